"""fuse_silu_mul: silu(gate) * up becomes one op (SwiGLU), reading a merged gate/up output directly."""

from __future__ import annotations

from passes.base import Pass, PassContext, PassResult, register
from passes.ir import Graph, Node


@register
class FuseSiluMul(Pass):
    """Fuse activation(silu) followed by a multiply into silu_mul; over a merged gate/up, drop the split."""

    name = "fuse_silu_mul"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        producers, users = graph.producers(), graph.users()
        matched = 0
        replace: dict[int, Node] = {}
        drop: set[int] = set()
        for mul in graph.nodes:
            if mul.op != "elementwise" or mul.attrs["fn"] != "mul":
                continue
            a, b = (producers.get(i) for i in mul.inputs)
            if b is not None and b.op == "activation":
                a, b = b, a
            if a is None or a.op != "activation" or a.attrs["fn"] != "silu" or len(users[a.outputs[0]]) != 1:
                continue
            up = mul.inputs[1] if mul.inputs[0] == a.outputs[0] else mul.inputs[0]
            gate = a.inputs[0]
            matched += 1
            lin = producers.get(gate)
            if (lin is not None and lin.op == "linear" and lin.outputs == [gate, up]
                    and len(set(lin.attrs.get("split_sizes", []))) == 1 and not lin.attrs.get("split_heads")):
                # [gate | up] side by side: keep the linear's single output, split inside silu_mul
                lin.outputs = [gate]
                lin.attrs = {k: v for k, v in lin.attrs.items() if k != "split_sizes"}
                fused = Node("silu_mul", [gate], list(mul.outputs), {}, {}, mul.source)
            else:
                fused = Node("silu_mul", [gate, up], list(mul.outputs), {}, {}, mul.source)
            replace[id(mul)] = fused
            drop.add(id(a))
        graph.nodes = [replace.get(id(n), n) for n in graph.nodes if id(n) not in drop]
        return PassResult(graph, matched, matched)
