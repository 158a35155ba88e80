"""What steps a throughput workload turns into: the scheduler and serving engine run for real on the CPU,
the model's forward is replaced by random logits (scheduling does not depend on the values with EOS
ignored), and each step is counted as decode-only (CUDA-graph eligible, overlapped on the GPU),
prefill-only or mixed, with its tokens.

    python -m builder.bench.schedule_mix artifacts/quickstart --concurrency 256 --input-len 128 --output-len 128 \\
        --max-num-batched-tokens 8192

Multiply the counts by per-step times from ``builder.bench.profile_step`` on the GPU to see where a throughput
run's wall time should go. Any artifact works (only its tokenizer limits and KV layout are used).
"""

from __future__ import annotations

import argparse
import collections
import json

import torch

from builder.bench.offline import _random_prompts
from runtime.sampling import SamplingParams
from runtime.serving import ServingConfig, ServingEngine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--num-prompts", type=int, default=None, help="default: 4 x concurrency")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    args = parser.parse_args(argv)
    c = args.concurrency
    max_seq_len = args.input_len + args.output_len
    num_blocks = c * -(-max_seq_len // 16) * 2
    engine = ServingEngine.load(args.artifact, "cpu", ServingConfig(
        max_num_seqs=c, max_waiting=1 << 20, num_blocks=num_blocks, max_seq_len=max_seq_len,
        max_num_batched_tokens=args.max_num_batched_tokens), check_hashes=False, allow_failed_gate=True)
    vocab = int(engine.executor.graph["meta"]["vocab_size"])
    logits = torch.randn(c, vocab)
    steps: collections.Counter = collections.Counter()
    tokens: collections.Counter = collections.Counter()

    def forward(inp):
        decodes = sum(1 for s in inp.seqs if s.num_new == 1 and s.num_context > 0)
        prefill = inp.input_ids.numel() - decodes
        kind = "decode-only" if prefill == 0 else "prefill-only" if decodes == 0 else "mixed"
        steps[kind] += 1
        tokens[f"{kind} prefill tokens"] += prefill
        tokens[f"{kind} decode tokens"] += decodes
        return logits[:inp.logits_indices.numel()]

    engine.executor.forward = forward
    prompts = _random_prompts(args.num_prompts or 4 * c, args.input_len, vocab, 0)
    engine.run(prompts, SamplingParams(max_tokens=args.output_len, ignore_eos=True))
    print(json.dumps({"steps": dict(steps), "tokens": dict(tokens)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
