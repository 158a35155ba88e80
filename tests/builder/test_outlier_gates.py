"""On the outlier variant of the bundled model, naive static INT8 W8A8 fails the default gate and
SmoothQuant passes it (the reason SmoothQuant exists)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from builder.cli import app
from conftest import BUNDLED, hf_logits, make_outlier_variant

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


@pytest.fixture(scope="module")
def outlier_checkpoint(tmp_path_factory) -> Path:
    return make_outlier_variant(tmp_path_factory.mktemp("outliers") / "ckpt")


def test_variant_computes_the_same_function(outlier_checkpoint):
    ids = torch.randint(7, 4096, (48,), generator=torch.Generator().manual_seed(2)).tolist()
    assert (hf_logits(outlier_checkpoint, ids) - hf_logits(BUNDLED, ids)).abs().max() < 1e-4


@pytest.mark.parametrize("smoothing,exit_code", [(False, 3), (True, 0)])
def test_naive_w8a8_fails_smoothquant_passes(outlier_checkpoint, tmp_path, smoothing, exit_code):
    sets = [f"model.checkpoint={outlier_checkpoint}", f"output_dir={tmp_path / 'a'}",
            f"quantization.smoothing={str(smoothing).lower()}", "quantization.activations=static",
            "calibration.num_samples=16", "gates.num_positions=2048", "gates.needle_context_len=null",
            "calibration.dataset=bundled", "gates.eval_dataset=bundled"]  # a copy of the bundled model, its text
    args = ["build", str(ROOT / "recipes/quickstart-smoothquant.yaml"), "--quiet"]
    for s in sets:
        args += ["--set", s]
    res = runner.invoke(app, args)
    assert res.exit_code == exit_code, res.output
    if not smoothing:
        assert "quality gates failed" in res.output and "top1_agreement" in res.output
