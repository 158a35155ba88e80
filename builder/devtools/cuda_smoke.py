"""Check that artifacts built on the CPU generate the same greedy tokens on CUDA, and time decode.

    python -m builder.devtools.cuda_smoke artifacts/quickstart artifacts/quickstart-awq ...

Prints, per artifact: whether CPU and CUDA greedy tokens agree, the max |logit difference| on a
fresh random prompt, and batch-1 decode tokens/s on each device (the bundled model is tiny, so
these figures measure per-step overhead, not bandwidth).
"""

from __future__ import annotations

import sys
import time

import torch

from runtime import Engine, SamplingParams
from runtime.serving import ServingConfig, ServingEngine

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n\nclass Config:\n", "    def __init__(self, name):\n",
           "for i in range(10):\n"]


def check(path: str, num_tokens: int = 64) -> str:
    cpu = Engine.load(path, device="cpu")
    gpu = Engine.load(path, device="cuda")
    params = SamplingParams(max_tokens=num_tokens, ignore_eos=True)
    prompt = cpu.tokenizer.encode("def fibonacci(n):")
    a, b = cpu.generate(prompt, params), gpu.generate(prompt, params)
    ids = torch.randint(7, cpu.tokenizer.vocab_size, (96,), generator=torch.Generator().manual_seed(0)).tolist()
    diff = (cpu.logits(ids) - gpu.logits(ids).cpu()).abs().max().item()
    agree = sum(x == y for x, y in zip(a.token_ids, b.token_ids))
    gpu.generate(prompt, params)  # warm
    torch.cuda.synchronize()
    t = time.perf_counter()
    g = gpu.generate(prompt, params)
    torch.cuda.synchronize()
    return (f"| {path} | {agree}/{num_tokens} | {diff:.2e} | {a.decode_tokens_per_s:.0f} | "
            f"{g.decode_tokens_per_s:.0f} | {time.perf_counter() - t:.2f} s |")


def staggered(srv: ServingEngine, prompts: list[list[int]], params: SamplingParams) -> list:
    """Half the prompts first, the rest after a few decode steps, so that steps mix their prefill with the
    others' decodes; returns each prompt's outputs (token ids in ``token_ids``), in order."""
    from runtime.outputs import RequestOutput

    half = len(prompts) // 2
    ids = [srv.add_request(p, params) for p in prompts[:half]]
    tokens: dict[str, list[int]] = {}
    for step in range(10 ** 6):
        if step == 3:
            ids += [srv.add_request(p, params) for p in prompts[half:]]
        elif step > 3 and not srv.has_unfinished:
            break
        for out in srv.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return [RequestOutput(i, "", tokens.get(i, []), None, True, None, 0, 0) for i in ids]


def check_serving(path: str, num_tokens: int = 64) -> str:
    """The serving engine on CUDA (Triton kernels, paged cache, CUDA-graph decode) against the CPU
    offline engine on the torch reference ops: greedy tokens of a batch of prompts, and batch-1 decode."""
    from builder.bench.offline import latency

    cpu = Engine.load(path, device="cpu")
    params = SamplingParams(max_tokens=num_tokens, ignore_eos=True)
    prompts = [cpu.tokenizer.encode(p) for p in PROMPTS]
    seeded = [SamplingParams(max_tokens=num_tokens, ignore_eos=True, temperature=0.8, top_p=0.95, seed=i)
              for i in range(len(prompts))]
    rows, sampled = [], []
    for graphs in (True, False):
        srv = ServingEngine.load(path, "cuda", ServingConfig(max_num_seqs=8, cuda_graphs=graphs,
                                                             kv_cache_bytes=256 << 20))
        outs = srv.run(prompts, params)  # with graphs: the overlapped decode pipeline
        outs += [srv.run([p], params)[0] for p in prompts]  # one sequence at a time: one-sequence step graphs
        outs += staggered(srv, prompts, params)  # prompts arriving while others decode: mixed step graphs
        agree = sum(sum(x == y for x, y in zip(o.token_ids, cpu.generate(p, params).token_ids))
                    for p, o in zip(prompts * 3, outs))
        sampled.append([o.token_ids for o in srv.run(prompts, seeded)])
        lat = latency(srv, 64, 128, repeats=3)
        total = 3 * num_tokens * len(prompts)
        rows.append(f"| {path} | kernels, graphs {'on' if graphs else 'off'} | {agree}/{total} | "
                    f"{lat.decode_tok_s:.0f} | {lat.ttft_ms:.1f} ms |")
        del srv
        torch.cuda.empty_cache()
    same = sum(sum(x == y for x, y in zip(a, b)) for a, b in zip(*sampled))
    rows.append(f"| {path} | seeded sampling, graphs on vs off | {same}/{num_tokens * len(prompts)} equal | | |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("| artifact | greedy tokens equal (CPU vs CUDA) | max abs logit diff | CPU decode tok/s | CUDA decode tok/s | CUDA 64 tokens |")
    print("| --- | --- | --- | --- | --- | --- |")
    for p in sys.argv[1:]:
        print(check(p), flush=True)
    print("\n| artifact | serving path | greedy tokens equal to CPU | batch-1 decode tok/s | TTFT (64 tokens) |")
    print("| --- | --- | --- | --- | --- |")
    for p in sys.argv[1:]:
        print(check_serving(p), flush=True)
