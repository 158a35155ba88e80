"""The block-table staging of the CUDA-graph steps (runtime.cuda_graphs.TableStaging): each fill gives a compact
[rows, width] block, each row its table then zeros, over fills that grow, shrink and drop rows; and the staged inputs
(runtime.cuda_graphs.StagedInputs): views of one buffer, copied at once."""
import random

import torch

from runtime.cuda_graphs import TableStaging


def _expected(tables: list[list[int]], rows: int, width: int) -> torch.Tensor:
    out = torch.zeros(rows, width, dtype=torch.int32)
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
        block = staging.fill(tables, rows)
        width = max((len(t) for t in tables), default=0)
        assert block.shape == (rows, width) and block.is_contiguous()
        assert torch.equal(block, _expected(tables, rows, width)), f"fill {step}"


def test_row_past_a_shorter_table_is_zeroed():
    staging = TableStaging(2, 4, pin=False)
    staging.fill([[7, 8, 9, 10], [5]], 2)
    assert staging.fill([[3, 4]], 3).tolist() == [[3, 4], [0, 0], [0, 0]]
    assert staging.fill([], 2).shape == (2, 0)


def test_staged_inputs_are_views_of_one_buffer_copied_at_once():
    from runtime.cuda_graphs import StagedInputs

    inputs = StagedInputs({"longs": (torch.long, (3, 5)), "ints": (torch.int32, (2, 3)), "one": (torch.long, (1,))},
                          torch.device("cpu"), pin=False)
    g = torch.Generator().manual_seed(0)
    for turn in (0, 1, 0):
        host = inputs.host(turn)
        want = {name: torch.randint(-1000, 1000, view.shape, generator=g, dtype=view.dtype)
                for name, view in host.items()}
        for name, value in want.items():
            host[name].copy_(value)
        inputs.copy(turn)
        for name, value in want.items():
            assert inputs.device[name].dtype == value.dtype and torch.equal(inputs.device[name], value), name
