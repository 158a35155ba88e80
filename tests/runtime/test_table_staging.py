"""The block-table staging of the CUDA-graph steps (runtime.cuda_graphs.TableStaging): each fill leaves the buffer
as a full rewrite would, each row its table then zeros, over fills that grow, shrink and drop rows."""
import random

import torch

from runtime.cuda_graphs import TableStaging


def _expected(tables: list[list[int]], rows: int, max_blocks: int) -> torch.Tensor:
    out = torch.zeros(rows, max_blocks, dtype=torch.int32)
    for i, table in enumerate(tables):
        out[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
    return out


def test_fills_match_a_full_rewrite():
    rng = random.Random(3)
    top, max_blocks = 12, 9
    staging = TableStaging(top, max_blocks, pin=False)
    for step in range(200):
        n = rng.randint(0, top)
        rows = rng.randint(n, top)  # the bucket: padded rows after the tables
        tables = [[rng.randrange(1, 1 << 30) for _ in range(rng.randint(0, max_blocks))] for _ in range(n)]
        width = staging.fill(tables, rows)
        assert width == max((len(t) for t in tables), default=0)
        assert torch.equal(staging.tensor[:rows], _expected(tables, rows, max_blocks)), f"fill {step}"
        # rows past the bucket are left as they were; the next fill that reaches them zeroes what they hold


def test_row_past_a_shorter_table_is_zeroed():
    staging = TableStaging(2, 4, pin=False)
    staging.fill([[7, 8, 9, 10], [5]], 2)
    staging.fill([[3]], 2)
    assert staging.tensor.tolist() == [[3, 0, 0, 0], [0, 0, 0, 0]]
