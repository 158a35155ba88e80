"""Trace a Hugging Face causal LM with torch.export on the meta device, then lift it to the IR.

No weights are read here: the model is built from its config on the meta device, exported with a
dynamic sequence length, and lifted. The builder attaches real weights afterwards.
"""

from __future__ import annotations

import logging
import time
import warnings

import torch

from passes.ir import Graph
from passes.lift import LiftContext, LiftError, lift

log = logging.getLogger(__name__)

# Rotary variants whose frequencies do not depend on the sequence length: the runtime precomputes them.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def build_meta_model(config) -> torch.nn.Module:
    """Instantiate the HF modeling code for ``config`` with no storage behind its weights."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model.eval()
    return model


def export_model(model: torch.nn.Module) -> torch.export.ExportedProgram:
    """torch.export ``model(input_ids) -> logits`` with a dynamic number of tokens."""
    ids = torch.zeros(1, 8, dtype=torch.long, device="meta")
    # DYNAMIC rather than a named Dim with a range: some modeling code adds guards (e.g. min(a*T, b*T))
    # that hold for every length but that a ranged Dim's constraint check cannot prove, and refuses.
    seq = torch.export.Dim.DYNAMIC
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.export.export(
            model, (), {"input_ids": ids, "use_cache": False},
            dynamic_shapes={"input_ids": {1: seq}, "use_cache": None}, strict=False,
        )


def rotary_tables(model: torch.nn.Module):
    """Map an ``inv_freq`` buffer target to its real (inv_freq, attention_scaling).

    The traced model lives on meta, so its buffers have no values; the rotary module is built again
    on the CPU from the same config, which applies any rope_scaling the family supports.
    """

    def table(buffer_target: str) -> tuple[torch.Tensor, float]:
        module_path = buffer_target.rsplit(".", 1)[0]
        meta_module = model.get_submodule(module_path)
        rope_type = getattr(meta_module, "rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise LiftError(f"rope_type {rope_type!r} at {module_path!r} is not supported; "
                            f"supported: {', '.join(STATIC_ROPE_TYPES)}")
        with torch.device("cpu"):
            real = type(meta_module)(meta_module.config)
        inv_freq = getattr(real, buffer_target.rsplit(".", 1)[1]).detach().to(torch.float32).clone()
        return inv_freq, float(getattr(real, "attention_scaling", 1.0))

    return table


def rope_types(config) -> list[str]:
    """The rotary variants a config asks for.

    transformers 5 keeps them in ``rope_parameters``, older configs in ``rope_scaling`` (``type`` or
    ``rope_type``); either may also map each layer type to its own parameters.
    """
    found = []
    for attr in ("rope_parameters", "rope_scaling"):
        params = getattr(config, attr, None)
        if not isinstance(params, dict) or not params:
            continue
        per_layer_type = all(isinstance(v, dict) for v in params.values())
        for p in params.values() if per_layer_type else [params]:
            found.append(p.get("rope_type") or p.get("type") or "default")
    return found


def check_rope(config) -> None:
    """Refuse, before tracing, rotary variants whose frequencies change with the sequence length."""
    for rope_type in rope_types(config):
        if rope_type not in STATIC_ROPE_TYPES:
            raise LiftError(f"rope_type {rope_type!r} (config.json rope_parameters / rope_scaling) is not supported: "
                            f"its frequencies depend on the sequence length, and the runtime precomputes them; "
                            f"supported: {', '.join(STATIC_ROPE_TYPES)}")


def trace(config) -> tuple[Graph, torch.nn.Module]:
    """Config -> IR graph whose params are meta tensors (rotary tables are real), plus the meta model."""
    check_rope(config)
    model = build_meta_model(config)
    start = time.perf_counter()
    exported = export_model(model)
    graph = lift(exported, LiftContext(model=model, rotary=rotary_tables(model)))
    graph.meta.update(model_meta(config, graph))
    log.info("traced %s in %.2fs: %s", type(model).__name__, time.perf_counter() - start, graph.summary())
    return graph, model


def model_meta(config, graph: Graph) -> dict:
    """Model dimensions the runtime and reports need, read off the lifted graph where possible."""
    attn = [n for n in graph.nodes if n.op == "attention"]
    embed = next(n for n in graph.nodes if n.op == "embedding")
    vocab, hidden = graph.params[embed.weights["weight"]].shape
    return {
        "architecture": (getattr(config, "architectures", None) or [type(config).__name__])[0],
        "model_type": config.model_type,
        "vocab_size": int(vocab),
        "hidden_size": int(hidden),
        "num_layers": len(attn),
        "num_attention_heads": attn[0].attrs["num_heads"] if attn else 0,
        "num_key_value_heads": attn[0].attrs["num_kv_heads"] if attn else 0,
        "head_dim": attn[0].attrs["head_dim"] if attn else 0,
        "max_position_embeddings": int(getattr(config, "max_position_embeddings", 0) or 0),
        "kv_layers": [
            {"num_kv_heads": n.attrs["num_kv_heads"], "head_dim": n.attrs["head_dim"]} for n in attn
        ],
    }
