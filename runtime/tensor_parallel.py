"""Tensor parallelism at run time: one process per rank over torch.distributed (NCCL on CUDA, gloo on CPU).

    rank 0 (this process)                               ranks 1..tp_size-1 (spawned here, or torchrun's)
    engine, scheduler, sampling                         the same graph over their own weight file
    TPExecutor.forward(inp):                            serve_steps():
      broadcast the step: a fixed int64 header    ───►   check the header, take the payload, rebuild the
        and its int64 payload (sequences, block           StepInput over their own KV cache (their kv heads,
        tables, ids, positions, rows, slots...)           rank 0's block tables)
      run the local graph: its all_reduce /        ◄──►   run it: the same collectives, in the same order
        all_gather nodes meet the workers' ones
      logits -> sampling, once, on rank 0                 logits: none asked for (replicated lm_head)

Each rank's KV cache holds its own kv heads; rank 0's block manager decides the blocks of all of them,
since every rank's pool has the same number of blocks. One tensor-parallel engine per process: the
collectives run on the default process group.

The message (``_send`` / ``_receive``): nothing is pickled; the header and its payload back to back, int64 on the
rank's device (NCCL on CUDA), in one broadcast of FIRST_INTS ints (the tail unused) and a second of the rest only
when the message is longer (a step carrying long prompts, a replay with long block tables):

    header  [len(HEADER)]  magic, kind (index in KINDS), flags (decode_only, profile; capture), meta_len, data_len,
                           num_seqs, num_tensors, num_freed, num_tokens, num_rows, num_fed, paged pool (num_blocks,
                           block_size), graphs (max_num_seqs, max_seq_len), plan (gpu_memory_utilization as
                           float64 bits, kv_cache_bytes, num_blocks; -1: not given)
    payload [meta_len + data_len]
      meta, read on the host:
        "step":        per tensor (name index in _PACKED, dtype index in _DTYPES, ndim, 2 dims); per sequence
                       (num_context, num_new, 0 = paged | 1 = contiguous, table length | cache id, 0 | capacity);
                       freed cache ids; the paged sequences' block tables, back to back
        "replay":      positions [n], slots [n], block table lengths [n], the tables back to back
        "step_graphs": token buckets [num_tokens], sequence buckets [num_seqs] (rank 0's StepGraphs', exactly)
        "step_replay": a packed step of T = num_tokens tokens over S = num_seqs sequences: input ids [T],
                       positions [T], slots [T], cu_seqlens_q [S + 1], context lengths [S], block table
                       lengths [S], logits rows [num_rows], fed rows [num_fed] (indices into the data), their
                       packed rows [num_fed], the tables back to back
      data, left on the device: the step's tensors as int64, in order ("step"); the input ids [n] ("replay"); the
        tokens the step in flight sampled ("step_replay" with fed rows; none without)

"heartbeat", "stop", "graphs" and "plan" are a header alone; a decode graph replay's input ids ride in its payload,
on the device when the step in flight sampled them, as do a step replay's fed tokens. The receiver reads the first
broadcast to the host once; it checks every header field before it reads a payload, and every record against the
header: a field out of range or counts that disagree raise StepMessageError naming the field, and the worker exits
(rank 0 then sees it gone). A replay is then checked against the worker's captured buckets and its paged pool.
"plan" (the memory plan, ``agree_kv_blocks``) is followed by one all_gather of every rank's own KV block count;
the least sizes every rank's pool (``runtime.memory.least_kv_blocks``).

Failure: a spawned worker that exits (crash, OOM kill) is seen at once by a thread watching its process
sentinel; the engine is marked failed with an error log line naming the rank and its exit code, and every
later step raises WorkerFailure (the server's /health turns 503). A step that raises, or a collective
that fails or waits past COLLECTIVE_TIMEOUT_S (a hung rank), fails the engine the same way: after a
broken step the ranks' collectives no longer line up. While idle, rank 0 sends a heartbeat every
HEARTBEAT_S so the workers' wait for the next step never reaches that timeout. Under torchrun, its agent
tears the whole group down when a rank dies. torchrun may span nodes (``--nnodes``): ranks are global, each
process takes the GPU of its LOCAL_RANK on its own node and the weight file of its RANK.

CUDA graphs (TPDecodeGraphs, TPStepGraphs): every rank captures its shard's decode step ("graphs") and its steps
carrying prefill ("step_graphs": rank 0's token and sequence buckets) for the same buckets in lockstep, and replays
one when rank 0 broadcasts a "replay" or "step_replay" message; the all_reduces are NCCL (or one-shot all-reduce)
kernels inside the graphs. No collective timeout covers those kernels: if a worker dies during a replay, rank 0's
GPU waits in the graph for good. The engine thread does not: its wait for the step's tokens polls the engine's failure
(``runtime.serving.wait_for_device``), which the sentinel thread sets, and raises it, so the step's requests fail
with it and /health turns 503 (the log line names the rank). The graphs hold NCCL resources, so they are destroyed
before the group is left.
"""

from __future__ import annotations

import atexit
import faulthandler
import itertools
import logging
import multiprocessing.connection
import os
import signal
import struct
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from runtime import collectives
from runtime.artifact import Artifact, ArtifactError, open_artifact
from runtime.cuda_graphs import DEFAULT_STEP_TOKEN_BUCKETS, PackedStep, StepGraphs, step_buckets
from runtime.executor import LONG_ROPE_OFFSET, Executor, PagedAttentionMetadata, SeqSlice, StepInput, mixed_step
from runtime.kv_cache import SequenceKV
from runtime.memory import MemoryPlan, fit_kv_blocks, least_kv_blocks, plan_budget, tensor_bytes
from runtime.paged_kv import PagedKVStorage, PagedSequenceKV

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = float(os.environ.get("LLM_BUILDER_TP_TIMEOUT_S", "120"))  # a step's wait for the slowest rank
# debugging a hang: every rank prints all its threads' Python stacks to stderr every this many seconds
STACKS_ENV = "LLM_BUILDER_TP_STACKS_S"
HEARTBEAT_S = 5.0  # idle rank 0 pings the workers this often (well under the timeout)
LOCK_POLL_S = 0.05  # a thread waiting for the group looks at the engine's failure this often
# graph captures with NCCL kernels: other threads (ProcessGroupNCCL's watchdog) may query CUDA meanwhile
CAPTURE_MODE = os.environ.get("LLM_BUILDER_TP_CAPTURE_MODE", "thread_local")
START_TIMEOUT_S = float(os.environ.get("LLM_BUILDER_TP_START_TIMEOUT_S", "900"))  # workers' start and weight load


class WorkerFailure(RuntimeError):
    """A tensor-parallel rank died, or a step or collective failed: this engine cannot step any more."""


@dataclass(frozen=True)
class RankSpec:
    """Where one rank runs."""

    rank: int
    tp_size: int
    device: torch.device  # cuda:<first + rank> (one GPU per rank), or cpu
    backend: str  # nccl on CUDA, gloo on CPU


def rank_spec(device: torch.device | str, rank: int, tp_size: int) -> RankSpec:
    """Rank ``rank``'s device and backend when rank 0 runs on ``device`` (cuda:N puts the ranks on N, N+1...)."""
    device = torch.device(device)
    if device.type == "cuda":
        return RankSpec(rank, tp_size, torch.device("cuda", (device.index or 0) + rank), "nccl")
    return RankSpec(rank, tp_size, torch.device("cpu"), "gloo")


def check_devices(device: torch.device, tp_size: int) -> None:
    """Raise ArtifactError unless this host has the GPUs a ``tp_size`` artifact needs on ``device``."""
    if device.type != "cuda":
        return
    first, count = device.index or 0, torch.cuda.device_count()
    if first + tp_size > count:
        raise ArtifactError(f"the artifact is sharded for tp_size {tp_size}: one rank per GPU, on cuda:{first}.."
                            f"cuda:{first + tp_size - 1}, but this host has {count} GPU(s); run it on a host with "
                            f"{tp_size} GPUs (or rebuild it with parallel.tp_size <= {max(count - first, 1)})")


def torchrun_rank() -> int | None:
    """This process's rank when torchrun (or another launcher setting RANK / WORLD_SIZE) started it, else None."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ and "MASTER_ADDR" in os.environ:
        return int(os.environ["RANK"])
    return None


# --- the step message ------------------------------------------------------------------------------
# Every message: a header of len(HEADER) int64s, then (when meta_len + data_len > 0) a payload of meta_len ints the
# receiver reads on the host followed by data_len ints that stay on the device, back to back, broadcast as FIRST_INTS
# ints (the tail unused when shorter) and, when longer, a second broadcast of the rest. Nothing is pickled.
MAGIC = 0x54504D31  # "TPM1": the first field of every header (else the ranks' messages are out of step)
KINDS = ("heartbeat", "stop", "step", "graphs", "replay", "plan", "step_graphs", "step_replay")  # "kind" indexes this
HEADER = ("magic", "kind", "flags", "meta_len", "data_len", "num_seqs", "num_tensors", "num_freed", "num_tokens",
          "num_rows", "num_fed", "pool_blocks", "block_size", "max_num_seqs", "max_seq_len", "gpu_memory_utilization",
          "kv_cache_bytes", "num_blocks")
_H = {name: i for i, name in enumerate(HEADER)}
_COUNTS = HEADER[_H["meta_len"]:_H["gpu_memory_utilization"]]  # counts and sizes: each in 0..MAX_MESSAGE_INTS
FLAG_DECODE_ONLY = 1  # "step": paged metadata with one new token per sequence
FLAG_PROFILE = 2  # "step": the memory plan's profiling step (every rank measures its activation peak)
FLAG_CAPTURE = 4  # "step_graphs": capture CUDA graphs; without it every rank runs the padded steps eagerly (CPU)
_FLAGS = {"step": (FLAG_DECODE_ONLY | FLAG_PROFILE, "bits 1 and 2"), "step_graphs": (FLAG_CAPTURE, "bit 4")}
MAX_MESSAGE_INTS = 1 << 27  # a payload bound far past any step's (1 GiB of int64)
FIRST_INTS = 8192  # a message's first broadcast (64 KiB): a decode replay of 64 sequences of 64 blocks takes 4,370; a
# step replay of a 128-token prompt of 8 blocks beside 7 decodes of 64 blocks, 1,005
# StepInput tensors, in this order when present: each one a record (name index in _PACKED, dtype index in _DTYPES,
# ndim, dims padded to _MAX_DIMS) in meta, its values (as int64) in data
_PACKED = ("input_ids", "positions", "logits_indices", "slot_mapping", "block_tables", "seq_lens", "context_lens",
           "cu_seqlens_q")
_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
_MAX_DIMS = 2
_TENSOR_RECORD = 3 + _MAX_DIMS
_SEQ_RECORD = 5  # (num_context, num_new, kv kind, a, b): paged: a = table length; contiguous: (cache id, capacity)
_PAGED, _CONTIGUOUS = 0, 1


class StepMessageError(ValueError):
    """A message from rank 0 that does not decode: a field out of range, or counts that disagree."""


@dataclass
class StepMessage:
    """What rank 0 broadcasts before each step, decoded; on the wire it is a fixed int64 header and one int64
    payload (``_encode``, ``_receive``; the module docstring lists the layout)."""

    kind: str  # KINDS: "step", "graphs" (capture the decode graphs), "replay" (a decode graph), "step_graphs" (capture
    # the graphs of steps carrying prefill), "step_replay" (one of them), "plan" (the memory plan: every rank's KV
    # block count), "heartbeat" or "stop"
    tensors: list[tuple[str, tuple[int, ...], torch.dtype]] = field(default_factory=list)  # packed order
    # per sequence: (num_context, num_new, kv) where kv is ("paged", block table) or ("seq", cache id, capacity)
    seqs: list[tuple] = field(default_factory=list)
    paged_pool: tuple[int, int] | None = None  # (num_blocks, block_size) of rank 0's paged KV storage
    decode_only: bool = False  # paged metadata: every sequence has one new token
    freed: list[int] = field(default_factory=list)  # ids of contiguous caches rank 0 has dropped
    graphs: tuple[int, int] | None = None  # "graphs": (max_num_seqs, max_seq_len) of rank 0's DecodeGraphs
    # "replay": (input ids, positions, slots, block tables) as DecodeGraphs.run takes them. Sent: host ids or a device
    # tensor (sampled by the step in flight); received: always a device tensor (the payload's data)
    replay: tuple | None = None
    profile: bool = False  # "step": the memory plan's profiling step
    # "plan": (gpu_memory_utilization, kv_cache_bytes or None, num_blocks or None, block_size) of the ServingConfig
    plan: tuple[float, int | None, int | None, int] | None = None
    # "step_graphs": rank 0's StepGraphs' (token buckets, sequence buckets), with ``graphs`` = (max rows, max_seq_len)
    buckets: tuple[list[int], list[int]] | None = None
    capture: bool = False  # "step_graphs": CUDA graphs, else the padded steps run eagerly (StepGraphs(capture=False))
    packed: PackedStep | None = None  # "step_replay": the packed step, as StepGraphs.run takes it
    # "step_replay": StepGraphs.run's feed (tokens, rows, packed rows): the tokens the step in flight sampled, on the
    # device (sent and received: the payload's data), rows into them, the packed rows they go to; None: no feed
    feed: tuple[torch.Tensor, list[int], list[int]] | None = None


def _encode(msg: StepMessage, data_len: int) -> tuple[list[int], list[int]]:
    """(header, meta) of ``msg``; its data (``data_len`` ints: the step's tensors, a replay's ids) travels beside."""
    h = [0] * len(HEADER)
    h[_H["magic"]], h[_H["kind"]] = MAGIC, KINDS.index(msg.kind)
    h[_H["flags"]] = FLAG_DECODE_ONLY * msg.decode_only | FLAG_PROFILE * msg.profile | FLAG_CAPTURE * msg.capture
    if msg.paged_pool is not None:
        h[_H["pool_blocks"]], h[_H["block_size"]] = msg.paged_pool
    if msg.graphs is not None:
        h[_H["max_num_seqs"]], h[_H["max_seq_len"]] = msg.graphs
    meta: list[int] = []
    if msg.kind == "step":
        for name, shape, dtype in msg.tensors:
            if name not in _PACKED or dtype not in _DTYPES or len(shape) > _MAX_DIMS:
                raise ValueError(f"step tensor {name} {tuple(shape)} {dtype} has no place in the step message (names "
                                 f"{_PACKED}, integer dtypes, at most {_MAX_DIMS} dims)")
            meta += [_PACKED.index(name), _DTYPES.index(dtype), len(shape), *shape, *[0] * (_MAX_DIMS - len(shape))]
        tables: list[int] = []
        for num_context, num_new, kv in msg.seqs:
            if kv[0] == "paged":
                meta += [num_context, num_new, _PAGED, len(kv[1]), 0]
                tables += kv[1]
            else:
                meta += [num_context, num_new, _CONTIGUOUS, kv[1], kv[2]]
        meta += msg.freed
        meta += tables
        h[_H["num_tensors"]], h[_H["num_seqs"]], h[_H["num_freed"]] = len(msg.tensors), len(msg.seqs), len(msg.freed)
    elif msg.kind == "replay":
        _, positions, slots, tables = msg.replay
        meta = [*positions, *slots, *(len(t) for t in tables)]
        for t in tables:
            meta += t
        h[_H["num_seqs"]] = len(positions)
    elif msg.kind == "step_graphs":
        tokens, seqs = msg.buckets
        meta = [*tokens, *seqs]
        h[_H["num_tokens"]], h[_H["num_seqs"]] = len(tokens), len(seqs)
    elif msg.kind == "step_replay":
        step = msg.packed
        _, rows, targets = msg.feed or (None, [], [])
        meta = [*step.input_ids, *step.positions, *step.slots, *step.cu_seqlens_q, *step.context_lens,
                *(len(t) for t in step.block_tables), *step.logits_rows, *rows, *targets]
        for t in step.block_tables:
            meta += t
        h[_H["num_tokens"]], h[_H["num_seqs"]] = step.num_tokens, step.num_seqs
        h[_H["num_rows"]], h[_H["num_fed"]] = len(step.logits_rows), len(rows)
    elif msg.kind == "plan":
        utilization, kv_cache_bytes, num_blocks, block_size = msg.plan
        h[_H["gpu_memory_utilization"]] = struct.unpack("<q", struct.pack("<d", utilization))[0]  # the float's bits
        h[_H["kv_cache_bytes"]] = -1 if kv_cache_bytes is None else kv_cache_bytes
        h[_H["num_blocks"]] = -1 if num_blocks is None else num_blocks
        h[_H["block_size"]] = block_size
    h[_H["meta_len"]], h[_H["data_len"]] = len(meta), data_len
    return h, meta


def _send(msg: StepMessage, data: list, spec: RankSpec) -> None:
    """Rank 0: broadcast ``msg``: its header, its meta and its ``data`` (int tensors, on the device or the host, or
    lists of ints) flattened to int64, in one broadcast of FIRST_INTS when they fit (a decode replay of up to a few
    hundred short sequences), else that and one more of the rest. On CUDA the host part goes in one pinned copy
    queued on the stream, device tensors are never read back, and the collectives run on the device."""
    data_len = sum(d.numel() if isinstance(d, torch.Tensor) else len(d) for d in data)
    header, meta = _encode(msg, data_len)
    host, parts = header + meta, []
    for d in data:
        if isinstance(d, torch.Tensor):
            parts.append(d.reshape(-1))
        elif parts:  # host ints after a device tensor
            parts.append(torch.tensor(d, dtype=torch.int64))
        else:  # host ints straight after the meta: in the same copy
            host += d
    cuda = spec.device.type == "cuda"
    total = len(host) + sum(p.numel() for p in parts)
    flat = torch.empty(max(total, FIRST_INTS), dtype=torch.int64, device=spec.device)
    wire = torch.tensor(host, dtype=torch.int64, pin_memory=cuda)
    flat[:len(host)].copy_(wire, non_blocking=cuda)  # the caching host allocator keeps the pinned block until it ran
    at = len(host)
    for part in parts:
        flat[at:at + part.numel()].copy_(part, non_blocking=cuda)
        at += part.numel()
    dist.broadcast(flat[:FIRST_INTS], src=0)
    if total > FIRST_INTS:
        dist.broadcast(flat[FIRST_INTS:], src=0)


def _receive(spec: RankSpec) -> tuple[StepMessage, dict[str, torch.Tensor]]:
    """A worker: receive rank 0's next message; returns it and a step's tensors by name (on this rank's device).
    Raises StepMessageError for a header or payload that does not decode (before reading a payload it announces).
    One read to the host per message: the header and meta of the first broadcast (and of the second, if any)."""
    first = torch.empty(FIRST_INTS, dtype=torch.int64, device=spec.device)
    dist.broadcast(first, src=0)
    head = first.cpu()
    h = _check_header(head[:len(HEADER)].tolist())
    meta_len, data_len = h["meta_len"], h["data_len"]
    total = len(HEADER) + meta_len + data_len
    if total <= FIRST_INTS:
        payload, host = first[len(HEADER):total], head[len(HEADER):total]
    else:
        rest = torch.empty(total - FIRST_INTS, dtype=torch.int64, device=spec.device)
        dist.broadcast(rest, src=0)
        payload = torch.cat([first[len(HEADER):], rest])
        host = payload[:meta_len].cpu() if meta_len > FIRST_INTS - len(HEADER) else head[len(HEADER):]
    if not meta_len + data_len:
        return _decode(h, [], None)
    return _decode(h, host[:meta_len].tolist(), payload[meta_len:])


def _bad(name: str, value, expected: str) -> StepMessageError:
    return StepMessageError(f"malformed message from tensor-parallel rank 0: {name} is {value} ({expected})")


def _check_header(values: list[int]) -> dict[str, int]:
    """The header's fields by name, each checked against what its kind allows."""
    h = dict(zip(HEADER, values))
    if h["magic"] != MAGIC:
        raise _bad("header field 'magic'", hex(h["magic"]), f"expected {hex(MAGIC)}: the ranks' messages are out of "
                                                            f"step, or the ranks run different versions")
    if not 0 <= h["kind"] < len(KINDS):
        raise _bad("header field 'kind'", h["kind"], f"not a message kind: 0..{len(KINDS) - 1} for {', '.join(KINDS)}")
    kind = KINDS[h["kind"]]
    flags, which = _FLAGS.get(kind, (0, "none"))
    if h["flags"] & ~flags:
        raise _bad("header field 'flags'", h["flags"], f"a {kind!r} message takes {which}")
    for name in _COUNTS:
        if not 0 <= h[name] <= MAX_MESSAGE_INTS:
            raise _bad(f"header field {name!r}", h[name], f"must be in 0..{MAX_MESSAGE_INTS}")
    if h["meta_len"] + h["data_len"] > MAX_MESSAGE_INTS:
        raise _bad("header fields 'meta_len' + 'data_len'", h["meta_len"] + h["data_len"],
                   f"a payload is at most {MAX_MESSAGE_INTS} ints")
    if kind in ("heartbeat", "stop", "graphs", "plan"):
        for name in ("meta_len", "data_len"):
            if h[name]:
                raise _bad(f"header field {name!r}", h[name], f"a {kind!r} message has no payload")
    if kind == "step":
        if h["num_tensors"] > len(_PACKED):
            raise _bad("header field 'num_tensors'", h["num_tensors"], f"a step packs at most {len(_PACKED)} tensors")
        fixed = _TENSOR_RECORD * h["num_tensors"] + _SEQ_RECORD * h["num_seqs"] + h["num_freed"]
        if h["meta_len"] < fixed:
            raise _bad("header field 'meta_len'", h["meta_len"], f"its tensor, sequence and freed-cache records "
                                                                 f"alone take {fixed}")
        if h["pool_blocks"] and not h["block_size"]:
            raise _bad("header field 'block_size'", 0, "a paged pool's blocks hold at least one token")
    elif kind == "replay":
        if not h["num_seqs"] or h["data_len"] != h["num_seqs"] or h["meta_len"] < 3 * h["num_seqs"]:
            raise _bad("header fields 'num_seqs', 'data_len', 'meta_len'",
                       (h["num_seqs"], h["data_len"], h["meta_len"]),
                       "a replay of n >= 1 sequences has n input ids and at least 3n meta ints")
    elif kind in ("graphs", "step_graphs"):
        for name in ("pool_blocks", "block_size", "max_num_seqs", "max_seq_len") + \
                (("num_tokens", "num_seqs") if kind == "step_graphs" else ()):
            if h[name] < 1:
                raise _bad(f"header field {name!r}", h[name], f"a {kind!r} message needs it >= 1")
        if kind == "step_graphs" and (h["data_len"] or h["meta_len"] != h["num_tokens"] + h["num_seqs"]):
            raise _bad("header fields 'meta_len', 'data_len'", (h["meta_len"], h["data_len"]),
                       f"a 'step_graphs' message has its {h['num_tokens']} token and {h['num_seqs']} sequence buckets "
                       f"in its meta, and no data")
    elif kind == "step_replay":
        if h["num_tokens"] < 1 or h["num_seqs"] < 1:
            raise _bad("header fields 'num_tokens', 'num_seqs'", (h["num_tokens"], h["num_seqs"]),
                       "a step replay has at least one token and one sequence")
        if (h["num_fed"] == 0) != (h["data_len"] == 0):
            raise _bad("header fields 'num_fed', 'data_len'", (h["num_fed"], h["data_len"]),
                       "fed rows take their tokens from the data, and only they do: both 0, or both >= 1")
        fixed = 3 * h["num_tokens"] + 3 * h["num_seqs"] + 1 + h["num_rows"] + 2 * h["num_fed"]
        if h["meta_len"] < fixed:
            raise _bad("header field 'meta_len'", h["meta_len"], f"a step replay's records before its block tables "
                                                                 f"alone take {fixed}")
    elif kind == "plan":
        utilization = struct.unpack("<d", struct.pack("<q", h["gpu_memory_utilization"]))[0]
        if not 0 < utilization <= 1:
            raise _bad("header field 'gpu_memory_utilization'", utilization, "must be in (0, 1]")
        for name in ("kv_cache_bytes", "num_blocks"):
            if h[name] < -1 or h[name] == 0:
                raise _bad(f"header field {name!r}", h[name], "-1 (not given) or >= 1")
        if h["block_size"] < 1:
            raise _bad("header field 'block_size'", h["block_size"], "must be >= 1")
    return h


class _Reader:
    """Reads a payload's meta ints in order; too few, or a value out of range, is a StepMessageError."""

    def __init__(self, values: list[int]) -> None:
        self.values, self.at = values, 0

    def take(self, n: int, what: str) -> list[int]:
        if self.at + n > len(self.values):
            raise _bad(f"the payload's {what}", f"past its end ({len(self.values)} meta ints)", "meta_len too small")
        out = self.values[self.at:self.at + n]
        self.at += n
        return out

    def end(self, kind: str) -> None:
        if self.at != len(self.values):
            raise _bad("header field 'meta_len'", len(self.values), f"the {kind!r} message's records take {self.at}")


def _in_range(values: list[int], lo: int, hi: int, what: str) -> None:
    """Raise unless every one of ``values`` is in [lo, hi)."""
    if values and (min(values) < lo or max(values) >= hi):
        bad = next(v for v in values if not lo <= v < hi)
        raise _bad(what, bad, f"must be in {lo}..{hi - 1}")


def _decode(h: dict[str, int], meta: list[int], data: torch.Tensor | None) -> tuple[StepMessage, dict]:
    """The message a checked header and its payload (meta ints on the host, data on the device) describe."""
    kind = KINDS[h["kind"]]
    msg = StepMessage(kind, decode_only=bool(h["flags"] & FLAG_DECODE_ONLY), profile=bool(h["flags"] & FLAG_PROFILE))
    if h["pool_blocks"]:
        msg.paged_pool = (h["pool_blocks"], h["block_size"])
    if kind == "graphs":
        msg.graphs = (h["max_num_seqs"], h["max_seq_len"])
    elif kind == "plan":
        utilization = struct.unpack("<d", struct.pack("<q", h["gpu_memory_utilization"]))[0]
        msg.plan = (utilization, None if h["kv_cache_bytes"] == -1 else h["kv_cache_bytes"],
                    None if h["num_blocks"] == -1 else h["num_blocks"], h["block_size"])
    elif kind == "replay":
        n, r = h["num_seqs"], _Reader(meta)
        positions, slots, lengths = r.take(n, "positions"), r.take(n, "slots"), r.take(n, "block table lengths")
        _in_range(lengths, 0, MAX_MESSAGE_INTS, "a replay's block table length")
        _in_range(positions, 0, MAX_MESSAGE_INTS, "a replay's position")
        tables = [r.take(k, f"block table {i}") for i, k in enumerate(lengths)]
        r.end(kind)
        msg.replay = (data, positions, slots, tables)
    elif kind == "step_graphs":
        msg.graphs, msg.capture = (h["max_num_seqs"], h["max_seq_len"]), bool(h["flags"] & FLAG_CAPTURE)
        r = _Reader(meta)
        tokens, seqs = r.take(h["num_tokens"], "token buckets"), r.take(h["num_seqs"], "sequence buckets")
        _increasing(tokens, "the token buckets")
        _increasing(seqs, "the sequence buckets")
        top = min(h["max_num_seqs"], tokens[-1])
        if seqs[-1] != top:  # else a worker's StepGraphs would derive other buckets than rank 0's
            raise _bad("the largest sequence bucket", seqs[-1], f"must be min(max_num_seqs {h['max_num_seqs']}, the "
                                                                f"largest token bucket {tokens[-1]}) = {top}")
        r.end(kind)
        msg.buckets = (tokens, seqs)
    elif kind == "step_replay":
        msg.packed, msg.feed = _decode_step_replay(h, _Reader(meta), data)
    elif kind == "step":
        r = _Reader(meta)
        for i in range(h["num_tensors"]):
            name, dtype, ndim, *dims = r.take(_TENSOR_RECORD, f"tensor record {i}")
            _in_range([name], 0, len(_PACKED), f"tensor record {i}'s name index")
            _in_range([dtype], 0, len(_DTYPES), f"tensor {_PACKED[name]}'s dtype code")
            _in_range([ndim], 0, _MAX_DIMS + 1, f"tensor {_PACKED[name]}'s ndim")
            _in_range(dims[:ndim], 0, MAX_MESSAGE_INTS, f"a dimension of tensor {_PACKED[name]}")
            msg.tensors.append((_PACKED[name], tuple(dims[:ndim]), _DTYPES[dtype]))
        records = [r.take(_SEQ_RECORD, f"sequence record {i}") for i in range(h["num_seqs"])]
        msg.freed = r.take(h["num_freed"], "freed cache ids")
        for i, (num_context, num_new, kv, a, b) in enumerate(records):
            _in_range([num_context, num_new], 0, MAX_MESSAGE_INTS, f"sequence {i}'s num_context / num_new")
            if kv == _PAGED:
                if not h["pool_blocks"]:
                    raise _bad(f"sequence {i}'s kv kind", kv, "a paged sequence in a step with no paged pool")
                _in_range([a], 0, MAX_MESSAGE_INTS, f"sequence {i}'s block table length")
                table = r.take(a, f"sequence {i}'s block table")
                _in_range(table, 0, h["pool_blocks"], f"a block of sequence {i}'s table")
                msg.seqs.append((num_context, num_new, ("paged", table)))
            elif kv == _CONTIGUOUS:
                _in_range([a], 0, 1 << 62, f"sequence {i}'s cache id")
                _in_range([b], 1, MAX_MESSAGE_INTS, f"sequence {i}'s cache capacity")
                msg.seqs.append((num_context, num_new, ("seq", a, b)))
            else:
                raise _bad(f"sequence {i}'s kv kind", kv, f"{_PAGED} (paged) or {_CONTIGUOUS} (contiguous cache)")
        r.end(kind)
        total = sum(_numel(shape) for _, shape, _ in msg.tensors)
        if total != h["data_len"]:
            raise _bad("header field 'data_len'", h["data_len"], f"the step's tensors hold {total} values")
        return msg, _unpack(msg.tensors, data)
    return msg, {}


def _increasing(values: list[int], what: str) -> None:
    """Raise unless ``values`` are bucket sizes: each >= 1, strictly increasing, at most MAX_MESSAGE_INTS."""
    _in_range(values, 1, MAX_MESSAGE_INTS + 1, f"one of {what}")
    if any(a >= b for a, b in zip(values, values[1:])):
        raise _bad(what, values, "must increase strictly")


def _decode_step_replay(h: dict[str, int], r: _Reader,
                        data: torch.Tensor | None) -> tuple[PackedStep, tuple | None]:
    """A "step_replay" payload's packed step and feed, each field checked against the header's counts; the worker
    checks them against its captured buckets and its paged pool (``_WorkerState.step_replay``)."""
    n, num_seqs, num_fed = h["num_tokens"], h["num_seqs"], h["num_fed"]
    ids, positions, slots = r.take(n, "input ids"), r.take(n, "positions"), r.take(n, "slots")
    cu, context = r.take(num_seqs + 1, "cu_seqlens_q"), r.take(num_seqs, "context lengths")
    lengths, rows = r.take(num_seqs, "block table lengths"), r.take(h["num_rows"], "logits rows")
    fed, targets = r.take(num_fed, "fed rows"), r.take(num_fed, "fed targets")
    for values, what in ((ids, "input id"), (positions, "position"), (slots, "slot"),
                         (context, "context length"), (lengths, "block table length")):
        _in_range(values, 0, MAX_MESSAGE_INTS, f"a step replay's {what}")
    if cu[0] != 0 or cu[-1] != n or any(a > b for a, b in zip(cu, cu[1:])):
        raise _bad("a step replay's cu_seqlens_q", cu if len(cu) <= 16 else f"{cu[:8]}...{cu[-8:]}",
                   f"must rise from 0 to its {n} tokens, never falling")
    _in_range(rows, 0, n, "a step replay's logits row")
    _in_range(fed, 0, h["data_len"], "a step replay's fed row (an index into its data's fed tokens)")
    _in_range(targets, 0, n, "a step replay's fed target (a packed row)")
    tables = [r.take(k, f"sequence {i}'s block table") for i, k in enumerate(lengths)]
    r.end("step_replay")
    return PackedStep(ids, positions, slots, cu, context, tables, rows), (data, fed, targets) if num_fed else None


def _unpack(specs: list, flat: torch.Tensor | None) -> dict[str, torch.Tensor]:
    out, start = {}, 0
    for name, shape, dtype in specs:
        n = _numel(shape)
        out[name] = flat[start:start + n].view(shape).to(dtype)
        start += n
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def gather_ints(value: int, spec: RankSpec) -> list[int]:
    """Every rank's ``value``, by rank: one all_gather of an int64 tensor on this rank's device (every rank calls
    it at the same point of its message loop)."""
    mine = torch.tensor([value], dtype=torch.int64, device=spec.device)
    parts = [torch.empty_like(mine) for _ in range(spec.tp_size)]
    dist.all_gather(parts, mine)
    return [int(p) for p in torch.cat(parts).tolist()]


# --- rank 0 --------------------------------------------------------------------------------------
class TPExecutor:
    """Rank 0's executor: each ``forward`` runs the step on every rank. Same interface as ``Executor``."""

    def __init__(self, local: Executor, spec: RankSpec, workers: list | None = None, store=None) -> None:
        self.local = local  # rank 0's shard of the graph
        self.graph, self.params, self.dtype = local.graph, local.params, local.dtype
        self.device, self.use_kernels, self.outputs, self.num_layers = (local.device, local.use_kernels,
                                                                        local.outputs, local.num_layers)
        self.long_rope_from = local.long_rope_from
        self.spec = spec
        self.tp_size = spec.tp_size
        self.failure: WorkerFailure | None = None  # set once, by whichever thread sees the failure first
        self._workers = workers or []  # spawned processes (ranks 1..); empty under torchrun
        self._store = store  # the rendezvous store the process group uses: kept alive with it
        self._lock = threading.Lock()  # one step (or heartbeat) on the group at a time
        self._fail_lock = threading.Lock()  # the first failure is logged before any thread can see it
        self._cache_ids = itertools.count()
        self._caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # SequenceKV -> id on the workers
        self._freed: deque[int] = deque()
        self._last_sent = time.monotonic()
        self._closed = threading.Event()
        self._threads = [threading.Thread(target=self._heartbeat, name="tp-heartbeat", daemon=True)]
        if self._workers:
            self._threads.append(threading.Thread(target=self._monitor, name="tp-monitor", daemon=True))
        for t in self._threads:
            t.start()
        atexit.register(_close_at_exit, weakref.ref(self))  # before multiprocessing's own exit handler kills them

    def kv_layout(self):
        return self.local.kv_layout()

    @torch.inference_mode()
    def forward(self, inp: StepInput, profile: bool = False) -> torch.Tensor:
        """Run one step on every rank; returns rank 0's logits [num_selected, vocab] fp32. ``profile``: the memory
        plan's profiling step (``profile_forward``)."""
        def step() -> torch.Tensor:
            msg, data = self._message(inp)
            msg.profile = profile
            _send(msg, data, self.spec)
            return self.local.forward(inp)

        return self.locked(step, "a step")

    def profile_forward(self, inp: StepInput) -> torch.Tensor:
        """``forward`` for ServingEngine's profiling step: every worker measures its own activation peak over it
        (CUDA), its workspace in the memory plan that ``agree_kv_blocks`` then asks it for."""
        return self.forward(inp, profile=True)

    def agree_kv_blocks(self, plan: MemoryPlan, gpu_memory_utilization: float, kv_cache_bytes: int | None,
                        num_blocks: int | None) -> MemoryPlan:
        """Rank 0's memory ``plan`` (ServingConfig's figures as given) with the KV block count every rank can hold:
        each rank computes its own (its free memory, weights and workspace; ``_WorkerState.kv_blocks``), they are
        gathered, and the least is the pool of all (the ranks' pools must be the same size). Raises MemoryPlanError
        when that is less than one max_seq_len request needs, naming the rank."""
        msg = StepMessage("plan", plan=(gpu_memory_utilization, kv_cache_bytes, num_blocks, plan.block_size))

        def agree() -> list[int]:
            _send(msg, [], self.spec)
            return gather_ints(plan.num_blocks, self.spec)

        return least_kv_blocks(plan, self.locked(agree, "agreeing on the memory plan"))

    def locked(self, fn, what: str):
        """Run ``fn`` (which talks to the workers) holding the group; any failure fails the engine, since
        the ranks' collectives no longer line up after it. A failure seen while waiting for the group is raised at
        once: the thread holding it may be inside a collective that waits for a dead rank until its timeout."""
        while not self._lock.acquire(timeout=LOCK_POLL_S):
            if self.failure is not None:
                raise self.failure
        try:
            if self.failure is not None:
                raise self.failure
            try:
                return fn()
            except Exception as e:
                raise self._fail(self._dead_workers() or f"{what} failed on rank 0 ({type(e).__name__}: {e})") from e
            finally:
                self._last_sent = time.monotonic()
        finally:
            self._lock.release()

    def _message(self, inp: StepInput) -> tuple[StepMessage, list[torch.Tensor]]:
        msg = StepMessage("step")
        while self._freed:
            msg.freed.append(self._freed.popleft())
        for s in inp.seqs:
            kv = s.kv
            if isinstance(kv, PagedSequenceKV):
                msg.paged_pool = (kv.storage.num_blocks, kv.storage.block_size)
                msg.seqs.append((s.num_context, s.num_new, ("paged", list(kv.block_table))))
                continue
            cache_id = self._caches.get(kv)
            if cache_id is None:
                cache_id = self._caches[kv] = next(self._cache_ids)
                weakref.finalize(kv, self._freed.append, cache_id)
            msg.seqs.append((s.num_context, s.num_new, ("seq", cache_id, kv.capacity)))
        named = [("input_ids", inp.input_ids), ("positions", inp.positions)]
        if inp.logits_indices is not None:
            named.append(("logits_indices", inp.logits_indices))
        if inp.paged is not None:
            md = inp.paged
            msg.decode_only = md.decode_only
            named += [(n, getattr(md, n)) for n in _PACKED[3:]]
        msg.tensors = [(name, tuple(t.shape), t.dtype) for name, t in named]
        return msg, [t for _, t in named]

    # --- failure and shutdown --------------------------------------------------------------------
    def _fail(self, reason: str) -> WorkerFailure:
        with self._fail_lock:
            if self.failure is None:
                failure = WorkerFailure(f"tensor-parallel engine failed: {reason}; restart it")
                log.error("%s", failure)
                self.failure = failure
            return self.failure

    def _dead_workers(self) -> str:
        """Which spawned workers have exited, and how ('' if none): the cause behind a failed collective."""
        time.sleep(0.1)  # a peer's socket closes a moment before its process is reaped
        return "; ".join(f"worker rank {rank} (pid {p.pid}) exited with {exit_text(p.exitcode)}"
                         for rank, p in enumerate(self._workers, start=1) if not p.is_alive())

    def _monitor(self) -> None:
        """Watch the workers' process sentinels: an exit outside ``close`` fails the engine at once."""
        by_sentinel = {p.sentinel: (rank, p) for rank, p in enumerate(self._workers, start=1)}
        while not self._closed.is_set():
            for s in multiprocessing.connection.wait(list(by_sentinel), timeout=0.5):
                if self._closed.is_set():
                    return
                rank, p = by_sentinel[s]
                p.join(1.0)
                self._fail(f"worker rank {rank} (pid {p.pid}) exited with {exit_text(p.exitcode)}")
                return

    def _heartbeat(self) -> None:
        while not self._closed.wait(HEARTBEAT_S / 2):
            if self.failure is not None or time.monotonic() - self._last_sent < HEARTBEAT_S:
                continue
            if not self._lock.acquire(blocking=False):
                continue
            try:
                if self.failure is None and not self._closed.is_set():
                    _send(StepMessage("heartbeat"), [], self.spec)
            except Exception as e:
                self._fail(f"a heartbeat to the workers failed ({type(e).__name__}: {e})")
            finally:
                self._last_sent = time.monotonic()
                self._lock.release()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the workers and leave the process group. Safe to call twice, and after a failure."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._lock.acquire(timeout=COLLECTIVE_TIMEOUT_S):
            try:
                if self.failure is None:
                    _send(StepMessage("stop"), [], self.spec)
            except Exception as e:
                log.warning("could not tell the tensor-parallel workers to stop (%s); terminating them", e)
            finally:
                self._lock.release()
        if dist.is_initialized():  # while the workers leave too: NCCL's teardown waits for every rank
            _destroy_group(timeout)
        for p in self._workers:
            p.join(timeout)
            if p.is_alive():
                p.terminate()
                p.join(timeout)
        for t in self._threads:
            t.join(1.0)


def _destroy_group(timeout: float) -> None:
    """Leave the process group, giving up after ``timeout`` seconds: NCCL's teardown can wait forever on
    resources still held elsewhere, and closing an engine must not hang (the group is then left as is)."""
    collectives.reset()
    t = threading.Thread(target=dist.destroy_process_group, name="tp-destroy-group", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        log.warning("leaving the tensor-parallel process group did not finish in %.0f s; left behind", timeout)


class TPDecodeGraphs:
    """Decode steps in CUDA graphs on every rank (DecodeGraphs' interface, for ServingEngine on rank 0).

    Each rank captures its own shard's decode step for the same buckets, in the same order, warm-up steps
    included, so the collectives line up: the warm-ups run them, the captures record them as NCCL kernels.
    A replay sends the step's inputs to the workers in one broadcast (two with long block tables), the header and
    its payload (positions, slots and block tables from the host, then the input ids: host ones, or the device tensor
    the step in flight sampled, never read back) and every rank replays its graph, the recorded all_reduces meeting
    across ranks."""

    def __init__(self, executor: TPExecutor, storage: PagedKVStorage, max_num_seqs: int, max_seq_len: int) -> None:
        from runtime.cuda_graphs import DecodeGraphs

        self.executor = executor
        msg = StepMessage("graphs", paged_pool=(storage.num_blocks, storage.block_size),
                          graphs=(max_num_seqs, max_seq_len))
        self.local = executor.locked(lambda: (_send(msg, [], executor.spec),
                                              DecodeGraphs(executor.local, storage, max_num_seqs, max_seq_len,
                                                           capture_error_mode=CAPTURE_MODE))[1],
                                     "capturing the decode CUDA graphs")
        self.buckets = self.local.buckets

    def bucket_for(self, num_seqs: int) -> int | None:
        return self.local.bucket_for(num_seqs)

    def close(self) -> None:
        """Rank 0's graphs; the workers destroy theirs when told to stop. After a rank died they are left as they
        are: a replay may still be waiting for it on this GPU, and closing them would wait with it."""
        if self.executor.failure is not None:
            log.warning("tensor parallel: the decode graphs are left as they are (%s)", self.executor.failure)
            return
        self.local.close()

    def run(self, input_ids: list[int] | torch.Tensor, positions: list[int], slots: list[int],
            tables: list[list[int]]) -> torch.Tensor:
        msg = StepMessage("replay", replay=(input_ids, positions, slots, tables))
        ids = input_ids if isinstance(input_ids, torch.Tensor) else list(input_ids)

        def replay() -> torch.Tensor:
            _send(msg, [ids], self.executor.spec)
            return self.local.run(input_ids, positions, slots, tables)

        return self.executor.locked(replay, "a decode graph replay")


class TPStepGraphs:
    """Steps carrying prefill in CUDA graphs on every rank (StepGraphs' interface, for ServingEngine on rank 0).

    As TPDecodeGraphs: a "step_graphs" message carries rank 0's buckets (token and sequence buckets, max rows,
    max_seq_len, the paged pool) and every rank captures its shard's StepGraphs for exactly those buckets, in the
    same order (largest first), warm-ups included, so the collectives of each step line up across ranks. A run sends
    the packed step and its feed in a "step_replay" message (the host fields in its meta, the fed tokens the step in
    flight sampled as its data, never read back) and every rank stages it into its own static buffers and replays
    the same graph. ``capture=False``: every rank runs the same padded steps eagerly (tests on the CPU)."""

    def __init__(self, executor: TPExecutor, storage: PagedKVStorage, max_tokens: int, max_num_seqs: int,
                 max_seq_len: int, token_buckets: tuple[int, ...] = DEFAULT_STEP_TOKEN_BUCKETS,
                 seq_buckets: tuple[int, ...] | None = None, capture: bool = True) -> None:
        self.executor = executor
        tokens, seqs = step_buckets(max_tokens, max_num_seqs, token_buckets, seq_buckets)
        msg = StepMessage("step_graphs", paged_pool=(storage.num_blocks, storage.block_size),
                          graphs=(max_num_seqs, max_seq_len), buckets=(tokens, seqs), capture=capture)

        def capture_all():
            _send(msg, [], executor.spec)
            return StepGraphs(executor.local, storage, max_tokens, max_num_seqs, max_seq_len, tokens, seqs,
                              capture=capture, capture_error_mode=CAPTURE_MODE)

        self.local = executor.locked(capture_all, "capturing the step CUDA graphs")
        self.token_buckets, self.seq_buckets = self.local.token_buckets, self.local.seq_buckets

    def bucket_for(self, num_tokens: int, num_seqs: int, num_rows: int = 0) -> tuple[int, int] | None:
        return self.local.bucket_for(num_tokens, num_seqs, num_rows)

    def close(self) -> None:
        """Rank 0's graphs, as TPDecodeGraphs.close: the workers destroy theirs when told to stop; after a rank died
        they are left as they are."""
        if self.executor.failure is not None:
            log.warning("tensor parallel: the step graphs are left as they are (%s)", self.executor.failure)
            return
        self.local.close()

    def run(self, step: PackedStep, feed: tuple[torch.Tensor, list[int], list[int]] | None = None) -> torch.Tensor:
        msg = StepMessage("step_replay", packed=step, feed=feed)

        def replay() -> torch.Tensor:
            _send(msg, [feed[0]] if feed is not None else [], self.executor.spec)
            return self.local.run(step, feed)

        return self.executor.locked(replay, "a step graph replay")


def _close_at_exit(ref: weakref.ref) -> None:
    executor = ref()
    if executor is not None:
        executor.close()


def exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


# --- the workers ---------------------------------------------------------------------------------
class _WorkerState:
    """A worker's KV caches: the paged pool (sized like rank 0's) and contiguous caches by rank 0's ids."""

    def __init__(self, executor: Executor, spec: RankSpec) -> None:
        self.executor, self.spec = executor, spec
        self.layout = executor.kv_layout()
        self.storage: PagedKVStorage | None = None
        self.graphs = None  # DecodeGraphs, once rank 0 asks for them
        self.step_graphs = None  # StepGraphs, likewise
        self.caches: dict[int, SequenceKV] = {}
        self.workspace = 0  # activation peak of the memory plan's profiling step (CUDA), bytes
        # with a replicated lm_head no worker needs logits (its eager steps and decode graphs skip the lm_head's
        # GEMM, a full read of it per step); vocab-parallel logits are gathered by every rank
        self.no_logits = not any(n["op"] == "all_gather" for n in executor.graph["nodes"])
        self.vocab_size = int(executor.graph.get("meta", {}).get("vocab_size", 0)) or MAX_MESSAGE_INTS

    def _paged_storage(self, pool: tuple[int, int] | None) -> None:
        if pool is not None and (self.storage is None or (self.storage.num_blocks, self.storage.block_size) != pool):
            self.storage = PagedKVStorage(self.layout, *pool, self.spec.device)
            self.graphs = self.step_graphs = None  # captured over the old storage

    def capture_graphs(self, msg: StepMessage) -> None:
        from runtime.cuda_graphs import DecodeGraphs

        self._paged_storage(msg.paged_pool)
        self.graphs = DecodeGraphs(self.executor, self.storage, *msg.graphs, capture_error_mode=CAPTURE_MODE,
                                   logits=not self.no_logits)

    def replay(self, msg: StepMessage) -> None:
        input_ids, positions, slots, tables = msg.replay  # the ids: a device tensor (the payload's data)
        if self.graphs is None:
            raise StepMessageError("a 'replay' message before any 'graphs' message: this rank has no decode graphs")
        if len(positions) > self.graphs.buckets[-1]:
            raise _bad("a replay's num_seqs", len(positions),
                       f"the largest captured bucket is {self.graphs.buckets[-1]}")
        for table in tables:
            _in_range([len(table)], 0, self.graphs.max_blocks + 1, "a replay's block table length")
            _in_range(table, 0, self.storage.num_blocks, "a block of a replay's table")
        self.graphs.run(input_ids, positions, slots, tables)

    def capture_step_graphs(self, msg: StepMessage) -> None:
        """Rank 0's StepGraphs' buckets over this rank's shard and pool, in the same order (StepGraphs captures
        the keys largest first), so that each capture's collectives meet rank 0's."""
        self._paged_storage(msg.paged_pool)
        tokens, seqs = msg.buckets
        max_rows, max_seq_len = msg.graphs
        self.step_graphs = StepGraphs(self.executor, self.storage, tokens[-1], max_rows, max_seq_len, tokens, seqs,
                                      capture=msg.capture, capture_error_mode=CAPTURE_MODE,
                                      logits=not self.no_logits)
        assert (self.step_graphs.token_buckets, self.step_graphs.seq_buckets) == (tokens, seqs), \
            "a worker's step buckets must be rank 0's"

    def step_replay(self, msg: StepMessage) -> None:
        """Check the packed step against the captured buckets and this rank's pool, then run it as rank 0 does."""
        graphs, step = self.step_graphs, msg.packed
        if graphs is None:
            raise StepMessageError("a 'step_replay' message before any 'step_graphs' message: this rank has no step "
                                   "graphs")
        counts = (step.num_tokens, step.num_seqs, len(step.logits_rows))
        if graphs.bucket_for(*counts) is None:
            raise _bad("a step replay's (num_tokens, num_seqs, num_rows)", counts,
                       f"no captured bucket holds it: token buckets {graphs.token_buckets}, sequence buckets "
                       f"{graphs.seq_buckets} (at most the token bucket; they bound the logits rows too)")
        block_size, num_blocks = self.storage.block_size, self.storage.num_blocks
        _in_range(step.input_ids, 0, self.vocab_size, "a step replay's input id")
        positions = step.positions
        if getattr(self.executor, "long_rope_from", None) is not None:  # LongRoPE's offset: the rotary's alone
            _in_range(positions, 0, 2 * LONG_ROPE_OFFSET, "a step replay's position (with LongRoPE's offset)")
            positions = [p & (LONG_ROPE_OFFSET - 1) for p in positions]
        _in_range(positions, 0, graphs.max_blocks * block_size, "a step replay's position")
        _in_range(step.slots, 0, num_blocks * block_size, "a step replay's slot")
        for i, (table, seq_len) in enumerate(zip(step.block_tables, step.seq_lens)):
            _in_range([len(table)], 0, graphs.max_blocks + 1, f"a step replay's sequence {i}'s block table length")
            _in_range(table, 0, num_blocks, f"a block of a step replay's sequence {i}'s table")
            if seq_len > len(table) * block_size:
                raise _bad(f"a step replay's sequence {i}'s length (context + new tokens)", seq_len,
                           f"its table of {len(table)} blocks holds {len(table) * block_size} tokens")
        graphs.run(step, msg.feed)

    def profile(self, msg: StepMessage, t: dict[str, torch.Tensor]) -> None:
        """The memory plan's profiling step: on CUDA measured as ServingEngine measures rank 0's (the activation
        peak over the step, its cache included); its caches are then dropped, as rank 0 drops its own."""
        device = self.spec.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        inp = self.step_input(msg, t)
        self.executor.forward(inp)
        for _, _, kv in msg.seqs:
            if kv[0] == "seq":
                self.caches.pop(kv[1], None)
        del inp
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            self.workspace = int(torch.cuda.max_memory_allocated(device) - before)
            torch.cuda.empty_cache()

    def kv_blocks(self, msg: StepMessage) -> int:
        """This rank's figure for the memory plan: how many KV blocks of ``msg.plan``'s block size fit here, from
        this rank's own free memory (CUDA), weights, profiled workspace and KV layout (``runtime.memory``)."""
        utilization, kv_cache_bytes, num_blocks, block_size = msg.plan
        weights, per_block = tensor_bytes(self.executor.params.values()), self.layout.bytes_per_token() * block_size
        budget, other = plan_budget(self.spec.device, weights_bytes=weights, workspace_bytes=self.workspace,
                                    other_bytes=0, bytes_per_block=per_block,
                                    gpu_memory_utilization=utilization, kv_cache_bytes=kv_cache_bytes,
                                    num_blocks=num_blocks)
        return fit_kv_blocks(budget - weights - self.workspace - other, per_block)

    def step_input(self, msg: StepMessage, t: dict[str, torch.Tensor]) -> StepInput:
        for cache_id in msg.freed:
            self.caches.pop(cache_id, None)
        self._paged_storage(msg.paged_pool)
        seqs = []
        for num_context, num_new, kv in msg.seqs:
            if kv[0] == "paged":
                cache = PagedSequenceKV(self.storage, kv[1], num_context)
            else:
                cache = self.caches.get(kv[1])
                if cache is None:
                    cache = self.caches[kv[1]] = SequenceKV(self.layout, kv[2], self.spec.device)
            seqs.append(SeqSlice(cache, num_context, num_new))
        rows = t.get("logits_indices")
        if self.no_logits:
            rows = torch.empty(0, dtype=torch.long, device=self.spec.device)
        inp = StepInput(t["input_ids"], t["positions"], seqs, rows)
        if "slot_mapping" in t:
            inp.paged = PagedAttentionMetadata(self.storage.k, self.storage.v, t["slot_mapping"], t["block_tables"],
                                               t["seq_lens"], t["context_lens"], t["cu_seqlens_q"], msg.decode_only,
                                               mixed=mixed_step([num_new for _, num_new, _ in msg.seqs]))
        return inp


def serve_steps(executor: Executor, spec: RankSpec) -> int:
    """A worker's loop: run every step rank 0 broadcasts until it says stop; returns the exit code."""
    state = _WorkerState(executor, spec)
    while True:
        try:
            msg, tensors = _receive(spec)
        except StepMessageError as e:  # the ranks' collectives cannot line up after it: rank 0 sees this rank exit
            log.error("tensor-parallel rank %d: %s; exiting", spec.rank, e)
            return 1
        except Exception as e:
            log.error("tensor-parallel rank %d lost rank 0 (%s: %s); exiting", spec.rank, type(e).__name__, e)
            return 1
        if msg.kind == "stop":
            for graphs in (state.graphs, state.step_graphs):  # before leaving the process group: NCCL resources
                if graphs is not None:
                    graphs.close()
            return 0
        try:
            if msg.kind == "step":
                if msg.profile:
                    state.profile(msg, tensors)
                else:
                    executor.forward(state.step_input(msg, tensors))
            elif msg.kind == "graphs":
                state.capture_graphs(msg)
            elif msg.kind == "replay":
                state.replay(msg)
            elif msg.kind == "step_graphs":
                state.capture_step_graphs(msg)
            elif msg.kind == "step_replay":
                state.step_replay(msg)
            elif msg.kind == "plan":
                try:
                    blocks = state.kv_blocks(msg)
                except Exception as e:  # rank 0 waits in the all_gather: answer 0, which it refuses naming this rank
                    log.error("tensor-parallel rank %d could not plan its KV cache (%s: %s)", spec.rank,
                              type(e).__name__, e)
                    blocks = 0
                gather_ints(blocks, spec)
        except StepMessageError as e:
            log.error("tensor-parallel rank %d: %s; exiting", spec.rank, e)
            return 1


def _dump_stacks_periodically() -> None:
    if seconds := float(os.environ.get(STACKS_ENV) or 0):
        faulthandler.dump_traceback_later(seconds, repeat=True)


def _init_group(spec: RankSpec, store=None) -> None:
    _dump_stacks_periodically()
    if spec.device.type == "cuda":
        torch.cuda.set_device(spec.device)
    kwargs = {"store": store} if store is not None else {"init_method": "env://"}
    dist.init_process_group(spec.backend, rank=spec.rank, world_size=spec.tp_size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S), **kwargs)


def _load_rank(artifact: Artifact, spec: RankSpec, use_kernels: bool) -> Executor:
    return Executor(artifact.graph, artifact.load_weights(spec.device, rank=spec.rank), use_kernels=use_kernels,
                    fp8_accumulation=artifact.manifest["runtime"].get("fp8_accumulation"))


def _worker_main(rank: int, tp_size: int, device: str, path: str, port: int, check_hashes: bool,
                 use_kernels: bool, num_threads: int, log_level: int) -> None:
    """Entry point of a spawned worker process."""
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s tp-rank{rank} %(name)s: %(message)s")
    spec = rank_spec(device, rank, tp_size)
    if spec.device.type == "cpu":
        torch.set_num_threads(num_threads)
    store = dist.TCPStore("127.0.0.1", port, tp_size, is_master=False, timeout=timedelta(seconds=START_TIMEOUT_S))
    try:
        store.set(f"tp/joined/{rank}", "1")
        _init_group(spec, store)
        executor = _load_rank(open_artifact(path, check_hashes, rank=rank), spec, use_kernels)
    except BaseException as e:
        store.set(f"tp/ready/{rank}", f"{type(e).__name__}: {e}")
        raise
    store.set(f"tp/ready/{rank}", "ok")
    code = serve_steps(executor, spec)
    _destroy_group(10.0)
    raise SystemExit(code)


# --- start-up --------------------------------------------------------------------------------------
def start(artifact: Artifact, device: torch.device, use_kernels: bool, check_hashes: bool = True) -> TPExecutor:
    """Start the ranks of a sharded artifact and return rank 0's executor.

    Spawns tp_size - 1 worker processes (torch.multiprocessing, spawn), one per GPU after ``device``'s, or
    joins the group torchrun set up (env RANK / WORLD_SIZE / MASTER_ADDR, one or more nodes): there, ranks other
    than 0 run the workers' loop here and exit the process when rank 0 closes the engine."""
    tp_size = artifact.tp_size
    if (rank := torchrun_rank()) is not None:
        return _join_torchrun(artifact, device, rank, use_kernels)
    check_devices(device, tp_size)
    if dist.is_initialized():
        raise ArtifactError("a torch.distributed process group already exists in this process; a tensor-parallel "
                            "engine needs its own (close the other engine first)")
    import torch.multiprocessing as mp

    spec = rank_spec(device, 0, tp_size)
    store = dist.TCPStore("127.0.0.1", 0, tp_size, is_master=True, timeout=timedelta(seconds=START_TIMEOUT_S),
                          wait_for_workers=False)
    ctx = mp.get_context("spawn")
    num_threads = max(1, (os.cpu_count() or 1) // tp_size)
    level = logging.getLogger().getEffectiveLevel()
    workers = [ctx.Process(target=_worker_main, name=f"tp-rank{r}", daemon=True,
                           args=(r, tp_size, str(device), str(artifact.path), store.port, check_hashes, use_kernels,
                                 num_threads, level))
               for r in range(1, tp_size)]
    for p in workers:
        p.start()
    try:
        _wait_for(store, workers, "joined")
        _init_group(spec, store)
        local = _load_rank(artifact, spec, use_kernels)
        _wait_for(store, workers, "ready")
    except BaseException:
        for p in workers:
            p.terminate()
        if dist.is_initialized():
            collectives.reset()
            dist.destroy_process_group()
        raise
    log.info("tensor parallel: %d ranks on %s (backend %s), worker pids %s", tp_size,
             "cpu" if spec.device.type == "cpu" else f"cuda:{spec.device.index}..{spec.device.index + tp_size - 1}",
             spec.backend, [p.pid for p in workers])
    return TPExecutor(local, spec, workers, store)


def _wait_for(store, workers: list, stage: str) -> None:
    """Wait until every worker has set ``tp/<stage>/<rank>``; a worker that exits or reports an error
    first stops the start-up with its message."""
    deadline = time.monotonic() + START_TIMEOUT_S
    pending = set(range(1, len(workers) + 1))
    while pending:
        for rank in sorted(pending):
            if store.check([f"tp/{stage}/{rank}"]):
                status = store.get(f"tp/{stage}/{rank}").decode()
                if stage == "ready" and status != "ok":
                    raise ArtifactError(f"tensor-parallel worker rank {rank} could not start: {status}")
                pending.discard(rank)
        for rank in pending:
            p = workers[rank - 1]
            if not p.is_alive() and not store.check([f"tp/{stage}/{rank}"]):
                raise ArtifactError(f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with "
                                    f"{exit_text(p.exitcode)} before it was {stage}; see its log above")
        if pending and time.monotonic() > deadline:
            raise ArtifactError(f"tensor-parallel workers {sorted(pending)} were not {stage} after "
                                f"{START_TIMEOUT_S:.0f}s (LLM_BUILDER_TP_START_TIMEOUT_S)")
        if pending:
            time.sleep(0.02)


def _join_torchrun(artifact: Artifact, device: torch.device, rank: int, use_kernels: bool) -> TPExecutor:
    """Join the group of torchrun's processes, on one node or several (``--nnodes``): the global RANK picks the
    weight file, LOCAL_RANK the GPU of this node (cuda:LOCAL_RANK); the node must have LOCAL_WORLD_SIZE GPUs."""
    world = int(os.environ["WORLD_SIZE"])
    if world != artifact.tp_size:
        raise ArtifactError(f"torchrun started {world} processes but the artifact is sharded for tp_size "
                            f"{artifact.tp_size}; run torchrun with --nnodes x --nproc-per-node = {artifact.tp_size} "
                            f"(e.g. --nproc-per-node {artifact.tp_size})")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if device.type == "cuda":
        if (local_world := int(os.environ.get("LOCAL_WORLD_SIZE", world))) > (count := torch.cuda.device_count()):
            raise ArtifactError(f"torchrun started {local_world} processes on this node (--nproc-per-node) but it "
                                f"has {count} GPU(s): one rank per GPU")
        spec = RankSpec(rank, world, torch.device("cuda", local_rank), "nccl")
    else:
        spec = rank_spec(device, rank, world)
    _init_group(spec)
    executor = _load_rank(artifact, spec, use_kernels)
    dist.barrier()
    if rank == 0:
        return TPExecutor(executor, spec)
    code = serve_steps(executor, spec)
    _destroy_group(10.0)
    raise SystemExit(code)

