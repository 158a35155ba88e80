"""`builder compare`: a report over three real builds of the bundled model (fp32, fp8, gptq).

Every expected value is read back from the artifacts' manifests (or computed here from them), never
copied from a report.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from builder.cli import app
from builder.compare import pareto_front, read_bench_file
from runtime.artifact import manifest_digest

ROOT = Path(__file__).resolve().parents[2]
FAST = ["calibration.num_samples=8", "calibration.seq_len=128", "gates.num_positions=1024",
        "gates.needle_context_len=null"]
# key -> (recipe, overrides). fp8's top-1 threshold is set out of reach so one gate FAILs.
BUILDS = {
    "fp32": ("quickstart.yaml", []),
    "fp8": ("quickstart-fp8.yaml", FAST + ["gates.min_top1_agreement=0.999"]),
    # GPTQ beats rounding to nearest on the bundled model from about 4,096 calibration tokens (test_recipes.py)
    "gptq": ("quickstart-gptq.yaml", FAST + ["calibration.num_samples=16", "calibration.seq_len=256"]),
}
runner = CliRunner()


@pytest.fixture(scope="module")
def built(shared_build) -> dict[str, Path]:
    """The three builds by ``builder build`` (fp32 and gptq as test_recipes.py builds them: once per test run)."""
    out = {}
    for key, (recipe, sets) in BUILDS.items():
        res = shared_build(recipe, [f"model.checkpoint={ROOT / 'models/pystdlib-llama'}", *sets])
        assert res.exit_code == (3 if key == "fp8" else 0), f"{key}: {res.output}"  # 3: built, a gate failed
        out[key] = res.path
    return out


@pytest.fixture(scope="module")
def manifests(built) -> dict[str, dict]:
    return {k: json.loads((p / "manifest.json").read_text()) for k, p in built.items()}


def serve_result(model: str) -> dict:
    """A `builder bench serve --json` object (schema of builder/bench/serve.py) with distinct figures."""
    def pct(base: float) -> dict:
        return {"mean": base * 1.1, "p50": base, "p90": base * 1.7, "p95": base * 2.1, "p99": base * 3.3}

    return {"kind": "bench_serve", "version": 1, "url": "http://127.0.0.1:8123", "model": model,
            "endpoint": "completions", "started_at": "2026-11-21T20:00:00Z", "config": {"concurrency": 8},
            "duration_s": 12.5, "num_requests": 64, "completed": 63, "failed": {"timeout": 1},
            "request_throughput": 5.04, "output_token_throughput": 645.125, "total_token_throughput": 1290.25,
            "total_input_tokens": 8064, "total_output_tokens": 8064, "ttft_ms": pct(41.75), "tpot_ms": pct(11.125),
            "itl_ms": pct(10.875), "e2e_ms": pct(1453.5),
            "goodput": {"slos_ms": {"ttft": 200.0}, "request_throughput": 4.8, "fraction": 0.9375}}


def sweep_result(model: str, rates: list[float], scale: float) -> dict:
    """A `builder bench serve --request-rate ... --json` sweep object (schema of builder/bench/serve.py): goodput
    follows the offered rate until p99 TTFT passes the 500 ms SLO at the last rate."""
    slos = {"ttft": 500.0, "tpot": 50.0}
    runs, points = [], []
    for i, rate in enumerate(rates):
        ttft, tpot = 40.0 * scale * (1 + i) ** 2, 11.5 * scale + i
        meets = ttft <= slos["ttft"] and tpot <= slos["tpot"]
        goodput = rate * (0.995 if meets else 0.625)
        runs.append({**serve_result(model), "config": {"request_rate": rate, "length_dist": "sharegpt",
                                                       "realized_lengths": {"input": {"mean": 263.5, "p50": 161.0,
                                                                                      "p90": 571.0},
                                                                            "output": {"mean": 301.5, "p50": 199.0,
                                                                                       "p90": 640.0}}}})
        points.append({"request_rate": rate, "num_requests": 1000, "completed": 1000, "failed": 0,
                       "request_throughput": rate * 0.999, "output_token_throughput": rate * 300.0,
                       "ttft_p99_ms": ttft, "tpot_p99_ms": tpot, "e2e_p99_ms": 9000.0,
                       "goodput_request_throughput": goodput, "goodput_fraction": goodput / rate,
                       "meets_slos": meets})
    met = [p["request_rate"] for p in points if p["meets_slos"]]
    return {"kind": "bench_serve_sweep", "version": 1, "url": "http://127.0.0.1:8123", "model": model,
            "endpoint": "completions", "started_at": "2026-11-21T20:00:00Z", "slos_ms": slos, "rates": rates,
            "goodput_rate": max(met) if met else None, "points": points, "runs": runs}


LATENCY_LINE = {"device": "cpu", "input_len": 96, "output_len": 32, "ttft_ms": 23.625, "decode_tok_s": 187.375,
                "weight_bytes": 1, "kv_bytes_per_token": 1, "bandwidth_gb_s": 9.5, "roofline_tok_s": 1400.0,
                "roofline_pct": 13.375, "peak_memory_gib": 0.25}


@pytest.fixture(scope="module")
def report(built, manifests, tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("report")
    serve = d / "serve.json"
    serve.write_text(json.dumps(serve_result(manifests["gptq"]["name"])))  # matched by its "model" field
    latency = d / "latency.jsonl"
    latency.write_text(json.dumps(LATENCY_LINE) + "\n")
    out = d / "out" / "report.html"
    args = ["compare", *(str(built[k]) for k in BUILDS), "--bench", str(serve),
            "--bench", f"{manifests['fp8']['name']}={latency}", "-o", str(out)]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    return {"html": out.read_text(), "md": out.with_suffix(".md").read_text(), "dir": str(out.parent)}


def html_section(html: str, anchor: str) -> str:
    start = html.index(f'<h2 id="{anchor}">')
    end = html.find("<h2", start + 1)
    return html[start:end if end > 0 else len(html)]


def md_section(md: str, title: str) -> str:
    start = md.index(f"\n## {title}")
    end = md.find("\n## ", start + 1)
    return md[start:end if end > 0 else len(md)]


def html_row(section: str, label: str) -> list[str]:
    """The cells after the row header ``label`` (tags stripped)."""
    row = re.search(r"<tr><th class=\"row\">(?:<code>)?" + re.escape(label) + r"(?:</code>)?</th>(.*?)</tr>",
                    section, re.S)
    assert row, f"no row {label!r}"
    return [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td[^>]*>(.*?)</td>", row.group(1), re.S)]


def md_header(section: str) -> str:
    return next(ln for ln in section.splitlines() if ln.startswith("| |"))


def md_row(section: str, label: str) -> list[str]:
    line = next(ln for ln in section.splitlines() if ln.startswith(f"| {label} |"))
    return [c.strip() for c in line.strip().strip("|").split(" | ")][1:]


def flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else k
        out.update(flat(v, key) if isinstance(v, dict) else {key: v})
    return out


def quality(m: dict) -> float:
    """Mean KL against the unquantized model; the unquantized artifact is that model (KL 0)."""
    gates = m["quantization"].get("gates")
    return next(x["value"] for x in gates["metrics"] if x["name"] == "kl") if gates else 0.0


def expected_pareto(points: dict[str, tuple[float, float]]) -> set[str]:
    return {k for k, p in points.items()
            if not any(q[0] <= p[0] and q[1] <= p[1] and q != p for o, q in points.items() if o != k)}


# ---------------------------------------------------------------- content


def test_every_artifact_is_named(report, manifests):
    for m in manifests.values():
        assert f">{m['name']}" in html_section(report["html"], "summary")
        assert f" {m['name']}" in md_header(md_section(report["md"], "Summary"))


def test_recipe_differences_only_and_highlighted(report, manifests):
    recipes = [flat({k: v for k, v in m["recipe"].items() if k not in ("name", "output_dir")})
               for m in manifests.values()]
    keys = set().union(*recipes)
    differ = {k for k in keys if len({json.dumps(r.get(k)) for r in recipes}) > 1}
    same = keys - differ
    assert {"quantization.algo", "calibration.num_samples"} <= differ and "runtime.max_seq_len" in same
    html, md = html_section(report["html"], "recipe"), md_section(report["md"], "Recipe differences")
    for k in differ:
        assert f"<code>{k}</code>" in html and f"| `{k}` |" in md
    for k in same:
        assert f"<code>{k}</code>" not in html and f"`{k}`" not in md
    # fp32's algo is the first column; the fp8 and gptq values differ from it and are highlighted
    row = re.search(r"<code>quantization\.algo</code></th>(.*?)</tr>", html, re.S).group(1)
    assert re.findall(r'<td class="(\w+)"', row) == ["same", "diff", "diff"]
    assert md_row(md, "`quantization.algo`") == ["`none`", f"**`{manifests['fp8']['quantization']['algo']}`**",
                                                 f"**`{manifests['gptq']['quantization']['algo']}`**"]


def test_gate_metrics_values_and_pass_fail(report, manifests):
    html, md = html_section(report["html"], "gates"), md_section(report["md"], "Quality gates")
    assert not manifests["fp8"]["quantization"]["gates"]["passed"]  # the fixture made one gate fail
    for col, key in enumerate(BUILDS):
        gates = manifests[key]["quantization"].get("gates")
        if gates is None:
            assert html_row(html, "kl")[col] == "reference" and md_row(md, "kl")[col] == "reference"
            continue
        for g in gates["metrics"]:
            status = g["status"].upper()  # PASS, FAIL, N/A (a check this baseline cannot judge), INFO (not gated)
            for cell in (html_row(html, g["name"])[col], md_row(md, g["name"])[col]):
                assert cell.startswith(f"{g['value']:.4g} ") and cell.endswith(status), cell
                if status == "INFO":  # reported only: no threshold in the cell
                    assert cell == f"{g['value']:.4g} INFO", cell
                else:
                    assert f"{g['threshold']:.4g}" in cell, cell
        overall = md_row(md, "overall")[col]
        assert overall.startswith("PASSED" if gates["passed"] else "FAILED: " + ", ".join(gates["failed"]))


def test_pareto_mark_on_the_expected_artifacts(report, manifests):
    points = {k: (m["weights"]["bytes"], quality(m)) for k, m in manifests.items()}
    optimal = expected_pareto(points)
    header = re.search(r"<thead><tr><th></th>(.*?)</tr></thead>", html_section(report["html"], "summary")).group(1)
    cells = re.findall(r"<th class=\"artifact[^\"]*\">(.*?)</th>", header)
    header_md = md_header(md_section(report["md"], "Summary"))
    for key, cell in zip(BUILDS, cells):
        name = manifests[key]["name"]
        assert cell.startswith(name)
        assert ("★" in cell) == (key in optimal), (key, optimal, points)
        assert (f"{name} ★ |" in header_md) == (key in optimal)
        assert md_row(md_section(report["md"], "Summary"), "Pareto: size vs kl")[list(BUILDS).index(key)] == (
            "★ optimal" if key in optimal else "dominated")


def test_sizes_bits_per_weight_and_times(report, manifests):
    md = md_section(report["md"], "Summary")
    num_params = manifests["fp32"]["model"]["num_parameters"]  # fp32 stores every parameter unpacked
    for col, key in enumerate(BUILDS):
        m = manifests[key]
        assert md_row(md, "bits/weight, overall")[col] == f"{m['weights']['bytes'] * 8 / num_params:.2f}"
        assert md_row(md, "weights")[col] == f"{m['weights']['bytes'] / 2**20:,.2f} MiB"
        assert md_row(md, "build time (s)")[col] == f"{m['build']['duration_s']:.1f}"
        quant_s = m["build"]["timings_s"].get("quantization_s")
        assert md_row(md, "calibration + quantization (s)")[col] == ("—" if quant_s is None else f"{quant_s:.1f}")
    assert md_row(md, "bits/weight, overall")[0] == "32.00"
    assert md_row(md, "bits/weight, quantized linears")[0] == "— (none)"
    assert md_row(md, "bits/weight, quantized linears")[2].startswith("4.")  # 4-bit plus group scales/zeros


def test_per_layer_hot_spots(report, manifests):
    html, md = html_section(report["html"], "hot-spots"), md_section(report["md"], "Per-layer error hot spots")
    for col, key in enumerate(BUILDS):
        for name, err in manifests[key]["quantization"].get("gates", {}).get("worst_layers", [])[:3]:
            assert html_row(html, name)[col] == f"{err:.4g}"
            assert md_row(md, f"`{name}`")[col] == f"**{err:.4g}**"  # in this artifact's top 5


def test_plots_embedded_and_nothing_fetched(report):
    html = report["html"]
    assert html.count("<svg") == 3  # quality vs size, quality vs throughput, latency percentiles
    assert "<script" not in html and "<link" not in html and "@import" not in html
    assert not re.search(r"(?:src|href)\s*=\s*[\"']?\s*(?:https?:)?//", html)
    assert not re.search(r"url\(\s*[\"']?\s*(?:https?:)?//", html)
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report["md"])
    assert len(images) == 3
    for name in images:
        svg = (Path(report["dir"]) / name).read_text()
        assert "<svg" in svg and "</svg>" in svg


def test_bench_figures_shown(report, manifests):
    html, md = html_section(report["html"], "bench"), md_section(report["md"], "Benchmarks")
    serve = serve_result(manifests["gptq"]["name"])
    for text in (html, md):
        assert manifests["gptq"]["name"] in text
        for value in (serve["output_token_throughput"], serve["ttft_ms"]["p99"], serve["tpot_ms"]["p50"],
                      serve["e2e_ms"]["p95"], serve["goodput"]["fraction"]):
            assert f"{value:.4g}" in text, value
        for value in (LATENCY_LINE["decode_tok_s"], LATENCY_LINE["ttft_ms"], LATENCY_LINE["roofline_pct"]):
            assert f"{value:.4g}" in text, value
    # the served artifact is the only one with a throughput figure, so the only throughput-Pareto point
    assert md_row(md_section(report["md"], "Summary"), "Pareto: throughput vs kl") == ["—", "—", "★ optimal"]


def test_quality_vs_throughput_pareto(built, manifests, tmp_path):
    """Each artifact served at a chosen rate: the worst-KL artifact, given the lowest rate, is dominated."""
    by_kl = sorted(BUILDS, key=lambda k: quality(manifests[k]))
    rates = dict(zip(by_kl, (500.0, 600.0, 100.0)))  # best KL slower than the second; the worst KL slowest
    args = ["compare", *(str(built[k]) for k in BUILDS), "-o", str(tmp_path / "r.html")]
    for k in BUILDS:
        f = tmp_path / f"{k}.json"
        f.write_text(json.dumps({**serve_result(manifests[k]["name"]), "output_token_throughput": rates[k]}))
        args += ["--bench", f"{built[k]}={f}"]  # attached by directory path this time
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    optimal = expected_pareto({k: (-rates[k], quality(manifests[k])) for k in BUILDS})
    assert by_kl[-1] not in optimal
    row = md_row(md_section((tmp_path / "r.md").read_text(), "Summary"), "Pareto: throughput vs kl")
    assert row == ["★ optimal" if k in optimal else "dominated" for k in BUILDS]


def test_goodput_sweep_table_and_chart(built, manifests, tmp_path):
    sweeps = {"fp32": sweep_result(manifests["fp32"]["name"], [20.0, 40.0, 60.0], 1.5),
              "gptq": sweep_result(manifests["gptq"]["name"], [40.0, 60.0, 80.0, 100.0], 0.5)}
    args = ["compare", str(built["fp32"]), str(built["gptq"]), "-o", str(tmp_path / "r.html")]
    for k, sweep in sweeps.items():
        f = tmp_path / f"sweep-{k}.json"
        f.write_text(json.dumps(sweep))
        args += ["--bench", str(f)]  # matched by the "model" field
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    html = html_section((tmp_path / "r.html").read_text(), "bench")
    md = md_section((tmp_path / "r.md").read_text(), "Benchmarks")
    table = html[html.index('<table id="bench-sweep-table">'):]
    table = table[:table.index("</table>")]
    rates = sorted({p["request_rate"] for s in sweeps.values() for p in s["points"]})
    assert [float(r) for r in re.findall(r'<tr><th class="row">([\d.]+)</th>', table)] == rates
    for rate in rates:
        expected = []
        for sweep in sweeps.values():
            point = next((p for p in sweep["points"] if p["request_rate"] == rate), None)
            if point is None:
                expected += ["—"] * 3
                continue
            mark = " ✓" if point["meets_slos"] else " ✕"
            expected += [f"{point['goodput_request_throughput']:.4g}{mark}", f"{point['ttft_p99_ms']:.4g}",
                         f"{point['tpot_p99_ms']:.4g}"]
        assert html_row(table, f"{rate:g}") == expected
        assert md_row(md, f"{rate:g}") == expected
    for row in (html_row(table, "goodput rate (req/s)"), md_row(md, "goodput rate (req/s)")):
        assert row == [f"{s['goodput_rate']:g}" for s in sweeps.values()]
    assert manifests["gptq"]["name"] in md and "sharegpt; input mean 263.5" in html
    figure = re.search(r'<figure id="plot-goodput">(.*?)</figure>', (tmp_path / "r.html").read_text(), re.S)
    assert figure and "<svg" in figure.group(1) and "offered request rate (req/s)" in figure.group(1)
    # a sweep is no throughput figure: no quality-vs-throughput plot; the Markdown links the chart's file
    assert "plot-quality-throughput" not in (tmp_path / "r.html").read_text()
    assert "(r-goodput.svg)" in (tmp_path / "r.md").read_text() and (tmp_path / "r-goodput.svg").is_file()


# ---------------------------------------------------------------- errors


def compare_fails(args: list[str], *expected: str) -> None:
    res = runner.invoke(app, ["compare", *args])
    assert res.exit_code == 1, res.output
    for text in expected:
        assert text in res.output, res.output


def test_missing_or_invalid_artifact(built, tmp_path):
    out = str(tmp_path / "r.html")
    compare_fails([str(built["fp32"]), str(tmp_path / "nope"), "-o", out], str(tmp_path / "nope"),
                  "is not a directory")
    (tmp_path / "empty").mkdir()
    compare_fails([str(built["fp32"]), str(tmp_path / "empty"), "-o", out], "has no manifest.json")
    compare_fails([str(built["fp32"]), "-o", out], "at least two artifacts")
    compare_fails([str(built["fp32"]), str(built["fp32"]), "-o", out], "given twice")
    assert not (tmp_path / "r.html").exists()


def test_artifacts_of_different_models_are_refused(built, manifests, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(built["fp32"], other)
    m = json.loads((other / "manifest.json").read_text())
    m["source"]["files"]["model.safetensors"] = "0" * 64  # as if built from other weights
    m["manifest_sha256"] = manifest_digest(m)
    (other / "manifest.json").write_text(json.dumps(m))
    compare_fails([str(built["gptq"]), str(other), "-o", str(tmp_path / "r.html")], "different models",
                  "model.safetensors")


def test_bench_file_errors(built, manifests, tmp_path):
    arts = [str(built["fp32"]), str(built["gptq"])]
    out = ["-o", str(tmp_path / "r.html")]
    compare_fails([*arts, "--bench", str(tmp_path / "missing.json"), *out], "missing.json does not exist")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json\n")
    compare_fails([*arts, "--bench", str(bad), *out], "bad.json line 1: not JSON")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"hello": 1}))
    compare_fails([*arts, "--bench", str(other), *out], "not a `builder bench` result")
    stranger = tmp_path / "stranger.json"
    stranger.write_text(json.dumps(serve_result("some-other-model")))
    compare_fails([*arts, "--bench", str(stranger), *out], "'some-other-model' matches none",
                  manifests["fp32"]["name"], manifests["gptq"]["name"])
    compare_fails([*arts, "--bench", f"nobody={stranger}", *out], "no artifact is named 'nobody'",
                  manifests["gptq"]["name"])
    latency = tmp_path / "latency.jsonl"
    latency.write_text(json.dumps(LATENCY_LINE) + "\n")
    compare_fails([*arts, "--bench", str(latency), *out], "no \"model\" field", f"ARTIFACT={latency}")
    v2 = tmp_path / "v2.json"
    v2.write_text(json.dumps({**serve_result(manifests["gptq"]["name"]), "version": 2}))
    compare_fails([*arts, "--bench", str(v2), *out], "version 2 is not supported")
    sweep = sweep_result(manifests["gptq"]["name"], [10.0], 1.0)
    for bad, message in (({**sweep, "version": 2}, "bench_serve_sweep version 2 is not supported"),
                         ({**sweep, "points": []}, "\"points\" should be a non-empty list"),
                         ({k: v for k, v in sweep.items() if k != "slos_ms"}, "sweep result without slos_ms")):
        v2.write_text(json.dumps(bad))
        compare_fails([*arts, "--bench", str(v2), *out], message)


def test_option_errors(built, tmp_path):
    arts = [str(built["fp32"]), str(built["gptq"])]
    compare_fails([*arts, "-o", str(tmp_path / "r.md")], "name the HTML file")
    compare_fails([*arts, "--quality-metric", "bleu", "-o", str(tmp_path / "r.html")], "'bleu'", "kl")
    report = built["gptq"] / "report.html"  # the artifact's own report, which its manifest lists
    before = report.read_bytes()
    compare_fails([*arts, "-o", str(report)], "is inside the artifact", "write the report elsewhere")
    assert report.read_bytes() == before
    compare_fails([*arts, "-o", "/proc/llm-builder-compare/r.html"], "cannot write the report")


# ---------------------------------------------------------------- units


def test_pareto_front():
    points = [(1.0, 5.0), (2.0, 2.0), (3.0, 3.0), (2.0, 2.0), (5.0, 0.0), None, (1.0, 6.0)]
    # (3, 3) is dominated by (2, 2); (1, 6) by (1, 5); equal points do not dominate each other
    assert pareto_front(points) == [True, True, False, True, True, False, False]


def test_bench_json_lines_are_classified(tmp_path):
    f = tmp_path / "b.jsonl"
    throughput = {"device": "cpu", "input_len": 8, "output_len": 8, "num_prompts": 4, "concurrency": 2,
                  "output_tok_s": 50.0, "total_tok_s": 100.0, "elapsed_s": 1.0, "num_preemptions": 0,
                  "peak_memory_gib": 0.1}
    step = {"device": "cpu", "batch_size": 4, "input_len": 8, "output_len": 8, "decode_step_ms": 2.5, "tok_s": 1600.0,
            "num_steps": 5, "peak_memory_gib": 0.1}  # bench latency --batch-size: no throughput figure, skipped
    f.write_text(json.dumps(LATENCY_LINE) + "\n\n" + json.dumps(step) + "\n" + json.dumps(throughput) + "\n")
    records = read_bench_file(f)
    assert [r.kind for r in records] == ["latency", "throughput"]
    assert [r.throughput for r in records] == [LATENCY_LINE["decode_tok_s"], throughput["output_tok_s"]]


def test_sizes_count_fp8_experts_with_the_quantized_weights(tmp_path):
    """A moe node with fp8 experts: its codes are logical parameters (one each) and, with their scales, quantized
    bytes; the router and the expert biases stay float parameters."""
    from builder.compare import weight_sizes

    E, H, I = 4, 8, 6  # noqa: E741
    params = {"r": ([E, H], "float32"), "gu": ([E, 2 * I, H], "float8_e4m3fn"), "d": ([E, H, I], "float8_e4m3fn"),
              "gus": ([E, 2 * I], "float32"), "ds": ([E, H], "float32"), "bgu": ([E, 2 * I], "float32")}
    graph = {"params": {n: {"shape": s, "dtype": d} for n, (s, d) in params.items()},
             "nodes": [{"op": "moe", "attrs": {"quant": {"scheme": "fp8"}},
                        "weights": {"gate_weight": "r", "w_gate_up": "gu", "w_down": "d", "w_gate_up_scale": "gus",
                                    "w_down_scale": "ds", "b_gate_up": "bgu"}}]}
    (tmp_path / "manifest.json").write_text("{}")
    sizes = weight_sizes(tmp_path, {"files": {}, "weights": {"bytes": 1}}, graph)
    codes = E * 2 * I * H + E * H * I
    assert sizes.quantized_linear_parameters == codes and sizes.num_quantized_moe_layers == 1
    assert sizes.quantized_linear_bytes == codes + 4 * (E * 2 * I + E * H)
    assert sizes.num_parameters == codes + E * H + E * 2 * I  # plus the router and the biases, float
    assert sizes.bpw_quantized == (codes + 4 * (E * 2 * I + E * H)) * 8 / codes  # 8-bit codes + per-channel scales
