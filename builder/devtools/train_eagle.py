"""Train an EAGLE-1 or EAGLE-3 head for the bundled model: a draft made from the target's own hidden states.

    python -m builder.devtools.train_eagle --target models/pystdlib-llama --out models/pystdlib-llama-eagle
    python -m builder.devtools.train_eagle --eagle3 --out models/pystdlib-llama-eagle3

The head is the layout ``runtime/eagle.py`` loads (its module docstring gives the math): for position i, with f_i
the target's final hidden state (after its final norm: the lm_head's input) and t_{i+1} the next token,
``g_i = layers(fc(cat(embed(t_{i+1}), f_i)))`` is trained to be f_{i+1}, so that the target's own lm_head over g_i
drafts t_{i+2}. The embedding table and the lm_head are the target's, frozen, and not stored with the head.

Corpus, split, packing and seeds are ``builder.devtools.train_draft``'s (the target's train split of the Python
standard library; ``train_bundled``'s files and windows). The target runs frozen beside the head and gives, per
batch, the features f and its logits. The loss, per chained step, is SmoothL1(g, f) (the feature regression of
EAGLE) plus ``cls_weight`` times KL(target || lm_head(g)) over the vocabulary (the token the draft proposes is what
speculation needs). At inference the head is chained: after the first draft it is fed (g_i, draft) in place of
(f_{i+1}, t_{i+2}), so it must read its own features. Training unrolls the chain the same way (``--unroll``
steps): step s feeds step s - 1's outputs with the text's tokens, at the positions and under the attention the
runtime's cache gives it (the true pairs up to the chain's start, then the chain's own entries); later steps weigh
``STEP_DECAY`` less. Uniform noise on the true features (``--noise``, relative to their RMS; EAGLE-1's
augmentation) is optional.

``--eagle3`` trains an EAGLE-3 head instead, in the layout ``runtime/eagle.py`` loads as version 3 (vLLM's and
SGLang's): the target's residual streams entering layers ``--aux-layers`` (default 1, L // 2, L - 1: 1, 2 and 3
of the bundled 4-layer target; Hugging Face's ``hidden_states[j]``) side by side through ``fc`` (no bias) give h;
the first layer attends over cat(input_layernorm(embed(t_{i+1})), hidden_norm(h)) with h as its residual, and its
output stream s goes through the head's own final norm and lm_head (initialised from the target's tied one, trained,
stored; the draft vocabulary is the whole vocabulary, ``d2t`` zeros). Chain steps feed step s - 1's streams in
place of fc's output, unrolled as above. EAGLE-3 drops the feature regression: the loss is the KL term alone.
The checkpoint names the first layer ``midlayer.*``.

The report, on windows of the held-out eval split, per chain step s (1 to ``EVAL_STEPS``): ``top1_agreement``,
the share of positions where the head's draft is the target's top token there (step 1 from the true features,
later steps from the head's own, fed the text's tokens), and ``acceptance``, the same share over only the
positions where the chain was fed what greedy speculation would feed it (the text's tokens were the target's top
tokens and the earlier drafts were accepted): the chance a greedy draft at that step is accepted after the earlier
ones were. ``expected_accepted`` sums their running products: the drafts accepted per proposal of that many. The
weights are stored in bf16 and measured as stored.

The default run is reproducible: fixed seed, fixed file order and split, fixed batches and number of steps. Its
defaults fit a 2-core CPU (about ten minutes: 500 steps of 8 windows of 256 tokens, two chain steps; step-1
agreement about 0.55, near the bundled draft model's). ``--device cuda`` runs under bf16 autocast; the bundled head
(models/pystdlib-llama-eagle, agreement about 0.69 at each of three chain steps) took a minute on one H200::

    python -m builder.devtools.train_eagle --device cuda --max-steps 2000 --batch-size 16 --seq-len 512 \\
        --lr 3e-3 --unroll 3 --cls-weight 0.5

``--eagle3`` has the same defaults and about the same time on the CPU (about a second a step); that default run
(7.1 MB, 3.1 MB of it its lm_head; not bundled, models/README.md) gives agreement 0.41, 0.37 and 0.29 at the three
chain steps, against 0.55, 0.53 and 0.52 for the EAGLE-1 default (on this 4-layer target the streams entering
layers 1 to 3 lack the last layer's output, which EAGLE-1 reads).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from builder.devtools.train_bundled import TrainSpec, autocast, batch_order, lr_factor, make_optimizer
from builder.devtools.train_draft import distill_loss, frozen_target_and_windows

EVAL_STEPS = 3  # chain steps reported on the held-out windows
STEP_DECAY = 0.8  # weight of chain step s in the loss: STEP_DECAY ** (s - 1)
EAGLE3_DEFAULT_OUT = Path("models/pystdlib-llama-eagle3")
WEIGHTS_FILE = "model.safetensors"


@dataclass
class EagleSpec:
    """The head's shape. hidden_size, rms_norm_eps and rope_theta are the target's; the defaults keep the bf16
    weights near 3 MB for the bundled model."""

    version: ClassVar[int] = 1
    hidden_size: int
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    num_hidden_layers: int = 1
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def config(self, vocab_size: int) -> dict:
        """config.json as ``runtime.eagle.load_head`` (and vLLM / SGLang's EAGLE-1 loaders) read it."""
        return {"architectures": ["LlamaForCausalLMEagle"], "model_type": "llama",
                "hidden_size": self.hidden_size, "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
                "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
                "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "hidden_act": "silu",
                "vocab_size": vocab_size, "torch_dtype": "bfloat16"}


@dataclass
class Eagle3Spec(EagleSpec):
    """An EAGLE-3 head's shape: EagleSpec's, the target layers whose input streams fc reads, and the draft
    vocabulary (here the target's whole vocabulary; ``d2t`` is stored as zeros)."""

    version: ClassVar[int] = 3
    aux_layers: tuple[int, ...] = (1, 2, 3)
    target_hidden_size: int = 0  # 0: hidden_size
    draft_vocab_size: int = 0  # 0: the target's vocabulary

    def config(self, vocab_size: int) -> dict:
        """config.json in the layout ``runtime.eagle.load_head`` (and vLLM / SGLang's EAGLE-3 loaders) read."""
        return {**super().config(vocab_size), "architectures": ["LlamaForCausalLMEagle3"],
                "target_hidden_size": self.target_hidden_size or self.hidden_size,
                "draft_vocab_size": self.draft_vocab_size or vocab_size,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layers),
                                 "use_aux_hidden_state": True}}


class RMSNorm(nn.Module):
    """Llama's RMSNorm (statistics in fp32, the gain applied in the input's dtype), as the runtime computes it."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention with rotary positions over the chain's keys (see :meth:`forward`)."""

    def __init__(self, spec: EagleSpec, in_features: int) -> None:
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.heads, self.kv_heads, self.head_dim = spec.num_attention_heads, spec.num_key_value_heads, d
        self.q_proj = nn.Linear(in_features, self.heads * d, bias=False)
        self.k_proj = nn.Linear(in_features, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(in_features, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                past: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """``x`` [B, n, h]: entry i of chain step s = len(past) + 1, which attends the step-1 entries 0..i (the
        true pairs up to the chain's start) and entry i of every later step up to itself (the chain so far), as
        the runtime's cache holds them. ``past`` gets this step's keys and values appended."""
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        past.append((k, v))
        keys = torch.cat([pk[:, :, :n] for pk, _ in past], dim=2)
        values = torch.cat([pv[:, :, :n] for _, pv in past], dim=2)
        rep = self.heads // self.kv_heads
        if rep > 1:
            keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
        if len(past) == 1:
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True)
        else:
            idx = torch.arange(n, device=x.device)
            causal = idx[None, :] <= idx[:, None]
            diagonal = (idx[None, :] == idx[:, None]).repeat(1, len(past) - 1)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=torch.cat([causal, diagonal], dim=1))
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.heads * self.head_dim))


class MLP(nn.Module):
    """Llama's SwiGLU feed-forward."""

    def __init__(self, spec: EagleSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    """A Llama decoder layer. An EAGLE-1 head's first has no input norm (fc's output goes in as it is); an EAGLE-3
    head's first attends over cat(input_layernorm(embed), hidden_norm(x)) (q, k and v over 2h features), x its
    residual."""

    def __init__(self, spec: EagleSpec, index: int) -> None:
        super().__init__()
        h = spec.hidden_size
        self.takes_embeds = spec.version == 3 and index == 0
        if index > 0 or spec.version == 3:
            self.input_layernorm = RMSNorm(h, spec.rms_norm_eps)
        if self.takes_embeds:
            self.hidden_norm = RMSNorm(h, spec.rms_norm_eps)
        self.self_attn = Attention(spec, 2 * h if self.takes_embeds else h)
        self.post_attention_layernorm = RMSNorm(h, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                past: list[tuple[torch.Tensor, torch.Tensor]], embeds: torch.Tensor | None = None) -> torch.Tensor:
        """``embeds``: the tokens' embeddings, read by an EAGLE-3 head's first layer only."""
        if self.takes_embeds:
            a = torch.cat([self.input_layernorm(embeds.to(x.dtype)), self.hidden_norm(x)], dim=-1)
        else:
            norm = getattr(self, "input_layernorm", None)
            a = x if norm is None else norm(x)
        x = x + self.self_attn(a, cos, sin, past)
        return x + self.mlp(self.post_attention_layernorm(x))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary over each head's two halves (Llama's rotate_half); x [B, heads, n, d], cos / sin [n, d] fp32."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class EagleHead(nn.Module):
    """The head being trained; its ``state_dict`` has the checkpoint's names and shapes (:func:`checkpoint_weights`
    gives an EAGLE-3 head's first layer its ``midlayer.`` name). No embedding: the target's, passed in. The lm_head
    is the target's for EAGLE-1 (not stored), the head's own for EAGLE-3 (``lm_head``, with ``d2t`` zeros: the draft
    vocabulary is the target's)."""

    def __init__(self, spec: EagleSpec, vocab_size: int = 0) -> None:
        """``vocab_size``: the target's (EAGLE-3: the draft vocabulary where ``spec.draft_vocab_size`` is 0)."""
        super().__init__()
        self.spec = spec
        h = spec.hidden_size
        if spec.version == 3:
            self.fc = nn.Linear(len(spec.aux_layers) * (spec.target_hidden_size or h), h, bias=False)
        else:
            self.fc = nn.Linear(2 * h, h, bias=True)
        self.layers = nn.ModuleList(Layer(spec, i) for i in range(spec.num_hidden_layers))
        if spec.version == 3:
            rows = spec.draft_vocab_size or vocab_size
            self.norm = RMSNorm(h, spec.rms_norm_eps)
            self.lm_head = nn.Linear(h, rows, bias=False)
            self.register_buffer("d2t", torch.zeros(rows, dtype=torch.long))  # draft row r is target token r + d2t[r]
        d = spec.head_dim
        inv_freq = torch.tensor([1.0 / spec.rope_theta ** (i / d) for i in range(0, d, 2)], dtype=torch.float32)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        for m in self.modules():  # Llama's initialisation: N(0, 0.02) matrices, zero bias, unit norm gains
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def chain(self, embed: torch.Tensor, tokens: torch.Tensor, features: torch.Tensor, steps: int,
              noise: float = 0.0) -> list[torch.Tensor]:
        """The head's outputs (its lm_head's inputs) over windows ``tokens`` [B, T] with the target's ``features``
        [B, T, f] (:func:`target_outputs`), for chain steps 1..``steps``: step s has T - s entries; entry i is fed
        (the step s - 1 hidden state i, or the features at i at step 1, and t_{i+s}) at position i + s - 1 and
        drafts t_{i+s+1}. ``embed``: the target's table."""
        return [out for out, _ in self.chain_states(embed, tokens, features, steps, noise)]

    def chain_states(self, embed: torch.Tensor, tokens: torch.Tensor, features: torch.Tensor, steps: int,
                     noise: float = 0.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`chain`'s outputs with the hidden state each step hands the next (:meth:`step`'s pair)."""
        t = tokens.shape[1]
        past: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.layers]
        states: list[tuple[torch.Tensor, torch.Tensor]] = []
        feats = features
        if noise:
            feats = feats + (torch.rand_like(feats) - 0.5) * (2 * noise * feats.pow(2).mean().sqrt())
        for s in range(1, steps + 1):
            n = t - s
            pos = torch.arange(s - 1, s - 1 + n, device=tokens.device, dtype=torch.float32)
            angles = pos[:, None] * self.inv_freq[None, :]
            cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
            inp = feats[:, :n] if s == 1 else states[-1][1][:, :n]
            states.append(self.step(F.embedding(tokens[:, s:], embed), inp, s == 1, cos, sin, past))
        return states

    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, fresh: bool, cos: torch.Tensor, sin: torch.Tensor,
             past: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One chain step over pairs (hidden, embeds) [B, n, *]: the lm_head's input and the hidden state the next
        step is fed, as ``runtime.eagle.EagleHead.forward`` computes them. EAGLE-1: x = layers(fc(cat(embed,
        hidden))), both x. EAGLE-3: h = fc(hidden) where ``fresh`` (the target's streams), else hidden as it is
        (the step before's); s = layers(h) (the first over the embeddings too); norm(s) and s."""
        if self.spec.version == 1:
            x = self.fc(torch.cat([embeds.to(hidden.dtype), hidden], dim=-1)).float()
            for layer, layer_past in zip(self.layers, past):
                x = layer(x, cos, sin, layer_past)
            return x, x
        x = self.fc(hidden).float() if fresh else hidden
        for i, (layer, layer_past) in enumerate(zip(self.layers, past)):
            x = layer(x, cos, sin, layer_past, embeds if i == 0 else None)
        return self.norm(x), x

    def logits(self, out: torch.Tensor, target: nn.Module) -> torch.Tensor:
        """Logits over the (draft) vocabulary from the head's outputs: the target's lm_head (EAGLE-1) or its own."""
        return target.lm_head(out) if self.spec.version == 1 else self.lm_head(out)

    def forward(self, embed: torch.Tensor, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Step 1 alone: the outputs over pairs (features[:, i], tokens[:, i]) at positions 0.. (as
        ``runtime.eagle.EagleHead.forward`` computes them from an empty cache), [B, n, h]."""
        return self.chain(embed, torch.cat([tokens[:, :1], tokens], dim=1), F.pad(features, (0, 0, 0, 1)), 1)[0]


@torch.no_grad()
def target_outputs(target: nn.Module, x: torch.Tensor, layers: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """The features a head is fed and the target's logits over windows ``x``, fp32. Features: the target's final
    hidden states (after its final norm), or with ``layers`` (EAGLE-3) the residual streams entering those layers
    side by side (Hugging Face's ``hidden_states[j]``, the executor's ``residual_stream(j)``)."""
    out = target.model(input_ids=x, output_hidden_states=bool(layers))
    f = out.last_hidden_state
    feats = torch.cat([out.hidden_states[j] for j in layers], dim=-1) if layers else f
    return feats.float(), target.lm_head(f).float()


def aux_layers(head: EagleHead) -> tuple[int, ...]:
    """The target layers whose input streams the head reads (EAGLE-3), else ()."""
    return tuple(head.spec.aux_layers) if head.spec.version == 3 else ()


def chain_loss(head: EagleHead, target: nn.Module, x: torch.Tensor, steps: int, cls_weight: float,
               noise: float) -> tuple[torch.Tensor, dict[str, float]]:
    """The training loss over windows ``x`` (see the module docstring) and its parts per step. EAGLE-3: the KL
    term alone (``cls_weight`` is not read)."""
    with autocast(x.device):
        f, logits = target_outputs(target, x, aux_layers(head))
        embed = target.get_input_embeddings().weight
        outs = head.chain(embed, x, f, steps, noise)
        total, parts = 0.0, {}
        for s, g in enumerate(outs, start=1):
            kl = distill_loss(head.logits(g, target), logits[:, s:])
            if head.spec.version == 3:
                total = total + STEP_DECAY ** (s - 1) * kl
                parts[f"kl{s}"] = kl.item()
                continue
            feat = F.smooth_l1_loss(g.float(), f[:, s:])
            total = total + STEP_DECAY ** (s - 1) * (feat + cls_weight * kl)
            parts[f"feat{s}"], parts[f"kl{s}"] = feat.item(), kl.item()
    return total, parts


@torch.no_grad()
def agreement(head: EagleHead, target: nn.Module, windows: torch.Tensor, steps: int = EVAL_STEPS,
              batch_size: int = 16) -> dict:
    """On ``windows``, per chain step: top-1 agreement with the target, acceptance along greedy paths, the mean
    KL(target || head) (see the module docstring); and the drafts accepted per proposal of ``steps``."""
    device = next(head.parameters()).device
    same, accepted, greedy_n, kl, n = ([0.0] * steps for _ in range(5))
    for i in range(0, windows.size(0), batch_size):
        x = windows[i:i + batch_size].to(device)
        with autocast(device):
            f, logits = target_outputs(target, x, aux_layers(head))
            outs = head.chain(target.get_input_embeddings().weight, x, f, steps)
            drafts = [head.logits(g, target).float() for g in outs]
        top = logits.argmax(-1)  # [B, T]
        on_path = top[:, :-1] == x[:, 1:]  # [B, T - 1]: the target's top token at p is the text's at p + 1
        ok = torch.ones_like(x[:, :-1], dtype=torch.bool)  # chain from base i fed as greedy speculation would
        for s, d in enumerate(drafts):
            m = x.size(1) - s - 1
            hit = d.argmax(-1) == top[:, s + 1:]
            ok = ok[:, :m]
            same[s] += hit.sum().item()
            n[s] += hit.numel()
            accepted[s] += (hit & ok).sum().item()
            greedy_n[s] += ok.sum().item()
            kl[s] += distill_loss(d, logits[:, s + 1:]).item() * hit.numel()
            ok = ok[:, :m - 1] & hit[:, :m - 1] & on_path[:, s + 1:s + m]
    report = {"steps": {}}
    expected, run = 0.0, 1.0
    for s in range(steps):
        rate = accepted[s] / max(greedy_n[s], 1)
        run *= rate
        expected += run
        report["steps"][str(s + 1)] = {"top1_agreement": round(same[s] / n[s], 4), "acceptance": round(rate, 4),
                                       "kl_target_head": round(kl[s] / n[s], 4), "positions": int(n[s]),
                                       "greedy_positions": int(greedy_n[s])}
    report[f"expected_accepted_of_{steps}"] = round(expected, 4)
    return report


def train(head: EagleHead, target: nn.Module, windows: torch.Tensor, spec: TrainSpec, steps: int,
          cls_weight: float, noise: float) -> list:
    """AdamW on :func:`chain_loss` over seeded batches of ``windows`` (warmup, then cosine decay; bf16 autocast on
    CUDA); the loss curve."""
    device = next(head.parameters()).device
    optimizer = make_optimizer(head, spec)
    batches = batch_order(windows.size(0), spec.batch_size, spec.max_steps, spec.seed)
    head.train()
    curve, recent, start = [], [], time.perf_counter()
    for step, idx in enumerate(batches, start=1):
        progress = (step - spec.warmup_steps) / max(spec.max_steps - spec.warmup_steps, 1)
        for group in optimizer.param_groups:
            group["lr"] = spec.peak_lr * lr_factor(step, spec.warmup_steps, progress, spec.min_lr_ratio)
        loss, parts = chain_loss(head, target, windows[idx].to(device), steps, cls_weight, noise)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"step {step}: the loss is {loss.item()} (a learning rate too high?)")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), spec.grad_clip)
        optimizer.step()
        recent = (recent + [loss.item()])[-spec.log_every:]
        if step % spec.log_every == 0 or step in (1, len(batches)):
            curve.append((step, round(sum(recent) / len(recent), 4)))
            detail = "  ".join(f"{k} {v:.3f}" for k, v in parts.items())
            print(f"step {step:5d}/{spec.max_steps}  loss {loss.item():.4f}  avg{len(recent)} {curve[-1][1]:.4f}  "
                  f"{detail}  {(time.perf_counter() - start) / step:.2f}s/step", flush=True)
    head.eval()
    return curve


def checkpoint_weights(head: EagleHead) -> dict[str, torch.Tensor]:
    """The head's tensors under the checkpoint's names, on the CPU: floats in bf16, ``d2t`` int64; an EAGLE-3
    head's first layer as ``midlayer.`` (the published layout; ``runtime.eagle`` reads it back as ``layers.0.``)."""
    weights = {}
    for name, value in head.state_dict().items():
        if head.spec.version == 3 and name.startswith("layers.0."):
            name = "midlayer." + name[len("layers.0."):]
        value = value.detach().to("cpu")
        weights[name] = (value.to(torch.bfloat16) if value.is_floating_point() else value).contiguous()
    return weights


def save_head(head: EagleHead, vocab_size: int, out: Path) -> int:
    """config.json and model.safetensors (bf16) in ``out``; returns the weights file's size in bytes."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    weights = checkpoint_weights(head)
    save_file(weights, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(head.spec.config(vocab_size), indent=2) + "\n")
    return (out / WEIGHTS_FILE).stat().st_size


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, default=Path("models/pystdlib-llama"), help="the bundled checkpoint")
    p.add_argument("--out", type=Path, default=None,
                   help=f"default: models/pystdlib-llama-eagle (--eagle3: {EAGLE3_DEFAULT_OUT})")
    p.add_argument("--eagle3", action="store_true", help="an EAGLE-3 head (the target's streams side by side, "
                   "its own norm and lm_head, the KL loss alone)")
    p.add_argument("--aux-layers", type=int, nargs="+", default=None,
                   help="--eagle3: the target layers whose input streams it reads (default 1, L // 2, L - 1)")
    p.add_argument("--max-steps", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=5e-3, help="peak learning rate")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--stdlib", type=Path, default=None, help="stdlib directory (default: this interpreter's)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (CUDA: bf16 autocast, fp32 weights)")
    p.add_argument("--unroll", type=int, default=2, help="chain steps trained (1: the true features alone)")
    p.add_argument("--cls-weight", type=float, default=0.2, help="weight of the KL term beside the features' "
                   "(EAGLE-1)")
    p.add_argument("--noise", type=float, default=0.0, help="uniform noise on the true features, times their RMS")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--intermediate-size", type=int, default=768)
    args = p.parse_args(argv)
    if args.out is None:
        args.out = EAGLE3_DEFAULT_OUT if args.eagle3 else Path("models/pystdlib-llama-eagle")
    return args


def round_to_stored(head: EagleHead) -> None:
    """The head's parameters rounded to bf16, the values stored, so that they are what is measured (its rotary
    frequencies stay fp32, as the runtime computes them)."""
    with torch.no_grad():
        for param in head.parameters():
            param.copy_(param.to(torch.bfloat16).float())


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    t0 = time.perf_counter()
    target, train_windows, held_out = frozen_target_and_windows(args, device)
    cfg = target.config
    rope_theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", None))
    shape = dict(hidden_size=cfg.hidden_size, intermediate_size=args.intermediate_size,
                 num_hidden_layers=args.layers, rms_norm_eps=cfg.rms_norm_eps, rope_theta=float(rope_theta or 10000.0))
    if args.eagle3:
        n = cfg.num_hidden_layers
        layers = tuple(args.aux_layers or (1, n // 2, n - 1))
        if any(not 0 <= j < n for j in layers):
            raise SystemExit(f"--aux-layers {list(layers)}: the streams entering layers 0..{n - 1} of the target")
        spec = Eagle3Spec(**shape, aux_layers=layers, target_hidden_size=cfg.hidden_size,
                          draft_vocab_size=cfg.vocab_size)
    else:
        spec = EagleSpec(**shape)
    train_spec = TrainSpec(seed=args.seed, max_steps=args.max_steps, batch_size=args.batch_size,
                           seq_len=args.seq_len, peak_lr=args.lr, threads=args.threads)
    head = EagleHead(spec, cfg.vocab_size).to(device)
    if args.eagle3:  # its lm_head starts as the target's
        with torch.no_grad():
            head.lm_head.weight.copy_(target.lm_head.weight)
    before = agreement(head, target, held_out)
    t1 = time.perf_counter()
    curve = train(head, target, train_windows, train_spec, args.unroll, args.cls_weight, args.noise)
    train_s = time.perf_counter() - t1
    round_to_stored(head)
    after = agreement(head, target, held_out)
    print(json.dumps({"before": before, "after": after}), flush=True)
    weights_bytes = save_head(head, cfg.vocab_size, args.out)
    params = sum(p.numel() for p in head.parameters())
    loss = (f"sum over chain steps s of {STEP_DECAY}^(s-1) * KL(target || lm_head(norm(s)))" if args.eagle3 else
            f"sum over chain steps s of {STEP_DECAY}^(s-1) * (SmoothL1(g, f) + cls_weight * KL(target || lm_head(g)))")
    metrics = {"target": str(args.target), **({"version": 3} if args.eagle3 else {}), "head": asdict(spec),
               "parameters": params,
               "train": {**asdict(train_spec), "device": str(device), "unroll": args.unroll,
                         **({} if args.eagle3 else {"cls_weight": args.cls_weight}), "noise": args.noise,
                         "step_decay": STEP_DECAY,
                         **({"device_name": torch.cuda.get_device_name(device)} if device.type == "cuda" else {})},
               "train_windows": train_windows.size(0), "train_seconds": round(train_s, 1),
               "loss": loss, "loss_curve": curve,
               "held_out": {"windows": held_out.size(0), "seq_len": args.seq_len, "untrained": before,
                            "trained": after},
               "weights_bytes": weights_bytes,
               "command": "python -m builder.devtools.train_eagle " + " ".join(sys.argv[1:] if argv is None else argv)}
    (args.out / "training_metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    print(f"wrote {args.out} ({params} parameters, {weights_bytes} bytes of weights) in "
          f"{time.perf_counter() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
