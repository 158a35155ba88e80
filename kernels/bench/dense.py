"""GPU benchmark and correctness check of the unquantized GEMV (``kernels.gemv.dense_gemv``) against cuBLAS.

    python -m kernels.bench.dense            # Llama-3-8B shapes and its lm_head at 1, 2, 4 rows; a layer's chain
    python -m kernels.bench.dense --sweep    # also time candidate GemvConfigs per shape (to tune _DENSE_CUDA_CONFIGS)
    python -m kernels.bench.dense --dense-rows 3 5 8 16 [--rows-sweep]   # kernels.dense_rows vs cuBLAS (and configs)

Each shape's fresh random bf16 weight (and x) is checked against the fp32 reference (``F.linear`` in fp32, rounded
to bf16), then ``dense_gemv`` and ``F.linear`` (cuBLAS) are timed over CUDA-graph replays of back-to-back calls,
cycling through enough weight copies that each call reads from HBM, not L2 (``kernels.bench.gemm.time_us``).
Reported: microseconds and TB/s of weight bytes, next to this GPU's copy bandwidth (2 GiB copied: bytes read plus
written, as ``builder bench latency`` measures its roofline's), measured in the same process.

The layer chain is a decode step's linears of one Llama-3-8B layer at one row, over 8 layers' distinct weights:
qkv, o_proj, gate_up, then down on silu(gate) * up: ``dense_gemv`` (the SwiGLU in the down projection's loads) vs
cuBLAS with the ``silu_mul`` kernel between, each output feeding the next call (the shapes are kept by slicing).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from kernels.activation import silu_mul
from kernels.bench.gemm import SHAPES, report, sweep_configs, time_us
from kernels.dense_rows import DEFAULT_CONFIG as ROWS_DEFAULT
from kernels.dense_rows import dense_rows
from kernels.gemv import GEMV_MAX_ROWS, GemvConfig, default_gemv_config, dense_gemv

DTYPE = torch.bfloat16
ALL_SHAPES = SHAPES + [("lm_head", 4096, 128256)]
ROWS = [1, 2, 4]
ROTATE_BYTES = 512 << 20  # weight bytes cycled through per shape: well past the 50 MB L2
TOL = 1e-2
CHAIN_LAYERS = 8


def _close(y: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float]:
    err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-6)).item()
    return err <= TOL, err


def bandwidth_tbs(nbytes: int = 2 << 30) -> float:
    """This GPU's copy bandwidth in TB/s: a 2 GiB device-to-device copy, read + write bytes counted (as
    ``builder bench latency`` measures its roofline's bandwidth), from CUDA-graph replays."""
    src = torch.empty(nbytes // 2, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    us = time_us([lambda: dst.copy_(src)], reps=10)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / us / 1e6


def candidates(rows: int) -> list[GemvConfig]:
    """Configs ``--sweep`` tries: (block_n, block_k, num_warps, num_stages) around the default, auto split-K, and a
    few fixed splits."""
    tiles = [(bn, bk, w, st) for bn in (16, 32, 64, 128) for bk in (128, 256, 512) for w in (4, 8) for st in (2, 3, 4)
             if bn * bk <= 32768 and not (rows > 2 and bn * bk > 16384)]
    return ([GemvConfig(bn, bk, num_warps=w, num_stages=st) for bn, bk, w, st in tiles]
            + [GemvConfig(64, 256, split_k=s, num_warps=4, num_stages=3) for s in (1, 2, 4, 8)])


def bench_shapes(sweep: bool, rows_list: list[int]) -> list[str]:
    failures = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"\ndense GEMV (kernels.gemv.dense_gemv) vs cuBLAS (F.linear), {DTYPE}; us per call (CUDA graphs, weights "
          "rotated past L2), TB/s of weight bytes")
    print(f"{'shape':>8} {'M':>2} {'K':>6} {'N':>6} | {'gemv':>7} {'cuBLAS':>7} | {'gemv':>5} {'cuBLAS':>6} | "
          f"{'ratio':>5} | rel.err  config")
    layer = {m: [0.0, 0.0] for m in rows_list}
    for name, k, n in ALL_SHAPES:
        nbytes = n * k * 2
        copies = max(2, -(-ROTATE_BYTES // nbytes))
        weights = [torch.randn(n, k, generator=gen, device="cuda").mul_(0.02).to(DTYPE) for _ in range(copies)]
        for m in rows_list:
            x = torch.randn(m, k, generator=gen, device="cuda").to(DTYPE)
            ref = F.linear(x.float(), weights[0].float()).to(DTYPE)
            ok, err = _close(dense_gemv(x, weights[0]), ref)
            if not ok:
                failures.append(f"dense {name} M={m}: max rel err {err:.2e}")
            t_gemv = time_us([lambda w=w: dense_gemv(x, w) for w in weights])
            t_cublas = time_us([lambda w=w: F.linear(x, w) for w in weights])
            if name != "lm_head":
                layer[m][0] += t_gemv
                layer[m][1] += t_cublas
            print(f"{name:>8} {m:2d} {k:6d} {n:6d} | {t_gemv:7.1f} {t_cublas:7.1f} | {nbytes / t_gemv / 1e6:5.2f} "
                  f"{nbytes / t_cublas / 1e6:6.2f} | {t_cublas / t_gemv:5.2f} | {err:.1e}  "
                  f"{default_gemv_config('dense', m, x.device)}")
            if sweep:
                failures += sweep_configs(f"dense {name} M={m}", candidates(m),
                                          lambda cand: _close(dense_gemv(x, weights[0], config=cand), ref),
                                          lambda cand: [lambda w=w: dense_gemv(x, w, config=cand) for w in weights],
                                          weight_bytes=nbytes, reps=10, top=5)
        del weights
        torch.cuda.empty_cache()
    for m, (g, c) in layer.items():
        print(f"{'layer':>8} {m:2d} {'':>6} {'':>6} | {g:7.1f} {c:7.1f} |  (the four linears, each timed alone)")
    return failures


def rows_candidates() -> list[GemvConfig]:
    """Configs ``--rows-sweep`` tries for ``kernels.dense_rows``: tensor-core tiles, auto split-K."""
    tiles = [(bn, bk, w, st) for bn in (16, 32, 64, 128) for bk in (64, 128, 256) for w in (4, 8) for st in (3, 5)
             if 2048 <= bn * bk <= 16384 and (w == 4 or bn * bk == 16384)]
    return [GemvConfig(bn, bk, num_warps=w, num_stages=st) for bn, bk, w, st in tiles]


def bench_rows(sweep: bool, rows_list: list[int]) -> list[str]:
    """``kernels.dense_rows`` at 3-16 rows against cuBLAS on the Llama-3-8B shapes (the down projection gated, as the
    runtime runs it: silu_mul + cuBLAS on the other side)."""
    failures = []
    gen = torch.Generator(device="cuda").manual_seed(3)
    print(f"\ndense rows (kernels.dense_rows, tensor cores) vs cuBLAS, {DTYPE}; us per call (CUDA graphs, weights "
          "rotated past L2), TB/s of weight bytes")
    shapes = [(name, k, n, name == "down") for name, k, n in ALL_SHAPES]
    total = {m: [0.0, 0.0] for m in rows_list}
    for name, k, n, gated in shapes:
        nbytes = n * k * 2
        copies = max(2, -(-ROTATE_BYTES // nbytes))
        weights = [torch.randn(n, k, generator=gen, device="cuda").mul_(0.02).to(DTYPE) for _ in range(copies)]
        for m in rows_list:
            x = torch.randn(m, 2 * k if gated else k, generator=gen, device="cuda").to(DTYPE)
            ref = F.linear((silu_mul(x) if gated else x).float(), weights[0].float()).to(DTYPE)
            ok, err = _close(dense_rows(x, weights[0], gated=gated), ref)
            if not ok:
                failures.append(f"dense_rows {name} M={m}: max rel err {err:.2e}")
            t_rows = time_us([lambda w=w: dense_rows(x, w, gated=gated) for w in weights])
            t_cublas = time_us([lambda w=w: F.linear(silu_mul(x) if gated else x, w) for w in weights])
            total[m][0] += t_rows * (32 if name != "lm_head" else 1)
            total[m][1] += t_cublas * (32 if name != "lm_head" else 1)
            print(f"{name:>8} {m:2d} {k:6d} {n:6d} | {t_rows:7.1f} {t_cublas:7.1f} | {nbytes / t_rows / 1e6:5.2f} "
                  f"{nbytes / t_cublas / 1e6:6.2f} | {t_cublas / t_rows:5.2f} | {err:.1e}  {ROWS_DEFAULT}")
            if sweep:
                failures += sweep_configs(f"dense_rows {name} M={m}", rows_candidates(),
                                          lambda cand: _close(dense_rows(x, weights[0], gated=gated, config=cand),
                                                              ref),
                                          lambda cand: [lambda w=w: dense_rows(x, w, gated=gated, config=cand)
                                                        for w in weights],
                                          weight_bytes=nbytes, reps=10, top=4)
        del weights
        torch.cuda.empty_cache()
    for m, (r, c) in total.items():
        print(f"{'step':>8} {m:2d}  32 layers + lm_head: dense_rows {r / 1e3:.3f} ms, cuBLAS {c / 1e3:.3f} ms "
              f"(each linear timed alone)")
    return failures


def bench_gated(rows_list: list[int]) -> list[str]:
    """The down projection on a merged [gate | up]: dense_gemv(gated) vs silu_mul + cuBLAS."""
    failures = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    k, n = 14336, 4096
    copies = max(2, -(-ROTATE_BYTES // (n * k * 2)))
    weights = [torch.randn(n, k, generator=gen, device="cuda").mul_(0.02).to(DTYPE) for _ in range(copies)]
    print("\ndown projection on [gate | up] (the SwiGLU fused into the loads) vs silu_mul + cuBLAS, us")
    for m in rows_list:
        gu = torch.randn(m, 2 * k, generator=gen, device="cuda").to(DTYPE)
        ref = F.linear(silu_mul(gu).float(), weights[0].float()).to(DTYPE)
        ok, err = _close(dense_gemv(gu, weights[0], gated=True), ref)
        if not ok:
            failures.append(f"dense gated down M={m}: max rel err {err:.2e}")
        t_gemv = time_us([lambda w=w: dense_gemv(gu, w, gated=True) for w in weights])
        t_cublas = time_us([lambda w=w: F.linear(silu_mul(gu), w) for w in weights])
        print(f"{'down':>8} {m:2d} | gated gemv {t_gemv:7.1f} | silu_mul + cuBLAS {t_cublas:7.1f} | {err:.1e}")
    return failures


def bench_chain() -> None:
    """One layer's linears at one row as a decode step chains them, over CHAIN_LAYERS layers' weights."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    shapes = {name: (k, n) for name, k, n in SHAPES}
    layers = [{name: torch.randn(n, k, generator=gen, device="cuda").mul_(k ** -0.5).to(DTYPE)  # unit gain
               for name, (k, n) in shapes.items()} for _ in range(CHAIN_LAYERS)]
    x = torch.randn(1, 4096, generator=gen, device="cuda").to(DTYPE)

    def chain(gemv: bool):
        h = x
        for w in layers:
            if gemv:
                a = dense_gemv(h, w["qkv"])[:, :4096]
                h = dense_gemv(dense_gemv(dense_gemv(a, w["o_proj"]), w["gate_up"]), w["down"], gated=True)
            else:
                a = F.linear(h, w["qkv"])[:, :4096]
                h = F.linear(silu_mul(F.linear(F.linear(a, w["o_proj"]), w["gate_up"])), w["down"])
        return h

    ok, err = _close(chain(True), chain(False))
    t_gemv = time_us([lambda: chain(True)], reps=10) / CHAIN_LAYERS
    t_cublas = time_us([lambda: chain(False)], reps=10) / CHAIN_LAYERS
    nbytes = sum(w.numel() * 2 for w in layers[0].values())
    print(f"\nlayer chain (qkv -> o_proj -> gate_up -> SwiGLU -> down, one row, {CHAIN_LAYERS} layers' weights), us per "
          f"layer: dense_gemv {t_gemv:.1f} ({nbytes / t_gemv / 1e6:.2f} TB/s), cuBLAS + silu_mul {t_cublas:.1f} "
          f"({nbytes / t_cublas / 1e6:.2f} TB/s); outputs agree: {ok} ({err:.1e})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time candidate configs per shape and M")
    parser.add_argument("--rows", nargs="*", type=int, default=ROWS, help=f"rows of x (at most {GEMV_MAX_ROWS})")
    parser.add_argument("--dense-rows", nargs="*", type=int, metavar="M",
                        help="only kernels.dense_rows against cuBLAS at these rows (3-16)")
    parser.add_argument("--rows-sweep", action="store_true", help="with --dense-rows: also sweep its configs")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernels.bench.dense needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"bandwidth: copy {bandwidth_tbs():.2f} TB/s (read + write)")
    if args.dense_rows:
        return report(bench_rows(args.rows_sweep, args.dense_rows))
    failures = bench_shapes(args.sweep, args.rows) + bench_gated(args.rows)
    bench_chain()
    return report(failures)


if __name__ == "__main__":
    sys.exit(main())
