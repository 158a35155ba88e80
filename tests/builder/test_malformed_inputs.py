"""Malformed recipes and checkpoints: `builder build` exits 1 with a one-line message, no traceback,
and fails before any expensive step (reading weights, running passes)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from builder.cli import app
from conftest import make_checkpoint

runner = CliRunner()


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("malformed") / "llama", "llama")


def _recipe(tmp_path: Path, checkpoint: Path, extra: str = "") -> Path:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model:\n  checkpoint: {checkpoint}\n  dtype: float32\noutput_dir: {tmp_path / 'out'}\n"
                      f"runtime:\n  max_seq_len: 256\n{extra}")
    return recipe


def _build_error(recipe: Path, *args: str) -> str:
    """Run `builder build`; check it failed cleanly, and return its one-line error message."""
    res = runner.invoke(app, ["build", str(recipe), "--quiet", *args])
    assert isinstance(res.exception, SystemExit), f"uncaught {res.exception!r}\n{res.output}"
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert not (recipe.parent / "out").exists()
    return lines[0]


@pytest.fixture
def no_expensive_steps(monkeypatch):
    """Reading the weights or running a pass fails the test: the error must come before them."""
    import builder.pipeline

    def forbidden(*args, **kwargs):
        raise AssertionError("the build went on to read weights or run passes")

    monkeypatch.setattr(builder.pipeline, "attach_weights", forbidden)
    monkeypatch.setattr(builder.pipeline, "run_passes", forbidden)


@pytest.mark.parametrize("section, message", [
    ("quantization:\n  algo: int8_wo\n  targets: ['re:nothing']\n",
     "quantization (algo int8_wo) selects no linear: targets ['re:nothing'] match none of the 14 linears "
     "(names look like 'model.layers.0.self_attn.q_proj')"),
    ("quantization:\n  - algo: gptq\n    group_size: 16\n    targets: ['re:mlp']\n  - algo: fp8\n"
     "    ignore: ['re:layers']\n", "quantization[1] (algo fp8) selects no linear: ignore ['re:layers'] excludes"),
    ("quantization:\n  algo: awq\n  group_size: 48\n", "awq: model.layers.0.self_attn.q_proj has in_features 64, "
                                                       "not divisible by group_size 48"),
])
def test_quantization_that_cannot_apply_fails_before_any_pass(tmp_path, base_checkpoint, no_expensive_steps,
                                                              section, message):
    assert message in _build_error(_recipe(tmp_path, base_checkpoint, section))
