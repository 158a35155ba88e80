"""Compile kernels for an H100 (sm_90) on a machine without a GPU, before spending device time on them.

    python -m kernels.bench.compile_sm90

The Triton interpreter (the CPU tests) accepts code that compiled Triton refuses, e.g. a kernel reading a plain
module-level int instead of a ``tl.constexpr``; such a kernel then fails at its first launch on the GPU. This
compiles the attention, frag GEMV and GEMM, MoE, fp8_block GEMM, argmax, LayerNorm and RoPE kernels named below with
``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` (no device needed) in the variants the runtime launches, and
prints for each whether it compiled and how many PDL waits its PTX holds. Run it with TRITON_INTERPRET unset.

``--sass DIR`` also writes each variant's PTX, TTGIR and SASS (``nvdisasm`` of the cubin, with Triton's own
binaries) into DIR and prints its registers and the opcodes of its innermost loops, so that a kernel change can
be read at the instruction level before any device time (session 29: where ptxas placed the frag GEMV's loads,
and whether Triton's pipeliner staged a load through shared memory: LDGSTS in the SASS).

It compiles with the Triton installed here, which may be newer than the device's: a construct only the device's
older frontend refuses (session 23: a constexpr ``if`` returning one type and falling through to a return of
another; session 40: a variable given another type inside a runtime ``if``; both refused by Triton 3.6) passes here
and still fails there. To compile with the device's frontend, unpack its wheel and put it first on the path:

    pip download --no-deps triton==3.6.0 -d /tmp/tr36 && unzip -q -d /tmp/tr36/site /tmp/tr36/triton-3.6.0-*.whl
    env -u TRITON_INTERPRET PYTHONPATH=/tmp/tr36/site:. python -m kernels.bench.compile_sm90
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)


def compile_kernel(fn, types: dict[str, str], constexprs: dict, num_warps: int = 4, num_stages: int = 3,
                   divisible: tuple[str, ...] = ()):
    """``fn`` (a ``triton.jit`` function) compiled for TARGET: ``types`` gives every runtime argument's Triton type
    ("*bf16", "i32", ...), ``constexprs`` every constexpr's value; ``divisible`` names the arguments a launch would
    specialise as multiples of 16 (pointers and sizes at real shapes), as Triton's JIT marks them."""
    names = fn.arg_names
    missing = [n for n in names if n not in types and n not in constexprs]
    if missing:
        raise ValueError(f"{fn.__name__}: no type or value for {missing}")
    signature = {n: types.get(n, "constexpr") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = ASTSource(fn=fn, signature=signature,
                    constexprs={(names.index(n),): v for n, v in constexprs.items()}, attrs=attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})


def _decode_attention() -> list[tuple[str, object]]:
    from kernels.paged_attention import _paged_decode_kernel

    types = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "block_tables_ptr": "*i32",
             "seq_lens_ptr": "*i32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "out_ptr": "*bf16",
             "part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "sinks_ptr": "*fp32",
             "counter_ptr": "*i32", "qk_scale": "fp32", "window": "i32", "num_splits": "i32", "softcap": "fp32",
             "kn_ptr": "*bf16", "vn_ptr": "*bf16", "slot_ptr": "*i64", "pos_ptr": "*i64", "inv_freq_ptr": "*fp32",
             "rope_scaling": "fp32", "long_from": "i32",
             **{n: "i32" for n in ("stride_qs", "stride_qh", "stride_os", "stride_oh", "stride_cb", "stride_ct",
                                   "stride_ch", "stride_bt", "stride_kns", "stride_knh", "stride_vns", "stride_vnh")}}
    base = dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_N=128, QUANT=0, FP32=False, F16=False,
                SPLIT=True, MIN_TILES=2, SPLITS_PAD=32, MERGE_UNROLL=4, EARLY=False, SOFTCAP=False, SINKS=False, HEADS_FIRST=False, WRITE=False,
                ROPE=False, ROT=128, INTERLEAVED=False, PDL=True)
    fp8 = {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}
    variants = [("split", {}, {}), ("split, 32-key tiles (a wide launch's)", {"BLOCK_N": 32}, {}),
                ("split, 32-key tiles, 64-token blocks", {"BLOCK_N": 32, "BLOCK_SIZE": 64}, {}),
                ("one split", {"SPLIT": False}, {}),
                ("sinks, softcap", {"SINKS": True, "SOFTCAP": True}, {}),
                ("fp8 cache", {"QUANT": 1, "F16": True, "BLOCK_N": 64}, fp8),
                ("fp8 cache, 64-token blocks", {"QUANT": 1, "F16": True, "BLOCK_N": 64, "BLOCK_SIZE": 64}, fp8),
                ("int8 cache", {"QUANT": 2, "F16": True, "BLOCK_N": 64}, {"k_cache_ptr": "*i8", "v_cache_ptr": "*i8"}),
                ("heads first", {"HEADS_FIRST": True}, {}),
                ("new K/V written, RoPE", {"WRITE": True, "ROPE": True}, {}),
                ("batch 1: new K/V written, RoPE, 64-key tiles, the first loaded early",
                 {"WRITE": True, "ROPE": True, "BLOCK_N": 64, "MIN_TILES": 1, "EARLY": True}, {}),
                ("batch 1: new K/V written, RoPE, 64-key tiles, the first loaded early, 64-token blocks",
                 {"WRITE": True, "ROPE": True, "BLOCK_N": 64, "MIN_TILES": 1, "EARLY": True, "BLOCK_SIZE": 64}, {}),
                ("new K/V written, RoPE, one split", {"WRITE": True, "ROPE": True, "SPLIT": False}, {}),
                ("new K/V written, no RoPE, fp8 cache", {"WRITE": True, "QUANT": 1, "F16": True, "BLOCK_N": 64}, fp8),
                ("new K/V written, RoPE, fp8 cache", {"WRITE": True, "ROPE": True, "QUANT": 1, "F16": True,
                                                      "BLOCK_N": 64}, fp8),
                ("batch 1: new K/V written, RoPE, fp8 cache, bf16 operands", {"WRITE": True, "ROPE": True, "QUANT": 1,
                                                                              "BLOCK_N": 64, "EARLY": True}, fp8),
                ("new K/V written, partial RoPE (a quarter)", {"WRITE": True, "ROPE": True, "ROT": 32}, {}),
                ("new K/V written, interleaved RoPE", {"WRITE": True, "ROPE": True, "INTERLEAVED": True}, {})]
    # pointers and strides as a launch at real shapes specialises them (multiples of 16): without the hint the
    # cache tiles' loads compile to one element each
    divisible = tuple(n for n, t in types.items() if t.startswith("*") or n.startswith("stride_") and n != "stride_bt")
    out = [(f"paged decode attention, {name}", lambda kw=kw, t=t: compile_kernel(
        _paged_decode_kernel, dict(types, **t), dict(base, **kw), divisible=divisible)) for name, kw, t in variants]
    return out + _decode_by_heads(types, base, fp8, divisible) + _prefill_attention(fp8) + _rope_write_kv()


def _decode_by_heads(types, base, fp8, divisible) -> list[tuple[str, object]]:
    """The decode kernel that takes several kv heads of a sequence per program (many short sequences)."""
    from kernels.paged_attention import _paged_decode_heads_kernel

    names = set(_paged_decode_heads_kernel.arg_names)
    h_types = {n: t for n, t in types.items() if n in names}
    h_base = {n: v for n, v in base.items() if n in names}
    h_div = tuple(n for n in divisible if n in names)
    serving = {"BLOCK_SIZE": 64, "HEADS": 8}
    variants = [("fp8 cache, 64-token blocks", {**serving, "QUANT": 1, "F16": True, "BLOCK_N": 64}, fp8),
                ("fp8 cache, 64-token blocks, 4 heads", {**serving, "QUANT": 1, "F16": True, "BLOCK_N": 64,
                                                         "HEADS": 4}, fp8),
                ("bf16 cache, 32-key tiles, 64-token blocks", {**serving, "BLOCK_N": 32}, {}),
                ("bf16 cache, 32-key tiles, 16-token blocks", {**serving, "BLOCK_N": 32, "BLOCK_SIZE": 16}, {}),
                ("int8 cache, 16-token blocks, sinks, softcap",
                 {**serving, "QUANT": 2, "F16": True, "BLOCK_N": 64, "BLOCK_SIZE": 16, "SINKS": True,
                  "SOFTCAP": True}, {"k_cache_ptr": "*i8", "v_cache_ptr": "*i8"})]
    return [(f"paged decode attention by heads, {name}", lambda kw=kw, t=t: compile_kernel(
        _paged_decode_heads_kernel, dict(h_types, **t), dict(h_base, **kw), divisible=h_div))
        for name, kw, t in variants]


def _rope_write_kv() -> list[tuple[str, object]]:
    from kernels.paged_attention import _rope_write_kv_kernel

    types = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "pos_ptr": "*i64", "inv_freq_ptr": "*fp32",
             "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "slot_ptr": "*i64", "k_scale_ptr": "*fp32",
             "v_scale_ptr": "*fp32", "scaling": "fp32", "long_from": "i32", "qo_ptr": "*bf16",
             **{n: "i32" for n in ("num_heads", "num_kv_heads", "q_blocks", "stride_qt", "stride_kt", "stride_vt",
                                   "stride_cb", "stride_ct", "stride_ch", "stride_qot")}}
    out = []
    for name, rot, inter in (("whole heads", 128, False), ("a quarter (partial)", 32, False),
                             ("interleaved", 128, True)):
        half = rot // 2
        consts = dict(HEAD_DIM=128, HALF=half, STEP=2 if inter else 1, PAIR=1 if inter else half, ROT=rot,
                      TAIL_PAD=max(1, 1 << (128 - rot - 1).bit_length()) if rot < 128 else 1, BLOCK_H=8,
                      BLOCK_D=1 << (half - 1).bit_length(), BLOCK_SIZE=16, QUANT=0, PDL=True, K_INPLACE=False,
                      Q_COPY=False)
        out.append((f"rope + KV write, {name}",
                    lambda consts=consts: compile_kernel(_rope_write_kv_kernel, types, consts, 4)))
    # an FP8 cache (the keys quantized after their rounding to the activation dtype), with and without the rotated
    # keys written back (the own-K/V prefill's k_in_place)
    fp8 = dict(types, k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv")
    for inplace in (False, True):
        consts = dict(HEAD_DIM=128, HALF=64, STEP=1, PAIR=64, ROT=128, TAIL_PAD=1, BLOCK_H=8, BLOCK_D=64,
                      BLOCK_SIZE=16, QUANT=1, PDL=True, K_INPLACE=inplace, Q_COPY=False)
        out.append((f"rope + KV write, fp8 cache{', codes in place' if inplace else ''}",
                    lambda consts=consts: compile_kernel(_rope_write_kv_kernel, fp8, consts, 4)))
    # q rotated into a copy (the decode by heads), partial rotary: its other features copied
    consts = dict(HEAD_DIM=128, HALF=16, STEP=1, PAIR=16, ROT=32, TAIL_PAD=128, BLOCK_H=8, BLOCK_D=16, BLOCK_SIZE=64,
                  QUANT=1, PDL=True, K_INPLACE=False, Q_COPY=True)
    out.append(("rope + KV write, fp8 cache, q into a copy, a quarter (partial)",
                lambda consts=consts: compile_kernel(_rope_write_kv_kernel, fp8, consts, 4)))
    # partial rotary (a quarter) into an INT8 cache: the key's other features quantized as they are
    int8 = dict(types, k_cache_ptr="*i8", v_cache_ptr="*i8")
    consts = dict(HEAD_DIM=128, HALF=16, STEP=1, PAIR=16, ROT=32, TAIL_PAD=128, BLOCK_H=8, BLOCK_D=16, BLOCK_SIZE=16,
                  QUANT=2, PDL=True, K_INPLACE=False, Q_COPY=False)
    out.append(("rope + KV write, a quarter (partial), int8 cache",
                lambda consts=consts: compile_kernel(_rope_write_kv_kernel, int8, consts, 4)))
    return out


def _prefill_attention(fp8: dict[str, str]) -> list[tuple[str, object]]:
    from kernels.paged_attention import PREFILL_ACC_DOT, PREFILL_LPT, _paged_prefill_kernel

    types = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "k_own_ptr": "*bf16",
             "v_own_ptr": "*bf16", "block_tables_ptr": "*i32",
             "cu_seqlens_q_ptr": "*i32", "context_lens_ptr": "*i32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
             "sinks_ptr": "*fp32", "out_ptr": "*bf16", "qk_scale": "fp32", "window": "i32", "num_seqs": "i32",
             "softcap": "fp32", **{n: "i32" for n in ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_cb",
                                                       "stride_ct", "stride_ch", "stride_bt", "stride_kt",
                                                       "stride_kh", "stride_vt", "stride_vh")}}
    base = dict(GROUP=4, GROUP_P2=4, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_T=16, BLOCK_N=64, QUANT=0, FP32=False,
                F16=False, SOFTCAP=False, SINKS=False, PDL=True, CONTIG=False, SKIP_SINGLE=False,
                ACC_DOT=PREFILL_ACC_DOT, LPT=PREFILL_LPT)  # the loop and order the runtime launches
    variants = [("bf16 cache", {}, {}), ("fp8 cache", {"QUANT": 1, "F16": True}, fp8),
                ("bf16 cache, 64-token blocks", {"BLOCK_SIZE": 64}, {}),
                ("fp8 cache, 64-token blocks", {"QUANT": 1, "F16": True, "BLOCK_SIZE": 64}, fp8),
                ("fp8 cache, 64-token blocks, one-token sequences skipped (the mixed step's)",
                 {"QUANT": 1, "F16": True, "BLOCK_SIZE": 64, "SKIP_SINGLE": True}, fp8),
                ("int8 cache, 64-token blocks", {"QUANT": 2, "F16": True, "BLOCK_SIZE": 64},
                 {"k_cache_ptr": "*i8", "v_cache_ptr": "*i8"}),
                ("the new tokens over their own K/V", {"CONTIG": True}, {}),
                ("fp8 cache, 64-token blocks, the new tokens over their own codes",
                 {"QUANT": 1, "F16": True, "BLOCK_SIZE": 64, "CONTIG": True}, fp8),
                ("fp8 cache, 64-token blocks, own codes, one-token sequences skipped",
                 {"QUANT": 1, "F16": True, "BLOCK_SIZE": 64, "CONTIG": True, "SKIP_SINGLE": True}, fp8)]
    # pointers and strides as a launch at real shapes specialises them (multiples of 16), as for the decode kernel
    divisible = tuple(n for n, t in types.items() if t.startswith("*") or n.startswith("stride_") and n != "stride_bt")
    return [(f"paged prefill attention, {name}", lambda kw=kw, t=t: compile_kernel(
        _paged_prefill_kernel, dict(types, **t), dict(base, **kw), divisible=divisible)) for name, kw, t in variants]


def _frag() -> list[tuple[str, object]]:
    from kernels.w4a16_frag import _w4a16_frag_kernel

    types = {"x_ptr": "*bf16", "qw_ptr": "*u8", "s_ptr": "*fp32", "z_ptr": "*u8", "bias_ptr": "*bf16", "y_ptr": "*bf16",
             "part_ptr": "*fp32", "counter_ptr": "*i32", "gain_ptr": "*bf16", "xss_ptr": "*fp32", "res_ptr": "*bf16",
             "ss_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "iters_per_split": "i32",
             "eps": "fp32"}
    base = dict(SPLIT_K=8, ONE_GROUP=False, HAS_BIAS=False, WARPS=4, BATCH_TILES=1, DEPTH=1, BITS=4, PDL=True,
                GATED=False, NORM=False, NBX=1, RESIDUAL=False, LATE_TRIGGER=False, LOADS_ONLY=False, RANGE_LINES=0,
                S_ROWS=1)
    variants = [("4-bit", {}), ("4-bit, loads only (bench)", {"LOADS_ONLY": True}),
                ("4-bit, SwiGLU out", {"GATED": True}),
                ("4-bit, 16 rows, SwiGLU out, bias", {"GATED": True, "BATCH_TILES": 2, "HAS_BIAS": True}),
                ("8-bit, SwiGLU out", {"BITS": 8, "ONE_GROUP": True, "GATED": True, "SPLIT_K": 1}),
                ("4-bit, norm in, SwiGLU out", {"NORM": True, "NBX": 32, "GATED": True}),
                ("4-bit, 32 rows, norm in", {"NORM": True, "NBX": 32, "BATCH_TILES": 4}),
                ("4-bit, residual out", {"RESIDUAL": True}), ("4-bit, late trigger", {"LATE_TRIGGER": True}),
                ("8-bit, 16 rows, norm in, residual out", {"BITS": 8, "ONE_GROUP": True, "NORM": True, "NBX": 32,
                                                           "RESIDUAL": True, "BATCH_TILES": 2}),
                ("4-bit, one group per channel", {"ONE_GROUP": True}),
                ("4-bit, range prefetch", {"RANGE_LINES": 64, "S_ROWS": 8}),
                ("8-bit, range prefetch", {"BITS": 8, "ONE_GROUP": True, "RANGE_LINES": 32})]
    divisible = ("x_ptr", "qw_ptr", "s_ptr", "z_ptr", "y_ptr", "part_ptr", "N", "K", "stride_xm")
    return [(f"frag W4A16 GEMV, {name}", lambda kw=kw: compile_kernel(
        _w4a16_frag_kernel, types, dict(base, **kw), num_warps=dict(base, **kw)["WARPS"], divisible=divisible))
        for name, kw in variants]


def _frag_mm() -> list[tuple[str, object]]:
    from kernels.frag_mm import _frag_mm_kernel

    types = {"x_ptr": "*bf16", "qw_ptr": "*u8", "s_ptr": "*fp32", "z_ptr": "*u8", "bias_ptr": "*bf16", "y_ptr": "*bf16",
             "part_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_ym": "i32",
             "iters_per_split": "i32"}
    base = dict(ONE_GROUP=False, HAS_BIAS=False, BLOCK_M=128, TILES_N=8, SPLIT=1, BITS=4, SWAP=False, X_GATHER=False,
                MMA_ORDER=False, PACKED=False, FP32_DOT=False, X_BF16=True)
    variants = [("4-bit groups, MMA order, swapped", {"SWAP": True, "MMA_ORDER": True}, 8),
                ("4-bit groups, MMA order, swapped, packed", {"SWAP": True, "MMA_ORDER": True, "PACKED": True}, 8),
                ("4-bit groups, MMA order, swapped, packed, 64 features on 4 warps",
                 {"SWAP": True, "MMA_ORDER": True, "PACKED": True, "TILES_N": 4}, 4),
                ("4-bit per channel, MMA order, swapped, packed",
                 {"SWAP": True, "MMA_ORDER": True, "PACKED": True, "ONE_GROUP": True}, 8),
                ("4-bit groups, MMA order, swapped, 64 features on 4 warps", {"SWAP": True, "MMA_ORDER": True,
                                                                             "TILES_N": 4}, 4),
                ("4-bit groups, MMA order, swapped, 256 rows", {"SWAP": True, "MMA_ORDER": True, "BLOCK_M": 256}, 8),
                ("4-bit groups, MMA order", {"MMA_ORDER": True}, 8),
                ("4-bit groups, 128 x 128", {}, 8), ("4-bit groups, swapped", {"SWAP": True}, 8),
                ("4-bit groups, x by column indices", {"X_GATHER": True}, 8),
                ("4-bit groups, 64 x 128, split", {"BLOCK_M": 64, "SPLIT": 4}, 4),
                ("4-bit per channel, bias", {"ONE_GROUP": True, "HAS_BIAS": True}, 8),
                ("8-bit per channel", {"BITS": 8, "ONE_GROUP": True}, 8),
                ("8-bit per channel, MMA order, swapped", {"BITS": 8, "ONE_GROUP": True, "SWAP": True,
                                                           "MMA_ORDER": True, "TILES_N": 4}, 4)]
    divisible = ("x_ptr", "qw_ptr", "s_ptr", "z_ptr", "y_ptr", "part_ptr", "N", "K", "stride_xm", "stride_ym")
    out = [(f"frag_mm GEMM, {name}", lambda kw=kw, w=w: compile_kernel(
        _frag_mm_kernel, types, dict(base, **kw), num_warps=w, divisible=divisible)) for name, kw, w in variants]
    return out + _frag_mm_fp8()


def _frag_mm_fp8() -> list[tuple[str, object]]:
    from kernels.frag_mm import _frag_mm_fp8_kernel

    types = {"xq_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "qw_ptr": "*u8", "s_ptr": "*fp32", "z_ptr": "*u8",
             "bias_ptr": "*bf16", "y_ptr": "*bf16", "part_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32",
             "stride_xm": "i32", "stride_ym": "i32", "iters_per_split": "i32"}
    base = dict(ONE_GROUP=False, HAS_BIAS=False, BLOCK_M=128, TILES_N=8, SPLIT=1, EMULATE=False, ASM=False,
                PAIR=False)
    variants = [("groups, 128 x 128, 8 warps", {}, 8), ("groups, 128 x 128, 8 warps, asm", {"ASM": True}, 8),
                ("groups, 64 x 128, 4 warps, asm, paired", {"ASM": True, "TILES_N": 4, "PAIR": True}, 4),
                ("groups, 128 x 64, 8 warps, asm, paired", {"ASM": True, "BLOCK_M": 64, "PAIR": True}, 8),
                ("groups, 128 x 128, 8 warps, asm, paired", {"ASM": True, "PAIR": True}, 8),
                ("groups, 256 x 64, 8 warps, asm", {"ASM": True, "BLOCK_M": 64, "TILES_N": 16}, 8),
                ("groups, 256 x 64, 8 warps, asm, paired", {"ASM": True, "BLOCK_M": 64, "TILES_N": 16, "PAIR": True}, 8),
                ("groups, 128 x 64, 4 warps, asm", {"ASM": True, "BLOCK_M": 64}, 4),
                ("groups, 256 x 32, 8 warps, asm", {"ASM": True, "BLOCK_M": 32, "TILES_N": 16}, 8),
                ("groups, 128 x 256, 8 warps, asm", {"ASM": True, "BLOCK_M": 256}, 8),
                ("groups, 64 x 128, 4 warps, asm", {"ASM": True, "TILES_N": 4}, 4),
                ("groups, 128 x 256, 8 warps", {"BLOCK_M": 256}, 8),
                ("groups, 64 x 128, 4 warps", {"TILES_N": 4}, 4), ("per channel, bias, split",
                                                                  {"ONE_GROUP": True, "HAS_BIAS": True, "SPLIT": 2}, 8)]
    divisible = ("xq_ptr", "qw_ptr", "s_ptr", "z_ptr", "y_ptr", "part_ptr", "N", "K", "stride_xm", "stride_ym")
    return [(f"frag_mm_fp8 W4A8 GEMM, {name}", lambda kw=kw, w=w: compile_kernel(
        _frag_mm_fp8_kernel, types, dict(base, **kw), num_warps=w, divisible=divisible)) for name, kw, w in variants]


def _moe() -> list[tuple[str, object]]:
    from kernels.moe import _moe_down_kernel, _moe_up_kernel

    ints = ("num_slots", "num_experts", "num_rows", "N", "K", "num_groups")
    up_types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "h_ptr": "*bf16", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
                "ws_ptr": "*fp32", "b_ptr": "*bf16", "wz_ptr": "*u8", "alpha": "fp32", "limit": "fp32",
                **{n: "i32" for n in ints + ("stride_xm", "stride_we", "stride_wn", "stride_hm")}}
    down_types = {"h_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "sorted_ptr": "*i32",
                  "block_expert_ptr": "*i32", "ws_ptr": "*fp32", "b_ptr": "*bf16", "wz_ptr": "*u8",
                  **{n: "i32" for n in ints + ("stride_hm", "stride_we", "stride_wn", "stride_ym")}}
    tiles = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1)
    base = dict(IEEE=False, EMULATE_BF16=False, FP8=False, HAS_BIAS=False, INT4=False, GROUP_SIZE=1, PTX=False,
                BLOCK_FP8=False, SCALE_ROWS=1, **tiles)
    variants = [("bf16 experts", {}, {}), ("FP8 experts", {"FP8": True}, {"w_ptr": "*fp8e4nv"}),
                ("W4A16 experts, groups of 128", {"INT4": True, "GROUP_SIZE": 128, "PTX": True}, {"w_ptr": "*u8"}),
                ("block-FP8 experts, 128 x 128 blocks", {"BLOCK_FP8": True, "SCALE_ROWS": 128},
                 {"w_ptr": "*fp8e4nv"})]
    divisible = ("x_ptr", "h_ptr", "y_ptr", "w_ptr", "N", "K", "stride_xm", "stride_hm", "stride_we", "stride_wn",
                 "stride_ym")
    out = []
    for name, kw, t in variants:
        out.append((f"fused MoE up GEMM, {name}", lambda kw=kw, t=t: compile_kernel(
            _moe_up_kernel, dict(up_types, **t), dict(base, TOP_K=8, ACT=0, **kw),
            divisible=tuple(n for n in divisible if n in up_types))))
        out.append((f"fused MoE down GEMM, {name}", lambda kw=kw, t=t: compile_kernel(
            _moe_down_kernel, dict(down_types, **t), dict(base, **kw),
            divisible=tuple(n for n in divisible if n in down_types))))
    return out + _moe_gemv()


def _moe_gemv() -> list[tuple[str, object]]:
    from kernels.moe_gemv import _CUDA_CONFIG, _moe_gemv_down_kernel, _moe_gemv_up_kernel

    ints = ("num_slots", "N", "K", "num_groups", "steps_per_split")
    ptrs = {"w_ptr": "*u8", "ws_ptr": "*fp32", "wz_ptr": "*u8", "b_ptr": "*bf16", "experts_ptr": "*i64",
            "part_ptr": "*fp32", "counter_ptr": "*i32"}
    up_types = {"x_ptr": "*bf16", "h_ptr": "*bf16", "alpha": "fp32", "limit": "fp32", **ptrs,
                **{n: "i32" for n in ints + ("stride_xm", "stride_we", "stride_wn", "stride_hm")}}
    down_types = {"h_ptr": "*bf16", "y_ptr": "*bf16", **ptrs,
                  **{n: "i32" for n in ints + ("stride_hm", "stride_we", "stride_wn", "stride_ym")}}
    cfg = _CUDA_CONFIG
    base = dict(HAS_BIAS=False, GROUP_SIZE=128, EMULATE_BF16=False, PTX=True, EVEN_N=True, EVEN_K=True, S_POW2=8,
                ROWS=1, SPLIT_K=1)
    variants = [("1 slot per pass", {}), ("2 slots per pass, split 4", {"ROWS": 2, "SPLIT_K": 4, "S_POW2": 16}),
                ("4 slots per pass, 64-row tiles, split 4", {"ROWS": 4, "SPLIT_K": 4, "S_POW2": 32, "BLOCK_N": 64})]
    divisible = ("x_ptr", "h_ptr", "y_ptr", "w_ptr", "part_ptr", "N", "K", "stride_xm", "stride_hm", "stride_we",
                 "stride_wn", "stride_ym")
    out = []
    for name, kw in variants:
        out.append((f"MoE W4A16 GEMV up, {name}", lambda kw=kw: compile_kernel(
            _moe_gemv_up_kernel, up_types, dict(base, TOP_K=8, ACT=0, **dict(dict(BLOCK_N=cfg.block_n,
                                                                                  BLOCK_K=cfg.block_k), **kw)),
            cfg.num_warps, cfg.num_stages, tuple(n for n in divisible if n in up_types))))
        out.append((f"MoE W4A16 GEMV down, {name}", lambda kw=kw: compile_kernel(
            _moe_gemv_down_kernel, down_types, dict(base, **dict(dict(BLOCK_N=cfg.down_block_n,
                                                                      BLOCK_K=cfg.down_block_k), **kw)),
            cfg.num_warps, cfg.num_stages, tuple(n for n in divisible if n in down_types))))
    return out


def _fp8_block() -> list[tuple[str, object]]:
    from kernels.fp8_block_gemm import (_CUDA_CONFIGS, _GEMV_CUDA_CONFIGS, _fp8_block_gemm_kernel,
                                        _fp8_block_gemv_kernel, _quantize_groups_kernel)

    types = {"x_ptr": "*bf16", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "bias_ptr": "*bf16",
             "y_ptr": "*bf16", "part_ptr": "*fp32", "counter_ptr": "*i32",
             **{n: "i32" for n in ("M", "N", "K", "BN", "k_steps_per_split", "stride_xm", "stride_wn", "stride_sn")}}
    divisible = ("x_ptr", "w_ptr", "ws_ptr", "y_ptr", "part_ptr", "N", "K", "stride_xm", "stride_wn")
    out = []
    for bound, cfg in _CUDA_CONFIGS:
        for split in (1, 4) if cfg.split_k != 1 else (1,):
            constexprs = dict(HAS_BIAS=False, SPLIT_K=split, PREQUANT=cfg.prequant, EMULATE_FP8=False,
                              DOT_FP16=False, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=128,
                              GROUP_M=cfg.group_m, PDL=True)
            t = dict(types, x_ptr="*fp8e4nv") if cfg.prequant else types
            out.append((f"fp8_block GEMM, {cfg.block_m}x{cfg.block_n} tiles, split_k {split}"
                        f"{', x quantized before' if cfg.prequant else ''}",
                        lambda c=constexprs, cfg=cfg, t=t: compile_kernel(
                            _fp8_block_gemm_kernel, t, c, cfg.num_warps, cfg.num_stages, divisible)))
    out.append(("fp8_block x quantization (groups of 128)", lambda: compile_kernel(
        _quantize_groups_kernel, {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "M": "i32", "K": "i32",
                                  "num_groups": "i32", "stride_xm": "i32"},
        dict(EMULATE_FP8=False, GK=128, GROUPS=16, PDL=True), divisible=("x_ptr", "q_ptr", "K", "stride_xm"))))
    gemv_types = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "bias_ptr": "*bf16", "y_ptr": "*bf16",
                  "part_ptr": "*fp32", "counter_ptr": "*i32",
                  **{n: "i32" for n in ("N", "K", "num_groups", "steps_per_split", "stride_xm", "stride_wn",
                                        "stride_sn")}}
    gemv_divisible = ("x_ptr", "w_ptr", "ws_ptr", "y_ptr", "part_ptr", "N", "K", "stride_xm", "stride_wn")
    for rows, cfg in _GEMV_CUDA_CONFIGS:
        for split in (1, 4):
            constexprs = dict(ROWS=rows, BN=128, HAS_BIAS=False, SPLIT_K=split, EMULATE_FP8=False, EVEN_N=True,
                              EVEN_K=True, BLOCK_N=cfg.block_n, G_STEP=max(1, cfg.block_k // 128), GK=128, VEC=16,
                              NUM_STAGES=cfg.num_stages, PREFETCH_ROWS=cfg.block_n, PREFETCH_LINES=2, PDL=True)
            out.append((f"fp8_block GEMV, {rows} rows, {cfg.block_n}x{cfg.block_k} tiles, split_k {split}",
                        lambda c=constexprs, cfg=cfg: compile_kernel(
                            _fp8_block_gemv_kernel, gemv_types, c, cfg.num_warps, cfg.num_stages, gemv_divisible)))
    return out


def _argmax() -> list[tuple[str, object]]:
    from kernels.argmax import _chunk_argmax_kernel, _one_chunk_argmax_kernel, _row_argmax_kernel

    return [("argmax, one chunk (a small vocabulary)", lambda: compile_kernel(
                _one_chunk_argmax_kernel, {"logits_ptr": "*fp32", "out_ptr": "*i64", "vocab": "i32", "stride": "i32",
                                           "invalid": "i32"}, {"BLOCK": 4096}, 8)),
            ("argmax, chunks", lambda: compile_kernel(
                _chunk_argmax_kernel, {"logits_ptr": "*fp32", "val_ptr": "*fp32", "idx_ptr": "*i32", "nan_ptr": "*i32",
                                       "vocab": "i32", "stride": "i32", "num_chunks": "i32"}, {"BLOCK": 4096}, 8)),
            ("argmax, rows", lambda: compile_kernel(
                _row_argmax_kernel, {"val_ptr": "*fp32", "idx_ptr": "*i32", "nan_ptr": "*i32", "out_ptr": "*i64",
                                     "num_chunks": "i32", "invalid": "i32"}, {"CHUNKS_PAD": 32}, 1))]


def _norms_and_rope() -> list[tuple[str, object]]:
    from kernels.fused_norm import _layer_norm_kernel
    from kernels.rope import _rope_kernel

    ln = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16",
          "total_ptr": "*bf16", "stride_x": "i32", "stride_res": "i32", "stride_out": "i32", "stride_total": "i32",
          "num_cols": "i32", "eps": "fp32"}
    rope = {"x_ptr": "*bf16", "pos_ptr": "*i64", "inv_freq_ptr": "*fp32", "stride_xt": "i32", "num_heads": "i32",
            "scaling": "fp32", "long_from": "i32"}
    out = [(f"layer_norm, {'gain' if w else 'no gain'}{' and bias' if b else ''}{', residual add' if r else ''}, 2560",
            lambda w=w, b=b, r=r: compile_kernel(
                _layer_norm_kernel, ln, {"HAS_RESIDUAL": r, "HAS_WEIGHT": w, "HAS_BIAS": b, "BLOCK": 4096,
                                         "PDL": True}, 4))
           for w, b, r in ((True, True, False), (True, False, False), (False, False, False), (True, True, True))]
    # head_dim, rotary_dim, interleaved: Llama (whole heads), Phi-2 (half), GPT-NeoX / StableLM (a quarter), Cohere
    for head_dim, rot, inter in ((128, 128, False), (80, 40, False), (128, 32, False), (128, 128, True)):
        half = rot // 2
        out.append((f"rope, head_dim {head_dim}, rotary_dim {rot}{', interleaved' if inter else ''}",
                    lambda head_dim=head_dim, half=half, inter=inter: compile_kernel(
                        _rope_kernel, rope, {"HEAD_DIM": head_dim, "HALF": half, "STEP": 2 if inter else 1,
                                             "PAIR": 1 if inter else half, "BLOCK_H": 32,
                                             "BLOCK_D": 1 << (half - 1).bit_length(), "PDL": True}, 4)))
    return out


def _silu_quant() -> list[tuple[str, object]]:
    from kernels.activation import _silu_mul_kernel, _silu_mul_quant_2pass_kernel, _silu_mul_quant_kernel
    from kernels.fused_norm import _rms_norm_kernel

    types = {"gate_ptr": "*bf16", "up_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "stride_gate": "i32",
             "stride_up": "i32", "stride_q": "i32", "num_cols": "i32"}
    consts = {"INT8": False, "EMULATE_FP8": False, "PDL": True}
    static = {"gate_ptr": "*bf16", "up_ptr": "*bf16", "out_ptr": "*fp8e4nv", "stride_gate": "i32", "stride_up": "i32",
              "stride_out": "i32", "num_cols": "i32", "s_ptr": "*fp32"}
    norm = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*fp8e4nv", "total_ptr": "*bf16",
            "s_ptr": "*fp32", "stride_x": "i32", "stride_res": "i32", "stride_out": "i32", "stride_total": "i32",
            "num_cols": "i32", "eps": "fp32", "weight_offset": "fp32"}
    norm_consts = {"HAS_RESIDUAL": True, "HAS_WEIGHT": True, "HAS_OFFSET": False, "QUANT": 1, "EMULATE_FP8": False,
                   "BLOCK": 4096, "PDL": True, "STATIC": False, "QMIN": -127.0}
    plain = {k: v for k, v in static.items() if k not in ("s_ptr", "out_ptr")} | {"out_ptr": "*bf16"}
    return [("silu_mul quantized, one pass, 14336", lambda: compile_kernel(
                _silu_mul_quant_kernel, types, {**consts, "BLOCK": 16384}, 16)),
            ("silu_mul quantized, two passes of 2048", lambda: compile_kernel(
                _silu_mul_quant_2pass_kernel, types, {**consts, "BLOCK": 2048}, 4)),
            ("silu_mul, static fp8 codes", lambda: compile_kernel(
                _silu_mul_kernel, static, {"BLOCK": 1024, "PDL": True, "TILE": 0, "STATIC": True, "INT8": False,
                                           "QMIN": -448.0, "EMULATE_FP8": False}, 4)),
            ("silu_mul, bf16 out", lambda: compile_kernel(
                _silu_mul_kernel, plain, {"BLOCK": 1024, "PDL": True, "TILE": 0, "s_ptr": None, "STATIC": False,
                                          "INT8": False, "QMIN": -127.0, "EMULATE_FP8": False}, 4)),
            ("residual add + rms_norm, per-token fp8 codes, 4096", lambda: compile_kernel(
                _rms_norm_kernel, norm, norm_consts, 8)),
            ("residual add + rms_norm, static fp8 codes, 4096", lambda: compile_kernel(
                _rms_norm_kernel, norm, {**norm_consts, "STATIC": True, "QMIN": -448.0}, 8))]


def _w8a8_rows() -> list[tuple[str, object]]:
    from kernels.pdl import prefetch_rows_plan
    from kernels.w8a8_rows import _CUDA_CONFIGS, _w8a8_rows_kernel

    out = []
    for code in ("fp8e4nv", "i8"):
        types = {"x_ptr": f"*{code}", "xs_ptr": "*fp32", "w_ptr": f"*{code}", "ws_ptr": "*fp32", "bias_ptr": "*bf16",
                 "y_ptr": "*bf16", "part_ptr": "*i32" if code == "i8" else "*fp32", "counter_ptr": "*i32",
                 **{n: "i32" for n in ("M", "N", "K", "steps_per_split", "stride_xm", "stride_wn", "stride_ym")}}
        for (bound, cfg), (split, even, bias) in zip(_CUDA_CONFIGS, ((4, True, False), (1, True, True),
                                                                     (4, False, True))):
            rows, lines = prefetch_rows_plan(cfg.block_n, cfg.block_k)
            consts = dict(INT8=code == "i8", PER_CHANNEL=True, HAS_BIAS=bias, SPLIT_K=split, SWAP=cfg.swap,
                          EMULATE=False, EVEN=even, PROMOTE=cfg.promote, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                          BLOCK_K=cfg.block_k, PREFETCH_ROWS=rows, PREFETCH_LINES=lines, PDL=True)
            name = (f"w8a8 rows {code}, {cfg.block_m}x{cfg.block_n}x{cfg.block_k}{' swap' if cfg.swap else ''}, "
                    f"split {split}{'' if even else ', masked'}{', bias' if bias else ''}")
            out.append((name, lambda t=types, c=consts, cfg=cfg: compile_kernel(
                _w8a8_rows_kernel, t, c, cfg.num_warps, cfg.num_stages,
                divisible=("x_ptr", "w_ptr", "K", "N", "stride_xm", "stride_wn", "stride_ym"))))
    from kernels.w8a8_gemm import _quantize_rows_static_kernel

    for code, qmin in (("fp8e4nv", -448.0), ("i8", -128.0)):
        types = {"x_ptr": "*bf16", "s_ptr": "*fp32", "q_ptr": f"*{code}", "K": "i32", "stride_xm": "i32",
                 "stride_qm": "i32"}
        consts = dict(QMIN=qmin, INT8=code == "i8", EMULATE_FP8=False, BLOCK_K=1024)
        out.append((f"quantize_rows_static {code}", lambda t=types, c=consts: compile_kernel(
            _quantize_rows_static_kernel, t, c, 4, divisible=("x_ptr", "q_ptr", "K", "stride_xm", "stride_qm"))))
    return out


def _binary(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _loop_opcodes(sass: str) -> list[collections.Counter]:
    """The opcode counts of each backward-branching loop in ``sass`` (a label, then a branch back to it)."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line.strip()))}
    loops = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i:
            ops = collections.Counter()
            for body in lines[labels[m.group(1)]:i + 1]:
                op = re.match(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9]+)", body)
                if op:
                    ops[op.group(1)] += 1
            loops.append(ops)
    return loops


def dump_stem(out_dir: str, name: str) -> str:
    """The path, less its suffix (.ptx, .ttgir, .cubin, .sass), where ``--sass out_dir`` writes variant ``name``."""
    return os.path.join(out_dir, re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_"))


def _dump(name: str, kernel, out_dir: str) -> str:
    """Write the variant's PTX, TTGIR and SASS under out_dir; return its registers and loops' opcodes."""
    stem = dump_stem(out_dir, name)
    with open(stem + ".ptx", "w") as f:
        f.write(kernel.asm["ptx"])
    with open(stem + ".ttgir", "w") as f:
        f.write(kernel.asm["ttgir"])
    with open(stem + ".cubin", "wb") as f:
        f.write(kernel.asm["cubin"])
    sass = subprocess.run([_binary("nvdisasm"), "-c", "-g", stem + ".cubin"], capture_output=True, text=True,
                          check=True).stdout
    with open(stem + ".sass", "w") as f:
        f.write(sass)
    usage = subprocess.run([_binary("cuobjdump"), "--dump-resource-usage", stem + ".cubin"], capture_output=True,
                           text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    loops = "; ".join(f"loop of {sum(ops.values())}: " + " ".join(f"{op} {n}" for op, n in ops.most_common(8))
                      for ops in _loop_opcodes(sass))
    return f"registers {regs.group(1) if regs else '?'}" + (f"; {loops}" if loops else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sass", metavar="DIR", help="write each variant's PTX, TTGIR and SASS here; print its "
                        "registers and loop opcodes")
    parser.add_argument("--only", metavar="TEXT", nargs="+",
                        help="only the variants whose name contains one of the TEXTs (any case)")
    parser.add_argument("--exact", action="store_true", help="--only's TEXTs are whole names (any case)")
    args = parser.parse_args(argv)
    if args.sass:
        os.makedirs(args.sass, exist_ok=True)
    failures = 0
    for name, build in (_decode_attention() + _frag() + _frag_mm() + _moe() + _fp8_block() + _argmax()
                        + _norms_and_rope() + _silu_quant() + _w8a8_rows()):
        if args.only and not any(text.lower() == name.lower() if args.exact else text.lower() in name.lower()
                                 for text in args.only):
            continue
        try:
            kernel = build()
            ptx = kernel.asm["ptx"]
            detail = f"; {_dump(name, kernel, args.sass)}" if args.sass else ""
            print(f"ok    {name} (PDL waits in the PTX: {ptx.count('griddepcontrol.wait')}{detail})", flush=True)
        except Exception as e:  # report every variant, then fail
            failures += 1
            print(f"FAIL  {name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
