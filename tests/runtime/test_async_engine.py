"""AsyncEngine: concurrent streams equal the offline engine, early close aborts, admission control."""

from __future__ import annotations

import asyncio
import time

import pytest

from runtime import Engine, SamplingParams
from runtime.async_engine import AsyncEngine
from runtime.engine import RequestError
from runtime.scheduler import QueueFullError
from runtime.serving import ServingConfig, ServingEngine


@pytest.fixture(scope="module")
def offline(bundled_artifact) -> Engine:
    return Engine.load(bundled_artifact)


@pytest.fixture
def engine(offline):
    e = AsyncEngine(ServingEngine(offline, ServingConfig(num_blocks=48, max_num_seqs=4, max_waiting=3)))
    e.start()
    yield e
    e.shutdown()
    pool = e.engine.kv.pool
    assert pool.num_free == pool.num_blocks and e.engine.scheduler.num_unfinished == 0


async def _collect(engine: AsyncEngine, prompt: list[int], params: SamplingParams) -> tuple[str, list[int], str]:
    text, ids, reason = "", [], None
    async for out in engine.generate(prompt, params):
        text += out.text
        ids += out.token_ids
        reason = out.finish_reason
    return text, ids, reason


def test_concurrent_streams_equal_offline_generation(engine, offline):
    prompts = [offline.tokenizer.encode(p) for p in ("def add(a, b):", "import json\n", "class Node:\n    ")]
    params = SamplingParams(max_tokens=16, ignore_eos=True)

    async def main():
        return await asyncio.gather(*(_collect(engine, p, params) for p in prompts))

    for prompt, (text, ids, reason) in zip(prompts, asyncio.run(main())):
        ref = offline.generate(prompt, params)
        assert (text, ids, reason) == (ref.text, ref.token_ids, "length")


def test_closing_the_stream_aborts_and_frees_blocks(engine, offline):
    prompt = offline.tokenizer.encode("def main():")

    async def main():
        stream = engine.generate(prompt, SamplingParams(max_tokens=300, ignore_eos=True))
        async for _ in stream:
            break  # the client goes away after the first delta
        await stream.aclose()
        deadline = time.monotonic() + 10
        pool = engine.engine.kv.pool
        while (engine.engine.scheduler.num_unfinished or pool.num_free != pool.num_blocks) \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert engine.engine.scheduler.num_unfinished == 0
    assert engine.engine.kv.pool.num_free == engine.engine.kv.pool.num_blocks


def test_admission_is_refused_at_once_when_the_queue_is_full(engine, offline):
    prompt = offline.tokenizer.encode("x = 1\n")
    params = SamplingParams(max_tokens=30, ignore_eos=True)

    async def main():
        async def one():
            try:
                return await _collect(engine, prompt, params)
            except QueueFullError:
                return "rejected"

        return await asyncio.gather(*(one() for _ in range(12)))

    results = asyncio.run(main())
    rejected = [r for r in results if r == "rejected"]
    done = [r for r in results if r != "rejected"]
    assert rejected and done  # 4 running + 3 waiting at most; the rest refused
    assert all(len(ids) == 30 for _, ids, _ in done)

    async def bad():
        async for _ in engine.generate([], params):
            pass

    with pytest.raises(RequestError, match="empty"):
        asyncio.run(bad())


def test_a_nudged_stream_wakes_with_keep_alive_and_loses_no_delta():
    """RequestStream.nudge (the server's keep-alive ticker): a waiting consumer gets KEEP_ALIVE; with a delta or an
    error queued, or once finished, a nudge adds nothing; ready_deltas passes over a marker."""
    from runtime.async_engine import KEEP_ALIVE, RequestStream
    from runtime.outputs import RequestOutput

    class Front:
        aborted: list[str] = []

        def abort(self, request_id: str) -> None:
            self.aborted.append(request_id)

    def delta(text: str, finished: bool = False) -> RequestOutput:
        return RequestOutput("r", text, [1], None, finished, "length" if finished else None, 3, 1)

    async def run() -> None:
        queue: asyncio.Queue = asyncio.Queue()
        stream = RequestStream(Front(), "r", queue)
        waiter = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        stream.nudge()
        assert await waiter is KEEP_ALIVE
        first = delta("a")
        queue.put_nowait(first)
        stream.nudge()  # a delta is queued: nothing added
        assert queue.qsize() == 1 and await stream.__anext__() is first
        stream.nudge()
        last = delta("b", finished=True)
        queue.put_nowait(last)
        assert stream.ready_deltas() == [last]  # the marker before it is passed over
        stream.nudge()  # finished: nothing added
        assert queue.empty()
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()

    asyncio.run(run())


def test_a_rank_dying_under_a_stuck_step_fails_its_requests_at_once(offline):
    """Tensor parallel: the engine thread can be inside a collective that waits for a dead rank until its timeout.
    The requests in flight (and those not yet taken) must fail as soon as the engine's failure is set, not then;
    /health's readiness turns false at once. A stand-in executor attribute and a step that blocks play the parts."""
    import threading

    from runtime.async_engine import EngineNotRunning

    serving = ServingEngine(offline, ServingConfig(num_blocks=48, max_num_seqs=4))
    serving.executor.failure = None  # what a tensor-parallel executor has (the failure watcher starts for it)
    stuck, release = threading.Event(), threading.Event()
    step = serving.step

    def stuck_step():
        outputs = step()
        if serving.num_steps >= 2:
            stuck.set()
            release.wait(30)  # a collective waiting for a rank that is gone
        return outputs

    serving.step = stuck_step
    engine = AsyncEngine(serving)
    engine.start()
    prompt = offline.tokenizer.encode("def main():")

    async def main():
        first = engine.generate(prompt, SamplingParams(max_tokens=200, ignore_eos=True))
        got = []

        async def read(stream):
            try:
                async for out in stream:
                    got.append(out)
            except EngineNotRunning as e:
                return e
            return None

        reader = asyncio.ensure_future(read(first))
        while not stuck.is_set():
            await asyncio.sleep(0.01)
        late = engine.generate(prompt, SamplingParams(max_tokens=4))  # queued, never taken by the stuck thread
        late_reader = asyncio.ensure_future(read(late))
        start = time.monotonic()
        serving.executor.failure = RuntimeError("worker rank 1 (pid 123) exited with signal SIGKILL")
        errors = await asyncio.wait_for(asyncio.gather(reader, late_reader), 5)
        return errors, time.monotonic() - start

    try:
        (first_error, late_error), waited = asyncio.run(main())
        assert isinstance(first_error, EngineNotRunning) and "rank 1" in str(first_error)
        assert isinstance(late_error, EngineNotRunning)
        assert waited < 2, f"the requests waited {waited:.1f} s for the stuck step"
        assert not engine.ready
    finally:
        release.set()
        engine.shutdown()
        del serving.executor.failure  # the executor is the module's offline engine's: leave it as it was
