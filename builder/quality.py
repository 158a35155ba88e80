"""Quality gates over graphs: the quantized graph against its unquantized baseline, same text, same run.

``builder build`` calls ``run_gates`` after quantizing; ``builder gate ARTIFACT --baseline ...`` calls
``gate_artifact``. The metrics themselves live in ``builder/gates.py``.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

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
    base, cand = GraphModel(baseline), GraphModel(candidate)
    report = compare(base.logits, cand.logits, eval_set, thresholds(algo, section),
                     base.greedy, cand.greedy, needle)
    log.info("quality gates (%s) on %s:\n%s", algo, path, report.table())
    return report


def gate_method(algo: str, kv_cache_dtype: str) -> str:
    """Which default thresholds apply: the weight method's, else the KV cache's."""
    if algo != "none":
        return algo
    return f"kv_{kv_cache_dtype}" if kv_cache_dtype in ("fp8", "int8") else "none"


def run_gates(recipe, baseline: Graph, candidate: Graph, tokenizer: Tokenizer) -> GateReport:
    method = gate_method(recipe.quantization.algo, recipe.runtime.kv_cache_dtype)
    return compare_graphs(method, recipe.gates, baseline, candidate, tokenizer)


def load_graph(path: Path, dtype: str | None = None) -> tuple[Graph, dict | None]:
    """A graph from an artifact directory (and its manifest) or from an HF checkpoint (traced)."""
    from runtime.artifact import MANIFEST, open_artifact

    if (path / MANIFEST).is_file():
        art = open_artifact(path)
        return Graph.from_dict(art.graph, art.load_weights()), art.manifest
    from builder.checkpoint import open_checkpoint
    from builder.pipeline import attach_weights
    from passes.trace import trace

    ckpt = open_checkpoint(path)
    graph, meta_model = trace(ckpt.hf_config())
    attach_weights(graph, ckpt, meta_model, getattr(torch, dtype or "float32"))
    return graph, None


def gate_artifact(artifact: Path, baseline: Path, section: GatesSection | None = None) -> GateReport:
    """Gate a built artifact against a baseline checkpoint or artifact of the same model."""
    from runtime.artifact import open_artifact

    manifest = open_artifact(artifact).manifest
    algo = gate_method(manifest.get("quantization", {}).get("algo", "none"),
                       manifest["runtime"].get("kv_cache_dtype", "auto"))
    if section is None:
        section = GatesSection.model_validate(manifest["recipe"].get("gates", {}))
    candidate, _ = load_graph(artifact)
    base, _ = load_graph(baseline, manifest["model"]["dtype"])
    tokenizer = Tokenizer.from_dir(artifact / "tokenizer")
    return compare_graphs(algo, section, base, candidate, tokenizer)
