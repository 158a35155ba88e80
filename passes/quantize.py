"""The lifecycle every quantization method shares, and layer-by-layer calibration.

    validate ─► select targets ─► for each segment of the graph (one decoder layer's worth):
                                    attach observer ─► run calibration tokens ─► remove observer
                                    apply the method to the segment's targets
                                    re-run the segment with the quantized weights (feeds the next)
            ─► check that every target was quantized

A segment ends after each attention node, so it holds one layer's o_proj/MLP and the next layer's
q/k/v. Only the values live across a segment boundary (the residual stream) are kept per
calibration window, so peak memory is one layer's activations for the calibration set plus the
weights, never the whole model's activations. Later segments are calibrated on the outputs of the
already-quantized earlier ones, as GPTQ prescribes.

Target selection: every ``linear`` node, minus the recipe's ``ignore`` list; ``targets`` restricts
to names or ``re:`` regexes. Names are the node's source module path (``model.layers.3.mlp.down_proj``;
a merged node has its parent's path and matches if any member matches). A section that selects no
linear is an error, before any calibration; a targets or ignore pattern that matches no linear at all
is a warning. The ``embedding`` is never quantized. The ``lm_head`` is quantized only when the section
says ``lm_head: true`` (targets / ignore do not reach it; such a section may select no linear and
quantize the lm_head alone): it is calibrated like a linear (its inputs are the final norm's outputs)
and stored in the method's scheme with ``in_features`` / ``out_features`` attrs, as a linear is.

Tied embeddings: the lm_head and the embedding then read one tensor. Quantizing the lm_head unties
them first (:func:`untie`): the embedding keeps the float table, the lm_head gets its own quantized
copy, so the artifact stores both (the float table and the codes of the copy).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from passes.base import Pass, PassContext, PassError, PassResult, Progress
from passes.ir import Graph, Node
import torch.nn.functional as F

from runtime.executor import Executor, Observer, SeqSlice, StepInput, sequence_positions
from kernels.torch_quant import make_quant_linear
from runtime.kv_cache import SequenceKV

log = logging.getLogger("passes.quantize")


def member_outputs(node: Node) -> list[tuple[str, int, int]]:
    """(name, first, end) of each output-feature range of a linear the per-layer error report names: a merged
    linear's members by their own modules (``model.layers.0.self_attn.q_proj+k_proj+v_proj.*`` ->
    ``...self_attn.q_proj``, ``...k_proj``, ``...v_proj``), any other linear whole, by its source."""
    names = _merged_members(next(iter(node.weights.values()), ""))  # any role: a quantized node has no weight
    out_features = node.attrs.get("out_features", 0)
    sizes = node.attrs.get("split_sizes")  # none on gate_up once fused into SiLU-and-multiply: equal halves
    if sizes is None and len(names) > 1 and out_features % len(names) == 0:
        sizes = [out_features // len(names)] * len(names)
    if not names or not sizes or len(names) != len(sizes):
        return [(node.source, 0, out_features or 1 << 62)]
    out, lo = [], 0
    for name, size in zip(names, sizes):
        out.append((name, lo, lo + size))
        lo += size
    return out


@dataclass
class Segment:
    start: int  # first node index
    end: int  # one past the last node index
    attention_layers: list[int]  # KV layers written inside the segment


def segments(graph: Graph, at_linears: bool = False) -> list[Segment]:
    """Cut the node list right after each attention node; ``at_linears``: also right before each linear, so that a
    linear's calibration inputs come through the quantized linears before it in its layer (GPTQ's "true
    sequential" order) rather than through their float weights."""
    cuts = [i + 1 for i, n in enumerate(graph.nodes) if n.op == "attention"]
    if at_linears:
        cuts = sorted(set(cuts) | {i for i, n in enumerate(graph.nodes) if n.op in ("linear", "lm_head") and i > 0})
    bounds = [0] + cuts + ([len(graph.nodes)] if not cuts or cuts[-1] < len(graph.nodes) else [])
    out = []
    for a, b in zip(bounds, bounds[1:]):
        layers = [n.attrs["layer"] for n in graph.nodes[a:b] if n.op == "attention"]
        out.append(Segment(a, b, layers))
    return out


def _merged_members(tensor_name: str) -> list[str]:
    """The member module paths of a merged linear's tensor (``a.q_proj+k_proj.weight`` -> ``a.q_proj``,
    ``a.k_proj``); [] for any other name."""
    stem = tensor_name.rsplit(".", 1)[0]
    parent, _, leaves = stem.rpartition(".")
    return [f"{parent}.{leaf}" for leaf in leaves.split("+")] if parent and "+" in leaves else []


def member_names(node: Node) -> list[str]:
    """Module paths a linear answers to: its source, and for a merged node each member's path."""
    return [node.source] + _merged_members(node.weights.get("weight", ""))


def _matches(patterns: list[str], names: list[str]) -> bool:
    for p in patterns:
        for name in names:
            if p.startswith("re:"):
                if re.search(p[3:], name):
                    return True
            elif name == p or name.endswith("." + p):
                return True
    return False


def _shown(patterns: list[str]) -> str:
    """Patterns as the recipe spells them (repr would double a regex's backslashes)."""
    return "[" + ", ".join(f"'{p}'" for p in patterns) + "]"


def select_linears(graph: Graph, targets: list[str], ignore: list[str], section: str,
                   warn: bool = True, allow_empty: bool = False, moe: bool = False) -> list[int]:
    """Indices of the linear nodes a quantization section selects: ``targets`` (empty = all) minus
    ``ignore``, minus linears an earlier section quantized.

    A section that selects nothing is a PassError naming its patterns, unless ``allow_empty`` (it
    quantizes the lm_head, or experts); with ``warn``, a pattern that matches no linear at all (nor, with ``moe``:
    the method quantizes experts, any moe layer's module path) is logged as a warning.
    """
    linears = [(i, member_names(n)) for i, n in enumerate(graph.nodes) if n.op == "linear"]
    targeted = [(i, names) for i, names in linears if not targets or _matches(targets, names)]
    kept = [(i, names) for i, names in targeted if not _matches(ignore, names)]
    chosen = [i for i, _ in kept if "quant" not in graph.nodes[i].attrs]
    example = linears[0][1][-1] if linears else "model.layers.0.mlp.down_proj"
    if warn:
        named = linears + ([(i, [n.source]) for i, n in enumerate(graph.nodes) if n.op == "moe"] if moe else [])
        for key, patterns in (("targets", targets), ("ignore", ignore)):
            for pattern in patterns:
                if not any(_matches([pattern], names) for _, names in named):
                    log.warning("%s: %s pattern '%s' matches no linear (names look like %r)", section, key,
                                pattern, example)
    if chosen or allow_empty:
        return chosen
    if not linears:
        why = "the graph has no linear layers"
    elif not targeted:
        why = f"targets {_shown(targets)} match none of the {len(linears)} linears (names look like {example!r})"
    elif not kept:
        why = (f"ignore {_shown(ignore)} excludes every linear that targets {_shown(targets)} match" if targets
               else f"ignore {_shown(ignore)} excludes all {len(linears)} linears")
    else:
        why = f"the {len(kept)} linears it matches were already quantized by an earlier section"
    raise PassError(f"{section} selects no linear: {why}; fix its targets/ignore or remove the section")


@dataclass
class QuantSettings:
    """Options every method understands (from the recipe's quantization section)."""

    targets: list[str] = field(default_factory=list)  # empty = every linear
    ignore: list[str] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)  # method-specific
    lm_head: bool = False  # also quantize the lm_head (targets / ignore do not apply to it)


class QuantMethod(Pass):
    """Base class: subclasses implement ``validate_node``, ``observe`` and ``quantize_node``."""

    needs_calibration = True
    scheme = ""  # the IR quant scheme this method writes
    # calibrate each linear on inputs through the quantized linears before it in its layer (segments(at_linears)):
    # for methods whose statistics are per linear (GPTQ's Hessian), not per layer block (AWQ, SmoothQuant)
    true_sequential = False

    def __init__(self) -> None:
        self.settings = QuantSettings()
        self.stats: dict[int, Any] = {}  # node index -> accumulated statistics
        self.references: dict[int, torch.Tensor] = {}  # id(node) -> float weight the quantized one stands for
        self.errors: dict[str, list[float]] = {}  # node source -> [sum sq error, sum sq reference]
        self.error_inputs = "calibration data"  # what the errors were measured on
        # value -> per-channel divisor a method applied to it inside an earlier segment (smoothquant folds scales
        # into a finished segment's v projection): calibration divides the live activations the same way
        self.rescaled_values: dict[str, torch.Tensor] = {}

    # --- hooks for subclasses --------------------------------------------------------------
    def configure(self, options: dict[str, Any]) -> None:
        """Read method options (called once, before validation)."""

    def validate_node(self, graph: Graph, node: Node) -> None:
        """Raise PassError if ``node`` cannot be quantized with these settings."""

    def observe(self, index: int, node: Node, x: torch.Tensor) -> None:
        """Accumulate statistics of a target's input ``x`` [num_tokens, in_features]."""

    def observe_inputs(self, index: int, node: Node, inputs: list[torch.Tensor]) -> None:
        """All of a target's inputs; linear methods only need the first."""
        self.observe(index, node, inputs[0])

    def is_applied(self, node: Node) -> bool:
        return node.attrs.get("quant") is not None

    def apply_segment(self, graph: Graph, targets: list[int]) -> None:
        """Quantize the targets of one segment (indices into graph.nodes), using ``self.stats``."""
        for i in targets:
            self.quantize_node(graph, graph.nodes[i], self.stats.get(i))

    def quantize_node(self, graph: Graph, node: Node, stats: Any) -> None:
        raise NotImplementedError

    quantizes_experts = False  # whether quantize_experts / selects_experts do anything (targets may name moe layers)
    # why experts this method left are left, for the log
    experts_left = "{name} does not quantize experts (fp8 does)"

    def quantize_experts(self, graph: Graph, targets: list[int]) -> dict[str, Any]:
        """Quantize the experts of the graph's ``moe`` nodes this section reaches (``targets``: the linears and
        lm_head it quantized); a summary of what it did (empty: the method leaves experts in the build dtype)."""
        return {}

    def expert_targets(self, graph: Graph, targets: list[int]) -> list[int]:
        """Indices of the ``moe`` nodes whose experts this method quantizes during calibration, layer by layer, on the
        calibration tokens routed to each expert (:meth:`observe_experts`, then :meth:`apply_experts` once the
        segment's statistics are in); [] for a method that quantizes experts afterwards, on the weights alone."""
        return []

    def observe_experts(self, index: int, node: Node, inputs: list[torch.Tensor]) -> None:
        """Accumulate statistics of a moe node's input (inputs[0]: [num_tokens, hidden], before routing)."""

    def apply_experts(self, graph: Graph, indices: list[int]) -> None:
        """Quantize the experts of the moe nodes ``indices`` (one segment's), from :meth:`observe_experts`'s
        statistics."""

    # --- lifecycle -------------------------------------------------------------------------
    def _reached(self, graph: Graph, linears: bool) -> list[Node]:
        """The unquantized moe nodes whose experts this section quantizes (methods that quantize experts): option
        ``experts`` (``self.experts``) true and the targets / ignore reach the node; or ``experts`` unset and, besides,
        the section takes a linear (``linears``) or its targets name the node (a section that quantizes the lm_head
        alone leaves experts unless asked)."""
        experts = getattr(self, "experts", None)
        if not self.quantizes_experts or experts is False:
            return []
        patterns, ignore = self.settings.targets, self.settings.ignore
        return [n for n in graph.nodes if n.op == "moe" and "quant" not in n.attrs
                and (not patterns or _matches(patterns, [n.source])) and not _matches(ignore, [n.source])
                and (experts or linears or (patterns and _matches(patterns, [n.source])))]

    def selects_experts(self, graph: Graph) -> bool:
        """Whether this section's targets name moe layers whose experts it will quantize (a section may then select
        no linear)."""
        return bool(self.settings.targets) and bool(self._reached(graph, linears=False))

    def select(self, graph: Graph, section: str, warn: bool = True) -> list[int]:
        """The nodes to quantize; ``section`` names the recipe section in errors."""
        head = select_lm_head(graph, section) if self.settings.lm_head else None
        experts = self.selects_experts(graph)
        linears = select_linears(graph, self.settings.targets, self.settings.ignore, section, warn,
                                 allow_empty=head is not None or experts, moe=self.quantizes_experts)
        return linears + ([head] if head is not None else [])

    def prepare(self, graph: Graph, options: dict[str, Any], section: str | None = None,
                warn: bool = True) -> list[int]:
        """Read the options, select the targets and validate each: all that can fail before calibration.

        The builder also calls it on the freshly traced graph, so a section that cannot apply stops
        the build before any pass runs.
        """
        opts = dict(options)
        self.settings = QuantSettings(opts.pop("targets", []), opts.pop("ignore", []), opts,
                                      bool(opts.pop("lm_head", False)))
        self.activation_quant = opts.pop("activation_quant", None)
        if self.activation_quant not in (None, "fp8"):
            raise PassError(f"{self.name}: activation_quant {self.activation_quant!r} is not 'fp8'")
        self.configure(opts)
        if self.activation_quant and self.scheme != "w4a16":
            raise PassError(f"{self.name}: activation_quant: fp8 (W4A8) takes 4-bit weights (the w4a16 scheme), "
                            f"not {self.scheme}")
        targets = self.select(graph, section or f"the {self.name} quantization section", warn)
        for i in targets:
            self.validate_node(graph, graph.nodes[i])
        return targets

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        targets = self.prepare(graph, ctx.options.get(self.name, {}))
        if self.needs_calibration and not ctx.calibration:
            raise PassError(f"{self.name} needs calibration data and none was given")
        for i in targets:
            if graph.nodes[i].op == "lm_head" and untie(graph, graph.nodes[i]):
                log.info("%s: the lm_head shares its weight with the embedding; untied: the embedding keeps the "
                         "%s table, the lm_head gets its own quantized copy", self.name, graph.meta.get("dtype", "float"))
        if ctx.calibration and self.needs_calibration:  # also measures each linear's output error on that data
            self._calibrate_and_apply(graph, targets, ctx.calibration, ctx.progress,
                                      self.expert_targets(graph, targets))
        else:  # nothing to fit on activations: no pass over the model, the errors measured on random inputs
            self.apply_segment(graph, targets)
            self._probe_errors(graph, targets)
        left = [graph.nodes[i].source for i in targets if not self.is_applied(graph.nodes[i])]
        if left:
            raise PassError(f"{self.name}: these linears were selected but not quantized: {', '.join(left[:5])}")
        experts = self.quantize_experts(graph, targets)
        left_moe = sum(n.op == "moe" and "quant" not in n.attrs for n in graph.nodes)
        if left_moe and any(graph.nodes[i].op in ("linear", "lm_head") for i in targets):  # a weight method
            log.warning("%s: the experts of %d mixture-of-experts (moe) layers stay in %s (shared-expert linears are "
                        "linears, selected as usual): %s", self.name, left_moe, graph.meta.get("dtype", "float"),
                        self.experts_left.format(name=self.name))
        summary = self.summary(graph, targets)
        summary.update(experts)
        return PassResult(graph, len(targets), len(targets), summary)

    def summary(self, graph: Graph, targets: list[int]) -> dict[str, Any]:
        linears = [i for i in targets if graph.nodes[i].op == "linear"]
        out: dict[str, Any] = {"scheme": self.scheme, "num_linears": len(linears)}
        if len(linears) < len(targets):
            out["lm_head"] = True
        num_moe = sum(n.op == "moe" and "quant" not in n.attrs for n in graph.nodes)
        if num_moe and targets:  # experts no method here quantized: left in the build dtype
            out["moe_layers_not_quantized"] = num_moe
        if self.errors:
            out["layer_errors"] = self.layer_errors()
            out["layer_error_inputs"] = self.error_inputs
        return out

    PROBE_ROWS = 64  # Gaussian input rows per linear for the errors of methods that fit nothing on activations

    def _probe_errors(self, graph: Graph, targets: list[int]) -> None:
        """Each quantized linear's relative output error on PROBE_ROWS standard-normal input rows (for a
        weight-only scheme, ~ the relative Frobenius error of its weight): one small matmul per linear instead
        of a pass of the model over calibration data."""
        self.error_inputs = f"{self.PROBE_ROWS} random (standard normal) input rows"
        gen = torch.Generator().manual_seed(0)
        observe = self._error_observer(graph, targets)
        for i in targets:
            w = graph.params[next(iter(graph.nodes[i].weights.values()))]
            x = torch.randn(self.PROBE_ROWS, graph.nodes[i].attrs.get("in_features") or w.shape[-1], generator=gen)
            observe(i, [x.to(w.device)])

    def layer_errors(self) -> dict[str, float]:
        """Relative output error ||x Wq^T - x W^T|| / ||x W^T|| per quantized linear, worst first."""
        rel = {k: (e / r) ** 0.5 if r > 0 else 0.0 for k, (e, r) in self.errors.items()}
        return dict(sorted(rel.items(), key=lambda kv: -kv[1]))

    def replace_weight(self, graph: Graph, node: Node, scheme: str, tensors: dict[str, torch.Tensor],
                       quant: dict[str, Any], reference: torch.Tensor | None = None) -> None:
        """Swap a linear's weight for quantized tensors; ``reference`` is the float weight they stand
        for on the node's (possibly rescaled) input, for the per-layer error report."""
        self.references[id(node)] = reference if reference is not None else graph.params[node.weights["weight"]]
        if getattr(self, "activation_quant", None) == "fp8" and scheme == "w4a16" and node.op == "linear":
            quant = {**quant, "activation_quant": "fp8"}  # W4A8: each input rounded per token to e4m3 at run time
        replace_weight(graph, node, scheme, tensors, quant)

    def _error_observer(self, graph: Graph, seg_targets: list[int]) -> Observer:
        fns = {}
        for i in seg_targets:
            node = graph.nodes[i]
            ref = self.references.pop(id(node), None)
            if ref is None or "quant" not in node.attrs:
                continue
            w = {r: graph.params[n] for r, n in node.weights.items() if r != "bias"}
            fn = make_quant_linear(node.attrs["quant"]["scheme"], w, node.attrs["quant"], torch.float32)
            fns[i] = (member_outputs(node), ref.float(), fn)

        def observe(index: int, inputs: list[torch.Tensor]) -> None:
            if index in fns:
                members, ref, fn = fns[index]
                x = inputs[0].float()
                y_ref = F.linear(x, ref)
                y = fn(x).float()
                for name, lo, hi in members:  # a merged linear: one row per member (q, k, v; gate, up)
                    err = self.errors.setdefault(name, [0.0, 0.0])
                    err[0] += float((y[..., lo:hi] - y_ref[..., lo:hi]).pow(2).sum())
                    err[1] += float(y_ref[..., lo:hi].pow(2).sum())

        return observe

    def _calibrate_and_apply(self, graph: Graph, targets: list[int], windows: list[list[int]],
                             progress: Progress | None = None, experts: list[int] | None = None) -> None:
        wanted, wanted_moe = set(targets), set(experts or ())
        executor = Executor(graph.to_dict(), graph.params)
        layout = executor.kv_layout()
        device = executor.device  # calibration runs where the weights are (the pipeline's choice)
        caches = [SequenceKV(layout, len(w), device, layers=set()) for w in windows]
        envs = [executor.start(StepInput(torch.tensor(w, device=device),
                                         sequence_positions(executor.long_rope_from, 0, len(w), len(w), device),
                                         [SeqSlice(kv, 0, len(w))])) for w, kv in zip(windows, caches)]

        def observer(index: int, inputs: list[torch.Tensor]) -> None:
            if index in wanted:
                self.observe_inputs(index, graph.nodes[index], inputs)
            elif index in wanted_moe:
                self.observe_experts(index, graph.nodes[index], inputs)

        segs = segments(graph, at_linears=self.true_sequential)
        for k, seg in enumerate(segs):
            seg_targets = [i for i in targets if seg.start <= i < seg.end]
            seg_moe = sorted(i for i in wanted_moe if seg.start <= i < seg.end)
            for kv in caches:
                for layer in seg.attention_layers:
                    kv.allocate_layer(layer, layout, device)
            if seg_targets or seg_moe:
                for env in envs:  # statistics pass over a copy: the env must stay at the segment start
                    executor.run_nodes(dict(env), seg.start, seg.end, observer)
                if seg_targets:
                    self.apply_segment(graph, seg_targets)
                if seg_moe:  # the experts on their routed tokens (observed with the segment's linears still float)
                    self.apply_experts(graph, seg_moe)
                self.stats.clear()
                for value, divisor in self.rescaled_values.items():
                    for env in envs:
                        env[value] = (env[value].float() / divisor.to(env[value].device)).to(env[value].dtype)
                self.rescaled_values.clear()
                executor = Executor(graph.to_dict(), graph.params)
            errors = self._error_observer(graph, seg_targets) if seg_targets else None
            for env in envs:  # propagate through the (now quantized) segment
                executor.run_nodes(env, seg.start, seg.end, errors)
            for kv in caches:
                for layer in seg.attention_layers:
                    kv.free_layer(layer)
            if progress is not None:
                progress(f"{self.name}: calibrating layer by layer", k + 1, len(segs))


def replace_weight(graph: Graph, node: Node, scheme: str, tensors: dict[str, torch.Tensor],
                   quant: dict[str, Any]) -> None:
    """Swap a linear's (or the lm_head's) ``weight`` for quantized tensors named ``<weight name minus
    .weight>.<role>``. An lm_head also records its shape as a linear does: its codes no longer show it."""
    base = node.weights["weight"].removesuffix(".weight")
    if node.op == "lm_head":
        out_f, in_f = graph.params[node.weights["weight"]].shape
        node.attrs.update(in_features=int(in_f), out_features=int(out_f))
    old = node.weights.pop("weight")
    for role, t in tensors.items():
        name = f"{base}.{role}"
        graph.params[name] = t
        node.weights[role] = name
    node.attrs["quant"] = {"scheme": scheme, **quant}
    if not any(old in n.weights.values() for n in graph.nodes):
        graph.params.pop(old, None)


def select_lm_head(graph: Graph, section: str) -> int:
    """Index of the lm_head node a section with ``lm_head: true`` quantizes."""
    heads = [i for i, n in enumerate(graph.nodes) if n.op == "lm_head"]
    assert len(heads) == 1, f"a graph has exactly one lm_head, found {len(heads)}"
    if "quant" in graph.nodes[heads[0]].attrs:
        raise PassError(f"{section} sets lm_head: true but an earlier section already quantized the lm_head; "
                        f"set it in one section only")
    return heads[0]


def in_features(graph: Graph, node: Node) -> int:
    """A linear's input features; an unquantized lm_head shows them only in its weight's shape."""
    if "in_features" in node.attrs:
        return node.attrs["in_features"]
    return int(graph.params[node.weights["weight"]].shape[1])


def untie(graph: Graph, node: Node) -> bool:
    """Give ``node`` (the lm_head) a weight of its own when another node reads the same tensor (tied
    embeddings); False when nothing shared it. Names follow the modules: the one whose name the tied
    tensor carries keeps it, the others get ``<their source>.weight``. The tensor itself is shared
    until a pass replaces one side (passes never modify a tensor in place)."""
    name = node.weights["weight"]
    others = [n for n in graph.nodes if n is not node and name in n.weights.values()]
    if not others:
        return False
    movers = others if name == f"{node.source}.weight" else [node]
    for n in movers:
        own = f"{n.source}.weight"
        assert own not in graph.params, f"cannot untie {name}: {own} is already a weight of the graph"
        graph.params[own] = graph.params[name]
        n.weights = {role: own if w == name else w for role, w in n.weights.items()}
    return True


def norm_can_absorb(graph: Graph, producer: Node | None, value: str, members: list[int]) -> bool:
    """Whether ``value`` (the input of the linears ``members``) comes from an RMSNorm whose gain can
    absorb a per-channel 1 / s (AWQ's and SmoothQuant's scales): a whole-vector norm with a weight and
    no ``weight_offset`` (the gain would be weight + offset), read by the members alone (any other
    reader would see x / s too)."""
    if (producer is None or producer.op not in ("rms_norm", "fused_add_rms_norm") or producer.outputs[0] != value
            or "weight" not in producer.weights or producer.attrs.get("head_dim")
            or producer.attrs.get("weight_offset")):
        return False
    wanted = {id(graph.nodes[i]) for i in members}
    return all(id(n) in wanted for n in graph.users().get(value, []))


def v_projection_rows(producers: dict[str, Node], users: dict[str, list[Node]],
                      value: str) -> tuple[Node, slice, tuple[int, int, int]] | None:
    """Where ``value`` is attention's output read by one linear alone (the output projection), and attention's v
    input is a linear's output read by attention alone: that v projection, its rows and the heads' shape
    (num_kv_heads, query heads per kv head, head_dim). Attention is linear in v, so dividing v's row (g, d) by s
    divides every query head of group g at d by s: a per-channel scale on the output projection's input can be
    folded there when the query heads of each group share it (AWQ's and SmoothQuant's output-projection scales).
    None where that does not hold."""
    attn = producers.get(value)
    if attn is None or attn.op != "attention" or len(users.get(value, [])) != 1:
        return None
    v = attn.inputs[2]
    lin = producers.get(v)
    if lin is None or lin.op != "linear" or len(users.get(v, [])) != 1:
        return None
    kv, heads, dim = attn.attrs["num_kv_heads"], attn.attrs["num_heads"], attn.attrs["head_dim"]
    sizes = lin.attrs.get("split_sizes") or [lin.attrs["out_features"]]
    at = lin.outputs.index(v)
    lo = sum(sizes[:at])
    if sizes[at] != kv * dim or heads % kv:
        return None
    return lin, slice(lo, lo + sizes[at]), (kv, heads // kv, dim)


def check_group_size(graph: Graph, node: Node, group_size: int, method: str) -> None:
    """Grouped weight quantization needs groups that tile the input dimension exactly."""
    in_f = in_features(graph, node)
    if group_size != -1 and in_f % group_size:
        options = [g for g in (256, 128, 64, 32, 16) if in_f % g == 0]
        raise PassError(f"{method}: {node.source} has in_features {in_f}, not divisible by group_size "
                        f"{group_size}; use {', '.join(map(str, options)) or 'a divisor of it'} or -1 (per channel) "
                        f"as the quantization section's group_size")
