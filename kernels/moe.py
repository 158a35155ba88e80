"""The ``moe`` op on CUDA: routing, a per-expert block plan and two grouped GEMMs, all on the device.

Semantics are ``kernels/torch_ops.moe`` (the reference; the IR's ``moe`` op). Its torch implementation reads each
expert's token count on the host; here nothing does, so a step with MoE layers can be captured in a CUDA graph:
every buffer and grid is sized from T (tokens) and the weights' shapes alone.

    route        the reference's own router (x @ gate_weight.T (+ bias), softmax / sigmoid in fp32, torch.topk of
                 the scores plus the selection bias where set, the weights gathered from the scores alone):
                 raw top-k scores [T, k] fp32 and experts [T, k]. torch.topk's choice among tied scores is part
                 of the op, so it is torch.topk that chooses (no host read: fixed shapes)
    plan         ``moe_align``: the T * k slots (slot s = token s // k, its routing slot s % k) grouped by
                 expert, each expert's group padded to a multiple of BLOCK_M (4 here; expert 1 got no slot):

                   sorted_slots  [max_rows]    | e0: s s s S | e2: s S S S | e3: s s s s s S S S | ...
                   block_expert  [max_blocks]  |     0       |     2       |     3   |    3      | E E
                   (S = num_slots: a padding row; E = num_experts: a block past the last expert's rows)

                 max_rows = max_blocks * BLOCK_M with max_blocks = (S + min(E, S) * (BLOCK_M - 1)) // BLOCK_M,
                 the most blocks any routing can need (at most min(E, S) experts get slots, each wasting at most
                 BLOCK_M - 1 rows); blocks past the routing's own are marked E and their programs exit at once.
                 Within an expert, slots keep their order (stable), so the plan is deterministic.
    up GEMM      per (block, column tile): the block's rows of x (token = slot // k) @ w_gate_up[e]^T for the gate
                 and the up halves, then act(gate) * up, rounded as the reference rounds (each GEMM output to x's
                 dtype, the activation in fp32 rounded, the product rounded): h [max_rows, I]
    down GEMM    per (block, column tile): h rows @ w_down[e]^T, rounded to x's dtype, stored at the slot's row of
                 y [S, H] (one writer per row: no atomics)
    sum          per token: its k routing weights (renormalised to sum 1 when norm_topk_prob, times
                 routed_scaling_factor where it is not 1, rounded to x's dtype
                 when round_weights), then sum_j weight_j * y[t * k + j] in slot order in fp32 (each product rounded
                 to x's dtype first when round_weights), rounded to x's dtype once: deterministic

W4A16 experts at a decode step's few slots (up to ``kernels.moe_gemv.gemv_max_slots``) skip the plan and the grouped
GEMMs: ``kernels.moe_gemv``'s GEMV kernels (one program per routed expert, column tile and K split, CUDA-core fp32
sums: at one or two slots per expert a 16-row tile is mostly padding), then the same sum kernel.

The plan takes one kernel when the slots fit one chunk (decode: ``_CHUNK_ELEMS`` / next_pow2(E) slots, 64 for 128
experts) and two otherwise (per-chunk expert counts, then the scatter, each program summing the counts of the chunks
before its own). Neither reads anything on the host.

FP8 experts (the reference's ``w_gate_up_scale`` / ``w_down_scale``: float8_e4m3fn weights with fp32 scales per
expert and output channel): each GEMM quantizes its input rows (x's gathered rows; h's) per token as
``kernels.w8a8_gemm`` does, a first pass over K for each block row's scale max(max|row|, 1e-12) / 448, then each
loaded tile quantized in registers (E4M3, nearest even), FP8 dots accumulated in fp32 (promoted once per K step), the
sums times the row's scale, then the channel's, before the roundings above. The router stays in x's dtype.

Block-FP8 experts (``block_size`` [bn, bk], fine-grained FP8 checkpoints: the scales one per block,
[E, ceil(out / bn), ceil(in / bk)]): a K step is one block's width (BLOCK_K = bk), its inputs quantized per row on
their own (max(max|group|, 1e-12) / 448, the reference's per-token-and-group scales), dotted with the step's codes
into a fresh fp32 sum, which is added times the rows' scales and each column's block scale. Interpreter-tested and
compiled for sm_90 (``kernels.bench.compile_sm90``); not yet run on a GPU, nor tuned.

W4A16 experts (the reference's ``*_scales`` / ``*_zeros`` / ``group_size``: uint8 codes packed two per byte along the
input, [E, out, in / 2], with fp32 scales and uint8 zero points per group, [E, out, in / group_size]). A K step never
crosses a group (BLOCK_K is cut to a power of two dividing group_size, and is at least 32: each dot's K is BLOCK_K / 2
bytes of codes, and tl.dot takes K >= 16 on the GPU; so group_size is a multiple of 32, or -1 for one group per
row), so within it the scale and zero point are constants of the column and

    sum_k x[m, k] (q[n, k] - z[n]) s[n] = s[n] * sum_k x[m, k] (q[n, k] - z[n])

Each K step loads the bytes of its tile once ([BLOCK_N, BLOCK_K / 2]: byte j holds the codes of inputs 2j, low nibble,
and 2j + 1, high), turns both nibbles into q - zero in x's dtype (exact: small integers; on bf16 x in PTX,
``kernels.w4a16_mma._codes_minus_zero``: per 4 bytes 2 byte permutes, 2 shifts and 4 LOPs place the 8 nibbles in the
mantissas of bf16 128.0, then one packed bf16 add of -(128 + zero) per two codes; fp16 / fp32 x and the interpreter
take plain integer ops to the same values), multiplies the low nibbles by the step's even inputs and the high ones by
its odd inputs (two 16-bit ``tl.dot`` of K = BLOCK_K / 2, fp32 sums: nothing is interleaved back) and adds those sums
times the group's scale to the fp32 accumulator; then the roundings above. The zero points are loaded a step ahead
(they gate the step's first MMA; its scales are read at its end). The group size is a constexpr of the kernels (the
group index a shift, not a division), and where it is a multiple of BLOCK_K the codes are loaded without a K mask.
A separate constexpr branch (INT4): the bf16 and FP8 paths compile as before; sm_90 SASS per 128-wide K step at 16 x
64 tiles (``kernels.bench.compile_sm90 --sass``, Triton 3.9): up GEMM 400 instructions, down 251 (bf16 experts: 155,
113; the fp32 dequantization per weight before: 1,701, 843). They launch with the bf16 experts' configurations
(``_CUDA_CONFIGS``, not yet timed for W4A16: ``python -m kernels.bench.moe --int4 --sweep``).

NOTE: the reference rounds each dequantized weight (q - zero) * scale to x's dtype before its GEMMs; the kernels never
form it, so their sums are those of the unrounded weights, each within half an ulp of the reference's: gate / up / h
values differ from the reference's as much as a GEMM summed in another order does (``tests/kernels/test_moe_kernel.py``
measures it), and agree to fp32 rounding where the scales are powers of two (the weights then exact in x's dtype).

NOTE: x in fp16 / bf16 (fp32 works, with exact fp32 dots: slow; FP8 dots with FP8 experts); experts stacked, in x's
dtype, FP8 or W4A16 codes. On the GPU the FP8 quotients use the approximate fp32 division: a value at a code's rounding boundary can
get the neighbouring code. The kernels are launched without PDL (``kernels.pdl``): each starts once the previous kernel
has finished. Under TRITON_INTERPRET the kernels run on the CPU (tests at small shapes), with fp32 dots on the 16-bit
operands (the interpreter's 16-bit dot is wrong), bf16 rounding done on the bits (its conversion truncates) and FP8
codes rounded in fp32 (``_round_e4m3``: its fp8 conversion is wrong; its divisions are IEEE: the reference's codes);
``python -m kernels.bench.moe`` (``--fp8``, ``--int4``) checks and times the GPU path at real shapes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import moe_gemv
from kernels import torch_ops as ops
from kernels.moe_activation import _act_mul, _round
from kernels.moe_gemv import MoeGemvConfig
from kernels.w4a16_gemm import _interpreting, grouped_tile
from kernels.w4a16_mma import _codes_minus_zero
from kernels.w8a8_gemm import _round_e4m3

X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# the IR's moe activations (passes.ir.MOE_ACTIVATIONS), in the kernels' ACT numbering; clamped_swiglu is gpt-oss's
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "sigmoid", "tanh", "clamped_swiglu")
_CHUNK_ELEMS = 8192  # slots x experts compared per plan program (a [E, CHUNK] one-hot)


@dataclass(frozen=True)
class MoeConfig:
    """One launch configuration of the grouped GEMMs."""

    block_m: int  # slots per block (>= 16: tl.dot's minimum); every expert's rows are padded to a multiple
    block_n: int  # up GEMM: columns of the gate (and as many of the up) half per tile
    block_k: int  # up GEMM: hidden features per K step
    down_block_n: int  # down GEMM: output (hidden) features per tile
    down_block_k: int  # down GEMM: intermediate features per K step
    group_m: int = 8  # blocks walked together per column of weight tiles (L2 reuse within an expert)
    num_warps: int = 4
    num_stages: int = 3


# Picked by the mean slots per expert, T * top_k / num_experts: the first row whose bound is >= it. Each row is the
# fastest of ``python -m kernels.bench.moe --sweep --tokens 1 64 1024`` on an H100 (torch 2.11, triton 3.6) at the
# shape whose mean falls in it: Qwen3-30B-A3B (128 experts, top-8) at T = 1 (59.9 us), 64 (466.5 us) and 1024
# (1242.5 us); Mixtral-8x7B (8 experts, top-2) at T = 64 (1005.1 us) and 1024 (6707.3 us; 0.66x torch's
# per-expert cuBLAS calls there: the grouped GEMM reaches ~110 TFLOP/s at large M).
_CUDA_CONFIGS: list[tuple[float, MoeConfig]] = [
    (1, MoeConfig(16, 64, 128, 32, 128, group_m=1, num_warps=4, num_stages=4)),  # decode: weight-bound, many tiles
    (8, MoeConfig(16, 32, 128, 32, 128, group_m=1, num_warps=4, num_stages=4)),
    (32, MoeConfig(32, 64, 128, 128, 64, group_m=8, num_warps=4, num_stages=4)),
    (64, MoeConfig(16, 128, 64, 64, 128, group_m=8, num_warps=4, num_stages=4)),
    (float("inf"), MoeConfig(64, 32, 128, 32, 128, group_m=8, num_warps=4, num_stages=3)),
]
_INTERPRETER_CONFIG = MoeConfig(16, 32, 32, 32, 32, group_m=2, num_warps=1, num_stages=1)


_SMEM_BYTES = 200 << 10  # of the H100's 227 KB per block: what the pipelined tiles may take


def default_config(num_slots: int, num_experts: int, device: torch.device, x_bytes: int = 2,
                   w_bytes: int = 2) -> MoeConfig:
    """The row of _CUDA_CONFIGS for these slots, its pipeline shortened until the up GEMM's stages (an x tile and
    two weight tiles each, at ``x_bytes`` / ``w_bytes`` per element: fp32 x would not fit the rows' 16-bit budget)
    and the down GEMM's fit _SMEM_BYTES."""
    if _interpreting() or device.type != "cuda":
        return _INTERPRETER_CONFIG
    mean_rows = num_slots / num_experts
    cfg = next(cfg for bound, cfg in _CUDA_CONFIGS if mean_rows <= bound)
    stage = max(cfg.block_m * cfg.block_k * x_bytes + 2 * cfg.block_k * cfg.block_n * w_bytes,
                cfg.block_m * cfg.down_block_k * x_bytes + cfg.down_block_k * cfg.down_block_n * w_bytes)
    stages = cfg.num_stages
    while stages > 1 and stages * stage > _SMEM_BYTES:
        stages -= 1
    return cfg if stages == cfg.num_stages else dataclasses.replace(cfg, num_stages=stages)


@dataclass
class MoePlan:
    """The slots grouped by expert into blocks of ``block_m`` rows (see the module docstring)."""

    sorted_slots: torch.Tensor  # [max_blocks * block_m] int32: a slot per row, num_slots on padding rows
    block_expert: torch.Tensor  # [max_blocks] int32: each block's expert; num_experts past the routing's blocks
    num_slots: int  # T * top_k
    num_experts: int
    block_m: int


# --- plan --------------------------------------------------------------------------------------------
@triton.jit
def _chunk_onehot(experts_ptr, num_slots, chunk, E_POW2: tl.constexpr, CHUNK: tl.constexpr):
    """The chunk's slots (int32 [CHUNK], masked past num_slots) and their experts as a one-hot [E_POW2, CHUNK]."""
    slots = chunk * CHUNK + tl.arange(0, CHUNK)
    experts = tl.load(experts_ptr + slots, mask=slots < num_slots, other=-1)
    onehot = (tl.arange(0, E_POW2)[:, None] == experts[None, :]).to(tl.int32)
    return slots, onehot


@triton.jit
def _moe_count_kernel(experts_ptr, counts_ptr, num_slots, E_POW2: tl.constexpr, CHUNK: tl.constexpr):
    # counts: [num_chunks, E_POW2] int32, chunk c's slots per expert
    chunk = tl.program_id(0)
    _, onehot = _chunk_onehot(experts_ptr, num_slots, chunk, E_POW2, CHUNK)
    tl.store(counts_ptr + chunk * E_POW2 + tl.arange(0, E_POW2), tl.sum(onehot, axis=1))


@triton.jit
def _moe_plan_kernel(experts_ptr, counts_ptr, sorted_ptr, block_expert_ptr, num_slots, num_chunks, num_blocks,
                     BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, CHUNK: tl.constexpr, ONE_CHUNK: tl.constexpr,
                     COUNT_TILE: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr):
    """Program c places chunk c's slots; program 0 also marks every expert's padding rows, and each program
    maps its share of the blocks to their experts."""
    chunk = tl.program_id(0)
    e_range = tl.arange(0, E_POW2)
    slots, onehot = _chunk_onehot(experts_ptr, num_slots, chunk, E_POW2, CHUNK)  # onehot: [E_POW2, CHUNK]
    # totals: [E_POW2] slots per expert; before: [E_POW2] of them in chunks before this one
    if ONE_CHUNK:
        totals = tl.sum(onehot, axis=1)
        before = tl.zeros((E_POW2,), dtype=tl.int32)
    else:
        totals = tl.zeros((E_POW2,), dtype=tl.int32)
        before = tl.zeros((E_POW2,), dtype=tl.int32)
        for c0 in range(0, num_chunks, COUNT_TILE):
            rows = c0 + tl.arange(0, COUNT_TILE)
            tile = tl.load(counts_ptr + rows[:, None] * E_POW2 + e_range[None, :], mask=(rows < num_chunks)[:, None],
                           other=0)  # [COUNT_TILE, E_POW2]
            totals += tl.sum(tile, axis=0)
            before += tl.sum(tl.where((rows < chunk)[:, None], tile, 0), axis=0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    start = end - padded  # [E_POW2] each expert's first row

    # this chunk's slots: row = start[e] + before[e] + rank among the chunk's slots of e (stable)
    rank = tl.sum((tl.cumsum(onehot, axis=1) - 1) * onehot, axis=0)  # [CHUNK]
    row = tl.sum(onehot * (start + before)[:, None], axis=0) + rank
    tl.store(sorted_ptr + row, slots, mask=slots < num_slots)

    # program 0: the padding rows [start + total, start + padded) of every expert, at most BLOCK_M - 1 each
    j = tl.arange(0, BLOCK_M)
    num_pad = tl.where(chunk == 0, padded - totals, 0)  # [E_POW2]
    tl.store(sorted_ptr + (start + totals)[:, None] + j[None, :],
             tl.zeros((E_POW2, BLOCK_M), dtype=tl.int32) + num_slots, mask=j[None, :] < num_pad[:, None])

    # block b belongs to the first expert whose rows end past b * BLOCK_M: the count of those ending at or before
    # it. Past the last expert's rows every end counts: E_POW2 >= num_experts, an empty block
    blocks = chunk * BLOCKS_PER_PROGRAM + tl.arange(0, BLOCKS_PER_PROGRAM)
    owner = tl.sum((end[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
    tl.store(block_expert_ptr + blocks, owner, mask=blocks < num_blocks)


def max_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """The most blocks of ``block_m`` rows any routing of ``num_slots`` slots over ``num_experts`` experts needs."""
    return (num_slots + min(num_experts, num_slots) * (block_m - 1)) // block_m


def moe_align(experts: torch.Tensor, num_experts: int, block_m: int) -> MoePlan:
    """The block plan of ``experts`` [T, top_k] (any integer dtype): slots grouped by expert into blocks of
    ``block_m`` rows, on the device, sized from the shapes alone (see the module docstring)."""
    flat = experts.reshape(-1)
    flat = flat if flat.is_contiguous() else flat.contiguous()
    num_slots = flat.numel()
    num_blocks = max_blocks(num_slots, num_experts, block_m)
    sorted_slots = torch.empty(num_blocks * block_m, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=flat.device)
    plan = MoePlan(sorted_slots, block_expert, num_slots, num_experts, block_m)
    if num_slots == 0:
        return plan
    e_pow2 = triton.next_power_of_2(num_experts)
    chunk = max(16, min(1024, _CHUNK_ELEMS // e_pow2))
    num_chunks = triton.cdiv(num_slots, chunk)
    counts = sorted_slots  # never read with one chunk
    if num_chunks > 1:
        counts = torch.empty(num_chunks, e_pow2, dtype=torch.int32, device=flat.device)
        _moe_count_kernel[(num_chunks,)](flat, counts, num_slots, E_POW2=e_pow2, CHUNK=chunk, num_warps=4)
    count_tile = max(1, min(triton.next_power_of_2(num_chunks), _CHUNK_ELEMS // e_pow2))
    _moe_plan_kernel[(num_chunks,)](
        flat, counts, sorted_slots, block_expert, num_slots, num_chunks, num_blocks,
        BLOCK_M=block_m, E_POW2=e_pow2, CHUNK=chunk, ONE_CHUNK=num_chunks == 1, COUNT_TILE=count_tile,
        BLOCKS_PER_PROGRAM=triton.next_power_of_2(triton.cdiv(num_blocks, num_chunks)), num_warps=4)
    return plan


# --- grouped GEMMs -------------------------------------------------------------------------------------
@triton.jit
def _dot(a, w, acc, IEEE: tl.constexpr):
    if IEEE:  # fp32 x: exact fp32 products, as the reference's fp32 linear; also the interpreter (its 16-bit dot
        # is wrong), on the 16-bit operands made fp32 (exactly), and on FP8 codes (``_fp8_codes``: exact too)
        return tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    elif a.dtype == tl.float8e4nv:
        # FP8 codes as fp16 (exact; one conversion instruction per two codes), on fp16 tensor cores: exact products,
        # fp32 sums. Hopper's FP8 MMA (Triton picks it for 64-row tiles) accumulates in reduced precision and measured
        # slower here (H100: 0.54x the bf16 experts at 1024 tokens of Mixtral-8x7B, error 3x the other tiles'); bf16
        # operands convert slowly (0.37x there). docs/BENCHMARKS.md, session 20
        return tl.dot(a.to(tl.float16), w.to(tl.float16), acc)
    else:
        return tl.dot(a, w, acc)


@triton.jit
def _fp8_row_scales(rows_ptr, mask_m, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_M] fp32 per-token FP8 scales of the rows at ``rows_ptr`` [BLOCK_M, 1] (K features each; masked rows 0):
    max(max|row|, 1e-12) / 448, the reference's ``quantize_activation_fp8``."""
    offs_k = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(rows_ptr + k0 + offs_k[None, :], mask=mask_m[:, None] & (offs_k < K - k0)[None, :], other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(a.to(tl.float32)), axis=1))
    return tl.math.div_rn(tl.maximum(amax, 1e-12), tl.zeros_like(amax) + 448.0)  # IEEE division, as torch's


@triton.jit
def _fp8_codes(a, x_scale, EMULATE: tl.constexpr):
    """a [BLOCK_M, BLOCK_K] over its rows' scales x_scale [BLOCK_M], clamped to +-448, rounded to E4M3 (ties to
    even): float8e4nv codes; under EMULATE (the interpreter, whose fp8 conversion is wrong) their values in fp32.
    The quotient is Triton's fp32 ``/``, approximate on the GPU (IEEE div_rn measured 1.5x slower in
    ``kernels.w8a8_gemm``), IEEE in the interpreter."""
    v = tl.minimum(tl.maximum(a.to(tl.float32) / x_scale[:, None], -448.0), 448.0)
    if EMULATE:
        return _round_e4m3(v)
    else:
        return v.to(tl.float8e4nv)


@triton.jit
def _block_fp8_step(a, w_ptrs, w_mask, ws_rows, kb, mask_n, acc, IEEE: tl.constexpr):
    """acc + one K step of block-FP8 experts: the step's inputs a [BLOCK_M, BLOCK_K] (one bk-wide group of each row,
    masked entries 0) quantized to E4M3 with their own per-row scale max(max|group|, 1e-12) / 448 (the reference's
    ``quantize_activation_fp8_blocks``), dotted with the step's e4m3 weight tile at ``w_ptrs`` [BLOCK_K, BLOCK_N] in
    fp32, times the row scales and each column's block scale (``ws_rows`` [BLOCK_N]: its block row's scales, this
    step's k-block ``kb``)."""
    amax = tl.max(tl.abs(a.to(tl.float32)), axis=1)
    x_scale = tl.math.div_rn(tl.maximum(amax, 1e-12), tl.zeros_like(amax) + 448.0)
    part = _dot(_fp8_codes(a, x_scale, IEEE), tl.load(w_ptrs, mask=w_mask, other=0.0), None, IEEE)
    ws = tl.load(ws_rows + kb, mask=mask_n, other=0.0)
    return acc + part * x_scale[:, None] * ws[None, :]


@triton.jit
def _int4_zeros(wz_ptr, rows, g, mask_n):
    """Group g's zero points (int32 [BLOCK_N]) of the rows of wz starting at ``rows`` [BLOCK_N]."""
    return tl.load(wz_ptr + rows + g, mask=mask_n, other=0).to(tl.int32)


@triton.jit
def _int4_mask(mask_n, offs_kh, k_left, EVEN_K: tl.constexpr):
    """[BLOCK_N, R] which of a K step's bytes to load: in columns < N, and among the ``k_left`` inputs left (K is
    even: a byte's two inputs together) unless EVEN_K (the group size a multiple of the step, so K is too): a mask
    constant along K keeps the codes' copies 16 bytes wide (8 with the K mask)."""
    if EVEN_K:
        return tl.broadcast_to(mask_n[:, None], (mask_n.shape[0], offs_kh.shape[0]))
    else:
        return mask_n[:, None] & (offs_kh < k_left // 2)[None, :]


@triton.jit
def _int4_dot(a_even, a_odd, w_ptrs, mask, zero, scale_ptrs, mask_n, acc, IEEE: tl.constexpr, PTX: tl.constexpr):
    """acc + one K step of W4A16 expert weights: the R bytes of each of BLOCK_N rows at ``w_ptrs`` [BLOCK_N, R] (byte
    j: the codes of inputs 2j, low nibble, and 2j + 1, high), each loaded once, against a_even / a_odd [BLOCK_M, R]
    (the step's even and odd inputs). Codes minus the group's zero point ``zero`` exactly in the dot's dtype, their
    products summed in fp32, times the group's scale (``scale_ptrs`` [BLOCK_N]: the K step lies in one group). Masked
    bytes are 0: finite weights against inputs that are 0 there, or in columns never stored. PTX: unpack four bytes
    at a time with one zero point (bf16 x, rows of a multiple of 16 bytes: see ``_int4_ptx``)."""
    b = tl.load(w_ptrs, mask=mask, other=0)
    lo, hi = _codes_minus_zero(b, zero, a_even.dtype, PTX)
    part = _dot(a_odd, tl.trans(hi), _dot(a_even, tl.trans(lo), None, IEEE), IEEE)
    return acc + tl.load(scale_ptrs, mask=mask_n, other=0.0)[None, :] * part


@triton.jit
def _block_rows(sorted_ptr, block_expert_ptr, pid_m, num_slots, BLOCK_M: tl.constexpr):
    """(expert, rows [BLOCK_M], slots [BLOCK_M], valid [BLOCK_M]) of block ``pid_m``."""
    expert = tl.load(block_expert_ptr + pid_m)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_ptr + rows)
    return expert, rows, slots, slots < num_slots


@triton.jit
def _moe_up_kernel(x_ptr, w_ptr, h_ptr, sorted_ptr, block_expert_ptr,
                   num_slots, num_experts, num_rows, N, K,
                   stride_xm, stride_we, stride_wn, stride_hm, ws_ptr, b_ptr, alpha, limit,
                   wz_ptr, num_groups,
                   TOP_K: tl.constexpr, ACT: tl.constexpr, IEEE: tl.constexpr, EMULATE_BF16: tl.constexpr,
                   FP8: tl.constexpr, HAS_BIAS: tl.constexpr, INT4: tl.constexpr, GROUP_SIZE: tl.constexpr,
                   PTX: tl.constexpr, BLOCK_FP8: tl.constexpr, SCALE_ROWS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # BLOCK_FP8: w holds e4m3 codes, ws [E, ceil(2N / SCALE_ROWS), num_groups] one fp32 scale per block of SCALE_ROWS
    # rows and BLOCK_K (the blocks' width) inputs; each step's inputs are quantized per row on their own
    # x: [T, K]; w: [E, 2N, K] (gate rows, then up rows); h: [num_rows, N]. FP8: w holds e4m3 codes, ws [E, 2N]
    # fp32 their per-row scales, and each block row of x is quantized per token (IEEE: emulated, the interpreter).
    # INT4: w holds 4-bit codes [E, 2N, K / 2] (strides in bytes), ws fp32 / wz uint8 [E, 2N, num_groups] the
    # groups' scales and zero points (groups of GROUP_SIZE inputs, a constant: no division by a runtime value per
    # step; each K step of BLOCK_K lies in one group).
    # HAS_BIAS: b [E, 2N] added to the gate and up outputs once rounded (the reference adds in x's dtype)
    pid_m, pid_n = grouped_tile(tl.program_id(0), num_rows, N, BLOCK_M, BLOCK_N, GROUP_M)
    expert, rows, slots, valid = _block_rows(sorted_ptr, block_expert_ptr, pid_m, num_slots, BLOCK_M)
    if expert >= num_experts:  # a block past the routing's own
        return
    tokens = tl.where(valid, slots // TOP_K, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    x_rows = x_ptr + tokens[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    offs_kh = tl.arange(0, BLOCK_K // 2)  # INT4: a K step's bytes, each the codes of inputs 2j and 2j + 1
    if INT4:  # [BN, BK / 2]
        w_gate = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn + offs_kh[None, :]
        g_gate = expert.to(tl.int64) * 2 * N * num_groups + offs_n * num_groups  # [BN] row starts of ws / wz
        g_up = g_gate + N * num_groups
    else:
        w_gate = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # [BK, BN]
    w_up = w_gate + N * stride_wn
    if FP8:
        x_scale = _fp8_row_scales(x_ptr + tokens[:, None] * stride_xm, valid, K, BLOCK_M, BLOCK_K)
    if INT4:  # the first step's zero points; each step loads the next one's, their latency behind its work (a
        # step's scales are read at its end)
        z_gate, z_up = _int4_zeros(wz_ptr, g_gate, 0, mask_n), _int4_zeros(wz_ptr, g_up, 0, mask_n)
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        a = tl.load(x_rows + k0, mask=valid[:, None] & mask_k[None, :], other=0.0)
        if FP8:
            a = _fp8_codes(a, x_scale, IEEE)
        w_mask = mask_k[:, None] & mask_n[None, :]
        if INT4:
            g = k0 // GROUP_SIZE
            g_next = tl.minimum((k0 + BLOCK_K) // GROUP_SIZE, num_groups - 1)
            z_gate_next = _int4_zeros(wz_ptr, g_gate, g_next, mask_n)
            z_up_next = _int4_zeros(wz_ptr, g_up, g_next, mask_n)
            b_mask = _int4_mask(mask_n, offs_kh, K - k0, GROUP_SIZE % BLOCK_K == 0)
            a_even, a_odd = tl.split(tl.reshape(a, (BLOCK_M, BLOCK_K // 2, 2)))
            acc_gate = _int4_dot(a_even, a_odd, w_gate + k0 // 2, b_mask, z_gate, ws_ptr + g_gate + g, mask_n,
                                 acc_gate, IEEE, PTX)
            acc_up = _int4_dot(a_even, a_odd, w_up + k0 // 2, b_mask, z_up, ws_ptr + g_up + g, mask_n, acc_up, IEEE,
                               PTX)
            z_gate, z_up = z_gate_next, z_up_next
        elif BLOCK_FP8:
            ws_e = ws_ptr + expert.to(tl.int64) * tl.cdiv(2 * N, SCALE_ROWS) * num_groups
            acc_gate = _block_fp8_step(a, w_gate + k0, w_mask, ws_e + (offs_n // SCALE_ROWS) * num_groups,
                                       k0 // BLOCK_K, mask_n, acc_gate, IEEE)
            acc_up = _block_fp8_step(a, w_up + k0, w_mask, ws_e + ((N + offs_n) // SCALE_ROWS) * num_groups,
                                     k0 // BLOCK_K, mask_n, acc_up, IEEE)
        else:
            acc_gate = _dot(a, tl.load(w_gate + k0, mask=w_mask, other=0.0), acc_gate, IEEE)
            acc_up = _dot(a, tl.load(w_up + k0, mask=w_mask, other=0.0), acc_up, IEEE)
    if FP8:  # the reference's order: (sum * row scale) * channel scale
        ws = ws_ptr + expert * 2 * N + offs_n
        acc_gate = acc_gate * x_scale[:, None] * tl.load(ws, mask=mask_n, other=0.0)[None, :]
        acc_up = acc_up * x_scale[:, None] * tl.load(ws + N, mask=mask_n, other=0.0)[None, :]
    dtype = h_ptr.dtype.element_ty
    gate, up = _round(acc_gate, dtype, EMULATE_BF16), _round(acc_up, dtype, EMULATE_BF16)
    if HAS_BIAS:
        bias = b_ptr + expert * 2 * N + offs_n
        gate = _round(gate.to(tl.float32) + tl.load(bias, mask=mask_n, other=0.0).to(tl.float32)[None, :], dtype,
                      EMULATE_BF16)
        up = _round(up.to(tl.float32) + tl.load(bias + N, mask=mask_n, other=0.0).to(tl.float32)[None, :], dtype,
                    EMULATE_BF16)
    h = _act_mul(gate, up, alpha, limit, ACT, EMULATE_BF16)
    tl.store(h_ptr + rows[:, None] * stride_hm + offs_n[None, :], h, mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _moe_down_kernel(h_ptr, w_ptr, y_ptr, sorted_ptr, block_expert_ptr,
                     num_slots, num_experts, num_rows, N, K,
                     stride_hm, stride_we, stride_wn, stride_ym, ws_ptr, b_ptr, wz_ptr, num_groups,
                     IEEE: tl.constexpr, EMULATE_BF16: tl.constexpr, FP8: tl.constexpr, HAS_BIAS: tl.constexpr,
                     INT4: tl.constexpr, GROUP_SIZE: tl.constexpr, PTX: tl.constexpr, BLOCK_FP8: tl.constexpr,
                     SCALE_ROWS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # h: [num_rows, K]; w: [E, N, K]; y: [num_slots, N], row = slot. FP8: as the up kernel's, ws [E, N]. INT4: as the
    # up kernel's, w [E, N, K / 2], ws / wz [E, N, num_groups].
    # HAS_BIAS: b [E, N] added to the rounded output, rounded again
    pid_m, pid_n = grouped_tile(tl.program_id(0), num_rows, N, BLOCK_M, BLOCK_N, GROUP_M)
    expert, rows, slots, valid = _block_rows(sorted_ptr, block_expert_ptr, pid_m, num_slots, BLOCK_M)
    if expert >= num_experts:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    h_rows = h_ptr + rows[:, None] * stride_hm + offs_k[None, :]
    offs_kh = tl.arange(0, BLOCK_K // 2)  # INT4: a K step's bytes, each the codes of inputs 2j and 2j + 1
    if INT4:  # [BN, BK / 2]
        w_cols = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn + offs_kh[None, :]
        g_rows = expert.to(tl.int64) * N * num_groups + offs_n * num_groups
    else:
        w_cols = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    if FP8:
        x_scale = _fp8_row_scales(h_ptr + rows[:, None] * stride_hm, valid, K, BLOCK_M, BLOCK_K)
    if INT4:  # as the up kernel's: each step loads the next one's zero points
        zero = _int4_zeros(wz_ptr, g_rows, 0, mask_n)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        a = tl.load(h_rows + k0, mask=valid[:, None] & mask_k[None, :], other=0.0)
        if FP8:
            a = _fp8_codes(a, x_scale, IEEE)
        if INT4:
            zero_next = _int4_zeros(wz_ptr, g_rows, tl.minimum((k0 + BLOCK_K) // GROUP_SIZE, num_groups - 1), mask_n)
            a_even, a_odd = tl.split(tl.reshape(a, (BLOCK_M, BLOCK_K // 2, 2)))
            b_mask = _int4_mask(mask_n, offs_kh, K - k0, GROUP_SIZE % BLOCK_K == 0)
            acc = _int4_dot(a_even, a_odd, w_cols + k0 // 2, b_mask, zero, ws_ptr + g_rows + k0 // GROUP_SIZE, mask_n,
                            acc, IEEE, PTX)
            zero = zero_next
        elif BLOCK_FP8:  # as the up kernel's: ws [E, ceil(N / SCALE_ROWS), num_groups]
            ws_e = ws_ptr + expert.to(tl.int64) * tl.cdiv(N, SCALE_ROWS) * num_groups
            acc = _block_fp8_step(a, w_cols + k0, mask_k[:, None] & mask_n[None, :],
                                  ws_e + (offs_n // SCALE_ROWS) * num_groups, k0 // BLOCK_K, mask_n, acc, IEEE)
        else:
            acc = _dot(a, tl.load(w_cols + k0, mask=mask_k[:, None] & mask_n[None, :], other=0.0), acc, IEEE)
    if FP8:
        acc = acc * x_scale[:, None] * tl.load(ws_ptr + expert * N + offs_n, mask=mask_n, other=0.0)[None, :]
    out = _round(acc, y_ptr.dtype.element_ty, EMULATE_BF16)
    if HAS_BIAS:
        b = tl.load(b_ptr + expert * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        out = _round(out.to(tl.float32) + b[None, :], y_ptr.dtype.element_ty, EMULATE_BF16)
    tl.store(y_ptr + tl.where(valid, slots, 0)[:, None] * stride_ym + offs_n[None, :], out,
             mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _moe_sum_kernel(y_ptr, weights_ptr, out_ptr, N, stride_ym, stride_om, scale,
                    TOP_K: tl.constexpr, K_POW2: tl.constexpr, NORM: tl.constexpr, ROUND: tl.constexpr,
                    EMULATE_BF16: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SCALE: tl.constexpr = False):
    # y: [T * TOP_K, N] each slot's expert output; weights: [T, TOP_K] fp32 raw top-k scores; out: [T, N]
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    ks = tl.arange(0, K_POW2)
    w = tl.load(weights_ptr + token * TOP_K + ks, mask=ks < TOP_K, other=0.0)
    if NORM:
        w = tl.math.div_rn(w, tl.zeros_like(w) + tl.sum(w, axis=0))  # IEEE division, as torch's
    if HAS_SCALE:  # routed_scaling_factor, after the renormalisation (the reference's order)
        w = w * scale
    dtype = out_ptr.dtype.element_ty
    if ROUND:
        w = _round(w, dtype, EMULATE_BF16).to(tl.float32)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        w_j = tl.sum(tl.where(ks == j, w, 0.0), axis=0)
        p = tl.load(y_ptr + (token * TOP_K + j) * stride_ym + offs_n, mask=mask_n, other=0.0).to(tl.float32) * w_j
        if ROUND:  # the reference's product is in x's dtype
            p = _round(p, dtype, EMULATE_BF16).to(tl.float32)
        acc += p
    tl.store(out_ptr + token * stride_om + offs_n, _round(acc, dtype, EMULATE_BF16), mask=mask_n)


# --- entry points ----------------------------------------------------------------------------------------
@dataclass
class Int4Experts:
    """W4A16 experts (``kernels.torch_ops.moe``'s): packed codes are the w_gate_up / w_down arguments; these are
    their groups' fp32 scales and uint8 zero points [E, out, in / group_size]."""

    w_gate_up_scales: torch.Tensor
    w_gate_up_zeros: torch.Tensor
    w_down_scales: torch.Tensor
    w_down_zeros: torch.Tensor
    group_size: int

    @classmethod
    def of(cls, w_gate_up_scales, w_gate_up_zeros, w_down_scales, w_down_zeros, group_size) -> Int4Experts | None:
        given = [t is not None for t in (w_gate_up_scales, w_gate_up_zeros, w_down_scales, w_down_zeros)]
        if not any(given):
            return None
        if not all(given):
            names = ("w_gate_up_scales", "w_gate_up_zeros", "w_down_scales", "w_down_zeros")
            raise ValueError(f"W4A16 experts take w_gate_up_scales, w_gate_up_zeros, w_down_scales and w_down_zeros; "
                             f"missing: {', '.join(n for n, g in zip(names, given) if not g)}")
        return cls(w_gate_up_scales, w_gate_up_zeros, w_down_scales, w_down_zeros, int(group_size))


INT4_MIN_BLOCK_K = 32  # the least K step of W4A16 experts, inputs (16 bytes of codes per row)


def int4_block_k(block_k: int, group_size: int, in_features: int) -> int:
    """A K step for W4A16 experts that never crosses a group boundary (one scale and zero point per column and step):
    for one group per row ``block_k`` itself, else the largest power of two <= block_k dividing group_size; at least
    INT4_MIN_BLOCK_K either way (each of the step's two dots takes BLOCK_K / 2 bytes of codes as its K, and tl.dot
    takes K >= 16 on the GPU; the interpreter would run less, the compiler does not)."""
    g = in_features if group_size == -1 else group_size
    if g == in_features:
        return max(block_k, INT4_MIN_BLOCK_K)
    bk = max(block_k, INT4_MIN_BLOCK_K)
    while bk > INT4_MIN_BLOCK_K and g % bk:
        bk //= 2
    if g % bk:
        sizes = ", ".join(str(INT4_MIN_BLOCK_K << i) for i in range(3))
        raise ValueError(f"W4A16 experts: group_size {group_size} is not a multiple of {INT4_MIN_BLOCK_K}; the fused "
                         f"kernel takes group sizes that are ({sizes}, ...) or -1 (one group per row)")
    return bk


def _int4_ptx(int4: Int4Experts | None, dtype: torch.dtype, ieee: bool, in_features: int) -> bool:
    """Whether W4A16 experts unpack their codes with the PTX magic numbers (``_codes_minus_zero``): bf16 dots only,
    and rows of a multiple of 16 bytes (in_features % 32 == 0). The asm takes a thread's four consecutive bytes as
    one row's, under one zero point; only a 16-byte-aligned row stride (which Triton specialises on) gives each
    thread runs of a row's bytes. Otherwise the layout may hand a thread bytes of four rows (on an H200, experts of
    40 inputs gave O(1) errors that way)."""
    return int4 is not None and not ieee and dtype == torch.bfloat16 and in_features % 32 == 0


def _check_int4(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, q: Int4Experts) -> None:
    num_experts, two_inter, half_hidden = w_gate_up.shape
    hidden, inter = x.shape[1], two_inter // 2
    if (w_gate_up.dtype != torch.uint8 or w_down.dtype != torch.uint8 or 2 * half_hidden != hidden or two_inter % 2
            or tuple(w_down.shape) != (num_experts, hidden, inter // 2) or inter % 2):
        raise ValueError(f"W4A16 experts hold uint8 codes packed two per byte: w_gate_up [E, 2 * I, hidden / 2], "
                         f"w_down [E, hidden, I / 2]; got {w_gate_up.dtype} {tuple(w_gate_up.shape)} and {w_down.dtype} "
                         f"{tuple(w_down.shape)} for x {tuple(x.shape)}")
    for name, in_f, rows, scales, zeros in (("w_gate_up", hidden, two_inter, q.w_gate_up_scales, q.w_gate_up_zeros),
                                            ("w_down", inter, hidden, q.w_down_scales, q.w_down_zeros)):
        g = in_f if q.group_size == -1 else q.group_size
        if g < 1 or in_f % g:
            raise ValueError(f"group_size {q.group_size} does not tile {name}'s {in_f} input features")
        want = (num_experts, rows, in_f // g)
        if scales.dtype != torch.float32 or tuple(scales.shape) != want:
            raise ValueError(f"{name}_scales is {scales.dtype} {tuple(scales.shape)}; expected torch.float32 {want} "
                             f"([E, out, in / group_size])")
        if zeros.dtype != torch.uint8 or tuple(zeros.shape) != want:
            raise ValueError(f"{name}_zeros is {zeros.dtype} {tuple(zeros.shape)}; expected torch.uint8 {want} "
                             f"([E, out, in / group_size])")
        int4_block_k(16, q.group_size, in_f)


def _check_inputs(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, top_k: int, activation: str,
                  w_gate_up_scale: torch.Tensor | None, w_down_scale: torch.Tensor | None,
                  b_gate_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None,
                  swiglu_limit: float = 0.0, int4: Int4Experts | None = None,
                  block_size: tuple[int, int] | None = None) -> None:
    if not (x.is_cuda or _interpreting()):
        raise RuntimeError("fused_moe runs on CUDA tensors (or under TRITON_INTERPRET=1); use kernels.torch_ops.moe "
                           "on the CPU")
    if x.dtype not in X_DTYPES:
        raise ValueError(f"x dtype {x.dtype} is not supported ({', '.join(map(str, X_DTYPES))})")
    if x.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(f"expected x [T, hidden], w_gate_up [E, 2 * I, hidden], w_down [E, hidden, I]; got "
                         f"{tuple(x.shape)}, {tuple(w_gate_up.shape)}, {tuple(w_down.shape)}")
    num_experts, two_inter, hidden = w_gate_up.shape
    if int4 is not None:
        if w_gate_up_scale is not None or w_down_scale is not None:
            raise ValueError("experts are FP8 (w_gate_up_scale / w_down_scale) or W4A16 (*_scales / *_zeros), not both")
        _check_int4(x, w_gate_up, w_down, int4)
        hidden = x.shape[1]
    elif (hidden != x.shape[1] or two_inter % 2 or tuple(w_down.shape) != (num_experts, hidden, two_inter // 2)):
        raise ValueError(f"x {tuple(x.shape)}, w_gate_up {tuple(w_gate_up.shape)} and w_down {tuple(w_down.shape)} "
                         f"are not [T, hidden], [E, 2 * I, hidden] and [E, hidden, I]")
    if int4 is None and (w_gate_up_scale is None) != (w_down_scale is None):
        given = "w_gate_up_scale" if w_down_scale is None else "w_down_scale"
        raise ValueError(f"FP8 experts take both w_gate_up_scale and w_down_scale; only {given} was given")
    if int4 is not None:
        pass  # checked above
    elif w_gate_up_scale is None:
        if w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
            raise ValueError(f"expert weights ({w_gate_up.dtype}, {w_down.dtype}) must be in x's dtype {x.dtype}, "
                             f"float8_e4m3fn with w_gate_up_scale and w_down_scale (FP8 experts), or packed uint8 "
                             f"4-bit codes with *_scales and *_zeros (W4A16 experts); no other quantized experts are "
                             f"supported")
    elif block_size is not None:
        _check_block_fp8(w_gate_up, w_down, w_gate_up_scale, w_down_scale, block_size)
    else:
        for name, w, scale, rows in (("w_gate_up", w_gate_up, w_gate_up_scale, "2 * I"),
                                     ("w_down", w_down, w_down_scale, "hidden")):
            if w.dtype != torch.float8_e4m3fn:
                raise ValueError(f"{name} is {w.dtype}; with {name}_scale (FP8 experts) it must hold "
                                 f"torch.float8_e4m3fn codes")
            if scale.dtype != torch.float32 or tuple(scale.shape) != tuple(w.shape[:2]):
                raise ValueError(f"{name}_scale is {scale.dtype} {tuple(scale.shape)}; expected torch.float32 "
                                 f"{tuple(w.shape[:2])} ([E, {rows}]: one scale per expert and output channel of "
                                 f"{name} {tuple(w.shape)})")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k {top_k} is not in 1..{num_experts} (the number of experts)")
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; known: {', '.join(ACTIVATIONS)}")
    if activation == "clamped_swiglu" and not swiglu_limit > 0:
        raise ValueError(f"clamped_swiglu needs swiglu_limit > 0, got {swiglu_limit}")
    for name, b, shape in (("b_gate_up", b_gate_up, (num_experts, two_inter)),
                           ("b_down", b_down, (num_experts, hidden))):
        if b is not None and (tuple(b.shape) != shape or not b.is_floating_point()):
            raise ValueError(f"{name} is {b.dtype} {tuple(b.shape)}; expected a floating-point [E, "
                             f"{'2 * I' if name == 'b_gate_up' else 'hidden'}] = {shape}")


BLOCK_FP8_WIDTHS = (16, 32, 64, 128, 256)  # block-FP8 experts' block widths along the input: a K step each


def _check_block_fp8(w_gate_up: torch.Tensor, w_down: torch.Tensor, w_gate_up_scale: torch.Tensor,
                     w_down_scale: torch.Tensor, block_size: tuple[int, int]) -> None:
    """Block-FP8 experts: e4m3 codes, fp32 scales [E, ceil(out / bn), ceil(in / bk)], gate rows whole blocks (the gate
    and up halves' blocks stacked), bk one of BLOCK_FP8_WIDTHS (the kernels' K step)."""
    bn, bk = block_size
    if bk not in BLOCK_FP8_WIDTHS or bn < 1:
        raise ValueError(f"block-FP8 experts take blocks {list(BLOCK_FP8_WIDTHS)} inputs wide (the kernels' K step) "
                         f"and at least one row; got block_size {list(block_size)}")
    if (w_gate_up.shape[1] // 2) % bn:
        raise ValueError(f"block-FP8 experts need the gate's {w_gate_up.shape[1] // 2} rows in whole blocks of {bn}")
    for name, w, scale in (("w_gate_up", w_gate_up, w_gate_up_scale), ("w_down", w_down, w_down_scale)):
        want = (w.shape[0], -(-w.shape[1] // bn), -(-w.shape[2] // bk))
        if w.dtype != torch.float8_e4m3fn or scale is None or scale.dtype != torch.float32 \
                or tuple(scale.shape) != want:
            got = None if scale is None else (scale.dtype, tuple(scale.shape))
            raise ValueError(f"{name} {w.dtype} with scales {got}: block-FP8 experts hold torch.float8_e4m3fn codes "
                             f"and torch.float32 scales {want}")


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def fused_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w_gate_up: torch.Tensor,
                  w_down: torch.Tensor, norm_topk_prob: bool = True, activation: str = "silu",
                  round_weights: bool = False, *, w_gate_up_scale: torch.Tensor | None = None,
                  w_down_scale: torch.Tensor | None = None, b_gate_up: torch.Tensor | None = None,
                  b_down: torch.Tensor | None = None, swiglu_alpha: float = 0.0, swiglu_limit: float = 0.0,
                  w_gate_up_scales: torch.Tensor | None = None, w_gate_up_zeros: torch.Tensor | None = None,
                  w_down_scales: torch.Tensor | None = None, w_down_zeros: torch.Tensor | None = None,
                  group_size: int = -1, block_size: tuple[int, int] | None = None,
                  config: MoeConfig | MoeGemvConfig | None = None, routed_scaling_factor: float = 1.0) -> torch.Tensor:
    """The experts' part of the ``moe`` op for a given routing: x [T, hidden], weights [T, top_k] fp32 (the raw
    top-k scores: renormalised here when ``norm_topk_prob``), experts [T, top_k] -> [T, hidden] in x's dtype.
    FP8 experts: float8_e4m3fn w_gate_up / w_down with their fp32 per-channel scales ``w_gate_up_scale`` [E, 2 * I]
    and ``w_down_scale`` [E, hidden] (``kernels.torch_ops.moe``'s). W4A16 experts: uint8 w_gate_up [E, 2 * I, hidden /
    2] / w_down [E, hidden, I / 2] packed 4-bit codes with ``*_scales`` fp32 / ``*_zeros`` uint8 [E, out, in /
    group_size] (the reference's; group_size a multiple of 32 or -1). Block-FP8 experts (``block_size`` [bn, bk]): e4m3
    codes with ``w_gate_up_scale`` / ``w_down_scale`` fp32 [E, ceil(out / bn), ceil(in / bk)], inputs quantized per
    token and bk-wide group, one K step of bk per block. Expert biases and the clamped SwiGLU as the
    reference's. W4A16 experts at up to ``kernels.moe_gemv.gemv_max_slots`` slots (T * top_k) run on that module's
    GEMV kernels, more on the grouped GEMMs; ``config`` forces a path and its launch: a MoeConfig the grouped GEMMs,
    a MoeGemvConfig the GEMV kernels (W4A16 experts only)."""
    top_k = experts.shape[-1]
    int4 = Int4Experts.of(w_gate_up_scales, w_gate_up_zeros, w_down_scales, w_down_zeros, group_size)
    _check_inputs(x, w_gate_up, w_down, top_k, activation, w_gate_up_scale, w_down_scale, b_gate_up, b_down,
                  swiglu_limit, int4, block_size)
    if weights.shape != experts.shape or experts.shape[0] != x.shape[0]:
        raise ValueError(f"weights {tuple(weights.shape)} and experts {tuple(experts.shape)} must both be "
                         f"[{x.shape[0]}, top_k]")
    num_tokens, hidden = x.shape
    num_experts, inter = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    num_slots = num_tokens * top_k
    if num_slots == 0:
        return out
    x, w_gate_up, w_down = (_last_dim_contiguous(t) for t in (x, w_gate_up, w_down))
    # a decode step's few slots with W4A16 experts: GEMV kernels (kernels.moe_gemv)
    if int4 is not None and (isinstance(config, MoeGemvConfig)
                             or (config is None and num_slots <= moe_gemv.gemv_max_slots(num_experts))):
        y = moe_gemv.int4_experts_gemv(
            x, experts, w_gate_up, w_down, (int4.w_gate_up_scales.contiguous(), int4.w_down_scales.contiguous()),
            (int4.w_gate_up_zeros.contiguous(), int4.w_down_zeros.contiguous()), int4.group_size,
            ACTIVATIONS.index(activation), b_gate_up, b_down, swiglu_alpha, swiglu_limit, config)
        _weighted_sum(y, weights, out, top_k, norm_topk_prob, round_weights, routed_scaling_factor)
        return out
    if isinstance(config, MoeGemvConfig):
        raise ValueError("a MoeGemvConfig (the small-slot GEMV path) applies to W4A16 experts only; these experts are "
                         f"{'FP8' if w_gate_up_scale is not None else w_gate_up.dtype}: pass a MoeConfig or None")
    cfg = config or default_config(num_slots, num_experts, x.device, x.element_size(), w_gate_up.element_size())
    if int4 is not None:  # K steps inside one group of the codes
        cfg = dataclasses.replace(cfg, block_k=int4_block_k(cfg.block_k, int4.group_size, hidden),
                                  down_block_k=int4_block_k(cfg.down_block_k, int4.group_size, inter))
    if block_size is not None:  # one K step per block of the scales
        cfg = dataclasses.replace(cfg, block_k=block_size[1], down_block_k=block_size[1])
    plan = moe_align(experts, num_experts, cfg.block_m)
    num_rows = plan.sorted_slots.numel()
    # h: [num_rows, I] each row's act(gate) * up; y: [T * top_k, hidden] each slot's expert output
    h = torch.empty(num_rows, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(num_slots, hidden, dtype=x.dtype, device=x.device)
    block = block_size is not None
    fp8 = w_gate_up_scale is not None and not block
    # IEEE: fp32 dots, for fp32 x with unquantized experts (FP8 experts take FP8 dots on the GPU) and the interpreter
    ieee = (x.dtype == torch.float32 and not (fp8 or block)) or _interpreting()
    emulate = _interpreting() and x.dtype == torch.bfloat16
    # ws: [E, 2I] / [E, hidden] contiguous FP8 scales, or [E, 2I, groups] / [E, hidden, groups] W4A16 group scales
    # (wz their zero points, groups = in / group_size); unread (any pointer) without them
    ws_up, ws_down = ((w_gate_up_scale.contiguous(), w_down_scale.contiguous()) if fp8 or block
                      else (w_gate_up, w_down))
    wz_up, wz_down, g_up, g_down, ng_up, ng_down = w_gate_up, w_down, 1, 1, 1, 1
    if block:  # num_groups: the scales' blocks along each GEMM's input
        ng_up, ng_down = triton.cdiv(hidden, block_size[1]), triton.cdiv(inter, block_size[1])
    if int4 is not None:
        ws_up, ws_down = int4.w_gate_up_scales.contiguous(), int4.w_down_scales.contiguous()
        wz_up, wz_down = int4.w_gate_up_zeros.contiguous(), int4.w_down_zeros.contiguous()
        # the kernels' GROUP_SIZE, a constexpr: a division by a run-time value per K step took ~25 instructions
        g_up = hidden if int4.group_size == -1 else int4.group_size
        g_down = inter if int4.group_size == -1 else int4.group_size
        ng_up, ng_down = hidden // g_up, inter // g_down
    launch = dict(FP8=fp8, INT4=int4 is not None, BLOCK_FP8=block, SCALE_ROWS=block_size[0] if block else 1,
                  GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    b_up = b_gate_up.contiguous() if b_gate_up is not None else w_gate_up  # unread (any pointer) without a bias
    b_dn = b_down.contiguous() if b_down is not None else w_down
    grid_up = (triton.cdiv(num_rows, cfg.block_m) * triton.cdiv(inter, cfg.block_n),)
    _moe_up_kernel[grid_up](
        x, w_gate_up, h, plan.sorted_slots, plan.block_expert, num_slots, num_experts, num_rows, inter, hidden,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), h.stride(0), ws_up, b_up, float(swiglu_alpha),
        float(swiglu_limit), wz_up, ng_up, GROUP_SIZE=g_up, PTX=_int4_ptx(int4, x.dtype, ieee, hidden), TOP_K=top_k,
        ACT=ACTIVATIONS.index(activation),
        IEEE=ieee, EMULATE_BF16=emulate, HAS_BIAS=b_gate_up is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, **launch)
    grid_down = (triton.cdiv(num_rows, cfg.block_m) * triton.cdiv(hidden, cfg.down_block_n),)
    _moe_down_kernel[grid_down](
        h, w_down, y, plan.sorted_slots, plan.block_expert, num_slots, num_experts, num_rows, hidden, inter,
        h.stride(0), w_down.stride(0), w_down.stride(1), y.stride(0), ws_down, b_dn, wz_down, ng_down,
        GROUP_SIZE=g_down, PTX=_int4_ptx(int4, x.dtype, ieee, inter), IEEE=ieee, EMULATE_BF16=emulate,
        HAS_BIAS=b_down is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.down_block_n, BLOCK_K=cfg.down_block_k, **launch)
    _weighted_sum(y, weights, out, top_k, norm_topk_prob, round_weights, routed_scaling_factor)
    return out


def _weighted_sum(y: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, top_k: int, norm_topk_prob: bool,
                  round_weights: bool, routed_scaling_factor: float = 1.0) -> None:
    """out [T, hidden] = each token's slots of y [T * top_k, hidden] weighted by ``weights`` [T, top_k] (the raw
    scores: see the module docstring's sum; times ``routed_scaling_factor`` after the renormalisation)."""
    num_tokens, hidden = out.shape
    weights = weights.float().contiguous()
    block_n = 32 if _interpreting() else min(1024, triton.next_power_of_2(hidden))
    _moe_sum_kernel[(num_tokens, triton.cdiv(hidden, block_n))](
        y, weights, out, hidden, y.stride(0), out.stride(0), float(routed_scaling_factor), TOP_K=top_k,
        K_POW2=triton.next_power_of_2(top_k),
        NORM=norm_topk_prob, ROUND=round_weights, EMULATE_BF16=_interpreting() and out.dtype == torch.bfloat16,
        BLOCK_N=block_n, HAS_SCALE=routed_scaling_factor != 1.0, num_warps=4)


def fused_moe(x: torch.Tensor, gate_weight: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, top_k: int,
              scoring: str = "softmax", norm_topk_prob: bool = True, activation: str = "silu",
              gate_bias: torch.Tensor | None = None, round_weights: bool = False, *,
              w_gate_up_scale: torch.Tensor | None = None, w_down_scale: torch.Tensor | None = None,
              b_gate_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None, swiglu_alpha: float = 0.0,
              swiglu_limit: float = 0.0, w_gate_up_scales: torch.Tensor | None = None,
              w_gate_up_zeros: torch.Tensor | None = None, w_down_scales: torch.Tensor | None = None,
              w_down_zeros: torch.Tensor | None = None, group_size: int = -1,
              block_size: tuple[int, int] | None = None,
              config: MoeConfig | MoeGemvConfig | None = None, select_bias: torch.Tensor | None = None,
              routed_scaling_factor: float = 1.0, router_fp32: bool = False) -> torch.Tensor:
    """The ``moe`` op (``kernels.torch_ops.moe``'s arguments and semantics, FP8 and W4A16 experts, expert biases,
    the clamped SwiGLU and the router's selection bias, scaling factor and fp32 logits included) with nothing read on
    the host: x [T, hidden] -> [T, hidden] in x's dtype. Capturable in a CUDA graph."""
    int4 = dict(w_gate_up_scales=w_gate_up_scales, w_gate_up_zeros=w_gate_up_zeros, w_down_scales=w_down_scales,
                w_down_zeros=w_down_zeros, group_size=group_size)
    _check_inputs(x, w_gate_up, w_down, top_k, activation, w_gate_up_scale, w_down_scale, b_gate_up, b_down,
                  swiglu_limit, Int4Experts.of(**int4), block_size)
    # the reference's router, renormalisation left to the sum kernel: [T, top_k] fp32 scores and int64 experts
    # (the selection bias picks the experts there; the scaling factor is applied by the sum kernel, after it)
    weights, experts = ops.moe_route(x, gate_weight, gate_bias, top_k, scoring, norm_topk_prob=False,
                                     select_bias=select_bias, router_fp32=router_fp32)
    return fused_experts(x, weights, experts, w_gate_up, w_down, norm_topk_prob, activation, round_weights,
                         w_gate_up_scale=w_gate_up_scale, w_down_scale=w_down_scale, b_gate_up=b_gate_up,
                         b_down=b_down, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit, block_size=block_size,
                         config=config, routed_scaling_factor=routed_scaling_factor, **int4)


def ref_moe(x: torch.Tensor, gate_weight: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, top_k: int,
            scoring: str = "softmax", norm_topk_prob: bool = True, activation: str = "silu",
            gate_bias: torch.Tensor | None = None, round_weights: bool = False, *,
            w_gate_up_scale: torch.Tensor | None = None, w_down_scale: torch.Tensor | None = None,
            b_gate_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None, swiglu_alpha: float = 0.0,
            swiglu_limit: float = 0.0, **int4) -> torch.Tensor:
    """The torch reference (the runtime's CPU path); ``int4``: W4A16 experts' ``*_scales``, ``*_zeros``,
    ``group_size``; and the router's ``select_bias``, ``routed_scaling_factor``, ``router_fp32``."""
    return ops.moe(x, gate_weight, w_gate_up, w_down, top_k, scoring, norm_topk_prob, activation, gate_bias,
                   round_weights, w_gate_up_scale=w_gate_up_scale, w_down_scale=w_down_scale, b_gate_up=b_gate_up,
                   b_down=b_down, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit, **int4)
