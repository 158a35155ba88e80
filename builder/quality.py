"""Quality gates over graphs: the quantized graph against its unquantized baseline, same text, same run.

``builder build`` calls ``run_gates`` after quantizing; ``builder gate ARTIFACT --baseline ...`` calls
``gate_artifact``. The metrics themselves live in ``builder/gates.py``.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from builder.calibration import BUNDLED_MODEL, DEFAULT_EVAL, read_texts, resolve_text, token_stream
from builder.gates import (DEFAULT_THRESHOLDS, GateError, GateReport, GateThresholds, MetricResult, compare,
                           make_eval_set, text_needle, thresholds_for)
from builder.recipe import GatesSection, gates_section
from passes.ir import Graph, Node
from runtime.executor import Executor, SeqSlice, StepInput, fp8_cublas_min_rows, sequence_positions
from runtime.kv_cache import SequenceKV
from runtime.tokenizer import Tokenizer

log = logging.getLogger("builder.gates")


class GraphModel:
    """Logits and greedy generation of a graph, through the runtime's executor (compiled once): on the CPU with the
    reference ops, or on a GPU (``device``) with the runtime's kernels and ``fp8_accumulation`` (the arithmetic the
    artifact runs there; the logits come back to the host)."""

    def __init__(self, graph: Graph, device: str | torch.device = "cpu", fp8_accumulation: str | None = None) -> None:
        self.device = torch.device(device)
        params = graph.params if self.device.type == "cpu" else {k: v.to(self.device) for k, v in graph.params.items()}
        self.executor = Executor(graph.to_dict(), params, use_kernels=self.device.type == "cuda",
                                 fp8_accumulation=fp8_accumulation, fp8_env=False)
        self.layout = self.executor.kv_layout()

    def _ids(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, device=self.device)

    def logits(self, ids: list[int]) -> torch.Tensor:
        kv = SequenceKV(self.layout, len(ids), self.device)
        positions = sequence_positions(self.executor.long_rope_from, 0, len(ids), len(ids), self.device)
        return self.executor.forward(StepInput(self._ids(ids), positions, [SeqSlice(kv, 0, len(ids))])).cpu()

    def _prefill(self, ids: list[int], total: int) -> tuple[SequenceKV, torch.Tensor]:
        kv = SequenceKV(self.layout, total, self.device)
        positions = sequence_positions(self.executor.long_rope_from, 0, len(ids), len(ids), self.device)
        return kv, self.executor.forward(StepInput(self._ids(ids), positions, [SeqSlice(kv, 0, len(ids))],
                                                   self._ids([len(ids) - 1])))

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        switch = self.executor.long_rope_from
        kv, logits = self._prefill(prompt, len(prompt) + n)
        out, pos = [], len(prompt)
        short = switch is not None and len(prompt) <= switch  # on LongRoPE's first table so far
        for _ in range(n):
            token = int(logits[-1].argmax())
            out.append(token)
            if short and pos + 1 > switch:
                # past LongRoPE's switch: every position again on its second table, as Hugging Face recomputes
                short = False
                kv, logits = self._prefill(prompt + out, len(prompt) + n)
            else:
                positions = sequence_positions(switch, pos, 1, pos + 1, self.device)
                logits = self.executor.forward(StepInput(self._ids([token]), positions, [SeqSlice(kv, pos, 1)]))
            pos += 1
        return out


def graph_digest(graph: Graph) -> str:
    """Content hash of a graph: its IR and every weight's bytes."""
    h = hashlib.sha256(graph.to_json().encode())
    for name in sorted(graph.params):
        t = graph.params[name].detach().contiguous().cpu()
        h.update(name.encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def cache_dir() -> Path:
    return Path(os.environ.get("LLM_BUILDER_CACHE", Path.home() / ".cache" / "llm-builder")) / "baselines"


class CachedModel:
    """A baseline's logits and greedy outputs, memoised on disk by the graph's content hash, so a
    second gated build of the same checkpoint (same dtype, same eval text) recomputes nothing."""

    def __init__(self, model: GraphModel, digest: str) -> None:
        self.model = model
        self.file = cache_dir() / f"{digest}.safetensors"
        self.entries: dict[str, torch.Tensor] = {}
        self.hits = self.misses = 0
        if self.file.is_file():
            try:
                self.entries = load_file(self.file)
            except (SafetensorError, OSError) as e:  # a damaged cache is recomputed, never trusted
                log.warning("ignoring unreadable baseline cache %s (%s)", self.file, e)

    def _key(self, kind: str, ids: list[int], n: int = 0) -> str:
        return hashlib.sha256(f"{kind}:{n}:{','.join(map(str, ids))}".encode()).hexdigest()

    def logits(self, ids: list[int]) -> torch.Tensor:
        return self._get(self._key("logits", ids), lambda: self.model.logits(ids))

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        out = self._get(self._key("greedy", prompt, n), lambda: torch.tensor(self.model.greedy(prompt, n)))
        return out.tolist()

    def _get(self, key: str, compute) -> torch.Tensor:
        if key in self.entries:
            self.hits += 1
            return self.entries[key]
        self.misses += 1
        value = compute().contiguous()
        self.entries[key] = value
        return value

    def save(self) -> None:
        if self.misses:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.file.with_suffix(".tmp")
            save_file(self.entries, tmp)
            tmp.replace(self.file)


def thresholds(algo: str, section: GatesSection) -> GateThresholds:
    overrides: dict[str, Any] = {k: getattr(section, k) for k in
                                 ("max_kl", "min_top1_agreement", "max_ppl_ratio", "min_greedy_agreement",
                                  "max_kl_vs_rtn") if getattr(section, k) is not None}
    overrides["min_greedy_match_tokens"] = section.greedy_tokens
    overrides["needle"] = bool(section.needle_context_len)
    if algo not in DEFAULT_THRESHOLDS:  # an unquantized artifact: the generic defaults
        return replace(GateThresholds(), **overrides)
    return thresholds_for(algo, **overrides)


def fast_accumulation_scoring(fp8_accumulation: str | None, window: int,
                              device: torch.device | None = None) -> tuple[str, MetricResult | None]:
    """Where the gates score a candidate whose FP8 GEMMs accumulate ``fp8_accumulation`` (the artifact's setting; the
    process's RUNTIME_FP8_FAST_ACCUM does not apply to the gates), and the report's row that says so. Fast
    accumulation exists only in cuBLAS's FP8 GEMMs on a GPU, so a fast candidate is scored there, through the
    runtime's kernels (their roundings included: the arithmetic the artifact runs), when ``device`` (the build's
    calibration device; None: any) is such a GPU (compute capability 8.9+) and the gate windows are long enough to
    reach cuBLAS; otherwise on the CPU's reference arithmetic, with a row saying the accumulation was not judged."""
    if fp8_accumulation != "fast":
        return "cpu", None

    def not_judged(why: str) -> tuple[str, MetricResult]:
        return "cpu", MetricResult("fp8_accumulation", 0.0, 0.0, True, "<=", f"not judged: {why}, so the gates "
                                   f"scored the promoted reference arithmetic (measure it on a GPU: python -m "
                                   f"builder.devtools.check_kernels ARTIFACT --fast-accum)", status="n/a")

    rows = fp8_cublas_min_rows()
    if window < rows:
        return not_judged(f"gate windows of {window} tokens run no FP8 GEMM on cuBLAS (it takes {rows} rows or more; "
                          f"set gates.window to at least {rows})")
    if device is not None and device.type != "cuda":
        return not_judged(f"the build ran on {device} (calibration.device)")
    if not torch.cuda.is_available():
        return not_judged("fast FP8 accumulation runs on a GPU and this machine has none")
    gpu = device if device is not None else torch.device("cuda")
    if torch.cuda.get_device_capability(gpu) < (8, 9):
        return not_judged(f"{torch.cuda.get_device_name(gpu)} has no FP8 GEMM (compute capability 8.9 or later)")
    return str(gpu), MetricResult("fp8_accumulation", 0.0, 0.0, True, "<=", "fast: the candidate was scored on the "
                                  "GPU through the runtime's kernels (their roundings included), the arithmetic the "
                                  "artifact runs; the baseline and round-to-nearest on the CPU reference",
                                  status="info")


def compare_graphs(algo: str, section: GatesSection, baseline: Graph, candidate: Graph,
                   tokenizer: Tokenizer, checkpoint: str | Path, rtn_check: bool = False,
                   eval_key: str = "gates.eval_dataset", fp8_accumulation: str | None = None,
                   device: torch.device | None = None) -> GateReport:
    """Gate ``candidate`` against ``baseline`` on the section's held-out text (``checkpoint``: the source model,
    which decides whether the shipped text may stand in for an unset ``eval_dataset``). ``rtn_check``: also
    against round-to-nearest of the same scheme (:func:`rtn_counterpart`), when the method's thresholds ask for it.
    ``fp8_accumulation``: the artifact's ``runtime.fp8_accumulation``; ``device``: where the build ran
    (:func:`fast_accumulation_scoring`)."""
    path, warning = resolve_text(section.eval_dataset, DEFAULT_EVAL, checkpoint, eval_key)
    if warning:
        log.warning("%s", warning)
    encode = lambda t: tokenizer.encode(t, add_special_tokens=False)  # noqa: E731
    stream, _ = token_stream(path, encode)
    eval_set = make_eval_set(stream, section.window, section.num_positions)
    needle = None
    if section.needle_context_len:
        filler = "".join(read_texts(path)[0])[:20000]
        needle = text_needle(encode, filler, section.needle_context_len)
    where, accumulation = fast_accumulation_scoring(fp8_accumulation, section.window, device)
    base = CachedModel(GraphModel(baseline), graph_digest(baseline))
    cand = GraphModel(candidate, where, fp8_accumulation)
    limits = thresholds(algo, section)
    rtn, why = (rtn_counterpart(baseline, candidate) if rtn_check and limits.max_kl_vs_rtn is not None
                else (None, ""))
    # the rounding depends on the baseline and the scheme alone: its logits are cached like the baseline's (on the
    # CPU reference: a candidate scored on the GPU is judged against reference rounding, its arithmetic included)
    rtn_model = CachedModel(GraphModel(rtn), graph_digest(rtn)) if rtn is not None else None
    report = compare(base.logits, cand.logits, eval_set, limits, base.greedy, cand.greedy, needle,
                     rtn_model.logits if rtn_model is not None else None)
    if why:  # asked for, not computable: say so
        why = f"not applicable: no round-to-nearest counterpart of this build ({why})"
        log.warning("quality gates: kl_vs_rtn %s", why)
        report.metrics.append(MetricResult("kl_vs_rtn", 0.0, limits.max_kl_vs_rtn, True, "<=", why, status="n/a"))
    if accumulation is not None:
        if accumulation.status == "n/a":
            log.warning("quality gates: fp8_accumulation %s", accumulation.detail)
        report.metrics.append(accumulation)
    if rtn_model is not None:
        rtn_model.save()
    base.save()
    report.baseline_cache = {"file": str(base.file), "hits": base.hits, "misses": base.misses}
    report.eval_data = {"path": str(path), **({"warning": warning} if warning else {})}
    log.info("quality gates (%s) on %s (baseline cache: %d hits, %d computed):\n%s", algo, path,
             base.hits, base.misses, report.table())
    return report


# schemes whose round-to-nearest counterpart the gates build from the baseline (plain rounding of the same rule)
RTN_SCHEMES = ("w4a16", "w8a16", "fp8", "w8a8_int8")


def _round_to_nearest(w: torch.Tensor, quant: dict[str, Any], candidate: Graph, node: Node) -> \
        tuple[str, dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]] | str:
    """The float rows ``w`` [out, in] of one candidate linear, rounded by its scheme's plain rule: (scheme,
    tensors by output row, tensors shared by all rows, quant attrs), or why there is no such rounding."""
    from kernels.torch_quant import quantize_weight_fp8, quantize_weight_int8
    from passes.int8_wo import PER_CHANNEL_INT8, int8_channels
    from passes.quant_math import QuantConfig, quantize_groups

    scheme = quant["scheme"]
    if scheme == "w8a16" and quant.get("scale_divisors"):  # int8_wo's rule, as the build recorded it
        divisors = tuple(float(d) for d in quant["scale_divisors"])
        codes, scales, zeros = int8_channels(w, divisors)
        return scheme, {"qweight": codes, "scales": scales, "zeros": zeros}, {}, {
            "bits": 8, "group_size": -1, "scale_divisors": list(divisors)}
    if scheme in ("w4a16", "w8a16"):
        # int8_wo records no symmetry: its one rule is symmetric per channel; every other writer records it
        symmetric = quant.get("symmetric", scheme == "w8a16" and PER_CHANNEL_INT8.symmetric)
        cfg = QuantConfig(bits=int(quant["bits"]), group_size=int(quant["group_size"]), symmetric=bool(symmetric))
        codes, scales, zeros = quantize_groups(w, cfg)
        acts = {"activation_quant": "fp8"} if quant.get("activation_quant") == "fp8" else {}  # W4A8: the same inputs
        return scheme, {"qweight": codes, "scales": scales, "zeros": zeros}, {}, {
            "bits": cfg.bits, "group_size": cfg.group_size, "symmetric": cfg.symmetric, **acts}
    if scheme == "fp8":
        per_channel = quant.get("weight_granularity", "tensor") == "channel"
        q, scale = quantize_weight_fp8(w, per_channel)
        rows, shared = ({"qweight": q, "weight_scale": scale}, {}) if per_channel else ({"qweight": q},
                                                                                         {"weight_scale": scale})
        if quant.get("activations") == "static":  # calibrated: the gate has no calibration text, the build's own
            shared["input_scale"] = candidate.params[node.weights["input_scale"]]
        return scheme, rows, shared, {"activations": quant.get("activations", "dynamic"),
                                      "weight_granularity": "channel" if per_channel else "tensor"}
    if scheme == "w8a8_int8":
        if quant.get("activations") == "static":
            return ("static W8A8 INT8: its input scales are calibrated on smoothed activations, and the gate has no "
                    "calibration text to calibrate unsmoothed ones")
        q, scale = quantize_weight_int8(w)  # no smoothing: naive W8A8
        return scheme, {"qweight": q, "weight_scale": scale}, {}, {"activations": "dynamic", "smoothed": False}
    return f"scheme {scheme} has no round-to-nearest counterpart (only {'/'.join(RTN_SCHEMES)})"


def rtn_counterpart(baseline: Graph, candidate: Graph) -> tuple[Graph | None, str]:
    """The baseline with every linear (and lm_head) the candidate quantizes rounded to nearest instead, by the
    same scheme's plain rule: the same bits, group size and symmetry (W4A16, W8A16; W4A8's fp8 inputs), the same
    granularity and activations (FP8; static input scales are the build's), per-channel INT8 without smoothing
    (SmoothQuant's W8A8 INT8, dynamic only). A calibrated method must beat it; a scheme that only rounds must match
    it. Returns (graph, "") or (None, why not).

    NOTE: the candidate is matched by member (q_proj, k_proj, ...), so either graph may hold merged linears. The
    rounding covers a candidate linear's rows together (a per-tensor FP8 scale spans a merged q/k/v), then each
    baseline linear takes its members' rows of it."""
    from passes.quant_math import pack_int4
    from passes.quantize import member_outputs, replace_weight

    targets = [n for n in candidate.nodes if n.attrs.get("quant")]
    if not targets:
        return None, "the build quantizes no linear"
    where = {(n.op, name): (i, lo, hi) for i, n in enumerate(baseline.nodes)
             if n.op in ("linear", "lm_head") and "weight" in n.weights for name, lo, hi in member_outputs(n)}
    graph = baseline.copy()
    done: set[int] = set()
    for cand in (n for n in targets if n.op == "moe"):  # FP8 or W4A16 experts rounded to nearest
        why = _rtn_experts(graph, cand)
        if why:
            return None, why
    for cand in (n for n in targets if n.op != "moe"):
        members = member_outputs(cand)
        if any((cand.op, name) not in where for name, _, _ in members):
            return None, f"the baseline holds no float linear for every member of {cand.source}"
        parts = [where[(cand.op, name)] for name, _, _ in members]  # (baseline node, rows) per member
        blocks = [baseline.params[baseline.nodes[i].weights["weight"]][lo:hi].float() for i, lo, hi in parts]
        rounded = _round_to_nearest(torch.cat(blocks), cand.attrs["quant"], candidate, cand)
        if isinstance(rounded, str):
            return None, rounded
        scheme, rows, shared, attrs = rounded
        offsets = torch.cumsum(torch.tensor([0] + [b.shape[0] for b in blocks]), 0).tolist()
        for i in dict.fromkeys(i for i, _, _ in parts):
            node = graph.nodes[i]
            mine = [k for k, (j, _, _) in enumerate(parts) if j == i]
            # the baseline linear's own members, in its row order, all inside this candidate linear
            if len(mine) != len(member_outputs(node)) or i in done:
                return None, f"{node.source} is merged differently in the baseline and the build"
            mine.sort(key=lambda k: parts[k][1])
            index = torch.cat([torch.arange(offsets[k], offsets[k + 1]) for k in mine])
            tensors = {role: t[index] for role, t in rows.items()}
            if scheme == "w4a16":
                tensors["qweight"] = pack_int4(tensors["qweight"])
            replace_weight(graph, node, scheme, {**tensors, **shared}, attrs)
            done.add(i)
    return graph, ""


def _rtn_experts(graph: Graph, cand: Node) -> str:
    """The baseline moe node at ``cand``'s source given the candidate's experts by round to nearest (in place on
    ``graph``, a copy of the baseline): FP8 (the fp8 pass's own rule), or W4A16 with the candidate's group size and
    symmetry (what awq / gptq give an expert no calibration token reached); "" or why it cannot be."""
    from passes.fp8 import quantize_moe_fp8
    from passes.moe_int4 import rtn_experts
    from passes.quant_math import QuantConfig

    node = next((n for n in graph.nodes if n.op == "moe" and n.source == cand.source and "quant" not in n.attrs), None)
    if node is None:
        return f"the baseline holds no float moe layer at {cand.source}"
    quant = cand.attrs["quant"]
    if quant.get("scheme") == "fp8":
        quantize_moe_fp8(graph, node)  # the copy's params only: the baseline keeps its float experts
    elif quant.get("scheme") == "w4a16":
        rtn_experts(graph, node, QuantConfig(4, int(quant["group_size"]), bool(quant.get("symmetric", False))))
    else:
        return f"moe scheme {quant.get('scheme')} has no round-to-nearest counterpart (fp8 and w4a16 have)"
    return ""


def rtn_graph(baseline: Graph, candidate: Graph) -> Graph | None:
    """:func:`rtn_counterpart`'s graph, None where it has none."""
    return rtn_counterpart(baseline, candidate)[0]


def gate_method(algo: str, kv_cache_dtype: str) -> str:
    """Which default thresholds apply: the weight method's, else the KV cache's."""
    if algo != "none":
        return algo.split("+")[0]
    return f"kv_{kv_cache_dtype}" if kv_cache_dtype in ("fp8", "int8") else "none"


def rtn_applies(algo: str, kv_cache_dtype: str) -> bool:
    """The round-to-nearest comparison: one weight method (calibrated: GPTQ, AWQ, SmoothQuant; or rounding alone:
    INT8 weight-only, FP8) and nothing else quantized (a mixed recipe or a quantized KV cache has no single
    rounding counterpart)."""
    return algo in ("gptq", "awq", "smoothquant", "int8_wo", "fp8") and kv_cache_dtype == "auto"


def run_gates(recipe, baseline: Graph, candidate: Graph, tokenizer: Tokenizer,
              device: torch.device | None = None) -> GateReport:
    """The build's gates (``device``: where its quantization passes ran)."""
    method = gate_method(recipe.quant_algo(), recipe.runtime.kv_cache_dtype)
    return compare_graphs(method, recipe.gates, baseline, candidate, tokenizer, recipe.model.checkpoint,
                          rtn_applies(recipe.quant_algo(), recipe.runtime.kv_cache_dtype),
                          fp8_accumulation=recipe.runtime.fp8_accumulation, device=device)


def load_graph(path: Path, dtype: str | None = None) -> tuple[Graph, dict | None]:
    """A graph from an artifact directory (and its manifest) or from an HF checkpoint (traced)."""
    from runtime.artifact import MANIFEST, open_artifact

    if (path / MANIFEST).is_file():
        art = open_artifact(path)
        return Graph.from_dict(art.graph, art.load_weights()), art.manifest
    from builder.checkpoint import attach_weights, open_checkpoint
    from passes.trace import trace

    ckpt = open_checkpoint(path)
    graph, meta_model = trace(ckpt.hf_config())
    attach_weights(graph, ckpt, meta_model, getattr(torch, dtype or "float32"))
    return graph, None


# files of a checkpoint that define the model (a baseline's tokenizer files may be copies in another format)
def _model_files(files: dict[str, str]) -> dict[str, str]:
    return {name: digest for name, digest in files.items()
            if name == "config.json" or name.endswith((".safetensors", ".safetensors.index.json"))}


def is_bundled_source(manifest: dict) -> bool:
    """Whether the artifact was built from the bundled model: its config and weight files hash as the bundled
    model's do."""
    from builder.checkpoint import open_checkpoint

    want = _model_files(manifest.get("source", {}).get("files", {}))
    return bool(want) and want == _model_files(open_checkpoint(BUNDLED_MODEL).file_hashes())


def check_baseline_source(manifest: dict, baseline: Path) -> None:
    """The baseline is the model the artifact was built from: its config and weight files hash as the
    manifest's ``source.files`` record (a checkpoint), or its own manifest records the same source (an
    artifact). Raises GateError naming the first difference."""
    from builder.checkpoint import open_checkpoint
    from runtime.artifact import MANIFEST, open_artifact

    want = _model_files(manifest.get("source", {}).get("files", {}))
    if not want:
        raise GateError("the artifact's manifest records no source files to check the baseline against; pass "
                        "--any-baseline to gate it against the given baseline anyway")
    if (baseline / MANIFEST).is_file():
        other = open_artifact(baseline).manifest
        oq = other.get("quantization", {})
        if oq.get("algo", "none") != "none" or oq.get("kv_cache_dtype", "auto") != "auto":
            raise GateError(f"baseline artifact {baseline} is itself quantized ({oq.get('algo')}, KV cache "
                            f"{oq.get('kv_cache_dtype')}); gate against the unquantized checkpoint or artifact")
        have, kind = _model_files(other.get("source", {}).get("files", {})), "artifact"
    else:
        have, kind = _model_files(open_checkpoint(baseline).file_hashes()), "checkpoint"
    for name in sorted(set(want) | set(have)):
        if want.get(name) != have.get(name):
            what = ("is missing" if name not in have else "was not part of the artifact's source" if name not in want
                    else f"differs (sha256 {have[name][:12]}..., the artifact's source {want[name][:12]}...)")
            raise GateError(f"baseline {kind} {baseline} is not the model the artifact was built from "
                            f"({manifest.get('source', {}).get('checkpoint', '?')}): {name} {what}. Pass that "
                            "checkpoint, or --any-baseline to gate against another model on purpose")


# the method whose default thresholds gate a pre-quantized artifact, by the scheme it imported
PREQUANTIZED_METHOD = {"w4a16": "gptq", "w8a16": "int8_wo", "fp8": "fp8", "fp8_block": "fp8",
                       "w8a8_int8": "smoothquant"}


def prequantized_method(imported: dict) -> str:
    """The thresholds of a pre-quantized artifact: its format's method (gptq, awq; ModelOpt's W4A16_AWQ is awq), else
    its scheme's."""
    if imported.get("source") in ("gptq", "awq"):
        return imported["source"]
    if imported.get("quant_algo") == "W4A16_AWQ":
        return "awq"
    return PREQUANTIZED_METHOD.get(imported.get("scheme", ""), "none")


def check_unquantized_baseline(baseline: Path) -> None:
    """A pre-quantized artifact is gated against a floating-point model of the same shape (another checkpoint
    than its source, so no hashes are compared): not against a quantized checkpoint or artifact."""
    from builder.checkpoint import open_checkpoint
    from runtime.artifact import MANIFEST, open_artifact

    if (baseline / MANIFEST).is_file():
        q = open_artifact(baseline).manifest.get("quantization", {})
        quantized = q.get("algo", "none") != "none"
    else:
        quantized = open_checkpoint(baseline).quant is not None
    if quantized:
        raise GateError(f"baseline {baseline} is itself quantized; gate a pre-quantized artifact against the "
                        f"unquantized (bf16/fp16/fp32) checkpoint it was quantized from")


def gate_artifact(artifact: Path, baseline: Path, section: GatesSection | None = None,
                  any_baseline: bool = False) -> GateReport:
    """Gate a built artifact against a baseline checkpoint or artifact of the same model (checked, unless
    ``any_baseline``, against the manifest's source hashes). An artifact built from a pre-quantized checkpoint is
    gated against an unquantized checkpoint of the model (any, with its format's or scheme's thresholds)."""
    from runtime.artifact import open_artifact

    art = open_artifact(artifact)
    manifest = art.manifest
    imported = manifest.get("quantization", {}).get("prequantized")
    if imported is not None:  # built from a quantized checkpoint: the baseline is another, unquantized one
        check_unquantized_baseline(baseline)
    elif not any_baseline:
        check_baseline_source(manifest, baseline)
    if imported is not None:
        algo = prequantized_method(imported)
    else:
        algo = gate_method(manifest.get("quantization", {}).get("algo", "none"),
                           manifest["runtime"].get("kv_cache_dtype", "auto"))
    if section is None:
        section = gates_section(manifest["recipe"].get("gates"), f"{artifact}/manifest.json")
    candidate, _ = load_graph(artifact)
    base, _ = load_graph(baseline, manifest["model"]["dtype"])
    tokenizer = art.load_tokenizer()
    q = manifest.get("quantization", {})
    rtn = rtn_applies(q.get("algo", "none"), q.get("kv_cache_dtype", manifest["runtime"].get("kv_cache_dtype", "auto")))
    # the bundled model by content (the recorded path may be relative to another directory or clone)
    source = BUNDLED_MODEL if is_bundled_source(manifest) else manifest["source"]["checkpoint"]
    return compare_graphs(algo, section, base, candidate, tokenizer, source, rtn,
                          eval_key="gates.eval_dataset (builder gate: --eval-dataset)",
                          fp8_accumulation=manifest["runtime"].get("fp8_accumulation"))
