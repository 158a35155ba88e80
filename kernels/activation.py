"""SiLU-and-multiply for the merged gate/up projection, with the runtime's numerics.

Semantics are ``kernels/torch_ops.silu_mul`` (the reference): for ``gate_up`` [num_tokens, 2 * I] the first
half of each row is the gate, the second the up projection, and

    out = to_dtype(silu(gate)) * up            [num_tokens, I], silu in fp32

(the silu is rounded to the activation dtype before the product, as torch's ``F.silu(gate) * up`` does).
Separate ``gate`` and ``up`` tensors are accepted too, as ``ops.silu_mul`` accepts them. ``quantize_to`` (int8 or
float8_e4m3fn): the rows leave quantized per token (``kernels.w8a8_gemm.QuantizedRows``, equal to
``quantize_rows(out)``) for the W8A8 linear that reads them, one row per program; with ``input_scale`` (the linear's
calibrated scale) the codes of ``quantize_rows_static(out, input_scale)``, elementwise.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels import torch_ops as ops
from kernels.pdl import pdl_args, wait_prior
from kernels.w4a16_gemm import _interpreting
from kernels.w8a8_gemm import (W_DTYPES, QuantizedRows, _codes, _qrange, quantize_row_store, static_codes,
                               static_scale_arg)

_BLOCK = 1024


def _quant_chunk() -> int:
    """KERNELS_SILU_QUANT_CHUNK: columns per pass of the two-pass quantized SiLU-mul (a power of two >= 16) for rows
    wider than it; 0 (the default) keeps every row in one program's registers. An A/B knob: the one-pass kernel holds
    a 14,336-column row in one program of 16 warps, one program per SM, so its loads stop while it reduces and
    stores (2.0 TB/s measured in a prefill step's profile on the H200, session 35); the two-pass one reads the row
    twice (the second time mostly from L2) in small programs, several per SM. Measured on the H200 (session 37,
    ``kernels.bench.silu_quant``): slower than one pass at every row count, 1 to 8,192 (8,192 rows: 266 us one pass,
    278 / 286 / 323 in chunks of 1,024 / 2,048 / 4,096), so it stays off."""
    value = os.environ.get("KERNELS_SILU_QUANT_CHUNK", "0")
    try:
        chunk = int(value)
    except ValueError:
        chunk = -1
    if chunk != 0 and (chunk < 16 or chunk & (chunk - 1)):
        raise ValueError(f"KERNELS_SILU_QUANT_CHUNK={value!r} is not 0 or a power of two >= 16")
    return chunk


@triton.jit
def silu_mul_values(g, u):
    """silu(g) * u in g's dtype: the silu in fp32, rounded to the dtype before the product (the reference's
    numerics; also the x of ``kernels.w4a16_mma``'s gated linears)."""
    dtype = g.dtype
    gf = g.to(tl.float32)
    e = tl.exp(-tl.abs(gf))  # in (0, 1]: no overflow for large |g|
    sigmoid = tl.where(gf >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    silu = (gf * sigmoid).to(dtype).to(tl.float32)
    return (silu * u.to(tl.float32)).to(dtype)


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, stride_gate, stride_up, stride_out, num_cols,
                     BLOCK: tl.constexpr, PDL: tl.constexpr, TILE: tl.constexpr = 0, s_ptr=None,
                     STATIC: tl.constexpr = False, INT8: tl.constexpr = False, QMIN: tl.constexpr = -127.0,
                     EMULATE_FP8: tl.constexpr = False):
    # TILE > 0: gate_ptr = up_ptr = a [gate | up] row interleaved per TILE columns (TILE gate columns, the same TILE
    # up columns, ...): output column c reads gate column (c // TILE) 2 TILE + c % TILE and the up column TILE after.
    # STATIC: out_ptr takes the codes of the values at the calibrated scale s_ptr holds (static_codes)
    wait_prior(PDL)  # before reading what the previous kernel wrote (kernels/pdl.py)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_cols
    g_cols = cols
    u_cols = cols
    if TILE > 0:
        g_cols = (cols // TILE) * (2 * TILE) + cols % TILE
        u_cols = g_cols + TILE
    g = tl.load(gate_ptr + row * stride_gate + g_cols, mask=mask, other=0.0)
    u = tl.load(up_ptr + row * stride_up + u_cols, mask=mask, other=0.0)
    if STATIC:
        codes = static_codes(silu_mul_values(g, u).to(tl.float32), tl.load(s_ptr).to(tl.float32), out_ptr, QMIN,
                             INT8, EMULATE_FP8)
        tl.store(out_ptr + row * stride_out + cols, codes, mask=mask)
    else:
        tl.store(out_ptr + row * stride_out + cols, silu_mul_values(g, u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_quant_kernel(gate_ptr, up_ptr, q_ptr, s_ptr, stride_gate, stride_up, stride_q, num_cols,
                           INT8: tl.constexpr, EMULATE_FP8: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # one program per row, the whole row in registers: its silu(gate) * up, then its per-token codes and scale
    wait_prior(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    g = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0)
    u = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0)
    v = tl.where(mask, silu_mul_values(g, u).to(tl.float32), 0.0)
    quantize_row_store(v, mask, q_ptr + row * stride_q + cols, s_ptr + row, INT8, EMULATE_FP8)


@triton.jit
def _silu_mul_quant_2pass_kernel(gate_ptr, up_ptr, q_ptr, s_ptr, stride_gate, stride_up, stride_q, num_cols,
                                 INT8: tl.constexpr, EMULATE_FP8: tl.constexpr, BLOCK: tl.constexpr,
                                 PDL: tl.constexpr):
    # one program per row in BLOCK-column chunks: the row's max |silu(gate) * up| first, then its codes from the
    # same values recomputed (the same arithmetic as _silu_mul_quant_kernel: the same scale and codes, bit for bit)
    wait_prior(PDL)
    row = tl.program_id(0)
    g_row = gate_ptr + row * stride_gate
    u_row = up_ptr + row * stride_up
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, num_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < num_cols
        g = tl.load(g_row + cols, mask=mask, other=0.0)
        u = tl.load(u_row + cols, mask=mask, other=0.0)
        amax = tl.maximum(amax, tl.abs(tl.where(mask, silu_mul_values(g, u).to(tl.float32), 0.0)))
    qmax, eps = _qrange(INT8)
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), eps), qmax)
    tl.store(s_ptr + row, scale)
    q_row = q_ptr + row * stride_q
    for start in range(0, num_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < num_cols
        g = tl.load(g_row + cols, mask=mask, other=0.0)
        u = tl.load(u_row + cols, mask=mask, other=0.0)
        v = tl.where(mask, silu_mul_values(g, u).to(tl.float32), 0.0)
        tl.store(q_row + cols, _codes(tl.math.div_rn(v, scale), qmax, q_row + cols, INT8, EMULATE_FP8), mask=mask)


def silu_mul(gate_up: torch.Tensor, up: torch.Tensor | None = None,
             quantize_to: torch.dtype | None = None, input_scale: torch.Tensor | None = None,
             act_qmin: int = -127) -> torch.Tensor | QuantizedRows:
    """``silu(gate) * up`` for ``gate_up`` [num_tokens, 2 * I] (or separate gate, up [num_tokens, I]); with
    ``quantize_to`` quantized (``QuantizedRows``): per token, or at ``input_scale`` (a calibrated scale, the codes
    of ``quantize_rows_static``; ``act_qmin`` its lowest int8 code), elementwise."""
    if not (gate_up.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"):
        raise RuntimeError("silu_mul runs on CUDA tensors (or under TRITON_INTERPRET=1); use kernels.torch_ops on the CPU")
    if up is None:
        if gate_up.dim() != 2 or gate_up.shape[1] % 2:
            raise ValueError(f"gate_up {tuple(gate_up.shape)} is not [num_tokens, 2 * intermediate]")
        gate, up = gate_up.chunk(2, dim=-1)
    else:
        gate = gate_up
        if gate.shape != up.shape or gate.dim() != 2:
            raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must be the same [num_tokens, I]")
    if gate.dtype != up.dtype:
        raise ValueError(f"gate and up dtypes differ ({gate.dtype}, {up.dtype})")
    gate = gate if gate.stride(-1) == 1 else gate.contiguous()
    up = up if up.stride(-1) == 1 else up.contiguous()
    num_tokens, num_cols = gate.shape
    if quantize_to is not None:
        if quantize_to not in W_DTYPES:
            raise ValueError(f"quantize_to takes {W_DTYPES}, got {quantize_to}")
        codes = torch.empty((num_tokens, num_cols), dtype=quantize_to, device=gate.device)
        if input_scale is not None:
            scale, qmin = static_scale_arg("silu_mul", input_scale, codes, act_qmin)
            if codes.numel():
                block = min(_BLOCK, triton.next_power_of_2(num_cols))
                _silu_mul_kernel[(num_tokens, triton.cdiv(num_cols, block))](
                    gate, up, codes, gate.stride(0), up.stride(0), codes.stride(0), num_cols, BLOCK=block,
                    num_warps=4, s_ptr=scale, STATIC=True, INT8=quantize_to == torch.int8, QMIN=qmin,
                    EMULATE_FP8=_interpreting(), **pdl_args(codes))
            return QuantizedRows(codes, scale.expand(num_tokens, 1))
        scales = torch.empty((num_tokens, 1), dtype=torch.float32, device=gate.device)
        chunk = _quant_chunk()
        if num_tokens and chunk and num_cols > chunk:  # the two-pass kernel (see _quant_chunk)
            _silu_mul_quant_2pass_kernel[(num_tokens,)](
                gate, up, codes, scales, gate.stride(0), up.stride(0), codes.stride(0), num_cols,
                INT8=quantize_to == torch.int8, EMULATE_FP8=_interpreting(), BLOCK=chunk,
                num_warps=min(max(chunk // 512, 4), 8), **pdl_args(codes))
        elif num_tokens:
            block = triton.next_power_of_2(num_cols)
            _silu_mul_quant_kernel[(num_tokens,)](
                gate, up, codes, scales, gate.stride(0), up.stride(0), codes.stride(0), num_cols,
                INT8=quantize_to == torch.int8, EMULATE_FP8=_interpreting(), BLOCK=block,
                num_warps=min(max(block // 1024, 4), 16), **pdl_args(codes))
        return QuantizedRows(codes, scales)
    out = torch.empty((num_tokens, num_cols), dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(num_cols))
    _silu_mul_kernel[(num_tokens, triton.cdiv(num_cols, block))](
        gate, up, out, gate.stride(0), up.stride(0), out.stride(0), num_cols, BLOCK=block, num_warps=4,
        **pdl_args(out))
    return out


def silu_mul_tiles(gate_up: torch.Tensor, tile: int) -> torch.Tensor:
    """``silu(gate) * up`` [num_tokens, I] of a merged [gate | up] row interleaved per ``tile`` columns (``tile``
    gate columns, then the same ``tile`` up columns, ...: ``kernels.w4a16_frag.gate_up_order``'s output), read in
    place: no de-interleaved copy."""
    if not (gate_up.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"):
        raise RuntimeError("silu_mul_tiles runs on CUDA tensors (or under TRITON_INTERPRET=1)")
    if gate_up.dim() != 2 or tile < 1 or gate_up.shape[1] % (2 * tile):
        raise ValueError(f"gate_up {tuple(gate_up.shape)} is not [num_tokens, 2 * intermediate] in whole pairs of "
                         f"{tile}-column tiles")
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    num_tokens, num_cols = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_tokens, num_cols), dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(num_cols))
    _silu_mul_kernel[(num_tokens, triton.cdiv(num_cols, block))](
        gate_up, gate_up, out, gate_up.stride(0), gate_up.stride(0), out.stride(0), num_cols, BLOCK=block,
        TILE=tile, num_warps=4, **pdl_args(out))
    return out


def ref_silu_mul(gate_up: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    return ops.silu_mul(gate_up, up)
