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

from builder.calibration import DEFAULT_EVAL, token_stream, read_texts
from builder.gates import DEFAULT_THRESHOLDS, GateReport, GateThresholds, compare, make_eval_set, text_needle, thresholds_for
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
                                 ("max_kl", "min_top1_agreement", "max_ppl_ratio", "min_greedy_agreement")
                                 if getattr(section, k) is not None}
    overrides["min_greedy_match_tokens"] = section.greedy_tokens
    overrides["needle"] = bool(section.needle_context_len)
    if algo not in DEFAULT_THRESHOLDS:  # an unquantized artifact: the generic defaults
        return replace(GateThresholds(), **overrides)
    return thresholds_for(algo, **overrides)


def compare_graphs(algo: str, section: GatesSection, baseline: Graph, candidate: Graph,
                   tokenizer: Tokenizer) -> GateReport:
    path = Path(section.eval_dataset) if section.eval_dataset else DEFAULT_EVAL
    encode = lambda t: tokenizer.encode(t, add_special_tokens=False)  # noqa: E731
    stream, _ = token_stream(path, encode)
    eval_set = make_eval_set(stream, section.window, section.num_positions)
    needle = None
    if section.needle_context_len:
        filler = "".join(read_texts(path)[0])[:20000]
        needle = text_needle(encode, filler, section.needle_context_len)
    base, cand = CachedModel(GraphModel(baseline), graph_digest(baseline)), GraphModel(candidate)
    report = compare(base.logits, cand.logits, eval_set, thresholds(algo, section),
                     base.greedy, cand.greedy, needle)
    base.save()
    report.baseline_cache = {"file": str(base.file), "hits": base.hits, "misses": base.misses}
    log.info("quality gates (%s) on %s (baseline cache: %d hits, %d computed):\n%s", algo, path,
             base.hits, base.misses, report.table())
    return report


def gate_method(algo: str, kv_cache_dtype: str) -> str:
    """Which default thresholds apply: the weight method's, else the KV cache's."""
    if algo != "none":
        return algo.split("+")[0]
    return f"kv_{kv_cache_dtype}" if kv_cache_dtype in ("fp8", "int8") else "none"


def run_gates(recipe, baseline: Graph, candidate: Graph, tokenizer: Tokenizer) -> GateReport:
    method = gate_method(recipe.quant_algo(), recipe.runtime.kv_cache_dtype)
    return compare_graphs(method, recipe.gates, baseline, candidate, tokenizer)


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


def gate_artifact(artifact: Path, baseline: Path, section: GatesSection | None = None) -> GateReport:
    """Gate a built artifact against a baseline checkpoint or artifact of the same model."""
    from runtime.artifact import open_artifact

    art = open_artifact(artifact)
    manifest = art.manifest
    algo = gate_method(manifest.get("quantization", {}).get("algo", "none"),
                       manifest["runtime"].get("kv_cache_dtype", "auto"))
    if section is None:
        section = GatesSection.model_validate(manifest["recipe"].get("gates", {}))
    candidate, _ = load_graph(artifact)
    base, _ = load_graph(baseline, manifest["model"]["dtype"])
    tokenizer = art.load_tokenizer()
    return compare_graphs(algo, section, base, candidate, tokenizer)
