"""GPU check and benchmark of the fused MoE (``kernels.moe``) against the ``moe`` op's torch implementation.

    python -m kernels.bench.moe                           # Qwen3-30B-A3B and Mixtral-8x7B layers, T = 1 ... 1024
    python -m kernels.bench.moe --shapes mixtral-8x7b --tokens 1 8
    python -m kernels.bench.moe --sweep                   # also time candidate MoeConfigs (to tune _CUDA_CONFIGS)
    python -m kernels.bench.moe --fp8                     # FP8 experts against the bf16 ones (--sweep: FP8 configs)
    python -m kernels.bench.moe --int4                    # W4A16 experts against the bf16 ones (--sweep: theirs)
    python -m kernels.bench.moe --int4 --path both --tokens 1 2 4 8 16   # W4A16: grouped GEMMs and GEMV kernels

Per (shape, T): fresh random bf16 tokens and weights (router, stacked experts), the shape's routing (top_k,
renormalised; Qwen3-MoE's weights rounded to bf16). ``fused_moe`` is checked against ``kernels.torch_ops.moe`` (max
abs error over the output's max; the routing is the same torch calls on both sides), then timed:

    fused    median of CUDA-graph replays, calls cycling through two copies of the weights so that each call reads
             its experts from HBM, not L2 (``kernels.bench.gemm.time_us``); capturing it is itself the check that
             nothing in it reads the host
    route    the router alone (linear, softmax, torch.topk), the same way: the part of ``fused`` outside the kernels
    torch    the torch op, eager (it reads each expert's token count on the host, so no CUDA graph): CUDA events
             over a loop of calls, host syncs included, as the runtime ran it before
    GB/s     bytes of the experts the routing activates (counted on the host, outside the timing) and of the router,
             over the fused time: at T = 1 the decode step's bandwidth measure (H100 HBM3: ~3,350 GB/s peak)

``--fp8``: the same bf16 experts quantized per expert and output channel (``quantize_experts_fp8``, as the passes do:
float8_e4m3fn codes, fp32 scales), the activations per token in the kernels. ``fused_moe`` with FP8 experts is checked
against ``ref_moe`` with the same scales (the same tolerance: a code at a rounding boundary may differ, the GPU's
division being approximate, and the fp32 sums run in another order), then timed as above against the bf16 experts'
``fused_moe``; GB/s counts the FP8 experts' bytes (codes and scales).

``--int4``: W4A16 experts of the same shapes, random 4-bit codes with fp32 scales and uint8 zero points in groups of
``INT4_GROUP_SIZE`` inputs (as ``kernels.bench.gemm``'s W4A16 weights; their weights spread about as the bf16 ones).
``fused_moe`` is checked against ``ref_moe`` on the same codes (max abs error over the output's max, as the bf16
experts: the reference rounds each dequantized weight to bf16, the kernels do not), then timed against the bf16
experts' ``fused_moe``; GB/s counts the W4A16 experts' bytes (codes, scales and zero points). ``--path`` picks the
W4A16 kernels: ``auto`` (``fused_moe``'s dispatch: the GEMV kernels of ``kernels.moe_gemv`` up to gemv_max_slots
slots), ``tile`` (the grouped GEMMs forced), ``gemv`` (the GEMV kernels forced), ``both`` (a row for each: the A/B
that sets gemv_max_slots). ``--sweep`` then times candidate configurations of each path shown.

Exits 1 when a check fails, 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from kernels import torch_ops as ops
from kernels.bench.gemm import report, sweep_configs, time_us
from kernels.moe import MoeConfig, default_config, fused_moe, ref_moe
from kernels.moe_gemv import MoeGemvConfig, default_gemv_config, gemv_max_slots
from kernels.torch_quant import quantize_experts_fp8


@dataclass(frozen=True)
class MoeShape:
    """One MoE layer's shape and routing."""

    num_experts: int
    hidden: int
    intermediate: int  # per expert
    top_k: int
    round_weights: bool  # routing weights rounded to the activations' dtype (Qwen-MoE)


SHAPES = {"qwen3-30b-a3b": MoeShape(128, 2048, 768, 8, True), "mixtral-8x7b": MoeShape(8, 4096, 14336, 2, False)}
TOKENS = (1, 8, 64, 256, 1024)
REL_TOL = 2e-2  # of the output's max: a few bf16 ulps (GEMMs summed in another order); a wrong expert is O(1)
DTYPE = torch.bfloat16


def _weights(shape: MoeShape, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """router [E, H], w_gate_up [E, 2I, H], w_down [E, H, I]; scaled so logits and activations are O(1)."""
    e, h, i = shape.num_experts, shape.hidden, shape.intermediate

    def randn(*size, scale):
        return (torch.randn(*size, generator=gen, device="cuda", dtype=DTYPE) * scale)

    return randn(e, h, scale=2 * h ** -0.5), randn(e, 2 * i, h, scale=h ** -0.5), randn(e, h, i, scale=i ** -0.5)


def time_eager_us(fns: list, reps: int = 10) -> float:
    """Median time of one call of ``fns`` (called in turn), eager, host syncs included."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for fn in fns:
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / len(fns))
    return statistics.median(samples)


def candidate_configs(num_tokens: int, shape: MoeShape) -> list[MoeConfig]:
    """Up to 24 configs around the defaults: block_m by the mean rows per expert, the up and down tiles."""
    mean_rows = num_tokens * shape.top_k / shape.num_experts
    block_ms = [16] if mean_rows <= 8 else [16, 32] if mean_rows <= 64 else [64, 128]
    return [MoeConfig(bm, bn, bk, dn, dk, group_m=1 if mean_rows <= 8 else 8, num_warps=8 if bm >= 128 else 4,
                      num_stages=4 if bm <= 32 else 3)
            for bm, (bn, bk), (dn, dk) in itertools.product(block_ms, [(32, 128), (64, 64), (64, 128), (128, 64)],
                                                           [(32, 128), (64, 128), (128, 64)])]


def bench(name: str, shape: MoeShape, tokens: tuple[int, ...], sweep: bool) -> list[str]:
    failures = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate, w_gate_up, w_down = _weights(shape, gen)
    copies = [(gate, w_gate_up, w_down), (gate, *_weights(shape, gen)[1:])]  # one router: the same routing
    expert_bytes = 3 * shape.hidden * shape.intermediate * DTYPE.itemsize
    router_bytes = shape.num_experts * shape.hidden * DTYPE.itemsize
    kw = dict(top_k=shape.top_k, round_weights=shape.round_weights)
    print(f"\n{name}: {shape.num_experts} experts of {shape.hidden} x {shape.intermediate}, top-{shape.top_k}, "
          f"{DTYPE}; times in us")
    print(f"{'T':>5} | {'fused':>8} {'route':>8} {'torch':>9} {'speedup':>7} | {'experts':>7} {'GB/s':>6} | "
          f"rel.err  config")
    for num_tokens in tokens:
        x = torch.randn(num_tokens, shape.hidden, generator=gen, device="cuda").to(DTYPE)
        out = fused_moe(x, gate, w_gate_up, w_down, **kw)
        ref = ops.moe(x, gate, w_gate_up, w_down, **kw)
        ok, err = _check(out, ref)
        if not ok:
            failures.append(f"{name} T={num_tokens}: rel.err {err:.3g}")
        t_fused = time_us([lambda c=c: fused_moe(x, *c, **kw) for c in copies])
        t_route = time_us([lambda c=c: ops.moe_route(x, c[0], None, shape.top_k, norm_topk_prob=False)
                           for c in copies])
        t_torch = time_eager_us([lambda c=c: ops.moe(x, *c, **kw) for c in copies])
        active = ops.moe_route(x, gate, None, shape.top_k)[1].unique().numel()
        gbs = (active * expert_bytes + router_bytes) / t_fused / 1e3
        cfg = default_config(num_tokens * shape.top_k, shape.num_experts, x.device)
        print(f"{num_tokens:>5} | {t_fused:8.1f} {t_route:8.1f} {t_torch:9.1f} {t_torch / t_fused:6.1f}x | "
              f"{active:>7} {gbs:6.0f} | {err:.1e}  {describe(cfg)}", flush=True)
        if sweep:
            failures += sweep_configs(
                f"moe {name} T={num_tokens}", candidate_configs(num_tokens, shape),
                lambda cand: _check(fused_moe(x, gate, w_gate_up, w_down, **kw, config=cand), ref),
                lambda cand: [lambda c=c: fused_moe(x, *c, **kw, config=cand) for c in copies],
                indent=f"{'':>5} ")
    del copies, gate, w_gate_up, w_down
    torch.cuda.empty_cache()
    return failures


@dataclass(frozen=True)
class QuantizedExperts:
    """A quantized form of the experts for ``--fp8`` / ``--int4``: how to make it, its bytes and its check."""

    name: str  # the table's column and the failures' prefix
    title: str  # what the table's heading says of it
    make: Callable  # (w_gate_up, w_down, generator) -> ((w_gate_up codes, w_down codes), fused_moe's keywords)
    expert_bytes: Callable[[int, int], float]  # (hidden, intermediate) -> one expert's bytes: codes, scales, zeros
    noise_share: float  # > 0: pass below this share of what the quantization changes (norms); 0: _check's REL_TOL


def _fp8_experts(w_gate_up: torch.Tensor, w_down: torch.Tensor, gen: torch.Generator):
    """The bf16 experts quantized per expert and output channel, as the passes do."""
    (q_gate_up, s_gate_up), (q_down, s_down) = quantize_experts_fp8(w_gate_up), quantize_experts_fp8(w_down)
    return (q_gate_up, q_down), dict(w_gate_up_scale=s_gate_up, w_down_scale=s_down)


INT4_GROUP_SIZE = 128


def _int4_experts(w_gate_up: torch.Tensor, w_down: torch.Tensor, gen: torch.Generator):
    """Random W4A16 experts of the bf16 ones' shapes, their weights (q - zero) * scale spread about as theirs
    (in ** -0.5: |q - zero| is ~6 on average over random codes and zero points)."""
    codes, kw = [], dict(group_size=INT4_GROUP_SIZE)
    for role, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        num_experts, out_f, in_f = w.shape
        groups = (num_experts, out_f, in_f // INT4_GROUP_SIZE)
        codes.append(torch.randint(0, 256, (num_experts, out_f, in_f // 2), dtype=torch.uint8, generator=gen,
                                   device="cuda"))
        kw[f"{role}_scales"] = (torch.rand(groups, generator=gen, device="cuda") + 0.5) * in_f ** -0.5 / 6
        kw[f"{role}_zeros"] = torch.randint(0, 16, groups, dtype=torch.uint8, generator=gen, device="cuda")
    return tuple(codes), kw


# FP8 experts on the GPU: the error against the torch op on the same codes, as a share of what FP8 changes against
# the bf16 experts (both as norms). A one-ulp difference in a GEMM's sum can move a row's maximum of h and with it
# that row's E4M3 grid, so some tokens differ by a part of the quantization noise; a wrong code or scale is >= 1.
FP8_NOISE_SHARE = 0.25

QUANTIZED = {
    "fp8": QuantizedExperts("fp8", "FP8 experts (per-channel e4m3, per-token activations)", _fp8_experts,
                            lambda h, i: 3 * h * i + 4 * (2 * i + h), FP8_NOISE_SHARE),
    "int4": QuantizedExperts("int4", f"W4A16 experts (random codes, groups of {INT4_GROUP_SIZE}, zero points)",
                             _int4_experts, lambda h, i: 3 * h * i * (0.5 + 5 / INT4_GROUP_SIZE), 0.0),
}


def gemv_candidates(num_tokens: int) -> list[MoeGemvConfig]:
    """Up to 14 small-slot configurations around the default: tile rows and K steps by slots per pass (those a
    step of ``num_tokens`` tokens can use: an expert gets at most one slot per token), auto splits; then fixed
    splits of the default tiles."""
    rows = [r for r in (1, 2, 4) if r <= num_tokens] or [1]
    out = [MoeGemvConfig(bn, bk, bn, bk, slots_per_pass=r)
           for (bn, bk), r in itertools.product([(128, 128), (64, 128), (128, 64), (64, 256)], rows)]
    return out + [MoeGemvConfig(slots_per_pass=rows[-1], split_k=split, down_split_k=split) for split in (2, 8)]


def _path_config(path: str, num_slots: int, shape: MoeShape, device: torch.device) -> MoeConfig | MoeGemvConfig | None:
    """The ``config`` that forces ``path`` ("tile", "gemv"), or None (``fused_moe``'s dispatch)."""
    if path == "tile":
        return default_config(num_slots, shape.num_experts, device, 2, 1)
    if path == "gemv":
        return default_gemv_config(device)
    return None


def bench_quantized(name: str, shape: MoeShape, tokens: tuple[int, ...], sweep: bool,
                    quant: QuantizedExperts, path: str = "auto") -> list[str]:
    """Quantized experts against bf16 ones of the same shapes: checked against ``ref_moe`` on the same codes, both
    timed."""
    failures = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate, w_gate_up, w_down = _weights(shape, gen)
    copies = [(gate, w_gate_up, w_down), (gate, *_weights(shape, gen)[1:])]  # one router: the same routing
    q_copies = []  # ((gate, w_gate_up codes, w_down codes), their scales (and zeros) as keywords), one per copy
    for _, w_gate_up, w_down in copies:
        q_experts, q_kw = quant.make(w_gate_up, w_down, gen)
        q_copies.append(((gate, *q_experts), q_kw))
    e, h, i = shape.num_experts, shape.hidden, shape.intermediate
    router_bytes = e * h * DTYPE.itemsize
    kw = dict(top_k=shape.top_k, round_weights=shape.round_weights)
    (gate, q_gate_up, q_down), scales = q_copies[0]
    print(f"\n{name}: {e} experts of {h} x {i}, top-{shape.top_k}, {DTYPE} x, {quant.title} against bf16; times "
          f"in us")
    own = f" / {quant.name}'s" if quant.noise_share else ""  # the error its own quantization makes
    print(f"{'T':>5} | {'bf16':>8} {quant.name:>8} {'speedup':>7} | {'experts':>7} {'GB/s':>6} | rel.err{own}  config")
    for num_tokens in tokens:
        x = torch.randn(num_tokens, h, generator=gen, device="cuda").to(DTYPE)
        ref = ref_moe(x, gate, q_gate_up, q_down, **kw, **scales)
        noise = _rel_norm(ref, ref_moe(x, *copies[0], **kw)) if quant.noise_share else 0.0  # what it changes

        def check(out: torch.Tensor, ref=ref, noise=noise) -> tuple[bool, float]:
            if not quant.noise_share:
                return _check(out, ref)
            err = _rel_norm(out, ref)
            return err < quant.noise_share * noise, err

        t_bf16 = time_us([lambda c=c: fused_moe(x, *c, **kw) for c in copies])
        active = ops.moe_route(x, gate, None, shape.top_k)[1].unique().numel()
        paths = (["tile", "gemv"] if path == "both" else [path]) if quant.name == "int4" else ["auto"]
        for p in paths:
            cfg = _path_config(p, num_tokens * shape.top_k, shape, x.device)
            ok, err = check(fused_moe(x, gate, q_gate_up, q_down, **kw, **scales, config=cfg))
            if not ok:
                failures.append(f"{name} {quant.name} {p} T={num_tokens}: rel.err {err:.3g}"
                                + (f" (norm), {quant.name}'s own {noise:.3g}" if quant.noise_share else ""))
            t_quant = time_us([lambda c=c, s=s: fused_moe(x, *c, **kw, **s, config=cfg) for c, s in q_copies])
            gbs = (active * quant.expert_bytes(h, i) + router_bytes) / t_quant / 1e3
            shown = cfg or (default_gemv_config(x.device) if quant.name == "int4" and num_tokens * shape.top_k
                            <= gemv_max_slots(e) else default_config(num_tokens * shape.top_k, e, x.device, 2, 1))
            print(f"{num_tokens:>5} | {t_bf16:8.1f} {t_quant:8.1f} {t_bf16 / t_quant:6.2f}x | {active:>7} {gbs:6.0f} | "
                  f"{err:.1e}{f' / {noise:.1e}' if quant.noise_share else ''}  {p}: {describe(shown)}", flush=True)
            if sweep:
                gemv = isinstance(shown, MoeGemvConfig)
                candidates = gemv_candidates(num_tokens) if gemv else candidate_configs(num_tokens, shape)
                failures += sweep_configs(
                    f"moe {quant.name} {name} T={num_tokens}", candidates,
                    lambda cand: check(fused_moe(x, gate, q_gate_up, q_down, **kw, **scales, config=cand)),
                    lambda cand: [lambda c=c, s=s: fused_moe(x, *c, **kw, **s, config=cand) for c, s in q_copies],
                    indent=f"{'':>5} ")
    del copies, q_copies, gate, w_gate_up, w_down, q_gate_up, q_down, scales
    torch.cuda.empty_cache()
    return failures


def describe(cfg: MoeConfig | MoeGemvConfig) -> str:
    if isinstance(cfg, MoeGemvConfig):
        return (f"gemv up {cfg.block_n}x{cfg.block_k} down {cfg.down_block_n}x{cfg.down_block_k} "
                f"rows{cfg.slots_per_pass} split {cfg.split_k or 'auto'}/{cfg.down_split_k or 'auto'} "
                f"w{cfg.num_warps} s{cfg.num_stages}")
    return (f"m{cfg.block_m} up {cfg.block_n}x{cfg.block_k} down {cfg.down_block_n}x{cfg.down_block_k} "
            f"g{cfg.group_m} w{cfg.num_warps} s{cfg.num_stages}")


def _rel_norm(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _check(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float]:
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    return err < REL_TOL, err


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--tokens", nargs="*", type=int, default=list(TOKENS))
    parser.add_argument("--sweep", action="store_true", help="also time candidate configs per shape and T")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--fp8", action="store_true", help="FP8 experts against bf16 ones (instead of the torch op)")
    kind.add_argument("--int4", action="store_true", help="W4A16 experts against bf16 ones (instead of the torch op)")
    parser.add_argument("--path", choices=("auto", "tile", "gemv", "both"), default="auto",
                        help="--int4: the W4A16 kernels timed: fused_moe's dispatch, the grouped GEMMs, the GEMV "
                             "kernels, or both (one row each)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernels.bench.moe needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    failures = []
    for name in args.shapes:
        if args.fp8 or args.int4:
            failures += bench_quantized(name, SHAPES[name], tuple(args.tokens), args.sweep,
                                        QUANTIZED["fp8" if args.fp8 else "int4"], args.path)
        else:
            failures += bench(name, SHAPES[name], tuple(args.tokens), args.sweep)
    return report(failures)


if __name__ == "__main__":
    sys.exit(main())
