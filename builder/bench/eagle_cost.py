"""What an EAGLE head's proposal costs beside its target, on the device the target runs on.

    python -m builder.bench.eagle_cost ARTIFACT [--head DIR | --config CHECKPOINT/config.json [--layers 1]]
        [--num-draft 4 ...] [--context 128]
        [--iters 50] [--device cuda] [--record FILE] [--tag NAME]

One request of ``--context`` tokens: its target hidden states recorded (random rows, the head's input; what they
hold does not change the cost), then the proposal a verify step is followed by, timed: the one accepted pair fed
and k - 1 chain steps (a CUDA-graph replay on CUDA) through ``EagleProposer.propose``, which reads the drafts back.
The median over ``--iters`` proposals is printed in ms for each k. Without ``--head``, a random EAGLE-1 head of
``--layers`` layers shaped like the target's layers (hidden size, heads, kv heads, intermediate size, from the
target checkpoint's ``--config``) is written to a temporary directory: the cost of a head of that size, not its
acceptance.
Figures (``--record``): eagle_proposal_ms_k{K}{tag} (ms).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def random_head(out: Path, cfg: dict, layers: int, seed: int = 0) -> Path:
    """A random EAGLE-1 head for a target of the Hugging Face config ``cfg`` (its layers' shape), in ``out``."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv, d, inter = cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or h // heads, cfg["intermediate_size"]

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    w = {"fc.weight": rnd(h, 2 * h)}
    for i in range(layers):
        p = f"layers.{i}."
        w.update({p + "self_attn.q_proj.weight": rnd(heads * d, h), p + "self_attn.k_proj.weight": rnd(kv * d, h),
                  p + "self_attn.v_proj.weight": rnd(kv * d, h), p + "self_attn.o_proj.weight": rnd(h, heads * d),
                  p + "mlp.gate_proj.weight": rnd(inter, h), p + "mlp.up_proj.weight": rnd(inter, h),
                  p + "mlp.down_proj.weight": rnd(h, inter), p + "post_attention_layernorm.weight": rnd(h) + 1})
        if i:
            w[p + "input_layernorm.weight"] = rnd(h) + 1
    out.mkdir(parents=True, exist_ok=True)
    save_file(w, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({
        "hidden_size": h, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": d,
        "intermediate_size": inter, "num_hidden_layers": layers, "rms_norm_eps": cfg.get("rms_norm_eps", 1e-5),
        "rope_theta": cfg.get("rope_theta", 10000.0), "hidden_act": "silu"}))
    return out


def main(argv: list[str] | None = None) -> int:
    from builder.bench.record import append_figures
    from runtime import Engine
    from runtime.eagle import EagleProposer
    from runtime.speculative import DraftRequest

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--head", help="an EAGLE head's checkpoint directory (default: a random one, --layers)")
    p.add_argument("--config", help="the target checkpoint's config.json: the random head's shape")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--num-draft", type=int, nargs="+", default=[4])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--device", default="cuda")
    p.add_argument("--record")
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    engine = Engine.load(args.artifact, args.device)
    with tempfile.TemporaryDirectory() as tmp:
        head = args.head
        if head is None:
            if args.config is None:
                p.error("give --head (a trained head) or --config (the target's config.json, for a random head)")
            head = str(random_head(Path(tmp) / "head", json.loads(Path(args.config).read_text()), args.layers))
        figures = []
        for k in args.num_draft:
            proposer = EagleProposer.load(head, engine, max_seq_len=args.context + k + 8, max_seqs=1,
                                          max_draft_tokens=k)
            hidden = torch.randn(args.context, proposer.head.config.hidden_size, device=engine.device,
                                 dtype=proposer.head.dtype)
            tokens = torch.randint(0, proposer.head.embed.shape[0], (args.context + 1,)).tolist()
            proposer.record_hidden("r", 0, hidden)
            proposer.propose([DraftRequest("r", tokens, k)])  # the prompt's catch-up, then the one-pair proposals
            times = []
            for _ in range(args.iters):
                if engine.device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                proposer.propose([DraftRequest("r", tokens, k)])
                times.append((time.perf_counter() - t0) * 1000)
            ms = statistics.median(times)
            print(f"EAGLE proposal, k = {k}, {args.context}-token context, head {head if args.head else 'random'}: "
                  f"{ms:.3f} ms (median of {args.iters})")
            figures.append((f"eagle_proposal_ms_k{k}{args.tag}", ms, "ms"))
            proposer.close()
    if args.record:
        append_figures(args.record, figures, args.device,
                       "python -m builder.bench.eagle_cost " + " ".join(argv or sys.argv[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
