"""Speculative decoding (runtime.speculative, ServingEngine's verify steps): the n-gram proposer, the settings, the
exactness of verification (greedy token for token; sampled: a chi-square test of the accept / reject rule, seeded
requests reproducible), KV rollback (no leaked blocks, rejected drafts never in the prefix cache), adaptivity, the
overlapped pipeline's fallback, metrics and the serve flags. On the bundled model (it repeats itself, so n-gram drafts
get accepted) and on a scripted proposer that drafts the reference continuation with errors placed on purpose."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence

os.environ.setdefault("TRITON_INTERPRET", "1")  # the verify step through the kernels, on the CPU (see the last test)

import pytest  # noqa: E402
import torch  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from conftest import build_artifact, make_checkpoint  # noqa: E402
from test_serving import PROMPTS  # noqa: E402  (the serving tests' prompts: code, some repeating)
from runtime import Engine, SamplingParams  # noqa: E402
from runtime.block_pool import BlockPool, hash_block  # noqa: E402
from runtime.kv_manager import KVCacheManager  # noqa: E402
from runtime.metrics import ServerMetrics  # noqa: E402
from runtime.sampling import sample  # noqa: E402
from runtime.scheduler import Request, Scheduler, SchedulerConfig  # noqa: E402
from runtime.serving import ServingConfig, ServingEngine  # noqa: E402
from runtime.speculative import (  # noqa: E402
    DEFAULT_SPECULATIVE_TOKENS, MAX_SPECULATIVE_TOKENS, PROBE_INTERVAL, DraftRequest, NgramProposer, PendingDrafts,
    Proposer, SpeculationPolicy, SpeculativeConfig, SpeculativeConfigError, accept_drafts, accept_rows)

# 2-grams: these tests' short generations draft often (the defaults, 3-6 tokens, draft less and accept more)
NGRAM = {"method": "ngram", "min_ngram": 2, "max_ngram": 4}
# Upper 1% points of the chi-square distribution by degrees of freedom (a statistic above one has p < 0.01), from
# the standard table: NIST/SEMATECH e-Handbook of Statistical Methods, section 1.3.6.7.4 (scipy.stats.chi2.ppf(0.99,
# df) gives the same values).
CHI2_CRITICAL_0_01 = {3: 11.345, 4: 13.277, 5: 15.086}


@pytest.fixture(scope="module")
def engine(bundled_artifact) -> Engine:
    return Engine.load(bundled_artifact)


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory):
    """A tiny Llama of another vocabulary than the bundled model's, head_dim 32 (the kernels' smallest)."""
    root = tmp_path_factory.mktemp("tiny")
    return build_artifact(make_checkpoint(root / "ckpt", "llama", num_attention_heads=2, num_key_value_heads=1),
                          root / "art")


def _serving(engine: Engine, speculative: dict | None = None, **config) -> ServingEngine:
    return ServingEngine(engine, ServingConfig(speculative=speculative, **{"num_blocks": 64, **config}))


def _assert_no_leaks(s: ServingEngine) -> None:
    assert s.scheduler.num_unfinished == 0 and s.kv.num_requests == 0
    assert s.kv.pool.num_free == s.kv.pool.num_blocks


class ScriptedProposer(Proposer):
    """Drafts the reference continuation of each request (its prompt plus the output a non-speculative run gave),
    with the draft at index ``wrong_at(num_drafts)`` replaced by another token: the verification then must accept
    exactly the drafts before it. ``wrong_at`` None: every draft right."""

    method = "scripted"

    def __init__(self, references: list[list[int]], vocab: int, wrong_at=None) -> None:
        self.references, self.vocab, self.wrong_at = references, vocab, wrong_at

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        out = []
        for r in requests:
            ref = next(ref for ref in self.references if ref[:len(r.token_ids)] == list(r.token_ids))
            drafts = ref[len(r.token_ids):len(r.token_ids) + r.max_tokens]
            j = self.wrong_at(len(drafts)) if self.wrong_at is not None and drafts else None
            if j is not None and j < len(drafts):
                drafts[j] = (drafts[j] + 1) % self.vocab
            out.append(drafts)
        return out


class DeviceScriptedProposer(ScriptedProposer):
    """ScriptedProposer's drafts left "on the device" (``PendingDrafts``), as a draft model's chain leaves them: each
    request's drafts at scattered places of a flat tensor among junk tokens, read only when the engine resolves
    them. Counts its proposals and its reads (each proposal must be read before the next)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.num_pending = self.num_read = 0
        self._gen = torch.Generator().manual_seed(11)

    def propose_pending(self, requests: Sequence[DraftRequest]) -> PendingDrafts:
        assert self.num_read == self.num_pending, "a proposal was not resolved before the next"
        drafts = super().propose(requests)
        total = sum(map(len, drafts))
        tokens = torch.randint(0, self.vocab, (3 * total + 5,), generator=self._gen)  # junk around the drafts
        places = torch.randperm(tokens.numel(), generator=self._gen)[:total].tolist()
        sources, i = [], 0
        for d in drafts:
            sources.append(places[i:i + len(d)])
            tokens[places[i:i + len(d)]] = torch.tensor(d, dtype=tokens.dtype)
            i += len(d)
        self.num_pending += 1

        def on_read(values: list[list[int]]) -> None:
            assert values == drafts
            self.num_read += 1

        return PendingDrafts(tokens, sources, on_read)

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        raise AssertionError("the serving engine takes drafts left on the device through propose_pending")


def _record_runs(s: ServingEngine) -> list[tuple[str, int, int]]:
    """Spy on verified decodes: (request id, tokens verification emitted, tokens the request kept of them)."""
    runs: list[tuple[str, int, int]] = []
    record = s._record_verified

    def spy(request, drafts, emitted):
        before = request.num_output_tokens
        out = record(request, drafts, emitted)
        runs.append((request.request_id, len(emitted), out.num_output_tokens - before))
        return out

    s._record_verified = spy
    return runs


def _references(engine: Engine, prompts: list[list[int]], params) -> list:
    return _serving(engine).run(prompts, params)


# --- the n-gram proposer --------------------------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_earlier_occurrence():
    p = NgramProposer(min_ngram=2, max_ngram=3)
    tokens = [5, 1, 2, 3, 4, 8, 1, 2, 3, 6, 7, 1, 2, 3]  # "1 2 3" came before "4 8" and, later, before "6 7"
    assert p.propose_one(tokens, 2) == [6, 7]
    assert p.propose_one(tokens, 4) == [6, 7, 1, 2]


def test_ngram_proposes_nothing_without_a_recurring_ngram():
    assert NgramProposer(2, 3).propose_one([1, 2, 3, 4, 5, 3], 4) == []  # "5 3" never came before
    assert NgramProposer(1, 3).propose_one([1, 2, 3, 4], 4) == []  # 4 never came before
    assert NgramProposer(2, 4).propose_one([7, 7], 4) == []  # too short for an earlier occurrence of 2 tokens
    assert NgramProposer(1, 3).propose_one([7, 7], 2) == [7, 7]


def test_ngram_prefers_the_longest_match():
    tokens = [9, 2, 3, 4, 5, 7, 2, 3, 6, 9, 2, 3]  # "9 2 3" -> 4 5 7; the later "2 3" -> 6 9
    assert NgramProposer(2, 3).propose_one(tokens, 3) == [4, 5, 7]
    assert NgramProposer(2, 2).propose_one(tokens, 3) == [6, 9, 2]


def test_ngram_caps_at_k_and_continues_a_repeating_stretch():
    tokens = [1, 2, 3, 1, 2, 3]
    assert NgramProposer(2, 3).propose_one(tokens, 2) == [1, 2]
    assert NgramProposer(2, 3).propose_one(tokens, 7) == [1, 2, 3, 1, 2, 3, 1]  # read on through its own drafts
    assert NgramProposer(1, 4).propose(
        [DraftRequest("a", tokens, 3), DraftRequest("b", [4, 4, 4], 2)]) == [[1, 2, 3], [4, 4]]


def test_ngram_index_of_a_growing_token_list_finds_what_a_full_scan_finds():
    """A request's token list is indexed as it grows (n-gram end positions, per request id): every lookup equals the
    backward scan over all positions, on random sequences of small vocabularies (many repeats) and every n-gram
    range; a list replaced or shortened is indexed again, a released request's index dropped; without a request id,
    or for a tuple, the tokens are scanned."""
    import random

    rng = random.Random(0)
    for trial in range(400):
        low = rng.randint(1, 4)
        proposer = NgramProposer(low, rng.randint(low, 7))
        vocab, tokens = rng.choice([2, 3, 5, 20]), []
        for _ in range(rng.randint(1, 50)):
            tokens.append(rng.randrange(vocab))
            expected = proposer._scan(tokens) if len(tokens) > low else None
            assert proposer._match(tokens, f"r{trial}") == expected, (proposer.min_ngram, proposer.max_ngram, tokens)
            assert proposer._match(tuple(tokens), f"r{trial}") == proposer._match(tokens) == expected
    proposer = NgramProposer(2, 3)
    tokens = [1, 2, 3, 1, 2]
    assert proposer.propose([DraftRequest("r", tokens, 2)]) == [[3, 1]] and list(proposer._indexes) == ["r"]
    first = proposer._indexes["r"]
    del tokens[3:]  # shorter than what was indexed (no request's list shrinks): indexed again
    assert proposer._match(tokens, "r") is None is proposer._scan(tokens) and proposer._indexes["r"] is not first
    tokens += [5, 1, 2]
    assert proposer._match(tokens, "r") == proposer._scan(tokens) == 2
    assert proposer.propose([DraftRequest("r", list(tokens), 2)]) == [[3, 5]]  # another list: indexed again
    assert proposer.may_propose(tokens, "s") and list(proposer._indexes) == ["r", "s"]
    proposer.release("r")
    proposer.release("s")
    assert not proposer._indexes


def test_ngram_refuses_bad_sizes():
    with pytest.raises(SpeculativeConfigError, match="min_ngram <= max_ngram, got min_ngram 3 and max_ngram 2"):
        NgramProposer(3, 2)
    with pytest.raises(SpeculativeConfigError, match="max_tokens must be >= 1"):
        NgramProposer(1, 2).propose_one([1, 1], 0)


# --- settings ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("section, message", [
    ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens: 0 is not an int in \[1, 16\]"),
    ({"method": "ngram", "num_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1}, r"17 is not an int in \[1, 16\]"),
    ({"method": "ngram", "min_ngram": 7}, "min_ngram 7 is above max_ngram 6"),
    ({"method": "ngram", "max_running": 0}, "max_running: 0 is not an int >= 1"),
    ({"method": "ngram", "min_acceptance": 1.5}, r"min_acceptance: 1.5 is not a number in \[0, 1\]"),
    ({"method": "mtp"}, "'mtp' is not available .*not implemented yet.*use one of ngram, draft, eagle"),
    ({"method": "draft"}, "methods 'draft' and 'eagle' need draft_model"),
    ({"method": "eagle"}, "methods 'draft' and 'eagle' need draft_model"),
    ({"method": "ngram", "draft_model": "artifacts/draft"}, "draft_model needs one of them"),
    ({"method": "ngram", "k": 3}, "unknown speculative setting.*'k'; known: adaptive, draft_model, max_ngram"),
])
def test_bad_settings_are_refused_with_what_is_allowed(section, message):
    with pytest.raises(SpeculativeConfigError, match=message):
        SpeculativeConfig.from_dict(section)
    with pytest.raises(ValueError, match=message):  # through the serving config too
        ServingConfig(speculative=section)


def test_the_number_of_drafts_defaults_by_method(tmp_path):
    """num_speculative_tokens left out: 12 n-gram drafts (free to make), 4 from a draft model (a forward each); an
    explicit value wins; with no method there is nothing to draft. A resolved section crosses the process boundary
    as it is."""
    assert DEFAULT_SPECULATIVE_TOKENS == {"ngram": 12, "draft": 4, "eagle": 4}
    assert SpeculativeConfig(method="ngram").num_speculative_tokens == 12
    assert SpeculativeConfig(method="draft", draft_model=str(tmp_path)).num_speculative_tokens == 4
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": None}).num_speculative_tokens == 12
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=3).num_speculative_tokens == 3
    assert SpeculativeConfig().num_speculative_tokens is None
    config = ServingConfig(speculative={"method": "ngram"})
    assert ServingConfig(**dataclasses.asdict(config)).speculative.num_speculative_tokens == 12


def test_settings_from_the_environment_and_across_the_process_boundary(monkeypatch):
    assert ServingConfig().speculative is None  # the artifact's section, else off (see the recipe test)
    monkeypatch.setenv("RUNTIME_SPEC_MAX_RUNNING", "3")
    monkeypatch.setenv("RUNTIME_SPEC_MIN_ACCEPTANCE", "0.5")
    config = ServingConfig(speculative=NGRAM)
    assert (config.speculative.max_running, config.speculative.min_acceptance) == (3, 0.5)
    # the engine process rebuilds its config from dataclasses.asdict
    assert ServingConfig(**dataclasses.asdict(config)).speculative == config.speculative
    monkeypatch.setenv("RUNTIME_SPEC_MAX_RUNNING", "many")
    with pytest.raises(SpeculativeConfigError, match="RUNTIME_SPEC_MAX_RUNNING='many' is not a whole number"):
        SpeculativeConfig()
    # out of range: the variable named, not a field the user never set
    for name, value, message in (("RUNTIME_SPEC_MAX_RUNNING", "0", r"'0' is not >= 1 \(unset it for the default 8\)"),
                                 ("RUNTIME_SPEC_MIN_ACCEPTANCE", "2", r"'2' is not in \[0, 1\]"),
                                 ("RUNTIME_SPEC_MIN_GAIN", "nan", r"'nan' is not >= 0")):
        monkeypatch.delenv("RUNTIME_SPEC_MAX_RUNNING")
        monkeypatch.setenv(name, value)
        with pytest.raises(SpeculativeConfigError, match=rf"{name}={message}"):
            SpeculativeConfig()
        monkeypatch.delenv(name)
        monkeypatch.setenv("RUNTIME_SPEC_MAX_RUNNING", "3")


def test_the_recipe_section_is_the_artifacts_default(checkpoints, tmp_path):
    """runtime.speculative in the recipe is recorded in the manifest and serves as the default; an explicit
    setting (SpeculativeConfig(), a serve flag) wins; greedy tokens stay those of decoding without it. A bad
    section is refused at validation, naming the key."""
    from builder.recipe import RecipeError, validate_recipe

    path = build_artifact(checkpoints["llama"], tmp_path / "art",
                          speculative={"method": "ngram", "num_speculative_tokens": 3, "max_ngram": 3})
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["runtime"]["speculative"] == {"method": "ngram", "num_speculative_tokens": 3, "min_ngram": 3,
                                                  "max_ngram": 3, "draft_model": None}
    engine = Engine.load(path)
    served = ServingEngine(engine, ServingConfig(num_blocks=64))
    assert served.config.speculative.enabled and served.proposer is not None
    assert (served.config.speculative.num_speculative_tokens, served.config.speculative.max_ngram) == (3, 3)
    plain = ServingEngine(engine, ServingConfig(num_blocks=64, speculative=SpeculativeConfig()))
    assert plain.proposer is None
    prompt = engine.tokenizer.encode("def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    assert served.run([prompt], params)[0].token_ids == plain.run([prompt], params)[0].token_ids
    assert served.spec_num_draft_tokens > 0  # it did speculate
    base = {"name": "x", "model": {"checkpoint": str(checkpoints["llama"])}}
    # a section without num_speculative_tokens records the method's default (12 n-gram drafts) as a number
    bare = build_artifact(checkpoints["llama"], tmp_path / "bare", speculative={"method": "ngram"})
    assert json.loads((bare / "manifest.json").read_text())["runtime"]["speculative"]["num_speculative_tokens"] == 12
    served = ServingEngine(Engine.load(bare), ServingConfig(num_blocks=64))
    assert served.config.speculative.num_speculative_tokens == DEFAULT_SPECULATIVE_TOKENS["ngram"]
    for section, message in (({"method": "draft"}, "methods 'draft' and 'eagle' need draft_model"),
                             ({"method": "draft", "draft_model": str(tmp_path)}, "is not an artifact directory"),
                             ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
                             ({"method": "ngram", "min_ngram": 7}, "min_ngram 7 is above max_ngram 6"),
                             ({"methd": "ngram"}, "unknown key")):
        with pytest.raises(RecipeError, match=message):
            validate_recipe({**base, "runtime": {"speculative": section}})


def test_serve_flags_build_the_speculative_section():
    from runtime.serve import build_parser, main, speculative_config

    parser = build_parser()
    assert speculative_config(parser.parse_args(["x"])) is None  # the artifact's section, else off
    assert speculative_config(parser.parse_args(["x", "--speculative-config", '{"method": null}']))["method"] is None
    section = speculative_config(parser.parse_args(["x", "--speculative-ngram", "6"]))
    assert (section["method"], section["num_speculative_tokens"]) == ("ngram", 6)
    section = speculative_config(parser.parse_args(
        ["x", "--speculative-config", '{"method": "ngram", "max_running": 2, "min_ngram": 1}',
         "--speculative-ngram", "3"]))
    assert (section["max_running"], section["min_ngram"], section["num_speculative_tokens"]) == (2, 1, 3)
    assert speculative_config(parser.parse_args(["x", "--speculative-config", "{}"]))["method"] is None  # off
    # settings without a method would silently turn the artifact's speculation off
    with pytest.raises(SpeculativeConfigError, match=r"--speculative-config sets min_gain, num_speculative_tokens "
                                                     r"but no method: it replaces the artifact's whole speculative"):
        speculative_config(parser.parse_args(["x", "--speculative-config",
                                              '{"num_speculative_tokens": 2, "min_gain": 0}']))
    for bad in (["--speculative-ngram", "17"], ["--speculative-config", "{oops"],
                ["--speculative-config", '{"num_speculative_tokens": 2}']):
        with pytest.raises(SystemExit) as exit_info:  # a bad option: exit 2, before anything is loaded
            main(["no-such-artifact", *bad])
        assert exit_info.value.code == 2


# --- the scheduler and the KV manager ------------------------------------------------------------------------------
def _decoding(num_blocks: int, budget: int, prompts: dict[str, list[int]], max_tokens: int = 4) -> Scheduler:
    """A scheduler (tiny pool, blocks of 4) whose requests have been prefilled and sampled one token each."""
    s = Scheduler(SchedulerConfig(4, budget, 64, 8), KVCacheManager(BlockPool(num_blocks), 4))
    for rid, prompt in prompts.items():
        s.add_request(Request(rid, prompt, SamplingParams(max_tokens=max_tokens)))
    out = s.schedule()
    s.update(out, {q.request.request_id: 50 for q in out.seqs})
    return s


def test_drafts_count_in_the_token_budget_and_take_lookahead_slots():
    s = _decoding(16, budget=8, prompts={"a": [1, 2, 3], "b": [4, 5, 6]}, max_tokens=12)
    s.add_request(Request("c", [10, 11, 12, 13, 14], SamplingParams(max_tokens=4)))
    out = s.schedule({"a": [60, 61, 62, 63], "b": [70, 71, 72, 73]})
    # a: its token + 4 drafts; b: its token + the 2 drafts the budget has left; c: no budget left, waits
    assert [(q.request.request_id, q.num_context, q.num_new, q.draft_token_ids) for q in out.seqs] == [
        ("a", 3, 5, [60, 61, 62, 63]), ("b", 3, 3, [70, 71])]
    assert out.num_batched_tokens == 8 and out.num_draft_tokens == 6 and s.get("c").status.value == "waiting"
    assert all(q.samples for q in out.seqs)
    # the drafts' slots are reserved (a: positions 3..7, 2 blocks) but not committed, hence never published
    assert (s.kv.num_tokens("a"), len(s.kv.blocks("a"))) == (4, 2)
    assert (s.kv.num_tokens("b"), len(s.kv.blocks("b"))) == (4, 2)
    assert s.kv.blocks("a")[0].block_hash is not None and s.kv.blocks("a")[1].block_hash is None
    s.update(out, {})  # the serving engine records drafts itself: only the decoded token counts as computed
    assert (s.get("a").num_computed_tokens, s.get("b").num_computed_tokens) == (4, 4)
    free = s.kv.pool.num_free
    assert s.kv.free_lookahead("a") == 1 and len(s.kv.blocks("a")) == 1  # nothing accepted: the draft block back
    assert s.kv.free_lookahead("a") == 0 and s.kv.pool.num_free == free + 1


def test_drafts_are_dropped_before_anyone_is_preempted_for_them():
    s = _decoding(3, budget=16, prompts={"a": [1, 2, 3], "b": [4, 5, 6]})  # a block each, one free
    out = s.schedule({"a": [60, 61, 62, 63, 64, 65], "b": [70]})  # a's drafts would need 2 more blocks
    assert [(q.request.request_id, q.num_new, q.draft_token_ids) for q in out.seqs] == [
        ("a", 1, []), ("b", 2, [70])]
    assert not out.preempted and s.num_preemptions == 0 and s.kv.pool.num_free == 0


# --- verification --------------------------------------------------------------------------------------------------
def test_accept_drafts_keeps_the_matching_prefix_and_one_token_of_the_target():
    assert accept_drafts([4, 5, 6, 7], [4, 5, 6]) == [4, 5, 6, 7]  # all accepted, plus the bonus token
    assert accept_drafts([4, 9, 6, 7], [4, 5, 6]) == [4, 9]  # the second draft rejected: the target's token there
    assert accept_drafts([8, 5, 6, 7], [4, 5, 6]) == [8]  # later matches do not count after a rejection
    assert accept_drafts([3], []) == [3]
    with pytest.raises(ValueError, match="2 drafts need 3 target tokens, got 2"):
        accept_drafts([1, 2], [1, 2])


def _verify_batch(target: torch.Tensor, bonus: torch.Tensor, draft: int, num: int, seed: int) -> list[list[int]]:
    """``num`` independent one-draft verifications over a fixed target distribution, as a verify step runs them:
    the two rows of each (``target`` at the draft's position, ``bonus`` after it) sampled by ``sample`` at
    temperature 1, then ``accept_rows``."""
    torch.manual_seed(seed)  # unseeded rows draw from the global RNG
    logits = torch.stack([target.log(), bonus.log()]).repeat(num, 1)  # [2 * num, vocab]
    params = [SamplingParams(temperature=1.0)] * (2 * num)
    tokens = sample(logits, params, [None] * (2 * num)).tolist()
    return accept_rows(tokens, [[draft]] * num, [None] * num, [None] * (2 * num))


def _chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs))


def _histogram(tokens: list[int], vocab: int) -> list[int]:
    return [tokens.count(t) for t in range(vocab)]


def test_rejection_sampling_keeps_the_target_distribution():
    """With a one-hot draft d: the first emitted token follows p (accepted with probability p(d)); the tokens
    emitted on rejection follow p with d removed and renormalised, not p; the bonus after an accepted draft
    follows the next position's distribution. 24,000 draws, chi-square at p > 0.01 (fixed seed)."""
    p = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.20, 0.30])
    q = torch.tensor([0.30, 0.25, 0.20, 0.10, 0.10, 0.05])  # the target at the position after the draft
    vocab, draft, num = len(p), 3, 24_000
    runs = _verify_batch(p, q, draft, num, seed=0)
    first = [r[0] for r in runs]
    assert _chi_square(_histogram(first, vocab), p.tolist()) < CHI2_CRITICAL_0_01[vocab - 1]
    num_accepted = sum(len(r) == 2 for r in runs)
    sd = math.sqrt(num * 0.2 * 0.8)
    assert abs(num_accepted - num * 0.2) < 4 * sd  # accepted with probability p(d) = 0.2
    assert all((len(r) == 2) == (r[0] == draft) for r in runs)  # a rejection emits one token, never the draft
    # on rejection: the residual (p without d, renormalised) fits, p itself does not
    rejected = [r[0] for r in runs if len(r) == 1]
    others = [t for t in range(vocab) if t != draft]
    counts = [rejected.count(t) for t in others]
    residual = [p[t].item() / (1 - p[draft].item()) for t in others]
    assert _chi_square(counts, residual) < CHI2_CRITICAL_0_01[vocab - 2]
    assert _chi_square(_histogram(rejected, vocab), p.tolist()) > 10 * CHI2_CRITICAL_0_01[vocab - 1]
    bonus = [r[1] for r in runs if len(r) == 2]
    assert _chi_square(_histogram(bonus, vocab), q.tolist()) < CHI2_CRITICAL_0_01[vocab - 1]


def test_the_distribution_test_rejects_resampling_from_p_on_rejection():
    """The test above can fail: a verifier that, after rejecting d, draws again from p (instead of the residual)
    emits d too often, and the same chi-square test refuses its output."""
    p = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.20, 0.30])
    vocab, draft, num = len(p), 3, 24_000
    g = torch.Generator().manual_seed(1)
    accept = torch.rand(num, generator=g) < p[draft]
    resampled = torch.multinomial(p, num, replacement=True, generator=g)
    first = torch.where(accept, torch.full_like(resampled, draft), resampled).tolist()
    assert _chi_square(_histogram(first, vocab), p.tolist()) > 10 * CHI2_CRITICAL_0_01[vocab - 1]


def test_accept_rows_rewinds_a_seeded_generator_to_the_last_draw_kept():
    """A request keeps a + 1 of its k + 1 draws: its generator continues as after a + 1 one-token steps."""
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.0, seed=5)] * 4
    g = torch.Generator().manual_seed(5)
    states: list = [None] * 4
    tokens = sample(logits, params, [g] * 4, generator_states=states).tolist()
    drafts = [tokens[0], (tokens[1] + 1) % 10, tokens[2]]  # the second draft is wrong: two tokens kept
    assert accept_rows(tokens, [drafts], [g], states) == [[tokens[0], tokens[1]]]
    reference = torch.Generator().manual_seed(5)
    for row in range(2):  # two one-token steps
        sample(logits[row:row + 1], params[:1], [reference])
    assert torch.equal(g.get_state(), reference.get_state())
    with pytest.raises(ValueError, match="account for 3 rows, the step sampled 4"):
        accept_rows(tokens, [[1, 2]], [None], states)


# --- the serving engine: exactness ---------------------------------------------------------------------------------
def test_greedy_output_is_token_for_token_the_same(engine):
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (48, 40, 33, 17, 45)]
    params[3] = SamplingParams(max_tokens=40)  # EOS allowed
    # a logit bias (history-free: such a request speculates) applies at every verified position too
    params[2] = SamplingParams(max_tokens=33, ignore_eos=True, logit_bias={prompts[2][-1]: 3.0, prompts[2][0]: -5.0})
    plain = _serving(engine)
    want = plain.run(prompts, params)
    s = _serving(engine, NGRAM)
    runs = _record_runs(s)
    got = s.run(prompts, params)
    for g, w in zip(got, want):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
    stats = s.stats()
    # the bundled model (perplexity 15.7) repeats itself less than its predecessor did: 18 accepted here
    assert stats.spec_num_accepted_tokens > 10 and stats.spec_num_steps > 5, "speculation never paid off"
    assert stats.spec_num_verified == len(runs) and stats.spec_num_accepted_tokens == sum(n - 1 for _, n, _ in runs)
    assert stats.num_steps < plain.stats().num_steps
    # max_tokens never cuts a verified run short: a request drafts at most what its max_tokens leaves after the
    # bonus token (request 3 may stop on EOS in a run)
    assert all(kept == emitted for rid, emitted, kept in runs if not rid.endswith("-3"))
    assert {w.finish_reason for i, w in enumerate(want) if i != 3} == {"length"}
    _assert_no_leaks(s)


def test_greedy_equality_under_preemption_and_chunked_prefill(engine):
    """A pool too small for every request (preemption, recompute from the prefix cache) and a token budget that
    drafts share with prompt chunks: still the non-speculative tokens, and nothing leaks."""
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    config = dict(num_blocks=14, max_seq_len=192, max_num_batched_tokens=24, max_num_seqs=4)
    want = _serving(engine, **config).run(prompts, params)
    s = _serving(engine, NGRAM, **config)
    got = s.run(prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert s.scheduler.num_preemptions > 0 and s.stats().spec_num_accepted_tokens > 0
    _assert_no_leaks(s)


@pytest.mark.parametrize("wrong", [None, 0, 2])
def test_drafts_left_on_the_device_are_fed_and_verified(engine, wrong):
    """A proposer that leaves its drafts on the device (a draft model's chain): the verify step's draft rows are fed
    from its tensor, the drafts are read back with the sampled tokens, and the output is the non-speculative one,
    with the drafts before the wrong one accepted; under preemption and a token budget that cuts drafts short. A
    draft row fed anything but the draft (its placeholder, another request's) changes the tokens after it."""
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    config = dict(num_blocks=14, max_seq_len=192, max_num_batched_tokens=24, max_num_seqs=4)
    want = _serving(engine, **config).run(prompts, params)
    vocab = int(engine.executor.graph["meta"]["vocab_size"])
    s = _serving(engine, {"method": "ngram", "num_speculative_tokens": 4, "min_acceptance": 0.0}, **config)
    s.proposer = proposer = DeviceScriptedProposer([p + w.token_ids for p, w in zip(prompts, want)], vocab,
                                                   wrong_at=None if wrong is None else (lambda k: wrong))
    runs = _record_runs(s)
    got = s.run(prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    stats = s.stats()
    assert proposer.num_pending > 10 and proposer.num_read == proposer.num_pending
    assert stats.spec_num_draft_tokens > 50 and s.scheduler.num_preemptions > 0
    if wrong is None:  # every draft right: all accepted, whatever number the scheduler kept
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    else:  # the drafts before the wrong one (fewer where the scheduler kept fewer than wrong + 1)
        assert all(emitted - 1 <= wrong for _, emitted, _ in runs)
        assert any(emitted - 1 == wrong for _, emitted, _ in runs)
    _assert_no_leaks(s)


@pytest.mark.parametrize("stop_kind", ["string", "token"])
def test_a_stop_in_the_middle_of_an_accepted_run_ends_it_there(engine, stop_kind):
    """Drafts are the reference continuation (all accepted: runs of k + 1 tokens); a stop string or stop token first
    reached inside a run ends the output where non-speculative decoding ends it, dropping the rest of the run."""
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:3]]
    free = _references(engine, prompts, SamplingParams(max_tokens=30, ignore_eos=True))
    vocab = int(engine.executor.graph["meta"]["vocab_size"])
    params = []
    for out in free:  # a stop first reached at output position 3, in the first verified run (positions 1..5)
        if stop_kind == "token":
            t = next(t for i, t in enumerate(out.token_ids) if i >= 2 and t not in out.token_ids[:i])
            params.append(SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[t]))
        else:
            text = engine.tokenizer.decode(out.token_ids[:3])
            params.append(SamplingParams(max_tokens=30, ignore_eos=True, stop=[text[-2:]]))
    want = _references(engine, prompts, params)
    assert all(w.finish_reason == "stop" and len(w.token_ids) < 30 for w in want)
    s = _serving(engine, NGRAM)
    s.proposer = ScriptedProposer([p + o.token_ids for p, o in zip(prompts, free)], vocab)
    runs = _record_runs(s)
    got = s.run(prompts, params)
    for g, w in zip(got, want):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
    assert any(kept < emitted for _, emitted, kept in runs), "no stop fell inside an accepted run"
    _assert_no_leaks(s)


@pytest.mark.parametrize("wrong_at", [0, 1, 3], ids=["first", "second", "last"])
def test_rejected_drafts_are_rolled_back(engine, wrong_at):
    """Every verify step rejects one draft at a chosen place: the output is still the reference, every rejected
    draft's KV slot is rewritten before it is read, the blocks only rejected drafts used go back at once, and
    the prefix cache never publishes a block holding one."""
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[1:3]]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    want = _references(engine, prompts, params)
    vocab = int(engine.executor.graph["meta"]["vocab_size"])
    s = _serving(engine, {"method": "ngram", "num_speculative_tokens": 4, "min_acceptance": 0.0})
    s.proposer = ScriptedProposer([p + w.token_ids for p, w in zip(prompts, want)], vocab,
                                  wrong_at=lambda k: min(wrong_at, k - 1))
    got = s.run(prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    stats = s.stats()
    assert stats.spec_num_verified > 10 and stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    _assert_no_leaks(s)
    # the blocks the requests left in the prefix cache serve the same prompts again, without speculation
    s.proposer = None
    hits = s.kv.stats.hits
    assert [o.token_ids for o in s.run(prompts, params)] == [w.token_ids for w in want]
    assert s.kv.stats.hits > hits and s.stats().spec_num_verified == stats.spec_num_verified
    _assert_no_leaks(s)


def test_blocks_of_rejected_drafts_are_returned_mid_run(engine):
    """One request whose prompt ends just before a block boundary gets 8 drafts, all wrong: the verify step holds
    a second block for them, and after it the request holds one block again, the other back in the free pool.
    After every step: blocks held = what the committed tokens need, and the cached blocks hash the real tokens."""
    bs = 16
    prompt = engine.tokenizer.encode(PROMPTS[2])[:12]  # 12 tokens: the first decode is at position 12
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    want = _references(engine, [prompt], params)[0]
    vocab = int(engine.executor.graph["meta"]["vocab_size"])
    s = _serving(engine, {"method": "ngram", "num_speculative_tokens": 8, "min_acceptance": 0.0})
    s.proposer = ScriptedProposer([prompt + want.token_ids], vocab, wrong_at=lambda k: 0)
    held_while_verifying = []
    verify = s._verify

    def spy(sched, logits, sampling, device_drafts=None):
        held_while_verifying.append(len(s.kv.blocks("r")))
        return verify(sched, logits, sampling, device_drafts)

    s._verify = spy
    s.add_request(prompt, params, request_id="r")
    tokens = []
    while s.has_unfinished:
        for out in s.step():
            tokens += out.token_ids
        if "r" not in s.kv:
            break
        committed = s.kv.num_tokens("r")
        blocks = s.kv.blocks("r")
        assert len(blocks) == -(-committed // bs), "blocks past the committed tokens were kept"
        assert s.kv.pool.num_free == s.kv.pool.num_blocks - len(blocks)
        token_ids = s.scheduler.get("r").token_ids
        chain = [None]
        for i in range(committed // bs):  # the hashes of the full blocks of committed tokens
            chain.append(hash_block(chain[-1], token_ids[i * bs:(i + 1) * bs], s.kv.hash_extra))
        for i, block in enumerate(blocks):
            if block.block_hash is not None:
                assert i < committed // bs and block.block_hash == chain[i + 1], \
                    "a block in the prefix cache does not hold committed tokens"
    assert held_while_verifying[0] == 2  # positions 12..20: the drafts reached into a second block
    assert tokens == want.token_ids
    assert s.stats().spec_num_accepted_tokens == 0
    _assert_no_leaks(s)


def test_seeded_sampling_is_reproducible_and_the_same_as_without(engine):
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    params = [SamplingParams(max_tokens=40, temperature=t, top_k=k, top_p=p, seed=seed, ignore_eos=True)
              for t, k, p, seed in ((0.3, 20, 1.0, 3), (0.8, 0, 0.95, 4), (0.5, 0, 1.0, 5), (1.0, 0, 1.0, 6),
                                    (0.3, 0, 0.9, 7))]
    runs = []
    for _ in range(2):
        s = _serving(engine, NGRAM)
        runs.append([o.token_ids for o in s.run(prompts, params)])
        assert s.stats().spec_num_accepted_tokens > 5
        _assert_no_leaks(s)
    assert runs[0] == runs[1]
    # the generator is consumed as without speculation: the same draws (up to floating-point near-ties, which
    # these prompts do not hit)
    assert runs[0] == [o.token_ids for o in _references(engine, prompts, params)]


# --- adaptivity ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_policy_grows_and_shrinks_k_and_pauses_on_low_acceptance(method, tmp_path):
    """After a miss, one more draft than were accepted; after a step whose drafts were all accepted, n-gram drafts
    (free to make) go back to k at once, a draft model's grow by one; low acceptance pauses, then probes with one."""
    draft = {"draft_model": str(tmp_path)} if method == "draft" else {}
    if draft:
        (tmp_path / "manifest.json").write_text("{}")
    policy = SpeculationPolicy(SpeculativeConfig(method=method, num_speculative_tokens=4, max_running=2,
                                                 min_acceptance=0.5, **draft))
    assert policy.step_allows(2) and not policy.step_allows(3)
    state = policy.new_state()
    assert policy.num_draft(state, step=0) == 4
    policy.update(state, 4, 4, step=0)
    assert state.num_draft == 4  # capped at num_speculative_tokens
    policy.update(state, 4, 1, step=1)
    assert state.num_draft == 2  # one more than were accepted
    policy.update(state, 2, 2, step=2)
    grown = 4 if method == "ngram" else 3
    assert state.num_draft == grown and policy.num_draft(state, step=3) == grown
    policy.update(state, grown, 0, step=3)
    policy.update(state, 1, 0, step=4)  # the acceptance rate falls below 0.5: paused
    assert policy.num_draft(state, step=5) == 0 and policy.num_draft(state, step=4 + PROBE_INTERVAL - 1) == 0
    assert policy.num_draft(state, step=4 + PROBE_INTERVAL) == 1  # then probes with one draft
    policy.update(state, 1, 0, step=40)
    assert policy.num_draft(state, step=41) == 0  # a failed probe pauses it again


def test_speculation_stays_off_above_max_running_and_for_excluded_requests(engine):
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[2:5]]
    s = _serving(engine, {"method": "ngram", "max_running": 2, "min_ngram": 2, "max_ngram": 4})
    s.run(prompts, SamplingParams(max_tokens=20, ignore_eos=True))  # three decode together to the end
    assert s.stats().spec_num_steps == 0
    excluded = [SamplingParams(max_tokens=20, ignore_eos=True, logprobs=1),
                SamplingParams(max_tokens=20, ignore_eos=True, repetition_penalty=1.2)]
    s = _serving(engine, NGRAM)
    outs = s.run(prompts[:2], excluded)
    assert s.stats().spec_num_steps == 0 and len(outs[0].logprobs) == 20
    # beside a speculating request, an excluded one still decodes one token per step, with its logprobs
    s = _serving(engine, NGRAM)
    outs = s.run(prompts[1:3], [excluded[0], SamplingParams(max_tokens=20, ignore_eos=True)])
    want = _references(engine, prompts[1:3], [excluded[0], SamplingParams(max_tokens=20, ignore_eos=True)])
    assert s.stats().spec_num_verified > 0 and s.stats().spec_num_draft_tokens > 0  # the other one speculated
    assert [o.token_ids for o in outs] == [w.token_ids for w in want]
    assert [lp.logprob for lp in outs[0].logprobs] == pytest.approx([lp.logprob for lp in want[0].logprobs], abs=1e-4)
    _assert_no_leaks(s)


def test_a_request_with_low_acceptance_pauses(engine):
    prompt = engine.tokenizer.encode(PROMPTS[2])
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    want = _references(engine, [prompt], params)[0]
    vocab = int(engine.executor.graph["meta"]["vocab_size"])
    s = _serving(engine, {"method": "ngram", "min_acceptance": 0.5, "min_ngram": 2, "max_ngram": 4})
    s.proposer = ScriptedProposer([prompt + want.token_ids], vocab, wrong_at=lambda k: 0)  # never accepted
    assert s.run([prompt], params)[0].token_ids == want.token_ids
    # the acceptance EWMA goes 1 -> 0.7 -> 0.49 < 0.5: two verified steps (k drafts, then one more than were
    # accepted: 1), then a pause of PROBE_INTERVAL steps, a probe with one draft (refused: 0.5 -> 0.35), another
    # pause, and so on to the 30th token
    probes = s.stats().spec_num_verified - 2
    assert 2 <= probes <= params.max_tokens // PROBE_INTERVAL
    assert s.stats().spec_num_draft_tokens == DEFAULT_SPECULATIVE_TOKENS["ngram"] + 1 + probes


def test_the_overlapped_pipeline_falls_back_to_verify_steps(engine):
    """With the (stand-in) decode graphs, steps of more than max_running decodes run ahead as before; once few
    enough remain, they speculate on the synchronous path; tokens equal the non-speculative ones."""
    from tests.runtime.test_overlap import EagerGraphs

    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (10, 14, 40, 45, 50)]
    want = _references(engine, prompts, params)
    s = _serving(engine, {"method": "ngram", "max_running": 2, "min_ngram": 2, "max_ngram": 4}, max_num_seqs=5)
    s.graphs = graphs = EagerGraphs(s, 5)
    got = s.run(prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert graphs.num_device_inputs > 3 and s.stats().spec_num_accepted_tokens > 0
    assert s._inflight is None
    _assert_no_leaks(s)


def test_the_pipeline_keeps_its_overlap_where_the_proposer_has_nothing(engine):
    """A step leaves the overlapped pipeline only where the proposer may have drafts: a proposer that never
    expects any leaves the pipeline as it is without speculation (every decode fed from the device) and is never
    asked to propose; the n-gram proposer expects drafts exactly where the suffix recurs."""
    from tests.runtime.test_overlap import EagerGraphs

    class Never(Proposer):
        method = "never"
        calls = 0

        def propose(self, requests):
            Never.calls += 1
            return [[] for _ in requests]

        def may_propose(self, token_ids, request_id=None):
            return False

    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:3]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    fed = []
    for spec in (None, NGRAM):
        s = _serving(engine, spec, max_num_seqs=3)
        if spec:
            s.proposer = Never()
        s.graphs = graphs = EagerGraphs(s, 3)
        s.run(prompts, params)
        fed.append(graphs.num_device_inputs)
    assert fed[0] > 3 and fed[1] == fed[0] and Never.calls == 0
    ngram = NgramProposer(2, 4)
    assert ngram.may_propose([5, 6, 7, 5, 6]) and not ngram.may_propose([5, 6, 7, 8, 9])


# --- metrics ---------------------------------------------------------------------------------------------------------
def test_metrics_export_the_speculation_counters(engine):
    s = _serving(engine, NGRAM)
    s.run([engine.tokenizer.encode(PROMPTS[4])], SamplingParams(max_tokens=40, ignore_eos=True))
    stats = s.stats()
    assert 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    body, _ = ServerMetrics(s.stats).render()
    samples = {x.name: x.value for f in text_string_to_metric_families(body.decode()) for x in f.samples}
    assert samples["llm_spec_draft_tokens_total"] == stats.spec_num_draft_tokens
    assert samples["llm_spec_accepted_tokens_total"] == stats.spec_num_accepted_tokens
    assert samples["llm_spec_verified_decodes_total"] == stats.spec_num_verified
    assert samples["llm_spec_verify_steps_total"] == stats.spec_num_steps
    assert samples["llm_spec_acceptance_rate"] == pytest.approx(
        stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens)
    assert samples["llm_spec_mean_accepted_tokens"] == pytest.approx(
        stats.spec_num_accepted_tokens / stats.spec_num_verified)


# --- verify steps through the kernels -------------------------------------------------------------------------------
def test_verify_steps_replay_the_step_graphs_padded_step(tiny_artifact):
    """A verify step goes through StepGraphs (the CUDA graphs replay exactly this padded step; here it runs eagerly
    through the kernels, under the Triton interpreter), in a sequence bucket that holds its k + 1 logits rows per
    decode: the tokens are the reference path's."""
    from runtime.cuda_graphs import StepGraphs

    path = tiny_artifact
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22]]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want = ServingEngine(Engine.load(path, use_kernels=False), ServingConfig(num_blocks=16)).run(prompts, params)
    fused = ServingEngine(Engine.load(path, use_kernels=True),
                          ServingConfig(num_blocks=16, max_num_batched_tokens=32, max_seq_len=64, max_num_seqs=2,
                                        speculative={"method": "ngram", "num_speculative_tokens": 3,
                                                     "min_acceptance": 0.0}))
    fused.step_graphs = graphs = StepGraphs(fused.executor, fused.storage, 32, 8, 64, token_buckets=(8, 16, 32),
                                            capture=False)
    assert graphs.bucket_for(6, 2, num_rows=6) == (8, 8) and graphs.bucket_for(6, 2, num_rows=9) is None
    vocab = int(fused.executor.graph["meta"]["vocab_size"])
    fused.proposer = ScriptedProposer([p + w.token_ids for p, w in zip(prompts, want)], vocab,
                                      wrong_at=lambda k: k - 1)  # the last draft wrong: k - 1 accepted
    runs, real_run = [], graphs.run

    def spy(step, feed=None):
        runs.append((step.num_tokens, step.num_seqs, len(step.logits_rows)))
        return real_run(step, feed)

    graphs.run = spy
    got = fused.run(prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert (8, 2, 8) in runs  # both decodes with 3 drafts: 8 tokens, 8 logits rows
    assert fused.stats().spec_num_accepted_tokens > 0
    _assert_no_leaks(fused)


@pytest.mark.parametrize("on_device", [False, True])
def test_verify_steps_run_as_chained_decodes(tiny_artifact, monkeypatch, on_device):
    """A verify step of a few decodes runs on the verify-step decode graphs (DecodeGraphs(chained=True); here eagerly
    through the kernels, under the Triton interpreter): each request's last token and its drafts as rows at
    consecutive positions, padded to the next row bucket; a step with more rows than the largest bucket takes the
    other path. Drafts on the host and drafts left on the device; greedy and seeded requests: the tokens are the
    non-speculative reference's."""
    monkeypatch.setenv("RUNTIME_VERIFY_DECODE_BUCKETS", "2,3,5")
    path = tiny_artifact
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22]]
    params = [SamplingParams(max_tokens=8, ignore_eos=True),
              SamplingParams(max_tokens=17, temperature=0.9, seed=3, ignore_eos=True)]
    want = ServingEngine(Engine.load(path, use_kernels=False), ServingConfig(num_blocks=16)).run(prompts, params)
    fused = ServingEngine(Engine.load(path, use_kernels=True),
                          ServingConfig(num_blocks=16, max_num_batched_tokens=32, max_seq_len=64, max_num_seqs=2,
                                        speculative={"method": "ngram", "num_speculative_tokens": 3,
                                                     "min_acceptance": 0.0}))
    fused.verify_graphs = graphs = fused._verify_decode_graphs(fused.spec_policy.config, capture=False)
    assert graphs.buckets == [2, 3, 5] and graphs.chained
    vocab = int(fused.executor.graph["meta"]["vocab_size"])
    scripted = DeviceScriptedProposer if on_device else ScriptedProposer
    fused.proposer = scripted([p + w.token_ids for p, w in zip(prompts, want)], vocab, wrong_at=lambda k: k - 1)
    runs, eager, real_run, real_forward = [], [], graphs.run, fused.executor.forward

    def spy(ids, positions, slots, tables):
        runs.append(positions)
        return real_run(ids, positions, slots, tables)

    def forward(inp):
        if inp.paged is not None and not inp.paged.chained:
            eager.append(inp.paged.cu_seqlens_q.tolist())
        return real_forward(inp)

    graphs.run, fused.executor.forward = spy, forward
    got = fused.run(prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert runs and all(len(r) <= 5 for r in runs)
    # one request alone with 3 drafts: 4 rows at consecutive positions (its last token's, then the drafts')
    assert any(len(r) == 4 and r == list(range(r[0], r[0] + 4)) for r in runs)
    assert [0, 4, 8] in eager  # both requests with 3 drafts: 8 rows, past the largest bucket (5)
    assert fused.stats().spec_num_accepted_tokens > 0
    _assert_no_leaks(fused)


def test_on_cuda_verify_steps_replay_the_chained_decode_graphs(bundled_artifact):
    """On CUDA (captured graphs), verify steps of one to three decodes replay the verify-step decode graphs, whose
    rows of one request attend to keys other rows of the same launch write: greedy and seeded tokens equal decoding
    without speculation."""
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("needs CUDA, the kernels compiled")
    engine = Engine.load(bundled_artifact, "cuda")
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:3]]
    params = [SamplingParams(max_tokens=40 + 12 * i, temperature=0.8 * (i % 2), seed=i, ignore_eos=True)
              for i in range(3)]
    want = _serving(engine).run(prompts, params)
    s = _serving(engine, {"method": "ngram", "num_speculative_tokens": 4, "min_acceptance": 0.0, "adaptive": False})
    assert s.verify_graphs is not None and s.verify_graphs._graphs
    vocab = int(engine.executor.graph["meta"]["vocab_size"])
    s.proposer = ScriptedProposer([p + w.token_ids for p, w in zip(prompts, want)], vocab, wrong_at=lambda k: k - 2)
    rows, real_run = [], s.verify_graphs.run
    s.verify_graphs.run = lambda *a: rows.append(len(a[1])) or real_run(*a)
    assert [o.token_ids for o in s.run(prompts, params)] == [w.token_ids for w in want]
    assert {5, 10, 15} & set(rows) and s.stats().spec_num_accepted_tokens > 0
    _assert_no_leaks(s)


def test_verify_decode_buckets(monkeypatch):
    from runtime.cuda_graphs import DEFAULT_VERIFY_DECODE_BUCKETS, verify_decode_buckets

    assert verify_decode_buckets() == DEFAULT_VERIFY_DECODE_BUCKETS
    monkeypatch.setenv("RUNTIME_VERIFY_DECODE_BUCKETS", "0")
    assert verify_decode_buckets() == ()
    monkeypatch.setenv("RUNTIME_VERIFY_DECODE_BUCKETS", "8, 3,1")
    with pytest.raises(ValueError, match="RUNTIME_VERIFY_DECODE_BUCKETS='8,3,1': give row counts from 2 to 256"):
        verify_decode_buckets()


def test_verify_buckets_pad_a_few_decodes_to_small_steps(monkeypatch):
    """With speculation on, a batch-1 verify step of k drafts pads to the next of the small buckets (2, 4, 8 tokens
    and sequences) instead of 16 tokens over 16 sequences; a small sequence bucket never pairs with a large token
    bucket (no graph of 32 tokens over 2 sequences is captured), and the regular buckets are as before."""
    from types import SimpleNamespace

    from runtime.cuda_graphs import DEFAULT_STEP_TOKEN_BUCKETS, StepGraphs, pairs_with, powers, step_buckets, \
        verify_buckets

    assert verify_buckets() == (2, 4, 8)
    small = verify_buckets()
    tokens, seqs = step_buckets(2048, 20, tuple(sorted(set(DEFAULT_STEP_TOKEN_BUCKETS) | set(small))),
                                tuple(sorted(set(powers(4, 20)) | set(small))))
    graphs = SimpleNamespace(token_buckets=tokens, seq_buckets=seqs)
    pick = StepGraphs.bucket_for.__get__(graphs)
    assert [pick(k + 1, 1, k + 1) for k in (1, 2, 3, 4, 7)] == [(2, 2), (4, 4), (4, 4), (8, 8), (8, 8)]
    assert pick(10, 2, 10) == (16, 16) and pick(20, 4, 20) == (32, 20)  # two or four decodes with k drafts
    assert pick(40, 2) == (64, 4) and pick(300, 16) == (384, 16)  # prompts: the regular pairs
    top = seqs[-1]
    keys = [(t, s) for t in tokens for s in seqs if pairs_with(t, s, top)]
    assert (32, 2) not in keys and (32, 8) not in keys and (8, 8) in keys and (2048, 20) in keys
    assert all(s in (1, 4, 16, 20) for t, s in keys if t > 16)
    monkeypatch.setenv("RUNTIME_VERIFY_BUCKETS", "0")
    assert verify_buckets() == ()
    monkeypatch.setenv("RUNTIME_VERIFY_BUCKETS", "2,32")
    with pytest.raises(ValueError, match="RUNTIME_VERIFY_BUCKETS='2,32': give sizes from 1 to 15"):
        verify_buckets()


# --- the draft-model proposer ---------------------------------------------------------------------------------------
def test_draft_model_drafts_as_a_fresh_one_would_after_any_acceptance(engine):
    """The draft keeps its KV cache across proposals and cuts it back to what the request kept: after any mix of
    accepted and rejected drafts it proposes exactly what a new proposer (empty cache) proposes for the same tokens."""
    from runtime.draft_model import DraftModelProposer

    vocab = int(engine.executor.graph["meta"]["vocab_size"])
    kept = DraftModelProposer(engine, vocab, engine.tokenizer, 512)
    prompt = engine.tokenizer.encode(PROMPTS[1])
    tokens = list(prompt)
    for num_accepted in [4, 0, 2, None, 1, 4, 3]:
        drafts = kept.propose([DraftRequest("r", tokens, 4)])[0]
        assert drafts == DraftModelProposer(engine, vocab, engine.tokenizer, 512).propose(
            [DraftRequest("r", list(tokens), 4)])[0]
        held = kept._seqs["r"]  # its cache holds the request's tokens, then the drafts it fed
        assert held.token_ids == tokens + drafts[:3] and held.kv.num_tokens == len(held.token_ids)
        if num_accepted is None:  # decoded a few steps without drafts (paused, a full batch): all its own tokens
            tokens += [(drafts[0] + 1) % vocab, drafts[1], drafts[2]]
            continue
        # the request keeps num_accepted drafts, then a token of its own (another than the next draft)
        own = (drafts[num_accepted] + 1) % vocab if num_accepted < len(drafts) else 7
        tokens += drafts[:num_accepted] + [own]
    kept.release("r")
    assert kept._seqs == {}


def test_draft_model_output_is_the_targets(engine, bundled_artifact):
    """The bundled model as its own draft: greedy drafts are all accepted, and greedy and seeded output equal the
    non-speculative output."""
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:3]]
    spec = {"method": "draft", "draft_model": str(bundled_artifact), "num_speculative_tokens": 3}
    greedy = SamplingParams(max_tokens=30, ignore_eos=True)
    s = _serving(engine, spec)
    assert [o.token_ids for o in s.run(prompts, greedy)] == [w.token_ids for w in _references(engine, prompts, greedy)]
    stats = s.stats()
    assert stats.spec_num_draft_tokens > 20 and stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    seeded = [SamplingParams(max_tokens=24, temperature=0.8, seed=i, ignore_eos=True) for i in range(3)]
    assert [o.token_ids for o in s.run(prompts, seeded)] == [w.token_ids for w in _references(engine, prompts, seeded)]
    assert s.stats().spec_num_accepted_tokens > stats.spec_num_accepted_tokens
    weights = sum(t.numel() * t.element_size() for t in engine.executor.params.values())
    assert s.memory_plan.weights_bytes == 2 * weights  # the draft's weights are planned beside the target's
    # and its caches: max_running of them, each of max_seq_len tokens (the same model: the target's bytes a token)
    per_token = engine.kv_layout.bytes_per_token()
    assert s.memory_plan.other_bytes == s.config.speculative.max_running * s.proposer.max_seq_len * per_token
    _assert_no_leaks(s)
    assert s.proposer._seqs == {}  # every request's draft cache released


def test_draft_model_keeps_at_most_max_seqs_caches(engine):
    """A draft holds at most max_seqs request caches, dropping the least recently proposed for; a request whose
    cache was dropped drafts as before (it refeeds its tokens)."""
    from runtime.draft_model import DraftModelProposer

    vocab = int(engine.executor.graph["meta"]["vocab_size"])

    def fresh() -> DraftModelProposer:
        return DraftModelProposer(engine, vocab, engine.tokenizer, 512)

    small = DraftModelProposer(engine, vocab, engine.tokenizer, 512, max_seqs=2)
    prompts = {f"r{i}": engine.tokenizer.encode(p) for i, p in enumerate(PROMPTS[:3])}
    reqs = [DraftRequest(r, ids, 3) for r, ids in prompts.items()]
    drafts = small.propose(reqs[:2])
    assert drafts == fresh().propose(reqs[:2])
    small.propose(reqs[2:])  # r0, the least recent, is dropped for r2
    assert list(small._seqs) == ["r1", "r2"]
    later = [DraftRequest("r0", prompts["r0"] + drafts[0][:1], 3)]  # r0 one token on (its first draft accepted)
    assert small.propose(later) == fresh().propose(later)  # refed from its tokens: the same drafts
    assert list(small._seqs) == ["r2", "r0"] and small.kv_bytes() == 2 * 512 * engine.kv_layout.bytes_per_token()
    # a step's own requests are never evicted for its new one: r2 (cached, older) stays while r1 comes back
    fed = []
    forward = small._forward
    small._forward = lambda seqs, tokens: (fed.extend(tokens), forward(seqs, tokens))[1]
    small.propose([DraftRequest("r1", prompts["r1"], 2), DraftRequest("r2", prompts["r2"] + [7], 2)])
    assert set(small._seqs) == {"r1", "r2"}  # r0 went, not r2
    assert [7] in fed  # r2 fed only its new token: its cache was kept


def test_a_draft_model_in_the_recipe_travels_inside_the_artifact(engine, bundled_artifact, tiny_artifact, tmp_path):
    """runtime.speculative method draft: the build copies the draft artifact into the target's (``draft/``, every
    file hashed by the target's manifest), which then serves with it by default (nothing outside the artifact): the
    bundled model as its own draft, greedy output equal to the plain one's. A draft whose tokenizer is not the
    checkpoint's is refused before anything is built; a tampered draft file fails the target's load."""
    from builder.pipeline import BuildError
    from conftest import BUNDLED

    target = build_artifact(BUNDLED, tmp_path / "target", max_batch_size=4, max_seq_len=512,
                            speculative={"method": "draft", "draft_model": str(bundled_artifact),
                                         "num_speculative_tokens": 3})
    manifest = json.loads((target / "manifest.json").read_text())
    assert manifest["runtime"]["speculative"]["draft_model"] == "draft"
    assert "draft/manifest.json" in manifest["files"] and "draft/weights.safetensors" in manifest["files"]
    served = ServingEngine(Engine.load(target), ServingConfig(num_blocks=64))
    assert served.config.speculative.method == "draft" and served.proposer is not None
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:2]]
    greedy = SamplingParams(max_tokens=20, ignore_eos=True)
    assert [o.token_ids for o in served.run(prompts, greedy)] == \
        [w.token_ids for w in _references(engine, prompts, greedy)]
    assert served.stats().spec_num_accepted_tokens > 10
    with pytest.raises(BuildError, match="its tokenizer.json is not the checkpoint's"):
        build_artifact(BUNDLED, tmp_path / "other", speculative={"method": "draft", "draft_model": str(tiny_artifact)})
    with pytest.raises(BuildError, match=r"carries a draft model of its own .*; name the plain draft artifact"):
        build_artifact(BUNDLED, tmp_path / "other", speculative={"method": "draft", "draft_model": str(target)})
    # the same tokenizer but more embedding rows: refused at build too (the proposer would refuse it at serve time)
    from transformers import AutoModelForCausalLM

    from conftest import save_tokenizer, tiny_config

    small = make_checkpoint(tmp_path / "small", "llama", num_attention_heads=2, num_key_value_heads=1)
    save_tokenizer(tmp_path / "wide")  # the same tokenizer, 384 embedding rows
    AutoModelForCausalLM.from_config(tiny_config("llama", 384, num_attention_heads=2, num_key_value_heads=1)) \
        .save_pretrained(tmp_path / "wide")
    wide = build_artifact(tmp_path / "wide", tmp_path / "wide_art")
    with pytest.raises(BuildError, match=r"its vocab_size is 384, the checkpoint's 320"):
        build_artifact(small, tmp_path / "other2", speculative={"method": "draft", "draft_model": str(wide)})
    from runtime.artifact import ArtifactError, manifest_digest

    elsewhere = json.loads((target / "manifest.json").read_text())
    elsewhere["runtime"]["speculative"]["draft_model"] = "../other"  # pointing outside, its own hash made to agree
    elsewhere["manifest_sha256"] = manifest_digest(elsewhere)
    (target / "manifest.json").write_text(json.dumps(elsewhere))
    with pytest.raises(ArtifactError, match=r"runtime\.speculative\.draft_model.*'draft' \(the bundled draft"):
        Engine.load(target)
    (target / "manifest.json").write_text(json.dumps(manifest))
    with open(target / "draft" / "graph.json", "a") as f:
        f.write(" ")

    with pytest.raises(ArtifactError, match="draft/graph.json"):
        Engine.load(target)


def test_a_draft_runs_on_one_gpu_whatever_its_gates_and_errors_name_its_setting(engine, bundled_artifact, monkeypatch,
                                                                               caplog):
    """A sharded draft is refused before any rank starts (it tried to start its ranks from the engine process); a
    draft that failed its quality gates is served with a warning (the target verifies every draft token; it was
    refused whatever --allow-failed-gate said); a draft path that is not an artifact is named as the speculative
    setting, relative to the working directory; the draft's caches are planned for the requests that can run."""
    import types

    import runtime.draft_model as dm
    from runtime.artifact import ArtifactError, open_artifact

    spec = {"method": "draft", "draft_model": str(bundled_artifact), "num_speculative_tokens": 3}
    monkeypatch.setattr(dm, "open_artifact", lambda path, **kw: types.SimpleNamespace(tp_size=2, manifest={}))
    with pytest.raises(ArtifactError, match=r"speculative draft_model: .* is sharded for tp_size 2; a draft model "
                                            r"runs on one GPU beside the target: build it with parallel\.tp_size 1"):
        _serving(engine, spec)

    def gate_failed(path, **kw):
        opened = open_artifact(path, **kw)
        opened.manifest = {**opened.manifest, "quantization": {"gates": {"passed": False, "failed": ["kl"]}}}
        return opened

    loads = []
    real_load = dm.Engine.load
    monkeypatch.setattr(dm, "open_artifact", gate_failed)
    monkeypatch.setattr(dm.Engine, "load", lambda *a, **kw: loads.append(kw) or real_load(*a, **kw))
    with caplog.at_level("WARNING", logger="runtime.draft_model"):
        served = _serving(engine, {**spec, "max_running": 100_000}, max_num_seqs=4)
    assert loads == [{"allow_failed_gate": True}] and "failed its quality gates (kl)" in caplog.text
    assert served.proposer.max_seqs == 4  # not 100,000 caches
    with pytest.raises(ArtifactError, match=r"speculative draft_model \(a relative path, read from the working "
                                            r"directory .*\): no-such-draft"):
        _serving(engine, {**spec, "draft_model": "no-such-draft"})


def test_draft_model_with_another_vocabulary_is_refused(engine, tiny_artifact):
    with pytest.raises(SpeculativeConfigError, match="draft model's vocabulary has .* entries, the target's 4096"):
        _serving(engine, {"method": "draft", "draft_model": str(tiny_artifact)})


def test_fixed_k_policy_never_adapts():
    policy = SpeculationPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False,
                                                 min_acceptance=0.5))
    state = policy.new_state()
    for step in range(5):
        policy.update(state, 3, 0, step)  # every draft rejected: an adaptive policy would shrink k, then pause
        assert policy.num_draft(state, step + 1) == 3
    with pytest.raises(SpeculativeConfigError, match="adaptive"):
        SpeculativeConfig(method="ngram", adaptive="no")


def test_speculative_bench_on_the_bundled_model(bundled_artifact, tmp_path):
    """builder.bench.speculative end to end on the CPU: equal tokens, drafts accepted on the code-editing
    workload, verify steps of fixed size timed, figures recorded."""
    import json

    from builder.bench import speculative as bench

    record = tmp_path / "figures.jsonl"
    assert bench.main([str(bundled_artifact), "--device", "cpu", "--prompts", "1", "--output-len", "24", "--rounds",
                       "2", "--verify-cost", "2", "--input-len", "32", "--record", str(record)]) == 0
    figures = {d["figure"]: d["value"] for d in map(json.loads, record.read_text().splitlines())}
    assert set(figures) == {"spec_speedup_ngram_b1", "spec_decode_tok_s_plain_b1", "spec_decode_tok_s_ngram_b1",
                            "spec_acceptance_ngram_b1", "spec_step_ms_k0", "spec_verify_cost_k2", "spec_step_ms_k2"}
    assert figures["spec_acceptance_ngram_b1"] > 0  # the model copies from its prompt
    assert figures["spec_verify_cost_k2"] == pytest.approx(figures["spec_step_ms_k2"] / figures["spec_step_ms_k0"],
                                                           rel=1e-2)


def test_code_editing_prompts_end_on_the_stretchs_first_nonblank_line(bundled_artifact):
    """Each code-editing prompt ends with the instruction and the stretch's first line, which is never blank (a blank
    cue left the model nothing to copy from: the stretches of three of the six files started on one)."""
    from pathlib import Path

    from builder.bench.speculative import SNIPPET_LINES, code_edit_prompts
    from runtime.artifact import open_artifact

    tokenizer = open_artifact(bundled_artifact, check_hashes=False).load_tokenizer()
    root = Path(__file__).resolve().parents[2]
    marker = "# The code above, written out again unchanged:\n"
    for ids in code_edit_prompts(tokenizer, 6, root):
        text = tokenizer.decode(ids)
        snippet, cue = text.split(marker)
        assert cue.strip() and cue.endswith("\n") and snippet.startswith(cue[:-1])
        assert len(snippet.splitlines()) <= SNIPPET_LINES + 2


def test_speculative_bench_with_a_draft_model_on_text(bundled_artifact, tmp_path):
    """--draft with --text: the draft model's figures (the bundled model as its own draft: nearly every proposal
    accepted), prompts cut from a text file."""
    import json

    from builder.bench import speculative as bench

    record = tmp_path / "figures.jsonl"
    from pathlib import Path

    text = Path(__file__).resolve().parents[2] / "models" / "pystdlib-llama" / "eval.txt"
    assert bench.main([str(bundled_artifact), "--device", "cpu", "--prompts", "2", "--output-len", "16",
                       "--input-len", "48", "--rounds", "1", "--draft", str(bundled_artifact), "--text", str(text),
                       "--record", str(record)]) == 0
    figures = {d["figure"]: d["value"] for d in map(json.loads, record.read_text().splitlines())}
    assert set(figures) == {"spec_speedup_draft_b1", "spec_decode_tok_s_plain_b1", "spec_decode_tok_s_draft_b1",
                            "spec_acceptance_draft_b1", "spec_accepted_per_verify_draft_b1"}
    assert figures["spec_acceptance_draft_b1"] > 0.9


def test_spec_profile_times_ngram_speculation_without_a_draft(bundled_artifact, capsys):
    """``builder.devtools.spec_profile`` without ``--draft``: n-gram drafts on the code-editing prompts, the phases
    of the speculative engine's steps timed beside the plain engine's."""
    from builder.devtools.spec_profile import main

    assert main([str(bundled_artifact), "--device", "cpu", "--prompts", "1", "--output-len", "16", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "speculative (ngram, k=12): 16 tokens" in out and "phase (host wall time" in out and "_run" in out


def test_spec_profile_trace_needs_cuda(bundled_artifact, capsys):
    """``--trace`` times GPU kernels under torch.profiler: on another device it is refused by name before any engine
    loads."""
    from builder.devtools.spec_profile import main

    with pytest.raises(SystemExit) as exc:
        main([str(bundled_artifact), "--device", "cpu", "--trace"])
    assert exc.value.code == 2 and "--trace times GPU kernels: it needs --device cuda" in capsys.readouterr().err


def test_ngram_sweep_counts_steps_and_estimates_the_speedup(bundled_artifact):
    """--ngram-sweep: each setting's steps against a plain pass, tokens equal, and the estimate from the counts (plain
    steps over speculative steps with each verify step weighed at the cost)."""
    from pathlib import Path

    from builder.bench.speculative import code_edit_prompts, ngram_sweep
    from runtime.artifact import open_artifact

    tokenizer = open_artifact(bundled_artifact, check_hashes=False).load_tokenizer()
    prompts = code_edit_prompts(tokenizer, 2, Path(__file__).resolve().parents[2])
    rows = ngram_sweep(str(bundled_artifact), "cpu", [(2, 4, 8), (3, 6, 12)], prompts, 32, cost=2.0)
    assert [(r["min_ngram"], r["max_ngram"], r["k"]) for r in rows] == [(2, 4, 8), (3, 6, 12)]
    for r in rows:
        assert r["tokens_equal"] and 0 < r["verify_steps"] <= r["steps"] < r["plain_steps"], r
        assert r["estimated_speedup"] == pytest.approx(r["plain_steps"] / (r["steps"] + r["verify_steps"]))
    with pytest.raises(SystemExit):
        from builder.bench import speculative as bench

        bench.main([str(bundled_artifact), "--device", "cpu", "--ngram-sweep", "4:2:8"])


# --- the rate check: speculation only where it measures faster -----------------------------------------------------
def test_rate_check_chooses_the_faster_mode_and_keeps_probing_the_other():
    from runtime.speculative import RATE_CYCLE_STEPS, RATE_MIN_SAMPLES, RATE_PROBE_STEPS, RateCheck

    check = RateCheck(min_gain=1.1)
    assert check.speculates(1, RATE_PROBE_STEPS) and not check.speculates(1, 0)  # unmeasured: drafts, plain probed
    for _ in range(RATE_MIN_SAMPLES - 1):
        check.record(1, True, 5, 0.010)  # 500 tok/s with drafts
        check.record(1, False, 1, 0.0025)  # 400 without
    assert check.chosen == {} and check.gain(1) == pytest.approx(1.25)
    check.record(1, True, 5, 0.010)
    check.record(1, False, 1, 0.0025)
    assert check.chosen == {1: True}  # 1.25x >= min_gain 1.1
    assert check.speculates(1, RATE_CYCLE_STEPS + RATE_PROBE_STEPS) and not check.speculates(1, RATE_CYCLE_STEPS)
    for _ in range(20):  # the drafts stop paying: 5 tokens in 14 ms, 357 tok/s
        check.record(1, True, 5, 0.014)
    assert check.chosen[1] is False and check.gain(1) < 1.1
    assert not check.speculates(1, RATE_PROBE_STEPS) and check.speculates(1, 2 * RATE_CYCLE_STEPS)  # probed
    assert check.speculates(2, RATE_PROBE_STEPS)  # another batch size: its own rates
    check.record(1, True, 0, 0.01)
    check.record(1, True, 3, 0.0)  # nothing to learn from: ignored
    assert check.samples[1, True] == RATE_MIN_SAMPLES + 20


def test_min_gain_is_checked_and_zero_or_fixed_k_turns_the_rate_check_off(monkeypatch):
    for bad in (-0.5, "1", True, float("nan")):
        with pytest.raises(SpeculativeConfigError, match="min_gain"):
            SpeculativeConfig(method="ngram", min_gain=bad)
    monkeypatch.setenv("RUNTIME_SPEC_MIN_GAIN", "1.2")
    assert SpeculativeConfig(method="ngram").min_gain == 1.2
    assert SpeculationPolicy(SpeculativeConfig(method="ngram")).rate_check.min_gain == 1.2
    for off in (dict(min_gain=0.0), dict(adaptive=False), dict(method=None)):
        assert SpeculationPolicy(SpeculativeConfig(**{"method": "ngram", **off})).rate_check is None


class _VirtualClock:
    """The rate check's clock in virtual seconds: one per engine step call, plus what proposals cost."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


class _CostlyProposer(ScriptedProposer):
    """Right drafts, each proposal costing ``cost`` virtual seconds (a draft model too slow for its target)."""

    def __init__(self, *args, clock: _VirtualClock, cost: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.clock, self.cost = clock, cost

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        self.clock.now += self.cost
        return super().propose(requests)


@pytest.mark.parametrize("pays", [False, True])
def test_drafts_that_do_not_pay_are_turned_off_by_measurement(engine, pays):
    """Every draft right (acceptance 1.0): on a virtual clock where a step call takes one second, a proposal that
    costs eight more makes 5 tokens in 9 s against 1 a second without drafts, so after the first measurements the
    engine decodes without them (probing them again each cycle); the same drafts at no cost are kept. The tokens are
    the non-speculative ones either way; /metrics reports the measured gain and whether drafts run."""
    from runtime.speculative import RATE_MIN_SAMPLES, RATE_PROBE_STEPS

    prompt = engine.tokenizer.encode(PROMPTS[1])
    params = SamplingParams(max_tokens=72, ignore_eos=True)
    want = _serving(engine).run([prompt], params)[0]
    vocab = int(engine.executor.graph["meta"]["vocab_size"])
    s = _serving(engine, {"method": "ngram", "num_speculative_tokens": 4, "min_acceptance": 0.0, "min_gain": 1.0})
    s._clock = clock = _VirtualClock()
    s.proposer = _CostlyProposer([prompt + want.token_ids], vocab, clock=clock, cost=0.0 if pays else 8.0)
    got = s.run([prompt], params)[0]
    assert got.token_ids == want.token_ids
    stats, check = s.stats(), s.spec_policy.rate_check
    assert check.chosen == {1: pays}, check.rates
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0
    assert check.gain(1) == pytest.approx(5.0 if pays else 5.0 / 9.0)
    assert stats.spec_drafting == int(pays) and stats.spec_measured_gain == pytest.approx(check.gain(1))
    body, _ = ServerMetrics(s.stats).render()
    samples = {x.name: x.value for f in text_string_to_metric_families(body.decode()) for x in f.samples}
    assert samples["llm_spec_drafting"] == int(pays)
    assert samples["llm_spec_measured_gain"] == pytest.approx(check.gain(1))
    plain_steps = stats.num_steps - stats.spec_num_steps
    if pays:  # past the first probe (plain steps), every step verifies drafts
        assert stats.spec_num_steps > RATE_MIN_SAMPLES and plain_steps <= RATE_PROBE_STEPS + 3
    else:  # a few verify steps to measure, then plain decoding to the end
        assert stats.spec_num_steps <= RATE_MIN_SAMPLES + 2 and plain_steps > RATE_PROBE_STEPS + 10
    _assert_no_leaks(s)


def test_the_verify_profile_times_each_stage(bundled_artifact, capsys):
    """builder.bench.verify_profile on the CPU: every step's host stages timed; a step with drafts passes through the
    verification, a plain one does not."""
    from builder.bench import verify_profile

    plain = verify_profile.profile(str(bundled_artifact), "cpu", 0, list(range(3, 27)), 12, 5)
    drafted = verify_profile.profile(str(bundled_artifact), "cpu", 2, list(range(3, 27)), 12, 5)
    assert "_verify" not in plain["host_ms"] and drafted["host_ms"]["_verify"] > 0
    assert plain["wall_ms"] > 0 and drafted["steps"] >= 4 and plain["steps"] == 12
    assert verify_profile.main([str(bundled_artifact), "--device", "cpu", "--num-draft", "1", "--input-len", "8",
                                "--output-len", "8"]) == 0
    assert "K = 1: wall" in capsys.readouterr().out
