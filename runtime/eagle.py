"""EAGLE heads: drafts made from the target's own hidden states (speculative method ``eagle``).

An EAGLE head (the EAGLE-1 / EAGLE-2 layout, as vLLM and SGLang load it) is one or a few decoder layers that
predict the target's next hidden state from its current one. For position i, with f_i the target's final hidden
state there (the lm_head's input, after the final norm) and t_{i+1} the token that follows it::

    g_i = layers(fc(cat(embed(t_{i+1}), f_i)))        the first layer without its input norm, no final norm
    draft for t_{i+2} = argmax lm_head(g_i)

and the chain goes on from (g_i, that draft) in place of (f_{i+1}, t_{i+2}). The pair of position i sits at
position i of the head's own KV cache (its rotary at i). The embedding table and the lm_head are the target's (the
lm_head through the target's own compiled node, so a quantized or soft-capped one is read as the target reads it);
the checkpoint brings fc and the layers (an ``lm_head.weight`` of its own is used where it has one).

Checkpoint: a directory with ``config.json`` (Llama fields: hidden_size, num_attention_heads, num_key_value_heads,
head_dim, intermediate_size, num_hidden_layers, rms_norm_eps, rope_theta or rope_parameters / rope_scaling of type
default or llama3, hidden_act silu) and ``model.safetensors``: ``fc.weight`` [h, 2h] (``fc.bias`` optional),
``layers.N.self_attn.{q,k,v,o}_proj.weight``, ``layers.N.mlp.{gate,up,down}_proj.weight``,
``layers.N.post_attention_layernorm.weight`` and, past the first layer, ``layers.N.input_layernorm.weight``
(a ``model.`` prefix is accepted; ``embed_tokens.weight`` is not read). Pickled weights (``pytorch_model.bin``) are
refused: convert them with safetensors first. ``builder/devtools/train_eagle.py`` trains one for a target.

The proposer (:class:`EagleProposer`): the serving engine hands it the target's hidden states of every step of a
request that may speculate (``record_hidden``: the rows and the position of the first). Before it drafts, the pairs
the request's head cache does not hold yet (up to the position before its last token) are fed in one step, whose
last row gives the first draft; then k - 1 chain steps. Chain entries (past the last known pair) are written over
at the next proposal, which starts from the known pairs. Positions whose hidden states were never recorded (a
prefix-cache hit; steps run at a load past the policy's ``max_running``) leave a gap, and the head's cache restarts
after it: the drafts lose that context, never exactness (the target verifies every draft, greedy drafts: one-hot).

The head runs eagerly in torch, one sequence at a time (a handful speculate at once: ``max_running``); it is not
captured in CUDA graphs yet.
"""

from __future__ import annotations

import json
import logging
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from runtime.speculative import DraftRequest, PendingDrafts, Proposer, SpeculativeConfigError

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
PICKLED_FILES = ("pytorch_model.bin", "model.bin", "model.pt", "pytorch_model.pt")


class EagleCheckpointError(SpeculativeConfigError):
    """An EAGLE head checkpoint that is missing, malformed, or does not fit the target."""


@dataclass(frozen=True)
class EagleConfig:
    """The head's shape, read from its config.json."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_layers: int
    rms_norm_eps: float
    inv_freq: tuple[float, ...]  # the rotary's frequencies, one per pair of a head's features

    @classmethod
    def from_dict(cls, cfg: dict, where: str) -> EagleConfig:
        def need(name: str, kind=int):
            value = cfg.get(name)
            if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise EagleCheckpointError(f"{where}: {name} must be a positive integer, got {value!r}")
            if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise EagleCheckpointError(f"{where}: {name} must be a positive number, got {value!r}")
            return value

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        kv_heads = cfg.get("num_key_value_heads") or heads
        head_dim = cfg.get("head_dim") or hidden // heads
        if not isinstance(kv_heads, int) or heads % kv_heads:
            raise EagleCheckpointError(f"{where}: num_key_value_heads {kv_heads!r} must divide num_attention_heads "
                                       f"{heads}")
        if not isinstance(head_dim, int) or head_dim % 2:
            raise EagleCheckpointError(f"{where}: head_dim {head_dim!r} must be an even integer")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise EagleCheckpointError(f"{where}: hidden_act {act!r} is not supported; EAGLE heads here use silu")
        eps = cfg.get("rms_norm_eps", 1e-6)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
            raise EagleCheckpointError(f"{where}: rms_norm_eps must be a positive number, got {eps!r}")
        return cls(hidden, heads, kv_heads, head_dim, need("intermediate_size"), need("num_hidden_layers"),
                   float(eps), _inv_freq(cfg, head_dim, where))


def _inv_freq(cfg: dict, head_dim: int, where: str) -> tuple[float, ...]:
    """Rotary frequencies of a Llama config: rope_theta (or rope_parameters' rope_theta), scaled by rope_type
    ``llama3`` where the config asks for it; other scalings are refused."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise EagleCheckpointError(f"{where}: rope_theta must be a positive number, got {theta!r}")
    base = [1.0 / theta ** (i / head_dim) for i in range(0, head_dim, 2)]
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return tuple(base)
    if kind != "llama3":
        raise EagleCheckpointError(f"{where}: rope scaling {kind!r} is not supported for EAGLE heads (default and "
                                   f"llama3 are)")
    try:
        factor, low, high = (float(params[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
        original = float(params["original_max_position_embeddings"])
    except (KeyError, TypeError, ValueError) as e:
        raise EagleCheckpointError(f"{where}: llama3 rope scaling needs factor, low_freq_factor, high_freq_factor "
                                   f"and original_max_position_embeddings ({e})") from None
    out = []
    for f in base:  # Llama 3.1's rule: long wavelengths divided by factor, short ones kept, a blend between
        wavelen = 2 * math.pi / f
        if wavelen > original / low:
            out.append(f / factor)
        elif wavelen < original / high:
            out.append(f)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return tuple(out)


def _layer_names(i: int) -> list[str]:
    names = [f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"]
    names += [f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    names.append(f"layers.{i}.post_attention_layernorm.weight")
    if i > 0:
        names.append(f"layers.{i}.input_layernorm.weight")
    return names


class EagleHead:
    """The head's weights and its forward over one sequence's new pairs (see the module docstring)."""

    def __init__(self, config: EagleConfig, weights: dict[str, torch.Tensor], embed: torch.Tensor,
                 lm_head, dtype: torch.dtype, device: torch.device) -> None:
        """``weights``: the checkpoint's tensors, names without a ``model.`` prefix; ``embed``: the target's
        embedding table [vocab, h]; ``lm_head``: hidden [n, h] -> logits [n, vocab] fp32."""
        self.config, self.embed, self.lm_head = config, embed, lm_head
        self.dtype, self.device = dtype, device
        self.w = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()}
        self.inv_freq = torch.tensor(config.inv_freq, dtype=torch.float32, device=device)

    def weights_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.w.values())

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotary over each head's two halves (Llama's rotate_half), at ``positions``; x [n, heads, d]."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # [n, d / 2]
        cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[:, None, :]
        sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[:, None, :]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return (x.float() * cos + rotated.float() * sin).to(x.dtype)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * xf.to(x.dtype)

    def forward(self, cache: _HeadCache, token_ids: torch.Tensor, hidden: torch.Tensor, start: int) -> torch.Tensor:
        """Feed pairs (hidden[j], token_ids[j]) at positions start + j into ``cache`` (written there; keys from
        ``cache.start`` on are attended); returns the head's output hidden states [n, h]."""
        cfg, w = self.config, self.w
        n = token_ids.shape[0]
        positions = torch.arange(start, start + n, device=self.device)
        x = torch.cat([F.embedding(token_ids, self.embed).to(self.dtype), hidden.to(self.dtype)], dim=-1)
        x = F.linear(x, w["fc.weight"], w.get("fc.bias"))
        end = start + n
        cache.reserve(end)
        key_pos = torch.arange(cache.start, end, device=self.device)
        mask = key_pos[None, :] <= positions[:, None]  # [n, keys]: causal over the cached keys and these
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            h = x if i == 0 else self._norm(x, w[p + "input_layernorm.weight"])
            q = F.linear(h, w[p + "self_attn.q_proj.weight"]).view(n, cfg.num_heads, cfg.head_dim)
            k = F.linear(h, w[p + "self_attn.k_proj.weight"]).view(n, cfg.num_kv_heads, cfg.head_dim)
            v = F.linear(h, w[p + "self_attn.v_proj.weight"]).view(n, cfg.num_kv_heads, cfg.head_dim)
            q, k = self._rope(q, positions), self._rope(k, positions)
            cache.k[i][start:end] = k
            cache.v[i][start:end] = v
            keys, values = cache.k[i][cache.start:end], cache.v[i][cache.start:end]
            rep = cfg.num_heads // cfg.num_kv_heads
            if rep > 1:
                keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
            attn = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                                  attn_mask=mask)  # [heads, n, d]
            x = x + F.linear(attn.transpose(0, 1).reshape(n, cfg.num_heads * cfg.head_dim),
                             w[p + "self_attn.o_proj.weight"])
            h = self._norm(x, w[p + "post_attention_layernorm.weight"])
            gated = F.silu(F.linear(h, w[p + "mlp.gate_proj.weight"])) * F.linear(h, w[p + "mlp.up_proj.weight"])
            x = x + F.linear(gated, w[p + "mlp.down_proj.weight"])
        return x


@dataclass
class _HeadCache:
    """One request's head cache: keys and values per layer by absolute position (positions [start, length) hold
    pairs of known tokens; the chain writes past them), grown by doubling up to ``limit`` positions."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    limit: int
    start: int = 0
    length: int = 0
    k: list[torch.Tensor] = field(default_factory=list)
    v: list[torch.Tensor] = field(default_factory=list)

    def reserve(self, end: int) -> None:
        cap = self.k[0].shape[0] if self.k else 0
        if end <= cap:
            return
        if end > self.limit:
            raise EagleCheckpointError(f"the EAGLE head's cache holds {self.limit} positions; {end} asked")
        new_cap = min(self.limit, max(end, 2 * cap, 64))
        shape = (new_cap, self.num_kv_heads, self.head_dim)
        for lst in (self.k, self.v):
            old = list(lst)
            lst.clear()
            for i in range(self.num_layers):
                t = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if old:
                    t[:cap] = old[i]
                lst.append(t)


@dataclass
class _Hidden:
    """The target's hidden states recorded for one request: rows for positions [known_from, known_to), stored by
    absolute position."""

    rows: torch.Tensor | None = None
    known_from: int = 0
    known_to: int = 0

    def record(self, start: int, hidden: torch.Tensor) -> None:
        n = hidden.shape[0]
        if n == 0:
            return
        end = start + n
        if self.rows is None or start > self.known_to or start < self.known_from:
            self.known_from = start  # a gap (or an earlier position: a recompute): what was known before is dropped
        self.known_to = end  # rows past end (a rejected draft's) are no longer known
        cap = self.rows.shape[0] if self.rows is not None else 0
        if end > cap:
            grown = hidden.new_zeros(max(end, 2 * cap, 64), hidden.shape[1])
            if self.rows is not None:
                grown[:cap] = self.rows
            self.rows = grown
        self.rows[start:end] = hidden


@dataclass
class _EagleSeq:
    cache: _HeadCache
    hidden: _Hidden = field(default_factory=_Hidden)


class EagleProposer(Proposer):
    """Greedy drafts from an EAGLE head over the target's hidden states (see the module docstring)."""

    method = "eagle"
    needs_hidden = True  # the serving engine records the target's hidden states (record_hidden)

    def __init__(self, head: EagleHead, max_seq_len: int, max_seqs: int = 8, max_draft_tokens: int = 4) -> None:
        if max_seqs < 1:
            raise SpeculativeConfigError(f"an EAGLE head needs room for at least one request, got {max_seqs}")
        if max_draft_tokens < 1:
            raise SpeculativeConfigError(f"max_draft_tokens must be >= 1, got {max_draft_tokens}")
        self.head, self.max_seq_len = head, max_seq_len
        self.max_seqs, self.max_draft_tokens = max_seqs, max_draft_tokens
        self._seqs: OrderedDict[str, _EagleSeq] = OrderedDict()  # least recently used first

    @classmethod
    def load(cls, path: str | Path, target, max_seq_len: int, max_seqs: int = 8,
             max_draft_tokens: int = 4) -> EagleProposer:
        """The head at ``path`` for ``target`` (an ``Engine``), on the target's device and in its dtype."""
        return cls(load_head(path, target), max_seq_len, max_seqs, max_draft_tokens)

    # -- what the serving engine tells it --------------------------------------------------------------------
    def record_hidden(self, request_id: str, start: int, hidden: torch.Tensor) -> None:
        """The target's final hidden states of ``request_id`` at positions start, start + 1, ... (rows of
        ``hidden``, copied: the caller's buffer may be a CUDA graph's, overwritten by the next replay)."""
        seq = self._seq(request_id)
        seq.hidden.record(start, hidden)

    def release(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)

    def weights_bytes(self) -> int:
        return self.head.weights_bytes()

    def kv_bytes(self) -> int:
        """The most the caches and the recorded hidden states take: max_seqs requests of max_seq_len positions."""
        cfg = self.head.config
        size = torch.empty((), dtype=self.head.dtype).element_size()
        per_position = (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim + cfg.hidden_size) * size
        return self.max_seqs * self.max_seq_len * per_position

    def _seq(self, request_id: str) -> _EagleSeq:
        seq = self._seqs.get(request_id)
        if seq is None:
            while len(self._seqs) >= self.max_seqs:
                self._seqs.popitem(last=False)
            cfg, head = self.head.config, self.head
            seq = self._seqs[request_id] = _EagleSeq(_HeadCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                                                head.dtype, head.device, self.max_seq_len))
        self._seqs.move_to_end(request_id)
        return seq

    # -- drafting --------------------------------------------------------------------------------------------
    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        drafts = self.propose_pending(requests)
        return drafts.resolve() if isinstance(drafts, PendingDrafts) else drafts

    @torch.inference_mode()
    def propose_pending(self, requests: Sequence[DraftRequest]) -> list[list[int]] | PendingDrafts:
        """As ``propose``, the drafts left on the device (``PendingDrafts``): each chain step's token feeds the next
        on the device, so the host waits for none of them (the serving engine reads them with the verify step's)."""
        chains = [self._propose_one(r) for r in requests]
        if not any(c is not None for c in chains):
            return [[] for _ in requests]
        flat = torch.cat([c for c in chains if c is not None])
        sources, at = [], 0
        for c in chains:
            n = 0 if c is None else c.numel()
            sources.append(list(range(at, at + n)))
            at += n
        return PendingDrafts(flat, sources)
    def may_propose(self, token_ids: Sequence[int], request_id: str | None = None) -> bool:
        """Whether the target's hidden state before the last token is known (else there is nothing to start from)."""
        seq = self._seqs.get(request_id) if request_id is not None else None
        if seq is None:
            return False
        last = len(token_ids) - 2  # the pair (f_last, t_{last + 1}) starts the drafts
        return seq.hidden.known_from <= last < seq.hidden.known_to

    def _propose_one(self, request: DraftRequest) -> torch.Tensor | None:
        """The request's drafts as a device tensor [k] (queued, not waited for), or None where it has none."""
        k = min(request.max_tokens, self.max_draft_tokens)
        tokens = request.token_ids
        num = len(tokens)
        seq = self._seqs.get(request.request_id)
        if seq is None or k < 1 or num < 2 or num + k > self.max_seq_len:
            return None
        self._seqs.move_to_end(request.request_id)
        hidden, cache = seq.hidden, seq.cache
        last = num - 2  # pairs (f_i, t_{i+1}) for positions up to last are known
        if not hidden.known_from <= last < hidden.known_to:
            return None
        # the cache holds known pairs below cache.length; the last pair is fed again where it holds it too (its
        # output starts the chain)
        first = min(cache.length, last)
        if first < hidden.known_from:  # a gap: the cache restarts after it
            cache.start = first = hidden.known_from
        ids = torch.tensor(list(tokens[first + 1:num]), dtype=torch.long, device=self.head.device)
        out = self.head.forward(cache, ids, hidden.rows[first:last + 1], first)
        cache.length = last + 1
        g = out[-1:]
        drafts = []
        for j in range(k):
            token = torch.argmax(self.head.lm_head(g), dim=-1)  # [1], on the device
            drafts.append(token)
            if j + 1 < k:
                g = self.head.forward(cache, token, g, last + 1 + j)
        return torch.cat(drafts)


def read_head(path: str | Path, hidden_size: int, vocab_size: int) -> tuple[EagleConfig, dict[str, torch.Tensor]]:
    """Read and check the head at ``path`` for a target of ``hidden_size`` features and ``vocab_size`` tokens: its
    config and its tensors (names without a ``model.`` prefix; ``embed_tokens.weight`` left out), every one of the
    shape config.json and the target give. Used by the runtime (``load_head``) and by the builder, which bundles a
    head into an artifact."""
    from safetensors import safe_open

    path = Path(path)
    where = f"EAGLE head {path}"
    if not path.is_dir():
        raise EagleCheckpointError(f"{where} is not a directory (an EAGLE checkpoint: config.json and "
                                   f"{WEIGHTS_FILE})")
    cfg_path, weights_path = path / "config.json", path / WEIGHTS_FILE
    if not weights_path.is_file():
        pickled = [p for p in PICKLED_FILES if (path / p).exists()]
        hint = (f"; it has {pickled[0]}, pickled weights this runtime never loads: convert them to {WEIGHTS_FILE} "
                f"(safetensors.torch.save_file) first") if pickled else ""
        raise EagleCheckpointError(f"{where} has no {WEIGHTS_FILE}{hint}")
    try:
        cfg = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise EagleCheckpointError(f"{where} has no config.json") from None
    except (OSError, ValueError) as e:
        raise EagleCheckpointError(f"{where}: config.json is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise EagleCheckpointError(f"{where}: config.json must hold an object")
    config = EagleConfig.from_dict(cfg, where)
    if config.hidden_size != hidden_size:
        raise EagleCheckpointError(f"{where}: hidden_size {config.hidden_size} is not the target's "
                                   f"{hidden_size}; an EAGLE head reads the target's hidden states")
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            weights = {k[len("model."):] if k.startswith("model.") else k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # a truncated or corrupt file
        raise EagleCheckpointError(f"{where}: {WEIGHTS_FILE} cannot be read ({e})") from None
    h, d = config.hidden_size, config.head_dim
    shapes = {"fc.weight": (h, 2 * h)}
    for i in range(config.num_layers):
        shapes.update({
            f"layers.{i}.self_attn.q_proj.weight": (config.num_heads * d, h),
            f"layers.{i}.self_attn.k_proj.weight": (config.num_kv_heads * d, h),
            f"layers.{i}.self_attn.v_proj.weight": (config.num_kv_heads * d, h),
            f"layers.{i}.self_attn.o_proj.weight": (h, config.num_heads * d),
            f"layers.{i}.mlp.gate_proj.weight": (config.intermediate_size, h),
            f"layers.{i}.mlp.up_proj.weight": (config.intermediate_size, h),
            f"layers.{i}.mlp.down_proj.weight": (h, config.intermediate_size),
            f"layers.{i}.post_attention_layernorm.weight": (h,),
        })
        if i > 0:
            shapes[f"layers.{i}.input_layernorm.weight"] = (h,)
    if "fc.bias" in weights:
        shapes["fc.bias"] = (h,)
    if "lm_head.weight" in weights:
        shapes["lm_head.weight"] = (vocab_size, h)
    missing = sorted(set(shapes) - set(weights))
    if missing:
        raise EagleCheckpointError(f"{where}: {WEIGHTS_FILE} lacks {', '.join(missing[:4])}"
                                   f"{' ...' if len(missing) > 4 else ''} (an EAGLE-1 head of "
                                   f"{config.num_layers} layer(s))")
    for name, shape in shapes.items():
        if tuple(weights[name].shape) != shape:
            raise EagleCheckpointError(f"{where}: {name} is {list(weights[name].shape)}, expected {list(shape)} "
                                       f"from config.json and the target")
        if not weights[name].is_floating_point() or not torch.isfinite(weights[name]).all():
            raise EagleCheckpointError(f"{where}: {name} is not a finite floating-point tensor")
    unused = sorted(set(weights) - set(shapes) - {"embed_tokens.weight"})
    if unused:
        raise EagleCheckpointError(f"{where}: {WEIGHTS_FILE} has tensors an EAGLE-1 head does not have: "
                                   f"{', '.join(unused[:4])}{' ...' if len(unused) > 4 else ''}")
    return config, {k: v for k, v in weights.items() if k in shapes}


def load_head(path: str | Path, target) -> EagleHead:
    """The head at ``path`` for ``target`` (an ``Engine``), checked by ``read_head``, on the target's device and in
    its dtype, sharing its embedding and lm_head (or the head's own lm_head where it has one)."""
    executor = target.executor
    if getattr(executor, "tp_size", 1) > 1:
        raise EagleCheckpointError(f"EAGLE head {path}: EAGLE heads run beside a target on one GPU; this target is "
                                   f"sharded")
    embed, lm_head, target_hidden = target_head_parts(executor)
    config, weights = read_head(path, target_hidden, embed.shape[0])
    dtype = executor.dtype
    if "lm_head.weight" in weights:
        own = weights.pop("lm_head.weight").to(device=target.device, dtype=dtype)

        def lm_head(x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, own).float()
    return EagleHead(config, weights, embed, lm_head, dtype, target.device)


def target_head_parts(executor):
    """The target's embedding table, a function running its lm_head node on hidden states [n, h] (logits fp32),
    and its hidden size: what an EAGLE head shares with it."""
    nodes = executor.graph["nodes"]
    emb = [n for n in nodes if n["op"] == "embedding" and n["inputs"] == ["input_ids"]]
    heads = [i for i, n in enumerate(nodes) if n["op"] == "lm_head"]
    if len(emb) != 1 or len(heads) != 1:
        raise EagleCheckpointError("the target has no single token embedding and lm_head for an EAGLE head to share")
    if emb[0].get("attrs", {}).get("scale") is not None or emb[0].get("attrs", {}).get("vocab_parallel"):
        raise EagleCheckpointError("the target scales or shards its token embedding; EAGLE heads are supported on "
                                   "targets that look tokens up as they are (Llama-style)")
    table = executor.params[emb[0]["weights"]["weight"]]
    kernel = executor.node_kernel(heads[0])

    def lm_head(x: torch.Tensor) -> torch.Tensor:
        from runtime.executor import StepInput

        step = executor.scratch_step(StepInput(x.new_zeros(0, dtype=torch.long), x.new_zeros(0, dtype=torch.long),
                                               []))
        return kernel([x.to(executor.dtype)], step)[0]

    return table, lm_head, table.shape[1]
