"""EngineProcess: the serving engine in its own process behind AsyncEngine's interface. Streams equal the offline
engine's generations, refusals are decided before anything is sent, closing a stream aborts the request, a load
failure is a clear error, and a dead engine process fails its streams and the health check instead of hanging."""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest

from runtime import Engine, SamplingParams
from runtime.async_engine import EngineNotRunning
from runtime.engine import RequestError
from runtime.engine_process import EngineProcess, EngineStartError
from runtime.outputs import RequestOutput, TokenLogprob, merge_deltas
from runtime.scheduler import QueueFullError
from runtime.server import create_app
from runtime.serving import ServingConfig
from conftest import serve_app


@pytest.fixture(scope="module")
def offline(bundled_artifact) -> Engine:
    return Engine.load(bundled_artifact)


@pytest.fixture(scope="module")
def engine(bundled_artifact):
    e = EngineProcess(bundled_artifact, "cpu", ServingConfig(num_blocks=160, max_num_seqs=2, max_waiting=3))
    e.start()
    yield e
    e.shutdown()
    assert not e._proc.is_alive()


async def _collect(engine, prompt: list[int], params: SamplingParams) -> tuple[str, list[int], str, list]:
    text, ids, reason, logprobs = "", [], None, []
    async for out in engine.generate(prompt, params):
        text += out.text
        ids += out.token_ids
        reason = out.finish_reason
        logprobs += out.logprobs or []
    return text, ids, reason, logprobs


def _idle(engine, timeout: float = 10.0) -> None:
    """Wait until the engine process reports no running or waiting request and every KV block free."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        s = engine.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_blocks:
            return
        assert time.monotonic() < deadline, f"the engine did not go idle: {s}"
        time.sleep(0.05)


def test_concurrent_streams_equal_offline_generation(engine, offline):
    prompts = [offline.tokenizer.encode(p) for p in ("def add(a, b):", "import json\n", "class Node:\n    ",
                                                     "for i in range(", "x = [")]
    params = [SamplingParams(max_tokens=16, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=10, logprobs=3, ignore_eos=True),
              SamplingParams(max_tokens=20, stop=["\n"]),
              SamplingParams(max_tokens=8, repetition_penalty=1.3, ignore_eos=True,
                             logit_bias={prompts[4][0]: 4.0, prompts[0][0]: -100})]  # int keys: JSON strings between

    async def main():  # three requests at a time on two sequence slots: one waits, all stream at once
        first = await asyncio.gather(*(_collect(engine, p, q) for p, q in zip(prompts[:3], params[:3])))
        return first + await asyncio.gather(*(_collect(engine, p, q) for p, q in zip(prompts[3:], params[3:])))

    for prompt, q, (text, ids, reason, logprobs) in zip(prompts, params, asyncio.run(main())):
        ref = offline.generate(prompt, q)
        assert (text, ids, reason) == (ref.text, ref.token_ids, ref.finish_reason)
        if q.logprobs:  # the logprobs crossed the process boundary intact
            assert [e.token_id for e in logprobs] == ids and all(len(e.top) == 3 for e in logprobs)
            assert all(isinstance(e, TokenLogprob) and e.logprob <= 0 for e in logprobs)
    _idle(engine)


def test_refusals_are_raised_at_submit(engine, offline):
    async def main():
        with pytest.raises(RequestError, match="must be in"):
            engine.submit([0, 10**9], SamplingParams())
        with pytest.raises(RequestError, match="empty"):
            engine.submit([], SamplingParams())
        with pytest.raises(RequestError, match="max_seq_len"):
            engine.submit([1] * engine.max_seq_len, SamplingParams())
        with pytest.raises(RequestError, match="^logit_bias: token id 1000000000 is outside"):
            engine.submit([1, 2], SamplingParams(logit_bias={10**9: 1.0}))

    asyncio.run(main())


def test_a_full_waiting_queue_refuses_with_queue_full(engine, offline):
    prompt = offline.tokenizer.encode("def f():")

    async def main():  # requests not yet taken by the engine count as waiting, as in AsyncEngine's inbox; once taken,
        # two of them run (max_num_seqs 2). So the refusal comes after 3 submits at the earliest (none taken yet) and
        # after 5 at the latest (2 running, 3 waiting), whenever the engine happens to read them.
        streams, refusal = [], None
        for _ in range(6):
            try:
                streams.append(engine.submit(prompt, SamplingParams(max_tokens=300, ignore_eos=True)))
            except QueueFullError as e:
                refusal = e
                break
        for s in streams:
            await s.aclose()  # aborts each
        return len(streams), refusal

    accepted, refusal = asyncio.run(main())
    assert refusal is not None and "max_waiting 3" in str(refusal)
    assert 3 <= accepted <= 5
    _idle(engine)


def test_closing_the_stream_aborts_and_frees_blocks(engine, offline):
    prompt = offline.tokenizer.encode("def main():")

    async def main():
        stream = engine.generate(prompt, SamplingParams(max_tokens=300, ignore_eos=True))
        async for _ in stream:
            break  # the client goes away after the first delta
        await stream.aclose()

    asyncio.run(main())
    _idle(engine)


def test_the_server_streams_through_the_engine_process(engine, offline):
    prompt = "def fibonacci(n):"
    ref = offline.generate(offline.tokenizer.encode(prompt), SamplingParams(max_tokens=12, ignore_eos=True))
    with serve_app(create_app(engine, "m")) as url:
        body = {"model": "m", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref.text
        chunks = []
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as s:
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:])["choices"][0]["text"])
        assert "".join(chunks) == ref.text
        too_long = httpx.post(f"{url}/v1/completions", json={**body, "prompt": [1] * 5000}, timeout=60)
        assert too_long.status_code == 400
    assert not engine.ready  # the app's shutdown stopped the engine process (this test is the fixture's last user)


def test_a_load_failure_is_a_clear_error(bundled_artifact, tmp_path):
    broken = tmp_path / "art"
    shutil.copytree(bundled_artifact, broken)
    weights = next(broken.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped byte: the engine process's hash check refuses the artifact
    weights.write_bytes(bytes(data))
    with pytest.raises(EngineStartError, match=weights.name):
        EngineProcess(broken, "cpu", ServingConfig(num_blocks=160))


def test_a_dead_engine_process_fails_streams_and_health(bundled_artifact, offline):
    engine = EngineProcess(bundled_artifact, "cpu", ServingConfig(num_blocks=160, max_num_seqs=4))
    prompt = offline.tokenizer.encode("def g():")
    with serve_app(create_app(engine, "m")) as url:
        async def main():
            stream = engine.generate(prompt, SamplingParams(max_tokens=400, ignore_eos=True))
            got = 0
            with pytest.raises(EngineNotRunning):
                async for _ in stream:
                    got += 1
                    if got == 2:
                        engine._proc.kill()  # the engine process dies mid-stream
            return got

        assert asyncio.run(main()) >= 2
        assert httpx.get(f"{url}/health", timeout=10).status_code == 503
        r = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503


def test_merge_deltas_joins_what_a_slow_consumer_missed():
    a = RequestOutput("r", "ab", [1, 2], [TokenLogprob(1, -0.1), TokenLogprob(2, -0.2)], False, None, 5, 2)
    b = RequestOutput("r", "", [3], [TokenLogprob(3, -0.3)], False, None, 5, 3)
    c = RequestOutput("r", "c", [4], [TokenLogprob(4, -0.4)], True, "length", 5, 4, num_cached_tokens=2)
    m = merge_deltas([a, b, c])
    assert (m.text, m.token_ids, m.finished, m.finish_reason, m.num_output_tokens, m.num_cached_tokens) == \
        ("abc", [1, 2, 3, 4], True, "length", 4, 2)
    assert [e.token_id for e in m.logprobs] == [1, 2, 3, 4]
    assert merge_deltas([b]) is b
    no_logprobs = RequestOutput("r", "x", [9], None, False, None, 5, 1)
    assert merge_deltas([no_logprobs, no_logprobs]).logprobs is None


def test_several_channels_route_results_and_survive_a_closed_one(bundled_artifact, offline):
    """One engine process, two channels (what ``--api-servers 2`` runs): each client's streams equal the offline
    generations, served side by side in one step loop; a client that closes with a request in flight has it aborted
    (its blocks freed) while the other keeps streaming; the engine stops once its last channel has closed."""
    from runtime.engine_process import EngineClient, start_engine_process, stop_process

    proc, channels, limits = start_engine_process(bundled_artifact, "cpu",
                                                  ServingConfig(num_blocks=160, max_num_seqs=4), num_channels=2)
    try:
        a, b = (EngineClient(bundled_artifact, to_engine, from_engine, limits) for to_engine, from_engine in channels)
        a.start()
        b.start()
        prompts = [offline.tokenizer.encode(p) for p in ("def add(a, b):", "import json\n", "class Node:\n    ")]
        params = SamplingParams(max_tokens=12, ignore_eos=True)

        async def both():
            return await asyncio.gather(_collect(a, prompts[0], params), _collect(b, prompts[1], params),
                                        _collect(a, prompts[2], params))

        for prompt, (text, ids, reason, _) in zip(prompts, asyncio.run(both())):
            ref = offline.generate(prompt, params)
            assert (text, ids, reason) == (ref.text, ref.token_ids, ref.finish_reason)

        async def close_a_mid_stream():
            long = SamplingParams(max_tokens=200, ignore_eos=True)
            a.submit(prompts[0], long)  # never read: a's process is about to exit
            stream = b.generate(prompts[1], SamplingParams(max_tokens=30, ignore_eos=True))
            first = await stream.__anext__()
            a.shutdown()  # its channel closes: the engine aborts a's request
            rest = [out async for out in stream]
            return [first, *rest]

        outs = asyncio.run(close_a_mid_stream())
        assert outs[-1].finish_reason == "length" and sum(len(o.token_ids) for o in outs) == 30
        _idle(b)  # a's request was aborted: every block free again
        assert b.ready and not a.ready
        b.shutdown()
        proc.join(30)
        assert not proc.is_alive() and proc.exitcode == 0, "the engine stops once its last channel has closed"
    finally:
        stop_process(proc)
