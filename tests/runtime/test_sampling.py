"""runtime.sampling: greedy, filtering and penalties against straightforward per-row references, seeds,
distributions, logprobs."""

from __future__ import annotations

import pytest
import torch

from runtime.sampling import (INVALID_TOKEN, MAX_LOGPROBS, MAX_REPETITION_PENALTY, MAX_TEMPERATURE, MIN_TEMPERATURE,
                              MIN_REPETITION_PENALTY, SamplingError, SamplingParams, _filtered_probs, apply_penalties,
                              compute_logprobs, make_generator, sample)

VOCAB = 64


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """The tensors here are tiny: thread hand-offs would dominate (badly so on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    """Fresh random logits (never constant: argmax and filtering must have something to choose)."""
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def draw(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    """``n`` draws from one row of logits: the row repeated n times, one generator advancing through them.
    logits: [vocab] -> tokens [n]."""
    g = make_generator(seed, "cpu")
    return sample(logits[None, :].expand(n, -1), [params] * n, [g] * n)


def reference_allowed(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Per-row reference for the filters, written plainly: returns the renormalised probabilities of the
    allowed tokens (0 elsewhere). logits: [vocab] -> probs [vocab]."""
    probs = torch.softmax(logits.double() / p.temperature, dim=-1)
    order = torch.argsort(probs, descending=True).tolist()
    allowed = order[:p.top_k] if p.top_k else order
    kept_probs = probs[allowed] / probs[allowed].sum()
    cumulative, top_p_set = 0.0, []
    for token, prob in zip(allowed, kept_probs.tolist()):
        top_p_set.append(token)
        cumulative += prob
        if cumulative >= p.top_p:
            break
    best = probs[top_p_set[0]]
    final = [t for t in top_p_set if probs[t] >= p.min_p * best]
    out = torch.zeros_like(probs)
    out[final] = probs[final] / probs[final].sum()
    return out


# --- greedy -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype):
    logits = random_logits(8, seed=1).to(dtype)
    out = sample(logits, [SamplingParams()] * 8, [None] * 8)
    assert out.dtype == torch.int64 and out.shape == (8,) and out.device == logits.device
    assert torch.equal(out, logits.float().argmax(-1))


def test_top_k_one_equals_greedy():
    logits = random_logits(16, seed=2)
    params = [SamplingParams(temperature=1.5, top_k=1, seed=i) for i in range(16)]
    out = sample(logits, params, [make_generator(p.seed, "cpu") for p in params])
    assert torch.equal(out, logits.argmax(-1))


def test_mixed_batch_greedy_rows_unaffected():
    logits = random_logits(4, seed=3)
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=1), SamplingParams(),
              SamplingParams(temperature=0.8, top_p=0.5, seed=2)]
    out = sample(logits, params, [make_generator(p.seed, "cpu") for p in params])
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
    assert 0 <= int(out[1]) < VOCAB and 0 <= int(out[3]) < VOCAB


# --- seeds --------------------------------------------------------------------------------------------
OTHER_PENALTIES = [{}, {"repetition_penalty": 1.7}, {"presence_penalty": 1.0, "frequency_penalty": -0.6}]


def run_steps(row_logits: list[torch.Tensor], params: SamplingParams, others: int, other_seed: int,
              prompt: list[int] | None = None) -> list[int]:
    """Sample one seeded request for several steps while ``others`` different requests share its batch
    (placed before and after it); returns the request's tokens. With a ``prompt``, every row passes its
    token history (each its own prompt and outputs) and some of the others carry penalties too."""
    g = make_generator(params.seed, "cpu")
    penalties = [{}] if prompt is None else OTHER_PENALTIES
    other_params = [SamplingParams(temperature=1.3, top_k=5 + i, top_p=0.7, seed=other_seed + i,
                                   **penalties[i % len(penalties)]) for i in range(others)]
    other_gens = [make_generator(p.seed, "cpu") for p in other_params]
    other_prompts = torch.randint(0, VOCAB, (others, 12), generator=torch.Generator().manual_seed(other_seed))
    half = others // 2
    plist = other_params[:half] + [params] + other_params[half:]
    glist = other_gens[:half] + [g] + other_gens[half:]
    prompts = other_prompts[:half].tolist() + [prompt] + other_prompts[half:].tolist()
    outputs: list[list[int]] = [[] for _ in plist]  # in batch order
    tokens = []
    for step, logits in enumerate(row_logits):
        noise = random_logits(others, seed=1000 * other_seed + step)  # noise: [others, vocab]
        batch = torch.cat([noise[:half], logits[None, :], noise[half:]])  # batch: [others + 1, vocab]
        histories = {} if prompt is None else {"prompt_ids": prompts, "output_ids": outputs}
        out = sample(batch, plist, glist, **histories).tolist()
        for row, token in enumerate(out):
            outputs[row].append(token)
        tokens.append(out[half])
    return tokens


def test_seed_reproducible_and_independent_of_batch():
    steps = list(random_logits(30, seed=4, scale=0.5))  # flat-ish: many tokens are likely
    params = SamplingParams(temperature=1.0, top_p=0.95, min_p=0.01, seed=1234)
    alone = run_steps(steps, params, others=0, other_seed=0)
    assert alone == run_steps(steps, params, others=0, other_seed=0)
    assert alone == run_steps(steps, params, others=3, other_seed=7)
    assert alone == run_steps(steps, params, others=6, other_seed=99)
    other_seed = run_steps(steps, SamplingParams(temperature=1.0, top_p=0.95, min_p=0.01, seed=4321), 0, 0)
    assert alone != other_seed


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_p=0.95, seed=1234, repetition_penalty=1.8),
    SamplingParams(temperature=0.9, seed=99, presence_penalty=1.5, frequency_penalty=0.5),
    SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0),  # greedy
], ids=["repetition", "presence-frequency", "greedy"])
def test_penalized_request_independent_of_batch(params):
    """With penalties, a request's tokens depend on its own history only, not on its neighbours'."""
    steps = list(random_logits(30, seed=6, scale=0.7))
    prompt = [3, 5, 5, 8, 13, 21]
    alone = run_steps(steps, params, others=0, other_seed=0, prompt=prompt)
    assert alone == run_steps(steps, params, others=3, other_seed=7, prompt=prompt)
    assert alone == run_steps(steps, params, others=6, other_seed=99, prompt=prompt)
    unpenalized = SamplingParams(temperature=params.temperature, top_p=params.top_p, seed=params.seed)
    assert alone != run_steps(steps, unpenalized, others=0, other_seed=0, prompt=prompt)


def test_unseeded_rows_use_global_rng():
    logits = random_logits(1, seed=5, scale=0.1)[0]
    torch.manual_seed(0)
    a = sample(logits[None].expand(50, -1), [SamplingParams(temperature=1.0)] * 50, [None] * 50)
    torch.manual_seed(0)
    b = sample(logits[None].expand(50, -1), [SamplingParams(temperature=1.0)] * 50, [None] * 50)
    assert torch.equal(a, b) and len(set(a.tolist())) > 5


def test_make_generator():
    assert make_generator(None, "cpu") is None
    a, b = make_generator(7, "cpu"), make_generator(7, torch.device("cpu"))
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))


# --- filtering against the reference ------------------------------------------------------------------
FILTER_CASES = [
    SamplingParams(temperature=1.0, top_p=0.5),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=2.0, top_p=0.3),
    SamplingParams(temperature=1.0, top_p=1e-6),  # only the top token
    SamplingParams(temperature=1.0, top_k=7),
    SamplingParams(temperature=1.2, top_k=10, top_p=0.6),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.8, min_p=0.1),
]


@pytest.mark.parametrize("params", FILTER_CASES, ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_filtered_tokens_lie_in_reference_set(params):
    n = 1500
    for seed in range(2):
        logits = random_logits(1, seed=10 + seed)[0]
        ref = reference_allowed(logits, params)  # ref: [vocab]
        allowed = set(torch.nonzero(ref).flatten().tolist())
        assert len(allowed) < VOCAB  # the filter really removes something
        tokens = draw(logits, params, n, seed=seed).tolist()
        assert set(tokens) <= allowed
        # ...and nothing allowed is masked out: every token with >= 2% reference mass shows up
        assert {t for t in allowed if ref[t] >= 0.02} <= set(tokens)


def test_batched_filters_match_per_row_reference():
    """Rows with different k / p / min-p in one batch: each row's draws lie in its own reference set."""
    logits = random_logits(len(FILTER_CASES), seed=20)  # logits: [rows, vocab]
    gens = [make_generator(i, "cpu") for i in range(len(FILTER_CASES))]
    seen: list[set[int]] = [set() for _ in FILTER_CASES]
    for _ in range(150):
        for row, token in enumerate(sample(logits, FILTER_CASES, gens).tolist()):
            seen[row].add(token)
    for row, params in enumerate(FILTER_CASES):
        allowed = set(torch.nonzero(reference_allowed(logits[row], params)).flatten().tolist())
        assert seen[row] <= allowed, f"row {row}: {seen[row] - allowed} outside the allowed set"


@pytest.mark.parametrize("params", FILTER_CASES, ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_filtered_probabilities_equal_reference(params):
    logits = random_logits(3, seed=40)  # logits: [3, vocab]
    ours = _filtered_probs(logits, [params] * 3)  # ours: [3, vocab]
    for row in range(3):
        torch.testing.assert_close(ours[row], reference_allowed(logits[row], params).float(),
                                   atol=1e-6, rtol=1e-5)


def test_top_p_one_never_drops_tail_tokens():
    """With one dominant token, the fp32 cumulative sum reaches 1.0 before the tail; top_p=1 keeps it all."""
    logits = torch.zeros(1, VOCAB)
    logits[0, 0] = 25.0  # the other tokens have ~1e-11 probability each
    probs = _filtered_probs(logits, [SamplingParams(temperature=1.0, top_k=VOCAB, top_p=1.0)])
    assert bool((probs > 0).all())


def test_top_p_keeps_top_token_even_if_it_alone_exceeds_p():
    logits = torch.full((VOCAB,), -5.0)
    logits[17] = 5.0  # ~99% of the mass
    assert set(draw(logits, SamplingParams(temperature=1.0, top_p=0.5), 200).tolist()) == {17}


# --- penalties ----------------------------------------------------------------------------------------
def reference_penalties(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Per-row reference for the penalties, written plainly (in double). logits: [vocab] -> [vocab]."""
    out = logits.double().tolist()
    for token in set(prompt) | set(output):
        out[token] = out[token] / p.repetition_penalty if out[token] > 0 else out[token] * p.repetition_penalty
    for token in set(output):
        out[token] -= p.presence_penalty + p.frequency_penalty * output.count(token)
    return torch.tensor(out, dtype=torch.float64)


PENALTY_CASES = [
    SamplingParams(repetition_penalty=1.6),
    SamplingParams(repetition_penalty=0.7),  # < 1 favours repeats
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=0.8),
    SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0),
    SamplingParams(temperature=0.8, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=-0.4),
]


def random_history(length: int, seed: int, high: int = 20) -> list[int]:
    """Ids from a small range, so that tokens repeat (and frequency counts exceed 1)."""
    return torch.randint(0, high, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_penalties_match_per_row_reference():
    rows = len(PENALTY_CASES)
    logits = random_logits(rows, seed=50)  # logits: [rows, vocab]
    prompts = [random_history(3 + 4 * i, seed=i) for i in range(rows)]
    outputs = [random_history(5 * i, seed=100 + i) for i in range(rows)]  # row 0: no output yet
    assert any(len(set(o)) < len(o) for o in outputs)  # duplicates are exercised
    before = logits.clone()
    ours = apply_penalties(logits, PENALTY_CASES, prompts, outputs)
    assert ours.dtype == torch.float32 and torch.equal(logits, before)  # the input is left alone
    for row, params in enumerate(PENALTY_CASES):
        ref = reference_penalties(logits[row], params, prompts[row], outputs[row])
        torch.testing.assert_close(ours[row].double(), ref, atol=1e-5, rtol=1e-6)
        assert not torch.equal(ours[row], logits[row]), f"row {row}: the penalty changed nothing"


def test_presence_and_frequency_ignore_the_prompt():
    logits = random_logits(1, seed=51)
    params = [SamplingParams(presence_penalty=1.0, frequency_penalty=1.0)]
    out = apply_penalties(logits, params, [[4, 4, 9]], [[]])
    assert torch.equal(out, logits)
    out = apply_penalties(logits, params, [[4, 4, 9]], [[9, 9]])
    assert float(out[0, 9]) == pytest.approx(float(logits[0, 9]) - 3.0, abs=1e-6)  # 1 presence + 2 frequency
    assert out[0, 4] == logits[0, 4]


def test_rows_without_penalties_are_bit_identical():
    params = [SamplingParams(), SamplingParams(repetition_penalty=1.5), SamplingParams(temperature=0.7, top_k=3),
              SamplingParams(frequency_penalty=0.3), SamplingParams(presence_penalty=0.0)]
    logits = random_logits(len(params), seed=52).to(torch.bfloat16)
    prompts = [random_history(8, seed=i) for i in range(len(params))]
    outputs = [random_history(6, seed=10 + i) for i in range(len(params))]
    out = apply_penalties(logits, params, prompts, outputs)
    for row in (0, 2, 4):
        assert torch.equal(out[row], logits[row].float())
    for row in (1, 3):
        assert not torch.equal(out[row], logits[row].float())


def test_no_penalties_returns_the_logits_without_work():
    logits = random_logits(3, seed=53)
    assert apply_penalties(logits, [SamplingParams()] * 3, [[1]] * 3, [[2]] * 3) is logits


@pytest.mark.parametrize("params", [
    SamplingParams(repetition_penalty=10.0),
    SamplingParams(presence_penalty=2.0, frequency_penalty=2.0),
    SamplingParams(temperature=1.0, top_k=1, seed=0, repetition_penalty=10.0),  # penalties come before filters
], ids=["greedy-repetition", "greedy-presence-frequency", "top-k-1-repetition"])
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["positive", "negative"])
def test_penalty_moves_the_argmax(params, sign):
    """The top tokens have been generated: the penalty must hand the choice to a token that has not."""
    logits = random_logits(1, seed=54)[0].abs() * sign + 0.1 * sign  # all logits > 0, or all < 0
    top = logits.topk(2).indices.tolist()  # the two most likely tokens, generated (twice and once)
    output = [top[0], top[0], top[1]]
    expected = int(reference_penalties(logits, params, [], output).argmax())
    assert expected not in top
    out = sample(logits[None], [params], [make_generator(params.seed, "cpu")], [[]], [output])
    assert int(out[0]) == expected


@pytest.mark.parametrize("given, missing", [({}, "prompt_ids and output_ids"),
                                            ({"prompt_ids": [[1]]}, "pass output_ids"),
                                            ({"output_ids": [[1]]}, "pass prompt_ids")])
def test_penalties_need_histories(given, missing):
    params = [SamplingParams(), SamplingParams(presence_penalty=0.5)]
    given = {k: v * 2 for k, v in given.items()}
    with pytest.raises(ValueError, match=rf"rows \[1\] have penalties.*{missing}$"):
        sample(random_logits(2, seed=55), params, [None, None], **given)


def test_histories_must_match_the_batch():
    with pytest.raises(ValueError, match="2 rows of logits but 2 params, 1 prompts and 2 outputs"):
        apply_penalties(random_logits(2), [SamplingParams(repetition_penalty=1.2)] * 2, [[1]], [[1], [2]])


# --- logprobs -----------------------------------------------------------------------------------------
def test_logprobs_match_log_softmax_reference():
    num_top = [3, None, 0, MAX_LOGPROBS, 1, None]
    logits = random_logits(len(num_top), seed=60)  # logits: [rows, vocab]
    tokens = torch.randint(0, VOCAB, (len(num_top),), generator=torch.Generator().manual_seed(61))
    ours = compute_logprobs(logits, tokens, num_top)
    assert len(ours) == len(num_top)
    for row, n in enumerate(num_top):
        if n is None:
            assert ours[row] is None
            continue
        ref = torch.log_softmax(logits[row].double(), dim=-1)  # ref: [vocab]
        entry = ours[row]
        assert entry.token_id == int(tokens[row])
        assert abs(entry.logprob - float(ref[tokens[row]])) < 1e-5
        assert len(entry.top) == n
        ids = [t for t, _ in entry.top]
        assert ids == torch.argsort(ref, descending=True)[:n].tolist()  # most likely first
        for token, logprob in entry.top:
            assert isinstance(token, int) and abs(logprob - float(ref[token])) < 1e-5


def test_logprobs_are_of_the_raw_logits_in_fp32():
    logits = random_logits(2, seed=62).to(torch.float16)
    tokens = torch.tensor([5, 9])
    ours = compute_logprobs(logits, tokens, [2, 2])
    ref = torch.log_softmax(logits.float(), dim=-1)
    for row in range(2):
        assert ours[row].logprob == pytest.approx(float(ref[row, tokens[row]]), abs=1e-6)
        assert ours[row].top[0] == (int(ref[row].argmax()), pytest.approx(float(ref[row].max()), abs=1e-6))


def test_logprobs_none_for_every_row():
    assert compute_logprobs(random_logits(3), torch.tensor([0, 1, 2]), [None] * 3) == [None, None, None]


# --- distribution -------------------------------------------------------------------------------------
def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of observed ``counts`` against expected ``probs`` (both [vocab])."""
    expected = probs.double() * counts.sum()
    return float(((counts.double() - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_empirical_distribution_matches_softmax(temperature):
    vocab, n = 10, 8000
    logits = random_logits(1, vocab=vocab, seed=30, scale=1.0)[0]
    tokens = draw(logits, SamplingParams(temperature=temperature), n, seed=3)
    counts = torch.bincount(tokens, minlength=vocab)
    expected = torch.softmax(logits / temperature, dim=-1)
    # 9 degrees of freedom: P(chi2 > 27.9) = 0.001. Seeded, so not flaky; a wrong temperature is far off.
    assert chi_square(counts, expected) < 27.9
    wrong = torch.softmax(logits / (temperature * 1.3), dim=-1)
    assert chi_square(counts, wrong) > 60


def test_empirical_distribution_after_filters_matches_reference():
    n = 8000
    params = SamplingParams(temperature=0.8, top_k=12, top_p=0.85, min_p=0.05)
    logits = random_logits(1, seed=31, scale=1.0)[0]
    ref = reference_allowed(logits, params)
    support = ref > 0
    counts = torch.bincount(draw(logits, params, n, seed=5), minlength=VOCAB)
    assert counts[~support].sum() == 0
    dof = int(support.sum()) - 1
    assert 3 <= dof <= 11
    assert chi_square(counts[support], ref[support]) < 35.0  # above P=0.001 critical values for dof <= 11


def test_unseeded_rows_drawn_together_follow_the_filtered_distribution_beside_seeded_and_greedy_rows():
    # unseeded rows share one multinomial over the batch; seeded rows keep their own draws, greedy their argmax
    n = 6000
    params = SamplingParams(temperature=0.8, top_k=12, top_p=0.85, min_p=0.05)
    seeded = SamplingParams(temperature=1.0, seed=9)
    logits = random_logits(1, seed=31, scale=1.0)[0]
    other = random_logits(2, seed=32, scale=1.0)
    rows = torch.cat([other[:1], logits[None].expand(n, -1), other[1:]])  # [seeded, n unseeded, greedy]
    plist = [seeded] + [params] * n + [SamplingParams()]
    torch.manual_seed(4)
    out = sample(rows, plist, [make_generator(9, "cpu")] + [None] * (n + 1))
    alone = sample(other[:1], [seeded], [make_generator(9, "cpu")])
    assert out[0] == alone[0]
    assert out[-1] == torch.argmax(other[1])
    ref = reference_allowed(logits, params)
    support = ref > 0
    counts = torch.bincount(out[1:-1], minlength=VOCAB)
    assert counts[~support].sum() == 0
    assert chi_square(counts[support], ref[support]) < 35.0


# --- parameter validation -----------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, allowed", [
    ("max_tokens", 0, ">= 1"),
    ("max_tokens", 2.5, ">= 1"),
    ("temperature", -0.1, "in [0, 100]"),
    ("temperature", float("nan"), "in [0, 100]"),
    ("temperature", 1e300, "in [0, 100]"),
    ("top_k", -1, ">= 0"),
    ("top_k", 1.5, ">= 0"),
    ("top_p", 1.5, "(0, 1]"),
    ("top_p", 0.0, "(0, 1]"),
    ("min_p", 1.0, "[0, 1)"),
    ("min_p", -0.5, "[0, 1)"),
    ("seed", -3, "None or an int"),
    ("seed", "42", "None or an int"),
    ("stop", "END", "list of at most 64 strings of 1 to 1024 characters"),
    ("stop", ["ok", ""], "list of at most 64 strings of 1 to 1024 characters"),
    ("stop", [f"s{i}" for i in range(65)], "list of at most 64 strings"),  # each is checked at every step
    ("stop", ["s" * 1025], "strings of 1 to 1024 characters"),
    ("stop_token_ids", [3, -1], "list of at most 1024 ints >= 0"),
    ("stop_token_ids", list(range(1025)), "list of at most 1024 ints"),
    ("ignore_eos", "yes", "True or False"),
    ("repetition_penalty", 0.0, "in [0.01, 100]"),
    ("repetition_penalty", -1.2, "in [0.01, 100]"),
    ("repetition_penalty", float("inf"), "in [0.01, 100]"),
    ("repetition_penalty", 1e-38, "in [0.01, 100]"),
    ("repetition_penalty", 1e-300, "in [0.01, 100]"),
    ("repetition_penalty", 100.5, "in [0.01, 100]"),
    ("presence_penalty", 2.5, "in [-2, 2]"),
    ("presence_penalty", -2.01, "in [-2, 2]"),
    ("presence_penalty", "1", "in [-2, 2]"),
    ("frequency_penalty", 3, "in [-2, 2]"),
    ("frequency_penalty", float("nan"), "in [-2, 2]"),
    ("logprobs", -1, "None or an int in [0, 20]"),
    ("logprobs", MAX_LOGPROBS + 1, "None or an int in [0, 20]"),
    ("logprobs", 2.0, "None or an int in [0, 20]"),
    ("logprobs", True, "None or an int in [0, 20]"),
    ("logit_bias", {"abc": 1.0}, "token ids (ints >= 0, or their decimal strings)"),
    ("logit_bias", {-3: 1.0}, "token ids (ints >= 0"),
    ("logit_bias", {"5": 101}, "numbers in [-100, 100]"),
    ("logit_bias", {5: float("nan")}, "numbers in [-100, 100]"),
    ("logit_bias", {5: "1"}, "numbers in [-100, 100]"),
    ("logit_bias", {i: 1.0 for i in range(301)}, "a map of at most 300 token ids"),
    ("logit_bias", [5, 1.0], "None or a map"),
    ("min_tokens", -1, "an int in [0, max_tokens]"),
    ("min_tokens", 2.0, "an int in [0, max_tokens]"),
    ("min_tokens", 65, "an int in [0, max_tokens] (max_tokens is 64)"),
])
def test_invalid_params_name_the_field(field, value, allowed):
    with pytest.raises(SamplingError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert message.startswith(f"{field}: {repr(value)[:150]}") and allowed in message
    assert len(message) < 500  # a long value is quoted cut short


def test_sampling_error_is_value_error_and_example_message():
    with pytest.raises(ValueError, match=r"^top_p: 1\.5 is not in \(0, 1\]; "):
        SamplingParams(top_p=1.5)


@pytest.mark.parametrize("field, meaning", [("temperature", "below 1e-05 decode greedily"),
                                            ("top_p", "the most likely token is always kept"),
                                            ("min_p", "0 is off"), ("repetition_penalty", "1 is off")])
def test_range_errors_say_what_the_smallest_values_mean(field, meaning):
    with pytest.raises(SamplingError, match=meaning):
        SamplingParams(**{field: -1.0})


def test_valid_params_accepted():
    p = SamplingParams(max_tokens=1, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0,
                       stop=("a", "b"), stop_token_ids=(1, 2), ignore_eos=True)
    assert p.stop == ["a", "b"] and p.stop_token_ids == [1, 2]
    assert not p.has_penalties and p.logprobs is None


@pytest.mark.parametrize("kwargs", [{"repetition_penalty": MIN_REPETITION_PENALTY},
                                    {"repetition_penalty": MAX_REPETITION_PENALTY}, {"presence_penalty": -2},
                                    {"frequency_penalty": 2.0}])
def test_boundary_penalties_accepted(kwargs):
    assert SamplingParams(**kwargs).has_penalties


@pytest.mark.parametrize("logprobs", [0, MAX_LOGPROBS])
def test_boundary_logprobs_accepted(logprobs):
    assert SamplingParams(logprobs=logprobs).logprobs == logprobs


def test_batch_size_mismatch_is_an_error():
    with pytest.raises(ValueError, match="2 rows"):
        sample(random_logits(2), [SamplingParams()], [None])


# --- numerical safety: any accepted value samples a real token; a broken row fails alone -------------------
EXTREME_CASES = [
    SamplingParams(temperature=1.0, repetition_penalty=MIN_REPETITION_PENALTY),
    SamplingParams(temperature=MIN_TEMPERATURE, repetition_penalty=MAX_REPETITION_PENALTY),
    SamplingParams(temperature=MAX_TEMPERATURE, repetition_penalty=MIN_REPETITION_PENALTY),
    SamplingParams(temperature=1.0, top_p=1e-300),  # 0 in fp32: the top token must still be kept
    SamplingParams(temperature=1.0, top_p=5e-324, min_p=1 - 1e-16),
    SamplingParams(repetition_penalty=MIN_REPETITION_PENALTY),  # greedy
]


@pytest.mark.parametrize("scale", [1.0, 1e4, 1e30], ids=["plain", "large", "huge"])
def test_extreme_accepted_params_sample_a_real_token(scale):
    rows = len(EXTREME_CASES)
    logits = random_logits(rows, seed=60) * scale
    history = [list(range(VOCAB))] * rows  # every token has been seen: the repetition penalty applies to all
    out = sample(logits, EXTREME_CASES, [make_generator(i, "cpu") for i in range(rows)], history, [[]] * rows)
    assert ((out >= 0) & (out < VOCAB)).all(), out


def test_tiny_top_p_samples_the_top_token():
    logits = random_logits(4, seed=61)
    params = [SamplingParams(temperature=1.0, top_p=p, seed=0) for p in (1e-300, 1e-46, 5e-324, 1e-6)]
    out = sample(logits, params, [make_generator(0, "cpu")] * 4)
    assert torch.equal(out, logits.argmax(-1))


BAD_ROWS = {"nan": lambda row: row.fill_(float("nan")),
            "one-nan": lambda row: row.index_fill_(0, torch.tensor([3]), float("nan")),
            "+inf": lambda row: row.index_fill_(0, torch.tensor([5]), float("inf")),
            "all-inf": lambda row: row.fill_(float("-inf"))}


BAD_ROW_PARAMS = {"seeded": SamplingParams(temperature=0.9, seed=3), "unseeded": SamplingParams(temperature=1.0),
                  "filtered": SamplingParams(temperature=1.0, top_p=0.8, top_k=5, min_p=0.05),
                  "penalized": SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5)}


# a penalized row's logits are clamped (+inf becomes a certain token, all -inf a uniform row): only NaN stays invalid
@pytest.mark.parametrize("bad, kind", [(b, k) for b in BAD_ROWS for k in BAD_ROW_PARAMS
                                       if k != "penalized" or "nan" in b])
def test_a_row_without_a_distribution_is_invalid_alone(bad, kind):
    """A row whose logits give no distribution (NaN, +inf, nothing finite) comes back as INVALID_TOKEN, without a
    host sync or an exception; the other rows get exactly the tokens they get without it."""
    bad_params = BAD_ROW_PARAMS[kind]
    healthy = [SamplingParams(), SamplingParams(temperature=0.8, seed=11),  # seeded: their draws are exact
               SamplingParams(temperature=1.2, top_k=7, seed=13),
               SamplingParams(temperature=1.0, top_p=0.9, seed=12, repetition_penalty=1.5)]
    logits = random_logits(len(healthy) + 1, seed=62)
    BAD_ROWS[bad](logits[2])
    params = healthy[:2] + [bad_params] + healthy[2:]
    seeds = [None, 11, bad_params.seed, 13, 12]
    history = [[1, 2, 3]] * len(params)
    torch.manual_seed(5)
    out = sample(logits, params, [make_generator(s, "cpu") for s in seeds], history, history).tolist()
    keep = [0, 1, 3, 4]
    torch.manual_seed(5)
    ref = sample(logits[keep], [params[i] for i in keep], [make_generator(seeds[i], "cpu") for i in keep],
                 history[:4], history[:4]).tolist()
    assert out[2] == INVALID_TOKEN
    assert [out[i] for i in keep] == ref


@pytest.mark.parametrize("bad", ["nan", "one-nan"])
def test_a_greedy_row_with_nan_logits_is_invalid(bad):
    logits = random_logits(3, seed=63)
    BAD_ROWS[bad](logits[1])
    out = sample(logits, [SamplingParams()] * 3, [None] * 3)
    assert out.tolist() == [int(logits[0].argmax()), INVALID_TOKEN, int(logits[2].argmax())]


# --- logit bias -------------------------------------------------------------------------------------
def test_logit_bias_keys_arrive_as_strings_and_are_kept_as_ints():
    p = SamplingParams(logit_bias={"7": 2.5, 3: -1, "07": 0.5})
    assert p.logit_bias == {7: 3.0, 3: -1.0}  # "7" and "07" name one token: their biases add up
    assert SamplingParams(logit_bias={}).logit_bias is None
    # the engine process carries params as a dict (dataclasses.asdict over a pipe): the same params come back
    import dataclasses
    assert SamplingParams(**dataclasses.asdict(p)).logit_bias == p.logit_bias


def test_logit_bias_adds_to_the_given_tokens_only():
    logits = random_logits(3)
    params = [SamplingParams(), SamplingParams(logit_bias={5: 10.0, 9: -3.25}), SamplingParams(logit_bias={0: 1.0})]
    from runtime.sampling import apply_logit_bias

    out = apply_logit_bias(logits, params)
    expected = logits.clone()
    expected[1, 5] += 10.0
    expected[1, 9] -= 3.25
    expected[2, 0] += 1.0
    assert torch.equal(out, expected)
    assert torch.equal(out[0], logits[0])  # a row without a bias is bit-identical
    assert not torch.equal(logits, out)  # the input (the raw logits logprobs report) is left as it was


def test_logit_bias_moves_the_greedy_choice_and_excludes_tokens():
    logits = random_logits(2, seed=3)
    top = int(logits[0].argmax())
    low = int(logits[0].argmin())
    tokens = sample(logits, [SamplingParams(logit_bias={low: 100.0}), SamplingParams(logit_bias={top: -100.0})],
                    [None, None])
    assert int(tokens[0]) == low  # +100 lifts the least likely token over a spread of a few units
    row1 = logits[1].clone()
    row1[top] -= 100.0
    assert int(tokens[1]) == int(row1.argmax())  # each row its own bias
    excluded = sample(logits[:1], [SamplingParams(logit_bias={top: -100.0})], [None])
    assert int(excluded[0]) == int(logits[0].topk(2).indices[1])


def test_logit_bias_shapes_the_sampled_distribution():
    logits = random_logits(1, seed=5)[0]
    bias = {1: 2.0, 2: -2.0}
    p = SamplingParams(temperature=1.0, logit_bias=bias, seed=0)
    counts = torch.bincount(draw(logits, p, 20000), minlength=VOCAB).double() / 20000
    biased = logits.clone()
    for t, b in bias.items():
        biased[t] += b
    expected = torch.softmax(biased.double(), dim=-1)
    assert (counts - expected).abs().max() < 0.02


def test_logit_bias_past_the_vocabulary_is_an_error_not_an_index_fault():
    from runtime.sampling import apply_logit_bias

    with pytest.raises(ValueError, match="token id 64 is outside the logits' vocabulary of 64"):
        apply_logit_bias(random_logits(1), [SamplingParams(logit_bias={64: 1.0})])
    from runtime.engine import RequestError, check_vocab_params

    with pytest.raises(RequestError, match=r"^logit_bias: token id 64 is outside this model's vocabulary; ids must "
                                           r"be in \[0, 64\)"):
        check_vocab_params(SamplingParams(logit_bias={3: 1.0, 64: 1.0}), 64)
    check_vocab_params(SamplingParams(logit_bias={63: 1.0}), 64)


# --- banned tokens (min_tokens) -------------------------------------------------------------------------------
def test_banned_tokens_are_never_chosen_and_other_rows_are_untouched():
    from runtime.sampling import ban_tokens

    logits = random_logits(3, seed=11)
    top = [int(t) for t in logits.argmax(-1)]
    out = ban_tokens(logits, [[top[0], 10**6], None, []])  # an id past the vocabulary is skipped
    assert out[0, top[0]] == float("-inf") and torch.isfinite(out[0]).sum() == VOCAB - 1
    assert torch.equal(out[1:], logits[1:]) and not torch.equal(out, logits)
    greedy = sample(logits, [SamplingParams()] * 3, [None] * 3, banned=[[top[0]], None, [top[2]]])
    second = [int(logits[i].topk(2).indices[1]) for i in range(3)]
    assert greedy.tolist() == [second[0], top[1], second[2]]
    g = make_generator(3, "cpu")
    many = sample(logits[:1].expand(2000, -1), [SamplingParams(temperature=2.0)] * 2000, [g] * 2000,
                  banned=[[top[0], second[0]]] * 2000)
    assert not set(many.tolist()) & {top[0], second[0]}
    with pytest.raises(ValueError, match="3 rows of logits but 2 lists"):
        ban_tokens(logits, [None, None])
