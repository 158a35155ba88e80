"""Trace a Hugging Face causal LM with torch.export on the meta device, then lift it to the IR.

No weights are read here: the model is built from its config on the meta device, exported with a
dynamic sequence length, and lifted. The builder attaches real weights afterwards.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import logging
import math
import time
import types
import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from kernels.torch_ops import clamped_swiglu
from passes.ir import ACTIVATIONS, Graph
from passes.lift import LiftContext, LiftError, attention, lift, moe_experts, moe_router, xielu

log = logging.getLogger(__name__)

# Rotary variants the rope op computes: frequencies that do not depend on the sequence length, and LongRoPE's two
# tables (the second for positions from original_max_position_embeddings on, see ``longrope_from``).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


# Config settings whose attention the IR's attention op does not compute: what each adds, refused before tracing.
UNSUPPORTED_ATTENTION = {
    "alibi": "ALiBi position biases added to the attention scores",
}
# Layer types (config.layer_types) whose token mixing is not attention over a KV cache: what each is, refused
# before tracing (their modeling code would take torch.export long to trace, only to stop at its first op).
UNSUPPORTED_LAYER_TYPES = {
    "linear_attention": "linear attention (Gated DeltaNet, lightning attention: a recurrent state per sequence "
                        "in place of a KV cache)",
}


def build_meta_model(config) -> torch.nn.Module:
    """Instantiate the HF modeling code for ``config`` with no storage behind its weights.

    Attention is traced as SDPA where the model takes it. A model class that refuses SDPA computes attention its
    own way (score soft-capping, attention sinks): it is built with the tracer's attention implementation instead
    (``ATTENTION_IMPLEMENTATION``), which makes each attention call one node carrying what it adds.
    """
    from transformers import AutoModelForCausalLM

    architecture = (getattr(config, "architectures", None) or [None])[0]
    name = f"{architecture} (model_type {config.model_type!r})" if architecture else f"model_type {config.model_type!r}"
    check_attention(config, name)
    config = copy.deepcopy(config)  # the experts' implementation is set on the model's config (trace_experts)
    try:
        try:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
        except ValueError as e:
            if not refuses_sdpa(e):
                raise
            register_traced_attention()
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION_IMPLEMENTATION,
                                                         dtype=torch.float32)
    except Exception as e:  # the modeling code's checks of the config (ValueError, AssertionError, ImportError, ...)
        reason = " ".join(str(e).split())
        raise LiftError(f"transformers cannot build the {name} model from its config.json "
                        f"({type(e).__name__}: {reason[:300]})") from e
    model.eval()
    trace_experts(model)
    trace_routers(model)
    trace_xielu(model)
    return model


def refuses_sdpa(error: Exception) -> bool:
    """Whether transformers refused to build a model because its class does not take SDPA attention."""
    reason = " ".join(str(error).split())
    return isinstance(error, ValueError) and ("scaled_dot_product_attention" in reason or "sdpa" in reason.lower())


def check_attention(config, name: str) -> None:
    """Refuse, before tracing, attention the attention op does not compute (it would trace as SDPA with a mask the
    lifter takes for a causal one)."""
    for key, what in UNSUPPORTED_ATTENTION.items():
        if getattr(config, key, None):
            raise LiftError(f"{name} has {key} = {getattr(config, key)!r} in its config.json: {what}, which the "
                            f"attention op does not compute (it takes a causal mask, a sliding window, a soft-cap "
                            f"and attention sinks); the model would need an attention op with position biases")
    layer_types = getattr(config, "layer_types", None) or []
    for kind, what in UNSUPPORTED_LAYER_TYPES.items():
        layers = [i for i, t in enumerate(layer_types) if t == kind]
        if layers:
            raise LiftError(f"{name} has {kind} layers ({', '.join(map(str, layers[:8]))}"
                            f"{', ...' if len(layers) > 8 else ''} in layer_types): {what}, which the IR has no op "
                            f"for")


# --- attention a model computes its own way -----------------------------------------------------------------
# A model class that refuses SDPA (transformers' _supports_sdpa = False) computes attention in its own eager code:
# score soft-capping (Gemma 2), attention sinks (gpt-oss). It is traced with this attention implementation
# instead, registered with transformers' attention interface: each call one ``llm_builder::attention`` node with the
# scale, the soft-cap and the sinks the model hands its attention function. No mask is made for an implementation
# without a mask function of its own (transformers' masking utils): the node is causal, its sliding window read by
# the lifter from the calling module, as for SDPA.
ATTENTION_IMPLEMENTATION = "llm_builder_trace"


def _traced_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                              softcap: float | None = None, s_aux: torch.Tensor | None = None,
                              **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q [B, H, T, D], k, v [B, Hkv, T, D] -> ([B, T, H, D], None)."""
    where = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
    if dropout:
        raise LiftError(f"attention of {where} uses dropout {dropout}; export the model in eval mode")
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        raise LiftError(f"attention of {where} is not causal (bidirectional); the attention op is causal")
    if kwargs.get("position_bias") is not None:
        raise LiftError(f"attention of {where} adds a position bias to its scores; the attention op has none")
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    return attention(query, key, value, s_aux, scale, float(softcap or 0.0)), None


def register_traced_attention() -> None:
    """Make ``ATTENTION_IMPLEMENTATION`` an attention implementation transformers' models can be built with."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_IMPLEMENTATION, _traced_attention_forward)


# --- mixture-of-experts blocks ----------------------------------------------------------------------------
# transformers (>= 5) stores a MoE block's experts as one module of stacked weights whose forward it picks from its
# experts interface (``config._experts_implementation``: eager, grouped_mm, batched_mm, ...); each of those
# dispatches tokens with data-dependent ops (nonzero, sort, histc, index_add). For tracing, the experts modules run
# this implementation instead: one ``llm_builder::moe_experts`` node the lifter turns, with the router before it,
# into a ``moe`` op. The router itself (linear, softmax / sigmoid, top-k, renormalisation) is traced as usual.
EXPERTS_IMPLEMENTATION = "llm_builder_trace"
# attributes transformers' @use_experts_implementation gives an experts module, saying how its weights are laid out
EXPERTS_LAYOUT = ("has_gate", "has_bias", "is_transposed", "is_concatenated")


def _traced_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    if self.llm_builder_activation == "clamped_swiglu":  # gpt-oss: [in, out] weights, gate / up interleaved, biases
        return moe_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                           "clamped_swiglu", self.gate_up_proj_bias, self.down_proj_bias, "in_out_interleaved",
                           float(self.alpha), float(self.limit))
    return moe_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                       self.llm_builder_activation)


def _is_clamped_swiglu(module: torch.nn.Module) -> bool:
    """Whether the experts module gates as gpt-oss's does: gate and up interleaved in gate_up ([..., ::2] and
    [..., 1::2]), (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit), for its own
    ``alpha`` and ``limit`` (tried on values past the limit, on the CPU)."""
    alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
    if not (isinstance(alpha, (int, float)) and isinstance(limit, (int, float)) and limit > 0):
        return False
    gate_up = torch.linspace(-2.0 * limit, 2.0 * limit, 2 * 97).reshape(1, -1)
    gate_up = gate_up[:, torch.randperm(gate_up.shape[1], generator=torch.Generator().manual_seed(0))]
    try:
        got = module._apply_gate(gate_up)
    except Exception:  # a gating that needs more than the tensor
        return False
    want = clamped_swiglu(gate_up[..., ::2], gate_up[..., 1::2], float(alpha), float(limit))
    return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got, want, rtol=1e-5,
                                                                                         atol=1e-6)


def trace_experts(model: torch.nn.Module) -> int:
    """Make every experts module of ``model`` trace as one ``moe_experts`` node; returns how many there are.

    Experts modules are found by the layout attributes transformers' experts interface gives them, not by class
    name; one whose layout or gating the moe op does not cover stops the trace with a LiftError saying what.
    """
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, _default_apply_gate
    except ImportError:  # transformers 4.x: no experts interface (its MoE blocks keep per-expert modules)
        return 0

    found = 0
    for path, module in model.named_modules():
        if not all(hasattr(module, a) for a in EXPERTS_LAYOUT):
            continue
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        oss = (module.has_gate and module.has_bias and module.is_transposed and not module.is_concatenated
               and not getattr(module, "has_post_expert_norm", False) and _is_clamped_swiglu(module))
        if oss:  # gpt-oss: gate_up_proj [E, hidden, 2I] (gate / up columns interleaved), down_proj [E, I, hidden]
            biases = getattr(module, "gate_up_proj_bias", None), getattr(module, "down_proj_bias", None)
            problems = [] if (
                isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3
                and down.dim() == 3 and gate_up.shape[0] == down.shape[0] and gate_up.shape[2] == 2 * down.shape[1]
                and gate_up.shape[1] == down.shape[2] and all(isinstance(b, torch.Tensor) for b in biases)
                and tuple(biases[0].shape) == (gate_up.shape[0], gate_up.shape[2])
                and tuple(biases[1].shape) == (down.shape[0], down.shape[2])) else [
                "weights other than gate_up_proj [experts, hidden, 2 * intermediate], down_proj [experts, "
                "intermediate, hidden] and their biases"]
            activation = "clamped_swiglu"
        else:
            problems = [what for what, bad in (
                ("no gate projection (an up projection only)", not module.has_gate),
                ("biases", module.has_bias),
                ("weights stored transposed ([experts, in, out])", module.is_transposed),
                ("gate and up rows interleaved", not module.is_concatenated),
                ("a norm after each expert", getattr(module, "has_post_expert_norm", False)),
                ("a gating of its own (it overrides _apply_gate)", getattr(type(module), "_apply_gate", None)
                 is not _default_apply_gate),
            ) if bad]
            if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3
                    and down.dim() == 3 and gate_up.shape[0] == down.shape[0]
                    and gate_up.shape[1] == 2 * down.shape[2] and gate_up.shape[2] == down.shape[1]):
                problems.append("weights other than gate_up_proj [experts, 2 * intermediate, hidden] and down_proj "
                                "[experts, hidden, intermediate]")
            activation = _activation_name(getattr(module, "act_fn", None))
            if activation is None:
                problems.append(f"an activation ({type(getattr(module, 'act_fn', None)).__name__}) other than "
                                f"{', '.join(ACTIVATIONS)}")
        if problems:
            raise LiftError(f"the experts at {path!r} ({type(module).__name__}) have {'; '.join(problems)}: the moe "
                            f"op takes experts stored as gate_up_proj [experts, 2 * intermediate, hidden] (gate rows, "
                            f"then up rows) and down_proj [experts, hidden, intermediate], without biases, each "
                            f"computing act(gate) * up; or gpt-oss's experts ([in, out] weights, gate / up "
                            f"interleaved, biases, its clamped SwiGLU)")
        module.llm_builder_activation = activation
        module.config._experts_implementation = EXPERTS_IMPLEMENTATION
        found += 1
    if found:
        ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, _traced_experts_forward)
    return found


# --- routers with a selection bias ------------------------------------------------------------------------------
# DeepSeek-V3's router ("noaux_tc") and its kin pick each token's experts by their scores plus a per-expert bias
# (e_score_correction_bias), weigh them by the scores alone, then renormalise and scale; DeepSeek-V3's own also limits
# the choice to the best topk_group of n_group expert groups (a chain of masks). For tracing, these routers run this
# implementation: one ``llm_builder::moe_router`` node carrying the arithmetic, which the lifter reads into the moe op.
# By class (their forwards, in transformers' modeling code): the attributes each reads and its arithmetic.
#   GLM-4.5, dots1, DeepSeek-V3 (``*TopkRouter``): logits in fp32 (x and weight cast), sigmoid, choice by scores +
#     e_score_correction_bias (within the top topk_group of n_group groups), weights gathered from the scores,
#     / (sum + 1e-20) when norm_topk_prob, then * routed_scaling_factor; fp32 weights
#   ERNIE 4.5 MoE (``Ernie4_5_MoeTopKRouter``): logits in fp32, softmax, choice by scores + moe_statics'
#     e_score_correction_bias [1, E], weights gathered, / clamp(sum, min=moe_norm_min), rounded to x's dtype
#   MiniMax-M2 (``MiniMaxM2TopKRouter``, its bias passed by its block): logits in the weight's (x's) dtype, sigmoid in
#     fp32, choice by scores + bias, weights gathered, / sum; fp32 weights
#   AFMoE (``AfmoeTokenChoiceRouter``, its expert_bias passed by its block): logits in x's dtype (its gate linear),
#     sigmoid in fp32, choice by scores + expert_bias, weights gathered, / (sum + 1e-20), * route_scale
# The eps of 1e-20 (and ERNIE's clamp at 1e-6 or so) is a no-op for any fp32 sum of top-k sigmoid / softmax scores
# the moe op meets (sigmoid scores are > 0; a top-k softmax sums to at least top_k / num_experts): the moe op
# renormalises by the sum itself.
SIGMOID_TOPK_ROUTERS = ("Glm4MoeTopkRouter", "Dots1TopkRouter", "DeepseekV3TopkRouter")


def _grouped_router_forward(self, hidden_states):
    x = hidden_states.reshape(-1, self.hidden_dim)
    weights, experts = moe_router(x, self.weight, self.e_score_correction_bias, int(self.top_k), "sigmoid",
                                  bool(self.norm_topk_prob), float(self.routed_scaling_factor), True, False)
    return weights, weights, experts  # (router_logits: unused by the block, weights, experts)


def _ernie_router_forward(self, hidden_states):
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    weights, experts = moe_router(x, self.weight, self.moe_statics.e_score_correction_bias, int(self.top_k),
                                  "softmax", True, 1.0, True, True)
    return weights, weights, experts


def _minimax_router_forward(self, hidden_states, e_score_correction_bias):
    x = hidden_states.reshape(-1, self.hidden_dim)
    weights, experts = moe_router(x, self.weight, e_score_correction_bias, int(self.top_k), "sigmoid", True, 1.0,
                                  False, False)
    return weights, weights, experts


def _afmoe_router_forward(self, hidden_states, expert_bias):
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    weights, experts = moe_router(x, self.gate.weight, expert_bias, int(self.top_k), "sigmoid", True,
                                  float(self.route_scale), False, False)
    return weights, weights, experts


def _xielu_forward(self, x: torch.Tensor) -> torch.Tensor:
    return xielu(x, self.alpha_p, self.alpha_n, self.beta, self.eps)


def trace_xielu(model: torch.nn.Module) -> int:
    """Make every xIELU activation of ``model`` (transformers' XIELUActivation: Apertus) trace as one ``xielu`` node;
    returns how many there are."""
    found = 0
    for module in model.modules():
        if type(module).__name__ == "XIELUActivation" and all(
                isinstance(getattr(module, a, None), torch.Tensor) for a in ("alpha_p", "alpha_n", "beta", "eps")):
            module.forward = types.MethodType(_xielu_forward, module)
            found += 1
    return found


def trace_routers(model: torch.nn.Module) -> int:
    """Make every router with a selection bias (``SIGMOID_TOPK_ROUTERS``, ERNIE 4.5 MoE's, MiniMax-M2's) trace as one
    ``moe_router`` node; returns how many there are. A group-limited choice (topk_group < n_group) stops the trace
    with a LiftError: the moe op chooses among all experts."""
    found = 0
    for path, module in model.named_modules():
        name = type(module).__name__
        if name in SIGMOID_TOPK_ROUTERS:
            n_group, topk_group = int(module.num_group), int(module.topk_group)
            if topk_group < n_group:
                raise LiftError(f"the router at {path!r} ({name}) limits each token's experts to the best "
                                f"topk_group={topk_group} of n_group={n_group} expert groups (config n_group / "
                                f"topk_group); the moe op chooses among all experts (n_group 1, or topk_group equal "
                                f"to n_group)")
            module.forward = types.MethodType(_grouped_router_forward, module)
        elif name == "Ernie4_5_MoeTopKRouter":
            module.forward = types.MethodType(_ernie_router_forward, module)
        elif name == "MiniMaxM2TopKRouter":
            module.forward = types.MethodType(_minimax_router_forward, module)
        elif name == "AfmoeTokenChoiceRouter" and getattr(module.gate, "bias", None) is None:
            module.forward = types.MethodType(_afmoe_router_forward, module)
        else:
            continue
        found += 1
    return found


def _activation_name(act: Callable | None) -> str | None:
    """Which of the IR's activations ``act`` computes (tried on a few values on the CPU), or None."""
    if act is None:
        return None
    x = torch.linspace(-6.0, 6.0, 97)
    try:
        y = act(x)
    except Exception:  # an activation module that needs more than a tensor
        return None
    candidates = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
                  "relu": F.relu, "sigmoid": torch.sigmoid}
    return next((name for name, fn in candidates.items()
                 if isinstance(y, torch.Tensor) and y.shape == x.shape and torch.allclose(y, fn(x), rtol=0, atol=1e-6)),
                None)


class ListIndexAsSlice(TorchFunctionMode):
    """Traces ``x[..., [i, i + 1, ..., j], ...]`` (one list of contiguous, ascending constant indices, Falcon's
    ``qkv[..., [-2], :]``) as the slice ``x[..., i:j + 1, ...]``: the same values, but exported as a slice, which the
    lifter reads as a fused linear's part; a list becomes a lifted index tensor on the meta device, whose values
    the lifter cannot read."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__ and len(args) == 2:
            index = _list_as_slice(args[0], args[1])
            if index is not None:
                args = (args[0], index)
        return func(*args, **(kwargs or {}))


def _list_as_slice(x: torch.Tensor, index):
    """``index`` with its one list of contiguous ascending ints replaced by the slice it takes, or None."""
    items = list(index) if isinstance(index, tuple) else [index]
    lists = [i for i, item in enumerate(items) if isinstance(item, list)]
    if len(lists) != 1 or any(isinstance(item, (torch.Tensor, bool)) for item in items):
        return None
    at, values = lists[0], items[lists[0]]
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return None
    # the dim the list indexes: counted from the front, or from the back when an Ellipsis comes before it
    consumes = [item is not None and item is not Ellipsis for item in items]
    dim = x.dim() - sum(consumes[at:]) if Ellipsis in items[:at] else sum(consumes[:at])
    size = x.shape[dim] if 0 <= dim < x.dim() else None
    if not isinstance(size, int) or not all(-size <= v < size for v in values):
        return None
    start = values[0] % size
    if [v % size for v in values] != list(range(start, start + len(values))):
        return None
    items[at] = slice(start, start + len(values))
    return tuple(items) if isinstance(index, tuple) else items[0]


def export_model(model: torch.nn.Module) -> torch.export.ExportedProgram:
    """torch.export ``model(input_ids) -> logits`` with a dynamic number of tokens."""
    ids = torch.zeros(1, 8, dtype=torch.long, device="meta")
    # DYNAMIC rather than a named Dim with a range: some modeling code adds guards (e.g. min(a*T, b*T))
    # that hold for every length but that a ranged Dim's constraint check cannot prove, and refuses.
    seq = torch.export.Dim.DYNAMIC
    # torch.export prints the partial graph of some failures to stderr: kept for the debug log instead, so that a
    # failed build says one line
    printed = io.StringIO()
    kwargs, shapes = {"input_ids": ids}, {"input_ids": {1: seq}}
    config = getattr(model, "config", None)
    use_cache = getattr(config, "use_cache", None)
    if "use_cache" in inspect.signature(model.forward).parameters:
        kwargs["use_cache"], shapes["use_cache"] = False, None
    elif config is not None:  # a forward that passes use_cache on in **kwargs (GraniteMoE's): its config's, off
        # (torch.export cannot take a dynamic_shapes entry for an argument inside **kwargs)
        config.use_cache = False
    with warnings.catch_warnings(), contextlib.redirect_stderr(printed), ListIndexAsSlice():
        warnings.simplefilter("ignore")
        try:
            return torch.export.export(model, (), kwargs, dynamic_shapes=shapes, strict=False)
        except LiftError:  # the tracer's own attention implementation refused what the model asked of it
            raise
        except Exception as e:  # torch.export raises many kinds (UserError, GuardOnDataDependentSymNode, ...)
            reason = " ".join(str(e).split())
            raise LiftError(f"torch.export cannot trace {type(model).__name__} on the meta device with a dynamic "
                            f"number of tokens ({type(e).__name__}: {reason[:400]}); the lifter needs one graph "
                            f"for every prompt length") from e
        finally:
            if "use_cache" not in kwargs and config is not None:
                config.use_cache = use_cache
            if printed.getvalue():
                log.debug("torch.export printed:\n%s", printed.getvalue())


def _rotary_of(model: torch.nn.Module, buffer_target: str) -> tuple[torch.nn.Module, str, str, str]:
    """An ``inv_freq`` buffer target's (rotary module, its path, its layer type or "", its rope_type): one table per
    layer type (Gemma 3: sliding_attention_inv_freq) has its own rope_type and scaling."""
    module_path, buffer = buffer_target.rsplit(".", 1)
    module = model.get_submodule(module_path)
    layer_type = buffer.removesuffix("inv_freq").removesuffix("_")
    rope_type = getattr(module, "rope_type", "default")
    if isinstance(rope_type, dict):
        rope_type = rope_type.get(layer_type, "default")
    return module, module_path, layer_type, rope_type


def rotary_tables(model: torch.nn.Module):
    """Map an ``inv_freq`` buffer target to its real (inv_freq, attention_scaling).

    The traced model lives on meta, so its buffers have no values; the rotary module is built again
    on the CPU from the same config, which applies any rope_scaling the family supports.
    """

    def table(buffer_target: str) -> tuple[torch.Tensor, float]:
        if not buffer_target.endswith("inv_freq"):  # a precomputed [positions, sin | cos] table (GPT-J's)
            return sinusoid_frequencies(model, buffer_target), 1.0
        meta_module, module_path, layer_type, rope_type = _rotary_of(model, buffer_target)
        buffer = buffer_target.rsplit(".", 1)[1]
        if rope_type not in STATIC_ROPE_TYPES:
            raise LiftError(f"rope_type {rope_type!r} at {module_path!r} is not supported; "
                            f"supported: {', '.join(STATIC_ROPE_TYPES)}")
        with torch.device("cpu"):
            real = type(meta_module)(meta_module.config)
        inv_freq = getattr(real, buffer).detach().to(torch.float32).clone()
        scaling = getattr(real, f"{layer_type}_attention_scaling", None) if layer_type else None
        return inv_freq, float(getattr(real, "attention_scaling", 1.0) if scaling is None else scaling)

    return table


def sinusoid_frequencies(model: torch.nn.Module, buffer_target: str) -> torch.Tensor:
    """The frequencies of a rotary module's precomputed table ``[positions, sin(p f) | cos(p f)]`` (GPT-J's and
    CodeGen's ``embed_positions``): the module built again on the CPU from its config, its table read, and accepted
    only where it is exactly the table of f = 1 / base ** (2i / dim) for the base its second frequency gives (the
    rope op computes cos / sin from the frequencies, not from a table)."""
    module_path, _, name = buffer_target.rpartition(".")
    meta_module = model.get_submodule(module_path) if module_path else model
    if not module_path or any(True for _ in meta_module.parameters()):  # rebuild a small table module only
        raise LiftError(f"rotary table {buffer_target!r} belongs to {type(meta_module).__name__}, which holds "
                        f"weights; the lifter rebuilds a rotary module that holds its tables alone")
    try:
        with torch.device("cpu"):
            real = type(meta_module)(getattr(meta_module, "config", None) or model.config)
        sincos = getattr(real, name).detach().to(torch.float32)
    except Exception as e:  # a module that cannot be rebuilt from its config alone
        raise LiftError(f"rotary table {buffer_target!r}: cannot rebuild {type(meta_module).__name__} on the CPU "
                        f"({type(e).__name__}: {e})") from e
    if sincos.dim() != 2 or sincos.shape[1] % 2 or sincos.shape[0] < 2 or sincos.shape[1] < 4:
        raise LiftError(f"rotary table {buffer_target!r} has shape {tuple(sincos.shape)}; the lifter reads a "
                        f"[positions, sin | cos] table")
    dim = sincos.shape[1]
    f1 = math.atan2(float(sincos[1, 1]), float(sincos[1, dim // 2 + 1]))  # the second frequency, base ** (-2 / dim)
    base = round(f1 ** (-dim / 2)) if 0 < f1 < 1 else 0
    if base > 1:
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64) / dim))
        angles = torch.arange(sincos.shape[0], dtype=torch.int64).float()[:, None] * inv_freq
        if torch.equal(torch.cat((torch.sin(angles), torch.cos(angles)), dim=1), sincos):
            return inv_freq.to(torch.float32)
    raise LiftError(f"rotary table {buffer_target!r} is not sin | cos of positions times 1 / base ** (2i / dim) "
                    f"for any base; the rope op computes its cos / sin from such frequencies")


def long_rotary_tables(model: torch.nn.Module):
    """Map an ``inv_freq`` buffer target to LongRoPE's second table and the first position it rotates
    (original_max_position_embeddings), or to None where the buffer's rotary is not LongRoPE.

    Hugging Face rotates a sequence within original_max_position_embeddings with the first table (short_factor) and,
    once it is longer, all of it with the second (long_factor): Phi-3's generation drops its cache at that point and
    recomputes every position. The rope op holds both tables; the engines offset the positions of a sequence past the
    switch onto the second (runtime.executor.LONG_ROPE_OFFSET) and recompute one that grows past it
    (runtime.scheduler).
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    def table(buffer_target: str) -> tuple[torch.Tensor, int] | None:
        module, _, layer_type, rope_type = _rotary_of(model, buffer_target)
        if rope_type != "longrope":
            return None
        long_from = longrope_from(module.config, layer_type or None)
        init = ROPE_INIT_FUNCTIONS["longrope"]
        kwargs = {"layer_type": layer_type} if layer_type and "layer_type" in inspect.signature(init).parameters \
            else {}
        long_inv_freq, _ = init(copy.deepcopy(module.config), torch.device("cpu"), seq_len=long_from + 1, **kwargs)
        return long_inv_freq.detach().to(torch.float32).clone(), long_from

    return table


def longrope_from(config, layer_type: str | None = None) -> int | None:
    """The first position LongRoPE's second table rotates (original_max_position_embeddings: Hugging Face takes the
    second table for a forward call whose sequence is longer), or None where the config's rotary is not LongRoPE."""
    for attr in ("rope_parameters", "rope_scaling"):
        params = getattr(config, attr, None)
        if not isinstance(params, dict) or not params:
            continue
        per_layer_type = all(isinstance(v, dict) for v in params.values())
        if per_layer_type:
            found = [params[layer_type]] if layer_type in params else list(params.values())
        else:
            found = [params]
        for p in found:
            if (p.get("rope_type") or p.get("type")) == "longrope":
                return int(p.get("original_max_position_embeddings")
                           or getattr(config, "original_max_position_embeddings", None)
                           or config.max_position_embeddings)
    return None


@contextlib.contextmanager
def without_longrope_pick(model: torch.nn.Module):
    """LongRoPE modules traced as static rotary: Hugging Face's forward picks its table for the call (by the largest
    position), which the lifter cannot take; the lifter gives the rope op both tables instead (``long_rotary_tables``).
    Each such module's ``rope_type`` reads "default" while tracing (the forward then skips the pick)."""
    changed = []
    for module in model.modules():
        rope_type = module.__dict__.get("rope_type")
        if rope_type == "longrope":
            changed.append((module, rope_type))
            module.rope_type = "default"
        elif isinstance(rope_type, dict) and "longrope" in rope_type.values():
            changed.append((module, rope_type))
            module.rope_type = {k: "default" if v == "longrope" else v for k, v in rope_type.items()}
    try:
        yield
    finally:
        for module, rope_type in changed:
            module.rope_type = rope_type


def buffer_values(model: torch.nn.Module) -> Callable[[str], torch.Tensor]:
    """Map a buffer target to its real value, for constants the lifter folds (an embedding scale).

    The meta model's buffers hold no values. A buffer the checkpoint does not store is set by the model's
    ``_init_weights`` when transformers loads it, so that is run on the buffer's module with a real,
    NaN-filled tensor standing in for the buffer (its meta weights are left as they are).
    """

    def value(buffer_target: str) -> torch.Tensor:
        module_path, name = buffer_target.rsplit(".", 1)
        module = model.get_submodule(module_path)
        meta = module._buffers[name]
        if not meta.is_floating_point() or meta.numel() > 1 << 16:
            raise LiftError(f"buffer {buffer_target!r} ({str(meta.dtype).removeprefix('torch.')}, "
                            f"{tuple(meta.shape)}) cannot be evaluated as a constant: only small float buffers are")
        real = torch.full(meta.shape, float("nan"), dtype=meta.dtype)
        module._buffers[name] = real
        try:
            model._init_weights(module)
        except Exception as e:  # an initialisation that needs more than this module's meta weights
            raise LiftError(f"cannot compute buffer {buffer_target!r}: {type(model).__name__}._init_weights failed "
                            f"on {type(module).__name__} ({type(e).__name__}: {e})") from e
        finally:
            module._buffers[name] = meta
        if real.isnan().any():
            raise LiftError(f"the value of buffer {buffer_target!r} is not set by {type(model).__name__}'s weight "
                            f"initialisation, so the lifter cannot fold it into the graph")
        return real

    return value


def rope_types(config) -> list[str]:
    """The rotary variants a config asks for.

    transformers 5 keeps them in ``rope_parameters``, older configs in ``rope_scaling`` (``type`` or
    ``rope_type``); either may also map each layer type to its own parameters.
    """
    found = []
    for attr in ("rope_parameters", "rope_scaling"):
        params = getattr(config, attr, None)
        if not isinstance(params, dict) or not params:
            continue
        per_layer_type = all(isinstance(v, dict) for v in params.values())
        for p in params.values() if per_layer_type else [params]:
            found.append(p.get("rope_type") or p.get("type") or "default")
    return found


def check_rope(config) -> None:
    """Refuse, before tracing, rotary variants whose frequencies change with the sequence length."""
    for rope_type in rope_types(config):
        if rope_type not in STATIC_ROPE_TYPES:
            raise LiftError(f"rope_type {rope_type!r} (config.json rope_parameters / rope_scaling) is not supported: "
                            f"its frequencies depend on the sequence length, and the runtime precomputes them; "
                            f"supported: {', '.join(STATIC_ROPE_TYPES)}")


def trace(config) -> tuple[Graph, torch.nn.Module]:
    """Config -> IR graph whose params are meta tensors (rotary tables are real), plus the meta model."""
    check_rope(config)
    model = build_meta_model(config)
    start = time.perf_counter()
    with without_longrope_pick(model):
        exported = export_model(model)
    try:
        graph = lift(exported, LiftContext(model=model, rotary=rotary_tables(model), buffer=buffer_values(model),
                                           long_rotary=long_rotary_tables(model)))
    except LiftError:
        raise
    except Exception as e:  # a graph the lifter's rules did not expect: still one line for the user, not a traceback
        raise LiftError(f"the lifter failed on {type(model).__name__} ({type(e).__name__}: {e}); this is a gap in "
                        f"passes/lift.py, not a problem of the checkpoint") from e
    graph.meta.update(model_meta(config, graph))
    log.info("traced %s in %.2fs: %s", type(model).__name__, time.perf_counter() - start, graph.summary())
    return graph, model


def model_meta(config, graph: Graph) -> dict:
    """Model dimensions the runtime and reports need, read off the lifted graph where possible."""
    attn = [n for n in graph.nodes if n.op == "attention"]
    embed = next(n for n in graph.nodes if n.op == "embedding" and n.inputs == ["input_ids"])  # not a position table
    vocab, hidden = graph.params[embed.weights["weight"]].shape
    return {
        "architecture": (getattr(config, "architectures", None) or [type(config).__name__])[0],
        "model_type": config.model_type,
        "vocab_size": int(vocab),
        "hidden_size": int(hidden),
        "num_layers": len(attn),
        "num_attention_heads": attn[0].attrs["num_heads"] if attn else 0,
        "num_key_value_heads": attn[0].attrs["num_kv_heads"] if attn else 0,
        "head_dim": attn[0].attrs["head_dim"] if attn else 0,
        "max_position_embeddings": int(getattr(config, "max_position_embeddings", 0) or 0),
        "kv_layers": [
            {"num_kv_heads": n.attrs["num_kv_heads"], "head_dim": n.attrs["head_dim"]} for n in attn
        ],
    }
