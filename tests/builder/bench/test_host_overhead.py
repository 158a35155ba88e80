"""``builder.bench.host_overhead``: the serving engine's own host work per step, the model stubbed out, on the
overlapped path the decode graphs take on a GPU (a step launched before the one in flight is read back)."""
from __future__ import annotations

from builder.bench import host_overhead


def test_host_overhead_runs_the_overlapped_path(artifacts, monkeypatch):
    fills = []
    real = host_overhead._StubGraphs.run

    def counted(self, *args):
        fills.append(len(args[1]))
        return real(self, *args)

    monkeypatch.setattr(host_overhead._StubGraphs, "run", counted)
    ms, steps, prof = host_overhead.host_ms_per_step(str(artifacts["llama"]), sequences=6, prompt_len=5,
                                                     output_len=7)
    assert ms > 0 and prof is None
    assert steps >= 7  # a prefill, then one step per further token
    assert fills and max(fills) == 6  # decode steps of all six sequences went through the stubbed graphs
