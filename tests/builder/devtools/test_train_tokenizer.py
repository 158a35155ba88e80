"""`python -m builder.devtools.train_tokenizer`: a byte-level BPE tokenizer from the installation's source."""

from __future__ import annotations

import json

import pytest

from builder.devtools import train_tokenizer
from runtime.tokenizer import Tokenizer


def test_a_small_tokenizer_round_trips_json(tmp_path):
    assert train_tokenizer.main([str(tmp_path / "tok"), "--vocab-size", "600", "--max-mb", "2"]) == 0
    tok = Tokenizer.from_dir(tmp_path / "tok")
    assert tok.vocab_size == 600
    text = '{"records": [{"id": 1, "name": "a.txt"}]}'
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and len(ids) < len(text)  # merges learned from the source
    assert json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())["eos_token"] == "<|eos|>"


def test_a_vocabulary_below_the_bytes_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        train_tokenizer.main([str(tmp_path / "tok"), "--vocab-size", "100"])
