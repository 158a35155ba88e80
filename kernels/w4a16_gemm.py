"""Weight-only quantized GEMM (w4a16, and w8a16 with ``bits=8``) for the CUDA path of the runtime.

``y = x @ ((q - zero) * scale).T + bias`` with x in fp16/bf16/fp32, fp32 accumulation, y in x's
dtype. Two storages of the weights are accepted (``layout``):

``"passes"``: as the quantization passes write them (``passes/README.md``, ``passes/quant_math.py``)

    qweight  uint8 [N, K/2]   byte j of row n = q[n, 2j] | q[n, 2j + 1] << 4   (bits=8: [N, K], q[n, k])
    scales   fp32  [N, G]     G = K / group_size groups (group_size -1: one group over all of K)
    zeros    uint8 [N, G]

``"k_major"``: :func:`repack_w4a16` of the above, done once at load; the fast layout

    qweight  uint8 [K/2, N]   byte [j, n] = q[n, j] | q[n, j + K/2] << 4     (bits=8: [K, N], q[n, k])
    scales   fp32  [G, N]
    zeros    uint8 [G, N]

    A K step reads bytes [j0, j0 + BLOCK_K/2) x [n0, n0 + BLOCK_N): rows contiguous over n (coalesced,
    vectorised), each byte once; its low nibbles pair with x[:, j0 : j0 + BLOCK_K/2] and its high
    nibbles with x[:, K/2 + j0 : ...], both contiguous. The passes' layout pairs nibbles with x's even
    and odd columns (stride-2 loads) and strides the bytes over n: correct, but 2x to 80x slower.

Fused kernel (decode and small batches): one program per (BLOCK_M x BLOCK_N) output tile (grouped
order for L2 reuse) and K split, looping over its K range: load the bytes, split the nibbles,
dequantize in fp32 with the group's scale and zero (one per column when the step lies in one group,
else gathered per (k, n)), and ``tl.dot`` low and high nibbles into the fp32 accumulator. At small M
few tiles fill few SMs, so the K loop is split across programs (``split_k``) whose fp32 partial sums
a second small kernel adds, with the bias (deterministic, no atomics). Configurations are picked by M
from ``_CUDA_CONFIGS`` (tuned with ``python -m kernels.bench.gemm --sweep`` on H100 and H200).

From ``DEQUANT_MIN_ROWS`` rows on (prefill), the weight is dequantized into a temporary bf16/fp16
[N, K] (``dequantize_w4a16``) and multiplied by cuBLAS, which beats the fused kernel there. Up to
``kernels.gemv.GEMV_MAX_ROWS`` rows the runtime uses the GEMV kernel (``kernels.gemv.w4a16_gemv``) instead.

NOTE: no host synchronisation: grids and splits come from shapes only (CUDA-graph capturable).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.torch_quant import dequantize_weight, unpack_int4

X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LAYOUTS = ("passes", "k_major")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class GemmConfig:
    """One launch configuration of the fused kernel."""

    block_m: int  # rows of x per tile (>= 16: tl.dot's minimum)
    block_n: int  # output features per tile
    block_k: int  # input features per K step (>= 32: each nibble half feeds a dot of block_k / 2)
    split_k: int = 1  # programs sharing one tile's K range; 0 = pick from the tile count and the SM count
    group_m: int = 8  # tile rows walked together (L2 reuse of the weight tiles across M)
    num_warps: int = 4
    num_stages: int = 3
    tf32_dot: bool = False  # bf16/fp16 x: tf32 MMA on the fp32 dequantized weights (no cast to x's dtype)


# Picked by M: the first row whose bound is >= M (up to DEQUANT_MIN_ROWS).
_CUDA_CONFIGS: list[tuple[int, GemmConfig]] = [
    (16, GemmConfig(16, 128, 256, split_k=0, num_warps=4, num_stages=3)),
    (32, GemmConfig(32, 128, 256, split_k=0, num_warps=4, num_stages=3)),
    (64, GemmConfig(64, 128, 128, split_k=0, num_warps=4, num_stages=4)),
    (1 << 62, GemmConfig(128, 128, 64, split_k=0, num_warps=4, num_stages=4)),
]
# Under TRITON_INTERPRET every program runs in Python: one small config keeps tests fast.
_INTERPRETER_CONFIG = GemmConfig(16, 32, 32, split_k=1, group_m=4, num_warps=1, num_stages=1)
# From this many rows on, dequantize + cuBLAS beats the fused kernel (H100/H200, Llama-3-8B shapes: the
# dequantization costs ~N*K*2.5 bytes of traffic, the fused kernel's MMA runs at ~1/3 of cuBLAS's rate).
DEQUANT_MIN_ROWS = 256
_MAX_SPLIT_K = 16
_MIN_K_STEPS_PER_SPLIT = 4  # fewer K steps per program than this and the extra partial sums cost more


def default_config(num_rows: int, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> GemmConfig:
    """The heuristic configuration for ``num_rows`` rows of x (split_k may still be 0 = auto). The table
    is tuned for 2-byte activations; fp32 ones (reference-precision artifacts) use half the K step and
    two stages so the tiles fit in shared memory (228 KiB per SM on Hopper)."""
    if _interpreting() or device.type != "cuda":
        return _INTERPRETER_CONFIG
    cfg = next(cfg for bound, cfg in _CUDA_CONFIGS if num_rows <= bound)
    if dtype == torch.float32:
        cfg = dataclasses.replace(cfg, block_k=max(32, cfg.block_k // 2), num_stages=2)
    return cfg


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _auto_split_k(num_tiles: int, num_k_steps: int, device: torch.device) -> int:
    """Enough K splits for about two programs per SM, each keeping a few K steps."""
    if device.type != "cuda":
        return 1
    num_sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    split = min(2 * num_sms // max(num_tiles, 1), num_k_steps // _MIN_K_STEPS_PER_SPLIT, _MAX_SPLIT_K)
    return max(split, 1)


def split_k_plan(y: torch.Tensor, k: int, block_m: int, block_n: int, block_k: int, split_k: int):
    """Grid and output of a split-K launch writing y [M, N]: (num_tiles, split_k, K steps per split, out,
    stride_om, stride_os). ``split_k`` 0 = auto; no split is left empty. With more than one split, ``out`` is
    a [split_k, M, N] fp32 buffer of partial sums for ``reduce_split_k``; else y itself."""
    num_rows, n = y.shape
    num_tiles = triton.cdiv(num_rows, block_m) * triton.cdiv(n, block_n)
    num_k_steps = triton.cdiv(k, block_k)
    split_k = split_k or _auto_split_k(num_tiles, num_k_steps, y.device)
    steps_per_split = triton.cdiv(num_k_steps, split_k)
    split_k = triton.cdiv(num_k_steps, steps_per_split)
    if split_k > 1:
        out = torch.empty((split_k, num_rows, n), dtype=torch.float32, device=y.device)
        return num_tiles, split_k, steps_per_split, out, out.stride(1), out.stride(0)
    return num_tiles, 1, steps_per_split, y, y.stride(0), 0


def reduce_split_k(partial: torch.Tensor, bias: torch.Tensor, y: torch.Tensor, split_k: int, has_bias: bool) -> None:
    """y = sum of the [split_k, M, N] fp32 partial sums (+ bias), in y's dtype."""
    block = 1024
    _split_k_reduce_kernel[(triton.cdiv(y.numel(), block),)](
        partial, bias, y, y.shape[1], y.numel(), SPLIT_K=split_k, HAS_BIAS=has_bias, BLOCK=block, num_warps=4)


# --- kernels ---------------------------------------------------------------------------------------
_DOT_NATIVE, _DOT_TF32, _DOT_IEEE = 0, 1, 2  # DOT modes of _mma


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(tile row, tile column) of program ``pid`` in grouped order: GROUP_M tile rows share each column
    of weight tiles while it is in L2."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_rows = min(num_pid_m - first_pid_m, GROUP_M)
    return first_pid_m + (pid % num_pid_in_group) % group_rows, (pid % num_pid_in_group) // group_rows


@triton.jit
def output_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """A split-K GEMM program's share (grid axis 0: output tiles in grouped order; axis 1: K splits): its rows
    offs_m, columns offs_n, their masks, and its K split pid_k."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, offs_m < M, offs_n < N, tl.program_id(1)


@triton.jit
def store_output_tile(out_ptr, y, bias_ptr, offs_m, offs_n, mask_m, mask_n, pid_k, stride_om, stride_os,
                      HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):
    """A tile's fp32 sums y [BLOCK_M, BLOCK_N] to ``out``: y [M, N] in out's dtype, bias added; or, split over K,
    this split's partial sums [SPLIT_K, M, N] fp32, which ``reduce_split_k`` adds with the bias."""
    mask_out = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            y += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=mask_out)
    else:
        tl.store(out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :], y, mask=mask_out)


@triton.jit
def _mma(a, w, acc, DOT: tl.constexpr):
    """acc + a @ w. a: x's dtype; w: fp32 dequantized weights. DOT: _DOT_NATIVE = tensor cores on x's
    dtype (w rounded to it); _DOT_TF32 = tf32 tensor cores on fp32 operands (x is exact in tf32, w is
    not rounded to bf16: no conversion); _DOT_IEEE = fp32 at IEEE precision (fp32 x; the interpreter,
    whose bf16 dot is wrong)."""
    if DOT == 0:
        return tl.dot(a, w.to(a.dtype), acc)
    elif DOT == 1:
        return tl.dot(a.to(tl.float32), w, acc, input_precision="tf32")
    else:
        return tl.dot(a.to(tl.float32), w.to(a.dtype).to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _load_bytes(qw_ptr, rows, offs_n, mask, stride_qw, K_MAJOR: tl.constexpr):
    """int32 [len(rows), BLOCK_N]: qweight's bytes at byte rows ``rows`` (j, or k for 8 bits)."""
    if K_MAJOR:
        ptrs = qw_ptr + rows[:, None] * stride_qw + offs_n[None, :]
    else:
        ptrs = qw_ptr + offs_n[None, :] * stride_qw + rows[:, None]
    return tl.load(ptrs, mask=mask, other=0).to(tl.int32)


@triton.jit
def _group_params(s_ptr, z_ptr, first_k, row_k, offs_n, mask, mask_n, group_size, stride_sz,
                  K_MAJOR: tl.constexpr, PER_TILE: tl.constexpr):
    """(scale, zero * scale) fp32 for codes of input features ``row_k`` [R] (first one ``first_k``):
    [1, BLOCK_N] when they all lie in one group (PER_TILE), else gathered [R, BLOCK_N]."""
    if PER_TILE:
        g = first_k // group_size
        if K_MAJOR:
            off = g * stride_sz + offs_n
        else:
            off = offs_n * stride_sz + g
        s = tl.load(s_ptr + off, mask=mask_n, other=0.0)[None, :]
        z = tl.load(z_ptr + off, mask=mask_n, other=0).to(tl.float32)[None, :]
    else:
        g = row_k // group_size
        if K_MAJOR:
            off = g[:, None] * stride_sz + offs_n[None, :]
        else:
            off = offs_n[None, :] * stride_sz + g[:, None]
        s = tl.load(s_ptr + off, mask=mask, other=0.0)
        z = tl.load(z_ptr + off, mask=mask, other=0).to(tl.float32)
    return s, z * s


@triton.jit
def _dequant(q, s, zs):
    """(q - zero) * scale as q * scale - zero * scale, fp32. q: int32 codes < 2^23, made floats with
    the 2^23 magic number (an OR and an exact subtraction) instead of a slow int-to-float conversion."""
    qf = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    return qf * s - zs


@triton.jit
def _w4a16_gemm_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr,
    M, N, K, group_size, k_steps_per_split,
    stride_xm,
    stride_qw,  # qweight's stride along its non-unit axis (byte rows when K_MAJOR, n otherwise)
    stride_sz,  # scales' / zeros' stride along their non-unit axis (groups when K_MAJOR, n otherwise)
    stride_om, stride_os,  # out: y [M, N] (stride_os unused), or partial sums [SPLIT_K, M, N] fp32
    BITS: tl.constexpr, K_MAJOR: tl.constexpr, PER_TILE: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    offs_m, offs_n, mask_m, mask_n, pid_k = output_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # this split's K steps; the last split may have fewer, so every step starts inside K
    first_step = pid_k * k_steps_per_split
    num_steps = min(k_steps_per_split, tl.cdiv(K, BLOCK_K) - first_step)
    for step in range(num_steps):
        if BITS == 4:
            # byte rows j: low nibbles are input features k_lo, high nibbles k_hi (module docstring)
            j0 = (first_step + step) * (BLOCK_K // 2)
            offs_j = j0 + tl.arange(0, BLOCK_K // 2)
            mask_j = offs_j < K // 2
            mask_w = mask_j[:, None] & mask_n[None, :]
            b = _load_bytes(qw_ptr, offs_j, offs_n, mask_w, stride_qw, K_MAJOR)  # [BLOCK_K / 2, BLOCK_N]
            mask_a = mask_m[:, None] & mask_j[None, :]
            if K_MAJOR:
                k_lo = offs_j
                k_hi = offs_j + K // 2
                s_lo, zs_lo = _group_params(s_ptr, z_ptr, j0, k_lo, offs_n, mask_w, mask_n, group_size,
                                            stride_sz, K_MAJOR, PER_TILE)
                s_hi, zs_hi = _group_params(s_ptr, z_ptr, j0 + K // 2, k_hi, offs_n, mask_w, mask_n, group_size,
                                            stride_sz, K_MAJOR, PER_TILE)
            else:  # k = 2j and 2j + 1 share a group (group sizes are even)
                k_lo = 2 * offs_j
                k_hi = k_lo + 1
                s_lo, zs_lo = _group_params(s_ptr, z_ptr, 2 * j0, k_lo, offs_n, mask_w, mask_n, group_size,
                                            stride_sz, K_MAJOR, PER_TILE)
                s_hi, zs_hi = s_lo, zs_lo
            a_lo = tl.load(x_rows + k_lo[None, :], mask=mask_a, other=0.0)  # [BLOCK_M, BLOCK_K / 2]
            a_hi = tl.load(x_rows + k_hi[None, :], mask=mask_a, other=0.0)
            acc = _mma(a_lo, _dequant(b & 0xF, s_lo, zs_lo), acc, DOT)
            acc = _mma(a_hi, _dequant(b >> 4, s_hi, zs_hi), acc, DOT)
        else:
            k0 = (first_step + step) * BLOCK_K
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            mask_w = mask_k[:, None] & mask_n[None, :]
            q = _load_bytes(qw_ptr, offs_k, offs_n, mask_w, stride_qw, K_MAJOR)  # [BLOCK_K, BLOCK_N]
            s, zs = _group_params(s_ptr, z_ptr, k0, offs_k, offs_n, mask_w, mask_n, group_size, stride_sz,
                                  K_MAJOR, PER_TILE)
            a = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            acc = _mma(a, _dequant(q, s, zs), acc, DOT)

    store_output_tile(out_ptr, acc, bias_ptr, offs_m, offs_n, mask_m, mask_n, pid_k, stride_om, stride_os,
                      HAS_BIAS, SPLIT_K)


@triton.jit
def _split_k_reduce_kernel(part_ptr, bias_ptr, y_ptr, N, num_out, SPLIT_K: tl.constexpr,
                           HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    # part: [SPLIT_K, M, N] fp32 (contiguous, num_out = M * N) -> y: [M, N] = sum + bias
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_out
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(part_ptr + s * num_out + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_store(out_ptr, q, s_ptr, z_ptr, row_k, offs_n, mask, N, group_size, stride_sz,
                   K_MAJOR: tl.constexpr):
    # out: W^T [K, N]; rows row_k get (q - zero) * scale, exactly as kernels.torch_quant computes it
    g = row_k // group_size
    if K_MAJOR:
        off = g[:, None] * stride_sz + offs_n[None, :]
    else:
        off = offs_n[None, :] * stride_sz + g[:, None]
    s = tl.load(s_ptr + off, mask=mask, other=0.0)
    z = tl.load(z_ptr + off, mask=mask, other=0).to(tl.int32)
    w = ((q - z).to(tl.float32) * s).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row_k[:, None] * N + offs_n[None, :], w, mask=mask)


@triton.jit
def _dequant_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, N, K, group_size, stride_qw, stride_sz,
                    BITS: tl.constexpr, K_MAJOR: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_j = tl.program_id(0) * BLOCK_J + tl.arange(0, BLOCK_J)  # byte rows
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if BITS == 4:
        mask = (offs_j < K // 2)[:, None] & (offs_n < N)[None, :]
        b = _load_bytes(qw_ptr, offs_j, offs_n, mask, stride_qw, K_MAJOR)
        if K_MAJOR:
            k_lo = offs_j
            k_hi = offs_j + K // 2
        else:
            k_lo = 2 * offs_j
            k_hi = k_lo + 1
        _dequant_store(out_ptr, b & 0xF, s_ptr, z_ptr, k_lo, offs_n, mask, N, group_size, stride_sz, K_MAJOR)
        _dequant_store(out_ptr, b >> 4, s_ptr, z_ptr, k_hi, offs_n, mask, N, group_size, stride_sz, K_MAJOR)
    else:
        mask = (offs_j < K)[:, None] & (offs_n < N)[None, :]
        q = _load_bytes(qw_ptr, offs_j, offs_n, mask, stride_qw, K_MAJOR)
        _dequant_store(out_ptr, q, s_ptr, z_ptr, offs_j, offs_n, mask, N, group_size, stride_sz, K_MAJOR)


# --- host side -------------------------------------------------------------------------------------
@dataclass
class _Weights:
    """qweight, scales, zeros of one layout, contiguous, with the facts the kernels take."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    k_major: bool
    out_features: int  # N
    in_features: int  # K
    group_size: int  # effective (-1 resolved to K)

    @property
    def qw_stride(self) -> int:  # along qweight's non-unit axis
        return self.qweight.stride(0)

    @property
    def sz_stride(self) -> int:  # along scales' / zeros' non-unit axis
        return self.scales.stride(0)


def _weights(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, bits: int,
             layout: str) -> _Weights:
    """Validates the weights of ``layout`` (user-facing errors) and returns them contiguous."""
    if bits not in (4, 8):
        raise ValueError(f"bits {bits} is not supported (4 for w4a16, 8 for w8a16)")
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")
    if qweight.dtype != torch.uint8 or zeros.dtype != torch.uint8 or scales.dtype != torch.float32:
        raise ValueError(f"expected qweight uint8, scales fp32, zeros uint8; got {qweight.dtype}, "
                         f"{scales.dtype}, {zeros.dtype}")
    if qweight.dim() != 2:
        raise ValueError(f"qweight must be 2-D, got shape {tuple(qweight.shape)}")
    k_major = layout == "k_major"
    out_features = qweight.shape[1] if k_major else qweight.shape[0]
    in_features = (qweight.shape[0] if k_major else qweight.shape[1]) * (8 // bits)
    g = in_features if group_size == -1 else group_size
    if g < 1 or in_features % g or (bits == 4 and g % 2):
        raise ValueError(f"group_size {group_size} does not divide the {in_features} input features into "
                         f"{'even ' if bits == 4 else ''}groups (use -1 for one group per output channel)")
    num_groups = in_features // g
    expected = (num_groups, out_features) if k_major else (out_features, num_groups)
    if tuple(scales.shape) != expected or tuple(zeros.shape) != expected:
        raise ValueError(f"scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} do not match qweight "
                         f"{tuple(qweight.shape)} ({layout} layout) with group_size {group_size} "
                         f"(expected {expected})")
    return _Weights(qweight.contiguous(), scales.contiguous(), zeros.contiguous(), k_major, out_features,
                    in_features, g)


def _check_device(t: torch.Tensor) -> None:
    if not (t.is_cuda or _interpreting()):
        raise RuntimeError("the w4a16 kernels run on CUDA tensors (or under TRITON_INTERPRET=1); "
                           "use kernels.torch_quant on the CPU")


def _check_inputs(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                  bias: torch.Tensor | None, bits: int, layout: str) -> tuple[_Weights, torch.Tensor]:
    """Validates a linear's inputs (user-facing errors); returns the weights and x as [M, K] with unit stride
    along K."""
    _check_device(x)
    if x.dtype not in X_DTYPES:
        raise ValueError(f"x dtype {x.dtype} is not supported ({', '.join(map(str, X_DTYPES))})")
    w = _weights(qweight, scales, zeros, group_size, bits, layout)
    if x.shape[-1] != w.in_features:
        raise ValueError(f"x has {x.shape[-1]} input features, the weights {w.in_features} "
                         f"(qweight {tuple(qweight.shape)}, {layout} layout, {bits} bits)")
    if bias is not None and tuple(bias.shape) != (w.out_features,):
        raise ValueError(f"bias {tuple(bias.shape)} does not match {w.out_features} output features")
    x2 = x.reshape(-1, w.in_features)  # x2: [M, K]
    return w, (x2 if x2.stride(-1) == 1 else x2.contiguous())


def dequantize_w4a16(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                     dtype: torch.dtype, *, bits: int = 4, layout: str = "passes") -> torch.Tensor:
    """The weight ``(q - zero) * scale`` [N, K] in ``dtype``, stored K-major (a view of a contiguous
    [K, N]); bitwise what ``kernels.torch_quant.dequantize_weight`` computes."""
    _check_device(qweight)
    w = _weights(qweight, scales, zeros, group_size, bits, layout)
    out = torch.empty((w.in_features, w.out_features), dtype=dtype, device=qweight.device)  # W^T
    num_byte_rows = w.in_features * bits // 8
    block_j, block_n = 32, 128
    _dequant_kernel[(triton.cdiv(num_byte_rows, block_j), triton.cdiv(w.out_features, block_n))](
        w.qweight, w.scales, w.zeros, out, w.out_features, w.in_features, w.group_size, w.qw_stride,
        w.sz_stride, BITS=bits, K_MAJOR=w.k_major, BLOCK_J=block_j, BLOCK_N=block_n, num_warps=4)
    return out.t()


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, bias: torch.Tensor | None = None, *, bits: int = 4, layout: str = "passes",
                 config: GemmConfig | None = None) -> torch.Tensor:
    """``x @ ((q - zero) * scale).T + bias`` for w4a16 (``bits=8``: w8a16) weights in ``layout``.

    x: [..., K] fp16/bf16/fp32 -> y: [..., N] in x's dtype (fp32 accumulation). ``layout="k_major"``
    takes :func:`repack_w4a16`'s output (``w4a16_linear(x, **repacked)``), several times faster at
    small M than the passes' layout. From ``DEQUANT_MIN_ROWS`` rows on (no ``config``) the weight is
    dequantized into a temporary and multiplied by cuBLAS; ``config`` forces the fused kernel with that
    configuration (benchmarks and tests).
    """
    w, x2 = _check_inputs(x, qweight, scales, zeros, group_size, bias, bits, layout)
    num_rows = x2.shape[0]
    if config is None and num_rows >= DEQUANT_MIN_ROWS:
        w_deq = dequantize_w4a16(w.qweight, w.scales, w.zeros, group_size, x.dtype, bits=bits, layout=layout)
        return F.linear(x, w_deq, bias)
    y = torch.empty((num_rows, w.out_features), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return y.reshape(*x.shape[:-1], w.out_features)

    cfg = config or default_config(num_rows, x.device, x.dtype)
    assert cfg.block_m >= 16 and cfg.block_k >= 32, f"{cfg}: tl.dot needs block_m >= 16 and block_k / 2 >= 16"
    num_tiles, split_k, steps_per_split, out, stride_om, stride_os = split_k_plan(
        y, w.in_features, cfg.block_m, cfg.block_n, cfg.block_k, cfg.split_k)
    bias_arg = bias if bias is not None else y  # never read without HAS_BIAS
    if x.dtype == torch.float32:
        dot = _DOT_IEEE
    elif cfg.tf32_dot:
        dot = _DOT_TF32
    else:  # the interpreter's bf16 dot is wrong: there, fp32 on the bf16-rounded operands
        dot = _DOT_IEEE if _interpreting() and x.dtype == torch.bfloat16 else _DOT_NATIVE
    # A K step's codes lie in one group (one scale per column) when group-aligned; each nibble half of
    # a k-major 4-bit step starts at j0 and K/2 + j0, so K/2 must keep the half steps aligned too.
    step_k = cfg.block_k // 2 if bits == 4 and w.k_major else cfg.block_k
    per_tile = w.group_size % step_k == 0 and (not (bits == 4 and w.k_major) or (w.in_features // 2) % step_k == 0)
    args = (x2, w.qweight, w.scales, w.zeros, bias_arg, out,
            num_rows, w.out_features, w.in_features, w.group_size, steps_per_split,
            x2.stride(0), w.qw_stride, w.sz_stride, stride_om, stride_os)
    flags = {"BITS": bits, "K_MAJOR": w.k_major, "PER_TILE": per_tile, "HAS_BIAS": bias is not None,
             "SPLIT_K": split_k, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "num_warps": cfg.num_warps,
             "num_stages": cfg.num_stages}
    _w4a16_gemm_kernel[(num_tiles, split_k)](*args, **flags, DOT=dot, BLOCK_M=cfg.block_m, GROUP_M=cfg.group_m)
    if split_k > 1:
        reduce_split_k(out, bias_arg, y, split_k, bias is not None)
    return y.reshape(*x.shape[:-1], w.out_features)


def w8a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, bias: torch.Tensor | None = None, *, layout: str = "passes",
                 config: GemmConfig | None = None) -> torch.Tensor:
    """:func:`w4a16_linear` for w8a16 weights (one code per byte)."""
    return w4a16_linear(x, qweight, scales, zeros, group_size, bias, bits=8, layout=layout, config=config)


# --- layouts and reference -------------------------------------------------------------------------
def repack_w4a16(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 bits: int = 4) -> dict[str, torch.Tensor | int | str]:
    """The passes' layout -> ``"k_major"`` (module docstring), as keyword arguments of
    :func:`w4a16_linear`. Done once, at load; :func:`unrepack_w4a16` inverts it."""
    w = _weights(qweight, scales, zeros, group_size, bits, "passes")
    if bits == 4:
        codes = unpack_int4(w.qweight)  # [N, K]
        half = w.in_features // 2
        packed = (codes[:, :half] | (codes[:, half:] << 4)).t().contiguous()  # [K/2, N]
    else:
        packed = w.qweight.t().contiguous()  # [K, N]
    return {"qweight": packed, "scales": w.scales.t().contiguous(), "zeros": w.zeros.t().contiguous(),
            "group_size": group_size, "bits": bits, "layout": "k_major"}


def unrepack_w4a16(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                   bits: int = 4, layout: str = "k_major") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qweight, scales, zeros) of ``layout`` -> the passes' layout (the inverse of :func:`repack_w4a16`)."""
    w = _weights(qweight, scales, zeros, group_size, bits, layout)
    if not w.k_major:
        return w.qweight, w.scales, w.zeros
    if bits == 4:
        packed = w.qweight.t()  # [N, K/2]: low nibbles are k < K/2, high nibbles k >= K/2
        codes = torch.cat((packed & 0x0F, packed >> 4), dim=1)  # [N, K]
        qweight_p = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    else:
        qweight_p = w.qweight.t().contiguous()
    return qweight_p, w.scales.t().contiguous(), w.zeros.t().contiguous()


def ref_w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     group_size: int, bias: torch.Tensor | None = None, *, bits: int = 4,
                     layout: str = "passes") -> torch.Tensor:
    """Reference: dequantize exactly as ``kernels/torch_quant.py`` does, matmul (and bias) in fp32, cast to x's dtype."""
    qweight, scales, zeros = unrepack_w4a16(qweight, scales, zeros, group_size, bits, layout)
    w = dequantize_weight(qweight, scales, zeros, bits, group_size, torch.float32)  # w: [N, K]
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
