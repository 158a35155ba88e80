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


def _dtype(name: str, dtype: str):
    """Set a param's stored dtype (``q.zeros`` -> ``int32``)."""
    def change(graph: dict) -> None:
        graph["params"][name]["dtype"] = dtype
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
    # stored types the project never writes (uint8 codes and zero points, fp32 scales): the zero points' or codes'
    # bytes read as another type (int8 ones off by 128, int32 ones four a value), fp16 scales not the kernels' fp32
    (_dtype("q.zeros", "int32"), r"its zeros is int32; a w4a16 linear stores uint8 zero points \(allowed: uint8\)"),
    (_dtype("q.zeros", "int8"), r"its zeros is int8; a w4a16 linear stores uint8 zero points \(allowed: uint8\)"),
    (_dtype("q.zeros", "float32"), r"its zeros is float32; a w4a16 linear stores uint8 zero points"),
    (_dtype("q.scales", "float16"), r"its scales is float16; a w4a16 linear stores float32 scales \(allowed: "
                                    r"float32\)"),
    (_dtype("q.scales", "bfloat16"), r"its scales is bfloat16; a w4a16 linear stores float32 scales"),
    (_dtype("q.qweight", "int8"), r"its qweight is int8; a w4a16 linear stores uint8 codes \(allowed: uint8\)"),
])
def test_weight_only_quant_attrs_that_disagree_with_their_tensors_are_refused(change, says):
    """Each message names the node (node 1, the linear from model.q), the attr and the tensors' shapes."""
    graph = _quantized()
    change(graph)
    with pytest.raises(GraphFormatError, match=rf"^node 1 \(linear, from model\.q\): {says}"):
        check_graph(graph)


@pytest.mark.parametrize("role, dtype, allowed", [("zeros", "int8", "uint8"), ("zeros", "int64", "uint8"),
                                                  ("scales", "float16", "float32"), ("qweight", "int8", "uint8")])
def test_w8a16_tensors_of_another_dtype_are_refused(role, dtype, allowed):
    """w8a16 as w4a16: uint8 codes and zero points (zero point 128 for the INT8 imports), fp32 scales."""
    graph = _quantized("w8a16", -1)
    _dtype(f"q.{role}", dtype)(graph)
    with pytest.raises(GraphFormatError, match=rf"^node 1 \(linear, from model\.q\): its {role} is {dtype}; a w8a16 "
                                               rf"linear stores {allowed} .*\(allowed: {allowed}\)$"):
        check_graph(graph)


def _w8a8(scheme: str = "fp8", granularity: str | None = "channel", static: bool = False,
          block: list[int] | None = None, out_features: int = HIDDEN, tp_size: int = 1) -> dict:
    """_graph() with a W8A8 linear [HIDDEN -> out_features] between the embedding and the lm_head, its tensors in
    kernels/torch_quant.py's layout: qweight [out, in] (int8 for w8a8_int8, e4m3 for fp8 / fp8_block), weight_scale
    [out] (per channel), [1] (per tensor) or [ceil(out / bn), ceil(in / bk)] (fp8_block), input_scale [1] where
    static."""
    graph = _graph()
    if tp_size > 1:  # per-rank shapes; the lm_head replicated
        graph["meta"]["tensor_parallel"] = {"tp_size": tp_size, "vocab_parallel": False}
    quant = {"scheme": scheme, "activations": "static" if static else "dynamic"}
    if block is not None:
        quant["block_size"] = block
        scale = [-(-out_features // block[0]), -(-HIDDEN // block[1])]
    else:
        scale = [out_features] if granularity != "tensor" else [1]
    if granularity is not None and scheme == "fp8":
        quant["weight_granularity"] = granularity
    graph["params"].update({"q.qweight": {"shape": [out_features, HIDDEN],
                                          "dtype": "int8" if scheme == "w8a8_int8" else "float8_e4m3fn"},
                            "q.weight_scale": {"shape": scale, "dtype": "float32"}})
    weights = {"qweight": "q.qweight", "weight_scale": "q.weight_scale"}
    if static:
        graph["params"]["q.input_scale"] = {"shape": [1], "dtype": "float32"}
        weights["input_scale"] = "q.input_scale"
    graph["nodes"].insert(1, {"op": "linear", "inputs": ["h"], "outputs": ["hq"], "source": "model.q",
                              "weights": weights, "attrs": {"in_features": HIDDEN, "out_features": out_features,
                                                            "quant": quant}})
    graph["nodes"][2]["inputs"] = ["hq"]
    graph["nodes"][2]["weights"]["weight"] = "head"
    graph["params"]["head"]["shape"] = [VOCAB, out_features]
    return graph


def test_the_crafted_w8a8_graphs_pass():
    for static in (False, True):
        check_graph(_w8a8("w8a8_int8", None, static))
        check_graph(_w8a8("w8a8_int8", None, static, tp_size=2))
        for granularity in ("tensor", "channel", None):
            check_graph(_w8a8("fp8", granularity, static))
            check_graph(_w8a8("fp8", granularity, static, tp_size=2))
    for block in ([4, 4], [3, 8], [128, 128], [1, 1]):  # partial last blocks have scales of their own
        check_graph(_w8a8("fp8_block", block=block))
        check_graph(_w8a8("fp8_block", block=block, out_features=12))
    check_graph(_w8a8("fp8_block", block=[4, 4], tp_size=2))


def _drop(role: str):
    def change(graph: dict) -> None:
        graph["nodes"][1]["weights"].pop(role)
    return change


def _add_input_scale(graph: dict) -> None:
    graph["params"]["q.input_scale"] = {"shape": [1], "dtype": "float32"}
    graph["nodes"][1]["weights"]["input_scale"] = "q.input_scale"


@pytest.mark.parametrize("make, change, says", [
    # a per-channel weight scale that is not one per output row: a broadcast error at the first request, or (one
    # scale) every row scaled by the first's
    (lambda: _w8a8("w8a8_int8"), _set("q.weight_scale", [4]),
     r"its weight_scale is \[4\]; quant scheme w8a8_int8 scales weights per output channel: over qweight "
     r"\[8, 8\], \[8\]"),
    (lambda: _w8a8("w8a8_int8"), _set("q.weight_scale", [1]), r"its weight_scale is \[1\]; quant scheme w8a8_int8 "
                                                                r"scales weights per output channel"),
    (lambda: _w8a8("fp8", "channel"), _set("q.weight_scale", [1]),
     r"its weight_scale is \[1\]; quant scheme fp8 with quant weight_granularity channel scales weights per "
     r"output channel: over qweight \[8, 8\], \[8\]"),
    (lambda: _w8a8("fp8", "tensor"), _set("q.weight_scale", [8]),
     r"its weight_scale is \[8\]; quant scheme fp8 with quant weight_granularity tensor scales weights per "
     r"tensor: over qweight \[8, 8\], \[1\]"),
    (lambda: _w8a8("fp8", None), _set("q.weight_scale", [3]),
     r"its weight_scale is \[3\]; quant scheme fp8 scales weights per tensor or per output channel: over "
     r"qweight \[8, 8\], \[1\] or \[8\]"),
    (lambda: _w8a8("fp8"), _set("quant.weight_granularity", "block"),
     r"quant weight_granularity is 'block'; allowed: tensor, channel"),
    # codes of another type: int8 bytes read as e4m3 (or the reverse) compute garbage
    (lambda: _w8a8("fp8"), lambda g: g["params"]["q.qweight"].update(dtype="int8"),
     r"its qweight is int8; quant scheme fp8 stores float8_e4m3fn codes \(allowed: float8_e4m3fn\)"),
    (lambda: _w8a8("w8a8_int8"), lambda g: g["params"]["q.qweight"].update(dtype="uint8"),
     r"its qweight is uint8; quant scheme w8a8_int8 stores int8 codes"),
    (lambda: _w8a8("fp8"), _set("q.qweight", [8, 8, 1]),
     r"its qweight is \[8, 8, 1\] in the graph's params; quant scheme fp8 stores 2-D codes \[out_features, "
     r"in_features\]"),
    (lambda: _w8a8("fp8"), _set("attrs.in_features", 16),
     r"its qweight is \[8, 8\]; attrs out_features x in_features are 8 x 16"),
    (lambda: _w8a8("w8a8_int8"), _drop("weight_scale"), r"it has no weight_scale; quant scheme w8a8_int8 reads "
                                                         r"qweight and weight_scale"),
    # static activations without their scale ran per token; a scale beside dynamic ones was never read
    (lambda: _w8a8("w8a8_int8", static=True), _drop("input_scale"),
     r"quant activations is 'static' but it has no input_scale; static activations are quantized with one "
     r"calibrated input_scale \[1\]"),
    (lambda: _w8a8("fp8", static=False), _add_input_scale,
     r"quant activations is 'dynamic' but it has an input_scale \[1\]; dynamic activations take none"),
    (lambda: _w8a8("fp8", static=True), _set("q.input_scale", [8]),
     r"its input_scale is \[8\]; static activations are quantized with one calibrated input_scale \[1\]"),
    (lambda: _w8a8("fp8"), _set("quant.activations", "per_token"),
     r"quant activations is 'per_token' \(allowed: static, dynamic\)"),
    # block scales that do not tile the codes: a RuntimeError at the first request, or (too many) silently cut
    (lambda: _w8a8("fp8_block", block=[4, 4]), _set("q.weight_scale", [2, 4]),
     r"its weight_scale is \[2, 4\]; quant block_size \[4, 4\] over qweight \[8, 8\] gives \[2, 2\]: one scale per "
     r"\[4, 4\] block \(a partial last block has its own\)"),
    (lambda: _w8a8("fp8_block", block=[4, 4]), _set("quant.block_size", [2, 4]),
     r"its weight_scale is \[2, 2\]; quant block_size \[2, 4\] over qweight \[8, 8\] gives \[4, 2\]"),
    (lambda: _w8a8("fp8_block", block=[4, 4]), _set("quant.block_size", [4, 0]),
     r"quant block_size is \[4, 0\]; allowed: \[rows, columns\], whole numbers in 1\.\.65536"),
    (lambda: _w8a8("fp8_block", block=[4, 4]), _set("quant.block_size", 128),
     r"quant block_size is 128; allowed: \[rows, columns\]"),
    (lambda: _w8a8("fp8_block", block=[4, 4]), _add_input_scale,
     r"quant activations is 'dynamic' but it has an input_scale \[1\]"),
    (lambda: _w8a8("fp8_block", block=[4, 4]), _set("quant.activations", "static"),
     r"quant activations is 'static'; quant scheme fp8_block quantizes its activations per token and block "
     r"\(allowed: dynamic\)"),
    # sharded: a rank's shapes are its own, but the scales still answer to its codes
    (lambda: _w8a8("fp8", "channel", tp_size=2), _set("q.weight_scale", [4]), r"its weight_scale is \[4\]"),
    (lambda: _w8a8("fp8_block", block=[4, 4], tp_size=2), _set("q.weight_scale", [1, 2]),
     r"its weight_scale is \[1, 2\]; quant block_size \[4, 4\] over qweight \[8, 8\] gives \[2, 2\]"),
])
def test_w8a8_quant_attrs_that_disagree_with_their_tensors_are_refused(make, change, says):
    """W8A8 INT8 (SmoothQuant), FP8 and block-FP8 linears: each message names the node, the attr and the shapes."""
    graph = make()
    change(graph)
    with pytest.raises(GraphFormatError, match=rf"^node 1 \(linear, from model\.q\): {says}"):
        check_graph(graph)


def test_a_quantized_lm_heads_scales_are_checked_as_a_linears():
    graph = _w8a8("fp8", "channel")
    head = graph["nodes"][2]
    head["attrs"] = {"in_features": HIDDEN, "out_features": VOCAB, "quant": {"scheme": "fp8", "activations": "dynamic",
                                                                              "weight_granularity": "channel"}}
    graph["params"].update({"h.qweight": {"shape": [VOCAB, HIDDEN], "dtype": "float8_e4m3fn"},
                            "h.weight_scale": {"shape": [VOCAB], "dtype": "float32"}})
    head["weights"] = {"qweight": "h.qweight", "weight_scale": "h.weight_scale"}
    check_graph(graph)
    graph["params"]["h.weight_scale"]["shape"] = [HIDDEN]
    with pytest.raises(GraphFormatError, match=r"^node 2 \(lm_head, from lm_head\): its weight_scale is \[8\]; quant "
                                               r"scheme fp8 with quant weight_granularity channel scales weights per "
                                               r"output channel: over qweight \[16, 8\], \[16\]"):
        check_graph(graph)


def test_an_unknown_quant_scheme_on_a_linear_is_refused():
    graph = _w8a8("fp8")
    graph["nodes"][1]["attrs"]["quant"]["scheme"] = "nvfp4"
    with pytest.raises(GraphFormatError, match=r"^node 1 \(linear, from model\.q\): quant scheme is 'nvfp4'; allowed: "
                                               r"w4a16, w8a16, w8a8_int8, fp8, fp8_block"):
        check_graph(graph)


def _input_role(graph: dict, role: str, shape: list[int] | None = None, dtype: str | None = None,
                node: int = 1) -> dict:
    """Give a linear (node 1: model.q) an input role, ``perm`` (int32) or ``pre_quant_scale`` (float32), of one entry
    per input feature of its qweight unless ``shape`` / ``dtype`` say otherwise."""
    qweight = graph["params"].get(graph["nodes"][node]["weights"].get("qweight", ""), {}).get("shape", [0, HIDDEN])
    in_features = qweight[1] * 8 // graph["nodes"][node]["attrs"].get("quant", {}).get("bits", 8)  # 4-bit: 2 a byte
    graph["params"][f"n{node}.{role}"] = {"shape": shape if shape is not None else [in_features],
                                         "dtype": dtype or ("int32" if role == "perm" else "float32")}
    graph["nodes"][node]["weights"][role] = f"n{node}.{role}"
    return graph


def _row_parallel(graph: dict) -> dict:
    """A sharded W8A8 linear's rank share cut along its input (row-parallel): qweight [8, 4] of in_features 8."""
    graph["params"]["q.qweight"]["shape"] = [HIDDEN, HIDDEN // 2]
    return graph


def test_the_crafted_input_role_graphs_pass():
    """The imports' layouts: an act-order perm int32 [in] (GPTQ, compressed-tensors: w4a16 / w8a16), a
    pre_quant_scale float32 [in] (ModelOpt AWQ: w4a16; SmoothQuant: w8a8_int8), both together; sharded, a
    row-parallel linear's scale is its rank's columns."""
    for scheme, group_size in (("w4a16", 4), ("w4a16", -1), ("w8a16", 2)):
        check_graph(_input_role(_quantized(scheme, group_size), "perm"))
        check_graph(_input_role(_quantized(scheme, group_size), "perm", dtype="int64"))
        check_graph(_input_role(_input_role(_quantized(scheme, group_size), "perm"), "pre_quant_scale"))
    check_graph(_input_role(_w8a8("w8a8_int8", None, static=True), "pre_quant_scale"))
    check_graph(_input_role(_w8a8("fp8", "channel"), "pre_quant_scale", dtype="bfloat16"))
    check_graph(_input_role(_row_parallel(_w8a8("w8a8_int8", None, tp_size=2)), "pre_quant_scale", [HIDDEN // 2]))


@pytest.mark.parametrize("make, says", [
    # another length: an index_select's or a broadcast's RuntimeError at the first request
    (lambda: _input_role(_quantized(), "perm", [4]),
     r"its perm is \[4\] in the graph's params; qweight \[8, 4\] \(w4a16\) reads 8 input features, and a perm "
     r"holds one per input feature: \[8\]$"),
    (lambda: _input_role(_quantized(), "perm", [8, 1]), r"its perm is \[8, 1\] in the graph's params; .*: \[8\]$"),
    (lambda: _input_role(_quantized("w8a16"), "pre_quant_scale", [4]),
     r"its pre_quant_scale is \[4\] in the graph's params; qweight \[8, 8\] \(w8a16\) reads 8 input features"),
    (lambda: _input_role(_w8a8("fp8"), "pre_quant_scale", [16]),
     r"its pre_quant_scale is \[16\] in the graph's params; qweight \[8, 8\] \(fp8\) reads 8 input features"),
    # sharded: the rank's own columns (a row-parallel linear's scale is cut with them), not attrs in_features
    (lambda: _input_role(_row_parallel(_w8a8("w8a8_int8", None, tp_size=2)), "pre_quant_scale", [HIDDEN]),
     r"its pre_quant_scale is \[8\] in the graph's params; qweight \[8, 4\] \(w8a8_int8\) reads 4 input features "
     r"\(this rank's own\), and a pre_quant_scale holds one per input feature: \[4\]$"),
    # another type: a float perm gathers truncated indices; an integer scale is no exporter's
    (lambda: _input_role(_quantized(), "perm", dtype="float32"),
     r"its perm is float32; a perm holds input feature indices \(allowed: int32, int64\)$"),
    (lambda: _input_role(_quantized(), "perm", dtype="uint8"), r"its perm is uint8; .*\(allowed: int32, int64\)$"),
    (lambda: _input_role(_quantized(), "pre_quant_scale", dtype="int32"),
     r"its pre_quant_scale is int32; a pre_quant_scale holds input feature scales \(allowed: float32, bfloat16, "
     r"float16\)$"),
])
def test_input_roles_that_disagree_with_their_linear_are_refused(make, says):
    """A linear's perm / pre_quant_scale: 1-D, one per input feature of its codes, of an integer / floating dtype;
    each message names the node, the role, what it holds and what is allowed."""
    with pytest.raises(GraphFormatError, match=rf"^node 1 \(linear, from model\.q\): {says}"):
        check_graph(make())


def test_input_roles_on_an_unquantized_linear_are_refused():
    """An unquantized linear never applies a perm or a pre_quant_scale: it would run as if they were not there."""
    graph = _input_role(_w8a8("fp8"), "perm", node=2)  # the lm_head, unquantized
    with pytest.raises(GraphFormatError, match=r"^node 2 \(lm_head, from lm_head\): it carries perm but has no quant "
                                               r"attr; only a quantized linear reads its input through"):
        check_graph(graph)


def _weight_only_tensors(graph: dict, perm: torch.Tensor | None = None,
                         scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Tensors for _quantized()'s graph (w4a16, groups of 4) with ``perm`` / ``scale`` as its input roles."""
    params = {"embed": torch.randn(VOCAB, HIDDEN), "head": torch.randn(VOCAB, HIDDEN),
              "q.qweight": torch.randint(0, 256, (HIDDEN, HIDDEN // 2), dtype=torch.uint8),
              "q.scales": torch.rand(HIDDEN, 2) + 0.5, "q.zeros": torch.full((HIDDEN, 2), 8, dtype=torch.uint8)}
    for role, t in (("perm", perm), ("pre_quant_scale", scale)):
        if t is not None:
            _input_role(graph, role)
            params[f"n1.{role}"] = t
    return params


@pytest.mark.parametrize("perm, says", [
    ([0, 1, 2, 3, 4, 5, 6, 6], r"its perm holds index 6 2 times and never 7; a perm of 8 input features is a "
                               r"permutation of 0\.\.7, each index once"),
    ([7, 6, 5, 4, 3, 2, 1, 8], r"its perm holds indices 1\.\.8; a perm of 8 input features is a permutation of 0\.\.7"),
    ([0, 1, 2, 3, 4, 5, 6, -1], r"its perm holds indices -1\.\.6; a perm of 8 input features"),
])
def test_a_perm_that_is_not_a_permutation_is_refused_when_the_linear_is_built(perm, says):
    """x[:, perm] over a perm with an index twice reads one input column twice and drops another (wrong outputs,
    silently); one out of range fails the first request deep in a gather. The values are the loaded tensor's, checked
    when the Executor is built (Engine.load), the message naming the node."""
    from runtime.executor import Executor

    graph = _quantized()
    Executor(graph, _weight_only_tensors(graph, perm=torch.randperm(HIDDEN).to(torch.int32)))  # a permutation
    graph = _quantized()
    params = _weight_only_tensors(graph, perm=torch.tensor(perm, dtype=torch.int32))
    check_graph(graph)  # its shape and dtype are right
    with pytest.raises(GraphFormatError, match=rf"^node 1 \(linear, from model\.q\): {says}"):
        Executor(graph, params)


@pytest.mark.parametrize("scale, says", [
    ([1.0] * 7 + [float("nan")], r"its pre_quant_scale holds nan \(input feature 7\); expected finite scales"),
    ([float("inf")] + [1.0] * 7, r"its pre_quant_scale holds inf \(input feature 0\); expected finite scales"),
    ([0.0] * 8, r"every one of its 8 pre_quant_scale values is 0, which zeroes the linear's whole input"),
])
def test_a_pre_quant_scale_that_is_not_finite_or_all_zero_is_refused_when_the_linear_is_built(scale, says):
    """x * s with an inf or nan in s makes every output of the linear inf or nan; all zeros zero its input. A few
    zeros (a dropped input channel) and negative scales (x * s with the columns made for it is exact) still load."""
    from runtime.executor import Executor

    graph = _quantized()
    Executor(graph, _weight_only_tensors(graph, scale=torch.tensor([0.5, -2.0, 0.0, 1.0, 3.0, 1.0, 1.0, 0.25])))
    graph = _quantized()
    params = _weight_only_tensors(graph, scale=torch.tensor(scale))
    check_graph(graph)
    with pytest.raises(GraphFormatError, match=rf"^node 1 \(linear, from model\.q\): {says}"):
        Executor(graph, params)


EXPERTS, INTER = 4, 4


def _moe(scheme: str | None = None, group_size: int = 4, block: list[int] | None = None, tp_size: int = 1) -> dict:
    """_graph() with a moe node [HIDDEN -> HIDDEN] of EXPERTS experts between the embedding and the lm_head, its
    tensors as the passes stack them (passes/ir.py, passes/fp8.py, passes/moe_int4.py): the router [E, hidden],
    w_gate_up [E, 2 * I, hidden] and w_down [E, hidden, I] (w4a16: 4-bit codes two a byte, fp32 scales and uint8
    zeros [E, out, in / group_size]; fp8: e4m3 codes, scales [E, out]; fp8_block: scales [E, ceil(out / bn), ceil(in
    / bk)])."""
    graph = _graph()
    if tp_size > 1:
        graph["meta"]["tensor_parallel"] = {"tp_size": tp_size, "vocab_parallel": False}
    inter = INTER // tp_size
    codes = {None: "float32", "fp8": "float8_e4m3fn", "fp8_block": "float8_e4m3fn", "w4a16": "uint8"}[scheme]
    packed = 2 if scheme == "w4a16" else 1
    params = {"router": [EXPERTS, HIDDEN], "gate_up": [EXPERTS, 2 * inter, HIDDEN // packed],
              "down": [EXPERTS, HIDDEN, inter // packed]}
    weights = {"gate_weight": "router", "w_gate_up": "gate_up", "w_down": "down"}
    attrs = {"num_experts": EXPERTS, "top_k": 2, "scoring": "softmax", "norm_topk_prob": True, "activation": "silu",
             "intermediate_size": inter}
    if scheme == "fp8":
        params.update({"gate_up.scale": [EXPERTS, 2 * inter], "down.scale": [EXPERTS, HIDDEN]})
        weights.update(w_gate_up_scale="gate_up.scale", w_down_scale="down.scale")
        attrs["quant"] = {"scheme": "fp8", "activations": "dynamic", "weight_granularity": "channel"}
    if scheme == "fp8_block":
        bn, bk = block
        params.update({"gate_up.scale": [EXPERTS, -(-2 * inter // bn), -(-HIDDEN // bk)],
                       "down.scale": [EXPERTS, -(-HIDDEN // bn), -(-inter // bk)]})
        weights.update(w_gate_up_scale="gate_up.scale", w_down_scale="down.scale")
        attrs["quant"] = {"scheme": "fp8_block", "block_size": block}
    if scheme == "w4a16":
        groups = {"gate_up": 1 if group_size == -1 else HIDDEN // group_size,
                  "down": 1 if group_size == -1 else inter // group_size}
        for role, rows in (("gate_up", 2 * inter), ("down", HIDDEN)):
            params.update({f"{role}.scales": [EXPERTS, rows, groups[role]], f"{role}.zeros": [EXPERTS, rows,
                                                                                             groups[role]]})
            weights.update({f"w_{role}_scales": f"{role}.scales", f"w_{role}_zeros": f"{role}.zeros"})
        attrs["quant"] = {"scheme": "w4a16", "bits": 4, "group_size": group_size, "symmetric": False}
    for name, shape in params.items():
        dtype = codes if name in ("gate_up", "down") else "uint8" if name.endswith(".zeros") else "float32"
        graph["params"][name] = {"shape": shape, "dtype": dtype}
    graph["nodes"].insert(1, {"op": "moe", "inputs": ["h"], "outputs": ["hm"], "source": "model.layers.0.mlp",
                              "weights": weights, "attrs": attrs})
    graph["nodes"][2]["inputs"] = ["hm"]
    return graph


def test_the_crafted_moe_graphs_pass():
    for tp_size in (1, 2):
        check_graph(_moe(None, tp_size=tp_size))
        check_graph(_moe("fp8", tp_size=tp_size))
        check_graph(_moe("w4a16", -1, tp_size=tp_size))
        check_graph(_moe("w4a16", 2, tp_size=tp_size))
        check_graph(_moe("fp8_block", block=[2, 2], tp_size=tp_size))
    check_graph(_moe("w4a16", 4))
    for block in ([4, 4], [3, 8], [128, 128]):  # partial last blocks have scales of their own
        check_graph(_moe("fp8_block", block=block))


def _moe_set(path: str, value):
    """Set a quant attr (``quant.group_size``), a node attr (``attrs.intermediate_size``), a param's shape
    (``down.scale``) or its dtype (``down:dtype``)."""
    def change(graph: dict) -> None:
        node = graph["nodes"][1]
        kind, key = path.split(".", 1) if "." in path else (path, "")
        if kind == "quant":
            node["attrs"]["quant"][key] = value
        elif kind == "attrs":
            node["attrs"][key] = value
        elif path.endswith(":dtype"):
            graph["params"][path.removesuffix(":dtype")]["dtype"] = value
        else:
            graph["params"][path]["shape"] = value
    return change


@pytest.mark.parametrize("make, change, says", [
    # the stacked experts against each other and the router: a matmul's RuntimeError at the first request
    (lambda: _moe(None), _moe_set("gate_up", [4, 6, 8]),
     r"its w_gate_up is \[4, 6, 8\]; with gate_weight \[4, 8\] \(4 experts, hidden 8\) and w_down \[4, 8, 4\] "
     r"\(intermediate 4\), the experts' gate and up rows are \[4, 8, 8\]"),
    (lambda: _moe(None), _moe_set("down", [4, 6, 4]),
     r"its w_down is \[4, 6, 4\]; with gate_weight \[4, 8\] \(4 experts, hidden 8\), the experts' down "
     r"projections are \[4, 8, 4\]"),
    (lambda: _moe(None), _moe_set("down", [3, 8, 4]), r"its w_down is \[3, 8, 4\]; .* are \[4, 8, 4\]"),
    (lambda: _moe(None), _moe_set("attrs.num_experts", 8),
     r"its gate_weight \[4, 8\] routes to 4 experts; attr num_experts is 8"),
    (lambda: _moe(None), _moe_set("attrs.intermediate_size", 6),
     r"its w_down \[4, 8, 4\] holds 4 intermediate features an expert; attr intermediate_size is 6"),
    (lambda: _moe(None), _moe_set("down", [4, 8]), r"its w_down is \[4, 8\] in the graph's params; a moe's w_down "
                                                   r"is 3-D"),
    # scales where no scheme reads them, or of another scheme: never applied (garbage) or a KeyError
    (lambda: _moe(None), lambda g: g["nodes"][1]["weights"].update(w_down_scale="router"),
     r"it carries w_down_scale, which unquantized experts do not read \(allowed: none\)"),
    (lambda: _moe("w4a16"), lambda g: g["nodes"][1]["weights"].update(w_down_scale="router"),
     r"it carries w_down_scale, which quant scheme w4a16 experts do not read \(allowed: w_gate_up_scales, "
     r"w_gate_up_zeros, w_down_scales, w_down_zeros\)"),
    (lambda: _moe("fp8"), lambda g: g["nodes"][1]["weights"].pop("w_down_scale"),
     r"it has no w_down_scale; quant scheme fp8 experts read w_gate_up_scale, w_down_scale"),
    (lambda: _moe("fp8"), _moe_set("quant.scheme", "w8a8_int8"),
     r"quant scheme is 'w8a8_int8'; allowed for a moe's experts: fp8, fp8_block, w4a16"),
    # FP8 experts: e4m3 codes, one scale per expert and output row, inputs per token
    (lambda: _moe("fp8"), _moe_set("down:dtype", "bfloat16"),
     r"its w_down is bfloat16; quant scheme fp8 experts store float8_e4m3fn codes \(allowed: float8_e4m3fn\)"),
    (lambda: _moe("fp8"), _moe_set("down.scale", [4, 1]),
     r"its w_down_scale is \[4, 1\]; quant scheme fp8 over w_down \[4, 8, 4\] gives \[4, 8\]: one scale per expert "
     r"and output row"),
    (lambda: _moe("fp8"), _moe_set("gate_up.scale", [4, 4]), r"its w_gate_up_scale is \[4, 4\]; .* gives \[4, 8\]"),
    (lambda: _moe("fp8"), _moe_set("quant.weight_granularity", "tensor"),
     r"quant weight_granularity is 'tensor'; fp8 experts scale each output row \(allowed: channel\)"),
    (lambda: _moe("fp8"), _moe_set("quant.activations", "static"),
     r"quant activations is 'static'; fp8 experts quantize their inputs per token \(allowed: dynamic\)"),
    # block-FP8 experts: one scale per block of each expert's codes
    (lambda: _moe("fp8_block", block=[2, 2]), _moe_set("down.scale", [4, 4, 4]),
     r"its w_down_scale is \[4, 4, 4\]; quant block_size \[2, 2\] over w_down \[4, 8, 4\] gives \[4, 4, 2\]: one "
     r"scale per expert and \[2, 2\] block"),
    (lambda: _moe("fp8_block", block=[2, 2]), _moe_set("quant.block_size", [4, 2]),
     r"its w_gate_up_scale is \[4, 4, 4\]; quant block_size \[4, 2\] over w_gate_up \[4, 8, 8\] gives \[4, 2, 4\]"),
    (lambda: _moe("fp8_block", block=[2, 2]), _moe_set("quant.block_size", [2]),
     r"quant block_size is \[2\]; allowed: \[rows, columns\], whole numbers in 1\.\.65536"),
    # W4A16 experts: packed codes, group scales and zero points
    (lambda: _moe("w4a16"), _moe_set("down:dtype", "int8"),
     r"its w_down is int8; quant scheme w4a16 experts store uint8 codes"),
    (lambda: _moe("w4a16"), _moe_set("gate_up.scales:dtype", "float16"),
     r"its w_gate_up_scales is float16; quant scheme w4a16 experts store float32 scales \(allowed: float32\)"),
    (lambda: _moe("w4a16"), _moe_set("down.scales:dtype", "bfloat16"),
     r"its w_down_scales is bfloat16; quant scheme w4a16 experts store float32 scales \(allowed: float32\)"),
    (lambda: _moe("w4a16"), _moe_set("gate_up.zeros:dtype", "int8"),
     r"its w_gate_up_zeros is int8; quant scheme w4a16 experts store uint8 zero points \(allowed: uint8\)"),
    (lambda: _moe("w4a16"), _moe_set("down.zeros:dtype", "int32"),
     r"its w_down_zeros is int32; quant scheme w4a16 experts store uint8 zero points \(allowed: uint8\)"),
    (lambda: _moe("w4a16"), _moe_set("down.zeros:dtype", "float32"),
     r"its w_down_zeros is float32; quant scheme w4a16 experts store uint8 zero points \(allowed: uint8\)"),
    (lambda: _moe("w4a16", 4), _moe_set("quant.group_size", 2),
     r"its w_gate_up_scales is \[4, 8, 2\]; quant group_size 2 over w_gate_up \[4, 8, 4\] \(8 input features\) "
     r"gives \[4, 8, 4\]: one per expert, output row and group"),
    (lambda: _moe("w4a16", 4), _moe_set("down.zeros", [4, 8, 2]),
     r"its w_down_zeros is \[4, 8, 2\]; quant group_size 4 over w_down \[4, 8, 2\] \(4 input features\) gives "
     r"\[4, 8, 1\]"),
    (lambda: _moe("w4a16", 4), _moe_set("quant.group_size", 3),
     r"quant group_size 3 does not divide the experts' 8 input features of w_gate_up"),
    (lambda: _moe("w4a16", 4), _moe_set("quant.group_size", 0),
     r"quant group_size is 0; allowed: -1 \(one group a row\) or a whole number in 1\.\.16777216"),
    (lambda: _moe("w4a16", 4), _moe_set("quant.bits", 8), r"quant bits is 8; w4a16 experts store 4-bit codes "
                                                          r"\(allowed: 4\)"),
    # sharded: a rank's share of the intermediate features; the scales still answer to its codes
    (lambda: _moe("fp8", tp_size=2), _moe_set("gate_up.scale", [4, 8]), r"its w_gate_up_scale is \[4, 8\]; .* "
                                                                        r"gives \[4, 4\]"),
])
def test_moe_quant_attrs_that_disagree_with_their_tensors_are_refused(make, change, says):
    """Stacked experts (float, FP8, block-FP8, W4A16): each message names the node, the attr and the shapes. Before,
    each of these loaded; the moe op met them at the first request (a RuntimeError) or computed garbage."""
    graph = make()
    change(graph)
    with pytest.raises(GraphFormatError, match=rf"^node 1 \(moe, from model\.layers\.0\.mlp\): {says}"):
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
