"""Weight-only linears (W4A16, W8A16) for 1-32 rows of x with the weights stored in the tensor-core MMA's register
order ("frag").

``y = x @ ((q - zero) * scale).T + bias`` for bf16 x, 4-bit codes in groups of 128 input features (or one group per
output channel), or 8-bit codes with one group per output channel (the int8 weight-only scheme). At a handful of rows a linear is bound by the bytes of its weights; what keeps a kernel
from reading them at HBM speed is what it does per byte besides the load. ``kernels.w4a16_mma`` lets Triton's
``tl.dot`` place operands, which moves x (and the unpacked codes) through shared memory with barriers on every
K step and pads the MMA's M to 16 rows of x. Here the roles are swapped and nothing is shared: the weights are
the MMA's A operand (16 output features x 16 input features per ``mma.sync.m16n8k16``), x is its B operand (8
columns: up to 8 rows of x per MMA), and the codes are stored in the exact order the A operand's registers take,
so that one 16-byte load per lane already holds its fragments for 4 MMAs. Each warp works alone on a tile of 16
output features; no shared memory, no barriers in the K loop.

Layout ("frag", made by :func:`repack_frag` from the passes' [N, K/2] layout; same byte count)::

    qweight uint8 [N, K/2], read as [N/16 tiles][K/64 chunks][32 lanes][4 words][4 bytes]
    lane l = 4 g + c (g < 8, c < 4), word j (input features k = 64 * chunk + 16 j + ...):
        byte 0: q[16 t + g,     k + 2c]     | q[16 t + g,     k + 2c + 8] << 4
        byte 1: q[16 t + g,     k + 2c + 1] | q[16 t + g,     k + 2c + 9] << 4
        byte 2: q[16 t + g + 8, k + 2c]     | q[16 t + g + 8, k + 2c + 8] << 4
        byte 3: q[16 t + g + 8, k + 2c + 1] | q[16 t + g + 8, k + 2c + 9] << 4
    scales fp32 [G, N], zeros uint8 [G, N] (contiguous over n, as the "mma" layout)

A word becomes the A fragment's four bf16x2 registers with two byte permutes, two shifts and four LOPs (each
nibble ORed into the mantissa of 128.0, as ``kernels.w4a16_mma``), and the zero point comes off in one packed
bf16 FMA per register (``128 + q - (128 + z)``: exact, small integers): 12 instructions and one MMA per 4 weight
bytes per lane. The MMA sums a group's 128 products in fp32; the group's scale multiplies them once (fp32 FMA
into the running total). Lanes 4b..4b+3 hold row b of x in the B operand (loaded straight from global memory,
L1-resident; rows >= M are zeros); each lane ends with y[2c, 2c + 1] x [16 t + g, 16 t + g + 8].

8-bit codes: a chunk is 32 input features, a word 4 codes (two words per k16 step: bytes of rows g, g + 8 at
features 2c, 2c + 1, then the same at + 8); each code is split into its nibbles, unpacked as above, and
``q - z = 16 (hi - z // 16) + (lo - z % 16)`` exactly, so two MMAs per A fragment (one per nibble) with separate
sums, combined as ``(16 hi + lo) * scale`` at the end: bf16 holds no 8-bit code plus an offset exactly.

A program is ``warps`` warps on adjacent tiles over one range of K (split-K across programs for the SMs: the
last program of a tile group adds the fp32 partials in split order, deterministic, and writes y). Loads run one
or two K iterations (128 input features, 1 KB per warp) ahead of the MMAs, in registers; the first weight loads
are issued before the programmatic-dependent-launch wait (weights are constants), x's after it.

Work of the neighbouring nodes the kernel can take over (``w4a16_frag``'s arguments; ``runtime.executor.plan_fusions``
decides): the SwiGLU of a merged gate/up (its rows interleaved per tile, :func:`gate_up_order`; the programs that
write y store silu(gate) * up), the residual add after a linear (those programs add the residual and store their
rows' sums of squares), and the RMSNorm of x (x's registers normalised as they are loaded, the rstd from the
producer's sums of squares; :class:`PendingNorm`).

The K loop is inline PTX (``mma.sync``, the unpacking, the loads), run once per thread: a Triton tensor of one
element per thread carries each register, and the PTX finds its lane from ``%tid.x``, so nothing depends on how
Triton lays tensors out. It runs on CUDA only (sm_80+); under TRITON_INTERPRET and on the CPU the layout is
exercised by :func:`dequantize_frag` (plain Triton) and the tests' lane-level emulation. Rows of x beyond
``FRAG_MAX_ROWS``, fp16/fp32 x and other group sizes go to ``kernels.w4a16_mma``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.activation import silu_mul_values
from kernels.gemv import _num_sms, _tile_counters, shape_config
from kernels.pdl import prefetch_l2_rows, wait_prior
from kernels.torch_quant import unpack_int4
from kernels.w4a16_gemm import _check_device, _interpreting

LAYOUT = "frag"
TILE_N = 16  # output features per tile (the MMA's M)
WARP_N = 32  # output features per warp (two tiles: x's registers serve both)
CHUNK_K = 64  # input features per 16-byte lane load (4 MMAs of k16)
ITER_K = 128  # input features per K iteration (one group of 128)
ROWS_PER_MMA = 8  # rows of x per MMA (its N)
LAUNCH_MAX_ROWS = 32  # rows of x per launch: 1, 2 or 4 MMAs per A fragment (BATCH_TILE_COUNTS)
FRAG_MAX_ROWS = 128  # rows of x w4a16_frag takes (launches of LAUNCH_MAX_ROWS, each reading the weights)
# The runtime's 4-bit layout for bf16 artifacts where supports() (KERNELS_W4A16_FRAG=0: kernels.w4a16_mma's
# instead). Up to FRAG_RUNTIME_MAX_ROWS rows of x the runtime runs this kernel, beyond it the weight dequantized
# for cuBLAS. Measured on an H100 at Llama-3-8B shapes (docs/BENCHMARKS.md, session 12): one layer's four 4-bit
# linears 62 us at 1 row against 78 for the mma kernel, 66 vs 90 at 8, 79 vs 95 at 16, 112 vs 159 at 32.
FRAG_ENABLED = os.environ.get("KERNELS_W4A16_FRAG", "1") != "0"
FRAG_RUNTIME_MAX_ROWS = 64
# auto split_k: the sweep's best splits at 1-8 rows give 384-448 programs on 132 SMs (H100);
# KERNELS_FRAG_PROGRAMS_PER_SM sets another target for A/B runs
_PROGRAMS_PER_SM_SETTING = os.environ.get("KERNELS_FRAG_PROGRAMS_PER_SM", "3")
try:
    _PROGRAMS_PER_SM = float(_PROGRAMS_PER_SM_SETTING)
except ValueError:
    _PROGRAMS_PER_SM = 0.0
if not _PROGRAMS_PER_SM > 0:
    raise ValueError(f"KERNELS_FRAG_PROGRAMS_PER_SM={_PROGRAMS_PER_SM_SETTING!r}: expected a positive number (3 by "
                     "default; the H100 and H200 sweeps' best, docs/BENCHMARKS.md sessions 21 and 27)")
_MIN_ITERS_PER_SPLIT = 2
_MAX_SPLIT_K = 32


@dataclass(frozen=True)
class FragConfig:
    """One launch configuration of :func:`w4a16_frag`."""

    warps: int = 4  # warps (32 output features each) per program
    split_k: int = 0  # programs sharing a tile's K range; 0 = about _PROGRAMS_PER_SM programs per SM
    depth: int = 2  # K iterations (1 KB of weights per warp each) loaded ahead of the MMAs: 1 to 4
    # with PDL: the program's whole range of codes, scales and zeros asked of the L2 before the wait (kernels.pdl,
    # "Range prefetch"), not only the first ``depth`` iterations loaded into registers
    prefetch_range: bool = False


def supports(bits: int, group_size: int, in_features: int, out_features: int) -> bool:
    """Whether :func:`repack_frag` / :func:`w4a16_frag` take these weights: 4-bit codes in groups of 128 (or one
    group per channel), 8-bit codes with one group per channel (int8 weight-only)."""
    if out_features % WARP_N:
        return False
    if bits == 4:
        return in_features % ITER_K == 0 and group_size in (ITER_K, -1, in_features)
    return bits == 8 and in_features % (ITER_K // 2) == 0 and group_size in (-1, in_features)


def runtime_layout(bits: int, group_size: int, in_features: int, out_features: int, dtype: torch.dtype) -> bool:
    """Whether the runtime keeps a weight-only linear of this shape, in an artifact of activation ``dtype``, on this
    layout (else ``kernels.w4a16_mma``'s). Not under TRITON_INTERPRET: the kernel is PTX, so the interpreter's
    runs keep testing the mma kernel."""
    return (FRAG_ENABLED and dtype == torch.bfloat16 and supports(bits, group_size, in_features, out_features)
            and not _interpreting())


# --- layout ----------------------------------------------------------------------------------------
def _shape(qweight: torch.Tensor, bits: int) -> tuple[int, int]:
    n, cols = qweight.shape
    return n, cols * 8 // bits


def mma_order(block: int) -> torch.Tensor:
    """The input features of one K iteration (``block``: 128 for 4-bit codes, 64 for 8-bit) in the order the
    MMAs take them: entry ``16 w + 8 h + 2 c + e`` (k16 step w, lane column c, half h, element e) is feature
    ``32 (w // 2) + 8 c + 4 (w % 2) + 2 h + e``. The weights are stored in this order and x read in its own, so
    that lane c's B registers are x's features 8c .. 8c + 7 of each 32: one 16-byte load per 4 registers instead
    of one 4-byte load per register (a permutation of K inside one quantization group changes no sum)."""
    k = torch.arange(block)
    w, h, c, e = k // 16, (k // 8) % 2, (k // 2) % 4, k % 2
    return 32 * (w // 2) + 8 * c + 4 * (w % 2) + 2 * h + e


def repack_frag(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                bits: int = 4) -> dict[str, torch.Tensor | int | str]:
    """The passes' layout (``qweight`` [N, K/2] for 4 bits, [N, K] for 8, ``scales`` / ``zeros`` [N, G]) -> the
    "frag" layout (module docstring), as keyword arguments of :func:`w4a16_frag` and :func:`dequantize_frag`."""
    if qweight.dtype != torch.uint8 or zeros.dtype != torch.uint8 or scales.dtype != torch.float32:
        raise ValueError(f"expected qweight uint8, scales fp32, zeros uint8; got {qweight.dtype}, {scales.dtype}, "
                         f"{zeros.dtype}")
    n, k = _shape(qweight, bits)
    if not supports(bits, group_size, k, n):
        raise ValueError(f"the frag layout takes 4-bit weights with N a multiple of {WARP_N}, K a multiple of "
                         f"{ITER_K} and groups of {ITER_K} (or one per channel), or 8-bit ones with one group per "
                         f"channel and K a multiple of {ITER_K // 2}; got {bits} bits [{n}, {k}], group_size "
                         f"{group_size}")
    num_groups = 1 if group_size in (-1, k) else k // group_size
    if tuple(scales.shape) != (n, num_groups) or tuple(zeros.shape) != (n, num_groups):
        raise ValueError(f"scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} do not match qweight "
                         f"{tuple(qweight.shape)} with group_size {group_size} (expected {(n, num_groups)})")
    block = 512 // bits
    codes = unpack_int4(qweight) if bits == 4 else qweight  # [N, K]
    codes = codes.reshape(n, k // block, block)[:, :, mma_order(block).to(codes.device)].reshape(n, k)
    if bits == 4:
        q = codes
        # n = 16 t + 8 h + g; k (in MMA order) = 64 chunk + 16 j + 8 half + 2 c + e
        q = q.reshape(n // TILE_N, 2, 8, k // CHUNK_K, 4, 2, 4, 2)  # t, h, g, chunk, j, half, c, e
        packed = q[:, :, :, :, :, 0] | (q[:, :, :, :, :, 1] << 4)  # t, h, g, chunk, j, c, e
        packed = packed.permute(0, 3, 2, 5, 4, 1, 6)  # t, chunk, g, c, j, h, e
    else:  # k (in MMA order) = 32 chunk + 16 s + 8 half + 2 c + e; word j = 2 s + half
        q = codes.reshape(n // TILE_N, 2, 8, k // 32, 2, 2, 4, 2)  # t, h, g, chunk, s, half, c, e
        packed = q.permute(0, 3, 2, 6, 4, 5, 1, 7)  # t, chunk, g, c, s, half, h, e
    return {"qweight": packed.reshape(qweight.shape).contiguous(), "scales": scales.t().contiguous(),
            "zeros": zeros.t().contiguous(), "group_size": group_size, "bits": bits, "layout": LAYOUT}


def unrepack_frag(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                  bits: int = 4, layout: str = LAYOUT) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qweight, scales, zeros) of the "frag" layout -> the passes' layout (the inverse of :func:`repack_frag`)."""
    n, k = _shape(qweight, bits)
    if bits == 4:
        p = qweight.reshape(n // TILE_N, k // CHUNK_K, 8, 4, 4, 2, 2)  # t, chunk, g, c, j, h, e
        p = p.permute(0, 5, 2, 1, 4, 3, 6)  # t, h, g, chunk, j, c, e
        mma = torch.stack((p & 0x0F, p >> 4), dim=5).reshape(n, k)  # t, h, g, chunk, j, half, c, e
    else:
        p = qweight.reshape(n // TILE_N, k // 32, 8, 4, 2, 2, 2, 2)  # t, chunk, g, c, s, half, h, e
        mma = p.permute(0, 6, 2, 1, 4, 5, 3, 7).reshape(n, k)  # t, h, g, chunk, s, half, c, e
    block = 512 // bits
    codes = torch.empty_like(mma).reshape(n, k // block, block)
    codes[:, :, mma_order(block).to(mma.device)] = mma.reshape(n, k // block, block)
    codes = codes.reshape(n, k)
    q = codes[:, 0::2] | (codes[:, 1::2] << 4) if bits == 4 else codes
    return q.contiguous(), scales.t().contiguous(), zeros.t().contiguous()


def gate_up_order(out_features: int) -> torch.Tensor:
    """The row order of a merged [gate | up] weight (``out_features`` = 2 I rows, I a multiple of 16) for the gated
    kernel (``w4a16_frag(..., gated=True)``): 16 gate rows, then the same 16 rows of up, and so on, so that each
    warp's two tiles are one gate tile and its up tile (any warp count)."""
    if out_features % (2 * TILE_N):
        raise ValueError(f"a merged gate/up of {out_features} rows does not split into two halves of whole "
                         f"{TILE_N}-row tiles")
    half = torch.arange(out_features // 2).reshape(-1, TILE_N)
    return torch.stack((half, half + out_features // 2), dim=1).reshape(-1)


def interleave_gate_up(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                       bias: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """A merged [gate | up] linear in the passes' layout (rows = output features) in :func:`gate_up_order`, for
    :func:`repack_frag` then ``w4a16_frag(..., gated=True)``; the bias (or None) alike."""
    order = gate_up_order(qweight.shape[0]).to(qweight.device)
    return (qweight[order].contiguous(), scales[order].contiguous(), zeros[order].contiguous(),
            None if bias is None else bias[order].contiguous())


def deinterleave_gate_up(y: torch.Tensor) -> torch.Tensor:
    """A linear's output [..., 2 I] in :func:`gate_up_order` back to [gate | up] (a copy)."""
    n = y.shape[-1]
    return y.reshape(*y.shape[:-1], n // (2 * TILE_N), 2, TILE_N).transpose(-3, -2).reshape(y.shape)


@dataclass
class _FragWeights:
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    out_features: int  # N
    in_features: int  # K
    one_group: bool
    bits: int


def _frag_weights(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, bits: int,
                  layout: str) -> _FragWeights:
    """Validates :func:`repack_frag`'s output (user-facing errors)."""
    if layout != LAYOUT:
        raise ValueError(f"w4a16_frag / dequantize_frag take the {LAYOUT!r} layout (kernels.w4a16_frag.repack_frag), "
                         f"not {layout!r}")
    if qweight.dim() != 2 or qweight.dtype != torch.uint8:
        raise ValueError(f"expected a 2-D uint8 qweight, got {qweight.dtype} {tuple(qweight.shape)}")
    if bits not in (4, 8):
        raise ValueError(f"bits {bits} is not supported (4 or 8)")
    n, k = _shape(qweight, bits)
    if not supports(bits, group_size, k, n):
        raise ValueError(f"qweight {tuple(qweight.shape)} ({bits} bits) with group_size {group_size} is not a frag "
                         f"layout (N a multiple of {WARP_N}; 4 bits: K of {ITER_K}, groups of {ITER_K} or one per "
                         f"channel; 8 bits: K of {ITER_K // 2}, one group per channel)")
    num_groups = 1 if group_size in (-1, k) else k // group_size
    if tuple(scales.shape) != (num_groups, n) or tuple(zeros.shape) != (num_groups, n) \
            or scales.dtype != torch.float32 or zeros.dtype != torch.uint8:
        raise ValueError(f"scales {scales.dtype} {tuple(scales.shape)} / zeros {zeros.dtype} {tuple(zeros.shape)} "
                         f"do not match: expected fp32 / uint8 {(num_groups, n)}")
    if n * k >= 2**31:
        raise ValueError(f"qweight {tuple(qweight.shape)}: {n} x {k} weights are more than the kernels' 32-bit "
                         "offsets address")
    return _FragWeights(qweight.contiguous(), scales.contiguous(), zeros.contiguous(), n, k, num_groups == 1, bits)


# --- dequantization (plain Triton: prefill sizes, and the layout's check under the interpreter) ---------------
@triton.jit
def _dequant_frag_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, N, K, ONE_GROUP: tl.constexpr, BITS: tl.constexpr,
                         CHUNKS: tl.constexpr):
    # one program per (tile of 16 output features, CHUNKS chunks of 512 bytes): out [16, CHUNKS x the chunk's
    # features] in row order (coalesced stores), each code gathered from its byte (cached loads)
    CK: tl.constexpr = 256 // BITS  # input features per chunk: 64 (4 bits), 32 (8 bits)
    t = tl.program_id(0)
    r = tl.arange(0, 16)[:, None]  # row within the tile: g = r % 8, h = r // 8
    k = tl.program_id(1) * (CK * CHUNKS) + tl.arange(0, CK * CHUNKS)[None, :]  # natural order (the output's)
    f = k % 32  # the feature's place in the MMA order (mma_order inverted): f = 32 a + 8 c + 4 b + 2 h + e
    kk = (k % (2 * CK)) // 32 * 32 + (f % 8) // 4 * 16 + (f % 4) // 2 * 8 + f // 8 * 2 + f % 2
    kk = kk % CK  # within its chunk
    rem = kk % 16  # within its k16 step: half (+ 8), c, e
    if BITS == 4:  # word j = kk // 16; the high nibble holds feature + 8
        word = kk // 16
    else:  # word 2 s + half, s = kk // 16
        word = 2 * (kk // 16) + rem // 8
    byte = (4 * (r % 8) + (rem % 8) // 2) * 16 + 4 * word + 2 * (r // 8) + rem % 2
    chunk = (k // (2 * CK)) * 2 + (k % (2 * CK)) // 32 * 32 // CK  # the chunk holding the MMA-order position
    q = tl.load(qw_ptr + (t * (K // CK) + chunk) * 512 + byte).to(tl.int32)
    if BITS == 4:
        q = tl.where(rem >= 8, q >> 4, q & 0xF)
    row = t * 16 + r
    grp = 0 if ONE_GROUP else k // 128
    s = tl.load(s_ptr + grp * N + row)
    z = tl.load(z_ptr + grp * N + row).to(tl.int32)
    tl.store(out_ptr + row * K + k, ((q - z).to(tl.float32) * s).to(out_ptr.dtype.element_ty))


@triton.jit
def _word_ptrs(qw_ptr, tile0, K, TILES: tl.constexpr, BITS: tl.constexpr):
    """int32* [(t, g), (chunk, c, j)] to the words of tiles tile0 .. tile0 + TILES - 1 at the first K iteration (add
    256 per iteration: 1 KB of codes per tile, two 512-byte chunks): runs of 16 contiguous words. Word
    (4 g + c) * 4 + j of a chunk belongs to lane 4 g + c (module docstring); j = 2 s + half for 8 bits."""
    r = tl.arange(0, 8 * TILES)
    t = tile0 + r // 8
    g = r % 8
    col = tl.arange(0, 32)
    chunk, c, j = col // 16, (col // 4) % 4, col % 4
    return (qw_ptr.to(tl.pointer_type(tl.int32)) + (t[:, None] * (K * BITS // 256) + chunk[None, :]) * 128
            + (4 * g[:, None] + c[None, :]) * 4 + j[None, :])


@triton.jit
def _unpack_words(words, TILES: tl.constexpr, BITS: tl.constexpr):
    """The codes of one K iteration's words (:func:`_word_ptrs`) as int32 [16 TILES, 128 (4 bits) or 64 (8 bits)]:
    row n = 16 t + 8 h + g of the tiles, input features in natural order.

    4 bits: nibble (h, half, e) of word (chunk, c, j) at shift 16 h + 8 e + 4 half is row 16 t + 8 h + g at the
    MMA-order position 64 chunk + 16 j + 8 half + 2 c + e, input feature 64 chunk + 32 (j // 2) + 8 c + 4 (j % 2)
    + 2 half + e of the group (mma_order): reshaped by those digits and permuted to [(t, h, g), (chunk, j // 2, c,
    j % 2, half, e)]. The nibbles are taken in (half, e) order, so each thread's run of 8 features (j % 2, half, e)
    is in register order. 8 bits: byte (h, e) of word (chunk, c, s, half) at shift 16 h + 8 e is row
    16 t + 8 h + g at feature 32 chunk + 8 c + 4 s + 2 half + e: the words' own order once h is next to t."""
    hh = tl.arange(0, 2)[:, None]
    if BITS == 4:
        uu = tl.arange(0, 4)[None, :]
        shifts = 16 * hh + 8 * (uu % 2) + 4 * (uu // 2)
        q = (words[:, None, :, None] >> shifts[None, :, None, :]) & 0xF  # [(t, g), h, (chunk, c, j), (half, e)]
        q = tl.reshape(q, (TILES, 8, 2, 2, 4, 2, 2, 2, 2))  # t, g, h, chunk, c, j // 2, j % 2, half, e
        q = tl.permute(q, (0, 2, 1, 3, 5, 4, 6, 7, 8))  # t, h, g, chunk, j // 2, c, j % 2, half, e
        return tl.reshape(q, (16 * TILES, 128))
    else:
        shifts = 16 * hh + 8 * tl.arange(0, 2)[None, :]
        q = (words[:, None, :, None] >> shifts[None, :, None, :]) & 0xFF  # [(t, g), h, (chunk, c, s, half), e]
        q = tl.permute(tl.reshape(q, (TILES, 8, 2, 64)), (0, 2, 1, 3))  # t, h, g, k
        return tl.reshape(q, (16 * TILES, 64))


@triton.jit
def _dequant_words_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, N, K, ONE_GROUP: tl.constexpr, BITS: tl.constexpr,
                          TILES: tl.constexpr, ITERS: tl.constexpr):
    # one program per (TILES tiles of 16 features, ITERS K iterations): each iteration's words loaded whole,
    # unpacked into natural feature order (_unpack_words) and stored as [16 TILES, IT_K] rows
    IT_K: tl.constexpr = 128 if BITS == 4 else 64
    w_ptrs = _word_ptrs(qw_ptr, tl.program_id(0) * TILES, K, TILES, BITS)
    n = tl.program_id(0) * (16 * TILES) + tl.arange(0, 16 * TILES)
    kk = tl.arange(0, IT_K)
    if ONE_GROUP:
        z = tl.load(z_ptr + n).to(tl.int32)
        s = tl.load(s_ptr + n)
    for i in range(ITERS):
        it = tl.program_id(1) * ITERS + i
        q = _unpack_words(tl.load(w_ptrs + it * 256), TILES, BITS)
        if not ONE_GROUP:  # 4 bits in groups of 128: one group per iteration
            z = tl.load(z_ptr + it * N + n).to(tl.int32)
            s = tl.load(s_ptr + it * N + n)
        w = (q - z[:, None]).to(tl.float32) * s[:, None]
        tl.store(out_ptr + n.to(tl.int64)[:, None] * K + it * IT_K + kk[None, :], w.to(out_ptr.dtype.element_ty))


def dequantize_frag(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    dtype: torch.dtype, *, bits: int = 4, layout: str = LAYOUT, by_words: bool = True) -> torch.Tensor:
    """The weight ``(q - zero) * scale`` [N, K] in ``dtype`` from :func:`repack_frag`'s layout (fp32 product
    rounded once, as ``kernels.torch_quant.dequantize_weight``): whole words unpacked (``by_words``, the default),
    or each code gathered from its byte (kept for comparison)."""
    _check_device(qweight)
    w = _frag_weights(qweight, scales, zeros, group_size, bits, layout)
    out = torch.empty((w.out_features, w.in_features), dtype=dtype, device=qweight.device)
    if by_words:
        tiles = next(t for t in (4, 2, 1) if (w.out_features // TILE_N) % t == 0)
        total_iters = w.in_features * bits // 512  # 1 KB of codes per tile each
        iters = next(i for i in (4, 2, 1) if total_iters % i == 0)
        _dequant_words_kernel[(w.out_features // (TILE_N * tiles), total_iters // iters)](
            w.qweight, w.scales, w.zeros, out, w.out_features, w.in_features, ONE_GROUP=w.one_group, BITS=bits,
            TILES=tiles, ITERS=iters, num_warps=4)
        return out
    num_chunks = w.in_features * bits // 256  # 512-byte chunks per tile (even)
    chunks = 2 if _interpreting() else next(c for c in (8, 4, 2) if num_chunks % c == 0)
    _dequant_frag_kernel[(w.out_features // TILE_N, num_chunks // chunks)](
        w.qweight, w.scales, w.zeros, out, w.out_features, w.in_features, ONE_GROUP=w.one_group, BITS=bits,
        CHUNKS=chunks, num_warps=4)
    return out


# --- the kernel's PTX ----------------------------------------------------------------------------------
# Operands are numbered outputs first, then inputs. Every block finds its lane and warp from %tid.x; warp w of a
# program works on the program's tiles 2w and 2w + 1 (32 output features), lane 4g + c on rows g and g + 8 of each.
_LANE = """
mov.u32 tid, %tid.x;
and.b32 lane, tid, 31;
shr.u32 warp, tid, 5;
shr.u32 g, lane, 2;
and.b32 c, lane, 3;
"""
_LANE_REGS = ".reg .u32 tid, lane, warp, g, c;\n.reg .u64 a, o;\n"


# The codes' load instruction: the read-only path without an L1 line (bytes read once; the x rows every warp reads
# stay in L1). Measured on an H100 (docs/BENCHMARKS.md, session 21): one layer's four linears at one row 57.4 against
# 60.5 us with plain .nc, AWQ int4 batch-1 decode 374.7 against 368.2 tok/s. KERNELS_FRAG_LOAD picks another for
# A/B runs.
_LOAD_OPS = {
    "nc_na": "ld.global.nc.L1::no_allocate.v4.b32",
    "nc": "ld.global.nc.v4.b32",
    "nc_256": "ld.global.nc.L2::256B.v4.b32",  # the L2 fetches 256-byte blocks from HBM
    "nc_na_256": "ld.global.nc.L1::no_allocate.L2::256B.v4.b32",
    "cs": "ld.global.cs.v4.b32",  # streaming (evict first)
    "plain": "ld.global.v4.b32",
}
_LOAD_OP = os.environ.get("KERNELS_FRAG_LOAD", "nc_na")
if _LOAD_OP not in _LOAD_OPS:
    raise ValueError(f"KERNELS_FRAG_LOAD={_LOAD_OP!r}: expected one of {', '.join(_LOAD_OPS)}")


def _load_weights_ptx() -> str:
    """$0..$15 <- the lane's 64 bytes of one K iteration (2 tiles x 2 chunks): $16 the program's first tile at
    this iteration (u8*), $17 bytes between tiles."""
    return ("{\n" + _LANE_REGS + _LANE + """
shl.b32 warp, warp, 1;
mul.wide.u32 a, warp, $17;
add.u64 a, a, $16;
mul.wide.u32 o, lane, 16;
add.u64 a, a, o;
cvt.u64.u32 o, $17;
LD {$0, $1, $2, $3}, [a];
LD {$4, $5, $6, $7}, [a+512];
add.u64 a, a, o;
LD {$8, $9, $10, $11}, [a];
LD {$12, $13, $14, $15}, [a+512];
}""").replace("LD", _LOAD_OPS[_LOAD_OP])


def _load_x_ptx(batch_tiles: int, regs: int = 16) -> str:
    """$0..$(regs bt - 1) <- the lane's B registers of one K iteration (``regs`` per batch tile: 16 for the 128
    features of a 4-bit iteration, 8 for the 64 of an 8-bit one): lane 4b + c's registers 4q .. 4q + 3 of batch
    tile t are x[b + 8t, 32q + 8c .. 32q + 8c + 7], one 16-byte load (the features in :func:`mma_order`); rows
    past M read row M - 1 (their sums are never stored). Inputs: x (bf16* at the iteration's first feature, 16-byte
    aligned), x's row stride in bytes, M."""
    n = regs * batch_tiles
    x_ptr, x_stride, m = f"${n}", f"${n + 1}", f"${n + 2}"
    lines = ["{", _LANE_REGS, ".reg .u32 b, last;", _LANE, f"sub.u32 last, {m}, 1;"]
    for bt in range(batch_tiles):
        lines += [f"add.u32 b, g, {8 * bt};",
                  "min.u32 b, b, last;",
                  f"mul.wide.u32 a, b, {x_stride};",
                  f"add.u64 a, a, {x_ptr};",
                  "mul.wide.u32 o, c, 16;",
                  "add.u64 a, a, o;"]
        lines += [f"ld.global.v4.b32 {{{', '.join(f'${regs * bt + 4 * q + i}' for i in range(4))}}}, [a+{64 * q}];"
                  for q in range(regs // 4)]
    lines.append("}")
    return "\n".join(lines)


def _load_gain_ptx(regs: int = 16) -> str:
    """$0..$(regs - 1) <- a norm's gain (bf16) at the features of the lane's x registers of one K iteration
    (:func:`_load_x_ptx`'s order; the same for every row). Input: the gain (bf16* at the iteration's first
    feature)."""
    lines = ["{", _LANE_REGS, _LANE, "mul.wide.u32 o, c, 16;", f"add.u64 a, ${regs}, o;"]
    lines += [f"ld.global.nc.v4.b32 {{{', '.join(f'${4 * q + i}' for i in range(4))}}}, [a+{64 * q}];"
              for q in range(regs // 4)]
    lines.append("}")
    return "\n".join(lines)


def _norm_x_ptx(batch_tiles: int, regs: int = 16) -> str:
    """The lane's x registers of one K iteration (bf16x2, a residual stream's total) -> the RMSNorm's output,
    ``bf16(bf16(x * rstd) * gain)`` per element (``kernels.fused_norm``'s numerics: the normalised value rounded
    before the gain, the product rounded once). Outputs $0..$(n - 1) (n = regs bt); inputs: the n x registers,
    ``regs`` gain registers (:func:`_load_gain_ptx`), then one rstd (f32) per batch tile (the lane's row)."""
    n = regs * batch_tiles
    lines = ["{", ".reg .b32 lo, hi, neg0;", "mov.b32 neg0, 0x80008000;"]
    for bt in range(batch_tiles):
        rs = f"${2 * n + regs + bt}"
        for i in range(regs):
            x, gain = f"${n + regs * bt + i}", f"${2 * n + i}"
            lines += [f"shl.b32 lo, {x}, 16;", f"and.b32 hi, {x}, 0xFFFF0000;",
                      f"mul.f32 lo, lo, {rs};", f"mul.f32 hi, hi, {rs};",
                      f"cvt.rn.bf16x2.f32 ${regs * bt + i}, hi, lo;",
                      f"fma.rn.bf16x2 ${regs * bt + i}, ${regs * bt + i}, {gain}, neg0;"]
    lines.append("}")
    return "\n".join(lines)


def _load_group_ptx(bits: int = 4) -> str:
    """$0..$3 <- the lane's rows' scales (tile 0 rows g, g + 8, tile 1 rows g, g + 8), then the zero registers:
    4 bits, $4..$7 <- their bf16x2 -(128 + zero); 8 bits (one group per channel), $4..$7 <- bf16x2
    -(128 + zero % 16), $8..$11 <- bf16x2 -(128 + zero // 16) of the same rows. Inputs after them: scales (fp32*),
    zeros (u8*), both at the group's first column of the program."""
    s, z = ("$8", "$9") if bits == 4 else ("$12", "$13")
    lines = ["{", _LANE_REGS, ".reg .u32 n, z;" if bits == 4 else ".reg .u32 n, z, y;", ".reg .b32 t;", _LANE,
             "shl.b32 n, warp, 5;", "add.u32 n, n, g;",
             "mul.wide.u32 o, n, 4;", f"add.u64 a, {s}, o;",
             "ld.global.nc.f32 $0, [a];", "ld.global.nc.f32 $1, [a+32];",
             "ld.global.nc.f32 $2, [a+64];", "ld.global.nc.f32 $3, [a+96];",
             "cvt.u64.u32 o, n;", f"add.u64 a, {z}, o;"]
    for i in range(4):
        lines.append(f"ld.global.nc.u8 z, [a+{8 * i}];")
        if bits == 4:
            lines += ["or.b32 z, z, 0xC300;", "shl.b32 t, z, 16;", f"or.b32 ${4 + i}, z, t;"]
        else:
            lines += ["and.b32 y, z, 15;", "or.b32 y, y, 0xC300;", "shl.b32 t, y, 16;", f"or.b32 ${4 + i}, y, t;",
                      "shr.u32 y, z, 4;", "or.b32 y, y, 0xC300;", "shl.b32 t, y, 16;", f"or.b32 ${8 + i}, y, t;"]
    lines.append("}")
    return "\n".join(lines)


def _sink_ptx(batch_tiles: int) -> str:
    """For ``kernels.bench`` only (``_BENCH_LOADS_ONLY``): the sums unchanged but for the loaded words, x and group
    registers XORed into the first, so that the K loop's loads stay and its compute is gone: what the loads alone
    read. Inputs as :func:`_compute_ptx`'s (4-bit codes: 16 x registers per batch tile, 8 group registers)."""
    n_out = 8 * batch_tiles
    n_in = 16 + 16 * batch_tiles + 8
    lines = ["{", ".reg .b32 r;", ".reg .f32 f;", f"mov.b32 r, ${n_out};"]
    lines += [f"xor.b32 r, r, ${n_out + i};" for i in range(1, n_in)]
    lines += ["cvt.rn.f32.u32 f, r;", f"add.f32 $0, ${n_out + n_in}, f;"]
    lines += [f"mov.f32 ${i}, ${n_out + n_in + i};" for i in range(1, n_out)]
    lines.append("}")
    return "\n".join(lines)


def _compute_ptx(batch_tiles: int, fold: bool) -> str:
    """One K iteration: 16 words of codes (2 tiles x 2 chunks x 4) -> 16 x batch_tiles MMAs.
    Outputs $0..$(8 bt - 1): the running sums, index (tile x batch_tiles + bt) x 4 + i, i the MMA's C register.
    Inputs: the 16 words, the 16 bt x registers (:func:`_load_x_ptx`), the group's 4 scales and 4 zero registers
    (:func:`_load_group_ptx`), the sums. fold: the group's products scaled into the sums; else (one group per
    channel) the raw products added to them."""
    n_out = 8 * batch_tiles
    w0 = n_out
    x0 = w0 + 16
    s0 = x0 + 16 * batch_tiles
    zz0 = s0 + 4
    t_in = zz0 + 4
    lines = ["{",
             ".reg .b32 t0, t1, h0, h1, u0, u1, u2, u3, one;",
             ".reg .f32 " + ", ".join(f"a{i}" for i in range(n_out)) + ";",
             "mov.b32 one, 0x3F803F80;"]
    if fold:
        lines += [f"mov.f32 a{i}, 0f00000000;" for i in range(n_out)]
    else:
        lines += [f"mov.f32 a{i}, ${t_in + i};" for i in range(n_out)]
    for tile in range(2):
        za, zb = f"${zz0 + 2 * tile}", f"${zz0 + 2 * tile + 1}"
        for w in range(8):  # chunk w // 4, k16 step w % 4: x registers 2w, 2w + 1
            word = f"${w0 + 8 * tile + w}"
            lines += [f"prmt.b32 t0, {word}, 0, 0x4140;",
                      f"prmt.b32 t1, {word}, 0, 0x4342;",
                      "lop3.b32 u0, t0, 0x000F000F, 0x43004300, 0xea;",
                      "lop3.b32 u1, t1, 0x000F000F, 0x43004300, 0xea;",
                      "shr.u32 h0, t0, 4;",
                      "shr.u32 h1, t1, 4;",
                      "lop3.b32 u2, h0, 0x000F000F, 0x43004300, 0xea;",
                      "lop3.b32 u3, h1, 0x000F000F, 0x43004300, 0xea;",
                      f"fma.rn.bf16x2 u0, u0, one, {za};",
                      f"fma.rn.bf16x2 u1, u1, one, {zb};",
                      f"fma.rn.bf16x2 u2, u2, one, {za};",
                      f"fma.rn.bf16x2 u3, u3, one, {zb};"]
            for bt in range(batch_tiles):
                acc = ", ".join(f"a{(tile * batch_tiles + bt) * 4 + i}" for i in range(4))
                xa, xb = f"${x0 + 16 * bt + 2 * w}", f"${x0 + 16 * bt + 2 * w + 1}"
                lines.append(f"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{acc}}}, {{u0, u1, u2, u3}}, "
                             f"{{{xa}, {xb}}}, {{{acc}}};")
    for i in range(n_out):  # C registers 0, 1: row g; 2, 3: row g + 8
        if fold:
            tile, r = i // (4 * batch_tiles), i % 4
            lines.append(f"fma.rn.f32 ${i}, ${s0 + 2 * tile + r // 2}, a{i}, ${t_in + i};")
        else:
            lines.append(f"mov.f32 ${i}, a{i};")
    lines.append("}")
    return "\n".join(lines)


def _store_ptx(batch_tiles: int, scaled: bool, bits: int = 4) -> str:
    """The lane's sums $2..$(n + 1) (n = 8 bt; 8 bits: 16 bt in :func:`_compute8_ptx`'s order, combined as
    16 hi + lo) -> the partials at $(n + 6) (fp32*: the program's first column of its split), times their rows'
    scales $(n + 2)..$(n + 5) when ``scaled`` (one group per channel; 8 bits: always), rows of x < $1 (M),
    $(n + 7) floats between rows; $0 a dummy output."""
    per_tile = 4 * bits // 4  # sums per (tile, batch tile): 4 C registers, twice for 8 bits (low, high nibbles)
    n_in = 2 * batch_tiles * per_tile
    s0, base, stride = n_in + 2, f"${n_in + 6}", f"${n_in + 7}"
    lines = ["{", _LANE_REGS, ".reg .u32 n, b, e;", ".reg .f32 v;", ".reg .pred p;", _LANE]
    for tile in range(2):
        for bt in range(batch_tiles):
            for r in range(4):
                i = 2 + (tile * batch_tiles + bt) * per_tile + r
                scale = f"${s0 + 2 * tile + r // 2}"
                lines += ["shl.b32 n, warp, 5;",
                          "add.u32 n, n, g;",
                          f"mad.lo.u32 b, c, 2, {8 * bt + r % 2};",
                          "setp.lt.u32 p, b, $1;",
                          f"mad.lo.u32 e, b, {stride}, n;",
                          f"add.u32 e, e, {16 * tile + 8 * (r // 2)};",
                          "mul.wide.u32 o, e, 4;",
                          f"add.u64 a, {base}, o;"]
                if bits == 8:
                    lines += [f"fma.rn.f32 v, ${i + 4}, 0f41800000, ${i};", f"mul.f32 v, v, {scale};"]
                else:
                    lines.append(f"mul.f32 v, ${i}, {scale};" if scaled else f"mov.f32 v, ${i};")
                lines.append("@p st.global.f32 [a], v;")
    lines += ["mov.u32 $0, 0;", "}"]
    return "\n".join(lines)


def _compute8_ptx(batch_tiles: int) -> str:
    """One K iteration of 8-bit codes (64 features: 2 tiles x 2 chunks of 32 x 2 k16 steps): each code is
    16 hi + lo, its nibbles unpacked as the 4-bit codes are, q - z = 16 (hi - z // 16) + (lo - z % 16) exactly, and
    the two halves multiplied into separate sums. Outputs $0..$(16 bt - 1): the sums, index (tile x batch_tiles +
    bt) x 8 + i, i < 4 the low nibbles' C registers, i >= 4 the high ones'. Inputs: 16 words, 8 bt x registers,
    4 low and 4 high zero registers (:func:`_load_group_ptx`), the sums."""
    n_out = 16 * batch_tiles
    w0 = n_out
    x0 = w0 + 16
    zl0 = x0 + 8 * batch_tiles
    zh0 = zl0 + 4
    t_in = zh0 + 4
    lines = ["{", ".reg .b32 t0, t1, t2, t3, h0, h1, h2, h3, u0, u1, u2, u3, v0, v1, v2, v3, one;",
             ".reg .f32 " + ", ".join(f"a{i}" for i in range(n_out)) + ";",
             "mov.b32 one, 0x3F803F80;"]
    lines += [f"mov.f32 a{i}, ${t_in + i};" for i in range(n_out)]
    lop = "0x000F000F, 0x43004300, 0xea"
    for tile in range(2):
        zla, zlb, zha, zhb = (f"${zl0 + 2 * tile}", f"${zl0 + 2 * tile + 1}", f"${zh0 + 2 * tile}",
                              f"${zh0 + 2 * tile + 1}")
        for step in range(4):  # k16 step: chunk step // 2, words 2 (step % 2) and the next of that chunk
            wa = f"${w0 + 8 * tile + 4 * (step // 2) + 2 * (step % 2)}"
            wb = f"${w0 + 8 * tile + 4 * (step // 2) + 2 * (step % 2) + 1}"
            lines += [f"prmt.b32 t0, {wa}, 0, 0x4140;", f"prmt.b32 t1, {wa}, 0, 0x4342;",
                      f"prmt.b32 t2, {wb}, 0, 0x4140;", f"prmt.b32 t3, {wb}, 0, 0x4342;",
                      f"lop3.b32 u0, t0, {lop};", f"lop3.b32 u1, t1, {lop};",
                      f"lop3.b32 u2, t2, {lop};", f"lop3.b32 u3, t3, {lop};",
                      "shr.u32 h0, t0, 4;", "shr.u32 h1, t1, 4;", "shr.u32 h2, t2, 4;", "shr.u32 h3, t3, 4;",
                      f"lop3.b32 v0, h0, {lop};", f"lop3.b32 v1, h1, {lop};",
                      f"lop3.b32 v2, h2, {lop};", f"lop3.b32 v3, h3, {lop};",
                      f"fma.rn.bf16x2 u0, u0, one, {zla};", f"fma.rn.bf16x2 u1, u1, one, {zlb};",
                      f"fma.rn.bf16x2 u2, u2, one, {zla};", f"fma.rn.bf16x2 u3, u3, one, {zlb};",
                      f"fma.rn.bf16x2 v0, v0, one, {zha};", f"fma.rn.bf16x2 v1, v1, one, {zhb};",
                      f"fma.rn.bf16x2 v2, v2, one, {zha};", f"fma.rn.bf16x2 v3, v3, one, {zhb};"]
            for bt in range(batch_tiles):
                base = (tile * batch_tiles + bt) * 8
                lo = ", ".join(f"a{base + i}" for i in range(4))
                hi = ", ".join(f"a{base + 4 + i}" for i in range(4))
                xa, xb = f"${x0 + 8 * bt + 2 * step}", f"${x0 + 8 * bt + 2 * step + 1}"
                lines += [f"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{lo}}}, {{u0, u1, u2, u3}}, "
                          f"{{{xa}, {xb}}}, {{{lo}}};",
                          f"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{hi}}}, {{v0, v1, v2, v3}}, "
                          f"{{{xa}, {xb}}}, {{{hi}}};"]
    lines += [f"mov.f32 ${i}, a{i};" for i in range(n_out)]
    lines.append("}")
    return "\n".join(lines)


def _constraints(outputs: str, n_out: int, inputs: str) -> tl.constexpr:
    return tl.constexpr(",".join([f"={outputs}"] * n_out) + "," + inputs)


def _regs(kind: str, n: int) -> str:
    return ",".join([kind] * n)


_LOAD_PTX, _LOAD_CONS = tl.constexpr(_load_weights_ptx()), _constraints("r", 16, "l,r")
_GROUP_PTX, _GROUP_CONS = tl.constexpr(_load_group_ptx()), tl.constexpr("=f,=f,=f,=f,=r,=r,=r,=r,l,l")
_I32, _F32 = tl.int32, tl.float32
_BYTES = tl.constexpr(tl.pointer_type(tl.uint8))
BATCH_TILE_COUNTS = (1, 2, 4)  # 8, 16 or 32 rows of x per launch
# per batch-tile count: x loads, compute (fold / raw), store (plain / scaled), the result types
_X_PTX = {bt: (tl.constexpr(_load_x_ptx(bt)), _constraints("r", 16 * bt, "l,r,r")) for bt in BATCH_TILE_COUNTS}
_C_PTX = {bt: (tl.constexpr(_compute_ptx(bt, True)), tl.constexpr(_compute_ptx(bt, False)),
               _constraints("f", 8 * bt, ",".join([_regs("r", 16 + 16 * bt), _regs("f", 4), _regs("r", 4),
                                                    _regs("f", 8 * bt)])))
          for bt in BATCH_TILE_COUNTS}
_S_PTX = {bt: (tl.constexpr(_store_ptx(bt, False)), tl.constexpr(_store_ptx(bt, True)),
               tl.constexpr("=r,r," + _regs("f", 8 * bt + 4) + ",l,r")) for bt in BATCH_TILE_COUNTS}
_X1_PTX, _X1_CONS = _X_PTX[1]
_X2_PTX, _X2_CONS = _X_PTX[2]
_X4_PTX, _X4_CONS = _X_PTX[4]
_FOLD1_PTX, _RAW1_PTX, _C1_CONS = _C_PTX[1]
_FOLD2_PTX, _RAW2_PTX, _C2_CONS = _C_PTX[2]
_FOLD4_PTX, _RAW4_PTX, _C4_CONS = _C_PTX[4]
_STORE1_PTX, _STORE1S_PTX, _S1_CONS = _S_PTX[1]
_STORE2_PTX, _STORE2S_PTX, _S2_CONS = _S_PTX[2]
_STORE4_PTX, _STORE4S_PTX, _S4_CONS = _S_PTX[4]
_I32X8, _I32X16, _I32X32, _I32X64 = (tl.constexpr((tl.int32,) * n) for n in (8, 16, 32, 64))
_F32X8, _F32X16, _F32X32, _F32X64 = (tl.constexpr((tl.float32,) * n) for n in (8, 16, 32, 64))
# 8-bit codes (one group per channel): x loads of 64 features, the two-nibble compute, the combining store
_X8_PTX = {bt: (tl.constexpr(_load_x_ptx(bt, 8)), _constraints("r", 8 * bt, "l,r,r")) for bt in BATCH_TILE_COUNTS}
_C8_PTX = {bt: (tl.constexpr(_compute8_ptx(bt)),
                _constraints("f", 16 * bt, ",".join([_regs("r", 16 + 8 * bt), _regs("r", 8), _regs("f", 16 * bt)])))
           for bt in BATCH_TILE_COUNTS}
_S8_PTX = {bt: (tl.constexpr(_store_ptx(bt, True, 8)), tl.constexpr("=r,r," + _regs("f", 16 * bt + 4) + ",l,r"))
           for bt in BATCH_TILE_COUNTS}
_X8_1_PTX, _X8_1_CONS = _X8_PTX[1]
_X8_2_PTX, _X8_2_CONS = _X8_PTX[2]
_X8_4_PTX, _X8_4_CONS = _X8_PTX[4]
_C8_1_PTX, _C8_1_CONS = _C8_PTX[1]
_C8_2_PTX, _C8_2_CONS = _C8_PTX[2]
_C8_4_PTX, _C8_4_CONS = _C8_PTX[4]
_S8_1_PTX, _S8_1_CONS = _S8_PTX[1]
_S8_2_PTX, _S8_2_CONS = _S8_PTX[2]
_S8_4_PTX, _S8_4_CONS = _S8_PTX[4]
# kernels.bench's loads-only variant (_BENCH_LOADS_ONLY): 4-bit codes, one batch tile
_SINK1_PTX = tl.constexpr(_sink_ptx(1))
_SINK1_CONS = _constraints("f", 8, ",".join([_regs("r", 32), _regs("f", 4), _regs("r", 4), _regs("f", 8)]))
# a norm applied on load (NORM): the gain's registers, and x's registers normalised
_GAIN_PTX = {regs: (tl.constexpr(_load_gain_ptx(regs)), _constraints("r", regs, "l")) for regs in (8, 16)}
_GAIN16_PTX, _GAIN16_CONS = _GAIN_PTX[16]
_GAIN8_PTX, _GAIN8_CONS = _GAIN_PTX[8]
_NORM_PTX = {(bt, regs): (tl.constexpr(_norm_x_ptx(bt, regs)),
                          _constraints("r", regs * bt, ",".join([_regs("r", regs * bt + regs), _regs("f", bt)])))
             for bt in BATCH_TILE_COUNTS for regs in (8, 16)}
_NORM1_16_PTX, _NORM1_16_CONS = _NORM_PTX[1, 16]
_NORM2_16_PTX, _NORM2_16_CONS = _NORM_PTX[2, 16]
_NORM4_16_PTX, _NORM4_16_CONS = _NORM_PTX[4, 16]
_NORM1_8_PTX, _NORM1_8_CONS = _NORM_PTX[1, 8]
_NORM2_8_PTX, _NORM2_8_CONS = _NORM_PTX[2, 8]
_NORM4_8_PTX, _NORM4_8_CONS = _NORM_PTX[4, 8]
_GROUP8_PTX = tl.constexpr(_load_group_ptx(8))
_GROUP8_CONS = tl.constexpr("=f,=f,=f,=f," + _regs("=r", 8) + ",l,l")


@triton.jit
def _addr(p):
    """A pointer as a byte pointer: the PTX blocks take addresses, and inline assembly wants one pointer type."""
    return p.to(_BYTES, bitcast=True)


@triton.jit
def _load_w(w_it, tile_bytes):
    """The lane's 16 words of codes of one K iteration."""
    return tl.inline_asm_elementwise(_LOAD_PTX, _LOAD_CONS, [w_it, tile_bytes], dtype=_I32X16, is_pure=True, pack=1)


@triton.jit
def _load_x(x_it, x_stride, m, BATCH_TILES: tl.constexpr, BITS: tl.constexpr):
    """The lane's x registers of one K iteration (16 per batch tile; 8 for 8-bit codes). After the PDL wait: not
    pure."""
    if BITS == 8:
        if BATCH_TILES == 1:
            return tl.inline_asm_elementwise(_X8_1_PTX, _X8_1_CONS, [x_it, x_stride, m], dtype=_I32X8,
                                             is_pure=False, pack=1)
        elif BATCH_TILES == 2:
            return tl.inline_asm_elementwise(_X8_2_PTX, _X8_2_CONS, [x_it, x_stride, m], dtype=_I32X16,
                                             is_pure=False, pack=1)
        else:
            return tl.inline_asm_elementwise(_X8_4_PTX, _X8_4_CONS, [x_it, x_stride, m], dtype=_I32X32,
                                             is_pure=False, pack=1)
    elif BATCH_TILES == 1:
        return tl.inline_asm_elementwise(_X1_PTX, _X1_CONS, [x_it, x_stride, m], dtype=_I32X16, is_pure=False,
                                         pack=1)
    elif BATCH_TILES == 2:
        return tl.inline_asm_elementwise(_X2_PTX, _X2_CONS, [x_it, x_stride, m], dtype=_I32X32, is_pure=False,
                                         pack=1)
    else:
        return tl.inline_asm_elementwise(_X4_PTX, _X4_CONS, [x_it, x_stride, m], dtype=_I32X64, is_pure=False,
                                         pack=1)


@triton.jit
def _load_gain(g_it, BITS: tl.constexpr):
    """A norm's gain at the lane's x registers' features of one K iteration (16 registers; 8-bit codes: 8)."""
    if BITS == 8:
        return tl.inline_asm_elementwise(_GAIN8_PTX, _GAIN8_CONS, [g_it], dtype=_I32X8, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(_GAIN16_PTX, _GAIN16_CONS, [g_it], dtype=_I32X16, is_pure=True, pack=1)


@triton.jit
def _norm_x(x, gain, rs, BATCH_TILES: tl.constexpr, BITS: tl.constexpr):
    """x's registers normalised (rstd per batch tile ``rs``, gain registers ``gain``)."""
    if BITS == 8:
        if BATCH_TILES == 1:
            return tl.inline_asm_elementwise(_NORM1_8_PTX, _NORM1_8_CONS, x + gain + (rs[0],), dtype=_I32X8,
                                             is_pure=True, pack=1)
        elif BATCH_TILES == 2:
            return tl.inline_asm_elementwise(_NORM2_8_PTX, _NORM2_8_CONS, x + gain + (rs[0], rs[1]), dtype=_I32X16,
                                             is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise(_NORM4_8_PTX, _NORM4_8_CONS, x + gain + rs, dtype=_I32X32,
                                             is_pure=True, pack=1)
    elif BATCH_TILES == 1:
        return tl.inline_asm_elementwise(_NORM1_16_PTX, _NORM1_16_CONS, x + gain + (rs[0],), dtype=_I32X16,
                                         is_pure=True, pack=1)
    elif BATCH_TILES == 2:
        return tl.inline_asm_elementwise(_NORM2_16_PTX, _NORM2_16_CONS, x + gain + (rs[0], rs[1]), dtype=_I32X32,
                                         is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(_NORM4_16_PTX, _NORM4_16_CONS, x + gain + rs, dtype=_I32X64,
                                         is_pure=True, pack=1)


@triton.jit
def _row_rstd(ss_ptr, row, inv_k, eps, NB: tl.constexpr):
    """rsqrt(mean square + eps) of x's rows ``row`` from their sums of squares in NB parts (a producer's
    programs), added in part order (every program the same sum)."""
    acc = tl.load(ss_ptr + row * NB)
    for j in tl.static_range(1, NB):
        acc += tl.load(ss_ptr + row * NB + j)
    return tl.rsqrt(acc * inv_k + eps)


@triton.jit
def _load_group(s_it, z_it, BITS: tl.constexpr):
    """The lane's rows' scales and zero registers of one group (4 + 4; 8-bit codes: 4 + 8)."""
    if BITS == 8:
        return tl.inline_asm_elementwise(_GROUP8_PTX, _GROUP8_CONS, [s_it, z_it],
                                         dtype=(_F32, _F32, _F32, _F32, _I32, _I32, _I32, _I32, _I32, _I32, _I32,
                                                _I32), is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(_GROUP_PTX, _GROUP_CONS, [s_it, z_it],
                                         dtype=(_F32, _F32, _F32, _F32, _I32, _I32, _I32, _I32), is_pure=True,
                                         pack=1)


@triton.jit
def _load_group_at(s_ptr, z_ptr, it, N, col0, lanes, BITS: tl.constexpr):
    """:func:`_load_group` of group (K iteration) ``it`` at the program's columns."""
    return _load_group(_addr(s_ptr + it * N + col0 + lanes), z_ptr + it * N + col0 + lanes, BITS)


@triton.jit
def _advance(a0, a1, a2, a3, new, DEPTH: tl.constexpr):
    """The loads in flight moved one iteration on: a0 is used now, a1 .. a(DEPTH - 1) are the next ones, ``new``
    (loaded DEPTH ahead) joins last; the slots past DEPTH are not touched."""
    if DEPTH == 1:
        return new, a1, a2, a3
    elif DEPTH == 2:
        return a1, new, a2, a3
    elif DEPTH == 3:
        return a1, a2, new, a3
    else:
        return a1, a2, a3, new


@triton.jit
def _compute(w, x, grp, t, BATCH_TILES: tl.constexpr, FOLD: tl.constexpr, BITS: tl.constexpr,
             LOADS_ONLY: tl.constexpr):
    """The sums ``t`` after one K iteration on the words ``w``, x registers ``x`` and the group ``grp``."""
    if LOADS_ONLY:  # kernels.bench only: 4 bits, one batch tile
        return tl.inline_asm_elementwise(_SINK1_PTX, _SINK1_CONS, w + x + grp + t, dtype=_F32X8, is_pure=True,
                                         pack=1)
    elif BITS == 8:
        zz = (grp[4], grp[5], grp[6], grp[7], grp[8], grp[9], grp[10], grp[11])
        if BATCH_TILES == 1:
            return tl.inline_asm_elementwise(_C8_1_PTX, _C8_1_CONS, w + x + zz + t, dtype=_F32X16, is_pure=True,
                                             pack=1)
        elif BATCH_TILES == 2:
            return tl.inline_asm_elementwise(_C8_2_PTX, _C8_2_CONS, w + x + zz + t, dtype=_F32X32, is_pure=True,
                                             pack=1)
        else:
            return tl.inline_asm_elementwise(_C8_4_PTX, _C8_4_CONS, w + x + zz + t, dtype=_F32X64, is_pure=True,
                                             pack=1)
    elif BATCH_TILES == 1:
        return tl.inline_asm_elementwise(_FOLD1_PTX if FOLD else _RAW1_PTX, _C1_CONS, w + x + grp + t,
                                         dtype=_F32X8, is_pure=True, pack=1)
    elif BATCH_TILES == 2:
        return tl.inline_asm_elementwise(_FOLD2_PTX if FOLD else _RAW2_PTX, _C2_CONS, w + x + grp + t,
                                         dtype=_F32X16, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(_FOLD4_PTX if FOLD else _RAW4_PTX, _C4_CONS, w + x + grp + t,
                                         dtype=_F32X32, is_pure=True, pack=1)


@triton.jit
def _store_partials(m, t, grp, part, n_stride, BATCH_TILES: tl.constexpr, SCALED: tl.constexpr,
                    BITS: tl.constexpr):
    """The sums (times the rows' scales when SCALED; 8-bit: always) into the partials, rows of x < M."""
    args = (m,) + t + (grp[0], grp[1], grp[2], grp[3], part, n_stride)
    if BITS == 8:
        if BATCH_TILES == 1:
            tl.inline_asm_elementwise(_S8_1_PTX, _S8_1_CONS, args, dtype=tl.int32, is_pure=False, pack=1)
        elif BATCH_TILES == 2:
            tl.inline_asm_elementwise(_S8_2_PTX, _S8_2_CONS, args, dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(_S8_4_PTX, _S8_4_CONS, args, dtype=tl.int32, is_pure=False, pack=1)
    elif BATCH_TILES == 1:
        tl.inline_asm_elementwise(_STORE1S_PTX if SCALED else _STORE1_PTX, _S1_CONS, args, dtype=tl.int32,
                                  is_pure=False, pack=1)
    elif BATCH_TILES == 2:
        tl.inline_asm_elementwise(_STORE2S_PTX if SCALED else _STORE2_PTX, _S2_CONS, args, dtype=tl.int32,
                                  is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(_STORE4S_PTX if SCALED else _STORE4_PTX, _S4_CONS, args, dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _w4a16_frag_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, part_ptr, counter_ptr, gain_ptr, xss_ptr, res_ptr, ss_ptr,
    M, N, K, stride_xm, iters_per_split, eps,
    SPLIT_K: tl.constexpr, ONE_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, WARPS: tl.constexpr,
    BATCH_TILES: tl.constexpr, DEPTH: tl.constexpr, BITS: tl.constexpr, PDL: tl.constexpr, GATED: tl.constexpr,
    NORM: tl.constexpr, NBX: tl.constexpr, RESIDUAL: tl.constexpr, LATE_TRIGGER: tl.constexpr,
    LOADS_ONLY: tl.constexpr, RANGE_LINES: tl.constexpr, S_ROWS: tl.constexpr,
):
    # grid (N / (32 WARPS), SPLIT_K); warp w of program p works on tiles 2 (p WARPS + w) and the next. A K
    # iteration is 1 KB of codes per warp: 128 input features of 4-bit codes, 64 of 8-bit ones. GATED: the
    # weights are a merged gate/up in interleave_gate_up's row order (each warp's first tile gate rows, its second
    # the same up rows), and y [M, N / 2] takes silu(gate) * up of the rounded sums. NORM: x is a residual stream's
    # total whose RMSNorm (gain, rows' sums of squares in NBX parts at xss) the K loop applies to x's registers.
    # RESIDUAL: y takes bf16(bf16(x W^T) + residual), and ss [M, programs] each program's sums of squares of it.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    lanes = tl.zeros([32 * WARPS], dtype=tl.int32)  # one element per thread: each PTX block runs once per thread
    col0 = pid_n * WARPS * 32  # the program's first output feature
    ITER_K: tl.constexpr = 512 // BITS
    HALF: tl.constexpr = WARPS * 16  # GATED: outputs per program
    first = pid_k * iters_per_split
    num_iters = min(iters_per_split, K // ITER_K - first)
    last = first + num_iters - 1
    tile_bytes = lanes + 2 * BITS * K  # 16 rows of K BITS / 8 bytes
    w_base = qw_ptr + col0 * (K * BITS // 8)
    if PDL and RANGE_LINES > 0:  # constants: the program's whole range of codes (and its groups) asked of the L2
        prefetch_l2_rows(w_base + first * 1024, 2 * BITS * K, 2 * WARPS, num_iters * 1024, 2 * WARPS, RANGE_LINES,
                         128)
        if not ONE_GROUP:
            prefetch_l2_rows(s_ptr + first * N + col0, N, num_iters, 32 * WARPS, S_ROWS, WARPS, 32)
            prefetch_l2_rows(z_ptr + first * N + col0, N, num_iters, 32 * WARPS, S_ROWS, (WARPS + 3) // 4, 128)
    # the codes of the first DEPTH iterations, and (groups of 128) their scales and zeros: constants, loaded before
    # the wait, and in the loop DEPTH iterations ahead alike (groups one ahead would chain each iteration to an HBM
    # round trip whatever the codes' depth)
    w = _load_w(w_base + first * 1024 + lanes, tile_bytes)
    grp = _load_group_at(s_ptr, z_ptr, 0 if ONE_GROUP else first, N, col0, lanes, BITS)
    w1, w2, w3, g1, g2, g3 = w, w, w, grp, grp, grp
    if DEPTH >= 2:
        w1 = _load_w(w_base + min(first + 1, last) * 1024 + lanes, tile_bytes)
        if not ONE_GROUP:
            g1 = _load_group_at(s_ptr, z_ptr, min(first + 1, last), N, col0, lanes, BITS)
    if DEPTH >= 3:
        w2 = _load_w(w_base + min(first + 2, last) * 1024 + lanes, tile_bytes)
        if not ONE_GROUP:
            g2 = _load_group_at(s_ptr, z_ptr, min(first + 2, last), N, col0, lanes, BITS)
    if DEPTH >= 4:
        w3 = _load_w(w_base + min(first + 3, last) * 1024 + lanes, tile_bytes)
        if not ONE_GROUP:
            g3 = _load_group_at(s_ptr, z_ptr, min(first + 3, last), N, col0, lanes, BITS)
    gain = lanes
    if NORM:  # the gain is a constant of the model
        gain = _load_gain(_addr(gain_ptr + first * ITER_K + lanes), BITS)
    if LATE_TRIGGER:  # the next kernel launches once this one's K loops are done (below)
        if PDL:
            tl.extra.cuda.gdc_wait()
    else:
        wait_prior(PDL)  # x and the partials are the preceding kernels'
    m = lanes + M
    x_stride = lanes + stride_xm * 2
    x = _load_x(_addr(x_ptr + first * ITER_K + lanes), x_stride, m, BATCH_TILES, BITS)
    rs = (tl.zeros([32 * WARPS], dtype=tl.float32),) * 4
    if NORM:  # the rstd of the lane's rows (g + 8 bt, past M the last row's), from the producer's sums of squares
        g_row = (tl.arange(0, 32 * WARPS) % 32) // 4
        inv_k = 1.0 / K
        rs0 = _row_rstd(xss_ptr, tl.minimum(g_row, M - 1), inv_k, eps, NBX)
        rs1, rs2, rs3 = rs0, rs0, rs0
        if BATCH_TILES >= 2:
            rs1 = _row_rstd(xss_ptr, tl.minimum(g_row + 8, M - 1), inv_k, eps, NBX)
        if BATCH_TILES >= 4:
            rs2 = _row_rstd(xss_ptr, tl.minimum(g_row + 16, M - 1), inv_k, eps, NBX)
            rs3 = _row_rstd(xss_ptr, tl.minimum(g_row + 24, M - 1), inv_k, eps, NBX)
        rs = (rs0, rs1, rs2, rs3)
    t = (tl.zeros([32 * WARPS], dtype=tl.float32),) * (8 * BATCH_TILES * (BITS // 4))
    for i in range(0, num_iters):
        it = first + i
        nxt = min(it + 1, last)
        wn = _load_w(w_base + min(it + DEPTH, last) * 1024 + lanes, tile_bytes)
        x2 = _load_x(_addr(x_ptr + nxt * ITER_K + lanes), x_stride, m, BATCH_TILES, BITS)
        gn = grp
        if not ONE_GROUP:
            gn = _load_group_at(s_ptr, z_ptr, min(it + DEPTH, last), N, col0, lanes, BITS)
        if NORM:
            gain2 = _load_gain(_addr(gain_ptr + nxt * ITER_K + lanes), BITS)
            t = _compute(w, _norm_x(x, gain, rs, BATCH_TILES, BITS), grp, t, BATCH_TILES, not ONE_GROUP, BITS,
                         LOADS_ONLY)
            gain = gain2
        else:
            t = _compute(w, x, grp, t, BATCH_TILES, not ONE_GROUP, BITS, LOADS_ONLY)
        w, w1, w2, w3 = _advance(w, w1, w2, w3, wn, DEPTH)
        x = x2
        if not ONE_GROUP:
            grp, g1, g2, g3 = _advance(grp, g1, g2, g3, gn, DEPTH)
    if LATE_TRIGGER:
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
    _store_partials(m, t, grp, _addr(part_ptr + (pid_k * M) * N + col0 + lanes), lanes + N, BATCH_TILES, ONE_GROUP,
                    BITS)
    # the last program of this column range (all of it without a split) adds the partials in split order; the
    # split count is a constexpr so that the partials' loads are unrolled and in flight together (a loop over a
    # runtime count waits out one L2 round trip per split)
    tl.debug_barrier()
    done = True
    if SPLIT_K > 1:
        done = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
    if done:
        if SPLIT_K > 1:
            tl.store(counter_ptr + pid_n, 0)  # zero again for the next launch
        cols = col0 + tl.arange(0, WARPS * 32)[None, :]
        for bt in tl.static_range(BATCH_TILES):  # 8 rows at a time: the unrolled loads' registers stay bounded
            rows = 8 * bt + tl.arange(0, 8)[:, None]
            mask = (rows < M) & (cols < N)
            offs = rows * N + cols
            tot = tl.load(part_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
            for k in tl.static_range(1, SPLIT_K):
                tot += tl.load(part_ptr + k * M * N + offs, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                tot += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
            if GATED:  # [8, (warp, gate | up, 16)] -> gate, up [8, (warp, 16)]: the linear's rounding, then silu_mul's
                v = tl.reshape(tot.to(y_ptr.dtype.element_ty), (8, WARPS, 2, 16))
                g, u = tl.split(tl.reshape(tl.permute(v, (0, 1, 3, 2)), (8, HALF, 2)))
                h_cols = pid_n * HALF + tl.arange(0, HALF)[None, :]
                tl.store(y_ptr + rows * (N // 2) + h_cols, silu_mul_values(g, u), mask=rows < M)
            elif RESIDUAL:  # fused_add_rms_norm's total (the linear's output rounded, plus the residual, rounded)
                r = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                total = (tot.to(y_ptr.dtype.element_ty).to(tl.float32) + r).to(y_ptr.dtype.element_ty)
                tl.store(y_ptr + offs, total, mask=mask)
                tf = total.to(tl.float32)
                ss_rows = 8 * bt + tl.arange(0, 8)
                tl.store(ss_ptr + ss_rows * tl.num_programs(0) + pid_n, tl.sum(tf * tf, axis=1), mask=ss_rows < M)
            else:
                tl.store(y_ptr + offs, tot.to(y_ptr.dtype.element_ty), mask=mask)
            tl.debug_barrier()


# --- host side -------------------------------------------------------------------------------------
# Picked by rows of x (the first bound >= M), from ``python -m kernels.bench.gemm --frag`` on an H100 at the
# Llama-3-8B shapes: 4 warps, K split for about _PROGRAMS_PER_SM programs per SM, one K iteration loaded ahead
# (two to four ahead were slower, codes and groups alike; with the compute taken out the same loads still read at
# ~2.6 TB/s: the kernel is bound by the memory side and its fixed costs, not by bytes in flight; session 21).
_CUDA_CONFIGS: list[tuple[int, FragConfig]] = [
    (ROWS_PER_MMA * 4, FragConfig(warps=4, split_k=0, depth=1)),
]


def _env_config(value: str | None) -> FragConfig | None:
    """KERNELS_FRAG_CONFIG="WARPS/SPLIT_K/DEPTH" (e.g. 4/0/2; split 0: auto): one configuration for every row count,
    for A/B runs of the whole decode step."""
    if not value:
        return None
    parts = value.split("/")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"KERNELS_FRAG_CONFIG={value!r}: expected WARPS/SPLIT_K/DEPTH, e.g. 4/0/2")
    warps, split_k, depth = map(int, parts)
    if warps not in (1, 2, 4, 8) or not 1 <= depth <= 4 or split_k > _MAX_SPLIT_K:
        raise ValueError(f"KERNELS_FRAG_CONFIG={value!r}: warps take 1, 2, 4 or 8, depth 1-4, split_k 0-{_MAX_SPLIT_K}")
    return FragConfig(warps=warps, split_k=split_k, depth=depth)


_ENV_CONFIG = _env_config(os.environ.get("KERNELS_FRAG_CONFIG"))
# kernels.bench only: the K loop's compute replaced by an XOR of what it loaded (wrong sums; 4 bits, up to 8 rows)
_BENCH_LOADS_ONLY = False
# KERNELS_FRAG_LATE_TRIGGER=all|residual|norm (A/B runs): the kernel lets its PDL dependent launch after its K loop
# instead of right after its wait (all launches, those adding a residual, or those applying a norm)
_LATE_TRIGGER = os.environ.get("KERNELS_FRAG_LATE_TRIGGER", "0")
if _LATE_TRIGGER not in ("0", "all", "residual", "norm"):
    raise ValueError(f"KERNELS_FRAG_LATE_TRIGGER={_LATE_TRIGGER!r}: expected 0, all, residual or norm")


# Per device and weight (bits, out_features, in_features): configurations for up to SHAPE_CONFIG_MAX_ROWS rows that beat
# the auto split by more than a run's spread in two sweeps (``SWEEP_VERBOSE=1 python -m kernels.bench.gemm --frag
# --bits B --rows 1 2 4 8 16``; H200, Llama-3-8B shapes, us at 1 / 8 rows, docs/BENCHMARKS.md session 34). The auto
# split aims at 3 programs per SM for every shape; the 8-bit codes (twice the K iterations of 4-bit ones) and the
# widest linear want more, and no one programs-per-SM target fits the four shapes (the sweep's table).
#   8-bit qkv     11.3 / 12.3 -> 11.0 / 11.4     8-bit o_proj 10.9 / 11.9 -> 8.5 / 9.7
#   8-bit gate_up 37.2 / 37.8 -> 32.2 / 32.8     8-bit down   27.1 / 27.9 -> 20.0 / 21.4
# End to end (int8 weight-only, batch 1, same artifact and call): 318.6 -> 354.3 tok/s. 4-bit: the sweep gave gate_up
# 22.1 -> 19.6 us (split 4) and the other shapes within 0.5 us; with gate_up's entry the AWQ batch-1 decode measured
# 454.2 against 455.3 without it, so 4-bit has none (the sweep timed the plain launch; the runtime's gate_up forms the
# SwiGLU and reads a pending norm, not swept).
# 4-bit o_proj: the rows' table's configuration with its range prefetched during the attention before it (session 55:
# AWQ batch 1 452.4 / 452.4 -> 458.5 / 459.3 tok/s, two rounds, same artifact and call; qkv too: 457.6 / 457.5).
# At 16 rows the auto split is as fast or faster for most shapes; shapes not listed take the rows' table.
# KERNELS_SHAPE_CONFIGS=0 leaves the table out (A/B runs; ``kernels.gemv.SHAPE_CONFIGS``).
SHAPE_CONFIG_MAX_ROWS = 8
_SHAPE_CONFIGS: dict[str, dict[tuple[int, int, int], FragConfig]] = {
    "H200": {
        (8, 6144, 4096): FragConfig(warps=2, split_k=16, depth=1),
        (8, 4096, 4096): FragConfig(warps=8, split_k=16, depth=1),
        (8, 28672, 4096): FragConfig(warps=4, split_k=4, depth=1),
        (8, 4096, 14336): FragConfig(warps=8, split_k=16, depth=1),
        (4, 4096, 4096): FragConfig(warps=4, split_k=0, depth=1, prefetch_range=True),
    },
}


def default_frag_config(num_rows: int, device: torch.device, out_features: int = 0, in_features: int = 0,
                        bits: int = 4) -> FragConfig:
    """The configuration for ``num_rows`` rows of x (and, where the device's shape table has the weight, for it)."""
    if _ENV_CONFIG is not None:
        return _ENV_CONFIG
    if num_rows <= SHAPE_CONFIG_MAX_ROWS:
        tuned = shape_config(_SHAPE_CONFIGS, (bits, out_features, in_features), device)
        if tuned is not None:
            return tuned
    return next((cfg for bound, cfg in _CUDA_CONFIGS if num_rows <= bound), _CUDA_CONFIGS[-1][1])


def frag_applies(x: torch.Tensor, num_rows: int) -> bool:
    """Whether :func:`w4a16_frag` runs these rows of x (bf16 on CUDA, at most FRAG_MAX_ROWS rows)."""
    return x.is_cuda and x.dtype == torch.bfloat16 and 1 <= num_rows <= FRAG_MAX_ROWS and not _interpreting()


@dataclass
class ResidualSum:
    """A frag linear's output added to the residual stream (``w4a16_frag(..., residual=)``): ``total`` [rows, N] is
    ``fused_add_rms_norm``'s second output, ``row_ss`` [rows, parts] fp32 the sums of squares of each row's parts
    (one per program), from which a reader finishes the RMSNorm without a norm kernel (:class:`PendingNorm`)."""

    total: torch.Tensor
    row_ss: torch.Tensor


@dataclass
class PendingNorm:
    """``rms_norm(total, weight, eps)`` not applied yet: ``w4a16_frag`` takes it as x and applies it to x's
    registers (the rstd from ``row_ss``); any other reader calls :meth:`materialize` (the norm kernel)."""

    total: torch.Tensor
    row_ss: torch.Tensor
    weight: torch.Tensor
    eps: float

    def materialize(self) -> torch.Tensor:
        from kernels.fused_norm import rms_norm

        return rms_norm(self.total, self.weight, self.eps)


def w4a16_frag(x: torch.Tensor | PendingNorm, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               group_size: int, bias: torch.Tensor | None = None, *, bits: int = 4, layout: str = LAYOUT,
               config: FragConfig | None = None, gated: bool = False,
               residual: torch.Tensor | None = None) -> torch.Tensor | ResidualSum:
    """``x @ ((q - zero) * scale).T + bias`` for 1..FRAG_MAX_ROWS rows of bf16 x on CUDA, on :func:`repack_frag`'s
    weights (``w4a16_frag(x, **repacked)``): one launch per LAUNCH_MAX_ROWS rows. x: [..., K] -> y: [..., N] bf16
    (fp32 sums). Fusions, each formed by the kernel (no launch of its own):

    - ``gated``: the weights are a merged gate/up in :func:`gate_up_order` (:func:`interleave_gate_up`) and y
      [..., N / 2] is ``silu_mul`` of the linear's bf16 output (``kernels.activation``'s numerics);
    - x a :class:`PendingNorm`: the RMSNorm of its total (``kernels.fused_norm``'s numerics; the rstd from the
      producer's per-part sums of squares) applied to x as it is loaded;
    - ``residual`` [..., N]: returns :class:`ResidualSum`, y added to it as ``fused_add_rms_norm`` adds (its
      ``total``), with the rows' sums of squares per program."""
    w = _frag_weights(qweight, scales, zeros, group_size, bits, layout)
    norm = x if isinstance(x, PendingNorm) else None
    if norm is not None:
        x = norm.total
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1 or x2.data_ptr() % 16 or x2.stride(0) % 8:  # the kernel loads x 16 bytes at a time
        x2 = x2.contiguous()
    num_rows = x2.shape[0]
    if not frag_applies(x, num_rows):
        raise ValueError(f"w4a16_frag takes 1..{FRAG_MAX_ROWS} rows of bf16 x on a CUDA device, got {num_rows} "
                         f"rows of {x.dtype} on {x.device}; use kernels.w4a16_mma")
    if x.shape[-1] != w.in_features:
        raise ValueError(f"x has {x.shape[-1]} input features, the weights take {w.in_features}")
    if bias is not None and tuple(bias.shape) != (w.out_features,):
        raise ValueError(f"bias {tuple(bias.shape)} does not match {w.out_features} output features")
    if gated and (w.out_features % (2 * TILE_N) or residual is not None):
        raise ValueError(f"gated: {w.out_features} output features are not a merged gate/up of whole tiles, or a "
                         "residual was given too")
    if norm is not None and (tuple(norm.weight.shape) != (w.in_features,) or norm.weight.dtype != torch.bfloat16
                             or norm.row_ss.dim() != 2 or norm.row_ss.shape[0] != num_rows
                             or norm.row_ss.dtype != torch.float32 or not norm.row_ss.is_contiguous()):
        raise ValueError(f"a PendingNorm needs a bf16 weight of {w.in_features} and fp32 row_ss [{num_rows}, parts], "
                         f"got {norm.weight.dtype} {tuple(norm.weight.shape)} and {norm.row_ss.dtype} "
                         f"{tuple(norm.row_ss.shape)}")
    if residual is not None:
        residual = residual.reshape(-1, residual.shape[-1]).contiguous()
        if tuple(residual.shape) != (num_rows, w.out_features) or residual.dtype != torch.bfloat16:
            raise ValueError(f"residual {residual.dtype} {tuple(residual.shape)} does not match y: bf16 "
                             f"{(num_rows, w.out_features)}")
    out_features = w.out_features // 2 if gated else w.out_features
    y = torch.empty((num_rows, out_features), dtype=torch.bfloat16, device=x.device)
    row_ss = None
    # one configuration for every slice: a residual's row_ss has one part per program, the same for all rows
    cfg = config or default_frag_config(min(num_rows, LAUNCH_MAX_ROWS), x.device, w.out_features, w.in_features,
                                        w.bits)
    for r0 in range(0, num_rows, LAUNCH_MAX_ROWS):  # each slice reads the weights again
        rows = min(LAUNCH_MAX_ROWS, num_rows - r0)
        if residual is not None and row_ss is None:
            row_ss = torch.empty((num_rows, w.out_features // (WARP_N * _warps(cfg, w.out_features))),
                                 dtype=torch.float32, device=x.device)
        _launch(x2[r0: r0 + rows], w, bias, y[r0: r0 + rows], cfg, gated,
                None if norm is None else (norm.weight, norm.row_ss[r0: r0 + rows], norm.eps),
                None if residual is None else (residual[r0: r0 + rows], row_ss[r0: r0 + rows]))
    y = y.reshape(*x.shape[:-1], out_features)
    return y if residual is None else ResidualSum(y, row_ss)


def _warps(cfg: FragConfig, n: int) -> int:
    """Warps per program: the configuration's, halved until the program's 32-feature warps divide N."""
    warps = cfg.warps
    while (n // WARP_N) % warps:
        warps //= 2
    return warps


def _launch(x2: torch.Tensor, w: _FragWeights, bias: torch.Tensor | None, y: torch.Tensor, cfg: FragConfig,
            gated: bool = False, norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
            residual: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    num_rows, n = y.shape[0], w.out_features
    if not 1 <= cfg.depth <= 4:
        raise ValueError(f"FragConfig.depth is {cfg.depth}; the kernel loads 1 to 4 K iterations ahead")
    warps = _warps(cfg, n)
    num_programs = n // (WARP_N * warps)
    total_iters = w.in_features * w.bits // 512  # 1 KB of codes per tile each
    split_k = cfg.split_k
    if not split_k:
        device_index = x2.device.index if x2.device.index is not None else torch.cuda.current_device()
        split_k = min(triton.cdiv(int(_PROGRAMS_PER_SM * _num_sms(device_index)), num_programs),
                      max(total_iters // _MIN_ITERS_PER_SPLIT, 1), _MAX_SPLIT_K)
    split_k = max(1, min(split_k, total_iters))
    iters_per_split = triton.cdiv(total_iters, split_k)
    split_k = triton.cdiv(total_iters, iters_per_split)
    part = torch.empty((split_k, num_rows, n), dtype=torch.float32, device=x2.device)
    counters = _tile_counters(x2.device, num_programs) if split_k > 1 else y
    batch_tiles = next(bt for bt in BATCH_TILE_COUNTS if num_rows <= ROWS_PER_MMA * bt)
    gain, xss, eps = norm if norm is not None else (y, part, 0.0)
    res, ss = residual if residual is not None else (y, part)
    if residual is not None and ss.shape[1] != num_programs:
        raise ValueError(f"row_ss has {ss.shape[1]} parts, this launch {num_programs} programs")
    launch = pdl.pdl_args(x2)
    # KERNELS_PREFETCH_RANGE_KB: each of the program's 2 x warps tiles reads iters_per_split KB of codes
    range_lines = (pdl.range_lines(iters_per_split * 1024, 2 * warps, cfg.prefetch_range)
                   if launch["PDL"] and (cfg.prefetch_range or pdl.range_applies(w.qweight.numel())) else 0)
    _w4a16_frag_kernel[(num_programs, split_k)](
        x2, w.qweight, w.scales, w.zeros, bias if bias is not None else y, y, part, counters, gain, xss, res, ss,
        num_rows, n, w.in_features, x2.stride(0), iters_per_split, eps,
        SPLIT_K=split_k, ONE_GROUP=w.one_group, HAS_BIAS=bias is not None, WARPS=warps, BATCH_TILES=batch_tiles,
        DEPTH=cfg.depth, BITS=w.bits, GATED=gated, NORM=norm is not None,
        NBX=xss.shape[1] if norm is not None else 1, RESIDUAL=residual is not None,
        LATE_TRIGGER=_LATE_TRIGGER == "all" or (_LATE_TRIGGER == "residual" and residual is not None)
        or (_LATE_TRIGGER == "norm" and norm is not None),
        LOADS_ONLY=_BENCH_LOADS_ONLY and w.bits == 4 and batch_tiles == 1, num_warps=warps,
        RANGE_LINES=range_lines, S_ROWS=triton.next_power_of_2(iters_per_split) if range_lines else 1, **launch)


# --- a tensor-core GEMM on the same layout (more rows of x: prefill, batched decode) -------------------------
# Past FRAG_RUNTIME_MAX_ROWS rows the frag kernel re-reads the weights per 32 rows and keeps x in registers; a GEMM
# with tl.dot tiles (wgmma on Hopper) is what those sizes need. Without it the runtime dequantizes the whole weight
# into a bf16 temporary for cuBLAS: a write and re-read of 4x (8 bits: 2x) the packed bytes per call.
#
# Each K iteration loads the program's words whole (_word_ptrs) and unpacks them into a [features, IT_K] tile in
# natural feature order (_unpack_words, which dequantize_frag's word kernel shares), so x's tile is a plain
# contiguous load (pipelined into shared memory).
# Compiled for sm_90 (Triton 3.6) the unpacked tile gets Triton's default blocked layout (one element per thread
# per row; 16-bit stores to shared memory) and the MMA is waited on before the next tile is unpacked: about 200
# TFLOP/s at most, so it pays only where the temporary costs more (gemm_preferred; docs/BENCHMARKS.md, session 17).
@dataclass(frozen=True)
class GemmConfig:
    """One launch configuration of :func:`frag_gemm`."""

    block_m: int = 64  # rows of x per program
    tiles_n: int = 8  # 16-feature tiles per program (block_n = 16 tiles_n; halved until it divides N / 16)
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 0  # programs sharing one output tile's K range; 0: enough programs for GEMM_PROGRAMS_PER_SM


GEMM_PROGRAMS_PER_SM = 2
# Where frag_gemm beats dequantize_frag + cuBLAS (H100, kernels.bench.gemm --frag-gemm [--bits 8], session 17): up to
# 128 rows on weights of at least GEMM_MIN_WEIGHTS (the 8B shape's gate_up and down: 4 bits 161 vs 205 and 97 vs
# 111 us at 128 rows, 8 bits 136 vs 232 and 90 vs 124), not on qkv / o_proj (4 bits 47 vs 44, 37 vs 30 us; 8 bits
# 51 vs 49, 37 vs 32) nor past 128 rows (at 160, 4 bits: 245 vs 209 on gate_up). Env KERNELS_FRAG_GEMM_MAX_ROWS
# moves the row bound (0: never frag_gemm but for an lm_head).
GEMM_RUNTIME_MAX_ROWS = int(os.environ.get("KERNELS_FRAG_GEMM_MAX_ROWS", "128"))
GEMM_MIN_WEIGHTS = 1 << 25


def gemm_preferred(num_rows: int, out_features: int, in_features: int) -> bool:
    """Whether the runtime runs :func:`frag_gemm` (rather than the weight dequantized for cuBLAS) for a linear of
    this shape past the frag kernel's rows (shapes only; the same rule for 4 and 8 bits)."""
    return num_rows <= GEMM_RUNTIME_MAX_ROWS and out_features * in_features >= GEMM_MIN_WEIGHTS


@triton.jit
def _frag_gemm_kernel(x_ptr, xs_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, part_ptr, M, N, K, stride_xm, stride_ym,
                      iters_per_split, ONE_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                      TILES_N: tl.constexpr, SPLIT: tl.constexpr, BITS: tl.constexpr, FP32_DOT: tl.constexpr):
    # program (m, n, k): rows [BLOCK_M m, +BLOCK_M) x features [BLOCK_N n, +BLOCK_N) (N is a multiple of BLOCK_N)
    # over K iterations [iters_per_split k, +iters_per_split); with SPLIT > 1 its fp32 sums go to part[k].
    # An iteration is 1 KB of codes per 16-feature tile: 128 input features of 4-bit codes (one group), 64 of 8-bit.
    # The codes go to the MMA as they are (small integers, exact in bf16); each group's zero point and scale are
    # applied to its fp32 sums, sum_k x (q - z) s = s (x . q - z sum_k x), with xs[m, iteration] = sum_k x (computed
    # before the launch), so nothing per weight depends on its row: the tile's layout follows the words' loads
    BLOCK_N: tl.constexpr = 16 * TILES_N
    IT_K: tl.constexpr = 128 if BITS == 4 else 64
    G = K // IT_K
    pid_m = tl.program_id(0)  # fastest: the programs on one weight tile run together and share it through L2
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    w_ptrs = _word_ptrs(qw_ptr, pid_n * TILES_N, K, TILES_N, BITS)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # the tile's features in natural order: n = 16 t + 8 h + g
    kk = tl.arange(0, IT_K)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + kk[None, :]
    xs_ptrs = xs_ptr + rows.to(tl.int64) * G
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    xsum = tl.zeros([BLOCK_M], dtype=tl.float32)
    it0 = pid_k * iters_per_split
    it1 = tl.minimum(it0 + iters_per_split, G)
    for it in range(it0, it1):
        q = _unpack_words(tl.load(w_ptrs + it * 256), TILES_N, BITS)
        q = q.to(tl.float32).to(x_ptr.dtype.element_ty)
        x = tl.load(x_ptrs + it * IT_K, mask=row_ok[:, None], other=0.0)
        xs = tl.load(xs_ptrs + it, mask=row_ok, other=0.0)
        if FP32_DOT:  # the interpreter: its dot of a cast bf16 operand is wrong; fp32 of the same values instead
            x = x.to(tl.float32)
            q = q.to(tl.float32)
        if ONE_GROUP:  # one zero point and scale per feature: applied once, after the loop
            acc = tl.dot(x, tl.trans(q), acc)
            xsum += xs
        else:
            z = tl.load(z_ptr + it * N + n).to(tl.float32)
            s = tl.load(s_ptr + it * N + n)
            acc += (tl.dot(x, tl.trans(q)) - xs[:, None] * z[None, :]) * s[None, :]
    if ONE_GROUP:
        z = tl.load(z_ptr + n).to(tl.float32)
        s = tl.load(s_ptr + n)
        acc = (acc - xsum[:, None] * z[None, :]) * s[None, :]
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n).to(tl.float32)[None, :]
        y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        p_ptrs = part_ptr + (pid_k * M + rows.to(tl.int64))[:, None] * N + n[None, :]
        tl.store(p_ptrs, acc, mask=row_ok[:, None])


def default_gemm_config(num_rows: int, out_features: int, bits: int = 4) -> GemmConfig:
    """The sweep's best at 65-128 rows. 4 bits: wide layers (gate_up) one K range per program in 128 x 128 tiles,
    the others 64 x 64 tiles with K split for the SMs; 8 bits: 128 x 64 tiles on 4 warps, K split for the SMs."""
    if bits == 8:
        return GemmConfig(block_m=128, tiles_n=4, num_warps=4, num_stages=3, split_k=0)
    if out_features >= 16384:
        return GemmConfig(block_m=128, tiles_n=8, num_warps=8, num_stages=3, split_k=1)
    return GemmConfig(block_m=64, tiles_n=4, num_warps=4, num_stages=3, split_k=0)


@dataclass(frozen=True)
class _GemmPlan:
    """A tl.dot GEMM's launch on the frag layout (frag_gemm, kernels.frag_mm): its grid and K split."""

    tiles_n: int  # 16-feature tiles per program (the config's, halved until it divides N / 16)
    it_k: int  # input features per K iteration (1 KB of codes per tile)
    total_iters: int
    grid: tuple[int, int, int]  # (row blocks, feature blocks, K splits)
    iters_per_split: int


def _gemm_rows(x: torch.Tensor, bias: torch.Tensor | None, w: _FragWeights, name: str) -> torch.Tensor:
    """x as [rows, K] (last dimension contiguous), after the checks both GEMMs make (user-facing errors)."""
    if x.dtype not in (torch.bfloat16, torch.float16) or x.shape[-1] != w.in_features:
        raise ValueError(f"{name} takes bf16/fp16 x with {w.in_features} input features, got {x.dtype} "
                         f"{tuple(x.shape)}")
    if bias is not None and tuple(bias.shape) != (w.out_features,):
        raise ValueError(f"bias {tuple(bias.shape)} does not match {w.out_features} output features")
    x2 = x.reshape(-1, w.in_features)
    return x2.contiguous() if x2.stride(-1) != 1 else x2


def _gemm_plan(m: int, w: _FragWeights, block_m: int, tiles_n: int, split_k: int, programs_per_sm: int,
               device: torch.device) -> _GemmPlan:
    """The grid for ``m`` rows: ``split_k`` 0 splits K until the grid holds about ``programs_per_sm`` programs per SM
    (at least 4 K iterations a split)."""
    n = w.out_features
    while (n // TILE_N) % tiles_n:
        tiles_n //= 2
    it_k = ITER_K if w.bits == 4 else ITER_K // 2
    grid_m, grid_n, total_iters = triton.cdiv(m, block_m), n // (TILE_N * tiles_n), w.in_features // it_k
    split = split_k
    if not split:
        device_index = device.index if device.index is not None else torch.cuda.current_device()
        split = min(triton.cdiv(programs_per_sm * _num_sms(device_index), grid_m * grid_n), max(total_iters // 4, 1))
    iters_per_split = triton.cdiv(total_iters, max(1, min(split, total_iters)))
    split = triton.cdiv(total_iters, iters_per_split)
    return _GemmPlan(tiles_n, it_k, total_iters, (grid_m, grid_n, split), iters_per_split)


def _gemm_partials(plan: _GemmPlan, m: int, n: int, y: torch.Tensor) -> torch.Tensor:
    """Where the programs write: fp32 partials [splits, m, n] when K is split, else y itself."""
    splits = plan.grid[2]
    return torch.empty((splits, m, n), dtype=torch.float32, device=y.device) if splits > 1 else y


def _gemm_finish(plan: _GemmPlan, part: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor) -> None:
    """With a split K: the partial sums added in split order (deterministic), the bias, rounded once into y."""
    if plan.grid[2] > 1:
        total = part.sum(0)
        if bias is not None:
            total += bias.float()
        y.copy_(total)


def frag_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
              bias: torch.Tensor | None = None, *, bits: int = 4, layout: str = LAYOUT,
              config: GemmConfig | None = None) -> torch.Tensor:
    """``x @ ((q - zero) * scale).T + bias`` for any number of rows of bf16/fp16 x, on :func:`repack_frag`'s 4-bit
    or 8-bit weights, with ``tl.dot`` tiles on the codes and each group's zero point and scale applied to its fp32
    sums (no dequantized temporary; the weights are not rounded to x's dtype). x: [..., K] -> y: [..., N] in x's dtype (fp32
    sums; with split-K, the splits' fp32 partial sums added in split order: deterministic)."""
    _check_device(x)
    w = _frag_weights(qweight, scales, zeros, group_size, bits, layout)
    x2 = _gemm_rows(x, bias, w, "frag_gemm")
    m, n = x2.shape[0], w.out_features
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    cfg = config or (GemmConfig(16, 2, 4, 1, 1) if _interpreting() else default_gemm_config(m, n, bits))
    plan = _gemm_plan(m, w, cfg.block_m, cfg.tiles_n, cfg.split_k, GEMM_PROGRAMS_PER_SM, x.device)
    part = _gemm_partials(plan, m, n, y)
    xs = x2.unflatten(-1, (plan.total_iters, plan.it_k)).sum(-1, dtype=torch.float32)  # [M, iterations]: x's sums
    _frag_gemm_kernel[plan.grid](
        x2, xs, w.qweight, w.scales, w.zeros, bias if bias is not None else y, y, part, m, n, w.in_features,
        x2.stride(0), y.stride(0), plan.iters_per_split, ONE_GROUP=w.one_group, HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, TILES_N=plan.tiles_n, SPLIT=plan.grid[2], BITS=bits, FP32_DOT=_interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _gemm_finish(plan, part, bias, y)
    return y.reshape(*x.shape[:-1], n)
