"""dce: dead-code elimination over nodes and weights."""

from __future__ import annotations

from passes.base import Pass, PassContext, PassResult, register
from passes.ir import Graph


@register
class DeadCodeElimination(Pass):
    """Remove nodes none of whose outputs are used, and weights no node references."""

    name = "dce"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        live = set(graph.outputs)
        kept = []
        for n in reversed(graph.nodes):
            if any(o in live for o in n.outputs):
                kept.append(n)
                live.update(n.inputs)
        removed_nodes = len(graph.nodes) - len(kept)
        graph.nodes = kept[::-1]
        used = {w for n in graph.nodes for w in n.weights.values()}
        dead_params = [k for k in graph.params if k not in used]
        for k in dead_params:
            del graph.params[k]
        return PassResult(graph, removed_nodes + len(dead_params), removed_nodes + len(dead_params),
                          {"nodes_removed": removed_nodes, "weights_removed": len(dead_params)})
