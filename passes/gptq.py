"""GPTQ: one-shot weight quantization with second-order error compensation (pure torch).

Frantar, Ashkboos, Hoefler, Alistarh (2022), "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers"; reference implementation IST-DASLab/gptq (``gptq.py``).

For a linear ``y = x W^T`` with calibration inputs X, GPTQ minimises ``||X W_hat^T - X W^T||^2`` row
by row. With the Hessian of that objective ``H = 2 X^T X / n`` (averaged over the n calibration
tokens), columns are quantized one at a time in a fixed order; after column i is rounded, its error
is spread over the not-yet-quantized columns through the inverse Hessian (the OBS update)::

    for each column i (in processing order):
        q_i   = quant(w_i)                       w_i: the error-updated column, all rows at once
        e_i   = (w_i - q_i) / U[i, i]            U = upper Cholesky factor of H^-1
        w_j  -= e_i * U[i, j]   for j > i        loss_i = (w_i - q_i)^2 / U[i, i]^2 / 2

Defaults (as the reference): dampening ``damp = 0.01`` x mean(diag(H)) added to the diagonal;
``H^-1`` by Cholesky, then the *upper* Cholesky factor of ``H^-1`` (numerically stable and what the
updates need); lazy batch updates in blocks of ``block_size = 128`` columns (errors are applied to
the columns beyond the block once per block); dead inputs (``H[i, i] == 0``, an input that was
always zero) get ``H[i, i] = 1`` and ``W[:, i] = 0``.

Groups: scale/zero of a group are computed (quant_math convention) on the error-updated weights
at the moment processing reaches the group's first column, so later groups see earlier groups'
error compensation (the exact current weights are used even when a group starts inside a block).
Per channel (``group_size = -1``) the parameters come from the whole weight, up front.

Act-order (the pass's default; ``act_order: false`` turns it off): columns are processed by descending ``diag(H)``
(most active inputs first).
Only *static groups* are supported with it: all group parameters are computed up front on the
(dead-zeroed) original weight, in original column order, and each column uses its original
group's parameters, so the stored layout is the plain ``[out, n_groups]`` one with no ``g_idx``;
the permutation is undone at the end. ``static_groups`` only matters with ``act_order``: without
act-order, groups are contiguous in processing order and always use the error-updated weights.

Scale refit (``refit_scales``, the pass's default): once every code is fixed, the group scales are re-solved by least
squares on the same objective, ``min_s (w - w_hat(s)) H (w - w_hat(s))^T`` per output row, where
``w_hat(s) = sum_k s_k (q_k - z_k)`` is linear in the row's group scales (:func:`refit_scales`). The codes were chosen
for the scales of the moment; the scales that best reproduce the row's outputs given those codes are found in
closed form, and a row keeps its old scales unless the new ones lower its objective. On the second trained fixture
(pydoc-qwen3, g64, asymmetric, no act-order) KL 4.689e-05 -> 4.534e-05 (docs/QUANTIZATION_COMPARISON.md, session 25).

This module is pure tensor math: the caller accumulates H (:class:`HessianAccumulator`) from the
linear's inputs and stores the :class:`GPTQResult`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from passes.base import PassError, register
from passes.ir import Graph, Node
from passes.quant_math import (QuantConfig, compute_qparams, dequantize, dequantize_groups, group_size_for,
                               pack_int4, quantize)
from passes.moe_int4 import ExpertInputs, Int4Experts
from passes.quant_math import HessianAccumulator
from passes.quantize import QuantMethod, check_group_size

__all__ = ["HessianAccumulator", "GPTQResult", "NotPositiveDefiniteError", "gptq_quantize", "refit_scales"]


class NotPositiveDefiniteError(ValueError):
    """The (dampened) Hessian is not positive definite."""


@dataclass
class GPTQResult:
    codes: Tensor  # uint8 [out, in]
    scales: Tensor  # fp32 [out, n_groups]
    zeros: Tensor  # uint8 [out, n_groups]
    loss: float  # sum over columns of the GPTQ objective's per-column losses (as the reference reports)
    w_hat: Tensor  # fp32 [out, in], the dequantized weight


def _inverse_cholesky_upper(H: Tensor, damp: float) -> Tensor:
    """Upper Cholesky factor of (H + damp * mean(diag H) * I)^-1."""
    n = H.shape[0]
    diag = torch.arange(n, device=H.device)
    H[diag, diag] += damp * torch.mean(torch.diag(H))
    hint = (f"the Hessian ({n}x{n}) is not positive definite even with damp={damp}: "
            "calibrate on more (or more varied) tokens, or use a larger damp")
    L, info = torch.linalg.cholesky_ex(H)
    if int(info) != 0:
        raise NotPositiveDefiniteError(hint)
    Hinv = torch.cholesky_inverse(L)
    U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
    if int(info) != 0 or not torch.isfinite(U).all():
        raise NotPositiveDefiniteError(hint)
    return U


REFIT_CHUNK_BYTES = 1 << 28  # the refit's [rows, n_groups, in] fp32 intermediate, at most this many bytes at a time


@torch.no_grad()
def refit_scales(weight: Tensor, codes: Tensor, scales: Tensor, zeros: Tensor, H: Tensor, group_size: int, *,
                 damp: float = 1e-6) -> Tensor:
    """Least-squares group scales for fixed codes: per output row, the scales ``s`` ``[n_groups]`` minimising
    ``(w - w_hat) H (w - w_hat)^T`` with ``w_hat = (q - z) * s`` per group, i.e. the row's output error on inputs
    whose second moment is ``H`` ``[in, in]``.

    The objective is quadratic in ``s``: with ``c = q - z`` split by group, ``A[k, l] = c_k H_kl c_l^T`` and
    ``b[k] = c_k (H w^T)_k``, the minimiser solves ``A s = b`` (solved in float64, ``A``'s diagonal raised by
    ``damp`` x its mean). A row keeps its old scales unless the solution is finite, positive and lowers the row's
    objective; codes and zero points are not changed. ``weight``, ``codes``, ``zeros``: ``[out, in]`` /
    ``[out, n_groups]`` as :func:`passes.quant_math.dequantize_groups` reads them. Returns fp32 ``[out, n_groups]``.
    """
    if weight.dim() != 2 or codes.shape != weight.shape:
        raise ValueError(f"refit_scales: codes {tuple(codes.shape)} must match the weight {tuple(weight.shape)}")
    out_f, in_f = weight.shape
    g = group_size_for(in_f, group_size)
    ng = in_f // g
    if tuple(scales.shape) != (out_f, ng) or tuple(zeros.shape) != (out_f, ng):
        raise ValueError(f"refit_scales: scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} must be "
                         f"{(out_f, ng)}")
    if tuple(H.shape) != (in_f, in_f):
        raise ValueError(f"refit_scales: H {tuple(H.shape)} must be {(in_f, in_f)}")
    W = weight.detach().float()
    H = H.detach().float().to(W.device)
    C = codes.float().to(W.device) - zeros.float().to(W.device).repeat_interleave(g, dim=1)
    old = scales.detach().float().to(W.device)
    new = old.clone()
    H_rows = H.reshape(ng, g, in_f)
    rows = max(1, REFIT_CHUNK_BYTES // (4 * ng * in_f))
    eye = torch.eye(ng, dtype=torch.float64, device=W.device)
    for r1 in range(0, out_f, rows):
        c, w, s0 = C[r1:r1 + rows], W[r1:r1 + rows], old[r1:r1 + rows]
        n = c.shape[0]
        cg = c.reshape(n, ng, g)
        D = torch.einsum("okg,kgi->oki", cg, H_rows)  # c_k H_k: [n, ng, in]
        A = torch.einsum("oklg,olg->okl", D.reshape(n, ng, ng, g), cg).double()
        b = (D * w[:, None, :]).sum(-1).double()
        A = A + damp * A.diagonal(dim1=1, dim2=2).mean(-1).clamp(min=1e-30)[:, None, None] * eye
        sol, info = torch.linalg.solve_ex(A, b.unsqueeze(-1))
        sol = sol.squeeze(-1).float()
        ok = (info == 0) & torch.isfinite(sol).all(-1) & (sol > 0).all(-1)
        sol = torch.where(ok[:, None], sol, s0)

        def objective(s: Tensor) -> Tensor:
            d = w - c * s.repeat_interleave(g, dim=1)
            return ((d @ H) * d).sum(-1)

        new[r1:r1 + rows] = torch.where((objective(sol) < objective(s0))[:, None], sol, s0)
    return new


@torch.no_grad()
def gptq_quantize(weight: Tensor, H: Tensor, cfg: QuantConfig, *, block_size: int = 128, damp: float = 0.01,
                  act_order: bool = False, static_groups: bool = True, refit: bool = False) -> GPTQResult:
    """Quantize ``weight`` ``[out, in]`` with GPTQ given the input Hessian ``H`` ``[in, in]``; ``refit``: then
    re-solve the group scales for the final codes on the undamped ``H`` (:func:`refit_scales`).

    Neither argument is modified. Raises ``ValueError`` on bad shapes or options and
    :class:`NotPositiveDefiniteError` (a ``ValueError``) when the Cholesky factorisation fails.
    """
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight [out, in], got shape {tuple(weight.shape)}")
    out_f, in_f = weight.shape
    if tuple(H.shape) != (in_f, in_f):
        raise ValueError(f"Hessian shape {tuple(H.shape)} does not match the weight's input dim {in_f}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not damp >= 0:
        raise ValueError(f"damp must be >= 0, got {damp}")
    if act_order and not static_groups:
        raise ValueError("act_order is only supported with static groups (static_groups=True): the storage "
                         "layout has no g_idx for columns whose group changes with the permutation")
    g = group_size_for(in_f, cfg.group_size)
    ng = in_f // g
    per_channel = ng == 1

    W = weight.detach().float().clone()
    H = H.detach().float().clone().to(W.device)
    if not torch.isfinite(H).all():
        raise ValueError("the Hessian has non-finite entries (inf/NaN in the calibration activations?)")
    if not torch.isfinite(W).all():
        raise ValueError("the weight has non-finite entries")

    dead = torch.diag(H) == 0
    W[:, dead] = 0
    # the refit's objective: the original weight (dead inputs zeroed) on the undamped H
    W_refit, H_refit = (W.clone(), H.clone()) if refit else (None, None)
    H[dead, dead] = 1

    scales = torch.empty(out_f, ng, dtype=torch.float32, device=W.device)
    zeros = torch.empty(out_f, ng, dtype=torch.float32, device=W.device)
    precomputed = per_channel or act_order  # all group params known before the loop
    if precomputed:
        for k in range(ng):
            s, z = compute_qparams(W[:, k * g:(k + 1) * g], cfg)
            scales[:, k], zeros[:, k] = s[:, 0], z[:, 0]

    perm = None
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True, stable=True)
        W = W[:, perm]
        H = H[perm][:, perm]
        group_of = (perm // g).tolist()  # processing position -> original group
    else:
        group_of = [j // g for j in range(in_f)]

    Hinv = _inverse_cholesky_upper(H, damp)
    del H

    Q = torch.zeros_like(W)  # codes, in processing order
    losses = torch.zeros(out_f, dtype=torch.float64, device=W.device)

    for i1 in range(0, in_f, block_size):
        i2 = min(i1 + block_size, in_f)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            j = i1 + i
            if not precomputed and j % g == 0:
                # The group's current weights: inside the block from W1; beyond it, W plus the
                # block's pending (lazy) update from the columns already quantized.
                end = j + g
                cur = W1[:, i:min(end, i2) - i1]
                if end > i2:
                    rest = W[:, i2:end] - Err1 @ Hinv[i1:i2, i2:end]
                    cur = torch.cat([cur, rest], dim=1)
                s, z = compute_qparams(cur, cfg)
                scales[:, j // g], zeros[:, j // g] = s[:, 0], z[:, 0]
            k = group_of[j]
            s, z = scales[:, k], zeros[:, k]
            w = W1[:, i]
            d = Hinv1[i, i]
            q = quantize(w, s, z, cfg.bits)
            Q[:, j] = q
            diff = w - dequantize(q, s, z)
            losses += (diff * diff / (d * d) / 2).double()
            err = diff / d
            W1[:, i:] -= err[:, None] @ Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]

    if perm is not None:
        Q = Q[:, torch.argsort(perm)]
    codes = Q.to(torch.uint8)
    zeros_u8 = zeros.to(torch.uint8)
    if refit:
        scales = refit_scales(W_refit, codes, scales, zeros_u8, H_refit, g)
    w_hat = dequantize_groups(codes, scales, zeros_u8, g)
    return GPTQResult(codes=codes, scales=scales, zeros=zeros_u8, loss=float(losses.sum()), w_hat=w_hat)


# --------------------------------------------------------------------------------------------
# The pass
# --------------------------------------------------------------------------------------------
@register
class GPTQ(Int4Experts, QuantMethod):
    """Quantize linear weights to 4 or 8 bits with GPTQ's Hessian-aware error compensation; with 4 bits, also the
    experts of mixture-of-experts layers (W4A16 experts, passes/moe_int4.py: each expert's GPTQ on the Hessian of the
    calibration tokens routed to it)."""

    name = "gptq"
    expert_rounding = "GPTQ"

    def configure(self, options: dict[str, Any]) -> None:
        self.cfg = QuantConfig(bits=int(options.get("bits", 4)), group_size=int(options.get("group_size", 128)),
                               symmetric=bool(options.get("symmetric", False)))
        self.scheme = "w4a16" if self.cfg.bits == 4 else "w8a16"
        self.block_size = int(options.get("block_size", 128))
        self.damp = float(options.get("damp", 0.01))
        # static act-order by default: it costs nothing at run time (the groups stay contiguous) and took KL down 9%
        # (pydoc-qwen3) and 23% (the bundled model) at g64, docs/QUANTIZATION_COMPARISON.md session 25; llm-compressor's
        # GPTQ defaults to it too
        self.act_order = bool(options.get("act_order", True))
        self.refit = bool(options.get("refit_scales", True))
        # true_sequential: each linear's Hessian on inputs through the quantized linears before it in its layer
        # (o_proj after the quantized q/k/v, down after gate/up). Off by default: on the two fixtures it moved KL by
        # -3.6% to +4.6% by row, within the spread of a thread count (docs/QUANTIZATION_COMPARISON.md, session 38)
        self.true_sequential = bool(options.get("true_sequential", False))
        self.total_loss = 0.0
        self.configure_experts(options)
        if self.cfg.bits != 4:
            if self.experts:
                raise PassError(f"gptq: experts: true needs bits 4 (W4A16 experts); bits is {self.cfg.bits}")
            self.experts = False
            self.experts_left = "gptq quantizes experts with bits 4 only (W4A16 experts); this section has bits 8"

    def quantize_expert(self, role: str, e: int, w: torch.Tensor, stats: ExpertInputs):
        res = gptq_quantize(w, stats.hessian(role, e), self.cfg, block_size=self.block_size, damp=self.damp,
                            act_order=self.act_order, static_groups=True, refit=self.refit)
        self.total_loss += float(res.loss)
        return res.codes, res.scales, res.zeros

    def validate_node(self, graph: Graph, node: Node) -> None:
        check_group_size(graph, node, self.cfg.group_size, self.name)

    def observe(self, index: int, node: Node, x: torch.Tensor) -> None:
        if index not in self.stats:
            self.stats[index] = HessianAccumulator(x.shape[-1])
        self.stats[index].add(x)

    def quantize_node(self, graph: Graph, node: Node, stats: Any) -> None:
        if stats is None or stats.num_tokens == 0:
            raise PassError(f"gptq: no calibration tokens reached {node.source}")
        w = graph.params[node.weights["weight"]]
        res = gptq_quantize(w, stats.H, self.cfg, block_size=self.block_size, damp=self.damp,
                            act_order=self.act_order, static_groups=True, refit=self.refit)
        self.total_loss += float(res.loss)
        codes = pack_int4(res.codes) if self.cfg.bits == 4 else res.codes
        self.replace_weight(graph, node, self.scheme, {"qweight": codes, "scales": res.scales, "zeros": res.zeros},
                            {"bits": self.cfg.bits, "group_size": self.cfg.group_size,
                             "symmetric": self.cfg.symmetric, "act_order": self.act_order}, reference=w)

    def summary(self, graph: Graph, targets: list[int]) -> dict[str, Any]:
        return {**super().summary(graph, targets), "bits": self.cfg.bits, "group_size": self.cfg.group_size,
                "gptq_loss": self.total_loss, "refit_scales": self.refit}
