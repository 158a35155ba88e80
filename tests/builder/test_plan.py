"""`builder plan`: the memory plan from config.json, checked against hand-worked shapes and against
built artifacts (weight bytes as stored, KV bytes per token, the runtime's own block arithmetic)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from builder.cli import app
from builder.pipeline import BuildError, build
from builder.plan import (CUDA_CONTEXT_BYTES, PlanError, check_target, load_plan_input, make_plan,
                          recipe_for_checkpoint)
from builder.recipe import RecipeError, validate_recipe
from conftest import BUNDLED, make_checkpoint
from runtime.artifact import open_artifact

runner = CliRunner()
GiB = 1 << 30

LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
             "tie_word_embeddings": False, "max_position_embeddings": 8192}
LLAMA3_70B = {**LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
              "num_attention_heads": 64}


def config_dir(root: Path, config: dict) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    return root


def stored_bytes(artifact: Path) -> int:
    return sum(t.numel() * t.element_size() for t in load_file(artifact / "weights.safetensors").values())


# --- hand-worked shapes --------------------------------------------------------------------------
def test_llama3_8b_parameters_and_bf16_bytes(tmp_path):
    h, layers, kv_dim, inter, vocab = 4096, 32, 8 * 128, 14336, 128256
    per_layer = h * h + 2 * h * kv_dim + h * h + 3 * h * inter + 2 * h  # q, k+v, o, gate/up/down, 2 norms
    expected = layers * per_layer + 2 * vocab * h + h  # untied embedding + lm_head, final norm
    assert expected == 8_030_261_248  # the published 8.03B

    plan = make_plan(recipe_for_checkpoint(config_dir(tmp_path / "8b", LLAMA3_8B), ["model.dtype=bfloat16"]))
    assert plan.num_parameters == expected
    rope_table = 128 // 2 * 4  # fp32 inv_freq
    assert plan.weights_bytes == 2 * expected + rope_table  # 16.06 GB, as docs/ANCHORS.md measures
    assert round(plan.weights_bytes / 1e9, 2) == 16.06
    assert plan.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert plan.fits


def test_70b_does_not_fit_80gib_in_bf16_but_does_at_tp2(tmp_path):
    path = config_dir(tmp_path / "70b", LLAMA3_70B)
    recipe = recipe_for_checkpoint(path, ["runtime.max_seq_len=4096", "runtime.max_batch_size=64",
                                          "runtime.max_num_tokens=2048"])
    h, layers, vocab, heads, kv_heads, hd, inter = 8192, 80, 128256, 64, 8, 128, 28672
    budget = int(80 * GiB * 0.9)

    one = make_plan(recipe)
    params = layers * (h * heads * hd + 2 * h * kv_heads * hd + heads * hd * h + 3 * h * inter + 2 * h) \
        + 2 * vocab * h + h
    assert one.num_parameters == params and round(params / 1e9, 1) == 70.6
    assert one.weights_bytes == 2 * params + hd // 2 * 4 > budget
    assert not one.fits and "weights alone" in one.verdict and one.num_blocks == 0

    two = make_plan(recipe, tp_size=2)
    linears_per_rank = layers * (h * (heads // 2) * hd + 2 * h * (kv_heads // 2) * hd + (heads // 2) * hd * h
                                 + 3 * h * (inter // 2))
    replicated = 2 * vocab * h + (2 * layers + 1) * h  # embedding, lm_head and norms on every rank
    weights = 2 * (linears_per_rank + replicated) + hd // 2 * 4
    assert two.weights_bytes == weights
    workspace = 4 * 2048 * (2 * inter // 2) * 2 + 4 * 64 * vocab  # widest linear: the merged gate/up per rank
    assert two.workspace_bytes == workspace
    kv_per_token = 2 * layers * (kv_heads // 2) * hd * 2
    assert two.kv_bytes_per_token == kv_per_token == 163_840
    blocks = (budget - weights - workspace - CUDA_CONTEXT_BYTES) // (kv_per_token * 16)
    assert two.num_blocks == blocks and two.fits
    at_max = two.concurrency[-1]
    assert (at_max.seq_len, at_max.by_kv_pool, at_max.max_concurrency) == (4096, blocks // 256, blocks // 256)
    first = two.concurrency[0]
    assert (first.seq_len, first.max_concurrency) == (512, min(64, blocks // 32))


def test_kv_heads_replicate_past_num_kv_heads_and_bad_tp_sizes_are_named(tmp_path):
    recipe = recipe_for_checkpoint(config_dir(tmp_path / "70b", LLAMA3_70B), ["runtime.kv_cache_dtype=fp8"])
    plan = make_plan(recipe, tp_size=16)
    assert plan.kv_heads_per_rank == 1 and plan.kv_bytes_per_token == 2 * 80 * 1 * 128 * 1
    with pytest.raises(PlanError, match="tp_size 3 does not divide num_attention_heads 64; "
                                        "pick tp_size 1, 2, 4, 8, 16, 32, 64$"):
        make_plan(recipe, tp_size=3)
    with pytest.raises(PlanError, match="tp_size 16 does not divide vocab_size 128255 \\(vocab_parallel\\)"):
        make_plan(recipe_for_checkpoint(config_dir(tmp_path / "odd", {**LLAMA3_70B, "vocab_size": 128255})),
                  tp_size=16, vocab_parallel=True)
    split = make_plan(recipe, tp_size=16, vocab_parallel=True)
    assert plan.weights_bytes - split.weights_bytes == 2 * (128256 - 128256 // 16) * 8192 * 2  # embedding, lm_head
    with pytest.raises(PlanError, match="not divisible by group_size 100"):
        make_plan(recipe_for_checkpoint(recipe.model.checkpoint, ["quantization.algo=gptq",
                                                                  "quantization.group_size=100"]))


@pytest.mark.parametrize("change, says", [
    ({"num_key_value_heads": 0}, "num_key_value_heads is 0; a positive integer is needed"),  # was read as "unset"
    ({"head_dim": 0}, "head_dim is 0; a positive integer is needed"),
    ({"num_key_value_heads": 12}, "num_key_value_heads 12 does not divide num_attention_heads 32"),
    ({"num_hidden_layers": 10**12}, "(at most 10,000)"),  # an object per layer: planned for hours before
])
def test_config_values_that_describe_no_model_are_named(tmp_path, change, says):
    with pytest.raises(PlanError, match=re.escape(says)):
        make_plan(load_plan_input(config_dir(tmp_path / "c", {**LLAMA3_8B, **change})))


def test_tp_size_comes_from_the_recipe(tmp_path):
    from builder.recipe import Recipe

    if "parallel" not in Recipe.model_fields:
        pytest.skip("the recipe has no parallel section yet")
    path = config_dir(tmp_path / "70b", LLAMA3_70B)
    raw = {"model": {"checkpoint": str(path)}, "output_dir": "o", "parallel": {"tp_size": 2}}
    assert make_plan(validate_recipe(raw)).settings.tp_size == 2
    assert make_plan(validate_recipe(raw), tp_size=4).settings.tp_size == 4  # --tp-size wins


# --- against built artifacts ---------------------------------------------------------------------
def test_plan_matches_the_bundled_artifact_and_the_runtime_arithmetic(bundled_artifact):
    from runtime import Engine
    from runtime.memory import estimate_workspace_bytes, plan_kv_blocks

    recipe = validate_recipe({"model": {"checkpoint": str(BUNDLED), "dtype": "float32"}, "output_dir": "unused",
                              "runtime": {"max_batch_size": 8, "max_seq_len": 512, "max_num_tokens": 64}})
    plan = make_plan(recipe, gpu_memory="1GiB")
    actual = stored_bytes(bundled_artifact)
    # Tolerance: none. The planner counts every tensor as the passes store it (fp32 RoPE table and KV
    # scales included): a difference is a planner bug or a new kind of tensor it has to learn about.
    assert plan.weights_bytes == actual, (plan.weights_breakdown, actual)
    engine = Engine.load(bundled_artifact)
    layout = engine.executor.kv_layout()
    assert plan.kv_bytes_per_token == layout.bytes_per_token()
    workspace = estimate_workspace_bytes(engine.executor.graph, 64, 8, torch.float32)
    assert plan.workspace_bytes == workspace
    runtime_plan = plan_kv_blocks(device="cuda", budget_bytes=plan.budget_bytes, weights_bytes=actual,
                                  workspace_bytes=workspace, other_bytes=CUDA_CONTEXT_BYTES, layout=layout,
                                  block_size=16, max_seq_len=512)
    assert runtime_plan.num_blocks == plan.num_blocks


QUANTIZED = {  # family -> quantization section(s) and KV cache dtype
    "llama-gptq4+int8_wo": ("llama", [{"algo": "gptq", "targets": ["re:\\.mlp(\\.|$)"], "group_size": 16},
                                      {"algo": "int8_wo"}], "fp8"),
    "qwen2-awq": ("qwen2", {"algo": "awq", "group_size": 16}, "auto"),
    "qwen3-fp8-static": ("qwen3", {"algo": "fp8", "activations": "static"}, "auto"),
    "mistral-smoothquant": ("mistral", {"algo": "smoothquant", "activations": "static"}, "int8"),
    "llama-gptq8-ignore": ("llama", {"algo": "gptq", "bits": 8, "group_size": 16, "ignore": ["re:layers\\.1\\."]},
                           "auto"),
    # lm_head: true on a tied checkpoint: the float embedding table plus the lm_head's own W4A16 copy
    "llama-awq-lm_head": ("llama", {"algo": "awq", "group_size": 16, "lm_head": True}, "auto"),
}


@pytest.mark.parametrize("case", sorted(QUANTIZED))
def test_plan_matches_quantized_artifacts(tmp_path, case):
    from runtime import Engine

    family, quantization, kv_dtype = QUANTIZED[case]
    recipe = validate_recipe({
        "name": case, "model": {"checkpoint": str(make_checkpoint(tmp_path / "ckpt", family)), "dtype": "float32"},
        "output_dir": str(tmp_path / "art"), "passes": ["merge_qkv", "merge_gate_up", "fuse_silu_mul", "dce"],
        "runtime": {"max_seq_len": 128, "max_num_tokens": 32, "kv_cache_dtype": kv_dtype},
        "quantization": quantization, "calibration": {"num_samples": 4, "seq_len": 32, "dataset": "bundled"}, "gates": {"enabled": False}})
    plan = make_plan(recipe)
    path = build(recipe).output_dir
    actual = stored_bytes(path)
    # Tolerance: none. The planner counts every tensor as the passes store it (fp32 RoPE table and KV
    # scales included): a difference is a planner bug or a new kind of tensor it has to learn about.
    assert plan.weights_bytes == actual, (plan.weights_breakdown, actual)
    engine = Engine.load(path)
    assert plan.kv_bytes_per_token == engine.executor.kv_layout().bytes_per_token()
    quantized = [n for n in engine.executor.graph["nodes"] if n["op"] == "linear" and n["attrs"].get("quant")]
    assert sum(plan.quantized_linears.values()) == len(quantized) > 0
    head = next(n for n in engine.executor.graph["nodes"] if n["op"] == "lm_head")
    assert (plan.lm_head_quantization is not None) == ("quant" in head["attrs"])


# --- CLI, errors, and the build's check ----------------------------------------------------------
def test_cli_plans_gpt2_from_its_own_key_names(tmp_path):
    """GPT-2's config.json names its sizes n_embd, n_head, n_layer, n_positions (transformers maps them onto the
    standard names) and leaves its MLP size null (4 x hidden): planned, as a Llama-style estimate, with its KV bytes
    per token exact."""
    from transformers import GPT2Config

    GPT2Config().save_pretrained(tmp_path / "gpt2")  # GPT-2 small: 12 layers of 12 heads of 64, 1024 positions
    assert "hidden_size" not in json.loads((tmp_path / "gpt2" / "config.json").read_text())
    res = runner.invoke(app, ["plan", str(tmp_path / "gpt2"), "--json", "-"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["kv_bytes_per_token"] == 2 * 12 * 12 * 64 * 2  # K and V, 12 layers, 12 heads of 64, bf16
    assert data["fits"] is True and any("planned as a Llama-style decoder" in n for n in data["notes"])
    model = data["model"]
    assert (model["hidden_size"], model["num_layers"], model["intermediate_size"],
            model["max_position_embeddings"]) == (768, 12, 3072, 1024)


def test_cli_table_and_json(tmp_path):
    path = config_dir(tmp_path / "70b", LLAMA3_70B)
    res = runner.invoke(app, ["plan", str(path), "--json", "-"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    for key in ("num_parameters", "weights_bytes", "weights_breakdown", "kv_bytes_per_token", "budget_bytes",
                "workspace_bytes", "workspace_is_estimate", "kv_pool_bytes", "num_blocks", "kv_pool_tokens",
                "concurrency", "fits", "verdict", "settings", "model", "notes"):
        assert key in data, key
    assert data["fits"] is False and data["settings"]["gpu_memory_bytes"] == 80 * GiB

    out = tmp_path / "plan.json"
    res = runner.invoke(app, ["plan", str(path), "--tp-size", "2", "--gpu-memory", "81920MiB", "--quant", "fp8",
                              "--max-seq-len", "8192", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "weights per rank" in res.output and "KV pool" in res.output and "fits" in res.output
    data = json.loads(out.read_text())
    assert data["fits"] is True and data["settings"]["tp_size"] == 2 and data["settings"]["quantization"] == ["fp8"]
    assert [c["seq_len"] for c in data["concurrency"]] == [512, 2048, 8192]
    assert data["settings"]["gpu_memory_bytes"] == 80 * GiB


def test_gpu_memory_units(tmp_path):
    recipe = recipe_for_checkpoint(config_dir(tmp_path / "8b", LLAMA3_8B))
    sizes = {text: make_plan(recipe, gpu_memory=text).settings.gpu_memory_bytes
             for text in ("80GiB", "80GB", "81920MiB")}
    assert sizes == {"80GiB": 80 * GiB, "80GB": 80 * 10**9, "81920MiB": 80 * GiB}


@pytest.mark.parametrize("args, message", [
    (["plan", "/nonexistent/model"], "does not exist; give a recipe YAML or a checkpoint directory"),
    (["plan", "{empty}"], "no config.json; the planner reads the model's shape from it"),
    (["plan", "{8b}", "--gpu-memory", "80 GiBs"], "--gpu-memory '80 GiBs' is not a byte count; write e.g."),
    (["plan", "{8b}", "--quant", "awk"], "quantization.algo: 'awk' is not one of"),
    (["plan", "{8b}", "--tp-size", "3"], "tp_size 3 does not divide num_attention_heads 32"),
])
def test_cli_bad_input_exits_1_with_the_reason(tmp_path, args, message):
    (tmp_path / "empty").mkdir()
    dirs = {"{empty}": str(tmp_path / "empty"), "{8b}": str(config_dir(tmp_path / "8b", LLAMA3_8B))}
    res = runner.invoke(app, [dirs.get(a, a) for a in args])
    assert res.exit_code == 1
    assert message in res.output, res.output


def test_recipe_target_section_is_validated(tmp_path):
    base = {"model": {"checkpoint": str(BUNDLED), "dtype": "float32"}, "output_dir": "o"}
    with pytest.raises(RecipeError, match="target.gpu_memory: '80 GiBs' is not a byte count"):
        validate_recipe({**base, "target": {"gpu_memory": "80 GiBs"}})
    with pytest.raises(RecipeError, match="target.fail_if_not_fits: unknown key \\(did you mean 'fail_if_not_fit'"):
        validate_recipe({**base, "target": {"fail_if_not_fits": True}})
    assert check_target(validate_recipe(base)) is None  # no target: nothing planned
    fits = validate_recipe({**base, "target": {"gpu_memory": "4GiB"}})
    assert check_target(fits) is None and make_plan(fits).settings.gpu_memory_bytes == 4 * GiB
    small = validate_recipe({**base, "target": {"gpu_memory": "64MiB"}})
    assert "does not fit its target (target.gpu_memory 64MiB" in check_target(small)


def test_build_fails_before_writing_when_the_target_is_too_small(tmp_path):
    out = tmp_path / "out"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model:\n  checkpoint: {BUNDLED}\n  dtype: float32\noutput_dir: {out}\n"
                      "target:\n  gpu_memory: 64MiB\n  fail_if_not_fit: true\n")
    with pytest.raises(BuildError, match="does not fit its target") as e:
        build(load_plan_input(recipe))
    assert "nothing was built" in str(e.value) and not out.exists()
    res = runner.invoke(app, ["build", str(recipe), "--quiet"])
    assert res.exit_code == 1 and "does not fit its target" in res.output and not out.exists()


TP_CASES = {  # name -> (family, quantization, vocab_parallel)
    "llama-fp32-tp2": ("llama", {"algo": "none"}, False),
    "llama-gptq4-tp2-vocab": ("llama", {"algo": "gptq", "group_size": 8}, True),  # 56 = 112 / 2 per rank
    "qwen2-int8_wo-tp2": ("qwen2", {"algo": "int8_wo"}, False),
    # a quantized lm_head split by vocabulary: per-tensor weight and input scales whole on each rank
    "qwen2-fp8-lm_head-tp2-vocab": ("qwen2", {"algo": "fp8", "activations": "static", "lm_head": True}, True),
}


@pytest.mark.parametrize("case", sorted(TP_CASES))
def test_plan_matches_each_rank_of_a_tensor_parallel_artifact(tmp_path, case):
    """Weights per rank from the planner equal every rank file's tensors, byte for byte."""
    family, quantization, vocab_parallel = TP_CASES[case]
    recipe = validate_recipe({
        "name": case, "model": {"checkpoint": str(make_checkpoint(tmp_path / "ckpt", family)), "dtype": "float32"},
        "output_dir": str(tmp_path / "art"), "passes": ["merge_qkv", "merge_gate_up", "fuse_silu_mul", "dce"],
        "runtime": {"max_seq_len": 128, "max_num_tokens": 32}, "quantization": quantization,
        "calibration": {"num_samples": 4, "seq_len": 32, "dataset": "bundled"}, "gates": {"enabled": False},
        "parallel": {"tp_size": 2, "vocab_parallel": vocab_parallel}})
    plan = make_plan(recipe)
    path = build(recipe).output_dir
    ranks = [sum(t.numel() * t.element_size() for t in load_file(path / f"weights-rank{r}.safetensors").values())
             for r in range(2)]
    assert ranks[0] == ranks[1] == plan.weights_bytes, (plan.weights_breakdown, ranks)
    open_artifact(path)  # the manifest's checks accept what the build wrote (a quantized lm_head's per-rank shape)
