"""The model families the toolchain builds, each checked against Hugging Face, and those it does not build yet.

Every case is a tiny random checkpoint (fp32, 2 layers, hidden 64, seeded, ``save_pretrained``) of one family,
built through ``builder build``'s own path (trace, lift, passes, verify, artifact) and run by the runtime: its
logits must match the Hugging Face model's within 1e-4 on fresh random tokens, and 32 greedy tokens must be the
ones HF picks. A family that does not lift yet must stop ``builder build`` with a one-line error naming the ATen
op and the module path (or why it cannot be traced), never a traceback.

Most of the time is torch.export's (a few seconds per model on a CPU): each family is traced once.

``SUPPORTED`` and ``NOT_YET`` are the one list of cases; the README's family table is made from them
(``python tests/passes/test_families.py`` prints it, and ``test_readme_table_matches_the_cases`` checks it).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
COMMON = dict(hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=2)


@dataclass(frozen=True)
class Family:
    """One family as a user brings it: a model_type and the config that makes its tiny checkpoint."""

    name: str  # as the README lists it
    model_type: str  # config.json's model_type
    config: dict[str, Any] = field(default_factory=dict)  # on top of COMMON
    covers: str = ""  # what this case exercises beyond a plain Llama (the README's column)


@dataclass(frozen=True)
class NotYet:
    """A family that does not lift yet: what ``builder build`` must say, and what the lifter would need."""

    family: Family
    expect: str  # a regular expression the one-line error must match (the op and the module path)
    needs: str  # the missing IR primitive (the README's column)


# one layer: what it adds is within a layer; the IR's fused q/k/v and partial rotary are also checked against HF by
# tests/passes/test_lift_primitives.py, which imports it
GPT_NEOX = Family("GPT-NeoX", "gpt_neox", dict(num_hidden_layers=1, num_key_value_heads=4),
                  "parallel attention and MLP on two LayerNorms of one residual, q/k/v fused per head (one weight, "
                  "rows interleaved by head), rotary on a quarter of each head, checkpoint names mapped as "
                  "transformers maps them on load (`embed_out` is the lm_head)")
SLIDING = dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])  # layer 0 slides, 1 is global
# the default Falcon (7B's layout: multi-query, parallel attention and MLP on one LayerNorm) with biases; the new
# decoder architecture (40B / 180B) and the sequential one are checked against HF by
# tests/passes/test_lift_primitives.py
FALCON = Family("Falcon", "falcon", dict(num_hidden_layers=1, bias=True),
                "linears written as x @ weight.T + bias, multi-query attention (one kv head) with q/k/v taken from "
                "one fused weight by slices and index lists, parallel attention and MLP on one LayerNorm, GeLU MLP, "
                "tied embeddings")
# GPT2Config takes hidden_size, num_hidden_layers, num_attention_heads, max_position_embeddings (n_positions) from
# COMMON under its own names; its MLP size is n_inner. Two layers, as COMMON: the positions are embedded once, before
# the first
GPT2 = Family("GPT-2", "gpt2", dict(n_inner=112),
              "learned absolute position embeddings (a table looked up by the positions), Conv1D linears stored "
              "[in, out] (transposed once on read), q/k/v in one Conv1D (split outputs), LayerNorm with bias, GeLU "
              "written out with tanh (gelu_new), biases everywhere, tied embeddings")
GRANITE_MULTIPLIERS = dict(embedding_multiplier=6.0, residual_multiplier=0.4, attention_multiplier=0.1,
                          logits_scaling=4.0)
SUPPORTED = [
    Family("Llama", "llama", dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}), "tied embeddings, llama3 rope scaling"),
    Family("Mistral", "mistral", dict(sliding_window=8), "sliding-window attention"),
    Family("Qwen2", "qwen2", {}, "q/k/v biases"),
    Family("Qwen3", "qwen3", dict(head_dim=24), "per-head q/k RMSNorm, head_dim != hidden / heads"),
    Family("OLMo 2", "olmo2", {}, "q/k RMSNorm over all heads, norms after attention and MLP"),
    Family("SmolLM3", "smollm3", dict(no_rope_layers=[1, 0]), "layers without rotary embeddings (NoPE)"),
    Family("Gemma", "gemma", dict(head_dim=16), "(1 + w) RMSNorm gains, embedding x sqrt(hidden), GeLU-tanh MLP"),
    Family("Gemma 3 (text)", "gemma3_text", dict(SLIDING, head_dim=16, query_pre_attn_scalar=24),
           "sliding and global layers with their own rope tables, q/k norms, norms around attention and MLP"),
    Family("OLMo 3", "olmo3", SLIDING, "OLMo 2's norms, sliding and global layers"),
    Family("EXAONE 4", "exaone4", SLIDING,
           "global layers without rotary embeddings, a window kept on every module but used on sliding layers only"),
    Family("Ministral", "ministral", dict(SLIDING, head_dim=16), "sliding and global layers"),
    # the temperature's period cut to 4 tokens (16,384 in the released configs), so the test's prompts cross it
    Family("Ministral 3", "ministral3", dict(head_dim=16, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 4,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}),
           "a query temperature per position, 1 + beta log(1 + floor(p / original_max_position_embeddings)) "
           "(llama_4_scaling_beta), after YaRN rotary"),
    Family("Seed-OSS", "seed_oss", dict(head_dim=16), "q/k/v biases"),
    Family("Hunyuan (dense)", "hunyuan_v1_dense", dict(head_dim=16), "per-head q/k RMSNorm"),
    Family("CWM", "cwm", dict(SLIDING, head_dim=16), "sliding and global layers"),
    Family("IQuest-Coder", "iquestcoder", dict(head_dim=16), "Llama-style"),
    Family("Cohere 2", "cohere2", dict(SLIDING, head_dim=16),
           "sliding layers with interleaved rotary, global layers without rotary embeddings, parallel attention "
           "and MLP on one LayerNorm without bias, logits x logit_scale, tied embeddings"),
    Family("VaultGemma", "vaultgemma", dict(SLIDING, head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=1.0,
                                            final_logit_softcapping=2.0),
           "Gemma 2's soft-capped attention scores and logits, sliding and global layers, without its norms after "
           "attention and MLP"),
    GPT2,
    # one layer each below: what these cases add is within a layer, and a second costs tracing time
    Family("Phi-3", "phi3", dict(num_hidden_layers=1),
           "q/k/v and gate/up stored as one fused weight each (sliced into a linear's split outputs)"),
    Family("StableLM", "stablelm", dict(num_hidden_layers=1, use_qkv_bias=True),
           "LayerNorm with bias, rotary on a quarter of each head, q/k/v biases"),
    Family("Phi-2", "phi", dict(num_hidden_layers=1),
           "parallel attention and MLP on one LayerNorm, rotary on half of each head, GeLU written out with tanh "
           "(gelu_new), fc1 -> GeLU -> fc2 MLP, biases everywhere, lm_head bias"),
    Family("Starcoder2", "starcoder2", dict(num_hidden_layers=1, sliding_window=8),
           "LayerNorm with bias, tanh-GeLU MLP without gate, biases, sliding-window attention"),
    Family("OLMo", "olmo", dict(num_hidden_layers=1), "LayerNorm without weight or bias"),
    Family("Apertus", "apertus", dict(num_hidden_layers=1, head_dim=16),
           "the xIELU activation (two scalar weights per layer through softplus), an MLP without gate, per-head q/k "
           "RMSNorm"),
    Family("NanoChat", "nanochat", dict(num_hidden_layers=1),
           "rotary by minus the angle (rotate_half written cat(x2, -x1): the negated frequencies), RMSNorm without "
           "gains, squared-ReLU MLP"),
    Family("Persimmon", "persimmon", dict(num_hidden_layers=1),
           "LayerNorm over each head's features (q/k norms with biases), q/k/v fused per head, rotary on half of "
           "each head, squared-ReLU MLP"),
    Family("Nemotron", "nemotron", dict(num_hidden_layers=1, head_dim=16),
           "LayerNorm with a (1 + w) gain (LayerNorm1P), squared-ReLU MLP without a gate, partial rotary"),
    Family("Cohere", "cohere", dict(num_hidden_layers=1),
           "LayerNorm without bias written out, parallel attention and MLP, interleaved (GPT-J) rotary, "
           "logits x logit_scale, tied embeddings"),
    Family("Cohere (q/k norms)", "cohere", dict(num_hidden_layers=1, use_qk_norm=True),
           "Command R+'s q/k LayerNorms: each head normalised, with a gain of its own per head ([heads, head_dim])"),
    Family("Granite", "granite", dict(num_hidden_layers=1, embedding_multiplier=6.0, residual_multiplier=0.4,
                                      attention_multiplier=0.1, logits_scaling=4.0),
           "embedding, residual and attention multipliers, logits / logits_scaling"),
    GPT_NEOX,
    Family("GLM", "glm", dict(num_hidden_layers=1, head_dim=16),
           "interleaved (GPT-J) rotary on half of each head, q/k/v biases, gate/up stored as one fused weight"),
    Family("GLM-4", "glm4", dict(num_hidden_layers=1, head_dim=16),
           "GLM's attention and fused gate/up, with norms after attention and MLP as well as before"),
    Family("GPT-J", "gptj", dict(num_hidden_layers=1, rotary_dim=8),
           "rotary cos / sin read from a precomputed [positions, sin | cos] table (embed_positions: its frequencies "
           "recovered and checked against the table), interleaved on half of each head, parallel attention and "
           "MLP on one LayerNorm, lm_head bias"),
    Family("CodeGen", "codegen", dict(num_hidden_layers=1, rotary_dim=8, n_inner=112),
           "GPT-J's precomputed rotary table, q/k/v stored as one weight in CodeGen's order (four groups of [q v k] "
           "rows)"),
    Family("Helium", "helium", dict(num_hidden_layers=1, head_dim=16), "interleaved (GPT-J) rotary"),
    Family("ERNIE 4.5", "ernie4_5", dict(num_hidden_layers=1, head_dim=16),
           "interleaved (GPT-J) rotary, tied embeddings"),
    Family("Arcee (AFM)", "arcee", dict(num_hidden_layers=1, head_dim=16),
           "squared-ReLU MLP without a gate (relu2: torch.square(relu(x)), lifted as x * x)"),
    Family("GPT-BigCode (StarCoder)", "gpt_bigcode", dict(num_hidden_layers=1, n_inner=112, multi_query=True),
           "multi-query attention with q/k/v in one linear, learned absolute position embeddings, LayerNorm with "
           "bias, GeLU-tanh MLP, tied embeddings"),
    # mixture of experts: 4 experts, 2 per token (the moe op)
    Family("Mixtral", "mixtral", dict(num_hidden_layers=1, num_local_experts=4, num_experts_per_tok=2),
           "mixture of experts (router softmax, top-2, renormalised; fp32 routing weights), per-expert checkpoint "
           "tensors stacked on load"),
    Family("Qwen3-MoE", "qwen3_moe", dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                          norm_topk_prob=True, mlp_only_layers=[1]),
           "mixture of experts beside a dense MLP layer (mlp_only_layers), routing weights rounded to the "
           "activations' dtype, q/k norms"),
    Family("Qwen2-MoE", "qwen2_moe", dict(num_hidden_layers=1, num_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=48, shared_expert_intermediate_size=80),
           "mixture of experts without renormalisation, plus a shared expert MLP scaled by a sigmoid gate"),
    Family("OLMoE", "olmoe", dict(num_hidden_layers=1, num_experts=4, num_experts_per_tok=2),
           "mixture of experts, q/k RMSNorm over all heads"),
    # attention computed in the model's own code (it refuses SDPA): the tracer's attention node. Caps small enough
    # to bend these tiny models' scores and logits (Gemma 2's own are 50 and 30)
    Family("Gemma 2", "gemma2", dict(SLIDING, head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=1.0,
                                     final_logit_softcapping=2.0),
           "attention scores and final logits soft-capped (c * tanh(x / c)), sliding and global layers, scale "
           "from query_pre_attn_scalar, norms around attention and MLP"),
    Family("FlexOlmo", "flex_olmo", dict(num_hidden_layers=1, num_experts=4, num_experts_per_tok=2),
           "mixture of experts without renormalisation, OLMo 2's norms (after attention and MLP, q/k over all "
           "heads)"),
    Family("Hunyuan (MoE)", "hunyuan_v1_moe", dict(num_hidden_layers=1, head_dim=16, num_experts=4, moe_topk=2,
                                                   moe_intermediate_size=48),
           "mixture of experts plus a shared MLP added unscaled, per-head q/k RMSNorm"),
    Family("GraniteMoE", "granitemoe", dict(num_hidden_layers=1, num_local_experts=4, num_experts_per_tok=2,
                                            **GRANITE_MULTIPLIERS),
           "mixture of experts routed by a softmax over the top-k logits, experts stored stacked (input_linear / "
           "output_linear, renamed as transformers renames them on load), Granite's multipliers; a causal LM that "
           "passes use_cache on in **kwargs (traced with it off in the config)"),
    Family("GraniteMoE (shared)", "granitemoeshared", dict(num_hidden_layers=1, num_local_experts=4,
                                                           num_experts_per_tok=2, shared_intermediate_size=80,
                                                           **GRANITE_MULTIPLIERS),
           "GraniteMoE with a shared MLP beside the experts"),
    Family("Cohere 2 (MoE)", "cohere2_moe", dict(SLIDING, head_dim=16, num_experts=4, num_experts_per_tok=2),
           "Cohere 2's layers (sliding with rotary, global without) with a mixture of experts"),
    # routers that choose by the scores plus a per-expert selection bias (e_score_correction_bias, randomised here as
    # every weight is: it changes the choice), weighing the experts by the scores alone
    Family("GLM-4.5 (MoE)", "glm4_moe", dict(num_hidden_layers=1, head_dim=16, first_k_dense_replace=0,
                                            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                            routed_scaling_factor=2.5),
           "mixture of experts chosen by sigmoid scores plus a per-expert selection bias (e_score_correction_bias), "
           "weighted by the scores alone, renormalised, times routed_scaling_factor, router in fp32; a shared "
           "expert MLP beside it"),
    Family("dots1", "dots1", dict(num_hidden_layers=1, n_routed_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=48, n_shared_experts=1, first_k_dense_replace=0,
                                  norm_topk_prob=True, routed_scaling_factor=2.5),
           "GLM-4.5's router (selection bias, scaling factor, fp32) with a shared expert, per-head q/k RMSNorm"),
    Family("ERNIE 4.5 (MoE)", "ernie4_5_moe", dict(num_hidden_layers=1, head_dim=16, moe_num_experts=4, moe_k=2,
                                                   moe_intermediate_size=48, moe_num_shared_experts=1,
                                                   moe_layer_start_index=0),
           "mixture of experts chosen by fp32 softmax scores plus a per-expert selection bias (moe_statics), "
           "weighted by the scores alone, renormalised and rounded to the activations' dtype; shared experts, "
           "interleaved rotary"),
    Family("MiniMax-M2", "minimax_m2", dict(num_hidden_layers=1, head_dim=16, num_local_experts=4,
                                            num_experts_per_tok=2),
           "mixture of experts chosen by sigmoid scores plus a per-expert selection bias, renormalised, q/k "
           "RMSNorm over all heads"),
    Family("AFMoE (Arcee Trinity)", "afmoe", dict(head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                moe_intermediate_size=48, num_dense_layers=1, num_shared_experts=1,
                                                route_scale=2.5, global_attn_every_n_layers=2, sliding_window=8),
           "a dense layer then a mixture of experts chosen by sigmoid scores plus a per-expert selection bias "
           "(expert_bias), renormalised, times route_scale, a shared expert; attention output gated by a sigmoid, "
           "sliding layers with rotary and global ones without, q/k RMSNorm, norms around attention and MLP"),
    FALCON,
    # gpt-oss: its attention (sinks, sliding and global layers) runs on the tracer's attention node, its experts on
    # the moe op with biases and the clamped SwiGLU
    Family("gpt-oss", "gpt_oss", dict(SLIDING, head_dim=16, num_local_experts=4, num_experts_per_tok=2),
           "mixture of experts with biases, [in, out] weights and gate / up columns interleaved (converted once on "
           "read), a clamped SwiGLU with alpha (u + 1) * g * sigmoid(alpha g), routed by a softmax over the top-k "
           "logits; attention sinks, sliding and global layers, rotary written on each head's halves, q/k/v/o "
           "biases; MXFP4 experts (the released checkpoints) decoded exactly as they are read"),
]

NOT_YET = [
    NotYet(Family("LFM2 (conv layers)", "lfm2", dict(num_hidden_layers=1, layer_types=["conv"])),
           r"aten\.transpose\.int at model\.layers\.0\.conv; a per-token value with the tokens as its last axis is "
           r"the input of a convolution over the tokens",
           "a short causal convolution over the tokens, with its state in the KV cache (its gated conv layers; its "
           "attention layers lift)"),
    # one layer each, the dense one where the family has both (first_k_dense_replace): the attention is what stops it
    NotYet(Family("DeepSeek-V3", "deepseek_v3", dict(
        num_hidden_layers=1, num_key_value_heads=4, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=48)),
           r"aten\.mul\.Tensor at module 'model\.layers\.0\.self_attn' is used in a pattern the lifter does not know",
           "multi-head latent attention (MLA: keys and values expanded from a low-rank latent that the cache would "
           "hold, one rotary part shared by all heads, q/k heads wider than v's); its router lifts as GLM-4.5's where "
           "topk_group equals n_group"),
    NotYet(Family("Qwen3-Next", "qwen3_next", dict(
        num_hidden_layers=1, head_dim=16, layer_types=["linear_attention"], num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=48, shared_expert_intermediate_size=48, linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)),
           r"model_type 'qwen3_next'\) has linear_attention layers \(0 in layer_types\): linear attention \(Gated "
           r"DeltaNet",
           "linear attention (Gated DeltaNet: a short causal convolution and a recurrent state per sequence, kept "
           "beside the KV cache) in three of every four layers"),
    NotYet(Family("Falcon-H1", "falcon_h1", dict(num_hidden_layers=1, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4,
                                                mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1,
                                                mamba_chunk_size=16)),
           r"aten\.exp\.default at module 'model\.layers\.0\.mamba' computes a new tensor from weight "
           r"model\.layers\.0\.mamba\.A_log",
           "Mamba-2 state-space mixers (a selective scan with a state per sequence, a short causal convolution) "
           "beside the attention; Jamba's, Bamba's, Zamba's and Nemotron-H's Mamba layers likewise"),
    NotYet(Family("Llama 4 (text)", "llama4_text", dict(num_hidden_layers=1, head_dim=16, num_local_experts=4,
                                                       num_experts_per_tok=1, intermediate_size_mlp=112)),
           r"unsupported op aten\.view_as_complex\.default applied to per-token values at module "
           r"'model\.layers\.0\.self_attn'",
           "rotary embeddings written as a complex product (view_as_complex); beyond it, chunked attention layers, "
           "a query temperature per position and experts fed the input scaled by the router's score"),
    NotYet(Family("Gemma 3n (text)", "gemma3n_text",
                  dict(head_dim=16, intermediate_size=[64, 64], laurel_rank=4, altup_num_inputs=2,
                       hidden_size_per_layer_input=8, vocab_size_per_layer_input=96, num_kv_shared_layers=0,
                       activation_sparsity_pattern=[0.0, 0.0], **SLIDING)),
           r"unsupported op aten\.ge\.Scalar applied to per-token values at module 'model'",
           "per-layer input embeddings (token ids checked against a second vocabulary), AltUp's predicted and "
           "corrected streams, LAuReL's low-rank residual; its per-layer MLP sizes are read"),
]


# --- checkpoints ------------------------------------------------------------------------------------
def family_config(family: Family, vocab_size: int):
    """The tiny config of ``family``; skips the test where the installed transformers has no such model_type (the GPU
    machines' 5.17 lacks some that the CPU machines' release has)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if family.model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers_version()} has no model_type {family.model_type!r}")
    return AutoConfig.for_model(family.model_type, vocab_size=vocab_size, **{**COMMON, **family.config})


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def make_family_model(family: Family, vocab_size: int, seed: int = 0) -> torch.nn.Module:
    """A tiny seeded fp32 HF model of ``family``, every weight random."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, vocab_size), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms and biases: random, not ones/zeros (a misplaced gain offset must show)
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
        for name, b in model.named_buffers():  # a router's selection bias is a buffer (GLM-4.5's): random too
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
        for name, p in model.named_parameters():  # ERNIE 4.5 MoE's is a [1, experts] parameter: as large
            if name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model.eval()


def make_family_checkpoint(path: Path, family: Family, tokenizer_dir: Path, seed: int = 0) -> torch.nn.Module:
    """Save a tiny seeded fp32 checkpoint of ``family`` with the shared tokenizer; returns the HF model."""
    path.mkdir(parents=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, path / f.name)
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
    model = make_family_model(family, len(vocab), seed)
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from conftest import save_tokenizer

    path = tmp_path_factory.mktemp("families") / "tokenizer"
    save_tokenizer(path)
    return path


@dataclass
class Built:
    model: torch.nn.Module  # the HF model the checkpoint was saved from
    checkpoint: Path
    artifact: Path


@pytest.fixture(scope="module")
def build(tokenizer_dir, tmp_path_factory):
    """family -> its checkpoint built into an artifact by the default build (verify included), once per module:
    tracing is most of a build's time (torch.export, seconds per model)."""
    from conftest import build_artifact

    built: dict[str, Built] = {}

    def get(family: Family) -> Built:
        if family.model_type not in built:
            root = tmp_path_factory.mktemp(family.model_type)
            model = make_family_checkpoint(root / "ckpt", family, tokenizer_dir)
            built[family.model_type] = Built(model, root / "ckpt", build_artifact(root / "ckpt", root / "artifact"))
        return built[family.model_type]

    return get


# --- the families that build ------------------------------------------------------------------------
@pytest.mark.parametrize("family", SUPPORTED, ids=lambda f: f.model_type)
def test_family_builds_and_matches_hf(family, build):
    from runtime import Engine, SamplingParams

    b = build(family)
    engine = Engine.load(b.artifact)
    vocab = b.model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (80,), generator=gen).tolist()  # past the sliding windows, two prefill chunks
    with torch.no_grad():
        expected = b.model(torch.tensor([ids]), use_cache=False).logits[0]
    err = (engine.logits(ids) - expected).abs().max().item()
    assert err < 1e-4, f"{family.name}: logits differ from HF by {err:.3g}"
    prompt = torch.randint(3, vocab, (12,), generator=gen).tolist()
    tokens = engine.generate(prompt, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)).token_ids
    assert len(tokens) == 32
    # HF's greedy choice after the prompt and each prefix of our tokens (one forward, no cache to get wrong):
    # equal at every step means HF's own greedy decoding picks these 32 tokens
    with torch.no_grad():
        hf_next = b.model(torch.tensor([prompt + tokens[:-1]]), use_cache=False).logits[0, len(prompt) - 1:].argmax(-1)
    assert tokens == hf_next.tolist()


def test_gemma_lifts_to_existing_primitives(build):
    """Gemma's extras are attributes of the usual ops, kept through the passes into graph.json: the (1 + w) gain a
    norm's weight_offset, sqrt(hidden) the embedding's scale (its buffer's value, computed by the model's own
    initialisation), GeLU-tanh an activation; Gemma 3's sliding and global layers each read their own rope table."""
    def nodes(family: Family) -> list[dict]:
        return json.loads((build(family).artifact / "graph.json").read_text())["nodes"]

    gemma3 = nodes(next(f for f in SUPPORTED if f.model_type == "gemma3_text"))
    embed = next(n for n in gemma3 if n["op"] == "embedding")
    assert embed["attrs"]["scale"] == pytest.approx(64 ** 0.5)
    norms = [n for n in gemma3 if n["op"] in ("rms_norm", "fused_add_rms_norm")]
    assert len(norms) == 2 * 6 + 1 and all(n["attrs"]["weight_offset"] == 1.0 for n in norms)  # 4 + q/k a layer
    assert {n["attrs"]["fn"] for n in gemma3 if n["op"] == "activation"} == {"gelu_tanh"}
    attn = [n["attrs"] for n in gemma3 if n["op"] == "attention"]
    assert [a.get("sliding_window") for a in attn] == [8, None] and attn[0]["scale"] == pytest.approx(24 ** -0.5)
    tables = [n["weights"]["inv_freq"] for n in gemma3 if n["op"] == "rope"]
    assert tables == (["model.rotary_emb.sliding_attention_inv_freq"] * 2
                      + ["model.rotary_emb.full_attention_inv_freq"] * 2)
    llama = nodes(SUPPORTED[0])  # a plain Llama has neither attribute
    assert not any("scale" in n["attrs"] or "weight_offset" in n["attrs"] for n in llama if n["op"] != "attention")


def test_layer_norm_rotary_and_fused_families_lift_to_the_new_attributes(build):
    """What the LayerNorm, partial / interleaved rotary, fused-weight and scaled-logits families lift to, as
    graph.json keeps it after the default passes: no LayerNorm fused as an RMSNorm, Phi-3's fused q/k/v one split
    linear and its gate/up read whole by silu_mul, constant factors on the logits an lm_head scale."""
    def nodes(model_type: str) -> list[dict]:
        family = next(f for f in SUPPORTED if f.model_type == model_type)
        return json.loads((build(family).artifact / "graph.json").read_text())["nodes"]

    def ops_of(graph: list[dict]) -> list[str]:
        return [n["op"] for n in graph]

    stablelm, olmo, cohere = nodes("stablelm"), nodes("olmo"), nodes("cohere")
    assert ops_of(stablelm).count("layer_norm") == 3 and "fused_add_rms_norm" not in ops_of(stablelm)
    assert all(set(n["weights"]) == {"weight", "bias"} for n in stablelm if n["op"] == "layer_norm")
    assert [n["attrs"].get("rotary_dim") for n in stablelm if n["op"] == "rope"] == [4, 4]  # a quarter of 16
    assert all(not n["weights"] for n in olmo if n["op"] == "layer_norm")
    assert [set(n["weights"]) for n in cohere if n["op"] == "layer_norm"] == [{"weight"}] * 2
    assert all(n["attrs"].get("interleaved") for n in cohere if n["op"] == "rope")
    assert next(n for n in cohere if n["op"] == "lm_head")["attrs"]["scale"] == pytest.approx(0.0625)
    granite = nodes("granite")
    assert next(n for n in granite if n["op"] == "lm_head")["attrs"]["scale"] == pytest.approx(1 / 4.0)
    assert sorted(n["attrs"]["value"] for n in granite if n["op"] == "elementwise" and n["attrs"]["fn"] == "scale") \
        == pytest.approx([0.4, 0.4, 6.0])
    phi3 = nodes("phi3")
    qkv = next(n for n in phi3 if n["op"] == "linear" and len(n["outputs"]) == 3)
    assert qkv["weights"]["weight"].endswith("self_attn.qkv_proj.weight")
    assert qkv["attrs"]["split_sizes"] == [64, 32, 32]
    gate_up = next(n for n in phi3 if n["op"] == "linear" and n["weights"]["weight"].endswith("gate_up_proj.weight"))
    assert "split_sizes" not in gate_up["attrs"] and next(n for n in phi3 if n["op"] == "silu_mul")["inputs"] \
        == gate_up["outputs"]
    phi2 = nodes("phi")  # gelu_new written out: one activation, the 0.5 * x it leaves behind dropped
    assert [n["attrs"]["fn"] for n in phi2 if n["op"] == "activation"] == ["gelu_tanh"]
    assert not any(n["op"] == "elementwise" and n["attrs"]["fn"] == "scale" for n in phi2)
    assert "bias" in next(n for n in phi2 if n["op"] == "lm_head")["weights"]


def test_gpt2_lifts_position_embeddings_and_conv1d_linears(build):
    """GPT-2's wpe is an embedding of the positions added to the token embedding's rows; its Conv1D weights, stored
    [in, out], are ordinary linears whose artifact tensors are the checkpoint's transposed (the list of them is the
    checkpoint reader's, not the artifact's); c_attn is one linear split into q, k and v; the lm_head is the token
    table."""
    from safetensors.torch import load_file

    b = build(GPT2)
    graph = json.loads((b.artifact / "graph.json").read_text())
    nodes = graph["nodes"]
    embeds = [n for n in nodes if n["op"] == "embedding"]
    assert [(n["inputs"], n["source"]) for n in embeds] == [(["input_ids"], "transformer.wte"),
                                                            (["positions"], "transformer.wpe")]
    add = next(n for n in nodes if n["op"] == "elementwise")
    assert add["attrs"]["fn"] == "add" and add["inputs"] == [embeds[0]["outputs"][0], embeds[1]["outputs"][0]]
    assert next(n for n in nodes if n["op"] == "lm_head")["weights"]["weight"] == embeds[0]["weights"]["weight"]
    assert "transposed_weights" not in graph["meta"]
    qkv = [n for n in nodes if n["op"] == "linear" and len(n["outputs"]) == 3]
    assert len(qkv) == 2 and all(n["attrs"]["split_sizes"] == [64, 64, 64] for n in qkv)
    stored = load_file(b.checkpoint / "model.safetensors")
    weights = load_file(b.artifact / "weights.safetensors")
    linears = [n for n in nodes if n["op"] == "linear"]
    assert len(linears) == 8
    for n in linears:
        name = n["weights"]["weight"]
        assert list(weights[name].shape) == [n["attrs"]["out_features"], n["attrs"]["in_features"]]
        assert torch.equal(weights[name], stored[name].t())


def test_moe_families_lift_to_the_moe_op(build):
    """Each MoE block is one moe node (its router's linear taken into it) with the routing its family computes,
    its weights the per-expert checkpoint tensors stacked as transformers stacks them; Qwen2-MoE's shared expert
    stays ordinary linears, gated by a sigmoid; a dense layer beside a sparse one (mlp_only_layers) keeps its MLP.
    Expert sharding and quantization are refused or skipped, saying so."""
    from safetensors.torch import load_file

    from passes import PassContext, PassError, run_passes
    from passes.ir import Graph
    from passes.shard import check_tp_size

    def built(model_type: str) -> tuple[Built, list[dict]]:
        b = build(next(f for f in SUPPORTED if f.model_type == model_type))
        return b, json.loads((b.artifact / "graph.json").read_text())["nodes"]

    expected = {  # model_type -> (norm_topk_prob, round_weights, intermediate_size)
        "mixtral": (True, False, 112), "qwen3_moe": (True, True, 48), "qwen2_moe": (False, True, 48),
        "olmoe": (False, True, 112),
    }
    for model_type, (norm, rounded, inter) in expected.items():
        b, nodes = built(model_type)
        moe = [n for n in nodes if n["op"] == "moe"]
        assert len(moe) == 1 and moe[0]["source"] == "model.layers.0.mlp", model_type
        attrs = moe[0]["attrs"]
        assert (attrs["num_experts"], attrs["top_k"], attrs["scoring"], attrs["activation"]) == \
            (4, 2, "softmax", "silu")
        assert (attrs["norm_topk_prob"], attrs.get("round_weights", False), attrs["intermediate_size"]) == \
            (norm, rounded, inter), model_type
        assert moe[0]["weights"] == {"gate_weight": "model.layers.0.mlp.gate.weight",
                                     "w_gate_up": "model.layers.0.mlp.experts.gate_up_proj",
                                     "w_down": "model.layers.0.mlp.experts.down_proj"}
        assert not any(n["op"] == "linear" and n["source"].endswith(".mlp.gate") for n in nodes)  # taken in
    qwen3 = built("qwen3_moe")[1]
    assert [n["source"] for n in qwen3 if n["op"] == "silu_mul"] == ["model.layers.1.mlp"]  # the dense layer
    qwen2 = built("qwen2_moe")[1]
    assert [n["attrs"]["fn"] for n in qwen2 if n["op"] == "activation"] == ["sigmoid"]
    gate = next(n for n in qwen2 if n["op"] == "linear" and n["source"].endswith("shared_expert_gate"))
    assert gate["attrs"]["out_features"] == 1
    assert any(n["op"] == "silu_mul" and n["source"] == "model.layers.0.mlp.shared_expert" for n in qwen2)

    mixtral, _ = built("mixtral")
    stored = load_file(mixtral.checkpoint / "model.safetensors")
    weights = load_file(mixtral.artifact / "weights.safetensors")
    expert = "model.layers.0.block_sparse_moe.experts.{}.{}.weight"
    assert torch.equal(weights["model.layers.0.mlp.experts.gate_up_proj"], torch.stack(
        [torch.cat([stored[expert.format(e, "w1")], stored[expert.format(e, "w3")]]) for e in range(4)]))
    assert torch.equal(weights["model.layers.0.mlp.experts.down_proj"],
                       torch.stack([stored[expert.format(e, "w2")] for e in range(4)]))

    graph = Graph.from_dict(json.loads((mixtral.artifact / "graph.json").read_text()), weights)
    with pytest.raises(PassError, match=r"shard: tp_size 3 does not divide the experts' intermediate size 112 of "
                                        r"model\.layers\.0\.mlp .*pick tp_size 1, 2, 4, 7, 8, 14, 16, 28, 56"):
        check_tp_size(graph, 3)
    quantized, records = run_passes(graph.copy(), ["int8_wo"], PassContext())
    # the linears are q/k/v (merged) and o_proj; the experts stay fp32
    assert records[0].details["moe_layers_not_quantized"] == 1 and records[0].details["num_linears"] == 2
    moe = next(n for n in quantized.nodes if n.op == "moe")
    assert "quant" not in moe.attrs and quantized.params[moe.weights["w_gate_up"]].dtype == torch.float32


@pytest.mark.parametrize("model_type, fp8", [("mixtral", False), ("mixtral", True), ("qwen2_moe", False),
                                           ("qwen3_moe", False), ("gpt_oss", False)])
def test_moe_experts_shard_over_ranks(build, model_type, fp8, monkeypatch):
    """Tensor parallelism splits every expert's intermediate features (gate and up rows, down columns, FP8 scales
    with their rows) and all-reduces the moe node's partial sums; the router stays whole on every rank. Two ranks'
    logits equal the unsharded graph's (Qwen2-MoE's shared expert splits as any MLP; gpt-oss's down-projection bias
    is held divided by tp_size on each rank, its gate/up bias split with its rows)."""
    from safetensors.torch import load_file
    from test_shard import run_ranks

    from passes import PassContext, run_passes
    from passes.ir import Graph
    from passes.verify import run_graph

    b = build(next(f for f in SUPPORTED if f.model_type == model_type))
    graph = Graph.from_dict(json.loads((b.artifact / "graph.json").read_text()),
                            load_file(b.artifact / "weights.safetensors"))
    float_graph = graph
    if fp8:
        graph, _ = run_passes(graph.copy(), ["fp8"], PassContext())
    sharded, records = run_passes(graph.copy(), ["shard"], PassContext(options={"shard": {"tp_size": 2}}))
    moes = [n for n in sharded.nodes if n.op == "moe"]
    assert records[0].details["moe_layers"] == len(moes) >= 1
    moe = moes[0]
    full = next(n for n in graph.nodes if n.op == "moe")
    inter = full.attrs["intermediate_size"]
    assert moe.attrs["intermediate_size"] == inter // 2
    up = graph.params[full.weights["w_gate_up"]].float()  # fp8 codes compared as their values

    def rank1(role: str) -> torch.Tensor:
        return sharded.shards.tensor(moe.weights[role], 1).float()

    assert torch.equal(rank1("w_gate_up"), torch.cat((up[:, inter // 2:inter], up[:, inter + inter // 2:]), dim=1))
    assert torch.equal(rank1("w_down"), graph.params[full.weights["w_down"]][:, :, inter // 2:].float())
    if fp8:  # per-row scales follow their rows; the down projection's, per output channel, stay whole
        scales = graph.params[full.weights["w_gate_up_scale"]]
        assert torch.equal(rank1("w_gate_up_scale"), torch.cat((scales[:, inter // 2:inter],
                                                                scales[:, inter + inter // 2:]), dim=1))
        assert torch.equal(rank1("w_down_scale"), graph.params[full.weights["w_down_scale"]])
    assert torch.equal(sharded.shards.tensor(moe.weights["gate_weight"], 1), graph.params[full.weights["gate_weight"]])
    reduce = next(n for n in sharded.nodes if n.op == "all_reduce" and n.inputs == moe.outputs)
    assert reduce.source == moe.source
    prompts = [torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 19)]
    expected, floats = run_graph(graph, prompts), run_graph(float_graph, prompts)
    for rank_logits in run_ranks(sharded, prompts, monkeypatch):
        for ours, ref, exact in zip(rank_logits, expected, floats):
            if fp8:  # each rank quantizes its share of h per token with its own scale: other codes, as far from
                # the float model as one rank's FP8 (a share cut wrong, or scales of other rows, is far off)
                def err(x: torch.Tensor) -> float:
                    return ((x - exact).norm() / exact.norm()).item()

                assert err(ours) < 1.3 * err(ref), (err(ours), err(ref))
            else:
                assert (ours - ref).abs().max().item() < 1e-4


def test_gpt_oss_experts_are_converted_once_and_quantize_fp8(build):
    """gpt-oss's experts (stored [E, in, out], gate / up columns interleaved, with biases) become one moe node in the
    moe op's layout: the artifact holds each weight converted once from the checkpoint's tensor, the biases as
    b_gate_up / b_down, the router (top-k of the logits, softmax over them) as softmax scoring renormalised, and the
    clamped SwiGLU's alpha and limit. The fp8 method quantizes the experts and leaves the biases float."""
    from safetensors.torch import load_file

    from passes import PassContext, run_passes
    from passes.ir import Graph

    b = build(next(f for f in SUPPORTED if f.model_type == "gpt_oss"))
    graph_json = json.loads((b.artifact / "graph.json").read_text())
    moes = [n for n in graph_json["nodes"] if n["op"] == "moe"]
    assert [n["source"] for n in moes] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    attrs, weights = moes[0]["attrs"], moes[0]["weights"]
    assert (attrs["scoring"], attrs["norm_topk_prob"], attrs["activation"], attrs["top_k"]) == \
        ("softmax", True, "clamped_swiglu", 2)
    assert (attrs["swiglu_alpha"], attrs["swiglu_limit"]) == (b.model.config.swiglu_alpha, b.model.config.swiglu_limit)
    prefix = "model.layers.0.mlp"
    assert weights == {"gate_weight": f"{prefix}.router.weight", "gate_bias": f"{prefix}.router.bias",
                       "w_gate_up": f"{prefix}.experts.gate_up_proj", "w_down": f"{prefix}.experts.down_proj",
                       "b_gate_up": f"{prefix}.experts.gate_up_proj_bias", "b_down": f"{prefix}.experts.down_proj_bias"}
    stored = load_file(b.checkpoint / "model.safetensors")
    held = load_file(b.artifact / "weights.safetensors")
    gate_up = stored[f"{prefix}.experts.gate_up_proj"].transpose(1, 2)  # [E, 2I, hidden], rows interleaved
    assert torch.equal(held[weights["w_gate_up"]], torch.cat((gate_up[:, 0::2], gate_up[:, 1::2]), dim=1))
    assert torch.equal(held[weights["w_down"]], stored[f"{prefix}.experts.down_proj"].transpose(1, 2))
    bias = stored[f"{prefix}.experts.gate_up_proj_bias"]
    assert torch.equal(held[weights["b_gate_up"]], torch.cat((bias[:, 0::2], bias[:, 1::2]), dim=1))
    assert "moe_weight_layouts" not in graph_json.get("meta", {})  # converted: nothing left for the runtime to do

    graph = Graph.from_dict(graph_json, held)
    quantized, records = run_passes(graph.copy(), ["fp8"], PassContext())
    assert records[0].details["moe_layers_quantized"] == 2
    moe = next(n for n in quantized.nodes if n.op == "moe")
    assert quantized.params[moe.weights["w_gate_up"]].dtype == torch.float8_e4m3fn
    assert torch.equal(quantized.params[moe.weights["b_gate_up"]], held[weights["b_gate_up"]])
    quantized.check()


def test_fp8_quantizes_moe_experts(build):
    """The fp8 method stores each expert's gate/up and down weights as e4m3 codes with an fp32 scale per output
    channel (the router stays float), recorded in the node's quant attr and the summary; the quantized experts run
    (inputs quantized per token) close to the float model's logits, and the option experts: false, or an ignore
    pattern on the layer, leaves them float."""
    from builder.quality import rtn_counterpart
    from passes import PassContext, run_passes
    from passes.ir import Graph, GraphError
    from runtime.executor import Executor, SeqSlice, StepInput
    from runtime.kv_cache import SequenceKV
    from safetensors.torch import load_file

    b = build(next(f for f in SUPPORTED if f.model_type == "mixtral"))
    graph = Graph.from_dict(json.loads((b.artifact / "graph.json").read_text()),
                            load_file(b.artifact / "weights.safetensors"))
    quantized, records = run_passes(graph.copy(), ["fp8"], PassContext())
    assert records[0].details["moe_layers_quantized"] == 1 and "moe_layers_not_quantized" not in records[0].details
    moe = next(n for n in quantized.nodes if n.op == "moe")
    assert moe.attrs["quant"] == {"scheme": "fp8", "activations": "dynamic", "weight_granularity": "channel"}
    before = next(n for n in graph.nodes if n.op == "moe")
    assert quantized.params[moe.weights["gate_weight"]].dtype == torch.float32
    for role, rows in (("w_gate_up", 2 * 112), ("w_down", 64)):
        w = graph.params[before.weights[role]]
        codes, scales = quantized.params[moe.weights[role]], quantized.params[moe.weights[f"{role}_scale"]]
        assert codes.dtype == torch.float8_e4m3fn and codes.shape == w.shape and scales.shape == (4, rows)
        assert before.weights[role] not in quantized.params  # the float experts are not kept
        # e4m3 keeps 3 mantissa bits: within half a step (2^-4 relative) of each weight, or of the row's finest
        # subnormal step (2^-9 of its scale)
        deq = codes.float() * scales[..., None]
        assert ((deq - w).abs() <= w.abs() * 2 ** -4 + scales[..., None] * 2 ** -9).all()
    quantized.check()
    broken = quantized.copy()
    next(n for n in broken.nodes if n.op == "moe").weights.pop("w_down_scale")
    with pytest.raises(GraphError, match=r"a moe with quant scheme fp8 carries exactly the weights \['w_gate_up_scale', "
                                         r"'w_down_scale'\]"):
        broken.check()

    ids = torch.randint(3, 300, (24,), generator=torch.Generator().manual_seed(5))

    def logits(g: Graph) -> torch.Tensor:
        executor = Executor(g.to_dict(), g.params)
        kv = SequenceKV(executor.kv_layout(), len(ids))
        return executor.forward(StepInput(ids, torch.arange(len(ids)), [SeqSlice(kv, 0, len(ids))])).float()

    ref = logits(graph)
    err = (logits(quantized) - ref).norm() / ref.norm()
    assert 0 < err < 0.1, err  # fp8 linears and experts, against the float model
    unscaled = quantized.copy()  # without the scales the codes alone are far off: the check above can fail
    for role in ("w_gate_up", "w_down"):
        name = next(n for n in unscaled.nodes if n.op == "moe").weights[f"{role}_scale"]
        unscaled.params[name] = torch.ones_like(unscaled.params[name])
    assert (logits(unscaled) - ref).norm() / ref.norm() > 5 * err

    # the gates' round-to-nearest counterpart rounds the baseline's experts by the pass's own rule: the same codes
    rtn, why = rtn_counterpart(graph, quantized)
    assert rtn is not None, why
    rtn_moe = next(n for n in rtn.nodes if n.op == "moe")
    for role in ("w_gate_up", "w_down", "w_gate_up_scale", "w_down_scale"):
        assert torch.equal(rtn.params[rtn_moe.weights[role]].float(), quantized.params[moe.weights[role]].float())

    for options in ({"experts": False}, {"ignore": ["re:mlp$"]}):
        kept, records = run_passes(graph.copy(), ["fp8"], PassContext(options={"fp8": options}))
        assert records[0].details["moe_layers_not_quantized"] == 1, options
        assert "quant" not in next(n for n in kept.nodes if n.op == "moe").attrs
    # a section whose targets name the moe layer only quantizes its experts alone
    alone, records = run_passes(graph.copy(), ["fp8"], PassContext(options={"fp8": {"targets": ["re:mlp$"]}}))
    assert records[0].details["moe_layers_quantized"] == 1 and records[0].details["num_linears"] == 0
    assert not any(n.attrs.get("quant") for n in alone.nodes if n.op == "linear")
    # a section that quantizes the lm_head alone (the linears an earlier one's) leaves the experts unless asked
    for experts, quantized_layers in ((None, 0), (True, 1)):
        options = {"int8_wo": {}, "fp8": {"lm_head": True, **({} if experts is None else {"experts": experts})}}
        both, records = run_passes(graph.copy(), ["int8_wo", "fp8"], PassContext(options=options))
        assert records[1].details.get("moe_layers_quantized", 0) == quantized_layers, experts
    # the FP8 KV cache's calibration runs the model through the fp8 experts after them
    kv, records = run_passes(quantized.copy(), ["kv_cache_quant"], PassContext(
        options={"kv_cache_quant": {"kv_cache_dtype": "fp8"}}, calibration=[ids.tolist()]))
    assert all(n.attrs.get("kv_cache_dtype") == "fp8" for n in kv.nodes if n.op == "attention")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_norm_and_embedding_scale_round_as_hf_does(dtype):
    """The runtime's references for Gemma's extras give HF's modules' own outputs bit for bit, in bf16 too: the
    (1 + w) gain applied in fp32 before the one rounding, the embedding scale rounded to the table's dtype
    (sqrt(3072) = 55.43 is 55.5 in bf16)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm, Gemma3TextScaledWordEmbedding
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from kernels import torch_ops as ops

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 96, generator=gen) * 3).to(dtype)
    for norm, offset in ((Gemma3RMSNorm(96, eps=1e-6), 1.0), (LlamaRMSNorm(96, eps=1e-6), 0.0)):
        with torch.no_grad():
            norm.weight.copy_(2.0 - offset + 0.3 * torch.randn(96, generator=gen))  # gains of about 2 either way
        norm = norm.to(dtype)
        assert torch.equal(ops.rms_norm(x, norm.weight.detach(), 1e-6, None, offset), norm(x).detach())
    embed = Gemma3TextScaledWordEmbedding(50, 3072, 0, embed_scale=3072 ** 0.5).to(dtype)
    ids = torch.randint(0, 50, (9,), generator=gen)
    with torch.no_grad():
        assert torch.equal(ops.embedding(ids, embed.weight, 3072 ** 0.5), embed(ids[None])[0])


def test_plan_takes_any_family_and_says_when_it_estimates(build):
    """`builder plan` has no allow-list either: a family outside the ones it counts exactly is planned as a
    Llama-style decoder, and the plan says so; its KV bytes per token are the built artifact's cache layout."""
    from builder.plan import make_plan, recipe_for_checkpoint

    gemma3 = build(next(f for f in SUPPORTED if f.model_type == "gemma3_text"))
    plan = make_plan(recipe_for_checkpoint(gemma3.checkpoint, ["model.dtype=float32"]))
    assert not plan.model.exact and any("planned as a Llama-style decoder" in n for n in plan.notes)
    attn = [n["attrs"] for n in json.loads((gemma3.artifact / "graph.json").read_text())["nodes"]
            if n["op"] == "attention"]
    assert plan.kv_bytes_per_token == sum(2 * a["num_kv_heads"] * a["head_dim"] * 4 for a in attn)
    llama = make_plan(recipe_for_checkpoint(build(SUPPORTED[0]).checkpoint))
    assert llama.model.exact and not any("Llama-style" in n for n in llama.notes)


# --- the families that do not build yet -------------------------------------------------------------
@pytest.mark.parametrize("case", NOT_YET, ids=lambda c: c.family.model_type)
def test_family_not_lifted_yet_fails_cleanly(case, tokenizer_dir, tmp_path):
    from typer.testing import CliRunner

    from builder.cli import app

    make_family_checkpoint(tmp_path / "ckpt", case.family, tokenizer_dir)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model:\n  checkpoint: {tmp_path / 'ckpt'}\n  dtype: float32\noutput_dir: {tmp_path / 'out'}\n"
                      f"runtime:\n  max_seq_len: 256\n")
    res = CliRunner().invoke(app, ["build", str(recipe), "--quiet"])
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output
    assert "Traceback" not in res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert re.search(case.expect, lines[0]), lines[0]
    assert not (tmp_path / "out").exists()


# --- the README's table -----------------------------------------------------------------------------
def readme_table() -> str:
    """The README's family table, made from the cases above."""
    rows = ["| family | `model_type` | status | tested with / missing |", "| --- | --- | --- | --- |"]
    rows += [f"| {f.name} | `{f.model_type}` | builds | {f.covers} |" for f in SUPPORTED]
    rows += [f"| {c.family.name} | `{c.family.model_type}` | not yet | needs {c.needs} |" for c in NOT_YET]
    return "\n".join(rows)


def test_readme_table_matches_the_cases():
    readme = (ROOT / "README.md").read_text()
    assert readme_table() in readme, ("README.md's family table differs from the test cases; paste the output of "
                                      "`python tests/passes/test_families.py` into it")


def test_gpt_oss_mxfp4_checkpoint_builds_with_its_experts_decoded(tokenizer_dir, tmp_path):
    """gpt-oss as released: its experts stored MXFP4 (``NAME_blocks`` uint8 [E, rows, G, 16], ``NAME_scales`` uint8
    [E, rows, G], ``quant_method: mxfp4``). The build decodes them as it reads them (exact: a code times a power of
    two) and matches the HF model whose experts hold transformers' own dequantization of the same tensors."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from conftest import build_artifact
    from runtime import Engine

    oss = next(f for f in SUPPORTED if f.model_type == "gpt_oss")
    family = Family(oss.name, oss.model_type, {**oss.config, "intermediate_size": 96})  # 32-element blocks
    ckpt = tmp_path / "ckpt"
    model = make_family_checkpoint(ckpt, family, tokenizer_dir)
    tensors = load_file(ckpt / "model.safetensors")
    gen = torch.Generator().manual_seed(3)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, in_f, out_f = tensors.pop(name).shape
        blocks = torch.randint(0, 256, (experts, out_f, in_f // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(119, 124, (experts, out_f, in_f // 32), generator=gen, dtype=torch.uint8)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        with torch.no_grad():  # the reference: transformers' own decoding, [E, in, out]
            model.get_parameter(name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (ckpt / "config.json").write_text(json.dumps(config))

    artifact = build_artifact(ckpt, tmp_path / "artifact")
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["quantization"]["source_mxfp4_weights"] == 4  # two layers' gate_up and down, recorded
    engine = Engine.load(artifact)
    ids = torch.randint(3, model.config.vocab_size, (40,), generator=gen).tolist()
    with torch.no_grad():
        expected = model(torch.tensor([ids]), use_cache=False).logits[0]
    assert (engine.logits(ids) - expected).abs().max().item() < 1e-4
    from builder.pipeline import BuildError

    with pytest.raises(BuildError, match="decoded exactly into bfloat16 or float32 only"):  # fp16: scales past range
        build_artifact(ckpt, tmp_path / "fp16", dtype="float16")
    # a blocks tensor without its scales is named
    del tensors["model.layers.0.mlp.experts.down_proj_scales"]
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    from builder.checkpoint import CheckpointError, open_checkpoint

    with pytest.raises(CheckpointError, match=r"MXFP4 tensor 'model\.layers\.0\.mlp\.experts\.down_proj_blocks' has "
                                              r"no 'model\.layers\.0\.mlp\.experts\.down_proj_scales'"):
        open_checkpoint(ckpt)


if __name__ == "__main__":
    print(readme_table())
