"""ServingEngine on the bundled model: batched results equal one-at-a-time results (chunked prefill,
preemption, shared prefixes included), seeds, aborts, timeouts, stop conditions, the memory plan."""

from __future__ import annotations

import re
import time

import pytest
import torch

from runtime import Engine, SamplingParams
from runtime.engine import RequestError
from runtime.memory import MemoryPlanError
from runtime.scheduler import QueueFullError
from runtime.serving import ServingConfig, ServingEngine

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n\nclass Config:\n    \"\"\"Settings.\"\"\"\n",
    "    def __init__(self, name, value=None):\n        self.name = name\n        self.value = value\n" * 3,
    "for i in range(10):\n",
    "    def read(self, path):\n        with open(path) as f:\n            return f.read()\n" * 4,
]


@pytest.fixture(scope="module")
def engine(bundled_artifact) -> Engine:
    return Engine.load(bundled_artifact)


def _serving(engine: Engine, **config) -> ServingEngine:
    return ServingEngine(engine, ServingConfig(**config))


def _assert_no_leaks(s: ServingEngine) -> None:
    assert s.scheduler.num_unfinished == 0
    assert s.kv.pool.num_free == s.kv.pool.num_blocks
    assert s.kv.num_requests == 0


def _assert_same_greedy(engine: Engine, prompt: list[int], got, ref) -> None:
    """Greedy tokens must be equal; if they differ, the reference's top two logits at the first
    difference must be a near-tie (batched and one-at-a-time matmuls round differently)."""
    if got.token_ids == ref.token_ids:
        return
    i = next(k for k, (a, b) in enumerate(zip(got.token_ids, ref.token_ids)) if a != b)
    logits = engine.logits(prompt + ref.token_ids[:i])[-1]
    top2 = torch.topk(logits, 2).values
    assert float(top2[0] - top2[1]) < 1e-4, f"diverged at generated token {i} without a tie"


def test_batched_equals_one_at_a_time_with_chunking_and_preemption(engine):
    # 16-token blocks; 14 blocks (224 slots) cannot hold all five requests at once, so the scheduler must
    # preempt; prompts longer than 64 tokens are prefilled in chunks across steps.
    s = _serving(engine, num_blocks=14, max_seq_len=192, max_num_batched_tokens=64, max_num_seqs=4)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    assert max(len(p) for p in prompts) > 64, "a prompt must need chunked prefill"
    params = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=0)
    outs = s.run(prompts, params)
    assert s.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    for prompt, out in zip(prompts, outs):
        ref = engine.generate(prompt, params)
        assert out.finish_reason == "length" and len(out.token_ids) == 40
        _assert_same_greedy(engine, prompt, out, ref)
        if out.token_ids == ref.token_ids:
            assert out.text == ref.text
            got = torch.tensor([lp.logprob for lp in out.logprobs])
            assert torch.allclose(got, torch.tensor(ref.logprobs), atol=1e-4)
    _assert_no_leaks(s)


def test_shared_prefixes_in_one_step_and_across_steps(engine):
    s = _serving(engine, num_blocks=64, max_num_batched_tokens=256)
    head = engine.tokenizer.encode(PROMPTS[2])  # 60+ tokens: several full blocks
    prompts = [head + engine.tokenizer.encode(tail, add_special_tokens=False)
               for tail in ("    def size(self):", "    def name(self):", "\n\nclass Other:")]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = s.run(prompts, params)  # admitted in one step: the later two hit blocks the first is filling
    assert [o.num_cached_tokens for o in outs][1:] == [len(head) // 16 * 16] * 2
    for prompt, out in zip(prompts, outs):
        _assert_same_greedy(engine, prompt, out, engine.generate(prompt, params))
    again = s.run(prompts[:1], params)[0]  # a later request: served from the (now free) cached blocks
    assert again.num_cached_tokens == (len(prompts[0]) - 1) // 16 * 16
    assert again.token_ids == outs[0].token_ids
    assert s.stats().prefix_cache_hits > 0
    _assert_no_leaks(s)


def test_seeded_sampling_is_independent_of_the_batch(engine):
    s = _serving(engine, num_blocks=64)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:3]]
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = s.run([prompts[0]], seeded)[0]
    others = SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True)
    together = s.run(prompts, [seeded, others, others])[0]
    assert together.token_ids == alone.token_ids
    assert engine.generate(prompts[0], seeded).token_ids == alone.token_ids
    _assert_no_leaks(s)


def test_stop_conditions(engine):
    s = _serving(engine, num_blocks=64, max_seq_len=64)
    prompt = engine.tokenizer.encode(PROMPTS[0])
    free = s.run([prompt], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    assert len(free.text) > 4
    stop = free.text[2:5]  # a string the greedy continuation is known to produce
    out = s.run([prompt], SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and stop not in out.text and out.text == free.text[:free.text.index(stop)]
    tok = free.token_ids[5]
    out = s.run([prompt], SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=[tok]))[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[:free.token_ids.index(tok) + 1]
    capped = s.run([prompt], SamplingParams(max_tokens=200, ignore_eos=True))[0]  # max_seq_len 64 caps it
    assert capped.finish_reason == "length" and len(prompt) + len(capped.token_ids) == 64
    _assert_no_leaks(s)


def test_abort_frees_blocks_at_the_next_step(engine):
    s = _serving(engine, num_blocks=64)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:2]]
    s.add_request(prompts[0], SamplingParams(max_tokens=50, ignore_eos=True), request_id="keep")
    s.add_request(prompts[1], SamplingParams(max_tokens=50, ignore_eos=True), request_id="drop")
    s.step()
    held = len(s.kv.block_table("drop"))
    free_before = s.kv.pool.num_free
    s.abort("drop")
    s.abort("unknown")  # ignored
    outs = s.step()
    dropped = [o for o in outs if o.request_id == "drop"]
    assert len(dropped) == 1 and dropped[0].finished and dropped[0].finish_reason == "abort"
    assert "drop" not in s.kv
    # "keep" may have taken one more block for its new token in the same step
    assert s.kv.pool.num_free >= free_before + held - 1
    while s.has_unfinished:
        s.step()
    _assert_no_leaks(s)


def test_timeout_finishes_the_request(engine):
    s = _serving(engine, num_blocks=64, request_timeout_s=0.05)
    s.add_request(engine.tokenizer.encode(PROMPTS[0]), SamplingParams(max_tokens=400, ignore_eos=True),
                  request_id="slow")
    outs = []
    deadline = time.monotonic() + 30
    while s.has_unfinished and time.monotonic() < deadline:
        outs += s.step()
    final = [o for o in outs if o.finished]
    assert len(final) == 1 and final[0].finish_reason == "timeout" and "timeout" in final[0].error
    _assert_no_leaks(s)


def test_bad_requests_change_nothing(engine):
    s = _serving(engine, num_blocks=40, max_waiting=1, max_seq_len=256)
    with pytest.raises(RequestError, match="max_seq_len is 256"):
        s.add_request(list(range(5, 261)))
    with pytest.raises(RequestError, match="empty"):
        s.add_request([])
    with pytest.raises(RequestError, match=r"\[0, 4096\)"):
        s.add_request([1, 2, 99999])
    s.add_request([1, 2, 3], SamplingParams(max_tokens=2), request_id="one")
    with pytest.raises(QueueFullError):
        s.add_request([1, 2, 3])
    assert s.scheduler.num_unfinished == 1
    s.run([])  # nothing to add: runs nothing
    while s.has_unfinished:
        s.step()
    _assert_no_leaks(s)


def test_memory_plan(engine):
    layout = engine.kv_layout
    # per block: 16 tokens x layers x (K + V) x kv_heads x head_dim x 4 bytes (fp32)
    per_block = 16 * sum(2 * h * d * 4 for h, d in zip(layout.num_kv_heads, layout.head_dim))
    s = _serving(engine, kv_cache_bytes=100 * per_block + 5)
    plan = s.memory_plan
    assert plan.bytes_per_block == per_block and plan.num_blocks == 100
    assert s.kv.pool.num_blocks == 100 and s.storage.bytes() == 100 * per_block
    assert plan.max_concurrency == pytest.approx(100 / (512 / 16))
    assert "100 blocks" in plan.describe()
    with pytest.raises(MemoryPlanError, match="max_seq_len 512 needs 32 blocks"):
        _serving(engine, kv_cache_bytes=31 * per_block)
    assert _serving(engine, num_blocks=8, max_seq_len=128).kv.pool.num_blocks == 8
    with pytest.raises(ValueError, match="above the artifact's 512"):
        _serving(engine, max_seq_len=1024)


def test_a_cpu_plan_past_the_machines_memory_is_refused(engine, monkeypatch):
    """On CPU the plan is what it asks for (weights, a workspace sized by max_num_seqs and max_num_batched_tokens,
    the KV budget): one past this machine's memory is refused, naming the parts, instead of logging a plan it cannot
    hold (max_num_seqs 10**12 planned a 15 TB workspace)."""
    from runtime import memory

    assert _serving(engine).kv.pool.num_blocks > 0  # the default plan fits
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 64 << 20)  # a 64 MiB machine
    with pytest.raises(MemoryPlanError, match=r"the CPU memory plan needs [\d.]+ GiB \(weights .* workspace .* KV "
                                              r"cache 1\.00 GiB\): more than this machine's 0\.1 GiB of memory\. "
                                              r"Lower max_num_seqs"):
        _serving(engine)
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 0)  # unknown: not refused
    assert _serving(engine).kv.pool.num_blocks > 0


def test_the_engine_builds_the_streaming_table_when_it_loads(engine):
    """The bundled (byte-level) tokenizer's byte table for streaming is built with the engine, not in its first
    request."""
    assert engine.tokenizer._token_bytes is not False and engine.tokenizer.token_bytes() is not None


def test_tokens_per_block_overrides_the_artifacts(engine, monkeypatch):
    """Serving with 64-token blocks (the artifact's are 16): the pool, the storage and the plan use them, the
    tokens match one-at-a-time generation through preemption and a prefix-cache hit of a whole block, no block
    leaks; the environment sets the default; a value that is not a power of two (or a bool) is refused."""
    assert engine.limits.tokens_per_block == 16
    s = _serving(engine, num_blocks=4, max_seq_len=192, max_num_batched_tokens=64, max_num_seqs=4, tokens_per_block=64)
    assert s.block_size == s.storage.block_size == s.kv.block_size == 64 and s.memory_plan.block_size == 64
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=60, ignore_eos=True)  # every sequence past its first block
    outs = s.run(prompts, params)
    assert s.scheduler.num_preemptions > 0, "4 blocks of 64 tokens were meant to force preemption"
    for prompt, out in zip(prompts, outs):
        _assert_same_greedy(engine, prompt, out, engine.generate(prompt, params))
    _assert_no_leaks(s)
    # a prompt sharing a whole 64-token block with one served before it reads that block from the prefix cache
    hits = s.kv.stats.hits
    s.run([prompts[2]], params)
    shared = prompts[2][:64] + prompts[3]
    out, = s.run([shared], params)
    assert s.kv.stats.hits - hits >= 64, "the shared 64-token block was not reused"
    _assert_same_greedy(engine, shared, out, engine.generate(shared, params))
    _assert_no_leaks(s)
    monkeypatch.setenv("RUNTIME_TOKENS_PER_BLOCK", "32")
    assert ServingConfig().tokens_per_block == 32 and ServingConfig(tokens_per_block=128).tokens_per_block == 128
    monkeypatch.delenv("RUNTIME_TOKENS_PER_BLOCK")
    assert ServingConfig().tokens_per_block is None  # the artifact's
    for bad in (0, 48, 2048, True):
        with pytest.raises(ValueError, match=f"tokens_per_block {bad} must be a power of two from 1 to 1024"):
            ServingConfig(tokens_per_block=bad)


@pytest.mark.parametrize("field, value, says", [
    ("max_waiting", 0, "max_waiting must be a whole number >= 1, got 0"),  # admitted nothing: run() spun forever
    ("max_num_seqs", 2.5, "max_num_seqs must be a whole number >= 1, got 2.5"),
    ("max_seq_len", True, "max_seq_len must be a whole number >= 1, got True"),
    ("request_timeout_s", float("nan"), "request_timeout_s must be > 0 seconds"),  # never timed out
    # inf held every new prompt for as long as any request decoded (`serve --prefill-hold-ms inf` was accepted)
    ("prefill_hold_ms", float("inf"), "prefill_hold_ms must be in 0..60000 ms, got inf"),
    ("prefill_hold_ms", float("nan"), "prefill_hold_ms must be in 0..60000 ms, got nan"),
    ("prefill_hold_ms", -1.0, "prefill_hold_ms must be in 0..60000 ms, got -1.0"),
])
def test_serving_config_refuses_values_that_would_serve_wrongly(field, value, says):
    from runtime.serving import ServingConfig

    with pytest.raises(ValueError, match=re.escape(says)):
        ServingConfig(**{field: value})


def test_prefill_graph_tokens_from_the_environment_and_checked(monkeypatch):
    from runtime.serving import ServingConfig

    assert ServingConfig().prefill_graph_tokens == 2048
    monkeypatch.setenv("RUNTIME_PREFILL_GRAPH_TOKENS", "0")
    assert ServingConfig().prefill_graph_tokens == 0  # eager prefill (A/B measurements)
    with pytest.raises(ValueError, match="prefill_graph_tokens must be >= 0, got -1"):
        ServingConfig(prefill_graph_tokens=-1)
    monkeypatch.setenv("RUNTIME_PREFILL_GRAPH_TOKENS", "lots")
    with pytest.raises(ValueError, match="RUNTIME_PREFILL_GRAPH_TOKENS='lots' is not a whole number"):
        ServingConfig()


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_quantized_kv_cache_pages_like_the_contiguous_cache(checkpoints, tmp_path, kind):
    from builder.pipeline import build
    from builder.recipe import validate_recipe

    recipe = validate_recipe({
        "model": {"checkpoint": str(checkpoints["llama"])}, "output_dir": str(tmp_path / kind),
        "runtime": {"max_seq_len": 256, "max_num_tokens": 32, "kv_cache_dtype": kind},
        "calibration": {"num_samples": 4, "seq_len": 32, "dataset": "bundled"}, "gates": {"enabled": False}})
    engine = Engine.load(build(recipe).output_dir)
    storage = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}[kind]
    s = _serving(engine, num_blocks=24)
    assert all(t.dtype == storage for t in s.storage.k + s.storage.v)
    prompts = [engine.tokenizer.encode(PROMPTS[i]) for i in (0, 1, 3)]
    params = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=0)
    for prompt, out in zip(prompts, s.run(prompts, params)):
        ref = engine.generate(prompt, params)
        assert out.token_ids == ref.token_ids
        got = torch.tensor([lp.logprob for lp in out.logprobs])
        assert torch.allclose(got, torch.tensor(ref.logprobs), atol=1e-4)
    _assert_no_leaks(s)
