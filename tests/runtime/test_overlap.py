"""The overlapped decode pipeline of ServingEngine (a graph decode step launched before the host reads
the previous step's tokens): same tokens as the synchronous path, no KV leaks, length limits never
overrun, stop tokens discard the step already in flight, aborts in the middle, pipeline drains.

CUDA graphs need a GPU, so the pipeline runs here over a stand-in with DecodeGraphs' interface that
executes the same decode step eagerly on the CPU (feeding it the device-side token tensor, as the real
graphs do). The real graphs are checked on the GPU by builder.devtools.cuda_smoke.
"""

from __future__ import annotations

import pytest
import torch

from runtime import Engine, SamplingParams
from runtime.executor import SeqSlice, StepInput
from runtime.paged_kv import PagedSequenceKV
from runtime.serving import ServingConfig, ServingEngine


class EagerGraphs:
    """DecodeGraphs' interface (bucket_for, run, close), running the one-token-per-sequence step eagerly."""

    def __init__(self, serving: ServingEngine, max_bucket: int) -> None:
        self.serving, self.max_bucket = serving, max_bucket
        self.num_runs = 0
        self.num_device_inputs = 0  # steps fed with the previous step's sampled tokens, still a tensor

    def bucket_for(self, num_seqs: int) -> int | None:
        return num_seqs if num_seqs <= self.max_bucket else None

    def close(self) -> None:
        self.closed = True

    def run(self, input_ids, positions, slots, tables) -> torch.Tensor:
        s = self.serving
        self.num_runs += 1
        if isinstance(input_ids, torch.Tensor):
            self.num_device_inputs += 1
            ids = input_ids.clone()
        else:
            ids = torch.tensor(input_ids, dtype=torch.long)
        for p, slot, table in zip(positions, slots, tables):  # the slot the engine computed is the table's
            assert slot == table[p // s.block_size] * s.block_size + p % s.block_size
        seqs = [SeqSlice(PagedSequenceKV(s.storage, list(table), p), p, 1) for p, table in zip(positions, tables)]
        inp = StepInput(ids, torch.tensor(positions, dtype=torch.long), seqs, torch.arange(len(positions)))
        return s.executor.forward(inp)


@pytest.fixture(scope="module")
def engine(bundled_artifact) -> Engine:
    return Engine.load(bundled_artifact)


def _pair(engine: Engine, **config) -> tuple[ServingEngine, ServingEngine, EagerGraphs]:
    sync = ServingEngine(engine, ServingConfig(**config))
    overlapped = ServingEngine(engine, ServingConfig(**config))
    overlapped.graphs = graphs = EagerGraphs(overlapped, overlapped.scheduler_config.max_num_seqs)
    replay = overlapped._replay

    def checked_replay(sched, input_ids=None):
        for q in sched.seqs:  # never a step past the last token a request may sample (max_tokens)
            r = q.request
            assert q.num_context <= r.num_prompt_tokens + r.params.max_tokens - 2, "computed past max_tokens"
        return replay(sched, input_ids)

    overlapped._replay = checked_replay
    return sync, overlapped, graphs


def _assert_no_leaks(s: ServingEngine) -> None:
    assert s.scheduler.num_unfinished == 0 and s._inflight is None
    assert s.kv.pool.num_free == s.kv.pool.num_blocks
    assert s.kv.num_requests == 0


def _prompts(engine: Engine, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    vocab = int(engine.executor.graph["meta"]["vocab_size"])
    return [torch.randint(3, vocab, (int(torch.randint(5, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_overlapped_decode_gives_the_synchronous_tokens(engine):
    sync, overlapped, graphs = _pair(engine, num_blocks=64, max_num_seqs=6, max_seq_len=128)
    prompts = _prompts(engine, 9, seed=1)  # more than max_num_seqs: admissions drain the pipeline
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (1, 2, 5, 17, 33, 8, 16, 3, 40)]
    params[4] = SamplingParams(max_tokens=33, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    params[6] = SamplingParams(max_tokens=16, temperature=1.0, seed=11, ignore_eos=True)
    want = sync.run(prompts, params)
    got = overlapped.run(prompts, params)
    assert graphs.num_device_inputs > 10, "the pipeline never ran ahead"
    for g, w, p in zip(got, want, params):
        assert g.token_ids == w.token_ids
        assert g.text == w.text
        assert len(g.token_ids) == p.max_tokens and g.finish_reason == "length"
    # a length limit is known ahead: no step ever computes past it, so both engines ran the same tokens
    assert overlapped.kv.stats.hits == sync.kv.stats.hits
    _assert_no_leaks(overlapped)
    # the prefix cache the pipeline left behind serves the same prompts again, with the same results
    again = overlapped.run(prompts, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in want]
    assert overlapped.kv.stats.hits > 0
    _assert_no_leaks(overlapped)


def test_a_stop_token_discards_the_step_in_flight(engine):
    sync, overlapped, graphs = _pair(engine, num_blocks=64, max_num_seqs=4, max_seq_len=128)
    prompts = _prompts(engine, 3, seed=2)
    free_run = sync.run(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    # stop each request on a token it generates mid-way, once it is deep in the pipeline
    params = [SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[o.token_ids[k]])
              for o, k in zip(free_run, (6, 11, 17))]
    want = sync.run(prompts, params)
    got = overlapped.run(prompts, params)
    for g, w, o, k in zip(got, want, free_run, (6, 11, 17)):
        stop = o.token_ids[k]
        assert g.token_ids == w.token_ids == o.token_ids[:o.token_ids.index(stop) + 1]
        assert g.finish_reason == w.finish_reason == "stop"
    assert graphs.num_device_inputs > 5
    _assert_no_leaks(overlapped)


def test_abort_while_a_step_is_in_flight(engine):
    _, s, graphs = _pair(engine, num_blocks=64, max_num_seqs=4, max_seq_len=128)
    prompts = _prompts(engine, 3, seed=3)
    ids = [s.add_request(p, SamplingParams(max_tokens=30, ignore_eos=True)) for p in prompts]
    emitted = {i: [] for i in ids}
    finish = {}
    for _ in range(8):
        for out in s.step():
            emitted[out.request_id] += out.token_ids
    assert s._inflight is not None
    s.abort(ids[1])
    while s.has_unfinished:
        for out in s.step():
            emitted[out.request_id] += out.token_ids
            if out.finished:
                finish[out.request_id] = out.finish_reason
    assert finish[ids[1]] == "abort" and len(emitted[ids[1]]) < 30
    assert len(emitted[ids[0]]) == len(emitted[ids[2]]) == 30
    assert graphs.num_device_inputs > 10
    _assert_no_leaks(s)


def test_logprobs_and_penalties_run_synchronously(engine):
    sync, overlapped, graphs = _pair(engine, num_blocks=64, max_num_seqs=4, max_seq_len=128)
    prompts = _prompts(engine, 2, seed=4)
    for params in (SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2),
                   SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=1.3)):
        want = sync.run(prompts, params)
        got = overlapped.run(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        if params.logprobs is not None:
            assert [len(o.logprobs) for o in got] == [12, 12]
    assert graphs.num_runs > 0 and graphs.num_device_inputs == 0
    _assert_no_leaks(overlapped)


def test_min_tokens_runs_synchronously_until_it_is_met(engine):
    """A request with min_tokens keeps EOS and its stop ids out only while it has fewer tokens, which needs an exact
    count at sampling: the pipeline runs it synchronously until then, and overlaps after. The tokens equal the
    synchronous engine's, and no stop id comes before min_tokens."""
    sync, overlapped, graphs = _pair(engine, num_blocks=64, max_num_seqs=4, max_seq_len=128)
    prompts = _prompts(engine, 3, seed=6)
    firsts = [o.token_ids[0] for o in sync.run(prompts, SamplingParams(max_tokens=1))]
    params = [SamplingParams(max_tokens=30, stop_token_ids=[t], min_tokens=m) for t, m in zip(firsts, (6, 0, 20))]
    want = sync.run(prompts, params)
    got = overlapped.run(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert len(want[1].token_ids) == 1 and want[1].finish_reason == "stop"  # no min_tokens: its first token stops it
    for o, p, t in zip(want, params, firsts):
        assert t not in o.token_ids[:p.min_tokens] and len(o.token_ids) >= p.min_tokens
    assert graphs.num_device_inputs > 0, "the pipeline never ran ahead once min_tokens was met"
    _assert_no_leaks(overlapped)


def _in_flight(engine: Engine, seed: int) -> tuple[ServingEngine, EagerGraphs]:
    """An overlapped engine five steps into two 50-token requests, a decode step in flight."""
    _, s, graphs = _pair(engine, num_blocks=64, max_num_seqs=4, max_seq_len=128)
    for p in _prompts(engine, 2, seed=seed):
        s.add_request(p, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(5):
        s.step()
    assert s._inflight is not None
    return s, graphs


def test_finish_all_drops_the_step_in_flight(engine):
    s, _ = _in_flight(engine, seed=5)
    outs = s.finish_all("abort", "shutting down")
    assert len(outs) == 2 and all(o.finished for o in outs)
    assert not s.has_unfinished
    _assert_no_leaks(s)


def test_close_drops_the_step_in_flight_and_destroys_the_graphs(engine):
    # graphs that recorded NCCL collectives must be destroyed before a tensor-parallel engine leaves its group
    s, graphs = _in_flight(engine, seed=6)
    s.close()
    assert s._inflight is None and s.graphs is None and getattr(graphs, "closed", False)
    s.close()  # twice is fine


def test_prompts_and_chunks_join_the_pipeline(engine):
    """Steps that carry prefill run ahead too: prompts arriving while others decode, long prompts prefilled in
    chunks across launched-ahead steps, prefix-cache hits, a request that fills the sequence slots; the tokens
    equal the synchronous path's, nothing leaks, and launched-ahead steps did carry prompt tokens beside decodes
    fed from the device."""
    config = dict(num_blocks=96, max_num_seqs=4, max_seq_len=128, max_num_batched_tokens=24)
    sync, overlapped, graphs = _pair(engine, **config)
    ahead: list[tuple[int, int]] = []  # (prompt tokens, decodes fed from the device) of steps launched ahead
    run = overlapped._run

    def spy(sched, tokens=None, **kwargs):
        if tokens is not None:
            ahead.append((sum(q.num_new for q in sched.seqs if q.in_flight_row is None),
                          sum(q.in_flight_row is not None for q in sched.seqs)))
        return run(sched, tokens, **kwargs)

    overlapped._run = spy
    prompts = _prompts(engine, 7, seed=8)
    prompts[5] = prompts[1][:20] + prompts[5]  # shares a prefix block with an earlier prompt
    prompts[6] = prompts[6] * 3  # 45-120 tokens: chunks of 24
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (9, 30, 4, 22, 15, 12, 6)]
    params[3] = SamplingParams(max_tokens=22, temperature=0.9, seed=3, ignore_eos=True)

    def staggered(s: ServingEngine) -> dict[int, list[int]]:
        ids: dict[str, int] = {}
        tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
        for step in range(10_000):
            if step % 3 == 0 and len(ids) < len(prompts):  # one arrival every third step
                i = len(ids)
                ids[s.add_request(prompts[i], params[i])] = i
            elif len(ids) == len(prompts) and not s.has_unfinished:
                break
            for out in s.step():
                tokens[ids[out.request_id]] += out.token_ids
        return tokens

    want = staggered(sync)
    got = staggered(overlapped)
    assert got == want
    assert all(len(got[i]) == p.max_tokens for i, p in enumerate(params))
    assert any(p > 0 and d > 0 for p, d in ahead), ahead  # prompt tokens beside device-fed decodes
    assert overlapped.kv.stats.hits == sync.kv.stats.hits > 0
    _assert_no_leaks(overlapped)
