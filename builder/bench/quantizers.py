"""Benchmark: our quantization passes against independent implementations (llm-compressor, NVIDIA ModelOpt).

A measurement script, not a test. For one trained checkpoint (``--model``: ``models/pystdlib-llama``, the bundled
model, or ``models/pydoc-qwen3``, the second fixture) it scores every quantized model against the unquantized one
on the checkpoint's own held-out text (``eval.txt``, >= 4096 positions in windows of 256,
``builder.gates.make_eval_set``) with one metric code, ``builder.gates.compare``: mean KL(base || quantized),
top-1 agreement, perplexity ratio.

- **Ours**: artifacts built by ``builder.pipeline.build`` from ``recipes/quickstart-<algo>.yaml`` with the method's
  overrides (``METHODS``), the checkpoint, its calibration split and ``gates.enabled=false``; each artifact's graph
  runs in ``builder.quality.GraphModel`` (the runtime's executor: packed weights, activation quantization).
- **Round to nearest** of the same scheme: ``builder.quality.rtn_counterpart`` of our artifact (what the gates'
  ``kl_vs_rtn`` divides by), and for static W8A8 our build without smoothing or clipping (naive static).
- **Peers** (``--peer NAME=DIR``, repeated): ``DIR/<method>/`` as written by ``builder/bench/peer_llmcompressor.py``
  or ``builder/bench/peer_modelopt.py``, each run in the tool's own virtualenv on the same token ids: a plain HF
  checkpoint of dequantized (fake-quant) weights where the tool can write one (traced like any checkpoint), and
  ``native_logits.safetensors``, the tool's own forward on the eval windows (weights and activations quantized as
  the tool simulates them; the like-for-like figure wherever activations are quantized).

Both sides calibrate on the same 64 x 256 token windows of the checkpoint's ``calibration.jsonl`` (seed 0)::

    python -m builder.bench.quantizers --model models/pydoc-qwen3 --dump-windows /tmp/qbench/qwen3
    /tmp/lc-venv/bin/python builder/bench/peer_llmcompressor.py --model models/pydoc-qwen3 \\
        --windows /tmp/qbench/qwen3/calib_windows.json --eval-windows /tmp/qbench/qwen3/eval_windows.json \\
        --out /tmp/qbench/qwen3/llm-compressor
    /tmp/mo-venv/bin/python builder/bench/peer_modelopt.py ... --out /tmp/qbench/qwen3/modelopt
    python -m builder.bench.quantizers --model models/pydoc-qwen3 --peer llm-compressor=/tmp/qbench/qwen3/llm-compressor \\
        --peer modelopt=/tmp/qbench/qwen3/modelopt --work-dir /tmp/qbench/qwen3/ours --json /tmp/qbench/qwen3/results.json

docs/QUANTIZATION_COMPARISON.md has the virtualenvs' set-up and the figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO_ROOT / "models" / "pystdlib-llama"
COMMON = ["gates.enabled=false", "calibration.num_samples=64", "calibration.seq_len=256"]
NUM_SAMPLES, SEQ_LEN, SEED = 64, 256, 0
EVAL_WINDOW, EVAL_POSITIONS = 256, 4096


@dataclass(frozen=True)
class Method:
    scheme: str  # the rows compared with each other share it
    algo: str  # recipes/quickstart-<algo>.yaml
    overrides: tuple[str, ...]
    note: str


SCHEMES = {
    "w4_asym": "W4A16 INT4 g64 asymmetric",
    "w4_sym": "W4A16 INT4 g64 symmetric",
    "w8a8_dynamic": "W8A8 INT8, dynamic per-token activations",
    "w8a8_static": "W8A8 INT8, static per-tensor activations",
    "fp8": "FP8 E4M3, per-channel weights, dynamic per-token activations",
    "int8_wo": "INT8 weight-only, per channel",
}
G64 = ("quantization.group_size=64",)
METHODS = {  # our methods; a peer's directory of the same name is the same method (or a variant in that scheme)
    "gptq": Method("w4_asym", "gptq", G64 + ("quantization.act_order=false",),
                   "GPTQ, no act-order, damp 0.01, block 128"),
    "gptq_act": Method("w4_asym", "gptq", G64, "GPTQ, static act-order (the default), damp 0.01, block 128"),
    "awq": Method("w4_asym", "awq", G64, "AWQ: per-group scale search (n_grid 20) + clip search, rounded to nearest"),
    "awq_gptq": Method("w4_asym", "awq", G64 + ("quantization.rounding=gptq",),
                       "AWQ scales, then GPTQ rounding on the scaled inputs (rounding: gptq)"),
    "gptq_sym": Method("w4_sym", "gptq", G64 + ("quantization.symmetric=true", "quantization.act_order=false"),
                       "GPTQ, symmetric, no act-order"),
    "gptq_sym_act": Method("w4_sym", "gptq", G64 + ("quantization.symmetric=true",),
                           "GPTQ, symmetric, static act-order (the default)"),
    "awq_sym": Method("w4_sym", "awq", G64 + ("quantization.symmetric=true",), "AWQ (scale + clip search), symmetric"),
    "awq_joint": Method("w4_asym", "awq", G64 + ("quantization.joint_clip=true",),
                        "AWQ with the clip search inside the scale search (joint_clip)"),
    "awq_sym_joint": Method("w4_sym", "awq", G64 + ("quantization.symmetric=true", "quantization.joint_clip=true"),
                            "AWQ, symmetric, joint_clip"),
    "smoothquant": Method("w8a8_dynamic", "smoothquant", (),
                          "alpha searched per group; norms -> q/k/v, gate/up; up -> down"),
    "smoothquant_static": Method("w8a8_static", "smoothquant", ("quantization.activations=static",
                                                                "quantization.smooth_output=true"),
                                 "alpha searched per group; norms -> q/k/v, gate/up; up -> down; v -> o"),
    "fp8": Method("fp8", "fp8", ("quantization.weight_granularity=channel",), "no calibration"),
    "int8_wo": Method("int8_wo", "int8_wo", (), "scale amax / 127.5 per channel, no calibration"),
    "int8_wo_refit": Method("int8_wo", "int8_wo", ("quantization.refit_scales=true",),
                            "scale amax / 127.5, then refit on the calibration inputs' second moments (refit_scales)"),
    "int8_wo_gptq": Method("int8_wo", "gptq", ("quantization.bits=8", "quantization.group_size=-1",
                                               "quantization.symmetric=true"),
                           "GPTQ at 8 bits per channel, symmetric (amax / 127.5), static act-order, damp 0.01"),
}
# variants measured once (docs/QUANTIZATION_COMPARISON.md, session 38), run by name: --methods gptq_act_true_seq,...
VARIANTS = {
    "gptq_true_seq": Method("w4_asym", "gptq", G64 + ("quantization.act_order=false",
                                                      "quantization.true_sequential=true"),
                            "GPTQ, no act-order, each linear calibrated through the quantized ones before it"),
    "gptq_act_true_seq": Method("w4_asym", "gptq", G64 + ("quantization.true_sequential=true",),
                                "GPTQ, act-order, each linear calibrated through the quantized ones before it"),
    "gptq_sym_true_seq": Method("w4_sym", "gptq", G64 + ("quantization.symmetric=true", "quantization.act_order=false",
                                                         "quantization.true_sequential=true"),
                                "GPTQ, symmetric, no act-order, true sequential"),
    "gptq_sym_act_true_seq": Method("w4_sym", "gptq", G64 + ("quantization.symmetric=true",
                                                             "quantization.true_sequential=true"),
                                    "GPTQ, symmetric, act-order, true sequential"),
    "int8_wo_gptq_true_seq": Method("int8_wo", "gptq", ("quantization.bits=8", "quantization.group_size=-1",
                                                        "quantization.symmetric=true",
                                                        "quantization.true_sequential=true"),
                                    "GPTQ at 8 bits per channel, true sequential"),
}
ALL_METHODS = {**METHODS, **VARIANTS}
# peers' directories in a scheme besides our method names (ModelOpt's AWQ with its clip search, symmetric)
PEER_VARIANTS = {"awq_full_sym": "w4_sym"}
NAIVE_STATIC = ("quantization.activations=static", "quantization.smoothing=false", "quantization.static_scale=max")

log = logging.getLogger("bench_quantizers")


def _tokenizer_encode(model: Path):
    from runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model)
    return lambda t: tok.encode(t, add_special_tokens=False)


def eval_set(model: Path):
    from builder.calibration import token_stream
    from builder.gates import make_eval_set

    stream, _ = token_stream(model / "eval.txt", _tokenizer_encode(model))
    return make_eval_set(stream, EVAL_WINDOW, EVAL_POSITIONS)


def dump_windows(model: Path, out: Path) -> None:
    """The calibration windows every implementation uses, and the eval windows, as JSON token ids."""
    from builder.calibration import token_windows

    out.mkdir(parents=True, exist_ok=True)
    calib = token_windows(model / "calibration.jsonl", _tokenizer_encode(model), NUM_SAMPLES, SEQ_LEN, seed=SEED)
    (out / "calib_windows.json").write_text(json.dumps({"manifest": calib.manifest(), "windows": calib.windows}))
    es = eval_set(model)
    (out / "eval_windows.json").write_text(json.dumps({"window": EVAL_WINDOW, "num_positions": es.num_positions,
                                                       "windows": es.windows}))
    print(f"wrote {out / 'calib_windows.json'} ({len(calib.windows)} x {SEQ_LEN} tokens, "
          f"sha256 of the file {calib.sha256[:12]}) and {out / 'eval_windows.json'} "
          f"({len(es.windows)} windows, {es.num_positions} positions)")


def recipe_overrides(model: Path, algo: str, extra: tuple[str, ...], out: Path) -> list[str]:
    return COMMON + [f"model.checkpoint={model}", f"calibration.dataset={model / 'calibration.jsonl'}",
                     f"gates.eval_dataset={model / 'eval.txt'}", f"output_dir={out}", *extra]


def build_ours(model: Path, algo: str, extra: tuple[str, ...], out: Path) -> float:
    from builder.pipeline import build
    from builder.recipe import load_recipe

    recipe = load_recipe(REPO_ROOT / "recipes" / f"quickstart-{algo}.yaml", recipe_overrides(model, algo, extra, out))
    t = time.perf_counter()
    build(recipe)
    return time.perf_counter() - t


class Baseline:
    """The unquantized checkpoint's graph and its logits per eval window, computed once."""

    def __init__(self, model: Path) -> None:
        from builder.quality import GraphModel, load_graph

        self.graph, _ = load_graph(model)
        self.model = GraphModel(self.graph)
        self.cache: dict[tuple[int, ...], torch.Tensor] = {}

    def logits(self, ids: list[int]) -> torch.Tensor:
        key = tuple(ids)
        if key not in self.cache:
            self.cache[key] = self.model.logits(ids)
        return self.cache[key]


def score(baseline: Baseline, candidate, es) -> dict:
    """KL / top-1 / ppl ratio, by ``builder.gates.compare`` (default thresholds: pass/fail is not the point here)."""
    from builder.gates import GateThresholds, compare

    report = compare(baseline.logits, candidate, es, GateThresholds())
    return {"kl": report.metric("kl").value, "top1": report.metric("top1_agreement").value,
            "ppl_ratio": report.metric("ppl_ratio").value, "positions": report.num_positions}


def native_logits_fn(path: Path, es):
    from safetensors.torch import load_file

    stored = load_file(path)
    by_ids = {tuple(w): stored[f"w{i}"] for i, w in enumerate(es.windows)}

    def logits(ids: list[int]) -> torch.Tensor:
        key = tuple(ids)
        if key not in by_ids:
            raise KeyError("native logits were stored for other eval windows; re-run the peer script with this "
                           "eval_windows.json")
        return by_ids[key]

    return logits


def versions_main() -> dict:
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _measure(row: dict, fn) -> dict:
    """``row`` with the scores of ``fn()`` (a logits function), or the error it raised: a benchmark goes on."""
    try:
        row.update(fn())
    except Exception as e:  # noqa: BLE001 - reported in the row
        row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
    print(markdown([row]).splitlines()[-1], flush=True)
    return row


def markdown(rows: list[dict]) -> str:
    lines = ["| scheme | method | implementation | KL (nats) | top-1 | ppl ratio | KL / round-to-nearest's |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        head = f"| {SCHEMES[r['scheme']]} | {r['method']} | {r['impl']} |"
        if "error" in r:
            lines.append(f"{head} n/a | n/a | n/a | FAILED: {r['error']} |")
            continue
        ratio = f"{r['kl_vs_rtn']:.3f}" if r.get("kl_vs_rtn") is not None else ""
        lines.append(f"{head} {r['kl']:.3e} | {r['top1']:.4f} | {r['ppl_ratio']:.4f} | {ratio} |")
    return "\n".join(lines)


def verdicts(rows: list[dict]) -> list[str]:
    """Per scheme: our best KL against the best peer's (like for like: a peer's native forward where the scheme
    quantizes activations, where its fake-quant checkpoint cannot carry them)."""
    out = []
    for scheme in SCHEMES:
        ok = [r for r in rows if r["scheme"] == scheme and "error" not in r]
        ours = [r for r in ok if r["impl"] == "ours"]
        peers = [r for r in ok if r["impl"] not in ("ours", "round to nearest")
                 and (scheme in ("w4_asym", "w4_sym", "int8_wo") or "native" in r["impl"])]
        if not ours or not peers:
            continue
        a, b = min(ours, key=lambda r: r["kl"]), min(peers, key=lambda r: r["kl"])
        word = "ahead" if a["kl"] < b["kl"] else "behind"
        out.append(f"- {SCHEMES[scheme]}: ours {a['method']} {a['kl']:.3e} vs best peer {b['impl']} {b['method']} "
                   f"{b['kl']:.3e}: {word} ({a['kl'] / b['kl']:.2f}x its KL)")
    return out


def _set_seed(seed: int) -> None:
    """The calibration windows' seed, for the dumped windows and our builds' recipes."""
    global SEED, COMMON
    SEED = seed
    COMMON = [o for o in COMMON if not o.startswith("calibration.seed=")] + [f"calibration.seed={seed}"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m builder.bench.quantizers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="a trained checkpoint with calibration.jsonl "
                    "and eval.txt (models/pystdlib-llama, models/pydoc-qwen3)")
    ap.add_argument("--peer", action="append", default=[], metavar="NAME=DIR",
                    help="a peer tool's output, one sub-directory per method (repeatable)")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/qbench/ours"), help="where our artifacts are built")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"of {', '.join(ALL_METHODS)}")
    ap.add_argument("--skip-build", action="store_true", help="reuse artifacts already in --work-dir")
    ap.add_argument("--json", type=Path, help="also write the measured rows as JSON here")
    ap.add_argument("--dump-windows", type=Path, metavar="DIR", help="write calib/eval token windows as JSON and exit")
    ap.add_argument("--calib-seed", type=int, default=SEED, help="which calibration windows (ours and the dumped "
                    "ones alike; default 0)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    model = args.model.resolve()
    _set_seed(args.calib_seed)
    if args.dump_windows:
        dump_windows(model, args.dump_windows)
        return 0
    peers = {}
    for spec in args.peer:
        name, sep, path = spec.partition("=")
        if not sep or not Path(path).is_dir():
            ap.error(f"--peer {spec!r}: expected NAME=DIR with an existing DIR")
        peers[name] = Path(path)
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in ALL_METHODS]
    if unknown:
        ap.error(f"unknown methods {unknown}; known: {', '.join(ALL_METHODS)}")

    from builder.quality import GraphModel, load_graph, rtn_counterpart

    torch.manual_seed(0)
    es = eval_set(model)
    baseline = Baseline(model)
    rows: list[dict] = []
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    rtn_kl: dict[str, float] = {}

    def add(row: dict, fn) -> None:
        rows.append(_measure(row, fn))

    def ours(name: str, scheme: str, algo: str, extra: tuple[str, ...]) -> Path:
        out = args.work_dir / name
        if not args.skip_build:
            build_ours(model, algo, extra, out)
        return out

    for name in methods:
        m = ALL_METHODS[name]
        row = {"scheme": m.scheme, "method": name, "impl": "ours", "note": m.note}
        graph = None
        try:
            graph, _ = load_graph(ours(name, m.scheme, m.algo, m.overrides))
        except Exception as e:  # noqa: BLE001 - reported in the row
            row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            rows.append(row)
            continue
        add(row, lambda: score(baseline, GraphModel(graph).logits, es))
        if m.scheme not in rtn_kl:  # the scheme's plain rounding, once
            if m.scheme == "w8a8_static":
                naive, _ = load_graph(ours("smoothquant_static_naive", m.scheme, "smoothquant", NAIVE_STATIC))
                rtn, why = naive, ""
            else:
                rtn, why = rtn_counterpart(baseline.graph, graph)
            if rtn is not None:
                r = _measure({"scheme": m.scheme, "method": "rtn", "impl": "round to nearest",
                              "note": "naive static W8A8 (no smoothing, max scales)" if m.scheme == "w8a8_static"
                              else "builder.quality.rtn_counterpart"}, lambda: score(baseline, GraphModel(rtn).logits, es))
                rows.append(r)
                if "error" not in r:
                    rtn_kl[m.scheme] = r["kl"]
            else:
                log.warning("no round-to-nearest counterpart for %s: %s", name, why)

    wanted = set(methods) | {v for v, sch in PEER_VARIANTS.items() if sch in {ALL_METHODS[m].scheme for m in methods}}
    for peer, root in peers.items():
        for d in sorted(p for p in root.iterdir() if p.is_dir() and p.name in wanted):
            scheme = ALL_METHODS[d.name].scheme if d.name in ALL_METHODS else PEER_VARIANTS[d.name]
            if (d / "config.json").is_file():
                add({"scheme": scheme, "method": d.name, "impl": f"{peer} (fake-quant checkpoint)"},
                    lambda: score(baseline, GraphModel(load_graph(d)[0]).logits, es))
            if (d / "native_logits.safetensors").is_file():
                add({"scheme": scheme, "method": d.name, "impl": f"{peer} (native forward)"},
                    lambda: score(baseline, native_logits_fn(d / "native_logits.safetensors", es), es))
    for r in rows:
        if "error" not in r and r["scheme"] in rtn_kl:
            r["kl_vs_rtn"] = r["kl"] / rtn_kl[r["scheme"]]
    order = list(SCHEMES)
    rows.sort(key=lambda r: (order.index(r["scheme"]), r["impl"] != "round to nearest", r["impl"] != "ours"))

    peer_versions = {name: json.loads((root / "versions.json").read_text()) if (root / "versions.json").is_file()
                     else None for name, root in peers.items()}
    print()
    print(f"## {model.name}: measured {started} on {cpu_name()} ({torch.get_num_threads()} torch threads, CPU only)")
    print(f"eval: {model.name}/eval.txt, {len(es.windows)} windows x {EVAL_WINDOW} tokens = {es.num_positions} scored "
          f"positions; calibration: {NUM_SAMPLES} x {SEQ_LEN} tokens of {model.name}/calibration.jsonl, seed {SEED} "
          f"(the same ids for every implementation)\n")
    print(markdown(rows))
    print()
    print("\n".join(verdicts(rows)))
    print()
    print("main environment:", json.dumps(versions_main()))
    for name, v in peer_versions.items():
        print(f"{name} environment:", json.dumps(v) if v else "(no versions.json)")
    print("command:", "python -m builder.bench.quantizers " + " ".join(sys.argv[1:] if argv is None else argv))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"date": started, "cpu": cpu_name(), "model": model.name,
                                         "main": versions_main(), "peers": peer_versions, "rows": rows}, indent=1))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
