"""verify: run the graph on a few prompts and compare its logits with the source model's."""

from __future__ import annotations

import torch

from passes.base import Pass, PassContext, PassError, PassResult, register
from passes.ir import Graph
from runtime.executor import Executor, SeqSlice, StepInput, sequence_positions
from runtime.kv_cache import SequenceKV


def run_graph(graph: Graph, prompts: list[list[int]], device: str = "cpu") -> list[torch.Tensor]:
    """Logits [len(prompt), vocab] for each prompt, from the runtime's executor over this graph."""
    executor = Executor(graph.to_dict(), graph.params)
    layout = executor.kv_layout()
    outs = []
    for ids in prompts:
        kv = SequenceKV(layout, len(ids), device)
        # (a prompt past LongRoPE's switch is on its second table throughout, as HF's one forward has it)
        positions = sequence_positions(executor.long_rope_from, 0, len(ids), len(ids), device)
        inp = StepInput(torch.tensor(ids, device=device), positions, [SeqSlice(kv, 0, len(ids))])
        outs.append(executor.forward(inp))
    return outs


@register
class Verify(Pass):
    """Fail the build if the graph's logits differ from the source model's by more than the tolerance."""

    name = "verify"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        if ctx.reference is None or not ctx.verify_prompts:
            raise PassError("verify needs the source model and at least one prompt")
        max_err, agree, total = 0.0, 0, 0
        for ids, ours in zip(ctx.verify_prompts, run_graph(graph, ctx.verify_prompts)):
            ref = ctx.reference(ids)
            if not (torch.isfinite(ours).all() and torch.isfinite(ref).all()):  # max() would pass a NaN by
                raise PassError(_not_finite(graph, ours, ref))
            max_err = max(max_err, (ours - ref).abs().max().item())
            agree += int((ours.argmax(-1) == ref.argmax(-1)).sum())
            total += len(ids)
        details = {"max_abs_logit_err": max_err, "atol": ctx.verify_atol, "top1_agreement": agree / total,
                   "num_prompts": len(ctx.verify_prompts), "num_tokens": total}
        if not max_err <= ctx.verify_atol:
            raise PassError(f"verify: logits differ from the source model by up to {max_err:.3g} "
                            f"(tolerance {ctx.verify_atol:g}, top-1 agreement {agree}/{total}); "
                            f"the graph does not compute what the checkpoint does")
        return PassResult(graph, len(ctx.verify_prompts), 0, details)


def _not_finite(graph: Graph, ours: torch.Tensor, ref: torch.Tensor) -> str:
    """Why verify stops on NaN or inf logits, naming the first weight that is not finite when there is one."""
    whose = ("the source model's and the graph's" if not torch.isfinite(ref).all() and not torch.isfinite(ours).all()
             else "the source model's" if not torch.isfinite(ref).all() else "the graph's")
    bad = next((name for name, t in graph.params.items() if t.is_floating_point() and not _finite(t)), None)
    where = (f"; the weight {bad!r} holds NaN or inf: the checkpoint is broken" if bad is not None
             else "; every weight is finite, so the computation overflows (or, if only the graph's are, the graph is "
                  "wrong)")
    return f"verify: {whose} logits are not finite (NaN or inf){where}"


def _finite(t: torch.Tensor) -> bool:
    """Whether every value of a floating-point weight is finite; FP8 codes (which isfinite does not take) are read
    as float32."""
    return bool(torch.isfinite(t.float() if t.element_size() == 1 else t).all())
