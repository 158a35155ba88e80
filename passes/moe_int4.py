"""W4A16 experts: a ``moe`` node's experts as 4-bit codes in groups along the input, each expert quantized on the
calibration tokens routed to it (the experts of the ``awq`` and ``gptq`` methods; ``fp8`` has its own, passes/fp8.py).

Layout (the ``moe`` op's quant scheme ``w4a16``, passes/ir.py): each expert's weight [out, in] is stored as a w4a16
linear stores its weight (passes/quant_math.py, passes/README.md), stacked over the E experts:

    w_gate_up          uint8  [E, 2 * I, hidden / 2]   codes, two per byte along the input, low nibble = even index
    w_gate_up_scales   fp32   [E, 2 * I, hidden / G]
    w_gate_up_zeros    uint8  [E, 2 * I, hidden / G]
    w_down             uint8  [E, hidden, I / 2]
    w_down_scales      fp32   [E, hidden, I / G]
    w_down_zeros       uint8  [E, hidden, I / G]

    w = (q - zero) * scale per (expert, output row, group of G inputs), in fp32, rounded to the activation dtype

G is the section's ``group_size`` (-1: one group per row), the grid asymmetric with zero points or ``symmetric`` (zero
point 8), quant_math's convention, so a dense w4a16 linear and an expert of the same section dequantize alike. The
router (``gate_weight``, ``gate_bias``) and gpt-oss's expert biases stay in the model dtype. The node's ``quant`` attr:
``{"scheme": "w4a16", "bits": 4, "group_size": G, "symmetric": ...}``.

Calibration (:class:`Int4Experts`, mixed into the methods). The statistics pass of the segment holding a moe node
observes the node's input x [T, hidden]; the router is run on it (``kernels.torch_ops.moe_route``: the op's own
routing), and expert e sees the rows routed to it (a token once per slot that chose e): x_e for its gate/up
projection, and h_e = act(x_e Wg_e^T) * (x_e Wu_e^T) for its down projection, computed with the float experts in the
model dtype (as the op computes; the gate/up codes are not yet chosen then). Per expert and projection:

    gptq   the Hessian of its routed rows; GPTQ (passes/gptq.py) on it with the section's act_order, damp, block_size
           and refit_scales
    awq    its clip searched (passes/awq.py ``search_clip``) on up to MAX_KEPT_ROWS of its routed rows (the first
           ones), rounded to nearest, then (refit_scales, default on) its group scales refit on its routed rows'
           Hessian; ``rounding: gptq``: GPTQ on that Hessian instead, as the section's linears. No activation-aware
           scale: every expert and the router read the same normalised x, so a per-channel 1 / s folded into the norm
           would reach the router too, and a per-expert s has nowhere to fold

An expert that no calibration token reached is rounded to nearest (``quant_math.quantize_groups``) and named, in the
build log (a warning) and in the pass's report: "experts that saw no calibration tokens: layer L experts [...]". The
report also holds each moe layer's routed rows per expert (``expert_tokens``).

Memory: per moe layer being calibrated, a Hessian [hidden, hidden] and one [I, I] (fp32) per expert that received
tokens, and with awq MAX_KEPT_ROWS rows of each input per expert; freed once the layer is quantized.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import torch_ops as ops
from passes.base import PassError
from passes.ir import Graph, Node
from passes.quant_math import HessianAccumulator, QuantConfig, pack_int4, quantize_groups

__all__ = ["ExpertInputs", "Int4Experts", "routed_inputs", "quantize_moe_int4", "check_expert_groups"]

log = logging.getLogger("passes.moe_int4")

MAX_KEPT_ROWS = 512  # routed rows kept per expert and projection for awq's clip search (search_clip samples 512)
ROLES = ("w_gate_up", "w_down")

# (role, expert, float weight [out, in] fp32) -> (codes uint8 [out, in], scales fp32, zeros uint8 [out, n_groups])
ExpertQuantizer = Callable[[str, int, Tensor], tuple[Tensor, Tensor, Tensor]]


def check_expert_groups(graph: Graph, node: Node, group_size: int, method: str) -> None:
    """PassError unless group_size is one the fused experts kernel takes (a multiple of INT4_MIN_BLOCK_K, or -1) and
    both projections' inputs (hidden, intermediate) are even and tiled by it."""
    from kernels.moe import INT4_MIN_BLOCK_K

    hidden = int(graph.params[node.weights["w_gate_up"]].shape[-1])
    for what, in_f in (("hidden size", hidden), ("intermediate size", int(node.attrs["intermediate_size"]))):
        if in_f % 2 or (group_size != -1 and (in_f % group_size or group_size % INT4_MIN_BLOCK_K)):
            options = [g for g in (256, 128, 64, 32) if in_f % g == 0]
            raise PassError(f"{method}: the experts of {node.source} read inputs of {in_f} features (the {what}); "
                            f"group_size {group_size} does not fit them: 4-bit experts take a group size that divides "
                            f"it and is a multiple of {INT4_MIN_BLOCK_K} (the fused kernel's least K step), and an "
                            f"even size (codes are packed two per byte); use {', '.join(map(str, options)) or '-1'}, "
                            f"-1 (per channel), or leave the experts unquantized (experts: false)")


@torch.no_grad()
def routed_inputs(graph: Graph, node: Node, x: Tensor):
    """For each expert that the op routes a row of ``x`` [T, hidden] to: (expert, x_e [n, hidden], h_e [n, I]), the
    rows of x routed to it (a token once per slot) and its down projection's inputs, from the float experts."""
    w = {role: graph.params[name] for role, name in node.weights.items()}
    a = node.attrs
    top_k = int(a["top_k"])
    _, experts = ops.moe_route(x, w["gate_weight"], w.get("gate_bias"), top_k, a["scoring"], a["norm_topk_prob"],
                               w.get("select_bias"), float(a.get("routed_scaling_factor", 1.0)),
                               bool(a.get("router_fp32", False)))  # the op's own choice, selection bias included
    for e, rows in ops.slots_by_expert(experts, int(a["num_experts"])):
        xe = x[rows // top_k]
        gate_up = F.linear(xe, w["w_gate_up"][e].to(x.dtype))
        if "b_gate_up" in w:
            gate_up = gate_up + w["b_gate_up"][e].to(x.dtype)
        yield e, xe, ops.expert_activation(gate_up, a["activation"], float(a.get("swiglu_alpha", 0.0)),
                                           float(a.get("swiglu_limit", 0.0)))


@dataclass
class ExpertInputs:
    """One moe node's calibration statistics per expert: routed rows, Hessians per projection, kept rows."""

    num_experts: int
    keep_rows: int = 0  # rows kept per expert and projection (awq's clip search); 0: none
    counts: list[int] = field(default_factory=list)
    hessians: dict[tuple[str, int], Any] = field(default_factory=dict)  # passes.quant_math.HessianAccumulator
    kept: dict[tuple[str, int], list[Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * self.num_experts

    def add(self, e: int, xe: Tensor, h: Tensor) -> None:
        self.counts[e] += xe.shape[0]
        for role, rows in (("w_gate_up", xe), ("w_down", h)):
            acc = self.hessians.setdefault((role, e), HessianAccumulator(rows.shape[-1]))
            acc.add(rows)
            if self.keep_rows:
                kept = self.kept.setdefault((role, e), [])
                have = sum(k.shape[0] for k in kept)
                if have < self.keep_rows:
                    kept.append(rows[:self.keep_rows - have].float())

    def hessian(self, role: str, e: int) -> Tensor | None:
        acc = self.hessians.get((role, e))
        return None if acc is None or acc.num_tokens == 0 else acc.H

    def rows(self, role: str, e: int) -> Tensor | None:
        kept = self.kept.get((role, e))
        return torch.cat(kept) if kept else None


def quantize_moe_int4(graph: Graph, node: Node, cfg: QuantConfig, quantize: ExpertQuantizer) -> None:
    """A moe node's experts as W4A16 in place (the module docstring's layout): ``quantize(role, e, w)`` gives each
    expert's codes, scales and zeros; the codes are packed, everything stacked and stored as ``<name>.qweight`` /
    ``.scales`` / ``.zeros`` where the float experts were, which leave ``graph.params`` unless another node reads
    them."""
    if cfg.bits != 4:
        raise PassError(f"W4A16 experts take 4-bit codes; got bits {cfg.bits}")
    for role in ROLES:
        old = node.weights[role]
        w = graph.params[old]
        codes, scales, zeros = [], [], []
        for e in range(w.shape[0]):
            c, s, z = quantize(role, e, w[e].float())
            codes.append(pack_int4(c))
            scales.append(s.float())
            zeros.append(z.to(torch.uint8))
        for suffix, parts in (("qweight", codes), ("scales", scales), ("zeros", zeros)):
            graph.params[f"{old}.{suffix}"] = torch.stack(parts).contiguous()
        node.weights[role] = f"{old}.qweight"
        node.weights[f"{role}_scales"], node.weights[f"{role}_zeros"] = f"{old}.scales", f"{old}.zeros"
        if not any(old in n.weights.values() for n in graph.nodes):
            graph.params.pop(old, None)
    node.attrs["quant"] = {"scheme": "w4a16", "bits": 4, "group_size": cfg.group_size, "symmetric": cfg.symmetric}


def rtn_experts(graph: Graph, node: Node, cfg: QuantConfig) -> None:
    """Every expert of ``node`` rounded to nearest (quant_math.quantize_groups): what an expert that saw no
    calibration token gets, and the quality gates' round-to-nearest counterpart."""
    quantize_moe_int4(graph, node, cfg, lambda role, e, w: quantize_groups(w, cfg))


def _layer_of(source: str) -> str:
    m = re.search(r"layers\.(\d+)\.", source + ".")
    return f"layer {m.group(1)}" if m else source


class Int4Experts:
    """Mixed into a 4-bit weight method (before QuantMethod in the bases; it reads ``self.cfg``): quantizes the moe
    nodes its section reaches to W4A16 experts during calibration (option ``experts``, default on, as fp8's: off in a
    section that quantizes the lm_head alone unless set; targets / ignore reach a moe layer by its module path).
    Subclasses implement :meth:`quantize_expert`."""

    quantizes_experts = True
    experts_left = ("quantization.experts is false, the section quantizes the lm_head alone, or its targets / ignore "
                    "leave those layers out")
    keep_expert_rows = 0  # rows of each expert's inputs kept for quantize_expert (awq's clip search)
    expert_rounding = ""  # how an expert with calibration tokens is quantized, for the report

    def configure_experts(self, options: dict[str, Any]) -> None:
        self.experts = options.get("experts")  # None: on, unless the section quantizes the lm_head alone
        self.expert_stats: dict[int, ExpertInputs] = {}
        self.expert_tokens: dict[str, list[int]] = {}  # moe source -> routed rows per expert
        self.experts_unseen: dict[str, list[int]] = {}  # moe source -> experts no calibration token reached
        self._moe_graph: Graph | None = None

    def quantize_expert(self, role: str, e: int, w: Tensor, stats: ExpertInputs) -> tuple[Tensor, Tensor, Tensor]:
        """Codes, scales and zeros of expert ``e``'s ``role`` weight ``w`` [out, in] fp32 from its routed inputs
        (``stats``; only called for an expert that received calibration tokens)."""
        raise NotImplementedError

    def _experts_chosen(self, graph: Graph, targets: list[int]) -> list[Node]:
        return self._reached(graph, any(graph.nodes[i].op == "linear" for i in targets))

    def select(self, graph: Graph, section: str, warn: bool = True) -> list[int]:
        targets = super().select(graph, section, warn)
        for node in self._experts_chosen(graph, targets):
            check_expert_groups(graph, node, self.cfg.group_size, self.name)
        return targets

    def expert_targets(self, graph: Graph, targets: list[int]) -> list[int]:
        self._moe_graph = graph
        chosen = {id(n) for n in self._experts_chosen(graph, targets)}
        return [i for i, n in enumerate(graph.nodes) if id(n) in chosen]

    def observe_experts(self, index: int, node: Node, inputs: list[Tensor]) -> None:
        stats = self.expert_stats.setdefault(index, ExpertInputs(int(node.attrs["num_experts"]), self.keep_expert_rows))
        for e, xe, h in routed_inputs(self._moe_graph, node, inputs[0]):
            stats.add(e, xe, h)

    def apply_experts(self, graph: Graph, indices: list[int]) -> None:
        for i in indices:
            node = graph.nodes[i]
            stats = self.expert_stats.pop(i, None) or ExpertInputs(int(node.attrs["num_experts"]))
            seen = [c > 0 for c in stats.counts]
            quantize_moe_int4(graph, node, self.cfg, lambda role, e, w: (
                self.quantize_expert(role, e, w, stats) if seen[e] else quantize_groups(w, self.cfg)))
            self.expert_tokens[node.source] = list(stats.counts)
            unseen = [e for e, ok in enumerate(seen) if not ok]
            if unseen:
                self.experts_unseen[node.source] = unseen

    def quantize_experts(self, graph: Graph, targets: list[int]) -> dict[str, Any]:
        """The experts' summary; any reached moe node calibration did not quantize (no calibration pass) is rounded
        to nearest, every expert of it named as unseen."""
        left = self._experts_chosen(graph, targets)
        if left:
            ids = {id(n) for n in left}
            self.apply_experts(graph, [i for i, n in enumerate(graph.nodes) if id(n) in ids])
        if not self.expert_tokens:
            return {}
        sym = "symmetric" if self.cfg.symmetric else "asymmetric with zero points"
        out: dict[str, Any] = {
            "moe_layers_quantized": len(self.expert_tokens),
            "moe_experts": (f"w4a16 codes in groups of {self.cfg.group_size} ({sym}), each expert {self.expert_rounding} "
                            f"on the calibration tokens routed to it; experts no token reached rounded to nearest"),
            "expert_tokens": dict(self.expert_tokens)}
        if self.experts_unseen:
            named = "; ".join(f"{_layer_of(src)} experts {experts}" for src, experts in self.experts_unseen.items())
            log.warning("%s: experts that saw no calibration tokens: %s (rounded to nearest; calibrate on more or more "
                        "varied text to reach them)", self.name, named)
            out["experts_without_tokens"] = named
        return out
