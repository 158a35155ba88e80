"""The ``moe`` op's torch implementation (kernels/torch_ops.py) against a per-token reference written out, and
against Hugging Face's own MoE blocks (Mixtral's, Qwen3-MoE's), with tied router scores, renormalisation on and
off, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import torch_ops as ops

NUM_EXPERTS, HIDDEN, INTER, TOKENS = 6, 32, 24, 40


def _weights(seed: int, dtype: torch.dtype = torch.float32):
    """Router and expert weights. Experts 0 and 1 (and 3 and 4) have the same router row, and x and the router hold
    small multiples of 1/8, so every token's logits tie exactly between them whatever the summation order; their
    own weights differ, so a wrong pick shows in the output."""
    gen = torch.Generator().manual_seed(seed)
    gate = torch.randint(-4, 5, (NUM_EXPERTS, HIDDEN), generator=gen) / 8
    gate[1], gate[4] = gate[0], gate[3]
    w_gate_up = torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.2
    w_down = torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen) * 0.2
    x = torch.randint(-4, 5, (TOKENS, HIDDEN), generator=gen) / 8
    return tuple(t.to(dtype) for t in (x, gate, w_gate_up, w_down))


def _has_split_ties(experts: torch.Tensor) -> bool:
    """Some token took one expert of a tied pair and not the other: the tie-breaking decided something."""
    return any(len({0, 1} & set(r)) == 1 or len({3, 4} & set(r)) == 1 for r in experts.tolist())


def per_token_reference(x, gate, w_gate_up, w_down, top_k, scoring, norm_topk_prob, bias=None):
    """One token at a time, in fp32: its scores, its top_k experts (torch.topk of its own row: HF's routers pick with
    torch.topk, whose tie-breaking is its own, neither the lower nor the higher index), each expert's SwiGLU MLP,
    the weighted sum over the slots in order."""
    out = []
    for row in x.float():
        logits = row @ gate.float().T + (bias.float() if bias is not None else 0)
        scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
        weights, experts = torch.topk(scores, top_k)
        if norm_topk_prob:
            weights = weights / weights.sum()
        total = torch.zeros(HIDDEN)
        for w, e in zip(weights.tolist(), experts.tolist()):
            g, u = (w_gate_up[e].float() @ row).chunk(2)
            total = total + w * (w_down[e].float() @ (F.silu(g) * u))
        out.append(total)
    return torch.stack(out)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_moe_matches_a_per_token_reference(scoring, norm_topk_prob, top_k):
    x, gate, w_gate_up, w_down = _weights(0)
    bias = torch.tensor([0.25, 0.25, -0.5, 0.125, 0.125, 0.0])  # the ties survive it
    weights, experts = ops.moe_route(x, gate, bias, top_k, scoring, norm_topk_prob)
    assert _has_split_ties(experts)
    out = ops.moe(x, gate, w_gate_up, w_down, top_k, scoring, norm_topk_prob, "silu", bias)
    ref = per_token_reference(x, gate, w_gate_up, w_down, top_k, scoring, norm_topk_prob, bias)
    assert out.shape == (TOKENS, HIDDEN) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    if norm_topk_prob:
        torch.testing.assert_close(weights.sum(-1), torch.ones(TOKENS))


def test_moe_routes_tied_scores_as_torch_topk_does():
    """Where two experts tie, the choice is torch.topk's over the whole batch, what HF's routers call: the
    runtime picks the same expert as the model, never its tied twin."""
    x, gate, w_gate_up, w_down = _weights(2)
    weights, experts = ops.moe_route(x, gate, None, 3, "softmax", True)
    scores = torch.softmax(F.linear(x, gate).float(), -1)
    assert torch.equal(experts, torch.topk(scores, 3, dim=-1).indices) and _has_split_ties(experts)
    for t in range(TOKENS):  # one token at a time (a decode step) picks as the whole batch did
        assert torch.equal(ops.moe_route(x[t:t + 1], gate, None, 3, "softmax", True)[1], experts[t:t + 1])


def _hf_block(model_type: str, norm_topk_prob: bool, implementation: str):
    from transformers import AutoConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = AutoConfig.for_model(model_type, hidden_size=HIDDEN, intermediate_size=INTER, moe_intermediate_size=INTER,
                                  num_local_experts=NUM_EXPERTS, num_experts=NUM_EXPERTS, num_experts_per_tok=2,
                                  norm_topk_prob=norm_topk_prob)
    config._experts_implementation = implementation
    return (MixtralSparseMoeBlock if model_type == "mixtral" else Qwen3MoeSparseMoeBlock)(config).eval()


@pytest.mark.parametrize("model_type,norm_topk_prob,round_weights", [
    ("mixtral", True, False),  # Mixtral always renormalises and keeps its routing weights in fp32
    ("qwen3_moe", True, True),  # Qwen-MoE rounds them to the activations' dtype
    ("qwen3_moe", False, True),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_matches_hf_blocks(model_type, norm_topk_prob, round_weights, dtype):
    x, gate, w_gate_up, w_down = _weights(3, dtype)
    out = ops.moe(x, gate, w_gate_up, w_down, 2, "softmax", norm_topk_prob, "silu", None, round_weights)
    for implementation in ("grouped_mm", "eager"):
        block = _hf_block(model_type, norm_topk_prob, implementation).to(dtype)
        with torch.no_grad():
            block.gate.weight.copy_(gate)
            block.experts.gate_up_proj.copy_(w_gate_up)
            block.experts.down_proj.copy_(w_down)
            expected = block(x[None])[0]
        if dtype == torch.float32:
            torch.testing.assert_close(out, expected, rtol=0, atol=2e-6)
        elif implementation == "grouped_mm":  # the same roundings in the same order
            torch.testing.assert_close(out, expected, rtol=0, atol=0)
        else:  # eager rounds each slot's product before summing: one bf16 rounding step apart at most
            torch.testing.assert_close(out.float(), expected.float(), rtol=2 ** -7, atol=2 ** -7)
    if dtype == torch.bfloat16 and model_type == "mixtral":  # fp32 weights: rounding them first is another result
        rounded = ops.moe(x, gate, w_gate_up, w_down, 2, "softmax", True, "silu", None, round_weights=True)
        assert not torch.equal(rounded, out)
