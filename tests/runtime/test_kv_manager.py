"""KVCacheManager: per-request block tables, prefix sharing of full blocks, failure without side effects."""

from __future__ import annotations

import pytest

from runtime.block_pool import BlockPool, hash_block
from runtime.kv_manager import KVCacheManager

BS = 4
PREFIX = [10, 11, 12, 13, 14, 15, 16, 17]  # two full blocks


def _manager(num_blocks: int, **kw) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks), BS, **kw)


def _admit(m: KVCacheManager, rid: str, tokens: list[int]):
    blocks, num_computed = m.get_computed_blocks(rid, tokens)
    new = m.allocate_slots(rid, tokens, len(tokens) - num_computed, blocks)
    return blocks, num_computed, new


def _pool_state(pool: BlockPool):
    return (pool.free_queue.block_ids(), [b.ref_cnt for b in pool.blocks], [b.block_hash for b in pool.blocks],
            dict(pool._cached))


def test_shared_prefix_shares_exactly_the_full_blocks():
    m = _manager(10)
    a = PREFIX + [20, 21]  # 2 full blocks + a partial one
    blocks, n, new = _admit(m, "a", a)
    assert (blocks, n) == ([], 0)
    assert [b.block_id for b in new] == [0, 1, 2]
    assert m.block_table("a") == [0, 1, 2] and m.num_tokens("a") == 10
    pool = m.pool
    h0 = hash_block(None, PREFIX[:4])
    h1 = hash_block(h0, PREFIX[4:])
    assert pool.blocks[0].block_hash == h0 and pool.blocks[1].block_hash == h1
    assert pool.blocks[2].block_hash is None  # partly filled: never cached

    b = PREFIX + [30, 31, 32]
    blocks, n, new = _admit(m, "b", b)
    assert [x.block_id for x in blocks] == [0, 1] and n == 8
    assert [x.block_id for x in new] == [3]
    assert m.block_table("b") == [0, 1, 3] and m.num_tokens("b") == 11
    assert [x.ref_cnt for x in pool.blocks[:4]] == [2, 2, 1, 1]

    # the same 10 tokens as "a": its partial block 2 holds tokens 8, 9 but is not shared
    blocks, n = m.get_computed_blocks("c", a)
    assert [x.block_id for x in blocks] == [0, 1] and n == 8
    # a prompt that is exactly the cached prefix still leaves its last token to compute
    blocks, n = m.get_computed_blocks("d", PREFIX)
    assert [x.block_id for x in blocks] == [0] and n == 4
    blocks, n = m.get_computed_blocks("e", PREFIX + [99])
    assert [x.block_id for x in blocks] == [0, 1] and n == 8
    assert [x.ref_cnt for x in pool.blocks[:4]] == [2, 2, 1, 1]  # lookups take no references


def test_third_request_reuses_cached_blocks_after_both_freed():
    m = _manager(10)
    _admit(m, "a", PREFIX + [20, 21])  # blocks 0, 1, 2
    _admit(m, "b", PREFIX + [30, 31, 32])  # blocks 0, 1 (shared), 3
    live_table = m.block_table("a")
    m.free("a")
    assert live_table == [] and "a" not in m
    assert m.pool.free_queue.block_ids() == [4, 5, 6, 7, 8, 9, 2]
    m.free("b")  # tail first: 3, then the shared blocks 1, 0 reach zero
    assert m.pool.free_queue.block_ids() == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]
    m.free("b")  # unknown: ignored

    blocks, n, new = _admit(m, "c", PREFIX + [20, 21])
    assert [x.block_id for x in blocks] == [0, 1] and n == 8
    assert [x.block_id for x in new] == [4]
    assert m.block_table("c") == [0, 1, 4]
    assert m.pool.free_queue.block_ids() == [5, 6, 7, 8, 9, 2, 3]
    assert [m.pool.blocks[i].ref_cnt for i in (0, 1, 4)] == [1, 1, 1]


def test_allocate_slots_returns_none_under_pressure_and_changes_nothing():
    m = _manager(4)
    _admit(m, "a", list(range(12)))  # blocks 0, 1, 2: one left
    before, stats = _pool_state(m.pool), (m.stats.requests, m.stats.queries, m.stats.hits)
    assert m.allocate_slots("b", list(range(100, 109)), 9) is None
    assert _pool_state(m.pool) == before and "b" not in m
    assert (m.stats.requests, m.stats.queries, m.stats.hits) == stats
    # a running request that cannot grow keeps what it had
    assert m.allocate_slots("a", list(range(12)) + [1, 2, 3, 4, 5], 5) is None
    assert m.block_table("a") == [0, 1, 2] and m.num_tokens("a") == 12
    assert _pool_state(m.pool) == before
    assert [x.block_id for x in m.allocate_slots("a", list(range(13)), 1)] == [3]
    assert m.allocate_slots("a", list(range(14)), 1) == []  # still room in block 3
    assert m.pool.num_free == 0


def test_free_cached_hits_count_against_the_free_blocks():
    """Computed blocks with ref_cnt 0 sit in the free queue: reviving them uses free blocks."""
    m = _manager(5)
    _admit(m, "a", PREFIX)  # 8 tokens: blocks 0, 1, both full and cached
    others = m.pool.allocate(3)  # 2, 3, 4
    m.free("a")
    assert m.pool.free_queue.block_ids() == [1, 0]
    blocks, n = m.get_computed_blocks("b", PREFIX + [7])
    assert [x.block_id for x in blocks] == [0, 1] and n == 8
    before = _pool_state(m.pool)
    assert m.allocate_slots("b", PREFIX + [7], 1, blocks) is None  # needs both free blocks + 1 more
    assert _pool_state(m.pool) == before
    # with a block freed after them, the hits must be taken before allocating (else block 1 is evicted)
    m.pool.free([others[2]])
    assert m.pool.free_queue.block_ids() == [1, 0, 4]
    new = m.allocate_slots("b", PREFIX + [7], 1, blocks)
    assert [x.block_id for x in new] == [4]
    assert m.block_table("b") == [0, 1, 4]
    assert m.pool.lookup(hash_block(None, PREFIX[:4])) is m.pool.blocks[0]


def test_stale_computed_blocks_are_rejected():
    m = _manager(3)
    _admit(m, "a", PREFIX)
    m.free("a")  # queue [2, 1, 0]
    blocks, _ = m.get_computed_blocks("b", PREFIX + [1])
    m.pool.allocate(3)  # evicts both cached blocks
    with pytest.raises(ValueError):
        m.allocate_slots("b", PREFIX + [1], 1, blocks)


def test_hash_chain_differs_when_an_earlier_block_differs():
    m = _manager(10)
    a = PREFIX + [1]
    b = [99] + PREFIX[1:] + [1]  # first block differs, second block has the same tokens
    _admit(m, "a", a)
    blocks, n, _ = _admit(m, "b", b)
    assert (blocks, n) == ([], 0)
    ha = [m.pool.blocks[i].block_hash for i in m.block_table("a")[:2]]
    hb = [m.pool.blocks[i].block_hash for i in m.block_table("b")[:2]]
    assert ha[0] != hb[0] and ha[1] != hb[1]  # block 1 differs through its parent
    assert m.block_table("a") == [0, 1, 2] and m.block_table("b") == [3, 4, 5]
    # a per-request extra (e.g. a LoRA id) separates otherwise equal prefixes
    blocks, n = m.get_computed_blocks("c", a, extra=("lora", 7))
    assert (blocks, n) == ([], 0)
    new = m.allocate_slots("c", a, len(a), extra=("lora", 7))
    assert [x.block_id for x in new] == [6, 7, 8]
    blocks, n = m.get_computed_blocks("d", a, extra=("lora", 7))
    assert [x.block_id for x in blocks] == [6, 7] and n == 8
    # and a manager-wide extra (e.g. the KV dtype) gives a different chain again
    m2 = KVCacheManager(m.pool, BS, hash_extra=("fp8",))
    assert m2.get_computed_blocks("e", a) == ([], 0)


def test_hit_rate_counters():
    m = _manager(10)
    _admit(m, "a", PREFIX + [20, 21])  # 10 tokens, no hits
    assert (m.stats.requests, m.stats.queries, m.stats.hits) == (1, 10, 0)
    # a request that cannot be admitted is not counted, however often it is looked up
    m.get_computed_blocks("big", PREFIX + list(range(40)))
    m.get_computed_blocks("big", PREFIX + list(range(40)))
    _admit(m, "b", PREFIX + [30, 31, 32])  # 11 tokens, 8 from the cache
    assert (m.stats.requests, m.stats.queries, m.stats.hits) == (2, 21, 8)
    assert m.stats.hit_rate == pytest.approx(8 / 21)
    # block lookups at the pool: a: 1 miss; big: 2 hits + 1 miss, twice; b: 2 hits
    assert (m.pool.num_queries, m.pool.num_hits) == (1 + 6 + 2, 4 + 2)
    old = m.reset_stats()
    assert old.hits == 8 and m.stats.queries == 0 and m.stats.hit_rate == 0.0


def test_decode_growth_caches_blocks_as_they_fill():
    m = _manager(6)
    tokens = PREFIX + [20, 21]
    _admit(m, "a", tokens)
    table = m.block_table("a")
    for t in (22, 23):  # block 2 fills at 12 tokens
        tokens.append(t)
        assert m.allocate_slots("a", tokens, 1) == []
    assert m.pool.blocks[2].block_hash == hash_block(m.pool.blocks[1].block_hash, [20, 21, 22, 23])
    tokens.append(24)
    assert [x.block_id for x in m.allocate_slots("a", tokens, 1)] == [3]
    assert table is m.block_table("a") and table == [0, 1, 2, 3]  # the same live list, appended to
    assert m.num_tokens("a") == 13 and m.pool.blocks[3].block_hash is None
    # chunked prefill: positions are taken as given, blocks cached only when full
    m.allocate_slots("p", list(range(100, 110)), 6)
    assert m.block_table("p") == [4, 5] and m.pool.blocks[4].block_hash is not None
    assert m.pool.blocks[5].block_hash is None
    assert m.allocate_slots("p", list(range(100, 110)), 4) is None  # needs a third block: none left
    assert m.num_tokens("p") == 6


def test_lookahead_slots_are_reserved_not_cached():
    m = _manager(6)
    new = m.allocate_slots("a", PREFIX, 8, num_lookahead_tokens=3)
    assert [x.block_id for x in new] == [0, 1, 2]
    assert m.num_tokens("a") == 8 and m.pool.blocks[2].block_hash is None
    assert m.allocate_slots("a", PREFIX + [1, 2, 3], 3) == []  # the reserved block covers them


def test_duplicate_blocks_from_the_same_step_stay_private():
    m = _manager(8)
    a = PREFIX + [1]
    assert m.get_computed_blocks("a", a) == ([], 0)
    assert m.get_computed_blocks("c", a) == ([], 0)  # both looked up before either allocated
    m.allocate_slots("a", a, len(a))
    m.allocate_slots("c", a, len(a))
    assert m.block_table("a") == [0, 1, 2] and m.block_table("c") == [3, 4, 5]
    assert m.pool.blocks[3].block_hash is None  # block 0 is the cached copy
    m.free("c")
    assert m.get_computed_blocks("d", a)[0] == [m.pool.blocks[0], m.pool.blocks[1]]


def test_prefix_caching_off():
    m = _manager(6, enable_prefix_caching=False)
    _admit(m, "a", PREFIX + [1])
    assert m.get_computed_blocks("b", PREFIX + [1]) == ([], 0)
    assert all(b.block_hash is None for b in m.pool.blocks) and m.pool.num_cached == 0
    m.free("a")
    assert m.pool.free_queue.block_ids() == [3, 4, 5, 2, 1, 0]
