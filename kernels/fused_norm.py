"""RMSNorm and residual-add + RMSNorm, one row per program, with the runtime's numerics.

Semantics are ``kernels/torch_ops.rms_norm`` / ``kernels/torch_ops.fused_add_rms_norm`` (the references):

    total  = x + residual                          (rounded to the activation dtype: it is the new residual)
    normed = weight' * to_dtype(total * rsqrt(mean(total^2) + eps))      (fp32 statistics)
    weight' = weight + weight_offset               (in the weight's dtype; Gemma-style gains)

and ``fused_add_rms_norm`` returns ``(normed, total)``. Outputs are new tensors (x and residual are
not written). A row is held in registers (hidden sizes up to a few tens of thousands).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels import torch_ops as ops
from kernels.pdl import pdl_args, wait_prior


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, total_ptr,
                     stride_x, stride_res, stride_out, stride_total,
                     num_cols, eps, weight_offset,
                     HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_OFFSET: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_prior(PDL)  # before reading what the previous kernel wrote (kernels/pdl.py)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        total = (h + r).to(total_ptr.dtype.element_ty)
        tl.store(total_ptr + row * stride_total + cols, total, mask=mask)
        h = total.to(tl.float32)
    mean_sq = tl.sum(h * h, axis=0) / num_cols
    h = h * tl.rsqrt(mean_sq + eps)
    if HAS_WEIGHT:
        # ops.rms_norm: the normalised row is cast to the activation dtype before the gain
        if HAS_RESIDUAL:
            h = h.to(total_ptr.dtype.element_ty).to(tl.float32)
        else:
            h = h.to(x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        if HAS_OFFSET:
            w = (w.to(tl.float32) + weight_offset).to(w_ptr.dtype.element_ty)
        h = h * w.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, h.to(out_ptr.dtype.element_ty), mask=mask)


def _num_warps(block: int) -> int:
    return min(max(block // 512, 1), 16)


def _check_device(x: torch.Tensor) -> None:
    if not (x.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"):
        raise RuntimeError("the Triton norms run on CUDA tensors (or under TRITON_INTERPRET=1); "
                           "use kernels.torch_ops on the CPU")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as [num_rows, num_cols] with unit column stride (a view when possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x2: torch.Tensor, res2: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
            weight_offset: float, out: torch.Tensor, total: torch.Tensor | None) -> None:
    num_rows, num_cols = x2.shape
    if num_rows == 0:
        return
    if weight is not None and tuple(weight.shape) != (num_cols,):
        raise ValueError(f"norm weight {tuple(weight.shape)} does not match the {num_cols} normalised features")
    block = triton.next_power_of_2(num_cols)
    dummy = out  # never read: its flag is off
    _rms_norm_kernel[(num_rows,)](
        x2, res2 if res2 is not None else dummy, weight if weight is not None else dummy, out,
        total if total is not None else dummy,
        x2.stride(0), res2.stride(0) if res2 is not None else 0, out.stride(0),
        total.stride(0) if total is not None else 0,
        num_cols, eps, weight_offset,
        HAS_RESIDUAL=res2 is not None, HAS_WEIGHT=weight is not None, HAS_OFFSET=bool(weight_offset),
        BLOCK=block, num_warps=_num_warps(block), **pdl_args(x2))


def _out_dtype(x: torch.Tensor, weight: torch.Tensor | None) -> torch.dtype:
    return x.dtype if weight is None else torch.promote_types(x.dtype, weight.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, weight_offset: float = 0.0,
             head_dim: int | None = None) -> torch.Tensor:
    """RMSNorm of each row of ``x`` [num_tokens, features] (per head of ``head_dim`` when given)."""
    _check_device(x)
    shape = x.shape
    x2 = _rows(x.reshape(-1, head_dim) if head_dim else x)  # x2: [num_rows, num_cols]
    out = torch.empty(x2.shape, dtype=_out_dtype(x, weight), device=x.device)
    _launch(x2, None, weight, eps, weight_offset, out, None)
    return out.reshape(shape)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float,
                       weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``: the normed row and the new residual stream."""
    _check_device(x)
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ in shape")
    x2, res2 = _rows(x), _rows(residual)
    total = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    out = torch.empty(x2.shape, dtype=_out_dtype(total, weight), device=x.device)
    _launch(x2, res2, weight, eps, weight_offset, out, total)
    return out.reshape(x.shape), total.reshape(x.shape)


# --- references ------------------------------------------------------------------------------------
def ref_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, weight_offset: float = 0.0,
                 head_dim: int | None = None) -> torch.Tensor:
    return ops.rms_norm(x, weight, eps, head_dim, weight_offset)


def ref_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float,
                           weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    return ops.fused_add_rms_norm(x, residual, weight, eps, weight_offset)
