"""GPU check and benchmark of the block-scaled FP8 linear (``kernels.fp8_block_gemm``: GEMV and GEMM) against bf16.

    python -m kernels.bench.fp8_block                   # every shape and M: check, then time (exit 1 on a mismatch)
    python -m kernels.bench.fp8_block --sweep           # also time candidate configs per shape and M
    python -m kernels.bench.fp8_block --sweep --rows 1 2 4 --shapes llama3-8b.qkv llama3-8b.down   # a subset

Weights: fresh random E4M3 codes over their whole range and fp32 block scales for 128 x 128 blocks (a fine-grained
FP8 checkpoint's layout), at the linear shapes of Llama-3-8B, Qwen3-8B and DeepSeek-V3 (its attention projections,
which are linears, and a shared expert's; K and N as the checkpoints store them). x: fresh random bf16 with an
outlier channel, at M = 1, 2, 4, 8, 16, 64, 256, 1024 rows. Each output is checked against ``ref_fp8_block_linear``
(the runtime's reference linear) before it is timed: the default path (``fp8_block_linear`` without a config: the
GEMV up to ``GEMV_ROWS`` rows, the GEMM above), at M <= 4 the GEMV and the GEMM forced at their default configs
(to set ``GEMV_ROWS``), and the bf16 ``F.linear`` of the dequantized weight (cuBLAS) as the baseline. Times are
CUDA-graph replay medians cycling through weight copies larger than the L2 (``kernels.bench.gemm.time_us``), so each
call reads its weights from HBM; TB/s counts the FP8 weight bytes (codes and scales) of the default path.

``--sweep`` times candidate configurations per shape and M (GEMV ones at M <= 4, GEMM ones at every M; each checked
against the reference first, mismatches reported as failures), prints the fastest three per shape and M, then two
summaries to set the tables from (``_GEMV_CUDA_CONFIGS``, ``_CUDA_CONFIGS``, ``GEMV_ROWS``): the fastest config of
each (shape, M) next to the default's time, and per M the configs with the lowest geometric mean, over the shapes,
of their time relative to that shape's fastest (one table row serves every shape). A full sweep takes longer than
one 10-minute device call: split it with ``--rows`` and ``--shapes``.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from kernels.bench.gemm import report, time_us
from kernels.fp8_block_gemm import (GEMV_ROWS, BlockConfig, GemvConfig, default_config, default_gemv_config,
                                    fp8_block_linear)
from kernels.gemv import GEMV_MAX_ROWS
from kernels.torch_quant import dequantize_weight_fp8_blocks, make_quant_linear

BLOCK = (128, 128)
# (model.linear, K, N)
SHAPES = [
    ("llama3-8b.qkv", 4096, 6144), ("llama3-8b.o_proj", 4096, 4096), ("llama3-8b.gate_up", 4096, 28672),
    ("llama3-8b.down", 14336, 4096),
    ("qwen3-8b.gate_up", 4096, 24576), ("qwen3-8b.down", 12288, 4096),  # qkv and o_proj: Llama-3-8B's
    ("deepseek-v3.qkv_a", 7168, 2112), ("deepseek-v3.q_b", 1536, 24576), ("deepseek-v3.kv_b", 512, 32768),
    ("deepseek-v3.o_proj", 16384, 7168), ("deepseek-v3.shared_gate_up", 7168, 4096),
    ("deepseek-v3.shared_down", 2048, 7168),
]
ROWS = (1, 2, 4, 8, 16, 64, 256, 1024)
REL_TOL = 1e-2  # of the output's max: a few bf16 ulps (and Hopper's FP8 MMA accumulation within a group); a bug is O(1)
COPIES_BYTES = 256 << 20  # weight bytes cycled per timing: past the H200's 60 MB L2


def gemv_candidates() -> list[GemvConfig]:
    """GEMV configs the sweep tries: (block_n, block_k, num_warps, num_stages) around the defaults (narrow tiles with
    long K steps; one stage where deeper pipelines spill at several rows), the first four at two auto-split targets."""
    tiles = [(16, 2048, 4, 3), (16, 1024, 4, 1), (16, 512, 4, 1), (16, 2048, 4, 1), (16, 2048, 4, 2),
             (16, 1024, 4, 3), (32, 1024, 4, 1), (32, 2048, 8, 3), (16, 512, 4, 2), (8, 1024, 4, 1), (32, 512, 4, 1),
             (64, 256, 4, 1), (16, 4096, 8, 2)]
    return ([GemvConfig(bn, bk, num_warps=w, num_stages=s, programs_per_sm=4) for bn, bk, w, s in tiles]
            + [GemvConfig(bn, bk, num_warps=w, num_stages=s, programs_per_sm=2) for bn, bk, w, s in tiles[:4]])


def gemm_candidates(m: int) -> list[BlockConfig]:
    """GEMM configs the sweep tries at ``m`` rows: tile rows around m, 64-256 columns, 4 / 8 warps, 3-5 stages; x
    quantized per program and by the pre-pass up to 16 rows, by the pre-pass above; split K auto, and none for the
    larger tiles. One stage's tiles stay within 64 KB of shared memory."""
    out = []
    if m <= 16:
        for bn in (64, 128, 256):
            for w in (4, 8):
                for s in (3, 4):
                    out += [BlockConfig(16, bn, num_warps=w, num_stages=s, prequant=p) for p in (False, True)]
        return out
    block_ms = (32, 64) if m <= 64 else (64, 128)
    for bm in block_ms:
        for bn in (64, 128, 256) if m <= 64 else (128, 256):
            for w in (4, 8):
                for s in (3, 4, 5):
                    if (bm + bn) * BLOCK[1] * s > 200 * 1024 or (s == 5 and bm + bn > 192):
                        continue
                    out.append(BlockConfig(bm, bn, num_warps=w, num_stages=s, prequant=True))
                    if bm >= 64 and s == 3:
                        out.append(BlockConfig(bm, bn, split_k=1, num_warps=w, num_stages=s, prequant=True))
    return out


def _weights(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    codes = (torch.randn(n, k, generator=gen, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.rand(-(-n // BLOCK[0]), -(-k // BLOCK[1]), generator=gen, device="cuda") * 1e-4 + 1e-5
    return codes, scales


def _x(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(m, k, generator=gen, device="cuda") * 2
    x[:, 7] *= 40  # an outlier channel: its group's scale differs from the others'
    return x.to(torch.bfloat16)


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _label(cfg) -> str:
    if isinstance(cfg, GemvConfig):
        split = f"split {cfg.split_k}" if cfg.split_k else f"{cfg.programs_per_sm or 'default'}/SM"
        return f"gemv {cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} {split}"
    if isinstance(cfg, BlockConfig):
        split = f"split {cfg.split_k}" if cfg.split_k else "split auto"
        return (f"gemm {cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} {split}"
                f"{' prequant' if cfg.prequant else ''}")
    return str(cfg)


class _Shape:
    """One shape's weights: FP8 copies and bf16 copies (each set past the L2), and the reference linear."""

    def __init__(self, k: int, n: int, gen: torch.Generator):
        codes, scales = _weights(n, k, gen)
        self.copies = [(codes, scales)] + [(codes.clone(), scales.clone())
                                           for _ in range(max(1, COPIES_BYTES // codes.numel()))]
        wb = dequantize_weight_fp8_blocks(codes, scales, BLOCK).to(torch.bfloat16)
        self.bf16 = [wb] + [wb.clone() for _ in range(max(1, COPIES_BYTES // (2 * wb.numel())))]
        self.ref = make_quant_linear("fp8_block", {"qweight": codes, "weight_scale": scales},
                                     {"block_size": list(BLOCK)}, torch.bfloat16)
        self.weight_bytes = codes.numel() + 4 * scales.numel()

    def fns(self, x: torch.Tensor, config=None) -> list:
        return [lambda q=q, s=s: fp8_block_linear(x, q, s, BLOCK, config=config) for q, s in self.copies]


def _timed(w: _Shape, x: torch.Tensor, ref: torch.Tensor, config, label: str, failures: list[str]) -> float:
    """us per call of fp8_block_linear at ``config`` (None: the dispatch's own), after checking it; nan when it
    mismatches (a failure) or does not compile on this GPU (printed)."""
    try:
        err = _rel_err(fp8_block_linear(x, *w.copies[0], BLOCK, config=config), ref)
        if not err < REL_TOL:
            failures.append(f"{label} {_label(config)}: rel.err {err:.3g}")
            return float("nan")
        return time_us(w.fns(x, config), reps=10)
    except (OutOfResources, CompilationError) as e:  # shared memory or registers: not a candidate on this GPU
        print(f"{'':>30} {_label(config)}: {type(e).__name__}: {str(e).splitlines()[0][:90]}")
        return float("nan")


def bench(shapes: list[tuple[str, int, int]], rows: list[int], sweep: bool) -> list[str]:
    failures: list[str] = []
    sweeps: dict[tuple[str, int], dict[str, float]] = {}
    defaults: dict[tuple[str, int], float] = {}
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"\nfp8_block linear, {BLOCK[0]} x {BLOCK[1]} blocks, bf16 x: us per call (CUDA graphs, weights rotated past "
          f"the L2); TB/s of FP8 weight bytes; speedup = bf16 / default")
    print(f"{'shape':>28} {'M':>4} | {'default':>8} {'gemv':>8} {'gemm':>8} {'bf16':>8} | {'TB/s':>5} | "
          f"{'speedup':>7} | rel.err  path")
    for name, k, n in shapes:
        w = _Shape(k, n, gen)
        for m in rows:
            x = _x(m, k, gen)
            ref = w.ref(x)
            label = f"{name} M={m}"
            err = _rel_err(fp8_block_linear(x, *w.copies[0], BLOCK), ref)
            if not err < REL_TOL:
                failures.append(f"{label} default: rel.err {err:.3g}")
            t = time_us(w.fns(x), reps=10)
            defaults[(name, m)] = t
            t_gemv = t_gemm = float("nan")
            if m <= GEMV_MAX_ROWS:  # both kernels at their defaults, whichever the dispatch picks
                t_gemv = _timed(w, x, ref, default_gemv_config(m, x.device), label, failures)
                t_gemm = _timed(w, x, ref, default_config(m, x.device), label, failures)
            t_bf16 = time_us([lambda wb=wb: F.linear(x, wb) for wb in w.bf16], reps=10)
            path = default_gemv_config(m, x.device) if m <= GEMV_ROWS else default_config(m, x.device)
            print(f"{name:>28} {m:>4} | {t:8.1f} {t_gemv:8.1f} {t_gemm:8.1f} {t_bf16:8.1f} | "
                  f"{w.weight_bytes / t / 1e6:5.2f} | {t_bf16 / t:6.2f}x | {err:.1e}  {_label(path)}", flush=True)
            if sweep:
                cands = (gemv_candidates() if m <= GEMV_MAX_ROWS else []) + gemm_candidates(m)
                times = {_label(c): _timed(w, x, ref, c, label, failures) for c in cands}
                times = {c: t for c, t in times.items() if not math.isnan(t)}
                sweeps[(name, m)] = times
                for c, tc in sorted(times.items(), key=lambda r: r[1])[:3]:
                    print(f"{'':>28} {'':>4}   sweep {tc:8.1f} us {w.weight_bytes / tc / 1e6:5.2f} TB/s  {c}",
                          flush=True)
        del w
        torch.cuda.empty_cache()
    if sweep:
        _summaries(sweeps, defaults)
    return failures


def _summaries(sweeps: dict[tuple[str, int], dict[str, float]], defaults: dict[tuple[str, int], float]) -> None:
    """The fastest config per (shape, M), and per M the configs fastest across the shapes (geometric mean of each
    config's time over the shape's fastest, over the shapes where it ran)."""
    print("\nfastest per shape and M (us; default = the dispatch's own config)")
    print(f"{'shape':>28} {'M':>4} | {'default':>8} {'best':>8} | best config")
    for (name, m), times in sweeps.items():
        if times:
            best = min(times, key=times.get)
            print(f"{name:>28} {m:>4} | {defaults[(name, m)]:8.1f} {times[best]:8.1f} | {best}")
    by_rows: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    num_shapes: dict[int, int] = defaultdict(int)
    for (name, m), times in sweeps.items():
        if not times:
            continue
        num_shapes[m] += 1
        fastest = min(times.values())
        for c, t in times.items():
            by_rows[m][c].append(t / fastest)
    print("\nper M, over the shapes: geometric mean of time / the shape's fastest (1.00 = fastest everywhere)")
    for m in sorted(by_rows):
        ranked = sorted(((math.exp(sum(map(math.log, r)) / len(r)), c) for c, r in by_rows[m].items()
                         if len(r) == num_shapes[m]))  # configs that ran on every shape
        for i, (score, c) in enumerate(ranked[:3]):
            print(f"  M={m:<5} {score:5.3f}  {c}" if i == 0 else f"  {'':7} {score:5.3f}  {c}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time candidate configs per shape and M")
    parser.add_argument("--rows", nargs="*", type=int, default=list(ROWS), help="rows of x (M)")
    parser.add_argument("--shapes", nargs="*", default=None,
                        help=f"shape names or model prefixes (default: all): {', '.join(s[0] for s in SHAPES)}")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernels.bench.fp8_block needs a CUDA GPU", file=sys.stderr)
        return 2
    shapes = SHAPES
    if args.shapes:
        shapes = [s for s in SHAPES if any(s[0] == a or s[0].startswith(a + ".") for a in args.shapes)]
        if not shapes:
            print(f"--shapes {' '.join(args.shapes)} names none of: {', '.join(s[0] for s in SHAPES)}",
                  file=sys.stderr)
            return 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    return report(bench(shapes, args.rows, args.sweep))


if __name__ == "__main__":
    sys.exit(main())
