"""GPTQ and AWQ on the outlier variant of the bundled model: lower KL than round-to-nearest at the
same bits and group size; artifacts build, load and generate."""

from __future__ import annotations

import pytest
import torch

from builder.gates import GateThresholds, compare
from builder.quality import GraphModel
from conftest import make_outlier_variant, memo_logits, quantization_setup
from passes import PassContext, run_passes
from passes.quant_math import QuantConfig, fake_quantize_groups

GROUP = 64
# A calibrated method must close at least 40% of round-to-nearest's KL. Measured here on the first bundled model
# (session 10): GPTQ 0.33 of it, AWQ 0.18; AWQ with its scale search off (n_grid 1: the clip search alone) about
# 0.85, and GPTQ without its error feedback is round-to-nearest itself. On the retrained bundled model (hidden 384,
# MLP 1024; session 26) GPTQ's 16 windows of 128 tokens give 0.505: fewer tokens per input feature
MAX_KL_VS_RTN = 0.6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    # 16 windows of 128 tokens: as many as AWQ's block search reads (awq.MAX_BLOCK_WINDOWS)
    return quantization_setup(make_outlier_variant(tmp_path_factory.mktemp("w4") / "ckpt"), 16)


@pytest.fixture(scope="module")
def kl(setup):
    """A graph's KL against the unquantized graph on the eval set; the reference's logits are computed once."""
    graph, _, eval_set = setup
    reference = memo_logits(GraphModel(graph).logits)
    return lambda cand: compare(reference, GraphModel(cand).logits, eval_set, GateThresholds()).metric("kl").value


def _rtn(graph):
    g = graph.copy()
    cfg = QuantConfig(bits=4, group_size=GROUP, symmetric=False)
    for n in g.nodes:
        if n.op == "linear":
            g.params[n.weights["weight"]] = fake_quantize_groups(g.params[n.weights["weight"]], cfg)
    return g


def _build(setup, algo, **options):
    graph, calib, _ = setup
    return run_passes(graph.copy(), [algo, "dce"],
                      PassContext(calibration=calib, options={algo: {"group_size": GROUP, **options}}))


@pytest.fixture(scope="module")
def rtn_kl(setup, kl) -> float:
    return kl(_rtn(setup[0]))


@pytest.fixture(scope="module")
def awq_build(setup, kl):
    """AWQ rounded to nearest (its default) on a coarse grid (5 alphas and clip ratios instead of 20; otherwise the
    defaults: a quarter of the search's time), built and scored once for the tests that compare against it or an
    option against it. AWQ at its default grid is held below round-to-nearest by
    tests/test_fixture_model.py::test_calibrated_4bit_beats_round_to_nearest (pydoc-qwen3) and the quickstart-awq
    recipe's gates."""
    quantized, records = _build(setup, "awq", n_grid=5)
    return quantized, records, kl(quantized)


@pytest.mark.parametrize("algo", ["gptq", "awq"])
def test_beats_round_to_nearest(setup, algo, kl, rtn_kl, request):
    if algo == "awq":
        quantized, records, kl_method = request.getfixturevalue("awq_build")
    else:
        quantized, records = _build(setup, algo)
        kl_method = kl(quantized)
    linears = [n for n in quantized.nodes if n.op == "linear"]
    assert all(n.attrs["quant"]["scheme"] == "w4a16" and n.attrs["quant"]["group_size"] == GROUP for n in linears)
    assert all(quantized.params[n.weights["qweight"]].shape[1] * 2 == n.attrs["in_features"] for n in linears)
    if algo == "awq":  # q/k/v and gate/up scales were searched on their whole block's output
        assert records[0].details["block_objective_groups"] == 8
    assert 0 < kl_method < MAX_KL_VS_RTN * rtn_kl, f"{algo}: KL {kl_method:.5f} vs round-to-nearest {rtn_kl:.5f}"


def test_awq_with_gptq_rounding_beats_awq_rounded_to_nearest(setup, kl, awq_build):
    _, nearest, kl_nearest = awq_build
    assert nearest[0].details["rounding"] == "nearest"
    quantized, records = _build(setup, "awq", rounding="gptq", n_grid=5)
    assert records[0].details["rounding"] == "gptq"
    kl_gptq = kl(quantized)
    assert 0 < kl_gptq < kl_nearest, f"AWQ with GPTQ rounding: KL {kl_gptq:.3e} vs rounded to nearest {kl_nearest:.3e}"


def test_bad_group_size_is_an_actionable_error(setup):
    graph, calib, _ = setup
    from passes import PassError

    with pytest.raises(PassError, match="in_features 384, not divisible by group_size 256; use 128, 64, 32, 16"):
        run_passes(graph.copy(), ["gptq"], PassContext(calibration=calib, options={"gptq": {"group_size": 256}}))


def test_awq_block_runner_reproduces_the_attention_block(setup):
    """The block AWQ's scale search scores (q/k/v -> rope -> attention -> o_proj) equals the graph's own."""
    from passes.awq import BlockRunner
    from runtime.executor import Executor, SeqSlice, StepInput
    from runtime.kv_cache import SequenceKV

    graph, calib, _ = setup
    qkv = next(i for i, n in enumerate(graph.nodes) if n.op == "linear" and len(n.outputs) == 3)
    o_proj = next(i for i, n in enumerate(graph.nodes) if i > qkv and n.op == "linear")
    ex = Executor(graph.to_dict(), graph.params)
    seen: dict[int, torch.Tensor] = {}
    ids = calib[0][:64]
    env = ex.start(StepInput(torch.tensor(ids), torch.arange(len(ids)),
                             [SeqSlice(SequenceKV(ex.kv_layout(), len(ids)), 0, len(ids))]))
    ex.run_nodes(env, 0, o_proj + 2, lambda i, xs: seen.__setitem__(i, xs[0]))
    block = BlockRunner.for_group(graph, [qkv], graph.nodes[qkv].inputs[0], [seen[qkv]])
    assert block is not None and block.output == graph.nodes[o_proj].outputs[0]
    weight = graph.params[graph.nodes[qkv].weights["weight"]]
    expected = torch.nn.functional.linear(seen[o_proj], graph.params[graph.nodes[o_proj].weights["weight"]])
    assert torch.allclose(block(block.x, [weight]), expected, atol=1e-5)


@pytest.mark.parametrize("quantize_v", [False, True])
def test_awq_output_projection_scale_folds_into_v_exactly(setup, quantize_v):
    """AWQ's output-projection scale (``scale_output``) divides v's rows (its per-(row, group) scales once v is
    quantized) and multiplies o_proj's input columns: the model computes the same function."""
    from passes.awq import _fold_target
    from passes.quant_math import pack_int4, quantize_groups
    from passes.quantize import replace_weight

    graph = setup[0].copy()
    attn = next(n for n in graph.nodes if n.op == "attention")
    o_proj = next(i for i, n in enumerate(graph.nodes) if n.op == "linear" and n.inputs[0] == attn.outputs[0])
    if quantize_v:  # as it is when o_proj's segment runs: the qkv linear is quantized already
        qkv = graph.producers()[attn.inputs[2]]
        codes, scales, zeros = quantize_groups(graph.params[qkv.weights["weight"]], QuantConfig(4, GROUP))
        replace_weight(graph, qkv, "w4a16", {"qweight": pack_int4(codes), "scales": scales, "zeros": zeros},
                       {"bits": 4, "group_size": GROUP, "symmetric": False})
    ids = setup[1][0][:48]
    before = GraphModel(graph).logits(ids)
    fold, heads = _fold_target(graph, attn, attn.outputs[0], [o_proj], scale_output=True)
    assert fold is not None and heads is not None
    kv, group, dim = heads
    s = torch.rand(kv, 1, dim, generator=torch.Generator().manual_seed(3)).add(0.5).expand(kv, group, dim).reshape(-1)
    fold(graph, s)
    name = graph.nodes[o_proj].weights["weight"]
    graph.params[name] = graph.params[name] * s[None, :]
    after = GraphModel(graph).logits(ids)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    assert _fold_target(graph, attn, attn.outputs[0], [o_proj], scale_output=False) == (None, None)


def test_awq_scales_the_output_projections(awq_build, setup):
    _, records, _ = awq_build
    layers = sum(n.op == "attention" for n in setup[0].nodes)
    # per layer: q/k/v (norm), gate/up (norm), down (up's rows) and o_proj (v's rows)
    assert records[0].details["scaled_groups"] == 4 * layers


def test_awq_joint_clip_beats_round_to_nearest(setup, kl, rtn_kl):
    quantized, records = _build(setup, "awq", joint_clip=True, n_grid=3)  # a clip search per alpha: a coarse grid
    assert records[0].details["joint_clip"] is True and records[0].details["scale_output"] is True
    assert 0 < kl(quantized) < MAX_KL_VS_RTN * rtn_kl


def test_awq_joint_clip_needs_the_clip_search(setup):
    from passes import PassError

    with pytest.raises(PassError, match="joint_clip .* needs the clip search"):
        _build(setup, "awq", joint_clip=True, rounding="gptq")


def test_awq_scale_refit_lowers_the_kl(setup, kl, awq_build):
    """The default refit of each row's group scales (least squares on the calibration inputs, codes fixed) gives a
    lower KL on the eval text than the same build with the grid fitted to the weights alone."""
    _, records, kl_refit = awq_build
    assert records[0].details["refit_scales"] is True
    quantized, plain = _build(setup, "awq", refit_scales=False, n_grid=5)
    assert plain[0].details["refit_scales"] is False
    kl_plain = kl(quantized)
    assert 0 < kl_refit < kl_plain, (kl_refit, kl_plain)


def test_gptq_true_sequential_calibrates_each_linear_through_the_quantized_ones_before_it(setup):
    """``true_sequential: true`` calibrates a layer's linears in turn, each on inputs through the quantized linears
    before it (``segments(at_linears=True)``); the default calibrates them all through the layer's float weights.
    The first linear of the model reads the embeddings either way, so its codes agree; a later one's differ."""
    from passes.quantize import segments

    graph, _, _ = setup
    cuts = segments(graph, at_linears=True)
    starts = {s.start for s in cuts}
    linears = [i for i, n in enumerate(graph.nodes) if n.op == "linear"]
    assert set(linears[1:]) <= starts and cuts[0].start == 0 and cuts[-1].end == len(graph.nodes)
    assert all(a.end == b.start for a, b in zip(cuts, cuts[1:]))
    layers = [layer for s in cuts for layer in s.attention_layers]
    assert layers == sorted(layers) and len(layers) == sum(n.op == "attention" for n in graph.nodes)
    assert len(segments(graph)) < len(cuts)

    seq, _ = _build(setup, "gptq", true_sequential=True)
    flat, _ = _build(setup, "gptq")
    codes = [[g.params[n.weights["qweight"]] for n in g.nodes if n.op == "linear"] for g in (seq, flat)]
    assert torch.equal(codes[0][0], codes[1][0])
    assert any(not torch.equal(a, b) for a, b in zip(codes[0][1:], codes[1][1:]))


def test_awq_w4a8_rounds_each_linear_input_and_beats_its_round_to_nearest(setup, kl, awq_build):
    """activation_quant: fp8 (W4A8): every linear AWQ quantizes carries it (the lm_head, unquantized here, does
    not), the reference executor rounds their inputs per token to e4m3 (the KL moves off W4A16's), and AWQ still
    closes the share of round-to-nearest's KL the W4A16 test asks for against round-to-nearest W4A8 (the gate's
    counterpart, builder.quality.rtn_counterpart, which keeps the fp8 inputs)."""
    from builder.quality import rtn_counterpart

    graph = setup[0]
    quantized, _ = _build(setup, "awq", n_grid=5, activation_quant="fp8")
    linears = [n for n in quantized.nodes if n.op == "linear"]
    assert linears and all(n.attrs["quant"]["activation_quant"] == "fp8" for n in linears)
    assert all("activation_quant" not in n.attrs.get("quant", {}) for n in quantized.nodes if n.op == "lm_head")
    rtn, why = rtn_counterpart(graph, quantized)
    assert rtn is not None, why
    assert all(n.attrs["quant"]["activation_quant"] == "fp8" for n in rtn.nodes if n.attrs.get("quant"))
    w4a8_kl, rtn_kl, w4a16_kl = kl(quantized), kl(rtn), awq_build[2]
    assert w4a8_kl != w4a16_kl
    assert w4a8_kl < MAX_KL_VS_RTN * rtn_kl, (w4a8_kl, rtn_kl, w4a16_kl)


def test_activation_quant_takes_4_bit_weights_only(setup):
    with pytest.raises(Exception, match="4-bit"):
        _build(setup, "gptq", bits=8, activation_quant="fp8")
    with pytest.raises(Exception, match="'fp8'"):
        _build(setup, "awq", activation_quant="int8")
