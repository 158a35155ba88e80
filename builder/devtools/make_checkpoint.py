"""Write a Llama-shaped Hugging Face checkpoint with random weights, for benchmarks.

    python -m builder.devtools.make_checkpoint --preset llama3-8b --out /tmp/llama3-8b-random --device cuda

Speed does not depend on weight values, so benchmarks at a real model's shape need no download: this
writes ``config.json``, sharded ``model-*.safetensors`` with their index, and a word-level tokenizer
covering the whole vocabulary, all loadable by ``transformers`` and by ``builder build``. Weights are
drawn on ``--device`` (a GPU makes the 8B preset take seconds instead of minutes), seeded, with
std 0.02 for matrices and 1 + 0.02·N(0, 1) for norm gains, so activations stay finite through 32 layers.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

SHARD_BYTES = 4 << 30


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


PRESETS = {
    "llama3-8b": LlamaShape(128256, 4096, 14336, 32, 32, 8),
    "llama3-1b": LlamaShape(128256, 2048, 8192, 16, 32, 8, tie_word_embeddings=True),
    "tiny": LlamaShape(512, 64, 128, 2, 4, 2, max_position_embeddings=512),
}


def _tensors(shape: LlamaShape) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, shape, is_norm) of every weight, in the HF Llama naming."""
    h, i, v = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    head_dim = h // shape.num_attention_heads
    kv = shape.num_key_value_heads * head_dim
    out = [("model.embed_tokens.weight", (v, h), False)]
    for n in range(shape.num_hidden_layers):
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
    if not shape.tie_word_embeddings:
        out.append(("lm_head.weight", (v, h), False))
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


def make_checkpoint(out: str | Path, shape: LlamaShape, *, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                    device: str = "cpu") -> Path:
    """Write the checkpoint into ``out`` (created); returns its path."""
    from transformers import LlamaConfig

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**asdict(shape), rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1,
                         torch_dtype=str(dtype).removeprefix("torch."))
    config.save_pretrained(out)
    generator = torch.Generator(device=device).manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tshape, is_norm in _tensors(shape):
        t = torch.randn(tshape, generator=generator, device=device, dtype=torch.float32) * 0.02
        if is_norm:
            t += 1.0
        t = t.to(dtype).cpu()
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    write_tokenizer(out, shape.vocab_size)
    write_calibration_text(out / "calibration.jsonl", shape.vocab_size, seed)
    return out


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
    args = parser.parse_args(argv)
    start = time.perf_counter()
    path = make_checkpoint(args.out, PRESETS[args.preset], dtype=getattr(torch, args.dtype), seed=args.seed,
                           device=args.device)
    print(f"wrote {args.preset} ({args.dtype}) to {path} in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
