"""Checkpoint loading: sharded safetensors, and clear errors for what is missing or corrupt."""

from __future__ import annotations

import json

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


def test_unsupported_family(tmp_path):
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match="model_type 'gpt2' is not supported; supported families: llama"):
        open_checkpoint(d)
