"""runtime.sampling: greedy, filtering against straightforward per-row references, seeds, distributions."""

from __future__ import annotations

import pytest
import torch

from runtime.sampling import SamplingError, SamplingParams, _filtered_probs, make_generator, sample

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
def run_steps(row_logits: list[torch.Tensor], params: SamplingParams, others: int, other_seed: int) -> list[int]:
    """Sample one seeded request for several steps while ``others`` different requests share its batch
    (placed before and after it); returns the request's tokens."""
    g = make_generator(params.seed, "cpu")
    other_params = [SamplingParams(temperature=1.3, top_k=5 + i, top_p=0.7, seed=other_seed + i)
                    for i in range(others)]
    other_gens = [make_generator(p.seed, "cpu") for p in other_params]
    tokens = []
    for step, logits in enumerate(row_logits):
        noise = random_logits(others, seed=1000 * other_seed + step)  # noise: [others, vocab]
        half = others // 2
        batch = torch.cat([noise[:half], logits[None, :], noise[half:]])  # batch: [others + 1, vocab]
        plist = other_params[:half] + [params] + other_params[half:]
        glist = other_gens[:half] + [g] + other_gens[half:]
        tokens.append(int(sample(batch, plist, glist)[half]))
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


# --- parameter validation -----------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, allowed", [
    ("max_tokens", 0, ">= 1"),
    ("max_tokens", 2.5, ">= 1"),
    ("temperature", -0.1, ">= 0"),
    ("temperature", float("nan"), ">= 0"),
    ("top_k", -1, ">= 0"),
    ("top_k", 1.5, ">= 0"),
    ("top_p", 1.5, "(0, 1]"),
    ("top_p", 0.0, "(0, 1]"),
    ("min_p", 1.0, "[0, 1)"),
    ("min_p", -0.5, "[0, 1)"),
    ("seed", -3, "None or an int"),
    ("seed", "42", "None or an int"),
    ("stop", "END", "list of non-empty strings"),
    ("stop", ["ok", ""], "list of non-empty strings"),
    ("stop_token_ids", [3, -1], "list of ints"),
    ("ignore_eos", "yes", "True or False"),
])
def test_invalid_params_name_the_field(field, value, allowed):
    with pytest.raises(SamplingError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert message.startswith(f"{field}: {value!r}") and allowed in message


def test_sampling_error_is_value_error_and_example_message():
    with pytest.raises(ValueError, match=r"^top_p: 1\.5 is not in \(0, 1\]$"):
        SamplingParams(top_p=1.5)


def test_valid_params_accepted():
    p = SamplingParams(max_tokens=1, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0,
                       stop=("a", "b"), stop_token_ids=(1, 2), ignore_eos=True)
    assert p.stop == ["a", "b"] and p.stop_token_ids == [1, 2]


def test_batch_size_mismatch_is_an_error():
    with pytest.raises(ValueError, match="2 rows"):
        sample(random_logits(2), [SamplingParams()], [None])
