"""The tracer's experts recognition (passes/trace.py ``trace_experts``): experts modules found by their layout
attributes, and one the moe op does not cover refused with one line saying what it has."""

from __future__ import annotations

import pytest
import torch

from passes.lift import LiftError
from passes.trace import EXPERTS_IMPLEMENTATION, build_meta_model, trace_experts


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
