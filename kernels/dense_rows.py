"""Unquantized linears at a few rows of x (3 to ``MAX_ROWS``): one pass over the weight on the tensor cores.

A decode step of a few sequences, or a speculative verify step of one (its last token and k drafts as rows,
``runtime.cuda_graphs.DecodeGraphs(chained=True)``), multiplies 3-16 rows of x by every weight: the step is bound by
the weight bytes, as at one row. ``kernels.gemv.dense_gemv`` keeps one fp32 accumulator tile per row on the CUDA cores
and stops paying at about two rows; cuBLAS's kernels for these shapes read the weight at ~90% of the GEMV's rate and
take neither programmatic dependent launch nor an L2 prefetch across the kernel boundary, which a step of ~220 linears
pays for at every boundary (Llama-3-8B bf16 on an H200, a verify step of 5 rows: 0.42 ms more GPU time than the
one-row step, docs/BENCHMARKS.md session 58).

Here each program streams [BLOCK_N, BLOCK_K] weight tiles of its share of K (split-K, the tile's last program adding
the partial sums in split order, as the GEMV does) and multiplies each by the x rows padded to 16 (``tl.dot``: the
products exact in fp32, the sums in fp32, rounded once to x's dtype). fp32 weights multiply in full fp32
(``input_precision="ieee"``), not TF32. ``gated``: x is [..., 2K], [gate | up], and the linear's input is
``silu(gate) * up`` as ``kernels.activation.silu_mul`` rounds it, formed in the x loads. With PDL the weight tile of
the first K step is asked for in L2 before the wait on the previous kernel (``kernels.pdl``).

Configurations by weight shape are to be tuned with ``python -m kernels.bench.dense --rows-sweep``.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.activation import silu_mul_values
from kernels.gemv import DENSE_DTYPES, GemvConfig, _arrive, _check_config, _load_weights, _split_plan
from kernels.pdl import LINE, pdl_args, prefetch_l2_rows, prefetch_rows_plan, wait_prior
from kernels.w4a16_gemm import _interpreting

MIN_ROWS = 3  # fewer take kernels.gemv.dense_gemv
MAX_ROWS = 16  # rows of x the kernel takes (one tensor-core tile of x)
# The runtime sends unquantized linears of MIN_ROWS..RUNTIME_MAX_ROWS rows here (``runtime.executor``);
# KERNELS_DENSE_ROWS_MAX=0 keeps them on cuBLAS (A/B runs)
_RUNTIME_MAX = os.environ.get("KERNELS_DENSE_ROWS_MAX", "16")
if not _RUNTIME_MAX.isdigit() or int(_RUNTIME_MAX) > MAX_ROWS:
    raise ValueError(f"KERNELS_DENSE_ROWS_MAX={_RUNTIME_MAX!r} is not a row count from 0 to {MAX_ROWS}")
RUNTIME_MAX_ROWS = int(_RUNTIME_MAX)

# Default launch configuration (block_n, block_k, warps, stages; split-K automatic); KERNELS_DENSE_ROWS_CONFIG=
# "BLOCK_N,BLOCK_K,WARPS,STAGES" replaces it (A/B runs)
DEFAULT_CONFIG = GemvConfig(64, 128, num_warps=4, num_stages=4)
_FORCED = os.environ.get("KERNELS_DENSE_ROWS_CONFIG", "")
if _FORCED:
    try:
        _bn, _bk, _w, _st = (int(v) for v in _FORCED.split(","))
        DEFAULT_CONFIG = GemvConfig(_bn, _bk, num_warps=_w, num_stages=_st)
    except ValueError:
        raise ValueError(f"KERNELS_DENSE_ROWS_CONFIG={_FORCED!r}: expected BLOCK_N,BLOCK_K,WARPS,STAGES (e.g. "
                         f"64,128,4,4)") from None
_INTERPRETER_CONFIG = GemvConfig(16, 32, split_k=2, num_warps=1, num_stages=1)


@triton.jit
def _x_tile(x_ptr, offs_m, mask_m, offs_k, mask_k, stride_xm, K, GATED: tl.constexpr):
    """x's rows [BLOCK_M, BLOCK_K] of this K step, zero past the rows and K; GATED: silu(gate) * up."""
    rows = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    mask = mask_m[:, None] & mask_k[None, :]
    if GATED:
        g = tl.load(rows, mask=mask, other=0.0)
        u = tl.load(rows + K, mask=mask, other=0.0)
        return silu_mul_values(g, u)
    else:
        return tl.load(rows, mask=mask, other=0.0)


@triton.jit
def _dense_rows_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, counter_ptr,
    M, N, K, steps_per_split, stride_xm, stride_wn,
    GATED: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    IEEE: tl.constexpr, PREFETCH_ROWS: tl.constexpr, PREFETCH_LINES: tl.constexpr, ELEMS_PER_LINE: tl.constexpr,
    PDL: tl.constexpr,
):
    # x: [M, K] (GATED: [M, 2K]) -> y: [M, N] contiguous; w: [N, K] rows contiguous over K. acc[n, m] = sum_k w[n, k]
    # x[m, k] over this program's K steps; part: [SPLIT_K, M, N] fp32 partial sums.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    first_step = pid_k * steps_per_split
    num_steps = min(steps_per_split, tl.cdiv(K, BLOCK_K) - first_step)
    if PDL and PREFETCH_ROWS > 0:  # weights are constants: ask for the first step's tile before the wait
        prefetch_l2_rows(w_ptr + (pid_n * BLOCK_N) * stride_wn + first_step * BLOCK_K, stride_wn,
                         N - pid_n * BLOCK_N, K - first_step * BLOCK_K, PREFETCH_ROWS, PREFETCH_LINES,
                         ELEMS_PER_LINE)
    wait_prior(PDL)  # before reading what the previous kernel wrote (kernels/pdl.py)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for step in tl.range(0, num_steps, num_stages=NUM_STAGES):
        offs_k = (first_step + step) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        w = _load_weights(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask_n[:, None] & mask_k[None, :],
                          not (EVEN_N and EVEN_K))  # [BLOCK_N, BLOCK_K]
        xt = tl.trans(_x_tile(x_ptr, offs_m, mask_m, offs_k, mask_k, stride_xm, K, GATED))  # [BLOCK_K, BLOCK_M]
        if IEEE:  # fp32 weights; and the interpreter, whose 16-bit dot is wrong: fp32 operands (exact products)
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, xt, acc)
    out = y_ptr + offs_m[None, :] * N + offs_n[:, None]  # [BLOCK_N, BLOCK_M] of y's [M, N]
    mask = mask_n[:, None] & mask_m[None, :]
    if SPLIT_K == 1:
        _store_tile(out, acc, bias_ptr, offs_n, mask_n, mask, HAS_BIAS)
    else:
        part = part_ptr + offs_m[None, :] * N + offs_n[:, None]
        tl.store(part + pid_k * M * N, acc, mask=mask)
        if _arrive(counter_ptr + pid_n, SPLIT_K):
            tl.store(counter_ptr + pid_n, 0)  # zero again for the next launch
            tot = tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")  # in split order, past L1
            for s in range(1, SPLIT_K):
                tot += tl.load(part + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            _store_tile(out, tot, bias_ptr, offs_n, mask_n, mask, HAS_BIAS)


@triton.jit
def _store_tile(out, val, bias_ptr, offs_n, mask_n, mask, HAS_BIAS: tl.constexpr):
    """y's tile = val (fp32) + bias per output feature, in y's dtype."""
    if HAS_BIAS:
        val += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    tl.store(out, val.to(out.dtype.element_ty), mask=mask)


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`dense_rows` takes this x and weight (dtypes only: the caller checks the rows)."""
    return weight.dtype in DENSE_DTYPES and x.dtype == weight.dtype and weight.dim() == 2


def dense_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, gated: bool = False,
               config: GemvConfig | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for at most ``MAX_ROWS`` rows of x, unquantized (fp16/bf16/fp32 weights in x's
    dtype): fp32 products and sums, the result rounded once to x's dtype. ``gated``: x is [..., 2K], [gate | up],
    and the linear's input is ``silu(gate) * up`` (``kernels.activation.silu_mul``'s rounding).

    x: [..., K] (gated: [..., 2K]) -> y: [..., N] in x's dtype. ``config`` forces a configuration (benchmarks and
    tests; split_k 0: automatic)."""
    if x.device.type != "cuda" and not _interpreting():
        raise RuntimeError("dense_rows needs a CUDA tensor (or TRITON_INTERPRET=1 for the CPU interpreter)")
    if not applies(x, weight):
        raise ValueError(f"dense_rows takes a 2-D fp16/bf16/fp32 weight in x's dtype; got weight {weight.dtype} "
                         f"{tuple(weight.shape)}, x {x.dtype}")
    n, k = weight.shape
    if x.shape[-1] != (2 * k if gated else k):
        raise ValueError(f"x has {x.shape[-1]} input features; the weight takes {k}"
                         + (f" (gated: [gate | up], {2 * k})" if gated else ""))
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias {tuple(bias.shape)} does not match {n} output features")
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    num_rows = x2.shape[0]
    if num_rows > MAX_ROWS:
        raise ValueError(f"dense_rows takes at most {MAX_ROWS} rows of x, got {num_rows} (x {tuple(x.shape)})")
    y = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return y.reshape(*x.shape[:-1], n)
    cfg = config or (_INTERPRETER_CONFIG if _interpreting() else DEFAULT_CONFIG)
    _check_config(cfg, 16, 16)
    cfg = dataclasses.replace(cfg, reduce_in_kernel=True)
    elem = weight.element_size()
    plan = _split_plan(y, triton.cdiv(k, cfg.block_k), cfg, torch.float32)
    elems_per_line = LINE // elem
    span = plan.steps_per_split * cfg.block_k * elem if pdl.range_applies(weight.numel() * elem) else 0
    prefetch_rows, lines_per_row = prefetch_rows_plan(cfg.block_n, cfg.block_k * elem, span)
    _dense_rows_kernel[plan.grid](
        x2, weight, bias if bias is not None else y, y, plan.part, plan.counters,
        num_rows, n, k, plan.steps_per_split, x2.stride(0), weight.stride(0),
        GATED=gated, HAS_BIAS=bias is not None, SPLIT_K=plan.split_k, EVEN_N=n % cfg.block_n == 0,
        EVEN_K=k % cfg.block_k == 0, BLOCK_M=MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        NUM_STAGES=cfg.num_stages, IEEE=weight.dtype == torch.float32 or _interpreting(), PREFETCH_ROWS=prefetch_rows,
        PREFETCH_LINES=lines_per_row, ELEMS_PER_LINE=elems_per_line, num_warps=cfg.num_warps, **pdl_args(x2))
    return y.reshape(*x.shape[:-1], n)
