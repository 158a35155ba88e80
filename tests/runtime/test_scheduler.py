"""Scheduler: budgets, chunked prefill, decode-first packing, preemption and resume, admission control,
with exact block ids (block size 4, tiny pools)."""

from __future__ import annotations

import pytest

from runtime.block_pool import BlockPool
from runtime.kv_manager import KVCacheManager
from runtime.sampling import SamplingParams
from runtime.scheduler import QueueFullError, Request, RequestStatus, Scheduler, SchedulerConfig

BS = 4


def _scheduler(num_blocks: int, max_num_batched_tokens: int = 32, max_num_seqs: int = 4, max_seq_len: int = 64,
               max_waiting: int = 8) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks), BS)
    return Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_seq_len, max_waiting), kv)


def _add(s: Scheduler, rid: str, prompt: list[int], max_tokens: int = 4) -> Request:
    r = Request(rid, prompt, SamplingParams(max_tokens=max_tokens))
    s.add_request(r)
    return r


def _step(s: Scheduler, next_token: int = 7) -> list[tuple[str, int, int]]:
    """Schedule, pretend the step ran, append ``next_token`` to every request that sampled.
    Returns the pack as (request id, num_context, num_new)."""
    out = s.schedule()
    s.update(out, {q.request.request_id: next_token for q in out.seqs if q.samples})
    return [(q.request.request_id, q.num_context, q.num_new) for q in out.seqs]


def _finish_all(s: Scheduler) -> None:
    for rid in [r.request_id for r in list(s.running) + list(s.waiting)]:
        s.finish_request(rid)
    assert s.kv.pool.num_free == s.kv.pool.num_blocks, "blocks leaked"
    assert s.kv.num_requests == 0


def test_chunked_prefill_then_decodes_first():
    s = _scheduler(16, max_num_batched_tokens=8)
    a = _add(s, "a", list(range(100, 110)))  # 10 tokens: more than one step's budget
    _add(s, "b", [200, 201, 202])
    assert _step(s) == [("a", 0, 8)]  # a takes the whole budget; b waits
    assert s.kv.block_table("a") == [0, 1] and "b" not in s.kv
    assert a.num_output_tokens == 0  # a chunk that does not reach the prompt's end samples nothing

    assert _step(s) == [("a", 8, 2), ("b", 0, 3)]  # a finishes its prompt, b is admitted in the same step
    assert s.kv.block_table("a") == [0, 1, 2] and s.kv.block_table("b") == [3]
    assert a.output_token_ids == [7] and s.get("b").output_token_ids == [7]

    _add(s, "c", list(range(300, 312)))  # 12 tokens
    assert _step(s) == [("a", 10, 1), ("b", 3, 1), ("c", 0, 6)]  # decodes, then c's first chunk
    assert s.kv.block_table("b") == [3] and s.kv.block_table("c") == [4, 5]  # b's 4 tokens fill block 3
    assert _step(s) == [("a", 11, 1), ("b", 4, 1), ("c", 6, 6)]
    assert s.kv.block_table("a") == [0, 1, 2]  # 12 tokens fit the 3 blocks a has
    assert s.kv.block_table("b") == [3, 6] and s.kv.block_table("c") == [4, 5, 7]
    _finish_all(s)


def test_max_num_seqs_bounds_the_running_batch():
    s = _scheduler(16, max_num_seqs=2)
    for rid in "abc":
        _add(s, rid, [1, 2, 3])
    assert [q[0] for q in _step(s)] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]
    s.finish_request("a")
    assert [q[0] for q in _step(s)] == ["b", "c"]
    _finish_all(s)


def test_no_step_runs_more_sequences_than_the_token_budget():
    """A step feeds at least one token a sequence within max_num_batched_tokens, so a running batch larger than the
    budget decodes in turns and no step holds more sequences than the budget: what sizes the largest decode CUDA
    graph (runtime.cuda_graphs.decode_graph_batch), whatever max_num_seqs allows to run."""
    from runtime.cuda_graphs import decode_graph_batch

    s = _scheduler(64, max_num_batched_tokens=5, max_num_seqs=10**12, max_waiting=16)
    for i in range(12):
        _add(s, f"r{i}", [1, 2], max_tokens=6)
    widths, ran = [], set()
    while s.running or s.waiting:
        pack = _step(s)
        widths.append(len(pack))
        ran |= {rid for rid, _, _ in pack}
        for r in [r for r in s.running if r.num_output_tokens >= 6]:
            s.finish_request(r.request_id)
    assert max(widths) == 5 and len(ran) == 12  # every request ran, at most 5 a step
    assert decode_graph_batch(10**12, 5) == 5 and decode_graph_batch(3, 8192) == 3
    assert s.kv.pool.num_free == s.kv.pool.num_blocks


def test_preempts_the_newest_request_and_recomputes_it_from_the_prefix_cache():
    s = _scheduler(5)
    _add(s, "a", list(range(10, 18)))  # 8 tokens: blocks 0, 1
    c = _add(s, "c", list(range(50, 59)))  # 9 tokens: blocks 2, 3 (full, cached) and 4 (one token)
    assert _step(s) == [("a", 0, 8), ("c", 0, 9)]
    assert s.kv.block_table("a") == [0, 1] and s.kv.block_table("c") == [2, 3, 4]

    # a's 9th token needs a block; none is free, so c (admitted last, not scheduled yet) is preempted,
    # its blocks freed tail first, and a takes the head of the free queue: c's partial block 4
    out = s.schedule()
    assert [r.request_id for r in out.preempted] == ["c"]
    assert [(q.request.request_id, q.num_context, q.num_new) for q in out.seqs] == [("a", 8, 1)]
    assert s.kv.block_table("a") == [0, 1, 4]
    assert s.kv.pool.free_queue.block_ids() == [3, 2]
    assert c.status is RequestStatus.WAITING and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert list(s.waiting) == [c] and s.num_preemptions == 1
    assert c.output_token_ids == [7]  # its generated token is kept and recomputed with the prompt
    s.update(out, {"a": 7})

    s.finish_request("a")  # frees 4, 1, 0 (tail first) behind c's cached blocks 3, 2
    assert s.kv.pool.free_queue.block_ids() == [3, 2, 4, 1, 0]
    # c resumes: its 10 tokens' two full blocks are still cached (2, 3), so only 2 tokens are recomputed
    assert _step(s) == [("c", 8, 2)]
    assert s.kv.block_table("c") == [2, 3, 4]
    assert c.output_token_ids == [7, 7]
    assert c.num_cached_tokens == 0  # reported for its first admission, not the recompute
    stats = s.kv.stats  # each request counted once: the recompute's 8 cache hits are not prefix-cache hits
    assert (stats.requests, stats.queries, stats.hits) == (2, 8 + 9, 0)
    _finish_all(s)


def test_preempted_request_is_not_overtaken_by_new_ones():
    s = _scheduler(4, max_num_batched_tokens=64)
    _add(s, "a", list(range(8)))  # blocks 0, 1
    _add(s, "b", list(range(20, 28)))  # blocks 2, 3
    _step(s)
    _add(s, "new", [90, 91])
    out = s.schedule()  # a needs a third block: b is preempted; nothing new is admitted this step
    assert [r.request_id for r in out.preempted] == ["b"]
    assert [q.request.request_id for q in out.seqs] == ["a"]
    assert [r.request_id for r in s.waiting] == ["b", "new"]
    s.update(out, {"a": 7})
    _finish_all(s)


def test_a_request_preempts_itself_when_it_is_the_newest():
    s = _scheduler(4, max_num_batched_tokens=64)
    _add(s, "a", list(range(7)))  # blocks 0, 1; after one token, 8 tokens still fit them
    _add(s, "b", list(range(20, 28)))  # blocks 2, 3; its 9th token needs a third block
    _step(s)
    out = s.schedule()  # a is scheduled first; b then finds no block and is the newest unscheduled
    assert [q.request.request_id for q in out.seqs] == ["a"]
    assert [r.request_id for r in out.preempted] == ["b"]
    assert s.kv.pool.free_queue.block_ids() == [3, 2]
    s.update(out, {"a": 7})
    _finish_all(s)


def test_same_step_prefix_hit_is_packed_after_the_request_that_fills_it():
    s = _scheduler(16)
    prefix = list(range(60, 68))  # two full blocks
    _add(s, "a", prefix + [1])
    _add(s, "b", prefix + [2, 3])
    assert _step(s) == [("a", 0, 9), ("b", 8, 2)]  # b computes only its own 2 tokens ...
    assert s.kv.block_table("a") == [0, 1, 2] and s.kv.block_table("b") == [0, 1, 3]  # ... reading a's blocks
    assert s.get("b").num_cached_tokens == 8
    _finish_all(s)


def test_admission_control():
    s = _scheduler(8, max_waiting=2, max_seq_len=16)
    _add(s, "a", [1, 2])
    _add(s, "b", [1, 2])
    with pytest.raises(QueueFullError, match="max_waiting 2"):
        _add(s, "c", [1, 2])
    assert not s.has_capacity
    _step(s)  # a and b start running: the queue has room again
    assert s.has_capacity
    _add(s, "c", [1, 2])
    with pytest.raises(ValueError, match="already in use"):
        _add(s, "c", [3])
    with pytest.raises(ValueError, match="max_seq_len is 16"):
        _add(s, "long", list(range(16)))
    with pytest.raises(ValueError, match="empty"):
        _add(s, "empty", [])
    _finish_all(s)


def test_a_request_larger_than_the_pool_is_refused_at_admission():
    s = _scheduler(2, max_seq_len=64)  # 8 slots
    with pytest.raises(ValueError, match="needs up to 3 KV blocks; the pool has 2"):
        _add(s, "a", list(range(6)), max_tokens=4)
    _add(s, "b", list(range(6)), max_tokens=2)  # 8 tokens at most: fits
    _finish_all(s)


def test_finishing_a_waiting_or_running_request_frees_everything():
    s = _scheduler(8, max_num_batched_tokens=4)
    _add(s, "a", list(range(10)))
    _add(s, "b", [5, 6])
    _step(s)  # a's first chunk
    assert s.kv.pool.num_free == 7
    assert s.finish_request("b").status is RequestStatus.FINISHED  # still waiting
    assert s.finish_request("a").status is RequestStatus.FINISHED  # running, mid-prefill
    assert s.finish_request("a") is None
    assert s.kv.pool.num_free == 8 and s.num_unfinished == 0
    assert s.has_capacity and s.schedule().empty


def test_prefill_hold_batches_new_prompts_while_requests_decode():
    kv = KVCacheManager(BlockPool(64), BS)
    s = Scheduler(SchedulerConfig(8, 64, 64, 8, prefill_hold_s=5.0, prefill_hold_tokens=10,
                                  prefill_hold_min_running=2), kv)
    for rid in ("a", "b"):
        _add(s, rid, [1, 2, 3], max_tokens=20)
    assert [q[0] for q in _step(s)] == ["a", "b"]  # an empty batch: admitted at once, whatever the hold
    c = _add(s, "c", [4, 5, 6])
    assert not s.admits_now(c.arrival_time + 4.9)
    assert _step(s) == [("a", 3, 1), ("b", 3, 1)]  # decode-only: c waits (3 tokens < 10, well under 5 s)
    assert s.admits_now(c.arrival_time + 5.0)  # the hold runs out
    d = _add(s, "d", list(range(10, 17)))  # 3 + 7 tokens waiting reach prefill_hold_tokens: both go now
    assert s.admits_now(d.arrival_time)
    assert _step(s) == [("a", 4, 1), ("b", 4, 1), ("c", 0, 3), ("d", 0, 7)]
    _finish_all(s)


def test_prefill_hold_does_not_apply_to_a_small_batch_or_when_off():
    for kwargs in ({"prefill_hold_s": 10.0, "prefill_hold_tokens": 100, "prefill_hold_min_running": 3}, {}):
        s = Scheduler(SchedulerConfig(8, 64, 64, 8, **kwargs), KVCacheManager(BlockPool(64), BS))
        for rid in ("a", "b"):
            _add(s, rid, [1, 2, 3], max_tokens=20)
        _step(s)
        _add(s, "c", [4, 5, 6])
        assert [q[0] for q in _step(s)] == ["a", "b", "c"]  # 2 running < 3 (or no hold): c is admitted at once
        _finish_all(s)
    with pytest.raises(ValueError, match="prefill_hold"):
        SchedulerConfig(8, 64, 64, 8, prefill_hold_s=-1)
