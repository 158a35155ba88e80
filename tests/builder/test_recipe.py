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


@pytest.mark.parametrize("data, message", [
    (BASE.encode("utf-16"), "the file is UTF-16 text; save it as UTF-8"),
    (b"\x80\x81\xffmodel: x\n", "not UTF-8 text (byte 0x80 at offset 0)"),
    (b"model: \x00\n", "not valid YAML: character #x0000 at offset 7 is not allowed"),
], ids=["utf-16", "binary", "nul"])
def test_unreadable_recipe_bytes(tmp_path, data, message):
    p = tmp_path / "r.yaml"
    p.write_bytes(data)
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_recipe_path_is_a_directory(tmp_path):
    with pytest.raises(RecipeError, match="is a directory; pass the recipe YAML file itself"):
        load_recipe(tmp_path)


def test_duplicate_key_names_key_and_lines(tmp_path):
    with pytest.raises(RecipeError, match=r"line 7, column 1: key 'runtime' appears twice in one mapping "
                                          r"\(first on line 5\)"):
        _load(tmp_path, BASE + "runtime:\n  max_seq_len: 8\nruntime:\n  max_batch_size: 2\n")
    with pytest.raises(RecipeError, match=r"line 7, column 3: key 'max_seq_len' appears twice"):
        _load(tmp_path, BASE + "runtime:\n  max_seq_len: 8\n  max_seq_len: 16\n")
    with pytest.raises(RecipeError, match="key 'a' appears twice"):
        _load(tmp_path, BASE, ["verify.prompts=[x]", "calibration={a: 1, a: 2}"])


@pytest.mark.parametrize("text, message", [
    ("runtime:\n  max_seq_len: true\n", "runtime.max_seq_len: true is a boolean; expected a whole number"),
    ("runtime:\n  max_seq_len: '128'\n", "runtime.max_seq_len: '128' is a string; expected a whole number "
                                         "(drop the quotes)"),
    ("runtime:\n  max_batch_size: 8.0\n", "runtime.max_batch_size: 8.0 is a decimal number; expected a whole "
                                          "number (write 8)"),
    ("quantization:\n  algo: gptq\n  group_size: 64.5\n", "quantization.group_size: 64.5 is a decimal number"),
    ("quantization:\n  algo: smoothquant\n  alpha: '0.5'\n", "quantization.alpha: '0.5' is a string; "
                                                             "expected a number"),
    ("gates:\n  enabled: 1\n", "gates.enabled: 1 is a whole number; expected true or false"),
    ("target:\n  gpu_memory: 80\n", "target.gpu_memory: 80 is a whole number; expected a string"),
    ("passes: dce\n", "passes: 'dce' is a string; expected a list"),
    ("runtime: 5\n", "runtime: 5 is a whole number; expected a section"),
    ("calibration:\n  seed: null\n", "calibration.seed: has no value; expected a whole number"),
])
def test_wrong_types_are_not_coerced(tmp_path, text, message):
    with pytest.raises(RecipeError) as e:
        _load(tmp_path, BASE + text)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_float_fields_take_whole_numbers(tmp_path):
    r = _load(tmp_path, BASE + "verify:\n  atol: 1\ntarget:\n  gpu_memory_utilization: 1\n")
    assert r.verify.atol == 1.0 and r.target.gpu_memory_utilization == 1.0


def test_empty_paths_are_refused(tmp_path):
    with pytest.raises(RecipeError, match="output_dir: must not be empty"):
        _load(tmp_path, "model:\n  checkpoint: ckpt\noutput_dir: ''\n")
    with pytest.raises(RecipeError, match="model.checkpoint: must not be empty"):
        _load(tmp_path, "model:\n  checkpoint: ' '\noutput_dir: out\n")


@pytest.mark.parametrize("text, message", [
    ("quantization:\n  algo: int8_wo\n  ignore: ['re:[unclosed']\n",
     "quantization.ignore[0]: 're:[unclosed' is not a valid regular expression (unterminated character set"),
    ("quantization:\n  - algo: int8_wo\n  - algo: gptq\n    targets: [mlp, 're:(a']\n",
     "quantization[1].targets[1]: 're:(a' is not a valid regular expression (missing )"),
    ("quantization:\n  algo: fp8\n  targets: ['']\n", "quantization.targets[0]: must not be empty"),
])
def test_bad_module_patterns_fail_at_load(tmp_path, text, message):
    with pytest.raises(RecipeError) as e:
        _load(tmp_path, BASE + text)
    assert message in str(e.value)


def test_exponent_numbers_are_numbers(tmp_path):
    """1e-9 is a number in a recipe and in --set (YAML 1.1 would read it as a string, which strict types refuse)."""
    r = _load(tmp_path, BASE + "verify:\n  atol: 1e-3\n", ["gates.max_kl=1e-9"])
    assert r.verify.atol == 1e-3 and r.gates.max_kl == 1e-9


def test_lm_head_option(tmp_path):
    """quantization.lm_head: off by default, a strict bool, only with a method, in one section of a list."""
    r = _load(tmp_path, BASE + "quantization:\n  algo: awq\n")
    assert r.quantization.lm_head is False and r.quantization.method_options()["lm_head"] is False
    r = _load(tmp_path, BASE + "quantization:\n  algo: awq\n  lm_head: true\n")
    assert r.quantization.method_options()["lm_head"] is True
    for value, kind in (("'yes'", "'yes' is a string"), ("1", "1 is a whole number"), ("null", "has no value")):
        with pytest.raises(RecipeError) as e:
            _load(tmp_path, BASE + f"quantization:\n  algo: fp8\n  lm_head: {value}\n")
        assert f"quantization.lm_head: {kind}" in str(e.value) and "expected true or false" in str(e.value)
    with pytest.raises(RecipeError, match=r"quantization\[1\]\.lm_head: 'true' is a string; expected true or false"):
        _load(tmp_path, BASE + "quantization:\n  - algo: gptq\n  - algo: int8_wo\n    lm_head: 'true'\n")
    with pytest.raises(RecipeError, match="quantization.lm_head: true needs a quantization method; algo is 'none'"):
        _load(tmp_path, BASE, ["quantization.lm_head=true"])
    with pytest.raises(RecipeError, match="lm_head: true in sections 0, 1; .* set it in one section only"):
        _load(tmp_path, BASE + "quantization:\n  - algo: gptq\n    lm_head: true\n  - algo: fp8\n    lm_head: true\n")


def test_a_value_that_aliases_expand_to_billions_of_items_is_quoted_without_walking_it(tmp_path):
    """YAML aliases make a kilobyte recipe hold a list of 2**40 strings (shared, so it costs no memory): the error
    quotes the start of it, bounded in depth and width, instead of writing it all out first."""
    lines = ["name: bomb", "model:", "  checkpoint: models/pystdlib-llama", "output_dir: out",
             'a0: &a0 ["x", "x"]'] + [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}]" for i in range(1, 40)] + ["passes: *a39"]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    quoted = r"passes\[0\]: \[\[\[\[\.\.\.\], \[\.\.\.\]\].*\.\.\. is a list; expected a string"
    with pytest.raises(RecipeError, match=quoted):
        load_recipe(path)


@pytest.mark.parametrize("name", ["int8_wo", "fp8", "awq", "gptq", "smoothquant", "kv_cache_quant"])
def test_a_quantization_method_in_passes_is_refused(tmp_path, name):
    """Listed as a pass it quantized the graph ungated, and the manifest said the artifact was unquantized."""
    key = "runtime.kv_cache_dtype" if name == "kv_cache_quant" else f"quantization.algo: {name}"
    with pytest.raises(RecipeError, match=rf"passes\[1\]: '{name}' is a quantization method.*set {key}"):
        _load(tmp_path, BASE + f"passes: [merge_qkv, {name}, verify]\n")


@pytest.mark.parametrize("key, value", [("window", 2048), ("needle_context_len", 4000), ("greedy_tokens", 1024)])
def test_gate_lengths_past_the_context_are_refused(tmp_path, key, value):
    with pytest.raises(RecipeError, match=rf"gates.{key} {value} is past runtime.max_seq_len 1024"):
        _load(tmp_path, BASE + f"runtime:\n  max_seq_len: 1024\ngates:\n  {key}: {value}\n")
    _load(tmp_path, BASE + f"runtime:\n  max_seq_len: {value + 1}\ngates:\n  {key}: {value}\n")  # within it: fine


def test_default_gate_lengths_shrink_to_a_short_context_and_the_needle_check_turns_off_with_0(tmp_path):
    """A recipe serving 64 tokens, gates left at their defaults: the windows are 64 tokens, the greedy check 16
    (both fit); at 12 tokens the greedy check takes 11; at 4, under the window's least, the window is left as it is
    (such a recipe loaded before). needle_context_len 0 or null turns the needle check off, as its description says;
    1-31 is refused."""
    gates = _load(tmp_path, BASE + "runtime:\n  max_seq_len: 64\n").gates
    assert (gates.window, gates.greedy_tokens) == (64, 16)
    gates = _load(tmp_path, BASE + "runtime:\n  max_seq_len: 12\n").gates
    assert (gates.window, gates.greedy_tokens) == (12, 11) and not gates.model_fields_set  # still the defaults
    gates = _load(tmp_path, BASE + "runtime:\n  max_seq_len: 4\n").gates  # under the window's least (8): loads
    assert (gates.window, gates.greedy_tokens) == (256, 3)
    assert (_load(tmp_path, BASE).gates.window, _load(tmp_path, BASE).gates.greedy_tokens) == (256, 16)
    for off in ("0", "null"):
        assert _load(tmp_path, BASE + f"gates:\n  needle_context_len: {off}\n").gates.needle_context_len is None
    with pytest.raises(RecipeError, match=r"gates.needle_context_len: 31 is too short for a needle check: at least "
                                          r"32 tokens, or 0 / null for none"):
        _load(tmp_path, BASE + "gates:\n  needle_context_len: 31\n")


def test_activation_quant_option(tmp_path):
    """quantization.activation_quant: fp8 (W4A8) on awq and gptq with 4 bits; refused elsewhere, naming why."""
    r = _load(tmp_path, BASE + "quantization:\n  algo: awq\n  activation_quant: fp8\n")
    assert r.quantization.method_options()["activation_quant"] == "fp8"
    plain = _load(tmp_path, BASE + "quantization:\n  algo: awq\n")
    assert "activation_quant" not in plain.quantization.method_options()
    _load(tmp_path, BASE + "quantization:\n  algo: gptq\n  activation_quant: fp8\n")
    with pytest.raises(RecipeError, match="activation_quant: fp8 .W4A8. takes 4-bit weights; bits is 8"):
        _load(tmp_path, BASE + "quantization:\n  algo: gptq\n  bits: 8\n  activation_quant: fp8\n")
    with pytest.raises(RecipeError, match="activation_quant: does not apply to algo 'smoothquant'"):
        _load(tmp_path, BASE + "quantization:\n  algo: smoothquant\n  activation_quant: fp8\n")
    with pytest.raises(RecipeError, match="quantization.activation_quant: 'int8'"):
        _load(tmp_path, BASE + "quantization:\n  algo: awq\n  activation_quant: int8\n")
