"""Structured output's token mask applied to the logits in one kernel.

Semantics are ``runtime.sampling.apply_token_bitmask`` (the reference, torch ops): for ``logits`` [num_seqs, vocab]
and an int32 ``bitmask`` [num_masked, ceil(vocab / 32)] (token t allowed when bit t % 32 of word t // 32 is set,
llguidance's layout), a new tensor where the masked rows hold -inf at every forbidden token and the rest is a copy.
``rows`` names the masked rows of ``logits`` (row ``rows[j]`` takes ``bitmask[j]``); None: every row, in order.

The reference unpacks the bitmask into a bool tensor and fills it: five device ops, each a launch from the host,
and on a decode step of a small model the host is what bounds the step. This is one launch: each program copies a
block of one row and masks it from the words it needs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 2048


@triton.jit
def _masked_logits_kernel(logits_ptr, bitmask_ptr, row_map_ptr, out_ptr, vocab, stride_logits, stride_out,
                          num_words, ALL_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < vocab
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_logits + offs, mask=inside)
    if ALL_ROWS:
        mask_row = row
    else:
        mask_row = tl.load(row_map_ptr + row)  # -1: not masked
    if mask_row >= 0:
        words = tl.load(bitmask_ptr + mask_row.to(tl.int64) * num_words + offs // 32, mask=inside, other=0)
        allowed = ((words >> (offs % 32)) & 1) != 0
        x = tl.where(allowed, x, float("-inf"))
    tl.store(out_ptr + row.to(tl.int64) * stride_out + offs, x, mask=inside)


def masked_logits(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
    """``logits`` with the forbidden tokens of the masked rows at -inf, as a new tensor (see the module docstring).
    ``logits`` fp32/fp16/bf16 [num_seqs, vocab] (rows may be strided), ``bitmask`` int32 on the same device."""
    num_seqs, vocab = logits.shape
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"a bitmask must be int32 [rows, >= {(vocab + 31) // 32}] for a vocabulary of {vocab}; got "
                         f"{bitmask.dtype} {tuple(bitmask.shape)}")
    all_rows = rows is None or rows == list(range(num_seqs))
    if bitmask.shape[0] != (num_seqs if all_rows else len(rows)):
        raise ValueError(f"{bitmask.shape[0]} bitmask rows for {num_seqs if all_rows else len(rows)} masked rows")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    bitmask = bitmask.contiguous()
    out = torch.empty((num_seqs, vocab), dtype=logits.dtype, device=logits.device)
    if num_seqs == 0:
        return out
    row_map = bitmask  # unused with ALL_ROWS
    if not all_rows:
        index = [-1] * num_seqs
        for j, r in enumerate(rows):
            index[r] = j
        row_map = torch.tensor(index, dtype=torch.int32)
        if logits.is_cuda:  # through pinned memory: a copy from pageable memory may wait for the stream
            row_map = row_map.pin_memory()
        row_map = row_map.to(logits.device, non_blocking=True)
    grid = (num_seqs, triton.cdiv(vocab, _BLOCK))
    _masked_logits_kernel[grid](logits, bitmask, row_map, out, vocab, logits.stride(0), out.stride(0),
                                bitmask.shape[1], ALL_ROWS=all_rows, BLOCK=_BLOCK, num_warps=4)
    return out
