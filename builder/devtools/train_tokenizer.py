"""A byte-level BPE tokenizer trained on this Python installation's own source files, for random checkpoints that
need a tokenizer which can write text.

    python -m builder.devtools.train_tokenizer OUT_DIR [--vocab-size 128256] [--max-mb 200]

The random checkpoints of ``builder.devtools.make_checkpoint`` have word-level vocabularies (``t123`` tokens) that
cannot spell JSON, so a structured-output benchmark on them (``builder.bench.structured --tokenizer DIR``) needs
another tokenizer of at most the model's vocabulary. A grammar's mask costs time per token of the vocabulary it
walks, so the benchmark wants one about as large as the real model's; this trains one offline, without a model
hub: the standard library's ``.py`` files, then site-packages', in sorted order (so the same installation gives the
same tokenizer), up to --max-mb of text. BPE stops short of --vocab-size when the text has no more pairs seen
twice; the size reached is printed (about 78,000 from the standard library alone).

The directory gets ``tokenizer.json`` and a ``tokenizer_config.json`` with ``<|bos|>`` / ``<|eos|>`` (ids 0, 1).
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

SPECIAL = ["<|bos|>", "<|eos|>"]


def source_files(max_bytes: int) -> list[Path]:
    """The installation's ``.py`` files: the standard library's first, then site-packages', up to ``max_bytes``."""
    paths = sysconfig.get_paths()
    stdlib, purelib = Path(paths["stdlib"]), Path(paths["purelib"])
    ordered = sorted(p for p in stdlib.rglob("*.py") if purelib not in p.parents and "site-packages" not in p.parts)
    ordered += sorted(purelib.rglob("*.py"))
    chosen, total = [], 0
    for path in ordered:
        try:
            size = path.stat().st_size
        except OSError:
            continue
        if total + size > max_bytes:
            break
        chosen.append(path)
        total += size
    return chosen


def _texts(paths: list[Path]) -> Iterator[str]:
    for path in paths:
        try:
            yield path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue


def train(out: Path, vocab_size: int, max_mb: float) -> int:
    """Train and save the tokenizer into ``out``; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = source_files(int(max_mb * 1e6))
    if not files:
        raise SystemExit("no .py files found in this Python installation to train on")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_texts(files), trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL[0], "eos_token": SPECIAL[1]}))
    return tok.get_vocab_size()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--vocab-size", type=int, default=128256, help="at most this many tokens (default: Llama 3's)")
    parser.add_argument("--max-mb", type=float, default=200.0, help="megabytes of source text to train on")
    args = parser.parse_args(argv)
    if args.vocab_size < 256 + len(SPECIAL):
        parser.error(f"--vocab-size must be at least {256 + len(SPECIAL)} (the byte alphabet and the special tokens)")
    start = time.perf_counter()
    size = train(args.out, args.vocab_size, args.max_mb)
    print(f"{args.out}: a byte-level BPE tokenizer of {size} tokens in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
