"""Lift a torch.export graph of a Hugging Face causal LM into the project's coarse IR.

The lifter is an abstract interpreter over the exported ATen graph. Each FX node gets an abstract
value saying what it is in IR terms:

- ``Tok``: a per-token activation backed by an IR value, plus how the FX tensor lays it out
  (``[1, T, F]``, ``[1, T, H, D]``, ``[1, H, T, D]``, ...).
- ``Pos``: anything computed only from positions, shapes and buffers (position ids, causal masks,
  rotary cos/sin tables). The runtime recomputes these itself, so they never become IR nodes.
- ``Param``: a weight.
- partial patterns (``Half``, ``Rot``, ``RmsInv``, ...): intermediate steps of RoPE and RMSNorm,
  recognised from their arithmetic, not from module or class names.

Any op applied to a per-token value that no rule recognises stops the lift with a ``LiftError``
naming the ATen op and the module path it came from. No table is keyed on architecture: a family
that composes the same primitives (embedding, RMSNorm, linear, rotate-half RoPE, SDPA, activations,
residual adds) lifts without new code.
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

    ``dims`` labels each FX dimension: B (batch of 1), T (tokens), F (flat features), H (heads),
    R (heads repeated for GQA), D (head dim). The IR value behind it is always [T, H * D] with
    heads major, so moving T around (transpose) or splitting F into H, D (view) never changes data.
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
class Param:
    name: str


@dataclass(frozen=True)
class Const:
    value: Any


# Partial patterns.
@dataclass(frozen=True)
class Half:  # x[..., :D/2] (lo) or x[..., D/2:] (hi), possibly negated
    x: Tok
    hi: bool
    neg: bool = False


@dataclass(frozen=True)
class Rot:  # rotate_half(x) = cat(-x_hi, x_lo)
    x: Tok


@dataclass(frozen=True)
class RopeTerm:  # x * cos, or rotate_half(x) * sin
    x: Tok
    rotated: bool
    table: Pos


@dataclass(frozen=True)
class Square:  # x ** 2
    x: Tok


@dataclass(frozen=True)
class MeanSquare:  # mean(x ** 2, -1) (+ eps)
    x: Tok
    eps: float = 0.0


@dataclass(frozen=True)
class RmsInv:  # rsqrt(mean(x ** 2, -1) + eps)
    x: Tok
    eps: float


@dataclass(frozen=True)
class Normed:  # x * rsqrt(mean(x ** 2) + eps), weight not applied yet
    x: Tok
    eps: float


PATTERNS = (Half, Rot, RopeTerm, Square, MeanSquare, RmsInv, Normed)


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
    aten.expand.default, aten.flatten.using_ints,
}
IGNORED_OPS = {
    aten._assert_tensor_metadata.default, aten.sym_size.int, aten._assert_scalar.default,
    aten.sym_constrain_range_for_size.default,
}
ACTIVATION_OPS = {
    aten.silu.default: "silu", aten.relu.default: "relu",
}


@dataclass
class LiftContext:
    model: torch.nn.Module  # the traced model (on meta), for module attributes such as sliding_window
    rotary: Callable[[str], tuple[torch.Tensor, float]]  # buffer target -> (inv_freq, attention_scaling)


@dataclass
class _State:
    env: dict[torch.fx.Node, Any] = field(default_factory=dict)
    nodes: list[Node] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    names: NameGen = field(default_factory=NameGen)
    num_attention: int = 0
    rope_tables: dict[frozenset[str], str] = field(default_factory=dict)  # buffers -> inv_freq param


def lift(exported: torch.export.ExportedProgram, ctx: LiftContext) -> Graph:
    """Lift an exported ``model(input_ids=...) -> logits`` program into a Graph."""
    gm = exported.graph_module
    sig = exported.graph_signature
    placeholders = {s.arg.name: s for s in sig.input_specs}
    state_dict = exported.state_dict
    st = _State(names=NameGen({"input_ids", "positions"}))

    for fx_node in gm.graph.nodes:
        if fx_node.op == "placeholder":
            spec = placeholders[fx_node.name]
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
            _mark_lm_head(st, logits.value)
    graph = Graph(st.nodes, ["input_ids", "positions"], [], _used_params(st))
    graph.outputs = [st.nodes[-1].outputs[0]]
    graph.check()
    return graph


def _used_params(st: _State) -> dict[str, torch.Tensor]:
    used = {w for n in st.nodes for w in n.weights.values()}
    return {k: v for k, v in st.params.items() if k in used}


def _mark_lm_head(st: _State, value: str) -> None:
    last = st.nodes[-1]
    if last.op != "linear" or last.outputs != [value]:
        raise LiftError("the model's logits are not produced by a final linear layer (lm_head)")
    last.op = "lm_head"
    last.attrs = {}


def _module_path(fx_node: torch.fx.Node) -> str:
    stack = fx_node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else "<top>"


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
    labels_after = {0: (), 1: ("D",) if len(before) >= 2 else ("F",), 2: ("H", "D")}.get(len(after))
    if labels_before is None or labels_after is None or (len(before) >= 2 and len(after) != 1):
        raise LiftError(f"unsupported tensor layout {shape} from {fx_node.target} at {_module_path(fx_node)}")
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
        raise LiftError(f"getitem on {base!r} at {source}")
    if not (_is_token_like(args) or _is_token_like(list(kwargs.values()))):
        # Only positions, shapes, buffers and constants feed this op: position machinery.
        return _pos_union(args + list(kwargs.values()))
    rule = RULES.get(target)
    if rule is None:
        raise LiftError(
            f"unsupported op {target} applied to per-token values at module {source!r}; "
            f"the lifter knows: {', '.join(sorted(str(t) for t in RULES))}"
        )
    result = rule(fx_node, args, kwargs, st, ctx, source)
    if result is NotImplemented:
        raise LiftError(f"op {target} at module {source!r} is used in a pattern the lifter does not "
                        f"know (operands: {', '.join(type(a).__name__ for a in args)})")
    return result


def _const(v: Any) -> Any:
    if isinstance(v, list):
        return [_const(x) for x in v]
    return v.value if isinstance(v, Const) else NotImplemented


# --- rules: one per ATen op, each returning an abstract value or NotImplemented -----------------
def _identity(fx_node, args, kwargs, st, ctx, source):
    x = args[0]
    if isinstance(x, Tok):
        return Tok(x.value, _layout_of(fx_node), x.repeat)
    return x


def _layout(fx_node, args, kwargs, st, ctx, source):
    x = args[0]
    if not isinstance(x, Tok):
        return NotImplemented
    layout = _layout_of(fx_node)
    repeat = x.repeat
    if "R" in layout.dims:  # expand [B, Hkv, R, T, D] for grouped-query attention
        repeat = layout.size("R")
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
    weight, ids = args[0], args[1]
    if not (isinstance(weight, Param) and isinstance(ids, Ids)):
        return NotImplemented
    out = _emit(st, "embedding", [ids.value], "embed", source, weights={"weight": weight.name})
    return Tok(out, _layout_of(fx_node))


def _linear(fx_node, args, kwargs, st, ctx, source):
    x, weight = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias", Const(None))
    if not (isinstance(x, Tok) and isinstance(weight, Param) and x.layout.dims[-1] == "F"):
        return NotImplemented
    weights = {"weight": weight.name}
    if isinstance(bias, Param):
        weights["bias"] = bias.name
    out_f, in_f = st.params[weight.name].shape
    prefix = source.rsplit(".", 1)[-1] if source != "<top>" else "linear"
    out = _emit(st, "linear", [x.value], prefix, source, weights=weights,
                attrs={"in_features": int(in_f), "out_features": int(out_f)})
    return Tok(out, _layout_of(fx_node))


def _slice(fx_node, args, kwargs, st, ctx, source):
    x = args[0]
    dim, start, end = (_const(a) for a in (args + [Const(0), Const(None), Const(None)])[1:4])
    if not isinstance(x, Tok):
        return NotImplemented
    dim = dim % len(x.layout.dims)
    label = x.layout.dims[dim]
    end = 2**63 - 1 if end is None else end
    start = 0 if start is None else start
    if label == "T" and start == 0 and end >= 2**62:
        return x  # x[:, 0:] on the token axis: a no-op
    if label == "D":
        d = x.layout.size("D")
        if (start, min(end, d)) == (0, d // 2):
            return Half(x, hi=False)
        if start == d // 2 and end >= d:
            return Half(x, hi=True)
    return NotImplemented


def _neg(fx_node, args, kwargs, st, ctx, source):
    x = args[0]
    if isinstance(x, Half):
        return Half(x.x, x.hi, not x.neg)
    return NotImplemented


def _cat(fx_node, args, kwargs, st, ctx, source):
    parts = args[0]
    if (len(parts) == 2 and all(isinstance(p, Half) for p in parts) and parts[0].x == parts[1].x
            and (parts[0].hi, parts[0].neg, parts[1].hi, parts[1].neg) == (True, True, False, False)):
        return Rot(parts[0].x)
    return NotImplemented


def _mul(fx_node, args, kwargs, st, ctx, source):
    a, b = args[0], args[1]
    for x, y in ((a, b), (b, a)):
        if isinstance(x, Normed) and isinstance(y, Param):
            return _rms_norm(fx_node, x, y, st, source)
        if isinstance(x, Tok) and isinstance(y, RmsInv) and y.x.value == x.value:
            return Normed(x, y.eps)
        if isinstance(x, Tok) and isinstance(y, Pos):
            return RopeTerm(x, rotated=False, table=y)
        if isinstance(x, Rot) and isinstance(y, Pos):
            return RopeTerm(x.x, rotated=True, table=y)
        if isinstance(x, Tok) and isinstance(y, Const) and isinstance(y.value, (int, float)):
            out = _emit(st, "elementwise", [x.value], "scaled", source,
                        attrs={"fn": "scale", "value": float(y.value)})
            return Tok(out, x.layout)
    if isinstance(a, Normed) and isinstance(b, Const) and b.value == 1:
        return a
    if isinstance(a, Tok) and isinstance(b, Tok):
        out = _emit(st, "elementwise", [a.value, b.value], "mul", source, attrs={"fn": "mul"})
        return Tok(out, _layout_of(fx_node))
    return NotImplemented


def _rms_norm(fx_node, normed: Normed, weight: Param, st: _State, source: str) -> Tok:
    x = normed.x
    attrs: dict[str, Any] = {"eps": normed.eps}
    if x.layout.dims[-1] == "D":  # normalised per head (e.g. q/k norms)
        attrs["head_dim"] = x.layout.size("D")
    out = _emit(st, "rms_norm", [x.value], "norm", source, weights={"weight": weight.name}, attrs=attrs)
    return Tok(out, _layout_of(fx_node), x.repeat)


def _add(fx_node, args, kwargs, st, ctx, source):
    a, b = args[0], args[1]
    if isinstance(a, RopeTerm) and isinstance(b, RopeTerm) and a.x == b.x and a.rotated != b.rotated:
        return _rope(fx_node, a.x, a.table if not a.rotated else b.table, st, ctx, source)
    for x, y in ((a, b), (b, a)):
        if isinstance(x, MeanSquare) and isinstance(y, Const):
            return MeanSquare(x.x, x.eps + float(y.value))
    if isinstance(a, Tok) and isinstance(b, Tok):
        out = _emit(st, "elementwise", [a.value, b.value], "add", source, attrs={"fn": "add"})
        return Tok(out, _layout_of(fx_node))
    return NotImplemented


def _rope(fx_node, x: Tok, table: Pos, st: _State, ctx: LiftContext, source: str) -> Tok:
    inv_freq_buffers = sorted(b for b in table.buffers if b.endswith("inv_freq") and "original" not in b)
    if len(inv_freq_buffers) != 1:
        raise LiftError(f"rotary embedding at {source!r}: cannot tell which inv_freq buffer its cos/sin "
                        f"come from (found {inv_freq_buffers or 'none'})")
    buffer = inv_freq_buffers[0]
    key = frozenset([buffer])
    if key not in st.rope_tables:
        inv_freq, scaling = ctx.rotary(buffer)
        st.params[buffer] = inv_freq
        st.rope_tables[key] = buffer
    _, scaling = ctx.rotary(buffer)
    num_heads, head_dim = x.layout.size("H"), x.layout.size("D")
    out = _emit(st, "rope", [x.value, "positions"], "rope", source, weights={"inv_freq": buffer},
                attrs={"num_heads": num_heads, "head_dim": head_dim, "attention_scaling": float(scaling)})
    return Tok(out, _layout_of(fx_node), x.repeat)


def _pow(fx_node, args, kwargs, st, ctx, source):
    x, p = args[0], args[1]
    if isinstance(x, Tok) and _const(p) == 2:
        return Square(x)
    return NotImplemented


def _mean(fx_node, args, kwargs, st, ctx, source):
    x = args[0]
    dims = _const(args[1]) if len(args) > 1 else None
    keepdim = _const(args[2]) if len(args) > 2 else _const(kwargs.get("keepdim", Const(False)))
    if isinstance(x, Square) and dims in ([-1], [len(x.x.layout.dims) - 1]) and keepdim:
        return MeanSquare(x.x)
    return NotImplemented


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
    q, k, v = args[:3]
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
    num_heads = q.layout.size("H")
    enable_gqa = bool(_const(extra.get("enable_gqa", Const(False))))
    num_kv_heads = k.layout.size("H") // k.repeat
    if enable_gqa:
        num_kv_heads = k.layout.size("H")
    scale = _const(extra.get("scale", Const(None)))
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    module = _attention_module(ctx.model, source)
    sliding_window = _sliding_window(module)
    attrs = {
        "layer": st.num_attention, "num_heads": num_heads, "num_kv_heads": num_kv_heads,
        "head_dim": head_dim, "scale": float(scale),
    }
    if sliding_window:
        attrs["sliding_window"] = int(sliding_window)
    st.num_attention += 1
    out = _emit(st, "attention", [q.value, k.value, v.value], "attn", source, attrs=attrs)
    return Tok(out, _layout_of(fx_node))


def _sliding_window(module: Any) -> int | None:
    """The attention module's sliding window: its own attribute where the model sets one, else from the
    config (per layer through ``layer_types`` where present; Mistral keeps it only in its config)."""
    if module is None:
        return None
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    config, layer = getattr(module, "config", None), getattr(module, "layer_idx", None)
    if config is None or not getattr(config, "sliding_window", None):
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer is not None:
        return config.sliding_window if layer_types[layer] == "sliding_attention" else None
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
    aten.slice.Tensor: _slice,
    aten.neg.default: _neg,
    aten.cat.default: _cat,
    aten.mul.Tensor: _mul,
    aten.add.Tensor: _add,
    aten.pow.Tensor_Scalar: _pow,
    aten.mean.dim: _mean,
    aten.rsqrt.default: _rsqrt,
    aten.scaled_dot_product_attention.default: _sdpa,
    aten.gelu.default: _activation,
    **{op: _activation for op in ACTIVATION_OPS},
}
