"""The KV cache manager: which blocks each request holds, and prefix-cache hits across requests.

Layers (each knows only its own things):

    scheduler (not here)   budgets and policy: which requests run, preempts when allocation fails
    KVCacheManager         requests: request id -> block table, hash chain of its full blocks
    BlockPool              blocks: reference counts, free queue (LRU eviction), hash -> block

A scheduler step, for a waiting request:

    blocks, num_computed = manager.get_computed_blocks(rid, token_ids)     # pure lookup
    new = manager.allocate_slots(rid, token_ids, len(token_ids) - num_computed, blocks)
    if new is None: ...  # not enough free blocks: leave it waiting, or preempt someone (manager.free)

and for a running one, ``allocate_slots(rid, token_ids, num_new)`` each step. ``block_table(rid)`` is
the live list of block ids a ``runtime.paged_kv.PagedSequenceKV`` reads through: append-only, except that
``free_lookahead`` drops the blocks past the last committed token after a speculative step (between steps, when
no step holds the table).

Only FULL blocks are ever shared. A partly filled block is still being written by its request (the
next decode step appends into it), so sharing it would need copy-on-write, and its contents - hence
its hash - are not final; a request that matches a cached prefix plus part of a block recomputes
those few tokens into a private block instead (at most block_size - 1 tokens of extra work).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from runtime.block_pool import BlockHash, BlockPool, KVBlock, hash_block


@dataclass
class PrefixCacheStats:
    """Prefix-cache effectiveness in tokens, counted once per admitted request (at its first
    successful ``allocate_slots``), so a request that waits several steps is not counted twice."""

    requests: int = 0
    queries: int = 0  # tokens of the admitted requests
    hits: int = 0  # of those, tokens whose K/V came from the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class _Request:
    blocks: list[KVBlock] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)  # the live block table handed out by block_table()
    block_hashes: list[BlockHash] = field(default_factory=list)  # hash chain of the full blocks so far
    num_tokens: int = 0  # tokens with slots, computed or scheduled (excludes lookahead)
    num_cached_blocks: int = 0  # leading full blocks already offered to the prefix cache
    extra: tuple = ()


class KVCacheManager:
    """Per-request block tables over a ``BlockPool``, with optional prefix caching.

    ``hash_extra`` goes into every block hash this manager makes (e.g. the KV storage dtype, so two
    caches of different dtypes never share a hash); a request's own ``extra`` (e.g. a LoRA id or a
    cache salt) is added to it.
    """

    def __init__(self, pool: BlockPool, block_size: int, enable_prefix_caching: bool = True, *,
                 hash_extra: tuple = ()) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_extra = tuple(hash_extra)
        self.stats = PrefixCacheStats()
        self._requests: dict[str, _Request] = {}

    # --- queries -----------------------------------------------------------------------------
    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids, in position order. This is the live list (the manager appends to
        it as the request grows, and empties it on ``free``): hand it to a PagedSequenceKV, do not
        modify it."""
        return self._requests[request_id].block_ids

    def blocks(self, request_id: str) -> list[KVBlock]:
        return list(self._requests[request_id].blocks)

    def num_tokens(self, request_id: str) -> int:
        """Tokens the request has slots for, computed or scheduled (lookahead slots excluded)."""
        return self._requests[request_id].num_tokens

    def reset_stats(self) -> PrefixCacheStats:
        """Return the stats so far and start counting afresh."""
        stats, self.stats = self.stats, PrefixCacheStats()
        return stats

    # --- prefix cache ------------------------------------------------------------------------
    def get_computed_blocks(self, request_id: str, token_ids: Sequence[int], *,
                            extra: tuple = ()) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of ``token_ids`` made of full blocks, and its length in tokens.

        At most ``len(token_ids) - 1`` tokens are reported computed, so at least the last token runs
        through the model and the request gets logits to sample from. Takes no references and
        changes nothing but the pool's lookup counters: pass the blocks to ``allocate_slots``.
        ``request_id`` is unused for now (kept so a manager with per-request state can use it).
        """
        if not self.enable_prefix_caching or len(token_ids) == 0:
            return [], 0
        bs, extra = self.block_size, self.hash_extra + tuple(extra)
        blocks: list[KVBlock] = []
        parent: BlockHash | None = None
        for i in range((len(token_ids) - 1) // bs):  # full blocks, leaving the last token uncached
            parent = hash_block(parent, token_ids[i * bs:(i + 1) * bs], extra)
            block = self.pool.lookup(parent)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * bs

    def _hashes(self, token_ids: Sequence[int], num_blocks: int, extra: tuple,
                start: list[BlockHash] | None = None) -> list[BlockHash]:
        """Hash chain of the first ``num_blocks`` full blocks of ``token_ids``, extending ``start``."""
        bs = self.block_size
        out = list(start or [])
        for i in range(len(out), num_blocks):
            out.append(hash_block(out[-1] if out else None, token_ids[i * bs:(i + 1) * bs], extra))
        return out

    # --- allocation --------------------------------------------------------------------------
    def allocate_slots(self, request_id: str, token_ids: Sequence[int], num_new_tokens: int,
                       computed_blocks: list[KVBlock] | None = None, *, num_lookahead_tokens: int = 0,
                       extra: tuple = (), count_stats: bool = True) -> list[KVBlock] | None:
        """Give the request slots for ``num_new_tokens`` more tokens; returns the newly allocated
        blocks (possibly none), or None - with no state changed - if the pool has too few free blocks.

        ``token_ids`` is all of the request's tokens known so far (prompt, then generated ones); the
        first call for a request may pass the ``computed_blocks`` from ``get_computed_blocks``.
        The block table grows only here (``free_lookahead`` trims unused lookahead blocks):

            positions  0                 num_computed        num_computed + num_new
                       |<- num_computed ->|<--- num_new --->|<- lookahead ->|
                       | K/V in the cache | computed by the | reserved, e.g. |
                       | (prefix hits or  | step this call  | speculative    |
                       |  earlier steps)  | is for          | draft tokens   |
            blocks     [ b0 ][ b1 ][ b2 ][ b3 ][ b4 ][ b5 ][ b6 ]
                       |<-- already held or -->|<---- allocated now ---->|
                            computed_blocks

        Blocks that become full with this call's tokens are hashed (chained on their parent) and
        registered in the prefix cache when prefix caching is on - before the step has actually
        written them, as the scheduler assumes scheduled tokens get computed. Lookahead slots are
        never cached. ``extra`` (see ``get_computed_blocks``) is fixed at the request's first call.
        ``count_stats=False`` keeps a re-admission (a preempted request's recompute) out of the prefix-cache
        statistics, which count each request once.
        """
        if num_new_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(f"negative token counts: num_new_tokens={num_new_tokens}, "
                             f"num_lookahead_tokens={num_lookahead_tokens}")
        bs, pool = self.block_size, self.pool
        state = self._requests.get(request_id)
        if state is not None and not computed_blocks:  # a running request's next tokens (every decode step)
            num_tokens = state.num_tokens + num_new_tokens
            if (-(-(num_tokens + num_lookahead_tokens) // bs) <= len(state.blocks) and len(token_ids) >= num_tokens
                    and (not self.enable_prefix_caching or num_tokens // bs <= state.num_cached_blocks)):
                # its blocks hold them and none becomes full: what the general path below would do comes to this
                state.num_tokens = num_tokens
                return []
        computed = list(computed_blocks or ())
        if state is not None and computed:
            raise ValueError(f"request {request_id!r} already holds blocks; computed_blocks only go with "
                             f"its first allocate_slots")
        if computed and not self.enable_prefix_caching:
            raise ValueError("computed_blocks given but prefix caching is off")
        num_held = len(state.blocks) if state is not None else 0
        num_computed = state.num_tokens if state is not None else len(computed) * bs
        num_tokens = num_computed + num_new_tokens
        if len(token_ids) < num_tokens:
            raise ValueError(f"request {request_id!r}: {len(token_ids)} token ids for {num_tokens} tokens")

        req_extra = self.hash_extra + tuple(extra) if state is None else state.extra
        hashes: list[BlockHash] = []
        if computed:  # the caller's blocks must still hold this request's prefix
            hashes = self._hashes(token_ids, len(computed), req_extra)
            for i, (b, h) in enumerate(zip(computed, hashes)):
                if b.block_hash != h:
                    raise ValueError(f"computed block {i} (id {b.block_id}) no longer caches request "
                                     f"{request_id!r}'s prefix; call get_computed_blocks again")

        num_needed = -(-(num_tokens + num_lookahead_tokens) // bs)
        num_new_blocks = max(0, num_needed - num_held - len(computed))
        num_revived = sum(1 for b in computed if b.ref_cnt == 0)  # leave the free queue on touch
        if num_new_blocks + num_revived > pool.num_free:
            return None

        pool.touch(computed)
        new_blocks = pool.allocate(num_new_blocks)
        assert new_blocks is not None  # checked above
        if state is None:
            state = self._requests[request_id] = _Request(extra=req_extra, block_hashes=hashes)
            if self.enable_prefix_caching and count_stats:
                self.stats.requests += 1
                self.stats.queries += len(token_ids)
                self.stats.hits += num_computed
        for b in computed + new_blocks:
            state.blocks.append(b)
            state.block_ids.append(b.block_id)
        state.num_tokens = num_tokens

        if self.enable_prefix_caching:
            num_full = num_tokens // bs
            if num_full > len(state.block_hashes):
                state.block_hashes = self._hashes(token_ids, num_full, req_extra, start=state.block_hashes)
            for i in range(state.num_cached_blocks, num_full):
                pool.cache_full_block(state.blocks[i], state.block_hashes[i])
            state.num_cached_blocks = max(state.num_cached_blocks, num_full)
        return new_blocks

    def free_lookahead(self, request_id: str) -> int:
        """Return the request's blocks past its last token with a slot (``num_tokens``): what lookahead slots
        allocated and no committed token uses, e.g. the slots of rejected speculative drafts. Such blocks were never
        registered in the prefix cache (only blocks full of committed tokens are), so they go back as plain free
        blocks, tail first. Returns how many were freed."""
        state = self._requests[request_id]
        num_kept = -(-state.num_tokens // self.block_size)
        extra = state.blocks[num_kept:]
        if not extra:
            return 0
        assert all(b.block_hash is None for b in extra), "a block past the committed tokens was in the prefix cache"
        self.pool.free(reversed(extra))
        del state.blocks[num_kept:]
        del state.block_ids[num_kept:]  # the live table shrinks: no PagedSequenceKV of this request outlives a step
        return len(extra)

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first (so its tail is evicted before its head, which
        other requests are likelier to share), and forget it. Unknown ids are ignored."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        self.pool.free(reversed(state.blocks))
        state.blocks.clear()
        state.block_ids.clear()  # a stale PagedSequenceKV now has capacity 0 instead of others' blocks
