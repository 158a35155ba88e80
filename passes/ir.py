"""The project's graph IR: a flat, typed list of coarse ops over per-token tensors.

Every value in the graph is a 2-D tensor ``[num_tokens, features]``: all sequences of a batch are
packed along the token axis, so an op never sees batch or padding structure. Ops that care about
heads (rope, attention, per-head norms) carry ``num_heads`` / ``head_dim`` attributes and view their
input as ``[num_tokens, num_heads, head_dim]`` themselves. Which tokens belong to which sequence,
their positions and their KV cache are the executor's business, passed beside the graph.

The graph is serialized to JSON (``graph.json`` in an artifact); weights are referenced by name and
stored separately (safetensors). See ``passes/README.md`` for the invariants passes must keep.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from runtime.manifest import MAX_SCALE_BLOCK  # one fp8_block scale's rows or columns, at most

IR_VERSION = 1


# Quantized linear weights: the `quant` attr's scheme says which roles a linear carries instead of `weight`.
QUANT_SCHEMES: dict[str, tuple[str, ...]] = {
    "none": ("weight",),
    "w4a16": ("qweight", "scales", "zeros"),  # 4-bit codes packed 2 per byte, per-group scale and zero
    "w8a16": ("qweight", "scales", "zeros"),  # 8-bit codes, per-group (or per-channel) scale and zero
    "w8a8_int8": ("qweight", "weight_scale"),  # int8 weight per channel; activations int8 (+ input_scale if static)
    "fp8": ("qweight", "weight_scale"),  # e4m3 weight per tensor/channel; activations e4m3 (+ input_scale if static)
    # e4m3 weight with one scale per block_size [bn, bk] block; activations e4m3 per token and bk-wide group (dynamic)
    "fp8_block": ("qweight", "weight_scale"),
}
# `perm` (optional, any scheme; int32 [in]): imported act-order checkpoints store W's input columns sorted by group,
# so groups are contiguous; the linear reads x[:, perm].
# `pre_quant_scale` (optional, any scheme but none; fp32 [in]): a per-input-channel scale s the checkpoint's exporter
# left on the linear instead of folding it into what came before (ModelOpt's AWQ keeps AWQ's s on o_proj and
# down_proj, whose inputs no norm writes; folding it into the rows of v_proj / up_proj would need their codes made
# again): the linear reads x * s, the product taken in fp32 and rounded to x's dtype, before a `perm` gather and any
# activation quantization. s is indexed by x's own channels.
QUANT_ROLES = ("qweight", "scales", "zeros", "weight_scale", "input_scale", "perm", "pre_quant_scale")
# `act_qmin` (optional quant attr, w8a8_int8 only): the lowest int8 activation code, -127 (absent: the SmoothQuant
# pass's symmetric range) or -128 (the full int8 range, as formats whose static activations clamp there store it:
# ModelOpt's W8A8_SQ_PER_CHANNEL, compressed-tensors' int8); codes are round-half-even(x / scale) clamped to
# act_qmin..127 on every path (kernels/torch_quant.py int8_act_qmin)
INT8_ACT_QMINS = (-127, -128)


@dataclass(frozen=True)
class OpSpec:
    """What an op consumes and produces; used to check a graph's structure."""

    num_inputs: tuple[int, int]  # (min, max) number of value inputs
    weights: tuple[str, ...] = ()  # required weight roles
    optional_weights: tuple[str, ...] = ()
    required_attrs: tuple[str, ...] = ()
    doc: str = ""


# The op set. The runtime's executor implements every op named here (``kernels/torch_ops.py``).
OPS: dict[str, OpSpec] = {
    "embedding": OpSpec((1, 1), ("weight",), doc="token ids [T] -> rows of the table [T, hidden]; with a `scale` "
                        "attr, rows * scale, the scale rounded to the table's dtype first (Gemma's sqrt(hidden)). "
                        "Reading `positions` instead of `input_ids`, a table of learned absolute position "
                        "embeddings (GPT-2's wpe), added to the token embeddings by an elementwise add"),
    "rms_norm": OpSpec(
        (1, 1), (), ("weight",), ("eps",),
        doc="x * rsqrt(mean(x^2) + eps) * (weight + weight_offset), computed in fp32; "
            "per head of size head_dim when that attr is set. Without weight_offset the normalised x is "
            "rounded to the activation dtype before the gain (Llama's order), with it the gain is applied "
            "in fp32 first (Gemma's (1 + w))",
    ),
    "layer_norm": OpSpec(
        (1, 1), (), ("weight", "bias"), ("eps",),
        doc="(x - mean(x)) * rsqrt(var(x) + eps) * weight + bias over each row, computed in fp32 and rounded once; "
            "weight and bias are optional (OLMo's norm has neither). With weight_offset the gain is weight + "
            "weight_offset, formed in the weight's dtype (Nemotron's LayerNorm1P: 1 + w). With head_dim, over each "
            "head's features, with one gain and bias of that size for every head (Persimmon's q/k norms) or a "
            "[heads, head_dim] gain, one per head (Command R+'s)",
    ),
    "fused_add_rms_norm": OpSpec(
        (2, 2), (), ("weight",), ("eps",),
        doc="(x, residual) -> (rms_norm(x + residual), x + residual)",
    ),
    "linear": OpSpec(
        (1, 1), (), ("weight", "bias") + QUANT_ROLES, ("in_features", "out_features"),
        doc="x @ weight.T + bias; with split_sizes, the output is split along features into outputs; with "
            "split_heads H as well, the output is H heads' rows side by side, each split by split_sizes, and output "
            "i holds every head's part i (GPT-NeoX's fused [q_h k_h v_h] rows); with a `quant` attr, the weight is "
            "stored quantized (see QUANT_SCHEMES)",
    ),
    "rope": OpSpec(
        (2, 2), ("inv_freq",), (), ("head_dim", "num_heads"),
        doc="(x, positions) -> x rotated (rotate-half layout; GPT-J's pairs with `interleaved`), cos/sin from "
            "inv_freq * attention_scaling; with rotary_dim, only each head's first rotary_dim features rotate "
            "(2 * len(inv_freq) == rotary_dim), the rest pass through; with long_from (LongRoPE), inv_freq holds two "
            "tables [2, rotary_dim / 2] and positions from long_from on take the second",
    ),
    "xielu": OpSpec(
        (1, 1), ("alpha_p", "alpha_n", "beta", "eps"), (), (),
        doc="xIELU (Apertus): with a_p = softplus(alpha_p) and a_n = beta + softplus(alpha_n) (one-element weights), "
            "a_p x^2 + beta x where x > 0, else (expm1(min(x, eps)) - x) a_n + beta x, in the model's order and "
            "dtypes",
    ),
    "position_scale": OpSpec(
        (2, 2), (), (), ("beta", "period"),
        doc="(x, positions) -> each token's row of x times 1 + beta * log(1 + floor(p / period)), the factor computed "
            "in fp32 and rounded to x's dtype before the product (Ministral 3's attention temperature on the "
            "rotated query, rope_parameters' llama_4_scaling_beta over original_max_position_embeddings)",
    ),
    "attention": OpSpec(
        (3, 3), (), ("k_scale", "v_scale", "sinks"), ("layer", "num_heads", "num_kv_heads", "head_dim", "scale"),
        doc="causal attention of q over the KV cache of layer `layer` after appending k, v: scores q k^T * scale, "
            "soft-capped to softcap * tanh(scores / softcap) where a `softcap` attr is set (Gemma 2), masked to "
            "the last `sliding_window` keys where that attr is set, softmax with each head's logit `sinks` [num_heads] "
            "added to its denominator only (attention sinks, gpt-oss) where that weight is set; with a "
            "`kv_cache_dtype` attr (fp8, int8) the cache stores k / k_scale and v / v_scale",
    ),
    "activation": OpSpec((1, 1), (), (), ("fn",), doc="fn in silu, gelu, gelu_tanh, relu, sigmoid, tanh"),
    "silu_mul": OpSpec((1, 2), (), (), (), doc="silu(gate) * up; with one input, its two halves"),
    "elementwise": OpSpec((1, 2), (), (), ("fn",), doc="fn in add, mul (two inputs) or scale (attr value)"),
    "lm_head": OpSpec(
        (1, 1), (), ("weight", "bias") + QUANT_ROLES, (),
        doc="logits (x @ weight.T + bias, times `scale` where set: Cohere's logit_scale, Granite's 1 / "
            "logits_scaling; then softcap * tanh(logits / softcap) where `softcap` is set: Gemma 2's "
            "final_logit_softcapping) for the rows the executor selects; with a `quant` attr (recipe "
            "quantization.lm_head), stored quantized like a linear, with in_features / out_features",
    ),
    "moe": OpSpec(
        (1, 1), ("gate_weight", "w_gate_up", "w_down"),
        ("gate_bias", "b_gate_up", "b_down", "w_gate_up_scale", "w_down_scale", "w_gate_up_scales", "w_gate_up_zeros",
         "w_down_scales", "w_down_zeros", "select_bias"),
        ("num_experts", "top_k", "scoring", "norm_topk_prob", "activation", "intermediate_size"),
        doc="a mixture of experts, x [T, hidden] -> [T, hidden]. Router: logits = x @ gate_weight.T (+ gate_bias) "
            "[T, num_experts] in x's dtype; scores = softmax or sigmoid (`scoring`) of them in fp32; each token goes "
            "to its top_k experts by score (torch.topk's order and tie-breaking), weighted by their scores, "
            "renormalised to sum 1 when norm_topk_prob, rounded to x's dtype first when `round_weights` (else they "
            "stay fp32). Selection bias (DeepSeek-V3's e_score_correction_bias: GLM-4.5, dots1, ERNIE 4.5 MoE, "
            "MiniMax-M2, AFMoE): with select_bias [num_experts] (or [1, num_experts]; fp32 where the family keeps it "
            "so, else the model's dtype; added in fp32) the top_k are chosen by scores + select_bias (torch.topk "
            "of that sum), each weighted by its score alone (gathered from the scores); `routed_scaling_factor` "
            "(default 1) multiplies the weights after the renormalisation (fp32, before round_weights); "
            "`router_fp32` (default false): the logits are computed in fp32 (x and gate_weight cast to fp32) "
            "instead of x's dtype. "
            "Expert e: act(x Wg^T) * (x Wu^T) @ Wd^T, [Wg; Wu] = w_gate_up[e] [2 * intermediate_size, "
            "hidden], Wd = w_down[e] [hidden, intermediate_size], act = `activation`. Output: per token, the sum "
            "over its top_k slots in slot order of weight * expert output, accumulated in the weights' dtype and "
            "rounded to x's dtype once. Expert biases (gpt-oss): b_gate_up [E, 2 * intermediate_size] added to "
            "x [Wg; Wu]^T, b_down [E, hidden] to the down projection. activation `clamped_swiglu` (moe only, "
            "gpt-oss): with g = min(gate, swiglu_limit), u = clamp(up, -swiglu_limit, swiglu_limit), the expert's "
            "hidden is (u + 1) * g * sigmoid(swiglu_alpha * g) instead of act(gate) * up. "
            "Shared experts are not part of it: they lift to linears beside it. With a "
            "`quant` attr (scheme fp8: MOE_QUANT_SCHEMES) the experts are FP8: w_gate_up / w_down hold e4m3 codes "
            "with per-channel fp32 scales w_gate_up_scale [E, 2 * intermediate_size] / w_down_scale [E, hidden], "
            "and each projection's input rows are quantized to e4m3 per token (dynamic), as an fp8 linear's. "
            "Scheme w4a16 (W4A16 experts, `quant` also holding bits 4, group_size, symmetric): w_gate_up [E, 2 * "
            "intermediate_size, hidden / 2] / w_down [E, hidden, intermediate_size / 2] hold 4-bit codes packed two per "
            "byte along the input (low nibble = even input index), w_gate_up_scales / w_down_scales fp32 and "
            "w_gate_up_zeros / w_down_zeros uint8 [E, out, in / group_size] their groups' scales and zero points: "
            "each expert's weight is (q - zero) * scale rounded to x's dtype (a w4a16 linear's layout, stacked)",
    ),
    # Tensor parallelism (written by the `shard` pass): collectives over the tp_size ranks of the default
    # process group; identity when tp_size is 1.
    "all_reduce": OpSpec(
        (1, 1), (), ("bias",), ("tp_size",),
        doc="sum of x over the tensor-parallel ranks, then + bias (held by every rank, added once)",
    ),
    "all_gather": OpSpec(
        (1, 1), (), (), ("tp_size",),
        doc="every rank's x concatenated along features in rank order (vocab-parallel logits)",
    ),
}

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "sigmoid", "tanh")
MOE_SCORING = ("softmax", "sigmoid")
# a moe's experts take the IR's activations as act(gate) * up, and gpt-oss's gating (clamped, alpha, up + 1)
MOE_ACTIVATIONS = ACTIVATIONS + ("clamped_swiglu",)
# Quantized experts of a `moe` node: scheme -> the weight roles it adds (the router's gate_weight is not quantized)
MOE_QUANT_SCHEMES: dict[str, tuple[str, ...]] = {
    "fp8": ("w_gate_up_scale", "w_down_scale"),
    "w4a16": ("w_gate_up_scales", "w_gate_up_zeros", "w_down_scales", "w_down_zeros"),
    "fp8_block": ("w_gate_up_scale", "w_down_scale"),  # one scale per [bn, bk] block of each expert (quant block_size)
}
ELEMENTWISE = ("add", "mul", "scale")


def block_size_ok(block: Any) -> bool:
    """An fp8_block linear's ``block_size``: [rows, columns] of one weight scale, integers in 1..MAX_SCALE_BLOCK."""
    return isinstance(block, list) and len(block) == 2 and all(
        isinstance(b, int) and not isinstance(b, bool) and 0 < b <= MAX_SCALE_BLOCK for b in block)


@dataclass(frozen=True)
class Slice:
    """Indices [start, stop) of a full tensor along ``dim``: one piece of a rank's shard."""

    dim: int
    start: int
    stop: int


@dataclass
class ShardedWeights:
    """Where each tensor-parallel rank's tensors come from (set by the ``shard`` pass).

    A rank's tensor ``name`` is its slices of ``full[name]`` concatenated along their dim (a plain
    view when there is one slice; the whole tensor when there is none: replicated). Nothing is
    copied until ``tensor`` is asked for one rank's tensor, so all ranks together cost one copy of
    the model, and the artifact writer materializes one tensor at a time.
    """

    tp_size: int
    full: dict[str, torch.Tensor]  # the unsharded tensors, by weight name
    slices: dict[str, list[tuple[Slice, ...]]]  # name -> per rank: its pieces of full[name]; () = replicated

    def tensor(self, name: str, rank: int) -> torch.Tensor:
        full, pieces = self.full[name], self.slices[name][rank]
        if not pieces:
            return full
        parts = [full.narrow(s.dim, s.start, s.stop - s.start) for s in pieces]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=pieces[0].dim)

    def num_params(self) -> int:
        """Parameters of the unsharded model."""
        return sum(t.numel() for t in self.full.values())


class GraphError(ValueError):
    """A graph that breaks the IR's invariants, or a serialized graph that cannot be read."""


@dataclass
class Node:
    """One op application. Values are named SSA-style; each is written by exactly one node."""

    op: str
    inputs: list[str]
    outputs: list[str]
    weights: dict[str, str] = field(default_factory=dict)  # role -> tensor name in Graph.params
    attrs: dict[str, Any] = field(default_factory=dict)
    source: str = ""  # module path in the source model this node was lifted from

    def __str__(self) -> str:
        outs = ", ".join(f"%{o}" for o in self.outputs)
        args = [f"%{i}" for i in self.inputs] + [f"{r}=@{w}" for r, w in self.weights.items()]
        attrs = ", ".join(f"{k}={_fmt_attr(v)}" for k, v in self.attrs.items())
        text = f"{outs} = {self.op}({', '.join(args)})"
        if attrs:
            text += f" {{{attrs}}}"
        if self.source:
            text += f"  # {self.source}"
        return text


def _fmt_attr(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


@dataclass
class Graph:
    """A model as an ordered list of nodes plus the weights they reference.

    ``params`` maps weight names to tensors. During a build they are real (or meta, right after
    tracing); serialization writes only their shapes and dtypes, the values go to safetensors.
    """

    nodes: list[Node]
    inputs: list[str]  # graph inputs, always ["input_ids", "positions"]
    outputs: list[str]  # graph outputs, ["logits"]
    params: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)  # model dimensions and source family
    version: int = IR_VERSION
    # Set by the `shard` pass (tp_size > 1): nodes and ``params`` (meta tensors) then describe one rank, and
    # each rank's real tensors come from here. Not serialized: the artifact writer writes one file per rank.
    shards: ShardedWeights | None = None

    # --- queries -------------------------------------------------------------------------
    def producers(self) -> dict[str, Node]:
        """Value name -> the node that writes it."""
        return {out: n for n in self.nodes for out in n.outputs}

    def users(self) -> dict[str, list[Node]]:
        """Value name -> nodes that read it, in graph order."""
        table: dict[str, list[Node]] = {}
        for n in self.nodes:
            for i in n.inputs:
                table.setdefault(i, []).append(n)
        return table

    def count_ops(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n.op] = counts.get(n.op, 0) + 1
        return counts

    def num_params(self) -> int:
        return sum(t.numel() for t in self.params.values())

    def copy(self) -> Graph:
        """A copy whose nodes and tables can be changed freely; tensors are shared (passes never
        modify a tensor in place, they put a new one in ``params``)."""
        import copy

        return Graph(copy.deepcopy(self.nodes), list(self.inputs), list(self.outputs), dict(self.params),
                     copy.deepcopy(self.meta), self.version, self.shards)

    # --- invariants ----------------------------------------------------------------------
    def check(self) -> None:
        """Raise GraphError if the graph breaks an invariant (see passes/README.md)."""
        defined = set(self.inputs)
        for n in self.nodes:
            spec = OPS.get(n.op)
            if spec is None:
                raise GraphError(f"node {n}: unknown op {n.op!r}; known ops: {', '.join(OPS)}")
            lo, hi = spec.num_inputs
            if not lo <= len(n.inputs) <= hi:
                raise GraphError(f"node {n}: {n.op} takes {lo}..{hi} inputs, got {len(n.inputs)}")
            for i in n.inputs:
                if i not in defined:
                    raise GraphError(f"node {n}: input %{i} is not defined before use")
            for role in spec.weights:
                if role not in n.weights:
                    raise GraphError(f"node {n}: {n.op} needs weight {role!r}")
            for role, name in n.weights.items():
                if role not in spec.weights + spec.optional_weights:
                    raise GraphError(f"node {n}: {n.op} has no weight role {role!r}")
                if name not in self.params:
                    raise GraphError(f"node {n}: weight @{name} is not in the graph's params")
            for a in spec.required_attrs:
                if a not in n.attrs:
                    raise GraphError(f"node {n}: {n.op} needs attribute {a!r}")
            if n.op in ("linear", "lm_head"):  # a plain one needs `weight`, a quantized one its scheme's roles
                scheme = n.attrs.get("quant", {}).get("scheme", "none")
                if scheme not in QUANT_SCHEMES:
                    raise GraphError(f"node {n}: unknown quant scheme {scheme!r}; known: {', '.join(QUANT_SCHEMES)}")
                for role in QUANT_SCHEMES[scheme]:
                    if role not in n.weights:
                        raise GraphError(f"node {n}: a {scheme} {n.op} needs weight {role!r}")
                if "pre_quant_scale" in n.weights and (scheme == "none" or tuple(
                        self.params[n.weights["pre_quant_scale"]].shape) != (n.attrs.get("in_features"),)):
                    raise GraphError(f"node {n}: a pre_quant_scale is one scale per input feature "
                                     f"({n.attrs.get('in_features')}) of a quantized {n.op}; it has shape "
                                     f"{tuple(self.params[n.weights['pre_quant_scale']].shape)}, scheme {scheme}")
                qmin = n.attrs.get("quant", {}).get("act_qmin", INT8_ACT_QMINS[0])
                if (scheme != "w8a8_int8" and "act_qmin" in n.attrs.get("quant", {})) or isinstance(qmin, bool) \
                        or not isinstance(qmin, int) or qmin not in INT8_ACT_QMINS:
                    raise GraphError(f"node {n}: quant act_qmin {qmin!r} on scheme {scheme}: the lowest int8 "
                                     f"activation code of a w8a8_int8 {n.op} is one of {INT8_ACT_QMINS}")
                if scheme == "fp8_block" and not block_size_ok(n.attrs["quant"].get("block_size")):
                    raise GraphError(f"node {n}: an fp8_block {n.op} needs quant block_size [rows, columns] of "
                                     f"integers in 1..{MAX_SCALE_BLOCK}; quant is {n.attrs['quant']}")
                sizes = n.attrs.get("split_sizes")
                if sizes is not None and (len(sizes) != len(n.outputs) or sum(sizes) * n.attrs.get("split_heads", 1)
                                          != n.attrs.get("out_features")):
                    raise GraphError(f"node {n}: split_sizes {sizes} (x split_heads) do not cover out_features "
                                     f"{n.attrs.get('out_features')} in {len(n.outputs)} outputs")
            if n.attrs.get("softcap", 0.0) < 0 or n.op == "activation" and n.attrs["fn"] not in ACTIVATIONS:
                raise GraphError(f"node {n}: softcap must be >= 0 (0 or absent: off) and an activation's fn one of "
                                 f"{', '.join(ACTIVATIONS)}")
            if n.op == "moe" and (n.attrs["scoring"] not in MOE_SCORING or n.attrs["activation"] not in MOE_ACTIVATIONS
                                  or not 1 <= n.attrs["top_k"] <= n.attrs["num_experts"]):
                raise GraphError(f"node {n}: moe needs scoring in {', '.join(MOE_SCORING)}, activation in "
                                 f"{', '.join(MOE_ACTIVATIONS)} and 1 <= top_k <= num_experts")
            if n.op == "moe" and n.attrs["activation"] == "clamped_swiglu" and not (
                    isinstance(n.attrs.get("swiglu_alpha"), (int, float))
                    and isinstance(n.attrs.get("swiglu_limit"), (int, float)) and n.attrs["swiglu_limit"] > 0):
                raise GraphError(f"node {n}: a clamped_swiglu moe needs numeric swiglu_alpha and swiglu_limit > 0")
            if n.op == "moe" and ("select_bias" in n.weights and tuple(self.params[n.weights["select_bias"]].shape)
                                  not in ((n.attrs["num_experts"],), (1, n.attrs["num_experts"]))
                                  or not isinstance(n.attrs.get("routed_scaling_factor", 1.0), (int, float))
                                  or isinstance(n.attrs.get("routed_scaling_factor", 1.0), bool)
                                  or not n.attrs.get("routed_scaling_factor", 1.0) > 0
                                  or not isinstance(n.attrs.get("router_fp32", False), bool)):
                raise GraphError(f"node {n}: a moe's select_bias is one value per expert ([num_experts] or [1, "
                                 f"num_experts]), its routed_scaling_factor a number > 0 and router_fp32 a bool; "
                                 f"attrs {n.attrs}")
            if n.op == "moe":  # quantized experts carry their scheme's roles; plain ones none of them
                scheme = n.attrs.get("quant", {}).get("scheme")
                if scheme is not None and scheme not in MOE_QUANT_SCHEMES:
                    raise GraphError(f"node {n}: unknown moe quant scheme {scheme!r}; known: "
                                     f"{', '.join(MOE_QUANT_SCHEMES)}")
                need = MOE_QUANT_SCHEMES.get(scheme, ())
                roles = {r for roles in MOE_QUANT_SCHEMES.values() for r in roles}
                if any((r in n.weights) != (r in need) for r in roles):
                    raise GraphError(f"node {n}: a moe with quant scheme {scheme or 'none'} carries exactly the "
                                     f"weights {list(need) or 'w_gate_up, w_down unquantized'}; it has "
                                     f"{sorted(n.weights)}")
                q = n.attrs.get("quant", {})
                if scheme == "w4a16" and not (q.get("bits") == 4 and isinstance(q.get("group_size"), int)
                                              and (q["group_size"] == -1 or q["group_size"] >= 1)):
                    raise GraphError(f"node {n}: w4a16 experts need quant bits 4 and an integer group_size (-1: one "
                                     f"group per row); quant is {q}")
                if scheme == "fp8_block" and not block_size_ok(q.get("block_size")):
                    raise GraphError(f"node {n}: fp8_block experts need quant block_size [rows, columns] of integers "
                                     f"in 1..{MAX_SCALE_BLOCK}; quant is {q}")
            for o in n.outputs:
                if o in defined:
                    raise GraphError(f"node {n}: value %{o} is written twice")
                defined.add(o)
        for o in self.outputs:
            if o not in defined:
                raise GraphError(f"graph output %{o} is never written")

    # --- serialization -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "ir_version": self.version,
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "meta": self.meta,
            "params": {
                name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                for name, t in self.params.items()
            },
            "nodes": [asdict(n) for n in self.nodes],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, data: dict[str, Any], params: dict[str, torch.Tensor] | None = None) -> Graph:
        """Rebuild a graph; without ``params``, weights are meta tensors of the recorded shapes."""
        version = data.get("ir_version")
        if version != IR_VERSION:
            raise GraphError(f"graph IR version {version!r} is not supported (this toolchain reads {IR_VERSION})")
        if params is None:
            params = {
                name: torch.empty(info["shape"], dtype=getattr(torch, info["dtype"]), device="meta")
                for name, info in data["params"].items()
            }
        nodes = [Node(**n) for n in data["nodes"]]
        graph = cls(nodes, list(data["inputs"]), list(data["outputs"]), params, dict(data.get("meta", {})))
        graph.check()
        return graph

    def __str__(self) -> str:
        head = (
            f"graph v{self.version} ({len(self.nodes)} nodes, {len(self.params)} weights, "
            f"{self.num_params() / 1e6:.2f}M parameters)\n"
            f"  inputs: {', '.join('%' + i for i in self.inputs)}\n"
        )
        body = "".join(f"  {n}\n" for n in self.nodes)
        return head + body + f"  return {', '.join('%' + o for o in self.outputs)}\n"

    def summary(self) -> str:
        """One line per op kind with its count, for logs and `builder inspect`."""
        return ", ".join(f"{op} x{c}" for op, c in sorted(self.count_ops().items()))


class NameGen:
    """Fresh value names: ``prefix``, ``prefix_1``, ``prefix_2``... unique within one graph."""

    def __init__(self, taken: set[str] | None = None) -> None:
        self.taken = set(taken or ())

    def __call__(self, prefix: str) -> str:
        name, k = prefix, 0
        while name in self.taken:
            k += 1
            name = f"{prefix}_{k}"
        self.taken.add(name)
        return name

    @classmethod
    def for_graph(cls, graph: Graph) -> NameGen:
        return cls({o for n in graph.nodes for o in n.outputs} | set(graph.inputs))
