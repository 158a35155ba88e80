"""The server's Prometheus metrics, each app in a registry of its own.

Latencies are measured in the server, per request, from its arrival at the HTTP handler:

    arrival ──prefill──> first token delta ──> delta ──> ... ──> last delta
    |<------ TTFT ------>|<-- ITL -->|                              |
    |<------------------------ end-to-end latency ----------------->|

A delta carrying k tokens after a gap of t seconds counts as k inter-token latencies of t / k. Tokens
that arrive together with the first one add no inter-token latency.

Engine state (running and waiting requests, KV cache usage, prefix-cache hit rate, preemptions, speculative
draft tokens proposed and accepted) is read from ``engine.stats()`` when /metrics is scraped, so it is never
stale and costs nothing per step.

With several server processes (``builder serve --api-servers N``) each process records its own requests into
prometheus_client's multiprocess files (``PROMETHEUS_MULTIPROC_DIR``, which must be set before prometheus_client is
imported: ``runtime.api_servers`` does) and a scrape of any of them sums every process's: ``ServerMetrics(...,
multiprocess=True)``.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from runtime.outputs import EngineStats, RequestOutput

# How a request to a generation route ended: the engine's finish reasons, then the server's refusals.
OUTCOMES = ("stop", "length", "abort", "timeout", "error", "rejected", "invalid")  # rejected: 429; invalid: other 4xx

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0)


class _EngineCollector:
    """Gauges and counters read from the engine's stats at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield GaugeMetricFamily("llm_num_requests_running", "Requests in the running batch.", value=s.num_running)
        yield GaugeMetricFamily("llm_num_requests_waiting", "Admitted requests waiting to run (preempted included).",
                                value=s.num_waiting)
        yield GaugeMetricFamily("llm_kv_cache_usage_perc", "KV cache blocks in use, percent.", value=100.0 * s.kv_usage)
        yield GaugeMetricFamily("llm_kv_cache_num_blocks", "KV cache blocks in the pool.", value=s.num_blocks)
        yield GaugeMetricFamily("llm_prefix_cache_hit_rate",
                                "Prompt tokens found in the prefix cache / prompt tokens looked up, since start.",
                                value=s.prefix_cache_hit_rate)
        yield CounterMetricFamily("llm_num_preemptions", "Requests preempted (blocks freed, recomputed later).",
                                  value=s.num_preemptions)
        yield CounterMetricFamily("llm_engine_steps", "Engine steps that ran the model.", value=s.num_steps)
        yield CounterMetricFamily("llm_spec_verify_steps", "Engine steps that verified speculative draft tokens.",
                                  value=s.spec_num_steps)
        yield CounterMetricFamily("llm_spec_verified_decodes",
                                  "Decodes verified with draft tokens (one request in one step).",
                                  value=s.spec_num_verified)
        yield CounterMetricFamily("llm_spec_draft_tokens", "Speculative draft tokens proposed and verified.",
                                  value=s.spec_num_draft_tokens)
        yield CounterMetricFamily("llm_spec_accepted_tokens", "Speculative draft tokens accepted.",
                                  value=s.spec_num_accepted_tokens)
        yield GaugeMetricFamily("llm_spec_acceptance_rate", "Accepted / proposed draft tokens, since start.",
                                value=s.spec_acceptance_rate)
        yield GaugeMetricFamily("llm_spec_mean_accepted_tokens",
                                "Accepted draft tokens per verified decode, since start (emitted tokens: this + 1).",
                                value=s.spec_mean_accepted_tokens)
        yield GaugeMetricFamily("llm_spec_measured_gain",
                                "Decode tokens per second with drafts over without, at the batch size last timed "
                                "(0 until both are measured).", value=s.spec_measured_gain)
        yield GaugeMetricFamily("llm_spec_drafting",
                                "1 while speculation runs at the batch size last timed, 0 where the rate check "
                                "turned it off (or speculation is off).", value=s.spec_drafting)


class _WeightedHistogram:
    """A histogram whose observations carry a count: a delta of k tokens after a gap t is one call, ``observe(t / k,
    k)``, where prometheus_client's Histogram takes k calls, each behind its lock (the ITL's per-token updates were the
    largest metrics cost in the server's profile). Exported as a standard histogram (``_bucket``, ``_count``,
    ``_sum``). Updated and collected on the server's event loop only (no lock)."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self.total = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.total += value * count

    def collect(self) -> Iterator[Metric]:
        cumulative, buckets = 0, []
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts):
            cumulative += count
            buckets.append((bound, cumulative))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=self.total)


class _RepeatedHistogram:
    """``_WeightedHistogram``'s interface over prometheus_client's Histogram, observed ``count`` times: the form the
    multiprocess files hold (a delta's k tokens are k observations, as before that class)."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]) -> None:
        self.histogram = Histogram(name, documentation, buckets=buckets, registry=None)

    def observe(self, value: float, count: int = 1) -> None:
        for _ in range(count):
            self.histogram.observe(value)


class ServerMetrics:
    """The metrics of one server app; ``render`` is what /metrics returns. ``multiprocess``: this app is one of
    several server processes, whose requests' metrics a scrape sums (module docstring)."""

    def __init__(self, stats: Callable[[], EngineStats], multiprocess: bool = False) -> None:
        self.registry = CollectorRegistry()
        if multiprocess:
            from prometheus_client import multiprocess as mp_metrics
            from prometheus_client import values

            if values.ValueClass is values.MutexValue:  # metrics would stay in this process, unseen by the others
                raise RuntimeError("multiprocess metrics need PROMETHEUS_MULTIPROC_DIR set before prometheus_client "
                                   "is imported (runtime.api_servers sets it)")
            mp_metrics.MultiProcessCollector(self.registry)
            r = None  # the metrics live in the files; the collector reads every process's
            self.itl = _RepeatedHistogram("llm_inter_token_latency_seconds",
                                          "Time between generated tokens, per token.", ITL_BUCKETS)
        else:
            r = self.registry
            self.itl = _WeightedHistogram("llm_inter_token_latency_seconds",
                                          "Time between generated tokens, per token.", ITL_BUCKETS)
            r.register(self.itl)
        self.ttft = Histogram("llm_time_to_first_token_seconds", "Request arrival to its first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("llm_e2e_request_latency_seconds", "Request arrival to its last token or error.",
                             buckets=E2E_BUCKETS, registry=r)
        self.requests = Counter("llm_requests", "Requests to the generation routes, by how they ended.",
                                ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # every outcome is exported from the start, at 0
        self.prompt_tokens = Counter("llm_prompt_tokens", "Prompt tokens of requests that ran.", registry=r)
        self.generation_tokens = Counter("llm_generation_tokens", "Generated tokens.", registry=r)
        self.registry.register(_EngineCollector(stats))

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def refused(self, outcome: str) -> None:
        """Count a request refused before it reached the engine ("rejected" or "invalid")."""
        assert outcome in ("rejected", "invalid"), outcome
        self.requests.labels(outcome).inc()

    def track(self, arrival_time: float) -> RequestTracker:
        return RequestTracker(self, arrival_time)


FLUSH_TOKENS = 16  # RequestTracker: tokens recorded before they reach the shared metrics (and at finish)


class RequestTracker:
    """Latencies and token counts of one request admitted to the engine; ``finish`` exactly once."""

    def __init__(self, metrics: ServerMetrics, arrival_time: float) -> None:
        self.metrics = metrics
        self.arrival_time = arrival_time  # time.monotonic() when the handler got the request
        self.last_token_time: float | None = None
        self.num_prompt_tokens = 0
        self.finished = False
        self.unflushed_tokens = 0  # generated tokens not yet in the shared counter

    def delta(self, out: RequestOutput, now: float | None = None) -> None:
        """Record one delta from the engine: its inter-token latencies as one weighted observation, its tokens in
        the shared counter every FLUSH_TOKENS tokens and at ``finish`` (each update of a Prometheus counter takes
        its lock: per delta they were a tenth of a streamed token's CPU in the server)."""
        now = time.monotonic() if now is None else now
        self.num_prompt_tokens = out.num_prompt_tokens
        num_tokens = len(out.token_ids)
        if num_tokens == 0:
            return
        self.unflushed_tokens += num_tokens
        if self.last_token_time is None:
            self.metrics.ttft.observe(now - self.arrival_time)
        else:
            self.metrics.itl.observe((now - self.last_token_time) / num_tokens, num_tokens)
        self.last_token_time = now
        if self.unflushed_tokens >= FLUSH_TOKENS:
            self.flush()

    def flush(self) -> None:
        """The tokens recorded since the last flush into the shared counter."""
        if self.unflushed_tokens:
            self.metrics.generation_tokens.inc(self.unflushed_tokens)
            self.unflushed_tokens = 0

    def finish(self, outcome: str, now: float | None = None) -> None:
        """Record how the request ended (a finish reason of OUTCOMES); later calls are ignored."""
        if self.finished:
            return
        assert outcome in OUTCOMES, outcome
        self.finished = True
        self.flush()
        now = time.monotonic() if now is None else now
        m = self.metrics
        m.e2e.observe(now - self.arrival_time)
        m.requests.labels(outcome).inc()
        m.prompt_tokens.inc(self.num_prompt_tokens)
