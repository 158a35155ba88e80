"""EAGLE heads (runtime.eagle): the head's forward against a reference built from transformers' Llama decoder layer,
the proposer's incremental cache against a from-scratch recomputation (growing tokens, accepted and rejected drafts,
a repeated proposal, a gap in the recorded hidden states), the checkpoint checks, and the serving engine with an
EAGLE head: greedy and seeded output equal to non-speculative decoding, drafts verified, nothing leaked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from runtime import Engine, SamplingParams
from runtime.eagle import EagleCheckpointError, EagleConfig, EagleProposer, load_head
from runtime.serving import ServingConfig, ServingEngine
from runtime.speculative import DraftRequest, SpeculativeConfig, SpeculativeConfigError

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n\nclass Config:\n",
           "    def read(self, path):\n        with open(path) as f:\n            return f.read()\n" * 2]


def write_head(path: Path, hidden: int, vocab: int | None = None, layers: int = 1, heads: int = 4,
               kv_heads: int = 2, intermediate: int = 96, seed: int = 0, fc_bias: bool = True,
               scale: float = 0.05, extra: dict | None = None, **config) -> Path:
    """A random EAGLE-1 head checkpoint (config.json, model.safetensors) for a target of ``hidden`` features."""
    g = torch.Generator().manual_seed(seed)
    d = hidden // heads

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * scale

    w = {"fc.weight": rnd(hidden, 2 * hidden)}
    if fc_bias:
        w["fc.bias"] = rnd(hidden)
    for i in range(layers):
        p = f"layers.{i}."
        w.update({p + "self_attn.q_proj.weight": rnd(heads * d, hidden),
                  p + "self_attn.k_proj.weight": rnd(kv_heads * d, hidden),
                  p + "self_attn.v_proj.weight": rnd(kv_heads * d, hidden),
                  p + "self_attn.o_proj.weight": rnd(hidden, heads * d),
                  p + "mlp.gate_proj.weight": rnd(intermediate, hidden),
                  p + "mlp.up_proj.weight": rnd(intermediate, hidden),
                  p + "mlp.down_proj.weight": rnd(hidden, intermediate),
                  p + "post_attention_layernorm.weight": 1 + rnd(hidden)})
        if i > 0:
            w[p + "input_layernorm.weight"] = 1 + rnd(hidden)
    if vocab is not None:
        w["lm_head.weight"] = rnd(vocab, hidden) * 20
    w.update(extra or {})
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in w.items()}, str(path / "model.safetensors"))
    cfg = {"architectures": ["LlamaForCausalLMEagle"], "hidden_size": hidden, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "head_dim": d, "intermediate_size": intermediate,
           "num_hidden_layers": layers, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", **config}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def engine(bundled_artifact) -> Engine:
    return Engine.load(bundled_artifact)


@pytest.fixture(scope="module")
def head_dir(engine, tmp_path_factory) -> Path:
    hidden = engine.executor.params[next(n["weights"]["weight"] for n in engine.executor.graph["nodes"]
                                         if n["op"] == "embedding")].shape[1]
    return write_head(tmp_path_factory.mktemp("eagle") / "head", hidden, layers=2)


def _reference_outputs(head, token_ids: list[int], hidden: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """The head over pairs (hidden[i], token_ids[i]) at positions 0..n-1 from scratch, by transformers' Llama
    decoder layers (the first without its input norm) and rotary embedding; ``window``: each position attends to at
    most that many positions up to its own."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = head.config
    config = LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_heads,
                         num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                         intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                         rms_norm_eps=cfg.rms_norm_eps, rope_theta=10000.0, attn_implementation="eager")
    n = len(token_ids)
    x = torch.cat([head.embed[torch.tensor(token_ids)].float(), hidden.float()], dim=-1)
    x = torch.nn.functional.linear(x, head.w["fc.weight"].float(), head.w["fc.bias"].float())[None]
    positions = torch.arange(n)[None]
    emb = LlamaRotaryEmbedding(config)(x, positions)
    mask = torch.full((n, n), float("-inf")).triu(1)
    if window is not None:
        mask = mask + torch.full((n, n), float("-inf")).tril(-window)
    mask = mask[None, None]
    for i in range(cfg.num_layers):
        layer = LlamaDecoderLayer(config, i)
        state = {k[len(f"layers.{i}."):]: v.float() for k, v in head.w.items() if k.startswith(f"layers.{i}.")}
        q, k, v = state.pop("qkv").split([cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
                                          cfg.num_kv_heads * cfg.head_dim])  # merged at load (one GEMM a step)
        gate, up = state.pop("gate_up").chunk(2)
        state.update({"self_attn.q_proj.weight": q, "self_attn.k_proj.weight": k, "self_attn.v_proj.weight": v,
                      "mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up})
        if i == 0:
            layer.input_layernorm = torch.nn.Identity()
        layer.load_state_dict(state, strict=True)
        out = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=emb)
        x = out[0] if isinstance(out, tuple) else out
    return x[0]


def _reference_drafts(head, tokens: list[int], hidden: torch.Tensor, k: int, window: int | None = None) -> list[int]:
    """Drafts from scratch: the head over every known pair, then k - 1 chain steps, each recomputed whole."""
    ids, feats = list(tokens[1:]), hidden[:len(tokens) - 1]
    drafts = []
    for _ in range(k):
        out = _reference_outputs(head, ids, feats, window)
        token = int(torch.argmax(head.lm_head(out[-1:].to(head.dtype)), dim=-1)[0])
        drafts.append(token)
        ids, feats = ids + [token], torch.cat([feats, out[-1:]])
    return drafts


def test_the_head_is_a_llama_decoder_over_fc_of_embedding_and_hidden(engine, head_dir):
    """Our forward (one step over new pairs, then one more pair on the cache) against transformers' layers."""
    head = load_head(head_dir, engine)
    g = torch.Generator().manual_seed(1)
    n = 11
    ids = torch.randint(0, head.embed.shape[0], (n,), generator=g)
    hidden = torch.randn(n, head.config.hidden_size, generator=g)
    ref = _reference_outputs(head, ids.tolist(), hidden)
    proposer = EagleProposer(head, 64, max_seqs=3)
    proposer._seq("a"), proposer._seq("b")
    slot = torch.tensor([proposer._seq("r").slot])  # the third slot: its rows of the cache are the last ones
    assert slot.item() == 2

    def at(p: int) -> torch.Tensor:
        return torch.tensor([p])

    ours = torch.cat([head.forward(proposer.cache, slot, ids[:7], hidden[:7], at(0), at(0))[0],
                      head.forward(proposer.cache, slot, ids[7:], hidden[7:], at(7), at(0))[0]])
    torch.testing.assert_close(ours.float(), ref, atol=2e-5, rtol=1e-4)


def test_incremental_drafts_equal_drafts_from_scratch(engine, head_dir):
    """The proposer feeds only what its cache lacks and writes its chain over later: after growing tokens (drafts
    accepted, one rejected), a repeated proposal and a gap in the recorded hidden states, every proposal equals the
    drafts recomputed from scratch over the known pairs."""
    head = load_head(head_dir, engine)
    g = torch.Generator().manual_seed(2)
    vocab, h = head.embed.shape[0], head.config.hidden_size
    tokens = torch.randint(0, vocab, (40,), generator=g).tolist()
    truth = torch.randn(60, h, generator=g)  # the "target's" hidden state at each position
    proposer = EagleProposer(head, 128, max_draft_tokens=4)
    proposer.record_hidden("r", 0, truth[:12])  # a prompt of 12 tokens, then its first sampled token
    known = tokens[:13]
    for grow in (0, 3, 0, 1, 2):  # tokens accepted since the last proposal (0: proposed again as it stood)
        if grow:
            proposer.record_hidden("r", len(known) - 1, truth[len(known) - 1:len(known) - 1 + grow])
            known = tokens[:len(known) + grow]
        drafts = proposer.propose([DraftRequest("r", known, 4)])[0]
        assert drafts == _reference_drafts(head, known, truth, 4)
    # a verify step's rows past the accepted ones are recorded too; they are written over before they are used
    proposer.record_hidden("r", len(known) - 1, torch.randn(5, h, generator=g))
    proposer.record_hidden("r", len(known) - 1, truth[len(known) - 1:len(known)])
    known = tokens[:len(known) + 1]
    assert proposer.propose([DraftRequest("r", known, 3)])[0] == _reference_drafts(head, known, truth, 3)
    # a gap (hidden states of positions 20..24 never recorded): the cache restarts after it
    proposer.record_hidden("r", 25, truth[25:30])
    known = tokens[:31]
    # (the rotary makes attention depend on relative positions only: the reference may start at 0)
    assert proposer.propose([DraftRequest("r", known, 2)])[0] == _reference_drafts(head, known[25:], truth[25:], 2)
    assert proposer._seqs["r"].start == 25
    assert not proposer.may_propose(tokens[:33], "r")  # position 31's hidden state is not known yet
    assert proposer.propose([DraftRequest("r", tokens[:33], 2)]) == [[]]
    proposer.release("r")
    assert proposer._seqs == {}


def test_one_proposal_drafts_for_several_requests_as_for_each_alone(engine, head_dir):
    """Requests drafting in the same step share one proposal (each feeds its last k + 1 known pairs, those already
    cached written again; a request after a gap repeats its first pair): every request's drafts equal the drafts
    recomputed from scratch for it alone, through prompts of different lengths, growth and a gap."""
    head = load_head(head_dir, engine)
    g = torch.Generator().manual_seed(5)
    vocab, h = head.embed.shape[0], head.config.hidden_size
    tokens = {r: torch.randint(0, vocab, (48,), generator=g).tolist() for r in "abc"}
    truth = {r: torch.randn(48, h, generator=g) for r in "abc"}
    proposer = EagleProposer(head, 96, max_seqs=4, max_draft_tokens=3)
    known = {"a": 13, "b": 3, "c": 22}  # prompts (one shorter than k + 1 pairs, one a long catch-up) and a token
    for r, n in known.items():
        proposer.record_hidden(r, 0, truth[r][:n - 1])
    for grow in ({}, {"a": 2, "c": 1}, {"b": 4}, {"a": 1, "b": 1, "c": 3}):
        for r, more in grow.items():
            proposer.record_hidden(r, known[r] - 1, truth[r][known[r] - 1:known[r] - 1 + more])
            known[r] += more
        requests = [DraftRequest(r, tokens[r][:known[r]], 3) for r in "abc"]
        assert proposer.propose(requests) == [_reference_drafts(head, tokens[r][:known[r]], truth[r], 3)
                                              for r in "abc"]
    proposer.record_hidden("b", 20, truth["b"][20:23])  # a gap: b's cache restarts at 20, with 2 pairs known
    known["b"] = 23
    requests = [DraftRequest(r, tokens[r][:known[r]], 2) for r in "abc"]
    want = [_reference_drafts(head, tokens[r][:known[r]], truth[r], 2) for r in "ac"]
    want.insert(1, _reference_drafts(head, tokens["b"][20:23], truth["b"][20:], 2))
    assert proposer.propose(requests) == want


def test_a_head_step_attends_within_its_window(engine, head_dir, monkeypatch):
    """RUNTIME_EAGLE_WINDOW: each position attends to at most that many positions up to its own, whatever the slot's
    capacity (a step's cost follows the window); drafts equal a from-scratch reference with that sliding window, for
    one request and for several at once, and differ from the unwindowed ones on this context."""
    head = load_head(head_dir, engine)
    g = torch.Generator().manual_seed(7)
    vocab, h = head.embed.shape[0], head.config.hidden_size
    tokens = {r: torch.randint(0, vocab, (40,), generator=g).tolist() for r in "ab"}
    truth = {r: torch.randn(40, h, generator=g) for r in "ab"}
    monkeypatch.setenv("RUNTIME_EAGLE_WINDOW", "5")
    proposer = EagleProposer(head, 64, max_seqs=2, max_draft_tokens=3)
    assert proposer.cache.window == 5
    known = {"a": 21, "b": 14}
    for r, n in known.items():
        proposer.record_hidden(r, 0, truth[r][:n - 1])
    assert proposer.propose([DraftRequest("a", tokens["a"][:21], 3)]) == [
        _reference_drafts(head, tokens["a"][:21], truth["a"], 3, window=5)]
    proposer.record_hidden("a", 20, truth["a"][20:22])
    known["a"] = 23
    both = proposer.propose([DraftRequest(r, tokens[r][:known[r]], 3) for r in "ab"])
    assert both == [_reference_drafts(head, tokens[r][:known[r]], truth[r], 3, window=5) for r in "ab"]
    wide = [_reference_drafts(head, tokens[r][:known[r]], truth[r], 3) for r in "ab"]
    assert both != wide  # the window changed what the head saw
    monkeypatch.setenv("RUNTIME_EAGLE_WINDOW", "x")
    with pytest.raises(SpeculativeConfigError, match="RUNTIME_EAGLE_WINDOW='x' is not a whole number"):
        EagleProposer(head, 64)


def test_bad_checkpoints_are_refused_with_what_is_wrong(engine, head_dir, tmp_path):
    hidden = load_head(head_dir, engine).config.hidden_size
    with pytest.raises(EagleCheckpointError, match="is not a directory"):
        load_head(tmp_path / "missing", engine)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04 not loaded")
    with pytest.raises(EagleCheckpointError, match="pytorch_model.bin, pickled weights this runtime never loads"):
        load_head(pickled, engine)
    with pytest.raises(EagleCheckpointError, match="hidden_size 64 is not the target's"):
        load_head(write_head(tmp_path / "narrow", 64), engine)
    corrupt = write_head(tmp_path / "corrupt", hidden)
    (corrupt / "model.safetensors").write_bytes((corrupt / "model.safetensors").read_bytes()[:100])
    with pytest.raises(EagleCheckpointError, match="cannot be read"):
        load_head(corrupt, engine)
    lacking = write_head(tmp_path / "lacking", hidden)
    cfg = json.loads((lacking / "config.json").read_text())
    (lacking / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 2}))
    with pytest.raises(EagleCheckpointError, match="lacks layers.1"):
        load_head(lacking, engine)
    with pytest.raises(EagleCheckpointError, match="rope scaling 'yarn' is not supported"):
        load_head(write_head(tmp_path / "yarn", hidden, rope_scaling={"rope_type": "yarn", "factor": 4.0}), engine)
    with pytest.raises(EagleCheckpointError, match="lm_head.weight is"):
        load_head(write_head(tmp_path / "vocab", hidden, vocab=7), engine)
    with pytest.raises(EagleCheckpointError, match="has tensors an EAGLE-1 head does not have: norm.weight"):
        load_head(write_head(tmp_path / "extra", hidden, extra={"norm.weight": torch.ones(hidden)}), engine)
    (lacking / "config.json").write_text("{not json")
    with pytest.raises(EagleCheckpointError, match="config.json is not valid JSON"):
        load_head(lacking, engine)
    with pytest.raises(SpeculativeConfigError, match="methods 'draft' and 'eagle' need draft_model"):
        SpeculativeConfig(method="eagle")


def test_llama3_rope_scaling_is_read():
    cfg = {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 32, "num_hidden_layers": 1,
           "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    ours = torch.tensor(EagleConfig.from_dict(cfg, "t").inv_freq, dtype=torch.float32)
    hf = LlamaConfig(hidden_size=64, num_attention_heads=4, intermediate_size=32, num_hidden_layers=1,
                     rope_theta=500000.0, rope_scaling=dict(cfg["rope_scaling"], rope_theta=500000.0))
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)


def _run(engine, prompts, params, speculative=None):
    s = ServingEngine(engine, ServingConfig(speculative=speculative, num_blocks=64))
    outs = [o.token_ids for o in s.run(prompts, params)]
    return s, outs


def test_serving_with_an_eagle_head_emits_the_targets_tokens(engine, head_dir):
    """Greedy and seeded output with an EAGLE head (random: its drafts are mostly rejected) equal the output without
    speculation; the head drafted and the target verified; every request's head state and KV blocks released."""
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    spec = {"method": "eagle", "draft_model": str(head_dir), "num_speculative_tokens": 3, "adaptive": False}
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    s, outs = _run(engine, prompts, greedy, spec)
    assert outs == _run(engine, prompts, greedy)[1]
    stats = s.stats()
    assert stats.spec_num_draft_tokens >= 24 and stats.spec_num_steps > 0
    seeded = [SamplingParams(max_tokens=16, temperature=0.8, seed=i, ignore_eos=True) for i in range(3)]
    assert [o.token_ids for o in s.run(prompts, seeded)] == _run(engine, prompts, seeded)[1]
    assert s.scheduler.num_unfinished == 0 and s.kv.num_requests == 0
    assert s.proposer._seqs == {}
    assert s.memory_plan.weights_bytes > sum(t.numel() * t.element_size() for t in engine.executor.params.values())


def test_an_eagle_head_in_the_recipe_travels_inside_the_artifact(checkpoints, tmp_path):
    """runtime.speculative method eagle: the build checks the head against the checkpoint and copies its two files
    into the artifact (listed, hashed); the artifact serves with it by default, tokens equal to decoding without;
    a head that does not fit is refused at build time and a tampered one at load."""
    from builder.pipeline import BuildError
    from conftest import build_artifact
    from runtime.artifact import ArtifactError

    config = json.loads((checkpoints["llama"] / "config.json").read_text())
    head = write_head(tmp_path / "head", config["hidden_size"], heads=2, kv_heads=1, intermediate=48)
    path = build_artifact(checkpoints["llama"], tmp_path / "art",
                          speculative={"method": "eagle", "draft_model": str(head), "num_speculative_tokens": 2})
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["runtime"]["speculative"]["draft_model"] == "eagle"
    assert {"eagle/config.json", "eagle/model.safetensors"} <= set(manifest["files"])
    engine = Engine.load(path)
    served = ServingEngine(engine, ServingConfig(num_blocks=64))
    assert isinstance(served.proposer, EagleProposer)
    prompt = list(range(3, 15))
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = ServingEngine(engine, ServingConfig(num_blocks=64, speculative=SpeculativeConfig()))
    assert served.run([prompt], params)[0].token_ids == plain.run([prompt], params)[0].token_ids
    assert served.spec_num_draft_tokens > 0
    wide = 2 * config["hidden_size"]
    with pytest.raises(BuildError, match=f"hidden_size {wide} is not the target's"):
        build_artifact(checkpoints["llama"], tmp_path / "wide",
                       speculative={"method": "eagle", "draft_model": str(write_head(tmp_path / "hw", wide))})
    data = bytearray((path / "eagle" / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (path / "eagle" / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="model.safetensors was modified after the build"):
        Engine.load(path)


def serve_recording_hidden(engine, head_dir, prompts, params):
    """Serve ``prompts`` with the head at ``head_dir`` (3 drafts, always on), recording every row of hidden states the
    proposer is handed; returns the serving engine, the outputs and {request id: {position: row (fp32, CPU)}}, the
    last row handed over at each position."""
    spec = {"method": "eagle", "draft_model": str(head_dir), "num_speculative_tokens": 3, "adaptive": False}
    s = ServingEngine(engine, ServingConfig(speculative=spec, num_blocks=64))
    assert s.graphs is not None and s.step_graphs is not None
    records: dict[str, dict[int, torch.Tensor]] = {}
    record = s.proposer.record_hidden

    def spy(request_id, start, hidden):
        rows = records.setdefault(request_id, {})
        for j in range(hidden.shape[0]):
            rows[start + j] = hidden[j].float().cpu()
        record(request_id, start, hidden)

    s.proposer.record_hidden = spy
    return s, s.run(prompts, params), records


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA graphs' hidden states need a GPU")
def test_on_cuda_the_graphs_hand_over_the_targets_hidden_states(bundled_artifact, head_dir):
    """On CUDA (kernels, decode and step graphs) the hidden states the proposer is handed are the target's: the last
    row recorded at each position equals an eager forward over the final tokens; output equals decoding without."""
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the kernels run compiled on the GPU")
    engine = Engine.load(bundled_artifact, "cuda")
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    s, outs, records = serve_recording_hidden(engine, head_dir, prompts, params)
    plain = ServingEngine(engine, ServingConfig(speculative=SpeculativeConfig(), num_blocks=64))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.run(prompts, params)]
    assert s.stats().spec_num_draft_tokens > 0
    from runtime.executor import SeqSlice, StepInput
    from runtime.kv_cache import SequenceKV

    engine.executor.keep_hidden = True
    step = engine.limits.max_num_tokens
    for prompt, out in zip(prompts, outs):
        tokens = prompt + out.token_ids
        rows = records[out.request_id]
        n = len(tokens) - 1  # the last token was never fed
        kv, eager = SequenceKV(engine.kv_layout, n, engine.device), []
        for lo in range(0, n, step):  # the offline engine's eager steps, chunk by chunk
            chunk = tokens[lo:min(n, lo + step)]
            engine.executor.forward(StepInput(torch.tensor(chunk, device="cuda"),
                                              torch.arange(lo, lo + len(chunk), device="cuda"),
                                              [SeqSlice(kv, lo, len(chunk))], None))
            kv.num_tokens = lo + len(chunk)
            eager.append(engine.executor.hidden.float().cpu())
        assert sorted(rows) == list(range(n))
        torch.testing.assert_close(torch.stack([rows[i] for i in range(n)]), torch.cat(eager), atol=2e-3, rtol=2e-3)


def test_the_proposal_cost_bench_runs_a_random_head_shaped_like_the_target(bundled_artifact, tmp_path, capsys):
    from builder.bench import eagle_cost
    from conftest import BUNDLED

    record = tmp_path / "figures.jsonl"
    assert eagle_cost.main([str(bundled_artifact), "--config", str(BUNDLED / "config.json"), "--device", "cpu",
                            "--num-draft", "2", "--iters", "2", "--context", "16", "--max-seq-len", "64",
                            "--record", str(record)]) == 0
    assert "EAGLE proposal, k = 2, 1 request(s) of 16-token context, 64-position head cache" in capsys.readouterr().out
    line = json.loads(record.read_text().splitlines()[0])
    assert line["figure"] == "eagle_proposal_ms_k2" and line["value"] > 0
    assert eagle_cost.main([str(bundled_artifact), "--config", str(BUNDLED / "config.json"), "--device", "cpu",
                            "--eagle3", "--draft-vocab", "256", "--num-draft", "1", "--iters", "1", "--context", "8",
                            "--record", str(record)]) == 0
    assert "EAGLE-3 proposal, k = 1, 1 request(s) of 8-token context" in capsys.readouterr().out
    assert json.loads(record.read_text().splitlines()[1])["figure"] == "eagle3_proposal_ms_k1"
    assert eagle_cost.main([str(bundled_artifact), "--config", str(BUNDLED / "config.json"), "--device", "cpu",
                            "--requests", "2", "--num-draft", "1", "--iters", "1", "--context", "8",
                            "--record", str(record), "--tag", "_t"]) == 0
    assert "EAGLE proposal, k = 1, 2 request(s) of 8-token context" in capsys.readouterr().out
    assert json.loads(record.read_text().splitlines()[2])["figure"] == "eagle_proposal_ms_k1_r2_t"


def test_a_prefix_cache_hit_leaves_a_gap_the_head_restarts_after(engine, head_dir):
    """The second request of a shared prompt is served from the prefix cache: the target computes only its last
    block's positions, so the head has no hidden states for the cached ones and restarts its cache after them. The
    output is still the target's."""
    prompt = engine.tokenizer.encode(PROMPTS[2])
    spec = {"method": "eagle", "draft_model": str(head_dir), "num_speculative_tokens": 3, "adaptive": False}
    s = ServingEngine(engine, ServingConfig(speculative=spec, num_blocks=64, enable_prefix_caching=True))
    starts = []
    record = s.proposer.record_hidden
    s.proposer.record_hidden = lambda rid, start, hidden: (starts.append((rid, start)), record(rid, start, hidden))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    first = s.run([prompt], params)[0]
    second = s.run([prompt], params)[0]
    assert first.token_ids == second.token_ids == _run(engine, [prompt], params)[1][0]
    assert min(start for rid, start in starts if rid == second.request_id) > 0  # its cached prefix was not recorded
    assert s.stats().spec_num_draft_tokens > 0
