"""The serving engine in its own process, so the HTTP server and the step loop do not share one interpreter lock.

In one process the engine thread's host work per step (scheduling, packing the next step, detokenizing, stop
checks) and the event loop's work per streamed token (JSON, SSE framing, the socket write) take turns on the GIL;
at a few hundred streams the sum outgrows the device's step time and the server serves far fewer tokens per second
than the offline engine (``builder.bench.serve_overhead`` measures it). Here the engine steps in a child process
(the "engine core") and the server process only handles HTTP:

    server process                                         engine process
    event loop: submit ── ["add", ...] ──────────────────► receiver thread ─► inbox
                abort  ── ["abort", id] ─────────────────►   step loop: take the inbox; step(); send one message
    reader thread ◄── ["step", acks, stats, outputs, refusals] ─┘   per step with every request's delta
      └─► one call_soon_threadsafe per event loop per step, each delta into its request's asyncio.Queue

``EngineProcess`` has ``AsyncEngine``'s interface (``submit``, ``generate``, ``abort``, ``stats``, ``ready``,
``start``, ``shutdown``, ``artifact``, ``tokenizer``, ``max_seq_len``), so ``runtime.server.create_app`` takes
either. Messages are JSON arrays of a fixed layout (below); nothing is pickled. A request is validated in the
server process against limits the engine reports when it is ready (vocabulary, max_seq_len, KV pool), so a
refusal is still known before a response starts; the rare refusal the engine makes itself (a race on its waiting
queue) arrives as the first item of the request's stream, as with ``AsyncEngine``.

Several server processes (``builder serve --api-servers N``, ``runtime.api_servers``): past ~15k streamed tokens a
second one event loop is the limit (docs/BENCHMARKS.md, session 30), so the HTTP work can be spread over N
processes sharing the listening socket. The engine process then has N channels (a pipe pair each,
``start_engine_process(num_channels=N)``), each server process an ``EngineClient`` on its own: a request's results
go back on the channel that sent it, every channel gets the shared stats each step, and a channel that closes (its
process exited) has its requests aborted while the others keep being served. The engine stops on a "stop" message
or once every channel has closed.

Messages (``json.dumps`` of a list; ``arrival`` is ``time.monotonic()``, one clock for both processes on Linux):

    to the engine:   ["add", request_id, prompt_token_ids, sampling_params_fields, timeout_s, arrival]
                     ["abort", request_id]
                     ["stop"]
    to the server:   ["ready", {"max_seq_len", "vocab_size", "block_size", "num_blocks", "max_waiting"}]
                     ["error", exception_type, message]            the engine could not load (then it exits)
                     ["step", adds_taken, stats, outputs, refusals]
                        stats:    EngineStats' fields in order, then the scheduler's new waiting requests
                        outputs:  [request_id, text, token_ids, logprobs, finished, finish_reason,
                                   num_prompt_tokens, num_output_tokens, num_cached_tokens, error]
                                  logprobs: null or [[token_id, logprob, [[token_id, logprob], ...]], ...]
                        refusals: [request_id, "queue_full" | "invalid", message]
                     ["failed", message]                           the engine cannot step any more (then it exits)
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import json
import logging
import multiprocessing as mp
import queue
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import torch

from runtime.artifact import open_artifact
from runtime.async_engine import EngineFront, EngineNotRunning, RequestStream, deliver
from runtime.engine import RequestError, check_vocab_params
from runtime.outputs import EngineStats, RequestOutput, TokenLogprob
from runtime.sampling import SamplingParams
from runtime.scheduler import QueueFullError
from runtime.serving import ServingConfig
from runtime.structured import GrammarCompiler

log = logging.getLogger(__name__)

__all__ = ["EngineClient", "EngineProcess", "EngineStartError", "start_engine_process", "stop_process"]

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # the server's log lines (runtime.serve) and these
START_TIMEOUT_S = 1800.0  # loading a large artifact and capturing its CUDA graphs
_STATS_FIELDS = [f.name for f in dataclasses.fields(EngineStats) if f.name != "extra"]


class EngineStartError(RuntimeError):
    """The engine process could not load the artifact (the message says why) or did not start in time."""


def _dumps(msg: list) -> bytes:
    return json.dumps(msg, separators=(",", ":"), ensure_ascii=False).encode()


def _encode_output(out: RequestOutput) -> list:
    logprobs = None if out.logprobs is None else [[e.token_id, e.logprob, [list(t) for t in e.top]]
                                                  for e in out.logprobs]
    return [out.request_id, out.text, out.token_ids, logprobs, out.finished, out.finish_reason,
            out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens, out.error]


def _decode_output(row: list) -> RequestOutput:
    rid, text, token_ids, logprobs, finished, reason, num_prompt, num_output, num_cached, error = row
    if logprobs is not None:
        logprobs = [TokenLogprob(t, lp, tuple((a, b) for a, b in top)) for t, lp, top in logprobs]
    return RequestOutput(rid, text, token_ids, logprobs, finished, reason, num_prompt, num_output, num_cached, error)


# --- the engine process ------------------------------------------------------------------------------------------
def load_engine(artifact: str, device: str, config: ServingConfig, check_hashes: bool, allow_failed_gate: bool):
    """The engine process's default loader: ``ServingEngine.load``."""
    from runtime.serving import ServingEngine

    return ServingEngine.load(artifact, device, config, check_hashes=check_hashes, allow_failed_gate=allow_failed_gate)


def _engine_main(channels: list[tuple[Any, Any]], loader: Callable, artifact: str, device: str,
                 config: dict[str, Any], check_hashes: bool, allow_failed_gate: bool, log_level: int) -> None:
    """The child's entry point: load, report ready (or the error) on every channel, then step until told to stop or
    until every channel has closed. ``channels``: one (inbound, outbound) pair of pipe ends per server process; a
    request's results go back on the channel it came from."""
    # Ctrl-C in a terminal reaches the whole process group: the server shuts down gracefully and stops this process
    # with a "stop" message, so the interrupt must not kill it first (requests in flight would lose their engine)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=LOG_FORMAT, force=True)  # its log lines go where the server's go
    try:
        engine = loader(artifact, device, ServingConfig(**config), check_hashes, allow_failed_gate)
    except BaseException as e:  # reported to the server processes, which raise it as EngineStartError
        for _, outbound in channels:
            outbound.send_bytes(_dumps(["error", type(e).__name__, str(e)]))
        return
    inbox: queue.SimpleQueue = queue.SimpleQueue()  # (channel, message)
    wake = threading.Event()

    def receive(channel: int, inbound) -> None:
        while True:
            try:
                data = inbound.recv_bytes()
            except (EOFError, OSError):  # that server process is gone
                inbox.put((channel, ["closed"]))
                wake.set()
                return
            inbox.put((channel, json.loads(data)))
            wake.set()

    for channel, (inbound, _) in enumerate(channels):
        threading.Thread(target=receive, args=(channel, inbound), name=f"engine-receive-{channel}",
                         daemon=True).start()
    sc = engine.scheduler_config
    ready = _dumps(["ready", {
        "max_seq_len": sc.max_seq_len, "vocab_size": int(engine.executor.graph.get("meta", {}).get("vocab_size", 0)),
        "block_size": engine.block_size, "num_blocks": engine.kv.pool.num_blocks, "max_waiting": sc.max_waiting}])
    for _, outbound in channels:
        outbound.send_bytes(ready)
    try:
        _step_loop(engine, inbox, wake, [outbound for _, outbound in channels])
    finally:
        engine.close()


class _Channels:
    """The engine process's side of its server processes' pipes: which channel each request came from, what each has
    had admitted, which are still open. A channel whose process has gone (its pipe closed, or a send failing) has
    its requests aborted; the others keep being served."""

    def __init__(self, engine, outbounds: list) -> None:
        self.engine = engine
        self.outbounds = outbounds
        self.open = set(range(len(outbounds)))
        self.owner: dict[str, int] = {}  # request id -> channel, until the request finishes
        self.adds_taken = [0] * len(outbounds)
        self.refusals: list[list[list]] = [[] for _ in outbounds]

    def close(self, channel: int) -> None:
        """Channel ``channel``'s process is gone: its requests are aborted (their results have no reader)."""
        if channel not in self.open:
            return
        self.open.discard(channel)
        with contextlib.suppress(OSError):
            self.outbounds[channel].close()  # that process's reader, if it still runs, sees the end
        for rid in [r for r, c in self.owner.items() if c == channel]:
            self.engine.abort(rid)

    def send_all(self, msg: list) -> None:
        data = _dumps(msg)
        for channel in sorted(self.open):
            self._send(channel, data)

    def _send(self, channel: int, data: bytes) -> None:
        try:
            self.outbounds[channel].send_bytes(data)
        except (OSError, ValueError):  # that process is gone (its reader will not come back)
            self.close(channel)

    def send_step(self, outputs: list[RequestOutput]) -> None:
        """One step message per open channel: its requests' outputs and refusals, the shared stats."""
        stats = self.engine.stats()
        row = [getattr(stats, f) for f in _STATS_FIELDS] + [self.engine.scheduler._num_new_waiting]
        per_channel: list[list] = [[] for _ in self.outbounds]
        for out in outputs:
            channel = self.owner.get(out.request_id)
            if channel is None:
                continue
            if out.finished:
                del self.owner[out.request_id]
            per_channel[channel].append(_encode_output(out))
        for channel in sorted(self.open):
            self._send(channel, _dumps(["step", self.adds_taken[channel], row, per_channel[channel],
                                        self.refusals[channel]]))
        self.refusals = [[] for _ in self.outbounds]

    @property
    def has_refusals(self) -> bool:
        return any(self.refusals)


def _step_loop(engine, inbox: queue.SimpleQueue, wake: threading.Event, outbounds: list) -> None:
    channels = _Channels(engine, outbounds)
    while True:
        stop = False
        while True:
            try:
                channel, msg = inbox.get_nowait()
            except queue.Empty:
                break
            kind = msg[0]
            if kind == "add":
                channels.adds_taken[channel] += 1
                _, rid, ids, fields, timeout_s, arrival = msg
                refusals = channels.refusals[channel]
                try:
                    engine.add_request(ids, SamplingParams(**fields), request_id=rid, timeout_s=timeout_s,
                                       arrival_time=arrival)
                    channels.owner[rid] = channel
                except QueueFullError as e:
                    refusals.append([rid, "queue_full", str(e)])
                except (RequestError, ValueError) as e:
                    refusals.append([rid, "invalid", str(e)])
                except Exception as e:  # e.g. the detokenizer rejects this prompt: this request fails alone
                    log.exception("admitting request %s failed", rid)
                    refusals.append([rid, "error", f"the engine could not admit the request: "
                                                   f"{type(e).__name__}: {e}"])
            elif kind == "abort":
                engine.abort(msg[1])
            elif kind == "closed":
                channels.close(channel)
                stop = stop or not channels.open
            elif kind == "stop":
                stop = True
        if stop:
            channels.send_step(engine.finish_all("abort", "the server is shutting down"))
            return
        if engine.failure is not None:  # a dead tensor-parallel rank: nothing can run any more
            channels.send_all(["failed", str(engine.failure)])
            return
        if not engine.has_unfinished:
            if channels.has_refusals:
                channels.send_step([])
            wake.wait(0.1)
            wake.clear()
            continue
        try:
            outputs = engine.step()
        except Exception as e:  # the shared step failed: fail the requests in flight, keep serving
            log.exception("engine step failed; failing %d requests", engine.scheduler.num_unfinished)
            outputs = engine.finish_all("error", f"the engine step failed: {type(e).__name__}: {e}")
        channels.send_step(outputs)


# --- the server side ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Stream:
    outputs: asyncio.Queue  # RequestOutput deltas, or the exception that refused the request
    loop: asyncio.AbstractEventLoop


def start_engine_process(artifact: str | Path, device: str | torch.device, config: ServingConfig, *,
                         num_channels: int = 1, check_hashes: bool = True, allow_failed_gate: bool = False,
                         start_timeout_s: float = START_TIMEOUT_S, loader: Callable = load_engine,
                         tp_size: int = 1) -> tuple[mp.process.BaseProcess, list[tuple[Any, Any]], dict]:
    """Start the engine process with ``num_channels`` pipe pairs (one per server process) and wait until it has
    loaded the artifact: ``(process, [(to_engine, from_engine), ...], limits)``, the limits being its "ready"
    message. A load failure raises EngineStartError with the engine's message (the process has exited)."""
    ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
    ends, server_ends = [], []
    for _ in range(num_channels):
        inbound, to_engine = ctx.Pipe(duplex=False)  # (receiving end, sending end)
        from_engine, outbound = ctx.Pipe(duplex=False)
        ends.append((inbound, outbound))
        server_ends.append((to_engine, from_engine))
    # daemonic (ended with this process) unless it must start tensor-parallel ranks of its own, which a daemonic
    # process may not; either way the caller stops it
    proc = ctx.Process(target=_engine_main, name="engine-core", daemon=tp_size == 1, args=(
        ends, loader, str(artifact), str(device), dataclasses.asdict(config), check_hashes, allow_failed_gate,
        logging.getLogger().getEffectiveLevel()))
    proc.start()
    for inbound, outbound in ends:
        inbound.close()
        outbound.close()
    try:
        limits = [_wait_ready(proc, from_engine, start_timeout_s) for _, from_engine in server_ends]
    except EngineStartError:
        stop_process(proc)
        raise
    return proc, server_ends, limits[0]


def _wait_ready(proc, from_engine, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while not from_engine.poll(0.5):
        if not proc.is_alive():
            raise EngineStartError(f"the engine process exited with code {proc.exitcode} while loading")
        if time.monotonic() > deadline:
            raise EngineStartError(f"the engine did not load within {timeout_s:g} s")
    try:
        msg = json.loads(from_engine.recv_bytes())
    except (EOFError, OSError):
        proc.join(5)
        raise EngineStartError(f"the engine process exited with code {proc.exitcode} while loading") from None
    if msg[0] == "error":
        proc.join(30)
        raise EngineStartError(msg[2] if msg[1] in ("ArtifactError", "TokenizerError", "MemoryPlanError",
                                                     "ValueError", "DeviceError") else f"{msg[1]}: {msg[2]}")
    return msg[1]


def stop_process(proc, timeout: float = 10.0) -> None:
    """Terminate ``proc`` if it is still running (SIGTERM, then SIGKILL after ``timeout`` s)."""
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()


class EngineClient(EngineFront):
    """A server process's side of an engine process: ``AsyncEngine``'s interface over one channel's pipe ends
    (``to_engine``, ``from_engine``) and the limits the engine reported when it was ready. It does not own the
    engine: ``shutdown`` closes its channel (the engine aborts this channel's requests and keeps serving the
    others; it stops once every channel has closed). ``EngineProcess`` is the client that owns its engine."""

    def __init__(self, artifact: str | Path, to_engine, from_engine, limits: dict) -> None:
        self.artifact = open_artifact(artifact, check_hashes=False)  # the engine process checks the hashes
        self.tokenizer = self.artifact.load_tokenizer()
        self._to_engine, self._from_engine = to_engine, from_engine
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards _streams, _adds_sent and the stats below
        self._streams: dict[str, _Stream] = {}
        self._adds_sent = 0
        self._adds_taken = 0
        self._stats: list = [0] * (len(_STATS_FIELDS) + 1)
        self._reader: threading.Thread | None = None
        self.errored: BaseException | None = None
        self._stopping = False
        self.max_seq_len: int = limits["max_seq_len"]
        self._vocab: int = limits["vocab_size"]
        self._block_size: int = limits["block_size"]
        self._num_blocks: int = limits["num_blocks"]
        self._max_waiting: int = limits["max_waiting"]
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()

    @property
    def grammars(self) -> GrammarCompiler:
        """A compiler of this process's own for checks before a request is sent (the engine process compiles the
        request's grammar again, from its own cache)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self._vocab, spread=1)  # checks: one matcher each
            return self._grammars

    # --- lifecycle -----------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._reader is None:
            self._reader = threading.Thread(target=self._read, name="engine-results", daemon=True)
            self._reader.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        if self._grammars is not None:
            self._grammars.close()
        with contextlib.suppress(OSError):
            self._to_engine.close()  # the engine sees this channel close
        if self._reader is not None:
            self._reader.join(timeout)
            self._reader = None

    @property
    def ready(self) -> bool:
        """Reading the engine's results, and the engine has not failed (what /health reports)."""
        return (self._reader is not None and self._reader.is_alive() and self.errored is None
                and not self._stopping)

    def stats(self) -> EngineStats:
        with self._lock:
            row, in_flight = list(self._stats), self._adds_sent - self._adds_taken
        stats = EngineStats(**dict(zip(_STATS_FIELDS, row)))
        stats.num_waiting += in_flight
        return stats

    # --- requests ------------------------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError if the request could never run on this engine (the engine's own checks, made here
        from the limits it reported: ``ServingEngine.check_request``)."""
        if self._vocab and any(not 0 <= t < self._vocab for t in prompt_token_ids):
            raise RequestError(f"prompt token ids must be in [0, {self._vocab}) for this model")
        check_vocab_params(params, self._vocab)
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestError("the prompt is empty")
        if n >= self.max_seq_len:
            raise RequestError(f"the prompt has {n} tokens; max_seq_len is {self.max_seq_len} (prompt plus at least "
                               f"one generated token)")
        num_blocks = -(-min(self.max_seq_len, n + params.max_tokens) // self._block_size)
        if num_blocks > self._num_blocks:
            raise RequestError(f"the request needs up to {num_blocks} KV blocks; the pool has {self._num_blocks}")

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, *, request_id: str | None = None,
               timeout_s: float | None = None, arrival_time: float | None = None) -> RequestStream:
        """As ``AsyncEngine.submit``: raises EngineNotRunning, RequestError or QueueFullError at once, else
        sends the request to the engine and returns its stream."""
        if not self.ready:
            raise EngineNotRunning("the engine is not running")
        self.validate(prompt_token_ids, params)
        request_id = request_id or uuid.uuid4().hex
        outputs: asyncio.Queue = asyncio.Queue()
        with self._lock:
            waiting = self._stats[-1] + self._adds_sent - self._adds_taken
            if waiting >= self._max_waiting:
                raise QueueFullError(f"{waiting} requests are already waiting (max_waiting {self._max_waiting})")
            if request_id in self._streams:
                raise RequestError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = _Stream(outputs, asyncio.get_running_loop())
            self._adds_sent += 1
        self._send(["add", request_id, [int(t) for t in prompt_token_ids], dataclasses.asdict(params), timeout_s,
                    time.monotonic() if arrival_time is None else arrival_time])
        return RequestStream(self, request_id, outputs)

    def abort(self, request_id: str) -> None:
        try:
            self._send(["abort", request_id])
        except (OSError, ValueError):  # the engine is gone: nothing to abort
            pass

    def _send(self, msg: list) -> None:
        data = _dumps(msg)
        with self._send_lock:
            self._to_engine.send_bytes(data)

    # --- results ---------------------------------------------------------------------------------------------------
    def _read(self) -> None:
        while True:
            try:
                msg = json.loads(self._from_engine.recv_bytes())
            except (EOFError, OSError):
                self._fail_all(EngineNotRunning("the engine process exited" if not self._stopping
                                                else "the engine shut down"))
                return
            if msg[0] == "step":
                _, adds_taken, stats, outputs, refusals = msg
                items: list[tuple[str, Any]] = [(o[0], _decode_output(o)) for o in outputs]
                for rid, kind, message in refusals:
                    if kind == "error":
                        items.append((rid, RequestOutput(rid, "", [], None, True, "error", 0, 0, error=message)))
                    else:
                        items.append((rid, (QueueFullError if kind == "queue_full" else RequestError)(message)))
                with self._lock:
                    self._adds_taken, self._stats = adds_taken, stats
                self._deliver(items)
            elif msg[0] == "failed":
                log.error("the engine failed: %s", msg[1])
                self._fail_all(EngineNotRunning(msg[1]))
                return

    def _deliver(self, items: list[tuple[str, Any]]) -> None:
        """Hand each item to its request's queue: one wake-up per event loop for the whole step."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        with self._lock:
            for rid, item in items:
                stream = self._streams.get(rid)
                if stream is None:
                    continue
                if isinstance(item, BaseException) or item.finished:
                    del self._streams[rid]
                by_loop.setdefault(stream.loop, []).append((stream.outputs, item))
        deliver(by_loop)

    def _fail_all(self, error: BaseException) -> None:
        self.errored = error if not self._stopping else None
        with self._lock:
            rids = list(self._streams)
        self._deliver([(rid, error) for rid in rids])



class EngineProcess(EngineClient):
    """A ServingEngine stepping in a child process, with ``AsyncEngine``'s interface (module docstring): the client of
    a one-channel engine process it starts and stops itself.

    The constructor starts the process and waits until the artifact is loaded: a load failure raises
    EngineStartError with the engine's message. ``start`` starts reading its results; ``shutdown`` stops it.
    ``loader``: a module-level function (or a functools.partial of one) with ``load_engine``'s signature that the
    engine process calls to make its ServingEngine (benchmarks substitute a simulated device)."""

    def __init__(self, artifact: str | Path, device: str | torch.device = "cpu", config: ServingConfig | None = None,
                 *, check_hashes: bool = True, allow_failed_gate: bool = False,
                 start_timeout_s: float = START_TIMEOUT_S, loader: Callable = load_engine) -> None:
        tp_size = open_artifact(artifact, check_hashes=False).tp_size
        self._proc, [(to_engine, from_engine)], limits = start_engine_process(
            artifact, device, config or ServingConfig(), check_hashes=check_hashes,
            allow_failed_gate=allow_failed_gate, start_timeout_s=start_timeout_s, loader=loader, tp_size=tp_size)
        atexit.register(self._kill)  # runs before multiprocessing's own exit hook, which would wait for the child
        super().__init__(artifact, to_engine, from_engine, limits)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        if self._proc.is_alive():
            try:
                self._send(["stop"])
            except (OSError, ValueError):
                pass
            self._proc.join(timeout)
        self._kill()
        atexit.unregister(self._kill)
        super().shutdown(timeout)

    def _kill(self) -> None:
        stop_process(self._proc)

    @property
    def ready(self) -> bool:
        """Loaded and stepping (what /health reports)."""
        return super().ready and self._proc.is_alive()
