"""The Hugging Face transformers baseline for ``builder bench latency``: the same checkpoint, batch 1.

    python -m builder.bench.hf_baseline CHECKPOINT [--input-len 128] [--output-len 128] [--compile]

Eager: ``model.generate`` with the default dynamic cache. ``--compile``: a static cache, with which
``generate`` compiles the decoding forward (torch.compile, CUDA graphs), the fastest stock setup.
Decode tokens/s = (output_len - 1) / (time of a full generate - time of a 1-token generate), so the
prefill is excluded. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _timed_generate(model, ids: torch.Tensor, num_new: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.bfloat16, device_map="cuda").eval()
    model.generation_config.pad_token_id = model.generation_config.eos_token_id
    if args.compile:  # a static cache makes generate() compile the decoding forward itself (CUDA graphs)
        model.generation_config.cache_implementation = "static"
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (1, args.input_len), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.inference_mode():
        for _ in range(2):  # warm up (and compile)
            _timed_generate(model, ids, args.output_len)
        full = statistics.median(_timed_generate(model, ids, args.output_len) for _ in range(args.repeats))
        first = statistics.median(_timed_generate(model, ids, 1) for _ in range(args.repeats))
    print(json.dumps({"baseline": "hf-static-compile" if args.compile else "hf-eager", "input_len": args.input_len,
                      "output_len": args.output_len, "ttft_ms": round(first * 1e3, 2),
                      "decode_tok_s": round((args.output_len - 1) / (full - first), 2),
                      "transformers": __import__("transformers").__version__}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
