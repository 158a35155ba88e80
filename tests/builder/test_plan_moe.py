"""`builder plan` on mixture-of-experts configs: total and active parameters counted against the HF models' own
parameters, experts kept out of quantization and tensor parallelism."""

from __future__ import annotations

import json

import pytest
import torch

from builder.plan import PlanError, make_plan, read_model_shape, recipe_for_checkpoint

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2)
CASES = {  # model_type -> config on top of COMMON
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    # a shared expert, and layer 1 dense (mlp_only_layers)
    "qwen2_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48,
                      shared_expert_intermediate_size=80, mlp_only_layers=[1]),
}


def _hf_counts(model_type: str) -> tuple[int, int, torch.nn.Module]:
    """(parameters, idle expert parameters per token) of the HF model, built on meta from the same config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **COMMON, **CASES[model_type]))
    total = sum(p.numel() for p in model.parameters())
    idle = 0
    for module in model.modules():
        if hasattr(module, "gate_up_proj") and hasattr(module, "down_proj") and module.gate_up_proj.dim() == 3:
            per_expert = (module.gate_up_proj.numel() + module.down_proj.numel()) // module.gate_up_proj.shape[0]
            idle += (module.gate_up_proj.shape[0] - model.config.num_experts_per_tok) * per_expert
    return total, idle, model


def _checkpoint(tmp_path, model_type: str):
    path = tmp_path / model_type
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": model_type, **COMMON, **CASES[model_type]}))
    return path


@pytest.mark.parametrize("model_type", list(CASES))
def test_plan_counts_total_and_active_parameters(tmp_path, model_type):
    total, idle, model = _hf_counts(model_type)
    qkv_biases = sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.bias"))  # not planned
    plan = make_plan(recipe_for_checkpoint(_checkpoint(tmp_path, model_type), ["model.dtype=bfloat16"]))
    assert plan.num_parameters == total - qkv_biases and plan.num_active_parameters == total - qkv_biases - idle
    assert any(f"B active per token (top 2 of {plan.model.moe.num_experts} experts" in n for n in plan.notes)
    expert_bytes = 2 * sum(p.numel() for n, p in model.named_parameters()
                           if ".experts." in n or n.endswith("mlp.gate.weight"))  # bf16 experts and routers
    assert plan.weights_breakdown["experts"] == expert_bytes


def test_plan_counts_fp8_experts_and_their_tp_shares(tmp_path):
    shape = read_model_shape(_checkpoint(tmp_path, "qwen2_moe"))
    assert shape.moe.sparse_layers == (0, 2)
    plan = make_plan(recipe_for_checkpoint(tmp_path / "qwen2_moe", ["model.dtype=bfloat16", "quantization.algo=fp8"]))
    # per layer: q/k/v merged and o_proj; a sparse layer's shared expert gate/up, down and its gate; the dense
    # layer's gate/up and down
    assert plan.quantized_linears == {"fp8": 3 * 2 + 2 * 3 + 2}
    unquantized = make_plan(recipe_for_checkpoint(tmp_path / "qwen2_moe", ["model.dtype=bfloat16"]))
    e, h, inter = 6, 64, 48
    assert unquantized.weights_breakdown["experts"] == 2 * e * (3 * h * inter + h) * 2  # bf16 experts and routers
    # fp8 experts: e4m3 codes, an fp32 scale per output channel of each expert; the routers stay bf16
    assert plan.weights_breakdown["experts"] == 2 * e * (3 * h * inter + 4 * (2 * inter + h) + 2 * h)
    assert any("the experts of 2 of them in fp8" in n for n in plan.notes)
    only = make_plan(recipe_for_checkpoint(tmp_path / "qwen2_moe", ["model.dtype=bfloat16", "quantization.algo=fp8",
                                                                     "quantization.targets=[re:layers.(0|2).mlp$]"]))
    assert only.weights_breakdown["experts"] == plan.weights_breakdown["experts"]  # the sparse layers' experts alone
    assert only.quantized_linears == {}
    for off in (["quantization.experts=false"], ["quantization.ignore=[re:mlp$]"]):  # the experts stay bf16
        kept = make_plan(recipe_for_checkpoint(tmp_path / "qwen2_moe", ["model.dtype=bfloat16",
                                                                          "quantization.algo=fp8", *off]))
        assert kept.weights_breakdown["experts"] == unquantized.weights_breakdown["experts"], off
    # two ranks: each holds half of every expert's intermediate features, the routers whole
    two = make_plan(recipe_for_checkpoint(tmp_path / "qwen2_moe", ["model.dtype=bfloat16"]), tp_size=2)
    assert two.weights_breakdown["experts"] == 2 * e * (3 * h * inter // 2 + h) * 2
    with pytest.raises(PlanError, match=r"tp_size 5 does not divide the experts' intermediate size 48"):
        make_plan(recipe_for_checkpoint(tmp_path / "qwen2_moe", ["model.dtype=bfloat16"]), tp_size=5)


def test_plan_counts_w4a16_experts(tmp_path):
    """awq and 4-bit gptq sections quantize the experts to W4A16: packed codes (two a byte) and an fp32 scale and a
    uint8 zero point per group of each expert's rows; the routers stay bf16. 8-bit gptq leaves them bf16."""
    _checkpoint(tmp_path, "qwen2_moe")
    e, h, inter, g = 6, 64, 48, 16
    int4 = 2 * e * (3 * h * inter // 2 + 5 * (2 * inter * (h // g) + h * (inter // g)) + 2 * h)
    for algo in ("awq", "gptq"):
        plan = make_plan(recipe_for_checkpoint(tmp_path / "qwen2_moe", [
            "model.dtype=bfloat16", f"quantization.algo={algo}", f"quantization.group_size={g}"]))
        assert plan.weights_breakdown["experts"] == int4, algo
        assert any("the experts of 2 in w4a16" in n for n in plan.notes), plan.notes
    unquantized = make_plan(recipe_for_checkpoint(tmp_path / "qwen2_moe", ["model.dtype=bfloat16"]))
    eight = make_plan(recipe_for_checkpoint(tmp_path / "qwen2_moe", [
        "model.dtype=bfloat16", "quantization.algo=gptq", "quantization.bits=8", f"quantization.group_size={g}"]))
    assert eight.weights_breakdown["experts"] == unquantized.weights_breakdown["experts"]


def test_plan_counts_block_fp8_scales_per_block(tmp_path):
    """A fine-grained FP8 checkpoint (transformers' ``quant_method: fp8`` with ``weight_block_size``) is planned as the
    import stores it: e4m3 codes and one fp32 scale per bn x bk block of each projection (partial blocks included;
    a merged q/k/v stacks its members' row blocks), not one per output channel; the experts likewise, per expert."""
    bn, bk = 16, 32
    path = _checkpoint(tmp_path, "mixtral")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": [bn, bk]}
    (path / "config.json").write_text(json.dumps(config))
    plan = make_plan(recipe_for_checkpoint(path, ["model.dtype=bfloat16"]))

    def blocks(rows: int, cols: int) -> int:  # a weight's scales: whole blocks plus the partial last ones
        return ((rows + bn - 1) // bn) * ((cols + bk - 1) // bk)

    layers, e, h, inter, kv = 3, 8, 64, 112, 32  # head_dim 16: q 64 rows, k and v 32 each
    attention = (64 + 2 * kv) * h + h * h + 4 * (blocks(64, h) + 2 * blocks(kv, h) + blocks(h, h))
    assert plan.weights_breakdown["linears"] == layers * attention
    expert = 3 * h * inter + 4 * (2 * blocks(inter, h) + blocks(h, inter))  # gate, up; down
    assert plan.weights_breakdown["experts"] == layers * e * (expert + 2 * h)  # the router stays bf16
    assert layers * e * 4 * (2 * blocks(inter, h) + blocks(h, inter)) < layers * e * 4 * (2 * inter + h)  # per channel
    assert any("with a scale per 16 x 32 block (fp8_block)" in n for n in plan.notes), plan.notes
    assert any("fp8 (e4m3, a scale per 16 x 32 block)" in n for n in plan.notes), plan.notes
