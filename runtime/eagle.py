"""EAGLE heads: drafts made from the target's own hidden states (speculative method ``eagle``).

An EAGLE head is one or a few decoder layers that predict the target's next token from its hidden states. Two
layouts are read, as vLLM and SGLang load them:

- **EAGLE-1 / EAGLE-2.** For position i, with f_i the target's final hidden state there (the lm_head's input,
  after the final norm) and t_{i+1} the token that follows it::

      g_i = layers(fc(cat(embed(t_{i+1}), f_i)))        the first layer without its input norm, no final norm
      draft for t_{i+2} = argmax lm_head(g_i)

  and the chain goes on from (g_i, that draft) in place of (f_{i+1}, t_{i+2}). The lm_head is the target's (run
  through the target's own compiled node, so a quantized or soft-capped one is read as the target reads it) unless
  the checkpoint has its own.
- **EAGLE-3.** The target's residual streams entering a few of its layers (``eagle_aux_hidden_state_layer_ids``,
  vLLM's indexing: layer j's input is layer j - 1's output, 0 the embeddings; default 2, L // 2, L - 3; SGLang reads
  explicit ids as layer outputs, one layer later, so a head whose config was written for it is read one layer early
  here: its ids need 1 added) side by side
  go through fc to the head's width h; the first layer attends over cat(input_norm(embed(t_{i+1})),
  hidden_norm(h)) (q, k and v from 2h features) with h as its residual (``norm_before_residual``: hidden_norm(h)),
  later layers are Llama layers, and a final norm feeds the head's own lm_head over a draft vocabulary whose rows
  map to target ids through ``d2t`` (target id = row + d2t[row]). A chain step feeds the final norm's input in
  place of fc's output. The executor keeps those streams through every step (``keep_hidden_states``).

The pair of position i sits at position i of the head's own KV cache (its rotary at i). The embedding table is the
target's (an EAGLE-3 head's own ``embed_tokens`` where it ships one, as it must where its width differs).

Checkpoint: a directory with ``config.json`` (Llama fields: hidden_size, num_attention_heads, num_key_value_heads,
head_dim, intermediate_size, num_hidden_layers, rms_norm_eps, rope_theta or rope_parameters / rope_scaling of type
default or llama3, hidden_act silu; EAGLE-3 also target_hidden_size, draft_vocab_size, the layer ids at the top
level or in ``eagle_config``; or a ``speculators`` eagle3 config, its Llama fields in ``transformer_layer_config``
and ``norm_before_residual`` true by default) and ``model.safetensors``. EAGLE-1: ``fc.weight`` [h, 2h]
(``fc.bias`` optional), ``layers.N.self_attn.{q,k,v,o}_proj.weight``, ``layers.N.mlp.{gate,up,down}_proj.weight``,
``layers.N.post_attention_layernorm.weight`` and, past the first layer, ``layers.N.input_layernorm.weight``
(``embed_tokens.weight`` is not read). EAGLE-3: ``fc.weight`` [h, streams x target hidden], ``midlayer.*`` (or
``layers.0.*``) with ``hidden_norm`` and ``input_layernorm``, ``layers.N.*`` past it, ``norm.weight``,
``lm_head.weight`` [draft vocabulary, h], ``d2t`` (``t2d`` is accepted and not read). A ``model.`` prefix is
accepted. It is recognised as EAGLE-3 by ``d2t`` / ``t2d`` / a hidden_norm or an ``Eagle3`` architecture name.
Pickled weights (``pytorch_model.bin``) are refused: convert them with safetensors first.
``builder/devtools/train_eagle.py`` trains an EAGLE-1 head (``--eagle3``: an EAGLE-3 head) for the bundled model.

The proposer (:class:`EagleProposer`): the serving engine hands it the target's hidden states of every step of a
request that may speculate (``record_hidden``: the rows and the position of the first). Before it drafts, the pairs
the request's head cache does not hold yet (up to the position before its last token) are fed in one step, whose
last row gives the first draft; then k - 1 chain steps. Chain entries (past the last known pair) are written over
at the next proposal, which starts from the known pairs. Positions whose hidden states were never recorded (a
prefix-cache hit; steps run at a load past the policy's ``max_running``) leave a gap, and the head's cache restarts
after it: the drafts lose that context, never exactness (the target verifies every draft, greedy drafts: one-hot).

The head's steps are torch ops over the requests drafting in a step at once (at most ``max_running``; each its own
slot of the head's cache), reading their slots, positions and cache starts from device tensors; a position attends
to at most ``RUNTIME_EAGLE_WINDOW`` (``DEFAULT_WINDOW``, 2,048) positions up to its own, so a step's cost follows that
window, not the slot's ``max_seq_len``; on CUDA a proposal
is one CUDA-graph replay (``EagleProposer``: a graph per number of pairs fed for one request, and per number of
requests for several), its drafts left on the device. Measured in docs/BENCHMARKS.md (sessions 56, 57): on the
bundled model the heads are accepted at 0.74-0.78 but a proposal (head steps of a few dozen small kernels each)
costs more than the steps it saves; at the Llama-3-8B shape an EAGLE-1 draft costs ~0.5 ms and an EAGLE-3 one
(32,000-token draft vocabulary) ~0.36 ms, against a 4.1 ms bf16 step. Proposals over several requests were checked
on the CPU only (drafts equal to each request's alone); their cost on a GPU is not measured yet.
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

from runtime.env import env_number
from runtime.speculative import DraftRequest, PendingDrafts, Proposer, SpeculativeConfigError

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
# the positions a head step attends to, up to its own (RUNTIME_EAGLE_WINDOW): its cost follows this, not the
# request cache's max_seq_len; longer contexts lose their oldest positions to the drafts, never exactness
DEFAULT_WINDOW = 2048
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
    version: int = 1  # 1: EAGLE-1 / EAGLE-2 layout; 3: EAGLE-3 (the target's layers side by side, a draft vocabulary)
    target_hidden_size: int = 0  # EAGLE-3: the target's hidden size (0: hidden_size)
    draft_vocab_size: int = 0  # EAGLE-3: the head's lm_head rows (0: the target's vocabulary)
    aux_layers: tuple[int, ...] = ()  # EAGLE-3: the target layers whose input streams it reads (): the default
    norm_before_residual: bool = False  # EAGLE-3: the first layer's residual is the normed hidden state

    @classmethod
    def from_dict(cls, cfg: dict, where: str, version: int = 1) -> EagleConfig:
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
        base = (hidden, heads, kv_heads, head_dim, need("intermediate_size"), need("num_hidden_layers"), float(eps),
                _inv_freq(cfg, head_dim, where))
        if version == 1:
            return cls(*base)
        target_hidden = cfg.get("target_hidden_size") or hidden
        draft_vocab = cfg.get("draft_vocab_size") or 0
        for name, value in (("target_hidden_size", target_hidden), ("draft_vocab_size", draft_vocab or 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EagleCheckpointError(f"{where}: {name} must be a positive integer, got {value!r}")
        nested = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
        aux = cfg.get("eagle_aux_hidden_state_layer_ids", nested.get("eagle_aux_hidden_state_layer_ids")) or ()
        if (not isinstance(aux, (list, tuple))
                or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in aux)):
            raise EagleCheckpointError(f"{where}: eagle_aux_hidden_state_layer_ids must be a list of layer indices "
                                       f"(0 or more), got {aux!r}")
        return cls(*base, version=3, target_hidden_size=target_hidden, draft_vocab_size=draft_vocab,
                   aux_layers=tuple(aux), norm_before_residual=bool(cfg.get("norm_before_residual", False)))

    def target_layers(self, num_layers: int) -> tuple[int, ...]:
        """EAGLE-3: the target layers (of ``num_layers``) whose input residual streams the head reads, ascending,
        as vLLM indexes them (layer j's input is layer j - 1's output; 0 is the embeddings, ``num_layers`` the
        stream the final norm reads): the config's ``eagle_aux_hidden_state_layer_ids``, else (2, L // 2, L - 3)."""
        ids = self.aux_layers or (2, num_layers // 2, num_layers - 3)
        bad = [i for i in ids if not 0 <= i <= num_layers]
        if bad:
            raise EagleCheckpointError(f"EAGLE-3 head: target layers {bad} are outside the target's 0..{num_layers} "
                                       f"(eagle_aux_hidden_state_layer_ids)")
        return tuple(sorted(set(ids)))


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


class EagleHead:
    """The head's weights and its forward over new pairs of one or several requests' slots (module docstring)."""

    def __init__(self, config: EagleConfig, weights: dict[str, torch.Tensor], embed: torch.Tensor,
                 lm_head, dtype: torch.dtype, device: torch.device, draft_ids: torch.Tensor | None = None) -> None:
        """``weights``: the checkpoint's tensors, names without a ``model.`` prefix (an EAGLE-3 head's ``midlayer.``
        as ``layers.0.``); ``embed``: the embedding table [vocab, h] (the target's, or an EAGLE-3 head's own);
        ``lm_head``: hidden [n, h] -> logits [n, vocab] fp32; ``draft_ids``: the target id of each lm_head row (an
        EAGLE-3 head's draft vocabulary; None: rows are target ids)."""
        self.config, self.embed, self.lm_head = config, embed, lm_head
        self.dtype, self.device = dtype, device
        self.draft_ids = None if draft_ids is None else draft_ids.to(device=device, dtype=torch.long)
        self.w = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()}
        for i in range(config.num_layers):  # one GEMM for q, k and v, one for gate and up (fewer launches a step)
            p = f"layers.{i}."
            self.w[p + "qkv"] = torch.cat([self.w.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
            self.w[p + "gate_up"] = torch.cat([self.w.pop(p + f"mlp.{x}_proj.weight") for x in ("gate", "up")])
        self.inv_freq = torch.tensor(config.inv_freq, dtype=torch.float32, device=device)
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None
        # the width of the target's hidden states a step is fed: its final ones (EAGLE-1), or its streams side by
        # side (EAGLE-3, fc's input)
        fc_in = self.w["fc.weight"].shape[1]
        self.input_width = fc_in - config.hidden_size if config.version == 1 else fc_in

    def weights_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.w.values())

    def rope_tables(self, capacity: int) -> None:
        """cos / sin of every position below ``capacity`` [capacity, head_dim], made once (a step gathers rows)."""
        angles = torch.arange(capacity, dtype=torch.float32, device=self.device)[:, None] * self.inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        self._tables = (angles.cos(), angles.sin())

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary over each head's two halves (Llama's rotate_half); x [n, heads, d], cos / sin [n, 1, d]."""
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return (x.float() * cos + rotated.float() * sin).to(x.dtype)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Llama's RMSNorm: over fp32, the gain applied in the model's dtype."""
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.config.rms_norm_eps).to(x.dtype)

    def draft(self, out: torch.Tensor) -> torch.Tensor:
        """Greedy drafts (target token ids) [n] from the head's outputs [n, h] (``forward``'s first)."""
        token = torch.argmax(self.lm_head(out), dim=-1)
        return token if self.draft_ids is None else self.draft_ids.index_select(0, token)

    def forward(self, cache: _SlotCache, slot: torch.Tensor, token_ids: torch.Tensor, hidden: torch.Tensor,
                first: torch.Tensor, start: torch.Tensor, fresh: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed pairs (hidden[j], token_ids[j]) of one request at positions first + j: ``forward_batch`` over one
        request (``first`` and ``start`` one-element device tensors); its two outputs, [n, h] each."""
        positions = first + torch.arange(token_ids.shape[0], device=self.device)
        out, stream = self.forward_batch(cache, slot, token_ids[None], hidden[None], positions[None], start, fresh)
        return out[0], stream[0]

    def forward_batch(self, cache: _SlotCache, slots: torch.Tensor, token_ids: torch.Tensor, hidden: torch.Tensor,
                      positions: torch.Tensor, starts: torch.Tensor, fresh: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed pairs (hidden[r, j], token_ids[r, j]) at positions[r, j] into request slot slots[r] of ``cache``
        (written there; that slot's keys from position starts[r] on are attended, causally), for R requests at once:
        token_ids and positions [R, n], hidden [R, n, width], slots and starts [R]. ``hidden`` is the target's
        (``fresh``: as recorded) or the head's own (the second output of the step before, in a chain). Returns the
        head's outputs [R, n, h] for its lm_head and the hidden states a chain step feeds on. Everything is a device
        tensor, so that a step is the same kernels whatever the requests and positions (``EagleProposer`` captures
        it in CUDA graphs). A pair may repeat an earlier one of its row (same token, state and position: the same
        keys written twice), which is how rows of fewer pairs are padded.

        EAGLE-1: x = fc(cat(embed, hidden)), then Llama layers (the first without its input norm, no final norm);
        both outputs are x. EAGLE-3: the target's streams side by side go through fc (``fresh`` only); the first
        layer attends over cat(input_norm(embed), hidden_norm(h)) with h as its residual (or hidden_norm(h):
        ``norm_before_residual``), later layers are Llama layers; the final norm's input is the chain's hidden state
        and its output the lm_head's."""
        cfg, w = self.config, self.w
        (num, n), cap = token_ids.shape, cache.capacity
        cos, sin = (t.index_select(0, positions.reshape(-1)).view(num, n, 1, -1) for t in self._tables)
        # the keys a step reads: the window before its first pair's position, through its last (the pairs of a row
        # are in ascending order), each query masked to its own window and causally, and to the row's cache start
        win = cache.window
        key_pos = positions[:, :1] - (win - 1) + torch.arange(win + n - 1, device=self.device)  # [R, span]
        mask = ((key_pos[:, None, :] <= positions[:, :, None]) & (key_pos[:, None, :] > positions[:, :, None] - win)
                & (key_pos[:, None, :] >= starts[:, None, None]) & (key_pos[:, None, :] >= 0))  # [R, n, span]
        keys_at = (slots[:, None] * cap + key_pos.clamp(0, cap - 1)).reshape(-1)  # their rows of the flat cache
        rows = (slots[:, None] * cap + positions).reshape(-1)  # the slots' rows the new pairs write
        embeds = F.embedding(token_ids, self.embed).to(self.dtype)
        if cfg.version == 1:
            x = F.linear(torch.cat([embeds, hidden.to(self.dtype)], dim=-1), w["fc.weight"], w.get("fc.bias"))
            for i in range(cfg.num_layers):
                h = x if i == 0 else self._norm(x, w[f"layers.{i}.input_layernorm.weight"])
                x = x + self._attend(i, h, cache, keys_at, rows, cos, sin, mask)
                x = x + self._mlp(i, self._norm(x, w[f"layers.{i}.post_attention_layernorm.weight"]))
            return x, x
        h = F.linear(hidden.to(self.dtype), w["fc.weight"], w.get("fc.bias")) if fresh else hidden.to(self.dtype)
        x = residual = None
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            if i == 0:
                normed = self._norm(h, w[p + "hidden_norm.weight"])
                residual = normed if cfg.norm_before_residual else h
                a = torch.cat([self._norm(embeds, w[p + "input_layernorm.weight"]), normed], dim=-1)
            else:
                residual = x + residual
                a = self._norm(residual, w[p + "input_layernorm.weight"])
            residual = residual + self._attend(i, a, cache, keys_at, rows, cos, sin, mask)
            x = self._mlp(i, self._norm(residual, w[p + "post_attention_layernorm.weight"]))
        stream = x + residual
        return self._norm(stream, w["norm.weight"]), stream

    def _attend(self, i: int, h: torch.Tensor, cache: _SlotCache, keys_at: torch.Tensor, rows: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Layer i's attention block over its input h [R, n, in]: q/k/v, rotary, the new keys and values written to
        the slots' rows, attention over the cache rows ``keys_at`` (each request's window, ``forward_batch``), the
        output projection."""
        cfg, w = self.config, self.w
        num, n = h.shape[:2]
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        p = f"layers.{i}."
        qkv = F.linear(h, w[p + "qkv"]).view(num, n, hq + 2 * hkv, d)
        qk = self._rope(qkv[:, :, :hq + hkv], cos, sin)  # q's and k's heads at once
        q, k, v = qk[:, :, :hq], qk[:, :, hq:], qkv[:, :, hq + hkv:]
        cache.k[i].index_copy_(0, rows, k.reshape(num * n, hkv, d))
        cache.v[i].index_copy_(0, rows, v.reshape(num * n, hkv, d))
        span = keys_at.numel() // num
        keys = cache.k[i].index_select(0, keys_at).view(num, span, hkv, d)  # [R, span, kv heads, d]
        values = cache.v[i].index_select(0, keys_at).view(num, span, hkv, d)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                              attn_mask=mask[:, None], enable_gqa=hq != hkv)  # [R, heads, n, d]
        return F.linear(attn.transpose(1, 2).reshape(num, n, hq * d), w[p + "self_attn.o_proj.weight"])

    def _mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(h, self.w[f"layers.{i}.gate_up"]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.w[f"layers.{i}.mlp.down_proj.weight"])


class _SlotCache:
    """The head's KV caches for ``slots`` requests at once: per layer one tensor [slots * capacity, kv heads, d],
    request slot i owning rows [i * capacity, (i + 1) * capacity) by position."""

    def __init__(self, config: EagleConfig, slots: int, capacity: int, dtype: torch.dtype,
                 device: torch.device, window: int | None = None) -> None:
        self.capacity = capacity
        # a query attends to the keys of at most this many positions up to its own (a head step's cost follows the
        # window, not the slot's capacity; past it the drafts lose context, never exactness)
        self.window = min(capacity, window or capacity)
        shape = (slots * capacity, config.num_kv_heads, config.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


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
    slot: int  # its rows of the slot cache
    start: int = 0  # the first position its cache holds (after a gap)
    length: int = 0  # positions [start, length) hold pairs of known tokens; the chain writes past them
    hidden: _Hidden = field(default_factory=_Hidden)


class EagleProposer(Proposer):
    """Greedy drafts from an EAGLE head over the target's hidden states (see the module docstring).

    A proposal for a request whose cache lacks at most ``max_draft_tokens + 1`` pairs (the usual case after a verify
    step: its accepted drafts and the target's own token) is one step feeding them and k - 1 one-token chain steps;
    on CUDA (``cuda_graphs``) that is one CUDA-graph replay, a graph per number of pairs fed. Several requests
    drafting in one step are one proposal over all of them (a graph per number of requests): each feeds its last
    ``max_draft_tokens + 1`` known pairs, those its cache holds already written again with the same keys, and a row
    of fewer known pairs (after a gap) repeats its first. More pairs (a prompt) are fed first, per request, in eager
    steps of at most ``max_draft_tokens + 1``."""

    method = "eagle"
    needs_hidden = True  # the serving engine records the target's hidden states (record_hidden)

    def __init__(self, head: EagleHead, max_seq_len: int, max_seqs: int = 8, max_draft_tokens: int = 4,
                 cuda_graphs: bool = True, window: int | None = None) -> None:
        if max_seqs < 1:
            raise SpeculativeConfigError(f"an EAGLE head needs room for at least one request, got {max_seqs}")
        if max_draft_tokens < 1:
            raise SpeculativeConfigError(f"max_draft_tokens must be >= 1, got {max_draft_tokens}")
        self.head, self.max_seq_len = head, max_seq_len
        self.max_seqs, self.max_draft_tokens = max_seqs, max_draft_tokens
        self.max_feed = max_draft_tokens + 1  # pairs a proposal's first step feeds at most
        self._seqs: OrderedDict[str, _EagleSeq] = OrderedDict()  # least recently used first
        self._free = list(range(max_seqs - 1, -1, -1))  # request slots; pop() takes the lowest
        head.rope_tables(max_seq_len)
        window = window or env_number("RUNTIME_EAGLE_WINDOW", DEFAULT_WINDOW, error=SpeculativeConfigError)
        if window < 1:
            raise SpeculativeConfigError(f"an EAGLE head's attention window must be at least 1 position, got {window}")
        self.cache = _SlotCache(head.config, max_seqs, max_seq_len, head.dtype, head.device, window)
        dev = head.device
        # a proposal's static inputs, a row per request: [slot, cache start, ids of the pairs fed..., their
        # positions...], their hidden states; and the drafts it leaves
        self._longs = torch.zeros(max_seqs, 2 + 2 * self.max_feed, dtype=torch.long, device=dev)
        self._feed_hidden = torch.zeros(max_seqs, self.max_feed, head.input_width, dtype=head.dtype, device=dev)
        self._out = torch.zeros(max_seqs, max_draft_tokens, dtype=torch.long, device=dev)
        # (requests, pairs fed each) -> the proposal's graph: one request and any number of pairs, or several
        # requests and max_feed pairs each
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        if cuda_graphs and dev.type == "cuda":
            pool = torch.cuda.graph_pool_handle()
            keys = [(r, self.max_feed) for r in range(max_seqs, 1, -1)] + [(1, n) for n in range(self.max_feed, 0, -1)]
            for num, n in keys:  # the largest first: the smaller ones reuse its memory
                self._graphs[(num, n)] = self._capture(num, n, pool)

    @classmethod
    def load(cls, path: str | Path, target, max_seq_len: int, max_seqs: int = 8, max_draft_tokens: int = 4,
             cuda_graphs: bool = True) -> EagleProposer:
        """The head at ``path`` for ``target`` (an ``Engine``), on the target's device and in its dtype."""
        return cls(load_head(path, target), max_seq_len, max_seqs, max_draft_tokens, cuda_graphs)

    # -- what the serving engine tells it --------------------------------------------------------------------
    def record_hidden(self, request_id: str, start: int, hidden: torch.Tensor) -> None:
        """The target's final hidden states of ``request_id`` at positions start, start + 1, ... (rows of
        ``hidden``, copied: the caller's buffer may be a CUDA graph's, overwritten by the next replay)."""
        seq = self._seq(request_id)
        seq.hidden.record(start, hidden)

    def release(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self._free.append(seq.slot)

    def close(self) -> None:
        for graph in self._graphs.values():
            graph.reset()
        self._graphs.clear()

    def weights_bytes(self) -> int:
        return self.head.weights_bytes()

    def kv_bytes(self) -> int:
        """The caches (max_seqs slots of max_seq_len positions) and the most hidden states recorded at once."""
        size = torch.empty((), dtype=self.head.dtype).element_size()
        return self.cache.bytes() + self.max_seqs * self.max_seq_len * self.head.input_width * size

    def _seq(self, request_id: str) -> _EagleSeq:
        seq = self._seqs.get(request_id)
        if seq is None:
            while len(self._seqs) >= self.max_seqs:
                _, old = self._seqs.popitem(last=False)
                self._free.append(old.slot)
            seq = self._seqs[request_id] = _EagleSeq(self._free.pop())
        self._seqs.move_to_end(request_id)
        return seq

    # -- drafting --------------------------------------------------------------------------------------------
    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        drafts = self.propose_pending(requests)
        return drafts.resolve() if isinstance(drafts, PendingDrafts) else drafts

    @torch.inference_mode()
    def propose_pending(self, requests: Sequence[DraftRequest]) -> list[list[int]] | PendingDrafts:
        """As ``propose``, the drafts left on the device (``PendingDrafts``): each chain step's token feeds the next
        on the device, so the host waits for none of them (the serving engine reads them with the verify step's).
        Every request that drafts is in one proposal (see the class docstring)."""
        plans = [self._plan(r) for r in requests]
        drafting = [p for p in plans if p is not None]
        if not drafting:
            return [[] for _ in requests]
        num = len(drafting)
        n = drafting[0][3] if num == 1 else self.max_feed
        self._stage(drafting, n)
        graph = self._graphs.get((num, n))
        if graph is not None:
            graph.replay()
        else:
            self._proposal(num, n)
        flat = self._out[:num].reshape(-1).clone()  # the buffer is the next replay's
        k, sources, row = self.max_draft_tokens, [], 0
        for plan, request in zip(plans, requests):
            if plan is None:
                sources.append([])
                continue
            sources.append(list(range(row * k, row * k + min(k, request.max_tokens))))
            row += 1
        return PendingDrafts(flat, sources)

    def may_propose(self, token_ids: Sequence[int], request_id: str | None = None) -> bool:
        """Whether the target's hidden state before the last token is known (else there is nothing to start from)."""
        seq = self._seqs.get(request_id) if request_id is not None else None
        if seq is None:
            return False
        last = len(token_ids) - 2  # the pair (f_last, t_{last + 1}) starts the drafts
        return seq.hidden.known_from <= last < seq.hidden.known_to

    def _plan(self, request: DraftRequest) -> tuple[_EagleSeq, Sequence[int], int, int] | None:
        """A request's part of a proposal: (its state, its tokens, the first position to feed, the number of pairs
        its cache lacks), after feeding a long catch-up (a prompt) in eager steps; None where it has no drafts."""
        tokens = request.token_ids
        num = len(tokens)
        seq = self._seqs.get(request.request_id)
        if seq is None or request.max_tokens < 1 or num < 2 or num + self.max_draft_tokens > self.max_seq_len:
            return None
        self._seqs.move_to_end(request.request_id)
        hidden = seq.hidden
        last = num - 2  # pairs (f_i, t_{i+1}) for positions up to last are known
        if not hidden.known_from <= last < hidden.known_to:
            return None
        # the cache holds known pairs below seq.length; the last pair is fed again where it holds it too (its output
        # starts the chain)
        first = min(seq.length, last)
        if first < hidden.known_from:  # a gap: the cache restarts after it
            seq.start = first = hidden.known_from
        while last + 1 - first > self.max_feed:  # a long catch-up (a prompt): eager steps first
            n = self.max_feed
            self._stage([(seq, tokens, first, n)], n)
            self._feed(1, n)
            first += n
        seq.length = last + 1
        return seq, tokens, first, last + 1 - first

    def _stage(self, plans: list[tuple[_EagleSeq, Sequence[int], int, int]], n: int) -> None:
        """The static inputs of a step feeding n pairs a request: each plan's pairs from its first position on,
        the pairs before them its cache already holds (down to its start) written again, then (after a gap) its
        first pair repeated, up to n."""
        longs, hidden = [], []
        for seq, tokens, first, count in plans:
            end = first + count  # positions [first, end) are the plan's own; n - count more before them
            lo = max(seq.start, end - n)
            positions = [lo] * (n - (end - lo)) + list(range(lo, end))
            pad = [0] * (self.max_feed - n)
            longs.append([seq.slot, seq.start, *(tokens[i + 1] for i in positions), *pad, *positions, *pad])
            hidden.append(seq.hidden.rows[positions[0]:end] if end - lo == n
                          else seq.hidden.rows[torch.tensor(positions, device=seq.hidden.rows.device)])
        self._longs[:len(plans)].copy_(torch.tensor(longs, dtype=torch.long), non_blocking=False)
        self._feed_hidden[:len(plans), :n].copy_(torch.stack(hidden))

    def _feed(self, num: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step over the staged pairs (num requests, n each); its outputs (``EagleHead.forward_batch``)."""
        longs = self._longs[:num]
        return self.head.forward_batch(self.cache, longs[:, 0], longs[:, 2:2 + n], self._feed_hidden[:num, :n],
                                       longs[:, 2 + self.max_feed:2 + self.max_feed + n], longs[:, 1])

    def _proposal(self, num: int, n: int) -> None:
        """Feed the staged pairs, then draft max_draft_tokens tokens a request into ``_out``, each fed to the next
        step on the device (what a proposal's CUDA graph holds)."""
        out, g = (t[:, -1:] for t in self._feed(num, n))
        longs = self._longs[:num]
        pos = longs[:, 1 + self.max_feed + n:2 + self.max_feed + n]  # [R, 1]: the last pair fed; the chain follows
        for j in range(self.max_draft_tokens):
            token = self.head.draft(out[:, 0])  # [R]
            self._out[:num, j].copy_(token)
            if j + 1 < self.max_draft_tokens:
                out, g = self.head.forward_batch(self.cache, longs[:, 0], token[:, None], g, pos + 1 + j, longs[:, 1],
                                                 fresh=False)

    def _capture(self, num: int, n: int, pool) -> torch.cuda.CUDAGraph:
        self._longs.zero_()  # warm-up and capture: slot 0, position 0 (whatever they write is written over)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):
                self._proposal(num, n)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool), torch.inference_mode():
            self._proposal(num, n)
        return graph


def read_head(path: str | Path, hidden_size: int, vocab_size: int, num_layers: int | None = None
              ) -> tuple[EagleConfig, dict[str, torch.Tensor]]:
    """Read and check the head at ``path`` for a target of ``hidden_size`` features, ``vocab_size`` tokens and
    ``num_layers`` decoder layers (None: the EAGLE-3 target layers are not checked): its config and its tensors
    (names without a ``model.`` prefix, an EAGLE-3 head's ``midlayer.`` as ``layers.0.``), every one of the shape
    config.json and the target give. Used by the runtime (``load_head``) and by the builder, which bundles a head
    into an artifact."""
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
    cfg = _from_speculators(cfg, where)
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            weights = {_tensor_name(k): f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # a truncated or corrupt file
        raise EagleCheckpointError(f"{where}: {WEIGHTS_FILE} cannot be read ({e})") from None
    version = _version(cfg, weights)
    config = EagleConfig.from_dict(cfg, where, version)
    target_hidden = config.target_hidden_size if version == 3 else config.hidden_size
    if target_hidden != hidden_size:
        name = "target_hidden_size" if version == 3 and "target_hidden_size" in cfg else "hidden_size"
        raise EagleCheckpointError(f"{where}: {name} {target_hidden} is not the target's {hidden_size}; an "
                                   f"EAGLE head reads the target's hidden states")
    shapes = _expected_shapes(config, weights, vocab_size, where)
    if version == 3 and num_layers is not None:
        layers = config.target_layers(num_layers)
        if shapes["fc.weight"][1] != len(layers) * hidden_size:
            raise EagleCheckpointError(f"{where}: fc.weight reads {shapes['fc.weight'][1] // hidden_size} of the "
                                       f"target's hidden states side by side, but the head names {len(layers)} "
                                       f"target layers {list(layers)} (eagle_aux_hidden_state_layer_ids, or the "
                                       f"default 2, L // 2, L - 3 for this {num_layers}-layer target)")
    missing = sorted(set(shapes) - set(weights))
    kind = "an EAGLE-3" if version == 3 else "an EAGLE-1"
    if missing:
        raise EagleCheckpointError(f"{where}: {WEIGHTS_FILE} lacks {', '.join(missing[:4])}"
                                   f"{' ...' if len(missing) > 4 else ''} ({kind} head of "
                                   f"{config.num_layers} layer(s))")
    for name, shape in shapes.items():
        if tuple(weights[name].shape) != shape:
            hint = (" (an EAGLE-3 head over a draft vocabulary names its size in draft_vocab_size)"
                    if version == 3 and name == "lm_head.weight" else "")
            raise EagleCheckpointError(f"{where}: {name} is {list(weights[name].shape)}, expected {list(shape)} "
                                       f"from config.json and the target{hint}")
        if name in ("d2t", "t2d"):
            continue
        if not weights[name].is_floating_point() or not torch.isfinite(weights[name]).all():
            raise EagleCheckpointError(f"{where}: {name} is not a finite floating-point tensor")
    if "d2t" in shapes:  # offsets: draft row r drafts target token r + d2t[r]
        d2t = weights["d2t"]
        if d2t.is_floating_point() or d2t.dtype == torch.bool:
            raise EagleCheckpointError(f"{where}: d2t must hold integer offsets, got {d2t.dtype}")
        ids = torch.arange(d2t.numel()) + d2t.long()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise EagleCheckpointError(f"{where}: d2t maps draft tokens outside the target's vocabulary of "
                                       f"{vocab_size}")
    if "t2d" in shapes and weights["t2d"].dtype != torch.bool:
        raise EagleCheckpointError(f"{where}: t2d must be a boolean mask over the target's vocabulary")
    ignored = {"embed_tokens.weight"} if version == 1 else set()
    unused = sorted(set(weights) - set(shapes) - ignored)
    if unused:
        raise EagleCheckpointError(f"{where}: {WEIGHTS_FILE} has tensors {kind} head does not have: "
                                   f"{', '.join(unused[:4])}{' ...' if len(unused) > 4 else ''}")
    return config, {k: v for k, v in weights.items() if k in shapes}


def _from_speculators(cfg: dict, where: str) -> dict:
    """A config in the ``speculators`` format (``speculators_model_type`` eagle3: the Llama fields in
    ``transformer_layer_config``, the EAGLE-3 fields at the top level, ``norm_before_residual`` true unless it says
    otherwise, as vLLM reads it) as the flat config the rest reads; other configs as they are."""
    kind = cfg.get("speculators_model_type")
    if kind is None:
        return cfg
    if kind != "eagle3":
        raise EagleCheckpointError(f"{where}: a speculators {kind!r} checkpoint is not supported (its eagle3 heads "
                                   f"are, and EAGLE-1 heads in the fc / layers.N layout)")
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise EagleCheckpointError(f"{where}: a speculators eagle3 config needs transformer_layer_config (an object "
                                   f"of the Llama layer's fields)")
    flat = dict(layer, architectures=["LlamaForCausalLMEagle3"],
                norm_before_residual=cfg.get("norm_before_residual", True))
    for name in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids"):
        if cfg.get(name) is not None:
            flat[name] = cfg[name]
    return flat


def _version(cfg: dict, names) -> int:
    """3 for an EAGLE-3 head (``d2t`` / ``t2d``, a first layer's hidden_norm, or an Eagle3 architecture), else 1."""
    archs = cfg.get("architectures") if isinstance(cfg.get("architectures"), list) else []
    return 3 if ({"d2t", "t2d", "layers.0.hidden_norm.weight"} & set(names)
                 or any("eagle3" in str(a).lower() for a in archs)) else 1


def head_version(path: str | Path) -> int:
    """The layout of the head at ``path`` (1 or 3), from its config.json and its tensors' names only (unchecked)."""
    from safetensors import safe_open

    path = Path(path)
    try:
        cfg = json.loads((path / "config.json").read_text())
        with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
            names = [_tensor_name(k) for k in f.keys()]
    except Exception as e:
        raise EagleCheckpointError(f"EAGLE head {path} cannot be read ({e})") from None
    if isinstance(cfg, dict) and cfg.get("speculators_model_type") == "eagle3":
        return 3
    return _version(cfg if isinstance(cfg, dict) else {}, names)


def _tensor_name(name: str) -> str:
    """A checkpoint's tensor name as the head reads it: no ``model.`` prefix, EAGLE-3's ``midlayer.`` as the first
    layer."""
    name = name[len("model."):] if name.startswith("model.") else name
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def _expected_shapes(config: EagleConfig, weights: dict[str, torch.Tensor], vocab_size: int,
                     where: str) -> dict[str, tuple[int, ...]]:
    """Every tensor the head must (or, where the checkpoint has it, may) hold, with its shape."""
    h, d = config.hidden_size, config.head_dim
    v3 = config.version == 3
    if v3:
        fc = weights.get("fc.weight")
        width = fc.shape[1] if fc is not None and fc.dim() == 2 else 3 * config.target_hidden_size
        if width % config.target_hidden_size:
            raise EagleCheckpointError(f"{where}: fc.weight's {width} inputs are not a whole number of the "
                                       f"target's hidden states ({config.target_hidden_size})")
        shapes: dict[str, tuple[int, ...]] = {"fc.weight": (h, width), "norm.weight": (h,),
                                              "lm_head.weight": (config.draft_vocab_size or vocab_size, h)}
    else:
        shapes = {"fc.weight": (h, 2 * h)}
    for i in range(config.num_layers):
        attn_in = 2 * h if v3 and i == 0 else h
        shapes.update({
            f"layers.{i}.self_attn.q_proj.weight": (config.num_heads * d, attn_in),
            f"layers.{i}.self_attn.k_proj.weight": (config.num_kv_heads * d, attn_in),
            f"layers.{i}.self_attn.v_proj.weight": (config.num_kv_heads * d, attn_in),
            f"layers.{i}.self_attn.o_proj.weight": (h, config.num_heads * d),
            f"layers.{i}.mlp.gate_proj.weight": (config.intermediate_size, h),
            f"layers.{i}.mlp.up_proj.weight": (config.intermediate_size, h),
            f"layers.{i}.mlp.down_proj.weight": (h, config.intermediate_size),
            f"layers.{i}.post_attention_layernorm.weight": (h,),
        })
        if i > 0 or v3:
            shapes[f"layers.{i}.input_layernorm.weight"] = (h,)
    if v3:
        shapes["layers.0.hidden_norm.weight"] = (h,)
        draft_vocab = shapes["lm_head.weight"][0]
        if draft_vocab != vocab_size or "d2t" in weights:
            shapes["d2t"] = (draft_vocab,)
        if "t2d" in weights:
            shapes["t2d"] = (vocab_size,)
        if "embed_tokens.weight" in weights or h != config.target_hidden_size:
            shapes["embed_tokens.weight"] = (vocab_size, h)  # its own embedding (needed where its width differs)
    if "fc.bias" in weights:
        shapes["fc.bias"] = (h,)
    if "lm_head.weight" in weights and not v3:
        shapes["lm_head.weight"] = (vocab_size, h)
    return shapes


def load_head(path: str | Path, target) -> EagleHead:
    """The head at ``path`` for ``target`` (an ``Engine``), checked by ``read_head``, on the target's device and in
    its dtype, sharing its embedding and lm_head (or the head's own lm_head where it has one). An EAGLE-3 head also
    sets the target's executor to keep the residual streams it reads (``keep_hidden_states``)."""
    executor = target.executor
    if getattr(executor, "tp_size", 1) > 1:
        raise EagleCheckpointError(f"EAGLE head {path}: EAGLE heads run beside a target on one GPU; this target is "
                                   f"sharded")
    embed, lm_head, target_hidden = target_head_parts(executor)
    config, weights = read_head(path, target_hidden, embed.shape[0], executor.num_layers)
    dtype = executor.dtype
    if "lm_head.weight" in weights:
        own = weights.pop("lm_head.weight").to(device=target.device, dtype=dtype)

        def lm_head(x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, own).float()
    draft_ids = None
    if "d2t" in weights:
        offsets = weights.pop("d2t").long()
        draft_ids = torch.arange(offsets.numel()) + offsets
    weights.pop("t2d", None)
    if "embed_tokens.weight" in weights:
        embed = weights.pop("embed_tokens.weight").to(device=target.device, dtype=dtype)
    if config.version == 3:
        try:
            names = [executor.residual_stream(j) for j in config.target_layers(executor.num_layers)]
        except ValueError as e:
            raise EagleCheckpointError(f"EAGLE head {path}: {e}") from None
        executor.keep_hidden_states(names)
    elif executor.hidden_name:
        executor.keep_hidden_states([executor.hidden_name])
    return EagleHead(config, weights, embed, lm_head, dtype, target.device, draft_ids)


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
    from runtime.executor import StepInput

    table = executor.params[emb[0]["weights"]["weight"]]
    kernel = executor.node_kernel(heads[0])
    none = table.new_zeros(0, dtype=torch.long)  # the node reads no ids or positions; every row gets logits
    step = executor.scratch_step(StepInput(none, none, []))

    def lm_head(x: torch.Tensor) -> torch.Tensor:
        return kernel([x.to(executor.dtype)], step)[0]

    return table, lm_head, table.shape[1]
