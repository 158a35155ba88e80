"""Probe PyTorch symmetric memory between two local GPUs, step by step, each step printed as it completes.

    python -m builder.devtools.symm_probe        (spawns two ranks; NCCL on cuda:0 and cuda:1)

Prints which step a failure or hang stops at: group start, symm_mem.empty, rendezvous, an eager one-shot
all-reduce, one with the copy folded in, and a CUDA graph of three; each rank dumps its stacks after
``--stack-after`` seconds if it is still running.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def _say(rank: int, t0: float, what: str) -> None:
    print(f"[rank {rank} +{time.perf_counter() - t0:.2f}s] {what}", flush=True)


def _rank(rank: int, port: int, stack_after: float) -> None:
    faulthandler.dump_traceback_later(stack_after, exit=True)
    t0 = time.perf_counter()
    torch.cuda.set_device(rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=rank, world_size=2, timeout=timedelta(seconds=60),
                            device_id=torch.device("cuda", rank))
    x = torch.ones(8, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    _say(rank, t0, f"nccl all_reduce ok ({x[0].item()})")
    import torch.distributed._symmetric_memory as symm_mem

    name = dist.group.WORLD.group_name
    backend = symm_mem.get_backend(torch.device("cuda", rank)) if hasattr(symm_mem, "get_backend") else "?"
    _say(rank, t0, f"symmetric memory backend {backend}")
    buf = symm_mem.empty(1 << 16, dtype=torch.bfloat16, device=torch.device("cuda", rank))
    _say(rank, t0, "symm_mem.empty ok")
    handle = symm_mem.rendezvous(buf, dist.group.WORLD)
    _say(rank, t0, f"rendezvous ok (world {handle.world_size}, rank {handle.rank})")
    buf[:4096].fill_(rank + 1)
    y = torch.ops.symm_mem.one_shot_all_reduce(buf[:4096], "sum", name)
    torch.cuda.synchronize()
    _say(rank, t0, f"one_shot_all_reduce ok ({y[0].item()}, want 3)")
    local = torch.full((4096,), 2.0 * (rank + 1), dtype=torch.bfloat16, device="cuda")
    y = torch.ops.symm_mem.one_shot_all_reduce_copy(buf[:4096], local, "sum", name)
    torch.cuda.synchronize()
    _say(rank, t0, f"one_shot_all_reduce_copy ok ({y[0].item()}, want 6)")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.ops.symm_mem.one_shot_all_reduce_copy(buf[:4096], local, "sum", name)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        out = torch.ops.symm_mem.one_shot_all_reduce_copy(buf[:4096], local, "sum", name)
        out = torch.ops.symm_mem.one_shot_all_reduce_copy(buf[:4096], out, "sum", name)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    _say(rank, t0, f"graph replays ok ({out[0].item()}, want 12)")
    n = 200
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    small = local[:4096].clone()
    for label, fn in (("nccl", lambda: dist.all_reduce(small)),
                      ("one-shot", lambda: torch.ops.symm_mem.one_shot_all_reduce_copy(buf[:4096], small, "sum",
                                                                                        name))):
        fn()
        torch.cuda.synchronize()
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        _say(rank, t0, f"{label} 8 KB eager: {start.elapsed_time(end) * 1000 / n:.1f} us per all-reduce")
    # in CUDA graphs (how the decode steps run them): 20 sums per graph, per size
    big = symm_mem.empty(4 << 20, dtype=torch.bfloat16, device=torch.device("cuda", rank))
    symm_mem.rendezvous(big, dist.group.WORLD)
    for nbytes in (8 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20):
        numel = nbytes // 2
        src = torch.randn(numel, device="cuda").to(torch.bfloat16)
        row = []
        for label, fn in (("nccl", lambda: dist.all_reduce(src)),
                          ("one-shot", lambda: torch.ops.symm_mem.one_shot_all_reduce_copy(big[:numel], src, "sum",
                                                                                            name))):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(20):
                    fn()
            graph.replay()
            torch.cuda.synchronize()
            start.record()
            for _ in range(10):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            row.append(f"{label} {start.elapsed_time(end) * 1000 / 200:.1f} us")
        if rank == 0:
            _say(rank, t0, f"graph, {nbytes >> 10} KB: " + ", ".join(row))
    faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=29533)
    parser.add_argument("--stack-after", type=float, default=45.0)
    args = parser.parse_args(argv)
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(args.port, args.stack_after), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
