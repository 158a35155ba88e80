"""The OpenAI-compatible server over real HTTP: uvicorn on a free loopback port, httpx as the client.

Results are compared with the offline engine (``Engine.generate`` / ``Engine.chat``) loaded apart from
the server; every test that sends work ends by checking that the server's KV pool is whole again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openapi_spec_validator
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import BUNDLED, build_artifact, serve_app
from runtime import Engine, SamplingParams
from runtime.async_engine import AsyncEngine
from runtime.generation_config import GenerationConfigError
from runtime.server import create_app
from runtime.serving import ServingConfig, ServingEngine

MODEL = "pystdlib"
API_KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Server:
    url: str
    serving: ServingEngine  # the engine behind the app, to check its KV pool

    def client(self, timeout: float = 30) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=AUTH, timeout=timeout)

    def async_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers=AUTH, timeout=30)

    def wait_idle(self, timeout: float = 5.0) -> None:
        """Wait until no request is left in the engine; then every KV block must be free."""
        pool, scheduler = self.serving.kv.pool, self.serving.scheduler
        deadline = time.monotonic() + timeout
        while (scheduler.num_unfinished or pool.num_free != pool.num_blocks) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert scheduler.num_unfinished == 0, f"{scheduler.num_unfinished} requests still in the engine"
        assert pool.num_free == pool.num_blocks, f"{pool.num_blocks - pool.num_free} KV blocks leaked"


@contextlib.contextmanager
def run_server(artifact: Path, config: ServingConfig, api_key: str | None = API_KEY):
    """A uvicorn server in a background thread on a free loopback port, until the block exits."""
    serving = ServingEngine.load(artifact, config=config)
    with serve_app(create_app(AsyncEngine(serving), MODEL, api_key=api_key)) as url:
        yield Server(url, serving)


@pytest.fixture(scope="module")
def offline(bundled_artifact) -> Engine:
    return Engine.load(bundled_artifact)


@pytest.fixture(scope="module")
def server(bundled_artifact):
    with run_server(bundled_artifact, ServingConfig(num_blocks=64, max_num_seqs=8)) as s:
        yield s


# --- helpers --------------------------------------------------------------------------------------------
def read_events(lines) -> tuple[list[dict], bool]:
    """The JSON events of an SSE body and whether it ended with [DONE] (and nothing after it). Comment lines
    (keep-alives) are skipped, as SSE clients do."""
    events, done = [], False
    for line in lines:
        if not line or line.startswith(":"):
            continue
        assert line.startswith("data: "), line
        assert not done, "data after [DONE]"
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
        else:
            events.append(json.loads(data))
    return events, done


def streamed(client: httpx.Client, path: str, body: dict) -> tuple[list[dict], bool]:
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return read_events(r.iter_lines())


def joined_text(chunks: list[dict], chat: bool) -> str:
    key = (lambda c: c["delta"].get("content") or "") if chat else (lambda c: c["text"])
    return "".join(key(c) for e in chunks for c in e["choices"])


def finish_reasons(chunks: list[dict]) -> list[str]:
    return [c["finish_reason"] for e in chunks for c in e["choices"] if c["finish_reason"] is not None]


def assert_error(r: httpx.Response, status: int, param: str | None = ...) -> dict:
    """The response is an OpenAI error with this status (and param, when given)."""
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if param is not ...:
        assert body["error"]["param"] == param, body
    return body["error"]


def usage_of(offline_result) -> dict:
    n_prompt, n_out = len(offline_result.prompt_token_ids), len(offline_result.token_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def metric_samples(client: httpx.Client) -> dict[tuple[str, tuple], float]:
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


# --- 1. concurrent requests equal the offline engine ------------------------------------------------------
COMPLETION_CASES = [("def fibonacci(n):", 24), ("import os\nimport sys\n", 9), ("class Config:\n    ", 40)]
CHAT = [{"role": "user", "content": "Write a function that adds two numbers."}]


def test_concurrent_streamed_and_whole_requests_equal_offline(server, offline):
    greedy = {"temperature": 0, "ignore_eos": True}
    requests = []  # (path, body, stream, expected offline Generation)
    for prompt, n in COMPLETION_CASES:
        ref = offline.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
        for stream in (False, True):
            requests.append(("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": n, **greedy},
                             stream, ref))
    ids = offline.tokenizer.encode("def main():")
    ref = offline.generate(ids, SamplingParams(max_tokens=12, ignore_eos=True))
    requests.append(("/v1/completions", {"prompt": ids, "max_tokens": 12, **greedy}, True, ref))
    requests.append(("/v1/completions", {"prompt": [ids], "max_tokens": 12, **greedy}, False, ref))
    ref = offline.chat(CHAT, SamplingParams(max_tokens=20, ignore_eos=True))
    for stream in (False, True):
        requests.append(("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_completion_tokens": 20,
                                                  **greedy}, stream, ref))

    async def send(client, path, body, stream):
        if not stream:
            r = await client.post(path, json=body)
            assert r.status_code == 200, r.text
            return r.json()
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", path, json=body) as r:
            assert r.status_code == 200, await r.aread()
            return read_events([line async for line in r.aiter_lines()])

    async def main():
        async with server.async_client() as client:
            return await asyncio.gather(*(send(client, p, b, s) for p, b, s, _ in requests))

    results = asyncio.run(main())
    for (path, body, stream, ref), result in zip(requests, results):
        chat = path.endswith("chat/completions")
        if stream:
            events, done = result
            assert done, "the stream did not end with [DONE]"
            *chunks, usage = events
            kind = "chat.completion.chunk" if chat else "text_completion"
            assert all(e["object"] == kind and e["model"] == MODEL for e in events)
            assert len({e["id"] for e in events}) == 1 and events[0]["id"].startswith("chatcmpl-" if chat else "cmpl-")
            assert joined_text(chunks, chat) == ref.text
            assert finish_reasons(chunks) == [ref.finish_reason] and chunks[-1]["choices"][0]["finish_reason"]
            if chat:
                assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            assert usage["choices"] == [] and {k: usage["usage"][k] for k in usage_of(ref)} == usage_of(ref)
            assert all(e["usage"] is None for e in chunks)
        else:
            assert result["id"].startswith("chatcmpl-" if chat else "cmpl-") and result["model"] == MODEL
            assert result["object"] == ("chat.completion" if chat else "text_completion")
            assert isinstance(result["created"], int)
            (choice,) = result["choices"]
            text = choice["message"]["content"] if chat else choice["text"]
            if chat:
                assert choice["message"]["role"] == "assistant"
            assert text == ref.text and choice["finish_reason"] == ref.finish_reason == "length"
            assert {k: result["usage"][k] for k in usage_of(ref)} == usage_of(ref)
            assert 0 <= result["usage"]["prompt_tokens_details"]["cached_tokens"] <= result["usage"]["prompt_tokens"]
    server.wait_idle()


def test_default_max_tokens_is_capped_and_fits_the_context(server, offline):
    with server.client() as client:
        short = client.post("/v1/completions", json={"prompt": "def f():", "ignore_eos": True})
        ids = offline.tokenizer.encode("x = 1\n" * 200)[:500]  # 12 tokens of room before max_seq_len 512
        long = client.post("/v1/completions", json={"prompt": ids, "ignore_eos": True})
    assert short.json()["usage"]["completion_tokens"] == 256
    assert long.json()["usage"]["completion_tokens"] == 512 - 500
    assert long.json()["choices"][0]["finish_reason"] == "length"
    server.wait_idle()


# --- 2. seeded sampling is reproducible, alone or in a batch ----------------------------------------------
def test_seeded_sampling_is_reproducible_under_concurrency(server, offline):
    body = {"prompt": "def parse(text):", "max_tokens": 24, "temperature": 0.8, "seed": 123, "ignore_eos": True}
    others = [{"prompt": p, "max_tokens": 24, "temperature": 1.0, "ignore_eos": True}
              for p in ("import re\n", "for i in range(10):", "class A:")]
    with server.client() as client:
        alone = client.post("/v1/completions", json=body).json()["choices"][0]["text"]

    async def main():
        async with server.async_client() as client:
            rs = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in [body, *others, body]))
        return [r.json()["choices"][0]["text"] for r in rs]

    texts = asyncio.run(main())
    ref = offline.generate("def parse(text):", SamplingParams(max_tokens=24, temperature=0.8, seed=123,
                                                              ignore_eos=True))
    assert alone == texts[0] == texts[-1] == ref.text
    other_seed = offline.generate("def parse(text):", SamplingParams(max_tokens=24, temperature=0.8, seed=124,
                                                                     ignore_eos=True))
    assert other_seed.text != ref.text  # the seed matters: the equalities above are not vacuous
    server.wait_idle()


# --- sampling defaults: the checkpoint's generation_config.json, else OpenAI's ---------------------------------
CHECKPOINT_DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05}


@pytest.fixture(scope="module")
def tuned_artifact(tmp_path_factory) -> Path:
    """The bundled model, built from a checkpoint whose generation_config.json sets sampling defaults."""
    checkpoint = tmp_path_factory.mktemp("tuned") / "pystdlib"
    shutil.copytree(BUNDLED, checkpoint)
    config = json.loads((checkpoint / "generation_config.json").read_text())
    (checkpoint / "generation_config.json").write_text(json.dumps({**config, "do_sample": True, **CHECKPOINT_DEFAULTS}))
    return build_artifact(checkpoint, checkpoint.parent / "artifact", max_batch_size=8, max_seq_len=512,
                          max_num_tokens=64)


def test_omitted_sampling_fields_take_openai_defaults(server, offline):
    """The bundled checkpoint sets no sampling defaults: a request without temperature samples at 1.0."""
    prompt, n = "def parse(text):", 24
    with server.client() as client:
        text = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": n, "seed": 5,
                                                    "ignore_eos": True}).json()["choices"][0]["text"]
        chat = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": n, "seed": 5,
                                                         "ignore_eos": True}).json()["choices"][0]["message"]["content"]
    sampled = SamplingParams(max_tokens=n, temperature=1.0, top_p=1.0, seed=5, ignore_eos=True)
    assert text == offline.generate(prompt, sampled).text and chat == offline.chat(CHAT, sampled).text
    greedy = SamplingParams(max_tokens=n, ignore_eos=True)
    assert text != offline.generate(prompt, greedy).text and chat != offline.chat(CHAT, greedy).text
    server.wait_idle()


def test_omitted_sampling_fields_take_the_checkpoint_defaults(tuned_artifact):
    prompt, n = "def parse(text):", 24
    offline = Engine.load(tuned_artifact)
    with run_server(tuned_artifact, ServingConfig(num_blocks=64)) as s, s.client() as client:
        body = {"prompt": prompt, "max_tokens": n, "seed": 5, "ignore_eos": True}
        defaulted = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        chosen = client.post("/v1/completions", json={**body, "temperature": 0}).json()["choices"][0]["text"]
        s.wait_idle()
    ref = offline.generate(prompt, SamplingParams(max_tokens=n, seed=5, ignore_eos=True, **CHECKPOINT_DEFAULTS))
    assert defaulted == ref.text
    # the defaults matter: OpenAI's or greedy decoding give other text
    assert ref.text != offline.generate(prompt, SamplingParams(max_tokens=n, seed=5, ignore_eos=True,
                                                               temperature=1.0)).text
    assert ref.text != offline.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True)).text
    # what the request sets wins; what it leaves out (here the repetition penalty) still comes from the file
    assert chosen == offline.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True,
                                                             repetition_penalty=1.05)).text
    assert chosen != offline.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True)).text


def test_a_bad_generation_config_stops_the_start_up(server, bundled_artifact, tmp_path, monkeypatch):
    """A sampling default the server could not use fails the start-up (exit 1), never a request."""
    bad = tmp_path / "generation_config.json"
    bad.write_text('{"eos_token_id": 1, "temperature": "x"}')
    artifact = server.serving.engine.artifact
    real = artifact.file
    monkeypatch.setattr(artifact, "file", lambda rel: bad if rel.endswith("/generation_config.json") else real(rel))
    with pytest.raises(GenerationConfigError, match=r"generation_config.json: temperature: 'x' is not in \[0, 100\]"):
        create_app(AsyncEngine(server.serving), MODEL)
    code = f"""
import sys
from pathlib import Path
import runtime.artifact
real = runtime.artifact.Artifact.file
runtime.artifact.Artifact.file = lambda self, rel: Path({str(bad)!r}) if rel.endswith('/generation_config.json') \
    else real(self, rel)
from runtime.serve import main
sys.exit(main([{str(bundled_artifact)!r}, '--num-blocks', '40']))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         check=False)
    assert res.returncode == 1 and "error: cannot serve" in res.stderr and "temperature: 'x'" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def _serve_on_a_taken_port(artifact, *flags: str) -> tuple[int, int]:
    """``builder serve`` on a port another socket listens on: (its exit code, the port)."""
    import runtime.serve

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        return runtime.serve.main([str(artifact), "--port", str(port), "--device", "cpu", *flags]), port


def test_a_port_it_cannot_listen_on_stops_the_start_up_before_the_engine_loads(bundled_artifact, capsys, monkeypatch):
    import runtime.serve

    loads = []
    monkeypatch.setattr("runtime.engine_process.EngineProcess.__init__", lambda *a, **k: loads.append(1))
    code, port = _serve_on_a_taken_port(bundled_artifact)
    assert code == 1
    assert f"error: cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err and not loads
    assert runtime.serve.main([str(bundled_artifact), "--host", "no..such..host", "--device", "cpu"]) == 1
    assert "error: cannot listen on no..such..host" in capsys.readouterr().err and not loads
    # several server processes: the same binding (runtime.net.bind_sockets), the same refusal, no engine started
    starts = []
    monkeypatch.setattr("runtime.engine_process.start_engine_process", lambda *a, **k: starts.append(1))
    code, port = _serve_on_a_taken_port(bundled_artifact, "--api-servers", "2")
    assert code == 1
    assert f"error: cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err and not starts
    with pytest.raises(SystemExit) as exited:  # argparse's usage error
        runtime.serve.main([str(bundled_artifact), "--port", "70000"])
    assert exited.value.code == 2 and "must be in 0..65535" in capsys.readouterr().err


# --- 3. logprobs ------------------------------------------------------------------------------------------
def test_completion_logprobs(server, offline):
    body = {"prompt": "def fibonacci(n):", "max_tokens": 10, "logprobs": 3, "temperature": 0, "ignore_eos": True}
    ref = offline.generate("def fibonacci(n):", SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3))
    with server.client() as client:
        whole = client.post("/v1/completions", json=body).json()
        chunks, done = streamed(client, "/v1/completions", body)
    lp = whole["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 10
    assert lp["token_logprobs"] == pytest.approx(ref.logprobs, abs=1e-4)
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert logprob <= 0 and len(top) == 3
        values = list(top.values())
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert next(iter(top)) == token and values[0] == pytest.approx(logprob)  # greedy: the likeliest
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert "".join(lp["tokens"]) == whole["choices"][0]["text"]  # ASCII code: every token has its own text
    assert done
    merged = {k: [x for e in chunks for c in e["choices"] if c["logprobs"] for x in c["logprobs"][k]] for k in lp}
    assert merged == lp
    server.wait_idle()


def test_logit_bias_steers_the_tokens_as_the_offline_engine_does(server, offline):
    """OpenAI's logit_bias: -100 keeps a token out, +100 all but forces it; streamed or not, chat or not, the same
    tokens as the offline engine with the same bias, and logprobs still of the model's own logits."""
    prompt = "def fibonacci(n):"
    plain = offline.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    banned = sorted(set(plain.token_ids))[:3]  # tokens the unbiased answer uses
    forced = plain.token_ids[0]
    cases = [({str(t): -100 for t in banned}, {t: -100.0 for t in banned}),
             ({str(forced): 100}, {forced: 100.0})]
    with server.client() as client:
        for sent, bias in cases:
            ref = offline.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True, logit_bias=bias, logprobs=0))
            body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logit_bias": sent,
                    "logprobs": 0}
            whole = client.post("/v1/completions", json=body).json()["choices"][0]
            chunks, done = streamed(client, "/v1/completions", body)
            assert whole["text"] == ref.text == joined_text(chunks, chat=False) and done
            assert whole["logprobs"]["token_logprobs"] == pytest.approx(ref.logprobs, abs=1e-4)
            if bias == {forced: 100.0}:
                assert set(ref.token_ids) == {forced}
            else:
                assert not set(ref.token_ids) & set(banned) and ref.text != plain.text
        chat = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 6, "temperature": 0,
                                                         "logit_bias": {str(forced): 100}}).json()
        assert chat["usage"]["completion_tokens"] == 6
        assert chat["choices"][0]["message"]["content"] == offline.tokenizer.decode([forced] * 6)
    server.wait_idle()


def test_min_tokens_keeps_the_end_off_until_then(server, offline):
    """vLLM's min_tokens: the greedy first token made a stop token ends the request at once; with min_tokens 4 that
    token cannot come before the fourth, the same tokens on the server (whole, streamed, chat) as offline."""
    prompt = "def fibonacci(n):"
    first = offline.generate(prompt, SamplingParams(max_tokens=1)).token_ids[0]
    stopped = offline.generate(prompt, SamplingParams(max_tokens=12, stop_token_ids=[first]))
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) == 1
    ref = offline.generate(prompt, SamplingParams(max_tokens=12, stop_token_ids=[first], min_tokens=4))
    assert len(ref.token_ids) >= 4 and first not in ref.token_ids[:3]
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "stop_token_ids": [first], "min_tokens": 4}
    with server.client() as client:
        whole = client.post("/v1/completions", json=body).json()
        chunks, done = streamed(client, "/v1/completions", body)
        assert whole["choices"][0]["text"] == ref.text == joined_text(chunks, chat=False) and done
        assert whole["usage"]["completion_tokens"] == len(ref.token_ids)
        assert whole["choices"][0]["finish_reason"] == ref.finish_reason
        assert_error(client.post("/v1/completions", json={**body, "min_tokens": 13}), 400, "min_tokens")
    server.wait_idle()


def test_n_choices_are_requests_of_their_own_with_consecutive_seeds(server, offline):
    """n > 1: one response whose choice i is what a request with seed + i gives (whole and streamed, completions and
    chat), usage counting the prompt once and every choice's tokens; unseeded greedy choices are all the same."""
    prompt = "import os\n"
    body = {"prompt": prompt, "max_tokens": 10, "temperature": 0.9, "seed": 41, "ignore_eos": True, "n": 3,
            "logprobs": 1}
    refs = [offline.generate(prompt, SamplingParams(max_tokens=10, temperature=0.9, seed=41 + i, ignore_eos=True,
                                                    logprobs=1)) for i in range(3)]
    assert len({r.text for r in refs}) > 1, "the seeds drew the same text: the test would not see a mix-up"
    with server.client() as client:
        whole = client.post("/v1/completions", json=body).json()
        assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
        assert [c["text"] for c in whole["choices"]] == [r.text for r in refs]
        for c, r in zip(whole["choices"], refs):
            assert c["logprobs"]["token_logprobs"] == pytest.approx(r.logprobs, abs=1e-4)
            assert c["logprobs"]["text_offset"][0] == 0  # each choice's offsets count its own text
        n_prompt = len(refs[0].prompt_token_ids)
        assert whole["usage"]["prompt_tokens"] == n_prompt and whole["usage"]["completion_tokens"] == 30
        assert whole["usage"]["total_tokens"] == n_prompt + 30
        chunks, done = streamed(client, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
        assert done and chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 30
        assert {e["id"] for e in chunks} == {chunks[0]["id"]}  # one response
        texts = {i: "".join(c["text"] for e in chunks for c in e["choices"] if c["index"] == i) for i in range(3)}
        assert texts == {i: r.text for i, r in enumerate(refs)}
        assert sorted(c["index"] for e in chunks for c in e["choices"] if c["finish_reason"]) == [0, 1, 2]
        chat = {"messages": CHAT, "max_tokens": 6, "temperature": 0, "n": 2}
        answer = client.post("/v1/chat/completions", json=chat).json()
        assert [c["index"] for c in answer["choices"]] == [0, 1]
        assert answer["choices"][0]["message"] == answer["choices"][1]["message"]  # greedy: the same answer
        chunks, done = streamed(client, "/v1/chat/completions", chat)
        roles = [c["index"] for e in chunks for c in e["choices"] if c["delta"].get("role")]
        assert done and sorted(roles) == [0, 1]  # each choice opens with its role
        for i in (0, 1):
            text = "".join(c["delta"].get("content") or "" for e in chunks for c in e["choices"] if c["index"] == i)
            assert text == answer["choices"][i]["message"]["content"]
    server.wait_idle()


def test_chat_logprobs(server, offline):
    body = {"messages": CHAT, "max_tokens": 8, "logprobs": True, "top_logprobs": 2, "temperature": 0,
            "ignore_eos": True}
    ref = offline.chat(CHAT, SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2))
    with server.client() as client:
        whole = client.post("/v1/chat/completions", json=body).json()
        chunks, _ = streamed(client, "/v1/chat/completions", body)
        plain = client.post("/v1/chat/completions", json={**body, "logprobs": False, "top_logprobs": None}).json()
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == 8
    assert [e["logprob"] for e in content] == pytest.approx(ref.logprobs, abs=1e-4)
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"} and entry["logprob"] <= 0
        assert bytes(entry["bytes"]).decode("utf-8") == entry["token"]
        top = entry["top_logprobs"]
        assert len(top) == 2 and top[0]["logprob"] >= top[1]["logprob"]
        assert top[0]["token"] == entry["token"] and top[0]["logprob"] == pytest.approx(entry["logprob"])
    streamed_content = [x for e in chunks for c in e["choices"] if c["logprobs"] for x in c["logprobs"]["content"]]
    assert streamed_content == content
    assert plain["choices"][0]["logprobs"] is None
    server.wait_idle()


# --- 4. stop strings ------------------------------------------------------------------------------------------
def _stop_across_tokens(offline: Engine, prompt: str, n: int) -> tuple[str, str]:
    """A 4-character stop string of the greedy continuation that starts in one token and ends in the next,
    and the text before its first occurrence."""
    tok = offline.tokenizer
    ref = offline.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    prompt_ids = tok.encode(prompt)
    base = len(tok.decode(prompt_ids))
    ends = [len(tok.decode(prompt_ids + ref.token_ids[:i])) - base for i in range(1, n + 1)]
    full = tok.decode(prompt_ids + ref.token_ids)[base:]
    assert full == ref.text
    for end in ends[2:]:
        stop = full[end - 2:end + 2]
        if len(stop) == 4 and full.find(stop) == end - 2 and stop.strip() and end - 2 not in ends:
            return stop, full[:end - 2]
    raise AssertionError("no stop string across a token boundary in the reference text")


@pytest.mark.parametrize("as_list", [False, True])
def test_stop_string_across_token_boundaries(server, offline, as_list):
    stop, before = _stop_across_tokens(offline, "def fibonacci(n):", 40)
    body = {"prompt": "def fibonacci(n):", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "stop": [stop] if as_list else stop}
    with server.client() as client:
        whole = client.post("/v1/completions", json=body).json()
        chunks, done = streamed(client, "/v1/completions", body)
    choice = whole["choices"][0]
    assert stop not in choice["text"] and choice["text"] == before and choice["finish_reason"] == "stop"
    assert joined_text(chunks, False) == before and finish_reasons(chunks) == ["stop"] and done
    assert offline.generate("def fibonacci(n):", SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop])).text \
        == before
    server.wait_idle()


# --- 5. bad input -----------------------------------------------------------------------------------------------
LONG_IDS = [100] * 600  # over max_seq_len 512
BAD_REQUESTS = [
    # (id, path, body (dict -> JSON, bytes -> raw), status, param)
    ("malformed json", "/v1/completions", b'{"prompt": "def",', 400, None),
    ("invalid utf-8", "/v1/completions", b'{"prompt": "\xff\xfe def"}', 400, None),
    ("not an object", "/v1/completions", b'["def"]', 400, None),
    ("empty body", "/v1/chat/completions", b"", 400, None),
    ("max_tokens string", "/v1/completions", {"prompt": "x", "max_tokens": "10"}, 400, "max_tokens"),
    ("max_tokens float", "/v1/completions", {"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens"),
    ("prompt number", "/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("prompt mixed list", "/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("prompt batch", "/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("messages string", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("message without role", "/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages"),
    ("image part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages"),
    ("stream string", "/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("temperature string", "/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("stop list of ints", "/v1/completions", {"prompt": "x", "stop": [1]}, 400, "stop"),
    ("max_tokens -1", "/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("max_tokens 0", "/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("max_tokens huge", "/v1/completions", {"prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
    ("max_tokens past context", "/v1/completions", {"prompt": [100] * 500, "max_tokens": 13}, 400, "max_tokens"),
    ("prompt too long", "/v1/completions", {"prompt": LONG_IDS}, 400, "prompt"),
    ("prompt text too long", "/v1/completions", {"prompt": "x = 1\n" * 400}, 400, "prompt"),
    ("chat too long", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x = 1\n" * 400}]}, 400,
     "messages"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("prompt of megabytes", "/v1/completions", {"prompt": "x = 1\n" * 400_000}, 400, "prompt"),
    ("chat of megabytes", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x = 1\n" * 400_000}]},
     400, "messages"),
    ("prompt nested twice", "/v1/completions", {"prompt": [["a"]]}, 400, "prompt"),
    ("text part without text", "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     400, "messages"),
    ("stop list too long", "/v1/completions", {"prompt": "x", "stop": [f"s{i}" for i in range(65)]}, 400, "stop"),
    ("stop string too long", "/v1/completions", {"prompt": "x", "stop": ["s" * 1025]}, 400, "stop"),
    ("stop_token_ids too many", "/v1/completions", {"prompt": "x", "stop_token_ids": list(range(1025))}, 400,
     "stop_token_ids"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("empty token list", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("token id out of vocabulary", "/v1/completions", {"prompt": [5, 10**6]}, 400, "prompt"),
    ("temperature -1", "/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("temperature 1e300", "/v1/completions", {"prompt": "x", "temperature": 1e300}, 400, "temperature"),
    # overflowed the logits and failed every request in flight with a 500
    ("repetition_penalty 1e-38", "/v1/completions", {"prompt": "x", "temperature": 1.0, "repetition_penalty": 1e-38},
     400, "repetition_penalty"),
    ("repetition_penalty 1e-300", "/v1/chat/completions",
     {"messages": CHAT, "temperature": 1.0, "repetition_penalty": 1e-300}, 400, "repetition_penalty"),
    ("top_p 0", "/v1/chat/completions", {"messages": CHAT, "top_p": 0}, 400, "top_p"),
    ("presence_penalty 3", "/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("logprobs 21", "/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("top_logprobs 21", "/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs"),
    ("top_logprobs without logprobs", "/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("stream_options without stream", "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}},
     400, "stream_options"),
    ("logit_bias key not a token id", "/v1/completions", {"prompt": "x", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("logit_bias 101", "/v1/chat/completions", {"messages": CHAT, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("logit_bias string value", "/v1/completions", {"prompt": "x", "logit_bias": {"5": "1"}}, 400, "logit_bias"),
    ("logit_bias past the vocabulary", "/v1/completions", {"prompt": "x", "logit_bias": {"1000000": 5}}, 400,
     "logit_bias"),
    ("logit_bias list", "/v1/completions", {"prompt": "x", "logit_bias": [1, 2]}, 400, "logit_bias"),
    ("n 0", "/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("n 17", "/v1/chat/completions", {"messages": CHAT, "n": 17}, 400, "n"),
    ("n string", "/v1/completions", {"prompt": "x", "n": "2"}, 400, "n"),
    ("best_of 2", "/v1/completions", {"prompt": "x", "best_of": 2}, 400, "best_of"),
    ("echo with logprobs", "/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1}, 400, "echo"),
    ("suffix", "/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("tools", "/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    ("unknown model", "/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("unknown chat model", "/v1/chat/completions", {"model": "gpt-4", "messages": CHAT}, 404, "model"),
]


@pytest.mark.parametrize("path, body, status, param", [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_gets_an_openai_error(server, path, body, status, param):
    with server.client() as client:
        if isinstance(body, bytes):
            r = client.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            r = client.post(path, json=body)
        error = assert_error(r, status, param)
        if status == 400:
            assert error["type"] == "invalid_request_error"
        if param in ("temperature", "top_p", "logprobs", "presence_penalty", "repetition_penalty", "top_logprobs",
                     "max_completion_tokens", "stop", "logit_bias") and isinstance(body, dict):
            assert error["message"].startswith(param)  # SamplingError's message, naming the request's field
    server.wait_idle()


@pytest.mark.parametrize("path, body, says", [
    # counted in pieces and refused once the count passes max_seq_len, not encoded whole (the tokenizer holds the
    # GIL: a whole encode of megabytes would stall every other request)
    ("/v1/completions", {"prompt": "x = 1\n" * 400_000}, "refused after counting"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x = 1\n" * 400_000}]},
     "refused after counting"),
    ("/v1/completions", {"prompt": [["a"]]}, "prompt[0] must be a string or a list of token ids"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content[0]: a text part needs its text"),
    ("/v1/completions", {"prompt": "x", "stop": [f"s{i}" for i in range(65)]}, "at most 64 strings"),
])
def test_bad_input_messages_say_what_is_wrong(server, path, body, says):
    with server.client() as client:
        error = assert_error(client.post(path, json=body), 400)
    assert says in error["message"], error
    assert len(error["message"]) < 1000, "the message quotes the request's input in full"


def test_unknown_routes_methods_and_fields(server):
    with server.client() as client:
        assert_error(client.get("/v1/nope"), 404)
        assert_error(client.get("/nope"), 404)
        assert_error(client.get("/v1/completions"), 405)
        assert client.head("/health").status_code == 200  # uptime probes that ask HEAD
        # unknown fields are ignored (OpenAI-compatible servers' policy); known OpenAI defaults are accepted
        r = client.post("/v1/completions", json={"prompt": "def", "max_tokens": 3, "frobnicate": {"x": 1},
                                                 "n": 1, "echo": False, "user": "u1"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
        # no Content-Type at all (curl -d sends form encoding): the body is still read as JSON
        r = client.post("/v1/completions", content=b'{"prompt": "def", "max_tokens": 2}',
                        headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert r.status_code == 200
    server.wait_idle()


def test_echo_returns_the_prompt_before_each_completion(server, offline):
    """completions echo: true: each choice's text is the prompt's, then its completion, whole and streamed (the
    prompt's text as each choice's first chunk); a prompt of token ids echoes their text."""
    prompt = "def fibonacci(n):"
    ref = offline.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True)).text
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "echo": True}
    with server.client() as client:
        r = client.post("/v1/completions", json={**body, "n": 2})
        assert r.status_code == 200, r.text
        assert [c["text"] for c in r.json()["choices"]] == [prompt + ref] * 2
        events, done = streamed(client, "/v1/completions", body)
        assert done and events[0]["choices"][0]["text"] == prompt and joined_text(events, False) == prompt + ref
        ids = offline.tokenizer.encode(prompt)
        r = client.post("/v1/completions", json={**body, "prompt": ids})
        assert r.json()["choices"][0]["text"] == offline.tokenizer.decode(ids) + ref
    server.wait_idle()


def test_server_is_healthy_after_bad_requests(server, offline):
    with server.client() as client:
        for _, path, body, _, _ in BAD_REQUESTS:
            client.post(path, **({"content": body} if isinstance(body, bytes) else {"json": body}))
        assert client.get("/health").json() == {"status": "ok"}
        r = client.post("/v1/completions", json={"prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0,
                                                 "ignore_eos": True})
    assert r.status_code == 200
    ref = offline.generate("def fibonacci(n):", SamplingParams(max_tokens=8, ignore_eos=True))
    assert r.json()["choices"][0]["text"] == ref.text
    server.wait_idle()


# --- 6. API key ------------------------------------------------------------------------------------------------
ROUTES = [("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "def", "max_tokens": 2}),
          ("POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2})]


@pytest.mark.parametrize("method, path, body", ROUTES, ids=[r[1] for r in ROUTES])
def test_api_key_is_required_on_v1_routes(server, method, path, body):
    wrong = [{}, {"Authorization": "Bearer nope"}, {"Authorization": API_KEY},
             {"Authorization": f"Basic {API_KEY}"}, {"Authorization": f"Bearer {API_KEY}x"}]
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for headers in wrong:
            r = client.request(method, path, json=body, headers=headers)
            assert assert_error(r, 401)["type"] == "authentication_error"
            assert r.headers["www-authenticate"] == "Bearer"
        assert_error(client.request(method, path, content=b"{bad json", headers={}), 401)  # auth comes first
        r = client.request(method, path, json=body, headers=AUTH)
        assert r.status_code == 200, r.text
        assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200
    server.wait_idle()


@pytest.mark.parametrize("key", ["", "   ", "\t\n"], ids=["empty", "spaces", "blank"])
def test_an_empty_api_key_is_an_error_not_no_key(server, key, tmp_path):
    with pytest.raises(ValueError, match="api_key .* is empty"):
        create_app(AsyncEngine(server.serving), MODEL, api_key=key)
    missing = str(tmp_path / "no-such-artifact")  # the key is checked first: nothing is loaded
    env = {k: v for k, v in os.environ.items() if k != "LLM_BUILDER_API_KEY"}
    res = _serve(missing, "--api-key", key, env=env)
    assert res.returncode == 1 and "error: --api-key is empty" in res.stderr, res.stderr
    res = _serve(missing, env={**env, "LLM_BUILDER_API_KEY": key})
    assert res.returncode == 1 and "error: $LLM_BUILDER_API_KEY is empty" in res.stderr, res.stderr
    res = _serve(missing, "--api-key", "k", env={**env, "LLM_BUILDER_API_KEY": key})  # the option wins
    assert res.returncode == 1 and "cannot serve" in res.stderr


# --- the OpenAPI schema ------------------------------------------------------------------------------------------
def _refs(node) -> list[str]:
    """Every $ref in a JSON document."""
    if isinstance(node, dict):
        return ([node["$ref"]] if "$ref" in node else []) + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def test_openapi_documents_bodies_responses_and_metrics(server):
    with server.client() as client:
        r = client.get("/openapi.json")
    assert r.status_code == 200
    spec = r.json()
    schemas = spec["components"]["schemas"]
    for ref in _refs(spec):
        assert ref.startswith("#/components/schemas/") and ref.split("/")[-1] in schemas, f"dangling {ref}"

    def resolve(schema: dict) -> dict:
        return schemas[schema["$ref"].split("/")[-1]] if "$ref" in schema else schema

    def error_schema(response: dict) -> dict:
        error = resolve(resolve(response["content"]["application/json"]["schema"])["properties"]["error"])
        assert set(error["properties"]) == {"message", "type", "param", "code"}
        return error

    routes = [("/v1/completions", {"prompt", "max_tokens", "temperature", "top_p", "stream", "logprobs"}, "prompt"),
              ("/v1/chat/completions", {"messages", "max_completion_tokens", "temperature", "top_logprobs"},
               "messages")]
    for path, fields, required in routes:
        op = spec["paths"][path]["post"]
        body = op["requestBody"]
        assert body["required"] is True
        schema = resolve(body["content"]["application/json"]["schema"])
        assert fields <= set(schema["properties"]) and required in schema["required"], schema
        responses = op["responses"]
        assert set(responses) == {"200", "400", "401", "404", "413", "429", "500", "503", "504"}
        for status in set(responses) - {"200"}:
            error_schema(responses[status])
        ok = responses["200"]["content"]
        assert "choices" in resolve(ok["application/json"]["schema"])["properties"]
        assert ok["text/event-stream"]["schema"]["type"] == "string"
    assert "data" in resolve(spec["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]
                             ["schema"])["properties"]
    error_schema(spec["paths"]["/v1/models"]["get"]["responses"]["401"])
    error_schema(spec["paths"]["/health"]["get"]["responses"]["503"])
    assert spec["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
    assert all(spec["paths"][p][m]["security"] == [{"bearer": []}] for p, m in
               [("/v1/models", "get"), ("/v1/completions", "post"), ("/v1/chat/completions", "post")])
    metrics = spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"] and metrics["text/plain"]["schema"]["type"] == "string"
    openapi_spec_validator.validate(spec)  # a valid OpenAPI document, as generated clients need


def test_models_lists_the_served_model(server):
    with server.client() as client:
        body = client.get("/v1/models").json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == [MODEL]
    assert body["data"][0]["object"] == "model" and body["data"][0]["max_model_len"] == 512


# --- 7. metrics --------------------------------------------------------------------------------------------------
def test_metrics_count_what_was_served(server):
    with server.client() as client:
        before = metric_samples(client)
        usages = [client.post("/v1/completions", json={"prompt": p, "max_tokens": n, "ignore_eos": True}).json()["usage"]
                  for p, n in COMPLETION_CASES]
        chunks, _ = streamed(client, "/v1/chat/completions",
                             {"messages": CHAT, "max_tokens": 7, "ignore_eos": True,
                              "stream_options": {"include_usage": True}})
        usages.append(chunks[-1]["usage"])
        shared = "import os\nimport sys\nimport json\n\n\ndef load(path):\n    with open(path) as f:\n" * 2
        for _ in range(2):  # the second finds the first's full blocks in the prefix cache
            usages.append(client.post("/v1/completions", json={"prompt": shared, "max_tokens": 3,
                                                                 "ignore_eos": True}).json()["usage"])
        assert client.post("/v1/completions", json={"prompt": "x", "temperature": -1}).status_code == 400
        assert client.post("/v1/completions", json={"model": "other", "prompt": "x"}).status_code == 404
        after = metric_samples(client)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    num_tokens = [u["completion_tokens"] for u in usages]
    assert usages[-1]["prompt_tokens_details"]["cached_tokens"] >= 16 > usages[-2]["prompt_tokens_details"][
        "cached_tokens"]
    assert delta("llm_requests_total", outcome="length") == 6
    assert delta("llm_requests_total", outcome="invalid") == 2
    for outcome in ("stop", "abort", "timeout", "error", "rejected"):
        assert delta("llm_requests_total", outcome=outcome) == 0
    assert delta("llm_generation_tokens_total") == sum(num_tokens)
    assert delta("llm_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("llm_time_to_first_token_seconds_count") == 6
    assert delta("llm_e2e_request_latency_seconds_count") == 6
    # one latency per token after those that came with the first (runtime.metrics): one per token after the first
    # when each first delta carries one token; under load the server may catch up on a request's first two at once
    assert sum(n - 2 for n in num_tokens) <= delta("llm_inter_token_latency_seconds_count") <= \
        sum(n - 1 for n in num_tokens)
    assert 0 < delta("llm_time_to_first_token_seconds_sum") < delta("llm_e2e_request_latency_seconds_sum")
    assert delta("llm_inter_token_latency_seconds_sum") > 0
    assert after[("llm_time_to_first_token_seconds_bucket", (("le", "+Inf"),))] >= 6
    assert after[("llm_num_requests_running", ())] == 0 and after[("llm_num_requests_waiting", ())] == 0
    assert 0 <= after[("llm_kv_cache_usage_perc", ())] <= 100
    assert after[("llm_kv_cache_num_blocks", ())] == server.serving.kv.pool.num_blocks
    assert 0 < after[("llm_prefix_cache_hit_rate", ())] <= 1
    assert after[("llm_num_preemptions_total", ())] >= 0
    server.wait_idle()


# --- 8. client disconnects ------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream, n", [(True, 1), (False, 1), (True, 3), (False, 3)],
                         ids=["streamed", "whole", "streamed-3-choices", "whole-3-choices"])
def test_client_disconnect_aborts_and_frees_blocks(server, stream, n):
    body = {"prompt": "def main():", "max_tokens": 480, "ignore_eos": True, "stream": stream, "n": n}
    scheduler = server.serving.scheduler
    with server.client() as client:
        aborted_before = metric_samples(client)[("llm_requests_total", (("outcome", "abort"),))]
    if stream:
        with server.client() as client, client.stream("POST", "/v1/completions", json=body) as r:
            events = (line for line in r.iter_lines() if line and not line.startswith(":"))
            for _ in range(3):
                assert next(events).startswith("data: {")
            assert scheduler.num_unfinished == n  # still generating when the client goes away
    else:
        with server.client(timeout=0.3) as client, pytest.raises(httpx.ReadTimeout):
            client.post("/v1/completions", json=body)
    server.wait_idle(timeout=3.0)  # long before the 480 tokens would have been generated
    with server.client() as client:  # every choice counts as a request (aborted)
        assert metric_samples(client)[("llm_requests_total", (("outcome", "abort"),))] == aborted_before + n


# --- timeouts ----------------------------------------------------------------------------------------------------
def test_request_timeout(bundled_artifact):
    config = ServingConfig(num_blocks=64, request_timeout_s=1.0)
    long = {"max_tokens": 480, "ignore_eos": True}  # 480 steps of at least 5 ms: past the timeout on any machine
    with run_server(bundled_artifact, config) as s, s.client() as client:
        step = s.serving.step

        def slow_step():
            outputs = step()
            time.sleep(0.005)
            return outputs

        s.serving.step = slow_step
        error = assert_error(client.post("/v1/completions", json={"prompt": "def main():", **long}), 504, None)
        assert error["type"] == "timeout_error" and error["code"] == "request_timeout"
        chunks, done = streamed(client, "/v1/chat/completions", {"messages": CHAT, **long})
        assert done and chunks[-1]["error"]["code"] == "request_timeout"
        assert all("error" not in e for e in chunks[:-1]) and joined_text(chunks[:-1], True)
        assert finish_reasons(chunks[:-1]) == []
        assert metric_samples(client)[("llm_requests_total", (("outcome", "timeout"),))] == 2
        s.wait_idle()


# --- queued streams --------------------------------------------------------------------------------------------
def test_a_queued_stream_gets_its_headers_and_keep_alives_at_once(bundled_artifact):
    """A streamed request that waits for a sequence slot is answered at once (headers, then SSE comments), so a
    client with a short read timeout does not give up; refusals are still plain HTTP errors."""
    config = ServingConfig(num_blocks=64, max_num_seqs=1, max_waiting=1)
    serving = ServingEngine.load(bundled_artifact, config=config)
    engine = AsyncEngine(serving)
    long = {"prompt": "def main():", "max_tokens": 480, "temperature": 0, "ignore_eos": True, "stream": True}
    with serve_app(create_app(engine, MODEL, api_key=API_KEY, sse_keepalive_s=0.05)) as url:
        s = Server(url, serving)
        with s.client() as busy_client, busy_client.stream("POST", "/v1/completions", json=long) as busy:
            busy_lines = busy.iter_lines()  # kept: a collected iterator closes the connection (an abort)
            assert next(line for line in busy_lines if line.startswith("data: "))  # it holds the only slot
            queued_body = {"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                           "stream": True}
            with s.client(timeout=2) as client, client.stream("POST", "/v1/completions", json=queued_body) as queued:
                assert queued.status_code == 200
                assert queued.headers["content-type"].startswith("text/event-stream")
                lines = queued.iter_lines()
                assert [next(lines) for _ in range(4)] == [": keep-alive", "", ": keep-alive", ""]
                stats = engine.stats()
                assert (stats.num_running, stats.num_waiting) == (1, 1), "the request was meant to be queued"
                # a refusal is decided at submission: a plain HTTP error, not a stream
                assert_error(client.post("/v1/completions", json={**queued_body, "temperature": -1}), 400,
                             "temperature")
                full = client.post("/v1/completions", json=queued_body)
                assert_error(full, 429)
                assert full.headers["retry-after"] == "1"
                busy.close()  # the client goes away: its request is aborted and the queued one admitted
                events, done = read_events(lines)
        assert done and finish_reasons(events) == ["length"] and joined_text(events, False)
        s.wait_idle()


# --- 9. load: a burst against a small queue ---------------------------------------------------------------------
def test_burst_gets_429_not_a_hang(bundled_artifact):
    num_requests, max_tokens = 24, 16
    config = ServingConfig(num_blocks=64, max_num_seqs=2, max_waiting=2)

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, float | None, int | None, str | None]:
        body = {"prompt": f"def task_{i}(x):", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return r.status_code, None, None, r.headers.get("retry-after")
            ttft, lines = None, []
            async for line in r.aiter_lines():
                if ttft is None and line.startswith("data: "):
                    ttft = time.perf_counter() - start  # the first chunk: sent once the first token is out
                lines.append(line)
        events, done = read_events(lines)
        assert done
        return 200, ttft, events[-1]["usage"]["completion_tokens"], None

    async def burst(url: str):
        limits = httpx.Limits(max_connections=num_requests)
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=30, limits=limits) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(num_requests))), 60)

    with run_server(bundled_artifact, config) as s:
        start = time.perf_counter()
        results = asyncio.run(burst(s.url))
        elapsed = time.perf_counter() - start
        ok = [r for r in results if r[0] == 200]
        refused = [r for r in results if r[0] == 429]
        assert len(ok) + len(refused) == num_requests, [r[0] for r in results]
        assert ok and refused
        assert all(r[3] is not None and int(r[3]) >= 1 for r in refused)
        assert all(r[2] == max_tokens for r in ok)
        ttfts = sorted(r[1] for r in ok)
        p99 = ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))]
        print(f"\nburst of {num_requests} streamed requests (max_num_seqs 2, max_waiting 2, {max_tokens} tokens): "
              f"{len(ok)} served, {len(refused)} got 429, {len(ok) / elapsed:.1f} requests/s served, "
              f"{len(ok) * max_tokens / elapsed:.0f} tokens/s, client TTFT p50 {statistics.median(ttfts) * 1e3:.1f} ms "
              f"p99 {p99 * 1e3:.1f} ms, {elapsed:.2f} s")
        s.wait_idle()
        with s.client() as client:
            assert client.get("/health").status_code == 200
            assert client.post("/v1/completions", json={"prompt": "def", "max_tokens": 4}).status_code == 200
            samples = metric_samples(client)
        assert samples[("llm_requests_total", (("outcome", "rejected"),))] == len(refused)
        s.wait_idle()


def test_n_choices_refused_together_when_the_queue_cannot_take_them_all(bundled_artifact):
    """n choices are n requests: where the engine holds fewer (one running, two waiting), the request gets 429 and
    the choices already queued are aborted, leaving no blocks behind; n = 2 then fits the waiting queue."""
    config = ServingConfig(num_blocks=64, max_num_seqs=1, max_waiting=2)
    with run_server(bundled_artifact, config) as s:
        with s.client() as client:
            for stream in (False, True):
                r = client.post("/v1/completions", json={"prompt": "def f(x):", "max_tokens": 8, "n": 4,
                                                         "stream": stream})
                assert_error(r, 429)
            s.wait_idle()
            ok = client.post("/v1/completions", json={"prompt": "def f(x):", "max_tokens": 4, "n": 2})
            assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
        s.wait_idle()


# --- 10. the command line ----------------------------------------------------------------------------------------
def _serve(*args: str, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime.serve", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120, env=env, check=False, **kwargs)


def test_serve_cli_help_and_errors(bundled_artifact, tmp_path):
    res = _serve("--help")
    assert res.returncode == 0 and "--api-key" in res.stdout and "--kv-cache-memory" in res.stdout
    missing = tmp_path / "no-such-artifact"
    env = {k: v for k, v in os.environ.items() if k != "LLM_BUILDER_API_KEY"}
    res = _serve(str(missing), env=env)
    assert res.returncode == 1 and "error:" in res.stderr and str(missing) in res.stderr
    assert "WITHOUT AN API KEY" not in res.stderr  # loopback by default
    res = _serve(str(missing), "--host", "0.0.0.0", env=env)  # warns before loading (and never binds here)
    assert res.returncode == 1 and "WITHOUT AN API KEY" in res.stderr
    res = _serve(str(missing), "--host", "0.0.0.0", "--api-key", "k", env=env)
    assert res.returncode == 1 and "WITHOUT AN API KEY" not in res.stderr
    res = _serve(str(bundled_artifact), "--num-blocks", "1")  # one request of 512 tokens needs 32 blocks
    assert res.returncode == 1 and "needs 32 blocks" in res.stderr
    res = _serve(str(bundled_artifact), "--num-blocks", "1", "--tokens-per-block", "256")  # 2 blocks of 256 tokens
    assert res.returncode == 1 and "needs 2 blocks" in res.stderr
    res = _serve(str(bundled_artifact), "--tokens-per-block", "48")
    assert res.returncode == 1 and "tokens_per_block 48 must be a power of two" in res.stderr
    res = _serve(str(bundled_artifact), "--kv-cache-memory", "lots")
    assert res.returncode == 2 and "byte count" in res.stderr
    res = _serve(str(bundled_artifact), "--device", "gpu")
    assert res.returncode == 1 and "error: device 'gpu' is not one of auto, cpu, cuda, cuda:N" in res.stderr
    assert "Traceback" not in res.stderr
    from runtime.serve import build_parser

    assert build_parser().parse_args(["x"]).device == "auto"


def _start_serve(*args: str, env: dict | None = None, timeout_s: float = 120) -> tuple[subprocess.Popen, str]:
    """``python -m runtime.serve *args`` on a free port, once /health answers 200: (process, base URL)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen([sys.executable, "-m", "runtime.serve", *args, "--port", str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"runtime.serve did not come up: {proc.communicate()[0]}")
        time.sleep(0.1)


def test_serve_cli_serves_with_the_key_from_the_environment(bundled_artifact):
    env = {**os.environ, "LLM_BUILDER_API_KEY": "env-key"}
    proc, url = _start_serve(str(bundled_artifact), "--num-blocks", "40", "--served-model-name", "m", env=env)
    try:
        assert httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "def"}).status_code == 401
        r = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "def", "max_tokens": 3},
                       headers={"Authorization": "Bearer env-key"}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: a graceful shutdown and exit 0
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "Traceback" not in out
    assert "memory plan on cpu" in out and "40 blocks" in out
    assert torch_has_cuda() or "device auto: CUDA is not available, using the CPU" in out  # the default, logged
    from runtime.serve import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example.com")


def test_serve_cli_api_servers_share_the_port_and_the_metrics(bundled_artifact):
    """``--api-servers 2``: two server processes over one engine process answer on one port, every /metrics scrape
    (whichever process takes it) counts every request, and Ctrl-C stops the servers and the engine, exit 0."""
    proc, url = _start_serve(str(bundled_artifact), "--num-blocks", "64", "--max-num-seqs", "4", "--api-servers", "2",
                             "--served-model-name", "m")
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        # /health answered by one process; a second still starting on a loaded machine would die by the SIGTERM of
        # the shutdown before uvicorn's graceful handling is in place: wait until both have started
        deadline = time.monotonic() + 120
        while sum("Application startup complete" in line for line in list(lines)) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            time.sleep(0.1)

        def ask(i: int) -> int:  # a connection each: the two processes take turns at the socket
            body = {"model": "m", "prompt": f"def f{i}(", "max_tokens": 4, "stream": i % 2 == 1}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return 4 if body["stream"] else r.json()["usage"]["completion_tokens"]

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            tokens = sum(pool.map(ask, range(8)))
        for _ in range(4):
            text = httpx.get(f"{url}/metrics", timeout=10).text
            counts = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                      if line.startswith(("llm_requests_total{", "llm_generation_tokens_total "))}
            assert sum(v for k, v in counts.items() if k.startswith("llm_requests_total")) == 8, text
            assert counts["llm_generation_tokens_total"] == tokens
            assert "llm_kv_cache_num_blocks 64.0" in text  # the engine's gauges, from its stats
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        reader.join(timeout=30)
    out = "".join(lines)
    assert proc.returncode == 0, out
    assert "Traceback" not in out
    assert "with 2 server processes over one engine process" in out
    assert out.count("Finished server process") == 2


def torch_has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_server_needs_no_build_packages(tmp_path):
    """The server and its command line load with builder/passes/transformers unimportable."""
    code = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('builder', 'passes', 'transformers', 'onnx', 'modelopt'):
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
import runtime.server, runtime.metrics
from runtime.serve import main
sys.exit(main([{str(tmp_path / 'missing')!r}]))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         check=False)
    assert res.returncode == 1 and "error: cannot serve" in res.stderr and "blocked" not in res.stderr, res.stderr


def test_a_text_only_delta_event_is_the_full_chunk_byte_for_byte():
    """_Call.text_event (the streamed text deltas' fast path) writes the same bytes as the chunk built as a dict;
    a delta it does not cover (finishing, logprobs asked, tool calls, no text) is left to the full chunk."""
    from runtime.outputs import RequestOutput
    from runtime.server import _Call, _sse

    def delta(text: str, finished: bool = False) -> RequestOutput:
        return RequestOutput("r", text, [5], None, finished, "stop" if finished else None, 3, 1)

    texts = ["hello", ' sa"id\n', "é😀\\", "\u2028\x00x", "</script>", "\u0000text\u0000"]
    for chat in (True, False):
        for include_usage in (True, False):
            call = _Call(chat, "chatcmpl-1" if chat else "cmpl-1", 1700000000, 'm"odel', False, include_usage, None,
                         None)
            for text in texts:
                assert call.text_event(delta(text), False) == _sse(call.delta_chunk(delta(text), False))
            assert call.text_event(delta("x", True), True) is None
            assert call.text_event(delta(""), False) is None
    logprobs = _Call(True, "chatcmpl-2", 1, "m", True, False, None, None)
    assert logprobs.text_event(delta("x"), False) is None


def test_stream_interval_gathers_tokens_per_event(bundled_artifact, offline):
    """create_app(stream_interval=4): a streamed completion sends its first token at once, then events of at least
    4 tokens (the last may hold fewer), and the same text and tokens as the offline engine; 0 is refused."""
    with pytest.raises(ValueError, match="stream_interval"):
        create_app(AsyncEngine(ServingEngine.load(bundled_artifact, config=ServingConfig(num_blocks=64))), MODEL,
                   stream_interval=0)
    serving = ServingEngine.load(bundled_artifact, config=ServingConfig(num_blocks=64, max_num_seqs=4))
    ref = offline.generate("def fibonacci(n):", SamplingParams(max_tokens=23, ignore_eos=True))
    body = {"prompt": "def fibonacci(n):", "max_tokens": 23, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "stream": True}
    # The engine holds its second token until the client has the first event: a handler that starts late would
    # otherwise find several deltas queued and rightly send them as one chunk (ready_deltas)
    first_read, step, emitted = threading.Event(), serving.step, []

    def gated_step():
        if emitted:
            assert first_read.wait(30), "the first event never reached the client"
        outputs = step()
        emitted.extend(o for o in outputs if o.token_ids)
        return outputs

    serving.step = gated_step

    def lines(r):
        for line in r.iter_lines():
            yield line
            if line.startswith("data: "):
                first_read.set()

    with serve_app(create_app(AsyncEngine(serving), MODEL, api_key=API_KEY, stream_interval=4)) as url:
        with Server(url, serving).client() as client, client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            events, done = read_events(lines(r))
    assert done
    counts = [len(c["logprobs"]["tokens"]) for e in events for c in e["choices"] if c["logprobs"]]
    assert sum(counts) == 23 and counts[0] == 1, counts
    assert all(n >= 4 for n in counts[1:-1]) and len(counts) <= 1 + -(-22 // 4), counts
    assert joined_text(events, chat=False) == ref.text
