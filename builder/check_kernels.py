"""Check an artifact on CUDA: the executor on the Triton/cuBLASLt kernels against its torch reference ops.

    python -m builder.check_kernels artifacts/llama3-8b-fp8 [--tokens 32]

Loads the artifact twice on the GPU (``use_kernels`` on and off), runs the same fresh random prompt
through both and prints the max absolute and relative logit difference and the top-1 agreement.
"""

from __future__ import annotations

import argparse
import json

import torch

from runtime import Engine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args(argv)
    fused = Engine.load(args.artifact, "cuda", check_hashes=False, use_kernels=True, allow_failed_gate=True)
    vocab = int(fused.executor.graph["meta"]["vocab_size"])
    ids = torch.randint(3, vocab, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    got = fused.logits(ids).float().cpu()
    del fused
    torch.cuda.empty_cache()
    ref = Engine.load(args.artifact, "cuda", check_hashes=False, use_kernels=False, allow_failed_gate=True)
    want = ref.logits(ids).float().cpu()
    diff = (got - want).abs().max().item()
    print(json.dumps({"artifact": args.artifact, "max_abs_diff": diff, "rel": diff / want.abs().max().item(),
                      "top1_agreement": (got.argmax(-1) == want.argmax(-1)).float().mean().item()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
