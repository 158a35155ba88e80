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
