"""The executor's moe node: on the kernel path it runs ``kernels.moe.fused_moe`` (nothing read on the host), equal to
the torch path; on CUDA, an MoE artifact served with its steps replayed from CUDA graphs generates the CPU reference
path's greedy tokens. On CPU the kernels run under TRITON_INTERPRET=1."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from runtime.executor import GRAPH_IR_VERSION, Executor, StepInput  # noqa: E402

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 and no CUDA device", allow_module_level=True)
NUM_EXPERTS, HIDDEN, INTER, VOCAB = 8, 32, 48, 64


def _graph(attrs: dict, bias: bool, fp8: bool = False, int4: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
    """embedding -> moe: a graph whose output is the moe node's, with random bf16 weights (fp8: the experts as the
    fp8 pass stores them, e4m3 codes and per-channel scales; int4: as the awq / gptq passes store them, W4A16 codes
    in groups of 16 with scales and zero points, rounded to nearest)."""
    g = torch.Generator().manual_seed(len(attrs) + bias)
    params = {"embed": torch.randn(VOCAB, HIDDEN, generator=g),
              "router": torch.randn(NUM_EXPERTS, HIDDEN, generator=g) * HIDDEN ** -0.5 * 2,
              "w_gate_up": torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=g) * HIDDEN ** -0.5,
              "w_down": torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=g) * INTER ** -0.5}
    weights = {"gate_weight": "router", "w_gate_up": "w_gate_up", "w_down": "w_down"}
    if bias:
        params["router_bias"] = torch.randn(NUM_EXPERTS, generator=g) * 0.5
        weights["gate_bias"] = "router_bias"
    if fp8:
        from kernels.torch_quant import quantize_experts_fp8

        for role in ("w_gate_up", "w_down"):
            params[role], params[f"{role}_scale"] = quantize_experts_fp8(params[role])
            weights[f"{role}_scale"] = f"{role}_scale"
        attrs = {**attrs, "quant": {"scheme": "fp8", "activations": "dynamic", "weight_granularity": "channel"}}
    if int4:
        from passes.quant_math import QuantConfig, pack_int4, quantize_groups

        cfg = QuantConfig(4, -1, False)  # one group per row: INTER (48) is no multiple of 32
        for role in ("w_gate_up", "w_down"):
            parts = [quantize_groups(w, cfg) for w in params[role]]
            params[role] = torch.stack([pack_int4(c) for c, _, _ in parts])
            params[f"{role}.scales"] = torch.stack([sc for _, sc, _ in parts])
            params[f"{role}.zeros"] = torch.stack([z for _, _, z in parts])
            weights[f"{role}_scales"], weights[f"{role}_zeros"] = f"{role}.scales", f"{role}.zeros"
        attrs = {**attrs, "quant": {"scheme": "w4a16", "bits": 4, "group_size": -1, "symmetric": False}}
    nodes = [{"op": "embedding", "inputs": ["input_ids"], "outputs": ["h"], "weights": {"weight": "embed"},
              "attrs": {}},
             {"op": "moe", "inputs": ["h"], "outputs": ["y"], "weights": weights,
              "attrs": {"num_experts": NUM_EXPERTS, "intermediate_size": INTER, "activation": "silu", **attrs}}]
    graph = {"ir_version": GRAPH_IR_VERSION, "nodes": nodes, "outputs": ["y"], "meta": {"dtype": "bfloat16"}}
    keep = lambda name, t: not t.dtype.is_floating_point or t.dtype == torch.float8_e4m3fn or name.endswith(  # noqa: E731
        ("_scale", ".scales"))
    return graph, {name: t.to(DEVICE) if keep(name, t) else t.to(DEVICE, torch.bfloat16)
                   for name, t in params.items()}


@pytest.mark.parametrize("attrs,bias,fp8,int4", [
    (dict(top_k=2, scoring="softmax", norm_topk_prob=True), False, False, False),  # Mixtral's routing
    (dict(top_k=2, scoring="softmax", norm_topk_prob=False, round_weights=True), False, False, False),  # Qwen2-MoE's
    (dict(top_k=3, scoring="sigmoid", norm_topk_prob=True, round_weights=True), True, False, False),
    (dict(top_k=2, scoring="softmax", norm_topk_prob=True), False, True, False),  # FP8 experts
    (dict(top_k=2, scoring="softmax", norm_topk_prob=False, round_weights=True), False, False, True),  # W4A16 experts
])
def test_moe_node_runs_the_fused_kernel(attrs, bias, fp8, int4, monkeypatch):
    from kernels import moe

    calls = []
    fused = moe.fused_moe
    monkeypatch.setattr(moe, "fused_moe", lambda *a, **k: calls.append(1) or fused(*a, **k))
    graph, params = _graph(attrs, bias, fp8, int4)
    if int4:
        assert {"w_gate_up_scales", "w_down_zeros"} <= set(graph["nodes"][1]["weights"])
    ids = torch.randint(0, VOCAB, (19,), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    inp = StepInput(ids, torch.arange(19, device=DEVICE), [])
    ref = Executor(graph, params, use_kernels=False).forward(inp)
    assert not calls
    out = Executor(graph, params, use_kernels=True).forward(inp)
    assert len(calls) == 1 and out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs: CUDA only (TRITON_INTERPRET=0 on a GPU machine)")
@pytest.mark.parametrize("quantization", [{}, {"algo": "fp8"}], ids=["float", "fp8"])
def test_moe_artifact_serves_from_cuda_graphs(tmp_path, quantization):
    """A two-layer Qwen3-MoE artifact (fp32, head_dim 32, 8 experts, top-2; also built fp8: linears and experts)
    served on CUDA with its decode steps and the steps carrying prefill replayed from CUDA graphs: the CPU
    reference path's greedy tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from conftest import build_artifact, save_tokenizer
    from runtime import Engine, SamplingParams
    from runtime.serving import ServingConfig, ServingEngine

    ckpt = tmp_path / "ckpt"
    vocab = save_tokenizer(ckpt)
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3_moe", vocab_size=vocab, hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=8,
                                  num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
                                  max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.1 * torch.randn_like(p) + (1.0 if p.dim() == 1 else 0.0))
    model.save_pretrained(ckpt, safe_serialization=True)
    if quantization:
        from builder.pipeline import build
        from builder.recipe import validate_recipe

        path = build(validate_recipe({
            "name": "moe-fp8", "model": {"checkpoint": str(ckpt), "dtype": "float32"},
            "output_dir": str(tmp_path / "art"), "quantization": quantization, "gates": {"enabled": False},
            "runtime": {"max_seq_len": 256, "max_num_tokens": 64}})).output_dir
    else:
        path = build_artifact(ckpt, tmp_path / "art")
    cpu = Engine.load(path, use_kernels=False)
    srv = ServingEngine.load(path, "cuda", ServingConfig(max_num_seqs=4, kv_cache_bytes=64 << 20))
    assert srv.graphs is not None and srv.step_graphs is not None
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 12, 40)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for prompt, out in zip(prompts, srv.run(prompts, params)):
        assert out.token_ids == cpu.generate(prompt, params).token_ids
    srv.close()
