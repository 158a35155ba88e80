"""Integer weight quantization: the project's one convention, shared by GPTQ and AWQ (int8_wo's symmetric rule is the
same, in ``passes.int8_wo.int8_channels``, which also reads older artifacts' per-channel choice of divisors).

Weights are ``[out, in]``; they are quantized per (output row, group of ``group_size`` consecutive
input columns). ``group_size = -1`` means one group over the whole input dimension (per output
channel). An input dimension not divisible by ``group_size`` is a ``ValueError``.

Asymmetric b-bit (``symmetric=False``), over each group:

    wmin  = min(w.min(), 0)          wmax = max(w.max(), 0)       (the range always contains 0)
    scale = (wmax - wmin) / (2^b - 1)
    zero  = clamp(round(-wmin / scale), 0, 2^b - 1)               (an integer code)
    q     = clamp(round(w / scale) + zero, 0, 2^b - 1)            codes in [0, 2^b - 1]
    w_hat = (q - zero) * scale

Symmetric b-bit (``symmetric=True``), over each group (amax = max|w|):

    INT4: scale = amax / 7.5         the whole code range -8 .. 7 (GPTQ's reference and compressed-tensors' grid):
                                     -amax is exactly -8, +amax rounds to 8 and is clamped to 7
    INT8: scale = amax / 127.5       the whole code range -128 .. 127 likewise (int8_wo's rule and compressed-tensors'
                                     grid): +-amax / scale is +-127.5 up to fp32 rounding, so -amax takes -128 or
                                     -127 and +amax 127 (clamped from 128, or rounded there)
    zero  = 2^(b-1)                  fixed: 8 for INT4, 128 for INT8 (codes are stored unsigned)
    q     = clamp(round(w / scale) + zero, 0, 2^b - 1)
    w_hat = (q - zero) * scale

INT4 was amax / 7 (codes -7 .. 7) until session 26. amax / 7.5 rounds worse on its own (round to nearest: mean KL
4.70e-4 -> 5.31e-4 on pydoc-qwen3, better on the bundled model: 1.88e-2 -> 1.70e-2), but every calibrated method
gains from the finer grid: GPTQ with act-order 7.36e-5 -> 6.44e-5 and 9.66e-3 -> 8.44e-3, GPTQ without it
6.26e-5 -> 6.07e-5 and 1.01e-2 -> 8.57e-3, AWQ 1.90e-4 -> 1.63e-4 (pydoc-qwen3, then the bundled model; g64,
``builder.bench.quantizers``; docs/QUANTIZATION_COMPARISON.md).
INT8 was amax / 127 until session 54: GPTQ at 8 bits per channel on the finer grid, mean KL 2.890e-7 -> 2.460e-7 on
pydoc-qwen3 and 4.584e-5 -> 4.544e-5 on the bundled model (docs/QUANTIZATION_COMPARISON.md, session 54), as
round to nearest alone had shown for int8_wo (session 30).

Both store the w4a16 / w8a16 layout of ``passes/README.md``: codes uint8 ``[out, in]`` (INT4 packed
two per byte by :func:`pack_int4`, low nibble = even input index), ``scales`` fp32
``[out, n_groups]``, ``zeros`` uint8 ``[out, n_groups]``; the runtime computes ``(q - zero) * scale``
whatever the convention was.

A group whose scale comes out 0 (all-zero weights) gets scale = 1 instead, so nothing divides by
zero and no NaN appears; its codes all equal its zero point and dequantize to exact zeros.
Rounding is ``torch.round`` (half to even). Everything is computed in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["QuantConfig", "compute_qparams", "quantize", "dequantize", "fake_quantize_groups",
           "quantize_groups", "dequantize_groups", "pack_int4", "unpack_int4", "group_size_for",
           "num_groups"]


@dataclass
class QuantConfig:
    """How a weight is quantized."""

    bits: int = 4  # 4 or 8
    group_size: int = 128  # -1 = per output channel (one group over the whole input dim)
    symmetric: bool = False

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits: {self.bits} is not supported (4 or 8)")
        if self.group_size != -1 and self.group_size < 1:
            raise ValueError(f"group_size: {self.group_size} must be -1 (per channel) or >= 1")

    @property
    def maxq(self) -> int:
        return 2 ** self.bits - 1


def group_size_for(in_features: int, group_size: int) -> int:
    """The effective group size for an input dimension (``-1`` -> ``in_features``); checks divisibility."""
    if group_size == -1:
        return in_features
    if group_size < 1:
        raise ValueError(f"group_size {group_size} must be -1 (per channel) or >= 1")
    if in_features % group_size:
        raise ValueError(f"input dimension {in_features} is not divisible by group_size {group_size}")
    return group_size


def num_groups(in_features: int, group_size: int) -> int:
    return in_features // group_size_for(in_features, group_size)


def compute_qparams(w: Tensor, cfg: QuantConfig) -> tuple[Tensor, Tensor]:
    """Scale and zero point of each row of ``w`` (all trailing dims of a row form one group).

    ``w``: ``[rows, ...]``. Returns ``(scale, zero)``, both fp32 ``[rows, 1]``; ``zero`` holds integer
    codes (as floats).
    """
    w = w.float().reshape(w.shape[0], -1)
    maxq = 2 ** cfg.bits - 1
    if cfg.symmetric:
        amax = w.abs().amax(dim=1, keepdim=True)
        scale = amax / (2 ** (cfg.bits - 1) - 0.5)  # 7.5 or 127.5: the module docstring
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        zero = torch.full_like(scale, float(2 ** (cfg.bits - 1)))
    else:
        wmin = w.amin(dim=1, keepdim=True).clamp(max=0)
        wmax = w.amax(dim=1, keepdim=True).clamp(min=0)
        scale = (wmax - wmin) / maxq
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        zero = torch.round(-wmin / scale).clamp(0, maxq)
    return scale, zero


def quantize(w: Tensor, scale: Tensor, zero: Tensor, bits: int) -> Tensor:
    """Integer codes ``clamp(round(w / scale) + zero, 0, 2^bits - 1)`` as fp32 (broadcasting)."""
    return (torch.round(w.float() / scale.float()) + zero.float()).clamp(0, 2 ** bits - 1)


def dequantize(q: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
    """``(q - zero) * scale`` in fp32 (broadcasting)."""
    return (q.float() - zero.float()) * scale.float()


def _grouped(w: Tensor, group_size: int) -> tuple[Tensor, int]:
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight [out, in], got shape {tuple(w.shape)}")
    g = group_size_for(w.shape[1], group_size)
    return w.float().reshape(w.shape[0], w.shape[1] // g, g), g


def _group_params(wg: Tensor, cfg: QuantConfig) -> tuple[Tensor, Tensor]:
    """wg: [out, n_groups, g] -> scale, zero [out, n_groups, 1]."""
    out_f, ng, g = wg.shape
    scale, zero = compute_qparams(wg.reshape(out_f * ng, g), cfg)
    return scale.reshape(out_f, ng, 1), zero.reshape(out_f, ng, 1)


def fake_quantize_groups(w: Tensor, cfg: QuantConfig) -> Tensor:
    """Quantize-dequantize ``w`` ``[out, in]`` per (row, group); fp32 ``[out, in]``."""
    wg, _ = _grouped(w, cfg.group_size)
    scale, zero = _group_params(wg, cfg)
    return dequantize(quantize(wg, scale, zero, cfg.bits), scale, zero).reshape(w.shape)


def quantize_groups(w: Tensor, cfg: QuantConfig) -> tuple[Tensor, Tensor, Tensor]:
    """Round-to-nearest: ``w`` ``[out, in]`` -> codes uint8 ``[out, in]``, scales fp32 and zeros uint8
    ``[out, n_groups]``."""
    wg, _ = _grouped(w, cfg.group_size)
    scale, zero = _group_params(wg, cfg)
    codes = quantize(wg, scale, zero, cfg.bits).to(torch.uint8).reshape(w.shape)
    return codes, scale.squeeze(-1).contiguous(), zero.squeeze(-1).to(torch.uint8)


def dequantize_groups(codes: Tensor, scales: Tensor, zeros: Tensor, group_size: int) -> Tensor:
    """Codes ``[out, in]`` with scales/zeros ``[out, n_groups]`` -> fp32 ``[out, in]``."""
    out_f, in_f = codes.shape
    g = group_size_for(in_f, group_size)
    ng = in_f // g
    if tuple(scales.shape) != (out_f, ng) or tuple(zeros.shape) != (out_f, ng):
        raise ValueError(f"scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} do not match "
                         f"codes {tuple(codes.shape)} with group_size {group_size} (expected {(out_f, ng)})")
    w = dequantize(codes.reshape(out_f, ng, g), scales.reshape(out_f, ng, 1), zeros.reshape(out_f, ng, 1))
    return w.reshape(out_f, in_f)


def pack_int4(codes: Tensor) -> Tensor:
    """uint8 codes ``[out, in]`` (values < 16, ``in`` even) -> uint8 ``[out, in // 2]``; the low nibble
    holds the even input index, the high nibble the odd one."""
    if codes.dim() != 2 or codes.shape[1] % 2:
        raise ValueError(f"pack_int4 needs [out, in] with an even in, got shape {tuple(codes.shape)}")
    if codes.is_floating_point() or codes.is_complex():
        raise ValueError(f"pack_int4 needs integer codes, got {codes.dtype}")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
        raise ValueError(f"pack_int4: codes must lie in [0, 15], got [{int(codes.min())}, {int(codes.max())}]")
    c = codes.to(torch.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: Tensor) -> Tensor:
    """Inverse of :func:`pack_int4`: uint8 ``[out, in // 2]`` -> uint8 ``[out, in]``."""
    if packed.dim() != 2 or packed.dtype != torch.uint8:
        raise ValueError(f"unpack_int4 needs uint8 [out, in // 2], got {packed.dtype} {tuple(packed.shape)}")
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


class HessianAccumulator:
    """Running average of ``2 x^T x`` over every calibration token seen, in fp32."""

    def __init__(self, in_features: int):
        if in_features < 1:
            raise ValueError(f"in_features must be >= 1, got {in_features}")
        self.in_features = in_features
        self.H = torch.zeros(in_features, in_features, dtype=torch.float32)
        self._n = 0

    @property
    def num_tokens(self) -> int:
        return self._n

    def add(self, x: Tensor) -> None:
        """x: ``[num_tokens, in_features]`` (leading dims are flattened), any float dtype."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected inputs with {self.in_features} features, got shape {tuple(x.shape)}")
        x = x.detach().reshape(-1, self.in_features)
        m = x.shape[0]
        if m == 0:
            return
        if self.H.device != x.device:
            self.H = self.H.to(x.device)
        # H_new = (n H_old + 2 x^T x) / (n + m), written as the reference does.
        self.H *= self._n / (self._n + m)
        self._n += m
        x = x.float() * math.sqrt(2.0 / self._n)
        self.H += x.t() @ x
