"""Pre-quantized mixture-of-experts checkpoints: every expert's linears stored 4-bit quantized, one linear per expert
and projection (``mlp.experts.3.gate_proj.qweight`` ...), as GPTQ, AutoAWQ and compressed-tensors write MoE models.

A tiny fp32 Qwen3-MoE (a moe layer, then a dense MLP layer) and a tiny Mixtral are quantized here by
``test_prequantized``'s own round-to-nearest and packing (written from the formats' specifications, independently of
``builder/prequantized.py``), attention and dense MLP linears included; the router stays in floating point. Each is
built with ``builder build`` (whose verify compares the artifact with a Hugging Face model holding the formats' own
dequantization, experts stacked by transformers' conversion) and checked: the moe nodes carry the w4a16 experts
scheme and their dequantized experts equal this file's, stacked gate rows then up rows; the runtime's logits match a
Hugging Face model holding this file's dequantized weights within 1e-4 (fp32), and its 24 greedy tokens are that
model's. FP8 Qwen3-MoEs (compressed-tensors per-channel codes, inputs per token; transformers' fine-grained FP8 in
32 x 32 blocks) import into the moe op's fp8 and fp8_block experts, checked through the build's verify. Experts the
moe op cannot run (act-order, a group size the fused kernel does not take, blocks that cut the gate rows) fail naming
why.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_prequantized import (FINE_GRAINED, GROUP, _w4a16_args, act_order_g_idx, awq_tensors, block_dequantize,
                               block_scaled, ct_packed_tensors, gptq_tensors, quantize, run_build)

QWEN3_MOE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                 norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=512, rms_norm_eps=1e-5)
MIXTRAL = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
               rms_norm_eps=1e-5)
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True,
        "checkpoint_format": "gptq", "lm_head": False}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
CT = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
      "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized",
                                    "weights": _w4a16_args(False, None), "input_activations": None}},
      "ignore": ["lm_head", "re:.*mlp\\.gate$"]}


def make_moe_checkpoint(path: Path, model_type: str, config: dict, seed: int) -> Path:
    """A tiny seeded fp32 checkpoint of ``model_type`` (norms and biases random, matrices N(0, 0.08))."""
    from conftest import save_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab = save_tokenizer(path)
    cfg = AutoConfig.for_model(model_type, vocab_size=vocab, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                               tie_word_embeddings=False, **config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _quantized_module(name: str) -> bool:
    """A linear the formats quantize: attention, dense MLP and expert projections (not the router, embeddings,
    norms or the lm_head)."""
    return (name.endswith(".weight") and ".layers." in name and "norm" not in name
            and not name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")))


def write_quantized(base: Path, out: Path, config: dict, pack) -> dict[str, torch.Tensor]:
    """``base`` with every quantized module's weight replaced by ``pack(module, weight)``'s tensors; returns module ->
    this file's dequantized weight."""
    shutil.copytree(base, out)
    tensors = load_file(out / "model.safetensors")
    expected = {}
    for name in sorted(tensors):
        if not _quantized_module(name) or tensors[name].dim() != 2:
            continue
        module = name.removesuffix(".weight")
        stored, expected[module] = pack(module, tensors.pop(name))
        tensors.update({f"{module}.{k}": v for k, v in stored.items()})
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = config
    (out / "config.json").write_text(json.dumps(cfg))
    return expected


def _groups(w: torch.Tensor) -> torch.Tensor:
    return torch.arange(w.shape[1]) // GROUP


def _gptq(module: str, w: torch.Tensor):
    q = quantize(w, 4, sym=True, g_idx=_groups(w))
    t = gptq_tensors(q, 4, v1=True)
    del t["g_idx"]
    return t, q.dequantize()


def _awq(module: str, w: torch.Tensor):
    q = quantize(w, 4, sym=False, g_idx=_groups(w))
    return awq_tensors(q), q.dequantize()


def _ct(module: str, w: torch.Tensor):
    q = quantize(w, 4, sym=False, g_idx=_groups(w))
    return ct_packed_tensors(q, sym=False), q.dequantize()


CT_FP8 = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
          "config_groups": {"group_0": {
              "targets": ["Linear"], "format": "float-quantized",
              "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
              "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                                    "dynamic": True}}},
          "ignore": ["lm_head", "re:.*mlp\\.gate$"]}


def _ct_fp8(module: str, w: torch.Tensor):
    """compressed-tensors FP8: e4m3 codes per output channel (scale amax / 448, stored [N, 1]), inputs per token."""
    scale = w.abs().amax(1, keepdim=True) / 448
    codes = (w / scale).to(torch.float8_e4m3fn)
    return {"weight": codes, "weight_scale": scale}, codes.float() * scale


FP8_BLOCKS = {**FINE_GRAINED, "weight_block_size": [32, 32]}


def _fp8_blocks32(module: str, w: torch.Tensor):
    """transformers' fine-grained FP8: e4m3 codes, one scale per 32 x 32 block (stored as weight_scale_inv)."""
    codes, scales = block_scaled(w, (32, 32))
    return {"weight": codes, "weight_scale_inv": scales}, block_dequantize(codes, scales, (32, 32))


CASES = {  # name -> (model type, its config, quantization_config, packer)
    "qwen3_moe-gptq": ("qwen3_moe", QWEN3_MOE, GPTQ, _gptq),
    "qwen3_moe-compressed-tensors": ("qwen3_moe", QWEN3_MOE, CT, _ct),
    "mixtral-awq": ("mixtral", MIXTRAL, AWQ, _awq),
    "qwen3_moe-compressed-tensors-fp8": ("qwen3_moe", QWEN3_MOE, CT_FP8, _ct_fp8),
    "qwen3_moe-fp8-blocks": ("qwen3_moe", QWEN3_MOE, FP8_BLOCKS, _fp8_blocks32),
}
FP8_CASES = ("qwen3_moe-compressed-tensors-fp8", "qwen3_moe-fp8-blocks")


def stacked_experts(expected: dict[str, torch.Tensor], layer: str, names: tuple[str, str, str]) -> tuple:
    """(gate_up [E, 2I, H], down [E, H, I]) of this file's dequantized experts of ``layer`` (``names``: the gate,
    up and down projections' module names in an expert)."""
    gate, up, down = names
    num = sum(1 for m in expected if m.startswith(f"{layer}.experts.") and m.endswith(f".{down}"))
    gate_up = torch.stack([torch.cat([expected[f"{layer}.experts.{e}.{gate}"], expected[f"{layer}.experts.{e}.{up}"]])
                           for e in range(num)])
    return gate_up, torch.stack([expected[f"{layer}.experts.{e}.{down}"] for e in range(num)])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = {}

    def get(name: str):
        if name not in cache:
            model_type, config, quant, pack = CASES[name]
            root = tmp_path_factory.mktemp(name)
            base = make_moe_checkpoint(root / "fp32", model_type, config, seed=11)
            expected = write_quantized(base, root / "ckpt", quant, pack)
            res = run_build(root / "ckpt", root / "artifact")
            assert res.exit_code == 0, res.output
            cache[name] = (base, root / "artifact", expected)
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(CASES))
def test_quantized_experts_import_with_their_own_codes(name, built):
    from kernels.torch_quant import dequantize_weight
    from runtime import Engine, SamplingParams

    base, artifact, expected = built(name)
    model_type = CASES[name][0]
    graph = json.loads((artifact / "graph.json").read_text())
    params = load_file(artifact / "weights.safetensors")
    moe = [n for n in graph["nodes"] if n["op"] == "moe"]
    fp8 = name in FP8_CASES
    source = CASES[name][2]["quant_method"]
    blocks = CASES[name][2].get("weight_block_size")
    want_quant = ({"scheme": "fp8_block", "block_size": blocks, "source": source} if blocks else
                  {"scheme": "fp8", "activations": "dynamic", "weight_granularity": "channel", "source": source}
                  if fp8 else {"scheme": "w4a16", "bits": 4, "group_size": GROUP, "symmetric": False, "source": source})
    assert moe and all(n["attrs"]["quant"] == want_quant for n in moe)
    names = ("w1", "w3", "w2") if model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for node in moe:
        w = {role: params[t] for role, t in node["weights"].items()}
        layer = node["weights"]["w_gate_up"].split(".mlp.")[0] + ".mlp"
        if model_type == "mixtral":
            layer = layer.replace(".mlp", ".block_sparse_moe")
        gate_up, down = stacked_experts(expected, layer, names)
        for role, want in (("w_gate_up", gate_up), ("w_down", down)):
            if blocks:
                assert w[role].dtype == torch.float8_e4m3fn
                ours = torch.stack([block_dequantize(w[role][e], w[f"{role}_scale"][e], tuple(blocks))
                                    for e in range(want.shape[0])])
            elif fp8:
                assert w[role].dtype == torch.float8_e4m3fn and w[f"{role}_scale"].shape == want.shape[:2]
                ours = w[role].float() * w[f"{role}_scale"][..., None]
            else:
                ours = torch.stack([dequantize_weight(w[role][e], w[f"{role}_scales"][e], w[f"{role}_zeros"][e], 4,
                                                      GROUP, torch.float32) for e in range(want.shape[0])])
            assert torch.equal(ours, want), f"{node['weights'][role]}: not the checkpoint's experts"
    manifest = json.loads((artifact / "manifest.json").read_text())
    record = manifest["quantization"]["prequantized"]
    num_experts = sum(1 for m in expected if ".experts." in m)
    assert record["expert_linears"] == num_experts and record["moe_weights"] == 2 * len(moe)
    assert record["num_linears"] == len(expected) - num_experts  # attention and dense MLP linears
    if fp8:
        # every linear quantizes its input per token: the build's verify compared the artifact with the HF model whose
        # linears and experts' projections did so too, at the fp32 tolerance (an activation on a rounding boundary can
        # move a later logit more: no comparison of this file's own here)
        verify = manifest["build"]["verify"] if "verify" in manifest["build"] else manifest["verify"]
        assert verify["max_abs_logit_err"] <= verify["atol"] == 1e-4 and verify["top1_agreement"] == 1.0
        return

    from transformers import AutoModelForCausalLM  # the float model, holding this file's dequantization instead

    ref = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="sdpa").eval()
    state = ref.state_dict()
    with torch.no_grad():
        for module, t in expected.items():
            if ".experts." not in module:
                state[f"{module}.weight"].copy_(t)
        for node in moe:
            experts = node["weights"]["w_gate_up"].removesuffix(".gate_up_proj.qweight")  # the model's stacked names
            src = experts.replace(".mlp.experts", ".block_sparse_moe") if model_type == "mixtral" else \
                experts.removesuffix(".experts")
            gate_up, down = stacked_experts(expected, src, names)
            state[f"{experts}.gate_up_proj"].copy_(gate_up)
            state[f"{experts}.down_proj"].copy_(down)
    engine = Engine.load(artifact)
    gen = torch.Generator().manual_seed(5)
    vocab = ref.config.vocab_size
    ids = torch.randint(3, vocab, (40,), generator=gen).tolist()
    with torch.no_grad():
        want = ref(torch.tensor([ids]), use_cache=False).logits[0]
    err = (engine.logits(ids) - want).abs().max().item()
    assert err < 1e-4, f"logits differ from HF by {err:.3g}"
    prompt = torch.randint(3, vocab, (12,), generator=gen).tolist()
    tokens = engine.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)).token_ids
    with torch.no_grad():
        hf_next = ref(torch.tensor([prompt + tokens[:-1]]), use_cache=False).logits[0, len(prompt) - 1:].argmax(-1)
    assert tokens == hf_next.tolist()


def _gptq_act_order_experts(module: str, w: torch.Tensor):
    g_idx = act_order_g_idx(w.shape[1], 3) if ".experts." in module else _groups(w)
    q = quantize(w, 4, sym=True, g_idx=g_idx)
    return gptq_tensors(q, 4, v1=True), q.dequantize()


def _gptq_group16(module: str, w: torch.Tensor):
    q = quantize(w, 4, sym=True, g_idx=torch.arange(w.shape[1]) // 16)
    t = gptq_tensors(q, 4, v1=True)
    del t["g_idx"]
    return t, q.dequantize()


def _gptq_no_down(module: str, w: torch.Tensor):
    if ".experts." in module and module.endswith("down_proj"):
        return {"weight": w}, w
    return _gptq(module, w)


def _fp8_blocks48(module: str, w: torch.Tensor):
    codes, scales = block_scaled(w, (48, 32))
    return {"weight": codes, "weight_scale_inv": scales}, w


@pytest.mark.parametrize("config, pack, message", [
    ({**GPTQ, "desc_act": True}, _gptq_act_order_experts, r"experts\.0\.gate_proj is act-order .* w4a16 scheme"),
    ({**GPTQ, "group_size": 16}, _gptq_group16, r"in groups of 16; the fused experts kernel takes group sizes that are "
                                                r"multiples of 32 .* cannot run as stored"),
    (GPTQ, _gptq_no_down, r"store their gate and up projections gptq-quantized and the others in floating point"),
    ({**FINE_GRAINED, "weight_block_size": [48, 32]}, _fp8_blocks48,
     r"64 rows per gate / up projection, not a multiple of their FP8 blocks' 48"),
])
def test_experts_the_moe_op_cannot_run_are_refused_naming_why(tmp_path_factory, config, pack, message):
    root = tmp_path_factory.mktemp("refused")
    base = make_moe_checkpoint(root / "fp32", "qwen3_moe", {**QWEN3_MOE, "num_hidden_layers": 1, "mlp_only_layers": []},
                               seed=12)
    write_quantized(base, root / "ckpt", config, pack)
    res = run_build(root / "ckpt", root / "artifact")
    assert res.exit_code != 0
    assert re.search(message, res.output), res.output


@pytest.mark.parametrize("name", ["qwen3_moe-gptq", "mixtral-awq", "qwen3_moe-compressed-tensors-fp8",
                                  "qwen3_moe-fp8-blocks"])
def test_plan_counts_a_prequantized_checkpoint_as_imported(name, built, tmp_path):
    """``builder plan`` of a pre-quantized checkpoint (a recipe without a quantization section) counts its linears and
    experts as the import stores them: the artifact's tensor bytes, less the q/k norms a Llama-style plan of Qwen3
    does not count."""
    from safetensors import safe_open

    from builder.plan import make_plan
    from builder.recipe import load_recipe

    _, artifact, _ = built(name)
    recipe = tmp_path / "plan.yaml"
    recipe.write_text(f"model:\n  checkpoint: {artifact.parent / 'ckpt'}\n  dtype: float32\n"
                      f"output_dir: {tmp_path / 'a'}\nruntime:\n  max_seq_len: 256\n")
    stored = 0
    with safe_open(artifact / "weights.safetensors", "pt") as f:
        for key in f.keys():
            if not key.endswith(("q_norm.weight", "k_norm.weight")):
                t = f.get_tensor(key)
                stored += t.numel() * t.element_size()
    plan = make_plan(load_recipe(recipe))
    assert plan.weights_bytes == stored, plan.weights_breakdown
    source = CASES[name][2]["quant_method"]
    assert any(n.startswith(f"pre-quantized checkpoint ({source})") for n in plan.notes), plan.notes


def test_tensor_parallel_names_the_checkpoints_groups(built, tmp_path):
    """At tp_size 2 the dense MLP's 96 input columns give 48 per rank, which cut the GPTQ checkpoint's groups of 32:
    the build fails naming the checkpoint's own groups and the tp_size to change (not a group size to rebuild with)."""
    _, artifact, _ = built("qwen3_moe-gptq")
    res = run_build(artifact.parent / "ckpt", tmp_path / "tp2", "parallel:\n  tp_size: 2\n")
    assert res.exit_code != 0
    assert re.search(r"cuts its quantization groups of 32 \(the gptq checkpoint's own\); pick a tp_size", res.output), \
        res.output
    assert "build with a group_size" not in res.output



@pytest.mark.parametrize("name", ["qwen3_moe-fp8-blocks", "qwen3_moe-gptq"])
def test_import_keeps_no_float_copies_unless_verify_needs_them(name, tmp_path_factory):
    """A build without the verify pass keeps none of the format's dequantized weights (a float copy of every quantized
    weight is the model's size again): the imported tensors are the same, the references gone."""
    from builder.checkpoint import attach_weights, open_checkpoint
    from passes.trace import trace

    model_type, config, quant, pack = CASES[name]
    root = tmp_path_factory.mktemp(f"{name}-refs")
    write_quantized(make_moe_checkpoint(root / "fp32", model_type, config, seed=11), root / "ckpt", quant, pack)
    ckpt = open_checkpoint(root / "ckpt")
    made = {}
    for keep in (True, False):
        graph, meta_model = trace(ckpt.hf_config())
        made[keep] = (graph, attach_weights(graph, ckpt, meta_model, torch.float32, keep_references=keep))
    (kept_graph, kept), (graph, imported) = made[True], made[False]
    assert graph.params.keys() == kept_graph.params.keys()
    assert all(torch.equal(graph.params[k], kept_graph.params[k]) for k in graph.params)
    assert imported.experts.keys() == kept.experts.keys() and imported.experts
    assert all(w is None for w in imported.experts.values()) and all(w is not None for w in kept.experts.values())
    assert all(lin.reference is None for lin in imported.linears.values()) and imported.linears
    assert imported.summary() == kept.summary()
    with pytest.raises(ValueError, match="keep_references"):
        imported.pop_reference_weights()
    assert kept.pop_reference_weights()
