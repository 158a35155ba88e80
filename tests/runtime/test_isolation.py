"""The runtime stands alone: no builder/passes imports, no transformers/onnx/modelopt needed."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"
FORBIDDEN = ("builder", "passes", "transformers", "onnx", "modelopt")


def test_runtime_sources_import_nothing_forbidden():
    for f in RUNTIME.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for n in names:
                assert n.split(".")[0] not in FORBIDDEN, f"{f.name} imports {n}"


def test_runtime_generates_with_build_packages_blocked(artifacts):
    """Load and generate in a fresh interpreter where importing a build-only package fails."""
    code = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {FORBIDDEN!r}:
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
from runtime import Engine, SamplingParams
out = Engine.load({str(artifacts['qwen2'])!r}).generate('def', SamplingParams(max_tokens=5, ignore_eos=True))
assert len(out.token_ids) == 5
print('ok')
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=RUNTIME.parent)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"
