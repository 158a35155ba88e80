"""GPU check and benchmark of the paged-attention kernels: ``python -m kernels.bench.attention``.

1. Correctness against the ``ref_*`` functions of ``kernels/paged_attention.py`` with fresh random
   inputs: a sweep of small cases over what the CPU interpreter tests cannot reach (tensor-core
   bf16/fp16 matmuls, hardware fp8 casts), then every benchmark shape (Llama-3-8B attention: 32 heads,
   8 kv heads, head_dim 128, block 16).
2. Timing with CUDA events (warmup, median of ``--iters``) of a CUDA-graph replay (GPU time; the
   capture also proves the call never syncs with the host) and of the eager call (which adds Python
   and Triton launch overhead). Decode at batch 1/8/64 x context 128/2048/8192 with bf16 and fp8
   caches, reported as achieved bandwidth (bytes of K/V, queries, outputs and block-table entries
   per second); prefill of 2048 tokens as attention TFLOP/s (4 * head_dim flops per visible
   (query, key) pair per head), beside torch SDPA on the same keys gathered to contiguous tensors.

3. Steps that mix decodes with a prompt through the prefill kernel (``--mixed-only``: these alone).
4. ``--decode-sweep``: the decode kernel's tilings (keys per iteration, warps, stages; fp16 operands for
   quantized caches) at serving shapes, each checked against the reference, the default marked.
5. ``--prefill-sweep``: the prefill kernel's tilings (rows of (token, head) pairs, keys per tile, warps, stages)
   over a 2,048-token prompt, the same after 6,144 cached tokens, and four 2,000-token prompts in one step, with
   bf16 and fp8 caches; ``best-config`` lines in ``KERNELS_PREFILL_CONFIG``'s form for an end-to-end A/B.
6. ``--fresh-backends``: fresh prompts on torch's attention backends (FlashAttention-2 varlen, cuDNN ragged,
   SDPA over a padded batch) beside the paged prefill kernel (``fresh_backends``).

Exits 1 when any correctness check fails (the timing still prints), 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import dataclass

import torch

from kernels.paged_attention import (
    KV_QMAX,
    DecodeConfig,
    _decode_config,
    _decode_num_splits,
    _num_sms,
    _prefill_config,
    decode_rows,
    paged_decode_attention,
    paged_mixed_attention,
    paged_prefill_attention,
    quantize_kv,
    ref_paged_decode_attention,
    ref_paged_prefill_attention,
    ref_write_kv_cache,
    write_kv_cache,
)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16  # Llama-3-8B
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "int8": torch.int8}
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}  # atol = rtol


@dataclass
class Paged:
    """A filled paged cache and the tables that address it."""

    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, a random permutation of the blocks
    k_scale: torch.Tensor | None  # fp32 [1] for quantized caches
    v_scale: torch.Tensor | None


def make_paged(lens: list[int], num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
               kv_dtype: torch.dtype, gen: torch.Generator) -> Paged:
    """Random K/V in shuffled blocks for sequences of ``lens`` tokens; the few blocks no table lists
    are NaN (int8: saturated), so a kernel reading through a wrong block id fails the check. The pool holds
    ``KERNELS_BENCH_POOL_BLOCKS`` blocks when that is more (a serving-sized cache, the tables' blocks spread over it,
    as a long-running engine's are), else only the blocks the tables need and 3 spares."""
    max_blocks = max(1, max(-(-n // block_size) for n in lens))
    num_blocks = max(len(lens) * max_blocks + 3, int(os.environ.get("KERNELS_BENCH_POOL_BLOCKS", "0")))
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
    v = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen, device="cuda")
    tables = perm[:len(lens) * max_blocks].view(len(lens), max_blocks).to(torch.int32)
    k_scale = v_scale = None
    if kv_dtype in KV_QMAX:
        qmax = KV_QMAX[kv_dtype]
        k_scale = (k.float().abs().amax() / qmax).reshape(1)
        v_scale = (v.float().abs().amax() / qmax).reshape(1)
    spare = perm[len(lens) * max_blocks:]
    k[spare] = v[spare] = float("nan") if kv_dtype != torch.int8 else float(k.abs().amax()) * 1e3
    k, v = quantize_kv(k, k_scale, kv_dtype), quantize_kv(v, v_scale, kv_dtype)
    return Paged(k, v, tables, k_scale, v_scale)


def close(out: torch.Tensor, expected: torch.Tensor) -> tuple[bool, float]:
    tol = TOL[out.dtype]
    err = (out.float() - expected.float()).abs().max().item()
    ok = bool(torch.isfinite(out.float()).all()) and torch.allclose(out.float(), expected.float(), atol=tol, rtol=tol)
    return ok, err


def check_decode(lens, num_heads, num_kv_heads, head_dim, dtype, kv_dtype, gen, window=None, num_splits=None):
    p = make_paged(lens, num_kv_heads, head_dim, BLOCK_SIZE, dtype, kv_dtype, gen)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen, device="cuda", dtype=dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    scale = head_dim ** -0.5
    kw = {"k_scale": p.k_scale, "v_scale": p.v_scale, "sliding_window": window}
    out = paged_decode_attention(q, p.k_cache, p.v_cache, p.block_tables, seq_lens, scale, num_splits=num_splits, **kw)
    expected = ref_paged_decode_attention(q, p.k_cache, p.v_cache, p.block_tables, seq_lens, scale, **kw)
    return close(out, expected)


def check_prefill(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, dtype, kv_dtype, gen, window=None):
    p = make_paged([c + n for c, n in zip(ctx_lens, q_lens)], num_kv_heads, head_dim, BLOCK_SIZE, dtype, kv_dtype, gen)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen, device="cuda", dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")
    scale = head_dim ** -0.5
    kw = {"k_scale": p.k_scale, "v_scale": p.v_scale, "sliding_window": window}
    out = paged_prefill_attention(q, p.k_cache, p.v_cache, p.block_tables, cu, ctx, scale, **kw)
    expected = ref_paged_prefill_attention(q, p.k_cache, p.v_cache, p.block_tables, cu, ctx, scale, **kw)
    return close(out, expected)


def check_write(num_tokens, num_kv_heads, head_dim, dtype, kv_dtype, gen):
    """write_kv_cache must store exactly what the reference stores (same bits)."""
    num_blocks = -(-num_tokens // BLOCK_SIZE) + 4
    k = 3 * torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen, device="cuda", dtype=dtype)
    v = 3 * torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen, device="cuda", dtype=dtype)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen, device="cuda")[:num_tokens]
    slots[::7] = -1  # padding tokens are skipped
    scales = (k.float().abs().amax() / 448, v.float().abs().amax() / 300) if kv_dtype in KV_QMAX else (None, None)
    caches = [torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen, device="cuda").to(kv_dtype)
              for _ in range(2)]
    expected = [c.clone() for c in caches]
    write_kv_cache(k, v, *caches, slots, k_scale=scales[0], v_scale=scales[1])
    ref_write_kv_cache(k, v, *expected, slots, k_scale=scales[0], v_scale=scales[1])
    same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(caches, expected))
    err = max((a.float() - b.float()).abs().max().item() for a, b in zip(caches, expected))
    return same, err


def sweep(gen) -> list[tuple[str, bool, float]]:
    """Small cases over dtypes, group sizes, head dims, windows and split counts (a rotation, not the
    full product, to keep the number of compiled variants small)."""
    results = []
    lens = [1, 17, 300, 1000, 64]
    heads = ((8, 8), (8, 2), (8, 1), (32, 8))
    combos = [(dtype, kv) for dtype in (torch.float32, torch.float16, torch.bfloat16)
              for kv in (dtype, torch.float8_e4m3fn, torch.int8)]
    for i, (dtype, kv_dtype) in enumerate(combos):
        num_heads, num_kv_heads = heads[i % len(heads)]
        head_dim = (32, 64, 128)[i % 3]
        name = f"{_name(dtype)}/{_name(kv_dtype)} h{num_heads}/{num_kv_heads} d{head_dim}"
        for window, splits in ((None, 1), (None, 5), (100, None), (100, 3)):
            ok, err = check_decode(lens, num_heads, num_kv_heads, head_dim, dtype, kv_dtype, gen,
                                   window=window, num_splits=splits)
            results.append((f"decode {name} window={window} splits={splits}", ok, err))
        for window in (None, 100):
            ok, err = check_prefill([1, 70, 200, 0, 129], [0, 0, 300, 5, 64], num_heads, num_kv_heads,
                                    head_dim, dtype, kv_dtype, gen, window=window)
            results.append((f"prefill {name} window={window}", ok, err))
        ok, err = check_write(300, num_kv_heads, head_dim, dtype, kv_dtype, gen)
        results.append((f"write_kv_cache {_name(dtype)}->{_name(kv_dtype)}", ok, err))
    return results


def time_ms(fn, warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn`` between CUDA events, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def timings(fn, args) -> tuple[float, float]:
    """(graph, eager) median milliseconds. The call is captured in a CUDA graph (which fails on a host
    sync) and its replay timed: GPU time, as the runtime's graphed steps see it. Eager adds the Python
    and Triton launch overhead."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_ms(graph.replay, args.warmup, args.iters), time_ms(fn, args.warmup, args.iters)


def bench_decode(batch, context, kv_name, gen, args, failures) -> str:
    kv_dtype = KV_DTYPES[kv_name]
    lens = [max(1, context - (i % 7)) for i in range(batch)]  # ragged, mostly not multiples of the block
    p = make_paged(lens, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.bfloat16, kv_dtype, gen)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    scale = HEAD_DIM ** -0.5

    def run():
        return paged_decode_attention(q, p.k_cache, p.v_cache, p.block_tables, seq_lens, scale,
                                      k_scale=p.k_scale, v_scale=p.v_scale)

    expected = ref_paged_decode_attention(q, p.k_cache, p.v_cache, p.block_tables, seq_lens, scale,
                                              k_scale=p.k_scale, v_scale=p.v_scale)
    ok, err = close(run(), expected)
    if not ok:
        failures.append(f"decode batch={batch} context={context} kv={kv_name}: max err {err:.3g}")
    ms, eager_ms = timings(run, args)
    kv_bytes = sum(lens) * NUM_KV_HEADS * HEAD_DIM * p.k_cache.element_size() * 2
    other = 2 * q.numel() * q.element_size() + sum(-(-n // BLOCK_SIZE) for n in lens) * 4
    splits = _decode_num_splits(batch, NUM_KV_HEADS, p.block_tables.shape[1] * BLOCK_SIZE, q.device,
                                _decode_config(kv_dtype, HEAD_DIM, batch * NUM_KV_HEADS, NUM_KV_HEADS,
                                               _num_sms(q.device)).min_keys)
    return (f"| decode | {kv_name} | {batch} | {context} | {splits} | {ms * 1e3:8.1f} | {eager_ms * 1e3:8.1f} | "
            f"{(kv_bytes + other) / ms / 1e6:7.0f} GB/s | {'ok' if ok else 'FAIL'} {err:.1e} |")


def _sweep_configs(args, f16s):
    """(BLOCK_N, warps, stages, fp16, heads first, kv heads per program) candidates: all of them, or --sweep-short's
    few. A program order only matters with one kv head per program."""
    if args.sweep_short:
        return [(bn, 4, st, f16, first, 1) for bn, st in ((64, 2), (128, 3)) for f16 in f16s
                for first in (False, True)]
    return [(bn, w, st, f16, first, heads) for bn in args.sweep_block_n for w in args.sweep_warps
            for st in args.sweep_stages for f16 in f16s for heads in args.sweep_heads
            for first in (False, True)[:args.sweep_orders if heads == 1 else 1]]


def decode_sweep(gen, args, failures) -> int:
    """Every decode tiling at a few serving shapes, GB/s of each, the default's row marked."""
    shapes = [tuple(map(int, sh.split("x"))) for sh in args.sweep_shapes] if args.sweep_shapes else \
        [(1, 8192), (64, 2048), (64, 8192), (256, 2048), (384, 1024)]
    print("| kv | batch | context | BLOCK_N | warps | stages | fp16 | heads first | kv heads per program | graph us | "
          "bandwidth | check |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for kv_name in args.sweep_kv:
        kv_dtype = KV_DTYPES[kv_name]
        f16s = ((True,) if args.sweep_fp16_only else (False, True)) if kv_dtype in KV_QMAX else (False,)
        for batch, context in shapes:
            lens = [max(1, context - (i % 7)) for i in range(batch)]
            p = make_paged(lens, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.bfloat16, kv_dtype, gen)
            q = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
            seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
            scale = HEAD_DIM ** -0.5
            expected = ref_paged_decode_attention(q, p.k_cache, p.v_cache, p.block_tables, seq_lens, scale,
                                                  k_scale=p.k_scale, v_scale=p.v_scale)
            kv_bytes = sum(lens) * NUM_KV_HEADS * HEAD_DIM * p.k_cache.element_size() * 2
            default = _decode_config(kv_dtype, HEAD_DIM, batch * NUM_KV_HEADS, NUM_KV_HEADS, _num_sms(q.device))
            best = None
            for block_n, warps, stages, f16, first, heads in _sweep_configs(args, f16s):
                cfg = DecodeConfig(block_n, warps, stages, f16, first, min_keys=default.min_keys, heads=heads)

                def run(cfg=cfg):
                    return paged_decode_attention(q, p.k_cache, p.v_cache, p.block_tables, seq_lens,
                                                  scale, k_scale=p.k_scale, v_scale=p.v_scale,
                                                  config=cfg)
                try:
                    ok, err = close(run(), expected)
                    ms, _ = timings(run, args)
                except Exception as e:  # out of shared memory or registers: not a candidate
                    print(f"| {kv_name} | {batch} | {context} | {block_n} | {warps} | {stages} | {f16} "
                          f"| {first} | {heads} | - | - | {type(e).__name__} |", flush=True)
                    continue
                if not ok:
                    failures.append(f"decode sweep {kv_name} {batch}x{context} {cfg}: max err {err:.3g}")
                mark = " (default)" if cfg == default else ""
                gbs = kv_bytes / ms / 1e6
                if ok and (best is None or ms < best[0]):
                    best = (ms, cfg)
                print(f"| {kv_name} | {batch} | {context} | {block_n} | {warps} | {stages} | {f16} | "
                      f"{first} | {heads} | {ms * 1e3:7.1f}{mark} | {gbs:6.0f} GB/s | {'ok' if ok else 'FAIL'} "
                      f"{err:.1e} |", flush=True)
            if best:
                print(f"best {kv_name} {batch}x{context}: {best[1]} {best[0] * 1e3:.1f} us", flush=True)
                c = best[1]  # the same, for KERNELS_DECODE_CONFIG
                print(f"best-config {kv_name} {batch}x{context} {c.block_n}:{c.num_warps}:{c.num_stages}:"
                      f"{int(c.heads_first)}:{c.heads}", flush=True)
            del p
            torch.cuda.empty_cache()
    for f in failures:
        print("FAIL", f)
    return 1 if failures else 0


def _prefill_inputs(q_lens, ctx_lens, kv_dtype, gen):
    """A prefill step's (paged cache, queries, cu_seqlens_q, context lengths, scale, attention flops): sequence i
    feeds q_lens[i] new tokens after ctx_lens[i] cached ones (4 * head_dim flops per visible (query, key) pair per
    head)."""
    p = make_paged([c + n for c, n in zip(ctx_lens, q_lens)], NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.bfloat16,
                   kv_dtype, gen)
    q = torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")
    pairs = sum(n * c + n * (n + 1) // 2 for n, c in zip(q_lens, ctx_lens))  # visible (query, key) pairs
    return p, q, cu, ctx, HEAD_DIM ** -0.5, 4 * NUM_HEADS * HEAD_DIM * pairs


def _own_kv(p, q_lens, ctx_lens=None):
    """The new tokens' keys and values as the step's own contiguous [tokens, kv heads, head_dim] bf16 tensors
    (a quantized cache's codes), gathered from the cache (``paged_prefill_attention(contiguous_kv=)``)."""
    ks, vs = [], []
    for table, n, c in zip(p.block_tables, q_lens, ctx_lens or [0] * len(q_lens)):
        pos = torch.arange(c, c + n, device="cuda")
        ks.append(p.k_cache[table.long()[pos // BLOCK_SIZE], pos % BLOCK_SIZE].to(torch.bfloat16))
        vs.append(p.v_cache[table.long()[pos // BLOCK_SIZE], pos % BLOCK_SIZE].to(torch.bfloat16))
    return torch.cat(ks), torch.cat(vs)


def bench_prefill(q_lens, ctx_lens, kv_name, gen, args, failures) -> list[str]:
    p, q, cu, ctx, scale, flops = _prefill_inputs(q_lens, ctx_lens, KV_DTYPES[kv_name], gen)

    def run():
        return paged_prefill_attention(q, p.k_cache, p.v_cache, p.block_tables, cu, ctx, scale,
                                       k_scale=p.k_scale, v_scale=p.v_scale)

    expected = ref_paged_prefill_attention(q, p.k_cache, p.v_cache, p.block_tables, cu, ctx, scale,
                                               k_scale=p.k_scale, v_scale=p.v_scale)
    ok, err = close(run(), expected)
    shape = f"{len(q_lens)}x{q_lens[0]} new, ctx {ctx_lens[0]}"
    if not ok:
        failures.append(f"prefill {shape} kv={kv_name}: max err {err:.3g}")
    ms, eager_ms = timings(run, args)
    rows = [(f"| prefill | {kv_name} | {shape} | {ms * 1e3:8.1f} | {eager_ms * 1e3:8.1f} | "
             f"{flops / ms / 1e9:6.1f} TFLOP/s | {'ok' if ok else 'FAIL'} {err:.1e} |")]
    # the same kernel with the new tokens over the step's own rows (a quantized cache's codes in bf16), the context
    # over the cache: RUNTIME_PREFILL_OWN_KV (fresh prompts, bf16) and RUNTIME_PREFILL_OWN_CODES
    own = _own_kv(p, q_lens, ctx_lens)

    def run_own():  # prompts only (no one-token sequence): the runtime's tiling for them
        return paged_prefill_attention(q, p.k_cache, p.v_cache, p.block_tables, cu, ctx, scale, k_scale=p.k_scale,
                                       v_scale=p.v_scale, contiguous_kv=own, prompts_only=True)

    ok, err = close(run_own(), expected)
    if not ok:
        failures.append(f"prefill {shape} kv={kv_name} over its own rows: max err {err:.3g}")
    ms, eager_ms = timings(run_own, args)
    what = "K/V" if kv_name == "bf16" else "codes"
    rows.append(f"| prefill, the step's own {what} | {kv_name} | {shape} | {ms * 1e3:8.1f} | {eager_ms * 1e3:8.1f} | "
                f"{flops / ms / 1e9:6.1f} TFLOP/s | {'ok' if ok else 'FAIL'} {err:.1e} |")
    if kv_name == "bf16" and len(set(ctx_lens)) == 1 and len(set(q_lens)) == 1:
        rows.append(_sdpa_row(p, q_lens, ctx_lens, q, scale, flops, shape, args))
    return rows


def prefill_sweep(gen, args, failures) -> int:
    """Every prefill tiling (BLOCK_M rows of (token, head) pairs, BLOCK_N keys, warps, stages) at three prompt
    shapes, attention TFLOP/s of each, the default's row marked; ``best-config`` lines in KERNELS_PREFILL_CONFIG's
    form."""
    shapes = (([2048], [0]), ([2048], [6144]), ([2000] * 4, [0] * 4))
    configs = [(bm, bn, w, st) for bm in args.sweep_block_m for bn in args.sweep_block_n for w in args.sweep_warps
               for st in args.sweep_stages]
    print("| kv | shape | BLOCK_M | BLOCK_N | warps | stages | graph us | throughput | check |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for kv_name in args.sweep_kv:
        kv_dtype = KV_DTYPES[kv_name]
        for q_lens, ctx_lens in shapes:
            p, q, cu, ctx, scale, flops = _prefill_inputs(q_lens, ctx_lens, kv_dtype, gen)
            expected = ref_paged_prefill_attention(q, p.k_cache, p.v_cache, p.block_tables, cu, ctx, scale,
                                                   k_scale=p.k_scale, v_scale=p.v_scale)
            shape = f"{len(q_lens)}x{q_lens[0]} new, ctx {ctx_lens[0]}"
            best = None
            # the new tokens over the step's own rows, as the runtime runs them: a quantized cache's codes at every
            # shape (prefill_own_codes), a bf16 cache's K/V for fresh prompts (RUNTIME_PREFILL_OWN_KV)
            quantized = kv_name != "bf16"
            own = (_own_kv(p, q_lens, ctx_lens) if args.sweep_own_kv and (quantized or not any(ctx_lens))
                   else None)
            if own is not None:
                shape += ", own codes" if quantized else ", own K/V"
            # the runtime's tiling for this launch (prompts only: the sweep's shapes hold no one-token sequence)
            default = _prefill_config(torch.bfloat16, HEAD_DIM, kv_dtype, own is not None)
            for cfg in configs:
                def run(cfg=cfg):
                    return paged_prefill_attention(q, p.k_cache, p.v_cache, p.block_tables, cu, ctx, scale,
                                                   k_scale=p.k_scale, v_scale=p.v_scale, config=cfg,
                                                   contiguous_kv=own)
                try:
                    ok, err = close(run(), expected)
                    ms, _ = timings(run, args)
                except Exception as e:  # out of shared memory or registers: not a candidate
                    print(f"| {kv_name} | {shape} | {' | '.join(map(str, cfg))} | - | - | {type(e).__name__} |",
                          flush=True)
                    continue
                if not ok:
                    failures.append(f"prefill sweep {kv_name} {shape} {cfg}: max err {err:.3g}")
                elif best is None or ms < best[0]:
                    best = (ms, cfg)
                mark = " (default)" if cfg == default else ""
                print(f"| {kv_name} | {shape} | {' | '.join(map(str, cfg))} | {ms * 1e3:8.1f}{mark} | "
                      f"{flops / ms / 1e9:6.1f} TFLOP/s | {'ok' if ok else 'FAIL'} {err:.1e} |", flush=True)
            if best:
                print(f"best-config {kv_name} {shape}: {':'.join(map(str, best[1]))} {best[0] * 1e3:.1f} us "
                      f"({flops / best[0] / 1e9:.1f} TFLOP/s)", flush=True)
            del p
            torch.cuda.empty_cache()
    for f in failures:
        print("FAIL", f)
    return 1 if failures else 0


def bench_mixed(num_decodes, context, prompt, kv_name, gen, args, failures) -> str:
    """A serving step that carries prefill: ``num_decodes`` sequences of one new token after ``context`` cached
    ones, then a fresh ``prompt``-token sequence, all through the varlen prefill kernel (what a step-graph replay
    runs), beside the decode kernel over the decode rows alone (the K/V reads they need) and the split step
    (``paged_mixed_attention``: the decodes on the decode kernel, the prompt on the prefill kernel, with the gather
    and scatter; RUNTIME_MIXED_DECODE_SPLIT). Bandwidth counts the K/V bytes every sequence must read once."""
    kv_dtype = KV_DTYPES[kv_name]
    lens = [max(1, context - (i % 7)) for i in range(num_decodes)] + [prompt]
    q_lens = [1] * num_decodes + [prompt]
    p = make_paged(lens, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.bfloat16, kv_dtype, gen)
    q = torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    ctx = torch.tensor([n - q for n, q in zip(lens, q_lens)], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor(lens[:num_decodes], dtype=torch.int32, device="cuda")
    scale = HEAD_DIM ** -0.5
    kw = {"k_scale": p.k_scale, "v_scale": p.v_scale}

    def mixed():
        return paged_prefill_attention(q, p.k_cache, p.v_cache, p.block_tables, cu, ctx, scale, **kw)

    def decode():
        return paged_decode_attention(q[:num_decodes], p.k_cache, p.v_cache, p.block_tables[:num_decodes], seq_lens,
                                      scale, **kw)

    all_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")

    def split():  # the per-step DecodeRows included (the runtime makes them once per step, not once per layer)
        rows = decode_rows(cu, all_lens, q.shape[0])
        return paged_mixed_attention(q, p.k_cache, p.v_cache, p.block_tables, cu, ctx, scale, rows, **kw)

    expected = ref_paged_prefill_attention(q, p.k_cache, p.v_cache, p.block_tables, cu, ctx, scale, **kw)
    ok, err = close(mixed(), expected)
    split_ok, split_err = close(split(), expected)
    if not ok:
        failures.append(f"mixed {num_decodes}x{context}+{prompt} kv={kv_name}: max err {err:.3g}")
    if not split_ok:
        failures.append(f"mixed, split {num_decodes}x{context}+{prompt} kv={kv_name}: max err {split_err:.3g}")
    ok, err = ok and split_ok, max(err, split_err)
    ms, _ = timings(mixed, args)
    decode_ms, _ = timings(decode, args)
    split_ms, _ = timings(split, args)
    kv_bytes = sum(lens) * NUM_KV_HEADS * HEAD_DIM * p.k_cache.element_size() * 2
    decode_bytes = sum(lens[:num_decodes]) * NUM_KV_HEADS * HEAD_DIM * p.k_cache.element_size() * 2
    return (f"| {num_decodes} decodes x ctx {context} + {prompt}-token prompt | {kv_name} | {ms * 1e3:8.1f} | "
            f"{kv_bytes / ms / 1e6:7.0f} GB/s | {decode_ms * 1e3:8.1f} | {decode_bytes / decode_ms / 1e6:7.0f} GB/s | "
            f"{split_ms * 1e3:8.1f} | {kv_bytes / split_ms / 1e6:7.0f} GB/s | {'ok' if ok else 'FAIL'} {err:.1e} |")


def fresh_backends(gen, args, failures) -> int:
    """Fresh prompts (no context) on each attention backend torch offers beside the paged prefill kernel, over the
    step's own rows as views of one QKV projection (as the executor holds them): the paged prefill kernel (own
    K/V, RUNTIME_PREFILL_OWN_KV's path), torch's FlashAttention-2 varlen (``aten._flash_attention_forward``), cuDNN's
    fused attention over ragged rows (``aten._cudnn_attention_forward`` with sequence offsets), and for prompts of
    one length SDPA over a padded batch per backend; each checked against the paged reference, with the eager wall
    time of its first call (a cuDNN graph is built per new shape). Then cuDNN's ragged path at steps of changing
    shape: the wall time of three calls each."""
    import time

    from torch.nn.attention import SDPBackend, sdpa_kernel

    print("\n| backend | prompts | graph us | eager us | TFLOP/s (graph) | check |")
    print("| --- | --- | --- | --- | --- | --- |")
    for q_lens in ([2048], [2000] * 4, [512] * 4, [2048, 1000, 700, 300], [8192]):
        ctx_lens = [0] * len(q_lens)
        p, q, cu, ctx, scale, flops = _prefill_inputs(q_lens, ctx_lens, torch.bfloat16, gen)
        k_own, v_own = _own_kv(p, q_lens)
        t = q.shape[0]
        qkv = torch.empty(t, NUM_HEADS + 2 * NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        qs, ks, vs = qkv.split([NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS], dim=1)
        qs.copy_(q), ks.copy_(k_own), vs.copy_(v_own)
        expected = ref_paged_prefill_attention(q, p.k_cache, p.v_cache, p.block_tables, cu, ctx, scale)
        max_len = max(q_lens)
        shape = "+".join(map(str, q_lens)) if len(set(q_lens)) > 1 else f"{len(q_lens)}x{q_lens[0]}"
        runs = {
            "paged prefill, own K/V": lambda: paged_prefill_attention(
                qs, p.k_cache, p.v_cache, p.block_tables, cu, ctx, scale, contiguous_kv=(ks, vs), prompts_only=True),
            "FlashAttention-2 varlen": lambda: torch.ops.aten._flash_attention_forward(
                qs, ks, vs, cu, cu, max_len, max_len, 0.0, True, False, scale=scale)[0],
            "cuDNN ragged": lambda: _cudnn_ragged(qs, ks, vs, cu, max_len, scale),
        }
        if len(set(q_lens)) == 1:
            n = q_lens[0]
            qb, kb, vb = (x.reshape(len(q_lens), n, *x.shape[1:]).transpose(1, 2) for x in (qs, ks, vs))
            for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                                  ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
                def sdpa(backend=backend):
                    with sdpa_kernel(backend):
                        return torch.nn.functional.scaled_dot_product_attention(
                            qb, kb, vb, scale=scale, is_causal=True, enable_gqa=True).transpose(1, 2).reshape(
                            t, NUM_HEADS, HEAD_DIM)
                runs[f"SDPA {name}, padded batch"] = sdpa
        for name, fn in runs.items():
            try:
                first = time.perf_counter()
                got = fn()
                torch.cuda.synchronize()
                first = (time.perf_counter() - first) * 1e3
                ok, err = close(got, expected)
                if not ok:
                    failures.append(f"{name} {shape}: max err {err:.3g}")
                try:
                    ms, eager_ms = timings(fn, args)
                except RuntimeError:
                    ms = float("nan")
                    eager_ms = time_ms(fn, args.warmup, args.iters)
                print(f"| {name} | {shape} | {ms * 1e3:8.1f} | {eager_ms * 1e3:8.1f} | {flops / ms / 1e9:6.1f} | "
                      f"{'ok' if ok else 'FAIL'} {err:.1e}; first call {first:.1f} ms |", flush=True)
            except Exception as e:  # noqa: BLE001 (a backend this torch / GPU lacks)
                print(f"| {name} | {shape} | - | - | - | {type(e).__name__}: {str(e).splitlines()[0][:120]} |")
        torch.cuda.empty_cache()
    # cuDNN at steps of changing shape: a new prompt count / longest prompt each call (a serving engine's steps)
    for lens in ([1500, 600], [1501, 600], [1500, 601], [1500, 600, 7], [900, 900, 900, 900, 900]):
        p_, q, cu, *_ = _prefill_inputs(lens, [0] * len(lens), torch.bfloat16, gen)
        k_own, v_own = _own_kv(p_, lens)
        walls = []
        for _ in range(3):
            start = time.perf_counter()
            _cudnn_ragged(q, k_own, v_own, cu, max(lens), HEAD_DIM ** -0.5)
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - start) * 1e3)
        print(f"cuDNN ragged {lens}: wall ms of three calls {', '.join(f'{w:.2f}' for w in walls)}")
    return 1 if failures else 0


def _cudnn_ragged(q, k, v, cu, max_len, scale):
    """Causal attention within each sequence of packed rows (bounds ``cu``) on cuDNN's ragged fused attention."""
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_len, max_len, False, 0.0, True, False,
                                                   scale=scale)[0]


def _sdpa_row(p, q_lens, ctx_lens, q, scale, flops, shape, args) -> str:
    """torch SDPA (its default backend: cuDNN on the H200 with torch 2.11) on the same keys gathered to contiguous
    tensors: a baseline, not a check."""
    n, c = q_lens[0], ctx_lens[0]
    pos = torch.arange(c + n, device="cuda")
    ks = torch.stack([p.k_cache[t.long()[pos // BLOCK_SIZE], pos % BLOCK_SIZE] for t in p.block_tables])
    vs = torch.stack([p.v_cache[t.long()[pos // BLOCK_SIZE], pos % BLOCK_SIZE] for t in p.block_tables])
    qs = q.view(len(q_lens), n, NUM_HEADS, HEAD_DIM).transpose(1, 2)
    ks, vs = ks.transpose(1, 2), vs.transpose(1, 2)
    if c == 0:
        kw = {"is_causal": True}
    else:
        kw = {"attn_mask": pos[None, :] <= (c + torch.arange(n, device="cuda"))[:, None]}

    def run():
        return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, scale=scale, enable_gqa=True, **kw)

    ms, eager_ms = timings(run, args)
    return (f"| sdpa, contiguous K/V (baseline) | bf16 | {shape} | {ms * 1e3:8.1f} | {eager_ms * 1e3:8.1f} | "
            f"{flops / ms / 1e9:6.1f} TFLOP/s | - |")


def _name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
            torch.float8_e4m3fn: "fp8", torch.int8: "int8"}[dtype]


def _block_size(text: str) -> int:
    """--block-size: a power of two, as the runtime's tokens_per_block."""
    value = int(text)
    if value < 1 or value & (value - 1):
        raise argparse.ArgumentTypeError(f"{text} is not a power of two (e.g. 16 or 64)")
    return value


def main(argv: list[str] | None = None) -> int:
    global BLOCK_SIZE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=_block_size, default=BLOCK_SIZE,
                        help=f"tokens per cache block (default {BLOCK_SIZE}; the serving setting tokens_per_block)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-sweep", action="store_true", help="skip the small-shape correctness sweep")
    parser.add_argument("--mixed-only", action="store_true",
                        help="only the steps that mix decodes with a prompt (prefill kernel vs decode kernel)")
    parser.add_argument("--decode-sweep", action="store_true", help="only the decode kernel's tilings (see above)")
    parser.add_argument("--prefill-only", action="store_true", help="only the prefill table (no sweep)")
    parser.add_argument("--fresh-backends", action="store_true",
                        help="fresh prompts on torch's attention backends beside the paged kernel (see above)")
    parser.add_argument("--prefill-sweep", action="store_true",
                        help="only the prefill kernel's tilings (--sweep-block-m/-n, --sweep-warps, --sweep-stages)")
    parser.add_argument("--sweep-block-m", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--sweep-short", action="store_true",
                        help="--decode-sweep over a few tilings only (both program orders)")
    parser.add_argument("--sweep-kv", nargs="+", default=["fp8", "bf16"], choices=sorted(KV_DTYPES),
                        help="cache dtypes of --decode-sweep")
    parser.add_argument("--sweep-own-kv", action="store_true",
                        help="--prefill-sweep: the new tokens over the step's own rows (contiguous_kv): a quantized "
                             "cache's codes at every shape, a bf16 cache's K/V for fresh prompts")
    parser.add_argument("--sweep-fp16-only", action="store_true",
                        help="quantized caches: only the tilings on fp16 operands (the serving default), not bf16")
    parser.add_argument("--sweep-block-n", nargs="+", type=int, default=[32, 64, 128, 256])
    parser.add_argument("--sweep-warps", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--sweep-stages", nargs="+", type=int, default=[2, 3, 4])
    parser.add_argument("--sweep-heads", nargs="+", type=int, default=[1],
                        help="kv heads per program (DecodeConfig.heads; > 1: the by-heads kernel, if they divide the "
                             "model's 8)")
    parser.add_argument("--sweep-orders", type=int, default=2, choices=(1, 2),
                        help="1: sequence-major program order only (one sequence: the orders are the same)")
    parser.add_argument("--sweep-shapes", nargs="+", default=None, metavar="BATCHxCONTEXT",
                        help="--decode-sweep's shapes instead of the serving ones, e.g. 1x192 1x256 (batch-1 decode "
                             "of the 128-in / 128-out benchmark)")
    args = parser.parse_args(argv)
    BLOCK_SIZE = args.block_size
    if not torch.cuda.is_available():
        print("kernels.bench.attention needs a CUDA device", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {_triton_version()}; cache "
          f"blocks of {BLOCK_SIZE} tokens")
    failures: list[str] = []

    if args.mixed_only:
        return _mixed_table(gen, args, failures)
    if args.decode_sweep:
        return decode_sweep(gen, args, failures)
    if args.prefill_sweep:
        return prefill_sweep(gen, args, failures)
    if args.fresh_backends:
        status = fresh_backends(gen, args, failures)
        for f in failures:
            print("FAIL", f)
        return status
    if args.prefill_only:
        _prefill_table(gen, args, failures)
        for f in failures:
            print("FAIL", f)
        return 1 if failures else 0
    if not args.skip_sweep:
        results = sweep(gen)
        failures += [f"{name}: max err {err:.3g}" for name, ok, err in results if not ok]
        print(f"correctness sweep: {sum(ok for _, ok, _ in results)}/{len(results)} cases pass")

    for kv_name in ("bf16", "fp8"):
        ok, err = check_write(2048, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, KV_DTYPES[kv_name], gen)
        print(f"write_kv_cache 2048 tokens -> {kv_name}: {'exact' if ok else f'MISMATCH (max err {err:.3g})'}")
        if not ok:
            failures.append(f"write_kv_cache -> {kv_name}")

    print(f"\nLlama-3-8B attention: {NUM_HEADS} heads, {NUM_KV_HEADS} kv heads, head_dim {HEAD_DIM}, "
          f"block {BLOCK_SIZE}, bf16 queries; median of {args.iters} after {args.warmup} warmup\n")
    print("| kernel | kv | batch | context | splits | graph us | eager us | bandwidth (graph) | check |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for kv_name in ("bf16", "fp8"):
        for batch in (1, 8, 64):
            for context in (128, 2048, 8192):
                print(bench_decode(batch, context, kv_name, gen, args, failures), flush=True)
                torch.cuda.empty_cache()

    _prefill_table(gen, args, failures)
    return _mixed_table(gen, args, failures)


def _prefill_table(gen, args, failures) -> None:
    print("\n| kernel | kv | shape | graph us | eager us | throughput (graph) | check |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for kv_name in ("bf16", "fp8"):
        for q_lens, ctx_lens in (([2048], [0]), ([2048], [6144]), ([512] * 4, [0] * 4)):
            for row in bench_prefill(q_lens, ctx_lens, kv_name, gen, args, failures):
                print(row, flush=True)


def _mixed_table(gen, args, failures) -> int:
    print("\n| step (prefill kernel) | kv | graph us | K/V bandwidth | decode rows alone, decode kernel us | "
          "its bandwidth | split step (decodes on the decode kernel) us | its K/V bandwidth | check |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for kv_name in ("bf16", "fp8"):
        for num_decodes, context, prompt in ((64, 512, 128), (256, 700, 256), (256, 2048, 512)):
            print(bench_mixed(num_decodes, context, prompt, kv_name, gen, args, failures), flush=True)
            torch.cuda.empty_cache()
    if failures:
        print(f"\n{len(failures)} correctness failure(s):", *failures, sep="\n  ", file=sys.stderr)
        return 1
    print("\nall correctness checks passed")
    return 0


def _triton_version() -> str:
    import triton
    return triton.__version__


if __name__ == "__main__":
    sys.exit(main())
