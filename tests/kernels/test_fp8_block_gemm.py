"""The block-scaled FP8 (fp8_block) Triton GEMV and GEMM against the runtime's reference linear, under the Triton
interpreter on CPU, with fresh random weights, block scales and inputs; shapes whose N and K are not multiples of the
block or the tile exercise the partial last blocks and the masked loads. With TRITON_INTERPRET=0 on a CUDA machine the
same tests run the compiled kernels on the GPU (the same seeded values, moved there)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton / kernels are imported

import pytest
import torch

from kernels import fp8_block_gemm
from kernels.fp8_block_gemm import (GEMV_ROWS, BlockConfig, GemvConfig, fp8_block_linear, quantize_groups,
                                    ref_fp8_block_linear, supports)
from kernels.gemv import GEMV_MAX_ROWS, _tile_counters
from kernels.torch_quant import dequantize_weight_fp8_blocks, quantize_activation_fp8_blocks
from kernels.w4a16_gemm import _interpreting

if _interpreting():
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"  # compiled kernels (TRITON_INTERPRET=0)
else:
    pytest.skip("TRITON_INTERPRET=0 and no CUDA device", allow_module_level=True)


def _weights(n: int, k: int, block: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes over their whole range and block scales that differ by up to 100x."""
    g = torch.Generator().manual_seed(seed)
    codes = (torch.randn(n, k, generator=g) * 120).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) * 1e-3 + 1e-5
    return codes.to(DEVICE), scales.to(DEVICE)


def _x(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 2
    x[:, 3] *= 30  # an outlier channel: its group's scale differs from the others'
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("m,n,k,block", [(1, 48, 64, (16, 32)), (5, 72, 80, (32, 16)), (3, 200, 300, (128, 128)),
                                         (17, 40, 96, (32, 32))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(m, n, k, block, dtype):
    seed = m * 1000 + n + k
    qweight, scales = _weights(n, k, block, seed)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1)).to(dtype).to(DEVICE)
    x = _x(m, k, dtype, seed + 2)
    y = fp8_block_linear(x, qweight, scales, block, bias)
    ref = ref_fp8_block_linear(x, qweight, scales, block, bias)
    assert y.dtype == dtype and y.shape == (m, n) and ref.abs().max() > 0
    if dtype == torch.float32:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    else:  # the reference rounds the same fp32 result to bf16; allow one bf16 ulp
        torch.testing.assert_close(y.float(), ref.float(), rtol=8e-3, atol=1e-6)


def _assert_matches(y: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: the reference's value up to the order of the fp32 sums; fp16 / bf16: the reference rounds the same fp32
    result to x's dtype, so one ulp of it apart at most."""
    assert y.dtype == ref.dtype and y.shape == ref.shape and ref.abs().max() > 0
    if y.dtype == torch.float32:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    else:
        rtol = 8e-3 if y.dtype == torch.bfloat16 else 1e-3
        torch.testing.assert_close(y.float(), ref.float(), rtol=rtol, atol=1e-6)


# (rows, N, K, block): N, K multiples of the 16 x 32 tile and its two-group step (no masks); N and K ending in a
# partial tile and a partial step; bn not a multiple of the tile's 16 columns (scales gathered per column) and K
# ending in a partial group; bk wider than the config's 32-feature step (the step is one whole group); 128 x 128
@pytest.mark.parametrize("m,n,k,block", [(1, 64, 128, (64, 16)), (2, 72, 80, (32, 16)), (3, 50, 200, (24, 64)),
                                         (4, 33, 300, (16, 128)), (2, 130, 260, (128, 128))])
@pytest.mark.parametrize("split_k", [1, 3])
def test_gemv_matches_reference(m, n, k, block, split_k):
    """The GEMV at 1-4 rows, K unsplit and split over three programs (the tile's last one adds the partial sums and
    the bias, then zeroes its counter), in fp32, bf16 and fp16 x."""
    dtype = (torch.float32, torch.bfloat16, torch.float16)[(m + n) % 3]
    seed = 100 * m + n + k + split_k
    qweight, scales = _weights(n, k, block, seed)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1)).to(dtype).to(DEVICE)
    x = _x(m, k, dtype, seed + 2)
    cfg = GemvConfig(16, 32, split_k=split_k, num_warps=1, num_stages=1)
    y = fp8_block_linear(x, qweight, scales, block, bias, config=cfg)
    _assert_matches(y, ref_fp8_block_linear(x, qweight, scales, block, bias))
    assert not _tile_counters(x.device, 1).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_default_configs_without_bias(dtype):
    """The dispatch's own configurations (no config passed) at one to three rows, no bias, a [M, 1, K] x."""
    block = (32, 32)
    qweight, scales = _weights(48, 160, block, 21)
    for m in range(1, GEMV_ROWS + 3):
        x = _x(m, 160, dtype, 22 + m).reshape(m, 1, 160)
        y = fp8_block_linear(x, qweight, scales, block)
        assert y.shape == (m, 1, 48)
        _assert_matches(y, ref_fp8_block_linear(x, qweight, scales, block))


@pytest.mark.parametrize("m,split_k,block_k", [(5, 1, 32), (17, 3, 32), (3, 2, 32), (17, 2, 16)])
def test_gemm_with_x_quantized_first(m, split_k, block_k):
    """The GEMM on the pre-pass's codes and scales (prequant), with and without split K, partial blocks and tiles; at
    bk 16 its steps multiply the codes as fp16 (narrower than the FP8 dot's K)."""
    block = (32, block_k)
    qweight, scales = _weights(70, 150, block, 30 + m)
    bias = torch.randn(70, generator=torch.Generator().manual_seed(31)).to(DEVICE)
    x = _x(m, 150, torch.float16, 32 + m)
    cfg = BlockConfig(16, 32, split_k=split_k, group_m=2, num_warps=1, num_stages=1, prequant=True)
    y = fp8_block_linear(x, qweight, scales, block, bias.half(), config=cfg)
    _assert_matches(y, ref_fp8_block_linear(x, qweight, scales, block, bias.half()))
    assert not _tile_counters(x.device, 1).any()


@pytest.mark.parametrize("k,block_k", [(96, 32), (100, 16), (40, 64)])
def test_quantize_groups_gives_the_reference_codes_and_scales(k, block_k):
    """The GEMM's pre-pass: bit for bit the reference's codes and scales (the scales stored [num_groups, M])."""
    x = _x(6, k, torch.bfloat16, k + block_k)
    codes, scales = quantize_groups(x, block_k)
    ref_codes, ref_scales = quantize_activation_fp8_blocks(x, block_k)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (6, k) and scales.shape == (-(-k // block_k), 6)
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))
    assert torch.equal(scales, ref_scales.t())


def test_reference_scales_are_ieee_quotients_on_every_device():
    """The reference's x_scale is max|group| / 448 rounded once, as the kernels divide, on the device the tests run
    on: on CUDA torch divides by a Python scalar through its fp32 reciprocal, one ulp off for about half of these
    maxima, and that moves the codes a bf16 x puts exactly on a rounding tie (the reference's codes are the CPU's)."""
    x = _x(64, 1000, torch.bfloat16, 5)  # 7 groups of 128 and a partial one of 104
    codes, scales = quantize_activation_fp8_blocks(x, 128)
    amax = torch.nn.functional.pad(x.cpu().float(), (0, 24)).view(64, 8, 128).abs().amax(-1)
    assert torch.equal(scales.cpu(), (amax.double() / 448).float())  # correctly rounded: 53 >= 2 * 24 + 2 bits
    cpu_codes, _ = quantize_activation_fp8_blocks(x.cpu(), 128)
    assert torch.equal(codes.cpu().view(torch.uint8), cpu_codes.view(torch.uint8))


def test_dispatch_runs_the_gemv_at_few_rows(monkeypatch):
    """Without a config: the GEMV up to GEMV_ROWS rows, the GEMM above; a GemvConfig forces the GEMV up to
    GEMV_MAX_ROWS rows and is refused beyond, a BlockConfig forces the GEMM at any size."""
    calls = []
    for name in ("_gemv", "_gemm"):
        real = getattr(fp8_block_gemm, name)
        monkeypatch.setattr(fp8_block_gemm, name, lambda *a, _n=name, _r=real: (calls.append((_n, a[0].shape[0])),
                                                                               _r(*a))[1])
    block = (16, 16)
    qweight, scales = _weights(24, 48, block, 40)
    for m in range(1, GEMV_ROWS + 3):
        x = _x(m, 48, torch.float32, 41 + m)
        _assert_matches(fp8_block_linear(x, qweight, scales, block), ref_fp8_block_linear(x, qweight, scales, block))
    assert calls == ([("_gemv", m) for m in range(1, GEMV_ROWS + 1)]
                     + [("_gemm", GEMV_ROWS + 1), ("_gemm", GEMV_ROWS + 2)])
    calls.clear()
    fp8_block_linear(_x(GEMV_MAX_ROWS, 48, torch.float32, 50), qweight, scales, block, config=GemvConfig(16, 16))
    fp8_block_linear(_x(1, 48, torch.float32, 51), qweight, scales, block, config=BlockConfig(16, 16))
    assert calls == [("_gemv", GEMV_MAX_ROWS), ("_gemm", 1)]
    with pytest.raises(ValueError, match=f"takes at most GEMV_MAX_ROWS = {GEMV_MAX_ROWS} rows of x, got 5"):
        fp8_block_linear(_x(5, 48, torch.float32, 52), qweight, scales, block, config=GemvConfig(16, 16))


def test_no_fp8_dot_narrower_than_its_minimum_k(monkeypatch):
    """The GEMM's steps at bk 16 (one group each) are narrower than an FP8 dot compiles for on the GPU, which the
    interpreter does not check: they run on fp16 operands, and both the host and the kernel refuse an FP8 dot there."""
    assert [fp8_block_gemm._dot_in_fp16(bk) for bk in (16, 32, 64, 128, 256)] == [True, False, False, False, False]
    qweight, scales = _weights(24, 48, (16, 16), 60)
    x = _x(5, 48, torch.float32, 61)
    cfg = BlockConfig(16, 16, split_k=1, num_warps=1, num_stages=1)
    monkeypatch.setattr(fp8_block_gemm, "_dot_in_fp16", lambda block_k: False)
    with pytest.raises(AssertionError, match="block_k 16: an FP8 dot needs K >= 32 on the GPU"):
        fp8_block_linear(x, qweight, scales, (16, 16), config=cfg)
    monkeypatch.setattr(fp8_block_gemm, "FP8_DOT_MIN_K", 16)  # past the host's check: the kernel's own
    with pytest.raises(Exception, match="an FP8 dot needs K >= FP8_DOT_MIN_K"):
        fp8_block_linear(x, qweight, scales, (16, 16), config=cfg)


def test_split_k_and_3d_input():
    """K split over programs (partial sums added with the bias by the reduction) and a [batch, tokens, K] x."""
    block = (32, 32)
    qweight, scales = _weights(40, 160, block, 7)
    x = _x(6, 160, torch.float32, 8).reshape(2, 3, 160)
    bias = torch.randn(40, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    y = fp8_block_linear(x, qweight, scales, block, bias, config=BlockConfig(16, 16, split_k=3, group_m=2,
                                                                             num_warps=1, num_stages=1))
    ref = ref_fp8_block_linear(x, qweight, scales, block, bias)
    assert y.shape == (2, 3, 40)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_reference_is_the_block_formula():
    """The reference linear is y = sum over groups of x's group codes * x_scale times the weight's codes * its
    block's scale, written here element by element."""
    n, k, block = 20, 50, (8, 16)
    qweight, scales = (t.cpu() for t in _weights(n, k, block, 3))  # torch only: on the CPU wherever the kernels run
    x = _x(4, k, torch.float32, 4).cpu()
    w = torch.stack([torch.stack([qweight[i, j].float() * scales[i // 8, j // 16] for j in range(k)])
                     for i in range(n)])
    assert torch.equal(dequantize_weight_fp8_blocks(qweight, scales, block), w)
    xq, x_scale = quantize_activation_fp8_blocks(x, 16)
    for g in range(-(-k // 16)):  # each group's codes span the e4m3 range: its max maps to 448
        cols = slice(16 * g, min(16 * (g + 1), k))
        assert torch.allclose(x_scale[:, g], x[:, cols].abs().amax(1) / 448)
        assert torch.equal(xq[:, cols].float().abs().amax(1), torch.full((4,), 448.0))
    x_deq = torch.cat([xq[:, 16 * g: 16 * (g + 1)].float() * x_scale[:, g: g + 1] for g in range(-(-k // 16))], 1)
    torch.testing.assert_close(ref_fp8_block_linear(x, qweight, scales, block), x_deq @ w.t(), rtol=1e-6, atol=1e-6)


def test_bad_inputs_are_named():
    qweight, scales = _weights(16, 64, (16, 32), 0)
    with pytest.raises(ValueError, match="input features"):
        fp8_block_linear(torch.randn(2, 63, device=DEVICE), qweight, scales, (16, 32))
    with pytest.raises(ValueError, match=r"weight_scale is torch.float32 \(1, 2\); expected row-major float32 "
                                         r"\(1, 4\) \(one scale per 16 x 16 block"):
        fp8_block_linear(torch.randn(2, 64, device=DEVICE), qweight, scales, (16, 16))
    with pytest.raises(ValueError, match="block width along K that is a power of two"):
        fp8_block_linear(torch.randn(2, 64, device=DEVICE), qweight, scales, (16, 24))
    assert supports((128, 128)) and supports((1, 16)) and not supports((128, 96)) and not supports((128, 512))


@pytest.mark.skipif(DEVICE != "cpu", reason="the executor here holds CPU weights (the interpreter's path)")
def test_executor_runs_fp8_block_linears_on_the_kernel(monkeypatch):
    """An fp8_block linear of a graph runs the kernel on the kernel path (at one row and at many, a block width the
    kernel takes) and the torch reference otherwise (a block width it does not take), with the same logits."""
    from kernels import fp8_block_gemm
    from passes.ir import Graph, Node
    from runtime.executor import Executor, StepInput

    def graph(block: tuple[int, int]) -> Graph:
        g = torch.Generator().manual_seed(11)
        codes, scales = _weights(72, 80, block, 12)
        params = {"embed.weight": torch.randn(50, 80, generator=g), "up.qweight": codes, "up.weight_scale": scales,
                  "up.bias": torch.randn(72, generator=g), "head.weight": torch.randn(50, 72, generator=g) * 0.1}
        nodes = [Node("embedding", ["input_ids"], ["h"], {"weight": "embed.weight"}),
                 Node("linear", ["h"], ["y"], {"qweight": "up.qweight", "weight_scale": "up.weight_scale",
                                               "bias": "up.bias"},
                      {"in_features": 80, "out_features": 72,
                       "quant": {"scheme": "fp8_block", "block_size": list(block), "activations": "dynamic"}}),
                 Node("lm_head", ["y"], ["logits"], {"weight": "head.weight"})]
        graph = Graph(nodes, ["input_ids", "positions"], ["logits"], params, {"dtype": "float32"})
        graph.check()
        return graph

    calls, real = [], fp8_block_gemm.fp8_block_linear

    def spy(x, *args, **kwargs):
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(fp8_block_gemm, "fp8_block_linear", spy)
    for block, on_kernel in (((32, 16), True), ((24, 40), False)):
        g = graph(block)
        ref, fused = Executor(g.to_dict(), g.params), Executor(g.to_dict(), g.params, use_kernels=True)
        for num_tokens in (1, 9):
            ids = torch.randint(0, 50, (num_tokens,), generator=torch.Generator().manual_seed(num_tokens))
            inp = StepInput(ids, torch.arange(num_tokens), [])
            want = ref.forward(inp)
            torch.testing.assert_close(fused.forward(inp), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        assert calls == ([1, 9] if on_kernel else []), (block, calls)
        calls.clear()
