"""What a CUDA graph's launch costs the host, by how many kernels it holds and how they are chained.

    python -m kernels.bench.graph_launch [--kernels 1 8 40 160] [--replays 400]

A decode step of a small model is a CUDA graph of a few dozen short kernels, and at batch 1 the host's side of a
step (the replay's launch among it) can take longer than the GPU's. Each graph here is N launches of a one-program
Triton kernel that adds 1 to a scalar, captured three ways: plain stream order, the same kernel launched with
programmatic dependent launch (``launch_pdl``, a programmatic edge in the graph; each program waits for its
predecessor, as the decode kernels do, kernels.pdl), and N torch ``add_`` ops. Printed per graph: the host's time per
``replay()`` call (the mean over --replays calls queued back to back, no synchronisation inside), the time per
replay once the GPU has run them all (synchronised at the end: the larger of the host's and the device's rate), and
whether the scalar counted every kernel (a check that the graph ran what was captured).
"""

from __future__ import annotations

import argparse
import time

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_kwargs, wait_prior


@triton.jit
def _bump(x_ptr, PDL: tl.constexpr):
    wait_prior(PDL)
    tl.store(x_ptr, tl.load(x_ptr) + 1.0)


def _capture(n: int, how: str, x: torch.Tensor) -> torch.cuda.CUDAGraph:
    launch = launch_kwargs(x) if how == "pdl" else {}

    def body():
        for _ in range(n):
            if how == "torch":
                x.add_(1.0)
            else:
                _bump[(1,)](x, PDL=bool(launch), **launch)

    body()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph


def measure(n: int, how: str, replays: int) -> dict[str, float]:
    """{"host_us", "replay_us", "ok"} for a graph of ``n`` kernels captured ``how`` (plain, pdl, torch)."""
    x = torch.zeros(1, device="cuda")
    graph = _capture(n, how, x)
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    x.zero_()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    queued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    ok = float(x.item()) == float(n * replays)
    return {"host_us": (queued - start) / replays * 1e6, "replay_us": (done - start) / replays * 1e6, "ok": ok}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, nargs="+", default=[1, 8, 40, 160])
    parser.add_argument("--replays", type=int, default=400)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("CUDA graphs need a GPU")
    print(f"{torch.cuda.get_device_name()}: us per replay of a graph of N one-program kernels "
          f"({args.replays} replays queued back to back)")
    print("kernels  chained by  host us per replay()  us per replay (host and device)  counted")
    for n in args.kernels:
        for how in ("plain", "pdl", "torch"):
            if how == "pdl" and not launch_kwargs(torch.zeros(1, device="cuda")):
                continue
            r = measure(n, how, args.replays)
            print(f"{n:7d}  {how:>10}  {r['host_us']:20.1f}  {r['replay_us']:31.1f}  {'yes' if r['ok'] else 'NO'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
