"""NVIDIA ModelOpt NVFP4 exports (``quant_algo: NVFP4``: e2m1 weight codes, fp8 scales per 16 columns, a global scale)
build: each quantized weight is decoded as it is read, as ModelOpt dequantizes it (code value times block scale
times global scale, in fp32, rounded once to the build's dtype), and the build proceeds on those float weights. The
export's FP4 activation scales and FP8 KV-cache scales are left unread (the artifact computes with unquantized
activations and its recipe's KV cache), and the manifest says how many of each it decoded and dropped.

The export is written here independently of ``builder/checkpoint.py``, as ModelOpt's NVFP4QTensor lays it out:
global scale = amax / (6 * 448); a block of 16 columns' scale = its amax / (6 * global), cast to float8_e4m3fn (1 where
the block is all zeros); codes = the nearest e2m1 value of w / (block scale * global), sign in bit 3; two codes a byte,
the even column in the low nibble. The runtime's logits and greedy tokens are the Hugging Face model's holding the
dequantized weights."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import build_artifact, make_checkpoint

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8 [N, K / 2], block scales fp8 [N, K / 16], global scale fp32 [], the dequantized weight fp32)."""
    w = w.float()
    scale_2 = w.abs().amax() / (6.0 * 448.0)
    blocks = w.view(w.shape[0], -1, 16)
    block_scale = blocks.abs().amax(-1) / (6.0 * scale_2)
    block_scale[block_scale == 0] = 1.0
    block_scale = block_scale.to(torch.float8_e4m3fn)
    scaled = blocks / (block_scale.float() * scale_2)[..., None]
    index = (scaled.abs()[..., None] - E2M1).abs().argmin(-1)  # nearest magnitude (the lower one on a tie)
    codes = (index + 8 * (scaled < 0)).to(torch.uint8).flatten(-2)  # sign in bit 3
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    dequant = (torch.where(scaled < 0, -1.0, 1.0) * E2M1[index] * (block_scale.float() * scale_2)[..., None])
    return packed, block_scale, scale_2.reshape(()), dequant.flatten(-2)


def export(base: Path, out: Path, kv_cache: str | None = "FP8") -> dict[str, torch.Tensor]:
    """The tiny checkpoint at ``base`` as a ModelOpt NVFP4 export at ``out``; returns the dequantized weights."""
    out.mkdir(parents=True)
    for f in base.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            (out / f.name).write_bytes(f.read_bytes())
    tensors = load_file(base / "model.safetensors")
    stored, dequantized = {}, {}
    for name, t in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in LINEARS:
            prefix = name.removesuffix(".weight")
            codes, scales, scale_2, dequantized[name] = quantize_nvfp4(t)
            stored.update({name: codes, f"{prefix}.weight_scale": scales, f"{prefix}.weight_scale_2": scale_2,
                           f"{prefix}.input_scale": torch.tensor(0.02)})
        else:
            stored[name] = t
    layers = json.loads((base / "config.json").read_text())["num_hidden_layers"]
    for i in range(layers):  # an FP8 KV cache's scales: left unread
        stored[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.1)
        stored[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.2)
    save_file(stored, out / "model.safetensors")
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                     "kv_cache_quant_algo": kv_cache, "exclude_modules": ["lm_head"]}
    (out / "config.json").write_text(json.dumps(config))
    return dequantized


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("nvfp4")
    base = make_checkpoint(root / "base", "llama", seed=4, tie_word_embeddings=False)
    dequantized = export(base, root / "ckpt")
    return root, dequantized, build_artifact(root / "ckpt", root / "artifact")


@pytest.mark.parametrize("rows_at_a_time", [1024, 5])
def test_the_reader_decodes_each_weight_as_modelopt_dequantizes_it(exported, rows_at_a_time, monkeypatch):
    """Every quantized weight read from the export equals the dequantization above in fp32, bit for bit, and rounds
    once to bf16 (decoded whole, and 5 rows at a time); its scales and the activation / KV-cache scales are not
    weights of the checkpoint."""
    import builder.checkpoint
    from builder.checkpoint import open_checkpoint

    monkeypatch.setattr(builder.checkpoint, "NVFP4_ROWS", rows_at_a_time)

    root, dequantized, _ = exported
    ckpt = open_checkpoint(root / "ckpt")
    assert ckpt.quant is None and sorted(ckpt.nvfp4) == sorted(dequantized)
    assert len(ckpt.nvfp4_dropped) == len(dequantized) + 4  # input scales, then two layers' k / v scales
    assert not any(re.search(r"(scale|scale_2)$", n) for n in ckpt.weight_map)
    read = ckpt.load_tensors(sorted(dequantized), torch.float32)
    for name, want in dequantized.items():
        assert torch.equal(read[name], want), name
    bf16 = ckpt.load_tensors([next(iter(dequantized))], torch.bfloat16)
    assert torch.equal(bf16[next(iter(dequantized))], dequantized[next(iter(dequantized))].to(torch.bfloat16))


def test_the_artifact_computes_what_hf_does_with_the_dequantized_weights(exported):
    """Logits of fresh random tokens within 1e-5 of the Hugging Face model holding the dequantized weights, and its
    greedy tokens; the manifest records the decoded weights and the unread scales."""
    from transformers import AutoModelForCausalLM

    from runtime import Engine, SamplingParams

    root, dequantized, artifact = exported
    model = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32).eval()
    model.load_state_dict({**model.state_dict(), **dequantized})
    engine = Engine.load(artifact)
    gen = torch.Generator().manual_seed(8)
    ids = torch.randint(3, model.config.vocab_size, (40,), generator=gen).tolist()
    with torch.no_grad():
        expected = model(torch.tensor([ids]), use_cache=False).logits[0]
    assert (engine.logits(ids) - expected).abs().max().item() < 1e-5
    prompt = ids[:9]
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                              pad_token_id=2)[0, len(prompt):].tolist()
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert engine.generate(prompt, params).token_ids == want
    manifest = (artifact / "manifest.json").read_text()
    assert '"source_nvfp4_weights": 14' in manifest and '"source_nvfp4_unread_scales": 18' in manifest


def test_malformed_nvfp4_exports_fail_naming_the_tensor(exported, tmp_path):
    """A weight without its block scales, block scales of the wrong shape, and a KV-cache algorithm that is not FP8
    each stop the build naming the tensor or setting; NVFP4_AWQ inside a mixed-precision export stays refused."""
    from builder.checkpoint import CheckpointError, open_checkpoint

    root, _, _ = exported
    q = "model.layers.0.self_attn.q_proj"

    def edited(name: str, edit) -> Path:
        out = tmp_path / name
        out.mkdir()
        for f in (root / "ckpt").iterdir():
            (out / f.name).write_bytes(f.read_bytes())
        tensors = load_file(out / "model.safetensors")
        config = json.loads((out / "config.json").read_text())
        edit(tensors, config)
        save_file(tensors, out / "model.safetensors")
        (out / "config.json").write_text(json.dumps(config))
        return out

    no_scale = edited("no-scale", lambda t, c: t.pop(f"{q}.weight_scale"))
    with pytest.raises(CheckpointError, match=rf"NVFP4 tensor '{q}\.weight_scale_2' has no '{q}\.weight_scale'"):
        open_checkpoint(no_scale)
    bad_shape = edited("bad-shape", lambda t, c: t.update(
        {f"{q}.weight_scale": t[f"{q}.weight_scale"][:, :-1].contiguous()}))
    with pytest.raises(CheckpointError, match=rf"NVFP4 weight '{q}\.weight': codes \(64, 32\) and block scales "
                                              rf"\(64, 3\) are not \[N, K / 2\] and \[N, K / 16\]"):
        open_checkpoint(bad_shape).load_tensors([f"{q}.weight"], torch.float32)
    kv = edited("kv", lambda t, c: c["quantization_config"].update(kv_cache_quant_algo="NVFP4"))
    with pytest.raises(CheckpointError, match=r"kv_cache_quant_algo is \"NVFP4\" beside NVFP4 weights; imported: FP8"):
        open_checkpoint(kv)
    scheme = edited("kv-scheme", lambda t, c: (c["quantization_config"].pop("kv_cache_quant_algo"),
                                               c["quantization_config"].update(kv_cache_scheme="NVFP4")))
    with pytest.raises(CheckpointError, match=r"kv_cache_quant_algo is \"NVFP4\" beside NVFP4 weights"):
        open_checkpoint(scheme)  # config.json's own key for it
    mixed = edited("mixed", lambda t, c: c["quantization_config"].update(
        quant_algo="MIXED_PRECISION", quantized_layers={f"{q}": {"quant_algo": "NVFP4_AWQ"}}))
    with pytest.raises(CheckpointError, match=r"quant_algo is \"NVFP4_AWQ\": FP4 \(e2m1\) weights with fp8 scales "
                                              r"per 16 have no IR scheme \(an export of NVFP4_AWQ alone is decoded"):
        open_checkpoint(mixed)


def test_an_hf_quant_config_only_export_builds_and_its_file_is_hashed(exported, tmp_path):
    """ModelOpt before 0.29 wrote hf_quant_config.json alone (no quantization_config in config.json): the export
    builds the same, and the manifest's source hashes include that file, which said how the weights decode."""
    root, dequantized, _ = exported
    out = tmp_path / "ckpt"
    out.mkdir()
    for f in (root / "ckpt").iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((out / "config.json").read_text())
    q = config.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(config))
    (out / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt", "version": "0.27.0"},
                                                          "quantization": {k: v for k, v in q.items()
                                                                           if k != "quant_method"}}))
    artifact = build_artifact(out, tmp_path / "artifact")
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert '"source_nvfp4_weights": 14' in json.dumps(manifest)
    assert "hf_quant_config.json" in json.dumps(manifest)


def test_an_moe_export_with_experts_stored_one_by_one_builds(tmp_path):
    """A Qwen3-MoE-style export whose experts are stored per expert (the names transformers stacks on load): every
    2-D linear of the layers decoded, the experts stacked as the float build stacks them, and the build's verify
    pass (the Hugging Face model holding the decoded weights) passes."""
    from safetensors.torch import load_file, save_file
    from test_prequantized_moe import QWEN3_MOE, make_moe_checkpoint

    base = make_moe_checkpoint(tmp_path / "base", "qwen3_moe", QWEN3_MOE, seed=3)
    out = tmp_path / "ckpt"
    out.mkdir()
    for f in base.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    stored = {}
    for name, t in load_file(base / "model.safetensors").items():
        if name.endswith(".weight") and ".layers." in name and t.dim() == 2 and "norm" not in name \
                and not name.endswith("mlp.gate.weight"):
            prefix = name.removesuffix(".weight")
            codes, scales, scale_2, _ = quantize_nvfp4(t)
            stored.update({name: codes, f"{prefix}.weight_scale": scales, f"{prefix}.weight_scale_2": scale_2})
        else:
            stored[name] = t
    assert any(".experts.0." in n for n in stored)
    save_file(stored, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
    (out / "config.json").write_text(json.dumps(config))
    artifact = build_artifact(out, tmp_path / "artifact")
    manifest = json.loads((artifact / "manifest.json").read_text())
    num_quantized = sum(1 for n in stored if n.endswith(".weight_scale_2"))
    assert f'"source_nvfp4_weights": {num_quantized}' in json.dumps(manifest)


def test_an_nvfp4_awq_export_folds_its_pre_quant_scales(tmp_path):
    """NVFP4_AWQ: ModelOpt keeps AWQ's per-input-channel scale s on the linears whose input no norm absorbs (o_proj,
    down_proj), their weights quantized as W / s, so that the linear computes W' (s * x). The decoded weight is
    dequant(W') * s, folded in fp32; the artifact's logits are the Hugging Face model's holding those weights."""
    from transformers import AutoModelForCausalLM

    from builder.checkpoint import open_checkpoint
    from runtime import Engine

    base = make_checkpoint(tmp_path / "base", "llama", seed=6, tie_word_embeddings=False)
    out = tmp_path / "ckpt"
    out.mkdir()
    for f in base.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    gen = torch.Generator().manual_seed(2)
    stored, folded = {}, {}
    for name, t in load_file(base / "model.safetensors").items():
        if name.endswith(".weight") and name.split(".")[-2] in LINEARS:
            prefix = name.removesuffix(".weight")
            smoothed = name.split(".")[-2] in ("o_proj", "down_proj")
            s = 0.5 + 1.5 * torch.rand(t.shape[1], generator=gen) if smoothed else torch.ones(t.shape[1])
            codes, scales, scale_2, dequant = quantize_nvfp4(t.float() / s)
            stored.update({name: codes, f"{prefix}.weight_scale": scales, f"{prefix}.weight_scale_2": scale_2})
            if smoothed:
                stored[f"{prefix}.pre_quant_scale"] = s
            folded[name] = dequant * s
        else:
            stored[name] = t
    save_file(stored, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4_AWQ", "group_size": 16}
    (out / "config.json").write_text(json.dumps(config))
    ckpt = open_checkpoint(out)
    read = ckpt.load_tensors(sorted(folded), torch.float32)
    assert all(torch.equal(read[n], folded[n]) for n in folded)
    assert sum(len(parts) == 4 for parts in ckpt.nvfp4.values()) == 4  # two layers' o_proj and down_proj
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    model.load_state_dict({**model.state_dict(), **folded})
    engine = Engine.load(build_artifact(out, tmp_path / "artifact"))
    ids = torch.randint(3, model.config.vocab_size, (30,), generator=gen).tolist()
    with torch.no_grad():
        expected = model(torch.tensor([ids]), use_cache=False).logits[0]
    assert (engine.logits(ids) - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("bad, message", [
    ("zeros", r"pre_quant_scale is 0 in all 32 values, which would fold the weight to zeros; expected finite scales, "
              r"not all 0 \(a few zeros and negative values are allowed\)"),
    ("nan", r"pre_quant_scale holds nan \(input feature 3\), which the folded column would carry into every output; "
            r"expected finite scales, not all 0"),
    ("inf", r"pre_quant_scale holds -inf \(input feature 3\)")])
def test_an_nvfp4_awq_scale_that_is_not_finite_or_all_zero_is_refused(bad, message):
    """NVFP4_AWQ folds its pre_quant_scale into the decoded columns (W diag(s)): an all-0 scale would fold the whole
    weight to zeros and an inf or nan would reach every output, silently; both are refused as the AWQ imports refuse
    them. A signed scale with a zero in it decodes as the product it is."""
    from builder.checkpoint import decode_nvfp4

    gen = torch.Generator().manual_seed(5)
    codes, scales, scale_2, dequant = quantize_nvfp4(torch.randn(8, 32, generator=gen))
    s = torch.randn(32, generator=gen)
    s[5] = 0.0
    assert torch.equal(decode_nvfp4(codes, scales, scale_2, torch.float32, s), dequant * s)
    s = {"zeros": torch.zeros(32), "nan": s.clone().index_fill_(0, torch.tensor([3]), float("nan")),
         "inf": s.clone().index_fill_(0, torch.tensor([3]), float("-inf"))}[bad]
    with pytest.raises(ValueError, match=message):
        decode_nvfp4(codes, scales, scale_2, torch.float32, s)
