"""The W8A8 (INT8 / FP8) Triton GEMM with fused activation quantization against the runtime's reference
linear, under the Triton interpreter on CPU. Weights are the passes' own quantized outputs."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton / kernels are imported

import pytest
import torch
import triton
import triton.language as tl

from kernels.w8a8_gemm import W8A8Config, _round_e4m3, div_exact, ref_w8a8_linear, w8a8_linear
from kernels.torch_quant import quantize_weight_fp8, quantize_weight_int8


def _weights(kind: str, n: int, k: int, per_channel: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[: n // 3] *= 4  # rows with different ranges: per-channel scales differ
    if kind == "int8":
        return quantize_weight_int8(w)
    return quantize_weight_fp8(w, per_channel)


def _x(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 2
    x[:, 3] *= 30  # an outlier channel, as real activations have
    return x.to(dtype)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("m,k,n", [(1, 96, 48), (5, 80, 40), (33, 64, 72)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference_dynamic(kind, m, k, n, dtype):
    seed = m * 1000 + k + n
    qweight, w_scale = _weights(kind, n, k, per_channel=True, seed=seed)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    x = _x(m, k, dtype, seed + 2)
    y = w8a8_linear(x, qweight, w_scale, bias=bias)
    ref = ref_w8a8_linear(x, qweight, w_scale, bias=bias)
    assert y.dtype == dtype and y.shape == (m, n)
    if dtype == torch.float32:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    else:  # the reference rounds the same fp32 result to bf16; allow one bf16 ulp
        torch.testing.assert_close(y.float(), ref.float(), rtol=8e-3, atol=1e-6)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_static_scale_and_split_k(kind):
    """Static (calibrated) activation scale with saturation, fp8's per-tensor weight scale, forced split-K."""
    m, k, n = 3, 128, 40
    qweight, w_scale = _weights(kind, n, k, per_channel=kind == "int8", seed=7)
    assert w_scale.numel() == (n if kind == "int8" else 1)
    x = _x(m, k, torch.float32, 8)
    input_scale = torch.tensor([x.abs().max().item() / 100])  # some values saturate: clamping is exercised
    cfg = W8A8Config(16, 16, 32, split_k=2, group_m=2, num_warps=1, num_stages=1)
    y = w8a8_linear(x, qweight, w_scale, input_scale=input_scale, config=cfg)
    ref = ref_w8a8_linear(x, qweight, w_scale, input_scale=input_scale)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("split_k", [1, 2])
def test_static_int8_codes_down_to_act_qmin(split_k):
    """act_qmin -128 (an imported checkpoint's full int8 range): inputs below -127.5 * input_scale take code -128,
    as the reference's; the default -127 clamps them to -127 (outputs measurably apart on such rows)."""
    m, k, n = 4, 96, 40
    qweight, w_scale = _weights("int8", n, k, per_channel=True, seed=17)
    x = _x(m, k, torch.float32, 18)
    input_scale = torch.tensor([4.0 / 127])  # |x| > 4 (2 sigma) saturates, at both ends
    assert (x / input_scale < -127.5).sum() > 2
    cfg = W8A8Config(16, 16, 32, split_k=split_k, group_m=2, num_warps=1, num_stages=1)
    y = w8a8_linear(x, qweight, w_scale, input_scale=input_scale, config=cfg, act_qmin=-128)
    ref = ref_w8a8_linear(x, qweight, w_scale, input_scale=input_scale, act_qmin=-128)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    y127 = w8a8_linear(x, qweight, w_scale, input_scale=input_scale, config=cfg)
    torch.testing.assert_close(y127, ref_w8a8_linear(x, qweight, w_scale, input_scale=input_scale), rtol=1e-5,
                               atol=1e-5 * ref.abs().max().item())
    assert (y127 - y).abs().max().item() > 1e-3 * ref.abs().max().item()
    with pytest.raises(ValueError, match=r"act_qmin -129 is not one of \(-127, -128\)"):
        w8a8_linear(x, qweight, w_scale, input_scale=input_scale, act_qmin=-129)
    fp8_weight, fp8_scale = _weights("fp8", n, k, per_channel=True, seed=17)
    with pytest.raises(ValueError, match="act_qmin -128 bounds int8 activation codes"):
        w8a8_linear(x, fp8_weight, fp8_scale, input_scale=input_scale, act_qmin=-128)


def test_bad_inputs_are_named():
    qweight, w_scale = _weights("fp8", 16, 32, True, 0)
    with pytest.raises(ValueError, match="input features"):
        w8a8_linear(torch.randn(2, 31), qweight, w_scale)
    with pytest.raises(ValueError, match="weight_scale"):
        w8a8_linear(torch.randn(2, 32), qweight, w_scale[:3])
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn"):
        w8a8_linear(torch.randn(2, 32), qweight.float(), w_scale)


@triton.jit
def _round_kernel(v_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(v_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, _round_e4m3(v), mask=offs < n)


def test_fp8_rounding_emulation_matches_torch_everywhere():
    """Every finite E4M3 value, the midpoints between neighbours (ties to even) and random values in
    between round exactly as torch's float8_e4m3fn conversion does."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = torch.unique(codes[codes.isfinite() & (codes.abs() <= 448)])
    mids = (grid[1:] + grid[:-1]) / 2
    rand = (torch.rand(4096, generator=torch.Generator().manual_seed(0)) * 2 - 1) * 448
    tiny = torch.randn(512, generator=torch.Generator().manual_seed(1)) * 2.0 ** -8  # subnormal range
    v = torch.cat([grid, mids, rand, tiny]).contiguous()
    out = torch.empty_like(v)
    _round_kernel[(triton.cdiv(v.numel(), 256),)](v, out, v.numel(), BLOCK=256)
    expected = v.to(torch.float8_e4m3fn).float()
    assert torch.equal(out, expected), (v[out != expected][:5], out[out != expected][:5])


@triton.jit
def _div_kernel(a_ptr, s_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(a_ptr + offs, mask=offs < n, other=1.0)
    s = tl.load(s_ptr + offs, mask=offs < n, other=1.0)
    tl.store(out_ptr + offs, div_exact(a, s, tl.math.div_rn(s * 0.0 + 1.0, s)), mask=offs < n)


def test_div_exact_is_the_ieee_quotient():
    """div_exact (the activation quantization's x / x_scale in the GEMV, GEMM and MoE kernels) gives torch's IEEE
    quotient bit for bit: random quotients, quotients one ulp either side of the codes' rounding boundaries k + 0.5
    (where the GPU's approximate ``/`` took the neighbouring code) and on them, and quotients past fp32's range
    (infinities of the right sign, not NaN); zeros stay zero; subnormal and infinite scales (their reciprocal
    overflows or vanishes) give the plain quotient. On the GPU with TRITON_INTERPRET=0 (the tensors are made
    there)."""
    device = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    gen = torch.Generator().manual_seed(5)
    n = 1 << 16
    s = 10.0 ** (torch.rand(n, generator=gen, dtype=torch.float64) * 6 - 5)
    k = torch.randint(-128, 127, (n,), generator=gen).double()
    boundary = ((k + 0.5) * s).float()
    a = torch.cat([(torch.rand(n, generator=gen, dtype=torch.float64) * 280 - 140).mul(s).float(), boundary,
                   torch.nextafter(boundary, torch.full_like(boundary, float("inf"))),
                   torch.nextafter(boundary, torch.full_like(boundary, float("-inf"))),
                   torch.tensor([3e38, -3e38, 0.0, -0.0, 1e-40, 0.0, 2.0, 0.0])])
    # the last four: subnormal scales (1 / s overflows) and an infinite one
    s = torch.cat([s.float()] * 4 + [torch.tensor([1e-3, 1e-3, 0.5, 0.5, 1e-39, 1e-39, float("inf"), float("inf")])])
    a, s = a.to(device), s.to(device)
    out = torch.empty_like(a)
    _div_kernel[(triton.cdiv(a.numel(), 1024),)](a, s, out, a.numel(), BLOCK=1024)
    expected = a / s
    # equal as numbers (a zero's sign may differ: -0 / s comes out +0, the same code)
    assert torch.equal(out, expected), (a[out != expected][:4], s[out != expected][:4])
    assert out[-8:-6].tolist() == [float("inf"), float("-inf")]


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_matches_the_reference_quantization(dtype, x_dtype):
    """The one-kernel per-token quantization (feeding _scaled_mm / _int_mm above 16 rows) gives the
    reference's codes and scales: K not a multiple of the block, an all-zero row (the scale floor)."""
    from kernels.w8a8_gemm import quantize_rows
    from kernels.torch_quant import quantize_activation_fp8, quantize_activation_int8

    x = _x(7, 100, x_dtype, seed=11)
    x[4] = 0
    q, s = quantize_rows(x, dtype)
    ref = quantize_activation_int8 if dtype == torch.int8 else quantize_activation_fp8
    q_ref, s_ref = ref(x, None)
    assert q.dtype == dtype and s.shape == (7, 1)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.int8), q_ref.view(torch.int8))
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn"):
        quantize_rows(x, torch.float16)


@pytest.mark.parametrize("k", [1024, 1025])
def test_reference_int8_matmul_is_exact_on_both_sides_of_the_float32_bound(k):
    """The CPU reference multiplies INT8 codes in float32 up to K = 1024 and in float64 beyond: exact either way, on
    codes at the extremes. The first row and column's sum is odd and, past K = 1024, beyond float32's 2**24."""
    from kernels.torch_quant import _int8_matmul

    g = torch.Generator().manual_seed(k)
    xq = torch.where(torch.rand(3, k, generator=g) < 0.5, -128, 127).to(torch.int8)
    wq = torch.where(torch.rand(5, k, generator=g) < 0.5, -128, 127).to(torch.int8)
    xq[0], wq[0] = -128, -128
    xq[0, 0], wq[0, 0] = 127, 127
    out = _int8_matmul(xq, wq)
    assert out.dtype == torch.int32 and int(out[0, 0]) == 128 * 128 * (k - 1) + 127 * 127
    assert torch.equal(out.long(), xq.long() @ wq.long().t())
