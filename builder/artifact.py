"""Writing an engine artifact directory (layout in runtime/artifact.py).

The artifact is assembled in a sibling temporary directory and moved into place only when complete,
so a failed build never leaves a half-written artifact or destroys the previous one.
"""

from __future__ import annotations

import json
import platform
import shutil
import socket
import struct
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from builder import __version__
from builder.checkpoint import Checkpoint
from builder.recipe import Recipe
from builder.report import render_reports
from passes import PassRecord
from passes.ir import Graph
from runtime.artifact import (FORMAT_NAME, FORMAT_VERSION, GRAPH, MANIFEST, TOKENIZER_DIR, WEIGHTS,
                              file_sha256, manifest_digest, rank_weights_file)


def _versions() -> dict[str, str]:
    import transformers

    return {"toolchain": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def write_artifact(recipe: Recipe, ckpt: Checkpoint, graph: Graph, records: list[PassRecord],
                   started_at: str, start: float, timings: dict[str, float],
                   extra: dict[str, Any] | None = None) -> Path:
    """Write the artifact; ``extra`` adds manifest sections (calibration, gates)."""
    out = Path(recipe.output_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.building"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        _write_contents(tmp, recipe, ckpt, graph, records, started_at, start, timings, extra or {})
        if out.exists():
            old = out.parent / f".{out.name}.old"
            if old.exists():
                shutil.rmtree(old)
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_contents(tmp: Path, recipe: Recipe, ckpt: Checkpoint, graph: Graph, records: list[PassRecord],
                    started_at: str, start: float, timings: dict[str, float], extra: dict[str, Any]) -> None:
    (tmp / GRAPH).write_text(graph.to_json())
    weights = _write_weights(tmp, graph)
    tok_dir = tmp / TOKENIZER_DIR
    tok_dir.mkdir()
    for f in ckpt.tokenizer_files():
        shutil.copy2(f, tok_dir / f.name)

    verify = next((r.details for r in records if r.name == "verify"), None)
    manifest: dict[str, Any] = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "name": recipe.name,
        "versions": _versions(),
        "recipe": recipe.resolved(),
        "recipe_sha256": recipe.sha256(),
        "source": {
            "checkpoint": str(ckpt.path),
            "model_type": ckpt.model_type,
            "config": ckpt.config_dict,
            "files": ckpt.file_hashes(),
        },
        "model": {**graph.meta, "dtype": recipe.model.dtype,
                  "num_parameters": graph.shards.num_params() if graph.shards else graph.num_params()},
        "runtime": recipe.runtime.model_dump(mode="json"),
        "graph": {"file": GRAPH, "ir_version": graph.version, "num_nodes": len(graph.nodes),
                  "ops": graph.count_ops()},
        "weights": weights,
        "tensor_parallel": graph.meta.get("tensor_parallel", {"tp_size": 1}),
        "build": {
            "started_at": started_at,
            "host": socket.gethostname(),
            "platform": platform.platform(),
            "timings_s": timings,
            "passes": [asdict(r) for r in records],
            "verify": verify,
        },
        "reports": {"markdown": "report.md", "html": "report.html"},
        "quantization": {"algo": recipe.quant_algo(), "kv_cache_dtype": recipe.runtime.kv_cache_dtype,
                         **extra},
    }
    manifest["build"]["duration_s"] = round(time.perf_counter() - start, 3)
    manifest["files"] = _file_table(tmp)  # report sizes need the weight files' sizes
    for name, text in render_reports(manifest, graph).items():
        (tmp / name).write_text(text)
    manifest["files"] = _file_table(tmp)
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))


def _write_weights(tmp: Path, graph: Graph) -> dict[str, Any]:
    """Write the weight file(s); returns the manifest's ``weights`` section.

    A sharded graph (tp_size > 1) gets one file per rank, written one tensor at a time from views of
    the full tensors, so the build never holds more than the model plus one tensor's shard."""
    if graph.shards is None:
        tensors = {name: t.contiguous() for name, t in graph.params.items()}
        save_file(tensors, tmp / WEIGHTS, metadata={"format": FORMAT_NAME})
        return {"files": [WEIGHTS], "num_tensors": len(tensors),
                "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}
    shards, names = graph.shards, sorted(graph.params)
    ranks = []
    for rank in range(shards.tp_size):
        file = rank_weights_file(rank)
        nbytes = write_safetensors_streaming(tmp / file, {n: graph.params[n] for n in names},
                                             lambda name: shards.tensor(name, rank),
                                             {"format": FORMAT_NAME, "rank": str(rank), "tp_size": str(shards.tp_size)})
        ranks.append({"rank": rank, "file": file, "bytes": nbytes, "tensors": names})
    return {"files": [r["file"] for r in ranks], "num_tensors": len(names), "bytes": sum(r["bytes"] for r in ranks),
            "tp_size": shards.tp_size, "ranks": ranks}


# safetensors' dtype names
_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
              torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def write_safetensors_streaming(path: Path, specs: dict[str, torch.Tensor], produce, metadata: dict[str, str]) -> int:
    """Write a safetensors file whose tensors are made one at a time by ``produce(name)``; returns the
    bytes of tensor data. ``specs`` gives each tensor's shape and dtype (meta tensors do) for the header.

    Layout (the safetensors format): u64 little-endian header size, the JSON header (name -> dtype,
    shape, data_offsets; padded with spaces to 8 bytes), then the tensors' bytes back to back."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, spec in specs.items():
        size = spec.numel() * spec.element_size()
        header[name] = {"dtype": _ST_DTYPES[spec.dtype], "shape": list(spec.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, spec in specs.items():
            _write_tensor(f, name, produce(name), spec)  # nothing of it outlives the call
    return offset


def _write_tensor(f, name: str, t: torch.Tensor, spec: torch.Tensor) -> None:
    assert t.shape == spec.shape and t.dtype == spec.dtype, f"{name}: {tuple(t.shape)} {t.dtype} != the header's"
    f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)


def _file_table(root: Path) -> dict[str, dict[str, Any]]:
    table = {}
    for f in sorted(root.rglob("*")):
        if f.is_file() and f.name != MANIFEST:
            table[f.relative_to(root).as_posix()] = {"bytes": f.stat().st_size, "sha256": file_sha256(f)}
    return table
