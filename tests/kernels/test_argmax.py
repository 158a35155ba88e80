"""Greedy decoding's argmax kernel (kernels/argmax.py) against torch.argmax with fresh random logits: ties across
and within chunks, rows of -inf, NaN rows and strided rows, under the Triton interpreter on CPU (CI) and compiled
at a real vocabulary on a GPU (run there with TRITON_INTERPRET=0); and ``sample`` taking it for all-greedy rows."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton / kernels are imported

import pytest
import torch

from kernels.argmax import _BLOCK, greedy_argmax, ref_greedy_argmax

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETING else "cuda"
if not INTERPRETING and not torch.cuda.is_available():
    pytest.skip("compiled Triton needs CUDA (or TRITON_INTERPRET=1)", allow_module_level=True)
INVALID = -7


@pytest.mark.parametrize("num_seqs,vocab", [(1, 3 * _BLOCK + 17), (4, 1000), (3, _BLOCK), (2, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_matches_torch(num_seqs, vocab, dtype):
    gen = torch.Generator().manual_seed(num_seqs * 100 + vocab)
    logits = (torch.randn(num_seqs, vocab + 5, generator=gen) * 3).to(dtype)[:, :vocab]  # strided rows
    if vocab > 8:
        # row 0: the maximum twice, in different chunks when there are several (the first must win)
        top = logits[0].float().max().item() + 1.0
        logits[0, vocab // 3] = top
        logits[0, vocab - 2] = top
    want = ref_greedy_argmax(logits, INVALID)
    got = greedy_argmax(logits.to(DEVICE), INVALID).cpu()
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert torch.equal(want, torch.argmax(logits.float(), dim=-1))  # no NaN here: plain argmax


def test_nan_rows_are_invalid_and_inf_rows_pick_the_first():
    gen = torch.Generator().manual_seed(5)
    vocab = 2 * _BLOCK + 3
    logits = torch.randn(4, vocab, generator=gen)
    logits[1, _BLOCK + 9] = float("nan")  # a NaN in the second chunk only
    logits[2] = float("-inf")  # nothing allowed: torch gives index 0
    logits[3, 7] = float("inf")
    logits[3, _BLOCK + 1] = float("inf")
    got = greedy_argmax(logits.to(DEVICE), INVALID).cpu()
    assert got.tolist() == [int(torch.argmax(logits[0])), INVALID, 0, 7]
    assert torch.equal(got, ref_greedy_argmax(logits, INVALID))
    small = logits[:, :_BLOCK // 2 + 9].clone()  # one chunk: the one-launch kernel, the same rules
    small[1, _BLOCK // 2 + 1] = float("nan")
    small[3, _BLOCK // 2 + 1] = float("inf")
    got = greedy_argmax(small.to(DEVICE), INVALID).cpu()
    assert got.tolist() == [int(torch.argmax(small[0])), INVALID, 0, 7]
    assert torch.equal(got, ref_greedy_argmax(small, INVALID))


@pytest.mark.skipif(INTERPRETING, reason="sample() takes the kernel on CUDA logits only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sample_takes_the_kernel_for_greedy_rows(dtype):
    from runtime.sampling import INVALID_TOKEN, SamplingParams, sample

    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn(3, 128256, generator=gen) * 4).to(dtype)  # bf16: read as it is, no fp32 copy first
    logits[1, 5] = float("nan")
    for use_kernels in (True, False):  # the kernel, or torch's argmax and NaN check: the same tokens
        got = sample(logits.cuda(), [SamplingParams()] * 3, [None] * 3, use_kernels=use_kernels).cpu()
        assert torch.equal(got, ref_greedy_argmax(logits, INVALID_TOKEN))
    # with a penalty the logits change first: the kernel then reads the penalised fp32 rows, as torch's path does
    params = [SamplingParams(repetition_penalty=1.5)] * 3
    history = [[int(torch.argmax(logits[i].float().nan_to_num(-1e9)))] for i in range(3)]
    want = sample(logits.cuda(), params, [None] * 3, history, [[]] * 3, use_kernels=False).cpu()
    got = sample(logits.cuda(), params, [None] * 3, history, [[]] * 3, use_kernels=True).cpu()
    assert torch.equal(got, want)
    assert got[0] != history[0][0] or got[2] != history[2][0]  # the penalty moved a row's argmax


def test_rejects_non_float_logits():
    with pytest.raises(ValueError, match="float logits"):
        greedy_argmax(torch.zeros(2, 3, dtype=torch.int32, device=DEVICE), INVALID)
