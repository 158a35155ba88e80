"""The CLI's own arguments and options, given carelessly or hostilely: each is refused with a one-line error and the
documented exit code (1 an error, 2 a usage error), never a traceback, a corrupted artifact or a recorded figure that
does not measure what its name says."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from builder.cli import app

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


@pytest.fixture(scope="module")
def quickstart(shared_build) -> Path:
    """The quickstart recipe built once per test run (``shared_build``): read it, copy it to change it."""
    res = shared_build("quickstart.yaml", [f"model.checkpoint={ROOT / 'models/pystdlib-llama'}"])
    assert res.exit_code == 0, res.output
    return res.path


def _text(res) -> str:
    return " ".join(res.output.replace("│", " ").split())  # rich's error box wraps lines


def _refused(res, code: int = 1) -> str:
    assert res.exit_code == code, res.output
    assert isinstance(res.exception, SystemExit), res.exception  # a message, no traceback
    return _text(res)


@pytest.mark.parametrize("command", ["latency", "throughput"])
def test_bench_refuses_outputs_past_max_seq_len_before_measuring(quickstart, tmp_path, command):
    """8 prompt tokens + 12 to generate under --max-seq-len 16: the requests would stop after 8 tokens while the
    figures are named and reported as 12-token outputs."""
    record = tmp_path / "benchmarks.jsonl"
    extra = ["--repeats", "1"] if command == "latency" else ["--concurrency", "1", "--num-prompts", "1"]
    res = runner.invoke(app, ["bench", command, str(quickstart), "--device", "cpu", "--input-len", "8",
                              "--output-len", "12", "--max-seq-len", "16", "--record", str(record), *extra])
    text = _refused(res)
    assert "the prompt has 8 tokens and 12 are to be generated: 20 is past max_seq_len 16" in text
    assert not record.exists()


def test_bench_latency_refuses_a_single_output_token(quickstart, tmp_path):
    """One output token is the prefill's: no decode step is timed, and the decode rate came out 0 tok/s."""
    record = tmp_path / "benchmarks.jsonl"
    res = runner.invoke(app, ["bench", "latency", str(quickstart), "--device", "cpu", "--input-len", "8",
                              "--output-len", "1", "--repeats", "1", "--record", str(record)])
    assert "Invalid value for '--output-len'" in _refused(res, 2)
    assert not record.exists()


@pytest.mark.parametrize("option, name", [("--record", "manifest.json"), ("--json", "results.jsonl")])
def test_bench_refuses_to_write_figures_into_the_artifact_it_measures(quickstart, tmp_path, option, name):
    quickstart = shutil.copytree(quickstart, tmp_path / "quickstart")  # a copy: the shared build is read only
    manifest = (quickstart / "manifest.json").read_bytes()
    res = runner.invoke(app, ["bench", "latency", str(quickstart), "--device", "cpu", "--input-len", "8",
                              "--output-len", "4", "--repeats", "1", option, str(quickstart / name)])
    assert f"{option} {quickstart / name} is inside the artifact" in _refused(res)
    assert (quickstart / "manifest.json").read_bytes() == manifest
    assert sorted(p.name for p in quickstart.iterdir()) == ["graph.json", "manifest.json", "report.html",
                                                            "report.md", "tokenizer", "weights.safetensors"]


@pytest.mark.parametrize("command", ["latency", "throughput"])
@pytest.mark.parametrize("where", ["missing directory", "a directory"])
def test_bench_json_that_cannot_be_written_is_refused_before_measuring(quickstart, tmp_path, command, where):
    path = tmp_path / "missing" / "results.jsonl" if where == "missing directory" else tmp_path
    extra = ["--repeats", "1"] if command == "latency" else ["--concurrency", "1", "--num-prompts", "1"]
    res = runner.invoke(app, ["bench", command, str(quickstart), "--device", "cpu", "--input-len", "8",
                              "--output-len", "4", "--json", str(path), *extra])
    assert f"--json {path}: not a file that can be appended to" in _refused(res)
    assert "input_len" not in res.output  # nothing was measured


def test_bench_throughput_refuses_a_concurrency_the_kv_pool_cannot_hold(quickstart):
    """--concurrency 10**12 built a warm-up wave of 10**12 prompts: a RuntimeError traceback (out of memory). Now
    its memory plan is refused at load (the workspace for 10**12 sequences' logits), and a concurrency the plan fits
    but the KV pool cannot hold (10**5 sequences, 16,384 blocks) is refused before the warm-up wave."""
    res = runner.invoke(app, ["bench", "throughput", str(quickstart), "--device", "cpu", "--input-len", "8",
                              "--output-len", "4", "--concurrency", str(10**12), "--num-prompts", "1"])
    assert "the CPU memory plan needs" in _refused(res) and "Lower max_num_seqs" in _text(res)
    res = runner.invoke(app, ["bench", "throughput", str(quickstart), "--device", "cpu", "--input-len", "8",
                              "--output-len", "4", "--concurrency", str(10**5), "--num-prompts", "1"])
    assert f"concurrency {10**5}: the KV pool's" in _refused(res)
    assert "give a concurrency of at most" in _text(res)


@pytest.mark.parametrize("args, given", [(["--num-prompts", str(10**12)], f"--num-prompts {10**12}"),
                                         (["--waves", str(10**9)], f"--waves {10**9} x --concurrency 2")])
def test_bench_throughput_refuses_more_prompts_than_it_can_make(quickstart, args, given):
    """--num-prompts 10**12 (or --waves x --concurrency past it) made every prompt up front: an allocator's
    traceback. Refused before the engine loads, naming the options and the bound."""
    res = runner.invoke(app, ["bench", "throughput", str(quickstart), "--device", "cpu", "--input-len", "8",
                              "--output-len", "4", "--concurrency", "2", *args])
    assert f"{given} asks for" in _refused(res)
    assert "requests at one point; at most 1,000,000" in _text(res)


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999", "http://127.0.0.1:abc", "http://127.0.0.1:8000\n",
                                 "http://[::1", "http://127.0.0.1:8000/v1?key=1"])
def test_bench_serve_refuses_a_malformed_url(url):
    """A port past 65535 (OverflowError), not a number or a newline (httpx InvalidURL), an unclosed IPv6 bracket
    (ValueError) were tracebacks; a query string was glued before /v1/models."""
    res = runner.invoke(app, ["bench", "serve", "--url", url, "--quiet"])
    assert f"--url {url!r} is not an http(s) base URL" in _refused(res)


@pytest.mark.parametrize("where", ["missing directory", "a directory"])
def test_bench_serve_json_that_cannot_be_written_is_refused_before_the_run(tmp_path, where):
    """Checked before any request is sent (the server here is not even up), not after the run's minutes."""
    path = tmp_path / "missing" / "serve.json" if where == "missing directory" else tmp_path
    res = runner.invoke(app, ["bench", "serve", "--url", "http://127.0.0.1:9", "--json", str(path), "--quiet"])
    assert f"--json {path}: not a file that can be written" in _refused(res)


@pytest.mark.parametrize("command", ["latency", "throughput"])
def test_bench_records_each_point_once_when_an_option_repeats_it(quickstart, tmp_path, command):
    """--input-len 8 --input-len 8 (or --concurrency 1 twice) measured and recorded each figure twice, with two
    different values under one name in one run."""
    record = tmp_path / "benchmarks.jsonl"
    twice = (["--input-len", "8", "--input-len", "8", "--repeats", "1"] if command == "latency"
             else ["--input-len", "8", "--concurrency", "1", "--concurrency", "1", "--num-prompts", "1"])
    res = runner.invoke(app, ["bench", command, str(quickstart), "--device", "cpu", "--output-len", "4",
                              "--record", str(record), *twice])
    assert res.exit_code == 0, res.output
    figures = [json.loads(line)["figure"] for line in record.read_text().splitlines()]
    assert len(figures) == len(set(figures)) > 0, figures
    flag = "--input-len" if command == "latency" else "--concurrency"
    assert json.loads(record.read_text().splitlines()[0])["command"].count(flag) == 1


@pytest.mark.parametrize("kind", ["a directory", "not a regular file", "missing"])
def test_gate_checks_the_eval_dataset_before_tracing_the_baseline(quickstart, tmp_path, monkeypatch, kind):
    """--eval-dataset DIR said 'does not exist', and only after the baseline was traced; it is now named for
    what it is, before any model is loaded."""
    import builder.quality

    def traced(*args, **kwargs):
        raise AssertionError("the baseline was traced before --eval-dataset was checked")

    monkeypatch.setattr(builder.quality, "gate_artifact", traced)
    path = {"a directory": tmp_path, "not a regular file": Path("/dev/null"), "missing": tmp_path / "x.txt"}[kind]
    what = {"a directory": "is a directory", "not a regular file": "is not a regular file",
            "missing": "does not exist"}[kind]
    res = runner.invoke(app, ["gate", str(quickstart), "--baseline", str(ROOT / "models/pystdlib-llama"),
                              "--eval-dataset", str(path)])
    assert f"--eval-dataset: data file '{path}' {what}; give a .txt or .jsonl file" in _refused(res)
