"""The serving engine driven from asyncio: one thread runs steps, coroutines await their requests.

    engine thread:  loop { take new requests from the inbox; step(); hand each delta to its request's
                           asyncio.Queue on the event loop }   (sleeps while there is nothing to do)
    event loop:     async for out in async_engine.generate(prompt_ids, params): ...

Admission is decided synchronously by ``submit`` before anything is queued: a request that can never
run raises RequestError, and one that finds the waiting queue full raises QueueFullError at once (the
server answers 429), so a burst never queues without bound and the server knows the answer before it
starts a response. A consumer that stops iterating (client disconnect, cancellation) and closes its
stream aborts its request; the engine frees its blocks at the start of the next step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from runtime.engine import RequestError
from runtime.outputs import EngineStats, RequestOutput
from runtime.sampling import SamplingParams
from runtime.scheduler import QueueFullError
from runtime.serving import ServingEngine
from runtime.structured import GrammarCompiler

log = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineNotRunning", "KEEP_ALIVE", "QueueFullError", "RequestError", "RequestStream"]

KEEP_ALIVE = object()  # what __anext__ returns to a consumer woken by RequestStream.nudge, instead of a delta
# a tensor-parallel engine: how often a thread of its own looks for a dead rank (see AsyncEngine._watch_failure)
FAILURE_POLL_S = 0.05


class EngineNotRunning(RuntimeError):
    """The engine is not stepping (not started yet, shut down, or its step loop died)."""


@dataclass
class _Submission:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    timeout_s: float | None
    arrival_time: float
    outputs: asyncio.Queue  # RequestOutput deltas, on the submitting event loop
    loop: asyncio.AbstractEventLoop


def deliver(by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]]) -> None:
    """From the engine's side: each event loop gets its items (a step's deltas) in one call_soon_threadsafe, one
    wake-up per loop and step rather than one per delta; a closed loop (nobody listening) is skipped."""
    for loop, puts in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, puts)
        except RuntimeError:
            pass


def _put_all(puts: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in puts:
        q.put_nowait(item)


class RequestStream:
    """One submitted request's deltas, as an async iterator that ends after the finishing delta. Waiting for
    the next delta may be cancelled (a timeout) without losing it. Closing the stream before the finishing
    delta aborts the request."""

    def __init__(self, engine: EngineFront, request_id: str, outputs: asyncio.Queue) -> None:
        self.request_id = request_id
        self._engine = engine
        self._outputs = outputs  # RequestOutput deltas, or the exception that refused the request
        self._finished = False
        self._pending: BaseException | None = None  # taken by ready_deltas, raised by the next __anext__

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._finished:
            raise StopAsyncIteration
        if self._pending is not None:
            out, self._pending = self._pending, None
        else:
            out = await self._outputs.get()  # cancellation-safe: asyncio.Queue drops no item for a cancelled get
        if out is KEEP_ALIVE:
            return out
        if isinstance(out, BaseException):
            self._finished = True
            raise out
        self._finished = out.finished
        return out

    def ready_deltas(self) -> list[RequestOutput]:
        """The deltas already queued, without waiting, up to and including the finishing one (a refusal or error
        is kept for the next ``__anext__`` to raise). A consumer that fell behind sends them as one chunk."""
        ready: list[RequestOutput] = []
        while not self._finished and self._pending is None:
            try:
                out = self._outputs.get_nowait()
            except asyncio.QueueEmpty:
                break
            if out is KEEP_ALIVE:
                continue
            if isinstance(out, BaseException):
                self._pending = out
                break
            self._finished = out.finished
            ready.append(out)
        return ready

    def nudge(self) -> None:
        """Wake a consumer waiting in ``__anext__`` with KEEP_ALIVE when nothing is queued (a server's keep-alive
        for an idle stream: one timer for all streams instead of a timeout around every wait)."""
        if not self._finished and self._pending is None and self._outputs.empty():
            self._outputs.put_nowait(KEEP_ALIVE)

    async def aclose(self) -> None:
        if not self._finished:
            self._finished = True
            self._engine.abort(self.request_id)


class EngineFront:
    """What the server drives: ``submit`` (each engine's own) and ``generate`` over it."""

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, *, request_id: str | None = None,
               timeout_s: float | None = None, arrival_time: float | None = None) -> RequestStream:
        raise NotImplementedError

    @property
    def grammars(self) -> GrammarCompiler:
        """A structured-output compiler for the engine's vocabulary, for checks before a request is submitted."""
        raise NotImplementedError

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, *,
                       request_id: str | None = None, timeout_s: float | None = None,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's deltas until it finishes (``submit``, iterated). Raises RequestError or
        QueueFullError before the first delta if the request is refused. Closing the iterator early
        aborts the request."""
        stream = self.submit(prompt_token_ids, params, request_id=request_id, timeout_s=timeout_s,
                             arrival_time=arrival_time)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()


class AsyncEngine(EngineFront):
    """A ServingEngine stepping in a background thread, with an async per-request stream."""

    def __init__(self, engine: ServingEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.artifact = engine.engine.artifact
        self.max_seq_len: int = engine.scheduler_config.max_seq_len
        self._inbox: queue.SimpleQueue[_Submission] = queue.SimpleQueue()
        self._num_inbox = 0  # submissions not yet taken by the engine thread (guarded by _admit)
        self._admit = threading.Lock()
        self._streams: dict[str, _Submission] = {}  # engine thread only
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errored: BaseException | None = None  # set if the step loop died

    @property
    def grammars(self) -> GrammarCompiler:
        """The engine's own compiler: a grammar checked here is compiled already when its request is admitted."""
        return self.engine.grammars

    # --- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="engine-step", daemon=True)
            self._thread.start()
            if hasattr(self.engine.executor, "failure"):  # tensor parallel: a rank can die under a step
                threading.Thread(target=self._watch_failure, name="engine-failure", daemon=True).start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def ready(self) -> bool:
        """Loaded and stepping (what /health reports)."""
        return (self._thread is not None and self._thread.is_alive() and self.errored is None
                and self.engine.failure is None)

    def stats(self) -> EngineStats:
        stats = self.engine.stats()
        stats.num_waiting += self._num_inbox
        return stats

    # --- requests --------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError if the request could never run on this engine."""
        self.engine.check_request(prompt_token_ids, params)

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, *, request_id: str | None = None,
               timeout_s: float | None = None, arrival_time: float | None = None) -> RequestStream:
        """Queue a request for the engine thread and return its stream; call from the event loop. Raises
        at once (nothing queued) EngineNotRunning, RequestError for a request that can never run, or
        QueueFullError when the waiting queue is full. The caller must iterate the stream to its end or
        close it."""
        if not self.ready:
            raise EngineNotRunning("the engine is not running")
        self.validate(prompt_token_ids, params)
        request_id = request_id or uuid.uuid4().hex
        sub = _Submission(request_id, list(prompt_token_ids), params, timeout_s,
                          time.monotonic() if arrival_time is None else arrival_time, asyncio.Queue(),
                          asyncio.get_running_loop())
        with self._admit:
            scheduler = self.engine.scheduler
            num_new_waiting = scheduler._num_new_waiting + self._num_inbox
            if num_new_waiting >= scheduler.config.max_waiting:
                raise QueueFullError(f"{num_new_waiting} requests are already waiting "
                                     f"(max_waiting {scheduler.config.max_waiting})")
            self._num_inbox += 1
            self._inbox.put(sub)
        self._wake.set()
        return RequestStream(self, request_id, sub.outputs)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wake.set()

    # --- the engine thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            if engine.failure is not None:  # a dead tensor-parallel rank: nothing can run any more
                self.errored = engine.failure
                self._dispatch(engine.finish_all("error", str(engine.failure)))
                self._fail_all(EngineNotRunning(str(engine.failure)))
                self._fail_inbox(EngineNotRunning(str(engine.failure)))
                return
            self._take_inbox()
            if not engine.has_unfinished:
                self._wake.wait(0.1)  # also wakes for deadlines of nothing: cheap
                self._wake.clear()
                continue
            # a failure that belongs to one request finishes it alone inside ``step``; what raises here is the
            # shared step (scheduling, the forward pass, the device)
            try:
                outputs = engine.step()
            except Exception as e:  # fail the requests in flight, keep serving
                log.exception("engine step failed; failing %d requests", engine.scheduler.num_unfinished)
                outputs = engine.finish_all("error", f"the engine step failed: {type(e).__name__}: {e}")
            self._dispatch(outputs)
        self._dispatch(engine.finish_all("abort", "the server is shutting down"))
        self._fail_all(EngineNotRunning("the engine shut down"))

    def _watch_failure(self) -> None:
        """Tensor parallel: fail the requests in flight as soon as a rank's death is seen (the executor's sentinel
        thread sets the engine's failure), not when the engine thread comes back: that thread may be inside a
        collective waiting for the dead rank, for up to its timeout (runtime.tensor_parallel.COLLECTIVE_TIMEOUT_S).
        Touches only the streams' queues (each put from its own event loop) and the inbox; the engine's own state
        stays the engine thread's, which finishes the requests when it returns."""
        while not self._stop.wait(FAILURE_POLL_S):
            failure = self.engine.failure
            if failure is not None:
                error = EngineNotRunning(str(failure))
                for sub in list(self._streams.values()):  # a snapshot: the engine thread may still change it
                    _put_error(sub, error)
                self._fail_inbox(error)
                return

    def _fail_inbox(self, error: BaseException) -> None:
        """Submissions the engine thread never took: each stream gets ``error``."""
        while True:
            try:
                sub = self._inbox.get_nowait()
            except queue.Empty:
                return
            _put_error(sub, error)
            with self._admit:
                self._num_inbox -= 1

    def _take_inbox(self) -> None:
        while True:
            try:
                sub = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:
                self.engine.add_request(sub.prompt_token_ids, sub.params, request_id=sub.request_id,
                                        timeout_s=sub.timeout_s, arrival_time=sub.arrival_time)
            except (RequestError, QueueFullError, ValueError) as e:
                sub.loop.call_soon_threadsafe(sub.outputs.put_nowait, e)
            except Exception as e:  # e.g. the detokenizer rejects this prompt: this request fails alone
                log.exception("admitting request %s failed", sub.request_id)
                error = f"the engine could not admit the request: {type(e).__name__}: {e}"
                failed = RequestOutput(sub.request_id, "", [], None, True, "error", len(sub.prompt_token_ids), 0,
                                       error=error)
                sub.loop.call_soon_threadsafe(sub.outputs.put_nowait, failed)
            else:
                self._streams[sub.request_id] = sub
            finally:
                with self._admit:
                    self._num_inbox -= 1

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hand each delta to its request's queue: one wake-up of each event loop per step, not one per delta."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            sub = self._streams.get(out.request_id)
            if sub is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            by_loop.setdefault(sub.loop, []).append((sub.outputs, out))
        deliver(by_loop)

    def _fail_all(self, error: BaseException) -> None:
        for sub in self._streams.values():
            _put_error(sub, error)
        self._streams.clear()


def _put_error(sub: _Submission, error: BaseException) -> None:
    """``error`` into a request's stream, from any thread (its event loop puts it; a closed loop is skipped)."""
    try:
        sub.loop.call_soon_threadsafe(sub.outputs.put_nowait, error)
    except RuntimeError:
        pass
