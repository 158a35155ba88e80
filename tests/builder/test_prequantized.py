"""Pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors, fine-grained FP8, ModelOpt) build into artifacts holding
their own codes.

A tiny fp32 Llama is quantized here, in each format, by this file's own round-to-nearest, and packed from the
formats' specifications (written independently of ``builder/prequantized.py``'s unpacking): GPTQ packs codes
along in_features into int32 words [K/8, N] (low bits = lower k) and v1 stores zero points minus one; AWQ packs
along out_features [K, N/8] in the nibble order 0 2 4 6 1 3 5 7; compressed-tensors packs signed codes + 8 along
in_features [N, K/8] and asymmetric zero points along out_features; fine-grained FP8 stores e4m3 codes [N, K] and
one fp32 ``weight_scale_inv`` per 128 x 128 block (on a Llama whose N and K are not multiples of 128: partial
blocks); ModelOpt stores e4m3 or int8 codes with a 0-d or per-channel ``weight_scale``, a 0-d static ``input_scale``
and the KV cache's ``k_scale`` / ``v_scale``, described by hf_quant_config.json. Each checkpoint is built with
``builder build`` and checked: the artifact's dequantized weights equal this file's dequantization exactly, the
runtime's logits match a Hugging Face model holding those weights (its W8A8 linears quantizing their inputs as the
format says) within 1e-4 (fp32) up to the first position where an activation on a rounding boundary takes another
code on either side (:func:`same_activation_codes`), and 32 greedy tokens are the ones HF picks. Malformed
checkpoints and recipes fail with one-line errors.
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
    inputs: object = None  # (module, x) -> x as the format quantizes the linear's input (W8A8), or None: unquantized
    base: str = "base"  # the fixture of the floating-point checkpoint it quantizes
    files: dict = field(default_factory=dict)  # other JSON files the format writes beside config.json
    expect_agree: int = 40  # leading positions of the 40-token comparison before an activation code moves


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


def fp8_static(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x quantized to e4m3 with a static per-tensor scale (clipped at +-448 * scale), dequantized."""
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale


def fake_quantize_input(module: str, x: torch.Tensor) -> torch.Tensor:
    """The activation quantization of _ct_mixed's W8A8 linears, as compressed-tensors specifies it."""
    if ".layers.1.self_attn." in module:  # fp8, static per-tensor scale
        return fp8_static(x, FP8_INPUT_SCALE)
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

# --- fine-grained FP8 (transformers' quant_method fp8) and ModelOpt ---------------------------------------
BLOCK = 128


def block_scaled(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest of w [N, K] to e4m3, one scale (amax / 448) per block of rows x columns, partial last
    blocks included: (codes, scales [ceil(N / rows), ceil(K / columns)])."""
    (n, k), (bn, bk) = w.shape, block
    scales = torch.zeros(-(-n // bn), -(-k // bk))
    codes = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            rows, cols = slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk)
            scales[i, j] = w[rows, cols].abs().max() / 448
            codes[rows, cols] = (w[rows, cols] / scales[i, j]).to(torch.float8_e4m3fn)
    return codes, scales


def block_dequantize(codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """w[n, k] = q[n, k] * scale[n // rows, k // columns], element by element."""
    n, k = codes.shape
    return codes.float() * scales[torch.arange(n) // block[0]][:, torch.arange(k) // block[1]]


def fine_grained(block: tuple[int, int], not_converted: tuple[str, ...] = ()):
    """The writer of fine-grained FP8 with ``block``: e4m3 ``weight`` and fp32 ``weight_scale_inv`` per block; the
    modules ``not_converted`` stay in fp32."""
    def write(module: str, w: torch.Tensor, layer: int):
        if module.endswith(not_converted):
            return None
        codes, scales = block_scaled(w, block)
        return {"weight": codes, "weight_scale_inv": scales}, block_dequantize(codes, scales, block)

    return write


def fake_quantize_groups(module: str, x: torch.Tensor) -> torch.Tensor:
    """Fine-grained FP8's activations: per token and group of 128 along in_features (the last one narrower),
    scale = the group's amax / 448, e4m3 codes, dequantized."""
    out = torch.empty_like(x)
    for start in range(0, x.shape[-1], BLOCK):
        group = x[..., start:start + BLOCK]
        scale = group.abs().amax(-1, keepdim=True) / 448
        out[..., start:start + BLOCK] = (group / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    return out


FINE_GRAINED = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": [BLOCK, BLOCK]}
# ModelOpt FP8: static activation scales shared by the linears that read one input (q/k/v, gate/up)
MODELOPT_INPUT_SCALES = {"q_proj": 4 / 448, "k_proj": 4 / 448, "v_proj": 4 / 448, "o_proj": 0.5 / 448,
                         "gate_proj": 3 / 448, "up_proj": 3 / 448, "down_proj": 1 / 448}
MODELOPT_FP8 = {"producer": {"name": "modelopt", "version": "0.47.0"},
                "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                                 "exclude_modules": ["lm_head", "model.embed_tokens"]}}
MODELOPT_CONFIG = {  # the quantization_config ModelOpt writes into config.json since 0.29
    "config_groups": {"group_0": {"input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
                                  "weights": {"dynamic": False, "num_bits": 8, "type": "float"},
                                  "targets": ["Linear"]}},
    "ignore": ["lm_head", "model.embed_tokens"], "quant_algo": "FP8",
    "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"}, "producer": MODELOPT_FP8["producer"]}


def _modelopt_fp8(module: str, w: torch.Tensor, layer: int):
    """ModelOpt's FP8: e4m3 codes with one 0-d fp32 weight_scale (amax / 448) and a 0-d input_scale; k_proj and
    v_proj also carry the KV cache's k_scale / v_scale."""
    scale = w.abs().amax() / 448
    codes = (w / scale).to(torch.float8_e4m3fn)
    leaf = module.rsplit(".", 1)[1]
    out = {"weight": codes, "weight_scale": scale.reshape(()), "input_scale": torch.tensor(MODELOPT_INPUT_SCALES[leaf])}
    if leaf in ("k_proj", "v_proj"):
        out[f"{leaf[0]}_scale"] = torch.tensor(0.02 + layer)
    return out, codes.float() * scale


def modelopt_inputs(module: str, x: torch.Tensor) -> torch.Tensor:
    return fp8_static(x, MODELOPT_INPUT_SCALES[module.rsplit(".", 1)[1]])


GPTQ_V1 = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": False,
           "checkpoint_format": "gptq", "lm_head": False}
CASES = [
    Case("gptq-v1-act-order", GPTQ_V1, _gptq_v1_act_order,
         expect={"source": "gptq", "schemes": {"w4a16": 14}, "act_order_linears": 7}),
    Case("awq", {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm",
                 "modules_to_not_convert": ["model.layers.1.mlp.down_proj"]}, _awq,
         expect={"source": "awq", "schemes": {"w4a16": 13}}),
    Case("compressed-tensors", CT_MIXED, _ct_mixed, inputs=fake_quantize_input,
         expect={"source": "compressed-tensors", "schemes": {"w4a16": 7, "fp8": 4, "w8a8_int8": 3},
                 "act_order_linears": 3}),
    Case("fp8-blocks", {**FINE_GRAINED, "modules_to_not_convert": ["layers.1.mlp.down_proj"]},
         fine_grained((BLOCK, BLOCK), ("layers.1.mlp.down_proj",)), inputs=fake_quantize_groups, base="block_base",
         expect_agree=9, expect={"source": "fp8", "schemes": {"fp8_block": 13}, "weight_block_size": [128, 128]}),
    Case("modelopt-fp8", {**MODELOPT_CONFIG, "quant_method": "modelopt"}, _modelopt_fp8, inputs=modelopt_inputs,
         files={"hf_quant_config.json": MODELOPT_FP8},
         expect={"source": "modelopt", "schemes": {"fp8": 14}, "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}),
]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The tiny fp32 Llama every case quantizes (hidden 64, 2 layers, an untied lm_head)."""
    from conftest import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("prequant") / "fp32", "llama", seed=3, intermediate_size=128,
                           tie_word_embeddings=False)


@pytest.fixture(scope="module")
def block_base(tmp_path_factory) -> Path:
    """A tiny fp32 Llama whose projections are not multiples of 128 (hidden 192, intermediate 320, head_dim 64, one
    kv head): 128 x 128 blocks end in partial ones along both dimensions."""
    from conftest import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("prequant") / "blocks", "llama", seed=6, hidden_size=192,
                           intermediate_size=320, num_attention_heads=3, num_key_value_heads=1,
                           tie_word_embeddings=False)


def write_quantized(base_dir: Path, out: Path, config: dict, quantize_fn,
                    files: dict | None = None) -> dict[str, torch.Tensor]:
    """``base_dir`` quantized by ``quantize_fn`` (``files``: other JSON files to write beside config.json); returns
    each quantized linear's dequantized weight (this file's own)."""
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
    if config is not None:
        cfg["quantization_config"] = config
    (out / "config.json").write_text(json.dumps(cfg))
    for name, data in (files or {}).items():
        (out / name).write_text(json.dumps(data))
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
def built(request, tmp_path_factory):
    cache: dict[str, Built] = {}

    def get(case: Case) -> Built:
        if case.name not in cache:
            root = tmp_path_factory.mktemp(case.name)
            expected = write_quantized(request.getfixturevalue(case.base), root / "ckpt", case.config, case.quantize,
                                       case.files)
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
        elif quant["scheme"] == "fp8_block":
            weight = block_dequantize(w["qweight"], w["weight_scale"], quant["block_size"])
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


def hf_model(checkpoint: Path, weights: dict[str, torch.Tensor], inputs=None) -> torch.nn.Module:
    """The checkpoint's model (config without its quantization_config) holding ``weights`` for its linears;
    ``inputs``: (module, x) -> x quantized as the format quantizes that linear's input (W8A8)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(checkpoint)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v for k, v in load_file(checkpoint / "model.safetensors").items() if k in model.state_dict()}
    state.update({f"{m}.weight": w for m, w in weights.items()})
    model.load_state_dict(state, strict=True)
    for module in weights if inputs is not None else []:
        model.get_submodule(module).register_forward_pre_hook(
            lambda mod, args, module=module: (inputs(module, args[0]),))
    return model.eval()


def same_activation_codes(model, ex, ids: list[int], inputs) -> int:
    """How many leading positions of ``ids`` every linear that quantizes its input (``inputs``) quantizes it alike
    in the HF model and in the runtime. Activation quantization is discontinuous: an input on an e4m3 rounding
    boundary can move one code (1/16 of its value) on the 1e-6 by which HF's attention and norms differ from the
    runtime's in fp32, and the logits after it by up to ~0.1. Asserts that the first such move is one: the two
    inputs it came from agree to 1e-5."""
    from runtime.executor import SeqSlice, StepInput
    from runtime.kv_cache import SequenceKV

    ours, theirs = {}, {}  # module -> its input [tokens, in_features] in the runtime's executor ``ex`` / in HF's

    def observe(index: int, xs: list[torch.Tensor]) -> None:
        node = ex.graph["nodes"][index]
        if node["op"] == "linear" and node["attrs"].get("quant"):  # a merged linear's members read one input
            parent, _, leaves = node["weights"]["qweight"].rsplit(".", 1)[0].rpartition(".")
            ours.update({f"{parent}.{leaf}": xs[0].clone() for leaf in leaves.split("+")})

    kv = SequenceKV(ex.kv_layout(), len(ids))
    ex.run_nodes(ex.start(StepInput(torch.tensor(ids), torch.arange(len(ids)), [SeqSlice(kv, 0, len(ids))])), 0,
                 len(ex.graph["nodes"]), observe)
    hooks = [model.get_submodule(m).register_forward_pre_hook(
        lambda mod, args, m=m: theirs.__setitem__(m, args[0][0].clone()), prepend=True) for m in ours]
    with torch.no_grad():
        model(torch.tensor([ids]), use_cache=False)
    for h in hooks:
        h.remove()
    first, where = len(ids), None
    for m, x in theirs.items():  # in the order the model runs them
        a, b = (inputs(m, t) if inputs is not None else t for t in (x, ours[m]))
        moved = ((a - b).abs() > 1e-3 * torch.maximum(a.abs(), b.abs())).any(-1).nonzero().flatten()
        if a is not x and len(moved) and moved[0] < first:  # (a code step is >= 1/16 of the value; int8 1/127)
            first, where = int(moved[0]), m
    if where is not None:
        gap = (theirs[where][first] - ours[where][first]).abs().max().item()
        assert gap <= 1e-5 * theirs[where][first].abs().max().item(), (where, first, gap)
    return first


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
    assert all(name in manifest["source"]["files"] for name in case.files)  # hashed with the checkpoint

    model = hf_model(b.checkpoint, b.expected, case.inputs)
    engine = Engine.load(b.artifact)
    gen = torch.Generator().manual_seed(5)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (40,), generator=gen).tolist()
    with torch.no_grad():
        expected = model(torch.tensor([ids]), use_cache=False).logits[0]
    agree = same_activation_codes(model, engine.executor, ids, case.inputs)
    assert agree >= case.expect_agree, agree
    err = (engine.logits(ids)[:agree] - expected[:agree]).abs().max().item()
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


def _per_channel(w: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ModelOpt's per-channel rounding of w: (codes, weight_scale [N], dequantized): e4m3 with amax / 448, or int8
    with amax / 127 rounded and clipped to -128..127."""
    if kind == "fp8":
        scale = w.abs().amax(1) / 448
        codes = (w / scale[:, None]).to(torch.float8_e4m3fn)
    else:
        scale = w.abs().amax(1) / 127
        codes = (w / scale[:, None]).round().clamp(-128, 127).to(torch.int8)
    return codes, scale, codes.float() * scale[:, None]


def _modelopt_per_channel(module: str, w: torch.Tensor, layer: int):
    """FP8_PER_CHANNEL_PER_TOKEN, layer 1's MLP excluded (left in fp32)."""
    if layer == 1 and ".mlp." in module:
        return None
    codes, scale, deq = _per_channel(w, "fp8")
    return {"weight": codes, "weight_scale": scale}, deq


def _modelopt_mixed(module: str, w: torch.Tensor, layer: int):
    """MIXED_PRECISION: layer 0 FP8_PER_CHANNEL_PER_TOKEN, layer 1's attention W8A16, its MLP left in fp32."""
    if layer == 0:
        return _modelopt_per_channel(module, w, layer)
    if ".mlp." in module:
        return None
    codes, scale, deq = _per_channel(w, "int8")
    return {"weight": codes, "weight_scale": scale}, deq


def per_token_fp8(module: str, x: torch.Tensor) -> torch.Tensor:
    """FP8_PER_CHANNEL_PER_TOKEN's activations: e4m3 per token, scale = amax / 448."""
    scale = x.abs().amax(-1, keepdim=True) / 448
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale


def per_token_fp8_layer0(module: str, x: torch.Tensor) -> torch.Tensor:
    return per_token_fp8(module, x) if ".layers.0." in module else x


def _modelopt_layers() -> dict:
    return {f"model.layers.{layer}.{lin}": {"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN" if layer == 0 else "W8A16"}
            for layer in range(2) for lin in LINEARS if layer == 0 or "self_attn" in lin}


@pytest.mark.parametrize("config, files, quantize_fn, inputs, schemes", [
    (None, {"hf_quant_config.json": {"producer": {"name": "modelopt", "version": "0.27.1"}, "quantization": {
        "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN", "kv_cache_quant_algo": None,
        "exclude_modules": ["lm_head", "model.layers.1.mlp*"]}}},
     _modelopt_per_channel, per_token_fp8, {"fp8": 11}),
    ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "ignore": ["lm_head"]},
     {"hf_quant_config.json": {"producer": {"name": "modelopt", "version": "0.47.0"}, "quantization": {
         "quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "quantized_layers": _modelopt_layers()}}},
     _modelopt_mixed, per_token_fp8_layer0, {"fp8": 7, "w8a16": 4}),
], ids=["hf_quant_config-only-per-channel", "mixed-precision"])
def test_modelopt_per_channel_w8a16_and_mixed_import_exactly_and_run(traced, base, tmp_path, config, files,
                                                                     quantize_fn, inputs, schemes):
    """An export that has only hf_quant_config.json (ModelOpt before 0.29: no quantization_config in config.json),
    with an exclude pattern; MIXED_PRECISION, whose quantized_layers say each module's algorithm."""
    from passes.verify import run_graph
    from runtime.executor import Executor

    expected = write_quantized(base, tmp_path / "ckpt", config, quantize_fn, files)
    graph = attach(traced, tmp_path / "ckpt")
    nodes = [{"op": n.op, "attrs": n.attrs, "weights": n.weights} for n in graph.nodes]
    ours = ir_weights(nodes, graph.params)
    assert sorted(ours) == sorted(expected) and all(torch.equal(ours[m], w) for m, w in expected.items())
    found: dict[str, int] = {}
    for n in (n for n in graph.nodes if "quant" in n.attrs):
        found[n.attrs["quant"]["scheme"]] = found.get(n.attrs["quant"]["scheme"], 0) + 1
    assert found == schemes
    ids = torch.randint(3, 300, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    model = hf_model(tmp_path / "ckpt", expected, inputs)
    with torch.no_grad():
        ref = model(torch.tensor([ids]), use_cache=False).logits[0]
    assert same_activation_codes(model, Executor(graph.to_dict(), graph.params), ids, inputs) == len(ids)
    assert (run_graph(graph, [ids])[0] - ref).abs().max().item() < 1e-4


CT_INT8_STATIC = {  # llm-compressor's W8A8 INT8 with static per-tensor activation scales
    "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": _ct_group(["Linear"], "int-quantized",
                                           {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                                           {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor",
                                            "dynamic": False})},
    "ignore": ["lm_head"]}


def input_amax(checkpoint: Path, ids: list[int]) -> dict[str, torch.Tensor]:
    """module -> max |x| of each decoder linear's input on ``ids`` (the floating-point model)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    amax: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args, name=name: amax.__setitem__(name, args[0].abs().amax()))
             for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in name]
    with torch.no_grad():
        model(torch.tensor([ids]), use_cache=False)
    for h in hooks:
        h.remove()
    return amax


def ct_int8_codes(x: torch.Tensor, scale: torch.Tensor, q_min: int = -128) -> torch.Tensor:
    """compressed-tensors' quantize of int8 activations (quantization/lifecycle/forward.py ``_quantize``):
    round(clamp(x / scale, q_min, q_max)), with calculate_range's q_min, q_max = -128, 127 for 8-bit ints."""
    return torch.round(torch.clamp(x / scale, q_min, 127))


def test_compressed_tensors_static_int8_activations_take_code_minus_128(traced, base, tmp_path):
    """compressed-tensors' static int8 activations clamp at -128 (its scales are amax / 127.5: -amax itself is code
    -128); the import's w8a8_int8 linears carry act_qmin -128, so an input below -127.5 * input_scale takes the
    format's code: the runtime's logits are a Hugging Face model's whose inputs compressed-tensors quantizes, and the
    graph clamped at -127 (the IR's default, the import before issue 19) is off by as much as that model clamped so."""
    from kernels.torch_quant import quantize_activation_int8
    from passes.verify import run_graph
    from runtime.executor import Executor, SeqSlice, StepInput
    from runtime.kv_cache import SequenceKV

    ids = torch.randint(3, 300, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    scales = {m: (0.6 * a / 127.5).reshape(1) for m, a in input_amax(base, ids).items()}  # 0.6: inputs saturate

    def write(module: str, w: torch.Tensor, layer: int):
        scale = w.abs().amax(1, keepdim=True) / 127.0
        codes = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
        return {"weight": codes, "weight_scale": scale, "input_scale": scales[module]}, codes.float() * scale

    expected = write_quantized(base, tmp_path / "ckpt", CT_INT8_STATIC, write)
    graph = attach(traced, tmp_path / "ckpt")
    quantized = [n for n in graph.nodes if "quant" in n.attrs]
    assert len(quantized) == 14 and all(n.attrs["quant"] == {"scheme": "w8a8_int8", "activations": "static",
                                                             "source": "compressed-tensors", "act_qmin": -128}
                                        for n in quantized)
    inputs = {}  # module -> the runtime's input to it

    def observe(index: int, xs: list[torch.Tensor]) -> None:
        node = graph.nodes[index]
        if "quant" in node.attrs:
            inputs[node.weights["qweight"].removesuffix(".qweight")] = xs[0].clone()

    ex = Executor(graph.to_dict(), graph.params)
    kv = SequenceKV(ex.kv_layout(), len(ids))
    ex.run_nodes(ex.start(StepInput(torch.tensor(ids), torch.arange(len(ids)), [SeqSlice(kv, 0, len(ids))])), 0,
                 len(graph.nodes), observe)
    moved = 0
    for module, x in inputs.items():  # the runtime's codes are the format's, -128 included; -127 would move some
        theirs = ct_int8_codes(x, scales[module])
        assert torch.equal(quantize_activation_int8(x, scales[module], -128)[0].float(), theirs), module
        moved += int((quantize_activation_int8(x, scales[module])[0].float() != theirs).sum())
    assert moved > 20 and moved == sum(int((ct_int8_codes(x, scales[m]) == -128).sum()) for m, x in inputs.items())

    def model(q_min: int):
        return hf_model(tmp_path / "ckpt", expected, lambda m, x: ct_int8_codes(x, scales[m], q_min) * scales[m])

    with torch.no_grad():
        ref, ref_127 = (model(q)(torch.tensor([ids]), use_cache=False).logits[0] for q in (-128, -127))
    assert same_activation_codes(model(-128), ex, ids, lambda m, x: ct_int8_codes(x, scales[m])) == len(ids)
    err = (run_graph(graph, [ids])[0] - ref).abs().max().item()
    assert err < 1e-5, err
    for q in quantized:
        q.attrs["quant"].pop("act_qmin")
    clamped = run_graph(graph, [ids])[0]
    assert (clamped - ref).abs().max().item() > 1e-3 and (clamped - ref_127).abs().max().item() < 1e-5


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
    ({"quant_method": "fp8", "weight_block_size": None}, {},
     r"quantization_config\.weight_block_size is null; imported: \[rows, columns\] of integers in 1\.\.65536, "
     r"e\.g\. \[128, 128\] \(per-tensor FP8, null, is not\)"),
    ({"quant_method": "fp8", "weight_block_size": [10 ** 12, 10 ** 12]}, {},  # was a 4 TB allocation
     r"quantization_config\.weight_block_size is \[1000000000000, 1000000000000\]; imported: \[rows, columns\] of "
     r"integers in 1\.\.65536"),
    ({**FINE_GRAINED, "activation_scheme": "static"}, {},
     r"quantization_config\.activation_scheme is \"static\"; imported: dynamic \(a static activation_scale"),
    ({**FINE_GRAINED, "activation_scheme": False}, {},
     r"quantization_config\.activation_scheme is false; imported: dynamic"),
    ({"quant_method": "modelopt", "quant_algo": "FP4_MAGIC"}, {},
     r"quantization_config\.quant_algo is \"FP4_MAGIC\": it is not an algorithm the import reads; imported: FP8, "
     r"FP8_PER_CHANNEL_PER_TOKEN, W8A16, W4A16_AWQ"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, {},  # decoded on read, but these are GPTQ's tensors
     r"the ModelOpt export's quant_algo is \"NVFP4\" but no tensor is stored as NAME\.weight / NAME\.weight_scale / "
     r"NAME\.weight_scale_2"),
    ({"quant_method": "modelopt", "quant_algo": "fp8_pb_wo"}, {},
     r"quant_algo is \"fp8_pb_wo\": FP8 weights in blocks with unquantized activations; the IR's fp8_block "
     r"quantizes its activations"),
    ({"quant_method": "modelopt", "quant_algo": "W4A16_AWQ"}, {},  # config.json's flat form carries no group size
     r"quantization_config\.group_size is null; W4A16_AWQ needs the positive number of input features that share "
     r"one weight_scale"),
    ({"quant_method": "modelopt", "quant_algo": "W8A8_SQ_PER_CHANNEL"}, {},  # imported, but these are GPTQ's tensors
     rf"tensor '{Q}\.weight' is missing; a modelopt quantized linear stores weight, weight_scale, input_scale \(found "
     rf"none of them\)"),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "INT8"}, {},
     r"quantization_config\.kv_cache_quant_algo is \"INT8\"; imported: FP8"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, {},
     r"quantization_config\.version is \"gemv\"; imported: gemm"),
    ({**CT_MIXED, "config_groups": {"group_0": _ct_group(["Linear"], "pack-quantized", _w4a16_args(False, None),
                                                         None)}}, {},
     rf"tensor '{Q}\.weight_packed' is missing; a compressed-tensors quantized linear stores weight_packed, "
     rf"weight_scale \(found none of them\)"),
    (GPTQ_V1, dict(replace={f"{Q}.scales": torch.ones(2, 64, dtype=torch.float16).index_fill_(1, torch.tensor([5]),
                                                                                             float("nan"))}),
     rf"tensor '{Q}\.scales' holds nan at \[0, 5\] \(2 of 128 values are not finite\); the checkpoint is corrupt"),
    (GPTQ_V1, dict(replace={f"{Q}.g_idx": torch.arange(64, dtype=torch.int32) // 32 * 5}),  # before any indexing
     rf"tensor '{Q}\.g_idx' holds group ids 0\.\.5; expected 0\.\.1"),
    ({**CT_MIXED, "ignore": "lm_head"}, {},
     r"quantization_config\.ignore is \"lm_head\"; expected a list of module names or patterns"),
    ({**CT_MIXED, "ignore": ["lm_head", 5]}, {},
     r"quantization_config\.ignore\[1\] is 5; expected a module name or pattern \(a non-empty string\)"),
    ({**CT_MIXED, "ignore": ["re:("]}, {},
     r"quantization_config\.ignore\[0\] \"re:\(\" is not a valid regular expression \(missing \)"),
    ({**FINE_GRAINED, "modules_to_not_convert": "model.layers.1.mlp.down_proj"}, {},
     r"quantization_config\.modules_to_not_convert is \"model\.layers\.1\.mlp\.down_proj\"; expected a list"),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": [1]}, {},
     r"quantization_config\.exclude_modules\[0\] is 1; expected a module name or pattern"),
], ids=["missing-qzeros", "qweight-shape", "scales-groups", "g_idx-uneven", "bits-3", "gptq-marlin", "hqq",
        "fp8-per-tensor", "fp8-huge-blocks", "fp8-static", "fp8-activations-false", "modelopt-unknown",
        "modelopt-nvfp4", "modelopt-fp8-pb-wo",
        "modelopt-awq-no-group-size", "modelopt-smoothquant", "modelopt-kv-int8", "awq-gemv", "ct-not-packed",
        "scales-nan", "g_idx-past-the-groups", "ct-ignore-a-string", "ct-ignore-not-a-string", "ct-ignore-bad-regex",
        "fp8-not-converted-a-string", "modelopt-exclude-not-a-string"])
def test_malformed_checkpoint_fails_naming_the_tensor(traced, base, tmp_path, config, edit, message):
    from builder.checkpoint import CheckpointError

    write_quantized(base, tmp_path / "ckpt", config, _gptq_plain)
    _edit(tmp_path / "ckpt", **edit)
    with pytest.raises(CheckpointError, match=message) as info:
        attach(traced, tmp_path / "ckpt")
    assert "\n" not in str(info.value)


def _set_scales(path: Path, name: str, change) -> None:
    """Replace checkpoint tensor ``name`` with ``change`` of it."""
    tensors = load_file(path / "model.safetensors")
    tensors[name] = change(tensors[name].clone())
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _negative_at(row: int, col: int):
    return lambda s: s.index_put_((torch.tensor([row]), torch.tensor([col])), torch.tensor(-0.5, dtype=s.dtype))


CT_L0 = Q  # CT_MIXED: pack-quantized W4A16, weight_scale [64, 2]
CT_FP8 = "model.layers.1.self_attn.q_proj"  # float-quantized, one weight_scale for the tensor
CT_INT8 = "model.layers.1.mlp.down_proj"  # int-quantized, weight_scale per output channel [64, 1]


@pytest.mark.parametrize("config, writer, name, message", [
    (GPTQ_V1, _gptq_plain, f"{Q}.scales",
     rf"tensor '{Q}\.scales': every one of its 128 scales is 0, which dequantizes every weight of the linear to 0"),
    (CT_MIXED, _ct_mixed, f"{CT_L0}.weight_scale",
     rf"tensor '{CT_L0}\.weight_scale': every one of its 128 scales is 0"),
    (CT_MIXED, _ct_mixed, f"{CT_FP8}.weight_scale",
     rf"tensor '{CT_FP8}\.weight_scale': every one of its 1 scales is 0"),
], ids=["gptq-all-zero", "ct-packed-all-zero", "ct-fp8-tensor-zero"])
def test_all_zero_scales_are_refused_naming_the_tensor(traced, base, tmp_path, config, writer, name, message):
    """A GPTQ or compressed-tensors linear whose weight scales are all zero (every weight 0: an export that lost its
    scales), imported without a word before; refused now, naming the tensor."""
    from builder.checkpoint import CheckpointError

    write_quantized(base, tmp_path / "ckpt", config, writer)
    _set_scales(tmp_path / "ckpt", name, torch.zeros_like)
    with pytest.raises(CheckpointError, match=message) as info:
        attach(traced, tmp_path / "ckpt")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("config, writer, name, change", [
    (GPTQ_V1, _gptq_plain, f"{Q}.scales", _negative_at(1, 3)), (GPTQ_V1, _gptq_plain, f"{Q}.scales", torch.neg),
    (CT_MIXED, _ct_mixed, f"{CT_L0}.weight_scale", _negative_at(5, 1)),
    (CT_MIXED, _ct_mixed, f"{CT_INT8}.weight_scale", _negative_at(7, 0))],
    ids=["gptq-one-negative", "gptq-all-negative", "ct-packed-negative", "ct-int8-channel-negative"])
def test_negative_scales_import_with_their_sign(traced, base, tmp_path, config, writer, name, change):
    """Negative scales are a valid encoding (dequantization is scale * (q - zero) whatever the sign; AutoRound's
    full-range symmetric groups carry about half their scales negative): they import, their signs kept."""
    write_quantized(base, tmp_path / "ckpt", config, writer)
    _set_scales(tmp_path / "ckpt", name, change)
    graph = attach(traced, tmp_path / "ckpt")
    node = next(n for n in graph.nodes if n.source == name.rsplit(".", 1)[0])
    scales = graph.params[node.weights["scales" if "scales" in node.weights else "weight_scale"]]
    assert (scales < 0).any()


@pytest.mark.parametrize("config, writer, name, channels", [(GPTQ_V1, _gptq_plain, f"{Q}.scales", 1),  # [G, N]
                                                            (CT_MIXED, _ct_mixed, f"{CT_L0}.weight_scale", 0),
                                                            (CT_MIXED, _ct_mixed, f"{CT_INT8}.weight_scale", 0)],
                         ids=["gptq", "ct-packed", "ct-int8"])
def test_a_few_zero_scales_pruned_channels_still_import(traced, base, tmp_path, config, writer, name, channels):
    """Zero scales on some output channels (pruned: their weights dequantize to 0) are not refused."""
    write_quantized(base, tmp_path / "ckpt", config, writer)
    _set_scales(tmp_path / "ckpt", name, lambda s: s.index_fill_(channels, torch.tensor([0, 2]), 0.0))
    graph = attach(traced, tmp_path / "ckpt")
    node = next(n for n in graph.nodes if n.source == name.rsplit(".", 1)[0])
    scales = graph.params[node.weights["scales" if "scales" in node.weights else "weight_scale"]]
    assert (scales.reshape(scales.shape[0], -1)[[0, 2]] == 0).all() and (scales != 0).any()


QK = "model.layers.0.self_attn.k_proj"
FINE_32 = {**FINE_GRAINED, "weight_block_size": [32, 32]}


@pytest.mark.parametrize("config, files, writer, edit, message", [
    (FINE_32, {}, fine_grained((32, 32)), dict(drop=f"{Q}.weight_scale_inv"),
     rf"tensor '{Q}\.weight_scale_inv' is missing; a fp8 quantized linear stores weight, weight_scale_inv \(found "
     rf"weight\)"),
    (FINE_32, {}, fine_grained((32, 32)), dict(replace={f"{Q}.weight_scale_inv": torch.ones(2, 3)}),
     rf"tensor '{Q}\.weight_scale_inv' is float32 \(2, 3\); expected float16 or bfloat16 or float32 \(2, 2\) \(one "
     rf"scale per 32 x 32 block of the 64 x 64 weight, partial blocks included\)"),
    (FINE_32, {}, fine_grained((32, 32)), dict(replace={f"{QK}.weight_scale_inv": torch.ones(2, 2)}),
     rf"tensor '{QK}\.weight_scale_inv' is float32 \(2, 2\); expected .* \(1, 2\) \(one scale per 32 x 32 block "
     rf"of the 32 x 64 weight"),
    (FINE_32, {}, fine_grained((32, 32)), dict(replace={f"{Q}.weight": torch.ones(64, 64, dtype=torch.bfloat16)}),
     rf"tensor '{Q}\.weight' is bfloat16 \(64, 64\); expected float8_e4m3fn \(64, 64\) \(the linear's codes"),
    ({**MODELOPT_CONFIG, "quant_method": "modelopt"}, {}, _modelopt_fp8, dict(drop=f"{Q}.input_scale"),
     rf"tensor '{Q}\.input_scale' is missing; a modelopt quantized linear stores weight, weight_scale, input_scale "
     rf"\(found weight, weight_scale\)"),
    ({**MODELOPT_CONFIG, "quant_method": "modelopt"}, {}, _modelopt_fp8,
     dict(replace={f"{Q}.weight_scale": torch.ones(64)}),
     rf"tensor '{Q}\.weight_scale' is float32 \(64,\); expected a float tensor of shape \(1,\) \(one scale for "
     rf"the whole tensor\)"),
    ({**MODELOPT_CONFIG, "quant_method": "modelopt"},
     {"hf_quant_config.json": {**MODELOPT_FP8,
                               "quantization": {**MODELOPT_FP8["quantization"], "quant_algo": "W8A16"}}},
     _modelopt_fp8, {}, r"quantization_config\.quant_algo is \"FP8\" but hf_quant_config\.json beside it says "
                        r"\"W8A16\""),
    ({"quant_method": "modelopt"}, {"hf_quant_config.json": {**MODELOPT_FP8, "quantization": "FP8"}}, _modelopt_fp8, {},
     r"hf_quant_config\.json: quantization is \"FP8\"; expected an object with quant_algo"),
], ids=["missing-scale-inv", "scale-blocks", "k_proj-scale-rows", "weight-not-fp8", "modelopt-no-input-scale",
        "modelopt-per-channel-scale", "modelopt-configs-disagree", "modelopt-quantization-a-string"])
def test_malformed_fp8_block_and_modelopt_checkpoints_fail_naming_the_tensor(traced, base, tmp_path, config, files,
                                                                            writer, edit, message):
    from builder.checkpoint import CheckpointError

    write_quantized(base, tmp_path / "ckpt", config, writer, files)
    _edit(tmp_path / "ckpt", **edit)
    with pytest.raises(CheckpointError, match=message) as info:
        attach(traced, tmp_path / "ckpt")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name, recipe, message", [
    ("fp8-blocks", "quantization:\n  algo: gptq\n",
     r"quantization: algo gptq does not describe the checkpoint, which is already quantized by fp8 \(fp8_block, "
     r"8-bit, group_size 128\)"),
    ("fp8-blocks", "quantization:\n  algo: fp8\n  weight_granularity: channel\n",
     r"quantization: weight_granularity channel \(the checkpoint's is block\) does not describe the checkpoint"),
    ("modelopt-fp8", "quantization:\n  algo: fp8\n  activations: dynamic\n",
     r"quantization: activations dynamic \(the checkpoint's is static\) does not describe the checkpoint, which is "
     r"already quantized by modelopt \(fp8, 8-bit, group_size -1\)"),
], ids=["fp8-blocks-gptq", "fp8-blocks-per-channel", "modelopt-dynamic"])
def test_a_recipe_that_disagrees_with_the_import_is_refused(request, name, recipe, message, tmp_path):
    """A recipe quantization section is checked against the checkpoint's before anything is built; ``algo: fp8``
    alone describes both (it writes fp8 W8A8, which both are)."""
    from builder.checkpoint import open_checkpoint
    from builder.prequantized import recipe_disagreement
    from builder.recipe import QuantizationSection

    case = next(c for c in CASES if c.name == name)
    write_quantized(request.getfixturevalue(case.base), tmp_path / "ckpt", case.config, case.quantize, case.files)
    res = run_build(tmp_path / "ckpt", tmp_path / "out", recipe)
    assert res.exit_code == 1 and "Traceback" not in res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(message, lines[0]), lines
    assert recipe_disagreement(open_checkpoint(tmp_path / "ckpt").quant, [QuantizationSection(algo="fp8")]) is None


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
