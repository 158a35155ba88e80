"""Shared fixtures: tiny Hugging Face checkpoints of each supported family, made on the fly.

Each checkpoint is a real ``save_pretrained`` directory (config.json, model.safetensors, tokenizer
files) with seeded random weights, including the norm weights (which HF initialises to ones and
would hide a norm applied in the wrong place).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One intra-op thread per xdist worker (and per process a test starts): the workers already use every core,
    # and two workers of two threads each on two cores run slower than either alone.
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[_var] = "1"

# Speculative decoding's rate check (runtime.speculative.RateCheck) turns drafts off where they measure slower than
# none: on a shared test machine that depends on its load, so the tests pin it off; its own tests set min_gain.
os.environ.setdefault("RUNTIME_SPEC_MIN_GAIN", "0")

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def _patch_language_once_per_launch() -> None:
    """Under TRITON_INTERPRET=1 the interpreter patches ``triton.language`` for a kernel's launch (restored after it)
    and again, never restored, at every call of a ``@triton.jit`` helper inside it: a walk over the language's
    members per call, a fifth to a quarter of an interpreted launch's time in the kernels' tests. The modules are
    the same objects at every level, so a helper whose language modules the launch already patched skips the walk.
    A helper that sees another module (``triton.language.core`` where the kernel saw only ``triton.language``) is
    patched as before. Nothing changes when the interpreter's internals are not the ones this knows."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch, grid_call = getattr(interpreter, "_patch_lang", None), getattr(interpreter.GridExecutor, "__call__", None)
    if patch is None or grid_call is None or getattr(patch, "once_per_launch", False):
        return
    state: dict[str, frozenset[int] | None] = {"patched": None}  # in a launch: the modules patched so far

    class _NoScope:
        def restore(self) -> None:
            pass

    langs_of: dict[object, frozenset[int]] = {}

    def langs(fn) -> frozenset[int]:  # the language modules a function sees, once per function
        if fn not in langs_of:
            langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        return langs_of[fn]

    def patch_once(fn):
        patched = state["patched"]
        if patched is not None and langs(fn) <= patched:
            return _NoScope()
        scope = patch(fn)
        if patched is not None:
            state["patched"] = patched | langs(fn)
        return scope

    def launch(self, *args, **kwargs):
        outer, state["patched"] = state["patched"], frozenset()
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            state["patched"] = outer

    patch_once.once_per_launch = True
    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = launch


def pytest_collection_finish(session) -> None:
    # after collection: the test modules set TRITON_INTERPRET before they import the kernels, and triton.language's
    # own helpers (tl.sum, ...) are interpreted only if it is first imported after that
    _patch_language_once_per_launch()


@pytest.fixture(scope="session", autouse=True)
def export_once_per_model() -> Iterator[None]:
    """``torch.export`` of a model this worker has exported before (same class, config and module classes) returns
    that export again. Exporting is nearly all of a tiny build's trace (4 s of 4.1 for the bundled model), and the
    suite builds the same checkpoints over and over (the bundled model about twenty times); the lifting and all
    that follows it still run every time. A test that swaps a modeling module class changes the key; a test that
    patches ``export_model`` itself replaces this for its duration; a failed export is not kept."""
    import passes.trace

    export = passes.trace.export_model
    exported: dict[tuple, torch.export.ExportedProgram] = {}

    def export_model(model: torch.nn.Module) -> torch.export.ExportedProgram:
        config = getattr(model, "config", None)
        if config is None:  # not a transformers model (the lifter's own test modules): no key to know it by
            return export(model)
        key = (type(model), config.to_json_string(), tuple(type(m) for m in model.modules()))
        if key not in exported:
            exported[key] = export(model)
        return exported[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(passes.trace, "export_model", export_model)
        yield


FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
SPECIAL = ["<|bos|>", "<|eos|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "import os\nimport sys\n\nclass Config:\n    \"\"\"Settings read from the environment.\"\"\"\n",
    "The quick brown fox jumps over the lazy dog. Zwölf Boxkämpfer jagen Viktor quer über den Sylter Deich.",
    "for i in range(10):\n    print(i, i * i)\n",
]


def save_tokenizer(path: Path, vocab_size: int = 320) -> int:
    """Train a tiny byte-level BPE tokenizer into ``path``; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B",
                                                       special_tokens=[("<|bos|>", bos)])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|eos|>",
        "pad_token": "<|pad|>", "chat_template": CHAT_TEMPLATE, "model_max_length": 512,
    }))
    return tok.get_vocab_size()


def tiny_config(family: str, vocab_size: int, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    if family == "llama":
        common.update(tie_word_embeddings=True, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}, rope_theta=500000.0)
        cls = LlamaConfig
    elif family == "mistral":
        common.update(sliding_window=None)
        cls = MistralConfig
    elif family == "qwen2":
        cls = Qwen2Config  # q/k/v projections carry biases
    elif family == "qwen3":
        common.update(head_dim=24)  # head_dim != hidden / heads, plus per-head q/k norms
        cls = Qwen3Config
    else:
        raise ValueError(family)
    common.update(overrides)
    return cls(**common)


def make_checkpoint(path: Path, family: str, seed: int = 0, **overrides) -> Path:
    """Save a tiny seeded checkpoint of ``family`` (weights in fp32) with a tokenizer to ``path``."""
    from transformers import AutoModelForCausalLM

    vocab = save_tokenizer(path)
    config = tiny_config(family, vocab, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms and biases: random, not ones/zeros
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """One tiny checkpoint per supported family, shared by the session."""
    root = tmp_path_factory.mktemp("ckpt")
    return {f: make_checkpoint(root / f, f, seed=i) for i, f in enumerate(FAMILIES)}


def hf_logits(path: Path, token_ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0]


def build_artifact(checkpoint: Path, out: Path, dtype: str = "float32", **runtime) -> Path:
    """Build an artifact from ``checkpoint`` with the default passes (verify included)."""
    from builder.pipeline import build
    from builder.recipe import validate_recipe

    recipe = validate_recipe({
        "name": out.name, "model": {"checkpoint": str(checkpoint), "dtype": dtype}, "output_dir": str(out),
        "runtime": {"max_seq_len": 256, "max_num_tokens": 64, **runtime},
    })
    return build(recipe).output_dir


@pytest.fixture(scope="session")
def artifacts(checkpoints, tmp_path_factory) -> dict[str, Path]:
    """One built artifact per family."""
    root = tmp_path_factory.mktemp("artifacts")
    return {f: build_artifact(p, root / f) for f, p in checkpoints.items()}


@pytest.fixture
def gpt_oss_attention_only(monkeypatch) -> None:
    """transformers' gpt-oss with its mixture of experts replaced by an identity (no experts) while the test runs:
    what is left is its attention (sinks, sliding / global layers, rotary on each head's halves), for tests of the
    attention alone (tensor-parallel sharding of the sinks)."""
    from transformers.models.gpt_oss import modeling_gpt_oss as oss

    class NoExperts(torch.nn.Module):
        def __init__(self, config) -> None:
            super().__init__()

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
            return x, None

    monkeypatch.setattr(oss, "GptOssMLP", NoExperts)


BUNDLED = Path(__file__).resolve().parents[1] / "models" / "pystdlib-llama"


@pytest.fixture(scope="session")
def bundled_artifact(tmp_path_factory) -> Path:
    """The bundled model built fp32 with small serving limits (8 sequences, 512 tokens, 64-token steps)."""
    return build_artifact(BUNDLED, tmp_path_factory.mktemp("bundled") / "pystdlib", max_batch_size=8,
                          max_seq_len=512, max_num_tokens=64)


@dataclass
class SharedBuild:
    """A ``builder build`` of a shipped recipe that several test files read."""
    path: Path  # the artifact directory: read it, copy it to change it
    exit_code: int  # builder build's: 0 built, 3 built and marked gate-failed
    output: str  # what it printed


RECIPES = Path(__file__).resolve().parents[1] / "recipes"


@pytest.fixture(scope="session")
def shared_build(tmp_path_factory) -> Callable[[str, list[str]], SharedBuild]:
    """``builder build recipes/RECIPE --quiet --set SET ...``, run once per test run for every test file that asks
    for the same recipe as validated (its output_dir aside): the quickstart builds are what several files check
    (every recipe builds, ``builder compare``, ``builder gate``), and under xdist those files run on different
    workers. The builds live in the run's temporary directory, which the workers share, each behind its file lock."""
    from filelock import FileLock
    from typer.testing import CliRunner

    from builder.cli import app
    from builder.recipe import load_recipe

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's directory: each worker's own lies below it
    root = root / "shared_builds"
    root.mkdir(exist_ok=True)

    def get(recipe: str, sets: list[str]) -> SharedBuild:
        resolved = load_recipe(RECIPES / recipe, [*sets, "output_dir=."]).model_dump(mode="json")
        key = hashlib.sha256(json.dumps(resolved, sort_keys=True).encode()).hexdigest()[:16]
        out, result = root / key / Path(recipe).stem, root / key / "result.json"
        with FileLock(root / f"{key}.lock"):
            if not result.is_file():
                result.parent.mkdir(exist_ok=True)
                args = ["build", str(RECIPES / recipe), "--quiet", "--set", f"output_dir={out}"]
                for s in sets:
                    args += ["--set", s]
                res = CliRunner().invoke(app, args)
                result.write_text(json.dumps({"exit_code": res.exit_code, "output": res.output}))
        done = json.loads(result.read_text())
        return SharedBuild(out, done["exit_code"], done["output"])

    return get


FIXTURE = Path(__file__).resolve().parents[1] / "models" / "pydoc-qwen3"
"""The second trained checkpoint: a Qwen3 model on stdlib docstrings (``builder/devtools/train_fixture.py``)."""


def quantization_setup(path: Path, num_samples: int, seq_len: int = 128, text_dir: Path | None = None,
                       num_positions: int = 2048):
    """The traced, merged fp32 graph of a checkpoint, calibration windows of held-out text and the gates' eval set
    (``num_positions`` positions in windows of 256): what the quantization quality tests score passes on. The
    text is ``calibration.jsonl`` / ``eval.txt`` of ``text_dir``, by default the bundled model's."""
    from builder.calibration import BUNDLED_MODEL, token_stream, token_windows
    from builder.checkpoint import attach_weights, open_checkpoint
    from builder.gates import make_eval_set
    from passes import PassContext, run_passes
    from passes.trace import trace
    from runtime.tokenizer import Tokenizer

    ckpt = open_checkpoint(path)
    graph, meta_model = trace(ckpt.hf_config())
    attach_weights(graph, ckpt, meta_model, torch.float32)
    graph, _ = run_passes(graph, ["merge_qkv", "merge_gate_up", "fuse_silu_mul", "fuse_add_rms_norm", "dce"],
                          PassContext())
    tok = Tokenizer.from_dir(path)
    encode = lambda t: tok.encode(t, add_special_tokens=False)  # noqa: E731
    text_dir = text_dir or BUNDLED_MODEL
    calib = token_windows(text_dir / "calibration.jsonl", encode, num_samples, seq_len, 0).windows
    stream, _ = token_stream(text_dir / "eval.txt", encode)
    return graph, calib, make_eval_set(stream, 256, num_positions)


def memo_logits(logits: Callable[[list[int]], torch.Tensor]) -> Callable[[list[int]], torch.Tensor]:
    """``logits`` (token ids -> logits) memoised by the ids: a reference scored against several candidates on one
    eval set (``builder.gates.compare``, which does not modify what it is given) runs once per window."""
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def cached(ids: list[int]) -> torch.Tensor:
        key = tuple(ids)
        if key not in cache:
            cache[key] = logits(ids)
        return cache[key]

    return cached


def make_outlier_variant(dst: Path, factor: float = 40.0, num_channels: int = 4, seed: int = 0) -> Path:
    """The bundled model with fixed-channel activation outliers, computing the same function.

    Every RMSNorm gain is multiplied by ``factor`` on a few channels and the matching input columns
    of the linears that norm feeds are divided by ``factor``: fp32 logits are unchanged, but the
    normed activations now carry the channel outliers of large real models.
    """
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(BUNDLED, dst)
    # in fp32 (the bundled weights are stored in bf16): the rescaled gains and columns then compute the same
    # function to fp32 rounding, where bf16 would round each rescaled weight again
    tensors = {k: v.float() for k, v in load_file(BUNDLED / "model.safetensors").items()}
    hidden = tensors["model.norm.weight"].shape[0]
    channels = torch.randperm(hidden, generator=torch.Generator().manual_seed(seed))[:num_channels]
    feeds = {"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj")}
    layers = {k.split(".")[2] for k in tensors if k.startswith("model.layers.")}
    for i in layers:
        for norm, linears in feeds.items():
            tensors[f"model.layers.{i}.{norm}.weight"][channels] *= factor
            for lin in linears:
                tensors[f"model.layers.{i}.{lin}.weight"][:, channels] /= factor
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "dtype": "float32"}, indent=2))
    return dst


@contextlib.contextmanager
def serve_app(app) -> Iterator[str]:
    """Serve an ASGI app with uvicorn in a background thread on a free loopback port until the block exits;
    yields its URL once /health answers 200, and checks the server shut down afterwards."""
    import socket
    import threading
    import time

    import httpx
    import uvicorn

    # IPPROTO_TCP explicitly: asyncio turns Nagle off only on sockets whose proto says TCP, and with Nagle
    # on, every response after the first on a connection waits ~40 ms for a delayed ACK
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not become healthy"
            time.sleep(0.05)
        yield url
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
    assert not thread.is_alive(), "the server did not shut down"


# The suite's heaviest files, longest first (seconds of one CPU per file, measured on a loaded 2-core machine of the
# CI's kind: 320, 250, 230, ... down to ~20). `--dist loadfile` hands files to the workers in collection order, and
# collection is alphabetical: the heaviest went out late (tests/passes, tests/runtime, tests/test_fixture_model.py)
# and the run ended on one worker. Longest first, the other files fill in behind them.
HEAVY_FILES = (
    "runtime/test_server.py", "kernels/test_executor_kernels.py", "passes/test_families.py",
    "kernels/test_paged_attention.py", "kernels/test_moe_kernel.py", "passes/test_weight_only_4bit.py",
    "runtime/test_speculative.py", "builder/test_recipes.py", "kernels/test_draft_paged.py",
    "builder/test_gate_regressions.py", "passes/test_smoothquant_static.py", "builder/test_compare.py",
    "kernels/test_gemm.py", "runtime/test_tensor_parallel.py", "builder/test_outlier_gates.py",
    "builder/test_malformed_inputs.py", "test_fixture_model.py", "passes/test_lift_primitives.py",
    "builder/test_plan.py", "kernels/test_gemv.py",
)


def pytest_collection_modifyitems(session, config, items) -> None:
    tests_dir = Path(__file__).resolve().parent
    rank = {name: i for i, name in enumerate(HEAVY_FILES)}

    def key(item) -> int:
        try:
            name = Path(str(item.fspath)).resolve().relative_to(tests_dir).as_posix()
        except ValueError:
            return len(HEAVY_FILES)
        return rank.get(name, len(HEAVY_FILES))

    items.sort(key=key)  # stable: every file's tests keep their order, the other files theirs
