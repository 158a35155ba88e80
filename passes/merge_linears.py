"""Shared rewrite for the linear-merge passes: sibling linears reading one input become one."""

from __future__ import annotations

import torch

from passes.ir import Graph, Node


def merged_name(weight_names: list[str], suffix: str) -> str:
    """model.layers.0.self_attn.{q,k,v}_proj.weight -> model.layers.0.self_attn.q_proj+k_proj+v_proj.weight"""
    parents = {n.rsplit(".", 2)[0] for n in weight_names}
    leaves = [n.rsplit(".", 2)[1] for n in weight_names]
    assert len(parents) == 1, f"merged weights come from different modules: {weight_names}"
    return f"{parents.pop()}.{'+'.join(leaves)}.{suffix}"


def merge_linear_group(graph: Graph, group: list[Node]) -> Node:
    """Replace ``group`` (linears on the same input, all with or all without bias) by one linear.

    The merged node sits where the first member was and writes every member's output, split by
    ``split_sizes``; its weight is the members' weights stacked along the output dim.
    """
    x = group[0].inputs[0]
    assert all(n.op == "linear" and n.inputs == [x] and "split_sizes" not in n.attrs for n in group)
    has_bias = {"bias" in n.weights for n in group}
    assert len(has_bias) == 1, "members disagree on bias"
    w_names = [n.weights["weight"] for n in group]
    weights = {"weight": merged_name(w_names, "weight")}
    graph.params[weights["weight"]] = torch.cat([graph.params[w] for w in w_names], dim=0)
    if has_bias.pop():
        b_names = [n.weights["bias"] for n in group]
        weights["bias"] = merged_name(b_names, "bias")
        graph.params[weights["bias"]] = torch.cat([graph.params[b] for b in b_names], dim=0)
    sizes = [n.attrs["out_features"] for n in group]
    merged = Node(
        "linear", [x], [n.outputs[0] for n in group], weights,
        {"in_features": group[0].attrs["in_features"], "out_features": sum(sizes), "split_sizes": sizes},
        group[0].source.rsplit(".", 1)[0],
    )
    first = graph.nodes.index(group[0])
    members = {id(n) for n in group}
    graph.nodes = [n for n in graph.nodes[:first] if id(n) not in members] + [merged] + \
        [n for n in graph.nodes[first:] if id(n) not in members]
    return merged


def sibling_linears(graph: Graph) -> dict[str, list[Node]]:
    """Input value -> the unsplit linears that read it, in graph order."""
    groups: dict[str, list[Node]] = {}
    for n in graph.nodes:
        if n.op == "linear" and "split_sizes" not in n.attrs:
            groups.setdefault(n.inputs[0], []).append(n)
    return groups
