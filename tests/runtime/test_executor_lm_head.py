"""The executor's lm_head, quantized (`quantization.lm_head`): the Triton kernel path (W4A16 on the tensor-core
kernel where it takes the group size, else the GEMV / GEMM; W8A8 INT8 and FP8) equals the torch reference path on
the rows ``logits_indices`` selects; zero rows launch nothing. On CPU the kernels run under TRITON_INTERPRET=1."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from builder.checkpoint import attach_weights, open_checkpoint  # noqa: E402
from passes import PassContext, run_passes  # noqa: E402
from passes.trace import trace  # noqa: E402
from runtime.executor import Executor, SeqSlice, StepInput  # noqa: E402
from runtime.kv_cache import SequenceKV  # noqa: E402

FUSED = ["merge_qkv", "merge_gate_up", "fuse_silu_mul", "fuse_add_rms_norm", "dce"]


@pytest.fixture(scope="module")
def graph(checkpoints):
    ckpt = open_checkpoint(checkpoints["qwen2"])
    graph, meta_model = trace(ckpt.hf_config())
    attach_weights(graph, ckpt, meta_model, torch.float32)
    graph, _ = run_passes(graph, FUSED, PassContext())
    return graph


@pytest.mark.parametrize("algo,options,machinery", [
    ("gptq", {"group_size": 16}, "_kernel_weight_only_linear"),  # the K-major GEMV / GEMM
    ("gptq", {"group_size": 32}, "_kernel_weight_only_linear"),  # kernels.w4a16_mma
    ("smoothquant", {}, "_kernel_w8a8_linear"),
    ("fp8", {"weight_granularity": "channel"}, "_kernel_w8a8_linear"),
])
def test_quantized_lm_head_on_the_kernels(graph, monkeypatch, algo, options, machinery):
    from runtime import executor

    g = torch.Generator().manual_seed(0)
    calib = [torch.randint(3, 300, (32,), generator=g).tolist() for _ in range(4)]
    ctx = PassContext(calibration=calib, options={algo: {**options, "lm_head": True, "ignore": ["re:."]}})
    quantized, _ = run_passes(graph.copy(), [algo, "dce"], ctx)
    built, real = [], getattr(executor, machinery)

    def spy(w, *args, **kwargs):
        built.append(w["qweight"].shape[0])
        return real(w, *args, **kwargs)

    def never(*args, **kwargs):
        raise AssertionError("a quantized lm_head was dequantized into a [vocab, hidden] temporary")

    from kernels import w4a16_mma

    monkeypatch.setattr(executor, machinery, spy)
    # past MMA_RUNTIME_MAX_ROWS an lm_head runs the kernel in slices of MMA_MAX_ROWS rows, never dequantized
    monkeypatch.setattr(w4a16_mma, "_KERNEL_ALWAYS_ROWS", 4)
    monkeypatch.setattr(w4a16_mma, "MMA_RUNTIME_MAX_ROWS", 4)
    monkeypatch.setattr(w4a16_mma, "MMA_MAX_ROWS", 8)
    monkeypatch.setattr(w4a16_mma, "dequantize_mma", never)
    ref, fused = Executor(quantized.to_dict(), quantized.params), Executor(quantized.to_dict(), quantized.params,
                                                                            use_kernels=True)
    vocab = quantized.meta["vocab_size"]
    assert built == [vocab]  # the lm_head (and no linear: ignored) was compiled onto the linears' kernels
    head = len(ref._program) - 1
    ids = torch.randint(3, 300, (24,), generator=g)
    env = ref.start(StepInput(ids, torch.arange(24), [SeqSlice(SequenceKV(ref.kv_layout(), 24), 0, 24)]))
    ref.run_nodes(env, 0, head)
    x = env[quantized.nodes[-1].inputs[0]]  # [24, hidden]: the final norm's output
    step = env["__step__"]
    # one row (decode: the GEMV), a few (the fused GEMM), a prefill chunk (W8A8: past the fused kernel's rows),
    # none (a tensor-parallel worker)
    for rows in ([17], [5, 17, 2], list(range(20)), []):
        step.inp.logits_indices = torch.tensor(rows, dtype=torch.long)
        want, got = ref._program[head][0]([x], step)[0], fused._program[head][0]([x], step)[0]
        assert got.shape == want.shape == (len(rows), vocab) and got.dtype == torch.float32
        if rows:
            assert torch.allclose(got, want, atol=1e-4 * want.abs().max()), (got - want).abs().max()


@pytest.mark.parametrize("scheme", ["fp8", "w8a8_int8"])
def test_w8a8_rows_past_the_fused_kernel_with_unaligned_outputs(monkeypatch, scheme):
    """cuBLAS's _scaled_mm / _int_mm take no weight dimension that is not a multiple of 16 / 8 (a vocabulary of 32001
    tokens): such a W8A8 linear runs a Triton GEMM past FUSED_MAX_ROWS rows too (the rows GEMM, kernels.w8a8_rows,
    where it applies: INT8 here; FP8 on bf16 / fp16 rows only, and this executor is fp32; the fused GEMM past it),
    and equals the reference."""
    from kernels import w8a8_gemm, w8a8_rows
    from kernels.torch_quant import make_quant_linear, quantize_weight_fp8, quantize_weight_int8
    from runtime import executor

    g = torch.Generator().manual_seed(4)
    weight = torch.randn(36, 64, generator=g) * 0.1  # 36 outputs: not a multiple of 8 (nor 16)
    codes, scale = quantize_weight_fp8(weight, True) if scheme == "fp8" else quantize_weight_int8(weight)
    w, quant = {"qweight": codes, "weight_scale": scale}, {"scheme": scheme}
    calls, real = [], w8a8_gemm.w8a8_linear

    def spy(x, *args, **kwargs):
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(w8a8_gemm, "w8a8_linear", spy)
    linear = executor._kernel_w8a8_linear(w, quant, type("Ex", (), {"dtype": torch.float32})())
    rows_calls, real_rows = [], w8a8_rows.w8a8_rows_linear

    def spy_rows(codes, *args, **kwargs):
        rows_calls.append(codes.shape[0])
        return real_rows(codes, *args, **kwargs)

    monkeypatch.setattr(w8a8_rows, "w8a8_rows_linear", spy_rows)
    past = max(w8a8_gemm.FUSED_MAX_ROWS, w8a8_rows.RUNTIME_MAX_ROWS, w8a8_rows.RUNTIME_MAX_ROWS_INT8) + 4
    counts = sorted({w8a8_gemm.FUSED_MAX_ROWS + 4, past})
    for num_rows in counts:
        x = torch.randn(num_rows, 64, generator=g)
        want = make_quant_linear(scheme, w, quant, torch.float32)(x)
        got = linear(x)
        assert torch.allclose(got, want, atol=2e-2 * want.abs().max()), (got - want).abs().max()
    # the rows GEMM where it applies (INT8; FP8 on bf16 / fp16 rows only), the fused GEMM past its rows
    on_rows = [r for r in counts if w8a8_rows.runtime_applies(r, codes.dtype, torch.float32)]
    assert rows_calls == on_rows and calls == [r for r in counts if r not in on_rows], (rows_calls, calls)
    assert past in calls
