"""The decode step captured in CUDA graphs, one per batch-size bucket.

A decode step of a small model is dominated by launch overhead: the executor issues a few kernels per
node from Python. Capturing the whole step (embedding to logits, fused attention over the paged cache
included) in a CUDA graph replays it with one launch. The graph reads its inputs from static buffers:

    input_ids, positions, slot_mapping   [max_bucket]              one new token per sequence
    block_tables                          [max_bucket, max_blocks]  max_blocks = ceil(max_seq_len / block_size)
    seq_lens, context_lens                [max_bucket]
    logits (output)                       [bucket, vocab]

A batch of n sequences replays the smallest bucket >= n; rows n..bucket-1 are padding: slot -1 (the
KV write skips it), sequence length 1 over block 0 (read, never written; its output is dropped).
Prefill and mixed steps run eagerly. Sampling runs after the replay, outside the graph.

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
        inp = self._step_input(b)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: autotuning and lazy initialisation happen outside the capture
                self.executor.forward(inp)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()  # nothing of the warm-up (collectives included) still pending at capture
        log.debug("capturing the decode step for batch size %d", b)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode=self.capture_error_mode):
            logits = self.executor.forward(inp)
        return graph, logits

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
