"""builder.devtools.make_checkpoint: random checkpoints of real shapes (Llama, Qwen3-MoE) that HF, the builder and
the runtime all load."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import build_artifact, hf_logits
from builder.devtools.make_checkpoint import PRESETS, main
from runtime import Engine


def test_tiny_preset_builds_and_matches_hf(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert main(["--preset", "tiny", "--out", str(ckpt), "--dtype", "float32", "--device", "cpu"]) == 0
    config = json.loads((ckpt / "config.json").read_text())
    shape = PRESETS["tiny"]
    assert (config["hidden_size"], config["num_key_value_heads"], config["vocab_size"]) == (
        shape.hidden_size, shape.num_key_value_heads, shape.vocab_size)
    engine = Engine.load(build_artifact(ckpt, tmp_path / "art"))
    ids = torch.randint(3, shape.vocab_size, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    ours, ref = engine.logits(ids), hf_logits(ckpt, ids)
    assert ref.std() > 0.01  # random weights, not a degenerate model
    assert (ours - ref).abs().max() < 1e-4
    assert engine.tokenizer.encode("t5 t6 t7", add_special_tokens=False) == [5, 6, 7]


def test_calibration_text_is_real_vocabulary(tmp_path):
    """Quantized builds of the random model calibrate on its calibration.jsonl: random real ids, no <unk>."""
    from tokenizers import Tokenizer

    from builder.devtools.make_checkpoint import write_calibration_text, write_tokenizer

    write_tokenizer(tmp_path, 500)
    write_calibration_text(tmp_path / "calibration.jsonl", 500, seed=0, num_texts=3, words=40)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    lines = (tmp_path / "calibration.jsonl").read_text().splitlines()
    assert len(lines) == 3
    ids = [tok.encode(json.loads(line)["text"], add_special_tokens=False).ids for line in lines]
    assert all(len(row) == 40 and min(row) >= 3 and max(row) < 500 for row in ids)
    assert len({i for row in ids for i in row}) > 60  # varied, not one repeated token


@pytest.mark.parametrize("preset", ["llama3-8b", "llama3-1b", "qwen3-30b-a3b", "tiny-moe"])
def test_preset_tensors_are_the_hf_models_state_dict(preset):
    """Every preset writes exactly the weights its HF model has, under the model's names and shapes (the model
    built on the meta device from the config the preset writes); the 30B-A3B preset has Qwen3-30B-A3B's 30.5B
    parameters."""
    from transformers import AutoModelForCausalLM

    shape = PRESETS[preset]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape.hf_config(torch.bfloat16))
    state = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if shape.tie_word_embeddings:  # stored once, as the embedding
        state.pop("lm_head.weight")
    assert {name: s for name, s, _ in shape.tensors()} == state
    if preset == "qwen3-30b-a3b":
        assert sum(p.numel() for p in model.parameters()) == 30_532_122_624


def test_staged_shards_are_save_file_of_the_tensors_drawn_in_order(tmp_path, monkeypatch):
    """Shards written from views of one reused buffer are byte for byte what saving each shard's freshly drawn
    tensors writes (the generator's output before the buffer existed): same values, same files, same index."""
    from safetensors.torch import save_file

    import builder.devtools.make_checkpoint as mc

    monkeypatch.setattr(mc, "SHARD_BYTES", 40_000)  # the tiny preset in several shards
    out = mc.make_checkpoint(tmp_path / "staged", PRESETS["tiny"], dtype=torch.bfloat16, seed=3)
    g = torch.Generator().manual_seed(3)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tshape, is_norm in PRESETS["tiny"].tensors():
        t = torch.randn(tshape, generator=g) * 0.02 + (1.0 if is_norm else 0.0)
        t = t.to(torch.bfloat16)
        if size and size + t.numel() * 2 > 40_000:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.numel() * 2
    assert len(shards) > 2
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(tmp_path / fname), metadata={"format": "pt"})
        assert (out / fname).read_bytes() == (tmp_path / fname).read_bytes(), fname
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {name: f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
                                   for k, shard in enumerate(shards) for name in shard}


def test_tiny_moe_preset_loads_in_transformers_and_builds(tmp_path):
    """The MoE preset in both expert layouts: transformers loads each with no missing or unexpected weight, both
    are the same model for one seed, the random router sends tokens to every expert, and the stacked layout
    builds into an artifact that matches HF (the per-expert one is the layout tests/passes/test_families.py builds)."""
    from transformers import AutoModelForCausalLM

    shape = PRESETS["tiny-moe"]
    ids = torch.randint(3, shape.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
    logits = {}
    for layout in ("stacked", "per-expert"):
        assert main(["--preset", "tiny-moe", "--out", str(tmp_path / layout), "--dtype", "float32", "--device", "cpu",
                     "--expert-tensors", layout]) == 0
        model, info = AutoModelForCausalLM.from_pretrained(tmp_path / layout, dtype=torch.float32,
                                                           output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
        with torch.no_grad():
            out = model(ids, output_router_logits=True)
        logits[layout] = out.logits[0]
        for router in out.router_logits:  # [tokens, experts]
            chosen = torch.bincount(router.topk(shape.num_experts_per_tok).indices.flatten(), minlength=8)
            assert chosen.min() > 0 and chosen.max() < 0.5 * ids.numel(), chosen.tolist()
    stored = json.loads((tmp_path / "per-expert" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in stored
    assert "model.layers.1.mlp.experts.gate_up_proj" in json.loads(
        (tmp_path / "stacked" / "model.safetensors.index.json").read_text())["weight_map"]
    assert torch.equal(logits["stacked"], logits["per-expert"])
    engine = Engine.load(build_artifact(tmp_path / "stacked", tmp_path / "art"))
    assert (engine.logits(ids[0].tolist()) - logits["stacked"]).abs().max() < 1e-4
    assert engine.tokenizer.encode("t5 t6 t7", add_special_tokens=False) == [5, 6, 7]


def test_options_that_do_not_fit_the_preset_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--preset", "tiny", "--out", str(tmp_path / "a"), "--expert-tensors", "per-expert"])
    assert "preset tiny has no experts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--preset", "tiny-moe", "--out", str(tmp_path / "b"), "--num-hidden-layers", "0"])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_fp8_blocks_write_a_fine_grained_fp8_checkpoint_the_build_imports(tmp_path):
    """--fp8-blocks: the tiny MoE's linears and experts as transformers' fine-grained FP8 (e4m3 codes, a scale per
    block, per-expert tensors; routers, norms, embedding and lm_head float), drawn from the same weights as the float
    checkpoint (codes times scales within e4m3's rounding of them), imported by the build as fp8_block linears and
    experts, its verify against the format's own dequantization passed."""
    from safetensors.torch import load_file

    shape = PRESETS["tiny-moe"]
    for name, extra in (("float", []), ("fp8", ["--fp8-blocks", "32"])):
        assert main(["--preset", "tiny-moe", "--out", str(tmp_path / name), "--dtype", "float32", "--device", "cpu",
                     "--expert-tensors", "per-expert", *extra]) == 0
    floats = {k: v for f in sorted((tmp_path / "float").glob("*.safetensors")) for k, v in load_file(f).items()}
    fp8 = {k: v for f in sorted((tmp_path / "fp8").glob("*.safetensors")) for k, v in load_file(f).items()}
    expert = "model.layers.1.mlp.experts.7.up_proj"
    codes, scales = fp8[f"{expert}.weight"], fp8[f"{expert}.weight_scale_inv"]
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (1, 2)  # [32 rows, 64 inputs] in 32 x 32 blocks
    w = floats[f"{expert}.weight"]
    deq = codes.float() * scales.repeat_interleave(32, 0).repeat_interleave(32, 1)
    assert ((deq - w).abs() <= w.abs() / 16 + 1e-6).all()  # e4m3 keeps 3 mantissa bits
    for kept in ("model.layers.0.mlp.gate.weight", "lm_head.weight", "model.layers.0.input_layernorm.weight"):
        assert torch.equal(fp8[kept], floats[kept]) and f"{kept}_scale_inv" not in fp8
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "fp8" and config["weight_block_size"] == [32, 32]
    manifest = json.loads((build_artifact(tmp_path / "fp8", tmp_path / "art") / "manifest.json").read_text())
    record = manifest["quantization"]["prequantized"]
    assert record["schemes"] == {"fp8_block": 4 * shape.num_hidden_layers}  # q, k, v and o_proj of each layer
    assert record["expert_linears"] == 3 * shape.num_experts * shape.num_hidden_layers
