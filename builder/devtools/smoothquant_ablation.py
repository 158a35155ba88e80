"""SmoothQuant's parts on one checkpoint: KL against the unquantized model for static and dynamic W8A8 INT8 with
each part of the pass turned on or off (alpha searched per group or fixed at 0.5, the down projection smoothed
through the up projection and the output projection through the v projection or not, static input scales clipped or not). A measurement script, not a test::

    python -m builder.devtools.smoothquant_ablation [--checkpoint models/pystdlib-llama]

Calibration: ``--num-samples`` windows of 128 tokens of the checkpoint's ``calibration.jsonl`` (else the bundled
model's); evaluation: the gates' set over its ``eval.txt`` (``builder.gates.make_eval_set``, 2048 positions in
windows of 256), scored by ``builder.gates.compare``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from builder.calibration import DEFAULT_CALIBRATION, DEFAULT_EVAL, token_stream, token_windows
from builder.checkpoint import attach_weights, open_checkpoint
from builder.gates import GateThresholds, compare, make_eval_set
from builder.quality import GraphModel
from passes import PassContext, run_passes
from passes import smoothquant as sq
from passes.trace import trace
from runtime.tokenizer import Tokenizer

GRAPH_PASSES = ["merge_qkv", "merge_gate_up", "fuse_silu_mul", "fuse_add_rms_norm", "dce"]
BOTH, DOWN, NONE = {"down", "out"}, {"down"}, set()
VARIANTS = [  # (label, options, projections smoothed through their producer: "down" via up, "out" via v)
    ("static, no smoothing, max scale (naive)", dict(activations="static", smoothing=False, static_scale="max"), BOTH),
    ("static, no smoothing, clipped scale", dict(activations="static", smoothing=False), BOTH),
    ("static, alpha 0.5, norms only", dict(activations="static", alpha=0.5), NONE),
    ("static, alpha 0.5", dict(activations="static", alpha=0.5), BOTH),
    ("static, alpha searched (default)", dict(activations="static"), DOWN),
    ("static, alpha searched, smooth_output (default: off)", dict(activations="static"), BOTH),
    ("static, alpha searched, clipped scale", dict(activations="static", static_scale="mse"), BOTH),
    ("dynamic, no smoothing", dict(smoothing=False), BOTH),
    ("dynamic, alpha 0.5, norms only", dict(alpha=0.5), NONE),
    ("dynamic, alpha searched, no output projection", dict(), DOWN),
    ("dynamic, alpha searched (default)", dict(), BOTH),
]


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m builder.devtools.smoothquant_ablation", description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=Path("models/pystdlib-llama"))
    ap.add_argument("--num-samples", type=int, default=16)
    args = ap.parse_args()
    ckpt = open_checkpoint(args.checkpoint)
    graph, meta_model = trace(ckpt.hf_config())
    attach_weights(graph, ckpt, meta_model, torch.float32)
    graph, _ = run_passes(graph, GRAPH_PASSES, PassContext())
    tok = Tokenizer.from_dir(args.checkpoint)
    encode = lambda t: tok.encode(t, add_special_tokens=False)  # noqa: E731
    calib_file = args.checkpoint / "calibration.jsonl"
    eval_file = args.checkpoint / "eval.txt"
    calib = token_windows(calib_file if calib_file.exists() else Path(DEFAULT_CALIBRATION), encode,
                          args.num_samples, 128, 0).windows
    stream, _ = token_stream(eval_file if eval_file.exists() else Path(DEFAULT_EVAL), encode)
    eval_set = make_eval_set(stream, 256, 2048)
    base = GraphModel(graph)
    up_rows, v_rows = sq.SmoothQuant.__dict__["_up_rows"], sq.SmoothQuant.__dict__["_v_rows"]
    off = staticmethod(lambda *a: None)
    print(f"| {args.checkpoint} | KL | top-1 | down / output projections smoothed | mean alpha |")
    print("| --- | --- | --- | --- | --- |")
    for label, options, folds in VARIANTS:
        sq.SmoothQuant._up_rows = up_rows if "down" in folds else off
        sq.SmoothQuant._v_rows = v_rows if "out" in folds else off
        options = {**options, "smooth_output": "out" in folds}
        quantized, records = run_passes(graph.copy(), ["smoothquant", "dce"],
                                        PassContext(calibration=calib, options={"smoothquant": options}))
        report = compare(base.logits, GraphModel(quantized).logits, eval_set, GateThresholds())
        d = records[0].details
        print(f"| {label} | {report.metric('kl').value:.3e} | {report.metric('top1_agreement').value:.4f} | "
              f"{d.get('smoothed_down_projections', 0)} / {d.get('smoothed_output_projections', 0)} | "
              f"{d.get('alpha_mean', d.get('alpha'))} |", flush=True)
    sq.SmoothQuant._up_rows, sq.SmoothQuant._v_rows = up_rows, v_rows
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
