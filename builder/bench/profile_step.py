"""Where a serving step's time goes: torch.profiler over steady-state steps of a throughput run.

    python -m builder.bench.profile_step artifacts/llama3-8b-fp8 --concurrency 64 --input-len 128 [--steps 20]

Two phases, after a warm-up wave: the prefill-bearing steps of a fresh wave of ``concurrency`` random prompts (until
every request has its first token), then ``--steps`` decode steps of that wave. The engine launches a step before it
reads the last one's tokens, so a step's kernels do not run inside its own ``step()`` call: each phase is profiled
whole (the prefill phase's GPU time includes the decode step its last call launched). Prints, per phase: wall time
per step (unprofiled: the prefill phase of another fresh wave, dropped after it, its abort included; the profiler's
tracing inflates host time), GPU time per step (the union of the kernels' spans in the profiled steps; with PDL a
kernel starts under its predecessor and waits inside, so the per-kernel durations in the tables include that wait,
and their sum, ``gpu_kernel_sum_ms_per_step``, can exceed the wall time), the
host share (1 − GPU / wall), host time per stage (scheduling, graph launch, eager packing, detokenize and
emit; the rest of a step is sampling and the wait for the GPU), and the top kernels and host functions. This
is the evidence behind the "where the time goes" notes in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from builder.bench.offline import _random_prompts, load_for_bench
from runtime import SamplingParams


class _HostTimers:
    """Wall time spent in the engine's host-side stages during unprofiled steps (wrapped instance methods)."""

    STAGES = (("schedule", "scheduler", "schedule"), ("launch_graph", None, "_replay"),
              ("prepare_eager", None, "_prepare"), ("emit", None, "_emit"))

    def __init__(self, engine) -> None:
        self.totals = {name: 0.0 for name, _, _ in self.STAGES}
        self._undo = []
        for name, owner, attr in self.STAGES:
            obj = getattr(engine, owner) if owner else engine
            fn = getattr(obj, attr)
            self._undo.append((obj, attr))
            setattr(obj, attr, self._wrap(name, fn))

    def _wrap(self, name, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[name] += time.perf_counter() - t0
        return timed

    def remove(self) -> None:
        for obj, attr in self._undo:
            delattr(obj, attr)  # back to the class's method


def _steps(engine, num_steps: int) -> int:
    steps = 0
    while steps < num_steps and engine.has_unfinished:
        engine.step()
        steps += 1
    return steps


def _prefill_steps(engine) -> int:
    """Steps until every request has its first token (the prefill-bearing steps of a wave)."""
    steps = 0
    while any(not r.output_token_ids for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
        steps += 1
    return steps


def busy_us(spans: list[tuple[float, float]]) -> float:
    """The time covered by the union of the (start, end) spans: the GPU's busy time. Kernels launched with PDL
    (``kernels.pdl``) start while their predecessor still runs and wait for it inside, so their durations overlap
    and their sum (``gpu_kernel_sum_ms_per_step``) exceeds the time the GPU was busy."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def _sync(engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def _profile(engine, plain_run, profiled_run, label: str, top: int) -> dict:
    """``plain_run()`` without the profiler (its tracing inflates host time: wall per step and where the host spends
    it), then ``profiled_run()`` under it (GPU kernel time per step, top kernels); each runs steps and returns how
    many."""
    timers = _HostTimers(engine)
    _sync(engine)
    t0 = time.perf_counter()
    plain_steps = plain_run()
    _sync(engine)
    plain_wall = time.perf_counter() - t0
    timers.remove()
    _sync(engine)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        steps = profiled_run()
        _sync(engine)
        wall = time.perf_counter() - t0
    device = [evt for evt in prof.events() if evt.device_type == torch.autograd.DeviceType.CUDA]
    row = {"phase": label, "steps": steps, "wall_ms_per_step": 1e3 * plain_wall / max(plain_steps, 1),
           "profiled_wall_ms_per_step": 1e3 * wall / max(steps, 1),
           "gpu_kernel_ms_per_step": busy_us([(e.time_range.start, e.time_range.end) for e in device])
           / 1e3 / max(steps, 1),
           "gpu_kernel_sum_ms_per_step": sum(e.device_time for e in device) / 1e3 / max(steps, 1)}
    row["host_share"] = 1 - row["gpu_kernel_ms_per_step"] / row["wall_ms_per_step"]
    row.update({f"host_{k}_ms_per_step": 1e3 * v / max(plain_steps, 1) for k, v in timers.totals.items()})
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (no GPU time: a dry run)")
    args = parser.parse_args(argv)
    engine = load_for_bench(args.artifact, args.device, max_num_seqs=args.concurrency, max_seq_len=None,
                            max_num_batched_tokens=None, cuda_graphs=not args.no_cuda_graphs)
    vocab = int(engine.executor.graph["meta"]["vocab_size"])
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    # warm-up wave (Triton compiles, graph capture), then a fresh wave to profile
    warmup = _random_prompts(args.concurrency, args.input_len, vocab, 1)
    engine.run(warmup, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.kv.pool.reset_prefix_cache()

    def wave(seed: int, tag: str) -> None:
        for i, prompt in enumerate(_random_prompts(args.concurrency, args.input_len, vocab, seed)):
            engine.add_request(prompt, params, request_id=f"{tag}{i}")

    def plain_prefill() -> int:  # a fresh wave's prefill-bearing steps, unprofiled; then that wave is dropped
        wave(2, "a")
        steps = _prefill_steps(engine)
        _sync(engine)
        engine.finish_all("abort")
        engine.kv.pool.reset_prefix_cache()
        return steps

    def profiled_prefill() -> int:  # another fresh wave's, profiled; it then decodes below
        wave(3, "b")
        return _prefill_steps(engine)

    rows = []
    # the steps are launched ahead of the host's read of their tokens, so a step's kernels do not run inside its own
    # step() call: a phase is profiled whole (the GPU time of the prefill phase includes the decode step its last
    # step call launched)
    rows.append(_profile(engine, plain_prefill, profiled_prefill,
                         f"prefill-bearing steps, {args.concurrency} x {args.input_len} tokens", args.top))
    num_prefill_steps = rows[-1]["steps"]
    rows.append(_profile(engine, lambda: _steps(engine, args.steps), lambda: _steps(engine, args.steps),
                         f"decode, batch {args.concurrency}", args.top))
    print(json.dumps({"prefill_steps": num_prefill_steps}))
    engine.finish_all("abort")
    return rows


if __name__ == "__main__":
    main()
