"""Quality gates: metrics of a candidate (e.g. quantized) model against a baseline, and pass/fail.

Models are plain callables, so this module knows nothing about artifacts or Hugging Face:

* ``LogitsFn``: token ids -> logits ``[len(ids), vocab]`` (fp32) of a causal LM; row ``i`` predicts
  token ``i + 1``.
* ``GreedyFn``: prompt ids, ``n`` -> the ``n`` greedy continuation token ids.

Metrics (all computed in fp32 from ``log_softmax``, accumulated in fp64; nothing takes ``exp`` of raw
logits, so large logits neither overflow nor lose the distribution):

``kl`` (``<= max_kl``, nats)
    For every scored position ``KL(P_base || P_cand) = sum_v p_b(v) * (log p_b(v) - log p_c(v))``,
    averaged over all positions of all windows. A window of ``L`` tokens scores its first ``L - 1``
    rows (each predicts a token that is in the window), so ``num_positions = sum(len(w) - 1)``.
    ``GateReport.per_window`` holds the mean KL of each window, for hot-spot reports.
``top1_agreement`` (``>= min_top1_agreement``)
    Fraction of scored positions where the two models' argmax tokens agree.
``ppl_ratio`` (``<= max_ppl_ratio``)
    ``exp(mean NLL_cand) / exp(mean NLL_base)`` of the actual next tokens over the same positions
    (computed as ``exp(mean NLL_cand - mean NLL_base)``).
``greedy_agreement`` (``>= min_greedy_agreement``; needs both ``GreedyFn``)
    Per prompt, each model generates ``N = min_greedy_match_tokens`` tokens; a prompt agrees when the
    ``N`` tokens are identical. The value is the fraction of prompts that agree exactly; the detail gives
    the mean common-prefix length and the prompts that differ.
``greedy_topk_agreement`` (reported, not gated: status ``info``)
    The same prompts, also counting a prompt whose first differing token is, for each model, in the other
    model's top-``greedy_top_k`` there (logits on prompt + common prefix): the models diverged on a
    near-tie. It reads how the divergences happened; it never passes a build the exact count fails.
``kl_vs_rtn`` (``<= max_kl_vs_rtn``; needs the round-to-nearest model's ``LogitsFn``)
    The candidate's mean KL over that of plain round-to-nearest of the same scheme (bits, group size,
    symmetry; FP8 granularity; W8A8 INT8 without smoothing), rebuilt by the caller from the baseline, on the
    same positions. One quantity, two readings by the ceiling:

    * below 1, "must beat rounding": a calibrated 4-bit method (GPTQ, AWQ) no better than rounding fails. On the
      bundled model (retrained in session 26; its recipes at g128) GPTQ scores 0.51 and AWQ 0.81 (the first bundled
      model at g64: 0.18 and 0.62 in session 25, 0.24 and 0.73 in session 8); the default ceiling is 0.9.
    * from 1, "no worse than a fresh rounding": INT8 weight-only and FP8 builds *are* that rounding, so a sound
      one scores exactly 1.000 (both trained fixtures, every granularity; no seed enters); SmoothQuant's smoothed
      build scores 0.72 (bundled) and 0.40-0.43 (pydoc-qwen3) over calibration seeds 0-2, 1.000 unsmoothed.
      Other sound rounding conventions of the same schemes (INT8 scale amax/127.5; scales stored in fp16/bf16)
      score 0.65-1.14 over 1,020-position subsets. One o_proj's scales x1.25 scores 1.69-1.97 there (FP8 on
      pydoc-qwen3, the mildest case; the absolute thresholds pass it), 64-85 (INT8 weight-only, pydoc-qwen3),
      3.8-4.8 (SmoothQuant, pydoc-qwen3), 8.5 and more on the bundled model. The default ceiling 1.3 (INT8
      weight-only and FP8; SmoothQuant only when the recipe sets one) sits
      between (docs/QUANTIZATION_COMPARISON.md, "Gate noise").
``needle`` (candidate rate ``>=`` baseline rate; needs both ``GreedyFn`` and a ``NeedleCheck``)
    Needle in a haystack: over ``num_trials`` seeded prompts, how often the greedy continuation contains
    the expected ids. It is relative to the baseline (a small model may not retrieve at all), so the
    metric's threshold is the baseline's rate; both rates are in the detail. A baseline that retrieves
    none makes the check one that cannot fail: it is reported as not applicable (status ``n/a``), never
    as passed.

Each metric's ``status`` is ``pass``, ``fail``, ``n/a`` (the check cannot judge this baseline) or ``info``
(reported, not gated); a report passes when no metric fails. A report whose every gated metric is
``n/a`` cannot happen: KL, top-1 agreement and the perplexity ratio always apply.

``DEFAULT_THRESHOLDS`` gives starting thresholds per quantization method; ``make_eval_set`` cuts held-out
text into scored windows and greedy prompts; ``text_needle`` builds a "secret code" needle check from a
text encoder.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Optional

import torch

LogitsFn = Callable[[list[int]], torch.Tensor]
GreedyFn = Callable[[list[int], int], list[int]]


class GateError(ValueError):
    """Inputs a gate cannot be computed from (empty eval set, vocab mismatch, stream too short, ...)."""


@dataclass
class GateThresholds:
    max_kl: float = 0.05  # mean token-level KL(baseline || candidate), nats
    min_top1_agreement: float = 0.95
    max_ppl_ratio: float = 1.05  # ppl(candidate) / ppl(baseline)
    # Greedy agreement: N tokens generated per prompt; a prompt agrees when they all match (the reported,
    # ungated top-k variant also forgives a first difference where each model's token is in the other's top-k)
    min_greedy_match_tokens: int = 16
    greedy_top_k: int = 5
    # fraction of prompts whose N tokens are identical. One near-tie flips a prompt, and how often a sound build
    # meets one depends on the model: the first bundled model (perplexity 71, repetitive) gave 7-8/8 for sound
    # builds; the retrained one (perplexity 15.7, session 26) gives 3/8 for sound FP8 and GPTQ builds, 4/8 for
    # SmoothQuant and 2/8 for AWQ g128, every first difference within the other model's top-5. 0.25 (2 of 8; 1 of 8
    # for the 4-bit methods) passes those and fails a build that loses nearly every continuation; KL, top-1 and
    # kl_vs_rtn judge the subtler faults
    min_greedy_agreement: float = 0.25
    needle: bool = True  # run the needle-in-a-haystack check when one is given
    # KL(baseline || candidate) / KL(baseline || round-to-nearest of the same scheme), when the caller gives the
    # round-to-nearest model: below 1 a calibrated method must beat plain rounding, from 1 a build must be no worse
    # than a fresh rounding (None: not checked)
    max_kl_vs_rtn: Optional[float] = None


# Starting points, to be tuned against measured results of real checkpoints: tighter for the 8-bit
# weight / activation / KV-cache methods, looser for 4-bit weight-only (gptq, awq). FP8's top-1 floor is 0.96:
# four FP8 implementations (this one, llm-compressor's, modelopt's, per-channel dynamic) agreeing within 1e-5 KL
# scored 0.977-0.978 top-1 on a held-out trained 6.8M-parameter model (issue 18), which 0.98 rejected: it judged
# the scheme, not the build; a sound FP8 build of the retrained bundled model (session 26) scores 0.9655 over
# 1,275 positions (KL 0.0029, kl_vs_rtn 1.000), which 0.97 rejected. SmoothQuant's floor is 0.95 for the same
# reason: its smoothed build of the bundled model's outlier variant scores 0.959.
# The rounding schemes get a kl_vs_rtn ceiling of 1.3: a sound build scores 1.000, other sound rounding conventions
# at most 1.14, one o_proj's scales x1.25 at least 1.69 (see the module docstring). SmoothQuant only where the recipe
# sets gates.max_kl_vs_rtn: smoothed builds scored 0.40-0.72 on the trained fixtures but 1.39 on a tiny random model
# without outliers (93 positions), where smoothing may cost a little and the build is still sound.
MAX_KL_VS_FRESH_ROUNDING = 1.3
DEFAULT_THRESHOLDS: dict[str, GateThresholds] = {
    "fp8": GateThresholds(max_kl=0.01, min_top1_agreement=0.96, max_ppl_ratio=1.01,
                          max_kl_vs_rtn=MAX_KL_VS_FRESH_ROUNDING),
    "int8_wo": GateThresholds(max_kl=0.01, min_top1_agreement=0.98, max_ppl_ratio=1.01,
                              max_kl_vs_rtn=MAX_KL_VS_FRESH_ROUNDING),
    "smoothquant": GateThresholds(max_kl=0.03, min_top1_agreement=0.95, max_ppl_ratio=1.03),
    "gptq": GateThresholds(max_kl=0.1, min_top1_agreement=0.90, max_ppl_ratio=1.10, min_greedy_agreement=0.125,
                           max_kl_vs_rtn=0.9),
    "awq": GateThresholds(max_kl=0.1, min_top1_agreement=0.90, max_ppl_ratio=1.10, min_greedy_agreement=0.125,
                          max_kl_vs_rtn=0.9),
    "kv_fp8": GateThresholds(max_kl=0.01, min_top1_agreement=0.98, max_ppl_ratio=1.01),
    "kv_int8": GateThresholds(max_kl=0.02, min_top1_agreement=0.97, max_ppl_ratio=1.02),
}


@dataclass
class EvalSet:
    """Held-out evaluation text, already tokenized."""

    windows: list[list[int]]  # each scored in full; positions = sum(len(w) - 1)
    prompts: list[list[int]]  # prompts for greedy-generation agreement

    @property
    def num_positions(self) -> int:
        return sum(max(len(w) - 1, 0) for w in self.windows)


@dataclass
class NeedleCheck:
    context_len: int
    make_prompt: Callable[[int], tuple[list[int], list[int]]]  # seed -> (prompt ids, expected continuation ids)
    num_trials: int = 4
    extra_tokens: int = 4  # generate len(expected) + extra_tokens, then look for expected anywhere in it


STATUSES = ("pass", "fail", "n/a", "info")


@dataclass
class MetricResult:
    name: str
    value: float
    threshold: float
    passed: bool  # did not fail: True for pass, n/a and info
    direction: str  # "<=" or ">=": value must be <= / >= threshold
    detail: str = ""
    status: str = ""  # one of STATUSES; empty: from ``passed``

    def __post_init__(self) -> None:
        if not self.status:
            self.status = "pass" if self.passed else "fail"
        if self.status not in STATUSES:
            raise ValueError(f"metric status {self.status!r} is not one of {', '.join(STATUSES)}")
        self.passed = self.status != "fail"


@dataclass
class GateReport:
    metrics: list[MetricResult]
    num_positions: int
    per_window: list[float] = field(default_factory=list)  # mean KL of each window, in eval-set order
    baseline_cache: Optional[dict[str, Any]] = None  # where the baseline's results came from, if cached
    eval_data: Optional[dict[str, Any]] = None  # the held-out text's path (and a warning when it is not the model's)

    @property
    def passed(self) -> bool:
        return all(m.passed for m in self.metrics)

    @property
    def failed(self) -> list[str]:
        """Names of the metrics that failed."""
        return [m.name for m in self.metrics if not m.passed]

    def metric(self, name: str) -> MetricResult:
        for m in self.metrics:
            if m.name == name:
                return m
        raise KeyError(f"no metric {name!r}; have {', '.join(m.name for m in self.metrics)}")

    def hot_spots(self, n: int = 5) -> list[tuple[int, float]]:
        """The ``n`` windows with the largest mean KL, as (window index, KL), largest first."""
        return sorted(enumerate(self.per_window), key=lambda t: -t[1])[:n]

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "failed": self.failed, "num_positions": self.num_positions,
                "metrics": [asdict(m) for m in self.metrics], "per_window_kl": list(self.per_window),
                "baseline_cache": self.baseline_cache, "eval_data": self.eval_data}

    def table(self) -> str:
        """Aligned text table for logs, with a summary line naming the failed metrics."""
        header = ("metric", "value", "", "threshold", "status", "detail")
        rows = [(m.name, f"{m.value:.6g}", m.direction if m.status != "info" else "", f"{m.threshold:.6g}"
                 if m.status != "info" else "", m.status.upper(), m.detail) for m in self.metrics]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(5)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + ("  " + r[5] if r[5] else "")
                 for r in [header, *rows]]
        lines.insert(1, "  ".join("-" * w for w in widths) + "  ------")
        verdict = "PASSED" if self.passed else f"FAILED ({', '.join(self.failed)})"
        lines.append(f"gate {verdict} over {self.num_positions} positions")
        return "\n".join(line.rstrip() for line in lines)


# ----------------------------------------------------------------------------------------- eval set


def make_eval_set(token_ids: list[int], window: int, num_positions: int = 4096, num_prompts: int = 8,
                  prompt_len: int = 32) -> EvalSet:
    """Cut a long token stream into non-overlapping windows until >= num_positions scored positions.

    The first ``ceil(num_positions / (window - 1))`` windows of ``window`` tokens are scored. Prompts are
    the first ``prompt_len`` tokens of the later windows of the stream, latest first (so with a long
    enough stream they come from windows that are not scored); when the stream holds fewer full windows
    than ``num_prompts``, further prompts start ``prompt_len``, ``2 * prompt_len``, ... tokens into the
    windows. Prompts are returned in stream order.
    """
    token_ids = [int(t) for t in token_ids]
    if window < 2:
        raise GateError(f"window must be >= 2 tokens (a window of L tokens scores L - 1 positions), got {window}")
    if num_positions < 1:
        raise GateError(f"num_positions must be >= 1, got {num_positions}")
    if num_prompts < 0 or not 1 <= prompt_len <= window:
        raise GateError(f"need num_prompts >= 0 and 1 <= prompt_len <= window ({window}); "
                        f"got num_prompts={num_prompts}, prompt_len={prompt_len}")
    n_scored = math.ceil(num_positions / (window - 1))
    needed = n_scored * window
    if len(token_ids) < needed:
        raise GateError(f"token stream too short: {num_positions} scored positions with window {window} need "
                        f"{n_scored} windows = {needed} tokens, but {len(token_ids)} tokens were given")
    n_full = len(token_ids) // window
    windows = [token_ids[i * window:(i + 1) * window] for i in range(n_scored)]

    starts: list[int] = []
    for j in range(window // prompt_len):  # offset round j, latest window first
        for w in reversed(range(n_full)):
            if len(starts) == num_prompts:
                break
            starts.append(w * window + j * prompt_len)
    if len(starts) < num_prompts:
        raise GateError(f"token stream too short for {num_prompts} prompts of {prompt_len} tokens: "
                        f"{len(token_ids)} tokens hold only {len(starts)}")
    prompts = [token_ids[s:s + prompt_len] for s in sorted(starts)]
    return EvalSet(windows=windows, prompts=prompts)


# ------------------------------------------------------------------------------------------ helpers


def _logits(fn: LogitsFn, ids: list[int], who: str, vocab: Optional[int] = None) -> torch.Tensor:
    out = fn(list(ids))
    if not isinstance(out, torch.Tensor):
        raise GateError(f"{who} logits function returned {type(out).__name__}, expected a torch.Tensor")
    if out.dim() == 3 and out.shape[0] == 1:
        out = out[0]
    if out.dim() != 2 or out.shape[0] != len(ids):
        raise GateError(f"{who} logits have shape {tuple(out.shape)}, expected [{len(ids)}, vocab] "
                        f"for {len(ids)} token ids")
    if vocab is not None and out.shape[1] != vocab:
        raise GateError(f"vocab mismatch: baseline logits have {vocab} entries per row, "
                        f"{who} logits have {out.shape[1]}")
    return out.detach().to(torch.float32)


def _greedy(fn: GreedyFn, prompt: list[int], n: int, who: str) -> list[int]:
    out = fn(list(prompt), n)
    out = [int(t) for t in (out.tolist() if isinstance(out, torch.Tensor) else out)]
    if len(out) != n:
        raise GateError(f"{who} greedy function returned {len(out)} tokens, expected {n}")
    return out


def _kl_rows(lp_b: torch.Tensor, lp_c: torch.Tensor) -> torch.Tensor:
    """Per-row KL(P_b || P_c) from log-probabilities; 0 * log 0 terms are 0."""
    p_b = lp_b.exp()
    terms = torch.where(p_b > 0, p_b * (lp_b - lp_c), torch.zeros_like(p_b))
    return terms.sum(-1)


def _contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


# ------------------------------------------------------------------------------------------ compare


def compare(baseline: LogitsFn, candidate: LogitsFn, eval_set: EvalSet, thresholds: GateThresholds,
            baseline_greedy: Optional[GreedyFn] = None, candidate_greedy: Optional[GreedyFn] = None,
            needle: Optional[NeedleCheck] = None, rtn: Optional[LogitsFn] = None) -> GateReport:
    """Score ``candidate`` against ``baseline`` on ``eval_set`` and gate it with ``thresholds``.

    KL, top-1 agreement and the perplexity ratio always run; greedy agreement runs when both greedy
    functions are given; the needle check when ``needle`` is given and ``thresholds.needle`` is set.
    """
    if not eval_set.windows:
        raise GateError("empty eval set: no windows to score")
    for i, w in enumerate(eval_set.windows):
        if len(w) < 2:
            raise GateError(f"eval set window {i} has {len(w)} token(s); a window needs >= 2 to score a position")
    if (baseline_greedy is None) != (candidate_greedy is None):
        raise GateError("greedy agreement needs both baseline_greedy and candidate_greedy (got only one)")
    has_greedy = baseline_greedy is not None
    if has_greedy and not eval_set.prompts:
        raise GateError("greedy functions were given but eval_set.prompts is empty")
    if needle is not None and thresholds.needle and not has_greedy:
        raise GateError("the needle check needs baseline_greedy and candidate_greedy")

    use_rtn = rtn is not None and thresholds.max_kl_vs_rtn is not None
    kl_sum = nll_b_sum = nll_c_sum = rtn_kl_sum = 0.0
    agree = positions = nonfinite = 0
    vocab: Optional[int] = None
    per_window: list[float] = []
    with torch.no_grad():
        for wi, w in enumerate(eval_set.windows):
            ids = [int(t) for t in w]
            lb = _logits(baseline, ids, "baseline", vocab)
            vocab = lb.shape[1]
            lc = _logits(candidate, ids, "candidate", vocab)
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise GateError(f"eval set window {wi} has token id {bad[0]} outside the vocab of {vocab}")
            lb, lc = lb[:-1], lc[:-1]  # the last row predicts past the window
            nonfinite += int((~torch.isfinite(lc)).any(-1).sum())
            lp_b, lp_c = torch.log_softmax(lb, -1), torch.log_softmax(lc, -1)
            kl = _kl_rows(lp_b, lp_c).double()
            target = torch.tensor(ids[1:], dtype=torch.long).unsqueeze(-1)
            kl_sum += float(kl.sum())
            per_window.append(float(kl.mean()))
            if use_rtn:  # round-to-nearest of the same scheme, on the same positions
                lp_r = torch.log_softmax(_logits(rtn, ids, "round-to-nearest", vocab)[:-1], -1)
                rtn_kl_sum += float(_kl_rows(lp_b, lp_r).double().sum())
            agree += int((lb.argmax(-1) == lc.argmax(-1)).sum())
            nll_b_sum -= float(lp_b.gather(-1, target).double().sum())
            nll_c_sum -= float(lp_c.gather(-1, target).double().sum())
            positions += len(ids) - 1

        mean_kl = kl_sum / positions
        top1 = agree / positions
        nll_b, nll_c = nll_b_sum / positions, nll_c_sum / positions
        ppl_ratio = math.exp(nll_c - nll_b) if math.isfinite(nll_c - nll_b) else float("nan")
        note = f"; candidate logits non-finite at {nonfinite} positions" if nonfinite else ""
        metrics = [
            _metric("kl", mean_kl, thresholds.max_kl, "<=", f"max per-window {max(per_window):.4g}{note}"),
            _metric("top1_agreement", top1, thresholds.min_top1_agreement, ">=", f"{agree}/{positions} positions"),
            _metric("ppl_ratio", ppl_ratio, thresholds.max_ppl_ratio, "<=",
                    f"ppl baseline {_exp(nll_b):.4g}, candidate {_exp(nll_c):.4g}"),
        ]
        if use_rtn:
            metrics.append(_kl_vs_rtn(mean_kl, rtn_kl_sum / positions, thresholds.max_kl_vs_rtn))
        if has_greedy:
            metrics += _greedy_agreement(baseline, candidate, baseline_greedy, candidate_greedy,
                                         eval_set.prompts, thresholds, vocab)
        if needle is not None and thresholds.needle:
            metrics.append(_needle(needle, baseline_greedy, candidate_greedy))
    return GateReport(metrics=metrics, num_positions=positions, per_window=per_window)


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return float("inf")


def _metric(name: str, value: float, threshold: float, direction: str, detail: str = "") -> MetricResult:
    ok = value <= threshold if direction == "<=" else value >= threshold  # NaN fails either way
    return MetricResult(name=name, value=float(value), threshold=float(threshold), passed=bool(ok),
                        direction=direction, detail=detail)


def _kl_vs_rtn(candidate_kl: float, rtn_kl: float, ceiling: float) -> MetricResult:
    detail = (f"KL {candidate_kl:.4g} vs {rtn_kl:.4g} of the same scheme rounded to nearest from the baseline "
              "(same positions)")
    if rtn_kl == 0:  # rounding loses nothing here: no method can beat it
        return MetricResult("kl_vs_rtn", 0.0, ceiling, True, "<=", detail + "; not applicable",
                            status="n/a")
    ratio = candidate_kl / rtn_kl  # NaN (a broken model on either side) fails
    how = f"closes {1 - ratio:.0%} of its error" if ratio <= 1 else f"{ratio:.3g}x its KL"
    want = ("a calibrated method must beat plain rounding" if ceiling < 1 else
            "must be no worse than a fresh rounding, which a build that only rounds equals: 1")
    return _metric("kl_vs_rtn", ratio, ceiling, "<=", f"{detail}: {how} ({want})")


def _greedy_agreement(baseline: LogitsFn, candidate: LogitsFn, baseline_greedy: GreedyFn,
                      candidate_greedy: GreedyFn, prompts: list[list[int]], thresholds: GateThresholds,
                      vocab: int) -> list[MetricResult]:
    """``greedy_agreement`` (exact, gated) and ``greedy_topk_agreement`` (near-ties counted, reported)."""
    n = thresholds.min_greedy_match_tokens
    if n < 1 or thresholds.greedy_top_k < 1:
        raise GateError(f"min_greedy_match_tokens and greedy_top_k must be >= 1, got {n} and {thresholds.greedy_top_k}")
    k = min(thresholds.greedy_top_k, vocab)
    exact = tolerated = 0
    prefix_lens: list[int] = []
    differ: list[int] = []
    disagree: list[int] = []
    for pi, prompt in enumerate(prompts):
        prompt = [int(t) for t in prompt]
        gb = _greedy(baseline_greedy, prompt, n, "baseline")
        gc = _greedy(candidate_greedy, prompt, n, "candidate")
        d = next((i for i in range(n) if gb[i] != gc[i]), n)
        prefix_lens.append(d)
        if d == n:
            exact += 1
            continue
        differ.append(pi)
        ctx = prompt + gb[:d]  # the next row predicts position d of the continuation
        top_b = set(_logits(baseline, ctx, "baseline", vocab)[-1].topk(k).indices.tolist())
        top_c = set(_logits(candidate, ctx, "candidate", vocab)[-1].topk(k).indices.tolist())
        if gc[d] in top_b and gb[d] in top_c:
            tolerated += 1
        else:
            disagree.append(pi)
    total = len(prompts)
    detail = f"exact {exact}/{total} prompts of {n} tokens, mean common prefix {sum(prefix_lens) / total:.2f}/{n}"
    if differ:
        detail += f", differ on prompts {differ}"
    topk_detail = f"exact {exact}/{total} + within top-{k} at the first difference {tolerated}/{total}"
    if disagree:
        topk_detail += f", outside it on prompts {disagree}"
    return [_metric("greedy_agreement", exact / total, thresholds.min_greedy_agreement, ">=", detail),
            MetricResult("greedy_topk_agreement", (exact + tolerated) / total, 0.0, True, ">=",
                         topk_detail, status="info")]


def _needle(check: NeedleCheck, baseline_greedy: GreedyFn, candidate_greedy: GreedyFn) -> MetricResult:
    if check.num_trials < 1:
        raise GateError(f"NeedleCheck.num_trials must be >= 1, got {check.num_trials}")
    hits_b = hits_c = 0
    for seed in range(check.num_trials):
        prompt, expected = check.make_prompt(seed)
        prompt, expected = [int(t) for t in prompt], [int(t) for t in expected]
        if not expected:
            raise GateError(f"needle prompt {seed} expects an empty continuation")
        n = len(expected) + check.extra_tokens
        hits_b += _contains(_greedy(baseline_greedy, prompt, n, "baseline"), expected)
        hits_c += _contains(_greedy(candidate_greedy, prompt, n, "candidate"), expected)
    t = check.num_trials
    detail = (f"retrieved: baseline {hits_b}/{t}, candidate {hits_c}/{t} "
              f"(context ~{check.context_len} tokens)")
    if hits_b == 0:  # a threshold of 0 passes every candidate: the check cannot judge this model
        return MetricResult("needle", hits_c / t, 0.0, True, ">=", detail + "; not applicable: the baseline "
                            "retrieves none, so no candidate could fail", status="n/a")
    return _metric("needle", hits_c / t, hits_b / t, ">=", detail)


# ------------------------------------------------------------------------------------------- needle

NEEDLE_QUESTION = " ... The secret code is"


def text_needle(encode: Callable[[str], list[int]], filler: str, context_len: int, num_trials: int = 4) -> NeedleCheck:
    """A needle check: ``filler`` repeated / truncated to about ``context_len`` tokens, with the sentence
    "The secret code is NNNNN." inserted at a seeded depth, ending with "... The secret code is" and
    expecting the tokens of " NNNNN".

    Trial ``s`` puts the needle in the ``s``-th of ``num_trials`` equal depth bands (jittered by the seed,
    snapped to a filler sentence boundary), so each trial probes a different depth. The pieces (filler
    sentences, " The secret code is", " NNNNN", ".", the question) are encoded separately and joined, so
    the expected ids appear verbatim in the prompt. ``encode`` should not add special tokens; a fixed
    prefix it adds (a BOS, as found by ``encode("")``) is kept once, at the start of the prompt.
    """
    special = [int(t) for t in encode("")]

    def enc(text: str) -> list[int]:
        ids = [int(t) for t in encode(text)]
        return ids[len(special):] if special and ids[:len(special)] == special else ids

    sentences = [s for s in re.split(r"(?<=[.!?])\s+", filler.strip()) if s]
    if not sentences:
        raise GateError("needle filler text is empty")
    chunks = [enc(" " + s) for s in sentences]
    if not any(chunks):
        raise GateError("needle filler text encodes to no tokens")
    question = enc(NEEDLE_QUESTION)
    lead = enc(" The secret code is")
    period = enc(".")
    probe = lead + enc(" 00000") + period
    budget = context_len - len(special) - len(probe) - len(question)
    if budget < 1:
        raise GateError(f"needle context_len {context_len} is too small: the needle and question alone take "
                        f"{len(special) + len(probe) + len(question)} tokens")

    # Filler: sentence chunks cycled until the budget, the last one truncated; remember the boundaries.
    body: list[int] = []
    bounds = [0]
    i = 0
    while len(body) < budget:
        body.extend(chunks[i % len(chunks)])
        bounds.append(min(len(body), budget))
        i += 1
    body = body[:budget]

    def make_prompt(seed: int) -> tuple[list[int], list[int]]:
        rng = random.Random(f"needle-{seed}")
        code = rng.randint(10000, 99999)
        answer = enc(f" {code}")
        band = seed % num_trials
        target = int((band + rng.random()) / num_trials * len(body))
        depth = min(bounds, key=lambda b: (abs(b - target), b))
        needle_ids = lead + answer + period
        filler_ids = body[:budget + len(probe) - len(needle_ids)]  # keep the prompt length fixed
        prompt = special + filler_ids[:depth] + needle_ids + filler_ids[depth:] + question
        return prompt, answer

    return NeedleCheck(context_len=context_len, make_prompt=make_prompt, num_trials=num_trials)


def thresholds_for(method: str, **overrides: Any) -> GateThresholds:
    """``DEFAULT_THRESHOLDS[method]`` with ``overrides`` applied; unknown methods raise GateError."""
    if method not in DEFAULT_THRESHOLDS:
        raise GateError(f"no default gate thresholds for {method!r}; known: {', '.join(DEFAULT_THRESHOLDS)}")
    return replace(DEFAULT_THRESHOLDS[method], **overrides)
