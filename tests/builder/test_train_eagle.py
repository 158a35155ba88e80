"""builder.devtools.train_eagle: a few steps on a handful of standard-library files give a checkpoint the runtime
loads (runtime.eagle.load_head), whose forward is the training module's (step 1 from an empty cache, then the
chain steps on the runtime's cache: the training's unrolled attention is what the proposer computes), whose greedy
drafts are the training module's, and a metrics file with the held-out agreement per chain step. The same for an
EAGLE-3 head (``--eagle3``): the published layout, loaded as version 3, its forward and drafts over the target's
residual streams the training module's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from builder.devtools import train_bundled as tb
from builder.devtools import train_eagle as te
from runtime import Engine
from runtime.eagle import EagleProposer, _tensor_name, load_head
from runtime.speculative import DraftRequest

BUNDLED = Path(__file__).resolve().parents[2] / "models" / "pystdlib-llama"


def _small_stdlib(root: Path) -> Path:
    """Two train-split and one eval-split files of this interpreter's standard library (top level, path order,
    5 to 40 kB each), copied under ``root``: enough windows of 64 tokens for a few steps and an evaluation."""
    want = {tb.SPLIT_TRAIN: 2, tb.SPLIT_EVAL: 1}
    src = tb.stdlib_root()
    for path in sorted(src.glob("*.py")):
        split = tb.assign_split(path.name)
        if want.get(split, 0) and 5_000 <= path.stat().st_size <= 40_000 and not tb.is_excluded(path.name):
            shutil.copyfile(path, root / path.name)
            want[split] -= 1
    assert not any(want.values()), "the standard library lacks files for a train and an eval split"
    return root


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("eagle")
    stdlib = tmp / "stdlib"
    stdlib.mkdir()
    out = tmp / "head"
    assert te.main(["--target", str(BUNDLED), "--out", str(out), "--stdlib", str(_small_stdlib(stdlib)),
                    "--max-steps", "3", "--batch-size", "2", "--seq-len", "64", "--unroll", "2"]) == 0
    return out


def _training_module(out: Path) -> te.EagleHead:
    """The training module with the stored (bf16) weights, in fp32 (an EAGLE-3 head's ``midlayer.`` as
    ``layers.0.``, as the runtime reads it)."""
    cfg = json.loads((out / "config.json").read_text())
    shape = dict(hidden_size=cfg["hidden_size"], num_attention_heads=cfg["num_attention_heads"],
                 num_key_value_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
                 intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
                 rms_norm_eps=cfg["rms_norm_eps"], rope_theta=cfg["rope_theta"])
    if "eagle_config" in cfg:
        spec = te.Eagle3Spec(**shape, aux_layers=tuple(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
                             target_hidden_size=cfg["target_hidden_size"], draft_vocab_size=cfg["draft_vocab_size"])
    else:
        spec = te.EagleSpec(**shape)
    module = te.EagleHead(spec, cfg["vocab_size"])
    weights = load_file(str(out / "model.safetensors"))
    module.load_state_dict({_tensor_name(k): v.float() if v.is_floating_point() else v for k, v in weights.items()},
                           strict=True)
    return module.eval()


def test_the_checkpoint_is_what_the_runtime_reads(trained, bundled_artifact) -> None:
    """Names, config and the forward: the runtime's head over random pairs, then two chain steps on its cache,
    equals the training module's unrolled chain at the same entries."""
    names = set(load_file(str(trained / "model.safetensors")))
    assert "fc.weight" in names and not any("embed" in n or "lm_head" in n for n in names)
    cfg = json.loads((trained / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle"] and cfg["rope_theta"] == 10000.0
    assert cfg["hidden_size"] == 384 and cfg["vocab_size"] == 4096 and cfg["hidden_act"] == "silu"

    engine = Engine.load(bundled_artifact)
    head = load_head(trained, engine)
    module = _training_module(trained)
    embed = head.embed.float()
    g = torch.Generator().manual_seed(0)
    n = 9  # pairs fed before the chain
    ids = torch.randint(0, embed.shape[0], (n + 3,), generator=g)  # t_1 .. t_{n+2}, then a spare
    feats = torch.randn(n + 3, head.config.hidden_size, generator=g) * 1.5  # post-norm features are about that
    with torch.no_grad():
        outs = module.chain(embed, torch.cat([ids[:1], ids])[None], feats[None], 3)
    proposer = EagleProposer(head, 64, max_seqs=1)
    slot = torch.tensor([proposer._seq("r").slot])

    def at(p: int) -> torch.Tensor:
        return torch.tensor([p])

    with torch.inference_mode():
        ours, _ = head.forward(proposer.cache, slot, ids[:n], feats[:n], at(0), at(0))
        torch.testing.assert_close(ours.float(), outs[0][0, :n], atol=1e-4, rtol=1e-4)
        step2, _ = head.forward(proposer.cache, slot, ids[n:n + 1], ours[-1:], at(n), at(0))
        torch.testing.assert_close(step2.float()[0], outs[1][0, n - 1], atol=1e-4, rtol=1e-4)
        step3, _ = head.forward(proposer.cache, slot, ids[n + 1:n + 2], step2, at(n + 1), at(0))
        torch.testing.assert_close(step3.float()[0], outs[2][0, n - 1], atol=1e-4, rtol=1e-4)


def test_drafts_and_metrics(trained, bundled_artifact) -> None:
    """The proposer's greedy drafts over the target's own hidden states are the training module's chain fed those
    drafts; the metrics file reports the held-out agreement per chain step, before and after."""
    from transformers import AutoModelForCausalLM

    engine = Engine.load(bundled_artifact)
    module = _training_module(trained)
    target = AutoModelForCausalLM.from_pretrained(BUNDLED, dtype=torch.float32).eval()
    tokens = torch.randint(0, 4096, (1, 17), generator=torch.Generator().manual_seed(1))
    feats, _ = te.target_outputs(target, tokens)
    proposer = EagleProposer(load_head(trained, engine), 64, max_seqs=1, max_draft_tokens=3)
    proposer.record_hidden("r", 0, feats[0, :16])
    drafts = proposer.propose([DraftRequest("r", tokens[0].tolist(), 3)])[0]
    assert len(drafts) == 3
    path = torch.cat([tokens, torch.tensor([drafts[:2]])], dim=1)  # the chain is fed the drafts
    with torch.no_grad():
        outs = module.chain(target.get_input_embeddings().weight, path, torch.nn.functional.pad(feats, (0, 0, 0, 2)),
                            3)
    assert [int(target.lm_head(o[0, 15]).argmax()) for o in outs] == drafts

    metrics = json.loads((trained / "training_metrics.json").read_text())
    assert metrics["command"].startswith("python -m builder.devtools.train_eagle ")
    assert metrics["weights_bytes"] == (trained / "model.safetensors").stat().st_size
    assert [s for s, _ in metrics["loss_curve"]] == [1, 3]
    for when in ("untrained", "trained"):
        report = metrics["held_out"][when]
        assert set(report["steps"]) == {"1", "2", "3"}
        for step in report["steps"].values():
            assert 0 <= step["top1_agreement"] <= 1 and 0 <= step["acceptance"] <= 1 and step["positions"] > 0
        assert 0 <= report["expected_accepted_of_3"] <= 3


@pytest.fixture(scope="module")
def trained3(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("eagle3")
    stdlib = tmp / "stdlib"
    stdlib.mkdir()
    out = tmp / "head"
    assert te.main(["--eagle3", "--target", str(BUNDLED), "--out", str(out), "--stdlib", str(_small_stdlib(stdlib)),
                    "--max-steps", "3", "--batch-size", "2", "--seq-len", "64", "--unroll", "2"]) == 0
    return out


def test_an_eagle3_checkpoint_in_the_published_layout(trained3, bundled_artifact) -> None:
    """``--eagle3`` writes the layout vLLM, SGLang and runtime.eagle load: config.json naming the target layers
    1, 2 and 3, ``midlayer.*``, fc over three streams without a bias, the head's own norm and lm_head over the
    whole vocabulary, zero ``d2t`` offsets; bf16 floats. The runtime loads it as version 3."""
    cfg = json.loads((trained3 / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "use_aux_hidden_state": True}
    assert (cfg["target_hidden_size"], cfg["hidden_size"], cfg["draft_vocab_size"], cfg["vocab_size"]) == \
        (384, 384, 4096, 4096)
    weights = load_file(str(trained3 / "model.safetensors"))
    assert weights["fc.weight"].shape == (384, 3 * 384) and "fc.bias" not in weights
    assert weights["lm_head.weight"].shape == (4096, 384) and weights["norm.weight"].shape == (384,)
    assert {"midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight"} <= set(weights)
    assert weights["midlayer.self_attn.q_proj.weight"].shape == (384, 2 * 384)
    assert not any(n.startswith("layers.") or "embed" in n for n in weights)
    assert weights["d2t"].dtype == torch.int64 and not weights["d2t"].any()
    assert {v.dtype for n, v in weights.items() if n != "d2t"} == {torch.bfloat16}

    head = load_head(trained3, Engine.load(bundled_artifact))
    assert head.config.version == 3 and head.config.aux_layers == (1, 2, 3)
    assert head.input_width == 3 * 384 and torch.equal(head.draft_ids, torch.arange(4096))
    metrics = json.loads((trained3 / "training_metrics.json").read_text())
    assert metrics["version"] == 3 and metrics["head"]["aux_layers"] == [1, 2, 3]
    assert metrics["weights_bytes"] == (trained3 / "model.safetensors").stat().st_size
    for when in ("untrained", "trained"):
        report = metrics["held_out"][when]
        assert set(report["steps"]) == {"1", "2", "3"} and 0 <= report["expected_accepted_of_3"] <= 3
        for step in report["steps"].values():
            assert 0 <= step["top1_agreement"] <= 1 and 0 <= step["acceptance"] <= 1 and step["positions"] > 0


def test_the_eagle3_training_forward_is_the_runtimes(trained3, bundled_artifact) -> None:
    """Over the target's residual streams (Hugging Face's hidden_states[1..3]): the runtime's head fed the pairs,
    then two chain steps on its own hidden state, gives the training module's unrolled chain (outputs, hidden
    states, logits); the proposer's greedy drafts are the training module's chain fed those drafts."""
    from transformers import AutoModelForCausalLM

    engine = Engine.load(bundled_artifact)
    head = load_head(trained3, engine)
    module = _training_module(trained3)
    target = AutoModelForCausalLM.from_pretrained(BUNDLED, dtype=torch.float32).eval()
    embed = target.get_input_embeddings().weight
    n = 12  # pairs (streams_i, t_{i+1}) fed before the chain
    tokens = torch.randint(0, 4096, (1, n + 3), generator=torch.Generator().manual_seed(3))
    streams, _ = te.target_outputs(target, tokens, (1, 2, 3))
    with torch.no_grad():
        states = module.chain_states(embed, tokens, streams, 3)
    proposer = EagleProposer(head, 64, max_seqs=1)
    slot = torch.tensor([proposer._seq("r").slot])

    def at(p: int) -> torch.Tensor:
        return torch.tensor([p])

    with torch.inference_mode():
        out, hidden = head.forward(proposer.cache, slot, tokens[0, 1:n + 1], streams[0, :n], at(0), at(0))
        torch.testing.assert_close(out.float(), states[0][0][0, :n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(hidden.float(), states[0][1][0, :n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(head.lm_head(out), module.logits(states[0][0], target)[0, :n], atol=1e-3,
                                   rtol=1e-3)
        for s in (2, 3):  # the chain: the hidden state of the step before, the next text token, no fc
            out, hidden = head.forward(proposer.cache, slot, tokens[0, n + s - 1:n + s], hidden[-1:],
                                       at(n + s - 2), at(0), fresh=False)
            torch.testing.assert_close(out.float()[0], states[s - 1][0][0, n - 1], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(hidden.float()[0], states[s - 1][1][0, n - 1], atol=1e-4, rtol=1e-4)

    proposer = EagleProposer(load_head(trained3, engine), 64, max_seqs=1, max_draft_tokens=3)
    proposer.record_hidden("r", 0, streams[0, :n])
    drafts = proposer.propose([DraftRequest("r", tokens[0, :n + 1].tolist(), 3)])[0]
    path = torch.cat([tokens[:, :n + 1], torch.tensor([drafts[:2]])], dim=1)  # the chain is fed the drafts
    with torch.no_grad():
        outs = module.chain(embed, path, torch.nn.functional.pad(streams[:, :n + 1], (0, 0, 0, 2)), 3)
    assert [int(module.logits(o[0, n - 1], target).argmax()) for o in outs] == drafts
