"""AWQ's searches (passes/awq.py) on small synthetic blocks."""

from __future__ import annotations

import pytest
import torch

from passes.awq import activation_stat, apply_clip, search_clip, search_scale, weight_stat
from passes.quant_math import QuantConfig, fake_quantize_groups

IN, TOKENS = 128, 384
OUTLIERS = [3, 17, 60, 99]
CFG = QuantConfig(bits=4, group_size=32, symmetric=False)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _x(seed=0):
    x = torch.randn(TOKENS, IN, generator=_gen(seed))
    x[:, OUTLIERS] *= 25.0  # a few salient input channels
    return x


def _weights(seed=1):
    g = _gen(seed)
    return [torch.randn(64, IN, generator=g), torch.randn(32, IN, generator=g)]


def concat_block(x, ws):
    return torch.cat([x @ w.t() for w in ws], dim=1)


def _mse(a, b):
    return (a - b).pow(2).mean().item()


def test_activation_stat():
    x = _x(2)
    stat = activation_stat(x.to(torch.bfloat16))
    assert stat.dtype == torch.float32 and stat.shape == (IN,)
    ref = torch.tensor([x[:, j].to(torch.bfloat16).float().abs().mean().item() for j in range(IN)])
    torch.testing.assert_close(stat, ref, rtol=1e-5, atol=1e-6)
    assert stat[OUTLIERS].min() > 10 * stat.median()
    # leading dims are flattened
    torch.testing.assert_close(activation_stat(x.reshape(3, TOKENS // 3, IN)), activation_stat(x))


def test_search_scale_protects_salient_channels():
    x, ws = _x(3), _weights(4)
    scale, alpha, losses = search_scale(x, ws, concat_block, CFG)
    assert len(losses) == 20 and all(l > 0 for l in losses)
    assert scale.shape == (IN,) and scale.dtype == torch.float32 and (scale > 0).all()
    assert alpha > 0
    assert losses[round(alpha * 20)] == min(losses)
    # the returned scale is x_mean^alpha normalised by sqrt(max * min)
    s = activation_stat(x).pow(alpha).clamp(min=1e-4)
    torch.testing.assert_close(scale, s / (s.max() * s.min()).sqrt())
    assert scale[OUTLIERS].min() > scale.median()

    ref = concat_block(x, ws)
    rtn = _mse(concat_block(x, [fake_quantize_groups(w, CFG) for w in ws]), ref)
    awq = _mse(concat_block(x, [fake_quantize_groups(w * scale, CFG) / scale for w in ws]), ref)
    assert losses[0] == pytest.approx(rtn, rel=1e-5)  # alpha = 0 is plain round to nearest
    assert awq == pytest.approx(min(losses), rel=1e-5)
    assert awq < 0.8 * rtn, (awq, rtn)


def test_search_scale_duo_grid_adds_the_weight_term():
    x, ws = _x(3), _weights(4)
    _, _, plain = search_scale(x, ws, concat_block, CFG, n_grid=10)
    scale, alpha, losses = search_scale(x, ws, concat_block, CFG, n_grid=10, duo=True)
    assert len(losses) == 20 and losses[:10] == pytest.approx(plain, rel=1e-6)
    best = min(range(20), key=losses.__getitem__)
    assert alpha == (best % 10) / 10
    s = activation_stat(x).pow(alpha)
    if best >= 10:  # the weight term: each channel's mean |w| relative to its group's max
        s = s / (weight_stat(ws, CFG.group_size).pow(1 - alpha) + 1e-4)
    s = s.clamp(min=1e-4)
    torch.testing.assert_close(scale, s / (s.max() * s.min()).sqrt())


def test_weight_stat():
    w = torch.tensor([[1.0, -2.0, 4.0, 0.0], [2.0, 2.0, -1.0, 1.0]])
    cfg = QuantConfig(bits=4, group_size=2, symmetric=False)
    # per (row, group of 2): |w| / max|w|, then the mean over rows
    expected = torch.tensor([(0.5 + 1.0) / 2, (1.0 + 1.0) / 2, (1.0 + 1.0) / 2, (0.0 + 1.0) / 2])
    torch.testing.assert_close(weight_stat([w], cfg.group_size), expected, rtol=1e-5, atol=1e-5)


def test_search_scale_block_fn_sees_the_candidate_weights():
    # A block that only reads the first linear: the search must score through block_fn.
    x, ws = _x(5), _weights(6)
    calls = []

    def first_only(x_, ws_):
        calls.append([w.clone() for w in ws_])
        return x_ @ ws_[0].t()

    _, _, losses = search_scale(x, ws, first_only, CFG, n_grid=5)
    assert len(losses) == 5 and len(calls) == 6
    assert torch.equal(calls[0][0], ws[0])  # the unquantized reference comes first
    assert not torch.equal(calls[1][0], ws[0])
    torch.testing.assert_close(calls[1][0], fake_quantize_groups(ws[0], CFG))


def _group_err(x, w, w_hat, g):
    """Per (row, group) MSE over tokens of the group's partial output."""
    xg = x.reshape(x.shape[0], -1, g)
    d = torch.einsum("tng,ong->otn", xg, w.reshape(w.shape[0], -1, g) - w_hat.reshape(w.shape[0], -1, g))
    return d.pow(2).mean(dim=1)  # [out, n_groups]


@pytest.mark.parametrize("symmetric", [False, True])
def test_search_clip_never_increases_the_sampled_error(symmetric):
    cfg = QuantConfig(bits=4, group_size=32, symmetric=symmetric)
    g = _gen(7)
    x = _x(8)
    w = torch.randn(40, IN, generator=g)
    w[torch.rand(40, IN, generator=g) < 0.02] *= 6  # a few weight outliers make clipping worthwhile
    b = search_clip(x, w, cfg, oc_batch=16)  # 40 rows: batches of 16, 16 and 8
    assert b.shape == (40, IN // 32, 2) and b.dtype == torch.float32
    wg = w.reshape(40, -1, 32)
    org_max = wg.abs().amax(-1)
    lo_0, hi_0 = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    assert (b[..., 0] <= 0).all() and (b[..., 1] >= 0).all()
    assert (b[..., 1] <= org_max).all() and (-b[..., 0] <= org_max).all()
    assert (b[..., 1] - b[..., 0] < hi_0 - lo_0).any()  # some groups do clip

    no_clip = _group_err(x, w, fake_quantize_groups(w, cfg), 32)
    clipped = _group_err(x, w, fake_quantize_groups(apply_clip(w, b, 32), cfg), 32)
    assert (clipped <= no_clip * (1 + 1e-5)).all()
    assert clipped.sum() < no_clip.sum()
    # each group's bounds are the best of the candidates: +-ratio * max|w| for ratios 1.0 ... 0.55, and for
    # asymmetric grids also the group's own range [min, max] shrunk by each ratio
    candidates = [apply_clip(w, org_max * (1 - i / 20), 32) for i in range(10)]
    if not symmetric:
        candidates += [apply_clip(w, torch.stack([lo_0, hi_0], -1) * (1 - i / 20), 32) for i in range(10)]
    errs = torch.stack([_group_err(x, w, fake_quantize_groups(c, cfg), 32) for c in candidates])
    assert (clipped <= errs.amin(0) * (1 + 1e-4) + 1e-6).all()
    if not symmetric:  # the range-shrinking candidates are what some groups choose
        assert (errs[10:].amin(0) < errs[:10].amin(0) * (1 - 1e-3)).any()


def test_search_clip_samples_tokens_with_a_stride():
    x = _x(9).repeat(32, 1)  # 12,288 tokens -> every 3rd token is used (4096 by default)
    w = torch.randn(8, IN, generator=_gen(10))
    torch.testing.assert_close(search_clip(x, w, CFG), search_clip(x[::3], w, CFG))
    torch.testing.assert_close(search_clip(x, w, CFG, n_sample_tokens=512), search_clip(x[::24], w, CFG))
    assert torch.equal(search_clip(x, w, CFG), search_clip(x, w, CFG))  # deterministic


def test_apply_clip_clamps_per_group():
    g = _gen(11)
    w = torch.randn(6, 64, generator=g)
    t = torch.rand(6, 4, generator=g) + 0.2
    out = apply_clip(w, t, 16)
    lo = -torch.rand(6, 4, generator=g) - 0.1
    both = apply_clip(w, torch.stack([lo, t], -1), 16)
    ref, ref_both = w.clone(), w.clone()
    for r in range(6):
        for k in range(4):
            ref[r, k * 16:(k + 1) * 16] = w[r, k * 16:(k + 1) * 16].clamp(-t[r, k].item(), t[r, k].item())
            ref_both[r, k * 16:(k + 1) * 16] = w[r, k * 16:(k + 1) * 16].clamp(lo[r, k].item(), t[r, k].item())
    assert torch.equal(out, ref) and torch.equal(both, ref_both)
    assert not torch.equal(out, w) and not torch.equal(both, out)
    with pytest.raises(ValueError):
        apply_clip(w, t, 32)


def test_search_scale_shares_the_scale_across_each_kv_heads_query_heads():
    """Output-projection scales fold into v's rows, so the query heads of one kv head must get the same scale."""
    torch.manual_seed(0)
    kv, group, dim = 2, 3, 4
    x = torch.randn(64, kv * group * dim) * torch.linspace(0.1, 5, kv * group * dim)
    w = torch.randn(8, kv * group * dim)
    cfg = QuantConfig(bits=4, group_size=kv * group * dim, symmetric=False)
    s, alpha, _ = search_scale(x, [w], lambda xx, ws: xx @ ws[0].T, cfg, n_grid=10, duo=True, heads=(kv, group, dim))
    assert alpha > 0  # a scale was chosen, not the identity
    per_head = s.reshape(kv, group, dim)
    assert torch.equal(per_head, per_head[:, :1].expand(kv, group, dim))
    assert not torch.equal(per_head[0, 0], per_head[1, 0])


def test_search_scale_with_joint_clip_scores_the_clipped_weights():
    """joint_clip: each alpha is scored on the weights after their clip search, so its losses are never above the
    plain search's (the clip search keeps a group unclipped unless clipping lowers its error) and alpha = 0 is
    round to nearest with the clip applied."""
    x, ws = _x(3), _weights(4)
    _, _, plain = search_scale(x, ws, concat_block, CFG, n_grid=10)
    _, _, joint = search_scale(x, ws, concat_block, CFG, n_grid=10, clip_x=x)
    assert len(joint) == len(plain) == 10
    clipped = [fake_quantize_groups(apply_clip(w, search_clip(x, w, CFG), CFG.group_size), CFG) for w in ws]
    assert joint[0] == pytest.approx(_mse(concat_block(x, clipped), concat_block(x, ws)), rel=1e-5)
    assert min(joint) <= min(plain) * 1.05
