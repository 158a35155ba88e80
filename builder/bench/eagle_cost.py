"""What an EAGLE head's proposal costs beside its target, on the device the target runs on.

    python -m builder.bench.eagle_cost ARTIFACT [--head DIR | --config CHECKPOINT/config.json [--layers 1]
        [--eagle3 [--draft-vocab 32000]]] [--num-draft 4 ...] [--requests 1 ...] [--context 128]
        [--iters 50] [--device cuda] [--record FILE] [--tag NAME]

One request of ``--context`` tokens: its target hidden states recorded (random rows, the head's input; what they
hold does not change the cost), then the proposal a verify step is followed by, timed: the one accepted pair fed
and k - 1 chain steps (a CUDA-graph replay on CUDA) through ``EagleProposer.propose``, which reads the drafts back.
The median over ``--iters`` proposals is printed in ms for each k. Without ``--head``, a random EAGLE-1 head of
``--layers`` layers shaped like the target's layers (hidden size, heads, kv heads, intermediate size, from the
target checkpoint's ``--config``) is written to a temporary directory: the cost of a head of that size, not its
acceptance. ``--eagle3``: a random EAGLE-3 head instead (the target's streams at its default layers 2, L // 2,
L - 3, or 1, L // 2, L for a target too small for three of those, through fc, an lm_head over ``--draft-vocab``
tokens, as the published Llama-3.1-8B heads have 32,000). ``--requests N``: N requests of that context draft
together, one proposal over all of them. The head's cache holds ``--max-seq-len`` positions a request (default:
the artifact's max_seq_len, as the serving engine sizes it); a head step attends over at most
``RUNTIME_EAGLE_WINDOW`` of them (2,048 by default; sessions 56 and 57 measured a slot of the context + k + 8
positions, over all of which the head attended then).
Figures (``--record``): eagle_proposal_ms_k{K}{tag} (ms), eagle3_proposal_ms_k{K}{tag} with ``--eagle3``; with N
requests, ..._k{K}_r{N}{tag}.
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


def random_head(out: Path, cfg: dict, layers: int, seed: int = 0, eagle3: bool = False,
                draft_vocab: int = 32000) -> Path:
    """A random EAGLE-1 head (or, ``eagle3``, an EAGLE-3 head over ``draft_vocab`` draft tokens) for a target of the
    Hugging Face config ``cfg`` (its layers' shape), in ``out``."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv, d, inter = cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or h // heads, cfg["intermediate_size"]

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    n = cfg["num_hidden_layers"]
    layers_read = sorted({2, n // 2, n - 3})  # an EAGLE-3 head's target layers (vLLM's default)
    if len(layers_read) < 3 or layers_read[0] < 1:  # a small target: layers of its own, as many as it has
        layers_read = sorted({min(1, n), max(1, n // 2), n})
    w = {"fc.weight": rnd(h, (len(layers_read) if eagle3 else 2) * h)}
    for i in range(layers):
        p = f"layers.{i}."
        a = 2 * h if eagle3 and i == 0 else h  # an EAGLE-3 head's first layer attends over embedding and state
        w.update({p + "self_attn.q_proj.weight": rnd(heads * d, a), p + "self_attn.k_proj.weight": rnd(kv * d, a),
                  p + "self_attn.v_proj.weight": rnd(kv * d, a), p + "self_attn.o_proj.weight": rnd(h, heads * d),
                  p + "mlp.gate_proj.weight": rnd(inter, h), p + "mlp.up_proj.weight": rnd(inter, h),
                  p + "mlp.down_proj.weight": rnd(h, inter), p + "post_attention_layernorm.weight": rnd(h) + 1})
        if i or eagle3:
            w[p + "input_layernorm.weight"] = rnd(h) + 1
    config = {"hidden_size": h, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": d,
              "intermediate_size": inter, "num_hidden_layers": layers, "rms_norm_eps": cfg.get("rms_norm_eps", 1e-5),
              "rope_theta": cfg.get("rope_theta", 10000.0), "hidden_act": "silu"}
    if eagle3:
        vocab = cfg["vocab_size"]
        draft_vocab = min(draft_vocab, vocab)
        ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
        w.update({"layers.0.hidden_norm.weight": rnd(h) + 1, "norm.weight": rnd(h) + 1,
                  "lm_head.weight": rnd(draft_vocab, h), "d2t": ids - torch.arange(draft_vocab)})
        config.update({"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft_vocab,
                       "target_hidden_size": h, "vocab_size": vocab, "eagle_aux_hidden_state_layer_ids": layers_read})
    out.mkdir(parents=True, exist_ok=True)
    save_file(w, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
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
    p.add_argument("--eagle3", action="store_true", help="a random EAGLE-3 head (with --config)")
    p.add_argument("--draft-vocab", type=int, default=32000, help="the random EAGLE-3 head's draft vocabulary")
    p.add_argument("--num-draft", type=int, nargs="+", default=[4])
    p.add_argument("--requests", type=int, nargs="+", default=[1], help="requests drafting together")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="the head cache's positions a request (default: the artifact's max_seq_len, as served)")
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
            head = str(random_head(Path(tmp) / "head", json.loads(Path(args.config).read_text()), args.layers,
                                   eagle3=args.eagle3, draft_vocab=args.draft_vocab))
        figures = []
        for k in args.num_draft:
            for num in args.requests:
                cap = args.max_seq_len or engine.limits.max_seq_len
                if cap < args.context + k + 2:
                    p.error(f"--max-seq-len {cap} leaves no room for a {args.context}-token context and {k} drafts")
                proposer = EagleProposer.load(head, engine, max_seq_len=cap, max_seqs=num, max_draft_tokens=k)
                requests = []
                for i in range(num):
                    hidden = torch.randn(args.context, proposer.head.input_width, device=engine.device,
                                         dtype=proposer.head.dtype)
                    tokens = torch.randint(0, proposer.head.embed.shape[0], (args.context + 1,)).tolist()
                    proposer.record_hidden(f"r{i}", 0, hidden)
                    requests.append(DraftRequest(f"r{i}", tokens, k))
                proposer.propose(requests)  # the prompts' catch-up, then the proposals after one accepted pair
                times = []
                for _ in range(args.iters):
                    if engine.device.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    proposer.propose(requests)
                    times.append((time.perf_counter() - t0) * 1000)
                ms = statistics.median(times)
                kind = "EAGLE-3" if proposer.head.config.version == 3 else "EAGLE"
                print(f"{kind} proposal, k = {k}, {num} request(s) of {args.context}-token context, {cap}-position "
                      f"head cache, head {head if args.head else 'random'}: {ms:.3f} ms (median of {args.iters})")
                prefix = "eagle3" if proposer.head.config.version == 3 else "eagle"
                figures.append((f"{prefix}_proposal_ms_k{k}{'' if num == 1 else f'_r{num}'}{args.tag}", ms, "ms"))
                proposer.close()
    if args.record:
        append_figures(args.record, figures, args.device,
                       "python -m builder.bench.eagle_cost " + " ".join(argv or sys.argv[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
