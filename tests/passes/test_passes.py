"""Each pass: structure before/after, what it matched, and logits against the HF model."""

from __future__ import annotations

import pytest
import torch

from conftest import FAMILIES, hf_logits
from builder.checkpoint import open_checkpoint
from builder.checkpoint import attach_weights
from passes import PASSES, PassContext, PassError, run_passes
from passes.trace import trace
from passes.verify import run_graph

PIPELINE = ["merge_qkv", "merge_gate_up", "fuse_silu_mul", "fuse_add_rms_norm", "dce"]
LAYERS = 2


def _real_graph(path):
    ckpt = open_checkpoint(path)
    graph, meta_model = trace(ckpt.hf_config())
    attach_weights(graph, ckpt, meta_model, torch.float32)
    return graph


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 7, 33)]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_hf_after_every_pass(family, checkpoints):
    path = checkpoints[family]
    graph = _real_graph(path)
    prompts = _prompts(graph.meta["vocab_size"])
    refs = [hf_logits(path, p) for p in prompts]
    for name in [None] + PIPELINE:
        if name is not None:
            graph, _ = run_passes(graph, [name], PassContext())
        for ours, ref in zip(run_graph(graph, prompts), refs):
            err = (ours - ref).abs().max().item()
            assert err < 1e-4, f"{family}: after {name or 'tracing'}, max |logit err| {err:.3g}"


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_pass_structure_and_counts(family, checkpoints):
    graph = _real_graph(checkpoints[family])
    before = graph.count_ops()
    graph, records = run_passes(graph, PIPELINE, PassContext())
    stats = {r.name: r for r in records}
    after = graph.count_ops()
    assert stats["merge_qkv"].changed == LAYERS
    assert stats["merge_gate_up"].changed == LAYERS
    assert stats["fuse_silu_mul"].changed == LAYERS
    # every norm fed by a residual add: 2 per layer except the first layer's input norm, plus the final norm
    assert stats["fuse_add_rms_norm"].changed == 2 * LAYERS
    assert after["linear"] == before["linear"] - 3 * LAYERS  # 7 -> 4 linears per layer
    assert "activation" not in after and after["silu_mul"] == LAYERS
    assert after["fused_add_rms_norm"] == 2 * LAYERS
    assert after["rms_norm"] == before["rms_norm"] - 2 * LAYERS
    assert "elementwise" not in after
    qkv = next(n for n in graph.nodes if n.op == "linear" and len(n.outputs) == 3)
    assert qkv.attrs["split_sizes"] == [64, 32, 32] if family != "qwen3" else [96, 48, 48]
    assert ("bias" in qkv.weights) == (family == "qwen2")
    # merged weights replaced the originals, which dce removed
    assert not any(k.endswith("q_proj.weight") for k in graph.params)
    assert stats["dce"].details["weights_removed"] == 5 * LAYERS + (3 * LAYERS if family == "qwen2" else 0)


def test_dce_removes_unused_nodes(checkpoints):
    from passes.ir import Node

    graph = _real_graph(checkpoints["llama"])
    norm = next(n for n in graph.nodes if n.op == "rms_norm")
    graph.nodes.insert(graph.nodes.index(norm) + 1,
                       Node("activation", [norm.outputs[0]], ["unused"], {}, {"fn": "relu"}))
    n = len(graph.nodes)
    graph, records = run_passes(graph, ["dce"], PassContext())
    assert len(graph.nodes) == n - 1 and records[0].details["nodes_removed"] == 1
    assert all(node.outputs != ["unused"] for node in graph.nodes)


def test_verify_pass_accepts_faithful_graph_and_rejects_a_wrong_one(checkpoints):
    path = checkpoints["qwen2"]
    graph = _real_graph(path)
    ctx = PassContext(reference=lambda ids: hf_logits(path, ids), verify_prompts=_prompts(320)[1:],
                      verify_atol=1e-4)
    graph, records = run_passes(graph, ["verify"], ctx)
    assert records[0].details["max_abs_logit_err"] < 1e-4
    assert records[0].details["top1_agreement"] == 1.0
    w = "model.layers.1.mlp.down_proj.weight"
    graph.params[w] = graph.params[w] + 0.05 * torch.randn_like(graph.params[w])
    with pytest.raises(PassError, match="logits differ"):
        run_passes(graph, ["verify"], ctx)


def test_verify_stops_on_logits_that_are_not_finite(checkpoints):
    """max(err, nan) is err: a NaN in the graph's logits (or the source model's) must not pass as no error."""
    path = checkpoints["qwen2"]
    graph = _real_graph(path)
    ctx = PassContext(reference=lambda ids: hf_logits(path, ids), verify_prompts=_prompts(320)[1:3],
                      verify_atol=1e-4)
    w = "model.layers.0.mlp.up_proj.weight"
    graph.params[w] = graph.params[w].clone()
    graph.params[w][0, 0] = float("nan")
    with pytest.raises(PassError, match=r"the graph's logits are not finite.*'model.layers.0.mlp.up_proj.weight'"):
        run_passes(graph, ["verify"], ctx)
    nan_ref = PassContext(reference=lambda ids: hf_logits(path, ids) * float("nan"),
                          verify_prompts=ctx.verify_prompts, verify_atol=1e-4)
    with pytest.raises(PassError, match="source model's and the graph's logits are not finite"):
        run_passes(graph, ["verify"], nan_ref)


def test_every_pass_has_name_and_docstring():
    for name, cls in PASSES.items():
        assert cls.name == name
        assert cls().description, f"pass {name} has no one-line docstring"
