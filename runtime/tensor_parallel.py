"""Tensor parallelism at run time: one process per rank over torch.distributed (NCCL on CUDA, gloo on CPU).

    rank 0 (this process)                               ranks 1..tp_size-1 (spawned here, or torchrun's)
    engine, scheduler, sampling                         the same graph over their own weight file
    TPExecutor.forward(inp):                            serve_steps():
      broadcast the step: a small metadata object  ───►   rebuild the StepInput over their own KV cache
      + one int64 tensor (ids, positions, rows,            (their kv heads, rank 0's block tables)
        slots, block tables)
      run the local graph: its all_reduce /        ◄──►   run it: the same collectives, in the same order
        all_gather nodes meet the workers' ones
      logits -> sampling, once, on rank 0                 logits: none asked for (replicated lm_head)

Each rank's KV cache holds its own kv heads; rank 0's block manager decides the blocks of all of them,
since every rank's pool has the same number of blocks. One tensor-parallel engine per process: the
collectives run on the default process group.

Failure: a spawned worker that exits (crash, OOM kill) is seen at once by a thread watching its process
sentinel; the engine is marked failed with an error log line naming the rank and its exit code, and every
later step raises WorkerFailure (the server's /health turns 503). A step that raises, or a collective
that fails or waits past COLLECTIVE_TIMEOUT_S (a hung rank), fails the engine the same way: after a
broken step the ranks' collectives no longer line up. While idle, rank 0 sends a heartbeat every
HEARTBEAT_S so the workers' wait for the next step never reaches that timeout. Under torchrun, its agent
tears the whole group down when a rank dies.

CUDA graphs (TPDecodeGraphs): every rank captures its shard's decode step for the same buckets in lockstep
and replays it when rank 0 broadcasts a "replay" message; the all_reduces are NCCL kernels inside the
graphs. No collective timeout covers those kernels: if a worker dies during a replay, rank 0's GPU waits in
the graph, and the engine thread with it, but the sentinel thread still marks the engine failed (health
503, the log line). The graphs hold NCCL resources, so they are destroyed before the group is left.
"""

from __future__ import annotations

import atexit
import faulthandler
import itertools
import logging
import multiprocessing.connection
import os
import signal
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from runtime.artifact import Artifact, ArtifactError, open_artifact
from runtime.executor import Executor, PagedAttentionMetadata, SeqSlice, StepInput
from runtime.kv_cache import SequenceKV
from runtime.paged_kv import PagedKVStorage, PagedSequenceKV

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = float(os.environ.get("LLM_BUILDER_TP_TIMEOUT_S", "120"))  # a step's wait for the slowest rank
# debugging a hang: every rank prints all its threads' Python stacks to stderr every this many seconds
STACKS_ENV = "LLM_BUILDER_TP_STACKS_S"
HEARTBEAT_S = 5.0  # idle rank 0 pings the workers this often (well under the timeout)
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
# StepInput tensors packed, in this order, into one int64 tensor (those present)
_PACKED = ("input_ids", "positions", "logits_indices", "slot_mapping", "block_tables", "seq_lens", "context_lens",
           "cu_seqlens_q")


@dataclass
class StepMessage:
    """What rank 0 broadcasts before each step (pickled); the step's integer tensors follow as one tensor."""

    kind: str  # "step", "graphs" (capture the decode graphs), "replay" (a decode graph), "heartbeat" or "stop"
    tensors: list[tuple[str, tuple[int, ...], str]] = field(default_factory=list)  # (name, shape, dtype), packed order
    # per sequence: (num_context, num_new, kv) where kv is ("paged", block table) or ("seq", cache id, capacity)
    seqs: list[tuple] = field(default_factory=list)
    paged_pool: tuple[int, int] | None = None  # (num_blocks, block_size) of rank 0's paged KV storage
    decode_only: bool = False  # paged metadata: every sequence has one new token
    freed: list[int] = field(default_factory=list)  # ids of contiguous caches rank 0 has dropped
    graphs: tuple[int, int] | None = None  # "graphs": (max_num_seqs, max_seq_len) of rank 0's DecodeGraphs
    # "replay": (input ids or None, positions, slots, block tables) as DecodeGraphs.run takes them; None ids:
    # they are on rank 0's device (sampled by the step in flight) and follow as a broadcast int64 tensor
    replay: tuple | None = None


def _pack(named: list[tuple[str, torch.Tensor]], device: torch.device) -> tuple[list, torch.Tensor | None]:
    specs = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in named]
    if not named:
        return specs, None
    return specs, torch.cat([t.reshape(-1).to(device=device, dtype=torch.int64) for _, t in named])


def _unpack(specs: list, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    out, start = {}, 0
    for name, shape, dtype in specs:
        n = _numel(shape)
        out[name] = flat[start:start + n].view(shape).to(getattr(torch, dtype))
        start += n
    return out


def _broadcast(msg: StepMessage | None, packed: torch.Tensor | None, spec: RankSpec) -> tuple[StepMessage, dict]:
    """Rank 0 sends (msg, packed); the others receive and unpack."""
    box = [msg]
    dist.broadcast_object_list(box, src=0, device=spec.device if spec.device.type == "cuda" else None)
    msg = box[0]
    total = sum(_numel(shape) for _, shape, _ in msg.tensors)
    if packed is None:
        packed = torch.empty(total, dtype=torch.int64, device=spec.device)
    if total:
        dist.broadcast(packed, src=0)
    return msg, _unpack(msg.tensors, packed)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# --- rank 0 --------------------------------------------------------------------------------------
class TPExecutor:
    """Rank 0's executor: each ``forward`` runs the step on every rank. Same interface as ``Executor``."""

    def __init__(self, local: Executor, spec: RankSpec, workers: list | None = None, store=None) -> None:
        self.local = local  # rank 0's shard of the graph
        self.graph, self.params, self.dtype = local.graph, local.params, local.dtype
        self.device, self.use_kernels, self.outputs, self.num_layers = (local.device, local.use_kernels,
                                                                        local.outputs, local.num_layers)
        self.spec = spec
        self.tp_size = spec.tp_size
        self.failure: WorkerFailure | None = None  # set once, by whichever thread sees the failure first
        self._workers = workers or []  # spawned processes (ranks 1..); empty under torchrun
        self._store = store  # the rendezvous store the process group uses: kept alive with it
        self._lock = threading.Lock()  # one step (or heartbeat) on the group at a time
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
    def forward(self, inp: StepInput) -> torch.Tensor:
        """Run one step on every rank; returns rank 0's logits [num_selected, vocab] fp32."""
        def step() -> torch.Tensor:
            msg, packed = self._message(inp)
            _broadcast(msg, packed, self.spec)
            return self.local.forward(inp)

        return self.locked(step, "a step")

    def locked(self, fn, what: str):
        """Run ``fn`` (which talks to the workers) holding the group; any failure fails the engine, since
        the ranks' collectives no longer line up after it."""
        with self._lock:
            if self.failure is not None:
                raise self.failure
            try:
                return fn()
            except Exception as e:
                raise self._fail(self._dead_workers() or f"{what} failed on rank 0 ({type(e).__name__}: {e})") from e
            finally:
                self._last_sent = time.monotonic()

    def _message(self, inp: StepInput) -> tuple[StepMessage, torch.Tensor | None]:
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
        msg.tensors, packed = _pack(named, self.spec.device)
        return msg, packed

    # --- failure and shutdown --------------------------------------------------------------------
    def _fail(self, reason: str) -> WorkerFailure:
        if self.failure is None:
            self.failure = WorkerFailure(f"tensor-parallel engine failed: {reason}; restart it")
            log.error("%s", self.failure)
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
                    _broadcast(StepMessage("heartbeat"), None, self.spec)
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
                    _broadcast(StepMessage("stop"), None, self.spec)
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
    t = threading.Thread(target=dist.destroy_process_group, name="tp-destroy-group", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        log.warning("leaving the tensor-parallel process group did not finish in %.0f s; left behind", timeout)


class TPDecodeGraphs:
    """Decode steps in CUDA graphs on every rank (DecodeGraphs' interface, for ServingEngine on rank 0).

    Each rank captures its own shard's decode step for the same buckets, in the same order, warm-up steps
    included, so the collectives line up: the warm-ups run them, the captures record them as NCCL kernels.
    A replay sends the step's host inputs to the workers (one small message; the input ids, when they are
    still on rank 0's GPU, follow as an NCCL broadcast that stays on the stream) and every rank replays its
    graph, the recorded all_reduces meeting across ranks."""

    def __init__(self, executor: TPExecutor, storage: PagedKVStorage, max_num_seqs: int, max_seq_len: int) -> None:
        from runtime.cuda_graphs import DecodeGraphs

        self.executor = executor
        msg = StepMessage("graphs", paged_pool=(storage.num_blocks, storage.block_size),
                          graphs=(max_num_seqs, max_seq_len))
        self.local = executor.locked(lambda: (_broadcast(msg, None, executor.spec),
                                              DecodeGraphs(executor.local, storage, max_num_seqs, max_seq_len,
                                                           capture_error_mode=CAPTURE_MODE))[1],
                                     "capturing the decode CUDA graphs")
        self.buckets = self.local.buckets

    def bucket_for(self, num_seqs: int) -> int | None:
        return self.local.bucket_for(num_seqs)

    def close(self) -> None:
        """Rank 0's graphs; the workers destroy theirs when told to stop."""
        self.local.close()

    def run(self, input_ids: list[int] | torch.Tensor, positions: list[int], slots: list[int],
            tables: list[list[int]]) -> torch.Tensor:
        on_device = isinstance(input_ids, torch.Tensor)
        msg = StepMessage("replay", replay=(None if on_device else list(input_ids), positions, slots, tables))

        def replay() -> torch.Tensor:
            _broadcast(msg, None, self.executor.spec)
            if on_device:
                dist.broadcast(input_ids.contiguous(), src=0)
            return self.local.run(input_ids, positions, slots, tables)

        return self.executor.locked(replay, "a decode graph replay")


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
        self.caches: dict[int, SequenceKV] = {}
        # with a replicated lm_head no worker needs logits; vocab-parallel logits are gathered by every rank
        self.no_logits = not any(n["op"] == "all_gather" for n in executor.graph["nodes"])

    def _paged_storage(self, pool: tuple[int, int] | None) -> None:
        if pool is not None and (self.storage is None or (self.storage.num_blocks, self.storage.block_size) != pool):
            self.storage = PagedKVStorage(self.layout, *pool, self.spec.device)
            self.graphs = None  # captured over the old storage

    def capture_graphs(self, msg: StepMessage) -> None:
        from runtime.cuda_graphs import DecodeGraphs

        self._paged_storage(msg.paged_pool)
        self.graphs = DecodeGraphs(self.executor, self.storage, *msg.graphs, capture_error_mode=CAPTURE_MODE)

    def replay(self, msg: StepMessage) -> None:
        input_ids, positions, slots, tables = msg.replay
        if input_ids is None:  # on rank 0's GPU: they follow as a tensor
            input_ids = torch.empty(len(positions), dtype=torch.long, device=self.spec.device)
            dist.broadcast(input_ids, src=0)
        self.graphs.run(input_ids, positions, slots, tables)

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
                                               t["seq_lens"], t["context_lens"], t["cu_seqlens_q"], msg.decode_only)
        return inp


def serve_steps(executor: Executor, spec: RankSpec) -> int:
    """A worker's loop: run every step rank 0 broadcasts until it says stop; returns the exit code."""
    state = _WorkerState(executor, spec)
    while True:
        try:
            msg, tensors = _broadcast(None, None, spec)
        except Exception as e:
            log.error("tensor-parallel rank %d lost rank 0 (%s: %s); exiting", spec.rank, type(e).__name__, e)
            return 1
        if msg.kind == "stop":
            if state.graphs is not None:  # before leaving the process group: they hold NCCL resources
                state.graphs.close()
            return 0
        if msg.kind == "step":
            executor.forward(state.step_input(msg, tensors))
        elif msg.kind == "graphs":
            state.capture_graphs(msg)
        elif msg.kind == "replay":
            state.replay(msg)


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
    return Executor(artifact.graph, artifact.load_weights(spec.device, rank=spec.rank), use_kernels=use_kernels)


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
    joins the group torchrun set up (env RANK / WORLD_SIZE / MASTER_ADDR): there, ranks other than 0 run
    the workers' loop here and exit the process when rank 0 closes the engine."""
    tp_size = artifact.tp_size
    check_devices(device, tp_size)
    if (rank := torchrun_rank()) is not None:
        return _join_torchrun(artifact, device, rank, use_kernels)
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
    world = int(os.environ["WORLD_SIZE"])
    if world != artifact.tp_size:
        raise ArtifactError(f"torchrun started {world} processes but the artifact is sharded for tp_size "
                            f"{artifact.tp_size}; run torchrun --nproc-per-node {artifact.tp_size}")
    base = torch.device(device.type, 0) if device.type == "cuda" else device
    spec = rank_spec(base, rank, world)
    _init_group(spec)
    executor = _load_rank(artifact, spec, use_kernels)
    dist.barrier()
    if rank == 0:
        return TPExecutor(executor, spec)
    code = serve_steps(executor, spec)
    _destroy_group(10.0)
    raise SystemExit(code)

