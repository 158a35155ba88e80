"""LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini): two rotary tables, the second for sequences past
original_max_position_embeddings (the switch).

Hugging Face rotates a sequence within the switch with the short_factor table; a longer one is rotated with the
long_factor table throughout, and Phi-3's generation drops its cache and recomputes every position when a sequence
grows past the switch. The artifact's rope op holds both tables; the engines offset the positions of a sequence past
the switch onto the second table (runtime.executor.LONG_ROPE_OFFSET) and recompute a running one that grows past it
(runtime.scheduler). Checked here against HF's logits and HF's own ``generate``, across the switch and from a prompt
past it, offline and served (chunked prefill, the prefix cache, speculative decoding).
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import build_artifact, save_tokenizer

LONG_FROM = 16  # original_max_position_embeddings of the tiny model (max_position_embeddings 512: factor 32)
HALF = 8  # frequencies per table (head_dim 16)
SHORT = [1.0 + 0.1 * i for i in range(HALF)]
LONG = [1.0 + 0.9 * i for i in range(HALF)]


def _phi3_longrope(path, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab = save_tokenizer(path)
    config = AutoConfig.for_model(
        "phi3", vocab_size=vocab, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, original_max_position_embeddings=LONG_FROM,
        bos_token_id=0, eos_token_id=1, pad_token_id=2,
        rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": SHORT, "long_factor": LONG})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if p.dim() == 1 else 0.08 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return model.eval()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("longrope")
    model = _phi3_longrope(root / "ckpt")
    return model, root, build_artifact(root / "ckpt", root / "artifact", max_seq_len=128, tokens_per_block=4)


def _hf_generate(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=2)
    return out[0, len(prompt):].tolist()


def test_the_rope_op_holds_both_tables(built):
    """Each rope node: inv_freq [2, 8] (short_factor's table, then long_factor's), long_from 16, and HF's attention
    factor for both, sqrt(1 + ln(512 / 16) / ln(16)) = 1.5."""
    import json

    from safetensors.torch import load_file

    _, _, artifact = built
    graph = json.loads((artifact / "graph.json").read_text())
    params = load_file(artifact / "weights.safetensors")
    ropes = [n for n in graph["nodes"] if n["op"] == "rope"]
    assert ropes and all(n["attrs"]["long_from"] == LONG_FROM for n in ropes)
    factor = math.sqrt(1 + math.log(512 / LONG_FROM) / math.log(LONG_FROM))
    assert all(n["attrs"]["attention_scaling"] == pytest.approx(factor) for n in ropes)
    base = 1e4 ** (torch.arange(0, 2 * HALF, 2, dtype=torch.float32) / (2 * HALF))
    expected = torch.stack([1.0 / (torch.tensor(SHORT) * base), 1.0 / (torch.tensor(LONG) * base)])
    torch.testing.assert_close(params[ropes[0]["weights"]["inv_freq"]], expected)


@pytest.mark.parametrize("length", [LONG_FROM, 40])
def test_logits_are_hfs_within_and_past_the_switch(built, length):
    """HF's one forward: 16 tokens on the first table, 40 on the second throughout (fresh random tokens)."""
    from runtime import Engine

    model, _, artifact = built
    ids = torch.randint(3, model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    with torch.no_grad():
        expected = model(torch.tensor([ids]), use_cache=False).logits[0]
    assert (Engine.load(artifact).logits(ids) - expected).abs().max().item() < 1e-4


def test_greedy_tokens_are_hf_generates_across_the_switch(built):
    """HF's ``generate`` tokens for a 10-token prompt growing past the switch (recomputed on the second table at 17
    tokens, as HF does), a 30-token prompt past it from the start, and a 12-token prompt whose first 12 tokens the
    30-token one starts with (its KV blocks, on the first table, must not serve the other): offline, and from the
    serving engine with prefill chunks of 8 tokens and the prefix cache, with and without n-gram speculation. The
    first table alone would part from HF's tokens (checked: the switch changes them)."""
    from runtime import Engine, SamplingParams
    from runtime.serving import ServingConfig, ServingEngine
    from runtime.speculative import SpeculativeConfig

    model, _, artifact = built
    gen = torch.Generator().manual_seed(9)
    vocab = model.config.vocab_size
    base = torch.randint(3, vocab, (30,), generator=gen).tolist()
    prompts = [torch.randint(3, vocab, (10,), generator=gen).tolist(), base, base[:12]]
    want = [_hf_generate(model, p, 24) for p in prompts]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine = Engine.load(artifact)
    assert [engine.generate(p, params).token_ids for p in prompts] == want
    for spec in (SpeculativeConfig(), SpeculativeConfig(method="ngram", num_speculative_tokens=3, min_gain=0.0)):
        srv = ServingEngine(engine, ServingConfig(num_blocks=96, max_num_batched_tokens=8, speculative=spec))
        assert [o.token_ids for o in srv.run(prompts, params)] == want
        assert srv.scheduler.num_preemptions == 0  # the switch's recompute is not a preemption
    # without the switch (the first table for every position) the first prompt's tokens are not HF's
    import runtime.scheduler as scheduler

    assert scheduler.Request(request_id="x", prompt_token_ids=[1], params=params).rope_offset == 0
    srv = ServingEngine(engine, ServingConfig(num_blocks=96, max_num_batched_tokens=8))
    srv.scheduler.config.long_rope_from = None
    assert srv.run(prompts[:1], params)[0].token_ids != want[0]


def test_the_gates_graph_model_runs_the_switch_as_the_engine(built):
    """builder.quality.GraphModel (the quality gates' logits and greedy agreement, over a graph): its greedy tokens
    across the switch are the engine's (HF's), and its logits past it the engine's."""
    import json

    from safetensors.torch import load_file

    from builder.quality import GraphModel
    from passes.ir import Graph
    from runtime import Engine, SamplingParams

    model, _, artifact = built
    graph = Graph.from_dict(json.loads((artifact / "graph.json").read_text()),
                            load_file(artifact / "weights.safetensors"))
    engine = Engine.load(artifact)
    gen = torch.Generator().manual_seed(21)
    prompt = torch.randint(3, model.config.vocab_size, (10,), generator=gen).tolist()
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    assert GraphModel(graph).greedy(prompt, 20) == engine.generate(prompt, params).token_ids == _hf_generate(model,
                                                                                                           prompt, 20)
    ids = torch.randint(3, model.config.vocab_size, (30,), generator=gen).tolist()
    assert (GraphModel(graph).logits(ids) - engine.logits(ids)).abs().max().item() < 1e-5


def test_a_graph_with_longrope_and_a_position_table_is_refused(built):
    """The engines offset a long sequence's positions for the rotary; a learned position table (or a query
    temperature per position) would read them as they are, so the executor refuses a graph with both rather than
    running it wrong."""
    import json

    from safetensors.torch import load_file

    from runtime.executor import Executor, GraphFormatError

    _, _, artifact = built
    graph = json.loads((artifact / "graph.json").read_text())
    graph["nodes"].insert(0, {"op": "embedding", "inputs": ["positions"], "outputs": ["pos_emb"], "weights": {},
                              "attrs": {}, "name": "wpe"})
    with pytest.raises(GraphFormatError, match="LongRoPE and a learned position table"):
        Executor(graph, load_file(artifact / "weights.safetensors"))
    graph["nodes"][0] = {"op": "position_scale", "inputs": ["input_ids", "positions"], "outputs": ["scaled"],
                         "weights": {}, "attrs": {"beta": 0.1, "period": 4}, "name": "temperature"}
    with pytest.raises(GraphFormatError, match="LongRoPE and a query temperature per position"):
        Executor(graph, load_file(artifact / "weights.safetensors"))


def test_two_gloo_ranks_run_the_switch_as_one(built):
    """A TP=2 artifact (two gloo ranks on CPU) generates HF's tokens across the switch and from a prompt past it,
    offline and served: the step messages carry the offset positions to the other rank."""
    from builder.pipeline import build
    from builder.recipe import validate_recipe
    from runtime import Engine, SamplingParams
    from runtime.serving import ServingConfig, ServingEngine

    model, root, _ = built
    recipe = validate_recipe({"name": "tp2", "model": {"checkpoint": str(root / "ckpt"), "dtype": "float32"},
                              "output_dir": str(root / "tp2"), "parallel": {"tp_size": 2},
                              "runtime": {"max_seq_len": 64, "max_num_tokens": 32, "tokens_per_block": 4}})
    artifact = build(recipe).output_dir
    gen = torch.Generator().manual_seed(33)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in (10, 20)]
    want = [_hf_generate(model, p, 12) for p in prompts]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine = Engine.load(artifact)
    try:
        assert engine.executor.tp_size == 2
        assert [engine.generate(p, params).token_ids for p in prompts] == want
        srv = ServingEngine(engine, ServingConfig(num_blocks=48, max_num_batched_tokens=8))
        assert [o.token_ids for o in srv.run(prompts, params)] == want
    finally:
        engine.close()
