"""Runtime settings read from the environment (``RUNTIME_*`` variables): one parser, one kind of message."""

from __future__ import annotations

import os


def env_number(name: str, default: int | float | None, kind: type = int, error: type[Exception] = ValueError):
    """``kind(os.environ[name])``, or ``default`` when it is unset; a value that does not parse raises ``error``
    naming the variable, its value and what is expected."""
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return kind(value)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        example = f" (e.g. {default})" if default is not None else ""
        raise error(f"{name}={value!r} is not {what}{example}") from None
