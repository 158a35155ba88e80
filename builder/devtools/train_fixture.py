"""Train the second fixture checkpoint: a small Qwen3 model on the standard library's docstrings.

The bundled ``models/pystdlib-llama`` is a Llama trained on Python source. Quantization and gate
tests that only ever see it cannot tell a method that works from one tuned to that one model, so
this script trains a second, different one: a ``Qwen3ForCausalLM`` (per-head q/k RMSNorm,
grouped-query attention, tied embeddings) on English prose, the module, class and function
docstrings of the same standard-library files, extracted with :mod:`ast`. Files are split by
:func:`builder.devtools.train_bundled.assign_split`, so eval and calibration docstrings come from
files that are never trained on. Everything but the corpus and the model family (tokenizer,
packing, training loop, evaluation, reports) is :mod:`builder.devtools.train_bundled`'s.

Run it as::

    python -m builder.devtools.train_fixture --out models/pydoc-qwen3

The run is reproducible: fixed seed, file order, split, data order and number of optimizer steps.
"""

from __future__ import annotations

import argparse
import ast
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from builder.devtools import train_bundled as tb
from builder.devtools.train_bundled import SPLIT_CALIBRATION, SPLIT_EVAL, SPLIT_TRAIN, SourceFile

FAMILY = "qwen3"
ARCHITECTURE = "Qwen3ForCausalLM"
VOCAB_SIZE = 2048
SEED = 1234
MAX_STEPS = 240  # x batch 8 x 256 tokens: about 1 epoch of the train split, inside 20 minutes on 2 CPU cores
BATCH_SIZE = 8
WARMUP_STEPS = 20
SEQ_LEN = 256
LOG_EVERY = 25
PEAK_LR = 4e-3  # twice the bundled model's: a smaller model, and fewer steps
CALIBRATION_CHUNK_CHARS = 1000  # docstring text is short: smaller chunks give enough calibration records
DEFAULT_PROMPTS = ("Return the number of", "This module provides", "Raise ValueError if")

MODEL_SPEC = tb.ModelSpec(
    hidden_size=192,  # 3 x 64 and intermediate 6 x 64: group_size 64 divides every linear's input
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=1024,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
)

REPORT = tb.ReportText(
    name="pydoc-qwen3",
    script="builder/devtools/train_fixture.py",
    data_lines=(
        "English prose: the module, class and function docstrings (`ast.get_docstring`, cleaned, in source order,",
        "a blank line between them) of the standard-library `*.py` files `train_bundled.py` reads (test suites,",
        "idlelib, site-packages, generated sysconfig data and non-UTF-8 files excluded). Files are split by",
        "`sha256(relative path) % 100` exactly as for `pystdlib-llama`: 0-89 train, 90-94 eval, 95-99 calibration;",
        "one document per file, files without docstrings dropped. Eval and calibration files are listed in",
        "`split.json` and never seen in training.",
    ),
    sample_lang="text",
    show_loss_curve=True,
)


def report_text(metrics: dict[str, Any]) -> tb.ReportText:
    """:data:`REPORT` with the corpus counts of this run added to the Data section."""
    d = metrics["data"]
    counts = (
        f"{d['source_files']} source files read; {d['files_without_docstrings']} without docstrings,"
        f" {len(d['skipped_unparsable'])} unparsable; docstrings per split: "
        + ", ".join(f"{name} {d[name]['docstrings']:,}" for name in (SPLIT_TRAIN, SPLIT_EVAL, SPLIT_CALIBRATION))
        + "."
    )
    return replace(REPORT, data_lines=(*REPORT.data_lines, "", counts))


def docstrings(source: str) -> list[str]:
    """Module, class and function docstrings of one Python source, cleaned, in source order."""
    tree = ast.parse(source)
    found: list[tuple[int, int, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node, clean=True)
        if doc and doc.strip():
            found.append((getattr(node, "lineno", 0), getattr(node, "col_offset", 0), doc.strip()))
    return [doc for _, _, doc in sorted(found)]


def docstring_files(files: Sequence[SourceFile]) -> tuple[list[SourceFile], dict[str, int], list[str]]:
    """Each file's docstrings as one document (same relative path, so the split is unchanged).

    Returns the documents, the number of docstrings per relative path, and the paths that do not
    parse under this interpreter (skipped).
    """
    docs: list[SourceFile] = []
    counts: dict[str, int] = {}
    unparsable: list[str] = []
    for f in files:
        try:
            found = docstrings(f.text)
        except SyntaxError:
            unparsable.append(f.rel_path)
            continue
        if found:
            docs.append(SourceFile(f.rel_path, "\n\n".join(found) + "\n"))
            counts[f.rel_path] = len(found)
    return docs, counts, unparsable


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options; the defaults reproduce the committed fixture."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("models/pydoc-qwen3"), help="output checkpoint directory")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--max-steps", type=int, default=MAX_STEPS, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    p.add_argument("--seq-len", type=int, default=SEQ_LEN)
    p.add_argument("--lr", type=float, default=PEAK_LR, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=WARMUP_STEPS)
    p.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    p.add_argument("--log-every", type=int, default=LOG_EVERY, help="print the loss every N steps")
    p.add_argument("--threads", type=int, default=tb.TrainSpec.threads)
    p.add_argument("--stdlib", type=Path, default=None, help="stdlib directory (default: this interpreter's)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Build the docstring corpus, tokenizer and model, train, evaluate and write the checkpoint directory."""
    args = parse_args(argv)
    out_dir, run_start = tb.prepare_out_dir(args)
    root = args.stdlib or tb.stdlib_root()
    sources, undecodable = tb.collect_stdlib_files(root)
    files, doc_counts, unparsable = docstring_files(sources)
    splits = tb.split_files(files)
    print(f"stdlib {root}: docstring documents " + ", ".join(f"{k}={len(v)}" for k, v in splits.items()), flush=True)
    corpus = tb.Corpus(
        splits, undecodable + unparsable,
        {"source_files": len(sources), "skipped_not_utf8": undecodable, "skipped_unparsable": unparsable,
         "files_without_docstrings": len(sources) - len(files) - len(unparsable)},
        split_counts=lambda fs: {"docstrings": sum(doc_counts[f.rel_path] for f in fs)})
    trainer = tb.Trainer("builder.devtools.train_fixture", MODEL_SPEC, family=FAMILY, architecture=ARCHITECTURE,
                         model_extra={"qk_norm": True}, calibration_chunk_chars=CALIBRATION_CHUNK_CHARS,
                         prompts=DEFAULT_PROMPTS, report=report_text)
    return tb.run(args, argv, out_dir, run_start, corpus, trainer)


if __name__ == "__main__":
    main()
