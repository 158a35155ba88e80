"""W4A8 (4-bit weights, activations rounded per token to fp8 e4m3): ``kernels.frag_mm.frag_mm_fp8`` (the fp8 MMA on
the frag layout's codes) and ``kernels.w8a8_gemm.round_rows_fp8`` under the interpreter against torch references
built from the passes' own codes, the fp8 fragment order derived from a repacked weight, the executor's routing
(``activation_quant: fp8``), and on CUDA the kernel at the 8B shapes in both of its code paths (the plain Triton
form and the inline PTX). ``python -m kernels.bench.gemm --w4a8`` checks and times it on the device."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton / kernels are imported

import pytest
import torch

from kernels.frag_mm import MmConfig, fp8_order, frag_mm_fp8, ref_w4a8_linear
from kernels.torch_quant import make_quant_linear, quantize_activation_fp8, round_activation_fp8
from kernels.w4a16_frag import mma_order, repack_frag
from kernels.w8a8_gemm import round_rows_fp8
from passes.quant_math import pack_int4

interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the interpreter's tests (the CUDA ones run on a GPU)")
on_cuda = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                             reason="e4m3 tensor cores: CUDA only (kernels.bench.gemm --w4a8 runs it on the device)")


def _codes(n: int, k: int, group_size: int, seed: int, device: str = "cpu") -> dict:
    """Random 4-bit codes, zero points and signed scales in the passes' layout, with the fp32 dequantized weight
    computed here from them (the reference's, independent of the frag layout)."""
    g = torch.Generator().manual_seed(seed)
    groups = 1 if group_size == -1 else k // group_size
    codes = torch.randint(0, 16, (n, k), generator=g).to(torch.uint8)
    zeros = torch.randint(0, 16, (n, groups), generator=g).to(torch.uint8)
    scales = (torch.rand(n, groups, generator=g) - 0.5) * 0.04
    wd = ((codes.float().reshape(n, groups, -1) - zeros.float()[:, :, None]) * scales[:, :, None]).reshape(n, k)
    return {"qweight": pack_int4(codes).to(device), "scales": scales.to(device), "zeros": zeros.to(device),
            "group_size": group_size, "w": wd.to(device)}


def _ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32: x's per-token e4m3 codes times their scales, against the fp32 weight."""
    xq, xs = quantize_activation_fp8(x, None)
    y = (xq.float() * xs) @ w.T
    return y + bias.float() if bias is not None else y


def test_fp8_order_is_where_a_repacked_word_puts_each_feature():
    """fp8_order from the layout itself: codes that spell their own input feature (two repacks, the feature's low
    and high nibble) are repacked, and for word (chunk, c, j) of a tile's lane 4 g + c, nibble (h, half, e) at shift
    16 h + 8 e + 4 half must hold the feature fp8_order names at column 64 chunk + 16 j + 4 c + 2 half + e (row g +
    8 h), the fp8 A fragment's k = 4 c + 2 half + e of each 16."""
    n, k = 32, 128
    feature = torch.arange(k).expand(n, k)
    spelled = []
    for shift in (0, 4):
        codes = ((feature >> shift) & 0xF).to(torch.uint8)
        packed = repack_frag(pack_int4(codes), torch.ones(n, 1), torch.zeros(n, 1, dtype=torch.uint8), -1, 4)
        words = packed["qweight"].view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        spelled.append(words.reshape(n // 16, k // 64, 32, 4))  # tile, chunk, lane, j
    order = fp8_order()
    assert sorted(order) == list(range(128))
    for chunk in range(2):
        for lane in range(32):
            c = lane % 4
            for j in range(4):
                for h in range(2):
                    for half in range(2):
                        for e in range(2):
                            sh = 16 * h + 8 * e + 4 * half
                            f = int((spelled[0][0, chunk, lane, j] >> sh) & 0xF) \
                                | int((spelled[1][0, chunk, lane, j] >> sh) & 0xF) << 4
                            assert order[64 * chunk + 16 * j + 4 * c + 2 * half + e] == f
    # and the bf16 MMA's order is another permutation of the same features (the GEMV's, frag_mm's)
    assert sorted(mma_order(128).tolist()) == sorted(order) and list(mma_order(128).tolist()) != list(order)


@interpreter
@pytest.mark.parametrize("m,n,k,group_size", [(37, 64, 256, 128), (5, 32, 128, 128), (20, 96, 384, -1),
                                              (70, 160, 256, 128)])
def test_frag_mm_fp8_matches_the_w4a8_reference(m, n, k, group_size):
    w = _codes(n, k, group_size, seed=m * n + k)
    packed = repack_frag(w["qweight"], w["scales"], w["zeros"], group_size, 4)
    g = torch.Generator().manual_seed(m + 5)
    x = (torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4).to(torch.bfloat16)  # rows' own scales
    x[:, 3] *= 30  # an outlier feature: small values round coarsely
    bias = (torch.randn(n, generator=g) * 0.1).to(torch.bfloat16)
    ref = _ref(x, w["w"], bias)
    configs = (None, MmConfig(block_m=16, tiles_n=1, num_warps=4, num_stages=1, split_k=3),
               MmConfig(block_m=32, tiles_n=4, num_warps=4, num_stages=1, split_k=1),
               MmConfig(block_m=16, tiles_n=2, num_warps=4, num_stages=1, split_k=1, pair=True),
               MmConfig(block_m=16, tiles_n=2, num_warps=4, num_stages=1, split_k=2, pair=True))
    # past 64 rows (several of the default's row tiles) the default and one split config: the others' partial tiles,
    # splits and pairs are the smaller shapes' (the interpreter runs every program)
    for cfg in configs[:2] if m > 64 else configs:
        y = frag_mm_fp8(x, **packed, bias=bias, config=cfg)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        torch.testing.assert_close(y.float(), ref, rtol=2**-7, atol=1e-3 * ref.abs().max().item())
    # the module's own reference agrees with the one here; leading dims are kept
    torch.testing.assert_close(ref_w4a8_linear(x, **packed, bias=bias).float(), ref, rtol=2**-7, atol=1e-3)
    y3 = frag_mm_fp8(x.reshape(1, m, k), **packed)
    assert y3.shape == (1, m, n)


@interpreter
def test_frag_mm_fp8_refuses_what_it_cannot_take():
    w = _codes(32, 128, 128, seed=1)
    packed = repack_frag(w["qweight"], w["scales"], w["zeros"], 128, 4)
    with pytest.raises(ValueError, match="input features"):
        frag_mm_fp8(torch.randn(3, 64).to(torch.bfloat16), **packed)
    with pytest.raises(ValueError, match="4-bit"):
        frag_mm_fp8(torch.randn(3, 128).to(torch.bfloat16), **{**packed, "bits": 8})
    assert frag_mm_fp8(torch.randn(0, 128).to(torch.bfloat16), **packed).shape == (0, 32)


@interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_round_rows_fp8_is_the_reference_rounding(dtype):
    """One kernel, the same values as quantize_activation_fp8's codes times scales rounded to x's dtype: rows of
    very different magnitudes, an all-zero row, a row whose max is negative, K past one block."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 300, generator=g) * torch.tensor([1.0, 1e-3, 50.0, 1.0, 0.0, 7.0])[:, None]
    x[3, 17] = -90.0
    x = x.to(dtype)
    y = round_rows_fp8(x)
    ref = round_activation_fp8(x)
    assert y.dtype == dtype
    if dtype == torch.bfloat16:  # the interpreter's fp32 -> bf16 cast truncates: within one ulp of the product
        torch.testing.assert_close(y, ref, rtol=2**-7, atol=0)
    else:
        assert torch.equal(y, ref)
    assert torch.equal(round_rows_fp8(x.reshape(2, 3, 300)), y.reshape(2, 3, 300))
    assert not torch.equal(y, x)  # it rounds: e4m3 keeps 3 mantissa bits


@on_cuda
def test_round_rows_fp8_on_cuda_is_the_reference_rounding_bit_for_bit():
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(300, 4096, generator=g, device="cuda") * torch.rand(300, 1, generator=g, device="cuda") * 20
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(round_rows_fp8(x.to(dtype)), round_activation_fp8(x.to(dtype)))


def test_the_reference_linear_rounds_its_input_when_asked():
    w = _codes(48, 256, 128, seed=4)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(6))
    tensors = {key: w[key] for key in ("qweight", "scales", "zeros")}
    quant = {"bits": 4, "group_size": 128}
    w4a16 = make_quant_linear("w4a16", tensors, quant, torch.float32)
    w4a8 = make_quant_linear("w4a16", tensors, {**quant, "activation_quant": "fp8"}, torch.float32)
    torch.testing.assert_close(w4a8(x), w4a16(round_activation_fp8(x)))
    torch.testing.assert_close(w4a8(x), _ref(x, w["w"]), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(w4a8(x), w4a16(x), rtol=1e-3, atol=1e-3)


def _routed(n: int, k: int, group_size: int, swiglu: bool, seed: int, device: str):
    """The executor's W4A8 linear (``activation_quant: fp8``) and its fp32 reference."""
    from runtime.executor import _kernel_weight_only_linear

    w = _codes(n, k, group_size, seed)
    bias = (torch.randn(n, generator=torch.Generator().manual_seed(seed + 1)) * 0.1).to(torch.bfloat16)
    tensors = {"qweight": w["qweight"].to(device), "scales": w["scales"].to(device), "zeros": w["zeros"].to(device),
               "bias": bias.to(device)}
    linear = _kernel_weight_only_linear(tensors, {"bits": 4, "group_size": group_size, "activation_quant": "fp8"},
                                        swiglu_out=swiglu)

    def reference(x: torch.Tensor, bf16_weights: bool = False, rounded: bool = True) -> torch.Tensor:
        """fp32 weights (the fp8 MMA's exact codes); ``bf16_weights``: each rounded to bf16 in groups, as the W4A16
        paths below the fp8 MMA's rows read them; ``rounded`` False: x as it is (W4A16's reference)"""
        wd = w["w"].to(torch.bfloat16).float() if bf16_weights and group_size != -1 else w["w"]
        y = _ref(x.cpu(), wd, bias) if rounded else x.cpu().float() @ wd.T + bias.float()
        return torch.nn.functional.silu(y[:, : n // 2]) * y[:, n // 2:] if swiglu else y

    return linear, reference


@interpreter
@pytest.mark.parametrize("swiglu,group_size", [(False, 128), (True, 128), (False, -1)])
def test_the_executor_runs_w4a8_linears_on_it(monkeypatch, swiglu, group_size):
    """From W4A8_RUNTIME_MIN_ROWS to W4A8_RUNTIME_MAX_ROWS rows the executor's frag path runs frag_mm_fp8 (a spy
    counts it); outside, x is rounded by round_rows_fp8 and the W4A16 paths run; all give the W4A8 reference, a
    merged gate/up included."""
    from kernels import frag_mm as module
    from kernels import w4a16_frag

    monkeypatch.setattr(w4a16_frag, "runtime_layout", lambda *args: True)
    calls = []
    real = module.frag_mm_fp8
    monkeypatch.setattr(module, "frag_mm_fp8", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    linear, reference = _routed(64, 256, group_size, swiglu, seed=7, device="cpu")
    g = torch.Generator().manual_seed(8)
    low = module.W4A8_RUNTIME_MIN_ROWS
    monkeypatch.setattr(module, "W4A8_RUNTIME_MAX_ROWS", low + 10)
    for rows, routed in ((low, True), (3, False), (low + 20, False)):
        calls.clear()
        x = torch.randn(rows, 256, generator=g).to(torch.bfloat16)
        ref = reference(x, bf16_weights=not routed)
        y = linear(x).float()
        # bf16 outputs (and below the fp8 MMA's rows the interpreter's truncating bf16 casts in the rounded x, the
        # CPU's bf16 matmul and the SwiGLU): elementwise within 2^-5, and on average 2x closer to the W4A8
        # reference than to the same linear on the unrounded x
        torch.testing.assert_close(y, ref, rtol=2**-5, atol=2e-2 * ref.abs().max().item())
        unrounded = reference(x, bf16_weights=not routed, rounded=False)
        assert 2 * (y - ref).abs().mean() < (y - unrounded).abs().mean()
        assert bool(calls) == routed


@on_cuda
@pytest.mark.parametrize("m", [65, 128, 256, 300])
@pytest.mark.parametrize("n,k,group_size", [(6144, 4096, 128), (4096, 14336, 128), (28672, 4096, 128),
                                            (512, 4096, -1), (160, 256, 128)])
def test_frag_mm_fp8_on_cuda(m, n, k, group_size):
    w = _codes(n, k, group_size, seed=m + n, device="cuda")
    packed = repack_frag(w["qweight"], w["scales"], w["zeros"], group_size, 4)
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = (torch.randn(m, k, generator=gen, device="cuda") * 2).to(torch.bfloat16)
    bias = (torch.randn(n, generator=gen, device="cuda") * 0.1).to(torch.bfloat16)
    ref = _ref(x, w["w"], bias)
    for cfg in (None, MmConfig(block_m=128, tiles_n=8, num_warps=8, num_stages=3, packed=False),
                MmConfig(block_m=64, tiles_n=4, num_warps=4, num_stages=3, split_k=3, packed=True),
                MmConfig(block_m=256, tiles_n=8, num_warps=8, num_stages=3, packed=True),
                MmConfig(block_m=64, tiles_n=16, num_warps=8, num_stages=3, packed=True, pair=True),
                MmConfig(block_m=32, tiles_n=16, num_warps=8, num_stages=4, split_k=3, packed=True, pair=True)):
        y = frag_mm_fp8(x, **packed, bias=bias, config=cfg).float()
        # fp32 sums of exact products, rounded once to bf16 (and the GPU's quantize_rows divides as torch does)
        torch.testing.assert_close(y, ref, rtol=2**-7, atol=2**-7 * ref.abs().max().item())


@on_cuda
@pytest.mark.parametrize("rows", [1, 16, 64, 65, 128, 256])
@pytest.mark.parametrize("n,k,swiglu", [(28672, 4096, True), (4096, 14336, False)])
def test_the_executor_on_cuda_at_the_8b_shapes(rows, n, k, swiglu):
    """The runtime's W4A8 linear at and around the GEMV's rows (x rounded, the frag GEMV) and past them (the fp8
    MMA), against the fp32 reference."""
    linear, reference = _routed(n, k, 128, swiglu, seed=rows + n, device="cuda")
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    ref = reference(x, bf16_weights=rows < 65)
    y = linear(x.cuda()).float().cpu()
    torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
