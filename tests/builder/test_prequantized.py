"""Pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors) build into artifacts holding their own codes.

A tiny fp32 Llama is quantized here, in each format, by this file's own round-to-nearest, and packed from the
formats' specifications (written independently of ``builder/prequantized.py``'s unpacking): GPTQ packs codes
along in_features into int32 words [K/8, N] (low bits = lower k) and v1 stores zero points minus one; AWQ packs
along out_features [K, N/8] in the nibble order 0 2 4 6 1 3 5 7; compressed-tensors packs signed codes + 8 along
in_features [N, K/8] and asymmetric zero points along out_features. Each checkpoint is built with ``builder
build`` and checked: the artifact's dequantized weights equal this file's dequantization exactly, the runtime's
logits match a Hugging Face model holding those weights within 1e-4 (fp32), and 32 greedy tokens are the ones HF
picks. Malformed checkpoints and recipes fail with one-line errors.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
GROUP = 32
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


# --- this file's own quantization and packing ------------------------------------------------------------
@dataclass
class Quantized:
    """One linear, quantized by the test: integer codes, zero points and scales in [out, in] / [out, groups]."""

    codes: torch.Tensor  # [N, K] unsigned codes
    zeros: torch.Tensor  # [N, G] unsigned zero points
    scales: torch.Tensor  # [N, G] fp16 (as the formats store them)
    g_idx: torch.Tensor  # [K] group of each input column

    def dequantize(self) -> torch.Tensor:
        """w[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)], in fp32."""
        g = self.g_idx.long()
        return (self.codes[:, :] - self.zeros[:, g]).float() * self.scales.float()[:, g]


def quantize(w: torch.Tensor, bits: int, sym: bool, g_idx: torch.Tensor, min_zero: int = 0) -> Quantized:
    """Round-to-nearest of w [N, K], one scale and zero point per (row, group of g_idx)."""
    n, k = w.shape
    num_groups = int(g_idx.max()) + 1
    maxq = 2 ** bits - 1
    codes = torch.zeros(n, k, dtype=torch.int64)
    zeros = torch.zeros(n, num_groups, dtype=torch.int64)
    scales = torch.zeros(n, num_groups, dtype=torch.float16)
    for g in range(num_groups):
        cols = (g_idx == g).nonzero().flatten()
        wg = w[:, cols]
        if sym:
            scale = (wg.abs().amax(1) / (2 ** (bits - 1) - 1)).half()
            zero = torch.full((n,), 2 ** (bits - 1), dtype=torch.int64)
        else:
            lo, hi = wg.amin(1).clamp(max=0), wg.amax(1).clamp(min=0)
            scale = ((hi - lo) / maxq).half()
            zero = torch.round(-lo / scale.float()).long().clamp(min_zero, maxq)
        codes[:, cols] = (torch.round(wg / scale.float()[:, None]).long() + zero[:, None]).clamp(0, maxq)
        zeros[:, g], scales[:, g] = zero, scale
    return Quantized(codes, zeros, scales, g_idx)


def pack_words(values: np.ndarray, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """Pack unsigned values along the last axis, 32 / bits per int32 word: field i of word c (bits i*b and up)
    holds value c * per_word + order[i]."""
    per_word = 32 // bits
    order = order or list(range(per_word))
    v = values.astype(np.uint64)
    words = np.zeros(v.shape[:-1] + (v.shape[-1] // per_word,), dtype=np.uint64)
    for i in range(per_word):
        words |= v[..., order[i]::per_word] << np.uint64(bits * i)
    return torch.from_numpy(words.astype(np.uint32).view(np.int32))


def gptq_tensors(q: Quantized, bits: int, v1: bool) -> dict[str, torch.Tensor]:
    codes_kn = q.codes.t().numpy()  # [K, N]: GPTQ packs along K (the first axis)
    return {"qweight": pack_words(codes_kn.T, bits).t().contiguous(),  # [K*b/32, N]
            "qzeros": pack_words((q.zeros.t() - (1 if v1 else 0)).numpy(), bits),  # [G, N*b/32]
            "scales": q.scales.t().contiguous(), "g_idx": q.g_idx.to(torch.int32)}


def awq_tensors(q: Quantized) -> dict[str, torch.Tensor]:
    return {"qweight": pack_words(q.codes.t().numpy(), 4, AWQ_ORDER),  # [K, N/8]
            "qzeros": pack_words(q.zeros.t().numpy(), 4, AWQ_ORDER),  # [G, N/8]
            "scales": q.scales.t().contiguous()}


def ct_packed_tensors(q: Quantized, sym: bool) -> dict[str, torch.Tensor]:
    # codes and zero points are signed (q - 8) in compressed-tensors, packed + 8: the unsigned values again
    out = {"weight_packed": pack_words(q.codes.numpy(), 4),  # [N, K/8]
           "weight_scale": q.scales.contiguous(), "weight_shape": torch.tensor(list(q.codes.shape))}
    if not sym:
        out["weight_zero_point"] = pack_words(q.zeros.t().numpy(), 4).t().contiguous()  # [N/8, G]
    if not torch.equal(q.g_idx, torch.arange(q.codes.shape[1]) // GROUP):
        out["weight_g_idx"] = q.g_idx.to(torch.int32)
    return out


def act_order_g_idx(k: int, seed: int) -> torch.Tensor:
    """A shuffled group assignment with GROUP columns per group, as GPTQ's act-order writes."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.arange(k) // GROUP)[torch.randperm(k, generator=gen)].to(torch.int32)


# --- the cases --------------------------------------------------------------------------------------------
@dataclass
class Case:
    name: str
    config: dict  # quantization_config
    quantize: object  # (module, weight [N, K], layer) -> (checkpoint tensors, dequantized weight) or None = float
    expect: dict = field(default_factory=dict)  # manifest prequantized fields
    w8a8: bool = False  # its layer-1 linears quantize their inputs (fake_quantize_input)


def _gptq_v1_act_order(module: str, w: torch.Tensor, layer: int):
    # layer 0: act-order g_idx (k_proj's differs from q_proj's: those two cannot merge); layer 1: plain groups
    seed = [lin.rsplit(".", 1)[1] for lin in LINEARS].index(module.rsplit(".", 1)[1]) if layer == 0 else None
    g_idx = act_order_g_idx(w.shape[1], seed) if seed is not None else torch.arange(w.shape[1]) // GROUP
    q = quantize(w, 4, sym=module.endswith("down_proj"), g_idx=g_idx, min_zero=1)  # v1 cannot store zero 0
    return gptq_tensors(q, 4, v1=True), q.dequantize()


def _gptq_v2_8bit(module: str, w: torch.Tensor, layer: int):
    q = quantize(w, 8, sym=False, g_idx=torch.arange(w.shape[1]) // GROUP)
    t = gptq_tensors(q, 8, v1=False)
    del t["g_idx"]  # optional: plain groups
    return t, q.dequantize()


def _awq(module: str, w: torch.Tensor, layer: int):
    if layer == 1 and module.endswith("down_proj"):
        return None  # modules_to_not_convert
    q = quantize(w, 4, sym=False, g_idx=torch.arange(w.shape[1]) // GROUP)
    return awq_tensors(q), q.dequantize()


def _ct_w4a16(module: str, w: torch.Tensor, layer: int):
    sym = layer == 1  # group_1 (layer 1) symmetric, with act-order; group_0 asymmetric
    g_idx = act_order_g_idx(w.shape[1], 7) if sym else torch.arange(w.shape[1]) // GROUP
    q = quantize(w, 4, sym=sym, g_idx=g_idx)
    return ct_packed_tensors(q, sym), q.dequantize()


def _w4a16_args(sym: bool, actorder) -> dict:
    return {"num_bits": 4, "type": "int", "symmetric": sym, "strategy": "group", "group_size": GROUP,
            "actorder": actorder, "dynamic": False}


FP8_INPUT_SCALE = 4.0 / 448  # layer 1's static activation scale: inputs beyond +-4 clip


def _ct_mixed(module: str, w: torch.Tensor, layer: int):
    """layer 0: W4A16 (attention asymmetric, MLP symmetric in act-order); layer 1: FP8 attention (per-tensor
    weight scale, static activations), INT8 W8A8 MLP (per-channel weights, dynamic per-token activations)."""
    if layer == 0:
        sym = "mlp" in module
        g_idx = act_order_g_idx(w.shape[1], 7) if sym else torch.arange(w.shape[1]) // GROUP
        q = quantize(w, 4, sym=sym, g_idx=g_idx)
        return ct_packed_tensors(q, sym), q.dequantize()
    if "self_attn" in module:
        scale = w.abs().amax() / 448.0
        codes = (w / scale).to(torch.float8_e4m3fn)
        return ({"weight": codes, "weight_scale": scale.reshape(1), "input_scale": torch.tensor([FP8_INPUT_SCALE])},
                codes.float() * scale)
    scale = w.abs().amax(1, keepdim=True) / 127.0
    codes = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
    return {"weight": codes, "weight_scale": scale}, codes.float() * scale


def fake_quantize_input(module: str, x: torch.Tensor) -> torch.Tensor:
    """The activation quantization of _ct_mixed's W8A8 linears, as compressed-tensors specifies it."""
    if ".layers.1.self_attn." in module:  # fp8, static per-tensor scale
        return (x / FP8_INPUT_SCALE).clamp(-448, 448).to(torch.float8_e4m3fn).float() * FP8_INPUT_SCALE
    if ".layers.1.mlp." in module:  # int8, dynamic per token: scale = amax / 127
        scale = x.abs().amax(-1, keepdim=True) / 127.0
        return torch.round(x / scale).clamp(-128, 127) * scale
    return x


def _ct_group(targets: list[str], fmt: str, weights: dict, inputs: dict | None) -> dict:
    return {"targets": targets, "format": fmt, "weights": weights, "input_activations": inputs}


CT_MIXED = {
    "quant_method": "compressed-tensors", "format": "mixed-precision", "quantization_status": "compressed",
    "config_groups": {
        "group_0": _ct_group(["re:model.layers.0.self_attn.*"], "pack-quantized", _w4a16_args(False, None), None),
        "group_1": _ct_group(["re:model.layers.0.mlp.*"], "pack-quantized", _w4a16_args(True, "group"), None),
        "group_2": _ct_group(["re:model.layers.1.self_attn.*"], "float-quantized",
                             {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"},
                             {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor",
                              "dynamic": False}),
        "group_3": _ct_group(["Linear"], "int-quantized",
                             {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                             {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                              "dynamic": True}),
    },
    "ignore": ["lm_head"]}

GPTQ_V1 = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": False,
           "checkpoint_format": "gptq", "lm_head": False}
CASES = [
    Case("gptq-v1-act-order", GPTQ_V1, _gptq_v1_act_order,
         expect={"source": "gptq", "schemes": {"w4a16": 14}, "act_order_linears": 7}),
    Case("awq", {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm",
                 "modules_to_not_convert": ["model.layers.1.mlp.down_proj"]}, _awq,
         expect={"source": "awq", "schemes": {"w4a16": 13}}),
    Case("compressed-tensors", CT_MIXED, _ct_mixed, w8a8=True,
         expect={"source": "compressed-tensors", "schemes": {"w4a16": 7, "fp8": 4, "w8a8_int8": 3},
                 "act_order_linears": 3}),
]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The tiny fp32 Llama every case quantizes (hidden 64, 2 layers, an untied lm_head)."""
    from conftest import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("prequant") / "fp32", "llama", seed=3, intermediate_size=128,
                           tie_word_embeddings=False)


def write_quantized(base_dir: Path, out: Path, config: dict, quantize_fn) -> dict[str, torch.Tensor]:
    """``base_dir`` quantized by ``quantize_fn``; returns each quantized linear's dequantized weight (this
    file's own)."""
    shutil.copytree(base_dir, out)
    tensors = load_file(out / "model.safetensors")
    expected = {}
    for layer in range(2):
        for lin in LINEARS:
            module = f"model.layers.{layer}.{lin}"
            made = quantize_fn(module, tensors[f"{module}.weight"], layer)
            if made is None:
                continue
            stored, expected[module] = made
            del tensors[f"{module}.weight"]
            tensors.update({f"{module}.{k}": v for k, v in stored.items()})
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = config
    (out / "config.json").write_text(json.dumps(cfg))
    return expected


def run_build(checkpoint: Path, out: Path, extra: str = ""):
    from typer.testing import CliRunner

    from builder.cli import app

    recipe = out.parent / f"{out.name}.yaml"
    recipe.write_text(f"model:\n  checkpoint: {checkpoint}\n  dtype: float32\noutput_dir: {out}\n"
                      f"verify:\n  prompts: ['def f(x):\\n    return x + 1']\n"
                      f"runtime:\n  max_seq_len: 256\n  max_num_tokens: 64\n{extra}")
    return CliRunner().invoke(app, ["build", str(recipe), "--quiet"])


@dataclass
class Built:
    checkpoint: Path
    artifact: Path
    expected: dict[str, torch.Tensor]  # module -> this file's dequantized weight


@pytest.fixture(scope="module")
def built(base, tmp_path_factory):
    cache: dict[str, Built] = {}

    def get(case: Case) -> Built:
        if case.name not in cache:
            root = tmp_path_factory.mktemp(case.name)
            expected = write_quantized(base, root / "ckpt", case.config, case.quantize)
            res = run_build(root / "ckpt", root / "artifact")
            assert res.exit_code == 0, res.output
            cache[case.name] = Built(root / "ckpt", root / "artifact", expected)
        return cache[case.name]

    return get


def ir_weights(nodes: list[dict], params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """module -> the weight a graph's quantized linears hold, dequantized as passes/README.md's layouts say
    (w4a16 / w8a16 through the runtime's CPU reference), a merged linear split into its members, an act-order
    permutation undone."""
    from kernels.torch_quant import dequantize_weight

    out = {}
    for node in nodes:
        quant = node["attrs"].get("quant")
        if node["op"] != "linear" or quant is None:
            continue
        w = {role: params[name] for role, name in node["weights"].items()}
        if quant["scheme"] in ("w4a16", "w8a16"):
            weight = dequantize_weight(w["qweight"], w["scales"], w["zeros"], quant["bits"], quant["group_size"],
                                       torch.float32)
        else:
            weight = w["qweight"].float() * w["weight_scale"].float().reshape(-1, 1)
        if "perm" in w:
            unperm = torch.empty_like(weight)
            unperm[:, w["perm"].long()] = weight
            weight = unperm
        stem = node["weights"]["qweight"].rsplit(".", 1)[0]  # a.b.q_proj+k_proj+v_proj or a.b.o_proj
        parent, _, leaves = stem.rpartition(".")
        members = leaves.split("+")
        sizes = node["attrs"].get("split_sizes") or [weight.shape[0] // len(members)] * len(members)
        for leaf, part in zip(members, weight.split(sizes)):
            out[f"{parent}.{leaf}"] = part
    return out


def hf_model(checkpoint: Path, weights: dict[str, torch.Tensor], w8a8: bool = False) -> torch.nn.Module:
    """The checkpoint's model (config without its quantization_config) holding ``weights`` for its linears;
    ``w8a8``: the W8A8 linears quantize their inputs (fake_quantize_input)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(checkpoint)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v for k, v in load_file(checkpoint / "model.safetensors").items() if k in model.state_dict()}
    state.update({f"{m}.weight": w for m, w in weights.items()})
    model.load_state_dict(state, strict=True)
    for module in weights if w8a8 else []:
        model.get_submodule(module).register_forward_pre_hook(
            lambda mod, args, module=module: (fake_quantize_input(module, args[0]),))
    return model.eval()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_prequantized_checkpoint_builds_with_its_own_codes(case, built):
    from runtime import Engine, SamplingParams

    b = built(case)
    graph = json.loads((b.artifact / "graph.json").read_text())
    ours = ir_weights(graph["nodes"], load_file(b.artifact / "weights.safetensors"))
    assert sorted(ours) == sorted(b.expected)
    for module, w in b.expected.items():
        assert torch.equal(ours[module], w), f"{module}: the artifact's weight is not the checkpoint's"
    manifest = json.loads((b.artifact / "manifest.json").read_text())
    assert manifest["quantization"]["algo"] == "prequantized"
    record = manifest["quantization"]["prequantized"]
    assert record["num_linears"] == len(b.expected)
    for key, value in case.expect.items():
        assert record[key] == value, (key, record)
    assert f"pre-quantized by {case.expect['source']}" in (b.artifact / "report.md").read_text()

    model = hf_model(b.checkpoint, b.expected, case.w8a8)
    engine = Engine.load(b.artifact)
    gen = torch.Generator().manual_seed(5)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (40,), generator=gen).tolist()
    with torch.no_grad():
        expected = model(torch.tensor([ids]), use_cache=False).logits[0]
    err = (engine.logits(ids) - expected).abs().max().item()
    assert err < 1e-4, f"logits differ from HF by {err:.3g}"
    prompt = torch.randint(3, vocab, (12,), generator=gen).tolist()
    tokens = engine.generate(prompt, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)).token_ids
    with torch.no_grad():
        hf_next = model(torch.tensor([prompt + tokens[:-1]]), use_cache=False).logits[0, len(prompt) - 1:].argmax(-1)
    assert tokens == hf_next.tolist()


# --- the import alone, on one traced graph: more formats, and malformed checkpoints ---------------------------
@pytest.fixture(scope="module")
def traced(base):
    from builder.checkpoint import open_checkpoint
    from passes.trace import trace

    return trace(open_checkpoint(base).hf_config())


def attach(traced, checkpoint: Path):
    """The traced graph (a copy) with ``checkpoint``'s weights, as the build attaches them."""
    from builder.checkpoint import attach_weights, open_checkpoint

    graph, meta_model = traced
    graph = graph.copy()
    attach_weights(graph, open_checkpoint(checkpoint), meta_model, torch.float32)
    return graph


def _gptq_v2_8bit(module: str, w: torch.Tensor, layer: int):
    q = quantize(w, 8, sym=False, g_idx=torch.arange(w.shape[1]) // GROUP)
    t = gptq_tensors(q, 8, v1=False)
    del t["g_idx"]  # optional: plain groups
    return t, q.dequantize()


def test_gptq_v2_8bit_imports_exactly_and_runs(traced, base, tmp_path):
    from passes.verify import run_graph

    config = {**GPTQ_V1, "bits": 8, "desc_act": False, "checkpoint_format": "gptq_v2"}
    expected = write_quantized(base, tmp_path / "ckpt", config, _gptq_v2_8bit)
    graph = attach(traced, tmp_path / "ckpt")
    nodes = [{"op": n.op, "attrs": n.attrs, "weights": n.weights} for n in graph.nodes]
    ours = ir_weights(nodes, graph.params)
    assert sorted(ours) == sorted(expected) and all(torch.equal(ours[m], w) for m, w in expected.items())
    assert {n.attrs["quant"]["scheme"] for n in graph.nodes if "quant" in n.attrs} == {"w8a16"}
    ids = torch.randint(3, 300, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        ref = hf_model(tmp_path / "ckpt", expected)(torch.tensor([ids]), use_cache=False).logits[0]
    assert (run_graph(graph, [ids])[0] - ref).abs().max().item() < 1e-4


def _gptq_plain(module: str, w: torch.Tensor, layer: int):
    q = quantize(w, 4, sym=True, g_idx=torch.arange(w.shape[1]) // GROUP)
    return gptq_tensors(q, 4, v1=True), q.dequantize()


def _edit(path: Path, drop: str = "", replace: dict | None = None) -> None:
    tensors = load_file(path / "model.safetensors")
    tensors.pop(drop, None)
    tensors.update(replace or {})
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


Q = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("config, edit, message", [
    (GPTQ_V1, dict(drop=f"{Q}.qzeros"),
     rf"tensor '{Q}\.qzeros' is missing; a gptq quantized linear stores qweight, qzeros, scales \(found qweight, "
     rf"scales\)"),
    (GPTQ_V1, dict(replace={f"{Q}.qweight": torch.zeros(4, 64, dtype=torch.int32)}),
     rf"tensor '{Q}\.qweight' is int32 \(4, 64\); expected int32 \(8, 64\) \(4-bit codes packed along "
     rf"in_features 64\)"),
    (GPTQ_V1, dict(replace={f"{Q}.scales": torch.ones(3, 64, dtype=torch.float16)}),
     rf"tensor '{Q}\.scales' is float16 \(3, 64\); expected float16 or bfloat16 or float32 \(2, 64\)"),
    (GPTQ_V1, dict(replace={f"{Q}.g_idx": torch.zeros(64, dtype=torch.int32)}),
     rf"tensor '{Q}\.g_idx' puts 0\.\.64 input channels in a group; act-order is imported when every group "
     rf"holds group_size 32"),
    ({**GPTQ_V1, "bits": 3}, {}, r"quantization_config\.bits is 3; expected one of 4, 8"),
    ({**GPTQ_V1, "checkpoint_format": "marlin"}, {}, r"checkpoint_format is \"marlin\"; imported: gptq"),
    ({"quant_method": "hqq", "nbits": 4}, {},
     r"quantization_config\.quant_method is \"hqq\": it is not a format the import reads; imported: gptq, awq"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, {},
     r"quant_method is \"fp8\": block-scaled FP8 .* has no IR scheme"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, {},
     r"quantization_config\.version is \"gemv\"; imported: gemm"),
    ({**CT_MIXED, "config_groups": {"group_0": _ct_group(["Linear"], "pack-quantized", _w4a16_args(False, None),
                                                         None)}}, {},
     rf"tensor '{Q}\.weight_packed' is missing; a compressed-tensors quantized linear stores weight_packed, "
     rf"weight_scale \(found none of them\)"),
], ids=["missing-qzeros", "qweight-shape", "scales-groups", "g_idx-uneven", "bits-3", "gptq-marlin", "hqq",
        "fp8-blocks", "awq-gemv", "ct-not-packed"])
def test_malformed_checkpoint_fails_naming_the_tensor(traced, base, tmp_path, config, edit, message):
    from builder.checkpoint import CheckpointError

    write_quantized(base, tmp_path / "ckpt", config, _gptq_plain)
    _edit(tmp_path / "ckpt", **edit)
    with pytest.raises(CheckpointError, match=message) as info:
        attach(traced, tmp_path / "ckpt")
    assert "\n" not in str(info.value)


def test_cli_refuses_a_recipe_that_requantizes_and_an_unknown_format(base, tmp_path):
    write_quantized(base, tmp_path / "ckpt", GPTQ_V1, _gptq_plain)
    res = run_build(tmp_path / "ckpt", tmp_path / "out", "quantization:\n  algo: awq\n")
    assert res.exit_code == 1 and "Traceback" not in res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(r"quantization: algo awq does not describe the checkpoint, which is "
                                         r"already quantized by gptq \(w4a16, 4-bit, group_size 32\)", lines[0])
    res = run_build(tmp_path / "ckpt", tmp_path / "out", "quantization:\n  algo: gptq\n  group_size: 128\n")
    assert res.exit_code == 1 and "group_size 128 (the checkpoint's is 32)" in res.stderr
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "eetq"
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg))
    res = run_build(tmp_path / "ckpt", tmp_path / "out")
    assert res.exit_code == 1 and len(res.stderr.strip().splitlines()) == 1
    assert "quant_method is \"eetq\"" in res.stderr and not (tmp_path / "out").exists()


def test_gate_compares_a_prequantized_artifact_with_an_unquantized_baseline(built, base, traced, tmp_path,
                                                                             monkeypatch):
    import passes.trace
    from typer.testing import CliRunner

    from builder.cli import app
    from conftest import CORPUS

    monkeypatch.setattr(passes.trace, "trace", lambda config: (traced[0].copy(), traced[1]))  # traced once
    b = built(CASES[0])
    text = tmp_path / "eval.txt"
    text.write_text("\n".join(CORPUS * 8))
    args = ["gate", str(b.artifact), "--eval-dataset", str(text), "--num-positions", "64", "--json", "--quiet"]
    res = CliRunner().invoke(app, [*args, "--baseline", str(base)])
    assert res.exit_code in (0, 3), res.output
    report = json.loads(res.stdout)
    kl = next(m for m in report["metrics"] if m["name"] == "kl")
    assert kl["threshold"] == 0.1 and kl["value"] > 0  # GPTQ's thresholds; the 4-bit weights differ from fp32
    res = CliRunner().invoke(app, [*args, "--baseline", str(b.checkpoint)])
    assert res.exit_code == 1 and "is itself quantized" in res.stderr
