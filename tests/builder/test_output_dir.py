"""`builder build` replaces only a previous artifact (or an empty directory) at output_dir, never user data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from builder.artifact import TEMP_MARKER, OutputDirError, temp_dirs
from builder.cli import app
from conftest import build_artifact, make_checkpoint
from runtime import Engine
from runtime.artifact import MANIFEST

runner = CliRunner()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", "llama")


def _recipe(tmp_path: Path, checkpoint: Path, out: Path) -> Path:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps({"name": "tiny", "model": {"checkpoint": str(checkpoint), "dtype": "float32"},
                                  "output_dir": str(out), "runtime": {"max_seq_len": 128, "max_num_tokens": 32}}))
    return recipe


def _build(tmp_path: Path, checkpoint: Path, out: Path, *args: str):
    return runner.invoke(app, ["build", str(_recipe(tmp_path, checkpoint, out)), "--quiet", *args])


@pytest.fixture
def no_build(monkeypatch):
    """Refusals must come before the build spends any time."""
    import builder.pipeline

    def fail(*args, **kwargs):
        raise AssertionError("the build ran")

    monkeypatch.setattr(builder.pipeline, "build", fail)


def _refused(res, *needles: str) -> None:
    assert res.exit_code == 1, res.output
    assert isinstance(res.exception, SystemExit), res.exception  # a message, not a traceback
    assert "Traceback" not in res.output
    for needle in needles:
        assert needle in res.output


def test_non_artifact_directory_is_refused(tmp_path, checkpoint, no_build):
    out = tmp_path / "mine"
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("my notes")
    (out / "sub" / "data.bin").write_bytes(b"\x00" * 10)
    res = _build(tmp_path, checkpoint, out)
    _refused(res, str(out), "is not an llm-builder artifact", "notes.txt", "--overwrite")
    assert (out / "notes.txt").read_text() == "my notes" and (out / "sub" / "data.bin").stat().st_size == 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "recipe.yaml"]


def test_directory_with_a_corrupt_manifest_is_refused(tmp_path, checkpoint, no_build):
    out = tmp_path / "mine"
    out.mkdir()
    (out / MANIFEST).write_text('{"format": "llm-builder-engine"')  # does not parse: not known to be ours
    _refused(_build(tmp_path, checkpoint, out), "is not an llm-builder artifact")
    assert (out / MANIFEST).exists()


def test_file_is_refused(tmp_path, checkpoint, no_build):
    out = tmp_path / "model.bin"
    out.write_bytes(b"precious")
    _refused(_build(tmp_path, checkpoint, out), str(out), "is a file, not a directory", "--overwrite")
    assert out.read_bytes() == b"precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.bin", "recipe.yaml"]


def test_symlink_is_refused(tmp_path, checkpoint, no_build):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("keep")
    out = tmp_path / "link"
    out.symlink_to(target)
    _refused(_build(tmp_path, checkpoint, out), "is a symbolic link", str(target))
    assert out.is_symlink() and (target / "keep.txt").read_text() == "keep"


@pytest.mark.parametrize("which", [0, 1], ids=["building", "old"])
def test_users_directory_named_like_a_staging_directory_is_refused(tmp_path, checkpoint, no_build, which):
    out = tmp_path / "art"
    staging = temp_dirs(out)[which]
    staging.mkdir()
    (staging / "keep.txt").write_text("keep")
    _refused(_build(tmp_path, checkpoint, out), str(staging), "was not made by `builder build`")
    assert (staging / "keep.txt").read_text() == "keep"


def test_previous_artifact_and_leftovers_are_replaced(tmp_path, checkpoint):
    out = tmp_path / "art"
    out.mkdir()  # an empty directory is fine to use
    res = _build(tmp_path, checkpoint, out)
    assert res.exit_code == 0, res.output
    assert not (out / TEMP_MARKER).exists()
    first = json.loads((out / MANIFEST).read_text())
    assert TEMP_MARKER not in first["files"]
    # a previous artifact counts as one even when damaged; an interrupted build's staging directory is ours
    (out / "weights.safetensors").unlink()
    building, old = temp_dirs(out)
    building.mkdir()
    (building / TEMP_MARKER).write_text("")
    (building / "graph.json").write_text("{}")
    res = _build(tmp_path, checkpoint, out, "--set", "runtime.max_batch_size=3")
    assert res.exit_code == 0, res.output
    assert json.loads((out / MANIFEST).read_text())["runtime"]["max_batch_size"] == 3
    assert not building.exists() and not old.exists() and not (out / TEMP_MARKER).exists()
    assert Engine.load(out).limits.max_batch_size == 3


@pytest.mark.parametrize("kind", ["directory", "file"])
def test_overwrite_replaces_anything(tmp_path, checkpoint, kind):
    out = tmp_path / "art"
    if kind == "directory":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    else:
        out.write_text("mine")
    res = _build(tmp_path, checkpoint, out, "--overwrite")
    assert res.exit_code == 0, res.output
    assert not (out / "notes.txt").exists()
    Engine.load(out)


def test_output_dir_changed_during_the_build_is_refused_at_write_time(tmp_path, checkpoint, monkeypatch):
    """Someone puts files in output_dir while the build runs: the swap refuses and they stay."""
    import builder.artifact

    out = tmp_path / "art"
    real = builder.artifact._write_contents

    def write_and_interfere(tmp, *args):
        real(tmp, *args)
        out.mkdir()
        (out / "notes.txt").write_text("mine")

    monkeypatch.setattr(builder.artifact, "_write_contents", write_and_interfere)
    with pytest.raises(OutputDirError, match="is not an llm-builder artifact"):
        build_artifact(checkpoint, out)
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


@pytest.mark.parametrize("where", ["the checkpoint", "above the checkpoint", "the working directory"])
def test_an_output_dir_that_is_or_holds_an_input_is_refused_even_with_overwrite(tmp_path, checkpoint, where,
                                                                                no_build, monkeypatch):
    import shutil

    copy = tmp_path / "inputs" / "ckpt"
    shutil.copytree(checkpoint, copy)
    out = {"the checkpoint": copy, "above the checkpoint": copy.parent, "the working directory": tmp_path / "wd"}[where]
    out.mkdir(exist_ok=True)
    monkeypatch.chdir(tmp_path / "wd" if where == "the working directory" else tmp_path)
    res = _build(tmp_path, copy, out, "--overwrite")
    _refused(res, str(out), "would destroy it")
    assert (copy / "config.json").is_file()  # nothing was deleted


def test_an_output_dir_nothing_can_be_written_beside_is_refused_before_the_build(tmp_path, checkpoint, no_build):
    out = Path("/proc/llm-builder-test/out")  # a place no one may create files in (root included)
    _refused(_build(tmp_path, checkpoint, out), str(out), "cannot write in /proc")


def test_a_draft_artifact_travels_as_the_files_its_manifest_lists(artifacts, tmp_path):
    """What someone added to the draft's directory (a file, a link out of it) stays out of the new artifact."""
    import os
    import shutil

    from builder.artifact import _copy_artifact
    from runtime.artifact import open_artifact

    draft = tmp_path / "draft"
    shutil.copytree(artifacts["llama"], draft)
    (draft / "junk").mkdir()
    (draft / "junk" / "x.txt").write_text("not the draft's")
    os.symlink("/etc/hostname", draft / "leak")
    _copy_artifact(draft, tmp_path / "copy")
    listed = set(json.loads((draft / MANIFEST).read_text())["files"]) | {MANIFEST}
    copied = {str(p.relative_to(tmp_path / "copy")) for p in (tmp_path / "copy").rglob("*") if p.is_file()}
    assert copied == listed and not any(p.is_symlink() for p in (tmp_path / "copy").rglob("*"))
    open_artifact(tmp_path / "copy")  # intact
