"""Write a Hugging Face checkpoint of a real model's shape with random weights, for benchmarks.

    python -m builder.devtools.make_checkpoint --preset llama3-8b --out /tmp/llama3-8b-random --device cuda
    python -m builder.devtools.make_checkpoint --preset qwen3-30b-a3b --out checkpoints/qwen3-30b-a3b-random

Speed does not depend on weight values, so benchmarks at a real model's shape need no download: this
writes ``config.json``, sharded ``model-*.safetensors`` with their index, and a word-level tokenizer
covering the whole vocabulary, all loadable by ``transformers`` and by ``builder build``. Weights are
drawn on ``--device`` (a GPU makes the 8B preset take seconds instead of minutes), seeded, with
std 0.02 for matrices and 1 + 0.02·N(0, 1) for norm gains, so activations stay finite through 32 layers.
Presets are Llama-shaped (``LlamaShape``) or Qwen3-MoE-shaped (``Qwen3MoeShape``: every layer's MLP a mixture
of experts). A random router (std 0.02, like every matrix) spreads tokens over all the experts: its logits have a
std of about 0.02·sqrt(hidden), 0.9 at hidden 2048, so each token's top-k differs with its hidden state.

Shards are written one at a time from one reused host buffer (pinned when drawing on a GPU), so the host holds
one shard (4 GiB), not the model: the 30B-A3B preset is 61 GB.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, replace
from math import prod
from pathlib import Path

import torch
from safetensors.torch import save_file

SHARD_BYTES = 4 << 30
EXPERT_TENSORS = ("stacked", "per-expert")  # how a mixture of experts' weights are stored (make_checkpoint)

# (name, shape, is_norm) of one weight
TensorSpec = tuple[str, tuple[int, ...], bool]


@dataclass(frozen=True)
class LlamaShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 8192
    rope_theta: float = 500000.0
    tie_word_embeddings: bool = False

    def hf_config(self, dtype: torch.dtype):
        from transformers import LlamaConfig

        return LlamaConfig(**asdict(self), rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1,
                           torch_dtype=str(dtype).removeprefix("torch."))

    def tensors(self) -> list[TensorSpec]:
        """Every weight, in the HF Llama naming."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        head_dim = h // self.num_attention_heads
        kv = self.num_key_value_heads * head_dim
        out = [("model.embed_tokens.weight", (v, h), False)]
        for n in range(self.num_hidden_layers):
            p = f"model.layers.{n}."
            out += [(p + "input_layernorm.weight", (h,), True),
                    (p + "self_attn.q_proj.weight", (h, h), False),
                    (p + "self_attn.k_proj.weight", (kv, h), False),
                    (p + "self_attn.v_proj.weight", (kv, h), False),
                    (p + "self_attn.o_proj.weight", (h, h), False),
                    (p + "post_attention_layernorm.weight", (h,), True),
                    (p + "mlp.gate_proj.weight", (i, h), False),
                    (p + "mlp.up_proj.weight", (i, h), False),
                    (p + "mlp.down_proj.weight", (h, i), False)]
        out.append(("model.norm.weight", (h,), True))
        if not self.tie_word_embeddings:
            out.append(("lm_head.weight", (v, h), False))
        return out


@dataclass(frozen=True)
class Qwen3MoeShape:
    """Qwen3-MoE (``Qwen3MoeForCausalLM``): every layer's MLP a mixture of experts routed by a softmax top-k,
    per-head q/k RMSNorm."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    intermediate_size: int  # the dense MLP of mlp_only_layers, which no layer is here (kept as the real config has it)
    max_position_embeddings: int = 40960
    rope_theta: float = 1e6
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False

    def hf_config(self, dtype: torch.dtype):
        from transformers import AutoConfig

        return AutoConfig.for_model("qwen3_moe", **asdict(self), rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
                                    torch_dtype=str(dtype).removeprefix("torch."))

    def tensors(self) -> list[TensorSpec]:
        """Every weight under Qwen3MoeForCausalLM's own state-dict names (transformers >= 5): a layer's experts as
        two stacked tensors, ``mlp.experts.gate_up_proj`` [E, 2 * I, hidden] (each expert's gate rows, then its up
        rows) and ``mlp.experts.down_proj`` [E, hidden, I]."""
        h, v, d, e, i = self.hidden_size, self.vocab_size, self.head_dim, self.num_experts, self.moe_intermediate_size
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        out = [("model.embed_tokens.weight", (v, h), False)]
        for n in range(self.num_hidden_layers):
            p = f"model.layers.{n}."
            out += [(p + "input_layernorm.weight", (h,), True),
                    (p + "self_attn.q_proj.weight", (q, h), False),
                    (p + "self_attn.k_proj.weight", (kv, h), False),
                    (p + "self_attn.v_proj.weight", (kv, h), False),
                    (p + "self_attn.o_proj.weight", (h, q), False),
                    (p + "self_attn.q_norm.weight", (d,), True),
                    (p + "self_attn.k_norm.weight", (d,), True),
                    (p + "post_attention_layernorm.weight", (h,), True),
                    (p + "mlp.gate.weight", (e, h), False),
                    (p + "mlp.experts.gate_up_proj", (e, 2 * i, h), False),
                    (p + "mlp.experts.down_proj", (e, h, i), False)]
        out.append(("model.norm.weight", (h,), True))
        if not self.tie_word_embeddings:
            out.append(("lm_head.weight", (v, h), False))
        return out


Shape = LlamaShape | Qwen3MoeShape

PRESETS: dict[str, Shape] = {
    "llama3-8b": LlamaShape(128256, 4096, 14336, 32, 32, 8),
    "llama3-1b": LlamaShape(128256, 2048, 8192, 16, 32, 8, tie_word_embeddings=True),
    # Llama-3-70B: 70.6B parameters, 141 GB in bf16; written with --fp8-channel it takes 72 GB (issue 22's runs)
    "llama3-70b": LlamaShape(128256, 8192, 28672, 80, 64, 8),
    "tiny": LlamaShape(512, 64, 128, 2, 4, 2, max_position_embeddings=512),
    # Qwen3-30B-A3B: 30.5B parameters (61 GB in bf16), 3.3B active per token (8 of 128 experts)
    "qwen3-30b-a3b": Qwen3MoeShape(151936, 2048, 48, 32, 4, 128, num_experts=128, num_experts_per_tok=8,
                                   moe_intermediate_size=768, intermediate_size=6144),
    # head_dim 32: the least the paged attention kernels take, so it runs in CUDA graphs (gpu_suite.sh tp-check)
    "tiny-moe": Qwen3MoeShape(512, 64, 2, 4, 2, 32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                              intermediate_size=128, max_position_embeddings=512),
}


def per_expert_tensors(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """A stacked experts tensor as the published checkpoints store it, one tensor per expert and projection
    (``mlp.experts.3.gate_proj.weight``), views of ``t``; any other tensor as it is."""
    prefix, _, leaf = name.rpartition(".")
    if not prefix.endswith("mlp.experts") or leaf not in ("gate_up_proj", "down_proj"):
        return {name: t}
    if leaf == "down_proj":  # t: [E, hidden, I]
        return {f"{prefix}.{e}.down_proj.weight": t[e] for e in range(t.shape[0])}
    inter = t.shape[1] // 2  # t: [E, 2 * I, hidden], each expert's gate rows then its up rows
    return {f"{prefix}.{e}.{proj}.weight": t[e, k * inter:(k + 1) * inter]
            for e in range(t.shape[0]) for k, proj in enumerate(("gate_proj", "up_proj"))}


def plan_shards(specs: list[TensorSpec], dtype: torch.dtype) -> list[list[TensorSpec]]:
    """The weights in file order, cut into shards of at most SHARD_BYTES (a larger tensor gets a shard of its own)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = prod(spec[1]) * dtype.itemsize
        if size and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


ROUTER_MODULES = ("mlp.gate",)  # left in floating point in fine-grained FP8 checkpoints (modules_to_not_convert)


def fp8_block_quantize(name: str, t: torch.Tensor, block: int) -> dict[str, torch.Tensor]:
    """A linear's weight [out, in] as transformers' fine-grained FP8 stores it: e4m3 codes under ``name`` and one fp32
    ``weight_scale_inv`` (amax / 448) per block x block tile, partial last tiles included; norms, embeddings, the
    lm_head and routers (any other tensor) as they are."""
    module = name.removesuffix(".weight")
    if not _quantizes(name, t):
        return {name: t}
    n, k = t.shape
    rows, cols = -(-n // block), -(-k // block)
    padded = torch.zeros(rows * block, cols * block, dtype=torch.float32, device=t.device)
    padded[:n, :k] = t.float()
    tiles = padded.view(rows, block, cols, block)
    scales = tiles.abs().amax(dim=(1, 3)) / 448  # [rows, cols]; all-zero padding never is a whole tile
    codes = (tiles / scales[:, None, :, None]).view(rows * block, cols * block)[:n, :k].to(torch.float8_e4m3fn)
    return {name: codes, f"{module}.weight_scale_inv": scales}


# compressed-tensors FP8 (llm-compressor's FP8_DYNAMIC preset): e4m3 weights with one scale per output channel,
# inputs quantized per token at run time; the lm_head left in floating point
COMPRESSED_FP8 = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
                  "config_groups": {"group_0": {
                      "targets": ["Linear"], "format": "float-quantized",
                      "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel",
                                  "dynamic": False},
                      "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                                            "dynamic": True}}},
                  "ignore": ["lm_head", "re:.*mlp\\.gate$"]}


def _quantizes(name: str, t: torch.Tensor) -> bool:
    """Whether a pre-quantized checkpoint stores this tensor quantized: a decoder layer's linear weight, not a norm's
    or a router's."""
    module = name.removesuffix(".weight")
    return (t.dim() == 2 and name.endswith(".weight") and ".layers." in name and "norm" not in name
            and not any(module.endswith(f".{r}") for r in ROUTER_MODULES))


def fp8_channel_quantize(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """A linear's weight [out, in] as compressed-tensors FP8 stores it: e4m3 codes under ``name`` and one fp32
    ``weight_scale`` [out, 1] (amax / 448) per output channel; any other tensor as it is."""
    if not _quantizes(name, t):
        return {name: t}
    scale = t.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448
    return {name: (t.float() / scale).to(torch.float8_e4m3fn), f"{name.removesuffix('.weight')}.weight_scale": scale}


def make_checkpoint(out: str | Path, shape: Shape, *, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                    device: str = "cpu", expert_tensors: str = "stacked", fp8_blocks: int = 0,
                    fp8_channel: bool = False) -> Path:
    """Write the checkpoint into ``out`` (created); returns its path.

    ``expert_tensors`` (mixture-of-experts shapes): ``stacked``, the model's own state-dict names, which
    transformers >= 5 loads as they are and ``builder build`` reads without copying; ``per-expert``, the layout of
    the published checkpoints (``experts.3.gate_proj.weight``), which transformers and the build stack on load. Both
    hold the same weights for one seed.

    ``fp8_blocks`` B > 0: the linears written as transformers' fine-grained FP8 (``quant_method: fp8``, B x B blocks,
    dynamic activations; Qwen3-30B-A3B-FP8's layout): e4m3 codes and fp32 ``weight_scale_inv`` per block
    (:func:`fp8_block_quantize`), drawn from the same weights; embeddings, norms, the lm_head and the routers stay in
    ``dtype``. Experts then take the per-expert layout.

    ``fp8_channel``: the linears written as compressed-tensors FP8 (:data:`COMPRESSED_FP8`: e4m3 codes, one fp32
    ``weight_scale`` per output channel, inputs per token; :func:`fp8_channel_quantize`), half the bf16 bytes.
    """
    assert expert_tensors in EXPERT_TENSORS, f"expert_tensors {expert_tensors!r} is not one of {EXPERT_TENSORS}"
    assert not (fp8_blocks and fp8_channel), "one FP8 layout: blocks or channels"
    quantize = ((lambda name, t: fp8_block_quantize(name, t, fp8_blocks)) if fp8_blocks
                else fp8_channel_quantize if fp8_channel else None)
    if quantize is not None:
        expert_tensors = "per-expert"
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = shape.hf_config(dtype)
    if fp8_blocks:
        config.quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                      "weight_block_size": [fp8_blocks, fp8_blocks],
                                      "modules_to_not_convert": list(ROUTER_MODULES)}
    elif fp8_channel:
        config.quantization_config = COMPRESSED_FP8
    config.save_pretrained(out)
    generator = torch.Generator(device=device).manual_seed(seed)
    shards = plan_shards(shape.tensors(), dtype)
    # every shard's tensors are views of one host buffer, reused shard after shard
    buffer_bytes = max(sum(prod(s) for _, s, _ in shard) for shard in shards) * dtype.itemsize
    staging = torch.empty(0 if quantize else buffer_bytes, dtype=torch.uint8,
                          pin_memory=torch.device(device).type == "cuda" and not quantize)
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        offset = 0
        for name, tshape, is_norm in shard:
            t = torch.randn(tshape, generator=generator, device=device, dtype=torch.float32) * 0.02
            if is_norm:
                t += 1.0
            if quantize:  # quantized from the device copy, then to the host (shards of FP8 codes are smaller)
                for part_name, part in (per_expert_tensors(name, t.to(dtype)) if expert_tensors == "per-expert"
                                        else {name: t.to(dtype)}).items():
                    tensors.update({k: v.cpu() for k, v in quantize(part_name, part).items()})
                continue
            nbytes = t.numel() * dtype.itemsize
            host = staging[offset:offset + nbytes].view(dtype).view(tshape)
            host.copy_(t.to(dtype))
            offset += nbytes
            tensors.update(per_expert_tensors(name, host) if expert_tensors == "per-expert" else {name: host})
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    write_tokenizer(out, shape.vocab_size)
    write_calibration_text(out / "calibration.jsonl", shape.vocab_size, seed)
    return out


def write_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer whose vocabulary is ``<bos>``, ``<eos>``, ``<unk>`` and ``t3`` ... ``t{V-1}``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<bos>": 0, "<eos>": 1, "<unk>": 2, **{f"t{k}": k for k in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "unk_token": "<unk>", "model_max_length": 1 << 20}, indent=1))


def write_calibration_text(path: Path, vocab_size: int, seed: int, num_texts: int = 64, words: int = 512) -> None:
    """Calibration text for the random model: lines of random vocabulary words (every token is a real id,
    not ``<unk>``), so calibrating passes see varied activations. Quality figures of a random model mean
    nothing; this only makes quantized builds of it run their full calibration."""
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(3, vocab_size, (num_texts, words), generator=g).tolist()
    path.write_text("".join(json.dumps({"text": " ".join(f"t{i}" for i in row)}) + "\n" for row in ids))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--expert-tensors", choices=EXPERT_TENSORS, default="stacked",
                        help="mixture-of-experts presets: stacked (the model's state-dict names; the build reads "
                             "them without copying) or per-expert (the published checkpoints' layout)")
    parser.add_argument("--num-hidden-layers", type=int, default=None,
                        help="fewer (or more) layers than the preset, e.g. to measure a build at a smaller size")
    parser.add_argument("--fp8-blocks", type=int, default=0, metavar="B",
                        help="write the linears as transformers' fine-grained FP8 in B x B blocks (e.g. 128: "
                             "Qwen3-30B-A3B-FP8's layout; experts per expert), a pre-quantized checkpoint")
    parser.add_argument("--fp8-channel", action="store_true",
                        help="write the linears as compressed-tensors FP8 (e4m3, a scale per output channel, inputs "
                             "per token: llm-compressor's FP8_DYNAMIC), a pre-quantized checkpoint at half the bytes")
    args = parser.parse_args(argv)
    if args.fp8_blocks < 0:
        parser.error(f"--fp8-blocks {args.fp8_blocks}: give a block size (e.g. 128), or 0 for none")
    if args.fp8_blocks and args.fp8_channel:
        parser.error("--fp8-blocks and --fp8-channel: give one FP8 layout")
    shape = PRESETS[args.preset]
    if args.num_hidden_layers is not None:
        if args.num_hidden_layers < 1:
            parser.error(f"--num-hidden-layers {args.num_hidden_layers}: give 1 or more")
        shape = replace(shape, num_hidden_layers=args.num_hidden_layers)
    if args.expert_tensors != "stacked" and not isinstance(shape, Qwen3MoeShape):
        parser.error(f"--expert-tensors {args.expert_tensors}: preset {args.preset} has no experts")
    start = time.perf_counter()
    path = make_checkpoint(args.out, shape, dtype=getattr(torch, args.dtype), seed=args.seed, device=args.device,
                           expert_tensors=args.expert_tensors, fp8_blocks=args.fp8_blocks,
                           fp8_channel=args.fp8_channel)
    layers = "" if args.num_hidden_layers is None else f", {shape.num_hidden_layers} layers"
    print(f"wrote {args.preset} ({args.dtype}{layers}) to {path} in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
