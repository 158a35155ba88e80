"""The IR primitives LayerNorm, partial / interleaved rotary, fused linears, plain MLPs, Conv1D linears, position
embeddings, soft-capped attention and attention sinks lift to: the runtime's references against Hugging Face's own
modules, GPT-NeoX's graph (its fused per-head q/k/v), Falcon's variants (fused q/k/v per group of heads or per head)
and gpt-oss's attention (sinks) against the HF models they were traced from, tensor parallelism over the new shapes,
and the lifter's errors on fused linears it cannot split.

The family builds themselves (verify, artifact, runtime, 32 greedy tokens) are tests/passes/test_families.py.
"""

from __future__ import annotations

import pytest
import torch

from kernels import torch_ops as ops
from passes import PassContext, run_passes
from passes.ir import Graph
from passes.trace import trace
from passes.verify import run_graph
from test_families import GPT_NEOX, Family, family_config, make_family_model
from test_shard import run_ranks

PIPELINE = ["merge_qkv", "merge_gate_up", "fuse_silu_mul", "fuse_add_rms_norm", "dce"]
VOCAB = 96
PHI2 = Family("Phi-2", "phi", dict(num_hidden_layers=1))
GPT2 = Family("GPT-2", "gpt2", dict(num_hidden_layers=1, n_inner=112))  # n_inner: the MLP size, as the others'


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (1, 9, 33)]


# Falcon's other layouts (the default one is built by test_families.py): the new decoder architecture (Falcon-40B /
# 180B: q/k/v fused per group of heads, a kv head per group, two LayerNorms) and the sequential one with q/k/v fused
# per head
FALCON_VARIANTS = [
    Family("Falcon (new decoder architecture)", "falcon",
           dict(num_hidden_layers=1, new_decoder_architecture=True, num_kv_heads=2, bias=True)),
    Family("Falcon (sequential)", "falcon", dict(num_hidden_layers=1, multi_query=False, parallel_attn=False)),
]
GPT_OSS = Family("gpt-oss", "gpt_oss", dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8))

_GRAPHS: dict[str, tuple[Graph, torch.nn.Module]] = {}


def traced(family: Family) -> tuple[Graph, torch.nn.Module]:
    """``family`` traced, with the HF model's own tensors attached (no checkpoint: names are the model's; Conv1D
    weights transposed, as the checkpoint reader does), through the default graph passes; cached per family, a copy
    each call."""
    key = f"{family.name}:{family.model_type}"
    if key not in _GRAPHS:
        model = make_family_model(family, VOCAB)
        _GRAPHS[key] = _with_weights(trace(family_config(family, VOCAB))[0], model), model
    graph, model = _GRAPHS[key]
    return graph.copy(), model


def _with_weights(graph: Graph, model: torch.nn.Module) -> Graph:
    state = model.state_dict()
    transposed = graph.meta.pop("transposed_weights", [])
    graph.params = {k: (state[k].t().contiguous() if k in transposed else state[k]) if v.is_meta else v
                    for k, v in graph.params.items()}
    graph.meta["dtype"] = "float32"
    return run_passes(graph, PIPELINE, PassContext())[0]


def _hf_logits(model: torch.nn.Module, prompts: list[list[int]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(torch.tensor([p]), use_cache=False).logits[0] for p in prompts]


# --- the runtime's references against HF's modules ---------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_reference_matches_hf(dtype):
    """ops.layer_norm against nn.LayerNorm with and without bias, OLMo's (no weight, no bias) and Cohere's (written
    out in fp32): fp32 inside, one rounding, bit for bit in bf16."""
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm
    from transformers.models.olmo.modeling_olmo import OlmoLayerNorm

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 96, generator=gen) * 3 + 1).to(dtype)
    norms = [torch.nn.LayerNorm(96, eps=1e-5), torch.nn.LayerNorm(96, eps=1e-6, bias=False),
             CohereLayerNorm(96, eps=1e-5)]
    for norm in norms:
        with torch.no_grad():
            norm.weight.copy_(1 + 0.3 * torch.randn(96, generator=gen))
            if getattr(norm, "bias", None) is not None:
                norm.bias.copy_(0.5 * torch.randn(96, generator=gen))
        norm = norm.to(dtype)
        bias = getattr(norm, "bias", None)
        eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
        ours = ops.layer_norm(x, norm.weight.detach(), None if bias is None else bias.detach(), eps)
        if isinstance(norm, CohereLayerNorm) and dtype == torch.float32:  # its own fp32 arithmetic: an ulp apart
            torch.testing.assert_close(ours, norm(x).detach())
        else:
            assert torch.equal(ours, norm(x).detach()), type(norm).__name__
    assert torch.equal(ops.layer_norm(x, None, None, 1e-5), OlmoLayerNorm(96)(x))


def test_partial_and_interleaved_rope_references_match_hf():
    """ops.rope on the first rotary_dim features of each head (GPT-NeoX's rotate-half) and on GPT-J pairs
    (Cohere's), with ops.rope_tables against HF's rotary modules' cos/sin."""
    from transformers.models.cohere import modeling_cohere as cohere
    from transformers.models.gpt_neox import modeling_gpt_neox as neox

    positions = torch.tensor([0, 1, 2, 5, 40, 300])
    q = torch.randn(len(positions), 4 * 16, generator=torch.Generator().manual_seed(0))
    for module, family, interleaved in ((neox, GPT_NEOX, False),
                                        (cohere, Family("Cohere", "cohere", dict(head_dim=16)), True)):
        config = family_config(family, VOCAB)
        rotary = (module.GPTNeoXRotaryEmbedding if module is neox else module.CohereRotaryEmbedding)(config)
        qh = q.view(len(positions), 4, 16).transpose(0, 1)[None]  # [1, heads, tokens, head_dim]
        cos, sin = rotary(qh, positions[None])
        expected, _ = module.apply_rotary_pos_emb(qh, qh, cos, sin)
        tables = ops.rope_tables(positions, rotary.inv_freq, rotary.attention_scaling, q.dtype, interleaved)
        rotary_dim = 2 * rotary.inv_freq.numel()
        assert rotary_dim == (4 if module is neox else 16)
        ours = ops.rope(q, *tables, 4, 16, rotary_dim, interleaved)
        torch.testing.assert_close(ours, expected[0].transpose(0, 1).reshape(q.shape), rtol=0, atol=1e-6)


@pytest.mark.parametrize("model_type, window", [("gemma2", None), ("gemma2", 5), ("gpt_oss", None), ("gpt_oss", 5)])
@pytest.mark.parametrize("num_context", [0, 9])
def test_capped_and_sink_attention_references_match_hf(model_type, window, num_context):
    """ops.attention_one with soft-capped scores against Gemma 2's eager attention, with attention sinks against
    gpt-oss's: fresh prompts and the last rows of a chunk after a cached context, with and without a sliding
    window, grouped-query heads."""
    from types import SimpleNamespace

    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_attention
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_attention

    gen = torch.Generator().manual_seed(num_context + (window or 0))
    num_heads, num_kv, head_dim, num_tokens, scale = 4, 2, 16, 23, 0.3
    q = torch.randn(1, num_heads, num_tokens, head_dim, generator=gen)
    k = torch.randn(1, num_kv, num_tokens, head_dim, generator=gen)
    v = torch.randn(1, num_kv, num_tokens, head_dim, generator=gen)
    sinks = torch.randn(num_heads, generator=gen) if model_type == "gpt_oss" else None
    softcap = 1.5 if model_type == "gemma2" else 0.0
    pos = torch.arange(num_tokens)
    visible = pos[None, :] <= pos[:, None]
    if window:
        visible &= pos[None, :] > pos[:, None] - window
    mask = torch.zeros(num_tokens, num_tokens).masked_fill(~visible, float("-inf"))[None, None]
    module = SimpleNamespace(num_key_value_groups=num_heads // num_kv, head_dim=head_dim, training=False, sinks=sinks)
    if model_type == "gemma2":
        expected, _ = gemma2_attention(module, q, k, v, mask, scaling=scale, softcap=softcap)
    else:
        expected, _ = gpt_oss_attention(module, q, k, v, mask, scaling=scale)
    ours = ops.attention_one(q[0].transpose(0, 1)[num_context:], k[0].transpose(0, 1), v[0].transpose(0, 1),
                             num_context, scale, window, softcap, sinks)
    torch.testing.assert_close(ours, expected[0, num_context:].reshape(num_tokens - num_context, -1),
                               rtol=1e-5, atol=1e-5)
    plain = ops.attention_one(q[0].transpose(0, 1)[num_context:], k[0].transpose(0, 1), v[0].transpose(0, 1),
                              num_context, scale, window)
    assert (plain - ours).abs().max() > 1e-2  # the cap and the sinks change these scores


# --- GPT-NeoX's graph: q/k/v fused per head ---------------------------------------------------------
def test_gpt_neox_graph_matches_hf():
    """GPT-NeoX's graph, with the model's tensors: q/k/v rows fused per head become one linear with split_heads,
    rotary covers a quarter of each head, the MLP and attention read two LayerNorms of one residual (parallel)."""
    graph, model = traced(GPT_NEOX)
    qkv = next(n for n in graph.nodes if n.op == "linear" and len(n.outputs) == 3)
    assert qkv.attrs["split_heads"] == 4 and qkv.attrs["split_sizes"] == [16, 16, 16]
    assert [n.attrs.get("rotary_dim") for n in graph.nodes if n.op == "rope"] == [4, 4]
    ops_count = graph.count_ops()
    assert ops_count["layer_norm"] == 3 and "rms_norm" not in ops_count and "fused_add_rms_norm" not in ops_count
    prompts = _prompts()
    for ours, ref in zip(run_graph(graph, prompts), _hf_logits(model, prompts)):
        assert (ours - ref).abs().max().item() < 1e-4


# --- Falcon's layouts and gpt-oss's attention ----------------------------------------------------------
@pytest.mark.parametrize("family, split_heads, split_sizes, num_kv_heads, biases", [
    (FALCON_VARIANTS[0], 2, [32, 16, 16], 2, True),  # per group: its 2 query heads, then its kv head's k and v
    (FALCON_VARIANTS[1], 4, [16, 16, 16], 4, False),  # per head: q, k, v
], ids=["new_decoder_architecture", "sequential"])
def test_falcon_layouts_match_hf(family, split_heads, split_sizes, num_kv_heads, biases):
    """Falcon's x @ weight.T (+ bias) linears are linears of the stored weight; its fused q/k/v, viewed per group of
    heads (the group's kv head broadcast over its query heads: grouped-query attention) or per head, is one linear
    with split_heads; the graph's logits equal HF's."""
    graph, model = traced(family)
    qkv = next(n for n in graph.nodes if n.op == "linear" and len(n.outputs) == 3)
    assert (qkv.attrs["split_heads"], qkv.attrs["split_sizes"]) == (split_heads, split_sizes)
    assert [n.attrs["num_kv_heads"] for n in graph.nodes if n.op == "attention"] == [num_kv_heads]
    linears = [n for n in graph.nodes if n.op == "linear"]
    assert len(linears) == 4 and all(("bias" in n.weights) == biases for n in linears)
    assert graph.count_ops()["layer_norm"] == 3
    prompts = _prompts()
    for ours, ref in zip(run_graph(graph, prompts), _hf_logits(model, prompts)):
        assert (ours - ref).abs().max().item() < 1e-4


def test_gpt_oss_attention_sinks_match_hf(gpt_oss_attention_only, monkeypatch):
    """gpt-oss's attention, traced through the tracer's attention node: its sinks a weight of each attention node,
    sliding then global layers; the graph's logits equal HF's eager attention's. Sharded over two ranks, each keeps
    its own heads' sinks and the logits stay the same. (Without its experts: tests/passes/test_families.py shards
    the whole model.)"""
    model = make_family_model(GPT_OSS, VOCAB)
    graph = _with_weights(trace(family_config(GPT_OSS, VOCAB))[0], model)
    attn = [n for n in graph.nodes if n.op == "attention"]
    assert [(a.attrs.get("sliding_window"), a.weights["sinks"]) for a in attn] == [
        (8, "model.layers.0.self_attn.sinks"), (None, "model.layers.1.self_attn.sinks")]
    prompts = _prompts()
    for ours, ref in zip(run_graph(graph, prompts), _hf_logits(model, prompts)):
        assert (ours - ref).abs().max().item() < 1e-4
    sharded, _ = run_passes(graph.copy(), ["shard"], PassContext(options={"shard": {"tp_size": 2}}))
    sinks = attn[0].weights["sinks"]
    assert list(sharded.params[sinks].shape) == [2]
    assert torch.equal(sharded.shards.tensor(sinks, 1), graph.params[sinks][2:])
    expected = run_graph(graph, prompts[1:])
    for rank_logits in run_ranks(sharded, prompts[1:], monkeypatch):
        for ours, ref in zip(rank_logits, expected):
            assert (ours - ref).abs().max().item() < 1e-5


# --- tensor parallelism over the new shapes -----------------------------------------------------------
@pytest.mark.parametrize("family", [GPT_NEOX, PHI2, GPT2], ids=lambda f: f.model_type)
def test_shard_splits_plain_mlps_and_per_head_fused_qkv(family, monkeypatch):
    """fc1 -> GeLU -> fc2 is split like gate/up -> down (column, then row + all_reduce); GPT-NeoX's per-head q/k/v
    rows by whole heads, GPT-2's Conv1D ones (transposed on read) as any linear's; biases follow their rows. Two
    ranks' logits equal the unsharded graph's."""
    graph, _ = traced(family)
    ctx = PassContext(options={"shard": {"tp_size": 2}})
    sharded, records = run_passes(graph.copy(), ["shard"], ctx)
    assert records[0].details["column_linears"] == records[0].details["row_linears"] == 2
    fc1 = next(n for n in sharded.nodes if n.op == "linear" and any(u.op == "activation" and u.inputs == n.outputs
                                                                    for u in sharded.nodes))
    assert fc1.attrs["out_features"] == 56 and list(sharded.params[fc1.weights["bias"]].shape) == [56]
    assert sum(n.op == "all_reduce" for n in sharded.nodes) == 2
    if family is GPT_NEOX:
        qkv = next(n for n in sharded.nodes if n.op == "linear" and len(n.outputs) == 3)
        assert qkv.attrs["split_heads"] == 2 and qkv.attrs["out_features"] == 96
    prompts = _prompts()[1:]
    expected = run_graph(graph, prompts)
    for rank_logits in run_ranks(sharded, prompts, monkeypatch):
        for ours, ref in zip(rank_logits, expected):
            assert (ours - ref).abs().max().item() < 1e-5


def test_shard_keeps_the_position_table_whole(monkeypatch):
    """With vocab_parallel, GPT-2's token table (tied to the lm_head) is split by vocabulary rows; its table of
    position embeddings has none and stays whole on every rank. Two ranks' logits equal the unsharded graph's."""
    graph, model = traced(GPT2)
    prompts = _prompts()
    for ours, ref in zip(run_graph(graph, prompts), _hf_logits(model, prompts)):
        assert (ours - ref).abs().max().item() < 1e-4
    ctx = PassContext(options={"shard": {"tp_size": 2, "vocab_parallel": True}})
    sharded, _ = run_passes(graph.copy(), ["shard"], ctx)
    tokens, positions = (n for n in sharded.nodes if n.op == "embedding")
    assert tokens.inputs == ["input_ids"] and tokens.attrs["vocab_parallel"]
    assert positions.inputs == ["positions"] and "vocab_parallel" not in positions.attrs
    assert list(sharded.params[tokens.weights["weight"]].shape) == [VOCAB // 2, 64]
    assert list(sharded.params[positions.weights["weight"]].shape) == [512, 64]
    expected = run_graph(graph, prompts[1:])
    for rank_logits in run_ranks(sharded, prompts[1:], monkeypatch):
        for ours, ref in zip(rank_logits, expected):
            assert (ours - ref).abs().max().item() < 1e-5


# --- quantization -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", [GPT_NEOX, PHI2, GPT2], ids=lambda f: f.model_type)
@pytest.mark.parametrize("algo, options, scheme, bound", [
    ("int8_wo", {}, "w8a16", 0.02),
    ("awq", {"group_size": 16}, "w4a16", 0.12),
])
def test_quantization_takes_the_new_linears(family, algo, options, scheme, bound):
    """Per-head fused q/k/v, plain MLPs, Conv1D linears and linears after a LayerNorm are quantized as any linear;
    the logits stay close to the float graph's."""
    graph, _ = traced(family)
    gen = torch.Generator().manual_seed(0)
    calibration = [torch.randint(0, VOCAB, (32,), generator=gen).tolist() for _ in range(6)]
    ctx = PassContext(calibration=calibration, options={algo: options})
    quantized, records = run_passes(graph.copy(), [algo, "dce"], ctx)
    linears = [n for n in quantized.nodes if n.op == "linear"]
    assert records[0].matched == len(linears) == 4 and all(n.attrs["quant"]["scheme"] == scheme for n in linears)
    prompts = _prompts()
    for ours, ref in zip(run_graph(quantized, prompts), run_graph(graph, prompts)):
        assert 0 < ((ours - ref).norm() / ref.norm()).item() < bound


# --- what the lifter refuses ----------------------------------------------------------------------------
class _Fused(torch.nn.Module):
    """An embedding, one linear whose output is sliced (``parts``), and a logits linear over the parts' sum."""

    def __init__(self, parts: list[tuple[int, int]]) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.fused = torch.nn.Linear(32, 64)
        self.head = torch.nn.Linear(16, VOCAB)
        self.parts = parts

    def forward(self, input_ids, use_cache=False):
        y = self.fused(self.embed(input_ids))
        out = y[..., self.parts[0][0]:self.parts[0][1]]
        for a, b in self.parts[1:]:
            out = out + y[..., a:b]
        return self.head(out)


@pytest.mark.parametrize("parts, error", [
    ([(0, 16), (16, 32), (32, 48), (48, 64)], None),
    ([(0, 16), (32, 48)], r"slices \[\(0, 16\), \(32, 48\)\] read of linear 'fused'.* do not tile its 64"),
    ([(0, 16), (8, 24), (16, 32), (32, 48), (48, 64)], r"do not tile"),
])
def test_fused_linear_slices_must_tile_its_output(parts, error):
    from passes.lift import LiftContext, LiftError, lift
    from passes.trace import export_model

    model = _Fused(parts).eval()
    with torch.device("meta"):
        model = model.to("meta")
    ctx = LiftContext(model=model, rotary=lambda buffer: (torch.ones(1), 1.0))
    if error is None:
        graph = lift(export_model(model), ctx)
        fused = next(n for n in graph.nodes if n.source == "fused")
        assert fused.attrs["split_sizes"] == [16] * 4 and len(fused.outputs) == 4
        return
    with pytest.raises(LiftError, match=error):
        lift(export_model(model), ctx)


class _PositionTable(torch.nn.Module):
    """Token embeddings plus a table of learned position embeddings read at the positions + ``offset`` (OPT's: 2)."""

    def __init__(self, offset: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.wpe = torch.nn.Embedding(64, 32)
        self.head = torch.nn.Linear(32, VOCAB)
        self.offset = offset

    def forward(self, input_ids, use_cache=False):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device) + self.offset
        return self.head(self.embed(input_ids) + self.wpe(positions[None]))


@pytest.mark.parametrize("offset", [0, 2])
def test_position_table_is_read_at_the_positions_themselves(offset):
    """A table looked up by arange over the tokens is an embedding of the graph's positions; one read at an offset
    from them is refused, saying so, rather than lifted a row off."""
    from passes.lift import LiftContext, LiftError, lift
    from passes.trace import export_model

    model = _PositionTable(offset).eval().to("meta")
    ctx = LiftContext(model=model, rotary=lambda buffer: (torch.ones(1), 1.0))
    if offset:
        with pytest.raises(LiftError, match=r"embedding 'wpe' is looked up at the positions \+ 2; the embedding op "
                                            r"reads the positions themselves"):
            lift(export_model(model), ctx)
        return
    graph = lift(export_model(model), ctx)
    assert [(n.inputs, n.weights["weight"]) for n in graph.nodes if n.op == "embedding"] == [
        (["input_ids"], "embed.weight"), (["positions"], "wpe.weight")]


class _IndexLists(torch.nn.Module):
    """One linear whose 48 output features are read in three parts of 16, the first by an index list."""

    def __init__(self, first: list[int]) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.fused = torch.nn.Linear(32, 48)
        self.head = torch.nn.Linear(16, VOCAB)
        self.first = first

    def forward(self, input_ids, use_cache=False):
        y = self.fused(self.embed(input_ids))
        return self.head(y[..., self.first] + y[..., 16:32] + y[..., [-16, -15, -14, -13, -12, -11, -10, -9, -8, -7,
                                                                        -6, -5, -4, -3, -2, -1]])


@pytest.mark.parametrize("contiguous", [True, False])
def test_index_lists_of_contiguous_constants_are_slices(contiguous):
    """An index list of contiguous, ascending constants (Falcon's qkv[..., [-2], :], negative ones too) is traced as
    the slice it equals, one of the fused linear's parts; any other list is refused, naming the op."""
    from passes.lift import LiftContext, LiftError, lift
    from passes.trace import export_model

    model = _IndexLists(list(range(16)) if contiguous else list(range(0, 32, 2))).eval().to("meta")
    ctx = LiftContext(model=model, rotary=lambda buffer: (torch.ones(1), 1.0))
    if not contiguous:
        with pytest.raises(LiftError, match=r"unsupported op aten\.index\.Tensor applied to per-token values .* by a "
                                            r"list other than one of contiguous, ascending constants"):
            lift(export_model(model), ctx)
        return
    fused = next(n for n in lift(export_model(model), ctx).nodes if n.source == "fused")
    assert fused.attrs["split_sizes"] == [16, 16, 16] and len(fused.outputs) == 3


class _WeightlessNormSquares(torch.nn.Module):
    """NanoChat's and Arcee's pieces: an RMSNorm without a gain (x * rsqrt(mean(x^2) + eps) in fp32, nothing after)
    read by two linears, and squares that are not a norm's (relu2 = torch.square(relu(x)), and a pow(x, 2))."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.up = torch.nn.Linear(32, 48)
        self.other = torch.nn.Linear(32, 48)
        self.down = torch.nn.Linear(48, 32)
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, input_ids, use_cache=False):
        x = self.embed(input_ids)
        h = x.float()
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x)
        y = torch.square(torch.relu(self.up(h))) + self.other(h).pow(2)
        return self.head(x + self.down(y))


def test_weightless_norm_and_squares_lift_to_existing_ops():
    """A norm with no gain after it is an rms_norm without a weight, emitted once for its two readers; a square
    that no mean reads (squared ReLU) is x * x. The graph's logits are the module's."""
    from passes.lift import LiftContext, lift
    from passes.trace import export_model

    model = _WeightlessNormSquares().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    meta = _WeightlessNormSquares().eval().to("meta")
    graph = lift(export_model(meta), LiftContext(model=meta, rotary=lambda buffer: (torch.ones(1), 1.0)))
    norms = [n for n in graph.nodes if n.op == "rms_norm"]
    assert len(norms) == 1 and not norms[0].weights and norms[0].attrs["eps"] == 1e-6
    squares = [n for n in graph.nodes if n.op == "elementwise" and n.attrs["fn"] == "mul"]
    assert len(squares) == 2 and all(n.inputs[0] == n.inputs[1] for n in squares)
    assert [n.attrs["fn"] for n in graph.nodes if n.op == "activation"] == ["relu"]
    graph.params = {k: state[k] for k in graph.params}
    prompts = _prompts()
    with torch.no_grad():
        expected = [model(torch.tensor([p]))[0] for p in prompts]
    for ours, ref in zip(run_graph(graph, prompts), expected):
        assert (ours - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("family, error", [
    # Falcon-RW's ALiBi biases would trace as an SDPA mask the lifter takes for a causal one: refused by name
    (Family("Falcon", "falcon", dict(num_hidden_layers=1, alibi=True)),
     r"model_type 'falcon' has alibi = True in its config\.json: ALiBi position biases added to the attention "
     r"scores, which the attention op does not compute"),
    # the tracer's attention implementation gets no mask: it refuses attention that is not causal
    (Family("Gemma 2", "gemma2", dict(num_hidden_layers=1, head_dim=16, use_bidirectional_attention=True)),
     r"attention of Gemma2Attention \(layer 0\) is not causal \(bidirectional\); the attention op is causal"),
], ids=["alibi", "bidirectional"])
def test_attention_the_op_does_not_compute_is_refused(family, error):
    from passes.lift import LiftError

    with pytest.raises(LiftError, match=error):
        trace(family_config(family, VOCAB))


PERSIMMON = Family("Persimmon", "persimmon", dict(num_hidden_layers=1))


def test_shard_runs_per_head_layer_norms_on_each_ranks_heads(monkeypatch):
    """Persimmon's q/k LayerNorms over each head's features (layer_norm with head_dim) run on a rank's own heads, as
    per-head RMSNorms do; their gain and bias, one per head feature, stay whole. Two ranks' logits equal the
    unsharded graph's, which equal HF's."""
    graph, model = traced(PERSIMMON)
    norms = [n for n in graph.nodes if n.op == "layer_norm" and n.attrs.get("head_dim")]
    assert len(norms) == 2
    prompts = _prompts()
    for ours, ref in zip(run_graph(graph, prompts), _hf_logits(model, prompts)):
        assert (ours - ref).abs().max().item() < 1e-4
    sharded, _ = run_passes(graph.copy(), ["shard"], PassContext(options={"shard": {"tp_size": 2}}))
    for n in (n for n in sharded.nodes if n.op == "layer_norm" and n.attrs.get("head_dim")):
        assert list(sharded.params[n.weights["weight"]].shape) == [n.attrs["head_dim"]]
    expected = run_graph(graph, prompts[1:])
    for rank_logits in run_ranks(sharded, prompts[1:], monkeypatch):
        for ours, ref in zip(rank_logits, expected):
            assert (ours - ref).abs().max().item() < 1e-5


MINISTRAL3 = Family("Ministral 3", "ministral3", dict(num_hidden_layers=1, head_dim=16, rope_parameters={
    "rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 4, "beta_fast": 32.0,
    "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}))


def test_shard_runs_the_query_temperature_on_each_ranks_heads(monkeypatch):
    """Ministral 3's query temperature (position_scale, 1 + beta log(1 + floor(p / 4)) here) runs on a rank's own
    query heads with the whole positions. Two ranks' logits equal the unsharded graph's, which equal HF's."""
    graph, model = traced(MINISTRAL3)
    scale = next(n for n in graph.nodes if n.op == "position_scale")
    assert scale.attrs == {"beta": 0.1, "period": 4} and scale.inputs[1] == "positions"
    assert any(n.op == "linear" and len(n.outputs) == 3 for n in graph.nodes)  # q/k/v merged through the scale
    prompts = _prompts()
    for ours, ref in zip(run_graph(graph, prompts), _hf_logits(model, prompts)):
        assert (ours - ref).abs().max().item() < 1e-4
    sharded, _ = run_passes(graph.copy(), ["shard"], PassContext(options={"shard": {"tp_size": 2}}))
    expected = run_graph(graph, prompts[1:])
    for rank_logits in run_ranks(sharded, prompts[1:], monkeypatch):
        for ours, ref in zip(rank_logits, expected):
            assert (ours - ref).abs().max().item() < 1e-5


APERTUS = Family("Apertus", "apertus", dict(num_hidden_layers=1, head_dim=16))


def test_xielu_reads_its_weights_and_buffers_and_runs_on_each_ranks_share(monkeypatch):
    """Apertus's xIELU is one xielu op reading the module's alpha_p / alpha_n weights and its beta / eps buffers;
    split across ranks with the MLP's intermediate features, its four scalars stay whole on each. Two ranks' logits
    equal the unsharded graph's, which equal HF's."""
    graph, model = traced(APERTUS)
    act = next(n for n in graph.nodes if n.op == "xielu")
    assert sorted(act.weights) == ["alpha_n", "alpha_p", "beta", "eps"]
    assert all(graph.params[w].numel() == 1 for w in act.weights.values())
    prompts = _prompts()
    for ours, ref in zip(run_graph(graph, prompts), _hf_logits(model, prompts)):
        assert (ours - ref).abs().max().item() < 1e-4
    sharded, records = run_passes(graph.copy(), ["shard"], PassContext(options={"shard": {"tp_size": 2}}))
    assert records[0].details["column_linears"] == records[0].details["row_linears"] == 2  # the MLP split too
    expected = run_graph(graph, prompts[1:])
    for rank_logits in run_ranks(sharded, prompts[1:], monkeypatch):
        for ours, ref in zip(rank_logits, expected):
            assert (ours - ref).abs().max().item() < 1e-5


COHERE_QK = Family("Cohere (q/k norms)", "cohere", dict(num_hidden_layers=1, use_qk_norm=True))


def test_shard_splits_per_head_gains_with_their_heads(monkeypatch):
    """Command R+'s q/k LayerNorms carry a gain per head ([heads, head_dim]): each rank keeps its own heads' rows of
    it (q: 4 heads, 2 a rank; k: 2 kv heads, 1 a rank). Two ranks' logits equal the unsharded graph's, which equal
    HF's."""
    graph, model = traced(COHERE_QK)
    norms = [n for n in graph.nodes if n.op == "layer_norm" and n.attrs.get("head_dim")]
    assert sorted(tuple(graph.params[n.weights["weight"]].shape) for n in norms) == [(2, 16), (4, 16)]
    prompts = _prompts()
    for ours, ref in zip(run_graph(graph, prompts), _hf_logits(model, prompts)):
        assert (ours - ref).abs().max().item() < 1e-4
    sharded, _ = run_passes(graph.copy(), ["shard"], PassContext(options={"shard": {"tp_size": 2}}))
    for n in (n for n in sharded.nodes if n.op == "layer_norm" and n.attrs.get("head_dim")):
        name = n.weights["weight"]
        full = graph.params[name]
        assert sharded.params[name].shape[0] == full.shape[0] // 2
        assert torch.equal(sharded.shards.tensor(name, 1), full[full.shape[0] // 2:])
    expected = run_graph(graph, prompts[1:])
    for rank_logits in run_ranks(sharded, prompts[1:], monkeypatch):
        for ours, ref in zip(rank_logits, expected):
            assert (ours - ref).abs().max().item() < 1e-5
