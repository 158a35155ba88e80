"""llm-compressor's quantization of a local checkpoint, for ``python -m builder.bench.quantizers``.

Runs in llm-compressor's own virtualenv (it imports nothing from this repository)::

    python builder/bench/peer_llmcompressor.py --model models/pystdlib-llama --windows DIR/calib_windows.json \
        --eval-windows DIR/eval_windows.json --out DIR/llm-compressor [--methods gptq,awq,...]

Methods: gptq, gptq_sym (W4A16 g64, no act-order), gptq_act, gptq_sym_act (the same with actorder="static"),
awq, awq_sym, smoothquant, smoothquant_static, fp8, int8_wo, int8_wo_gptq (W8A16 per-channel symmetric GPTQ,
actorder "static", damp 0.01, block 128).

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


def w4_g64(symmetric=False):
    return {"group_0": QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", strategy="group", group_size=G, symmetric=symmetric, dynamic=False))}


def w8_channel_sym():
    return {"group_0": QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=8, type="int", strategy="channel", symmetric=True, dynamic=False))}


def w8a8_static():
    return {"group_0": QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=8, type="int", strategy="channel", symmetric=True, dynamic=False),
        input_activations=QuantizationArgs(num_bits=8, type="int", strategy="tensor", symmetric=True, dynamic=False))}


def recipe_for(method):
    if method in ("gptq", "gptq_sym"):  # W4A16 g64 (a)symmetric, no act-order, damp 0.01, block 128
        return [GPTQModifier(config_groups=w4_g64(method == "gptq_sym"), ignore=IGNORE, actorder=None,
                             block_size=128, dampening_frac=0.01)]
    if method in ("gptq_act", "gptq_sym_act"):  # the same with llm-compressor's default act-order, "static"
        return [GPTQModifier(config_groups=w4_g64(method == "gptq_sym_act"), ignore=IGNORE, actorder="static",
                             block_size=128, dampening_frac=0.01)]
    if method in ("awq", "awq_sym"):  # AWQ scale search (n_grid 20) + W4A16 g64 (a)symmetric RTN of the scaled weights
        return [AWQModifier(n_grid=20), QuantizationModifier(config_groups=w4_g64(method == "awq_sym"), ignore=IGNORE)]
    if method == "smoothquant":  # alpha 0.5, then W8A8 INT8: per-channel sym weights, dynamic per-token acts
        return [SmoothQuantModifier(smoothing_strength=0.5), QuantizationModifier(scheme="W8A8", ignore=IGNORE)]
    if method == "smoothquant_static":  # alpha 0.5, then INT8 per-channel sym weights, static per-tensor acts
        return [SmoothQuantModifier(smoothing_strength=0.5),
                QuantizationModifier(config_groups=w8a8_static(), ignore=IGNORE)]
    if method == "fp8":  # FP8 E4M3: per-channel weights, dynamic per-token activations
        return [QuantizationModifier(scheme="FP8_DYNAMIC", ignore=IGNORE)]
    if method == "int8_wo":  # W8A16 per-channel symmetric RTN
        return [QuantizationModifier(config_groups=w8_channel_sym(), ignore=IGNORE)]
    if method == "int8_wo_gptq":  # W8A16 per-channel symmetric GPTQ, static act-order (its default)
        return [GPTQModifier(config_groups=w8_channel_sym(), ignore=IGNORE, actorder="static", block_size=128,
                             dampening_frac=0.01)]
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
    # native_logits.safetensors lands in the same directory; the index names model.safetensors as the only weight
    # file, so a loader that honours it (builder.checkpoint) does not take the logits for extra checkpoint tensors
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in sd.values())},
         "weight_map": {k: "model.safetensors" for k in sd}}, indent=1))
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
    ap.add_argument("--methods", default="gptq,gptq_sym,gptq_act,gptq_sym_act,awq,smoothquant,smoothquant_static,"
                    "fp8,int8_wo", help="comma-separated; gptq_act / gptq_sym_act are gptq / gptq_sym with "
                    "actorder='static' (llm-compressor's default activation ordering)")
    a = ap.parse_args()
    src = Path(a.model)
    windows = json.loads(Path(a.windows).read_text())["windows"]
    eval_windows = json.loads(Path(a.eval_windows).read_text())["windows"]
    ds = Dataset.from_dict({"input_ids": windows, "attention_mask": [[1] * len(w) for w in windows]})
    Path(a.out).mkdir(parents=True, exist_ok=True)
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
