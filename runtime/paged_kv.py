"""Paged KV storage, and the per-sequence view the executor appends to and reads from.

``PagedKVStorage`` holds every layer's keys and values as ``[num_blocks, block_size, num_kv_heads,
head_dim]`` tensors shared by all sequences. ``PagedSequenceKV`` is one sequence's window onto it
through its block table (from ``KVCacheManager.block_table``), with the same ``append``/``view``
interface as ``runtime.kv_cache.SequenceKV``, so the executor's attention runs on either unchanged:

    position p of the sequence  ->  slot  block_table[p // block_size] * block_size + p % block_size
                                    of the layer's storage flattened to [num_blocks * block_size, ...]

``view`` gathers positions [0, end) into contiguous tensors (a copy, unless the blocks it needs happen
to be physically consecutive, when it is a plain slice of the storage).
"""

from __future__ import annotations

import torch

from runtime.kv_cache import CacheFullError, KVLayout


class PagedKVStorage:
    """All layers' K/V blocks on one device."""

    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int,
                 device: torch.device | str = "cpu") -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        # k[layer]: [num_blocks, block_size, num_kv_heads, head_dim]. A sequence only ever reads positions it has
        # written. On CUDA zeroed all the same (a memset, ~40 ms for 114 GB on an H200): the padding rows of a
        # captured decode step attend over block 0's first slot (runtime.cuda_graphs), which no sequence may have
        # written yet, and an FP8 byte left by the allocator can be NaN (0x7F): their dropped outputs stay finite.
        # On the CPU (no captured steps) left uninitialised: its pages are committed only as sequences write them
        new = torch.zeros if self.device.type == "cuda" else torch.empty
        self.k = [new(num_blocks, block_size, h, d, dtype=layout.dtype_of(i), device=self.device)
                  for i, (h, d) in enumerate(zip(layout.num_kv_heads, layout.head_dim))]
        self.v = [new(t.shape, dtype=t.dtype, device=self.device) for t in self.k]
        # the same memory as [num_blocks * block_size, num_kv_heads, head_dim]: one row per slot
        self.k_slots = [t.view(-1, *t.shape[2:]) for t in self.k]
        self.v_slots = [t.view(-1, *t.shape[2:]) for t in self.v]

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @staticmethod
    def blocks_for_budget(layout: KVLayout, block_size: int, budget_bytes: int) -> int:
        """How many blocks of ``block_size`` tokens (all layers, K and V) fit in ``budget_bytes``."""
        per_block = layout.bytes_per_token() * block_size
        return max(0, int(budget_bytes) // per_block) if per_block else 0


class PagedSequenceKV:
    """One sequence's K/V through a block table; a drop-in for ``SequenceKV`` in ``SeqSlice.kv``.

    ``block_table`` is kept by reference: the manager appends blocks to it between steps and
    ``capacity`` grows with it. It must only ever be appended to (entries already there are the
    sequence's positions, and index tensors are cached per position range and table length).
    """

    def __init__(self, storage: PagedKVStorage, block_table: list[int], num_tokens: int = 0) -> None:
        self.storage = storage
        self.block_table = block_table
        self.num_tokens = num_tokens  # tokens whose K/V are stored; the caller advances it, as with SequenceKV
        self._slot_cache: dict[tuple[int, int, int], slice | torch.Tensor] = {}

    @property
    def capacity(self) -> int:
        return len(self.block_table) * self.storage.block_size

    def slot_mapping(self, start: int, end: int) -> torch.Tensor:
        """Flat slot index of each position in [start, end): [end - start] int64 on the storage device."""
        slots = self._slots(start, end)
        if isinstance(slots, slice):
            return torch.arange(slots.start, slots.stop, device=self.storage.device)
        return slots

    def _slots(self, start: int, end: int) -> slice | torch.Tensor:
        """Slots of positions [start, end): a slice when they are physically consecutive, else an
        index tensor. Cached, since every layer of a step asks for the same ranges."""
        if end > self.capacity:
            raise CacheFullError(f"sequence needs {end} cache slots, its {len(self.block_table)} blocks hold "
                                 f"{self.capacity}")
        key = (start, end, len(self.block_table))
        slots = self._slot_cache.get(key)
        if slots is not None:
            return slots
        bs = self.storage.block_size
        first, last = start // bs, (end - 1) // bs
        ids = self.block_table[first:last + 1]
        if ids == list(range(ids[0], ids[0] + len(ids))):
            lo = ids[0] * bs + start % bs
            slots = slice(lo, lo + end - start)
        else:
            device = self.storage.device
            pos = torch.arange(start, end, device=device)
            table = torch.tensor(ids, dtype=torch.long, device=device)
            slots = table[pos // bs - first] * bs + pos % bs
        if len(self._slot_cache) >= 8:  # a step uses two ranges (append, view); keep a few
            self._slot_cache.clear()
        self._slot_cache[key] = slots
        return slots

    def append(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: [num_new, num_kv_heads, head_dim], written at positions [start, start + num_new)
        n = k.shape[0]
        if n == 0:
            return
        slots = self._slots(start, start + n)
        ks, vs = self.storage.k_slots[layer], self.storage.v_slots[layer]
        if isinstance(slots, slice):
            ks[slots] = k
            vs[slots] = v
        else:
            ks.index_copy_(0, slots, k.to(ks.dtype))
            vs.index_copy_(0, slots, v.to(vs.dtype))

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [0, end) as contiguous [end, num_kv_heads, head_dim] tensors."""
        ks, vs = self.storage.k_slots[layer], self.storage.v_slots[layer]
        if end == 0:
            return ks[:0], vs[:0]
        slots = self._slots(0, end)
        if isinstance(slots, slice):
            return ks[slots], vs[slots]
        return ks.index_select(0, slots), vs.index_select(0, slots)

    def truncate(self, num_tokens: int) -> None:
        self.num_tokens = min(self.num_tokens, num_tokens)
