"""The tensor-core W4A16 / W8A16 kernel (``kernels/w4a16_mma.py``) against the torch reference, under the Triton
interpreter on CPU: its layout round-trips, its dequantization equals the passes' bit for bit, and its products
match ``ref_w4a16_linear`` for every path (per-step correction, one group per channel, the dequantizing variant,
two chunks per step, K splits, several M tiles), on fresh seeded random weights and inputs."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton / kernels are imported

import pytest
import torch

from kernels.torch_quant import dequantize_weight
from kernels.w4a16_gemm import ref_w4a16_linear
from kernels.w4a16_mma import (
    MmaConfig,
    dequantize_mma,
    pair_span,
    repack_mma,
    supports,
    unrepack_mma,
    w4a16_mma,
)
from passes.quant_math import QuantConfig, pack_int4, quantize_groups

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _weights(n: int, k: int, group_size: int, bits: int, seed: int) -> dict:
    """The passes' quantized weights of a random [n, k] matrix, as keyword arguments of ref_w4a16_linear."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, : k // 4] += 0.03  # groups off-centre: zero points vary
    codes, scales, zeros = quantize_groups(w, QuantConfig(bits=bits, group_size=group_size, symmetric=False))
    return {"qweight": pack_int4(codes) if bits == 4 else codes, "scales": scales, "zeros": zeros,
            "group_size": group_size, "bits": bits, "layout": "passes"}


def _check(m: int, n: int, k: int, group_size: int, bits: int, dtype: torch.dtype, bias: bool, seed: int,
           config: MmaConfig | None = None, tiled: bool | None = None) -> None:
    passes = _weights(n, k, group_size, bits, seed)
    packed = repack_mma(passes["qweight"], passes["scales"], passes["zeros"], group_size, bits, tiled=tiled)
    g = torch.Generator().manual_seed(seed + 1)
    x = (torch.randn(m, k, generator=g) * 2).to(dtype)
    b = (torch.randn(n, generator=g) * 0.1).to(dtype) if bias else None
    y, ref = w4a16_mma(x, **packed, bias=b, config=config), ref_w4a16_linear(x, **passes, bias=b)
    assert y.dtype == ref.dtype and y.shape == ref.shape
    tol = TOL[dtype]
    torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max().item())


SPLIT2 = MmaConfig(32, 16, split_k=2, num_warps=1, num_stages=1)
CASES = [  # (m, n, k, group_size, bits, dtype, bias, config); fp32 x always takes the dequantizing variant
    (1, 64, 128, 32, 4, torch.float16, True, None),  # pair span 16: per-step correction
    (3, 48, 256, 64, 4, torch.bfloat16, False, None),  # ragged N tile (48 of 32-wide tiles)
    (5, 64, 128, -1, 4, torch.float16, True, None),  # one group per channel: corrected once, at the end
    (2, 32, 64, 32, 8, torch.float16, True, None),
    (4, 40, 128, -1, 8, torch.bfloat16, True, MmaConfig(32, 16, split_k=3, num_warps=1, num_stages=1)),
    (17, 64, 256, 128, 4, torch.bfloat16, False, SPLIT2),  # two M tiles, each with its own split counters
    (3, 64, 512, 128, 4, torch.float16, True, MmaConfig(32, 16, chunks=2, split_k=2, num_warps=1, num_stages=1)),
    (3, 64, 384, 128, 4, torch.float32, True, MmaConfig(32, 16, chunks=2, num_warps=1, num_stages=1)),  # odd
    (1, 64, 128, 32, 4, torch.float32, True, None),
    (17, 64, 256, -1, 8, torch.float32, False, SPLIT2),
    (20, 64, 512, 128, 4, torch.bfloat16, True, MmaConfig(32, 16, dequant=True, split_k=2, num_warps=1,
                                                          num_stages=1)),
    (20, 64, 256, -1, 8, torch.float32, False, MmaConfig(32, 32, dequant=True, num_warps=1, num_stages=1)),
    # zero points subtracted per weight, the products scaled per group (4 bits; 8 bits keep the correction)
    (1, 64, 256, 64, 4, torch.bfloat16, True, MmaConfig(32, 16, zsub=True, split_k=2, num_warps=1, num_stages=1)),
    (3, 48, 512, 128, 4, torch.float16, False, MmaConfig(32, 16, zsub=True, split_k=3, num_warps=1,
                                                         num_stages=1)),  # ragged N tile, 4 steps over 3 splits
    (2, 64, 256, -1, 4, torch.bfloat16, True, MmaConfig(32, 16, zsub=True, num_warps=1,
                                                        num_stages=1)),  # one group: scaled once, at the end
    (3, 64, 512, 128, 4, torch.bfloat16, True, MmaConfig(32, 16, zsub=True, chunks=2, split_k=2, num_warps=1,
                                                         num_stages=1)),
    (4, 64, 256, -1, 8, torch.float16, False, MmaConfig(32, 16, zsub=True, num_warps=1, num_stages=1)),
]


@pytest.mark.parametrize("m,n,k,group_size,bits,dtype,bias,config", CASES)
def test_mma_matches_the_reference(m, n, k, group_size, bits, dtype, bias, config):
    _check(m, n, k, group_size, bits, dtype, bias, seed=m * 31 + n + k + group_size, config=config)


@pytest.mark.parametrize("m,n,k,group_size,bits,dtype,bias,config", [CASES[i] for i in (0, 3, 6, 8, 11, 13)])
def test_mma_matches_the_reference_untiled(m, n, k, group_size, bits, dtype, bias, config):
    """The same kernel on the untiled layout (rows of K/2 or K bytes)."""
    _check(m, n, k, group_size, bits, dtype, bias, seed=m * 17 + n + k, config=config, tiled=False)


@pytest.mark.parametrize("m,n,k,group_size,bits,dtype,bias,config", [CASES[i] for i in (0, 1, 3, 6, 8, 10, 12)])
def test_gated_equals_silu_mul_then_the_linear(m, n, k, group_size, bits, dtype, bias, config):
    """gated=True (the SwiGLU in the linear's x loads) gives bit for bit the linear of silu_mul's output."""
    from kernels.activation import silu_mul

    passes = _weights(n, k, group_size, bits, seed=m + n + k)
    packed = repack_mma(passes["qweight"], passes["scales"], passes["zeros"], group_size, bits)
    g = torch.Generator().manual_seed(k + 3)
    gate_up = (torch.randn(m, 2 * k, generator=g) * 3).to(dtype)
    b = (torch.randn(n, generator=g) * 0.1).to(dtype) if bias else None
    fused = w4a16_mma(gate_up, **packed, bias=b, config=config, gated=True)
    separate = w4a16_mma(silu_mul(gate_up), **packed, bias=b, config=config)
    assert torch.equal(fused, separate)
    ref = ref_w4a16_linear(silu_mul(gate_up), **passes, bias=b)
    tol = TOL[dtype]
    torch.testing.assert_close(fused.float(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max().item())
    with pytest.raises(ValueError, match="gate and up"):
        w4a16_mma(gate_up[:, :k], **packed, gated=True)


@pytest.mark.parametrize("tiled", [True, False])
@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 128), (4, -1), (8, 64), (8, -1)])
def test_layout_round_trips_and_dequantizes_exactly(bits, group_size, tiled):
    passes = _weights(48, 256, group_size, bits, seed=7)
    packed = repack_mma(passes["qweight"], passes["scales"], passes["zeros"], group_size, bits, tiled=tiled)
    assert packed["layout"] == "mma" and packed["qweight"].shape == passes["qweight"].shape
    assert packed["tile_n"] == (16 if tiled else 0)  # 48 columns: tiles of 16
    for got, want in zip(unrepack_mma(**packed), (passes["qweight"], passes["scales"], passes["zeros"])):
        assert torch.equal(got, want)
    want = dequantize_weight(passes["qweight"], passes["scales"], passes["zeros"], bits, group_size, torch.float32)
    assert torch.equal(dequantize_mma(**packed, dtype=torch.float32), want)


@pytest.mark.parametrize("group_size", [128, -1])
def test_fp32_keeps_the_references_precision(group_size):
    """fp32 x (reference-precision artifacts) at K = 4096 with a positive mean, against a float64 reference: the
    per-group correction would cancel two sums ~100x the result (relative error ~6e-4); fp32 takes the
    dequantizing variant, within fp32's own rounding."""
    passes = _weights(32, 4096, group_size, 4, seed=11)
    packed = repack_mma(passes["qweight"], passes["scales"], passes["zeros"], group_size, 4)
    x = torch.rand(1, 4096, generator=torch.Generator().manual_seed(12)) + 0.5
    w = dequantize_weight(passes["qweight"], passes["scales"], passes["zeros"], 4, group_size, torch.float64)
    want = x.double() @ w.t()
    err = ((w4a16_mma(x, **packed).double() - want).abs().max() / want.abs().max()).item()
    assert err < 1e-5, err


def test_tiles_are_contiguous():
    """Tiled, one program's K step (tile_n rows x pair_span bytes) is one contiguous block of qweight."""
    passes = _weights(64, 256, 128, 4, seed=5)
    flat = repack_mma(passes["qweight"], passes["scales"], passes["zeros"], 128, 4, tiled=False)["qweight"]
    tiled = repack_mma(passes["qweight"], passes["scales"], passes["zeros"], 128, 4, tiled=True)
    t, p = tiled["tile_n"], tiled["pair_span"]
    assert (t, p) == (64, 64)
    assert torch.equal(tiled["qweight"].reshape(-1)[t * p: 2 * t * p].reshape(t, p), flat[:t, p: 2 * p])


def test_chunk_pairs_lie_in_one_group():
    """A 4-bit chunk's low nibbles are its first pair_span input features, the high nibbles the next ones."""
    passes = _weights(4, 256, 64, 4, seed=3)
    packed = repack_mma(passes["qweight"], passes["scales"], passes["zeros"], 64, 4, tiled=False)
    span = packed["pair_span"]
    assert span == pair_span(64, 256) == 32
    codes = torch.stack((passes["qweight"] & 0xF, passes["qweight"] >> 4), 2).reshape(4, 256)  # q[n, k]
    first = packed["qweight"][:, :span]
    assert torch.equal(first & 0xF, codes[:, :span]) and torch.equal(first >> 4, codes[:, span: 2 * span])


def test_shapes_it_does_not_take_are_refused():
    assert not supports(4, 16, 256)  # a chunk of 8 bytes: below tl.dot's 16
    assert supports(4, 32, 256) and supports(8, -1, 4096) and not supports(8, 8, 256)
    passes = _weights(32, 64, 16, 4, seed=1)
    with pytest.raises(ValueError, match="group_size 16"):
        repack_mma(passes["qweight"], passes["scales"], passes["zeros"], 16, 4)
    passes = _weights(32, 64, 32, 4, seed=1)
    packed = repack_mma(passes["qweight"], passes["scales"], passes["zeros"], 32, 4)
    with pytest.raises(ValueError, match="'mma' layout"):
        w4a16_mma(torch.randn(1, 64), **{**packed, "layout": "k_major"})
    with pytest.raises(ValueError, match="pair_span"):
        w4a16_mma(torch.randn(1, 64), **{**packed, "pair_span": 8})
    with pytest.raises(ValueError, match="tile_n"):
        w4a16_mma(torch.randn(1, 64), **{**packed, "tile_n": 64})
    with pytest.raises(ValueError, match="input features"):
        w4a16_mma(torch.randn(1, 32), **packed)
    with pytest.raises(ValueError, match="MMA_MAX_ROWS"):
        w4a16_mma(torch.randn(257, 64), **packed)
