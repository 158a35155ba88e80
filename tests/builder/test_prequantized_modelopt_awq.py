"""NVIDIA ModelOpt W4A16_AWQ checkpoints (``export_hf_checkpoint`` of an INT4_AWQ_CFG model) build into artifacts
holding their own codes, with AWQ's per-input-channel ``pre_quant_scale`` applied exactly.

The export layout, as ModelOpt's source writes it (``modelopt/torch/export/quant_utils.py``: pack_int4_in_uint8,
process_layer_quant_config, postprocess_state_dict; ``unified_export_hf.py``: requantize_resmooth_fused_llm_layers,
fuse_prequant_layernorm), written here independently of ``builder/prequantized.py``:

- ``weight`` uint8 [N/2, K]: symmetric int4 codes q = round(w / scale) clamped to -8..7, packed two output rows a byte
  along N (row 2i in the low nibble, 2i+1 in the high one, two's complement);
- ``weight_scale`` fp32 [N, K / group]: amax / 7 of each output row's group of ``group_size`` input features;
- AWQ's input scale s (the linear computes W (x * s), W quantized from w / s): folded into the norm before q/k/v and
  gate/up (the norm's weight times s, no tensor left on the linears), kept as ``pre_quant_scale`` [K] (the export's
  dtype) on o_proj and down_proj, whose inputs no norm writes;
- hf_quant_config.json: ``quant_algo: W4A16_AWQ``, ``group_size``, ``has_zero_point: false``, ``pre_quant_scale:
  true``, ``exclude_modules``; config.json's quantization_config (ModelOpt 0.29 on) carries quant_algo and ignore only.

A tiny fp32 Llama and Qwen3 are exported so, built with ``builder build`` (its verify included), and checked: the
artifact's codes dequantize to this file's weights exactly and its o_proj / down_proj carry the checkpoint's scales;
the runtime's logits match a Hugging Face model whose linears hold dequant(W) * s[None, :] within 1e-5 (fp32) and its
greedy tokens are that model's; the same artifact with the scales dropped is far from it (the test can fail). The
kernel path scales x before its kernels and plans no fusion into those linears; tensor parallelism cuts the scales
with the input columns. Malformed exports fail naming the tensor or field and what is allowed.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_prequantized import attach, ir_weights, run_build

GROUP = 32
ATTN_IN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
MLP_IN = ("mlp.gate_proj", "mlp.up_proj")
KEPT = ("self_attn.o_proj", "mlp.down_proj")  # the linears whose pre_quant_scale the export keeps
PRODUCER = {"name": "modelopt", "version": "0.35.0"}


def hf_quant_config(group: int | None = GROUP, **extra) -> dict:
    q = {"quant_algo": "W4A16_AWQ", "kv_cache_quant_algo": None, "group_size": group, "has_zero_point": False,
         "pre_quant_scale": True, "exclude_modules": ["lm_head"], **extra}
    return {"producer": PRODUCER, "quantization": {k: v for k, v in q.items() if v is not None or k != "group_size"}}


FLAT = {"ignore": ["lm_head"], "quant_algo": "W4A16_AWQ", "producer": PRODUCER, "quant_method": "modelopt"}


# --- this file's own export -------------------------------------------------------------------------------------
def export_linear(w: torch.Tensor, s: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The exported tensors of a linear w [N, K] whose input AWQ multiplies by s [K], and their dequantization
    q * scale [N, K] (fp32): the codes are of w / s, so that dequant (x * s) stands for w x."""
    n, k = w.shape
    smoothed = (w / s[None, :]).view(n, k // group, group)
    scale = smoothed.abs().amax(-1) / 7  # [N, K / group], fp32
    codes = torch.round(smoothed / scale[..., None]).clamp(-8, 7).to(torch.int16).view(n, k)
    nibbles = codes & 0xF  # two's complement in 4 bits
    packed = (nibbles[0::2] | (nibbles[1::2] << 4)).to(torch.uint8)  # [N/2, K]: row 2i low, row 2i+1 high
    return {"weight": packed, "weight_scale": scale}, codes.float() * scale.repeat_interleave(group, dim=1)


@dataclass
class Export:
    checkpoint: Path
    weights: dict[str, torch.Tensor]  # module -> dequant(W) [N, K] fp32
    scales: dict[str, torch.Tensor]  # module -> its pre_quant_scale as stored, in fp32 (o_proj, down_proj)


def export(base: Path, out: Path, scale_dtype: torch.dtype = torch.float32, group: int = GROUP, seed: int = 0,
           files: dict | None = None, config: dict | None = None) -> Export:
    """``base`` (fp32) exported as ModelOpt W4A16_AWQ: random positive AWQ scales (e^(0.5 N(0, 1)), far from ones)
    folded into the norms before q/k/v and gate/up, kept as ``scale_dtype`` pre_quant_scale on o_proj / down_proj."""
    shutil.copytree(base, out)
    tensors = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    weights, scales = {}, {}
    layers = json.loads((base / "config.json").read_text())["num_hidden_layers"]
    for layer in range(layers):
        prefix = f"model.layers.{layer}"
        for norm, linears in (("input_layernorm", ATTN_IN), ("post_attention_layernorm", MLP_IN)):
            s = torch.exp(0.5 * torch.randn(tensors[f"{prefix}.{norm}.weight"].shape, generator=gen))
            tensors[f"{prefix}.{norm}.weight"] = tensors[f"{prefix}.{norm}.weight"] * s  # fuse_prequant_layernorm
            for lin in linears:
                stored, weights[f"{prefix}.{lin}"] = export_linear(tensors.pop(f"{prefix}.{lin}.weight"), s, group)
                tensors.update({f"{prefix}.{lin}.{k}": v for k, v in stored.items()})
        for lin in KEPT:
            module = f"{prefix}.{lin}"
            w = tensors.pop(f"{module}.weight")
            s = torch.exp(0.5 * torch.randn(w.shape[1], generator=gen)).to(scale_dtype)
            stored, weights[module] = export_linear(w, s.float(), group)
            tensors.update({f"{module}.{k}": v for k, v in stored.items()})
            tensors[f"{module}.pre_quant_scale"], scales[module] = s, s.float()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = FLAT if config is None else config
    (out / "config.json").write_text(json.dumps(cfg))
    for name, data in ({"hf_quant_config.json": hf_quant_config(group)} if files is None else files).items():
        (out / name).write_text(json.dumps(data))
    return Export(out, weights, scales)


def reference_model(exp: Export) -> torch.nn.Module:
    """The export's model in transformers (fp32): the checkpoint's norms (scales folded in) and float tensors, each
    linear holding dequant(W), times s[None, :] where the linear keeps a pre_quant_scale: W (x * s) = (W s) x."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(exp.checkpoint)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v for k, v in load_file(exp.checkpoint / "model.safetensors").items() if k in model.state_dict()}
    state.update({f"{m}.weight": w * exp.scales[m][None, :] if m in exp.scales else w for m, w in exp.weights.items()})
    model.load_state_dict(state, strict=True)
    return model.eval()


def graph_logits(graph: dict, params: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """The runtime executor's logits of ``ids`` (one prefill) over a graph.json dict."""
    from runtime.executor import Executor, SeqSlice, StepInput
    from runtime.kv_cache import SequenceKV

    ex = Executor(graph, params)
    kv = SequenceKV(ex.kv_layout(), len(ids))
    return ex.forward(StepInput(torch.tensor(ids), torch.arange(len(ids)), [SeqSlice(kv, 0, len(ids))]))


FAMILIES = {  # family -> the tiny checkpoint's overrides (intermediate 128: groups of 32 tile the down projection)
    "llama": dict(intermediate_size=128, tie_word_embeddings=False),
    "qwen3": dict(intermediate_size=128),  # head_dim 24: o_proj reads 96 features, three groups
}


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    from conftest import make_checkpoint

    root = tmp_path_factory.mktemp("modelopt-awq-base")
    return {f: make_checkpoint(root / f, f, seed=7 + i, **FAMILIES[f]) for i, f in enumerate(FAMILIES)}


@pytest.fixture(scope="module")
def built(bases, tmp_path_factory):
    """family -> (its export, the artifact ``builder build`` made of it): Llama's scales stored bf16 (a bf16
    export's), Qwen3's fp32."""
    cache = {}

    def get(family: str):
        if family not in cache:
            root = tmp_path_factory.mktemp(f"modelopt-awq-{family}")
            exp = export(bases[family], root / "ckpt", torch.bfloat16 if family == "llama" else torch.float32)
            res = run_build(exp.checkpoint, root / "artifact")
            assert res.exit_code == 0, res.output
            cache[family] = (exp, root / "artifact")
        return cache[family]

    return get


def graph_with_the_exports_weights(artifact: Path, exp) -> tuple[dict, dict[str, torch.Tensor]]:
    """The artifact's graph and parameters, after checking that its linears' weights (as the IR dequantizes them)
    are the export's, module for module."""
    graph = json.loads((artifact / "graph.json").read_text())
    params = load_file(artifact / "weights.safetensors")
    ours = ir_weights(graph["nodes"], params)
    assert sorted(ours) == sorted(exp.weights)
    for module, w in exp.weights.items():
        assert torch.equal(ours[module], w), f"{module}: the artifact's weight is not the export's"
    return graph, params


@pytest.mark.parametrize("family", list(FAMILIES))
def test_awq_export_builds_with_its_codes_and_scales(family, built):
    from runtime import Engine, SamplingParams

    exp, artifact = built(family)
    graph, params = graph_with_the_exports_weights(artifact, exp)
    scaled = {n["source"]: params[n["weights"]["pre_quant_scale"]] for n in graph["nodes"]
              if "pre_quant_scale" in n["weights"]}
    assert sorted(scaled) == sorted(exp.scales)  # o_proj, down_proj; the merged q/k/v and gate/up carry none
    for module, s in exp.scales.items():
        assert scaled[module].dtype == torch.float32 and torch.equal(scaled[module], s)
    quants = [n["attrs"]["quant"] for n in graph["nodes"] if n["attrs"].get("quant")]
    assert all(q == {"scheme": "w4a16", "bits": 4, "group_size": GROUP, "source": "modelopt"} for q in quants)
    record = json.loads((artifact / "manifest.json").read_text())["quantization"]["prequantized"]
    want = {"source": "modelopt", "quant_algo": "W4A16_AWQ", "scheme": "w4a16", "bits": 4, "group_size": GROUP,
            "schemes": {"w4a16": 14}, "num_linears": 14, "pre_quant_scale_linears": 4, "act_order_linears": 0}
    assert {k: record[k] for k in want} == want, record
    assert "4 scaling their input by the exporter's pre_quant_scale" in (artifact / "report.md").read_text()

    model = reference_model(exp)
    engine = Engine.load(artifact)
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(3, model.config.vocab_size, (40,), generator=gen).tolist()
    with torch.no_grad():
        expected = model(torch.tensor([ids]), use_cache=False).logits[0]
    ours_logits = engine.logits(ids)
    err = (ours_logits - expected).abs().max().item()
    assert err < 1e-5, f"logits differ from the dequantized model by {err:.3g}"
    # the scales matter: without them (the same artifact, the role dropped) the logits are far off
    dropped = copy.deepcopy(graph)
    for node in dropped["nodes"]:
        node["weights"].pop("pre_quant_scale", None)
    off = (graph_logits(dropped, params, ids) - expected).abs().max().item()
    assert off > 1000 * max(err, 1e-6) and off > 0.05, off
    prompt = torch.randint(3, model.config.vocab_size, (12,), generator=gen).tolist()
    tokens = engine.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)).token_ids
    with torch.no_grad():
        hf_next = model(torch.tensor([prompt + tokens[:-1]]), use_cache=False).logits[0, len(prompt) - 1:].argmax(-1)
    assert tokens == hf_next.tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel path on a GPU")
def test_awq_export_on_cuda_gives_the_cpu_paths_tokens(tmp_path):
    """On CUDA (the kernels, the serving engine's CUDA graphs) the export's artifact gives the CPU reference path's
    logits and greedy tokens: the pre_quant_scale multiply before the W4A16 kernels, on a GPU. Heads of 32 (the
    kernels' smallest)."""
    from conftest import make_checkpoint

    base = make_checkpoint(tmp_path / "base", "llama", seed=3, num_attention_heads=2, num_key_value_heads=1,
                           **FAMILIES["llama"])
    exp = export(base, tmp_path / "ckpt", torch.bfloat16)
    res = run_build(exp.checkpoint, tmp_path / "artifact")
    assert res.exit_code == 0, res.output
    assert_cuda_matches_cpu(tmp_path / "artifact", torch.Generator().manual_seed(5))


def assert_cuda_matches_cpu(artifact: Path, gen: torch.Generator) -> None:
    """The artifact on CUDA (the kernels; the serving engine's CUDA graphs) against the CPU reference path: logits of a
    fresh random prompt within 1e-3, greedy tokens of three prompts equal, offline and served, up to a near-tie (see
    ``assert_same_greedy``)."""
    from runtime import Engine, SamplingParams
    from runtime.serving import ServingConfig, ServingEngine

    cpu, gpu = Engine.load(artifact), Engine.load(artifact, device="cuda")
    assert gpu.executor.use_kernels
    vocab = cpu.tokenizer.vocab_size
    ids = torch.randint(3, vocab, (40,), generator=gen).tolist()
    err = (cpu.logits(ids) - gpu.logits(ids).cpu()).abs().max().item()
    assert err < 1e-3, err
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (12, 5, 30)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = [cpu.generate(p, params).token_ids for p in prompts]
    served = ServingEngine(gpu, ServingConfig(num_blocks=64)).run(prompts, params)
    for prompt, expected, offline, online in zip(prompts, want, [gpu.generate(p, params).token_ids for p in prompts],
                                                 [o.token_ids for o in served]):
        assert_same_greedy(cpu, prompt, expected, offline, 2 * err)
        assert_same_greedy(cpu, prompt, expected, online, 2 * err)


def assert_same_greedy(reference, prompt: list[int], want: list[int], got: list[int], tol: float) -> None:
    """``got`` (greedy tokens of another path) equals ``want`` (the reference's), or the two part at a near-tie: at
    the first token where they differ, the reference's logits after the tokens both produced rank ``got``'s token
    within ``tol`` of its own (two paths whose logits differ by rounding may each take the other's runner-up; past
    that point each continues its own text, which is not compared). ``tol``: twice the logits' measured difference,
    so a path that is wrong rather than rounded differently (a gap larger than its own rounding) still fails."""
    assert len(got) == len(want), (got, want)
    i = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), None)
    if i is None:
        return
    logits = reference.logits(prompt + want[:i])[-1]
    gap = (logits[want[i]] - logits[got[i]]).item()
    assert gap <= tol, f"greedy tokens part at {i} ({want[i]} vs {got[i]}) with a logit gap of {gap:.3g} > {tol:.3g}"


def test_greedy_paths_may_part_only_at_a_near_tie():
    """assert_same_greedy (the CUDA tests' comparison) passes equal tokens and a parting at a near-tie, and fails a
    parting whose token the reference ranks clearly lower."""
    class Reference:
        def logits(self, ids):
            out = torch.zeros(len(ids), 8)
            out[-1, 3], out[-1, 5], out[-1, 6] = 1.0, 0.999, 0.5
            return out

    assert_same_greedy(Reference(), [1], [2, 3, 4], [2, 3, 4], 0.0)
    assert_same_greedy(Reference(), [1], [2, 3, 4], [2, 5, 1], 2e-3)
    with pytest.raises(AssertionError, match=r"part at 1 \(3 vs 6\) with a logit gap of 0.5"):
        assert_same_greedy(Reference(), [1], [2, 3, 4], [2, 6, 1], 2e-3)


def test_a_graph_with_a_role_the_runtime_does_not_know_is_refused(built):
    """A linear carrying a weight role the runtime does not run fails at load, naming it, instead of running without
    it (the manifest check and the executor both)."""
    from runtime.executor import Executor, GraphFormatError
    from runtime.manifest import ManifestError, check_graph

    exp, artifact = built("llama")
    graph = json.loads((artifact / "graph.json").read_text())
    params = load_file(artifact / "weights.safetensors")
    node = next(n for n in graph["nodes"] if "pre_quant_scale" in n["weights"])
    node["weights"]["post_quant_scale"] = node["weights"].pop("pre_quant_scale")
    with pytest.raises(GraphFormatError, match=rf"linear {re.escape(node['source'])} carries weight role\(s\) "
                                               rf"post_quant_scale, which this runtime does not run; it runs .*"
                                               rf"perm, pre_quant_scale"):
        Executor(graph, params)
    manifest = json.loads((artifact / "manifest.json").read_text())
    with pytest.raises(ManifestError, match=r"a w4a16 linear carries weight role\(s\) post_quant_scale, which this "
                                            r"runtime does not run; allowed: qweight, scales, zeros, bias, "
                                            r"input_scale, perm, pre_quant_scale"):
        check_graph(manifest, graph)


def test_the_kernel_path_scales_the_input_before_its_kernels(monkeypatch):
    """On the kernel path a linear with a pre_quant_scale hands its kernels x * s (one multiply in the activations'
    dtype where s is exact in it, else in fp32 and rounded): the same as the reference path, in bf16 too; and no
    fusion hands such a linear a SwiGLU, a pending norm or quantized rows."""
    import runtime.executor as executor
    from kernels.torch_quant import make_quant_linear
    from runtime.executor import _Fusions, _linear, plan_fusions

    gen = torch.Generator().manual_seed(3)
    out_f, in_f = 48, 64
    codes = torch.randint(0, 16, (out_f, in_f), generator=gen, dtype=torch.uint8)
    w = {"qweight": codes[:, 0::2] | (codes[:, 1::2] << 4), "scales": torch.rand(out_f, 2, generator=gen) / 50,
         "zeros": torch.full((out_f, 2), 8, dtype=torch.uint8),
         "pre_quant_scale": torch.exp(torch.randn(in_f, generator=gen)).bfloat16().float()}
    quant = {"scheme": "w4a16", "bits": 4, "group_size": 32}
    seen = []

    def kernel(weights, q, **kwargs):  # stands in for the Triton paths: records what x they get
        assert "pre_quant_scale" not in weights
        fn = make_quant_linear("w4a16", weights, q, kwargs["dtype"])
        return lambda x: seen.append(x) or fn(x)

    monkeypatch.setattr(executor, "_kernel_weight_only_linear", kernel)
    for dtype in (torch.float32, torch.bfloat16):
        ex = SimpleNamespace(use_kernels=True, dtype=dtype, _index=0, _fusions=_Fusions(set(), {}, set()),
                             _node={"op": "linear", "source": "o_proj"})
        fn = _linear(w, {"quant": quant, "in_features": in_f, "out_features": out_f}, ex)
        x = torch.randn(5, in_f, generator=gen).to(dtype)
        y = fn([x], None)[0]
        want_x = (x.float() * w["pre_quant_scale"]).to(dtype)
        assert torch.equal(seen[-1], want_x)  # one rounding of the fp32 product, as the reference path
        assert torch.equal(y, make_quant_linear("w4a16", w, quant, dtype)(x))
    # a weight-only down projection reading a SwiGLU forms it in its loads, unless it scales its input first
    nodes = [{"op": "linear", "inputs": ["x"], "outputs": ["gu"], "attrs": {"in_features": 64}, "weights": {}},
             {"op": "silu_mul", "inputs": ["gu"], "outputs": ["h"], "attrs": {}, "weights": {}},
             {"op": "linear", "inputs": ["h"], "outputs": ["y"], "weights": {},
              "attrs": {"in_features": 64, "out_features": 64, "quant": quant}}]
    consumers = {"x": 1, "gu": 1, "h": 1}
    assert plan_fusions(nodes, consumers).gated == {2}
    nodes[2]["weights"]["pre_quant_scale"] = "s"
    assert not plan_fusions(nodes, consumers).gated


def test_tensor_parallel_cuts_the_scales_with_the_input_columns(bases, tmp_path, monkeypatch):
    """At tp_size 2, o_proj and down_proj (row-parallel) scale the input columns each rank holds, so the ranks' partial
    sums add up to the one-device graph's logits."""
    from builder.checkpoint import open_checkpoint
    from passes import PassContext, run_passes
    from passes.ir import Slice
    from passes.trace import trace
    from tests.passes.test_shard import PIPELINE, PROMPTS, _logits, _shard, run_ranks
    from runtime.executor import Executor

    exp = export(bases["llama"], tmp_path / "ckpt", seed=2)
    graph = attach(trace(open_checkpoint(exp.checkpoint).hf_config()), exp.checkpoint)
    graph, _ = run_passes(graph, PIPELINE, PassContext())
    refs = _logits(Executor(graph.to_dict(), graph.params), PROMPTS)
    sharded, _ = _shard(graph, 2)
    down = next(n for n in sharded.nodes if n.source.endswith("down_proj"))
    name = down.weights["pre_quant_scale"]
    assert sharded.shards.slices[name] == [(Slice(0, 0, 64),), (Slice(0, 64, 128),)]
    assert list(sharded.params[name].shape) == [64] and down.attrs["in_features"] == 64
    for rank_logits in run_ranks(sharded, PROMPTS, monkeypatch):
        for ours, ref in zip(rank_logits, refs):
            assert (ours - ref).abs().max().item() < 1e-4


# --- malformed exports ------------------------------------------------------------------------------------------
O = "model.layers.0.self_attn.o_proj"
Q = "model.layers.0.self_attn.q_proj"


def _edit(path: Path, drop: str = "", replace: dict | None = None) -> None:
    tensors = load_file(path / "model.safetensors")
    tensors.pop(drop, None)
    tensors.update(replace or {})
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("files, config, edit, message", [
    (None, None, dict(replace={f"{O}.pre_quant_scale": torch.ones(63)}),
     rf"tensor '{O}\.pre_quant_scale' is float32 \(63,\); expected float16 or bfloat16 or float32 \(64,\) \(one scale "
     rf"per input feature of the 64: the linear computes W \(x \* pre_quant_scale\)\)"),
    (None, None, dict(replace={f"{O}.pre_quant_scale": torch.full((64,), float("inf"))}),
     rf"tensor '{O}\.pre_quant_scale' holds inf at \[0\] \(64 of 64 values are not finite\); the checkpoint is "
     rf"corrupt"),
    (None, None, dict(replace={f"{O}.pre_quant_scale": torch.zeros(64, dtype=torch.bfloat16)}),
     rf"tensor '{O}\.pre_quant_scale' is 0 in all 64 values, which zeroes the linear's whole input; expected finite "
     rf"scales, not all 0 \(AWQ's; a few zeros and negative values are allowed\)"),
    (None, None, dict(drop=f"{Q}.weight_scale"),
     rf"tensor '{Q}\.weight_scale' is missing; a modelopt quantized linear stores weight, weight_scale \(found "
     rf"weight\)"),
    (None, None, dict(replace={f"{Q}.weight": torch.zeros(64, 64, dtype=torch.uint8)}),
     rf"tensor '{Q}\.weight' is uint8 \(64, 64\); expected uint8 or int8 \(32, 64\) \(4-bit codes of the 64 x 64 "
     rf"weight, two output rows a byte\)"),
    ({"hf_quant_config.json": hf_quant_config(16)}, None, {},
     rf"tensor '{Q}\.weight_scale' is float32 \(64, 2\); expected float16 or bfloat16 or float32 \(64, 4\) \(one "
     rf"scale per output row and group of 16 of the 64 input features\)"),
    ({"hf_quant_config.json": hf_quant_config(48)}, None, {},
     rf"{Q}: W4A16_AWQ's group_size 48 does not divide its in_features 64; its weight_scale groups must tile the "
     rf"input \(a group_size dividing every quantized linear's in_features"),
    ({"hf_quant_config.json": hf_quant_config(0)}, None, {},
     r"hf_quant_config\.json: quantization\.group_size is 0; W4A16_AWQ needs the positive number of input features "
     r"that share one weight_scale"),
    ({}, None, {},  # config.json's flat quantization_config alone: no group size in it
     r"config\.json: quantization_config\.group_size is null; W4A16_AWQ needs the positive number of input features "
     r"that share one weight_scale \(e\.g\. 128; ModelOpt writes it to hf_quant_config\.json"),
    ({"hf_quant_config.json": hf_quant_config(has_zero_point=True)}, None, {},
     r"quantization\.has_zero_point is true; imported: false \(ModelOpt's W4A16_AWQ is symmetric"),
    ({"hf_quant_config.json": {"producer": PRODUCER, "quantization": {"quant_algo": "MIXED_PRECISION",
                                                                      "quantized_layers": {O: {"quant_algo":
                                                                                               "W4A16_AWQ"}}}}},
     {**FLAT, "quant_algo": "MIXED_PRECISION"}, {},
     rf"quantization\.quantized_layers\.{re.escape(O)}\.group_size is null; W4A16_AWQ needs"),
], ids=["scale-shape", "scale-inf", "scale-all-zero", "missing-weight-scale", "packed-along-k", "scale-groups",
        "group-48", "group-0", "flat-config-no-group", "zero-points", "mixed-no-group"])
def test_malformed_awq_export_fails_naming_the_tensor_or_field(bases, tmp_path, files, config, edit, message):
    from builder.checkpoint import CheckpointError, open_checkpoint
    from passes.trace import trace

    exp = export(bases["llama"], tmp_path / "ckpt", files=files, config=config)
    _edit(exp.checkpoint, **edit)
    with pytest.raises(CheckpointError, match=message) as info:
        attach(trace(open_checkpoint(bases["llama"]).hf_config()), exp.checkpoint)
    assert "\n" not in str(info.value)


def test_a_pre_quant_scale_is_read_as_the_runtime_loads_it():
    """_read_pre_quant_scale allows what runtime/executor.py ``_check_input_tensors`` allows at load: finite scales,
    not all 0; a few zeros and negative values (signed exports) import as stored, in fp32. All 0 (the linear's whole
    input zeroed) or a nan / inf is refused at import, naming the tensor, what it found and what is allowed: before,
    an all-0 scale imported and the built artifact was refused by the runtime at load."""
    from builder.prequantized import PrequantizedError, _read_pre_quant_scale
    from runtime.executor import GraphFormatError, _check_input_tensors

    name = f"{O}.pre_quant_scale"
    signed = torch.tensor([0.5, -2.0, 0.0, 1.25], dtype=torch.bfloat16)
    ir: dict[str, torch.Tensor] = {}
    _read_pre_quant_scale(name, {name: signed}, 4, ir, "AWQ's")
    assert ir["pre_quant_scale"].dtype == torch.float32 and torch.equal(ir["pre_quant_scale"], signed.float())
    _check_input_tensors(ir, "o_proj")  # the runtime loads what the import writes
    allowed = r"expected finite scales, not all 0 \(AWQ's; a few zeros and negative values are allowed\)"
    for values, found in ((torch.zeros(4), r"is 0 in all 4 values, which zeroes the linear's whole input"),
                          (torch.tensor([1.0, float("nan"), 1.0, 1.0]), r"holds nan \(input feature 1\)"),
                          (torch.tensor([1.0, 1.0, 1.0, float("-inf")]), r"holds -inf \(input feature 3\)")):
        ir = {}
        with pytest.raises(PrequantizedError, match=rf"^tensor '{re.escape(name)}' {found}; {allowed}$"):
            _read_pre_quant_scale(name, {name: values}, 4, ir, "AWQ's")
        assert not ir
        with pytest.raises(GraphFormatError):  # the runtime refuses each of them at load too
            _check_input_tensors({"pre_quant_scale": values}, "o_proj")


@pytest.mark.parametrize("algo, message", [
    ("W4A8_AWQ", r"int4 weights with a second, fp8 scale and static fp8 activations \(an int4 x fp8 matmul\) have no "
                 r"IR scheme"),
])
def test_other_awq_algorithms_stay_refused(bases, tmp_path, algo, message):
    from builder.checkpoint import CheckpointError, open_checkpoint

    exp = export(bases["llama"], tmp_path / "ckpt", files={"hf_quant_config.json": {
        "producer": PRODUCER, "quantization": {**hf_quant_config()["quantization"], "quant_algo": algo}}},
        config={**FLAT, "quant_algo": algo})
    with pytest.raises(CheckpointError, match=rf"quant_algo is \"{algo}\": {message}.*; imported: FP8, "
                                              rf"FP8_PER_CHANNEL_PER_TOKEN, W8A16, W4A16_AWQ, W8A8_SQ_PER_CHANNEL"):
        open_checkpoint(exp.checkpoint)


def test_experts_with_a_pre_quant_scale_are_refused(tmp_path):
    """ModelOpt keeps each expert projection's (averaged) pre_quant_scale: the moe op has no input scale, so such
    experts are refused naming why, not imported without it."""
    from test_prequantized_moe import QWEN3_MOE, make_moe_checkpoint

    base = make_moe_checkpoint(tmp_path / "fp32", "qwen3_moe", {**QWEN3_MOE, "num_hidden_layers": 1,
                                                                 "mlp_only_layers": []}, seed=4)
    shutil.copytree(base, tmp_path / "ckpt")
    tensors = load_file(tmp_path / "ckpt" / "model.safetensors")
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        module = name.removesuffix(".weight")
        s = torch.exp(0.5 * torch.randn(tensors[name].shape[1]))
        stored, _ = export_linear(tensors.pop(name), s, GROUP)
        tensors.update({f"{module}.{k}": v for k, v in stored.items()}, **{f"{module}.pre_quant_scale": s})
    save_file(tensors, tmp_path / "ckpt" / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    cfg["quantization_config"] = {**FLAT, "ignore": ["lm_head", "*mlp.gate"]}
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "ckpt" / "hf_quant_config.json").write_text(json.dumps(
        hf_quant_config(exclude_modules=["lm_head", "*mlp.gate"])))
    res = run_build(tmp_path / "ckpt", tmp_path / "artifact")
    assert res.exit_code != 0
    assert re.search(r"experts\.0\.gate_proj is scaled on its input \(a pre_quant_scale, which the moe op does not "
                     r"apply\); quantized experts import as", res.output), res.output
