"""Build tiny random artifacts of the families ``tests/passes/test_families.py`` covers, for a CUDA check.

    python -m builder.devtools.family_artifacts OUT_DIR [--dtype float32|bfloat16] [--only phi3 stablelm ...]
        [--head-dim 32]
    python -m builder.devtools.cuda_smoke OUT_DIR/*       # on the device: CPU vs CUDA greedy tokens

Each family's checkpoint is the test's (fp32, 2 layers, hidden 64, seeded), built with the default passes
(verify included) into ``OUT_DIR/MODEL_TYPE``; the CUDA serving path then runs them against the CPU path. The
tests' head_dim of 16 has no paged-attention kernel (the serving path refuses it); ``--head-dim`` (32, 64, 128 or
256) sets it in every family's config, so that the CUDA serving path runs the attention kernels.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--only", nargs="*", help="model_types to build (default: every supported family)")
    parser.add_argument("--head-dim", type=int, choices=[32, 64, 128, 256],
                        help="head_dim in every family's config (default: the tests' 16)")
    args = parser.parse_args()
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "passes")]
    from conftest import build_artifact, save_tokenizer
    from test_families import SUPPORTED, make_family_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        tok = Path(tmp) / "tokenizer"
        save_tokenizer(tok)
        for family in SUPPORTED:
            if args.only and family.model_type not in args.only:
                continue
            ckpt = Path(tmp) / family.model_type
            if args.head_dim:
                family = dataclasses.replace(family, config={**family.config, "head_dim": args.head_dim})
            make_family_checkpoint(ckpt, family, tok)
            out = build_artifact(ckpt, args.out / family.model_type, dtype=args.dtype)
            print(f"{family.name}: {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
