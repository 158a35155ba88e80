"""``make_checkpoint --fp8-channel`` writes what llm-compressor's FP8_DYNAMIC writes (compressed-tensors, e4m3 codes
with a scale per output channel), and its import is the artifact the fp8 method makes from the same weights in bf16,
tensor for tensor: so a 70B-shaped FP8 run (issue 22) needs half the checkpoint bytes and measures the same engine."""
from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from builder.devtools.make_checkpoint import main as make
from builder.pipeline import build
from builder.recipe import load_recipe

SETTINGS = ["runtime.max_seq_len=512"]


def _build(recipe: str, checkpoint, out, extra: list[str] = ()):
    overrides = [f"model.checkpoint={checkpoint}", f"output_dir={out}", *SETTINGS, *extra]
    return build(load_recipe(recipe, overrides))


def test_fp8_channel_checkpoint_imports_as_the_fp8_method_quantizes(tmp_path):
    assert make(["--preset", "tiny", "--out", str(tmp_path / "bf16"), "--device", "cpu"]) == 0
    assert make(["--preset", "tiny", "--out", str(tmp_path / "fp8"), "--device", "cpu", "--fp8-channel"]) == 0
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors"
    stored = {k: v for f in (tmp_path / "fp8").glob("*.safetensors") for k, v in load_file(f).items()}
    assert stored["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.layers.0.mlp.down_proj.weight_scale"].shape == (64, 1)
    assert stored["lm_head.weight"].dtype == torch.bfloat16  # ignored, as FP8_DYNAMIC leaves it

    _build("recipes/bench/llama3-8b-fp8.yaml", tmp_path / "bf16", tmp_path / "quantized",
           [f"calibration.dataset={tmp_path / 'bf16' / 'calibration.jsonl'}"])
    _build("recipes/bench/llama3-70b-fp8.yaml", tmp_path / "fp8", tmp_path / "imported")
    ours, imported = (load_file(tmp_path / d / "weights.safetensors") for d in ("quantized", "imported"))
    assert ours.keys() == imported.keys()
    for name, t in ours.items():
        other = imported[name]
        assert t.dtype == other.dtype, name
        bits = (lambda x: x.view(torch.uint8)) if t.dtype == torch.float8_e4m3fn else (lambda x: x)
        assert torch.equal(bits(t), bits(other)), f"{name} differs"
    manifest = json.loads((tmp_path / "imported" / "manifest.json").read_text())
    assert manifest["quantization"]["prequantized"]["schemes"] == {"fp8": 14}
