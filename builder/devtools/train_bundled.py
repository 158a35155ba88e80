"""Train the small bundled Llama checkpoint on the Python standard library.

The toolchain needs a real Hugging Face checkpoint to exercise end to end
(tracing, quantization, packaging, serving) without network access. This
script builds one from text that every machine with Python already has: the
source files of the standard library. It trains a byte-level BPE tokenizer and
a small ``LlamaForCausalLM`` (with grouped-query attention) from scratch on
CPU, then writes the checkpoint plus held-out calibration/eval text and a
training report.

Run it as::

    python -m builder.devtools.train_bundled --out models/pystdlib-llama

The default run is reproducible: fixed seed, fixed file order, fixed split,
fixed data order and a fixed number of optimizer steps. ``--time-budget-min``
switches to a wall-clock-bounded run, which is not reproducible.

Importing this module has no side effects; the split function
(:func:`assign_split`) is reused by the tests.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# --------------------------------------------------------------------------
# Constants shared with the tests
# --------------------------------------------------------------------------

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
CHAT_TOKENS = ("<|user|>", "<|assistant|>", "<|system|>", "<|end|>")
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, *CHAT_TOKENS)
"""Special tokens in id order: bos=0, eos=1, pad=2, then the chat tokens."""

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

SPLIT_TRAIN = "train"
SPLIT_EVAL = "eval"
SPLIT_CALIBRATION = "calibration"

EXCLUDED_DIR_NAMES = frozenset({"test", "tests", "idlelib", "site-packages", "__pycache__"})
"""Directory names skipped anywhere in a path: test suites, the IDE, and third-party packages."""

EXCLUDED_FILE_PREFIXES = ("_sysconfigdata",)
"""Generated build configuration: it embeds the build machine's paths, so it differs per install."""

DEFAULT_PROMPTS = ("def fibonacci(n):", "import os\n", "class Stack:")


# --------------------------------------------------------------------------
# Corpus: file discovery and the deterministic split
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class SourceFile:
    """One standard-library source file: its path relative to the stdlib root and its text."""

    rel_path: str
    text: str


def stdlib_root() -> Path:
    """Return the directory holding the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def python_version() -> str:
    """Return ``major.minor.micro`` of the running interpreter (the corpus depends on it)."""
    return platform.python_version()


def is_excluded(rel_path: str) -> bool:
    """Tell whether a stdlib-relative POSIX path is left out of the corpus.

    Test suites, IDLE and site-packages are skipped because they are not
    representative library code (test data contains deliberately broken or
    odd files); the generated sysconfig data is skipped because it differs
    between installs and would make the corpus machine-specific.
    """
    parts = rel_path.split("/")
    if any(part in EXCLUDED_DIR_NAMES for part in parts[:-1]):
        return True
    return parts[-1].startswith(EXCLUDED_FILE_PREFIXES)


def assign_split(rel_path: str) -> str:
    """Assign a file to a split by a stable hash of its stdlib-relative path.

    ``sha256(path) mod 100``: 0-89 train, 90-94 eval, 95-99 calibration.
    Hashing the path (not the content or list position) keeps the assignment
    identical across runs, machines and Python patch releases, and lets anyone
    recompute it from the path alone.
    """
    bucket = int(hashlib.sha256(rel_path.encode("utf-8")).hexdigest(), 16) % 100
    if bucket < 90:
        return SPLIT_TRAIN
    if bucket < 95:
        return SPLIT_EVAL
    return SPLIT_CALIBRATION


def collect_stdlib_files(root: Path) -> tuple[list[SourceFile], list[str]]:
    """Read every eligible ``*.py`` file under ``root``, sorted by relative path.

    Returns the decoded files and the relative paths that were skipped because
    they are not valid UTF-8. Sorting makes the downstream token stream, and
    hence training, independent of filesystem enumeration order.
    """
    files: list[SourceFile] = []
    undecodable: list[str] = []
    rel_paths = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py") if p.is_file())
    for rel_path in rel_paths:
        if is_excluded(rel_path):
            continue
        try:
            text = (root / rel_path).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            undecodable.append(rel_path)
            continue
        if text.strip():
            files.append(SourceFile(rel_path, text))
    return files, undecodable


def pack_stdlib(root: Path, out: Path) -> int:
    """Write the corpus files under ``root`` (the ones :func:`collect_stdlib_files` reads) into a ``.tar.gz``.

    For training on a machine whose Python is another version: unpack it there and pass the directory as
    ``--stdlib`` with ``--stdlib-version``. Entries are in path order with zeroed times. Returns the file count.
    """
    import io
    import tarfile

    files, _ = collect_stdlib_files(root)
    with tarfile.open(out, "w:gz") as tar:
        for f in files:
            data = (root / f.rel_path).read_bytes()
            info = tarfile.TarInfo(f.rel_path)
            info.size, info.mtime = len(data), 0
            tar.addfile(info, io.BytesIO(data))
    return len(files)


def split_files(files: Sequence[SourceFile]) -> dict[str, list[SourceFile]]:
    """Group files by :func:`assign_split`, keeping the sorted order inside each split."""
    splits: dict[str, list[SourceFile]] = {SPLIT_TRAIN: [], SPLIT_EVAL: [], SPLIT_CALIBRATION: []}
    for f in files:
        splits[assign_split(f.rel_path)].append(f)
    return splits


# --------------------------------------------------------------------------
# Held-out text shipped with the checkpoint
# --------------------------------------------------------------------------


def chunk_text(text: str, chunk_chars: int) -> list[str]:
    """Cut text into pieces of roughly ``chunk_chars`` characters at line boundaries.

    Whole lines keep each chunk readable code; a single line longer than the
    target becomes its own chunk rather than being split mid-line.
    """
    chunks: list[str] = []
    current: list[str] = []
    size = 0
    for line in text.splitlines(keepends=True):
        if current and size + len(line) > chunk_chars:
            chunks.append("".join(current))
            current, size = [], 0
        current.append(line)
        size += len(line)
    if current:
        chunks.append("".join(current))
    return chunks


def write_calibration_jsonl(
    files: Sequence[SourceFile], path: Path, chunk_chars: int = 2000, max_bytes: int = 1_000_000
) -> dict[str, int]:
    """Write calibration chunks as JSON lines (``{"text": ...}``), stopping near ``max_bytes``.

    Quantization passes consume this as their default calibration set, so it
    comes only from the calibration split and never from training files.
    """
    n_chunks = n_bytes = 0
    with path.open("w", encoding="utf-8") as out:
        for f in files:
            for chunk in chunk_text(f.text, chunk_chars):
                if not chunk.strip():
                    continue
                line = json.dumps({"text": chunk}, ensure_ascii=False) + "\n"
                size = len(line.encode("utf-8"))
                if n_bytes + size > max_bytes:
                    return {"chunks": n_chunks, "bytes": n_bytes}
                out.write(line)
                n_chunks += 1
                n_bytes += size
    return {"chunks": n_chunks, "bytes": n_bytes}


def build_eval_text(files: Sequence[SourceFile], target_chars: int = 200_000) -> str:
    """Concatenate eval-split files (blank line between) and cut at a line near ``target_chars``."""
    pieces: list[str] = []
    total = 0
    for f in files:
        body = f.text if f.text.endswith("\n") else f.text + "\n"
        pieces.append(body + "\n")
        total += len(body) + 1
        if total >= target_chars:
            break
    text = "".join(pieces)
    if len(text) > target_chars:
        cut = text.rfind("\n", 0, target_chars)
        text = text[: cut + 1] if cut > 0 else text[:target_chars]
    return text


def write_split_manifest(splits: dict[str, list[SourceFile]], undecodable: list[str], path: Path,
                         version: str | None = None) -> None:
    """Record which files were held out, so held-out data can be audited and re-derived.

    ``version`` is the Python version whose standard library the corpus is (default: the running interpreter's).
    """
    manifest = {
        "python_version": version or python_version(),
        "stdlib_root_note": "paths are relative to sysconfig.get_paths()['stdlib']",
        "rule": "sha256(rel_path) % 100: 0-89 train, 90-94 eval, 95-99 calibration",
        "counts": {name: len(fs) for name, fs in splits.items()},
        "skipped_not_utf8": undecodable,
        SPLIT_EVAL: [f.rel_path for f in splits[SPLIT_EVAL]],
        SPLIT_CALIBRATION: [f.rel_path for f in splits[SPLIT_CALIBRATION]],
    }
    path.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer whose first ids are :data:`SPECIAL_TOKENS`.

    Byte-level BPE encodes any string losslessly, so decode(encode(x)) == x.
    The post-processor prepends ``<|bos|>`` (as Llama tokenizers do), matching
    how each training document starts.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``.

    The config files are written by hand (rather than by a transformers class)
    so their content does not depend on the installed transformers version.
    """
    tokenizer.save(str(out_dir / "tokenizer.json"))
    special_map = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": list(CHAT_TOKENS),
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_map,
        "model_max_length": model_max_length,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n", encoding="utf-8")


def check_tokenizer(out_dir: Path, samples: Sequence[str]) -> dict[str, Any]:
    """Load the saved tokenizer through ``AutoTokenizer`` and verify it round-trips.

    Raises ``AssertionError`` if special-token ids are not the expected ones or
    if any sample does not decode back to itself.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out_dir))
    expected = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    actual = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    assert actual == expected, f"special token ids {actual} != {expected}"
    assert tok.bos_token_id == 0 and tok.eos_token_id == 1 and tok.pad_token_id == 2
    chars = toks = 0
    for text in samples:
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id, "tokenizer must prepend <|bos|>"
        decoded = tok.decode(ids, skip_special_tokens=True)
        assert decoded == text, "decode(encode(text)) does not round-trip"
        chars += len(text)
        toks += len(ids) - 1
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|user|>\nhi<|end|>\n<|assistant|>\n", repr(chat)
    return {"class": type(tok).__name__, "samples": len(samples), "chars_per_token": round(chars / max(toks, 1), 3)}


def encode_documents(tokenizer: Tokenizer, texts: Sequence[str]) -> torch.Tensor:
    """Tokenize documents into one stream: ``<|bos|> doc <|eos|>`` for each, in order."""
    bos = tokenizer.token_to_id(BOS_TOKEN)
    eos = tokenizer.token_to_id(EOS_TOKEN)
    stream: list[int] = []
    for enc in tokenizer.encode_batch(list(texts), add_special_tokens=False):
        stream.append(bos)
        stream.extend(enc.ids)
        stream.append(eos)
    return torch.tensor(stream, dtype=torch.long)


def pack_windows(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Cut a token stream into non-overlapping ``[n, seq_len]`` windows, dropping the tail."""
    n = stream.numel() // seq_len
    return stream[: n * seq_len].view(n, seq_len)


# --------------------------------------------------------------------------
# Model, optimisation, evaluation
# --------------------------------------------------------------------------


@dataclass
class ModelSpec:
    """Size of the Llama model; defaults keep the float32 checkpoint well under 20 MB."""

    hidden_size: int = 256
    intermediate_size: int = 704
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5


@dataclass
class TrainSpec:
    """Optimisation settings. ``max_steps`` is fixed so the default run is reproducible."""

    seed: int = 1234
    max_steps: int = 500
    time_budget_min: float | None = None
    batch_size: int = 16
    seq_len: int = 256
    peak_lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    log_every: int = 25
    threads: int = 2
    device: str = "cpu"  # "cuda" (or "cuda:N"): the steps run under bf16 autocast, the weights stay fp32
    eval_every: int = 0  # print the validation windows' perplexity every N steps (0: never)


@dataclass
class TrainResult:
    """What the training loop measured."""

    steps: int
    train_seconds: float
    final_loss: float
    final_loss_avg: float
    tokens_seen: int
    loss_curve: list[tuple[int, float]] = field(default_factory=list)
    validation_curve: list[tuple[int, float]] = field(default_factory=list)  # (step, perplexity), if asked for


MODEL_FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"mlp_bias": False}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),  # no mlp_bias key; per-head q/k RMSNorm is built in
}
"""``family -> (config class, model class, config keys beyond ModelSpec)`` that :func:`build_model` can make."""


def build_model(spec: ModelSpec, vocab_size: int, family: str = "llama") -> PreTrainedModel:
    """Create a freshly initialised causal LM of ``family`` (default Llama) with tied embeddings and GQA."""
    import transformers

    assert family in MODEL_FAMILIES, f"family {family!r}: use one of {sorted(MODEL_FAMILIES)}"
    assert spec.num_attention_heads % spec.num_key_value_heads == 0
    assert spec.num_key_value_heads < spec.num_attention_heads, "grouped-query attention must be exercised"
    config_name, model_name, extra = MODEL_FAMILIES[family]
    config = getattr(transformers, config_name)(
        vocab_size=vocab_size,
        **asdict(spec),
        hidden_act="silu",
        attention_bias=False,
        **extra,
        tie_word_embeddings=True,
        bos_token_id=SPECIAL_TOKENS.index(BOS_TOKEN),
        eos_token_id=SPECIAL_TOKENS.index(EOS_TOKEN),
        pad_token_id=SPECIAL_TOKENS.index(PAD_TOKEN),
        initializer_range=0.02,
        use_cache=True,
    )
    return getattr(transformers, model_name)(config)


def lr_factor(step: int, warmup_steps: int, progress: float, min_ratio: float) -> float:
    """Learning-rate multiplier: linear warmup over ``warmup_steps``, then cosine decay to ``min_ratio``.

    ``progress`` (0 to 1) is how far the run is through its decay phase: by
    steps in the default run, by elapsed time in a time-budgeted run.
    """
    if step <= warmup_steps:
        return step / max(warmup_steps, 1)
    progress = min(max(progress, 0.0), 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, spec: TrainSpec) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (norm gains are left undecayed)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=spec.peak_lr, betas=spec.betas, eps=1e-8)


def batch_order(n_windows: int, batch_size: int, steps: int, seed: int) -> list[torch.Tensor]:
    """Deterministic batches of window indices: a seeded permutation per epoch, no repeats within one."""
    gen = torch.Generator().manual_seed(seed)
    batches: list[torch.Tensor] = []
    perm = torch.randperm(n_windows, generator=gen)
    pos = 0
    while len(batches) < steps:
        if pos + batch_size > n_windows:
            perm, pos = torch.randperm(n_windows, generator=gen), 0
        batches.append(perm[pos : pos + batch_size])
        pos += batch_size
    return batches


def autocast(device: torch.device):
    """bf16 autocast on CUDA (fp32 weights and optimizer state); nothing on the CPU, which trains in fp32."""
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor, grad_clip: float) -> float:
    """One optimizer step of next-token prediction on ``batch`` (on the model's device); returns the batch loss."""
    with autocast(batch.device):
        loss = model(input_ids=batch, labels=batch).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return loss.item()


def train_model(model: torch.nn.Module, windows: torch.Tensor, spec: TrainSpec,
                validation: torch.Tensor | None = None) -> TrainResult:
    """Run the training loop on ``spec.device`` and return the measured loss curve and time.

    With ``time_budget_min`` set, the schedule is driven by elapsed time and
    training stops when the budget is spent (or at ``max_steps``). With
    ``spec.eval_every`` and ``validation`` windows, their perplexity is printed and recorded every that many steps.
    """
    device = torch.device(spec.device)
    model.to(device)
    optimizer = make_optimizer(model, spec)
    batches = batch_order(windows.size(0), spec.batch_size, spec.max_steps, spec.seed)
    budget_s = spec.time_budget_min * 60.0 if spec.time_budget_min else None
    model.train()
    curve: list[tuple[int, float]] = []
    validation_curve: list[tuple[int, float]] = []
    recent: list[float] = []
    start = time.perf_counter()
    step = 0
    loss_value = float("nan")
    for step, idx in enumerate(batches, start=1):
        elapsed = time.perf_counter() - start
        if budget_s is not None and elapsed >= budget_s:
            step -= 1
            break
        if budget_s is not None:
            progress = elapsed / budget_s
        else:
            progress = (step - spec.warmup_steps) / max(spec.max_steps - spec.warmup_steps, 1)
        for group in optimizer.param_groups:
            group["lr"] = spec.peak_lr * lr_factor(step, spec.warmup_steps, progress, spec.min_lr_ratio)
        loss_value = train_step(model, optimizer, windows[idx].to(device), spec.grad_clip)
        recent = (recent + [loss_value])[-spec.log_every :]
        if validation is not None and spec.eval_every and (step % spec.eval_every == 0 or step == len(batches)):
            ppl, _ = perplexity(model, validation)
            validation_curve.append((step, round(ppl, 3)))
            print(f"step {step:5d}  validation perplexity {ppl:.3f}", flush=True)
            model.train()
        if step % spec.log_every == 0 or step == 1 or step == len(batches):
            curve.append((step, round(sum(recent) / len(recent), 4)))
            rate = (time.perf_counter() - start) / step
            print(
                f"step {step:5d}/{spec.max_steps}  loss {loss_value:.4f}  avg{len(recent)} {curve[-1][1]:.4f}  "
                f"lr {optimizer.param_groups[0]['lr']:.2e}  {rate:.2f}s/step",
                flush=True,
            )
    train_seconds = time.perf_counter() - start
    if recent and (not curve or curve[-1][0] != step):
        curve.append((step, round(sum(recent) / len(recent), 4)))
    model.eval()
    return TrainResult(
        steps=step,
        train_seconds=round(train_seconds, 1),
        final_loss=round(loss_value, 4),
        final_loss_avg=round(sum(recent) / max(len(recent), 1), 4),
        tokens_seen=step * spec.batch_size * spec.seq_len,
        loss_curve=curve,
        validation_curve=validation_curve,
    )


@torch.no_grad()
def perplexity(model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 16) -> tuple[float, int]:
    """Perplexity over non-overlapping windows; each window predicts its own last ``seq_len - 1`` tokens.

    Runs in fp32 on the model's device. Returns ``(perplexity, number_of_predicted_tokens)``.
    """
    model.eval()
    device = next(model.parameters()).device
    total_nll = 0.0
    total_tokens = 0
    for i in range(0, windows.size(0), batch_size):
        x = windows[i : i + batch_size].to(device)
        n_pred = x.size(0) * (x.size(1) - 1)
        total_nll += model(input_ids=x, labels=x).loss.item() * n_pred
        total_tokens += n_pred
    return math.exp(total_nll / total_tokens), total_tokens


@torch.no_grad()
def generate_samples(
    model: torch.nn.Module, tokenizer_dir: Path, prompts: Sequence[str], seed: int, max_new_tokens: int = 96
) -> list[dict[str, str]]:
    """Greedy and sampled (temperature 0.8, top-p 0.95) continuations for each prompt."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    device = next(model.parameters()).device
    samples = []
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt")["input_ids"].to(device)
        common = dict(max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        greedy = model.generate(ids, do_sample=False, **common)
        torch.manual_seed(seed)
        sampled = model.generate(ids, do_sample=True, temperature=0.8, top_p=0.95, top_k=0, **common)
        samples.append(
            {
                "prompt": prompt,
                "greedy": tok.decode(greedy[0], skip_special_tokens=True),
                "sampled": tok.decode(sampled[0], skip_special_tokens=True),
            }
        )
    return samples


# --------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------


def dir_size_bytes(path: Path) -> int:
    """Total size of the regular files directly inside ``path``."""
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


@dataclass(frozen=True)
class ReportText:
    """The parts of ``TRAINING.md`` that name the checkpoint and describe its corpus (all else comes from metrics)."""

    name: str  # checkpoint directory name, the report's title
    script: str  # repo path of the training script
    data_lines: tuple[str, ...]  # the Data section's paragraph, above the split table
    sample_lang: str  # code-fence language of the samples
    show_loss_curve: bool = False  # list the logged loss curve in the Training section


BUNDLED_REPORT = ReportText(
    name="pystdlib-llama",
    script="builder/devtools/train_bundled.py",
    data_lines=(
        "Standard-library `*.py` files (test suites, idlelib, site-packages, generated sysconfig data and",
        "non-UTF-8 files excluded), split by `sha256(relative path) % 100`: 0-89 train, 90-94 eval, 95-99",
        "calibration. Eval and calibration files are listed in `split.json` and never seen in training.",
    ),
    sample_lang="python",
)


def write_training_report(
    out_dir: Path, metrics: dict[str, Any], samples: list[dict[str, str]], text: ReportText = BUNDLED_REPORT
) -> None:
    """Write ``TRAINING.md``: how the checkpoint was produced and what it measured."""
    m = metrics
    lines = [
        f"# {text.name}: training record",
        "",
        f"Generated by `{text.script}`; every number below was measured by that run.",
        "",
        "## Reproduce",
        "",
        "```",
        m["command"],
        "```",
        "",
        f"- seed: {m['seed']}",
        f"- python: {m['python_version']} (the corpus is this Python version's standard library)",
        f"- torch: {m['torch_version']}, transformers: {m['transformers_version']}, tokenizers: {m['tokenizers_version']}",
        (f"- device: {m['train']['device_name']} (bf16 autocast, fp32 weights and optimizer state)"
         if m["train"].get("device", "cpu") != "cpu" else f"- threads: {m['train']['threads']} (CPU)"),
        *([f"- tokenizer: read from `{m['tokenizer']['source']}` (not retrained)"]
          if m["tokenizer"].get("source") else []),
        "",
        "## Data",
        "",
        *text.data_lines,
        "",
        "| split | files | characters | tokens |",
        "|---|---:|---:|---:|",
    ]
    for name in (SPLIT_TRAIN, SPLIT_EVAL, SPLIT_CALIBRATION):
        d = m["data"][name]
        lines.append(f"| {name} | {d['files']} | {d['chars']:,} | {d['tokens']:,} |")
    lines += [
        "",
        f"Skipped (not UTF-8): {len(m['data']['skipped_not_utf8'])} file(s).",
        f"Shipped held-out text: `calibration.jsonl` ({m['shipped']['calibration_chunks']} chunks,",
        f"{m['shipped']['calibration_bytes']:,} bytes) and `eval.txt` ({m['shipped']['eval_txt_chars']:,} characters).",
        "",
        "## Tokenizer",
        "",
        f"Byte-level BPE, vocab {m['tokenizer']['vocab_size']}, trained on the train split only; special tokens",
        f"{', '.join(f'`{t}`' for t in SPECIAL_TOKENS)} (ids 0-{len(SPECIAL_TOKENS) - 1}).",
        f"{m['tokenizer']['chars_per_token']} characters per token on round-trip check samples.",
        "",
        "## Model",
        "",
        "```json",
        json.dumps(m["model"], indent=2),
        "```",
        "",
        f"Parameters: {m['parameters']:,}; checkpoint directory size: {m['checkpoint_dir_bytes']:,} bytes "
        f"(weights stored as {m['weights_dtype']}).",
        "",
        "## Training",
        "",
        f"- steps: {m['train']['steps']} x batch {m['train']['batch_size']} x seq_len {m['train']['seq_len']}"
        f" = {m['train']['tokens_seen']:,} tokens ({m['train']['epochs']:.2f} epochs of the train split)",
        f"- AdamW, peak lr {m['train']['peak_lr']}, betas {m['train']['betas']}, weight decay {m['train']['weight_decay']},"
        f" {m['train']['warmup_steps']} warmup steps then cosine to {m['train']['min_lr_ratio']} x peak, grad clip"
        f" {m['train']['grad_clip']}",
        f"- train time: {m['train']['train_seconds']:.0f} s; whole run (corpus, tokenizer, training, eval):"
        f" {m['total_seconds']:.0f} s",
        f"- final train loss: {m['train']['final_loss']:.4f} (mean of last {m['train']['log_every']} steps:"
        f" {m['train']['final_loss_avg']:.4f})",
        *(
            [f"- train loss by step (mean of the last {m['train']['log_every']} steps): "
             + ", ".join(f"{step}: {loss:.3f}" for step, loss in m["train"]["loss_curve"])]
            if text.show_loss_curve
            else []
        ),
        "",
        "## Held-out evaluation",
        "",
        "Measured on the weights as stored.",
        "",
        *(
            ["- calibration split perplexity during training (step: perplexity): "
             + ", ".join(f"{step}: {ppl:.2f}" for step, ppl in m["train"]["validation_curve"])]
            if m["train"].get("validation_curve") else []
        ),
        f"- eval split perplexity: **{m['eval']['eval_split_ppl']:.2f}** over {m['eval']['eval_split_tokens']:,}"
        f" predicted tokens (non-overlapping windows of {m['train']['seq_len']})",
        f"- `eval.txt` perplexity: {m['eval']['eval_txt_ppl']:.2f} over {m['eval']['eval_txt_tokens']:,} predicted tokens",
        *([f"- calibration split perplexity: {m['eval']['calibration_split_ppl']:.2f} over"
           f" {m['eval']['calibration_split_tokens']:,} predicted tokens"]
          if "calibration_split_ppl" in m["eval"] else []),
        f"- uniform baseline: {m['tokenizer']['vocab_size']}",
        "",
        "## Samples",
        "",
        "Greedy decoding, and sampling with temperature 0.8 / top-p 0.95 (seeded).",
    ]
    for s in samples:
        lines += [
            "",
            f"### Prompt `{s['prompt']!r}`",
            "",
            "Greedy:",
            "",
            f"```{text.sample_lang}",
            s["greedy"],
            "```",
            "",
            "Sampled:",
            "",
            f"```{text.sample_lang}",
            s["sampled"],
            "```",
        ]
    (out_dir / "TRAINING.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------


def write_reports(
    out_dir: Path, metrics: dict[str, Any], samples: list[dict[str, str]], text: ReportText = BUNDLED_REPORT
) -> None:
    """Write ``training_metrics.json`` and ``TRAINING.md``, including the final directory size.

    The size depends on the reports themselves, so they are rewritten until it is stable.
    """
    metrics["checkpoint_dir_bytes"] = 0
    for _ in range(4):
        (out_dir / "training_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
        write_training_report(out_dir, metrics, samples, text)
        size = dir_size_bytes(out_dir)
        if size == metrics["checkpoint_dir_bytes"]:
            return
        metrics["checkpoint_dir_bytes"] = size


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options; the defaults reproduce the bundled checkpoint."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("models/pystdlib-llama"), help="output checkpoint directory")
    p.add_argument("--seed", type=int, default=TrainSpec.seed)
    p.add_argument("--max-steps", type=int, default=TrainSpec.max_steps, help="optimizer steps; also the cap of a time-budgeted run")
    p.add_argument(
        "--time-budget-min",
        type=float,
        default=None,
        help="stop training after this many minutes and drive the LR schedule by time (not reproducible)",
    )
    p.add_argument("--batch-size", type=int, default=TrainSpec.batch_size)
    p.add_argument("--seq-len", type=int, default=TrainSpec.seq_len)
    p.add_argument("--lr", type=float, default=TrainSpec.peak_lr, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=TrainSpec.warmup_steps)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--log-every", type=int, default=TrainSpec.log_every, help="print the loss every N steps")
    p.add_argument("--threads", type=int, default=TrainSpec.threads)
    p.add_argument("--stdlib", type=Path, default=None, help="stdlib directory (default: this interpreter's)")
    add_training_options(p)
    p.add_argument("--pack-stdlib", type=Path, default=None, metavar="FILE",
                   help="only write the corpus files into FILE (.tar.gz), for --stdlib on another machine, and exit")
    return p.parse_args(argv)


def add_training_options(p: argparse.ArgumentParser, spec: ModelSpec | None = None) -> None:
    """Options every trainer takes: device, size of the model, tokenizer reuse, the corpus' Python version."""
    spec = spec or ModelSpec()
    p.add_argument("--device", default=TrainSpec.device,
                   help="cpu, cuda or cuda:N (CUDA trains under bf16 autocast with fp32 weights; runs are seeded but "
                        "not bit-reproducible across GPUs)")
    p.add_argument("--eval-every", type=int, default=TrainSpec.eval_every,
                   help="print the calibration split's perplexity every N steps (0: never)")
    p.add_argument("--weight-decay", type=float, default=TrainSpec.weight_decay)
    p.add_argument("--min-lr-ratio", type=float, default=TrainSpec.min_lr_ratio)
    p.add_argument("--hidden-size", type=int, default=spec.hidden_size)
    p.add_argument("--intermediate-size", type=int, default=spec.intermediate_size)
    p.add_argument("--layers", type=int, default=spec.num_hidden_layers)
    p.add_argument("--heads", type=int, default=spec.num_attention_heads)
    p.add_argument("--kv-heads", type=int, default=spec.num_key_value_heads)
    p.add_argument("--head-dim", type=int, default=spec.head_dim)
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="a directory whose tokenizer.json is used as is instead of training one")
    p.add_argument("--stdlib-version", default=None,
                   help="the Python version of --stdlib's library, recorded in split.json "
                        "(default: this interpreter's)")


def model_spec_from_args(args: argparse.Namespace, base: ModelSpec) -> ModelSpec:
    """``base`` with the size options of :func:`add_training_options` applied."""
    return ModelSpec(**{**asdict(base), "hidden_size": args.hidden_size, "intermediate_size": args.intermediate_size,
                        "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
                        "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim})


def load_tokenizer(args: argparse.Namespace) -> Tokenizer | None:
    """The tokenizer named by ``--tokenizer``, read before the output directory is cleared (it may be the same)."""
    path = getattr(args, "tokenizer", None)
    if path is None:
        return None
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        raise SystemExit(f"--tokenizer {path}: no tokenizer.json there")
    return Tokenizer.from_str(file.read_text(encoding="utf-8"))


def save_checkpoint(model: torch.nn.Module, out_dir: Path) -> str:
    """Save weights (float32 if they fit the 20 MB budget, else bfloat16) with the generation config."""
    from transformers import GenerationConfig

    n_params = sum(p.numel() for p in model.parameters())
    dtype = torch.float32 if n_params * 4 < 17_000_000 else torch.bfloat16
    device = next(model.parameters()).device
    model.to("cpu").to(dtype)
    model.config.dtype = dtype
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=[model.config.eos_token_id, SPECIAL_TOKENS.index("<|end|>")],
        pad_token_id=model.config.pad_token_id,
    )
    model.save_pretrained(str(out_dir), safe_serialization=True)
    (out_dir / "model.safetensors").chmod(0o644)
    model.to(torch.float32).to(device)  # the stored values, in fp32
    return str(dtype).replace("torch.", "")


@dataclass
class Corpus:
    """What a trainer hands :func:`run`: its documents by split, and how ``training_metrics.json`` describes them."""

    splits: dict[str, list[SourceFile]]
    skipped: list[str]  # paths left out of the corpus, listed in split.json
    data: dict[str, Any]  # entries of metrics["data"] after the per-split counts
    split_counts: Callable[[list[SourceFile]], dict[str, Any]] = lambda fs: {}  # per split, after "files"


@dataclass
class Trainer:
    """One trainer script's choices: everything :func:`run` does not take from the command line."""

    module: str  # for the recorded command: python -m MODULE ARGS
    model_spec: ModelSpec
    family: str = "llama"
    architecture: str = "LlamaForCausalLM"
    model_extra: dict[str, Any] = field(default_factory=dict)  # entries of metrics["model"] after the spec
    calibration_chunk_chars: int | None = None  # None: write_calibration_jsonl's default
    prompts: Sequence[str] = DEFAULT_PROMPTS
    report: Callable[[dict[str, Any]], ReportText] = lambda metrics: BUNDLED_REPORT


def prepare_out_dir(args: argparse.Namespace) -> tuple[Path, float]:
    """Seed, threads and determinism from ``args``; a fresh ``args.out``. Returns it and the run's start time."""
    run_start = time.perf_counter()
    if str(getattr(args, "device", "cpu")).startswith("cuda"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before CUDA starts
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    out_dir: Path = args.out
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    return out_dir, run_start


def run(args: argparse.Namespace, argv: Sequence[str] | None, out_dir: Path, run_start: float, corpus: Corpus,
        trainer: Trainer, tokenizer: Tokenizer | None = None) -> dict[str, Any]:
    """Write the held-out text, train the tokenizer (unless one is given) and the model on ``corpus``, evaluate,
    write the checkpoint directory and its reports; returns the metrics.

    The size options of :func:`add_training_options`, where ``args`` has them, replace ``trainer.model_spec``'s.
    """
    import tokenizers
    import transformers

    splits = corpus.splits
    version = getattr(args, "stdlib_version", None) or python_version()
    model_spec = model_spec_from_args(args, trainer.model_spec) if hasattr(args, "hidden_size") else trainer.model_spec
    write_split_manifest(splits, corpus.skipped, out_dir / "split.json", version)
    chunking = {} if trainer.calibration_chunk_chars is None else {"chunk_chars": trainer.calibration_chunk_chars}
    calib = write_calibration_jsonl(splits[SPLIT_CALIBRATION], out_dir / "calibration.jsonl", **chunking)
    eval_text = build_eval_text(splits[SPLIT_EVAL])
    (out_dir / "eval.txt").write_text(eval_text, encoding="utf-8")

    t0 = time.perf_counter()
    tokenizer_source = getattr(args, "tokenizer", None)
    if tokenizer is None:
        tokenizer = train_tokenizer([f.text for f in splits[SPLIT_TRAIN]], args.vocab_size)
    save_tokenizer(tokenizer, out_dir, model_max_length=model_spec.max_position_embeddings)
    tok_check = check_tokenizer(out_dir, [f.text for f in splits[SPLIT_EVAL][:20]])
    if tokenizer_source is not None:
        tok_check["source"] = str(tokenizer_source)
    print(f"tokenizer {'read' if tokenizer_source else 'trained'} in {time.perf_counter() - t0:.1f}s: {tok_check}",
          flush=True)

    streams = {name: encode_documents(tokenizer, [f.text for f in fs]) for name, fs in splits.items()}
    spec = TrainSpec(
        seed=args.seed,
        max_steps=args.max_steps,
        time_budget_min=getattr(args, "time_budget_min", None),
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        peak_lr=args.lr,
        warmup_steps=args.warmup_steps,
        log_every=args.log_every,
        threads=args.threads,
        device=getattr(args, "device", TrainSpec.device),
        eval_every=getattr(args, "eval_every", 0),
        weight_decay=getattr(args, "weight_decay", TrainSpec.weight_decay),
        min_lr_ratio=getattr(args, "min_lr_ratio", TrainSpec.min_lr_ratio),
    )
    train_windows = pack_windows(streams[SPLIT_TRAIN], spec.seq_len)
    print(f"train tokens {streams[SPLIT_TRAIN].numel():,} -> {train_windows.size(0)} windows", flush=True)

    torch.manual_seed(args.seed)
    model = build_model(model_spec, tokenizer.get_vocab_size(), family=trainer.family)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters", flush=True)
    validation = pack_windows(streams[SPLIT_CALIBRATION], spec.seq_len) if spec.eval_every else None
    result = train_model(model, train_windows, spec, validation)

    weights_dtype = save_checkpoint(model, out_dir)  # rounds the weights to the stored dtype: evaluate those
    eval_ppl, eval_tokens = perplexity(model, pack_windows(streams[SPLIT_EVAL], spec.seq_len))
    calib_ppl, calib_tokens = perplexity(model, pack_windows(streams[SPLIT_CALIBRATION], spec.seq_len))
    eval_txt_ids = torch.tensor(tokenizer.encode(eval_text).ids, dtype=torch.long)
    eval_txt_ppl, eval_txt_tokens = perplexity(model, pack_windows(eval_txt_ids, spec.seq_len))
    print(f"held-out perplexity: eval split {eval_ppl:.2f} ({eval_tokens} tokens), calibration split "
          f"{calib_ppl:.2f}, eval.txt {eval_txt_ppl:.2f}", flush=True)
    samples = generate_samples(model, out_dir, trainer.prompts, args.seed)
    for s in samples:
        print(f"--- {s['prompt']!r}\n[greedy]\n{s['greedy']}\n[sampled]\n{s['sampled']}", flush=True)

    command = f"python -m {trainer.module} " + " ".join(sys.argv[1:] if argv is None else argv)
    metrics: dict[str, Any] = {
        "command": command.strip(),
        "seed": args.seed,
        "python_version": version,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "tokenizers_version": tokenizers.__version__,
        "data": {
            **{
                name: {"files": len(fs), **corpus.split_counts(fs), "chars": sum(len(f.text) for f in fs),
                       "tokens": int(streams[name].numel())}
                for name, fs in splits.items()
            },
            **corpus.data,
        },
        "shipped": {
            "calibration_chunks": calib["chunks"],
            "calibration_bytes": calib["bytes"],
            "eval_txt_chars": len(eval_text),
        },
        "tokenizer": {"vocab_size": tokenizer.get_vocab_size(), **tok_check},
        "model": {"architecture": trainer.architecture, "vocab_size": tokenizer.get_vocab_size(),
                  **asdict(model_spec), "tie_word_embeddings": True, **trainer.model_extra},
        "parameters": n_params,
        "weights_dtype": weights_dtype,
        "train": {
            **{k: v for k, v in asdict(spec).items() if k != "seed"},
            **asdict(result),
            "epochs": result.tokens_seen / max(train_windows.numel(), 1),
            **({"device_name": torch.cuda.get_device_name(torch.device(spec.device))}
               if spec.device.startswith("cuda") else {}),
        },
        "eval": {
            "eval_split_ppl": round(eval_ppl, 3),
            "eval_split_tokens": eval_tokens,
            "eval_txt_ppl": round(eval_txt_ppl, 3),
            "eval_txt_tokens": eval_txt_tokens,
            "calibration_split_ppl": round(calib_ppl, 3),
            "calibration_split_tokens": calib_tokens,
        },
        "samples": samples,
    }
    metrics["total_seconds"] = round(time.perf_counter() - run_start, 1)
    write_reports(out_dir, metrics, samples, trainer.report(metrics))
    print(f"done in {metrics['total_seconds']:.0f}s; {out_dir} is {metrics['checkpoint_dir_bytes']:,} bytes")
    return metrics


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Build the corpus, tokenizer and model, train, evaluate and write the checkpoint directory."""
    args = parse_args(argv)
    if args.pack_stdlib is not None:
        n = pack_stdlib(args.stdlib or stdlib_root(), args.pack_stdlib)
        print(f"{args.pack_stdlib}: {n} files of Python {python_version()}'s standard library")
        return {}
    tokenizer = load_tokenizer(args)
    out_dir, run_start = prepare_out_dir(args)
    root = args.stdlib or stdlib_root()
    files, undecodable = collect_stdlib_files(root)
    splits = split_files(files)
    print(f"stdlib {root}: " + ", ".join(f"{k}={len(v)}" for k, v in splits.items()), flush=True)
    corpus = Corpus(splits, undecodable, {"skipped_not_utf8": undecodable})
    return run(args, argv, out_dir, run_start, corpus, Trainer("builder.devtools.train_bundled", ModelSpec()),
               tokenizer)


if __name__ == "__main__":
    main()
