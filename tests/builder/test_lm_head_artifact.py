"""An artifact built with `quantization.lm_head: true` from a tied checkpoint: what the manifest, report,
inspect and compare say, the gates measure the whole model, the runtime loads and generates on the CPU,
and a manifest or graph.json that disagrees about the lm_head is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from builder.cli import app
from builder.compare import compare, render
from builder.pipeline import build
from builder.recipe import validate_recipe
from conftest import make_checkpoint
from runtime import ArtifactError, Engine, SamplingParams
from runtime.artifact import GRAPH, MANIFEST, file_sha256, manifest_digest, open_artifact


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, artifact): a tiny tied Llama, GPTQ 4-bit linears and lm_head, gated (loose thresholds: a
    random model's top-1 is a coin toss; these tests check that the gates run, not the model's quality)."""
    root = tmp_path_factory.mktemp("lm_head")
    ckpt = make_checkpoint(root / "ckpt", "llama", seed=3)
    recipe = validate_recipe({
        "name": "gptq-lm_head", "model": {"checkpoint": str(ckpt), "dtype": "float32"},
        "output_dir": str(root / "art"), "runtime": {"max_seq_len": 128, "max_num_tokens": 32},
        "quantization": {"algo": "gptq", "group_size": 16, "lm_head": True},
        "calibration": {"num_samples": 4, "seq_len": 32, "dataset": "bundled"},
        "gates": {"eval_dataset": "bundled", "num_positions": 64, "window": 32, "greedy_tokens": 4,
                  "needle_context_len": None, "max_kl": 10.0,
                  "min_top1_agreement": 0.0, "max_ppl_ratio": 100.0, "min_greedy_agreement": 0.0}})
    return ckpt, build(recipe).output_dir


def test_manifest_graph_and_weights(built):
    ckpt, path = built
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["quantization"]["lm_head"] == "w4a16" and manifest["recipe"]["quantization"]["lm_head"]
    nodes = json.loads((path / GRAPH).read_text())["nodes"]
    head, emb = (next(n for n in nodes if n["op"] == op) for op in ("lm_head", "embedding"))
    assert head["attrs"]["quant"]["scheme"] == "w4a16" and "weight" not in head["weights"]
    weights = load_file(path / "weights.safetensors")
    stored = load_file(ckpt / "model.safetensors")
    table = stored.get("model.embed_tokens.weight", stored.get("lm_head.weight"))
    assert torch.equal(weights[emb["weights"]["weight"]], table)  # the embedding: the float table, untouched
    assert weights[head["weights"]["qweight"]].dtype == torch.uint8
    assert sum(t.numel() * t.element_size() for t in weights.values()) == manifest["weights"]["bytes"]


def test_gates_and_layer_errors_cover_the_lm_head(built):
    _, path = built
    manifest = json.loads((path / MANIFEST).read_text())
    gates = manifest["quantization"]["gates"]
    assert gates["passed"] and {m["name"] for m in gates["metrics"]} >= {"kl", "top1_agreement"}
    assert next(m for m in gates["metrics"] if m["name"] == "kl")["value"] > 0
    gptq = next(p for p in manifest["build"]["passes"] if p["name"] == "gptq")
    assert gptq["matched"] == 9 and gptq["details"]["num_linears"] == 8 and gptq["details"]["lm_head"]
    assert 0 < gptq["details"]["layer_errors"]["lm_head"] < 0.2  # measured on calibration data, as a linear's


def test_report_inspect_and_compare_show_it(built, tmp_path):
    _, path = built
    report = (path / "report.md").read_text()
    assert "lm_head: quantized (w4a16), untied from the embedding, which stays in float32." in report
    assert "lm_head: quantized (w4a16)" in (path / "report.html").read_text()
    res = CliRunner().invoke(app, ["inspect", str(path)])
    assert res.exit_code == 0 and "quantization  gptq, lm_head w4a16, KV cache auto" in res.output, res.output
    twin = Path(shutil.copytree(path, tmp_path / "twin"))
    c = compare([path, twin])
    sizes = c.entries[0].sizes
    meta = json.loads((path / GRAPH).read_text())["meta"]
    assert sizes.lm_head_quantized and sizes.num_quantized_linears == sizes.num_linears == 8
    head_params = meta["vocab_size"] * meta["hidden_size"]
    assert sizes.quantized_linear_parameters > head_params  # the lm_head counted unpacked, in x out
    assert 4 < sizes.bpw_quantized < 8  # 4-bit codes plus one fp32 scale and a zero per 16 weights: 6.5
    assert "(8/8 linears + lm_head)" in render(c, [], {})["md"]


def test_runtime_loads_and_generates_on_the_cpu(built):
    from conftest import hf_logits

    ckpt, path = built
    engine = Engine.load(path, device="cpu")
    head = next(n for n in engine.executor.graph["nodes"] if n["op"] == "lm_head")
    assert head["attrs"]["quant"]["scheme"] == "w4a16"
    ids = torch.randint(3, 300, (24,), generator=torch.Generator().manual_seed(7)).tolist()
    ref = hf_logits(ckpt, ids)
    err = ((engine.logits(ids) - ref).norm() / ref.norm()).item()
    assert 1e-3 < err < 0.3, err  # int4 linears and lm_head in groups of 16 (measured ~0.2)
    out = engine.generate(ids, SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(out.token_ids) == 8 and all(0 <= t < ref.shape[-1] for t in out.token_ids)


def _tamper(src: Path, dst: Path, edit_manifest=None, edit_graph=None) -> Path:
    """A copy with graph.json and/or the manifest edited, every hash recomputed (a careful tamperer)."""
    path = Path(shutil.copytree(src, dst))
    m = json.loads((path / MANIFEST).read_text())
    if edit_graph is not None:
        graph = json.loads((path / GRAPH).read_text())
        edit_graph(next(n for n in graph["nodes"] if n["op"] == "lm_head"))
        (path / GRAPH).write_text(json.dumps(graph))
        m["files"][GRAPH] = {"bytes": (path / GRAPH).stat().st_size, "sha256": file_sha256(path / GRAPH)}
    if edit_manifest is not None:
        edit_manifest(m["quantization"])
    m["manifest_sha256"] = manifest_digest(m)
    (path / MANIFEST).write_text(json.dumps(m))
    return path


@pytest.mark.parametrize("case, needle", [
    ("manifest says none", "quantization.lm_head is 'none'; allowed: graph.json's lm_head scheme ('w4a16')"),
    ("manifest key dropped", "quantization.lm_head is missing; allowed: graph.json's lm_head scheme ('w4a16')"),
    ("unknown scheme", "quantization.lm_head is 'int3'; allowed: one of none, w4a16, w8a16, w8a8_int8, fp8"),
    ("graph scheme unknown", "graph.json lm_head lm_head: quant scheme 'w3a16' is not one this runtime executes"),
    ("graph scales dropped", "a w4a16 lm_head needs scales"),
    ("graph shape edited", "disagree with the quantized lm_head's out_features x in_features"),
])
def test_a_disagreeing_lm_head_is_refused(built, tmp_path, case, needle):
    _, path = built
    edits = {
        "manifest says none": dict(edit_manifest=lambda q: q.__setitem__("lm_head", "none")),
        "manifest key dropped": dict(edit_manifest=lambda q: q.pop("lm_head")),
        "unknown scheme": dict(edit_manifest=lambda q: q.__setitem__("lm_head", "int3")),
        "graph scheme unknown": dict(edit_graph=lambda n: n["attrs"]["quant"].__setitem__("scheme", "w3a16")),
        "graph scales dropped": dict(edit_graph=lambda n: n["weights"].pop("scales")),
        "graph shape edited": dict(edit_graph=lambda n: n["attrs"].__setitem__("in_features", 32)),
    }
    bad = _tamper(path, tmp_path / "bad", **edits[case])
    with pytest.raises(ArtifactError) as info:
        open_artifact(bad)
    assert needle in str(info.value), str(info.value)
