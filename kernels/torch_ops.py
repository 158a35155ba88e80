"""Torch implementations of the IR's ops: what the runtime's executor runs on the CPU, and the reference
the Triton kernels of this package are tested against.

Each function takes the node's input tensors (``[num_tokens, features]``), its weights and its
attributes. Numerics follow the source models: norms in fp32 then cast back, rotary tables in fp32
cast to the activation dtype, attention in the activation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.torch_quant import dequantize_weight, quantize_activation_fp8


def embedding(ids: torch.Tensor, table: torch.Tensor, scale: float | torch.Tensor | None = None) -> torch.Tensor:
    # ids: [num_tokens] -> [num_tokens, hidden]. The scale is rounded to the table's dtype, as Gemma's
    # embed_scale.to(weight.dtype) is (sqrt(3072) = 55.43 is 55.5 in bf16); a 0-d tensor of that dtype on the
    # table's device is used as it is (no copy: what a CUDA graph replays)
    rows = F.embedding(ids, table)
    return rows if scale is None else rows * torch.as_tensor(scale, dtype=table.dtype, device=table.device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, head_dim: int | None = None,
             weight_offset: float = 0.0) -> torch.Tensor:
    # x: [num_tokens, features]; with head_dim, normalised per head of that size
    shape = x.shape
    if head_dim:
        x = x.view(shape[0], -1, head_dim)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None and weight_offset:  # Gemma's order: the gain (w + offset) in fp32, one rounding
        return (h * (weight.float() + weight_offset)).to(x.dtype).reshape(shape)
    out = h.to(x.dtype)  # Llama's order: rounded to the activation dtype, then the gain
    if weight is not None:
        out = weight * out
    return out.reshape(shape)


def xielu(x: torch.Tensor, alpha_p: torch.Tensor, alpha_n: torch.Tensor, beta: torch.Tensor,
          eps: torch.Tensor) -> torch.Tensor:
    # transformers' XIELUActivation (its Python path), the same expressions on the same tensors
    a_p = F.softplus(alpha_p)
    a_n = beta + F.softplus(alpha_n)
    return torch.where(x > 0, a_p * x * x + beta * x, (torch.expm1(torch.min(x, eps)) - x) * a_n + beta * x)


def position_scale(x: torch.Tensor, positions: torch.Tensor, beta: float, period: int) -> torch.Tensor:
    # x: [num_tokens, features]; each row times 1 + beta log(1 + floor(p / period)) (fp32, rounded to x's dtype)
    factor = 1.0 + beta * torch.log(1.0 + torch.floor(positions.to(torch.float32) / period))
    return x * factor.to(x.dtype)[:, None]


def layer_norm_heads(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                     head_dim: int) -> torch.Tensor:
    # x: [num_tokens, heads * head_dim], each head normalised in fp32, then a gain (and bias) of its own per head
    # ([heads, head_dim]: Command R+'s q/k LayerNorms) applied in fp32, one rounding
    shape = x.shape
    h = F.layer_norm(x.float().view(shape[0], -1, head_dim), (head_dim,), None, None, eps)
    if weight is not None:
        h = h * weight.float().view(-1, head_dim)
    if bias is not None:
        h = h + bias.float().view(-1, head_dim)
    return h.to(x.dtype).reshape(shape)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    # x: [num_tokens, features]; mean-centred and scaled in fp32, the gain and bias applied there too, one rounding
    # (what HF's nn.LayerNorm does inside the kernel, and Cohere's and OLMo's norms in their own fp32 code)
    w = weight.float() if weight is not None else None
    b = bias.float() if bias is not None else None
    return F.layer_norm(x.float(), (x.shape[-1],), w, b, eps).to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float,
                       weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + residual
    return rms_norm(total, weight, eps, None, weight_offset), total


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(logits / cap): scores or logits squashed into (-cap, cap) (Gemma 2)."""
    return torch.tanh(logits / cap) * cap


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                dtype: torch.dtype, interleaved: bool = False,
                long_from: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [num_tokens, rotary_dim] (rotary_dim = 2 * len(inv_freq)): each frequency twice, the halves
    side by side for the rotate-half layout, or pair by pair for the interleaved (GPT-J) one. LongRoPE's two tables:
    inv_freq [2, rotary_dim / 2]; a position p >= ``long_from`` is position p - long_from on the second (the caller
    offsets the positions of a sequence the second table rotates), the others are on the first."""
    if inv_freq.dim() == 2:
        if long_from is None:
            raise ValueError("two frequency tables (inv_freq [2, rotary_dim / 2]) need long_from")
        long = positions >= long_from
        inv_freq = torch.where(long[:, None], inv_freq[1][None, :], inv_freq[0][None, :])
        positions = torch.where(long, positions - long_from, positions)
    freqs = positions.to(torch.float32)[:, None] * inv_freq  # [num_tokens, rotary_dim / 2]
    emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, head_dim: int,
         rotary_dim: int | None = None, interleaved: bool = False) -> torch.Tensor:
    # x: [num_tokens, num_heads * head_dim]; cos, sin: [num_tokens, rotary_dim]. Features [rotary_dim, head_dim)
    # of each head pass through (partial rotary: StableLM, Phi-2, GPT-NeoX)
    xh = x.view(x.shape[0], num_heads, head_dim)
    rot = rotary_dim or head_dim
    xr = xh[..., :rot]
    if interleaved:  # pairs (x0, x1), (x2, x3), ... rotate: (-x1, x0, -x3, x2, ...)
        pairs = xr.unflatten(-1, (rot // 2, 2))
        rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    else:
        rotated = torch.cat((-xr[..., rot // 2:], xr[..., :rot // 2]), dim=-1)
    out = xr * cos[:, None, :] + rotated * sin[:, None, :]
    if rot < head_dim:
        out = torch.cat((out, xh[..., rot:]), dim=-1)
    return out.reshape(x.shape)


def attention_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_context: int, scale: float,
                  sliding_window: int | None, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of one sequence's new queries over its whole cache.

    q: [num_new, num_heads, head_dim]; k, v: [num_context + num_new, num_kv_heads, head_dim].
    Query i sits at position num_context + i and sees keys at positions <= its own (and, with a
    sliding window, > its own - window). ``softcap`` > 0: scores become softcap * tanh(scores / softcap) before the
    mask (Gemma 2); ``sinks`` [num_heads]: each head's sink logit joins its softmax's denominator (gpt-oss).
    """
    num_new, num_heads, head_dim = q.shape
    num_kv = k.shape[1]
    qh = q.transpose(0, 1)  # [num_heads, num_new, head_dim]
    kh = k.transpose(0, 1)  # [num_kv_heads, num_keys, head_dim]
    vh = v.transpose(0, 1)
    if num_kv != num_heads:
        kh = kh.repeat_interleave(num_heads // num_kv, dim=0)
        vh = vh.repeat_interleave(num_heads // num_kv, dim=0)
    if softcap or sinks is not None:
        out = _attention_capped(qh, kh, vh, _causal_mask(num_context, num_new, k.shape[0], sliding_window, q.device),
                                scale, softcap, sinks)
    elif num_context == 0 and not sliding_window:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
        mask = _causal_mask(num_context, num_new, k.shape[0], sliding_window, q.device)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out.transpose(0, 1).reshape(num_new, num_heads * head_dim)


def _causal_mask(num_context: int, num_new: int, num_keys: int, sliding_window: int | None,
                 device: torch.device) -> torch.Tensor:
    """[num_new, num_keys] bool: which keys each new query sees."""
    q_pos = torch.arange(num_context, num_context + num_new, device=device)[:, None]
    k_pos = torch.arange(num_keys, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window:
        mask &= k_pos > q_pos - sliding_window
    return mask


def _attention_capped(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, mask: torch.Tensor, scale: float,
                      softcap: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention written out, for what SDPA lacks: scores (in q's dtype, as the models' eager code computes them)
    soft-capped, softmax in fp32 with each head's sink logit in the denominator, probabilities rounded to v's dtype.
    qh: [num_heads, num_new, head_dim]; kh, vh: [num_heads, num_keys, head_dim]."""
    scores = torch.matmul(qh, kh.transpose(1, 2)) * scale  # [num_heads, num_new, num_keys]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.float().masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # exp(s - lse), lse over the scores and the sink: the sink takes its share, but has no value
        sink = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
        probs = torch.exp(scores - torch.logsumexp(torch.cat((scores, sink), dim=-1), dim=-1, keepdim=True))
    return torch.matmul(probs.to(vh.dtype), vh)


def activation(x: torch.Tensor, fn: str) -> torch.Tensor:
    if fn == "silu":
        return F.silu(x)
    if fn == "gelu":
        return F.gelu(x)
    if fn == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if fn == "relu":
        return F.relu(x)
    if fn == "sigmoid":
        return torch.sigmoid(x)
    if fn == "tanh":
        return torch.tanh(x)
    raise ValueError(f"unknown activation {fn!r}")


def silu_mul(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    if up is None:  # gate: [num_tokens, 2 * intermediate], the two halves side by side
        gate, up = gate.chunk(2, dim=-1)
    return F.silu(gate) * up


def moe_route(x: torch.Tensor, gate_weight: torch.Tensor, gate_bias: torch.Tensor | None, top_k: int,
              scoring: str = "softmax", norm_topk_prob: bool = True, select_bias: torch.Tensor | None = None,
              routed_scaling_factor: float = 1.0, router_fp32: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixture-of-experts router: (weights [T, top_k] fp32, experts [T, top_k] int64) of x [T, hidden].

    The logits in x's dtype (in fp32, x and gate_weight cast to it, when ``router_fp32``), their softmax (or
    sigmoid) in fp32, torch.topk's choice (its order and its tie-breaking) of the scores plus ``select_bias`` [E]
    (or [1, E]; added in fp32) where given (DeepSeek-V3's e_score_correction_bias: it picks the experts, the weights
    are the scores alone), renormalised to sum 1 when ``norm_topk_prob``, then times ``routed_scaling_factor``:
    Mixtral's, Qwen-MoE's, OLMoE's, GLM-4.5's, dots1's, ERNIE 4.5 MoE's, MiniMax-M2's and AFMoE's routers."""
    if router_fp32:
        x, gate_weight = x.float(), gate_weight.float()
        gate_bias = None if gate_bias is None else gate_bias.float()
    logits = F.linear(x, gate_weight, gate_bias)  # [T, num_experts]
    if scoring == "softmax":
        scores = torch.softmax(logits.float(), dim=-1)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(logits.float())
    else:
        raise ValueError(f"unknown router scoring {scoring!r}")
    if select_bias is None:
        weights, experts = torch.topk(scores, top_k, dim=-1)
    else:
        experts = torch.topk(scores + select_bias.float().reshape(-1), top_k, dim=-1)[1]
        weights = scores.gather(1, experts)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, experts


def expert_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None,
                  scales: torch.Tensor | None = None, zeros: torch.Tensor | None = None,
                  group_size: int = -1, block_size: tuple[int, int] | list[int] | None = None) -> torch.Tensor:
    """One expert projection, x [n, in] @ w [out, in]^T in x's dtype. With ``w_scale`` (FP8 experts, the ``moe``
    op's ``quant`` scheme fp8): w holds float8_e4m3fn codes with one fp32 scale per output channel, and the rows
    of x are quantized to FP8 per token (dynamic, scale = max|x_row| / 448) as the FP8 linears' are; the codes'
    products are summed in fp32, times both scales, rounded to x's dtype once. With ``scales`` / ``zeros`` (W4A16
    experts, scheme w4a16): w holds 4-bit codes packed two per byte [out, in / 2], ``scales`` fp32 / ``zeros`` uint8
    [out, in / group_size]; the weight is dequantized as a w4a16 linear's ((q - zero) * scale in fp32, rounded to
    x's dtype), then multiplied as an unquantized one. With ``block_size`` [bn, bk] (block-FP8 experts, scheme
    fp8_block): w holds e4m3 codes and ``w_scale`` fp32 [ceil(out / bn), ceil(in / bk)] one scale per block, and x is
    quantized per token and bk-wide group: the ``fp8_block`` linear's arithmetic (``kernels.torch_quant``)."""
    if block_size is not None:
        from kernels.torch_quant import make_quant_linear

        return make_quant_linear("fp8_block", {"qweight": w, "weight_scale": w_scale},
                                 {"block_size": list(block_size)}, x.dtype)(x)
    if scales is not None:
        return F.linear(x, dequantize_weight(w, scales, zeros, 4, group_size, x.dtype))
    if w_scale is None:
        return F.linear(x, w)
    xq, x_scale = quantize_activation_fp8(x, None)  # [n, in] codes, [n, 1] scales
    return ((xq.float() @ w.float().t()) * x_scale * w_scale.float()[None, :]).to(x.dtype)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert gating: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit), in
    gate's dtype (each op rounded, as transformers computes it)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def slots_by_expert(experts: torch.Tensor, num_experts: int):
    """(expert, its slots) for every expert with at least one: ``experts`` [T, top_k] routed experts, a slot ``s``
    being token ``s // top_k``'s routing slot ``s % top_k``; each expert's slots in order (one host read of the
    counts)."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # slots grouped by expert
    start = 0
    for e, n in enumerate(torch.bincount(flat, minlength=num_experts).tolist()):
        if n:
            yield e, order[start:start + n]
            start += n


def expert_activation(gate_up: torch.Tensor, activation_fn: str, swiglu_alpha: float = 0.0,
                      swiglu_limit: float = 0.0) -> torch.Tensor:
    """An expert's hidden rows from its gate/up projection's output (gate columns, then up): act(gate) * up, or
    :func:`clamped_swiglu` for ``clamped_swiglu``."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation_fn == "clamped_swiglu":
        return clamped_swiglu(gate, up, swiglu_alpha, swiglu_limit)
    return activation(gate, activation_fn) * up


def moe(x: torch.Tensor, gate_weight: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, top_k: int,
        scoring: str = "softmax", norm_topk_prob: bool = True, activation_fn: str = "silu",
        gate_bias: torch.Tensor | None = None, round_weights: bool = False,
        w_gate_up_scale: torch.Tensor | None = None, w_down_scale: torch.Tensor | None = None,
        b_gate_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None, swiglu_alpha: float = 0.0,
        swiglu_limit: float = 0.0, w_gate_up_scales: torch.Tensor | None = None,
        w_gate_up_zeros: torch.Tensor | None = None, w_down_scales: torch.Tensor | None = None,
        w_down_zeros: torch.Tensor | None = None, group_size: int = -1,
        block_size: tuple[int, int] | list[int] | None = None, select_bias: torch.Tensor | None = None,
        routed_scaling_factor: float = 1.0, router_fp32: bool = False) -> torch.Tensor:
    """The ``moe`` op: x [T, hidden] routed to its top_k experts, each expert run on the tokens routed to it.

    w_gate_up: [num_experts, 2 * intermediate, hidden] (gate rows, then up rows); w_down: [num_experts, hidden,
    intermediate]. Each (token, slot) pair's output is the expert's output times the slot's weight (fp32 unless
    ``round_weights``: rounded to x's dtype first, as Qwen-MoE and OLMoE do), and a token's slots are summed in
    slot order, in that product's dtype, then rounded to x's dtype once: transformers' grouped and batched experts.
    FP8 experts: w_gate_up / w_down hold float8_e4m3fn codes and ``w_gate_up_scale`` [num_experts, 2 *
    intermediate] / ``w_down_scale`` [num_experts, hidden] their per-channel fp32 scales; each projection's input
    rows are quantized per token (:func:`expert_linear`); with ``block_size`` [bn, bk] (block-FP8 experts) the
    scales are one per block, [num_experts, ceil(out / bn), ceil(in / bk)], and the rows are quantized per token and
    bk-wide group. The router stays in x's dtype.
    W4A16 experts (scheme w4a16): w_gate_up [E, 2 * intermediate, hidden / 2] and w_down [E, hidden, intermediate /
    2] hold uint8 4-bit codes packed two per byte along the input (low nibble = even input index), ``*_scales`` fp32
    and ``*_zeros`` uint8 [E, out, in / group_size] (group_size -1: one group per row) their groups' scales and zero
    points: each expert's weight is (q - zero) * scale in fp32 rounded to x's dtype, then used as an unquantized
    expert's (the layout of a w4a16 linear's qweight / scales / zeros, one per expert, stacked).
    Expert biases (gpt-oss): ``b_gate_up`` [num_experts, 2 * intermediate] and ``b_down`` [num_experts, hidden], each
    added to its projection's output in x's dtype. ``activation_fn`` "clamped_swiglu": :func:`clamped_swiglu` with
    ``swiglu_alpha`` and ``swiglu_limit`` instead of act(gate) * up. ``select_bias``, ``routed_scaling_factor``,
    ``router_fp32``: the router's (:func:`moe_route`).
    NOTE: the per-expert token counts are read on the host (one sync per call), so this cannot be captured in a
    CUDA graph.
    """
    num_tokens, hidden = x.shape
    weights, experts = moe_route(x, gate_weight, gate_bias, top_k, scoring, norm_topk_prob, select_bias,
                                 routed_scaling_factor, router_fp32)
    if round_weights:
        weights = weights.to(x.dtype)
    # slots: [T * top_k, hidden], row t * top_k + j = token t's slot j
    slots = torch.zeros(num_tokens * top_k, hidden, dtype=torch.promote_types(x.dtype, weights.dtype),
                        device=x.device)
    flat_weights = weights.reshape(-1)
    for e, rows in slots_by_expert(experts, w_gate_up.shape[0]):
        int4_up = {} if w_gate_up_scales is None else dict(scales=w_gate_up_scales[e], zeros=w_gate_up_zeros[e],
                                                           group_size=group_size)
        int4_down = {} if w_down_scales is None else dict(scales=w_down_scales[e], zeros=w_down_zeros[e],
                                                          group_size=group_size)
        gate_up = expert_linear(x[rows // top_k], w_gate_up[e], None if w_gate_up_scale is None else w_gate_up_scale[e],
                                block_size=block_size, **int4_up)
        if b_gate_up is not None:
            gate_up = gate_up + b_gate_up[e]
        h = expert_activation(gate_up, activation_fn, swiglu_alpha, swiglu_limit)
        out = expert_linear(h, w_down[e], None if w_down_scale is None else w_down_scale[e], block_size=block_size,
                            **int4_down)  # [n, hidden]
        if b_down is not None:
            out = out + b_down[e]
        slots[rows] = out * flat_weights[rows, None]
    return slots.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
