"""builder.pipeline: what the quantization passes' device copies leave on the host."""

from __future__ import annotations

import weakref

import torch

from builder.pipeline import params_to_host


def test_params_the_passes_kept_come_back_as_the_host_tensors_not_copies():
    host = {"experts": torch.randn(4, 8), "q.weight": torch.randn(8, 8), "norm": torch.randn(8)}
    copies = {k: v.clone() for k, v in host.items()}  # stands for the device copies
    moved = {k: weakref.ref(v) for k, v in copies.items()}
    quantized = torch.randint(-8, 8, (8, 8), dtype=torch.int8)
    after = {"experts": copies.pop("experts"), "norm": torch.zeros(8), "q.weight_codes": quantized}  # q.weight dropped
    del copies  # the replaced copies are gone: nothing but the passes' params held them
    assert moved["q.weight"]() is None and moved["norm"]() is None
    back = params_to_host(after, moved, host)
    assert back.keys() == after.keys()
    assert back["experts"] is host["experts"]  # kept: the host tensor, no copy
    assert torch.equal(back["norm"], torch.zeros(8)) and back["norm"] is not host["norm"]  # replaced by a pass
    assert back["q.weight_codes"] is quantized  # new, already on the host
