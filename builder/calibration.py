"""Calibration and evaluation text: read a .txt or .jsonl file, tokenize, cut into seeded windows.

The held-out files shipped beside the bundled model (``models/pystdlib-llama``), ``calibration.jsonl`` and
``eval.txt``, are standard-library Python source the model never saw: the default for that model only. Any
other model is calibrated and gated on text the recipe names (``calibration.dataset``,
``gates.eval_dataset``), or on the shipped text when the recipe says ``bundled``, which the manifest and the
report then flag (:func:`resolve_text`).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CALIBRATION = REPO_ROOT / "models" / "pystdlib-llama" / "calibration.jsonl"
DEFAULT_EVAL = REPO_ROOT / "models" / "pystdlib-llama" / "eval.txt"
BUNDLED_MODEL = REPO_ROOT / "models" / "pystdlib-llama"
BUNDLED = "bundled"  # calibration.dataset / gates.eval_dataset: use the shipped text on purpose


class DataError(ValueError):
    """A calibration or evaluation file that is missing, unreadable, empty or too short."""


@dataclass
class TokenData:
    """Token windows cut from a text file, with what the manifest records about them."""

    path: str
    sha256: str  # of the file's bytes
    windows: list[list[int]]
    seed: int

    def manifest(self) -> dict:
        return {"path": self.path, "sha256": self.sha256, "num_samples": len(self.windows),
                "seq_len": len(self.windows[0]) if self.windows else 0, "seed": self.seed}


def is_bundled_model(checkpoint: str | Path) -> bool:
    try:
        return Path(checkpoint).resolve() == BUNDLED_MODEL.resolve()
    except OSError:
        return False


def resolve_text(value: str | None, default: Path, checkpoint: str | Path, key: str) -> tuple[Path, str | None]:
    """The text file for ``key`` (``calibration.dataset`` / ``gates.eval_dataset``) and a warning for the
    report, or None. Unset, it is the shipped text for the bundled model and an error for any other model
    (its quantization would silently be fitted and judged on Python source); ``bundled`` takes the shipped
    text on purpose, with a warning when the model is not the bundled one."""
    if value and value != BUNDLED:
        return Path(value), None
    if is_bundled_model(checkpoint):
        return default, None
    if value == BUNDLED:
        return default, (f"{key}: bundled: {default.name}, the bundled model's held-out Python source, not text "
                         f"of this model's domain; quantization fitted or judged on it may not hold on the "
                         f"model's real inputs")
    raise DataError(f"{key} is not set and {checkpoint} is not the bundled model: set it to a .txt or .jsonl "
                    f"file of text like the model's real inputs, or to '{BUNDLED}' to use the repo's Python-source "
                    f"text ({default.name}) on purpose (the report then says so)")


def read_texts(path: Path, text_field: str = "text") -> tuple[list[str], str]:
    """Texts of a .txt file (one text) or .jsonl file (one per line), and the file's sha256."""
    if not path.is_file():
        what = ("is a directory" if path.is_dir() else "is not a regular file" if path.exists() else "does not exist")
        raise DataError(f"data file {str(path)!r} {what}; give a .txt or .jsonl file")
    try:
        raw = path.read_bytes()
        content = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read as UTF-8 text ({e})") from e
    digest = hashlib.sha256(raw).hexdigest()
    if path.suffix == ".jsonl":
        texts = []
        for i, line in enumerate(content.splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{i}: not valid JSON ({e})") from e
            if not isinstance(item, dict) or not isinstance(item.get(text_field), str):
                raise DataError(f"{path}:{i}: expected an object with a string {text_field!r} field")
            texts.append(item[text_field])
    elif path.suffix == ".txt":
        texts = [content]
    else:
        raise DataError(f"{path}: unsupported data file type {path.suffix!r}; use .txt or .jsonl")
    if not any(t.strip() for t in texts):
        raise DataError(f"{path} is empty; it must hold text to calibrate or evaluate on")
    return texts, digest


def token_windows(path: Path, encode: Callable[[str], list[int]], num_samples: int, seq_len: int,
                  seed: int, text_field: str = "text") -> TokenData:
    """``num_samples`` windows of ``seq_len`` tokens, drawn without overlap at seeded offsets."""
    texts, digest = read_texts(path, text_field)
    stream: list[int] = []
    for t in texts:
        stream.extend(encode(t))
    slots = len(stream) // seq_len
    if slots < num_samples:
        raise DataError(f"{path} has {len(stream)} tokens; {num_samples} samples of {seq_len} tokens need "
                        f"{num_samples * seq_len}. Use more text, or lower num_samples / seq_len")
    chosen = sorted(random.Random(seed).sample(range(slots), num_samples))
    windows = [stream[i * seq_len:(i + 1) * seq_len] for i in chosen]
    return TokenData(str(path), digest, windows, seed)


def token_stream(path: Path, encode: Callable[[str], list[int]], text_field: str = "text") -> tuple[list[int], str]:
    texts, digest = read_texts(path, text_field)
    stream: list[int] = []
    for t in texts:
        stream.extend(encode(t))
    return stream, digest
