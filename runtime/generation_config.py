"""The sampling defaults a checkpoint ships in its ``generation_config.json``.

The server applies them to requests that leave a field out, as vLLM does: the fields vLLM takes from the
file (temperature, top_p, top_k, min_p, repetition_penalty), only those the file sets. ``do_sample`` is
not read (vLLM does not either): a file that sets a temperature means it. The values are validated here,
when the server starts, so a bad one stops the start-up with a message naming the file, the field and
what is allowed, instead of failing requests later.
"""

from __future__ import annotations

import json
from pathlib import Path

from runtime.sampling import SamplingError, SamplingParams

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class GenerationConfigError(ValueError):
    """A generation_config.json that cannot be read, or that sets a sampling field to a value not allowed."""


def sampling_defaults(path: Path | None) -> dict[str, float | int]:
    """The sampling fields (of SAMPLING_FIELDS) that the generation_config.json at ``path`` sets, checked
    against SamplingParams' ranges; {} when ``path`` is None or no such file exists. A field set to null
    counts as not set."""
    if path is None or not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # UnicodeDecodeError, JSONDecodeError, 5,000-digit ints
        raise GenerationConfigError(f"{path}: cannot read it as JSON ({type(e).__name__}: {str(e)[:200]}); fix or "
                                    f"remove the file") from None
    if not isinstance(config, dict):
        raise GenerationConfigError(f"{path}: a JSON object is expected, got {type(config).__name__}; "
                                    f"fix or remove the file")
    defaults = {name: config[name] for name in SAMPLING_FIELDS if config.get(name) is not None}
    try:
        SamplingParams(**defaults)
    except SamplingError as e:
        raise GenerationConfigError(f"{path}: {e}; fix the field or remove it from the file") from None
    return defaults
