"""Where a serving step's time goes: torch.profiler over steady-state steps of a throughput run.

    python -m builder.profile_step artifacts/llama3-8b-fp8 --concurrency 64 --input-len 128 [--steps 20]

Fills the engine with ``concurrency`` random prompts, runs until every request is decoding, then
profiles ``--steps`` decode steps (and, separately, the prefill-bearing steps of a fresh wave). Prints,
per phase: wall time per step, GPU kernel time per step (sum of kernel durations; kernels do not
overlap on one stream), the host share (wall − GPU), and the top kernels and host functions. This
is the evidence behind the "where the time goes" notes in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from builder.bench import _random_prompts, load_for_bench
from runtime import SamplingParams


def _profile(engine, num_steps: int, label: str, top: int) -> dict:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        steps = 0
        while steps < num_steps and engine.has_unfinished:
            engine.step()
            steps += 1
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    gpu_us = sum(evt.device_time for evt in prof.events() if evt.device_type == torch.autograd.DeviceType.CUDA)
    row = {"phase": label, "steps": steps, "wall_ms_per_step": 1e3 * wall / max(steps, 1),
           "gpu_kernel_ms_per_step": gpu_us / 1e3 / max(steps, 1)}
    row["host_share"] = 1 - row["gpu_kernel_ms_per_step"] / row["wall_ms_per_step"]
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
    num_prefill_steps = 0
    while any(not r.output_token_ids for r in engine.scheduler.running) or engine.scheduler.waiting:
        num_prefill_steps += 1
        if num_prefill_steps == 1:
            rows.append(_profile(engine, 1, "first prefill step", args.top))
        else:
            engine.step()
    rows.append(_profile(engine, args.steps, f"decode, batch {args.concurrency}", args.top))
    print(json.dumps({"prefill_steps": num_prefill_steps}))
    engine.finish_all("abort")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
