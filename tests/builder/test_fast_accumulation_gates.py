"""Fast FP8 accumulation (``runtime.fp8_accumulation: fast``) runs only in cuBLAS's FP8 GEMMs on a GPU, so the gates
score such a build there, through the runtime's kernels, when they can; otherwise they score the reference arithmetic
and the report says the accumulation was not judged (builder/quality.py: fast_accumulation_scoring)."""

from __future__ import annotations

import json

import pytest
import torch

from builder import quality
from builder.quality import fast_accumulation_scoring


def _gpu(monkeypatch, capability=(9, 0)):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "an old GPU")


def test_where_a_fast_accumulating_candidate_is_scored(monkeypatch):
    assert fast_accumulation_scoring("promoted", 256) == ("cpu", None)
    assert fast_accumulation_scoring(None, 256) == ("cpu", None)  # an artifact from before the setting
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    device, row = fast_accumulation_scoring("fast", 256)
    assert device == "cpu" and row.status == "n/a" and row.passed and "this machine has none" in row.detail
    _gpu(monkeypatch)
    device, row = fast_accumulation_scoring("fast", 256)
    assert device == "cuda" and row.status == "info" and "scored on the GPU" in row.detail
    assert fast_accumulation_scoring("fast", 256, torch.device("cuda", 0))[0] == "cuda:0"
    # windows too short to reach cuBLAS, a build on the CPU, a GPU without FP8 GEMMs: not judged, and why
    for args, why in (((32,), "set gates.window to at least 65"), ((256, torch.device("cpu")), "calibration.device")):
        device, row = fast_accumulation_scoring("fast", *args)
        assert device == "cpu" and row.status == "n/a" and why in row.detail, row.detail
    _gpu(monkeypatch, capability=(8, 0))
    device, row = fast_accumulation_scoring("fast", 256)
    assert device == "cpu" and "an old GPU has no FP8 GEMM" in row.detail


def _recipe(checkpoint, out, **runtime) -> dict:
    return {"model": {"checkpoint": str(checkpoint), "dtype": "bfloat16"}, "output_dir": str(out),
            "runtime": {"max_seq_len": 128, "max_num_tokens": 128, **runtime},
            "quantization": {"algo": "fp8"}, "calibration": {"num_samples": 4, "seq_len": 32, "dataset": "bundled",
                                                              "device": "cpu"},
            "gates": {"eval_dataset": "bundled", "num_positions": 128, "window": 80, "greedy_tokens": 4,
                      "needle_context_len": None, "max_kl": 10.0, "min_top1_agreement": 0.0, "max_ppl_ratio": 100.0,
                      "min_greedy_agreement": 0.0}}


def test_a_fast_build_is_gated_where_it_runs(checkpoints, tmp_path, monkeypatch):
    """Built on the CPU, its gates say the accumulation was not judged; ``builder gate`` on a machine with a Hopper
    GPU scores the candidate there (the baseline and round-to-nearest on the CPU reference), whatever
    RUNTIME_FP8_FAST_ACCUM says in that process."""
    from builder.pipeline import build
    from builder.recipe import validate_recipe

    out = build(validate_recipe(_recipe(checkpoints["llama"], tmp_path / "fast", fp8_accumulation="fast"))).output_dir
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["runtime"]["fp8_accumulation"] == "fast"
    gates = manifest["quantization"]["gates"]
    row = next(m for m in gates["metrics"] if m["name"] == "fp8_accumulation")
    assert gates["passed"] and row["status"] == "n/a" and "the build ran on cpu" in row["detail"]

    seen, real = [], quality.GraphModel

    class Recorder(real):  # no GPU here: records where each model was asked to run, runs it on the CPU
        def __init__(self, graph, device="cpu", fp8_accumulation=None):
            super().__init__(graph, "cpu", fp8_accumulation)
            seen.append((str(device), fp8_accumulation, self.executor.fp8_fast_accum))

    _gpu(monkeypatch)
    monkeypatch.setattr(quality, "GraphModel", Recorder)
    monkeypatch.setenv("RUNTIME_FP8_FAST_ACCUM", "0")
    report = quality.gate_artifact(out, checkpoints["llama"])
    assert ("cuda", "fast", True) in seen and all(s[0] == "cpu" for s in seen if s[0] != "cuda"), seen
    assert len([s for s in seen if s[0] == "cuda"]) == 1  # the candidate alone
    assert next(m for m in report.metrics if m.name == "fp8_accumulation").status == "info"


def test_fast_accumulation_needs_fp8_linears_on_16_bit_activations(checkpoints, tmp_path):
    from builder.pipeline import BuildError, build
    from builder.recipe import validate_recipe

    fp32 = _recipe(checkpoints["llama"], tmp_path / "fp32", fp8_accumulation="fast")
    fp32["model"]["dtype"] = "float32"
    with pytest.raises(BuildError, match="model.dtype is float32: FP8 GEMMs on cuBLAS run on bfloat16 or float16"):
        build(validate_recipe(fp32))
    # an fp8 section among others is enough (the MLPs in INT8 weight-only, the rest FP8)
    mixed = _recipe(checkpoints["llama"], tmp_path / "mixed", fp8_accumulation="fast")
    mixed["quantization"] = [{"algo": "int8_wo", "targets": ["re:mlp"]}, {"algo": "fp8"}]
    mixed["gates"]["enabled"] = False
    out = build(validate_recipe(mixed)).output_dir
    assert json.loads((out / "manifest.json").read_text())["runtime"]["fp8_accumulation"] == "fast"
    assert not (tmp_path / "fp32").exists()
