"""``kernels.bench.shape_table``: the frag GEMV's per-shape table entries from a sweep's log, in the format
``kernels.bench.gemm --frag`` prints with SWEEP_VERBOSE=1 (host-side parsing only)."""

from __future__ import annotations

from kernels.bench.gemm import sweep_line
from kernels.bench.shape_table import entries, parse
from kernels.w4a16_frag import FragConfig


def _log(times: dict[tuple[str, int, tuple[int, int, int]], float]) -> str:
    lines = ["W8A16 (per channel) in the MMA's register order (kernels.w4a16_frag) vs kernels.w4a16_mma"]
    for (shape, rows, (warps, split, depth)), us in times.items():
        lines.append(sweep_line(f"frag {shape} M={rows}", FragConfig(warps=warps, split_k=split, depth=depth), us))
    return "\n".join(lines)


def test_an_entry_only_where_the_best_candidate_beats_the_auto_split():
    times = {}
    for rows in (1, 8, 16):
        times[("down", rows, (4, 0, 1))] = 27.0  # the auto split
        times[("down", rows, (8, 16, 1))] = 20.0 if rows <= 8 else 40.0  # wins up to 8 rows only
        times[("qkv", rows, (4, 0, 1))] = 11.0
        times[("qkv", rows, (2, 16, 1))] = 10.8  # 2%: below the least gain
    bits, parsed = parse(_log(times))
    assert bits == 8 and parsed["down"][16][(8, 16, 1)] == 40.0
    lines = entries(bits, parsed, max_rows=8, min_gain=0.05)
    assert len(lines) == 1 and lines[0].strip().startswith(
        "(8, 4096, 14336): FragConfig(warps=8, split_k=16, depth=1),"), lines
    assert entries(bits, parsed, max_rows=16, min_gain=0.05) == []  # over 16 rows the auto split wins
