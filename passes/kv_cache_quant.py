"""kv_cache_quant: FP8 or INT8 KV cache with per-layer scales calibrated on the calibration set.

For each attention layer, the largest |k| (after RoPE) and |v| seen on the calibration tokens gives
``k_scale = amax / 448`` (FP8 E4M3) or ``amax / 127`` (INT8, codes in [-127, 127]). The attention
node records ``kv_cache_dtype`` and carries the scales as weights; the runtime's cache stores
k / k_scale and v / v_scale in that dtype and multiplies back when it reads. Halves (vs 16-bit) or
quarters (vs fp32) the KV bytes per token, which is the working set of decode.
"""

from __future__ import annotations

from typing import Any

import torch

from passes.base import PassError, register
from passes.ir import Graph, Node
from passes.quantize import QuantMethod

QMAX = {"fp8": 448.0, "int8": 127.0}


@register
class KVCacheQuant(QuantMethod):
    """Calibrate per-layer K and V scales and switch each layer's KV cache to FP8 or INT8."""

    name = "kv_cache_quant"

    def configure(self, options: dict[str, Any]) -> None:
        self.dtype = options.get("kv_cache_dtype", "fp8")
        if self.dtype not in QMAX:
            raise PassError(f"kv_cache_quant: kv_cache_dtype {self.dtype!r} is not one of fp8, int8")
        self.scheme = f"kv_{self.dtype}"

    def select(self, graph: Graph, section: str, warn: bool = True) -> list[int]:
        return [i for i, n in enumerate(graph.nodes) if n.op == "attention" and "kv_cache_dtype" not in n.attrs]

    def observe_inputs(self, index: int, node: Node, inputs: list[torch.Tensor]) -> None:
        k_max = inputs[1].detach().abs().amax().float()
        v_max = inputs[2].detach().abs().amax().float()
        old = self.stats.get(index)
        self.stats[index] = (k_max, v_max) if old is None else (torch.maximum(old[0], k_max),
                                                                torch.maximum(old[1], v_max))

    def is_applied(self, node: Node) -> bool:
        return "kv_cache_dtype" in node.attrs

    def quantize_node(self, graph: Graph, node: Node, stats: Any) -> None:
        if stats is None:
            raise PassError(f"kv_cache_quant: no calibration statistics reached {node.source}")
        layer = node.attrs["layer"]
        for role, amax in zip(("k_scale", "v_scale"), stats):
            name = f"kv_cache.layers.{layer}.{role}"
            graph.params[name] = (amax.clamp(min=1e-6) / QMAX[self.dtype]).reshape(1)
            node.weights[role] = name
        node.attrs["kv_cache_dtype"] = self.dtype

    def summary(self, graph: Graph, targets: list[int]) -> dict[str, Any]:
        return {"kv_cache_dtype": self.dtype, "num_layers": len(targets)}
