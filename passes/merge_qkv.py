"""merge_qkv: the q, k and v projections of an attention block become one linear."""

from __future__ import annotations

from passes.base import Pass, PassContext, PassResult, register
from passes.ir import Graph
from passes.merge_linears import can_merge, merge_linear_group, sibling_linears


def _reaches_attention(graph: Graph, value: str, attn_inputs: set[str]) -> bool:
    """Follow rope, position_scale (Ministral 3's query temperature) and per-head norm nodes from ``value`` to an
    attention input."""
    users = graph.users()
    frontier = [value]
    while frontier:
        v = frontier.pop()
        if v in attn_inputs:
            return True
        frontier += [u.outputs[0] for u in users.get(v, []) if u.inputs[0] == v and (
            u.op in ("rope", "position_scale", "rms_norm") or (u.op == "layer_norm" and u.attrs.get("head_dim")))]
    return False


@register
class MergeQKV(Pass):
    """Merge each attention block's q/k/v linears (same input) into one linear with split outputs."""

    name = "merge_qkv"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        attn_inputs = {i for n in graph.nodes if n.op == "attention" for i in n.inputs}
        matched = changed = 0
        for group in sibling_linears(graph).values():
            qkv = [n for n in group if _reaches_attention(graph, n.outputs[0], attn_inputs)]
            if len(qkv) < 2:
                continue
            matched += 1
            if can_merge(graph, qkv):
                merge_linear_group(graph, qkv)
                changed += 1
        return PassResult(graph, matched, changed)
