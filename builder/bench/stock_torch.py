"""The stock-PyTorch baseline: what a user gets without this toolchain, on the same checkpoint.

    python -m builder.bench.stock_torch CHECKPOINT [--quant bf16|int8wo|int4] [--input-len 128] [--output-len 128]
                                                   [--batch-size N]

A plain Llama written in PyTorch (embedding, RMSNorm, RoPE, grouped-query SDPA over a static KV cache,
SwiGLU MLP), its weights read from the checkpoint's safetensors, the one-token decode step compiled with
``torch.compile(mode="reduce-overhead")`` (Inductor plus CUDA graphs) and the prefill with
``torch.compile`` as well, with gpt-fast's Inductor settings (``INDUCTOR_SETTINGS``: coordinate-descent tuning,
which also makes Inductor turn a one-row matmul into a fused multiply-and-reduce kernel, so the int8 weights are
dequantized inside it instead of materialized in bf16 every step): the recipe of gpt-fast, the fastest setup a
PyTorch user writes by hand.
Linears, every one but the lm_head, which stays in the model dtype as in the runtime's int4 artifacts:

    bf16     ``F.linear`` on the checkpoint's weights in bfloat16
    int8wo   int8 weights with one bf16 scale per output channel, dequantized inside the compiled matmul
    int4     asymmetric 4-bit groups of 128 on PyTorch's tinygemm kernel (``aten._weight_int4pack_mm``)

Batch 1 (the default): decode tokens/s = (output_len - 1) / (time of the decode steps after the first
token); TTFT is the prefill plus the first token. Batch N > 1: N random prompts of input_len tokens in a
static KV cache of N rows, prefilled together and decoded together; the figure is the median wall time of
one decode step (each step synchronized) over every step but the first, and N / that as tokens/s. One batch
size per process: each compiles its own graphs. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

QUANT_MODES = ("bf16", "int8wo", "int4")
# gpt-fast's (generate.py). Without coordinate-descent tuning Inductor keeps the int8 weight-only matmul as a bf16
# copy of the weights plus cuBLAS: 15.3 tok/s for the Llama-3-8B shape at batch 1 on an H100 (docs/BENCHMARKS.md)
INDUCTOR_SETTINGS = {"coordinate_descent_tuning": True, "fx_graph_cache": True}
INT4_GROUP_SIZE = 128
INT4_INNER_K_TILES = 8  # tinygemm's packing for the CUDA kernel


class StockModelError(ValueError):
    """A checkpoint or setting the stock baseline cannot run."""


@dataclass
class LlamaShape:
    """The few config.json fields a Llama forward needs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None or {"rope_type": "llama3", ...}
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, config: dict) -> LlamaShape:
        if config.get("model_type") not in ("llama", "mistral"):
            raise StockModelError(f"model_type {config.get('model_type')!r}: the stock baseline is a plain Llama "
                                  f"(llama, mistral)")
        heads = config["num_attention_heads"]
        scaling = config.get("rope_scaling") or config.get("rope_parameters")
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise StockModelError(f"rope_type {rope_type!r}: the stock baseline knows default and llama3 RoPE")
        theta = (scaling or {}).get("rope_theta", config.get("rope_theta", 10000.0))
        return cls(config["vocab_size"], config["hidden_size"], config["intermediate_size"],
                   config["num_hidden_layers"], heads, config.get("num_key_value_heads", heads),
                   config.get("head_dim") or config["hidden_size"] // heads, config.get("rms_norm_eps", 1e-6),
                   float(theta), scaling if rope_type == "llama3" else None,
                   bool(config.get("tie_word_embeddings", False)))


def rope_inv_freq(shape: LlamaShape) -> torch.Tensor:
    """[head_dim / 2] fp32 inverse frequencies, with Llama 3's long-context rescaling when configured."""
    d = shape.head_dim
    inv_freq = 1.0 / shape.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    s = shape.rope_scaling
    if s is None:
        return inv_freq.float()
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    between = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(between, mid, scaled).float()


# --- linears ----------------------------------------------------------------------------------------
class Int8WeightOnlyLinear(nn.Module):
    """int8 weight [out, in] and a bf16 scale per output channel; Inductor fuses the dequantization."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127  # scale: [out]
        self.register_buffer("weight", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype)) * self.scale


def quantize_int4_groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit groups (the passes' round-to-nearest) in tinygemm's convention:
    w ~= (q - 8) * scale + zero, so tinygemm's float zero is (8 - integer zero) * scale.

    Returns codes [out, in] int32 in [0, 15] and scales_and_zeros [in / group_size, out, 2] (bf16)."""
    from passes.quant_math import QuantConfig, quantize_groups

    codes, scale, zero = quantize_groups(weight, QuantConfig(bits=4, group_size=group_size))  # scale: [out, groups]
    offset = (8 - zero.float()) * scale
    scales_and_zeros = torch.stack((scale, offset), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return codes.to(torch.int32), scales_and_zeros


class Int4TinygemmLinear(nn.Module):
    """PyTorch's own int4 weight-only matmul (``aten._weight_int4pack_mm``), group size 128."""

    def __init__(self, weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> None:
        super().__init__()
        out_f, in_f = weight.shape
        if in_f % group_size or out_f % 8:
            raise StockModelError(f"a [{out_f}, {in_f}] weight does not fit int4 groups of {group_size}")
        codes, scales_and_zeros = quantize_int4_groups(weight, group_size)
        if weight.is_cuda:
            packed = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8)
            packed = torch.ops.aten._convert_weight_to_int4pack(packed, INT4_INNER_K_TILES)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, INT4_INNER_K_TILES)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(weight.device))
        self.group_size, self.out_features = group_size, out_f

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        mm = torch.ops.aten._weight_int4pack_mm if x.is_cuda else torch.ops.aten._weight_int4pack_mm_for_cpu
        y = mm(rows, self.packed, self.group_size, self.scales_and_zeros)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)


def make_linear(weight: torch.Tensor, quant: str) -> nn.Module:
    if quant == "bf16":
        layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        layer.weight = nn.Parameter(weight, requires_grad=False)
        return layer
    if quant == "int8wo":
        return Int8WeightOnlyLinear(weight)
    if quant == "int4":
        return Int4TinygemmLinear(weight)
    raise StockModelError(f"quant {quant!r} is not one of {', '.join(QUANT_MODES)}")


# --- the model -------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(weight, requires_grad=False), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [batch, heads, tokens, head_dim]; cos, sin: [tokens, head_dim] (rotate-half layout)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Layer(nn.Module):
    def __init__(self, shape: LlamaShape, w: dict[str, torch.Tensor], quant: str, max_seq_len: int,
                 batch_size: int = 1) -> None:
        super().__init__()
        self.shape = shape
        self.input_norm = RMSNorm(w["input_layernorm.weight"], shape.rms_norm_eps)
        self.post_norm = RMSNorm(w["post_attention_layernorm.weight"], shape.rms_norm_eps)
        qkv = torch.cat([w[f"self_attn.{p}_proj.weight"] for p in "qkv"])
        self.qkv = make_linear(qkv, quant)
        self.o = make_linear(w["self_attn.o_proj.weight"], quant)
        self.gate_up = make_linear(torch.cat((w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"])), quant)
        self.down = make_linear(w["mlp.down_proj.weight"], quant)
        dtype, device = w["input_layernorm.weight"].dtype, w["input_layernorm.weight"].device
        cache = (batch_size, shape.num_kv_heads, max_seq_len, shape.head_dim)
        self.register_buffer("k_cache", torch.zeros(cache, dtype=dtype, device=device))
        self.register_buffer("v_cache", torch.zeros(cache, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        # x: [batch, tokens, hidden] (batch = the cache's rows); pos: [tokens], the same for every row;
        # mask: [tokens, max_seq_len] bool
        s, (b, n) = self.shape, x.shape[:2]
        q, k, v = self.qkv(self.input_norm(x)).split(
            [s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_kv_heads * s.head_dim], dim=-1)
        q = apply_rope(q.view(b, n, s.num_heads, s.head_dim).transpose(1, 2), cos, sin)
        k = apply_rope(k.view(b, n, s.num_kv_heads, s.head_dim).transpose(1, 2), cos, sin)
        self.k_cache.index_copy_(2, pos, k)  # k_cache: [batch, kv_heads, max_seq_len, head_dim]
        self.v_cache.index_copy_(2, pos, v.view(b, n, s.num_kv_heads, s.head_dim).transpose(1, 2))
        attn = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask[None, None],
                                              enable_gqa=True)
        x = x + self.o(attn.transpose(1, 2).reshape(b, n, s.num_heads * s.head_dim))
        gate, up = self.gate_up(self.post_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class StockLlama(nn.Module):
    """A Llama over a static KV cache of ``batch_size`` rows of ``max_seq_len`` positions; every forward runs
    all the rows, at the same positions."""

    def __init__(self, shape: LlamaShape, weights: dict[str, torch.Tensor], quant: str, max_seq_len: int,
                 batch_size: int = 1) -> None:
        super().__init__()
        self.shape, self.max_seq_len, self.batch_size = shape, max_seq_len, batch_size
        self.embed = nn.Parameter(weights["model.embed_tokens.weight"], requires_grad=False)
        self.layers = nn.ModuleList(
            Layer(shape, {k.removeprefix(f"model.layers.{i}."): v for k, v in weights.items()
                          if k.startswith(f"model.layers.{i}.")}, quant, max_seq_len, batch_size)
            for i in range(shape.num_layers))
        self.norm = RMSNorm(weights["model.norm.weight"], shape.rms_norm_eps)
        head = weights["model.embed_tokens.weight"] if shape.tie_word_embeddings else weights["lm_head.weight"]
        self.lm_head = nn.Parameter(head, requires_grad=False)  # kept in the model dtype, as in our artifacts
        device = self.embed.device
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), rope_inv_freq(shape))
        angles = torch.cat((angles, angles), dim=-1).to(device)
        self.register_buffer("cos", angles.cos().to(self.embed.dtype))
        self.register_buffer("sin", angles.sin().to(self.embed.dtype))
        self.register_buffer("causal", torch.ones(max_seq_len, max_seq_len, dtype=torch.bool, device=device).tril())

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """ids: [batch, tokens], pos: [tokens] -> logits of each row's last token [batch, vocab] (fp32)."""
        x = F.embedding(ids, self.embed)
        cos, sin, mask = self.cos[pos], self.sin[pos], self.causal[pos]
        for layer in self.layers:
            x = layer(x, pos, cos, sin, mask)
        return F.linear(self.norm(x[:, -1]), self.lm_head).float()


def read_weights(checkpoint: Path, dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files (never pickles), cast to ``dtype`` on ``device``."""
    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise StockModelError(f"{checkpoint}: no *.safetensors weight files")
    weights = {}
    for file in files:
        with safe_open(file, framework="pt", device=device) as f:
            for name in f.keys():
                weights[name] = f.get_tensor(name).to(dtype)
    return weights


def load_stock_model(checkpoint: str | Path, quant: str = "bf16", device: str = "cuda",
                     max_seq_len: int = 512, dtype: torch.dtype = torch.bfloat16, batch_size: int = 1) -> StockLlama:
    checkpoint = Path(checkpoint)
    shape = LlamaShape.from_config(json.loads((checkpoint / "config.json").read_text()))
    with torch.device(device):
        return StockLlama(shape, read_weights(checkpoint, dtype, device), quant, max_seq_len, batch_size).eval()


# --- the benchmark ---------------------------------------------------------------------------------
def _greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1, keepdim=True)  # [batch, 1]


def generate(model: StockLlama, prefill, decode, prompt: torch.Tensor, num_new: int, *,
             time_steps: bool = False) -> tuple[list[float], torch.Tensor]:
    """Greedy tokens after ``prompt`` [batch, n] (the model's batch_size rows); returns wall times and the
    tokens [batch, num_new]. The times are taken after the first token and after the last; with
    ``time_steps``, after the first token and after every decode step, each step synchronized."""
    n = prompt.shape[1]
    times, tokens = [], []
    token = _greedy(prefill(prompt, torch.arange(n, device=prompt.device)))
    torch.cuda.synchronize() if prompt.is_cuda else None
    times.append(time.perf_counter())
    tokens.append(token)
    for i in range(num_new - 1):
        pos = torch.tensor([n + i], device=prompt.device)
        token = _greedy(decode(token.clone(), pos))  # clone: a CUDA-graph output is overwritten next replay
        tokens.append(token)
        if time_steps:
            torch.cuda.synchronize() if prompt.is_cuda else None
            times.append(time.perf_counter())
    if not time_steps:
        torch.cuda.synchronize() if prompt.is_cuda else None
        times.append(time.perf_counter())
    return times, torch.cat(tokens, dim=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--quant", choices=QUANT_MODES, default="bf16")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=1, help="prompts decoded together (1: TTFT and tok/s; "
                        "N > 1: the decode step time)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--no-compile", action="store_true", help="eager (checking on the CPU)")
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error(f"--batch-size {args.batch_size}: a batch is 1 or more prompts")
    if args.batch_size > 1 and args.output_len < 3:
        parser.error(f"--output-len {args.output_len}: a decode step figure needs at least 3 tokens (the first "
                     f"decode step is left out)")

    model = load_stock_model(args.checkpoint, args.quant, args.device, args.input_len + args.output_len,
                             batch_size=args.batch_size)
    prefill = decode = model
    if not args.no_compile:
        import torch._inductor.config as inductor_config

        for name, value in INDUCTOR_SETTINGS.items():
            setattr(inductor_config, name, value)
        prefill = torch.compile(model, dynamic=False)
        decode = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, model.shape.vocab_size, (args.batch_size, args.input_len), generator=g).to(args.device)
    with torch.inference_mode():
        for _ in range(2):  # warm up: compiles, captures the CUDA graphs
            generate(model, prefill, decode, prompt, args.output_len)
        if args.batch_size > 1:
            print(json.dumps(_decode_step_figures(args, model, prefill, decode, prompt)))
            return 0
        ttfts, rates = [], []
        for _ in range(args.repeats):
            if prompt.is_cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            (t_first, t_end), _ = generate(model, prefill, decode, prompt, args.output_len)
            ttfts.append((t_first - t0) * 1e3)
            rates.append((args.output_len - 1) / (t_end - t_first))
    print(json.dumps({"baseline": f"stock-torch-{args.quant}", "input_len": args.input_len,
                      "output_len": args.output_len, "ttft_ms": round(statistics.median(ttfts), 2),
                      "decode_tok_s": round(statistics.median(rates), 2), "torch": torch.__version__,
                      "compiled": not args.no_compile}))
    return 0


def _decode_step_figures(args: argparse.Namespace, model: StockLlama, prefill, decode, prompt: torch.Tensor) -> dict:
    """The median decode step over ``args.repeats`` runs at batch ``args.batch_size``, the first step of each
    left out (as the runtime's figure leaves it out)."""
    seconds = []
    for _ in range(args.repeats):
        times, _ = generate(model, prefill, decode, prompt, args.output_len, time_steps=True)
        seconds += [end - start for start, end in zip(times[1:-1], times[2:])]  # decode step 2 onwards
    step = statistics.median(seconds)
    return {"baseline": f"stock-torch-{args.quant}", "batch_size": args.batch_size, "input_len": args.input_len,
            "output_len": args.output_len, "decode_step_ms": round(step * 1e3, 3),
            "decode_tok_s": round(args.batch_size / step, 2), "torch": torch.__version__,
            "compiled": not args.no_compile}


if __name__ == "__main__":
    raise SystemExit(main())


def run_stock_baseline(checkpoint: str | Path, quant: str, input_len: int, output_len: int,
                       device: str = "cuda", repeats: int = 3, timeout_s: float = 1800, batch_size: int = 1) -> dict:
    """Run the baseline in a fresh process (its own compile caches and memory) and return its JSON line."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "builder.bench.stock_torch", str(checkpoint), "--quant", quant, "--input-len",
           str(input_len), "--output-len", str(output_len), "--repeats", str(repeats), "--device", device]
    if batch_size != 1:
        cmd += ["--batch-size", str(batch_size)]
    if not str(device).startswith("cuda"):
        cmd.append("--no-compile")  # the CPU check runs eagerly
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    lines = [line for line in res.stdout.splitlines() if line.startswith("{")]
    if res.returncode != 0 or not lines:
        tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise StockModelError(f"the stock-PyTorch baseline failed (exit {res.returncode}): {tail}")
    return json.loads(lines[-1])
