"""int8_wo: INT8 weight-only quantization (W8A16), per output channel, symmetric, round to nearest.

Codes are stored unsigned with the fixed zero point 128 (the w8a16 layout shared with GPTQ's 8-bit output):
w = (q - 128) * scale, q - 128 in [-128, 127]. Each output channel takes whichever of two scales reconstructs its
weights with the smaller squared error (``two_scale_int8``):

- amax / 127: +-amax exactly representable, codes in [-127, 127] (the project's convention, ``passes.quant_math``);
- amax / 127.5: a 0.4% finer grid; -amax is exactly -128, +amax rounds to 128 and is clamped to 127 (llm-compressor's
  convention).

Neither convention wins on every model (docs/QUANTIZATION_COMPARISON.md, session 23: amax / 127.5 alone is 1.5x
better in KL on one fixture and 1.07x worse on the other); the per-channel choice is ahead of amax / 127 on both.
Activations stay in the model dtype; no calibration is needed: the build reads no calibration text and the
per-layer output error is measured on random inputs (``QuantMethod._probe_errors``).

``refit_scales: true`` (off by default) calibrates: each linear's input second moment ``H`` is gathered on the
calibration text (``passes.gptq.HessianAccumulator``), each row takes whichever of the two scales gives the smaller
output error ``(w - w_hat) H (w - w_hat)^T`` instead of the smaller weight error, and its scale is then re-solved
for those codes by least squares on the same objective (``passes.gptq.refit_scales``; a row keeps its scale unless
that lowers its error). The codes stay round-to-nearest; only the scales see the activations
(``calibrated_int8``).
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
SCALE_DIVISORS = (127.0, 127.5)  # amax / divisor: the candidates of each output channel


def two_scale_int8(w: torch.Tensor, H: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w`` [out, in] -> codes uint8 [out, in] (zero point 128), scales fp32 [out, 1], zeros uint8 [out, 1]: each
    row's scale is amax / 127 or amax / 127.5, whichever gives the smaller sum of squared errors (ties: 127); with
    ``H`` [in, in] (the inputs' second moment), the smaller output error ``d H d^T`` (d: the row's error)."""
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight [out, in], got shape {tuple(w.shape)}")
    w = w.float()
    if H is not None:
        H = H.float().to(w.device)
    amax = w.abs().amax(dim=1, keepdim=True)
    amax = torch.where(amax == 0, torch.full_like(amax, 127.0), amax)  # an all-zero row: scale 1, codes 128
    best_q = best_scale = best_err = None
    for divisor in SCALE_DIVISORS:
        scale = amax / divisor
        q = torch.round(w / scale).clamp(-128, 127)
        d = q * scale - w
        err = (d * d if H is None else (d @ H) * d).sum(dim=1, keepdim=True)
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
    """``two_scale_int8`` choosing by output error on inputs of second moment ``H``, then each row's scale re-solved
    for its codes by least squares on that error (``refit_scales``: kept where the new one is no better)."""
    codes, scales, zeros = two_scale_int8(w, H)
    scales = refit_scales(w, codes, scales, zeros, H, -1)
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
            codes, scales, zeros = two_scale_int8(w)
        self.replace_weight(graph, node, self.scheme, {"qweight": codes, "scales": scales, "zeros": zeros}, quant)
