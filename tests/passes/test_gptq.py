"""GPTQ (passes/gptq.py) against naive references on small random problems."""

from __future__ import annotations

import pytest
import torch

from passes.gptq import GPTQResult, HessianAccumulator, NotPositiveDefiniteError, gptq_quantize, refit_scales
from passes.quant_math import QuantConfig, dequantize_groups, quantize_groups

OUT, IN, TOKENS = 48, 128, 768


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _naive_rtn(w: torch.Tensor, bits: int, group_size: int, sym: bool) -> torch.Tensor:
    """Round to nearest per (row, group), written out from the convention, one group at a time."""
    out = torch.empty_like(w)
    g = w.shape[1] if group_size == -1 else group_size
    maxq = 2 ** bits - 1
    for r in range(w.shape[0]):
        for c0 in range(0, w.shape[1], g):
            grp = w[r, c0:c0 + g]
            if sym:
                scale = grp.abs().max() / (7.5 if bits == 4 else 2 ** (bits - 1) - 1)  # INT4: codes -8 .. 7
                zero = 2 ** (bits - 1)
            else:
                lo, hi = grp.min().clamp(max=0), grp.max().clamp(min=0)
                scale = (hi - lo) / maxq
                zero = torch.round(-lo / scale).clamp(0, maxq)
            q = (torch.round(grp / scale) + zero).clamp(0, maxq)
            out[r, c0:c0 + g] = (q - zero) * scale
    return out


def _weight(seed=0):
    return torch.randn(OUT, IN, generator=_gen(seed))


def _hessian(x):
    return 2 * x.t() @ x / x.shape[0]


def _correlated_x(seed=1):
    g = _gen(seed)
    z = torch.randn(TOKENS, IN, generator=g)
    a = torch.randn(IN, IN, generator=g) / IN ** 0.5
    return z @ a + 0.1 * z


def _check_result(res: GPTQResult, cfg: QuantConfig):
    g = IN if cfg.group_size == -1 else cfg.group_size
    assert res.codes.dtype == torch.uint8 and res.codes.shape == (OUT, IN)
    assert res.scales.dtype == torch.float32 and res.scales.shape == (OUT, IN // g)
    assert res.zeros.dtype == torch.uint8 and res.zeros.shape == (OUT, IN // g)
    assert int(res.codes.max()) <= 2 ** cfg.bits - 1
    torch.testing.assert_close(res.w_hat, dequantize_groups(res.codes, res.scales, res.zeros, cfg.group_size))
    assert res.loss >= 0 and torch.isfinite(res.w_hat).all()


@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("group_size", [32, -1])
def test_orthonormal_inputs_give_round_to_nearest(sym, group_size):
    cfg = QuantConfig(bits=4, group_size=group_size, symmetric=sym)
    w = _weight()
    q, _ = torch.linalg.qr(torch.randn(TOKENS, IN, generator=_gen(3), dtype=torch.float64))
    x = (q * TOKENS ** 0.5).float()  # X^T X / n = I up to rounding
    res = gptq_quantize(w, _hessian(x), cfg, block_size=48)
    _check_result(res, cfg)
    torch.testing.assert_close(res.w_hat, _naive_rtn(w, 4, group_size, sym), rtol=0, atol=1e-6)


@pytest.mark.parametrize("sym", [False, True])
def test_diagonal_hessian_with_act_order_gives_round_to_nearest(sym):
    # A diagonal H has no cross terms, so nothing is compensated: GPTQ must equal RTN whatever the
    # processing order, which checks that act-order's static groups and un-permutation are right.
    cfg = QuantConfig(bits=4, group_size=32, symmetric=sym)
    w = _weight(4)
    h = torch.diag(torch.rand(IN, generator=_gen(5)) + 0.5)
    assert not torch.equal(torch.argsort(torch.diag(h), descending=True), torch.arange(IN))
    for act_order in (False, True):
        res = gptq_quantize(w, h, cfg, act_order=act_order)
        _check_result(res, cfg)
        assert torch.equal(res.w_hat, _naive_rtn(w, 4, 32, sym))


def _out_err(x, w, w_hat):
    return ((x @ w_hat.t() - x @ w.t()) ** 2).sum().item()


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("sym", [False, True])
def test_gptq_beats_rtn_on_correlated_inputs(sym, act_order):
    cfg = QuantConfig(bits=4, group_size=32, symmetric=sym)
    w = _weight(6)
    x = _correlated_x(7)
    res = gptq_quantize(w, _hessian(x), cfg, act_order=act_order, block_size=64)
    _check_result(res, cfg)
    gptq_err = _out_err(x, w, res.w_hat)
    rtn_err = _out_err(x, w, _naive_rtn(w, 4, 32, sym))
    assert gptq_err < 0.9 * rtn_err, (gptq_err, rtn_err)
    # the reported loss is the objective 1/2 tr(dW H dW^T) = ||X dW^T||^2 / n (up to dampening)
    assert res.loss == pytest.approx(gptq_err / TOKENS, rel=0.1)


def test_group_start_inside_a_block_uses_updated_weights():
    # Groups of 32 starting inside 128-wide blocks, and groups of 64 spanning two 48-wide blocks,
    # must give the same result as processing one column per block (no lazy batching at all).
    w = _weight(8)
    h = _hessian(_correlated_x(9))
    for gs in (32, 64):
        cfg = QuantConfig(bits=4, group_size=gs)
        a = gptq_quantize(w, h, cfg, block_size=128)
        b = gptq_quantize(w, h, cfg, block_size=48)
        c = gptq_quantize(w, h, cfg, block_size=1)
        torch.testing.assert_close(a.scales, c.scales, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(b.scales, c.scales, rtol=1e-4, atol=1e-6)
        assert (a.codes != c.codes).float().mean() < 0.002 and (b.codes != c.codes).float().mean() < 0.002


def test_hessian_accumulator_over_chunks():
    x = _correlated_x(10)
    x[100:357] = x[100:357].to(torch.bfloat16).float()  # that chunk is fed as bf16
    acc = HessianAccumulator(IN)
    for a, b in [(0, 1), (1, 100), (100, 100), (100, 357), (357, TOKENS)]:
        acc.add(x[a:b].to(torch.bfloat16) if a == 100 else x[a:b])
    assert acc.num_tokens == TOKENS
    assert acc.H.dtype == torch.float32 and acc.H.shape == (IN, IN)
    ref = 2 * x.double().t() @ x.double() / TOKENS
    torch.testing.assert_close(acc.H.double(), ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError):
        acc.add(torch.randn(3, IN + 1))


def test_dead_inputs():
    cfg = QuantConfig(bits=4, group_size=32)
    x = _correlated_x(11)
    dead = [0, 5, 40, 127]
    x[:, dead] = 0
    w = _weight(12)
    h = _hessian(x)
    h_before = h.clone()
    res = gptq_quantize(w, h, cfg, act_order=True)
    assert torch.equal(h, h_before)  # the caller's Hessian is not modified
    _check_result(res, cfg)
    assert (res.w_hat[:, dead] == 0).all()
    alive = [i for i in range(IN) if i not in dead]
    assert _out_err(x, w, res.w_hat) < 0.9 * _out_err(x, w, _naive_rtn(w, 4, 32, False))
    assert res.w_hat[:, alive].abs().sum() > 0


def test_act_order_requires_static_groups():
    with pytest.raises(ValueError, match="static"):
        gptq_quantize(_weight(), torch.eye(IN), QuantConfig(), act_order=True, static_groups=False)


def test_not_positive_definite_is_a_clear_error():
    h = -torch.eye(IN)
    with pytest.raises(NotPositiveDefiniteError, match="damp"):
        gptq_quantize(_weight(), h, QuantConfig())


def test_bad_group_size():
    with pytest.raises(ValueError, match=r"128.*96|96.*128"):
        gptq_quantize(_weight(), torch.eye(IN), QuantConfig(group_size=96))


def _objective(w, w_hat, h):
    d = (w - w_hat).double()
    return ((d @ h.double()) * d).sum(-1)  # per row


@pytest.mark.parametrize("sym", [False, True])
def test_refit_scales_recovers_the_scales_that_made_the_weight(sym):
    """A weight that is exactly (q - z) * s_true per group: from any other positive scales, the least-squares refit
    returns s_true (the objective's unique minimum, 0)."""
    g = _gen(21)
    cfg = QuantConfig(bits=4, group_size=32, symmetric=sym)
    codes = torch.randint(0, 16, (OUT, IN), generator=g, dtype=torch.uint8)
    zeros = torch.full((OUT, IN // 32), 8) if sym else torch.randint(0, 16, (OUT, IN // 32), generator=g)
    zeros = zeros.to(torch.uint8)
    s_true = torch.rand(OUT, IN // 32, generator=g) + 0.05
    w = dequantize_groups(codes, s_true, zeros, 32)
    start = s_true * (0.5 + torch.rand(OUT, IN // 32, generator=g))
    s = refit_scales(w, codes, start, zeros, _hessian(_correlated_x()), cfg.group_size)
    torch.testing.assert_close(s, s_true, rtol=1e-4, atol=1e-6)


def test_refit_scales_lowers_the_output_error_and_keeps_the_codes():
    cfg = QuantConfig(bits=4, group_size=32, symmetric=False)
    w, x = _weight(22), _correlated_x(23)
    h = _hessian(x)
    codes, scales, zeros = quantize_groups(w, cfg)  # round to nearest: its scales fit the weights, not the outputs
    new = refit_scales(w, codes, scales, zeros, h, 32)
    before = _objective(w, dequantize_groups(codes, scales, zeros, 32), h)
    after = _objective(w, dequantize_groups(codes, new, zeros, 32), h)
    assert (after <= before).all()
    assert after.sum() < 0.95 * before.sum()
    assert (new > 0).all() and torch.isfinite(new).all()
    # rows it cannot improve keep their scales: a refit of the refit changes (almost) nothing
    again = refit_scales(w, codes, new, zeros, h, 32)
    assert (_objective(w, dequantize_groups(codes, again, zeros, 32), h) <= after * (1 + 1e-6)).all()


def test_refit_scales_keeps_the_old_scales_where_the_solution_is_not_positive():
    """A row whose codes sit at the zero point in one group (c = 0: that group's scale is free) and whose weights
    run against its codes in another gets a non-positive or singular solution; it keeps its scales."""
    cfg = QuantConfig(bits=4, group_size=32, symmetric=True)
    w = _weight(24)[:2]
    codes, scales, zeros = quantize_groups(w, cfg)
    codes[0] = 16 - codes[0]  # row 0's codes now say -w: the best scale would be negative
    new = refit_scales(w, codes, scales, zeros, _hessian(_correlated_x(25)), 32)
    assert torch.equal(new[0], scales[0])
    assert not torch.equal(new[1], scales[1])


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_refit_keeps_the_codes_and_lowers_the_objective(act_order):
    cfg = QuantConfig(bits=4, group_size=32, symmetric=False)
    w, x = _weight(26), _correlated_x(27)
    h = _hessian(x)
    plain = gptq_quantize(w, h, cfg, act_order=act_order)
    refit = gptq_quantize(w, h, cfg, act_order=act_order, refit=True)
    _check_result(refit, cfg)
    assert torch.equal(plain.codes, refit.codes) and torch.equal(plain.zeros, refit.zeros)
    before, after = _objective(w, plain.w_hat, h), _objective(w, refit.w_hat, h)
    assert (after <= before * (1 + 1e-6)).all() and after.sum() < before.sum()


def test_refit_scales_rejects_mismatched_shapes():
    w = _weight()
    codes, scales, zeros = quantize_groups(w, QuantConfig(group_size=32))
    with pytest.raises(ValueError, match="H"):
        refit_scales(w, codes, scales, zeros, torch.eye(IN + 1), 32)
    with pytest.raises(ValueError, match="scales"):
        refit_scales(w, codes, scales[:, :2], zeros, torch.eye(IN), 32)
