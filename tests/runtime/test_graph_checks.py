"""runtime.executor.check_graph on small crafted graphs (dicts, as graph.json holds them): what the engines refuse
at load instead of failing at the first request."""

from __future__ import annotations

import copy

import pytest

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
