"""smoothquant: W8A8 INT8 with activation outliers migrated into the weights.

SmoothQuant (Xiao et al., 2023, "SmoothQuant: Accurate and Efficient Post-Training Quantization for
Large Language Models"; reference mit-han-lab/smoothquant). For linears fed by an RMSNorm (q/k/v
and gate/up), per input channel j:

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)        (alpha = 0.5 by default)

X is divided by s (folded into the norm's weight) and W's column j multiplied by s_j, which leaves
X W^T unchanged while flattening activation outliers. max|W_j| is taken over every linear reading
the same normed input. Linears not fed by a norm (o_proj, down_proj) are quantized without smoothing.
With ``lm_head: true`` the lm_head is smoothed the same way into the final norm (it is that norm's only
reader); where no norm can absorb the scales it is quantized without smoothing, with a warning.

Weights: per output channel, symmetric, scale = amax / 127 (not 127.5), codes in [-127, 127].
Activations: per-token dynamic scales (default), or a static per-tensor ``input_scale`` =
max|X / s| / 127 over the calibration set.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kernels.torch_quant import INT8_MAX, quantize_weight_int8
from passes.base import PassError, register
from passes.ir import Graph, Node
from passes.quantize import QuantMethod, norm_can_absorb

log = logging.getLogger("passes.smoothquant")


def smoothing_scales(act_max: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """s: [in] from the activations' per-channel max |x| and the group's weights [out_i, in]."""
    w_max = torch.stack([w.float().abs().amax(dim=0) for w in weights]).amax(dim=0)
    s = act_max.float().clamp(min=1e-5).pow(alpha) / w_max.clamp(min=1e-5).pow(1 - alpha)
    return s.clamp(min=1e-5)


@register
class SmoothQuant(QuantMethod):
    """Smooth activation outliers into the weights, then quantize linears to INT8 weights and activations."""

    name = "smoothquant"
    scheme = "w8a8_int8"

    def configure(self, options: dict[str, Any]) -> None:
        self.alpha = float(options.get("alpha", 0.5))
        self.smoothing = bool(options.get("smoothing", True))
        self.static = options.get("activations", "dynamic") == "static"
        self.num_smoothed = 0

    def observe(self, index: int, node: Node, x: torch.Tensor) -> None:
        amax = x.detach().abs().float().amax(dim=0)  # [in]
        self.stats[index] = torch.maximum(self.stats[index], amax) if index in self.stats else amax

    def apply_segment(self, graph: Graph, targets: list[int]) -> None:
        producers = graph.producers()
        groups: dict[str, list[int]] = {}
        for i in targets:
            groups.setdefault(graph.nodes[i].inputs[0], []).append(i)
        for value, members in groups.items():
            if any(i not in self.stats for i in members):
                raise PassError(f"smoothquant: no calibration statistics reached {graph.nodes[members[0]].source}")
            act_max = torch.stack([self.stats[i] for i in members]).amax(dim=0)
            norm = producers.get(value)
            smooth = self.smoothing and norm_can_absorb(graph, norm, value, members)
            if self.smoothing and not smooth and any(graph.nodes[i].op == "lm_head" for i in members):
                log.warning("smoothquant: the lm_head's input (%%%s) comes from no norm that can absorb the smoothing "
                            "scales; the lm_head is quantized to W8A8 INT8 without smoothing", value)
            s = None
            if smooth:
                weights = [graph.params[graph.nodes[i].weights["weight"]] for i in members]
                s = smoothing_scales(act_max, weights, self.alpha)
                name = norm.weights["weight"]
                graph.params[name] = (graph.params[name].float() / s).to(graph.params[name].dtype)
                self.num_smoothed += 1
            for i in members:
                self._quantize(graph, graph.nodes[i], s, act_max)

    def _quantize(self, graph: Graph, node: Node, s: torch.Tensor | None, act_max: torch.Tensor) -> None:
        w = graph.params[node.weights["weight"]].float()
        if s is not None:
            w = w * s[None, :]
            act_max = act_max / s
        q, scale = quantize_weight_int8(w)
        tensors = {"qweight": q, "weight_scale": scale}
        if self.static:
            tensors["input_scale"] = (act_max.amax().clamp(min=1e-8) / INT8_MAX).reshape(1)
        self.replace_weight(graph, node, self.scheme, tensors,
                       {"activations": "static" if self.static else "dynamic", "smoothed": s is not None},
                            reference=w)

    def summary(self, graph: Graph, targets: list[int]) -> dict[str, Any]:
        return {**super().summary(graph, targets), "alpha": self.alpha, "smoothed_groups": self.num_smoothed}
