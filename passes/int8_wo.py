"""int8_wo: INT8 weight-only quantization (W8A16), per output channel, symmetric, round to nearest.

scale = amax / 127 per output channel (not 127.5); codes are stored unsigned with the fixed zero
point 128 (the w8a16 layout shared with GPTQ's 8-bit output): w = (q - 128) * scale. Activations
stay in the model dtype; no calibration is needed (given calibration data, the per-layer output
error is still measured on it).
"""

from __future__ import annotations

from typing import Any

import torch

from passes.base import register
from passes.ir import Graph, Node
from passes.quantize import QuantMethod


def quantize_w8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w: [out, in] -> (codes uint8 [out, in], scales fp32 [out, 1], zeros uint8 [out, 1])."""
    w = w.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-8)
    codes = ((w / scale).round().clamp(-127, 127) + 128).to(torch.uint8)
    return codes, scale, torch.full_like(scale, 128, dtype=torch.uint8)


@register
class Int8WeightOnly(QuantMethod):
    """Quantize linear weights to INT8 per output channel; activations stay in the model dtype."""

    name = "int8_wo"
    scheme = "w8a16"
    needs_calibration = False

    def quantize_node(self, graph: Graph, node: Node, stats: Any) -> None:
        codes, scales, zeros = quantize_w8_per_channel(graph.params[node.weights["weight"]])
        self.replace_weight(graph, node, self.scheme, {"qweight": codes, "scales": scales, "zeros": zeros},
                            {"bits": 8, "group_size": -1})
