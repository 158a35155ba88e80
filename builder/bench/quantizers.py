"""Benchmark: our quantization passes against an independent implementation (llm-compressor).

This is a benchmark script, not a test. It measures, on the same held-out eval set the quality
gates use (``models/pystdlib-llama/eval.txt``, >= 4096 scored positions, windows of 256 tokens,
``builder.gates.make_eval_set``), the mean KL, top-1 agreement and perplexity ratio of each quantized
model against the unquantized bundled model, with ``builder.gates.compare``:

(a) ours: artifacts built from ``recipes/quickstart-{gptq,awq,smoothquant,fp8,int8_wo}.yaml`` with
    ``gates.enabled=false calibration.num_samples=64 calibration.seq_len=256`` and the output under
    ``--work-dir``; each artifact's graph is loaded with ``builder.quality.load_graph``;
(b) the independent tool: one directory per method under ``--independent-dir``, each a plain HF
    checkpoint whose quantized linears hold the *dequantized* (fake-quant) fp32 weights, traced by
    ``builder.quality.load_graph``; plus, where present, ``native_logits.safetensors``: the tool's own
    forward pass (weights AND activations fake-quantized as the tool simulates them) on the same eval
    windows, scored with the same ``compare``.

Both sides calibrate on the same 64 x 256 token windows: ``--dump-windows DIR`` writes them
(``builder.calibration.token_windows(..., 64, 256, seed=0)`` over ``calibration.jsonl``) and the
eval windows as JSON, and ``--emit-independent-script PATH`` writes the llm-compressor script that
reads them (run it in its own virtualenv; see docs/QUANTIZATION_COMPARISON.md)::

    python -m builder.bench.quantizers --dump-windows /tmp/qbench
    python -m builder.bench.quantizers --emit-independent-script /tmp/qbench/lc_quantize.py
    /tmp/lc-venv/bin/python /tmp/qbench/lc_quantize.py --model models/pystdlib-llama \\
        --windows /tmp/qbench/calib_windows.json --eval-windows /tmp/qbench/eval_windows.json --out /tmp/qbench/lc
    python -m builder.bench.quantizers --independent-dir /tmp/qbench/lc
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL = REPO_ROOT / "models" / "pystdlib-llama"
METHODS = ["gptq", "awq", "smoothquant", "fp8", "int8_wo"]
OVERRIDES = ["gates.enabled=false", "calibration.num_samples=64", "calibration.seq_len=256"]
NUM_SAMPLES, SEQ_LEN, SEED = 64, 256, 0
EVAL_WINDOW, EVAL_POSITIONS = 256, 4096

# What each method is on each side (the "notes" column).
NOTES = {
    ("gptq", "ours"): "W4A16 INT4 g64 asym, no act-order, damp 0.01, block 128; packed INT4 artifact",
    ("gptq", "llm-compressor"): "GPTQModifier W4A16 g64 asym, actorder=None, damp 0.01, block 128; fake-quant ckpt",
    ("awq", "ours"): "AWQ scale search (n_grid 20) + clip search, INT4 g64 asym",
    ("awq", "llm-compressor"): "AWQModifier (n_grid 20, duo_scaling, no clip search) + RTN INT4 g64 asym; fake-quant ckpt",
    ("smoothquant", "ours"): "alpha 0.5; W8 per-channel sym + A8 dynamic per-token (both simulated in executor)",
    ("smoothquant", "llm-compressor"): "SmoothQuantModifier 0.5 + W8A8 (RTN); ckpt = smoothing + W8 only, NO act quant",
    ("fp8", "ours"): "E4M3 W per-channel + A dynamic per-token",
    ("fp8", "llm-compressor"): "FP8_DYNAMIC (W per-channel, A per-token); ckpt = W only, NO act quant",
    ("int8_wo", "ours"): "W8A16 per-channel sym, scale amax/127",
    ("int8_wo", "llm-compressor"): "W8A16 per-channel sym RTN, scale amax/127.5 (compressed-tensors); fake-quant ckpt",
}
NATIVE_NOTE = "tool's own forward: its fake-quant of weights, and of activations where the scheme has them"

log = logging.getLogger("bench_quantizers")

# The independent side: run with llm-compressor's own virtualenv (written by --emit-independent-script).
INDEPENDENT_SCRIPT = r'''"""Independent quantization of models/pystdlib-llama with llm-compressor (run in its own venv).

usage: python lc_quantize.py --model models/pystdlib-llama --windows DIR/calib_windows.json \
           --eval-windows DIR/eval_windows.json --out DIR [--methods gptq,awq,smoothquant,fp8,int8_wo]

For each method: oneshot() on the HF model loaded from the local dir with the exact calibration token
windows, then write DIR/<method>/ = config + tokenizer + model.safetensors whose quantized linears hold
the DEQUANTIZED (fake-quant) fp32 weights, and every other tensor (incl. smoothed norms) as the tool
left it. Also writes DIR/<method>/native_logits.safetensors: the tool's own forward (weight AND
activation fake-quant, as llm-compressor simulates it) on the eval windows, for reference.
"""

import argparse
import json
import shutil
import time
from pathlib import Path

import torch
from datasets import Dataset
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.lifecycle.forward import forward_quantize
from llmcompressor import oneshot
from llmcompressor.modifiers.gptq import GPTQModifier
from llmcompressor.modifiers.quantization import QuantizationModifier
from llmcompressor.modifiers.transform import AWQModifier, SmoothQuantModifier

G = 64

# llm-compressor 0.14.0.1 AWQ pins its cached activations (IntermediatesCache.pin_memory) for faster
# host-to-device copies; on a machine without any accelerator torch raises "Cannot access accelerator
# device when none is available". Pinning is only a transfer optimisation, so on CPU-only hosts it is
# made a no-op here (the package itself is not modified).
if not torch.cuda.is_available():
    from llmcompressor.pipelines.cache import IntermediatesCache
    IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
IGNORE = ["lm_head"]


def w4_asym_g64():
    return {"group_0": QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", strategy="group", group_size=G, symmetric=False, dynamic=False))}


def w8_channel_sym():
    return {"group_0": QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=8, type="int", strategy="channel", symmetric=True, dynamic=False))}


def recipe_for(method):
    if method == "gptq":  # W4A16 g64 asymmetric, no act-order, damp 0.01, block 128
        return [GPTQModifier(config_groups=w4_asym_g64(), ignore=IGNORE, actorder=None,
                             block_size=128, dampening_frac=0.01)]
    if method == "awq":  # AWQ scale search (n_grid 20) + W4A16 g64 asymmetric RTN of the scaled weights
        return [AWQModifier(n_grid=20), QuantizationModifier(config_groups=w4_asym_g64(), ignore=IGNORE)]
    if method == "smoothquant":  # alpha 0.5, then W8A8 INT8: per-channel sym weights, dynamic per-token acts
        return [SmoothQuantModifier(smoothing_strength=0.5), QuantizationModifier(scheme="W8A8", ignore=IGNORE)]
    if method == "fp8":  # FP8 E4M3: per-channel weights, dynamic per-token activations
        return [QuantizationModifier(scheme="FP8_DYNAMIC", ignore=IGNORE)]
    if method == "int8_wo":  # W8A16 per-channel symmetric RTN
        return [QuantizationModifier(config_groups=w8_channel_sym(), ignore=IGNORE)]
    raise SystemExit(f"unknown method {method}")


def export_fake_quant(model, src: Path, out: Path, method: str) -> dict:
    """Plain HF checkpoint: quantized linears' weights replaced by their dequantized values."""
    out.mkdir(parents=True, exist_ok=True)
    fq = {}
    act_schemes = {}
    with torch.no_grad():
        for name, m in model.named_modules():
            scheme = getattr(m, "quantization_scheme", None)
            if scheme is None or scheme.weights is None:
                continue
            fq[f"{name}.weight"] = forward_quantize(m, m.weight.data, "weight", scheme.weights).float().clone()
            if scheme.input_activations is not None:
                act_schemes[name] = scheme.input_activations.model_dump(mode="json")
    sd = {}
    for k, v in model.state_dict().items():
        leaf = k.rsplit(".", 1)[-1]
        if leaf.startswith(("weight_", "input_", "output_")) or leaf.endswith(("_scale", "_zero_point", "_g_idx")):
            continue  # quantization parameters
        sd[k] = fq.get(k, v).detach().float().contiguous().clone()
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    for f in src.iterdir():
        if f.is_file() and f.suffix in (".json",) and f.name not in ("training_metrics.json", "split.json"):
            shutil.copy(f, out / f.name)
    changed = [k for k in fq if not torch.equal(fq[k], model.state_dict()[k].float())]
    acts = next(iter(act_schemes.values()), None)
    return {"fake_quant_linears": len(fq), "weights_changed_by_export_qdq": len(changed),
            "linears_with_activation_quant_not_in_ckpt": len(act_schemes),
            "activation_args": {k: acts[k] for k in ("num_bits", "type", "strategy", "dynamic", "symmetric")}
            if acts else None}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--windows", required=True)
    ap.add_argument("--eval-windows", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--methods", default="gptq,awq,smoothquant,fp8,int8_wo")
    a = ap.parse_args()
    src = Path(a.model)
    windows = json.loads(Path(a.windows).read_text())["windows"]
    eval_windows = json.loads(Path(a.eval_windows).read_text())["windows"]
    ds = Dataset.from_dict({"input_ids": windows, "attention_mask": [[1] * len(w) for w in windows]})
    summary = json.loads((Path(a.out) / "summary.json").read_text()) if (Path(a.out) / "summary.json").is_file() else {}
    for method in a.methods.split(","):
        t = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, local_files_only=True)
        oneshot(model=model, dataset=ds, recipe=recipe_for(method), num_calibration_samples=len(windows),
                max_seq_length=len(windows[0]), shuffle_calibration_samples=False, batch_size=1)
        secs = time.perf_counter() - t
        out = Path(a.out) / method
        info = export_fake_quant(model, src, out, method)
        model.eval()
        with torch.no_grad():
            logits = {f"w{i}": model(torch.tensor([w])).logits[0].float().contiguous()
                      for i, w in enumerate(eval_windows)}
        save_file(logits, out / "native_logits.safetensors")
        info["oneshot_seconds"] = round(secs, 1)
        info["recipe"] = [repr(m) for m in recipe_for(method)]
        (out / "lc_info.json").write_text(json.dumps(info, indent=1))
        summary[method] = {k: v for k, v in info.items() if k != "recipe"}
        print(method, json.dumps(summary[method]), flush=True)
        del model
    (Path(a.out) / "summary.json").write_text(json.dumps(summary, indent=1))
    import platform, compressed_tensors, llmcompressor, transformers
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "llmcompressor": llmcompressor.__version__,
                "compressed-tensors": compressed_tensors.__version__}
    (Path(a.out) / "versions.json").write_text(json.dumps(versions, indent=1))


if __name__ == "__main__":
    main()
'''

def _tokenizer_encode():
    from runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(MODEL)
    return lambda t: tok.encode(t, add_special_tokens=False)


def eval_set():
    from builder.calibration import DEFAULT_EVAL, token_stream
    from builder.gates import make_eval_set

    stream, _ = token_stream(DEFAULT_EVAL, _tokenizer_encode())
    return make_eval_set(stream, EVAL_WINDOW, EVAL_POSITIONS)


def dump_windows(out: Path) -> None:
    """The calibration windows both implementations use, and the eval windows, as JSON token ids."""
    from builder.calibration import DEFAULT_CALIBRATION, token_windows

    out.mkdir(parents=True, exist_ok=True)
    calib = token_windows(DEFAULT_CALIBRATION, _tokenizer_encode(), NUM_SAMPLES, SEQ_LEN, seed=SEED)
    (out / "calib_windows.json").write_text(json.dumps({"manifest": calib.manifest(), "windows": calib.windows}))
    es = eval_set()
    (out / "eval_windows.json").write_text(json.dumps({"window": EVAL_WINDOW, "num_positions": es.num_positions,
                                                       "windows": es.windows}))
    print(f"wrote {out / 'calib_windows.json'} ({len(calib.windows)} x {SEQ_LEN} tokens, "
          f"sha256 of the file {calib.sha256[:12]}) and {out / 'eval_windows.json'} "
          f"({len(es.windows)} windows, {es.num_positions} positions)")


def build_ours(method: str, work_dir: Path) -> tuple[Path, float]:
    from builder.pipeline import build
    from builder.recipe import load_recipe

    out = work_dir / method
    recipe = load_recipe(REPO_ROOT / "recipes" / f"quickstart-{method}.yaml",
                         OVERRIDES + [f"output_dir={out}"])
    t = time.perf_counter()
    build(recipe)
    return out, time.perf_counter() - t


class Baseline:
    """The unquantized bundled model's logits per eval window, computed once."""

    def __init__(self) -> None:
        from builder.quality import GraphModel, load_graph

        graph, _ = load_graph(MODEL)
        self.model = GraphModel(graph)
        self.cache: dict[tuple[int, ...], torch.Tensor] = {}

    def logits(self, ids: list[int]) -> torch.Tensor:
        key = tuple(ids)
        if key not in self.cache:
            self.cache[key] = self.model.logits(ids)
        return self.cache[key]


def recipe_thresholds(method: str):
    """The thresholds the quickstart recipe's gates use (method defaults plus the recipe's overrides)."""
    from builder.quality import thresholds
    from builder.recipe import load_recipe

    recipe = load_recipe(REPO_ROOT / "recipes" / f"quickstart-{method}.yaml")
    return thresholds(method, recipe.gates)


def score(method: str, baseline: Baseline, candidate, es) -> dict:
    """KL / top-1 / ppl ratio via builder.gates.compare; pass/fail against the quickstart recipe's
    thresholds for these three metrics (greedy agreement and the needle check are not run here)."""
    from builder.gates import compare

    report = compare(baseline.logits, candidate, es, recipe_thresholds(method))
    m = {r.name: r for r in report.metrics}
    return {"kl": m["kl"].value, "top1": m["top1_agreement"].value, "ppl_ratio": m["ppl_ratio"].value,
            "gate_passed": report.passed, "gate_failed": report.failed, "positions": report.num_positions,
            "ppl_detail": m["ppl_ratio"].detail}


def native_logits_fn(path: Path, es):
    from safetensors.torch import load_file

    stored = load_file(path)
    by_ids = {tuple(w): stored[f"w{i}"] for i, w in enumerate(es.windows)}

    def logits(ids: list[int]) -> torch.Tensor:
        key = tuple(ids)
        if key not in by_ids:
            raise KeyError("native logits were stored for other eval windows; re-run the independent script "
                           "with this eval_windows.json")
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


def markdown(rows: list[dict]) -> str:
    lines = ["| method | implementation | KL (nats) | top-1 agreement | ppl ratio | notes |",
             "| --- | --- | ---: | ---: | ---: | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['method']} | {r['impl']} | n/a | n/a | n/a | FAILED: {r['error']} |")
            continue
        gate = ("recipe gate PASS" if r["gate_passed"] else
                f"recipe gate FAIL ({', '.join(r['gate_failed'])})")
        lines.append(f"| {r['method']} | {r['impl']} | {r['kl']:.3e} | {r['top1']:.4f} | {r['ppl_ratio']:.4f} | "
                     f"{r['note']}; {gate} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m builder.bench.quantizers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--independent-dir", type=Path, help="the independent tool's output: one sub-directory per method")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/qbench/ours"), help="where our artifacts are built")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--skip-build", action="store_true", help="reuse artifacts already in --work-dir")
    ap.add_argument("--json", type=Path, help="also write the measured rows as JSON here")
    ap.add_argument("--dump-windows", type=Path, metavar="DIR", help="write calib/eval token windows as JSON and exit")
    ap.add_argument("--emit-independent-script", type=Path, metavar="PATH",
                    help="write the llm-compressor script (run it in its own venv) and exit")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    if args.emit_independent_script:
        args.emit_independent_script.parent.mkdir(parents=True, exist_ok=True)
        args.emit_independent_script.write_text(INDEPENDENT_SCRIPT)
        print(f"wrote {args.emit_independent_script}")
        return 0
    if args.dump_windows:
        dump_windows(args.dump_windows)
        return 0
    if args.independent_dir is None:
        ap.error("--independent-dir is required (or --dump-windows / --emit-independent-script)")

    from builder.quality import GraphModel, load_graph

    torch.manual_seed(0)
    methods = [m for m in args.methods.split(",") if m]
    es = eval_set()
    baseline = Baseline()
    rows: list[dict] = []
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    for method in methods:
        # (a) ours
        row = {"method": method, "impl": "ours", "note": NOTES[(method, "ours")]}
        try:
            out = args.work_dir / method
            secs = None
            if not args.skip_build:
                out, secs = build_ours(method, args.work_dir)
            graph, manifest = load_graph(out)
            row.update(score(method, baseline, GraphModel(graph).logits, es))
            row["build_seconds"] = secs
        except Exception as e:  # a benchmark reports what failed and goes on
            row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
        rows.append(row)
        print(markdown([row]).splitlines()[-1], flush=True)

        # (b) the independent tool: its fake-quant checkpoint, then its own forward (if stored)
        d = args.independent_dir / method
        row = {"method": method, "impl": "llm-compressor (fake-quant ckpt)", "note": NOTES[(method, "llm-compressor")]}
        try:
            if not (d / "config.json").is_file():
                raise FileNotFoundError(f"{d} holds no checkpoint (the independent run did not produce one)")
            graph, _ = load_graph(d)
            row.update(score(method, baseline, GraphModel(graph).logits, es))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
        rows.append(row)
        print(markdown([row]).splitlines()[-1], flush=True)
        if (d / "native_logits.safetensors").is_file():
            row = {"method": method, "impl": "llm-compressor (native fwd)", "note": NATIVE_NOTE}
            try:
                row.update(score(method, baseline, native_logits_fn(d / "native_logits.safetensors", es), es))
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            rows.append(row)
            print(markdown([row]).splitlines()[-1], flush=True)

    indep_versions = {}
    if (args.independent_dir / "versions.json").is_file():
        indep_versions = json.loads((args.independent_dir / "versions.json").read_text())
    print()
    print(f"## Measured {started} on {cpu_name()} ({torch.get_num_threads()} torch threads, CPU only)")
    print(f"eval: {MODEL.relative_to(REPO_ROOT)}/eval.txt, {len(es.windows)} windows x {EVAL_WINDOW} tokens = "
          f"{es.num_positions} scored positions; calibration: 64 x 256 tokens, seed 0 (same ids on both sides)\n")
    print(markdown(rows))
    print()
    print("main environment:", json.dumps(versions_main()))
    print("independent environment:", json.dumps(indep_versions) if indep_versions else "(no versions.json)")
    print("ours built with: load_recipe('recipes/quickstart-<method>.yaml', "
          f"{OVERRIDES + ['output_dir=' + str(args.work_dir) + '/<method>']}) -> builder.pipeline.build")
    print("command:", "python -m builder.bench.quantizers " + " ".join(sys.argv[1:] if argv is None else argv))
    if args.json:
        args.json.write_text(json.dumps({"date": started, "cpu": cpu_name(), "main": versions_main(),
                                         "independent": indep_versions, "rows": rows}, indent=1))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
