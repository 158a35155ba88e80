"""The artifact writer's weight file: written one tensor at a time and hashed as it is written, each tensor's data
aligned to its element size."""

from __future__ import annotations

import json
import struct

import torch
from safetensors.torch import load_file

from builder.artifact import _write_weights
from passes.ir import Graph
from runtime.artifact import WEIGHTS, file_sha256


def test_weight_file_is_hashed_as_written_and_aligned(tmp_path):
    g = torch.Generator().manual_seed(0)
    params = {  # names in an order that would misalign the wider tensors if written as given
        "a.codes": torch.randint(-8, 8, (3, 5), generator=g, dtype=torch.int8),  # 15 bytes
        "b.scale": torch.rand(7, generator=g, dtype=torch.float32),
        "c.fp8": torch.randn(9, generator=g).to(torch.float8_e4m3fn),
        "d.weight": torch.randn(6, 4, generator=g).to(torch.bfloat16),
        "e.table": torch.randn(5, generator=g, dtype=torch.float64),
    }
    section, hashes = _write_weights(tmp_path, Graph([], ["input_ids", "positions"], ["logits"], params))
    assert hashes == {WEIGHTS: file_sha256(tmp_path / WEIGHTS)}
    assert section == {"files": [WEIGHTS], "num_tensors": 5,
                       "bytes": sum(t.numel() * t.element_size() for t in params.values())}
    written = load_file(tmp_path / WEIGHTS)
    assert written.keys() == params.keys()
    assert all(torch.equal(written[n].view(torch.uint8), params[n].view(torch.uint8)) for n in params)
    raw = (tmp_path / WEIGHTS).read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    for name, t in params.items():
        assert header[name]["data_offsets"][0] % t.element_size() == 0, (name, header[name])
