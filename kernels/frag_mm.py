"""A tensor-core GEMM on the "frag" weight layout (``kernels.w4a16_frag``) for many rows of x: prefill chunks and
decode batches past the GEMV's rows.

``y = x @ ((q - zero) * scale).T + bias`` for bf16 / fp16 x on :func:`kernels.w4a16_frag.repack_frag`'s 4-bit
(groups of 128 or one per channel) or 8-bit (one group per channel) weights, read as stored: no dequantized copy of
the weight is written (the runtime's path before it dequantized the whole weight into a bf16 temporary for cuBLAS at
every call: a write and a re-read of 4x the packed bytes, 8 bits 2x).

How it differs from ``w4a16_frag.frag_gemm`` (the first GEMM on this layout, which stays for comparison):
- **One running accumulator.** Each weight is dequantized in registers to x's dtype, ``((q - z) * s)`` rounded once
  from fp32 (4 bits in groups; what ``dequantize_frag`` + cuBLAS computed), or ``q - z`` exactly (per-channel
  codes, -255 .. 255, exact in bf16) with the scale applied once after the loop. So every K step is
  ``acc = tl.dot(x, w, acc)``: the MMAs of successive steps chain on one accumulator (wgmma's asynchronous form on
  Hopper) instead of each group's sums being waited on, scaled and added (frag_gemm's per-group epilogue).
- **The weights as the MMA's register operand, formed where they are loaded** (``mma_order``, the runtime's
  4-bit default): the frag layout already stores each lane's codes for one A fragment in one 32-bit word, so
  :func:`_dequant_mma` forms the [features, 128] tile in the MMA's own order (rows natural, columns MMA-order
  positions) from the words by ``tl.join`` (new dimensions are a thread's registers), ``tl.permute`` and
  ``tl.reshape``, and the weights are the first operand (``swap``: y.T = w @ x.T, wgmma's register-A form, no
  shared-memory round trip); x is permuted once per call into ``mma_order``. Each nibble is ORed in place into the
  mantissa of 2^23 (:func:`_nibbles`): no shifts, no int-to-float conversions. ``packed`` (sm_90 with bf16 x, the
  runtime's default there: 7-17% less time per call on the H200) does the same in bf16x2 arithmetic by inline PTX.
- **The first version, kept for comparison** (``mma_order`` off): the nibbles at shifts 0, 8, 4, 12 of each
  half-word (four consecutive input features), rows in the order ``16 t + 2 g + h``, columns as :func:`x_order`, x
  read in that order (``X_GATHER``: column indices in the kernel) or permuted before the launch; the tile goes
  through shared memory as the MMA's second operand. 8-bit words already hold their features in natural order.

W4A8 (:func:`frag_mm_fp8`, the runtime's path for linears built with ``activation_quant: fp8``): the same words
against x quantized per token to e4m3, on the fp8 MMA (twice the bf16 rate on Hopper): ``q - z`` is exact in e4m3,
so the codes go to the MMA unrounded, formed in the fp8 fragment's order (:func:`fp8_order`), and each group's
fp32 sums are scaled once (section "W4A8" below).

Numerics: fp32 accumulation, one rounding of y; 4-bit groups round each dequantized weight to x's dtype once (as the
dequantize + cuBLAS path did; ``packed`` rounds the scale to bf16 first); per-channel codes are exact in the MMA.
Split-K (for shapes whose output tiles do not fill the SMs) writes fp32 partials that are added in split order:
deterministic. Under TRITON_INTERPRET the dots run in fp32 on the same values (the interpreter's bf16 dot is
unreliable), which the CPU tests check against ``dequantize_frag`` in fp32.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.w4a16_frag import (
    LAYOUT,
    _frag_weights,
    _gemm_finish,
    _gemm_partials,
    _gemm_plan,
    _gemm_rows,
    _word_ptrs,
    mma_order,
)
from kernels.w4a16_gemm import _check_device, _interpreting

PROGRAMS_PER_SM = 1  # auto split-K: split until the grid holds about this many programs per SM
# The runtime runs frag_mm for 4-bit frag linears of more than w4a16_frag.FRAG_RUNTIME_MAX_ROWS rows on weights of
# at least MM_MIN_WEIGHTS: up to MM_RUNTIME_MAX_ROWS rows on wide ones (at least MM_WIDE output features), up to 128
# on the others (KERNELS_FRAG_MM_MAX_ROWS; 0: never). That is where it beat both paths before it (frag_gemm at 65-128
# rows, the weight dequantized for cuBLAS) on the H200 (docs/BENCHMARKS.md, session 50; 8B shape): gate_up 109 us at
# 128 rows (frag_gemm 168, dequantized 156) and 152 at 256 (dequantized 178), down 80 at 128 (98, 85; but 122 vs 93
# at 256), not the 8B shape's qkv / o_proj (under 2^25 weights: the dequantization is cheaper there) nor
# prefill-sized steps (cuBLAS's bf16 GEMM runs at ~2x its MMA rate). Not measured: larger models' qkv / o_proj (70B:
# over 2^25 weights, so up to 128 rows here), the lm_head, GPUs before sm_90. 8-bit codes: MM_BITS8 below.
MM_RUNTIME_MAX_ROWS = int(os.environ.get("KERNELS_FRAG_MM_MAX_ROWS", "256"))
# KERNELS_FRAG_MM_MIN_WEIGHTS (A/B runs): another floor, e.g. 0 to route the 8B shape's qkv and o_proj here too
_MIN_WEIGHTS = os.environ.get("KERNELS_FRAG_MM_MIN_WEIGHTS", str(1 << 25))
if not _MIN_WEIGHTS.isdigit():
    raise ValueError(f"KERNELS_FRAG_MM_MIN_WEIGHTS={_MIN_WEIGHTS!r} is not a whole number of weights "
                     "(default 33554432)")
MM_MIN_WEIGHTS = int(_MIN_WEIGHTS)
MM_WIDE = 16384
# The runtime's 4-bit configurations take MmConfig.packed (the dequantization in bf16x2 arithmetic; sm_90, bf16 x):
# 7-17% less time at every 8B shape and tiling swept at 128 and 256 rows on the H200 (session 53: gate_up at 128 rows
# 108.8 -> 96.1 us, down 80.0 -> 69.5). KERNELS_FRAG_MM_PACKED=0 restores the fp32 dequantization (A/B runs).
MM_PACKED = os.environ.get("KERNELS_FRAG_MM_PACKED", "1") != "0"
# 8-bit codes (int8 weight-only) take the same rule: in the MMA's order they beat the dequantized weight on cuBLAS for
# the 8B shape's gate_up at 65-256 rows (85.1 / 88.1 / 148.0 us against 172.8 / 175.9 / 196.5) and down at 65-128
# (70.2 / 76.3 against 90.7 / 94.5), not qkv (H200, session 53). KERNELS_FRAG_MM_BITS8=0: the paths before (A/B runs).
MM_BITS8 = os.environ.get("KERNELS_FRAG_MM_BITS8", "1") != "0"


def preferred(num_rows: int, out_features: int, in_features: int, bits: int = 4) -> bool:
    """Whether the runtime runs :func:`frag_mm` for a frag linear of this shape past the GEMV's rows (shapes only)."""
    limit = MM_RUNTIME_MAX_ROWS if out_features >= MM_WIDE else min(MM_RUNTIME_MAX_ROWS, 128)
    return ((bits == 4 or (bits == 8 and MM_BITS8)) and num_rows <= limit
            and out_features * in_features >= MM_MIN_WEIGHTS)


@dataclass(frozen=True)
class MmConfig:
    """One launch configuration of :func:`frag_mm`."""

    block_m: int = 128  # rows of x per program
    tiles_n: int = 8  # 16-feature tiles per program (block_n = 16 tiles_n; halved until it divides N / 16)
    num_warps: int = 8
    num_stages: int = 3
    split_k: int = 0  # programs sharing one output tile's K range; 0: enough programs for PROGRAMS_PER_SM
    swap: bool = False  # the weights as the MMA's first operand (y.T = w @ x.T), x as the second
    x_gather: bool = False  # x read in the codes' order by column indices in the kernel, not permuted before
    mma_order: bool = False  # the code tile in the MMA's order (_dequant_mma / _dequant_mma8; x read in mma_order)
    # with mma_order, 4 bits, bf16 x on sm_90+: the dequantization in bf16x2 arithmetic (_PACKED_ASM; sub / mul
    # .bf16x2 are sm_90 PTX: ignored below it); frag_mm_fp8: the e4m3 codes by inline PTX (_E4M3_ASM)
    packed: bool = False
    # frag_mm_fp8: two K iterations a loop step, both MMAs issued before either's sums are used (the second tile's
    # codes formed while the first MMA runs), at the cost of a second fp32 tile of sums
    pair: bool = False


def default_config(num_rows: int, out_features: int, bits: int = 4,
                   capability: tuple[int, int] = (9, 0)) -> MmConfig:
    """The H200 sweeps' best (``python -m kernels.bench.gemm --frag-mm [--bits 8]``, sessions 50 and 53), the code
    tile in the MMA's order as its register operand. 4 bits: past 128 rows on wide weights 128 features x 256 rows on
    8 warps, else 64 features x 128 rows on 4 warps. 8 bits: the same past 128 rows on wide weights, 128 features x
    128 rows on 8 warps up to 128 rows on them, 64 x 128 on 4 warps on the others. Below sm_90 the 256-row tile is not
    used: its three stages of x need ~181 KB of shared memory there (more than an A100's 163 KB, an sm_86/89's 99)."""
    wide = out_features >= MM_WIDE
    if num_rows > 128 and wide and tuple(capability) >= (9, 0):
        return MmConfig(block_m=256, tiles_n=8, num_warps=8, num_stages=3, swap=True, mma_order=True,
                        packed=MM_PACKED)
    if bits == 8 and wide:
        return MmConfig(block_m=128, tiles_n=8, num_warps=8, num_stages=3, swap=True, mma_order=True)
    return MmConfig(block_m=128, tiles_n=4, num_warps=4, num_stages=3, swap=True, mma_order=True, packed=MM_PACKED)


@functools.cache
def x_order(bits: int) -> tuple[int, ...]:
    """Entry ``c`` is the input feature (within one K iteration: 128 features for 4 bits, 64 for 8) of column ``c``
    of the kernel's unpacked code tile. 4 bits: column ``64 chunk + 16 c + 4 j + v`` (word ``(chunk, c, j)`` of
    ``_word_ptrs``, nibble ``v`` at shift ``8 (v % 2) + 4 (v // 2)`` of its half-word) holds MMA-order position
    ``64 chunk + 16 j + 8 (v // 2) + 2 c + v % 2`` (module docstring of ``kernels.w4a16_frag``), that is feature
    ``64 chunk + 32 (j // 2) + 8 c + 4 (j % 2) + v``. 8 bits: the natural order."""
    if bits == 8:
        return tuple(range(64))
    order = []
    for col in range(128):
        chunk, c, j, v = col // 64, (col // 16) % 4, (col // 4) % 4, col % 4
        order.append(64 * chunk + 32 * (j // 2) + 8 * c + 4 * (j % 2) + v)
    return tuple(order)


@triton.jit
def _codes(words, TILES: tl.constexpr, BITS: tl.constexpr):
    """One K iteration's words (``_word_ptrs``: [(t, g), (chunk, c, j)]) -> int32 codes [16 TILES, IT_K]: row
    ``16 t + 2 g + h`` (feature ``16 t + 8 h + g``), column as :func:`x_order`; a reshape of the shifted words."""
    hh = tl.arange(0, 2)[:, None]
    if BITS == 4:
        vv = tl.arange(0, 4)[None, :]
        shifts = 16 * hh + 8 * (vv % 2) + 4 * (vv // 2)  # [h, v]
        q = (words[:, None, :, None] >> shifts[None, :, None, :]) & 0xF  # [(t, g), h, (chunk, c, j), v]
        return tl.reshape(q, (16 * TILES, 128))
    else:
        shifts = 16 * hh + 8 * tl.arange(0, 2)[None, :]  # [h, e]
        q = (words[:, None, :, None] >> shifts[None, :, None, :]) & 0xFF  # [(t, g), h, (chunk, c, s, half), e]
        return tl.reshape(q, (16 * TILES, 64))


@triton.jit
def _nibbles(x, z, s, SH: tl.constexpr):
    """``(q - z) * s`` in fp32 for the nibble at bits SH .. SH + 3 of each (half-)word ``x`` (rows' zero points ``z``
    and scales ``s``): the nibble is ORed in place into the mantissa of 2^23 (``2^23 + q 2^SH``, exact for SH <= 12),
    less ``2^23 + z 2^SH`` (exact), times ``s 2^-SH`` (exact while s 2^-SH is a normal float, |s| >= 2^-114): one
    rounding, as the fp32 reference; no shift, no
    int -> float conversion."""
    v = ((x & (0xF << SH)) | 0x4B000000).to(tl.float32, bitcast=True)
    return (v - (8388608.0 + z * (1 << SH))[:, None]) * (s * (1.0 / (1 << SH)))[:, None]


@triton.jit
def _mma_tile4(q, TILES: tl.constexpr):
    """A 4-bit iteration's eight joined values per word, [(t, g), (chunk, c, j), e, half, h] (each join's dimension
    last), as the [16 TILES, 128] tile in the MMA's order: rows 16 t + 8 h + g, columns 64 chunk + 16 j + 8 half +
    2 c + e. A reshape and a permutation: no value leaves its thread."""
    q = tl.reshape(q, (TILES, 8, 2, 4, 4, 2, 2, 2))  # t, g, chunk, c, j, e, half, h
    q = tl.permute(q, (0, 7, 1, 2, 4, 6, 3, 5))  # t, h, g, chunk, j, half, c, e
    return tl.reshape(q, (16 * TILES, 128))


@triton.jit
def _dequant_mma(words, z_lo, z_hi, s_lo, s_hi, TILES: tl.constexpr):
    """4-bit words (``_word_ptrs``: [(t, g), (chunk, c, j)]) -> the dequantized weights, fp32 [16 TILES, 128], in
    the MMA's own order: row ``16 t + 8 h + g`` (natural; ``z_lo`` / ``s_lo`` are rows ``16 t + g``, ``z_hi`` /
    ``s_hi`` rows ``16 t + 8 + g``), column the MMA-order position ``64 chunk + 16 j + 8 half + 2 c + e`` (x read in
    ``mma_order``). Nibble (h, half, e) of a word is at shift ``16 h + 8 e + 4 half``. Built by joins, whose new
    dimensions are a thread's own registers, and a permutation: each lane's word already holds the eight values
    the MMA's A fragment takes from it, so the tile is formed where the word was loaded."""
    hi = words >> 16
    q = tl.join(tl.join(tl.join(_nibbles(words, z_lo, s_lo, 0), _nibbles(words, z_lo, s_lo, 8)),
                        tl.join(_nibbles(words, z_lo, s_lo, 4), _nibbles(words, z_lo, s_lo, 12))),
                tl.join(tl.join(_nibbles(hi, z_hi, s_hi, 0), _nibbles(hi, z_hi, s_hi, 8)),
                        tl.join(_nibbles(hi, z_hi, s_hi, 4), _nibbles(hi, z_hi, s_hi, 12))))
    return _mma_tile4(q, TILES)


# One word -> its eight weights as four bf16x2 registers (A-fragment pairs: features e = 0, 1 of one row):
# bytes 0, 1 (h = 0) and 2, 3 (h = 1) spread to the two halves of a register by one byte permute each, the two
# nibbles of a pair masked in place and ORed into the mantissa of bf16 128.0 (0x4300 | q = 128 + q, exact), then
# less 128 + z (exact) and times the scale, two weights per instruction.
_PACKED_ASM = tl.constexpr("""{
.reg .b32 t0, t1, u0, u1, p0, p1, p2, p3;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
shr.b32 u0, t0, 4;
shr.b32 u1, t1, 4;
lop3.b32 p0, t0, 0x000F000F, 0x43004300, 0xea;
lop3.b32 p1, u0, 0x000F000F, 0x43004300, 0xea;
lop3.b32 p2, t1, 0x000F000F, 0x43004300, 0xea;
lop3.b32 p3, u1, 0x000F000F, 0x43004300, 0xea;
sub.rn.bf16x2 p0, p0, $6;
sub.rn.bf16x2 p1, p1, $6;
sub.rn.bf16x2 p2, p2, $8;
sub.rn.bf16x2 p3, p3, $8;
mul.rn.bf16x2 $0, p0, $7;
mul.rn.bf16x2 $1, p1, $7;
mul.rn.bf16x2 $2, p2, $9;
mul.rn.bf16x2 $3, p3, $9;
}""")


@triton.jit
def _bytes(x, z, s, SH: tl.constexpr):
    """:func:`_nibbles` for the byte at bits SH .. SH + 7 (SH <= 8): ``2^23 + q 2^SH`` less ``2^23 + z 2^SH``, times
    ``s 2^-SH`` (per-channel codes: s is 1, the scale comes after the loop)."""
    v = ((x & (0xFF << SH)) | 0x4B000000).to(tl.float32, bitcast=True)
    return (v - (8388608.0 + z * (1 << SH))[:, None]) * (s * (1.0 / (1 << SH)))[:, None]


@triton.jit
def _dequant_mma8(words, z_lo, z_hi, s_lo, s_hi, TILES: tl.constexpr):
    """8-bit words (``_word_ptrs``: [(t, g), (chunk, c, s, half)]) -> fp32 [16 TILES, 64] in the MMA's order: row
    ``16 t + 8 h + g``, column the MMA-order position ``32 chunk + 16 s + 8 half + 2 c + e`` (x read in
    ``mma_order(64)``). Byte (h, e) of a word is at shift ``16 h + 8 e`` (module docstring of kernels.w4a16_frag)."""
    hi = words >> 16
    q = tl.join(tl.join(_bytes(words, z_lo, s_lo, 0), _bytes(words, z_lo, s_lo, 8)),
                tl.join(_bytes(hi, z_hi, s_hi, 0), _bytes(hi, z_hi, s_hi, 8)))
    q = tl.reshape(q, (TILES, 8, 2, 4, 2, 2, 2, 2))  # t, g, chunk, c, s, half, e, h
    q = tl.permute(q, (0, 7, 1, 2, 4, 5, 3, 6))  # t, h, g, chunk, s, half, c, e
    return tl.reshape(q, (16 * TILES, 64))


@triton.jit
def _dequant_mma_packed(words, z_lo, z_hi, s_lo, s_hi, TILES: tl.constexpr):
    """:func:`_dequant_mma` in packed bf16 arithmetic (_PACKED_ASM; CUDA only): the same tile, as bf16, with the
    scale rounded to bf16 before its product (two roundings a weight instead of one)."""
    c_lo = tl.broadcast_to((z_lo + 128.0).to(tl.bfloat16)[:, None], words.shape)
    c_hi = tl.broadcast_to((z_hi + 128.0).to(tl.bfloat16)[:, None], words.shape)
    b_lo = tl.broadcast_to(s_lo.to(tl.bfloat16)[:, None], words.shape)
    b_hi = tl.broadcast_to(s_hi.to(tl.bfloat16)[:, None], words.shape)
    p0, p1, p2, p3 = tl.inline_asm_elementwise(
        _PACKED_ASM, "=r,=r,=r,=r,r,r,r,r,r,r",
        [tl.join(words, words), tl.join(c_lo, c_lo), tl.join(b_lo, b_lo), tl.join(c_hi, c_hi), tl.join(b_hi, b_hi)],
        dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16), is_pure=True, pack=2)
    q = tl.join(tl.join(p0, p1), tl.join(p2, p3))  # [(t, g), (chunk, c, j), e, half, h]
    return _mma_tile4(q, TILES)


@triton.jit
def _round_bf16(v):
    """fp32 -> the nearest bf16 (ties to even), as fp32: the interpreter's own cast truncates."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _store_rows(acc, y_ptr, part_ptr, bias_ptr, rows, row_ok, n, M, N, pid_k, stride_ym, SPLIT: tl.constexpr,
                HAS_BIAS: tl.constexpr):
    """A program's fp32 tile [rows, n]: plus the bias and rounded into y, or (SPLIT > 1) its K split's partials."""
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n).to(tl.float32)[None, :]
        y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        p_ptrs = part_ptr + (pid_k * M + rows.to(tl.int64))[:, None] * N + n[None, :]
        tl.store(p_ptrs, acc, mask=row_ok[:, None])


@triton.jit
def _frag_mm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, part_ptr, M, N, K, stride_xm, stride_ym,
                    iters_per_split, ONE_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                    TILES_N: tl.constexpr, SPLIT: tl.constexpr, BITS: tl.constexpr, SWAP: tl.constexpr,
                    X_GATHER: tl.constexpr, MMA_ORDER: tl.constexpr, PACKED: tl.constexpr, FP32_DOT: tl.constexpr,
                    X_BF16: tl.constexpr):
    # program (m, n, k): rows [BLOCK_M m, +BLOCK_M) x the features of tiles [TILES_N n, +TILES_N) over K iterations
    # [iters_per_split k, +iters_per_split); with SPLIT > 1 its fp32 sums go to part[k]
    BLOCK_N: tl.constexpr = 16 * TILES_N
    IT_K: tl.constexpr = 128 if BITS == 4 else 64
    G = K // IT_K
    pid_m = tl.program_id(0)  # fastest: the programs on one weight tile run together and share it through L2
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    w_ptrs = _word_ptrs(qw_ptr, pid_n * TILES_N, K, TILES_N, BITS)
    r = tl.arange(0, BLOCK_N)
    if MMA_ORDER:  # natural rows
        n = pid_n * BLOCK_N + r
    else:  # the tile's row 16 t + 2 g + h holds feature 16 t + 8 h + g
        n = pid_n * BLOCK_N + (r // 16) * 16 + (r % 2) * 8 + (r % 16) // 2
    c = tl.arange(0, IT_K)
    if X_GATHER and BITS == 4 and not MMA_ORDER:  # x_order, computed
        cols = (c // 64) * 64 + ((c // 4) % 4) // 2 * 32 + ((c // 16) % 4) * 8 + ((c // 4) % 2) * 4 + c % 4
    else:
        cols = c
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :]
    if MMA_ORDER:  # the words' rows (t, g): features 16 t + g (h = 0) and 16 t + 8 + g (h = 1)
        rw = tl.arange(0, 8 * TILES_N)
        n_lo = pid_n * BLOCK_N + (rw // 8) * 16 + rw % 8
        if ONE_GROUP:
            z_lo = tl.load(z_ptr + n_lo).to(tl.float32)
            z_hi = tl.load(z_ptr + n_lo + 8).to(tl.float32)
            s_lo = tl.full([8 * TILES_N], 1.0, tl.float32)
            s_hi = s_lo
    elif ONE_GROUP:  # codes as floats: 2^23 + q, exact; minus (2^23 + z), exact
        z1 = tl.load(z_ptr + n).to(tl.float32) + 8388608.0
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    it0 = pid_k * iters_per_split
    it1 = tl.minimum(it0 + iters_per_split, G)
    for it in range(it0, it1):
        if MMA_ORDER:
            if not ONE_GROUP:
                z_lo = tl.load(z_ptr + it * N + n_lo).to(tl.float32)
                z_hi = tl.load(z_ptr + it * N + n_lo + 8).to(tl.float32)
                s_lo = tl.load(s_ptr + it * N + n_lo)
                s_hi = tl.load(s_ptr + it * N + n_lo + 8)
            if PACKED:
                w = _dequant_mma_packed(tl.load(w_ptrs + it * 256), z_lo, z_hi, s_lo, s_hi, TILES_N)
            elif BITS == 8:
                w = _dequant_mma8(tl.load(w_ptrs + it * 256), z_lo, z_hi, s_lo, s_hi, TILES_N)
            else:
                w = _dequant_mma(tl.load(w_ptrs + it * 256), z_lo, z_hi, s_lo, s_hi, TILES_N)
        else:
            qf = (_codes(tl.load(w_ptrs + it * 256), TILES_N, BITS) | 0x4B000000).to(tl.float32, bitcast=True)
            if ONE_GROUP:  # 2^23 + q less 2^23 + z: exact small integers; the scale after the loop
                w = qf - z1[:, None]
            else:  # (q - z) exact, times the scale: one rounding, as the fp32 reference
                z = tl.load(z_ptr + it * N + n).to(tl.float32) + 8388608.0
                s = tl.load(s_ptr + it * N + n)
                w = (qf - z[:, None]) * s[:, None]
        x = tl.load(x_ptrs + it * IT_K, mask=row_ok[:, None], other=0.0)
        if FP32_DOT:  # the interpreter: the values x's dtype holds, dotted in fp32
            if X_BF16:
                w = _round_bf16(w)
            else:
                w = w.to(x_ptr.dtype.element_ty).to(tl.float32)
            x = x.to(tl.float32)
        else:
            w = w.to(x_ptr.dtype.element_ty)
        if SWAP:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if SWAP:
        acc = tl.trans(acc)
    if ONE_GROUP:
        acc = acc * tl.load(s_ptr + n)[None, :]
    _store_rows(acc, y_ptr, part_ptr, bias_ptr, rows, row_ok, n, M, N, pid_k, stride_ym, SPLIT, HAS_BIAS)


@functools.cache
def _order_tensor(bits: int, mma: bool, device: torch.device) -> torch.Tensor:
    """The code tile's column order per K iteration (``mma_order``, or 4 bits' :func:`x_order`) on ``device``, made
    once (a copy from the host cannot run inside a CUDA-graph capture)."""
    return mma_order(512 // bits).to(device) if mma else torch.tensor(x_order(4), device=device)


def _permuted_x(x2: torch.Tensor, bits: int, mma: bool) -> torch.Tensor:
    """x's columns in the kernel's code order, per K iteration: one gather before the launch (8-bit codes outside the
    MMA order are in natural order already)."""
    if bits == 8 and not mma:
        return x2
    m, k = x2.shape
    block = 512 // bits
    return x2.reshape(m, k // block, block).index_select(2, _order_tensor(bits, mma, x2.device)).reshape(m, k)


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    """The device's compute capability, asked once (frag_mm runs on every eager prefill step)."""
    return torch.cuda.get_device_capability(device_index)


def frag_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
            bias: torch.Tensor | None = None, *, bits: int = 4, layout: str = LAYOUT,
            config: MmConfig | None = None) -> torch.Tensor:
    """``x @ ((q - zero) * scale).T + bias`` for any number of rows of bf16/fp16 x on :func:`repack_frag`'s 4-bit or
    8-bit weights (module docstring). x: [..., K] -> y: [..., N] in x's dtype."""
    _check_device(x)
    w = _frag_weights(qweight, scales, zeros, group_size, bits, layout)
    x2 = _gemm_rows(x, bias, w, "frag_mm")
    m, n = x2.shape[0], w.out_features
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    capability = (0, 0) if _interpreting() else _capability(x.device.index if x.device.index is not None
                                                            else torch.cuda.current_device())
    cfg = config or (MmConfig(16, 2, 4, 1, 1) if _interpreting() else default_config(m, n, bits, capability))
    mma = cfg.mma_order
    x2 = x2 if cfg.x_gather and not mma else _permuted_x(x2, bits, mma)
    plan = _gemm_plan(m, w, cfg.block_m, cfg.tiles_n, cfg.split_k, PROGRAMS_PER_SM, x.device)
    part = _gemm_partials(plan, m, n, y)
    _frag_mm_kernel[plan.grid](
        x2, w.qweight, w.scales, w.zeros, bias if bias is not None else y, y, part, m, n, w.in_features,
        x2.stride(0), y.stride(0), plan.iters_per_split, ONE_GROUP=w.one_group, HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, TILES_N=plan.tiles_n, SPLIT=plan.grid[2], BITS=bits, SWAP=cfg.swap,
        X_GATHER=cfg.x_gather, MMA_ORDER=mma,
        PACKED=mma and bits == 4 and cfg.packed and x.dtype == torch.bfloat16 and capability >= (9, 0),
        FP32_DOT=_interpreting(), X_BF16=x.dtype == torch.bfloat16, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _gemm_finish(plan, part, bias, y)
    return y.reshape(*x.shape[:-1], n)


# --- W4A8: the same 4-bit codes against fp8 activations (Hopper's e4m3 MMA, twice the bf16 rate) ----------------
# y = xs * sum_g s_g * sum_{k in g} (q - z) xq, with xq / xs x's per-token e4m3 codes and fp32 scales (the dynamic
# per-token quantization of the W8A8 path, kernels.w8a8_gemm.quantize_rows): q - z (-15 .. 15) is exact in e4m3, so
# the codes go to the MMA unrounded; each group's exact fp32 sums are scaled by its s and added (one FMA per
# accumulator element per 128 input features). Numerics: those of x rounded per token to e4m3 (x's own rounding,
# the W4A8 scheme's), then the fp32 products and sums of W4A16 with the weights unrounded.
#
# The register operand's order: wgmma's 8-bit A fragment gives lane (g, c) rows g and g + 8 at k 4c .. 4c + 3 of each
# 16 (kWidth 4), where the bf16 MMA's gave it 2c, 2c + 1, 2c + 8, 2c + 9; a frag word holds exactly those four of
# each row, so the same words make the fp8 fragment once their nibbles are read in the other order (_tile_e4m3), and
# x's codes are written in that order (fp8_order) by the quantization.
W4A8_RUNTIME_MIN_ROWS = int(os.environ.get("KERNELS_W4A8_MIN_ROWS", "65"))
# past it the weight dequantized for cuBLAS's bf16 GEMM on the rounded x (H200, session 51: gate_up 245 us at 512
# rows against 239 for the dequantized path; cuBLAS pulls ahead at prefill sizes)
W4A8_RUNTIME_MAX_ROWS = int(os.environ.get("KERNELS_W4A8_MAX_ROWS", "512"))
# and only on weights of at least this many codes (KERNELS_W4A8_MIN_WEIGHTS; 2^25: gate_up and down of the 8B shape)
W4A8_MIN_WEIGHTS = int(os.environ.get("KERNELS_W4A8_MIN_WEIGHTS", "0"))


@functools.cache
def fp8_order() -> tuple[int, ...]:
    """Entry ``p`` is the input feature (of a K iteration's 128) at column ``p`` of :func:`_frag_mm_fp8_kernel`'s
    code tile: ``p = 64 chunk + 16 j + 4 c + 2 half + e`` takes nibble (half, e) of word (chunk, c, j), whose
    feature is ``mma_order(128)`` at the bf16 MMA position ``64 chunk + 16 j + 8 half + 2 c + e``."""
    mma = mma_order(128).tolist()
    order = []
    for p in range(128):
        chunk, j, c, half, e = p // 64, (p // 16) % 4, (p // 4) % 4, (p // 2) % 2, p % 2
        order.append(mma[64 * chunk + 16 * j + 8 * half + 2 * c + e])
    return tuple(order)


@triton.jit
def _code_minus_zero(x, z, SH: tl.constexpr):
    """``q - z`` in fp32, exact, for the nibble at bits SH .. SH + 3 of each (half-)word ``x``: ``2^23 + q 2^SH``
    (ORed in place) times 2^-SH, less ``2^(23 - SH) + z``: one FMA whose exact result is representable."""
    v = ((x & (0xF << SH)) | 0x4B000000).to(tl.float32, bitcast=True)
    return v * (1.0 / (1 << SH)) - ((8388608.0 / (1 << SH)) + z)[:, None]


@triton.jit
def _tile_e4m3(words, z_lo, z_hi, TILES: tl.constexpr):
    """4-bit words (``_word_ptrs``) -> ``q - z`` (fp32, exact) [16 TILES, 128] in the fp8 MMA's order: row
    ``16 t + 8 h + g``, column ``64 chunk + 16 j + 4 c + 2 half + e`` (:func:`fp8_order`) for nibble (h, half, e)
    of word (chunk, c, j) at shift ``16 h + 8 e + 4 half``. Joins and a permutation, as :func:`_dequant_mma`."""
    hi = words >> 16
    q = tl.join(tl.join(tl.join(_code_minus_zero(words, z_lo, 0), _code_minus_zero(words, z_lo, 8)),
                        tl.join(_code_minus_zero(words, z_lo, 4), _code_minus_zero(words, z_lo, 12))),
                tl.join(tl.join(_code_minus_zero(hi, z_hi, 0), _code_minus_zero(hi, z_hi, 8)),
                        tl.join(_code_minus_zero(hi, z_hi, 4), _code_minus_zero(hi, z_hi, 12))))
    q = tl.reshape(q, (TILES, 8, 2, 4, 4, 2, 2, 2))  # t, g, chunk, c, j, e, half, h
    q = tl.permute(q, (0, 7, 1, 2, 4, 3, 6, 5))  # t, h, g, chunk, j, c, half, e
    return tl.reshape(q, (16 * TILES, 128))


# One word -> its eight codes less their zero points as e4m3, in the two registers of wgmma's 8-bit A fragment that
# it feeds (rows g and g + 8, k 4c .. 4c + 3: bytes (half, e) = nibbles at shifts 8 e + 4 half): each pair of
# nibbles (h = 0, 1) at one shift is ORed into the mantissas of fp16 1024 (bits 0 .. 3) or of 1024 with the nibble
# times 16 (bits 4 .. 7; the shifts 8 and 12 after one shift of the word by 8), less 1024 + z or, times 1/16, less
# 64 + z: q - z exactly, two per instruction; then two per conversion to e4m3 (exact: |q - z| <= 15) and two byte
# permutes. $2 the word, $6 (1024 + z_lo, 1024 + z_hi) as fp16x2, $10 -(64 + z_lo, 64 + z_hi) (copies of each fill
# the rest of the four inputs a pack of four takes).
_E4M3_ASM = tl.constexpr("""{
.reg .b32 t, m0, m1, m2, m3, r16;
.reg .b16 e0, e1, e2, e3;
shr.b32 t, $2, 8;
lop3.b32 m0, $2, 0x000F000F, 0x64006400, 0xea;
lop3.b32 m1, $2, 0x00F000F0, 0x64006400, 0xea;
lop3.b32 m2, t, 0x000F000F, 0x64006400, 0xea;
lop3.b32 m3, t, 0x00F000F0, 0x64006400, 0xea;
mov.b32 r16, 0x2C002C00;
sub.rn.f16x2 m0, m0, $6;
fma.rn.f16x2 m1, m1, r16, $10;
sub.rn.f16x2 m2, m2, $6;
fma.rn.f16x2 m3, m3, r16, $10;
cvt.rn.satfinite.e4m3x2.f16x2 e0, m0;
cvt.rn.satfinite.e4m3x2.f16x2 e1, m1;
cvt.rn.satfinite.e4m3x2.f16x2 e2, m2;
cvt.rn.satfinite.e4m3x2.f16x2 e3, m3;
mov.b32 m0, {e0, e2};
mov.b32 m1, {e1, e3};
prmt.b32 $0, m0, m1, 0x6420;
prmt.b32 $1, m0, m1, 0x7531;
}""")


@triton.jit
def _tile_e4m3_asm(words, z_lo, z_hi, TILES: tl.constexpr):
    """:func:`_tile_e4m3` as e4m3 by inline PTX (_E4M3_ASM; CUDA sm_89+): the same values, in the same order."""
    zl = z_lo.to(tl.int32)[:, None]
    zh = z_hi.to(tl.int32)[:, None]
    c0 = tl.broadcast_to((0x6400 + zl) | ((0x6400 + zh) << 16), words.shape)
    c4 = tl.broadcast_to(((0x5400 + 16 * zl) | ((0x5400 + 16 * zh) << 16)) | -2147450880, words.shape)  # signs set
    w4 = tl.join(tl.join(words, words), tl.join(words, words))
    lo, hi = tl.inline_asm_elementwise(
        _E4M3_ASM, "=r,=r,r,r,r,r,r,r,r,r,r,r,r,r",
        [w4, tl.join(tl.join(c0, c0), tl.join(c0, c0)), tl.join(tl.join(c4, c4), tl.join(c4, c4))],
        dtype=(tl.float8e4nv, tl.float8e4nv), is_pure=True, pack=4)
    q = tl.join(lo, hi)  # [(t, g), (chunk, c, j), half, e, h]
    q = tl.reshape(q, (TILES, 8, 2, 4, 4, 2, 2, 2))  # t, g, chunk, c, j, half, e, h
    q = tl.permute(q, (0, 7, 1, 2, 4, 3, 5, 6))  # t, h, g, chunk, j, c, half, e
    return tl.reshape(q, (16 * TILES, 128))


@triton.jit
def _group_sums(w_ptrs, x_ptrs, z_ptr, it, N, n_lo, z_lo, z_hi, row_ok, end, ONE_GROUP: tl.constexpr,
                TILES_N: tl.constexpr, EMULATE: tl.constexpr, ASM: tl.constexpr, MASKED: tl.constexpr):
    """K iteration ``it``'s fp32 sums [features, rows] of (q - z) x (``MASKED`` and ``it >= end``: zeros, nothing
    read)."""
    if MASKED:  # end: the split's last iteration + 1; it < end as vectors (the interpreter takes no scalar mask)
        ok = (n_lo * 0 + it) < end
        if not ONE_GROUP:
            z_lo = tl.load(z_ptr + it * N + n_lo, mask=ok, other=0).to(tl.float32)
            z_hi = tl.load(z_ptr + it * N + n_lo + 8, mask=ok, other=0).to(tl.float32)
        x = tl.load(x_ptrs + it * 128, mask=(row_ok & ((row_ok.to(tl.int32) * 0 + it) < end))[:, None], other=0.0)
        words = tl.load(w_ptrs + it * 256, mask=ok[:, None], other=0)
    else:
        if not ONE_GROUP:
            z_lo = tl.load(z_ptr + it * N + n_lo).to(tl.float32)
            z_hi = tl.load(z_ptr + it * N + n_lo + 8).to(tl.float32)
        x = tl.load(x_ptrs + it * 128, mask=row_ok[:, None], other=0.0)
        words = tl.load(w_ptrs + it * 256)
    if EMULATE:  # the interpreter: the same exact values, dotted in fp32
        return tl.dot(_tile_e4m3(words, z_lo, z_hi, TILES_N), tl.trans(x.to(tl.float32)), input_precision="ieee")
    else:  # one group: 128 products summed by the MMA (promoted to fp32 once per group)
        if ASM:
            w = _tile_e4m3_asm(words, z_lo, z_hi, TILES_N)
        else:
            w = _tile_e4m3(words, z_lo, z_hi, TILES_N).to(tl.float8e4nv)
        return tl.dot(w, tl.trans(x), max_num_imprecise_acc=128)


@triton.jit
def _frag_mm_fp8_kernel(xq_ptr, xs_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, part_ptr, M, N, K, stride_xm,
                        stride_ym, iters_per_split, ONE_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK_M: tl.constexpr, TILES_N: tl.constexpr, SPLIT: tl.constexpr, EMULATE: tl.constexpr,
                        ASM: tl.constexpr, PAIR: tl.constexpr):
    # program (m, n, k) as _frag_mm_kernel's (swapped operands: acc is [features, rows]); xq: e4m3 codes [M, K] in
    # fp8_order per K iteration, xs: fp32 [M]. PAIR: two groups per loop step, both MMAs issued before either's
    # sums are scaled (the second group's codes are formed while the first's MMA runs)
    BLOCK_N: tl.constexpr = 16 * TILES_N
    G = K // 128
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    w_ptrs = _word_ptrs(qw_ptr, pid_n * TILES_N, K, TILES_N, 4)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rw = tl.arange(0, 8 * TILES_N)
    n_lo = pid_n * BLOCK_N + (rw // 8) * 16 + rw % 8  # the words' rows (t, g): features 16 t + g and 16 t + 8 + g
    x_ptrs = xq_ptr + rows.to(tl.int64)[:, None] * stride_xm + tl.arange(0, 128)[None, :]
    z_lo = tl.load(z_ptr + n_lo).to(tl.float32)  # one group: the zero points, once; else reloaded per group
    z_hi = tl.load(z_ptr + n_lo + 8).to(tl.float32)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    it0 = pid_k * iters_per_split
    it1 = tl.minimum(it0 + iters_per_split, G)
    STEP: tl.constexpr = 2 if PAIR else 1
    for it in range(it0, it1, STEP):
        part = _group_sums(w_ptrs, x_ptrs, z_ptr, it, N, n_lo, z_lo, z_hi, row_ok, it1, ONE_GROUP, TILES_N,
                           EMULATE, ASM, False)
        if PAIR:  # the second group may be past the split's end (an odd count): zeros
            part2 = _group_sums(w_ptrs, x_ptrs, z_ptr, it + 1, N, n_lo, z_lo, z_hi, row_ok, it1, ONE_GROUP, TILES_N,
                                EMULATE, ASM, True)
            if ONE_GROUP:
                acc += part + part2
            else:
                acc += part * tl.load(s_ptr + it * N + n)[:, None] \
                    + part2 * tl.load(s_ptr + (it + 1) * N + n, mask=(n * 0 + it + 1) < it1, other=0.0)[:, None]
        elif ONE_GROUP:
            acc += part
        else:
            acc += part * tl.load(s_ptr + it * N + n)[:, None]
    acc = tl.trans(acc) * tl.load(xs_ptr + rows, mask=row_ok, other=0.0)[:, None]
    if ONE_GROUP:
        acc = acc * tl.load(s_ptr + n)[None, :]
    _store_rows(acc, y_ptr, part_ptr, bias_ptr, rows, row_ok, n, M, N, pid_k, stride_ym, SPLIT, HAS_BIAS)


@functools.cache
def _fp8_order_tensor(device: torch.device) -> torch.Tensor:
    return torch.tensor(fp8_order(), device=device)


def quantize_rows_fp8_order(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 128) -> (e4m3 codes [M, K] with each K iteration's columns in :func:`fp8_order`,
    fp32 scales [M]): ``kernels.w8a8_gemm.quantize_rows``'s per-token codes (amax / 448; the reference's
    ``quantize_activation_fp8``), permuted for :func:`frag_mm_fp8`."""
    from kernels.w8a8_gemm import quantize_rows

    m, k = x.shape
    if k % 128:
        raise ValueError(f"quantize_rows_fp8_order: {k} input features is not a multiple of 128")
    xp = x.reshape(m, k // 128, 128).index_select(2, _fp8_order_tensor(x.device)).reshape(m, k)
    codes, scales = quantize_rows(xp, torch.float8_e4m3fn)
    return codes, scales.reshape(m)


def fp8_preferred(num_rows: int, x: torch.Tensor, out_features: int = 0, in_features: int = 0) -> bool:
    """Whether the runtime runs :func:`frag_mm_fp8` for a W4A8 linear's ``num_rows`` rows of ``x``: from
    W4A8_RUNTIME_MIN_ROWS rows (fewer: the W4A16 GEMV on x rounded to e4m3, bound by the weights' bytes) up to
    W4A8_RUNTIME_MAX_ROWS (more: the W4A16 paths on the rounded x), on weights of at least W4A8_MIN_WEIGHTS codes,
    on a GPU with e4m3 MMAs (sm_89+; under the interpreter, always)."""
    if not W4A8_RUNTIME_MIN_ROWS <= num_rows <= W4A8_RUNTIME_MAX_ROWS or x.dtype not in (torch.bfloat16,
                                                                                         torch.float16):
        return False
    if out_features * in_features < W4A8_MIN_WEIGHTS:
        return False
    if _interpreting():
        return True
    return x.is_cuda and _capability(x.device.index if x.device.index is not None
                                     else torch.cuda.current_device()) >= (8, 9)


def default_fp8_config(num_rows: int, out_features: int, in_features: int = 0) -> MmConfig:
    """W4A8's tile, from the first H200 sweep (session 51, ``kernels.bench.gemm --w4a8``): 64 features x 64 rows
    on 4 warps, 4 stages; past 128 rows on a long K (the down projection) 64 x 128 on 4 warps. The codes made by
    inline PTX (``packed``: _E4M3_ASM, 275 SASS instructions a thread per K step against 401 for the plain Triton
    form at 128 x 128, compiled for sm_90 by Triton 3.6; 283 / 406 by 3.9; 1.05-1.1x faster measured)."""
    if num_rows > 128 and in_features >= 8192:
        return MmConfig(block_m=128, tiles_n=4, num_warps=4, num_stages=3, swap=True, mma_order=True, packed=True)
    return MmConfig(block_m=64, tiles_n=4, num_warps=4, num_stages=4, swap=True, mma_order=True, packed=True)


def frag_mm_fp8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int, bias: torch.Tensor | None = None, *, bits: int = 4, layout: str = LAYOUT,
                config: MmConfig | None = None) -> torch.Tensor:
    """W4A8: ``fp8(x) @ ((q - zero) * scale).T + bias`` for bf16 / fp16 x on :func:`repack_frag`'s 4-bit weights,
    x quantized per token to e4m3 first (:func:`quantize_rows_fp8_order`). x: [..., K] -> y: [..., N] in x's dtype.
    Tensor cores at the e4m3 rate (sm_89+); the reference is :func:`ref_w4a8_linear`."""
    _check_device(x)
    if bits != 4:
        raise ValueError(f"frag_mm_fp8 takes 4-bit codes (q - z is exact in e4m3), not {bits}-bit")
    w = _frag_weights(qweight, scales, zeros, group_size, bits, layout)
    x2 = _gemm_rows(x, bias, w, "frag_mm_fp8")
    m, n = x2.shape[0], w.out_features
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    cfg = config or (MmConfig(16, 2, 4, 1, 1) if _interpreting() else default_fp8_config(m, n, w.in_features))
    xq, xs = quantize_rows_fp8_order(x2)
    plan = _gemm_plan(m, w, cfg.block_m, cfg.tiles_n, cfg.split_k, PROGRAMS_PER_SM, x.device)
    part = _gemm_partials(plan, m, n, y)
    _frag_mm_fp8_kernel[plan.grid](
        xq, xs, w.qweight, w.scales, w.zeros, bias if bias is not None else y, y, part, m, n, w.in_features,
        xq.stride(0), y.stride(0), plan.iters_per_split, ONE_GROUP=w.one_group, HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, TILES_N=plan.tiles_n, SPLIT=plan.grid[2], EMULATE=_interpreting(), ASM=cfg.packed,
        PAIR=cfg.pair, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _gemm_finish(plan, part, bias, y)
    return y.reshape(*x.shape[:-1], n)


def ref_w4a8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int, bias: torch.Tensor | None = None, *, bits: int = 4,
                    layout: str = LAYOUT) -> torch.Tensor:
    """The torch reference of :func:`frag_mm_fp8`: x's per-token e4m3 codes times their scales, in fp32, against
    the fp32 dequantized weights; rounded once to x's dtype."""
    from kernels.torch_quant import quantize_activation_fp8
    from kernels.w4a16_frag import dequantize_frag

    xq, xs = quantize_activation_fp8(x.reshape(-1, x.shape[-1]), None)
    w = dequantize_frag(qweight, scales, zeros, group_size, torch.float32, bits=bits, layout=layout)
    y = (xq.float() * xs) @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])
