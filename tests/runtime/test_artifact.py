"""Artifact integrity: a modified, truncated or re-versioned artifact is refused with a clear error."""

from __future__ import annotations

import json
import shutil

import pytest

from runtime import ArtifactError, Engine
from runtime.artifact import MANIFEST, manifest_digest


@pytest.fixture
def artifact_copy(artifacts, tmp_path):
    dst = tmp_path / "a"
    shutil.copytree(artifacts["llama"], dst)
    return dst


def test_manifest_contents(artifacts):
    m = json.loads((artifacts["qwen3"] / MANIFEST).read_text())
    assert m["format_version"] == 1 and m["versions"]["torch"]
    assert len(m["recipe_sha256"]) == 64 and m["recipe"]["model"]["dtype"] == "float32"
    assert set(m["files"]) >= {"graph.json", "weights.safetensors", "tokenizer/tokenizer.json", "report.md",
                               "report.html"}
    assert all(len(f["sha256"]) == 64 for f in m["files"].values())
    assert m["source"]["files"]["model.safetensors"] and m["source"]["config"]["model_type"] == "qwen3"
    assert m["model"]["num_layers"] == 2 and m["model"]["head_dim"] == 24
    assert m["build"]["verify"]["max_abs_logit_err"] < 1e-4
    assert [p["name"] for p in m["build"]["passes"]][-1] == "verify"


def test_loads_clean(artifact_copy):
    Engine.load(artifact_copy)


def test_modified_weight_file_refused(artifact_copy):
    f = artifact_copy / "weights.safetensors"
    data = bytearray(f.read_bytes())
    data[-10] ^= 0xFF  # same size, one byte flipped
    f.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="weights.safetensors was modified after the build"):
        Engine.load(artifact_copy)


def test_truncated_weight_file_refused(artifact_copy):
    f = artifact_copy / "weights.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ArtifactError, match="truncated"):
        Engine.load(artifact_copy)


def test_modified_manifest_refused(artifact_copy):
    f = artifact_copy / MANIFEST
    m = json.loads(f.read_text())
    m["runtime"]["max_seq_len"] = 100000
    f.write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="manifest.json was modified after the build"):
        Engine.load(artifact_copy)


def test_other_format_version_refused(artifact_copy):
    f = artifact_copy / MANIFEST
    m = json.loads(f.read_text())
    m["format_version"] = 99
    m["manifest_sha256"] = manifest_digest(m)
    f.write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="format version 99 is not supported"):
        Engine.load(artifact_copy)


def test_missing_file_and_not_an_artifact(artifact_copy, tmp_path):
    (artifact_copy / "graph.json").unlink()
    with pytest.raises(ArtifactError, match="graph.json is missing"):
        Engine.load(artifact_copy)
    with pytest.raises(ArtifactError, match="has no manifest.json"):
        Engine.load(tmp_path)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / MANIFEST).write_text("{not json")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        Engine.load(tmp_path / "bad")
