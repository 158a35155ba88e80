"""Instruction mix of a compiled Triton kernel's loops, from the Triton cache (GPU machines; reading, not tuning).

    python -m builder.devtools.sass_stats KERNEL_NAME [--top 25]

Finds the newest cubin of KERNEL_NAME in the Triton cache (``TRITON_CACHE_DIR`` or ``~/.triton/cache``),
disassembles it with the ``cuobjdump`` Triton ships, and prints the register and shared-memory use and, for
each backward branch (a loop), its instruction count and the most frequent opcodes. Divide a K loop's count by
the bytes of weights each thread reads per iteration for the instructions-per-byte figure the kernels' docstrings
quote.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
from pathlib import Path

import triton


def _cuobjdump() -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


def newest_cubin(kernel: str) -> Path | None:
    root = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    found = sorted(root.glob(f"*/{kernel}.cubin"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def loops(sass: str) -> list[tuple[int, int, collections.Counter]]:
    """(start, end, opcode counts) of every backward branch's body."""
    instrs = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            instrs.append((int(m.group(1), 16), m.group(2)))
    out = []
    for addr, text in instrs:
        if "BRA" not in text:
            continue
        target = re.search(r"0x([0-9a-f]+)", text.split("BRA", 1)[1])
        if target and int(target.group(1), 16) < addr:
            lo = int(target.group(1), 16)
            body = [t for a, t in instrs if lo <= a <= addr]
            out.append((lo, addr, collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for t in body)))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    cubin = newest_cubin(args.kernel)
    if cubin is None:
        print(f"no cubin of {args.kernel} in the Triton cache", file=sys.stderr)
        return 1
    usage = subprocess.run([_cuobjdump(), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
    print(cubin.name, re.findall(r"REG:\d+|SHARED:\d+|LOCAL:\d+", usage))
    sass = subprocess.run([_cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True).stdout
    for lo, hi, counts in loops(sass):
        print(f"loop {lo:#x}-{hi:#x}: {sum(counts.values())} instructions: {counts.most_common(args.top)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
