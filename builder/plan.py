"""`builder plan`: will the artifact fit its GPU? The runtime's start-up memory plan, made before the build.

From the model's ``config.json`` alone (no weights are read, so a 70B config plans in milliseconds) and
the recipe's precision, KV dtype, tp_size and serving limits:

    budget = gpu_memory x gpu_memory_utilization                       (per GPU = per tensor-parallel rank)
    |<- weights per rank ->|<- workspace (estimate) ->|<- CUDA context ->|<- KV pool: num_blocks blocks ->|
                                                                            block = tokens_per_block tokens
                                                                            x all layers x (K + V), this rank

What is exact and what is not:
- weights per rank: every tensor as the passes store it (``passes/README.md``): model-dtype weights,
  W4A16 codes packed two per byte with fp32 scales and uint8 zeros per (row, group), W8A16 / W8A8 /
  FP8 codes of one byte with fp32 scales, biases and norms in the model dtype, the fp32 RoPE table,
  fp32 per-layer KV scales. At tp_size 1 this is the artifact's tensor bytes exactly (tested). Under
  tensor parallelism the split assumed is Megatron's: q/k/v/gate/up split by output rows, o/down by
  input columns, KV heads replicated when tp_size > num_key_value_heads, norms replicated, embedding and
  lm_head replicated unless ``vocab_parallel``. A quantized lm_head (``quantization.lm_head``) is counted
  as a linear [vocab rows, hidden] of its section's scheme; a tied one then no longer shares the
  embedding table, which stays in the model dtype beside it.
- KV bytes per token: exact, 2 x layers x KV heads per rank x head_dim x element size (fp8/int8 KV: 1 B;
  their per-layer scales are two fp32 numbers a layer, counted with the weights).
- workspace: an ESTIMATE, the runtime's CPU formula (``runtime/memory.py`` estimate_workspace_bytes):
  4 x max_num_tokens x widest linear output x element size + 4 x max_batch_size x vocab x 4 B (fp32
  logits). On CUDA the runtime measures a profiling step instead.
- CUDA context: a fixed allowance (CUDA_CONTEXT_BYTES); the runtime measures what is held outside its
  allocator (context, cuBLAS/NCCL workspaces, other processes).

A plan fits when the pool holds at least one request of max_seq_len tokens.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from builder.recipe import QuantizationSection, Recipe, validate_recipe

log = logging.getLogger("builder.plan")

GiB = 1 << 30
MiB = 1 << 20
DEFAULT_GPU_MEMORY = "80GiB"
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
CUDA_CONTEXT_BYTES = 500 * MiB  # allowance for the CUDA context and library workspaces, outside the allocator
TYPICAL_SEQ_LENS = (512, 2048, 8192)  # concurrency is also shown at these lengths (capped by max_seq_len)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
KV_QUANT_BYTES = {"fp8": 1, "int8": 1}
# The W-scheme each method stores (llm-compressor / compressed-tensors names); gptq bits 8 -> W8A16.
SCHEME_NAMES = {"awq": "W4A16", "gptq": "W4A16", "int8_wo": "W8A16", "smoothquant": "W8A8 INT8", "fp8": "FP8"}


class PlanError(ValueError):
    """A plan that cannot be made: no readable config.json, an unsupported model, a tp_size that does
    not divide the model, a malformed memory size. The message says what to change."""


# --- inputs ------------------------------------------------------------------------------------
def parse_memory(text: str) -> int:
    """Bytes in ``80GiB``, ``80GB`` (powers of 1000), ``81920MiB`` or a plain byte count."""
    from runtime.memory import parse_bytes

    try:
        return parse_bytes(str(text))
    except ValueError as e:
        raise PlanError(str(e)) from None


# Families whose biases and q/k norms the planner knows from model_type alone. Any other family is planned as a
# Llama-style decoder from config.json's standard keys (the KV cache per token from its heads, the weights an
# estimate); the plan says so. Whether a family builds at all is the lifter's call, not this list's.
EXACT_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


# the planner builds an object per layer: a config beyond any model's is refused rather than planned for hours
_MAX_DIMENSION = {"num_hidden_layers": 10_000}


@dataclass(frozen=True)
class MoeShape:
    """A mixture-of-experts decoder's experts, from config.json's usual keys (Mixtral, Qwen-MoE, OLMoE)."""

    num_experts: int  # num_local_experts or num_experts
    top_k: int  # num_experts_per_tok
    expert_intermediate_size: int  # moe_intermediate_size, else intermediate_size (Mixtral, OLMoE)
    shared_intermediate_size: int  # shared_expert_intermediate_size (Qwen2-MoE's gated shared expert); 0: none
    sparse_layers: tuple[int, ...]  # layers with experts; the others (mlp_only_layers, decoder_sparse_step) are dense

    @classmethod
    def from_config(cls, config: dict[str, Any], num_layers: int) -> Optional[MoeShape]:
        num_experts = config.get("num_local_experts") or config.get("num_experts")
        if not isinstance(num_experts, int) or num_experts < 1:
            return None
        step, dense = config.get("decoder_sparse_step") or 1, set(config.get("mlp_only_layers") or [])
        return cls(num_experts, int(config.get("num_experts_per_tok") or 1),
                   int(config.get("moe_intermediate_size") or config.get("intermediate_size") or 0),
                   int(config.get("shared_expert_intermediate_size") or 0),
                   tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0))

    def expert_params(self, hidden: int, tp_size: int = 1) -> int:
        """One sparse layer's experts and router (the moe op's weights), on one of ``tp_size`` ranks (each holds its
        share of every expert's intermediate features; the router whole)."""
        return self.num_experts * (3 * hidden * self.expert_intermediate_size // tp_size + hidden)

    def shared_params(self, hidden: int) -> int:
        """One sparse layer's shared expert and its sigmoid gate (plain linears)."""
        return 3 * hidden * self.shared_intermediate_size + hidden if self.shared_intermediate_size else 0


@dataclass(frozen=True)
class ModelShape:
    """The decoder's shape, read from config.json (exact for EXACT_FAMILIES, a Llama-style estimate otherwise)."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # config's head_dim, else hidden_size / num_heads (Qwen3's default: 128)
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool  # lm_head shares the embedding table (stored once)
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm on q and k (Qwen3)
    max_position_embeddings: Optional[int] = None  # the build refuses a longer max_seq_len
    exact: bool = True  # False: a family outside EXACT_FAMILIES, weights counted as a Llama-style decoder's
    moe: Optional[MoeShape] = None  # a mixture of experts: its sparse layers' MLPs are experts (and a shared one)

    @classmethod
    def from_config(cls, config: dict[str, Any], source: str = "config.json") -> ModelShape:
        """The shape ``config`` (a checkpoint's config.json) describes; PlanError naming a missing or bad value."""
        model_type = config.get("model_type")
        if not isinstance(model_type, str) or not model_type:
            raise PlanError(f"{source}: model_type is {json.dumps(model_type)}; the planner needs the model's family")
        config = standard_keys(config)

        def need(key: str, default: int | None = None) -> int:
            value = config.get(key)
            value = default if value is None else value  # a 0 is a value (refused below), not a missing key
            bound = _MAX_DIMENSION.get(key, 1 << 31)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= bound:
                raise PlanError(f"{source}: {key} is {config.get(key)!r}; a positive integer is needed to plan"
                                + (f" (at most {_MAX_DIMENSION[key]:,})" if key in _MAX_DIMENSION else ""))
            return value

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        if heads % need("num_key_value_heads", heads):
            raise PlanError(f"{source}: num_key_value_heads {config.get('num_key_value_heads')} does not divide "
                            f"num_attention_heads {heads}: each key/value head serves a whole group of query heads")
        attention_bias = bool(config.get("attention_bias", False))
        return cls(
            model_type=model_type, num_layers=need("num_hidden_layers"), hidden_size=hidden, num_heads=heads,
            num_kv_heads=need("num_key_value_heads", heads),
            head_dim=need("head_dim", 128 if model_type == "qwen3" else hidden // heads),
            intermediate_size=need("intermediate_size"), vocab_size=need("vocab_size"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias and model_type in ("llama", "qwen3"),
            mlp_bias=bool(config.get("mlp_bias", False)) and model_type == "llama",
            qk_norm=model_type == "qwen3", max_position_embeddings=config.get("max_position_embeddings"),
            exact=model_type in EXACT_FAMILIES, moe=MoeShape.from_config(config, need("num_hidden_layers")))

    def num_parameters(self) -> int:
        """Elements of the unquantized, unsharded model (a tied table counted once)."""
        h, hd, i = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        per_layer = (h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
                     + (q + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0)
                     + (2 * i + h if self.mlp_bias else 0) + (2 * hd if self.qk_norm else 0))
        tables = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        total = self.num_layers * per_layer + tables + h
        if self.moe is not None:  # a sparse layer has experts (and maybe a shared expert) instead of its dense MLP
            dense_mlp = 3 * h * i + (2 * i + h if self.mlp_bias else 0)
            total += len(self.moe.sparse_layers) * (self.moe.expert_params(h) + self.moe.shared_params(h) - dense_mlp)
        return total

    def num_active_parameters(self) -> int:
        """Parameters one token computes with: all but the experts it is not routed to (top_k of num_experts)."""
        if self.moe is None:
            return self.num_parameters()
        m = self.moe
        idle = (m.num_experts - m.top_k) * 3 * self.hidden_size * m.expert_intermediate_size
        return self.num_parameters() - len(m.sparse_layers) * idle


STANDARD_KEYS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "max_position_embeddings",
                 "num_key_value_heads", "intermediate_size", "vocab_size")
MLP_SIZE_KEYS = ("n_inner", "ffn_hidden_size")  # the MLP's size under other names (GPT-2, Falcon)


def standard_keys(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with the standard keys the planner reads filled in from the family's own names: those its
    transformers config class maps onto them (``attribute_map``: GPT-2's n_embd, n_head, n_layer, n_positions), and
    the MLP size under another name (GPT-2's n_inner, whose null means 4 x hidden; Falcon's ffn_hidden_size).
    transformers is consulted only when a standard key is missing."""
    if all(config.get(k) is not None for k in STANDARD_KEYS):
        return config
    from transformers import CONFIG_MAPPING

    config = dict(config)
    config_class = CONFIG_MAPPING[config["model_type"]] if config["model_type"] in CONFIG_MAPPING else None
    for standard, own in (getattr(config_class, "attribute_map", None) or {}).items():
        if config.get(standard) is None and config.get(own) is not None:
            config[standard] = config[own]
    if config.get("intermediate_size") is None:
        size = next((config[k] for k in MLP_SIZE_KEYS if config.get(k) is not None), None)
        if size is None and "n_inner" in config and isinstance(config.get("hidden_size"), int):
            size = 4 * config["hidden_size"]  # GPT-2's n_inner: null means 4 x hidden
        if size is not None:
            config["intermediate_size"] = size
    return config


def read_model_shape(checkpoint: str | Path) -> ModelShape:
    """The shape in ``checkpoint/config.json``; nothing else in the directory is read."""
    path = Path(checkpoint)
    if not path.is_dir():
        raise PlanError(f"checkpoint {str(path)!r} is not a directory; give a local Hugging Face checkpoint "
                        f"(only its config.json is read)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise PlanError(f"{path}: no config.json; the planner reads the model's shape from it")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"{config_file}: cannot read it as JSON ({e})") from None
    if not isinstance(config, dict):
        raise PlanError(f"{config_file}: expected a JSON object, got {type(config).__name__}")
    return ModelShape.from_config(config, str(config_file))


# --- the graph's linears, per rank --------------------------------------------------------------
@dataclass(frozen=True)
class LinearNode:
    """One linear of the built graph on one rank (a merged q/k/v or gate/up node holds its members)."""

    source: str  # module path (a merged node: the parent module), as the quantization passes match it
    members: tuple[str, ...]  # module paths of the checkpoint linears it holds
    in_features: int  # per rank
    out_features: tuple[int, ...]  # per member, per rank
    bias: bool

    def match_names(self) -> list[str]:
        """What ``targets`` / ``ignore`` patterns are matched against (passes/quantize.py member_names)."""
        return [self.source, *self.members] if len(self.members) > 1 else [self.source]


def _tp_problem(shape: ModelShape, tp_size: int, vocab_parallel: bool) -> Optional[str]:
    """Why ``tp_size`` cannot split this model (the shard pass's rules, passes/shard.py), or None."""
    heads, kv = shape.num_heads, shape.num_kv_heads
    if shape.moe is not None and shape.moe.expert_intermediate_size % tp_size:
        return (f"tp_size {tp_size} does not divide the experts' intermediate size "
                f"{shape.moe.expert_intermediate_size}")
    if heads % tp_size:
        return f"tp_size {tp_size} does not divide num_attention_heads {heads}"
    if tp_size <= kv and kv % tp_size:
        return f"tp_size {tp_size} does not divide num_key_value_heads {kv}"
    if tp_size > kv and tp_size % kv:
        return f"tp_size {tp_size} is above num_key_value_heads {kv} but not a multiple of it"
    if shape.intermediate_size % tp_size:
        return f"tp_size {tp_size} does not divide intermediate_size {shape.intermediate_size}"
    if vocab_parallel and shape.vocab_size % tp_size:
        return f"tp_size {tp_size} does not divide vocab_size {shape.vocab_size} (vocab_parallel)"
    return None


def shard_heads(shape: ModelShape, tp_size: int, vocab_parallel: bool = False) -> tuple[int, int]:
    """(attention heads, KV heads) per rank; KV heads are replicated when tp_size > num_kv_heads."""
    if tp_size < 1:
        raise PlanError(f"tp_size {tp_size} must be >= 1")
    why = _tp_problem(shape, tp_size, vocab_parallel)
    if why is not None:
        ok = [t for t in range(1, shape.num_heads + 1) if _tp_problem(shape, t, vocab_parallel) is None]
        raise PlanError(f"{why}; pick tp_size {', '.join(map(str, ok))}")
    return shape.num_heads // tp_size, max(1, shape.num_kv_heads // tp_size)


def linear_nodes(shape: ModelShape, tp_size: int, passes: list[str]) -> list[LinearNode]:
    """The decoder's linears on one rank, merged as the recipe's merge_qkv / merge_gate_up passes merge
    them. Column-parallel (q, k, v, gate, up) split output rows; row-parallel (o, down) input columns."""
    heads, kv_heads = shard_heads(shape, tp_size)
    h, hd, inter = shape.hidden_size, shape.head_dim, shape.intermediate_size // tp_size

    def column(parent: str, members: list[tuple[str, int]], merged: bool, bias: bool) -> list[LinearNode]:
        names = tuple(f"{parent}.{leaf}" for leaf, _ in members)
        if merged:
            return [LinearNode(parent, names, h, tuple(out for _, out in members), bias)]
        return [LinearNode(name, (name,), h, (out,), bias) for name, (_, out) in zip(names, members)]

    def row(name: str, in_features: int, bias: bool) -> LinearNode:
        return LinearNode(name, (name,), in_features, (h,), bias)

    nodes: list[LinearNode] = []
    for layer in range(shape.num_layers):
        attn, mlp = f"model.layers.{layer}.self_attn", f"model.layers.{layer}.mlp"
        nodes += column(attn, [("q_proj", heads * hd), ("k_proj", kv_heads * hd), ("v_proj", kv_heads * hd)],
                        "merge_qkv" in passes, shape.qkv_bias)
        nodes.append(row(f"{attn}.o_proj", heads * hd, shape.o_bias))
        moe = shape.moe
        if moe is not None and layer in moe.sparse_layers:  # experts are no linears; a shared expert's are
            if moe.shared_intermediate_size:
                shared, inter_s = f"{mlp}.shared_expert", moe.shared_intermediate_size
                nodes += column(shared, [("gate_proj", inter_s), ("up_proj", inter_s)], "merge_gate_up" in passes,
                                False)
                nodes += [row(f"{shared}.down_proj", inter_s, False),
                          LinearNode(f"{mlp}.shared_expert_gate", (f"{mlp}.shared_expert_gate",), h, (1,), False)]
            continue
        nodes += column(mlp, [("gate_proj", inter), ("up_proj", inter)], "merge_gate_up" in passes, shape.mlp_bias)
        nodes.append(row(f"{mlp}.down_proj", inter, shape.mlp_bias))
    return nodes


def assign_methods(nodes: list[LinearNode], sections: list[QuantizationSection]) -> list[Optional[QuantizationSection]]:
    """The quantization section each node gets: the first (in recipe order) whose targets select it and
    whose ignore list does not; a node taken by an earlier section is not selected by a later one."""
    from passes.quantize import _matches  # the quantization passes' own matcher, so selection agrees

    chosen: list[Optional[QuantizationSection]] = [None] * len(nodes)
    for section in sections:
        for k, node in enumerate(nodes):
            names = node.match_names()
            if chosen[k] is not None or (section.targets and not _matches(section.targets, names)):
                continue
            if not _matches(section.ignore, names):
                chosen[k] = section
    return chosen


def _expert_section(q: QuantizationSection) -> Optional[str]:
    """The experts' scheme a section writes: fp8, w4a16 (awq; gptq with bits 4), or None (its method leaves them)."""
    if q.algo == "fp8":
        return "fp8"
    if q.algo == "awq" or (q.algo == "gptq" and (q.bits or 4) == 4):
        return "w4a16"
    return None


def expert_layers(shape: ModelShape, sections: list[QuantizationSection],
                  methods: list[Optional[QuantizationSection]]) -> dict[int, QuantizationSection]:
    """The sparse layers whose experts a section quantizes, with that section (the first that reaches the layer): a
    section of a method that quantizes experts (fp8, awq, gptq with bits 4) whose targets / ignore reach the layer's
    ``model.layers.N.mlp``, with ``experts`` true, or unset and taking a linear (``methods``: each linear node's
    section) or naming the layer in its targets (an lm_head-only section quantizes experts only when asked). Other
    methods leave experts in the model dtype."""
    from passes.quantize import _matches

    if shape.moe is None:
        return {}
    takes = {id(m) for m in methods if m is not None}
    out: dict[int, QuantizationSection] = {}
    for layer in shape.moe.sparse_layers:
        name = f"model.layers.{layer}.mlp"
        q = next((q for q in sections if _expert_section(q) and (not q.targets or _matches(q.targets, [name]))
                  and not _matches(q.ignore, [name])
                  and (q.experts or (q.experts is None and (id(q) in takes or bool(q.targets))))), None)
        if q is not None:
            out[layer] = q
    return out


def fp8_expert_layers(shape: ModelShape, sections: list[QuantizationSection],
                      methods: list[Optional[QuantizationSection]]) -> list[int]:
    """The sparse layers whose experts a section quantizes to fp8 (:func:`expert_layers`)."""
    return [layer for layer, q in expert_layers(shape, sections, methods).items() if _expert_section(q) == "fp8"]


def experts_bytes(shape: ModelShape, sections: list[QuantizationSection],
                  methods: list[Optional[QuantizationSection]], itemsize: int, tp_size: int = 1,
                  fp8_blocks: Optional[tuple[int, int]] = None) -> int:
    """Bytes of the sparse layers' experts and routers (the moe ops' weights) on one of ``tp_size`` ranks: fp8
    experts as e4m3 codes [E, 3 * intermediate, hidden] + fp32 scales [E, 2 * intermediate + hidden], or, imported
    from a fine-grained FP8 checkpoint (``fp8_blocks`` [bn, bk]), one fp32 scale per bn x bk block of each
    projection ([E, 2 * ceil(intermediate / bn), ceil(hidden / bk)] and [E, ceil(hidden / bn), ceil(intermediate /
    bk)]); w4a16 experts (awq, gptq 4-bit) as packed codes [E, 3 * intermediate, hidden / 2] + fp32 scales and uint8
    zeros per group ([E, 2 * intermediate, hidden / G] and [E, hidden, intermediate / G]); the others and every router
    in the model dtype (:func:`expert_layers`); each rank holds 1 / tp_size of every expert's intermediate features
    (the down projection's per-channel fp8 scales and the router whole)."""
    m = shape.moe
    if m is None:
        return 0
    h, inter = shape.hidden_size, m.expert_intermediate_size // tp_size
    total = 0
    chosen = expert_layers(shape, sections, methods)
    for layer in m.sparse_layers:
        q = chosen.get(layer)
        scheme = _expert_section(q) if q is not None else None
        if scheme == "fp8" and fp8_blocks is not None:  # the moe op's fp8_block experts: the blocks as stored
            bn, bk = fp8_blocks
            blocks = 2 * -(-inter // bn) * -(-h // bk) + -(-h // bn) * -(-inter // bk)  # gate, up; down
            total += m.num_experts * (3 * h * inter + 4 * blocks + h * itemsize)
        elif scheme == "fp8":
            total += m.num_experts * (3 * h * inter + 4 * (2 * inter + h) + h * itemsize)
        elif scheme == "w4a16":
            g = q.group_size or 128
            groups = 2 * inter * (h // (h if g == -1 else g)) + h * (inter // (inter if g == -1 else g))
            total += m.num_experts * (3 * h * inter // 2 + 5 * groups + h * itemsize)
        else:
            total += m.expert_params(h, tp_size) * itemsize
    return total


def linear_bytes(node: LinearNode, section: Optional[QuantizationSection], itemsize: int, tp_size: int,
                 fp8_blocks: Optional[tuple[int, int]] = None) -> int:
    """Bytes of one linear node on one rank as the passes store it (passes/README.md, quant_math.py):

        none          weight [out, in] in the model dtype
        W4A16         codes uint8 [out, in/2] + scales fp32 + zeros uint8 [out, in/group_size]   (awq, gptq 4-bit)
        W8A16         codes uint8 [out, in]   + scales fp32 + zeros uint8 [out, in/group_size]   (gptq 8-bit;
                      int8_wo: one group per row)
        W8A8 INT8     codes int8 [out, in] + weight_scale fp32 [out] (+ input_scale fp32 [1] if static)
        FP8           codes e4m3 [out, in] + weight_scale fp32 [out] or [1] (+ input_scale fp32 [1] if static)
        FP8 blocks    codes e4m3 [out, in] + weight_scale fp32 [ceil(out/bn), ceil(in/bk)] per member (``fp8_blocks``
                      [bn, bk]: a fine-grained FP8 checkpoint's fp8_block, imported; merged members stack their rows)

    A bias stays in the model dtype. Per-tensor and input scales belong to the node, so a merged q/k/v
    node has one of each.
    """
    out_f, in_f = sum(node.out_features), node.in_features
    total = out_f * itemsize if node.bias else 0
    if section is None:
        return total + out_f * in_f * itemsize
    algo = section.algo
    if algo in ("awq", "gptq", "int8_wo"):
        bits = (section.bits or 4) if algo == "gptq" else (4 if algo == "awq" else 8)
        group_size = -1 if algo == "int8_wo" else (section.group_size or 128)
        if group_size != -1 and in_f % group_size:
            per_rank = f" per rank (tp_size {tp_size})" if tp_size > 1 else ""
            options = [g for g in (256, 128, 64, 32, 16) if in_f % g == 0]
            raise PlanError(f"{algo}: {node.source} has in_features {in_f}{per_rank}, not divisible by group_size "
                            f"{group_size}; use {', '.join(map(str, options)) or 'a divisor of it'} "
                            f"or -1 (per channel)")
        if bits == 4 and in_f % 2:
            raise PlanError(f"{algo}: {node.source} has an odd in_features {in_f}{' per rank' if tp_size > 1 else ''}"
                            f"; packed 4-bit codes hold two input columns per byte")
        num_groups = 1 if group_size == -1 else in_f // group_size
        codes = out_f * (in_f // 2 if bits == 4 else in_f)
        return total + codes + out_f * num_groups * (4 + 1)
    static = 4 if section.activations == "static" else 0
    if algo == "smoothquant":
        return total + out_f * in_f + out_f * 4 + static
    if algo == "fp8" and fp8_blocks is not None:
        bn, bk = fp8_blocks
        return total + out_f * in_f + 4 * sum(-(-out // bn) for out in node.out_features) * -(-in_f // bk)
    if algo == "fp8":
        return total + out_f * in_f + (out_f * 4 if section.weight_granularity == "channel" else 4) + static
    raise AssertionError(f"linear_bytes: unhandled quantization algo {algo!r}")


# --- the plan ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanSettings:
    """What the plan is made for: the recipe's precision and serving limits, and the target GPU."""

    dtype: str  # model dtype: float32 | bfloat16 | float16
    quantization: list[str]  # the recipe's methods in order, e.g. ["gptq", "int8_wo"]; empty = none
    kv_cache_dtype: str  # auto (the model dtype) | fp8 | int8
    tp_size: int
    vocab_parallel: bool  # embedding / lm_head rows split over the ranks (else replicated)
    max_seq_len: int
    max_batch_size: int
    max_num_tokens: int
    tokens_per_block: int
    gpu_memory_bytes: int  # per GPU
    gpu_memory_utilization: float
    cuda_context_bytes: int = CUDA_CONTEXT_BYTES


@dataclass(frozen=True)
class Concurrency:
    seq_len: int  # tokens per request (prompt + output)
    by_kv_pool: int  # requests of seq_len whose KV cache the pool holds at once
    max_concurrency: int  # by_kv_pool capped by max_batch_size


@dataclass(frozen=True)
class Plan:
    """Where one GPU's memory goes, per tensor-parallel rank; ``to_dict`` is the --json output."""

    source: str  # the recipe or checkpoint planned
    name: str
    model: ModelShape
    settings: PlanSettings
    num_parameters: int  # whole model, unquantized
    num_active_parameters: int  # what one token computes with (a mixture of experts: top_k experts); else all
    weights_bytes: int  # per rank, as stored (see weights_breakdown)
    weights_breakdown: dict[str, int]  # embedding, lm_head, linears, norms, rope, kv_scales: bytes per rank
    quantized_linears: dict[str, int]  # method -> how many linear nodes of the graph it quantizes (lm_head apart)
    kv_heads_per_rank: int
    kv_bytes_per_token: int  # per rank, all layers, K and V
    budget_bytes: int  # gpu_memory x gpu_memory_utilization
    workspace_bytes: int  # ESTIMATE (runtime/memory.py's CPU formula)
    workspace_formula: str
    kv_pool_bytes: int  # what is left for the KV cache (negative: the rest does not even fit)
    num_blocks: int
    concurrency: list[Concurrency]
    fits: bool
    verdict: str  # one sentence: fits with N requests, or what does not fit and what to change
    notes: list[str] = field(default_factory=list)
    lm_head_quantization: Optional[str] = None  # the method that quantizes the lm_head; None: model dtype

    @property
    def kv_pool_tokens(self) -> int:
        return self.num_blocks * self.settings.tokens_per_block

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["kv_pool_tokens"] = self.kv_pool_tokens
        out["workspace_is_estimate"] = True
        return out

    def summary(self) -> str:
        """One line for the build log."""
        s = self.settings
        return (f"memory plan ({s.gpu_memory_bytes / GiB:.1f} GiB x {s.gpu_memory_utilization:g}, tp_size "
                f"{s.tp_size}): weights {_size(self.weights_bytes)} + workspace ~{_size(self.workspace_bytes)} + "
                f"CUDA context {_size(s.cuda_context_bytes)} + KV pool {_size(max(self.kv_pool_bytes, 0))} "
                f"({self.kv_pool_tokens} tokens at {self.kv_bytes_per_token} B/token); {self.verdict}")


def _size(num_bytes: int) -> str:
    sign, n = ("-" if num_bytes < 0 else ""), abs(num_bytes)
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{sign}{n / scale:.2f} {unit}"
    return f"{sign}{n} B"


def _recipe_parallel(recipe: Recipe) -> tuple[int, bool]:
    """(tp_size, vocab_parallel) of the recipe's ``parallel`` section; (1, False) without one."""
    parallel = getattr(recipe, "parallel", None)
    return (int(getattr(parallel, "tp_size", None) or getattr(recipe, "tp_size", None) or 1),
            bool(getattr(parallel, "vocab_parallel", False)))


def make_plan(recipe: Recipe, *, tp_size: int | None = None, gpu_memory: str | int | None = None,
              gpu_memory_utilization: float | None = None, vocab_parallel: bool | None = None,
              source: str | None = None) -> Plan:
    """Plan ``recipe`` on one GPU of ``gpu_memory`` (default: the recipe's target, else 80GiB) at
    ``gpu_memory_utilization`` (default: the target's, else 0.9) per tensor-parallel rank; ``tp_size``
    and ``vocab_parallel`` default to the recipe's ``parallel`` section."""
    target = getattr(recipe, "target", None)
    memory = gpu_memory if gpu_memory is not None else (target.gpu_memory if target else DEFAULT_GPU_MEMORY)
    utilization = gpu_memory_utilization if gpu_memory_utilization is not None else (
        target.gpu_memory_utilization if target else DEFAULT_GPU_MEMORY_UTILIZATION)
    if not 0 < utilization <= 1:
        raise PlanError(f"gpu_memory_utilization {utilization} must lie in (0, 1]")
    rt = recipe.runtime
    recipe_tp_size, recipe_vocab_parallel = _recipe_parallel(recipe)
    sections, imported_note, fp8_blocks = recipe.quant_sections(), None, None
    if not sections:  # a pre-quantized checkpoint: its linears and experts as the import stores them
        sections, imported_note, fp8_blocks = prequantized_sections(recipe.model.checkpoint)
    settings = PlanSettings(
        dtype=recipe.model.dtype, quantization=[q.algo for q in sections],
        kv_cache_dtype=rt.kv_cache_dtype, tp_size=tp_size if tp_size is not None else recipe_tp_size,
        vocab_parallel=vocab_parallel if vocab_parallel is not None else recipe_vocab_parallel,
        max_seq_len=rt.max_seq_len, max_batch_size=rt.max_batch_size,
        max_num_tokens=rt.max_num_tokens, tokens_per_block=rt.tokens_per_block,
        gpu_memory_bytes=memory if isinstance(memory, int) else parse_memory(memory),
        gpu_memory_utilization=float(utilization))
    shape = read_model_shape(recipe.model.checkpoint)
    plan = plan_memory(shape, settings, sections, list(recipe.passes), source or recipe.model.checkpoint,
                       recipe.name or Path(recipe.model.checkpoint).name, fp8_blocks)
    if imported_note:
        plan.notes.append(imported_note)
    return plan


# the IR scheme a pre-quantized checkpoint's import writes -> the recipe method that writes it too
_IMPORTED_METHOD = {"w4a16": "gptq", "w8a16": "int8_wo", "fp8": "fp8", "fp8_block": "fp8", "w8a8_int8": "smoothquant"}


def prequantized_sections(checkpoint: str | Path) -> tuple[list[QuantizationSection], str | None,
                                                          tuple[int, int] | None]:
    """For a checkpoint another tool quantized (``builder/prequantized.py`` reads its config): one quantization section
    of the method that writes the scheme its import stores (GPTQ / AWQ / 4-bit compressed-tensors: W4A16 in the
    checkpoint's groups; FP8 ...), reaching every linear and expert as the import does, a note saying so, and a
    fine-grained FP8 checkpoint's [bn, bk] (its fp8_block weights hold one scale per block, not per channel; else None).
    ([], None, None) for a floating-point checkpoint (or a config.json :func:`read_model_shape` reports on)."""
    from builder.prequantized import PrequantizedError, read_quant_config

    cfg_file = Path(checkpoint) / "config.json"
    try:
        config = json.loads(cfg_file.read_text())
        fmt = read_quant_config(cfg_file, config) if isinstance(config, dict) else None
    except (OSError, json.JSONDecodeError):
        return [], None, None
    except PrequantizedError as e:
        raise PlanError(str(e)) from None
    if fmt is None or fmt.scheme not in _IMPORTED_METHOD:
        return [], None, None
    algo = _IMPORTED_METHOD[fmt.scheme]
    if algo == "gptq":
        section = QuantizationSection(algo=algo, bits=4, group_size=fmt.group_size)
    elif algo == "fp8":  # scales per channel (or block) as the format records them; compressed-tensors per group
        ct = getattr(fmt, "schemes", None)
        channel = (fmt.details.get("weight_granularity") in ("channel", "block")
                   or bool(ct and ct[0].weights.get("strategy") == "channel"))
        section = QuantizationSection(algo=algo, weight_granularity="channel" if channel else "tensor")
    else:
        section = QuantizationSection(algo=algo)
    blocks = tuple(fmt.details["weight_block_size"]) if fmt.scheme == "fp8_block" else None
    groups = (f" in groups of {fmt.group_size}" if algo == "gptq" and fmt.group_size != -1 else
              f" with a scale per {blocks[0]} x {blocks[1]} block" if blocks else "")
    note = (f"pre-quantized checkpoint ({fmt.source}): its linears and mixture-of-experts experts are planned as the "
            f"import stores them, {SCHEME_NAMES[algo]}{groups} ({fmt.scheme}); modules the checkpoint keeps in "
            f"floating point and other schemes of a mixed-precision config are not told apart")
    return [section], note, blocks


def plan_memory(shape: ModelShape, s: PlanSettings, sections: list[QuantizationSection], passes: list[str],
                source: str, name: str, fp8_blocks: Optional[tuple[int, int]] = None) -> Plan:
    """The plan itself: pure arithmetic on the shape and the settings (``fp8_blocks``: a fine-grained FP8
    checkpoint's [bn, bk], whose fp8 weights hold one scale per block)."""
    tp, itemsize = s.tp_size, DTYPE_BYTES[s.dtype]
    _, kv_heads = shard_heads(shape, tp, s.vocab_parallel)
    nodes = linear_nodes(shape, tp, passes)
    methods = assign_methods(nodes, sections)
    vocab_rows = shape.vocab_size // tp if s.vocab_parallel else shape.vocab_size
    table = vocab_rows * shape.hidden_size * itemsize
    per_layer_norms = 2 * shape.hidden_size + (2 * shape.head_dim if shape.qk_norm else 0)
    kv_quantized = s.kv_cache_dtype != "auto"
    head_section = next((q for q in sections if q.lm_head), None)
    if head_section is not None:  # its own quantized copy, tied or not
        head = LinearNode("lm_head", ("lm_head",), shape.hidden_size, (vocab_rows,), False)
        head_bytes = linear_bytes(head, head_section, itemsize, tp, fp8_blocks)
    else:
        head_bytes = 0 if shape.tie_word_embeddings else table  # a tied lm_head is the embedding table
    breakdown = {
        "embedding": table,
        "lm_head": head_bytes,
        "linears": sum(linear_bytes(n, m, itemsize, tp, fp8_blocks) for n, m in zip(nodes, methods)),
        "norms": (shape.num_layers * per_layer_norms + shape.hidden_size) * itemsize,
        "rope": shape.head_dim // 2 * 4,  # inv_freq, fp32, one table shared by the layers
        "kv_scales": shape.num_layers * 2 * 4 if kv_quantized else 0,  # k_scale, v_scale fp32 per layer
        "experts": experts_bytes(shape, sections, methods, itemsize, tp, fp8_blocks),
    }
    weights = sum(breakdown.values())
    quantized: dict[str, int] = {}
    for m in methods:
        if m is not None:
            quantized[m.algo] = quantized.get(m.algo, 0) + 1

    kv_itemsize = KV_QUANT_BYTES[s.kv_cache_dtype] if kv_quantized else itemsize
    kv_per_token = 2 * shape.num_layers * kv_heads * shape.head_dim * kv_itemsize
    widest = max([sum(n.out_features) for n in nodes]
                 + ([2 * shape.moe.expert_intermediate_size] if shape.moe is not None else []))
    workspace = 4 * s.max_num_tokens * widest * itemsize + 4 * s.max_batch_size * shape.vocab_size  # fp32 logits
    formula = (f"4 x max_num_tokens {s.max_num_tokens} x widest linear {widest} x {itemsize} B + "
               f"max_batch_size {s.max_batch_size} x vocab {shape.vocab_size} x 4 B logits")
    budget = int(s.gpu_memory_bytes * s.gpu_memory_utilization)
    pool = budget - weights - workspace - s.cuda_context_bytes
    bytes_per_block = kv_per_token * s.tokens_per_block
    num_blocks = max(0, pool // bytes_per_block)

    def blocks_for(seq_len: int) -> int:
        return -(-seq_len // s.tokens_per_block)

    lengths = sorted({min(n, s.max_seq_len) for n in TYPICAL_SEQ_LENS} | {s.max_seq_len})
    concurrency = [Concurrency(n, num_blocks // blocks_for(n), min(num_blocks // blocks_for(n), s.max_batch_size))
                   for n in lengths]
    need = blocks_for(s.max_seq_len) * bytes_per_block
    fits = pool >= need
    if weights > budget:
        verdict = (f"does not fit: the weights alone ({_size(weights)} per rank) exceed the budget "
                   f"({_size(budget)}); quantize (fp8, int8_wo, awq, gptq) or raise tp_size")
    elif not fits:
        verdict = (f"does not fit: the KV pool gets {_size(max(pool, 0))} but one request of max_seq_len "
                   f"{s.max_seq_len} needs {_size(need)}; lower max_seq_len or max_num_tokens, use an fp8 KV "
                   f"cache, quantize, raise tp_size or gpu_memory_utilization")
    else:
        at_max = concurrency[-1]
        verdict = (f"fits: {at_max.by_kv_pool} requests of max_seq_len {s.max_seq_len} at once by KV pool "
                   f"({at_max.max_concurrency} with max_batch_size {s.max_batch_size})")
    notes = [
        "workspace is an estimate (the runtime's CPU formula); on CUDA the runtime measures a profiling step",
        f"CUDA context is a fixed allowance of {_size(s.cuda_context_bytes)}; the runtime measures memory held "
        "outside its allocator",
    ]
    if not shape.exact:
        notes.append(f"model_type {shape.model_type!r} is planned as a Llama-style decoder (q/k/v/o and gate/up/down "
                     f"linears, two norms a layer) from config.json's standard keys: the KV cache per token follows "
                     f"from its heads, the weights are an estimate (extra norms and biases are not counted; experts "
                     f"are, from config.json's usual keys)")
    if shape.moe is not None:
        m, chosen = shape.moe, expert_layers(shape, sections, methods)
        fp8_layers = sum(_expert_section(q) == "fp8" for q in chosen.values())
        int4_layers = len(chosen) - fp8_layers
        scales = f"a scale per {fp8_blocks[0]} x {fp8_blocks[1]} block" if fp8_blocks else "per-channel scales"
        parts = ([f"{fp8_layers} of them in fp8 (e4m3, {scales})"] if fp8_layers else []) + (
            [f"{int4_layers} in w4a16 (4-bit codes in groups, scales and zero points per group)"]
            if int4_layers else [])
        notes.append(f"mixture of experts: {shape.num_parameters() / 1e9:.2f} B parameters, "
                     f"{shape.num_active_parameters() / 1e9:.2f} B active per token (top {m.top_k} of {m.num_experts} "
                     f"experts in {len(m.sparse_layers)} of {shape.num_layers} layers); "
                     + (f"the experts of {' and '.join(parts)}, the rest and the routers in {s.dtype}" if chosen
                        else f"the experts stay in {s.dtype}"))
    if shape.max_position_embeddings and s.max_seq_len > shape.max_position_embeddings:
        notes.append(f"max_seq_len {s.max_seq_len} exceeds the model's max_position_embeddings "
                     f"{shape.max_position_embeddings}: `builder build` refuses this recipe")
    if head_section is not None and shape.tie_word_embeddings:
        notes.append(f"lm_head quantized ({head_section.algo}): untied from the embedding, which stays in {s.dtype}")
    if kv_quantized:
        notes.append(f"{s.kv_cache_dtype} KV cache: 1 B per element; its per-layer scales "
                     f"({breakdown['kv_scales']} B) are negligible and counted with the weights")
    if tp > 1:
        notes.append("tensor parallel: Megatron split assumed (q/k/v/gate/up by rows, o/down by columns), "
                     + ("KV heads replicated, " if shape.num_kv_heads < tp else "")
                     + ("embedding/lm_head split by vocab" if s.vocab_parallel else "embedding/lm_head replicated")
                     + "; NCCL buffers are not counted")
    return Plan(source=source, name=name, model=shape, settings=s, num_parameters=shape.num_parameters(),
                num_active_parameters=shape.num_active_parameters(),
                weights_bytes=weights, weights_breakdown=breakdown, quantized_linears=quantized,
                kv_heads_per_rank=kv_heads, kv_bytes_per_token=kv_per_token, budget_bytes=budget,
                workspace_bytes=workspace, workspace_formula=formula, kv_pool_bytes=pool, num_blocks=int(num_blocks),
                concurrency=concurrency, fits=fits, verdict=verdict, notes=notes,
                lm_head_quantization=head_section.algo if head_section is not None else None)


# --- entry points: checkpoint directories, the CLI, the build -------------------------------------
def recipe_for_checkpoint(checkpoint: str | Path, overrides: list[str] | None = None) -> Recipe:
    """The recipe a plan of a bare checkpoint directory stands for: the defaults (bfloat16, no
    quantization, the default passes and serving limits) plus ``key.path=value`` overrides, validated
    as any recipe is."""
    from builder.recipe import apply_override

    raw: dict[str, Any] = {"name": Path(checkpoint).name, "model": {"checkpoint": str(checkpoint)},
                           "output_dir": "(plan only)"}
    for item in overrides or []:
        apply_override(raw, item)
    return validate_recipe(raw, source=f"plan of {checkpoint}")


def load_plan_input(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """A recipe YAML, or a checkpoint directory planned with the recipe defaults (see recipe_for_checkpoint)."""
    from builder.recipe import load_recipe

    p = Path(path)
    if p.is_dir():
        return recipe_for_checkpoint(p, overrides)
    if not p.exists():
        raise PlanError(f"{str(p)!r} does not exist; give a recipe YAML or a checkpoint directory")
    return load_recipe(p, overrides)


def check_target(recipe: Recipe) -> Optional[str]:
    """Plan ``recipe`` against its ``target`` section and log the plan; returns why it cannot fit, or None.

    Without a ``target`` section nothing is planned: a build does not guess the device it is for.
    """
    target = getattr(recipe, "target", None)
    if target is None:
        return None
    try:
        plan = make_plan(recipe)
    except PlanError as e:
        return f"cannot plan the memory of {recipe.name} on its target: {e}"
    log.info("%s", plan.summary())
    if plan.fits:
        return None
    return (f"{recipe.name} does not fit its target (target.gpu_memory {target.gpu_memory} x "
            f"{target.gpu_memory_utilization:g}, tp_size {plan.settings.tp_size}): weights "
            f"{_size(plan.weights_bytes)}, workspace ~{_size(plan.workspace_bytes)}, budget "
            f"{_size(plan.budget_bytes)}; {plan.verdict}")


def render(plan: Plan, console=None) -> None:
    """The plan as rich tables."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    m, s = plan.model, plan.settings
    quant = " + ".join(f"{a} ({SCHEME_NAMES[a]})" for a in s.quantization) or "none"
    kv_dtype = s.dtype if s.kv_cache_dtype == "auto" else s.kv_cache_dtype
    head = Table(title=f"memory plan: {plan.name} ({plan.source})", title_justify="left")
    head.add_column("", style="bold")
    head.add_column("value", justify="right")
    head.add_column("how")
    active = f" ({plan.num_active_parameters / 1e9:.2f} B active)" if m.moe is not None else ""
    head.add_row("model", f"{plan.num_parameters / 1e9:.2f} B params{active}",
                 f"{m.model_type}: {m.num_layers} layers, hidden {m.hidden_size}, heads {m.num_heads}/"
                 f"{m.num_kv_heads} kv, head_dim {m.head_dim}, intermediate {m.intermediate_size}, vocab "
                 f"{m.vocab_size}{', tied' if m.tie_word_embeddings else ''}")
    lm_head = plan.lm_head_quantization or s.dtype
    head.add_row("precision", s.dtype, f"quantization {quant}; lm_head {lm_head}; KV cache {kv_dtype}")
    b = plan.weights_breakdown
    parts = ", ".join(f"{k} {_size(v)}" for k, v in b.items() if v)
    head.add_row("weights per rank", _size(plan.weights_bytes),
                 f"{plan.weights_bytes / 1e9:.2f} GB at tp_size {s.tp_size}: {parts}")
    head.add_row("KV cache per token", f"{plan.kv_bytes_per_token / 1024:.1f} KiB",
                 f"2 x {m.num_layers} layers x {plan.kv_heads_per_rank} kv heads/rank x {m.head_dim} x "
                 f"{KV_QUANT_BYTES.get(s.kv_cache_dtype, DTYPE_BYTES[s.dtype])} B")
    head.add_row("budget", _size(plan.budget_bytes),
                 f"gpu memory {_size(s.gpu_memory_bytes)} x utilization {s.gpu_memory_utilization:g}")
    head.add_row("- weights", _size(plan.weights_bytes), "")
    head.add_row("- workspace (estimate)", _size(plan.workspace_bytes), plan.workspace_formula)
    head.add_row("- CUDA context (allowance)", _size(s.cuda_context_bytes), "fixed; measured by the runtime")
    head.add_row("= KV pool", _size(plan.kv_pool_bytes),
                 f"{plan.num_blocks} blocks x {s.tokens_per_block} tokens = {plan.kv_pool_tokens} tokens")
    head.add_row("fits", "yes" if plan.fits else "NO", plan.verdict, style=None if plan.fits else "red")
    table = Table(title="concurrency", title_justify="left")
    table.add_column("tokens per request", justify="right")
    table.add_column("by KV pool", justify="right")
    table.add_column(f"max concurrency (<= max_batch_size {s.max_batch_size})", justify="right")
    for c in plan.concurrency:
        table.add_row(str(c.seq_len) + (" (max_seq_len)" if c.seq_len == s.max_seq_len else ""),
                      str(c.by_kv_pool), str(c.max_concurrency))
    console.print(head)
    console.print(table)
    for note in plan.notes:
        console.print(f"note: {note}", highlight=False)


def write_json(plan: Plan, destination: str) -> None:
    """``-`` prints the plan as JSON on stdout; anything else is a file path."""
    text = json.dumps(plan.to_dict(), indent=1)
    if destination == "-":
        print(text)
        return
    try:
        Path(destination).write_text(text + "\n")
    except OSError as e:
        raise PlanError(f"--json {destination}: cannot write it: {e}") from None
