"""``kernels.frag_mm`` (the chained-accumulator GEMM on the frag layout) under the interpreter against x @ the
dequantized weights: 4-bit groups of 128 (each weight rounded to x's dtype once, as the kernel does), 4-bit and
8-bit per channel (exact codes, the scale after the loop), rows that do not fill a tile, N that does not fill a
program's tiles, a bias, split-K, the swapped operands and x read by column indices. The GPU test at real shapes
is skipped here and runs on the device (``kernels.bench.gemm --frag-mm`` prints its own check too)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton / kernels are imported

import pytest
import torch
import triton
import triton.language as tl

from kernels.frag_mm import MmConfig, _dequant_mma, frag_mm, x_order
from kernels.w4a16_frag import dequantize_frag, mma_order, repack_frag
from kernels.w4a16_gemm import ref_w4a16_linear
from passes.quant_math import QuantConfig, pack_int4, quantize_groups

interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the interpreter's tests (test_frag_mm_on_cuda runs the kernel on a GPU)")
CONFIGS = [None, MmConfig(block_m=16, tiles_n=1, num_warps=4, num_stages=1, split_k=3),
           MmConfig(block_m=32, tiles_n=4, num_warps=4, num_stages=2, split_k=1, swap=True),
           MmConfig(block_m=16, tiles_n=2, num_warps=4, num_stages=1, split_k=2, x_gather=True),
           MmConfig(block_m=16, tiles_n=2, num_warps=4, num_stages=1, split_k=2, swap=True, mma_order=True)]


def _weights(n: int, k: int, group_size: int, seed: int, bits: int = 4) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, : k // 4] += 0.03  # groups off-centre: zero points vary
    codes, scales, zeros = quantize_groups(w, QuantConfig(bits=bits, group_size=group_size, symmetric=False))
    return {"qweight": pack_int4(codes) if bits == 4 else codes, "scales": scales, "zeros": zeros,
            "group_size": group_size, "bits": bits, "layout": "passes"}


def test_x_order_is_a_permutation_the_mma_order_predicts():
    """The 4-bit column order, derived independently: column 64 chunk + 16 c + 4 j + v is MMA-order position
    64 chunk + 16 j + 8 (v // 2) + 2 c + v % 2, whose feature is mma_order's entry there."""
    order = x_order(4)
    assert sorted(order) == list(range(128)) and x_order(8) == tuple(range(64))
    mma = mma_order(128)
    for col in range(128):
        chunk, c, j, v = col // 64, (col // 16) % 4, (col // 4) % 4, col % 4
        assert order[col] == int(mma[64 * chunk + 16 * j + 8 * (v // 2) + 2 * c + v % 2])


@interpreter
@pytest.mark.parametrize("m,n,k,group_size,bits", [(37, 64, 256, 128, 4), (16, 96, 384, -1, 4),
                                                   (5, 32, 128, 128, 4), (20, 160, 256, 128, 4),
                                                   (37, 64, 192, -1, 8), (9, 160, 128, -1, 8)])
def test_frag_mm_matches_the_dequantized_weights(m, n, k, group_size, bits):
    passes = _weights(n, k, group_size, seed=m * n + k + bits, bits=bits)
    packed = repack_frag(passes["qweight"], passes["scales"], passes["zeros"], group_size, bits)
    g = torch.Generator().manual_seed(m + 11)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    bias = (torch.randn(n, generator=g) * 0.1).to(torch.bfloat16)
    w = dequantize_frag(**packed, dtype=torch.float32)
    if group_size not in (-1, k):  # groups: each weight rounded to x's dtype once, as the kernel's operand
        w = w.to(torch.bfloat16).float()
    ref = x.float() @ w.T + bias.float()
    for cfg in CONFIGS:
        y = frag_mm(x, **packed, bias=bias, config=cfg)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        torch.testing.assert_close(y.float(), ref, rtol=2**-7, atol=1e-3)  # one bf16 rounding of the fp32 sum
    y = frag_mm(x.reshape(1, m, k), **packed)  # leading dims kept, no bias
    torch.testing.assert_close(y.float(), (x.float() @ w.T).reshape(1, m, n), rtol=2**-7, atol=1e-3)


@interpreter
def test_frag_mm_refuses_what_it_cannot_take():
    passes = _weights(32, 128, 128, seed=1)
    packed = repack_frag(passes["qweight"], passes["scales"], passes["zeros"], 128, 4)
    with pytest.raises(ValueError, match="input features"):
        frag_mm(torch.randn(3, 64).to(torch.bfloat16), **packed)
    with pytest.raises(ValueError, match="bf16/fp16"):
        frag_mm(torch.randn(3, 128), **packed)
    with pytest.raises(ValueError, match="bias"):
        frag_mm(torch.randn(3, 128).to(torch.bfloat16), **packed, bias=torch.zeros(16, dtype=torch.bfloat16))
    assert frag_mm(torch.randn(0, 128).to(torch.bfloat16), **packed).shape == (0, 32)


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="bf16 tensor cores: CUDA only (kernels.bench.gemm --frag-mm runs it on the device)")
@pytest.mark.parametrize("m", [65, 128, 300, 1024])
@pytest.mark.parametrize("n,k,group_size,bits", [(6144, 4096, 128, 4), (4096, 14336, 128, 4), (512, 4096, -1, 4),
                                                 (160, 256, 128, 4), (6144, 4096, -1, 8), (4096, 14336, -1, 8)])
def test_frag_mm_on_cuda(m, n, k, group_size, bits):
    passes = {key: v.cuda() if isinstance(v, torch.Tensor) else v for key, v in
              _weights(n, k, group_size, seed=m + n, bits=bits).items()}
    packed = repack_frag(passes["qweight"], passes["scales"], passes["zeros"], group_size, bits)
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
    bias = (torch.randn(n, generator=gen, device="cuda") * 0.1).to(torch.bfloat16)
    ref = ref_w4a16_linear(x, **passes, bias=bias).float()
    for cfg in (None, MmConfig(block_m=128, tiles_n=8, num_warps=8, num_stages=3, split_k=1, swap=True),
                MmConfig(block_m=64, tiles_n=4, num_warps=4, num_stages=2, split_k=5, x_gather=True),
                MmConfig(block_m=64, tiles_n=8, num_warps=4, num_stages=3, split_k=3, mma_order=True),
                MmConfig(block_m=128, tiles_n=4, num_warps=4, num_stages=3, swap=True, mma_order=True, packed=True)):
        y = frag_mm(x, **packed, bias=bias, config=cfg).float()
        torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_the_runtime_takes_it_for_large_weights_at_decode_sized_steps():
    """Shapes only: the 8B shape's gate_up up to MM_RUNTIME_MAX_ROWS rows and down up to 128, 4-bit and 8-bit codes
    alike; qkv / o_proj and prefill-sized steps keep the paths before (sessions 50 and 53's H200 tables)."""
    from kernels import frag_mm as module

    limit = module.MM_RUNTIME_MAX_ROWS
    if limit < 256:
        pytest.skip(f"KERNELS_FRAG_MM_MAX_ROWS={limit} in the environment")
    assert module.preferred(65, 28672, 4096) and module.preferred(256, 28672, 4096)
    assert module.preferred(128, 4096, 14336) and not module.preferred(129, 4096, 14336)
    assert not module.preferred(128, 6144, 4096) and not module.preferred(128, 4096, 4096)
    assert not module.preferred(limit + 1, 28672, 4096)
    if module.MM_BITS8:
        assert module.preferred(128, 28672, 4096, bits=8) and module.preferred(128, 4096, 14336, bits=8)
        assert not module.preferred(129, 4096, 14336, bits=8) and not module.preferred(128, 6144, 4096, bits=8)
    assert not module.preferred(128, 28672, 4096, bits=3)


@triton.jit
def _dequant_mma_probe(w_ptr, zl_ptr, zh_ptr, sl_ptr, sh_ptr, out_ptr, T: tl.constexpr):
    r = tl.arange(0, 8 * T)
    words = tl.load(w_ptr + r[:, None] * 32 + tl.arange(0, 32)[None, :])
    w = _dequant_mma(words, tl.load(zl_ptr + r).to(tl.float32), tl.load(zh_ptr + r).to(tl.float32),
                     tl.load(sl_ptr + r), tl.load(sh_ptr + r), T)
    tl.store(out_ptr + tl.arange(0, 16 * T)[:, None] * 128 + tl.arange(0, 128)[None, :], w)


@interpreter
@pytest.mark.parametrize("scales", ["mixed sign", "large", "zero"])
def test_dequant_mma_is_the_fp32_product_bit_for_bit(scales):
    """_dequant_mma against (q - z) * s in fp32, bit for bit, from the layout's own definition (nibble (h, half, e)
    of word (chunk, c, j) of row (t, g) at shift 16 h + 8 e + 4 half is weight row 16 t + 8 h + g, MMA-order column
    64 chunk + 16 j + 8 half + 2 c + e): every shift, zero points 0 and 15, words with the top bit set (sign
    extension of words >> 16), negative scales. Exact for normal s 2^-12, that is |s| >= 2^-114."""
    T = 2
    g = torch.Generator().manual_seed(5)
    words = torch.randint(-2**31, 2**31, (8 * T, 32), generator=g, dtype=torch.int64)
    words[0] = -1  # every nibble 15, top bit set
    words[1] = 0
    words = words.to(torch.int32)
    zl, zh = (torch.randint(0, 16, (8 * T,), generator=g).to(torch.uint8) for _ in range(2))
    zl[0], zh[0], zl[1], zh[1] = 0, 15, 15, 0
    if scales == "mixed sign":
        sl, sh = ((torch.rand(8 * T, generator=g) - 0.5) * 0.1 for _ in range(2))
    elif scales == "large":
        sl, sh = (torch.full((8 * T,), 3.0e38) * torch.where(torch.rand(8 * T, generator=g) < 0.5, -1.0, 1.0)
                  for _ in range(2))
    else:
        sl, sh = torch.zeros(8 * T), torch.zeros(8 * T)
    out = torch.empty(16 * T, 128)
    _dequant_mma_probe[(1,)](words, zl, zh, sl, sh, out, T)
    ref = torch.empty(T, 2, 8, 2, 4, 2, 4, 2)  # t, h, g, chunk, j, half, c, e
    wu = words.to(torch.int64) & 0xFFFFFFFF
    for h in range(2):
        z, s = (zh, sh) if h else (zl, sl)
        for half in range(2):
            for e in range(2):
                q = ((wu >> (16 * h + 8 * e + 4 * half)) & 0xF).reshape(T, 8, 2, 4, 4)  # t, g, chunk, c, j
                w = (q.float() - z.float().reshape(T, 8, 1, 1, 1)) * s.reshape(T, 8, 1, 1, 1)
                ref[:, h, :, :, :, half, :, e] = w.permute(0, 1, 2, 4, 3)
    ref = ref.reshape(16 * T, 128)
    assert bool(((out == ref) | (out.isnan() & ref.isnan())).all())


@interpreter
@pytest.mark.parametrize("group_size", [128, -1])
def test_frag_mm_fp16_in_mma_order(group_size):
    """fp16 x on the runtime's 4-bit configuration (MMA order, swapped), N that halves tiles_n (96 features: 6 tiles
    for 4), split-K, a bias in fp32."""
    m, n, k = 21, 96, 256
    passes = _weights(n, k, group_size, seed=3)
    packed = repack_frag(passes["qweight"], passes["scales"], passes["zeros"], group_size, 4)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(m, k, generator=g).to(torch.float16)
    bias = torch.randn(n, generator=g) * 0.1
    w = dequantize_frag(**packed, dtype=torch.float32)
    if group_size != -1:
        w = w.to(torch.float16).float()
    ref = x.float() @ w.T + bias
    for split in (1, 3):
        cfg = MmConfig(block_m=16, tiles_n=4, num_warps=4, num_stages=1, split_k=split, swap=True, mma_order=True)
        y = frag_mm(x, **packed, bias=bias, config=cfg)
        assert y.dtype == torch.float16
        torch.testing.assert_close(y.float(), ref, rtol=2**-9, atol=1e-3)


def _routed_linear(n: int, k: int, group_size: int, swiglu: bool, seed: int, device: str, bits: int = 4):
    """The executor's weight-only linear (runtime.executor._kernel_weight_only_linear) on random 4- or 8-bit weights,
    with its fp32 reference: x @ dequantized weights + bias (each weight rounded to bf16 in groups), SwiGLU'd for a
    merged gate/up."""
    from passes.quant_math import pack_int4
    from runtime.executor import _kernel_weight_only_linear

    g = torch.Generator().manual_seed(seed)
    groups = 1 if group_size == -1 else k // group_size
    levels = 1 << bits
    codes = torch.randint(0, levels, (n, k), generator=g).to(torch.uint8)
    zeros = torch.randint(0, levels, (n, groups), generator=g).to(torch.uint8)
    scales = (torch.rand(n, groups, generator=g) - 0.5) * 0.04 * 16 / levels
    bias = (torch.randn(n, generator=g) * 0.1).to(torch.bfloat16)
    w = {"qweight": (pack_int4(codes) if bits == 4 else codes).to(device), "scales": scales.to(device),
         "zeros": zeros.to(device), "bias": bias.to(device)}
    linear = _kernel_weight_only_linear(w, {"bits": bits, "group_size": group_size}, swiglu_out=swiglu)
    wd = ((codes.float().reshape(n, groups, -1) - zeros.float()[:, :, None]) * scales[:, :, None]).reshape(n, k)
    if group_size != -1:
        wd = wd.to(torch.bfloat16).float()

    def reference(x: torch.Tensor) -> torch.Tensor:
        y = x.float().cpu() @ wd.T + bias.float()
        return torch.nn.functional.silu(y[:, : n // 2]) * y[:, n // 2:] if swiglu else y

    return linear, reference


@interpreter
@pytest.mark.parametrize("swiglu,group_size,bits", [(False, 128, 4), (True, 128, 4), (False, -1, 4), (True, -1, 8)])
def test_the_executor_routes_frag_linears_to_it(monkeypatch, swiglu, group_size, bits):
    """The executor's frag path past the GEMV's rows, under the interpreter with the frag layout forced on and the
    size threshold lowered: frag_mm runs (a spy counts it) and gives the reference, a merged gate/up in its gate_up
    order included; past the row limit the dequantized path runs instead, with the same result."""
    from kernels import frag_mm as module
    from kernels import w4a16_frag

    monkeypatch.setattr(w4a16_frag, "runtime_layout", lambda *args: True)
    monkeypatch.setattr(module, "MM_MIN_WEIGHTS", 0)
    monkeypatch.setattr(module, "MM_BITS8", True)
    monkeypatch.setattr(module, "MM_RUNTIME_MAX_ROWS", 80)
    calls = []
    real = module.frag_mm
    monkeypatch.setattr(module, "frag_mm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    linear, reference = _routed_linear(64, 256, group_size, swiglu, seed=7, device="cpu", bits=bits)
    g = torch.Generator().manual_seed(8)
    for rows, routed in ((70, True), (90, False)):
        calls.clear()
        x = torch.randn(rows, 256, generator=g).to(torch.bfloat16)
        ref = reference(x)
        torch.testing.assert_close(linear(x).float(), ref, rtol=2**-6, atol=2e-3 * ref.abs().max().item())
        assert bool(calls) == routed


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="CUDA only (the interpreter's routing test above forces the layout)")
@pytest.mark.parametrize("rows", [65, 128, 256, 300])
@pytest.mark.parametrize("n,k,swiglu", [(28672, 4096, True), (4096, 14336, False), (6144, 4096, False)])
def test_the_executor_on_cuda_at_the_8b_shapes(rows, n, k, swiglu):
    """The runtime's choice at the 8B shape's gate_up (SwiGLU out), down and qkv around its row limits (frag_mm,
    or the dequantized weight on cuBLAS), against the fp32 reference."""
    linear, reference = _routed_linear(n, k, 128, swiglu, seed=rows + n, device="cuda")
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    ref = reference(x)
    y = linear(x.cuda()).float().cpu()
    torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
