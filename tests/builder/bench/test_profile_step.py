"""``builder.bench.profile_step`` on the CPU (a dry run of its phases: no GPU time there): the prefill phase is a
whole fresh wave's prefill-bearing steps, not the first step call, and the decode phase then runs that wave."""

from __future__ import annotations

import json

from builder.bench import profile_step


def test_phases_profile_the_prefill_bearing_steps_then_decode(artifacts, capsys):
    rows = profile_step.main([str(artifacts["llama"]), "--device", "cpu", "--concurrency", "3", "--input-len", "40",
                              "--output-len", "6", "--steps", "2", "--top", "3"])
    prefill, decode = rows
    # 3 x 40 prompt tokens in steps of at most the artifact's 64 tokens: two prefill-bearing steps at least
    assert prefill["phase"] == "prefill-bearing steps, 3 x 40 tokens" and prefill["steps"] >= 2
    assert decode["phase"] == "decode, batch 3" and decode["steps"] == 2
    assert prefill["gpu_kernel_ms_per_step"] == 0 and prefill["wall_ms_per_step"] > 0  # no CUDA on the CPU
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert printed[-1] == {"prefill_steps": prefill["steps"]}


def test_busy_time_is_the_union_of_the_spans():
    """PDL kernels start under their predecessor: overlapping spans count once, gaps not at all."""
    assert profile_step.busy_us([(0.0, 10.0), (4.0, 12.0), (20.0, 25.0), (21.0, 22.0)]) == 17.0
    assert profile_step.busy_us([]) == 0.0
