"""The runtime: loads an engine artifact and generates. Imports nothing from builder/ or passes/.

Public names are imported lazily, so ``import runtime.executor`` stays light.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ArtifactError": "runtime.artifact",
    "open_artifact": "runtime.artifact",
    "Engine": "runtime.engine",
    "Generation": "runtime.engine",
    "RequestError": "runtime.engine",
    "SamplingParams": "runtime.sampling",
    "ServingConfig": "runtime.serving",
    "ServingEngine": "runtime.serving",
    "AsyncEngine": "runtime.async_engine",
    "RequestOutput": "runtime.outputs",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
