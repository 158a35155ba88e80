"""Quantized builds as a deploy gate: calibration recorded, gates run, a regression blocks the build."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from builder.cli import app

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()
FAST = ["calibration.num_samples=8", "calibration.seq_len=128", "gates.num_positions=1024",
        "gates.needle_context_len=null", f"model.checkpoint={ROOT / 'models/pystdlib-llama'}", "--quiet"]


def _build(recipe: str, out: Path, *sets: str):
    args = ["build", str(ROOT / "recipes" / recipe), "--set", f"output_dir={out}"]
    for s in [*FAST[:-1], *sets]:
        args += ["--set", s]
    return runner.invoke(app, args + ["--quiet"])


@pytest.fixture(scope="module")
def smoothquant_artifact(shared_build) -> Path:
    """The SmoothQuant recipe built as test_recipes.py builds it (once per test run)."""
    res = shared_build("quickstart-smoothquant.yaml", FAST[:-1])
    assert res.exit_code == 0, res.output
    return res.path


def test_manifest_records_calibration_and_gates(smoothquant_artifact):
    m = json.loads((smoothquant_artifact / "manifest.json").read_text())
    q = m["quantization"]
    assert q["algo"] == "smoothquant"
    assert q["calibration"]["num_samples"] == 8 and q["calibration"]["seed"] == 0
    assert len(q["calibration"]["sha256"]) == 64
    assert q["gates"]["passed"] and q["gates"]["num_positions"] >= 1024
    names = {g["name"]: g["status"] for g in q["gates"]["metrics"]}
    assert names == {"kl": "pass", "top1_agreement": "pass", "ppl_ratio": "pass", "greedy_agreement": "pass",
                     "greedy_topk_agreement": "info"}
    assert "Quality gates against the unquantized model" in (smoothquant_artifact / "report.md").read_text()


def test_gate_command_against_checkpoint(smoothquant_artifact, tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_BUILDER_CACHE", str(tmp_path / "cache"))
    args = ["gate", str(smoothquant_artifact), "--baseline", str(ROOT / "models/pystdlib-llama"),
            "--num-positions", "512", "--json", "--quiet"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    kl = next(g for g in report["metrics"] if g["name"] == "kl")
    assert report["passed"] and 0 < kl["value"] < 0.03
    assert report["baseline_cache"]["hits"] == 0 and report["baseline_cache"]["misses"] > 0
    again = json.loads(runner.invoke(app, args).output)  # the baseline comes from the cache this time
    assert again["baseline_cache"]["misses"] == 0 and again["baseline_cache"]["hits"] > 0
    assert again["metrics"] == report["metrics"]


def test_gate_command_refuses_a_baseline_that_is_not_the_source(smoothquant_artifact, tmp_path, monkeypatch):
    import shutil

    monkeypatch.setenv("LLM_BUILDER_CACHE", str(tmp_path / "cache"))
    other = tmp_path / "other"
    shutil.copytree(ROOT / "models/pystdlib-llama", other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rms_norm_eps": config["rms_norm_eps"] * 2}))
    args = ["gate", str(smoothquant_artifact), "--baseline", str(other), "--num-positions", "256", "--quiet"]
    res = runner.invoke(app, args)
    assert res.exit_code == 1, res.output  # an error, not a failed gate
    assert "is not the model the artifact was built from" in res.output and "config.json differs" in res.output
    assert "--any-baseline" in res.output
    res = runner.invoke(app, args + ["--any-baseline"])  # on purpose: gated against the changed model
    assert res.exit_code in (0, 3) and ("gate PASSED" in res.output or "gate FAILED" in res.output), res.output


def test_gate_command_on_a_missing_artifact_is_an_error(tmp_path):
    res = runner.invoke(app, ["gate", str(tmp_path / "missing"), "--baseline", str(ROOT / "models/pystdlib-llama"),
                              "--quiet"])
    assert res.exit_code == 1 and "missing is not a directory" in res.output, res.output  # 3 is a failed gate


@pytest.mark.parametrize("gates,message", [
    ("garbage", "gates: 'garbage' is a string; expected a section"),
    ({"max_kl": "high"}, "gates.max_kl: 'high' is a string; expected a number"),
    ({"max_kll": 1}, "gates.max_kll: unknown key (did you mean 'max_kl'?)")])
def test_gate_command_refuses_a_malformed_gates_section_in_the_manifest(smoothquant_artifact, tmp_path, gates,
                                                                       message):
    """A manifest edited (and re-hashed) to hold a malformed gates section: a one-line error naming the key, exit 1,
    never a traceback."""
    import shutil

    from builder.artifact import manifest_digest

    artifact = tmp_path / "edited"
    shutil.copytree(smoothquant_artifact, artifact)
    manifest = json.loads((artifact / "manifest.json").read_text())
    manifest["recipe"]["gates"] = gates
    del manifest["manifest_sha256"]
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (artifact / "manifest.json").write_text(json.dumps(manifest))
    res = runner.invoke(app, ["gate", str(artifact), "--baseline", str(ROOT / "models/pystdlib-llama"), "--quiet"])
    assert res.exit_code == 1 and "invalid gates section" in res.output and message in res.output, res.output
    assert "Traceback" not in res.output and "ValidationError" not in res.output


def test_gate_command_refuses_a_quantized_baseline_and_knows_the_bundled_model_by_content(smoothquant_artifact):
    from builder.calibration import BUNDLED_MODEL
    from builder.checkpoint import open_checkpoint
    from builder.quality import is_bundled_source

    res = runner.invoke(app, ["gate", str(smoothquant_artifact), "--baseline", str(smoothquant_artifact), "--quiet"])
    assert res.exit_code == 1 and "is itself quantized (smoothquant" in res.output, res.output
    files = open_checkpoint(BUNDLED_MODEL).file_hashes()
    assert is_bundled_source({"source": {"checkpoint": "elsewhere/pystdlib-llama", "files": files}})
    changed = {**files, "config.json": "0" * 64}
    assert not is_bundled_source({"source": {"checkpoint": str(BUNDLED_MODEL), "files": changed}})


def test_regression_blocks_the_build(tmp_path):
    from runtime import ArtifactError, Engine

    out = tmp_path / "blocked"
    res = _build("quickstart-fp8.yaml", out, "gates.max_kl=1e-9")
    assert res.exit_code == 3  # EXIT_GATE_FAILED, documented in the README
    assert "quality gates failed for quickstart-fp8: kl" in res.output and "FAIL" in res.output
    assert "layers with the largest relative output error (on " in res.output and "model.layers." in res.output
    m = json.loads((out / "manifest.json").read_text())
    assert m["quantization"]["gates"]["passed"] is False and m["quantization"]["gates"]["failed"] == ["kl"]
    assert "FAILED" in (out / "report.md").read_text()
    with pytest.raises(ArtifactError, match="failed its quality gates"):
        Engine.load(out)
    Engine.load(out, allow_failed_gate=True)
    res = runner.invoke(app, ["generate", str(out), "--prompt", "def", "--max-tokens", "4"])
    assert res.exit_code == 1 and "--allow-failed-gate" in res.output
    res = runner.invoke(app, ["generate", str(out), "--prompt", "def", "--max-tokens", "4", "--allow-failed-gate"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["gate", str(out), "--baseline", str(ROOT / "models/pystdlib-llama"),
                              "--num-positions", "256", "--quiet"])
    assert res.exit_code == 3 and "gate FAILED (kl" in res.output, res.output  # a failed gate, as builder build


@pytest.mark.parametrize("option, says", [(["--num-positions", "0"], "gates.num_positions: 0"),
                                          (["--num-positions", "-5"], "greater than or equal to 1")])
def test_gate_command_names_a_bad_option_value(smoothquant_artifact, option, says):
    res = runner.invoke(app, ["gate", str(smoothquant_artifact), "--baseline", str(ROOT / "models/pystdlib-llama"),
                              *option, "--quiet"])
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output  # a message, no traceback
    assert "the command's options" in res.output and says in res.output, res.output
