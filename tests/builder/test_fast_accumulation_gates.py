"""Fast FP8 accumulation (``runtime.fp8_accumulation: fast``) runs only on a GPU, so the gates score such a build
there, through the runtime's kernels; on a machine without one they score the reference arithmetic and the report
says the accumulation was not judged (builder/quality.py: fast_accumulation_scoring)."""

from __future__ import annotations

import json

import torch

from builder.quality import fast_accumulation_scoring


def test_where_a_fast_accumulating_candidate_is_scored(monkeypatch):
    assert fast_accumulation_scoring("promoted") == ("cpu", None)
    assert fast_accumulation_scoring(None) == ("cpu", None)  # an artifact from before the setting
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    device, row = fast_accumulation_scoring("fast")
    assert device == "cpu" and row.status == "n/a" and row.passed and "not judged" in row.detail
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    device, row = fast_accumulation_scoring("fast")
    assert device == "cuda" and row.status == "info" and "scored on the GPU" in row.detail


def test_a_fast_build_without_a_gpu_says_its_gates_did_not_judge_it(checkpoints, tmp_path, monkeypatch):
    from builder.pipeline import build
    from builder.recipe import validate_recipe

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = build(validate_recipe({
        "model": {"checkpoint": str(checkpoints["llama"]), "dtype": "float32"}, "output_dir": str(tmp_path / "fast"),
        "runtime": {"max_seq_len": 128, "max_num_tokens": 32, "fp8_accumulation": "fast"},
        "quantization": {"algo": "fp8"}, "calibration": {"num_samples": 4, "seq_len": 32, "dataset": "bundled"},
        "gates": {"eval_dataset": "bundled", "num_positions": 64, "window": 32, "greedy_tokens": 4,
                  "needle_context_len": None, "max_kl": 10.0, "min_top1_agreement": 0.0, "max_ppl_ratio": 100.0,
                  "min_greedy_agreement": 0.0}})).output_dir
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["runtime"]["fp8_accumulation"] == "fast"
    gates = manifest["quantization"]["gates"]
    row = next(m for m in gates["metrics"] if m["name"] == "fp8_accumulation")
    assert gates["passed"] and row["status"] == "n/a" and "not judged" in row["detail"]
