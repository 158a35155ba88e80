"""Block-scaled FP8 W8A8 GEMM (the IR's ``fp8_block``: fine-grained FP8 checkpoints such as DeepSeek-V3's and
Qwen3-FP8's) with the activation quantization fused in.

``y = sum over K groups g of (quant(x)[:, g] @ qweight[:, g].T) * x_scale[:, g] * weight_scale[n // bn, g] + bias``,
x in fp16/bf16/fp32 and y in x's dtype: the arithmetic of the reference ``fp8_block`` path of
``kernels.torch_quant.make_quant_linear``:

    x_scale       dynamic, per token and group of bk along K (the last may be narrower): max|x| over the
                  group / 448 (floored at 1e-12 / 448)
    quant         x / x_scale clamped to +-448, rounded to E4M3 (round-half-even)
    qweight       float8_e4m3fn [N, K]; weight_scale fp32 [ceil(N / bn), ceil(K / bk)] for block_size [bn, bk]
    acc           fp32: each group's dot (exact E4M3 products) scaled by its two scales, then added

One K step is one activation group (BLOCK_K = bk), so a program quantizes its rows' x step in registers from the
step's own max (no separate quantization kernel, and x is read once per output tile), multiplies it by the
[BLOCK_K, BLOCK_N] weight tile on tensor cores, and adds the step's fp32 sum times x_scale [BLOCK_M] x
weight_scale [BLOCK_N] (one scale per bn output rows: a decode step reads the 1-byte codes and one scale per
block). The step's dot starts from zero, so Hopper's reduced-precision FP8 accumulation spans one group at most.
Small M leaves few output tiles, so K is split across programs whose scaled partial sums ``reduce_split_k`` adds
with the bias (as in ``kernels.w8a8_gemm``). The kernel takes block_k a power of two from 16 to 256
(:func:`supports`); the runtime runs other block sizes on the torch reference.

NOTE: under TRITON_INTERPRET the fp32 -> float8e4nv conversion is wrong (``kernels.w8a8_gemm``), so the
interpreter rounds x to E4M3 with ``_round_e4m3`` and multiplies in fp32; the GPU converts with the hardware's
round-to-nearest-even and multiplies FP8 on tensor cores. Divisions are IEEE (``div_rn``), as the reference's.
No host synchronisation: grids come from shapes (CUDA-graph capturable). The CUDA configurations are first
guesses, not tuned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.w4a16_gemm import _interpreting, output_tile, reduce_split_k, split_k_plan, store_output_tile
from kernels.w8a8_gemm import X_DTYPES, _round_e4m3

BLOCK_K_RANGE = (16, 256)  # the block widths along K the kernel takes (powers of two: one K step per group)


@dataclass(frozen=True)
class BlockConfig:
    """One launch configuration; the K step is the checkpoint's block width, not a choice."""

    block_m: int  # rows of x per tile (>= 16: tl.dot's minimum)
    block_n: int  # output features per tile
    split_k: int = 0  # programs sharing one tile's K range; 0 = from the tile count and the SM count
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


# Picked by M: the first row whose bound is >= M
_CUDA_CONFIGS: list[tuple[int, BlockConfig]] = [
    (16, BlockConfig(16, 128)),
    (32, BlockConfig(32, 128)),
    (64, BlockConfig(64, 128)),
    (1 << 62, BlockConfig(128, 128, split_k=1, num_warps=8)),
]
_INTERPRETER_CONFIG = BlockConfig(16, 32, split_k=1, group_m=4, num_warps=1, num_stages=1)


def default_config(num_rows: int, device: torch.device) -> BlockConfig:
    if _interpreting() or device.type != "cuda":
        return _INTERPRETER_CONFIG
    return next(cfg for bound, cfg in _CUDA_CONFIGS if num_rows <= bound)


def supports(block_size: list[int] | tuple[int, int]) -> bool:
    """Whether the kernel takes weights of this block size: any bn, a power-of-two bk in BLOCK_K_RANGE."""
    block_k = block_size[1]
    return BLOCK_K_RANGE[0] <= block_k <= BLOCK_K_RANGE[1] and block_k & (block_k - 1) == 0


@triton.jit
def _fp8_block_gemm_kernel(
    x_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr,
    M, N, K, BN, k_steps_per_split,
    stride_xm, stride_wn, stride_sn,
    stride_om, stride_os,  # out: y [M, N] (stride_os unused), or partial sums [SPLIT_K, M, N] fp32
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, EMULATE_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    offs_m, offs_n, mask_m, mask_n, pid_k = output_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    ws_rows = ws_ptr + (offs_n // BN) * stride_sn  # [BLOCK_N]: each column's row of block scales

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first_step = pid_k * k_steps_per_split
    num_steps = min(k_steps_per_split, tl.cdiv(K, BLOCK_K) - first_step)
    for step in range(num_steps):
        group = first_step + step
        offs_k = group * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        # the group's scale per row (masked lanes are 0: no effect on the max), then its codes
        x_scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(a), axis=1), 1e-12), 448.0)  # [BLOCK_M]
        v = tl.minimum(tl.maximum(tl.math.div_rn(a, x_scale[:, None]), -448.0), 448.0)
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None],
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if EMULATE_FP8:
            part = tl.dot(_round_e4m3(v), w.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(v.to(tl.float8e4nv), w)
        w_scale = tl.load(ws_rows + group, mask=mask_n, other=0.0)  # [BLOCK_N]
        acc += part * x_scale[:, None] * w_scale[None, :]

    store_output_tile(out_ptr, acc, bias_ptr, offs_m, offs_n, mask_m, mask_n, pid_k, stride_om, stride_os,
                      HAS_BIAS, SPLIT_K)


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
                     config: BlockConfig | None = None) -> torch.Tensor:
    """An fp8_block linear (see the module docstring): x [..., K] fp16/bf16/fp32 -> [..., N] in x's dtype, at any
    number of rows (``config`` forces one configuration)."""
    x2 = _check_inputs(x, qweight, weight_scale, block_size, bias)
    (n, k), num_rows = qweight.shape, x2.shape[0]
    y = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return y.reshape(*x.shape[:-1], n)
    cfg = config or default_config(num_rows, x.device)
    bn, bk = block_size
    num_tiles, split_k, steps_per_split, out, stride_om, stride_os = split_k_plan(
        y, k, cfg.block_m, cfg.block_n, bk, cfg.split_k)
    bias_arg = bias if bias is not None else y
    _fp8_block_gemm_kernel[(num_tiles, split_k)](
        x2, qweight, weight_scale, bias_arg, out, num_rows, n, k, bn, steps_per_split,
        x2.stride(0), qweight.stride(0), weight_scale.stride(0), stride_om, stride_os,
        HAS_BIAS=bias is not None, SPLIT_K=split_k, EMULATE_FP8=_interpreting(),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split_k > 1:
        reduce_split_k(out, bias_arg, y, split_k, bias is not None)
    return y.reshape(*x.shape[:-1], n)


def ref_fp8_block_linear(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
                         block_size: list[int] | tuple[int, int], bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference: the runtime's reference ``fp8_block`` linear."""
    from kernels.torch_quant import make_quant_linear

    w = {"qweight": qweight, "weight_scale": weight_scale}
    if bias is not None:
        w["bias"] = bias
    return make_quant_linear("fp8_block", w, {"block_size": list(block_size)}, x.dtype)(x)
