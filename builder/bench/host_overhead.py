"""The serving engine's host work per step at many sequences, without the model: ``python -m builder.bench.host_overhead
ARTIFACT --sequences 512``.

On a GPU the overlapped pipeline hides the host's per-step work (scheduling, the decode graph's inputs, sampling's
launch, recording and detokenizing the tokens, stop checks) behind the device's step, as long as that work is the
shorter. This measures it on the CPU: the artifact's engine with its decode graphs replaced by a stub that stages the
block tables as ``DecodeGraphs.run`` does and returns fixed random logits, and its forward (prefill) by the same, so
what is timed is the engine's own Python. ``--profile`` prints the functions taking the most time (cProfile, which
roughly doubles it). The stub's logits are sampled on the CPU here (an argmax over sequences x vocabulary), on the
device there: the figure includes that, which the host does not pay on a GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from builder.bench.offline import load_for_bench
from runtime.cuda_graphs import TableStaging
from runtime.sampling import SamplingParams


class _StubGraphs:
    """What the serving engine calls of ``DecodeGraphs``: one bucket of ``n`` rows; fixed logits."""

    def __init__(self, n: int, logits: torch.Tensor, max_blocks: int) -> None:
        self.buckets, self._logits = [n], logits
        self._tables = TableStaging(n, max_blocks, pin=False)

    def bucket_for(self, k: int) -> int | None:
        return self.buckets[0] if k <= self.buckets[0] else None

    def run(self, input_ids, positions, slots, tables) -> torch.Tensor:
        self._tables.fill(tables, self.buckets[0])
        return self._logits[:len(positions)]

    def close(self) -> None:
        pass


def host_ms_per_step(artifact: str, sequences: int, prompt_len: int, output_len: int,
                     profile: bool = False) -> tuple[float, int, cProfile.Profile | None]:
    """(ms per engine step, steps, the profile when asked) of ``sequences`` requests decoded together."""
    max_seq_len = prompt_len + output_len + 16
    engine = load_for_bench(artifact, "cpu", max_num_seqs=sequences, max_seq_len=max_seq_len,
                            max_num_batched_tokens=max(8192, sequences), cuda_graphs=False)
    vocab = int(engine.executor.graph["meta"]["vocab_size"])
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(sequences, vocab, generator=gen)
    engine.executor.forward = lambda inp: logits[:(inp.logits_indices.numel() if inp.logits_indices is not None
                                                   else inp.input_ids.numel())].clone()
    engine.graphs = _StubGraphs(sequences, logits, -(-max_seq_len // engine.block_size))
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=gen).tolist() for _ in range(sequences)]
    engine.run(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True))  # warm up
    prof = cProfile.Profile() if profile else None
    steps0, start = engine.num_steps, time.perf_counter()
    if prof:
        prof.enable()
    engine.run(prompts, SamplingParams(max_tokens=output_len, ignore_eos=True))
    if prof:
        prof.disable()
    steps = engine.num_steps - steps0
    return (time.perf_counter() - start) / steps * 1e3, steps, prof


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--sequences", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    ms, steps, prof = host_ms_per_step(args.artifact, args.sequences, args.prompt_len, args.output_len, args.profile)
    print(f"{args.sequences} sequences x {args.output_len} tokens: {steps} steps, {ms:.2f} ms of host time per step"
          + (" (profiled)" if prof else ""))
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
