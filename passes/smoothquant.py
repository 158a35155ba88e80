"""smoothquant: W8A8 INT8 with activation outliers migrated into the weights.

SmoothQuant (Xiao et al., 2023, "SmoothQuant: Accurate and Efficient Post-Training Quantization for
Large Language Models"; reference mit-han-lab/smoothquant). For linears fed by an RMSNorm (q/k/v
and gate/up), per input channel j:

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)

X is divided by s (folded into the norm's weight) and W's column j multiplied by s_j, which leaves
X W^T unchanged while flattening activation outliers. max|W_j| is taken over every linear reading
the same normed input. The down projection is smoothed through the up projection: its input is
silu(gate) * up, so dividing the up projection's output rows (and bias) by s divides it by s exactly;
it is smoothed only where that lowers its calibration error (a model without outliers there gains nothing).
With static activations the output projection is smoothed through the v projection the same way: attention is
linear in v, so dividing v's output row (kv head g, d) by s divides the attention output of every query head of
group g at d by s (with GQA the group's query heads share one scale). The v projection belongs to the previous
calibration segment, already quantized: its per-row weight scales (and bias) are divided instead, which is the
same up to rounding, and the live attention outputs are divided for the rest of calibration. Measured
(builder.devtools.smoothquant_ablation, both trained fixtures): static KL 5-9% lower; dynamic +5% / -1%, within
the calibration's noise. Opt-in (``smooth_output: true``): on the outlier variant of the bundled model it cut KL but
moved static greedy agreement from >= 6/8 to 5/8 prompts (tests/builder/test_outlier_gates.py), so it is not the
default until measured on more models.

alpha: given, that one; else (default) per group the alpha of ALPHA_GRID (static: STATIC_ALPHA_GRID, up to 0.9)
whose smoothed, quantized group has the least output error on up to SAMPLE_ROWS calibration rows,
``sum_i || X W_i^T - Q(X / s) Q(W_i s)^T ||^2`` (Q: the activations' quantization of the recipe; the weights'
per-channel INT8). Static, the search holds out the windows it samples rows from: each candidate's s and static
scale (max |X / s|) come from the other windows' maxima, so a candidate that fits the calibration maxima tightly
(alpha near 1 equalises every channel's max) pays for the rows that exceed them, as text after calibration does;
the winner's s is then recomputed from every window. Measured (``python -m builder.bench.quantizers``, session 19,
calibration seeds 0 / 1 / 2): pydoc-qwen3 3.02e-5 / 3.10e-5 / 3.26e-5 -> 2.48e-5 / 2.58e-5 / 2.66e-5,
pystdlib-llama 1.68e-4 / 1.68e-4 / 1.71e-4 -> 1.68e-4 / 1.67e-4 / 1.70e-4. The grid to 0.9 without holding out:
2.85e-5 / 3.19e-5 / 2.86e-5 (qwen3); to 1.0: 2.78e-5, 1.77e-4 (alpha 1.0 everywhere, as ModelOpt: 2.70e-5, 1.83e-4).
With ``lm_head: true`` the lm_head is smoothed the same way into the final norm (it is that norm's only
reader); where no norm can absorb the scales it is quantized without smoothing, with a warning.

Weights: per output channel, symmetric, scale = amax / 127 (not 127.5), codes in [-127, 127].
Activations: per-token dynamic scales (default), or a static per-tensor ``input_scale``. Static scales
(``static_scale``): "mse" clips: of the candidates max|X / s| * r / 127, r in (0.3 ... 1], the one whose
activation quantization error, carried through the quantized weight, is least on up to SAMPLE_ROWS calibration
rows, ``|| (Q(X / s) - X / s) W_q^T ||^2``; "max" takes r = 1 (no clipping); "auto" (default) searches the same
errors but takes the largest r (the least clipping) whose error is within one standard error of the least one's
(the one-standard-error rule of model selection; the standard error of the paired per-row difference between the
two candidates' errors, over the sampled rows). A clip is a bet that later text stays inside the range the clip
leaves: its gain on the calibration rows is spread over every row while its cost falls on the few rows it clamps,
so a gain those rows' spread cannot tell from noise does not pay for that bet. Measured (session 35,
``python -m builder.bench.quantizers``, calibration seeds 0 / 1; docs/QUANTIZATION_COMPARISON.md): pystdlib-llama
2.530e-3 / 2.222e-3 -> 2.375e-3 / 2.226e-3, pydoc-qwen3 2.484e-5 / 2.580e-5 -> 2.641e-5 / 2.603e-5 (the bundled
model's eval text drives its down projections' inputs to 1.2-2.1x the calibration maximum, where clipping costs
most; ModelOpt's static SmoothQuant at seed 0: 2.411e-3, 2.807e-5). Until session 35 "auto" was "mse". On the
outlier fixture (tests/passes/test_smoothquant_static.py) clipping cuts naive static W8A8's KL 8x (9.9e-3 vs
8.2e-2) and raises a smoothed build's slightly (2.1e-4 vs 2.0e-4); on the two trained fixtures it lowers a smoothed
build's (pydoc-qwen3 3.98e-5 -> 3.02e-5, pystdlib-llama 2.08e-4 -> 1.68e-4, ``python -m builder.bench.quantizers``,
session 17; until then "auto" clipped only unsmoothed builds). Choosing alpha with each candidate's own clipped
scale instead of max |X / s| was tried and gained nothing (3.18e-5, 1.68e-4).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kernels.torch_quant import INT8_MAX, quantize_activation_int8, quantize_weight_int8
from passes.base import PassError, register
from passes.ir import Graph, Node
from passes.quantize import QuantMethod, norm_can_absorb, v_projection_rows

log = logging.getLogger("passes.smoothquant")

SAMPLE_ROWS = 512  # calibration rows (tokens) kept per linear for the alpha and clipping searches
CLIP_STANDARD_ERRORS = 1.0  # static "auto": a clip must beat a lesser one by more than this many standard errors
ALPHA_GRID = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
STATIC_ALPHA_GRID = ALPHA_GRID + (0.9,)  # static activations: the held-out search (see the module docstring)
CLIP_RATIOS = tuple(1.0 - 0.05 * i for i in range(15))  # 1.0 ... 0.3


def smoothing_scales(act_max: torch.Tensor, weights: list[torch.Tensor], alpha: float,
                     heads: tuple[int, int, int] | None = None) -> torch.Tensor:
    """s: [in] from the activations' per-channel max |x| and the group's weights [out_i, in].

    ``heads`` = (num_kv_heads, group, head_dim): the input is attention's output, whose channel (kv head g, query
    head j of its group, d) can only be divided by a scale the group's query heads share (it is folded into the v
    projection's row (g, d)): maxima are taken over each group's query heads first."""
    w_max = torch.stack([w.float().abs().amax(dim=0) for w in weights]).amax(dim=0)
    a_max = act_max.float()
    if heads is not None:
        kv, group, dim = heads
        a_max, w_max = (t.reshape(kv, group, dim).amax(dim=1, keepdim=True).expand(kv, group, dim).reshape(-1)
                        for t in (a_max, w_max))
    s = a_max.clamp(min=1e-5).pow(alpha) / w_max.clamp(min=1e-5).pow(1 - alpha)
    return s.clamp(min=1e-5)


def within_standard_errors(errors: torch.Tensor, best: torch.Tensor, k: float) -> bool:
    """Whether the total of per-row ``errors`` exceeds ``best``'s (the same rows) by at most ``k`` standard errors
    of that total difference: sqrt(n) times the standard deviation of the per-row differences (paired rows)."""
    d = (errors - best).double()
    if d.numel() < 2:
        return bool(d.sum() <= 0)
    return float(d.sum()) <= k * float(d.std()) * d.numel() ** 0.5


@register
class SmoothQuant(QuantMethod):
    """Smooth activation outliers into the weights, then quantize linears to INT8 weights and activations."""

    name = "smoothquant"
    scheme = "w8a8_int8"

    def configure(self, options: dict[str, Any]) -> None:
        alpha = options.get("alpha")
        self.smoothing = bool(options.get("smoothing", True))
        self.static = options.get("activations", "dynamic") == "static"
        self.alphas = (STATIC_ALPHA_GRID if self.static else ALPHA_GRID) if alpha is None else (float(alpha),)
        self.chosen_alphas: list[float] = []  # per smoothed group
        self.static_scale = options.get("static_scale", "auto")
        self.smooth_output = bool(options.get("smooth_output", False))
        if self.static_scale not in ("auto", "mse", "max"):
            raise PassError(f"smoothquant: static_scale {self.static_scale!r} is not one of auto, mse, max")
        self.num_smoothed = 0
        self.num_smoothed_down = 0
        self.num_smoothed_out = 0  # output projections smoothed through the v projection
        self.clip_ratios: list[float] = []  # static "auto" / "mse": the ratio chosen per linear
        self.samples: dict[int, torch.Tensor] = {}  # calibration rows per linear, this segment (the searches)
        self.fit_max: dict[int, torch.Tensor] = {}  # static: per-channel max |x| of the windows not sampled

    def observe(self, index: int, node: Node, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1])
        amax = x.abs().float().amax(dim=0)  # [in]
        self.stats[index] = torch.maximum(self.stats[index], amax) if index in self.stats else amax
        kept = self.samples.get(index)
        need = SAMPLE_ROWS - (0 if kept is None else kept.shape[0])
        if (self.smoothing or self.static and self.static_scale != "max") and need > 0:  # up to 64 rows per window
            per_window = min(need, SAMPLE_ROWS // 8)
            take = x[:: max(1, x.shape[0] // per_window)][:per_window].float()
            self.samples[index] = take if kept is None else torch.cat([kept, take])
        elif self.static:  # a window none of whose rows were sampled: the alpha search's held-out statistics
            fit = self.fit_max.get(index)
            self.fit_max[index] = amax if fit is None else torch.maximum(fit, amax)

    def apply_segment(self, graph: Graph, targets: list[int]) -> None:
        producers, users = graph.producers(), graph.users()
        groups: dict[str, list[int]] = {}
        for i in targets:
            groups.setdefault(graph.nodes[i].inputs[0], []).append(i)
        # folded groups first: smoothing a down projection rescales the up projection's rows before that is quantized
        folds = {v: self._up_rows(producers, users, v) or (self._v_rows(graph, producers, users, v) if self.smooth_output else None)
                 for v in groups}
        for value in sorted(groups, key=lambda v: folds[v] is None):
            members = groups[value]
            if any(i not in self.stats for i in members):
                raise PassError(f"smoothquant: no calibration statistics reached {graph.nodes[members[0]].source}")
            act_max = torch.stack([self.stats[i] for i in members]).amax(dim=0)
            fold = folds[value] if self.smoothing else None
            if fold is not None:
                node = graph.nodes[members[0]]
                lin, rows, heads = fold
                s = self._search(act_max, [graph.params[node.weights["weight"]]], members, unsmoothed=True,
                                 heads=heads)
                if s is not None:
                    # the rows' divisor: v's row (g, d) takes the scale its group's query heads share
                    row_s = s if heads is None else s.reshape(heads)[:, 0, :].reshape(-1)
                    for role in self._row_roles(graph, lin):
                        t = graph.params[lin.weights[role]]
                        scaled = t.float().clone()
                        scaled[rows] /= row_s.reshape(-1, *[1] * (t.dim() - 1))
                        graph.params[lin.weights[role]] = scaled.to(t.dtype)
                    if heads is None:
                        self.num_smoothed_down += 1
                    else:  # the v projection ran in an earlier segment: its live output (attention's) follows
                        self.num_smoothed_out += 1
                        self.rescaled_values[value] = s
                self._quantize(graph, node, s, act_max, members[0])
                continue
            norm = producers.get(value)
            smooth = self.smoothing and norm_can_absorb(graph, norm, value, members)
            if self.smoothing and not smooth and any(graph.nodes[i].op == "lm_head" for i in members):
                log.warning("smoothquant: the lm_head's input (%%%s) comes from no norm that can absorb the smoothing "
                            "scales; the lm_head is quantized to W8A8 INT8 without smoothing", value)
            s = None
            if smooth:
                weights = [graph.params[graph.nodes[i].weights["weight"]] for i in members]
                s = self._search(act_max, weights, members)
                name = norm.weights["weight"]
                graph.params[name] = (graph.params[name].float() / s).to(graph.params[name].dtype)
                self.num_smoothed += 1
            for i in members:
                self._quantize(graph, graph.nodes[i], s, act_max, i)
        self.samples.clear()
        self.fit_max.clear()

    def _search(self, act_max: torch.Tensor, weights: list[torch.Tensor], members: list[int],
                unsmoothed: bool = False, heads: tuple[int, int, int] | None = None) -> torch.Tensor | None:
        """The group's smoothing scales: for each alpha candidate (and, ``unsmoothed``, none at all) the output
        error of the quantized group on the calibration rows; the least wins (one candidate: that one).

        Static, where some windows were not sampled (``fit_max``): each candidate is measured as it would be
        deployed on text it was not calibrated on: its scales and its static input scale (max |X / s|) come
        from those windows alone, the sampled rows are quantized with them (clamped where they exceed it), and
        the winner's scales are then taken from every window's maximum."""
        fit = None
        if self.static and all(i in self.fit_max for i in members):
            fit = torch.stack([self.fit_max[i] for i in members]).amax(dim=0)
        candidates = [(a, smoothing_scales(act_max, weights, a, heads),
                       None if fit is None else smoothing_scales(fit, weights, a, heads)) for a in self.alphas]
        if unsmoothed:
            candidates.append((None, None, None))
        x = self.samples.get(members[0])
        if len(candidates) > 1 and x is not None:
            ws = [w.float().to(x.device) for w in weights]
            refs = [x @ w.t() for w in ws]

            def error(s: torch.Tensor | None) -> float:
                s = torch.ones(x.shape[-1], device=x.device) if s is None else s.to(x.device)
                scale = None if fit is None else (fit.to(x.device) / s).amax().clamp(min=1e-8) / INT8_MAX
                xq = self._fake_x(x / s, scale)
                return sum(float((xq @ self._fake_w(w * s[None, :]).t() - ref).pow(2).sum())
                           for w, ref in zip(ws, refs))

            alpha, s, _ = min(candidates, key=lambda c: error(c[1] if fit is None else c[2]))
        else:
            alpha, s, _ = candidates[0]
        if alpha is not None:
            self.chosen_alphas.append(alpha)
        return s

    def _fake_x(self, x: torch.Tensor, input_scale: torch.Tensor | None = None) -> torch.Tensor:
        """x through the runtime's activation quantization: per token (dynamic), or per tensor with
        ``input_scale`` (static; default max |x| / 127)."""
        if self.static and input_scale is None:
            input_scale = x.abs().amax().clamp(min=1e-8) / INT8_MAX
        q, scale = quantize_activation_int8(x, input_scale if self.static else None)
        return q.float() * scale

    @staticmethod
    def _fake_w(w: torch.Tensor) -> torch.Tensor:
        q, scale = quantize_weight_int8(w)
        return q.float() * scale.to(w.device)[:, None]

    @staticmethod
    def _up_rows(producers: dict[str, Node], users: dict[str, list[Node]], value: str) -> tuple[Node, slice, None] | None:
        """Where ``value`` is a SwiGLU's output read by one linear alone: the (unquantized) up projection and its
        rows whose division by s divides ``value`` by s; else None."""
        mul = producers.get(value)
        if mul is None or mul.op != "silu_mul" or len(users.get(value, [])) != 1:
            return None
        source = mul.inputs[-1]  # [gate | up] merged, or up alone
        lin = producers.get(source)
        if lin is None or lin.op != "linear" or "weight" not in lin.weights or len(users.get(source, [])) != 1 \
                or lin.attrs.get("split_sizes"):
            return None
        out = lin.attrs["out_features"]
        return lin, slice(out // 2, out) if len(mul.inputs) == 1 else slice(0, out), None

    @staticmethod
    def _v_rows(graph: Graph, producers: dict[str, Node], users: dict[str, list[Node]],
                value: str) -> tuple[Node, slice, tuple[int, int, int]] | None:
        """:func:`passes.quantize.v_projection_rows`, where the v projection (already quantized, an earlier segment)
        keeps a per-row scale to divide."""
        found = v_projection_rows(producers, users, value)
        return found if found is not None and SmoothQuant._row_roles(graph, found[0]) else None

    @staticmethod
    def _row_roles(graph: Graph, lin: Node) -> list[str]:
        """The tensors of ``lin`` whose rows scale its output rows: the weight (or, quantized, a scale with one row
        per output feature) and the bias; [] when no such scale exists (a per-tensor one)."""
        out = lin.attrs["out_features"]
        scale = "weight" if "weight" in lin.weights else "weight_scale"
        t = graph.params.get(lin.weights.get(scale, ""))
        if t is None or t.dim() == 0 or t.shape[0] != out:
            return []
        return [scale] + (["bias"] if "bias" in lin.weights else [])

    def _quantize(self, graph: Graph, node: Node, s: torch.Tensor | None, act_max: torch.Tensor, index: int) -> None:
        w = graph.params[node.weights["weight"]].float()
        if s is not None:
            w = w * s[None, :]
            act_max = act_max / s
        q, scale = quantize_weight_int8(w)
        tensors = {"qweight": q, "weight_scale": scale}
        if self.static:
            x = self.samples.get(index)
            if x is not None and s is not None:
                x = x / s.to(x.device)
            wq = (q.float() * scale[:, None]).to(x.device) if x is not None else None
            clip = self.static_scale != "max"
            tensors["input_scale"] = self._static_scale(act_max.amax().clamp(min=1e-8), x if clip else None,
                                                        wq).reshape(1)
        self.replace_weight(graph, node, self.scheme, tensors,
                       {"activations": "static" if self.static else "dynamic", "smoothed": s is not None},
                            reference=w)

    def _static_scale(self, amax: torch.Tensor, x: torch.Tensor | None, wq: torch.Tensor | None) -> torch.Tensor:
        """The per-tensor input scale: amax / 127, or the clipped candidate whose activation rounding, carried
        through the quantized weight, costs least on the calibration rows ``x`` (already smoothed): "mse" the least,
        "auto" the least clipping within CLIP_STANDARD_ERRORS standard errors of the least (the module docstring).
        On ``amax``'s device, beside the weights it scales: the calibration forward of later segments runs the
        quantized linears on that device."""
        if x is None:
            return (amax / INT8_MAX).float()
        rows = {r: (self._fake_x(x, amax.to(x.device) * r / INT8_MAX) - x).matmul(wq.t()).pow(2).sum(dim=1)
                for r in CLIP_RATIOS}  # per calibration row
        best = min(CLIP_RATIOS, key=lambda r: float(rows[r].sum()))
        if self.static_scale == "auto":
            best = next(r for r in CLIP_RATIOS if within_standard_errors(rows[r], rows[best], CLIP_STANDARD_ERRORS))
        self.clip_ratios.append(best)
        return (amax * best / INT8_MAX).float()

    def summary(self, graph: Graph, targets: list[int]) -> dict[str, Any]:
        alphas = self.chosen_alphas
        out = {**super().summary(graph, targets), "alpha": "search" if len(self.alphas) > 1 else self.alphas[0],
               "smoothed_groups": self.num_smoothed, "smoothed_down_projections": self.num_smoothed_down,
               "smoothed_output_projections": self.num_smoothed_out}
        if len(self.alphas) > 1 and alphas:
            out["alpha_mean"] = round(sum(alphas) / len(alphas), 3)
        if self.static:
            out["static_scale"] = self.static_scale
            if self.clip_ratios:
                out["clip_ratio_mean"] = round(sum(self.clip_ratios) / len(self.clip_ratios), 3)
        return out
