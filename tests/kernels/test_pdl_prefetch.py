"""The L2 prefetch plans of kernels.pdl: how many rows and lines a GEMV program asks for before its PDL wait.

The prefetch itself only runs compiled on a GPU (``prefetch.global.L2``; compiled for sm_90 by
``kernels.bench.compile_sm90``'s "range prefetch" variants); these check the host-side sizes against the
weights each program reads, with the budgets set as the environment would set them.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton / kernels are imported (as the kernels' tests)

import pytest

from kernels import pdl


@pytest.fixture
def budget(monkeypatch):
    """Set the first-tile budget (lines) and the range budget (lines) as KERNELS_PREFETCH_KB / _RANGE_KB would."""
    def set_budget(first_lines: int, range_lines: int) -> None:
        monkeypatch.setattr(pdl, "PREFETCH", True)
        monkeypatch.setattr(pdl, "MAX_PREFETCH_LINES", first_lines)
        monkeypatch.setattr(pdl, "RANGE_LINES", range_lines)
    return set_budget


def test_first_tile_plan_without_a_range_budget(budget):
    budget(256, 0)
    # 16 rows x 1 KB (8 lines a row): the whole first tile, 128 lines
    assert pdl.prefetch_rows_plan(16, 1024) == (16, 8)
    # 64 rows x 4 KB: 32 lines a row, so 8 rows fit in 256 lines
    assert pdl.prefetch_rows_plan(64, 4096) == (8, 32)
    # the range is ignored while its budget is 0
    assert pdl.prefetch_rows_plan(16, 1024, 8192) == (16, 8)
    assert pdl.range_lines(8192, 8) == 0


def test_range_plan_covers_every_step_within_its_budget(budget):
    budget(256, 2048)  # 256 KB
    # 16 rows, 4 steps of 1 KB a row: 32 lines a row, 512 lines, within 2,048
    assert pdl.prefetch_rows_plan(16, 1024, 4096) == (16, 32)
    # 16 rows, 64 KB a row: 512 lines a row would be 8,192; the budget leaves 128 a row
    assert pdl.prefetch_rows_plan(16, 1024, 65536) == (16, 128)
    # a range no longer than the first tile keeps the first-tile plan
    assert pdl.prefetch_rows_plan(16, 1024, 1024) == (16, 8)
    # a budget below the first tile's lines keeps the first-tile plan
    budget(256, 64)
    assert pdl.prefetch_rows_plan(16, 1024, 65536) == (16, 8)


def test_range_lines_round_up_to_a_power_of_two_within_the_budget(budget):
    budget(256, 2048)
    # 8 tiles of 3 KB: 24 lines each, rounded up to 32
    assert pdl.range_lines(3 * 1024, 8) == 32
    # 8 tiles of 64 KB: 512 lines each would be 4,096; 2,048 over 8 rows leaves 256
    assert pdl.range_lines(64 * 1024, 8) == 256
    # a budget that does not divide by the rows rounds down to a power of 2 (2,048 / 24 -> 64)
    assert pdl.range_lines(64 * 1024, 24) == 64
    assert pdl.range_lines(0, 8) == 0


def test_bad_budget_names_the_variable():
    # in a child process: reloading kernels.pdl here would leave the interpreter's kernels on stale jit functions
    env = dict(os.environ, KERNELS_PREFETCH_RANGE_KB="lots")
    done = subprocess.run([sys.executable, "-c", "import kernels.pdl"], env=env, capture_output=True, text=True,
                          cwd=pathlib.Path(__file__).resolve().parents[2])
    assert done.returncode != 0
    assert "KERNELS_PREFETCH_RANGE_KB='lots' is not a whole number of kilobytes" in done.stderr
