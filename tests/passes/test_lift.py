"""Tracing HF models into the IR: structure per family, serialization, unknown ops."""

from __future__ import annotations

import pytest

from conftest import FAMILIES, tiny_config
from passes.ir import Graph
from passes.lift import LiftError
from passes.trace import trace


@pytest.mark.parametrize("family", FAMILIES)
def test_trace_structure(family):
    config = tiny_config(family, 320)
    graph, _ = trace(config)
    ops = graph.count_ops()
    layers = config.num_hidden_layers
    assert ops["attention"] == layers
    assert ops["rope"] == 2 * layers
    assert ops["linear"] == 7 * layers
    assert ops["embedding"] == 1 and ops["lm_head"] == 1
    per_head_norms = 2 * layers if family == "qwen3" else 0
    assert ops["rms_norm"] == 2 * layers + 1 + per_head_norms
    attn = [n for n in graph.nodes if n.op == "attention"]
    assert [n.attrs["layer"] for n in attn] == list(range(layers))
    assert attn[0].attrs["num_heads"] == 4 and attn[0].attrs["num_kv_heads"] == 2
    head_dim = 24 if family == "qwen3" else 16
    assert attn[0].attrs["head_dim"] == head_dim
    q_proj = next(n for n in graph.nodes if n.source.endswith("layers.0.self_attn.q_proj"))
    assert ("bias" in q_proj.weights) == (family == "qwen2")
    assert graph.meta["num_layers"] == layers and graph.meta["vocab_size"] == 320


def test_tied_embeddings_share_one_weight():
    graph, _ = trace(tiny_config("llama", 320))
    embed = next(n for n in graph.nodes if n.op == "embedding")
    head = next(n for n in graph.nodes if n.op == "lm_head")
    assert embed.weights["weight"] == head.weights["weight"]


def test_llama3_rope_scaling_is_applied():
    """The inv_freq table follows the config's llama3 rope_scaling (formula written out here)."""
    import math

    import torch

    graph, _ = trace(tiny_config("llama", 320))
    inv_freq = graph.params["model.rotary_emb.inv_freq"]
    plain = 1.0 / (500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    factor, low, high, orig = 8.0, 1.0, 4.0, 64
    expected = []
    for f in plain.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < orig / high:
            expected.append(f)
        elif wavelen > orig / low:
            expected.append(f / factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            expected.append((1 - smooth) * f / factor + smooth * f)
    assert torch.allclose(inv_freq.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-5)
    assert not torch.allclose(inv_freq.double(), plain)


def test_graph_serialization_round_trip():
    graph, _ = trace(tiny_config("qwen3", 320))
    again = Graph.from_dict(graph.to_dict())
    assert str(again) == str(graph)
    assert again.to_dict() == graph.to_dict()


def test_graph_prints_readably():
    graph, _ = trace(tiny_config("mistral", 320))
    text = str(graph)
    assert "attention(%" in text and "num_kv_heads=2" in text and "# model.layers.1.self_attn" in text


def test_unknown_op_names_op_and_module():
    config = tiny_config("llama", 320, hidden_act="mish")
    with pytest.raises(LiftError) as e:
        trace(config)
    assert "aten.mish" in str(e.value)
    assert "model.layers.0.mlp.act_fn" in str(e.value)


def test_mistral_sliding_window_comes_from_the_config(tmp_path):
    """transformers keeps Mistral's window only in the config (no module attribute): the lift must find it,
    and logits past the window must match HF."""
    import torch

    from conftest import build_artifact, hf_logits, make_checkpoint
    from runtime import Engine

    graph, _ = trace(tiny_config("mistral", 320, sliding_window=8))
    assert [n.attrs.get("sliding_window") for n in graph.nodes if n.op == "attention"] == [8, 8]
    assert all("sliding_window" not in n.attrs
               for n in trace(tiny_config("llama", 320))[0].nodes if n.op == "attention")
    ckpt = make_checkpoint(tmp_path / "ckpt", "mistral", sliding_window=8)
    engine = Engine.load(build_artifact(ckpt, tmp_path / "art"))
    ids = torch.randint(3, 320, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    assert (engine.logits(ids) - hf_logits(ckpt, ids)).abs().max() < 1e-4


@pytest.mark.parametrize("family, overrides, rope_type", [
    ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    ("qwen2", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}}, "dynamic"),
    ("mistral", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),  # the older key
])
def test_length_dependent_rope_is_refused_before_tracing(family, overrides, rope_type, monkeypatch):
    import passes.trace

    monkeypatch.setattr(passes.trace, "export_model", lambda model: pytest.fail("traced before the rope check"))
    with pytest.raises(LiftError, match=rf"rope_type '{rope_type}' \(config.json rope_parameters / rope_scaling\) "
                                        rf"is not supported: .*; supported: default, linear, llama3, yarn, longrope"):
        trace(tiny_config(family, 320, **overrides))


def test_rope_types_read_every_form():
    from types import SimpleNamespace

    from passes.trace import rope_types

    per_layer_type = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                      "sliding_attention": {"rope_type": "dynamic", "factor": 4.0}}
    assert rope_types(SimpleNamespace(rope_parameters=per_layer_type)) == ["default", "dynamic"]
    assert rope_types(SimpleNamespace(rope_scaling={"type": "linear", "factor": 2.0})) == ["linear"]
    assert rope_types(SimpleNamespace(rope_parameters=None, rope_scaling=None)) == []
    assert rope_types(tiny_config("llama", 320)) == ["llama3", "llama3"]  # transformers 5 keeps both keys


def test_a_rotary_table_is_read_only_where_it_is_exactly_a_sinusoid():
    """``sinusoid_frequencies`` (GPT-J's and CodeGen's precomputed [positions, sin | cos] tables): the frequencies of
    a standard table come back exactly; a table off by one ulp somewhere, one whose rotary module holds weights, and a
    buffer at the model's root are refused with a LiftError naming the buffer."""
    import torch

    from passes.trace import sinusoid_frequencies

    def table(num_pos: int, dim: int, base: int = 10000) -> torch.Tensor:
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64) / dim))
        angles = torch.arange(num_pos, dtype=torch.int64).float()[:, None] * inv_freq
        return torch.cat((torch.sin(angles), torch.cos(angles)), dim=1)

    class Rotary(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.register_buffer("embed_positions", config.make(), persistent=False)

    class Model(torch.nn.Module):
        def __init__(self, make, weights: bool = False):
            super().__init__()
            self.config = type("Config", (), {"make": staticmethod(make)})()
            self.rotary = Rotary(self.config)
            if weights:
                self.rotary.proj = torch.nn.Linear(2, 2)

    for base in (10000, 500000):
        got = sinusoid_frequencies(Model(lambda: table(64, 16, base)), "rotary.embed_positions")
        assert torch.equal(got, (1.0 / (base ** (torch.arange(0, 16, 2, dtype=torch.int64) / 16))).float())

    def off_by_one_ulp() -> torch.Tensor:
        t = table(64, 16)
        t[40, 3] = torch.nextafter(t[40, 3], torch.tensor(2.0))
        return t

    with pytest.raises(LiftError, match="rotary.embed_positions.*is not sin | cos"):
        sinusoid_frequencies(Model(off_by_one_ulp), "rotary.embed_positions")
    with pytest.raises(LiftError, match="holds weights"):
        sinusoid_frequencies(Model(lambda: table(64, 16), weights=True), "rotary.embed_positions")
    with pytest.raises(LiftError, match="'embed_positions'"):
        sinusoid_frequencies(Model(lambda: table(64, 16)), "embed_positions")
