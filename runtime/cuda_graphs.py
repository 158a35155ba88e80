"""The decode step captured in CUDA graphs, one per batch-size bucket; one-sequence prefill steps, one per
token-count bucket.

A decode step of a small model is dominated by launch overhead: the executor issues a few kernels per
node from Python. Capturing the whole step (embedding to logits, fused attention over the paged cache
included) in a CUDA graph replays it with one launch. The graph reads its inputs from static buffers:

    input_ids, positions, slot_mapping   [max_bucket]              one new token per sequence
    block_tables                          [max_bucket, max_blocks]  max_blocks = ceil(max_seq_len / block_size)
    seq_lens, context_lens                [max_bucket]
    logits (output)                       [bucket, vocab]

A batch of n sequences replays the smallest bucket >= n; rows n..bucket-1 are padding: slot -1 (the
KV write skips it), sequence length 1 over block 0 (read, never written; its output is dropped).
Sampling runs after the replay, outside the graph.

A prefill step of one sequence (a fresh prompt, or one chunk of it: the batch-1 time to first token) replays
:class:`PrefillGraphs`' graph of the smallest token bucket >= its n new tokens: tokens n..bucket-1 are padding
(slot -1, position 0, after the sequence's end in cu_seqlens_q, so the prefill attention gives them no tile),
and the logits are those of token n - 1. Steps of several sequences, and prompts longer than the largest
bucket, run eagerly.

NOTE: nothing in the captured step may synchronise with the host or allocate from Python values; the
executor's kernel path and ``kernels.paged_attention`` are written for that (grid sizes from shapes).
"""

from __future__ import annotations

import logging
import time

import torch

from runtime.executor import Executor, PagedAttentionMetadata, StepInput
from runtime.paged_kv import PagedKVStorage

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
DEFAULT_PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)


def capture_step(executor: Executor, inp: StepInput, pool,
                 capture_error_mode: str) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """One step over ``inp``'s static buffers captured in a CUDA graph; returns it and its logits buffer."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up: autotuning and lazy initialisation happen outside the capture
            executor.forward(inp)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()  # nothing of the warm-up (collectives included) still pending at capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode=capture_error_mode):
        logits = executor.forward(inp)
    return graph, logits


class DecodeGraphs:
    """CUDA graphs of the decode step for every bucket up to ``max_num_seqs``."""

    def __init__(self, executor: Executor, storage: PagedKVStorage, max_num_seqs: int, max_seq_len: int,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS, capture_error_mode: str = "global") -> None:
        self.executor = executor
        self.capture_error_mode = capture_error_mode
        device = storage.device
        self.buckets = sorted({b for b in buckets if b < max_num_seqs} | {max_num_seqs})
        top = self.buckets[-1]
        self.max_blocks = -(-max_seq_len // storage.block_size)
        # static inputs: sized for the largest bucket; each graph reads a prefix
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((top,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(top, self.max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(top, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(top, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(top + 1, dtype=torch.int32, device=device)
        self.rows = torch.arange(top, dtype=torch.long, device=device)
        self.storage = storage
        # pinned host staging, two sets used in turn (see run): [positions, slots, ids], [seq_lens, context_lens],
        # block tables
        self._staging = [(torch.zeros(3, top, dtype=torch.long).pin_memory(),
                          torch.zeros(2, top, dtype=torch.int32).pin_memory(),
                          torch.zeros(top, self.max_blocks, dtype=torch.int32).pin_memory()) for _ in range(2)]
        self._turn = 0
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):  # largest first: smaller graphs reuse its memory pool
            self._graphs[b] = self._capture(b, pool)
        log.info("captured decode CUDA graphs for batch sizes %s in %.1fs", self.buckets,
                 time.perf_counter() - start)

    def _step_input(self, b: int) -> StepInput:
        md = PagedAttentionMetadata(self.storage.k, self.storage.v, self.slot_mapping[:b], self.block_tables[:b],
                                    self.seq_lens[:b], self.context_lens[:b], self.cu_seqlens_q[:b + 1],
                                    decode_only=True)
        return StepInput(self.input_ids[:b], self.positions[:b], [], self.rows[:b], paged=md)

    def _capture(self, b: int, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        log.debug("capturing the decode step for batch size %d", b)
        return capture_step(self.executor, self._step_input(b), pool, self.capture_error_mode)

    def close(self) -> None:
        """Destroy the graphs now (idempotent). Graphs that recorded NCCL collectives (tensor parallelism)
        hold resources of the communicator: leaving the process group waits for them, so they must go first."""
        try:
            torch.cuda.synchronize(self.storage.device)
        except RuntimeError as e:  # a failed device: the graphs still go
            log.warning("closing the decode graphs: %s", e)
        for graph, _ in self._graphs.values():
            graph.reset()
        self._graphs.clear()

    def bucket_for(self, num_seqs: int) -> int | None:
        return next((b for b in self.buckets if b >= num_seqs), None)

    def run(self, input_ids: list[int] | torch.Tensor, positions: list[int], slots: list[int],
            tables: list[list[int]]) -> torch.Tensor:
        """Replay the decode step for len(positions) sequences; returns their logits [n, vocab] (a view of
        the graph's output buffer, valid until the next replay). ``input_ids``: host ids, or a device tensor
        (the tokens the previous step sampled, not yet read by the host: see ServingEngine's overlap).

        Inputs travel through pinned staging buffers, two of them used in turn: the copies are queued
        behind the work already on the stream and the host never waits for them; the engine reads each
        step's tokens before it launches the step after next, so a buffer is never refilled while its
        copy may still be pending."""
        n = len(positions)
        b = self.bucket_for(n)
        assert b is not None, f"{n} sequences exceed the largest captured bucket {self.buckets[-1]}"
        pad = b - n
        on_device = isinstance(input_ids, torch.Tensor)
        longs, ints, tabs = self._staging[self._turn]
        self._turn ^= 1
        longs[:, :b] = torch.tensor([positions + [0] * pad, slots + [-1] * pad,
                                     [0] * b if on_device else input_ids + [0] * pad], dtype=torch.long)
        ints[:, :b] = torch.tensor([[p + 1 for p in positions] + [1] * pad, positions + [0] * pad], dtype=torch.int32)
        # only the columns in use: entries past a sequence's length are never read (seq_lens bounds the kernel)
        width = max(len(t) for t in tables)
        tabs[:b, :width] = torch.tensor([t + [0] * (width - len(t)) for t in tables] + [[0] * width] * pad,
                                        dtype=torch.int32)
        if on_device:
            self.input_ids[:n].copy_(input_ids)  # device to device, after the step that sampled them
        else:
            self.input_ids[:b].copy_(longs[2, :b], non_blocking=True)
        self.positions[:b].copy_(longs[0, :b], non_blocking=True)
        self.slot_mapping[:b].copy_(longs[1, :b], non_blocking=True)
        self.seq_lens[:b].copy_(ints[0, :b], non_blocking=True)
        self.context_lens[:b].copy_(ints[1, :b], non_blocking=True)
        self.block_tables[:b, :width].copy_(tabs[:b, :width], non_blocking=True)
        graph, logits = self._graphs[b]
        graph.replay()
        return logits[:n]


class PrefillGraphs:
    """CUDA graphs of a one-sequence prefill step for every token bucket up to ``max_tokens`` (see the module
    docstring). ``capture=False`` runs the same padded step eagerly instead of replaying it (tests on the CPU,
    where the kernels run under the Triton interpreter)."""

    def __init__(self, executor: Executor, storage: PagedKVStorage, max_tokens: int, max_seq_len: int,
                 buckets: tuple[int, ...] = DEFAULT_PREFILL_BUCKETS, capture: bool = True,
                 capture_error_mode: str = "global") -> None:
        self.executor, self.storage = executor, storage
        self.buckets = sorted(b for b in buckets if b <= max_tokens)
        device = storage.device
        top = self.buckets[-1] if self.buckets else 0
        self.max_blocks = -(-max_seq_len // storage.block_size)
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((top,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(1, self.max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(1, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(1, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.zeros(2, dtype=torch.int32, device=device)
        self.logits_index = torch.zeros(1, dtype=torch.long, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture and self.buckets:
            start = time.perf_counter()
            pool = torch.cuda.graph_pool_handle()  # its own: a decode graph's logits may still be read
            for b in reversed(self.buckets):
                self._graphs[b] = self._capture(b, pool, capture_error_mode)
            log.info("captured one-sequence prefill CUDA graphs for %s tokens in %.1fs", self.buckets,
                     time.perf_counter() - start)

    def _step_input(self, b: int) -> StepInput:
        md = PagedAttentionMetadata(self.storage.k, self.storage.v, self.slot_mapping[:b], self.block_tables,
                                    self.seq_lens, self.context_lens, self.cu_seqlens_q, decode_only=False)
        return StepInput(self.input_ids[:b], self.positions[:b], [], self.logits_index, paged=md)

    def _capture(self, b: int, pool, capture_error_mode: str) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self.cu_seqlens_q.copy_(torch.tensor([0, b], dtype=torch.int32))  # warm-up: a whole bucket of real rows
        self.seq_lens.fill_(b)
        return capture_step(self.executor, self._step_input(b), pool, capture_error_mode)

    def close(self) -> None:
        for graph, _ in self._graphs.values():
            graph.reset()
        self._graphs.clear()

    def bucket_for(self, num_tokens: int) -> int | None:
        return next((b for b in self.buckets if b >= num_tokens), None)

    def run(self, input_ids: list[int], context: int, table: list[int]) -> torch.Tensor:
        """The step of ``len(input_ids)`` new tokens of one sequence with ``context`` tokens already cached in
        the blocks of ``table`` (which holds the new ones' slots too); returns the last token's logits [1, vocab]
        (a view of the graph's output buffer, valid until its next replay). The inputs are copied from pageable
        host memory: the host may reuse it at once."""
        n = len(input_ids)
        b = self.bucket_for(n)
        assert b is not None and n >= 1, f"{n} tokens: no prefill bucket (largest {self.buckets[-1:]})"
        bs = self.storage.block_size
        pad = b - n
        slots = [table[p // bs] * bs + p % bs for p in range(context, context + n)]
        longs = torch.tensor([list(input_ids) + [0] * pad, list(range(context, context + n)) + [0] * pad,
                              slots + [-1] * pad], dtype=torch.long)
        self.input_ids[:b].copy_(longs[0])
        self.positions[:b].copy_(longs[1])
        self.slot_mapping[:b].copy_(longs[2])
        ints = torch.tensor([context + n, context, 0, n], dtype=torch.int32)
        self.seq_lens.copy_(ints[0:1])
        self.context_lens.copy_(ints[1:2])
        self.cu_seqlens_q.copy_(ints[2:4])
        self.logits_index.fill_(n - 1)
        self.block_tables[0, :len(table)].copy_(torch.tensor(table, dtype=torch.int32))
        if b not in self._graphs:  # not captured: the same padded step, eagerly
            return self.executor.forward(self._step_input(b))
        graph, logits = self._graphs[b]
        graph.replay()
        return logits
