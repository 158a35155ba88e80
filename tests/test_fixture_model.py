"""Checks on the second trained fixture, ``models/pydoc-qwen3`` (a Qwen3 model on stdlib docstrings).

It is the quantization and gate tests' second real model, of another family and trained on other text
than the bundled Llama, so these tests guard what they rely on: it loads as a Qwen3 model with
grouped-query attention and q/k norms, its held-out text really is held out, it has learned something
(perplexity far below the uniform baseline), the toolchain builds it exactly (fp32 logits equal Hugging
Face's), and a calibrated 4-bit method beats plain rounding on it.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from builder.devtools.train_bundled import SPLIT_CALIBRATION, SPLIT_EVAL, SPLIT_TRAIN, assign_split
from conftest import FIXTURE, build_artifact, hf_logits, memo_logits, quantization_setup

SEQ_LEN = 256
N_WINDOWS = 8
UNIFORM_FACTOR = 5  # the held-out perplexity bound: uniform perplexity (vocab size) / UNIFORM_FACTOR
MAX_WEIGHT_BYTES = 8 * 1024 * 1024
GROUP = 64  # hidden size 192 = 3 x 64


@pytest.fixture(scope="module")
def config() -> dict:
    """The raw ``config.json``."""
    return json.loads((FIXTURE / "config.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def model():
    """The checkpoint loaded through transformers' auto class."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(FIXTURE), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(FIXTURE))


@pytest.fixture(scope="module")
def eval_ids(hf_tokenizer) -> list[int]:
    """Token ids of the first 20,000 characters of the held-out ``eval.txt``."""
    text = (FIXTURE / "eval.txt").read_text(encoding="utf-8")[:20_000]
    return hf_tokenizer(text)["input_ids"]


def test_loads_as_qwen3_with_gqa_and_qk_norm(config: dict, model) -> None:
    """A Qwen3ForCausalLM whose attention shares key/value heads and normalises q and k per head."""
    from transformers import Qwen3ForCausalLM

    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert isinstance(model, Qwen3ForCausalLM)
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    assert 1 < kv_heads < heads and heads % kv_heads == 0
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.out_features == heads * head_dim
    assert attn.k_proj.out_features == kv_heads * head_dim
    assert attn.q_norm.weight.shape == attn.k_norm.weight.shape == (head_dim,)
    assert config["tie_word_embeddings"] and model.lm_head.weight is model.model.embed_tokens.weight


def test_weights_are_small_and_trained_fp32() -> None:
    """The committed weights are float32 and a few MB; the training record says so too."""
    from safetensors import safe_open

    weights = FIXTURE / "model.safetensors"
    assert weights.stat().st_size <= MAX_WEIGHT_BYTES
    with safe_open(str(weights), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    metrics = json.loads((FIXTURE / "training_metrics.json").read_text(encoding="utf-8"))
    assert metrics["model"]["architecture"] == "Qwen3ForCausalLM" and metrics["weights_dtype"] == "float32"
    assert metrics["train"]["steps"] > 0 and metrics["train"]["train_seconds"] > 0


def test_held_out_files_are_not_in_train_split() -> None:
    """Recomputing the split from each listed path puts it in its held-out split, never in train."""
    manifest = json.loads((FIXTURE / "split.json").read_text(encoding="utf-8"))
    eval_paths, calib_paths = set(manifest[SPLIT_EVAL]), set(manifest[SPLIT_CALIBRATION])
    assert eval_paths and calib_paths and not eval_paths & calib_paths
    assert all(assign_split(p) == SPLIT_EVAL for p in eval_paths)
    assert all(assign_split(p) == SPLIT_CALIBRATION for p in calib_paths)
    assert not any(assign_split(p) == SPLIT_TRAIN for p in eval_paths | calib_paths)


def test_eval_perplexity_beats_uniform_baseline(model, eval_ids: list[int], config: dict) -> None:
    """Held-out docstrings score far better than guessing: at most a fifth of the uniform perplexity (the vocab
    size). A freshly initialised model scores about the vocab size; this 1.7M-parameter model, trained on 0.5M
    tokens of prose, is looser than the bundled model's tenth (its TRAINING.md has the measured figures)."""
    assert len(eval_ids) >= SEQ_LEN * N_WINDOWS
    windows = torch.tensor(eval_ids[: SEQ_LEN * N_WINDOWS]).view(N_WINDOWS, SEQ_LEN)
    with torch.no_grad():
        ppl = math.exp(model(input_ids=windows, labels=windows).loss.item())
    assert ppl < config["vocab_size"] / UNIFORM_FACTOR, ppl


def test_fp32_build_matches_hugging_face(tmp_path, eval_ids: list[int]) -> None:
    """The toolchain's fp32 artifact (verify pass included) gives Hugging Face's logits on held-out text."""
    from runtime import Engine

    engine = Engine.load(build_artifact(FIXTURE, tmp_path / "pydoc-qwen3"))
    ids = eval_ids[:96]
    ours, theirs = engine.logits(ids), hf_logits(FIXTURE, ids)
    assert ours.shape == theirs.shape and ours.shape[0] == len(ids)
    assert (ours - theirs).abs().max() < 1e-4


@pytest.fixture(scope="module")
def quantization():
    """The traced graph, calibration windows and eval set both calibrated methods are scored on, with the
    unquantized graph's logits and the round-to-nearest counterparts' computed once (by content: GPTQ and AWQ at
    the same bits, group size and symmetry share one)."""
    from builder.quality import GraphModel, graph_digest

    graph, calib, eval_set = quantization_setup(FIXTURE, 16, text_dir=FIXTURE, num_positions=1024)
    rtn_logits: dict[str, object] = {}

    def rtn(g):
        digest = graph_digest(g)
        if digest not in rtn_logits:
            rtn_logits[digest] = memo_logits(GraphModel(g).logits)
        return rtn_logits[digest]

    return graph, calib, eval_set, memo_logits(GraphModel(graph).logits), rtn


@pytest.mark.parametrize("algo, options, max_ratio", [
    ("gptq", {}, 1.0),
    # a calibrated 4-bit method must close at least 40% of round-to-nearest's error (issue 18's bar): AWQ's scales
    # then GPTQ's rounding (0.196 here), and AWQ's defaults, rounding to nearest (0.497 here; 0.72 before the
    # asymmetric clip bounds and the scale refit of session 25; symmetric AWQ scored 0.397, not run here to save time)
    ("awq", {"rounding": "gptq"}, 0.6),
    ("awq", {}, 0.6),
])
def test_calibrated_4bit_beats_round_to_nearest(algo: str, options: dict, max_ratio: float, quantization) -> None:
    """A calibrated 4-bit method, calibrated on the fixture's own held-out text, has lower KL on its eval text
    than plain rounding (the gates' round-to-nearest counterpart: same bits, group size and symmetry)."""
    from builder.gates import GateThresholds, compare
    from builder.quality import GraphModel, rtn_graph
    from passes import PassContext, run_passes

    graph, calib, eval_set, reference, rtn_logits = quantization
    quantized, _ = run_passes(graph.copy(), [algo, "dce"],
                              PassContext(calibration=calib, options={algo: {"group_size": GROUP, **options}}))
    linears = [n for n in quantized.nodes if n.op == "linear"]
    assert linears and all(n.attrs["quant"]["scheme"] == "w4a16" for n in linears)
    rtn = rtn_graph(graph, quantized)
    assert rtn is not None, "round-to-nearest counterpart not built"
    report = compare(reference, GraphModel(quantized).logits, eval_set,
                     GateThresholds(max_kl_vs_rtn=1.0), rtn=rtn_logits(rtn))
    kl, ratio = report.metric("kl").value, report.metric("kl_vs_rtn").value
    assert 0 < kl and 0 < ratio < max_ratio, f"{algo} {options}: KL {kl:.3g} is {ratio:.3f} x round-to-nearest's"


def test_gptq_at_8_bits_per_channel_beats_int8_weight_only_rounding(quantization) -> None:
    """INT8 weight-only with GPTQ's rounding (``method: gptq``, bits 8, one symmetric scale per output channel) closes
    at least 40% of round-to-nearest's KL on the fixture's own text (docs/QUANTIZATION_COMPARISON.md, session 54:
    0.16-0.18x on this model, 0.50x on the bundled one, at 64 windows of 256 tokens; 0.23x here, where round to
    nearest is int8_wo's amax / 127.5 as GPTQ's grid is)."""
    from builder.gates import GateThresholds, compare
    from builder.quality import GraphModel, rtn_graph
    from passes import PassContext, run_passes

    graph, calib, eval_set, reference, rtn_logits = quantization
    options = {"bits": 8, "group_size": -1, "symmetric": True}
    quantized, _ = run_passes(graph.copy(), ["gptq", "dce"], PassContext(calibration=calib, options={"gptq": options}))
    linears = [n for n in quantized.nodes if n.op == "linear"]
    assert linears and all(n.attrs["quant"]["scheme"] == "w8a16" and n.attrs["quant"]["group_size"] == -1
                           for n in linears)
    rtn = rtn_graph(graph, quantized)
    assert rtn is not None, "round-to-nearest counterpart not built"
    report = compare(reference, GraphModel(quantized).logits, eval_set, GateThresholds(max_kl_vs_rtn=1.0),
                     rtn=rtn_logits(rtn))
    kl, ratio = report.metric("kl").value, report.metric("kl_vs_rtn").value
    assert 0 < kl and 0 < ratio < 0.6, f"gptq {options}: KL {kl:.3g} is {ratio:.3f} x round-to-nearest's"
