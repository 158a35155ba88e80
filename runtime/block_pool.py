"""The KV block pool: fixed-size blocks, their reference counts, and the prefix cache's hash map.

The pool knows blocks only; requests are the manager's business (``runtime.kv_manager``), budgets and
preemption the scheduler's. Every block exists from the start. A block is in exactly one of two states:

    in use:  ref_cnt > 0, not in the free queue
    free:    ref_cnt == 0, in the free queue; if it still carries a block_hash its contents are
             valid and a later request may take it back (``touch``) instead of recomputing it

The free queue is in eviction order: ``allocate`` takes blocks from its head, ``free`` puts blocks at
its tail, so the block freed longest ago is reused (and its cached contents evicted) first - LRU.
The manager frees a request's blocks in reverse, so the tail of a sequence (the least shareable part)
is evicted before its head.

    free queue:  head -> [7] <-> [3] <-> [4] <-> ... <-> [1] <- tail
                 (allocated first)                    (allocated last)

Running out of blocks is not an error here: ``allocate`` returns None and changes nothing, and the
scheduler turns that into preemption. Misuse (freeing a free block, caching a half-written block
under another hash) raises, since it means a bookkeeping bug.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from dataclasses import dataclass, field
from typing import Iterable

import torch

BlockHash = bytes  # sha256 digest, see hash_block

_HASH_DOMAIN = b"runtime.kv-block/v1"


def hash_block(parent_hash: BlockHash | None, token_ids: Iterable[int], extra: tuple = ()) -> BlockHash:
    """A stable hash of one full block's contents: its parent block's hash, its token ids, and
    anything else that changes the K/V stored in it (KV storage dtype, LoRA id, cache salt...).

    Chaining the parent's hash makes a block's hash stand for the whole prefix up to and including
    it, so equal hashes mean equal K/V. The encoding is canonical (type-tagged, length-prefixed) and
    hashed with sha256, so it is the same in every process - unlike ``hash()``, which is salted.
    """
    h = hashlib.sha256(_HASH_DOMAIN)
    if parent_hash is None:
        h.update(b"\x00")
    else:
        h.update(b"\x01" + struct.pack("<Q", len(parent_hash)) + bytes(parent_hash))
    ids = [int(t) for t in token_ids]
    h.update(struct.pack(f"<Q{len(ids)}q", len(ids), *ids))
    extra = tuple(extra)
    try:
        h.update(_encode_extra(extra))
    except TypeError:  # unhashable parts (lists): encode without the memo
        h.update(_encode(extra))
    return h.digest()


@functools.lru_cache(maxsize=256)
def _encode_extra(extra: tuple) -> bytes:
    """``_encode(extra)``, memoised: a request's extra (one KV dtype per layer, ...) is the same for every
    block it hashes, and encoding it dominated the hash of a block."""
    return _encode(extra)


def _encode(value) -> bytes:
    """Canonical bytes for the values allowed in a block hash's ``extra``."""
    if value is None:
        return b"N"
    if isinstance(value, bool):  # before int: bool is an int
        return b"B1" if value else b"B0"
    if isinstance(value, int):
        s = str(value).encode()
        return b"I" + struct.pack("<Q", len(s)) + s
    if isinstance(value, float):
        return b"F" + struct.pack("<d", value)
    if isinstance(value, str):
        s = value.encode("utf-8")
        return b"S" + struct.pack("<Q", len(s)) + s
    if isinstance(value, (bytes, bytearray)):
        return b"Y" + struct.pack("<Q", len(value)) + bytes(value)
    if isinstance(value, torch.dtype):
        s = str(value).encode()
        return b"D" + struct.pack("<Q", len(s)) + s
    if isinstance(value, (tuple, list)):
        return b"T" + struct.pack("<Q", len(value)) + b"".join(_encode(v) for v in value)
    raise TypeError(f"cannot hash {type(value).__name__} into a KV block hash; use None, bool, int, float, "
                    f"str, bytes, torch.dtype or tuples of them")


@dataclass(eq=False)
class KVBlock:
    """One block of KV slots. Identity is the object (eq=False): the pool owns exactly one per id."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set once the block is full and registered in the prefix cache
    # intrusive free-list links; None when the block is not in the free queue
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks through their own links: O(1) pop from the head, append to
    the tail, and removal from the middle (a cache hit on a free block)."""

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels: never handed out
        self._tail = KVBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def __len__(self) -> int:
        return self.num_free

    def contains(self, block: KVBlock) -> bool:
        return block.prev_free is not None

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVBlock) -> None:
        if block.prev_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free += 1

    def block_ids(self) -> list[int]:
        """Free block ids from head (evicted first) to tail; O(n), for tests and debugging."""
        out, b = [], self._head.next_free
        while b is not self._tail:
            out.append(b.block_id)
            b = b.next_free
        return out


class BlockPool:
    """``num_blocks`` KV blocks, their reference counts, and the prefix cache (hash -> block)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}  # full blocks whose contents may be reused
        self.num_queries = 0  # lookup() calls
        self.num_hits = 0  # lookup() calls that found a block
        self.num_evictions = 0  # cached blocks whose contents allocate() reclaimed

    # --- state -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks with no reference (cached or not): what ``allocate`` can hand out."""
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (referenced by a request); free cached blocks count as free."""
        return 1.0 - self.num_free / self.num_blocks

    @property
    def num_cached(self) -> int:
        """Blocks findable by hash (in use or free)."""
        return len(self._cached)

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_queries if self.num_queries else 0.0

    # --- allocation --------------------------------------------------------------------------
    def allocate(self, n: int) -> list[KVBlock] | None:
        """``n`` blocks from the head of the free queue, each with ref_cnt 1; None (and no change) if
        fewer than ``n`` are free. A block that still held cached contents leaves the cache."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.free_queue.num_free:
            return None
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            assert block.ref_cnt == 0, block
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in the given order; a block reaching zero goes to the
        free queue's tail and stays findable by hash until ``allocate`` reuses it."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than it was referenced")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache hits; a free block leaves the free queue (it is in use again)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    # --- prefix cache ------------------------------------------------------------------------
    def cache_full_block(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Register a full, in-use block under ``block_hash``. Returns False (and leaves the block
        uncached) when another block already holds the same contents - e.g. two requests with the
        same prompt computed in the same step; the duplicate is freed like any private block."""
        if block.ref_cnt <= 0:
            raise ValueError(f"block {block.block_id} is free; only blocks in use can be cached")
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise ValueError(f"block {block.block_id} is already cached under another hash")
            return True
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        """The block caching ``block_hash`` (in use or free), or None; counts a query (and a hit).
        Takes no reference: call ``touch`` on the blocks you keep."""
        self.num_queries += 1
        block = self._cached.get(block_hash)
        if block is not None:
            self.num_hits += 1
        return block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only when no block is in use (else False, nothing changes)."""
        if self.num_free != self.num_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        return True

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
            self.num_evictions += 1
        block.block_hash = None
