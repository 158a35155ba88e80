"""W8A8 linear on rows already quantized per token (FP8 E4M3 and INT8), for decode batches (the runtime: FP8 at 2 to 64
rows, INT8 at 2 to 256).

``y = (codes @ qweight.T) * x_scale * weight_scale + bias`` where ``codes`` [M, K] and ``x_scale`` [M, 1] come
from the kernel that made the rows (a norm or the SwiGLU quantizes its output: ``kernels.w8a8_gemm.QuantizedRows``,
``runtime.executor.plan_fusions``), ``qweight`` [N, K] float8_e4m3fn or int8 with ``weight_scale`` [N] or [1]:
the arithmetic of ``kernels.w8a8_gemm.ref_w8a8_linear`` on those codes (int8: exact int32 sums, then
``float(sum) * x_scale * weight_scale``; fp8: fp32 sums of exact products).

Past the GEMV's one row the runtime ran the fused Triton GEMM (``kernels.w8a8_gemm``, which quantizes x again per
output tile) up to 16 rows and cuBLAS (``torch._scaled_mm`` / ``torch._int_mm``) beyond. At a decode
batch a linear is still bound by its weight bytes, and cuBLAS's kernels for FP8 with row-wise scales read them at
about half of the H200's bandwidth (64 rows: 26 us per Llama-3-8B linear on average, 2.1 TB/s of codes; profile in
docs/BENCHMARKS.md, session 39); here a layer's four linears take 19-42% less time from 8 to 64 rows. From 128
rows cuBLAS's tiles win (``_CUDA_CONFIGS``). Here a program streams a [BLOCK_N, BLOCK_K] tile of weight codes per K step
(contiguous rows, pipelined through shared memory) against the rows' [BLOCK_M, BLOCK_K] codes on tensor cores. With
``swap`` the weights are the MMA's M operand and the rows its N: ``acc^T = W x^T``, so 8-64 rows of x fill an MMA
whose M would otherwise need 64 (Hopper's wgmma). K is split across programs when the output tiles are too few for
the SMs; the partial sums [split_k, M, N] (fp32; int32 for INT8, exact) are added in split order by the last program
of each tile (a ticket on ``kernels.gemv``'s tile counters, as the GEMV does): one launch, deterministic.

Accumulation: Hopper's FP8 MMA keeps fewer bits than fp32 in its accumulator. ``tl.dot``'s
``max_num_imprecise_acc`` promotes the partial sum into an fp32 accumulator every ``promote`` input features
(default 32: every MMA instruction); the bench's error against the fp32 reference is cuBLAS's or lower (with
``use_fast_accum`` off, as the runtime calls it).

Under TRITON_INTERPRET the fp8 codes are multiplied in fp32 (exact: the interpreter has no FP8 MMA). The launch takes
PDL (``kernels.pdl``): the first weight tile is asked of the L2 before the wait for the producer of the rows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.gemv import _num_sms, _tile_counters
from kernels.pdl import pdl_args, prefetch_l2_rows, prefetch_rows_plan, range_applies, wait_prior
from kernels.w4a16_gemm import _interpreting

W_DTYPES = (torch.int8, torch.float8_e4m3fn)


@dataclass(frozen=True)
class RowsConfig:
    """One launch configuration."""

    block_m: int  # rows of x per tile: a power of 2 from 16
    block_n: int  # output features per tile (>= 64 with swap: the MMA's M)
    block_k: int  # input features per K step (>= 32)
    split_k: int = 0  # programs sharing one tile's K range; 0: enough for programs_per_sm programs per SM
    swap: bool = True  # the weights as the MMA's M operand (acc^T = W x^T)
    num_warps: int = 4
    num_stages: int = 4
    promote: int = 32  # FP8: input features summed in the MMA's own accumulator before adding into fp32
    programs_per_sm: float = 2.0  # the auto split's target


# Picked by rows (the first bound >= M), from ``python -m kernels.bench.w8a8 --rows-sweep --kind fp8`` on an H200 at the
# Llama-3-8B shapes (docs/BENCHMARKS.md, session 39): each bucket's tiling was the best or second best of its sweep on
# qkv, o_proj and down (gate_up's best was a 128-wide tile). Per layer, the best tiling of each shape against cuBLAS's
# _scaled_mm on the same codes: 8 rows 67.8 vs 116.0 us, 16 rows 69.5 vs 109.9, 32 rows 74.2 vs 107.5, 64 rows 87.3
# vs 108.3. From 128 rows cuBLAS is faster on three of the four shapes (qkv 14.5 vs 26.2 us at 128 rows), so the
# runtime's FP8 linears stop at RUNTIME_MAX_ROWS.
_CUDA_CONFIGS: list[tuple[int, RowsConfig]] = [
    (16, RowsConfig(16, 64, 256, num_warps=4, num_stages=4)),
    (32, RowsConfig(32, 64, 128, num_warps=4, num_stages=4)),
    (1 << 62, RowsConfig(64, 64, 128, num_warps=4, num_stages=4)),
]
_INTERPRETER_CONFIG = RowsConfig(16, 32, 32, num_warps=1, num_stages=1)


def _env_rows(name: str, default: int) -> int:
    value = os.environ.get(name, str(default))
    if not value.isdigit():
        raise ValueError(f"{name}={value!r} is not a whole number of rows")
    return int(value)


# The runtime's W8A8 linears (per-token or static activation scales) run this kernel from KERNELS_W8A8_ROWS_MIN rows
# (the norms and the SwiGLU before them then hand over quantized rows, FP8 and INT8) to KERNELS_W8A8_ROWS_MAX (FP8) /
# KERNELS_W8A8_ROWS_MAX_INT8 rows (INT8), the one-row GEMV below and cuBLAS above; a maximum of 0: never (A/B runs).
# INT8 sums are exact and the kernel beat _int_mm at every row count measured (32-256 rows: 0.57-0.66x its time per
# layer) and, with quantize_rows before it, the fused GEMM at 2-16 rows (an INT8 SmoothQuant 8B decode step at 4 / 16
# sequences 3.41 / 3.63 ms against 3.86 / 4.10, H200, session 39: before the norms wrote INT8 codes, which is not
# timed); FP8 loses to _scaled_mm from 128 rows. FP8 only for bf16 /
# fp16 activations: an fp32 model keeps the reference's exact fp32 sums past the fused GEMM's rows (the MMA's partial
# sums within a promotion interval keep fewer bits). Static (calibrated) scales take the same rows: a norm or the SwiGLU
# writes their codes at the input scale (runtime.executor._Fusions.static_inputs), o_proj's input quantize_rows_static.
RUNTIME_MIN_ROWS = _env_rows("KERNELS_W8A8_ROWS_MIN", 2)
RUNTIME_MAX_ROWS = _env_rows("KERNELS_W8A8_ROWS_MAX", 64)
RUNTIME_MAX_ROWS_INT8 = _env_rows("KERNELS_W8A8_ROWS_MAX_INT8", 256)


def default_config(num_rows: int, device: torch.device) -> RowsConfig:
    if _interpreting() or device.type != "cuda":
        return _INTERPRETER_CONFIG
    return next(cfg for bound, cfg in _CUDA_CONFIGS if num_rows <= bound)


def runtime_applies(num_rows: int, dtype: torch.dtype, act_dtype: torch.dtype) -> bool:
    """Whether the runtime's W8A8 linears with weights of ``dtype`` run this kernel at this many rows of
    ``act_dtype`` activations (shapes only)."""
    if dtype == torch.int8:
        return RUNTIME_MIN_ROWS <= num_rows <= RUNTIME_MAX_ROWS_INT8
    return (RUNTIME_MIN_ROWS <= num_rows <= RUNTIME_MAX_ROWS and dtype == torch.float8_e4m3fn
            and act_dtype in (torch.bfloat16, torch.float16))


# --- kernel ----------------------------------------------------------------------------------------
@triton.jit
def _w8a8_rows_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, y_ptr, part_ptr, counter_ptr,
    M, N, K, steps_per_split, stride_xm, stride_wn, stride_ym,
    INT8: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    SWAP: tl.constexpr, EMULATE: tl.constexpr, EVEN: tl.constexpr, PROMOTE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PREFETCH_ROWS: tl.constexpr, PREFETCH_LINES: tl.constexpr, PDL: tl.constexpr,
):
    # grid (N / BLOCK_N, M / BLOCK_M, SPLIT_K): program (n, m, k) sums rows [BLOCK_M m, +BLOCK_M) x features
    # [BLOCK_N n, +BLOCK_N) over K steps [steps_per_split k, +steps_per_split). EVEN: N and K are multiples of
    # BLOCK_N and BLOCK_K (the weight loads unmasked).
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    first = pid_k * steps_per_split
    num_steps = tl.minimum(steps_per_split, tl.cdiv(K, BLOCK_K) - first)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    if PDL and PREFETCH_ROWS > 0:  # the weights are constants: ask for the first step's tile before the wait
        prefetch_l2_rows(w_ptr + (pid_n * BLOCK_N).to(tl.int64) * stride_wn + first * BLOCK_K, stride_wn,
                         N - pid_n * BLOCK_N, K - first * BLOCK_K, PREFETCH_ROWS, PREFETCH_LINES, 128)
    wait_prior(PDL)  # the rows are the preceding kernel's (kernels/pdl.py)
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.int32 if INT8 else tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32 if INT8 else tl.float32)
    for step in range(num_steps):
        offs_k = (first + step) * BLOCK_K + tl.arange(0, BLOCK_K)
        x_mask = mask_m[:, None] & (offs_k < K)[None, :]
        if EMULATE:  # the interpreter: the codes as fp32 (it cannot fill masked fp8 lanes), exact
            w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & (offs_k < K)[None, :])
            w = tl.where(mask_n[:, None] & (offs_k < K)[None, :], w.to(tl.float32), 0.0)
            x = tl.where(x_mask, tl.load(x_rows + offs_k[None, :], mask=x_mask).to(tl.float32), 0.0)
        else:
            if EVEN:
                w = tl.load(w_rows + offs_k[None, :])  # [BLOCK_N, BLOCK_K]
            else:
                w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & (offs_k < K)[None, :], other=0.0)
            x = tl.load(x_rows + offs_k[None, :], mask=x_mask, other=0.0)
        if INT8:
            if SWAP:
                acc = tl.dot(w, tl.trans(x), acc, out_dtype=tl.int32)
            else:
                acc = tl.dot(x, tl.trans(w), acc, out_dtype=tl.int32)
        elif EMULATE:  # exact fp32 products of the codes
            if SWAP:
                acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            if SWAP:
                acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=PROMOTE)
            else:
                acc = tl.dot(x, tl.trans(w), acc, max_num_imprecise_acc=PROMOTE)
    if SWAP:
        acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    mask = mask_m[:, None] & mask_n[None, :]
    offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]  # 64-bit: M x N x splits may pass 2^31
    done = True
    if SPLIT_K > 1:
        tl.store(part_ptr + pid_k.to(tl.int64) * M * N + offs, acc, mask=mask)
        tl.debug_barrier()  # every thread's partials stored before the ticket
        tile = pid_m * tl.num_programs(0) + pid_n
        done = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
    if done:
        if SPLIT_K > 1:
            tl.store(counter_ptr + tile, 0)  # zero again for the next launch
            acc = tl.load(part_ptr + offs, mask=mask, other=0, cache_modifier=".cg")
            for k in tl.static_range(1, SPLIT_K):  # in split order: the same sums whichever program is last
                acc += tl.load(part_ptr + (k * M).to(tl.int64) * N + offs, mask=mask, other=0, cache_modifier=".cg")
        x_scale = tl.load(xs_ptr + offs_m, mask=mask_m, other=0.0)
        if PER_CHANNEL:
            w_scale = tl.load(ws_ptr + offs_n, mask=mask_n, other=0.0)
        else:
            w_scale = tl.zeros((BLOCK_N,), dtype=tl.float32) + tl.load(ws_ptr)
        y = acc.to(tl.float32) * x_scale[:, None] * w_scale[None, :]
        if HAS_BIAS:
            y += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=mask)


# --- entry point -----------------------------------------------------------------------------------
def _auto_split(tiles: int, steps: int, cfg: RowsConfig, device: torch.device) -> int:
    """K splits for ``tiles`` output tiles of ``steps`` K steps: about ``programs_per_sm`` programs per SM, every
    split at least two K steps, at most 16 splits."""
    if _interpreting() or device.type != "cuda":
        return 1 if steps < 4 else 2  # the interpreter: both paths, at small shapes
    target = cfg.programs_per_sm * _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return max(1, min(16, steps // 2, round(target / tiles)))


def w8a8_rows_linear(codes: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None = None, *, out_dtype: torch.dtype = torch.bfloat16,
                     config: RowsConfig | None = None) -> torch.Tensor:
    """``(codes @ qweight.T) * x_scale * weight_scale + bias`` in ``out_dtype`` (module docstring).

    codes [..., K] in qweight's dtype (float8_e4m3fn or int8), x_scale with one fp32 value per row; qweight [N, K],
    weight_scale [N] or [1]. ``config`` forces one configuration."""
    if codes.device.type != "cuda" and not _interpreting():
        raise RuntimeError("w8a8_rows_linear needs CUDA tensors (or TRITON_INTERPRET=1 for the CPU interpreter)")
    if qweight.dtype not in W_DTYPES or qweight.dim() != 2:
        raise ValueError(f"qweight must be a 2-D int8 or float8_e4m3fn [N, K] tensor, got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    if codes.dtype != qweight.dtype:
        raise ValueError(f"the rows' codes are {codes.dtype}, the weight's {qweight.dtype}: quantize the rows to the "
                         "weight's dtype")
    n, k = qweight.shape
    if codes.shape[-1] != k:
        raise ValueError(f"the rows have {codes.shape[-1]} input features, qweight {k}")
    x2 = codes.reshape(-1, k)
    num_rows = x2.shape[0]
    if x_scale.numel() != num_rows:
        raise ValueError(f"x_scale has {x_scale.numel()} values for {num_rows} rows (one per row)")
    if weight_scale.numel() not in (1, n):
        raise ValueError(f"weight_scale has {weight_scale.numel()} values; expected 1 or {n}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias {tuple(bias.shape)} does not match {n} output features")
    if out_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype {out_dtype} is not float16, bfloat16 or float32")
    y = torch.empty((num_rows, n), dtype=out_dtype, device=codes.device)
    if num_rows == 0:
        return y.reshape(*codes.shape[:-1], n)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    qweight = qweight if qweight.stride(-1) == 1 else qweight.contiguous()
    xs = x_scale.reshape(-1).float().contiguous()
    ws = weight_scale.reshape(-1).float().contiguous()
    cfg = config or default_config(num_rows, codes.device)
    sizes = (cfg.block_m, cfg.block_n, cfg.block_k)
    if any(b & (b - 1) for b in sizes) or cfg.block_m < 16 or cfg.block_n < 16 or cfg.block_k < 32:
        raise ValueError(f"RowsConfig tiles {sizes}: block_m, block_n and block_k must be powers of 2, at least 16, 16 "
                         "and 32")
    tiles_n, tiles_m = triton.cdiv(n, cfg.block_n), triton.cdiv(num_rows, cfg.block_m)
    steps = triton.cdiv(k, cfg.block_k)
    split = cfg.split_k or _auto_split(tiles_n * tiles_m, steps, cfg, codes.device)
    steps_per_split = triton.cdiv(steps, min(split, steps))
    split = triton.cdiv(steps, steps_per_split)  # no empty split
    int8 = qweight.dtype == torch.int8
    if split > 1:
        part = torch.empty((split, num_rows, n), dtype=torch.int32 if int8 else torch.float32, device=codes.device)
        counters = _tile_counters(codes.device, tiles_n * tiles_m)
    else:
        part = counters = y
    pdl = pdl_args(y)
    span = steps_per_split * cfg.block_k if range_applies(qweight.numel()) else 0
    rows, lines = prefetch_rows_plan(cfg.block_n, cfg.block_k, span) if pdl["PDL"] else (0, 1)
    _w8a8_rows_kernel[(tiles_n, tiles_m, split)](
        x2, xs, qweight, ws, bias if bias is not None else y, y, part, counters,
        num_rows, n, k, steps_per_split, x2.stride(0), qweight.stride(0), y.stride(0),
        INT8=int8, PER_CHANNEL=ws.numel() == n and n > 1, HAS_BIAS=bias is not None, SPLIT_K=split,
        SWAP=cfg.swap, EMULATE=_interpreting() and not int8, EVEN=n % cfg.block_n == 0 and k % cfg.block_k == 0,
        PROMOTE=cfg.promote, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PREFETCH_ROWS=rows, PREFETCH_LINES=lines, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl)
    return y.reshape(*codes.shape[:-1], n)
