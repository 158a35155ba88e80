"""Checkpoint loading: sharded safetensors, and clear errors for what is missing or corrupt."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from builder.checkpoint import CheckpointError, open_checkpoint
from conftest import make_checkpoint


def test_hub_id_says_download_first(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError) as e:
        open_checkpoint("meta-llama/Llama-3.1-8B")
    assert "does not exist" in str(e.value) and "download the checkpoint first" in str(e.value)
    assert "never downloads" in str(e.value)


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist; download the checkpoint first"):
        open_checkpoint(tmp_path / "nowhere")


def test_sharded_checkpoint_reads_all_shards(tmp_path):
    from transformers import AutoModelForCausalLM

    src = make_checkpoint(tmp_path / "one", "llama")
    model = AutoModelForCausalLM.from_pretrained(src)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB", safe_serialization=True)
    ckpt = open_checkpoint(tmp_path / "sharded")
    assert len(ckpt.weight_files) > 1
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(ckpt.load_tensors([name])[name], model.state_dict()[name])


def test_a_tensor_stored_twice_is_refused_naming_both_files(tmp_path):
    """Which copy a loader reads depends on the loader (transformers: the last shard it reads, whatever the index
    says), so a tensor in two files with different values is refused: two shards with an index that names one, and
    a stale file beside an unsharded checkpoint; identical copies are read from the first file."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    src = make_checkpoint(tmp_path / "one", "llama")
    AutoModelForCausalLM.from_pretrained(src).save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.0.self_attn.q_proj.weight"
    other = next(f for f in sorted(set(index.values())) if f != index[name])
    tensors = load_file(tmp_path / "sharded" / other)
    tensors[name] = torch.zeros(load_file(tmp_path / "sharded" / index[name])[name].shape)
    save_file(tensors, tmp_path / "sharded" / other, metadata={"format": "pt"})
    first, second = sorted([index[name], other])
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' is stored in both {first} and {second} with "
                                              rf"different values \(model\.safetensors\.index\.json names "
                                              rf"{index[name]}\); which copy a loader reads depends on the loader"):
        open_checkpoint(tmp_path / "sharded")
    shutil.copy(src / "model.safetensors", src / "zz-old.safetensors")  # the same values: either copy will do
    assert open_checkpoint(src).weight_map[name].name == "model.safetensors"
    stale = load_file(src / "zz-old.safetensors")
    stale[name] = stale[name] + 1
    save_file(stale, src / "zz-old.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"is stored in both model\.safetensors and zz-old\.safetensors with "
                                              r"different values \(no model\.safetensors\.index\.json\)"):
        open_checkpoint(src)


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_config_counts_the_files_do_not_hold_are_refused_before_tracing(tmp_path):
    """num_hidden_layers past the layers the files hold (a corrupt 100,000 traced for minutes before the missing
    weight was found), and more experts per token than experts."""
    src = make_checkpoint(tmp_path / "c", "llama")
    layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    _edit_config(src, num_hidden_layers=100_000)
    with pytest.raises(CheckpointError, match=rf"num_hidden_layers is 100000 but the safetensors files hold layers "
                                              rf"0\.\.{layers - 1}"):
        open_checkpoint(src)
    _edit_config(src, num_hidden_layers=layers, num_experts_per_tok=6, num_local_experts=4)
    with pytest.raises(CheckpointError, match=r"num_experts_per_tok 6 is more than the 4 experts \(num_local_experts\)"):
        open_checkpoint(src)


def test_a_tied_weight_stored_twice_with_different_values_is_refused(tmp_path):
    """config.json ties the lm_head to the embedding but the files store an lm_head of its own, with other values:
    transformers would not tie them, the graph would; refused naming both tensors and the setting."""
    from builder.checkpoint import weight_sources
    from passes.trace import trace

    src = make_checkpoint(tmp_path / "c", "llama", tie_word_embeddings=False)
    _edit_config(src, tie_word_embeddings=True)
    ckpt = open_checkpoint(src)
    graph, meta = trace(ckpt.hf_config())
    with pytest.raises(CheckpointError, match=r"'model\.embed_tokens\.weight' and 'lm_head\.weight' are one weight of "
                                              r"the llama model as config\.json builds it \(tied\) but the files "
                                              r"store different values \(config\.json sets tie_word_embeddings: "
                                              r"true\); if the model has its own lm_head, set tie_word_embeddings to "
                                              r"false"):
        weight_sources(graph, ckpt, meta)


def test_pickle_only_checkpoint_is_refused(tmp_path):
    d = tmp_path / "pickled"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (d / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="pickled weights are never loaded"):
        open_checkpoint(d)


def test_corrupt_safetensors(tmp_path):
    d = make_checkpoint(tmp_path / "c", "mistral")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        open_checkpoint(d)


def test_any_family_opens_but_model_type_is_required(tmp_path, checkpoints):
    """No allow-list: whether a family builds is the lifter's call (tests/passes/test_families.py). A config.json
    without a model_type names no family transformers could read."""
    d = shutil.copytree(checkpoints["llama"], tmp_path / "other")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "model_type": "gemma3_text"}))
    assert open_checkpoint(d).model_type == "gemma3_text"
    for bad, shown in ((None, "null"), ("", '""'), (3, "3")):
        (d / "config.json").write_text(json.dumps({**config, "model_type": bad}))
        with pytest.raises(CheckpointError, match=rf"model_type is {shown}; config.json must name the model's family"):
            open_checkpoint(d)
    del config["model_type"]
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="model_type is null"):
        open_checkpoint(d)


@pytest.mark.parametrize("key, section, message", [
    ("quantization_config", {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
     r"quantization_config\.activation_scheme is \"static\"; imported: dynamic"),
    ("quantization_config", {"quant_method": "bitsandbytes"}, r"quant_method is \"bitsandbytes\": bitsandbytes"),
    ("quantization_config", {"quant_method": "gptq", "bits": 2}, r"quantization_config\.bits is 2; expected one of 4, "
                                                                 r"8"),
    ("compression_config", {"format": "float-quantized"}, r"compression_config\.config_groups is missing or empty"),
])
def test_pre_quantized_checkpoint_of_an_unimported_kind_is_refused(tmp_path, checkpoints, key, section, message):
    d = shutil.copytree(checkpoints["llama"], tmp_path / "quantized")
    config = json.loads((d / "config.json").read_text())
    config[key] = section
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        open_checkpoint(d)


@pytest.mark.parametrize("section, source", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 32}, "gptq"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "GEMM"}, "awq"),
])
def test_pre_quantized_checkpoint_opens_with_its_format(tmp_path, checkpoints, section, source):
    """Opening reads the format; the import itself (builder/prequantized.py) is tested in test_prequantized.py."""
    d = shutil.copytree(checkpoints["llama"], tmp_path / "quantized")
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"] = section
    (d / "config.json").write_text(json.dumps(config))
    ckpt = open_checkpoint(d)
    assert (ckpt.quant.source, ckpt.quant.bits, ckpt.quant.group_size) == (source, 4, 32)


def _fp8_checkpoint(src, dst, with_scales: bool):
    """``src`` with its layers' linear weights stored as float8 codes (and per-tensor scales), the way
    FP8 checkpoints store them, but with no quantization_config left in config.json."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    for name in [n for n in tensors if "_proj.weight" in n]:
        w = tensors[name]
        scale = w.abs().amax() / 448.0
        tensors[name] = (w / scale).to(torch.float8_e4m3fn)
        if with_scales:
            tensors[name.removesuffix("weight") + "weight_scale"] = scale.reshape(1)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _attach(path):
    from builder.checkpoint import attach_weights
    from passes.trace import trace

    ckpt = open_checkpoint(path)
    graph, meta_model = trace(ckpt.hf_config())
    attach_weights(graph, ckpt, meta_model, torch.float32)
    return graph


def test_unread_checkpoint_tensors_are_refused(tmp_path, checkpoints):
    d = _fp8_checkpoint(checkpoints["llama"], tmp_path / "fp8", with_scales=True)
    with pytest.raises(CheckpointError, match=r"14 checkpoint tensors are read by no weight of the llama model: "
                                              r"model\.layers\.0\.mlp\.down_proj\.weight_scale, .* and 8 more; a "
                                              r"checkpoint with extra tensors \(quantization scales, adapters\)"):
        _attach(d)


def test_float8_weights_are_not_cast(tmp_path, checkpoints):
    d = _fp8_checkpoint(checkpoints["llama"], tmp_path / "fp8", with_scales=False)
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.0\.mlp\.down_proj\.weight' is stored as "
                                              r"float8_e4m3fn where a floating-point weight is expected"):
        _attach(d)
    name = "model.layers.0.mlp.down_proj.weight"
    assert open_checkpoint(d).load_tensors([name])[name].dtype == torch.float8_e4m3fn  # raw reads stay raw


def test_integer_weights_are_not_cast(tmp_path, checkpoints):
    from safetensors.torch import load_file, save_file

    d = shutil.copytree(checkpoints["qwen2"], tmp_path / "packed")
    tensors = load_file(d / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones_like(tensors["model.norm.weight"], dtype=torch.int32)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' is stored as int32 where a floating-point"):
        open_checkpoint(d).load_tensors(["model.norm.weight"], torch.float32)


def test_tied_weight_stored_under_both_names_and_rotary_tables_are_read(tmp_path, checkpoints):
    from safetensors.torch import load_file, save_file

    d = shutil.copytree(checkpoints["llama"], tmp_path / "both")  # llama fixtures tie lm_head to the embedding
    tensors = load_file(d / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # older checkpoints carry these
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    graph = _attach(d)
    assert not any(t.is_meta for t in graph.params.values())


def test_tokenizer_larger_than_the_vocabulary(tmp_path, checkpoints):
    d = shutil.copytree(checkpoints["mistral"], tmp_path / "small-vocab")
    config = json.loads((d / "config.json").read_text())
    config["vocab_size"] = 300  # the fixtures' tokenizers have 320 tokens
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"tokenizer.json: the tokenizer has 320 tokens \(ids 0\.\.319, added "
                                              r"tokens included\) but config.json vocab_size is 300"):
        open_checkpoint(d)
    tokenizer = json.loads((d / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append({**tokenizer["added_tokens"][0], "id": 400, "content": "<|extra|>"})
    (d / "tokenizer.json").write_text(json.dumps(tokenizer))
    config["vocab_size"] = 352  # padded past the base vocabulary, but not past the added token
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"the tokenizer has 401 tokens .* vocab_size is 352"):
        open_checkpoint(d)
    config["vocab_size"] = 401
    (d / "config.json").write_text(json.dumps(config))
    assert open_checkpoint(d).config_dict["vocab_size"] == 401


def test_tensor_names_are_mapped_as_transformers_maps_them_on_load():
    """transformers' own loading rules, read from the installed version: a model's registered renamings (GPT-NeoX's
    lm_head stored as embed_out, legacy LayerNorm gamma), the base_model_prefix added to a base model's keys, tensors
    the model drops on load (old causal-mask buffers) and conversions that are not renamings (Mixtral's experts,
    merged into one tensor) kept apart."""
    from transformers import AutoConfig

    from builder.checkpoint import map_tensor_names
    from passes.trace import build_meta_model

    def meta_model(model_type: str, **config):
        return build_meta_model(AutoConfig.for_model(model_type, vocab_size=96, hidden_size=64, intermediate_size=112,
                                                     num_hidden_layers=1, num_attention_heads=4, **config))

    neox = meta_model("gpt_neox")
    names = map_tensor_names(neox, ["embed_out.weight", "gpt_neox.embed_in.weight", "layers.0.mlp.dense_h_to_4h.bias",
                                    "gpt_neox.layers.0.attention.bias", "gpt_neox.layers.0.attention.masked_bias",
                                    "gpt_neox.layers.0.attention.dense.weight_scale"])
    assert names.model_name["embed_out.weight"] == "lm_head.weight"
    assert names.model_name["gpt_neox.embed_in.weight"] == "gpt_neox.embed_in.weight"
    assert names.model_name["layers.0.mlp.dense_h_to_4h.bias"] == "gpt_neox.layers.0.mlp.dense_h_to_4h.bias"
    assert names.ignored == {"gpt_neox.layers.0.attention.bias", "gpt_neox.layers.0.attention.masked_bias"}
    assert not names.converted
    llama = meta_model("llama")
    assert map_tensor_names(llama, ["model.layers.0.LayerNorm.gamma"]).model_name == {
        "model.layers.0.LayerNorm.gamma": "model.layers.0.LayerNorm.weight"}
    mixtral = meta_model("mixtral")
    names = map_tensor_names(mixtral, ["model.layers.0.block_sparse_moe.experts.0.w1.weight",
                                       "model.layers.0.block_sparse_moe.gate.weight"])
    assert names.converted == {"model.layers.0.block_sparse_moe.experts.0.w1.weight":
                               "model.layers.0.mlp.experts.gate_up_proj"}
    assert names.model_name == {"model.layers.0.block_sparse_moe.gate.weight": "model.layers.0.mlp.gate.weight"}


def test_base_model_checkpoint_binds_and_unmapped_or_missing_tensors_are_named(tmp_path, checkpoints):
    """A checkpoint saved from the base model (no ``model.`` prefix; the llama fixture ties its lm_head) binds as
    from_pretrained would load it; a tensor that maps to no weight, or a weight no tensor maps to, still stops the
    build with one line naming it."""
    from safetensors.torch import load_file, save_file

    from builder.checkpoint import attach_weights, weight_sources
    from passes.trace import trace

    d = shutil.copytree(checkpoints["llama"], tmp_path / "base")
    original = load_file(d / "model.safetensors")
    assert "lm_head.weight" not in original
    tensors = {k.removeprefix("model."): v for k, v in original.items()}
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    ckpt = open_checkpoint(d)
    graph, meta_model = trace(ckpt.hf_config())
    assert weight_sources(graph, ckpt, meta_model)["lm_head.weight"] == "embed_tokens.weight"

    save_file({**tensors, "layers.0.mlp.extra.weight": torch.ones(2), "layers.0.LayerNorm.gamma": torch.ones(2)},
              d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"2 checkpoint tensors are read by no weight of the llama model: "
                                              r"layers\.0\.LayerNorm\.gamma \(loaded by transformers as "
                                              r"layers\.0\.LayerNorm\.weight\), layers\.0\.mlp\.extra\.weight;") as e:
        weight_sources(graph, open_checkpoint(d), meta_model)
    assert "\n" not in str(e.value)
    save_file({k: v for k, v in tensors.items() if k != "norm.weight"}, d / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"weight 'model\.norm\.weight' \(or an alias of it\) is missing from "
                                              r"the safetensors files, under its own name and any name transformers "
                                              r"maps to it; the checkpoint is incomplete") as e:
        weight_sources(graph, open_checkpoint(d), meta_model)
    assert "\n" not in str(e.value)

    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    attach_weights(graph, open_checkpoint(d), meta_model, torch.float32)
    for name, t in graph.params.items():
        if name in original:
            assert torch.equal(t, original[name]), name
    assert torch.equal(graph.params["lm_head.weight"], original["model.embed_tokens.weight"])


def test_stacked_expert_weights_bind_from_per_expert_tensors(tmp_path):
    """A mixture of experts' per-expert checkpoint tensors (Mixtral's ``experts.10.w1.weight``) are stacked into
    the model's ``experts.gate_up_proj`` / ``down_proj`` in expert order (10 after 9, not after 1) by transformers'
    own conversion; a checkpoint already stored stacked binds by name; a missing expert stops the build naming the
    weight and what it was computed from."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from builder.checkpoint import Conversion, attach_weights, weight_sources
    from passes.trace import trace

    config = AutoConfig.for_model("mixtral", vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=12,
                                  num_experts_per_tok=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "per_expert")
    stored = load_file(tmp_path / "per_expert" / "model.safetensors")
    expert = "model.layers.0.block_sparse_moe.experts.{}.{}.weight"
    assert expert.format(10, "w1") in stored and "model.layers.0.mlp.experts.gate_up_proj" not in stored
    ckpt = open_checkpoint(tmp_path / "per_expert")
    graph, meta_model = trace(ckpt.hf_config())
    sources = weight_sources(graph, ckpt, meta_model)
    gate_up = sources["model.layers.0.mlp.experts.gate_up_proj"]
    assert isinstance(gate_up, Conversion)
    assert list(gate_up.sources.values()) == [[expert.format(e, w) for e in range(12)] for w in ("w1", "w3")]
    attach_weights(graph, ckpt, meta_model, torch.float32)
    state = model.state_dict()
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"):
        assert torch.equal(graph.params[name], state[name]), name

    stacked = tmp_path / "stacked"
    shutil.copytree(tmp_path / "per_expert", stacked)
    save_file({k: v.contiguous() for k, v in state.items()}, stacked / "model.safetensors", metadata={"format": "pt"})
    graph, meta_model = trace(open_checkpoint(stacked).hf_config())
    assert weight_sources(graph, open_checkpoint(stacked), meta_model)["model.layers.0.mlp.experts.down_proj"] \
        == "model.layers.0.mlp.experts.down_proj"

    save_file({k: v for k, v in stored.items() if k != expert.format(7, "w2")},
              tmp_path / "per_expert" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"weight 'model\.layers\.0\.mlp\.experts\.down_proj', computed from 11 "
                                              r"tensors \(\.experts\.\*\.w2\.weight\), has shape \(11, 32, 24\), "
                                              r"config\.json implies \(12, 32, 24\)") as e:
        attach_weights(graph, open_checkpoint(tmp_path / "per_expert"), meta_model, torch.float32)
    assert "\n" not in str(e.value)
