"""int8_wo: INT8 weight-only quantization (W8A16), per output channel, symmetric, round to nearest.

scale = amax / 127 per output channel (not 127.5); codes are stored unsigned with the fixed zero
point 128 (the w8a16 layout shared with GPTQ's 8-bit output): w = (q - 128) * scale. Activations
stay in the model dtype; no calibration is needed: the build reads no calibration text and the per-layer
output error is measured on random inputs (``QuantMethod._probe_errors``).
"""

from __future__ import annotations

from typing import Any

from passes.base import register
from passes.ir import Graph, Node
from passes.quant_math import QuantConfig, quantize_groups
from passes.quantize import QuantMethod

PER_CHANNEL_INT8 = QuantConfig(bits=8, group_size=-1, symmetric=True)


@register
class Int8WeightOnly(QuantMethod):
    """Quantize linear weights to INT8 per output channel; activations stay in the model dtype."""

    name = "int8_wo"
    scheme = "w8a16"
    needs_calibration = False

    def quantize_node(self, graph: Graph, node: Node, stats: Any) -> None:
        codes, scales, zeros = quantize_groups(graph.params[node.weights["weight"]], PER_CHANNEL_INT8)
        self.replace_weight(graph, node, self.scheme, {"qweight": codes, "scales": scales, "zeros": zeros},
                            {"bits": 8, "group_size": -1})
