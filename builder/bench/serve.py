"""Benchmark client for a running OpenAI-compatible server (``builder bench serve``): ours, vLLM, or any other.

    builder serve artifacts/quickstart --port 8000 &
    builder bench serve --url http://127.0.0.1:8000 --tokenizer artifacts/quickstart \\
        --input-len 128 --output-len 128 --num-requests 200 --concurrency 16 --json serve.json
    builder bench serve --dataset prompts.jsonl --request-rate 4 --duration 60 --concurrency 32 \\
        --slo ttft=500 --slo tpot=50
    builder bench serve --tokenizer artifacts/quickstart --length-dist sharegpt --num-requests 1000 \\
        --request-rate 20 --request-rate 40 --request-rate 60 --slo ttft=500 --slo tpot=50 --json sweep.json

Load: at most ``--concurrency`` requests in flight (default 1 without ``--request-rate``), or Poisson
arrivals at ``--request-rate`` req/s, optionally capped by ``--concurrency``. Arrival k (from 0) is sent
at t_k = g_0 + ... + g_{k-1} seconds after the start (t_0 = 0), where the gaps g_i are successive
``random.Random(seed).expovariate(rate)`` draws. A run ends after ``--num-requests`` requests and/or
after ``--duration`` seconds: with a rate, exactly the arrivals with t_k < duration are sent (fewer only
when a concurrency cap holds one back past the duration); without one, no request is sent after it.
Requests in flight are then awaited, each for at most ``--timeout`` seconds from its send. Neither bound
given: each dataset line once, or 100 random prompts.

Prompts: ``--dataset file.jsonl`` (one object per line: ``prompt`` (string), optional ``max_tokens`` or
``output_len``, default ``--output-len``; cycled in order when more requests are asked for), or random
token ids, which need ``--tokenizer`` (a tokenizer.json, a directory holding one, or one of our artifact
directories) for exact token counts. They are sent as token ids (``prompt: [ids]``; /v1/completions of
our server and vLLM) or, with ``--prompt-format text`` and always for ``--endpoint chat``, decoded text.
The lengths of random prompts (``--length-dist``, seeded):

    uniform   (default) ``--input-len`` (default 128) and ``--output-len`` (default 128) tokens, each varied
              uniformly by +/- ``--range-ratio``
    sharegpt  a synthetic mix shaped like ShareGPT conversations as published summaries describe them
              (heavy-tailed, lognormal-like; no dataset is downloaded or bundled): input and output drawn
              independently, round(lognormvariate(ln(median), sigma)), at least 1 token, with
                  input:  median 160, sigma 1.0 (mean ~264, p90 ~577, p99 ~1,640), at most 4,096
                  output: median 200, sigma 0.9 (mean ~300, p90 ~634, p99 ~1,620), at most 2,048
              then clipped: the output to ``--output-len`` when given and to max_model_len - 1, the input
              to ``--input-len`` when given and to what max_model_len leaves beside the output (the prompt
              is cut, as a client truncating a long conversation would). ``--input-len``/``--output-len``
              are maxima here, not targets; without them only the server's max_model_len (GET /v1/models,
              when it says) bounds the mix. The realized mean, p50 and p90 of the lengths sent are printed
              and written to the JSON config (``realized_lengths``).

Every request streams (``stream: true``, ``stream_options: {"include_usage": true}``), asks for greedy
decoding and ``ignore_eos: true`` (a vLLM extension our server supports; ``--no-ignore-eos`` drops it).
Output tokens come from the usage chunk, else the number of streamed chunks that carried text; prompt
tokens from the usage chunk, else the client's own count.

Metrics (docs ANCHORS "Serving metrics", as ``vllm bench serve`` defines them), in milliseconds:

    TTFT  first chunk with text - request send time (queueing and prefill included)
    ITL   gaps between consecutive chunks with text, pooled over requests (a chunk may carry several
          tokens when the server coalesces them; then its gap covers them all)
    TPOT  per request, (E2E - TTFT) / (output_tokens - 1); requests of one output token have none
    E2E   end of the stream (``data: [DONE]``) - request send time

Each is reported as mean, p50, p90, p95, p99 (linear interpolation between order statistics, as numpy's
default). Throughput is over wall-clock time, from the first send to the last request's end: completed
requests/s, output tokens/s, (prompt + output) tokens/s. Goodput for ``--slo ttft=500 --slo tpot=50
--slo e2e=2000`` (ms): requests that met every SLO given (value <= bound; a request with no TPOT meets
a TPOT SLO), as req/s over the same wall-clock time and as a fraction of the requests sent.

Failed requests are counted by kind and left out of every latency and token figure: ``http_<status>``
(``http_429`` when the server's queue is full), ``timeout``, ``connection``, ``stream_error`` (an error
event inside the stream), ``bad_response`` (not an SSE stream, bad JSON, no ``[DONE]``), ``no_tokens``.

``--json PATH`` writes one object: kind "bench_serve", version 1, url, model, endpoint, started_at,
config, duration_s, num_requests (sent), completed, failed {kind: count}, request_throughput,
output_token_throughput, total_token_throughput, total_input_tokens, total_output_tokens, ttft_ms,
tpot_ms, itl_ms, e2e_ms ({mean, p50, p90, p95, p99}, null values when there is no sample) and goodput
(null, or {slos_ms, request_throughput, fraction}). With ``--length-dist sharegpt``, config also holds
realized_lengths {input, output: {mean, p50, p90}} (tokens, of the requests sent).

Rate sweep: ``--request-rate`` given more than once runs one benchmark per rate, in increasing order, against
the same server, each with the same settings (``--num-requests`` and/or ``--duration`` per rate, the same seed,
so the same prompts). A rate *meets the SLOs* when at least one request completed, none failed, and for each
``--slo`` given the p99 of that metric over the completed requests is <= its bound (a TPOT with no sample
meets it). The *goodput rate* is the highest rate that meets them (null when none does, or without
``--slo``). ``--json PATH`` then writes kind "bench_serve_sweep", version 1: url, model, endpoint,
started_at (of the first rate), slos_ms, rates (req/s, increasing), goodput_rate, points (one per rate:
request_rate, num_requests, completed, failed (count), request_throughput, output_token_throughput,
ttft_p99_ms, tpot_p99_ms, e2e_p99_ms, goodput_request_throughput, goodput_fraction (null without
``--slo``), meets_slos (null without ``--slo``)) and runs (each rate's "bench_serve" object as above).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, Optional
from urllib.parse import urlparse

import httpx

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
PROMPT_FORMATS = ("ids", "text")
LENGTH_DISTS = ("uniform", "sharegpt")
DEFAULT_LEN = 128  # --input-len and --output-len of uniform random prompts, and max_tokens of dataset lines
SLO_NAMES = ("ttft", "tpot", "e2e")
PERCENTILES = (50, 90, 95, 99)
DEFAULT_NUM_RANDOM_REQUESTS = 100
API_KEY_ENV = ("LLM_BUILDER_API_KEY", "OPENAI_API_KEY")  # looked up in this order when --api-key is absent

Progress = Callable[[str, int, Optional[int]], None]  # (task, done, total or None when open-ended)


class BenchError(ValueError):
    """Bad benchmark input or an unusable server: the message says what was wrong and what is allowed."""


@dataclass
class ServeBenchConfig:
    """The settings of one run, as given on the command line (``None``: the documented default)."""

    url: str = "http://127.0.0.1:8000"  # server base URL; a trailing /v1 is accepted
    model: Optional[str] = None  # None: the first id of GET /v1/models
    api_key: Optional[str] = None  # None: $LLM_BUILDER_API_KEY, else $OPENAI_API_KEY, else no key
    endpoint: str = "completions"  # completions | chat
    concurrency: Optional[int] = None  # most requests in flight; None: 1 without a rate, no cap with one
    request_rate: Optional[float] = None  # Poisson arrivals per second; None: send as slots free up
    num_requests: Optional[int] = None  # requests to send
    duration: Optional[float] = None  # seconds after which no new request is sent
    dataset: Optional[str] = None  # JSONL prompts; None: random token ids
    tokenizer: Optional[str] = None  # tokenizer.json, or a directory with one (or with tokenizer/tokenizer.json)
    length_dist: str = "uniform"  # random prompts' lengths: uniform | sharegpt (see the module docstring)
    input_len: Optional[int] = None  # uniform: tokens per prompt (None: 128); sharegpt: the most (None: no cap)
    output_len: Optional[int] = None  # max_tokens as input_len, and of dataset lines that give none (None: 128)
    range_ratio: float = 0.0  # uniform lengths drawn uniformly from [len * (1 - r), len * (1 + r)]
    prompt_format: Optional[str] = None  # random prompts: ids | text; None: ids for completions, text for chat
    ignore_eos: bool = True
    slos: list[str] = field(default_factory=list)  # "ttft=500" (ms), as given to --slo
    seed: int = 0  # prompts and arrivals
    timeout: float = 600.0  # seconds per request, from its send
    workers: int = 1  # client processes sharing the load (requests dealt round-robin, concurrency split)

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise BenchError(f"--endpoint {self.endpoint!r} is not one of {', '.join(ENDPOINTS)}")
        if self.prompt_format is not None and self.prompt_format not in PROMPT_FORMATS:
            raise BenchError(f"--prompt-format {self.prompt_format!r} is not one of {', '.join(PROMPT_FORMATS)}")
        if self.endpoint == "chat" and self.prompt_format == "ids":
            raise BenchError("--endpoint chat sends messages, which are text: use --prompt-format text (or leave "
                             "it out)")
        if self.length_dist not in LENGTH_DISTS:
            raise BenchError(f"--length-dist {self.length_dist!r} is not one of {', '.join(LENGTH_DISTS)}")
        if self.length_dist == "sharegpt" and self.dataset is not None:
            raise BenchError("--length-dist sharegpt shapes random prompts; a --dataset brings its own prompts: "
                             "give one of them")
        if self.length_dist == "sharegpt" and self.range_ratio:
            raise BenchError("--range-ratio varies --length-dist uniform lengths; sharegpt draws its own spread")
        if self.length_dist == "uniform":  # derived once: the default lengths (sharegpt: None is no cap)
            self.input_len = DEFAULT_LEN if self.input_len is None else self.input_len
            self.output_len = DEFAULT_LEN if self.output_len is None else self.output_len
        for name in ("concurrency", "num_requests", "input_len", "output_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise BenchError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        for name in ("request_rate", "duration", "timeout"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise BenchError(f"--{name.replace('_', '-')} must be a positive number of "
                                 f"{'requests/s' if name == 'request_rate' else 'seconds'}, got {value}")
        if self.workers < 1:
            raise BenchError(f"--workers must be >= 1, got {self.workers}")
        if self.workers > 1 and self.num_requests is None and self.request_rate is None:
            raise BenchError("--workers > 1 needs the requests known up front: give --num-requests, or --request-rate "
                             "with --duration")
        if self.workers > 1 and self.concurrency is not None and self.concurrency < self.workers:
            raise BenchError(f"--concurrency {self.concurrency} is below --workers {self.workers}: each client "
                             f"process needs at least one request in flight")
        if not 0 <= self.range_ratio < 1:
            raise BenchError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")
        try:  # a bad port, host or character: httpx and the socket raised their own errors (tracebacks) later
            parsed = urlparse(self.url)
            _ = parsed.port  # ValueError: not a number, or past 65535
            httpx.URL(self.url)  # InvalidURL: a non-printable character
            ok = (parsed.scheme in ("http", "https") and bool(parsed.hostname) and not parsed.query
                  and not parsed.fragment)
        except (ValueError, httpx.InvalidURL):
            ok = False
        if not ok:
            raise BenchError(f"--url {self.url!r} is not an http(s) base URL such as http://127.0.0.1:8000 (a host, "
                             f"an optional port in 0..65535 and path; no query or fragment)")
        parse_slos(self.slos)

    @property
    def base_url(self) -> str:
        url = self.url.rstrip("/")
        return url[:-3] if url.endswith("/v1") else url

    @property
    def format(self) -> str:
        return self.prompt_format or ("text" if self.endpoint == "chat" else "ids")

    def resolved_api_key(self) -> Optional[str]:
        if self.api_key:
            return self.api_key
        return next((os.environ[name] for name in API_KEY_ENV if os.environ.get(name)), None)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["api_key"] = "<set>" if self.resolved_api_key() else None  # never write the key itself
        return out


def parse_slos(specs: list[str]) -> dict[str, float]:
    """``["ttft=500", "tpot=50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        name = name.strip().lower()
        try:
            ms = float(value) if sep else math.nan
        except ValueError:
            ms = math.nan
        if name not in SLO_NAMES or not (ms > 0 and math.isfinite(ms)):
            raise BenchError(f"--slo {spec!r}: expected NAME=MILLISECONDS with NAME one of {', '.join(SLO_NAMES)} "
                             "and a positive number, e.g. --slo ttft=500 --slo tpot=50")
        if name in slos:
            raise BenchError(f"--slo {name} is given twice")
        slos[name] = ms
    return slos


# --- prompts ---------------------------------------------------------------------------------------------
@dataclass
class Prompt:
    prompt: str | list[int]  # text, or token ids (completions only)
    num_tokens: Optional[int]  # the client's count of prompt tokens; None when unknown
    max_tokens: int  # output tokens asked for


def load_tokenizer(path: str | Path):
    """A ``tokenizers.Tokenizer`` from a tokenizer.json, a directory holding one, or an artifact directory."""
    from tokenizers import Tokenizer

    p = Path(path)
    candidates = [p] if p.is_file() else [p / "tokenizer.json", p / "tokenizer" / "tokenizer.json"]
    file = next((c for c in candidates if c.is_file()), None)
    if file is None:
        raise BenchError(f"--tokenizer {path}: no tokenizer.json there; give a tokenizer.json file, a directory "
                         "holding one (a Hugging Face checkpoint), or an artifact directory")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # the tokenizers library raises plain Exceptions on a bad file
        raise BenchError(f"--tokenizer {file}: cannot load it with the tokenizers library: {e}") from None


def load_dataset(path: str | Path, default_max_tokens: int) -> list[Prompt]:
    """Prompts of a JSONL file: one object per line with ``prompt`` and optional ``max_tokens``/``output_len``."""
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise BenchError(f"--dataset {path}: cannot read it: {e}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--dataset {path} line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise BenchError(f"{where}: not JSON ({e.msg}); each line must be an object such as "
                             '{"prompt": "...", "max_tokens": 128}') from None
        if not isinstance(row, dict):
            raise BenchError(f"{where}: a JSON {type(row).__name__}, expected an object with a \"prompt\" string")
        prompt = row.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise BenchError(f"{where}: \"prompt\" must be a non-empty string, got {prompt!r:.60}")
        lengths = {k: row[k] for k in ("max_tokens", "output_len") if row.get(k) is not None}
        for k, v in lengths.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise BenchError(f"{where}: \"{k}\" must be an integer >= 1, got {v!r}")
        if len(set(lengths.values())) > 1:
            raise BenchError(f"{where}: \"max_tokens\" {lengths['max_tokens']} and \"output_len\" "
                             f"{lengths['output_len']} disagree; give one")
        prompts.append(Prompt(prompt, None, next(iter(lengths.values()), default_max_tokens)))
    if not prompts:
        raise BenchError(f"--dataset {path}: no prompts in it (empty, or only blank lines)")
    return prompts


def _draw_len(rng: random.Random, length: int, ratio: float) -> int:
    return max(1, rng.randint(int(length * (1 - ratio)), int(length * (1 + ratio))))


@dataclass(frozen=True)
class LogNormalLen:
    """A token count round(lognormvariate(ln(median), sigma)), at least 1 and at most ``most``."""

    median: float  # tokens; the mean is median * exp(sigma^2 / 2)
    sigma: float  # of ln(length)
    most: int  # the mix's own upper end (its tail beyond is very rare)

    def draw(self, rng: random.Random) -> int:
        return min(self.most, max(1, round(rng.lognormvariate(math.log(self.median), self.sigma))))


# Synthetic ShareGPT-like lengths (module docstring): heavy-tailed prompts, answers a little longer at the median.
SHAREGPT_INPUT = LogNormalLen(median=160, sigma=1.0, most=4096)
SHAREGPT_OUTPUT = LogNormalLen(median=200, sigma=0.9, most=2048)


def sharegpt_lengths(rng: random.Random, max_input: Optional[int] = None, max_output: Optional[int] = None,
                     max_model_len: Optional[int] = None) -> tuple[int, int]:
    """(input, output) tokens of one request of the synthetic ShareGPT-like mix, clipped (module docstring).

    NOTE: the output is clipped first (to ``max_output`` and ``max_model_len - 1``); the input then gets at most
    what ``max_model_len`` leaves, so input + output <= max_model_len always holds and both are >= 1.
    """
    num_in, num_out = SHAREGPT_INPUT.draw(rng), SHAREGPT_OUTPUT.draw(rng)
    if max_output is not None:
        num_out = min(num_out, max_output)
    if max_input is not None:
        num_in = min(num_in, max_input)
    if max_model_len:
        num_out = min(num_out, max_model_len - 1)
        num_in = min(num_in, max_model_len - num_out)
    return num_in, num_out


def _draw_lengths(rng: random.Random, config: ServeBenchConfig, max_model_len: Optional[int]) -> tuple[int, int]:
    if config.length_dist == "sharegpt":
        return sharegpt_lengths(rng, config.input_len, config.output_len, max_model_len)
    return _draw_len(rng, config.input_len, config.range_ratio), _draw_len(rng, config.output_len, config.range_ratio)


def random_prompts(tokenizer, config: ServeBenchConfig, max_model_len: Optional[int] = None) -> Iterator[Prompt]:
    """Endless seeded prompts of random non-special token ids, of exact lengths when sent as ids.

    As text, the ids are decoded and the text re-encoded (without special tokens), trimming or adding
    ids until it encodes to the drawn length or a few tries pass; ``num_tokens`` is that encoded length.
    """
    added = set(tokenizer.get_added_tokens_decoder())
    vocab = [i for i in range(tokenizer.get_vocab_size(with_added_tokens=True)) if i not in added]
    rng = random.Random(config.seed)
    while True:
        num_in, num_out = _draw_lengths(rng, config, max_model_len)
        ids = [rng.choice(vocab) for _ in range(num_in)]
        if config.format == "ids":
            yield Prompt(ids, num_in, num_out)
            continue
        for _ in range(8):
            text = tokenizer.decode(ids)
            encoded = tokenizer.encode(text, add_special_tokens=False).ids
            if len(encoded) == num_in:
                break
            ids = encoded[:num_in] + [rng.choice(vocab) for _ in range(num_in - len(encoded))]
        yield Prompt(text, len(encoded), num_out)


def _prompts(config: ServeBenchConfig, tokenizer,
             max_model_len: Optional[int]) -> tuple[Iterator[Prompt], Optional[int]]:
    """The prompt stream and the number of requests to send (None: until --duration)."""
    if config.dataset is not None:
        rows = load_dataset(config.dataset, config.output_len)
        if tokenizer is not None:
            for row in rows:
                row.num_tokens = len(tokenizer.encode(row.prompt).ids)
        default = len(rows)
        source: Iterator[Prompt] = itertools.cycle(rows)
    else:
        if tokenizer is None:
            raise BenchError("random prompts need --tokenizer (a tokenizer.json, a directory holding one, or an "
                             "artifact directory) to make prompts of exact token counts; or give prompts with "
                             "--dataset FILE.jsonl")
        default = DEFAULT_NUM_RANDOM_REQUESTS
        source = random_prompts(tokenizer, config, max_model_len)
    num = config.num_requests if config.num_requests is not None else (None if config.duration else default)
    return source, num


# --- the client ------------------------------------------------------------------------------------------
@dataclass
class RequestRecord:
    """One request as the client saw it; times are seconds since the benchmark started (time.monotonic, one clock
    for every client process)."""

    index: int  # send order
    max_tokens: int  # output tokens asked for
    num_prompt_tokens: Optional[int]  # usage.prompt_tokens, else the client's count; None when unknown
    send_s: float = math.nan  # just before the request went out
    chunk_s: list[float] = field(default_factory=list)  # arrival of each streamed chunk that carried text
    end_s: float = math.nan  # the stream's [DONE], or the failure
    num_output_tokens: int = 0  # usage.completion_tokens, else len(chunk_s)
    error: Optional[str] = None  # failure kind (see the module docstring); None: completed
    message: str = ""  # the failure's detail

    @property
    def ok(self) -> bool:
        return self.error is None


class _Failed(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _error_message(body: bytes) -> str:
    """The message of an OpenAI-shaped error body, else the body's start."""
    text = body.decode("utf-8", errors="replace")
    try:
        error = json.loads(text).get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
    except (ValueError, AttributeError):
        pass
    return text[:200]


def _request_body(config: ServeBenchConfig, model: str, prompt: Prompt) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                            "temperature": 0.0}
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt.prompt}]
        body["max_completion_tokens"] = prompt.max_tokens
    else:
        body["prompt"] = prompt.prompt
        body["max_tokens"] = prompt.max_tokens
    if config.ignore_eos:
        body["ignore_eos"] = True
    return body


def _chunk_text(event: dict, chat: bool) -> str:
    choices = event.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    if chat:
        delta = choices[0].get("delta") or {}
        return delta.get("content") or delta.get("reasoning_content") or ""
    return choices[0].get("text") or ""


async def _stream(client: httpx.AsyncClient, path: str, body: dict, record: RequestRecord, clock: Callable[[], float],
                  chat: bool) -> None:
    """Send one streamed request and fill ``record`` from its events; raises _Failed."""
    usage = None
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            raise _Failed(f"http_{r.status_code}", _error_message(await r.aread()))
        if not r.headers.get("content-type", "").startswith("text/event-stream"):
            raise _Failed("bad_response", f"expected a text/event-stream, got {r.headers.get('content-type')!r}")
        done = False
        async for line in r.aiter_lines():
            now = clock()
            if not line.startswith("data:"):
                continue  # blank separators, comments, event: lines
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                done = True
                break
            try:
                event = json.loads(data)
            except ValueError:
                raise _Failed("bad_response", f"an event that is not JSON: {data[:100]!r}") from None
            if not isinstance(event, dict):
                raise _Failed("bad_response", f"an event that is not an object: {data[:100]!r}")
            if event.get("error"):
                raise _Failed("stream_error", _error_message(json.dumps(event).encode()))
            if _chunk_text(event, chat):
                record.chunk_s.append(now)
            if event.get("usage"):
                usage = event["usage"]
    record.end_s = clock()
    if not done:
        raise _Failed("bad_response", "the stream ended without data: [DONE]")
    if not record.chunk_s:
        raise _Failed("no_tokens", "the stream carried no text")
    record.num_output_tokens = len(record.chunk_s)
    if usage:
        record.num_output_tokens = int(usage.get("completion_tokens") or record.num_output_tokens)
        if usage.get("prompt_tokens") is not None:
            record.num_prompt_tokens = int(usage["prompt_tokens"])


async def _send(client: httpx.AsyncClient, config: ServeBenchConfig, model: str, prompt: Prompt, record: RequestRecord,
                clock: Callable[[], float]) -> None:
    """One request, within --timeout; a failure lands in ``record.error``, never raises."""
    path = ENDPOINTS[config.endpoint]
    body = _request_body(config, model, prompt)
    record.send_s = clock()
    try:
        await asyncio.wait_for(_stream(client, path, body, record, clock, config.endpoint == "chat"), config.timeout)
    except _Failed as e:
        record.error, record.message = e.kind, str(e)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        record.error, record.message = "timeout", f"no complete answer within --timeout {config.timeout:g} s"
    except httpx.TransportError as e:
        record.error, record.message = "connection", f"{type(e).__name__}: {e}"
    except httpx.HTTPError as e:  # e.g. a body that does not decode
        record.error, record.message = "bad_response", f"{type(e).__name__}: {e}"
    if record.error is not None:
        record.end_s = clock()


def poisson_arrivals(rate: float, seed: int) -> Iterator[float]:
    """Send times in seconds from the start: 0, then cumulative ``Random(seed).expovariate(rate)`` gaps."""
    rng, t = random.Random(seed), 0.0
    while True:
        yield t
        t += rng.expovariate(rate)


async def _discover_model(client: httpx.AsyncClient, config: ServeBenchConfig) -> tuple[str, Optional[int]]:
    """The model to ask for and its max_model_len when the server says; checks the server is there."""
    url = f"{config.base_url}/v1/models"
    try:
        r = await client.get("/v1/models", timeout=min(config.timeout, 30.0))
    except httpx.TransportError as e:
        raise BenchError(f"cannot reach {url} ({type(e).__name__}: {e}); is the server running, and is --url "
                         "its base URL (e.g. http://127.0.0.1:8000)?") from None
    if r.status_code in (401, 403):
        raise BenchError(f"GET {url} answered {r.status_code} ({_error_message(r.content)}); pass the server's "
                         f"key with --api-key or ${API_KEY_ENV[0]} / ${API_KEY_ENV[1]}")
    models: dict[str, Optional[int]] = {}
    if r.status_code == 200:
        try:
            models = {m["id"]: m.get("max_model_len") for m in r.json()["data"]}
        except (ValueError, KeyError, TypeError):
            models = {}
    if config.model is not None:
        if models and config.model not in models:
            raise BenchError(f"--model {config.model!r} is not served at {config.base_url}; it serves: "
                             f"{', '.join(models)}")
        return config.model, models.get(config.model)
    if not models:
        raise BenchError(f"GET {url} answered {r.status_code} without a model list; name the model with --model")
    name = next(iter(models))
    return name, models[name]


def _check_fits(config: ServeBenchConfig, max_model_len: Optional[int]) -> None:
    if config.dataset is not None or config.length_dist != "uniform" or not max_model_len:
        return  # sharegpt lengths are clipped to max_model_len instead
    longest = int(config.input_len * (1 + config.range_ratio)) + int(config.output_len * (1 + config.range_ratio))
    if longest > max_model_len:
        raise BenchError(f"random prompts of up to {longest} tokens (input + output, with --range-ratio) do not fit "
                         f"the server's max_model_len {max_model_len}; lower --input-len/--output-len")


def length_stats(values: list[int]) -> dict[str, Optional[float]]:
    """mean, p50 and p90 of token counts; None when there are none."""
    if not values:
        return {"mean": None, "p50": None, "p90": None}
    return {"mean": sum(values) / len(values), "p50": percentile(values, 50), "p90": percentile(values, 90)}


@dataclass
class BenchResult:
    config: ServeBenchConfig
    model: str
    started_at: str  # ISO 8601, UTC
    duration_s: float  # first send to the last request's end
    records: list[RequestRecord]  # in send order
    lengths: list[tuple[Optional[int], int]] = field(default_factory=list)  # (prompt, output) tokens drawn, as sent

    def realized_lengths(self) -> dict[str, dict[str, Optional[float]]]:
        """mean/p50/p90 of the prompt and output lengths of the requests sent (the client's counts)."""
        return {"input": length_stats([n for n, _ in self.lengths if n is not None]),
                "output": length_stats([m for _, m in self.lengths])}

    def summary(self) -> dict[str, Any]:
        """The JSON object (schema in the module docstring)."""
        config = self.config.to_json()
        if self.config.length_dist == "sharegpt":
            config["realized_lengths"] = self.realized_lengths()
        return {"kind": "bench_serve", "version": 1, "url": self.config.base_url, "model": self.model,
                "endpoint": self.config.endpoint, "started_at": self.started_at, "config": config,
                **summarize(self.records, self.duration_s, parse_slos(self.config.slos))}


async def _run(config: ServeBenchConfig, progress: Optional[Progress],
               transport: Optional[httpx.AsyncBaseTransport]) -> BenchResult:
    tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer is not None else None
    key = config.resolved_api_key()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)  # queue in the server, not here
    async with httpx.AsyncClient(base_url=config.base_url, headers=headers, limits=limits, transport=transport,
                                 timeout=httpx.Timeout(config.timeout, connect=min(config.timeout, 30.0))) as client:
        model, max_model_len = await _discover_model(client, config)
        _check_fits(config, max_model_len)
        prompts, num_requests = _prompts(config, tokenizer, max_model_len)
        rate, cap = config.request_rate, config.concurrency
        if rate is None and cap is None:
            cap = 1
        arrivals = poisson_arrivals(rate, config.seed) if rate is not None else itertools.repeat(0.0)
        total = num_requests
        if total is None and rate is not None:  # duration only: the arrivals before it
            total = sum(1 for _ in itertools.takewhile(lambda t: t < config.duration,
                                                       poisson_arrivals(rate, config.seed)))
        slots = asyncio.Semaphore(cap) if cap is not None else None
        records: list[RequestRecord] = []
        lengths: list[tuple[Optional[int], int]] = []
        tasks: list[asyncio.Task] = []
        num_done = 0

        def finished(_: asyncio.Task) -> None:
            nonlocal num_done
            num_done += 1
            if slots is not None:
                slots.release()
            if progress is not None:
                progress("requests", num_done, total)

        if config.workers > 1:
            return await _run_workers(config, model, prompts, total, arrivals, cap)
        started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        start = time.monotonic()

        def clock() -> float:
            return time.monotonic() - start

        if progress is not None:
            progress("requests", 0, total)
        for index, arrival in enumerate(arrivals):
            if num_requests is not None and index >= num_requests:
                break
            if config.duration is not None and arrival >= config.duration:
                break
            if arrival > clock():
                await asyncio.sleep(arrival - clock())
            if slots is not None:
                await slots.acquire()
            # a Poisson schedule without a cap is judged by its send times alone (reproducible counts)
            if config.duration is not None and clock() >= config.duration and (rate is None or slots is not None):
                if slots is not None:
                    slots.release()
                break
            prompt = next(prompts)
            record = RequestRecord(index, prompt.max_tokens, prompt.num_tokens)
            records.append(record)
            lengths.append((prompt.num_tokens, prompt.max_tokens))
            task = asyncio.create_task(_send(client, config, model, prompt, record, clock))
            task.add_done_callback(finished)
            tasks.append(task)
        if progress is not None and total is None:  # open-ended until now: the count is known
            total = len(tasks)
            progress("requests", num_done, total)
        await asyncio.gather(*tasks)
        duration = clock()
    return BenchResult(config, model, started_at, duration, records, lengths)


# --- several client processes -----------------------------------------------------------------------------
# One Python process parses a few tens of thousands of SSE events per second at most; a server streaming to hundreds
# of requests at once sends more, and a single client would measure itself. With --workers N, N processes share the
# requests (index i goes to process i % N, with its send time) and the concurrency cap (split as evenly as it
# goes), start on one shared time.monotonic() instant, and send their records back as JSON.
async def _run_workers(config: ServeBenchConfig, model: str, prompts: Iterator[Prompt], total: int,
                       arrivals: Iterator[float], cap: Optional[int]) -> BenchResult:
    import multiprocessing as mp

    n = config.workers
    items = [(i, t, asdict(next(prompts))) for i, t in zip(range(total), arrivals)]
    if config.duration is not None:  # a Poisson schedule: the arrivals before --duration
        items = [it for it in items if it[1] < config.duration]
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for w in range(n):
        mine, theirs = ctx.Pipe()
        share = None if cap is None else cap // n + (w < cap % n)
        proc = ctx.Process(target=_worker_main, args=(theirs, asdict(config), model, items[w::n], share), daemon=True)
        proc.start()
        theirs.close()
        pipes.append(mine)
        procs.append(proc)
    loop = asyncio.get_running_loop()
    try:
        for pipe in pipes:  # each has imported and connected: start together
            await loop.run_in_executor(None, pipe.recv_bytes)
        start = time.monotonic() + 0.05
        started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        for pipe in pipes:
            pipe.send_bytes(json.dumps(start).encode())
        replies = [json.loads(await loop.run_in_executor(None, pipe.recv_bytes)) for pipe in pipes]
    finally:
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.terminate()
    records = sorted((RequestRecord(**r) for reply in replies for r in reply), key=lambda r: r.index)
    ends = [r.end_s for r in records if not math.isnan(r.end_s)]
    lengths = [(p["num_tokens"], p["max_tokens"]) for _, _, p in items]
    return BenchResult(config, model, started_at, max(ends) if ends else 0.0, records, lengths)


def _worker_main(pipe, config_fields: dict, model: str, items: list, cap: Optional[int]) -> None:
    """One client process of ``--workers``: send its share of the requests, reply with their records."""
    config = ServeBenchConfig(**{**config_fields, "workers": 1})
    pipe.send_bytes(b"ready")
    start = json.loads(pipe.recv_bytes())
    records = asyncio.run(_send_share(config, model, items, cap, start))
    pipe.send_bytes(json.dumps([asdict(r) for r in records]).encode())


async def _send_share(config: ServeBenchConfig, model: str, items: list, cap: Optional[int],
                      start: float) -> list[RequestRecord]:
    key = config.resolved_api_key()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    slots = asyncio.Semaphore(cap) if cap is not None else None
    records, tasks = [], []

    def clock() -> float:
        return time.monotonic() - start

    async with httpx.AsyncClient(base_url=config.base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(config.timeout, connect=min(config.timeout, 30.0))) as client:
        if clock() < 0:
            await asyncio.sleep(-clock())
        for index, arrival, prompt in items:
            if arrival > clock():
                await asyncio.sleep(arrival - clock())
            if slots is not None:
                await slots.acquire()
            prompt = Prompt(**prompt)
            record = RequestRecord(index, prompt.max_tokens, prompt.num_tokens)
            records.append(record)
            task = asyncio.create_task(_send(client, config, model, prompt, record, clock))
            if slots is not None:
                task.add_done_callback(lambda _: slots.release())
            tasks.append(task)
        await asyncio.gather(*tasks)
    return records


def run(config: ServeBenchConfig, progress: Optional[Progress] = None,
        transport: Optional[httpx.AsyncBaseTransport] = None) -> BenchResult:
    """Run the benchmark against ``config.url``; raises BenchError on bad input or an unusable server."""
    return asyncio.run(_run(config, progress, transport))


# --- rate sweep ------------------------------------------------------------------------------------------
def sweep_rates(rates: list[float]) -> list[float]:
    """The rates of a sweep, checked and in increasing order (the order they run in)."""
    for rate in rates:
        if not (rate > 0 and math.isfinite(rate)):
            raise BenchError(f"--request-rate must be a positive number of requests/s, got {rate}")
    repeated = sorted({r for r in rates if rates.count(r) > 1})
    if repeated:
        raise BenchError(f"--request-rate {', '.join(format(r, 'g') for r in repeated)} is given twice")
    return sorted(rates)


def meets_slos(summary: dict[str, Any], slos_ms: dict[str, float]) -> Optional[bool]:
    """Whether one run meets the SLOs at p99 (module docstring); None without SLOs."""
    if not slos_ms:
        return None
    if not summary["completed"] or summary["failed"]:
        return False
    p99 = {name: summary[f"{name}_ms"]["p99"] for name in slos_ms}
    return all(p99[name] is None or p99[name] <= bound for name, bound in slos_ms.items())


def sweep_point(summary: dict[str, Any], slos_ms: dict[str, float]) -> dict[str, Any]:
    """One rate's line of the sweep summary, from its "bench_serve" object."""
    goodput = summary["goodput"] or {}
    return {"request_rate": summary["config"]["request_rate"], "num_requests": summary["num_requests"],
            "completed": summary["completed"], "failed": sum(summary["failed"].values()),
            "request_throughput": summary["request_throughput"],
            "output_token_throughput": summary["output_token_throughput"],
            "ttft_p99_ms": summary["ttft_ms"]["p99"], "tpot_p99_ms": summary["tpot_ms"]["p99"],
            "e2e_p99_ms": summary["e2e_ms"]["p99"], "goodput_request_throughput": goodput.get("request_throughput"),
            "goodput_fraction": goodput.get("fraction"), "meets_slos": meets_slos(summary, slos_ms)}


@dataclass
class SweepResult:
    results: list[BenchResult]  # one per rate, in increasing rate order

    def summary(self) -> dict[str, Any]:
        """The "bench_serve_sweep" JSON object (schema in the module docstring)."""
        runs = [r.summary() for r in self.results]
        first = runs[0]
        slos_ms = parse_slos(self.results[0].config.slos)
        points = [sweep_point(s, slos_ms) for s in runs]
        met = [p["request_rate"] for p in points if p["meets_slos"]]
        return {"kind": "bench_serve_sweep", "version": 1, "url": first["url"], "model": first["model"],
                "endpoint": first["endpoint"], "started_at": first["started_at"], "slos_ms": slos_ms,
                "rates": [p["request_rate"] for p in points], "goodput_rate": max(met) if met else None,
                "points": points, "runs": runs}


def run_sweep(config: ServeBenchConfig, rates: list[float], progress: Optional[Progress] = None,
              transport: Optional[httpx.AsyncBaseTransport] = None) -> SweepResult:
    """One run per request rate, in increasing order, with ``config``'s other settings (module docstring)."""
    results = []
    for rate in sweep_rates(rates):
        def progress_at(task: str, done: int, total: Optional[int], rate: float = rate) -> None:
            progress(f"{task} at {rate:g} req/s", done, total)

        results.append(run(dataclasses.replace(config, request_rate=rate),
                           progress_at if progress is not None else None, transport))
    return SweepResult(results)


# --- metrics ---------------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """The q-th percentile, interpolating linearly between order statistics (numpy's default)."""
    assert values, "percentile of no values"
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def stats(values: list[float]) -> dict[str, Optional[float]]:
    """mean, p50, p90, p95, p99 of ``values``; all None when there are none."""
    if not values:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    return {"mean": sum(values) / len(values), **{f"p{q}": percentile(values, q) for q in PERCENTILES}}


def request_latencies_ms(r: RequestRecord) -> dict[str, Optional[float]]:
    """TTFT, TPOT and E2E of one completed request, in ms (TPOT None for a single output token)."""
    ttft = (r.chunk_s[0] - r.send_s) * 1e3
    e2e = (r.end_s - r.send_s) * 1e3
    tpot = (e2e - ttft) / (r.num_output_tokens - 1) if r.num_output_tokens > 1 else None
    return {"ttft": ttft, "tpot": tpot, "e2e": e2e}


def summarize(records: list[RequestRecord], duration_s: float, slos_ms: dict[str, float]) -> dict[str, Any]:
    """Counts, throughputs, latency statistics and goodput of a run (failed requests only counted)."""
    done = [r for r in records if r.ok]
    failed: dict[str, int] = {}
    for r in records:
        if not r.ok:
            failed[r.error] = failed.get(r.error, 0) + 1
    per_request = [request_latencies_ms(r) for r in done]
    itl = [(b - a) * 1e3 for r in done for a, b in zip(r.chunk_s, r.chunk_s[1:])]
    num_in = sum(r.num_prompt_tokens or 0 for r in done)
    num_out = sum(r.num_output_tokens for r in done)
    rate = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    goodput = None
    if slos_ms:
        num_good = sum(all(m[name] is None or m[name] <= bound for name, bound in slos_ms.items())
                       for m in per_request)
        goodput = {"slos_ms": dict(slos_ms), "request_throughput": rate(num_good),
                   "fraction": num_good / len(records) if records else 0.0}
    return {
        "duration_s": duration_s, "num_requests": len(records), "completed": len(done), "failed": failed,
        "request_throughput": rate(len(done)), "output_token_throughput": rate(num_out),
        "total_token_throughput": rate(num_in + num_out), "total_input_tokens": num_in,
        "total_output_tokens": num_out,
        "ttft_ms": stats([m["ttft"] for m in per_request]),
        "tpot_ms": stats([m["tpot"] for m in per_request if m["tpot"] is not None]),
        "itl_ms": stats(itl), "e2e_ms": stats([m["e2e"] for m in per_request]),
        "goodput": goodput,
    }


# --- output ----------------------------------------------------------------------------------------------
def write_json(summary: dict[str, Any], path: str | Path) -> None:
    try:
        Path(path).write_text(json.dumps(summary, indent=1) + "\n")
    except OSError as e:
        raise BenchError(f"--json {path}: cannot write it: {e}") from None


def print_report(result: BenchResult, summary: dict[str, Any]) -> None:
    """The run as rich tables on stdout, with the first message of each failure kind."""
    from rich.console import Console
    from rich.table import Table

    s = summary
    head = Table(title=f"{s['model']} at {s['url']}{ENDPOINTS[s['endpoint']]}", show_header=False,
                 title_justify="left")
    head.add_column(style="bold")
    head.add_column()
    failed = ", ".join(f"{k} {v}" for k, v in sorted(s["failed"].items())) or "0"
    head.add_row("requests", f"{s['num_requests']} sent, {s['completed']} completed, failed: {failed}")
    head.add_row("duration", f"{s['duration_s']:.2f} s")
    head.add_row("throughput", f"{s['request_throughput']:.2f} req/s, {s['output_token_throughput']:.1f} output "
                 f"tok/s, {s['total_token_throughput']:.1f} total tok/s")
    head.add_row("tokens", f"{s['total_input_tokens']} input, {s['total_output_tokens']} output")
    if "realized_lengths" in s["config"]:
        head.add_row("lengths", _lengths_text(s["config"]))
    if s["goodput"] is not None:
        g = s["goodput"]
        bounds = ", ".join(f"{k} <= {v:g} ms" for k, v in g["slos_ms"].items())
        head.add_row("goodput", f"{g['request_throughput']:.2f} req/s, {g['fraction']:.1%} of requests ({bounds})")
    table = Table(title="latency (ms)", title_justify="left")
    table.add_column("metric")
    for column in ("mean", *(f"p{q}" for q in PERCENTILES)):
        table.add_column(column, justify="right")
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")):
        table.add_row(name, *("-" if v is None else f"{v:.2f}" for v in s[key].values()))
    console = Console()
    console.print(head)
    console.print(table)
    _print_failures(console, result.records)


def _print_failures(console, records: list[RequestRecord], prefix: str = "") -> None:
    """The first message of each failure kind."""
    from rich.text import Text

    seen = set()
    for r in records:
        if not r.ok and r.error not in seen:
            seen.add(r.error)
            console.print(Text.assemble(prefix, (r.error, "red"), f": {r.message}"))


def _lengths_text(config: dict[str, Any]) -> str:
    """A run's realized lengths in a line: ``sharegpt: input mean 264 / p50 160 / p90 577, output ... tokens``."""
    parts = []
    for side, st in config["realized_lengths"].items():
        figures = " / ".join(f"{k} {_maybe(v, '.0f')}" for k, v in st.items())
        parts.append(f"{side} {figures}")
    return f"{config['length_dist']}: {', '.join(parts)} tokens"


def _maybe(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_sweep_report(sweep: SweepResult, summary: dict[str, Any]) -> None:
    """The sweep as one rich table on stdout (a line per rate), the goodput rate, and failures per rate."""
    from rich.console import Console
    from rich.table import Table

    s = summary
    slos = ", ".join(f"p99 {k.upper()} <= {v:g} ms" for k, v in s["slos_ms"].items())
    table = Table(title=f"{s['model']} at {s['url']}{ENDPOINTS[s['endpoint']]}: request rate sweep"
                  + (f" ({slos})" if slos else ""), title_justify="left")
    for column in ("rate req/s", "completed / sent", "failed", "throughput req/s", "output tok/s",
                   "TTFT p50 / p99 ms", "TPOT p50 / p99 ms", "goodput req/s", "goodput fraction", "meets SLOs"):
        table.add_column(column, justify="right")
    for point, run_summary in zip(s["points"], s["runs"]):
        ttft, tpot = run_summary["ttft_ms"], run_summary["tpot_ms"]
        meets = {None: "-", True: "yes", False: "no"}[point["meets_slos"]]
        table.add_row(f"{point['request_rate']:g}", f"{point['completed']} / {point['num_requests']}",
                      str(point["failed"]), f"{point['request_throughput']:.2f}",
                      f"{point['output_token_throughput']:.1f}",
                      *(f"{_maybe(m['p50'], '.1f')} / {_maybe(m['p99'], '.1f')}" for m in (ttft, tpot)),
                      _maybe(point["goodput_request_throughput"], ".2f"), _maybe(point["goodput_fraction"], ".1%"),
                      meets)
    console = Console()
    console.print(table)
    config = s["runs"][0]["config"]
    if "realized_lengths" in config:
        console.print(f"lengths ({s['runs'][0]['num_requests']} requests at {s['rates'][0]:g} req/s) "
                      + _lengths_text(config))
    if s["slos_ms"]:
        rate = s["goodput_rate"]
        console.print(f"goodput rate: {'none of the rates' if rate is None else f'{rate:g} req/s'} (the highest "
                      f"rate at which no request failed and {slos})")
    for result in sweep.results:
        _print_failures(console, result.records, f"at {result.config.request_rate:g} req/s: ")
