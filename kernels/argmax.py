"""Greedy decoding's argmax over the vocabulary, in two small kernels.

Semantics are ``torch.argmax(logits, dim=-1)`` (the first maximal index of each row) plus a flag per row that
holds a NaN, which ``runtime.sampling.sample`` turns into its invalid-token marker (torch's argmax picks a NaN
there, which ``sample`` then finds by a gather). For ``logits`` [num_seqs, vocab] in any float dtype.

A vocabulary of at most ``_BLOCK`` entries (a small model's) takes one program per row and one launch.

Why a kernel: at batch 1 on an H100 torch's argmax over a 128,256-entry row ran as one reduction of 27.8 us
(``builder.bench.profile_step``, Llama-3-8B shape), 1% of a decode step, plus the gather and the NaN check as
their own launches. Here each program reduces ``_BLOCK`` entries of one row to (max, first index of it, has NaN),
and one program per row reduces those partials, lowest chunk first: deterministic, and the same index as torch's
for every row without NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096  # entries per program of the first pass (16 KB of fp32)
_INT32_MAX = 2**31 - 1
_INT_MAX = tl.constexpr(_INT32_MAX)  # a global the kernels read must be a constexpr


@triton.jit
def _block_argmax(logits_ptr, row, offs, vocab, stride):
    """Over row ``row``'s entries ``offs`` (those < vocab): (the maximum, its first index, 1 if a NaN is among them)."""
    inside = offs < vocab
    x = tl.load(logits_ptr + row.to(tl.int64) * stride + offs, mask=inside, other=float("-inf")).to(tl.float32)
    is_nan = x != x
    x = tl.where(is_nan, float("-inf"), x)
    m = tl.max(x, 0)
    # the first index at the maximum (a row of -inf everywhere: its first index, as torch's)
    first = tl.min(tl.where((x == m) & inside, offs, _INT_MAX), 0)
    return m, first, tl.max(is_nan.to(tl.int32), 0)


@triton.jit
def _chunk_argmax_kernel(logits_ptr, val_ptr, idx_ptr, nan_ptr, vocab, stride, num_chunks, BLOCK: tl.constexpr):
    # grid (num_seqs, num_chunks): this chunk's maximum, its first index, and whether the chunk holds a NaN
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    m, first, nan = _block_argmax(logits_ptr, row, chunk * BLOCK + tl.arange(0, BLOCK), vocab, stride)
    out = row * num_chunks + chunk
    tl.store(val_ptr + out, m)
    tl.store(idx_ptr + out, first)
    tl.store(nan_ptr + out, nan)


@triton.jit
def _row_argmax_kernel(val_ptr, idx_ptr, nan_ptr, out_ptr, num_chunks, invalid, CHUNKS_PAD: tl.constexpr):
    # grid (num_seqs,): the chunks' maxima reduced, the lowest index among the equal ones; a NaN anywhere: invalid
    row = tl.program_id(0)
    offs = tl.arange(0, CHUNKS_PAD)
    inside = offs < num_chunks
    v = tl.load(val_ptr + row * num_chunks + offs, mask=inside, other=float("-inf"))
    i = tl.load(idx_ptr + row * num_chunks + offs, mask=inside, other=_INT_MAX)
    nan = tl.max(tl.load(nan_ptr + row * num_chunks + offs, mask=inside, other=0), 0)
    m = tl.max(v, 0)
    best = tl.min(tl.where(v == m, i, _INT_MAX), 0)
    tl.store(out_ptr + row, tl.where(nan != 0, invalid, best).to(tl.int64))


@triton.jit
def _one_chunk_argmax_kernel(logits_ptr, out_ptr, vocab, stride, invalid, BLOCK: tl.constexpr):
    # grid (num_seqs,), a vocabulary of at most BLOCK entries: each row's first maximal index, or invalid for a NaN
    row = tl.program_id(0)
    _, first, nan = _block_argmax(logits_ptr, row, tl.arange(0, BLOCK), vocab, stride)
    tl.store(out_ptr + row, tl.where(nan != 0, invalid, first).to(tl.int64))


def greedy_argmax(logits: torch.Tensor, invalid: int) -> torch.Tensor:
    """[num_seqs] int64: each row's first maximal index, or ``invalid`` for a row holding a NaN. ``logits``:
    [num_seqs, vocab] on CUDA (or under TRITON_INTERPRET=1), any float dtype, rows may be strided."""
    if logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError(f"greedy_argmax takes float logits [num_seqs, vocab], got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    num_seqs, vocab = logits.shape
    if vocab >= _INT32_MAX:
        raise ValueError(f"a vocabulary of {vocab} entries is past int32 indices")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(num_seqs, dtype=torch.int64, device=logits.device)
    if num_seqs == 0:
        return out
    num_chunks = triton.cdiv(vocab, _BLOCK)
    if num_chunks == 1:  # a small vocabulary: one launch, no partials (the step's host time is a small model's cost)
        _one_chunk_argmax_kernel[(num_seqs,)](logits, out, vocab, logits.stride(0), invalid,
                                              BLOCK=max(triton.next_power_of_2(vocab), 16), num_warps=8)
        return out
    vals = torch.empty((num_seqs, num_chunks), dtype=torch.float32, device=logits.device)
    idxs = torch.empty((num_seqs, num_chunks), dtype=torch.int32, device=logits.device)
    nans = torch.empty((num_seqs, num_chunks), dtype=torch.int32, device=logits.device)
    _chunk_argmax_kernel[(num_seqs, num_chunks)](logits, vals, idxs, nans, vocab, logits.stride(0), num_chunks,
                                                 BLOCK=_BLOCK, num_warps=8)
    _row_argmax_kernel[(num_seqs,)](vals, idxs, nans, out, num_chunks, invalid,
                                    CHUNKS_PAD=max(triton.next_power_of_2(num_chunks), 2), num_warps=1)
    return out


def ref_greedy_argmax(logits: torch.Tensor, invalid: int) -> torch.Tensor:
    """The torch reference: ``torch.argmax`` with the rows holding a NaN at ``invalid``."""
    out = torch.argmax(logits.float(), dim=-1)
    return out.masked_fill(torch.isnan(logits).any(dim=-1), invalid)
