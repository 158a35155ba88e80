"""W4A16 experts (passes/moe_int4.py): the awq and gptq methods quantize a mixture of experts' experts to 4-bit codes
in groups, each expert on the calibration tokens routed to it, and name the experts no token reached.

The model is a tiny random Qwen3-MoE (fp32, 2 layers, hidden 64, 8 experts of intermediate 64, top-2) saved with
transformers' ``save_pretrained`` and built by ``builder build``'s own path; its artifact runs on the CPU (the torch
reference of the moe op) against the Hugging Face model's logits."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from test_families import Family, make_family_checkpoint

NUM_EXPERTS, TOP_K, HIDDEN, INTER = 8, 2, 64, 64
QWEN3_MOE = Family("Qwen3-MoE", "qwen3_moe", dict(head_dim=16, num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K,
                                                  moe_intermediate_size=INTER))
CALIBRATION = {"num_samples": 16, "seq_len": 64, "dataset": "bundled"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    from conftest import save_tokenizer

    root = tmp_path_factory.mktemp("moe_int4")
    save_tokenizer(root / "tokenizer")
    model = make_family_checkpoint(root / "ckpt", QWEN3_MOE, root / "tokenizer")
    return root / "ckpt", model


@pytest.fixture(scope="module")
def float_graph(checkpoint, tmp_path_factory):
    """The float build's graph (and params), for the passes run directly."""
    from conftest import build_artifact
    from passes.ir import Graph
    from safetensors.torch import load_file

    artifact = build_artifact(checkpoint[0], tmp_path_factory.mktemp("moe_int4_float") / "artifact")
    return Graph.from_dict(json.loads((artifact / "graph.json").read_text()),
                           load_file(artifact / "weights.safetensors"))


def _build(checkpoint: Path, out: Path, quantization: dict) -> Path:
    from builder.pipeline import build
    from builder.recipe import validate_recipe

    recipe = validate_recipe({
        "name": out.name, "model": {"checkpoint": str(checkpoint), "dtype": "float32"}, "output_dir": str(out),
        "runtime": {"max_seq_len": 256, "max_num_tokens": 64}, "quantization": quantization,
        "calibration": CALIBRATION, "gates": {"enabled": False}})
    return build(recipe).output_dir


# experts only (targets name the moe layers): the error measured is the experts'. Round to nearest, int4 g32 on these
# random experts, is 8.5% of the logits' norm off the float model (g64 symmetric: ~10%); the calibrated methods land
# near it (7.8-8.9% at g32). 15% allows for the methods' spread; experts read without their scales (each code times 1)
# or with another expert's codes are O(1) off
@pytest.mark.parametrize("quantization", [
    {"algo": "awq", "group_size": 32, "targets": ["re:mlp$"]},
    {"algo": "gptq", "group_size": 64, "symmetric": True, "targets": ["re:mlp$"]},
], ids=["awq-g32-asym", "gptq-g64-sym"])
def test_int4_experts_artifact_matches_hf(checkpoint, tmp_path, quantization):
    from runtime import Engine, SamplingParams
    from safetensors.torch import load_file

    path, model = checkpoint
    artifact = _build(path, tmp_path / "artifact", quantization)
    graph = json.loads((artifact / "graph.json").read_text())
    weights = load_file(artifact / "weights.safetensors")
    moes = [n for n in graph["nodes"] if n["op"] == "moe"]
    assert len(moes) == 2
    g = quantization["group_size"]
    for node in moes:
        assert node["attrs"]["quant"] == {"scheme": "w4a16", "bits": 4, "group_size": g,
                                          "symmetric": quantization.get("symmetric", False)}
        w = {role: weights[name] for role, name in node["weights"].items()}
        assert w["w_gate_up"].dtype == torch.uint8 and w["w_gate_up"].shape == (NUM_EXPERTS, 2 * INTER, HIDDEN // 2)
        assert w["w_down"].dtype == torch.uint8 and w["w_down"].shape == (NUM_EXPERTS, HIDDEN, INTER // 2)
        assert w["w_gate_up_scales"].dtype == torch.float32 and w["w_gate_up_scales"].shape == (NUM_EXPERTS, 2 * INTER,
                                                                                                HIDDEN // g)
        assert w["w_down_zeros"].dtype == torch.uint8 and w["w_down_zeros"].shape == (NUM_EXPERTS, HIDDEN, INTER // g)
        assert w["gate_weight"].dtype == torch.float32  # the router stays float
        if quantization.get("symmetric"):
            assert (w["w_gate_up_zeros"] == 8).all() and (w["w_down_zeros"] == 8).all()
    assert not any(n["attrs"].get("quant") for n in graph["nodes"] if n["op"] == "linear")

    manifest = json.loads((artifact / "manifest.json").read_text())
    record = next(r for r in manifest["build"]["passes"] if r["name"] == quantization["algo"])
    details = record["details"]
    assert details["moe_layers_quantized"] == 2
    tokens = details["expert_tokens"]
    assert sorted(tokens) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    for counts in tokens.values():  # every calibration token's top-2 slots, counted once per expert
        assert len(counts) == NUM_EXPERTS and sum(counts) == TOP_K * CALIBRATION["num_samples"] * CALIBRATION["seq_len"]
    assert "experts_without_tokens" not in details  # 1024 tokens reach all 8 experts

    engine = Engine.load(artifact)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, model.config.vocab_size, (48,), generator=gen).tolist()
    with torch.no_grad():
        expected = model(torch.tensor([ids]), use_cache=False).logits[0]
    got = engine.logits(ids)
    err = ((got - expected).norm() / expected.norm()).item()
    assert err < 0.15, f"W4A16 experts: logits {err:.3f} (relative, norm) off the HF model's"
    assert err > 1e-3  # the experts are quantized: not the float model
    agree = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert agree >= 0.75, f"top-1 agreement with HF {agree:.2f}"
    prompt = ids[:8]
    out = engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)).token_ids
    assert len(out) == 8


def _logits(graph, ids: torch.Tensor) -> torch.Tensor:
    from runtime.executor import Executor, SeqSlice, StepInput
    from runtime.kv_cache import SequenceKV

    executor = Executor(graph.to_dict(), graph.params)
    kv = SequenceKV(executor.kv_layout(), len(ids))
    return executor.forward(StepInput(ids, torch.arange(len(ids)), [SeqSlice(kv, 0, len(ids))])).float()


@pytest.mark.parametrize("algo", ["gptq", "awq"])
def test_experts_no_calibration_token_reached_are_named(float_graph, algo, caplog):
    """One calibration token reaches 2 experts per layer: the other 6 are rounded to nearest and named (log and
    report); the 2 it reached are calibrated on it (their codes are not round-to-nearest's)."""
    from passes import PassContext, run_passes
    from passes.moe_int4 import rtn_experts
    from passes.quant_math import QuantConfig

    options = {algo: {"group_size": 32, "targets": ["re:mlp$"]}}
    with caplog.at_level(logging.WARNING):
        quantized, records = run_passes(float_graph.copy(), [algo], PassContext(options=options, calibration=[[17]]))
    details = records[0].details
    unseen = {src: [e for e, c in enumerate(counts) if c == 0] for src, counts in details["expert_tokens"].items()}
    assert all(sum(c) == TOP_K and len(unseen[src]) == NUM_EXPERTS - TOP_K
               for src, c in details["expert_tokens"].items())
    named = (f"layer 0 experts {unseen['model.layers.0.mlp']}; layer 1 experts {unseen['model.layers.1.mlp']}")
    assert details["experts_without_tokens"] == named
    assert f"experts that saw no calibration tokens: {named}" in caplog.text

    rtn = float_graph.copy()
    for node in rtn.nodes:
        if node.op == "moe":
            rtn_experts(rtn, node, QuantConfig(4, 32, False))
    from builder.quality import rtn_counterpart

    gates_rtn, why = rtn_counterpart(float_graph, quantized)  # the quality gates' baseline: the same rounding
    assert gates_rtn is not None, why
    for a, b in zip((n for n in gates_rtn.nodes if n.op == "moe"), (n for n in rtn.nodes if n.op == "moe")):
        assert a.attrs["quant"] == b.attrs["quant"]
        assert all(torch.equal(gates_rtn.params[a.weights[r]], rtn.params[b.weights[r]]) for r in b.weights)
    for node, ref in zip((n for n in quantized.nodes if n.op == "moe"), (n for n in rtn.nodes if n.op == "moe")):
        codes, rtn_codes = quantized.params[node.weights["w_gate_up"]], rtn.params[ref.weights["w_gate_up"]]
        scales, rtn_scales = (quantized.params[node.weights["w_gate_up_scales"]],
                              rtn.params[ref.weights["w_gate_up_scales"]])
        for e in range(NUM_EXPERTS):
            same = torch.equal(codes[e], rtn_codes[e]) and torch.equal(scales[e], rtn_scales[e])
            assert same == (e in unseen[node.source]), (node.source, e)


def test_int4_expert_bytes_and_errors(float_graph):
    """A group size that does not tile the experts' inputs, and experts: true with gptq's 8 bits, are errors naming
    what to change; a broken w4a16 node (a role missing, no group_size) fails the graph check; the executor runs
    the int4 experts as their dequantized weights would run."""
    from passes import PassContext, run_passes
    from passes.base import PassError
    from passes.ir import GraphError
    from passes.moe_int4 import rtn_experts
    from passes.quant_math import QuantConfig
    from kernels.torch_quant import dequantize_experts_int4

    with pytest.raises(PassError, match=r"awq: the experts of model\.layers\.0\.mlp read inputs of 64 features .*"
                                        r"group_size 48"):
        run_passes(float_graph.copy(), ["awq"], PassContext(options={"awq": {"group_size": 48, "targets": ["re:mlp$"]}},
                                                             calibration=[[5, 6]]))
    with pytest.raises(PassError, match=r"group_size 16 does not fit them: 4-bit experts take a group size that "
                                        r"divides it and is a multiple of 32 .*; use 64, 32, -1 \(per channel\)"):
        run_passes(float_graph.copy(), ["awq"], PassContext(options={"awq": {"group_size": 16, "targets": ["re:mlp$"]}},
                                                             calibration=[[5, 6]]))
    with pytest.raises(PassError, match="experts: true needs bits 4"):
        run_passes(float_graph.copy(), ["gptq"], PassContext(options={"gptq": {"bits": 8, "experts": True}},
                                                              calibration=[[5, 6]]))

    graph = float_graph.copy()
    ids = torch.randint(3, 300, (20,), generator=torch.Generator().manual_seed(2))
    for node in graph.nodes:
        if node.op == "moe":
            rtn_experts(graph, node, QuantConfig(4, 16, True))
    graph.check()
    dequantized = graph.copy()  # the same experts as float weights: the artifact's meaning
    for node in dequantized.nodes:
        if node.op == "moe":
            for role in ("w_gate_up", "w_down"):
                w = dequantize_experts_int4(*(graph.params[node.weights[r]] for r in (role, f"{role}_scales",
                                                                                       f"{role}_zeros")), 16,
                                            torch.float32)
                dequantized.params[node.weights[role] + ".float"] = w
                node.weights[role] = node.weights[role] + ".float"
                del node.weights[f"{role}_scales"], node.weights[f"{role}_zeros"]
            del node.attrs["quant"]
    torch.testing.assert_close(_logits(graph, ids), _logits(dequantized, ids), rtol=0, atol=0)

    broken = graph.copy()
    node = next(n for n in broken.nodes if n.op == "moe")
    node.weights.pop("w_down_zeros")
    with pytest.raises(GraphError, match=r"a moe with quant scheme w4a16 carries exactly the weights"):
        broken.check()
    broken = graph.copy()
    next(n for n in broken.nodes if n.op == "moe").attrs["quant"].pop("group_size")
    with pytest.raises(GraphError, match="w4a16 experts need quant bits 4 and an integer group_size"):
        broken.check()


def test_int4_experts_shard_over_ranks(float_graph, monkeypatch):
    """Two ranks: each holds its half of every expert's intermediate features, codes, scales and zero points cut with
    their rows (gate / up) and their groups (down: codes two a byte, groups of 16); both ranks' summed outputs are the
    one-rank model's (exact up to the all-reduce's fp32 sum). A share that would cut a group is an error."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_shard import run_ranks

    from passes import PassContext, run_passes
    from passes.base import PassError
    from passes.moe_int4 import rtn_experts
    from passes.quant_math import QuantConfig
    from passes.verify import run_graph

    graph = float_graph.copy()
    for node in graph.nodes:
        if node.op == "moe":
            rtn_experts(graph, node, QuantConfig(4, 16, False))
    sharded, _ = run_passes(graph.copy(), ["shard"], PassContext(options={"shard": {"tp_size": 2}}))
    moe = next(n for n in sharded.nodes if n.op == "moe")
    full = next(n for n in graph.nodes if n.op == "moe")
    half = INTER // 2

    def rank1(role: str) -> torch.Tensor:
        return sharded.shards.tensor(moe.weights[role], 1)

    for role in ("w_gate_up", "w_gate_up_scales", "w_gate_up_zeros"):
        t = graph.params[full.weights[role]]
        assert torch.equal(rank1(role), torch.cat((t[:, half:INTER], t[:, INTER + half:]), dim=1)), role
    assert torch.equal(rank1("w_down"), graph.params[full.weights["w_down"]][:, :, half // 2:])
    for role in ("w_down_scales", "w_down_zeros"):
        assert torch.equal(rank1(role), graph.params[full.weights[role]][:, :, half // 16:]), role
    prompts = [torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 19)]
    expected = run_graph(graph, prompts)
    for rank_logits in run_ranks(sharded, prompts, monkeypatch):
        for ours, ref in zip(rank_logits, expected):
            assert (ours - ref).abs().max().item() < 1e-4

    coarse = float_graph.copy()
    for node in coarse.nodes:
        if node.op == "moe":
            rtn_experts(coarse, node, QuantConfig(4, 64, False))
    with pytest.raises(PassError, match=r"w4a16 experts' down projection has groups of 64 of the 64 intermediate "
                                        r"features; tp_size 2 would cut a group"):
        run_passes(coarse, ["shard"], PassContext(options={"shard": {"tp_size": 2}}))


def test_calibration_routes_with_the_selection_bias(float_graph):
    """The experts' calibration rows are routed as the op routes them: with a selection bias (GLM-4.5's router), the
    experts it chooses, not those the scores alone would."""
    from kernels import torch_ops as ops
    from passes.moe_int4 import routed_inputs

    graph = float_graph.copy()
    node = next(n for n in graph.nodes if n.op == "moe")
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(0))
    first = ops.moe_route(x, graph.params[node.weights["gate_weight"]], None, TOP_K, node.attrs["scoring"])[1]
    bias = torch.zeros(NUM_EXPERTS)
    bias[first.unique()] = -10.0  # the experts the scores alone pick are never chosen
    graph.params["select_bias"] = bias
    node.weights["select_bias"] = "select_bias"
    seen = {e for e, *_ in routed_inputs(graph, node, x)}
    assert seen and seen.isdisjoint(first.unique().tolist())
