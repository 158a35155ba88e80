"""AWQ: activation-aware weight quantization, the search half (pure torch).

Lin, Tang, Tang, Yang, Chen, Wang, Xiao, Dang, Gan, Han (2023), "AWQ: Activation-aware Weight
Quantization for LLM Compression and Acceleration"; reference implementation mit-han-lab/llm-awq
(``awq/quantize/auto_scale.py``, ``auto_clip.py``, ``quantizer.py``).

A few input channels carry much larger activations than the rest, and the weights reading them
matter most. AWQ protects them by scaling, not by keeping them in high precision: for a group of
linears reading the same input x, with s > 0 per input channel,

    y = x W^T = (x / s) (W * s)^T       and only W * s is quantized,

so a salient channel's weights are scaled up and lose relatively less to rounding. The scale is
searched, not solved: ``s = mean|x|^alpha`` (normalised by ``sqrt(max(s) * min(s))``), with alpha on a
grid of ``n_grid = 20`` points ``{0, 0.05, ..., 0.95}``, keeping the alpha whose fake-quantized block
output is closest (MSE) to the unquantized output (:func:`search_scale`). alpha = 0 gives s = 1,
plain round-to-nearest. Then, on the scaled weights and inputs, a per-(row, group) max-value clip
is searched (:func:`search_clip`): thresholds ``(1 - i / n_grid) * max|w|`` for
``i < n_grid * max_shrink`` (``n_grid = 20``, ``max_shrink = 0.5``: ratios 1.0 ... 0.55), measured on
``n_sample_tokens = 4096`` tokens (every kept calibration token, ``MAX_TOKENS_KEPT``; the reference takes a fixed
stride of 512), picking per group the threshold with the least output error. For asymmetric
grids the group's own range ``[min, max]`` shrunk by the same ratios is tried too (past the reference, whose
clip at ``+-ratio * max|w|`` shortens only the longer side of an asymmetric range).

Past the reference, once a linear's codes are fixed its group scales are refit (``refit_scales``, default on):
per output row, the scales that minimise the row's output error on the kept calibration inputs for those codes, by
least squares (``passes.gptq.refit_scales``). Clipping and rounding choose codes for a grid fitted to the weights;
the refit fits the grid to the outputs. On pydoc-qwen3 (g64) the two changes took AWQ's KL from 2.149e-4 to
1.287e-4 (asymmetric, 51% of round-to-nearest's error closed, was 19%) and from 2.822e-4 to 1.895e-4 (symmetric,
60% closed); on the bundled model from 1.511e-3 to 1.285e-3 (docs/QUANTIZATION_COMPARISON.md, session 25).

Defaults (paper §5.1 / the reference): INT4 weights, group size 128, asymmetric with zero points
(the project's convention, ``passes/quant_math.py``, whose asymmetric range always contains 0 where
the reference's spans [min, max]).

Options past the reference. ``scale_output`` (default on) also scales each output projection's input, folded into
the v projection's rows: attention is linear in v, so that is exact when the query heads of each kv head share the
scale (``passes.quantize.v_projection_rows``; the reference does it for equal-shaped v and o only, i.e. without
GQA). The v projection is quantized by then (an earlier segment), so the division goes into its per-(row, group)
scales, exactly. ``joint_clip`` (default off) runs the clip search inside the scale search, scoring each alpha on
the weights it will actually round: on pydoc-qwen3 it took KL to 1.99e-4 (asymmetric) and 2.08e-4 (symmetric, 56% of
round-to-nearest's error closed), on the bundled model 1.56e-3 / 1.91e-3 (level); it costs one clip search per
candidate, n_grid (2 n_grid with the duo scale) times the search. ``duo_scaling`` (default on for ``symmetric``)
also searches ``s = mean|x|^alpha / w^(1 - alpha)``, with ``w`` each input channel's mean ``|w| / max|w|`` over the
(row, group) ranges (:func:`weight_stat`), as later AWQ implementations do; the grid's best of both forms wins.
``clip: false`` skips the clip search. On the second trained fixture (pydoc-qwen3, g64; ``python -m
builder.bench.quantizers``) the output-projection scales took KL from 2.38e-4 to 2.15e-4 (asymmetric) and, with the
duo scale, symmetric AWQ from 3.84e-4 to 2.82e-4; on the bundled model they are level (1.53e-3 to 1.51e-3; 1.91e-3
to 1.93e-3). ``rounding: gptq`` rounds the scaled weights with GPTQ (``passes/gptq.py``) on the Hessian of the
scaled inputs over every calibration token instead of clipping and rounding to nearest (AWQ's scales, then GPTQ's
rounding, a combination several tools offer). On the bundled model (g64, 4,335 positions): KL 1.53e-3 rounded to
nearest, 4.96e-4 with GPTQ rounding (GPTQ alone 5.0e-4; with the clip searched first, 7.0e-4), round-to-nearest
without scales 2.08e-3.

The caller applies the results: it folds ``1 / s`` into the op producing x (a norm's weight, the
previous linear's output rows), multiplies each W_j's input columns by s, divides the recorded
inputs by s before :func:`search_clip` (as the reference does), clips with :func:`apply_clip`, and
quantizes (``quant_math.quantize_groups``). Everything here is deterministic and fp32. A norm absorbs
s only when the group's linears are its sole readers; a group whose input nothing can absorb is
quantized without scaling (round to nearest, clip search kept). With ``lm_head: true`` the lm_head is
such a group of its own, fed by the final norm, its scale searched on the logits.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict
from typing import Any, Callable

import torch
from torch import Tensor

from passes.base import PassError, register
from passes.gptq import HessianAccumulator, gptq_quantize, refit_scales
from passes.ir import Graph, Node
from passes.quant_math import QuantConfig, fake_quantize_groups, group_size_for, pack_int4, quantize_groups
from passes.moe_int4 import MAX_KEPT_ROWS, ExpertInputs, Int4Experts
from passes.quantize import QuantMethod, check_group_size, norm_can_absorb, v_projection_rows
from runtime.executor import Executor, SeqSlice, StepInput, kv_layout_of, sequence_positions
from runtime.kv_cache import SequenceKV

__all__ = ["activation_stat", "search_scale", "search_clip", "apply_clip"]

log = logging.getLogger("passes.awq")


def activation_stat(x: Tensor) -> Tensor:
    """x: ``[num_tokens, in]`` (leading dims flattened) -> mean |x| per input channel, fp32 ``[in]``."""
    return x.detach().reshape(-1, x.shape[-1]).float().abs().mean(dim=0)


@torch.no_grad()
def weight_stat(weights: list[Tensor], group_size: int) -> Tensor:
    """Mean over the output rows of every W_j of ``|w| / max|w|`` within each (row, quantization group): how
    large a weight is per input channel relative to its group's range, fp32 ``[in]`` (the "duo" scale's w term)."""
    w = torch.cat([w.detach().float() for w in weights])
    g = group_size_for(w.shape[1], group_size)
    wg = w.abs().reshape(w.shape[0], -1, g)
    return (wg / (wg.amax(dim=-1, keepdim=True) + 1e-6)).reshape(w.shape).mean(dim=0)


def search_scale(x: Tensor, weights: list[Tensor], block_fn: Callable[[Tensor, list[Tensor]], Tensor],
                 cfg: QuantConfig, n_grid: int = 20, duo: bool = False,
                 heads: tuple[int, int, int] | None = None,
                 clip_x: Tensor | None = None) -> tuple[Tensor, float, list[float]]:
    """Grid-search the per-input-channel scale ``s = mean|x|^alpha`` for the linears ``weights``.

    ``x``: ``[num_tokens, in]``, the input every W_j (``[out_j, in]``) reads. ``block_fn(x, weights)``
    computes the output of the block the linears feed (e.g. their concatenated outputs); it is
    called with fp32 tensors, first with the original weights, then once per alpha with
    ``fake_quant(W_j * s) / s``. Returns ``(best_scale fp32 [in], best_alpha, losses)``, where
    ``losses[i]`` is the output MSE for ``alpha = i / n_grid`` (``losses[0]`` is plain RTN). ``duo``: also
    try ``s = mean|x|^alpha / w^(1 - alpha)`` (``w``: :func:`weight_stat`, the weights' own salience, as later
    AWQ implementations do), whose losses follow as ``losses[n_grid + i]``; the best of both grids wins.
    ``clip_x`` (``joint_clip``): the group's own inputs; each candidate's weights are then clip-searched
    (:func:`search_clip` on ``clip_x / s``) before they are fake-quantized, so alpha is chosen for the weights that
    will be rounded, clip included. ``heads`` = (num_kv_heads, query heads per kv head, head_dim): x is attention's
    output and s is folded into the v projection's rows, so each kv head's query heads share one scale per
    channel: the statistics are averaged over them first.
    """
    if n_grid < 1:
        raise ValueError(f"n_grid must be >= 1, got {n_grid}")
    if not weights:
        raise ValueError("search_scale needs at least one weight")
    x = x.detach().reshape(-1, x.shape[-1]).float()
    in_f = x.shape[1]
    ws = [w.detach().float() for w in weights]
    for w in ws:
        if w.dim() != 2 or w.shape[1] != in_f:
            raise ValueError(f"weight of shape {tuple(w.shape)} does not read inputs of {in_f} features")
        group_size_for(in_f, cfg.group_size)
    org_out = block_fn(x, ws).float()
    x_mean = activation_stat(x)
    w_mean = weight_stat(ws, cfg.group_size) if duo else None
    if heads is not None:
        kv, group, dim = heads
        x_mean, w_mean = (None if t is None else t.reshape(kv, group, dim).mean(dim=1, keepdim=True)
                          .expand(kv, group, dim).reshape(-1) for t in (x_mean, w_mean))

    losses: list[float] = []
    best_loss, best_alpha, best_scale = math.inf, None, None
    for i in range(2 * n_grid if duo else n_grid):
        alpha = (i % n_grid) / n_grid
        s = x_mean.pow(alpha)
        if i >= n_grid:
            s = s / (w_mean.pow(1 - alpha) + 1e-4)
        s = s.clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        if clip_x is not None:  # the clip search on the scaled weights and inputs, as the quantization will do
            xs_ = clip_x / s
            qws = [fake_quantize_groups(apply_clip(w * s, search_clip(xs_, w * s, cfg), cfg.group_size), cfg) / s
                   for w in ws]
        else:
            qws = [fake_quantize_groups(w * s, cfg) / s for w in ws]
        out = block_fn(x, qws).float()
        loss = (org_out - out).pow(2).mean().item()
        losses.append(loss)
        if loss < best_loss:
            best_loss, best_alpha, best_scale = loss, alpha, s
    if best_scale is None:
        raise ValueError(f"search_scale: no finite loss on the grid ({losses}); inf/NaN in x or the weights?")
    return best_scale.clone(), best_alpha, losses


@torch.no_grad()
def search_clip(x: Tensor, weight: Tensor, cfg: QuantConfig, n_grid: int = 20, max_shrink: float = 0.5,
                n_sample_tokens: int = 4096, oc_batch: int = 256) -> Tensor:
    """Search a clip per (output row, group) of ``weight`` ``[out, in]``.

    For each ratio ``1 - i / n_grid`` with ``i < n_grid * max_shrink`` (i = 0, no clipping, is always
    tried), every group is clamped to ``+-ratio * max|w_group|``, fake-quantized, and its partial
    output ``x_group . w_group`` on the sampled tokens compared (MSE over tokens) with the
    unquantized one; each (row, group) keeps its best bounds. Asymmetric configurations also try each ratio
    of the group's own range, ``[ratio * min(w, 0), ratio * max(w, 0)]``: their grid spans [min, max], so a clip
    at +-ratio * max|w| shortens only the longer side of it, and shrinking both sides is what narrows the step
    (pydoc-qwen3, g64: AWQ's KL 2.149e-4 -> 1.844e-4 before the scale refit; docs/QUANTIZATION_COMPARISON.md).
    ``n_sample_tokens``: the tokens scored, every ``n // n_sample_tokens``-th of ``x``; 4096, ModelOpt's count (64
    per calibration window, every window), was 512 (the reference's). Each (row, group) picks its clip on these
    tokens alone, and on 512 the pick follows the sample. With 4096, every token AWQ keeps, symmetric AWQ on the
    bundled model went 1.409e-2 -> 1.364e-2 at calibration seed 0 and 1.350e-2 -> 1.315e-2 at
    seed 1 (ModelOpt's awq_full: 1.358e-2); on pydoc-qwen3 1.631e-4 -> 1.648e-4 and 1.848e-4 -> 1.656e-4;
    asymmetric 1.142e-2 -> 1.139e-2 and 1.287e-4 -> 1.258e-4 (seed 0; docs/QUANTIZATION_COMPARISON.md, session 31).
    ``x``: ``[num_tokens, in]``, already divided by the AWQ scale if one was applied. Returns fp32 bounds
    ``[out, n_groups, 2]`` (low, high) for :func:`apply_clip`. Output rows are processed ``oc_batch`` at a time
    to bound memory.

    NOTE: a candidate's error is ``mean_t (x_t . d)^2 = d^T G d`` per (row, group), with ``d`` the group's rounding
    error (clipped and fake-quantized minus unquantized weights) and ``G = x^T x / t`` the group's Gram matrix over
    the sampled tokens, formed once in fp64: each candidate costs ``g^2`` per (row, group) whatever the number of
    tokens (``t g`` through the outputs; 64x less at 4096 tokens and g 64), and the difference of two nearly equal
    fp32 outputs is never taken.
    """
    if n_grid < 1 or n_sample_tokens < 1 or oc_batch < 1:
        raise ValueError(f"n_grid ({n_grid}), n_sample_tokens ({n_sample_tokens}) and oc_batch ({oc_batch}) "
                         "must be >= 1")
    if not 0 <= max_shrink <= 1:
        raise ValueError(f"max_shrink must lie in [0, 1], got {max_shrink}")
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight [out, in], got shape {tuple(weight.shape)}")
    out_f, in_f = weight.shape
    x = x.detach().reshape(-1, x.shape[-1]).float()
    if x.shape[1] != in_f:
        raise ValueError(f"inputs of {x.shape[1]} features do not match the weight's input dim {in_f}")
    if x.shape[0] == 0:
        raise ValueError("search_clip needs at least one calibration token")
    g = group_size_for(in_f, cfg.group_size)
    ng = in_f // g

    step = max(1, x.shape[0] // n_sample_tokens)
    xs = x[::step].reshape(-1, ng, g).permute(1, 0, 2).double()  # [ng, t, g]
    gram = torch.bmm(xs.transpose(1, 2), xs) / xs.shape[1]  # [ng, g, g]
    n_steps = max(1, math.ceil(n_grid * max_shrink - 1e-9))

    w_all = weight.detach().float().reshape(out_f, ng, g)
    best_all = []
    for o1 in range(0, out_f, oc_batch):
        w = w_all[o1:o1 + oc_batch]  # [ob, ng, g]
        ob = w.shape[0]
        org_max = w.abs().amax(dim=-1, keepdim=True)  # [ob, ng, 1]
        lo_0, hi_0 = w.amin(dim=-1, keepdim=True).clamp(max=0), w.amax(dim=-1, keepdim=True).clamp(min=0)
        best_lo, best_hi = -org_max, org_max.clone()
        min_err = torch.full_like(org_max, math.inf, dtype=torch.float64)
        candidates = [(-org_max * (1 - i / n_grid), org_max * (1 - i / n_grid)) for i in range(n_steps)]
        if not cfg.symmetric:  # i = 0 is the unclipped range again
            candidates += [(lo_0 * (1 - i / n_grid), hi_0 * (1 - i / n_grid)) for i in range(1, n_steps)]
        for lo, hi in candidates:
            cur = torch.maximum(torch.minimum(w, hi), lo)
            q = fake_quantize_groups(cur.reshape(ob, in_f), cfg).reshape(ob, ng, g)
            d = (q - w).permute(1, 0, 2).double()  # [ng, ob, g]
            err = (torch.bmm(d, gram) * d).sum(dim=-1).t().unsqueeze(-1)  # [ob, ng, 1]
            better = err < min_err
            min_err = torch.where(better, err, min_err)
            best_lo, best_hi = torch.where(better, lo, best_lo), torch.where(better, hi, best_hi)
        best_all.append(torch.cat([best_lo, best_hi], dim=-1))
    return torch.cat(best_all, dim=0)


def apply_clip(weight: Tensor, bounds: Tensor, group_size: int) -> Tensor:
    """Clamp each (row, group) of ``weight`` ``[out, in]`` to its bounds: ``[out, n_groups, 2]`` (low, high), as
    :func:`search_clip` returns them, or ``[out, n_groups]`` thresholds t for ``[-t, t]``; fp32 ``[out, in]``."""
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight [out, in], got shape {tuple(weight.shape)}")
    out_f, in_f = weight.shape
    g = group_size_for(in_f, group_size)
    if tuple(bounds.shape) not in ((out_f, in_f // g), (out_f, in_f // g, 2)):
        raise ValueError(f"clip bounds of shape {tuple(bounds.shape)} do not match weight {tuple(weight.shape)} "
                         f"with group_size {group_size} (expected {(out_f, in_f // g)} or {(out_f, in_f // g, 2)})")
    w = weight.float().reshape(out_f, in_f // g, g)
    b = bounds.float().to(w.device)
    lo, hi = (b[..., :1], b[..., 1:]) if b.dim() == 3 else (-b.unsqueeze(-1), b.unsqueeze(-1))
    return torch.maximum(torch.minimum(w, hi), lo).reshape(out_f, in_f)


# --------------------------------------------------------------------------------------------
# The pass
# --------------------------------------------------------------------------------------------
# How the scaled weights become codes: "nearest" (the reference: clip searched for rounding to nearest, then
# rounded) or "gptq" (GPTQ's error compensation on the scaled inputs' Hessian, no clip: the clip thresholds are
# chosen for rounding to nearest and cost accuracy under GPTQ, bundled model KL 7.0e-4 with them, 5.0e-4 without)
ROUNDINGS = ("nearest", "gptq")
MAX_TOKENS_KEPT = 4096  # calibration tokens kept per linear input for the searches (seeded subsample)
MAX_BLOCK_WINDOWS = 16  # calibration windows run through a block per scale candidate


class BlockRunner:
    """The output of the block a group of linears feeds, as AWQ's scale search minimises it.

    The block runs from the group's linears to the next linear that reads their results: for q/k/v
    that is (per-head norms, RoPE, attention, o_proj), for gate/up (silu_mul, down_proj). The calibration
    windows run packed in one step of the runtime's executor, so attention sees each window as its own
    sequence with its own positions (on the CPU the token-wise ops give each row what a window alone would,
    bit for bit). Called as ``block(x, weights)`` by ``search_scale`` with candidate weights.
    """

    def __init__(self, graph: Graph, members: list[int], value: str, start: int, end: int,
                 windows: list[torch.Tensor]) -> None:
        self.graph, self.members, self.value = graph, members, value
        self.nodes = graph.nodes[start:end + 1]
        self.output = graph.nodes[end].outputs[0]
        self.lengths = [w.shape[0] for w in windows]
        self.x = torch.cat(windows)
        self.layers = {n.attrs["layer"] for n in self.nodes if n.op == "attention"}
        # the whole model's layout: the block's attention indexes the cache by its global layer
        self.layout = kv_layout_of([asdict(n) for n in graph.nodes], getattr(torch, graph.meta.get("dtype", "float32")))

    @classmethod
    def for_group(cls, graph: Graph, members: list[int], value: str,
                  windows: list[torch.Tensor]) -> BlockRunner | None:
        end = _block_end(graph, members)
        if end is None or not windows:
            return None
        start = min(members)
        produced = {o for n in graph.nodes[start:end + 1] for o in n.outputs}
        needed = {i for n in graph.nodes[start:end + 1] for i in n.inputs} - produced
        if not needed <= {value, "positions"}:
            return None
        return cls(graph, members, value, start, end, windows)

    def __call__(self, x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
        params = dict(self.graph.params)
        for i, w in zip(self.members, weights):
            params[self.graph.nodes[i].weights["weight"]] = w.to(params[self.graph.nodes[i].weights["weight"]].dtype)
        sub = {"ir_version": self.graph.version, "outputs": [self.output], "meta": self.graph.meta,
               "nodes": [asdict(n) for n in self.nodes]}
        ex = Executor(sub, params)
        # every window in one step, packed back to back: the token-wise ops see all rows at once, attention
        # still runs per window over that window's own cache
        seqs = [SeqSlice(SequenceKV(self.layout, n, ex.device, layers=self.layers), 0, n) for n in self.lengths]
        positions = torch.cat([sequence_positions(ex.long_rope_from, 0, n, n, ex.device) for n in self.lengths])
        env = ex.start(StepInput(torch.empty(0, dtype=torch.long, device=ex.device), positions, seqs))
        env[self.value] = x.to(ex.dtype)
        ex.run_nodes(env, 0, len(self.nodes))
        return env[self.output].float()


def _block_end(graph: Graph, members: list[int]) -> int | None:
    """Index of the first linear downstream of the group, if reached before a residual add or norm."""
    frontier = {o for i in members for o in graph.nodes[i].outputs}
    for j in range(max(members) + 1, len(graph.nodes)):
        n = graph.nodes[j]
        if not any(i in frontier for i in n.inputs) or j in members:
            continue
        if n.op == "linear":
            return j
        if n.op in ("fused_add_rms_norm", "lm_head", "elementwise") or (n.op == "rms_norm" and not n.attrs.get("head_dim")):
            return None
        frontier.update(n.outputs)
    return None


@register
class AWQ(Int4Experts, QuantMethod):
    """Quantize linear weights to 4 bits (grouped; asymmetric unless ``symmetric``) after AWQ's activation-aware
    scaling and clipping; also the experts of mixture-of-experts layers (W4A16 experts, passes/moe_int4.py: each
    expert's clip searched and its scales refit on the calibration tokens routed to it, no activation scale)."""

    name = "awq"
    scheme = "w4a16"
    keep_expert_rows = MAX_KEPT_ROWS

    def configure(self, options: dict[str, Any]) -> None:
        self.cfg = QuantConfig(bits=4, group_size=int(options.get("group_size", 128)),
                               symmetric=bool(options.get("symmetric", False)))
        self.n_grid = int(options.get("n_grid", 20))
        self.rounding = options.get("rounding", "nearest")
        if self.rounding not in ROUNDINGS:
            raise PassError(f"awq: rounding {self.rounding!r} is not one of {', '.join(ROUNDINGS)}")
        self.damp = float(options.get("damp", 0.01))
        self.block_size = int(options.get("block_size", 128))
        self.clip = self.rounding == "nearest" and bool(options.get("clip", True))
        # defaults from the quantizer bench on the two trained fixtures (docs/QUANTIZATION_COMPARISON.md, session 17)
        self.duo = bool(options.get("duo_scaling", self.cfg.symmetric))
        self.scale_output = bool(options.get("scale_output", True))
        self.joint_clip = bool(options.get("joint_clip", False))
        self.refit = bool(options.get("refit_scales", True))
        if self.joint_clip and not self.clip:
            raise PassError("awq: joint_clip scores each scale candidate after its clip search; it needs the clip "
                            "search (clip: true, rounding: nearest)")
        self.duo_groups = 0  # groups whose best scale had the weight term
        self.configure_experts(options)
        self.expert_rounding = ("GPTQ-rounded" if self.rounding == "gptq" else
                                ("clip-searched, " if self.clip else "") + "rounded to nearest"
                                + (", scales refit" if self.refit else ""))
        self.alphas: dict[str, float] = {}
        self.block_objective: dict[str, bool] = {}  # group -> scale searched on the whole block's output

    def validate_node(self, graph: Graph, node: Node) -> None:
        check_group_size(graph, node, self.cfg.group_size, self.name)

    def observe(self, index: int, node: Node, x: torch.Tensor) -> None:
        kept = self.stats.setdefault(index, [])
        kept.append(x.detach().float().reshape(-1, x.shape[-1]))

    def _inputs(self, index: int) -> torch.Tensor:
        x = torch.cat(self.stats[index])
        if x.shape[0] > MAX_TOKENS_KEPT:
            x = x[torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))[:MAX_TOKENS_KEPT]]
        return x

    def apply_segment(self, graph: Graph, targets: list[int]) -> None:
        """Scale every group of the segment first (on float weights), then clip and quantize each linear."""
        producers = graph.producers()
        groups: dict[str, list[int]] = {}
        for i in targets:
            groups.setdefault(graph.nodes[i].inputs[0], []).append(i)
        inputs: dict[int, torch.Tensor] = {}
        hessians: dict[int, torch.Tensor] = {}
        for value, members in groups.items():
            if any(i not in self.stats for i in members):
                raise PassError(f"awq: no calibration statistics reached {graph.nodes[members[0]].source}")
            x = self._inputs(members[0])
            s = self._scale_group(graph, producers.get(value), value, members, x)
            for i in members:
                inputs[i] = x / s if s is not None else x
            if self.rounding == "gptq":  # the Hessian of the scaled input, over every calibration token
                acc = HessianAccumulator(x.shape[-1])
                for chunk in self.stats[members[0]]:
                    acc.add(chunk / s if s is not None else chunk)
                for i in members:
                    hessians[i] = acc.H
            elif self.refit:  # the refit's: the kept (scaled) inputs' second moments, once for the group
                xs = inputs[members[0]]
                H = xs.T @ xs
                for i in members:
                    hessians[i] = H
        for i in targets:
            self._clip_and_quantize(graph, graph.nodes[i], inputs[i], hessians.get(i))

    def _scale_group(self, graph: Graph, producer: Node | None, value: str, members: list[int],
                     x: torch.Tensor) -> torch.Tensor | None:
        """Search s for a group and fold it into whatever produced its input; None if nothing can absorb it.

        The lm_head's group is the lm_head alone, fed by the final norm: s folds into that norm's gain
        and is searched on the logits themselves (no block follows)."""
        fold, heads = _fold_target(graph, producer, value, members, self.scale_output)
        if fold is None:
            if any(graph.nodes[i].op == "lm_head" for i in members):
                log.warning("awq: the lm_head's input (%%%s) comes from no norm that can absorb a scale; the lm_head "
                            "is quantized without AWQ scaling (round to nearest, clip search kept)", value)
            return None
        weights = [graph.params[graph.nodes[i].weights["weight"]].float() for i in members]
        block = BlockRunner.for_group(graph, members, value, self.stats[members[0]][:MAX_BLOCK_WINDOWS])
        if block is not None:
            s, alpha, losses = search_scale(block.x, weights, block, self.cfg, self.n_grid, self.duo, heads,
                                            x if self.joint_clip else None)
        else:  # the group feeds no block we can run alone (e.g. down_proj): its own outputs
            s, alpha, losses = search_scale(x, weights, lambda xx, ws: torch.cat([xx @ w.T for w in ws], dim=-1),
                                            self.cfg, self.n_grid, self.duo, heads,
                                            x if self.joint_clip else None)
        self.duo_groups += int(min(range(len(losses)), key=losses.__getitem__) >= self.n_grid)
        self.alphas[graph.nodes[members[0]].source] = alpha
        self.block_objective[graph.nodes[members[0]].source] = block is not None
        fold(graph, s)
        for i, w in zip(members, weights):
            name = graph.nodes[i].weights["weight"]
            graph.params[name] = (w * s[None, :]).to(graph.params[name].dtype)
        return s

    def quantize_expert(self, role: str, e: int, w: torch.Tensor, stats: ExpertInputs):
        """An expert's weight as a linear of this section would be, minus the activation scale (nothing can absorb
        a per-expert one): :meth:`_round` on its kept routed rows and their Hessian."""
        return self._round(w, stats.rows(role, e) if self.clip else None, stats.hessian(role, e))

    def _round(self, w: torch.Tensor, x: torch.Tensor | None, H: torch.Tensor | None):
        """(codes, scales, zeros) of ``w``: its clip searched on inputs ``x`` and rounded to nearest, the scales refit
        on ``H`` (the clipped codes reproducing the unclipped weight's outputs); or GPTQ on ``H`` (``rounding:
        gptq``, no clip)."""
        if self.rounding == "gptq":
            res = gptq_quantize(w, H, self.cfg, block_size=self.block_size, damp=self.damp, refit=self.refit)
            return res.codes, res.scales, res.zeros
        clipped = apply_clip(w, search_clip(x, w, self.cfg), self.cfg.group_size) if self.clip else w
        codes, scales, zeros = quantize_groups(clipped, self.cfg)
        if self.refit:
            scales = refit_scales(w, codes, scales, zeros, H, self.cfg.group_size)
        return codes, scales, zeros

    def _clip_and_quantize(self, graph: Graph, node: Node, x: torch.Tensor, H: torch.Tensor | None) -> None:
        w = graph.params[node.weights["weight"]].float()
        codes, scales, zeros = self._round(w, x, H)
        self.replace_weight(graph, node, self.scheme, {"qweight": pack_int4(codes), "scales": scales, "zeros": zeros},
                            {"bits": 4, "group_size": self.cfg.group_size, "symmetric": self.cfg.symmetric}, reference=w)

    def summary(self, graph: Graph, targets: list[int]) -> dict[str, Any]:
        return {**super().summary(graph, targets), "group_size": self.cfg.group_size,
                "scaled_groups": len(self.alphas), "block_objective_groups": sum(self.block_objective.values()),
                "mean_alpha": sum(self.alphas.values()) / len(self.alphas) if self.alphas else 0.0,
                "duo_scaling": self.duo, "duo_groups": self.duo_groups, "rounding": self.rounding,
                "scale_output": self.scale_output, "joint_clip": self.joint_clip, "refit_scales": self.refit}


def _fold_target(graph: Graph, producer: Node | None, value: str, members: list[int], scale_output: bool = False):
    """How to divide a group's input by s, and the heads' shape when s must be shared across query heads: through
    the norm's gain, the rows of the linear whose output feeds silu_mul's `up` half, or (``scale_output``) the
    v projection's rows behind attention. (None, None) where nothing upstream can absorb it."""
    if producer is None:
        return None, None
    if scale_output and producer.op == "attention":
        found = v_projection_rows(graph.producers(), graph.users(), value)
        if found is None or not any(role in found[0].weights for role in ("weight", "scales")):
            return None, None
        lin, rows, heads = found

        def fold_v(graph: Graph, s: torch.Tensor) -> None:
            # v's row (g, d) takes the scale its query heads share. The v projection is quantized already (an
            # earlier segment): its per-(row, group) scales carry the division exactly, (q - z) * scale / s
            row_s = s.reshape(heads)[:, 0, :].reshape(-1)
            for role in ("weight", "scales", "bias"):
                if role in lin.weights:
                    t = graph.params[lin.weights[role]].float().clone()
                    t[rows] /= row_s.reshape(-1, *[1] * (t.dim() - 1))
                    graph.params[lin.weights[role]] = t.to(graph.params[lin.weights[role]].dtype)
        return fold_v, heads
    if norm_can_absorb(graph, producer, value, members):
        def fold_norm(graph: Graph, s: torch.Tensor) -> None:
            name = producer.weights["weight"]
            graph.params[name] = (graph.params[name].float() / s).to(graph.params[name].dtype)
        return fold_norm, None
    if producer.op == "silu_mul" and len(producer.inputs) == 1:
        gate_up = producer.inputs[0]

        def fold_up(graph: Graph, s: torch.Tensor) -> None:
            lin = graph.producers()[gate_up]
            assert "quant" not in lin.attrs, "awq scales a segment before quantizing any of it"
            name = lin.weights["weight"]
            w = graph.params[name].float()
            half = w.shape[0] // 2
            w = torch.cat([w[:half], w[half:] / s[:, None]])  # up rows: silu(g) * (u / s)
            graph.params[name] = w.to(graph.params[name].dtype)
            if "bias" in lin.weights:
                b = graph.params[lin.weights["bias"]].float()
                graph.params[lin.weights["bias"]] = torch.cat([b[:half], b[half:] / s]).to(b.dtype)
        return fold_up, None
    return None, None
