"""The w4a16 / w8a16 Triton GEMM against its torch reference, under the Triton interpreter on CPU.

Weights are real pass outputs: ``passes.quant_math.quantize_groups`` codes (packed by ``pack_int4``),
fp32 scales and uint8 zeros, asymmetric and symmetric.
"""

from __future__ import annotations

import itertools
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton / kernels are imported

import pytest
import torch

from kernels import w4a16_gemm
from kernels.w4a16_gemm import (
    GemmConfig,
    dequantize_w4a16,
    ref_w4a16_linear,
    repack_w4a16,
    unrepack_w4a16,
    w4a16_linear,
)
from passes.quant_math import QuantConfig, pack_int4, quantize_groups, unpack_int4
from kernels.torch_quant import dequantize_weight

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _quantized(out_f: int, in_f: int, bits: int, group_size: int, symmetric: bool, seed: int) -> dict:
    """A random weight quantized by the passes' convention, as keyword arguments of the kernels."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    w[:, : in_f // 4] += 0.03  # groups whose range is not centred on 0: zero points away from the middle
    codes, scales, zeros = quantize_groups(w, QuantConfig(bits=bits, group_size=group_size, symmetric=symmetric))
    assert symmetric or len(torch.unique(zeros)) > 1, "asymmetric zero points should vary"
    return {"qweight": pack_int4(codes) if bits == 4 else codes, "scales": scales, "zeros": zeros,
            "group_size": group_size, "bits": bits, "layout": "passes"}


def _in_layout(weights: dict, layout: str) -> dict:
    if layout == "passes":
        return weights
    return repack_w4a16(weights["qweight"], weights["scales"], weights["zeros"], weights["group_size"],
                        weights["bits"])


def _inputs(m: int, in_f: int, out_f: int, dtype: torch.dtype, bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, in_f, generator=g).to(dtype)
    b = (torch.randn(out_f, generator=g) * 0.1).to(dtype) if bias else None
    return x, b


def _assert_matches(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert y.dtype == ref.dtype and y.shape == ref.shape
    tol = TOL[ref.dtype]
    scale = ref.float().abs().max().item()
    torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol * scale)


def _check(m: int, weights: dict, layout: str, dtype: torch.dtype, bias: bool, seed: int,
           config: GemmConfig | None = None) -> None:
    """The kernel on ``weights`` stored in ``layout`` against the reference on the passes' layout."""
    out_f, in_f = weights["qweight"].shape[0], weights["qweight"].shape[1] * 8 // weights["bits"]
    x, b = _inputs(m, in_f, out_f, dtype, bias, seed)
    _assert_matches(w4a16_linear(x, **_in_layout(weights, layout), bias=b, config=config),
                    ref_w4a16_linear(x, **weights, bias=b))


# M x group_size x dtype in full; N, K, symmetry, bias and layout cycle so each value meets the others.
_VARIANTS = list(itertools.product((64, 96), (128, 256), (False, True), (True, False), ("passes", "k_major")))
CASES = [(m, gs, dt, *_VARIANTS[(7 * i) % len(_VARIANTS)])
         for i, (m, gs, dt) in enumerate(itertools.product((1, 5, 33), (32, 64, 128, -1),
                                                           (torch.float32, torch.bfloat16)))]


@pytest.mark.parametrize("m,group_size,dtype,n,k,symmetric,bias,layout", CASES,
                         ids=lambda v: str(v).replace("torch.", ""))
def test_w4a16_matches_reference(m, group_size, dtype, n, k, symmetric, bias, layout):
    _check(m, _quantized(n, k, 4, group_size, symmetric, seed=m + k), layout, dtype, bias, seed=n)


@pytest.mark.parametrize("config", [
    GemmConfig(16, 32, 32, split_k=2),  # even K split, reduced by the second kernel (with the bias)
    GemmConfig(16, 32, 64, split_k=3),  # uneven split (4 K steps over 3 programs); 2 groups per K step
    GemmConfig(32, 64, 64, split_k=1, group_m=2),  # groups gathered per (k, n); grouped tile order
], ids=["split2", "split3-uneven", "gather-groups"])
@pytest.mark.parametrize("layout", ["passes", "k_major"])
def test_w4a16_configs(config, layout):
    _check(37, _quantized(96, 256, 4, 32, False, seed=3), layout, torch.float32, True, seed=4, config=config)


def test_k_major_unaligned_halves():
    # K/2 = 48 is not a multiple of the half step (32): the high nibbles' groups are gathered
    _check(3, _quantized(32, 96, 4, -1, False, seed=17), "k_major", torch.float32, True, seed=18,
           config=GemmConfig(16, 32, 64))


@pytest.mark.parametrize("m,group_size,symmetric,dtype", [(9, 64, False, torch.float32), (9, -1, True, torch.bfloat16),
                                                          (1, 32, False, torch.float16)])
@pytest.mark.parametrize("layout", ["passes", "k_major"])
def test_w8a16_matches_reference(m, group_size, symmetric, dtype, layout):
    _check(m, _quantized(64, 128, 8, group_size, symmetric, seed=5), layout, dtype, True, seed=6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tf32_dot_mode(dtype):
    _check(17, _quantized(64, 256, 4, 128, False, seed=13), "k_major", dtype, True, seed=14,
           config=GemmConfig(16, 32, 64, tf32_dot=True))


@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, -1), (8, 64)])
@pytest.mark.parametrize("layout", ["passes", "k_major"])
def test_dequantize_is_the_runtimes(bits, group_size, layout):
    weights = _quantized(96, 128, bits, group_size, False, seed=15)
    w = dequantize_w4a16(**_in_layout(weights, layout), dtype=torch.float32)
    assert w.shape == (96, 128) and w.stride() == (1, 96)  # [N, K] stored K-major
    assert torch.equal(w, dequantize_weight(weights["qweight"], weights["scales"], weights["zeros"], bits,
                                            group_size, torch.float32))


def test_large_batches_dequantize_then_matmul(monkeypatch):
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[4])
        return dequantize_w4a16(*args, **kwargs)

    monkeypatch.setattr(w4a16_gemm, "DEQUANT_MIN_ROWS", 6)
    monkeypatch.setattr(w4a16_gemm, "dequantize_w4a16", spy)
    weights = _quantized(64, 128, 4, 64, True, seed=16)
    for m in (5, 6, 40):
        _check(m, weights, "k_major", torch.float32, True, seed=m)
    assert calls == [torch.float32, torch.float32]  # 6 and 40 rows; 5 rows ran the fused kernel


def test_float16_and_leading_dims():
    weights = _quantized(64, 128, 4, 64, False, seed=7)
    x, _ = _inputs(6, 128, 64, torch.float16, False, seed=8)
    y = w4a16_linear(x.view(2, 3, 128), **weights)
    assert y.shape == (2, 3, 64)
    _assert_matches(y.reshape(6, 64), ref_w4a16_linear(x, **weights))
    assert w4a16_linear(x[:0], **weights).shape == (0, 64)


@pytest.mark.parametrize("bits", [4, 8])
def test_repack_round_trips(bits):
    weights = _quantized(96, 256, bits, 64, False, seed=9)
    packed = repack_w4a16(weights["qweight"], weights["scales"], weights["zeros"], 64, bits)
    assert packed["layout"] == "k_major" and packed["group_size"] == 64 and packed["bits"] == bits
    assert packed["qweight"].shape == (256 * bits // 8, 96) and packed["scales"].shape == (4, 96)
    if bits == 4:  # byte [j, n] = q[n, j] | q[n, j + K/2] << 4
        codes = unpack_int4(weights["qweight"])
        assert torch.equal(packed["qweight"][5, 7], codes[7, 5] | (codes[7, 128 + 5] << 4))
    back = unrepack_w4a16(packed["qweight"], packed["scales"], packed["zeros"], 64, bits)
    for name, restored in zip(("qweight", "scales", "zeros"), back):
        assert torch.equal(restored, weights[name]), name


def test_rejects_mismatched_weights():
    weights = _quantized(64, 128, 4, 32, False, seed=11)
    x, _ = _inputs(2, 128, 64, torch.float32, False, seed=12)
    with pytest.raises(ValueError, match="group_size 48 does not divide"):
        w4a16_linear(x, **{**weights, "group_size": 48})
    with pytest.raises(ValueError, match="do not match qweight"):
        w4a16_linear(x, **{**weights, "group_size": 64})
    with pytest.raises(ValueError, match="x has 256 input features, the weights 128"):
        w4a16_linear(torch.randn(2, 256), **weights)
    with pytest.raises(ValueError, match="bias"):
        w4a16_linear(x, **weights, bias=torch.randn(63))
    with pytest.raises(ValueError, match="layout"):
        w4a16_linear(x, **{**weights, "layout": "n_major"})
