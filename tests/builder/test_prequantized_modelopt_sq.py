"""NVIDIA ModelOpt W8A8_SQ_PER_CHANNEL checkpoints (``export_hf_checkpoint`` of an INT8_SMOOTHQUANT_CFG model) build
into artifacts holding their own codes, and quantize their activations as the format does: x * pre_quant_scale,
then round-half-even(x * s / input_scale) clamped to -128..127.

The export layout, as ModelOpt's source writes it (``modelopt/torch/export/quant_utils.py``: to_quantized_weight,
get_scaling_factor, postprocess_state_dict, preprocess_linear_fusion; ``unified_export_hf.py``:
_export_quantized_weight, requantize_resmooth_fused_llm_layers; ``quantization/tensor_quant.py``: _tensor_quant;
``quantization/nn/modules/tensor_quantizer.py``: forward, export_amax; ``quantization/model_calib.py``:
apply_pre_quant_scale_and_smooth), written here independently of ``builder/prequantized.py``:

- SmoothQuant's per-input-channel s stays on every linear's input quantizer as ``pre_quant_scale`` [K] (the model's
  dtype): the norms are scaled only for AWQ formats, so q/k/v, o, gate/up and down all keep theirs; the linears that
  read one input (q/k/v, gate/up) share one s (preprocess_linear_fusion averages them) and one input amax (the max);
- the weight is smoothed, w / s[None, :], then quantized per output channel: ``weight`` int8 [N, K] =
  round(w' / scale) clamped to -128..127, ``weight_scale`` fp32 [N] = amax / 127;
- ``input_scale`` fp32 0-d = amax / 127, amax the calibration's max |x * s| (static, per tensor);
- the input quantizer multiplies by s first, then fake-quantizes with narrow_range false: round(x * 127 / amax)
  (torch.round or the CUDA kernel's rint: half to even) clamped to -128..127.

A tiny fp32 Llama is exported so, its input scales at 0.6 of the calibration's max so that inputs saturate at both
ends, built with ``builder build`` (its verify included), and checked: the artifact's codes dequantize to this file's
weights exactly, its linears carry the export's scales and ``act_qmin`` -128; the runtime's logits match a Hugging
Face model whose linears hold dequant(W) and whose inputs are fake-quantized as above (x * s, codes -128..127, times
input_scale) within 1e-5 (fp32), its greedy tokens are that model's, and the same artifact clamped at -127 (the
SmoothQuant pass's range) is measurably off on the same input (the test can fail). The Triton kernels (GEMV, GEMM)
under TRITON_INTERPRET=1 clamp at -128 too and give the reference path's tokens (and on CUDA, where there is one, the
CPU path's); tensor parallelism keeps the scales whole on column-parallel linears and cuts the pre_quant_scale with
a row-parallel one's input columns. An export without pre_quant_scales (INT8_DEFAULT_CFG's) imports too. Malformed
exports fail naming the tensor; an ``act_qmin`` the runtime does not run is refused by the manifest check, the
executor and Graph.check.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernel-path test: the Triton kernels on the CPU

import copy
import functools
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_prequantized import attach, run_build
from test_prequantized_modelopt_awq import _edit, assert_cuda_matches_cpu, graph_with_the_exports_weights

ATTN_IN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
MLP_IN = ("mlp.gate_proj", "mlp.up_proj")
GROUPS = (ATTN_IN, ("self_attn.o_proj",), MLP_IN, ("mlp.down_proj",))  # the linears that read one input
PRODUCER = {"name": "modelopt", "version": "0.35.0"}
RATIO = 0.6  # input_scale = RATIO * the calibration's max |x * s| / 127: inputs beyond saturate
QMAX, QMIN = 127, -128


def hf_quant_config(**extra) -> dict:
    return {"producer": PRODUCER, "quantization": {"quant_algo": "W8A8_SQ_PER_CHANNEL", "kv_cache_quant_algo": None,
                                                   "exclude_modules": ["lm_head"], **extra}}


FLAT = {"ignore": ["lm_head"], "quant_algo": "W8A8_SQ_PER_CHANNEL", "producer": PRODUCER, "quant_method": "modelopt"}


# --- this file's own export -------------------------------------------------------------------------------------
def export_linear(w: torch.Tensor, s: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The exported tensors of a linear w [N, K] whose input SmoothQuant multiplies by s [K], and their dequantization
    q * weight_scale [N, K] (fp32): the codes are of w / s, so that dequant (x * s) stands for w x."""
    smoothed = w / s[None, :]
    scale = smoothed.abs().amax(1) / 127  # [N], fp32
    codes = (smoothed / scale[:, None]).round().clamp(-128, 127).to(torch.int8)
    return {"weight": codes, "weight_scale": scale}, codes.float() * scale[:, None]


def modelopt_codes(x: torch.Tensor, s: torch.Tensor, input_scale: torch.Tensor, qmin: int = QMIN) -> torch.Tensor:
    """ModelOpt's W8A8_SQ activation codes of x [..., K]: x * s (in x's dtype, as the runtime takes the product), then
    x * s / input_scale rounded half to even, clamped to qmin..127 (ModelOpt: -128, narrow_range false)."""
    xs = (x.float() * s).to(x.dtype).float()
    return torch.round(xs / input_scale.float()).clamp(qmin, QMAX)


@dataclass
class Export:
    checkpoint: Path
    weights: dict[str, torch.Tensor]  # module -> dequant(W) [N, K] fp32
    scales: dict[str, torch.Tensor]  # module -> its pre_quant_scale as stored, in fp32
    input_scales: dict[str, torch.Tensor]  # module -> its input_scale (fp32, 0-d)


@functools.lru_cache(maxsize=4)
def calibration_amax(base: Path, ids: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """module -> per-input-channel max |x| of each decoder linear's input on ``ids`` (the fp32 model, unquantized)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    amax, hooks = {}, []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name:
            hooks.append(module.register_forward_pre_hook(
                lambda mod, args, name=name: amax.__setitem__(name, args[0].abs().reshape(-1, args[0].shape[-1])
                                                               .amax(0))))
    with torch.no_grad():
        model(torch.tensor([ids]), use_cache=False)
    for h in hooks:
        h.remove()
    return amax


def export(base: Path, out: Path, calib_ids: list[int], scale_dtype: torch.dtype = torch.float32, seed: int = 0,
           files: dict | None = None, config: dict | None = None) -> Export:
    """``base`` (fp32) exported as ModelOpt W8A8_SQ_PER_CHANNEL: per group of linears reading one input a random
    positive s (e^(0.5 N(0, 1)), far from ones) stored as ``scale_dtype`` pre_quant_scale on each, and one
    input_scale = RATIO * max |x * s| / 127 over the calibration ids ``calib_ids``."""
    amax = calibration_amax(base, tuple(calib_ids))
    shutil.copytree(base, out)
    tensors = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    weights, scales, input_scales = {}, {}, {}
    layers = json.loads((base / "config.json").read_text())["num_hidden_layers"]
    for layer in range(layers):
        prefix = f"model.layers.{layer}"
        for group in GROUPS:
            k = tensors[f"{prefix}.{group[0]}.weight"].shape[1]
            s = torch.exp(0.5 * torch.randn(k, generator=gen)).to(scale_dtype)
            x_amax = torch.stack([amax[f"{prefix}.{lin}"] for lin in group]).amax(0)
            input_scale = (RATIO * (x_amax * s.float()).amax() / 127).float().reshape(())
            for lin in group:
                module = f"{prefix}.{lin}"
                stored, weights[module] = export_linear(tensors.pop(f"{module}.weight"), s.float())
                tensors.update({f"{module}.{k}": v for k, v in stored.items()})
                tensors[f"{module}.pre_quant_scale"], scales[module] = s.clone(), s.float()
                tensors[f"{module}.input_scale"], input_scales[module] = input_scale.clone(), input_scale
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = FLAT if config is None else config
    (out / "config.json").write_text(json.dumps(cfg))
    for name, data in ({"hf_quant_config.json": hf_quant_config()} if files is None else files).items():
        (out / name).write_text(json.dumps(data))
    return Export(out, weights, scales, input_scales)


def reference_model(exp: Export, qmin: int = QMIN) -> torch.nn.Module:
    """The export's model in transformers (fp32): its float tensors, each quantized linear holding dequant(W) and
    reading its input as ModelOpt quantizes it: (x * s) to codes qmin..127, times input_scale."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(exp.checkpoint)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v for k, v in load_file(exp.checkpoint / "model.safetensors").items() if k in model.state_dict()}
    state.update({f"{m}.weight": w for m, w in exp.weights.items()})
    model.load_state_dict(state, strict=True)
    for m in exp.weights:
        s, xs = exp.scales[m], exp.input_scales[m]
        model.get_submodule(m).register_forward_pre_hook(
            lambda mod, args, s=s, xs=xs: ((modelopt_codes(args[0], s, xs, qmin) * xs).to(args[0].dtype),))
    return model.eval()


def graph_logits(graph: dict, params: dict[str, torch.Tensor], ids: list[int], **kwargs) -> torch.Tensor:
    """The runtime executor's logits of ``ids`` (one prefill) over a graph.json dict."""
    from runtime.executor import Executor, SeqSlice, StepInput
    from runtime.kv_cache import SequenceKV

    ex = Executor(graph, params, **kwargs)
    kv = SequenceKV(ex.kv_layout(), len(ids))
    return ex.forward(StepInput(torch.tensor(ids), torch.arange(len(ids)), [SeqSlice(kv, 0, len(ids))]))


def linear_inputs(graph: dict, params: dict[str, torch.Tensor], ids: list[int]) -> dict[str, torch.Tensor]:
    """source of each quantized linear node -> the input [tokens, in] the runtime's reference path hands it."""
    from runtime.executor import Executor, SeqSlice, StepInput
    from runtime.kv_cache import SequenceKV

    ex, seen = Executor(graph, params), {}

    def observe(index: int, xs: list[torch.Tensor]) -> None:
        node = graph["nodes"][index]
        if node["op"] == "linear" and node["attrs"].get("quant"):
            seen[node["source"]] = xs[0].clone()

    kv = SequenceKV(ex.kv_layout(), len(ids))
    ex.run_nodes(ex.start(StepInput(torch.tensor(ids), torch.arange(len(ids)), [SeqSlice(kv, 0, len(ids))])), 0,
                 len(graph["nodes"]), observe)
    return seen


CALIB_SEED, PROMPT_SEED = 1, 11


def random_ids(seed: int, n: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    from conftest import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("modelopt-sq-base") / "fp32", "llama", seed=7,
                           intermediate_size=128, tie_word_embeddings=False)


def vocab_of(path: Path) -> int:
    return json.loads((path / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def built(base, tmp_path_factory):
    """(the export, the artifact ``builder build`` made of it)."""
    root = tmp_path_factory.mktemp("modelopt-sq")
    exp = export(base, root / "ckpt", random_ids(CALIB_SEED, 40, vocab_of(base)))
    res = run_build(exp.checkpoint, root / "artifact")
    assert res.exit_code == 0, res.output
    return exp, root / "artifact"


def test_sq_export_builds_with_its_codes_scales_and_full_int8_range(built):
    from runtime import Engine, SamplingParams

    exp, artifact = built
    graph, params = graph_with_the_exports_weights(artifact, exp)
    linears = [n for n in graph["nodes"] if n["attrs"].get("quant")]
    assert len(linears) == 8  # q/k/v and gate/up merged: they share s and input_scale, as the export makes them
    for node in linears:
        assert node["attrs"]["quant"] == {"scheme": "w8a8_int8", "activations": "static", "source": "modelopt",
                                          "act_qmin": -128}, node["attrs"]["quant"]
        member = node["weights"]["qweight"].rsplit(".", 1)[0].rpartition(".")
        first = f"{member[0]}.{member[2].split('+')[0]}"  # the merged node's first member: the group's s
        pqs, xs = params[node["weights"]["pre_quant_scale"]], params[node["weights"]["input_scale"]]
        assert pqs.dtype == torch.float32 and torch.equal(pqs, exp.scales[first])
        assert torch.equal(xs, exp.input_scales[first].reshape(1))
    record = json.loads((artifact / "manifest.json").read_text())["quantization"]["prequantized"]
    want = {"source": "modelopt", "quant_algo": "W8A8_SQ_PER_CHANNEL", "scheme": "w8a8_int8", "bits": 8,
            "activations": "static", "schemes": {"w8a8_int8": 14}, "num_linears": 14, "pre_quant_scale_linears": 14}
    assert {k: record.get(k) for k in want} == want, record

    vocab = vocab_of(exp.checkpoint)
    ids = random_ids(PROMPT_SEED, 40, vocab)
    # the input saturates at the negative end: each linear (the runtime's reference path) computes its output from
    # ModelOpt's codes, -128 included, which a -127 clamp would move
    from kernels.torch_quant import make_quant_linear

    saturated, inputs = 0, linear_inputs(graph, params, ids)
    for node, x in ((n, inputs[n["source"]]) for n in linears):
        w = {role: params[name] for role, name in node["weights"].items()}
        codes = modelopt_codes(x, w["pre_quant_scale"], w["input_scale"])
        saturated += int((codes == QMIN).sum())
        want = (codes * w["input_scale"]) @ (w["qweight"].float() * w["weight_scale"][:, None]).t()
        got = make_quant_linear("w8a8_int8", w, node["attrs"]["quant"], torch.float32)(x)
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item(), node["source"]
    assert saturated > 20, saturated

    model = reference_model(exp)
    engine = Engine.load(artifact)
    with torch.no_grad():
        expected = model(torch.tensor([ids]), use_cache=False).logits[0]
    err = (engine.logits(ids) - expected).abs().max().item()
    assert err < 1e-5, f"logits differ from ModelOpt's quantization by {err:.3g}"
    # the range matters: the same artifact clamping at -127 (the IR's default) is measurably off on this input
    clamped = copy.deepcopy(graph)
    for node in clamped["nodes"]:
        node["attrs"].get("quant", {}).pop("act_qmin", None)
    clamped_logits = graph_logits(clamped, params, ids)
    off = (clamped_logits - expected).abs().max().item()
    assert off > 100 * max(err, 1e-6) and off > 1e-3, (off, err)
    with torch.no_grad():
        near = (reference_model(exp, qmin=-127)(torch.tensor([ids]), use_cache=False).logits[0]
                - clamped_logits).abs().max().item()
    assert near < 1e-5, near  # ... and is the -127 reference's: the attr is all that moved
    prompt = random_ids(PROMPT_SEED + 1, 12, vocab)
    tokens = engine.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)).token_ids
    with torch.no_grad():
        hf_next = model(torch.tensor([prompt + tokens[:-1]]), use_cache=False).logits[0, len(prompt) - 1:].argmax(-1)
    assert tokens == hf_next.tolist()


def test_the_triton_kernels_clamp_at_minus_128_and_give_the_reference_paths_tokens(built, monkeypatch):
    """The kernel path (under TRITON_INTERPRET=1 on the CPU): a prefill's rows are quantized at the static scale for the
    W8A8 rows GEMM (``kernels.w8a8_rows``; ``quantize_rows_static``), a decode step's row runs the GEMV, both told
    act_qmin -128 (each clamps its static codes there, tests/kernels/test_w8a8_rows.py and test_gemv.py), after the
    pre_quant_scale multiply: the reference path's logits and greedy tokens."""
    from kernels import gemv, w8a8_gemm
    from runtime import Engine, SamplingParams

    exp, artifact = built
    calls, below = [], {"rows": 0, "gemv": 0}  # kernel -> inputs (x * s) below -127.5 * input_scale it was handed

    def spy_gemv(x, qweight, weight_scale, input_scale, *args, **kwargs):
        calls.append(("gemv", kwargs.get("act_qmin")))
        below["gemv"] += int((x.float() / input_scale < QMIN + 0.5).sum())
        return real_gemv(x, qweight, weight_scale, input_scale, *args, **kwargs)

    def spy_rows(x, input_scale, dtype, act_qmin=-127):
        calls.append(("rows", act_qmin))
        below["rows"] += int((x.float() / input_scale < QMIN + 0.5).sum())
        return real_rows(x, input_scale, dtype, act_qmin=act_qmin)

    real_gemv, real_rows = gemv.w8a8_gemv, w8a8_gemm.quantize_rows_static
    monkeypatch.setattr(gemv, "w8a8_gemv", spy_gemv)
    monkeypatch.setattr(w8a8_gemm, "quantize_rows_static", spy_rows)  # read when a linear loads
    ref, fused = Engine.load(artifact), Engine.load(artifact, use_kernels=True)
    assert fused.executor.use_kernels
    vocab = vocab_of(exp.checkpoint)
    ids = random_ids(PROMPT_SEED, 12, vocab)
    err = (fused.logits(ids) - ref.logits(ids)).abs().max().item()
    assert err < 1e-4, err
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert fused.generate(ids, params).token_ids == ref.generate(ids, params).token_ids
    assert sorted(set(calls)) == [("gemv", -128), ("rows", -128)], sorted(set(calls))
    assert below["rows"] > 0 and below["gemv"] > 0, below  # codes of -128 went through both paths


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="the Triton kernel path on a GPU (TRITON_INTERPRET=0)")
def test_sq_export_on_cuda_gives_the_cpu_paths_tokens(tmp_path):
    """On CUDA (the kernels, the W8A8 rows GEMM at 2-256 rows, the serving engine's CUDA graphs) the export's
    artifact gives the CPU reference path's logits and greedy tokens: the pre_quant_scale multiply, then static int8
    codes down to -128. Heads of 32 (the kernels' smallest); pre_quant_scale stored bf16, as a bf16 export's."""
    from conftest import make_checkpoint

    base = make_checkpoint(tmp_path / "base", "llama", seed=3, num_attention_heads=2, num_key_value_heads=1,
                           intermediate_size=128, tie_word_embeddings=False)
    exp = export(base, tmp_path / "ckpt", random_ids(CALIB_SEED, 40, vocab_of(base)), torch.bfloat16)
    res = run_build(exp.checkpoint, tmp_path / "artifact")
    assert res.exit_code == 0, res.output
    assert_cuda_matches_cpu(tmp_path / "artifact", torch.Generator().manual_seed(PROMPT_SEED))


def test_an_act_qmin_the_runtime_does_not_run_is_refused(built):
    """A w8a8_int8 linear whose act_qmin is not -127 or -128, or an act_qmin on another scheme, fails at load naming
    it (the manifest check, the executor, Graph.check) instead of running with another clamp."""
    from passes.ir import Graph, GraphError
    from runtime.executor import Executor, GraphFormatError
    from runtime.manifest import ManifestError, check_graph

    exp, artifact = built
    graph = json.loads((artifact / "graph.json").read_text())
    params = load_file(artifact / "weights.safetensors")
    manifest = json.loads((artifact / "manifest.json").read_text())
    check_graph(manifest, graph)  # as built: -128
    node = next(n for n in graph["nodes"] if n["attrs"].get("quant"))
    where = re.escape(node["source"])
    for value, scheme in ((-129, "w8a8_int8"), (-128.5, "w8a8_int8"), (True, "w8a8_int8"), (-128, "fp8")):
        bad = copy.deepcopy(graph)
        quant = next(n for n in bad["nodes"] if n["source"] == node["source"])["attrs"]["quant"]
        quant.update(act_qmin=value, scheme=scheme)
        with pytest.raises(ManifestError, match=rf"graph\.json linear {where}: quant act_qmin {re.escape(repr(value))} "
                                                rf"on a {scheme} linear is not one this runtime runs; allowed: -127 or "
                                                rf"-128, on w8a8_int8 linears only"):
            check_graph(manifest, bad)
        with pytest.raises(GraphFormatError, match=rf"linear {where}: quant act_qmin {re.escape(repr(value))} on "
                                                   rf"scheme '{scheme}': this runtime runs act_qmin -127 or -128 on "
                                                   rf"w8a8_int8 linears only"):
            Executor(bad, params)
        with pytest.raises(GraphError, match=rf"quant act_qmin {re.escape(repr(value))} on scheme {scheme}"):
            Graph.from_dict(bad, params).check()


def test_tensor_parallel_keeps_the_scales_whole_or_cuts_them_with_the_input_columns(base, tmp_path, monkeypatch):
    """At tp_size 2 the column-parallel q/k/v and gate/up hold the whole pre_quant_scale and input_scale (they read
    the whole input), the row-parallel o_proj and down_proj scale and quantize the input columns each rank holds with
    the one static input_scale: the ranks' partial sums add up to the one-device graph's logits."""
    from builder.checkpoint import open_checkpoint
    from passes import PassContext, run_passes
    from passes.ir import Slice
    from passes.trace import trace
    from tests.passes.test_shard import PIPELINE, PROMPTS, _logits, _shard, run_ranks
    from runtime.executor import Executor

    exp = export(base, tmp_path / "ckpt", random_ids(CALIB_SEED, 40, vocab_of(base)), seed=2)
    graph = attach(trace(open_checkpoint(exp.checkpoint).hf_config()), exp.checkpoint)
    graph, _ = run_passes(graph, PIPELINE, PassContext())
    refs = _logits(Executor(graph.to_dict(), graph.params), PROMPTS)
    sharded, _ = _shard(graph, 2)
    qkv = next(n for n in sharded.nodes if "q_proj+k_proj+v_proj" in n.weights.get("qweight", ""))
    down = next(n for n in sharded.nodes if n.source.endswith("down_proj"))
    slices, whole = sharded.shards.slices, [(), ()]  # per rank: the pieces it holds; () the whole tensor
    assert slices[qkv.weights["pre_quant_scale"]] == whole and slices[qkv.weights["input_scale"]] == whole
    assert slices[down.weights["pre_quant_scale"]] == [(Slice(0, 0, 64),), (Slice(0, 64, 128),)]
    assert slices[down.weights["input_scale"]] == whole
    assert down.attrs["quant"]["act_qmin"] == -128 and down.attrs["in_features"] == 64
    for rank_logits in run_ranks(sharded, PROMPTS, monkeypatch):
        for ours, ref in zip(rank_logits, refs):
            assert (ours - ref).abs().max().item() < 1e-4


# --- malformed exports ------------------------------------------------------------------------------------------
Q = "model.layers.0.self_attn.q_proj"
D = "model.layers.1.mlp.down_proj"


@pytest.mark.parametrize("edit, message", [
    (dict(drop=f"{Q}.input_scale"),
     rf"tensor '{Q}\.input_scale' is missing; a modelopt quantized linear stores weight, weight_scale, input_scale "
     rf"\(found weight, weight_scale\)"),
    (dict(replace={f"{Q}.input_scale": torch.tensor([0.1, 0.2])}),
     rf"tensor '{Q}\.input_scale' is float32 \(2,\); expected float16 or bfloat16 or float32 \(1,\) \(one activation "
     rf"scale\)"),
    (dict(replace={f"{Q}.input_scale": torch.tensor(0.0)}),
     rf"tensor '{Q}\.input_scale' is 0\.0; expected a positive finite activation scale"),
    (dict(replace={f"{Q}.pre_quant_scale": torch.ones(63)}),
     rf"tensor '{Q}\.pre_quant_scale' is float32 \(63,\); expected float16 or bfloat16 or float32 \(64,\) \(one scale "
     rf"per input feature of the 64: the linear computes W \(x \* pre_quant_scale\)\)"),
    (dict(replace={f"{D}.pre_quant_scale": torch.ones(64)}),  # down_proj reads the 128 intermediate features
     rf"tensor '{D}\.pre_quant_scale' is float32 \(64,\); expected float16 or bfloat16 or float32 \(128,\)"),
    (dict(replace={f"{Q}.pre_quant_scale": torch.full((64,), float("nan"))}),
     rf"tensor '{Q}\.pre_quant_scale' holds nan at \[0\] \(64 of 64 values are not finite\); the checkpoint is "
     rf"corrupt"),
    (dict(replace={f"{Q}.weight_scale": torch.ones(1)}),
     rf"tensor '{Q}\.weight_scale' is float32 \(1,\); expected a float tensor of shape \(64, 1\) \(one scale per "
     rf"output channel\)"),
    (dict(replace={f"{Q}.weight_scale": torch.ones(64, 2)}),
     rf"tensor '{Q}\.weight_scale' is float32 \(64, 2\); expected a float tensor of shape \(64, 1\)"),
    (dict(replace={f"{Q}.weight": torch.zeros(64, 64, dtype=torch.uint8)}),
     rf"tensor '{Q}\.weight' is uint8 \(64, 64\); expected int8 \(64, 64\) \(the linear's codes \[out_features, "
     rf"in_features\]\)"),
], ids=["missing-input-scale", "input-scale-shape", "input-scale-zero", "pre-quant-scale-shape",
        "down-pre-quant-scale-shape", "pre-quant-scale-nan", "weight-scale-per-tensor", "weight-scale-groups",
        "weight-uint8"])
def test_malformed_sq_export_fails_naming_the_tensor(base, tmp_path, edit, message):
    from builder.checkpoint import CheckpointError, open_checkpoint
    from passes.trace import trace

    exp = export(base, tmp_path / "ckpt", random_ids(CALIB_SEED, 40, vocab_of(base)))
    _edit(exp.checkpoint, **edit)
    with pytest.raises(CheckpointError, match=message) as info:
        attach(trace(open_checkpoint(base).hf_config()), exp.checkpoint)
    assert "\n" not in str(info.value)


def test_an_export_without_pre_quant_scales_imports_too(base, tmp_path):
    """INT8_DEFAULT_CFG (ModelOpt's max calibration, no SmoothQuant) exports W8A8_SQ_PER_CHANNEL as well, without
    pre_quant_scale tensors: the linears import with static codes down to -128 and no input scale role."""
    from builder.checkpoint import open_checkpoint
    from passes.trace import trace

    exp = export(base, tmp_path / "ckpt", random_ids(CALIB_SEED, 40, vocab_of(base)))
    tensors = load_file(exp.checkpoint / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.endswith("pre_quant_scale")},
              exp.checkpoint / "model.safetensors", metadata={"format": "pt"})
    graph = attach(trace(open_checkpoint(base).hf_config()), exp.checkpoint)
    quantized = [n for n in graph.nodes if "quant" in n.attrs]
    assert len(quantized) == 14 and not any("pre_quant_scale" in n.weights for n in quantized)
    assert all(n.attrs["quant"]["act_qmin"] == -128 and "input_scale" in n.weights for n in quantized)
