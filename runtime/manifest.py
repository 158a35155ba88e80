"""The manifest's schema, checked when an artifact is opened, before any of its values is used.

A matching ``manifest_sha256`` proves only that the manifest was not edited without re-hashing it, so
its values are checked here on their own: against the schema (``SCHEMA``: each key the runtime and
`builder inspect` read, with its type and range), against each other (limits within the model's, every
file the runtime reads listed with its hash), against graph.json (model dims, KV layout, tensor-parallel
section, each quantized node's scheme and weights, the lm_head's scheme as ``quantization.lm_head``
records it) and against the weight files' safetensors headers (every tensor graph.json names, with its
shape and dtype). Each check raises ManifestError naming the key, its value and what is allowed.

Paths in ``SCHEMA`` are dotted keys; ``[]`` stands for every item of a list, e.g.
``model.kv_layers[].head_dim``. A key's parent always has its own row above it, so a child is only
looked at when its parent is present (a parent that may be absent is ``optional``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from kernels.torch_quant import FP8_ACCUMULATIONS

MISSING = object()  # a key the manifest does not have

MODEL_DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8", "int8")
# model dims recorded both in the manifest's ``model`` section and in graph.json's ``meta``
MODEL_DIMS = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "max_position_embeddings")
# The weight roles a linear or lm_head node carries for each storage scheme its ``quant`` attr names ("none": not
# quantized); passes/ir.py QUANT_SCHEMES writes them, kernels/torch_quant.py executes them.
QUANT_WEIGHTS = {
    "none": ("weight",),
    "w4a16": ("qweight", "scales", "zeros"),
    "w8a16": ("qweight", "scales", "zeros"),
    "w8a8_int8": ("qweight", "weight_scale"),
    "fp8": ("qweight", "weight_scale"),
    "fp8_block": ("qweight", "weight_scale"),
}
QUANTIZABLE_OPS = ("linear", "lm_head")
# the roles a quantized linear may carry beside its scheme's (kernels/torch_quant.py): a static activation scale, an
# imported act-order permutation, an exporter's per-input-channel scale (ModelOpt AWQ's pre_quant_scale)
QUANT_OPTIONAL_WEIGHTS = ("bias", "input_scale", "perm", "pre_quant_scale")
# a moe node's quantized experts (passes/ir.py MOE_QUANT_SCHEMES): scheme -> the weight roles it adds
MOE_QUANT_WEIGHTS = {"fp8": ("w_gate_up_scale", "w_down_scale"),
                     "w4a16": ("w_gate_up_scales", "w_gate_up_zeros", "w_down_scales", "w_down_zeros"),
                     "fp8_block": ("w_gate_up_scale", "w_down_scale")}
# the quant attrs a scheme's runtime reads
SCHEME_ATTRS = {"w4a16": ("bits", "group_size"), "w8a16": ("bits", "group_size"), "fp8_block": ("block_size",)}
# rows or columns of one fp8_block weight scale, at most (checkpoints use 128): the one bound on a quant's block_size,
# held by passes/ir.py (block_size_ok), builder/prequantized.py and runtime/executor.py (_block_size)
MAX_SCALE_BLOCK = 65536
# optional quant attrs that change what a linear computes: attr -> (the scheme that may carry it, the values this
# runtime runs); another value, or the attr on another scheme, is refused (kernels/torch_quant.py int8_act_qmin)
SCHEME_OPTIONAL_ATTRS = {"act_qmin": ("w8a8_int8", (-127, -128))}  # kernels/torch_quant.py INT8_ACT_QMINS
# safetensors' dtype names -> graph.json's (torch's)
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


class ManifestError(ValueError):
    """A manifest value of the wrong type or range, or one that disagrees with graph.json or the weights."""


@dataclass(frozen=True)
class Rule:
    """What a value must be: ``test(value)`` holds; ``allowed`` says it in words for the error."""

    test: Callable[[Any], bool]
    allowed: str


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def int_at_least(low: int) -> Rule:
    return Rule(lambda v: _is_int(v) and v >= low, f"an integer >= {low}")


def one_of(*values: str) -> Rule:
    return Rule(lambda v: v in values, "one of " + ", ".join(values))


def optional(rule: Rule) -> Rule:
    return Rule(lambda v: v is MISSING or v is None or rule.test(v), f"{rule.allowed}, null or absent")


POSITIVE = int_at_least(1)
COUNT = int_at_least(0)
NAME = Rule(lambda v: isinstance(v, str) and v.strip() != "", "a non-empty string")
TEXT = Rule(lambda v: isinstance(v, str), "a string")
NUMBER = Rule(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number")
BOOL = Rule(lambda v: isinstance(v, bool), "true or false")
OBJECT = Rule(lambda v: isinstance(v, dict), "a JSON object")
ARRAY = Rule(lambda v: isinstance(v, list), "a JSON array")
POWER_OF_TWO = Rule(lambda v: _is_int(v) and v >= 1 and v & (v - 1) == 0, "a power of two >= 1 (e.g. 16, 32, 64)")
SHA256 = Rule(lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) is not None,
              "64 lowercase hex digits")
FINITE = Rule(lambda v: NUMBER.test(v) and math.isfinite(v), "a finite number")

SCHEMA: list[tuple[str, Rule]] = [
    ("name", NAME),
    ("versions", OBJECT), ("versions.toolchain", TEXT), ("versions.torch", TEXT),
    ("recipe", OBJECT),
    ("source", OBJECT), ("source.checkpoint", TEXT), ("source.config", OBJECT), ("source.files", OBJECT),
    ("model", OBJECT), ("model.architecture", NAME), ("model.model_type", NAME),
    *((f"model.{dim}", POSITIVE) for dim in MODEL_DIMS),
    ("model.kv_layers", ARRAY), ("model.kv_layers[]", OBJECT),
    ("model.kv_layers[].num_kv_heads", POSITIVE), ("model.kv_layers[].head_dim", POSITIVE),
    ("model.dtype", one_of(*MODEL_DTYPES)), ("model.num_parameters", COUNT),
    ("runtime", OBJECT),
    ("runtime.max_batch_size", POSITIVE),
    ("runtime.max_seq_len", int_at_least(2)),
    ("runtime.max_num_tokens", POSITIVE),
    ("runtime.tokens_per_block", POWER_OF_TWO),
    ("runtime.kv_cache_dtype", one_of(*KV_CACHE_DTYPES)),
    ("runtime.fp8_accumulation", optional(one_of(*FP8_ACCUMULATIONS))),  # absent: promoted (an older toolchain)
    ("graph", OBJECT), ("graph.file", NAME), ("graph.ir_version", POSITIVE), ("graph.num_nodes", POSITIVE),
    ("graph.ops", OBJECT),
    ("weights", OBJECT), ("weights.files", ARRAY), ("weights.files[]", NAME),
    ("weights.num_tensors", COUNT), ("weights.bytes", COUNT),
    ("weights.ranks", optional(ARRAY)), ("weights.ranks[]", OBJECT),
    ("weights.ranks[].rank", COUNT), ("weights.ranks[].file", NAME),
    ("tensor_parallel", OBJECT), ("tensor_parallel.tp_size", POSITIVE),
    ("build", OBJECT), ("build.started_at", TEXT), ("build.host", TEXT), ("build.duration_s", FINITE),
    ("build.passes", ARRAY), ("build.passes[]", OBJECT), ("build.passes[].name", NAME),
    ("build.verify", optional(OBJECT)), ("build.verify.max_abs_logit_err", NUMBER), ("build.verify.atol", NUMBER),
    ("build.verify.top1_agreement", NUMBER),
    ("reports", OBJECT), ("reports.markdown", NAME), ("reports.html", NAME),
    ("quantization", OBJECT), ("quantization.algo", NAME), ("quantization.kv_cache_dtype", one_of(*KV_CACHE_DTYPES)),
    ("quantization.lm_head", optional(one_of(*QUANT_WEIGHTS))),  # absent: a toolchain that never quantized it
    ("quantization.gates", optional(OBJECT)), ("quantization.gates.passed", BOOL),
    ("quantization.gates.failed", ARRAY), ("quantization.gates.failed[]", NAME),
    ("quantization.gates.metrics", ARRAY), ("quantization.gates.metrics[]", OBJECT),
    ("quantization.gates.metrics[].name", NAME), ("quantization.gates.metrics[].value", NUMBER),
    ("files", OBJECT),
]


def _values(data: Any, path: str) -> Iterator[tuple[str, Any]]:
    """(concrete key, value) for each value ``path`` names; MISSING for an absent last key. Nothing
    when a parent is absent or not a container (its own row reports that)."""
    found = [("", data)]
    parts = path.split(".")
    for i, part in enumerate(parts):
        key, each = part.removesuffix("[]"), part.endswith("[]")
        last = i == len(parts) - 1
        step = []
        for where, value in found:
            if not isinstance(value, dict) or (key not in value and not last):
                continue
            where = f"{where}.{key}" if where else key
            value = value.get(key, MISSING)
            if not each:
                step.append((where, value))
            elif isinstance(value, list):
                step.extend((f"{where}[{j}]", item) for j, item in enumerate(value))
        found = step
    return iter(found)


def _show(value: Any) -> str:
    return "missing" if value is MISSING else repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."


def _fail(key: str, value: Any, allowed: str) -> ManifestError:
    return ManifestError(f"{key} is {_show(value)}; allowed: {allowed}")


def _is_safe_relative(rel: str) -> bool:
    """A path inside the artifact: relative, posix, no ``..`` or empty parts."""
    p = PurePosixPath(rel)
    return (rel != "" and "\\" not in rel and not p.is_absolute() and p.as_posix() == rel
            and all(part not in ("", ".", "..") for part in p.parts))


def check_manifest(manifest: dict[str, Any], required: dict[str, str]) -> None:
    """The schema, the file table, and the values' agreement with each other. ``required``: files that
    must be listed besides graph.json and the weights (what needs them -> path)."""
    for path, rule in SCHEMA:
        for key, value in _values(manifest, path):
            if not rule.test(value):
                raise _fail(key, value, rule.allowed)
    _check_files(manifest, required)
    _check_weights(manifest)
    model, runtime = manifest["model"], manifest["runtime"]
    if runtime["max_seq_len"] > model["max_position_embeddings"]:
        raise _fail("runtime.max_seq_len", runtime["max_seq_len"],
                    f"at most the model's max_position_embeddings ({model['max_position_embeddings']})")
    if len(model["kv_layers"]) != model["num_layers"]:
        raise ManifestError(f"model.kv_layers has {len(model['kv_layers'])} entries; allowed: one per layer "
                            f"(model.num_layers is {model['num_layers']})")
    if manifest["quantization"]["kv_cache_dtype"] != runtime["kv_cache_dtype"]:
        raise _fail("quantization.kv_cache_dtype", manifest["quantization"]["kv_cache_dtype"],
                    f"the same as runtime.kv_cache_dtype ({runtime['kv_cache_dtype']!r})")
    spec = runtime.get("speculative")
    draft = spec.get("draft_model") if isinstance(spec, dict) else None
    if draft is not None:  # a bundled draft artifact (DRAFT_DIR) or EAGLE head (EAGLE_DIR), every file of it listed
        eagle = spec.get("method") == "eagle"
        if draft != ("eagle" if eagle else "draft"):
            raise _fail("runtime.speculative.draft_model", draft,
                        "'eagle' (the bundled EAGLE head) or null" if eagle else
                        "'draft' (the bundled draft artifact) or null")
        for rel in (("eagle/config.json", "eagle/model.safetensors") if eagle else ("draft/manifest.json",)):
            if rel not in manifest["files"]:
                raise ManifestError(f"files does not list {rel!r} (runtime.speculative.draft_model); every file the "
                                    f"runtime reads must be listed with its sha256")


def _check_files(manifest: dict[str, Any], required: dict[str, str]) -> None:
    files = manifest["files"]
    for rel, info in files.items():
        if not _is_safe_relative(rel):
            raise _fail("files", rel, "paths relative to the artifact directory, without '..' or backslashes")
        if not isinstance(info, dict):
            raise _fail(f"files[{rel!r}]", info, "a JSON object with bytes and sha256")
        for field, rule in (("bytes", COUNT), ("sha256", SHA256)):
            if not rule.test(info.get(field, MISSING)):
                raise _fail(f"files[{rel!r}].{field}", info.get(field, MISSING), rule.allowed)
    needed = {"graph.file": [manifest["graph"]["file"]], "weights.files": manifest["weights"]["files"],
              **{what: [rel] for what, rel in required.items()}}
    for key, names in needed.items():
        for name in names:
            if name not in files:
                raise ManifestError(f"files does not list {name!r} ({key}); every file the runtime reads must be "
                                    f"listed with its sha256")


def _check_weights(manifest: dict[str, Any]) -> None:
    weights, tp_size = manifest["weights"], manifest["tensor_parallel"]["tp_size"]
    names = weights["files"]
    if not names:
        raise _fail("weights.files", names, "at least one weight file")
    if len(set(names)) != len(names):
        raise _fail("weights.files", names, "each file once")
    ranks = weights.get("ranks")
    if tp_size == 1:
        if ranks is not None:
            raise ManifestError(f"weights.ranks has {len(ranks)} entries; allowed: none when "
                                f"tensor_parallel.tp_size is 1")
        return
    if ranks is None or len(ranks) != tp_size:
        raise ManifestError(f"weights.ranks has {0 if ranks is None else len(ranks)} entries; allowed: one per "
                            f"rank (tensor_parallel.tp_size is {tp_size})")
    for i, r in enumerate(ranks):
        if r["rank"] != i:
            raise _fail(f"weights.ranks[{i}].rank", r["rank"], f"{i} (ranks in order)")
    if names != [r["file"] for r in ranks]:
        raise _fail("weights.files", names, f"the ranks' files in rank order ({[r['file'] for r in ranks]})")
    if weights.get("tp_size", tp_size) != tp_size:
        raise _fail("weights.tp_size", weights["tp_size"], f"tensor_parallel.tp_size ({tp_size})")


def check_graph(manifest: dict[str, Any], graph: Any) -> None:
    """graph.json's structure, and its dims, KV layout and tensor-parallel section against the manifest's."""
    if not isinstance(graph, dict):
        raise _fail("graph.json", type(graph).__name__, "a JSON object")
    for key, rule in (("ir_version", POSITIVE), ("meta", OBJECT), ("params", OBJECT), ("nodes", ARRAY)):
        if not rule.test(graph.get(key, MISSING)):
            raise _fail(f"graph.json {key}", graph.get(key, MISSING), rule.allowed)
    for key, recorded in (("ir_version", graph["ir_version"]), ("num_nodes", len(graph["nodes"]))):
        if manifest["graph"][key] != recorded:
            raise _fail(f"graph.{key}", manifest["graph"][key], f"graph.json's {recorded!r}")
    for name, info in graph["params"].items():
        if not (isinstance(info, dict) and isinstance(info.get("shape"), list)
                and all(COUNT.test(d) for d in info["shape"]) and info.get("dtype") in SAFETENSORS_DTYPES.values()):
            raise _fail(f"graph.json params[{name!r}]", info, "{shape: [non-negative ints], dtype: a torch dtype name}")
    if not all(isinstance(n, dict) and isinstance(n.get("attrs", {}), dict) and isinstance(n.get("weights", {}), dict)
               for n in graph["nodes"]):
        raise ManifestError("graph.json nodes must be JSON objects with attrs and weights objects")
    model, meta, tp = manifest["model"], graph["meta"], manifest["tensor_parallel"]
    for key in ("architecture", "model_type", "dtype", *MODEL_DIMS, "kv_layers"):
        if key in meta and meta[key] != model[key]:
            raise _fail(f"model.{key}", model[key], f"graph.json's {meta[key]!r}")
    if tp != meta.get("tensor_parallel", {"tp_size": 1}):
        raise _fail("tensor_parallel", tp, f"graph.json's {meta.get('tensor_parallel', {'tp_size': 1})!r}")
    _check_layers(manifest, graph["nodes"])
    _check_embedding(manifest, graph)
    _check_quantized(manifest, graph["nodes"])


def _check_layers(manifest: dict[str, Any], nodes: list[dict[str, Any]]) -> None:
    """Each attention node against model.kv_layers (per rank: tensor_parallel's head counts)."""
    model, tp, kv_dtype = manifest["model"], manifest["tensor_parallel"], manifest["runtime"]["kv_cache_dtype"]
    attention = [n.get("attrs", {}) for n in nodes if n.get("op") == "attention"]
    if len(attention) != model["num_layers"]:
        raise _fail("model.num_layers", model["num_layers"], f"graph.json's {len(attention)} attention layers")
    for i, (attrs, layer) in enumerate(zip(attention, model["kv_layers"])):
        expected = {"head_dim": layer["head_dim"]}
        if tp["tp_size"] == 1:
            expected.update(num_heads=model["num_attention_heads"], num_kv_heads=layer["num_kv_heads"])
        else:
            expected.update(num_heads=tp.get("num_heads_per_rank"), num_kv_heads=tp.get("num_kv_heads_per_rank"))
        for key, want in expected.items():
            if attrs.get(key) != want:
                source = f"model.kv_layers[{i}].{key}" if key != "num_heads" else "model.num_attention_heads"
                raise ManifestError(f"{source} ({want!r}) disagrees with graph.json's attention layer {i} "
                                    f"({key} {attrs.get(key)!r})")
        if attrs.get("kv_cache_dtype", "auto") != kv_dtype:
            raise _fail("runtime.kv_cache_dtype", kv_dtype,
                        f"graph.json's attention layer {i} KV cache dtype ({attrs.get('kv_cache_dtype', 'auto')!r})")
    if kv_dtype in ("fp8", "int8"):  # a quantized cache: every layer's scales (the kernels read them)
        for i, node in enumerate(n for n in nodes if n.get("op") == "attention"):
            missing = [w for w in ("k_scale", "v_scale") if w not in node.get("weights", {})]
            if missing:
                raise ManifestError(f"graph.json's attention layer {i} has no {' / '.join(missing)} weight; "
                                    f"runtime.kv_cache_dtype {kv_dtype} needs each layer's k_scale and v_scale")


def _check_embedding(manifest: dict[str, Any], graph: dict[str, Any]) -> None:
    """The embedding table's shape is [vocab_size (per rank with vocab_parallel), hidden_size]. A table looked up
    by the positions (learned position embeddings) is not the vocabulary's."""
    model, tp = manifest["model"], manifest["tensor_parallel"]
    for node in graph["nodes"]:
        if (node.get("op") != "embedding" or "weight" not in node.get("weights", {})
                or node.get("inputs") != ["input_ids"]):
            continue
        info = graph["params"].get(node["weights"]["weight"])
        vocab = model["vocab_size"] // tp["tp_size"] if tp.get("vocab_parallel") else model["vocab_size"]
        if info is None or info["shape"] != [vocab, model["hidden_size"]]:
            raise ManifestError(f"model.vocab_size {model['vocab_size']} and model.hidden_size "
                                f"{model['hidden_size']} disagree with the embedding table's shape "
                                f"{None if info is None else info['shape']} in graph.json")


def _check_quantized(manifest: dict[str, Any], nodes: list[dict[str, Any]]) -> None:
    """Each linear / lm_head carries the weight roles of its storage scheme, only those ops are quantized,
    and the lm_head's scheme is the one ``quantization.lm_head`` records, its shape the model's."""
    for node in nodes:
        op, attrs, where = node.get("op"), node.get("attrs", {}), node.get("source") or node.get("op")
        quant = attrs.get("quant")
        if op == "moe":
            _check_moe(node, quant, where)
            continue
        if quant is not None and op not in QUANTIZABLE_OPS:
            raise ManifestError(f"graph.json {op} node {where} has a quant attr; only {' and '.join(QUANTIZABLE_OPS)} "
                                f"and moe nodes are stored quantized")
        if op not in QUANTIZABLE_OPS:
            continue
        scheme = "none" if quant is None else quant.get("scheme") if isinstance(quant, dict) else quant
        if quant is not None and (not isinstance(quant, dict) or scheme not in QUANT_WEIGHTS or scheme == "none"):
            raise ManifestError(f"graph.json {op} {where}: quant scheme {scheme!r} is not one this runtime executes; "
                                f"allowed: {', '.join(s for s in QUANT_WEIGHTS if s != 'none')}")
        missing = [r for r in QUANT_WEIGHTS[scheme] if r not in node.get("weights", {})]
        missing += [a for a in SCHEME_ATTRS.get(scheme, ()) if a not in quant]
        if missing:
            raise ManifestError(f"graph.json {op} {where}: a {scheme} {op} needs {', '.join(missing)}")
        for attr, (owner, values) in SCHEME_OPTIONAL_ATTRS.items():
            value = (quant or {}).get(attr, MISSING)
            if value is not MISSING and (scheme != owner or isinstance(value, bool) or not isinstance(value, int)
                                         or value not in values):
                raise ManifestError(f"graph.json {op} {where}: quant {attr} {_show(value)} on a {scheme} {op} is not "
                                    f"one this runtime runs; allowed: {' or '.join(map(str, values))}, on {owner} "
                                    f"linears only")
        allowed = QUANT_WEIGHTS[scheme] + (("bias",) if scheme == "none" else QUANT_OPTIONAL_WEIGHTS)
        unknown = [r for r in node.get("weights", {}) if r not in allowed]
        if unknown:  # run without it, the node would compute something else than the graph says
            raise ManifestError(f"graph.json {op} {where}: a {scheme} {op} carries weight role(s) "
                                f"{', '.join(unknown)}, which this runtime does not run; allowed: {', '.join(allowed)}")
        if op == "lm_head":
            _check_lm_head(manifest, attrs, scheme)


def _check_moe(node: dict[str, Any], quant: Any, where: str) -> None:
    """A moe node's experts: unquantized (no scale roles), or a scheme of MOE_QUANT_WEIGHTS with its roles."""
    scheme = quant.get("scheme") if isinstance(quant, dict) else quant
    if quant is not None and scheme not in MOE_QUANT_WEIGHTS:
        raise ManifestError(f"graph.json moe {where}: quant scheme {scheme!r} is not one this runtime executes for "
                            f"experts; allowed: {', '.join(MOE_QUANT_WEIGHTS)}")
    need = set(MOE_QUANT_WEIGHTS.get(scheme, ()))
    roles = {r for rs in MOE_QUANT_WEIGHTS.values() for r in rs} & set(node.get("weights", {}))
    if roles != need:
        raise ManifestError(f"graph.json moe {where}: {'a ' + scheme if quant else 'an unquantized'} moe carries the "
                            f"weights {sorted(need) or 'without scales'}; it has {sorted(roles) or 'none'} of them")
    if scheme == "w4a16" and not (quant.get("bits") == 4 and isinstance(quant.get("group_size"), int)):
        raise ManifestError(f"graph.json moe {where}: w4a16 experts need quant bits 4 and an integer group_size; "
                            f"quant is {quant}")
    if scheme == "w4a16" and quant["group_size"] != -1 and (quant["group_size"] < 1 or quant["group_size"] % 32):
        raise ManifestError(f"graph.json moe {where}: w4a16 experts in groups of {quant['group_size']}: the experts "
                            f"kernel takes group sizes that are multiples of 32, or -1 (one group per row)")
    block = quant.get("block_size") if isinstance(quant, dict) else None
    if scheme == "fp8_block" and not (isinstance(block, list) and len(block) == 2
                                      and all(_is_int(b) and b >= 1 for b in block)):
        raise ManifestError(f"graph.json moe {where}: fp8_block experts need quant block_size [rows, columns] of "
                            f"positive integers; quant is {quant}")


def _check_lm_head(manifest: dict[str, Any], attrs: dict[str, Any], scheme: str) -> None:
    recorded = manifest["quantization"].get("lm_head", MISSING)
    if recorded is not MISSING and recorded != scheme:
        raise _fail("quantization.lm_head", recorded, f"graph.json's lm_head scheme ({scheme!r})")
    if scheme == "none":
        return
    if recorded is MISSING:
        raise _fail("quantization.lm_head", recorded, f"graph.json's lm_head scheme ({scheme!r}): the lm_head is "
                                                      f"quantized")
    model, tp = manifest["model"], manifest["tensor_parallel"]
    vocab = model["vocab_size"] // tp["tp_size"] if tp.get("vocab_parallel") else model["vocab_size"]
    shape = (attrs.get("out_features"), attrs.get("in_features"))
    if shape != (vocab, model["hidden_size"]):
        raise ManifestError(f"model.vocab_size {model['vocab_size']} and model.hidden_size {model['hidden_size']} "
                            f"disagree with the quantized lm_head's out_features x in_features {shape[0]} x {shape[1]} "
                            f"in graph.json")


def check_weight_header(file: str, header: dict[str, tuple[str, list[int]]], params: dict[str, Any],
                        complete: bool) -> None:
    """A weight file's tensors (name -> (safetensors dtype, shape)) against graph.json's ``params``;
    ``complete``: the file must hold every one of them (a rank's file), not only some."""
    for name, (dtype, shape) in header.items():
        info = params.get(name)
        if info is None:
            raise ManifestError(f"{file} holds tensor {name!r}, which graph.json does not name")
        if SAFETENSORS_DTYPES.get(dtype) != info["dtype"] or list(shape) != info["shape"]:
            raise ManifestError(f"{file}: tensor {name!r} is {dtype} {list(shape)}; graph.json records "
                                f"{info['dtype']} {info['shape']}")
    if complete and (missing := sorted(set(params) - set(header))):
        raise ManifestError(f"{file} lacks tensors graph.json names: {', '.join(missing[:5])}")
