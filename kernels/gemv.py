"""GEMV kernels for quantized linears at 1 to ``GEMV_MAX_ROWS`` rows of x (batch-1 and small-batch decode).

At a handful of tokens a linear is a matrix-vector product bound by the weight bytes read from HBM. The GEMM
kernels (``kernels.w4a16_gemm``, ``kernels.w8a8_gemm``) multiply 16-row tiles on tensor cores (15/16 padding at
M = 1); the w4a16 one spends ~14 instructions per weight byte (fp32 dequantization, conversion for the MMA,
shared-memory operands) in its K loop, more than the SMs can issue at HBM speed. Here there is no ``tl.dot``:
each program streams its weight tile and multiplies it by the rows of x (kept in registers) with broadcast
fp32 (int32 for INT8) multiply-adds into per-thread accumulators, reduced with ``tl.sum`` once, at the end.
The budget that shapes the kernels: at 3 TB/s an H100 issues about 10 instructions per weight byte; the
figures below are the K loops' SASS for sm_90.

``w4a16_gemv``: ``y = x @ ((q - zero) * scale).T + bias`` on :func:`kernels.w4a16_gemm.repack_w4a16`'s
``k_major`` layout, 4 or 8 bits, fp32 products and sums (``ref_w4a16_linear``)::

    qweight uint8 [K/2, N]: byte [j, n] = q[n, j] | q[n, j + K/2] << 4   (8 bits: [K, N], q[n, k])
    scales  fp32 [G, N], zeros uint8 [G, N]

    one K step of a program: BLOCK_R = BLOCK_K / 2 byte rows (8 bits: BLOCK_K)
                         n0 ............ n0 + BLOCK_N
      rows j0 .. +T     | pass 0: 16 bytes/thread |   byte rows contiguous over n: coalesced vector loads;
      rows j0+T .. +2T  | pass 1                  |   low nibbles pair with x[:, j], high with x[:, K/2 + j]
      ...               | BLOCK_R / T passes      |   acc[t, n] += w_lo * x[j] + w_hi * x[K/2 + j]   [T, BLOCK_N]

    T: the rows one pass of the program's threads covers. The step lies in one quantization group (host-side
    choice of BLOCK_R where the group size allows), so its scales and zeros are per column, loaded once per
    step for all its passes.

  4-bit codes become ``1 + q / 16`` by ORing the nibble into the mantissa of 1.0 (1.5 instructions per code in
  PTX, ``_unpack_nibbles``) and are dequantized by one FMA: ``(1 + q / 16) * 16 s - (16 s + z s)``, within
  2^-18 * scale of (q - zero) * scale (the GEMM's ``_dequant``: 2^-19). Per weight byte: 2 FMAs of dequantization,
  2 per row of x, ~9 instructions at M = 1. 8-bit codes use the GEMM's ``_dequant``.

``w8a8_gemv``: ``y = (quant(x) @ qweight.T) * x_scale * weight_scale + bias`` for int8 / float8_e4m3fn
``qweight`` [N, K] (``ref_w8a8_linear``): each program first reads its rows of x over all of K for the
per-token max (or loads the static ``input_scale``), then per K step quantizes each row's x step once, in
registers (int8: round half to even, clamp to act_qmin..127, act_qmin -127 or -128 as the linear's ``quant`` says
(``kernels.torch_quant.int8_act_qmin``); fp8: clamp to +-448, round to E4M3), and multiplies it by
the [BLOCK_N, BLOCK_K] weight tile (rows contiguous over k). Each thread holds 16 contiguous codes of a row
per vector load and sums their products in registers every step (``_dot_chunks``): [BLOCK_N, BLOCK_K / 16]
accumulators, so a thread can own many rows and its quantized x serves them all. Exact int32 products and
sums for INT8, fp32 for FP8 (E4M3 products are exact in fp32); the sums over K are scaled once, by x_scale *
weight_scale, as the reference does. ~2.6 (INT8) / 4 (FP8) instructions per weight byte at M = 1.

``dense_gemv``: ``F.linear`` for unquantized fp16/bf16/fp32 weights [N, K] (rows contiguous over k), fp32 products
and sums rounded once to x's dtype; the same [BLOCK_N, BLOCK_K] tiles and per-thread chunk sums as ``w8a8_gemv``
without the quantization. Against cuBLAS's GEMV it wins by launching with PDL and asking the L2 for its first tile
before the wait (``kernels.pdl.prefetch_l2_rows``), and by tiles of 16 rows x 1 KB of K (H100, one row: 2.5-3.1
TB/s against cuBLAS's 2.0-2.8). ``gated``: x is a merged [gate | up] and the input ``silu(gate) * up``, formed in
the x loads as ``kernels.activation.silu_mul`` forms it.

Small N leaves few BLOCK_N tiles for 132 SMs, so K is split across ``split_k`` programs per tile (from the tile
count and the SM count, or the config). The split programs write their partial sums [split_k, M, N] (fp32;
int32 for INT8) and count themselves in on the tile's counter; the last to arrive adds the partials in split
order (deterministic), scales, adds the bias and writes y: one launch, where a second reduction kernel
(``reduce_split_k``, ``GemvConfig.reduce_in_kernel=False``) would add a launch gap comparable to the whole
GEMV (8 MB of 4-bit weights: ~3 us on an H100).

NOTE: the tile counters are one int32 buffer per device (``_tile_counters``), zero between launches: the last
program of a tile resets its counter. The frag GEMV, the decode attention's split merge, the fp8_block GEMV and
GEMM (``kernels.fp8_block_gemm``) and the W8A8 rows GEMM (``kernels.w8a8_rows``) take theirs from it too. Split-K launches that may run concurrently on one device
(several streams) would share counters; the runtime runs one stream per device. The buffer is allocated on first use,
which must come before any CUDA-graph capture (the runtime warms up before capturing). No host
synchronisation: grids, splits and tiles come from shapes only (CUDA-graph capturable).

NOTE: under TRITON_INTERPRET the PTX unpacking runs as plain integer ops (same bits), and the fp32 ->
float8e4nv conversion is wrong (``kernels.w8a8_gemm``), so the interpreter rounds x to E4M3 with
``_round_e4m3``; the GPU converts with the hardware's round-to-nearest-even.

Configurations (``GemvConfig``) are picked by the number of rows from per-kernel tables, to be tuned with
``python -m kernels.bench.gemm --gemv-sweep`` and ``python -m kernels.bench.w8a8 --gemv-sweep``.
``GEMV_ENABLED`` switches the runtime's use of these kernels (``runtime/executor.py``), which sends them at
most ``GEMV_RUNTIME_MAX_ROWS`` rows (one: measured faster there only); W4A16 / W8A16 weights go to
``kernels.w4a16_mma`` instead wherever it takes their group size (faster at 1-16 rows, session 7).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.activation import silu_mul_values
from kernels.pdl import LINE, pdl_args, prefetch_l2_rows, prefetch_rows_plan, wait_prior
from kernels.w4a16_gemm import (
    _check_inputs as _check_w4a16_inputs,
    _dequant,
    _group_params,
    _interpreting,
    _num_sms,
    reduce_split_k,
)
from kernels.w8a8_gemm import (
    _MAGIC,
    QuantizedRows,
    act_qmin_arg,
    div_exact,
    _check_inputs as _check_w8a8_inputs,
    _qrange,
    _round_e4m3,
)

GEMV_MAX_ROWS = 4  # rows of x (tokens) the GEMV kernels take; the runtime sends more to the GEMM kernels
GEMV_ENABLED = True  # the runtime's kernel path uses the GEMV kernels up to GEMV_RUNTIME_MAX_ROWS rows
# The runtime sends only this many rows here: on the H100 the GEMV wins at one row (W8A8 Llama-3-8B linears
# 98 vs 118 us per layer, W4A16 qkv / o_proj / gate_up 14.0 / 11.7 / 47.1 vs 18.3 / 14.7 / 55.5 us) and
# ties or loses to the tensor-core GEMMs at 2-4 rows (docs/BENCHMARKS.md, session 5)
GEMV_RUNTIME_MAX_ROWS = 1
# Unquantized linears (``dense_gemv``) go here up to this many rows instead of cuBLAS (two: the Llama-3-8B bf16
# decode step at two sequences 6.34 -> 6.20 ms on an H100, docs/BENCHMARKS.md session 19; at four rows the GEMV ties
# or loses); KERNELS_DENSE_GEMV_ROWS=0 keeps them on cuBLAS at every size (A/B runs)
_DENSE_ROWS = os.environ.get("KERNELS_DENSE_GEMV_ROWS", "2")
if not _DENSE_ROWS.isdigit() or int(_DENSE_ROWS) > 4:
    raise ValueError(f"KERNELS_DENSE_GEMV_ROWS={_DENSE_ROWS!r} is not a row count from 0 to 4")
DENSE_RUNTIME_MAX_ROWS = int(_DENSE_ROWS)
# KERNELS_GEMV_PREQUANT=1: a norm or SwiGLU feeding a W8A8 linear writes its rows quantized (codes and per-token
# scale) for the one-row GEMV too, which then skips its own pass over x for the max. Off by default: measured slower
# (Llama-3-8B FP8 batch-1 decode on an H100, two rounds in one call: 266.5 / 266.1 tok/s on, 271.6 / 270.5 off;
# docs/BENCHMARKS.md, session 19): a one-row norm that quantizes is one program doing two passes, where each GEMV
# program's own max over x (from L2) overlaps its weight prefetch
GEMV_PREQUANT = os.environ.get("KERNELS_GEMV_PREQUANT", "0") == "1"
# KERNELS_GEMV_WEIGHT_LOAD: the cache hints of the dense and W8A8 GEMVs' weight loads, for A/B runs: "default",
# "cg" (L2 only: no L1 line for bytes read once), "evict_first" (the first lines to go from the caches)
_WEIGHT_LOADS = {"default": ("", ""), "cg": (".cg", ""), "evict_first": ("", "evict_first")}
_WEIGHT_LOAD = os.environ.get("KERNELS_GEMV_WEIGHT_LOAD", "default")
if _WEIGHT_LOAD not in _WEIGHT_LOADS:
    raise ValueError(f"KERNELS_GEMV_WEIGHT_LOAD={_WEIGHT_LOAD!r}: expected one of {', '.join(_WEIGHT_LOADS)}")
_W_CACHE = tl.constexpr(_WEIGHT_LOADS[_WEIGHT_LOAD][0])
_W_EVICT = tl.constexpr(_WEIGHT_LOADS[_WEIGHT_LOAD][1])


@dataclass(frozen=True)
class GemvConfig:
    """One launch configuration of a GEMV kernel."""

    block_n: int  # output features per program (power of 2)
    block_k: int  # input features per K step (power of 2; 4-bit: block_k / 2 byte rows)
    split_k: int = 0  # programs sharing one tile's K range; 0 = from the tile count and the SM count
    num_warps: int = 4
    num_stages: int = 3  # K steps in flight (tl.range software pipelining of the weight loads)
    reduce_in_kernel: bool = True  # split_k > 1: the tile's last program adds the partials (else reduce_split_k)
    programs_per_sm: float = 0.0  # split_k 0: about this many programs per SM (0: programs_per_sm(kernel, device))


# Picked by rows of x: the first row whose bound is >= M. The one-row configs are the fastest of
# ``--gemv-sweep`` on an H100 across the Llama-3-8B shapes (session 5, docs/BENCHMARKS.md); the 2- and 4-row
# ones were chosen from the kernels' SASS for sm_90 (instructions per weight byte in the K loop: an H100
# issues about 10 per weight byte at 3 TB/s) and lose to the GEMMs there, so the runtime does not use them:
#   w4a16 128 x 256, 4 warps: 9.2 (M = 1), 12.1 (2), 17.3 (4) instructions per byte, 158-239 registers
#   w8a8  128 x 128, 4 warps: int8 2.6 / 3.8 / 6.3, fp8 4.0 / 6.0 / 10.1, 80-255 registers
_W4A16_CUDA_CONFIGS: list[tuple[int, GemvConfig]] = [
    (1, GemvConfig(128, 256, num_warps=4, num_stages=2)),
    (2, GemvConfig(128, 256, num_warps=4, num_stages=3)),
    (GEMV_MAX_ROWS, GemvConfig(128, 256, num_warps=4, num_stages=3)),
]
# dense (fp16/bf16/fp32 weights), ``python -m kernels.bench.dense --sweep`` on an H100 (docs/BENCHMARKS.md, session
# 19): at one row 16 x 512 tiles are the fastest or within 1% of it on every Llama-3-8B shape (2.65-3.12 TB/s, the
# 64 x 256 tiles 2.42-3.05); at two rows they are within 3% of the fastest on qkv, o_proj and gate_up (ahead of cuBLAS);
# at four rows the GEMV ties or loses to cuBLAS (the runtime sends at most DENSE_RUNTIME_MAX_ROWS rows)
_DENSE_CUDA_CONFIGS: list[tuple[int, GemvConfig]] = [
    (1, GemvConfig(16, 512, num_warps=4, num_stages=4)),
    (2, GemvConfig(16, 512, num_warps=4, num_stages=3)),
    (GEMV_MAX_ROWS, GemvConfig(64, 256, num_warps=4, num_stages=3)),
]
_W8A8_CUDA_CONFIGS: list[tuple[int, GemvConfig]] = [
    # one row: 16 x 2048 tiles, among the three fastest on qkv, gate_up and down (FP8; session 19's --gemv-sweep)
    (1, GemvConfig(16, 2048, num_warps=4, num_stages=3)),
    (2, GemvConfig(128, 128, num_warps=4, num_stages=3)),
    (GEMV_MAX_ROWS, GemvConfig(128, 128, num_warps=4, num_stages=3)),
]
# Under TRITON_INTERPRET every program runs in Python: small tiles, no split, keep tests fast.
_INTERPRETER_CONFIG = GemvConfig(32, 32, split_k=1, num_warps=1, num_stages=1)
# auto split_k: about this many programs per SM (latency hiding: bytes in flight), per kernel; the H100 figure
# unless _DEVICE_PROGRAMS_PER_SM names the device
_PROGRAMS_PER_SM = 4.0
# measured per device: an H200 (4.1-4.2 TB/s) runs the Llama-3-8B bf16 batch-1 decode step faster with fewer,
# longer programs (docs/BENCHMARKS.md, session 27)
_DEVICE_PROGRAMS_PER_SM: dict[str, dict[str, float]] = {
    "H200": {"dense": 2.0},
}


# Per device and weight shape (out_features, in_features): the one-row W8A8 GEMV configurations that beat the rows'
# table by more than a run's spread at that shape in ``python -m kernels.bench.w8a8 --gemv-sweep --kind fp8`` (H200,
# Llama-3-8B shapes, docs/BENCHMARKS.md session 34: o_proj 9.9 -> 7.7 us, gate_up 34.0 -> 32.7, down 21.8 -> 19.0; qkv
# kept its 10.3; end to end, FP8 batch 1 in one call: 335.1 -> 354.1 tok/s). Shapes not listed take the rows' table.
# KERNELS_SHAPE_CONFIGS=0 leaves every shape table of the kernels out (this one and ``kernels.w4a16_frag``'s), for
# A/B runs.
SHAPE_CONFIGS = os.environ.get("KERNELS_SHAPE_CONFIGS", "1") != "0"
_W8A8_SHAPE_CONFIGS: dict[str, dict[tuple[int, int], GemvConfig]] = {
    "H200": {
        (4096, 4096): GemvConfig(16, 2048, num_warps=8, num_stages=4),
        (28672, 4096): GemvConfig(16, 512, num_warps=4, num_stages=3),
        (4096, 14336): GemvConfig(16, 1024, num_warps=4, num_stages=3, programs_per_sm=2.0),
    },
}


def shape_config(tables: dict[str, dict[tuple, Any]], key: tuple, device: torch.device) -> Any:
    """The entry for ``key`` in the table of ``device``'s kind (a name fragment of the CUDA device, as
    ``_DEVICE_PROGRAMS_PER_SM``), or None: no table for the device, no entry, not CUDA, or KERNELS_SHAPE_CONFIGS=0."""
    if not SHAPE_CONFIGS or device.type != "cuda" or _interpreting():
        return None
    name = _device_name(device.index if device.index is not None else torch.cuda.current_device())
    return next((table[key] for fragment, table in tables.items() if fragment in name and key in table), None)


def _env_programs_per_sm(value: str | None) -> dict[str, float]:
    """KERNELS_GEMV_PROGRAMS_PER_SM (A/B runs): "2" for every GEMV kernel, or "dense=2,w8a8=3" per kernel."""
    if not value:
        return {}
    kernels = ("w4a16", "w8a8", "dense")
    out: dict[str, float] = {}
    for item in value.split(","):
        name, sep, number = item.rpartition("=")
        try:
            target = float(number)
        except ValueError:
            target = 0.0
        if target <= 0 or (sep and name not in kernels):
            raise ValueError(f"KERNELS_GEMV_PROGRAMS_PER_SM={value!r}: expected a positive number, or KERNEL=NUMBER "
                             f"pairs separated by commas with KERNEL one of {', '.join(kernels)}")
        out.update({name: target} if name else dict.fromkeys(kernels, target))
    return out


_ENV_PROGRAMS_PER_SM = _env_programs_per_sm(os.environ.get("KERNELS_GEMV_PROGRAMS_PER_SM"))


def programs_per_sm(kernel: str, device: torch.device) -> float:
    """The auto split-K's target programs per SM for ``kernel`` on ``device``: the environment's, the device's
    (``_DEVICE_PROGRAMS_PER_SM``, by a name fragment of the CUDA device), or ``_PROGRAMS_PER_SM``."""
    if kernel in _ENV_PROGRAMS_PER_SM:
        return _ENV_PROGRAMS_PER_SM[kernel]
    if device.type == "cuda":
        name = _device_name(device.index if device.index is not None else torch.cuda.current_device())
        for fragment, table in _DEVICE_PROGRAMS_PER_SM.items():
            if fragment in name and kernel in table:
                return table[kernel]
    return _PROGRAMS_PER_SM


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:  # read once per device (shape_config runs at every GEMV call outside a graph)
    return torch.cuda.get_device_name(index)


_MAX_SPLIT_K = 32
_MIN_STEPS_PER_SPLIT = 2  # fewer K steps per program and its fixed costs (x's max, the epilogue) dominate
_MIN_COUNTERS = 4096  # tile counters allocated at once (N / BLOCK_N tiles of one launch)
_MIN_ALIGNED_ROWS = 8  # the default config's K step shrinks to this many byte rows to stay in one group


def default_gemv_config(kernel: str, num_rows: int, device: torch.device, bits: int = 4) -> GemvConfig:
    """The table's configuration for ``kernel`` ("w4a16", "w8a8" or "dense") at ``num_rows`` rows; 8-bit w4a16
    weights take half the K step (the same bytes per step)."""
    if _interpreting() or device.type != "cuda":
        return _INTERPRETER_CONFIG
    return _cuda_config(kernel, num_rows, device.index if device.index is not None else torch.cuda.current_device(),
                        bits)


@functools.lru_cache(maxsize=None)
def _cuda_config(kernel: str, num_rows: int, device_index: int, bits: int) -> GemvConfig:
    """``default_gemv_config`` on CUDA, resolved once per argument set (it runs at every GEMV call outside a graph)."""
    table = {"w4a16": _W4A16_CUDA_CONFIGS, "w8a8": _W8A8_CUDA_CONFIGS, "dense": _DENSE_CUDA_CONFIGS}[kernel]
    cfg = next(cfg for bound, cfg in table if num_rows <= bound)
    if kernel == "w4a16" and bits == 8:
        cfg = dataclasses.replace(cfg, block_k=max(cfg.block_k // 2, 16))
    if not cfg.programs_per_sm:
        cfg = dataclasses.replace(cfg, programs_per_sm=programs_per_sm(kernel, torch.device("cuda", device_index)))
    return cfg


# --- kernels ---------------------------------------------------------------------------------------
@triton.jit
def _load_weights(ptrs, mask, MASKED: tl.constexpr):
    """:func:`_load` of weight bytes, with the KERNELS_GEMV_WEIGHT_LOAD cache hints."""
    if MASKED:
        return tl.load(ptrs, mask=mask, other=0.0, cache_modifier=_W_CACHE, eviction_policy=_W_EVICT)
    else:
        return tl.load(ptrs, cache_modifier=_W_CACHE, eviction_policy=_W_EVICT)


@triton.jit
def _load(ptrs, mask, MASKED: tl.constexpr):
    """tl.load, masked (other=0) only where the shapes leave a ragged tile: unmasked loads need no predicates."""
    if MASKED:
        return tl.load(ptrs, mask=mask, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _unit_code(q):
    """1 + q / 16 (fp32, exact) for 4-bit codes q: the code ORed into the mantissa of 1.0."""
    return ((q << 19) | 0x3F800000).to(tl.float32, bitcast=True)


# Per 4 packed bytes: move each byte's low (high) nibble to bits 3..6 and set bit 7 (shl/shr + lop3), then put
# that byte under 0x3F (prmt): 0x3F800000 | q << 19 = 1 + q / 16. 1.5 instructions per code.
_UNPACK_PTX = tl.constexpr("""
{
.reg .b32 t, k;
mov.b32 k, 0x3F000000;
shl.b32 t, $8, 3;
lop3.b32 t, t, 0x78787878, 0x80808080, 0xea;
prmt.b32 $0, t, k, 0x7054;
prmt.b32 $1, t, k, 0x7154;
prmt.b32 $2, t, k, 0x7254;
prmt.b32 $3, t, k, 0x7354;
shr.u32 t, $8, 1;
lop3.b32 t, t, 0x78787878, 0x80808080, 0xea;
prmt.b32 $4, t, k, 0x7054;
prmt.b32 $5, t, k, 0x7154;
prmt.b32 $6, t, k, 0x7254;
prmt.b32 $7, t, k, 0x7354;
}
""")


@triton.jit
def _unpack_nibbles(b, PTX: tl.constexpr):
    """uint8 bytes -> (1 + low nibble / 16, 1 + high nibble / 16) fp32 (``_unit_code``), in PTX on the GPU:
    from the plain version ptxas makes 3 integer instructions per code."""
    if PTX:
        return tl.inline_asm_elementwise(_UNPACK_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [b],
                                         dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
    else:
        q = b.to(tl.int32)
        return _unit_code(q & 0xF), _unit_code(q >> 4)


@triton.jit
def _dequant_consts(s_ptr, z_ptr, first_k, row_k, offs_n, mask, mask_n, group_size, stride_sz,
                    BITS: tl.constexpr, PER_TILE: tl.constexpr):
    """The group constants (a, b) of codes of input features ``row_k`` (the first ``first_k``), [1, BLOCK_N]
    when they lie in one group (PER_TILE), else gathered per (k, n). 4 bits: (16 * scale, 16 * scale + zero *
    scale), with which (q - zero) * scale = (1 + q / 16) * a - b; 8 bits: (scale, zero * scale) of ``_dequant``."""
    s, zs = _group_params(s_ptr, z_ptr, first_k, row_k, offs_n, mask, mask_n, group_size, stride_sz, True, PER_TILE)
    if BITS == 4:
        return 16.0 * s, 16.0 * s + zs
    else:
        return s, zs


@triton.jit
def _fma_row(acc, x_row, offs_r, half_k, mask_r, w, w_hi, BITS: tl.constexpr, MASKED: tl.constexpr):
    """acc + one row of x times the dequantized weights, per (byte row, n): [T, BLOCK_N] fp32. 4 bits: w (low
    nibbles) pairs with x[offs_r], w_hi (high nibbles) with x[half_k + offs_r]; 8 bits: w with x[offs_r]."""
    acc += w * _load(x_row + offs_r, mask_r, MASKED).to(tl.float32)[:, None]
    if BITS == 4:
        acc += w_hi * _load(x_row + half_k + offs_r, mask_r, MASKED).to(tl.float32)[:, None]
    return acc


@triton.jit
def _w4a16_pass(acc0, acc1, acc2, acc3, x_ptr, stride_xm, qw_ptr, stride_qw, offs_r, offs_n, mask_n, num_byte_rows,
                half_k, a, b, a_hi, b_hi, ROWS: tl.constexpr, BITS: tl.constexpr, PTX: tl.constexpr,
                EVEN_N: tl.constexpr, EVEN_R: tl.constexpr):
    """The accumulators [T, BLOCK_N] plus the products of byte rows ``offs_r`` [T] with the rows of x, the codes
    dequantized with their group constants (``_dequant_consts``)."""
    mask_r = offs_r < num_byte_rows
    ptrs = qw_ptr + offs_r[:, None] * stride_qw + offs_n[None, :]
    bytes_ = _load(ptrs, mask_r[:, None] & mask_n[None, :], not (EVEN_N and EVEN_R))  # [T, BLOCK_N] uint8
    if BITS == 4:
        u, u_hi = _unpack_nibbles(bytes_, PTX)
        w = u * a - b  # (q - zero) * scale in one FMA
        w_hi = u_hi * a_hi - b_hi
    else:
        w = _dequant(bytes_.to(tl.int32), a, b)
        w_hi = w
    acc0 = _fma_row(acc0, x_ptr, offs_r, half_k, mask_r, w, w_hi, BITS, not EVEN_R)
    if ROWS > 1:
        acc1 = _fma_row(acc1, x_ptr + stride_xm, offs_r, half_k, mask_r, w, w_hi, BITS, not EVEN_R)
    if ROWS > 2:
        acc2 = _fma_row(acc2, x_ptr + 2 * stride_xm, offs_r, half_k, mask_r, w, w_hi, BITS, not EVEN_R)
    if ROWS > 3:
        acc3 = _fma_row(acc3, x_ptr + 3 * stride_xm, offs_r, half_k, mask_r, w, w_hi, BITS, not EVEN_R)
    return acc0, acc1, acc2, acc3


@triton.jit
def _store_row(y_row, val, bias_ptr, offs_n, mask_n, HAS_BIAS: tl.constexpr):
    """y_row[offs_n] = val (fp32) + bias, in y's dtype."""
    if HAS_BIAS:
        val += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(y_row + offs_n, val.to(y_row.dtype.element_ty), mask=mask_n)


@triton.jit
def _arrive(counter_ptr, SPLIT_K: tl.constexpr):
    """Counts this program in on its tile's counter; true in the last of the tile's SPLIT_K programs, which then
    sees every program's partial sums. The barrier orders all threads' partial stores before the (one thread's,
    acquire-release, GPU-scope) increment."""
    tl.debug_barrier()
    return tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1


@triton.jit
def _split_sum(part_ptr, row, offs_n, mask_n, N, ROWS: tl.constexpr, SPLIT_K: tl.constexpr):
    """Sum of row ``row``'s partials over the splits, in split order; part: [SPLIT_K, ROWS, N] (read from L2,
    past L1, where other SMs wrote them)."""
    tot = tl.load(part_ptr + row * N + offs_n, mask=mask_n, other=0, cache_modifier=".cg")
    for s in range(1, SPLIT_K):
        tot += tl.load(part_ptr + (s * ROWS + row) * N + offs_n, mask=mask_n, other=0, cache_modifier=".cg")
    return tot


@triton.jit
def _sums_epilogue(acc0, acc1, acc2, acc3, y_ptr, part_ptr, counter_ptr, bias_ptr, offs_n, mask_n, N, pid_n, pid_k,
                   AXIS: tl.constexpr, ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                   REDUCE_IN_KERNEL: tl.constexpr):
    """y's rows = each row accumulator summed over AXIS (+ bias), stored at once (one split) or as this split's
    partial sums [SPLIT_K, ROWS, N], which the tile's last program adds in split order (REDUCE_IN_KERNEL; else
    ``reduce_split_k`` does, in a second launch)."""
    if SPLIT_K == 1:
        _store_row(y_ptr, tl.sum(acc0, axis=AXIS), bias_ptr, offs_n, mask_n, HAS_BIAS)
        if ROWS > 1:
            _store_row(y_ptr + N, tl.sum(acc1, axis=AXIS), bias_ptr, offs_n, mask_n, HAS_BIAS)
        if ROWS > 2:
            _store_row(y_ptr + 2 * N, tl.sum(acc2, axis=AXIS), bias_ptr, offs_n, mask_n, HAS_BIAS)
        if ROWS > 3:
            _store_row(y_ptr + 3 * N, tl.sum(acc3, axis=AXIS), bias_ptr, offs_n, mask_n, HAS_BIAS)
    else:
        part = part_ptr + pid_k * ROWS * N + offs_n  # this split's partial sums [ROWS, N]
        tl.store(part, tl.sum(acc0, axis=AXIS), mask=mask_n)
        if ROWS > 1:
            tl.store(part + N, tl.sum(acc1, axis=AXIS), mask=mask_n)
        if ROWS > 2:
            tl.store(part + 2 * N, tl.sum(acc2, axis=AXIS), mask=mask_n)
        if ROWS > 3:
            tl.store(part + 3 * N, tl.sum(acc3, axis=AXIS), mask=mask_n)
        if REDUCE_IN_KERNEL:
            if _arrive(counter_ptr + pid_n, SPLIT_K):
                tl.store(counter_ptr + pid_n, 0)  # zero again for the next launch
                for row in tl.static_range(ROWS):
                    _store_row(y_ptr + row * N, _split_sum(part_ptr, row, offs_n, mask_n, N, ROWS, SPLIT_K),
                               bias_ptr, offs_n, mask_n, HAS_BIAS)


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, part_ptr, counter_ptr,
    N, K, group_size, steps_per_split,
    stride_xm, stride_qw, stride_sz,  # qweight's byte rows, scales' / zeros' groups
    ROWS: tl.constexpr, BITS: tl.constexpr, PER_TILE: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr, REDUCE_IN_KERNEL: tl.constexpr, PTX: tl.constexpr, EVEN_N: tl.constexpr,
    EVEN_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, T: tl.constexpr, NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    # x: [ROWS, K] -> y: [ROWS, N] contiguous. A K step is BLOCK_R byte rows of qweight, walked in passes of T
    # rows (one pass of the program's threads over [T, BLOCK_N]) into [T, BLOCK_N] accumulators: the step's group
    # constants serve its BLOCK_R / T passes.
    wait_prior(PDL)  # before reading what the previous kernel wrote (kernels/pdl.py)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    num_byte_rows = K * BITS // 8
    half_k = K // 2
    acc0 = tl.zeros((T, BLOCK_N), dtype=tl.float32)  # one accumulator per row of x
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    first_step = pid_k * steps_per_split
    num_steps = min(steps_per_split, tl.cdiv(num_byte_rows, BLOCK_R) - first_step)
    for step in tl.range(0, num_steps, num_stages=NUM_STAGES):
        r0 = (first_step + step) * BLOCK_R
        if PER_TILE:  # the step (each nibble half) lies in one group: constants per column, once per step
            a, b = _dequant_consts(s_ptr, z_ptr, r0, r0, offs_n, mask_n, mask_n, group_size, stride_sz, BITS, True)
            a_hi, b_hi = a, b
            if BITS == 4:
                a_hi, b_hi = _dequant_consts(s_ptr, z_ptr, r0 + half_k, r0, offs_n, mask_n, mask_n, group_size,
                                             stride_sz, BITS, True)
        for p in tl.static_range(BLOCK_R // T):
            offs_r = r0 + p * T + tl.arange(0, T)
            if not PER_TILE:
                mask_w = (offs_r < num_byte_rows)[:, None] & mask_n[None, :]
                a, b = _dequant_consts(s_ptr, z_ptr, r0, offs_r, offs_n, mask_w, mask_n, group_size, stride_sz,
                                       BITS, False)
                a_hi, b_hi = a, b
                if BITS == 4:
                    a_hi, b_hi = _dequant_consts(s_ptr, z_ptr, r0, offs_r + half_k, offs_n, mask_w, mask_n,
                                                 group_size, stride_sz, BITS, False)
            acc0, acc1, acc2, acc3 = _w4a16_pass(acc0, acc1, acc2, acc3, x_ptr, stride_xm, qw_ptr, stride_qw, offs_r,
                                                 offs_n, mask_n, num_byte_rows, half_k, a, b, a_hi, b_hi, ROWS, BITS,
                                                 PTX, EVEN_N, EVEN_R)

    _sums_epilogue(acc0, acc1, acc2, acc3, y_ptr, part_ptr, counter_ptr, bias_ptr, offs_n, mask_n, N, pid_n, pid_k,
                   0, ROWS, HAS_BIAS, SPLIT_K, REDUCE_IN_KERNEL)


@triton.jit
def _absmax(x_row, offs, mask, amax):
    return tl.maximum(amax, tl.abs(tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)))


@triton.jit
def _quantize_step(x_row, offs_k, mask_k, x_scale, x_rcp, qmax, qmin, INT8: tl.constexpr, EMULATE_FP8: tl.constexpr,
                   MASKED: tl.constexpr, PREQUANT: tl.constexpr, EXACT: tl.constexpr):
    """One row's x step [BLOCK_K] quantized with ``x_scale`` (``x_rcp``: its reciprocal, correctly rounded) as the
    reference does, clamped to ``qmin``..``qmax``: int8 codes as int32, E4M3 values as fp32 (0 where masked).
    PREQUANT: x holds the codes already. EXACT: the reference's IEEE quotient (``div_exact``), else Triton's fp32
    ``/``, approximate on the GPU: a value within an ulp of a rounding boundary may take the neighbouring code."""
    if PREQUANT:
        if INT8:
            return _load(x_row + offs_k, mask_k, MASKED).to(tl.int32)
        else:
            return _load(x_row + offs_k, mask_k, MASKED).to(tl.float32)
    a = _load(x_row + offs_k, mask_k, MASKED).to(tl.float32)
    if EXACT:
        v = tl.minimum(tl.maximum(div_exact(a, x_scale, x_rcp), qmin), qmax)
    else:
        v = tl.minimum(tl.maximum(a / x_scale, qmin), qmax)
    if INT8:
        return (v + _MAGIC).to(tl.int32, bitcast=True) - 0x4B400000  # bits of 1.5 * 2^23 + code, ties to even
    elif EMULATE_FP8:
        return _round_e4m3(v)
    else:
        return v.to(tl.float8e4nv).to(tl.float32)


@triton.jit
def _dot_chunks(acc, w, q, VEC: tl.constexpr):
    """acc [BLOCK_N, BLOCK_K / VEC] + the products w [BLOCK_N, BLOCK_K] * q [BLOCK_K] summed over each run of VEC
    input features: a thread's contiguous codes (one vector load), so the sums stay in registers."""
    prod = w * q[None, :]
    return acc + tl.sum(tl.reshape(prod, (prod.shape[0], prod.shape[1] // VEC, VEC)), axis=2)


@triton.jit
def _scaled(total, x_scale, w_scale):
    """The reference's order: float(sum) * x_scale * weight_scale."""
    return total.to(tl.float32) * x_scale * w_scale


@triton.jit
def _w8a8_gemv_kernel(
    x_ptr, w_ptr, ws_ptr, xs_ptr, bias_ptr, y_ptr, part_ptr, counter_ptr,
    N, K, steps_per_split,
    stride_xm, stride_wn,
    ROWS: tl.constexpr, INT8: tl.constexpr, STATIC: tl.constexpr, PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, REDUCE_IN_KERNEL: tl.constexpr, EMULATE_FP8: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
    AMAX_BLOCK: tl.constexpr, NUM_STAGES: tl.constexpr, PREQUANT: tl.constexpr, PREFETCH_ROWS: tl.constexpr,
    PREFETCH_LINES: tl.constexpr, PDL: tl.constexpr, QMIN: tl.constexpr,
):
    # x: [ROWS, K], w: [N, K] -> y: [ROWS, N] contiguous. A K step quantizes each row's x step once and multiplies
    # it by the [BLOCK_N, BLOCK_K] weight tile into [BLOCK_N, BLOCK_K / VEC] accumulators (``_dot_chunks``).
    # The quotient x / x_scale: with a STATIC scale (a calibration's or an export's, which define the codes) the
    # reference's IEEE one (``div_exact``); with per-token scales Triton's approximate ``/`` (every program quantizes
    # its whole K range, so div_exact's two more operations per element cost 9% on Llama-3-8B's FP8 gate_up at one
    # row on the H200, 32.7 -> 35.6 us): a value within an ulp of a rounding boundary may take the neighbouring code.
    # PREQUANT: x is already codes (a norm quantized it, ``QuantizedRows``) and xs_ptr its per-row scales. QMIN: the
    # lowest code (fp32): -qmax, or -128.0 for int8 codes that take the full range (act_qmin -128)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    qmax, eps = _qrange(INT8)
    first_step = pid_k * steps_per_split
    if PDL and PREFETCH_ROWS > 0:  # weights are constants: ask for the first step's tile before the wait
        prefetch_l2_rows(w_ptr + (pid_n * BLOCK_N) * stride_wn + first_step * BLOCK_K, stride_wn,
                         N - pid_n * BLOCK_N, K - first_step * BLOCK_K, PREFETCH_ROWS, PREFETCH_LINES, 128)
    wait_prior(PDL)  # before reading what the previous kernel wrote (kernels/pdl.py)

    # x_scale per row: the static calibrated scale, the quantizing norm's, or max|x_row| / qmax over all of K
    if PREQUANT:
        xs0 = tl.load(xs_ptr)
        xs1 = xs0
        xs2 = xs0
        xs3 = xs0
        if ROWS > 1:
            xs1 = tl.load(xs_ptr + 1)
        if ROWS > 2:
            xs2 = tl.load(xs_ptr + 2)
        if ROWS > 3:
            xs3 = tl.load(xs_ptr + 3)
    elif STATIC:
        xs0 = tl.load(xs_ptr).to(tl.float32)
        xs1 = xs0
        xs2 = xs0
        xs3 = xs0
    else:
        m0 = tl.zeros((AMAX_BLOCK,), dtype=tl.float32)
        m1 = m0
        m2 = m0
        m3 = m0
        for k0 in tl.range(0, K, AMAX_BLOCK, num_stages=NUM_STAGES):
            offs = k0 + tl.arange(0, AMAX_BLOCK)
            mask = offs < K
            m0 = _absmax(x_ptr, offs, mask, m0)
            if ROWS > 1:
                m1 = _absmax(x_ptr + stride_xm, offs, mask, m1)
            if ROWS > 2:
                m2 = _absmax(x_ptr + 2 * stride_xm, offs, mask, m2)
            if ROWS > 3:
                m3 = _absmax(x_ptr + 3 * stride_xm, offs, mask, m3)
        # IEEE divisions, as the reference's (Triton's ``/`` is approximate on the GPU)
        xs0 = tl.math.div_rn(tl.maximum(tl.max(m0, axis=0), eps), qmax)
        xs1 = tl.math.div_rn(tl.maximum(tl.max(m1, axis=0), eps), qmax)
        xs2 = tl.math.div_rn(tl.maximum(tl.max(m2, axis=0), eps), qmax)
        xs3 = tl.math.div_rn(tl.maximum(tl.max(m3, axis=0), eps), qmax)
    xr0 = tl.math.div_rn(xs0 * 0.0 + 1.0, xs0)  # reciprocals for div_exact, once per row
    xr1 = tl.math.div_rn(xs1 * 0.0 + 1.0, xs1)
    xr2 = tl.math.div_rn(xs2 * 0.0 + 1.0, xs2)
    xr3 = tl.math.div_rn(xs3 * 0.0 + 1.0, xs3)

    if INT8:
        acc0 = tl.zeros((BLOCK_N, BLOCK_K // VEC), dtype=tl.int32)
    else:
        acc0 = tl.zeros((BLOCK_N, BLOCK_K // VEC), dtype=tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    num_steps = min(steps_per_split, tl.cdiv(K, BLOCK_K) - first_step)
    for step in tl.range(0, num_steps, num_stages=NUM_STAGES):
        offs_k = (first_step + step) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        w = _load_weights(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask_n[:, None] & mask_k[None, :],
                  not (EVEN_N and EVEN_K))  # [BLOCK_N, BLOCK_K]
        if INT8:
            w = w.to(tl.int32)
        else:
            w = w.to(tl.float32)
        acc0 = _dot_chunks(acc0, w, _quantize_step(x_ptr, offs_k, mask_k, xs0, xr0, qmax, QMIN, INT8, EMULATE_FP8,
                                                   not EVEN_K, PREQUANT, STATIC), VEC)
        if ROWS > 1:
            acc1 = _dot_chunks(acc1, w, _quantize_step(x_ptr + stride_xm, offs_k, mask_k, xs1, xr1, qmax, QMIN, INT8,
                                                       EMULATE_FP8, not EVEN_K, PREQUANT, STATIC), VEC)
        if ROWS > 2:
            acc2 = _dot_chunks(acc2, w, _quantize_step(x_ptr + 2 * stride_xm, offs_k, mask_k, xs2, xr2, qmax, QMIN,
                                                       INT8,
                                                       EMULATE_FP8, not EVEN_K, PREQUANT, STATIC), VEC)
        if ROWS > 3:
            acc3 = _dot_chunks(acc3, w, _quantize_step(x_ptr + 3 * stride_xm, offs_k, mask_k, xs3, xr3, qmax, QMIN,
                                                       INT8,
                                                       EMULATE_FP8, not EVEN_K, PREQUANT, STATIC), VEC)

    if PER_CHANNEL:
        w_scale = tl.load(ws_ptr + offs_n, mask=mask_n, other=0.0)
    else:
        w_scale = tl.load(ws_ptr)
    if SPLIT_K == 1:
        _store_row(y_ptr, _scaled(tl.sum(acc0, axis=1), xs0, w_scale), bias_ptr, offs_n, mask_n, HAS_BIAS)
        if ROWS > 1:
            _store_row(y_ptr + N, _scaled(tl.sum(acc1, axis=1), xs1, w_scale), bias_ptr, offs_n, mask_n, HAS_BIAS)
        if ROWS > 2:
            _store_row(y_ptr + 2 * N, _scaled(tl.sum(acc2, axis=1), xs2, w_scale), bias_ptr, offs_n, mask_n,
                       HAS_BIAS)
        if ROWS > 3:
            _store_row(y_ptr + 3 * N, _scaled(tl.sum(acc3, axis=1), xs3, w_scale), bias_ptr, offs_n, mask_n,
                       HAS_BIAS)
    elif REDUCE_IN_KERNEL:
        # unscaled partial sums (int32 for INT8: exact), scaled once by the last program, as the reference does
        part = part_ptr + pid_k * ROWS * N + offs_n
        tl.store(part, tl.sum(acc0, axis=1), mask=mask_n)
        if ROWS > 1:
            tl.store(part + N, tl.sum(acc1, axis=1), mask=mask_n)
        if ROWS > 2:
            tl.store(part + 2 * N, tl.sum(acc2, axis=1), mask=mask_n)
        if ROWS > 3:
            tl.store(part + 3 * N, tl.sum(acc3, axis=1), mask=mask_n)
        if _arrive(counter_ptr + pid_n, SPLIT_K):
            tl.store(counter_ptr + pid_n, 0)  # zero again for the next launch
            _store_row(y_ptr, _scaled(_split_sum(part_ptr, 0, offs_n, mask_n, N, ROWS, SPLIT_K), xs0, w_scale),
                       bias_ptr, offs_n, mask_n, HAS_BIAS)
            if ROWS > 1:
                _store_row(y_ptr + N, _scaled(_split_sum(part_ptr, 1, offs_n, mask_n, N, ROWS, SPLIT_K), xs1,
                                              w_scale), bias_ptr, offs_n, mask_n, HAS_BIAS)
            if ROWS > 2:
                _store_row(y_ptr + 2 * N, _scaled(_split_sum(part_ptr, 2, offs_n, mask_n, N, ROWS, SPLIT_K), xs2,
                                                  w_scale), bias_ptr, offs_n, mask_n, HAS_BIAS)
            if ROWS > 3:
                _store_row(y_ptr + 3 * N, _scaled(_split_sum(part_ptr, 3, offs_n, mask_n, N, ROWS, SPLIT_K), xs3,
                                                  w_scale), bias_ptr, offs_n, mask_n, HAS_BIAS)
    else:  # scaled fp32 partial sums for reduce_split_k (which adds the bias)
        part = part_ptr + pid_k * ROWS * N + offs_n
        tl.store(part, _scaled(tl.sum(acc0, axis=1), xs0, w_scale), mask=mask_n)
        if ROWS > 1:
            tl.store(part + N, _scaled(tl.sum(acc1, axis=1), xs1, w_scale), mask=mask_n)
        if ROWS > 2:
            tl.store(part + 2 * N, _scaled(tl.sum(acc2, axis=1), xs2, w_scale), mask=mask_n)
        if ROWS > 3:
            tl.store(part + 3 * N, _scaled(tl.sum(acc3, axis=1), xs3, w_scale), mask=mask_n)


@triton.jit
def _dense_x_step(x_row, offs_k, mask_k, K, GATED: tl.constexpr, MASKED: tl.constexpr):
    """One row's x step [BLOCK_K] as fp32; GATED: x is a row [gate | up] of 2K features and the step is
    ``silu(gate) * up`` as ``kernels.activation.silu_mul`` rounds it (bit for bit)."""
    if GATED:
        g = _load(x_row + offs_k, mask_k, MASKED)
        u = _load(x_row + K + offs_k, mask_k, MASKED)
        return silu_mul_values(g, u).to(tl.float32)
    else:
        return _load(x_row + offs_k, mask_k, MASKED).to(tl.float32)


@triton.jit
def _dense_gemv_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, counter_ptr,
    N, K, steps_per_split, stride_xm, stride_wn,
    ROWS: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
    NUM_STAGES: tl.constexpr, PREFETCH_ROWS: tl.constexpr, PREFETCH_LINES: tl.constexpr,
    ELEMS_PER_LINE: tl.constexpr, PDL: tl.constexpr,
):
    # x: [ROWS, K] (GATED: [ROWS, 2K]) -> y: [ROWS, N] contiguous; w: [N, K] rows contiguous over K. A program
    # streams [BLOCK_N, BLOCK_K] weight tiles of its K range (16-byte vector loads along K), the products summed per
    # thread's run of VEC features into [BLOCK_N, BLOCK_K / VEC] fp32 accumulators, reduced once at the end.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    first_step = pid_k * steps_per_split
    num_steps = min(steps_per_split, tl.cdiv(K, BLOCK_K) - first_step)
    if PDL and PREFETCH_ROWS > 0:  # weights are constants: ask for the first step's tile before the wait
        prefetch_l2_rows(w_ptr + (pid_n * BLOCK_N) * stride_wn + first_step * BLOCK_K, stride_wn,
                         N - pid_n * BLOCK_N, K - first_step * BLOCK_K, PREFETCH_ROWS, PREFETCH_LINES,
                         ELEMS_PER_LINE)
    wait_prior(PDL)  # before reading what the previous kernel wrote (kernels/pdl.py)
    acc0 = tl.zeros((BLOCK_N, BLOCK_K // VEC), dtype=tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    for step in tl.range(0, num_steps, num_stages=NUM_STAGES):
        offs_k = (first_step + step) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        w = _load_weights(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask_n[:, None] & mask_k[None, :],
                  not (EVEN_N and EVEN_K)).to(tl.float32)  # [BLOCK_N, BLOCK_K]
        acc0 = _dot_chunks(acc0, w, _dense_x_step(x_ptr, offs_k, mask_k, K, GATED, not EVEN_K), VEC)
        if ROWS > 1:
            acc1 = _dot_chunks(acc1, w, _dense_x_step(x_ptr + stride_xm, offs_k, mask_k, K, GATED, not EVEN_K), VEC)
        if ROWS > 2:
            acc2 = _dot_chunks(acc2, w, _dense_x_step(x_ptr + 2 * stride_xm, offs_k, mask_k, K, GATED, not EVEN_K),
                               VEC)
        if ROWS > 3:
            acc3 = _dot_chunks(acc3, w, _dense_x_step(x_ptr + 3 * stride_xm, offs_k, mask_k, K, GATED, not EVEN_K),
                               VEC)

    _sums_epilogue(acc0, acc1, acc2, acc3, y_ptr, part_ptr, counter_ptr, bias_ptr, offs_n, mask_n, N, pid_n, pid_k,
                   1, ROWS, HAS_BIAS, SPLIT_K, True)

# --- host side -------------------------------------------------------------------------------------
_COUNTERS: dict[tuple[str, int | None], torch.Tensor] = {}
_RETIRED_COUNTERS: list[torch.Tensor] = []  # outgrown buffers a captured CUDA graph may still point at


def _tile_counters(device: torch.device, num_tiles: int) -> torch.Tensor:
    """The device's int32 tile counters (module docstring), at least ``num_tiles`` of them, all zero."""
    key = (device.type, device.index)
    counters = _COUNTERS.get(key)
    if counters is None or counters.numel() < num_tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"the GEMV kernels' split-K counters for {num_tiles} tiles on {device} are "
                               "first needed inside a CUDA-graph capture; call the kernel once before capturing")
        if counters is not None:
            _RETIRED_COUNTERS.append(counters)
        counters = torch.zeros(max(_MIN_COUNTERS, triton.next_power_of_2(num_tiles)), dtype=torch.int32,
                               device=device)
        _COUNTERS[key] = counters
    return counters


def _check_config(cfg: GemvConfig, min_block_n: int, min_block_k: int) -> None:
    for name in ("block_n", "block_k"):
        value = getattr(cfg, name)
        assert value >= 1 and value & (value - 1) == 0, f"{cfg}: {name} must be a power of 2"
    assert cfg.block_n >= min_block_n and cfg.block_k >= min_block_k, \
        f"{cfg}: block_n must be >= {min_block_n}, block_k >= {min_block_k}"
    assert cfg.split_k >= 0, f"{cfg}: split_k must be >= 0 (0 = auto)"


def _check_rows(name: str, x: torch.Tensor, num_rows: int) -> None:
    if num_rows > GEMV_MAX_ROWS:
        raise ValueError(f"{name} takes at most GEMV_MAX_ROWS = {GEMV_MAX_ROWS} rows of x, got {num_rows} "
                         f"(x {tuple(x.shape)}); use the GEMM kernels for more")


@dataclass
class _SplitPlan:
    """How one launch splits K, and where its partial sums go."""

    grid: tuple[int, int]  # (N tiles, split_k)
    split_k: int
    steps_per_split: int  # K steps per program; the last split may have fewer, none has none
    part: torch.Tensor  # [split_k, M, N] partial sums (y itself when split_k == 1: never read)
    counters: torch.Tensor  # the tile counters (y when unused)


def auto_split_k(num_tiles: int, num_steps: int, programs_per_sm: float, num_sms: int) -> int:
    """Programs sharing each output tile's K range when the configuration leaves it to the launch: enough for about
    ``programs_per_sm`` programs per SM over ``num_tiles`` tiles, at least _MIN_STEPS_PER_SPLIT of the ``num_steps``
    K steps each, at most _MAX_SPLIT_K; then evened out so that no program gets no K step."""
    split_k = min(triton.cdiv(int(programs_per_sm * num_sms), num_tiles), num_steps // _MIN_STEPS_PER_SPLIT,
                  _MAX_SPLIT_K)
    split_k = max(1, min(split_k, num_steps))
    return triton.cdiv(num_steps, triton.cdiv(num_steps, split_k))


def split_target(cfg: Any) -> float:
    """The programs per SM an auto split aims at for a launch configuration: its ``programs_per_sm`` (a
    GemvConfig's, filled in by ``default_gemv_config``), else _PROGRAMS_PER_SM (kernels.w4a16_mma's MmaConfig has
    none of its own)."""
    return getattr(cfg, "programs_per_sm", 0.0) or _PROGRAMS_PER_SM


def _split_plan(y: torch.Tensor, num_steps: int, cfg: GemvConfig, acc_dtype: torch.dtype) -> _SplitPlan:
    """Split K over programs: ``cfg.split_k``, or enough for about _PROGRAMS_PER_SM programs per SM."""
    num_rows, n = y.shape
    num_tiles = triton.cdiv(n, cfg.block_n)
    split_k = cfg.split_k
    if not split_k:
        split_k = 1
        if y.device.type == "cuda":
            device_index = y.device.index if y.device.index is not None else torch.cuda.current_device()
            split_k = auto_split_k(num_tiles, num_steps, split_target(cfg), _num_sms(device_index))
    split_k = max(1, min(split_k, num_steps))
    steps_per_split = triton.cdiv(num_steps, split_k)
    split_k = triton.cdiv(num_steps, steps_per_split)
    if split_k == 1:
        return _SplitPlan((num_tiles, 1), 1, steps_per_split, y, y)
    if not cfg.reduce_in_kernel:
        acc_dtype = torch.float32  # reduce_split_k's input
    part = torch.empty((split_k, num_rows, n), dtype=acc_dtype, device=y.device)
    counters = _tile_counters(y.device, num_tiles) if cfg.reduce_in_kernel else y
    return _SplitPlan((num_tiles, split_k), split_k, steps_per_split, part, counters)


def _finish_split(plan: _SplitPlan, cfg: GemvConfig, bias: torch.Tensor | None, y: torch.Tensor) -> None:
    if plan.split_k > 1 and not cfg.reduce_in_kernel:
        reduce_split_k(plan.part, bias if bias is not None else y, y, plan.split_k, bias is not None)


def _fit_block_k(block_k: int, bits: int, group_size: int, in_features: int) -> int:
    """The default config's K step, halved (down to _MIN_ALIGNED_ROWS byte rows) until every step lies in
    one quantization group: one scale and zero per column, not gathered per (k, n)."""
    def aligned(bk: int) -> bool:
        rows = bk // 2 if bits == 4 else bk
        return group_size % rows == 0 and (bits == 8 or (in_features // 2) % rows == 0)

    bk = block_k
    while not aligned(bk) and (bk // 2 if bits == 4 else bk) > _MIN_ALIGNED_ROWS:
        bk //= 2
    return bk if aligned(bk) else block_k


def _rows_per_pass(block_rows: int, block_cols: int, num_warps: int) -> int:
    """Rows of a [rows, block_cols] byte tile that one pass of the program's threads covers: Triton gives each
    thread 16 contiguous bytes of a row (one vector load), so 32 * num_warps threads cover 512 * num_warps
    bytes."""
    return min(block_rows, max(1, 512 * num_warps // block_cols))


def w4a16_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               group_size: int, bias: torch.Tensor | None = None, *, bits: int = 4, layout: str = "k_major",
               config: GemvConfig | None = None) -> torch.Tensor:
    """``x @ ((q - zero) * scale).T + bias`` for at most ``GEMV_MAX_ROWS`` rows of x, on
    :func:`kernels.w4a16_gemm.repack_w4a16`'s weights (``w4a16_gemv(x, **repacked)``: the keyword arguments
    of ``w4a16_linear``; ``layout`` must be ``"k_major"``); 4 or 8 bits.

    x: [..., K] fp16/bf16/fp32 with prod(leading dims) <= GEMV_MAX_ROWS -> y: [..., N] in x's dtype (fp32
    products and sums, as ``ref_w4a16_linear``). ``config`` forces a configuration (benchmarks and tests).
    """
    if layout != "k_major":
        raise ValueError(f"w4a16_gemv takes the 'k_major' layout (kernels.w4a16_gemm.repack_w4a16), not {layout!r}")
    w, x2 = _check_w4a16_inputs(x, qweight, scales, zeros, group_size, bias, bits, layout)
    num_rows, n = x2.shape[0], w.out_features
    _check_rows("w4a16_gemv", x, num_rows)
    y = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return y.reshape(*x.shape[:-1], n)

    cfg = config
    if cfg is None:
        cfg = default_gemv_config("w4a16", num_rows, x.device, bits)
        cfg = dataclasses.replace(cfg, block_k=_fit_block_k(cfg.block_k, bits, w.group_size, w.in_features))
    _check_config(cfg, 16, 2 if bits == 4 else 1)  # 16: a thread's vector of bytes (_rows_per_pass, PTX unpacking)
    block_r = cfg.block_k // 2 if bits == 4 else cfg.block_k  # byte rows per K step
    num_byte_rows = w.in_features * bits // 8
    # A step's codes lie in one group (one scale per column) when group-aligned; the high nibbles' rows start
    # at K/2 + j0, so K/2 must keep them aligned too.
    per_tile = w.group_size % block_r == 0 and (bits == 8 or (w.in_features // 2) % block_r == 0)
    plan = _split_plan(y, triton.cdiv(num_byte_rows, block_r), cfg, torch.float32)
    _w4a16_gemv_kernel[plan.grid](
        x2, w.qweight, w.scales, w.zeros, bias if bias is not None else y, y, plan.part, plan.counters,
        n, w.in_features, w.group_size, plan.steps_per_split,
        x2.stride(0), w.qw_stride, w.sz_stride,
        ROWS=num_rows, BITS=bits, PER_TILE=per_tile, HAS_BIAS=bias is not None, SPLIT_K=plan.split_k,
        REDUCE_IN_KERNEL=cfg.reduce_in_kernel, PTX=not _interpreting(), EVEN_N=n % cfg.block_n == 0,
        EVEN_R=num_byte_rows % block_r == 0, BLOCK_N=cfg.block_n, BLOCK_R=block_r,
        T=_rows_per_pass(block_r, cfg.block_n, cfg.num_warps), NUM_STAGES=cfg.num_stages,
        num_warps=cfg.num_warps, **pdl_args(x2))
    _finish_split(plan, cfg, bias, y)
    return y.reshape(*x.shape[:-1], n)


def w8a8_gemv(x: torch.Tensor | QuantizedRows, qweight: torch.Tensor, weight_scale: torch.Tensor,
              input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None, *,
              out_dtype: torch.dtype | None = None, config: GemvConfig | None = None,
              act_qmin: int = -127) -> torch.Tensor:
    """:func:`kernels.w8a8_gemm.w8a8_linear` (INT8 when ``qweight`` is int8, FP8 when float8_e4m3fn) for at
    most ``GEMV_MAX_ROWS`` rows of x: the activation quantized per token (``input_scale`` None) or with the
    static ``input_scale`` [1] inside the kernel, exactly as ``ref_w8a8_linear``; or taken as quantized
    (``QuantizedRows``, codes in qweight's dtype and per-row scales, as a quantizing norm writes them).

    x: [..., K] fp16/bf16/fp32 with prod(leading dims) <= GEMV_MAX_ROWS -> y: [..., N] in x's dtype (for
    QuantizedRows: ``out_dtype``, default bf16). ``config`` forces a configuration (benchmarks and tests).
    ``act_qmin``: the lowest int8 activation code, -127 or -128 (rows already quantized keep their codes).
    """
    qmin = act_qmin_arg("w8a8_gemv", qweight, act_qmin)
    prequant = isinstance(x, QuantizedRows)
    if prequant:
        if input_scale is not None:
            raise ValueError("w8a8_gemv: quantized rows come with their own per-token scales; this linear has a "
                             "static input_scale")
        if x.codes.dtype != qweight.dtype:
            raise ValueError(f"w8a8_gemv: the rows' codes are {x.codes.dtype}, the weight's {qweight.dtype}")
        # contiguous: a static scale comes expanded over the rows (stride 0)
        scales, out_dtype = x.scales.reshape(-1).float().contiguous(), out_dtype or torch.bfloat16
        x = x.codes
        qweight, x2 = _check_w8a8_inputs("w8a8_gemv", x, qweight, weight_scale, bias, x_dtypes=(qweight.dtype,))
        if scales.numel() != x2.shape[0]:
            raise ValueError(f"w8a8_gemv: {x2.shape[0]} quantized rows come with {scales.numel()} scales")
    else:
        qweight, x2 = _check_w8a8_inputs("w8a8_gemv", x, qweight, weight_scale, bias)
        out_dtype = x.dtype
    (n, k), num_rows = qweight.shape, x2.shape[0]
    _check_rows("w8a8_gemv", x, num_rows)
    y = torch.empty((num_rows, n), dtype=out_dtype, device=x.device)
    if num_rows == 0:
        return y.reshape(*x.shape[:-1], n)

    cfg = config or (num_rows == 1 and shape_config(_W8A8_SHAPE_CONFIGS, (n, k), x.device)) \
        or default_gemv_config("w8a8", num_rows, x.device)
    _check_config(cfg, 1, 1)
    int8 = qweight.dtype == torch.int8
    plan = _split_plan(y, triton.cdiv(k, cfg.block_k), cfg, torch.int32 if int8 else torch.float32)
    ws = weight_scale.reshape(-1).float()
    xs = scales if prequant else input_scale.reshape(-1).float() if input_scale is not None else ws  # ws: unread
    # the per-token max's K step: up to 32 elements per thread and row of x
    amax_block = min(triton.next_power_of_2(k),
                     max(cfg.block_k, 1024 * cfg.num_warps // triton.next_power_of_2(num_rows)))
    span = plan.steps_per_split * cfg.block_k if pdl.range_applies(qweight.numel()) else 0
    prefetch_rows, lines_per_row = prefetch_rows_plan(cfg.block_n, cfg.block_k, span)
    _w8a8_gemv_kernel[plan.grid](
        x2, qweight, ws, xs, bias if bias is not None else y, y, plan.part, plan.counters,
        n, k, plan.steps_per_split, x2.stride(0), qweight.stride(0),
        ROWS=num_rows, INT8=int8, STATIC=input_scale is not None, PER_CHANNEL=ws.numel() == n and n > 1,
        HAS_BIAS=bias is not None, SPLIT_K=plan.split_k, REDUCE_IN_KERNEL=cfg.reduce_in_kernel,
        EMULATE_FP8=_interpreting() and not int8, EVEN_N=n % cfg.block_n == 0, EVEN_K=k % cfg.block_k == 0,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, VEC=min(cfg.block_k, 16), AMAX_BLOCK=amax_block,
        NUM_STAGES=cfg.num_stages, PREQUANT=prequant, PREFETCH_ROWS=prefetch_rows, PREFETCH_LINES=lines_per_row,
        QMIN=qmin, num_warps=cfg.num_warps, **pdl_args(x2))
    _finish_split(plan, cfg, bias, y)
    return y.reshape(*x.shape[:-1], n)


DENSE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def dense_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`dense_gemv` takes this x and weight (dtypes only: the caller checks the rows)."""
    return weight.dtype in DENSE_DTYPES and x.dtype == weight.dtype and weight.dim() == 2


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, gated: bool = False,
               config: GemvConfig | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for at most ``GEMV_MAX_ROWS`` rows of x, unquantized (fp16/bf16/fp32 weights
    in x's dtype), fp32 products and sums, the result rounded once to x's dtype. ``gated``: x is [..., 2K], a
    gate and an up projection side by side, and the linear's input is ``silu(gate) * up`` as
    ``kernels.activation.silu_mul`` forms it, in the kernel's x loads (the SwiGLU's launch saved).

    x: [..., K] (gated: [..., 2K]) -> y: [..., N] in x's dtype. ``config`` forces a configuration (benchmarks and
    tests).
    """
    if x.device.type != "cuda" and not _interpreting():
        raise RuntimeError("dense_gemv needs a CUDA tensor (or TRITON_INTERPRET=1 for the CPU interpreter)")
    if not dense_applies(x, weight):
        raise ValueError(f"dense_gemv takes a 2-D fp16/bf16/fp32 weight in x's dtype; got weight {weight.dtype} "
                         f"{tuple(weight.shape)}, x {x.dtype}")
    n, k = weight.shape
    if x.shape[-1] != (2 * k if gated else k):
        raise ValueError(f"x has {x.shape[-1]} input features; the weight takes {k}"
                         + (f" (gated: [gate | up], {2 * k})" if gated else ""))
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias {tuple(bias.shape)} does not match {n} output features")
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    num_rows = x2.shape[0]
    _check_rows("dense_gemv", x, num_rows)
    y = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return y.reshape(*x.shape[:-1], n)

    cfg = config or default_gemv_config("dense", num_rows, x.device)
    _check_config(cfg, 1, 1)
    cfg = dataclasses.replace(cfg, reduce_in_kernel=True)
    elem = weight.element_size()
    vec = min(cfg.block_k, 16 // elem)  # one 16-byte vector load per thread and row
    plan = _split_plan(y, triton.cdiv(k, cfg.block_k), cfg, torch.float32)
    elems_per_line = LINE // elem
    span = plan.steps_per_split * cfg.block_k * elem if pdl.range_applies(weight.numel() * elem) else 0
    prefetch_rows, lines_per_row = prefetch_rows_plan(cfg.block_n, cfg.block_k * elem, span)
    _dense_gemv_kernel[plan.grid](
        x2, weight, bias if bias is not None else y, y, plan.part, plan.counters,
        n, k, plan.steps_per_split, x2.stride(0), weight.stride(0),
        ROWS=num_rows, GATED=gated, HAS_BIAS=bias is not None, SPLIT_K=plan.split_k,
        EVEN_N=n % cfg.block_n == 0, EVEN_K=k % cfg.block_k == 0, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, VEC=vec,
        NUM_STAGES=cfg.num_stages, PREFETCH_ROWS=prefetch_rows, PREFETCH_LINES=lines_per_row,
        ELEMS_PER_LINE=elems_per_line, num_warps=cfg.num_warps, **pdl_args(x2))
    return y.reshape(*x.shape[:-1], n)
