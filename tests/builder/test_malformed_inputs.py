"""Malformed recipes and checkpoints: `builder build` exits 1 with a one-line message, no traceback,
and fails before any expensive step (reading weights, running passes)."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import pytest
from typer.testing import CliRunner

from builder.cli import app
from conftest import make_checkpoint

runner = CliRunner()


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("malformed") / "llama", "llama")


@pytest.fixture(scope="module", autouse=True)
def traced_once():
    """Trace each distinct config once per module: the cases test error handling, not tracing, and
    torch.export takes seconds. Every build gets its own copy of the graph."""
    import builder.pipeline

    real = builder.pipeline.trace
    cache: dict[str, tuple] = {}

    def trace(config):
        key = config.to_json_string()
        if key not in cache:
            cache[key] = real(config)
        graph, meta_model = cache[key]
        return graph.copy(), meta_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builder.pipeline, "trace", trace)
        yield


def _recipe(tmp_path: Path, checkpoint: Path | str, extra: str = "") -> Path:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model:\n  checkpoint: {checkpoint}\n  dtype: float32\noutput_dir: {tmp_path / 'out'}\n"
                      f"runtime:\n  max_seq_len: 256\n{extra}")
    return recipe


def _build_error(recipe: Path, *args: str) -> str:
    """Run `builder build`; check it failed cleanly, and return its one-line error message."""
    res = runner.invoke(app, ["build", str(recipe), "--quiet", *args])
    assert isinstance(res.exception, SystemExit), f"uncaught {res.exception!r}\n{res.output}"
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert not (recipe.parent / "out").exists()
    return lines[0]


def _forbid_expensive_steps(monkeypatch) -> None:
    """Reading the weights or running a pass fails the test: the error must come before them."""
    import builder.pipeline

    def forbidden(*args, **kwargs):
        raise AssertionError("the build went on to read weights or run passes")

    monkeypatch.setattr(builder.pipeline, "attach_weights", forbidden)
    monkeypatch.setattr(builder.pipeline, "run_passes", forbidden)


@pytest.fixture
def no_expensive_steps(monkeypatch):
    _forbid_expensive_steps(monkeypatch)


@pytest.mark.parametrize("section, message", [
    ("quantization:\n  algo: int8_wo\n  targets: ['re:nothing']\n",
     "quantization (algo int8_wo) selects no linear: targets ['re:nothing'] match none of the 14 linears "
     "(names look like 'model.layers.0.self_attn.q_proj')"),
    ("quantization:\n  - algo: gptq\n    group_size: 16\n    targets: ['re:mlp']\n  - algo: fp8\n"
     "    ignore: ['re:layers']\n", "quantization[1] (algo fp8) selects no linear: ignore ['re:layers'] excludes"),
    ("quantization:\n  algo: awq\n  group_size: 48\n", "awq: model.layers.0.self_attn.q_proj has in_features 64, "
                                                       "not divisible by group_size 48"),
], ids=["targets-match-nothing", "later-section-ignores-everything", "group-size-not-dividing"])
def test_quantization_that_cannot_apply_fails_before_any_pass(tmp_path, base_checkpoint, no_expensive_steps,
                                                              section, message):
    assert message in _build_error(_recipe(tmp_path, base_checkpoint, section))


# --- the sweep -------------------------------------------------------------------------------------
@dataclass
class Case:
    id: str
    expect: str  # a piece of the one-line error message
    recipe: str = ""  # YAML appended to the base recipe; {tmp} is the case's directory
    checkpoint: Optional[Callable[[Path], None]] = None  # edits a copy of the base checkpoint
    recipe_file: Optional[Callable[[Path], None]] = None  # edits the written recipe file
    args: tuple[str, ...] = ()  # extra command-line arguments
    before_weights: bool = True  # fails before any weight is read or pass runs


def _config(**changes) -> Callable[[Path], None]:
    def edit(ckpt: Path) -> None:
        config = json.loads((ckpt / "config.json").read_text())
        config.update(changes)
        (ckpt / "config.json").write_text(json.dumps(config))
    return edit


def _write(name: str, data: str | bytes) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        target = path / name if path.is_dir() else path
        target.write_bytes(data if isinstance(data, bytes) else data.encode())
    return edit


def _remove(*names: str) -> Callable[[Path], None]:
    def edit(ckpt: Path) -> None:
        for name in names:
            (ckpt / name).unlink()
    return edit


def _tensors(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(ckpt: Path) -> None:
        import torch  # noqa: F401  (safetensors.torch needs it)
        from safetensors.torch import load_file, save_file

        tensors = load_file(ckpt / "model.safetensors")
        change(tensors)
        save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    return edit


def _shard_index(ckpt: Path) -> None:
    """An index that names a second shard the directory lacks."""
    shard = (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00002.safetensors")
    data = shard.read_bytes()
    names = [k for k in json.loads(data[8:8 + int.from_bytes(data[:8], "little")]) if k != "__metadata__"]
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        n: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, n in enumerate(names)}}))


def _whole_index(ckpt: Path) -> None:
    """An index over the one shard there is, without the "metadata" object transformers reads."""
    data = (ckpt / "model.safetensors").read_bytes()
    names = [k for k in json.loads(data[8:8 + int.from_bytes(data[:8], "little")]) if k != "__metadata__"]
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        n: "model.safetensors" for n in names}}))


def _replace_with_file(ckpt: Path) -> None:
    shutil.rmtree(ckpt)
    ckpt.write_text("not a directory")


def _truncate(name: str, keep: int) -> Callable[[Path], None]:
    def edit(ckpt: Path) -> None:
        (ckpt / name).write_bytes((ckpt / name).read_bytes()[:keep])
    return edit


def _fp8_weights(tensors: dict) -> None:
    import torch

    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        scale = tensors[name].abs().amax() / 448.0
        tensors[name] = (tensors[name] / scale).to(torch.float8_e4m3fn)


Q = "quantization:\n  algo: "
CASES = [
    # the recipe file
    Case("recipe-missing", "does not exist", recipe_file=lambda p: p.unlink()),
    Case("recipe-is-a-directory", "is a directory; pass the recipe YAML file itself",
         recipe_file=lambda p: (p.unlink(), p.mkdir())),
    Case("recipe-utf16", "the file is UTF-16 text; save it as UTF-8",
         recipe_file=lambda p: p.write_bytes(p.read_text().encode("utf-16"))),
    Case("recipe-binary", "not UTF-8 text (byte 0x89 at offset 0)", recipe_file=_write("", b"\x89PNG\r\n\x1a\n")),
    Case("recipe-nul-byte", "not valid YAML: character #x0000", recipe_file=_write("", "model: a\x00\n")),
    Case("recipe-empty", "is empty; a recipe is a YAML mapping", recipe_file=_write("", "")),
    Case("recipe-top-level-list", "got a list", recipe_file=_write("", "- model: x\n")),
    Case("recipe-bad-yaml", "not valid YAML: line 8, column 1: expected ',' or ']', but got '<stream end>' (while "
         "parsing a flow sequence that starts on line 7, column 9)", recipe="passes: [dce\n"),
    Case("recipe-tab-indent", "not valid YAML: line 8, column 1: found character '\\t' that cannot start any token",
         recipe="verify:\n\tatol: 1\n"),
    Case("recipe-duplicate-key", "key 'max_seq_len' appears twice in one mapping (first on line 6)",
         recipe="  max_seq_len: 128\n"),
    Case("recipe-duplicate-section", "key 'runtime' appears twice in one mapping (first on line 5)", recipe="runtime:\n  max_batch_size: 2\n"),
    Case("unknown-top-level-key", "outptu_dir: unknown key (did you mean 'output_dir'?)", recipe="outptu_dir: x\n"),
    Case("unknown-nested-key", "runtime.max_seqlen: unknown key (did you mean 'max_seq_len'?)",
         args=("--set", "runtime.max_seqlen=64")),
    Case("model-missing", "model: required key is missing",
         recipe_file=lambda p: p.write_text("output_dir: out\n")),
    Case("output-dir-missing", "output_dir: required key is missing",
         recipe_file=lambda p: p.write_text("model:\n  checkpoint: ckpt\n")),
    Case("output-dir-empty", "output_dir: must not be empty", args=("--set", "output_dir=''")),
    Case("output-dir-null", "output_dir: has no value; expected a string", args=("--set", "output_dir=null")),
    Case("checkpoint-empty", "model.checkpoint: must not be empty", args=("--set", "model.checkpoint=")),
    Case("bad-dtype", "model.dtype: 'fp32' is not one of float32, bfloat16, float16", args=("--set", "model.dtype=fp32")),
    Case("bool-for-int", "runtime.max_seq_len: true is a boolean; expected a whole number",
         args=("--set", "runtime.max_seq_len=true")),
    Case("string-for-int", "runtime.max_batch_size: '8' is a string; expected a whole number (drop the quotes)",
         args=("--set", "runtime.max_batch_size='8'")),
    Case("float-for-int", "runtime.max_num_tokens: 64.0 is a decimal number; expected a whole number (write 64)",
         args=("--set", "runtime.max_num_tokens=64.0")),
    Case("string-for-float", "verify.atol: 'small' is a string; expected a number", args=("--set", "verify.atol=small")),
    Case("list-for-string", "calibration.text_field: ['a'] is a list; expected a string",
         args=("--set", "calibration.text_field=[a]")),
    Case("zero-batch", "runtime.max_batch_size: 0: input should be greater than or equal to 1",
         args=("--set", "runtime.max_batch_size=0")),
    Case("negative-seq-len", "runtime.max_seq_len: -5: input should be greater than or equal to 2",
         args=("--set", "runtime.max_seq_len=-5")),
    Case("block-not-power-of-two", "tokens_per_block 24 is not a power of two", args=("--set", "runtime.tokens_per_block=24")),
    Case("bad-kv-cache-dtype", "runtime.kv_cache_dtype: 'int4' is not one of auto, fp8, int8",
         args=("--set", "runtime.kv_cache_dtype=int4")),
    Case("passes-not-a-list", "passes: 'dce' is a string; expected a list", args=("--set", "passes=dce")),
    Case("unknown-pass", "passes[1]: 'fuse_everything' is not a known pass", args=("--set", "passes=[dce, fuse_everything]")),
    Case("shard-listed", "passes[0]: 'shard' runs last", args=("--set", "passes=[shard]")),
    Case("bad-algo", "quantization.algo: 'awk' is not one of awq, gptq", recipe=Q + "awk\n"),
    Case("option-for-other-algo", "quantization.group_size: does not apply to algo 'int8_wo'",
         recipe=Q + "int8_wo\n  group_size: 64\n"),
    Case("bad-bits", "quantization.bits: 3 is not one of 4, 8", recipe=Q + "gptq\n  bits: 3\n"),
    Case("bad-awq-rounding", "quantization.rounding: 'stochastic' is not one of nearest, gptq",
         recipe=Q + "awq\n  rounding: stochastic\n"),
    Case("rounding-for-gptq", "quantization.rounding: does not apply to algo 'gptq'",
         recipe=Q + "gptq\n  rounding: gptq\n"),
    Case("zero-group-size", "quantization.group_size: 0 must be -1 (per channel) or >= 1",
         recipe=Q + "awq\n  group_size: 0\n"),
    Case("bad-regex", "quantization.ignore[0]: 're:[unclosed' is not a valid regular expression",
         recipe=Q + "int8_wo\n  ignore: ['re:[unclosed']\n"),
    Case("duplicate-methods", "quantization: a list needs distinct methods other than 'none'",
         recipe="quantization:\n  - algo: fp8\n  - algo: fp8\n"),
    Case("zero-atol", "verify.atol: 0: input should be greater than 0", args=("--set", "verify.atol=0")),
    Case("no-verify-prompts", "verify.prompts: []: list should have at least 1 item", args=("--set", "verify.prompts=[]")),
    Case("zero-calibration-samples", "calibration.num_samples: 0", args=("--set", "calibration.num_samples=0")),
    Case("bad-calibration-device", "calibration.device: 'gpu' is not one of auto, cpu, cuda",
         args=("--set", "calibration.device=gpu")),
    Case("bad-gpu-memory", "target.gpu_memory:", args=("--set", "target.gpu_memory=80 GiBs")),
    Case("utilization-above-one", "target.gpu_memory_utilization: 1.5", args=("--set", "target.gpu_memory_utilization=1.5")),
    Case("negative-max-kl", "gates.max_kl: -1", args=("--set", "gates.max_kl=-1")),
    Case("zero-tp-size", "parallel.tp_size: 0", args=("--set", "parallel.tp_size=0")),
    Case("tp-size-above-host", "tp_size: 4 is more than the runtime host's gpus_per_node 2",
         recipe="parallel:\n  tp_size: 4\n  gpus_per_node: 2\n"),
    Case("set-without-value", "--set 'runtime.max_seq_len': expected key.path=value", args=("--set", "runtime.max_seq_len")),
    Case("set-into-a-value", "--set 'output_dir.x=1': 'output_dir' is not a section", args=("--set", "output_dir.x=1")),
    # the checkpoint directory and its files
    Case("checkpoint-missing", "does not exist; download the checkpoint first",
         args=("--set", "model.checkpoint=/nonexistent/llama")),
    Case("checkpoint-hub-id", "looks like a model hub id: this toolchain never downloads",
         args=("--set", "model.checkpoint=meta-llama/Llama-3.1-8B")),
    Case("checkpoint-is-a-file", "is not a directory", checkpoint=_replace_with_file),
    Case("no-config", "has no config.json", checkpoint=_remove("config.json")),
    Case("config-not-json", "config.json is not valid JSON", checkpoint=_write("config.json", "{model_type: llama")),
    Case("config-not-utf8", "config.json is not valid JSON", checkpoint=_write("config.json", b"\xff\xfe{\x00}")),
    Case("config-a-list", "config.json holds a JSON list, not an object", checkpoint=_write("config.json", "[1, 2]")),
    Case("model-type-that-does-not-lift", "op aten.embedding.default at module 'model.decoder.embed_positions' "
         "combines weight model.decoder.embed_positions.weight", checkpoint=_config(model_type="opt")),
    Case("no-model-type", "model_type is null; config.json must name the model's family",
         checkpoint=_config(model_type=None)),
    Case("config-size-a-string", "hidden_size is \"64\", expected a positive whole number",
         checkpoint=_config(hidden_size="64")),
    Case("config-zero-heads", "num_attention_heads is 0, expected a positive whole number",
         checkpoint=_config(num_attention_heads=0)),
    Case("config-per-layer-sizes-short", "intermediate_size is [64], expected a positive whole number or a list of "
         "them, one per layer (2 layers)", checkpoint=_config(intermediate_size=[64])),
    Case("config-per-layer-size-zero", "intermediate_size is [64, 0], expected a positive whole number or a list",
         checkpoint=_config(intermediate_size=[64, 0])),
    Case("config-kv-heads-not-dividing", "num_key_value_heads 3 does not divide num_attention_heads 4",
         checkpoint=_config(num_key_value_heads=3)),
    Case("config-rejected-by-transformers", "transformers cannot read this llama config",
         checkpoint=_config(rms_norm_eps="tiny")),
    Case("pre-quantized-block-fp8-static", "quantization_config.activation_scheme is \"static\"; imported: dynamic",
         checkpoint=_config(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128],
                                                 "activation_scheme": "static"})),
    Case("pre-quantized-without-codes", "config.json says the checkpoint is gptq-quantized but no linear of the "
         "model has its quantized tensors", before_weights=False,
         checkpoint=_config(quantization_config={"quant_method": "gptq", "bits": 4, "group_size": 32})),
    Case("no-weights", "has no *.safetensors weight files", checkpoint=_remove("model.safetensors")),
    Case("pickled-weights-only", "pickled weights are never loaded; convert them to safetensors first",
         checkpoint=lambda c: ((c / "model.safetensors").rename(c / "pytorch_model.bin"))),
    Case("weights-a-pipe", "model.safetensors is not a regular file",
         checkpoint=lambda c: ((c / "model.safetensors").unlink(), os.mkfifo(c / "model.safetensors"))),
    Case("truncated-weights", "model.safetensors: not a readable safetensors file",
         checkpoint=_truncate("model.safetensors", 1000)),
    Case("garbage-weights", "model.safetensors: not a readable safetensors file",
         checkpoint=_write("model.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage}")),
    Case("index-names-missing-shard", "shards named in model.safetensors.index.json are missing: "
         "model-00002-of-00002.safetensors", checkpoint=_shard_index),
    Case("index-without-metadata", 'model.safetensors.index.json has no "metadata" object',
         checkpoint=_whole_index, before_weights=False),  # only the verify pass's reference needs it
    Case("index-not-json", "model.safetensors.index.json is not a valid safetensors index",
         checkpoint=_write("model.safetensors.index.json", "{")),
    Case("index-without-weight-map", "model.safetensors.index.json is not a valid safetensors index",
         checkpoint=_write("model.safetensors.index.json", json.dumps({"metadata": {}}))),
    Case("generation-config-out-of-range", "temperature: -5 is not in",
         checkpoint=_write("generation_config.json", json.dumps({"temperature": -5}))),
    Case("eos-id-past-vocab", "generation_config.json: eos_token_id[0] is 1000000000000; allowed: token ids 0..319 "
         "(the model's vocab_size)",
         checkpoint=_write("generation_config.json", json.dumps({"eos_token_id": [10**12, -1]}))),
    Case("chat-template-syntax-error", "chat_template.jinja: the chat template does not compile (Jinja error at line "
         "2: Encountered unknown tag 'endfro'", checkpoint=_write("chat_template.jinja", "{% for m in messages %}\n"
                                                                                         "{% endfro %}")),
    Case("no-tokenizer", "ckpt/tokenizer.json: no such file", checkpoint=_remove("tokenizer.json")),
    Case("tokenizer-not-json", "tokenizer.json: not a valid tokenizer file", checkpoint=_write("tokenizer.json", "{oops")),
    Case("tokenizer-past-vocab", "the tokenizer has 320 tokens (ids 0..319, added tokens included) but config.json "
         "vocab_size is 256", checkpoint=_config(vocab_size=256)),
    Case("seq-len-past-positions", "runtime.max_seq_len 1024 exceeds the model's max_position_embeddings 512",
         args=("--set", "runtime.max_seq_len=1024")),
    Case("plan-does-not-fit", "nothing was built (target.fail_if_not_fit is true)",
         recipe="target:\n  gpu_memory: 1MiB\n  fail_if_not_fit: true\n"),
    # (smoothquant fits its scales on calibration text; int8 weight-only reads none)
    Case("calibration-file-missing", "calibration.dataset: data file",
         recipe=Q + "smoothquant\ncalibration:\n  dataset: {tmp}/none.txt\n"),
    Case("calibration-file-too-short", "samples of 256 tokens need 16384",
         recipe=Q + "smoothquant\ncalibration:\n  dataset: {tmp}/short.txt\n",
         checkpoint=lambda c: (c.parent / "short.txt").write_text("tiny")),
    Case("calibration-wrong-suffix", "unsupported data file type '.csv'",
         recipe=Q + "smoothquant\ncalibration:\n  dataset: {tmp}/data.csv\n",
         checkpoint=lambda c: (c.parent / "data.csv").write_text("a,b\n")),
    Case("eval-file-missing", "gates.eval_dataset: data file", recipe=Q + "int8_wo\ngates:\n  eval_dataset: {tmp}/none.txt\n"),
    # another model's quantization is fitted and gated on text the recipe names (or says 'bundled' on purpose)
    Case("calibration-text-unset", "calibration.dataset is not set and", recipe=Q + "smoothquant\n"),
    Case("eval-text-unset", "gates.eval_dataset is not set and", recipe=Q + "int8_wo\n"),
    # found on the traced graph, before weights are read
    Case("dynamic-rope", "rope_type 'dynamic' (config.json rope_parameters / rope_scaling) is not supported",
         checkpoint=_config(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})),
    Case("targets-match-nothing", "quantization (algo fp8) selects no linear: targets ['re:attn\\.qproj']",
         recipe=Q + "fp8\n  targets: ['re:attn\\.qproj']\n"),
    Case("group-size-not-dividing", "not divisible by group_size 48", recipe=Q + "gptq\n  group_size: 48\n"),
    Case("group-size-names-the-key", "as the quantization section's group_size", recipe=Q + "gptq\n  group_size: 48\n"),
    Case("tp-size-not-dividing-heads", "tp_size 3 does not divide num_attention_heads 4",
         args=("--set", "parallel.tp_size=3")),
    # found when the weights are read
    Case("tensor-missing", "weight 'model.layers.1.mlp.up_proj.weight' (or an alias of it) is missing",
         checkpoint=_tensors(lambda t: t.pop("model.layers.1.mlp.up_proj.weight")), before_weights=False),
    Case("tensor-wrong-shape", "tensor 'model.norm.weight' has shape (32,), config.json implies (64,)",
         checkpoint=_tensors(lambda t: t.update({"model.norm.weight": t["model.norm.weight"][:32].clone()})),
         before_weights=False),
    Case("tensor-nothing-reads", "1 checkpoint tensor is read by no weight of the llama model: "
         "model.layers.0.self_attn.q_proj.weight_scale",
         checkpoint=_tensors(lambda t: t.update({"model.layers.0.self_attn.q_proj.weight_scale":
                                                 t["model.norm.weight"][:1].clone()})), before_weights=False),
    Case("float8-weights", "is stored as float8_e4m3fn where a floating-point weight is expected",
         checkpoint=_tensors(_fp8_weights), before_weights=False),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_malformed_input_fails_cleanly(case, tmp_path, base_checkpoint, monkeypatch):
    checkpoint = base_checkpoint
    if case.checkpoint is not None:
        checkpoint = shutil.copytree(base_checkpoint, tmp_path / "ckpt")
        case.checkpoint(checkpoint)
    recipe = _recipe(tmp_path, checkpoint, case.recipe.replace("{tmp}", str(tmp_path)))
    if case.recipe_file is not None:
        case.recipe_file(recipe)
    if case.before_weights:
        _forbid_expensive_steps(monkeypatch)
    assert case.expect in _build_error(recipe, *case.args)


def test_the_sweep_is_wide():
    assert len(CASES) >= 50 and len({c.id for c in CASES}) == len(CASES)
