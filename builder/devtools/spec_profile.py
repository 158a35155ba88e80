"""Where a speculative decoding step's time goes at batch 1: wall time per step of the serving engine, split by
the engine's phases (proposal, scheduling, the target's step launch, sampling, recording), plus a cProfile table.

    python -m builder.devtools.spec_profile ARTIFACT [--draft DRAFT_ARTIFACT] [--num-draft K] [--text FILE]
        [--prompts 4] [--output-len 128] [--device cuda] [--top 25] [--trace]

With ``--draft``: the draft model's drafts, on ``--prompts`` stretches of held-out text (``--text``). Without: n-gram
drafts (the runtime's defaults unless ``--num-draft``) on the code-editing prompts of ``builder.bench.speculative``.

Each phase's figure is host wall time inside that call, synchronisations included (a draft model's proposal queues
its chain and returns; the verify step's tokens and the drafts are read back together in ``_verify``), so the phases
add up to the step and show what the host waits on.
The plain engine (no speculation) runs the same prompts first for the per-token comparison.

``--trace`` (CUDA): both runs again under torch.profiler, without cProfile: per token, the wall time, the GPU
kernels' summed time and how many kernels ran, so a step's device time is told apart from the host time around it;
then the speculative run's top kernels.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections import defaultdict
from pathlib import Path

from builder.bench.speculative import _close, _generate, _load, code_edit_prompts, text_prompts
from runtime.artifact import open_artifact
from runtime.speculative import SpeculativeConfig


def _timed(obj, name: str, totals: dict[str, float], counts: dict[str, int]) -> None:
    """Wrap ``obj.name`` to add its wall time to ``totals[name]``."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start
            counts[name] += 1

    setattr(obj, name, wrapper)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--draft", default=None, help="a draft artifact; without it, n-gram drafts")
    parser.add_argument("--num-draft", type=int, default=None, help="drafts per step (default: the method's)")
    parser.add_argument("--text", type=Path, default=Path("models/pystdlib-llama/eval.txt"))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--trace", action="store_true", help="GPU kernel time per token under torch.profiler")
    args = parser.parse_args(argv)
    if args.trace and not args.device.startswith("cuda"):
        parser.error("--trace times GPU kernels: it needs --device cuda")
    tokenizer = open_artifact(args.artifact, check_hashes=False).load_tokenizer()
    prompts = text_prompts(tokenizer, args.prompts, args.input_len, args.text) if args.draft else \
        code_edit_prompts(tokenizer, args.prompts, Path(__file__).resolve().parents[2])

    plain = _load(args.artifact, args.device, None)
    _generate(plain, prompts[0], 8)
    start = time.perf_counter()
    plain_tokens = sum(len(_generate(plain, p, args.output_len)[0]) for p in prompts)
    plain_s = time.perf_counter() - start
    plain_steps = plain.num_steps
    traced = {"plain": _traced(plain, prompts, args.output_len, args.top)} if args.trace else {}
    _close(plain)

    method = {"method": "draft", "draft_model": args.draft} if args.draft else {"method": "ngram"}
    engine = _load(args.artifact, args.device, SpeculativeConfig(**method, min_gain=0.0,
                                                                 num_speculative_tokens=args.num_draft))
    _generate(engine, prompts[0], 8)
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    _timed(engine.proposer, "propose_pending", totals, counts)  # what the engine calls (drafts left on the device)
    if getattr(engine.proposer, "paged", None) is not None:
        _timed(engine.proposer.paged, "feed", totals, counts)
    _timed(engine.scheduler, "schedule", totals, counts)
    for name in ("_run", "_sample", "_logprobs", "_record", "_verify", "_wants_drafts", "step"):
        _timed(engine, name, totals, counts)
    steps0 = engine.num_steps
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    tokens = sum(len(_generate(engine, p, args.output_len)[0]) for p in prompts)
    profile.disable()
    spec_s = time.perf_counter() - start
    steps = engine.num_steps - steps0
    stats = engine.stats()
    k = engine.config.speculative.num_speculative_tokens
    if args.trace:
        traced["speculative"] = _traced(engine, prompts, args.output_len, args.top)
    _close(engine)

    print(f"plain: {plain_tokens} tokens in {plain_s * 1e3:.1f} ms ({plain_s / plain_tokens * 1e3:.3f} ms a token, "
          f"{plain_steps} steps)")
    print(f"speculative ({method['method']}, k={k}): {tokens} tokens in {spec_s * 1e3:.1f} ms "
          f"({spec_s / tokens * 1e3:.3f} ms a token), {steps} steps ({spec_s / max(steps, 1) * 1e3:.3f} ms a step); "
          f"acceptance {stats.spec_acceptance_rate:.2f}, accepted per verify {stats.spec_mean_accepted_tokens:.2f}")
    print("phase (host wall time inside the call)      calls   ms a call   ms a step")
    for name in sorted(totals, key=totals.get, reverse=True):
        print(f"  {name:40s} {counts[name]:7d} {totals[name] / counts[name] * 1e3:10.3f} "
              f"{totals[name] / max(steps, 1) * 1e3:10.3f}")
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue())
    for name, (summary, table) in traced.items():
        print(f"traced {name}: {summary}")
    if "speculative" in traced:
        print(traced["speculative"][1])
    return 0


def _traced(engine, prompts: list, output_len: int, top: int) -> tuple[str, str]:
    """Generate ``prompts`` again under torch.profiler: (a line of per-token figures, the top kernels' table)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    steps0 = engine.num_steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        tokens = sum(len(_generate(engine, p, output_len)[0]) for p in prompts)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.device_time_total for e in kernels)
    steps = max(engine.num_steps - steps0, 1)
    summary = (f"{tokens} tokens, {steps} steps: wall {wall / tokens * 1e3:.3f} ms a token, GPU kernels and copies "
               f"{gpu_us / tokens / 1e3:.3f} ms a token ({gpu_us / steps / 1e3:.3f} ms a step, "
               f"{len(kernels) / steps:.1f} launches a step), GPU busy {gpu_us / 1e6 / wall:.0%} of the wall time "
               f"(under the profiler)")
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=top)
    return summary, table


if __name__ == "__main__":
    raise SystemExit(main())
