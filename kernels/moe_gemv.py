"""The ``moe`` op's experts for a decode step's few slots, W4A16 experts: GEMV kernels, no tensor cores.

At a few tokens (T * top_k slots up to ``gemv_max_slots``) the experts are bound by their weight bytes. The grouped
GEMMs of ``kernels.moe`` give each routed expert a 16-row ``tl.dot`` tile, mostly padding at one or two slots per
expert, and spend their issue slots on the MMA operands' shared-memory traffic: on an H200 the W4A16 experts of
Mixtral-8x7B at T = 1 ran at 0.75 TB/s, slower than the bf16 experts reading four times the bytes. Here each program
streams one expert's codes along K in 16-byte vector loads per thread and multiplies them by its slots' inputs with
fp32 multiply-adds on the CUDA cores, the rows of x (h) in registers: the ``kernels.gemv`` design, per expert.

Grid: (slot, column tile, K split), from the shapes alone (CUDA-graph capturable: how many distinct experts a step
routes to is never read on the host)::

    experts (flat)   e5 e2 | e2 e7 | e5 e1        T = 3 tokens, top-2: slots 0..5
    program (s, n, k) for slot s: the *leader* of its expert (its first slot) or exits at once
        s = 0: e5's slots {0, 4}   s = 1: e2's {1, 2}   s = 3: e7's {3}   s = 5: e1's {5}   s = 2, 4: exit
    a leader walks its expert's slots in passes of ROWS (``MoeGemvConfig.slots_per_pass``): each K step's codes are
    loaded and unpacked once per pass and serve its ROWS slots (the weight read shared by the slots routed to one
    expert; at top-8 of 128 experts with 8 tokens, or Mixtral's top-2 of 8, experts repeat)

One K step of a program, for W4A16 codes [E, out, in / 2] (byte j of a row: inputs 2j, low nibble, and 2j + 1, high),
with BLOCK_K dividing the group size (or one group per row) so that the step has one scale and zero point per row::

                       BLOCK_K / 2 bytes of each row (16 per thread: one vector load)
      rows n0 ..      | lo, hi = 1 + q / 16 (``kernels.gemv._unpack_nibbles``: the nibble in the mantissa of 1.0)
      n0 + BLOCK_N    | w = join(lo, hi) - (1 + zero / 16) = (q - zero) / 16     exact (Sterbenz: both in [1, 2))
                      | acc[r, n, c] += 16 scale[n] * sum_{32 inputs of run c} x[r, k] w[n, k]   fp32

so every sum over the products x (q - zero) is exact in its codes and in fp32, and is multiplied by the group's scale
(16 scale and (q - zero) / 16: powers of two, the same fp32 values), as ``kernels.moe``'s W4A16 tiles do; the weights
(q - zero) * scale are never formed, so never rounded (the reference rounds them to x's dtype: the tiles' NOTE).
The up kernel runs the gate and up rows of a column tile together (the inputs loaded once for both), then rounds as
the tiles do (each GEMM output to x's dtype, the expert bias in x's dtype, ``kernels.moe_activation._act_mul``) and
stores h [num_slots, I]; the down kernel stores y [num_slots, hidden]; ``kernels.moe._moe_sum_kernel`` adds a token's
slots.

Split-K: where the column tiles of the routed experts leave SMs idle (Qwen3-30B-A3B's I = 768: 6 tiles of 128 per
expert), ``split_k`` programs share a tile's K range; each stores its fp32 partial sums [split_k, num_slots, ...] and
counts itself in on the (leader, tile) counter (``kernels.gemv._arrive``), and the last to arrive adds the partials
in split order (deterministic) and runs the epilogue: one launch per GEMM. The counters are ``kernels.gemv``'s
(``_tile_counters``: allocated on first use, which must come before a CUDA-graph capture; zero between launches).

NOTE: a leader's expert may have more slots than a pass takes (all T tokens on one expert): it then walks them in
several passes, each reading the tile's codes again (from L2 after the first). Programs of non-leader slots exit
after reading the step's [num_slots] experts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.gemv import _arrive, _tile_counters, _unpack_nibbles, auto_split_k
from kernels.moe_activation import _act_mul, _round
from kernels.w4a16_gemm import _interpreting, _num_sms

# Slots (T * top_k) up to which ``kernels.moe.fused_experts`` takes this path for W4A16 experts (``gemv_max_slots``);
# above it, the grouped GEMMs. Measured on an H200 (session 33, ``python -m kernels.bench.moe --int4 --path both``,
# GEMV / grouped GEMMs us): Mixtral-8x7B (8 experts, top-2) 130 / 233 at 2 slots, 453 / 645 at 8, 801 / 672 at 16;
# Qwen3-30B-A3B (128 experts, top-8) 37 / 53 at 8 slots, 95 / 116 at 32, 157 / 164 at 64, 242 / 217 at 128. The GEMV
# wins while the slots are few against the experts (each expert's weights read for one or two slots), so the bound
# is max(8, experts / 2). KERNELS_MOE_GEMV_SLOTS sets a fixed bound instead (A/B runs: 0 sends every step to the
# grouped GEMMs).
_MAX_SLOTS_ENV = os.environ.get("KERNELS_MOE_GEMV_SLOTS", "")
if _MAX_SLOTS_ENV and not _MAX_SLOTS_ENV.isdigit():
    raise ValueError(f"KERNELS_MOE_GEMV_SLOTS={_MAX_SLOTS_ENV!r} is not a slot count (0 or more; 0: never this path)")
GEMV_MAX_SLOTS: int | None = int(_MAX_SLOTS_ENV) if _MAX_SLOTS_ENV else None


def gemv_max_slots(num_experts: int) -> int:
    """The most slots a step of ``num_experts`` W4A16 experts runs on the GEMV kernels (see GEMV_MAX_SLOTS)."""
    return GEMV_MAX_SLOTS if GEMV_MAX_SLOTS is not None else max(8, num_experts // 2)


_VEC_INPUTS = 32  # inputs per thread's run of codes (16 bytes: one vector load), summed in registers
_PROGRAMS_PER_SM = 4.0  # the auto split-K's target, counting one program per routed (expert, tile)


@dataclass(frozen=True)
class MoeGemvConfig:
    """One launch configuration of the small-slot kernels (``fused_experts(config=...)`` forces this path)."""

    block_n: int = 128  # up: gate (and as many up) rows per program
    block_k: int = 128  # up: inputs per K step (cut to divide the group size)
    down_block_n: int = 128  # down: hidden rows per program
    down_block_k: int = 128  # down: intermediate inputs per K step (cut as block_k)
    slots_per_pass: int = 2  # slots of one expert sharing each loaded step of codes: 1, 2 or 4 (cut to next_pow2(T);
    # at 4 the up kernel's tiles are cut to 64 rows)
    split_k: int = 0  # up: programs per tile's K range; 0: from the routed tiles and the SM count
    down_split_k: int = 0  # down: as split_k
    num_warps: int = 4
    num_stages: int = 3


# Not yet tuned on a GPU: 128-row tiles give each thread four rows of codes per 16-byte column of x (its inputs
# converted to fp32 once for four rows); ``python -m kernels.bench.moe --int4 --path gemv --sweep`` times others
_CUDA_CONFIG = MoeGemvConfig()
_INTERPRETER_CONFIG = MoeGemvConfig(32, 64, 32, 64, slots_per_pass=2, split_k=1, down_split_k=1, num_warps=1,
                                    num_stages=1)


def default_gemv_config(device: torch.device) -> MoeGemvConfig:
    if _interpreting() or device.type != "cuda":
        return _INTERPRETER_CONFIG
    return _CUDA_CONFIG


def _step_k(block_k: int, group: int, in_features: int) -> int:
    """The K step: ``block_k`` halved until it divides the group (one scale and zero point per row and step); at
    least one thread's run of codes (_VEC_INPUTS, which every group size the experts take is a multiple of)."""
    bk = max(block_k, _VEC_INPUTS)
    if group == in_features:  # one group per row: any step, the last one masked
        return min(bk, max(_VEC_INPUTS, triton.next_power_of_2(in_features)))
    while bk > _VEC_INPUTS and group % bk:
        bk //= 2
    assert group % bk == 0, f"group size {group} is not a multiple of {_VEC_INPUTS} (kernels.moe.int4_block_k)"
    return bk


def _split(requested: int, num_tiles: int, num_steps: int, num_routed: int, device: torch.device) -> tuple[int, int]:
    """(split_k, K steps per split) of one GEMM: ``requested``, or enough for about _PROGRAMS_PER_SM programs per SM
    over the (expert, tile) pairs of ``num_routed`` experts; evened out so that no split is empty."""
    split_k = requested
    if not split_k:
        split_k = 1
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            split_k = auto_split_k(num_tiles * num_routed, num_steps, _PROGRAMS_PER_SM, _num_sms(index))
    split_k = max(1, min(split_k, num_steps))
    steps_per_split = triton.cdiv(num_steps, split_k)
    return triton.cdiv(num_steps, steps_per_split), steps_per_split


# --- kernels -------------------------------------------------------------------------------------------
@triton.jit
def _leader_slots(experts_ptr, pid_s, num_slots, S_POW2: tl.constexpr):
    """(same [S_POW2]: the slots routed to slot pid_s's expert, their ranks among them, their count, and whether
    pid_s is the first of them: the program that runs them)."""
    idx = tl.arange(0, S_POW2)
    routed = tl.load(experts_ptr + idx, mask=idx < num_slots, other=-1)
    same = routed == tl.load(experts_ptr + pid_s)
    first = tl.min(tl.where(same, idx, S_POW2), axis=0)
    rank = tl.cumsum(same.to(tl.int32), axis=0) - 1
    return same, rank, tl.sum(same.to(tl.int32), axis=0), first == pid_s


@triton.jit
def _pass_slot(same, rank, count, r):
    """(slot, valid): the expert's slot of rank r (slot 0, not valid, past its last)."""
    idx = tl.arange(0, same.shape[0])
    return tl.sum(tl.where(same & (rank == r), idx, 0), axis=0), r < count


@triton.jit
def _pass_slots(same, rank, count, p0):
    """(slot, valid) of ranks p0 .. p0 + 3 of the expert's slots: one pass's four rows (``_pass_slot`` each)."""
    slot0, v0 = _pass_slot(same, rank, count, p0)
    slot1, v1 = _pass_slot(same, rank, count, p0 + 1)
    slot2, v2 = _pass_slot(same, rank, count, p0 + 2)
    slot3, v3 = _pass_slot(same, rank, count, p0 + 3)
    return slot0, v0, slot1, v1, slot2, v2, slot3, v3


@triton.jit
def _masked(mask, valid):
    """mask & the scalar ``valid``, as a boolean mask (the interpreter's & of the two is int32, which it refuses as a
    mask; the compiler folds the comparison)."""
    return (mask & valid) != 0


@triton.jit
def _int4_weights(w_ptrs, mask_w, z_ptrs, s_ptrs, mask_n, EVEN: tl.constexpr, PTX: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K step of codes: (w, s16), w the bytes [BLOCK_N, BLOCK_K / 2] at ``w_ptrs`` as (q - zero) / 16 in input
    order [BLOCK_N, BLOCK_K] fp32 (exact), s16 [BLOCK_N] 16 times the step's group scales; ``z_ptrs`` / ``s_ptrs``
    [BLOCK_N] the group's zero points and scales. Masked bytes give finite weights: their inputs are 0."""
    if EVEN:
        b = tl.load(w_ptrs)
        zf = tl.load(z_ptrs).to(tl.float32)
        s16 = tl.load(s_ptrs) * 16.0
    else:
        b = tl.load(w_ptrs, mask=mask_w, other=0)
        zf = tl.load(z_ptrs, mask=mask_n, other=0).to(tl.float32)
        s16 = tl.load(s_ptrs, mask=mask_n, other=0.0) * 16.0
    zf = 1.0 + zf * 0.0625  # 1 + zero / 16, exact
    lo, hi = _unpack_nibbles(b, PTX)  # 1 + q / 16 per nibble, fp32 [BLOCK_N, BLOCK_K / 2]
    # the nibbles back in input order: a thread's 16 bytes become its 32 contiguous inputs (no data movement)
    return tl.reshape(tl.join(lo - zf[:, None], hi - zf[:, None]), (BLOCK_N, BLOCK_K)), s16


@triton.jit
def _row_inputs(row_ptr, valid, k0, K, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_K] fp32: inputs k0 .. k0 + BLOCK_K of the row at ``row_ptr`` (0 where not valid, and past K)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = _masked(tl.full((BLOCK_K,), 1, tl.int1) if EVEN_K else offs_k < K, valid)
    return tl.load(row_ptr + offs_k, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _pass_inputs(base_ptr, stride, DIV: tl.constexpr, slot0, v0, slot1, v1, slot2, v2, slot3, v3, k0, K,
                 EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
    """One K step's inputs of a pass's ROWS slots (``_row_inputs``; the rest repeat the first, unused): slot s reads
    row s // DIV of ``base_ptr`` (x: a token's TOP_K slots share its row; h: a row per slot)."""
    a0 = _row_inputs(base_ptr + (slot0 // DIV) * stride, v0, k0, K, EVEN_K, BLOCK_K)
    a1 = a0
    a2 = a0
    a3 = a0
    if ROWS > 1:
        a1 = _row_inputs(base_ptr + (slot1 // DIV) * stride, v1, k0, K, EVEN_K, BLOCK_K)
    if ROWS > 2:
        a2 = _row_inputs(base_ptr + (slot2 // DIV) * stride, v2, k0, K, EVEN_K, BLOCK_K)
        a3 = _row_inputs(base_ptr + (slot3 // DIV) * stride, v3, k0, K, EVEN_K, BLOCK_K)
    return a0, a1, a2, a3


@triton.jit
def _chunk_sums(acc, w, a, s16):
    """acc [BLOCK_N, BLOCK_K / 32] + w [BLOCK_N, BLOCK_K] * a [BLOCK_K] summed over each thread's run of 32 inputs
    (in registers), times the group's 16 * scale [BLOCK_N]."""
    prod = w * a[None, :]
    return acc + tl.sum(tl.reshape(prod, (prod.shape[0], prod.shape[1] // 32, 32)), axis=2) * s16[:, None]


@triton.jit
def _rows_chunk_sums(acc0, acc1, acc2, acc3, w, s16, a0, a1, a2, a3, ROWS: tl.constexpr):
    """``_chunk_sums`` of the pass's ROWS rows of inputs against one step of codes."""
    acc0 = _chunk_sums(acc0, w, a0, s16)
    if ROWS > 1:
        acc1 = _chunk_sums(acc1, w, a1, s16)
    if ROWS > 2:
        acc2 = _chunk_sums(acc2, w, a2, s16)
        acc3 = _chunk_sums(acc3, w, a3, s16)
    return acc0, acc1, acc2, acc3


@triton.jit
def _split_sum(part, mask, stride_split, SPLIT_K: tl.constexpr):
    """The partial sums at ``part`` [BLOCK_N] of each split (``stride_split`` apart) added in split order; read from
    L2, past L1, where other SMs wrote them. The split count is a constexpr: the loads unrolled, in flight together."""
    tot = tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, SPLIT_K):
        tot += tl.load(part + s * stride_split, mask=mask, other=0.0, cache_modifier=".cg")
    return tot


@triton.jit
def _up_out(acc_gate, acc_up, slot, valid, h_ptr, b_ptr, part_ptr, expert, offs_n, mask_n, pid_k, num_slots, N,
            stride_hm, alpha, limit, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, EMULATE_BF16: tl.constexpr,
            SPLIT_K: tl.constexpr):
    """One slot's sums [BLOCK_N, BLOCK_K / 32]: its h columns (one split), or its partial sums."""
    gate, up = tl.sum(acc_gate, axis=1), tl.sum(acc_up, axis=1)
    if SPLIT_K == 1:
        _up_epilogue(gate, up, slot, valid, h_ptr, b_ptr, expert, offs_n, mask_n, N, stride_hm, alpha, limit, ACT,
                     HAS_BIAS, EMULATE_BF16)
    else:
        part = part_ptr + (pid_k * num_slots + slot) * 2 * N + offs_n
        tl.store(part, gate, mask=_masked(mask_n, valid))
        tl.store(part + N, up, mask=_masked(mask_n, valid))


@triton.jit
def _up_epilogue(gate, up, slot, valid, h_ptr, b_ptr, expert, offs_n, mask_n, N, stride_hm, alpha, limit,
                 ACT: tl.constexpr, HAS_BIAS: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """h[slot, offs_n] = act(gate) * up from the fp32 sums [BLOCK_N], rounded as ``kernels.moe``'s up GEMM."""
    dtype = h_ptr.dtype.element_ty
    gate, up = _round(gate, dtype, EMULATE_BF16), _round(up, dtype, EMULATE_BF16)
    if HAS_BIAS:
        bias = b_ptr + expert * 2 * N + offs_n
        gate = _round(gate.to(tl.float32) + tl.load(bias, mask=mask_n, other=0.0).to(tl.float32), dtype, EMULATE_BF16)
        up = _round(up.to(tl.float32) + tl.load(bias + N, mask=mask_n, other=0.0).to(tl.float32), dtype, EMULATE_BF16)
    tl.store(h_ptr + slot * stride_hm + offs_n, _act_mul(gate, up, alpha, limit, ACT, EMULATE_BF16),
             mask=_masked(mask_n, valid))


@triton.jit
def _moe_gemv_up_kernel(x_ptr, w_ptr, ws_ptr, wz_ptr, b_ptr, h_ptr, experts_ptr, part_ptr, counter_ptr,
                        num_slots, N, K, num_groups, steps_per_split, stride_xm, stride_we, stride_wn, stride_hm,
                        alpha, limit,
                        TOP_K: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP_SIZE: tl.constexpr,
                        EMULATE_BF16: tl.constexpr, PTX: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                        S_POW2: tl.constexpr, ROWS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    # x: [T, K]; w: [E, 2N, K / 2] codes (gate rows, then up rows; strides in bytes); ws fp32 / wz uint8 [E, 2N,
    # num_groups]; b: [E, 2N] (HAS_BIAS); h: [num_slots, N]; experts: [num_slots] (slot = token * TOP_K + j);
    # part: [SPLIT_K, num_slots, 2, N] fp32 partial sums (SPLIT_K > 1). ROWS (1, 2 or 4) slots per pass, each with
    # its own accumulators [BLOCK_N, BLOCK_K / 32] (2D: the codes' layout, each thread's 32 inputs in its registers)
    pid_s = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    same, rank, count, leader = _leader_slots(experts_ptr, pid_s, num_slots, S_POW2)
    if not leader:
        return
    expert = tl.load(experts_ptr + pid_s).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_kh = tl.arange(0, BLOCK_K // 2)
    w_gate = w_ptr + expert * stride_we + offs_n[:, None] * stride_wn + offs_kh[None, :]  # [BLOCK_N, BLOCK_K / 2]
    w_up = w_gate + N * stride_wn
    g_gate = expert * 2 * N * num_groups + offs_n * num_groups  # [BLOCK_N] rows of ws / wz
    g_up = g_gate + N * num_groups
    first_step = pid_k * steps_per_split
    num_steps = tl.minimum(steps_per_split, tl.cdiv(K, BLOCK_K) - first_step)
    even: tl.constexpr = EVEN_N and EVEN_K
    for p0 in range(0, count, ROWS):
        slot0, v0, slot1, v1, slot2, v2, slot3, v3 = _pass_slots(same, rank, count, p0)
        acc_g0 = tl.zeros((BLOCK_N, BLOCK_K // 32), dtype=tl.float32)
        acc_u0 = acc_g0
        acc_g1 = acc_g0
        acc_u1 = acc_g0
        acc_g2 = acc_g0
        acc_u2 = acc_g0
        acc_g3 = acc_g0
        acc_u3 = acc_g0
        for step in range(0, num_steps):
            k0 = (first_step + step) * BLOCK_K
            g = k0 // GROUP_SIZE
            mask_w = mask_n[:, None] & (offs_kh < (K - k0) // 2)[None, :]
            # the gate rows' codes, then the up rows': one step of unpacked codes live at a time
            a0, a1, a2, a3 = _pass_inputs(x_ptr, stride_xm, TOP_K, slot0, v0, slot1, v1, slot2, v2, slot3, v3, k0, K,
                                          EVEN_K, BLOCK_K, ROWS)
            w, s16 = _int4_weights(w_gate + k0 // 2, mask_w, wz_ptr + g_gate + g, ws_ptr + g_gate + g, mask_n, even,
                                   PTX, BLOCK_N, BLOCK_K)
            acc_g0, acc_g1, acc_g2, acc_g3 = _rows_chunk_sums(acc_g0, acc_g1, acc_g2, acc_g3, w, s16, a0, a1, a2, a3,
                                                              ROWS)
            w, s16 = _int4_weights(w_up + k0 // 2, mask_w, wz_ptr + g_up + g, ws_ptr + g_up + g, mask_n, even, PTX,
                                   BLOCK_N, BLOCK_K)
            acc_u0, acc_u1, acc_u2, acc_u3 = _rows_chunk_sums(acc_u0, acc_u1, acc_u2, acc_u3, w, s16, a0, a1, a2, a3,
                                                              ROWS)
        out = (h_ptr, b_ptr, part_ptr, expert, offs_n, mask_n, pid_k, num_slots, N, stride_hm, alpha, limit)
        _up_out(acc_g0, acc_u0, slot0, v0, *out, ACT, HAS_BIAS, EMULATE_BF16, SPLIT_K)
        if ROWS > 1:
            _up_out(acc_g1, acc_u1, slot1, v1, *out, ACT, HAS_BIAS, EMULATE_BF16, SPLIT_K)
        if ROWS > 2:
            _up_out(acc_g2, acc_u2, slot2, v2, *out, ACT, HAS_BIAS, EMULATE_BF16, SPLIT_K)
            _up_out(acc_g3, acc_u3, slot3, v3, *out, ACT, HAS_BIAS, EMULATE_BF16, SPLIT_K)
    if SPLIT_K > 1:
        counter = counter_ptr + pid_s * tl.num_programs(1) + pid_n
        if _arrive(counter, SPLIT_K):
            tl.store(counter, 0)  # zero again for the next launch
            for r in range(0, count):
                slot, valid = _pass_slot(same, rank, count, r)
                part = part_ptr + slot * 2 * N + offs_n
                gate = _split_sum(part, mask_n, num_slots * 2 * N, SPLIT_K)
                up = _split_sum(part + N, mask_n, num_slots * 2 * N, SPLIT_K)
                _up_epilogue(gate, up, slot, valid, h_ptr, b_ptr, expert, offs_n, mask_n, N, stride_hm, alpha, limit,
                             ACT, HAS_BIAS, EMULATE_BF16)


@triton.jit
def _down_out(acc, slot, valid, y_ptr, b_ptr, part_ptr, expert, offs_n, mask_n, pid_k, num_slots, N, stride_ym,
              HAS_BIAS: tl.constexpr, EMULATE_BF16: tl.constexpr, SPLIT_K: tl.constexpr):
    """One slot's sums [BLOCK_N, BLOCK_K / 32]: its y columns (one split), or its partial sums."""
    out = tl.sum(acc, axis=1)
    if SPLIT_K == 1:
        _down_epilogue(out, slot, valid, y_ptr, b_ptr, expert, offs_n, mask_n, N, stride_ym, HAS_BIAS, EMULATE_BF16)
    else:
        tl.store(part_ptr + (pid_k * num_slots + slot) * N + offs_n, out, mask=_masked(mask_n, valid))


@triton.jit
def _down_epilogue(out, slot, valid, y_ptr, b_ptr, expert, offs_n, mask_n, N, stride_ym, HAS_BIAS: tl.constexpr,
                   EMULATE_BF16: tl.constexpr):
    """y[slot, offs_n] from the fp32 sums [BLOCK_N], rounded as ``kernels.moe``'s down GEMM."""
    dtype = y_ptr.dtype.element_ty
    y = _round(out, dtype, EMULATE_BF16)
    if HAS_BIAS:
        b = tl.load(b_ptr + expert * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        y = _round(y.to(tl.float32) + b, dtype, EMULATE_BF16)
    tl.store(y_ptr + slot * stride_ym + offs_n, y, mask=_masked(mask_n, valid))


@triton.jit
def _moe_gemv_down_kernel(h_ptr, w_ptr, ws_ptr, wz_ptr, b_ptr, y_ptr, experts_ptr, part_ptr, counter_ptr,
                          num_slots, N, K, num_groups, steps_per_split, stride_hm, stride_we, stride_wn, stride_ym,
                          HAS_BIAS: tl.constexpr, GROUP_SIZE: tl.constexpr, EMULATE_BF16: tl.constexpr,
                          PTX: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, S_POW2: tl.constexpr,
                          ROWS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # h: [num_slots, K]; w: [E, N, K / 2] codes; ws / wz [E, N, num_groups]; b: [E, N]; y: [num_slots, N];
    # part: [SPLIT_K, num_slots, N] fp32 (SPLIT_K > 1). As the up kernel, one matrix
    pid_s = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    same, rank, count, leader = _leader_slots(experts_ptr, pid_s, num_slots, S_POW2)
    if not leader:
        return
    expert = tl.load(experts_ptr + pid_s).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_kh = tl.arange(0, BLOCK_K // 2)
    w_rows = w_ptr + expert * stride_we + offs_n[:, None] * stride_wn + offs_kh[None, :]
    g_rows = expert * N * num_groups + offs_n * num_groups
    first_step = pid_k * steps_per_split
    num_steps = tl.minimum(steps_per_split, tl.cdiv(K, BLOCK_K) - first_step)
    even: tl.constexpr = EVEN_N and EVEN_K
    for p0 in range(0, count, ROWS):
        slot0, v0, slot1, v1, slot2, v2, slot3, v3 = _pass_slots(same, rank, count, p0)
        acc0 = tl.zeros((BLOCK_N, BLOCK_K // 32), dtype=tl.float32)
        acc1 = acc0
        acc2 = acc0
        acc3 = acc0
        for step in range(0, num_steps):
            k0 = (first_step + step) * BLOCK_K
            g = k0 // GROUP_SIZE
            mask_w = mask_n[:, None] & (offs_kh < (K - k0) // 2)[None, :]
            a0, a1, a2, a3 = _pass_inputs(h_ptr, stride_hm, 1, slot0, v0, slot1, v1, slot2, v2, slot3, v3, k0, K,
                                          EVEN_K, BLOCK_K, ROWS)
            w, s16 = _int4_weights(w_rows + k0 // 2, mask_w, wz_ptr + g_rows + g, ws_ptr + g_rows + g, mask_n, even,
                                   PTX, BLOCK_N, BLOCK_K)
            acc0, acc1, acc2, acc3 = _rows_chunk_sums(acc0, acc1, acc2, acc3, w, s16, a0, a1, a2, a3, ROWS)
        out = (y_ptr, b_ptr, part_ptr, expert, offs_n, mask_n, pid_k, num_slots, N, stride_ym)
        _down_out(acc0, slot0, v0, *out, HAS_BIAS, EMULATE_BF16, SPLIT_K)
        if ROWS > 1:
            _down_out(acc1, slot1, v1, *out, HAS_BIAS, EMULATE_BF16, SPLIT_K)
        if ROWS > 2:
            _down_out(acc2, slot2, v2, *out, HAS_BIAS, EMULATE_BF16, SPLIT_K)
            _down_out(acc3, slot3, v3, *out, HAS_BIAS, EMULATE_BF16, SPLIT_K)
    if SPLIT_K > 1:
        counter = counter_ptr + pid_s * tl.num_programs(1) + pid_n
        if _arrive(counter, SPLIT_K):
            tl.store(counter, 0)
            for r in range(0, count):
                slot, valid = _pass_slot(same, rank, count, r)
                out = _split_sum(part_ptr + slot * N + offs_n, mask_n, num_slots * N, SPLIT_K)
                _down_epilogue(out, slot, valid, y_ptr, b_ptr, expert, offs_n, mask_n, N, stride_ym, HAS_BIAS,
                               EMULATE_BF16)


# --- host side -----------------------------------------------------------------------------------------
def int4_experts_gemv(x: torch.Tensor, experts: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                      scales: tuple[torch.Tensor, torch.Tensor], zeros: tuple[torch.Tensor, torch.Tensor],
                      group_size: int, activation: int, b_gate_up: torch.Tensor | None, b_down: torch.Tensor | None,
                      swiglu_alpha: float, swiglu_limit: float, config: MoeGemvConfig | None = None
                      ) -> torch.Tensor:
    """Each slot's expert output y [T * top_k, hidden] in x's dtype, for W4A16 experts (``kernels.moe.fused_experts``
    has checked the arguments: x [T, hidden], experts [T, top_k], codes w_gate_up [E, 2I, hidden / 2] / w_down [E,
    hidden, I / 2] with their ``scales`` fp32 / ``zeros`` uint8 [E, out, in / group_size], last dims contiguous;
    ``activation`` the index in ``kernels.moe.ACTIVATIONS``)."""
    num_tokens, hidden = x.shape
    top_k = experts.shape[1]
    num_experts, inter = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    num_slots = num_tokens * top_k
    cfg = config or default_gemv_config(x.device)
    assert all(v >= 1 and v & (v - 1) == 0 for v in (cfg.block_n, cfg.down_block_n)), \
        f"{cfg}: block_n and down_block_n must be powers of 2"
    assert cfg.slots_per_pass in (1, 2, 4), f"{cfg}: slots_per_pass takes 1, 2 or 4"
    flat = experts.reshape(-1)
    flat = flat if flat.is_contiguous() else flat.contiguous()
    rows = min(cfg.slots_per_pass, triton.next_power_of_2(num_tokens))  # an expert gets at most T slots (top-k)
    emulate = _interpreting() and x.dtype == torch.bfloat16
    common = dict(EMULATE_BF16=emulate, PTX=not _interpreting(), S_POW2=triton.next_power_of_2(num_slots), ROWS=rows,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    num_routed = min(num_experts, num_slots)
    h = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)  # h: [T * top_k, I]
    y = torch.empty(num_slots, hidden, dtype=x.dtype, device=x.device)  # y: [T * top_k, hidden]
    for name, (out_f, in_f, w, block_n, block_k, split) in {
            "up": (inter, hidden, w_gate_up, cfg.block_n, cfg.block_k, cfg.split_k),
            "down": (hidden, inter, w_down, cfg.down_block_n, cfg.down_block_k, cfg.down_split_k)}.items():
        if rows == 4 and name == "up":
            block_n = min(block_n, 64)  # 128 gate and 128 up rows for four slots spill (sm_90: 255 registers, ~300 LDL)
        group = in_f if group_size == -1 else group_size
        block_k = _step_k(block_k, group, in_f)
        num_tiles = triton.cdiv(out_f, block_n)
        split_k, steps_per_split = _split(split, num_tiles, triton.cdiv(in_f, block_k), num_routed, x.device)
        part = counters = y  # unread with one split
        if split_k > 1:
            part = torch.empty(split_k * num_slots * (2 if name == "up" else 1) * out_f, dtype=torch.float32,
                               device=x.device)
            counters = _tile_counters(x.device, num_slots * num_tiles)
        s, z = scales[name == "down"], zeros[name == "down"]
        bias = b_gate_up if name == "up" else b_down
        launch = dict(HAS_BIAS=bias is not None, GROUP_SIZE=group, EVEN_N=out_f % block_n == 0,
                      EVEN_K=in_f % block_k == 0, SPLIT_K=split_k, BLOCK_N=block_n, BLOCK_K=block_k, **common)
        bias = bias.contiguous() if bias is not None else w  # unread without a bias
        grid = (num_slots, num_tiles, split_k)
        if name == "up":
            _moe_gemv_up_kernel[grid](
                x, w, s, z, bias, h, flat, part, counters, num_slots, inter, hidden, hidden // group,
                steps_per_split, x.stride(0), w.stride(0), w.stride(1), h.stride(0), float(swiglu_alpha),
                float(swiglu_limit), TOP_K=top_k, ACT=activation, **launch)
        else:
            _moe_gemv_down_kernel[grid](
                h, w, s, z, bias, y, flat, part, counters, num_slots, hidden, inter, inter // group, steps_per_split,
                h.stride(0), w.stride(0), w.stride(1), y.stride(0), **launch)
    return y

