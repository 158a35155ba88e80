"""LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini): two rotary tables, the second for sequences past
original_max_position_embeddings.

Hugging Face rotates a sequence within original_max_position_embeddings with the short_factor table; once the sequence
is longer, Phi-3's generation drops its cache and rotates all of it with the long_factor table. The artifact's rope
op holds both tables (the second taken from position long_from on, a kernel test checks the switch), and a build
whose runtime.max_seq_len passes the switch is refused: within it the runtime computes the model exactly, checked
here against HF's logits and HF's ``generate``.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import build_artifact, save_tokenizer

LONG_FROM = 64  # original_max_position_embeddings of the tiny model (max_position_embeddings 512: factor 8)
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
    return model, root, build_artifact(root / "ckpt", root / "artifact", max_seq_len=LONG_FROM)


def test_the_rope_op_holds_both_tables_and_the_switch(built):
    """Each rope node: inv_freq [2, 8] (short_factor's table, then long_factor's), long_from 64, and HF's attention
    factor for both, sqrt(1 + ln(512 / 64) / ln(64))."""
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


def test_logits_and_greedy_tokens_are_hfs(built):
    """Within original_max_position_embeddings: logits of 60 fresh random tokens within 1e-4 of HF's, and HF's
    ``generate`` tokens (positions up to 49), offline and from the serving engine with its prefill in chunks."""
    from runtime import Engine, SamplingParams
    from runtime.serving import ServingConfig, ServingEngine

    model, _, artifact = built
    engine = Engine.load(artifact)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, model.config.vocab_size, (60,), generator=gen).tolist()
    with torch.no_grad():
        expected = model(torch.tensor([ids]), use_cache=False).logits[0]
    assert (engine.logits(ids) - expected).abs().max().item() < 1e-4
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in (10, 3)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with torch.no_grad():
        want = [model.generate(torch.tensor([p]), max_new_tokens=40, min_new_tokens=40, do_sample=False,
                               pad_token_id=2)[0, len(p):].tolist() for p in prompts]
    assert [engine.generate(p, params).token_ids for p in prompts] == want
    served = ServingEngine(engine, ServingConfig(num_blocks=32, max_num_batched_tokens=8)).run(prompts, params)
    assert [o.token_ids for o in served] == want


def test_a_max_seq_len_past_the_switch_is_refused(built):
    """runtime.max_seq_len 65 (one past original_max_position_embeddings) stops the build before tracing, naming the
    switch and the largest max_seq_len allowed; nothing is written."""
    from builder.pipeline import BuildError

    _, root, _ = built
    with pytest.raises(BuildError, match=r"runtime\.max_seq_len 65 passes this model's LongRoPE switch at "
                                         r"original_max_position_embeddings 64: .*set runtime\.max_seq_len to at most "
                                         r"64"):
        build_artifact(root / "ckpt", root / "too-long", max_seq_len=LONG_FROM + 1)
    assert not (root / "too-long").exists()
