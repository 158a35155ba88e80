"""A failure that belongs to one request fails that request alone: its sampling (raising, or a row without a
valid distribution), its logprobs, its detokenization or its stop check. The other requests of the same
batch finish with the tokens they get without it, on the synchronous and the overlapped decode path and
through the HTTP server (the failed request: a 500 server_error, or an error event in its stream).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import pytest

import runtime.serving as serving_module
from conftest import serve_app
from runtime import Engine, SamplingParams
from runtime.async_engine import AsyncEngine
from runtime.outputs import RequestOutput
from runtime.server import create_app
from runtime.serving import ServingConfig, ServingEngine
from test_overlap import EagerGraphs

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Config:\n    ", "for i in range(10):\n"]
BAD = 1  # the request that fails
FAIL_AT = 3  # it fails on its third token: two were generated and emitted before
POISON_SEED = 4242  # marks the failing request's params where only its params reach the code


@pytest.fixture(scope="module")
def engine(bundled_artifact) -> Engine:
    return Engine.load(bundled_artifact)


def _params() -> list[SamplingParams]:
    """Greedy, seeded and unseeded-sampled rows around the failing one (greedy, or seeded where marked)."""
    return [SamplingParams(max_tokens=16, ignore_eos=True),
            SamplingParams(max_tokens=16, ignore_eos=True, seed=POISON_SEED),
            SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.9, top_p=0.95, seed=7),
            SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2)]


@dataclass
class Result:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    error: str | None = None


def _run(s: ServingEngine, prompts: list[list[int]], params: list[SamplingParams],
         inject: Callable[[ServingEngine, list[str]], None] = lambda s, ids: None) -> list[Result]:
    ids = [f"r{i}" for i in range(len(prompts))]
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        s.add_request(prompt, p, request_id=ids[i])
    inject(s, ids)
    results = {i: Result([], "") for i in ids}
    while s.has_unfinished:
        for out in s.step():
            r = results[out.request_id]
            r.token_ids += out.token_ids
            r.text += out.text
            r.finish_reason, r.error = out.finish_reason, out.error
    assert s.scheduler.num_unfinished == 0 and s._inflight is None
    assert s.kv.pool.num_free == s.kv.pool.num_blocks, "KV blocks leaked"
    return [results[i] for i in ids]


# --- what fails, injected ---------------------------------------------------------------------------------
def _nth_call_raises(n: int, what: str, real: Callable) -> Callable:
    calls = 0

    def fn(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == n:
            raise RuntimeError(f"injected {what} failure")
        return real(*args, **kwargs)

    return fn


def _poisoned_sample(monkeypatch, mode: str) -> list[int]:
    """Patch the sampler the serving engine calls: from the failing request's FAIL_AT-th token on, a batch
    holding it raises ("raise") or its logits row is NaN ("nan"). Returns the sizes of the batches hit."""
    real, hits, batch_sizes = serving_module.sample, [0], []

    def sample(logits, params, generators, **histories):
        rows = [i for i, p in enumerate(params) if p.seed == POISON_SEED]
        if rows:
            hits[0] += 1
        if rows and hits[0] >= FAIL_AT:
            batch_sizes.append(len(params))
            if mode == "raise":
                raise RuntimeError("injected sampling failure")
            logits = logits.clone()
            logits[rows] = float("nan")
        return real(logits, params, generators, **histories)

    monkeypatch.setattr(serving_module, "sample", sample)
    return batch_sizes


def _poisoned_logprobs(monkeypatch) -> None:
    real = serving_module.compute_logprobs
    calls = [0]

    def compute_logprobs(logits, token_ids, num_top):
        if 5 in num_top:  # the failing request asks for 5 alternatives, the healthy one for 2
            calls[0] += 1
            if calls[0] >= FAIL_AT:
                raise RuntimeError("injected logprobs failure")
        return real(logits, token_ids, num_top)

    monkeypatch.setattr(serving_module, "compute_logprobs", compute_logprobs)


def _inject_track(attribute: str, method: str, n: int) -> Callable[[ServingEngine, list[str]], None]:
    """Make the failing request's detokenizer or stop checker raise on its n-th call."""
    def inject(s: ServingEngine, ids: list[str]) -> None:
        owner = getattr(s._tracks[ids[BAD]], attribute)
        setattr(owner, method, _nth_call_raises(n, f"{attribute}.{method}", getattr(owner, method)))

    return inject


FAILURES = {  # name -> (what the error message says, tokens the failing request ends with)
    "sampling raises": ("sampling failed: RuntimeError: injected sampling failure", FAIL_AT - 1),
    "sampling gives NaN": ("gave no valid token distribution", FAIL_AT - 1),
    "logprobs raise": ("computing logprobs failed: RuntimeError: injected logprobs failure", FAIL_AT - 1),
    # the token was sampled and recorded; turning it into text failed
    "detokenizer raises": ("detokenizing or checking the stop conditions of token", FAIL_AT),
    "stop check raises": ("RuntimeError: injected stops.check failure", FAIL_AT),
}


def _setup(name: str, monkeypatch, params: list[SamplingParams]) -> Callable[[ServingEngine, list[str]], None]:
    if name == "sampling raises":
        _poisoned_sample(monkeypatch, "raise")
    elif name == "sampling gives NaN":
        _poisoned_sample(monkeypatch, "nan")
    elif name == "logprobs raise":
        params[BAD] = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=5)
        _poisoned_logprobs(monkeypatch)
    elif name == "detokenizer raises":
        return _inject_track("detok", "push", FAIL_AT)
    elif name == "stop check raises":  # checked when a token is emitted and again for the delta's safe text
        params[BAD] = SamplingParams(max_tokens=16, ignore_eos=True, stop=["never in this text"])
        return _inject_track("stops", "check", 2 * FAIL_AT - 1)
    return lambda s, ids: None


def _check(results: list[Result], reference: list[Result], name: str) -> None:
    for i, (got, ref) in enumerate(zip(results, reference)):
        if i == BAD:
            message, num_tokens = FAILURES[name]
            assert got.finish_reason == "error", got
            assert message in got.error, got.error
            assert len(got.token_ids) == num_tokens, got  # what it produced before failing, nothing after
        else:
            assert (got.token_ids, got.text, got.finish_reason, got.error) == \
                (ref.token_ids, ref.text, "length", None), f"request {i} was affected"


@pytest.mark.parametrize("name", list(FAILURES))
def test_a_failing_request_fails_alone(engine, monkeypatch, name):
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    params = _params()
    reference = _run(ServingEngine(engine, ServingConfig(num_blocks=64)), prompts, params)
    assert all(r.finish_reason == "length" and len(r.token_ids) == 16 for r in reference)
    inject = _setup(name, monkeypatch, params)
    s = ServingEngine(engine, ServingConfig(num_blocks=64))
    _check(_run(s, prompts, params, inject), reference, name)


@pytest.mark.parametrize("mode", ["raise", "nan"])
def test_a_failing_request_fails_alone_on_the_overlapped_path(engine, monkeypatch, mode):
    """The overlapped decode pipeline: the failing row's token is not known when the next step launches (it is
    fed token 0 instead of INVALID_TOKEN); the request is finished once the step is read back."""
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    params = [SamplingParams(max_tokens=16, ignore_eos=True, seed=s) for s in (None, POISON_SEED, None, None)]
    params[2] = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.9, seed=7)

    def overlapped() -> tuple[ServingEngine, EagerGraphs]:
        s = ServingEngine(engine, ServingConfig(num_blocks=64))
        s.graphs = EagerGraphs(s, s.scheduler_config.max_num_seqs)
        return s, s.graphs

    s, graphs = overlapped()
    reference = _run(s, prompts, params)
    assert graphs.num_device_inputs > 0, "the pipeline was meant to overlap"
    batch_sizes = _poisoned_sample(monkeypatch, mode)
    s, graphs = overlapped()
    results = _run(s, prompts, params)
    assert graphs.num_device_inputs > 0 and max(batch_sizes) == len(prompts)
    _check(results, reference, "sampling raises" if mode == "raise" else "sampling gives NaN")


def test_add_request_failure_fails_that_request_alone(engine, monkeypatch):
    """A request the engine thread cannot admit (here: its detokenizer cannot be made) gets an error delta;
    the engine keeps stepping the others."""
    real = serving_module.IncrementalDetokenizer

    def detokenizer(tokenizer, prompt_ids):
        if len(prompt_ids) == 3:
            raise RuntimeError("injected detokenizer failure")
        return real(tokenizer, prompt_ids)

    monkeypatch.setattr(serving_module, "IncrementalDetokenizer", detokenizer)
    async_engine = AsyncEngine(ServingEngine(engine, ServingConfig(num_blocks=64)))
    async_engine.start()
    prompt = engine.tokenizer.encode("def add(a, b):")
    ref = engine.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))

    async def collect(ids: list[int]) -> list[RequestOutput]:
        return [out async for out in async_engine.generate(ids, SamplingParams(max_tokens=8, ignore_eos=True))]

    async def main():  # the bound: a dead engine thread would leave both waiting forever
        return await asyncio.wait_for(asyncio.gather(collect([5, 6, 7]), collect(prompt)), 60)

    try:
        bad, good = asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert [(o.finish_reason, o.error) for o in bad] == [
        ("error", "the engine could not admit the request: RuntimeError: injected detokenizer failure")]
    assert [t for o in good for t in o.token_ids] == ref.token_ids and good[-1].finish_reason == "length"
    assert async_engine.engine.scheduler.num_unfinished == 0
    assert async_engine.engine.kv.pool.num_free == async_engine.engine.kv.pool.num_blocks


# --- through the server -------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["raise", "nan"])
def test_the_server_answers_the_failing_request_with_an_error_and_the_others_normally(bundled_artifact, engine,
                                                                                      monkeypatch, mode):
    batch_sizes = _poisoned_sample(monkeypatch, mode)
    healthy = [{"prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True} for p in PROMPTS]
    bad = {"prompt": "def main():", "max_tokens": 24, "temperature": 0.8, "seed": POISON_SEED, "ignore_eos": True}
    serving = ServingEngine.load(bundled_artifact, config=ServingConfig(num_blocks=64, max_num_seqs=8))

    async def send(client: httpx.AsyncClient, body: dict, stream: bool):
        if not stream:
            return await client.post("/v1/completions", json=body)
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            return r.status_code, [line async for line in r.aiter_lines() if line]

    async def main(url: str):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(*(send(client, b, False) for b in healthy), send(client, bad, False),
                                        send(client, bad, True))

    with serve_app(create_app(AsyncEngine(serving), "m")) as url:
        *ok, whole, (status, lines) = asyncio.run(main(url))
    assert batch_sizes and max(batch_sizes) > 2, "the failing request was meant to share its batches"
    for body, r in zip(healthy, ok):
        assert r.status_code == 200, r.text
        ref = engine.generate(body["prompt"], SamplingParams(max_tokens=24, ignore_eos=True))
        assert r.json()["choices"][0]["text"] == ref.text
    assert whole.status_code == 500, whole.text
    error = whole.json()["error"]
    assert error["type"] == "server_error"
    assert FAILURES[f"sampling {'raises' if mode == 'raise' else 'gives NaN'}"][0] in error["message"]
    assert status == 200 and lines[-1] == "data: [DONE]"
    events = [json.loads(line[len("data: "):]) for line in lines[:-1] if line.startswith("data: ")]
    assert events[-1]["error"]["type"] == "server_error" and all("error" not in e for e in events[:-1])
    assert serving.scheduler.num_unfinished == 0 and serving.kv.pool.num_free == serving.kv.pool.num_blocks
