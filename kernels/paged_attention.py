"""Paged-attention Triton kernels over the runtime's block-table KV cache.

Three entry points, each tested against its plain-torch twin at the end of this file (``ref_*``,
written plainly: gather each sequence's K/V through its block table, dequantize, fp32 softmax):

- ``write_kv_cache``: scatter new K/V rows into their cache slots, quantizing for fp8/int8 caches.
- ``paged_decode_attention``: one query token per sequence (split-KV flash-decoding, merged by the last split to
  finish: one kernel).
- ``paged_prefill_attention``: packed variable-length causal prefill, chunked prefill included
  (``paged_mixed_attention``: a step mixing decodes with prompts, its decodes on the decode kernel).

Cache layout (``runtime/paged_kv.py``):

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]   (model dtype, fp8 e4m3 or int8)
    position p of sequence i  ->  block block_tables[i, p // block_size], row p % block_size
    real value = stored.float() * k_scale   (per-layer fp32 scalar; quantized caches only)

NOTE: the kernels never synchronise with the host (no ``.item()``, no per-sequence Python loops): grid
sizes come from tensor shapes only, so a step can be captured in a CUDA graph. Scales are read on the
device; pass them as tensors (a Python float is accepted and copied to the device on each call).

Numerics: scores, softmax statistics and accumulators are fp32; the two matmuls take operands in the
query's dtype (bf16/fp16 tensor cores, fp32 with IEEE precision for fp32 queries) with fp32
accumulation. Quantized K/V are fed to the matmuls as stored (fp8 and int8 values are exact in
bf16/fp16) and their scales are folded into the score scale and the output.

Two optional terms, each a constexpr flag so that attention without it compiles to the same code as before:
``softcap`` (Gemma 2: scores become softcap * tanh(scores / softcap), computed on the fp32 scores) and ``sinks``
(gpt-oss: one fp32 logit per query head added to its softmax denominator only, after the last key tile, or in the
merge of decode splits).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.gemv import _tile_counters
from kernels.pdl import pdl_args, wait_prior
from kernels.rope import NO_LONG_TABLE, cos_sin, rope_table, rotate

SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)  # 256: Gemma, Gemma 2 and 3
QUERY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_QUANT = {torch.float8_e4m3fn: 1, torch.int8: 2}  # cache storage dtype -> QUANT code in the kernels

# Decode split heuristic (``_decode_num_splits``).
# below this a split's partial result costs more to merge than it saves; KERNELS_DECODE_MIN_KEYS_PER_SPLIT sets
# another floor for A/B runs (a multiple of 64)
_MIN_KEYS_SETTING = os.environ.get("KERNELS_DECODE_MIN_KEYS_PER_SPLIT", "256")
_MIN_KEYS_PER_SPLIT = int(_MIN_KEYS_SETTING) if _MIN_KEYS_SETTING.isdigit() else 0
if _MIN_KEYS_PER_SPLIT < 64 or _MIN_KEYS_PER_SPLIT % 64:
    raise ValueError(f"KERNELS_DECODE_MIN_KEYS_PER_SPLIT={_MIN_KEYS_SETTING!r}: expected a multiple of 64 (256 by "
                     "default)")
_MAX_SPLITS = 32
_MERGE_UNROLL = 4  # a decode merge's partials loaded per iteration, in flight together
# KERNELS_PREFILL_F16=0: prefill over a quantized cache converts it to the query's dtype (bf16) instead of fp16
PREFILL_F16 = os.environ.get("KERNELS_PREFILL_F16", "1") != "0"
# The prefill kernel's inner loop and program order (=0 turns each off, for A/B runs): KERNELS_PREFILL_ACC_DOT folds
# the score scale into the exponent's multiply-add and lets the P @ V product accumulate into the rescaled
# accumulator inside the MMA (one fp32 [rows, head_dim] tile live instead of two); KERNELS_PREFILL_LPT runs each kv
# head's query tiles last first (a causal prompt's last tiles see the most keys: the longest programs start first,
# the launch ends on short ones). Measured together on an H200 (docs/BENCHMARKS.md, session 48; `python -m
# kernels.bench.attention --prefill-only --block-size 64`, one process per setting): an FP8 cache's own codes on the
# prompts' tiling 135.1 -> 128.1 us for a fresh 2,048-token prompt, 922.6 -> 881.3 after 6,144 cached, 63.6 -> 63.5
# for four of 512; bf16 124.3 -> 124.2, 651.2 -> 631.0, 51.8 -> 52.5. Each alone gained less.
PREFILL_ACC_DOT = os.environ.get("KERNELS_PREFILL_ACC_DOT", "1") != "0"
PREFILL_LPT = os.environ.get("KERNELS_PREFILL_LPT", "1") != "0"
# KERNELS_DECODE_CONFIG="BLOCK_N:WARPS:STAGES[:HEADS_FIRST[:HEADS]]" replaces _decode_config's tiling for 16-bit and
# quantized caches (fp16 operands) at head_dim <= 128, HEADS kv heads per program past _SMALL_DECODE_PAIRS pairs
# (A/B runs against `python -m kernels.bench.attention --decode-sweep`'s best-config lines; colons, since
# gpu_suite.sh's AB_SETTINGS separate variables with commas)
_DECODE_CONFIG_SETTING = os.environ.get("KERNELS_DECODE_CONFIG", "")


def _decode_config_override(setting: str) -> tuple[int, int, int, bool, int] | None:
    if not setting:
        return None
    parts = setting.split(":")
    ok = len(parts) in (3, 4, 5) and all(p.strip().isdigit() for p in parts)
    values = [int(p) for p in parts] + [0, 1][len(parts) - 3:] if ok else []
    if not ok or values[0] not in (16, 32, 64, 128, 256) or values[1] not in (1, 2, 4, 8, 16) \
            or not 1 <= values[2] <= 6 or values[3] not in (0, 1) or values[4] not in (1, 2, 4, 8, 16):
        raise ValueError(f"KERNELS_DECODE_CONFIG={setting!r}: expected BLOCK_N:WARPS:STAGES[:HEADS_FIRST[:HEADS]] with "
                         "BLOCK_N in 16..256 (a power of 2), WARPS in 1..16 (a power of 2), STAGES in 1..6, "
                         "HEADS_FIRST 0 or 1, HEADS (kv heads per program) in 1..16 (a power of 2), e.g. 256:4:2 or "
                         "64:4:3:0:8")
    return values[0], values[1], values[2], bool(values[3]), values[4]


_DECODE_CONFIG_OVERRIDE = _decode_config_override(_DECODE_CONFIG_SETTING)
# KERNELS_PREFILL_CONFIG="BLOCK_M:BLOCK_N:WARPS:STAGES" replaces _prefill_config's tiling for 16-bit queries at
# head_dim <= 128 (A/B runs against `python -m kernels.bench.attention --prefill-sweep`'s best-config lines)
_PREFILL_CONFIG_SETTING = os.environ.get("KERNELS_PREFILL_CONFIG", "")


def prefill_config_override(setting: str) -> tuple[int, int, int, int] | None:
    """``KERNELS_PREFILL_CONFIG``'s (BLOCK_M, BLOCK_N, num_warps, num_stages), or None when unset."""
    if not setting:
        return None
    parts = setting.split(":")
    ok = len(parts) == 4 and all(p.strip().isdigit() for p in parts)
    values = [int(p) for p in parts] if ok else []
    if not ok or values[0] not in (16, 32, 64, 128, 256) or values[1] not in (16, 32, 64, 128, 256) \
            or values[2] not in (1, 2, 4, 8, 16) or not 1 <= values[3] <= 6:
        raise ValueError(f"KERNELS_PREFILL_CONFIG={setting!r}: expected BLOCK_M:BLOCK_N:WARPS:STAGES with BLOCK_M and "
                         "BLOCK_N in 16..256 (powers of 2), WARPS in 1..16 (a power of 2), STAGES in 1..6, e.g. "
                         "128:64:8:3")
    return values[0], values[1], values[2], values[3]


_PREFILL_CONFIG_OVERRIDE = prefill_config_override(_PREFILL_CONFIG_SETTING)
# How an fp32 model's attention matmuls run on the GPU (KERNELS_FP32_DOT): "tf32x3", the default, splits each fp32
# operand into a TF32 high part and a TF32 remainder and takes three tensor-core products (high x high, high x low,
# low x high; the dropped low x low term is ~2^-22 of the product), "ieee" takes IEEE fp32 products on the FMA
# units (the bundled fp32 model's decode step: 0.233 against 0.179 ms of GPU time on an H200, docs/BENCHMARKS.md
# session 49). The interpreter computes in fp32 either way.
_FP32_DOT_PRECISIONS = ("tf32x3", "ieee")


def fp32_dot_precision(setting: str) -> str:
    """``KERNELS_FP32_DOT``'s input precision for fp32 matmuls ("tf32x3" when unset)."""
    setting = setting.strip() or "tf32x3"
    if setting not in _FP32_DOT_PRECISIONS:
        raise ValueError(f"KERNELS_FP32_DOT={setting!r}: expected one of {', '.join(_FP32_DOT_PRECISIONS)}")
    return setting


_FP32_DOT = tl.constexpr(fp32_dot_precision(os.environ.get("KERNELS_FP32_DOT", "")))
# INT8 caches' keys and values into fp16 operands by byte arithmetic (_s8_to); KERNELS_INT8_PTX=0: the compiler's
# per-value conversion (A/B runs)
_INT8_PTX = tl.constexpr(os.environ.get("KERNELS_INT8_PTX", "1") != "0")
_LOG2E = 1.4426950408889634
_NO_WINDOW = 1 << 30  # "window" passed to the kernels when there is none: larger than any position


# --- device helpers ---------------------------------------------------------------------------------
@triton.jit
def _mma(a, b, FP32: tl.constexpr):
    """a @ b accumulated in fp32. FP32: fp32 operands (fp32 models, and the CPU interpreter, whose bf16/fp16 dot
    is wrong) at _FP32_DOT's precision; otherwise tensor cores on the operands' dtype."""
    if FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=_FP32_DOT)
    return tl.dot(a, b)


@triton.jit
def _mma_acc(a, b, acc, FP32: tl.constexpr):
    """acc + a @ b, the products accumulated into acc by the MMA itself (as _mma otherwise)."""
    if FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=_FP32_DOT)
    return tl.dot(a, b, acc)


@triton.jit
def _softcap(s, cap):
    """cap * tanh(s / cap) of log2-domain scores, cap given in the log2 domain too (the model's cap * log2(e):
    the same squashing of the natural scores). tanh(y) = 1 - 2 / (e^2y + 1), e^2y kept finite (2^126: tanh 1)."""
    e = tl.exp2(tl.minimum(s * (2.8853900817779268 / cap), 126.0))  # 2 * log2(e): e^(2 s / cap), natural scores
    return cap * (1.0 - 2.0 / (e + 1.0))


@triton.jit
def _sink_share(sink, m_i):
    """The sink's term of the softmax denominator, 2^(sink * log2(e) - m_i) for a natural sink logit, kept finite:
    at most 2^126, which leaves a row that saw no key (m_i = -1e30) its zeros."""
    return tl.exp2(tl.minimum(sink.to(tl.float32) * 1.4426950408889634 - m_i, 126.0))


@triton.jit
def _query_operand(q, FP32: tl.constexpr, F16: tl.constexpr):
    """q as the matmuls take it: fp32 (FP32), fp16 clamped to its range (F16: a quantized cache's fp16 operands),
    else as loaded."""
    if FP32:
        out = q.to(tl.float32)
    elif F16:
        out = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    else:
        out = q
    return out


@triton.jit
def _rotate_rows(x, pair, first, cos, sin):
    """Rotate-half RoPE of whole rows x [R, D] (fp32): pair[:, d] = x[:, (d + D/2) % D], first: d < D/2, cos / sin
    [1, D] of angle d % (D/2); ``kernels.rope.rotate``'s fmas for each half (the same bits)."""
    x = x.to(tl.float32)
    pair = pair.to(tl.float32)
    return tl.where(first, tl.fma(x, cos, -(pair * sin)), tl.fma(x, cos, pair * sin))


@triton.jit
def _new_key_step(q, kn, vn, qk_scale, softcap, m_i, l_i, acc, SOFTCAP: tl.constexpr):
    """Fold one key held in registers (kn, vn: [D] fp32 values as the cache stores them) into the running (max, sum,
    acc) of the query rows q [R, D] (compute dtype), with the tile loop's roundings: operands in q's dtype, fp32
    score, the weight rounded to q's dtype before it multiplies the value."""
    s = tl.sum(q.to(tl.float32) * kn.to(q.dtype).to(tl.float32)[None, :], 1) * qk_scale
    if SOFTCAP:
        s = _softcap(s, softcap)
    m_new = tl.maximum(m_i, s)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new)
    l_i = l_i * alpha + p
    acc = acc * alpha[:, None] + p.to(q.dtype).to(tl.float32)[:, None] * vn.to(q.dtype).to(tl.float32)[None, :]
    return m_new, l_i, acc


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, FP32: tl.constexpr):
    """Fold one tile into the running (max, sum, acc). s: [R, N] log2-domain scores (-inf where
    masked); v: [N, D] in the compute dtype, zero where masked. m_i starts finite, so no NaN."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _mma(p.to(v.dtype), v, FP32)
    return m_new, l_i, acc


@triton.jit
def _online_softmax_step_folded(s, scale, v, m_i, l_i, acc, FP32: tl.constexpr):
    """_online_softmax_step of the log2-domain scores ``s * scale`` (scale > 0, s: raw scores, -inf where masked):
    the scale taken in the exponent's argument (one multiply-add an element), the tile's P @ V accumulated into the
    rescaled acc by the MMA."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = _mma_acc(p.to(v.dtype), v, acc * alpha[:, None], FP32)
    return m_new, l_i, acc


@triton.jit
def _rint_nonneg(a):
    """Round a >= 0 (< 2**31) to the nearest integer, ties to even, as torch.round does."""
    t = a.to(tl.int32)  # truncation == floor for a >= 0
    frac = a - t.to(tl.float32)  # exact
    up = (frac > 0.5) | ((frac == 0.5) & ((t & 1) == 1))
    return (t + up.to(tl.int32)).to(tl.float32)


@triton.jit
def _round_to_e4m3(y):
    """Round |y| <= 448 to the nearest float8 e4m3 value (ties to even), in fp32 arithmetic.

    The final cast to fp8 is then exact, so the result does not depend on the backend's conversion
    rounding (the interpreter truncates). Binade [2^e, 2^(e+1)) has step 2^(e-3); below 2^-6 the
    subnormals have the fixed step 2^-9.
    """
    bits = y.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    up = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2^(3 - e)
    down = ((124 + e) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3)
    r = _rint_nonneg(tl.abs(y) * up) * down
    # y's sign bit onto r (-0.0 stays -0.0, as in torch)
    return (r.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _quantize(x, scale_ptr, QUANT: tl.constexpr):
    """x (QUANT 1: fp8, 2: int8) in storage arithmetic, as runtime/executor.py ``_kv_codec``: fp8:
    clamp(x / s, +-448) rounded to e4m3; int8: round(clamp(x / s, +-127)). fp32 values on the storage
    grid; the division is IEEE (Triton's ``/`` is not correctly rounded on NVIDIA)."""
    y = tl.math.div_rn(x.to(tl.float32), tl.load(scale_ptr) + tl.zeros_like(x).to(tl.float32))
    if QUANT == 1:
        r = _round_to_e4m3(tl.minimum(tl.maximum(y, -448.0), 448.0))
    else:
        y = tl.minimum(tl.maximum(y, -127.0), 127.0)
        r = _rint_nonneg(tl.abs(y))
        r = tl.where(y < 0, -r, r)
    return r


# --- write_kv_cache ---------------------------------------------------------------------------------
@triton.jit
def _write_kv_kernel(
        k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr, num_kv_heads,
        stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ct, stride_ch,
        BLOCK_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr,
        PDL: tl.constexpr):
    # grid: (num_tokens,); one program writes all kv heads of one token
    wait_prior(PDL)  # before reading what the previous kernel wrote (kernels/pdl.py)
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_h < num_kv_heads)[:, None]
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct \
        + offs_h[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if QUANT != 0:
        k = _quantize(k, k_scale_ptr, QUANT)
        v = _quantize(v, v_scale_ptr, QUANT)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, *, k_scale: torch.Tensor | float | None = None,
                   v_scale: torch.Tensor | float | None = None) -> None:
    """Scatter ``k, v: [num_tokens, num_kv_heads, head_dim]`` into the caches' flat slots, in place.

    slot_mapping: [num_tokens] int32/int64, slot = block_id * block_size + offset; a negative slot is a
    padding token and is skipped. fp8/int8 caches are quantized with ``k_scale``/``v_scale`` exactly as
    ``runtime.executor._kv_codec`` does (``quantize_kv``).
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    _check_cache(k_cache, v_cache, num_kv_heads, head_dim)
    assert v.shape == k.shape, f"k {tuple(k.shape)} and v {tuple(v.shape)} differ"
    assert slot_mapping.shape == (num_tokens,), f"slot_mapping {tuple(slot_mapping.shape)} != ({num_tokens},)"
    if num_tokens == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    quant = _QUANT.get(k_cache.dtype, 0)
    k_scale_t, v_scale_t = _scales(k_cache, k_scale, v_scale, k.device)
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping.contiguous(), k_scale_t, v_scale_t, num_kv_heads,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *k_cache.stride()[:3],
        BLOCK_SIZE=k_cache.shape[1], HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
        QUANT=quant, num_warps=4, **pdl_args(k))


# --- RoPE and the KV write in one kernel -------------------------------------------------------------
@triton.jit
def _rope_write_kv_kernel(
        q_ptr, k_ptr, v_ptr, pos_ptr, inv_freq_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
        num_heads, num_kv_heads, q_blocks, scaling, long_from, stride_qt, stride_kt, stride_vt, stride_cb, stride_ct,
        stride_ch, qo_ptr, stride_qot, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, STEP: tl.constexpr,
        PAIR: tl.constexpr, ROT: tl.constexpr,
        TAIL_PAD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr, K_INPLACE: tl.constexpr = False,
        Q_COPY: tl.constexpr = False):
    # grid: (num_tokens, q_blocks + kv blocks). Programs below q_blocks rotate BLOCK_H query heads of their token
    # in place (Q_COPY: into qo_ptr's rows instead, the features past ROT copied as they are); the others rotate
    # BLOCK_H key heads and write them (and those heads' values) into the cache, and with K_INPLACE the rotated keys
    # (rounded to the activation dtype) back into k too, or over a quantized cache the codes into k and v.
    # HALF frequencies rotate pairs of features (STEP * i, STEP * i + PAIR) of the first ROT: (i, HALF + i) rotate-half,
    # (2i, 2i + 1) interleaved (kernels.rope); a key's features [ROT, HEAD_DIM) go to the cache as they are.
    wait_prior(PDL)  # before reading what the previous kernel wrote (kernels/pdl.py)
    t = tl.program_id(0)
    hb = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HALF
    dtype = q_ptr.dtype.element_ty
    cos, sin = cos_sin(tl.load(pos_ptr + t), inv_freq_ptr, offs_d, mask_d, scaling, long_from, HALF, dtype)
    if hb < q_blocks:
        offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = (offs_h < num_heads)[:, None] & mask_d[None, :]
        ptrs = q_ptr + t * stride_qt + offs_h[:, None] * HEAD_DIM + STEP * offs_d[None, :]
        y1, y2 = rotate(ptrs, mask, cos, sin, PAIR)
        o_ptrs = qo_ptr + t * stride_qot + offs_h[:, None] * HEAD_DIM + STEP * offs_d[None, :]
        tl.store(o_ptrs, y1.to(dtype), mask=mask)
        tl.store(o_ptrs + PAIR, y2.to(dtype), mask=mask)
        if Q_COPY and ROT < HEAD_DIM:  # partial rotary: the features the rotation leaves, into the copy too
            offs_r = ROT + tl.arange(0, TAIL_PAD)
            mask_r = (offs_h < num_heads)[:, None] & (offs_r < HEAD_DIM)[None, :]
            rest = tl.load(q_ptr + t * stride_qt + offs_h[:, None] * HEAD_DIM + offs_r[None, :], mask=mask_r)
            tl.store(qo_ptr + t * stride_qot + offs_h[:, None] * HEAD_DIM + offs_r[None, :], rest, mask=mask_r)
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        offs_h = (hb - q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_h = (offs_h < num_kv_heads)[:, None]
        mask = mask_h & mask_d[None, :]
        k_row = k_ptr + t * stride_kt + offs_h[:, None] * HEAD_DIM
        if K_INPLACE or slot >= 0:  # a negative slot is a padding token: nothing goes to the cache
            # the key rounded to the activation dtype first, as the separate RoPE kernel stores it
            # (names of this branch's own: a name both branches of `hb < q_blocks` assign must keep one type)
            r1, r2 = rotate(k_row + STEP * offs_d[None, :], mask, cos, sin, PAIR)
            k1 = r1.to(dtype)
            k2 = r2.to(dtype)
            offs_v = tl.arange(0, HEAD_DIM)
            v_row = v_ptr + t * stride_vt + offs_h[:, None] * HEAD_DIM + offs_v[None, :]
            v = tl.load(v_row, mask=mask_h)
            c1, c2, cv = k1, k2, v
            if QUANT != 0:
                c1 = _quantize(k1, k_scale_ptr, QUANT)
                c2 = _quantize(k2, k_scale_ptr, QUANT)
                cv = _quantize(v, v_scale_ptr, QUANT)
            if ROT < HEAD_DIM:  # partial rotary: the key's other features as they are
                offs_kr = ROT + tl.arange(0, TAIL_PAD)
                mask_kr = mask_h & (offs_kr < HEAD_DIM)[None, :]
                k_tail = tl.load(k_row + offs_kr[None, :], mask=mask_kr)
                if QUANT != 0:
                    k_tail = _quantize(k_tail, k_scale_ptr, QUANT)
            if slot >= 0:
                dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + offs_h[:, None] * stride_ch
                tl.store(k_cache_ptr + dst + STEP * offs_d[None, :], c1.to(k_cache_ptr.dtype.element_ty), mask=mask)
                tl.store(k_cache_ptr + dst + PAIR + STEP * offs_d[None, :], c2.to(k_cache_ptr.dtype.element_ty),
                         mask=mask)
                tl.store(v_cache_ptr + dst + offs_v[None, :], cv.to(v_cache_ptr.dtype.element_ty), mask=mask_h)
                if ROT < HEAD_DIM:
                    tl.store(k_cache_ptr + dst + offs_kr[None, :], k_tail.to(k_cache_ptr.dtype.element_ty),
                             mask=mask_kr)
            if K_INPLACE:  # every token's row, whatever its slot: the rotated key, or a quantized cache's codes
                # (exact in the activation dtype) of the key, its unrotated features and the value
                tl.store(k_row + STEP * offs_d[None, :], c1.to(dtype), mask=mask)
                tl.store(k_row + PAIR + STEP * offs_d[None, :], c2.to(dtype), mask=mask)
                if QUANT != 0:
                    tl.store(v_row, cv.to(dtype), mask=mask_h)
                    if ROT < HEAD_DIM:
                        tl.store(k_row + offs_kr[None, :], k_tail.to(dtype), mask=mask_kr)


def rope_write_kv_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                        inv_freq: torch.Tensor, attention_scaling: float, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                        k_scale: torch.Tensor | float | None = None,
                        v_scale: torch.Tensor | float | None = None, rotary_dim: int | None = None,
                        interleaved: bool = False, long_from: int | None = None,
                        k_in_place: bool = False, q_out: torch.Tensor | None = None) -> torch.Tensor:
    """``kernels.rope.apply_rope_`` on q and k, then :func:`write_kv_cache` of the rotated k and v, in one kernel
    (a decode step's three launches per layer in one). q is rotated in place and returned; k is not modified (its
    rotation goes to the cache only) unless ``k_in_place``: then k holds the rotated keys too, rounded to its dtype,
    or over a quantized cache k and v hold the codes the cache takes (exact in their dtype), for attention over the
    step's own keys (``paged_prefill_attention(contiguous_kv=)``). ``q_out`` (q's shape and
    dtype, heads contiguous): the rotated q goes there instead, and is returned; q is then left as it is.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim] (rows may be strided, e.g.
    views into a merged QKV projection); positions: [num_tokens] integer; inv_freq: [rotary_dim / 2] fp32 (or two
    tables with ``long_from``); ``rotary_dim`` (default head_dim), ``interleaved`` and ``long_from`` as
    ``apply_rope_``'s (partial rotary, GPT-J pairs, LongRoPE).
    Same numerics as the three kernels (the rotated key is rounded to q's dtype before the cache's quantization).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    _check_cache(k_cache, v_cache, num_kv_heads, head_dim)
    if k.shape != v.shape or k.shape[0] != num_tokens or k.shape[2] != head_dim or head_dim % 2:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} are not [num_tokens, heads, "
                         "head_dim] with one even head_dim and the same kv heads")
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise ValueError(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    rot = _rotary_dim(rotary_dim, head_dim)
    if tuple(positions.shape) != (num_tokens,) or tuple(slot_mapping.shape) != (num_tokens,):
        raise ValueError(f"positions {tuple(positions.shape)} / slot_mapping {tuple(slot_mapping.shape)} do not match "
                         f"{num_tokens} tokens")
    table, long_from = rope_table(inv_freq, long_from, rot)
    if q_out is not None and (q_out.shape != q.shape or q_out.dtype != q.dtype or q_out.device != q.device):
        raise ValueError(f"q_out {tuple(q_out.shape)} ({q_out.dtype}) is not q's {tuple(q.shape)} ({q.dtype})")
    out = q if q_out is None else q_out
    for name, t in (("q", q), ("k", k), ("v", v), ("q_out", out)):
        if t.stride(2) != 1 or t.stride(1) != head_dim:
            raise ValueError(f"{name} must have contiguous heads (strides (*, {head_dim}, 1)), got {t.stride()}")
    if num_tokens == 0:
        return out
    half = rot // 2
    block_d = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(max(num_heads, num_kv_heads)), max(512 // block_d, 1))
    q_blocks = triton.cdiv(num_heads, block_h)
    k_scale_t, v_scale_t = _scales(k_cache, k_scale, v_scale, q.device)
    _rope_write_kv_kernel[(num_tokens, q_blocks + triton.cdiv(num_kv_heads, block_h))](
        q, k, v, positions, table, k_cache, v_cache, slot_mapping.contiguous(), k_scale_t, v_scale_t,
        num_heads, num_kv_heads, q_blocks, float(attention_scaling), long_from, q.stride(0), k.stride(0), v.stride(0),
        *k_cache.stride()[:3], out, out.stride(0), HEAD_DIM=head_dim, HALF=half, STEP=2 if interleaved else 1,
        PAIR=1 if interleaved else half, ROT=rot, TAIL_PAD=triton.next_power_of_2(max(head_dim - rot, 1)),
        BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_SIZE=k_cache.shape[1], QUANT=_QUANT.get(k_cache.dtype, 0),
        K_INPLACE=k_in_place, Q_COPY=q_out is not None, num_warps=4, **pdl_args(q))
    return out


def _rotary_dim(rotary_dim: int | None, head_dim: int) -> int:
    """The rotated features of each head: head_dim, or an even number below it (partial rotary)."""
    rot = head_dim if rotary_dim is None else rotary_dim
    if rot % 2 or not 0 < rot <= head_dim:
        raise ValueError(f"rotary_dim {rotary_dim} is not an even number of features in (0, head_dim {head_dim}]")
    return rot


# --- decode -----------------------------------------------------------------------------------------
# Step-varying integers (sequence counts, splits, the block-table width) are not specialized: Triton would
# compile a new variant whenever one became 1 or a multiple of 16, mid-serving (seconds per compile).
@triton.jit
def _e4m3_to(x, dtype: tl.constexpr, PTX: tl.constexpr):
    """fp8 e4m3 values as ``dtype``. PTX (fp16): two per conversion instruction, in x's own layout: an opaque
    step, which the compiler leaves where it stands; a plain conversion it moves past the value tile's change to
    the matmul's operand layout, which then reads the tile from shared memory a byte at a time."""
    if PTX:
        y = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi;\n mov.b32 {lo, hi}, $2;\n cvt.rn.f16x2.e4m3x2 $0, lo;\n"
            " cvt.rn.f16x2.e4m3x2 $1, hi; }", "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)
    else:
        y = x.to(dtype)
    return y


@triton.jit
def _s8_to(x, dtype: tl.constexpr, PTX: tl.constexpr):
    """int8 values as ``dtype``. PTX (fp16): four values per five instructions, in x's own layout: each byte's sign
    bit flipped (x + 128 as an unsigned byte), two bytes set under 0x64 as the low bytes of two fp16 halves (prmt:
    1024 + x + 128, exact), then 1152 taken off both halves at once (exact: x). A plain conversion is one I2F per
    value at a fraction of the FMA rate, and it may be moved past the tile's layout change (see _e4m3_to)."""
    if PTX:
        y = tl.inline_asm_elementwise(
            "{ .reg .b32 u, lo, hi, c, m;\n xor.b32 u, $2, 0x80808080;\n mov.b32 c, 0x64646464;\n"
            " prmt.b32 lo, u, c, 0x4140;\n prmt.b32 hi, u, c, 0x4342;\n mov.b32 m, 0x64806480;\n"
            " sub.f16x2 $0, lo, m;\n sub.f16x2 $1, hi, m; }", "=r,=r,r", [x], dtype=tl.float16, is_pure=True,
            pack=4)
    else:
        y = x.to(dtype)
    return y


@triton.jit
def _kv_operand(x, dtype: tl.constexpr, QUANT: tl.constexpr, F16: tl.constexpr):
    """A loaded key or value tile as the matmul's operand dtype: INT8 codes on fp16 operands by _s8_to's byte
    arithmetic (with _INT8_PTX), anything else by a plain conversion (FP8 keys: the compiler's two-at-a-time cvt)."""
    if QUANT == 2 and F16 and _INT8_PTX:
        y = _s8_to(x, dtype, True)
    else:
        y = x.to(dtype)
    return y


@triton.jit
def _tile_blocks(table, tile, pos, valid, any_valid, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The cache blocks of key tile ``tile`` (keys ``pos``): [BLOCK_N] ids, one per key, or where a block holds
    whole tiles (BLOCK_SIZE a multiple of BLOCK_N) the tile's one id, a scalar; 0 where nothing is to be read."""
    if BLOCK_SIZE % BLOCK_N == 0:
        block = tl.load(table + (tile * BLOCK_N) // BLOCK_SIZE, mask=any_valid, other=0).to(tl.int64)
    else:
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return block


@triton.jit
def _tile_rows(block, tile, pos, kv_head, stride_cb, stride_ct, stride_ch, BLOCK_SIZE: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Offsets of key tile ``tile``'s rows for its keys ([HEAD_DIM, BLOCK_N], as k_offs adds them) and values
    ([BLOCK_N, HEAD_DIM]): per key from its block id, or (one block per tile) the tile's base alone, to which the
    loop-invariant k_offs / v_offs add each key's row."""
    if BLOCK_SIZE % BLOCK_N == 0:
        base = block * stride_cb + ((tile * BLOCK_N) % BLOCK_SIZE) * stride_ct + kv_head * stride_ch
        k_rows = base
        v_rows = base
    else:
        row = block * stride_cb + (pos % BLOCK_SIZE) * stride_ct + kv_head * stride_ch
        k_rows = row[None, :]
        v_rows = row[:, None]
    return k_rows, v_rows


@triton.jit
def _decode_key_tile(q, k_cache_ptr, k_rows, k_offs, v_cache_ptr, v_rows, v_offs, valid, qk_scale, softcap, m_i, l_i,
                     acc, QUANT: tl.constexpr, F16: tl.constexpr, FP32: tl.constexpr, SOFTCAP: tl.constexpr):
    """Fold one key tile of a decode query's rows q into the running (max, sum, acc): keys [HEAD_DIM, BLOCK_N] at
    k_cache_ptr + k_rows + k_offs and values [BLOCK_N, HEAD_DIM] at v_cache_ptr + v_rows + v_offs (_tile_rows), the
    keys ``valid`` [BLOCK_N] visible. The keys' masked lanes are left unloaded (garbage), masked out of s; the
    values' are zero-filled by their load (16-bit and FP8 caches: no select; FP8 converted two at a time, _e4m3_to,
    INT8 on fp16 operands four at a time, _s8_to), or zeroed after it (INT8 otherwise: the compiler's conversion)."""
    k = tl.load(k_cache_ptr + k_rows + k_offs, mask=valid[None, :])  # [HEAD_DIM, BLOCK_N]
    s = _mma(q, _kv_operand(k, q.dtype, QUANT, F16), FP32) * qk_scale
    if SOFTCAP:
        s = _softcap(s, softcap)
    s = tl.where(valid[None, :], s, float("-inf"))
    if QUANT == 1 and (F16 or FP32):
        v = _e4m3_to(tl.load(v_cache_ptr + v_rows + v_offs, mask=valid[:, None], other=0.0), q.dtype, F16)
    elif QUANT == 0:
        v = tl.load(v_cache_ptr + v_rows + v_offs, mask=valid[:, None], other=0.0).to(q.dtype)
    elif F16 and _INT8_PTX:  # zero-filled by the load (a zero code converts to 0.0), four at a time
        v = _s8_to(tl.load(v_cache_ptr + v_rows + v_offs, mask=valid[:, None], other=0), q.dtype, True)
    else:
        v = tl.load(v_cache_ptr + v_rows + v_offs, mask=valid[:, None])  # [BLOCK_N, HEAD_DIM]
        v = tl.where(valid[:, None], v.to(q.dtype), 0.0)
    return _online_softmax_step(s, v, m_i, l_i, acc, FP32)


@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _paged_decode_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, k_scale_ptr, v_scale_ptr,
        out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, sinks_ptr, counter_ptr,
        kn_ptr, vn_ptr, slot_ptr, pos_ptr, inv_freq_ptr, rope_scaling, long_from,
        qk_scale, window, num_splits, softcap,
        stride_qs, stride_qh, stride_os, stride_oh, stride_cb, stride_ct, stride_ch, stride_bt,
        stride_kns, stride_knh, stride_vns, stride_vnh,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr, QUANT: tl.constexpr, FP32: tl.constexpr, F16: tl.constexpr, SPLIT: tl.constexpr,
        MIN_TILES: tl.constexpr, SPLITS_PAD: tl.constexpr, MERGE_UNROLL: tl.constexpr, EARLY: tl.constexpr,
        SOFTCAP: tl.constexpr, SINKS: tl.constexpr, HEADS_FIRST: tl.constexpr, WRITE: tl.constexpr,
        ROPE: tl.constexpr, ROT: tl.constexpr, INTERLEAVED: tl.constexpr, PDL: tl.constexpr):
    # grid: (num_seqs, num_kv_heads, num_splits), or (num_kv_heads, num_seqs, num_splits) with HEADS_FIRST (a
    # sequence's kv heads run side by side, so that together they read whole cache rows). One program: the GROUP
    # query heads sharing one kv head (padded to GROUP_PAD rows for tl.dot), over split `split` of the sequence's
    # key tiles.
    # SPLIT: a sequence's tiles are shared by up to num_splits programs, as many as give each at least MIN_TILES
    # tiles (its own length, read on the device: a short sequence runs in one program, which writes the output);
    # the others exit. With several, each writes its partial (m, l, acc) and the last to finish, by a ticket on
    # counter_ptr[seq, kv_head] (zero before and after), merges them in split order and writes the output.
    # F16 (quantized caches): the matmuls take fp16 operands, into which fp8 e4m3 and int8 values convert exactly
    # (one conversion per two values; bf16 takes more), and q is clamped to fp16's range.
    # SOFTCAP: scores soft-capped (softcap: the cap in the log2 domain); SINKS: each head's sink logit (sinks_ptr)
    # joins the softmax denominator, after the last tile or in the merge.
    # WRITE: the step's own key and value (kn_ptr, vn_ptr: [num_seqs, num_kv_heads, HEAD_DIM]) are not in the cache
    # yet: the program whose tiles hold the sequence's last position writes them at slot_ptr[seq] (skipped for a
    # negative slot), as write_kv_cache would, and folds them in from registers after its key loop, which stops
    # before that position (no wait for the store: its tile loads go out with q's).
    # ROPE (with WRITE): q and the new key arrive unrotated; every program rotates its q rows, the writer the key,
    # with rope_write_kv_cache's numerics (the rotated key rounded to q's dtype before the cache's quantization):
    # the first ROT features of each head, rotate-half or (INTERLEAVED) in neighbouring pairs; the rest pass through.
    if HEADS_FIRST:
        kv_head = tl.program_id(0)
        seq = tl.program_id(1)
        num_kv_heads = tl.num_programs(0)
    else:
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        num_kv_heads = tl.num_programs(1)
    num_heads = num_kv_heads * GROUP
    split = tl.program_id(2)
    # the lengths and block tables are the step's inputs, written before its first kernel: read before the wait
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = tl.maximum(seq_len - window, 0)  # the query at seq_len - 1 sees keys [lo, seq_len)
    first_tile = lo // BLOCK_N
    num_tiles = tl.cdiv(seq_len, BLOCK_N) - first_tile
    used = 1
    if SPLIT:
        used = tl.minimum(tl.maximum(tl.cdiv(num_tiles, MIN_TILES), 1), num_splits)
    if split < used:
        # this split's key tiles: an equal share of the tiles overlapping [lo, seq_len)
        tiles_per_split = tl.cdiv(num_tiles, used)
        tile_lo = first_tile + split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, first_tile + num_tiles)

        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK_N)
        head = kv_head * GROUP + offs_g
        g_mask = offs_g < GROUP
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        ONE_BLOCK: tl.constexpr = BLOCK_SIZE % BLOCK_N == 0
        pos = tile_lo * BLOCK_N + offs_n
        valid = (pos >= lo) & (pos < tl.minimum(seq_len, tile_hi * BLOCK_N))  # none for an empty split
        # the first tile's blocks: one per key, or (ONE_BLOCK: the cache's blocks hold whole tiles) the tile's one
        block = _tile_blocks(table, tile_lo, pos, valid, tile_lo < tile_hi, BLOCK_SIZE, BLOCK_N)
        if ONE_BLOCK:  # a tile's keys and values from one base: 32-bit offsets, the same for every tile
            k_offs = offs_n[None, :] * stride_ct + offs_d[:, None]
            v_offs = offs_n[:, None] * stride_ct + offs_d[None, :]
        else:
            k_offs = offs_d[:, None]
            v_offs = offs_d[None, :]
        if ROPE:  # positions are a step input too, and inv_freq a constant: the angles before the wait
            dtype = q_ptr.dtype.element_ty
            if INTERLEAVED or ROT < HEAD_DIM:
                # partial or interleaved rotary: d < ROT pairs with its partner, the others with themselves at angle
                # 0 (cos 1, sin 0: x * 1 -+ x * 0, the value itself)
                rotates = offs_d < ROT
                if INTERLEAVED:
                    offs_pair = tl.where(rotates, offs_d ^ 1, offs_d)
                    first = ((offs_d % 2) == 0)[None, :]
                    freq = offs_d // 2
                else:
                    offs_pair = tl.where(rotates, (offs_d + ROT // 2) % ROT, offs_d)
                    first = (offs_d < ROT // 2)[None, :]
                    freq = offs_d % (ROT // 2)
                cos, sin = cos_sin(tl.load(pos_ptr + seq), inv_freq_ptr, freq, rotates, rope_scaling, long_from,
                                   ROT // 2, dtype)
                cos = tl.where(rotates[None, :], cos, 1.0)
                sin = tl.where(rotates[None, :], sin, 0.0)
            else:
                offs_pair = (offs_d + HEAD_DIM // 2) % HEAD_DIM  # rotate-half on whole rows: d pairs with d +- HALF
                first = (offs_d < HEAD_DIM // 2)[None, :]
                cos, sin = cos_sin(tl.load(pos_ptr + seq), inv_freq_ptr, offs_d % (HEAD_DIM // 2), offs_d < HEAD_DIM,
                                   rope_scaling, long_from, HEAD_DIM // 2, dtype)
        if WRITE:
            # the program whose tiles hold the new position takes the new key and value
            last = seq_len - 1
            writer = (seq_len > 0) & (split == (last // BLOCK_N - first_tile) // tl.maximum(tiles_per_split, 1))
            w_mask = offs_d < tl.where(writer, HEAD_DIM, 0)  # [HEAD_DIM]: all lanes in the writer, none elsewhere
            slot = tl.load(slot_ptr + seq).to(tl.int64)
            # the loop below reads the keys before it; the new one joins from registers after it
            seq_len = last
        if EARLY:
            # the first tile's keys and values: earlier steps wrote them (the kernels before this one's predecessor
            # have completed), so their loads go out before the wait, under the preceding kernel's tail; a program
            # of one tile (batch 1: 64-key splits) then waits for nothing but q. Masked lanes are left unloaded
            # (garbage): masked out of s and zeroed in v below.
            valid = (pos >= lo) & (pos < tl.minimum(seq_len, tile_hi * BLOCK_N))
            k_rows, v_rows = _tile_rows(block, tile_lo, pos, kv_head, stride_cb, stride_ct, stride_ch, BLOCK_SIZE,
                                        BLOCK_N)
            k0 = tl.load(k_cache_ptr + k_rows + k_offs, mask=valid[None, :])  # [HEAD_DIM, BLOCK_N]
            v0 = tl.load(v_cache_ptr + v_rows + v_offs, mask=valid[:, None])  # [BLOCK_N, HEAD_DIM]
            nxt = pos + BLOCK_N
            block = _tile_blocks(table, tile_lo + 1, nxt, nxt < seq_len, (tile_lo + 1) * BLOCK_N < seq_len,
                                 BLOCK_SIZE, BLOCK_N)  # the next tile's

        wait_prior(PDL)  # q and the new key / value are the preceding kernel's (kernels/pdl.py)
        # q: [GROUP_PAD, HEAD_DIM]; padding rows are zero and never stored
        q_rows = q_ptr + seq * stride_qs + head[:, None] * stride_qh
        q = tl.load(q_rows + offs_d[None, :], mask=g_mask[:, None], other=0.0)
        if ROPE:
            q = _rotate_rows(q, tl.load(q_rows + offs_pair[None, :], mask=g_mask[:, None], other=0.0), first, cos,
                             sin).to(dtype)
        if WRITE:
            # the new key (rotated, rounded to q's dtype) and value as the cache stores them (fp32 values); zeros
            # in the other programs
            kn_row = kn_ptr + seq * stride_kns + kv_head * stride_knh
            kn = tl.load(kn_row + offs_d, mask=w_mask, other=0.0)
            if ROPE:
                pair = tl.load(kn_row + offs_pair, mask=w_mask, other=0.0)
                kn = tl.reshape(_rotate_rows(kn[None, :], pair[None, :], first, cos, sin).to(dtype), [HEAD_DIM])
            vn = tl.load(vn_ptr + seq * stride_vns + kv_head * stride_vnh + offs_d, mask=w_mask, other=0.0)
            if QUANT != 0:
                kn = _quantize(kn, k_scale_ptr, QUANT)
                vn = _quantize(vn, v_scale_ptr, QUANT)
            else:
                kn = kn.to(tl.float32)
                vn = vn.to(tl.float32)
            dst = (tl.maximum(slot, 0) // BLOCK_SIZE) * stride_cb + (tl.maximum(slot, 0) % BLOCK_SIZE) * stride_ct \
                + kv_head * stride_ch + offs_d
            stored = offs_d < tl.where(writer & (slot >= 0), HEAD_DIM, 0)  # a negative slot (padding): nothing written
            tl.store(k_cache_ptr + dst, kn.to(k_cache_ptr.dtype.element_ty), mask=stored)
            tl.store(v_cache_ptr + dst, vn.to(v_cache_ptr.dtype.element_ty), mask=stored)
        q = _query_operand(q, FP32, F16)
        if QUANT != 0:
            qk_scale = qk_scale * tl.load(k_scale_ptr)

        m_i = tl.full([GROUP_PAD], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
        start = tile_lo
        if EARLY:  # the first tile, loaded before the wait
            s = _mma(q, k0.to(q.dtype), FP32) * qk_scale
            if SOFTCAP:
                s = _softcap(s, softcap)
            s = tl.where(valid[None, :], s, float("-inf"))
            v0 = tl.where(valid[:, None], v0.to(q.dtype), 0.0)
            m_i, l_i, acc = _online_softmax_step(s, v0, m_i, l_i, acc, FP32)
            start = tile_lo + 1
        for tile in range(start, tile_hi):
            pos = tile * BLOCK_N + offs_n
            valid = (pos >= lo) & (pos < seq_len)
            k_rows, v_rows = _tile_rows(block, tile, pos, kv_head, stride_cb, stride_ct, stride_ch, BLOCK_SIZE,
                                        BLOCK_N)
            # the next tile's blocks, loaded ahead (past the last tile: masked off)
            nxt = pos + BLOCK_N
            block = _tile_blocks(table, tile + 1, nxt, nxt < seq_len, (tile + 1) * BLOCK_N < seq_len, BLOCK_SIZE,
                                 BLOCK_N)
            m_i, l_i, acc = _decode_key_tile(q, k_cache_ptr, k_rows, k_offs, v_cache_ptr, v_rows, v_offs, valid,
                                             qk_scale, softcap, m_i, l_i, acc, QUANT, F16, FP32, SOFTCAP)
        if WRITE:
            m_w, l_w, acc_w = _new_key_step(q, kn, vn, qk_scale, softcap, m_i, l_i, acc, SOFTCAP)
            m_i = tl.where(writer, m_w, m_i)
            l_i = tl.where(writer, l_w, l_i)
            acc = tl.where(writer, acc_w, acc)

        if QUANT != 0:
            acc = acc * tl.load(v_scale_ptr)
        out_ptrs = out_ptr + seq * stride_os + head[:, None] * stride_oh + offs_d[None, :]
        if used == 1:
            if SINKS:
                l_i = l_i + _sink_share(tl.load(sinks_ptr + head, mask=g_mask, other=0.0), m_i)
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty sequence gets zeros
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
        else:
            part = (seq * num_heads + head) * num_splits  # [GROUP_PAD]: each head's first split
            tl.store(part_m_ptr + part + split, m_i, mask=g_mask)
            tl.store(part_l_ptr + part + split, l_i, mask=g_mask)
            tl.store(part_acc_ptr + (part + split)[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_mask[:, None])
            tl.debug_barrier()  # every thread's partials stored before the ticket
            ticket = counter_ptr + seq * num_kv_heads + kv_head
            if tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == used - 1:
                tl.store(ticket, 0)  # zero again for the next launch
                # log-sum-exp merge: out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, splits in order
                offs_s = tl.arange(0, SPLITS_PAD)
                s_mask = g_mask[:, None] & (offs_s[None, :] < used)
                m_s = tl.load(part_m_ptr + part[:, None] + offs_s[None, :], mask=s_mask, other=-1.0e30,
                              cache_modifier=".cg")
                l_s = tl.load(part_l_ptr + part[:, None] + offs_s[None, :], mask=s_mask, other=0.0,
                              cache_modifier=".cg")
                m_max = tl.max(m_s, 1)
                denom = tl.sum(l_s * tl.exp2(m_s - m_max[:, None]), 1)
                if SINKS:
                    denom = denom + _sink_share(tl.load(sinks_ptr + head, mask=g_mask, other=0.0), m_max)
                out = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
                # MERGE_UNROLL splits' partials per iteration, their loads in flight together (one L2 round trip
                # per split in turn was most of a short merge), added in split order
                for j0 in range(0, used, MERGE_UNROLL):
                    for jj in tl.static_range(MERGE_UNROLL):
                        j = j0 + jj
                        j_mask = g_mask & (offs_g * 0 + j < used)  # [GROUP_PAD]
                        w = tl.exp2(tl.load(part_m_ptr + part + j, mask=j_mask, other=-1.0e30, cache_modifier=".cg")
                                    - m_max)
                        a = tl.load(part_acc_ptr + (part + j)[:, None] * HEAD_DIM + offs_d[None, :],
                                    mask=j_mask[:, None], other=0.0, cache_modifier=".cg")
                        out += a * w[:, None]
                out = out / tl.where(denom > 0, denom, 1.0)[:, None]
                tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


@triton.jit(do_not_specialize=["stride_bt"])
def _paged_decode_heads_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, k_scale_ptr, v_scale_ptr, out_ptr, sinks_ptr,
        qk_scale, window, softcap, stride_qs, stride_qh, stride_os, stride_oh, stride_cb, stride_ct, stride_ch,
        stride_bt, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr, QUANT: tl.constexpr, FP32: tl.constexpr, F16: tl.constexpr, HEADS: tl.constexpr,
        SOFTCAP: tl.constexpr, SINKS: tl.constexpr, PDL: tl.constexpr):
    # _paged_decode_kernel's attention (its numerics; no splits, no new K/V: those are written first) for many short
    # sequences. grid (num_seqs, num_kv_heads // HEADS): a program takes HEADS kv heads of one sequence, one after the
    # other, in ONE loop over (kv head, key tile) pairs. A program per (sequence, kv head) spends a fixed prologue
    # (the sequence's length and block table, the pipeline's first loads, q) on the few tiles of a short sequence;
    # here the software pipeline runs on from one head's last tile into the next head's first, and the length and
    # table are read once for HEADS heads. At a head's first tile its query rows are loaded; at its last its output
    # is stored and the running softmax starts over.
    seq = tl.program_id(0)
    kv0 = tl.program_id(1) * HEADS
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = tl.maximum(seq_len - window, 0)  # the query at seq_len - 1 sees keys [lo, seq_len)
    first_tile = lo // BLOCK_N
    num_tiles = tl.maximum(tl.cdiv(seq_len, BLOCK_N) - first_tile, 1)  # an empty sequence: one empty tile (zeros)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if BLOCK_SIZE % BLOCK_N == 0:  # a tile's keys and values from one base (see _paged_decode_kernel)
        k_offs = offs_n[None, :] * stride_ct + offs_d[:, None]
        v_offs = offs_n[:, None] * stride_ct + offs_d[None, :]
    else:
        k_offs = offs_d[:, None]
        v_offs = offs_d[None, :]
    pos = first_tile * BLOCK_N + offs_n
    block = _tile_blocks(table, first_tile, pos, (pos >= lo) & (pos < seq_len), first_tile * BLOCK_N < seq_len,
                         BLOCK_SIZE, BLOCK_N)

    wait_prior(PDL)  # q is the preceding kernel's (kernels/pdl.py)
    if QUANT != 0:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    q = _query_operand(tl.zeros([GROUP_PAD, HEAD_DIM], dtype=q_ptr.dtype.element_ty), FP32, F16)  # set per head
    m_i = tl.full([GROUP_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    h = kv0 * 0  # the iteration's kv head (from kv0) and tile (from first_tile), counted: no division per tile
    j = kv0 * 0
    for it in range(0, HEADS * num_tiles):
        kv_head = kv0 + h
        head = kv_head * GROUP + offs_g
        tile = first_tile + j
        if j == 0:  # a head's first tile: its query rows (padding rows zero, never stored)
            q = _query_operand(tl.load(q_ptr + seq * stride_qs + head[:, None] * stride_qh + offs_d[None, :],
                                       mask=g_mask[:, None], other=0.0), FP32, F16)
        pos = tile * BLOCK_N + offs_n
        valid = (pos >= lo) & (pos < seq_len)
        k_rows, v_rows = _tile_rows(block, tile, pos, kv_head, stride_cb, stride_ct, stride_ch, BLOCK_SIZE, BLOCK_N)
        # the next iteration's blocks, loaded ahead: the next tile's, or the first tile's again for the next head
        nxt_tile = tl.where(j + 1 == num_tiles, first_tile, tile + 1)
        nxt = nxt_tile * BLOCK_N + offs_n
        block = _tile_blocks(table, nxt_tile, nxt, (nxt >= lo) & (nxt < seq_len), nxt_tile * BLOCK_N < seq_len,
                             BLOCK_SIZE, BLOCK_N)
        m_i, l_i, acc = _decode_key_tile(q, k_cache_ptr, k_rows, k_offs, v_cache_ptr, v_rows, v_offs, valid,
                                         qk_scale, softcap, m_i, l_i, acc, QUANT, F16, FP32, SOFTCAP)
        if j == num_tiles - 1:  # the head's last tile: its output; the next head's softmax starts over
            if QUANT != 0:
                acc = acc * tl.load(v_scale_ptr)
            if SINKS:
                l_i = l_i + _sink_share(tl.load(sinks_ptr + head, mask=g_mask, other=0.0), m_i)
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty sequence gets zeros
            tl.store(out_ptr + seq * stride_os + head[:, None] * stride_oh + offs_d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
            m_i = tl.full([GROUP_PAD], -1.0e30, dtype=tl.float32)
            l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
            acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
        last = j + 1 == num_tiles
        h = tl.where(last, h + 1, h)
        j = tl.where(last, 0, j + 1)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                           k_scale: torch.Tensor | float | None = None,
                           v_scale: torch.Tensor | float | None = None,
                           sliding_window: int | None = None, num_splits: int | None = None,
                           softcap: float = 0.0, sinks: torch.Tensor | None = None,
                           config: DecodeConfig | None = None, new_kv: NewKV | None = None) -> torch.Tensor:
    """Attention of one new query per sequence over its paged cache; returns ``out`` like ``q``.

    q: [num_seqs, num_heads, head_dim], query i at position seq_lens[i] - 1 (its K/V already written);
    block_tables: [num_seqs, max_blocks] int32 (padded); seq_lens: [num_seqs] int32 (0: output zeros).
    num_splits: at most this many programs share a sequence's keys (flash-decoding): ceil(its key tiles / (the
    config's ``min_keys``, else ``_MIN_KEYS_PER_SPLIT``, keys' worth)) of them, from its own length (read on the
    device), the last to finish merging; None picks it from shapes alone (``_decode_num_splits``). Any value gives
    the same result up to fp32 rounding. ``seq_lens`` and ``block_tables`` are read before the kernel's PDL wait:
    they must not be written by the kernel launched just before this one (the runtime's are step inputs, copied
    before the step's first kernel).
    softcap > 0: scores become softcap * tanh(scores / softcap) (Gemma 2); sinks: [num_heads] fp32 sink logits,
    one per head, in each head's softmax denominator (gpt-oss). Either off compiles the kernel without its code.
    config: the kernel's tiling (``_decode_config`` picks one by cache dtype, head_dim and launch width; the
    benchmark sweeps it). A config of ``heads`` > 1 (dividing the kv heads) runs one program per sequence and that
    many of its kv heads, one after the other, without splits (num_splits is then not read); its ``new_kv`` is
    written (and q rotated, into a copy) by a kernel before it, two launches.
    new_kv: the step's key and value, not yet in the cache: the kernel writes them (``write_kv_cache``, or
    ``rope_write_kv_cache`` with its RoPE, q then arriving unrotated) and attends over them, one launch for two.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    _check_attention_args(q, k_cache, v_cache, block_tables, num_seqs, softcap, sinks)
    assert seq_lens.shape == (num_seqs,), f"seq_lens {tuple(seq_lens.shape)} != ({num_seqs},)"
    if new_kv is not None:
        new_kv.check(q, num_kv_heads)
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    block_size = k_cache.shape[1]
    cfg = config or _decode_config(k_cache.dtype, head_dim, num_seqs * num_kv_heads, num_kv_heads,
                                   _num_sms(q.device) if q.is_cuda else 0)
    min_keys = cfg.min_keys or _MIN_KEYS_PER_SPLIT
    if num_splits is None:
        num_splits = _decode_num_splits(num_seqs, num_kv_heads, block_tables.shape[1] * block_size, q.device,
                                        min_keys)
    assert num_splits >= 1, f"num_splits must be >= 1, got {num_splits}"
    q = _last_dim_contiguous(q)
    group = num_heads // num_kv_heads
    k_scale_t, v_scale_t = _scales(k_cache, k_scale, v_scale, q.device)
    if cfg.heads > 1 and num_kv_heads % cfg.heads == 0:
        return _decode_by_heads(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale_t, v_scale_t,
                                sliding_window, softcap, sinks, cfg, new_kv, out)
    split = num_splits > 1
    if split:  # fp32 partials: [num_seqs, num_heads, num_splits, (head_dim | -)], and a ticket per (seq, kv head)
        part_acc = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_m = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        counters = _tile_counters(q.device, num_seqs * num_kv_heads)
    else:
        part_acc = part_m = part_l = out  # unused
        counters = seq_lens
    sinks_t = q if sinks is None else sinks  # a placeholder, never read, without sinks
    rope = new_kv is not None and new_kv.positions is not None
    if new_kv is None:  # placeholders, never read
        kn = vn = q
        slots = pos = inv_freq = seq_lens
        long_from = NO_LONG_TABLE
    else:
        kn, vn, slots = new_kv.k, new_kv.v, new_kv.slot_mapping
        pos = new_kv.positions if rope else seq_lens
        inv_freq, long_from = rope_table(new_kv.inv_freq, new_kv.long_from, new_kv.rotary_dim or head_dim) if rope \
            else (q, NO_LONG_TABLE)
    grid = (num_kv_heads, num_seqs, num_splits) if cfg.heads_first else (num_seqs, num_kv_heads, num_splits)
    _paged_decode_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, k_scale_t, v_scale_t, out, part_acc, part_m, part_l, sinks_t,
        counters, kn, vn, slots, pos, inv_freq, float(new_kv.scaling) if rope else 1.0, long_from,
        scale * _LOG2E, sliding_window or _NO_WINDOW, num_splits, softcap * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_cache.stride()[:3], block_tables.stride(0),
        kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=cfg.block_n, QUANT=_QUANT.get(k_cache.dtype, 0),
        FP32=_fp32_dot(q.dtype), F16=cfg.f16 and k_cache.dtype in _QUANT and not _fp32_dot(q.dtype), SPLIT=split,
        MIN_TILES=max(1, min_keys // cfg.block_n), SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
        MERGE_UNROLL=_MERGE_UNROLL, EARLY=cfg.early,
        SOFTCAP=softcap > 0, SINKS=sinks is not None, HEADS_FIRST=cfg.heads_first, WRITE=new_kv is not None,
        ROPE=rope, ROT=(new_kv.rotary_dim or head_dim) if rope else head_dim,
        INTERLEAVED=bool(rope and new_kv.interleaved), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_args(q))
    return out


def _decode_by_heads(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale_t, v_scale_t, sliding_window,
                     softcap, sinks, cfg: DecodeConfig, new_kv: NewKV | None, out: torch.Tensor) -> torch.Tensor:
    """paged_decode_attention through _paged_decode_heads_kernel: the step's new K/V written first (with q rotated
    into a copy of its own under RoPE: the caller's q is left as it is), by the kernels the prefill path runs."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if new_kv is not None and new_kv.positions is not None:
        # (rope_write_kv_cache reads heads at a stride of head_dim, which NewKV does not ask of k and v)
        k, v = (t if t.stride(1) == head_dim else t.contiguous() for t in (new_kv.k, new_kv.v))
        q_rot = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        q = rope_write_kv_cache(q if q.stride(1) == head_dim else q.contiguous(), k, v, new_kv.positions,
                                new_kv.inv_freq, new_kv.scaling, k_cache, v_cache, new_kv.slot_mapping,
                                k_scale=k_scale_t, v_scale=v_scale_t, rotary_dim=new_kv.rotary_dim,
                                interleaved=new_kv.interleaved, long_from=new_kv.long_from, q_out=q_rot)
    elif new_kv is not None:
        write_kv_cache(new_kv.k, new_kv.v, k_cache, v_cache, new_kv.slot_mapping, k_scale=k_scale_t,
                       v_scale=v_scale_t)
    group = num_heads // num_kv_heads
    _paged_decode_heads_kernel[(num_seqs, num_kv_heads // cfg.heads)](
        q, k_cache, v_cache, block_tables, seq_lens, k_scale_t, v_scale_t, out, q if sinks is None else sinks,
        scale * _LOG2E, sliding_window or _NO_WINDOW, softcap * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_cache.stride()[:3], block_tables.stride(0),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_N=cfg.block_n, QUANT=_QUANT.get(k_cache.dtype, 0),
        FP32=_fp32_dot(q.dtype), F16=cfg.f16 and k_cache.dtype in _QUANT and not _fp32_dot(q.dtype), HEADS=cfg.heads,
        SOFTCAP=softcap > 0, SINKS=sinks is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_args(q))
    return out


@dataclass(frozen=True)
class NewKV:
    """A decode step's own keys and values for :func:`paged_decode_attention` to write into the cache itself.

    k, v: [num_seqs, num_kv_heads, head_dim] in q's dtype (rows may be strided, heads contiguous: views into a merged
    QKV projection); slot_mapping: [num_seqs], each sequence's new slot (negative: write nothing, a padding row).
    positions, inv_freq, scaling, rotary_dim, interleaved, long_from: RoPE of q and k first, as ``rope_write_kv_cache``
    (rotate-half on whole heads by default); positions None: q and k are already rotated (or the model has no RoPE).
    """

    k: torch.Tensor
    v: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor | None = None
    inv_freq: torch.Tensor | None = None
    scaling: float = 1.0
    rotary_dim: int | None = None  # the rotated features of each head (None: all)
    interleaved: bool = False  # GPT-J pairs (2i, 2i + 1) instead of the halves
    long_from: int | None = None  # LongRoPE: inv_freq holds two tables, the second from this position on

    def check(self, q: torch.Tensor, num_kv_heads: int) -> None:
        num_seqs, _, head_dim = q.shape
        expected = (num_seqs, num_kv_heads, head_dim)
        if tuple(self.k.shape) != expected or tuple(self.v.shape) != expected:
            raise ValueError(f"new_kv: k {tuple(self.k.shape)} and v {tuple(self.v.shape)} must be {expected} "
                             "(one new key and value per sequence)")
        if self.k.dtype != q.dtype or self.v.dtype != q.dtype:
            raise ValueError(f"new_kv: k and v must be in q's dtype {q.dtype}, got {self.k.dtype} / {self.v.dtype}")
        for name, t in (("k", self.k), ("v", self.v)):
            if t.stride(2) != 1:
                raise ValueError(f"new_kv: {name}'s head_dim must be contiguous, got strides {t.stride()}")
        if tuple(self.slot_mapping.shape) != (num_seqs,):
            raise ValueError(f"new_kv: slot_mapping {tuple(self.slot_mapping.shape)} != ({num_seqs},)")
        if self.positions is not None:
            rot = _rotary_dim(self.rotary_dim, head_dim)
            if tuple(self.positions.shape) != (num_seqs,) or self.inv_freq is None:
                raise ValueError(f"new_kv: positions {tuple(self.positions.shape)} / inv_freq "
                                 f"{None if self.inv_freq is None else tuple(self.inv_freq.shape)} do not match "
                                 f"{num_seqs} sequences and rotary_dim {rot}")
            rope_table(self.inv_freq, self.long_from, rot)  # raises for a table of another shape


@dataclass(frozen=True)
class DecodeConfig:
    """The decode kernel's tiling: keys per iteration (several cache blocks), warps, pipeline stages, for
    quantized caches whether the matmuls run on fp16 operands (else the query's dtype), and the programs' order."""

    block_n: int
    num_warps: int
    num_stages: int
    f16: bool = False
    heads_first: bool = False  # programs ordered kv head fastest: a sequence's heads side by side
    min_keys: int = 0  # keys a split takes at least (a multiple of block_n); 0: _MIN_KEYS_PER_SPLIT
    early: bool = False  # the first tile's keys and values loaded before the PDL wait (registers: small tiles only)
    # kv heads per program: > 1 (dividing the model's kv heads) runs _paged_decode_heads_kernel, one program per
    # sequence and that many of its kv heads in one loop, no splits (many short sequences); 1: a program per
    # (sequence, kv head) and its splits
    heads: int = 1


# Up to this many (sequence, kv head) pairs a 16-bit cache's decode takes 64-key tiles and splits of 64 keys: at
# batch 1 (8 pairs) each program's fixed instruction stream (the first tiles' addresses, RoPE, the new K/V) is what
# the launch waits on, and smaller tiles over more programs shorten it. H200, bf16 batch-1 decode, same artifact and
# call (docs/BENCHMARKS.md, session 30): 239.6 tok/s against 236.0 / 236.1 with 128-key tiles and 256-key splits.
_SMALL_DECODE_PAIRS = 16
# There, each program's first tile is loaded before its PDL wait (DecodeConfig.early); KERNELS_DECODE_EARLY=0 loads it
# after, as wider launches do (A/B runs)
_EARLY_TILE = os.environ.get("KERNELS_DECODE_EARLY", "1") != "0"


# Quantized caches past _SMALL_DECODE_PAIRS pairs: as many kv heads per program (DecodeConfig.heads, 8 / 4 / 2,
# dividing the model's) as still leave at least this many programs per SM (the by-heads kernel); fewer: a program per
# pair and its splits. H200, FP8 cache, 64-token blocks, 64:4:3 (docs/BENCHMARKS.md, session 41): by heads, 5-8%
# faster than a program per pair at 512 x 150-1,152 with 4 heads (7-11% with 8) and 3-8% at 256 x 250-2,048 with
# 2 or 4; slower with 1 program per SM (256 x 2,048 at 8 heads: 383 against 318 us) and at 64 x 2,048 (splits win).
# 4 rather than 2 programs per SM: end to end, 128/128 at 512 sequences gave 24,952 tok/s at 4 heads (1,024
# programs) and 24,722 at 8 in one run each, a difference within the spread of two runs of one setting (~3%).
_HEADS_MIN_PROGRAMS_PER_SM = 4
# Programs of 2 warps (_TWO_WARP_DECODE_PAIRS): 3 per SM. In session 47's second sweep (FP8) that picks the best heads,
# or heads within 0.6% of it, at all five shapes (128 x 1,024: 2 heads, 80.7 us against 83.5 for a program per pair);
# in the first, 8 heads at 512 x 1,152 and 512 x 2,048 were 1.1% and 0.1% behind that sweep's best (4 heads)
_HEADS_MIN_PROGRAMS_PER_SM_2_WARPS = 3


# FP8 caches from this many (sequence, kv head) pairs: programs of 2 warps. In two H200 sweeps (docs/BENCHMARKS.md,
# session 47; FP8, 64-token blocks) 64:2:3 was the best tiling at every shape, 512 to 4,096 pairs: 2.2-4.9% under
# 64:4:3 at 512 x 300 / 1,152 / 2,048 and 256 x 2,048 (48 tilings), 8.5% at 128 x 1,024 and 11.8% at 64 x 2,048 with a
# program per pair (64 tilings: 32- and 64-key tiles, 3 and 4 stages, 2 and 4 warps). Narrower launches, not swept,
# and INT8 caches, whose conversion is another instruction stream, not measured with 2 warps, keep 4
_TWO_WARP_DECODE_PAIRS = 512


def _decode_heads(pairs: int, num_kv_heads: int, sms: int, warps: int = 4) -> int:
    """kv heads per program for a wide decode over a quantized cache, programs of ``warps`` warps (see
    _HEADS_MIN_PROGRAMS_PER_SM)."""
    least = _HEADS_MIN_PROGRAMS_PER_SM_2_WARPS if warps == 2 else _HEADS_MIN_PROGRAMS_PER_SM
    for heads in (8, 4, 2):
        if num_kv_heads % heads == 0 and pairs // heads >= least * sms:
            return heads
    return 1


def _decode_config(cache_dtype: torch.dtype, head_dim: int = 128, pairs: int = 0, num_kv_heads: int = 0,
                   sms: int = 0) -> DecodeConfig:
    """The decode tiling for a launch over ``pairs`` (sequence, kv head) pairs of ``num_kv_heads`` kv heads each on a
    GPU of ``sms`` SMs (0: unknown, then a program per pair), measured best on an H100 for
    Llama-3-8B shapes (``python -m kernels.bench.attention --decode-sweep``). head_dim 256 halves the keys per
    iteration (and doubles the warps for 16-bit caches) so that a key tile takes the registers a 128 one does.
    Quantized caches convert to fp16 operands (11-18% faster than bf16 ones at 64:4:3 on the H200), 64-key tiles, in
    3 stages past _SMALL_DECODE_PAIRS pairs: the H200 sweep over six serving shapes (docs/BENCHMARKS.md, session 34)
    put 64:4:3 within 4% of each shape's best from 200 keys on and 10% behind at 512 x 150 (best 32:4:3), 11-33% ahead
    of the 128:4:3 chosen on an H100 (session 18) for 2,048 pairs and more, 4-7% ahead of 64:4:2 below. 16-bit
    caches: 64-key tiles and
    splits up to _SMALL_DECODE_PAIRS pairs (H200), each program's first tile loaded before the PDL wait there
    (``early``: 32 KB of keys and values in registers, which a 128-key tile would double); beyond, 32-key tiles in 3
    stages, the fastest of 12 tilings at every serving shape swept on the H200 (docs/BENCHMARKS.md, session 31):
    98 us against 244 for the former 128:4:3 at 512 sequences of 150 keys, 517 against 707 at 256 x 2,048, 267
    against 357 at 32 x 8,192; for these 16-bit caches the by-heads kernel measured level with a program per pair
    (H200, session 41). Wide launches over quantized caches take several kv heads per program (``_decode_heads``),
    FP8 ones on 2 warps from _TWO_WARP_DECODE_PAIRS pairs on."""
    if head_dim > 128:
        return DecodeConfig(32, 4, 2) if cache_dtype == torch.float32 else DecodeConfig(64, 8, 2)
    if cache_dtype == torch.float32:
        return DecodeConfig(64, 4, 2)
    quantized = cache_dtype.itemsize == 1  # fp8 / int8: converted to fp16 in registers before the matmul
    if _DECODE_CONFIG_OVERRIDE is not None:
        block_n, warps, stages, heads_first, heads = _DECODE_CONFIG_OVERRIDE
        if not quantized and 0 < pairs <= _SMALL_DECODE_PAIRS:  # the tiling replaced; splits of one tile (64 keys)
            return DecodeConfig(block_n, warps, stages, heads_first=heads_first, min_keys=max(block_n, 64),
                                early=_EARLY_TILE and block_n <= 64)
        return DecodeConfig(block_n, warps, stages, f16=quantized, heads_first=heads_first,
                            heads=heads if pairs > _SMALL_DECODE_PAIRS else 1)
    if quantized:
        if 0 < pairs <= _SMALL_DECODE_PAIRS:
            return DecodeConfig(64, 4, 2, f16=True)
        warps = 2 if cache_dtype == torch.float8_e4m3fn and pairs >= _TWO_WARP_DECODE_PAIRS else 4
        return DecodeConfig(64, warps, 3, f16=True, heads=_decode_heads(pairs, num_kv_heads, sms, warps) if sms else 1)
    if 0 < pairs <= _SMALL_DECODE_PAIRS:
        return DecodeConfig(64, 4, 2, min_keys=64, early=_EARLY_TILE)
    return DecodeConfig(32, 4, 3)


def _decode_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device,
                       min_keys: int = 0) -> int:
    """Key splits per sequence for decode, from shapes only (no host sync; stable for CUDA graphs).

    One program per (sequence, kv head) leaves most SMs idle at small batch; splitting each sequence's
    keys over more programs fills them. Heuristic: aim for two waves of programs over the SMs, but give
    every split at least ``min_keys`` (0: ``_MIN_KEYS_PER_SPLIT``) keys of the table's capacity (``max_context`` =
    max_blocks * block_size: the real lengths are on the device) and use at most ``_MAX_SPLITS``.
    Each sequence's own tiles are shared out; a split beyond a short sequence's tiles exits at once.
    """
    programs = num_seqs * num_kv_heads
    wanted = -(-2 * _num_sms(device) // programs)
    by_length = max(1, max_context // (min_keys or _MIN_KEYS_PER_SPLIT))
    return max(1, min(wanted, by_length, _MAX_SPLITS))


# --- prefill ----------------------------------------------------------------------------------------
@triton.jit
def _find_seq(cu_seqlens_q_ptr, tile, num_seqs, BLOCK_T: tl.constexpr):
    """The sequence owning flat query tile ``tile`` (BLOCK_T tokens): the last i with cu[i] // BLOCK_T + i <= tile.

    Sequence i's tiles start at cu[i] // BLOCK_T + i: room for its cdiv(len_i, BLOCK_T) tiles plus at
    most one spare, and num_tokens // BLOCK_T + num_seqs tiles in all, a bound known from shapes.
    """
    lo = tile * 0
    hi = lo + num_seqs
    while lo < hi:  # binary search over [lo, hi)
        mid = (lo + hi) // 2
        if tl.load(cu_seqlens_q_ptr + mid) // BLOCK_T + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _prefill_key_tile(start, q, q_pos, m_i, l_i, acc, table, k_cache_ptr, v_cache_ptr, kv_head, kv_len, window,
                      qk_scale, softcap, stride_cb, stride_ct, stride_ch, stride_vt, HEAD_DIM: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, FP32: tl.constexpr,
                      SOFTCAP: tl.constexpr, CONTIG: tl.constexpr, QUANT: tl.constexpr, F16: tl.constexpr, own0=0,
                      ACC_DOT: tl.constexpr = False):
    """Fold keys [start, start + BLOCK_N) into the running softmax of a query tile (start: a multiple of BLOCK_N
    in the cache; any position in the step's own rows). MASKED: the tile may hold keys past kv_len, after a query
    (causal) or before its window; else all are visible. CONTIG: the keys are the step's own K/V rows, position
    pos at row pos - own0 from the sequence's first (k_cache_ptr / v_cache_ptr point at its kv head there),
    stride_ct per key row, stride_vt per value row: 32-bit offsets from one base, not a 64-bit address per element.
    Cache blocks holding whole tiles (BLOCK_SIZE a multiple of BLOCK_N): the tile's one block id and base, as in the
    decode kernel (_tile_blocks / _tile_rows)."""
    pos = start + tl.arange(0, BLOCK_N)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    if MASKED:
        in_seq = pos < kv_len
    if CONTIG:
        k_ptrs = k_cache_ptr + ((pos - own0) * stride_ct)[None, :] + offs_d[:, None]  # [HEAD_DIM, BLOCK_N]
        v_ptrs = v_cache_ptr + ((pos - own0) * stride_vt)[:, None] + offs_d[None, :]  # [BLOCK_N, HEAD_DIM]
    elif BLOCK_SIZE % BLOCK_N == 0:  # start < kv_len: its block is the sequence's
        block = tl.load(table + start // BLOCK_SIZE).to(tl.int64)
        base = block * stride_cb + (start % BLOCK_SIZE) * stride_ct + kv_head * stride_ch
        k_ptrs = k_cache_ptr + base + (offs_n[None, :] * stride_ct + offs_d[:, None])
        v_ptrs = v_cache_ptr + base + (offs_n[:, None] * stride_ct + offs_d[None, :])
    else:
        if MASKED:
            block = tl.load(table + pos // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
        else:
            block = tl.load(table + pos // BLOCK_SIZE).to(tl.int64)
        row = block * stride_cb + (pos % BLOCK_SIZE) * stride_ct + kv_head * stride_ch
        k_ptrs = k_cache_ptr + row[None, :] + offs_d[:, None]
        v_ptrs = v_cache_ptr + row[:, None] + offs_d[None, :]
    if MASKED:  # the keys' masked lanes stay unloaded (garbage), masked out of s; the values' are zeros
        k = tl.load(k_ptrs, mask=in_seq[None, :])
        if QUANT == 1 and (F16 or FP32):  # zero-filled by the load (no select), converted two at a time
            v = _e4m3_to(tl.load(v_ptrs, mask=in_seq[:, None], other=0.0), q.dtype, F16)
        elif QUANT == 0:
            v = tl.load(v_ptrs, mask=in_seq[:, None], other=0.0).to(q.dtype)
        elif F16 and _INT8_PTX:  # zero-filled by the load, four at a time
            v = _s8_to(tl.load(v_ptrs, mask=in_seq[:, None], other=0), q.dtype, True)
        else:
            v = tl.where(in_seq[:, None], tl.load(v_ptrs, mask=in_seq[:, None]).to(q.dtype), 0.0)
    else:
        k = tl.load(k_ptrs)
        if QUANT == 1 and (F16 or FP32):
            v = _e4m3_to(tl.load(v_ptrs), q.dtype, F16)
        else:
            v = _kv_operand(tl.load(v_ptrs), q.dtype, QUANT, F16)
    k = _kv_operand(k, q.dtype, QUANT, F16)
    if ACC_DOT and not SOFTCAP:  # the scale folded into the exponent (_online_softmax_step_folded)
        s = _mma(q, k.to(q.dtype), FP32)
        if MASKED:
            visible = in_seq[None, :] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        return _online_softmax_step_folded(s, qk_scale, v, m_i, l_i, acc, FP32)
    s = _mma(q, k.to(q.dtype), FP32) * qk_scale
    if SOFTCAP:
        s = _softcap(s, softcap)
    if MASKED:
        visible = in_seq[None, :] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    if ACC_DOT:
        return _online_softmax_step_folded(s, 1.0, v, m_i, l_i, acc, FP32)
    return _online_softmax_step(s, v, m_i, l_i, acc, FP32)


@triton.jit
def _prefill_key_runs(a, b, c, end, q, q_pos, m_i, l_i, acc, table, k_ptr, v_ptr, kv_head, kv_len, window, qk_scale,
                      softcap, stride_cb, stride_ct, stride_ch, stride_vt, HEAD_DIM: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, FP32: tl.constexpr, SOFTCAP: tl.constexpr,
                      CONTIG: tl.constexpr, QUANT: tl.constexpr, F16: tl.constexpr, own0,
                      ACC_DOT: tl.constexpr = False):
    """Keys [a, end) in tiles of BLOCK_N from a (_prefill_key_tile's arguments): [a, b) and [c, end) masked, [b, c)
    visible to every row."""
    for start in range(a, b, BLOCK_N):
        m_i, l_i, acc = _prefill_key_tile(start, q, q_pos, m_i, l_i, acc, table, k_ptr, v_ptr, kv_head, kv_len,
                                          window, qk_scale, softcap, stride_cb, stride_ct, stride_ch, stride_vt,
                                          HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, FP32, SOFTCAP, CONTIG, QUANT, F16, own0,
                                          ACC_DOT)
    for start in range(b, c, BLOCK_N):
        m_i, l_i, acc = _prefill_key_tile(start, q, q_pos, m_i, l_i, acc, table, k_ptr, v_ptr, kv_head, kv_len,
                                          window, qk_scale, softcap, stride_cb, stride_ct, stride_ch, stride_vt,
                                          HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, FP32, SOFTCAP, CONTIG, QUANT, F16,
                                          own0, ACC_DOT)
    for start in range(c, end, BLOCK_N):
        m_i, l_i, acc = _prefill_key_tile(start, q, q_pos, m_i, l_i, acc, table, k_ptr, v_ptr, kv_head, kv_len,
                                          window, qk_scale, softcap, stride_cb, stride_ct, stride_ch, stride_vt,
                                          HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, FP32, SOFTCAP, CONTIG, QUANT, F16, own0,
                                          ACC_DOT)
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _paged_prefill_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, k_own_ptr, v_own_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr,
        k_scale_ptr, v_scale_ptr, sinks_ptr, out_ptr, qk_scale, window, num_seqs, softcap,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ct, stride_ch, stride_bt,
        stride_kt, stride_kh, stride_vt, stride_vh,
        GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr, FP32: tl.constexpr, F16: tl.constexpr,
        SOFTCAP: tl.constexpr, SINKS: tl.constexpr, PDL: tl.constexpr, CONTIG: tl.constexpr = False,
        SKIP_SINGLE: tl.constexpr = False, ACC_DOT: tl.constexpr = False, LPT: tl.constexpr = False):
    # F16: fp16 matmul operands for a quantized cache, as in _paged_decode_kernel. CONTIG: a sequence's new tokens
    # attend over the step's own K/V [num_tokens, kv heads, head_dim] in q's dtype (k_own_ptr: stride_kt per token,
    # stride_kh per head; v_own_ptr: stride_vt, stride_vh), its context over the cache (none for fresh prompts: the
    # block tables unread). Over a quantized cache the own rows hold the cache's codes (exact in q's dtype), scaled
    # as the cache's are: the same values, without a conversion per key tile (with F16 the context's codes take fp16
    # operands, the own rows q as loaded).
    # SKIP_SINGLE: sequences of exactly one new token are left alone (their rows unwritten: paged_mixed_attention
    # gives them to the decode kernel).
    # grid: (num_tokens // BLOCK_T + num_seqs, num_kv_heads). Program (t, g): flat query tile t (BLOCK_T tokens
    # of one sequence, ``_find_seq``) for the GROUP query heads of kv head g, over every key its rows can see.
    # The tile's BLOCK_M = BLOCK_T * GROUP_P2 rows are (token, head) pairs, token-major: each key tile is read
    # once for the whole GQA group (a decode's one token fills GROUP rows); rows of heads >= GROUP are padding.
    BLOCK_M: tl.constexpr = BLOCK_T * GROUP_P2
    wait_prior(PDL)  # before reading what the previous kernel wrote (kernels/pdl.py)
    tile = tl.program_id(0)
    if LPT:  # the query tiles last first (PREFILL_LPT)
        tile = tl.num_programs(0) - 1 - tile
    seq = _find_seq(cu_seqlens_q_ptr, tile, num_seqs, BLOCK_T)
    if seq < 0:  # only when cu_seqlens_q[0] > 0: rows before it belong to no sequence
        return
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    t_start = (tile - (q_start // BLOCK_T + seq)) * BLOCK_T  # first token of the tile within the sequence
    if t_start >= q_len:  # a spare tile
        return
    if SKIP_SINGLE and q_len == 1:
        return
    kv_head = tl.program_id(1)
    context = tl.load(context_lens_ptr + seq)
    kv_len = context + q_len

    rows = tl.arange(0, BLOCK_M)
    offs_t = t_start + rows // GROUP_P2  # each row's token within the sequence
    head = kv_head * GROUP + rows % GROUP_P2
    offs_d = tl.arange(0, HEAD_DIM)
    m_mask = (offs_t < q_len) & (rows % GROUP_P2 < GROUP)
    q_pos = context + offs_t  # absolute positions of the rows' queries
    q = tl.load(q_ptr + (q_start + offs_t)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=m_mask[:, None], other=0.0)
    q = _query_operand(q, FP32, F16)
    qk_cache = qk_scale
    if QUANT != 0:
        qk_cache = qk_scale * tl.load(k_scale_ptr)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt

    # Key tiles [a, hi) in three runs: [a, b) and [c, hi) need masks, [b, c) is visible to every row:
    #   a: first tile holding a key the first query sees (window); hi: past the last query's position
    #   b: first tile past every row's window start;  c: end of the tiles before the first query
    first_pos = context + t_start
    last_pos = context + tl.minimum(t_start + BLOCK_T, q_len) - 1
    a = (tl.maximum(first_pos - window + 1, 0) // BLOCK_N) * BLOCK_N
    hi = last_pos + 1
    b = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(last_pos - window + 1, 0), BLOCK_N) * BLOCK_N, a), hi)
    c = tl.maximum(tl.minimum(((first_pos + 1) // BLOCK_N) * BLOCK_N, hi), b)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if CONTIG:
        # the context's keys [a, context) from the cache: whole tiles visible to every row from b on (past every
        # row's window start) up to the last whole tile, c; a partial last tile masked at context
        cb = tl.maximum(tl.minimum(b, (context // BLOCK_N) * BLOCK_N), a)
        cc = tl.maximum((context // BLOCK_N) * BLOCK_N, cb)
        m_i, l_i, acc = _prefill_key_runs(a, cb, cc, context, q, q_pos, m_i, l_i, acc, table, k_cache_ptr,
                                          v_cache_ptr, kv_head, context, window, qk_cache, softcap, stride_cb,
                                          stride_ct, stride_ch, stride_ct, HEAD_DIM, BLOCK_SIZE, BLOCK_N, FP32,
                                          SOFTCAP, False, QUANT, F16, 0, ACC_DOT)
        # the step's own keys [context, hi) (the sequence's first row of k_own / v_own at this kv head), in tiles
        # from context: the same three runs, counted from there
        k_src = k_own_ptr + q_start.to(tl.int64) * stride_kt + kv_head * stride_kh
        v_src = v_own_ptr + q_start.to(tl.int64) * stride_vt + kv_head * stride_vh
        if F16:  # the cache's codes took fp16 operands; the own rows are in q's dtype: q as loaded (again)
            q = tl.load(q_ptr + (q_start + offs_t)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                        mask=m_mask[:, None], other=0.0)
            q = _query_operand(q, FP32, False)
        oa = context + (tl.maximum(first_pos - window + 1 - context, 0) // BLOCK_N) * BLOCK_N
        ob = tl.minimum(tl.maximum(context + tl.cdiv(tl.maximum(last_pos - window + 1 - context, 0), BLOCK_N) * BLOCK_N,
                                   oa), hi)
        oc = tl.maximum(tl.minimum(context + ((first_pos + 1 - context) // BLOCK_N) * BLOCK_N, hi), ob)
        m_i, l_i, acc = _prefill_key_runs(oa, ob, oc, hi, q, q_pos, m_i, l_i, acc, table, k_src, v_src, kv_head,
                                          kv_len, window, qk_cache, softcap, stride_cb, stride_kt, stride_kh, stride_vt,
                                          HEAD_DIM, BLOCK_SIZE, BLOCK_N, FP32, SOFTCAP, True, 0, False, context,
                                          ACC_DOT)
    else:
        m_i, l_i, acc = _prefill_key_runs(a, b, c, hi, q, q_pos, m_i, l_i, acc, table, k_cache_ptr, v_cache_ptr,
                                          kv_head, kv_len, window, qk_cache, softcap, stride_cb, stride_ct, stride_ch,
                                          stride_ct, HEAD_DIM, BLOCK_SIZE, BLOCK_N, FP32, SOFTCAP, False, QUANT, F16,
                                          0, ACC_DOT)
    if QUANT != 0:
        acc = acc * tl.load(v_scale_ptr)
    if SINKS:
        l_i = l_i + _sink_share(tl.load(sinks_ptr + head, mask=rows % GROUP_P2 < GROUP, other=0.0), m_i)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + offs_t)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            scale: float, *, k_scale: torch.Tensor | float | None = None,
                            v_scale: torch.Tensor | float | None = None,
                            sliding_window: int | None = None, softcap: float = 0.0,
                            sinks: torch.Tensor | None = None,
                            config: tuple[int, int, int, int] | None = None,
                            contiguous_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                            out: torch.Tensor | None = None, skip_single: bool = False,
                            prompts_only: bool = False) -> torch.Tensor:
    """Causal attention of packed new tokens over their paged caches; returns ``out`` like ``q``.

    q: [num_tokens, num_heads, head_dim]; sequence i's new tokens are rows cu_seqlens_q[i]:cu_seqlens_q[i+1]
    (cu_seqlens_q: [num_seqs + 1] int32, starting at 0, ending at num_tokens) at positions
    context_lens[i] + j (context_lens: [num_seqs] int32; > 0 for a chunked prefill). Their K/V are
    already written to the cache, so every key, old or new, is read through block_tables:
    [num_seqs, max_blocks] int32 (the new ones from ``contiguous_kv`` when given). Rows past cu_seqlens_q[-1]
    (padding) are left unwritten.
    softcap and sinks: as ``paged_decode_attention``. ``config``: (BLOCK_M, BLOCK_N, num_warps, num_stages) in place
    of ``_prefill_config``'s (a tiling sweep's candidates).
    ``contiguous_kv``: (k, v) [num_tokens, num_kv_heads, head_dim] in q's dtype, the step's own keys (rotated) and
    values as the cache holds them, read in place of the cache for the new tokens' keys (contiguous rows, streamed
    without the block tables' indirection, and over a quantized cache without converting its codes per key tile);
    a context's keys still come from the cache. Over a 16-bit cache of q's dtype: the rotated keys and the values
    (``rope_write_kv_cache(k_in_place=True)``); over a quantized cache: their codes (the same call writes them), which
    k_scale / v_scale scale as the cache's; nothing checks that they are (real keys there would be scaled as codes).
    The same keys and values as the paged path's: bit for bit for fresh prompts over a 16-bit cache; else up to the
    order of the fp32 sums (the key tiles start at the context's end) and, over a quantized cache with fp16 operands
    (``PREFILL_F16``), the own rows' products, whose operands are q's dtype (bf16 probabilities, not fp16).
    ``out``: where to write (like q; a new tensor by default). ``skip_single``: leave the rows of sequences with
    exactly one new token unwritten (``paged_mixed_attention``). ``prompts_only``: the caller expects no sequence
    of the launch to have exactly one new token (as with ``skip_single``), which picks the tiling for prompts
    (``_prefill_config``); a hint for speed only, any launch runs correctly either way.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = context_lens.shape[0]
    _check_attention_args(q, k_cache, v_cache, block_tables, num_seqs, softcap, sinks)
    if contiguous_kv is not None:
        k, v = contiguous_kv
        if k.shape != v.shape or k.shape[0] != num_tokens or k.shape[2] != head_dim \
                or k.shape[1] != k_cache.shape[2] or k.dtype != q.dtype or v.dtype != q.dtype:
            raise ValueError(f"contiguous_kv {tuple(k.shape)} / {tuple(v.shape)} ({k.dtype}, {v.dtype}) are not the "
                             f"step's [{num_tokens}, {k_cache.shape[2]}, {head_dim}] keys and values in {q.dtype}")
        if k.stride(2) != 1:
            k = k.contiguous()
        if v.stride(2) != 1:
            v = v.contiguous()
        if num_tokens * max(k.stride(0), v.stride(0)) >= 2**31:  # past the 32-bit row offsets: the cache's blocks
            contiguous_kv = None
    assert cu_seqlens_q.shape == (num_seqs + 1,), \
        f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} != ({num_seqs + 1},) for {num_seqs} sequences"
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"out {tuple(out.shape)} ({out.dtype}) is not like q {tuple(q.shape)} ({q.dtype}) with "
                         "contiguous heads")
    if num_tokens == 0 or num_seqs == 0:
        return out
    q = _last_dim_contiguous(q)
    block_m, block_n, num_warps, num_stages = config or _prefill_config(
        q.dtype, head_dim, k_cache.dtype, prompts_only and contiguous_kv is not None)
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    group_p2 = triton.next_power_of_2(group)
    block_t = max(1, block_m // group_p2)  # tokens per tile: BLOCK_M rows of (token, head) pairs
    k_scale_t, v_scale_t = _scales(k_cache, k_scale, v_scale, q.device)
    own = contiguous_kv is not None
    k_own, v_own = (k, v) if own else (q, q)
    own_strides = (k.stride(0), k.stride(1), v.stride(0), v.stride(1)) if own else (0, 0, 0, 0)
    _paged_prefill_kernel[(num_tokens // block_t + num_seqs, num_kv_heads)](
        q, k_cache, v_cache, k_own, v_own, block_tables, cu_seqlens_q, context_lens, k_scale_t, v_scale_t,
        q if sinks is None else sinks, out, scale * _LOG2E, sliding_window or _NO_WINDOW, num_seqs, softcap * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_cache.stride()[:3], block_tables.stride(0),
        *own_strides, GROUP=group, GROUP_P2=group_p2, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_T=block_t, BLOCK_N=block_n, QUANT=_QUANT.get(k_cache.dtype, 0), FP32=_fp32_dot(q.dtype),
        F16=PREFILL_F16 and k_cache.dtype in _QUANT and not _fp32_dot(q.dtype), SOFTCAP=softcap > 0,
        SINKS=sinks is not None, CONTIG=own, SKIP_SINGLE=skip_single,
        ACC_DOT=PREFILL_ACC_DOT and scale > 0, LPT=PREFILL_LPT,  # the fold assumes a positive scale (k_scale: the
        # executor refuses one <= 0 at load)
        num_warps=num_warps, num_stages=num_stages, **pdl_args(q))
    return out


@dataclass(frozen=True)
class DecodeRows:
    """A step's sequences of exactly one new token (``decode_rows``), for ``paged_mixed_attention``; made once per
    step, on the device, without a host sync (a CUDA graph replays it)."""

    gather: torch.Tensor  # [num_seqs] int64: each sequence's last new row (0 where it has none)
    scatter: torch.Tensor  # [num_seqs] int64: that row for a sequence of one new token, else num_tokens (a spare row)
    seq_lens: torch.Tensor  # [num_seqs] int32: its length for a sequence of one new token, else 0 (no work)


def decode_rows(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int) -> DecodeRows:
    """``DecodeRows`` of a packed step: cu_seqlens_q [num_seqs + 1] and seq_lens [num_seqs] int32 as
    ``paged_prefill_attention`` and ``paged_decode_attention`` take them, over num_tokens rows."""
    one = cu_seqlens_q[1:] - cu_seqlens_q[:-1] == 1
    last = (cu_seqlens_q[1:].long() - 1).clamp(min=0)
    return DecodeRows(last, torch.where(one, last, num_tokens), torch.where(one, seq_lens, 0).to(torch.int32))


def paged_mixed_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                          scale: float, rows: DecodeRows, *, k_scale: torch.Tensor | float | None = None,
                          v_scale: torch.Tensor | float | None = None, sliding_window: int | None = None,
                          softcap: float = 0.0, sinks: torch.Tensor | None = None,
                          contiguous_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``paged_prefill_attention`` of a step that mixes decodes with prompts, its sequences of one new token on the
    decode kernel: their queries gathered (``rows``, ``decode_rows``), attended over their caches by
    ``paged_decode_attention`` (the others get length 0: no work) and scattered back, the other sequences by the
    prefill kernel, which leaves the decodes' rows alone. The prefill kernel reads a decode's keys with a tile of
    BLOCK_M rows of which it fills one GQA group, without splitting the keys; the decode kernel splits them and
    reads them at about twice the bandwidth (kernels.bench.attention --mixed-only). The same result up to fp32
    rounding. Three more launches a layer (gather, decode, scatter) than the prefill kernel alone, and
    ``decode_rows``' few small ops once a step. ``contiguous_kv``: as ``paged_prefill_attention``'s, for the prefill
    kernel's sequences (the decodes read their keys from the cache)."""
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return torch.empty_like(q)
    out = q.new_empty((num_tokens + 1, *q.shape[1:]))  # the last row takes the scatter of non-decode sequences
    # PDL: the decode kernel reads rows.seq_lens and block_tables before its wait, so the kernel launched just before
    # it must not write them: that is the gather, an ordinary launch (which starts once all before it are done)
    # after decode_rows' ops. Keep a plain launch between decode_rows and this kernel.
    dec = paged_decode_attention(q.index_select(0, rows.gather), k_cache, v_cache, block_tables, rows.seq_lens, scale,
                                 k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window, softcap=softcap,
                                 sinks=sinks)
    out.index_copy_(0, rows.scatter, dec)
    paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, k_scale=k_scale,
                            v_scale=v_scale, sliding_window=sliding_window, softcap=softcap, sinks=sinks,
                            out=out[:num_tokens], skip_single=True, prompts_only=True, contiguous_kv=contiguous_kv)
    return out[:num_tokens]


# Prompts over an FP8 cache's own codes (``contiguous_kv``), no one-token sequence in the launch: 128 rows of (token,
# head) pairs, 64 keys, 8 warps, 3 stages. Swept on an H200 (docs/BENCHMARKS.md, session 48; `python -m
# kernels.bench.attention --prefill-sweep --sweep-own-kv`, 16 tilings): 148.3 -> 135.4 us for a fresh 2,048-token
# prompt, 490.8 -> 434.5 for four of 2,000 in one launch, 919.7 -> 916.6 for 2,048 after 6,144 cached; the static
# FP8-KV build's 2048/128 throughput +1.4% (3,233 / 3,275 -> 3,305 / 3,296 output tok/s, alternating, one call).
# One-token sequences keep 64-row tiles: a decode fills one GQA group of a tile's rows (session 42: 128-row tiles
# read a mixed step's decodes 1.5x slower), and bf16 caches were level or slower with 128 rows.
_FP8_PROMPT_CONFIG = (128, 64, 8, 3)


def _prefill_config(dtype: torch.dtype, head_dim: int = 128, cache_dtype: torch.dtype | None = None,
                    prompts_own_codes: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for prefill, measured on an H100 (Llama-3-8B shapes,
    ``kernels/bench/attention.py``, with one head per tile: 64x64 within 10% of the best of 128x64, 128x128 and
    64x32 at every shape, and the best with short sequences). BLOCK_M rows are (token, head) pairs of one GQA
    group: BLOCK_M // next_power_of_2(group) tokens per tile. fp32 runs its matmuls on CUDA cores: smaller
    tiles. head_dim 256: half the keys per tile and twice the warps (the accumulator and a key tile are twice
    as wide). ``prompts_own_codes``: a launch of prompts and chunks only (no one-token sequence) over the step's own
    rows of an FP8 cache (``cache_dtype``): ``_FP8_PROMPT_CONFIG``. ``KERNELS_PREFILL_CONFIG`` overrides every
    16-bit launch up to head_dim 128."""
    if dtype == torch.float32:
        return (16, 16, 4, 1) if head_dim > 128 else (32, 32, 4, 2)
    if head_dim <= 128 and _PREFILL_CONFIG_OVERRIDE is not None:
        return _PREFILL_CONFIG_OVERRIDE
    if head_dim <= 128 and prompts_own_codes and cache_dtype == torch.float8_e4m3fn:
        return _FP8_PROMPT_CONFIG
    return (64, 32, 8, 2) if head_dim > 128 else (64, 64, 4, 2)


# --- shared host-side helpers ----------------------------------------------------------------------
def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not supported by the paged-attention kernels; "
                         f"supported: {', '.join(map(str, SUPPORTED_HEAD_DIMS))}")
    assert k_cache.dim() == 4 and k_cache.shape[2:] == (num_kv_heads, head_dim), \
        f"k_cache {tuple(k_cache.shape)} is not [num_blocks, block_size, {num_kv_heads}, {head_dim}]"
    assert v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype, \
        f"v_cache {tuple(v_cache.shape)} {v_cache.dtype} != k_cache {tuple(k_cache.shape)} {k_cache.dtype}"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1, \
        f"k/v caches need equal strides and contiguous rows: {k_cache.stride()}, {v_cache.stride()}"


def _check_attention_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, num_seqs: int, softcap: float = 0.0,
                          sinks: torch.Tensor | None = None) -> None:
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if q.dtype not in QUERY_DTYPES:
        raise ValueError(f"query dtype {q.dtype} is not one of {', '.join(map(str, QUERY_DTYPES))}")
    _check_cache(k_cache, v_cache, num_kv_heads, head_dim)
    assert num_heads % num_kv_heads == 0, f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
    assert k_cache.dtype in (q.dtype, *_QUANT), \
        f"cache dtype {k_cache.dtype} is neither the query dtype {q.dtype} nor fp8 e4m3 / int8"
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs and block_tables.stride(1) == 1, \
        f"block_tables {tuple(block_tables.shape)} is not a row-contiguous [{num_seqs}, max_blocks] table"
    if not softcap >= 0:
        raise ValueError(f"softcap must be >= 0 (0: off), got {softcap}")
    if sinks is not None and (sinks.shape != (num_heads,) or sinks.dtype != torch.float32 or not sinks.is_contiguous()
                              or sinks.device != q.device):
        raise ValueError(f"sinks must be a contiguous fp32 [{num_heads}] tensor on {q.device}, one logit per query "
                         f"head; got {tuple(sinks.shape)} {sinks.dtype} on {sinks.device}")


def _scales(cache: torch.Tensor, k_scale, v_scale, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Device fp32 scalars for the kernels; placeholders (never read) for an unquantized cache."""
    if cache.dtype not in _QUANT:
        return cache, cache
    if k_scale is None or v_scale is None:
        raise ValueError(f"a {cache.dtype} KV cache needs k_scale and v_scale")

    def as_tensor(s) -> torch.Tensor:
        t = torch.as_tensor(s, dtype=torch.float32, device=device).reshape(-1)
        assert t.numel() == 1, f"KV scales are per-layer scalars, got {t.numel()} values"
        return t

    return as_tensor(k_scale), as_tensor(v_scale)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _fp32_dot(dtype: torch.dtype) -> bool:
    """Run the matmuls in fp32: for fp32 inputs, and always under TRITON_INTERPRET (whose bf16/fp16
    ``tl.dot`` and fp32->bf16 casts are inexact); tested numerics therefore match within tolerance."""
    return dtype == torch.float32 or _interpreted()


def _interpreted() -> bool:
    """Whether the kernels were built for the interpreter (TRITON_INTERPRET=1 at import time)."""
    return not isinstance(_paged_decode_kernel, triton.runtime.JITFunction)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


# --- plain-torch references (what the kernels are tested against) ---------------------------------
# largest finite magnitude of each quantized KV storage dtype (runtime/executor.py ``_kv_codec``)
KV_QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}


def quantize_kv(x: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in the cache's storage ``dtype``: divide by the per-layer scale, clamp, round (int8), cast."""
    if dtype not in KV_QMAX:
        return x.to(dtype)
    qmax = KV_QMAX[dtype]
    y = (x.float() / torch.as_tensor(scale, dtype=torch.float32, device=x.device)).clamp(-qmax, qmax)
    return (y.round() if dtype == torch.int8 else y).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | float | None) -> torch.Tensor:
    """Stored cache rows as fp32 values."""
    if x.dtype not in KV_QMAX:
        return x.float()
    return x.float() * torch.as_tensor(scale, dtype=torch.float32, device=x.device)


def ref_write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, *, k_scale: torch.Tensor | float | None = None,
                       v_scale: torch.Tensor | float | None = None) -> None:
    """Write rows ``k, v: [num_tokens, num_kv_heads, head_dim]`` to flat slots of the caches, in place.

    slot = block_id * block_size + offset; a negative slot (a padding token) is skipped.
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_slots = k_cache.view(-1, *k_cache.shape[2:])
    v_slots = v_cache.view(-1, *v_cache.shape[2:])
    k_slots[slots] = quantize_kv(k[keep], k_scale, k_cache.dtype)
    v_slots[slots] = quantize_kv(v[keep], v_scale, v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int,
              scale: torch.Tensor | float | None) -> torch.Tensor:
    """Positions [0, num_tokens) of one sequence as fp32 [num_tokens, num_kv_heads, head_dim]."""
    pos = torch.arange(num_tokens, device=cache.device)
    blocks = block_table.long()[pos // cache.shape[1]]
    return dequantize_kv(cache[blocks, pos % cache.shape[1]], scale)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
           sliding_window: int | None, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Masked attention in fp32 over one sequence's gathered keys (key j sits at position j).

    q: [num_q, num_heads, head_dim] at positions ``q_pos: [num_q]``; k, v: [num_keys, num_kv_heads, head_dim].
    Query at position p sees keys at positions <= p and, with a sliding window, > p - window
    (``kernels.torch_ops.attention_one``); softcap > 0: scores softcap * tanh(scores / softcap); sinks
    [num_heads]: a logit per head that joins the softmax and is dropped. Returns fp32 [num_q, num_heads, head_dim].
    """
    group = q.shape[1] // k.shape[1]
    kh = k.float().repeat_interleave(group, dim=1)  # [num_keys, num_heads, head_dim]
    vh = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kh) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    k_pos = torch.arange(k.shape[0], device=q.device)[None, :]
    mask = k_pos <= q_pos[:, None]
    if sliding_window:
        mask &= k_pos > q_pos[:, None] - sliding_window
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # one more column per head, softmaxed with the scores, then dropped
        sink = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
        probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probs = scores.softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vh)


def ref_paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                               k_scale: torch.Tensor | float | None = None,
                               v_scale: torch.Tensor | float | None = None,
                               sliding_window: int | None = None, softcap: float = 0.0,
                               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence at position seq_lens[i] - 1 over its cached keys; like ``q``.

    q: [num_seqs, num_heads, head_dim]; a sequence of length 0 gets zeros.
    """
    out = torch.zeros_like(q)
    for i, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        k = gather_kv(k_cache, block_tables[i], n, k_scale)
        v = gather_kv(v_cache, block_tables[i], n, v_scale)
        q_pos = torch.tensor([n - 1], device=q.device)
        out[i] = attend(q[i:i + 1], k, v, q_pos, scale, sliding_window, softcap, sinks)[0].to(q.dtype)
    return out


def ref_paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                context_lens: torch.Tensor, scale: float, *,
                                k_scale: torch.Tensor | float | None = None,
                                v_scale: torch.Tensor | float | None = None,
                                sliding_window: int | None = None, softcap: float = 0.0,
                                sinks: torch.Tensor | None = None,
                                contiguous_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Causal attention of packed new tokens over their sequences' cached keys; like ``q``.

    q: [num_tokens, num_heads, head_dim]; sequence i's rows cu_seqlens_q[i]:cu_seqlens_q[i + 1] sit at
    positions context_lens[i] + j, and their own K/V are already in the cache; with ``contiguous_kv`` (k, v) like
    ``paged_prefill_attention``'s, the new tokens' keys and values are those rows instead (codes, over a quantized
    cache, scaled as its own).
    """
    out = torch.empty_like(q)
    cu, ctx = cu_seqlens_q.tolist(), context_lens.tolist()
    for i in range(len(ctx)):
        start, end = cu[i], cu[i + 1]
        if end == start:
            continue
        num_keys = ctx[i] + end - start
        k = gather_kv(k_cache, block_tables[i], num_keys, k_scale)
        v = gather_kv(v_cache, block_tables[i], num_keys, v_scale)
        if contiguous_kv is not None:  # the cache's values of the new tokens, from the rows (codes if quantized)
            k, v = k.clone(), v.clone()
            for dst, rows, s in ((k, contiguous_kv[0], k_scale), (v, contiguous_kv[1], v_scale)):
                dst[ctx[i]:] = rows[start:end].float()
                if k_cache.dtype in KV_QMAX:
                    dst[ctx[i]:] *= torch.as_tensor(s, dtype=torch.float32, device=dst.device)
        q_pos = torch.arange(ctx[i], num_keys, device=q.device)
        out[start:end] = attend(q[start:end], k, v, q_pos, scale, sliding_window, softcap, sinks).to(q.dtype)
    return out
