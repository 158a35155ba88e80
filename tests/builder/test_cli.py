"""The CLI end to end on the bundled model: build the quickstart recipe, generate, inspect."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from builder.cli import app

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "quickstart"
    res = runner.invoke(app, ["build", str(ROOT / "recipes/quickstart.yaml"), "--quiet",
                              "--set", f"output_dir={out}",
                              "--set", f"model.checkpoint={ROOT / 'models/pystdlib-llama'}"])
    assert res.exit_code == 0, res.output
    return out


def test_build_writes_a_complete_artifact(quickstart):
    m = json.loads((quickstart / "manifest.json").read_text())
    assert m["build"]["verify"]["max_abs_logit_err"] <= 1e-4
    assert [p["name"] for p in m["build"]["passes"]] == ["merge_qkv", "merge_gate_up", "fuse_silu_mul",
                                                         "fuse_add_rms_norm", "dce", "verify"]
    html = (quickstart / "report.html").read_text()
    assert "Build report" in html and "merge_qkv" in html and "passed" in html
    assert "fused_add_rms_norm" in (quickstart / "report.md").read_text()


def test_generate_prints_text(quickstart):
    res = runner.invoke(app, ["generate", str(quickstart), "--prompt", "def fibonacci(n):", "--max-tokens", "32"])
    assert res.exit_code == 0, res.output
    assert res.output.startswith("def fibonacci(n):")
    assert len(res.output.strip()) > len("def fibonacci(n):") + 10


def test_inspect_shows_manifest_and_report(quickstart):
    res = runner.invoke(app, ["inspect", str(quickstart)])
    assert res.exit_code == 0, res.output
    for needle in ("integrity verified", "LlamaForCausalLM", "merge_qkv -> merge_gate_up", "report.html",
                   "weights.safetensors", "max |logit err|"):
        assert needle in res.output
    res = runner.invoke(app, ["inspect", str(quickstart), "--graph"])
    assert "attention(%" in res.output


def test_bad_recipe_and_missing_checkpoint_exit_with_message(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  checkpoint: nowhere/model\noutput_dir: o\nquantization:\n  algo: awk\n")
    res = runner.invoke(app, ["build", str(bad)])
    assert res.exit_code == 1
    assert "quantization.algo: 'awk' is not one of awq, gptq, smoothquant, fp8, int8_wo, none" in res.output
    res = runner.invoke(app, ["build", str(bad), "--set", "quantization.algo=none", "--quiet"])
    assert res.exit_code == 1 and "does not exist" in res.output and "download" in res.output
    assert not (tmp_path / "o").exists()


def test_failed_build_keeps_previous_artifact(quickstart, monkeypatch):
    """A build that fails verification leaves the existing artifact untouched."""
    import passes.verify

    real = passes.verify.run_graph
    monkeypatch.setattr(passes.verify, "run_graph", lambda g, p: [x + 0.01 for x in real(g, p)])
    before = (quickstart / "manifest.json").read_bytes()
    res = runner.invoke(app, ["build", str(ROOT / "recipes/quickstart.yaml"), "--quiet",
                              "--set", f"output_dir={quickstart}",
                              "--set", f"model.checkpoint={ROOT / 'models/pystdlib-llama'}"])
    assert res.exit_code == 1 and "logits differ" in res.output
    assert (quickstart / "manifest.json").read_bytes() == before


def test_serve_delegates_to_the_runtime_server(monkeypatch, tmp_path):
    import runtime.serve

    seen = []
    monkeypatch.setattr(runtime.serve, "main", lambda argv: seen.append(argv) or 0)
    res = runner.invoke(app, ["serve", str(tmp_path), "--port", "9001", "--api-key", "k", "--max-num-seqs", "4",
                              "--kv-cache-memory", "512MiB", "--no-prefix-caching", "--request-timeout", "2.5"])
    assert res.exit_code == 0, res.output
    args = runtime.serve.build_parser().parse_args(seen[0])
    assert (args.artifact, args.host, args.port, args.api_key) == (str(tmp_path), "127.0.0.1", 9001, "k")
    assert (args.max_num_seqs, args.kv_cache_memory, args.no_prefix_caching, args.request_timeout) == (
        4, 512 << 20, True, 2.5)
    assert (args.max_num_batched_tokens, args.num_blocks, args.allow_failed_gate) == (None, None, False)
    res = runner.invoke(app, ["serve", str(tmp_path), "--api-key", "-starts-with-a-dash", "--served-model-name", "-m"])
    assert res.exit_code == 0, res.output  # values that look like options travel as --flag=value
    args = runtime.serve.build_parser().parse_args(seen[1])
    assert (args.api_key, args.served_model_name) == ("-starts-with-a-dash", "-m")


def test_serve_missing_artifact_exits_1(tmp_path):
    res = runner.invoke(app, ["serve", str(tmp_path / "missing")])
    assert res.exit_code == 1 and "missing" in res.output


def test_html_report_escapes_manifest_text(quickstart):
    """Names and paths from the recipe reach the HTML report escaped, never as markup."""
    from builder.report import render_reports
    from passes.ir import Graph

    m = json.loads((quickstart / "manifest.json").read_text())
    m["name"] = "<script>alert(1)</script>"
    graph = Graph.from_dict(json.loads((quickstart / "graph.json").read_text()))
    html = render_reports(m, graph)["report.html"]
    assert "<script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html


@pytest.mark.parametrize("value", ["0", "-2", "2.5", "four"])
def test_bench_latency_refuses_bad_batch_sizes(value, tmp_path):
    """Refused while parsing, before any artifact is read: the message names the option, the value and what
    is allowed."""
    res = runner.invoke(app, ["bench", "latency", str(tmp_path / "missing"), "--device", "cpu",
                              "--batch-size", "2", "--batch-size", value])
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.replace("│", " ").split())  # the error box wraps lines
    assert f"Invalid value for '--batch-size': '{value}' is not a batch size: give whole numbers of 1 or more" in text


def test_bench_latency_batch_sizes_need_four_output_tokens(tmp_path):
    res = runner.invoke(app, ["bench", "latency", str(tmp_path / "missing"), "--device", "cpu", "--batch-size", "2",
                              "--output-len", "3"])
    assert res.exit_code == 1 and "--output-len 3: --batch-size needs at least 4" in res.output, res.output


@pytest.mark.parametrize("command, option", [("latency", "--input-len"), ("latency", "--output-len"),
                                             ("latency", "--repeats"), ("throughput", "--input-len"),
                                             ("throughput", "--output-len"), ("throughput", "--num-prompts")])
def test_bench_refuses_counts_below_one_while_parsing(command, option, tmp_path):
    res = runner.invoke(app, ["bench", command, str(tmp_path / "missing"), "--device", "cpu", option, "0"])
    assert res.exit_code == 2, res.output
    assert f"Invalid value for '{option}'" in " ".join(res.output.replace("│", " ").split())


def test_bench_refuses_a_prompt_past_the_context_and_an_unwritable_record(quickstart, tmp_path):
    res = runner.invoke(app, ["bench", "throughput", str(quickstart), "--device", "cpu", "--input-len", "8",
                              "--output-len", "2", "--concurrency", "1", "--record", "/proc/nope/x.jsonl"])
    assert res.exit_code == 1 and "--record /proc/nope/x.jsonl: not a file that can be appended to" in res.output
    res = runner.invoke(app, ["bench", "latency", str(quickstart), "--device", "cpu", "--input-len", "5000",
                              "--output-len", "2", "--repeats", "1"])
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output  # a message, no traceback
    assert "the prompt has 5000 tokens" in res.output and "--input-len 5000" in res.output
