"""Where a serving step's time goes: torch.profiler over steady-state steps of a throughput run.

    python -m builder.bench.profile_step artifacts/llama3-8b-fp8 --concurrency 64 --input-len 128 [--steps 20]

Fills the engine with ``concurrency`` random prompts, runs until every request is decoding, then
profiles ``--steps`` decode steps (and, separately, the prefill-bearing steps of a fresh wave). Prints,
per phase: wall time per step (unprofiled steps, the profiler's tracing inflates host time), GPU kernel
time per step (sum of kernel durations in the profiled steps; kernels do not overlap on one stream), the
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


def _profile(engine, num_steps: int, label: str, top: int) -> dict:
    # first without the profiler (its tracing inflates host time): wall per step and where the host spends it
    timers = _HostTimers(engine)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    plain_steps = _steps(engine, num_steps)
    torch.cuda.synchronize()
    plain_wall = time.perf_counter() - t0
    timers.remove()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        steps = _steps(engine, num_steps)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    gpu_us = sum(evt.device_time for evt in prof.events() if evt.device_type == torch.autograd.DeviceType.CUDA)
    row = {"phase": label, "steps": steps, "wall_ms_per_step": 1e3 * plain_wall / max(plain_steps, 1),
           "profiled_wall_ms_per_step": 1e3 * wall / max(steps, 1),
           "gpu_kernel_ms_per_step": gpu_us / 1e3 / max(steps, 1)}
    row["host_share"] = 1 - row["gpu_kernel_ms_per_step"] / row["wall_ms_per_step"]
    row.update({f"host_{k}_ms_per_step": 1e3 * v / max(plain_steps, 1) for k, v in timers.totals.items()})
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--no-cuda-graphs", action="store_true")
    args = parser.parse_args(argv)
    engine = load_for_bench(args.artifact, "cuda", max_num_seqs=args.concurrency, max_seq_len=None,
                            max_num_batched_tokens=None, cuda_graphs=not args.no_cuda_graphs)
    vocab = int(engine.executor.graph["meta"]["vocab_size"])
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    # warm-up wave (Triton compiles, graph capture), then a fresh wave to profile
    warmup = _random_prompts(args.concurrency, args.input_len, vocab, 1)
    engine.run(warmup, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.kv.pool.reset_prefix_cache()
    for i, prompt in enumerate(_random_prompts(args.concurrency, args.input_len, vocab, 2)):
        engine.add_request(prompt, params, request_id=f"p{i}")
    rows = []
    # prefill-bearing steps: until every request has its first token
    first_step = engine.num_steps
    while any(not r.output_token_ids for r in engine.scheduler.running) or engine.scheduler.waiting:
        if engine.num_steps == first_step:  # one unprofiled and one profiled prefill-bearing step
            rows.append(_profile(engine, 1, "first prefill step", args.top))
        else:
            engine.step()
    num_prefill_steps = engine.num_steps - first_step
    rows.append(_profile(engine, args.steps, f"decode, batch {args.concurrency}", args.top))
    print(json.dumps({"prefill_steps": num_prefill_steps}))
    engine.finish_all("abort")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
