"""Artifact integrity: a modified, truncated or re-versioned artifact is refused with a clear error; files
added to an artifact are never read."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save

from runtime import ArtifactError, Engine, SamplingParams
from runtime.artifact import MANIFEST, manifest_digest
from runtime.tokenizer import Tokenizer


@pytest.fixture
def artifact_copy(artifacts, tmp_path):
    dst = tmp_path / "a"
    shutil.copytree(artifacts["llama"], dst)
    return dst


def test_manifest_contents(artifacts):
    m = json.loads((artifacts["qwen3"] / MANIFEST).read_text())
    assert m["format_version"] == 1 and m["versions"]["torch"]
    assert len(m["recipe_sha256"]) == 64 and m["recipe"]["model"]["dtype"] == "float32"
    assert set(m["files"]) >= {"graph.json", "weights.safetensors", "tokenizer/tokenizer.json", "report.md",
                               "report.html"}
    assert all(len(f["sha256"]) == 64 for f in m["files"].values())
    assert m["source"]["files"]["model.safetensors"] and m["source"]["config"]["model_type"] == "qwen3"
    assert m["model"]["num_layers"] == 2 and m["model"]["head_dim"] == 24
    assert m["build"]["verify"]["max_abs_logit_err"] < 1e-4
    assert [p["name"] for p in m["build"]["passes"]][-1] == "verify"


def test_loads_clean(artifact_copy):
    Engine.load(artifact_copy)


def test_modified_weight_file_refused(artifact_copy):
    f = artifact_copy / "weights.safetensors"
    data = bytearray(f.read_bytes())
    data[-10] ^= 0xFF  # same size, one byte flipped
    f.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="weights.safetensors was modified after the build"):
        Engine.load(artifact_copy)


def test_truncated_weight_file_refused(artifact_copy):
    f = artifact_copy / "weights.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ArtifactError, match="truncated"):
        Engine.load(artifact_copy)


def test_modified_manifest_refused(artifact_copy):
    f = artifact_copy / MANIFEST
    m = json.loads(f.read_text())
    m["runtime"]["max_seq_len"] = 100000
    f.write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="manifest.json was modified after the build"):
        Engine.load(artifact_copy)


def test_other_format_version_refused(artifact_copy):
    f = artifact_copy / MANIFEST
    m = json.loads(f.read_text())
    m["format_version"] = 99
    m["manifest_sha256"] = manifest_digest(m)
    f.write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="format version 99 is not supported"):
        Engine.load(artifact_copy)


def test_missing_file_and_not_an_artifact(artifact_copy, tmp_path):
    (artifact_copy / "graph.json").unlink()
    with pytest.raises(ArtifactError, match="graph.json is missing"):
        Engine.load(artifact_copy)
    with pytest.raises(ArtifactError, match="has no manifest.json"):
        Engine.load(tmp_path)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / MANIFEST).write_text("{not json")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        Engine.load(tmp_path / "bad")


def test_listed_files_reached_through_symbolic_links_are_refused(artifact_copy, tmp_path):
    """A listed file, or a directory on its way, that is a link to elsewhere is refused before anything is read (its
    hash could be made to match any file of the host); the artifact directory itself may be a link."""
    outside = tmp_path / "outside"
    shutil.copytree(artifact_copy / "tokenizer", outside)
    shutil.rmtree(artifact_copy / "tokenizer")
    (artifact_copy / "tokenizer").symlink_to(outside)
    with pytest.raises(ArtifactError, match=r"tokenizer is a symbolic link \(to .*outside\); an artifact's files are "
                                            r"its own"):
        Engine.load(artifact_copy)
    (artifact_copy / "tokenizer").unlink()
    shutil.copytree(outside, artifact_copy / "tokenizer")
    (tmp_path / "graph.json").write_bytes((artifact_copy / "graph.json").read_bytes())
    (artifact_copy / "graph.json").unlink()
    (artifact_copy / "graph.json").symlink_to(tmp_path / "graph.json")
    with pytest.raises(ArtifactError, match=r"graph\.json is a symbolic link"):
        Engine.load(artifact_copy)
    (artifact_copy / "graph.json").unlink()
    shutil.copy(tmp_path / "graph.json", artifact_copy / "graph.json")
    (tmp_path / "latest").symlink_to(artifact_copy)
    Engine.load(tmp_path / "latest").close()


def test_json_that_parses_to_nothing_usable_and_a_tensor_in_two_weight_files_are_refused(artifact_copy):
    """graph.json nested past Python's recursion limit or holding an integer of 5,000 digits (ValueError and
    RecursionError, not JSONDecodeError), and a second weight file repeating a tensor (the last file read would
    win), each a one-line ArtifactError naming the file."""
    graph = (artifact_copy / "graph.json").read_text()
    for text in ("[" * 100_000 + "]" * 100_000, '{"x": ' + "9" * 5000 + "}"):
        _rewrite(artifact_copy, "graph.json", text)
        with pytest.raises(ArtifactError, match=r"graph\.json is not valid JSON \((RecursionError|ValueError)"):
            Engine.load(artifact_copy)
    _rewrite(artifact_copy, "graph.json", graph)
    import hashlib

    weights = load_file(artifact_copy / "weights.safetensors")
    name = sorted(weights)[0]
    data = save({name: weights[name] * 0})  # listed and hashed: a second weight file with the tensor zeroed
    (artifact_copy / "weights-extra.safetensors").write_bytes(data)
    m = json.loads((artifact_copy / MANIFEST).read_text())
    m["files"]["weights-extra.safetensors"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    m["weights"]["files"].append("weights-extra.safetensors")
    m["manifest_sha256"] = manifest_digest(m)
    (artifact_copy / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match=rf"tensor '{name}' is in both weights\.safetensors and "
                                            rf"weights-extra\.safetensors"):
        Engine.load(artifact_copy)


def _scaled_weights(path):
    """The artifact's weights times 3: read in place of (or over) the real ones, they change every token."""
    return save({k: v * 3 for k, v in load_file(path / "weights.safetensors").items()})


EVIL_TEMPLATE = "{% for m in messages %}<|assistant|>{{ m['content'] | upper }}{% endfor %}"
# files the tokenizer or the weight loader could read, with contents that change the output if read
PLANTED = {
    "tokenizer/chat_template.jinja": lambda path: EVIL_TEMPLATE,
    "tokenizer/tokenizer_config.json": lambda path: json.dumps({
        "chat_template": EVIL_TEMPLATE, "eos_token": "<|end|>", "bos_token": "<|user|>", "add_bos_token": True}),
    "tokenizer/special_tokens_map.json": lambda path: json.dumps({"eos_token": "<|end|>", "sep_token": "<|user|>"}),
    "tokenizer/generation_config.json": lambda path: json.dumps({"eos_token_id": [3, 4]}),
    "tokenizer/added_tokens.json": lambda path: json.dumps({"<|evil|>": 320}),
    "weights-rank1.safetensors": _scaled_weights,
    "weights-rank0.safetensors": _scaled_weights,
    "model.safetensors": _scaled_weights,
}


def _unlist(path, rel):
    """Take ``rel`` out of the artifact (file and manifest entry), as a build without it would have."""
    (path / rel).unlink()
    m = json.loads((path / MANIFEST).read_text())
    del m["files"][rel]
    m["manifest_sha256"] = manifest_digest(m)
    (path / MANIFEST).write_text(json.dumps(m))


def _observe(path):
    """What the artifact's files decide: chat prompt ids, greedy tokens, special and EOS ids."""
    engine = Engine.load(path)
    tok = engine.tokenizer
    chat = engine.chat([{"role": "user", "content": "def f(n):"}], SamplingParams(max_tokens=6, ignore_eos=True)) \
        if tok.chat_template is not None else None
    greedy = engine.generate("def fibonacci(n):", SamplingParams(max_tokens=6, ignore_eos=True))
    return {"chat_prompt": chat and chat.prompt_token_ids, "chat_tokens": chat and chat.token_ids,
            "prompt": greedy.prompt_token_ids, "tokens": greedy.token_ids, "eos": tok.eos_token_ids,
            "bos": tok.bos_token_id, "special": tok.special_tokens}


@pytest.mark.parametrize("rel", PLANTED)
def test_unlisted_files_do_not_change_the_output(artifact_copy, rel):
    """A file the manifest does not list is never read, whatever its name; listed ones are unlisted first."""
    if (artifact_copy / rel).exists():
        _unlist(artifact_copy, rel)
    before = _observe(artifact_copy)
    content = PLANTED[rel](artifact_copy)
    (artifact_copy / rel).write_bytes(content if isinstance(content, bytes) else content.encode())
    assert _observe(artifact_copy) == before
    if rel.startswith("tokenizer/") and rel != "tokenizer/added_tokens.json":  # read, it would change the output
        probed = Tokenizer.from_dir(artifact_copy / "tokenizer")
        assert (probed.chat_template, probed.eos_token_ids, probed.special_tokens) != (
            Engine.load(artifact_copy).tokenizer.chat_template, before["eos"], before["special"])


def _rewrite(path, rel, text: str, graph: dict | None = None) -> None:
    """Replace a listed file and re-hash it in the manifest (with the summary of ``graph`` when given): an artifact
    a newer (or broken) toolchain wrote, consistent in itself."""
    import collections
    import hashlib

    (path / rel).write_text(text)
    m = json.loads((path / MANIFEST).read_text())
    data = (path / rel).read_bytes()
    m["files"][rel] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if graph is not None:
        m["graph"].update(ir_version=graph["ir_version"], num_nodes=len(graph["nodes"]),
                          ops=dict(collections.Counter(str(n.get("op")) for n in graph["nodes"])))
    m["manifest_sha256"] = manifest_digest(m)
    (path / MANIFEST).write_text(json.dumps(m))


def _attention(g, i=1):
    return [n for n in g["nodes"] if n["op"] == "attention"][i]


@pytest.mark.parametrize("change, says", [
    (lambda g: g.update(ir_version=g["ir_version"] + 1), "IR version"),  # a graph a newer toolchain wrote
    (lambda g: g["nodes"][1].update(op="frobnicate"), "frobnicate"),
    (lambda g: g["nodes"].pop(1), "which no earlier node writes"),  # a node missing: its readers cannot run
    # consistent with their hashes, these ran (and some computed garbage silently, exit 0) or raised tracebacks
    (lambda g: _attention(g)["attrs"].update(layer=0), r"layer attrs are \[0, 0\]; expected 0\.\.1, each once"),
    (lambda g: _attention(g)["attrs"].update(sliding_window=-5), r"attr sliding_window is -5; expected a whole"),
    (lambda g: next(n for n in g["nodes"] if n["op"] == "rope")["attrs"].update(num_heads=10 ** 9),
     r"attr num_heads is 1000000000; expected a whole number in 1\.\.16777216"),
    (lambda g: next(n for n in g["nodes"] if "eps" in n.get("attrs", {}))["attrs"].update(eps=float("inf")),
     r"attr eps is inf; expected a finite number > 0"),
    # a softmax scale <= 0 (the prefill kernel folds it into the exponent: NaN; else inverted or flat attention)
    (lambda g: _attention(g)["attrs"].update(scale=0.0),
     r"attention.*attr scale is 0\.0; expected a finite number > 0"),
    (lambda g: _attention(g)["attrs"].update(scale=-0.125), r"attr scale is -0\.125; expected a finite number > 0"),
    (lambda g: next(n for n in g["nodes"] if n["op"] == "lm_head").update(
        weights={"weight": next(n for n in g["nodes"] if n["op"] == "linear")["weights"]["weight"]}),
     r"lm_head, .*its weight is \[\d+, \d+\]; the graph gives \[\d+, \d+\]"),
    (lambda g: g["nodes"][1].pop("op"), r"node 1 is not an object with a string op"),
    (lambda g: g["nodes"][1].update(outputs=[]), r"outputs must be a list of value names \(at least one\)"),
    (lambda g: g["nodes"][1].update(weights={"weight": "no.such.weight"}), r"reads weight 'no\.such\.weight', which"),
    # the output a hidden state (the final norm's), not the logits: loaded, then failed the first request's sampling
    (lambda g: g.update(outputs=[next(n for n in g["nodes"] if n["op"] == "lm_head")["inputs"][0]]),
     r"the graph's output '[^']+' is written by node \d+ \(fused_add_rms_norm, from model\.norm\), not by the "
     r"lm_head; the engines sample its rows as logits \[tokens, vocab_size\]"),
    (lambda g: g.update(outputs=["positions"]),
     r"the graph's output 'positions' is one of its inputs, not the lm_head"),
    (lambda g: next(n for n in g["nodes"] if n["op"] == "lm_head").update(op="linear"),
     r"is written by node \d+ \(linear, .*not by the lm_head"),
])
def test_a_graph_this_runtime_cannot_run_is_an_artifact_error(artifact_copy, change, says):
    graph = json.loads((artifact_copy / "graph.json").read_text())
    change(graph)
    _rewrite(artifact_copy, "graph.json", json.dumps(graph), graph)
    with pytest.raises(ArtifactError, match=f"cannot run the artifact's graph.*{says}"):
        Engine.load(artifact_copy)


def test_a_chat_template_that_does_not_compile_stops_the_engine_load(artifact_copy):
    """An artifact whose (listed, re-hashed) chat template has a Jinja syntax error is refused at load, naming the
    file and the error's line; it loaded before and failed each chat request."""
    from runtime.tokenizer import TokenizerError

    _rewrite(artifact_copy, "tokenizer/chat_template.jinja", "{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
    with pytest.raises(TokenizerError, match=r"tokenizer/chat_template\.jinja: the chat template does not compile "
                                             r"\(Jinja error at line 2: unexpected '}'"):
        Engine.load(artifact_copy)


@pytest.mark.parametrize("value, key", [(10**12, "eos_token_id"), (-1, "eos_token_id"), ("vocab", "eos_token_id"),
                                        (["vocab", -1], r"eos_token_id\[0\]")])
def test_eos_ids_outside_the_model_vocabulary_stop_the_engine_load(artifact_copy, value, key):
    """An artifact whose (listed, re-hashed) generation_config.json names EOS ids past the model's vocab_size, or
    negative ones, and no other, is refused at load, naming the file, the field and the range; it loaded, and never
    stopped."""
    from runtime.tokenizer import TokenizerError

    vocab = json.loads((artifact_copy / MANIFEST).read_text())["model"]["vocab_size"]
    value = [vocab if v == "vocab" else v for v in value] if isinstance(value, list) else \
        vocab if value == "vocab" else value
    bad = value[0] if isinstance(value, list) else value
    _rewrite(artifact_copy, "tokenizer/generation_config.json", json.dumps({"eos_token_id": value}))
    with pytest.raises(TokenizerError, match=rf"tokenizer/generation_config\.json: {key} is {bad}; allowed: token ids "
                                             rf"0\.\.{vocab - 1} \(the model's vocab_size\)"):
        Engine.load(artifact_copy)


@pytest.fixture(scope="module")
def int8_wo_artifact(checkpoints, tmp_path_factory):
    """The tiny Llama with int8 weight-only linears (w8a16, one group a row: scales and zeros [out, 1])."""
    from builder.pipeline import build
    from builder.recipe import validate_recipe

    out = tmp_path_factory.mktemp("int8_wo") / "a"
    return build(validate_recipe({
        "name": "a", "model": {"checkpoint": str(checkpoints["llama"]), "dtype": "float32"}, "output_dir": str(out),
        "runtime": {"max_seq_len": 128, "max_num_tokens": 32}, "quantization": {"algo": "int8_wo"},
        "gates": {"enabled": False}})).output_dir


@pytest.mark.parametrize("quant, says", [
    ({"group_size": 16}, r"its scales are \[128, 1\] \(scales \[128, 1\], zeros \[128, 1\]\); quant bits 8 and "
                         r"group_size 16 over qweight \[128, 64\] \(64 input features\) give \[128, 4\]"),
    ({"group_size": 48}, r"quant group_size 48 does not divide its 64 input features \(qweight \[128, 64\]"),
    ({"bits": 4}, r"quant bits is 4; a w8a16 linear stores 8-bit codes \(allowed: 8\)"),
])
def test_weight_only_quant_attrs_that_disagree_with_the_stored_tensors_are_named(int8_wo_artifact, tmp_path, quant,
                                                                                  says):
    """A (re-hashed) graph.json whose weight-only linear's bits or group_size disagree with its scales and zeros: a
    load-time error naming the node, the attr and the shapes, where it met only the engine's catch-all before."""
    path = shutil.copytree(int8_wo_artifact, tmp_path / "a")
    graph = json.loads((path / "graph.json").read_text())
    node = next(n for n in graph["nodes"] if n["op"] == "linear")  # layer 0's merged q, k, v: [128, 64]
    node["attrs"]["quant"].update(quant)
    _rewrite(path, "graph.json", json.dumps(graph), graph)
    with pytest.raises(ArtifactError, match=rf"cannot run the artifact's graph: node \d+ \(linear, from "
                                            rf"model\.layers\.0\.self_attn\): {says}"):
        Engine.load(path)


def test_prompts_the_model_cannot_read_are_request_errors(artifacts):
    from runtime import RequestError
    from runtime.tokenizer import TokenizerError

    engine = Engine.load(artifacts["llama"])
    vocab = engine.executor.graph["meta"]["vocab_size"]
    for ids in ([vocab], [-1], [1, 10**9]):
        with pytest.raises(RequestError, match=rf"must be in \[0, {vocab}\)"):
            engine.generate(ids, SamplingParams(max_tokens=2))
    with pytest.raises(TokenizerError, match="lone surrogate at character 3"):
        engine.generate("caf\udce9", SamplingParams(max_tokens=2))  # a byte that was not UTF-8, as argv keeps it


@pytest.fixture(scope="module")
def fp8_artifact(checkpoints, tmp_path_factory):
    """The tiny Llama with FP8 linears: one e4m3 scale per tensor, static activations (an input_scale [1] each)."""
    from builder.pipeline import build
    from builder.recipe import validate_recipe

    out = tmp_path_factory.mktemp("fp8") / "a"
    return build(validate_recipe({
        "name": "a", "model": {"checkpoint": str(checkpoints["llama"]), "dtype": "float32"}, "output_dir": str(out),
        "runtime": {"max_seq_len": 128, "max_num_tokens": 32},
        "quantization": {"algo": "fp8", "activations": "static", "weight_granularity": "tensor"},
        "calibration": {"num_samples": 4, "seq_len": 32, "dataset": "bundled"},
        "gates": {"enabled": False}})).output_dir


def _fp8_tamper(graph: dict, quant: dict | None = None, drop: str | None = None) -> None:
    node = next(n for n in graph["nodes"] if n["op"] == "linear")  # layer 0's merged q, k, v: [128, 64]
    node["attrs"]["quant"].update(quant or {})
    if drop:
        node["weights"].pop(drop)


@pytest.mark.parametrize("change, says", [
    # one scale for the merged q, k, v, read as one per output row: a broadcast of [1] (every row the same scale)
    ({"quant": {"weight_granularity": "channel"}},
     r"its weight_scale is \[1\]; quant scheme fp8 with quant weight_granularity channel scales weights per "
     r"output channel: over qweight \[128, 64\], \[128\]"),
    ({"quant": {"activations": "dynamic"}},
     r"quant activations is 'dynamic' but it has an input_scale \[1\]; dynamic activations take none"),
    ({"drop": "input_scale"}, r"quant activations is 'static' but it has no input_scale"),
    ({"quant": {"scheme": "fp8_block", "block_size": [64, 64]}},
     r"quant activations is 'static'; quant scheme fp8_block quantizes its activations per token and block "
     r"\(allowed: dynamic\)"),
    ({"quant": {"scheme": "fp8_block", "block_size": [64, 64], "activations": "dynamic"}, "drop": "input_scale"},
     r"its weight_scale is \[1\]; quant block_size \[64, 64\] over qweight \[128, 64\] gives \[2, 1\]"),
])
def test_w8a8_quant_attrs_that_disagree_with_the_stored_tensors_are_named(fp8_artifact, tmp_path, change, says):
    """A (re-hashed) graph.json whose FP8 linear's weight granularity, activations or scheme disagree with its stored
    scales: a load-time error naming the node, the attr and the shapes. Before, three loaded and ran other than their
    attrs say (one scale declared per channel, an input_scale beside dynamic activations, a static linear without
    its input_scale quantized per token), and block scales of the wrong shape met the engine's catch-all."""
    path = shutil.copytree(fp8_artifact, tmp_path / "a")
    graph = json.loads((path / "graph.json").read_text())
    _fp8_tamper(graph, **change)
    _rewrite(path, "graph.json", json.dumps(graph), graph)
    with pytest.raises(ArtifactError, match=rf"cannot run the artifact's graph: node \d+ \(linear, from "
                                            rf"model\.layers\.0\.self_attn\): {says}"):
        Engine.load(path)
