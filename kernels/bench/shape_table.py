"""The frag GEMV's per-weight-shape configurations for a device, from a sweep's log (``kernels.w4a16_frag``'s
``_SHAPE_CONFIGS``).

    SWEEP_VERBOSE=1 python -m kernels.bench.gemm --frag --bits 8 --rows 1 2 4 8 16 > sweep.txt   # on the device
    python -m kernels.bench.shape_table sweep.txt [--max-rows 8] [--min-gain 0.05]

For each weight shape in the log, the candidate configuration with the least time summed over the rows up to
``--max-rows`` is compared with the auto split (4 warps, split 0, depth 1: what a shape not in the table gets); it is
printed as a table entry when it is faster by at least ``--min-gain``, with its times and the auto split's. The
session-34 H200 entries were chosen this way (by hand), except 8-bit down: 8 warps at split 16 (20.0 / 21.4 us at 1 /
8 rows) over the sum's winner, 2 warps at depth 2 (20.3 / 20.8), so that its residual's sums of squares come in 16
parts, not 64, for the norm its reader applies (``PendingNorm``). A sweep's winner is a candidate, not a result: each entry
still needs the end-to-end A/B (``AB_SETTINGS="- KERNELS_SHAPE_CONFIGS=0" gpu_suite.sh ab-PREC``) before it lands:
the 4-bit gate_up entry won the sweep by 12% and measured level end to end.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

from kernels.bench.gemm import SHAPES

LINE = re.compile(r"\s+frag (\w+) M=(\d+) FragConfig\(warps=(\d+), split_k=(\d+), depth=(\d+)"
                  r"(?:, prefetch_range=\w+)?\): ([\d.]+) us")
AUTO = (4, 0, 1)  # warps, split_k (0: auto), depth: the rows' table for every shape


def parse(text: str) -> tuple[int, dict[str, dict[int, dict[tuple[int, int, int], float]]]]:
    """(bits, shape -> rows -> (warps, split_k, depth) -> us) of a ``SWEEP_VERBOSE=1 --frag`` log."""
    bits = 8 if "W8A16" in text else 4
    times: dict[str, dict[int, dict[tuple[int, int, int], float]]] = defaultdict(lambda: defaultdict(dict))
    for m in LINE.finditer(text):
        shape, rows, warps, split, depth, us = m.groups()
        times[shape][int(rows)][(int(warps), int(split), int(depth))] = float(us)
    return bits, times


def entries(bits: int, times: dict, max_rows: int, min_gain: float) -> list[str]:
    """The table's lines: ``(bits, out_features, in_features): FragConfig(...)`` with the summed times as a comment,
    for the shapes whose best candidate beats the auto split by ``min_gain``."""
    dims = {name: (n, k) for name, k, n in SHAPES}
    out = []
    for shape, by_rows in sorted(times.items()):
        rows = sorted(r for r in by_rows if r <= max_rows)
        common = set.intersection(*(set(by_rows[r]) for r in rows)) if rows else set()
        if AUTO not in common:
            continue
        total = {cfg: sum(by_rows[r][cfg] for r in rows) for cfg in common}
        best = min(total, key=total.get)
        if total[best] <= (1 - min_gain) * total[AUTO]:
            warps, split, depth = best
            n, k = dims[shape]
            shown = " / ".join(f"{by_rows[r][best]:.1f}" for r in rows)
            auto = " / ".join(f"{by_rows[r][AUTO]:.1f}" for r in rows)
            out.append(f"        ({bits}, {n}, {k}): FragConfig(warps={warps}, split_k={split}, depth={depth}),  "
                       f"# {shape}: {shown} us at rows {rows} (auto split {auto})")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path, help="the output of SWEEP_VERBOSE=1 python -m kernels.bench.gemm --frag ...")
    parser.add_argument("--max-rows", type=int, default=8, help="the table applies up to these rows (default 8)")
    parser.add_argument("--min-gain", type=float, default=0.05, help="least gain over the auto split (default 0.05)")
    args = parser.parse_args()
    bits, times = parse(args.log.read_text())
    if not times:
        print(f"{args.log}: no SWEEP_VERBOSE candidate lines", file=sys.stderr)
        return 1
    lines = entries(bits, times, args.max_rows, args.min_gain)
    print("\n".join(lines) if lines else f"no shape gains {args.min_gain:.0%} over the auto split")
    return 0


if __name__ == "__main__":
    sys.exit(main())
