"""``kernels.gemv.dense_gemv`` (unquantized fp16/bf16/fp32 weights, 1-4 rows) against ``F.linear`` in fp32, under the
Triton interpreter on CPU; its gated form against ``silu_mul`` then the linear; and the executor's use of it."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton / kernels are imported

import pytest
import torch
import torch.nn.functional as F

from kernels import gemv
from kernels.activation import silu_mul
from kernels.gemv import GEMV_MAX_ROWS, GemvConfig, dense_gemv

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _inputs(rows: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int, gated: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 2 * k if gated else k, generator=g) * 2).to(dtype)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    b = (torch.randn(n, generator=g) * 0.1).to(dtype) if bias else None
    return x, w, b


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """fp32 products and sums, rounded once to x's dtype."""
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


def _assert_close(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert y.dtype == ref.dtype and y.shape == ref.shape
    tol = TOL[ref.dtype]
    torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max().item())


# ragged N and K (masked tiles), K over several steps and splits, every row count, each dtype, with and without bias
CASES = [(1, 96, 128, torch.float32, True), (2, 64, 96, torch.bfloat16, False), (3, 40, 200, torch.float16, True),
         (4, 128, 64, torch.float32, False), (1, 33, 257, torch.bfloat16, True), (4, 70, 160, torch.bfloat16, True)]


@pytest.mark.parametrize("rows,n,k,dtype,bias", CASES)
def test_dense_gemv_matches_linear(rows, n, k, dtype, bias):
    x, w, b = _inputs(rows, n, k, dtype, bias, seed=rows * 1000 + n + k)
    _assert_close(dense_gemv(x, w, b), _reference(x, w, b))


@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_dense_gemv_split_k(split_k):
    # K split across programs, the tile's last program adding the partials; the counters are left at zero
    x, w, b = _inputs(2, 48, 160, torch.float32, True, seed=7 + split_k)
    cfg = GemvConfig(16, 32, split_k=split_k, num_warps=1, num_stages=1)
    _assert_close(dense_gemv(x, w, b, config=cfg), _reference(x, w, b))
    assert int(gemv._tile_counters(x.device, 1).abs().sum()) == 0
    # a second launch over the same counters gives the same result
    _assert_close(dense_gemv(x, w, b, config=cfg), _reference(x, w, b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dense_gemv_gated_equals_silu_mul_then_linear(dtype):
    x, w, b = _inputs(1, 64, 96, dtype, False, seed=11, gated=True)
    x[0, :8] = torch.tensor([-30.0, -4.0, -0.5, 0.0, 0.5, 4.0, 30.0, 1e-3]).to(dtype)  # silu's tails and zero
    act = silu_mul(x)  # the SwiGLU kernel's rounding
    _assert_close(dense_gemv(x, w, b, gated=True), _reference(act, w, b))
    # the gated x is formed bit for bit as silu_mul forms it: with one input feature per output the results agree
    eye = torch.eye(96, dtype=dtype)
    assert torch.equal(dense_gemv(x, eye, gated=True), act)


def test_dense_gemv_leading_dims_and_empty():
    x, w, b = _inputs(4, 32, 64, torch.float32, True, seed=3)
    y = dense_gemv(x.reshape(2, 2, 64), w, b)
    assert y.shape == (2, 2, 32)
    _assert_close(y.reshape(4, 32), _reference(x, w, b))
    assert dense_gemv(x[:0], w, b).shape == (0, 32)


def test_dense_gemv_refuses_bad_input():
    x, w, b = _inputs(1, 32, 64, torch.float32, True, seed=5)
    with pytest.raises(ValueError, match="at most GEMV_MAX_ROWS"):
        dense_gemv(torch.randn(GEMV_MAX_ROWS + 1, 64), w)
    with pytest.raises(ValueError, match="input features"):
        dense_gemv(torch.randn(1, 63), w)
    with pytest.raises(ValueError, match="in x's dtype"):
        dense_gemv(x.to(torch.bfloat16), w)
    with pytest.raises(ValueError, match="bias"):
        dense_gemv(x, w, torch.zeros(31))
    with pytest.raises(ValueError, match="gated"):
        dense_gemv(x, w, gated=True)


def test_executor_runs_dense_linears_on_the_gemv(tmp_path, monkeypatch):
    """On the kernel path a one-row step's unquantized linears (lm_head included) run dense_gemv, each layer's down
    projection forming silu(gate) * up itself; more rows go to cuBLAS (F.linear); the logits match the reference
    path's either way."""
    from conftest import build_artifact, make_checkpoint
    from runtime import Engine

    path = build_artifact(make_checkpoint(tmp_path / "ckpt", "llama", num_attention_heads=2, num_key_value_heads=1),
                          tmp_path / "art")
    ref, fused = Engine.load(path, use_kernels=False), Engine.load(path, use_kernels=True)
    layers = fused.executor.num_layers
    assert len(fused.executor._fusions.gated) == layers
    calls, real = [], gemv.dense_gemv

    def spy(x, weight, bias=None, **kwargs):
        calls.append((x.numel() // x.shape[-1], kwargs.get("gated", False)))
        return real(x, weight, bias, **kwargs)

    monkeypatch.setattr(gemv, "dense_gemv", spy)
    ids = torch.randint(3, 300, (5,), generator=torch.Generator().manual_seed(4)).tolist()
    assert (fused.logits(ids[:1]) - ref.logits(ids[:1])).abs().max() < 1e-4
    num_linears = sum(1 for n in fused.executor.graph["nodes"] if n["op"] in ("linear", "lm_head"))
    assert len(calls) == num_linears and all(rows == 1 for rows, _ in calls), calls
    assert sum(g for _, g in calls) == layers
    calls.clear()
    assert (fused.logits(ids) - ref.logits(ids)).abs().max() < 1e-4
    assert not calls
    monkeypatch.setattr(gemv, "DENSE_RUNTIME_MAX_ROWS", 0)  # KERNELS_DENSE_GEMV_ROWS=0: cuBLAS at every size
    assert (fused.logits(ids[:1]) - ref.logits(ids[:1])).abs().max() < 1e-4
    assert not calls
