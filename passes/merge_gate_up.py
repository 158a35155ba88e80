"""merge_gate_up: the gate and up projections of a gated MLP become one linear."""

from __future__ import annotations

from passes.base import Pass, PassContext, PassResult, register
from passes.ir import Graph
from passes.merge_linears import can_merge, merge_linear_group, sibling_linears


@register
class MergeGateUp(Pass):
    """Merge gate/up linears whose outputs meet in act(gate) * up into one linear with split outputs."""

    name = "merge_gate_up"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        producers = graph.producers()
        matched = changed = 0
        for group in list(sibling_linears(graph).values()):
            outs = {n.outputs[0]: n for n in group}
            for mul in [n for n in graph.nodes if n.op == "elementwise" and n.attrs["fn"] == "mul"]:
                a, b = (producers.get(i) for i in mul.inputs)
                if a is None or b is None:
                    continue
                if a.op == "linear" and b.op == "activation":
                    a, b = b, a
                if not (a.op == "activation" and a.inputs[0] in outs and b.outputs[0] in outs):
                    continue
                gate, up = outs[a.inputs[0]], outs[b.outputs[0]]
                if gate is up or gate.attrs["out_features"] != up.attrs["out_features"]:
                    continue
                matched += 1
                if can_merge(graph, [gate, up]):
                    merge_linear_group(graph, [gate, up])
                    changed += 1
                break
        return PassResult(graph, matched, changed)
