"""`lm_head: true`: every quantization method quantizes the lm_head like a linear, checked against the
Hugging Face model (logits, and the final hidden states times the dequantized lm_head), on a tied
(llama) and an untied (qwen2) checkpoint; off by default; vocab-parallel shards of a quantized lm_head."""

from __future__ import annotations

import logging

import pytest
import torch

from builder.checkpoint import attach_weights, open_checkpoint
from kernels.torch_quant import dequantize_weight
from passes import PassContext, PassError, run_passes
from passes.ir import QUANT_SCHEMES, Graph, Node
from passes.trace import trace
from passes.verify import run_graph
from runtime.manifest import QUANT_WEIGHTS

FUSED = ["merge_qkv", "merge_gate_up", "fuse_silu_mul", "fuse_add_rms_norm", "dce"]
ONLY_LM_HEAD = ["re:."]  # an ignore pattern every linear matches: the section quantizes the lm_head alone

# algo -> (options, scheme, bounds on the relative logit error against Hugging Face: the lm_head alone
# quantized, the whole model). Measured on these checkpoints: lm_head alone int8 ~0.6-1%, fp8 ~3.7% (3 mantissa
# bits), int4 in groups of 16 ~7-8%; whole model int8_wo 2.0%, smoothquant 2.7%, fp8 10.6%, awq / gptq 20-21%.
METHODS = {
    "awq": ({"group_size": 16}, "w4a16", 0.12, 0.3),
    "gptq": ({"group_size": 16}, "w4a16", 0.12, 0.3),
    "int8_wo": ({}, "w8a16", 0.02, 0.03),
    "fp8": ({}, "fp8", 0.06, 0.15),
    "smoothquant": ({}, "w8a8_int8", 0.02, 0.04),
}


class Family:
    """One checkpoint's fused graph and its Hugging Face reference on random prompts."""

    def __init__(self, path) -> None:
        from transformers import AutoModelForCausalLM

        ckpt = open_checkpoint(path)
        graph, meta_model = trace(ckpt.hf_config())
        attach_weights(graph, ckpt, meta_model, torch.float32)
        self.graph, _ = run_passes(graph, FUSED, PassContext())
        g = torch.Generator().manual_seed(0)
        self.calibration = [torch.randint(3, 300, (32,), generator=g).tolist() for _ in range(6)]
        self.prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (40, 17)]
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
        with torch.no_grad():  # hidden: the final norm's output, what the lm_head reads
            outs = [model(torch.tensor([ids])) for ids in self.prompts]
            self.logits = [o.logits[0] for o in outs]
            self.hidden = [model.model(torch.tensor([ids])).last_hidden_state[0] for ids in self.prompts]
        self.tied = model.config.tie_word_embeddings

    def quantize(self, algo: str, **options) -> tuple[Graph, dict]:
        ctx = PassContext(calibration=self.calibration, options={algo: options})
        graph, records = run_passes(self.graph.copy(), [algo, "dce"], ctx)
        return graph, records[0]

    def rel_err(self, graph: Graph) -> float:
        return max(((ours - ref).norm() / ref.norm()).item() for ours, ref in zip(run_graph(graph, self.prompts),
                                                                                   self.logits))


@pytest.fixture(scope="module")
def families(checkpoints) -> dict[str, Family]:
    return {f: Family(checkpoints[f]) for f in ("llama", "qwen2")}


def _node(graph: Graph, op: str) -> Node:
    return next(n for n in graph.nodes if n.op == op)


def _final_norm(graph: Graph) -> Node:
    return graph.producers()[_node(graph, "lm_head").inputs[0]]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("algo", sorted(METHODS))
def test_lm_head_alone_quantized_like_a_linear(families, family, algo):
    fam = families[family]
    options, scheme, bound, _ = METHODS[algo]
    graph, record = fam.quantize(algo, **options, lm_head=True, ignore=ONLY_LM_HEAD)
    head = _node(graph, "lm_head")
    assert record.matched == 1 and record.details["num_linears"] == 0 and record.details["lm_head"]
    assert not any("quant" in n.attrs for n in graph.nodes if n.op == "linear")
    assert head.attrs["quant"]["scheme"] == scheme and set(head.weights) >= set(QUANT_SCHEMES[scheme])
    assert "weight" not in head.weights and (head.attrs["out_features"], head.attrs["in_features"]) == (
        fam.graph.meta["vocab_size"], fam.graph.meta["hidden_size"])
    assert "lm_head" in record.details["layer_errors"]  # measured on the calibration windows
    err = fam.rel_err(graph)
    assert 1e-3 < err < bound, f"{algo} on {family}: relative logit error {err:.4f} (bound {bound})"

    norm_before, norm_after = (g.params[_final_norm(g).weights["weight"]] for g in (fam.graph, graph))
    if algo in ("awq", "smoothquant"):  # the scales went into the final norm's gain
        assert not torch.equal(norm_before, norm_after)
        assert algo == "awq" or head.attrs["quant"]["smoothed"]
    else:
        assert torch.equal(norm_before, norm_after)
    if scheme in ("w4a16", "w8a16"):  # what the runtime computes is the HF hidden state times the stored weight
        q = head.attrs["quant"]
        w = dequantize_weight(*(graph.params[head.weights[r]] for r in ("qweight", "scales", "zeros")),
                              q["bits"], q["group_size"], torch.float32)
        for h, ours in zip(fam.hidden, run_graph(graph, fam.prompts)):
            expected = (h * (norm_after / norm_before)) @ w.T
            assert torch.allclose(ours, expected, rtol=1e-4, atol=1e-4 * expected.abs().max())


@pytest.mark.parametrize("algo", sorted(METHODS))
def test_default_leaves_the_lm_head_and_option_adds_it(families, algo):
    fam = families["qwen2"]
    options, scheme, _, bound = METHODS[algo]
    off, rec_off = fam.quantize(algo, **options)
    on, rec_on = fam.quantize(algo, **options, lm_head=True)
    head_before, head_off = _node(fam.graph, "lm_head"), _node(off, "lm_head")
    assert "quant" not in head_off.attrs and head_off.weights == head_before.weights
    assert off.params[head_off.weights["weight"]] is fam.graph.params[head_before.weights["weight"]]
    assert rec_off.matched == 8 and "lm_head" not in rec_off.details
    assert rec_on.matched == 9 and rec_on.details["num_linears"] == 8 and _node(on, "lm_head").attrs["quant"]
    # the whole model quantized, lm_head included, against Hugging Face: linears and lm_head errors add up
    err_off, err_on = fam.rel_err(off), fam.rel_err(on)
    assert 0 < err_on < bound and err_on != err_off, (err_off, err_on)


@pytest.mark.parametrize("algo", ["gptq", "smoothquant"])
def test_tied_embedding_is_untied(families, algo):
    fam = families["llama"]
    assert fam.tied
    emb_before, head_before = _node(fam.graph, "embedding"), _node(fam.graph, "lm_head")
    assert emb_before.weights["weight"] == head_before.weights["weight"]  # one tensor, two readers
    table = fam.graph.params[emb_before.weights["weight"]]
    graph, _ = fam.quantize(algo, **METHODS[algo][0], lm_head=True)
    emb, head = _node(graph, "embedding"), _node(graph, "lm_head")
    assert emb.weights["weight"] == "model.embed_tokens.weight" and "weight" not in head.weights
    assert graph.params[emb.weights["weight"]] is table  # the embedding keeps the float table, unchanged
    assert graph.params[head.weights["qweight"]].shape[0] == table.shape[0]
    assert not any(t is table for name, t in graph.params.items() if name != emb.weights["weight"])
    # off: still one tensor read by both
    off, _ = fam.quantize(algo, **METHODS[algo][0])
    assert _node(off, "embedding").weights["weight"] == _node(off, "lm_head").weights["weight"]


@pytest.mark.parametrize("algo", ["awq", "smoothquant"])
def test_no_norm_to_absorb_the_scales_falls_back_with_a_warning(families, algo, caplog):
    """A node between the final norm and the lm_head (here x * 1): nothing can take AWQ's or SmoothQuant's
    inverse scales, so the lm_head is quantized without them, and the build log says so."""
    fam = families["qwen2"]
    base = fam.graph.copy()
    head = _node(base, "lm_head")
    base.nodes.insert(base.nodes.index(head), Node("elementwise", [head.inputs[0]], ["unscaled"], attrs={
        "fn": "scale", "value": 1.0}))
    head.inputs = ["unscaled"]
    base.check()
    ctx = PassContext(calibration=fam.calibration, options={algo: {**METHODS[algo][0], "lm_head": True,
                                                                   "ignore": ONLY_LM_HEAD}})
    with caplog.at_level(logging.WARNING):
        graph, _ = run_passes(base, [algo, "dce"], ctx)
    assert any("lm_head" in r.getMessage() and "no norm that can absorb" in r.getMessage() for r in caplog.records)
    assert torch.equal(graph.params[_final_norm(fam.graph).weights["weight"]],
                       fam.graph.params[_final_norm(fam.graph).weights["weight"]])
    head = _node(graph, "lm_head")
    assert head.attrs["quant"]["scheme"] == METHODS[algo][1] and head.attrs["quant"].get("smoothed") in (None, False)
    assert 1e-3 < fam.rel_err(graph) < METHODS[algo][2]


def test_lm_head_errors(families):
    fam = families["qwen2"]
    ctx = PassContext(calibration=fam.calibration, options={"int8_wo": {"lm_head": True}, "fp8": {"lm_head": True}})
    with pytest.raises(PassError, match="sets lm_head: true but an earlier section already quantized the lm_head"):
        run_passes(fam.graph.copy(), ["int8_wo", "fp8"], ctx)
    ctx = PassContext(calibration=fam.calibration, options={"gptq": {"group_size": 48, "lm_head": True,
                                                                     "ignore": ONLY_LM_HEAD}})
    with pytest.raises(PassError, match="gptq: lm_head has in_features 64, not divisible by group_size 48"):
        run_passes(fam.graph.copy(), ["gptq"], ctx)


def test_runtime_knows_every_scheme_the_passes_write():
    assert QUANT_WEIGHTS == QUANT_SCHEMES


@pytest.mark.parametrize("algo,options", [("awq", {"group_size": 16}),
                                          ("fp8", {"activations": "static"}),  # per-tensor weight and input scales
                                          ("smoothquant", {})])  # per-row weight scales, per-token activations
def test_vocab_parallel_splits_a_quantized_lm_head(families, algo, options, monkeypatch):
    from test_shard import _logits, _shard, run_ranks

    from runtime.executor import Executor

    fam = families["qwen2"]
    # the lm_head alone: quantized row-parallel linears would differ across ranks by their own rounding
    graph, _ = fam.quantize(algo, **options, lm_head=True, ignore=ONLY_LM_HEAD)
    refs = _logits(Executor(graph.to_dict(), graph.params), fam.prompts)
    sharded, _ = _shard(graph, 2, vocab_parallel=True)
    head = _node(sharded, "lm_head")
    vocab = fam.graph.meta["vocab_size"]
    assert head.attrs["out_features"] == vocab // 2  # per rank, as a column-split linear's
    for role, name in head.weights.items():
        full = sharded.shards.full[name]
        for r in range(2):
            local = sharded.shards.tensor(name, r).view(torch.uint8)  # bytes: float8 has no torch.equal
            if full.shape[0] == vocab:  # codes, per-row scales and zeros: this rank's rows
                assert torch.equal(local, full[r * vocab // 2:(r + 1) * vocab // 2].view(torch.uint8)), role
            else:  # per-tensor weight / input scale: whole on every rank
                assert full.numel() == 1 and torch.equal(local, full.view(torch.uint8)), role
    for rank_logits in run_ranks(sharded, fam.prompts, monkeypatch):
        for ours, ref in zip(rank_logits, refs):  # every rank sees the whole row: exact up to fp32 rounding
            assert (ours - ref).abs().max().item() < 1e-4
