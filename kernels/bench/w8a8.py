"""GPU check and benchmark of the W8A8 GEMM (FP8 and INT8, fused activation quantization).

    python -m kernels.bench.w8a8              # Llama-3-8B shapes: check, then time (exit 1 on a mismatch)
    python -m kernels.bench.w8a8 --sweep      # also time candidate configs per shape (to tune _CUDA_CONFIGS)
    python -m kernels.bench.w8a8 --gemv-sweep # the GEMV tables only, with candidate GemvConfigs per shape and M

Weights: fresh random bf16 weights quantized by the passes (per-channel FP8 E4M3 / INT8). Each
``w8a8_linear`` output is checked against ``ref_w8a8_linear`` (the runtime's reference linear) on fresh
random bf16 activations with an outlier channel, then timed against cuBLAS on the same shape: the bf16
``F.linear`` of the unquantized weight, ``torch._scaled_mm`` after a torch per-token quantization (FP8;
the runtime's large-M path before ``quantize_rows``; ``+qrows``: with the one-kernel quantization the runtime
now uses) and ``torch._int_mm`` likewise (INT8, M > 16 only). Times are CUDA-graph
replay medians cycling through weight copies larger than L2 (``kernels.bench.gemm.time_us``).

GEMV: ``kernels.gemv.w8a8_gemv`` at M = 1, 2, 4 (dynamic per-token scales), checked the same way and timed next
to ``w8a8_linear`` and the bf16 ``F.linear``; TB/s of weight bytes (codes + scales). ``--gemv-sweep`` times
candidate ``GemvConfig``s (to tune ``kernels.gemv._W8A8_CUDA_CONFIGS``).

``--rows`` / ``--rows-sweep``: only ``kernels.w8a8_rows.w8a8_rows_linear`` (rows quantized beforehand, as a norm
hands them over) at 8-256 rows against cuBLAS on the same codes, with candidate configs per M for the sweep.

``--scaling``: only ``torch._scaled_mm`` at the runtime's large-M sizes with row-wise scales (per-token x
per-channel: what every FP8 linear passes today, static per-tensor scales broadcast to rows and columns) against one
scale per operand (tensor-wise: what a build of per-tensor weights and static per-tensor activations could pass), the
same codes; the time of each, TFLOP/s and the largest difference of the results relative to the output's largest
magnitude.

``--fast-accum``: only ``torch._scaled_mm`` at the runtime's large-M sizes (128 ... 8192 rows) with and without
``use_fast_accum`` (Hopper's FP8 MMA accumulating without periodic promotion to fp32), the time of each and the
largest difference of the fast result from the fp32-promoted one, relative to the output's largest magnitude.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from kernels.bench.gemm import SHAPES, report, sweep_configs, time_us
from kernels.gemv import GemvConfig, default_gemv_config, w8a8_gemv
from kernels.w8a8_gemm import QuantizedRows, W8A8Config, default_config, quantize_rows, ref_w8a8_linear, w8a8_linear
from kernels.w8a8_rows import RowsConfig, default_config as default_rows_config, w8a8_rows_linear
from kernels.torch_quant import (make_fp8_scaled_mm_linear, quantize_activation_int8, quantize_weight_fp8,
                                 quantize_weight_int8)

ROWS = (1, 4, 16, 32)  # the runtime sends at most FUSED_MAX_ROWS (16) rows to the fused kernel
GEMV_ROWS = (1, 2, 4)
REL_TOL = 1.5e-2  # see bench(): a few bf16 ulps of the output's max; a bug is O(1)
COPIES_BYTES = 256 << 20  # weight copies cycled per timing: past the 50 MiB L2


def _quantize(w: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_weight_fp8(w, True) if kind == "fp8" else quantize_weight_int8(w)


def _shape_weights(kind: str, n: int, k: int, gen: torch.Generator):
    """A random bf16 weight [n, k], its quantized codes and scales, copies of those and of the bf16 weight to rotate
    past the L2 in the timings: (w, qweight, w_scale, copies, bf16 copies)."""
    w = torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
    qweight, w_scale = _quantize(w.float(), kind)
    copies = [(qweight.clone(), w_scale.clone()) for _ in range(max(2, COPIES_BYTES // qweight.numel()))]
    wbs = [w.clone() for _ in range(max(2, COPIES_BYTES // (2 * w.numel())))]
    return w, qweight, w_scale, copies, wbs


def _int_mm_linear(qweight: torch.Tensor, w_scale: torch.Tensor):
    wt = qweight.t()

    def fn(x):
        xq, xs = quantize_activation_int8(x, None)
        return (torch._int_mm(xq, wt).float() * xs * w_scale).to(x.dtype)

    return fn


def candidate_configs(m: int) -> list[W8A8Config]:
    bm = max(16, 1 << (m - 1).bit_length())
    out = []
    for bn in (32, 64, 128):
        for bk in (128, 256, 512):
            for warps in (4, 8):
                for stages in (3, 4, 5):
                    if bm * bk * 2 + bk * bn > 64 * 1024:  # one stage's tiles; stay inside shared memory
                        continue
                    out.append(W8A8Config(min(bm, 64), bn, bk, num_warps=warps, num_stages=stages))
    return out


def bench(kind: str, sweep: bool) -> list[str]:
    failures = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"\nW8A8 {kind}: times in us (CUDA graphs, weights rotated past L2); rel.err vs the reference linear")
    print(f"{'shape':>8} {'M':>4} | {'triton':>8} {'cublas8':>8} {'+qrows':>8} {'bf16':>8} | {'GB/s':>6} | "
          "rel.err  config")
    for name, k, n in SHAPES:
        w, qweight, w_scale, copies, wbs = _shape_weights(kind, n, k, gen)
        for m in ROWS:
            x = torch.randn(m, k, generator=gen, device="cuda") * 2
            x[:, 7] *= 40
            x = x.to(torch.bfloat16)
            y = w8a8_linear(x, qweight, w_scale)
            ref = ref_w8a8_linear(x, qweight, w_scale)
            err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            # bf16 output, and the kernel's fast fp32 division can give an activation the neighbouring
            # code (one E4M3 step is 6-12%): a few bf16 ulps of the output's max; a bug is O(1)
            if not err < REL_TOL:
                failures.append(f"{kind} {name} M={m}: rel.err {err:.3g}")
            t = time_us([lambda q=q, s=s: w8a8_linear(x, q, s) for q, s in copies])
            if kind == "fp8":
                fns = [make_fp8_scaled_mm_linear({"qweight": q, "weight_scale": s}) for q, s in copies]
                t_cublas = time_us([lambda f=f: f(x) for f in fns])
                def qrows(x2):
                    return quantize_rows(x2, torch.float8_e4m3fn)

                fused_q = [make_fp8_scaled_mm_linear({"qweight": q, "weight_scale": s}, qrows) for q, s in copies]
                t_cublas_q = time_us([lambda f=f: f(x) for f in fused_q])
            elif m > 16:
                fns = [_int_mm_linear(q, s) for q, s in copies]
                t_cublas = time_us([lambda f=f: f(x) for f in fns])
            else:
                t_cublas = float("nan")
            if kind != "fp8":
                t_cublas_q = float("nan")
            t_bf16 = time_us([lambda wb=wb: F.linear(x, wb) for wb in wbs])
            gbs = (qweight.numel() + 4 * n) / t / 1e3
            cfg = default_config(m, x.device)
            print(f"{name:>8} {m:>4} | {t:8.1f} {t_cublas:8.1f} {t_cublas_q:8.1f} {t_bf16:8.1f} | {gbs:6.0f} | "
                  f"{err:.1e}  "
                  f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}")
            if sweep:
                _sweep(kind, name, m, x, ref, copies)
        del copies, wbs
        torch.cuda.empty_cache()
    return failures


def _sweep(kind: str, name: str, m: int, x: torch.Tensor, ref: torch.Tensor, copies) -> None:
    # configs that miss the reference are left out of the ranking (the default config's check is bench()'s)
    sweep_configs(f"{kind} {name} M={m}", candidate_configs(m), lambda cfg: _check(
                  w8a8_linear(x, copies[0][0], copies[0][1], config=cfg), ref),
                  lambda cfg: [lambda q=q, s=s: w8a8_linear(x, q, s, config=cfg) for q, s in copies],
                  indent=f"{'':>8} {'':>4}   ", reps=10)


def _x(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(m, k, generator=gen, device="cuda") * 2
    x[:, 7] *= 40  # an outlier channel
    return x.to(torch.bfloat16)


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _check(y: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float]:
    err = _rel_err(y, ref)
    return err < REL_TOL, err


def gemv_candidates() -> list[GemvConfig]:
    """GEMV configs the --gemv-sweep tries (block_n, block_k, split_k, num_warps, num_stages)."""
    rows = [(128, 128, 0, 4, 3), (64, 128, 0, 4, 3), (128, 256, 0, 4, 3), (64, 256, 0, 4, 3), (128, 128, 0, 8, 3),
            (256, 128, 0, 8, 3), (128, 128, 0, 4, 4), (128, 64, 0, 4, 4), (128, 128, 4, 4, 3), (128, 128, 16, 4, 3)]
    # narrow tiles with long K steps (1-2 KB of each weight row per step): the dense GEMV's fastest shape (session 19)
    rows += [(bn, bk, 0, w, st) for bn in (16, 32) for bk in (512, 1024, 2048) for w in (4, 8) for st in (3, 4)
             if bn * bk <= 32768]
    # the auto split's target programs per SM (the H200 ran the dense GEMV fastest at 2, session 27)
    targets = [GemvConfig(bn, bk, num_warps=4, num_stages=st, programs_per_sm=p)
               for bn, bk in ((16, 2048), (16, 1024), (32, 1024)) for st in (3, 4) for p in (2.0, 3.0, 6.0, 8.0)]
    return ([GemvConfig(bn, bk, split_k=s, num_warps=w, num_stages=st) for bn, bk, s, w, st in rows]
            + [GemvConfig(128, 128, num_warps=4, num_stages=3, reduce_in_kernel=False)] + targets)


def bench_gemv(kind: str, sweep: bool) -> list[str]:
    """w8a8_gemv at GEMV_ROWS rows: checked against the reference linear, timed next to w8a8_linear and bf16."""
    failures = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    print(f"\nW8A8 {kind} GEMV (kernels.gemv): times in us (CUDA graphs, weights rotated past L2); TB/s of weight "
          "bytes (bf16: of the bf16 weight)")
    print(f"{'shape':>8} {'M':>3} | {'gemv':>8} {'gemm':>8} {'bf16':>8} | {'gemv':>6} {'gemm':>6} {'bf16':>6} | "
          "rel.err  config")
    for name, k, n in SHAPES:
        w, qweight, w_scale, copies, wbs = _shape_weights(kind, n, k, gen)
        weight_bytes = qweight.numel() + 4 * w_scale.numel()
        for m in GEMV_ROWS:
            x = _x(m, k, gen)
            ref = ref_w8a8_linear(x, qweight, w_scale)
            err = _rel_err(w8a8_gemv(x, qweight, w_scale), ref)
            if not err < REL_TOL:
                failures.append(f"{kind} gemv {name} M={m}: rel.err {err:.3g}")
            t = time_us([lambda q=q, s=s: w8a8_gemv(x, q, s) for q, s in copies])
            t_gemm = time_us([lambda q=q, s=s: w8a8_linear(x, q, s) for q, s in copies])
            t_bf16 = time_us([lambda wb=wb: F.linear(x, wb) for wb in wbs])
            print(f"{name:>8} {m:>3} | {t:8.1f} {t_gemm:8.1f} {t_bf16:8.1f} | {weight_bytes / t / 1e6:6.2f} "
                  f"{weight_bytes / t_gemm / 1e6:6.2f} {2 * w.numel() / t_bf16 / 1e6:6.2f} | {err:.1e}  "
                  f"{default_gemv_config('w8a8', m, x.device)}")
            if sweep and m == 1:  # the runtime sends the GEMV one row (GEMV_RUNTIME_MAX_ROWS)
                failures += _gemv_sweep(kind, name, x, ref, copies, weight_bytes)
        del copies, wbs
        torch.cuda.empty_cache()
    return failures


def _gemv_sweep(kind: str, name: str, x: torch.Tensor, ref: torch.Tensor, copies, weight_bytes: int) -> list[str]:
    return sweep_configs(f"{kind} gemv {name} M={x.shape[0]}", gemv_candidates(), lambda cfg: _check(
                         w8a8_gemv(x, copies[0][0], copies[0][1], config=cfg), ref),
                         lambda cfg: [lambda q=q, s=s: w8a8_gemv(x, q, s, config=cfg) for q, s in copies],
                         indent=f"{'':>8} {'':>3}   ", weight_bytes=weight_bytes, reps=10)


SCALED_MM_ROWS = (128, 512, 2048, 8192)  # the runtime's large-M sizes (--fast-accum, --scaling)


def _scaled_mm_ab(fn_a, fn_b, weights: list[torch.Tensor]) -> tuple[float, float, float]:
    """(us of fn_a, us of fn_b, their largest difference relative to fn_a's largest magnitude): each fn takes a
    weight copy ([in, out] FP8 codes) and runs one ``_scaled_mm``; times cycle through the copies (past the L2)."""
    a, b = fn_a(weights[0]).float(), fn_b(weights[0]).float()
    rel = ((a - b).abs().max() / a.abs().max()).item()
    return (time_us([lambda w=w: fn_a(w) for w in weights]), time_us([lambda w=w: fn_b(w) for w in weights]), rel)


def bench_fast_accum() -> None:
    """``_scaled_mm`` with and without fast accumulation at the Llama-3-8B shapes (see the module docstring)."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    print("\n| shape | M | fp32-promoted us | fast accum us | speedup | max rel diff |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, k, n in SHAPES:
        w = torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        q, ws = quantize_weight_fp8(w, True)
        w_scale = ws.float().reshape(1, -1).expand(1, n).contiguous()
        qs = [q.clone().t() for _ in range(max(1, COPIES_BYTES // q.numel()))]
        for m in SCALED_MM_ROWS:
            x = torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize_rows(x, torch.float8_e4m3fn)
            xs = xs.expand(m, 1).contiguous()

            def mm(b, fast):
                return torch._scaled_mm(xq, b, scale_a=xs, scale_b=w_scale, out_dtype=torch.bfloat16,
                                        use_fast_accum=fast)
            slow_us, fast_us, rel = _scaled_mm_ab(lambda b: mm(b, False), lambda b: mm(b, True), qs)
            print(f"| {name} | {m} | {slow_us:.1f} | {fast_us:.1f} | {slow_us / fast_us:.2f}x | {rel:.1e} |",
                  flush=True)


def bench_scaling() -> None:
    """``_scaled_mm`` with row-wise against tensor-wise scales at the Llama-3-8B shapes (see the module docstring)."""
    gen = torch.Generator(device="cuda").manual_seed(8)
    print("\n| shape | M | row-wise us | TFLOP/s | tensor-wise us | TFLOP/s | speedup | max rel diff |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, k, n in SHAPES:
        w = torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        q, w_scale1 = quantize_weight_fp8(w, False)
        w_scale1 = w_scale1.reshape(())
        w_rows = w_scale1.reshape(1, 1).expand(1, n).contiguous()
        qs = [q.clone().t() for _ in range(max(1, COPIES_BYTES // q.numel()))]
        for m in SCALED_MM_ROWS:
            x = torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16)
            xq, x_scale1 = quantize_weight_fp8(x, False)  # one scale for all of x: amax / 448
            x_scale1 = x_scale1.reshape(())
            x_rows = x_scale1.reshape(1, 1).expand(m, 1).contiguous()
            row_us, ten_us, rel = _scaled_mm_ab(
                lambda b: torch._scaled_mm(xq, b, scale_a=x_rows, scale_b=w_rows, out_dtype=torch.bfloat16),
                lambda b: torch._scaled_mm(xq, b, scale_a=x_scale1, scale_b=w_scale1, out_dtype=torch.bfloat16), qs)
            tflops = 2 * m * n * k / 1e6  # TFLOP/s at a time in us
            print(f"| {name} | {m} | {row_us:.1f} | {tflops / row_us:.0f} | {ten_us:.1f} | {tflops / ten_us:.0f} | "
                  f"{row_us / ten_us:.2f}x | {rel:.1e} |", flush=True)


ROWS_M = (8, 16, 32, 64, 128, 256)


def rows_candidates(m: int) -> list[RowsConfig]:
    """Configurations ``--rows-sweep`` tries at ``m`` rows (kernels.w8a8_rows)."""
    bm = max(16, 1 << (m - 1).bit_length())
    out = []
    if bm <= 64:  # the weights as the MMA's M operand: x's rows fill its N
        for bn, bk, warps, stages in ((64, 128, 4, 4), (128, 128, 4, 4), (128, 128, 4, 5), (128, 256, 4, 3),
                                      (64, 256, 4, 4), (128, 128, 8, 4), (256, 128, 8, 3)):
            out.append(RowsConfig(bm, bn, bk, num_warps=warps, num_stages=stages))
        out += [RowsConfig(bm, 128, 128, num_warps=4, num_stages=4, programs_per_sm=p) for p in (1.0, 3.0, 4.0)]
        out.append(RowsConfig(bm, 128, 128, num_warps=4, num_stages=4, promote=128))
    for bm2, bn, bk, warps, stages in ((64, 128, 128, 4, 4), (128, 128, 128, 8, 4), (128, 128, 128, 8, 3),
                                       (64, 256, 128, 8, 3), (128, 64, 128, 4, 4)):
        if bm2 <= max(bm, 64):
            out.append(RowsConfig(bm2, bn, bk, swap=False, num_warps=warps, num_stages=stages))
    out.append(RowsConfig(min(bm, 128), 128, 128, swap=False, num_warps=8, num_stages=4, promote=128))
    return out


def bench_rows(kind: str, sweep: bool) -> list[str]:
    """``w8a8_rows_linear`` on rows quantized by ``quantize_rows`` (what a norm hands an FP8 / INT8 linear) at
    ROWS_M rows, checked against the reference linear of the unquantized rows, timed next to cuBLAS on the same codes
    (``_scaled_mm`` / ``_int_mm``, the runtime's path before it) and the bf16 ``F.linear``; TB/s of weight codes."""
    failures = []
    gen = torch.Generator(device="cuda").manual_seed(3)
    dtype = torch.float8_e4m3fn if kind == "fp8" else torch.int8
    print(f"\nW8A8 {kind} on quantized rows (kernels.w8a8_rows): us (CUDA graphs, weights rotated past L2); TB/s of "
          "weight codes; rel.err of each against the reference linear")
    print(f"{'shape':>8} {'M':>4} | {'rows':>8} {'cublas':>8} {'bf16':>8} | {'rows':>5} {'cublas':>6} | "
          "err rows  err cublas  config")
    for name, k, n in SHAPES:
        w, qweight, w_scale, copies, wbs = _shape_weights(kind, n, k, gen)
        for m in ROWS_M:
            x = _x(m, k, gen)
            rows = QuantizedRows(*quantize_rows(x, dtype))
            ref = ref_w8a8_linear(x, qweight, w_scale)
            err = _rel_err(w8a8_rows_linear(rows.codes, rows.scales, qweight, w_scale), ref)
            if not err < REL_TOL:
                failures.append(f"{kind} rows {name} M={m}: rel.err {err:.3g}")
            t = time_us([lambda q=q, s=s: w8a8_rows_linear(rows.codes, rows.scales, q, s) for q, s in copies])
            if kind == "fp8":
                fns = [make_fp8_scaled_mm_linear({"qweight": q, "weight_scale": s}) for q, s in copies]
                err_cublas = _rel_err(fns[0](rows), ref)
                t_cublas = time_us([lambda f=f: f(rows) for f in fns])
            elif m > 16:  # _int_mm takes more than 16 rows
                def int_mm(q, s):
                    return (torch._int_mm(rows.codes, q.t()).float() * rows.scales * s).to(torch.bfloat16)
                err_cublas = _rel_err(int_mm(qweight, w_scale), ref)
                t_cublas = time_us([lambda q=q, s=s: int_mm(q, s) for q, s in copies])
            else:
                err_cublas = t_cublas = float("nan")
            t_bf16 = time_us([lambda wb=wb: F.linear(x, wb) for wb in wbs])
            cfg = default_rows_config(m, x.device)
            print(f"{name:>8} {m:>4} | {t:8.1f} {t_cublas:8.1f} {t_bf16:8.1f} | {qweight.numel() / t / 1e6:5.2f} "
                  f"{qweight.numel() / t_cublas / 1e6:6.2f} | {err:.1e}  {err_cublas:.1e}    {cfg}", flush=True)
            if sweep:
                failures += sweep_configs(
                    f"{kind} rows {name} M={m}", rows_candidates(m),
                    lambda cfg: _check(w8a8_rows_linear(rows.codes, rows.scales, qweight, w_scale, config=cfg), ref),
                    lambda cfg: [lambda q=q, s=s: w8a8_rows_linear(rows.codes, rows.scales, q, s, config=cfg)
                                 for q, s in copies],
                    indent=f"{'':>8} {'':>4}   ", weight_bytes=qweight.numel(), reps=10)
        del copies, wbs
        torch.cuda.empty_cache()
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time candidate configs per shape")
    parser.add_argument("--gemv-sweep", action="store_true",
                        help="only the GEMV tables, timing candidate GEMV configs per shape and M")
    parser.add_argument("--gemv", action="store_true", help="only the GEMV tables (no sweep)")
    parser.add_argument("--kind", choices=("fp8", "int8", "both"), default="both")
    parser.add_argument("--fast-accum", action="store_true", help="only _scaled_mm with and without fast accumulation")
    parser.add_argument("--scaling", action="store_true",
                        help="only _scaled_mm with row-wise against tensor-wise scales")
    parser.add_argument("--rows", action="store_true",
                        help="only the quantized-rows kernel's tables (kernels.w8a8_rows)")
    parser.add_argument("--rows-sweep", action="store_true", help="those tables, timing candidate configs per M")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_w8a8 needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if args.fast_accum:
        bench_fast_accum()
        return 0
    if args.scaling:
        bench_scaling()
        return 0
    failures = []
    for kind in (("fp8", "int8") if args.kind == "both" else (args.kind,)):
        if args.rows or args.rows_sweep:
            failures += bench_rows(kind, args.rows_sweep)
            continue
        if not (args.gemv_sweep or args.gemv):
            failures += bench(kind, args.sweep)
        failures += bench_gemv(kind, args.gemv_sweep)
    return report(failures)


if __name__ == "__main__":
    sys.exit(main())
