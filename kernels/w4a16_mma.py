"""Weight-only quantized linears (W4A16, W8A16) for decode-sized batches on tensor cores, with no per-weight
dequantization arithmetic.

``y = x @ ((q - zero) * scale).T + bias`` on :func:`repack_mma`'s layout ("mma"), rows of codes contiguous over K
so that each thread's 16-byte load already holds pairs of consecutive input features, the order the MMA's
operand fragments take (a K-major byte tile would need a byte-wise shuffle through shared memory). A row is cut
into chunks of P bytes (``pair_span``: a power of 2 up to 64 inside one group; one K step of the kernel)::

    4 bits: qweight uint8 [N, K/2]: chunk c of row n holds q[n, 2cP + i] | q[n, 2cP + P + i] << 4, i < P
            (the low nibbles are the chunk's first P input features, the high nibbles the next P)
    8 bits: qweight uint8 [N, K]: chunk c of row n holds q[n, cP + i]
    scales  fp32 [G, N], zeros uint8 [G, N]  (per group, contiguous over n)

    tiled (``tile_n`` T > 0, the default where a power-of-2 T divides N): [N/T, chunks, T, P], so each
    program's K step (its T rows' chunk c) is one contiguous block of T * P bytes; untiled (T = 0): [N, chunks, P]

At 1-16 rows of x a linear is bound by the weight bytes read; at 3 TB/s an H100 issues about 10 instructions
per weight byte, and dequantizing each code in fp32 (``(q - zero) * scale``: unpack, convert, FMA) before the
multiply-add spends most of them (``kernels.gemv``: ~9 per byte at one row, ~1.35 TB/s). Here a code costs only
its unpacking. Within one quantization group the scale and zero are constants of the column, so

    sum_k x[m, k] (q[n, k] - z[n]) s[n] = s[n] * (sum_k x[m, k] (q[n, k] + OFF) - (z[n] + OFF) * sum_k x[m, k])

and the inner sum is a plain tensor-core product of x with the codes offset by OFF, exact in the MMA's fp32
accumulation (codes are small integers, exact in bf16). Each K step of a program is one chunk, inside one group::

    bytes [BLOCK_N, P] ── unpack ──► lo, hi: codes + OFF (bf16 [BLOCK_N, P] each)
    acc += s * (x[:, 2cP : 2cP + P] @ lo.T + x[:, 2cP + P : 2cP + 2P] @ hi.T) - s * (z + OFF) * sum(x[:, 2cP : 2cP + 2P])

4-bit codes become ``128 + q`` bf16 by ORing the nibble into the mantissa of 128.0 (OFF = 128): in PTX, per 4
packed bytes 2 byte permutes, 2 shifts and 4 LOPs make 8 bf16 codes (``_UNPACK_BF16_PTX``), 2 instructions per
weight byte (7.4 per byte for the whole one-row K loop on sm_90 with Triton 3.6, from 9.2 for the GEMV); 8-bit
codes are ``q - 128`` (OFF = -128). With one group per output channel (``group_size == K``) the raw products
accumulate over the whole K range and the correction runs once, at the end. From 17 rows the dequantizing
variant (``MmaConfig.dequant``) forms each weight in registers and accumulates in the MMA instead: the
correction's cost grows with the rows. The 4-bit default up to 16 rows (``MmaConfig.zsub``) skips the correction
instead: each unpacked code gets ``-(128 + zero)`` added in one packed bf16 FMA per two codes (exact: small
integers), so the MMA forms ``sum_k x (q - zero)`` directly and only the group's scale multiplies the products (no
sum of x, whose reduction and broadcast cost shared-memory round trips and barriers: 128 registers instead of 168,
5 barriers per K step instead of 15; ~18% less time per layer, docs/BENCHMARKS.md session 8).
:func:`dequantize_mma` turns the layout back into a [N, K] weight for cuBLAS at prefill sizes. On an H100 at
Llama-3-8B shapes the one-row W4A16 linears reach 0.85-1.7 TB/s (83 µs per layer where the correcting kernel
took 101 in the same call, session 8) and 98 µs at 16 rows: latency-bound, not issue-bound.

At small N the BLOCK_N tiles are too few for the SMs, so K is split across programs whose fp32 partial sums
the tile's last program adds in split order (deterministic) in the same launch, as ``kernels.gemv`` does (its
tile counters, and its NOTE on concurrency and CUDA-graph capture, apply here).

The correction subtracts two sums about 128 / |q - zero| times larger than the result: for bf16 / fp16 x the
error stays within the output's rounding, for fp32 x (reference-precision artifacts) it would not (relative 6e-4
at K = 4096, one group), so fp32 x always takes the dequantizing variant, which forms ``(q - zero) * scale`` in
fp32 exactly as the reference does and multiplies at IEEE precision.

NOTE: under TRITON_INTERPRET (and for fp16 / fp32 x) the codes are converted with plain integer and float ops,
and the interpreter multiplies in fp32 at IEEE precision (its bf16 dot is wrong). No host synchronisation:
grids and splits come from shapes only (CUDA-graph capturable).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.activation import silu_mul_values
from kernels.gemv import _split_plan, _tile_counters
from kernels.pdl import prefetch_l2, wait_prior
from kernels.torch_quant import unpack_int4
from kernels.w4a16_gemm import X_DTYPES, _check_device, _interpreting

LAYOUT = "mma"
MMA_MAX_ROWS = 256  # rows of x the kernel takes
MMA_TILED = True  # repack_mma's default: each program's K step contiguous in memory (tile_width)
MMA_ENABLED = True  # the runtime repacks weight-only linears to this layout where supports() (runtime/executor.py)
MMA_RUNTIME_MAX_ROWS = 128  # the runtime sends this many rows here; more to dequantize_mma + cuBLAS
MAX_PAIR_SPAN = 64  # bytes per row of a 4-bit chunk (a K step): 128 input features, one group of 128


@dataclass(frozen=True)
class MmaConfig:
    """One launch configuration of :func:`w4a16_mma`."""

    block_n: int  # output features per program (power of 2, >= 16)
    block_m: int = 16  # rows of x per tile (power of 2, >= 16: tl.dot's minimum)
    chunks: int = 1  # chunks per K step (1 or 2; 1 where the K range has an odd number of them)
    split_k: int = 0  # programs sharing one tile's K range; 0 = from the tile count and the SM count
    num_warps: int = 4
    num_stages: int = 2
    dequant: bool = False  # dequantize each code (scale and zero per weight) and accumulate in the MMA: for many rows
    zsub: bool = False  # 4 bits: subtract the zero point from each code in bf16 (exact) and scale the products per
    #                     group, instead of correcting with the sum of x (no reduction of x, no layout round trips)
    ptx_unpack: bool = True  # bf16 x on the GPU: 4-bit codes unpacked in PTX (else plain Triton integer ops)
    reduce_in_kernel: bool = True  # read by kernels.gemv._split_plan: the last program adds the partials


# Picked by rows of x: the first row whose bound is >= M. The fastest of ``python -m kernels.bench.gemm --mma-sweep``
# on an H100 across the Llama-3-8B shapes (tiled layout; docs/BENCHMARKS.md). Up to 16 rows, 4-bit codes minus
# their zero point (zsub: ~18% less time per Llama-3-8B layer than the correcting kernel at 1 and 16 rows, session
# 8) in one pipeline stage, three for wide layers (N >= _WIDE_N); 8 bits, the correcting kernel with two chunks per
# step in three stages; beyond, the dequantizing variant (128-row tiles for wide layers past 64 rows).
_CUDA_CONFIGS: list[tuple[int, MmaConfig]] = [
    (16, MmaConfig(128, 16, num_warps=4, num_stages=1, zsub=True)),
    (32, MmaConfig(128, 32, dequant=True, num_warps=4, num_stages=2)),
    (64, MmaConfig(128, 64, dequant=True, num_warps=4, num_stages=2)),
    (128, MmaConfig(128, 64, dequant=True, num_warps=4, num_stages=3)),
    (MMA_MAX_ROWS, MmaConfig(128, 128, dequant=True, num_warps=8, num_stages=3)),
]
_WIDE_N = 16384
_LONG_K = 8192
_KERNEL_ALWAYS_ROWS = 64  # up to here the kernel beats dequantize + cuBLAS on every shape measured
_INTERPRETER_CONFIG = MmaConfig(32, 16, split_k=1, num_warps=1, num_stages=1)
_MIN_BLOCK = 16  # tl.dot's minimum along every dimension


def default_mma_config(num_rows: int, device: torch.device, out_features: int = 0, bits: int = 4) -> MmaConfig:
    """The table's configuration for ``num_rows`` rows of x, ``out_features`` columns and ``bits``-bit codes
    (block_n is the layout's tile on tiled weights)."""
    if _interpreting() or device.type != "cuda":
        return _INTERPRETER_CONFIG
    cfg = next(cfg for bound, cfg in _CUDA_CONFIGS if num_rows <= bound)
    if not cfg.dequant and bits == 8:
        cfg = replace(cfg, chunks=2, num_stages=3, zsub=False)
    elif not cfg.dequant and out_features >= _WIDE_N:
        cfg = replace(cfg, num_stages=3)
    elif _KERNEL_ALWAYS_ROWS < num_rows <= 128 and out_features >= _WIDE_N:
        cfg = MmaConfig(128, 128, dequant=True, num_warps=8, num_stages=3)
    return cfg


def prefers_kernel(num_rows: int, out_features: int, in_features: int) -> bool:
    """Whether :func:`w4a16_mma` beats :func:`dequantize_mma` + cuBLAS for this many rows of a [N, K] linear.
    Measured on an H100 at Llama-3-8B shapes (docs/BENCHMARKS.md, session 7): up to 64 rows everywhere; at 128
    rows on wide (N >= 16384: gate_up 156 vs 216 µs) and long-K (K >= 8192: down 99 vs 116 µs) layers only
    (qkv 62 vs 48, o_proj 57 vs 30 µs); past MMA_RUNTIME_MAX_ROWS never."""
    if num_rows <= _KERNEL_ALWAYS_ROWS:
        return True
    return num_rows <= MMA_RUNTIME_MAX_ROWS and (out_features >= _WIDE_N or in_features >= _LONG_K)


def _largest_step(limit: int, *multiples_of: int) -> int | None:
    """The largest power of 2 in [16, limit] dividing every ``multiples_of``, else None."""
    r = 1 << (max(limit, 1).bit_length() - 1)
    while r >= _MIN_BLOCK:
        if all(m % r == 0 for m in multiples_of):
            return r
        r //= 2
    return None


def pair_span(group_size: int, in_features: int) -> int | None:
    """The 4-bit layout's chunk width in bytes for this group size (-1: one group), or None when no chunk of
    at least 16 bytes lies inside one group (the kernel does not take such weights)."""
    g = in_features if group_size == -1 else group_size
    if g % 2 or in_features % g:
        return None
    return _largest_step(MAX_PAIR_SPAN, g // 2, in_features // 2)


def chunk_width(bits: int, group_size: int, in_features: int) -> int | None:
    """Bytes per row of one K step (a chunk) for these weights: 4 bits, :func:`pair_span`; 8 bits, the largest
    power of 2 up to MAX_PAIR_SPAN inside one group; None when the kernel does not take them."""
    if bits == 4:
        return pair_span(group_size, in_features)
    g = in_features if group_size == -1 else group_size
    return _largest_step(MAX_PAIR_SPAN, g, in_features) if bits == 8 and in_features % g == 0 else None


def tile_width(out_features: int) -> int:
    """The N tile of the tiled layout (and of the kernel's programs) for a layer of ``out_features``: 0 (untiled)
    when no power-of-2 tile divides it."""
    t = 256 if out_features >= _WIDE_N else 128
    while t >= _MIN_BLOCK and out_features % t:
        t //= 2
    return t if t >= _MIN_BLOCK else 0


def supports(bits: int, group_size: int, in_features: int) -> bool:
    """Whether :func:`repack_mma` and :func:`w4a16_mma` take weights of this shape (else use ``kernels.gemv`` /
    ``kernels.w4a16_gemm``)."""
    return bits in (4, 8) and chunk_width(bits, group_size, in_features) is not None


# --- layout ----------------------------------------------------------------------------------------
def repack_mma(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
               bits: int = 4, tiled: bool | None = None) -> dict[str, torch.Tensor | int | str]:
    """The passes' layout (``qweight`` [N, K/2] / [N, K], ``scales`` / ``zeros`` [N, G]) -> the "mma" layout
    (module docstring), as keyword arguments of :func:`w4a16_mma` and :func:`dequantize_mma`. Done once, at load;
    :func:`unrepack_mma` inverts it. ``tiled`` (default ``MMA_TILED``): each program's K step is contiguous."""
    if bits not in (4, 8):
        raise ValueError(f"bits {bits} is not supported (4 for w4a16, 8 for w8a16)")
    if qweight.dtype != torch.uint8 or zeros.dtype != torch.uint8 or scales.dtype != torch.float32:
        raise ValueError(f"expected qweight uint8, scales fp32, zeros uint8; got {qweight.dtype}, {scales.dtype}, "
                         f"{zeros.dtype}")
    n, cols = qweight.shape
    k = cols * (8 // bits)
    if not supports(bits, group_size, k):
        raise ValueError(f"the mma layout takes no {bits}-bit weights with group_size {group_size} and {k} input "
                         "features (it needs K steps of >= 16 bytes inside one group)")
    num_groups = k // (k if group_size == -1 else group_size)
    if tuple(scales.shape) != (n, num_groups) or tuple(zeros.shape) != (n, num_groups):
        raise ValueError(f"scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} do not match qweight "
                         f"{tuple(qweight.shape)} with group_size {group_size} (expected {(n, num_groups)})")
    span = chunk_width(bits, group_size, k)
    if bits == 4:
        codes = unpack_int4(qweight).reshape(n, k // (2 * span), 2, span)  # [N, chunks, lo/hi, P]
        packed = (codes[:, :, 0] | (codes[:, :, 1] << 4)).reshape(n, k // 2)
    else:
        packed = qweight
    tile = tile_width(n) if (MMA_TILED if tiled is None else tiled) else 0
    if tile:  # [N / T, T, chunks, P] -> [N / T, chunks, T, P]
        packed = packed.reshape(n // tile, tile, cols // span, span).transpose(1, 2).reshape(n, cols)
    return {"qweight": packed.contiguous(), "scales": scales.t().contiguous(), "zeros": zeros.t().contiguous(),
            "group_size": group_size, "bits": bits, "layout": LAYOUT, "pair_span": span, "tile_n": tile}


def unrepack_mma(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, bits: int = 4,
                 layout: str = LAYOUT, pair_span: int = 0,
                 tile_n: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qweight, scales, zeros) of the "mma" layout -> the passes' layout (the inverse of :func:`repack_mma`)."""
    n, cols = qweight.shape
    if tile_n:
        qweight = qweight.reshape(n // tile_n, cols // pair_span, tile_n, pair_span).transpose(1, 2).reshape(n, cols)
    if bits == 4:
        n, half = qweight.shape
        chunks = qweight.reshape(n, half // pair_span, 1, pair_span)
        codes = torch.cat((chunks & 0x0F, chunks >> 4), dim=2).reshape(n, 2 * half)  # [N, K]
        qweight = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    return qweight.contiguous(), scales.t().contiguous(), zeros.t().contiguous()


@dataclass
class _MmaWeights:
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    out_features: int  # N
    in_features: int  # K
    group_size: int  # -1 resolved to K
    step: int  # bytes per row of a chunk (a K step)
    tile_n: int  # the tiled layout's N tile (0: rows of K/2 or K bytes)

    @property
    def strides(self) -> tuple[int, int]:
        """(bytes between a tile's rows, bytes between its chunks)."""
        cols = self.qweight.shape[1]
        return (self.step, self.tile_n * self.step) if self.tile_n else (cols, self.step)


def _mma_weights(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, bits: int,
                 layout: str, pair_span: int, tile_n: int) -> _MmaWeights:
    """Validates :func:`repack_mma`'s output (user-facing errors)."""
    if layout != LAYOUT:
        raise ValueError(f"w4a16_mma / dequantize_mma take the {LAYOUT!r} layout (kernels.w4a16_mma.repack_mma), "
                         f"not {layout!r}")
    if bits not in (4, 8) or qweight.dim() != 2 or qweight.dtype != torch.uint8:
        raise ValueError(f"expected 4 or 8 bits and a 2-D uint8 qweight, got {bits} bits, {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    n, cols = qweight.shape
    k = cols * (8 // bits)
    g = k if group_size == -1 else group_size
    if not supports(bits, group_size, k) or pair_span != chunk_width(bits, group_size, k) \
            or tile_n not in (0, tile_width(n)):
        raise ValueError(f"qweight {tuple(qweight.shape)} with group_size {group_size}, pair_span {pair_span} and "
                         f"tile_n {tile_n} is not repack_mma's {bits}-bit layout")
    if tuple(scales.shape) != (k // g, n) or tuple(zeros.shape) != (k // g, n) or scales.dtype != torch.float32 \
            or zeros.dtype != torch.uint8:
        raise ValueError(f"scales {scales.dtype} {tuple(scales.shape)} / zeros {zeros.dtype} {tuple(zeros.shape)} "
                         f"do not match: expected fp32 / uint8 {(k // g, n)}")
    if n * k >= 2**31:  # the kernels index weights and outputs [N, K] with 32-bit offsets
        raise ValueError(f"qweight {tuple(qweight.shape)}: {n} x {k} weights are more than the kernels' 32-bit "
                         "offsets address")
    return _MmaWeights(qweight.contiguous(), scales.contiguous(), zeros.contiguous(), n, k, g, pair_span, tile_n)


# --- kernels ---------------------------------------------------------------------------------------
# Per 4 packed bytes b0..b3 (one register): spread bytes 0,1 (2,3) into the two halves of a register (prmt),
# keep each half's low nibble (high: after a 4-bit shift) and OR in the bits of bf16 128.0 (lop3 0xea = a & b | c):
# two bf16 128 + q per register, element i of the outputs from byte i.
_UNPACK_BF16_PTX = tl.constexpr("""
{
.reg .b32 t0, t1, s0, s1, zero;
mov.b32 zero, 0;
prmt.b32 t0, $4, zero, 0x4140;
prmt.b32 t1, $4, zero, 0x4342;
lop3.b32 $0, t0, 0x000F000F, 0x43004300, 0xea;
lop3.b32 $1, t1, 0x000F000F, 0x43004300, 0xea;
shr.u32 s0, t0, 4;
shr.u32 s1, t1, 4;
lop3.b32 $2, s0, 0x000F000F, 0x43004300, 0xea;
lop3.b32 $3, s1, 0x000F000F, 0x43004300, 0xea;
}
""")


# The same, then minus (128 + zero) per weight: $5 holds bf16x2 -(128 + z) twice (a register's 4 codes share one
# row of the tile, so one zero point; $6-$8 hold the same value, unused); fma.rn.bf16x2 (x 1.0) gives q - z, exact.
_UNPACK_ZSUB_BF16_PTX = tl.constexpr("""
{
.reg .b32 t0, t1, s0, s1, u0, u1, u2, u3, zero, one;
mov.b32 zero, 0;
mov.b32 one, 0x3F803F80;
prmt.b32 t0, $4, zero, 0x4140;
prmt.b32 t1, $4, zero, 0x4342;
lop3.b32 u0, t0, 0x000F000F, 0x43004300, 0xea;
lop3.b32 u1, t1, 0x000F000F, 0x43004300, 0xea;
shr.u32 s0, t0, 4;
shr.u32 s1, t1, 4;
lop3.b32 u2, s0, 0x000F000F, 0x43004300, 0xea;
lop3.b32 u3, s1, 0x000F000F, 0x43004300, 0xea;
fma.rn.bf16x2 $0, u0, one, $5;
fma.rn.bf16x2 $1, u1, one, $5;
fma.rn.bf16x2 $2, u2, one, $5;
fma.rn.bf16x2 $3, u3, one, $5;
}
""")


@triton.jit
def _codes_minus_zero(b, zero, DOT_DTYPE: tl.constexpr, PTX: tl.constexpr):
    """4-bit bytes [BN, R] and the zero point per row (uint8-valued int32 [BN]) -> (low codes - zero, high codes
    - zero) in DOT_DTYPE, exact."""
    z2 = tl.broadcast_to(zero[:, None], b.shape)
    if PTX:
        v = (z2 | 0xC300).to(tl.uint32)  # bf16 bits of -(128 + z)
        zz = (v | (v << 16)).to(tl.int32, bitcast=True)
        return tl.inline_asm_elementwise(_UNPACK_ZSUB_BF16_PTX, "=r,=r,=r,=r,r,r,r,r,r", [b, zz],
                                         dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        q = b.to(tl.int32)
        return ((q & 0xF) - z2).to(tl.float32).to(DOT_DTYPE), ((q >> 4) - z2).to(tl.float32).to(DOT_DTYPE)


@triton.jit
def _codes(b, BITS: tl.constexpr, DOT_DTYPE: tl.constexpr, PTX: tl.constexpr):
    """uint8 bytes -> (low codes + 128, high codes + 128) for 4 bits, (q - 128, q - 128) for 8 bits, in DOT_DTYPE
    (exact: small integers)."""
    if BITS == 4:
        if PTX:
            return tl.inline_asm_elementwise(_UNPACK_BF16_PTX, "=r,=r,=r,=r,r", [b],
                                             dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        else:
            q = b.to(tl.int32)
            return ((q & 0xF) + 128).to(tl.float32).to(DOT_DTYPE), ((q >> 4) + 128).to(tl.float32).to(DOT_DTYPE)
    else:
        v = (b.to(tl.int32) - 128).to(tl.float32).to(DOT_DTYPE)
        return v, v


@triton.jit
def _dot(a, w_t, acc, IEEE: tl.constexpr):
    """acc + a @ w_t.T (acc None: from zero): tensor cores on the operands' dtype, or fp32 at IEEE precision."""
    if IEEE:
        return tl.dot(a.to(tl.float32), tl.trans(w_t.to(tl.float32)), acc, input_precision="ieee")
    else:
        return tl.dot(a, tl.trans(w_t), acc)


@triton.jit
def _group_params(s_ptr, z_ptr, g, offs_n, mask_n, stride_sz, OFF: tl.constexpr, EVEN_N: tl.constexpr):
    """(scale, zero + OFF) of group g per column, fp32 [1, BLOCK_N]: code - (zero + OFF) = q - zero, exactly."""
    if EVEN_N:
        s = tl.load(s_ptr + g * stride_sz + offs_n)
        z = tl.load(z_ptr + g * stride_sz + offs_n)
    else:
        s = tl.load(s_ptr + g * stride_sz + offs_n, mask=mask_n, other=0.0)
        z = tl.load(z_ptr + g * stride_sz + offs_n, mask=mask_n, other=0)
    return s[None, :], (z.to(tl.float32) + OFF)[None, :]


@triton.jit
def _load_chunk(w_rows, cols, mask_n, EVEN_N: tl.constexpr):
    """The tile's bytes at columns ``cols`` of qweight: [BLOCK_N, BLOCK_R] uint8."""
    if EVEN_N:
        return tl.load(w_rows + cols[None, :])
    else:
        return tl.load(w_rows + cols[None, :], mask=mask_n[:, None], other=0)


@triton.jit
def _load_x(x_rows, x_row0, cols, mask_m, K, GATED: tl.constexpr):
    """x's columns ``cols`` [BLOCK_R] of the tile's rows, [BLOCK_M, BLOCK_R]. GATED (one row of x, at ``x_row0``):
    x = silu(gate) * up from a row [gate | up] of 2K features, rounded as ``kernels.activation.silu_mul`` rounds
    it, formed on the vector and placed in the tile's first row (on the MMA's padded operand tile, replicated
    across warps, it would cost 3.6x the K step's instructions: 1498 instead of 413; this way 484, sm_90)."""
    if GATED:
        v = silu_mul_values(tl.load(x_row0 + cols), tl.load(x_row0 + K + cols))
        first = (tl.arange(0, x_rows.shape[0]) == 0)[:, None]
        return tl.where(first, v[None, :], tl.zeros_like(v)[None, :])
    else:
        return tl.load(x_rows + cols[None, :], mask=mask_m[:, None], other=0.0)


@triton.jit
def _chunk(acc, raw, xsum, b, r0, x_rows, mask_m, offs_r, s_ptr, z_ptr, offs_n, mask_n, group_size, stride_sz,
           zero, K, x_row0, BITS: tl.constexpr, ONE_GROUP: tl.constexpr, PTX: tl.constexpr, IEEE: tl.constexpr,
           EVEN_N: tl.constexpr, BLOCK_R: tl.constexpr, DEQUANT: tl.constexpr, ZSUB: tl.constexpr,
           GATED: tl.constexpr):
    """One chunk's products added in: (acc, raw, xsum) updated. ``b``: its bytes, from qweight column r0;
    ``zero``: ZSUB with one group, the zero points (int32 [BLOCK_N])."""
    OFF: tl.constexpr = 128.0 if BITS == 4 else -128.0
    k0 = r0 * (8 // BITS)  # the chunk's first input feature
    if ZSUB:  # q - zero per weight in the MMA's dtype (exact), the products scaled once per group and column
        x_lo = _load_x(x_rows, x_row0, k0 + offs_r, mask_m, K, GATED)
        x_hi = _load_x(x_rows, x_row0, k0 + BLOCK_R + offs_r, mask_m, K, GATED)
        if ONE_GROUP:
            lo, hi = _codes_minus_zero(b, zero, x_rows.dtype.element_ty, PTX)
            raw = _dot(x_hi, hi, _dot(x_lo, lo, raw, IEEE), IEEE)
        else:
            g = k0 // group_size
            if EVEN_N:
                z = tl.load(z_ptr + g * stride_sz + offs_n).to(tl.int32)
                s = tl.load(s_ptr + g * stride_sz + offs_n)
            else:
                z = tl.load(z_ptr + g * stride_sz + offs_n, mask=mask_n, other=0).to(tl.int32)
                s = tl.load(s_ptr + g * stride_sz + offs_n, mask=mask_n, other=0.0)
            lo, hi = _codes_minus_zero(b, z, x_rows.dtype.element_ty, PTX)
            acc += s[None, :] * _dot(x_hi, hi, _dot(x_lo, lo, None, IEEE), IEEE)
        return acc, raw, xsum
    lo, hi = _codes(b, BITS, x_rows.dtype.element_ty, PTX)  # [BLOCK_N, BLOCK_R] each
    x_lo = _load_x(x_rows, x_row0, k0 + offs_r, mask_m, K, GATED)
    if DEQUANT:  # dequantize each code as the reference does ((q - zero) * scale in fp32), then the MMA
        s, zoff = _group_params(s_ptr, z_ptr, k0 // group_size, offs_n, mask_n, stride_sz, OFF, EVEN_N)
        s_col = tl.reshape(s, (s.shape[1], 1))
        zoff = tl.reshape(zoff, (s.shape[1], 1))
        acc = _dot(x_lo, ((lo.to(tl.float32) - zoff) * s_col).to(x_lo.dtype), acc, IEEE)
        if BITS == 4:
            x_hi = _load_x(x_rows, x_row0, k0 + BLOCK_R + offs_r, mask_m, K, GATED)
            acc = _dot(x_hi, ((hi.to(tl.float32) - zoff) * s_col).to(x_lo.dtype), acc, IEEE)
        return acc, raw, xsum
    if BITS == 4:
        x_hi = _load_x(x_rows, x_row0, k0 + BLOCK_R + offs_r, mask_m, K, GATED)
        prod = _dot(x_lo, lo, None, IEEE) + _dot(x_hi, hi, None, IEEE)
        xs = tl.sum(x_lo.to(tl.float32) + x_hi.to(tl.float32), axis=1)
    else:
        prod = _dot(x_lo, lo, None, IEEE)
        xs = tl.sum(x_lo.to(tl.float32), axis=1)
    if ONE_GROUP:
        raw += prod
        xsum += xs
    else:
        s, zoff = _group_params(s_ptr, z_ptr, k0 // group_size, offs_n, mask_n, stride_sz, OFF, EVEN_N)
        acc += s * prod - (s * zoff) * xs[:, None]
    return acc, raw, xsum


@triton.jit
def _w4a16_mma_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, part_ptr, counter_ptr,
    M, N, K, group_size, steps_per_split, split_k,
    stride_xm, stride_row, stride_chunk, stride_sz,
    BITS: tl.constexpr, ONE_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    PTX: tl.constexpr, IEEE: tl.constexpr, EVEN_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, CHUNKS: tl.constexpr,
    DEQUANT: tl.constexpr, ZSUB: tl.constexpr, NUM_STAGES: tl.constexpr,
    GATED: tl.constexpr, PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr,
):
    # x: [M, K] -> y: [M, N] contiguous; grid (N tiles, split_k, M tiles). A K step is CHUNKS chunks of BLOCK_R
    # bytes of each row of the tile: 4 bits, codes 2 * r0 .. 2 * r0 + 2 * BLOCK_R per chunk; 8 bits, r0 .. r0 + BLOCK_R.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    first_step = pid_k * steps_per_split
    num_steps = min(steps_per_split, (K * BITS // 8) // (BLOCK_R * CHUNKS) - first_step)
    if PREFETCH_LINES > 0:  # tiled weights: this program's K steps are one contiguous range (constants: no wait)
        prefetch_l2(qw_ptr + pid_n * BLOCK_N * (K * BITS // 8) + first_step * CHUNKS * stride_chunk,
                    num_steps * CHUNKS * stride_chunk, PREFETCH_LINES)
    wait_prior(PDL)  # x, the partial sums and their counters are the preceding kernels'
    OFF: tl.constexpr = 128.0 if BITS == 4 else -128.0
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    offs_r = tl.arange(0, BLOCK_R)
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    x_row0 = x_ptr + pid_m * BLOCK_M * stride_xm
    # this tile's rows: its first byte is the same in both layouts (N tiles of BLOCK_N whole rows)
    w_rows = qw_ptr + pid_n * BLOCK_N * (K * BITS // 8) + tl.arange(0, BLOCK_N)[:, None] * stride_row
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    raw = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # ONE_GROUP: uncorrected products over the split
    xsum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    zero = tl.zeros((BLOCK_N,), dtype=tl.int32)
    if ZSUB and ONE_GROUP:  # one zero point per column for the whole K range
        if EVEN_N:
            zero = tl.load(z_ptr + offs_n).to(tl.int32)
        else:
            zero = tl.load(z_ptr + offs_n, mask=mask_n, other=0).to(tl.int32)
    for step in tl.range(0, num_steps, num_stages=NUM_STAGES):
        c0 = (first_step + step) * CHUNKS
        r0 = c0 * BLOCK_R
        b0 = _load_chunk(w_rows, c0 * stride_chunk + offs_r, mask_n, EVEN_N)
        if CHUNKS == 2:  # both chunks' loads in flight before either is used
            b1 = _load_chunk(w_rows, (c0 + 1) * stride_chunk + offs_r, mask_n, EVEN_N)
        acc, raw, xsum = _chunk(acc, raw, xsum, b0, r0, x_rows, mask_m, offs_r, s_ptr, z_ptr, offs_n, mask_n,
                                group_size, stride_sz, zero, K, x_row0, BITS, ONE_GROUP and not DEQUANT, PTX, IEEE,
                                EVEN_N, BLOCK_R, DEQUANT, ZSUB, GATED)
        if CHUNKS == 2:
            acc, raw, xsum = _chunk(acc, raw, xsum, b1, r0 + BLOCK_R, x_rows, mask_m, offs_r, s_ptr, z_ptr, offs_n,
                                    mask_n, group_size, stride_sz, zero, K, x_row0, BITS, ONE_GROUP and not DEQUANT,
                                    PTX, IEEE, EVEN_N, BLOCK_R, DEQUANT, ZSUB, GATED)
    if ONE_GROUP and ZSUB:
        s, zoff = _group_params(s_ptr, z_ptr, 0, offs_n, mask_n, stride_sz, OFF, EVEN_N)
        acc = s * raw
    elif ONE_GROUP and not DEQUANT:
        s, zoff = _group_params(s_ptr, z_ptr, 0, offs_n, mask_n, stride_sz, OFF, EVEN_N)
        acc = s * raw - (s * zoff) * xsum[:, None]

    mask = mask_m[:, None] & mask_n[None, :]
    out = offs_m[:, None] * N + offs_n[None, :]
    if not SPLIT:
        _store_tile(y_ptr + out, acc, bias_ptr, offs_n, mask_n, mask, HAS_BIAS)
    else:
        tl.store(part_ptr + pid_k * M * N + out, acc, mask=mask)
        # count this program in on the tile's counter (acquire-release, GPU scope) after all its threads stored
        # their partials; the last of the split_k programs sees them all and finishes the tile
        counter = counter_ptr + pid_m * tl.num_programs(0) + pid_n
        tl.debug_barrier()
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == split_k - 1:
            tl.store(counter, 0)  # zero again for the next launch
            tot = tl.load(part_ptr + out, mask=mask, other=0.0, cache_modifier=".cg")  # split order: deterministic
            for i in range(1, split_k):
                tot += tl.load(part_ptr + i * M * N + out, mask=mask, other=0.0, cache_modifier=".cg")
            _store_tile(y_ptr + out, tot, bias_ptr, offs_n, mask_n, mask, HAS_BIAS)


@triton.jit
def _store_tile(y_ptrs, acc, bias_ptr, offs_n, mask_n, mask, HAS_BIAS: tl.constexpr):
    """y = acc (fp32) + bias, in y's dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptrs, acc.to(y_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_mma_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, N, K, group_size, stride_row, stride_chunk, stride_sz,
                        BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    # out [N, K] = (q - zero) * scale in out's dtype; grid (N tiles, K steps of BLOCK_R bytes per row)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_n < N)[:, None]
    r0 = tl.program_id(1) * BLOCK_R
    offs_r = tl.arange(0, BLOCK_R)
    rows = qw_ptr + tl.program_id(0) * BLOCK_N * (K * BITS // 8) + tl.arange(0, BLOCK_N)[:, None] * stride_row
    q = tl.load(rows + (tl.program_id(1) * stride_chunk + offs_r)[None, :], mask=mask, other=0).to(tl.int32)
    k0 = r0 * (8 // BITS)
    g = k0 // group_size
    s = tl.load(s_ptr + g * stride_sz + offs_n, mask=offs_n < N, other=0.0)[:, None]
    z = tl.load(z_ptr + g * stride_sz + offs_n, mask=offs_n < N, other=0).to(tl.int32)[:, None]
    rows = out_ptr + offs_n[:, None] * K
    if BITS == 4:
        tl.store(rows + (k0 + offs_r)[None, :], (((q & 0xF) - z).to(tl.float32) * s).to(out_ptr.dtype.element_ty),
                 mask=mask)
        tl.store(rows + (k0 + BLOCK_R + offs_r)[None, :],
                 (((q >> 4) - z).to(tl.float32) * s).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(rows + (k0 + offs_r)[None, :], ((q - z).to(tl.float32) * s).to(out_ptr.dtype.element_ty), mask=mask)


# --- host side -------------------------------------------------------------------------------------
def dequantize_mma(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                   dtype: torch.dtype, *, bits: int = 4, layout: str = LAYOUT, pair_span: int = 0,
                   tile_n: int = 0) -> torch.Tensor:
    """The weight ``(q - zero) * scale`` [N, K] in ``dtype`` from :func:`repack_mma`'s layout (fp32 product
    rounded once, as ``kernels.torch_quant.dequantize_weight``)."""
    _check_device(qweight)
    w = _mma_weights(qweight, scales, zeros, group_size, bits, layout, pair_span, tile_n)
    out = torch.empty((w.out_features, w.in_features), dtype=dtype, device=qweight.device)
    block_n = w.tile_n or 64
    _dequant_mma_kernel[(triton.cdiv(w.out_features, block_n), w.in_features * bits // 8 // w.step)](
        w.qweight, w.scales, w.zeros, out, w.out_features, w.in_features, w.group_size, *w.strides,
        w.scales.stride(0), BITS=bits, BLOCK_N=block_n, BLOCK_R=w.step, num_warps=4)
    return out


def w4a16_mma(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
              bias: torch.Tensor | None = None, *, bits: int = 4, layout: str = LAYOUT, pair_span: int = 0,
              tile_n: int = 0, config: MmaConfig | None = None, gated: bool = False) -> torch.Tensor:
    """``x @ ((q - zero) * scale).T + bias`` for at most ``MMA_MAX_ROWS`` rows of x, on :func:`repack_mma`'s
    weights (``w4a16_mma(x, **repacked)``); 4 or 8 bits.

    x: [..., K] fp16/bf16/fp32 -> y: [..., N] in x's dtype (fp32 sums, as ``ref_w4a16_linear``). ``gated``: x is
    [..., 2K], a gate and an up projection side by side, and the linear's input is ``silu(gate) * up`` as
    ``kernels.activation.silu_mul`` forms it (bit for bit): for one row of x, in the kernel's x loads (the SwiGLU's
    own launch saved, a decode step at batch 1), for more by ``silu_mul`` first. ``config`` forces a
    configuration (benchmarks and tests).
    """
    _check_device(x)
    if x.dtype not in X_DTYPES:
        raise ValueError(f"x dtype {x.dtype} is not supported ({', '.join(map(str, X_DTYPES))})")
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    num_rows = x2.shape[0]
    cfg = config or default_mma_config(num_rows, x.device, qweight.shape[0], bits)
    w = _mma_weights(qweight, scales, zeros, group_size, bits, layout, pair_span, tile_n)
    if w.tile_n:  # the layout's tiles are the programs' tiles
        cfg = replace(cfg, block_n=w.tile_n)
    if x.dtype == torch.float32:  # the correction's two large sums would cancel below fp32's reference precision
        cfg = replace(cfg, dequant=True)
    if x.shape[-1] != w.in_features * (2 if gated else 1):
        what = f"2 x {w.in_features} (gate and up)" if gated else str(w.in_features)
        raise ValueError(f"x has {x.shape[-1]} input features, the weights take {what} (qweight "
                         f"{tuple(qweight.shape)}, {bits} bits)")
    if bias is not None and tuple(bias.shape) != (w.out_features,):
        raise ValueError(f"bias {tuple(bias.shape)} does not match {w.out_features} output features")
    if num_rows > MMA_MAX_ROWS:
        raise ValueError(f"w4a16_mma takes at most MMA_MAX_ROWS = {MMA_MAX_ROWS} rows of x, got {num_rows} "
                         f"(x {tuple(x.shape)}); use dequantize_mma and a matmul for more")
    for name in ("block_n", "block_m"):
        value = getattr(cfg, name)
        assert value >= _MIN_BLOCK and value & (value - 1) == 0, f"{cfg}: {name} must be a power of 2 >= 16"
    if gated and num_rows > 1:
        from kernels.activation import silu_mul

        x2, gated = silu_mul(x2), False
    n = w.out_features
    y = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return y.reshape(*x.shape[:-1], n)

    num_chunks = w.in_features * bits // 8 // w.step
    chunks = cfg.chunks if cfg.chunks in (1, 2) and num_chunks % cfg.chunks == 0 else 1
    num_steps = num_chunks // chunks
    m_tiles = triton.cdiv(num_rows, cfg.block_m)
    plan = _split_plan(y, num_steps, cfg, torch.float32)
    if plan.split_k > 1 and m_tiles > 1:  # one counter per (M tile, N tile)
        plan.counters = _tile_counters(y.device, m_tiles * plan.grid[0])
    pure = _interpreting() or not x.is_cuda
    launch = pdl.pdl_args(x)
    # what one program reads, for the L2 prefetch before its wait (tiled weights: one contiguous range)
    prefetch = pdl.prefetch_lines(plan.steps_per_split * chunks * w.step * cfg.block_n) \
        if launch["PDL"] and pdl.PREFETCH and w.tile_n else 0
    _w4a16_mma_kernel[(plan.grid[0], plan.split_k, m_tiles)](
        x2, w.qweight, w.scales, w.zeros, bias if bias is not None else y, y, plan.part, plan.counters,
        num_rows, n, w.in_features, w.group_size, plan.steps_per_split, plan.split_k,
        x2.stride(0), *w.strides, w.scales.stride(0),
        BITS=bits, ONE_GROUP=w.group_size == w.in_features, HAS_BIAS=bias is not None, SPLIT=plan.split_k > 1,
        PTX=cfg.ptx_unpack and not pure and x.dtype == torch.bfloat16, IEEE=pure or x.dtype == torch.float32,
        EVEN_N=n % cfg.block_n == 0, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=w.step, CHUNKS=chunks, DEQUANT=cfg.dequant,
        ZSUB=cfg.zsub and bits == 4 and not cfg.dequant, GATED=gated,
        NUM_STAGES=cfg.num_stages, PREFETCH_LINES=prefetch, num_warps=cfg.num_warps, **launch)
    return y.reshape(*x.shape[:-1], n)
