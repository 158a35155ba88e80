"""Pass interface, registry and the pass manager.

A pass has a stable ``name``, a one-line docstring, and ``run(graph, ctx) -> PassResult``. The
recipe is resolved into an ordered list of pass names once (``builder/pipeline.py``); the manager
only runs that list, logging what each pass matched and changed and how long it took.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from passes.ir import Graph

log = logging.getLogger("passes")
Progress = Callable[[str, int, int], None]


class PassError(RuntimeError):
    """A pass found the graph unfit (e.g. verification failed); stops the build."""


@dataclass
class PassContext:
    """What passes may need besides the graph. Passes read it; they do not mutate it."""

    # reference(token_ids) -> logits [num_tokens, vocab] fp32 of the source model (verify pass)
    reference: Callable[[list[int]], torch.Tensor] | None = None
    verify_prompts: list[list[int]] = field(default_factory=list)  # token ids the verify pass runs
    verify_atol: float = 1e-4  # max |logit difference| allowed by the verify pass
    options: dict[str, dict[str, Any]] = field(default_factory=dict)  # per-pass options from the recipe
    calibration: list[list[int]] = field(default_factory=list)  # token windows for calibrating passes
    progress: Progress | None = None  # progress(task, done, total) for long passes; None = silent


@dataclass
class PassResult:
    """A pass's output graph and what it did, for the log and the build report."""

    graph: Graph
    matched: int = 0  # pattern instances found
    changed: int = 0  # instances rewritten
    details: dict[str, Any] = field(default_factory=dict)  # pass-specific figures (e.g. verify's max error)


@dataclass
class PassRecord:
    name: str
    matched: int
    changed: int
    seconds: float
    nodes_before: int
    nodes_after: int
    details: dict[str, Any]


class Pass:
    """Base class: subclasses set ``name`` and implement ``run``."""

    name: str = ""

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        raise NotImplementedError

    @property
    def description(self) -> str:
        return (self.__doc__ or "").strip().splitlines()[0] if self.__doc__ else ""


PASSES: dict[str, type[Pass]] = {}


def register(cls: type[Pass]) -> type[Pass]:
    assert cls.name and cls.name not in PASSES, f"pass name {cls.name!r} missing or taken"
    PASSES[cls.name] = cls
    return cls


def run_passes(graph: Graph, names: list[str], ctx: PassContext) -> tuple[Graph, list[PassRecord]]:
    """Run the named passes in order; each result is structure-checked before the next runs."""
    records = []
    for name in names:
        p = PASSES[name]()
        before = len(graph.nodes)
        start = time.perf_counter()
        result = p.run(graph, ctx)
        seconds = time.perf_counter() - start
        result.graph.check()
        graph = result.graph
        rec = PassRecord(name, result.matched, result.changed, seconds, before, len(graph.nodes), result.details)
        records.append(rec)
        extra = "".join(f", {k}={_fmt(v)}" for k, v in result.details.items())
        log.info("pass %-18s matched=%d changed=%d nodes %d->%d in %.3fs%s",
                 name, rec.matched, rec.changed, before, rec.nodes_after, seconds, extra)
    return graph, records


def _fmt(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)
