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


# Roles one tensor of which serves the whole linear (not one row per output feature): merged members must agree.
SHARED_ROLES = ("input_scale", "perm", "pre_quant_scale")


def can_merge(graph: Graph, group: list[Node]) -> bool:
    """Whether ``group`` can become one linear: all with or all without bias, and stored alike (all float, or
    all in one quant scheme with equal settings and equal shared tensors: a pre-quantized checkpoint's input
    scales, act-order permutations and pre_quant_scales). fp8_block members stack their block scales by rows, so
    every member but the last must hold whole blocks of rows."""
    if len({"bias" in n.weights for n in group}) != 1 or len({tuple(sorted(n.weights)) for n in group}) != 1:
        return False
    quants = [n.attrs.get("quant") for n in group]
    if any(q != quants[0] for q in quants):
        return False
    if quants[0] and quants[0]["scheme"] == "fp8_block" and any(
            n.attrs["out_features"] % quants[0]["block_size"][0] for n in group[:-1]):
        return False
    return all(torch.equal(graph.params[n.weights[role]], graph.params[group[0].weights[role]])
               for n in group for role in SHARED_ROLES if role in n.weights)


def merge_linear_group(graph: Graph, group: list[Node]) -> Node:
    """Replace ``group`` (linears on the same input that :func:`can_merge`) by one linear.

    The merged node sits where the first member was and writes every member's output, split by
    ``split_sizes``; its weight is the members' weights stacked along the output dim (each role of a
    quantized one: codes, scales and zero points by rows; a per-tensor weight scale becomes per channel).
    """
    x = group[0].inputs[0]
    assert all(n.op == "linear" and n.inputs == [x] and "split_sizes" not in n.attrs for n in group)
    assert can_merge(graph, group), "members are stored differently"
    sizes = [n.attrs["out_features"] for n in group]
    weights = {}
    for role in group[0].weights:
        names = [n.weights[role] for n in group]
        weights[role] = merged_name(names, role)
        if role in SHARED_ROLES:
            graph.params[weights[role]] = graph.params[names[0]]
            continue
        parts = [graph.params[w] for w in names]
        if role == "weight_scale" and parts[0].dim() <= 1:  # per tensor [1] or channel [out]: per channel stacked
            parts = [t.reshape(-1).expand(size) for t, size in zip(parts, sizes)]
        graph.params[weights[role]] = torch.cat(parts, dim=0)
    attrs = {"in_features": group[0].attrs["in_features"], "out_features": sum(sizes), "split_sizes": sizes}
    if "quant" in group[0].attrs:
        attrs["quant"] = dict(group[0].attrs["quant"])
        if "weight_scale" in weights and attrs["quant"].get("weight_granularity") == "tensor":
            attrs["quant"]["weight_granularity"] = "channel"
    merged = Node("linear", [x], [n.outputs[0] for n in group], weights, attrs, group[0].source.rsplit(".", 1)[0])
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
