"""Recipe validation: the messages name the key path, the bad value and what is allowed."""

from __future__ import annotations

import pytest

from builder.recipe import DEFAULT_PASSES, RecipeError, load_recipe

BASE = "model:\n  checkpoint: ckpt\n  dtype: float32\noutput_dir: out\n"


def _load(tmp_path, text, overrides=None):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return load_recipe(p, overrides)


def test_valid_recipe_defaults(tmp_path):
    r = _load(tmp_path, BASE)
    assert r.name == "r" and r.model.dtype == "float32"
    assert r.passes == DEFAULT_PASSES
    assert r.runtime.tokens_per_block == 16 and r.quantization.algo == "none"
    assert len(r.sha256()) == 64


def test_unknown_key_names_path_and_suggests(tmp_path):
    with pytest.raises(RecipeError) as e:
        _load(tmp_path, BASE + "runtime:\n  max_batchsize: 4\n")
    msg = str(e.value)
    assert "runtime.max_batchsize: unknown key" in msg
    assert "did you mean 'max_batch_size'" in msg
    assert "max_seq_len" in msg  # lists what is allowed


def test_bad_enum_value_lists_allowed(tmp_path):
    with pytest.raises(RecipeError) as e:
        _load(tmp_path, BASE + "quantization:\n  algo: awk\n")
    assert "quantization.algo: 'awk' is not one of awq, gptq, smoothquant, fp8, int8_wo, none" in str(e.value)


def test_bad_number_and_missing_key(tmp_path):
    with pytest.raises(RecipeError) as e:
        _load(tmp_path, "model:\n  dtype: float32\noutput_dir: o\nruntime:\n  max_seq_len: 1\n")
    msg = str(e.value)
    assert "model.checkpoint: required key is missing" in msg
    assert "runtime.max_seq_len: 1" in msg and "greater than or equal to 2" in msg


def test_unknown_pass_and_block_size(tmp_path):
    with pytest.raises(RecipeError, match=r"passes\[1\]: 'fuse_everything' is not a known pass"):
        _load(tmp_path, BASE + "passes: [dce, fuse_everything]\n")
    with pytest.raises(RecipeError, match="tokens_per_block 12 is not a power of two"):
        _load(tmp_path, BASE + "runtime:\n  tokens_per_block: 12\n")


def test_set_overrides(tmp_path):
    r = _load(tmp_path, BASE, ["runtime.max_seq_len=4096", "model.dtype=bfloat16", "passes=[dce]"])
    assert r.runtime.max_seq_len == 4096 and r.model.dtype == "bfloat16" and r.passes == ["dce"]
    with pytest.raises(RecipeError, match="runtime.max_seqlen: unknown key"):
        _load(tmp_path, BASE, ["runtime.max_seqlen=4096"])
    with pytest.raises(RecipeError, match="expected key.path=value"):
        _load(tmp_path, BASE, ["runtime.max_seq_len"])
    with pytest.raises(RecipeError, match=r"the value .* is not valid YAML \(while scanning a double-quoted"):
        _load(tmp_path, BASE, ['quantization.ignore="re:layers\\.0\\."'])


def test_not_yaml_and_missing_file(tmp_path):
    with pytest.raises(RecipeError, match="not valid YAML"):
        _load(tmp_path, "model: [unclosed\n")
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")


def test_mixed_methods_list(tmp_path):
    r = _load(tmp_path, BASE + "quantization:\n  - algo: gptq\n    targets: ['re:mlp']\n  - algo: int8_wo\n")
    assert [q.algo for q in r.quant_sections()] == ["gptq", "int8_wo"] and r.quant_algo() == "gptq+int8_wo"
    with pytest.raises(RecipeError, match="a list needs distinct methods"):
        _load(tmp_path, BASE + "quantization:\n  - algo: gptq\n  - algo: gptq\n")
    with pytest.raises(RecipeError, match=r"quantization\[1\]\.algo: 'awk' is not one of"):
        _load(tmp_path, BASE + "quantization:\n  - algo: gptq\n  - algo: awk\n")
    assert _load(tmp_path, BASE).quant_sections() == []
