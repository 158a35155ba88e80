"""runtime.executor.check_graph on small crafted graphs (dicts, as graph.json holds them): what the engines refuse
at load instead of failing at the first request."""

from __future__ import annotations

import copy

import pytest
import torch

from runtime.executor import GraphFormatError, check_graph

VOCAB, HIDDEN = 16, 8


def _graph(lm_head_rows: int = VOCAB, tp_size: int = 1) -> dict:
    """input_ids -> embedding -> lm_head (-> all_gather of its rows with ``tp_size`` > 1: vocab-parallel)."""
    nodes = [{"op": "embedding", "inputs": ["input_ids"], "outputs": ["h"], "weights": {"weight": "embed"},
              "attrs": {}, "source": "model.embed_tokens"},
             {"op": "lm_head", "inputs": ["h"], "outputs": ["logits"], "weights": {"weight": "head"}, "attrs": {},
              "source": "lm_head"}]
    meta = {"vocab_size": VOCAB, "hidden_size": HIDDEN}
    if tp_size > 1:
        nodes[1]["outputs"] = ["logits_partial"]
        nodes.append({"op": "all_gather", "inputs": ["logits_partial"], "outputs": ["logits"], "weights": {},
                      "attrs": {"tp_size": tp_size}, "source": "lm_head"})
        meta["tensor_parallel"] = {"tp_size": tp_size, "vocab_parallel": True}
    return {"ir_version": 1, "inputs": ["input_ids", "positions"], "outputs": ["logits"], "meta": meta,
            "params": {"embed": {"shape": [VOCAB // tp_size, HIDDEN], "dtype": "float32"},
                       "head": {"shape": [lm_head_rows, HIDDEN], "dtype": "float32"}},
            "nodes": nodes}


def test_the_crafted_graphs_pass():
    check_graph(_graph())
    check_graph(_graph(VOCAB // 2, tp_size=2))


def test_a_vocab_parallel_lm_head_whose_rows_are_not_the_vocabulary_is_refused():
    """A sharded lm_head (shapes per rank, which the unsharded weight-shape check skips) whose rows are not
    vocab_size / tp_size: the gathered logits would not be [tokens, vocab_size]."""
    with pytest.raises(GraphFormatError, match=r"node 1 \(lm_head, from lm_head\) writes the graph's output 'logits' "
                                               r"with 16 logits a token \(its weight's rows\); expected the "
                                               r"vocabulary's 8 \(meta vocab_size 16 over tp_size 2\)"):
        check_graph(_graph(VOCAB, tp_size=2))


def test_an_output_that_is_not_the_lm_heads_is_refused():
    graph = _graph()
    graph["outputs"] = ["h"]  # the hidden state
    with pytest.raises(GraphFormatError, match=r"the graph's output 'h' is written by node 0 \(embedding, from "
                                               r"model\.embed_tokens\), not by the lm_head; the engines sample"):
        check_graph(graph)
    gathered = _graph(VOCAB // 2, tp_size=2)
    gathered["nodes"][2]["inputs"] = ["h"]  # an all_gather of something else
    with pytest.raises(GraphFormatError, match=r"written by node 0 \(embedding, .*not by the lm_head \(through an "
                                               r"all_gather\)"):
        check_graph(gathered)
    empty = copy.deepcopy(_graph())
    empty["outputs"] = []
    with pytest.raises(GraphFormatError, match=r"the graph has no outputs; its first output must be the lm_head's"):
        check_graph(empty)


def _quantized(scheme: str = "w4a16", group_size: int = 4, **quant) -> dict:
    """_graph() with a weight-only linear [HIDDEN -> HIDDEN] between the embedding and the lm_head, its tensors in
    kernels/torch_quant.py's layout: qweight [out, in * bits / 8] uint8, scales and zeros [out, in / group_size]."""
    graph = _graph()
    bits = {"w4a16": 4, "w8a16": 8}[scheme]
    groups = 1 if group_size == -1 else HIDDEN // group_size
    graph["params"].update({"q.qweight": {"shape": [HIDDEN, HIDDEN * bits // 8], "dtype": "uint8"},
                            "q.scales": {"shape": [HIDDEN, groups], "dtype": "float32"},
                            "q.zeros": {"shape": [HIDDEN, groups], "dtype": "uint8"}})
    graph["nodes"].insert(1, {"op": "linear", "inputs": ["h"], "outputs": ["hq"], "source": "model.q",
                              "weights": {"qweight": "q.qweight", "scales": "q.scales", "zeros": "q.zeros"},
                              "attrs": {"in_features": HIDDEN, "out_features": HIDDEN, "quant": {
                                  "scheme": scheme, "bits": bits, "group_size": group_size, **quant}}})
    graph["nodes"][2]["inputs"] = ["hq"]
    return graph


def test_the_crafted_weight_only_graphs_pass():
    for scheme in ("w4a16", "w8a16"):
        for group_size in (-1, 2, 4, 8):
            check_graph(_quantized(scheme, group_size))


def _set(path: str, value):
    """Set a quant attr (``quant.bits``), a node attr (``attrs.in_features``) or a param's shape (``q.scales``)."""
    def change(graph: dict) -> None:
        node = graph["nodes"][1]
        kind, key = path.split(".", 1)
        if kind == "quant":
            node["attrs"]["quant"][key] = value
        elif kind == "attrs":
            node["attrs"][key] = value
        else:
            graph["params"][path]["shape"] = value
    return change


@pytest.mark.parametrize("change, says", [
    (_set("quant.bits", 3), r"quant bits is 3; a w4a16 linear stores 4-bit codes \(allowed: 4\)"),
    (_set("quant.bits", 8), r"quant bits is 8; a w4a16 linear stores 4-bit codes \(allowed: 4\)"),
    (_set("quant.bits", "4"), r"quant bits is '4'; a w4a16 linear stores 4-bit codes"),
    (_set("quant.group_size", 0), r"quant group_size is 0; allowed: -1 \(one group a row\) or a whole number in "
                                  r"1\.\.16777216 dividing the input features"),
    (_set("quant.group_size", 3), r"quant group_size 3 does not divide its 8 input features \(qweight \[8, 4\], "
                                  r"4-bit codes\)"),
    # the attr says groups of 4 (2 a row); the scales hold 4 a row: dequantized over the wrong groups, or a reshape's
    # RuntimeError caught by the engine's catch-all
    (_set("q.scales", [8, 4]), r"its scales are \[8, 4\] \(scales \[8, 4\], zeros \[8, 2\]\); quant bits 4 and "
                               r"group_size 4 over qweight \[8, 4\] \(8 input features\) give \[8, 2\]"),
    (_set("q.zeros", [2, 8]), r"its zeros are \[2, 8\] \(scales \[8, 2\], zeros \[2, 8\]\); quant bits 4 and "
                              r"group_size 4"),
    (_set("q.zeros", [8]), r"its zeros is \[8\] in the graph's params; a w4a16 linear's zeros is 2-D"),
    (_set("attrs.in_features", 16), r"its qweight \[8, 4\] holds 8 x 8 4-bit codes; attrs out_features x "
                                    r"in_features are 8 x 16"),
])
def test_weight_only_quant_attrs_that_disagree_with_their_tensors_are_refused(change, says):
    """Each message names the node (node 1, the linear from model.q), the attr and the tensors' shapes."""
    graph = _quantized()
    change(graph)
    with pytest.raises(GraphFormatError, match=rf"^node 1 \(linear, from model\.q\): {says}"):
        check_graph(graph)


@pytest.mark.parametrize("k_scale, v_scale, bad", [(0.0, 1.0, "k_scale"), (1.0, -2.0, "v_scale"),
                                                   (float("nan"), 1.0, "k_scale"), (1.0, float("inf"), "v_scale")])
def test_a_quantized_kv_caches_scales_must_be_finite_and_positive(k_scale, v_scale, bad):
    """k_scale / v_scale of a quantized KV cache (the kernels fold k_scale into the softmax's scale): 0, negative or
    not finite is refused when the attention is built, naming the layer and the tensor; positive ones pass."""
    from runtime.executor import _check_kv_scales

    attrs = {"layer": 3}
    _check_kv_scales({"k_scale": torch.tensor([0.02]), "v_scale": torch.tensor(0.5)}, attrs)
    _check_kv_scales({}, attrs)  # a 16-bit cache has none
    w = {"k_scale": torch.tensor([k_scale]), "v_scale": torch.tensor([v_scale])}
    with pytest.raises(GraphFormatError, match=rf"attention layer 3: its {bad} holds .*; expected finite values > 0"):
        _check_kv_scales(w, attrs)
