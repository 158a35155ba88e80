"""The W8A8 linear on rows already quantized per token (``kernels.w8a8_rows``) against the runtime's reference
linear, under the Triton interpreter on CPU: fresh random activations quantized by the reference's own per-token
quantization, weights quantized by the passes' functions. On a GPU, ``python -m kernels.bench.w8a8 --rows`` checks
the compiled kernel at the Llama-3-8B shapes against the same reference."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton / kernels are imported

import pytest
import torch

from kernels.gemv import _tile_counters
from kernels.torch_quant import (quantize_activation_fp8, quantize_activation_int8, quantize_weight_fp8,
                                 quantize_weight_int8)
from kernels.w8a8_gemm import ref_w8a8_linear
from kernels.w8a8_rows import RowsConfig, w8a8_rows_linear


def _weights(kind: str, n: int, k: int, per_channel: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[: n // 3] *= 4  # rows with different ranges: per-channel scales differ
    return quantize_weight_int8(w) if kind == "int8" else quantize_weight_fp8(w, per_channel)


def _rows(kind: str, m: int, k: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 2
    x[:, 3] *= 30  # an outlier channel, as real activations have
    x = x.to(dtype)
    codes, scales = quantize_activation_int8(x, None) if kind == "int8" else quantize_activation_fp8(x, None)
    return x, codes, scales


CONFIGS = [RowsConfig(16, 32, 32, split_k=1, num_warps=1, num_stages=1),
           RowsConfig(16, 32, 32, split_k=3, num_warps=1, num_stages=1),
           RowsConfig(16, 32, 32, split_k=2, swap=False, num_warps=1, num_stages=1)]


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("m,k,n", [(1, 96, 64), (5, 80, 40), (19, 128, 72)])
@pytest.mark.parametrize("cfg", CONFIGS, ids=["one-split", "three-splits", "unswapped"])
def test_matches_the_reference_linear(kind, m, k, n, cfg):
    seed = m * 1000 + k + n
    qweight, w_scale = _weights(kind, n, k, per_channel=True, seed=seed)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1))
    x, codes, scales = _rows(kind, m, k, torch.float32, seed + 2)
    y = w8a8_rows_linear(codes, scales, qweight, w_scale, bias, out_dtype=torch.float32, config=cfg)
    ref = ref_w8a8_linear(x, qweight, w_scale, bias=bias)
    assert y.shape == (m, n) and y.dtype == torch.float32
    if kind == "int8":  # exact int32 sums, then the reference's float(sum) * x_scale * weight_scale + bias
        torch.testing.assert_close(y, ref, rtol=0, atol=0)
    else:  # fp32 sums of exact products, summed in another order
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_bf16_out_per_tensor_scale_and_leading_dims(kind):
    qweight, w_scale = _weights(kind, 48, 64, per_channel=False, seed=3)
    if kind == "int8":  # one scale for the tensor (the reference reads the same codes with it)
        w_scale = w_scale.amax().reshape(1)
    x, codes, scales = _rows(kind, 6, 64, torch.bfloat16, seed=4)
    y = w8a8_rows_linear(codes.reshape(2, 3, 64), scales.reshape(2, 3, 1), qweight, w_scale,
                         out_dtype=torch.bfloat16)
    ref = ref_w8a8_linear(x, qweight, w_scale)
    assert y.shape == (2, 3, 48) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.reshape(6, 48).float(), ref.float(), rtol=8e-3, atol=1e-6)


def test_split_counters_are_zero_again():
    qweight, w_scale = _weights("fp8", 64, 128, per_channel=True, seed=5)
    _, codes, scales = _rows("fp8", 3, 128, torch.float32, seed=6)
    cfg = RowsConfig(16, 32, 32, split_k=4, num_warps=1, num_stages=1)
    w8a8_rows_linear(codes, scales, qweight, w_scale, out_dtype=torch.float32, config=cfg)
    assert int(_tile_counters(codes.device, 2).abs().sum()) == 0  # the last program of each tile reset its own


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_default_config_splits_k_and_matches(kind):
    """No config: the interpreter's default tiles with the automatic split (two splits past four K steps)."""
    qweight, w_scale = _weights(kind, 40, 160, per_channel=True, seed=10)
    x, codes, scales = _rows(kind, 21, 160, torch.float32, seed=11)
    y = w8a8_rows_linear(codes, scales, qweight, w_scale, out_dtype=torch.float32)
    ref = ref_w8a8_linear(x, qweight, w_scale)
    torch.testing.assert_close(y, ref, rtol=0 if kind == "int8" else 1e-5,
                               atol=0 if kind == "int8" else 1e-5 * ref.abs().max().item())


def test_tiles_must_be_powers_of_two():
    qweight, w_scale = _weights("fp8", 32, 64, per_channel=True, seed=12)
    _, codes, scales = _rows("fp8", 2, 64, torch.float32, seed=13)
    with pytest.raises(ValueError, match="powers of 2"):
        w8a8_rows_linear(codes, scales, qweight, w_scale, config=RowsConfig(48, 32, 32))


def test_empty_rows():
    qweight, w_scale = _weights("fp8", 32, 32, per_channel=True, seed=7)
    y = w8a8_rows_linear(torch.empty(0, 32, dtype=torch.float8_e4m3fn), torch.empty(0, 1), qweight, w_scale)
    assert y.shape == (0, 32)


def test_bad_inputs_are_named():
    qweight, w_scale = _weights("fp8", 32, 64, per_channel=True, seed=8)
    _, codes, scales = _rows("fp8", 2, 64, torch.float32, seed=9)
    with pytest.raises(ValueError, match="quantize the rows to the weight's dtype"):
        w8a8_rows_linear(codes.view(torch.int8), scales, qweight, w_scale)
    with pytest.raises(ValueError, match="input features"):
        w8a8_rows_linear(codes[:, :32], scales, qweight, w_scale)
    with pytest.raises(ValueError, match="one per row"):
        w8a8_rows_linear(codes, scales[:1], qweight, w_scale)
    with pytest.raises(ValueError, match="weight_scale"):
        w8a8_rows_linear(codes, scales, qweight, w_scale[:3])
    with pytest.raises(ValueError, match="bias"):
        w8a8_rows_linear(codes, scales, qweight, w_scale, torch.zeros(31))
    with pytest.raises(ValueError, match="out_dtype"):
        w8a8_rows_linear(codes, scales, qweight, w_scale, out_dtype=torch.int32)


@pytest.mark.parametrize("kind,act_qmin", [("int8", -127), ("int8", -128), ("fp8", -127)])
def test_static_scale_rows_are_the_references_codes(kind, act_qmin):
    """quantize_rows_static gives the codes of the reference's static quantization (an outlier past the range
    clamps), and the rows GEMM on them equals the reference linear with that input scale."""
    from kernels.w8a8_gemm import quantize_rows_static

    qweight, w_scale = _weights(kind, 48, 96, per_channel=True, seed=14)
    g = torch.Generator().manual_seed(15)
    x = torch.randn(7, 96, generator=g) * 2
    x[0, :3] = torch.tensor([1e4, -1e4, -0.0])
    s = torch.tensor([0.03])
    codes, scales = quantize_rows_static(x, s, qweight.dtype, act_qmin=act_qmin)
    if kind == "int8":
        want, _ = quantize_activation_int8(x, s, act_qmin)
        assert torch.equal(codes, want) and int(codes.min()) == act_qmin
    else:
        want, _ = quantize_activation_fp8(x, s)
        assert torch.equal(codes.float(), want.float())  # values: the interpreter's e4m3 rounding drops -0's sign
    assert scales.shape == (7, 1) and torch.equal(scales, s.expand(7, 1))
    y = w8a8_rows_linear(codes, scales, qweight, w_scale, out_dtype=torch.float32)
    ref = ref_w8a8_linear(x, qweight, w_scale, input_scale=s, act_qmin=act_qmin)
    torch.testing.assert_close(y, ref, rtol=0 if kind == "int8" else 1e-5,
                               atol=0 if kind == "int8" else 1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("scheme,dtype", [("fp8", torch.bfloat16), ("w8a8_int8", torch.float32)])
def test_the_runtime_linear_runs_static_scales_on_the_rows_gemm(monkeypatch, scheme, dtype):
    """A W8A8 linear with a calibrated input scale (ModelOpt / compressed-tensors FP8, static SmoothQuant) at a decode
    batch's rows: the static codes go to the rows GEMM, and the result is the reference linear's."""
    from kernels import w8a8_rows
    from kernels.torch_quant import make_quant_linear
    from runtime import executor

    codes_kind = "int8" if scheme == "w8a8_int8" else "fp8"
    qweight, w_scale = _weights(codes_kind, 64, 96, per_channel=True, seed=16)
    w = {"qweight": qweight, "weight_scale": w_scale, "input_scale": torch.tensor([0.02])}
    calls, real = [], w8a8_rows.w8a8_rows_linear

    def spy(codes, *args, **kwargs):
        calls.append(codes.shape[0])
        return real(codes, *args, **kwargs)

    monkeypatch.setattr(w8a8_rows, "w8a8_rows_linear", spy)
    linear = executor._kernel_w8a8_linear(w, {"scheme": scheme}, type("Ex", (), {"dtype": dtype})())
    x = (torch.randn(20, 96, generator=torch.Generator().manual_seed(17)) * 2).to(dtype)
    assert w8a8_rows.runtime_applies(20, qweight.dtype, dtype)
    got = linear(x)
    want = make_quant_linear(scheme, w, {"scheme": scheme}, dtype)(x)
    assert calls == [20]
    torch.testing.assert_close(got.float(), want.float(), rtol=8e-3 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-5 * want.float().abs().max().item())
