"""RMSNorm and residual-add + RMSNorm, and LayerNorm, one row per program, with the runtime's numerics.

Semantics are ``kernels/torch_ops.rms_norm`` / ``kernels/torch_ops.fused_add_rms_norm`` (the references):

    total  = x + residual                          (rounded to the activation dtype: it is the new residual)
    normed = weight' * to_dtype(total * rsqrt(mean(total^2) + eps))      (fp32 statistics)
    weight' = weight + weight_offset               (in the weight's dtype; Gemma-style gains)

and ``fused_add_rms_norm`` returns ``(normed, total)``. Outputs are new tensors (x and residual are
not written). A row is held in registers (hidden sizes up to a few tens of thousands).

``layer_norm`` is ``kernels/torch_ops.layer_norm``: the row centred and scaled in fp32 (biased variance), the gain
and bias applied in fp32, one rounding to the activation dtype (LayerNorm families: GPT-2, Phi-2, StableLM, GPT-NeoX,
Falcon, Starcoder2, Cohere, OLMo). One kernel where the reference takes three (a cast to fp32, the norm, a cast back).
``fused_add_layer_norm`` adds the residual first, as ``fused_add_rms_norm`` does, and returns ``(normed, total)``.

``quantize_to`` (int8 or float8_e4m3fn): the normed rows leave quantized per token instead, as
``kernels.w8a8_gemm.QuantizedRows`` equal to ``quantize_rows(normed)``, for a W8A8 linear that reads them: one
kernel and one write of 1-byte codes where the norm and the quantization took two kernels and a 2-byte round trip.
With ``input_scale`` (a linear's calibrated scale) the codes are ``quantize_rows_static(normed, input_scale)``'s.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels import torch_ops as ops
from kernels.pdl import pdl_args, wait_prior
from kernels.w4a16_gemm import _interpreting
from kernels.w8a8_gemm import W_DTYPES, QuantizedRows, quantize_row_store, static_codes, static_scale_arg


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, total_ptr, s_ptr,
                     stride_x, stride_res, stride_out, stride_total,
                     num_cols, eps, weight_offset,
                     HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_OFFSET: tl.constexpr,
                     QUANT: tl.constexpr, EMULATE_FP8: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
                     STATIC: tl.constexpr = False, QMIN: tl.constexpr = -127.0):
    # QUANT (1: fp8, 2: int8): out_ptr takes the row's codes and s_ptr its scale; the normed row in the activation
    # dtype (total's, or x's) is what they quantize. STATIC: s_ptr holds a calibrated scale, the codes' (QMIN: the
    # lowest code), and nothing is stored there
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
    if QUANT != 0:
        act = total_ptr.dtype.element_ty if HAS_RESIDUAL else x_ptr.dtype.element_ty
        h = tl.where(mask, h.to(act).to(tl.float32), 0.0)
        if STATIC:
            tl.store(out_ptr + row * stride_out + cols, static_codes(h, tl.load(s_ptr).to(tl.float32), out_ptr, QMIN,
                                                                     QUANT == 2, EMULATE_FP8), mask=mask)
        else:
            quantize_row_store(h, mask, out_ptr + row * stride_out + cols, s_ptr + row, QUANT == 2, EMULATE_FP8)
    else:
        tl.store(out_ptr + row * stride_out + cols, h.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_kernel(x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, total_ptr, stride_x, stride_res, stride_out,
                       stride_total, num_cols, eps, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_prior(PDL)  # before reading what the previous kernel wrote (kernels/pdl.py)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:  # the residual stream's new value, rounded to its dtype as the add stores it, is what is normed
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        total = (h + r).to(total_ptr.dtype.element_ty)
        tl.store(total_ptr + row * stride_total + cols, total, mask=mask)
        h = total.to(tl.float32)
    mean = tl.sum(h, axis=0) / num_cols
    d = tl.where(mask, h - mean, 0.0)
    y = d * tl.rsqrt(tl.sum(d * d, axis=0) / num_cols + eps)
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


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
            weight_offset: float, out: torch.Tensor, total: torch.Tensor | None,
            scales: torch.Tensor | None = None, static: bool = False, qmin: float = -127.0) -> None:
    num_rows, num_cols = x2.shape
    if num_rows == 0:
        return
    if weight is not None and tuple(weight.shape) != (num_cols,):
        raise ValueError(f"norm weight {tuple(weight.shape)} does not match the {num_cols} normalised features")
    block = triton.next_power_of_2(num_cols)
    dummy = out  # never read: its flag is off
    _rms_norm_kernel[(num_rows,)](
        x2, res2 if res2 is not None else dummy, weight if weight is not None else dummy, out,
        total if total is not None else dummy, scales if scales is not None else dummy,
        x2.stride(0), res2.stride(0) if res2 is not None else 0, out.stride(0),
        total.stride(0) if total is not None else 0,
        num_cols, eps, weight_offset,
        HAS_RESIDUAL=res2 is not None, HAS_WEIGHT=weight is not None, HAS_OFFSET=bool(weight_offset),
        QUANT=0 if scales is None else (2 if out.dtype == torch.int8 else 1), EMULATE_FP8=_interpreting(),
        BLOCK=block, num_warps=_num_warps(block), STATIC=static, QMIN=qmin, **pdl_args(x2))


def _out_dtype(x: torch.Tensor, weight: torch.Tensor | None) -> torch.dtype:
    return x.dtype if weight is None else torch.promote_types(x.dtype, weight.dtype)


class _Quant(NamedTuple):
    codes: torch.Tensor  # [num_rows, num_cols]
    kernel_scales: torch.Tensor  # what the kernel's s_ptr is: the rows' scales it writes, or the static one it reads
    scales: torch.Tensor  # [num_rows, 1], the QuantizedRows'
    static: bool
    qmin: float

    def launch_args(self) -> dict:
        return {"scales": self.kernel_scales, "static": self.static, "qmin": self.qmin}


def _quantized_out(x2: torch.Tensor, quantize_to: torch.dtype | None, weight: torch.Tensor | None,
                   weight_offset: float, head_dim: int | None = None, input_scale: torch.Tensor | None = None,
                   act_qmin: int = -127) -> _Quant | None:
    """The buffers and launch arguments for ``quantize_to``, or None for a plain normed output. The kernel quantizes
    the normed row rounded to the activation dtype: the weight must be in it too (the normed output's dtype). With
    ``input_scale`` (one calibrated value) the codes are ``quantize_rows_static``'s at it, and the rows' scales are
    it expanded to [num_tokens, 1], as that function returns them."""
    if quantize_to is None:
        return None
    if (quantize_to not in W_DTYPES or head_dim or weight_offset
            or (weight is not None and weight.dtype != x2.dtype)):
        raise ValueError(f"quantize_to takes {W_DTYPES} for a whole-row norm without weight_offset whose weight "
                         f"is in the activation dtype, got {quantize_to} (head_dim {head_dim}, weight_offset "
                         f"{weight_offset}, weight {None if weight is None else weight.dtype}, x {x2.dtype})")
    codes = torch.empty(x2.shape, dtype=quantize_to, device=x2.device)
    if input_scale is None:
        scales = torch.empty((x2.shape[0], 1), dtype=torch.float32, device=x2.device)
        return _Quant(codes, scales, scales, False, -127.0)
    scale, qmin = static_scale_arg("rms_norm", input_scale, codes, act_qmin)
    return _Quant(codes, scale, scale.expand(x2.shape[0], 1), True, qmin)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, weight_offset: float = 0.0,
             head_dim: int | None = None, quantize_to: torch.dtype | None = None,
             input_scale: torch.Tensor | None = None, act_qmin: int = -127) -> torch.Tensor | QuantizedRows:
    """RMSNorm of each row of ``x`` [num_tokens, features] (per head of ``head_dim`` when given); with
    ``quantize_to`` the rows quantized (``QuantizedRows``, [num_tokens, features]): per token, or at ``input_scale``
    (a calibrated scale; ``act_qmin`` the lowest int8 code, as ``quantize_rows_static`` takes it)."""
    _check_device(x)
    shape = x.shape
    x2 = _rows(x.reshape(-1, head_dim) if head_dim else x)  # x2: [num_rows, num_cols]
    quant = _quantized_out(x2, quantize_to, weight, weight_offset, head_dim, input_scale, act_qmin)
    if quant is not None:
        _launch(x2, None, weight, eps, weight_offset, quant.codes, None, **quant.launch_args())
        return QuantizedRows(quant.codes, quant.scales)
    out = torch.empty(x2.shape, dtype=_out_dtype(x, weight), device=x.device)
    _launch(x2, None, weight, eps, weight_offset, out, None)
    return out.reshape(shape)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float,
                       weight_offset: float = 0.0, quantize_to: torch.dtype | None = None,
                       input_scale: torch.Tensor | None = None, act_qmin: int = -127,
                       ) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``: the normed row and the new residual stream; with
    ``quantize_to`` the normed rows quantized (``QuantizedRows``, [num_tokens, features]), per token or at
    ``input_scale`` (see ``rms_norm``)."""
    _check_device(x)
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ in shape")
    x2, res2 = _rows(x), _rows(residual)
    total = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    quant = _quantized_out(x2, quantize_to, weight, weight_offset, None, input_scale, act_qmin)
    if quant is not None:
        _launch(x2, res2, weight, eps, weight_offset, quant.codes, total, **quant.launch_args())
        return QuantizedRows(quant.codes, quant.scales), total.reshape(x.shape)
    out = torch.empty(x2.shape, dtype=_out_dtype(total, weight), device=x.device)
    _launch(x2, res2, weight, eps, weight_offset, out, total)
    return out.reshape(x.shape), total.reshape(x.shape)


def _launch_layer_norm(x2: torch.Tensor, res2: torch.Tensor | None, weight: torch.Tensor | None,
                       bias: torch.Tensor | None, eps: float, out: torch.Tensor, total: torch.Tensor | None) -> None:
    num_rows, num_cols = x2.shape
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != (num_cols,):
            raise ValueError(f"layer_norm {name} {tuple(t.shape)} does not match the {num_cols} normalised features")
    if num_rows:
        block = triton.next_power_of_2(num_cols)
        _layer_norm_kernel[(num_rows,)](
            x2, res2 if res2 is not None else out, weight if weight is not None else out,
            bias if bias is not None else out, out, total if total is not None else out, x2.stride(0),
            res2.stride(0) if res2 is not None else 0, out.stride(0), total.stride(0) if total is not None else 0,
            num_cols, eps, HAS_RESIDUAL=res2 is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
            BLOCK=block, num_warps=_num_warps(block), **pdl_args(x2))


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm of each row of ``x`` [..., features], in x's dtype (``kernels.torch_ops.layer_norm``)."""
    _check_device(x)
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    _launch_layer_norm(x2, None, weight, bias, eps, out, None)
    return out.reshape(x.shape)


def fused_add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                         bias: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(layer_norm(x + residual), x + residual)`` in one kernel: the normed row and the new residual stream."""
    _check_device(x)
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ in shape")
    x2, res2 = _rows(x), _rows(residual)
    total = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    out = torch.empty(x2.shape, dtype=total.dtype, device=x.device)
    _launch_layer_norm(x2, res2, weight, bias, eps, out, total)
    return out.reshape(x.shape), total.reshape(x.shape)


# --- references ------------------------------------------------------------------------------------
def ref_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, weight_offset: float = 0.0,
                 head_dim: int | None = None) -> torch.Tensor:
    return ops.rms_norm(x, weight, eps, head_dim, weight_offset)


def ref_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float,
                           weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    return ops.fused_add_rms_norm(x, residual, weight, eps, weight_offset)


def ref_layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    return ops.layer_norm(x, weight, bias, eps)


def ref_fused_add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                             bias: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + residual
    return ops.layer_norm(total, weight, bias, eps), total
