"""Rotary position embedding, in place, with cos/sin computed in the kernel from the positions.

Semantics are ``kernels/torch_ops.rope_tables`` + ``kernels/torch_ops.rope`` (the reference), rotate-half layout:

    angle[t, i] = fp32(positions[t]) * inv_freq[i]                  i < rotary_dim / 2
    (two tables, LongRoPE: inv_freq [2, rotary_dim / 2] and long_from; a position p >= long_from stands for position
    p - long_from on the second table: the caller offsets the positions of a sequence the second table rotates)
    cos, sin    = to_dtype(cos(angle) * attention_scaling), to_dtype(sin(angle) * attention_scaling)
    x[t, h, :half], x[t, h, half:rotary_dim] = x1 * cos - x2 * sin,  x2 * cos + x1 * sin     half = rotary_dim / 2

rotary_dim is head_dim unless the model rotates part of each head (StableLM, Phi-2, GPT-NeoX): features
[rotary_dim, head_dim) pass through. The interleaved (GPT-J) layout pairs neighbours instead, x1 = x[0::2] and
x2 = x[1::2] of the first rotary_dim features (Cohere).

No tables are materialised. The angle is reduced to [-pi, pi] (Cody-Waite, 2*pi split in three) before
``tl.cos`` / ``tl.sin``, so accuracy does not depend on how the backend handles large arguments
(positions in the thousands give angles in the thousands of radians).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels import torch_ops as ops
from kernels.pdl import pdl_args, wait_prior

_INV_TWO_PI = tl.constexpr(0.15915493667125702)
# 2*pi = _TWO_PI_HI + _TWO_PI_MID + _TWO_PI_LO; HI and MID have 9 significant bits, so k * HI and
# k * MID are exact in fp32 for k < 2**15 (angles below ~2e5 rad).
_TWO_PI_HI = tl.constexpr(6.28125)
_TWO_PI_MID = tl.constexpr(0.001934051513671875)
_TWO_PI_LO = tl.constexpr(1.2556658930407139e-06)


@triton.jit
def cos_sin(pos, inv_freq_ptr, offs_d, mask_d, scaling, long_from, NUM_FREQS: tl.constexpr, dtype: tl.constexpr):
    """cos, sin [1, BLOCK_D] (fp32 values of ``dtype``: the reference's tables) of one position's angles. A position
    at or past ``long_from`` is position pos - long_from on the second table, NUM_FREQS entries on (LongRoPE; see
    ``rope_tables``)."""
    long = pos >= long_from
    table = inv_freq_ptr + tl.where(long, NUM_FREQS, 0)
    pos = tl.where(long, pos - long_from, pos)
    # angle: [BLOCK_D], >= 0 (positions and inverse frequencies are non-negative)
    angle = pos.to(tl.float32) * tl.load(table + offs_d, mask=mask_d, other=0.0)
    k = (angle * _INV_TWO_PI + 0.5).to(tl.int32).to(tl.float32)  # round to nearest (angle >= 0)
    r = ((angle - k * _TWO_PI_HI) - k * _TWO_PI_MID) - k * _TWO_PI_LO
    cos = (tl.cos(r) * scaling).to(dtype).to(tl.float32)[None, :]
    sin = (tl.sin(r) * scaling).to(dtype).to(tl.float32)[None, :]
    return cos, sin


@triton.jit
def rotate(ptrs, mask, cos, sin, HALF: tl.constexpr):
    """The rotated pairs (fp32) whose first features ``ptrs`` [BLOCK_H, BLOCK_D] point at, their partners ``HALF``
    features further (a head's halves; 1 for the interleaved layout)."""
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    # explicit fmas: the compiler has no contraction left to choose, so every kernel that rotates (this one, the
    # decode attention's, kernels.paged_attention._rotate_rows) gives the same bits
    return tl.fma(x1, cos, -(x2 * sin)), tl.fma(x2, cos, x1 * sin)


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, inv_freq_ptr, stride_xt, num_heads, scaling, long_from,
                 HEAD_DIM: tl.constexpr, HALF: tl.constexpr, STEP: tl.constexpr, PAIR: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    # HALF: the frequencies (rotary_dim / 2). Pair i is features (STEP * i, STEP * i + PAIR): (i, HALF + i)
    # rotate-half (STEP 1, PAIR HALF), (2i, 2i + 1) interleaved (STEP 2, PAIR 1)
    wait_prior(PDL)  # before reading what the previous kernel wrote (kernels/pdl.py)
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HALF
    mask = (offs_h < num_heads)[:, None] & mask_d[None, :]
    dtype = x_ptr.dtype.element_ty
    cos, sin = cos_sin(tl.load(pos_ptr + t), inv_freq_ptr, offs_d, mask_d, scaling, long_from, HALF, dtype)
    ptrs = x_ptr + t * stride_xt + offs_h[:, None] * HEAD_DIM + STEP * offs_d[None, :]  # each pair's first
    y1, y2 = rotate(ptrs, mask, cos, sin, PAIR)
    tl.store(ptrs, y1.to(dtype), mask=mask)
    tl.store(ptrs + PAIR, y2.to(dtype), mask=mask)


def apply_rope_(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, num_heads: int,
                head_dim: int, attention_scaling: float = 1.0, rotary_dim: int | None = None,
                interleaved: bool = False, long_from: int | None = None) -> torch.Tensor:
    """Rotate ``x`` [num_tokens, num_heads * head_dim] in place (rows may be strided); returns ``x``.

    positions: [num_tokens] integer; inv_freq: [rotary_dim / 2] fp32, or [2, rotary_dim / 2] with ``long_from`` (two
    tables, LongRoPE: a position p >= long_from is p - long_from on the second). ``rotary_dim`` (default head_dim):
    the leading features of each head that rotate, the rest pass through; ``interleaved``: neighbouring features pair
    up (GPT-J) instead of the two halves.
    """
    if not (x.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"):
        raise RuntimeError("apply_rope_ runs on CUDA tensors (or under TRITON_INTERPRET=1); use kernels.torch_ops on the CPU")
    if head_dim % 2 or x.dim() != 2 or x.shape[1] != num_heads * head_dim:
        raise ValueError(f"x {tuple(x.shape)} is not [num_tokens, num_heads * head_dim] = [*, {num_heads} * "
                         f"{head_dim}] with an even head_dim")
    rot = head_dim if rotary_dim is None else rotary_dim
    if rot % 2 or not 0 < rot <= head_dim:
        raise ValueError(f"rotary_dim {rotary_dim} is not an even number of features in (0, head_dim {head_dim}]")
    if x.stride(1) != 1:
        raise ValueError("apply_rope_ writes in place and needs x's features contiguous (x.stride(1) == 1)")
    if tuple(positions.shape) != (x.shape[0],):
        raise ValueError(f"positions {tuple(positions.shape)} do not match {x.shape[0]} tokens")
    table, long_from = rope_table(inv_freq, long_from, rot)
    num_tokens = x.shape[0]
    if num_tokens == 0:
        return x
    half = rot // 2
    block_d = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(num_heads), max(4096 // block_d, 1))
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _rope_kernel[grid](x, positions, table, x.stride(0), num_heads, float(attention_scaling), long_from,
                       HEAD_DIM=head_dim, HALF=half, STEP=2 if interleaved else 1, PAIR=1 if interleaved else half,
                       BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4, **pdl_args(x))
    return x


def rope_table(inv_freq: torch.Tensor, long_from: int | None, rotary_dim: int) -> tuple[torch.Tensor, int]:
    """The kernels' (flat fp32 frequency table, the offset of positions on its second table) for ``inv_freq``
    [rotary_dim / 2] (one table: no position reaches the offset) or [2, rotary_dim / 2] with ``long_from`` >= 0
    (LongRoPE)."""
    half = rotary_dim // 2
    if tuple(inv_freq.shape) == (half,) and long_from is None:
        return inv_freq.float().contiguous(), NO_LONG_TABLE
    if tuple(inv_freq.shape) == (2, half) and long_from is not None and long_from >= 0:
        return inv_freq.float().contiguous().view(-1), int(long_from)
    raise ValueError(f"inv_freq {tuple(inv_freq.shape)} with long_from {long_from} does not match rotary_dim "
                     f"{rotary_dim}: expected [{half}] frequencies, or [2, {half}] (two tables) with long_from >= 0")


NO_LONG_TABLE = 1 << 30  # long_from with one table: past any position


def ref_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, num_heads: int, head_dim: int,
             attention_scaling: float = 1.0, rotary_dim: int | None = None, interleaved: bool = False,
             long_from: int | None = None) -> torch.Tensor:
    """Reference (out of place): the runtime's tables and rotation."""
    cos, sin = ops.rope_tables(positions, inv_freq.float(), attention_scaling, x.dtype, interleaved, long_from)
    return ops.rope(x, cos, sin, num_heads, head_dim, rotary_dim, interleaved)
