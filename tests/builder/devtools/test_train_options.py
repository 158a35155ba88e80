"""The trainers' options for training elsewhere: the standard library packed here and read there, the model's size
from the command line, a tokenizer reused as is."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from builder.devtools import train_bundled as tb


def test_packed_stdlib_unpacks_to_the_same_corpus(tmp_path: Path) -> None:
    """``--pack-stdlib`` writes exactly the files the corpus reads (no tests, no IDLE, no generated sysconfig data,
    no other files), and a directory unpacked from it gives the same corpus and split."""
    root = tmp_path / "lib"
    files = {"os.py": "import sys\n", "json/decoder.py": "x = 1\n", "test/test_os.py": "skip\n",
             "idlelib/run.py": "skip\n", "_sysconfigdata_x.py": "skip\n", "README.txt": "not python\n",
             "email/mime/text.py": "'''ü'''\n"}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    out = tmp_path / "stdlib.tar.gz"
    assert tb.pack_stdlib(root, out) == 3
    with tarfile.open(out) as tar:
        assert sorted(tar.getnames()) == ["email/mime/text.py", "json/decoder.py", "os.py"]
        assert all(m.mtime == 0 for m in tar.getmembers())
        tar.extractall(tmp_path / "there", filter="data")
    here, _ = tb.collect_stdlib_files(root)
    there, _ = tb.collect_stdlib_files(tmp_path / "there")
    assert here == there and tb.split_files(here) == tb.split_files(there)


def test_size_options_and_tokenizer_reuse(tmp_path: Path) -> None:
    """The size options replace the default spec's fields (the rest stays); ``--tokenizer`` reads tokenizer.json
    before the output directory is cleared, and a directory without one is refused by name."""
    args = tb.parse_args(["--out", str(tmp_path / "m"), "--hidden-size", "384", "--intermediate-size", "1024",
                          "--layers", "6", "--heads", "6", "--head-dim", "64", "--device", "cuda"])
    spec = tb.model_spec_from_args(args, tb.ModelSpec())
    assert (spec.hidden_size, spec.intermediate_size, spec.num_hidden_layers, spec.num_attention_heads,
            spec.num_key_value_heads, spec.head_dim) == (384, 1024, 6, 6, 2, 64)
    assert spec.rope_theta == tb.ModelSpec.rope_theta and args.device == "cuda"
    assert tb.load_tokenizer(args) is None
    bundled = Path(__file__).resolve().parents[3] / "models" / "pystdlib-llama"
    tok = tb.load_tokenizer(tb.parse_args(["--tokenizer", str(bundled)]))
    assert tok.get_vocab_size() == 4096 and tok.token_to_id(tb.BOS_TOKEN) == 0
    with pytest.raises(SystemExit, match="no tokenizer.json"):
        tb.load_tokenizer(tb.parse_args(["--tokenizer", str(tmp_path)]))
