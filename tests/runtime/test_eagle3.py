"""EAGLE-3 heads (runtime.eagle, version 3): the head's forward against a plain torch reference written from the
layout vLLM and SGLang load (the target's layer streams side by side through fc, a first layer over
cat(input_norm(embed), hidden_norm(h)), a final norm, a draft vocabulary mapped to target ids through d2t), the
proposer's incremental drafts against drafts recomputed from scratch, the target's residual streams the executor
hands over, the checkpoint checks, and serving with an EAGLE-3 head: output equal to decoding without speculation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from runtime import Engine, SamplingParams
from runtime.eagle import EagleCheckpointError, EagleProposer, load_head
from runtime.serving import ServingConfig, ServingEngine
from runtime.speculative import DraftRequest

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n\nclass Config:\n",
           "    def read(self, path):\n        with open(path) as f:\n            return f.read()\n" * 2]


def write_head3(path: Path, target_hidden: int, vocab: int, *, hidden: int | None = None, layers: int = 1,
                heads: int = 4, kv_heads: int = 2, intermediate: int = 96, draft_vocab: int | None = None,
                aux: list[int] | None = (1, 2, 3), streams: int = 3, seed: int = 0, scale: float = 0.05,
                own_embed: bool = False, midlayer: bool = True, **config) -> Path:
    """A random EAGLE-3 head checkpoint in the SafeAILab / vLLM layout: ``midlayer.*`` (or ``layers.0.*``) and
    ``layers.N.*``, ``fc`` over ``streams`` target hidden states, ``norm``, an lm_head over ``draft_vocab`` rows
    with ``d2t`` offsets to the target's ids (a random subset of them) and ``t2d``."""
    g = torch.Generator().manual_seed(seed)
    h = hidden or target_hidden
    d = h // heads

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * scale

    w = {"fc.weight": rnd(h, streams * target_hidden), "norm.weight": 1 + rnd(h)}
    for i in range(layers):
        p = ("midlayer." if midlayer else "layers.0.") if i == 0 else f"layers.{i}."
        attn_in = 2 * h if i == 0 else h
        w.update({p + "self_attn.q_proj.weight": rnd(heads * d, attn_in),
                  p + "self_attn.k_proj.weight": rnd(kv_heads * d, attn_in),
                  p + "self_attn.v_proj.weight": rnd(kv_heads * d, attn_in),
                  p + "self_attn.o_proj.weight": rnd(h, heads * d),
                  p + "mlp.gate_proj.weight": rnd(intermediate, h),
                  p + "mlp.up_proj.weight": rnd(intermediate, h),
                  p + "mlp.down_proj.weight": rnd(h, intermediate),
                  p + "input_layernorm.weight": 1 + rnd(h),
                  p + "post_attention_layernorm.weight": 1 + rnd(h)})
        if i == 0:
            w[p + "hidden_norm.weight"] = 1 + rnd(h)
    rows = draft_vocab or vocab
    w["lm_head.weight"] = rnd(rows, h) * 20
    if draft_vocab:
        ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
        w["d2t"] = ids - torch.arange(draft_vocab)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        w["t2d"] = t2d
    if own_embed:
        w["embed_tokens.weight"] = rnd(vocab, h) * 20
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in w.items()}, str(path / "model.safetensors"))
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": h, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "head_dim": d, "intermediate_size": intermediate,
           "num_hidden_layers": layers, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
           "vocab_size": vocab, "target_hidden_size": target_hidden, **config}
    if draft_vocab:
        cfg["draft_vocab_size"] = draft_vocab
    if aux is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux), "use_aux_hidden_state": True}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def engine(bundled_artifact) -> Engine:
    return Engine.load(bundled_artifact)


def _dims(engine) -> tuple[int, int]:
    table = engine.executor.params[next(n["weights"]["weight"] for n in engine.executor.graph["nodes"]
                                        if n["op"] == "embedding")]
    return table.shape[1], table.shape[0]


@pytest.fixture(scope="module")
def head_dir(engine, tmp_path_factory) -> Path:
    hidden, vocab = _dims(engine)
    return write_head3(tmp_path_factory.mktemp("eagle3") / "head", hidden, vocab, layers=2, draft_vocab=512)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _reference(head, token_ids: list[int], hidden: torch.Tensor, fresh: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The head from scratch over positions 0..n-1 in fp32, written out plainly: positions below ``fresh`` take the
    target's streams through fc, later ones (a chain's) the head's own hidden state as it stands; returns the final
    norm's output and its input at every position."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg, w = head.config, {k: v.float() for k, v in head.w.items()}
    eps, n = cfg.rms_norm_eps, len(token_ids)
    rope = LlamaRotaryEmbedding(LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_heads,
                                            head_dim=cfg.head_dim, rope_theta=10000.0))
    cos, sin = rope(hidden.float(), torch.arange(n)[None])
    emb = head.embed.float()[torch.tensor(token_ids)]
    h = torch.stack([hidden[i, :cfg.hidden_size].float() if i >= fresh
                     else hidden[i].float() @ w["fc.weight"].T for i in range(n)])
    causal = torch.full((n, n), float("-inf")).triu(1)
    x = residual = None
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        if i == 0:
            normed = _rms(h, w[p + "hidden_norm.weight"], eps)
            residual = normed if cfg.norm_before_residual else h
            a = torch.cat([_rms(emb, w[p + "input_layernorm.weight"], eps), normed], dim=-1)
        else:
            residual = x + residual
            a = _rms(residual, w[p + "input_layernorm.weight"], eps)
        nq, nk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, k, v = (a @ w[p + "qkv"].T).split([nq * d, nk * d, nk * d], dim=-1)
        q, k = apply_rotary_pos_emb(q.view(1, n, nq, d).transpose(1, 2), k.view(1, n, nk, d).transpose(1, 2),
                                    cos, sin)
        v = v.view(1, n, nk, d).transpose(1, 2)
        k, v = (t.repeat_interleave(nq // nk, dim=1) for t in (k, v))
        att = torch.softmax(q @ k.transpose(-1, -2) / d ** 0.5 + causal, dim=-1) @ v  # [1, nq, n, d]
        residual = residual + att.transpose(1, 2).reshape(n, nq * d) @ w[p + "self_attn.o_proj.weight"].T
        gate, up = (_rms(residual, w[p + "post_attention_layernorm.weight"], eps) @ w[p + "gate_up"].T).chunk(2, -1)
        x = (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    stream = x + residual
    return _rms(stream, w["norm.weight"], eps), stream


def _reference_drafts(head, tokens: list[int], streams: torch.Tensor, k: int) -> list[int]:
    """Drafts from scratch: the head over every known pair (the target's streams), then k - 1 chain steps fed the
    head's own hidden state of the position before, each recomputed whole."""
    ids, feats = list(tokens[1:]), streams[:len(tokens) - 1]
    fresh = len(ids)
    drafts = []
    for _ in range(k):
        out, stream = _reference(head, ids, feats, fresh)
        token = int(head.draft(out[-1:].to(head.dtype))[0])
        drafts.append(token)
        pad = torch.zeros(1, feats.shape[1])
        pad[0, :stream.shape[1]] = stream[-1]
        ids, feats = ids + [token], torch.cat([feats, pad])
    return drafts


def test_the_eagle3_head_matches_a_plain_reference(engine, head_dir):
    """Our forward (a step over target pairs, one more on the cache, then a chain step on the head's own hidden state)
    against the reference; drafts are target ids through d2t."""
    head = load_head(head_dir, engine)
    assert head.config.version == 3 and head.input_width == 3 * head.config.hidden_size
    g = torch.Generator().manual_seed(1)
    n = 10
    ids = torch.randint(0, head.embed.shape[0], (n,), generator=g)
    streams = torch.randn(n, head.input_width, generator=g)
    proposer = EagleProposer(head, 64, max_seqs=2)
    slot = torch.tensor([proposer._seq("r").slot])

    def at(p: int) -> torch.Tensor:
        return torch.tensor([p])

    out_a, s_a = head.forward(proposer.cache, slot, ids[:6], streams[:6], at(0), at(0))
    out_b, s_b = head.forward(proposer.cache, slot, ids[6:9], streams[6:9], at(6), at(0))
    out_c, s_c = head.forward(proposer.cache, slot, ids[9:], s_b[-1:], at(9), at(0), fresh=False)
    chain = streams.clone()
    chain[9, :s_b.shape[1]] = s_b[-1]
    ref_out, ref_stream = _reference(head, ids.tolist(), chain, fresh=9)
    torch.testing.assert_close(torch.cat([out_a, out_b, out_c]).float(), ref_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(torch.cat([s_a, s_b, s_c]).float(), ref_stream, atol=2e-5, rtol=1e-4)
    drafts = head.draft(out_c)
    allowed = set((torch.arange(512) + load_tensor(head_dir, "d2t")).tolist())
    assert int(drafts[0]) in allowed


def load_tensor(path: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return f.get_tensor(name)


def test_incremental_eagle3_drafts_equal_drafts_from_scratch(engine, head_dir):
    head = load_head(head_dir, engine)
    g = torch.Generator().manual_seed(2)
    vocab = engine.tokenizer.vocab_size if hasattr(engine.tokenizer, "vocab_size") else head.embed.shape[0]
    tokens = torch.randint(0, min(vocab, head.embed.shape[0]), (30,), generator=g).tolist()
    truth = torch.randn(40, head.input_width, generator=g)
    proposer = EagleProposer(head, 96, max_draft_tokens=3)
    proposer.record_hidden("r", 0, truth[:9])
    known = tokens[:10]
    for grow in (0, 2, 1, 0, 3):
        if grow:
            proposer.record_hidden("r", len(known) - 1, truth[len(known) - 1:len(known) - 1 + grow])
            known = tokens[:len(known) + grow]
        assert proposer.propose([DraftRequest("r", known, 3)])[0] == _reference_drafts(head, known, truth, 3)


def test_one_eagle3_proposal_drafts_for_several_requests_as_for_each_alone(engine, head_dir):
    head = load_head(head_dir, engine)
    g = torch.Generator().manual_seed(6)
    tokens = {r: torch.randint(0, head.embed.shape[0], (30,), generator=g).tolist() for r in "ab"}
    truth = {r: torch.randn(30, head.input_width, generator=g) for r in "ab"}
    proposer = EagleProposer(head, 64, max_seqs=3, max_draft_tokens=3)
    known = {"a": 9, "b": 3}
    for r, n in known.items():
        proposer.record_hidden(r, 0, truth[r][:n - 1])
    for grow in ({}, {"a": 2}, {"a": 1, "b": 3}):
        for r, more in grow.items():
            proposer.record_hidden(r, known[r] - 1, truth[r][known[r] - 1:known[r] - 1 + more])
            known[r] += more
        got = proposer.propose([DraftRequest(r, tokens[r][:known[r]], 3) for r in "ab"])
        assert got == [_reference_drafts(head, tokens[r][:known[r]], truth[r], 3) for r in "ab"]


def test_the_executor_hands_over_the_residual_streams_the_head_names(engine, head_dir):
    """With an EAGLE-3 head loaded, a forward leaves the streams entering target layers 1, 2 and 3 side by side:
    Hugging Face's ``hidden_states[j]`` of the bundled checkpoint (the input of layer j), in fp32."""
    from transformers import AutoModelForCausalLM

    from conftest import BUNDLED
    from runtime.executor import SeqSlice, StepInput
    from runtime.kv_cache import SequenceKV

    ex = engine.executor
    try:
        load_head(head_dir, engine)
        assert ex.hidden_names == [ex.residual_stream(j) for j in (1, 2, 3)]
        ex.keep_hidden = True
        tokens = engine.tokenizer.encode(PROMPTS[1])
        kv = SequenceKV(engine.kv_layout, len(tokens), engine.device)
        ex.forward(StepInput(torch.tensor(tokens), torch.arange(len(tokens)), [SeqSlice(kv, 0, len(tokens))], None))
        kept = ex.hidden.float()
    finally:
        ex.keep_hidden = False
        ex.keep_hidden_states([ex.hidden_name])
    hf = AutoModelForCausalLM.from_pretrained(BUNDLED, dtype=torch.float32)
    with torch.no_grad():
        states = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    expected = torch.cat([states[j][0] for j in (1, 2, 3)], dim=-1)
    assert kept.shape == expected.shape
    torch.testing.assert_close(kept, expected, atol=1e-3, rtol=1e-3)


def test_bad_eagle3_checkpoints_are_refused_with_what_is_wrong(engine, tmp_path):
    hidden, vocab = _dims(engine)
    with pytest.raises(EagleCheckpointError, match=r"fc.weight reads 3 .* names 2 target layers \[1, 2\] .*default"):
        load_head(write_head3(tmp_path / "default", hidden, vocab, aux=None), engine)  # a 4-layer target: 2, 2, 1
    with pytest.raises(EagleCheckpointError, match=r"target layers \[9\] are outside the target's 0..4"):
        load_head(write_head3(tmp_path / "far", hidden, vocab, aux=[1, 2, 9]), engine)
    with pytest.raises(EagleCheckpointError, match="target_hidden_size 64 is not the target's"):
        load_head(write_head3(tmp_path / "narrow", 64, vocab), engine)
    bad = write_head3(tmp_path / "d2t", hidden, vocab, draft_vocab=16)
    from safetensors.torch import load_file
    w = load_file(str(bad / "model.safetensors"))
    w["d2t"] = w["d2t"] + vocab
    save_file(w, str(bad / "model.safetensors"))
    with pytest.raises(EagleCheckpointError, match="d2t maps draft tokens outside the target's vocabulary"):
        load_head(bad, engine)
    w["d2t"] = w["d2t"].float()
    save_file(w, str(bad / "model.safetensors"))
    with pytest.raises(EagleCheckpointError, match="d2t must hold integer offsets"):
        load_head(bad, engine)
    del w["d2t"]
    save_file(w, str(bad / "model.safetensors"))
    with pytest.raises(EagleCheckpointError, match=r"lacks d2t \(an EAGLE-3 head"):
        load_head(bad, engine)
    wide = write_head3(tmp_path / "wide", hidden, vocab, hidden=2 * hidden)
    with pytest.raises(EagleCheckpointError, match="lacks embed_tokens.weight"):
        load_head(wide, engine)  # a head wider than the target cannot share its embedding
    assert load_head(write_head3(tmp_path / "own", hidden, vocab, hidden=2 * hidden, own_embed=True,
                                 midlayer=False), engine).embed.shape == (vocab, 2 * hidden)


def _run(engine, prompts, params, speculative=None):
    s = ServingEngine(engine, ServingConfig(speculative=speculative, num_blocks=64))
    return s, [o.token_ids for o in s.run(prompts, params)]


def test_serving_with_an_eagle3_head_emits_the_targets_tokens(engine, head_dir):
    """Greedy and seeded output with an EAGLE-3 head equal the output without speculation; the head drafted (ids
    of its draft vocabulary only) and every request's state was released."""
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    spec = {"method": "eagle", "draft_model": str(head_dir), "num_speculative_tokens": 3, "adaptive": False}
    greedy = SamplingParams(max_tokens=20, ignore_eos=True)
    s, outs = _run(engine, prompts, greedy, spec)
    try:
        assert outs == _run(engine, prompts, greedy)[1]
        assert s.stats().spec_num_draft_tokens >= 20
        seeded = [SamplingParams(max_tokens=12, temperature=0.8, seed=i, ignore_eos=True) for i in range(3)]
        assert [o.token_ids for o in s.run(prompts, seeded)] == _run(engine, prompts, seeded)[1]
        assert s.proposer._seqs == {} and s.kv.num_requests == 0
    finally:
        engine.executor.keep_hidden = False
        engine.executor.keep_hidden_states([engine.executor.hidden_name])


def test_an_eagle3_head_in_the_recipe_is_checked_against_the_checkpoints_layers(checkpoints, tmp_path):
    from builder.pipeline import BuildError
    from conftest import build_artifact

    config = json.loads((checkpoints["llama"] / "config.json").read_text())
    layers = config["num_hidden_layers"]
    head = write_head3(tmp_path / "head", config["hidden_size"], config["vocab_size"], heads=2, kv_heads=1,
                       intermediate=48, aux=[0, 1, layers])
    path = build_artifact(checkpoints["llama"], tmp_path / "art",
                          speculative={"method": "eagle", "draft_model": str(head), "num_speculative_tokens": 2})
    engine = Engine.load(path)
    served = ServingEngine(engine, ServingConfig(num_blocks=64))
    assert isinstance(served.proposer, EagleProposer) and served.proposer.head.config.version == 3
    prompt = list(range(3, 15))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    assert served.run([prompt], params)[0].token_ids == Engine.load(path).generate(prompt, params).token_ids
    far = write_head3(tmp_path / "far", config["hidden_size"], config["vocab_size"], heads=2, kv_heads=1,
                      intermediate=48, aux=[0, 1, layers + 1])
    with pytest.raises(BuildError, match=rf"target layers \[{layers + 1}\] are outside"):
        build_artifact(checkpoints["llama"], tmp_path / "far-art",
                       speculative={"method": "eagle", "draft_model": str(far)})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA graphs' hidden states need a GPU")
def test_on_cuda_the_graphs_hand_over_the_targets_streams(bundled_artifact, head_dir):
    """On CUDA (kernels, decode and step graphs) the streams the proposer is handed are the target's: the last row
    recorded at each position equals an eager forward's over the final tokens; output equals decoding without."""
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the kernels run compiled on the GPU")
    from runtime.executor import SeqSlice, StepInput
    from runtime.kv_cache import SequenceKV

    from test_eagle import serve_recording_hidden

    engine = Engine.load(bundled_artifact, "cuda")
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    s, outs, records = serve_recording_hidden(engine, head_dir, prompts, params)
    assert s.stats().spec_num_draft_tokens > 0
    for prompt, out in zip(prompts, outs):
        tokens = prompt + out.token_ids
        n = len(tokens) - 1
        kv = SequenceKV(engine.kv_layout, n, engine.device)
        engine.executor.forward(StepInput(torch.tensor(tokens[:n], device="cuda"), torch.arange(n, device="cuda"),
                                          [SeqSlice(kv, 0, n)], None))
        eager = engine.executor.hidden.float().cpu()
        rows = records[out.request_id]
        assert sorted(rows) == list(range(n)) and eager.shape[1] == 3 * _dims(engine)[0]
        torch.testing.assert_close(torch.stack([rows[i] for i in range(n)]), eager, atol=2e-3, rtol=2e-3)
    plain = ServingEngine(Engine.load(bundled_artifact, "cuda"), ServingConfig(num_blocks=64))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.run(prompts, params)]


def test_head_version_reads_the_layout_without_loading(engine, head_dir, tmp_path):
    from runtime.eagle import head_version

    from test_eagle import write_head

    assert head_version(head_dir) == 3
    assert head_version(write_head(tmp_path / "one", _dims(engine)[0])) == 1
    with pytest.raises(EagleCheckpointError, match="cannot be read"):
        head_version(tmp_path / "missing")


def _fed_once(head, ids: torch.Tensor, streams: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's outputs over target pairs at positions 0.. in a fresh proposer's cache of ``capacity`` positions."""
    proposer = EagleProposer(head, capacity, max_seqs=1)
    slot, zero = torch.tensor([proposer._seq("r").slot]), torch.tensor([0])
    return head.forward(proposer.cache, slot, ids, streams, zero, zero)


def test_norm_before_residual_heads_take_the_normed_state_as_residual(engine, tmp_path):
    """``norm_before_residual``: the first layer's residual is hidden_norm(h) (the reference reads the flag too), which
    changes the outputs against the same weights without it."""
    hidden, vocab = _dims(engine)
    before = load_head(write_head3(tmp_path / "before", hidden, vocab, norm_before_residual=True), engine)
    after = load_head(write_head3(tmp_path / "after", hidden, vocab), engine)
    assert before.config.norm_before_residual and not after.config.norm_before_residual
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (6,), generator=g)
    streams = torch.randn(6, before.input_width, generator=g)
    outs = []
    for head in (before, after):
        out, stream = _fed_once(head, ids, streams, 32)
        ref_out, ref_stream = _reference(head, ids.tolist(), streams, fresh=6)
        torch.testing.assert_close(out.float(), ref_out, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(stream.float(), ref_stream, atol=2e-5, rtol=1e-4)
        outs.append(stream)
    assert not torch.allclose(outs[0], outs[1], atol=1e-3)


def test_a_speculators_format_head_reads_as_the_flat_layout(engine, tmp_path):
    """A ``speculators`` eagle3 config (the Llama fields in transformer_layer_config, norm_before_residual true unless
    it says otherwise, layers.N names) gives the head the flat config with the same weights gives; other speculators
    kinds and a config without the layer fields are refused by name."""
    from runtime.eagle import head_version

    hidden, vocab = _dims(engine)
    flat = write_head3(tmp_path / "flat", hidden, vocab, draft_vocab=256, midlayer=False, norm_before_residual=True)
    spec = tmp_path / "spec"
    spec.mkdir()
    (spec / "model.safetensors").write_bytes((flat / "model.safetensors").read_bytes())
    cfg = json.loads((flat / "config.json").read_text())
    layer = {k: cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                 "intermediate_size", "num_hidden_layers", "rms_norm_eps", "rope_theta", "hidden_act",
                                 "vocab_size")}
    (spec / "config.json").write_text(json.dumps({
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "transformer_layer_config": layer,
        "draft_vocab_size": 256, "target_hidden_size": hidden, "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
        "speculators_config": {"algorithm": "eagle3", "proposal_methods": [{"speculative_tokens": 3}]}}))
    assert head_version(spec) == 3
    a, b = load_head(flat, engine), load_head(spec, engine)
    assert a.config == b.config and b.config.norm_before_residual
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, vocab, (5,), generator=g)
    streams = torch.randn(5, a.input_width, generator=g)
    outs = [_fed_once(head, ids, streams, 16)[0] for head in (a, b)]
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    (spec / "config.json").write_text(json.dumps({"speculators_model_type": "eagle",
                                                  "transformer_layer_config": layer}))
    with pytest.raises(EagleCheckpointError, match="a speculators 'eagle' checkpoint is not supported"):
        load_head(spec, engine)
    (spec / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))
    with pytest.raises(EagleCheckpointError, match="needs transformer_layer_config"):
        load_head(spec, engine)


def test_residual_streams_of_a_qwen3_target_pass_its_per_head_norms(checkpoints, tmp_path):
    """Qwen3's q / k norms (one per head) sit between a layer's norm and its attention: the stream entering each layer
    is still found, and equals Hugging Face's hidden_states[j] (0: the embeddings)."""
    from transformers import AutoModelForCausalLM

    from conftest import build_artifact
    from runtime.executor import SeqSlice, StepInput
    from runtime.kv_cache import SequenceKV

    engine = Engine.load(build_artifact(checkpoints["qwen3"], tmp_path / "art"))
    ex = engine.executor
    layers = [0, 1, ex.num_layers - 1]
    ex.keep_hidden_states([ex.residual_stream(j) for j in layers])
    ex.keep_hidden = True
    tokens = list(range(3, 20))
    kv = SequenceKV(engine.kv_layout, len(tokens), engine.device)
    ex.forward(StepInput(torch.tensor(tokens), torch.arange(len(tokens)), [SeqSlice(kv, 0, len(tokens))], None))
    hf = AutoModelForCausalLM.from_pretrained(checkpoints["qwen3"], dtype=torch.float32)
    with torch.no_grad():
        states = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(ex.hidden.float(), torch.cat([states[j][0] for j in layers], dim=-1),
                               atol=1e-4, rtol=1e-4)
