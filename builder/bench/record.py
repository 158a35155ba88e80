"""Benchmark figures as lines of a JSON-lines record (``docs/benchmarks.jsonl``): one line per figure,

    {"figure": "decode_b1_bf16", "value": 156.6, "unit": "tok/s", "device": "NVIDIA H100 80GB HBM3",
     "versions": {"torch": ..., "triton": ..., "toolchain": ...}, "command": "builder bench latency ...",
     "date": "2026-11-23T12:00:00+00:00"}

appended by the benchmark commands (``--record PATH``); the latest line of a figure is its current value.
Figure names: ``decode_b1_{precision}`` (tok/s), ``ttft_{input_len}_{precision}`` (ms),
``decode_step_b{N}_{precision}`` (ms per decode step of N sequences decoded together), an ``_in{input_len}``
suffix on the decode figures when the prompts are not 128 tokens, and ``baseline_<name>`` for the
stock-PyTorch baseline's figure measured in the same run. The precision part is :func:`figure_tag`'s: a
mixture-of-experts model's figures are ``moe_{precision}`` (``decode_b1_moe_bf16``), an artifact with a quantized
lm_head's ``{precision}_qhead``, one with a quantized KV cache's ``{precision}_kvfp8`` (or ``_kvint8``), one whose
W8A8 linears take calibrated (static) activation scales ``{precision}_static`` (``fp8_static_kvfp8``).
"""

from __future__ import annotations

import json
import platform
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from builder import __version__
from kernels.torch_quant import fp8_fast_accum

# The precision a figure is named after, by the scheme most of an artifact's linears use.
SCHEME_PRECISION = {"w4a16": "int4", "w8a16": "int8wo", "w8a8_int8": "int8", "fp8": "fp8"}
DTYPE_PRECISION = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
# The stock-PyTorch mode a precision is compared with (no stock FP8 or W8A8 path: 8-bit weights, bf16 math).
STOCK_QUANT = {"bf16": "bf16", "fp16": "bf16", "fp32": "bf16", "int4": "int4", "w4a8": "int4", "int8wo": "int8wo",
               "int8": "int8wo", "fp8": "int8wo"}


def precision_of(graph: dict[str, Any], manifest: dict[str, Any]) -> str:
    """bf16, fp8, int4, w4a8 (int4 weights, fp8 inputs), int8wo, int8 (W8A8): what most of the artifact's linears
    run in."""
    quants = [(n.get("attrs", {}).get("quant") or {}) for n in graph["nodes"] if n["op"] == "linear"]
    schemes = Counter(q.get("scheme", "none") + ("+fp8" if q.get("activation_quant") == "fp8" else "") for q in quants)
    scheme = schemes.most_common(1)[0][0] if schemes else "none"
    if scheme == "w4a16+fp8":  # W4A8: 4-bit weights, inputs rounded to fp8 (quantization.activation_quant)
        return "w4a8"
    if scheme == "none":
        return DTYPE_PRECISION.get(manifest["model"]["dtype"], manifest["model"]["dtype"])
    return SCHEME_PRECISION.get(scheme, scheme)


def figure_tag(graph: dict[str, Any], manifest: dict[str, Any]) -> str:
    """The part of figure names that says what ran: the precision (:func:`precision_of`), after ``moe_`` when the
    graph has mixture-of-experts layers, followed by ``_static`` when linears take calibrated (static) activation
    scales, then ``_qhead`` when the lm_head is quantized too (the stock baseline keeps it in the model dtype), and
    ``_float_experts`` when the linears are quantized but the experts are not
    (fp8 quantizes them by default: ``quantization.experts: false`` keeps them), then ``_kv{dtype}`` when the KV cache
    is quantized (``runtime.kv_cache_dtype`` fp8 or int8: the same weights with another cache are another artifact),
    and ``_fastacc`` when FP8 linears (on bf16 / fp16 activations) accumulate fast on cuBLAS
    (``runtime.fp8_accumulation``, or RUNTIME_FP8_FAST_ACCUM for this process: ``torch_quant.fp8_fast_accum``)."""
    moe_nodes = [n for n in graph["nodes"] if n["op"] == "moe"]
    quant_head = (manifest.get("quantization") or {}).get("lm_head", "none") != "none"
    quants = [(n.get("attrs") or {}).get("quant") or {} for n in graph["nodes"] if n["op"] == "linear"]
    quantized = any(quants)
    static = any(q.get("activations") == "static" for q in quants)
    float_experts = quantized and any(not (n.get("attrs") or {}).get("quant") for n in moe_nodes)
    kv = (manifest.get("runtime") or {}).get("kv_cache_dtype", "auto")
    # cuBLAS's FP8 GEMMs: FP8 linears on bf16 / fp16 activations (experts run the fused MoE kernels)
    scaled_mm = any(q.get("scheme") == "fp8" for q in quants) and \
        (manifest.get("model") or {}).get("dtype") in ("bfloat16", "float16")
    fast = scaled_mm and fp8_fast_accum((manifest.get("runtime") or {}).get("fp8_accumulation"))
    return (("moe_" if moe_nodes else "") + precision_of(graph, manifest) + ("_static" if static else "")
            + ("_qhead" if quant_head else "") + ("_float_experts" if float_experts else "")
            + (f"_kv{kv}" if kv != "auto" else "") + ("_fastacc" if fast else ""))


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def versions() -> dict[str, str]:
    out = {"toolchain": __version__, "torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    return out


def append_figures(path: str | Path, figures: list[tuple[str, float, str]], device: torch.device | str,
                   command: str) -> None:
    """Append (name, value, unit) figures measured on ``device`` by ``command`` (the command line to rerun)."""
    common = {"device": device_name(device), "versions": versions(), "command": command,
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    with open(path, "a") as f:
        for name, value, unit in figures:
            f.write(json.dumps({"figure": name, "value": round(value, 3), "unit": unit, **common}) + "\n")


def latest_figures(path: str | Path, patterns: list[str] | None = None) -> list[dict[str, Any]]:
    """The current line of each figure in the record (its latest), sorted by name; ``patterns``: only the names
    containing one of them. A line that is not a JSON object with a figure name is an error naming its number."""
    latest: dict[str, dict[str, Any]] = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not a JSON line ({e})") from None
        if not isinstance(row, dict) or not isinstance(row.get("figure"), str):
            raise ValueError(f"{path}:{number}: not a figure (a JSON object with a \"figure\" name)")
        latest[row["figure"]] = row
    names = sorted(n for n in latest if not patterns or any(p in n for p in patterns))
    return [latest[n] for n in names]


def main(argv: list[str] | None = None) -> int:
    """``python -m builder.bench.record [--record docs/benchmarks.jsonl] [PATTERN ...]``: the current figures as a
    markdown table (name, value, unit, device, date)."""
    import argparse

    parser = argparse.ArgumentParser(description="the current value of each recorded benchmark figure")
    parser.add_argument("patterns", nargs="*", help="only figures whose name contains one of these")
    parser.add_argument("--record", default="docs/benchmarks.jsonl")
    args = parser.parse_args(argv)
    print("| figure | value | unit | device | date |")
    print("| --- | ---: | --- | --- | --- |")
    for row in latest_figures(args.record, args.patterns):
        print(f"| {row['figure']} | {row.get('value')} | {row.get('unit', '')} | {row.get('device', '')} | "
              f"{str(row.get('date', ''))[:10]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
