"""fuse_add_rms_norm: a residual add feeding an RMSNorm becomes one fused op."""

from __future__ import annotations

from passes.base import Pass, PassContext, PassResult, register
from passes.ir import Graph, Node


@register
class FuseAddRmsNorm(Pass):
    """Fuse s = a + b; n = rms_norm(s) into (n, s) = fused_add_rms_norm(a, b): one read of a and b."""

    name = "fuse_add_rms_norm"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        producers = graph.producers()
        matched = 0
        replace: dict[int, Node] = {}  # id(add node) -> fused node
        drop: set[int] = set()
        for norm in graph.nodes:
            if norm.op != "rms_norm" or norm.attrs.get("head_dim"):
                continue
            add = producers.get(norm.inputs[0])
            if add is None or add.op != "elementwise" or add.attrs["fn"] != "add" or id(add) in replace:
                continue
            matched += 1
            attrs = {k: v for k, v in norm.attrs.items()}
            # The fused node takes the add's place: its inputs exist there, and the norm only read the sum.
            replace[id(add)] = Node("fused_add_rms_norm", list(add.inputs), [norm.outputs[0], add.outputs[0]],
                                    dict(norm.weights), attrs, norm.source)
            drop.add(id(norm))
        graph.nodes = [replace.get(id(n), n) for n in graph.nodes if id(n) not in drop]
        return PassResult(graph, matched, matched)
