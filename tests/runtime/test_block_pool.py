"""BlockPool: reference counts, LRU free queue, prefix-cache map; hash_block's stability."""

from __future__ import annotations

import pytest
import torch

from runtime.block_pool import BlockPool, FreeBlockQueue, KVBlock, hash_block


def _h(i: int) -> bytes:
    return hash_block(None, [i])


def _snapshot(pool: BlockPool):
    return (pool.free_queue.block_ids(), [b.ref_cnt for b in pool.blocks], [b.block_hash for b in pool.blocks],
            dict(pool._cached), pool.num_free)


def test_allocate_free_and_ref_counts():
    pool = BlockPool(5)
    assert pool.num_free == 5 and pool.usage == 0.0
    a = pool.allocate(2)
    assert [b.block_id for b in a] == [0, 1]
    assert [b.ref_cnt for b in a] == [1, 1]
    assert pool.num_free == 3 and pool.usage == pytest.approx(0.4)
    assert pool.free_queue.block_ids() == [2, 3, 4]

    pool.touch([a[0]])  # a second user of block 0
    assert a[0].ref_cnt == 2
    pool.free(a)
    assert [b.ref_cnt for b in a] == [1, 0]
    assert pool.free_queue.block_ids() == [2, 3, 4, 1]  # only block 1 reached zero
    pool.free([a[0]])
    assert pool.free_queue.block_ids() == [2, 3, 4, 1, 0]
    assert pool.num_free == 5 and pool.usage == 0.0
    with pytest.raises(ValueError):
        pool.free([a[0]])  # double free is a bookkeeping bug, not a return value

    assert [b.block_id for b in pool.allocate(3)] == [2, 3, 4]  # head of the queue first
    assert pool.allocate(0) == []


def test_eviction_order_is_lru_and_tail_first():
    pool = BlockPool(6)
    req_a = pool.allocate(3)  # blocks 0, 1, 2
    req_b = pool.allocate(2)  # blocks 3, 4
    for i, b in enumerate(req_a + req_b):
        assert pool.cache_full_block(b, _h(i))
    # a request frees its blocks tail first: its tail is evicted before its head
    pool.free(reversed(req_a))  # freed earlier -> evicted earlier
    pool.free(reversed(req_b))
    assert pool.free_queue.block_ids() == [5, 2, 1, 0, 4, 3]

    evicted = []
    for _ in range(6):
        (block,) = pool.allocate(1)
        evicted.append(block.block_id)
        assert block.block_hash is None and block.ref_cnt == 1
    assert evicted == [5, 2, 1, 0, 4, 3]
    assert pool.num_evictions == 5 and pool.num_cached == 0


def test_freed_cached_block_is_found_until_evicted():
    pool = BlockPool(4)
    blocks = pool.allocate(2)  # 0, 1
    pool.cache_full_block(blocks[0], _h(0))
    pool.cache_full_block(blocks[1], _h(1))
    pool.free(reversed(blocks))
    assert pool.free_queue.block_ids() == [2, 3, 1, 0]

    # still findable while free
    hit = pool.lookup(_h(0))
    assert hit is blocks[0] and hit.ref_cnt == 0
    # a hit takes it out of the free queue from the middle
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.free_queue.block_ids() == [2, 3, 1]
    pool.free([hit])
    assert pool.free_queue.block_ids() == [2, 3, 1, 0]  # back at the tail: most recently used

    assert [b.block_id for b in pool.allocate(2)] == [2, 3]  # uncached blocks: nothing evicted
    assert pool.lookup(_h(1)) is blocks[1]
    (b,) = pool.allocate(1)  # evicts block 1's contents
    assert b is blocks[1] and b.block_hash is None
    assert pool.lookup(_h(1)) is None
    assert pool.lookup(_h(0)) is blocks[0]
    assert (pool.num_queries, pool.num_hits) == (4, 3)
    assert pool.hit_rate == pytest.approx(0.75)


def test_allocate_returns_none_when_exhausted_and_changes_nothing():
    pool = BlockPool(4)
    held = pool.allocate(2)
    pool.cache_full_block(held[0], _h(0))
    spare = pool.allocate(1)
    pool.cache_full_block(spare[0], _h(2))
    pool.free(spare)  # one cached free block, one uncached free block
    before = _snapshot(pool)
    assert pool.allocate(3) is None
    assert _snapshot(pool) == before
    got = pool.allocate(2)
    assert [b.block_id for b in got] == [3, 2]
    assert pool.allocate(1) is None and pool.num_free == 0 and pool.usage == 1.0
    assert pool.lookup(_h(2)) is None  # evicted by the successful allocation


def test_cache_full_block_rules():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    assert pool.cache_full_block(a, _h(0))
    assert pool.cache_full_block(a, _h(0))  # same hash again: fine
    with pytest.raises(ValueError):
        pool.cache_full_block(a, _h(1))  # a block's contents do not change once full
    assert not pool.cache_full_block(b, _h(0))  # duplicate contents: the first block stays the cached one
    assert b.block_hash is None and pool.lookup(_h(0)) is a
    pool.free([b])
    with pytest.raises(ValueError):
        pool.cache_full_block(b, _h(5))  # free blocks cannot be cached
    assert not pool.reset_prefix_cache()  # block a is in use
    pool.free([a])
    assert pool.reset_prefix_cache() and pool.num_cached == 0 and a.block_hash is None


def test_free_queue_links():
    blocks = [KVBlock(i) for i in range(4)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    q.remove(blocks[0])
    assert q.block_ids() == [1, 3] and len(q) == 2
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    with pytest.raises(ValueError):
        q.remove(blocks[2])
    q.append(blocks[0])
    assert q.popleft() is blocks[1]
    assert q.block_ids() == [3, 0]
    assert "prev_free" not in repr(blocks[3])  # no recursion through the links


def test_hash_block_is_stable_and_content_sensitive():
    h = hash_block(None, [1, 2, 3, 4])
    assert isinstance(h, bytes) and len(h) == 32
    # a golden value: not Python's salted hash(), the same in every process and version
    assert h.hex() == "f4d82efd7317d35563aeab86aaa77369d0f5de5dda1cefd50c7b9b814ddfc102"
    assert hash_block(None, (1, 2, 3, 4)) == h
    assert hash_block(None, torch.tensor([1, 2, 3, 4])) == h
    assert hash_block(h, [5, 6]) != hash_block(None, [5, 6])  # parent matters
    assert hash_block(h, [5, 6]) != hash_block(hash_block(None, [1, 2, 3, 5]), [5, 6])
    assert hash_block(None, [1, 2, 3, 4], (torch.float8_e4m3fn,)) != h  # extra matters
    assert hash_block(None, [1], (1,)) != hash_block(None, [1], ("1",)) != hash_block(None, [1], (True,))
    assert hash_block(None, [1], (("lora", 1),)) == hash_block(None, [1], (["lora", 1],))
    assert hash_block(None, [1, 2]) != hash_block(None, [1, 2], ((),))
    with pytest.raises(TypeError):
        hash_block(None, [1], (object(),))
