"""Writing an engine artifact directory (layout in runtime/artifact.py).

The artifact is assembled in a sibling temporary directory and moved into place only when complete,
so a failed build never leaves a half-written artifact or destroys the previous one:

    out/             the previous artifact, an empty directory, or nothing (anything else is refused)
    .out.building/   the new artifact while it is written          } both carry TEMP_MARKER while they are
    .out.old/        the previous artifact while it is swapped out }  ours; only such directories are deleted

User data is never deleted: ``output_dir`` is replaced only when it is a previous artifact (its
manifest.json names the format) or empty, and the sibling temporaries only when they carry the marker.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import socket
import struct
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from builder import __version__
from builder.checkpoint import Checkpoint
from builder.recipe import Recipe
from builder.report import render_reports
from passes import PassRecord
from passes.ir import Graph
from runtime.artifact import (DRAFT_DIR, EAGLE_DIR, FORMAT_NAME, FORMAT_VERSION, GRAPH, MANIFEST, TOKENIZER_DIR,
                              WEIGHTS, file_sha256, manifest_digest, rank_weights_file)

TEMP_MARKER = ".llm-builder-temporary"  # in a directory this module made and may delete


class OutputDirError(RuntimeError):
    """``output_dir`` (or a sibling the build stages in) holds something that is not ours to replace."""


def _versions() -> dict[str, str]:
    import transformers

    return {"toolchain": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def temp_dirs(out: Path) -> tuple[Path, Path]:
    """The sibling directories a build of ``out`` stages in: (new artifact being written, previous one)."""
    return out.parent / f".{out.name}.building", out.parent / f".{out.name}.old"


def is_artifact_dir(path: Path) -> bool:
    """A real directory whose manifest.json parses and names the artifact format (content not verified)."""
    if path.is_symlink() or not path.is_dir():
        return False
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT_NAME


def is_replaceable(out: Path) -> bool:
    """A build may put its artifact at ``out``: nothing is there, an empty directory, or a previous artifact."""
    if out.is_symlink():
        return False
    if not out.exists():
        return True
    return out.is_dir() and (is_artifact_dir(out) or not any(out.iterdir()))


def _is_ours(path: Path) -> bool:
    return not path.is_symlink() and path.is_dir() and (path / TEMP_MARKER).is_file()


def _listing(path: Path, limit: int = 3) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_output_dir(out: Path) -> None:
    """Raise OutputDirError unless a build may write ``out``: it is absent, an empty directory or a
    previous artifact, and its staging siblings are absent or ours."""
    overwrite = "or pass --overwrite to `builder build` to replace it"
    parent = next((p for p in out.absolute().parents if p.exists() or p.is_symlink()), None)
    if parent is not None and not parent.is_dir():
        raise OutputDirError(f"output_dir {out}: {parent} is a file, not a directory; choose another output_dir")
    if parent is not None:  # the build writes a staging directory beside output_dir: can it, before it starts?
        try:
            tempfile.TemporaryDirectory(dir=parent, prefix=".builder-probe-").cleanup()
        except OSError as e:
            raise OutputDirError(f"output_dir {out}: cannot write in {parent} ({e.strerror or e}); choose a "
                                 f"writable place") from None
    if out.is_symlink():
        raise OutputDirError(f"output_dir {out} is a symbolic link (to {os.readlink(out)}); set output_dir to a "
                             f"real path, remove the link, {overwrite} (the link, not its target)")
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"output_dir {out} is a file, not a directory: choose another output_dir, move the "
                             f"file away, {overwrite}")
    if not is_replaceable(out):
        raise OutputDirError(f"output_dir {out} exists and is not an llm-builder artifact (no {MANIFEST} of format "
                             f"{FORMAT_NAME!r}; it holds {_listing(out)}); the build replaces only a previous "
                             f"artifact or an empty directory: choose another output_dir, empty it, {overwrite}")
    for tmp in temp_dirs(out):
        if (tmp.exists() or tmp.is_symlink()) and not _is_ours(tmp):
            raise OutputDirError(f"{tmp} exists but was not made by `builder build` (it has no {TEMP_MARKER} "
                                 f"file); the build stages output_dir {out} there and would delete it: rename it, "
                                 f"or remove it if it is left over from an interrupted build")


def check_not_an_input(out: Path, inputs: dict[str, str | Path | None]) -> None:
    """Raise OutputDirError when ``out`` is, or holds, one of the build's inputs (``inputs``: what the recipe
    calls it -> its path) or the working directory: replacing it (the build does, and ``--overwrite`` deletes it
    first) would destroy what the build reads."""
    target = out.absolute().resolve()
    for name, path in [*inputs.items(), ("the working directory", Path.cwd())]:
        if path is None:
            continue
        where = Path(path).absolute().resolve()
        if where == target or target in where.parents:
            raise OutputDirError(f"output_dir {out} {'is' if where == target else 'holds'} {name} ({path}): the build "
                                 f"replaces output_dir and would destroy it; choose another output_dir")


def remove_output_dir(out: Path) -> None:
    """Delete whatever ``out`` is (a link itself, not its target): what ``--overwrite`` does before a build."""
    if out.is_symlink() or out.is_file():
        out.unlink()
    elif out.is_dir():
        shutil.rmtree(out)


def _mark(path: Path) -> None:
    (path / TEMP_MARKER).write_text("made by `builder build`; deleted by it when the build moves on\n")


def _remove_ours(path: Path) -> None:
    """Delete a staging directory this module made; its marker goes last, so an interrupted removal
    leaves a directory that is still recognisably ours."""
    if not (path.exists() or path.is_symlink()):
        return
    assert _is_ours(path), f"{path} is not a directory made by the build"
    for child in path.iterdir():
        if child.name == TEMP_MARKER:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
    (path / TEMP_MARKER).unlink()
    path.rmdir()


def write_artifact(recipe: Recipe, ckpt: Checkpoint, graph: Graph, records: list[PassRecord],
                   started_at: str, start: float, timings: dict[str, float],
                   extra: dict[str, Any] | None = None) -> Path:
    """Write the artifact; ``extra`` adds manifest sections (calibration, gates). Raises OutputDirError
    (before writing, and again before the swap) when ``output_dir`` holds something not ours to replace."""
    out = Path(recipe.output_dir)
    check_output_dir(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = temp_dirs(out)
    _remove_ours(tmp)
    tmp.mkdir()
    _mark(tmp)
    try:
        _write_contents(tmp, recipe, ckpt, graph, records, started_at, start, timings, extra or {})
        check_output_dir(out)  # it may have changed while the build ran
        _swap_in(tmp, out, old)
    except BaseException:
        if _is_ours(tmp):
            _remove_ours(tmp)
        raise
    (out / TEMP_MARKER).unlink()
    return out


def _swap_in(tmp: Path, out: Path, old: Path) -> None:
    """Move the finished ``tmp`` to ``out``, replacing (and then deleting) a previous artifact there."""
    if not out.exists():
        tmp.rename(out)
        return
    _remove_ours(old)
    out.rename(old)
    _mark(old)
    try:
        tmp.rename(out)
    except BaseException:
        old.rename(out)
        (out / TEMP_MARKER).unlink()
        raise
    _remove_ours(old)


def _copy_artifact(src: Path, dst: Path) -> None:
    """An artifact's manifest and the files it lists (their contents: a link is not copied as a link), nothing
    else: files someone added beside them, or links out of the directory, do not travel into the new artifact."""
    manifest = json.loads((src / MANIFEST).read_text())
    dst.mkdir()
    shutil.copyfile(src / MANIFEST, dst / MANIFEST)
    for rel in manifest["files"]:
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / rel, dst / rel)


def _write_contents(tmp: Path, recipe: Recipe, ckpt: Checkpoint, graph: Graph, records: list[PassRecord],
                    started_at: str, start: float, timings: dict[str, float], extra: dict[str, Any]) -> None:
    (tmp / GRAPH).write_text(graph.to_json())
    weights, weight_hashes = _write_weights(tmp, graph)
    tok_dir = tmp / TOKENIZER_DIR
    tok_dir.mkdir()
    for f in ckpt.tokenizer_files():
        shutil.copy2(f, tok_dir / f.name)
    runtime_section = recipe.runtime.model_dump(mode="json")
    spec = runtime_section["speculative"]
    if spec["num_speculative_tokens"] is None:  # the method's default, as a number: a runtime from before the
        # method-dependent default (DEFAULT_SPECULATIVE_TOKENS) refuses a null
        from runtime.speculative import DEFAULT_SPECULATIVE_TOKENS

        spec["num_speculative_tokens"] = DEFAULT_SPECULATIVE_TOKENS.get(spec["method"],
                                                                        DEFAULT_SPECULATIVE_TOKENS["draft"])
    if recipe.runtime.speculative.method == "draft":  # the draft artifact travels inside (checked by the pipeline)
        _copy_artifact(Path(recipe.runtime.speculative.draft_model), tmp / DRAFT_DIR)
        runtime_section["speculative"]["draft_model"] = DRAFT_DIR  # relative to the artifact
    if recipe.runtime.speculative.method == "eagle":  # the EAGLE head's two files travel inside (checked likewise)
        (tmp / EAGLE_DIR).mkdir()
        for name in ("config.json", "model.safetensors"):
            shutil.copyfile(Path(recipe.runtime.speculative.draft_model) / name, tmp / EAGLE_DIR / name)
        runtime_section["speculative"]["draft_model"] = EAGLE_DIR

    verify = next((r.details for r in records if r.name == "verify"), None)
    manifest: dict[str, Any] = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "name": recipe.name or Path(recipe.output_dir).name,  # a recipe given as a dict may have none
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
        "runtime": runtime_section,
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
                         "lm_head": lm_head_scheme(graph), **extra},
    }
    manifest["build"]["duration_s"] = round(time.perf_counter() - start, 3)
    manifest["files"] = _file_table(tmp, weight_hashes)  # report sizes need the weight files' sizes
    for name, text in render_reports(manifest, graph).items():
        (tmp / name).write_text(text)
    manifest["files"] = _file_table(tmp, {name: entry["sha256"] for name, entry in manifest["files"].items()})
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))


def lm_head_scheme(graph: Graph) -> str:
    """The lm_head's storage scheme (``none``: the model dtype), as graph.json's lm_head node records it;
    the runtime checks the manifest's copy against graph.json."""
    head = next(n for n in graph.nodes if n.op == "lm_head")
    return head.attrs.get("quant", {}).get("scheme", "none")


def _write_weights(tmp: Path, graph: Graph) -> tuple[dict[str, Any], dict[str, str]]:
    """Write the weight file(s); returns the manifest's ``weights`` section and each file's sha256.

    Files are written one tensor at a time and hashed as they are written (a 61 GB file is not read back to hash
    it). A sharded graph (tp_size > 1) gets one file per rank, written from views of the full tensors, so the build
    never holds more than the model plus one tensor's shard."""
    if graph.shards is None:
        # largest elements first, as safetensors' save_file orders them: every tensor's data aligned to its element
        names = sorted(graph.params, key=lambda n: (-graph.params[n].element_size(), n))
        hasher = hashlib.sha256()
        nbytes = write_safetensors_streaming(tmp / WEIGHTS, {n: graph.params[n] for n in names},
                                             graph.params.__getitem__, {"format": FORMAT_NAME}, hasher)
        return {"files": [WEIGHTS], "num_tensors": len(names), "bytes": nbytes}, {WEIGHTS: hasher.hexdigest()}
    shards, names = graph.shards, sorted(graph.params)
    ranks, hashes = [], {}
    for rank in range(shards.tp_size):
        file, hasher = rank_weights_file(rank), hashlib.sha256()
        nbytes = write_safetensors_streaming(tmp / file, {n: graph.params[n] for n in names},
                                             lambda name: shards.tensor(name, rank),
                                             {"format": FORMAT_NAME, "rank": str(rank), "tp_size": str(shards.tp_size)},
                                             hasher)
        ranks.append({"rank": rank, "file": file, "bytes": nbytes, "tensors": names})
        hashes[file] = hasher.hexdigest()
    return ({"files": [r["file"] for r in ranks], "num_tensors": len(names), "bytes": sum(r["bytes"] for r in ranks),
             "tp_size": shards.tp_size, "ranks": ranks}, hashes)


# safetensors' dtype names
_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
              torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64", torch.bool: "BOOL",
              torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def write_safetensors_streaming(path: Path, specs: dict[str, torch.Tensor], produce, metadata: dict[str, str],
                                hasher: Any = None) -> int:
    """Write a safetensors file whose tensors are made one at a time by ``produce(name)``; returns the
    bytes of tensor data. ``specs`` gives each tensor's shape and dtype (meta tensors do) for the header.
    ``hasher`` (a hashlib object) is fed the file's bytes as they are written, on a second thread: a tensor is
    hashed while it is written, and let go of before the next one is made.

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
    with open(path, "wb") as f, ThreadPoolExecutor(max_workers=1) as pool:
        def write(data) -> None:
            hashing = pool.submit(hasher.update, data) if hasher is not None else None
            f.write(data)
            if hashing is not None:
                hashing.result()

        write(struct.pack("<Q", len(text)))
        write(text)
        for name, spec in specs.items():
            write(_tensor_bytes(name, produce(name), spec))  # nothing of it outlives the call
    return offset


def _tensor_bytes(name: str, t: torch.Tensor, spec: torch.Tensor) -> memoryview:
    assert t.shape == spec.shape and t.dtype == spec.dtype, f"{name}: {tuple(t.shape)} {t.dtype} != the header's"
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data


def _file_table(root: Path, known_hashes: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file under ``root`` (a bundled draft artifact's, its manifest included);
    ``known_hashes`` (path -> sha256) are files hashed already."""
    known_hashes = known_hashes or {}
    table = {}
    for f in sorted(root.rglob("*")):
        if f.is_file() and f != root / MANIFEST and f != root / TEMP_MARKER:
            name = f.relative_to(root).as_posix()
            table[name] = {"bytes": f.stat().st_size, "sha256": known_hashes.get(name) or file_sha256(f)}
    return table
