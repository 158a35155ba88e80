"""builder.devtools.train_eagle: a few steps on a handful of standard-library files give a checkpoint the runtime
loads (runtime.eagle.load_head), whose forward is the training module's (step 1 from an empty cache, then the
chain steps on the runtime's cache: the training's unrolled attention is what the proposer computes), whose greedy
drafts are the training module's, and a metrics file with the held-out agreement per chain step."""

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
from runtime.eagle import EagleProposer, load_head
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
    """The training module with the stored (bf16) weights, in fp32."""
    cfg = json.loads((out / "config.json").read_text())
    spec = te.EagleSpec(hidden_size=cfg["hidden_size"], num_attention_heads=cfg["num_attention_heads"],
                        num_key_value_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
                        intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
                        rms_norm_eps=cfg["rms_norm_eps"], rope_theta=cfg["rope_theta"])
    module = te.EagleHead(spec)
    module.load_state_dict({k: v.float() for k, v in load_file(str(out / "model.safetensors")).items()},
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
        ours = head.forward(proposer.cache, slot, ids[:n], feats[:n], at(0), at(0))
        torch.testing.assert_close(ours.float(), outs[0][0, :n], atol=1e-4, rtol=1e-4)
        step2 = head.forward(proposer.cache, slot, ids[n:n + 1], ours[-1:], at(n), at(0))
        torch.testing.assert_close(step2.float()[0], outs[1][0, n - 1], atol=1e-4, rtol=1e-4)
        step3 = head.forward(proposer.cache, slot, ids[n + 1:n + 2], step2, at(n + 1), at(0))
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
