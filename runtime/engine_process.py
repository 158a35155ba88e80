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
from runtime.engine import RequestError
from runtime.outputs import EngineStats, RequestOutput, TokenLogprob
from runtime.sampling import SamplingParams
from runtime.scheduler import QueueFullError
from runtime.serving import ServingConfig

log = logging.getLogger(__name__)

__all__ = ["EngineProcess", "EngineStartError"]

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


def _engine_main(inbound, outbound, loader: Callable, artifact: str, device: str, config: dict[str, Any],
                 check_hashes: bool, allow_failed_gate: bool, log_level: int) -> None:
    """The child's entry point: load, report ready (or the error), then step until told to stop."""
    # Ctrl-C in a terminal reaches the whole process group: the server shuts down gracefully and stops this process
    # with a "stop" message, so the interrupt must not kill it first (requests in flight would lose their engine)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=LOG_FORMAT, force=True)  # its log lines go where the server's go
    try:
        engine = loader(artifact, device, ServingConfig(**config), check_hashes, allow_failed_gate)
    except BaseException as e:  # reported to the server process, which raises it as EngineStartError
        outbound.send_bytes(_dumps(["error", type(e).__name__, str(e)]))
        return
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    wake = threading.Event()

    def receive() -> None:
        while True:
            try:
                data = inbound.recv_bytes()
            except (EOFError, OSError):  # the server process is gone
                inbox.put(["stop"])
                wake.set()
                return
            inbox.put(json.loads(data))
            wake.set()

    threading.Thread(target=receive, name="engine-receive", daemon=True).start()
    sc = engine.scheduler_config
    outbound.send_bytes(_dumps(["ready", {
        "max_seq_len": sc.max_seq_len, "vocab_size": int(engine.executor.graph.get("meta", {}).get("vocab_size", 0)),
        "block_size": engine.block_size, "num_blocks": engine.kv.pool.num_blocks, "max_waiting": sc.max_waiting}]))
    try:
        _step_loop(engine, inbox, wake, outbound)
    finally:
        engine.close()


def _step_loop(engine, inbox: queue.SimpleQueue, wake: threading.Event, outbound) -> None:
    adds_taken = 0
    while True:
        refusals: list[list] = []
        stop = False
        while True:
            try:
                msg = inbox.get_nowait()
            except queue.Empty:
                break
            kind = msg[0]
            if kind == "add":
                adds_taken += 1
                _, rid, ids, fields, timeout_s, arrival = msg
                try:
                    engine.add_request(ids, SamplingParams(**fields), request_id=rid, timeout_s=timeout_s,
                                       arrival_time=arrival)
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
            elif kind == "stop":
                stop = True
        if stop:
            _send_step(outbound, engine, adds_taken, engine.finish_all("abort", "the server is shutting down"),
                       refusals)
            return
        if engine.failure is not None:  # a dead tensor-parallel rank: nothing can run any more
            outbound.send_bytes(_dumps(["failed", str(engine.failure)]))
            return
        if not engine.has_unfinished:
            if refusals:
                _send_step(outbound, engine, adds_taken, [], refusals)
            wake.wait(0.1)
            wake.clear()
            continue
        try:
            outputs = engine.step()
        except Exception as e:  # the shared step failed: fail the requests in flight, keep serving
            log.exception("engine step failed; failing %d requests", engine.scheduler.num_unfinished)
            outputs = engine.finish_all("error", f"the engine step failed: {type(e).__name__}: {e}")
        _send_step(outbound, engine, adds_taken, outputs, refusals)


def _send_step(outbound, engine, adds_taken: int, outputs: list[RequestOutput], refusals: list[list]) -> None:
    stats = engine.stats()
    row = [getattr(stats, f) for f in _STATS_FIELDS] + [engine.scheduler._num_new_waiting]
    outbound.send_bytes(_dumps(["step", adds_taken, row, [_encode_output(o) for o in outputs], refusals]))


# --- the server side ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Stream:
    outputs: asyncio.Queue  # RequestOutput deltas, or the exception that refused the request
    loop: asyncio.AbstractEventLoop


class EngineProcess(EngineFront):
    """A ServingEngine stepping in a child process, with ``AsyncEngine``'s interface (module docstring).

    The constructor starts the process and waits until the artifact is loaded: a load failure raises
    EngineStartError with the engine's message. ``start`` starts reading its results; ``shutdown`` stops it.
    ``loader``: a module-level function (or a functools.partial of one) with ``load_engine``'s signature that the
    engine process calls to make its ServingEngine (benchmarks substitute a simulated device)."""

    def __init__(self, artifact: str | Path, device: str | torch.device = "cpu", config: ServingConfig | None = None,
                 *, check_hashes: bool = True, allow_failed_gate: bool = False,
                 start_timeout_s: float = START_TIMEOUT_S, loader: Callable = load_engine) -> None:
        self.artifact = open_artifact(artifact, check_hashes=False)  # the engine process checks the hashes
        self.tokenizer = self.artifact.load_tokenizer()
        ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
        inbound, self._to_engine = ctx.Pipe(duplex=False)  # (receiving end, sending end)
        self._from_engine, outbound = ctx.Pipe(duplex=False)
        config = config or ServingConfig()
        # daemonic (ended with this process) unless it must start tensor-parallel ranks of its own, which a daemonic
        # process may not; either way the exit hook below stops it
        self._proc = ctx.Process(target=_engine_main, name="engine-core", daemon=self.artifact.tp_size == 1, args=(
            inbound, outbound, loader, str(artifact), str(device), dataclasses.asdict(config), check_hashes,
            allow_failed_gate, logging.getLogger().getEffectiveLevel()))
        self._proc.start()
        atexit.register(self._kill)  # runs before multiprocessing's own exit hook, which would wait for the child
        inbound.close()
        outbound.close()
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards _streams, _adds_sent and the stats below
        self._streams: dict[str, _Stream] = {}
        self._adds_sent = 0
        self._adds_taken = 0
        self._stats: list = [0] * (len(_STATS_FIELDS) + 1)
        self._reader: threading.Thread | None = None
        self.errored: BaseException | None = None
        self._stopping = False
        info = self._wait_ready(start_timeout_s)
        self.max_seq_len: int = info["max_seq_len"]
        self._vocab: int = info["vocab_size"]
        self._block_size: int = info["block_size"]
        self._num_blocks: int = info["num_blocks"]
        self._max_waiting: int = info["max_waiting"]

    def _wait_ready(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while not self._from_engine.poll(0.5):
            if not self._proc.is_alive():
                raise EngineStartError(f"the engine process exited with code {self._proc.exitcode} while loading")
            if time.monotonic() > deadline:
                self._kill()
                raise EngineStartError(f"the engine did not load within {timeout_s:g} s")
        try:
            msg = json.loads(self._from_engine.recv_bytes())
        except (EOFError, OSError):
            self._proc.join(5)
            raise EngineStartError(f"the engine process exited with code {self._proc.exitcode} while loading") \
                from None
        if msg[0] == "error":
            self._proc.join(30)
            raise EngineStartError(msg[2] if msg[1] in ("ArtifactError", "TokenizerError", "MemoryPlanError",
                                                         "ValueError", "DeviceError") else f"{msg[1]}: {msg[2]}")
        return msg[1]

    # --- lifecycle -----------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._reader is None:
            self._reader = threading.Thread(target=self._read, name="engine-results", daemon=True)
            self._reader.start()

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
        if self._reader is not None:
            self._reader.join(timeout)
            self._reader = None

    def _kill(self) -> None:
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()

    @property
    def ready(self) -> bool:
        """Loaded and stepping (what /health reports)."""
        return (self._reader is not None and self._reader.is_alive() and self.errored is None
                and self._proc.is_alive() and not self._stopping)

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

