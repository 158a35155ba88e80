"""The structured-output mask kernel (kernels/token_mask.py) against runtime.sampling.apply_token_bitmask's torch
path, with fresh random logits and masks: under the Triton interpreter on CPU (CI), and compiled at a real
vocabulary on a GPU (run there with TRITON_INTERPRET=0)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton / kernels are imported

import pytest
import torch

from kernels.token_mask import masked_logits
from runtime.sampling import TokenBitmask, apply_token_bitmask

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
interpreter = pytest.mark.skipif(not INTERPRETING, reason="CPU tensors need the Triton interpreter")


def _bitmask(rows: int, vocab: int, density: float, gen: torch.Generator) -> torch.Tensor:
    allowed = torch.rand(rows, (vocab + 31) // 32 * 32, generator=gen) < density
    bits = (allowed.view(rows, (vocab + 31) // 32, 32).long() << torch.arange(32)).sum(-1)  # int64, bit 31 included
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)


@interpreter
@pytest.mark.parametrize("num_seqs,vocab,rows", [(1, 4096, [0]), (5, 1000, None), (6, 2085, [0, 3, 5]),
                                                 (3, 77, [2]), (4, 300, [])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_logits_match_the_torch_path(num_seqs, vocab, rows, dtype):
    gen = torch.Generator().manual_seed(num_seqs * 1000 + vocab)
    logits = (torch.randn(num_seqs, vocab + 3, generator=gen) * 4).to(dtype)[:, :vocab]  # strided rows
    masked_rows = list(range(num_seqs)) if rows is None else rows
    bitmask = _bitmask(len(masked_rows), vocab, 0.3, gen)
    before = logits.clone()
    want = apply_token_bitmask(logits, TokenBitmask(masked_rows, bitmask))  # CPU: the torch ops
    got = masked_logits(logits, bitmask, rows)
    assert got.dtype == logits.dtype and torch.equal(got, want)
    assert torch.equal(logits, before)  # a new tensor: the raw logits stay for logprobs
    if masked_rows:
        assert torch.isinf(got[masked_rows]).any() and torch.isfinite(got[masked_rows]).any()


@pytest.mark.skipif(INTERPRETING or not torch.cuda.is_available(), reason="needs a GPU, compiled")
@pytest.mark.parametrize("rows", [None, list(range(0, 64, 3))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_logits_on_the_gpu_at_a_real_vocabulary(rows, dtype):
    gen = torch.Generator().manual_seed(7)
    num_seqs, vocab = 64, 128256
    logits = (torch.randn(num_seqs, vocab, generator=gen) * 4).to(dtype)
    masked_rows = list(range(num_seqs)) if rows is None else rows
    bitmask = _bitmask(len(masked_rows), vocab, 0.05, gen)
    want = apply_token_bitmask(logits, TokenBitmask(masked_rows, bitmask))  # CPU: the torch ops
    got = masked_logits(logits.cuda(), bitmask.cuda(), rows)
    assert torch.equal(got.cpu(), want)


@interpreter
def test_a_bitmask_that_does_not_fit_is_refused():
    with pytest.raises(ValueError, match="int32"):
        masked_logits(torch.zeros(2, 100), torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="masked rows"):
        masked_logits(torch.zeros(2, 64), torch.zeros(1, 2, dtype=torch.int32))
