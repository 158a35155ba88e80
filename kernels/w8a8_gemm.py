"""W8A8 GEMM (INT8 and FP8 E4M3) with the activation quantization fused in, for small batches.

``y = (quant(x) @ qweight.T) * x_scale * weight_scale + bias`` with x in fp16/bf16/fp32 and y in x's
dtype, the arithmetic of the reference ``w8a8_int8`` / ``fp8`` paths of ``kernels.torch_quant.make_quant_linear``:

    x_scale  dynamic: per token (row), max|x_row| / QMAX (floored at 1e-8 for int8, 1e-12 for fp8);
             static: the calibrated ``input_scale`` [1]
    quant    int8: round-half-even(x / x_scale) clamped to act_qmin..127 (act_qmin -127, or -128 for imported
             checkpoints whose static activations take the full int8 range: ``torch_quant.int8_act_qmin``);
             fp8: x / x_scale clamped to +-448, rounded to E4M3 (round-half-even)
    qweight  int8 or float8_e4m3fn [N, K] (as the passes write it), weight_scale fp32 [N] or [1]
    acc      int8: exact int32;  fp8: fp32 tensor-core accumulation

Decode is memory-bound: a separate activation-quantization kernel costs launches and a round trip of
x through HBM per linear, and cuBLAS's FP8/INT8 GEMMs are tuned for large M (``torch._int_mm`` needs
M > 16; ``torch._scaled_mm`` at M = 1 takes ~2x the time of the bf16 GEMV on H100). Here each program
first reads its rows of x once over all of K for the per-token max (a few KiB per row, from L1/L2), then
walks its K range: quantize the x step in registers, ``tl.dot`` it against the 1-byte weight tile. Small
M leaves few output tiles, so K is split across programs whose scaled fp32 partial sums a second kernel
adds with the bias (as in ``kernels.w4a16_gemm``). From ``FUSED_MAX_ROWS`` rows on the runtime uses cuBLAS
(``_scaled_mm`` / ``_int_mm``); up to ``kernels.gemv.GEMV_MAX_ROWS`` the GEMV kernel (``kernels.gemv.w8a8_gemv``).

NOTE: under TRITON_INTERPRET the fp32 -> float8e4nv conversion of the interpreter rounds wrongly (it can
lose an exponent step), so the interpreter path rounds to E4M3 in fp32 arithmetic (``_round_e4m3``) and
multiplies in fp32; the GPU path converts with the hardware's round-to-nearest-even and multiplies FP8
on tensor cores. Both give the reference's quantized values; ``python -m builder.devtools.check_kernels`` checks
the GPU path at real shapes. No host synchronisation: grids come from shapes (CUDA-graph capturable).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.w4a16_gemm import _interpreting, output_tile, reduce_split_k, split_k_plan, store_output_tile

X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
W_DTYPES = (torch.int8, torch.float8_e4m3fn)
# The runtime sends more rows than this to cuBLAS: at 32-64 rows each program re-reads all its rows of x
# for the per-token max and re-quantizes them per output tile, and cuBLAS wins (docs/BENCHMARKS.md)
FUSED_MAX_ROWS = 16


@dataclass(frozen=True)
class W8A8Config:
    """One launch configuration."""

    block_m: int  # rows of x per tile (>= 16: tl.dot's minimum)
    block_n: int  # output features per tile
    block_k: int  # input features per K step (>= 32 for 1-byte dots)
    split_k: int = 0  # programs sharing one tile's K range; 0 = from the tile count and the SM count
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4


# Picked by M: the first row whose bound is >= M. Tuned with ``python -m kernels.bench.w8a8 --sweep`` on
# H100 (FP8, Llama-3-8B shapes; docs/BENCHMARKS.md).
_CUDA_CONFIGS: list[tuple[int, W8A8Config]] = [
    (16, W8A8Config(16, 128, 128, num_warps=8, num_stages=3)),
    (32, W8A8Config(32, 128, 256, num_warps=4, num_stages=3)),
    # 32-row tiles at 64 rows too: 64-row FP8 tiles take Hopper's wgmma path, whose reduced-precision
    # accumulation measured 0.5-0.7% off the reference; grouped order shares each weight tile via L2
    (1 << 62, W8A8Config(32, 128, 256, num_warps=4, num_stages=3)),  # (benchmarks; the runtime stops at 16)
]
_INTERPRETER_CONFIG = W8A8Config(16, 32, 32, split_k=1, group_m=4, num_warps=1, num_stages=1)


def default_config(num_rows: int, device: torch.device) -> W8A8Config:
    if _interpreting() or device.type != "cuda":
        return _INTERPRETER_CONFIG
    return next(cfg for bound, cfg in _CUDA_CONFIGS if num_rows <= bound)


# --- kernels ---------------------------------------------------------------------------------------
_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: (v + MAGIC) - MAGIC rounds |v| < 2^22 to an integer, ties to even


@triton.jit
def _round_e4m3(v):
    """v (fp32, |v| <= 448) rounded to the nearest E4M3 value, ties to even, as fp32. E4M3 has 3 mantissa
    bits and a smallest normal exponent of -6 (below it, subnormals with the same spacing 2^-9)."""
    e = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    ulp = ((tl.maximum(e, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(max(e, -6) - 3)
    return ((v / ulp + _MAGIC) - _MAGIC) * ulp


@triton.jit
def div_exact(a, s, r):
    """``a / s`` correctly rounded (the IEEE division torch computes), given ``r`` = 1 / s correctly rounded
    (``tl.math.div_rn``, once per scale): the product a * r and one correction with fused multiply-adds,
    q + (a - q s) r, which rounds to the correctly rounded quotient (Markstein's theorem; 40M random and
    rounding-boundary cases checked against IEEE division in fp32, no mismatch). Three operations: the GPU's ``/`` is
    an approximation within 2 ulp, so a value next to a rounding boundary took the neighbouring code there (the CPU
    reference's tokens parted from the GPU's), and ``div_rn`` per element measured 1.5x slower in the GEMM. Used where a
    static scale defines the codes (kernels.gemv's W8A8 GEMV says why not for per-token scales). Where the correction
    is NaN - a quotient past fp32's range (inf * s - inf), or r itself infinite or NaN (a subnormal or infinite s) -
    the plain quotient a / s is taken instead: such scales are degenerate, and a / s is what the reference computes
    up to its last ulp."""
    q = a * r
    exact = tl.fma(tl.fma(-q, s, a), r, q)
    return tl.where(exact == exact, exact, a / s)


@triton.jit
def _qrange(INT8: tl.constexpr):
    """(largest code, floor of the per-token max): the reference's ``quantize_activation_int8/fp8``."""
    if INT8:
        return 127.0, 1e-8
    else:
        return 448.0, 1e-12


@triton.jit
def _w8a8_gemm_kernel(
    x_ptr, w_ptr, ws_ptr, xs_ptr, bias_ptr, out_ptr,
    M, N, K, k_steps_per_split,
    stride_xm, stride_wn,
    stride_om, stride_os,  # out: y [M, N] (stride_os unused), or partial sums [SPLIT_K, M, N] fp32
    INT8: tl.constexpr, STATIC: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr, EMULATE_FP8: tl.constexpr, QMIN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # QMIN: the lowest code (fp32): -qmax, or -128.0 for int8 codes that take the full range (act_qmin -128)
    offs_m, offs_n, mask_m, mask_n, pid_k = output_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    qmax, eps = _qrange(INT8)

    # x_scale: [BLOCK_M] per-token scales computed here from this tile's rows, read over all of K, or the
    # static calibrated scale
    if not STATIC:
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & (offs_k[None, :] < K), other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(a.to(tl.float32)), axis=1))
        x_scale = tl.math.div_rn(tl.maximum(amax, eps), tl.zeros_like(amax) + qmax)  # IEEE, as the reference's
    else:
        x_scale = tl.zeros((BLOCK_M,), dtype=tl.float32) + tl.load(xs_ptr).to(tl.float32)
    x_rcp = tl.math.div_rn(tl.zeros_like(x_scale) + 1.0, x_scale)  # for div_exact (static scales)

    if INT8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first_step = pid_k * k_steps_per_split
    num_steps = min(k_steps_per_split, tl.cdiv(K, BLOCK_K) - first_step)
    for step in range(num_steps):
        offs_k = (first_step + step) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        # x / x_scale: a static scale's (it defines the codes) as the reference divides, per-token ones by Triton's
        # ``/``, approximate on the GPU (a value within an ulp of a rounding boundary may take the neighbouring code;
        # the policy and its cost: kernels.gemv's W8A8 GEMV)
        if STATIC:
            v = div_exact(a.to(tl.float32), x_scale[:, None], x_rcp[:, None])
        else:
            v = a.to(tl.float32) / x_scale[:, None]
        v = tl.minimum(tl.maximum(v, QMIN), qmax)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None],
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if INT8:
            acc = tl.dot(((v + _MAGIC) - _MAGIC).to(tl.int8), w, acc, out_dtype=tl.int32)
        elif EMULATE_FP8:
            acc = tl.dot(_round_e4m3(v), w.to(tl.float32), acc, input_precision="ieee")
        else:
            # Hopper's FP8 MMA accumulates in reduced precision; promote into fp32 once per K step
            acc = tl.dot(v.to(tl.float8e4nv), w, acc, max_num_imprecise_acc=BLOCK_K)

    if PER_CHANNEL:
        w_scale = tl.load(ws_ptr + offs_n, mask=mask_n, other=0.0)
    else:
        w_scale = tl.zeros((BLOCK_N,), dtype=tl.float32) + tl.load(ws_ptr)
    y = acc.to(tl.float32) * x_scale[:, None] * w_scale[None, :]
    store_output_tile(out_ptr, y, bias_ptr, offs_m, offs_n, mask_m, mask_n, pid_k, stride_om, stride_os, HAS_BIAS,
                      SPLIT_K)


# --- entry points ----------------------------------------------------------------------------------
def _check_inputs(name: str, x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
                  bias: torch.Tensor | None, x_dtypes: tuple[torch.dtype, ...] = X_DTYPES
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Validates a W8A8 linear's inputs (user-facing errors, naming the entry point ``name``); returns qweight
    [N, K] and x as [M, K], both with unit stride along K. ``x_dtypes``: those x may have (already quantized rows:
    the weight's)."""
    if x.device.type != "cuda" and not _interpreting():
        raise RuntimeError(f"{name} needs a CUDA tensor (or TRITON_INTERPRET=1 for the CPU interpreter)")
    if x.dtype not in x_dtypes:
        raise ValueError(f"x dtype {x.dtype} is not supported ({', '.join(map(str, x_dtypes))})")
    if qweight.dtype not in W_DTYPES or qweight.dim() != 2:
        raise ValueError(f"qweight must be a 2-D int8 or float8_e4m3fn [N, K] tensor, got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    n, k = qweight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, qweight {k}")
    if weight_scale.numel() not in (1, n):
        raise ValueError(f"weight_scale has {weight_scale.numel()} values; expected 1 or {n}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias {tuple(bias.shape)} does not match {n} output features")
    x2 = x.reshape(-1, k)  # x2: [M, K]
    return (qweight if qweight.stride(1) == 1 else qweight.contiguous(),
            x2 if x2.stride(-1) == 1 else x2.contiguous())


def act_qmin_arg(name: str, qweight: torch.Tensor, act_qmin: int) -> float:
    """The kernels' QMIN (the lowest activation code, fp32) for ``act_qmin``: -127 or -128 for int8 weights
    (``kernels.torch_quant.INT8_ACT_QMINS``), -127 (the default, ignored: e4m3's is -448) for fp8 ones."""
    from kernels.torch_quant import INT8_ACT_QMINS

    if qweight.dtype != torch.int8:
        if act_qmin != INT8_ACT_QMINS[0]:
            raise ValueError(f"{name}: act_qmin {act_qmin} bounds int8 activation codes; the weight is {qweight.dtype}")
        return -448.0
    if isinstance(act_qmin, bool) or act_qmin not in INT8_ACT_QMINS:
        raise ValueError(f"{name}: act_qmin {act_qmin!r} is not one of {INT8_ACT_QMINS}")
    return float(act_qmin)


def w8a8_linear(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
                input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None, *,
                config: W8A8Config | None = None, act_qmin: int = -127) -> torch.Tensor:
    """W8A8 linear (INT8 when ``qweight`` is int8, FP8 when float8_e4m3fn); see the module docstring.

    x: [..., K] fp16/bf16/fp32 -> [..., N] in x's dtype. ``input_scale`` None = dynamic per-token
    activation scales, else the static scale [1]. ``act_qmin``: the lowest int8 activation code, -127 or -128.
    Runs the fused kernel at any M (``config`` forces one configuration); the runtime sends at most
    ``FUSED_MAX_ROWS`` rows here.
    """
    qmin = act_qmin_arg("w8a8_linear", qweight, act_qmin)
    qweight, x2 = _check_inputs("w8a8_linear", x, qweight, weight_scale, bias)
    (n, k), num_rows = qweight.shape, x2.shape[0]
    y = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return y.reshape(*x.shape[:-1], n)
    cfg = config or default_config(num_rows, x.device)
    num_tiles, split_k, steps_per_split, out, stride_om, stride_os = split_k_plan(
        y, k, cfg.block_m, cfg.block_n, cfg.block_k, cfg.split_k)
    ws = weight_scale.reshape(-1).float()
    xs = input_scale.reshape(-1).float() if input_scale is not None else ws  # ws: never read unless STATIC
    bias_arg = bias if bias is not None else y
    int8 = qweight.dtype == torch.int8
    _w8a8_gemm_kernel[(num_tiles, split_k)](
        x2, qweight, ws, xs, bias_arg, out, num_rows, n, k, steps_per_split,
        x2.stride(0), qweight.stride(0), stride_om, stride_os,
        INT8=int8, STATIC=input_scale is not None, PER_CHANNEL=ws.numel() == n and n > 1,
        HAS_BIAS=bias is not None, SPLIT_K=split_k, EMULATE_FP8=_interpreting() and not int8, QMIN=qmin,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split_k > 1:
        reduce_split_k(out, bias_arg, y, split_k, bias is not None)
    return y.reshape(*x.shape[:-1], n)


@triton.jit
def _row_scale(x_row, K, INT8: tl.constexpr, BLOCK_K: tl.constexpr):
    """A row's per-token scale, max(amax, floor) / qmax, as the reference's (an IEEE division)."""
    qmax, eps = _qrange(INT8)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        amax = tl.maximum(amax, tl.abs(tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)))
    return tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), eps), qmax)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, INT8: tl.constexpr,
                          EMULATE_FP8: tl.constexpr, BLOCK_K: tl.constexpr):
    # one program per row: the row's max over K, then its codes; x: [M, K] -> q: [M, K], s: [M] fp32
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_xm
    qmax, _ = _qrange(INT8)
    scale = _row_scale(x_row, K, INT8, BLOCK_K)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        v = tl.math.div_rn(tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32), scale)
        tl.store(q_ptr + row * stride_qm + offs, _codes(v, qmax, q_ptr, INT8, EMULATE_FP8), mask=offs < K)


@triton.jit
def _codes(v, qmax, q_ptr, INT8: tl.constexpr, EMULATE_FP8: tl.constexpr):
    """Scaled values ``v`` (fp32) clamped to +-qmax and rounded to the codes ``q_ptr`` holds (int8 or fp8 e4m3)."""
    v = tl.minimum(tl.maximum(v, -qmax), qmax)
    if INT8:
        return ((v + _MAGIC) - _MAGIC).to(tl.int8)
    elif EMULATE_FP8:
        return _round_e4m3(v).to(q_ptr.dtype.element_ty)
    else:
        return v.to(tl.float8e4nv)


@triton.jit
def quantize_row_store(v, mask, q_row_ptr, s_ptr, INT8: tl.constexpr, EMULATE_FP8: tl.constexpr):
    """A whole row held in registers (fp32 ``v``, the activation's values; masked lanes 0) quantized per token as
    ``_quantize_rows_kernel`` does it: its scale to ``s_ptr``, its codes to ``q_row_ptr`` (for kernels that make
    the row, such as the norms, so that no other kernel reads it back)."""
    qmax, eps = _qrange(INT8)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(v), axis=0), eps), qmax)
    tl.store(s_ptr, scale)
    tl.store(q_row_ptr, _codes(tl.math.div_rn(v, scale), qmax, q_row_ptr, INT8, EMULATE_FP8), mask=mask)


@triton.jit
def _quantize_rows_static_kernel(x_ptr, s_ptr, q_ptr, K, stride_xm, stride_qm, QMIN: tl.constexpr,
                                 INT8: tl.constexpr, EMULATE_FP8: tl.constexpr, BLOCK_K: tl.constexpr):
    # program (row, K block): codes of x [M, K] at the static scale s [1], the reference's arithmetic (an IEEE
    # quotient, div_exact; int8 round half to even clamped to QMIN..127, fp8 clamped to +-448 and rounded to e4m3)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(q_ptr + row * stride_qm + offs, static_codes(x, tl.load(s_ptr).to(tl.float32), q_ptr, QMIN, INT8,
                                                           EMULATE_FP8), mask=mask)


@triton.jit
def static_codes(x, scale, q_ptr, QMIN: tl.constexpr, INT8: tl.constexpr, EMULATE_FP8: tl.constexpr):
    """Values ``x`` (fp32) as codes of ``q_ptr``'s dtype at a calibrated (static) ``scale`` (fp32 scalar): the
    reference's arithmetic (an IEEE quotient, div_exact; int8 round half to even clamped to QMIN..127, fp8 clamped to
    +-448 and rounded to e4m3). Shared by ``quantize_rows_static`` and the kernels that make rows for a linear with
    an input scale (the norms, the SwiGLU: ``runtime.executor.plan_fusions``)."""
    qmax, _ = _qrange(INT8)
    rcp = tl.math.div_rn(scale * 0.0 + 1.0, scale)  # once per program, for div_exact
    # NaN stays NaN on the GPU (the reference's clamp keeps it: an fp8 NaN code, a NaN output; the interpreter's fp8
    # conversion does not represent it)
    v = tl.minimum(tl.maximum(div_exact(x, scale, rcp), QMIN, propagate_nan=tl.PropagateNan.ALL), qmax,
                   propagate_nan=tl.PropagateNan.ALL)
    if INT8:
        return ((v + _MAGIC) - _MAGIC).to(tl.int8)
    elif EMULATE_FP8:
        return _round_e4m3(v).to(q_ptr.dtype.element_ty)
    else:
        return v.to(tl.float8e4nv)


def static_scale_arg(what: str, input_scale: torch.Tensor, codes: torch.Tensor,
                     act_qmin: int) -> tuple[torch.Tensor, float]:
    """(the scale as the kernels read it, fp32 [1]; their QMIN) for a kernel writing ``codes`` at a calibrated
    ``input_scale`` (one value), ``act_qmin`` its lowest int8 code (ValueError naming ``what`` otherwise)."""
    if input_scale.numel() != 1:
        raise ValueError(f"{what}: input_scale has {input_scale.numel()} values; static codes take one")
    return input_scale.reshape(1).float(), act_qmin_arg(what, codes, act_qmin)


def quantize_rows_static(x: torch.Tensor, input_scale: torch.Tensor, dtype: torch.dtype,
                         act_qmin: int = -127) -> tuple[torch.Tensor, torch.Tensor]:
    """Static per-tensor quantization in one kernel: x [M, K] -> (codes [M, K] in ``dtype``, the scale expanded to
    [M, 1] fp32), the codes of ``kernels.torch_quant.quantize_activation_int8 / _fp8(x, input_scale)`` (``act_qmin``:
    the lowest int8 code, -127 or -128). Feeds ``kernels.w8a8_rows`` for linears with a calibrated input scale."""
    if dtype not in W_DTYPES:
        raise ValueError(f"quantize_rows_static: dtype {dtype} is not int8 or float8_e4m3fn")
    if x.dim() != 2:
        raise ValueError(f"quantize_rows_static: expected x [M, K], got shape {tuple(x.shape)}")
    if input_scale.numel() != 1:
        raise ValueError(f"quantize_rows_static: input_scale has {input_scale.numel()} values; expected one")
    qmin = act_qmin_arg("quantize_rows_static", torch.empty(0, dtype=dtype), act_qmin)
    x = x if x.stride(-1) == 1 else x.contiguous()
    num_rows, k = x.shape
    q = torch.empty((num_rows, k), dtype=dtype, device=x.device)
    s = input_scale.reshape(1).float()
    if num_rows:
        block = 32 if _interpreting() else 1024
        _quantize_rows_static_kernel[(num_rows, triton.cdiv(k, block))](
            x, s, q, k, x.stride(0), q.stride(0), QMIN=qmin, INT8=dtype == torch.int8, EMULATE_FP8=_interpreting(),
            BLOCK_K=block, num_warps=4)
    return q, s.expand(num_rows, 1)


class QuantizedRows(NamedTuple):
    """Activations already quantized per token, as ``quantize_rows`` returns them, passed from the kernel that made
    them (a norm) to the W8A8 linear that reads them (``runtime.executor.plan_fusions``)."""

    codes: torch.Tensor  # [M, K] int8 or float8_e4m3fn
    scales: torch.Tensor  # [M, 1] fp32

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token quantization in one kernel (torch's takes six): x [M, K] -> (codes [M, K] in
    ``dtype`` (int8 or float8_e4m3fn), scales [M, 1] fp32), the reference's ``quantize_activation_*``
    arithmetic (IEEE divisions, as torch's: the same scales and codes). Meant to feed ``_scaled_mm`` / ``_int_mm``
    above ``FUSED_MAX_ROWS`` rows (the executor's W8A8 path); timed by ``kernels.bench.w8a8`` (``+qrows``)."""
    if dtype not in W_DTYPES:
        raise ValueError(f"quantize_rows: dtype {dtype} is not int8 or float8_e4m3fn")
    if x.dim() != 2:
        raise ValueError(f"quantize_rows: expected x [M, K], got shape {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_rows, k = x.shape
    q = torch.empty((num_rows, k), dtype=dtype, device=x.device)
    scales = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device)
    if num_rows:
        block = 32 if _interpreting() else 1024
        _quantize_rows_kernel[(num_rows,)](x, q, scales, k, x.stride(0), q.stride(0), INT8=dtype == torch.int8,
                                           EMULATE_FP8=_interpreting(), BLOCK_K=block, num_warps=4)
    return q, scales


@triton.jit
def _round_rows_kernel(x_ptr, y_ptr, K, stride_xm, stride_ym, EMULATE_FP8: tl.constexpr, BLOCK_K: tl.constexpr):
    # one program per row: _quantize_rows_kernel's scale and e4m3 codes, stored as code * scale in y's dtype
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_xm
    qmax, _ = _qrange(False)
    scale = _row_scale(x_row, K, False, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        v = tl.math.div_rn(tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32), scale)
        v = tl.minimum(tl.maximum(v, -qmax), qmax)
        if EMULATE_FP8:
            code = _round_e4m3(v)
        else:
            code = v.to(tl.float8e4nv).to(tl.float32)
        tl.store(y_ptr + row * stride_ym + offs, (code * scale).to(y_ptr.dtype.element_ty), mask=offs < K)


def round_rows_fp8(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] rounded per token to e4m3 and back, in one kernel: ``(codes * scales).to(x.dtype)`` for
    :func:`quantize_rows`' codes and scales (the reference's ``quantize_activation_fp8(x, None)``). What a W4A8
    linear (4-bit weights, fp8 activations) feeds the W4A16 kernels at the rows where no fp8 MMA runs
    (``runtime.executor``), so that its activations are rounded the same way at every batch size."""
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    num_rows, k = x2.shape
    y = torch.empty((num_rows, k), dtype=x.dtype, device=x.device)
    if num_rows:
        block = 32 if _interpreting() else 1024
        _round_rows_kernel[(num_rows,)](x2, y, k, x2.stride(0), y.stride(0), EMULATE_FP8=_interpreting(),
                                        BLOCK_K=block, num_warps=4)
    return y.reshape(x.shape)


def ref_w8a8_linear(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
                    input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                    act_qmin: int = -127) -> torch.Tensor:
    """The torch reference: the runtime's reference ``w8a8_int8`` / ``fp8`` linear (``act_qmin``: its quant attr)."""
    from kernels.torch_quant import make_quant_linear

    scheme = "w8a8_int8" if qweight.dtype == torch.int8 else "fp8"
    w = {"qweight": qweight, "weight_scale": weight_scale}
    if input_scale is not None:
        w["input_scale"] = input_scale
    if bias is not None:
        w["bias"] = bias
    return make_quant_linear(scheme, w, {"act_qmin": act_qmin} if act_qmin != -127 else {}, x.dtype)(x)
