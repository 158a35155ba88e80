"""runtime.generation_config: the sampling defaults a checkpoint's generation_config.json sets, checked when read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.generation_config import SAMPLING_FIELDS, GenerationConfigError, sampling_defaults


def write(tmp_path: Path, config) -> Path:
    path = tmp_path / "generation_config.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return path


def test_only_the_sampling_fields_the_file_sets(tmp_path):
    path = write(tmp_path, {"bos_token_id": 0, "eos_token_id": [1, 6], "do_sample": True, "temperature": 0.6,
                            "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05, "max_new_tokens": 100,
                            "min_p": None})
    assert sampling_defaults(path) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05}
    full = {"temperature": 1, "top_p": 1, "top_k": 0, "min_p": 0.05, "repetition_penalty": 1.0}
    assert sampling_defaults(write(tmp_path, full)) == full and set(full) == set(SAMPLING_FIELDS)


def test_no_file_no_defaults(tmp_path):
    assert sampling_defaults(None) == {}
    assert sampling_defaults(tmp_path / "generation_config.json") == {}
    assert sampling_defaults(write(tmp_path, {"eos_token_id": 1})) == {}


@pytest.mark.parametrize("field, value, allowed", [
    ("temperature", "x", "in [0, 100]"),
    ("temperature", -0.5, "in [0, 100]"),
    ("top_p", 0, "in (0, 1]"),
    ("top_k", 40.0, "an int >= 0"),
    ("top_k", -1, "an int >= 0"),
    ("min_p", 1.5, "in [0, 1)"),
    ("repetition_penalty", 0, "in [0.01, 100]"),
    ("repetition_penalty", True, "in [0.01, 100]"),
])
def test_a_bad_value_names_the_file_the_field_and_what_is_allowed(tmp_path, field, value, allowed):
    path = write(tmp_path, {"temperature": 0.7, field: value})
    with pytest.raises(GenerationConfigError) as info:
        sampling_defaults(path)
    message = str(info.value)
    assert message.startswith(f"{path}: {field}: {value!r}") and allowed in message and "remove" in message


@pytest.mark.parametrize("text, what", [("{not json", "cannot read it as JSON"), ("[0.7]", "a JSON object is expected"),
                                        (b"\xff\xfe", "cannot read it as JSON"),
                                        ("[" * 100_000 + "]" * 100_000, r"cannot read it as JSON \(RecursionError"),
                                        ('{"x": ' + "9" * 5000 + "}", r"cannot read it as JSON \(ValueError")])
def test_an_unreadable_file_is_an_error(tmp_path, text, what):
    path = tmp_path / "generation_config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(GenerationConfigError, match=what):
        sampling_defaults(path)
