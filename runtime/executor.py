"""Runs an artifact's graph over a packed batch of tokens.

The graph (``graph.json``) is compiled once into a list of closures, one per node, each bound to its
weights and attributes. A step runs them in order over ``[num_tokens, features]`` tensors; the
attention op is the only one that sees sequence boundaries, through ``StepInput.seqs``.

    packed tokens:  | seq 0: num_new_0 | seq 1: num_new_1 | ... |
    positions:      | c0, c0+1, ...    | c1, c1+1, ...    | ... |   (c_i = tokens already cached)
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from kernels import torch_ops as ops
from runtime.collectives import all_reduce_for
from runtime.kv_cache import KVLayout, SequenceKV
from runtime.manifest import MAX_SCALE_BLOCK
from kernels.torch_quant import (fp8_fast_accum, int8_act_qmin, make_fp8_scaled_mm_linear, make_quant_linear,
                                  permute_input, scale_input)

GRAPH_IR_VERSION = 1  # the graph IR version this runtime executes
# the kernel path's fusions across nodes (plan_fusions); RUNTIME_FUSE_ROPE=0 / RUNTIME_FUSE_SWIGLU=0 /
# RUNTIME_FUSE_NORM_QUANT=0 turn one off (A/B measurements: builder/devtools/gpu_suite.sh ab-PREC)
FUSE_ROPE = os.environ.get("RUNTIME_FUSE_ROPE", "1") != "0"
FUSE_SWIGLU = os.environ.get("RUNTIME_FUSE_SWIGLU", "1") != "0"
FUSE_NORM_QUANT = os.environ.get("RUNTIME_FUSE_NORM_QUANT", "1") != "0"
# decode-only steps write the step's K/V (after RoPE, when fused) in the decode attention kernel itself
# (``kernels.paged_attention.NewKV``: one launch per layer instead of two); RUNTIME_FUSE_KV_WRITE=0: the separate
# write (rope_write_kv_cache / write_kv_cache) before it, as prefill steps do
FUSE_KV_WRITE = os.environ.get("RUNTIME_FUSE_KV_WRITE", "1") != "0"
# RUNTIME_FUSE_NORM_LINEAR=1 turns on plan_fusions' residual_out / pending_norms (off: with PDL on it measured slower
# than the norm kernels it removes; docs/BENCHMARKS.md, session 23)
FUSE_NORM_INTO_LINEARS = os.environ.get("RUNTIME_FUSE_NORM_LINEAR", "0") == "1"
# RUNTIME_PREFILL_OWN_KV=1: an eager step of fresh prompts only (no cached context, ``PagedAttentionMetadata.fresh``)
# over a 16-bit cache runs its attention over the step's own rotated keys and values (contiguous rows) instead of the
# cache's blocks (``paged_prefill_attention(contiguous_kv=)``; the same values, bit for bit). Off until timed on a GPU:
# the paged prefill kernel was about half of SDPA's speed on fresh 2,048-token prompts (docs/BENCHMARKS.md, session 39)
PREFILL_OWN_KV = os.environ.get("RUNTIME_PREFILL_OWN_KV", "0") == "1"


def _auto_setting(name: str) -> bool | None:
    """An ``auto`` / ``1`` / ``0`` environment setting (case and surrounding spaces ignored, empty: auto) as None,
    True or False."""
    raw = os.environ.get(name, "auto")
    modes = {"auto": None, "1": True, "0": False}
    value = raw.strip().lower() or "auto"
    if value not in modes:
        raise ValueError(f"{name}={raw!r} is not one of {', '.join(modes)}")
    return modes[value]


# RUNTIME_PREFILL_OWN_CODES: a step carrying prefill over a quantized cache, in a layer with RoPE, has the rope kernel
# leave the codes it writes to the cache in k and v too (exact in the activation dtype), and its new tokens attend
# over those rows, their context over the cache (``paged_prefill_attention(contiguous_kv=)``): the same keys and
# values, without converting each key tile's codes for every query tile (the own rows' products take the activation
# dtype's operands, where a quantized cache's take fp16 ones). "auto" (the default): FP8 caches; "1": INT8 ones too
# (not timed); "0": none. H200, FP8 cache (docs/BENCHMARKS.md, session 43, the kernel as it is): one fresh
# 2,048-token prompt 184.1 -> 147.2 us, after a 6,144-token context 966.0 -> 918.5, four of 512 63.9 -> 62.1; an
# FP8-KV 8B artifact at 2048/128, 256 sequences, 3,027 output tok/s with it and the mixed split (an earlier version
# of the kernel, with bf16 operands throughout: 2,948 / 2,960 -> 2,990 / 2,990 in one call)
PREFILL_OWN_CODES: bool | None = _auto_setting("RUNTIME_PREFILL_OWN_CODES")
# RUNTIME_MIXED_DECODE_SPLIT: a step that mixes decodes with prompts or chunks (``PagedAttentionMetadata.mixed``)
# attends its decodes (sequences of one new token) on the decode kernel and the rest on the prefill kernel
# (``kernels.paged_attention.paged_mixed_attention``; StepGraphs then captures such steps apart) instead of all on the
# prefill kernel, which reads a decode's keys at about half the decode kernel's bandwidth over an FP8 cache.
# "auto" (the default): layers whose cache is FP8; "1": every layer; "0": none. Measured on an H200
# (docs/BENCHMARKS.md, session 43): FP8 cache, 256 decodes over 2,048 keys beside a 512-token prompt 653.9 -> 362.9
# us (64 decodes over 512 keys beside 128 prompt tokens: 59.4 -> 62.1), and an FP8-KV 8B artifact at 2048/128, 256
# sequences, 2,900 -> 2,990 output tok/s in one call; a bf16 cache 560.0 -> 584.9 us (its prefill kernel reads
# decodes within 1.1x of the decode kernel, and the split adds three launches a layer). INT8 caches: not timed.
MIXED_DECODE_SPLIT: bool | None = _auto_setting("RUNTIME_MIXED_DECODE_SPLIT")


def mixed_decode_split(kv_dtype: torch.dtype) -> bool:
    """Whether a layer whose cache stores ``kv_dtype`` attends a mixed step's decodes on the decode kernel
    (``MIXED_DECODE_SPLIT``; auto: an FP8 cache)."""
    if MIXED_DECODE_SPLIT is not None:
        return MIXED_DECODE_SPLIT
    return kv_dtype == torch.float8_e4m3fn


def prefill_own_codes(kv_dtype: torch.dtype) -> bool:
    """Whether a layer whose cache stores ``kv_dtype`` prefills over the step's own codes (``PREFILL_OWN_CODES``;
    auto: an FP8 cache; on: any quantized cache)."""
    if PREFILL_OWN_CODES is None:
        return kv_dtype == torch.float8_e4m3fn
    return PREFILL_OWN_CODES and kv_dtype in KV_STORAGE.values()


# Weight roles of a linear / lm_head that act on its input before the matmul (an imported act-order gather, an
# exporter's per-input-channel scale): such a linear reads plain rows, so no fusion hands it anything else
INPUT_ROLES = ("perm", "pre_quant_scale")
# LongRoPE (a rope node's long_from: its model's original_max_position_embeddings): Hugging Face rotates a sequence
# within long_from tokens with the first table and, once it is longer, all of it with the second (Phi-3's generation
# recomputes its cache then; see runtime.scheduler). The engines give a sequence on the second table positions offset
# by LONG_ROPE_OFFSET; the rope ops read p + LONG_ROPE_OFFSET as position p on the second table, and everything else
# that reads positions takes them modulo the offset (DecodeGraphs' lengths).
LONG_ROPE_OFFSET = 1 << 24


def sequence_positions(long_from: int | None, start: int, num: int, length: int,
                       device: torch.device | str | None = None) -> torch.Tensor:
    """Positions start .. start + num - 1 of a sequence of ``length`` tokens, offset onto LongRoPE's second table
    (LONG_ROPE_OFFSET) where the sequence is longer than the switch ``long_from`` (None: no LongRoPE)."""
    offset = LONG_ROPE_OFFSET if long_from is not None and length > long_from else 0
    return torch.arange(offset + start, offset + start + num, device=device)


def long_rope_from(graph: dict[str, Any]) -> int | None:
    """The sequence length past which the graph's LongRoPE rotates with its second table, or None (one table)."""
    return next((n["attrs"]["long_from"] for n in graph["nodes"]
                 if n["op"] == "rope" and n.get("attrs", {}).get("long_from") is not None), None)
# every weight role a linear / lm_head may carry (passes/ir.py QUANT_SCHEMES and QUANT_ROLES); another is refused
LINEAR_ROLES = ("weight", "bias", "qweight", "scales", "zeros", "weight_scale", "input_scale") + INPUT_ROLES


class GraphFormatError(ValueError):
    """graph.json is malformed, of another IR version, or uses an op this runtime lacks."""


@dataclass
class SeqSlice:
    """One sequence's share of a step."""

    kv: SequenceKV  # its cache; the step appends num_new tokens after num_context
    num_context: int  # tokens already in the cache before this step
    num_new: int  # tokens of this sequence packed into the step


@dataclass
class PagedAttentionMetadata:
    """The step's sequences over a paged KV cache as batched tensors, for the fused attention kernels
    (``kernels.paged_attention``). Built by the serving engine; fixed-shape for a CUDA-graph bucket."""

    k_caches: list[torch.Tensor]  # per layer: [num_blocks, block_size, num_kv_heads, head_dim]
    v_caches: list[torch.Tensor]
    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot of each new token; -1 = padding
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded
    seq_lens: torch.Tensor  # [num_seqs] int32: context + new tokens
    context_lens: torch.Tensor  # [num_seqs] int32: tokens cached before this step
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32: packed row offsets of each sequence's new tokens
    decode_only: bool  # every sequence has exactly one new token (the decode kernel applies)
    fresh: bool = False  # every sequence is a prompt with no cached context (set by the eager path only; graphs: False)
    # some sequences have exactly one new token and some more (the steps of mixed_decode_split); set by the host, which
    # knows it: the eager paths from their sequences, StepGraphs by a graph of its own for such steps
    mixed: bool = False
    # decode rows that may be one sequence's consecutive positions (a speculative verify step laid out as decodes,
    # ``runtime.cuda_graphs.DecodeGraphs(chained=True)``): a row attends to keys other rows of the step write, so the
    # K/V are written by their own kernel before the attention reads the cache (not inside the decode kernel)
    chained: bool = False


def mixed_step(num_new: Sequence[int]) -> bool:
    """Whether a step of sequences with these numbers of new tokens mixes decodes (one new token) with others: the
    steps ``mixed_decode_split`` applies to (``PagedAttentionMetadata.mixed``)."""
    return 1 in num_new and any(n > 1 for n in num_new)


@dataclass
class StepInput:
    """Everything a forward step needs besides the weights."""

    input_ids: torch.Tensor  # [num_tokens] int64, sequences packed back to back
    positions: torch.Tensor  # [num_tokens] int64, position of each token in its sequence
    seqs: list[SeqSlice]  # in packing order; sum(num_new) == num_tokens
    logits_indices: torch.Tensor | None = None  # [num_selected] rows to compute logits for; None = all
    paged: PagedAttentionMetadata | None = None  # set: attention runs the fused kernels over it


@dataclass
class _Step:
    """Per-step scratch shared by the nodes (rotary tables are computed once per step)."""

    inp: StepInput
    rope_cache: dict[str, tuple[torch.Tensor, torch.Tensor]]
    decode_rows: Any = None  # kernels.paged_attention.DecodeRows of a mixed step, made by its first attention layer


Kernel = Callable[[list[torch.Tensor], _Step], tuple[torch.Tensor, ...]]


@dataclass
class _Fusions:
    """Work the kernel path moves from one node into a later one, planned once from the graph (graph.json is
    unchanged; the CPU path and calibration run every node as written). An absorbed node compiles to the
    identity on its first input, so the node that absorbs it reads what the absorbed node read."""

    absorbed: set[int]  # nodes whose work a later node does
    rope: dict[int, tuple[dict[str, Any], str]]  # attention node -> (its q rope node, the positions' value name)
    gated: set[int]  # weight-only (mma layout) and unquantized linears that form silu(gate) * up from the [gate | up]
    # they read
    # norms and SwiGLUs whose rows feed one W8A8 linear (FP8 on cuBLAS's _scaled_mm, or INT8): where that linear
    # takes quantized rows (_quantize_to) they leave quantized, as QuantizedRows: per token (dynamic activations), or
    # at the linear's calibrated input scale (static_inputs)
    quant_producers: dict[int, int] = field(default_factory=dict)  # producer node -> the linear it feeds
    # producer node -> that linear's (input_scale, act_qmin: its lowest INT8 code), filled at load
    static_inputs: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)
    # weight-only linears on the frag layout whose merged [gate | up] output feeds a SwiGLU: they output
    # silu(gate) * up themselves (``w4a16_frag(..., gated=True)``; the SwiGLU node is absorbed)
    swiglu_out: set[int] = field(default_factory=set)
    # frag linears whose only reader is a residual-add + RMSNorm: they add their output to the residual (the extra
    # input named here) and leave its rows' sums of squares (``w4a16_frag(..., residual=)``); the norm node then
    # passes a ``PendingNorm`` to its readers, frag linears that apply it as they load x (no norm kernel)
    residual_out: dict[int, str] = field(default_factory=dict)
    pending_norms: set[int] = field(default_factory=set)
    # residual adds whose sum a LayerNorm reads -> that norm: the add's node computes both in one kernel
    # (``kernels.fused_norm.fused_add_layer_norm``, as fused_add_rms_norm does for RMSNorm) and the norm's node does
    # nothing; the sum is still the add's output for its other readers
    add_layer_norms: dict[int, int] = field(default_factory=dict)


def plan_fusions(nodes: list[dict[str, Any]], num_consumers: dict[str, int],
                 dtype: torch.dtype = torch.bfloat16, scaled_mm: bool = False) -> _Fusions:
    """The fusions the Triton kernels take: RoPE of q and k into the attention's KV write
    (``kernels.paged_attention.rope_write_kv_cache``: one kernel for three), the SwiGLU of a merged gate/up
    into the down projection when that is a weight-only linear on ``kernels.w4a16_mma`` or an unquantized one
    (``dense_gemv`` at a decode step's rows) (``gated``), the quantization of the rows of a norm or a SwiGLU into
    the W8A8 linear reading them (FP8 where it runs ``_scaled_mm``: ``scaled_mm``, ``_scaled_mm_device``; INT8 on
    any device), per token or at the linear's calibrated scale (``quant_producers``; the scales are filled in at
    load: ``static_inputs``), and a residual add with the LayerNorm of its sum (``add_layer_norms``). A value a
    fusion would hide must have no other reader."""
    from kernels import gemv, w4a16_frag, w4a16_mma
    from kernels.paged_attention import SUPPORTED_HEAD_DIMS

    producer = {name: i for i, node in enumerate(nodes) for name in node["outputs"]}
    readers: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        for name in node["inputs"]:
            readers.setdefault(name, []).append(i)
    fusions = _Fusions(set(), {}, set())
    for i, node in enumerate(nodes):
        attrs = node.get("attrs", {})
        if node["op"] == "linear" and FUSE_SWIGLU and _swiglu_producer(node, nodes, readers, dtype):
            fusions.swiglu_out.add(i)
            fusions.absorbed.add(readers[node["outputs"][0]][0])
        if node["op"] == "linear" and FUSE_NORM_INTO_LINEARS and _norm_into_linears(node, nodes, readers, dtype):
            j = readers[node["outputs"][0]][0]
            residual = next(n for n in nodes[j]["inputs"] if n != node["outputs"][0])
            if j not in fusions.pending_norms and producer.get(residual, -1) < i:  # the residual exists by then
                fusions.residual_out[i] = residual
                fusions.pending_norms.add(j)
        if i in fusions.swiglu_out:
            continue
        if node["op"] == "attention" and FUSE_ROPE and attrs["head_dim"] in SUPPORTED_HEAD_DIMS:
            q, k = node["inputs"][:2]
            rq, rk = (nodes[producer[n]] if n in producer else None for n in (q, k))
            if (rq is None or rk is None or rq["op"] != "rope" or rk["op"] != "rope"
                    or num_consumers.get(q) != 1 or num_consumers.get(k) != 1
                    or num_consumers.get(rq["inputs"][0]) != 1 or num_consumers.get(rk["inputs"][0]) != 1):
                continue
            same = (rq["weights"]["inv_freq"] == rk["weights"]["inv_freq"] and rq["inputs"][1] == rk["inputs"][1]
                    and all(rq["attrs"].get(a, d) == rk["attrs"].get(a, d) for a, d in
                            (("attention_scaling", 1.0), ("rotary_dim", None), ("interleaved", False),
                             ("long_from", None))))
            heads = (rq["attrs"]["num_heads"] == attrs["num_heads"]
                     and rk["attrs"]["num_heads"] == attrs["num_kv_heads"]
                     and rq["attrs"]["head_dim"] == rk["attrs"]["head_dim"] == attrs["head_dim"])
            if same and heads:
                fusions.absorbed |= {producer[q], producer[k]}
                fusions.rope[i] = (rq, rq["inputs"][1])
        elif (node["op"] == "linear" and FUSE_SWIGLU and (attrs.get("quant") or {}).get("scheme") in ("w4a16", "w8a16")
              and (attrs.get("quant") or {}).get("activation_quant") != "fp8"  # W4A8: x is rounded before the kernel
              and not attrs.get("split_sizes") and node["inputs"][0] in producer
              and not set(INPUT_ROLES) & set(node.get("weights", {}))):  # x gathered / scaled first: no SwiGLU
            j = producer[node["inputs"][0]]
            quant, in_features = attrs["quant"], attrs.get("in_features")
            group = in_features if quant.get("group_size") == -1 else quant.get("group_size")
            frag = w4a16_frag.runtime_layout(quant["bits"], group, in_features or 0, attrs.get("out_features") or 0,
                                             dtype)
            if (nodes[j]["op"] == "silu_mul" and len(nodes[j]["inputs"]) == 1 and in_features
                    and j not in fusions.absorbed
                    and num_consumers.get(node["inputs"][0]) == 1 and w4a16_mma.MMA_ENABLED and not frag
                    and w4a16_mma.supports(quant["bits"], group, in_features)):
                fusions.absorbed.add(j)
                fusions.gated.add(i)
        elif (node["op"] == "linear" and FUSE_SWIGLU and not attrs.get("quant") and not attrs.get("split_sizes")
              and gemv.DENSE_RUNTIME_MAX_ROWS > 0 and node["inputs"][0] in producer
              and num_consumers.get(node["inputs"][0]) == 1):
            j = producer[node["inputs"][0]]  # an unquantized down projection: the SwiGLU in dense_gemv's x loads
            if (nodes[j]["op"] == "silu_mul" and len(nodes[j]["inputs"]) == 1 and j not in fusions.absorbed
                    and nodes[j]["outputs"][0] == node["inputs"][0]):
                fusions.absorbed.add(j)
                fusions.gated.add(i)
        elif (node["op"] == "linear" and FUSE_NORM_QUANT and not attrs.get("lm_head")
              and (((attrs.get("quant") or {}).get("scheme") == "fp8" and scaled_mm
                    and dtype in (torch.bfloat16, torch.float16))
                   or ((attrs.get("quant") or {}).get("scheme") == "w8a8_int8"
                       and dtype in (torch.bfloat16, torch.float16, torch.float32)))
              and not set(INPUT_ROLES) & set(node.get("weights", {}))
              and (attrs.get("in_features") or 1) % 16 == 0 and (attrs.get("out_features") or 1) % 16 == 0
              and node["inputs"][0] in producer and num_consumers.get(node["inputs"][0]) == 1):
            j = producer[node["inputs"][0]]
            norm = nodes[j]
            norm_attrs = norm.get("attrs", {})
            norm_ok = (norm["op"] in ("rms_norm", "fused_add_rms_norm") and not norm_attrs.get("weight_offset")
                       and not norm_attrs.get("head_dim"))
            if ((norm_ok or norm["op"] == "silu_mul") and norm["outputs"][0] == node["inputs"][0]
                    and attrs.get("in_features") and attrs.get("out_features")):
                fusions.quant_producers[j] = i
    for i, node in enumerate(nodes):  # residual add -> LayerNorm (GPT-2, StableLM, Starcoder2, OLMo, Falcon, ...)
        if (node["op"] != "elementwise" or node.get("attrs", {}).get("fn") != "add" or len(node["inputs"]) != 2
                or i in fusions.absorbed):
            continue
        norms = [j for j in readers.get(node["outputs"][0], []) if nodes[j]["op"] == "layer_norm"
                 and nodes[j]["inputs"][0] == node["outputs"][0] and j not in fusions.absorbed
                 and not nodes[j].get("attrs", {}).get("head_dim")]
        if len(norms) == 1 and norms[0] not in fusions.add_layer_norms.values():
            fusions.add_layer_norms[i] = norms[0]
    return fusions


def _swiglu_producer(node: dict[str, Any], nodes: list[dict[str, Any]], readers: dict[str, list[int]],
                     dtype: torch.dtype) -> bool:
    """Whether a linear node forms the SwiGLU of its output itself (``_Fusions.swiglu_out``): a frag linear (not an
    lm_head, one unsplit output of whole gate and up tiles) whose only reader is a one-input ``silu_mul``."""
    from kernels import w4a16_frag

    attrs, out = node.get("attrs", {}), node["outputs"]
    if (attrs.get("split_sizes") or attrs.get("lm_head") or len(out) != 1 or len(readers.get(out[0], [])) != 1
            or (attrs.get("out_features") or 0) % (2 * w4a16_frag.TILE_N) or not _frag_linear_node(node, dtype)):
        return False
    silu = nodes[readers[out[0]][0]]
    return silu["op"] == "silu_mul" and silu["inputs"] == out


def _frag_linear_node(node: dict[str, Any], dtype: torch.dtype) -> bool:
    """A 4- or 8-bit weight-only linear the runtime keeps on the frag layout (no act-order gather, no input
    scale)."""
    from kernels import w4a16_frag

    attrs = node.get("attrs", {})
    quant = attrs.get("quant") or {}
    if (node["op"] != "linear" or quant.get("scheme") not in ("w4a16", "w8a16")
            or set(INPUT_ROLES) & set(node.get("weights", {}))):
        return False
    in_features, out_features = attrs.get("in_features") or 0, attrs.get("out_features") or 0
    group = in_features if quant.get("group_size") == -1 else quant.get("group_size")
    return w4a16_frag.runtime_layout(quant.get("bits"), group, in_features, out_features, dtype)


def _norm_into_linears(node: dict[str, Any], nodes: list[dict[str, Any]], readers: dict[str, list[int]],
                       dtype: torch.dtype) -> bool:
    """Whether a linear adds its output to the residual stream itself and the residual-add + RMSNorm after it
    becomes a ``PendingNorm`` for its readers (``_Fusions.residual_out``): a frag linear (not an lm_head, one
    unsplit output) whose only reader is a ``fused_add_rms_norm`` (bf16, a gain, no offset) adding it to another
    value (either input: the sum is the same; ``plan_fusions`` also wants that value made before the linear), and
    every reader of that norm's output is a frag linear too."""
    attrs, out = node.get("attrs", {}), node["outputs"]
    if (dtype != torch.bfloat16 or attrs.get("split_sizes") or attrs.get("lm_head") or len(out) != 1
            or len(readers.get(out[0], [])) != 1 or not _frag_linear_node(node, dtype)):
        return False
    norm = nodes[readers[out[0]][0]]
    if (norm["op"] != "fused_add_rms_norm" or out[0] not in norm["inputs"] or len(set(norm["inputs"])) != 2
            or norm["attrs"].get("weight_offset") or "weight" not in norm.get("weights", {})
            or len(norm["outputs"]) != 2):
        return False
    normed = readers.get(norm["outputs"][0], [])
    return bool(normed) and all(_frag_linear_node(nodes[r], dtype) and nodes[r]["inputs"][0] == norm["outputs"][0]
                                and not nodes[r].get("attrs", {}).get("split_heads") for r in normed)


# ops besides rope that read the positions, as a LongRoPE graph's refusal names them
_POSITION_READERS = {"embedding": "a learned position table", "position_scale": "a query temperature per position"}


def check_graph(graph: dict[str, Any]) -> None:
    """An artifact's graph as loaded, before anything is compiled: GraphFormatError unless this runtime runs its IR
    version and every op, every node reads only the graph's inputs and earlier nodes' outputs, and the graph's
    outputs are written (a graph with a node dropped or reordered would otherwise fail mid-forward). The engines
    call it on what they load; graphs built in memory (the passes' calibration sub-graphs) are not artifacts."""
    if graph.get("ir_version") != GRAPH_IR_VERSION:
        raise GraphFormatError(f"graph IR version {graph.get('ir_version')!r} is not supported by this runtime (it "
                               f"runs version {GRAPH_IR_VERSION}); rebuild the artifact")
    _check_node_fields(graph)
    unknown = next((n for n in graph["nodes"] if n["op"] not in _COMPILERS), None)
    if unknown is not None:
        raise GraphFormatError(f"op {unknown['op']!r} (from {unknown.get('source') or 'unknown'}) is not implemented "
                               f"by this runtime; known: {', '.join(_COMPILERS)}")
    known = set(graph["inputs"])
    for i, node in enumerate(graph["nodes"]):
        missing = next((name for name in node["inputs"] if name not in known), None)
        if missing is not None:
            raise GraphFormatError(f"node {i} ({node['op']}, from {node.get('source') or 'unknown'}) reads "
                                   f"{missing!r}, which no earlier node writes and the graph does not take as an input")
        known.update(node["outputs"])
    missing = next((name for name in graph["outputs"] if name not in known), None)
    if missing is not None:
        raise GraphFormatError(f"the graph's output {missing!r} is written by no node")
    _check_attrs(graph)
    _check_weight_only_quant(graph)
    _check_w8a8_quant(graph)
    _check_input_roles(graph)
    _check_moe_experts(graph)
    _check_logits_output(graph)


def _node_name(i: int, node: dict) -> str:
    return f"node {i} ({node.get('op')}, from {node.get('source') or 'unknown'})"


def _check_node_fields(graph: dict[str, Any]) -> None:
    """The graph's fields have the types the engines read: lists of names, nodes with a string op, lists of input
    and output names, attrs and weights objects (a KeyError or TypeError deep in the compiler otherwise)."""
    for key in ("inputs", "outputs", "nodes"):
        if not isinstance(graph.get(key), list):
            raise GraphFormatError(f"the graph's {key} is {type(graph.get(key)).__name__}, not a list")
    if not isinstance(graph.get("params", {}), dict) or not isinstance(graph.get("meta", {}), dict):
        raise GraphFormatError("the graph's params and meta must be objects")
    params = graph.get("params", {})
    for i, node in enumerate(graph["nodes"]):
        if not isinstance(node, dict) or not isinstance(node.get("op"), str):
            raise GraphFormatError(f"node {i} is not an object with a string op")
        for key in ("inputs", "outputs"):
            names = node.get(key)
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names) \
                    or (key == "outputs" and not names):
                raise GraphFormatError(f"{_node_name(i, node)}: {key} must be a list of value names"
                                       f"{' (at least one)' if key == 'outputs' else ''}")
        for key in ("attrs", "weights"):
            if not isinstance(node.get(key, {}), dict):
                raise GraphFormatError(f"{_node_name(i, node)}: {key} must be an object")
        unknown = next((w for w in node.get("weights", {}).values() if not isinstance(w, str) or w not in params),
                       None)
        if unknown is not None:
            raise GraphFormatError(f"{_node_name(i, node)} reads weight {unknown!r}, which the graph's params do not "
                                   f"list")


def _check_logits_output(graph: dict[str, Any]) -> None:
    """The graph's first output, what ``Executor.forward`` returns and the samplers read as logits, is the lm_head's
    (passes/lift.py makes the final linear the lm_head and its output the graph's), or with a vocab-parallel lm_head
    the all_gather of its rows: [tokens, vocab_size], the lm_head's weight having a row per token (per rank when
    split). A graph whose output is a hidden state loaded, and failed at the first request with a message about
    sampling."""
    outputs, nodes = graph["outputs"], graph["nodes"]
    if not outputs:
        raise GraphFormatError("the graph has no outputs; its first output must be the lm_head's logits")
    producer = {name: i for i, node in enumerate(nodes) for name in node["outputs"]}
    name = outputs[0]
    if name not in producer:
        raise GraphFormatError(f"the graph's output {name!r} is one of its inputs, not the lm_head's logits")
    i = producer[name]
    gathered = nodes[i]["op"] == "all_gather" and len(nodes[i]["inputs"]) == 1 and nodes[i]["inputs"][0] in producer
    if gathered:  # vocab-parallel: each rank's rows of the logits, concatenated
        i = producer[nodes[i]["inputs"][0]]
    if nodes[i]["op"] != "lm_head":
        raise GraphFormatError(f"the graph's output {name!r} is written by {_node_name(i, nodes[i])}, not by the "
                               f"lm_head{' (through an all_gather)' if gathered else ''}; the engines sample its "
                               f"rows as logits [tokens, vocab_size]: rebuild the artifact")
    meta = graph.get("meta", {})
    vocab, tp = meta.get("vocab_size"), meta.get("tensor_parallel") or {}
    weights = nodes[i].get("weights", {})
    info = graph.get("params", {}).get(weights.get("weight", weights.get("qweight", "")))
    shape = info.get("shape") if isinstance(info, dict) else None
    if not _is_whole(vocab) or not isinstance(shape, list) or not shape or not _is_whole(shape[0]):
        return  # no vocab_size to hold it to, or no weight (check_graph's other checks name that)
    split = tp.get("vocab_parallel") and _is_whole(tp.get("tp_size")) and tp["tp_size"] > 1
    rows = vocab // tp["tp_size"] if split else vocab
    if shape[0] != rows:
        per_rank = f" over tp_size {tp['tp_size']}" if split else ""
        raise GraphFormatError(f"{_node_name(i, nodes[i])} writes the graph's output {name!r} with {shape[0]} "
                               f"logits a token (its weight's rows); expected the vocabulary's {rows} (meta "
                               f"vocab_size {vocab}{per_rank}): rebuild the artifact")


def _is_whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


WEIGHT_ONLY_BITS = {"w4a16": 4, "w8a16": 8}  # a weight-only scheme's code width (kernels/torch_quant.py's layout)
# a weight-only linear's tensors: role -> (the dtype the project writes, what it holds). The passes (quant_math, gptq,
# awq, int8_wo) and builder/prequantized.py's imports all store uint8 codes (4-bit ones two a byte), fp32 scales and
# uint8 zero points; the runtime reads the codes and zeros as unsigned bytes (int8 ones are off by 128, wider ones
# are not a layout it has) and the kernels take the scales as fp32
WEIGHT_ONLY_DTYPES = {"qweight": ("uint8", "codes"), "scales": ("float32", "scales"), "zeros": ("uint8", "zero points")}


def _check_weight_only_quant(graph: dict[str, Any]) -> None:
    """Each weight-only linear / lm_head (w4a16, w8a16) against its stored tensors, in kernels/torch_quant.py's layout:
    quant bits the scheme's (4 or 8), group_size -1 (one group a row) or a whole number dividing the input features,
    qweight [out, in * bits / 8] (of the linear's in_features x out_features where the graph is not sharded: a rank's
    shapes are its own), scales and zeros [out, in / group_size] each; qweight and zeros uint8, scales float32
    (WEIGHT_ONLY_DTYPES, what the passes and the imports write). Before, such a linear loaded through the compiler's
    catch-all (a reshape's RuntimeError) or computed over the wrong groups, or (int8 or int32 zeros, fp16 scales)
    dequantized its weights from bytes of another type."""
    params = graph.get("params", {})
    sharded = (graph.get("meta", {}).get("tensor_parallel") or {}).get("tp_size", 1) != 1
    for i, node in enumerate(graph["nodes"]):
        attrs = node.get("attrs", {})
        quant = attrs.get("quant")
        scheme = quant.get("scheme") if isinstance(quant, dict) else None
        if node["op"] not in ("linear", "lm_head") or scheme not in WEIGHT_ONLY_BITS:
            continue
        where, want = _node_name(i, node), WEIGHT_ONLY_BITS[scheme]
        bits, group = quant.get("bits"), quant.get("group_size")
        if not _is_whole(bits) or bits != want:
            raise GraphFormatError(f"{where}: quant bits is {bits!r}; a {scheme} linear stores {want}-bit codes "
                                   f"(allowed: {want})")
        if not _is_whole(group) or not (group == -1 or 1 <= group <= _MAX_DIM):
            raise GraphFormatError(f"{where}: quant group_size is {group!r}; allowed: -1 (one group a row) or a whole "
                                   f"number in 1..{_MAX_DIM} dividing the input features")
        shapes = {}
        for role in ("qweight", "scales", "zeros"):
            info = params.get(node.get("weights", {}).get(role, ""))
            shape = info.get("shape") if isinstance(info, dict) else None
            if not isinstance(shape, list) or len(shape) != 2 or not all(_is_whole(d) for d in shape):
                raise GraphFormatError(f"{where}: its {role} is {shape!r} in the graph's params; a {scheme} linear's "
                                       f"{role} is 2-D")
            dtype, (allowed, what) = info.get("dtype"), WEIGHT_ONLY_DTYPES[role]
            if dtype is not None and dtype != allowed:
                raise GraphFormatError(f"{where}: its {role} is {dtype}; a {scheme} linear stores {allowed} {what} "
                                       f"(allowed: {allowed})")
            shapes[role] = shape
        out_features, in_features = shapes["qweight"][0], shapes["qweight"][1] * 8 // bits
        if not sharded and (attrs.get("out_features", out_features), attrs.get("in_features", in_features)) != (
                out_features, in_features):
            raise GraphFormatError(f"{where}: its qweight {shapes['qweight']} holds {out_features} x {in_features} "
                                   f"{bits}-bit codes; attrs out_features x in_features are "
                                   f"{attrs.get('out_features')} x {attrs.get('in_features')}")
        if group != -1 and in_features % group:
            raise GraphFormatError(f"{where}: quant group_size {group} does not divide its {in_features} input "
                                   f"features (qweight {shapes['qweight']}, {bits}-bit codes)")
        groups = 1 if group == -1 else in_features // group
        bad = next((r for r in ("scales", "zeros") if shapes[r] != [out_features, groups]), None)
        if bad is not None:
            raise GraphFormatError(f"{where}: its {bad} are {shapes[bad]} (scales {shapes['scales']}, zeros "
                                   f"{shapes['zeros']}); quant bits {bits} and group_size {group} over qweight "
                                   f"{shapes['qweight']} ({in_features} input features) give [{out_features}, "
                                   f"{groups}]: one per output row and group")


LINEAR_SCHEMES = ("w4a16", "w8a16", "w8a8_int8", "fp8", "fp8_block")  # a quantized linear's (passes/ir.py's)
W8A8_CODES = {"w8a8_int8": "int8", "fp8": "float8_e4m3fn", "fp8_block": "float8_e4m3fn"}  # qweight's dtype


def _param(graph: dict[str, Any], node: dict, role: str) -> tuple[list[int] | None, str | None] | None:
    """(shape, dtype) of the param a node reads as ``role`` (None for either that is not well formed), or None where
    the node has no such role."""
    name = node.get("weights", {}).get(role)
    if name is None:
        return None
    info = graph.get("params", {}).get(name)
    info = info if isinstance(info, dict) else {}
    shape, dtype = info.get("shape"), info.get("dtype")
    ok = isinstance(shape, list) and all(_is_whole(d) and d >= 0 for d in shape)
    return (shape if ok else None), (dtype if isinstance(dtype, str) else None)


def _block_size(quant: dict, where: str) -> list[int]:
    """An fp8_block quant's block_size: [rows, columns] of one weight scale, whole numbers in 1..MAX_SCALE_BLOCK."""
    block = quant.get("block_size")
    if not (isinstance(block, list) and len(block) == 2
            and all(_is_whole(b) and 1 <= b <= MAX_SCALE_BLOCK for b in block)):
        raise GraphFormatError(f"{where}: quant block_size is {block!r}; allowed: [rows, columns], whole numbers in "
                               f"1..{MAX_SCALE_BLOCK}")
    return block


def _check_w8a8_quant(graph: dict[str, Any]) -> None:
    """Each W8A8 linear / lm_head (w8a8_int8: SmoothQuant's or an imported INT8; fp8; fp8_block) against its stored
    tensors, in kernels/torch_quant.py's layout: qweight 2-D codes of the scheme's dtype (int8, e4m3) [out, in] (of
    the linear's out_features x in_features where the graph is not sharded: a rank's shapes are its own);
    weight_scale [out] per output channel (w8a8_int8; fp8 with weight_granularity channel), [1] per tensor (fp8 with
    weight_granularity tensor), or one per block of the quant's block_size [bn, bk], [ceil(out / bn), ceil(in / bk)]
    (fp8_block); an input_scale of one element where activations are static, none where dynamic (fp8_block: dynamic
    only). Before, a scale of another shape loaded and failed the first request (a broadcast's RuntimeError), or
    computed garbage (a per-channel linear with one scale, block scales past the codes cut off, a static linear
    without its scale quantizing per token). Also refuses a linear's quant scheme this runtime does not run."""
    sharded = (graph.get("meta", {}).get("tensor_parallel") or {}).get("tp_size", 1) != 1
    for i, node in enumerate(graph["nodes"]):
        attrs = node.get("attrs", {})
        if node["op"] not in ("linear", "lm_head") or "quant" not in attrs:
            continue
        where, quant = _node_name(i, node), attrs["quant"]
        scheme = quant.get("scheme") if isinstance(quant, dict) else None
        if not isinstance(quant, dict) or scheme not in LINEAR_SCHEMES:
            raise GraphFormatError(f"{where}: quant scheme is {scheme!r}; allowed: {', '.join(LINEAR_SCHEMES)}")
        if scheme not in W8A8_CODES:
            continue
        for role in ("qweight", "weight_scale"):
            if _param(graph, node, role) is None:
                raise GraphFormatError(f"{where}: it has no {role}; quant scheme {scheme} reads qweight and "
                                       f"weight_scale")
        (shape, dtype), want = _param(graph, node, "qweight"), W8A8_CODES[scheme]
        if shape is None or len(shape) != 2:
            raise GraphFormatError(f"{where}: its qweight is {shape!r} in the graph's params; quant scheme {scheme} "
                                   f"stores 2-D codes [out_features, in_features]")
        if dtype is not None and dtype != want:
            raise GraphFormatError(f"{where}: its qweight is {dtype}; quant scheme {scheme} stores {want} codes "
                                   f"(allowed: {want})")
        out_features, in_features = shape
        if not sharded and (attrs.get("out_features", out_features), attrs.get("in_features", in_features)) != (
                out_features, in_features):
            raise GraphFormatError(f"{where}: its qweight is {shape}; attrs out_features x in_features are "
                                   f"{attrs.get('out_features')} x {attrs.get('in_features')}")
        activations = quant.get("activations")
        allowed = ("dynamic",) if scheme == "fp8_block" else ("static", "dynamic")
        if activations is not None and activations not in allowed:
            per_block = f"; quant scheme {scheme} quantizes its activations per token and block" \
                if scheme == "fp8_block" and activations == "static" else ""
            raise GraphFormatError(f"{where}: quant activations is {activations!r}{per_block} (allowed: "
                                   f"{', '.join(allowed)})")
        input_scale = _param(graph, node, "input_scale")
        if activations == "static" and input_scale is None:
            raise GraphFormatError(f"{where}: quant activations is 'static' but it has no input_scale; static "
                                   f"activations are quantized with one calibrated input_scale [1]")
        if input_scale is not None and (activations == "dynamic" or scheme == "fp8_block"):
            raise GraphFormatError(f"{where}: quant activations is {activations or 'dynamic'!r} but it has an "
                                   f"input_scale {input_scale[0]}; dynamic activations take none")
        if input_scale is not None and input_scale[0] not in ([1], []):
            raise GraphFormatError(f"{where}: its input_scale is {input_scale[0]}; static activations are quantized "
                                   f"with one calibrated input_scale [1]")
        scale = _param(graph, node, "weight_scale")[0]
        if scheme == "fp8_block":
            block = _block_size(quant, where)
            blocks = [-(-out_features // block[0]), -(-in_features // block[1])]
            if scale != blocks:
                raise GraphFormatError(f"{where}: its weight_scale is {scale}; quant block_size {block} over qweight "
                                       f"{shape} gives {blocks}: one scale per {block} block (a partial last block "
                                       f"has its own)")
            continue
        granularity = quant.get("weight_granularity")
        if granularity is not None and granularity not in ("tensor", "channel"):
            raise GraphFormatError(f"{where}: quant weight_granularity is {granularity!r}; allowed: tensor, channel")
        if scheme == "w8a8_int8" and granularity is None:
            granularity = "channel"  # SmoothQuant's and the imports' (kernels/torch_quant.py)
        wants = {"tensor": [[1], []], "channel": [[out_features]], None: [[1], [], [out_features]]}[granularity]
        if scale not in wants:
            per = {"tensor": "per tensor", "channel": "per output channel",
                   None: "per tensor or per output channel"}[granularity]
            declared = f" with quant weight_granularity {granularity}" if "weight_granularity" in quant else ""
            raise GraphFormatError(f"{where}: its weight_scale is {scale}; quant scheme {scheme}{declared} scales "
                                   f"weights {per}: over qweight {shape}, "
                                   f"{' or '.join(str(w) for w in wants if w)}")


# INPUT_ROLES' dtypes: role -> (the dtypes allowed, what it holds). The imports write int32 perms and fp32
# pre_quant_scales (builder/prequantized.py, passes/ir.py QUANT_ROLES); the kernels read a perm as int64 indices and
# a scale in fp32 (kernels/torch_quant.py permute_input, scale_input), so the other whole / 16-bit types run the same
INPUT_DTYPES = {"perm": (("int32", "int64"), "input feature indices"),
                "pre_quant_scale": (("float32", "bfloat16", "float16"), "input feature scales")}


def _check_input_roles(graph: dict[str, Any]) -> None:
    """Each linear / lm_head's INPUT_ROLES against its codes: a perm (an imported act-order gather, x[:, perm]) and a
    pre_quant_scale (an exporter's per-input-channel scale, x * s) are 1-D, one entry per input feature of its qweight
    (a rank's own where the graph is sharded: a row-parallel linear's scale is cut with its input columns), of the
    dtypes INPUT_DTYPES allows, and only on a quantized linear (an unquantized one never applies them). Their values
    are checked when the linear is built (``_check_input_tensors``). Before, a perm or scale of another length loaded
    and failed the first request (an index_select's or a broadcast's RuntimeError), a float perm gathered truncated
    indices, and an unquantized linear ran without them."""
    sharded = (graph.get("meta", {}).get("tensor_parallel") or {}).get("tp_size", 1) != 1
    for i, node in enumerate(graph["nodes"]):
        roles = [r for r in INPUT_ROLES if r in node.get("weights", {})]
        if node["op"] not in ("linear", "lm_head") or not roles:
            continue
        where, quant = _node_name(i, node), node.get("attrs", {}).get("quant")
        if not quant:
            raise GraphFormatError(f"{where}: it carries {roles[0]} but has no quant attr; only a quantized linear "
                                   f"reads its input through a perm or a pre_quant_scale (an unquantized one would "
                                   f"run without it)")
        scheme, qweight = quant.get("scheme"), _param(graph, node, "qweight")
        if qweight is None or qweight[0] is None or len(qweight[0]) != 2:
            continue  # the scheme's own checks name a missing or malformed qweight
        in_features = qweight[0][1] * 8 // WEIGHT_ONLY_BITS[scheme] if scheme in WEIGHT_ONLY_BITS else qweight[0][1]
        own = " (this rank's own)" if sharded else ""
        for role in roles:
            (shape, dtype), (allowed, what) = _param(graph, node, role), INPUT_DTYPES[role]
            if shape != [in_features]:
                raise GraphFormatError(f"{where}: its {role} is {shape!r} in the graph's params; qweight "
                                       f"{qweight[0]} ({scheme}) reads {in_features} input features{own}, and a "
                                       f"{role} holds one per input feature: [{in_features}]")
            if dtype is not None and dtype not in allowed:
                raise GraphFormatError(f"{where}: its {role} is {dtype}; a {role} holds {what} (allowed: "
                                       f"{', '.join(allowed)})")


def _check_input_tensors(w: dict[str, torch.Tensor], where: str) -> None:
    """A linear's perm and pre_quant_scale as loaded (their shapes and dtypes are ``_check_input_roles``'): the perm
    a permutation of 0..in - 1, every input feature once (x[:, perm] with an index out of range reads past the row,
    with one twice it reads a column twice and drops another: wrong outputs, silently); the pre_quant_scale finite
    (one inf or nan makes every output of the linear inf or nan) and not all 0 (the linear's whole input zeroed). A
    few zeros stay allowed, as in a weight's scales (a dropped input channel), and negative scales too: x * s with
    the columns made for s is exact whatever its sign."""
    perm = w.get("perm")
    if perm is not None:
        index, n = perm.reshape(-1).long(), perm.numel()
        low, high = (int(index.min()), int(index.max())) if n else (0, -1)
        if low < 0 or high >= n:
            raise GraphFormatError(f"{where}: its perm holds indices {low}..{high}; a perm of {n} input features is "
                                   f"a permutation of 0..{n - 1}, each index once: rebuild the artifact")
        counts = torch.bincount(index, minlength=n)
        if not bool(counts.eq(1).all()):
            twice, never = int(torch.nonzero(counts > 1)[0, 0]), int(torch.nonzero(counts == 0)[0, 0])
            raise GraphFormatError(f"{where}: its perm holds index {twice} {int(counts[twice])} times and never "
                                   f"{never}; a perm of {n} input features is a permutation of 0..{n - 1}, each index "
                                   f"once: rebuild the artifact")
    scale = w.get("pre_quant_scale")
    if scale is not None:
        values = scale.float().reshape(-1)
        finite = torch.isfinite(values)
        if not bool(finite.all()):
            at = int(torch.nonzero(~finite)[0, 0])
            raise GraphFormatError(f"{where}: its pre_quant_scale holds {float(values[at])} (input feature {at}); "
                                   f"expected finite scales (the linear reads x * pre_quant_scale): rebuild the "
                                   f"artifact")
        if values.numel() and not bool(values.ne(0).any()):
            raise GraphFormatError(f"{where}: every one of its {values.numel()} pre_quant_scale values is 0, which "
                                   f"zeroes the linear's whole input; expected nonzero scales (a few zeros, dropped "
                                   f"input channels, are allowed): rebuild the artifact")


# a moe node's quant scheme -> the weight roles it adds (passes/ir.py's MOE_QUANT_SCHEMES); None: float experts
MOE_SCHEMES: dict[str | None, tuple[str, ...]] = {
    None: (), "fp8": ("w_gate_up_scale", "w_down_scale"), "fp8_block": ("w_gate_up_scale", "w_down_scale"),
    "w4a16": ("w_gate_up_scales", "w_gate_up_zeros", "w_down_scales", "w_down_zeros")}
MOE_CODES = {"fp8": "float8_e4m3fn", "fp8_block": "float8_e4m3fn", "w4a16": "uint8"}  # the experts' codes' dtype
# a weight-only moe's scale and zero-point roles -> WEIGHT_ONLY_DTYPES' key: its experts are stacked w4a16 linears
# (passes/moe_int4.py; builder/prequantized.py import_experts stacks the imported linears' fp32 scales, uint8 zeros)
MOE_WEIGHT_ONLY_ROLES = {"w_gate_up_scales": "scales", "w_gate_up_zeros": "zeros", "w_down_scales": "scales",
                         "w_down_zeros": "zeros"}


def _check_moe_experts(graph: dict[str, Any]) -> None:
    """Each moe node's stacked experts against its router, its attrs and each other (passes/ir.py's moe op): the
    router gate_weight [E, hidden] with E the attr num_experts, w_gate_up [E, 2 * I, hidden] and w_down [E, hidden,
    I] (I the attr intermediate_size where the graph is not sharded: a rank's share is its own), and by quant scheme:
    fp8, e4m3 codes with w_gate_up_scale [E, 2 * I] and w_down_scale [E, hidden] (per channel, inputs per token);
    fp8_block, e4m3 codes with one scale per expert and block_size [bn, bk] block, [E, ceil(out / bn), ceil(in /
    bk)]; w4a16, uint8 codes two a byte along the input ([E, 2 * I, hidden / 2], [E, hidden, I / 2]) with float32
    scales and uint8 zeros [E, out, in / group_size] (a w4a16 linear's WEIGHT_ONLY_DTYPES, stacked); no scale roles
    of another scheme. Before, the moe op met these at the first request (a matmul's RuntimeError), or computed
    garbage (scales of another scheme never applied; int8 or int32 zeros, fp16 scales dequantized from bytes of
    another type)."""
    sharded = (graph.get("meta", {}).get("tensor_parallel") or {}).get("tp_size", 1) != 1
    every = sorted({r for roles in MOE_SCHEMES.values() for r in roles}, key=lambda r: (r.startswith("w_down"), r))
    for i, node in enumerate(graph["nodes"]):
        if node["op"] != "moe":
            continue
        attrs, where, weights = node.get("attrs", {}), _node_name(i, node), node.get("weights", {})
        quant = attrs.get("quant")
        scheme = quant.get("scheme") if isinstance(quant, dict) else None
        if quant is not None and (scheme is None or scheme not in MOE_SCHEMES):
            raise GraphFormatError(f"{where}: quant scheme is {scheme!r}; allowed for a moe's experts: "
                                   f"{', '.join(s for s in MOE_SCHEMES if s)}")
        quant, roles = quant or {}, MOE_SCHEMES[scheme]
        extra = next((r for r in every if r in weights and r not in roles), None)
        if extra is not None:
            which = f"quant scheme {scheme} experts do" if scheme else "unquantized experts do"
            raise GraphFormatError(f"{where}: it carries {extra}, which {which} not read (allowed: "
                                   f"{', '.join(roles) or 'none'})")
        shapes = {}
        for role in ("gate_weight", "w_gate_up", "w_down") + roles:
            param = _param(graph, node, role)
            if param is None:
                raise GraphFormatError(f"{where}: it has no {role}; quant scheme {scheme} experts read "
                                       f"{', '.join(roles)}" if role in roles else f"{where}: it has no {role}")
            dims = 2 if role == "gate_weight" or (scheme == "fp8" and role in roles) else 3  # fp8: [E, out]
            if param[0] is None or len(param[0]) != dims:
                raise GraphFormatError(f"{where}: its {role} is {param[0]!r} in the graph's params; a moe's {role} "
                                       f"is {dims}-D")
            if role in ("w_gate_up", "w_down") and scheme in MOE_CODES and param[1] not in (None, MOE_CODES[scheme]):
                raise GraphFormatError(f"{where}: its {role} is {param[1]}; quant scheme {scheme} experts store "
                                       f"{MOE_CODES[scheme]} codes (allowed: {MOE_CODES[scheme]})")
            if scheme in WEIGHT_ONLY_BITS and role in MOE_WEIGHT_ONLY_ROLES and param[1] is not None:
                allowed, what = WEIGHT_ONLY_DTYPES[MOE_WEIGHT_ONLY_ROLES[role]]
                if param[1] != allowed:
                    raise GraphFormatError(f"{where}: its {role} is {param[1]}; quant scheme {scheme} experts store "
                                           f"{allowed} {what} (allowed: {allowed})")
            shapes[role] = param[0]
        (experts, hidden), packed = shapes["gate_weight"], 2 if scheme == "w4a16" else 1
        if attrs.get("num_experts", experts) != experts:
            raise GraphFormatError(f"{where}: its gate_weight {shapes['gate_weight']} routes to {experts} experts; "
                                   f"attr num_experts is {attrs.get('num_experts')}")
        inter = shapes["w_down"][2] * packed
        router = f"with gate_weight {shapes['gate_weight']} ({experts} experts, hidden {hidden})"
        down = [experts, hidden, shapes["w_down"][2]]
        if shapes["w_down"] != down:
            raise GraphFormatError(f"{where}: its w_down is {shapes['w_down']}; {router}, the experts' down "
                                   f"projections are {down}")
        gate_up = [experts, 2 * inter, hidden // packed]
        if shapes["w_gate_up"] != gate_up or hidden % packed:
            raise GraphFormatError(f"{where}: its w_gate_up is {shapes['w_gate_up']}; {router} and w_down "
                                   f"{shapes['w_down']} (intermediate {inter}), the experts' gate and up rows are "
                                   f"{gate_up}")
        if not sharded and attrs.get("intermediate_size", inter) != inter:
            raise GraphFormatError(f"{where}: its w_down {shapes['w_down']} holds {inter} intermediate features an "
                                   f"expert; attr intermediate_size is {attrs.get('intermediate_size')}")
        # each projection: (codes role, output rows, input features)
        projections = (("w_gate_up", 2 * inter, hidden), ("w_down", hidden, inter))
        if scheme == "fp8":
            for key, allowed, why in (("weight_granularity", "channel", "scale each output row"),
                                      ("activations", "dynamic", "quantize their inputs per token")):
                if quant.get(key, allowed) != allowed:
                    raise GraphFormatError(f"{where}: quant {key} is {quant[key]!r}; fp8 experts {why} (allowed: "
                                           f"{allowed})")
            for role, rows, _ in projections:
                if shapes[f"{role}_scale"] != [experts, rows]:
                    raise GraphFormatError(f"{where}: its {role}_scale is {shapes[role + '_scale']}; quant scheme fp8 "
                                           f"over {role} {shapes[role]} gives {[experts, rows]}: one scale per expert "
                                           f"and output row")
        elif scheme == "fp8_block":
            block = _block_size(quant, where)
            for role, rows, cols in projections:
                want = [experts, -(-rows // block[0]), -(-cols // block[1])]
                if shapes[f"{role}_scale"] != want:
                    raise GraphFormatError(f"{where}: its {role}_scale is {shapes[role + '_scale']}; quant block_size "
                                           f"{block} over {role} {shapes[role]} gives {want}: one scale per expert and "
                                           f"{block} block (a partial last block has its own)")
        elif scheme == "w4a16":
            bits, group = quant.get("bits", 4), quant.get("group_size")
            if bits != 4 or not _is_whole(bits):
                raise GraphFormatError(f"{where}: quant bits is {bits!r}; w4a16 experts store 4-bit codes (allowed: 4)")
            if not _is_whole(group) or not (group == -1 or 1 <= group <= _MAX_DIM):
                raise GraphFormatError(f"{where}: quant group_size is {group!r}; allowed: -1 (one group a row) or a "
                                       f"whole number in 1..{_MAX_DIM} dividing the experts' input features")
            for role, rows, cols in projections:
                if group != -1 and cols % group:
                    raise GraphFormatError(f"{where}: quant group_size {group} does not divide the experts' {cols} "
                                           f"input features of {role} {shapes[role]} (4-bit codes)")
                want = [experts, rows, 1 if group == -1 else cols // group]
                bad = next((r for r in (f"{role}_scales", f"{role}_zeros") if shapes[r] != want), None)
                if bad is not None:
                    raise GraphFormatError(f"{where}: its {bad} is {shapes[bad]}; quant group_size {group} over {role} "
                                           f"{shapes[role]} ({cols} input features) gives {want}: one per expert, "
                                           f"output row and group")


# attrs the engines read as whole numbers, and the least each may be (group_size: -1 is one group a row)
_INT_ATTRS = {"num_heads": 1, "num_kv_heads": 1, "head_dim": 1, "layer": 0, "in_features": 1, "out_features": 1,
              "num_experts": 1, "top_k": 1, "intermediate_size": 1, "rotary_dim": 1}
_MAX_DIM = 1 << 24  # any size past this is a corrupt graph, not a model


def _check_attrs(graph: dict[str, Any]) -> None:
    """Attr values the kernels trust: whole numbers in range, finite positive eps, a window of at least one key,
    attention layers 0..n-1 each once (two attention nodes on one KV cache layer compute garbage silently), and
    unquantized linear / lm_head / embedding weights of the shapes their attrs give."""
    layers = []
    params = graph.get("params", {})
    for i, node in enumerate(graph["nodes"]):
        attrs, where = node.get("attrs", {}), _node_name(i, node)
        for key, least in _INT_ATTRS.items():
            value = attrs.get(key)
            if key in attrs and value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                                       or not least <= value <= _MAX_DIM):
                raise GraphFormatError(f"{where}: attr {key} is {value!r}; expected a whole number in "
                                       f"{least}..{_MAX_DIM}")
        for key in ("eps", "scale"):
            value = attrs.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or (value <= 0 and (
                                          key == "eps" or node["op"] == "attention"))):
                positive = key == "eps" or node["op"] == "attention"  # a softmax scale <= 0 inverts or flattens it
                raise GraphFormatError(f"{where}: attr {key} is {value!r}; expected a finite number"
                                       f"{' > 0' if positive else ''}")
        window = attrs.get("sliding_window")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise GraphFormatError(f"{where}: attr sliding_window is {window!r}; expected a whole number >= 1 or null")
        if node["op"] == "attention":
            if "layer" not in attrs:
                raise GraphFormatError(f"{where}: attention has no layer attr (its KV cache layer)")
            layers.append(attrs["layer"])
        weight = params.get(node.get("weights", {}).get("weight", ""))
        shape = list(weight["shape"]) if isinstance(weight, dict) and isinstance(weight.get("shape"), list) else None
        if shape is None or "quant" in attrs or "tensor_parallel" in graph.get("meta", {}):  # a rank's shapes
            continue
        if node["op"] == "linear" and "in_features" in attrs and "out_features" in attrs:
            want = [attrs["out_features"], attrs["in_features"]]
        elif node["op"] == "lm_head" or (node["op"] == "embedding" and "input_ids" in node["inputs"]):
            want = [graph.get("meta", {}).get("vocab_size"), shape[-1]]  # a row per token
        else:
            want = None
        if want is not None and None not in want and shape != want:
            raise GraphFormatError(f"{where}: its weight is {shape}; the graph gives {want} (a row per token of "
                                   f"its vocab_size, or out_features x in_features)")
    if sorted(layers) != list(range(len(layers))):
        raise GraphFormatError(f"the attention nodes' layer attrs are {sorted(layers)[:8]}; expected "
                               f"0..{len(layers) - 1}, each once (one KV cache layer each)")
    head_dims = {n["attrs"].get("head_dim") for n in graph["nodes"] if n["op"] == "attention"}
    rope = next((i for i, n in enumerate(graph["nodes"]) if n["op"] == "rope"
                 and n.get("attrs", {}).get("head_dim") not in head_dims), None)
    if rope is not None:
        raise GraphFormatError(f"{_node_name(rope, graph['nodes'][rope])}: attr head_dim "
                               f"{graph['nodes'][rope]['attrs'].get('head_dim')!r} is no attention layer's "
                               f"({sorted(d for d in head_dims if d is not None)})")


class Executor:
    """A compiled graph bound to its weights on one device."""

    def __init__(self, graph: dict[str, Any], params: dict[str, torch.Tensor], use_kernels: bool = False,
                 fp8_accumulation: str | None = None, fp8_env: bool = True) -> None:
        if graph.get("ir_version") != GRAPH_IR_VERSION:
            raise GraphFormatError(f"graph IR version {graph.get('ir_version')!r} is not supported by this "
                                   f"runtime (it runs version {GRAPH_IR_VERSION}); rebuild the artifact")
        self.graph = graph
        self.params = params
        self.dtype = getattr(torch, graph.get("meta", {}).get("dtype", "")) if graph.get("meta", {}).get("dtype") \
            else next((t.dtype for t in params.values() if t.is_floating_point()), torch.float32)
        self.outputs: list[str] = graph["outputs"]
        self.long_rope_from = long_rope_from(graph)  # LongRoPE's switch (see LONG_ROPE_OFFSET), or None
        readers = [_POSITION_READERS.get(n["op"], f"a {n['op']} op") for n in graph["nodes"]
                   if "positions" in n["inputs"] and n["op"] != "rope"]
        if self.long_rope_from is not None and readers:
            raise GraphFormatError(f"this graph has LongRoPE and {readers[0]}: the engines offset a long sequence's "
                                   f"positions for the rotary (LONG_ROPE_OFFSET), which it would read as they are; "
                                   f"no family has both, and this runtime does not run it")
        self.device = next((t.device for t in params.values()), torch.device("cpu"))  # where the weights live
        # Triton kernels (``kernels/``) for attention over a paged cache, norms, RoPE, SwiGLU and W4A16/W8A16
        # GEMMs; otherwise the torch reference ops. On for CUDA by default (Engine.load); on CPU only
        # under TRITON_INTERPRET=1 (tests).
        self.use_kernels = use_kernels
        # cuBLAS's FP8 GEMMs without the periodic promotion to fp32 (the artifact's runtime.fp8_accumulation, or, with
        # ``fp8_env``, RUNTIME_FP8_FAST_ACCUM: kernels.torch_quant.fp8_fast_accum)
        self.fp8_fast_accum = fp8_fast_accum(fp8_accumulation, env=fp8_env)
        self._program: list[tuple[Kernel, list[str], list[str], list[str]]] = []
        nodes = graph["nodes"]
        self._num_consumers: dict[str, int] = {}
        for node in nodes:
            for name in node["inputs"]:
                self._num_consumers[name] = self._num_consumers.get(name, 0) + 1
        self._fusions = plan_fusions(nodes, self._num_consumers, self.dtype, _scaled_mm_device(self.device)) \
            if use_kernels else _Fusions(set(), {}, set())
        for i, residual in list(self._fusions.residual_out.items()):  # the norm's gain as loaded: bf16, as x
            j = next(r for r in self._fusions.pending_norms if residual in nodes[r]["inputs"]
                     and nodes[i]["outputs"][0] in nodes[r]["inputs"])
            gain = params.get(nodes[j].get("weights", {}).get("weight", ""))
            if gain is None or gain.dtype != torch.bfloat16:
                del self._fusions.residual_out[i]
                self._fusions.pending_norms.discard(j)
        for j, i in list(self._fusions.quant_producers.items()):  # the shapes cuBLAS takes, as loaded (sharded)
            qweight = params.get(nodes[i].get("weights", {}).get("qweight", ""))
            input_scale = params.get(nodes[i].get("weights", {}).get("input_scale", ""))
            if (qweight is None or qweight.shape[0] % 16 or qweight.shape[1] % 16
                    or (input_scale is not None and input_scale.numel() != 1)):
                del self._fusions.quant_producers[j]
            elif input_scale is not None:  # a calibrated scale: the producer writes the codes of quantize_rows_static
                quant = nodes[i]["attrs"]["quant"]
                self._fusions.static_inputs[j] = (input_scale.reshape(1).float(),
                                                  int8_act_qmin(quant) if quant["scheme"] == "w8a8_int8" else -127)
        # what each node reads: an attention that applies RoPE itself also reads the positions
        inputs = [node["inputs"] + ([self._fusions.rope[i][1]] if i in self._fusions.rope else [])
                  + ([self._fusions.residual_out[i]] if i in self._fusions.residual_out else [])
                  for i, node in enumerate(nodes)]
        last_use: dict[str, int] = {name: i for i, names in enumerate(inputs) for name in names}
        # the lm_head's input (the final hidden states, after the final norm): kept in the step's environment and
        # left in ``hidden`` by ``forward`` where ``keep_hidden`` is set (an EAGLE head reads it, runtime.eagle);
        # ``keep_hidden_states`` names other values instead (an EAGLE-3 head's layers of the residual stream)
        heads = [n for n in nodes if n["op"] == "lm_head"]
        self.hidden_name: str | None = heads[0]["inputs"][0] if len(heads) == 1 else None
        self.hidden_names: list[str] = [self.hidden_name] if self.hidden_name else []
        self.keep_hidden = False
        self.hidden: torch.Tensor | None = None
        for i, node in enumerate(nodes):
            compile_fn = _COMPILERS.get(node["op"])
            if compile_fn is None:
                raise GraphFormatError(f"op {node['op']!r} (from {node.get('source') or 'unknown'}) is not "
                                       f"implemented by this runtime; known: {', '.join(_COMPILERS)}")
            weights = {role: params[name] for role, name in node.get("weights", {}).items()}
            self._node, self._index = node, i
            kernel = _identity if i in self._fusions.absorbed else compile_fn(weights, node.get("attrs", {}), self)
            outputs = node["outputs"]
            if i in self._fusions.add_layer_norms:  # the sum and the norm of it (see _Fusions.add_layer_norms)
                norm = nodes[self._fusions.add_layer_norms[i]]
                kernel = _fused_add_layer_norm({r: params[n] for r, n in norm.get("weights", {}).items()},
                                               norm.get("attrs", {}))
                outputs = outputs + norm["outputs"]
            elif i in self._fusions.add_layer_norms.values():
                kernel = _done_before  # its output came with the add's
            dead = [n for n in inputs[i]
                    if last_use.get(n) == i and n not in self.outputs and n not in self.hidden_names]
            self._program.append((kernel, inputs[i], outputs, sorted(set(dead))))
        self.num_layers = sum(1 for n in nodes if n["op"] == "attention")

    def kv_layout(self) -> KVLayout:
        """Per-layer KV shapes and storage dtypes."""
        return kv_layout_of(self.graph["nodes"], self.dtype)

    @torch.inference_mode()
    def forward(self, inp: StepInput) -> torch.Tensor:
        """Run one step; returns logits [num_selected, vocab] in fp32."""
        env = self.start(inp)
        self.run_nodes(env, 0, len(self._program))
        if self.keep_hidden:  # [num_tokens, width], every row (not only the logits rows)
            names = self.hidden_names
            self.hidden = env.get(names[0]) if len(names) == 1 else torch.cat([env[n] for n in names], dim=-1)
        return env[self.outputs[0]]

    def keep_hidden_states(self, names: list[str]) -> None:
        """Keep ``names`` (values of the graph, each [num_tokens, hidden]) through every step and leave them in
        ``hidden``, side by side in that order, where ``keep_hidden`` is set; before any CUDA graph is captured."""
        produced = {o for node in self.graph["nodes"] for o in node["outputs"]}
        unknown = [n for n in names if n not in produced]
        if not names or unknown:
            raise ValueError(f"no values {unknown or names} in this graph to keep as hidden states")
        self.hidden_names = list(names)
        self._program = [(kernel, ins, outs, [n for n in dead if n not in names])
                         for kernel, ins, outs, dead in self._program]

    def residual_stream(self, layer: int) -> str:
        """The name of the residual stream's value entering decoder layer ``layer`` (0: the token embeddings;
        ``num_layers``: the stream the final norm reads), as EAGLE-3 heads index the target's layers: the sum a
        residual-add + RMSNorm writes beside its norm, found from each layer's attention back through its q input to
        the norm before it. Graphs where that norm is not there (post-norm or parallel blocks) are refused."""
        nodes = self.graph["nodes"]
        producer = {o: i for i, node in enumerate(nodes) for o in node["outputs"]}
        attentions = [i for i, node in enumerate(nodes) if node["op"] == "attention"]
        if not 0 <= layer <= len(attentions):
            raise ValueError(f"layer {layer} is outside this graph's 0..{len(attentions)}")
        if layer == len(attentions):
            if not self.hidden_name:
                raise ValueError("this graph has no single lm_head whose final norm marks the last layer's output")
            at = producer.get(self.hidden_name)
        else:
            at = attentions[layer]
            for _ in range(6):  # attention <- rope <- a per-head q norm (Qwen3) <- q/k/v linear <- the layer's norm
                at = producer.get(nodes[at]["inputs"][0]) if at is not None else None
                if at is None or (nodes[at]["op"] in ("rms_norm", "fused_add_rms_norm")
                                  and not nodes[at].get("attrs", {}).get("head_dim")):
                    break
        node = nodes[at] if at is not None else None
        if node is not None and node["op"] == "fused_add_rms_norm" and len(node["outputs"]) == 2:
            return node["outputs"][1]
        embedding = producer.get(node["inputs"][0]) if node is not None and node["op"] == "rms_norm" else None
        if layer == 0 and embedding is not None and nodes[embedding]["op"] == "embedding":
            return node["inputs"][0]  # the embeddings, which the first norm reads as they are
        raise ValueError(f"the residual stream entering layer {layer} is not a residual-add + RMSNorm's sum in this "
                         f"graph (EAGLE-3 heads read pre-norm Llama-style blocks)")

    def node_kernel(self, index: int) -> Kernel:
        """Node ``index``'s compiled kernel: ``kernel(inputs, step)`` -> outputs (see ``scratch_step``)."""
        return self._program[index][0]

    @staticmethod
    def scratch_step(inp: StepInput) -> _Step:
        """The per-step scratch a kernel run outside ``forward`` is given (``node_kernel``)."""
        return _Step(inp, {})

    def start(self, inp: StepInput) -> dict[str, Any]:
        """A fresh environment for running nodes over ``inp`` (see ``run_nodes``)."""
        return {"input_ids": inp.input_ids, "positions": inp.positions, _STEP: _Step(inp, {})}

    @torch.inference_mode()
    def run_nodes(self, env: dict[str, Any], start: int, end: int, observer: Observer | None = None) -> None:
        """Run nodes [start, end) in ``env``, in place. ``observer(index, inputs)`` sees each node's inputs.

        Used whole by ``forward``; in ranges by calibration, which carries ``env`` across ranges.
        Values dead after ``end`` are dropped as usual.
        """
        step = env[_STEP]
        for i in range(start, end):
            kernel, ins, outs, dead = self._program[i]
            args = [env[n] for n in ins]
            if observer is not None:
                observer(i, args)
            for name, value in zip(outs, kernel(args, step)):
                env[name] = value
            for name in dead:
                env.pop(name, None)


def kv_layout_of(nodes: list[dict[str, Any]], dtype: torch.dtype) -> KVLayout:
    """KV shapes and storage dtypes of a graph's attention layers (``dtype`` where not quantized)."""
    attn = [n["attrs"] for n in nodes if n["op"] == "attention"]
    dtypes = tuple(KV_STORAGE[a["kv_cache_dtype"]] if a.get("kv_cache_dtype") else dtype for a in attn)
    uniform = len(set(dtypes)) <= 1
    return KVLayout([a["num_kv_heads"] for a in attn], [a["head_dim"] for a in attn],
                    dtypes[0] if dtypes else dtype, None if uniform else dtypes)


_STEP = "__step__"
KV_STORAGE = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
Observer = Callable[[int, list[torch.Tensor]], None]


# --- per-op compilers: (weights, attrs, executor) -> kernel ------------------------------------
def _identity(xs, step) -> tuple[torch.Tensor, ...]:
    """An absorbed node (``_Fusions``): its output is its input, which the absorbing node reads."""
    return (xs[0],)


def _embedding(w, attrs, ex) -> Kernel:
    table, scale = w["weight"], attrs.get("scale")
    if scale is not None:  # made once: the step only multiplies (nothing copied inside a CUDA graph)
        scale = torch.tensor(scale, dtype=table.dtype, device=table.device)
    if attrs.get("vocab_parallel"):
        return _vocab_parallel_embedding(table, scale)
    if scale is None:
        return lambda xs, step: (F.embedding(xs[0], table),)
    return lambda xs, step: (ops.embedding(xs[0], table, scale),)


def _rms_norm(w, attrs, ex) -> Kernel:
    weight, eps = w.get("weight"), attrs["eps"]
    head_dim, offset = attrs.get("head_dim"), attrs.get("weight_offset", 0.0)
    # NOTE: a weight_offset norm runs the torch reference on CUDA too: it applies the (w + offset) gain in fp32
    # before rounding (Gemma's order), where kernels.fused_norm rounds first
    if ex.use_kernels and not offset:
        from kernels.fused_norm import rms_norm

        quantize_to = _quantize_to(ex, weight)
        if quantize_to is not None:
            scale, qmin = ex._fusions.static_inputs.get(ex._index, (None, -127))
            return lambda xs, step: (rms_norm(xs[0], weight, eps, quantize_to=quantize_to(xs[0]),
                                              input_scale=scale, act_qmin=qmin),)
        return lambda xs, step: (rms_norm(xs[0], weight, eps, offset, head_dim),)
    return lambda xs, step: (ops.rms_norm(xs[0], weight, eps, head_dim, offset),)


def _quantize_to(ex, weight) -> Callable[[torch.Tensor], torch.dtype | None] | None:
    """For a norm or SwiGLU of ``_Fusions.quant_producers``: x -> the dtype its rows leave in, the codes of the linear
    reading them (FP8 or INT8) where it takes quantized rows: from ``kernels.w8a8_rows.RUNTIME_MIN_ROWS`` rows on
    while that kernel runs for the scheme (the rows GEMM, cuBLAS past it), else past FUSED_MAX_ROWS (cuBLAS), and up
    to GEMV_RUNTIME_MAX_ROWS when the GEMV takes them (``kernels.gemv.GEMV_PREQUANT``: it then skips its own
    per-token max); shapes only, the same inside a CUDA graph; else None (the fused Triton GEMM takes the activation
    dtype's rows). None for any other node."""
    if ex._index not in ex._fusions.quant_producers or (weight is not None and weight.dtype != ex.dtype):
        return None
    from kernels import gemv, w8a8_rows
    from kernels.w8a8_gemm import FUSED_MAX_ROWS

    int8 = ex.graph["nodes"][ex._fusions.quant_producers[ex._index]]["attrs"]["quant"]["scheme"] == "w8a8_int8"
    codes = torch.int8 if int8 else torch.float8_e4m3fn
    gemv_rows = gemv.GEMV_RUNTIME_MAX_ROWS if gemv.GEMV_ENABLED and gemv.GEMV_PREQUANT else 0
    # exactly where the linear takes codes (_kernel_w8a8_linear): the GEMV's rows when it skips its own max, the rows
    # GEMM's (past the GEMV's), and past the fused GEMM's rows (cuBLAS, or the INT8 matmul)
    rows_from = max(w8a8_rows.RUNTIME_MIN_ROWS, gemv.GEMV_RUNTIME_MAX_ROWS + 1)
    rows_to = w8a8_rows.RUNTIME_MAX_ROWS_INT8 if int8 else w8a8_rows.RUNTIME_MAX_ROWS

    def quantize_to(x: torch.Tensor) -> torch.dtype | None:
        rows = x.numel() // x.shape[-1]
        return codes if rows <= gemv_rows or rows_from <= rows <= rows_to or rows > FUSED_MAX_ROWS else None

    return quantize_to


def _layer_norm_gain(w, attrs) -> torch.Tensor | None:
    """A layer_norm's gain: its weight, or with a ``weight_offset`` the weight plus it, formed once in the weight's
    dtype (Nemotron's LayerNorm1P computes ``self.weight + 1`` in the parameter's dtype)."""
    weight, offset = w.get("weight"), attrs.get("weight_offset", 0.0)
    if weight is None or not offset:
        return weight
    return (weight + offset).to(weight.dtype)


def _fused_add_layer_norm(w, attrs) -> Kernel:
    """A residual add and the LayerNorm reading its sum, in one kernel: (sum, normed). Operands of other shapes than
    each other (a broadcast add) take the add, then the norm."""
    from kernels.fused_norm import fused_add_layer_norm, layer_norm

    weight, bias, eps = _layer_norm_gain(w, attrs), w.get("bias"), attrs["eps"]

    def kernel(xs, step):
        x, residual = xs
        if x.shape != residual.shape or x.dtype != residual.dtype:
            total = x + residual
            return total, layer_norm(total, weight, bias, eps)
        return fused_add_layer_norm(x, residual, weight, bias, eps)[::-1]

    return kernel


def _done_before(xs, step) -> tuple:
    """A node whose output an earlier node's kernel produced (see _Fusions.add_layer_norms): nothing to do."""
    return ()


def _layer_norm(w, attrs, ex) -> Kernel:
    weight, bias, eps = _layer_norm_gain(w, attrs), w.get("bias"), attrs["eps"]
    fn = ops.layer_norm
    if ex.use_kernels:  # one Triton kernel (kernels.fused_norm.layer_norm); after a residual add, the add's node runs
        # both instead (_Fusions.add_layer_norms) and this one is not called
        from kernels.fused_norm import layer_norm as fn
    head_dim = attrs.get("head_dim")
    if head_dim and weight is not None and weight.dim() == 2:  # a gain per head, [heads, head_dim]: torch ops, CUDA too
        return lambda xs, step: (ops.layer_norm_heads(xs[0], weight, bias, eps, head_dim),)
    if head_dim:  # each head's features a row of their own, one gain and bias for every head
        return lambda xs, step: (fn(xs[0].reshape(-1, head_dim), weight, bias, eps).reshape(xs[0].shape),)
    return lambda xs, step: (fn(xs[0], weight, bias, eps),)


def _fused_add_rms_norm(w, attrs, ex) -> Kernel:
    weight, eps, offset = w.get("weight"), attrs["eps"], attrs.get("weight_offset", 0.0)
    if ex._index in ex._fusions.pending_norms:  # the linear before it added the residual (plan_fusions)
        from kernels.fused_norm import fused_add_rms_norm
        from kernels.w4a16_frag import PendingNorm, ResidualSum

        def pending(xs, step):
            done = next((x for x in xs if isinstance(x, ResidualSum)), None)
            if done is not None:
                return PendingNorm(done.total, done.row_ss, weight, eps), done.total
            return fused_add_rms_norm(xs[0], xs[1], weight, eps)  # the linear ran another path (more rows)

        return pending
    fn = ops.fused_add_rms_norm
    if ex.use_kernels and not offset:  # as _rms_norm
        from kernels.fused_norm import fused_add_rms_norm as fn

        quantize_to = _quantize_to(ex, weight)
        if quantize_to is not None:
            scale, qmin = ex._fusions.static_inputs.get(ex._index, (None, -127))
            return lambda xs, step: fn(xs[0], xs[1], weight, eps, quantize_to=quantize_to(xs[0]),
                                       input_scale=scale, act_qmin=qmin)
    return lambda xs, step: fn(xs[0], xs[1], weight, eps, offset)


def _linear(w, attrs, ex) -> Kernel:
    quant = attrs.get("quant")
    unknown = sorted(set(w) - set(LINEAR_ROLES))
    if unknown:  # run without it, the linear would compute something else than the graph says
        raise GraphFormatError(f"{ex._node.get('op', 'linear')} {ex._node.get('source') or ''} carries weight role(s) "
                               f"{', '.join(unknown)}, which this runtime does not run; it runs "
                               f"{', '.join(LINEAR_ROLES)}: update the runtime or rebuild the artifact")
    if quant and "act_qmin" in quant:  # a bound on the int8 activation codes: run as written, or not at all
        try:
            int8_act_qmin(quant)
        except ValueError as e:
            raise GraphFormatError(f"{ex._node.get('op', 'linear')} {ex._node.get('source') or ''}: {e}; update the "
                                   f"runtime or rebuild the artifact") from None
    if set(INPUT_ROLES) & set(w):  # what the linear does to its input, from the loaded tensors (before any path)
        where = _node_name(ex._index, ex._node)
        if not quant:
            raise GraphFormatError(f"{where}: it carries {', '.join(r for r in INPUT_ROLES if r in w)} but has no "
                                   f"quant attr; only a quantized linear reads its input through them")
        _check_input_tensors(w, where)
    if quant and "pre_quant_scale" in w and ex.use_kernels:  # an exporter's input scale: x * s, then any kernel path
        rest = {role: t for role, t in w.items() if role != "pre_quant_scale"}
        inner = _linear(rest, {k: v for k, v in attrs.items() if k != "split_sizes"}, ex)
        fn = scale_input(lambda x: inner([x], None)[0], w["pre_quant_scale"], ex.dtype)
    elif quant and "perm" in w and ex.use_kernels:  # act-order import: every kernel path reads x[:, perm]
        rest = {role: t for role, t in w.items() if role != "perm"}
        inner = _linear(rest, {k: v for k, v in attrs.items() if k != "split_sizes"}, ex)
        fn = permute_input(lambda x: inner([x], None)[0], w["perm"])
    elif quant and ex.use_kernels and quant["scheme"] in ("w4a16", "w8a16"):
        fn = _kernel_weight_only_linear(w, quant, lm_head=attrs.get("lm_head", False),
                                        gated=not attrs.get("lm_head") and ex._index in ex._fusions.gated,
                                        dtype=ex.dtype, swiglu_out=ex._index in ex._fusions.swiglu_out)
    elif quant and ex.use_kernels and quant["scheme"] in ("fp8", "w8a8_int8"):
        fn = _kernel_w8a8_linear(w, quant, ex)
    elif quant and ex.use_kernels and quant["scheme"] == "fp8_block":
        fn = _kernel_fp8_block_linear(w, quant, ex.dtype)
    elif quant:
        fn = make_quant_linear(quant["scheme"], w, quant, ex.dtype)
    elif ex.use_kernels:
        fn = _kernel_dense_linear(w["weight"], w.get("bias"), gated=ex._index in ex._fusions.gated
                                  and not attrs.get("lm_head"))
    else:
        weight, bias = w["weight"], w.get("bias")
        fn = lambda x: ops.linear(x, weight, bias)  # noqa: E731
    if ex._fusions.pending_norms and not getattr(fn, "takes_pending_norm", False):  # plan_fusions saw other shapes
        inner = fn
        fn = lambda x: inner(x.materialize() if hasattr(x, "materialize") else x)  # noqa: E731
    if ex._index in ex._fusions.residual_out and getattr(fn, "takes_residual", False):
        return lambda xs, step: (fn(xs[0], residual=xs[1]),)  # ResidualSum, or y where the kernel does not run
    split, num_heads = attrs.get("split_sizes"), attrs.get("split_heads")
    if split and num_heads:  # [T, H * sum(split)] -> per part [T, H * part], every head's part side by side
        return lambda xs, step: tuple(part.reshape(part.shape[0], -1) for part in
                                      fn(xs[0]).view(xs[0].shape[0], num_heads, -1).split(split, dim=-1))
    if split:
        return lambda xs, step: fn(xs[0]).split(split, dim=-1)
    return lambda xs, step: (fn(xs[0]),)


def _kernel_w8a8_linear(w, quant, ex) -> Callable[[torch.Tensor], torch.Tensor]:
    """FP8 / INT8 W8A8: up to ``GEMV_RUNTIME_MAX_ROWS`` tokens the Triton GEMV (``kernels.gemv``, while
    ``GEMV_ENABLED``); where ``kernels.w8a8_rows.runtime_applies`` (FP8 on bf16/fp16 rows, INT8 on any) the rows GEMM
    on rows a norm quantized (``QuantizedRows``), or ``quantize_rows`` (per token) / ``quantize_rows_static`` (a
    calibrated input scale) quantizes; up to ``FUSED_MAX_ROWS`` the fused Triton GEMM (the activation quantization
    inside); more tokens go to cuBLAS (``_scaled_mm`` for FP8 in bf16/fp16, ``_int_mm`` for INT8) after
    ``quantize_rows``, one kernel for the dynamic per-token quantization (torch's takes six). Every path clamps INT8
    activation codes at the quant attr's ``act_qmin`` (-127, or -128: ``kernels.torch_quant.int8_act_qmin``); the
    per-token ones (``quantize_rows``, a norm's per-token ``QuantizedRows``) never reach below -127; a norm's static
    codes take the linear's ``act_qmin`` (``_Fusions.static_inputs``)."""
    from kernels import gemv, w8a8_rows
    from kernels.w8a8_gemm import FUSED_MAX_ROWS, QuantizedRows, quantize_rows, quantize_rows_static, w8a8_linear

    storage = w["qweight"].dtype

    def quantize(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_rows(x2, storage)

    qweight, w_scale, input_scale, bias = w["qweight"], w["weight_scale"], w.get("input_scale"), w.get("bias")
    qmin = int8_act_qmin(quant)
    # cuBLAS's _scaled_mm takes weights whose dimensions are multiples of 16, _int_mm multiples of 8: a quantized
    # lm_head over a vocabulary such as 32001 is not, and runs the Triton GEMM at every size instead
    align = 16 if quant["scheme"] == "fp8" else 8
    takes_quantized = False
    if qweight.shape[0] % align or qweight.shape[1] % align:
        large = lambda x: w8a8_linear(x, qweight, w_scale, input_scale, bias, act_qmin=qmin)  # noqa: E731
    elif (quant["scheme"] == "fp8" and _scaled_mm_device(w["qweight"].device)
          and ex.dtype in (torch.bfloat16, torch.float16)):
        large = make_fp8_scaled_mm_linear(w, quantize, ex.dtype, lambda x2, scale: quantize_rows_static(
            x2, scale, storage, act_qmin=qmin), fast_accum=ex.fp8_fast_accum)
        takes_quantized = True
    else:
        large = make_quant_linear(quant["scheme"], w, quant, ex.dtype, quantize)
        takes_quantized = quant["scheme"] == "w8a8_int8"  # past the rows GEMM's rows: _int_mm on a norm's codes

    def linear(x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        rows = (x.codes if isinstance(x, QuantizedRows) else x).numel() // x.shape[-1]
        if isinstance(x, QuantizedRows):  # a norm quantized them (plan_fusions): the GEMV, the rows GEMM or cuBLAS
            if gemv.GEMV_ENABLED and rows <= gemv.GEMV_RUNTIME_MAX_ROWS:
                return gemv.w8a8_gemv(x, qweight, w_scale, None, bias, out_dtype=ex.dtype)
            if w8a8_rows.runtime_applies(rows, storage, ex.dtype):
                return w8a8_rows.w8a8_rows_linear(x.codes, x.scales, qweight, w_scale, bias, out_dtype=ex.dtype)
            if not takes_quantized:
                raise RuntimeError(f"a norm fed quantized rows {tuple(x.shape)} to a linear of weight "
                                   f"{tuple(qweight.shape)} that does not take them past the rows GEMM "
                                   f"(_scaled_mm or the INT8 matmul; plan_fusions)")
            return large(x)
        # shapes only: no sync, the same inside a CUDA graph
        if gemv.GEMV_ENABLED and rows <= gemv.GEMV_RUNTIME_MAX_ROWS:
            return gemv.w8a8_gemv(x, qweight, w_scale, input_scale, bias, act_qmin=qmin)
        if w8a8_rows.runtime_applies(rows, storage, x.dtype):  # per-token scales, or the static one per row
            x2 = x.reshape(-1, x.shape[-1])
            codes, scales = quantize(x2) if input_scale is None else quantize_rows_static(x2, input_scale, storage,
                                                                                          act_qmin=qmin)
            y = w8a8_rows.w8a8_rows_linear(codes, scales, qweight, w_scale, bias, out_dtype=x.dtype)
            return y.reshape(*x.shape[:-1], y.shape[-1])
        if rows <= FUSED_MAX_ROWS:
            return w8a8_linear(x, qweight, w_scale, input_scale, bias, act_qmin=qmin)
        return large(x)

    return linear


def _kernel_fp8_block_linear(w, quant, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """Block-scaled FP8 (fine-grained FP8 checkpoints): the Triton kernels at every size (``kernels.fp8_block_gemm``:
    the GEMV at a few rows, the GEMM above; cuBLAS's ``_scaled_mm`` here takes per-row scales, not per-block ones); a
    block width they do not take runs the torch reference."""
    from kernels import fp8_block_gemm

    if not fp8_block_gemm.supports(quant["block_size"]):
        return make_quant_linear("fp8_block", w, quant, dtype)
    qweight, scales, bias, block = w["qweight"], w["weight_scale"], w.get("bias"), quant["block_size"]
    return lambda x: fp8_block_gemm.fp8_block_linear(x, qweight, scales, block, bias)


def _kernel_dense_linear(weight: torch.Tensor, bias: torch.Tensor | None,
                         gated: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """An unquantized linear: ``kernels.gemv.dense_gemv`` up to ``DENSE_RUNTIME_MAX_ROWS`` rows (a decode step at
    batch 1-2: PDL and the L2 prefetch overlap it with the kernel before it; cuBLAS's GEMV takes neither),
    ``kernels.dense_rows`` from 3 to its ``RUNTIME_MAX_ROWS`` rows (a verify step, a decode of a few sequences: the
    same, on the tensor cores), cuBLAS beyond. ``gated`` (``plan_fusions``): x is a merged [gate | up] and the input silu(gate) * up, formed in the
    GEMV's x loads or by ``silu_mul`` before cuBLAS."""
    from kernels import dense_rows, gemv
    from kernels.activation import silu_mul

    def linear(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]  # shapes only
        if rows <= gemv.DENSE_RUNTIME_MAX_ROWS and gemv.dense_applies(x, weight):
            return gemv.dense_gemv(x, weight, bias, gated=gated)
        if dense_rows.MIN_ROWS <= rows <= dense_rows.RUNTIME_MAX_ROWS and dense_rows.applies(x, weight):
            return dense_rows.dense_rows(x, weight, bias, gated=gated)
        if gated:
            x = silu_mul(x)
        return ops.linear(x, weight, bias)

    return linear


def fp8_cublas_min_rows() -> int:
    """The fewest rows of x with which an FP8 linear on bf16 / fp16 activations runs cuBLAS's ``_scaled_mm`` on CUDA
    (fewer take the GEMV, the rows GEMM or the fused GEMM: ``_kernel_w8a8_linear``)."""
    from kernels import gemv, w8a8_rows
    from kernels.w8a8_gemm import FUSED_MAX_ROWS

    return max(gemv.GEMV_RUNTIME_MAX_ROWS if gemv.GEMV_ENABLED else 0, w8a8_rows.RUNTIME_MAX_ROWS, FUSED_MAX_ROWS) + 1


def _scaled_mm_device(device: torch.device) -> bool:
    """Whether FP8 linears past FUSED_MAX_ROWS rows run ``torch._scaled_mm`` on this device (CUDA; the CPU path
    runs the reference arithmetic)."""
    return device.type == "cuda"


def _in_slices(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, step: int) -> torch.Tensor:
    """fn over the rows of x, ``step`` at a time."""
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.cat([fn(x2[i: i + step]) for i in range(0, x2.shape[0], step)])
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _kernel_weight_only_linear(w, quant, lm_head: bool = False, gated: bool = False,
                               dtype: torch.dtype = torch.bfloat16,
                               swiglu_out: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """W4A16/W8A16 through the Triton kernels that read the packed weights (they stay packed in memory). On the frag
    layout (``kernels.w4a16_frag``, bf16): its kernel up to FRAG_RUNTIME_MAX_ROWS rows, then ``kernels.frag_mm`` where
    it is ``preferred`` (large weights up to MM_RUNTIME_MAX_ROWS rows), then ``frag_gemm`` where
    ``gemm_preferred`` (large weights up to GEMM_RUNTIME_MAX_ROWS rows; an lm_head at any size), else the weight
    dequantized for cuBLAS. Else, where ``kernels.w4a16_mma`` takes the group size (``MMA_ENABLED``), its layout: its
    tensor-core kernel where it is the faster (``prefers_kernel``: decode-sized steps), else the weight dequantized into
    a temporary for cuBLAS. An lm_head is never dequantized (a [vocab, hidden] temporary per step): more rows run the
    kernel in slices. Otherwise the K-major layout: the GEMV up to ``GEMV_RUNTIME_MAX_ROWS`` tokens (``kernels.gemv``,
    while ``GEMV_ENABLED``), else the GEMM. ``gated`` (``plan_fusions``, mma layout only): x is a merged [gate | up] and
    the linear's input silu(gate) * up, formed in the kernel's x loads or by ``silu_mul`` before cuBLAS.
    ``swiglu_out`` (``plan_fusions``, frag layout only): the linear is a merged [gate | up] and returns
    silu(gate) * up, formed by the frag kernel's programs that write y (its rows stored in ``gate_up_order``), or
    by ``silu_mul`` after the larger paths."""
    from kernels import frag_mm, gemv, w4a16_frag, w4a16_mma
    from kernels.activation import silu_mul, silu_mul_tiles
    from kernels.w4a16_gemm import repack_w4a16, w4a16_linear

    from kernels.w8a8_gemm import round_rows_fp8

    qweight, bias, bits = w["qweight"], w.get("bias"), quant["bits"]
    in_features = qweight.shape[1] * (2 if bits == 4 else 1)
    group = in_features if quant["group_size"] == -1 else quant["group_size"]
    frag = w4a16_frag.runtime_layout(bits, group, in_features, qweight.shape[0], dtype)
    # W4A8 (activation_quant fp8): x rounded per token to e4m3; past the frag kernel's rows frag_mm_fp8 runs the
    # fp8 MMA on the codes (sm_89+), elsewhere the W4A16 kernels read the rounded x
    fp8_acts = quant.get("activation_quant") == "fp8"
    if swiglu_out and not (frag and qweight.shape[0] % (2 * w4a16_frag.TILE_N) == 0):
        # planned from the graph's shapes, and these weights (a shard) do not fit: the SwiGLU after the linear
        inner = _kernel_weight_only_linear(w, quant, lm_head, gated, dtype)
        return lambda x: silu_mul(inner(x))
    if fp8_acts and not (frag and bits == 4):  # no fp8 MMA on these layouts: the rounded x into the W4A16 paths
        assert not gated, "plan_fusions gates no W4A8 linear"
        inner = _kernel_weight_only_linear(w, {**quant, "activation_quant": None}, lm_head, gated, dtype, swiglu_out)
        return lambda x: inner(round_rows_fp8(x.materialize() if isinstance(x, w4a16_frag.PendingNorm) else x))
    if frag:
        assert not gated, "plan_fusions gates no linear on the frag layout"
        scales, zeros = w["scales"], w["zeros"]
        if swiglu_out:  # once, at load
            qweight, scales, zeros, bias = w4a16_frag.interleave_gate_up(qweight, scales, zeros, bias)
        packed = w4a16_frag.repack_frag(qweight, scales, zeros, group, bits)  # once, at load
        out_features = qweight.shape[0]

        def frag_linear(x: torch.Tensor | w4a16_frag.PendingNorm,
                        residual: torch.Tensor | None = None) -> torch.Tensor | w4a16_frag.ResidualSum:
            xt = x.total if isinstance(x, w4a16_frag.PendingNorm) else x
            rows = xt.numel() // xt.shape[-1]
            if fp8_acts:
                if isinstance(x, w4a16_frag.PendingNorm):
                    x = xt = x.materialize()
                if frag_mm.fp8_preferred(rows, xt, out_features, in_features):  # the fp8 MMA; it rounds x itself
                    y = frag_mm.frag_mm_fp8(x, bias=bias, **packed)  # y, not a ResidualSum: the norm adds it
                    return silu_mul_tiles(y, w4a16_frag.TILE_N) if swiglu_out else y
                x = xt = round_rows_fp8(x)
            if rows <= w4a16_frag.FRAG_RUNTIME_MAX_ROWS and w4a16_frag.frag_applies(xt, rows):  # shapes and dtype
                return w4a16_frag.w4a16_frag(x, bias=bias, gated=swiglu_out, residual=residual, **packed)
            if isinstance(x, w4a16_frag.PendingNorm):  # plan_fusions: the norm's readers are all frag linears
                x = x.materialize()
            if swiglu_out:  # read in gate_up_order, no de-interleaved copy
                return silu_mul_tiles(frag_any(x), w4a16_frag.TILE_N)
            return frag_any(x)

        def frag_any(x: torch.Tensor) -> torch.Tensor:
            rows = x.numel() // x.shape[-1]
            if frag_mm.preferred(rows, out_features, in_features, bits):  # tensor cores on the codes, no temporary
                return frag_mm.frag_mm(x, bias=bias, **packed)
            if lm_head or w4a16_frag.gemm_preferred(rows, out_features, in_features):
                return w4a16_frag.frag_gemm(x, bias=bias, **packed)  # tensor-core tiles, no dequantized temporary
            if lm_head and w4a16_frag.frag_applies(x, 1):  # never a [vocab, hidden] temporary
                return _in_slices(lambda xs: w4a16_frag.w4a16_frag(xs, bias=bias, **packed), x,
                                  w4a16_frag.FRAG_MAX_ROWS)
            return F.linear(x, w4a16_frag.dequantize_frag(**packed, dtype=x.dtype), bias)

        frag_linear.takes_residual = frag_linear.takes_pending_norm = True  # plan_fusions' residual_out, pending_norms
        return frag_linear
    if w4a16_mma.MMA_ENABLED and w4a16_mma.supports(bits, group, in_features):
        packed = w4a16_mma.repack_mma(qweight, w["scales"], w["zeros"], group, bits)  # once, at load

        out_features = qweight.shape[0]

        def mma_linear(x: torch.Tensor) -> torch.Tensor:
            if w4a16_mma.prefers_kernel(x.numel() // x.shape[-1], out_features, in_features):  # shapes only
                return w4a16_mma.w4a16_mma(x, bias=bias, gated=gated, **packed)
            if gated:
                x = silu_mul(x)
            if lm_head:  # never a [vocab, hidden] temporary
                return _in_slices(lambda xs: w4a16_mma.w4a16_mma(xs, bias=bias, **packed), x, w4a16_mma.MMA_MAX_ROWS)
            return F.linear(x, w4a16_mma.dequantize_mma(**packed, dtype=x.dtype), bias)

        return mma_linear
    assert not gated, "plan_fusions gates only linears on the mma layout"
    packed = repack_w4a16(qweight, w["scales"], w["zeros"], group, bits)  # K-major: coalesced loads, once

    def linear(x: torch.Tensor) -> torch.Tensor:
        if gemv.GEMV_ENABLED and x.numel() <= gemv.GEMV_RUNTIME_MAX_ROWS * x.shape[-1]:  # shapes only, as above
            return gemv.w4a16_gemv(x, bias=bias, **packed)
        return w4a16_linear(x, bias=bias, **packed)

    return linear


def _xielu(w, attrs, ex) -> Kernel:
    """Apertus's activation (``ops.xielu``): torch ops on CPU and CUDA alike, in graphs too."""
    alpha_p, alpha_n, beta, eps = w["alpha_p"], w["alpha_n"], w["beta"], w["eps"]
    return lambda xs, step: (ops.xielu(xs[0], alpha_p, alpha_n, beta, eps),)


def _position_scale(w, attrs, ex) -> Kernel:
    """Ministral 3's query temperature (``ops.position_scale``): a few elementwise ops on the device, in graphs too."""
    beta, period = float(attrs["beta"]), int(attrs["period"])
    return lambda xs, step: (ops.position_scale(xs[0], xs[1], beta, period),)


def _rope(w, attrs, ex) -> Kernel:
    inv_freq = w["inv_freq"].float()
    num_heads, head_dim, scaling = attrs["num_heads"], attrs["head_dim"], attrs.get("attention_scaling", 1.0)
    rotary_dim, interleaved = attrs.get("rotary_dim"), bool(attrs.get("interleaved"))
    # LongRoPE: inv_freq is [2, rotary_dim / 2]; positions offset by LONG_ROPE_OFFSET take the second table
    long_from = LONG_ROPE_OFFSET if attrs.get("long_from") is not None else None
    key = f"{id(w['inv_freq'])}:{interleaved}"
    # partial and interleaved rotary too (StableLM, Phi-2, GPT-NeoX; Cohere): one kernel; where the attention rotates
    # q and k itself, in its KV write (``_Fusions.rope``), this node is absorbed instead
    if ex.use_kernels:
        from kernels.rope import apply_rope_

        # in place when this node is the only reader of its input (q/k fresh from the QKV projection)
        exclusive = ex._num_consumers.get(ex._node["inputs"][0], 0) == 1

        def rope_kernel(xs, step):
            x, positions = xs
            if not exclusive or x.stride(-1) != 1:
                x = x.contiguous() if exclusive else x.clone()
            return (apply_rope_(x, positions, inv_freq, num_heads, head_dim, scaling, rotary_dim, interleaved,
                                long_from),)

        return rope_kernel

    def kernel(xs, step):
        x, positions = xs
        tables = step.rope_cache.get(key)
        if tables is None:
            tables = step.rope_cache[key] = ops.rope_tables(positions, inv_freq, scaling, x.dtype, interleaved,
                                                            long_from)
        return (ops.rope(x, *tables, num_heads, head_dim, rotary_dim, interleaved),)

    return kernel


def _check_kv_scales(w, attrs) -> None:
    """A quantized KV cache's k_scale / v_scale: finite and > 0 (the codes are the values divided by them; the kernels
    fold k_scale into the softmax's scale, which must stay positive)."""
    for name in ("k_scale", "v_scale"):
        if name in w:
            values = w[name].float()
            if not bool(torch.isfinite(values).all()) or not bool((values > 0).all()):
                raise GraphFormatError(f"attention layer {attrs.get('layer')}: its {name} holds "
                                       f"{values.flatten()[:4].tolist()}; expected finite values > 0 (a quantized KV "
                                       f"cache's scale): rebuild the artifact")


def _attention(w, attrs, ex) -> Kernel:
    layer, num_heads, num_kv = attrs["layer"], attrs["num_heads"], attrs["num_kv_heads"]
    head_dim, scale, window = attrs["head_dim"], attrs["scale"], attrs.get("sliding_window")
    softcap, sinks = attrs.get("softcap", 0.0), w.get("sinks")  # Gemma 2's score soft-cap, gpt-oss's sinks
    _check_kv_scales(w, attrs)  # before either path is built (_paged_attention's scales too)
    store, load = _kv_codec(attrs.get("kv_cache_dtype"), w.get("k_scale"), w.get("v_scale"), ex.dtype)
    # RoPE of q and k done here (plan_fusions): the node reads them unrotated, and the positions after v
    rope = _fused_rope(ex, ex._fusions.rope[ex._index]) if ex._index in ex._fusions.rope else None

    paged = _paged_attention(w, attrs, rope) if ex.use_kernels else None  # None: a head_dim the kernels lack

    def kernel(xs, step):
        if step.inp.paged is not None and paged is not None:
            return paged(xs, step.inp.paged, step)
        if step.inp.paged is not None and not step.inp.seqs:  # a CUDA-graph step carries only the paged cache
            from kernels.paged_attention import SUPPORTED_HEAD_DIMS

            raise GraphFormatError(f"attention layer {layer}: head_dim {head_dim} has no paged attention kernel "
                                   f"(they take {', '.join(map(str, SUPPORTED_HEAD_DIMS))}), so its steps cannot run "
                                   f"from CUDA graphs; serve with --no-cuda-graphs (ServingConfig(cuda_graphs=False))")
        if rope is not None:  # the separate kernels, in place (the fusion's inputs have no other reader)
            q, k, v, positions = xs
            xs = [rope.apply(q, positions, num_heads), rope.apply(k, positions, num_kv), v]
        q, k, v = xs  # q: [num_tokens, num_heads * head_dim]; k, v: [num_tokens, num_kv * head_dim]
        q = q.view(-1, num_heads, head_dim)
        k, v = store(k.view(-1, num_kv, head_dim), v.view(-1, num_kv, head_dim))
        outs, start = [], 0
        for s in step.inp.seqs:
            end = start + s.num_new
            s.kv.append(layer, s.num_context, k[start:end], v[start:end])
            k_all, v_all = load(*s.kv.view(layer, s.num_context + s.num_new))
            outs.append(ops.attention_one(q[start:end], k_all, v_all, s.num_context, scale, window, softcap, sinks))
            start = end
        return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=0),)

    return kernel


@dataclass
class _FusedRope:
    """The RoPE an attention node applies to its q and k (``_Fusions.rope``)."""

    inv_freq: torch.Tensor  # fp32 [rotary_dim / 2], or [2, rotary_dim / 2] with long_from
    scaling: float  # attention_scaling
    head_dim: int
    rotary_dim: int | None = None  # partial rotary: the first rotary_dim features of each head (None: all)
    interleaved: bool = False  # GPT-J pairs
    long_from: int | None = None  # LongRoPE: LONG_ROPE_OFFSET (positions offset by it take inv_freq's second table)

    def apply(self, x: torch.Tensor, positions: torch.Tensor, num_heads: int) -> torch.Tensor:
        from kernels.rope import apply_rope_

        return apply_rope_(x, positions, self.inv_freq, num_heads, self.head_dim, self.scaling, self.rotary_dim,
                           self.interleaved, self.long_from)


def _fused_rope(ex, planned: tuple[dict[str, Any], str]) -> _FusedRope:
    rq = planned[0]
    return _FusedRope(ex.params[rq["weights"]["inv_freq"]].float(), rq["attrs"].get("attention_scaling", 1.0),
                      rq["attrs"]["head_dim"], rq["attrs"].get("rotary_dim"), bool(rq["attrs"].get("interleaved")),
                      LONG_ROPE_OFFSET if rq["attrs"].get("long_from") is not None else None)


def _paged_attention(w, attrs, rope: _FusedRope | None = None
                     ) -> Callable[[list[torch.Tensor], PagedAttentionMetadata, _Step], tuple] | None:
    """Attention through the Triton kernels: write the step's K/V into the paged cache (quantizing for
    FP8/INT8 caches), then decode (one query per sequence) or varlen prefill over the block tables. With
    ``rope``, q and k arrive unrotated and one kernel rotates q in place and writes the rotated k and v. A
    decode-only step does all of it in the decode kernel (``FUSE_KV_WRITE``), unless its rows are chained
    (``PagedAttentionMetadata.chained``)."""
    from kernels.paged_attention import (SUPPORTED_HEAD_DIMS, NewKV, decode_rows, paged_decode_attention,
                                         paged_mixed_attention, paged_prefill_attention, rope_write_kv_cache,
                                         write_kv_cache)

    layer, num_heads, num_kv = attrs["layer"], attrs["num_heads"], attrs["num_kv_heads"]
    head_dim, scale, window = attrs["head_dim"], attrs["scale"], attrs.get("sliding_window")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return None
    k_scale = w["k_scale"].float().reshape(1) if "k_scale" in w else None
    v_scale = w["v_scale"].float().reshape(1) if "v_scale" in w else None
    extra = {"softcap": attrs.get("softcap", 0.0),  # made once: the step passes the same tensors (CUDA graphs)
             "sinks": w["sinks"].float().contiguous() if "sinks" in w else None}

    def run(xs, md: PagedAttentionMetadata, step: _Step):
        q, k, v = xs[:3]  # q: [num_tokens, num_heads * head_dim]; k, v: [num_tokens, num_kv * head_dim]
        q = q.view(-1, num_heads, head_dim)
        kc, vc = md.k_caches[layer], md.v_caches[layer]
        k, v = k.view(-1, num_kv, head_dim), v.view(-1, num_kv, head_dim)
        new_kv = None
        # attention over the step's own rows: a step of fresh prompts over a 16-bit cache, its rotated keys
        # (PREFILL_OWN_KV); a step carrying prefill over a quantized cache, the codes (prefill_own_codes)
        own_kv = not md.decode_only and (
            (PREFILL_OWN_KV and md.fresh and kc.dtype == q.dtype) or (rope is not None and prefill_own_codes(kc.dtype)))
        if md.decode_only and FUSE_KV_WRITE and not md.chained:  # the decode kernel writes its row's K/V itself
            rotary = (xs[3], rope.inv_freq, rope.scaling, rope.rotary_dim, rope.interleaved, rope.long_from) \
                if rope is not None else ()
            new_kv = NewKV(k, v, md.slot_mapping, *rotary)
        elif rope is not None:
            # q is rotated in place; with own_kv k too, or k and v hold the codes (the attention is their only reader)
            rope_write_kv_cache(q, k, v, xs[3], rope.inv_freq, rope.scaling, kc, vc, md.slot_mapping, k_scale=k_scale,
                                v_scale=v_scale, rotary_dim=rope.rotary_dim, interleaved=rope.interleaved,
                                long_from=rope.long_from, k_in_place=own_kv)
        else:
            write_kv_cache(k, v, kc, vc, md.slot_mapping, k_scale=k_scale, v_scale=v_scale)
        if md.decode_only:
            out = paged_decode_attention(q, kc, vc, md.block_tables, md.seq_lens, scale, k_scale=k_scale,
                                         v_scale=v_scale, sliding_window=window, new_kv=new_kv, **extra)
        elif md.mixed and mixed_decode_split(kc.dtype):
            if step.decode_rows is None:  # once per step, on the device (captured with a step graph)
                step.decode_rows = decode_rows(md.cu_seqlens_q, md.seq_lens, q.shape[0])
            out = paged_mixed_attention(q, kc, vc, md.block_tables, md.cu_seqlens_q, md.context_lens, scale,
                                        step.decode_rows, k_scale=k_scale, v_scale=v_scale, sliding_window=window,
                                        contiguous_kv=(k, v) if own_kv else None, **extra)
        else:
            # no decode beside a prompt here when the split applies (step graphs set md.mixed from the split too):
            # the prompts' tiling (kernels.paged_attention._prefill_config). A step graph of one-token sequences only
            # (a draft model's catch-up feed) can reach it too: 128-row tiles then, as correct, slower
            prompts_only = not md.mixed and mixed_decode_split(kc.dtype)
            out = paged_prefill_attention(q, kc, vc, md.block_tables, md.cu_seqlens_q, md.context_lens, scale,
                                          k_scale=k_scale, v_scale=v_scale, sliding_window=window,
                                          contiguous_kv=(k, v) if own_kv else None, prompts_only=prompts_only,
                                          **extra)
        return (out.view(-1, num_heads * head_dim),)

    return run


def _kv_codec(kind: str | None, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, dtype: torch.dtype):
    """(store, load) for a layer's cache: identity, or quantize with the calibrated per-layer scales."""
    if kind is None:
        return (lambda k, v: (k, v)), (lambda k, v: (k, v))
    qmax = {"fp8": 448.0, "int8": 127.0}[kind]
    storage = KV_STORAGE[kind]
    ks, vs = k_scale.float(), v_scale.float()

    def quant(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        y = (x.float() / s).clamp(-qmax, qmax)
        return (y.round() if kind == "int8" else y).to(storage)

    return ((lambda k, v: (quant(k, ks), quant(v, vs))),
            (lambda k, v: ((k.float() * ks).to(dtype), (v.float() * vs).to(dtype))))


def _activation(w, attrs, ex) -> Kernel:
    fn = attrs["fn"]
    return lambda xs, step: (ops.activation(xs[0], fn),)


def _silu_mul(w, attrs, ex) -> Kernel:
    if ex.use_kernels:
        from kernels.activation import silu_mul

        quantize_to = _quantize_to(ex, None)  # for an FP8 or INT8 down projection (plan_fusions)
        if quantize_to is not None:
            scale, qmin = ex._fusions.static_inputs.get(ex._index, (None, -127))
            return lambda xs, step: (silu_mul(*xs, quantize_to=quantize_to(xs[0]), input_scale=scale,
                                              act_qmin=qmin),)
        return lambda xs, step: (silu_mul(*xs),)
    return lambda xs, step: (ops.silu_mul(*xs),)


def _moe(w, attrs, ex) -> Kernel:
    # On the kernel path, kernels.moe: routing, the expert blocks and both grouped GEMMs on the device, nothing read
    # on the host (CUDA-graph capturable). The torch reference elsewhere: it reads each expert's token count on the
    # host, which a CUDA graph cannot capture
    # FP8 experts (`quant` scheme fp8): e4m3 codes with per-channel scales, inputs quantized per token. W4A16 experts
    # (scheme w4a16): packed 4-bit codes with group scales and zero points, dequantized to x's dtype. Block-FP8 experts
    # (scheme fp8_block): e4m3 codes with a scale per [bn, bk] block, inputs quantized per token and bk-wide group
    gate_weight, gate_bias, w_gate_up, w_down = w["gate_weight"], w.get("gate_bias"), w["w_gate_up"], w["w_down"]
    scheme_args = {}  # W4A16 experts' group scales, zero points and size; block-FP8 experts' block size
    if attrs.get("quant", {}).get("scheme") == "w4a16":
        scheme_args = {role: w[role] for role in ("w_gate_up_scales", "w_gate_up_zeros", "w_down_scales",
                                                  "w_down_zeros")}
        scheme_args["group_size"] = int(attrs["quant"]["group_size"])
    if attrs.get("quant", {}).get("scheme") == "fp8_block":
        scheme_args["block_size"] = tuple(int(b) for b in attrs["quant"]["block_size"])
    experts = {**scheme_args, "w_gate_up_scale": w.get("w_gate_up_scale"), "w_down_scale": w.get("w_down_scale"),
               # gpt-oss: expert biases and its clamped SwiGLU
               "b_gate_up": w.get("b_gate_up"), "b_down": w.get("b_down"),
               "swiglu_alpha": float(attrs.get("swiglu_alpha", 0.0)),
               "swiglu_limit": float(attrs.get("swiglu_limit", 0.0)),
               # GLM-4.5, dots1, ERNIE 4.5 MoE, MiniMax-M2: a selection bias, a scaling factor, fp32 logits
               "select_bias": w.get("select_bias"),
               "routed_scaling_factor": float(attrs.get("routed_scaling_factor", 1.0)),
               "router_fp32": bool(attrs.get("router_fp32", False))}
    top_k, scoring, norm = attrs["top_k"], attrs["scoring"], attrs["norm_topk_prob"]
    fn, round_weights = attrs["activation"], attrs.get("round_weights", False)
    if fn == "clamped_swiglu" and not ("swiglu_alpha" in attrs and attrs.get("swiglu_limit", 0) > 0):
        raise GraphFormatError("graph.json: a moe node with activation clamped_swiglu needs swiglu_alpha and "
                               "swiglu_limit > 0")
    if ex.use_kernels:
        from kernels.moe import fused_moe

        return lambda xs, step: (fused_moe(xs[0], gate_weight, w_gate_up, w_down, top_k, scoring, norm, fn,
                                           gate_bias, round_weights, **experts),)

    def kernel(xs, step):
        if xs[0].is_cuda and torch.cuda.is_current_stream_capturing():
            raise GraphFormatError("the moe op's torch implementation reads each expert's token count on the host, "
                                   "which a CUDA graph cannot capture; run it on the kernels (use_kernels, the "
                                   "default on CUDA: kernels.moe) or serve with --no-cuda-graphs "
                                   "(ServingConfig(cuda_graphs=False))")
        return (ops.moe(xs[0], gate_weight, w_gate_up, w_down, top_k, scoring, norm, fn, gate_bias, round_weights,
                        **experts),)

    return kernel


def _elementwise(w, attrs, ex) -> Kernel:
    fn = attrs["fn"]
    if fn == "add":
        return lambda xs, step: (xs[0] + xs[1],)
    if fn == "mul":
        return lambda xs, step: (xs[0] * xs[1],)
    if fn == "scale":
        value = attrs["value"]
        return lambda xs, step: (xs[0] * value,)
    raise GraphFormatError(f"elementwise fn {fn!r} is not one of add, mul, scale")


def _lm_head(w, attrs, ex) -> Kernel:
    """Logits [num_selected, vocab] fp32 of the rows ``logits_indices`` selects (all rows when None), so
    decode and chunked prefill skip the vocabulary-wide GEMM for rows nobody samples. The GEMM is a
    linear's, compiled by ``_linear``: a quantized lm_head (``quant`` attr, recipe
    ``quantization.lm_head``) runs the same W4A16/W8A16/W8A8 kernels or torch references as the linears."""
    quant = attrs.get("quant")
    linear = _linear(w, {"quant": quant, "lm_head": True} if quant else {}, ex)
    num_rows = (w["weight"] if "weight" in w else w["qweight"]).shape[0]  # vocab (this rank's share)
    scale = attrs.get("scale")  # logits * scale (Cohere's logit_scale, Granite's 1 / logits_scaling)
    softcap = attrs.get("softcap")  # then softcap * tanh(logits / softcap) (Gemma 2's final_logit_softcapping)

    def kernel(xs, step):
        x = xs[0]  # [num_tokens, hidden]
        if step.inp.logits_indices is not None:
            x = x.index_select(0, step.inp.logits_indices)
        if x.shape[0] == 0:  # a tensor-parallel worker asks for none: no GEMM launch over zero rows
            return (x.new_empty(0, num_rows, dtype=torch.float32),)
        logits = linear([x], step)[0]
        if scale is not None:
            logits = logits * scale
        if softcap:  # in the model's dtype, as the model computes it
            logits = ops.softcap(logits, softcap)
        return (logits.float(),)

    return kernel


# --- tensor parallelism: collectives over the default process group (runtime/tensor_parallel.py) ------
def _group_size(tp_size: int) -> None:
    """A sharded graph runs only in a process group of its tp_size (else its partial sums stay partial)."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world != tp_size:
        raise GraphFormatError(f"this graph is sharded for tp_size {tp_size} but runs in a process group of {world} "
                               f"rank(s); load the artifact with Engine.load, which starts its ranks")


def _all_reduce(w, attrs, ex) -> Kernel:
    bias, tp_size = w.get("bias"), attrs["tp_size"]
    if tp_size == 1:
        return lambda xs, step: (xs[0] if bias is None else xs[0] + bias,)
    import torch.distributed as dist

    _group_size(tp_size)
    upcast = dist.get_backend() == "gloo"  # CPU: sum 16-bit partials in fp32 (gloo's 16-bit sums are slow)
    reduce = all_reduce_for(ex.device, torch.float32 if upcast else ex.dtype)

    def kernel(xs, step):
        x = xs[0]  # [num_tokens, features]: this rank's partial sum (the row-parallel linear's fresh output)
        y = reduce(x.float() if upcast and x.dtype != torch.float32 else x).to(x.dtype)
        return (y if bias is None else y + bias,)

    return kernel


def _all_gather(w, attrs, ex) -> Kernel:
    tp_size = attrs["tp_size"]
    if tp_size == 1:
        return lambda xs, step: (xs[0],)
    import torch.distributed as dist

    _group_size(tp_size)

    def kernel(xs, step):
        x = xs[0].contiguous()  # [num_rows, features / tp_size]
        parts = [torch.empty_like(x) for _ in range(tp_size)]
        dist.all_gather(parts, x)
        return (torch.cat(parts, dim=-1),)

    return kernel


def _vocab_parallel_embedding(table: torch.Tensor, scale: torch.Tensor | None = None) -> Kernel:
    """This rank's rows of the table ([vocab / tp_size, hidden]); ids of other ranks' rows give zeros, and
    the all_reduce after the node sums the ranks' lookups."""
    import torch.distributed as dist

    rows = table.shape[0]
    start = rows * (dist.get_rank() if dist.is_available() and dist.is_initialized() else 0)

    def kernel(xs, step):
        ids = xs[0] - start
        outside = (ids < 0) | (ids >= rows)
        return (ops.embedding(ids.clamp(0, rows - 1), table, scale).masked_fill(outside[:, None], 0),)

    return kernel


_COMPILERS: dict[str, Callable[..., Kernel]] = {
    "embedding": _embedding,
    "rms_norm": _rms_norm,
    "layer_norm": _layer_norm,
    "fused_add_rms_norm": _fused_add_rms_norm,
    "linear": _linear,
    "rope": _rope,
    "position_scale": _position_scale,
    "xielu": _xielu,
    "attention": _attention,
    "activation": _activation,
    "silu_mul": _silu_mul,
    "elementwise": _elementwise,
    "moe": _moe,
    "lm_head": _lm_head,
    "all_reduce": _all_reduce,
    "all_gather": _all_gather,
}
