"""builder.devtools.make_checkpoint: a random Llama-shaped checkpoint that HF, the builder and the runtime all load."""

from __future__ import annotations

import json

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
