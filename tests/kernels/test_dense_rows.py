"""``kernels.dense_rows.dense_rows`` (unquantized fp16/bf16/fp32 weights, 3-16 rows, on the tensor cores) against
``F.linear`` in fp32, under the Triton interpreter on CPU; its gated form against ``silu_mul`` then the linear; the
executor's choice of it; and, on a GPU, the Llama-3-8B shapes."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton / kernels are imported

import pytest
import torch
import torch.nn.functional as F

from kernels import dense_rows as dr
from kernels import gemv
from kernels.activation import silu_mul
from kernels.gemv import GemvConfig

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _inputs(rows: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int, gated: bool = False,
            device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 2 * k if gated else k, generator=g) * 2).to(dtype)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    b = (torch.randn(n, generator=g) * 0.1).to(dtype) if bias else None
    return x.to(device), w.to(device), None if b is None else b.to(device)


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """fp32 products and sums, rounded once to x's dtype."""
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


def _assert_close(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert y.dtype == ref.dtype and y.shape == ref.shape
    tol = TOL[ref.dtype]
    torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max().item())


# ragged N and K (masked tiles), K over several steps and splits, row counts 3-16, each dtype, with and without bias
CASES = [(3, 40, 200, torch.float16, True), (5, 64, 96, torch.bfloat16, False), (8, 96, 128, torch.float32, True),
         (16, 33, 257, torch.bfloat16, True), (12, 70, 160, torch.float32, False)]


@pytest.mark.parametrize("rows,n,k,dtype,bias", CASES)
def test_dense_rows_matches_linear(rows, n, k, dtype, bias):
    x, w, b = _inputs(rows, n, k, dtype, bias, seed=rows * 1000 + n + k)
    _assert_close(dr.dense_rows(x, w, b), _reference(x, w, b))


@pytest.mark.parametrize("split_k", [1, 3])
def test_split_k_sums_in_the_kernel_and_leaves_the_counters_at_zero(split_k):
    x, w, b = _inputs(6, 48, 160, torch.float32, True, seed=7 + split_k)
    cfg = GemvConfig(16, 32, split_k=split_k, num_warps=1, num_stages=1)
    for _ in range(2):  # a second launch over the same counters gives the same result
        _assert_close(dr.dense_rows(x, w, b, config=cfg), _reference(x, w, b))
        assert int(gemv._tile_counters(x.device, 4).abs().sum()) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gated_forms_the_swiglu_in_its_loads(dtype):
    x, w, b = _inputs(5, 48, 64, dtype, False, seed=3, gated=True)
    _assert_close(dr.dense_rows(x, w, gated=True), _reference(silu_mul(x), w, None))


def test_bad_inputs_are_refused():
    x, w, _ = _inputs(17, 16, 32, torch.float32, False, seed=1)
    with pytest.raises(ValueError, match="at most 16 rows"):
        dr.dense_rows(x, w)
    with pytest.raises(ValueError, match="x has 32 input features; the weight takes 16"):
        dr.dense_rows(x[:4], w[:, :16])
    with pytest.raises(ValueError, match="in x's dtype"):
        dr.dense_rows(x[:4], w.to(torch.bfloat16))


def test_the_executor_sends_it_three_to_runtime_max_rows(monkeypatch):
    """An unquantized linear on the kernel path: 1-2 rows on the GEMV, 3..RUNTIME_MAX_ROWS here, more on cuBLAS."""
    from runtime import executor

    calls = []
    monkeypatch.setattr(gemv, "dense_gemv", lambda x, *a, **k: calls.append(("gemv", x.shape[0])) or x[:, :8])
    monkeypatch.setattr(dr, "dense_rows", lambda x, *a, **k: calls.append(("rows", x.shape[0])) or x[:, :8])
    monkeypatch.setattr(executor.ops, "linear", lambda x, *a, **k: calls.append(("cublas", x.shape[0])) or x[:, :8])
    linear = executor._kernel_dense_linear(torch.zeros(8, 16), None)
    for rows in (1, 2, 3, 16, 17):
        linear(torch.zeros(rows, 16))
    assert calls == [("gemv", 1), ("gemv", 2), ("rows", 3), ("rows", 16), ("cublas", 17)]
    monkeypatch.setattr(dr, "RUNTIME_MAX_ROWS", 0)  # KERNELS_DENSE_ROWS_MAX=0: cuBLAS
    calls.clear()
    linear(torch.zeros(3, 16))
    assert calls == [("cublas", 3)]


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs CUDA, the kernel compiled")
@pytest.mark.parametrize("rows", [3, 5, 8, 16])
@pytest.mark.parametrize("n,k,gated", [(6144, 4096, False), (4096, 4096, False), (28672, 4096, False),
                                       (4096, 14336, True), (128256, 4096, False)])
def test_on_cuda_at_the_8b_shapes(rows, n, k, gated):
    x, w, b = _inputs(rows, n, k, torch.bfloat16, False, seed=rows + n, gated=gated, device="cuda")
    ref = _reference(silu_mul(x) if gated else x, w, None)
    _assert_close(dr.dense_rows(x, w, gated=gated), ref)
