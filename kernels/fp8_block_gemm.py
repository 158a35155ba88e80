"""Block-scaled FP8 W8A8 linear (the IR's ``fp8_block``: fine-grained FP8 checkpoints such as DeepSeek-V3's and
Qwen3-FP8's) with the activation quantization in the kernels: a GEMV at 1 to ``GEMV_ROWS`` rows (decode), a
tensor-core GEMM above.

``y = sum over K groups g of (quant(x)[:, g] @ qweight[:, g].T) * x_scale[:, g] * weight_scale[n // bn, g] + bias``,
x in fp16/bf16/fp32 and y in x's dtype: the arithmetic of the reference ``fp8_block`` path of
``kernels.torch_quant.make_quant_linear``:

    x_scale       dynamic, per token and group of bk along K (the last may be narrower): max|x| over the
                  group / 448 (floored at 1e-12 / 448), IEEE division
    quant         x / x_scale (IEEE division) clamped to +-448, rounded to E4M3 (round-half-even)
    qweight       float8_e4m3fn [N, K]; weight_scale fp32 [ceil(N / bn), ceil(K / bk)] for block_size [bn, bk]
    acc           fp32: each group's sum of exact E4M3 products scaled by its two scales, then added

Both kernels keep the reference's values: the same scales and codes (the divisions are IEEE ``div_rn``, not the
fast approximate ``/``), exact products; they differ from it in the order of the fp32 sums (and the GEMM, on Hopper's
FP8 tensor cores, in their reduced-precision accumulation within one group).

GEMV (``_fp8_block_gemv_kernel``, 1 to ``kernels.gemv.GEMV_MAX_ROWS`` rows; ``kernels.gemv``'s W8A8 GEMV with
per-group scales). Decode reads each weight byte once and is bound by HBM: no tensor cores, no 15/16 padding of a 16-row
tile. A program owns BLOCK_N output features and a K range of whole steps; a K step is G_STEP whole activation
groups (a config's block_k rounded up to a multiple of bk), so a step quantizes its own rows of x with no
cross-step state::

    one K step of a program, weights [BLOCK_N, G_STEP, bk] (16-byte vector loads along K)
                     group g0        group g0 + 1     ...   group g0 + G_STEP - 1
    x row r      | max -> x_scale | max -> x_scale |     |                |   codes: x / x_scale, E4M3
    n0 .. +BN    | sum of VEC-wide runs of exact products, per thread, in fp32 | -> acc += runs * x_scale * ws[n, g]

The group's max spans the threads holding its bk features (warp shuffles); the per-run sums stay in registers
and are scaled once per step (one FMA per VEC products). Small N leaves few column tiles for the SMs, so K is split
over programs; the last program of a column tile adds the partial sums in split order (``kernels.gemv``'s tile
counters: one launch). With PDL the program asks the L2 for its first weight step before waiting for the previous
kernel (``kernels.pdl``).

GEMM (``_fp8_block_gemm_kernel``): one K step is one group (BLOCK_K = bk); the step's [BLOCK_M, BLOCK_K] codes are
multiplied by the [BLOCK_K, BLOCK_N] weight tile on tensor cores from a zero accumulator (so Hopper's reduced-precision
FP8 accumulation spans one group at most) and the step's fp32 sums are added times x_scale [BLOCK_M] x weight_scale
[BLOCK_N]. Where the config says ``prequant`` (the larger M), x is quantized once per (row, group) by a small
kernel (``quantize_groups``: codes [M, K], scales [num_groups, M]); otherwise each program quantizes its rows'
step itself, which re-does the divisions once per column tile, cheap only for a few rows. Few output tiles split K
over programs, the tile's last one adding the partial sums (as the GEMV). The kernel takes block_k a power of two
from 16 to 256 (:func:`supports`); the runtime runs other block sizes on the torch reference. An FP8 dot compiles
for K >= 32 only (FP8_DOT_MIN_K), so at bk 16 a step multiplies the codes as fp16: exact, the same sums.

NOTE: under TRITON_INTERPRET the fp32 -> float8e4nv conversion is wrong (``kernels.w8a8_gemm``), so the
interpreter rounds x to E4M3 with ``_round_e4m3`` and multiplies in fp32; the GPU converts with the hardware's
round-to-nearest-even and multiplies FP8 on tensor cores (GEMM) or in fp32 (GEMV). No host synchronisation: grids
and splits come from shapes (CUDA-graph capturable); the tile counters are allocated on first use, which must come
before any capture (``kernels.gemv``). The CUDA configurations are first guesses (but the GEMV's at one and two
rows, measured), to be set from ``python -m kernels.bench.fp8_block --sweep``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.gemv import (
    GEMV_MAX_ROWS,
    GemvConfig,
    _arrive,
    _check_config,
    _load,
    _load_weights,
    _split_plan,
    _sums_epilogue,
    _tile_counters,
)
from kernels.pdl import pdl_args, prefetch_l2_rows, prefetch_rows_plan, wait_prior
from kernels.w4a16_gemm import _interpreting, output_tile, split_k_plan
from kernels.w8a8_gemm import X_DTYPES, _codes, _round_e4m3

BLOCK_K_RANGE = (16, 256)  # the block widths along K the kernels take (powers of two: whole groups per K step)
# tl.dot on FP8 operands compiles for K >= 32 only on the GPU (the FP8 MMA's K; the interpreter takes any): the GEMM's
# K step, one group, is narrower for bk = 16, so those steps multiply fp16 operands (:func:`_dot_in_fp16`)
FP8_DOT_MIN_K = 32
_FP8_DOT_MIN_K = tl.constexpr(FP8_DOT_MIN_K)
# fp8_block_linear runs the GEMV up to this many rows of x, the GEMM above. One, measured on an H200 (session 33,
# ``python -m kernels.bench.fp8_block --sweep --rows 1 2 --shapes llama3-8b``, us per call against bf16's): at one row
# the GEMV leads (qkv 10.1 / 15.8, o_proj 7.0 / 13.9, gate_up 35.0 / 55.8); at two rows the GEMM on x quantized once
# (16 x 128 tiles) beats the GEMV by 1.5-2x (qkv 12.0 against 21.0, o_proj 9.3 / 14.4, gate_up 33.7 / 69.7): the
# GEMV's fp32 products and sums double with the rows (SASS: 5.2 instructions per weight byte at one row, 8.1 at two;
# an H200 issues about 7 per byte at 4.8 TB/s), the GEMM's tensor cores take the second row for free
GEMV_ROWS = 1
assert GEMV_ROWS <= GEMV_MAX_ROWS, "the GEMV kernel keeps one accumulator per row, GEMV_MAX_ROWS at most"
_FP8_MAX = tl.constexpr(448.0)  # the largest E4M3 code


@dataclass(frozen=True)
class BlockConfig:
    """One launch configuration of the GEMM; the K step is the checkpoint's block width, not a choice."""

    block_m: int  # rows of x per tile (>= 16: tl.dot's minimum)
    block_n: int  # output features per tile
    split_k: int = 0  # programs sharing one tile's K range; 0 = from the tile count and the SM count
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    prequant: bool = False  # x quantized once by quantize_groups (else by each program, per column tile)


# Picked by M: the first row whose bound is >= M. Up to 16 rows: the H200 sweep's fastest at two rows (session 33;
# 16 x 128 tiles, 8 warps, 3 stages, x quantized once by quantize_groups: 12.0 / 9.3 / 33.7 us on Llama-3-8B's qkv /
# o_proj / gate_up, where the same tiles quantizing x in each program took 33.8 / 21.3 / 133.2: every column tile
# repeated the divisions); 4 to 16 rows were not swept. Above 16 rows, first guesses (not yet timed): x quantized once,
# 64- and 128-row tiles on Hopper's wgmma path, 8 warps for 128 rows.
_CUDA_CONFIGS: list[tuple[int, BlockConfig]] = [
    (16, BlockConfig(16, 128, num_warps=8, num_stages=3, prequant=True)),
    (32, BlockConfig(32, 128, num_warps=4, num_stages=4, prequant=True)),
    (64, BlockConfig(64, 128, num_warps=4, num_stages=4, prequant=True)),
    (1 << 62, BlockConfig(128, 128, num_warps=8, num_stages=3, prequant=True)),
]
_INTERPRETER_CONFIG = BlockConfig(16, 32, split_k=1, group_m=4, num_warps=1, num_stages=1)

# GEMV, picked by rows of x likewise (two and four rows: benchmarks and forced configs only). One row: the H200
# sweep's fastest on qkv and o_proj (session 33: 64 x 256 tiles, one stage, about 4 programs per SM; 10.1 and 7.0 us,
# against 11.4 and 7.9 for 16 x 1024; the first guess, 16 x 2048 in 3 stages, took 183 us on qkv). Two and four
# rows from the SASS (instructions per weight byte in the K loop, registers): a deeper pipeline spills (255
# registers), so one stage and warps in flight hide the loads (8.1 / 16.6, 249 / 207 registers, no spills)
_GEMV_CUDA_CONFIGS: list[tuple[int, GemvConfig]] = [
    (1, GemvConfig(64, 256, num_warps=4, num_stages=1, programs_per_sm=4)),
    (2, GemvConfig(16, 1024, num_warps=4, num_stages=1)),
    (GEMV_MAX_ROWS, GemvConfig(16, 512, num_warps=4, num_stages=1)),
]
_GEMV_INTERPRETER_CONFIG = GemvConfig(16, 32, split_k=1, num_warps=1, num_stages=1)


def default_config(num_rows: int, device: torch.device) -> BlockConfig:
    """The GEMM's configuration at ``num_rows`` rows of x."""
    if _interpreting() or device.type != "cuda":
        return _INTERPRETER_CONFIG
    return next(cfg for bound, cfg in _CUDA_CONFIGS if num_rows <= bound)


def default_gemv_config(num_rows: int, device: torch.device) -> GemvConfig:
    """The GEMV's configuration at ``num_rows`` (1 to GEMV_MAX_ROWS) rows of x."""
    if _interpreting() or device.type != "cuda":
        return _GEMV_INTERPRETER_CONFIG
    return next(cfg for bound, cfg in _GEMV_CUDA_CONFIGS if num_rows <= bound)


def _dot_in_fp16(block_k: int) -> bool:
    """Whether the GEMM's K steps (one group of ``block_k`` features each) multiply fp16 operands, not FP8: below
    FP8_DOT_MIN_K, where the FP8 dot does not compile. E4M3 codes are exact in fp16 and their products in the fp32
    accumulator, so the sums are the FP8 dot's (at half its tensor-core rate, for the few checkpoints with bk 16)."""
    return block_k < FP8_DOT_MIN_K


def supports(block_size: list[int] | tuple[int, int]) -> bool:
    """Whether the kernels take weights of this block size: any bn, a power-of-two bk in BLOCK_K_RANGE."""
    block_k = block_size[1]
    return BLOCK_K_RANGE[0] <= block_k <= BLOCK_K_RANGE[1] and block_k & (block_k - 1) == 0


# --- GEMV ------------------------------------------------------------------------------------------
@triton.jit
def _group_codes(x_row, offs_k, mask_k, EMULATE_FP8: tl.constexpr, MASKED: tl.constexpr):
    """One row's x over a K step of whole groups (offs_k [G_STEP, GK]) quantized as the reference does: (E4M3 values
    as fp32 [G_STEP, GK], 0 where masked; the groups' x_scale [G_STEP]). Masked features are 0: no effect on a max."""
    a = _load(x_row + offs_k, mask_k, MASKED).to(tl.float32)
    x_scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(a), axis=1), 1e-12), _FP8_MAX)
    v = tl.minimum(tl.maximum(tl.math.div_rn(a, x_scale[:, None]), -_FP8_MAX), _FP8_MAX)
    if EMULATE_FP8:
        return _round_e4m3(v), x_scale
    else:
        return v.to(tl.float8e4nv).to(tl.float32), x_scale


@triton.jit
def _group_dot(acc, w, q, scale, VEC: tl.constexpr):
    """acc [BLOCK_N, G_STEP, GK / VEC] + the products w [BLOCK_N, G_STEP, GK] * q [G_STEP, GK] summed over each run of
    VEC input features (a thread's vector load: the sums stay in registers; E4M3 products are exact in fp32), times
    their group's scale [BLOCK_N, G_STEP] (x_scale * weight_scale)."""
    prod = w * q[None, :, :]
    runs = tl.sum(tl.reshape(prod, (prod.shape[0], prod.shape[1], prod.shape[2] // VEC, VEC)), axis=3)
    return acc + runs * scale[:, :, None]


@triton.jit
def _group_scales(ws_ptr, ws_rows, groups, num_groups, mask_n, pid_n, stride_sn, BN: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """The weight scales of the step's groups for the tile's columns, [BLOCK_N, G_STEP]: loaded once per group when the
    tile lies in one block row (BN a multiple of BLOCK_N: every column has the same scale), else per column."""
    mask_g = groups < num_groups
    if BN % BLOCK_N == 0:
        ws = tl.load(ws_ptr + (pid_n * BLOCK_N // BN) * stride_sn + groups, mask=mask_g, other=0.0)
        return tl.zeros((BLOCK_N, 1), dtype=tl.float32) + ws[None, :]
    else:
        return tl.load(ws_rows[:, None] + groups[None, :], mask=mask_n[:, None] & mask_g[None, :], other=0.0)


@triton.jit
def _fp8_block_gemv_kernel(
    x_ptr, w_ptr, ws_ptr, bias_ptr, y_ptr, part_ptr, counter_ptr,
    N, K, num_groups, steps_per_split,
    stride_xm, stride_wn, stride_sn,
    ROWS: tl.constexpr, BN: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    EMULATE_FP8: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr,
    G_STEP: tl.constexpr, GK: tl.constexpr, VEC: tl.constexpr, NUM_STAGES: tl.constexpr,
    PREFETCH_ROWS: tl.constexpr, PREFETCH_LINES: tl.constexpr, PDL: tl.constexpr,
):
    # x: [ROWS, K], w: [N, K] -> y: [ROWS, N] contiguous. A K step is G_STEP groups of GK (= bk) features: the weight
    # tile [BLOCK_N, G_STEP, GK], each row's codes [G_STEP, GK] and scales [G_STEP]; accumulators [BLOCK_N, G_STEP,
    # GK / VEC] per row of x, scaled per step, reduced once at the end.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    ws_rows = ws_ptr + (offs_n // BN) * stride_sn  # [BLOCK_N]: each column's row of block scales
    first_step = pid_k * steps_per_split
    if PDL and PREFETCH_ROWS > 0:  # weights are constants: ask for the first step's tile before the wait
        prefetch_l2_rows(w_ptr + (pid_n * BLOCK_N) * stride_wn + first_step * G_STEP * GK, stride_wn,
                         N - pid_n * BLOCK_N, K - first_step * G_STEP * GK, PREFETCH_ROWS, PREFETCH_LINES, 128)
    wait_prior(PDL)  # before reading what the previous kernel wrote (kernels/pdl.py)

    acc0 = tl.zeros((BLOCK_N, G_STEP, GK // VEC), dtype=tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    offs_g = tl.arange(0, G_STEP)
    offs_c = tl.arange(0, GK)
    num_steps = min(steps_per_split, tl.cdiv(num_groups, G_STEP) - first_step)
    for step in tl.range(0, num_steps, num_stages=NUM_STAGES):
        groups = (first_step + step) * G_STEP + offs_g  # [G_STEP]
        offs_k = groups[:, None] * GK + offs_c[None, :]  # [G_STEP, GK]
        mask_k = offs_k < K
        w = _load_weights(w_ptr + offs_n[:, None, None] * stride_wn + offs_k[None, :, :],
                          mask_n[:, None, None] & mask_k[None, :, :], not (EVEN_N and EVEN_K))
        w = w.to(tl.float32)  # [BLOCK_N, G_STEP, GK]
        ws = _group_scales(ws_ptr, ws_rows, groups, num_groups, mask_n, pid_n, stride_sn, BN, BLOCK_N)
        q, xs = _group_codes(x_ptr, offs_k, mask_k, EMULATE_FP8, not EVEN_K)
        acc0 = _group_dot(acc0, w, q, ws * xs[None, :], VEC)
        if ROWS > 1:
            q, xs = _group_codes(x_ptr + stride_xm, offs_k, mask_k, EMULATE_FP8, not EVEN_K)
            acc1 = _group_dot(acc1, w, q, ws * xs[None, :], VEC)
        if ROWS > 2:
            q, xs = _group_codes(x_ptr + 2 * stride_xm, offs_k, mask_k, EMULATE_FP8, not EVEN_K)
            acc2 = _group_dot(acc2, w, q, ws * xs[None, :], VEC)
        if ROWS > 3:
            q, xs = _group_codes(x_ptr + 3 * stride_xm, offs_k, mask_k, EMULATE_FP8, not EVEN_K)
            acc3 = _group_dot(acc3, w, q, ws * xs[None, :], VEC)

    # the runs summed per group, then (in _sums_epilogue) over the groups: [BLOCK_N] per row of x
    _sums_epilogue(tl.sum(acc0, axis=2), tl.sum(acc1, axis=2), tl.sum(acc2, axis=2), tl.sum(acc3, axis=2), y_ptr,
                   part_ptr, counter_ptr, bias_ptr, offs_n, mask_n, N, pid_n, pid_k, 1, ROWS, HAS_BIAS, SPLIT_K, True)


def _gemv(x2: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor, block_size: list[int] | tuple[int, int],
          bias: torch.Tensor | None, y: torch.Tensor, cfg: GemvConfig) -> None:
    """y [M, N] = the fp8_block linear of x2 [M, K] (M <= GEMV_MAX_ROWS) by the GEMV kernel."""
    _check_config(cfg, 1, 1)
    (n, k), (bn, bk) = qweight.shape, block_size
    g_step = max(1, cfg.block_k // bk)  # the K step: whole groups, at least one
    step_k = g_step * bk
    num_groups = triton.cdiv(k, bk)
    plan = _split_plan(y, triton.cdiv(num_groups, g_step), dataclasses.replace(cfg, reduce_in_kernel=True),
                       torch.float32)
    prefetch_rows, lines_per_row = prefetch_rows_plan(cfg.block_n, step_k)
    _fp8_block_gemv_kernel[plan.grid](
        x2, qweight, weight_scale, bias if bias is not None else y, y, plan.part, plan.counters,
        n, k, num_groups, plan.steps_per_split, x2.stride(0), qweight.stride(0), weight_scale.stride(0),
        ROWS=x2.shape[0], BN=bn, HAS_BIAS=bias is not None, SPLIT_K=plan.split_k, EMULATE_FP8=_interpreting(),
        EVEN_N=n % cfg.block_n == 0, EVEN_K=k % step_k == 0, BLOCK_N=cfg.block_n, G_STEP=g_step, GK=bk,
        VEC=min(bk, 16), NUM_STAGES=cfg.num_stages, PREFETCH_ROWS=prefetch_rows, PREFETCH_LINES=lines_per_row,
        num_warps=cfg.num_warps, **pdl_args(x2))


# --- GEMM ------------------------------------------------------------------------------------------
@triton.jit
def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, M, K, num_groups, stride_xm, EMULATE_FP8: tl.constexpr,
                            GK: tl.constexpr, GROUPS: tl.constexpr, PDL: tl.constexpr):
    # program (row, j): groups j * GROUPS ... of one row of x [M, K] -> codes q [M, K] (contiguous), scales s
    # [num_groups, M] (a GEMM step reads its rows' scales of one group as one contiguous vector)
    wait_prior(PDL)
    row = tl.program_id(0)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    offs_k = groups[:, None] * GK + tl.arange(0, GK)[None, :]  # [GROUPS, GK]
    mask = offs_k < K
    a = tl.load(x_ptr + row * stride_xm + offs_k, mask=mask, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(a), axis=1), 1e-12), _FP8_MAX)  # [GROUPS]
    tl.store(q_ptr + row * K + offs_k, _codes(tl.math.div_rn(a, scale[:, None]), _FP8_MAX, q_ptr, False, EMULATE_FP8),
             mask=mask)
    tl.store(s_ptr + groups * M + row, scale, mask=groups < num_groups)


def quantize_groups(x2: torch.Tensor, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 [M, K] (unit stride along K) -> (E4M3 codes [M, K], fp32 scales [ceil(K / block_k), M]): the reference's
    ``quantize_activation_fp8_blocks`` (the same codes and scales; the scales transposed) in one kernel."""
    num_rows, k = x2.shape
    num_groups = triton.cdiv(k, block_k)
    codes = torch.empty((num_rows, k), dtype=torch.float8_e4m3fn, device=x2.device)
    scales = torch.empty((num_groups, num_rows), dtype=torch.float32, device=x2.device)
    if num_rows:
        groups = max(1, (64 if _interpreting() else 2048) // block_k)  # features per program: 2048 on the GPU
        _quantize_groups_kernel[(num_rows, triton.cdiv(num_groups, groups))](
            x2, codes, scales, num_rows, k, num_groups, x2.stride(0), EMULATE_FP8=_interpreting(), GK=block_k,
            GROUPS=groups, num_warps=4, **pdl_args(x2))
    return codes, scales


@triton.jit
def _store_rows(y_ptr, val, bias_ptr, offs_m, offs_n, mask_out, mask_n, N, HAS_BIAS: tl.constexpr):
    """y [M, N] at the tile = val (fp32 [BLOCK_M, BLOCK_N]) + bias, in y's dtype."""
    if HAS_BIAS:
        val += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], val.to(y_ptr.dtype.element_ty), mask=mask_out)


@triton.jit
def _fp8_block_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, y_ptr, part_ptr, counter_ptr,
    M, N, K, BN, k_steps_per_split,
    stride_xm, stride_wn, stride_sn,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, PREQUANT: tl.constexpr, EMULATE_FP8: tl.constexpr,
    DOT_FP16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PDL: tl.constexpr,
):
    # x: [M, K] in x's dtype, or its E4M3 codes with their scales xs [num_groups, M] (PREQUANT); w: [N, K] ->
    # y: [M, N] contiguous. Split over K: partial sums [SPLIT_K, M, N] fp32 added by the tile's last program.
    # DOT_FP16: the step's dot on the codes as fp16 (exact), for groups narrower than the FP8 dot's K.
    tl.static_assert(DOT_FP16 or BLOCK_K >= _FP8_DOT_MIN_K, "an FP8 dot needs K >= FP8_DOT_MIN_K: DOT_FP16 below it")
    offs_m, offs_n, mask_m, mask_n, pid_k = output_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    wait_prior(PDL)  # before reading what the previous kernel wrote (kernels/pdl.py)
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    w_rows = w_ptr + offs_n[:, None] * stride_wn
    ws_rows = ws_ptr + (offs_n // BN) * stride_sn  # [BLOCK_N]: each column's row of block scales

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first_step = pid_k * k_steps_per_split
    num_steps = min(k_steps_per_split, tl.cdiv(K, BLOCK_K) - first_step)
    for step in range(num_steps):
        group = first_step + step
        offs_k = group * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if PREQUANT:  # codes and the group's scales, as quantize_groups wrote them
            x_scale = tl.load(xs_ptr + group * M + offs_m, mask=mask_m, other=0.0)  # [BLOCK_M]
        else:  # the group's scale per row (masked lanes are 0: no effect on the max), then its codes
            a = a.to(tl.float32)
            x_scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(a), axis=1), 1e-12), _FP8_MAX)
            a = tl.minimum(tl.maximum(tl.math.div_rn(a, x_scale[:, None]), -_FP8_MAX), _FP8_MAX)
        w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        if not EMULATE_FP8:  # float8e4nv codes (already, with PREQUANT)
            q = a.to(tl.float8e4nv)
        elif PREQUANT:  # the interpreter: the codes' values in fp32 (its conversion to float8e4nv is wrong)
            q = a.to(tl.float32)
        else:
            q = _round_e4m3(a)
        if DOT_FP16:
            part = tl.dot(q.to(tl.float16), tl.trans(w.to(tl.float16)))
        elif EMULATE_FP8:
            part = tl.dot(q, tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            part = tl.dot(q, tl.trans(w))
        w_scale = tl.load(ws_rows + group, mask=mask_n, other=0.0)  # [BLOCK_N]
        acc += part * x_scale[:, None] * w_scale[None, :]

    mask_out = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        _store_rows(y_ptr, acc, bias_ptr, offs_m, offs_n, mask_out, mask_n, N, HAS_BIAS)
    else:
        tile = offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_ptr + pid_k * M * N + tile, acc, mask=mask_out)
        tile_id = tl.program_id(0)
        if _arrive(counter_ptr + tile_id, SPLIT_K):  # the last of the tile's programs: all partials are in
            tl.store(counter_ptr + tile_id, 0)  # zero again for the next launch
            tot = tl.load(part_ptr + tile, mask=mask_out, other=0.0, cache_modifier=".cg")
            for s in range(1, SPLIT_K):  # split order: deterministic
                tot += tl.load(part_ptr + s * M * N + tile, mask=mask_out, other=0.0, cache_modifier=".cg")
            _store_rows(y_ptr, tot, bias_ptr, offs_m, offs_n, mask_out, mask_n, N, HAS_BIAS)


def _gemm(x2: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor, block_size: list[int] | tuple[int, int],
          bias: torch.Tensor | None, y: torch.Tensor, cfg: BlockConfig) -> None:
    """y [M, N] = the fp8_block linear of x2 [M, K] by the GEMM kernel."""
    assert cfg.block_m >= 16 and cfg.block_m & (cfg.block_m - 1) == 0, f"{cfg}: block_m must be a power of 2 >= 16"
    assert cfg.block_n >= 16 and cfg.block_n & (cfg.block_n - 1) == 0, f"{cfg}: block_n must be a power of 2 >= 16"
    (n, k), (bn, bk) = qweight.shape, block_size
    num_rows = x2.shape[0]
    num_tiles, split_k, steps_per_split, part, _, _ = split_k_plan(y, k, cfg.block_m, cfg.block_n, bk, cfg.split_k)
    counters = _tile_counters(y.device, num_tiles) if split_k > 1 else y
    dot_fp16 = _dot_in_fp16(bk)
    assert dot_fp16 or bk >= FP8_DOT_MIN_K, f"block_k {bk}: an FP8 dot needs K >= {FP8_DOT_MIN_K} on the GPU"
    xs = y  # never read without prequant
    if cfg.prequant:
        x2, xs = quantize_groups(x2, bk)
    _fp8_block_gemm_kernel[(num_tiles, split_k)](
        x2, xs, qweight, weight_scale, bias if bias is not None else y, y, part, counters,
        num_rows, n, k, bn, steps_per_split, x2.stride(0), qweight.stride(0), weight_scale.stride(0),
        HAS_BIAS=bias is not None, SPLIT_K=split_k, PREQUANT=cfg.prequant, EMULATE_FP8=_interpreting(),
        DOT_FP16=dot_fp16, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x2))


# --- entry points ----------------------------------------------------------------------------------
def _check_inputs(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
                  block_size: list[int] | tuple[int, int], bias: torch.Tensor | None) -> torch.Tensor:
    """Validates the inputs (user-facing errors); returns x as [M, K] with unit stride along K."""
    if x.device.type != "cuda" and not _interpreting():
        raise RuntimeError("fp8_block_linear needs a CUDA tensor (or TRITON_INTERPRET=1 for the CPU interpreter)")
    if x.dtype not in X_DTYPES:
        raise ValueError(f"x dtype {x.dtype} is not supported ({', '.join(map(str, X_DTYPES))})")
    if qweight.dtype != torch.float8_e4m3fn or qweight.dim() != 2 or qweight.stride(1) != 1:
        raise ValueError(f"qweight must be a row-major float8_e4m3fn [N, K] tensor, got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    (n, k), (bn, bk) = qweight.shape, block_size
    if not supports(block_size):
        raise ValueError(f"block_size {list(block_size)}: the kernel takes a block width along K that is a power of "
                         f"two from {BLOCK_K_RANGE[0]} to {BLOCK_K_RANGE[1]}")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, qweight {k}")
    blocks = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    if tuple(weight_scale.shape) != blocks or weight_scale.dtype != torch.float32 or weight_scale.stride(1) != 1:
        raise ValueError(f"weight_scale is {weight_scale.dtype} {tuple(weight_scale.shape)}; expected row-major "
                         f"float32 {blocks} (one scale per {bn} x {bk} block of qweight {n} x {k})")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias {tuple(bias.shape)} does not match {n} output features")
    x2 = x.reshape(-1, k)  # x2: [M, K]
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def fp8_block_linear(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
                     block_size: list[int] | tuple[int, int], bias: torch.Tensor | None = None, *,
                     config: BlockConfig | GemvConfig | None = None) -> torch.Tensor:
    """An fp8_block linear (see the module docstring): x [..., K] fp16/bf16/fp32 -> [..., N] in x's dtype, at any
    number of rows: the GEMV up to GEMV_ROWS rows, the GEMM above. ``config`` forces a kernel and its configuration
    (a GemvConfig: the GEMV, at most GEMV_MAX_ROWS rows; a BlockConfig: the GEMM), for benchmarks and tests."""
    x2 = _check_inputs(x, qweight, weight_scale, block_size, bias)
    (n, k), num_rows = qweight.shape, x2.shape[0]
    if isinstance(config, GemvConfig) and num_rows > GEMV_MAX_ROWS:
        raise ValueError(f"a GemvConfig runs the GEMV, which takes at most GEMV_MAX_ROWS = {GEMV_MAX_ROWS} rows of x, "
                         f"got {num_rows} (x {tuple(x.shape)}); pass a BlockConfig or no config for more")
    y = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return y.reshape(*x.shape[:-1], n)
    if isinstance(config, GemvConfig) or (config is None and num_rows <= GEMV_ROWS):
        _gemv(x2, qweight, weight_scale, block_size, bias, y, config or default_gemv_config(num_rows, x.device))
    else:
        _gemm(x2, qweight, weight_scale, block_size, bias, y, config or default_config(num_rows, x.device))
    return y.reshape(*x.shape[:-1], n)


def ref_fp8_block_linear(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
                         block_size: list[int] | tuple[int, int], bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference: the runtime's reference ``fp8_block`` linear."""
    from kernels.torch_quant import make_quant_linear

    w = {"qweight": qweight, "weight_scale": weight_scale}
    if bias is not None:
        w["bias"] = bias
    return make_quant_linear("fp8_block", w, {"block_size": list(block_size)}, x.dtype)(x)
