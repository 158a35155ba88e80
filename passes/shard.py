"""shard: split the graph over ``tp_size`` tensor-parallel ranks, in the style of Megatron-LM.

    embedding ─► norm ─► q/k/v (column: by heads) ─► rope ─► attention (local heads) ─► o_proj (row) ─► all_reduce
                 norm ─► gate/up (column: by intermediate features) ─► silu·mul ─► down_proj (row) ─► all_reduce
                 norm ─► moe (every expert's gate/up rows and down columns by intermediate features; the router
                         whole) ─► all_reduce
    norms, residual adds and rope tables are replicated; so are the embedding and lm_head, unless
    ``vocab_parallel``: then both are split by vocabulary rows (masked lookup + all_reduce; partial
    logits + all_gather). A quantized lm_head is split the same way: its codes and per-row scales / zero
    points by rows, per-tensor weight and input scales replicated; each rank's logits are exact since
    every rank sees the whole input row (dynamic per-token activation scales agree across ranks).

Heads: rank r holds q heads [r*H/tp, (r+1)*H/tp). KV heads: KV/tp per rank when tp <= KV; when tp > KV
each rank holds the one kv head its q heads read (kv head r*KV // tp), replicated on tp/KV ranks.

Quantized weights are cut together with their scales and zero points: a column split cuts output rows
(every scheme); a row split cuts input columns on group boundaries (packed 4-bit codes hold two columns
per byte); per-channel and per-tensor scales are replicated. fp8_block scales [out / bn, in / bk] are cut by
whole blocks, rows with a column split, columns with a row split. A split that would cut a quantization
group or scale block is an error.

Experts: each rank runs every expert on its share of the intermediate features, so its moe output is a partial
sum (the routing, computed whole on every rank, agrees). FP8 experts' per-row scales follow their rows, the down
projection's per-output-channel scales are replicated; each rank quantizes its share of the down projection's input
per token with its own scale (other codes than one rank's, as close to the float model). A bias after the down
projection (gpt-oss) is added by every rank: each holds it divided by tp_size (exact for powers of two).

Every rank runs the same graph (same shapes); only its weights differ. The result's ``params`` are meta
tensors of one rank's shapes, and ``graph.shards`` says how each rank's tensors are cut from the full
ones (nothing is copied here; see ``ir.ShardedWeights``). Runs last, after quantization and the quality
gates, which need the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from passes.base import Pass, PassContext, PassError, PassResult, register
from passes.ir import Graph, NameGen, Node, ShardedWeights, Slice

Ranges = list[tuple[int, int]]  # per rank: [start, stop) of a feature dimension


@dataclass(frozen=True)
class Rule:
    """How one role of node is split (Megatron's Column/RowParallelLinear, VocabParallelEmbedding)."""

    split: str  # "column": output features; "row": input features; "vocab": rows of the table / lm_head
    collective: str | None  # the op inserted after the node: all_reduce (partial sums), all_gather (logits)


RULES: dict[str, Rule] = {
    "qkv": Rule("column", None),  # q, k, v projections, split by heads (each member separately)
    "o_proj": Rule("row", "all_reduce"),  # reads the local heads' attention output
    "gate_up": Rule("column", None),  # gate, up projections, split by intermediate features
    "down_proj": Rule("row", "all_reduce"),  # reads the local intermediate features
    "embedding": Rule("vocab", "all_reduce"),  # only with vocab_parallel; replicated otherwise
    "lm_head": Rule("vocab", "all_gather"),  # only with vocab_parallel; replicated otherwise
}

# Ops that run unchanged on a rank's share of the features (all their inputs split alike).
_LOCAL_OPS = ("rope", "position_scale", "activation", "xielu", "silu_mul", "elementwise", "attention")
UNARY_ACTIVATIONS = ("activation", "xielu")  # one value in, one out, elementwise (their weights, if any, whole)
PER_HEAD_NORMS = ("rms_norm", "layer_norm")  # with a head_dim attr: each head normalised alone, whatever rank holds it


def even_ranges(size: int, tp_size: int) -> Ranges:
    step = size // tp_size
    return [(r * step, (r + 1) * step) for r in range(tp_size)]


def head_ranges(num_heads: int, head_dim: int, tp_size: int) -> Ranges:
    """Features of each rank's heads; with fewer heads than ranks, each rank's one (replicated) head."""
    if tp_size <= num_heads:
        return even_ranges(num_heads * head_dim, tp_size)
    return [((r * num_heads // tp_size) * head_dim, (r * num_heads // tp_size + 1) * head_dim) for r in range(tp_size)]


def local_heads(num_heads: int, tp_size: int) -> int:
    return max(1, num_heads // tp_size)


@dataclass(frozen=True)
class _Member:
    """One member of a column-parallel linear's output (q, k, v, gate or up)."""

    size: int  # output features in the full weight
    num_heads: int = 0  # attention members: heads in it (split by heads); 0 = split evenly
    head_dim: int = 0

    def ranges(self, tp_size: int) -> Ranges:
        if self.num_heads:
            return head_ranges(self.num_heads, self.head_dim, tp_size)
        return even_ranges(self.size, tp_size)

    def local_size(self, tp_size: int) -> int:
        """Features of this member on each rank."""
        a, b = self.ranges(tp_size)[0]
        return b - a


@dataclass
class _Column:
    """A column-parallel linear and its members, by output index (a [gate | up] output holds two)."""

    node: Node
    role: str
    members: dict[int, list[_Member]] = field(default_factory=dict)


@dataclass
class _Match:
    """What the shard pass found in a graph, before any rewrite."""

    columns: dict[int, _Column] = field(default_factory=dict)  # id(node) -> column-parallel linear
    rows: dict[int, tuple[Node, str]] = field(default_factory=dict)  # id(node) -> (row-parallel linear, role)
    head_nodes: dict[int, tuple[Node, int]] = field(default_factory=dict)  # id(rope) -> (node, full num_heads)
    # id(norm) -> (a per-head norm whose gain is one per head, [heads, head_dim], full num_heads): split by heads
    head_gains: dict[int, tuple[Node, int]] = field(default_factory=dict)
    attention: list[Node] = field(default_factory=list)


def _fail(message: str) -> PassError:
    return PassError(f"shard: {message}")


def match(graph: Graph) -> _Match:
    """Find the column- and row-parallel linears of every attention block and gated MLP."""
    producers, users = graph.producers(), graph.users()
    m = _Match()

    def column(node: Node, role: str) -> _Column:
        col = m.columns.setdefault(id(node), _Column(node, role))
        if col.role != role:
            raise _fail(f"linear {node.source} feeds both attention and an MLP; it cannot be split one way")
        return col

    for attn in (n for n in graph.nodes if n.op == "attention"):
        m.attention.append(attn)
        a = attn.attrs
        for value, num in zip(attn.inputs, (a["num_heads"], a["num_kv_heads"], a["num_kv_heads"])):
            v, p = value, producers.get(value)
            while p is not None and (p.op in ("rope", "position_scale")
                                     or (p.op in PER_HEAD_NORMS and p.attrs.get("head_dim"))):
                if p.op == "rope":  # its num_heads attr becomes the rank's
                    m.head_nodes[id(p)] = (p, num)
                elif "weight" in p.weights and graph.params[p.weights["weight"]].dim() == 2:
                    m.head_gains[id(p)] = (p, num)
                v = p.inputs[0]
                p = producers.get(v)
            if p is None or p.op != "linear":
                raise _fail(f"attention {attn.source} reads %{value}, which does not come from a linear "
                            f"(through rope / per-head norms); the shard pass cannot split its heads")
            column(p, "qkv").members[p.outputs.index(v)] = [_Member(num * a["head_dim"], num, a["head_dim"])]
        for u in users.get(attn.outputs[0], []):
            if u.op != "linear" or "split_sizes" in u.attrs:
                raise _fail(f"attention output of {attn.source} is read by {u.op} {u.source}; the shard pass "
                            f"expects only the output projection (a linear)")
            m.rows[id(u)] = (u, "o_proj")

    for down in graph.nodes:
        if down.op != "linear" or id(down) in m.rows:
            continue
        p = producers.get(down.inputs[0])
        up = producers.get(p.inputs[0]) if p is not None and p.op in UNARY_ACTIVATIONS else None
        plain = up is not None and up.op == "linear"  # fc1 -> act -> fc2 (Phi-2, GPT-NeoX, Starcoder2; Apertus's xIELU)
        if p is None or not (p.op == "silu_mul" or (p.op == "elementwise" and p.attrs["fn"] == "mul") or plain):
            continue
        m.rows[id(down)] = (down, "down_proj")
        frontier = [(down.inputs[0], False)]
        while frontier:
            v, halves = frontier.pop()
            p = producers.get(v)
            if p is not None and p.op == "linear":
                out_f = p.attrs["split_sizes"][p.outputs.index(v)] if "split_sizes" in p.attrs \
                    else p.attrs["out_features"]
                sizes = [out_f // 2, out_f // 2] if halves else [out_f]
                column(p, "gate_up").members[p.outputs.index(v)] = [_Member(s) for s in sizes]
            elif p is not None and p.op == "silu_mul":
                frontier += [(i, len(p.inputs) == 1) for i in p.inputs]
            elif p is not None and (p.op in UNARY_ACTIVATIONS or (p.op == "elementwise" and p.attrs["fn"] == "mul")):
                frontier += [(i, False) for i in p.inputs]
            else:
                raise _fail(f"the MLP input of {down.source} comes from {p.op if p else 'a graph input'} "
                            f"{p.source if p else v}; expected gate/up linears through silu_mul or act * mul, or "
                            f"one linear through an activation")
    for col in m.columns.values():
        heads = col.node.attrs.get("split_heads")
        if heads and any(mem.num_heads != heads for members in col.members.values() for mem in members):
            raise _fail(f"linear {col.node.source} holds {heads} heads' q/k/v rows side by side (split_heads) but "
                        f"its parts do not all have {heads} heads; the shard pass splits such a linear by whole heads")
        num_outputs = len(col.node.outputs)
        if sorted(col.members) != list(range(num_outputs)):
            raise _fail(f"linear {col.node.source} has outputs that feed neither attention heads nor an MLP; "
                        f"the shard pass cannot split it")
    _check_split_values(graph, m)
    return m


def _check_split_values(graph: Graph, m: _Match) -> None:
    """Values split across ranks may only reach ops that run on a share of the features, and end at a
    row-parallel linear (whose partial sums are all-reduced): anything else would see part of a tensor."""
    split = {o for col in m.columns.values() for o in col.node.outputs}
    for n in graph.nodes:
        # rope's and position_scale's positions are whole
        reads = [i in split for i in n.inputs[:1 if n.op in ("rope", "position_scale") else None]]
        if id(n) in m.rows:
            if not all(reads):
                raise _fail(f"{n.source} was matched as row-parallel but reads a whole (replicated) value")
            continue
        if not any(reads):
            continue
        local = n.op in _LOCAL_OPS or (n.op in PER_HEAD_NORMS and n.attrs.get("head_dim"))
        if not local or not all(reads):
            raise _fail(f"{n.op} {n.source or n.outputs[0]} reads a value split across ranks "
                        f"({', '.join(i for i in n.inputs if i in split)}); the shard pass only runs rope, per-head "
                        f"norms, activations, silu_mul, elementwise ops and attention on split values")
        split.update(n.outputs)


def _vocab_nodes(graph: Graph) -> list[Node]:
    """The nodes ``vocab_parallel`` splits by rows: the token embedding and the lm_head. A table looked up by the
    positions (GPT-2's learned position embeddings) has no vocabulary rows: it stays whole, like the norms."""
    return [n for n in graph.nodes if n.op == "lm_head" or (n.op == "embedding" and n.inputs == ["input_ids"])]


def _vocab_rows(graph: Graph, node: Node) -> int:
    """Vocabulary rows of the embedding table or the lm_head (plain, or quantized: its codes' rows)."""
    return int(graph.params[node.weights["weight" if "weight" in node.weights else "qweight"]].shape[0])


def _divisors_ok(tp_size: int, graph: Graph, m: _Match, vocab_parallel: bool) -> str | None:
    """Why ``tp_size`` cannot split this graph, or None."""
    for attn in m.attention:
        heads, kv = attn.attrs["num_heads"], attn.attrs["num_kv_heads"]
        if heads % tp_size:
            return f"tp_size {tp_size} does not divide num_attention_heads {heads} ({attn.source})"
        if tp_size <= kv and kv % tp_size:
            return f"tp_size {tp_size} does not divide num_key_value_heads {kv} ({attn.source})"
        if tp_size > kv and tp_size % kv:
            return (f"tp_size {tp_size} is above num_key_value_heads {kv} but not a multiple of it ({attn.source}): "
                    f"the kv heads cannot be replicated evenly")
    for node, role in m.rows.values():
        if role == "down_proj" and node.attrs["in_features"] % tp_size:
            return (f"tp_size {tp_size} does not divide the intermediate size {node.attrs['in_features']} "
                    f"({node.source})")
    if vocab_parallel:
        for n in _vocab_nodes(graph):
            rows = _vocab_rows(graph, n)
            if rows % tp_size:
                return (f"tp_size {tp_size} does not divide the vocabulary size {rows} of {n.op} {n.source}; "
                        f"set parallel.vocab_parallel: false (replicated embedding and lm_head)")
    return None


def check_tp_size(graph: Graph, tp_size: int, vocab_parallel: bool = False) -> None:
    """Raise PassError, naming the sizes that would work, if this graph cannot be split ``tp_size`` ways.

    Cheap (structure and shapes only): the pipeline calls it right after tracing, so a bad tp_size stops the
    build before calibration. Quantization group boundaries are checked by the pass itself."""
    if tp_size < 1:
        raise _fail(f"tp_size must be >= 1, got {tp_size}")
    if tp_size == 1:
        return
    for n in (n for n in graph.nodes if n.op == "moe"):
        inter = n.attrs["intermediate_size"]
        if inter % tp_size:
            ok = [t for t in range(1, min(inter, 64) + 1) if inter % t == 0]
            raise _fail(f"tp_size {tp_size} does not divide the experts' intermediate size {inter} of {n.source} "
                        f"(each rank takes an equal share of every expert's features); pick tp_size "
                        f"{', '.join(map(str, ok))}")
    m = match(graph)
    why = _divisors_ok(tp_size, graph, m, vocab_parallel)
    if why is not None:
        limit = max([a.attrs["num_heads"] for a in m.attention] + [tp_size])
        ok = [t for t in range(1, limit + 1) if _divisors_ok(t, graph, m, vocab_parallel) is None]
        raise _fail(f"{why}; pick tp_size {', '.join(map(str, ok[:-1]))}{' or ' if len(ok) > 1 else ''}{ok[-1]}")


def check_tp_groups(graph: Graph, tp_size: int, targets: list[int], group_size: int, bits: int, key: str) -> None:
    """Raise PassError before calibration if the quantization about to run (groups of ``group_size`` input columns,
    ``bits``-bit codes, on the linears ``targets``) would leave a row-parallel linear whose rank share of input
    columns cuts a group (or, 4-bit, a packed byte): what the shard pass would refuse after calibration and gates.
    ``key`` names the recipe's section."""
    if tp_size == 1 or (group_size == -1 and bits != 4):
        return
    rows = match(graph).rows
    for i in targets:
        node = graph.nodes[i]
        if id(node) not in rows:
            continue
        in_f = node.attrs["in_features"]
        local = in_f // tp_size
        if bits == 4 and local % 2:  # two 4-bit codes a byte: no group size helps
            raise _fail(f"tp_size {tp_size} splits the input of {node.source} ({in_f}) into {local} columns per "
                        f"rank, an odd number: packed 4-bit codes ({key}) hold two columns per byte; pick a tp_size "
                        f"that leaves it even")
        if group_size != -1 and local % group_size:
            fits = ", ".join(str(g) for g in (256, 128, 64, 32, 16, 8) if local % g == 0) or "none of the usual sizes"
            raise _fail(f"tp_size {tp_size} splits the input of {node.source} ({in_f}) into {local} columns per "
                        f"rank, which cuts the quantization groups of {group_size} that {key} asks for; set "
                        f"{key}.group_size to one dividing {local} ({fits}) or -1 (per channel), or pick another "
                        f"tp_size")


# --- weights -------------------------------------------------------------------------------------
def _expert_slices(node: Node, role: str, tp_size: int) -> list[tuple[Slice, ...]] | None:
    """Per rank: the share of a moe node's weight role when every expert's intermediate features are split (each
    rank runs every expert on its features: gate and up rows, down columns; its output a partial sum); None =
    replicated (the router; the down projection's per-output-channel scales)."""
    inter = node.attrs["intermediate_size"]
    ranges = even_ranges(inter, tp_size)
    quant = node.attrs.get("quant") or {}
    if quant.get("scheme") == "fp8_block":  # scales per [bn, bk] block: each rank's share whole blocks both ways
        bn, bk = quant["block_size"]
        if any(a % bn or b % bn or a % bk or b % bk for a, b in ranges):
            raise _fail(f"{node.source}: its block-FP8 experts have blocks of {bn} x {bk}; tp_size {tp_size} gives "
                        f"each rank {inter // tp_size} of the {inter} intermediate features, which cuts a block; "
                        f"pick a tp_size whose share is a multiple of {max(bn, bk)}")
        if role == "w_gate_up_scale":  # [E, 2I / bn, hidden / bk]: gate and up row blocks
            return [(Slice(1, a // bn, b // bn), Slice(1, (inter + a) // bn, (inter + b) // bn)) for a, b in ranges]
        if role == "w_down_scale":  # [E, hidden / bn, I / bk]: column blocks
            return [(Slice(2, a // bk, b // bk),) for a, b in ranges]
    if role in ("w_gate_up", "w_gate_up_scale", "b_gate_up", "w_gate_up_scales", "w_gate_up_zeros"):
        return [(Slice(1, a, b), Slice(1, inter + a, inter + b)) for a, b in ranges]  # [E, 2I, ...]: gate, up rows
    if quant.get("scheme") == "w4a16" and role in ("w_down", "w_down_scales", "w_down_zeros"):
        # W4A16 experts: the down projection's input columns are packed two per byte [E, hidden, I / 2] and grouped
        # [E, hidden, I / group_size]: each rank's share must start and end on a group boundary
        g = quant["group_size"]
        if g == -1 or any(a % g or b % g for a, b in ranges):
            raise _fail(f"{node.source}: its w4a16 experts' down projection has groups of "
                        f"{'all ' if g == -1 else ''}{inter if g == -1 else g} of the {inter} intermediate features; "
                        f"tp_size {tp_size} would cut a group (each rank takes {inter // tp_size}); pick a tp_size "
                        f"whose share is a multiple of the group size"
                        + ("" if quant.get("source") else ", or a smaller group_size"))
        div = 2 if role == "w_down" else g
        return [(Slice(2, a // div, b // div),) for a, b in ranges]
    if role == "w_down":  # [E, hidden, I]
        return [(Slice(2, a, b),) for a, b in ranges]
    return None



def _column_slices(col: _Column, tp_size: int) -> list[tuple[Slice, ...]]:
    """Per rank: the rows of each member, in member order (q_r, k_r, v_r / gate_r, up_r); for q/k/v rows held
    per head (``split_heads``), the rows of the rank's heads, one block."""
    heads = col.node.attrs.get("split_heads")
    if heads:
        rows = col.node.attrs["out_features"] // heads
        return [(Slice(0, a * rows, b * rows),) for a, b in even_ranges(heads, tp_size)]
    out: list[list[Slice]] = [[] for _ in range(tp_size)]
    offset = 0
    for index in sorted(col.members):
        for member in col.members[index]:
            for r, (a, b) in enumerate(member.ranges(tp_size)):
                out[r].append(Slice(0, offset + a, offset + b))
            offset += member.size
    return [tuple(s) for s in out]


def _row_slices(node: Node, role: str, tp_size: int) -> list[tuple[Slice, ...]] | None:
    """Per rank: the input columns of one weight role of a row-parallel linear; None = replicated."""
    in_f = node.attrs["in_features"]
    local = in_f // tp_size
    quant = node.attrs.get("quant") or {}
    scheme = quant.get("scheme", "none")
    if role == "weight_scale" and scheme == "fp8_block":  # [out blocks, in blocks]: each rank its input blocks
        return _block_slices(node, [(Slice(1, r * local, (r + 1) * local),) for r in range(tp_size)],
                            quant["block_size"][1], tp_size)
    if role in ("weight_scale", "input_scale"):  # per output channel or per tensor: whole on every rank
        return None
    if role == "perm":
        raise _fail(f"{node.source} reads its input in act-order (a `perm` of all {in_f} input columns, from a "
                    f"pre-quantized checkpoint), which a row-parallel split cannot cut; build with tp_size 1 or "
                    f"from a checkpoint quantized without act-order (desc_act false)")
    if role == "pre_quant_scale":  # [in]: each rank scales its own input columns
        return [(Slice(0, r * local, (r + 1) * local),) for r in range(tp_size)]
    if role == "qweight" and scheme == "w4a16":
        if local % 2:
            raise _fail(f"tp_size {tp_size} splits the input of {node.source} ({in_f}) into {local} columns, an odd "
                        f"number: packed 4-bit codes hold two columns per byte; pick a tp_size that leaves it even")
        return [(Slice(1, r * local // 2, (r + 1) * local // 2),) for r in range(tp_size)]
    if role in ("scales", "zeros"):
        group = quant["group_size"]
        if group == -1:  # one group per output row: the same scale for every column of the row
            return None
        if local % group:
            cut = (f"tp_size {tp_size} splits the input of {node.source} ({in_f}) into {local} columns per rank, "
                   f"which cuts its quantization groups of {group}")
            if quant.get("source"):  # a pre-quantized checkpoint's groups are as they were made
                raise _fail(f"{cut} (the {quant['source']} checkpoint's own); pick a tp_size whose share of the "
                            f"{in_f} columns is a multiple of {group}")
            fits = [g for g in (256, 128, 64, 32, 16, 8) if local % g == 0]
            raise _fail(f"{cut}; build with a group_size dividing {local} "
                        f"({', '.join(map(str, fits)) or 'none of the usual sizes'}), per channel (-1), or another "
                        f"tp_size")
        return [(Slice(1, r * local // group, (r + 1) * local // group),) for r in range(tp_size)]
    return [(Slice(1, r * local, (r + 1) * local),) for r in range(tp_size)]


def _block_slices(node: Node, pieces: list[tuple[Slice, ...]], block: int, tp_size: int) -> list[tuple[Slice, ...]]:
    """Per rank: the rows (dim 0) or columns (dim 1) of an fp8_block weight's scales [out / bn, in / bk] for the
    pieces ``pieces`` of its codes, one scale per ``block`` codes; a piece that does not start and end on a block
    boundary would split a block's scale between ranks (and misalign the rank's blocks), and is an error."""
    for piece in (p for rank in pieces for p in rank):
        if piece.start % block or piece.stop % block:
            what = "output rows" if piece.dim == 0 else "input columns"
            size = piece.stop - piece.start
            raise _fail(f"tp_size {tp_size} splits the {what} of {node.source} into pieces of {size} (from "
                        f"{piece.start}), which cut its fp8_block scale blocks of {block} {what}; pick a tp_size whose "
                        f"share of every projection is a multiple of {block}, or build with tp_size 1")
    return [tuple(Slice(p.dim, p.start // block, p.stop // block) for p in rank) for rank in pieces]


def _per_row_slices(graph: Graph, node: Node, role: str, rows: list[tuple[Slice, ...]],
                    num_rows: int) -> list[tuple[Slice, ...]] | None:
    """Per rank: a column- or vocab-parallel node's weight role cut by the output rows ``rows`` of its codes: per-row
    tensors with the rows, fp8_block scales with their row blocks; None = replicated (per-tensor scales, and what
    applies to the input, whole on every rank: perm, pre_quant_scale)."""
    quant = node.attrs.get("quant") or {}
    if role == "weight_scale" and quant.get("scheme") == "fp8_block":
        return _block_slices(node, rows, quant["block_size"][0], len(rows))
    t = graph.params[node.weights[role]]
    per_row = role not in ("input_scale", "perm", "pre_quant_scale") and t.dim() >= 1 and t.shape[0] == num_rows
    return rows if per_row else None


class _Assigner:
    """Collects each weight's per-rank slices; a weight split two different ways is an error."""

    def __init__(self, tp_size: int) -> None:
        self.tp_size = tp_size
        self.slices: dict[str, list[tuple[Slice, ...]]] = {}

    def __call__(self, name: str, slices: list[tuple[Slice, ...]] | None, who: str) -> None:
        slices = slices or [()] * self.tp_size
        old = self.slices.setdefault(name, slices)
        if old != slices:
            raise _fail(f"weight {name} is shared by nodes that split it differently (one is {who}); "
                        f"untie it or keep it replicated")


def _local_shape(t: torch.Tensor, pieces: tuple[Slice, ...]) -> list[int]:
    shape = list(t.shape)
    if pieces:
        shape[pieces[0].dim] = sum(s.stop - s.start for s in pieces)
    return shape


# --- the pass ------------------------------------------------------------------------------------
@register
class Shard(Pass):
    """Split attention heads and MLP features over tp_size ranks; all_reduce after the row-parallel linears."""

    name = "shard"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        opts = ctx.options.get(self.name, {})
        tp_size, vocab_parallel = int(opts.get("tp_size", 1)), bool(opts.get("vocab_parallel", False))
        if tp_size == 1:
            return PassResult(graph, 0, 0, {"tp_size": 1})
        check_tp_size(graph, tp_size, vocab_parallel)
        m = match(graph)
        assign = _Assigner(tp_size)
        names = NameGen.for_graph(graph)
        after: dict[int, Node] = {}  # id(node) -> collective to insert right after it

        def collective(node: Node, op: str, weights: dict[str, str] | None = None) -> None:
            partial = names(f"{node.outputs[0]}_partial")
            after[id(node)] = Node(op, [partial], [node.outputs[0]], weights or {}, {"tp_size": tp_size}, node.source)
            node.outputs = [partial]

        for col in m.columns.values():
            n = col.node
            assert RULES[col.role].split == "column" and RULES[col.role].collective is None
            rows = _column_slices(col, tp_size)
            for role, w in n.weights.items():  # per-tensor scales: replicated
                assign(w, _per_row_slices(graph, n, role, rows, n.attrs["out_features"]), n.source)
            local = [sum(mem.local_size(tp_size) for mem in col.members[i]) for i in sorted(col.members)]
            n.attrs["out_features"] = sum(local)
            if "split_heads" in n.attrs:  # the same parts per head, fewer heads
                n.attrs["split_heads"] //= tp_size
            elif "split_sizes" in n.attrs:
                n.attrs["split_sizes"] = local

        for node, role in m.rows.values():
            for w_role, w in list(node.weights.items()):
                if w_role == "bias":
                    continue
                assign(w, _row_slices(node, w_role, tp_size), node.source)
            bias = node.weights.pop("bias", None)
            node.attrs["in_features"] //= tp_size
            collective(node, RULES[role].collective, {"bias": bias} if bias else None)
            if bias:
                assign(bias, None, node.source)

        moes = [n for n in graph.nodes if n.op == "moe"]
        for node in moes:  # every rank runs every expert on its share of their features; partial sums all-reduced
            if "b_down" in node.weights:  # added by every rank, so 1 / tp_size of it each (exact for powers of 2)
                name = node.weights["b_down"]
                if any(name in n.weights.values() for n in graph.nodes if n is not node):
                    raise _fail(f"the down-projection bias {name} of {node.source} is shared with another node; the "
                                f"shard pass divides it by tp_size for this one")
                graph.params[name] = graph.params[name] / tp_size
            for role, w in node.weights.items():
                assign(w, _expert_slices(node, role, tp_size), node.source)
            node.attrs["intermediate_size"] //= tp_size
            collective(node, "all_reduce")

        kv_replicated = any(tp_size > a.attrs["num_kv_heads"] for a in m.attention)
        for attn in m.attention:
            if "sinks" in attn.weights:  # one sink logit per query head: each rank its own heads'
                local = local_heads(attn.attrs["num_heads"], tp_size)
                assign(attn.weights["sinks"], [(Slice(0, r * local, (r + 1) * local),) for r in range(tp_size)],
                       attn.source)
            attn.attrs["num_heads"] = local_heads(attn.attrs["num_heads"], tp_size)
            attn.attrs["num_kv_heads"] = local_heads(attn.attrs["num_kv_heads"], tp_size)
        for node, num in m.head_nodes.values():
            node.attrs["num_heads"] = local_heads(num, tp_size)
        for node, num in m.head_gains.values():  # [heads, head_dim] gains (and biases): each rank its own heads' rows
            for role in ("weight", "bias"):
                if role in node.weights:
                    assign(node.weights[role], [(Slice(0, a, b),) for a, b in head_ranges(num, 1, tp_size)],
                           node.source)

        if vocab_parallel:
            for n in _vocab_nodes(graph):
                rows = _vocab_rows(graph, n)
                ranges = [(Slice(0, a, b),) for a, b in even_ranges(rows, tp_size)]
                for role, w in n.weights.items():  # per-tensor scales: replicated
                    assign(w, _per_row_slices(graph, n, role, ranges, rows), n.source)
                if n.op == "embedding":
                    n.attrs["vocab_parallel"] = True
                if "out_features" in n.attrs:  # a quantized lm_head records its shape per rank, as linears do
                    n.attrs["out_features"] = rows // tp_size
                collective(n, RULES[n.op].collective)

        graph.nodes = [x for n in graph.nodes for x in ((n, after[id(n)]) if id(n) in after else (n,))]
        used = {w for n in graph.nodes for w in n.weights.values()}
        full = {k: v for k, v in graph.params.items() if k in used}
        for name in full:  # everything not split above is replicated
            assign.slices.setdefault(name, [()] * tp_size)
        graph.shards = ShardedWeights(tp_size, full, {k: assign.slices[k] for k in full})
        graph.params = {k: torch.empty(_local_shape(t, assign.slices[k][0]), dtype=t.dtype, device="meta")
                        for k, t in full.items()}
        attn0 = m.attention[0].attrs if m.attention else {}
        graph.meta["tensor_parallel"] = {
            "tp_size": tp_size, "vocab_parallel": vocab_parallel,
            "num_heads_per_rank": attn0.get("num_heads", 0), "num_kv_heads_per_rank": attn0.get("num_kv_heads", 0),
        }
        num_split = len(m.columns) + len(m.rows)
        details: dict[str, Any] = {
            "tp_size": tp_size, "column_linears": len(m.columns), "row_linears": len(m.rows),
            "collectives": len(after), "vocab_parallel": vocab_parallel, "kv_heads_replicated": kv_replicated,
        }
        if moes:
            details["moe_layers"] = len(moes)
        return PassResult(graph, num_split, num_split, details)
