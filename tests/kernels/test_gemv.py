"""The GEMV kernels (``kernels/gemv.py``) against the torch references, under the Triton interpreter on CPU.

W4A16 / W8A16 weights are the passes' group quantization (``quantize_groups``) repacked to the k_major layout;
W8A8 weights are the passes' per-channel INT8 / FP8 quantization. Every case draws fresh seeded random inputs.
"""

from __future__ import annotations

import itertools
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton / kernels are imported

import pytest
import torch

from kernels import gemv
from kernels.gemv import GEMV_MAX_ROWS, GemvConfig, w4a16_gemv, w8a8_gemv
from kernels.w4a16_gemm import ref_w4a16_linear, repack_w4a16
from kernels.w8a8_gemm import ref_w8a8_linear
from passes.quant_math import QuantConfig, pack_int4, quantize_groups
from kernels.torch_quant import quantize_weight_fp8, quantize_weight_int8

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _packed(n: int, k: int, group_size: int, seed: int, bits: int = 4) -> tuple[dict, dict]:
    """(the passes' weights, their repack_w4a16 k_major form), as keyword arguments of the kernels."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, : k // 4] += 0.03  # groups off-centre: zero points vary
    codes, scales, zeros = quantize_groups(w, QuantConfig(bits=bits, group_size=group_size, symmetric=False))
    passes = {"qweight": pack_int4(codes) if bits == 4 else codes, "scales": scales, "zeros": zeros,
              "group_size": group_size, "bits": bits, "layout": "passes"}
    return passes, repack_w4a16(passes["qweight"], scales, zeros, group_size, bits)


def _x_bias(shape: tuple[int, ...], n: int, dtype: torch.dtype, bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * 2).to(dtype)
    return x, ((torch.randn(n, generator=g) * 0.1).to(dtype) if bias else None)


def _assert_close(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert y.dtype == ref.dtype and y.shape == ref.shape
    tol = TOL[ref.dtype]
    torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max().item())


def _check_w4a16(m_shape: tuple[int, ...], n: int, k: int, group_size: int, dtype: torch.dtype, bias: bool,
                 seed: int, bits: int = 4, config: GemvConfig | None = None) -> None:
    passes, packed = _packed(n, k, group_size, seed, bits)
    x, b = _x_bias((*m_shape, k), n, dtype, bias, seed + 1)
    _assert_close(w4a16_gemv(x, **packed, bias=b, config=config), ref_w4a16_linear(x, **passes, bias=b))


# every M with every group size (80: K / 2 = 40 rows is not a multiple of the default 16-row step, which the
# default config shrinks to 8 rows; -1: one group); dtype and bias cycle through them
W4A16_CASES = [(m, k, gs, DTYPES[i % 3], i % 2 == 0)
               for i, (m, (k, gs)) in enumerate(itertools.product(range(1, GEMV_MAX_ROWS + 1),
                                                                  ((128, 32), (128, 64), (80, 40), (96, -1))))]


@pytest.mark.parametrize("m,k,group_size,dtype,bias", W4A16_CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_w4a16_gemv_matches_reference(m, k, group_size, dtype, bias):
    _check_w4a16((m,), 48, k, group_size, dtype, bias, seed=10 * m + k)


@pytest.mark.parametrize("config", [
    GemvConfig(16, 32, split_k=2),  # two K splits, added in the kernel by the tile's last program
    GemvConfig(32, 32, split_k=3),  # uneven split (5 K steps over 3 programs); ragged last column tile (N = 48)
    GemvConfig(16, 32, split_k=3, reduce_in_kernel=False),  # partial sums added by reduce_split_k
    GemvConfig(32, 128, split_k=1),  # 64-row step over K / 2 = 80 rows: ragged last step, groups gathered
    GemvConfig(64, 32, split_k=2, num_warps=1),  # a 16-row step in two passes of T = 512 / 64 = 8 rows
], ids=["split2", "split3-uneven", "split3-second-kernel", "ragged-gathered", "two-passes"])
@pytest.mark.parametrize("m", [1, 3])
def test_w4a16_gemv_configs(config, m):
    _check_w4a16((m,), 48, 160, 32, torch.float32, True, seed=m, config=config)


@pytest.mark.parametrize("m,group_size,dtype", [(1, 32, torch.float32), (2, -1, torch.bfloat16),
                                                (4, 64, torch.float16)])
def test_w8a16_gemv_matches_reference(m, group_size, dtype):
    _check_w4a16((m,), 40, 128, group_size, dtype, True, seed=m, bits=8)
    _check_w4a16((m,), 40, 128, group_size, dtype, False, seed=m, bits=8, config=GemvConfig(16, 32, split_k=2))


def test_w4a16_gemv_leading_dims_and_empty():
    _check_w4a16((2, 1), 32, 64, 32, torch.bfloat16, True, seed=3)
    _check_w4a16((1, 1, 3), 32, 64, 32, torch.float32, False, seed=4)
    _, packed = _packed(32, 64, 32, seed=5)
    assert w4a16_gemv(torch.randn(0, 64), **packed).shape == (0, 32)


def _w8a8_weights(kind: str, n: int, k: int, per_channel: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[: n // 3] *= 4  # rows with different ranges: per-channel scales differ
    return quantize_weight_int8(w) if kind == "int8" else quantize_weight_fp8(w, per_channel)


def _check_w8a8(kind: str, m_shape: tuple[int, ...], n: int, k: int, dtype: torch.dtype, static: bool, bias: bool,
                seed: int, per_channel: bool = True, config: GemvConfig | None = None) -> None:
    qweight, w_scale = _w8a8_weights(kind, n, k, per_channel, seed)
    x, b = _x_bias((*m_shape, k), n, dtype, bias, seed + 1)
    x[..., 3] *= 30  # an outlier channel, as real activations have
    # static: some values saturate, so the clamp is exercised
    input_scale = torch.tensor([x.float().abs().max().item() / 100]) if static else None
    y = w8a8_gemv(x, qweight, w_scale, input_scale, b, config=config)
    ref = ref_w8a8_linear(x, qweight, w_scale, input_scale, b)
    assert y.dtype == ref.dtype and y.shape == ref.shape
    # the interpreter quantizes x exactly as the reference; the sums differ in order only (INT8: not at all)
    rtol = 1e-5 if dtype == torch.float32 else 8e-3  # 16-bit outputs: one ulp of the same fp32 result
    torch.testing.assert_close(y.float(), ref.float(), rtol=rtol, atol=rtol * ref.float().abs().max().item())


# kind x M x static in full; dtype and bias cycle. K = 80 and N = 40 leave ragged last tiles (32-wide blocks).
W8A8_CASES = [(kind, m, static, DTYPES[i % 3], i % 4 < 2)
              for i, (kind, m, static) in enumerate(itertools.product(("int8", "fp8"), range(1, GEMV_MAX_ROWS + 1),
                                                                      (False, True)))]


@pytest.mark.parametrize("kind,m,static,dtype,bias", W8A8_CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_w8a8_gemv_matches_reference(kind, m, static, dtype, bias):
    _check_w8a8(kind, (m,), 40, 80, dtype, static, bias, seed=100 * m + static)


@pytest.mark.parametrize("config", [
    GemvConfig(16, 32, split_k=2),  # partial sums (INT8: int32) added and scaled by the tile's last program
    GemvConfig(32, 16, split_k=3),  # uneven split, K step smaller than the 16-code chunks: one chunk per step
    GemvConfig(16, 32, split_k=3, reduce_in_kernel=False),  # scaled partials added by reduce_split_k
], ids=["split2", "split3-uneven", "split3-second-kernel"])
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_w8a8_gemv_configs(config, kind):
    _check_w8a8(kind, (3,), 40, 112, torch.float32, False, True, seed=7, config=config)
    _check_w8a8(kind, (2,), 40, 112, torch.float32, True, False, seed=8, config=config)


def test_w8a8_gemv_per_tensor_scale_and_leading_dims():
    _check_w8a8("fp8", (2, 1), 32, 64, torch.bfloat16, False, True, seed=9, per_channel=False)
    _check_w8a8("int8", (1, 1, 2), 32, 64, torch.float32, True, True, seed=10)


@pytest.mark.parametrize("m,config", [(1, None), (3, GemvConfig(16, 32, split_k=2)),
                                      (2, GemvConfig(16, 32, split_k=3, reduce_in_kernel=False))])
def test_w8a8_gemv_static_int8_codes_down_to_act_qmin(m, config):
    """act_qmin -128 (an imported checkpoint's full int8 range): inputs below -127.5 * input_scale take code -128
    in the kernel, as in the reference; the default -127 clamps them to -127 (outputs measurably apart)."""
    qweight, w_scale = _w8a8_weights("int8", 40, 80, True, seed=30 + m)
    x, b = _x_bias((m, 80), 40, torch.float32, True, seed=31 + m)
    x[:, 3] *= 30
    input_scale = torch.tensor([3.0 / 127])  # |x| > 3 (1.5 sigma) saturates, at both ends
    assert (x / input_scale < -127.5).sum() > 2
    y = w8a8_gemv(x, qweight, w_scale, input_scale, b, config=config, act_qmin=-128)
    ref = ref_w8a8_linear(x, qweight, w_scale, input_scale, b, act_qmin=-128)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    y127 = w8a8_gemv(x, qweight, w_scale, input_scale, b, config=config)
    torch.testing.assert_close(y127, ref_w8a8_linear(x, qweight, w_scale, input_scale, b), rtol=1e-5,
                               atol=1e-5 * ref.abs().max().item())
    assert (y127 - y).abs().max().item() > 1e-3 * ref.abs().max().item()


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_w8a8_gemv_zero_rows(kind):
    qweight, w_scale = _w8a8_weights(kind, 32, 64, True, seed=11)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(12))
    x[1] = 0  # all-zero token: the per-token scale's floor (not 0 / 0), codes 0
    torch.testing.assert_close(w8a8_gemv(x, qweight, w_scale), ref_w8a8_linear(x, qweight, w_scale), rtol=1e-5,
                               atol=1e-6)
    assert w8a8_gemv(x[:0], qweight, w_scale).shape == (0, 32)


@pytest.mark.parametrize("kind,m", [("fp8", 1), ("fp8", 3), ("int8", 2)])
def test_w8a8_gemv_takes_quantized_rows(kind, m):
    """Rows a norm already quantized (``QuantizedRows``: codes and per-token scales, as ``quantize_rows`` writes
    them) give what the GEMV gives when it quantizes the same rows itself, in the requested output dtype."""
    from kernels.w8a8_gemm import QuantizedRows, quantize_rows

    qweight, w_scale = _w8a8_weights(kind, 40, 80, True, seed=20 + m)
    x, b = _x_bias((m, 80), 40, torch.bfloat16, True, seed=21 + m)
    x[:, 5] *= 30
    codes, scales = quantize_rows(x, qweight.dtype)
    y = w8a8_gemv(QuantizedRows(codes, scales), qweight, w_scale, None, b, out_dtype=torch.bfloat16,
                  config=GemvConfig(16, 32, split_k=2))
    assert y.dtype == torch.bfloat16 and y.shape == (m, 40)
    torch.testing.assert_close(y, w8a8_gemv(x, qweight, w_scale, None, b), rtol=0, atol=0)
    with pytest.raises(ValueError, match="static input_scale"):
        w8a8_gemv(QuantizedRows(codes, scales), qweight, w_scale, torch.tensor([0.1]))
    with pytest.raises(ValueError, match="scales"):
        w8a8_gemv(QuantizedRows(codes, scales[:0]), qweight, w_scale)


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_w8a8_gemv_takes_rows_at_a_static_scale(kind):
    """Rows a norm quantized at a linear's calibrated scale come with that one scale expanded over the rows (stride
    0, as quantize_rows_static returns it): the GEMV gives what it gives when it quantizes the rows itself at that
    static scale."""
    from kernels.w8a8_gemm import QuantizedRows, quantize_rows_static

    qweight, w_scale = _w8a8_weights(kind, 40, 80, True, seed=31)
    x, b = _x_bias((3, 80), 40, torch.bfloat16, True, seed=32)
    input_scale = x.float().abs().amax().reshape(1) / (448.0 if kind == "fp8" else 127.0)
    codes, scales = quantize_rows_static(x, input_scale, qweight.dtype)
    assert scales.stride(0) == 0 and scales.shape == (3, 1)
    y = w8a8_gemv(QuantizedRows(codes, scales), qweight, w_scale, None, b, out_dtype=torch.bfloat16)
    torch.testing.assert_close(y, w8a8_gemv(x, qweight, w_scale, input_scale, b), rtol=0, atol=0)


def test_split_counters_are_zero_after_each_launch():
    """The tile counters (one buffer per device) must be zero between launches: the last program resets them."""
    _check_w4a16((2,), 48, 128, 32, torch.float32, False, seed=12, config=GemvConfig(16, 32, split_k=4))
    _check_w8a8("int8", (1,), 48, 96, torch.float32, False, False, seed=13, config=GemvConfig(16, 32, split_k=3))
    counters = gemv._COUNTERS[("cpu", None)]
    assert counters.numel() >= gemv._MIN_COUNTERS and not counters.any()


def test_rejects_bad_inputs():
    _, packed = _packed(32, 64, 32, seed=14)
    qweight, w_scale = _w8a8_weights("fp8", 32, 64, True, seed=15)
    too_many = torch.randn(GEMV_MAX_ROWS + 1, 64)
    with pytest.raises(ValueError, match=f"at most GEMV_MAX_ROWS = {GEMV_MAX_ROWS} rows of x, got 5"):
        w4a16_gemv(too_many, **packed)
    with pytest.raises(ValueError, match="at most GEMV_MAX_ROWS"):
        w8a8_gemv(too_many.view(5, 1, 64), qweight, w_scale)
    with pytest.raises(ValueError, match="k_major"):
        w4a16_gemv(torch.randn(1, 64), **{**packed, "layout": "passes"})
    with pytest.raises(ValueError, match="x has 63 input features, the weights 64"):
        w4a16_gemv(torch.randn(1, 63), **packed)
    with pytest.raises(ValueError, match="bias"):
        w4a16_gemv(torch.randn(1, 64), **packed, bias=torch.randn(31))
    with pytest.raises(ValueError, match="x has 65 input features, qweight 64"):
        w8a8_gemv(torch.randn(1, 65), qweight, w_scale)
    with pytest.raises(ValueError, match="weight_scale"):
        w8a8_gemv(torch.randn(1, 64), qweight, w_scale[:3])
    with pytest.raises(ValueError, match="x dtype"):
        w8a8_gemv(torch.randn(1, 64).double(), qweight, w_scale)
