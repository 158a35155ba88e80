"""Quality gates: metrics checked against independent computations on tiny seeded synthetic LMs."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from builder.gates import (DEFAULT_THRESHOLDS, EvalSet, GateError, GateThresholds, MetricResult, compare,
                           make_eval_set, text_needle, thresholds_for)

VOCAB, DIM, WINDOW = 64, 32, 128


class TinyLM:
    """logits_i = (E[id_i] + cummean(E[ids])_i) @ W: an embedding + linear LM whose context matters."""

    def __init__(self, E: torch.Tensor, W: torch.Tensor):
        self.E, self.W = E, W

    def hidden(self, ids: list[int]) -> torch.Tensor:
        e = self.E[torch.tensor(ids, dtype=torch.long)]
        cummean = e.cumsum(0) / torch.arange(1, len(ids) + 1, dtype=e.dtype).unsqueeze(-1)
        return e + cummean

    def __call__(self, ids: list[int]) -> torch.Tensor:
        return self.hidden(ids) @ self.W

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(self(ids)[-1].argmax()))
        return ids[len(prompt):]

    def noisy(self, scale: float, seed: int = 1) -> TinyLM:
        g = torch.Generator().manual_seed(seed)
        return TinyLM(self.E, self.W + scale * self.W.std() * torch.randn(self.W.shape, generator=g))

    def sample_stream(self, num_windows: int, seed: int = 2) -> list[int]:
        """Windows sampled from the model itself (context reset per window), so ppl is meaningful."""
        g = torch.Generator().manual_seed(seed)
        out: list[int] = []
        for _ in range(num_windows):
            t = int(torch.randint(VOCAB, (1,), generator=g))
            ids, total = [t], self.E[t].clone()
            for n in range(1, WINDOW):
                logits = (self.E[t] + total / n) @ self.W
                t = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
                ids.append(t)
                total += self.E[t]
            out.extend(ids)
        return out


def tiny_lm(seed: int = 0, vocab: int = VOCAB) -> TinyLM:
    g = torch.Generator().manual_seed(seed)
    E = torch.randn(vocab, DIM, generator=g)
    W = torch.randn(DIM, vocab, generator=g) * (1.5 / math.sqrt(DIM))
    return TinyLM(E, W)


@pytest.fixture(scope="module")
def lm() -> TinyLM:
    return tiny_lm(0)


@pytest.fixture(scope="module")
def eval_set(lm) -> EvalSet:
    stream = lm.sample_stream(num_windows=36)
    es = make_eval_set(stream, window=WINDOW)
    assert es.num_positions >= 4096
    return es


def _run(base: TinyLM, cand: TinyLM, es: EvalSet, th: GateThresholds | None = None, **kw):
    return compare(base, cand, es, th or GateThresholds(), base.greedy, cand.greedy, **kw)


def test_identical_models_pass_with_exact_metrics(lm, eval_set):
    twin = TinyLM(lm.E.clone(), lm.W.clone())  # a separate but equal model
    r = _run(lm, twin, eval_set)
    assert abs(r.metric("kl").value) < 1e-6
    assert r.metric("top1_agreement").value == 1.0
    assert r.metric("ppl_ratio").value == pytest.approx(1.0, abs=1e-6)
    g = r.metric("greedy_agreement")
    assert g.value == 1.0 and "exact 8/8" in g.detail and "mean common prefix 16.00/16" in g.detail
    assert g.status == "pass" and r.metric("greedy_topk_agreement").status == "info"
    assert r.passed and r.failed == []
    assert r.num_positions == sum(len(w) - 1 for w in eval_set.windows) >= 4096
    assert len(r.per_window) == len(eval_set.windows) and max(r.per_window) < 1e-6


def test_metrics_match_independent_computation(lm, eval_set):
    cand = lm.noisy(0.1)
    r = compare(lm, cand, eval_set, GateThresholds())
    kls, agree, nll_b, nll_c, per_window = [], [], [], [], []
    for w in eval_set.windows:
        lb, lc = lm(w)[:-1].double(), cand(w)[:-1].double()
        kl = torch.distributions.kl_divergence(torch.distributions.Categorical(logits=lb),
                                               torch.distributions.Categorical(logits=lc))
        kls.extend(kl.tolist())
        per_window.append(kl.mean().item())
        agree.extend((lb.argmax(-1) == lc.argmax(-1)).tolist())
        tgt = torch.tensor(w[1:])
        nll_b.extend((-torch.log_softmax(lb, -1)[torch.arange(len(tgt)), tgt]).tolist())
        nll_c.extend((-torch.log_softmax(lc, -1)[torch.arange(len(tgt)), tgt]).tolist())
    n = len(kls)
    assert r.num_positions == n
    assert r.metric("kl").value == pytest.approx(sum(kls) / n, rel=1e-4)
    assert r.metric("kl").value > 1e-3  # the comparison is not vacuous
    assert r.metric("top1_agreement").value == pytest.approx(sum(agree) / n, abs=1e-12)
    ppl = math.exp(sum(nll_c) / n) / math.exp(sum(nll_b) / n)
    assert r.metric("ppl_ratio").value == pytest.approx(ppl, rel=1e-5)
    assert r.per_window == pytest.approx(per_window, rel=1e-4)
    assert r.hot_spots(1)[0] == (max(range(len(per_window)), key=per_window.__getitem__), pytest.approx(max(per_window), rel=1e-4))


def test_kl_is_stable_for_huge_logits(lm, eval_set):
    """A constant shift of 1000 (exp overflows fp32) leaves every distribution, hence every metric, unchanged."""
    cand = lm.noisy(0.1)
    es = EvalSet(windows=eval_set.windows[:4], prompts=[])
    ref = compare(lm, cand, es, GateThresholds())
    shifted = compare(lambda ids: lm(ids) + 1000.0, lambda ids: cand(ids) - 1000.0, es, GateThresholds())
    for name in ("kl", "top1_agreement", "ppl_ratio"):
        assert math.isfinite(shifted.metric(name).value)
        assert shifted.metric(name).value == pytest.approx(ref.metric(name).value, rel=1e-2)
    # Very peaked distributions (softmax underflows to exactly 0 in fp32): still finite and exact.
    sharp, sharp_c = (lambda ids: 60.0 * lm(ids)), (lambda ids: 60.0 * cand(ids))
    kl = compare(sharp, sharp_c, es, GateThresholds()).metric("kl").value
    ref_kl = []
    for w in es.windows:
        lp_b, lp_c = torch.log_softmax(sharp(w)[:-1].double(), -1), torch.log_softmax(sharp_c(w)[:-1].double(), -1)
        ref_kl.extend((lp_b.exp() * (lp_b - lp_c)).sum(-1).tolist())
    assert (torch.softmax(sharp_c(es.windows[0]), -1) == 0).any()  # the case is really there
    assert math.isfinite(kl) and kl == pytest.approx(sum(ref_kl) / len(ref_kl), rel=1e-3)


def test_more_noise_is_monotonically_worse_and_fails_named(lm, eval_set):
    reports = [_run(lm, lm.noisy(s), eval_set) for s in (0.02, 0.1, 0.4, 1.5)]
    kl = [r.metric("kl").value for r in reports]
    top1 = [r.metric("top1_agreement").value for r in reports]
    ppl = [r.metric("ppl_ratio").value for r in reports]
    greedy = [r.metric("greedy_agreement").value for r in reports]
    assert all(a < b for a, b in zip(kl, kl[1:])), kl
    assert all(a > b for a, b in zip(top1, top1[1:])), top1
    assert all(a < b for a, b in zip(ppl, ppl[1:])) and ppl[0] > 1.0, ppl
    assert greedy[0] >= greedy[-1] and greedy[-1] < 1.0, greedy
    assert reports[0].passed, reports[0].table()
    worst = reports[-1]
    assert not worst.passed and {"kl", "top1_agreement", "ppl_ratio"} <= set(worst.failed)
    table = worst.table()
    assert re.search(r"^kl\s+\S+\s+<=\s+0\.05\s+FAIL", table, re.M), table
    assert "gate FAILED (kl, top1_agreement, ppl_ratio" in table.splitlines()[-1]
    d = json.loads(json.dumps(worst.to_dict()))
    assert d["passed"] is False and "kl" in d["failed"] and len(d["per_window_kl"]) == len(eval_set.windows)
    assert {m["name"] for m in d["metrics"]} == {"kl", "top1_agreement", "ppl_ratio", "greedy_agreement",
                                                 "greedy_topk_agreement"}


def test_only_the_violated_threshold_fails(lm, eval_set):
    cand = lm.noisy(0.1)
    kl = compare(lm, cand, eval_set, GateThresholds()).metric("kl").value
    loose = GateThresholds(max_kl=kl * 0.9, min_top1_agreement=0.0, max_ppl_ratio=10.0)
    r = compare(lm, cand, eval_set, loose)
    assert r.failed == ["kl"]
    loose.max_kl = kl * 1.1
    assert compare(lm, cand, eval_set, loose).passed


def test_make_eval_set_windows_and_prompts():
    g = torch.Generator().manual_seed(5)
    stream = torch.randint(1000, (20000,), generator=g).tolist()
    es = make_eval_set(stream, window=256)
    assert es.num_positions >= 4096 and len(es.windows) == math.ceil(4096 / 255)
    assert all(len(w) == 256 for w in es.windows)
    assert sum(es.windows, []) == stream[:256 * len(es.windows)]  # contiguous, non-overlapping
    assert len(es.prompts) == 8 and all(len(p) == 32 for p in es.prompts)
    n_full = len(stream) // 256
    assert es.prompts == [stream[w * 256:w * 256 + 32] for w in range(n_full - 8, n_full)]  # later windows
    # Few windows: more prompts than windows still gives distinct prompts from the stream.
    few = make_eval_set(stream[:3 * 2048], window=2048)
    assert len(few.prompts) == 8 and len({tuple(p) for p in few.prompts}) == 8
    # Too short: the message says how many tokens are needed and how many were given.
    with pytest.raises(GateError, match=r"need 33 windows = 4224 tokens, but 4000 tokens were given"):
        make_eval_set(stream[:4000], window=128)
    with pytest.raises(GateError, match="window must be >= 2"):
        make_eval_set(stream, window=1)


def _bigram(table: torch.Tensor):
    """A bigram LM (logits depend on the last token only) and its greedy decoder."""
    def logits(ids):
        return table[torch.tensor(ids)]

    def greedy(prompt, n):
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(table[ids[-1]].argmax()))
        return ids[len(prompt):]
    return logits, greedy


def test_greedy_top_k_tolerance():
    """The chain s -> t1 -> t2 -> r is shared; the models differ only in row r, after 3 common tokens."""
    V = 32
    g = torch.Generator().manual_seed(11)
    base = torch.randn(V, V, generator=g)
    s, t1, t2, r, a, b, z = 3, 7, 9, 12, 20, 21, 22
    for frm, to in ((s, t1), (t1, t2), (t2, r)):
        base[frm, to] = 10.0
    base[r, a], base[r, b], base[r, z] = 10.0, 9.0, -10.0
    base[a, s] = base[b, s] = base[z, s] = 10.0  # loop back to the chain
    base[s, a] = base[s, b] = base[s, z] = -10.0  # a, b, z far from the top-k in row s (wrong-row check)
    es = EvalSet(windows=[[0, 1, 2, 3]], prompts=[[5, s], [6, s]])
    th = GateThresholds(min_greedy_match_tokens=8, greedy_top_k=5, min_greedy_agreement=1.0)

    def gate(cand_table, name="greedy_topk_agreement", **kw):
        bl, bg = _bigram(base)
        cl, cg = _bigram(cand_table)
        return compare(bl, cl, es, GateThresholds(**{**th.__dict__, **kw}), bg, cg).metric(name)

    swapped = base.clone()
    swapped[r, a], swapped[r, b] = 9.0, 10.0  # near-tie flipped: differs, but each in the other's top-5
    m = gate(swapped)
    assert m.status == "info" and m.value == 1.0, m  # reported, never gated
    assert "exact 0/2" in m.detail and "within top-5 at the first difference 2/2" in m.detail
    exact = gate(swapped, "greedy_agreement")  # the gated metric counts identical continuations only
    assert exact.value == 0.0 and exact.status == "fail" and not exact.passed
    assert "mean common prefix 3.00/8" in exact.detail and "differ on prompts [0, 1]" in exact.detail
    assert gate(swapped, greedy_top_k=1).value == 0.0  # with k=1 no differing token is within the top-k

    far = base.clone()
    far[r, z] = 20.0  # candidate picks z, ranked last by the baseline
    m = gate(far)
    assert m.value == 0.0 and "outside it on prompts [0, 1]" in m.detail

    one_sided = base.clone()
    one_sided[r, b], one_sided[r, a] = 10.0, -20.0  # b is in the baseline's top-5, a not in the candidate's
    assert gate(one_sided).value == 0.0


@pytest.mark.parametrize("starts, num_exact", [
    ((0, 2, 4, 6, 8, 10, 13, 17), 6),  # 13 and 17 reach 20 within 8 tokens
    ((0, 2, 13, 14, 15, 16, 17, 19), 2),  # six do: the build of issue 18 that the top-5 rule scored 1.0
])
def test_greedy_agreement_counts_exact_continuations_only(starts, num_exact):
    """Prompts whose continuations reach token 20 differ there on a near-tie: the gated value counts the identical
    continuations only (the top-k variant, reported beside it, is 8/8), so a 0.9 threshold fails the build."""
    V = 32
    base = torch.full((V, V), -5.0)
    for t in range(V):
        base[t, (t + 1) % V] = 10.0  # t -> t + 1
    cand = base.clone()
    cand[20, 21], cand[20, 30] = 9.0, 10.0  # from 20 the candidate takes 30 (the baseline's second choice: 9 vs 10)
    base[20, 30] = 9.0
    es = EvalSet(windows=[[0, 1, 2, 3]], prompts=[[t] for t in starts])
    bl, bg = _bigram(base)
    cl, cg = _bigram(cand)
    r = compare(bl, cl, es, GateThresholds(max_kl=10, min_top1_agreement=0, max_ppl_ratio=1e9,
                                           min_greedy_match_tokens=8, min_greedy_agreement=0.9), bg, cg)
    g, topk = r.metric("greedy_agreement"), r.metric("greedy_topk_agreement")
    assert g.value == num_exact / 8 and g.status == "fail" and r.failed == ["greedy_agreement"], r.table()
    assert f"exact {num_exact}/8 prompts of 8 tokens" in g.detail, g.detail
    assert topk.value == 1.0 and topk.status == "info"
    assert re.search(r"^greedy_topk_agreement\s+1\s+INFO", r.table(), re.M), r.table()


def test_metric_status_is_checked():
    assert MetricResult("x", 1.0, 0.0, False, ">=", status="n/a").passed  # n/a and info never fail a report
    failed = MetricResult("x", 0.0, 1.0, False, ">=")
    assert not failed.passed and failed.status == "fail"
    with pytest.raises(ValueError, match="not one of pass, fail, n/a, info"):
        MetricResult("x", 1.0, 0.0, True, ">=", status="ok")


FILLER = ("The grass is green. The sky is blue. Rivers run to the sea. Birds sing in the morning. "
          "Old roads wind through quiet hills. Bread is baked before dawn.")
SECRET = [ord(c) for c in " The secret code is "]


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]  # char-level, vocab 128


def copier(fallback):
    """Greedy fn that, on a needle prompt, copies the digits after the first "The secret code is "."""
    def greedy(prompt, n):
        for i in range(len(prompt) - len(SECRET)):
            if prompt[i:i + len(SECRET)] == SECRET and chr(prompt[i + len(SECRET)]).isdigit():
                j = i + len(SECRET)
                while j < len(prompt) and chr(prompt[j]).isdigit():
                    j += 1
                return ([ord(" ")] + prompt[i + len(SECRET):j] + [ord(".")] * n)[:n]
        return fallback(prompt, n)
    return greedy


def test_text_needle_prompts():
    check = text_needle(encode, FILLER, context_len=600, num_trials=4)
    depths = []
    for seed in range(4):
        prompt, expected = check.make_prompt(seed)
        assert check.make_prompt(seed) == (prompt, expected)  # seeded
        text = "".join(map(chr, prompt))
        m = re.fullmatch(r" \d{5}", "".join(map(chr, expected)))
        assert m, expected
        assert text.endswith(" ... The secret code is") and text.count(f"The secret code is{m.group()}.") == 1
        assert 560 <= len(prompt) <= 600
        depths.append(text.index("The secret code is") / len(text))
    assert depths == sorted(depths) and len({round(d, 2) for d in depths}) == 4, depths
    with pytest.raises(GateError, match="too small"):
        text_needle(encode, FILLER, context_len=30)


def test_text_needle_strips_bos():
    check = text_needle(lambda s: [1] + encode(s), FILLER, context_len=300)
    prompt, expected = check.make_prompt(0)
    assert prompt[0] == 1 and 1 not in prompt[1:] and 1 not in expected


def test_needle_check_is_relative_to_baseline():
    g = torch.Generator().manual_seed(3)
    model = TinyLM(torch.randn(128, DIM, generator=g), torch.randn(DIM, 128, generator=g) / math.sqrt(DIM))
    check = text_needle(encode, FILLER, context_len=400, num_trials=4)
    es = EvalSet(windows=[encode(FILLER)[:64]], prompts=[encode("Birds sing")])
    th = GateThresholds(max_kl=1.0, min_top1_agreement=0.0, max_ppl_ratio=10.0, min_greedy_match_tokens=4)
    smart, dumb = copier(model.greedy), model.greedy

    def needle(base_greedy, cand_greedy, thresholds=th):
        r = compare(model, model, es, thresholds, base_greedy, cand_greedy, needle=check)
        return r, (r.metric("needle") if thresholds.needle else None)

    r, m = needle(smart, smart)
    assert m.passed and m.value == 1.0 and "baseline 4/4, candidate 4/4" in m.detail and r.passed
    r, m = needle(smart, dumb)
    assert not m.passed and m.value == 0.0 and m.threshold == 1.0 and r.failed == ["needle"]
    assert "baseline 4/4, candidate 0/4" in m.detail
    r, m = needle(dumb, dumb)  # the baseline retrieves none: the check cannot fail, so it does not judge
    assert m.status == "n/a" and m.passed and "baseline 0/4, candidate 0/4" in m.detail and "not applicable" in m.detail
    assert r.passed and re.search(r"^needle\s+0\s+>=\s+0\s+N/A", r.table(), re.M), r.table()
    assert (r.to_dict()["metrics"][-1]["name"], r.to_dict()["metrics"][-1]["status"]) == ("needle", "n/a")  # manifest
    r, m = needle(dumb, smart)  # a candidate that retrieves every needle does not pass it either: nothing to judge
    assert m.status == "n/a" and "baseline 0/4, candidate 4/4" in m.detail, m
    r, _ = needle(smart, dumb, GateThresholds(**{**th.__dict__, "needle": False}))
    assert r.passed and "needle" not in [x.name for x in r.metrics]
    with pytest.raises(GateError, match="needs baseline_greedy and candidate_greedy"):
        compare(model, model, es, th, needle=check)


def test_input_validation(lm, eval_set):
    es = EvalSet(windows=eval_set.windows[:2], prompts=eval_set.prompts[:2])
    wide = tiny_lm(0, vocab=VOCAB + 1)
    with pytest.raises(GateError, match=rf"vocab mismatch: baseline logits have {VOCAB} .* candidate logits have {VOCAB + 1}"):
        compare(lm, wide, es, GateThresholds())
    with pytest.raises(GateError, match="empty eval set"):
        compare(lm, lm, EvalSet(windows=[], prompts=[]), GateThresholds())
    with pytest.raises(GateError, match="window 1 has 1 token"):
        compare(lm, lm, EvalSet(windows=[[1, 2, 3], [4]], prompts=[]), GateThresholds())
    with pytest.raises(GateError, match=r"expected \[3, vocab\]"):
        compare(lm, lambda ids: lm(ids)[:-1], EvalSet(windows=[[1, 2, 3]], prompts=[]), GateThresholds())
    with pytest.raises(GateError, match="outside the vocab"):
        flat = lambda ids: torch.randn(len(ids), VOCAB, generator=torch.Generator().manual_seed(len(ids)))
        compare(flat, flat, EvalSet(windows=[[1, VOCAB + 5, 3]], prompts=[]), GateThresholds())
    with pytest.raises(GateError, match="only one"):
        compare(lm, lm, es, GateThresholds(), baseline_greedy=lm.greedy)
    with pytest.raises(GateError, match="returned 3 tokens, expected 16"):
        compare(lm, lm, es, GateThresholds(), lm.greedy, lambda p, n: lm.greedy(p, 3))


def test_nan_candidate_fails_instead_of_passing(lm, eval_set):
    es = EvalSet(windows=eval_set.windows[:2], prompts=[])
    r = compare(lm, lambda ids: torch.full((len(ids), VOCAB), float("nan")), es, GateThresholds())
    assert {"kl", "ppl_ratio"} <= set(r.failed) and "non-finite" in r.metric("kl").detail


def test_default_thresholds():
    assert set(DEFAULT_THRESHOLDS) == {"fp8", "int8_wo", "smoothquant", "gptq", "awq", "kv_fp8", "kv_int8"}
    for eight in ("fp8", "int8_wo"):
        for four in ("gptq", "awq"):
            e, f = DEFAULT_THRESHOLDS[eight], DEFAULT_THRESHOLDS[four]
            assert e.max_kl < f.max_kl and e.min_top1_agreement > f.min_top1_agreement and e.max_ppl_ratio < f.max_ppl_ratio
    t = thresholds_for("awq", max_kl=0.2)
    assert t.max_kl == 0.2 and DEFAULT_THRESHOLDS["awq"].max_kl == 0.1
    with pytest.raises(GateError, match="known: fp8"):
        thresholds_for("int3")


def test_a_method_no_better_than_round_to_nearest_fails(lm, eval_set):
    """kl_vs_rtn: the candidate's KL over round-to-nearest's; RTN itself (ratio 1) fails the 0.9 ceiling, a
    candidate with a third of its noise passes; without the RTN model or the ceiling the metric is absent."""
    rtn = lm.noisy(0.3)
    th = GateThresholds(max_kl=1.0, min_top1_agreement=0.0, max_ppl_ratio=10.0, max_kl_vs_rtn=0.9)
    same = compare(lm, rtn, eval_set, th, rtn=rtn).metric("kl_vs_rtn")
    assert same.value == pytest.approx(1.0) and same.status == "fail" and "closes 0% of its error" in same.detail
    better = compare(lm, lm.noisy(0.1), eval_set, th, rtn=rtn)
    m = better.metric("kl_vs_rtn")
    assert m.status == "pass" and 0 < m.value < 0.5 and better.passed, better.table()
    assert "kl_vs_rtn" not in [x.name for x in compare(lm, rtn, eval_set, th).metrics]
    no_ceiling = GateThresholds(max_kl=1.0, min_top1_agreement=0.0, max_ppl_ratio=10.0)
    assert "kl_vs_rtn" not in [x.name for x in compare(lm, rtn, eval_set, no_ceiling, rtn=rtn).metrics]
    assert DEFAULT_THRESHOLDS["gptq"].max_kl_vs_rtn == DEFAULT_THRESHOLDS["awq"].max_kl_vs_rtn == 0.9


def test_a_build_worse_than_a_fresh_rounding_fails(lm, eval_set):
    """kl_vs_rtn with a ceiling from 1 (INT8 weight-only, FP8, SmoothQuant): a candidate that is the rounding scores
    1 and passes; one with twice its noise (about 4x its KL) fails, and the detail says which reading applies."""
    rtn = lm.noisy(0.1)
    th = GateThresholds(max_kl=1.0, min_top1_agreement=0.0, max_ppl_ratio=10.0, max_kl_vs_rtn=1.3)
    same = compare(lm, rtn, eval_set, th, rtn=rtn).metric("kl_vs_rtn")
    assert same.value == pytest.approx(1.0) and same.status == "pass" and "no worse than a fresh rounding" in same.detail
    worse = compare(lm, lm.noisy(0.2, seed=3), eval_set, th, rtn=rtn).metric("kl_vs_rtn")
    assert worse.status == "fail" and worse.value > 2 and f"{worse.value:.3g}x its KL" in worse.detail
