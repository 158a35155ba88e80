"""`builder bench serve` against our real server (uvicorn on a free loopback port, bundled model), plus the
metric math on hand-made timestamps and the failure kinds on a mock transport.

Expected figures are computed here from the raw per-request timestamps the benchmark returns (with
``statistics``), never by calling the module's own metric functions.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import socket
import statistics
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from conftest import serve_app
from builder.bench.serve import (BenchError, RequestRecord, ServeBenchConfig, meets_slos, parse_slos, run, run_sweep,
                                 sharegpt_lengths, summarize)
from builder.cli import app
from runtime.async_engine import AsyncEngine
from runtime.server import create_app
from runtime.serving import ServingConfig, ServingEngine

API_KEY = "bench-key-1"
STAT_KEYS = {"mean", "p50", "p90", "p95", "p99"}
SUMMARY_KEYS = {"kind", "version", "url", "model", "endpoint", "started_at", "config", "duration_s", "num_requests",
                "completed", "failed", "request_throughput", "output_token_throughput", "total_token_throughput",
                "total_input_tokens", "total_output_tokens", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "goodput"}


@contextlib.contextmanager
def serve(artifact: Path, config: ServingConfig, api_key: str | None = API_KEY):
    """Our server in a background thread on a free loopback port, until the block exits; yields its URL."""
    with serve_app(create_app(AsyncEngine(ServingEngine.load(artifact, config=config)), "pystdlib",
                              api_key=api_key)) as url:
        yield url


@pytest.fixture(scope="module")
def url(bundled_artifact):
    with serve(bundled_artifact, ServingConfig(num_blocks=128, max_num_seqs=8)) as u:
        yield u


@pytest.fixture(scope="module")
def tokenizer(bundled_artifact) -> str:
    return str(bundled_artifact)  # an artifact directory: tokenizer/tokenizer.json inside


def config(url: str, **kw) -> ServeBenchConfig:
    return ServeBenchConfig(url=url, api_key=API_KEY, **kw)


@pytest.fixture(scope="module")
def fixed(url, tokenizer):
    """6 random 16-token prompts, 8 output tokens each, 2 in flight."""
    return run(config(url, tokenizer=tokenizer, num_requests=6, concurrency=2, input_len=16, output_len=8,
                      slos=["ttft=1e7", "tpot=1e7", "e2e=1e7"]))


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def inclusive_quantiles(values: list[float]) -> dict[str, float]:
    """mean and p50/p90/p95/p99 by the statistics module (inclusive method = linear interpolation)."""
    cuts = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else [values[0]] * 99
    return {"mean": statistics.fmean(values), "p50": cuts[49], "p90": cuts[89], "p95": cuts[94], "p99": cuts[98]}


# --- metric math on hand-made timestamps -----------------------------------------------------------------
def test_metric_math_by_hand():
    records = [
        # sent at 0: text chunks at 100, 150, 250 ms, [DONE] at 300 ms, 3 output tokens
        RequestRecord(0, 3, 10, send_s=0.0, chunk_s=[0.1, 0.15, 0.25], end_s=0.3, num_output_tokens=3),
        # usage says 4 output tokens in 2 chunks (the server coalesced some)
        RequestRecord(1, 4, 20, send_s=1.0, chunk_s=[1.2, 1.3], end_s=1.3, num_output_tokens=4),
        # one output token: no TPOT, no ITL
        RequestRecord(2, 1, 30, send_s=0.5, chunk_s=[0.55], end_s=0.6, num_output_tokens=1),
        RequestRecord(3, 8, 40, send_s=0.2, end_s=0.21, error="http_429", message="busy"),
        RequestRecord(4, 8, 50, send_s=0.3, chunk_s=[0.4], end_s=1.9, error="timeout"),
    ]
    s = summarize(records, 2.0, {"ttft": 150.0, "tpot": 50.0})
    assert (s["num_requests"], s["completed"], s["failed"]) == (5, 3, {"http_429": 1, "timeout": 1})
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (60, 8)
    assert s["request_throughput"] == pytest.approx(1.5)  # 3 completed / 2 s
    assert s["output_token_throughput"] == pytest.approx(4.0)  # 8 / 2
    assert s["total_token_throughput"] == pytest.approx(34.0)  # (60 + 8) / 2
    # TTFT 100, 200, 50 -> sorted 50, 100, 200; p90 sits at 1.8 between ranks: 100 + 0.8 * 100
    assert s["ttft_ms"] == pytest.approx({"mean": 350 / 3, "p50": 100, "p90": 180, "p95": 190, "p99": 198})
    # TPOT (300 - 100) / 2 = 100 and (300 - 200) / 3 = 33.3; the one-token request has none
    assert s["tpot_ms"] == pytest.approx({"mean": 200 / 3, "p50": 200 / 3, "p90": 100 / 3 + 0.9 * 200 / 3,
                                          "p95": 100 / 3 + 0.95 * 200 / 3, "p99": 100 / 3 + 0.99 * 200 / 3})
    # ITL 50, 100 (request 0) and 100 (request 1), pooled
    assert s["itl_ms"] == pytest.approx({"mean": 250 / 3, "p50": 100, "p90": 100, "p95": 100, "p99": 100})
    # E2E 300, 300, 100
    assert s["e2e_ms"] == pytest.approx({"mean": 700 / 3, "p50": 300, "p90": 300, "p95": 300, "p99": 300})
    # only request 2 meets TTFT <= 150 and TPOT <= 50 (it has no TPOT); fraction of the 5 sent
    assert s["goodput"]["slos_ms"] == {"ttft": 150.0, "tpot": 50.0}
    assert (s["goodput"]["request_throughput"], s["goodput"]["fraction"]) == pytest.approx((0.5, 0.2))
    assert summarize(records, 2.0, {})["goodput"] is None
    empty = summarize(records[3:], 1.0, {"e2e": 1.0})
    assert empty["completed"] == 0 and empty["ttft_ms"] == dict.fromkeys(STAT_KEYS)
    assert empty["goodput"]["fraction"] == 0.0


def test_parse_slos():
    assert parse_slos(["ttft=500", "TPOT=50.5", "e2e=2e3"]) == {"ttft": 500.0, "tpot": 50.5, "e2e": 2000.0}
    for bad in ("ttft", "ttft=", "ttft=-1", "itl=5", "ttft=fast", "ttft=inf"):
        with pytest.raises(BenchError, match=r"NAME=MILLISECONDS with NAME one of ttft, tpot, e2e"):
            parse_slos([bad])
    with pytest.raises(BenchError, match="given twice"):
        parse_slos(["ttft=1", "ttft=2"])


# --- against the real server -----------------------------------------------------------------------------
def test_fixed_concurrency_counts_and_tokens(fixed):
    s = fixed.summary()
    assert (s["num_requests"], s["completed"], s["failed"]) == (6, 6, {})
    assert s["model"] == "pystdlib" and s["endpoint"] == "completions"
    for r in fixed.records:
        assert r.ok, r.message
        assert r.num_output_tokens == 8  # ignore_eos: exactly max_tokens
        assert r.num_prompt_tokens == 16  # token-id prompts: no BOS added
        assert 1 <= len(r.chunk_s) <= 8
        assert r.send_s < r.chunk_s[0] and r.chunk_s == sorted(r.chunk_s) and r.chunk_s[-1] <= r.end_s
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (96, 48)
    # never more than 2 requests in flight: at any send, at most 1 other request is between send and end
    for r in fixed.records:
        assert sum(o.send_s <= r.send_s < o.end_s for o in fixed.records if o is not r) <= 1
    last_end = max(r.end_s for r in fixed.records)
    assert last_end <= fixed.duration_s < last_end + 2.0  # the run ends with its last request (event-loop slack)
    assert s["request_throughput"] == pytest.approx(6 / fixed.duration_s)
    assert s["output_token_throughput"] == pytest.approx(48 / fixed.duration_s)
    assert s["total_token_throughput"] == pytest.approx(144 / fixed.duration_s)


def test_latency_stats_match_the_raw_timestamps(fixed):
    s = fixed.summary()
    recs = fixed.records
    ttft = [(r.chunk_s[0] - r.send_s) * 1e3 for r in recs]
    e2e = [(r.end_s - r.send_s) * 1e3 for r in recs]
    tpot = [(b - a) / 7 for a, b in zip(ttft, e2e)]  # 8 output tokens each
    itl = [(b - a) * 1e3 for r in recs for a, b in zip(r.chunk_s, r.chunk_s[1:])]
    for key, raw in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl), ("e2e_ms", e2e)):
        got = s[key]
        assert set(got) == STAT_KEYS
        assert got == pytest.approx(inclusive_quantiles(raw), rel=1e-9, abs=1e-9), key
        assert min(raw) <= got["p50"] <= got["p90"] <= got["p95"] <= got["p99"] <= max(raw), key
    assert all(t > 0 for t in ttft + itl)


def test_goodput(fixed):
    s = fixed.summary()
    assert s["goodput"] == {"slos_ms": {"ttft": 1e7, "tpot": 1e7, "e2e": 1e7},
                            "request_throughput": s["request_throughput"], "fraction": 1.0}
    impossible = summarize(fixed.records, fixed.duration_s, {"ttft": 1e-6})["goodput"]
    assert impossible["request_throughput"] == 0 and impossible["fraction"] == 0
    # a TTFT bound between the fastest and the slowest request keeps exactly those at or under it
    ttft = sorted((r.chunk_s[0] - r.send_s) * 1e3 for r in fixed.records)
    half = summarize(fixed.records, fixed.duration_s, {"ttft": ttft[2]})["goodput"]
    assert half["fraction"] == pytest.approx(sum(t <= ttft[2] for t in ttft) / 6)


def test_poisson_arrivals_follow_the_seeded_schedule(url, tokenizer):
    rate, duration, seed = 40.0, 0.25, 7
    rng, t, schedule = random.Random(seed), 0.0, []
    while t < duration:  # documented: first at 0, then cumulative expovariate(rate) gaps
        schedule.append(t)
        t += rng.expovariate(rate)
    result = run(config(url, tokenizer=tokenizer, request_rate=rate, duration=duration, seed=seed, input_len=8,
                        output_len=4))
    assert len(result.records) == len(schedule) == result.summary()["num_requests"]
    assert result.summary()["completed"] == len(schedule)
    for r, planned in zip(result.records, schedule):
        assert r.send_s >= planned - 1e-6
    capped = run(config(url, tokenizer=tokenizer, request_rate=1000.0, num_requests=5, concurrency=1, input_len=8,
                        output_len=4))
    assert capped.summary()["completed"] == 5
    for a, b in zip(capped.records, capped.records[1:]):  # a cap of 1: each waits for the one before
        assert b.send_s >= a.end_s


def test_cli_dataset_json_and_table(url, tmp_path):
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text('{"prompt": "def fibonacci(n):", "max_tokens": 4}\n\n'
                       '{"prompt": "import os\\n", "output_len": 6}\n{"prompt": "class Config:"}\n')
    out = tmp_path / "bench.json"
    res = CliRunner().invoke(app, ["bench", "serve", "--url", url + "/v1", "--api-key", API_KEY, "--dataset",
                                   str(dataset), "--output-len", "5", "--concurrency", "3", "--slo", "ttft=0.001",
                                   "--json", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    for text in ("TTFT", "TPOT", "ITL", "E2E", "p99", "goodput", "3 completed"):
        assert text in res.output
    s = json.loads(out.read_text())
    assert set(s) == SUMMARY_KEYS
    assert (s["kind"], s["version"], s["url"], s["endpoint"]) == ("bench_serve", 1, url, "completions")
    assert (s["num_requests"], s["completed"], s["failed"], s["total_output_tokens"]) == (3, 3, {}, 4 + 6 + 5)
    assert s["total_input_tokens"] > 0  # from the usage chunks
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(s[key]) == STAT_KEYS
    assert s["goodput"] == {"slos_ms": {"ttft": 0.001}, "request_throughput": 0.0, "fraction": 0.0}
    assert s["config"]["concurrency"] == 3 and s["config"]["slos"] == ["ttft=0.001"]
    assert s["config"]["api_key"] == "<set>" and API_KEY not in out.read_text()
    assert s["started_at"].endswith("+00:00")


def test_chat_endpoint_text_prompts(url, tokenizer):
    result = run(config(url, endpoint="chat", tokenizer=tokenizer, num_requests=2, concurrency=2, input_len=8,
                        output_len=5))
    assert [r.num_output_tokens for r in result.records] == [5, 5]
    assert all(r.ok and r.num_prompt_tokens > 8 for r in result.records)  # the chat template adds tokens


def test_http_errors_are_counted_and_left_out(url, tmp_path):
    dataset = tmp_path / "mixed.jsonl"
    dataset.write_text('{"prompt": "x = 1", "max_tokens": 3}\n{"prompt": "y = 2", "max_tokens": 100000}\n')
    result = run(config(url, dataset=str(dataset), concurrency=2))
    s = result.summary()
    assert (s["completed"], s["failed"], s["total_output_tokens"]) == (1, {"http_400": 1}, 3)
    bad = result.records[1]
    assert bad.error == "http_400" and "max_tokens" in bad.message
    good = result.records[0]
    assert s["e2e_ms"]["mean"] == pytest.approx((good.end_s - good.send_s) * 1e3)


def test_queue_full_is_reported_as_429(bundled_artifact, tokenizer):
    with serve(bundled_artifact, ServingConfig(num_blocks=64, max_num_seqs=1, max_waiting=1), api_key=None) as u:
        result = run(ServeBenchConfig(url=u, tokenizer=tokenizer, num_requests=6, concurrency=6, input_len=8,
                                      output_len=16))
    s = result.summary()
    assert s["failed"].get("http_429", 0) >= 1 and set(s["failed"]) == {"http_429"}
    assert s["completed"] + s["failed"]["http_429"] == 6 and s["completed"] >= 1
    assert all("busy" in r.message for r in result.records if not r.ok)


def _mock(handler) -> httpx.MockTransport:
    def route(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 64}]})
        return handler(request)
    return httpx.MockTransport(route)


SSE = {"content-type": "text/event-stream"}


@pytest.mark.parametrize("response, kind, message", [
    (httpx.Response(500, json={"error": {"message": "engine failed"}}), "http_500", "engine failed"),
    (httpx.Response(200, headers=SSE, text='data: {"choices": [{"text": "a"}]}\n\n'
                    'data: {"error": {"message": "the request timed out"}}\n\ndata: [DONE]\n\n'),
     "stream_error", "timed out"),
    (httpx.Response(200, headers=SSE, text='data: {"choices": [{"text": "a"}]}\n\n'), "bad_response", "[DONE]"),
    (httpx.Response(200, headers=SSE, text="data: {not json\n\n"), "bad_response", "not JSON"),
    (httpx.Response(200, json={"choices": []}), "bad_response", "text/event-stream"),
    (httpx.Response(200, headers=SSE, text='data: {"choices": [{"text": ""}]}\n\ndata: [DONE]\n\n'),
     "no_tokens", "no text"),
])
def test_failure_kinds(tmp_path, response, kind, message):
    dataset = tmp_path / "one.jsonl"
    dataset.write_text('{"prompt": "x", "max_tokens": 2}\n')
    result = run(ServeBenchConfig(url="http://bench.invalid", dataset=str(dataset)),
                 transport=_mock(lambda request: response))
    (r,) = result.records
    assert r.error == kind and message in r.message
    assert result.summary()["failed"] == {kind: 1} and result.summary()["ttft_ms"]["mean"] is None


def test_chunk_count_when_there_is_no_usage(tmp_path):
    body = "".join(f'data: {{"choices": [{{"text": "{t}"}}]}}\n\n' for t in "abc") + "data: [DONE]\n\n"
    dataset = tmp_path / "one.jsonl"
    dataset.write_text('{"prompt": "x", "max_tokens": 3}\n')
    result = run(ServeBenchConfig(url="http://bench.invalid", dataset=str(dataset)),
                 transport=_mock(lambda request: httpx.Response(200, headers=SSE, text=body)))
    (r,) = result.records
    assert r.ok and r.num_output_tokens == 3 and len(r.chunk_s) == 3 and r.num_prompt_tokens is None


# --- bad input -------------------------------------------------------------------------------------------
def cli(*args: str):
    return CliRunner().invoke(app, ["bench", "serve", "--quiet", *args])


def test_unreachable_url_is_a_clear_error(tokenizer):
    dead = closed_port_url()
    res = cli("--url", dead, "--tokenizer", tokenizer, "--num-requests", "1")
    assert res.exit_code == 1
    assert f"cannot reach {dead}/v1/models" in res.output and "--url" in res.output
    res = cli("--url", "localhost:8000", "--tokenizer", tokenizer)
    assert res.exit_code == 1 and "is not an http(s) base URL" in res.output


def test_bad_jsonl_names_the_line(tmp_path, url):
    dataset = tmp_path / "bad.jsonl"
    cases = {
        '{"prompt": "ok"}\n\n{"prompt": "ok", \n': r"line 3: not JSON",
        '{"prompt": "ok"}\n["prompt"]\n': r"line 2: a JSON list, expected an object",
        '{"text": "no prompt key"}\n': r"line 1: \"prompt\" must be a non-empty string",
        '{"prompt": "ok", "max_tokens": 0}\n': r"line 1: \"max_tokens\" must be an integer >= 1, got 0",
        '{"prompt": "ok", "max_tokens": 4, "output_len": 5}\n': r"line 1: .* disagree",
        "\n\n": r"no prompts in it",
    }
    for text, pattern in cases.items():
        dataset.write_text(text)
        with pytest.raises(BenchError, match=pattern):
            run(config(url, dataset=str(dataset)))
    res = cli("--url", url, "--api-key", API_KEY, "--dataset", str(tmp_path / "missing.jsonl"))
    assert res.exit_code == 1 and "missing.jsonl: cannot read it" in res.output


def test_bad_options_say_what_is_allowed(url, tokenizer, tmp_path):
    cases = [
        (["--slo", "ttft:500"], "expected NAME=MILLISECONDS with NAME one of ttft, tpot, e2e"),
        ([], "random prompts need --tokenizer"),
        (["--tokenizer", str(tmp_path)], "no tokenizer.json there"),
        (["--tokenizer", tokenizer, "--endpoint", "embeddings"], "is not one of completions, chat"),
        (["--tokenizer", tokenizer, "--endpoint", "chat", "--prompt-format", "ids"], "use --prompt-format text"),
        (["--tokenizer", tokenizer, "--range-ratio", "1.5"], "--range-ratio must be in [0, 1)"),
        (["--tokenizer", tokenizer, "--request-rate", "0"], "--request-rate must be a positive number"),
        (["--tokenizer", tokenizer, "--input-len", "600"], "do not fit the server's max_model_len 512"),
        (["--tokenizer", tokenizer, "--model", "other"], "'other' is not served at"),
    ]
    for args, message in cases:
        res = cli("--url", url, "--api-key", API_KEY, *args)
        assert res.exit_code == 1 and message in res.output, (args, res.output)
    res = cli("--url", url, "--api-key", "wrong", "--tokenizer", tokenizer)
    assert res.exit_code == 1 and "answered 401" in res.output and "--api-key" in res.output


def test_workers_share_the_requests_and_the_concurrency(url, tokenizer, fixed):
    split = run(config(url, tokenizer=tokenizer, num_requests=6, concurrency=2, input_len=16, output_len=8,
                       workers=2))
    s = split.summary()
    assert (s["num_requests"], s["completed"], s["failed"]) == (6, 6, {})
    assert [r.index for r in split.records] == list(range(6))
    assert [r.num_prompt_tokens for r in split.records] == [r.num_prompt_tokens for r in fixed.records]
    assert s["total_output_tokens"] == 48 and s["config"]["workers"] == 2
    for w in range(2):  # each process got every other request and a cap of one: its requests run one at a time
        mine = split.records[w::2]
        for a, b in zip(mine, mine[1:]):
            assert b.send_s >= a.end_s
    last_end = max(r.end_s for r in split.records)
    assert split.duration_s == last_end and s["output_token_throughput"] == pytest.approx(48 / last_end)
    rate, duration, seed = 40.0, 0.25, 3
    rng, t, schedule = random.Random(seed), 0.0, []
    while t < duration:
        schedule.append(t)
        t += rng.expovariate(rate)
    poisson = run(config(url, tokenizer=tokenizer, request_rate=rate, duration=duration, seed=seed, input_len=8,
                         output_len=4, workers=2))
    assert [r.index for r in poisson.records] == list(range(len(schedule)))
    assert poisson.summary()["completed"] == len(schedule)
    for r, planned in zip(poisson.records, schedule):  # every process keeps the shared schedule
        assert r.send_s >= planned - 1e-6


def test_workers_need_the_requests_known_up_front(url, tokenizer):
    with pytest.raises(BenchError, match="--workers > 1 needs"):
        config(url, tokenizer=tokenizer, duration=1.0, concurrency=4, workers=2)
    with pytest.raises(BenchError, match="below --workers"):
        config(url, tokenizer=tokenizer, num_requests=4, concurrency=1, workers=2)
    with pytest.raises(BenchError, match="--workers must be >= 1"):
        config(url, tokenizer=tokenizer, num_requests=4, workers=0)


# --- ShareGPT-like lengths -------------------------------------------------------------------------------
def draws(seed: int, num: int = 2000, **clip) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [sharegpt_lengths(rng, **clip) for _ in range(num)]


def test_sharegpt_mix_shape_within_the_documented_bounds():
    pairs = draws(0)
    assert pairs == draws(0) and pairs != draws(1)  # seeded
    for values, median, sigma, most in (([i for i, _ in pairs], 160, 1.0, 4096), ([o for _, o in pairs], 200, 0.9,
                                                                                   2048)):
        cuts = statistics.quantiles(values, n=100, method="inclusive")
        # documented lognormal figures, +/- 15% (several standard errors at 2,000 draws)
        assert statistics.median(values) == pytest.approx(median, rel=0.15)
        assert statistics.fmean(values) == pytest.approx(median * math.exp(sigma ** 2 / 2), rel=0.15)
        assert cuts[89] == pytest.approx(median * math.exp(1.2816 * sigma), rel=0.15)
        assert cuts[98] > 4 * median  # heavy tail: p99 several times the median
        assert 1 <= min(values) and max(values) <= most
    assert max(i for i, _ in pairs) > 1500  # prompts reach a few thousand tokens


def test_sharegpt_mix_clipping():
    free = draws(3, 500)
    capped = draws(3, 500, max_input=300, max_output=100)
    assert capped == [(min(i, 300), min(o, 100)) for i, o in free]  # a cap clips, it does not redraw
    assert any(i == 300 for i, _ in capped) and any(o == 100 for _, o in capped)
    fitted = draws(3, 500, max_model_len=256)
    for (i, o), (fi, fo) in zip(free, fitted):  # the output keeps its length; the prompt gets what is left
        assert fo == min(o, 255) and fi == min(i, 256 - fo) and fi >= 1 and fi + fo <= 256
    assert any(fi < i for (i, _), (fi, _) in zip(free, fitted))


def test_sharegpt_prompts_against_the_server(url, tokenizer, tmp_path):
    out = tmp_path / "sharegpt.json"
    res = cli("--url", url, "--api-key", API_KEY, "--tokenizer", tokenizer, "--length-dist", "sharegpt",
              "--output-len", "6", "--num-requests", "8", "--concurrency", "8", "--json", str(out))
    assert res.exit_code == 0, res.output
    s = json.loads(out.read_text())
    assert s["kind"] == "bench_serve" and s["completed"] == 8 and s["failed"] == {}
    assert (s["config"]["length_dist"], s["config"]["input_len"], s["config"]["output_len"]) == ("sharegpt", None, 6)
    realized = s["config"]["realized_lengths"]
    assert set(realized) == {"input", "output"} and set(realized["input"]) == {"mean", "p50", "p90"}
    # token-id prompts and ignore_eos: the server counted exactly the lengths drawn
    assert realized["input"]["mean"] * 8 == pytest.approx(s["total_input_tokens"])
    assert realized["output"]["mean"] * 8 == pytest.approx(s["total_output_tokens"]) and realized["output"]["p90"] <= 6
    assert "sharegpt: input mean" in res.output


def test_sharegpt_lengths_are_the_ones_sent(url, tokenizer):
    result = run(config(url, tokenizer=tokenizer, length_dist="sharegpt", output_len=4, num_requests=8,
                        concurrency=8))
    assert all(r.ok for r in result.records)
    inputs = [r.num_prompt_tokens for r in result.records]  # usage.prompt_tokens: token-id prompts, no BOS added
    outputs = [r.num_output_tokens for r in result.records]  # ignore_eos: exactly the max_tokens drawn
    assert all(1 <= o <= 4 for o in outputs) and all(i + o <= 512 for i, o in zip(inputs, outputs))
    assert len(set(inputs)) > 1  # a mix, not one length
    realized = result.summary()["config"]["realized_lengths"]
    for got, raw in ((realized["input"], inputs), (realized["output"], outputs)):
        cuts = statistics.quantiles(raw, n=10, method="inclusive")
        assert got == pytest.approx({"mean": statistics.fmean(raw), "p50": statistics.median(raw), "p90": cuts[8]})


# --- rate sweep ------------------------------------------------------------------------------------------
def summary_with(p99: dict, completed: int = 4, failed: dict | None = None) -> dict:
    return {"completed": completed, "failed": failed or {},
            **{f"{k}_ms": {"p99": v} for k, v in p99.items()}}


def test_meets_slos_is_p99_of_each_slo_and_no_failure():
    slos = {"ttft": 500.0, "tpot": 50.0}
    assert meets_slos(summary_with({"ttft": 500.0, "tpot": 49.0, "e2e": 1e9}), slos) is True  # bound included
    assert meets_slos(summary_with({"ttft": 500.1, "tpot": 1.0, "e2e": 1.0}), slos) is False
    assert meets_slos(summary_with({"ttft": 1.0, "tpot": 50.5, "e2e": 1.0}), slos) is False
    assert meets_slos(summary_with({"ttft": 1.0, "tpot": None, "e2e": 1.0}), slos) is True  # one-token outputs
    assert meets_slos(summary_with({"ttft": 1.0, "tpot": 1.0, "e2e": 1.0}, failed={"http_429": 1}), slos) is False
    assert meets_slos(summary_with({"ttft": None, "tpot": None, "e2e": None}, completed=0), slos) is False
    assert meets_slos(summary_with({"ttft": 1e9, "tpot": 1e9, "e2e": 1e9}), {}) is None


def test_sweep_runs_each_rate_and_writes_the_sweep_json(url, tokenizer, tmp_path):
    out = tmp_path / "sweep.json"
    res = cli("--url", url, "--api-key", API_KEY, "--tokenizer", tokenizer, "--input-len", "8", "--output-len", "4",
              "--num-requests", "4", "--request-rate", "200", "--request-rate", "50", "--slo", "ttft=1e7",
              "--slo", "tpot=1e7", "--json", str(out))
    assert res.exit_code == 0, res.output
    assert "request rate sweep" in res.output and "goodput rate: 200 req/s" in res.output
    s = json.loads(out.read_text())
    assert set(s) == {"kind", "version", "url", "model", "endpoint", "started_at", "slos_ms", "rates", "goodput_rate",
                      "points", "runs"}
    assert (s["kind"], s["version"], s["url"], s["model"]) == ("bench_serve_sweep", 1, url, "pystdlib")
    assert s["rates"] == [50.0, 200.0] and s["slos_ms"] == {"ttft": 1e7, "tpot": 1e7}
    assert s["goodput_rate"] == 200.0  # every rate met these bounds: the highest
    for rate, point, run_summary in zip(s["rates"], s["points"], s["runs"]):
        assert set(run_summary) == SUMMARY_KEYS and run_summary["kind"] == "bench_serve"
        assert run_summary["config"]["request_rate"] == rate and run_summary["num_requests"] == 4
        assert point == {"request_rate": rate, "num_requests": 4, "completed": 4, "failed": 0,
                         "request_throughput": run_summary["request_throughput"],
                         "output_token_throughput": run_summary["output_token_throughput"],
                         "ttft_p99_ms": run_summary["ttft_ms"]["p99"], "tpot_p99_ms": run_summary["tpot_ms"]["p99"],
                         "e2e_p99_ms": run_summary["e2e_ms"]["p99"],
                         "goodput_request_throughput": run_summary["request_throughput"], "goodput_fraction": 1.0,
                         "meets_slos": True}
    assert s["started_at"] == s["runs"][0]["started_at"]


def test_sweep_goodput_rate_follows_the_p99_criterion(url, tokenizer):
    sweep = run_sweep(config(url, tokenizer=tokenizer, input_len=8, output_len=4, num_requests=3), [100.0, 30.0])
    assert [r.config.request_rate for r in sweep.results] == [30.0, 100.0]
    ttft_p99 = [r.summary()["ttft_ms"]["p99"] for r in sweep.results]
    # a TTFT bound between the two rates' p99s: only the rate(s) at or under it meet it
    bound = min(ttft_p99)
    meeting = [r.config.request_rate for r, p99 in zip(sweep.results, ttft_p99) if p99 <= bound]
    for result in sweep.results:
        result.config.slos = [f"ttft={bound!r}"]
    s = sweep.summary()
    assert [p["meets_slos"] for p in s["points"]] == [p99 <= bound for p99 in ttft_p99]
    assert s["goodput_rate"] == max(meeting) and s["runs"][0]["goodput"]["slos_ms"] == {"ttft": bound}
    for result in sweep.results:
        result.config.slos = []
    assert sweep.summary()["goodput_rate"] is None and sweep.summary()["points"][0]["meets_slos"] is None


def test_sweep_and_length_options_say_what_is_allowed(url, tokenizer, tmp_path):
    dataset = tmp_path / "d.jsonl"
    dataset.write_text('{"prompt": "x"}\n')
    cases = [
        (["--length-dist", "zipf"], "--length-dist 'zipf' is not one of uniform, sharegpt"),
        (["--length-dist", "sharegpt", "--range-ratio", "0.2"], "--range-ratio varies --length-dist uniform"),
        (["--length-dist", "sharegpt", "--dataset", str(dataset)], "a --dataset brings its own prompts"),
        (["--request-rate", "10", "--request-rate", "10"], "--request-rate 10 is given twice"),
        (["--request-rate", "10", "--request-rate", "0"], "--request-rate must be a positive number"),
    ]
    for args, message in cases:
        res = cli("--url", url, "--api-key", API_KEY, "--tokenizer", tokenizer, *args)
        assert res.exit_code == 1 and message in res.output, (args, res.output)
