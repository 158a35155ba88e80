"""Check a tensor-parallel artifact against its one-rank build: same greedy tokens, logits within tolerance.

    python -m builder.devtools.tp_check artifacts/quickstart artifacts/quickstart-tp2 [--device cuda]

Loads each artifact with the offline engine (a tp_size > 1 artifact starts its other ranks: NCCL on
cuda:0..N-1, gloo on CPU), generates 64 greedy tokens for four prompts, runs one fresh random prompt for
logits, and prints the agreement and each engine's batch-1 decode rate. Then the same prompts through the
serving engine (paged KV cache; on CUDA the decode steps and the steps carrying prefill in CUDA graphs on every
rank, overlapped with the host), one batch, greedy tokens compared with the offline one-rank engine's. On CUDA the
prompts' prefill step must have replayed the step graphs (else it fails: their buckets missed it).
"""

from __future__ import annotations

import argparse
import time

import torch

from runtime import Engine, SamplingParams
from runtime.serving import ServingConfig, ServingEngine

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "for i in range(10):\n", "class Config:\n"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reference", help="the tp_size 1 artifact")
    parser.add_argument("sharded", help="the tensor-parallel artifact of the same model")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    results = []
    for path in (args.reference, args.sharded):
        engine = Engine.load(path, args.device)
        prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
        t0 = time.perf_counter()
        tokens = [engine.generate(p, params).token_ids for p in prompts]
        seconds = time.perf_counter() - t0
        ids = torch.randint(7, engine.tokenizer.vocab_size, (96,), generator=torch.Generator().manual_seed(0)).tolist()
        results.append((tokens, engine.logits(ids).float().cpu()))
        print(f"{path}: tp_size {engine.artifact.tp_size}, {len(PROMPTS) * args.tokens / seconds:.0f} tok/s "
              f"(batch 1, offline engine)", flush=True)
        engine.close()
    (ref_tokens, ref_logits), (tp_tokens, tp_logits) = results
    total = len(PROMPTS) * args.tokens
    equal = sum(a == b for x, y in zip(ref_tokens, tp_tokens) for a, b in zip(x, y))
    diff = (ref_logits - tp_logits).abs().max().item()
    print(f"greedy tokens equal: {equal}/{total}; max |logit difference| {diff:.3g}")
    serving = ServingEngine.load(args.sharded, args.device, ServingConfig(max_num_seqs=8, kv_cache_bytes=256 << 20))
    replayed = _count_runs(serving.step_graphs)
    outs = serving.run([serving.tokenizer.encode(p) for p in PROMPTS], params)
    graphs = type(serving.graphs).__name__ if serving.graphs is not None else "eager"
    prefill = "eager" if serving.step_graphs is None else f"{type(serving.step_graphs).__name__}, {replayed[0]} step(s)"
    missed = serving.step_graphs is not None and not replayed[0]
    serving.close()
    served = sum(a == b for x, o in zip(ref_tokens, outs) for a, b in zip(x, o.token_ids))
    print(f"serving engine ({graphs} decode, {prefill} prefill) greedy tokens equal to the one-rank offline engine: "
          f"{served}/{total}" + ("; no step replayed the step graphs" if missed else ""))
    return 0 if equal == total and served == total and not missed else 1


def _count_runs(step_graphs) -> list[int]:
    """A counter of the steps that go through ``step_graphs`` (the steps carrying prefill replayed as CUDA graphs)."""
    count = [0]
    if step_graphs is not None:
        run = step_graphs.run

        def counted(*args, **kwargs):
            count[0] += 1
            return run(*args, **kwargs)

        step_graphs.run = counted
    return count


if __name__ == "__main__":  # spawned ranks re-import this module: nothing may run at import
    raise SystemExit(main())
