"""Quantized linear layers in plain torch: what the runtime runs on the CPU, and the reference the GEMM and
GEMV kernels of this package are tested against.

Storage conventions (written by the quantization passes, see passes/README.md):
- w4a16 / w8a16: ``qweight`` unsigned codes (4-bit packed two per byte, low nibble = even input
  index), ``scales`` [out, num_groups], ``zeros`` [out, num_groups] integer codes;
  w = (q - zero) * scale.
- w8a8_int8: ``qweight`` int8 [out, in], ``weight_scale`` fp32 [out]; activations quantized to
  int8 per token (dynamic) or with the calibrated per-tensor ``input_scale`` (static); scale = amax / 127;
  codes round-half-even(x / scale) clamped to ``act_qmin``..127, ``act_qmin`` the node's ``quant`` attr (-127 where
  absent: the SmoothQuant pass's symmetric range; -128, the full int8 range, for imported checkpoints whose format
  quantizes static activations so: ModelOpt's W8A8_SQ_PER_CHANNEL, compressed-tensors). Only a static scale can
  take a code below -127: a per-token scale amax / 127 puts every x / scale within +-127 (and a hair).
- fp8: ``qweight`` float8_e4m3fn [out, in], ``weight_scale`` fp32 [out] or [1]; activations e4m3 per
  token (dynamic) or with ``input_scale`` (static); scale = amax / 448.
- fp8_block: ``qweight`` float8_e4m3fn [out, in], ``weight_scale`` fp32 [ceil(out / bn), ceil(in / bk)] for the
  ``block_size`` [bn, bk] of the node's ``quant``: w[n, k] = q[n, k] * scale[n // bn, k // bk] (a partial last
  block along either dimension has its own scale); activations e4m3 per token and bk-wide group along in (the
  last group may be narrower), scale = the group's amax / 448 (dynamic). Fine-grained FP8 checkpoints
  (DeepSeek-V3, Qwen3-FP8) store this.
- any scheme may carry ``perm`` int32 [in] (an act-order checkpoint's input channels sorted by group, so
  groups are contiguous): the linear computes ``x[:, perm] @ W.T``, W's columns being in that order.
- any scheme may carry ``pre_quant_scale`` fp32 [in] (a per-input-channel scale s a checkpoint's exporter left on the
  linear: ModelOpt's AWQ on o_proj / down_proj): the linear computes ``(x * s) @ W.T``, x * s taken in fp32 and
  rounded to x's dtype (as the exporter's own bf16 ``x * s`` rounds), before a ``perm`` gather and any activation
  quantization.
"""

from __future__ import annotations

from typing import Callable

import os

import torch
import torch.nn.functional as F

FP8_MAX = 448.0
# How cuBLAS's FP8 GEMMs (_scaled_mm) accumulate on Hopper: "promoted" (partial sums moved into fp32 periodically, the
# default) or "fast" (use_fast_accum: the MMA's own accumulator throughout; 5-19% faster at 128-8192 rows, ~1% of the
# output's largest magnitude apart at Llama-3-8B shapes: docs/BENCHMARKS.md, session 18). An artifact says which in
# its manifest (runtime.fp8_accumulation, the recipe's); RUNTIME_FP8_FAST_ACCUM=1|0 overrides it for A/B runs.
FP8_ACCUMULATIONS = ("promoted", "fast")


def fp8_fast_accum(setting: str | None = None, env: bool = True) -> bool:
    """Whether FP8 GEMMs accumulate fast: RUNTIME_FP8_FAST_ACCUM (1 or 0) when set and ``env``, else ``setting`` (an
    artifact's runtime.fp8_accumulation; None: promoted)."""
    value = os.environ.get("RUNTIME_FP8_FAST_ACCUM", "") if env else ""
    if value not in ("", "0", "1"):
        raise ValueError(f"RUNTIME_FP8_FAST_ACCUM={value!r} is not 1 (fast) or 0 (promoted)")
    if value:
        return value == "1"
    if setting not in (None, *FP8_ACCUMULATIONS):
        raise ValueError(f"fp8_accumulation {setting!r} is not one of {', '.join(FP8_ACCUMULATIONS)}")
    return setting == "fast"


INT8_MAX = 127.0
# the lower bounds of the int8 activation codes a w8a8_int8 linear's ``quant`` may name (``act_qmin``); the first is
# the default (the attr absent). Every path honours both: this file, kernels/w8a8_gemm.py and kernels/gemv.py
INT8_ACT_QMINS = (-127, -128)


def int8_act_qmin(quant: dict | None) -> int:
    """The lower bound of a w8a8_int8 linear's activation codes (its ``quant`` attr's ``act_qmin``, default -127);
    ValueError naming the value for one this runtime does not run (another value, or the attr on another scheme)."""
    quant = quant or {}
    if "act_qmin" not in quant:
        return INT8_ACT_QMINS[0]
    value = quant["act_qmin"]
    if quant.get("scheme", "w8a8_int8") != "w8a8_int8" or isinstance(value, bool) \
            or not isinstance(value, int) or value not in INT8_ACT_QMINS:
        raise ValueError(f"quant act_qmin {value!r} on scheme {quant.get('scheme')!r}: this runtime runs act_qmin "
                         f"{' or '.join(map(str, INT8_ACT_QMINS))} on w8a8_int8 linears only (the lower bound of "
                         f"their int8 activation codes)")
    return int(value)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    # packed: [out, in / 2] uint8 -> codes [out, in] uint8
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], -1)


def dequantize_weight(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                      group_size: int, dtype: torch.dtype) -> torch.Tensor:
    codes = unpack_int4(qweight) if bits == 4 else qweight
    out_f, in_f = codes.shape
    g = in_f if group_size == -1 else group_size
    w = codes.view(out_f, in_f // g, g).float() - zeros.float()[:, :, None]
    return (w * scales.float()[:, :, None]).reshape(out_f, in_f).to(dtype)


def quantize_weight_fp8(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [out, in] -> (e4m3 codes [out, in], fp32 scale [out] or [1]); scale = amax / 448."""
    w = w.float()
    amax = w.abs().amax(dim=1) if per_channel else w.abs().amax().reshape(1)
    scale = amax.clamp(min=1e-12) / FP8_MAX
    q = (w / scale[:, None] if per_channel else w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantize_experts_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked expert weights [E, out, in] -> (e4m3 codes [E, out, in], fp32 scales [E, out]): each expert's rows
    as :func:`quantize_weight_fp8` per channel, one expert at a time (one expert's fp32 copy at most)."""
    codes = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scales = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
    for e in range(w.shape[0]):
        codes[e], scales[e] = quantize_weight_fp8(w[e], per_channel=True)
    return codes, scales


def dequantize_experts_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                            dtype: torch.dtype) -> torch.Tensor:
    """W4A16 experts (the ``moe`` op's quant scheme w4a16) back to weights: codes uint8 [E, out, in / 2] (two per
    byte, low nibble = even input index, as a w4a16 linear's ``qweight``), ``scales`` fp32 and ``zeros`` uint8 [E, out,
    in / group_size] (group_size -1: one group per row) -> [E, out, in] in ``dtype``: (q - zero) * scale in fp32,
    rounded to ``dtype`` once, each expert exactly as :func:`dequantize_weight` dequantizes a linear."""
    return torch.stack([dequantize_weight(codes[e], scales[e], zeros[e], 4, group_size, dtype)
                        for e in range(codes.shape[0])])


def quantize_weight_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [out, in] -> (int8 codes [out, in], fp32 scale [out]); per output channel, scale = amax / 127."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / INT8_MAX
    return (w / scale[:, None]).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def quantize_activation_int8(x: torch.Tensor, input_scale: torch.Tensor | None,
                             qmin: int = -127) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [num_tokens, in] -> (int8 codes, scale [num_tokens, 1] or [1, 1]): round-half-even(x / scale) in fp32 (an
    IEEE division) clamped to ``qmin``..127 (``qmin`` -127 or -128: :func:`int8_act_qmin`)."""
    if input_scale is None:  # a tensor divisor: the IEEE quotient on CUDA too (see quantize_activation_fp8_blocks)
        amax = x.abs().amax(-1, keepdim=True).float().clamp(min=1e-8)
        scale = amax / amax.new_full((), INT8_MAX)
    else:
        scale = input_scale.float().reshape(1, 1)
    q = (x.float() / scale).round().clamp(qmin, INT8_MAX).to(torch.int8)
    return q, scale


def quantize_activation_fp8(x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if input_scale is None:  # a tensor divisor: the IEEE quotient on CUDA too (see quantize_activation_fp8_blocks)
        amax = x.abs().amax(-1, keepdim=True).float().clamp(min=1e-12)
        scale = amax / amax.new_full((), FP8_MAX)
    else:
        scale = input_scale.float().reshape(1, 1)
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def round_activation_fp8(x: torch.Tensor) -> torch.Tensor:
    """x rounded per token to e4m3 at its dynamic scale and back, in x's dtype: the activations of a W4A8 linear
    (4-bit weights with ``activation_quant: fp8``), ``(codes * scale).to(x.dtype)``."""
    q, scale = quantize_activation_fp8(x, None)
    return (q.float() * scale).to(x.dtype)


def expand_blocks(scales: torch.Tensor, block: int, size: int, dim: int) -> torch.Tensor:
    """Each scale repeated ``block`` times along ``dim``, cut to ``size`` (a partial last block); a block past
    ``size`` is one scale, repeated ``size`` times."""
    return scales.repeat_interleave(min(block, size), dim=dim).narrow(dim, 0, size)


def dequantize_weight_fp8_blocks(qweight: torch.Tensor, weight_scale: torch.Tensor,
                                 block_size: tuple[int, int] | list[int]) -> torch.Tensor:
    """fp8_block codes [N, K] and block scales [ceil(N / bn), ceil(K / bk)] -> w [N, K] fp32, each code times its
    block's scale (one fp32 product per element: exactly ``q.float() * scale[n // bn, k // bk]``)."""
    (n, k), (bn, bk) = qweight.shape, block_size
    w = qweight.float()
    rows = expand_blocks(weight_scale.float(), bn, n, 0)  # [N, ceil(K / bk)]: each row's scales along K
    full = k // bk
    w[:, :full * bk].unflatten(1, (full, bk)).mul_(rows[:, :full, None])  # whole blocks: a view, no [N, K] scales
    if k % bk:
        w[:, full * bk:].mul_(rows[:, full:])
    return w


def quantize_activation_fp8_blocks(x: torch.Tensor, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [num_tokens, K] -> (e4m3 codes [num_tokens, K], fp32 scales [num_tokens, ceil(K / block_k)]): each token's
    groups of ``block_k`` along K (the last may be narrower) scaled by their own amax / 448, floored as the per-token
    path's (an all-zero group gets codes 0 where transformers' kernel divides 0 by 0)."""
    num_tokens, k = x.shape
    num_groups = -(-k // block_k)
    groups = F.pad(x.float(), (0, num_groups * block_k - k)).view(num_tokens, num_groups, block_k)  # zeros: no max
    amax = groups.abs().amax(-1).clamp(min=1e-12)  # [num_tokens, num_groups]
    # The IEEE quotient on every device, as the kernels (kernels.fp8_block_gemm) divide: on CUDA, torch divides by a
    # Python scalar through its fp32 reciprocal, one ulp off in some scales; then a code a bf16 x puts exactly on a
    # rounding tie goes to its neighbour (one step of a group's top binade is 1/16 of its max)
    scale = amax / amax.new_full((), FP8_MAX)
    q = (groups / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(num_tokens, num_groups * block_k)[:, :k], scale


def _int8_matmul(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    # xq: [m, k] int8, wq: [n, k] int8 -> [m, n] int32 (exact)
    if xq.is_cuda and xq.shape[0] > 16:
        return torch._int_mm(xq, wq.t())
    # Elsewhere: float BLAS is exact here and far faster than int32. Every partial sum is an integer of at most
    # 128 * 128 * k: exact in float32 up to k = 1024 (<= 2**24; twice float64's speed), in float64 beyond (< 2**53).
    dtype = torch.float32 if xq.shape[-1] * 128 * 128 <= 2 ** 24 else torch.float64
    return (xq.to(dtype) @ wq.t().to(dtype)).to(torch.int32)


Quantize = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # x [M, K] -> (codes, scales [M, 1])


def make_fp8_scaled_mm_linear(w: dict[str, torch.Tensor], quantize: Quantize | None = None,
                              dtype: torch.dtype = torch.bfloat16,
                              quantize_static: Callable[[torch.Tensor, torch.Tensor],
                                                        tuple[torch.Tensor, torch.Tensor]] | None = None,
                              fast_accum: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """FP8 W8A8 on Hopper tensor cores: ``torch._scaled_mm`` with row-wise scales (per-token activation
    scales x per-channel weight scales, a per-tensor scale broadcast to every row/column), bf16/fp16 out.
    Same arithmetic as the reference ``fp8`` path of ``make_quant_linear``, with fp32 accumulation (``fast_accum``:
    on CUDA the MMA's own accumulator, without the periodic promotion to fp32; see :func:`fp8_fast_accum`).
    ``quantize``: the dynamic per-token quantization to use (a fused kernel); default the torch ops.
    ``quantize_static(x2, input_scale)``: the same for a calibrated input scale (default the torch ops). x may also
    be rows already quantized (``kernels.w8a8_gemm.QuantizedRows``: codes [tokens, in], scales [tokens, 1]),
    whose output is ``dtype`` (the model's activation dtype); on the tensor-wise path below, rows that come with one
    scale expanded over them (stride 0: a norm wrote them at this linear's input scale, ``runtime.executor``'s
    ``_Fusions.static_inputs``) take the scalar scales, and rows with scales of their own the row-wise call.

    A calibrated input scale beside a per-tensor weight scale (ModelOpt's FP8, the fp8 recipe's static activations
    on tensor granularity) runs cuBLAS's tensor-wise kernel, one scale per operand: the same products and scales,
    and on an H200 (``python -m kernels.bench.w8a8 --scaling``, docs/BENCHMARKS.md, session 43) a Llama-3-8B layer's
    four linears took 79.4 us against the row-wise kernel's 124.4 at 128 rows, 181.1 against 189.0 at 512, 722.9
    against 726.9 at 2,048 and 2,915 against 3,016 at 8,192."""
    wq_t = w["qweight"].t()  # [in, out] column-major view of the row-major [out, in] weight, as cuBLASLt wants
    out_features = wq_t.shape[1]
    w_scale = w["weight_scale"].float().reshape(1, -1).expand(1, out_features).contiguous()  # [1, out]
    input_scale, bias = w.get("input_scale"), w.get("bias")
    tensorwise = input_scale is not None and input_scale.numel() == 1 and w["weight_scale"].numel() == 1
    if tensorwise:
        scale_a, scale_b = input_scale.float().reshape(()), w["weight_scale"].float().reshape(())

    def fp8_linear(x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, tuple):  # kernels.w8a8_gemm.QuantizedRows: rows a norm quantized, [num_tokens, in]
            xq, x_scale = x
            shape, out_dtype = xq.shape, dtype
        else:
            x2 = x.reshape(-1, x.shape[-1])  # [num_tokens, in]
            if input_scale is None:
                xq, x_scale = quantize(x2) if quantize is not None else quantize_activation_fp8(x2, None)
            else:
                xq, x_scale = (quantize_static or quantize_activation_fp8)(x2, input_scale)
            shape, out_dtype = x.shape, x.dtype
        if tensorwise and (not isinstance(x, tuple) or x_scale.stride(0) == 0):  # shapes only, as in a CUDA graph
            sa, sb = scale_a, scale_b
        else:
            sa, sb = x_scale.expand(xq.shape[0], 1).contiguous(), w_scale  # [num_tokens, 1], [1, out]
        y = torch._scaled_mm(xq, wq_t, scale_a=sa, scale_b=sb, out_dtype=out_dtype,
                             use_fast_accum=fast_accum and xq.is_cuda)
        if bias is not None:
            y = y + bias
        return y.reshape(*shape[:-1], out_features)

    return fp8_linear


def permute_input(fn: Callable[[torch.Tensor], torch.Tensor],
                  perm: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``fn`` reading ``x[..., perm]`` (a ``perm`` role: W's input columns sorted by group); ``fn`` itself when
    there is none. A gather on the device: no host sync, the same inside a CUDA graph."""
    if perm is None:
        return fn
    index = perm.long()
    return lambda x: fn(x.index_select(-1, index))


def scale_input(fn: Callable[[torch.Tensor], torch.Tensor], scale: torch.Tensor | None,
                dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """``fn`` reading ``x * scale`` (a ``pre_quant_scale`` role: one fp32 scale per input channel), the product in
    fp32 rounded to x's dtype; ``fn`` itself when there is none. ``dtype``: the activations' dtype, in which the
    scale is held once at load when it is exact there (every bf16 / fp16 exporter's is): torch multiplies two bf16
    tensors in fp32 and rounds once, so that is one elementwise kernel with the same result, the same inside a CUDA
    graph. Its cost on the kernel path: one extra read and write of x per linear (the fusions that hand a linear
    anything but plain rows skip these linears, ``runtime/executor.py`` plan_fusions)."""
    if scale is None:
        return fn
    s32 = scale.float().reshape(-1)
    held = s32.to(dtype)
    same = bool(torch.equal(held.float(), s32))

    def scaled(x: torch.Tensor) -> torch.Tensor:
        if x.dtype == dtype and same:
            return fn(x * held)
        return fn((x.float() * s32).to(x.dtype))

    return scaled


def make_quant_linear(scheme: str, w: dict[str, torch.Tensor], quant: dict, dtype: torch.dtype,
                      quantize: Quantize | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function x -> x @ W.T + bias for a quantized linear (W as stored by the passes, or imported with a
    ``perm`` and / or a ``pre_quant_scale``). ``quantize``: the dynamic per-token activation quantization of the W8A8
    schemes (a fused kernel); default the torch ops. The INT8 one also takes rows already quantized
    (``kernels.w8a8_gemm.QuantizedRows``, per token or at its input scale), whose output is ``dtype``."""
    if "pre_quant_scale" in w:
        rest = {role: t for role, t in w.items() if role != "pre_quant_scale"}
        return scale_input(make_quant_linear(scheme, rest, quant, dtype, quantize), w["pre_quant_scale"], dtype)
    if "perm" in w:
        rest = {role: t for role, t in w.items() if role != "perm"}
        return permute_input(make_quant_linear(scheme, rest, quant, dtype, quantize), w["perm"])
    bias = w.get("bias")
    if scheme in ("w4a16", "w8a16"):
        weight = dequantize_weight(w["qweight"], w["scales"], w["zeros"], quant["bits"], quant["group_size"], dtype)
        if quant.get("activation_quant") == "fp8":  # W4A8: x rounded per token to e4m3 first
            return lambda x: F.linear(round_activation_fp8(x), weight, bias)
        return lambda x: F.linear(x, weight, bias)
    input_scale = w.get("input_scale")
    w_scale = w["weight_scale"].float().reshape(1, -1)
    if scheme == "w8a8_int8":
        wq, qmin = w["qweight"], int8_act_qmin({**quant, "scheme": scheme})

        def int8_linear(x: torch.Tensor) -> torch.Tensor:
            out_dtype = dtype
            if isinstance(x, tuple):  # kernels.w8a8_gemm.QuantizedRows: rows a norm quantized, [num_tokens, in]
                xq, x_scale = x
            elif quantize is not None and input_scale is None and x.dim() == 2:
                xq, x_scale = quantize(x)  # per token: no code below -127 (INT8_ACT_QMINS), whatever qmin says
                out_dtype = x.dtype
            else:
                xq, x_scale = quantize_activation_int8(x, input_scale, qmin)
                out_dtype = x.dtype
            y = _int8_matmul(xq, wq).float() * x_scale * w_scale
            return (y + bias.float() if bias is not None else y).to(out_dtype)

        return int8_linear
    if scheme == "fp8":
        w_deq = w["qweight"].float()

        def fp8_linear(x: torch.Tensor) -> torch.Tensor:
            if quantize is not None and input_scale is None and x.dim() == 2:
                xq, x_scale = quantize(x)
            else:
                xq, x_scale = quantize_activation_fp8(x, input_scale)
            y = (xq.float() @ w_deq.t()) * x_scale * w_scale
            return (y + bias.float() if bias is not None else y).to(x.dtype)

        return fp8_linear
    if scheme == "fp8_block":
        _, block_k = quant["block_size"]
        w_deq = dequantize_weight_fp8_blocks(w["qweight"], w["weight_scale"], quant["block_size"])

        def fp8_block_linear(x: torch.Tensor) -> torch.Tensor:
            x2 = x.reshape(-1, x.shape[-1])  # [num_tokens, in]
            xq, x_scale = quantize_activation_fp8_blocks(x2, block_k)
            y = (xq.float() * expand_blocks(x_scale, block_k, x2.shape[1], 1)) @ w_deq.t()
            y = y + bias.float() if bias is not None else y
            return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])

        return fp8_block_linear
    raise ValueError(f"unknown quant scheme {scheme!r}")
