"""The tracer's experts recognition (passes/trace.py ``trace_experts``): experts modules found by their layout
attributes, and one the moe op does not cover refused with one line saying what it has; its routers with a selection
bias (``trace_routers``), a group-limited choice refused."""

from __future__ import annotations

import pytest
import torch

from passes.lift import LiftError
from passes.trace import EXPERTS_IMPLEMENTATION, build_meta_model, trace_experts, trace_routers


def _meta_model(model_type: str = "qwen3_moe") -> torch.nn.Module:
    from transformers import AutoConfig

    return build_meta_model(AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, intermediate_size=48,
                                                 num_hidden_layers=2, num_attention_heads=4, num_experts=4,
                                                 num_experts_per_tok=2, moe_intermediate_size=16))


def test_experts_modules_are_found_by_layout_and_traced_as_one_node():
    model = _meta_model()
    experts = [m for _, m in model.named_modules() if hasattr(m, "llm_builder_activation")]
    assert len(experts) == 2 and all(m.llm_builder_activation == "silu" for m in experts)
    assert all(m.config._experts_implementation == EXPERTS_IMPLEMENTATION for m in experts)
    assert trace_experts(_meta_model("llama")) == 0


@pytest.mark.parametrize("change,message", [
    (lambda m: setattr(m, "has_bias", True), r"have biases: the moe op takes experts stored as gate_up_proj"),
    (lambda m: setattr(m, "is_transposed", True), r"have weights stored transposed \(\[experts, in, out\]\)"),
    (lambda m: setattr(m, "act_fn", torch.nn.Tanh()), r"have an activation \(Tanh\) other than silu, gelu"),
])
def test_experts_the_moe_op_does_not_cover_are_refused(change, message):
    model = _meta_model()
    change(model.get_submodule("model.layers.1.mlp.experts"))
    where = r"the experts at 'model\.layers\.1\.mlp\.experts' \(Qwen3MoeExperts\) "
    with pytest.raises(LiftError, match=where + message):
        trace_experts(model)


def _glm4_moe(**routing) -> torch.nn.Module:
    from transformers import AutoConfig

    return build_meta_model(AutoConfig.for_model("glm4_moe", vocab_size=64, hidden_size=32, intermediate_size=48,
                                                 num_hidden_layers=1, num_attention_heads=4, head_dim=8,
                                                 first_k_dense_replace=0, n_routed_experts=8, num_experts_per_tok=2,
                                                 moe_intermediate_size=16, **routing))


def test_routers_with_a_selection_bias_trace_as_one_node():
    from passes.trace import _grouped_router_forward

    # n_group 1, or every group kept (topk_group == n_group): the choice is among all experts
    for routing in ({}, dict(n_group=2, topk_group=2)):
        router = _glm4_moe(**routing).get_submodule("model.layers.0.mlp.gate")
        assert router.forward.__func__ is _grouped_router_forward
    assert trace_routers(_meta_model()) == 0  # Qwen3-MoE's router has no selection bias


def test_a_group_limited_choice_is_refused():
    with pytest.raises(LiftError, match=r"the router at 'model\.layers\.0\.mlp\.gate' \(Glm4MoeTopkRouter\) limits "
                                        r"each token's experts to the best topk_group=1 of n_group=2 expert groups"):
        _glm4_moe(n_group=2, topk_group=1)
