"""Calibration and gate text for a model that is not the bundled one: named in the recipe, or taken from the
shipped text on purpose ('bundled', flagged in the manifest and the report), never silently."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from builder.calibration import (BUNDLED_MODEL, DEFAULT_CALIBRATION, DEFAULT_EVAL, DataError, is_bundled_model,
                                 resolve_text)

ROOT = Path(__file__).resolve().parents[2]


def test_unset_text_is_the_shipped_text_for_the_bundled_model_only(tmp_path):
    assert is_bundled_model(BUNDLED_MODEL) and is_bundled_model(ROOT / "models" / "pystdlib-llama" / ".")
    assert resolve_text(None, DEFAULT_CALIBRATION, BUNDLED_MODEL, "calibration.dataset") == (DEFAULT_CALIBRATION, None)
    other = tmp_path / "ckpt"
    with pytest.raises(DataError, match=r"calibration.dataset is not set and .*ckpt is not the bundled model: set it "
                                        r"to a .txt or .jsonl file .* or to 'bundled'"):
        resolve_text(None, DEFAULT_CALIBRATION, other, "calibration.dataset")
    path, warning = resolve_text("bundled", DEFAULT_EVAL, other, "gates.eval_dataset")
    assert path == DEFAULT_EVAL and warning.startswith("gates.eval_dataset: bundled: eval.txt")
    assert resolve_text("bundled", DEFAULT_EVAL, BUNDLED_MODEL, "gates.eval_dataset") == (DEFAULT_EVAL, None)
    mine = tmp_path / "mine.txt"
    assert resolve_text(str(mine), DEFAULT_EVAL, other, "gates.eval_dataset") == (mine, None)


def test_a_build_of_another_model_names_its_text_or_says_bundled(checkpoints, tmp_path):
    from builder.pipeline import build
    from builder.recipe import validate_recipe

    def recipe(out: str, calibration: dict, gates: dict):
        return validate_recipe({
            "model": {"checkpoint": str(checkpoints["llama"]), "dtype": "float32"}, "output_dir": str(tmp_path / out),
            "runtime": {"max_seq_len": 128, "max_num_tokens": 32}, "quantization": {"algo": "smoothquant"},
            "calibration": {"num_samples": 4, "seq_len": 32, **calibration},
            "gates": {"num_positions": 64, "window": 32, "greedy_tokens": 4, "needle_context_len": None, "max_kl": 10.0,
                      "min_top1_agreement": 0.0, "max_ppl_ratio": 100.0, "min_greedy_agreement": 0.0, **gates}})

    with pytest.raises(DataError, match="calibration.dataset is not set"):
        build(recipe("a", {}, {}))
    with pytest.raises(DataError, match="gates.eval_dataset is not set"):
        build(recipe("b", {"dataset": "bundled"}, {}))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    own = tmp_path / "own.txt"
    own.write_text("def f(x):\n    return x + 1\n" * 200)
    out = build(recipe("c", {"dataset": "bundled"}, {"eval_dataset": str(own)})).output_dir
    q = json.loads((out / "manifest.json").read_text())["quantization"]
    assert "not text of this model's domain" in q["calibration"]["warning"]
    assert q["gates"]["eval_data"] == {"path": str(own)}
    report = (out / "report.md").read_text()
    assert "**Warning: calibration.dataset: bundled: calibration.jsonl" in report
