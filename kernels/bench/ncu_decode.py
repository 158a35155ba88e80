"""The batch-1 decode step's kernels at the Llama-3-8B shape, launched for Nsight Compute to profile.

Each kernel is compiled and run once outside the profiled range, then launched ``--repeats`` times between
``cudaProfilerStart`` / ``cudaProfilerStop``, so that ``ncu --profile-from-start off`` sees exactly those launches
(the driver is ``builder/devtools/gpu_suite.sh ncu-decode``)::

    ncu --profile-from-start off --clock-control none --set full -o report python -m kernels.bench.ncu_decode

What runs, one row of x (batch 1), bf16 activations:

- ``w4a16``: the frag W4A16 GEMV (``kernels.w4a16_frag``, AWQ int4 g128) at qkv, o_proj, gate_up (gated: the
  merged gate/up with SiLU-mul) and down;
- ``dense``: the bf16 split-K GEMV (``kernels.gemv.dense_gemv``) at the same four shapes, for comparison: it reads
  at the copy bandwidth in the step profile;
- ``attention``: the paged decode attention over ``--context`` keys with the step's K/V written by the kernel
  (``NewKV`` with RoPE), 32 query heads, 8 KV heads, head_dim 128, 16-token blocks.

Without ncu it prints each launch's time from CUDA events, so the script also runs on its own.
"""

from __future__ import annotations

import argparse

import torch

SHAPES = [("qkv", 4096, 6144), ("o_proj", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)]
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def _w4a16_calls(gen: torch.Generator) -> list[tuple[str, object]]:
    from kernels.bench.gemm import random_w4a16
    from kernels.w4a16_frag import interleave_gate_up, repack_frag, w4a16_frag

    calls = []
    for name, k, n in SHAPES:
        qweight, scales, zeros = random_w4a16(n, k, gen)
        gated = name == "gate_up"
        if gated:
            qweight, scales, zeros, _ = interleave_gate_up(qweight, scales, zeros)
        packed = repack_frag(qweight, scales, zeros, 128, 4)
        x = torch.randn(1, k, generator=gen, device="cuda").to(torch.bfloat16)
        calls.append((f"w4a16 {name}", lambda x=x, p=packed, g=gated: w4a16_frag(x, **p, gated=g)))
    return calls


def _dense_calls(gen: torch.Generator) -> list[tuple[str, object]]:
    from kernels.gemv import dense_gemv

    calls = []
    for name, k, n in SHAPES:
        w = (torch.randn(n, k, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
        x = torch.randn(1, k, generator=gen, device="cuda").to(torch.bfloat16)
        calls.append((f"dense {name}", lambda x=x, w=w: dense_gemv(x, w)))
    return calls


def _attention_call(gen: torch.Generator, context: int) -> tuple[str, object]:
    from kernels.bench.attention import make_paged
    from kernels.paged_attention import NewKV, paged_decode_attention

    p = make_paged([context], NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.bfloat16, torch.bfloat16, gen)
    width = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    qkv = torch.randn(1, width, generator=gen, device="cuda").to(torch.bfloat16)
    q = qkv[:, :NUM_HEADS * HEAD_DIM].view(1, NUM_HEADS, HEAD_DIM)
    k = qkv[:, NUM_HEADS * HEAD_DIM:(NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM].view(1, NUM_KV_HEADS, HEAD_DIM)
    v = qkv[:, (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM:].view(1, NUM_KV_HEADS, HEAD_DIM)
    pos = torch.tensor([context - 1], device="cuda")
    slots = p.block_tables[0, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
    inv_freq = (1.0 / 5e5 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)).cuda()
    seq_lens = torch.tensor([context], dtype=torch.int32, device="cuda")
    new_kv = NewKV(k, v, slots, pos, inv_freq, 1.0)
    return (f"attention {context} keys", lambda: paged_decode_attention(
        q, p.k_cache, p.v_cache, p.block_tables, seq_lens, HEAD_DIM ** -0.5, new_kv=new_kv))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernels", nargs="*", default=["w4a16", "dense", "attention"],
                        choices=["w4a16", "dense", "attention"])
    parser.add_argument("--context", type=int, default=192, help="attention: keys in the cache, the new one included")
    parser.add_argument("--repeats", type=int, default=2, help="profiled launches of each kernel")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("ncu_decode needs a CUDA device")
    gen = torch.Generator(device="cuda").manual_seed(0)
    calls = []
    if "w4a16" in args.kernels:
        calls += _w4a16_calls(gen)
    if "dense" in args.kernels:
        calls += _dense_calls(gen)
    if "attention" in args.kernels:
        calls.append(_attention_call(gen, args.context))
    for _, fn in calls:  # compile and warm up outside the profiled range
        fn()
        fn()
    torch.cuda.synchronize()
    times = {}
    torch.cuda.cudart().cudaProfilerStart()
    for name, fn in calls:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.repeats):
            fn()
        end.record()
        torch.cuda.synchronize()
        times[name] = start.elapsed_time(end) * 1e3 / args.repeats
    torch.cuda.cudart().cudaProfilerStop()
    for name, us in times.items():  # under ncu these include its replays; alone, back-to-back eager launches
        print(f"{name:>22}: {us:9.1f} us per launch (eager, events)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
