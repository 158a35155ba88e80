"""Server metrics: per-request latencies and counts, engine gauges read at scrape time, one registry per app."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime.metrics import OUTCOMES, ServerMetrics
from runtime.outputs import EngineStats, RequestOutput


def _stats(**overrides) -> EngineStats:
    values = {"num_running": 3, "num_waiting": 2, "kv_usage": 0.25, "num_blocks": 64, "num_free_blocks": 48,
              "prefix_cache_queries": 40, "prefix_cache_hits": 10, "num_preemptions": 5, "num_steps": 7}
    return EngineStats(**{**values, **overrides})


def _samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def _delta(num_tokens: int, finished: bool = False, reason: str | None = None) -> RequestOutput:
    return RequestOutput("r", "x" * num_tokens, list(range(num_tokens)), None, finished, reason, 11, 0)


def test_tracker_measures_ttft_itl_per_token_and_e2e():
    metrics = ServerMetrics(_stats)
    tracker = metrics.track(arrival_time=100.0)
    tracker.delta(_delta(1), now=100.5)  # first token after 0.5 s
    tracker.delta(_delta(3), now=101.1)  # three tokens 0.6 s later: three gaps of 0.2 s
    tracker.delta(_delta(0, True, "stop"), now=101.2)  # a final delta without tokens adds no gap
    tracker.finish("stop", now=101.2)
    tracker.finish("abort", now=102.0)  # later calls are ignored
    s = _samples(metrics)
    assert s[("llm_time_to_first_token_seconds_count", ())] == 1
    assert s[("llm_time_to_first_token_seconds_sum", ())] == pytest.approx(0.5)
    assert s[("llm_inter_token_latency_seconds_count", ())] == 3
    assert s[("llm_inter_token_latency_seconds_sum", ())] == pytest.approx(0.6)
    assert s[("llm_inter_token_latency_seconds_bucket", (("le", "0.2"),))] == 3
    assert s[("llm_inter_token_latency_seconds_bucket", (("le", "0.15"),))] == 0
    assert s[("llm_e2e_request_latency_seconds_sum", ())] == pytest.approx(1.2)
    assert s[("llm_generation_tokens_total", ())] == 4 and s[("llm_prompt_tokens_total", ())] == 11
    assert {o: s[("llm_requests_total", (("outcome", o),))] for o in OUTCOMES} == {
        o: float(o == "stop") for o in OUTCOMES}


def test_refusals_and_engine_gauges():
    stats = _stats()
    metrics = ServerMetrics(lambda: stats)
    metrics.refused("rejected")
    metrics.refused("invalid")
    metrics.refused("invalid")
    s = _samples(metrics)
    assert s[("llm_requests_total", (("outcome", "rejected"),))] == 1
    assert s[("llm_requests_total", (("outcome", "invalid"),))] == 2
    assert s[("llm_e2e_request_latency_seconds_count", ())] == 0  # refusals never reached the engine
    assert (s[("llm_num_requests_running", ())], s[("llm_num_requests_waiting", ())]) == (3, 2)
    assert s[("llm_kv_cache_usage_perc", ())] == 25.0 and s[("llm_kv_cache_num_blocks", ())] == 64
    assert s[("llm_prefix_cache_hit_rate", ())] == 0.25
    assert s[("llm_num_preemptions_total", ())] == 5 and s[("llm_engine_steps_total", ())] == 7
    stats.num_preemptions, stats.kv_usage = 6, 0.5  # read at scrape time, not at registration
    s = _samples(metrics)
    assert s[("llm_num_preemptions_total", ())] == 6 and s[("llm_kv_cache_usage_perc", ())] == 50.0


def test_apps_have_registries_of_their_own():
    a, b = ServerMetrics(_stats), ServerMetrics(lambda: _stats(num_running=9))
    a.refused("invalid")
    assert _samples(a)[("llm_requests_total", (("outcome", "invalid"),))] == 1
    assert _samples(b)[("llm_requests_total", (("outcome", "invalid"),))] == 0
    assert _samples(b)[("llm_num_requests_running", ())] == 9


def test_a_long_stream_reaches_the_metrics_every_flush_tokens_and_at_finish():
    from runtime.metrics import FLUSH_TOKENS

    metrics = ServerMetrics(_stats)
    tracker = metrics.track(arrival_time=0.0)
    for i in range(FLUSH_TOKENS + 4):
        tracker.delta(_delta(1), now=1.0 + 0.01 * i)
    s = _samples(metrics)
    assert s[("llm_generation_tokens_total", ())] == FLUSH_TOKENS  # the first FLUSH_TOKENS, while it runs
    assert s[("llm_inter_token_latency_seconds_count", ())] == FLUSH_TOKENS + 3  # latencies at once
    tracker.finish("length", now=2.0)
    s = _samples(metrics)
    assert s[("llm_generation_tokens_total", ())] == FLUSH_TOKENS + 4
    assert s[("llm_inter_token_latency_seconds_count", ())] == FLUSH_TOKENS + 3
    assert s[("llm_inter_token_latency_seconds_sum", ())] == pytest.approx(0.01 * (FLUSH_TOKENS + 3))


def test_the_latency_histogram_exports_what_prometheus_client_would():
    """The ITL histogram takes a delta of k tokens as one observation of weight k; its exposition equals
    prometheus_client's Histogram fed the same k values one by one (buckets cumulative, +Inf, count, sum)."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from runtime.metrics import ITL_BUCKETS, _WeightedHistogram

    ours = _WeightedHistogram("x_seconds", "doc", ITL_BUCKETS)
    registry = CollectorRegistry()
    registry.register(ours)
    theirs_registry = CollectorRegistry()
    theirs = Histogram("x_seconds", "doc", buckets=ITL_BUCKETS, registry=theirs_registry)
    for value, k in ((0.0005, 1), (0.02, 3), (0.0025, 2), (7.0, 1), (0.3, 5), (0.015, 1)):
        ours.observe(value, k)
        for _ in range(k):
            theirs.observe(value)

    def lines(reg):
        return sorted(line for line in generate_latest(reg).decode().splitlines()
                      if line.startswith("x_seconds_") and "_created" not in line)
    assert lines(registry) == lines(theirs_registry)
