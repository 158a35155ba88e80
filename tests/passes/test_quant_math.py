"""The shared integer quantization convention (passes/quant_math.py)."""

from __future__ import annotations

import pytest
import torch

from passes.quant_math import (QuantConfig, compute_qparams, dequantize, dequantize_groups, fake_quantize_groups,
                               pack_int4, quantize, quantize_groups, unpack_int4)

CONFIGS = [QuantConfig(bits=b, group_size=gs, symmetric=sym)
           for b in (4, 8) for gs in (32, -1) for sym in (False, True)]


def _w(out=16, inp=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g)
    w[3] += 2.0  # an all-positive-ish row: the asymmetric range must still contain 0
    w[5, :64] = -torch.rand(64, generator=g) - 0.1  # an all-negative group
    return w


def _ref_params(wg: torch.Tensor, bits: int, sym: bool):
    """Independent per-group parameters straight from the documented formulas (wg: [rows, g])."""
    if sym:
        scale = wg.abs().max(dim=1).values / (7.5 if bits == 4 else 127.5)
        zero = torch.full_like(scale, 2 ** (bits - 1))
    else:
        lo = torch.minimum(wg.min(dim=1).values, torch.zeros(wg.shape[0]))
        hi = torch.maximum(wg.max(dim=1).values, torch.zeros(wg.shape[0]))
        scale = (hi - lo) / (2 ** bits - 1)
        zero = torch.round(-lo / scale).clamp(0, 2 ** bits - 1)
    return scale, zero


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"b{c.bits}-g{c.group_size}-{'sym' if c.symmetric else 'asym'}")
def test_round_trip_error_bound(cfg):
    w = _w()
    codes, scales, zeros = quantize_groups(w, cfg)
    g = w.shape[1] if cfg.group_size == -1 else cfg.group_size
    ng = w.shape[1] // g
    assert codes.dtype == torch.uint8 and zeros.dtype == torch.uint8 and scales.dtype == torch.float32
    assert codes.shape == w.shape and scales.shape == (w.shape[0], ng) == zeros.shape
    assert int(codes.max()) <= 2 ** cfg.bits - 1
    ref_scale, ref_zero = _ref_params(w.reshape(-1, g), cfg.bits, cfg.symmetric)
    torch.testing.assert_close(scales.reshape(-1), ref_scale, rtol=1e-6, atol=0)
    assert torch.equal(zeros.reshape(-1).float(), ref_zero)
    w_hat = dequantize_groups(codes, scales, zeros, cfg.group_size)
    per_elem_scale = scales.repeat_interleave(g, dim=1)
    # fp32 division leaves +-amax / scale a few ulps off the half step (127.5: ulp 2^-17, 2e-5 of a half step)
    assert ((w - w_hat).abs() <= per_elem_scale / 2 * (1 + 1e-4)).all()
    torch.testing.assert_close(fake_quantize_groups(w, cfg), w_hat, rtol=0, atol=1e-6)
    if cfg.symmetric:
        assert (zeros == 2 ** (cfg.bits - 1)).all()
    else:
        # the group's extremes (or zero) map to the code range ends
        assert (codes.reshape(-1, g).amax(1) == 2 ** cfg.bits - 1).logical_or(
            codes.reshape(-1, g).amin(1) == 0).all()


def test_compute_qparams_on_a_slice_matches_groups():
    cfg = QuantConfig(bits=4, group_size=32)
    w = _w()
    _, scales, zeros = quantize_groups(w, cfg)
    s, z = compute_qparams(w[:, 64:96], cfg)
    assert s.shape == (w.shape[0], 1) and z.shape == (w.shape[0], 1)
    torch.testing.assert_close(s[:, 0], scales[:, 2])
    assert torch.equal(z[:, 0], zeros[:, 2].float())
    q = quantize(w[:, 64:96], s, z, 4)
    assert torch.equal(q.to(torch.uint8), quantize_groups(w, cfg)[0][:, 64:96])
    torch.testing.assert_close(dequantize(q, s, z), fake_quantize_groups(w, cfg)[:, 64:96])


def test_int8_symmetric_uses_amax_over_127_5():
    """The whole code range -128 .. 127, as int8_wo rounds (``int8_channels``): the same codes and scales."""
    from passes.int8_wo import int8_channels

    w = torch.tensor([[2.54, -1.0, 0.5, 2.525, 0.0, -2.54, 0.314, 1.1]])
    codes, scales, zeros = quantize_groups(w, QuantConfig(bits=8, group_size=-1, symmetric=True))
    scale = torch.tensor(2.54) / 127.5  # amax / 127.5, not amax / 127
    assert scales.item() == scale.item()
    assert zeros.item() == 128
    # 2.525 / (2.54 / 127.5) = 126.75 -> 127 (with amax / 127: 126.25 -> 126); +-2.54 land on +-127.49999 in fp32
    assert codes.tolist() == [[255, 78, 153, 255, 128, 1, 128 + 16, 128 + 55]]
    wo_codes, wo_scales, wo_zeros = int8_channels(w)
    assert torch.equal(codes, wo_codes) and torch.equal(scales, wo_scales) and torch.equal(zeros, wo_zeros)
    w_hat = dequantize_groups(codes, scales, zeros, -1)
    assert w_hat[0, 0].item() == pytest.approx(127 * 2.54 / 127.5, rel=1e-6)


def test_int4_symmetric_uses_amax_over_7_5():
    """The whole code range -8 .. 7 (GPTQ's and compressed-tensors' grid): -amax lands on -8, +amax on 7.5, rounded
    (half to even) to 8 and clamped to 7."""
    w = torch.tensor([[0.7, -0.36, 0.1, -0.7, 0.0, 0.26, 0.44, 0.04]])
    codes, scales, zeros = quantize_groups(w, QuantConfig(bits=4, group_size=8, symmetric=True))
    assert scales.item() == (torch.tensor(0.7) / 7.5).item()
    assert zeros.item() == 8
    # 0.7->7.5->8->clamped 7, -0.36->-3.86->-4, 0.1->1.07->1, -0.7->-7.5->-8, 0->0, 0.26->2.79->3, 0.44->4.71->5,
    # 0.04->0.43->0
    assert codes.tolist() == [[15, 4, 9, 0, 8, 11, 13, 8]]


def test_all_zero_group_gives_no_nan():
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    w[1, 32:] = 0
    w[2] = 0
    for sym in (False, True):
        cfg = QuantConfig(bits=4, group_size=32, symmetric=sym)
        codes, scales, zeros = quantize_groups(w, cfg)
        assert torch.isfinite(scales).all() and (scales > 0).all()
        w_hat = dequantize_groups(codes, scales, zeros, 32)
        assert torch.isfinite(w_hat).all()
        assert (w_hat[1, 32:] == 0).all() and (w_hat[2] == 0).all()
        assert torch.isfinite(fake_quantize_groups(w, cfg)).all()


def test_pack_unpack_exact_inverse_and_layout():
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (8, 64), generator=g, dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (8, 32)
    assert torch.equal(unpack_int4(packed), codes)
    # low nibble = even input index
    hand = pack_int4(torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8))
    assert hand.tolist() == [[0x21, 0x0F]]
    # the runtime reads the same layout
    from kernels.torch_quant import unpack_int4 as runtime_unpack
    assert torch.equal(runtime_unpack(packed), codes)


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError):
        pack_int4(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError):
        pack_int4(torch.full((2, 4), 16, dtype=torch.uint8))


def test_dequantize_matches_runtime():
    from kernels.torch_quant import dequantize_weight
    w = _w()
    for gs in (32, -1):
        codes, scales, zeros = quantize_groups(w, QuantConfig(bits=4, group_size=gs))
        ours = dequantize_groups(codes, scales, zeros, gs)
        theirs = dequantize_weight(pack_int4(codes), scales, zeros, 4, gs, torch.float32)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_per_channel_is_one_group_over_the_row():
    w = _w()
    cfg = QuantConfig(bits=4, group_size=-1)
    _, scales, zeros = quantize_groups(w, cfg)
    assert scales.shape == (w.shape[0], 1)
    ref_scale, ref_zero = _ref_params(w, 4, False)
    torch.testing.assert_close(scales[:, 0], ref_scale, rtol=1e-6, atol=0)
    assert torch.equal(zeros[:, 0].float(), ref_zero)
    # differs from grouped quantization
    assert not torch.equal(fake_quantize_groups(w, cfg), fake_quantize_groups(w, QuantConfig(bits=4, group_size=32)))


def test_bad_group_size():
    w = torch.randn(4, 96)
    with pytest.raises(ValueError, match=r"96.*64|64.*96"):
        quantize_groups(w, QuantConfig(group_size=64))
    with pytest.raises(ValueError, match=r"96.*64|64.*96"):
        fake_quantize_groups(w, QuantConfig(group_size=64))
    with pytest.raises(ValueError):
        QuantConfig(group_size=0)
    with pytest.raises(ValueError):
        QuantConfig(bits=3)


def test_int8_wo_rounds_on_amax_over_127_5():
    """int8_channels: by default each row's scale is amax / 127.5 over the whole [-128, 127] code range around the
    zero point 128 (-amax lands on -128, +amax clamps to 127); an all-zero row gets scale 1, codes 128. Given several
    divisors (older artifacts recorded amax / 127 and / 127.5), each row takes the one with the smaller squared error.
    The gates' round-to-nearest counterpart of an int8_wo build applies the rule its attrs record."""
    from builder.quality import _round_to_nearest
    from passes.int8_wo import SCALE_DIVISORS, int8_channels

    assert SCALE_DIVISORS == (127.5,)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g)
    w[1] = 0.0
    w[2, 7] = -w[2].abs().max() * 2  # a negative extreme: -amax lands on -128
    w[3, 5] = w[3].abs().max() * 2  # a positive extreme: +amax rounds to 128, clamped to 127
    codes, scales, zeros = int8_channels(w)
    assert codes.dtype == torch.uint8 and scales.shape == (64, 1) and torch.equal(zeros, torch.full((64, 1), 128,
                                                                                                   dtype=torch.uint8))
    assert torch.equal(codes[1], torch.full((256,), 128, dtype=torch.uint8)) and scales[1].item() == 1.0
    amax = w.abs().amax(1, keepdim=True)
    rows = [r for r in range(64) if r != 1]
    torch.testing.assert_close(scales[rows], amax[rows] / 127.5, rtol=0, atol=0)
    assert torch.equal(codes[rows].long() - 128, torch.round(w / (amax / 127.5)).clamp(-128, 127)[rows].long())
    assert codes[2, 7].item() == 0 and codes[3, 5].item() == 255
    # several divisors: the better per row
    two = (127.0, 127.5)
    codes2, scales2, _ = int8_channels(w, two)
    candidates = []
    for d in two:
        sc = amax / d
        q = torch.round(w / sc).clamp(-128, 127)
        candidates.append((((q * sc - w) ** 2).sum(1), sc))
    pick = torch.where(candidates[1][0] < candidates[0][0], 1, 0)
    for r in rows:
        assert scales2[r].item() == candidates[pick[r]][1][r].item(), r
    assert 0 < pick[rows].sum() < len(rows)  # both conventions win somewhere on random rows
    for recorded, (c, s_) in ((list(SCALE_DIVISORS), (codes, scales)), ([127.0, 127.5], (codes2, scales2))):
        _, rows_out, _, attrs = _round_to_nearest(w, {"scheme": "w8a16", "bits": 8, "group_size": -1,
                                                      "scale_divisors": recorded}, None, None)
        assert torch.equal(rows_out["qweight"], c) and torch.equal(rows_out["scales"], s_)
        assert attrs["scale_divisors"] == recorded
    with pytest.raises(ValueError, match="divisors"):
        int8_channels(w, (12.0,))


def test_int8_wo_refit_fits_the_scales_to_the_output_error():
    """calibrated_int8 (int8_wo's refit_scales): the default rule's codes, each row's scale re-solved for them on
    inputs of second moment H: no row's output error above the plain rounding's, and lower in total on inputs with
    outlier features."""
    from passes.gptq import HessianAccumulator
    from passes.int8_wo import calibrated_int8, int8_channels

    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 128, generator=g)
    x = torch.randn(512, 128, generator=g)
    x[:, :4] *= 20  # a few loud input features, as trained models have
    acc = HessianAccumulator(128)
    acc.add(x)
    H = acc.H

    def out_err(codes, scales):
        d = (codes.float() - 128) * scales - w
        return ((d @ H) * d).sum(1)

    plain = int8_channels(w)
    codes, scales, zeros = calibrated_int8(w, H)
    assert torch.equal(codes, plain[0]) and torch.equal(zeros, plain[2])
    before, after = out_err(*plain[:2]), out_err(codes, scales)
    assert (after <= before * (1 + 1e-6)).all()
    assert after.sum() < 0.97 * before.sum()
    assert not torch.equal(scales, plain[1])  # the refit moved scales
