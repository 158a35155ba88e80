"""fp8: FP8 E4M3 weights and activations (W8A8), e.g. for Hopper tensor cores.

Weights: scale = amax / 448 per tensor (default) or per output channel; codes are
``float8_e4m3fn`` (max 448). Activations: dynamic per-token scales at run time (default), or a
static per-tensor ``input_scale = amax / 448`` calibrated on the calibration set (max over all tokens).

Mixture-of-experts layers (``moe`` nodes; option ``experts``, default on, except in a section that quantizes the
lm_head alone, where it must be set; a section whose targets name moe layers only, e.g. ``re:mlp$``, quantizes their
experts alone): every expert's gate/up and down
weights become e4m3 codes with one scale per output channel (per expert), and their inputs are quantized per token
at run time (dynamic, whatever ``activations`` says: a static scale per expert would need calibration tokens to
reach every expert). The router stays in the model dtype. The section's targets / ignore patterns reach a moe
layer by its module path (``model.layers.N.mlp``).
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.torch_quant import FP8_MAX, quantize_experts_fp8, quantize_weight_fp8
from passes.base import PassError, register
from passes.ir import Graph, Node
from passes.quantize import QuantMethod


@register
class FP8(QuantMethod):
    """Quantize linears to FP8 E4M3 weights with per-tensor/per-channel scales and FP8 activations."""

    name = "fp8"
    scheme = "fp8"

    def configure(self, options: dict[str, Any]) -> None:
        self.per_channel = options.get("weight_granularity", "tensor") == "channel"
        self.static = options.get("activations", "dynamic") == "static"
        self.needs_calibration = self.static
        self.experts = options.get("experts")  # None: on, unless the section quantizes the lm_head alone

    def observe(self, index: int, node: Node, x: torch.Tensor) -> None:
        amax = x.detach().abs().amax().float()
        self.stats[index] = torch.maximum(self.stats[index], amax) if index in self.stats else amax

    def quantize_node(self, graph: Graph, node: Node, stats: Any) -> None:
        q, scale = quantize_weight_fp8(graph.params[node.weights["weight"]], self.per_channel)
        tensors = {"qweight": q, "weight_scale": scale}
        if self.static:
            if stats is None:
                raise PassError(f"fp8: no calibration statistics reached {node.source}")
            tensors["input_scale"] = (stats.clamp(min=1e-12) / FP8_MAX).reshape(1)
        self.replace_weight(graph, node, self.scheme, tensors, {
            "activations": "static" if self.static else "dynamic",
            "weight_granularity": "channel" if self.per_channel else "tensor"})

    quantizes_experts = True
    experts_left = ("quantization.experts is false, the section quantizes the lm_head alone, or its targets / ignore "
                    "leave those layers out")

    def quantize_experts(self, graph: Graph, targets: list[int]) -> dict[str, Any]:
        chosen = self._reached(graph, any(graph.nodes[i].op == "linear" for i in targets))
        for node in chosen:
            quantize_moe_fp8(graph, node)
        if not chosen:
            return {}
        return {"moe_layers_quantized": len(chosen),
                "moe_experts": "fp8 e4m3 codes, per-channel scales per expert, activations quantized per token"}


def quantize_moe_fp8(graph: Graph, node: Node) -> None:
    """A moe node's experts as FP8 in place (codes and scales where the float experts were, named
    ``<name>.qweight`` / ``<name>.weight_scale``); the float tensors leave ``graph.params`` unless another node
    reads them."""
    for role in ("w_gate_up", "w_down"):
        old = node.weights[role]
        graph.params[f"{old}.qweight"], graph.params[f"{old}.weight_scale"] = quantize_experts_fp8(graph.params[old])
        node.weights[role], node.weights[f"{role}_scale"] = f"{old}.qweight", f"{old}.weight_scale"
        if not any(old in n.weights.values() for n in graph.nodes):
            graph.params.pop(old, None)
    node.attrs["quant"] = {"scheme": "fp8", "activations": "dynamic", "weight_granularity": "channel"}
