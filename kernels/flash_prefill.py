"""Fresh prompts' causal attention on torch's FlashAttention-2 varlen kernel, beside the paged Triton kernels.

A prompt with no cached context attends only over its own new keys. For those, torch's built-in FlashAttention-2
(``aten._flash_attention_forward``, CUDA, 16-bit operands) runs at about 1.5x the paged prefill kernel: 86 us
against 124-128 us for one 2,048-token Llama-3-8B prompt on an H200 (docs/BENCHMARKS.md, sessions 42 and 48).
Prompts that continue a cached context (chunked prefill, prefix hits), speculative verify rows and decodes stay on
``kernels.paged_attention``.

One call covers a whole eager step. :func:`plan_flash` (host side, from the scheduled sequences) cuts the packed
rows into segments: each fresh prompt of two or more tokens is one, and the other rows are cut into segments of at
most 128 rows (one FlashAttention row tile each, so they cost one tile a head). Their output is not attention over
anything meaningful: the paged kernels overwrite those rows afterwards (``paged_prefill_attention(skip_fresh=True)``,
and the decode kernel for one-token sequences). The keys and values are the step's own rows as the cache holds them:
for a 16-bit cache the rotated keys and the values; for an FP8 cache its codes in the activation dtype (exact), whose
scales the caller folds in (the key scale into ``scale``, the value scale into the values it passes).

Nothing here runs inside a CUDA graph: the segments' bounds are host integers of the step (the captured prefill
buckets keep the paged kernels).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

SEGMENT_ROWS = 128  # rows of a segment of other sequences' rows (FlashAttention-2's row tile at head_dim <= 128)


@dataclass
class FlashPlan:
    """An eager step's rows cut into FlashAttention segments (:func:`plan_flash`)."""

    cu_seqlens: torch.Tensor  # int32 [segments + 1]: segment bounds over the packed rows (from 0 to num_tokens)
    max_len: int  # the longest fresh prompt (no segment is longer)
    decode_rows: torch.Tensor  # int64 [n]: the rows of the sequences of exactly one new token
    decode_seqs: torch.Tensor  # int64 [n]: their indices among the step's sequences
    others: int  # sequences of two or more new tokens over a cached context (the paged prefill kernel's)
    fresh_rows: int  # rows attended here


def fresh_prompt(num_new: int, num_context: int) -> bool:
    """Whether a sequence of the step is attended by :func:`flash_prefill`: two or more new tokens, no context."""
    return num_context == 0 and num_new > 1


def plan_flash(num_new: Sequence[int], num_context: Sequence[int],
               to_device: Callable[[list[int], torch.dtype], torch.Tensor]) -> FlashPlan | None:
    """The segments of a step whose sequences have ``num_new`` new tokens over ``num_context`` cached ones (packed
    back to back in that order), or None when no sequence is a fresh prompt. ``to_device(values, dtype)`` makes a
    device tensor (the serving engine's pinned, non-blocking copy)."""
    fresh = [fresh_prompt(n, c) for n, c in zip(num_new, num_context, strict=True)]
    if not any(fresh):
        return None
    max_len = max(n for n, f in zip(num_new, fresh) if f)
    seg = min(SEGMENT_ROWS, max_len)
    bounds, pending, row = [0], 0, 0
    decode_rows, decode_seqs, others = [], [], 0

    def flush(pending: int) -> None:
        while pending > 0:
            take = min(seg, pending)
            bounds.append(bounds[-1] + take)
            pending -= take

    for i, (n, f) in enumerate(zip(num_new, fresh)):
        if f:
            flush(pending)
            pending = 0
            bounds.append(bounds[-1] + n)
        else:
            pending += n
            if n == 1:
                decode_rows.append(row)
                decode_seqs.append(i)
            elif n > 1:
                others += 1
        row += n
    flush(pending)
    return FlashPlan(to_device(bounds, torch.int32), max_len, to_device(decode_rows, torch.int64),
                     to_device(decode_seqs, torch.int64), others,
                     sum(n for n, f in zip(num_new, fresh) if f))


@functools.cache
def _op_arguments() -> frozenset[str]:
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if op is None:
        return frozenset()
    return frozenset(a.name for a in op.default._schema.arguments)


@functools.cache
def _device_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 0)


def flash_supported(q: torch.Tensor, window: int | None = None, softcap: float = 0.0,
                    sinks: torch.Tensor | None = None) -> bool:
    """Whether :func:`flash_prefill` takes this layer's attention: CUDA (compute capability 8.0+), fp16 / bf16
    queries, a head size FlashAttention-2 has (a multiple of 8, at most 256), no softcap or sinks, and a sliding
    window only where this torch's operator takes one."""
    args = _op_arguments()
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16) or not args:
        return False
    head_dim = q.shape[-1]
    if head_dim % 8 or head_dim > 256 or softcap > 0 or sinks is not None:
        return False
    if window is not None and "window_size_left" not in args:
        return False
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    return _device_ok(index)


def flash_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: FlashPlan, scale: float,
                  window: int | None = None) -> torch.Tensor:
    """Causal attention within each of ``plan``'s segments: q [num_tokens, heads, head_dim], k / v [num_tokens, kv
    heads, head_dim] (the kv heads dividing the heads), all of one 16-bit dtype with contiguous rows of head_dim;
    returns a new [num_tokens, heads, head_dim] tensor. ``window``: each query sees its last ``window`` keys, itself
    included, as the paged kernels' ``sliding_window``."""
    kwargs: dict = {"scale": scale}
    if window is not None:
        kwargs.update(window_size_left=window - 1, window_size_right=0)
    return torch.ops.aten._flash_attention_forward(q, k, v, plan.cu_seqlens, plan.cu_seqlens, plan.max_len,
                                                   plan.max_len, 0.0, True, False, **kwargs)[0]


def ref_flash_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: FlashPlan, scale: float,
                      window: int | None = None) -> torch.Tensor:
    """:func:`flash_prefill` in plain torch (fp32 softmax), for tests and machines without it."""
    bounds = plan.cu_seqlens.tolist()
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs = q[a:b].float().transpose(0, 1)  # [heads, n, d]
        ks = k[a:b].float().repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v[a:b].float().repeat_interleave(group, dim=1).transpose(0, 1)
        s = (qs @ ks.transpose(1, 2)) * scale
        i = torch.arange(b - a, device=q.device)
        visible = i[None, :] <= i[:, None]
        if window is not None:
            visible &= i[:, None] - i[None, :] < window
        s = s.masked_fill(~visible, float("-inf"))
        out[a:b] = (torch.softmax(s, dim=-1) @ vs).transpose(0, 1).to(q.dtype)
    return out
