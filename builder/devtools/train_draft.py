"""Train the bundled draft model: a small Llama distilled from the bundled checkpoint, for speculative decoding.

    python -m builder.devtools.train_draft --target models/pystdlib-llama --out models/pystdlib-llama-draft

The draft shares the target's tokenizer (copied) and is trained on the target's own train split of the Python
standard library (``builder.devtools.train_bundled``'s files, split and packing), to match the target rather than
the text: the loss at every position is KL(target || draft) over the vocabulary, the target's softmax at
temperature 1 taken as the label. What speculation needs from a draft is to propose the target's own next token,
so the report gives, on windows of the held-out eval split, the share of positions where the draft's top token is
the target's (the chance a greedy draft token is accepted when the draft saw the same context) beside both models'
perplexity. The checkpoint is stored in bf16 (under 2 MB), the tokenizer files copied from the target.

The default run is reproducible: fixed seed, fixed file order and split, fixed batches and number of steps.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

import torch

from builder.devtools.train_bundled import (SPLIT_EVAL, SPLIT_TRAIN, ModelSpec, TrainSpec, autocast, batch_order,
                                            build_model, collect_stdlib_files, encode_documents, lr_factor,
                                            make_optimizer, pack_windows, split_files, stdlib_root)

DRAFT_SPEC = ModelSpec(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
EVAL_WINDOWS = 64


def distill_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(softmax(target) || softmax(draft)), in nats (fp32)."""
    t = torch.log_softmax(target_logits.float(), dim=-1)
    d = torch.log_softmax(draft_logits.float(), dim=-1)
    return (t.exp() * (t - d)).sum(-1).mean()


@torch.no_grad()
def agreement(draft: torch.nn.Module, target: torch.nn.Module, windows: torch.Tensor,
              batch_size: int = 16) -> dict[str, float]:
    """On ``windows``: the share of positions where the draft's top token is the target's, the mean KL(target ||
    draft), and each model's perplexity (each window predicts its own last seq_len - 1 tokens)."""
    same = kl = nll_d = nll_t = 0.0
    n = 0
    device = next(draft.parameters()).device
    for i in range(0, windows.size(0), batch_size):
        x = windows[i:i + batch_size].to(device)
        d, t = draft(input_ids=x).logits.float(), target(input_ids=x).logits.float()
        same += (d.argmax(-1) == t.argmax(-1)).sum().item()
        kl += distill_loss(d, t).item() * x.numel()
        labels = x[:, 1:].reshape(-1)
        nll_d += torch.nn.functional.cross_entropy(d[:, :-1].reshape(-1, d.size(-1)), labels, reduction="sum").item()
        nll_t += torch.nn.functional.cross_entropy(t[:, :-1].reshape(-1, t.size(-1)), labels, reduction="sum").item()
        n += x.numel()
    n_pred = windows.size(0) * (windows.size(1) - 1)
    return {"top1_agreement": round(same / n, 4), "kl_target_draft": round(kl / n, 4),
            "draft_perplexity": round(math.exp(nll_d / n_pred), 2), "target_perplexity": round(math.exp(nll_t / n_pred), 2),
            "positions": n}


def distill(draft: torch.nn.Module, target: torch.nn.Module, windows: torch.Tensor, spec: TrainSpec) -> list:
    """AdamW on ``distill_loss`` over seeded batches of ``windows`` (warmup, then cosine decay; bf16 autocast on
    CUDA); the loss curve."""
    device = next(draft.parameters()).device
    optimizer = make_optimizer(draft, spec)
    batches = batch_order(windows.size(0), spec.batch_size, spec.max_steps, spec.seed)
    draft.train()
    curve, recent, start = [], [], time.perf_counter()
    for step, idx in enumerate(batches, start=1):
        progress = (step - spec.warmup_steps) / max(spec.max_steps - spec.warmup_steps, 1)
        for group in optimizer.param_groups:
            group["lr"] = spec.peak_lr * lr_factor(step, spec.warmup_steps, progress, spec.min_lr_ratio)
        x = windows[idx].to(device)
        with torch.no_grad(), autocast(device):
            target_logits = target(input_ids=x).logits
        with autocast(device):
            loss = distill_loss(draft(input_ids=x).logits, target_logits)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), spec.grad_clip)
        optimizer.step()
        recent = (recent + [loss.item()])[-spec.log_every:]
        if step % spec.log_every == 0 or step in (1, len(batches)):
            curve.append((step, round(sum(recent) / len(recent), 4)))
            print(f"step {step:5d}/{spec.max_steps}  KL {loss.item():.4f}  avg{len(recent)} {curve[-1][1]:.4f}  "
                  f"{(time.perf_counter() - start) / step:.2f}s/step", flush=True)
    draft.eval()
    return curve


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, default=Path("models/pystdlib-llama"), help="the bundled checkpoint")
    p.add_argument("--out", type=Path, default=Path("models/pystdlib-llama-draft"))
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--stdlib", type=Path, default=None, help="stdlib directory (default: this interpreter's)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (CUDA: bf16 autocast, fp32 weights)")
    return p.parse_args(argv)


def frozen_target_and_windows(args: argparse.Namespace, device: torch.device
                              ) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The target checkpoint ``args.target``, frozen, on ``device``; the train split's windows of ``args.seq_len``
    tokens and EVAL_WINDOWS seeded windows of the eval split (``args.stdlib``, else this interpreter's library): what a
    model trained to match the target (this draft, ``train_eagle``'s head) learns from and is scored on."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    tokenizer = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval().to(device)
    for p in target.parameters():
        p.requires_grad_(False)
    files, _ = collect_stdlib_files(args.stdlib or stdlib_root())
    splits = split_files(files)
    train = pack_windows(encode_documents(tokenizer, [f.text for f in splits[SPLIT_TRAIN]]), args.seq_len)
    held_out = pack_windows(encode_documents(tokenizer, [f.text for f in splits[SPLIT_EVAL]]), args.seq_len)
    held_out = held_out[torch.randperm(held_out.size(0), generator=torch.Generator().manual_seed(args.seed))]
    held_out = held_out[:EVAL_WINDOWS]
    print(f"{train.size(0)} train windows, {held_out.size(0)} eval windows of {args.seq_len} tokens "
          f"({time.perf_counter() - t0:.0f}s)", flush=True)
    return target, train, held_out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    t0 = time.perf_counter()
    target, train, held_out = frozen_target_and_windows(args, device)
    spec = TrainSpec(seed=args.seed, max_steps=args.max_steps, batch_size=args.batch_size, seq_len=args.seq_len,
                     peak_lr=args.lr, threads=args.threads)
    draft = build_model(DRAFT_SPEC, target.config.vocab_size).to(device)
    before = agreement(draft, target, held_out)
    t1 = time.perf_counter()
    curve = distill(draft, target, train, spec)
    train_s = time.perf_counter() - t1
    draft.to(torch.bfloat16).to(torch.float32)  # the values stored (bf16): measure those
    after = agreement(draft, target, held_out)
    print(json.dumps({"before": before, "after": after}), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    draft.to("cpu").to(torch.bfloat16).save_pretrained(args.out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (args.target / name).exists():
            shutil.copyfile(args.target / name, args.out / name)
    params = sum(p.numel() for p in draft.parameters())
    metrics = {"target": str(args.target), "model": asdict(DRAFT_SPEC), "parameters": params,
               "train": {**asdict(spec), "device": str(device),
                         **({"device_name": torch.cuda.get_device_name(device)} if device.type == "cuda" else {})},
               "train_windows": train.size(0), "train_seconds": round(train_s, 1),
               "loss": "KL(target || draft), nats per position", "loss_curve": curve,
               "held_out": {"windows": held_out.size(0), "seq_len": args.seq_len, "untrained": before,
                            "trained": after},
               "weights_bytes": (args.out / "model.safetensors").stat().st_size,
               "command": "python -m builder.devtools.train_draft " + " ".join(sys.argv[1:] if argv is None else argv)}
    (args.out / "training_metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    print(f"wrote {args.out} ({params} parameters, {metrics['weights_bytes']} bytes of weights) in "
          f"{time.perf_counter() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
