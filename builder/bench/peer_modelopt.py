"""NVIDIA ModelOpt's quantization of a local checkpoint, for ``python -m builder.bench.quantizers``.

Runs in ModelOpt's own virtualenv (it imports nothing from this repository)::

    python builder/bench/peer_modelopt.py --model models/pystdlib-llama --windows DIR/calib_windows.json \\
        --eval-windows DIR/eval_windows.json --out DIR/modelopt [--methods gptq_sym,awq,...]

For each method: ``mtq.quantize`` on the HF model (fp32, loaded from the local directory) with a forward loop over
the exact calibration token windows, then the tool's own forward (its fake quantization of weights, and of
activations where the scheme has them) on the eval windows, written to ``DIR/<method>/native_logits.safetensors``.
ModelOpt keeps smoothing and AWQ scales as ``pre_quant_scale`` on the input quantizers (applied to the activations
in that forward; TensorRT-LLM folds them at export), so no plain fake-quant checkpoint is written: the native
forward is the figure. The lm_head stays unquantized (the configs' own ``*lm_head*`` rule), as in our builds.

Methods and configurations (group size 64 where the scheme has groups: the fixtures' widths are multiples of 64,
not all of 128):

- ``gptq_sym``: INT4 weights, blocks of 64, symmetric (ModelOpt's INT4 has no zero point), algorithm ``gptq``
  (damp 0.01, block 128).
- ``awq_sym``: ``INT4_AWQ_CFG`` with blocks of 64 (symmetric), algorithm ``awq_lite`` (the config's default: the
  scale search); ``awq_full_sym``: the same with ``awq_full`` (scale search, then clip search).
- ``smoothquant_static``: ``INT8_SMOOTHQUANT_CFG`` (INT8 per-channel weights, static per-tensor INT8 activations,
  smoothing alpha 1.0, its default).
- No dynamic (per-token) SmoothQuant: ModelOpt's smoothquant calibration sets a per-channel axis on the input
  quantizers, which its per-token dynamic setting (``block_sizes {-1: None}``) refuses ("Axis and block_sizes are
  both set", 0.47.0): its INT8 SmoothQuant is static.
- ``fp8``: ``FP8_PER_CHANNEL_PER_TOKEN_CFG`` (E4M3 per-channel weights, dynamic per-token activations).
- ``int8_wo``: ``INT8_WEIGHT_ONLY_CFG`` (INT8 per-channel weights); ``int8_wo_gptq``: the same with algorithm
  ``gptq`` (damp 0.01, block 128).
"""

import argparse
import copy
import json
import platform
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

import modelopt
import modelopt.torch.quantization as mtq

GROUP = 64
METHODS = ["gptq_sym", "awq_sym", "awq_full_sym", "smoothquant_static", "fp8", "int8_wo", "int8_wo_gptq"]


def _with(base: dict, algorithm=None, weight=None) -> dict:
    """A copy of a ModelOpt config with the weight quantizer entry replaced and the algorithm set."""
    cfg = copy.deepcopy(base)
    for entry in cfg["quant_cfg"]:
        if entry.get("quantizer_name") == "*weight_quantizer" and weight is not None:
            entry["cfg"] = weight
    if algorithm is not None:
        cfg["algorithm"] = algorithm
    return cfg


def config_for(method: str) -> dict:
    int4_g = {"num_bits": 4, "block_sizes": {-1: GROUP, "type": "static"}, "enable": True}
    if method == "gptq_sym":
        return _with(mtq.INT4_AWQ_CFG, {"method": "gptq", "perc_damp": 0.01, "block_size": 128}, weight=int4_g)
    if method == "awq_sym":
        return _with(mtq.INT4_AWQ_CFG, {"method": "awq_lite", "alpha_step": 0.1}, weight=int4_g)
    if method == "awq_full_sym":
        return _with(mtq.INT4_AWQ_CFG, {"method": "awq_full", "alpha_step": 0.1}, weight=int4_g)
    if method == "smoothquant_static":
        return copy.deepcopy(mtq.INT8_SMOOTHQUANT_CFG)
    if method == "fp8":
        return copy.deepcopy(mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG)
    if method == "int8_wo":
        return copy.deepcopy(mtq.INT8_WEIGHT_ONLY_CFG)
    if method == "int8_wo_gptq":
        return _with(mtq.INT8_WEIGHT_ONLY_CFG, {"method": "gptq", "perc_damp": 0.01, "block_size": 128})
    raise ValueError(f"unknown method {method}; one of {', '.join(METHODS)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--windows", required=True)
    ap.add_argument("--eval-windows", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--methods", default=",".join(METHODS))
    a = ap.parse_args()
    torch.manual_seed(0)
    windows = json.loads(Path(a.windows).read_text())["windows"]
    eval_windows = json.loads(Path(a.eval_windows).read_text())["windows"]
    out_root = Path(a.out)
    out_root.mkdir(parents=True, exist_ok=True)
    summary_path = out_root / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    for method in a.methods.split(","):
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32, local_files_only=True).eval()

        def forward_loop(m):
            with torch.no_grad():
                for w in windows:
                    m(torch.tensor([w]))

        t = time.perf_counter()
        try:
            cfg = config_for(method)
            mtq.quantize(model, cfg, forward_loop)
        except Exception as e:  # noqa: BLE001 - one method's failure is reported, the others still run
            summary[method] = {"error": f"{type(e).__name__}: {e}"}
            print(method, "FAILED:", summary[method]["error"], flush=True)
            continue
        secs = time.perf_counter() - t
        out = out_root / method
        out.mkdir(parents=True, exist_ok=True)
        with torch.no_grad():
            logits = {f"w{i}": model(torch.tensor([w])).logits[0].float().contiguous()
                      for i, w in enumerate(eval_windows)}
        save_file(logits, out / "native_logits.safetensors")
        quantized = sum(1 for n, mod in model.named_modules()
                        if n.endswith("weight_quantizer") and getattr(mod, "is_enabled", False))
        info = {"quantize_seconds": round(secs, 1), "weight_quantizers_enabled": quantized,
                "algorithm": json.loads(json.dumps(cfg.get("algorithm"), default=str))}
        (out / "info.json").write_text(json.dumps(info, indent=1))
        summary[method] = info
        print(method, json.dumps(info), flush=True)
        del model
    summary_path.write_text(json.dumps(summary, indent=1))
    import transformers

    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "modelopt": modelopt.__version__}
    (out_root / "versions.json").write_text(json.dumps(versions, indent=1))


if __name__ == "__main__":
    main()
