"""The executor's kernel path (what runs on CUDA) on graphs with LayerNorm, partial and interleaved rotary, a scaled
lm_head, learned position embeddings, soft-capped attention and logits, attention sinks, LongRoPE's two rotary
tables, Nemotron's (1 + w) LayerNorm gain, Persimmon's per-head LayerNorm, NanoChat's negated rotary, Ministral 3's
query temperature, Apertus's xIELU, gpt-oss's experts (biases, clamped SwiGLU) and GLM-4.5's router (a selection
bias, a scaling factor): ops without a Triton kernel run their torch reference there, LayerNorm runs its kernel with
the residual add before it, partial and interleaved rotary are fused into the attention's KV write as whole-head
rotary is, the paged attention kernels soft-cap and add the sinks, and the serving engine on the kernels generates
the reference path's tokens. On CPU the kernels run under TRITON_INTERPRET=1; on a GPU machine (TRITON_INTERPRET=0)
the kernel path runs on CUDA, from CUDA graphs, against the CPU reference."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from conftest import build_artifact, save_tokenizer  # noqa: E402
from runtime import Engine, SamplingParams  # noqa: E402
from runtime.serving import ServingConfig, ServingEngine  # noqa: E402

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("compiled Triton needs CUDA (or TRITON_INTERPRET=1)", allow_module_level=True)

# head_dim 32, which the paged attention kernels take; one layer: the ops, not depth, are under test
SHAPE = dict(hidden_size=64, intermediate_size=112, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
             max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=2)
ONE_SLIDING = dict(sliding_window=8, layer_types=["sliding_attention"])  # prompts of 40 tokens pass the window
FAMILIES = {  # model_type -> (config on top of SHAPE, whether RoPE is fused into the KV write)
    "stablelm": ({}, True),  # layer_norm with bias, rotary on 8 of 32 features per head
    "cohere": ({}, True),  # layer_norm without bias, interleaved rotary, lm_head scale
    "phi": ({}, True),  # parallel attention and MLP on one layer_norm, rotary on half of each head
    "gpt_neox": ({}, True),  # q/k/v fused per head, rotary on a quarter of each head, two layer_norms
    "gpt2": ({}, False),  # an embedding of the positions (the paged steps' own), no rotary at all
    # LayerNorm1P: the layer_norm kernels (alone and after the residual add) with the (1 + w) gain, squared ReLU
    "nemotron": (dict(head_dim=32), True),
    # rotary by minus the angle (negated frequencies through the rope kernel: the q/k norms after it keep it apart
    # from the KV write), RMSNorm without gains
    "nanochat": ({}, False),
    # the query temperature per position (period 4 tokens: the prompts and the decode steps cross it), YaRN rotary
    "ministral3": (dict(head_dim=32, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 4,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}),
        False),
    "persimmon": ({}, True),  # LayerNorm over each head's features (q/k norms, the layer_norm kernel on rows of 32)
    "apertus": (dict(head_dim=32), True),  # the xIELU activation (torch ops on CUDA too), per-head q/k RMSNorm
    # scores and logits soft-capped (caps that bend these tiny models' values), a sliding window
    "gemma2": (dict(ONE_SLIDING, head_dim=32, attn_logit_softcapping=1.0, final_logit_softcapping=2.0), True),
    # attention sinks, rotary on each head's halves, experts with biases and the clamped SwiGLU (the fused moe
    # kernels); no q/k/v biases, which at 1 + noise would make every query see the same scores
    "gpt_oss": (dict(ONE_SLIDING, head_dim=32, attention_bias=False, num_local_experts=4, num_experts_per_tok=2),
                True),
    # GLM-4.5's router: experts chosen by sigmoid scores plus a selection bias (a random buffer), weighted by the
    # scores alone, times routed_scaling_factor, logits in fp32 (the fused moe kernels' routing and sum)
    "glm4_moe": (dict(head_dim=32, first_k_dense_replace=0, n_routed_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=48, routed_scaling_factor=2.5), True),
    # LongRoPE (Phi-3.5 / Phi-4-mini): two rotary tables, the switch at 6 tokens: the 5-token prompt grows past it
    # (recomputed on the second table), the 40-token one is past it from the start (offset positions through the
    # fused RoPE + KV write and the decode kernel's RoPE)
    "phi3": (dict(original_max_position_embeddings=6, rope_parameters={
        "rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0 + 0.05 * i for i in range(16)],
        "long_factor": [1.0 + 0.6 * i for i in range(16)]}), True),
}


def _checkpoint(path, model_type: str):
    """A tiny seeded fp32 checkpoint with every weight random (norm gains and biases too) and a tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab = save_tokenizer(path)
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, vocab_size=vocab, **SHAPE, **FAMILIES[model_type][0])
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(0.1 * torch.randn_like(p) + (1.0 if p.dim() == 1 else 0.0))
            if name.endswith(".sinks"):  # sink logits far apart: equal ones only scale every head alike, which the
                p.normal_(0.0, 2.0)  # final norm undoes, and a kernel that dropped them would pass
        for name, b in model.named_buffers():  # a router's selection bias (GLM-4.5's): random, large enough to choose
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.mark.parametrize("family", FAMILIES)
def test_kernel_path_runs_the_new_ops(family, tmp_path):
    path = build_artifact(_checkpoint(tmp_path / "ckpt", family), tmp_path / "art")
    ref = Engine.load(path, use_kernels=False)
    fused = ServingEngine(Engine.load(path, device=DEVICE, use_kernels=True),
                          ServingConfig(num_blocks=16, max_num_batched_tokens=32, max_seq_len=128))
    # every rotary the kernels take is fused into the KV write (partial and interleaved too); gpt2 has none
    assert fused.executor.use_kernels and bool(fused.executor._fusions.rope) == FAMILIES[family][1]
    # a residual add whose sum a LayerNorm reads runs with it (the LayerNorm families' sequential or parallel blocks)
    has_layer_norm = any(n["op"] == "layer_norm" for n in fused.executor.graph["nodes"])
    assert bool(fused.executor._fusions.add_layer_norms) == has_layer_norm
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 40)]  # 40: prefilled in two chunks
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=0)
    for prompt, out in zip(prompts, fused.run(prompts, params)):
        want = ref.generate(prompt, params)
        assert out.token_ids == want.token_ids
        got = torch.tensor([lp.logprob for lp in out.logprobs])
        assert torch.allclose(got, torch.tensor(want.logprobs), atol=1e-4)
