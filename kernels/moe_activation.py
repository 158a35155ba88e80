"""The fused MoE kernels' roundings and expert activations (``kernels.moe``'s grouped GEMMs and ``kernels.moe_gemv``'s
small-slot GEMVs share them): each op rounded to the activation dtype where the reference ``kernels.torch_ops.moe``
rounds, so both paths give its bits."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _round(v, dtype: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """fp32 v rounded to ``dtype`` (nearest, ties to even). EMULATE_BF16: for the interpreter, whose fp32 -> bf16
    conversion truncates: the rounding done on the bits, the conversion then exact."""
    if EMULATE_BF16:
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        v = bits.to(tl.float32, bitcast=True)
    return v.to(dtype)


@triton.jit
def _tanh(v):
    """tanh of fp32 v: (1 - t) / (1 + t) with t = exp(-2|v|), near 0 its series (where 1 - t loses precision)."""
    t = tl.exp(-2.0 * tl.abs(v))
    mag = tl.where(tl.abs(v) < 4e-3, tl.abs(v) * (1.0 - v * v / 3.0), (1.0 - t) / (1.0 + t))
    return tl.where(v < 0, -mag, mag)


@triton.jit
def _sigmoid(v):
    """sigmoid of fp32 v without overflow for large |v|."""
    e = tl.exp(-tl.abs(v))  # in (0, 1]
    return tl.where(v >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def _act_mul(g, u, alpha, limit, ACT: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """act(g) * u in g's dtype with the reference's roundings: act in fp32 rounded to the dtype, then the product
    in fp32 rounded (ACT numbers ``ACTIVATIONS``: silu, gelu, gelu_tanh, relu, sigmoid, tanh). ACT 6, clamped_swiglu
    (gpt-oss): (clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha * g'), g' = min(g, limit), each op rounded."""
    dtype = g.dtype
    gf = g.to(tl.float32)
    if ACT == 6:
        gf = tl.minimum(gf, limit)
        uf = tl.minimum(tl.maximum(u.to(tl.float32), -limit), limit)
        sig = _round(_sigmoid(_round(gf * alpha, dtype, EMULATE_BF16).to(tl.float32)), dtype, EMULATE_BF16)
        glu = _round(gf * sig.to(tl.float32), dtype, EMULATE_BF16).to(tl.float32)
        up1 = _round(uf + 1.0, dtype, EMULATE_BF16).to(tl.float32)
        return _round(up1 * glu, dtype, EMULATE_BF16)
    if ACT == 0 or ACT == 4:
        e = tl.exp(-tl.abs(gf))  # in (0, 1]: no overflow for large |g|
        a = tl.where(gf >= 0, 1.0 / (1.0 + e), e / (1.0 + e))  # sigmoid
        if ACT == 0:
            a = gf * a
    elif ACT == 1:
        a = 0.5 * gf * (1.0 + tl.math.erf(gf * 0.7071067811865476))
    elif ACT == 2:
        a = 0.5 * gf * (1.0 + _tanh(0.7978845608028654 * (gf + 0.044715 * gf * gf * gf)))  # torch's formula
    elif ACT == 3:
        a = tl.maximum(gf, 0.0)
    else:
        a = _tanh(gf)
    a = _round(a, dtype, EMULATE_BF16).to(tl.float32)
    return _round(a * u.to(tl.float32), dtype, EMULATE_BF16)
