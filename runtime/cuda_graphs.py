"""The decode step captured in CUDA graphs, one per batch-size bucket; steps that carry prefill, one per
(token bucket, sequence bucket).

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

A step that carries prefill (fresh prompts, chunks of long ones, and the decodes running beside them: one
new token each) replays :class:`StepGraphs`' graph of the smallest token bucket >= its T new tokens and the
smallest sequence bucket >= its S sequences. It runs the varlen prefill attention over every sequence (a decode
is a sequence of one new token), whose grid depends on the bucket only (T // BLOCK_T + S tiles). Padding:
tokens T..bucket-1 get slot -1 (the KV write skips them) and position 0 and lie past cu_seqlens_q[S], so no
tile reads them; sequences S..bucket-1 have no new tokens (cu_seqlens_q stays at T, context 0), so their
tiles exit at once; the logits rows past the step's sampling rows read row 0 and are dropped. Steps larger
than the largest buckets run eagerly. A speculative verify step (decodes fed their draft tokens too: k + 1 new
tokens and k + 1 logits rows each, runtime.speculative) replays them as well, in a sequence bucket that holds
its logits rows, unless its rows fit the verify-step decode graphs (``DecodeGraphs(chained=True)``: each token a
row of its own, at consecutive positions of its request; ``verify_decode_buckets``).

NOTE: nothing in the captured step may synchronise with the host or allocate from Python values; the
executor's kernel path and ``kernels.paged_attention`` are written for that (grid sizes from shapes).
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from array import array
from dataclasses import dataclass

import torch

from runtime import executor as _executor
from runtime.executor import LONG_ROPE_OFFSET, Executor, PagedAttentionMetadata, StepInput, mixed_step
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


class TableStaging:
    """A host buffer of block tables (pinned on CUDA), filled row by row into a compact [rows, width] block, width the
    longest table's length: one contiguous source for the copy to the device.

    Building the padded tables as a nested list and turning it into a tensor costs the host O(rows x blocks) Python
    work per step: 9.8 ms for 512 sequences of 136 blocks (2,176 tokens) on the 2-core development machine. Here
    each row is copied from its list in one slice assignment, the buffer's memory seen as a memoryview of C ints
    (no numpy needed): 1.3 ms there. The block is compact rather than [rows, max_blocks] sliced to the width: a
    strided host source makes torch stage the copy through a pageable temporary (a synchronous copy of the host
    per step, "Memcpy HtoD (Pageable -> Device)" in a profile)."""

    def __init__(self, rows: int, max_blocks: int, pin: bool) -> None:
        self.tensor = torch.zeros(rows * max_blocks, dtype=torch.int32, pin_memory=pin)
        self.max_blocks = max_blocks
        self._ints = memoryview((ctypes.c_int32 * self.tensor.numel()).from_address(self.tensor.data_ptr())) \
            .cast("B").cast("i")
        self._zeros = memoryview(array("i", bytes(4 * max_blocks)))

    def fill(self, tables: list[list[int]], rows: int) -> torch.Tensor:
        """[rows, width] (a view of the buffer, contiguous): row i holds ``tables[i]`` then zeros, rows past the
        tables are zeros (padding); width is the longest table's length (0 for none)."""
        ints, zeros = self._ints, self._zeros
        width = max(map(len, tables), default=0)
        for i, table in enumerate(tables):
            n, at = len(table), i * width
            ints[at:at + n] = array("i", table)
            if n < width:
                ints[at + n:at + width] = zeros[:width - n]
        for i in range(len(tables), rows):
            ints[i * width:(i + 1) * width] = zeros[:width]
        return self.tensor[:rows * width].view(rows, width)


class StagedInputs:
    """A captured step's static inputs as views of one device buffer, staged in pinned host buffers of the same
    layout used in turn: one copy a step instead of one per input (each costs the host ~5-12 us to queue).
    ``fields``: name -> (dtype, shape); each field starts at a multiple of 8 bytes. ``device[name]`` is the view the
    graphs read, ``host(turn)[name]`` the view to fill; ``copy(turn)`` queues the whole buffer (a few KB: every
    field in full, the parts a step does not use included, which its graph does not read)."""

    def __init__(self, fields: dict[str, tuple[torch.dtype, tuple[int, ...]]], device: torch.device, pin: bool,
                 sets: int = 2) -> None:
        layout, size = {}, 0
        for name, (dtype, shape) in fields.items():
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            layout[name] = (size, nbytes, dtype, shape)
            size += -(-nbytes // 8) * 8
        self._layout, self.pin = layout, pin
        self._device = torch.zeros(size, dtype=torch.uint8, device=device)
        self._hosts = [torch.zeros(size, dtype=torch.uint8, pin_memory=pin) for _ in range(sets)]
        self.device = self._views(self._device)
        self._host_views = [self._views(h) for h in self._hosts]

    def _views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: buf[at:at + n].view(dtype).view(shape) for name, (at, n, dtype, shape) in self._layout.items()}

    def host(self, turn: int) -> dict[str, torch.Tensor]:
        return self._host_views[turn]

    def copy(self, turn: int) -> None:
        self._device.copy_(self._hosts[turn], non_blocking=self.pin)


class DecodeGraphs:
    """CUDA graphs of the decode step for every bucket up to ``max_num_seqs``.

    ``chained=True``: the graphs of a speculative verify step laid out as decodes (``ServingEngine._run``): a
    request's last token and its k drafts are k + 1 rows at consecutive positions over the same block table, row j
    attending to the cache up to its own position, so the drafts are scored by the decode step's kernels (GEMV-class
    linears, the decode attention) instead of a prompt's. The K/V are then written before the attention reads them
    (``PagedAttentionMetadata.chained``). ``capture=False`` runs the same padded step eagerly (tests on the CPU)."""

    def __init__(self, executor: Executor, storage: PagedKVStorage, max_num_seqs: int, max_seq_len: int,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS, capture_error_mode: str = "global",
                 logits: bool = True, chained: bool = False, capture: bool = True) -> None:
        self.executor = executor
        self.capture_error_mode = capture_error_mode
        self.logits = logits  # False: no logits rows (a tensor-parallel worker's replicated lm_head is not run)
        self.chained = chained
        device = storage.device
        pin = device.type == "cuda"
        self.buckets = sorted({b for b in buckets if b < max_num_seqs} | {max_num_seqs})
        top = self.buckets[-1]
        self.max_blocks = -(-max_seq_len // storage.block_size)
        # static inputs: sized for the largest bucket; each graph reads a prefix. [positions, slots, ids] and
        # [seq_lens, context_lens] in one buffer, staged in two pinned sets used in turn (see run)
        self._inputs = StagedInputs({"longs": (torch.long, (3, top)), "ints": (torch.int32, (2, top))}, device,
                                    pin=pin)
        longs, ints = self._inputs.device["longs"], self._inputs.device["ints"]
        self.positions, self.slot_mapping, self.input_ids = longs[0], longs[1], longs[2]
        self.seq_lens, self.context_lens = ints[0], ints[1]
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        self.block_tables = torch.zeros(top, self.max_blocks, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(top + 1, dtype=torch.int32, device=device)
        self.rows = torch.arange(top, dtype=torch.long, device=device)
        self.storage = storage
        self._tables = [TableStaging(top, self.max_blocks, pin=pin) for _ in range(2)]
        self._turn = 0
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # per bucket, the graph's final hidden states (where the executor keeps them: an EAGLE head reads them);
        # ``hidden`` after ``run``: those of the step just replayed, valid until the next replay
        self._hidden: dict[int, torch.Tensor] = {}
        self.hidden: torch.Tensor | None = None
        if not capture:
            return
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):  # largest first: smaller graphs reuse its memory pool
            self._graphs[b] = self._capture(b, pool)
        log.info("captured %s CUDA graphs for batch sizes %s in %.1fs",
                 "verify-step (chained decode)" if chained else "decode", self.buckets, time.perf_counter() - start)

    def _step_input(self, b: int) -> StepInput:
        md = PagedAttentionMetadata(self.storage.k, self.storage.v, self.slot_mapping[:b], self.block_tables[:b],
                                    self.seq_lens[:b], self.context_lens[:b], self.cu_seqlens_q[:b + 1],
                                    decode_only=True, chained=self.chained)
        return StepInput(self.input_ids[:b], self.positions[:b], [], self.rows[:b if self.logits else 0], paged=md)

    def _capture(self, b: int, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        log.debug("capturing the decode step for batch size %d", b)
        captured = capture_step(self.executor, self._step_input(b), pool, self.capture_error_mode)
        if self.executor.keep_hidden:  # made inside the capture: the replays write it in place
            self._hidden[b] = self.executor.hidden
        return captured

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
        turn = self._turn
        self._turn ^= 1
        host = self._inputs.host(turn)
        host["longs"][:, :b] = torch.tensor([positions + [0] * pad, slots + [-1] * pad,
                                             [0] * b if on_device else input_ids + [0] * pad], dtype=torch.long)
        # the lengths without LongRoPE's offset, which only the rotary reads (runtime.executor.LONG_ROPE_OFFSET)
        real = [p & (LONG_ROPE_OFFSET - 1) for p in positions] if self.executor.long_rope_from is not None \
            else positions
        host["ints"][:, :b] = torch.tensor([[p + 1 for p in real] + [1] * pad, real + [0] * pad], dtype=torch.int32)
        self._inputs.copy(turn)
        if on_device:
            self.input_ids[:n].copy_(input_ids)  # device to device, after the step that sampled them
        # only the columns in use are copied: entries past a sequence's length are never read (seq_lens bounds the
        # kernel)
        tables = self._tables[turn].fill(tables, b)
        if tables.shape[1]:
            self.block_tables[:b, :tables.shape[1]].copy_(tables, non_blocking=self._inputs.pin)
        if b not in self._graphs:  # not captured (capture=False): the same padded step, eagerly
            logits = self.executor.forward(self._step_input(b))
            if self.executor.keep_hidden:
                self.hidden = self.executor.hidden[:n]
            return logits[:n]
        graph, logits = self._graphs[b]
        graph.replay()
        if b in self._hidden:
            self.hidden = self._hidden[b][:n]
        return logits[:n]


# Token buckets of steps carrying prefill: past 64 each at most 1.5x the one before (padding costs compute there);
# sequence buckets: powers of 4 (a padded sequence costs an lm_head row and attention tiles that exit at once)
DEFAULT_STEP_TOKEN_BUCKETS = (16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
# Where speculation is on, verify steps of a few decodes (k + 1 tokens and logits rows each) also get these buckets,
# as token and as sequence buckets, so that batch 1 with k drafts pads to the next of them instead of 16 tokens over
# 16 sequences (16 lm_head rows); a sequence bucket that is no power of 4 pairs only with token buckets up to
# SMALL_STEP_TOKENS. RUNTIME_VERIFY_BUCKETS="2,4,8" (the default; "0": none, as before, for A/B runs).
SMALL_STEP_TOKENS = 16


def verify_buckets() -> tuple[int, ...]:
    """RUNTIME_VERIFY_BUCKETS as sizes (see SMALL_STEP_TOKENS)."""
    raw = os.environ.get("RUNTIME_VERIFY_BUCKETS", "2,4,8").replace(" ", "")
    try:
        sizes = tuple(sorted({int(v) for v in raw.split(",") if v} - {0}))
    except ValueError:
        sizes = (-1,)
    if any(not 1 <= v < SMALL_STEP_TOKENS for v in sizes):
        raise ValueError(f"RUNTIME_VERIFY_BUCKETS={raw!r}: give sizes from 1 to {SMALL_STEP_TOKENS - 1} separated by "
                         f"commas (e.g. 2,4,8), or 0 for none")
    return sizes


# A verify step of a few decodes runs on DecodeGraphs(chained=True) instead, one row per token (the last known token
# and each draft), where its rows fit one of these buckets: the decode step's kernels then score the drafts, and a
# batch-1 step of k drafts pads to k + 1 rows or the next bucket. RUNTIME_VERIFY_DECODE_BUCKETS (sizes separated by
# commas; "0": none, verify steps on the step graphs as before, for A/B runs).
DEFAULT_VERIFY_DECODE_BUCKETS = (2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48)
MAX_VERIFY_DECODE_ROWS = 256


def verify_decode_buckets() -> tuple[int, ...]:
    """RUNTIME_VERIFY_DECODE_BUCKETS as sizes (see DEFAULT_VERIFY_DECODE_BUCKETS); () for none."""
    raw = os.environ.get("RUNTIME_VERIFY_DECODE_BUCKETS", ",".join(map(str, DEFAULT_VERIFY_DECODE_BUCKETS)))
    raw = raw.replace(" ", "")
    try:
        sizes = tuple(sorted({int(v) for v in raw.split(",") if v} - {0}))
    except ValueError:
        sizes = (-1,)
    if any(not 2 <= v <= MAX_VERIFY_DECODE_ROWS for v in sizes):
        raise ValueError(f"RUNTIME_VERIFY_DECODE_BUCKETS={raw!r}: give row counts from 2 to {MAX_VERIFY_DECODE_ROWS} "
                         f"separated by commas (e.g. 2,3,5,8), or 0 for none")
    return sizes


def pairs_with(token_bucket: int, seq_bucket: int, top_seqs: int) -> bool:
    """Whether a step graph of ``token_bucket`` tokens over ``seq_bucket`` sequences is captured: at most one
    sequence a token, and a sequence bucket that is not a power of 4 (a verify step's, see SMALL_STEP_TOKENS) only
    with small token buckets."""
    regular = seq_bucket == top_seqs or seq_bucket & (seq_bucket - 1) == 0 and seq_bucket.bit_length() % 2 == 1
    return seq_bucket <= token_bucket and (regular or token_bucket <= SMALL_STEP_TOKENS)


def powers(base: int, limit: int) -> tuple[int, ...]:
    """1, base, base^2, ... below ``limit``, and ``limit`` itself."""
    out = [1]
    while out[-1] * base < limit:
        out.append(out[-1] * base)
    return tuple(sorted(set(out) | {limit}))


def decode_graph_batch(max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """The largest batch DecodeGraphs captures: a decode step feeds one token a sequence within the step's token
    budget, so no step runs more than ``max_num_batched_tokens`` sequences, whatever ``max_num_seqs`` allows to
    run (a serve --max-num-seqs of 10**12 had sized the graphs' buffers and their largest capture by it)."""
    return min(max_num_seqs, max_num_batched_tokens)


def step_buckets(max_tokens: int, max_num_seqs: int, token_buckets: tuple[int, ...] = DEFAULT_STEP_TOKEN_BUCKETS,
                 seq_buckets: tuple[int, ...] | None = None) -> tuple[list[int], list[int]]:
    """StepGraphs' (token buckets, sequence buckets): those given below the largest step, and the largest. Given the
    lists this returns, it returns them again (a tensor-parallel worker rebuilds rank 0's buckets from them)."""
    tokens = sorted({b for b in token_buckets if b < max_tokens} | {max_tokens})
    top_seqs = min(max_num_seqs, max_tokens)
    seq_buckets = powers(4, top_seqs) if seq_buckets is None else seq_buckets
    return tokens, sorted({b for b in seq_buckets if b < top_seqs} | {top_seqs})


@dataclass
class PackedStep:
    """A step's sequences packed on the host: what the eager path turns into tensors and the step graphs copy
    into their static buffers (``ServingEngine._pack``)."""

    input_ids: list[int]  # [T] the new tokens, sequences back to back
    positions: list[int]  # [T]
    slots: list[int]  # [T] flat cache slot of each new token
    cu_seqlens_q: list[int]  # [S + 1]
    context_lens: list[int]  # [S] tokens cached before the step
    block_tables: list[list[int]]  # [S] each sequence's blocks (its new tokens' included)
    logits_rows: list[int]  # rows whose logits are sampled, in order

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def seq_lens(self) -> list[int]:
        """[S] each sequence's tokens after the step: context + new."""
        cu = self.cu_seqlens_q
        return [c + cu[i + 1] - cu[i] for i, c in enumerate(self.context_lens)]


class StepGraphs:
    """CUDA graphs of steps that carry prefill, one per (token bucket, sequence bucket) with the sequence bucket
    at most the token bucket (see the module docstring). ``capture=False`` runs the same padded step eagerly
    instead of replaying it (tests on the CPU, where the kernels run under the Triton interpreter).
    ``max_num_seqs`` bounds both a step's sequences and its logits rows (more than one per sequence in a verify step).

    Every graph copies its logits into one static buffer [max sequences, vocab] outside the graphs' pool, so
    the pool holds one step's activations whatever the number of graphs; they are shared: replays are
    stream-ordered and a step's logits are consumed before the next replay is queued. ``logits=False``: no logits
    rows, and no such buffer (a tensor-parallel worker's replicated lm_head is not run, as in DecodeGraphs).
    Where ``runtime.executor.mixed_decode_split`` takes a layer of the cache (read when the graphs are made: by
    default an FP8 cache), a sequence bucket of two or more has a second graph for steps that mix decodes with
    prompts or chunks (``PagedAttentionMetadata.mixed``: their decodes on the decode kernel), the other steps keeping
    the first."""

    def __init__(self, executor: Executor, storage: PagedKVStorage, max_tokens: int, max_num_seqs: int,
                 max_seq_len: int, token_buckets: tuple[int, ...] = DEFAULT_STEP_TOKEN_BUCKETS,
                 seq_buckets: tuple[int, ...] | None = None, capture: bool = True,
                 capture_error_mode: str = "global", logits: bool = True) -> None:
        self.executor, self.storage = executor, storage
        self.token_buckets, self.seq_buckets = step_buckets(max_tokens, max_num_seqs, token_buckets, seq_buckets)
        self.wants_logits = logits
        device = storage.device
        top_t, top_s = self.token_buckets[-1], self.seq_buckets[-1]
        self.max_seq_len = max_seq_len
        self.max_blocks = -(-max_seq_len // storage.block_size)
        pin = device.type == "cuda"
        # static inputs, one buffer staged in two host sets used in turn: [ids, positions, slots] of the tokens,
        # the logits rows, [seq_lens, context_lens, cu_seqlens_q] of the sequences (the first two padded by one)
        self._inputs = StagedInputs({"tokens": (torch.long, (3, top_t)), "rows": (torch.long, (top_s,)),
                                     "seqs": (torch.int32, (3, top_s + 1))}, device, pin)
        tokens, seqs = self._inputs.device["tokens"], self._inputs.device["seqs"]
        self.input_ids, self.positions, self.slot_mapping = tokens[0], tokens[1], tokens[2]
        self.slot_mapping.fill_(-1)
        self.logits_index = self._inputs.device["rows"]
        self.seq_lens, self.context_lens, self.cu_seqlens_q = seqs[0, :top_s], seqs[1, :top_s], seqs[2]
        self.block_tables = torch.zeros(top_s, self.max_blocks, dtype=torch.int32, device=device)
        self.logits: torch.Tensor | None = None  # [top_s, vocab] ([0, vocab] without logits), at the first capture
        # where the executor keeps its final hidden states (runtime.eagle): every graph copies them into one static
        # buffer [top_t, hidden], as the logits; ``hidden`` after ``run``: the step's rows, valid until the next run
        self._hidden_buf: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None
        # per host set: the block tables, and [fed rows | their targets] (a feed's index, see run)
        self._staging = [(TableStaging(top_s, self.max_blocks, pin),
                          torch.zeros(2 * top_t, dtype=torch.long, pin_memory=pin)) for _ in range(2)]
        self._turn = 0
        # per staging set, an event recorded after its copies were queued: the set is rewritten only once they ran
        # (a caller that launches steps back to back without reading any back, e.g. a draft model's long prompt)
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self.split_mixed = any(_executor.mixed_decode_split(t.dtype) for t in storage.k)
        self._graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        if capture:
            start = time.perf_counter()
            pool = torch.cuda.graph_pool_handle()  # its own: a decode graph's logits may still be read
            for key in sorted(self.keys(), reverse=True):  # largest first: the smaller ones reuse its memory
                self._graphs[key] = self._capture(*key, pool, capture_error_mode)
            log.info("captured %d CUDA graphs of steps carrying prefill (tokens %s x sequences %s) in %.1fs",
                     len(self._graphs), self.token_buckets, self.seq_buckets, time.perf_counter() - start)

    def keys(self) -> list[tuple[int, int, bool]]:
        """(token bucket, sequence bucket, mixed) of every graph (mixed: see the class docstring)."""
        top = self.seq_buckets[-1]
        return [(t, s, mixed) for t in self.token_buckets for s in self.seq_buckets if pairs_with(t, s, top)
                for mixed in ((False, True) if self.split_mixed and s > 1 else (False,))]

    def _step_input(self, t: int, s: int, mixed: bool = False) -> StepInput:
        md = PagedAttentionMetadata(self.storage.k, self.storage.v, self.slot_mapping[:t], self.block_tables[:s],
                                    self.seq_lens[:s], self.context_lens[:s], self.cu_seqlens_q[:s + 1],
                                    decode_only=False, mixed=mixed)
        return StepInput(self.input_ids[:t], self.positions[:t], [], self.logits_index[:s if self.wants_logits else 0],
                         paged=md)

    def _capture(self, t: int, s: int, mixed: bool, pool, capture_error_mode: str) -> torch.cuda.CUDAGraph:
        log.debug("capturing the step of %d tokens over %d sequences%s", t, s, " (mixed)" if mixed else "")
        # warm-up state: all t tokens one sequence's, written nowhere (slot -1)
        self.slot_mapping[:t].fill_(-1)
        self.cu_seqlens_q[:s + 1].fill_(t)
        self.cu_seqlens_q[0] = 0
        self.context_lens[:s].zero_()
        self.seq_lens[:s].fill_(0)
        self.seq_lens[0] = t
        inp = self._step_input(t, s, mixed)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # autotuning and lazy initialisation happen outside the capture
                out = self.executor.forward(inp)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        if self.logits is None:
            rows = self.seq_buckets[-1] if self.wants_logits else 0
            self.logits = torch.empty(rows, out.shape[1], dtype=out.dtype, device=out.device)
        keep = self.executor.keep_hidden
        if keep and self._hidden_buf is None:
            hidden = self.executor.hidden
            self._hidden_buf = hidden.new_empty(self.token_buckets[-1], hidden.shape[1])
        del out
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode=capture_error_mode):
            self.logits[:s].copy_(self.executor.forward(inp))
            if keep:
                self._hidden_buf[:t].copy_(self.executor.hidden)
        return graph

    def close(self) -> None:
        """Destroy the graphs now (idempotent); as DecodeGraphs.close, after the work queued on the device: graphs
        that recorded NCCL collectives (tensor parallelism) must go before the process group is left."""
        if self._graphs:
            try:
                torch.cuda.synchronize(self.storage.device)
            except RuntimeError as e:  # a failed device: the graphs still go
                log.warning("closing the step graphs: %s", e)
        for graph in self._graphs.values():
            graph.reset()
        self._graphs.clear()

    def bucket_for(self, num_tokens: int, num_seqs: int, num_rows: int = 0) -> tuple[int, int] | None:
        """The (token bucket, sequence bucket) of a step, or None when it is larger than the largest. The sequence
        bucket also bounds the logits rows (``num_rows``): a speculative verify step selects k + 1 rows of a
        decode, and is padded to a sequence bucket that holds all of them."""
        t = next((b for b in self.token_buckets if b >= num_tokens), None)
        if t is None:
            return None
        top = self.seq_buckets[-1]
        s = next((b for b in self.seq_buckets if b >= max(num_seqs, num_rows) and pairs_with(t, b, top)), None)
        return None if s is None or s > t else (t, s)

    def run(self, step: PackedStep,
            feed: tuple[torch.Tensor, list[int], list[int]] | None = None) -> torch.Tensor:
        """Replay (or, without graphs, run eagerly) the padded step; returns the logits of
        ``step.logits_rows`` [len(logits_rows), vocab] (a view of the static buffer, valid until the next
        run). The inputs travel through pinned staging buffers used in turn, as in ``DecodeGraphs.run``.
        ``feed`` = (tokens, rows, packed rows): input ids still on the device (the tokens the step in flight
        sampled), tokens[rows[i]] going to packed row packed_rows[i] in place of its placeholder."""
        n, num_seqs, rows = step.num_tokens, step.num_seqs, len(step.logits_rows)
        key = self.bucket_for(n, num_seqs, rows)
        assert key is not None and n >= 1, f"{n} tokens over {num_seqs} sequences ({rows} logits rows): no step bucket"
        t, s = key
        cu = step.cu_seqlens_q
        mixed = self.split_mixed and mixed_step([b - a for a, b in zip(cu, cu[1:])])
        turn = self._turn
        tabs, fed = self._staging[turn]
        self._turn ^= 1
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()  # done already on the serving path, which reads each step back
        pad_t, pad_s = t - n, s - num_seqs
        host = self._inputs.host(turn)
        host["tokens"][:, :t] = torch.tensor([step.input_ids + [0] * pad_t, step.positions + [0] * pad_t,
                                              step.slots + [-1] * pad_t], dtype=torch.long)
        host["rows"][:s] = torch.tensor(step.logits_rows + [0] * (s - rows), dtype=torch.long)
        zeros = [0] * (pad_s + 1)
        host["seqs"][:, :s + 1] = torch.tensor([step.seq_lens + zeros, step.context_lens + zeros,
                                                step.cu_seqlens_q + [n] * pad_s], dtype=torch.int32)
        nb = self._inputs.pin
        self._inputs.copy(turn)
        tables = tabs.fill(step.block_tables, s)
        if tables.shape[1]:
            self.block_tables[:s, :tables.shape[1]].copy_(tables, non_blocking=nb)
        if feed is not None:
            tokens, sources, targets = feed
            k = len(sources)
            fed[:2 * k] = torch.tensor(sources + targets, dtype=torch.long)
            index = fed[:2 * k].to(self.input_ids.device, non_blocking=nb)
            self.input_ids.index_copy_(0, index[k:], tokens.index_select(0, index[:k]))
        if nb:
            self._copied[turn] = torch.cuda.Event()
            self._copied[turn].record()
        graph = self._graphs.get((t, s, mixed))
        if graph is None:  # not captured: the same padded step, eagerly
            logits = self.executor.forward(self._step_input(t, s, mixed))[:rows]
            if self.executor.keep_hidden:
                self.hidden = self.executor.hidden[:n]
            return logits
        graph.replay()
        if self._hidden_buf is not None:
            self.hidden = self._hidden_buf[:n]
        return self.logits[:rows]
