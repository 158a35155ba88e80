"""FP8 W8A8 linears for 1-32 rows of x on tensor cores, reading the weights in the passes' own [N, K] layout.

``y = (quant(x) @ qweight.T) * x_scale * weight_scale + bias`` for float8_e4m3fn ``qweight`` [N, K] with a
per-channel or per-tensor weight scale, x quantized per token (dynamic, ``max|x| / 448``) or with the static
``input_scale``, as ``kernels.w8a8_gemm.ref_w8a8_linear``. At a handful of rows the linear is bound by its
weight bytes; ``kernels.gemv.w8a8_gemv`` multiplies them on the FMA units (4 instructions per weight byte at one
row, 6-10 at 2-4) and ``kernels.w8a8_gemm`` pads x to 16-row ``tl.dot`` tiles through shared memory. Here, as in
``kernels.w4a16_frag``, the weights are the A operand of ``mma.sync.m16n8k32`` with E4M3 inputs (sm_89+: 16
output features x 32 input features), x the B operand (8 columns: up to 8 rows of x per MMA), each warp alone on
32 output features, no shared memory and no barriers in the K loop. E4M3 products are exact in fp32, so the MMA
computes what the reference does (sums in another order).

No repacking: the same bytes serve cuBLAS (``torch._scaled_mm``) at prefill sizes. A sum over k is order-free,
so the kernel picks which input feature each of the MMA's k positions stands for. The A fragment of lane
``l = 4 g + c`` holds rows g (registers 0, 2) and g + 8 (1, 3) at MMA k ``4 c .. 4 c + 3`` (registers 0, 1) and
``16 + 4 c ..`` (2, 3); the B fragment holds x's row g at the same k (register 0: ``4 c ..``, 1: ``16 + 4 c ..``)
(PTX ISA, "Matrix fragments for mma.m16n8k32"). Within each chunk of 64 input features, MMA s (0, 1) of the
chunk takes at MMA k ``16 h + 4 c + e`` the feature ``16 c + 8 s + 4 h + e``::

    lane 4g + c, chunk j (features 64 j ..):  row g:      bytes 64 j + 16 c .. + 15  -> words R0 R1 R2 R3
                                              row g + 8:  the same                   -> words S0 S1 S2 S3
        MMA s = 0: A = {R0, S0, R1, S1}, B = {X0, X1};   MMA s = 1: A = {R2, S2, R3, S3}, B = {X2, X3}
    X0..X3: x's features 64 j + 16 c .. + 15 of row g (batch tile bt: row g + 8 bt), quantized to E4M3

so a lane reads 16 contiguous bytes of each of its rows per chunk (a warp's load: 8 rows x 64 contiguous bytes)
and 32 contiguous bytes of bf16 x, which it quantizes in registers (``x * (1 / x_scale)``, ``cvt.rn.satfinite``
to E4M3: the reference's clamp to +-448 and round to nearest even; the reciprocal's product can land one code
away from the reference's quotient when within an fp32 ulp of a rounding boundary, as the other W8A8 kernels'
fast division). The per-token scales come first: each program reads its rows of x over all of K for their max
(or the static scale), stores ``1 / x_scale`` per row for its lanes (``inv``: identical values from every
program) and waits at a barrier; rows past M take row M - 1's (their sums are never stored).

A program is ``warps`` warps on adjacent 32-feature tiles over one range of K (split-K across programs for the
SMs; the last program of a tile group adds the fp32 partials in split order, deterministic, multiplies by
``x_scale * weight_scale`` and writes y). The weight loads of the next K iteration (``j_chunks`` chunks of 64
features) are issued while this one multiplies, the first ones before the programmatic-dependent-launch wait.

The K loop is inline PTX run once per thread (a Triton tensor of one element per thread carries each register;
the PTX finds its lane from ``%tid.x``). It runs on CUDA only (sm_89+); the layout argument above is checked on
the CPU by the tests' lane-level emulation, the kernel on the GPU against ``ref_w8a8_linear``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.gemv import _num_sms, _tile_counters
from kernels.pdl import wait_prior
from kernels.w4a16_frag import _LANE, _LANE_REGS, _addr, _constraints, _regs, _store_ptx
from kernels.w4a16_gemm import _interpreting

WARP_N = 32  # output features per warp (two 16-row MMA tiles: x's registers serve both)
CHUNK_K = 64  # input features per 16-byte lane load of a row (two MMAs of k32)
ROWS_PER_MMA = 8  # rows of x per MMA (its N)
LAUNCH_MAX_ROWS = 32  # rows of x per launch: 1, 2 or 4 MMAs per A fragment (BATCH_TILE_COUNTS)
BATCH_TILE_COUNTS = (1, 2, 4)
FP8_MAX = 448.0
# The runtime's FP8 W8A8 path up to FP8_FRAG_RUNTIME_MAX_ROWS rows of bf16 x on sm_89+ (KERNELS_FP8_FRAG=0:
# kernels.gemv / kernels.w8a8_gemm as before).
FP8_FRAG_ENABLED = os.environ.get("KERNELS_FP8_FRAG", "1") != "0"
FP8_FRAG_RUNTIME_MAX_ROWS = 16
_PROGRAMS_PER_SM = 3
_MIN_ITERS_PER_SPLIT = 2
_MAX_SPLIT_K = 32


@dataclass(frozen=True)
class Fp8FragConfig:
    """One launch configuration of :func:`w8a8_frag`."""

    warps: int = 4  # warps (32 output features each) per program
    split_k: int = 0  # programs sharing a tile's K range; 0 = about _PROGRAMS_PER_SM programs per SM
    depth: int = 1  # K iterations loaded ahead of the MMAs: 1 or 2
    j_chunks: int = 1  # chunks of 64 input features per K iteration (16 bytes per row and chunk per lane): 1, 2, 4


def supports(in_features: int, out_features: int) -> bool:
    """Whether :func:`w8a8_frag` takes a [out_features, in_features] weight: N a multiple of 32, K of 64."""
    return out_features % WARP_N == 0 and in_features % CHUNK_K == 0 and out_features * in_features < 2**31


@functools.cache
def _capable(device: torch.device) -> bool:
    """E4M3 ``mma.sync`` needs compute capability 8.9+."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index) >= (8, 9)


def runtime_applies(x: torch.Tensor, num_rows: int, qweight: torch.Tensor) -> bool:
    """Whether the runtime runs these rows of x through :func:`w8a8_frag`: bf16 x on an sm_89+ CUDA device, FP8
    weights of a supported shape, 1..FP8_FRAG_RUNTIME_MAX_ROWS rows. Shapes and dtypes only (graph-safe)."""
    return (FP8_FRAG_ENABLED and x.is_cuda and x.dtype == torch.bfloat16 and qweight.dtype == torch.float8_e4m3fn
            and 1 <= num_rows <= FP8_FRAG_RUNTIME_MAX_ROWS and not _interpreting()
            and supports(qweight.shape[1], qweight.shape[0]) and _capable(x.device))


# --- the kernel's PTX ----------------------------------------------------------------------------------
# Operands are numbered outputs first, then inputs; every block finds its lane and warp from %tid.x (warp w of
# a program: output features 32 w .. 32 w + 31 of the program's; lane 4 g + c: rows g and g + 8 of each tile).
def _load_weights_ptx(j_chunks: int) -> str:
    """$0..$(16 J - 1) <- the lane's weight words of one K iteration, index ((tile x 2 + half) x J + j) x 4 + word
    (half 0: row g of the tile, 1: row g + 8; word w: bytes 64 j + 16 c + 4 w .. + 3 of the iteration).
    Inputs: the program's first row at this iteration's first feature (u8*), K (bytes per row)."""
    n = 16 * j_chunks
    base, k = f"${n}", f"${n + 1}"
    lines = ["{", _LANE_REGS, ".reg .u64 r8, b;", _LANE,
             "shl.b32 warp, warp, 5;", "add.u32 warp, warp, g;",  # the lane's first row: 32 w + g
             f"mul.wide.u32 a, warp, {k};", f"add.u64 a, a, {base};",
             "mul.wide.u32 o, c, 16;", "add.u64 a, a, o;",
             f"mul.wide.u32 r8, {k}, 8;"]  # 8 rows
    for rows8 in range(4):  # tile 0 row g, tile 0 row g + 8, tile 1 row g, tile 1 row g + 8
        lines.append("mov.u64 b, a;" if rows8 == 0 else "add.u64 b, b, r8;")
        for j in range(j_chunks):
            regs = ", ".join(f"${(rows8 * j_chunks + j) * 4 + w}" for w in range(4))
            lines.append(f"ld.global.nc.v4.b32 {{{regs}}}, [b+{64 * j}];")
    lines.append("}")
    return "\n".join(lines)


def _load_x_ptx(batch_tiles: int, j_chunks: int) -> str:
    """$0..$(4 J bt - 1) <- the lane's B registers of one K iteration, E4M3: index bt x 4 J + 4 j + r holds x's
    features 64 j + 16 c + 4 r .. + 3 of row min(g + 8 bt, M - 1), each times its row's 1 / x_scale, rounded to
    nearest even with saturation to +-448. Inputs: M, x (bf16* at the iteration's first feature, as bytes), x's
    row stride in bytes, then one 1 / x_scale per batch tile (the lane's rows'). (M first: Triton 3.6 broadcasts
    inline-assembly operands against the first one, and a pointer does not take a float.)"""
    n = 4 * j_chunks * batch_tiles
    m, x_ptr, stride = f"${n}", f"${n + 1}", f"${n + 2}"
    lines = ["{", _LANE_REGS, ".reg .u32 b, last, w0, w1, w2, w3, w4, w5, w6, w7;",
             ".reg .f32 lo, hi;", ".reg .b16 h0, h1;", _LANE, f"sub.u32 last, {m}, 1;"]
    for bt in range(batch_tiles):
        inv = f"${n + 3 + bt}"
        lines += [f"add.u32 b, g, {8 * bt};", "min.u32 b, b, last;",
                  f"mul.wide.u32 a, b, {stride};", f"add.u64 a, a, {x_ptr};",
                  "mul.wide.u32 o, c, 32;", "add.u64 a, a, o;"]
        for j in range(j_chunks):
            lines += [f"ld.global.v4.b32 {{w0, w1, w2, w3}}, [a+{128 * j}];",
                      f"ld.global.v4.b32 {{w4, w5, w6, w7}}, [a+{128 * j + 16}];"]
            for r in range(4):  # features 4 r .. 4 r + 3: bf16 words 2 r (4 r, 4 r + 1) and 2 r + 1
                for half, word in enumerate((2 * r, 2 * r + 1)):
                    lines += [f"shl.b32 lo, w{word}, 16;", f"and.b32 hi, w{word}, 0xFFFF0000;",
                              f"mul.f32 lo, lo, {inv};", f"mul.f32 hi, hi, {inv};",
                              f"cvt.rn.satfinite.e4m3x2.f32 h{half}, hi, lo;"]
                lines.append(f"mov.b32 ${bt * 4 * j_chunks + 4 * j + r}, {{h0, h1}};")
    lines.append("}")
    return "\n".join(lines)


def _compute_ptx(batch_tiles: int, j_chunks: int) -> str:
    """One K iteration: 2 tiles x J chunks x 2 MMAs per batch tile. Outputs $0..$(8 bt - 1): the running sums,
    index (tile x batch_tiles + bt) x 4 + i (i the MMA's C register). Inputs: the 16 J weight words
    (:func:`_load_weights_ptx`), the 4 J bt x registers (:func:`_load_x_ptx`), the sums."""
    n_out = 8 * batch_tiles
    w0 = n_out
    x0 = w0 + 16 * j_chunks
    t_in = x0 + 4 * j_chunks * batch_tiles
    lines = ["{", ".reg .f32 " + ", ".join(f"a{i}" for i in range(n_out)) + ";"]
    lines += [f"mov.f32 a{i}, ${t_in + i};" for i in range(n_out)]
    for tile in range(2):
        for j in range(j_chunks):
            for s in range(2):
                row_g = [f"${w0 + ((tile * 2) * j_chunks + j) * 4 + 2 * s + i}" for i in range(2)]
                row_g8 = [f"${w0 + ((tile * 2 + 1) * j_chunks + j) * 4 + 2 * s + i}" for i in range(2)]
                a_frag = f"{{{row_g[0]}, {row_g8[0]}, {row_g[1]}, {row_g8[1]}}}"
                for bt in range(batch_tiles):
                    xb = x0 + bt * 4 * j_chunks + 4 * j + 2 * s
                    acc = ", ".join(f"a{(tile * batch_tiles + bt) * 4 + i}" for i in range(4))
                    lines.append(f"mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {{{acc}}}, {a_frag}, "
                                 f"{{${xb}, ${xb + 1}}}, {{{acc}}};")
    lines += [f"mov.f32 ${i}, a{i};" for i in range(n_out)]
    lines.append("}")
    return "\n".join(lines)


def _inv_ptx(batch_tiles: int) -> str:
    """$0..$(bt - 1) <- the lane's rows' 1 / x_scale (row min(g + 8 bt, M - 1)) from the program's ``inv``
    (fp32*, written before the barrier in this kernel: an L2 load, not the non-coherent path). Inputs: inv, M."""
    inv, m = f"${batch_tiles}", f"${batch_tiles + 1}"
    lines = ["{", _LANE_REGS, ".reg .u32 b, last;", _LANE, f"sub.u32 last, {m}, 1;"]
    for bt in range(batch_tiles):
        lines += [f"add.u32 b, g, {8 * bt};", "min.u32 b, b, last;", "mul.wide.u32 o, b, 4;",
                  f"add.u64 a, {inv}, o;", f"ld.global.cg.f32 ${bt}, [a];"]
    lines.append("}")
    return "\n".join(lines)


_I32, _F32 = tl.int32, tl.float32
_TUPLES = {n: (tl.constexpr((tl.int32,) * n), tl.constexpr((tl.float32,) * n)) for n in (1, 2, 4, 8, 16, 32, 64)}
J_CHOICES = (1, 2, 4)
_W_PTX = {j: (tl.constexpr(_load_weights_ptx(j)), _constraints("r", 16 * j, "l,r")) for j in J_CHOICES}
_X_PTX = {(bt, j): (tl.constexpr(_load_x_ptx(bt, j)), _constraints("r", 4 * j * bt, "r,l,r," + _regs("f", bt)))
          for bt in BATCH_TILE_COUNTS for j in J_CHOICES}
_C_PTX = {(bt, j): (tl.constexpr(_compute_ptx(bt, j)),
                    _constraints("f", 8 * bt, ",".join([_regs("r", 16 * j + 4 * j * bt), _regs("f", 8 * bt)])))
          for bt in BATCH_TILE_COUNTS for j in J_CHOICES}
_INV_PTX = {bt: (tl.constexpr(_inv_ptx(bt)), _constraints("f", bt, "l,r")) for bt in BATCH_TILE_COUNTS}
_S_PTX = {bt: (tl.constexpr(_store_ptx(bt, False)), tl.constexpr("=r,r," + _regs("f", 8 * bt + 4) + ",l,r"))
          for bt in BATCH_TILE_COUNTS}
_W1_PTX, _W1_CONS = _W_PTX[1]
_W2_PTX, _W2_CONS = _W_PTX[2]
_W4_PTX, _W4_CONS = _W_PTX[4]
_X11_PTX, _X11_CONS = _X_PTX[(1, 1)]
_X21_PTX, _X21_CONS = _X_PTX[(2, 1)]
_X41_PTX, _X41_CONS = _X_PTX[(4, 1)]
_X12_PTX, _X12_CONS = _X_PTX[(1, 2)]
_X22_PTX, _X22_CONS = _X_PTX[(2, 2)]
_X42_PTX, _X42_CONS = _X_PTX[(4, 2)]
_X14_PTX, _X14_CONS = _X_PTX[(1, 4)]
_X24_PTX, _X24_CONS = _X_PTX[(2, 4)]
_X44_PTX, _X44_CONS = _X_PTX[(4, 4)]
_C11_PTX, _C11_CONS = _C_PTX[(1, 1)]
_C21_PTX, _C21_CONS = _C_PTX[(2, 1)]
_C41_PTX, _C41_CONS = _C_PTX[(4, 1)]
_C12_PTX, _C12_CONS = _C_PTX[(1, 2)]
_C22_PTX, _C22_CONS = _C_PTX[(2, 2)]
_C42_PTX, _C42_CONS = _C_PTX[(4, 2)]
_C14_PTX, _C14_CONS = _C_PTX[(1, 4)]
_C24_PTX, _C24_CONS = _C_PTX[(2, 4)]
_C44_PTX, _C44_CONS = _C_PTX[(4, 4)]
_INV1_PTX, _INV1_CONS = _INV_PTX[1]
_INV2_PTX, _INV2_CONS = _INV_PTX[2]
_INV4_PTX, _INV4_CONS = _INV_PTX[4]
_S1_PTX, _S1_CONS = _S_PTX[1]
_S2_PTX, _S2_CONS = _S_PTX[2]
_S4_PTX, _S4_CONS = _S_PTX[4]
_I32X4, _I32X8, _I32X16, _I32X32, _I32X64 = (_TUPLES[n][0] for n in (4, 8, 16, 32, 64))
_F32X8, _F32X16, _F32X32 = (_TUPLES[n][1] for n in (8, 16, 32))
_F32X2, _F32X4 = _TUPLES[2][1], _TUPLES[4][1]


@triton.jit
def _load_w(w_it, k_bytes, J: tl.constexpr):
    """The lane's 16 J weight words of one K iteration (constants: loadable before the PDL wait)."""
    if J == 1:
        return tl.inline_asm_elementwise(_W1_PTX, _W1_CONS, [w_it, k_bytes], dtype=_I32X16, is_pure=True, pack=1)
    elif J == 2:
        return tl.inline_asm_elementwise(_W2_PTX, _W2_CONS, [w_it, k_bytes], dtype=_I32X32, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(_W4_PTX, _W4_CONS, [w_it, k_bytes], dtype=_I32X64, is_pure=True, pack=1)


@triton.jit
def _load_x(x_it, x_stride, m, inv, BATCH_TILES: tl.constexpr, J: tl.constexpr):
    """The lane's E4M3 x registers of one K iteration (4 J per batch tile)."""
    if J == 1:
        if BATCH_TILES == 1:
            return tl.inline_asm_elementwise(_X11_PTX, _X11_CONS, (m, x_it, x_stride) + inv, dtype=_I32X4,
                                             is_pure=False, pack=1)
        elif BATCH_TILES == 2:
            return tl.inline_asm_elementwise(_X21_PTX, _X21_CONS, (m, x_it, x_stride) + inv, dtype=_I32X8,
                                             is_pure=False, pack=1)
        else:
            return tl.inline_asm_elementwise(_X41_PTX, _X41_CONS, (m, x_it, x_stride) + inv, dtype=_I32X16,
                                             is_pure=False, pack=1)
    elif J == 2:
        if BATCH_TILES == 1:
            return tl.inline_asm_elementwise(_X12_PTX, _X12_CONS, (m, x_it, x_stride) + inv, dtype=_I32X8,
                                             is_pure=False, pack=1)
        elif BATCH_TILES == 2:
            return tl.inline_asm_elementwise(_X22_PTX, _X22_CONS, (m, x_it, x_stride) + inv, dtype=_I32X16,
                                             is_pure=False, pack=1)
        else:
            return tl.inline_asm_elementwise(_X42_PTX, _X42_CONS, (m, x_it, x_stride) + inv, dtype=_I32X32,
                                             is_pure=False, pack=1)
    else:
        if BATCH_TILES == 1:
            return tl.inline_asm_elementwise(_X14_PTX, _X14_CONS, (m, x_it, x_stride) + inv, dtype=_I32X16,
                                             is_pure=False, pack=1)
        elif BATCH_TILES == 2:
            return tl.inline_asm_elementwise(_X24_PTX, _X24_CONS, (m, x_it, x_stride) + inv, dtype=_I32X32,
                                             is_pure=False, pack=1)
        else:
            return tl.inline_asm_elementwise(_X44_PTX, _X44_CONS, (m, x_it, x_stride) + inv, dtype=_I32X64,
                                             is_pure=False, pack=1)


@triton.jit
def _compute(w, x, t, BATCH_TILES: tl.constexpr, J: tl.constexpr):
    """The sums ``t`` after one K iteration on the weight words ``w`` and x registers ``x``."""
    if J == 1:
        if BATCH_TILES == 1:
            return tl.inline_asm_elementwise(_C11_PTX, _C11_CONS, w + x + t, dtype=_F32X8, is_pure=True, pack=1)
        elif BATCH_TILES == 2:
            return tl.inline_asm_elementwise(_C21_PTX, _C21_CONS, w + x + t, dtype=_F32X16, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise(_C41_PTX, _C41_CONS, w + x + t, dtype=_F32X32, is_pure=True, pack=1)
    elif J == 2:
        if BATCH_TILES == 1:
            return tl.inline_asm_elementwise(_C12_PTX, _C12_CONS, w + x + t, dtype=_F32X8, is_pure=True, pack=1)
        elif BATCH_TILES == 2:
            return tl.inline_asm_elementwise(_C22_PTX, _C22_CONS, w + x + t, dtype=_F32X16, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise(_C42_PTX, _C42_CONS, w + x + t, dtype=_F32X32, is_pure=True, pack=1)
    else:
        if BATCH_TILES == 1:
            return tl.inline_asm_elementwise(_C14_PTX, _C14_CONS, w + x + t, dtype=_F32X8, is_pure=True, pack=1)
        elif BATCH_TILES == 2:
            return tl.inline_asm_elementwise(_C24_PTX, _C24_CONS, w + x + t, dtype=_F32X16, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise(_C44_PTX, _C44_CONS, w + x + t, dtype=_F32X32, is_pure=True, pack=1)


@triton.jit
def _lane_inv(inv_ptr, m, BATCH_TILES: tl.constexpr):
    """The lane's rows' 1 / x_scale, one per batch tile (a tuple)."""
    if BATCH_TILES == 1:
        return (tl.inline_asm_elementwise(_INV1_PTX, _INV1_CONS, [inv_ptr, m], dtype=_F32, is_pure=False,
                                          pack=1),)
    elif BATCH_TILES == 2:
        return tl.inline_asm_elementwise(_INV2_PTX, _INV2_CONS, [inv_ptr, m], dtype=_F32X2, is_pure=False, pack=1)
    else:
        return tl.inline_asm_elementwise(_INV4_PTX, _INV4_CONS, [inv_ptr, m], dtype=_F32X4, is_pure=False, pack=1)


@triton.jit
def _store_partials(m, t, zero, part, n_stride, BATCH_TILES: tl.constexpr):
    """The raw sums into the partials, rows of x < M."""
    args = (m,) + t + (zero, zero, zero, zero, part, n_stride)
    if BATCH_TILES == 1:
        tl.inline_asm_elementwise(_S1_PTX, _S1_CONS, args, dtype=tl.int32, is_pure=False, pack=1)
    elif BATCH_TILES == 2:
        tl.inline_asm_elementwise(_S2_PTX, _S2_CONS, args, dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(_S4_PTX, _S4_CONS, args, dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _w8a8_frag_kernel(
    x_ptr, w_ptr, ws_ptr, xs_ptr, bias_ptr, y_ptr, part_ptr, scale_ptr, counter_ptr,
    M, N, K, stride_xm, iters_per_split, split_k,
    STATIC: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, WARPS: tl.constexpr,
    BATCH_TILES: tl.constexpr, J: tl.constexpr, DEPTH: tl.constexpr, AMAX_ROWS: tl.constexpr,
    AMAX_BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    # grid (N / (32 WARPS), split_k); warp w of program p works on output features 32 (p WARPS + w) .. + 31
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    lanes = tl.zeros([32 * WARPS], dtype=tl.int32)  # one element per thread: each PTX block runs once per thread
    col0 = pid_n * WARPS * 32
    ITER_K: tl.constexpr = 64 * J
    first = pid_k * iters_per_split
    num_iters = min(iters_per_split, K // ITER_K - first)
    last = first + num_iters - 1
    k_bytes = lanes + K
    w_base = _addr(w_ptr) + col0 * K
    w = _load_w(w_base + first * ITER_K + lanes, k_bytes, J)  # weights are constants: before the wait
    w1 = w
    if DEPTH == 2:
        w1 = _load_w(w_base + min(first + 1, last) * ITER_K + lanes, k_bytes, J)
    wait_prior(PDL)  # x and the partials are the preceding kernels'

    # the rows' scales: max|x| over all of K (from L2), or the static one; x_scale and 1 / x_scale per row go to
    # the scratch (every program stores the same values) for the lanes and the final reduction
    ROWS: tl.constexpr = 8 * BATCH_TILES
    arows = tl.arange(0, AMAX_ROWS)
    if STATIC:
        x_scale = tl.zeros([AMAX_ROWS], dtype=tl.float32) + tl.load(xs_ptr).to(tl.float32)
    else:
        amax = tl.zeros([AMAX_ROWS, AMAX_BLOCK], dtype=tl.float32)
        for k0 in range(0, K, AMAX_BLOCK):
            cols = k0 + tl.arange(0, AMAX_BLOCK)
            v = tl.load(x_ptr + arows[:, None] * stride_xm + cols[None, :],
                        mask=(arows[:, None] < M) & (cols[None, :] < K), other=0.0)
            amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
        x_scale = tl.maximum(tl.max(amax, axis=1), 1e-12) / 448.0
    tl.store(scale_ptr + arows, x_scale, mask=arows < M)
    tl.store(scale_ptr + ROWS + arows, 1.0 / x_scale, mask=arows < M)
    tl.debug_barrier()  # the stores visible to the program's threads
    inv = _lane_inv(_addr(scale_ptr + ROWS) + lanes, lanes + M, BATCH_TILES)  # rows past M read row M - 1's

    m = lanes + M
    x_stride = lanes + stride_xm * 2
    x = _load_x(_addr(x_ptr + first * ITER_K) + lanes, x_stride, m, inv, BATCH_TILES, J)
    t = (tl.zeros([32 * WARPS], dtype=tl.float32),) * (8 * BATCH_TILES)
    for i in range(0, num_iters):
        it = first + i
        nxt = min(it + 1, last)
        w2 = _load_w(w_base + min(it + DEPTH, last) * ITER_K + lanes, k_bytes, J)
        x2 = _load_x(_addr(x_ptr + nxt * ITER_K) + lanes, x_stride, m, inv, BATCH_TILES, J)
        t = _compute(w, x, t, BATCH_TILES, J)
        if DEPTH == 2:
            w = w1
            w1 = w2
        else:
            w = w2
        x = x2
    zero = tl.zeros([32 * WARPS], dtype=tl.float32)
    _store_partials(m, t, zero, _addr(part_ptr + (pid_k * M) * N + col0 + lanes), lanes + N, BATCH_TILES)
    # the last program of this column range (all of it without a split) adds the partials in split order
    tl.debug_barrier()
    done = True
    if split_k > 1:
        done = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu") == split_k - 1
    if done:
        if split_k > 1:
            tl.store(counter_ptr + pid_n, 0)  # zero again for the next launch
        rows = tl.arange(0, ROWS)
        cols = col0 + tl.arange(0, WARPS * 32)[None, :]
        mask = (rows[:, None] < M) & (cols < N)
        offs = rows[:, None] * N + cols
        tot = tl.load(part_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
        for k in range(1, split_k):
            tot += tl.load(part_ptr + k * M * N + offs, mask=mask, other=0.0, cache_modifier=".cg")
        if PER_CHANNEL:
            w_scale = tl.load(ws_ptr + cols, mask=cols < N, other=0.0)
        else:
            w_scale = tl.load(ws_ptr)
        row_scale = tl.load(scale_ptr + rows, mask=rows < M, other=1.0, cache_modifier=".cg")
        tot = tot * row_scale[:, None] * w_scale  # the reference's order: float(sum) * x_scale * weight_scale
        if HAS_BIAS:
            tot += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs, tot.to(y_ptr.dtype.element_ty), mask=mask)


# --- host side -------------------------------------------------------------------------------------
def default_config(num_rows: int) -> Fp8FragConfig:
    """The configuration for ``num_rows`` rows of x."""
    return Fp8FragConfig()


def w8a8_frag(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
              input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None, *,
              config: Fp8FragConfig | None = None) -> torch.Tensor:
    """``ref_w8a8_linear`` (FP8) for bf16 x on an sm_89+ CUDA device: x [..., K] -> y [..., N] bf16; one launch per
    LAUNCH_MAX_ROWS rows (each reads the weights). ``qweight`` float8_e4m3fn [N, K] (N a multiple of 32, K of 64),
    ``weight_scale`` [N] or [1] (fp32), ``input_scale`` [1] (static) or None (per token)."""
    if qweight.dim() != 2 or qweight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"w8a8_frag takes a 2-D float8_e4m3fn qweight, got {qweight.dtype} {tuple(qweight.shape)}")
    n, k = qweight.shape
    if not supports(k, n):
        raise ValueError(f"w8a8_frag takes weights [N, K] with N a multiple of {WARP_N} and K of {CHUNK_K} (and "
                         f"N x K < 2^31), got {tuple(qweight.shape)}")
    if not x.is_cuda or x.dtype != torch.bfloat16 or _interpreting() or not _capable(x.device):
        raise ValueError(f"w8a8_frag takes bf16 x on a CUDA device of compute capability 8.9+, got {x.dtype} on "
                         f"{x.device}; use kernels.w8a8_gemm")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the weights take {k}")
    ws = weight_scale.reshape(-1).float()
    if ws.numel() not in (1, n):
        raise ValueError(f"weight_scale has {ws.numel()} values; expected 1 or {n} (one per output feature)")
    if input_scale is not None and input_scale.numel() != 1:
        raise ValueError(f"input_scale has {input_scale.numel()} values; expected one (static per-tensor scale)")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias {tuple(bias.shape)} does not match {n} output features")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1 or x2.data_ptr() % 16 or x2.stride(0) % 8:  # the kernel loads x 16 bytes at a time
        x2 = x2.contiguous()
    num_rows = x2.shape[0]
    y = torch.empty((num_rows, n), dtype=torch.bfloat16, device=x.device)
    xs = input_scale.reshape(-1).float() if input_scale is not None else ws  # ws: never read unless static
    for r0 in range(0, num_rows, LAUNCH_MAX_ROWS):  # each slice reads the weights again
        rows = min(LAUNCH_MAX_ROWS, num_rows - r0)
        _launch(x2[r0: r0 + rows], qweight, ws, xs, input_scale is not None, bias, y[r0: r0 + rows],
                config or default_config(rows))
    return y.reshape(*x.shape[:-1], n)


def _launch(x2: torch.Tensor, qweight: torch.Tensor, ws: torch.Tensor, xs: torch.Tensor, static: bool,
            bias: torch.Tensor | None, y: torch.Tensor, cfg: Fp8FragConfig) -> None:
    num_rows, n = y.shape
    k = qweight.shape[1]
    warps = cfg.warps
    while (n // WARP_N) % warps:
        warps //= 2
    num_programs = n // (WARP_N * warps)
    j_chunks = cfg.j_chunks if k % (CHUNK_K * cfg.j_chunks) == 0 else 1
    total_iters = k // (CHUNK_K * j_chunks)
    split_k = cfg.split_k
    if not split_k:
        device_index = x2.device.index if x2.device.index is not None else torch.cuda.current_device()
        split_k = min(triton.cdiv(_PROGRAMS_PER_SM * _num_sms(device_index), num_programs),
                      max(total_iters // _MIN_ITERS_PER_SPLIT, 1), _MAX_SPLIT_K)
    split_k = max(1, min(split_k, total_iters))
    iters_per_split = triton.cdiv(total_iters, split_k)
    split_k = triton.cdiv(total_iters, iters_per_split)
    batch_tiles = next(bt for bt in BATCH_TILE_COUNTS if num_rows <= ROWS_PER_MMA * bt)
    rows_pad = ROWS_PER_MMA * batch_tiles
    scratch = torch.empty(split_k * num_rows * n + 2 * rows_pad, dtype=torch.float32, device=x2.device)
    part, scales = scratch[: split_k * num_rows * n], scratch[split_k * num_rows * n:]
    counters = _tile_counters(x2.device, num_programs) if split_k > 1 else y
    # the per-token max over rows padded to a power of 2, about 32 x values per thread and K step
    amax_rows = triton.next_power_of_2(num_rows)
    amax_block = min(triton.next_power_of_2(k), max(64, 32 * 32 * warps // amax_rows))
    _w8a8_frag_kernel[(num_programs, split_k)](
        x2, qweight.view(torch.uint8), ws, xs, bias if bias is not None else y, y, part, scales, counters,
        num_rows, n, k, x2.stride(0), iters_per_split, split_k,
        STATIC=static, PER_CHANNEL=ws.numel() == n and n > 1, HAS_BIAS=bias is not None, WARPS=warps,
        BATCH_TILES=batch_tiles, J=j_chunks, DEPTH=cfg.depth, AMAX_ROWS=amax_rows, AMAX_BLOCK=amax_block,
        num_warps=warps,
        **pdl.pdl_args(x2))
