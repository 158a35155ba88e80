"""Where a verify step's time goes at batch 1: the host's stages, the GPU's kernels, and the wall time between tokens.

    python -m builder.bench.verify_profile ARTIFACT [--num-draft 0 4 ...] [--input-len 128] [--output-len 64]
        [--device cuda] [--top 12]

For each K (0: plain decoding), one request of ``--input-len`` random tokens decodes ``--output-len`` tokens greedily
with K drafts a step that the target rejects (the request's last token repeated: a verify step of fixed size, as
``builder.bench.speculative --verify-cost`` measures its cost). Printed per step, over the steady steps (from the
fifth token to the one before the last; the prompt's step and the first ones left out): the wall time between two
steps' tokens (median); the mean host time of each stage of ``ServingEngine``, waits for the device
included (proposal, scheduling, the launch with its packing and input copies, the verification, which waits for the
step and holds the sampling and the recording, timed again on their own); and the GPU's kernel time (a second run of
the request under ``torch.profiler``, CUDA activity only: the sum of kernel durations, and the busy time, their
union, which PDL's overlap makes shorter than the sum), with the kernels that take the most. Wall minus busy is what
the host adds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

STAGES = ("_propose", "_run", "_verify", "_sample", "_record", "_launch_next", "_complete")


def _instrument(engine) -> dict[str, list[float]]:
    """Wrap the engine's stages (and its scheduler's ``schedule``) with host timers; returns their totals per call."""
    totals: dict[str, list[float]] = defaultdict(list)

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[name].append(time.perf_counter() - t0)
        return wrapper

    for name in STAGES:
        if hasattr(engine, name):
            setattr(engine, name, timed(name, getattr(engine, name)))
    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)
    return totals


def _busy(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def profile(path: str, device: str, k: int, prompt: list[int], output_len: int, top: int) -> dict:
    from builder.bench.speculative import _close, _load, _RepeatProposer
    from runtime import SamplingParams
    from runtime.speculative import SpeculativeConfig

    spec = None if k == 0 else SpeculativeConfig(method="ngram", num_speculative_tokens=k, adaptive=False,
                                                 min_acceptance=0.0)
    engine = _load(path, device, spec)
    if k:
        engine.proposer = _RepeatProposer()
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.add_request(prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))  # warm up
    while engine.has_unfinished:
        engine.step()
    # pass 1: the host's stages timed, no profiler (its tracing of every op would slow the host down); each stage's
    # time summed at every step that produced tokens, so that the steady steps' share can be taken apart
    totals = _instrument(engine)
    ends, marks = [], []
    engine.add_request(prompt, params)
    while engine.has_unfinished:
        if engine.step():
            ends.append(time.perf_counter())
            marks.append({name: sum(v) for name, v in totals.items()})
    steps = max(len(ends), 1)
    gaps = [b - a for a, b in zip(ends, ends[1:])][3:-1]
    steady = max(len(gaps), 1)  # the steps between token 4 and the last (the prompt's and the first ones left out)
    first, last = (marks[3], marks[-2]) if len(marks) > 4 else ({}, marks[-1] if marks else {})
    host = {name: 1e3 * (last.get(name, 0.0) - first.get(name, 0.0)) / steady for name in last}
    # pass 2: the same request under the profiler (CUDA activity only), over the same steady steps
    cuda = torch.device(device).type == "cuda"
    kernels, profiled = [], 0
    if cuda:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        engine.add_request(prompt, params)
        produced, on = 0, False
        while engine.has_unfinished:
            if not on and produced == 4 and produced < len(ends) - 1:
                prof.start()
                on = True
            if engine.step():
                produced += 1
                profiled += on
                if on and produced == len(ends) - 1:
                    torch.cuda.synchronize()
                    prof.stop()
                    on = False
        if on:
            prof.stop()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA] if profiled else []
    per_step = max(profiled, 1)
    by_name: dict[str, float] = defaultdict(float)
    for e in kernels:
        by_name[e.name] += e.device_time_total
    out = {
        "k": k, "steps": steps,
        "wall_ms": 1e3 * statistics.median(gaps) if gaps else float("nan"),
        "host_ms": host,
        "kernel_ms": sum(by_name.values()) / 1e3 / per_step,
        "busy_ms": _busy([(e.time_range.start, e.time_range.end) for e in kernels]) / 1e3 / per_step,
        "kernels_per_step": len(kernels) / per_step,
        "top": sorted(((v / 1e3 / per_step, n) for n, v in by_name.items()), reverse=True)[:top],
    }
    _close(engine)
    return out


def main(argv: list[str] | None = None) -> int:
    from pathlib import Path

    from builder.bench.offline import _random_prompts
    from runtime.artifact import read_manifest

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--num-draft", type=int, nargs="+", default=[0, 4])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--device", default="cuda")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args(argv)
    vocab = read_manifest(Path(args.artifact))["model"]["vocab_size"]
    prompt = _random_prompts(1, args.input_len, vocab, seed=0)[0]
    for k in args.num_draft:
        r = profile(args.artifact, args.device, k, prompt, args.output_len, args.top)
        host = ", ".join(f"{name} {ms:.3f}" for name, ms in sorted(r["host_ms"].items(), key=lambda x: -x[1]))
        print(f"K = {k}: wall {r['wall_ms']:.3f} ms a step; GPU busy {r['busy_ms']:.3f} ms (kernels' sum "
              f"{r['kernel_ms']:.3f}, {r['kernels_per_step']:.0f} kernels); host per step (ms): {host}")
        for ms, name in r["top"]:
            print(f"    {ms:8.4f} ms  {name[:110]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
