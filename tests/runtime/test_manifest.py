"""A tampered artifact is refused with one ArtifactError naming what is wrong: manifest values edited and
re-hashed (so the self-hash matches), listed files flipped, truncated or deleted; files added to it are
ignored."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from builder.pipeline import build
from builder.recipe import validate_recipe
from conftest import build_artifact, make_checkpoint
from runtime import ArtifactError, Engine
from runtime.artifact import MANIFEST, file_sha256, manifest_digest, open_artifact


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[int, Path]:
    """tp_size -> an artifact of one tiny Llama (2 layers, 4 heads, 2 kv heads, 512 positions)."""
    root = tmp_path_factory.mktemp("manifest")
    ckpt = make_checkpoint(root / "ckpt", "llama")
    tp2 = validate_recipe({
        "name": "tp2", "model": {"checkpoint": str(ckpt), "dtype": "float32"}, "output_dir": str(root / "tp2"),
        "passes": ["merge_qkv", "merge_gate_up", "dce"], "runtime": {"max_seq_len": 128, "max_num_tokens": 32},
        "parallel": {"tp_size": 2}})
    return {1: build_artifact(ckpt, root / "tp1"), 2: build(tp2).output_dir}


def _copy(src: Path, tmp_path: Path, name: str = "a") -> Path:
    return Path(shutil.copytree(src, tmp_path / name))


def _rehash(path: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    """Edit the manifest and record its new self-hash, as a careful tamperer would."""
    m = json.loads((path / MANIFEST).read_text())
    edit(m)
    m["manifest_sha256"] = manifest_digest(m)
    (path / MANIFEST).write_text(json.dumps(m))


def _relist(path: Path, rel: str) -> None:
    """Record a rewritten file's new size and hash in the (re-hashed) manifest."""
    info = {"bytes": (path / rel).stat().st_size, "sha256": file_sha256(path / rel)}
    _rehash(path, lambda m: m["files"].__setitem__(rel, info))


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(m: dict[str, Any]) -> None:
        *parents, last = key.split(".")
        for p in parents:
            m = m[int(p)] if isinstance(m, list) else m[p]
        if value is DELETE:
            del m[last]
        else:
            m[last] = value
    return edit


class _Delete:
    def __repr__(self) -> str:
        return "DELETE"


DELETE = _Delete()  # _set's value that removes the key


def _refused(path: Path, needle: str, load: Callable[[Path], Any] = Engine.load) -> str:
    with pytest.raises(ArtifactError) as info:  # any other exception type fails the test
        load(path)
    message = str(info.value)
    assert "\n" not in message and needle in message, message
    return message


# (manifest key, new value, what the error must name); the self-hash is recomputed after each edit
EDITS = [
    ("runtime.tokens_per_block", 0, "runtime.tokens_per_block is 0; allowed: a power of two"),
    ("runtime.tokens_per_block", 12, "runtime.tokens_per_block is 12"),
    ("runtime.tokens_per_block", "16", "runtime.tokens_per_block is '16'"),
    ("runtime.max_seq_len", 100000, "runtime.max_seq_len is 100000; allowed: at most the model's "
                                    "max_position_embeddings (512)"),
    ("runtime.max_seq_len", 1, "runtime.max_seq_len is 1; allowed: an integer >= 2"),
    ("runtime.max_batch_size", 0, "runtime.max_batch_size is 0; allowed: an integer >= 1"),
    ("runtime.max_batch_size", True, "runtime.max_batch_size is True"),
    ("runtime.max_num_tokens", -1, "runtime.max_num_tokens is -1"),
    ("runtime.max_num_tokens", 1.5, "runtime.max_num_tokens is 1.5"),
    ("runtime.kv_cache_dtype", "fp4", "runtime.kv_cache_dtype is 'fp4'; allowed: one of auto, fp8, int8"),
    ("runtime.kv_cache_dtype", "fp8", "quantization.kv_cache_dtype is 'auto'"),
    ("runtime.fp8_accumulation", "sloppy", "runtime.fp8_accumulation is 'sloppy'; allowed: one of promoted, fast"),
    ("runtime", DELETE, "runtime is missing; allowed: a JSON object"),
    ("runtime", [], "runtime is []"),
    ("files", DELETE, "files is missing"),
    ("files", {}, "files does not list 'graph.json'"),
    ("files.tokenizer/tokenizer.json", DELETE, "files does not list 'tokenizer/tokenizer.json'"),
    ("files.graph.json", "x", "files['graph.json'] is 'x'"),
    ("files.graph.json.sha256", "zz", "files['graph.json'].sha256 is 'zz'; allowed: 64 lowercase hex digits"),
    ("files.graph.json.bytes", -1, "files['graph.json'].bytes is -1"),
    ("files.../outside.txt", {"bytes": 0, "sha256": "0" * 64}, "files is '../outside.txt'"),
    ("model.head_dim", "x", "model.head_dim is 'x'; allowed: an integer >= 1"),
    ("model.head_dim", 32, "model.head_dim is 32; allowed: graph.json's 16"),
    ("model.hidden_size", 0, "model.hidden_size is 0"),
    ("model.vocab_size", 321, "model.vocab_size is 321; allowed: graph.json's 320"),
    ("model.num_layers", 3, "model.kv_layers has 2 entries"),
    ("model.num_attention_heads", 8, "model.num_attention_heads is 8"),
    ("model.max_position_embeddings", 100000, "model.max_position_embeddings is 100000; allowed: graph.json's 512"),
    ("model.kv_layers.0.head_dim", 0, "model.kv_layers[0].head_dim is 0"),
    ("model.kv_layers.1.num_kv_heads", 4, "model.kv_layers is"),
    ("model.dtype", "float64", "model.dtype is 'float64'; allowed: one of float32, bfloat16, float16"),
    ("model.dtype", "bfloat16", "model.dtype is 'bfloat16'; allowed: graph.json's 'float32'"),
    ("graph.file", "nope.json", "files does not list 'nope.json' (graph.file)"),
    ("graph.ir_version", 2, "graph.ir_version is 2; allowed: graph.json's 1"),
    ("graph.num_nodes", 3, "graph.num_nodes is 3"),
    ("weights.files", [], "weights.files is []; allowed: at least one weight file"),
    ("weights.files", ["weights.safetensors", "weights.safetensors"], "allowed: each file once"),
    ("weights.files", ["weights-rank1.safetensors"], "files does not list 'weights-rank1.safetensors'"),
    ("weights.files", ["graph.json"], "cannot read its safetensors header"),
    ("weights.files", "weights.safetensors", "weights.files is 'weights.safetensors'; allowed: a JSON array"),
    ("weights.ranks", [], "weights.ranks has 0 entries; allowed: none when tensor_parallel.tp_size is 1"),
    ("tensor_parallel.tp_size", 2, "weights.ranks has 0 entries; allowed: one per rank"),
    ("tensor_parallel.tp_size", 0, "tensor_parallel.tp_size is 0"),
    ("tensor_parallel.vocab_parallel", True, "tensor_parallel is"),
    ("name", "", "name is ''; allowed: a non-empty string"),
    ("quantization.gates", {"passed": "no"}, "quantization.gates.passed is 'no'; allowed: true or false"),
    ("quantization.gates", "failed", "quantization.gates is 'failed'"),
    ("build.duration_s", "slow", "build.duration_s is 'slow'"),
    ("build.passes", [{"name": 3}], "build.passes[0].name is 3"),
    ("reports.html", None, "reports.html is None"),
]


@pytest.mark.parametrize("key,value,needle", EDITS, ids=[f"{k}={v!r}"[:60] for k, v, _ in EDITS])
def test_edited_manifest_is_refused(built, tmp_path, key, value, needle):
    path = _copy(built[1], tmp_path)
    if key.startswith("files."):  # file names hold dots: the key is files.<name>[.field]
        name = key.removeprefix("files.")
        field = next((f for f in (".sha256", ".bytes") if name.endswith(f)), "")
        name = name.removesuffix(field)

        def edit(m):
            if value is DELETE:
                del m["files"][name]
            elif field:
                m["files"][name][field[1:]] = value
            else:
                m["files"][name] = value
        _rehash(path, edit)
    else:
        _rehash(path, _set(key, value))
    message = _refused(path, needle)
    assert str(path) in message and "rebuild" in message


TP_EDITS = [
    ("tensor_parallel.tp_size", 1, "weights.ranks has 2 entries; allowed: none when tensor_parallel.tp_size is 1"),
    ("tensor_parallel.tp_size", 3, "weights.ranks has 2 entries; allowed: one per rank"),
    ("weights.ranks.1.rank", 0, "weights.ranks[1].rank is 0; allowed: 1"),
    ("weights.ranks.1.file", "weights-rank0.safetensors", "weights.files is"),
    ("weights.files", ["weights-rank1.safetensors", "weights-rank0.safetensors"], "weights.files is"),
    ("tensor_parallel.num_kv_heads_per_rank", 2, "tensor_parallel is"),
]


@pytest.mark.parametrize("key,value,needle", TP_EDITS, ids=[f"{k}={v!r}"[:60] for k, v, _ in TP_EDITS])
def test_edited_tensor_parallel_manifest_is_refused(built, tmp_path, key, value, needle):
    path = _copy(built[2], tmp_path)
    _rehash(path, _set(key, value))
    _refused(path, needle, lambda p: open_artifact(p, rank=0))


def _drop_tensor(path: Path) -> None:
    tensors = load_file(path / "weights.safetensors")
    tensors.pop("model.norm.weight")
    save_file(tensors, path / "weights.safetensors")


def _reshape_tensor(path: Path) -> None:
    tensors = load_file(path / "weights.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1]
    save_file(tensors, path / "weights.safetensors")


def _retype_tensor(path: Path) -> None:
    tensors = load_file(path / "weights.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.float16)
    save_file(tensors, path / "weights.safetensors")


def _graph_edit(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def rewrite(path: Path) -> None:
        graph = json.loads((path / "graph.json").read_text())
        change(graph)
        (path / "graph.json").write_text(json.dumps(graph))
    return rewrite


def _attention(graph: dict[str, Any]) -> dict[str, Any]:
    return next(n for n in graph["nodes"] if n["op"] == "attention")["attrs"]


def _embedding(graph: dict[str, Any]) -> str:
    return next(n for n in graph["nodes"] if n["op"] == "embedding")["weights"]["weight"]


# a listed file rewritten and re-listed with its new hash: it must still agree with the rest
REWRITES = [
    ("weights.safetensors", _drop_tensor, "lacks tensors graph.json names: model.norm.weight"),
    ("weights.safetensors", _reshape_tensor, "tensor 'model.norm.weight' is F32 [63]; graph.json records float32 [64]"),
    ("weights.safetensors", _retype_tensor, "tensor 'model.norm.weight' is F16 [64]"),
    ("graph.json", _graph_edit(lambda g: _attention(g).update(num_kv_heads=4)),
     "model.kv_layers[0].num_kv_heads (2) disagrees with graph.json's attention layer 0 (num_kv_heads 4)"),
    ("graph.json", _graph_edit(lambda g: _attention(g).update(kv_cache_dtype="fp8")),
     "runtime.kv_cache_dtype is 'auto'; allowed: graph.json's attention layer 0 KV cache dtype ('fp8')"),
    ("graph.json", _graph_edit(lambda g: g["meta"].update(hidden_size=96)), "model.hidden_size is 64"),
    ("graph.json", _graph_edit(lambda g: g["params"][_embedding(g)].update(shape=[300, 64])),
     "disagree with the embedding table's shape [300, 64]"),
    ("graph.json", _graph_edit(lambda g: g.update(nodes=g["nodes"][:-1])), "graph.num_nodes is"),
    ("graph.json", _graph_edit(lambda g: g.pop("params")), "graph.json params is missing"),
]


@pytest.mark.parametrize("rel,rewrite,needle", REWRITES, ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(REWRITES)])
def test_rewritten_and_relisted_file_is_refused(built, tmp_path, rel, rewrite, needle):
    path = _copy(built[1], tmp_path)
    rewrite(path)
    _relist(path, rel)
    _refused(path, needle)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_every_listed_file_flipped_truncated_or_deleted_is_refused(built, tmp_path, tp_size):
    files = json.loads((built[tp_size] / MANIFEST).read_text())["files"]
    assert {"graph.json", "tokenizer/tokenizer.json", "report.html"} <= set(files)
    damages = {"flipped": (lambda f: f.write_bytes(_flip(f.read_bytes())), "was modified after the build"),
               "truncated": (lambda f: f.write_bytes(f.read_bytes()[:-1]), "is truncated or modified"),
               "deleted": (lambda f: f.unlink(), "is missing (listed in the manifest)")}
    manifest_needles = {"flipped": MANIFEST, "truncated": "not valid JSON", "deleted": "has no manifest.json"}
    for rel in [*files, MANIFEST]:
        for how, (damage, needle) in damages.items():
            path = _copy(built[tp_size], tmp_path, f"{how}-{rel.replace('/', '_')}")
            damage(path / rel)
            _refused(path, manifest_needles[how] if rel == MANIFEST else needle, open_artifact)


def _flip(data: bytes) -> bytes:
    i = len(data) // 2
    return data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:]


@pytest.mark.parametrize("rel", ["tokenizer/chat_template.jinja", "tokenizer/special_tokens_map.json",
                                 "tokenizer/added_tokens.json", "weights-rank1.safetensors", "extra.safetensors",
                                 "graph.json.bak", "notes/readme.txt"])
def test_added_files_are_ignored(built, tmp_path, rel):
    path = _copy(built[1], tmp_path)
    (path / rel).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(path / "weights.safetensors" if rel.endswith(".safetensors") else path / "graph.json", path / rel)
    artifact = open_artifact(path)
    assert artifact.file(rel) is None and not artifact.has(rel)
    assert artifact.file("graph.json") == path / "graph.json"
    Engine.load(path)


def test_inspect_and_serve_exit_1_with_the_message(built, tmp_path):
    from builder.cli import app

    path = _copy(built[1], tmp_path)
    _rehash(path, _set("runtime.tokens_per_block", 0))
    runner = CliRunner()
    for args in (["inspect", str(path)], ["serve", str(path), "--device", "cpu"]):
        res = runner.invoke(app, args)
        assert res.exit_code == 1, (args, res.output)
        assert isinstance(res.exception, SystemExit) and "Traceback" not in res.output
        assert "runtime.tokens_per_block is 0; allowed: a power of two" in res.output, res.output


def test_moe_experts_carry_exactly_their_schemes_scales():
    """A moe node's experts are unquantized (no scale roles), fp8 with both scales, or w4a16 with both projections'
    group scales and zero points (and its group_size); anything else in graph.json (a scheme the runtime does not run
    for experts, scales without the scheme, the scheme without scales, another scheme's scales) is refused, naming
    the node."""
    from runtime.manifest import ManifestError, _check_quantized

    weights = {"gate_weight": "router", "w_gate_up": "gu", "w_down": "d"}
    scales = {"w_gate_up_scale": "gu_s", "w_down_scale": "d_s"}
    fp8 = {"quant": {"scheme": "fp8", "activations": "dynamic", "weight_granularity": "channel"}}
    int4_roles = {"w_gate_up_scales": "gu_s", "w_gate_up_zeros": "gu_z", "w_down_scales": "d_s", "w_down_zeros": "d_z"}
    int4 = {"quant": {"scheme": "w4a16", "bits": 4, "group_size": 64, "symmetric": False}}
    _check_quantized({}, [{"op": "moe", "source": "model.layers.0.mlp", "weights": weights, "attrs": {}},
                          {"op": "moe", "source": "model.layers.1.mlp", "weights": {**weights, **scales}, "attrs": fp8},
                          {"op": "moe", "source": "model.layers.2.mlp", "weights": {**weights, **int4_roles},
                           "attrs": int4}])
    bad = [({**weights, **scales}, {"quant": {"scheme": "w8a16"}}, "quant scheme 'w8a16' is not one this runtime "
                                                                     "executes for experts; allowed: fp8, w4a16"),
           ({**weights, **scales}, int4, r"a w4a16 moe carries the weights \['w_down_scales', 'w_down_zeros', "
                                         r"'w_gate_up_scales', 'w_gate_up_zeros'\]; it has \['w_down_scale', "
                                         r"'w_gate_up_scale'\]"),
           ({**weights, **int4_roles}, {"quant": {"scheme": "w4a16", "bits": 4}},
            "w4a16 experts need quant bits 4 and an integer group_size"),
           ({**weights, **int4_roles}, {"quant": {"scheme": "w4a16", "bits": 4, "group_size": 16}},
            "w4a16 experts in groups of 16: the experts kernel takes group sizes that are multiples of 32"),
           ({**weights, **scales}, {}, "an unquantized moe carries the weights without scales; it has "
                                       r"\['w_down_scale', 'w_gate_up_scale'\]"),
           ({**weights, "w_down_scale": "d_s"}, fp8, r"a fp8 moe carries the weights \['w_down_scale', "
                                                     r"'w_gate_up_scale'\]; it has \['w_down_scale'\]")]
    for node_weights, attrs, needle in bad:
        with pytest.raises(ManifestError, match="graph.json moe model.layers.3.mlp: " + needle):
            _check_quantized({}, [{"op": "moe", "source": "model.layers.3.mlp", "weights": node_weights,
                                   "attrs": attrs}])


def test_a_quantized_kv_cache_without_its_scales_is_refused(built):
    """kv_cache_dtype fp8 / int8 recorded, but an attention layer without its k_scale / v_scale weights: the kernels
    would read None (an AttributeError at the first token); refused naming the layer."""
    from runtime.manifest import ManifestError, check_graph

    manifest = json.loads((built[1] / MANIFEST).read_text())
    graph = json.loads((built[1] / "graph.json").read_text())
    check_graph(manifest, graph)
    manifest["runtime"]["kv_cache_dtype"] = manifest["quantization"]["kv_cache_dtype"] = "int8"
    for node in (n for n in graph["nodes"] if n["op"] == "attention"):
        node["attrs"]["kv_cache_dtype"] = "int8"
    with pytest.raises(ManifestError, match=r"attention layer 0 has no k_scale / v_scale weight; "
                                            r"runtime\.kv_cache_dtype int8 needs each layer's k_scale and v_scale"):
        check_graph(manifest, graph)
