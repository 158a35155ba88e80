"""The recipe's parallel section; a tp_size the model cannot take stopping the build before calibration;
rank weight files written one tensor at a time."""

from __future__ import annotations

import weakref

import pytest
import torch

from builder.recipe import RecipeError, load_recipe, validate_recipe
from passes import PassError

BASE = "model:\n  checkpoint: ckpt\n  dtype: float32\noutput_dir: out\n"


def _load(tmp_path, text):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return load_recipe(p)


def test_defaults_to_one_rank(tmp_path):
    r = _load(tmp_path, BASE)
    assert (r.parallel.tp_size, r.parallel.vocab_parallel, r.parallel.gpus_per_node) == (1, False, None)
    r = _load(tmp_path, BASE + "parallel:\n  tp_size: 4\n  vocab_parallel: true\n  gpus_per_node: 8\n")
    assert (r.parallel.tp_size, r.parallel.vocab_parallel) == (4, True)


@pytest.mark.parametrize("section,message", [
    ("  tp_size: 0\n", "parallel.tp_size: 0: input should be greater than or equal to 1"),
    ("  tp_size: 4\n  gpus_per_node: 2\n",
     "parallel.tp_size: 4 is more than the runtime host's gpus_per_node 2; one rank runs per GPU, pick 1 or 2"),
    ("  tp_sise: 2\n", "parallel.tp_sise: unknown key (did you mean 'tp_size'?); allowed here: tp_size, "),
])
def test_bad_parallel_settings_name_the_key(tmp_path, section, message):
    with pytest.raises(RecipeError) as e:
        _load(tmp_path, BASE + "parallel:\n" + section)
    assert message in str(e.value)


def test_shard_is_not_listed_as_a_pass(tmp_path):
    with pytest.raises(RecipeError, match="'shard' runs last, after quantization, when parallel.tp_size > 1"):
        _load(tmp_path, BASE + "passes: [merge_qkv, shard]\n")


def test_a_tp_size_the_model_cannot_take_stops_the_build_before_calibration(checkpoints, tmp_path, monkeypatch):
    import builder.pipeline as pipeline

    def no_calibration(*args, **kwargs):
        raise AssertionError("the build calibrated before checking tp_size")

    monkeypatch.setattr(pipeline, "calibration_data", no_calibration)
    out = tmp_path / "tp3"
    recipe = validate_recipe({"model": {"checkpoint": str(checkpoints["llama"]), "dtype": "float32"},
                              "output_dir": str(out), "runtime": {"max_seq_len": 256},
                              "quantization": {"algo": "gptq", "group_size": 8},
                              "parallel": {"tp_size": 3}})
    with pytest.raises(PassError, match=r"tp_size 3 does not divide num_attention_heads 4 .*pick tp_size 1, 2 or 4"):
        pipeline.build(recipe)
    assert not out.exists()


def test_rank_files_are_written_one_tensor_at_a_time(checkpoints, tmp_path, monkeypatch):
    """The build holds the model plus one tensor's shard: each concatenated shard (merged q/k/v, gate/up)
    is gone before the next is made, and the rest are views of the model's tensors."""
    from safetensors.torch import load_file

    from builder.artifact import _write_weights
    from builder.checkpoint import open_checkpoint
    from builder.checkpoint import attach_weights
    from passes import PassContext, run_passes
    from passes.ir import ShardedWeights
    from passes.trace import trace

    ckpt = open_checkpoint(checkpoints["llama"])
    graph, meta_model = trace(ckpt.hf_config())
    attach_weights(graph, ckpt, meta_model, torch.float32)
    ctx = PassContext(options={"shard": {"tp_size": 2}})
    graph, _ = run_passes(graph, ["merge_qkv", "merge_gate_up", "fuse_silu_mul", "dce", "shard"], ctx)
    shards = graph.shards
    model_storage = {t.untyped_storage().data_ptr() for t in shards.full.values()}
    made = ShardedWeights.tensor
    fresh: list[weakref.ref] = []

    def tracked(self, name: str, rank: int) -> torch.Tensor:
        assert all(ref() is None for ref in fresh), "an earlier shard is still held while the next one is made"
        t = made(self, name, rank)
        if t.untyped_storage().data_ptr() not in model_storage:
            fresh.append(weakref.ref(t))
        return t

    monkeypatch.setattr(ShardedWeights, "tensor", tracked)
    section, _ = _write_weights(tmp_path, graph)
    assert len(fresh) == 2 * 2 * 2  # (q/k/v, gate/up) x 2 layers x 2 ranks are concatenations
    monkeypatch.setattr(ShardedWeights, "tensor", made)
    for rank, entry in enumerate(section["ranks"]):
        written = load_file(tmp_path / entry["file"])
        assert sorted(written) == entry["tensors"]
        assert all(torch.equal(written[n], shards.tensor(n, rank)) for n in written)
