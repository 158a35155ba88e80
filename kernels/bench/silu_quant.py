"""The quantized SiLU-mul (``kernels.activation.silu_mul(..., quantize_to=)``) at Llama-3-8B's intermediate size:
the one-pass kernel against the two-pass one at each chunk size (``KERNELS_SILU_QUANT_CHUNK``), us per launch and the
bandwidth of its bytes (gate and up read once, codes and scales written), from CUDA-graph replays (median of 50).

    python -m kernels.bench.silu_quant [--rows 1 16 256 2048 8192] [--cols 14336] [--chunks 0 1024 2048 4096]

Each row's codes and scale are checked equal to the one-pass kernel's before it is timed.
"""

from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

import torch


def main(argv: list[str] | None = None) -> int:
    from kernels.activation import silu_mul
    from kernels.bench.attention import timings  # (graph, eager) median ms

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256, 2048, 8192])
    parser.add_argument("--cols", type=int, default=14336)
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 1024, 2048, 4096])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels.bench.silu_quant times CUDA kernels; no CUDA device", file=sys.stderr)
        return 1
    print(f"{'rows':>6} " + " ".join(f"{'chunk ' + str(c) if c else 'one pass':>22}" for c in args.chunks))
    for rows in args.rows:
        gen = torch.Generator(device="cuda").manual_seed(rows)
        gate_up = (torch.randn(rows, 2 * args.cols, device="cuda", generator=gen) * 3).to(torch.bfloat16)
        nbytes = gate_up.numel() * 2 + rows * args.cols + rows * 4
        cells, want = [], None
        for chunk in args.chunks:
            os.environ["KERNELS_SILU_QUANT_CHUNK"] = str(chunk)
            got = silu_mul(gate_up, quantize_to=torch.float8_e4m3fn)
            if want is None:
                want = got
            elif not (torch.equal(got.scales, want.scales)
                      and torch.equal(got.codes.view(torch.uint8), want.codes.view(torch.uint8))):
                print(f"rows {rows}, chunk {chunk}: codes or scales differ from the one-pass kernel's", file=sys.stderr)
                return 1
            us = 1e3 * timings(lambda: silu_mul(gate_up, quantize_to=torch.float8_e4m3fn),
                               SimpleNamespace(warmup=5, iters=50))[0]
            cells.append(f"{us:9.1f} us {nbytes / us / 1e6:5.2f} TB/s")
        print(f"{rows:>6} " + " ".join(f"{c:>22}" for c in cells), flush=True)
    os.environ.pop("KERNELS_SILU_QUANT_CHUNK", None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
