"""The engine artifact on disk: its layout, and loading it with integrity checks.

    artifacts/<name>/
      manifest.json          format version, toolchain, resolved recipe, source hashes, dims,
                             sha256 and size of every other file, and its own hash
      graph.json             the graph IR (ops, attributes, weight names)
      weights.safetensors    every weight the graph names (tp_size 1), or
      weights-rank{r}.safetensors   rank r's shard of every weight (tp_size > 1; manifest: tensor_parallel)
      tokenizer/             tokenizer.json, tokenizer_config.json, ...
      report.md, report.html the build report

The manifest's ``manifest_sha256`` is the sha256 of the manifest's canonical JSON without that key,
so an edited manifest is refused as surely as an edited weight file. This guards against corruption
and tampering by mistake; it is not a signature. A manifest's values are checked too (runtime/manifest.py:
types, ranges, agreement with graph.json and the weight headers), since a re-hashed one may hold anything.

NOTE: the runtime reads only files the manifest lists (``Artifact.file``), each verified against its
size and sha256; a file added to the directory afterwards is ignored, whatever its name.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from runtime.manifest import ManifestError, check_graph, check_manifest, check_weight_header
from runtime.tokenizer import TOKENIZER_FILE, Tokenizer

FORMAT_NAME = "llm-builder-engine"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
GRAPH = "graph.json"
WEIGHTS = "weights.safetensors"
TOKENIZER_DIR = "tokenizer"
DRAFT_DIR = "draft"  # a draft model's artifact, bundled (runtime.speculative method draft)
EAGLE_DIR = "eagle"  # an EAGLE head's config.json and model.safetensors, bundled (method eagle, runtime.eagle)


def rank_weights_file(rank: int) -> str:
    """The weight file of tensor-parallel rank ``rank``."""
    return f"weights-rank{rank}.safetensors"


class ArtifactError(RuntimeError):
    """The artifact is missing, of another format version, truncated, or modified since it was built."""


def canonical_json(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def manifest_digest(manifest: dict[str, Any]) -> str:
    """The hash a manifest records of itself (computed with the ``manifest_sha256`` key left out)."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(canonical_json(body)).hexdigest()


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass
class Artifact:
    """A verified artifact: manifest, graph and the path of its files."""

    path: Path
    manifest: dict[str, Any]
    graph: dict[str, Any]

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / TOKENIZER_DIR

    def file(self, rel: str) -> Path | None:
        """The path of ``rel`` (posix, relative to the artifact) when the manifest lists it, else None:
        a file the manifest does not list was not verified, so it is never read."""
        return self.path / rel if rel in self.manifest["files"] else None

    def has(self, rel: str) -> bool:
        """Whether the manifest lists ``rel`` (and so the runtime may read it)."""
        return self.file(rel) is not None

    def listed_in(self, folder: str) -> frozenset[str]:
        """The listed files under ``folder``, as paths relative to it."""
        prefix = folder.rstrip("/") + "/"
        return frozenset(rel.removeprefix(prefix) for rel in self.manifest["files"] if rel.startswith(prefix))

    def load_tokenizer(self) -> Tokenizer:
        """The tokenizer, from the listed files of ``tokenizer/`` only; its EOS ids within the model's vocab_size."""
        return Tokenizer.from_dir(self.tokenizer_dir, files=self.listed_in(TOKENIZER_DIR),
                                  vocab_size=self.manifest["model"]["vocab_size"])

    @property
    def tp_size(self) -> int:
        """Tensor-parallel ranks the artifact is sharded for (1: one weight file, one device)."""
        return self.manifest["tensor_parallel"]["tp_size"]

    def load_weights(self, device: torch.device | str = "cpu", rank: int | None = None) -> dict[str, torch.Tensor]:
        """Every weight, or with ``rank`` (required when tp_size > 1) only that rank's file."""
        files = self.manifest["weights"]["files"]
        if self.tp_size > 1:
            if rank is None or not 0 <= rank < self.tp_size:
                raise ArtifactError(f"{self.path} is sharded for tp_size {self.tp_size}: load one rank's weights "
                                    f"(rank 0..{self.tp_size - 1}), or run it with Engine.load, which starts the ranks")
            files = [self.manifest["weights"]["ranks"][rank]["file"]]
        weights: dict[str, torch.Tensor] = {}
        for name in files:
            file = self.file(name)
            if file is None:
                raise ArtifactError(f"{self.path}: weight file {name} is not listed in the manifest's files")
            try:
                weights.update(load_file(file, device=str(device)))
            except (SafetensorError, OSError) as e:
                raise ArtifactError(f"{self.path / name}: cannot read weights ({e})") from e
        missing = sorted(set(self.graph["params"]) - set(weights))
        if missing:
            raise ArtifactError(f"{self.path}: weights named by graph.json are missing: {', '.join(missing[:5])}")
        return weights


def read_manifest(path: Path) -> dict[str, Any]:
    file = path / MANIFEST
    if not path.is_dir():
        raise ArtifactError(f"{path} is not a directory; build an artifact with `builder build RECIPE`")
    if not file.is_file():
        raise ArtifactError(f"{path} has no {MANIFEST}; it is not an engine artifact (or its build did not finish)")
    try:
        manifest = json.loads(file.read_text())
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, integers past 4,300 digits
        raise ArtifactError(f"{file} is not valid JSON ({type(e).__name__}: {str(e)[:200]}); the artifact is corrupt, "
                            f"rebuild it") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise ArtifactError(f"{file} is not a manifest of format {FORMAT_NAME!r}")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(f"{file}: artifact format version {version!r} is not supported by this runtime "
                            f"(it reads version {FORMAT_VERSION}); rebuild the artifact with a matching toolchain")
    recorded = manifest.get("manifest_sha256")
    if recorded != manifest_digest(manifest):
        raise ArtifactError(f"{file} was modified after the build (its manifest_sha256 does not match its "
                            f"contents); rebuild the artifact")
    return manifest


def verify_files(path: Path, manifest: dict[str, Any], check_hashes: bool = True,
                 skip_hashes: frozenset[str] = frozenset()) -> None:
    """Every file the manifest lists exists with its recorded size (and sha256, except ``skip_hashes``), inside the
    artifact: a listed file or a directory on its way reached through a symbolic link is refused (it could name any
    file of the host)."""
    for rel, info in manifest["files"].items():
        file = path / rel
        inside = path
        for part in Path(rel).parts:  # the artifact directory itself may be a link (artifacts/latest): not its files
            inside = inside / part
            if inside.is_symlink():
                raise ArtifactError(f"{inside} is a symbolic link (to {os.readlink(inside)}); an artifact's files are "
                                    f"its own, not links to others: copy the files in, or rebuild the artifact")
        if not file.is_file():
            raise ArtifactError(f"{file} is missing (listed in the manifest); rebuild or re-copy the artifact")
        size = file.stat().st_size
        if size != info["bytes"]:
            raise ArtifactError(f"{file} is truncated or modified: {size} bytes, the manifest records "
                                f"{info['bytes']}; rebuild or re-copy the artifact")
        if check_hashes and rel not in skip_hashes and file_sha256(file) != info["sha256"]:
            raise ArtifactError(f"{file} was modified after the build (sha256 does not match the manifest); "
                                f"rebuild or re-copy the artifact")


def _weight_header(file: Path) -> dict[str, tuple[str, list[int]]]:
    """A safetensors file's tensors as name -> (dtype, shape), from its header alone."""
    try:
        with safe_open(str(file), framework="pt") as f:
            slices = {name: f.get_slice(name) for name in f.keys()}
            return {name: (s.get_dtype(), s.get_shape()) for name, s in slices.items()}
    except (SafetensorError, OSError) as e:
        raise ArtifactError(f"{file}: cannot read its safetensors header ({e}); rebuild the artifact") from e


def open_artifact(path: str | Path, check_hashes: bool = True, rank: int | None = None) -> Artifact:
    """Read and verify an artifact directory; raises ArtifactError naming what is wrong. With ``rank``
    (a tensor-parallel worker), other ranks' weight files are only size-checked: their ranks hash them."""
    path = Path(path)
    manifest = read_manifest(path)
    _checked(path / MANIFEST, check_manifest, manifest, {"the tokenizer": f"{TOKENIZER_DIR}/{TOKENIZER_FILE}"})
    others = frozenset(r["file"] for r in manifest["weights"].get("ranks", []) if r["rank"] != rank) \
        if rank is not None else frozenset()
    verify_files(path, manifest, check_hashes, others)
    graph_file = path / manifest["graph"]["file"]
    try:
        graph = json.loads(graph_file.read_text())
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, integers past 4,300 digits
        raise ArtifactError(f"{graph_file} is not valid JSON ({type(e).__name__}: {str(e)[:200]}); rebuild the "
                            f"artifact") from None
    _checked(path / MANIFEST, check_graph, manifest, graph)
    _checked(path, _check_weight_headers, path, manifest, graph)
    return Artifact(path, manifest, graph)


def _check_weight_headers(path: Path, manifest: dict[str, Any], graph: dict[str, Any]) -> None:
    """Every weight file holds tensors of graph.json's shapes and dtypes: each rank's file all of them
    (tp_size > 1), else the files together."""
    files, sharded = manifest["weights"]["files"], manifest["tensor_parallel"]["tp_size"] > 1
    union: dict[str, tuple[str, list[int]]] = {}
    owner: dict[str, str] = {}
    for name in files:
        header = _weight_header(path / name)
        check_weight_header(name, header, graph["params"], complete=sharded)
        if not sharded:  # one set of weights over several files: each tensor in one of them (else the last read wins)
            twice = next((t for t in header if t in owner), None)
            if twice is not None:
                raise ArtifactError(f"{path}: tensor {twice!r} is in both {owner[twice]} and {name}; an artifact's "
                                    f"weight files hold each tensor once: rebuild it")
            owner.update(dict.fromkeys(header, name))
        union.update(header)
    check_weight_header(" + ".join(files), union, graph["params"], complete=True)


def _checked(where: Path, check, *args: Any) -> None:
    """Run one of runtime/manifest.py's checks; its ManifestError becomes an ArtifactError naming ``where``."""
    try:
        check(*args)
    except ManifestError as e:
        raise ArtifactError(f"{where}: {e}; the artifact was edited after the build or written by a faulty "
                            f"toolchain: rebuild it with `builder build`") from e
