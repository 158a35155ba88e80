"""KV cache storage the executor's attention reads and appends to.

``SequenceKV`` is one sequence's cache, contiguous per layer. The executor only uses
``append`` and ``view``, so a paged cache (block tables over a shared block pool) can take its
place without touching the ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class CacheFullError(RuntimeError):
    """A sequence grew past the capacity its cache was allocated with."""


@dataclass(frozen=True)
class KVLayout:
    """Per-layer KV shapes, from the artifact's manifest."""

    num_kv_heads: list[int]  # per layer
    head_dim: list[int]  # per layer
    dtype: torch.dtype  # storage dtype of every layer not listed in layer_dtypes
    layer_dtypes: tuple[torch.dtype, ...] | None = None  # per-layer storage dtypes, when they differ

    def dtype_of(self, layer: int) -> torch.dtype:
        return self.layer_dtypes[layer] if self.layer_dtypes else self.dtype

    def bytes_per_token(self) -> int:
        return sum(2 * h * d * torch.empty((), dtype=self.dtype_of(i)).element_size()
                   for i, (h, d) in enumerate(zip(self.num_kv_heads, self.head_dim)))


class SequenceKV:
    """One sequence's keys and values, preallocated to ``capacity`` tokens."""

    def __init__(self, layout: KVLayout, capacity: int, device: torch.device | str = "cpu",
                 layers: set[int] | None = None) -> None:
        self.capacity = capacity
        self.num_tokens = 0  # tokens whose K/V are stored (all layers agree after a full step)
        # k[layer]: [capacity, num_kv_heads, head_dim]; only ``layers`` are allocated when given
        self.k = [torch.empty(capacity, h, d, dtype=layout.dtype_of(i), device=device)
                  if layers is None or i in layers else None
                  for i, (h, d) in enumerate(zip(layout.num_kv_heads, layout.head_dim))]
        self.v = [torch.empty_like(t) if t is not None else None for t in self.k]

    def allocate_layer(self, layer: int, layout: KVLayout, device: torch.device | str = "cpu") -> None:
        self.k[layer] = torch.empty(self.capacity, layout.num_kv_heads[layer], layout.head_dim[layer],
                                    dtype=layout.dtype_of(layer), device=device)
        self.v[layer] = torch.empty_like(self.k[layer])

    def free_layer(self, layer: int) -> None:
        self.k[layer] = self.v[layer] = None

    def append(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: [num_new, num_kv_heads, head_dim], written at positions [start, start + num_new)
        end = start + k.shape[0]
        if end > self.capacity:
            raise CacheFullError(f"sequence needs {end} cache slots, capacity is {self.capacity}")
        self.k[layer][start:end] = k
        self.v[layer][start:end] = v

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer][:end], self.v[layer][:end]

    def truncate(self, num_tokens: int) -> None:
        self.num_tokens = min(self.num_tokens, num_tokens)
