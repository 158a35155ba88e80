"""GPU benchmark and correctness check of the w4a16 GEMM and the elementwise kernels.

    python -m kernels.bench.gemm              # Llama-3-8B shapes: check, then time (exit 1 on a mismatch)
    python -m kernels.bench.gemm --sweep      # also time candidate configs per shape (to tune _CUDA_CONFIGS)
    python -m kernels.bench.gemm --gemv-sweep # the GEMV table only, with candidate GemvConfigs per shape and M
    python -m kernels.bench.gemm --mma        # the tensor-core W4A16 / W8A16 kernel (kernels.w4a16_mma) table only
    python -m kernels.bench.gemm --mma-sweep  # that table with candidate MmaConfigs per shape at M = 1 ... 128
    python -m kernels.bench.gemm --frag       # the fragment-order W4A16 kernel (kernels.w4a16_frag), configs swept
    python -m kernels.bench.gemm --frag-gemm  # frag_gemm (tl.dot on the same layout) vs dequantize + cuBLAS, M 65-4096
    python -m kernels.bench.gemm --frag-mm    # frag_mm (kernels.frag_mm, one chained accumulator) vs frag_gemm,
                                              # dequantize + cuBLAS and bf16 cuBLAS, M 65-4096, configs swept
    python -m kernels.bench.gemm --w4a8       # W4A8 frag_mm_fp8 vs W4A16 frag_mm, FP8 W8A8 cuBLAS, bf16 cuBLAS

GEMM: fresh random w4a16 weights (group_size 128) at Llama-3-8B's linear shapes, M in 1..2048 rows.
Each is checked against ``ref_w4a16_linear``, then ``w4a16_linear`` is timed on the repacked
(``k_major``) and the passes' layouts against (a) torch bf16 matmul on the dequantized weight (what
the runtime runs today) and (b) the reference dequantize + fp32 matmul.
Times are CUDA-event medians over CUDA-graph replays (no launch overhead), cycling through enough
weight copies that each call reads from HBM, not L2. Reported: microseconds, GB/s of weight bytes
(packed codes + scales + zeros) for M <= 32, TFLOP/s otherwise.

GEMV: ``kernels.gemv.w4a16_gemv`` at M = 1, 2, 4 on the same shapes (checked against ``ref_w4a16_linear``),
timed the same way next to ``w4a16_linear`` (the GEMM the runtime used before) and bf16 ``F.linear``; TB/s of
weight bytes. ``--gemv-sweep`` times candidate ``GemvConfig``s (to tune ``kernels.gemv._W4A16_CUDA_CONFIGS``).

FRAG: ``kernels.w4a16_frag.w4a16_frag`` (weights in the MMA's register order, M = 1 ... 16, 4 bits, group 128) on
the same shapes, checked against ``ref_w4a16_linear``, each candidate ``FragConfig`` timed next to the mma kernel
(the runtime's path before it) and bf16 ``F.linear``; TB/s of weight bytes (``--frag``).

MMA: ``kernels.w4a16_mma.w4a16_mma`` on :func:`repack_mma`'s layout at M = 1 ... 256 (4 bits, group 128; and 8
bits per channel, the int8 weight-only scheme), checked against ``ref_w4a16_linear``, timed next to the path the
runtime took before it (GEMV at M = 1, else the GEMM below 256 rows), ``dequantize_mma`` + cuBLAS, and bf16
``F.linear``; TB/s of weight bytes.

Elementwise: rms_norm, fused_add_rms_norm, apply_rope_ and silu_mul against ``kernels.torch_ops`` at
[2048, 4096] and [1, 4096].
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

import kernels.w4a16_frag as frag_module
from kernels.frag_mm import MmConfig, frag_mm
from kernels.activation import ref_silu_mul, silu_mul
from kernels.fused_norm import (
    fused_add_rms_norm,
    ref_fused_add_rms_norm,
    ref_rms_norm,
    rms_norm,
)
from kernels.gemv import GemvConfig, default_gemv_config, w4a16_gemv
from kernels.w4a16_frag import FragConfig, dequantize_frag, frag_gemm, repack_frag, w4a16_frag
from kernels.w4a16_frag import GemmConfig as FragGemmConfig
from kernels.w4a16_mma import MmaConfig, default_mma_config, dequantize_mma, repack_mma, w4a16_mma
from kernels.rope import apply_rope_, ref_rope
from kernels.w4a16_gemm import (
    DEQUANT_MIN_ROWS,
    GemmConfig,
    default_config,
    ref_w4a16_linear,
    repack_w4a16,
    w4a16_linear,
)
from kernels.torch_quant import dequantize_weight

# (name, K, N): Llama-3-8B, hidden 4096, 32 query / 8 KV heads of 128, intermediate 14336
SHAPES = [("qkv", 4096, 6144), ("o_proj", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)]
ROWS = [1, 8, 32, 64, 128, 512, 2048]
GEMV_ROWS = [1, 2, 4]
GROUP_SIZE = 128
DTYPE = torch.bfloat16
ROTATE_BYTES = 256 << 20  # weights read per graph replay: well beyond the 50 MB L2
TOL = 2e-2


def time_us(fns: list[Callable[[], object]], reps: int = 20) -> float:
    """Median GPU time of one call, from CUDA-graph replays of ``fns`` called in turn."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:  # warm up (compiles Triton kernels) outside the graph
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    calls = max(len(fns), 8)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples)


def report(failures: list[str]) -> int:
    """Print the mismatches and the verdict; the exit status: 1 on a mismatch."""
    for f in failures:
        print(f"FAIL {f}", file=sys.stderr)
    print(f"\n{'FAILED' if failures else 'all checks passed'} ({len(failures)} failures)")
    return 1 if failures else 0


def random_w4a16(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random codes, zero points and positive scales in the passes' layout, on the GPU."""
    qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen, device="cuda")
    num_groups = k // GROUP_SIZE
    scales = torch.rand(n, num_groups, generator=gen, device="cuda") * 0.02 + 0.002
    zeros = torch.randint(0, 16, (n, num_groups), dtype=torch.uint8, generator=gen, device="cuda")
    return qweight, scales, zeros


def _close(y: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float]:
    err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-6)).item()
    ok = torch.allclose(y.float(), ref.float(), rtol=TOL, atol=TOL * ref.float().abs().max().item())
    return ok, err


def candidate_configs(m: int) -> list[GemmConfig]:
    """Fused-kernel configs the sweep tries for ``m`` rows."""
    if m <= 64:
        bm = min(max(16, 1 << (m - 1).bit_length()), 64)
        rows = [(128, 128, 0, 4, 4, False), (128, 128, 0, 4, 4, True), (64, 128, 0, 4, 4, False),
                (128, 256, 0, 4, 3, False), (256, 128, 0, 8, 3, False), (128, 128, 1, 4, 4, False),
                (128, 128, 8, 4, 4, False), (128, 64, 0, 4, 4, False), (64, 256, 0, 4, 3, False)]
        return [GemmConfig(bm, bn, bk, split_k=s, num_warps=w, num_stages=st, tf32_dot=tf)
                for bn, bk, s, w, st, tf in rows]
    if m < DEQUANT_MIN_ROWS:
        rows = [(128, 128, 64, 0, 4, 4, False), (64, 128, 64, 0, 4, 4, False), (128, 256, 64, 1, 8, 3, False),
                (128, 128, 64, 0, 8, 3, False), (64, 128, 128, 0, 4, 3, False), (128, 128, 64, 0, 4, 4, True)]
    else:  # for comparison with dequantize + cuBLAS
        rows = [(128, 256, 64, 1, 8, 3, False), (128, 128, 64, 1, 4, 4, False), (128, 128, 64, 1, 8, 3, False)]
    return [GemmConfig(bm, bn, bk, split_k=s, num_warps=w, num_stages=st, tf32_dot=tf)
            for bm, bn, bk, s, w, st, tf in rows]


@dataclass
class _ShapeWeights:
    """One linear's weights in every form the benchmark reads, with copies to rotate through."""

    row_major: list[dict]  # as the passes store them (w4a16_linear keyword arguments)
    k_major: list[dict]  # repack_w4a16
    bf16: list[torch.Tensor]  # dequantized [N, K], what the runtime multiplies by today
    weight_bytes: int  # packed codes + scales + zeros of one copy


def _make_weights(n: int, k: int, gen: torch.Generator) -> _ShapeWeights:
    first = random_w4a16(n, k, gen)
    weight_bytes = sum(t.numel() * t.element_size() for t in first)
    triples = [first] + [random_w4a16(n, k, gen) for _ in range(max(ROTATE_BYTES // weight_bytes, 1))]
    row_major = [{"qweight": q, "scales": s, "zeros": z, "group_size": GROUP_SIZE, "layout": "passes"}
                 for q, s, z in triples]
    k_major = [repack_w4a16(*w, GROUP_SIZE) for w in triples]
    bf16 = [dequantize_weight(*w, 4, GROUP_SIZE, DTYPE) for w in triples[: max(ROTATE_BYTES // (n * k * 2), 1)]]
    return _ShapeWeights(row_major, k_major, bf16, weight_bytes)


def _gemm_fns(x: torch.Tensor, packs: list[dict],
              config: GemmConfig | None = None) -> list[Callable[[], torch.Tensor]]:
    return [lambda p=p: w4a16_linear(x, **p, config=config) for p in packs]


def _path(m: int, device: torch.device) -> str:
    return "dequantize + cuBLAS" if m >= DEQUANT_MIN_ROWS else str(default_config(m, device))


def _bench_rows(name: str, m: int, w: _ShapeWeights, gen: torch.Generator, sweep: bool) -> list[str]:
    failures = []
    k = w.bf16[0].shape[1]
    n = w.bf16[0].shape[0]
    x = torch.randn(m, k, generator=gen, device="cuda").to(DTYPE)
    ref = ref_w4a16_linear(x, **w.row_major[0])
    worst = 0.0
    for label, packs in (("k-major", w.k_major), ("row-major", w.row_major)):
        ok, err = _close(_gemm_fns(x, packs[:1])[0](), ref)
        worst = max(worst, err)
        if not ok:
            failures.append(f"gemm {name} M={m} {label}: max rel err {err:.2e}")
    t_kmaj = time_us(_gemm_fns(x, w.k_major))
    t_row = time_us(_gemm_fns(x, w.row_major))
    t_bf16 = time_us([lambda wt=wt: F.linear(x, wt) for wt in w.bf16])
    t_ref = time_us([lambda: ref_w4a16_linear(x, **w.row_major[0])], reps=5)
    flops = 2 * m * n * k
    if m <= 32:
        rate, rate_bf16 = f"{w.weight_bytes / t_kmaj / 1e3:8.0f} GB/s", f"{n * k * 2 / t_bf16 / 1e3:8.0f} GB/s"
    else:
        rate, rate_bf16 = f"{flops / t_kmaj / 1e6:6.1f} TFLOP/s", f"{flops / t_bf16 / 1e6:6.1f} TFLOP/s"
    print(f"{name:>8} {m:5d} {k:6d} {n:6d} | {t_kmaj:8.1f} {t_row:8.1f} {t_bf16:10.1f} {t_ref:10.1f} | "
          f"{rate:>14} {rate_bf16:>14} | {worst:.1e}  {_path(m, x.device)}")
    if sweep:
        failures += _sweep(name, x, ref, w)
    return failures


def sweep_configs(label: str, candidates: list, check: Callable[[object], tuple[bool, float]],
                  timed: Callable[[object], list[Callable[[], object]]], *, indent: str = f"{'':>8} ",
                  weight_bytes: int | None = None, reps: int = 20, top: int = 3) -> list[str]:
    """Try each candidate config: ``check(cfg)`` -> (matches the reference, max rel err), then time the calls
    ``timed(cfg)`` (one per rotated weight copy); print the ``top`` fastest (with TB/s of ``weight_bytes`` when
    given). Returns the mismatches; configs that do not compile (shared memory, registers) are printed and
    skipped."""
    failures, results = [], []
    for cfg in candidates:
        try:
            ok, err = check(cfg)
            if not ok:
                failures.append(f"{label} {cfg}: max rel err {err:.2e}")
                continue
            results.append((time_us(timed(cfg), reps), cfg))
        except (OutOfResources, CompilationError) as e:  # too much shared memory / registers: skip it
            print(f"{indent}sweep {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
    for t, cfg in sorted(results, key=lambda r: r[0])[:top]:
        rate = f" {weight_bytes / t / 1e6:6.2f} TB/s" if weight_bytes else ""
        print(f"{indent}sweep {t:8.1f} us{rate}  {cfg}")
    return failures


def sweep_line(label: str, cand: object, us: float) -> str:
    """One candidate's line under SWEEP_VERBOSE (``kernels.bench.shape_table`` reads them back)."""
    return f"    {label} {cand}: {us:.1f} us"


def _fastest(label: str, default_us: float, candidates: list, failures: list[str],
             check: Callable[[object], tuple[bool, float]], timed: Callable[[object], list[Callable[[], object]]]
             ) -> tuple[float, str]:
    """(us, config) of the fastest of the default (``default_us``) and the candidates that match the reference
    (``check``; mismatches go to ``failures``, configs that do not compile on this GPU are skipped), each timed over
    ``timed(cfg)``'s calls."""
    best, best_cfg = default_us, "default"
    for cand in candidates:
        try:
            ok, err = check(cand)
        except OutOfResources:
            continue  # shared memory or registers: not a candidate on this GPU
        if not ok:
            failures.append(f"{label} {cand}: max rel err {err:.2e}")
            continue
        t = time_us(timed(cand))
        if SWEEP_VERBOSE:
            print(sweep_line(label, cand, t), flush=True)
        if t < best:
            best, best_cfg = t, str(cand)
    return best, best_cfg


def _sweep(name: str, x: torch.Tensor, ref: torch.Tensor, w: _ShapeWeights) -> list[str]:
    """Time the candidate configs for this shape; print the three fastest."""
    return sweep_configs(f"gemm {name} M={x.shape[0]}", candidate_configs(x.shape[0]),
                         lambda cand: _close(_gemm_fns(x, w.k_major[:1], cand)[0](), ref),
                         lambda cand: _gemm_fns(x, w.k_major, cand))


def bench_gemm(sweep: bool) -> list[str]:
    failures = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"w4a16 GEMM, group_size {GROUP_SIZE}, {DTYPE}; times in us (CUDA graphs, weights rotated past L2)")
    print(f"{'shape':>8} {'M':>5} {'K':>6} {'N':>6} | {'triton':>8} {'passes':>8} {'torch bf16':>10} "
          f"{'ref deq+mm':>10} | {'triton':>14} {'bf16':>14} | rel.err  config")
    for name, k, n in SHAPES:
        weights = _make_weights(n, k, gen)
        for m in ROWS:
            failures += _bench_rows(name, m, weights, gen, sweep)
        del weights
        torch.cuda.empty_cache()
    return failures


def gemv_candidates() -> list[GemvConfig]:
    """GEMV configs the --gemv-sweep tries (block_n, block_k, split_k, num_warps, num_stages): tile shapes around
    the default, pipeline depth, a few fixed K splits, and the second-kernel reduction."""
    rows = [(128, 256, 0, 4, 3), (128, 128, 0, 4, 3), (256, 128, 0, 4, 3), (128, 128, 0, 2, 4), (128, 512, 0, 4, 3),
            (256, 256, 0, 8, 3), (128, 256, 0, 4, 2), (128, 256, 0, 4, 4), (128, 256, 4, 4, 3), (128, 256, 16, 4, 3)]
    return ([GemvConfig(bn, bk, split_k=s, num_warps=w, num_stages=st) for bn, bk, s, w, st in rows]
            + [GemvConfig(128, 256, num_warps=4, num_stages=3, reduce_in_kernel=False)])


def _bench_gemv_rows(name: str, m: int, w: _ShapeWeights, gen: torch.Generator, sweep: bool) -> list[str]:
    failures = []
    n, k = w.bf16[0].shape
    x = torch.randn(m, k, generator=gen, device="cuda").to(DTYPE)
    ref = ref_w4a16_linear(x, **w.row_major[0])
    ok, err = _close(w4a16_gemv(x, **w.k_major[0]), ref)
    if not ok:
        failures.append(f"gemv {name} M={m}: max rel err {err:.2e}")
    t_gemv = time_us([lambda p=p: w4a16_gemv(x, **p) for p in w.k_major])
    t_gemm = time_us(_gemm_fns(x, w.k_major))
    t_bf16 = time_us([lambda wt=wt: F.linear(x, wt) for wt in w.bf16])
    tbs = w.weight_bytes / t_gemv / 1e6
    print(f"{name:>8} {m:3d} {k:6d} {n:6d} | {t_gemv:8.1f} {t_gemm:8.1f} {t_bf16:8.1f} | {tbs:6.2f} "
          f"{w.weight_bytes / t_gemm / 1e6:6.2f} {n * k * 2 / t_bf16 / 1e6:6.2f} | {err:.1e}  "
          f"{default_gemv_config('w4a16', m, x.device)}")
    if sweep:
        failures += _gemv_sweep(name, x, ref, w)
    return failures


def _gemv_sweep(name: str, x: torch.Tensor, ref: torch.Tensor, w: _ShapeWeights) -> list[str]:
    """Time the candidate GEMV configs for this shape and M; print the three fastest."""
    return sweep_configs(f"gemv {name} M={x.shape[0]}", gemv_candidates(),
                         lambda cand: _close(w4a16_gemv(x, **w.k_major[0], config=cand), ref),
                         lambda cand: [lambda p=p: w4a16_gemv(x, **p, config=cand) for p in w.k_major],
                         weight_bytes=w.weight_bytes)


def bench_gemv(sweep: bool) -> list[str]:
    failures = []
    gen = torch.Generator(device="cuda").manual_seed(2)
    print(f"\nw4a16 GEMV (kernels.gemv), group_size {GROUP_SIZE}, {DTYPE}; times in us (CUDA graphs, weights "
          "rotated past L2); TB/s of weight bytes (bf16: of the bf16 weight)")
    print(f"{'shape':>8} {'M':>3} {'K':>6} {'N':>6} | {'gemv':>8} {'gemm':>8} {'bf16':>8} | {'gemv':>6} {'gemm':>6} "
          f"{'bf16':>6} | rel.err  config")
    for name, k, n in SHAPES:
        weights = _make_weights(n, k, gen)
        for m in GEMV_ROWS:
            failures += _bench_gemv_rows(name, m, weights, gen, sweep)
        del weights
        torch.cuda.empty_cache()
    return failures


MMA_ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
MMA_SWEEP_ROWS = [1, 16, 32, 64, 128]
SWEEP_VERBOSE = os.environ.get("SWEEP_VERBOSE", "0") != "0"  # --frag / --frag-gemm: every candidate's time too
SWEEP_TOP = int(os.environ.get("SWEEP_TOP", "3"))  # --mma-sweep: how many of the fastest configurations to print


def mma_candidates(m: int) -> list[MmaConfig]:
    """MmaConfigs the --mma-sweep tries (block_n, block_r, num_warps, num_stages, split_k, ptx_unpack)."""
    bm = min(max(16, 1 << (m - 1).bit_length()), 128)
    if m > 16:  # the dequantizing variant: (block_n, block_m, num_warps, num_stages)
        rows = [(128, bm, 4, 3), (128, bm, 4, 2), (128, bm, 8, 3), (64, bm, 4, 3), (256, bm, 8, 3), (128, 64, 4, 3),
                (128, 32, 4, 3), (64, 64, 4, 4)]
        return [MmaConfig(bn, b, dequant=True, num_warps=w, num_stages=st) for bn, b, w, st in rows]
    # up to 16 rows, on tiled weights (block_n is the layout's tile): (chunks, num_warps, num_stages, split_k, zsub)
    rows = [(1, 4, 1, 0, False), (1, 4, 3, 0, False), (2, 4, 3, 0, False), (1, 4, 1, 0, True), (1, 4, 2, 0, True),
            (1, 4, 3, 0, True), (2, 4, 1, 0, True), (2, 4, 2, 0, True), (2, 4, 3, 0, True), (2, 8, 2, 0, True),
            (1, 8, 2, 0, True), (1, 8, 3, 0, True), (1, 4, 2, 16, True)]
    return [MmaConfig(128, bm, chunks=ch, split_k=sk, num_warps=w, num_stages=st, zsub=z)
            for ch, w, st, sk, z in rows]


def random_w8(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random 8-bit codes, per-channel scales and the fixed zero point 128 (the int8 weight-only scheme)."""
    qweight = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen, device="cuda")
    scales = torch.rand(n, 1, generator=gen, device="cuda") * 0.002 + 0.0002
    return qweight, scales, torch.full((n, 1), 128, dtype=torch.uint8, device="cuda")


@dataclass
class _Rotated:
    """Random weight-only weights of one shape: ``triples`` (qweight, scales, zeros) in the passes' layout, enough
    copies that each timed call reads from HBM (the first is the one checked), and ``bf16`` dequantized copies for
    cuBLAS, as many as ROTATE_BYTES holds."""

    bits: int
    group: int
    triples: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    weight_bytes: int  # of one copy: codes, scales, zeros
    bf16: list[torch.Tensor]

    def passes(self, i: int = 0) -> dict:
        q, s, z = self.triples[i]
        return {"qweight": q, "scales": s, "zeros": z, "group_size": self.group, "bits": self.bits, "layout": "passes"}


def _rotated_weights(n: int, k: int, bits: int, gen: torch.Generator) -> _Rotated:
    """4 bits: groups of GROUP_SIZE; 8 bits: per channel (the int8 weight-only scheme)."""
    group = GROUP_SIZE if bits == 4 else -1
    make = random_w4a16 if bits == 4 else random_w8
    first = make(n, k, gen)
    weight_bytes = sum(t.numel() * t.element_size() for t in first)
    triples = [first] + [make(n, k, gen) for _ in range(max(ROTATE_BYTES // weight_bytes, 1))]
    copies = max(ROTATE_BYTES // (n * k * 2), 1)
    bf16 = [dequantize_weight(q, s, z, bits, group, DTYPE) for q, s, z in triples[:copies]]
    return _Rotated(bits, group, triples, weight_bytes, bf16)


def _bench_mma_shape(name: str, k: int, n: int, bits: int, gen: torch.Generator, sweep: bool,
                     rows: list[int]) -> list[str]:
    failures = []
    rot = _rotated_weights(n, k, bits, gen)
    group, triples, weight_bytes, bf16 = rot.group, rot.triples, rot.weight_bytes, rot.bf16
    passes = [rot.passes(i) for i in range(len(triples))]
    mma = [repack_mma(q, s, z, group, bits, tiled=True) for q, s, z in triples]
    untiled = [repack_mma(q, s, z, group, bits, tiled=False) for q, s, z in triples]
    k_major = [repack_w4a16(q, s, z, group, bits) for q, s, z in triples]
    for m in rows:
        x = torch.randn(m, k, generator=gen, device="cuda").to(DTYPE)
        ref = ref_w4a16_linear(x, **passes[0])
        ok, err = _close(w4a16_mma(x, **mma[0]), ref)
        ok_d, err_d = _close(F.linear(x, dequantize_mma(**mma[0], dtype=DTYPE)), ref)
        if not ok:
            failures.append(f"mma {bits}-bit {name} M={m}: max rel err {err:.2e}")
        if not ok_d:
            failures.append(f"dequantize_mma {bits}-bit {name} M={m}: max rel err {err_d:.2e}")
        t_mma = time_us([lambda p=p: w4a16_mma(x, **p) for p in mma])
        t_flat = float("nan")
        if m in MMA_SWEEP_ROWS:
            ok_u, err_u = _close(w4a16_mma(x, **untiled[0]), ref)
            if not ok_u:
                failures.append(f"mma untiled {bits}-bit {name} M={m}: max rel err {err_u:.2e}")
            t_flat = time_us([lambda p=p: w4a16_mma(x, **p) for p in untiled])
        if m == 1:
            before = time_us([lambda p=p: w4a16_gemv(x, **p) for p in k_major])
        elif m < DEQUANT_MIN_ROWS:
            before = time_us([lambda p=p: w4a16_linear(x, **p) for p in k_major])
        else:
            before = float("nan")
        t_deq = time_us([lambda p=p: F.linear(x, dequantize_mma(**p, dtype=DTYPE)) for p in mma[:4]])
        t_bf16 = time_us([lambda wt=wt: F.linear(x, wt) for wt in bf16])
        print(f"{name:>8} {bits:2d} {m:4d} {k:6d} {n:6d} | {t_mma:8.1f} {t_flat:8.1f} {before:8.1f} {t_deq:8.1f} "
              f"{t_bf16:8.1f} | "
              f"{weight_bytes / t_mma / 1e6:6.2f} {n * k * 2 / t_bf16 / 1e6:6.2f} | {max(err, err_d):.1e}  "
              f"{default_mma_config(m, x.device, n, bits)}")
        if sweep and m in MMA_SWEEP_ROWS:
            failures += sweep_configs(f"mma {bits}-bit {name} M={m}", mma_candidates(m),
                                      lambda cand: _close(w4a16_mma(x, **mma[0], config=cand), ref),
                                      lambda cand: [lambda p=p: w4a16_mma(x, **p, config=cand) for p in mma],
                                      weight_bytes=weight_bytes, top=SWEEP_TOP)
    return failures


def bench_mma(sweep: bool, shapes: list[str] | None = None, rows: list[int] | None = None,
              bits_list: list[int] | None = None) -> list[str]:
    failures = []
    gen = torch.Generator(device="cuda").manual_seed(3)
    print(f"\nW4A16 (group {GROUP_SIZE}) / W8A16 (per channel) on tensor cores (kernels.w4a16_mma), {DTYPE}; times in "
          "us (CUDA graphs, weights rotated past L2); 'before': the runtime's previous path (GEMV at M = 1, the GEMM "
          "below 256 rows); 'untiled': the mma kernel on rows of K/2 bytes (M = 1 ... 128); TB/s of weight bytes (bf16: of "
          "the bf16 weight)")
    print(f"{'shape':>8} {'b':>2} {'M':>4} {'K':>6} {'N':>6} | {'mma':>8} {'untiled':>8} {'before':>8} {'deq+mm':>8} "
          f"{'bf16':>8} | "
          f"{'mma':>6} {'bf16':>6} | rel.err  config")
    for bits in bits_list or (4, 8):
        for name, k, n in SHAPES:
            if shapes and name not in shapes:
                continue
            failures += _bench_mma_shape(name, k, n, bits, gen, sweep, rows or MMA_ROWS)
            torch.cuda.empty_cache()
    return failures


FRAG_ROWS = [1, 2, 4, 8, 16, 32, 64, 128]


def frag_candidates() -> list[FragConfig]:
    return [FragConfig(warps=w, split_k=s, depth=d) for w in (2, 4, 8) for d in (1, 2, 4)
            for s in (0, 2, 4, 8, 12, 16, 24, 32)]


# --frag with KERNELS_BENCH_FRAG_LOADS_ONLY=1: the default config's time ("frag") is its K loop's loads alone, the
# compute replaced by an XOR of what they loaded (4 bits, up to 8 rows): how fast the kernel could go if its
# instructions cost nothing
LOADS_ONLY = os.environ.get("KERNELS_BENCH_FRAG_LOADS_ONLY", "0") != "0"


def bench_frag(shapes: list[str] | None = None, rows: list[int] | None = None, sweep: bool = True,
               bits: int = 4) -> list[str]:
    failures = []
    gen = torch.Generator(device="cuda").manual_seed(5)
    print(f"\n{'W4A16 (group ' + str(GROUP_SIZE) + ')' if bits == 4 else 'W8A16 (per channel)'} in the MMA's register "
          f"order (kernels.w4a16_frag) vs kernels.w4a16_mma, {DTYPE}; "
          "times in us (CUDA graphs, weights rotated past L2); TB/s of weight bytes (codes, scales, zeros; bf16: its "
          "weight); best: the fastest candidate config")
    print(f"{'shape':>8} {'M':>3} | {'frag':>7} {'best':>7} {'mma':>7} {'bf16':>7} | {'frag':>5} {'best':>5} {'mma':>5} "
          f"{'bf16':>5} | rel.err  best config")
    for name, k, n in SHAPES:
        if shapes and name not in shapes:
            continue
        rot = _rotated_weights(n, k, bits, gen)
        group, triples, weight_bytes, bf16, passes = rot.group, rot.triples, rot.weight_bytes, rot.bf16, rot.passes()
        frag = [repack_frag(q, s_, z, group, bits) for q, s_, z in triples]
        mma = [repack_mma(q, s_, z, group, bits, tiled=True) for q, s_, z in triples]
        ok_d, err_d = _close(dequantize_frag(**frag[0], dtype=torch.float32),
                             dequantize_weight(*triples[0], bits, group, torch.float32))
        if not ok_d:
            failures.append(f"dequantize_frag {name}: max rel err {err_d:.2e}")
        t_deq_frag = time_us([lambda p=p: dequantize_frag(**p, dtype=DTYPE) for p in frag[:4]])
        t_deq_mma = time_us([lambda p=p: dequantize_mma(**p, dtype=DTYPE) for p in mma[:4]])
        print(f"{name:>8} dequantize to bf16: frag {t_deq_frag:.1f} us, mma {t_deq_mma:.1f} us")
        for m in rows or FRAG_ROWS:
            x = torch.randn(m, k, generator=gen, device="cuda").to(DTYPE)
            ref = ref_w4a16_linear(x, **passes)
            ok, err = _close(w4a16_frag(x, **frag[0]), ref)
            if not ok:
                failures.append(f"frag {name} M={m}: max rel err {err:.2e}")
            frag_module._BENCH_LOADS_ONLY = LOADS_ONLY  # checked above with the compute; timed without it
            t_frag = time_us([lambda p=p: w4a16_frag(x, **p) for p in frag])
            frag_module._BENCH_LOADS_ONLY = False
            best, best_cfg = _fastest(
                f"frag {name} M={m}", t_frag, frag_candidates() if sweep else [], failures,
                lambda cand: _close(w4a16_frag(x, **frag[0], config=cand), ref),
                lambda cand: [lambda p=p: w4a16_frag(x, **p, config=cand) for p in frag])
            t_mma = time_us([lambda p=p: w4a16_mma(x, **p) for p in mma])
            t_bf16 = time_us([lambda wt=wt: F.linear(x, wt) for wt in bf16])
            print(f"{name:>8} {m:3d} | {t_frag:7.1f} {best:7.1f} {t_mma:7.1f} {t_bf16:7.1f} | "
                  f"{weight_bytes / t_frag / 1e6:5.2f} {weight_bytes / best / 1e6:5.2f} {weight_bytes / t_mma / 1e6:5.2f} "
                  f"{n * k * 2 / t_bf16 / 1e6:5.2f} | {err:.1e}  {best_cfg}", flush=True)
        torch.cuda.empty_cache()
    return failures


def _checked_sweep(label: str, fn: Callable, x: torch.Tensor, ref: torch.Tensor, packs: list[dict],
                   candidates: list, failures: list[str]) -> tuple[float, float, float, str]:
    """``fn(x, **pack)`` with its default config checked against ``ref`` (a mismatch goes to ``failures``) and timed
    over the rotated ``packs``, then the candidates (``_fastest``): (max rel err, default us, best us, best config)."""
    ok, err = _close(fn(x, **packs[0]), ref)
    if not ok:
        failures.append(f"{label}: max rel err {err:.2e}")
    t_default = time_us([lambda p=p: fn(x, **p) for p in packs])
    best, best_cfg = _fastest(label, t_default, candidates, failures,
                              lambda cand: _close(fn(x, **packs[0], config=cand), ref),
                              lambda cand: [lambda p=p: fn(x, **p, config=cand) for p in packs])
    return err, t_default, best, best_cfg


FRAG_GEMM_ROWS = [65, 128, 256, 512, 1024, 2048, 4096]


def frag_gemm_candidates() -> list[FragGemmConfig]:
    return [FragGemmConfig(bm, tn, w, st, sk) for bm, tn, w, st, sk in (
        (64, 4, 4, 3, 0), (64, 8, 4, 3, 0), (64, 2, 4, 3, 0), (128, 4, 4, 3, 0), (128, 8, 8, 3, 0),
        (64, 4, 4, 3, 1), (128, 8, 8, 3, 1))]


def bench_frag_gemm(shapes: list[str] | None = None, rows: list[int] | None = None, sweep: bool = True,
                    bits: int = 4) -> list[str]:
    """frag_gemm against what the runtime ran before past FRAG_RUNTIME_MAX_ROWS (dequantize_frag + F.linear) and bf16
    F.linear alone, per linear of the 8B shape; the default config and the best candidate. 4 bits: group 128;
    8 bits: per channel (int8 weight-only)."""
    failures = []
    gen = torch.Generator(device="cuda").manual_seed(6)
    print(f"\nW{bits}A16 (group {GROUP_SIZE if bits == 4 else -1}) frag_gemm vs dequantize_frag + F.linear, {DTYPE}; us (CUDA graphs, weights "
          "rotated past L2); TFLOP/s of the default and of bf16 F.linear")
    print(f"{'shape':>8} {'M':>5} | {'gemm':>8} {'best':>8} {'deq+mm':>8} {'bf16 mm':>8} | {'TFLOP/s':>7} {'bf16':>7} | "
          "rel.err  best config")
    for name, k, n in SHAPES:
        if shapes and name not in shapes:
            continue
        rot = _rotated_weights(n, k, bits, gen)
        weight_bytes, bf16, passes = rot.weight_bytes, rot.bf16, rot.passes()
        frag = [repack_frag(q, s_, z, rot.group, bits) for q, s_, z in rot.triples]
        for m in rows or FRAG_GEMM_ROWS:
            x = torch.randn(m, k, generator=gen, device="cuda").to(DTYPE)
            ref = ref_w4a16_linear(x, **passes)
            err, t_gemm, best, best_cfg = _checked_sweep(f"frag_gemm {name} M={m}", frag_gemm, x, ref, frag,
                                                         frag_gemm_candidates() if sweep else [], failures)
            t_deq = time_us([lambda p=p: F.linear(x, dequantize_frag(**p, dtype=DTYPE)) for p in frag[:4]])
            if m == (rows or FRAG_GEMM_ROWS)[0]:  # the dequantization alone, both kernels
                t_new = time_us([lambda p=p: dequantize_frag(**p, dtype=DTYPE) for p in frag[:4]])
                t_old = time_us([lambda p=p: dequantize_frag(**p, dtype=DTYPE, by_words=False) for p in frag[:4]])
                moved = (n * k * 2 + weight_bytes) / 1e6  # MB written and read
                print(f"{name:>8} dequantize_frag: by words {t_new:.1f} us ({moved / t_new:.2f} TB/s), "
                      f"by bytes {t_old:.1f} us ({moved / t_old:.2f} TB/s)", flush=True)
            t_bf16 = time_us([lambda wt=wt: F.linear(x, wt) for wt in bf16])
            print(f"{name:>8} {m:5d} | {t_gemm:8.1f} {best:8.1f} {t_deq:8.1f} {t_bf16:8.1f} | "
                  f"{2 * m * n * k / t_gemm / 1e6:7.1f} {2 * m * n * k / t_bf16 / 1e6:7.1f} | {err:.1e}  {best_cfg}",
                  flush=True)
        del frag, bf16, rot
        torch.cuda.empty_cache()
    return failures


FRAG_MM_ROWS = [65, 128, 256, 512]


def frag_mm_candidates(bits: int = 4) -> list[MmConfig]:
    """block_m, tiles_n, warps, stages, split_k (0: auto), swapped operands, x by column indices, MMA order."""
    if bits == 8:
        return [MmConfig(*c) for c in ((128, 8, 8, 3, 0), (64, 8, 4, 4, 0), (128, 8, 8, 3, 0, True),
                                       (64, 16, 8, 3, 0), (128, 4, 4, 3, 0))] + [
            MmConfig(*c, swap=True, mma_order=True) for c in ((128, 4, 4, 3, 0), (256, 8, 8, 3, 0), (128, 8, 8, 3, 0))]
    if os.environ.get("FRAG_MM_SPLIT_SWEEP", "0") != "0":  # explicit K splits against the auto one (packed)
        return [MmConfig(*c, swap=True, mma_order=True, packed=True) for c in (
            [(128, 4, 4, 3, s) for s in (0, 1, 2, 3, 4, 6)] + [(256, 8, 8, 3, s) for s in (0, 1, 2, 3)])]
    if os.environ.get("FRAG_MM_PACKED_SWEEP", "0") != "0":  # the packed dequantization against the fp32 one
        return [MmConfig(*c, swap=True, mma_order=True, packed=p) for c in (
            (256, 8, 8, 3, 0), (128, 4, 4, 3, 0), (128, 8, 8, 3, 0)) for p in (False, True)]
    return [MmConfig(*c, swap=True, mma_order=True) for c in (
        (256, 8, 8, 3, 0), (128, 16, 8, 3, 0), (128, 4, 4, 3, 0), (64, 4, 4, 3, 0), (128, 8, 8, 4, 0),
        (256, 4, 4, 3, 0), (64, 8, 4, 4, 0), (128, 8, 8, 3, 0), (128, 4, 4, 4, 0))]


def bench_frag_mm(shapes: list[str] | None = None, rows: list[int] | None = None, sweep: bool = True,
                  bits: int = 4) -> list[str]:
    """frag_mm (its default config and the fastest candidate) against frag_gemm's default, dequantize_frag +
    F.linear (the runtime's path past frag_gemm's rows) and bf16 F.linear alone, per linear of the 8B shape, each
    checked against the fp32 reference first. 4 bits: group 128; 8 bits: per channel."""
    failures = []
    gen = torch.Generator(device="cuda").manual_seed(7)
    print(f"\nW{bits}A16 frag_mm vs frag_gemm vs dequantize_frag + F.linear vs bf16 F.linear, {DTYPE}; us (CUDA "
          "graphs, weights rotated past L2); TFLOP/s of frag_mm's best and of bf16 F.linear")
    print(f"{'shape':>8} {'M':>5} | {'mm':>8} {'mm best':>8} {'gemm':>8} {'deq+mm':>8} {'bf16 mm':>8} | "
          f"{'TFLOP/s':>7} {'bf16':>7} | rel.err  best config")
    for name, k, n in SHAPES:
        if shapes and name not in shapes:
            continue
        rot = _rotated_weights(n, k, bits, gen)
        bf16, passes = rot.bf16, rot.passes()
        frag = [repack_frag(q, s_, z, rot.group, bits) for q, s_, z in rot.triples]
        for m in rows or FRAG_MM_ROWS:
            x = torch.randn(m, k, generator=gen, device="cuda").to(DTYPE)
            ref = ref_w4a16_linear(x, **passes)
            err, t_mm, best, best_cfg = _checked_sweep(f"frag_mm {name} M={m}", frag_mm, x, ref, frag,
                                                       frag_mm_candidates(bits) if sweep else [], failures)
            t_gemm = time_us([lambda p=p: frag_gemm(x, **p) for p in frag])
            t_deq = time_us([lambda p=p: F.linear(x, dequantize_frag(**p, dtype=DTYPE)) for p in frag[:4]])
            t_bf16 = time_us([lambda wt=wt: F.linear(x, wt) for wt in bf16])
            print(f"{name:>8} {m:5d} | {t_mm:8.1f} {best:8.1f} {t_gemm:8.1f} {t_deq:8.1f} {t_bf16:8.1f} | "
                  f"{2 * m * n * k / best / 1e6:7.1f} {2 * m * n * k / t_bf16 / 1e6:7.1f} | {err:.1e}  {best_cfg}",
                  flush=True)
        del frag, bf16, rot
        torch.cuda.empty_cache()
    return failures


def frag_mm_fp8_candidates() -> list[MmConfig]:
    """block_m, tiles_n, warps, stages, split_k (0: auto); ``packed``: the inline-PTX e4m3 codes (_E4M3_ASM);
    ``pair``: two groups a loop step. Wide feature tiles: each program reads its rows of x from L2 (session 51: at
    64 x 64 tiles x's e4m3 codes are 4x the weights' bytes through L2 at 128 rows)."""
    if os.environ.get("W4A8_WIDE_SWEEP", "0") != "0":  # session 51's second sweep: none of these won
        return [MmConfig(*c, swap=True, mma_order=True, packed=True, pair=p) for c in (
            (64, 16, 8, 3, 0), (64, 16, 8, 4, 0), (32, 16, 8, 4, 0), (64, 8, 4, 3, 0), (64, 8, 8, 3, 0),
            (128, 8, 8, 3, 0)) for p in (False, True)]
    return [MmConfig(*c, swap=True, mma_order=True, packed=True) for c in (
        (64, 4, 4, 4, 0), (128, 4, 4, 3, 0), (64, 8, 8, 3, 0), (64, 4, 4, 3, 0), (32, 4, 4, 4, 0))]


def bench_w4a8(shapes: list[str] | None = None, rows: list[int] | None = None, sweep: bool = True) -> list[str]:
    """W4A8 (kernels.frag_mm.frag_mm_fp8: x quantized per token to e4m3, the 4-bit codes as e4m3 on the fp8 MMA)
    against W4A16 frag_mm, the FP8 W8A8 path (quantize_rows + cuBLAS's row-wise ``_scaled_mm`` on an e4m3 copy of
    the weight) and bf16 F.linear, per linear of the 8B shape; each W4A8 config checked against the fp32 reference
    of the same arithmetic (``ref_w4a8_linear``) first. Times include the activation quantization of both FP8
    paths."""
    from kernels.frag_mm import frag_mm_fp8, ref_w4a8_linear
    from kernels.torch_quant import make_fp8_scaled_mm_linear, quantize_weight_fp8
    from kernels.w8a8_gemm import quantize_rows, round_rows_fp8

    failures = []
    gen = torch.Generator(device="cuda").manual_seed(8)
    print(f"\nW4A8 frag_mm_fp8 vs W4A16 frag_mm vs FP8 W8A8 (quantize_rows + _scaled_mm) vs bf16 F.linear, {DTYPE} "
          "x; us (CUDA graphs, weights rotated past L2); TFLOP/s of W4A8's best, FP8's and bf16's")
    print(f"{'shape':>8} {'M':>5} | {'w4a8':>8} {'best':>8} {'w4a16':>8} {'deq+mm':>8} {'fp8':>8} {'bf16 mm':>8} | "
          f"{'TFLOP/s':>7} {'fp8':>7} {'bf16':>7} | rel.err  best config")

    def qrows(x2):
        return quantize_rows(x2, torch.float8_e4m3fn)

    for name, k, n in SHAPES:
        if shapes and name not in shapes:
            continue
        rot = _rotated_weights(n, k, 4, gen)
        bf16 = rot.bf16
        frag = [repack_frag(q, s_, z, rot.group, 4) for q, s_, z in rot.triples]
        fp8 = [make_fp8_scaled_mm_linear(dict(zip(("qweight", "weight_scale"), quantize_weight_fp8(wt, True))), qrows)
               for wt in bf16]
        for m in rows or FRAG_MM_ROWS:
            x = torch.randn(m, k, generator=gen, device="cuda").to(DTYPE)
            ref = ref_w4a8_linear(x, **frag[0])
            err, t_mm, best, best_cfg = _checked_sweep(f"frag_mm_fp8 {name} M={m}", frag_mm_fp8, x, ref, frag,
                                                       frag_mm_fp8_candidates() if sweep else [], failures)
            t_w4a16 = time_us([lambda p=p: frag_mm(x, **p) for p in frag])
            # the W4A16 paths past frag_mm's rows: x rounded to e4m3, the weight dequantized for cuBLAS
            t_deq = time_us([lambda p=p: F.linear(round_rows_fp8(x), dequantize_frag(**p, dtype=DTYPE))
                             for p in frag[:4]])
            t_fp8 = time_us([lambda f=f: f(x) for f in fp8])
            t_bf16 = time_us([lambda wt=wt: F.linear(x, wt) for wt in bf16])
            flop = 2 * m * n * k / 1e6
            print(f"{name:>8} {m:5d} | {t_mm:8.1f} {best:8.1f} {t_w4a16:8.1f} {t_deq:8.1f} {t_fp8:8.1f} {t_bf16:8.1f} | "
                  f"{flop / best:7.1f} {flop / t_fp8:7.1f} {flop / t_bf16:7.1f} | {err:.1e}  {best_cfg}", flush=True)
        del frag, bf16, fp8, rot
        torch.cuda.empty_cache()
    return failures


def _bench_elementwise_rows(t: int, gen: torch.Generator) -> list[str]:
    failures = []
    hidden, num_heads, head_dim = 4096, 32, 128
    weight = (torch.randn(hidden, generator=gen, device="cuda") * 0.1 + 1.0).to(DTYPE)
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2, device="cuda", dtype=torch.float32) / head_dim)
    x = torch.randn(t, hidden, generator=gen, device="cuda").to(DTYPE)
    res = torch.randn(t, hidden, generator=gen, device="cuda").to(DTYPE)
    gate_up = (torch.randn(t, 2 * hidden, generator=gen, device="cuda") * 3).to(DTYPE)
    positions = torch.randint(0, 8192, (t,), generator=gen, device="cuda")
    # (name, kernel, reference, kernel as timed): rope is checked on a copy, timed in place
    cases = [
        ("rms_norm", lambda: rms_norm(x, weight, 1e-5), lambda: ref_rms_norm(x, weight, 1e-5), None),
        ("fused_add_rms_norm", lambda: fused_add_rms_norm(x, res, weight, 1e-5)[0],
         lambda: ref_fused_add_rms_norm(x, res, weight, 1e-5)[0], None),
        ("rope (in place)", lambda: apply_rope_(x.clone(), positions, inv_freq, num_heads, head_dim),
         lambda: ref_rope(x, positions, inv_freq, num_heads, head_dim),
         lambda: apply_rope_(x, positions, inv_freq, num_heads, head_dim)),
        ("silu_mul", lambda: silu_mul(gate_up), lambda: ref_silu_mul(gate_up), None),
    ]
    for name, fn, ref_fn, timed_fn in cases:
        ok, err = _close(fn(), ref_fn())
        if not ok:
            failures.append(f"{name} tokens={t}: max rel err {err:.2e}")
        print(f"{name:>20} {t:6d} | {time_us([timed_fn or fn]):8.1f} {time_us([ref_fn]):8.1f} | {err:.1e}")
    return failures


def bench_elementwise() -> list[str]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    print("\nelementwise kernels vs kernels.torch_ops (torch), bf16; times in us (CUDA graphs)")
    print(f"{'op':>20} {'tokens':>6} | {'triton':>8} {'torch':>8} | rel.err")
    return [f for t in (2048, 1) for f in _bench_elementwise_rows(t, gen)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time candidate configs per shape")
    parser.add_argument("--gemv-sweep", action="store_true",
                        help="only the GEMV table, timing candidate GEMV configs per shape and M")
    parser.add_argument("--mma", action="store_true", help="only the tensor-core W4A16 / W8A16 table")
    parser.add_argument("--mma-sweep", action="store_true",
                        help="the tensor-core table, timing candidate MmaConfigs per shape at M = 1, 16, 32, 64, 128")
    parser.add_argument("--shapes", nargs="*", help="--mma / --mma-sweep / --frag: only these shapes (qkv o_proj gate_up down)")
    parser.add_argument("--rows", nargs="*", type=int, help="--mma / --mma-sweep / --frag: only these M")
    parser.add_argument("--bits", nargs="*", type=int, help="--mma / --mma-sweep / --frag: only these widths (4 8)")
    parser.add_argument("--frag", action="store_true",
                        help="only the fragment-order W4A16 table (kernels.w4a16_frag), with candidate FragConfigs")
    parser.add_argument("--frag-gemm", action="store_true",
                        help="only frag_gemm (kernels.w4a16_frag, M >= 65) vs dequantize + cuBLAS, with candidate configs")
    parser.add_argument("--frag-mm", action="store_true",
                        help="only frag_mm (kernels.frag_mm) vs frag_gemm, dequantize + cuBLAS and bf16 cuBLAS")
    parser.add_argument("--w4a8", action="store_true",
                        help="only W4A8 frag_mm_fp8 vs W4A16 frag_mm, FP8 W8A8 cuBLAS and bf16 cuBLAS")
    parser.add_argument("--no-sweep", action="store_true",
                        help="--frag / --frag-gemm / --frag-mm: the default config only")
    parser.add_argument("--skip-elementwise", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_gemm needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference matmul at full precision
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if args.w4a8:
        failures = bench_w4a8(shapes=args.shapes, rows=args.rows, sweep=not args.no_sweep)
    elif args.frag_mm:
        failures = [f for b in (args.bits or [4]) for f in
                    bench_frag_mm(shapes=args.shapes, rows=args.rows, sweep=not args.no_sweep, bits=b)]
    elif args.frag_gemm:
        failures = [f for b in (args.bits or [4]) for f in
                    bench_frag_gemm(shapes=args.shapes, rows=args.rows, sweep=not args.no_sweep, bits=b)]
    elif args.frag:
        failures = [f for b in (args.bits or [4]) for f in bench_frag(shapes=args.shapes, rows=args.rows,
                                                                            sweep=not args.no_sweep, bits=b)]
    elif args.gemv_sweep:
        failures = bench_gemv(sweep=True)
    elif args.mma or args.mma_sweep:
        failures = bench_mma(sweep=args.mma_sweep, shapes=args.shapes, rows=args.rows,
                             bits_list=args.bits)
    else:
        failures = bench_gemm(args.sweep) + bench_gemv(sweep=False)
        if not args.skip_elementwise:
            failures += bench_elementwise()
    return report(failures)


if __name__ == "__main__":
    sys.exit(main())
