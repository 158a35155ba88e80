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
from builder.recipe import GatesSection
from passes.ir import Graph
from runtime.executor import Executor, SeqSlice, StepInput
from runtime.kv_cache import SequenceKV
from runtime.tokenizer import Tokenizer

log = logging.getLogger("builder.gates")


class GraphModel:
    """Logits and greedy generation of a graph, through the runtime's executor (compiled once)."""

    def __init__(self, graph: Graph) -> None:
        self.executor = Executor(graph.to_dict(), graph.params)
        self.layout = self.executor.kv_layout()

    def logits(self, ids: list[int]) -> torch.Tensor:
        kv = SequenceKV(self.layout, len(ids))
        return self.executor.forward(StepInput(torch.tensor(ids), torch.arange(len(ids)), [SeqSlice(kv, 0, len(ids))]))

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        kv = SequenceKV(self.layout, len(prompt) + n)
        last = torch.tensor([len(prompt) - 1])
        logits = self.executor.forward(StepInput(torch.tensor(prompt), torch.arange(len(prompt)),
                                                 [SeqSlice(kv, 0, len(prompt))], last))
        out, pos = [], len(prompt)
        for _ in range(n):
            token = int(logits[-1].argmax())
            out.append(token)
            logits = self.executor.forward(StepInput(torch.tensor([token]), torch.tensor([pos]),
                                                     [SeqSlice(kv, pos, 1)]))
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


def compare_graphs(algo: str, section: GatesSection, baseline: Graph, candidate: Graph,
                   tokenizer: Tokenizer, checkpoint: str | Path, rtn_check: bool = False,
                   eval_key: str = "gates.eval_dataset") -> GateReport:
    """Gate ``candidate`` against ``baseline`` on the section's held-out text (``checkpoint``: the source model,
    which decides whether the shipped text may stand in for an unset ``eval_dataset``). ``rtn_check``: also
    against round-to-nearest of the same scheme (:func:`rtn_graph`), when the method's thresholds ask for it."""
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
    base, cand = CachedModel(GraphModel(baseline), graph_digest(baseline)), GraphModel(candidate)
    limits = thresholds(algo, section)
    rtn = rtn_graph(baseline, candidate) if rtn_check and limits.max_kl_vs_rtn is not None else None
    report = compare(base.logits, cand.logits, eval_set, limits, base.greedy, cand.greedy, needle,
                     GraphModel(rtn).logits if rtn is not None else None)
    if rtn_check and limits.max_kl_vs_rtn is not None and rtn is None:  # asked for, not computable: say so
        why = ("not applicable: no round-to-nearest counterpart of this build (a scheme other than "
               f"{'/'.join(RTN_SCHEMES)}, or linears the baseline does not hold)")
        log.warning("quality gates: kl_vs_rtn %s", why)
        report.metrics.append(MetricResult("kl_vs_rtn", 0.0, limits.max_kl_vs_rtn, True, "<=", why, status="n/a"))
    base.save()
    report.baseline_cache = {"file": str(base.file), "hits": base.hits, "misses": base.misses}
    report.eval_data = {"path": str(path), **({"warning": warning} if warning else {})}
    log.info("quality gates (%s) on %s (baseline cache: %d hits, %d computed):\n%s", algo, path,
             base.hits, base.misses, report.table())
    return report


RTN_SCHEMES = ("w4a16", "w8a16")  # weight-only schemes whose round-to-nearest counterpart the gates build


def rtn_graph(baseline: Graph, candidate: Graph) -> Graph | None:
    """The baseline with every linear (and lm_head) the candidate stores weight-only rounded to nearest instead,
    with the candidate's bits, group size and symmetry: what the method must beat. None when the candidate
    holds another scheme (W8A8, FP8: no one round-to-nearest counterpart)."""
    from passes.quant_math import QuantConfig, pack_int4, quantize_groups
    from passes.quantize import member_outputs, replace_weight

    # by member (q_proj, k_proj, ...): either graph may hold the merged linears (rows are quantized independently)
    quantized = {(n.op, name): n.attrs["quant"] for n in candidate.nodes if n.attrs.get("quant")
                 for name, _, _ in member_outputs(n)}
    if not quantized or any(q["scheme"] not in RTN_SCHEMES for q in quantized.values()):
        return None
    graph = baseline.copy()
    done = 0
    for node in graph.nodes:
        if "weight" not in node.weights or node.op not in ("linear", "lm_head"):
            continue
        members = [quantized.get((node.op, name)) for name, _, _ in member_outputs(node)]
        if any(q is None or q != members[0] for q in members):
            continue
        q = members[0]
        cfg = QuantConfig(bits=int(q["bits"]), group_size=int(q["group_size"]), symmetric=bool(q.get("symmetric")))
        codes, scales, zeros = quantize_groups(graph.params[node.weights["weight"]].float(), cfg)
        replace_weight(graph, node, q["scheme"], {"qweight": pack_int4(codes) if cfg.bits == 4 else codes,
                                                  "scales": scales, "zeros": zeros},
                       {"bits": cfg.bits, "group_size": cfg.group_size, "symmetric": cfg.symmetric})
        done += len(members)
    return graph if done == len(quantized) else None


def gate_method(algo: str, kv_cache_dtype: str) -> str:
    """Which default thresholds apply: the weight method's, else the KV cache's."""
    if algo != "none":
        return algo.split("+")[0]
    return f"kv_{kv_cache_dtype}" if kv_cache_dtype in ("fp8", "int8") else "none"


def rtn_applies(algo: str, kv_cache_dtype: str) -> bool:
    """The round-to-nearest comparison: one calibrated weight-only method (GPTQ, AWQ) and nothing else
    quantized (a mixed recipe or a quantized KV cache has no single rounding counterpart)."""
    return algo in ("gptq", "awq") and kv_cache_dtype == "auto"


def run_gates(recipe, baseline: Graph, candidate: Graph, tokenizer: Tokenizer) -> GateReport:
    method = gate_method(recipe.quant_algo(), recipe.runtime.kv_cache_dtype)
    return compare_graphs(method, recipe.gates, baseline, candidate, tokenizer, recipe.model.checkpoint,
                          rtn_applies(recipe.quant_algo(), recipe.runtime.kv_cache_dtype))


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


def gate_artifact(artifact: Path, baseline: Path, section: GatesSection | None = None,
                  any_baseline: bool = False) -> GateReport:
    """Gate a built artifact against a baseline checkpoint or artifact of the same model (checked, unless
    ``any_baseline``, against the manifest's source hashes)."""
    from runtime.artifact import open_artifact

    art = open_artifact(artifact)
    manifest = art.manifest
    if not any_baseline:
        check_baseline_source(manifest, baseline)
    algo = gate_method(manifest.get("quantization", {}).get("algo", "none"),
                       manifest["runtime"].get("kv_cache_dtype", "auto"))
    if section is None:
        section = GatesSection.model_validate(manifest["recipe"].get("gates", {}))
    candidate, _ = load_graph(artifact)
    base, _ = load_graph(baseline, manifest["model"]["dtype"])
    tokenizer = art.load_tokenizer()
    q = manifest.get("quantization", {})
    rtn = rtn_applies(q.get("algo", "none"), q.get("kv_cache_dtype", manifest["runtime"].get("kv_cache_dtype", "auto")))
    # the bundled model by content (the recorded path may be relative to another directory or clone)
    source = BUNDLED_MODEL if is_bundled_source(manifest) else manifest["source"]["checkpoint"]
    return compare_graphs(algo, section, base, candidate, tokenizer, source, rtn,
                          eval_key="gates.eval_dataset (builder gate: --eval-dataset)")
