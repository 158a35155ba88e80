"""Lift a torch.export graph of a Hugging Face causal LM into the project's coarse IR.

The lifter is an abstract interpreter over the exported ATen graph. Each FX node gets an abstract
value saying what it is in IR terms:

- ``Tok``: a per-token activation backed by an IR value, plus how the FX tensor lays it out
  (``[1, T, F]``, ``[1, T, H, D]``, ``[1, H, T, D]``, ...).
- ``Pos``: anything computed only from positions, shapes and buffers (position ids, causal masks,
  rotary cos/sin tables). The runtime recomputes these itself, so they never become IR nodes.
- ``Param``: a weight, possibly offset by a constant (a norm gain of ``1 + w``).
- partial patterns (``Sub``, ``Rot``, ``HalfRope``, ``RmsInv``, ``Centered``, ...): intermediate steps of RoPE
  (rotate-half, interleaved, or written on each head's halves as gpt-oss does, over all or the first features of
  each head), RMSNorm, LayerNorm and a GeLU written out with tanh, recognised from their arithmetic, not from
  module or class names.
- slices of a linear's output features (q/k/v or gate/up stored as one fused weight) become that linear's split
  outputs (``split_sizes``) once the lift has seen them all.
- ``Positions``: the position ids themselves (``arange`` over the tokens), followed through views, so that an
  embedding table looked up by them (GPT-2's learned absolute position embeddings) becomes an ``embedding`` of the
  graph's ``positions`` input.

Linears stored as transformers' ``Conv1D`` (GPT-2: ``addmm(bias, x, weight)`` with the weight [in, out]) become
ordinary linears whose weight the graph holds [out, in], as every other linear's: the graph lists them in
``meta["transposed_weights"]`` and the checkpoint reader (``builder/checkpoint.py``) transposes them once, so passes
and kernels never see the stored layout.

Linears written out as ``x @ weight.T`` (Falcon's) are linears of the weight as stored (a transposed weight is kept as
``ParamT`` until a matmul reads it), a bias added to such a product right after it becomes the linear's bias. A fused
q/k/v whose parts are taken by index lists (``qkv[..., [-2], :]``) or per group of heads (a view ``[.., groups, slots,
head_dim]``, Falcon's new decoder architecture) is split as any other fused linear (the tracer has an index list of
contiguous constants traced as the slice it equals); a kv head broadcast over its group's query heads is grouped-query
attention.

Attention: SDPA, or, for models whose attention adds what SDPA cannot (score soft-capping, attention sinks), the
tracer's own attention implementation (``passes/trace.py``), which makes each call one ``llm_builder::attention``
node (:func:`attention`) carrying the scale, the soft-cap and the sinks. A soft-cap of the final logits
(``c * tanh(logits / c)``) becomes the lm_head's ``softcap``.

Mixture-of-experts blocks: transformers (>= 5) keeps a block's experts in one module of stacked weights whose
forward dispatches tokens with data-dependent ops (sort, histc, grouped_mm, or nonzero and index_add). The tracer
(``passes/trace.py``) has every such module, found by the layout attributes transformers' experts interface gives it,
run as one ``llm_builder::moe_experts`` node (:func:`moe_experts`) instead. The router before it is lifted from its
arithmetic like everything else: a linear's logits, their softmax (or a sigmoid), the top-k, optionally the top-k
weights divided by their sum and cast back to the activations' dtype (``Scores``, ``TopK``, ``TopWeights``); or the
top-k of the logits with a softmax over those k (gpt-oss's, the same weights as the softmax renormalised). Routers
that choose by the scores plus a per-expert selection bias (DeepSeek-V3's e_score_correction_bias: GLM-4.5, dots1,
ERNIE 4.5 MoE, MiniMax-M2, AFMoE), written as chains of group masks, are traced whole as one
``llm_builder::moe_router`` node (:func:`moe_router`, ``trace_routers``) carrying their arithmetic; the bias becomes
the moe op's ``select_bias`` (kept in fp32 where the family keeps it so: ``meta["fp32_weights"]``). The
experts node then becomes one ``moe`` op with that routing, the router's linear taken into it. A shared expert
(Qwen2-MoE's, scaled by a sigmoid gate) is ordinary linears and elementwise ops beside it. gpt-oss's experts, stored
[experts, in, out] with gate and up columns interleaved and biases, are held in the moe op's layout:
``meta["moe_weight_layouts"]`` has the checkpoint reader convert them once, as it transposes Conv1D weights.

Small constants the model computes from its own buffers (an embedding scale of sqrt(hidden)) are
evaluated on the CPU when a per-token value is multiplied by them, and become an attribute.

Any op applied to a per-token value that no rule recognises stops the lift with a ``LiftError``
naming the ATen op, the module path it came from and, where known, the IR primitive it would need.
No table is keyed on architecture: a family that composes the same primitives (embedding, RMSNorm or LayerNorm,
linear, RoPE, attention, activations, residual adds, constant scales and experts behind a top-k router) lifts without
new code.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx

from passes.ir import Graph, NameGen, Node

aten = torch.ops.aten


class LiftError(RuntimeError):
    """The exported graph uses an op, or a pattern, the lifter does not know."""


# --------------------------------------------------------------------------------------------
# Abstract values
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """Where the token axis and feature axes of an FX tensor are.

    ``dims`` labels each FX dimension: B (batch of 1), T (tokens), F (flat features), G (groups of heads: a fused
    q/k/v viewed [.., groups, slots, head_dim], Falcon's), H (heads, or a group's slots), R (heads repeated for
    GQA), D (head dim). The IR value behind it is always [T, (G *) H * D] with heads major, so moving T around
    (transpose) or splitting F into H, D (view) never changes data.
    """

    dims: tuple[str, ...]
    sizes: tuple[int, ...]  # -1 for T

    def size(self, label: str) -> int:
        return self.sizes[self.dims.index(label)] if label in self.dims else 1


@dataclass(frozen=True)
class Tok:
    value: str  # IR value name
    layout: Layout
    repeat: int = 1  # GQA expansion factor applied by an expand/reshape before attention


@dataclass(frozen=True)
class Ids:
    value: str


@dataclass(frozen=True)
class Pos:
    buffers: frozenset[str] = frozenset()  # buffer targets this position-derived value depends on


@dataclass(frozen=True)
class Positions(Pos):
    """The position ids 0, 1, ..., T - 1 of the traced tokens, plus ``offset``: at run time the graph's ``positions``
    input (each token's position in its sequence) when ``offset`` is 0."""

    offset: int = 0


@dataclass(frozen=True)
class Param:
    name: str
    offset: float = 0.0  # the model uses weight + offset (Gemma's RMSNorm gain: 1 + w)


@dataclass(frozen=True)
class ParamT:
    """weight.T of a 2-D weight (Falcon's ``x @ weight.T``): only a matmul may read it, as a linear of ``name``."""

    name: str


@dataclass(frozen=True)
class Const:
    value: Any


# Partial patterns.
@dataclass(frozen=True)
class Sub:  # x[..., start:stop:step] over each head's features (absolute indices into head_dim), maybe negated
    x: Tok
    start: int
    stop: int
    step: int = 1
    neg: bool = False


@dataclass(frozen=True)
class Rot:  # rotate_half(x[..., start:stop]) = cat(-x_hi, x_lo); interleaved: GPT-J's stack(-x_odd, x_even)
    x: Tok
    start: int
    stop: int
    interleaved: bool = False
    neg: bool = False  # cat(x_hi, -x_lo) = -rotate_half(x): a rotation by minus the angle (NanoChat's)


@dataclass(frozen=True)
class Stacked:  # stack((-x_odd, x_even), -1): an interleaved rotation before its flatten
    rot: Rot


@dataclass(frozen=True)
class RopeTerm:  # x[..., start:stop] * cos, or rotate(x[..., start:stop]) * sin
    x: Tok
    rotated: bool
    table: Pos
    start: int
    stop: int
    interleaved: bool = False
    neg: bool = False  # rotated by minus the angle (see Rot)


@dataclass(frozen=True)
class HalfRope:  # one half of a rotation written on each head's halves (gpt-oss): x_lo * cos - x_hi * sin (lo), or
    x: Tok       # x_hi * cos + x_lo * sin (hi), over features [start, stop) of each head
    table: Pos
    start: int
    stop: int
    lo: bool


@dataclass(frozen=True)
class Mean:  # mean(x, -1)
    x: Tok


@dataclass(frozen=True)
class Centered:  # x - mean(x, -1): LayerNorm's mean-centring
    x: Tok


@dataclass(frozen=True)
class Square:  # x ** 2
    x: Tok | Centered


@dataclass(frozen=True)
class MeanSquare:  # mean(x ** 2, -1) (+ eps)
    x: Tok | Centered
    eps: float = 0.0


@dataclass(frozen=True)
class RmsInv:  # rsqrt(mean(x ** 2, -1) + eps)
    x: Tok | Centered
    eps: float


@dataclass(frozen=True)
class Normed:  # x * rsqrt(mean(x ** 2) + eps) (RMSNorm), or centred (LayerNorm); weight not applied yet
    x: Tok
    eps: float
    centered: bool = False
    source: str = ""  # the module that normalises


# GeLU written out with tanh (transformers' gelu_new, gelu_python_tanh): 0.5 * x * (1 + tanh(a * (x + b * x^3)))
@dataclass(frozen=True)
class Cube:  # b * x ** 3
    x: Tok
    coef: float = 1.0


@dataclass(frozen=True)
class TanhArg:  # a * (x + b * x ** 3), and tanh of it
    x: Tok
    a: float
    b: float
    tanh: bool = False


@dataclass(frozen=True)
class OnePlusTanh:  # 1 + tanh(a * (x + b * x ** 3))
    x: Tok


@dataclass(frozen=True)
class Split:  # split / chunk of x along FX dim ``dim``: each piece's [start, stop), taken by getitem
    x: Tok
    dim: int
    bounds: tuple[tuple[int, int], ...]


# A mixture-of-experts router: scores of the router linear's logits, their top-k, the top-k weights' renormalisation.
@dataclass(frozen=True)
class Scores:  # softmax or sigmoid of a router's logits (in fp32), or the logits themselves (topk before softmax)
    logits: Tok
    scoring: str  # "softmax" | "sigmoid" | "logits"
    sigmoid: str | None = None  # the sigmoid activation's output value, dropped with the router linear
    # a router traced whole (``moe_router``): its selection bias (a weight's name), scaling factor, fp32 logits
    select_bias: str | None = None
    scale: float = 1.0
    fp32: bool = False


@dataclass(frozen=True)
class TopK:  # topk(scores, k): the (values, indices) pair, taken by getitem
    scores: Scores
    k: int
    weights: Any = None  # a router traced whole (``moe_router``): its routing weights (a TopWeights)


@dataclass(frozen=True)
class TopIndices:  # the experts each token is routed to [T, k]
    scores: Scores
    k: int


@dataclass(frozen=True)
class TopWeights:  # the routing weights [T, k], maybe renormalised to sum 1, maybe cast to the activations' dtype
    scores: Scores
    k: int
    renormalized: bool = False
    cast: bool = False


@dataclass(frozen=True)
class TopWeightsSum:  # sum(weights, -1, keepdim=True): the denominator of the renormalisation
    weights: TopWeights


PATTERNS = (Sub, Rot, Stacked, RopeTerm, HalfRope, Mean, Centered, Square, MeanSquare, RmsInv, Normed, Cube, TanhArg,
            OnePlusTanh, Split, Scores, TopK, TopIndices, TopWeights, TopWeightsSum)
GELU_TANH = (math.sqrt(2.0 / math.pi), 0.044715)  # a, b of the tanh approximation


# --------------------------------------------------------------------------------------------
# The lifter
# --------------------------------------------------------------------------------------------
IDENTITY_OPS = {
    aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.contiguous.default,
    aten.clone.default, aten.alias.default, aten.detach.default, aten.type_as.default,
    aten.dropout.default,
}
LAYOUT_OPS = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int,
    aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default,
    aten.expand.default, aten.broadcast_to.default, aten.flatten.using_ints,
}
IGNORED_OPS = {
    aten._assert_tensor_metadata.default, aten.sym_size.int, aten._assert_scalar.default,
    aten.sym_constrain_range_for_size.default,
}
ACTIVATION_OPS = {
    aten.silu.default: "silu", aten.relu.default: "relu", aten.sigmoid.default: "sigmoid",
}
DTYPE_CASTS = {aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.type_as.default}


# --- the experts of a mixture-of-experts block --------------------------------------------------------------
@torch.library.custom_op("llm_builder::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor, activation: str, b_gate_up: torch.Tensor | None = None,
                b_down: torch.Tensor | None = None, layout: str = "stacked", swiglu_alpha: float = 0.0,
                swiglu_limit: float = 0.0) -> torch.Tensor:
    """Stands for a model's routed experts while tracing (``passes/trace.py`` makes every experts module call it):
    x [T, hidden] goes to experts top_k_index [T, k], expert e computing act(x Wg_e^T) * (x Wu_e^T) Wd_e^T with
    [Wg_e; Wu_e] = w_gate_up[e] and Wd_e = w_down[e], and the outputs are summed with top_k_weights [T, k]. It is
    one node in the exported graph, where the experts' own code dispatches tokens with data-dependent ops.
    ``layout`` "in_out_interleaved" (gpt-oss): w_gate_up [E, hidden, 2I] with gate and up columns interleaved,
    w_down [E, I, hidden], biases b_gate_up [E, 2I] (interleaved too) and b_down [E, hidden], activation
    "clamped_swiglu" with ``swiglu_alpha`` and ``swiglu_limit``."""
    raise RuntimeError("llm_builder::moe_experts only stands for a model's experts in a traced graph; "
                       "it is never run (the runtime's moe op computes them)")


@moe_experts.register_fake
def _moe_experts_fake(x, top_k_index, top_k_weights, w_gate_up, w_down, activation, b_gate_up=None, b_down=None,
                      layout="stacked", swiglu_alpha=0.0, swiglu_limit=0.0):
    return torch.empty_like(x)


MOE_EXPERTS_OP = torch.ops.llm_builder.moe_experts.default


@torch.library.custom_op("llm_builder::moe_router", mutates_args=())
def moe_router(x: torch.Tensor, weight: torch.Tensor, select_bias: torch.Tensor, top_k: int, scoring: str,
               norm_topk_prob: bool, routed_scaling_factor: float, router_fp32: bool,
               round_weights: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Stands for a router that picks experts by its scores plus a per-expert selection bias (DeepSeek-V3's
    e_score_correction_bias: GLM-4.5's, dots1's, ERNIE 4.5 MoE's, MiniMax-M2's) while tracing (``passes/trace.py``
    makes those routers call it): (weights [T, top_k], experts [T, top_k]) of x [T, hidden] as
    ``kernels.torch_ops.moe_route`` computes them with these arguments (weights rounded to x's dtype when
    ``round_weights``). One node in the exported graph, where the router's own code is a chain of group masks."""
    raise RuntimeError("llm_builder::moe_router only stands for a model's router in a traced graph; it is never run")


@moe_router.register_fake
def _moe_router_fake(x, weight, select_bias, top_k, scoring, norm_topk_prob, routed_scaling_factor, router_fp32,
                     round_weights):
    n = x.shape[0]
    return (x.new_empty((n, top_k), dtype=x.dtype if round_weights else torch.float32),
            x.new_empty((n, top_k), dtype=torch.int64))


MOE_ROUTER_OP = torch.ops.llm_builder.moe_router.default


# --- xIELU (Apertus's activation) --------------------------------------------------------------------------------
@torch.library.custom_op("llm_builder::xielu", mutates_args=())
def xielu(x: torch.Tensor, alpha_p: torch.Tensor, alpha_n: torch.Tensor, beta: torch.Tensor,
          eps: torch.Tensor) -> torch.Tensor:
    """Stands for transformers' XIELUActivation while tracing (``passes/trace.py`` makes each such module call it):
    with a_p = softplus(alpha_p) and a_n = beta + softplus(alpha_n), a_p x^2 + beta x where x > 0, else
    (expm1(min(x, eps)) - x) a_n + beta x (``kernels.torch_ops.xielu``). One node in the exported graph, where the
    module's own code is a where() over two branches of scalars computed from its weights and buffers."""
    raise RuntimeError("llm_builder::xielu only stands for an xIELU activation in a traced graph; it is never run")


@xielu.register_fake
def _xielu_fake(x, alpha_p, alpha_n, beta, eps):
    return torch.empty_like(x)


XIELU_OP = torch.ops.llm_builder.xielu.default


# --- attention the model computes its own way (soft-capping, sinks) -----------------------------------------
@torch.library.custom_op("llm_builder::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, scale: float,
              softcap: float) -> torch.Tensor:
    """Stands for one causal attention call while tracing (``passes/trace.py`` registers it as an attention
    implementation with transformers): q [B, H, T, D], k, v [B, Hkv, T, D] -> [B, T, H, D]. Scores q k^T * scale,
    soft-capped to softcap * tanh(scores / softcap) when softcap > 0, masked causally (and by the calling module's
    sliding window), softmax with each head's sink logit sinks[h] (when given) in the denominator only."""
    raise RuntimeError("llm_builder::attention only stands for a model's attention in a traced graph; "
                       "it is never run (the runtime's attention op computes it)")


@attention.register_fake
def _attention_fake(q, k, v, sinks, scale, softcap):
    return q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3])


ATTENTION_OP = torch.ops.llm_builder.attention.default


@dataclass
class LiftContext:
    model: torch.nn.Module  # the traced model (on meta), for module attributes such as sliding_window
    rotary: Callable[[str], tuple[torch.Tensor, float]]  # buffer target -> (inv_freq, attention_scaling)
    # buffer target -> its real value (the traced model's buffers are meta); None: constants cannot be evaluated
    buffer: Callable[[str], torch.Tensor] | None = None
    # buffer target -> LongRoPE's second table and the first position it rotates, or None (one table)
    long_rotary: Callable[[str], tuple[torch.Tensor, int] | None] | None = None


@dataclass
class _State:
    env: dict[torch.fx.Node, Any] = field(default_factory=dict)
    nodes: list[Node] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    names: NameGen = field(default_factory=NameGen)
    num_attention: int = 0
    rope_tables: dict[frozenset[str], str] = field(default_factory=dict)  # buffers -> inv_freq param
    # a rotary buffer -> ctx.rotary's (inv_freq, attention_scaling) and ctx.long_rotary's answer for it
    rotaries: dict[str, tuple[torch.Tensor, float, tuple[torch.Tensor, int] | None]] = field(default_factory=dict)
    inputs: dict[str, Any] = field(default_factory=dict)  # placeholder name -> its InputSpec
    constants: dict[str, Any] = field(default_factory=dict)  # the exported program's lifted constant tensors
    evaluated: dict[torch.fx.Node, torch.Tensor] = field(default_factory=dict)  # constants computed so far
    producer: dict[str, Node] = field(default_factory=dict)  # IR value -> the node that writes it
    splits: dict[str, _Split] = field(default_factory=dict)  # a linear's output value -> the slices read of it
    # a partial rope's output -> (its input, rotary_dim): the two agree on the features from rotary_dim on
    passthrough: dict[str, tuple[str, int]] = field(default_factory=dict)
    # a weight stored [in, out] (Conv1D) -> the linears that read it so; the graph holds it transposed
    transposed: dict[str, list[Node]] = field(default_factory=dict)
    # expert weights held in the moe op's layout, stored otherwise (gpt-oss): name -> moe_layout_convert's kind
    moe_layouts: dict[str, str] = field(default_factory=dict)
    # weights the checkpoint reader keeps in fp32 (a router's selection bias and weight where the family does)
    fp32_weights: set[str] = field(default_factory=set)


@dataclass
class _Split:
    """The slices of one linear's output features that the model reads (fused q/k/v or gate/up weights). At the
    end of the lift they must tile the output, and the linear then writes one value per slice (``split_sizes``)."""

    node: Node  # the linear
    pieces: dict[tuple[int, int], str] = field(default_factory=dict)  # (start, stop) -> value name
    per_head: int = 0  # > 0: the slices are of each of this many heads' features (GPT-NeoX's [q_h k_h v_h] rows)


def lift(exported: torch.export.ExportedProgram, ctx: LiftContext) -> Graph:
    """Lift an exported ``model(input_ids=...) -> logits`` program into a Graph."""
    gm = exported.graph_module
    sig = exported.graph_signature
    placeholders = {s.arg.name: s for s in sig.input_specs}
    state_dict = exported.state_dict
    st = _State(names=NameGen({"input_ids", "positions"}), constants=dict(exported.constants))

    for fx_node in gm.graph.nodes:
        if fx_node.op == "placeholder":
            spec = placeholders[fx_node.name]
            st.inputs[fx_node.name] = spec
            if spec.kind == torch.export.graph_signature.InputKind.PARAMETER:
                st.env[fx_node] = Param(spec.target)
                st.params[spec.target] = state_dict[spec.target]
            elif spec.kind in (torch.export.graph_signature.InputKind.BUFFER,
                               torch.export.graph_signature.InputKind.CONSTANT_TENSOR):
                st.env[fx_node] = Pos(frozenset([spec.target]))
            elif fx_node.name == "input_ids":
                st.env[fx_node] = Ids("input_ids")
            else:
                st.env[fx_node] = Const(None)
        elif fx_node.op == "get_attr":
            st.env[fx_node] = Pos()
        elif fx_node.op == "call_function":
            st.env[fx_node] = _lift_call(fx_node, st, ctx)
        elif fx_node.op == "output":
            outs = fx_node.args[0]
            out = outs[0] if isinstance(outs, (tuple, list)) else outs
            logits = st.env[out]
            if not isinstance(logits, Tok):
                raise LiftError(f"the model's first output is not a per-token value ({logits!r})")
            _finish_splits(st)
            _mark_lm_head(st, logits.value)
            _drop_dead(st)
            _check_transposed(st)
    graph = Graph(st.nodes, ["input_ids", "positions"], [], _used_params(st))
    graph.outputs = [st.nodes[-1].outputs[0]]
    if st.transposed:
        graph.meta["transposed_weights"] = sorted(st.transposed)
    if st.moe_layouts:
        graph.meta["moe_weight_layouts"] = dict(sorted(st.moe_layouts.items()))
    if st.fp32_weights:
        graph.meta["fp32_weights"] = sorted(st.fp32_weights & set(graph.params))
    graph.check()
    return graph


def _used_params(st: _State) -> dict[str, torch.Tensor]:
    used = {w for n in st.nodes for w in n.weights.values()}
    return {k: v for k, v in st.params.items() if k in used}


def _mark_lm_head(st: _State, value: str) -> None:
    """The final linear becomes the lm_head; a soft-cap of its logits, c * tanh(logits / c) (Gemma 2's
    final_logit_softcapping), becomes its ``softcap``, and constant factors applied before that (Cohere's
    logit_scale, Granite's 1 / logits_scaling) its ``scale``."""
    softcap = _logit_softcap(st, value)
    if softcap is not None:
        value = st.nodes[-3].inputs[0]
        del st.nodes[-3:]
    scale = 1.0
    while (st.nodes[-1].op == "elementwise" and st.nodes[-1].attrs["fn"] == "scale" and len(st.nodes) > 1
           and st.nodes[-1].outputs == [value] and st.nodes[-2].outputs == st.nodes[-1].inputs
           and sum(st.nodes[-1].inputs[0] in n.inputs for n in st.nodes) == 1):
        scale *= st.nodes[-1].attrs["value"]
        value = st.nodes.pop().inputs[0]
    last = st.nodes[-1]
    if last.op != "linear" or last.outputs != [value]:
        raise LiftError("the model's logits are not produced by a final linear layer (lm_head)")
    last.op = "lm_head"
    last.attrs = {} if scale == 1.0 else {"scale": scale}
    if softcap is not None:
        last.attrs["softcap"] = softcap


def _logit_softcap(st: _State, value: str) -> float | None:
    """c when the graph ends in x * (1 / c) -> tanh -> * c writing ``value``, each step read by the next alone."""
    if len(st.nodes) < 4:
        return None
    down, tanh, up = st.nodes[-3:]
    chain = (down.op == "elementwise" and down.attrs["fn"] == "scale" and tanh.op == "activation"
             and tanh.attrs["fn"] == "tanh" and up.op == "elementwise" and up.attrs["fn"] == "scale"
             and up.outputs == [value] and tanh.inputs == down.outputs and up.inputs == tanh.outputs)
    if not chain or not math.isclose(down.attrs["value"] * up.attrs["value"], 1.0, rel_tol=1e-6):
        return None
    if any(sum(v in n.inputs for n in st.nodes) != 1 for v in (down.inputs[0], down.outputs[0], tanh.outputs[0])):
        return None
    return float(up.attrs["value"])


def _finish_splits(st: _State) -> None:
    """Each linear whose output the model read in slices writes one value per slice (``split_sizes``)."""
    for value, split in st.splits.items():
        node = split.node
        reader = next((n for n in st.nodes if value in n.inputs), None)
        if reader is not None:
            raise LiftError(f"the output of linear {node.source!r} is read both whole (by {reader.op} at "
                            f"{reader.source!r}) and in slices; the lifter splits a fused linear only when every "
                            f"reader takes a slice")
        cuts = sorted(split.pieces)
        size = node.attrs["out_features"] // max(split.per_head, 1)
        if [c[0] for c in cuts] != [0] + [c[1] for c in cuts[:-1]] or cuts[-1][1] != size:
            raise LiftError(f"the slices {cuts} read of linear {node.source!r}'s output do not tile its {size} "
                            f"features{' per head' if split.per_head else ''}; a fused linear is split only into "
                            f"adjacent, non-overlapping parts")
        node.outputs = [split.pieces[c] for c in cuts]
        node.attrs["split_sizes"] = [b - a for a, b in cuts]
        if split.per_head:
            node.attrs["split_heads"] = split.per_head


def _check_transposed(st: _State) -> None:
    """A weight the graph holds transposed (Conv1D's [in, out]) may be read only by the linears that read it so."""
    for n in st.nodes:
        for w in n.weights.values():
            if w in st.transposed and not any(n is r for r in st.transposed[w]):
                raise LiftError(f"weight {w} is read as a Conv1D weight ([in, out], by {st.transposed[w][0].source!r}) "
                                f"and also as stored by {n.op} at {n.source!r}; the graph holds one layout of it")


def _drop_dead(st: _State) -> None:
    """Drop activations and elementwise ops nothing reads: the leftovers of a pattern recognised later (the
    0.5 * x of a GeLU written out with tanh)."""
    read = {i for n in st.nodes for i in n.inputs} | set(st.nodes[-1].outputs)
    while True:
        dead = [n for n in st.nodes if n.op in ("elementwise", "activation") and not read & set(n.outputs)]
        if not dead:
            return
        gone = {id(n) for n in dead}
        st.nodes = [n for n in st.nodes if id(n) not in gone]
        read = {i for n in st.nodes for i in n.inputs} | set(st.nodes[-1].outputs)


def _module_path(fx_node: torch.fx.Node) -> str:
    stack = fx_node.meta.get("nn_module_stack") or {}
    return (list(stack.values())[-1][0] if stack else "") or "<top>"  # the root module's path is ""


def _rotary_uses_only(fx_node: torch.fx.Node, st: _State) -> bool:
    """Whether every reader of ``fx_node`` multiplies it by a position-derived value (a cos / sin table)."""
    users = [u for u in fx_node.users if u.target not in IGNORED_OPS]
    return bool(users) and all(
        u.target in (aten.mul.Tensor,) and len(u.args) == 2
        and isinstance(_abstract(u.args[1] if u.args[0] is fx_node else u.args[0], st), Pos) for u in users)


def _abstract(arg: Any, st: _State) -> Any:
    if isinstance(arg, torch.fx.Node):
        return st.env.get(arg)
    if isinstance(arg, (list, tuple)):
        return [_abstract(a, st) for a in arg]
    return Const(arg)


def _is_token_like(v: Any) -> bool:
    if isinstance(v, list):
        return any(_is_token_like(x) for x in v)
    return isinstance(v, (Tok, Ids) + PATTERNS)


def _pos_union(vals: list[Any]) -> Pos:
    buffers: frozenset[str] = frozenset()
    for v in vals:
        if isinstance(v, list):
            buffers |= _pos_union(v).buffers
        elif isinstance(v, Pos):
            buffers |= v.buffers
    return Pos(buffers)


def _emit(st: _State, op: str, inputs: list[str], prefix: str, source: str, *,
          weights: dict[str, str] | None = None, attrs: dict[str, Any] | None = None) -> str:
    out = st.names(prefix)
    st.nodes.append(Node(op, inputs, [out], dict(weights or {}), dict(attrs or {}), source))
    st.producer[out] = st.nodes[-1]
    return out


def _layout_of(fx_node: torch.fx.Node) -> Layout:
    """Label the dims of a per-token FX tensor from its shape: the symbolic dim is the token axis."""
    val = fx_node.meta.get("val")
    shape = tuple(val.shape)
    t_axis = [i for i, s in enumerate(shape) if not isinstance(s, int)]
    if len(t_axis) != 1:
        raise LiftError(f"cannot find the token axis of {fx_node.target} in shape {shape} "
                        f"at {_module_path(fx_node)}")
    t = t_axis[0]
    before, after = shape[:t], shape[t + 1:]
    labels_before = {0: (), 1: ("B",), 2: ("B", "H"), 3: ("B", "H", "R")}.get(len(before))
    labels_after = {0: (), 1: ("D",) if len(before) >= 2 else ("F",), 2: ("H", "D"), 3: ("G", "H", "D")}.get(len(after))
    if labels_before is None or labels_after is None or (len(before) >= 2 and len(after) != 1):
        tokens_last = not after and len(before) == 2  # [B, features, T]: a convolution over the tokens' axis
        need = ("; a per-token value with the tokens as its last axis is the input of a convolution over the tokens "
                "(a short causal conv, e.g. LFM2's or Mamba's), which the IR has no op for" if tokens_last else
                "; the IR's per-token values are [B, T, features] or split into heads")
        raise LiftError(f"unsupported tensor layout {shape} from {fx_node.target} at {_module_path(fx_node)}{need}")
    sizes = tuple(int(s) if isinstance(s, int) else -1 for s in shape)
    return Layout(labels_before + ("T",) + labels_after, sizes)


def _lift_call(fx_node: torch.fx.Node, st: _State, ctx: LiftContext) -> Any:
    target = fx_node.target
    args = [_abstract(a, st) for a in fx_node.args]
    kwargs = {k: _abstract(v, st) for k, v in fx_node.kwargs.items()}
    source = _module_path(fx_node)
    if target in IGNORED_OPS:
        return None
    if target is operator.getitem:
        base, index = args
        if isinstance(base, Pos):
            return base
        if isinstance(base, TopK):  # (values, indices) = topk(scores, k)
            return (base.weights or TopWeights(base.scores, base.k), TopIndices(base.scores, base.k))[_const(index)]
        if isinstance(base, Split):
            start, stop = base.bounds[_const(index)]
            # a chunk of each head's features that is only multiplied by a rotary table is a half of a rotation
            # written on the heads' halves (gpt-oss), not a projection of a fused linear
            halves = base.x.layout.dims[base.dim] == "D" and _rotary_uses_only(fx_node, st)
            piece = _slice_value(fx_node, base.x, base.dim, start, stop, 1, st, source, fused=not halves)
            if piece is NotImplemented:
                raise LiftError(f"module {source!r} splits a per-token value along an axis other than its features"
                                f"{_needs(aten.split.Tensor)}")
            return piece
        raise LiftError(f"getitem on {base!r} at {source}")
    if not (_is_token_like(args) or _is_token_like(list(kwargs.values()))):
        if target == aten.embedding.default and isinstance(args[1], Positions):  # a table of position embeddings
            return _embedding(fx_node, args, kwargs, st, ctx, source)
        if any(isinstance(a, (Param, ParamT)) for a in args + list(kwargs.values())):
            return _weight_expression(fx_node, args, kwargs, source)
        # Only positions, shapes, buffers and constants feed this op: position machinery.
        return _positions(fx_node, args) or _pos_union(args + list(kwargs.values()))
    if any(isinstance(a, Normed) for a in args) and not _takes_normed(target, args):
        args = [_weightless_norm(fx_arg, a, st) if isinstance(a, Normed) else a
                for fx_arg, a in zip(fx_node.args, args)]
    rule = RULES.get(target)
    if rule is None:
        known = "" if target in NEEDS else f"; the lifter knows: {', '.join(sorted(str(t) for t in RULES))}"
        raise LiftError(f"unsupported op {target} applied to per-token values at module {source!r}{_needs(target)}"
                        f"{known}")
    result = rule(fx_node, args, kwargs, st, ctx, source)
    if result is NotImplemented:
        raise LiftError(f"op {target} at module {source!r} is used in a pattern the lifter does not "
                        f"know (operands: {', '.join(type(a).__name__ for a in args)}){_needs(target)}")
    return result


def _takes_normed(target: Any, args: list) -> bool:
    """Whether an op keeps a norm pending: a cast (the gain may follow it), or a product with the gain (a weight)
    or with 1."""
    if target in IDENTITY_OPS:
        return True
    return target == aten.mul.Tensor and any(isinstance(a, Param) or isinstance(a, Const) and a.value == 1
                                             for a in args)


def _weightless_norm(fx_arg: torch.fx.Node, normed: Normed, st: _State) -> Tok:
    """A norm without a gain (NanoChat's RMSNorm: x * rsqrt(mean(x^2) + eps), nothing after) read by an op other
    than a product with a weight: the norm op without its weight, emitted once for that FX value."""
    x, source = normed.x, normed.source or _module_path(fx_arg)
    attrs: dict[str, Any] = {"eps": normed.eps}
    if x.layout.dims[-1] == "D":
        if normed.centered:
            raise LiftError(f"LayerNorm per head at {source!r}: the layer_norm op normalises whole rows only")
        attrs["head_dim"] = x.layout.size("D")
    out = _emit(st, "layer_norm" if normed.centered else "rms_norm", [x.value], "norm", source, attrs=attrs)
    tok = st.env[fx_arg] = Tok(out, _layout_of(fx_arg), x.repeat)
    return tok


# What an op the lifter stops at usually stands for, and the IR primitive lifting it would take.
NEEDS: dict[Any, str] = {
    aten.layer_norm.default: "a LayerNorm over something other than one row of features (per head, or with a gain "
                             "computed from the weight), which the layer_norm op does not cover",
    aten.native_layer_norm.default: "a LayerNorm whose statistics are used as well, which the layer_norm op does not "
                                    "return",
    aten.softmax.int: "a softmax over per-token values other than a mixture-of-experts router's (over the experts' "
                      "logits, followed by a top-k), which the IR has no op for",
    aten._softmax.default: "a softmax over per-token values other than a mixture-of-experts router's (over the "
                           "experts' logits, followed by a top-k), which the IR has no op for",
    aten.topk.default: "a top-k of something other than a mixture-of-experts router's softmax or sigmoid scores",
    aten.one_hot.default: "a mixture-of-experts block whose experts dispatch tokens in their own code (one_hot, "
                          "nonzero, index_add) instead of transformers' experts interface, which the tracer turns into "
                          "one node",
    aten.matmul.default: "attention written out as matmul + softmax (eager attention) or another product of two "
                         "activations; the IR takes attention from scaled_dot_product_attention or the tracer's "
                         "attention implementation, and matmuls only as x @ weight.T (a linear)",
    aten.bmm.default: "attention written out as matmul + softmax (eager attention) or another product of two "
                      "activations; the IR takes attention from scaled_dot_product_attention or the tracer's "
                      "attention implementation",
    aten.div.Tensor: "a division of per-token values by something other than a constant, which the lifter does not "
                     "map to an IR op",
    aten.index.Tensor: "an index of per-token features by a tensor, or by a list other than one of contiguous, "
                       "ascending constants (which the tracer takes as a slice)",
    aten.slice.Tensor: "a slice of per-token features other than a fused linear's parts (q/k/v, gate/up) or the "
                       "rotated part of each head (partial rotary embeddings)",
    aten.embedding.default: "an embedding looked up by something other than the token ids or the positions (a "
                            "position table read at an offset, or by ids computed from the tokens), which the IR has "
                            "no op for",
    aten.addmm.default: "x @ weight + c with the weight stored [in, out] (transformers' Conv1D) where c is not a bias "
                        "parameter or alpha / beta scale the terms, which the linear op does not cover",
    aten.mean.dim: "a mean of per-token values other than a norm's (RMSNorm's mean of squares, LayerNorm's "
                   "mean and variance)",
    aten.view.default: "a view of the token ids or of features the IR cannot follow (a model that reshapes its "
                       "input_ids into more than one id per token)",
}


def _needs(target: Any) -> str:
    need = NEEDS.get(target)
    return f"; this is usually {need}" if need else ""


TRANSPOSE_OPS = {aten.numpy_T.default, aten.t.default, aten.transpose.int, aten.permute.default}


def _weight_expression(fx_node, args, kwargs, source) -> Param | ParamT:
    """An op on weights alone: a cast passes through, a constant added becomes the weight's offset (the
    ``1 + w`` gain of Gemma's RMSNorm), the transpose of a 2-D weight is read by a matmul as a linear (Falcon's
    ``x @ weight.T``). Anything else would compute a tensor the graph cannot store."""
    x = args[0]
    if fx_node.target in IDENTITY_OPS and isinstance(x, (Param, ParamT)):
        return x
    if fx_node.target in TRANSPOSE_OPS and fx_node.meta["val"].dim() == 2 and isinstance(x, (Param, ParamT)) \
            and not getattr(x, "offset", 0.0):
        return ParamT(x.name) if isinstance(x, Param) else Param(x.name)
    if fx_node.target == aten.add.Tensor and _const(kwargs.get("alpha", Const(1))) == 1:
        for w, c in ((args[0], args[1]), (args[1], args[0])):
            if isinstance(w, Param) and isinstance(c, Const) and isinstance(c.value, (int, float)):
                return Param(w.name, w.offset + float(c.value))
    weights = ", ".join(a.name for a in args if isinstance(a, (Param, ParamT)))
    if any(isinstance(a, Pos) for a in args + list(kwargs.values())):
        raise LiftError(f"op {fx_node.target} at module {source!r} combines weight {weights} with values computed "
                        f"from the positions{_needs(fx_node.target)}; the IR's only position-dependent ops are "
                        f"rope and attention")
    raise LiftError(f"op {fx_node.target} at module {source!r} computes a new tensor from weight {weights} before "
                    f"using it; the lifter takes weights as stored, cast, or offset by a constant (a norm gain of "
                    f"1 + w)")


def _const(v: Any) -> Any:
    if isinstance(v, list):
        return [_const(x) for x in v]
    return v.value if isinstance(v, Const) else NotImplemented


# --- rules: one per ATen op, each returning an abstract value or NotImplemented -----------------
def _identity(fx_node, args, kwargs, st, ctx, source):
    x = args[0]
    if isinstance(x, TopWeights) and fx_node.target in DTYPE_CASTS:  # Qwen-MoE's weights.to(logits.dtype)
        return TopWeights(x.scores, x.k, x.renormalized, cast=True)
    if isinstance(x, Tok):
        return Tok(x.value, _layout_of(fx_node), x.repeat)
    return x


def _layout(fx_node, args, kwargs, st, ctx, source):
    x = args[0]
    if isinstance(x, Stacked):  # stack((-x_odd, x_even), -1).flatten(-2): the interleaved rotation
        return x.rot
    if isinstance(x, Ids):  # input_ids.view(-1, T) and the like: still one id per token
        shape = tuple(fx_node.meta["val"].shape)
        return x if math.prod(d for d in shape if isinstance(d, int)) == 1 else NotImplemented
    if not isinstance(x, Tok):
        return NotImplemented
    layout = _layout_of(fx_node)
    repeat = x.repeat
    if "R" in layout.dims:  # expand [B, Hkv, R, T, D] for grouped-query attention
        repeat = layout.size("R")
    if (fx_node.target in (aten.expand.default, aten.broadcast_to.default) and "G" in x.layout.dims
            and layout.dims == x.layout.dims and x.layout.size("H") == 1 and repeat == 1):
        repeat = layout.size("H")  # a group's one kv head over its query heads [B, T, G, 1 -> R, D]: GQA
    old_feats = math.prod(s for d, s in zip(x.layout.dims, x.layout.sizes) if d not in "BTR")
    new_feats = math.prod(s for d, s in zip(layout.dims, layout.sizes) if d not in "BTR")
    if "R" not in x.layout.dims and x.repeat > 1:
        old_feats //= x.repeat
    if "R" not in layout.dims and repeat > 1:
        new_feats //= repeat  # [B, Hkv * R, T, D] after the GQA expand: still Hkv heads of data
    if old_feats != new_feats:
        raise LiftError(f"{fx_node.target} at {source!r} changes the features per token "
                        f"({old_feats} -> {new_feats}); only views of heads are supported")
    return Tok(x.value, layout, repeat)


def _embedding(fx_node, args, kwargs, st, ctx, source):
    """A table looked up by the token ids, or by the positions (learned absolute position embeddings, GPT-2's wpe:
    the same op over the graph's ``positions`` input)."""
    weight, ids = args[0], args[1]
    if not (isinstance(weight, Param) and isinstance(ids, (Ids, Positions)) and not weight.offset):
        return NotImplemented
    if isinstance(ids, Positions) and ids.offset:
        raise LiftError(f"embedding {source!r} is looked up at the positions + {ids.offset}; the embedding op reads "
                        f"the positions themselves{_needs(aten.embedding.default)}")
    value, prefix = ("positions", "pos_embed") if isinstance(ids, Positions) else (ids.value, "embed")
    out = _emit(st, "embedding", [value], prefix, source, weights={"weight": weight.name})
    return Tok(out, _layout_of(fx_node))


def _positions(fx_node, args) -> Positions | None:
    """arange over the tokens (the position ids of a trace without cache), a constant added to it, or a view of
    it that keeps one value per token; None for any other position machinery."""
    target, val = fx_node.target, fx_node.meta.get("val")
    if not isinstance(val, torch.Tensor) or math.prod(d for d in val.shape if isinstance(d, int)) != 1 \
            or sum(not isinstance(d, int) for d in val.shape) != 1:
        return None  # not one value per token
    if target == aten.arange.default and len(args) == 1:  # arange(T): 0, 1, ..., T - 1
        return Positions()
    x = args[0] if args else None
    if not isinstance(x, Positions):
        return None
    if target in LAYOUT_OPS or target in IDENTITY_OPS:
        return x
    if target == aten.add.Tensor and isinstance(args[1], Const) and isinstance(args[1].value, int):
        return Positions(offset=x.offset + args[1].value)
    return None


def _linear(fx_node, args, kwargs, st, ctx, source):
    x, weight = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias", Const(None))
    if not (isinstance(x, Tok) and isinstance(weight, Param) and x.layout.dims[-1] == "F" and not weight.offset):
        return NotImplemented
    if isinstance(bias, Param) and bias.offset:
        return NotImplemented
    out_f, in_f = st.params[weight.name].shape
    return _emit_linear(fx_node, x, weight, bias, int(in_f), int(out_f), st, source)


def _addmm(fx_node, args, kwargs, st, ctx, source):
    """addmm(bias, x, weight) = x @ weight + bias with the weight stored [in, out]: transformers' Conv1D (GPT-2),
    a linear whose weight the graph holds transposed (``meta["transposed_weights"]``: transposed once when the
    checkpoint is read)."""
    bias, x, weight = args[:3]
    scaled = [_const(kwargs.get(k, Const(1))) for k in ("beta", "alpha")] != [1, 1]
    if scaled or not (isinstance(x, Tok) and x.layout.dims[-1] == "F" and isinstance(weight, Param)
                      and isinstance(bias, Param) and not weight.offset and not bias.offset):
        return NotImplemented
    if weight.name not in st.transposed:
        st.params[weight.name] = st.params[weight.name].t()
        st.transposed[weight.name] = []
    out_f, in_f = st.params[weight.name].shape
    out = _emit_linear(fx_node, x, weight, bias, int(in_f), int(out_f), st, source)
    st.transposed[weight.name].append(st.producer[out.value])
    return out


def _matmul(fx_node, args, kwargs, st, ctx, source):
    """x @ weight.T (Falcon's linears, written out): a linear of the weight as stored. A bias added to the product
    right after it is taken into the linear (``_add``)."""
    x, weight = args[:2]
    if not (isinstance(x, Tok) and x.layout.dims[-1] == "F" and isinstance(weight, ParamT)):
        return NotImplemented
    out_f, in_f = st.params[weight.name].shape
    return _emit_linear(fx_node, x, Param(weight.name), Const(None), int(in_f), int(out_f), st, source)


def _linear_bias(fx_node, x: Tok, bias: Param, x_fx: Any, st: _State) -> Tok | None:
    """x + bias where x is the fresh output of a linear without a bias that nothing else reads: that linear's bias
    (Falcon's ``x @ weight.T + bias``, one rounding where the model rounds the product first in 16 bits)."""
    node = st.producer.get(x.value)
    if (node is None or node.op != "linear" or "bias" in node.weights or node.outputs != [x.value] or bias.offset
            or x.value in st.splits or not isinstance(x_fx, torch.fx.Node) or _num_uses(x_fx) != 1
            or tuple(st.params[bias.name].shape) != (node.attrs["out_features"],)):
        return None
    node.weights["bias"] = bias.name
    return Tok(x.value, _layout_of(fx_node), x.repeat)


def _emit_linear(fx_node, x: Tok, weight: Param, bias: Any, in_f: int, out_f: int, st: _State, source: str) -> Tok:
    weights = {"weight": weight.name}
    if isinstance(bias, Param):
        weights["bias"] = bias.name
    prefix = source.rsplit(".", 1)[-1] if source != "<top>" else "linear"
    out = _emit(st, "linear", [x.value], prefix, source, weights=weights,
                attrs={"in_features": in_f, "out_features": out_f})
    return Tok(out, _layout_of(fx_node))


def _bounds(start: int | None, stop: int | None, size: int) -> tuple[int, int]:
    """Python slice bounds (None, negative, past the end) as 0 <= start <= stop <= size."""
    start = 0 if start is None else start + size if start < 0 else start
    stop = size if stop is None else stop + size if stop < 0 else stop
    return min(start, size), min(max(stop, start), size)


def _slice(fx_node, args, kwargs, st, ctx, source):
    defaults = [Const(0), Const(None), Const(None), Const(1)]  # dim, start, end, step
    dim, start, stop, step = (_const(a) for a in (args[1:] + defaults[len(args) - 1:]))
    val = fx_node.args[0].meta.get("val") if isinstance(fx_node.args[0], torch.fx.Node) else None
    if not isinstance(args[0], Tok) and isinstance(val, torch.Tensor) and isinstance(dim, int) and step == 1:
        size = val.shape[dim]  # a slice that keeps a whole axis (x[:, :, :, ::2] slices the others whole first)
        if start in (0, None) and (stop is None or stop >= 2**62 or isinstance(size, int) and stop >= size):
            return args[0]
    return _slice_value(fx_node, args[0], dim, start, stop, step, st, source)


def _slice_value(fx_node, x, dim, start, stop, step, st: _State, source: str, fused: bool = False):
    """x[..., start:stop:step] along FX dim ``dim``. Per-head features (D) become a ``Sub`` pattern (rotate-half
    and partial rotary), or with ``fused`` (a split / chunk of a linear's output) a per-head slice of that
    linear; flat features (F) or whole heads (H) of a linear's output become one of its split outputs."""
    if isinstance(x, Sub) and not x.neg and x.step == 1 and dim % len(x.x.layout.dims) == len(x.x.layout.dims) - 1:
        a, b = _bounds(start, stop, x.stop - x.start)
        return _sub(x.x, x.start + a, x.start + b, step)
    if not isinstance(x, Tok):
        return NotImplemented
    dim = dim % len(x.layout.dims)
    label, size = x.layout.dims[dim], x.layout.sizes[dim]
    if label == "T":
        return x if (start in (0, None) and (stop is None or stop >= 2**62) and step == 1) else NotImplemented
    a, b = _bounds(start, stop, size)
    if label == "D" and not fused:
        return _sub(x, a, b, step)
    if step != 1 or x.repeat != 1 or label not in "FHD" or label == "D" and "H" not in x.layout.dims \
            or label == "D" and "G" in x.layout.dims:
        return NotImplemented
    if (a, b) == (0, size):
        return x
    unit = x.layout.size("D") if label == "H" else 1  # the IR value is [T, (G *) H * D], heads major
    # per head: a slice of each head's features, or of each group's slots (Falcon's [q_1 .. q_R k v] per group)
    groups = x.layout.size("G")  # 1 when there are none
    per_head = x.layout.size("H") if label == "D" else groups if groups > 1 else 0
    return _split_output(fx_node, x, a * unit, b * unit, per_head, st, source)


def _sub(x: Tok, start: int, stop: int, step: int) -> Tok | Sub:
    return x if (start, stop, step) == (0, x.layout.size("D"), 1) else Sub(x, start, stop, step)


def _split_output(fx_node, x: Tok, start: int, stop: int, per_head: int, st: _State, source: str) -> Tok:
    """Features [start, stop) of a linear's output (of each of its ``per_head`` heads when set): one output of
    that linear, split when the lift ends (``_finish_splits``)."""
    split = st.splits.get(x.value)
    if split is None:
        node = st.producer.get(x.value)
        if node is None or node.op != "linear" or node.outputs != [x.value]:
            what = f"{node.op} at {node.source!r} writes" if node is not None else "no node writes"
            raise LiftError(f"module {source!r} slices the features of a value {what}, not a linear's output; the "
                            f"lifter splits only linears whose weight fuses several projections (q/k/v, gate/up)")
        split = st.splits[x.value] = _Split(node, per_head=per_head)
    if split.per_head != per_head:
        raise LiftError(f"module {source!r} slices linear {split.node.source!r}'s output both per head and as a whole")
    name = split.pieces.get((start, stop))
    if name is None:
        name = split.pieces[(start, stop)] = st.names(f"{x.value}_{start}")
    return Tok(name, _layout_of(fx_node))


def _select(fx_node, args, kwargs, st, ctx, source):
    """x.select(dim, i) over heads or a group's slots of a fused linear's output (``qkv.view(.., H, 3, D)[..., 0, :]``):
    that slice of the linear, one of its split outputs."""
    x, dim, index = args[0], _const(args[1]), _const(args[2])
    if not isinstance(x, Tok) or not isinstance(index, int):
        return NotImplemented
    dim %= len(x.layout.dims)
    if x.layout.dims[dim] != "H":
        return NotImplemented
    index %= x.layout.sizes[dim]
    return _slice_value(fx_node, x, dim, index, index + 1, 1, st, source, fused=True)


def _split(fx_node, args, kwargs, st, ctx, source):
    """split / split_with_sizes / chunk: the pieces' bounds, each taken by a getitem (``_slice_value``)."""
    x = args[0]
    if not isinstance(x, Tok):
        return NotImplemented
    dim = _const(args[2]) if len(args) > 2 else _const(kwargs.get("dim", Const(0)))
    dim %= len(x.layout.dims)
    size = x.layout.sizes[dim]
    if size < 0:
        return NotImplemented
    how = _const(args[1])
    if fx_node.target == aten.chunk.default:
        how = -(-size // how)
    sizes = how if isinstance(how, list) else [how] * (-(-size // how))
    bounds, start = [], 0
    for n in sizes:
        bounds.append((start, min(start + n, size)))
        start += n
    return Split(x, dim, tuple(bounds))


def _neg(fx_node, args, kwargs, st, ctx, source):
    x = args[0]
    if isinstance(x, Sub):
        return Sub(x.x, x.start, x.stop, x.step, not x.neg)
    return NotImplemented


def _cat(fx_node, args, kwargs, st, ctx, source):
    parts = args[0]
    if len(parts) == 2 and all(isinstance(p, HalfRope) for p in parts):
        lo, hi = parts
        ndim = fx_node.meta["val"].dim()
        last = (fx_node.args[1] if len(fx_node.args) > 1 else fx_node.kwargs.get("dim", 0)) % ndim == ndim - 1
        if lo.lo and not hi.lo and lo.x == hi.x and (lo.start, lo.stop) == (hi.start, hi.stop) and last:
            # cat(x_lo cos - x_hi sin, x_hi cos + x_lo sin) = x * cos + rotate_half(x) * sin over [start, stop)
            term = RopeTerm(lo.x, rotated=True, table=lo.table, start=lo.start, stop=lo.stop)
            return _rope(fx_node, term, lo.table, st, ctx, source)
    if len(parts) == 2 and all(isinstance(p, Sub) and p.step == 1 for p in parts):
        hi, lo = parts
        if (hi.x.value == lo.x.value and hi.neg and not lo.neg and hi.start == lo.stop
                and hi.stop - hi.start == lo.stop - lo.start):
            return Rot(lo.x, lo.start, hi.stop)  # rotate_half(x[..., lo.start:hi.stop])
        if (hi.x.value == lo.x.value and lo.neg and not hi.neg and hi.start == lo.stop
                and hi.stop - hi.start == lo.stop - lo.start):  # cat(x2, -x1) = -rotate_half(x) (NanoChat's)
            return Rot(lo.x, lo.start, hi.stop, neg=True)  # -rotate_half(x[..., lo.start:hi.stop])
    return _reassemble(fx_node, parts, st)


def _reassemble(fx_node, parts: list, st: _State):
    """cat(rope(x[..., :r]), x[..., r:]): partial rotary, where the rope op passes features r: through."""
    subs = [Sub(p, 0, p.layout.size("D")) if isinstance(p, Tok) else p for p in parts]
    subs = [p for p in subs if not isinstance(p, Sub) or p.start < p.stop]  # x[..., D:] of a full rotary: empty
    if not subs or not all(isinstance(p, Sub) and p.step == 1 and not p.neg for p in subs):
        return NotImplemented
    base, ndim = subs[0].x, fx_node.meta["val"].dim()
    if (fx_node.args[1] if len(fx_node.args) > 1 else fx_node.kwargs.get("dim", 0)) % ndim != ndim - 1:
        return NotImplemented  # not along the last (head_dim) axis
    end = 0
    for p in subs:
        same = p.x.value == base.value or (st.passthrough.get(base.value, ("", 0))[0] == p.x.value
                                           and p.start >= st.passthrough[base.value][1])
        if p.start != end or not same:
            return NotImplemented
        end = p.stop
    if end != base.layout.size("D"):
        return NotImplemented
    return Tok(base.value, _layout_of(fx_node), base.repeat)


def _stack(fx_node, args, kwargs, st, ctx, source):
    """stack((-x[..., 1::2], x[..., ::2]), -1): the GPT-J (interleaved) rotation, flattened next."""
    parts = args[0]
    dim = _const(args[1]) if len(args) > 1 else _const(kwargs.get("dim", Const(0)))
    last = dim % fx_node.meta["val"].dim() == fx_node.meta["val"].dim() - 1
    if len(parts) == 2 and all(isinstance(p, Sub) and p.step == 2 for p in parts) and last:
        odd, even = parts
        if (odd.x.value == even.x.value and odd.neg and not even.neg and odd.start == even.start + 1
                and odd.stop == even.stop and (even.stop - even.start) % 2 == 0):
            return Stacked(Rot(even.x, even.start, even.stop, interleaved=True))
    return NotImplemented


def _mul(fx_node, args, kwargs, st, ctx, source):
    a, b = args[0], args[1]
    for x, y, x_fx, y_fx in ((a, b, *fx_node.args[:2]), (b, a, *fx_node.args[1::-1])):
        if isinstance(x, Normed) and isinstance(y, Param):
            return _norm(fx_node, x, y, st, source)
        if isinstance(x, (Tok, Centered)) and isinstance(y, RmsInv) and _base(x) == _base(y.x) \
                and isinstance(x, Centered) == isinstance(y.x, Centered):
            return Normed(x.x if isinstance(x, Centered) else x, y.eps, centered=isinstance(x, Centered),
                          source=source)
        if isinstance(x, Tok) and isinstance(y, Pos) and _is_scalar(y_fx):
            return _scale(x, x_fx, float(_evaluate(y_fx, st, ctx, source)), st, source)
        if isinstance(x, Tok) and isinstance(y, Pos):
            return RopeTerm(x, rotated=False, table=y, start=0, stop=x.layout.size("D"))
        if isinstance(x, Sub) and x.step == 1 and not x.neg and isinstance(y, Pos):
            return RopeTerm(x.x, rotated=False, table=y, start=x.start, stop=x.stop)
        if isinstance(x, Rot) and isinstance(y, Pos):
            return RopeTerm(x.x, rotated=True, table=y, start=x.start, stop=x.stop, interleaved=x.interleaved,
                            neg=x.neg)
        if isinstance(y, Const) and isinstance(y.value, (int, float)) and not isinstance(y.value, bool):
            if isinstance(x, Cube):
                return Cube(x.x, x.coef * y.value)
            if isinstance(x, TanhArg) and not x.tanh:
                return TanhArg(x.x, x.a * y.value, x.b)
        if isinstance(x, Tok) and isinstance(y, OnePlusTanh):
            half = st.producer.get(x.value)
            if (half is not None and half.op == "elementwise" and half.attrs["fn"] == "scale"
                    and half.attrs["value"] == 0.5 and half.inputs == [y.x.value]):
                out = _emit(st, "activation", [y.x.value], "gelu_tanh", source, attrs={"fn": "gelu_tanh"})
                return Tok(out, y.x.layout)  # 0.5 * x * (1 + tanh(...)): the 0.5 * x node is left for _drop_dead
        if isinstance(x, Tok) and isinstance(y, Const) and isinstance(y.value, (int, float)):
            if y.value == 1:  # a multiplier left at 1 (Granite's defaults): exactly x
                return x
            out = _emit(st, "elementwise", [x.value], "scaled", source,
                        attrs={"fn": "scale", "value": float(y.value)})
            return Tok(out, x.layout)
    if isinstance(a, Normed) and isinstance(b, Const) and b.value == 1:
        return a
    if isinstance(a, Tok) and isinstance(b, Tok):
        out = _emit(st, "elementwise", [a.value, b.value], "mul", source, attrs={"fn": "mul"})
        return Tok(out, _layout_of(fx_node))
    return NotImplemented


def _base(x: Tok | Centered) -> str:
    return x.x.value if isinstance(x, Centered) else x.value


def _norm(fx_node, normed: Normed, weight: Param, st: _State, source: str) -> Tok:
    """An RMSNorm, or a LayerNorm written out (Cohere's: mean-centred, no bias), with its gain."""
    x = normed.x
    attrs: dict[str, Any] = {"eps": normed.eps}
    per_head = x.layout.dims[-1] == "D"
    if per_head:  # normalised per head (e.g. q/k norms)
        attrs["head_dim"] = x.layout.size("D")
    gain = tuple(st.params[weight.name].shape) if weight.name in st.params else None
    heads_gain = per_head and normed.centered and gain == (x.layout.size("H"), x.layout.sizes[-1])
    if gain is not None and gain != (x.layout.sizes[-1],) and not heads_gain:  # a gain the norm ops cannot apply
        raise LiftError(f"{'LayerNorm' if normed.centered else 'RMSNorm'} {'per head ' if per_head else ''}at "
                        f"{source!r} has a gain of shape {gain}; the {'layer_norm' if normed.centered else 'rms_norm'} "
                        f"op takes one of {x.layout.sizes[-1]} features, the same for every "
                        f"{'head' if per_head else 'token'}")
    if weight.offset:  # gain (offset + w), e.g. Gemma's 1 + w
        if normed.centered:  # the layer_norm op forms it in the weight's dtype (Nemotron's); code written out may not
            raise LiftError(f"LayerNorm at {source!r} has a gain of {weight.offset:g} + w computed in its own code; "
                            f"the layer_norm op takes w + offset formed in the weight's dtype, as aten.layer_norm "
                            f"callers do")
        attrs["weight_offset"] = weight.offset
    op = "layer_norm" if normed.centered else "rms_norm"
    out = _emit(st, op, [x.value], "norm", source, weights={"weight": weight.name}, attrs=attrs)
    return Tok(out, _layout_of(fx_node), x.repeat)


def _layer_norm(fx_node, args, kwargs, st, ctx, source):
    """aten.layer_norm(x, [features], weight?, bias?, eps): with or without a gain and a bias (OLMo has none)."""
    x, shape = args[0], _const(args[1])
    weight, bias, eps = (args + [Const(None), Const(None), Const(1e-5)])[2:5]
    if not (isinstance(x, Tok) and x.layout.dims[-1] in ("F", "D") and shape == [x.layout.sizes[-1]]):
        return NotImplemented
    weights, attrs = {}, {"eps": float(_const(eps))}
    if x.layout.dims[-1] == "D":  # over each head's features (Persimmon's q/k LayerNorms), one gain for every head
        attrs["head_dim"] = x.layout.size("D")
    for role, w in (("weight", weight), ("bias", bias)):
        if isinstance(w, Param) and (role == "weight" or not w.offset):
            weights[role] = w.name
        elif not (isinstance(w, Const) and w.value is None):
            return NotImplemented
    if isinstance(weight, Param) and weight.offset:  # a gain of offset + w (Nemotron's LayerNorm1P: 1 + w)
        attrs["weight_offset"] = weight.offset
    out = _emit(st, "layer_norm", [x.value], "norm", source, weights=weights, attrs=attrs)
    return Tok(out, _layout_of(fx_node), x.repeat)


def _is_scalar(fx_arg: Any) -> bool:
    """An FX value of one element and a static shape (a 0-d tensor such as an embedding scale)."""
    val = fx_arg.meta.get("val") if isinstance(fx_arg, torch.fx.Node) else None
    return (isinstance(val, torch.Tensor) and all(isinstance(d, int) for d in val.shape)
            and math.prod(val.shape) == 1)


def _evaluate(node: torch.fx.Node, st: _State, ctx: LiftContext, source: str) -> torch.Tensor:
    """The value of a constant the model computes from its buffers and literals alone (no input), on the CPU.

    The traced model is on meta, so buffers come from ``ctx.buffer`` and lifted constants from the
    exported program; a device argument is replaced by the CPU.
    """
    if node in st.evaluated:
        return st.evaluated[node]
    spec = st.inputs.get(node.name) if node.op == "placeholder" else None
    kind, target = (spec.kind, spec.target) if spec is not None else (None, None)
    if kind == torch.export.graph_signature.InputKind.CONSTANT_TENSOR and target in st.constants:
        value = st.constants[target]
    elif kind == torch.export.graph_signature.InputKind.BUFFER and not spec.persistent and ctx.buffer is not None:
        value = ctx.buffer(target)  # not stored in the checkpoint: the model computes it
    elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        args = torch.fx.node.map_arg(node.args, lambda n: _evaluate(n, st, ctx, source))
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: _evaluate(n, st, ctx, source))
        if "device" in kwargs:
            kwargs = {**kwargs, "device": torch.device("cpu")}
        value = node.target(*args, **kwargs)
    else:
        value = None
    if not isinstance(value, torch.Tensor) or value.is_meta:
        raise LiftError(f"module {source!r} multiplies per-token values by a constant whose value cannot be "
                        f"computed before running the model (it depends on {node.name}, {target or node.op}); the "
                        f"lifter folds only constants computed from the model's buffers and literals")
    st.evaluated[node] = value
    return value


def _scale(x: Tok, x_fx: torch.fx.Node, value: float, st: _State, source: str) -> Tok:
    """x * a constant: the embedding's ``scale`` when x is a fresh embedding lookup read by nothing else
    (Gemma's rows * sqrt(hidden)), else an elementwise scale."""
    embed = st.nodes[-1] if st.nodes else None
    producer = x_fx
    while producer.target in IDENTITY_OPS and _num_uses(producer) == 1:
        producer = producer.args[0]
    if (embed is not None and embed.op == "embedding" and embed.outputs == [x.value] and "scale" not in embed.attrs
            and producer.target == aten.embedding.default and _num_uses(producer) == 1):
        embed.attrs["scale"] = value
        return x
    out = _emit(st, "elementwise", [x.value], "scaled", source, attrs={"fn": "scale", "value": value})
    return Tok(out, x.layout)


def _num_uses(fx_node: torch.fx.Node) -> int:
    return sum(1 for u in fx_node.users if u.target not in IGNORED_OPS)


def _half_rope(same: Any, other: Any, lo: bool) -> HalfRope | None:
    """``same`` = x[..., half] * cos and ``other`` = x[..., other half] * sin, halves of one range [start, stop) of
    each head (``lo``: the first half's output, x_lo cos - x_hi sin; else x_hi cos + x_lo sin), or None."""
    if not (isinstance(same, RopeTerm) and isinstance(other, RopeTerm) and same.x == other.x
            and not same.rotated and not other.rotated and not same.interleaved and not other.interleaved):
        return None
    first, second = (same, other) if lo else (other, same)
    if first.stop != second.start or first.stop - first.start != second.stop - second.start:
        return None
    return HalfRope(same.x, same.table, first.start, second.stop, lo)


def _add(fx_node, args, kwargs, st, ctx, source):
    a, b = args[0], args[1]
    if isinstance(a, RopeTerm) and isinstance(b, RopeTerm) and a.x == b.x and a.rotated != b.rotated \
            and (a.start, a.stop) == (b.start, b.stop):
        plain, rotated = (b, a) if a.rotated else (a, b)
        return _rope(fx_node, rotated, plain.table, st, ctx, source)
    if _const(kwargs.get("alpha", Const(1))) == 1:
        half = _half_rope(a, b, lo=False) or _half_rope(b, a, lo=False)  # x_hi * cos + x_lo * sin
        if half is not None:
            return half
    for x, y in ((a, b), (b, a)):
        if isinstance(x, MeanSquare) and isinstance(y, Const):
            return MeanSquare(x.x, x.eps + float(y.value))
        if isinstance(x, Tok) and isinstance(y, Cube) and y.x.value == x.value:
            return TanhArg(x, 1.0, y.coef)  # x + b * x^3
        if isinstance(x, TanhArg) and x.tanh and isinstance(y, Const) and y.value == 1:
            return OnePlusTanh(x.x)
    for x, y, x_fx in ((a, b, fx_node.args[0]), (b, a, fx_node.args[1])):
        if isinstance(x, Tok) and isinstance(y, Param) and _const(kwargs.get("alpha", Const(1))) == 1:
            biased = _linear_bias(fx_node, x, y, x_fx, st)
            if biased is not None:
                return biased
    if isinstance(a, Tok) and isinstance(b, Tok):
        out = _emit(st, "elementwise", [a.value, b.value], "add", source, attrs={"fn": "add"})
        return Tok(out, _layout_of(fx_node))
    return NotImplemented


def _add_inplace(fx_node, args, kwargs, st, ctx, source):
    """a += b (Falcon's mlp_output += attention_output): the sum, which later readers of a see as well."""
    result = _add(fx_node, args, kwargs, st, ctx, source)
    if result is not NotImplemented:
        st.env[fx_node.args[0]] = result
    return result


def _sub_op(fx_node, args, kwargs, st, ctx, source):
    a, b = args[0], args[1]
    if _const(kwargs.get("alpha", Const(1))) == 1:
        half = _half_rope(a, b, lo=True)  # x_lo * cos - x_hi * sin
        if half is not None:
            return half
    if isinstance(a, Tok) and isinstance(b, Mean) and a.value == b.x.value:
        return Centered(a)  # x - mean(x): LayerNorm's centring
    return NotImplemented


def _div(fx_node, args, kwargs, st, ctx, source):
    a, b = args[0], args[1]
    # renormalised in fp32, before any cast to the activations' dtype (the moe op's order)
    if isinstance(a, TopWeights) and isinstance(b, TopWeightsSum) and b.weights == a and not (a.renormalized or a.cast):
        renormalized = TopWeights(a.scores, a.k, True, a.cast)  # weights / weights.sum(-1): they sum to 1
        if fx_node.target == aten.div_.Tensor:  # in place (Mixtral's /=): the divided tensor's later readers see it
            st.env[fx_node.args[0]] = renormalized
        return renormalized
    if isinstance(a, Tok) and isinstance(b, Const) and isinstance(b.value, (int, float)) and b.value:
        if b.value == 1:
            return a
        out = _emit(st, "elementwise", [a.value], "scaled", source, attrs={"fn": "scale", "value": 1.0 / b.value})
        return Tok(out, a.layout)  # x / c (Granite's logits_scaling): x * (1 / c)
    return NotImplemented


def _tanh(fx_node, args, kwargs, st, ctx, source):
    x = args[0]
    if isinstance(x, TanhArg) and not x.tanh:
        if math.isclose(x.a, GELU_TANH[0], rel_tol=1e-6) and math.isclose(x.b, GELU_TANH[1], rel_tol=1e-6):
            return TanhArg(x.x, x.a, x.b, tanh=True)
    if isinstance(x, Tok):  # an activation (a soft-cap of the logits is taken into the lm_head: _mark_lm_head)
        out = _emit(st, "activation", [x.value], "tanh", source, attrs={"fn": "tanh"})
        return Tok(out, x.layout)
    return NotImplemented


def _rope(fx_node, term: RopeTerm, table: Pos, st: _State, ctx: LiftContext, source: str) -> Tok | Sub:
    """x * cos + rotate(x) * sin over features [0, rotary_dim) of each head; the rest pass through."""
    x = term.x
    inv_freq_buffers = sorted(b for b in table.buffers if b.endswith("inv_freq") and "original" not in b)
    if not inv_freq_buffers and len(table.buffers) == 1:  # cos / sin read from a precomputed table (GPT-J's)
        inv_freq_buffers = sorted(table.buffers)
    if len(inv_freq_buffers) != 1:
        raise LiftError(f"rotary embedding at {source!r}: cannot tell which inv_freq buffer its cos/sin "
                        f"come from (found {inv_freq_buffers or 'none'})")
    buffer = inv_freq_buffers[0]
    if buffer not in st.rotaries:  # the rotary module rebuilt on the CPU once per table, not for every q and k
        st.rotaries[buffer] = (*ctx.rotary(buffer), ctx.long_rotary(buffer) if ctx.long_rotary is not None
                               and buffer.endswith("inv_freq") else None)
    inv_freq, scaling, long = st.rotaries[buffer]
    if not buffer.endswith("inv_freq"):
        buffer = f"{buffer}.inv_freq"  # the frequencies, not the table, are the rope op's weight
    if term.neg:  # x cos - rotate_half(x) sin: the rotation by minus each angle, i.e. by the negated frequencies
        if long is not None:
            raise LiftError(f"rotary embedding at {source!r} rotates by minus the angle with two (LongRoPE) tables")
        inv_freq, buffer = -inv_freq, f"{buffer}.negated"
    key = frozenset([buffer])
    if key not in st.rope_tables:  # LongRoPE's two tables as one [2, rotary_dim / 2] parameter
        st.params[buffer] = inv_freq if long is None else torch.stack([inv_freq, long[0]])
        st.rope_tables[key] = buffer
    num_heads, head_dim = x.layout.size("H"), x.layout.size("D")
    if "R" not in x.layout.dims:  # heads already broadcast over their query heads (Falcon's kv): the data's own
        num_heads //= x.repeat
    if term.start != 0 or 2 * inv_freq.numel() != term.stop:
        raise LiftError(f"rotary embedding at {source!r} rotates features [{term.start}, {term.stop}) of each head "
                        f"with {inv_freq.numel()} frequencies; the rope op rotates the first 2 * frequencies")
    attrs = {"num_heads": num_heads, "head_dim": head_dim, "attention_scaling": float(scaling)}
    if long is not None:
        attrs["long_from"] = long[1]
    if term.stop != head_dim:
        attrs["rotary_dim"] = term.stop
    if term.interleaved:
        attrs["interleaved"] = True
    out = _emit(st, "rope", [x.value, "positions"], "rope", source, weights={"inv_freq": buffer}, attrs=attrs)
    if term.stop == head_dim:
        return Tok(out, _layout_of(fx_node), x.repeat)
    st.passthrough[out] = (x.value, term.stop)
    return Sub(Tok(out, x.layout, x.repeat), 0, term.stop)


def _pow(fx_node, args, kwargs, st, ctx, source):
    x, p = args[0], args[1]
    if isinstance(x, Tok) and _const(p) == 2 and not _feeds_mean(fx_node):
        # squared ReLU (relu2: torch.square(relu(x))) and other squares that are not a norm's: x * x, exactly
        out = _emit(st, "elementwise", [x.value, x.value], "mul", source, attrs={"fn": "mul"})
        return Tok(out, _layout_of(fx_node))
    if isinstance(x, (Tok, Centered)) and _const(p) == 2:
        return Square(x)
    if isinstance(x, Tok) and _const(p) == 3:
        return Cube(x)
    return NotImplemented


def _square(fx_node, args, kwargs, st, ctx, source):
    return _pow(fx_node, [args[0], Const(2)], {}, st, ctx, source)


def _feeds_mean(fx_node: torch.fx.Node) -> bool:
    """Whether every reader of ``fx_node`` (through casts) is a mean: the mean of squares of a norm."""
    users = [u for u in fx_node.users if u.target not in IGNORED_OPS]
    return bool(users) and all(u.target == aten.mean.dim or u.target in IDENTITY_OPS and _feeds_mean(u) for u in users)


def _mean(fx_node, args, kwargs, st, ctx, source):
    x = args[0]
    dims = _const(args[1]) if len(args) > 1 else None
    keepdim = _const(args[2]) if len(args) > 2 else _const(kwargs.get("keepdim", Const(False)))
    inner = x.x if isinstance(x, Square) else x
    base = inner.x if isinstance(inner, Centered) else inner
    if not (isinstance(base, Tok) and dims in ([-1], [len(base.layout.dims) - 1]) and keepdim):
        return NotImplemented
    if isinstance(x, Square):
        return MeanSquare(x.x)
    return Mean(x) if isinstance(x, Tok) else NotImplemented


def _rsqrt(fx_node, args, kwargs, st, ctx, source):
    x = args[0]
    if isinstance(x, MeanSquare):
        return RmsInv(x.x, x.eps)
    return NotImplemented


def _activation(fx_node, args, kwargs, st, ctx, source):
    x = args[0]
    if not isinstance(x, Tok):
        return NotImplemented
    fn = ACTIVATION_OPS.get(fx_node.target)
    if fx_node.target == aten.gelu.default:
        fn = "gelu_tanh" if _const(kwargs.get("approximate", Const("none"))) == "tanh" else "gelu"
    out = _emit(st, "activation", [x.value], fn, source, attrs={"fn": fn})
    return Tok(out, x.layout)


def _sdpa(fx_node, args, kwargs, st, ctx, source):
    q, k, v = _scaled_by_position(*args[:3], st, ctx, source)
    if not all(isinstance(t, Tok) for t in (q, k, v)):
        return NotImplemented
    for t in (q, k, v):
        if t.layout.dims[-2:] != ("T", "D"):
            return NotImplemented
    names = ["attn_mask", "dropout_p", "is_causal"]
    extra = dict(zip(names, args[3:])) | kwargs
    mask = extra.get("attn_mask", Const(None))
    if not isinstance(mask, (Pos, Const)):
        raise LiftError(f"attention at {source!r} has a mask computed from activations; only causal "
                        f"(optionally sliding-window) masks are supported")
    if (_const(extra.get("dropout_p", Const(0.0))) or 0.0) != 0.0:
        raise LiftError(f"attention at {source!r} uses dropout; export the model in eval mode")
    head_dim = q.layout.size("D")
    enable_gqa = bool(_const(extra.get("enable_gqa", Const(False))))
    num_kv_heads = k.layout.size("H") // k.repeat
    if enable_gqa:
        num_kv_heads = k.layout.size("H")
    scale = _const(extra.get("scale", Const(None)))
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    return _emit_attention(fx_node, q, k, v, num_kv_heads, float(scale), st, ctx, source)


def _scaled_by_position(q: Any, k: Any, v: Any, st: _State, ctx: LiftContext, source: str) -> tuple[Any, Any, Any]:
    """(q, k, v) with a query multiplied by a position-derived factor that no rotation completes lifted: Ministral 3's
    attention temperature, 1 + beta log(1 + floor(p / period)) (rope_parameters' llama_4_scaling_beta and
    original_max_position_embeddings), becomes a ``position_scale`` op on the query. Any other such factor, or one on
    the key or value, stops the lift."""
    beta = period = None
    if isinstance(q, RopeTerm) and not q.rotated:  # the config read only where a query is scaled
        try:  # the attention module's own config (a text config nested in a multimodal model's)
            config = getattr(ctx.model.get_submodule(source), "config", None) or ctx.model.config
        except AttributeError:
            config = getattr(ctx.model, "config", None)
        rope = getattr(config, "rope_parameters", None) or {}
        beta, period = rope.get("llama_4_scaling_beta"), rope.get("original_max_position_embeddings")
    if (isinstance(q, RopeTerm) and not q.rotated and not q.interleaved and q.start == 0 and not q.table.buffers
            and q.stop == q.x.layout.size("D") and beta is not None and period):  # a factor of the positions alone
        out = _emit(st, "position_scale", [q.x.value, "positions"], "q_scaled", source,
                    attrs={"beta": float(beta), "period": int(period)})
        q = Tok(out, q.x.layout, q.x.repeat)
    for name, t in (("query", q), ("key", k), ("value", v)):
        if isinstance(t, RopeTerm) and not t.rotated:
            raise LiftError(f"the attention at {source!r} takes a {name} multiplied by a factor computed from the "
                            f"positions outside a rotary embedding (an attention temperature per position, "
                            f"llama_4_scaling_beta), which the attention op does not compute")
    return q, k, v


def _traced_attention(fx_node, args, kwargs, st, ctx, source):
    """One attention call through the tracer's own implementation (``attention``): its scale, soft-cap and sinks
    (a per-head weight) become the attention op's attributes and weight."""
    q, k, v, sinks, scale, softcap = args[:6]
    q, k, v = _scaled_by_position(q, k, v, st, ctx, source)
    if not all(isinstance(t, Tok) and t.layout.dims[-2:] == ("T", "D") for t in (q, k, v)):
        return NotImplemented
    if not (isinstance(sinks, Param) and not sinks.offset or isinstance(sinks, Const) and sinks.value is None):
        raise LiftError(f"the attention sinks at {source!r} are computed, not a weight; the attention op takes a "
                        f"per-head weight of sink logits")
    num_heads = q.layout.size("H")
    if isinstance(sinks, Param) and tuple(st.params[sinks.name].shape) != (num_heads,):
        raise LiftError(f"the attention sinks {sinks.name} at {source!r} have shape "
                        f"{tuple(st.params[sinks.name].shape)}; the attention op takes one per query head "
                        f"({num_heads})")
    num_kv_heads = k.layout.size("H") // k.repeat
    node_sinks = sinks.name if isinstance(sinks, Param) else None
    return _emit_attention(fx_node, q, k, v, num_kv_heads, float(_const(scale)), st, ctx, source,
                           float(_const(softcap)), node_sinks)


def _emit_attention(fx_node, q: Tok, k: Tok, v: Tok, num_kv_heads: int, scale: float, st: _State, ctx: LiftContext,
                    source: str, softcap: float = 0.0, sinks: str | None = None) -> Tok:
    module = _attention_module(ctx.model, source)
    sliding_window = _sliding_window(module, source)
    attrs = {
        "layer": st.num_attention, "num_heads": q.layout.size("H"), "num_kv_heads": num_kv_heads,
        "head_dim": q.layout.size("D"), "scale": scale,
    }
    if sliding_window:
        attrs["sliding_window"] = int(sliding_window)
    if softcap:
        attrs["softcap"] = softcap
    st.num_attention += 1
    out = _emit(st, "attention", [q.value, k.value, v.value], "attn", source, attrs=attrs,
                weights={"sinks": sinks} if sinks else None)
    return Tok(out, _layout_of(fx_node))


# --- mixture of experts: the router's arithmetic, then trace.py's moe_experts node --------------------------
def _softmax(fx_node, args, kwargs, st, ctx, source):
    """softmax(logits, -1) (in fp32) of a linear's output: a router's scores (attention's is inside SDPA)."""
    x = args[0]
    dim = _const(args[1]) if len(args) > 1 else _const(kwargs.get("dim", Const(None)))
    if isinstance(x, Tok) and x.layout.dims[-1] == "F" and dim in (-1, len(x.layout.dims) - 1):
        return Scores(x, "softmax")
    if isinstance(x, TopWeights) and x.scores.scoring == "logits" and not (x.renormalized or x.cast) \
            and dim in (-1, len(x.scores.logits.layout.dims) - 1):
        # softmax over the top-k logits (gpt-oss's router): the softmax over all experts renormalised over the
        # top k, in the logits' (the activations') dtype
        return TopWeights(x.scores, x.k, renormalized=True, cast=True)
    return NotImplemented


def _topk(fx_node, args, kwargs, st, ctx, source):
    """topk(scores, k) over the experts: a router's choice. Sigmoid scores were lifted as an activation (a shared
    expert's gate is one too): its node is dropped with the router when the experts node reads the choice."""
    x, k = args[0], _const(args[1])
    rest = dict(zip(("dim", "largest", "sorted"), args[2:])) | kwargs
    dim, largest = _const(rest.get("dim", Const(-1))), _const(rest.get("largest", Const(True)))
    if isinstance(x, Tok):
        producer = st.producer.get(x.value)
        if producer is not None and producer.op == "linear" and x.layout.dims[-1] == "F":
            x = Scores(x, "logits")  # the top-k of the router's logits, softmaxed after (gpt-oss)
        elif producer is None or producer.op != "activation" or producer.attrs["fn"] != "sigmoid":
            return NotImplemented
        else:
            x = Scores(Tok(producer.inputs[0], x.layout), "sigmoid", producer.outputs[0])
    if not (isinstance(x, Scores) and isinstance(k, int) and largest is True
            and dim in (-1, len(x.logits.layout.dims) - 1)):
        return NotImplemented
    return TopK(x, k)


def _sum(fx_node, args, kwargs, st, ctx, source):
    """weights.sum(-1, keepdim=True): the denominator of the routing weights' renormalisation."""
    x = args[0]
    dims = _const(args[1]) if len(args) > 1 else None
    keepdim = _const(args[2]) if len(args) > 2 else _const(kwargs.get("keepdim", Const(False)))
    if isinstance(x, TopWeights) and dims in ([-1], [1]) and keepdim is True:
        return TopWeightsSum(x)
    return NotImplemented


def _moe_router(fx_node, args, kwargs, st, ctx, source):
    """A router traced whole (``moe_router``): its linear emitted (taken into the moe node by the experts node), the
    (weights, experts) pair as a topk's, with the selection bias, the scaling factor and the fp32 logits."""
    x, weight, bias = args[:3]
    top_k, scoring, norm, scale, fp32, round_weights = (_const(a) for a in args[3:9])
    bias_name = (bias.name if isinstance(bias, Param) and not bias.offset
                 else next(iter(bias.buffers)) if isinstance(bias, Pos) and len(bias.buffers) == 1 else None)
    if not (isinstance(x, Tok) and x.layout.dims[-1] == "F" and isinstance(weight, Param) and not weight.offset
            and bias_name is not None and scoring in ("softmax", "sigmoid")):
        return NotImplemented
    if bias_name not in st.params:  # a buffer (GLM-4.5's, MiniMax-M2's): a moe weight, read from the checkpoint
        val = fx_node.args[2].meta["val"]
        st.params[bias_name] = torch.empty(tuple(val.shape), dtype=val.dtype, device="meta")
    num_experts, hidden = st.params[weight.name].shape
    logits = _emit(st, "linear", [x.value], "router", source, weights={"weight": weight.name},
                   attrs={"in_features": int(hidden), "out_features": int(num_experts)})
    # the weights the family keeps in fp32 whatever the model's dtype (transformers' _keep_in_fp32_modules_strict:
    # GLM-4.5's, dots1's, ERNIE 4.5 MoE's gate.weight and bias); others in the model's dtype, as transformers loads them
    keep = tuple(getattr(type(ctx.model), "_keep_in_fp32_modules_strict", None) or ())
    for name in (weight.name, bias_name):
        if any(k in name.split(".") or name.endswith("." + k) or ("." + k + ".") in name for k in keep):
            st.fp32_weights.add(name)
    scores = Scores(Tok(logits, x.layout), scoring, select_bias=bias_name, scale=float(scale), fp32=bool(fp32))
    return TopK(scores, int(top_k), TopWeights(scores, int(top_k), bool(norm), bool(round_weights)))


def _xielu(fx_node, args, kwargs, st, ctx, source):
    """The xIELU node (trace.py): an ``xielu`` op reading the module's two scalar weights and its beta and eps
    buffers (stored in the checkpoint, read from it as weights)."""
    x, alpha_p, alpha_n, beta, eps = args[:5]
    buffers = [next(iter(b.buffers)) if isinstance(b, Pos) and len(b.buffers) == 1 else None for b in (beta, eps)]
    if not (isinstance(x, Tok) and x.layout.dims[-1] == "F" and None not in buffers
            and all(isinstance(w, Param) and not w.offset for w in (alpha_p, alpha_n))):
        raise LiftError(f"xIELU at {source!r}: the xielu op takes a per-token value, the module's two scalar weights "
                        f"as stored and its beta and eps buffers")
    for name in buffers:  # read from the checkpoint as the weights are (attach_weights loads meta params by name)
        if name not in st.params:
            st.params[name] = ctx.model.get_buffer(name)
    out = _emit(st, "xielu", [x.value], "act", source, weights={"alpha_p": alpha_p.name, "alpha_n": alpha_n.name,
                                                                 "beta": buffers[0], "eps": buffers[1]})
    return Tok(out, x.layout, x.repeat)


def _moe_experts(fx_node, args, kwargs, st, ctx, source):
    """The experts node (trace.py): with the router that chose its experts, one ``moe`` op. The router's linear
    (and a sigmoid's activation) were emitted as IR nodes on the way: they are taken back into the moe node."""
    x, experts, weights, w_gate_up, w_down, activation = args[:6]
    extra = dict(zip(("b_gate_up", "b_down", "layout", "swiglu_alpha", "swiglu_limit"), args[6:])) | kwargs
    b_gate_up, b_down = extra.get("b_gate_up", Const(None)), extra.get("b_down", Const(None))
    layout = _const(extra.get("layout", Const("stacked")))
    if not (isinstance(x, Tok) and x.layout.dims[-1] == "F" and isinstance(experts, TopIndices)
            and isinstance(weights, TopWeights) and isinstance(w_gate_up, Param) and isinstance(w_down, Param)
            and not w_gate_up.offset and not w_down.offset
            and all(isinstance(b, Const) and b.value is None or isinstance(b, Param) and not b.offset
                    for b in (b_gate_up, b_down))):
        return NotImplemented
    scores = experts.scores
    if weights.scores != scores or weights.k != experts.k:
        raise LiftError(f"the experts at {source!r} are weighted by another router's scores than the one that chose "
                        f"them; the moe op weights each expert by its own routing score")
    if scores.scoring == "logits" and not weights.renormalized:
        raise LiftError(f"the experts at {source!r} are weighted by their raw top-k router logits; the moe op weights "
                        f"them by the scores' softmax (over all experts, or over the top k)")
    router = st.producer.get(scores.logits.value)
    if (router is None or router.op != "linear" or router.inputs != [x.value] or router.outputs != [scores.logits.value]
            or scores.logits.value in st.splits):
        raise LiftError(f"the experts at {source!r} are routed by scores of something other than a linear of their "
                        f"own input; the moe op's router is x @ gate_weight.T (+ bias)")
    taken = {scores.logits.value, scores.sigmoid}
    reader = next((n for n in st.nodes if taken & set(n.inputs) and n.outputs[0] != scores.sigmoid), None)
    if reader is not None:
        raise LiftError(f"the router logits of the experts at {source!r} are also read by {reader.op} at "
                        f"{reader.source!r}; the moe op keeps them to itself")
    if layout == "in_out_interleaved":  # gpt-oss: held as the moe op's layout, converted once when read
        if not isinstance(b_gate_up, Param):
            raise LiftError(f"the experts at {source!r} store gate and up interleaved without a gate/up bias; the "
                            f"lifter converts that layout with its bias (gpt-oss)")
        _moe_in_out_interleaved(st, w_gate_up.name, w_down.name, b_gate_up.name)
    elif layout != "stacked":
        raise LiftError(f"the experts at {source!r} have weights laid out as {layout!r}; the lifter knows 'stacked' "
                        f"and 'in_out_interleaved'")
    num_experts, two_inter, hidden = st.params[w_gate_up.name].shape
    if tuple(st.params[router.weights["weight"]].shape) != (num_experts, hidden):
        raise LiftError(f"the router of the experts at {source!r} scores {router.attrs['out_features']} experts, "
                        f"their weights hold {num_experts}")
    st.nodes = [n for n in st.nodes if not taken & set(n.outputs)]
    moe_weights = {"gate_weight": router.weights["weight"], "w_gate_up": w_gate_up.name, "w_down": w_down.name}
    if "bias" in router.weights:
        moe_weights["gate_bias"] = router.weights["bias"]
    if scores.select_bias is not None:
        moe_weights["select_bias"] = scores.select_bias
    for role, b in (("b_gate_up", b_gate_up), ("b_down", b_down)):
        if isinstance(b, Param):
            moe_weights[role] = b.name
    attrs = {"num_experts": int(num_experts), "top_k": experts.k,
             "scoring": "softmax" if scores.scoring == "logits" else scores.scoring,
             "norm_topk_prob": weights.renormalized, "activation": _const(activation),
             "intermediate_size": int(two_inter) // 2}
    if attrs["activation"] == "clamped_swiglu":
        attrs["swiglu_alpha"] = float(_const(extra["swiglu_alpha"]))
        attrs["swiglu_limit"] = float(_const(extra["swiglu_limit"]))
    if weights.cast:
        attrs["round_weights"] = True
    if scores.scale != 1.0:
        attrs["routed_scaling_factor"] = scores.scale
    if scores.fp32:
        attrs["router_fp32"] = True
    block = ".".join(p for p, q in zip(router.source.split("."), source.split(".")) if p == q)  # their parent
    out = _emit(st, "moe", [x.value], "moe", block or source, weights=moe_weights, attrs=attrs)
    return Tok(out, _layout_of(fx_node))


def _moe_in_out_interleaved(st: _State, w_gate_up: str, w_down: str, b_gate_up: str) -> None:
    """gpt-oss's experts as stored (gate_up [E, hidden, 2I] with gate / up columns interleaved, down [E, I, hidden],
    b_gate_up [E, 2I] interleaved) are held in the moe op's layout (gate_up [E, 2I, hidden]: gate rows, then up rows;
    down [E, hidden, I]; b_gate_up gate then up); ``meta["moe_weight_layouts"]`` tells the checkpoint reader
    (``builder/checkpoint.py``) to convert them once."""
    layouts = st.moe_layouts
    for name, kind in ((w_gate_up, "gate_up_in_out_interleaved"), (w_down, "down_in_out"),
                       (b_gate_up, "bias_interleaved")):
        if layouts.get(name, kind) != kind:
            raise LiftError(f"weight {name} is read by experts both as {layouts[name]} and as {kind}")
        if name not in layouts:
            layouts[name] = kind
            meta = st.params[name]
            st.params[name] = torch.empty(moe_layout_shape(kind, tuple(meta.shape)), dtype=meta.dtype, device="meta")


def moe_layout_shape(kind: str, stored: tuple[int, ...]) -> tuple[int, ...]:
    """The moe op's shape of a weight stored as ``kind`` (``_moe_in_out_interleaved``) with shape ``stored``."""
    if kind == "bias_interleaved":
        return stored
    return (stored[0], stored[2], stored[1])  # [E, in, out] -> [E, out, in]


def moe_layout_convert(kind: str, tensor: torch.Tensor) -> torch.Tensor:
    """A stored expert weight (``_moe_in_out_interleaved``) in the moe op's layout: [E, in, out] -> [E, out, in], and
    gate / up interleaved -> gate rows, then up rows."""
    if kind == "bias_interleaved":
        return torch.cat((tensor[:, 0::2], tensor[:, 1::2]), dim=1).contiguous()
    t = tensor.transpose(1, 2)
    if kind == "gate_up_in_out_interleaved":
        t = torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)
    return t.contiguous()


LAYER_TYPES = ("full_attention", "sliding_attention")  # config.layer_types entries the attention op covers


def _sliding_window(module: Any, source: str) -> int | None:
    """The attention module's sliding window. Where the config has ``layer_types``, they say which layers
    slide (a module may keep the config's window on its full-attention layers too, as EXAONE 4's does); else
    the module's own attribute, else the config (Mistral keeps it only there)."""
    if module is None:
        return None
    config, layer = getattr(module, "config", None), getattr(module, "layer_idx", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer is not None and layer < len(layer_types):
        if layer_types[layer] not in LAYER_TYPES:
            raise LiftError(f"attention at {source!r} is of layer type {layer_types[layer]!r} (config.layer_types); "
                            f"the attention op covers {', '.join(LAYER_TYPES)}")
        if layer_types[layer] == "full_attention":
            return None
        return getattr(module, "sliding_window", None) or config.sliding_window
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    if config is None or not getattr(config, "sliding_window", None):
        return None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return config.sliding_window


def _attention_module(model: torch.nn.Module, path: str) -> torch.nn.Module | None:
    try:
        return model.get_submodule(path) if path != "<top>" else model
    except AttributeError:
        return None


RULES: dict[Any, Callable] = {
    **{op: _identity for op in IDENTITY_OPS},
    **{op: _layout for op in LAYOUT_OPS},
    aten.embedding.default: _embedding,
    aten.linear.default: _linear,
    aten.addmm.default: _addmm,
    aten.slice.Tensor: _slice,
    aten.neg.default: _neg,
    aten.cat.default: _cat,
    aten.mul.Tensor: _mul,
    aten.add.Tensor: _add,
    aten.pow.Tensor_Scalar: _pow,
    aten.square.default: _square,
    aten.mean.dim: _mean,
    aten.rsqrt.default: _rsqrt,
    aten.sub.Tensor: _sub_op,
    aten.div.Tensor: _div,
    aten.div_.Tensor: _div,
    aten.softmax.int: _softmax,
    aten._softmax.default: _softmax,
    aten.topk.default: _topk,
    aten.sum.dim_IntList: _sum,
    MOE_EXPERTS_OP: _moe_experts,
    XIELU_OP: _xielu,
    MOE_ROUTER_OP: _moe_router,
    aten.tanh.default: _tanh,
    aten.stack.default: _stack,
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split,
    aten.chunk.default: _split,
    aten.layer_norm.default: _layer_norm,
    aten.scaled_dot_product_attention.default: _sdpa,
    ATTENTION_OP: _traced_attention,
    aten.matmul.default: _matmul,
    aten.add_.Tensor: _add_inplace,
    aten.select.int: _select,
    aten.gelu.default: _activation,
    **{op: _activation for op in ACTIVATION_OPS},
}
