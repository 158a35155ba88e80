"""int8_wo: INT8 weight-only quantization (W8A16), per output channel, symmetric, round to nearest.

Codes are stored unsigned with the fixed zero point 128 (the w8a16 layout shared with GPTQ's 8-bit output):
w = (q - 128) * scale, q - 128 in [-128, 127]. Each channel's scale is amax / 127.5 (``SCALE_DIVISORS``): the whole
code range, -amax exactly -128, +amax rounding to 128 and clamped to 127; a 0.4% finer grid than amax / 127 (+-amax
exact over [-127, 127]). It is also llm-compressor's rule, and since session 54 the project's symmetric 8-bit
convention for GPTQ too (``passes.quant_math``). Measured on both trained fixtures (docs/QUANTIZATION_COMPARISON.md,
session 30): level with that peer on both, 1.03x ModelOpt's amax / 127 on the bundled model (which amax / 127 loses
on pydoc-qwen3 by 1.48x); each channel taking the better of the two by weight error (the default of sessions 23-29,
still read from older artifacts' ``scale_divisors``) was 1.19x the best peer on pydoc-qwen3, and the finest grid that
clips nothing, max(-min / 128, max / 127), lost on pydoc-qwen3 too (session 54).
Activations stay in the model dtype; no calibration is needed: the build reads no calibration text and the
per-layer output error is measured on random inputs (``QuantMethod._probe_errors``).

``refit_scales: true`` (off by default) calibrates: each linear's input second moment ``H`` is gathered on the
calibration text (``passes.gptq.HessianAccumulator``), and each row's scale is re-solved for its codes by least
squares on the output error ``(w - w_hat) H (w - w_hat)^T`` (``passes.gptq.refit_scales``; a row keeps its scale
unless that lowers its error). The codes stay round-to-nearest; only the scales see the activations
(``calibrated_int8``). Ahead of llm-compressor on both fixtures (0.91x and 0.99x its KL), 1.02x ModelOpt on the
bundled model (session 30).
"""

from __future__ import annotations

from typing import Any

from passes.base import PassError, register
from passes.ir import Graph, Node
import torch

from passes.gptq import HessianAccumulator, refit_scales

from passes.quant_math import QuantConfig
from passes.quantize import QuantMethod

PER_CHANNEL_INT8 = QuantConfig(bits=8, group_size=-1, symmetric=True)
SCALE_DIVISORS = (127.5,)  # amax / divisor; more than one: each output channel takes the best (older artifacts)


def int8_channels(w: torch.Tensor, divisors: tuple[float, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                        torch.Tensor]:
    """``w`` [out, in] -> codes uint8 [out, in] (zero point 128), scales fp32 [out, 1], zeros uint8 [out, 1]: each
    row's scale is amax / d, of the ``divisors`` (default ``SCALE_DIVISORS``) the one whose rounding (codes clamped to
    [-128, 127]) has the smaller sum of squared errors (ties: the first); an all-zero row gets scale 1, codes 128."""
    divisors = SCALE_DIVISORS if divisors is None else divisors
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight [out, in], got shape {tuple(w.shape)}")
    if not divisors or any(not 64 <= float(d) <= 128 for d in divisors):
        raise ValueError(f"int8 scale divisors must lie in [64, 128] (amax / divisor), got {divisors}")
    w = w.float()
    amax = w.abs().amax(dim=1, keepdim=True)
    amax = torch.where(amax == 0, torch.full_like(amax, 127.5), amax)  # an all-zero row: scale 1, codes 128
    best_q = best_scale = best_err = None
    for divisor in divisors:
        scale = amax / float(divisor)
        q = torch.round(w / scale).clamp(-128, 127)
        d = q * scale - w
        err = (d * d).sum(dim=1, keepdim=True)
        if best_err is None:
            best_q, best_scale, best_err = q, scale, err
        else:
            better = err < best_err
            best_q = torch.where(better, q, best_q)
            best_scale = torch.where(better, scale, best_scale)
            best_err = torch.where(better, err, best_err)
    codes = (best_q + 128).to(torch.uint8)
    return codes, best_scale.contiguous(), torch.full_like(best_scale, 128).to(torch.uint8)


def calibrated_int8(w: torch.Tensor, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``int8_channels``' codes, each row's scale re-solved for them by least squares on the output error on inputs
    of second moment ``H`` (``refit_scales``: kept where the new one is no better)."""
    codes, scales, zeros = int8_channels(w)
    scales = refit_scales(w.float(), codes, scales, zeros, H.float().to(w.device), -1)
    return codes, scales.contiguous(), zeros


@register
class Int8WeightOnly(QuantMethod):
    """Quantize linear weights to INT8 per output channel; activations stay in the model dtype."""

    name = "int8_wo"
    scheme = "w8a16"
    needs_calibration = False

    def configure(self, options: dict[str, Any]) -> None:
        self.refit = bool(options.get("refit_scales", False))
        self.needs_calibration = self.refit  # the scales fitted to the calibration inputs' second moments

    def observe(self, index: int, node: Node, x: torch.Tensor) -> None:
        if index not in self.stats:
            self.stats[index] = HessianAccumulator(x.shape[-1])
        self.stats[index].add(x)

    def quantize_node(self, graph: Graph, node: Node, stats: Any) -> None:
        w = graph.params[node.weights["weight"]]
        quant = {"bits": 8, "group_size": -1, "scale_divisors": list(SCALE_DIVISORS)}
        if self.refit:
            if stats is None or stats.num_tokens == 0:
                raise PassError(f"int8_wo: refit_scales needs calibration inputs and none reached {node.source}")
            codes, scales, zeros = calibrated_int8(w, stats.H)
            quant["refit_scales"] = True
        else:
            codes, scales, zeros = int8_channels(w)
        self.replace_weight(graph, node, self.scheme, {"qweight": codes, "scales": scales, "zeros": zeros}, quant)
