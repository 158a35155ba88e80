"""The fused MoE kernels (kernels/moe.py) against the ``moe`` op's torch implementation (kernels/torch_ops.py, itself
checked against Hugging Face's blocks in test_moe.py): the block plan's invariants, then the whole op with fresh
random inputs at small shapes under the Triton interpreter on CPU (routings where experts get no token and where one
expert gets them all included), with unquantized, FP8 and W4A16 experts. On CUDA (TRITON_INTERPRET=0): the same cases
compiled, Qwen3-30B-A3B's and Mixtral-8x7B's shapes, and the op captured in a CUDA graph replayed over changing
routings."""

from __future__ import annotations

import functools
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton / kernels are imported

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import moe, moe_gemv  # noqa: E402
from kernels import torch_ops as ops  # noqa: E402
from kernels.torch_quant import quantize_experts_fp8  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRETED:
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    pytest.skip("TRITON_INTERPRET=0 and no CUDA device", allow_module_level=True)
on_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="CUDA only (TRITON_INTERPRET=0 on a GPU machine)")


def _inputs(num_experts: int, hidden: int, inter: int, num_tokens: int, dtype: torch.dtype, seed: int,
            bias: bool = False, device: str = DEVICE):
    """x, router, experts and (optionally) a router bias: random, scaled so that logits, gate/up and outputs are
    O(1) (logits spread enough that routing varies across tokens)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    x = randn(num_tokens, hidden)
    gate = randn(num_experts, hidden, scale=2 * hidden ** -0.5)
    w_gate_up = randn(num_experts, 2 * inter, hidden, scale=hidden ** -0.5)
    w_down = randn(num_experts, hidden, inter, scale=inter ** -0.5)
    gate_bias = randn(num_experts, scale=0.5) if bias else None
    return x, gate, w_gate_up, w_down, gate_bias


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: fp32 rounding apart; 16-bit: a few units in the last place of the output's largest value (GEMMs summed
    in another order round some intermediates the other way). A token sent to a wrong expert, or a slot weighted by
    another's weight, is off by O(1)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    tol = 1e-5 if ref.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max().item())


def _fp8_inputs(num_experts: int, hidden: int, inter: int, num_tokens: int, dtype: torch.dtype, seed: int,
                bias: bool = False):
    """``_inputs``' tensors made in fp32: x, router and bias then in ``dtype``, the experts FP8. Returns x, router,
    (w_gate_up, w_down), (w_gate_up_scale, w_down_scale), router bias."""
    x, gate, w_gate_up, w_down, gate_bias = _inputs(num_experts, hidden, inter, num_tokens, torch.float32, seed, bias)
    (w_gate_up, gate_up_scale), (w_down, down_scale) = quantize_experts_fp8(w_gate_up), quantize_experts_fp8(w_down)
    return (x.to(dtype), gate.to(dtype), (w_gate_up, w_down), (gate_up_scale, down_scale),
            None if gate_bias is None else gate_bias.to(dtype))


FP8_GPU_REL_NORM = 1.5e-2


def _assert_close_fp8(out: torch.Tensor, ref: torch.Tensor) -> None:
    """FP8 experts under the interpreter: the reference's codes (the per-token scales and the quotients both IEEE
    divisions, E4M3 rounding to nearest even), their products exact in fp32; only the fp32 sums' order differs, so an
    output (or a gate / up value) within an fp32 ulp of a rounding boundary of x's dtype may round the other way.
    16-bit: one unit in the last place of the output's largest value. fp32: as ``_assert_close`` (the sums' order;
    the activation's own fp32 error, e.g. gelu's 1 + erf near -1, can move a code of h by one E4M3 step)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    scale = ref.float().abs().max().item()
    if out.is_cuda and ref.dtype != torch.float32:
        # the GPU's 16-bit GEMMs sum in another order: a gate / up value one ulp off can move a row's maximum of h,
        # and with it the E4M3 grid of that whole row (dynamic per-token scales), so a few tokens differ by a
        # fraction of the quantization noise (~5% of the output's norm); a wrong scale or code is O(1) or that noise
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < FP8_GPU_REL_NORM, f"relative error {err:.3g} (norm) >= {FP8_GPU_REL_NORM}"
        return
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * scale)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=torch.finfo(ref.dtype).eps * scale)


# --- the plan --------------------------------------------------------------------------------------------
def _check_plan(experts: torch.Tensor, num_experts: int, block_m: int) -> None:
    """Every slot in exactly one row, in its expert's blocks, in slot order within an expert; each expert's rows a
    run of whole blocks, padded with num_slots; blocks past the routing's own marked as no expert."""
    plan = moe.moe_align(experts.to(DEVICE), num_experts, block_m)
    flat = experts.reshape(-1)
    num_slots = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    blocks = (counts + block_m - 1) // block_m
    used = int(blocks.sum())
    assert plan.block_expert.numel() == moe.max_blocks(num_slots, num_experts, block_m) >= used
    block_expert = plan.block_expert.cpu()
    assert block_expert[:used].tolist() == torch.repeat_interleave(torch.arange(num_experts), blocks).tolist()
    assert (block_expert[used:] >= num_experts).all()
    rows = plan.sorted_slots.cpu()[:used * block_m]
    real = rows[rows != num_slots]
    assert real.tolist() == torch.argsort(flat, stable=True).tolist()  # grouped by expert, slot order kept
    assert (flat[real.long()] == torch.repeat_interleave(block_expert[:used], block_m)[rows != num_slots]).all()


@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_m,routing", [
    (1, 8, 128, 16, "random"),  # decode at Qwen3-MoE's routing: 8 experts of 128, one slot each
    (17, 2, 8, 16, "random"),
    (40, 1, 4, 16, "one"),  # every token to expert 3: three blocks, the last one padded
    (30, 2, 8, 32, "two"),  # only experts 2 and 5: the others get nothing
    (40, 4, 1024, 16, "random"),  # 160 slots in chunks of 16: the counting kernel, counts summed in two tiles
])
def test_plan(num_tokens, top_k, num_experts, block_m, routing):
    g = torch.Generator().manual_seed(num_tokens * 31 + top_k)
    if routing == "random":
        experts = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)])
    elif routing == "one":
        experts = torch.full((num_tokens, top_k), 3)
    else:
        experts = torch.tensor([[2, 5], [5, 2]]).repeat(num_tokens // 2, 1)
    _check_plan(experts, num_experts, block_m)


# --- the op -------------------------------------------------------------------------------------------
# (num_experts, hidden, intermediate, num_tokens, top_k, scoring, norm_topk_prob, round_weights, activation, dtype,
#  router bias)
CASES = [
    (8, 64, 64, 1, 1, "softmax", True, False, "silu", torch.bfloat16, False),  # decode, top-1 (weight 1)
    (8, 64, 64, 1, 2, "softmax", True, False, "silu", torch.bfloat16, False),  # Mixtral's routing
    (8, 64, 64, 3, 2, "sigmoid", False, False, "silu", torch.bfloat16, True),
    (8, 64, 64, 17, 2, "softmax", True, True, "silu", torch.bfloat16, False),  # Qwen3-MoE's rounded weights
    (6, 48, 40, 17, 2, "softmax", False, True, "silu", torch.bfloat16, False),  # hidden, I not multiples of tiles
    (4, 32, 48, 17, 1, "sigmoid", True, False, "silu", torch.bfloat16, True),
    (4, 32, 32, 17, 3, "sigmoid", True, False, "relu", torch.bfloat16, False),  # top_k not a power of 2
    (8, 32, 32, 3, 2, "softmax", True, False, "gelu_tanh", torch.bfloat16, False),
    (5, 32, 32, 3, 1, "sigmoid", False, False, "gelu", torch.bfloat16, False),
    (4, 32, 32, 3, 2, "softmax", True, False, "tanh", torch.bfloat16, False),
    (8, 64, 32, 17, 2, "softmax", True, False, "silu", torch.float32, False),
    (8, 64, 32, 3, 2, "softmax", True, True, "silu", torch.float16, False),
    (64, 32, 32, 70, 2, "softmax", True, False, "silu", torch.bfloat16, False),  # two plan chunks; many experts
]


def _case_id(c: tuple) -> str:
    return (f"E{c[0]}-H{c[1]}-I{c[2]}-T{c[3]}-k{c[4]}-{c[5]}-norm{int(c[6])}-round{int(c[7])}-{c[8]}-"
            f"{str(c[9])[6:]}{'-bias' if c[10] else ''}")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_fused_moe_matches_the_torch_op(case):
    num_experts, hidden, inter, num_tokens, top_k, scoring, norm, round_weights, act, dtype, bias = case
    x, gate, w_gate_up, w_down, gate_bias = _inputs(num_experts, hidden, inter, num_tokens, dtype,
                                                    seed=num_tokens * 100 + hidden + inter, bias=bias)
    out = moe.fused_moe(x, gate, w_gate_up, w_down, top_k, scoring, norm, act, gate_bias, round_weights)
    ref = ops.moe(x, gate, w_gate_up, w_down, top_k, scoring, norm, act, gate_bias, round_weights)
    _assert_close(out, ref)


def _expert_biases(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return ((torch.randn(num_experts, 2 * inter, generator=g, device=DEVICE) * 0.5).to(dtype),
            (torch.randn(num_experts, hidden, generator=g, device=DEVICE) * 0.5).to(dtype))


# gpt-oss's experts: biases on both projections and the clamped SwiGLU (alpha 1.702, limit 7; inputs scaled so that
# some gate and up values pass the limit); (num_experts, hidden, intermediate, num_tokens, top_k, dtype, fp8)
OSS_CASES = [
    (4, 32, 32, 9, 2, torch.float32, False),
    (8, 64, 32, 17, 2, torch.bfloat16, False),
    (4, 48, 40, 5, 3, torch.float16, False),  # K of both GEMMs masked
    (8, 64, 64, 17, 2, torch.bfloat16, True),
]


@pytest.mark.parametrize("case", OSS_CASES, ids=lambda c: f"E{c[0]}-H{c[1]}-I{c[2]}-T{c[3]}-k{c[4]}-{str(c[5])[6:]}"
                         f"{'-fp8' if c[6] else ''}")
def test_expert_biases_and_clamped_swiglu_match_the_torch_op(case):
    num_experts, hidden, inter, num_tokens, top_k, dtype, fp8 = case
    seed = num_tokens * 100 + hidden + inter + 7
    if fp8:
        x, gate, experts, scales, gate_bias = _fp8_inputs(num_experts, hidden, inter, num_tokens, dtype, seed, True)
        kw = dict(w_gate_up_scale=scales[0], w_down_scale=scales[1])
    else:
        x, gate, *experts, gate_bias = _inputs(num_experts, hidden, inter, num_tokens, dtype, seed, bias=True)
        kw = {}
    x = x * 8  # gate / up values of a few units: some pass the limit
    b_gate_up, b_down = _expert_biases(num_experts, hidden, inter, dtype, seed)
    kw.update(b_gate_up=b_gate_up, b_down=b_down, swiglu_alpha=1.702, swiglu_limit=7.0)
    args = (x, gate, *experts, top_k, "softmax", True, "clamped_swiglu", gate_bias, False)
    out, ref = moe.fused_moe(*args, **kw), ops.moe(*args, **kw)
    (_assert_close_fp8 if fp8 else _assert_close)(out, ref)
    # the biases and the gating count: without them the op is another one
    plain = ops.moe(x, gate, *experts, top_k, "softmax", True, "silu", gate_bias, False,
                    **{k: v for k, v in kw.items() if k.startswith("w_")})
    assert (ref.float() - plain.float()).abs().max() > 0.1 * ref.float().abs().max()


def test_clamped_swiglu_reference_is_gpt_oss_gating():
    """ops.clamped_swiglu against transformers' own GptOssExperts._apply_gate (gate and up interleaved there)."""
    pytest.importorskip("transformers")
    from transformers import AutoConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = AutoConfig.for_model("gpt_oss", hidden_size=16, intermediate_size=8, num_local_experts=2)
    module = GptOssExperts(config)
    gate_up = torch.randn(5, 16, generator=torch.Generator().manual_seed(0)) * 6  # past the limit of 7 too
    want = module._apply_gate(gate_up)
    got = ops.clamped_swiglu(gate_up[:, ::2], gate_up[:, 1::2], module.alpha, module.limit)  # the module's own
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# (num_experts, hidden, intermediate, num_tokens, top_k, scoring, norm_topk_prob, round_weights, activation, dtype,
#  router bias): as CASES, with FP8 experts
FP8_CASES = [
    (8, 64, 64, 1, 1, "softmax", True, False, "silu", torch.bfloat16, False),  # decode, top-1: 7 experts get nothing
    (8, 64, 64, 17, 2, "softmax", True, True, "silu", torch.bfloat16, False),
    (6, 48, 40, 17, 2, "sigmoid", False, False, "gelu_tanh", torch.bfloat16, True),  # K of both GEMMs masked
    (8, 32, 32, 5, 2, "softmax", True, True, "silu", torch.float16, False),
    (4, 32, 48, 17, 3, "sigmoid", True, False, "silu", torch.float32, False),
    (8, 48, 32, 9, 2, "softmax", True, False, "relu", torch.float32, True),
]


@pytest.mark.parametrize("case", FP8_CASES, ids=_case_id)
def test_fp8_experts_match_the_torch_op(case):
    num_experts, hidden, inter, num_tokens, top_k, scoring, norm, round_weights, act, dtype, bias = case
    x, gate, experts, scales, gate_bias = _fp8_inputs(num_experts, hidden, inter, num_tokens, dtype,
                                                      seed=num_tokens * 100 + hidden + inter + 1, bias=bias)
    kw = dict(w_gate_up_scale=scales[0], w_down_scale=scales[1])
    out = moe.fused_moe(x, gate, *experts, top_k, scoring, norm, act, gate_bias, round_weights, **kw)
    _assert_close_fp8(out, ops.moe(x, gate, *experts, top_k, scoring, norm, act, gate_bias, round_weights, **kw))


def _block_fp8_experts(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert of w [E, out, in] (fp32) as e4m3 codes with one scale (amax / 448) per block of rows x inputs,
    partial last blocks included: (codes, scales [E, ceil(out / bn), ceil(in / bk)])."""
    (e, n, k), (bn, bk) = w.shape, block
    scales = torch.zeros(e, -(-n // bn), -(-k // bk), device=w.device)
    codes = torch.zeros(e, n, k, dtype=torch.float8_e4m3fn, device=w.device)
    for i in range(scales.shape[1]):
        for j in range(scales.shape[2]):
            tile = w[:, i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            scales[:, i, j] = tile.abs().amax(dim=(1, 2)) / 448
            codes[:, i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (tile / scales[:, i, j, None, None]).to(
                torch.float8_e4m3fn)
    return codes, scales


# (num_experts, hidden, intermediate, num_tokens, top_k, activation, dtype, block): block-FP8 experts (one scale per
# [bn, bk] block, inputs quantized per token and bk-wide group); hidden 48 / intermediate 40 end in partial blocks
BLOCK_FP8_CASES = [
    (8, 64, 64, 1, 2, "silu", torch.bfloat16, (32, 32)),
    (8, 64, 64, 17, 2, "silu", torch.bfloat16, (16, 32)),
    (6, 48, 32, 9, 2, "gelu_tanh", torch.float16, (32, 16)),
    (4, 48, 32, 5, 3, "silu", torch.float32, (16, 32)),
]


@pytest.mark.parametrize("case", BLOCK_FP8_CASES, ids=lambda c: f"e{c[0]}-h{c[1]}-i{c[2]}-t{c[3]}-{c[6]}-b{c[7]}")
def test_block_fp8_experts_match_the_torch_op(case):
    num_experts, hidden, inter, num_tokens, top_k, act, dtype, block = case
    x, gate, w_gate_up, w_down, _ = _inputs(num_experts, hidden, inter, num_tokens, torch.float32,
                                            seed=num_tokens * 31 + hidden + block[0])
    (w_gate_up, s_up), (w_down, s_down) = (_block_fp8_experts(w, block) for w in (w_gate_up, w_down))
    kw = dict(w_gate_up_scale=s_up, w_down_scale=s_down, block_size=block)
    x, gate = x.to(dtype), gate.to(dtype)
    out = moe.fused_moe(x, gate, w_gate_up, w_down, top_k, "softmax", True, act, **kw)
    _assert_close_fp8(out, ops.moe(x, gate, w_gate_up, w_down, top_k, "softmax", True, act, **kw))
    with pytest.raises(ValueError, match="block-FP8 experts hold torch.float8_e4m3fn codes and torch.float32 scales"):
        moe.fused_moe(x, gate, w_gate_up, w_down, top_k, "softmax", True, act,
                      **dict(kw, w_down_scale=s_down[:, :1]))


@pytest.mark.parametrize("fp8", [False, True], ids=["unquantized", "fp8"])
@pytest.mark.parametrize("routing", ["one expert takes every token", "half the experts get none"])
def test_skewed_routings(routing, fp8):
    """A router bias pins the routing: expert 3 first for all 40 tokens (three blocks of it); or experts 0, 1, 4
    and 6 never chosen. Weights and the second choice still come from the router."""
    num_experts, top_k = 8, 2
    if fp8:
        x, gate, (w_gate_up, w_down), scales, _ = _fp8_inputs(num_experts, 32, 32, 40, torch.bfloat16, seed=11)
        kw, check = dict(w_gate_up_scale=scales[0], w_down_scale=scales[1]), _assert_close_fp8
    else:
        x, gate, w_gate_up, w_down, _ = _inputs(num_experts, 32, 32, 40, torch.bfloat16, seed=11)
        kw, check = {}, _assert_close
    bias = torch.zeros(num_experts, device=DEVICE)
    if routing == "one expert takes every token":
        bias[3] = 8.0
    else:
        bias[[0, 1, 4, 6]] = -8.0
    bias = bias.to(torch.bfloat16)
    experts = ops.moe_route(x, gate, bias, top_k)[1].cpu()
    counts = torch.bincount(experts.reshape(-1), minlength=num_experts)
    assert (counts[3] == 40) if routing.startswith("one") else (counts[[0, 1, 4, 6]].sum() == 0 and counts.min() == 0)
    out = moe.fused_moe(x, gate, w_gate_up, w_down, top_k, "softmax", True, "silu", bias, **kw)
    check(out, ops.moe(x, gate, w_gate_up, w_down, top_k, "softmax", True, "silu", bias, **kw))


def test_no_tokens():
    x, gate, w_gate_up, w_down, _ = _inputs(4, 32, 32, 0, torch.bfloat16, seed=1)
    out = moe.fused_moe(x, gate, w_gate_up, w_down, 2)
    assert out.shape == (0, 32) and out.dtype == torch.bfloat16


def test_bad_inputs_are_named():
    x, gate, w_gate_up, w_down, _ = _inputs(4, 32, 32, 3, torch.bfloat16, seed=2)
    with pytest.raises(ValueError, match="quantized experts"):
        moe.fused_moe(x, gate, w_gate_up.float(), w_down, 2)
    with pytest.raises(ValueError, match=r"\[E, hidden, I\]"):
        moe.fused_moe(x, gate, w_gate_up, w_down[:, :, :16], 2)
    with pytest.raises(ValueError, match="top_k 5"):
        moe.fused_moe(x, gate, w_gate_up, w_down, 5)
    with pytest.raises(ValueError, match="unknown activation"):
        moe.fused_moe(x, gate, w_gate_up, w_down, 2, activation="swish")


def test_bad_fp8_scales_are_named():
    x, gate, (w_gate_up, w_down), (gate_up_scale, down_scale), _ = _fp8_inputs(4, 32, 16, 3, torch.bfloat16, seed=3)
    with pytest.raises(ValueError, match=r"w_gate_up_scale is torch.float32 \(4, 16\); expected torch.float32 "
                                         r"\(4, 32\) \(\[E, 2 \* I\]"):
        moe.fused_moe(x, gate, w_gate_up, w_down, 2, w_gate_up_scale=gate_up_scale[:, :16], w_down_scale=down_scale)
    with pytest.raises(ValueError, match=r"w_down_scale is torch.bfloat16 \(4, 32\); expected torch.float32 "
                                         r"\(4, 32\) \(\[E, hidden\]"):
        moe.fused_moe(x, gate, w_gate_up, w_down, 2, w_gate_up_scale=gate_up_scale,
                      w_down_scale=down_scale.to(torch.bfloat16))
    with pytest.raises(ValueError, match="only w_down_scale was given"):
        moe.fused_moe(x, gate, w_gate_up, w_down, 2, w_down_scale=down_scale)
    with pytest.raises(ValueError, match="float8_e4m3fn with w_gate_up_scale and w_down_scale"):
        moe.fused_moe(x, gate, w_gate_up, w_down, 2)  # FP8 codes without their scales
    with pytest.raises(ValueError, match=r"w_down is torch.bfloat16; with w_down_scale \(FP8 experts\) it must hold "
                                         r"torch.float8_e4m3fn"):
        moe.fused_experts(x, torch.ones(3, 2), torch.zeros(3, 2, dtype=torch.int64), w_gate_up,
                          w_down.to(torch.bfloat16), w_gate_up_scale=gate_up_scale, w_down_scale=down_scale)


# --- W4A16 experts -----------------------------------------------------------------------------------------
def _int4_experts(w: torch.Tensor, group_size: int, symmetric: bool):
    """Stacked float experts [E, out, in] -> (codes uint8 [E, out, in / 2], scales fp32, zeros uint8 [E, out, in /
    group_size]), each expert rounded to nearest as the passes' W4A16 experts store it (passes/moe_int4.py)."""
    from passes.quant_math import QuantConfig, pack_int4, quantize_groups

    cfg = QuantConfig(4, group_size, symmetric)
    parts = [quantize_groups(w[e].float().cpu(), cfg) for e in range(w.shape[0])]
    return (torch.stack([pack_int4(c) for c, _, _ in parts]).to(w.device),
            torch.stack([s for _, s, _ in parts]).to(w.device), torch.stack([z for _, _, z in parts]).to(w.device))


def _int4_inputs(num_experts: int, hidden: int, inter: int, num_tokens: int, dtype: torch.dtype, seed: int,
                 group_size: int, symmetric: bool, bias: bool = False):
    """``_inputs``' tensors, the experts as W4A16 codes: x, router, (w_gate_up, w_down) codes, the int4 keyword
    arguments (scales, zeros, group_size), router bias."""
    x, gate, w_gate_up, w_down, gate_bias = _inputs(num_experts, hidden, inter, num_tokens, dtype, seed, bias)
    (up_codes, up_scales, up_zeros), (down_codes, down_scales, down_zeros) = (
        _int4_experts(w, group_size, symmetric) for w in (w_gate_up, w_down))
    kw = dict(w_gate_up_scales=up_scales, w_gate_up_zeros=up_zeros, w_down_scales=down_scales,
              w_down_zeros=down_zeros, group_size=group_size)
    return x, gate, (up_codes, down_codes), kw, gate_bias


# (num_experts, hidden, intermediate, num_tokens, top_k, scoring, norm_topk_prob, round_weights, activation, dtype,
#  router bias, group_size, symmetric)
INT4_CASES = [
    (8, 64, 64, 17, 2, "softmax", True, False, "silu", torch.bfloat16, False, 32, False),  # Mixtral's routing
    (8, 64, 64, 17, 2, "softmax", False, True, "silu", torch.bfloat16, False, 32, True),  # not renormalised
    (16, 64, 32, 5, 8, "softmax", True, True, "silu", torch.bfloat16, False, 32, True),  # Qwen3-MoE's top-8
    (16, 64, 64, 1, 8, "softmax", False, False, "silu", torch.bfloat16, False, 64, False),  # decode, top-8
    (16, 64, 64, 9, 8, "sigmoid", False, False, "gelu_tanh", torch.bfloat16, True, 32, False),
    (6, 96, 32, 9, 2, "softmax", True, False, "silu", torch.bfloat16, False, 32, True),  # 3 groups of 32
    (8, 64, 32, 9, 2, "softmax", True, False, "silu", torch.float32, False, 32, False),
    (8, 32, 32, 5, 2, "softmax", True, True, "silu", torch.float16, False, -1, True),  # one group per row
]


def _int4_id(c: tuple) -> str:
    return _case_id(c[:11]) + f"-g{c[11]}-{'sym' if c[12] else 'asym'}"


def _assert_close_int4(out: torch.Tensor, ref: torch.Tensor) -> None:
    """W4A16 experts against the reference on the same codes. The reference rounds each dequantized weight (q - zero)
    * scale to x's dtype before its GEMMs; the kernels sum x (q - zero) exactly in fp32 and multiply by the group's
    scale, the weights never rounded. Each weight is then within half an ulp of the reference's, so a gate / up value
    differs from the reference's by a fraction of its own ulp and may round the other way, as with GEMMs summed in
    another order: ``_assert_close``'s few units in the last place of the output's largest value (the criterion of the
    bf16 experts; under the interpreter INT4_CASES measured at most 1.8 such units over 12 seeds each, where the
    kernels that rounded the weights as the reference does agreed within one). ``test_int4_exact_weights`` holds the
    kernels to the tighter criterion where no weight rounds."""
    _assert_close(out, ref)


@pytest.mark.parametrize("case", INT4_CASES, ids=_int4_id)
def test_int4_experts_match_the_torch_op(case):
    num_experts, hidden, inter, num_tokens, top_k, scoring, norm, round_weights, act, dtype, bias, group, sym = case
    x, gate, experts, kw, gate_bias = _int4_inputs(num_experts, hidden, inter, num_tokens, dtype,
                                                   seed=num_tokens * 100 + hidden + inter + 2, group_size=group,
                                                   symmetric=sym, bias=bias)
    args = (x, gate, *experts, top_k, scoring, norm, act, gate_bias, round_weights)
    ref = ops.moe(*args, **kw)
    _assert_close_int4(moe.fused_moe(*args, **kw), ref)
    # the reference is the dequantized experts run as float ones, bit for bit: the artifact's meaning
    floats = [_dequantized(experts[0], kw["w_gate_up_scales"], kw["w_gate_up_zeros"], dtype),
              _dequantized(experts[1], kw["w_down_scales"], kw["w_down_zeros"], dtype)]
    torch.testing.assert_close(ops.moe(x, gate, *floats, top_k, scoring, norm, act, gate_bias, round_weights), ref,
                               rtol=0, atol=0)
    # the codes' nibble order, the zero points and the scales each count: swapped or dropped, the op is another one
    swapped = tuple(((c >> 4) | (c << 4)).to(torch.uint8) for c in experts)
    for other, kw2 in ((swapped, kw), (experts, {**kw, "w_gate_up_zeros": torch.zeros_like(kw["w_gate_up_zeros"])}),
                       (experts, {**kw, "w_down_scales": kw["w_down_scales"].flip(0)})):
        changed = ops.moe(x, gate, *other, top_k, scoring, norm, act, gate_bias, round_weights, **kw2)
        assert (changed.float() - ref.float()).abs().max() > 0.1 * ref.float().abs().max()


def _dequantized(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Packed codes [E, out, in / 2] (low nibble first) with scales / zeros [E, out, groups] -> [E, out, in] in
    ``dtype``: (q - zero) * scale in fp32, rounded once (written here apart from the reference's own unpacking)."""
    q = torch.stack((codes & 0x0F, codes >> 4), dim=-1).reshape(*codes.shape[:2], -1).float()
    g = q.shape[2] // scales.shape[2]
    return ((q - zeros.float().repeat_interleave(g, 2)) * scales.float().repeat_interleave(g, 2)).to(dtype)


def _power_of_two_scales(kw: dict) -> dict:
    """``kw`` (``_int4_inputs``' keyword arguments) with every group scale rounded to a power of two: each dequantized
    weight (q - zero) * scale is then exact in bf16 / fp16 (|q - zero| <= 15), so the reference rounds none."""
    return {k: torch.exp2(torch.round(torch.log2(v))) if k.endswith("_scales") else v for k, v in kw.items()}


# (num_experts, hidden, intermediate, num_tokens, top_k, dtype, group_size, symmetric)
EXACT_INT4_CASES = [
    (8, 128, 128, 9, 2, torch.bfloat16, 128, False),  # groups of 128: four K steps of the interpreter's 32 each
    (8, 128, 128, 9, 2, torch.bfloat16, 128, True),
    (8, 128, 64, 17, 2, torch.bfloat16, 64, False),
    (8, 128, 64, 17, 2, torch.bfloat16, 64, True),
    (6, 48, 40, 9, 2, torch.bfloat16, -1, False),  # one group per row: neither K a multiple of the step (masked)
    (8, 64, 64, 5, 2, torch.float16, 64, False),
    (8, 64, 64, 5, 2, torch.float32, 32, True),
]


@pytest.mark.parametrize("case", EXACT_INT4_CASES, ids=lambda c: f"E{c[0]}-H{c[1]}-I{c[2]}-T{c[3]}-k{c[4]}-"
                         f"{str(c[5])[6:]}-g{c[6]}-{'sym' if c[7] else 'asym'}")
def test_int4_exact_weights(case):
    """Power-of-two group scales: the reference's dequantized weights are exact, the kernels' unrounded ones the same
    values, and products of x with them exact in fp32; only the fp32 sums' order differs. Under the interpreter the
    FP8 tests' criterion (``_assert_close_fp8``: one unit in the last place of the output's largest value), which
    nibble order, zero points and group scales must meet exactly; on the GPU ``_assert_close``."""
    num_experts, hidden, inter, num_tokens, top_k, dtype, group, sym = case
    x, gate, experts, kw, _ = _int4_inputs(num_experts, hidden, inter, num_tokens, dtype, group_size=group,
                                           symmetric=sym, seed=num_tokens * 100 + hidden + inter + group + 3)
    kw = _power_of_two_scales(kw)
    ref = ops.moe(x, gate, *experts, top_k, **kw)
    out = moe.fused_moe(x, gate, *experts, top_k, **kw)
    (_assert_close if out.is_cuda else _assert_close_fp8)(out, ref)


def test_int4_skewed_routing():
    """Experts 0, 1, 4 and 6 never chosen (a router bias), expert 3 first for every token: empty experts, and three
    blocks of one expert, with W4A16 experts."""
    x, gate, experts, kw, _ = _int4_inputs(8, 64, 32, 40, torch.bfloat16, seed=12, group_size=32, symmetric=False)
    bias = torch.zeros(8, device=DEVICE)
    bias[[0, 1, 4, 6]] = -8.0
    bias[3] = 8.0
    bias = bias.to(torch.bfloat16)
    counts = torch.bincount(ops.moe_route(x, gate, bias, 2)[1].cpu().reshape(-1), minlength=8)
    assert counts[3] == 40 and counts[[0, 1, 4, 6]].sum() == 0
    _assert_close_int4(moe.fused_moe(x, gate, *experts, 2, gate_bias=bias, **kw),
                       ops.moe(x, gate, *experts, 2, gate_bias=bias, **kw))


def test_bad_int4_experts_are_named():
    x, gate, (up, down), kw, _ = _int4_inputs(4, 64, 32, 3, torch.bfloat16, seed=4, group_size=32, symmetric=False)
    with pytest.raises(ValueError, match="missing: w_down_zeros"):
        moe.fused_moe(x, gate, up, down, 2, **{**kw, "w_down_zeros": None})
    with pytest.raises(ValueError, match=r"w_gate_up_scales is torch.float32 \(4, 64, 1\); expected torch.float32 "
                                         r"\(4, 64, 2\)"):
        moe.fused_moe(x, gate, up, down, 2, **{**kw, "w_gate_up_scales": kw["w_gate_up_scales"][:, :, :1]})
    with pytest.raises(ValueError, match=r"w_down_zeros is torch.int32 .* expected torch.uint8"):
        moe.fused_moe(x, gate, up, down, 2, **{**kw, "w_down_zeros": kw["w_down_zeros"].int()})
    with pytest.raises(ValueError, match=r"packed two per byte: w_gate_up \[E, 2 \* I, hidden / 2\]"):
        moe.fused_moe(x, gate, up.float(), down, 2, **kw)
    with pytest.raises(ValueError, match="group_size 16 is not a multiple of 32"):
        doubled = {k: kw[k].repeat(1, 1, 2) for k in kw if k.endswith(("_scales", "_zeros"))}
        moe.fused_moe(x, gate, up, down, 2, **{**kw, "group_size": 16, **doubled})
    _, _, _, fp8_scales, _ = _fp8_inputs(4, 32, 32, 3, torch.bfloat16, seed=4)
    with pytest.raises(ValueError, match="not both"):
        moe.fused_moe(x, gate, up, down, 2, w_gate_up_scale=fp8_scales[0], w_down_scale=fp8_scales[1], **kw)


# --- CUDA: real shapes, and a CUDA graph ---------------------------------------------------------------------
# name: (num_experts, hidden, intermediate per expert, top_k, round_weights); both renormalise
REAL_SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8, True), "mixtral-8x7b": (8, 4096, 14336, 2, False)}


@functools.cache
def _real_weights(name: str):
    num_experts, hidden, inter, _, _ = REAL_SHAPES[name]
    return _inputs(num_experts, hidden, inter, 1, torch.bfloat16, seed=0)[1:4]


@on_cuda
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 1024])
@pytest.mark.parametrize("name", sorted(REAL_SHAPES))
def test_real_shapes_on_cuda(name, num_tokens):
    _, hidden, _, top_k, round_weights = REAL_SHAPES[name]
    gate, w_gate_up, w_down = _real_weights(name)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator("cuda").manual_seed(num_tokens), device="cuda")
    x = x.to(torch.bfloat16)
    out = moe.fused_moe(x, gate, w_gate_up, w_down, top_k, round_weights=round_weights)
    _assert_close(out, ops.moe(x, gate, w_gate_up, w_down, top_k, round_weights=round_weights))


@functools.cache
def _real_fp8_weights(name: str):
    gate, w_gate_up, w_down = _real_weights(name)
    (w_gate_up, gate_up_scale), (w_down, down_scale) = quantize_experts_fp8(w_gate_up), quantize_experts_fp8(w_down)
    return gate, (w_gate_up, w_down), (gate_up_scale, down_scale)


@on_cuda
@pytest.mark.parametrize("num_tokens", [1, 64, 1024])
@pytest.mark.parametrize("name", sorted(REAL_SHAPES))
def test_fp8_real_shapes_on_cuda(name, num_tokens):
    """FP8 experts quantized from the bf16 ones, against the torch op on the GPU (``_assert_close_fp8``'s GPU
    criterion: the rows of h whose E4M3 grid moves with a one-ulp difference upstream)."""
    _, hidden, _, top_k, round_weights = REAL_SHAPES[name]
    gate, experts, scales = _real_fp8_weights(name)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator("cuda").manual_seed(num_tokens), device="cuda")
    x = x.to(torch.bfloat16)
    kw = dict(top_k=top_k, round_weights=round_weights, w_gate_up_scale=scales[0], w_down_scale=scales[1])
    _assert_close_fp8(moe.fused_moe(x, gate, *experts, **kw), ops.moe(x, gate, *experts, **kw))


@on_cuda
@pytest.mark.parametrize("num_tokens", [1, 64, 1024])
@pytest.mark.parametrize("name", sorted(REAL_SHAPES))
def test_block_fp8_real_shapes_on_cuda(name, num_tokens):
    """Block-FP8 experts (128 x 128 blocks, Qwen3-30B-A3B-FP8's) rounded from the bf16 ones, against the torch op on
    the GPU (``_assert_close_fp8``'s GPU criterion)."""
    _, hidden, _, top_k, round_weights = REAL_SHAPES[name]
    gate, w_gate_up, w_down = _real_weights(name)
    (w_gate_up, s_up), (w_down, s_down) = (_block_fp8_experts(w.float(), (128, 128)) for w in (w_gate_up, w_down))
    kw = dict(top_k=top_k, round_weights=round_weights, w_gate_up_scale=s_up, w_down_scale=s_down,
              block_size=(128, 128))
    x = torch.randn(num_tokens, hidden, generator=torch.Generator("cuda").manual_seed(num_tokens), device="cuda")
    x = x.to(torch.bfloat16)
    _assert_close_fp8(moe.fused_moe(x, gate, w_gate_up, w_down, **kw), ops.moe(x, gate, w_gate_up, w_down, **kw))


@on_cuda
@pytest.mark.parametrize("num_tokens", [1, 4, 16, 64, 1024])
@pytest.mark.parametrize("name", sorted(REAL_SHAPES))
def test_int4_real_shapes_on_cuda(name, num_tokens):
    """W4A16 experts (group 128, asymmetric) rounded from the bf16 ones, against the torch op on the GPU (the GEMV
    kernels up to gemv_max_slots, the grouped GEMMs above)."""
    _, hidden, _, top_k, round_weights = REAL_SHAPES[name]
    gate, w_gate_up, w_down = _real_weights(name)
    (up, up_s, up_z), (down, down_s, down_z) = (_int4_experts(w, 128, False) for w in (w_gate_up, w_down))
    kw = dict(top_k=top_k, round_weights=round_weights, w_gate_up_scales=up_s, w_gate_up_zeros=up_z,
              w_down_scales=down_s, w_down_zeros=down_z, group_size=128)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator("cuda").manual_seed(num_tokens), device="cuda")
    x = x.to(torch.bfloat16)
    _assert_close_int4(moe.fused_moe(x, gate, up, down, **kw), ops.moe(x, gate, up, down, **kw))


@on_cuda
def test_captured_in_a_cuda_graph():
    """Captured once at 24 tokens, replayed over new tokens and a router bias changed in place (every token to
    expert 3 first; then experts 0 and 1 never): each replay equals the torch op on that replay's inputs."""
    num_experts, top_k = 16, 4
    x, gate, w_gate_up, w_down, bias = _inputs(num_experts, 256, 128, 24, torch.bfloat16, seed=5, bias=True)
    _replay_over_routings(lambda: moe.fused_moe(x, gate, w_gate_up, w_down, top_k, gate_bias=bias), x, bias, 6,
                          (None, 3, (0, 1)),
                          lambda out: _assert_close(out, ops.moe(x, gate, w_gate_up, w_down, top_k, gate_bias=bias)))


def _replay_over_routings(run, x: torch.Tensor, bias: torch.Tensor, seed: int, pins: tuple, check) -> None:
    """``run`` (the op on x and the router bias) once eagerly (compiles, allocates what it keeps, outside the
    capture), then captured in a CUDA graph and replayed over new x and biases, ``check``-ed on each replay's output:
    per pin, none (random biases), one expert every token's first (3), or experts never chosen ((0, 1))."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    g = torch.Generator("cuda").manual_seed(seed)
    for pin in pins:
        x.copy_(torch.randn(x.shape, generator=g, device="cuda"))
        bias.copy_(torch.randn(bias.shape[0], generator=g, device="cuda") * 0.5)
        if pin == 3:
            bias[3] = 8.0
        elif pin:
            bias[list(pin)] = -8.0
        graph.replay()
        check(out)


# --- W4A16 experts, the small-slot (GEMV) path --------------------------------------------------------------
def _gemv_config(slots_per_pass: int = 2, split_k: int = 1) -> moe_gemv.MoeGemvConfig:
    """Small tiles (32 rows, K steps of 64 inputs: several per row), a forced split."""
    return moe_gemv.MoeGemvConfig(32, 64, 32, 64, slots_per_pass=slots_per_pass, split_k=split_k,
                                  down_split_k=split_k, num_warps=1 if INTERPRETED else 4, num_stages=1)


# (num_experts, hidden, intermediate, num_tokens, top_k, scoring, norm_topk_prob, round_weights, activation, dtype,
#  router bias, group_size, symmetric, slots_per_pass, split_k): INT4_CASES' fields, then the launch's
GEMV_INT4_CASES = [
    (8, 64, 64, 1, 1, "softmax", True, False, "silu", torch.bfloat16, False, 32, False, 2, 1),  # decode, top-1
    (8, 128, 64, 1, 2, "softmax", True, False, "silu", torch.bfloat16, False, 64, True, 2, 2),  # Mixtral's routing
    (16, 64, 64, 2, 8, "softmax", True, True, "gelu_tanh", torch.float16, False, -1, False, 2, 1),  # top-8, repeats
    (4, 64, 32, 3, 2, "sigmoid", False, False, "silu", torch.float32, True, 32, False, 1, 2),  # 6 slots, 4 experts
    (4, 64, 64, 8, 2, "softmax", True, False, "silu", torch.bfloat16, False, 64, True, 2, 3),  # passes of 2 slots
    (4, 64, 64, 8, 2, "softmax", False, True, "silu", torch.bfloat16, True, 32, False, 4, 1),  # passes of 4 slots
    (6, 48, 40, 3, 2, "softmax", True, False, "silu", torch.bfloat16, False, -1, False, 2, 2),  # K and N masked
]


def _gemv_id(c: tuple) -> str:
    return _int4_id(c[:13]) + f"-rows{c[13]}-split{c[14]}"


@pytest.mark.parametrize("case", GEMV_INT4_CASES, ids=_gemv_id)
def test_int4_gemv_matches_the_torch_op(case):
    """The small-slot kernels forced (``config``), against the torch op on the same codes; the slots of a step
    routed to one expert share its programs (several passes where they outnumber a pass's slots)."""
    *fields, rows, split = case
    num_experts, hidden, inter, num_tokens, top_k, scoring, norm, round_weights, act, dtype, bias, group, sym = fields
    x, gate, experts, kw, gate_bias = _int4_inputs(num_experts, hidden, inter, num_tokens, dtype,
                                                   seed=num_tokens * 100 + hidden + inter + 5, group_size=group,
                                                   symmetric=sym, bias=bias)
    args = (x, gate, *experts, top_k, scoring, norm, act, gate_bias, round_weights)
    out = moe.fused_moe(*args, **kw, config=_gemv_config(rows, split))
    _assert_close_int4(out, ops.moe(*args, **kw))


@pytest.mark.parametrize("rows,split", [(2, 1), (1, 3)])
def test_int4_gemv_exact_weights_one_expert(rows, split):
    """Power-of-two group scales (``test_int4_exact_weights``: the reference's weights exact, only the fp32 sums'
    order differs) and a router bias sending every token first to expert 3: its 7 slots in passes, the other experts'
    programs, the split partials. The interpreter holds the kernels to ``_assert_close_fp8``'s one unit in the last
    place, which a code, zero point or scale out of place misses."""
    x, gate, experts, kw, _ = _int4_inputs(6, 128, 64, 7, torch.bfloat16, seed=31, group_size=64, symmetric=False)
    kw = _power_of_two_scales(kw)
    bias = torch.zeros(6, device=DEVICE)
    bias[3] = 8.0
    bias = bias.to(torch.bfloat16)
    assert (ops.moe_route(x, gate, bias, 2)[1][:, 0] == 3).all()
    out = moe.fused_moe(x, gate, *experts, 2, gate_bias=bias, **kw, config=_gemv_config(rows, split))
    (_assert_close if out.is_cuda else _assert_close_fp8)(out, ops.moe(x, gate, *experts, 2, gate_bias=bias, **kw))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_int4_gemv_expert_biases_and_clamped_swiglu(dtype):
    x, gate, experts, kw, gate_bias = _int4_inputs(4, 64, 32, 3, dtype, seed=41, group_size=32, symmetric=False,
                                                   bias=True)
    x = x * 8  # gate / up values of a few units: some pass the limit
    b_gate_up, b_down = _expert_biases(4, 64, 32, dtype, seed=41)
    kw.update(b_gate_up=b_gate_up, b_down=b_down, swiglu_alpha=1.702, swiglu_limit=7.0)
    args = (x, gate, *experts, 2, "softmax", True, "clamped_swiglu", gate_bias, False)
    _assert_close_int4(moe.fused_moe(*args, **kw, config=_gemv_config(2, 2)), ops.moe(*args, **kw))


def test_int4_dispatch_by_slot_count(monkeypatch):
    """W4A16 experts go to the GEMV kernels up to a fixed bound's slots and to the grouped GEMMs above (and whenever a
    MoeConfig is given); a MoeGemvConfig with other experts is refused."""
    calls = []
    gemv = moe_gemv.int4_experts_gemv
    monkeypatch.setattr(moe_gemv, "int4_experts_gemv", lambda *a, **k: calls.append(a[0].shape[0]) or gemv(*a, **k))
    monkeypatch.setattr(moe_gemv, "GEMV_MAX_SLOTS", 8)
    for num_tokens, top_k, want in ((1, 2, [1]), (4, 2, [4]), (5, 2, [])):
        calls.clear()
        x, gate, experts, kw, _ = _int4_inputs(4, 32, 32, num_tokens, torch.bfloat16, seed=num_tokens,
                                               group_size=32, symmetric=False)
        out = moe.fused_moe(x, gate, *experts, top_k, **kw)
        assert calls == want, f"{num_tokens * top_k} slots"
        _assert_close_int4(out, ops.moe(x, gate, *experts, top_k, **kw))
    calls.clear()
    x, gate, experts, kw, _ = _int4_inputs(4, 32, 32, 1, torch.bfloat16, seed=1, group_size=32, symmetric=False)
    moe.fused_moe(x, gate, *experts, 2, **kw, config=moe.default_config(2, 4, x.device))
    assert calls == []
    x, gate, w_gate_up, w_down, _ = _inputs(4, 32, 32, 1, torch.bfloat16, seed=2)
    with pytest.raises(ValueError, match="applies to W4A16 experts only"):
        moe.fused_moe(x, gate, w_gate_up, w_down, 2, config=_gemv_config())


def test_int4_gemv_bound_by_experts(monkeypatch):
    """Without KERNELS_MOE_GEMV_SLOTS the GEMV kernels take up to max(8, experts / 2) slots (the H200's A/B:
    Mixtral's 8 experts up to 8 slots, Qwen3-MoE's 128 up to 64)."""
    monkeypatch.setattr(moe_gemv, "GEMV_MAX_SLOTS", None)
    assert [moe_gemv.gemv_max_slots(e) for e in (4, 8, 16, 64, 128)] == [8, 8, 8, 32, 64]
    monkeypatch.setattr(moe_gemv, "GEMV_MAX_SLOTS", 0)
    assert moe_gemv.gemv_max_slots(128) == 0


@on_cuda
@pytest.mark.parametrize("split_k", [0, 4], ids=["auto-split", "split4"])
def test_int4_gemv_captured_in_a_cuda_graph(split_k):
    """The small-slot kernels captured once at 2 tokens, top-4 of 16 experts, replayed over new tokens and router
    biases (every token to expert 3 first: one program runs both its slots; then experts 0 and 1 never): each replay
    equals the torch op on its inputs, so the split-K counters are zero again after every launch."""
    num_experts, top_k = 16, 4
    x, gate, experts, kw, bias = _int4_inputs(num_experts, 256, 128, 2, torch.bfloat16, seed=7, group_size=64,
                                              symmetric=False, bias=True)
    cfg = moe_gemv.MoeGemvConfig(split_k=split_k, down_split_k=split_k)

    _replay_over_routings(lambda: moe.fused_moe(x, gate, *experts, top_k, gate_bias=bias, **kw, config=cfg), x, bias,
                          8, (None, 3, (0, 1), None),  # the eager run also allocates the split-K counters
                          lambda out: _assert_close_int4(out, ops.moe(x, gate, *experts, top_k, gate_bias=bias, **kw)))


# --- a router's selection bias (DeepSeek-V3's e_score_correction_bias: GLM-4.5, dots1, ERNIE 4.5 MoE, MiniMax-M2) ---
# (scoring, norm_topk_prob, round_weights, routed_scaling_factor, router_fp32, dtype, experts: plain / fp8 / int4)
SELECT_CASES = [
    ("sigmoid", True, False, 2.5, True, torch.bfloat16, "plain"),  # GLM-4.5's / dots1's
    ("sigmoid", False, False, 2.5, True, torch.float32, "plain"),  # not renormalised: the scale alone
    ("softmax", True, True, 1.0, True, torch.bfloat16, "plain"),  # ERNIE 4.5 MoE's: weights rounded
    ("sigmoid", True, False, 1.0, False, torch.float16, "plain"),  # MiniMax-M2's: logits in x's dtype
    ("sigmoid", True, False, 2.5, True, torch.bfloat16, "fp8"),
    ("sigmoid", True, False, 2.5, True, torch.bfloat16, "int4"),  # few slots: the GEMV kernels' path
]


def _select_bias(x: torch.Tensor, gate: torch.Tensor, top_k: int, scoring: str, fp32: bool) -> torch.Tensor:
    """A selection bias [E] fp32 that moves some token's choice: the experts each token ranks first get -1, the
    others up to +0.5 (scores are in (0, 1): the bias outweighs them)."""
    scores = ops.moe_route(x, gate, None, top_k, scoring, router_fp32=fp32)[1]
    bias = torch.linspace(0.5, 0.0, gate.shape[0], device=x.device)
    bias[scores[:, 0].unique()] = -1.0
    return bias


@pytest.mark.parametrize("case", SELECT_CASES, ids=lambda c: f"{c[0]}-norm{int(c[1])}-round{int(c[2])}-s{c[3]}-"
                         f"fp32{int(c[4])}-{str(c[5])[6:]}-{c[6]}")
def test_selection_bias_matches_the_torch_op(case):
    scoring, norm, round_weights, scale, fp32, dtype, experts = case
    num_experts, hidden, inter, num_tokens, top_k = 8, 64, 64, 3 if experts == "int4" else 17, 2
    seed = num_tokens * 100 + hidden + inter + 11
    if experts == "fp8":
        x, gate, weights, scales, _ = _fp8_inputs(num_experts, hidden, inter, num_tokens, dtype, seed)
        kw = dict(w_gate_up_scale=scales[0], w_down_scale=scales[1])
    elif experts == "int4":
        x, gate, weights, kw, _ = _int4_inputs(num_experts, hidden, inter, num_tokens, dtype, seed, 32, False)
    else:
        x, gate, *weights, _ = _inputs(num_experts, hidden, inter, num_tokens, dtype, seed)
        kw = {}
    select_bias = _select_bias(x, gate, top_k, scoring, fp32)
    route = dict(select_bias=select_bias, routed_scaling_factor=scale, router_fp32=fp32)
    args = (x, gate, *weights, top_k, scoring, norm, "silu", None, round_weights)
    out, ref = moe.fused_moe(*args, **kw, **route), ops.moe(*args, **kw, **route)
    (_assert_close_fp8 if experts == "fp8" else _assert_close_int4 if experts == "int4" else _assert_close)(out, ref)
    # the bias changes the choice (each token's first expert is never chosen), and the weights are the scores alone
    chosen = ops.moe_route(x, gate, None, top_k, scoring, norm, select_bias, scale, fp32)
    unbiased = ops.moe_route(x, gate, None, top_k, scoring, norm, None, scale, fp32)
    assert not torch.equal(chosen[1], unbiased[1])
    logits = x.float() @ gate.float().t() if fp32 else (x @ gate.t()).float()
    scores = torch.softmax(logits, -1) if scoring == "softmax" else torch.sigmoid(logits)
    want = scores.gather(1, chosen[1])
    want = (want / want.sum(-1, keepdim=True) if norm else want) * scale
    torch.testing.assert_close(chosen[0], want, rtol=1e-5, atol=1e-6)
    # without the bias (or the scale) the op is another one
    for other in [dict(route, select_bias=None)] + ([dict(route, routed_scaling_factor=1.0)] if scale != 1.0 else []):
        changed = ops.moe(*args, **kw, **other)
        assert (changed.float() - ref.float()).abs().max() > 0.1 * ref.float().abs().max()


@pytest.mark.parametrize("model_type", ["glm4_moe", "ernie4_5_moe", "minimax_m2"])
def test_selection_bias_reference_is_the_families_routers(model_type):
    """kernels.torch_ops.moe_route with the moe op's attrs as the lifter sets them is each family's router in
    transformers (the experts it picks, their weights), on a bias that changes the choice."""
    pytest.importorskip("transformers")
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers has no model_type {model_type!r}")
    E, H, k = 8, 32, 2
    kw = {"glm4_moe": dict(n_routed_experts=E, num_experts_per_tok=k, routed_scaling_factor=2.5, norm_topk_prob=True),
          "ernie4_5_moe": dict(moe_num_experts=E, moe_k=k),
          "minimax_m2": dict(num_local_experts=E, num_experts_per_tok=k)}[model_type]
    cfg = AutoConfig.for_model(model_type, hidden_size=H, **kw)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, H, generator=g)
    weight = torch.randn(E, H, generator=g) * 0.5
    bias = _select_bias(x, weight, k, "softmax" if model_type == "ernie4_5_moe" else "sigmoid", True)
    if model_type == "glm4_moe":
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
        router = Glm4MoeTopkRouter(cfg)
        router.e_score_correction_bias.copy_(bias)
        attrs = dict(scoring="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5, router_fp32=True)
    elif model_type == "ernie4_5_moe":
        from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeTopKRouter
        router = Ernie4_5_MoeTopKRouter(cfg)
        router.moe_statics.e_score_correction_bias.data.copy_(bias[None])
        attrs = dict(scoring="softmax", norm_topk_prob=True, router_fp32=True)
    else:
        from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter
        router = MiniMaxM2TopKRouter(cfg)
        attrs = dict(scoring="sigmoid", norm_topk_prob=True)
    with torch.no_grad():
        router.weight.copy_(weight)
        got = [t.detach() for t in (router(x)[1:] if model_type != "minimax_m2" else router(x, bias)[1:])]
    weights, experts = ops.moe_route(x, weight, None, k, select_bias=bias, **attrs)
    order = got[1].sort(-1).indices  # transformers' topk is unsorted for some: compare as sets, with their weights
    mine = experts.sort(-1).indices
    assert torch.equal(got[1].gather(1, order), experts.gather(1, mine))
    torch.testing.assert_close(got[0].gather(1, order).float(), weights.gather(1, mine), rtol=1e-6, atol=1e-7)
    assert not torch.equal(experts, ops.moe_route(x, weight, None, k, attrs["scoring"])[1])  # the bias counts
