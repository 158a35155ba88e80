"""Record the tensor-parallel speed-up at batch 1 from two ``builder bench latency --json`` files of one call:

    python -m builder.devtools.tp_speedup --one $OUT/lat_bf16.jsonl --sharded $OUT/lat_bf16-tp2.jsonl --tp-size 2 \\
        --name 8b --record $OUT/benchmarks.jsonl

appends ``tp{N}_speedup_b1_{name}`` (x: the sharded artifact's batch-1 decode tok/s over the one-rank artifact's,
the last batch-1 row of each file) and ``tp{N}_decode_b1_{name}`` (tok/s), and prints both.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from builder.bench.record import append_figures


def batch1_tok_s(path: Path) -> float:
    """The decode tok/s of the last batch-1 latency row in ``path`` (rows without a batch_size are batch 1)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip().startswith("{")]
    rates = [r["decode_tok_s"] for r in rows if "decode_tok_s" in r and r.get("batch_size", 1) == 1]
    if not rates:
        raise SystemExit(f"{path}: no batch-1 latency row (a 'decode_tok_s' field); run builder bench latency "
                         f"--json {path} first")
    return rates[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", type=Path, required=True, help="latency JSON lines of the tp_size 1 artifact")
    parser.add_argument("--sharded", type=Path, required=True, help="latency JSON lines of the sharded artifact")
    parser.add_argument("--tp-size", type=int, required=True)
    parser.add_argument("--name", required=True, help="the model's tag in the figure names, e.g. 8b")
    parser.add_argument("--record", type=Path, help="append the figures to this JSON-lines record")
    parser.add_argument("--command", default="", help="the commands that measured both files (recorded)")
    args = parser.parse_args(argv)
    one, sharded = batch1_tok_s(args.one), batch1_tok_s(args.sharded)
    figures = [(f"tp{args.tp_size}_speedup_b1_{args.name}", round(sharded / one, 3), "x"),
               (f"tp{args.tp_size}_decode_b1_{args.name}", sharded, "tok/s")]
    for name, value, unit in figures:
        print(f"{name} {value} {unit} (one rank: {one} tok/s)")
    if args.record:
        append_figures(args.record, figures, torch.device("cuda") if torch.cuda.is_available() else "cpu",
                       args.command or f"builder bench latency (--one {args.one}, --sharded {args.sharded})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
