"""The executor's lm_head, quantized (`quantization.lm_head`): the Triton kernel path (W4A16 GEMV / GEMM, W8A8
INT8 and FP8) equals the torch reference path on the rows ``logits_indices`` selects; zero rows launch
nothing. On CPU the kernels run under TRITON_INTERPRET=1."""

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
    ("gptq", {"group_size": 16}, "_kernel_weight_only_linear"),
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

    def spy(w, *args):
        built.append(w["qweight"].shape[0])
        return real(w, *args)

    monkeypatch.setattr(executor, machinery, spy)
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
