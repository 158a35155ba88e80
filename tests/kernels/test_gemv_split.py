"""How the GEMV kernels split K when their configuration leaves it to the launch: the per-kernel, per-device
programs-per-SM target and its environment override, and the per-device, per-weight-shape configurations (host-side
arithmetic; the kernels' sums are tested in test_dense_gemv.py and test_gemv.py)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton / kernels are imported, as in the other kernel tests

import pytest
import torch

from kernels import gemv

# Llama-3-8B's linears on the one-row dense config (16 output features x 512 input features per step): (N tiles,
# K steps) for qkv, o_proj, gate_up, down and the lm_head
SHAPES = {"qkv": (6144 // 16, 4096 // 512), "o_proj": (4096 // 16, 4096 // 512), "gate_up": (28672 // 16, 4096 // 512),
          "down": (4096 // 16, 14336 // 512), "lm_head": (128256 // 16, 4096 // 512)}


def _splits(target: float) -> dict[str, int]:
    return {name: gemv.auto_split_k(tiles, steps, target, 132) for name, (tiles, steps) in SHAPES.items()}


def test_two_programs_per_sm_splits_only_the_narrow_long_linears():
    # the H200 A/B (docs/BENCHMARKS.md, session 27): 2 per SM ran the bf16 step fastest, which leaves qkv whole and
    # halves o_proj's and down's K; 3 per SM also splits qkv, 1.5 splits nothing
    assert _splits(2) == {"qkv": 1, "o_proj": 2, "gate_up": 1, "down": 2, "lm_head": 1}
    assert _splits(3)["qkv"] == 2 and _splits(1.5) == dict.fromkeys(SHAPES, 1)
    assert _splits(4) == {"qkv": 2, "o_proj": 3, "gate_up": 1, "down": 3, "lm_head": 1}


def test_auto_split_leaves_no_program_without_work():
    for tiles in (1, 3, 64):
        for steps in range(1, 40):
            split = gemv.auto_split_k(tiles, steps, 4, 132)
            per = -(-steps // split)
            assert 1 <= split <= gemv._MAX_SPLIT_K and (split - 1) * per < steps, (tiles, steps, split)


def test_the_device_table_and_the_environment_pick_the_target(monkeypatch):
    cuda = torch.device("cuda", 0)  # a device object only: nothing runs on it
    monkeypatch.setattr(gemv, "_ENV_PROGRAMS_PER_SM", {})
    monkeypatch.setattr(gemv, "_device_name", lambda index: "NVIDIA H200")
    assert gemv.programs_per_sm("dense", cuda) == 2.0
    assert gemv.programs_per_sm("w8a8", cuda) == gemv._PROGRAMS_PER_SM  # measured level on the H200: the default
    monkeypatch.setattr(gemv, "_device_name", lambda index: "NVIDIA H100 80GB HBM3")
    assert gemv.programs_per_sm("dense", cuda) == gemv._PROGRAMS_PER_SM
    assert gemv.programs_per_sm("dense", torch.device("cpu")) == gemv._PROGRAMS_PER_SM
    monkeypatch.setattr(gemv, "_ENV_PROGRAMS_PER_SM", gemv._env_programs_per_sm("dense=3"))
    assert gemv.programs_per_sm("dense", cuda) == 3.0 and gemv.programs_per_sm("w4a16", cuda) == 4.0


@pytest.mark.parametrize("value, expected", [
    ("2", {"w4a16": 2.0, "w8a8": 2.0, "dense": 2.0}),
    ("dense=2,w8a8=3.5", {"dense": 2.0, "w8a8": 3.5}),
    ("", {}),
])
def test_programs_per_sm_setting_parses(value, expected):
    assert gemv._env_programs_per_sm(value) == expected


@pytest.mark.parametrize("value", ["two", "dense=0", "dense=-1", "gemm=2", "dense=2,", "=2"])
def test_a_bad_programs_per_sm_setting_names_what_is_allowed(value):
    with pytest.raises(ValueError, match="KERNELS_GEMV_PROGRAMS_PER_SM=.*KERNEL one of w4a16, w8a8, dense"):
        gemv._env_programs_per_sm(value)


def test_every_split_config_has_a_target():
    # _split_plan serves the GEMVs' GemvConfig and kernels.w4a16_mma's MmaConfig (which has no target of its own)
    from kernels.w4a16_mma import MmaConfig

    assert gemv.split_target(MmaConfig(block_n=64)) == gemv._PROGRAMS_PER_SM
    assert gemv.split_target(gemv.GemvConfig(16, 512)) == gemv._PROGRAMS_PER_SM
    assert gemv.split_target(gemv.GemvConfig(16, 512, programs_per_sm=2.0)) == 2.0


def test_the_shape_tables_apply_on_their_device_up_to_their_rows(monkeypatch):
    """The per-device, per-weight-shape configurations (``kernels.w4a16_frag._SHAPE_CONFIGS``,
    ``gemv._W8A8_SHAPE_CONFIGS``) replace the rows' table only on that device, for those shapes, up to their rows,
    and not with KERNELS_SHAPE_CONFIGS=0."""
    from kernels import w4a16_frag
    from kernels.w4a16_frag import FragConfig, default_frag_config

    cuda = torch.device("cuda", 0)  # a device object only: nothing runs on it
    monkeypatch.setattr(gemv, "_interpreting", lambda: False)
    monkeypatch.setattr(w4a16_frag, "_ENV_CONFIG", None)
    monkeypatch.setattr(gemv, "_device_name", lambda index: "NVIDIA H200")
    auto = w4a16_frag._CUDA_CONFIGS[-1][1]
    gate_up_8bit = (1, cuda, 28672, 4096, 8)
    assert default_frag_config(*gate_up_8bit) == FragConfig(warps=4, split_k=4, depth=1) != auto
    assert default_frag_config(w4a16_frag.SHAPE_CONFIG_MAX_ROWS, cuda, 28672, 4096, 8) != auto
    assert default_frag_config(w4a16_frag.SHAPE_CONFIG_MAX_ROWS + 1, cuda, 28672, 4096, 8) == auto
    assert default_frag_config(1, cuda, 28672, 4096, 4) == auto  # 4-bit gate_up: not in the table
    assert default_frag_config(1, cuda, 28672, 2048, 8) == auto  # another shape
    assert default_frag_config(1, torch.device("cpu"), 28672, 4096, 8) == auto
    fp8_down = gemv.shape_config(gemv._W8A8_SHAPE_CONFIGS, (4096, 14336), cuda)
    assert fp8_down is not None and fp8_down.programs_per_sm == 2.0
    monkeypatch.setattr(gemv, "SHAPE_CONFIGS", False)  # KERNELS_SHAPE_CONFIGS=0
    assert default_frag_config(*gate_up_8bit) == auto
    assert gemv.shape_config(gemv._W8A8_SHAPE_CONFIGS, (4096, 14336), cuda) is None
    monkeypatch.setattr(gemv, "SHAPE_CONFIGS", True)
    monkeypatch.setattr(gemv, "_device_name", lambda index: "NVIDIA H100 80GB HBM3")
    assert default_frag_config(*gate_up_8bit) == auto
    assert gemv.shape_config(gemv._W8A8_SHAPE_CONFIGS, (4096, 14336), cuda) is None
