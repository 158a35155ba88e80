"""Checks on the bundled ``models/pystdlib-llama`` checkpoint.

The checkpoint is the toolchain's offline test model, so these tests guard
what later stages rely on: it loads with transformers and tokenizers, it is a
Llama model with grouped-query attention, it stays small, its held-out data
really is held out, and it has learned something (perplexity far below the
uniform baseline).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from builder.devtools.train_bundled import (
    SPECIAL_TOKENS,
    SPLIT_CALIBRATION,
    SPLIT_EVAL,
    SPLIT_TRAIN,
    assign_split,
    collect_stdlib_files,
    python_version,
    split_files,
    stdlib_root,
)

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "pystdlib-llama"
MAX_BYTES = 25 * 1024 * 1024
SEQ_LEN = 256
N_WINDOWS = 2


@pytest.fixture(scope="module")
def config() -> dict:
    """The raw ``config.json``."""
    return json.loads((MODEL_DIR / "config.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def split_manifest() -> dict:
    """The raw ``split.json``."""
    return json.loads((MODEL_DIR / "split.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def model():
    """The checkpoint loaded through transformers' auto class."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(str(MODEL_DIR)).eval()


@pytest.fixture(scope="module")
def hf_tokenizer():
    """The tokenizer loaded through transformers' auto class."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


def test_expected_files_present() -> None:
    """Every file later stages read is shipped."""
    expected = {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "split.json",
        "calibration.jsonl",
        "eval.txt",
        "TRAINING.md",
        "training_metrics.json",
    }
    present = {p.name for p in MODEL_DIR.iterdir()}
    assert expected <= present, f"missing: {sorted(expected - present)}"


def test_checkpoint_is_small() -> None:
    """Each file, and the directory as a whole, stays under 25 MB."""
    sizes = {p.name: p.stat().st_size for p in MODEL_DIR.iterdir() if p.is_file()}
    assert all(size < MAX_BYTES for size in sizes.values()), sizes
    assert sum(sizes.values()) < MAX_BYTES, sum(sizes.values())


def test_config_is_llama_with_gqa(config: dict, model) -> None:
    """The model is a LlamaForCausalLM whose attention shares key/value heads across groups."""
    from transformers import LlamaForCausalLM

    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert isinstance(model, LlamaForCausalLM)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    assert 1 < kv_heads < heads and heads % kv_heads == 0
    attn = model.model.layers[0].self_attn
    head_dim = config["head_dim"]
    assert attn.q_proj.out_features == heads * head_dim
    assert attn.k_proj.out_features == kv_heads * head_dim
    assert attn.v_proj.out_features == kv_heads * head_dim


def test_tokenizer_matches_model(config: dict, hf_tokenizer) -> None:
    """Both tokenizer loaders agree with the model on vocabulary and special-token ids."""
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    assert raw.get_vocab_size() == config["vocab_size"]
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        assert raw.token_to_id(token) == expected_id
    assert hf_tokenizer.bos_token_id == config["bos_token_id"]
    assert hf_tokenizer.eos_token_id == config["eos_token_id"]
    assert hf_tokenizer.pad_token_id == config["pad_token_id"]
    assert len(hf_tokenizer) == config["vocab_size"]


def test_tokenizer_round_trips_and_renders_chat(hf_tokenizer) -> None:
    """Byte-level BPE decodes stdlib text back exactly, and the chat template uses the chat tokens."""
    text = (MODEL_DIR / "eval.txt").read_text(encoding="utf-8")[:3000] + "\tünïcode ✓ \r\n"
    ids = hf_tokenizer(text)["input_ids"]
    assert ids[0] == hf_tokenizer.bos_token_id
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == text
    chat = hf_tokenizer.apply_chat_template(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert chat == "<|system|>\ns<|end|>\n<|user|>\nu<|end|>\n<|assistant|>\n"


def test_held_out_files_are_not_in_train_split(split_manifest: dict) -> None:
    """Recomputing the split from each listed path puts it in its held-out split, never in train."""
    eval_paths = set(split_manifest[SPLIT_EVAL])
    calib_paths = set(split_manifest[SPLIT_CALIBRATION])
    assert eval_paths and calib_paths
    assert not eval_paths & calib_paths
    assert all(assign_split(p) == SPLIT_EVAL for p in eval_paths)
    assert all(assign_split(p) == SPLIT_CALIBRATION for p in calib_paths)
    assert not any(assign_split(p) == SPLIT_TRAIN for p in eval_paths | calib_paths)


def test_split_manifest_matches_local_stdlib(split_manifest: dict) -> None:
    """On the interpreter the checkpoint was built with, the manifest is exactly the recomputed split."""
    if split_manifest["python_version"] != python_version():
        pytest.skip(f"checkpoint built on Python {split_manifest['python_version']}, running {python_version()}")
    files, _ = collect_stdlib_files(stdlib_root())
    splits = split_files(files)
    assert [f.rel_path for f in splits[SPLIT_EVAL]] == split_manifest[SPLIT_EVAL]
    assert [f.rel_path for f in splits[SPLIT_CALIBRATION]] == split_manifest[SPLIT_CALIBRATION]
    train_texts = {f.text for f in splits[SPLIT_TRAIN]}
    held_out_texts = {f.text for f in splits[SPLIT_EVAL] + splits[SPLIT_CALIBRATION]}
    assert not train_texts & held_out_texts


def test_calibration_jsonl_parses() -> None:
    """Each calibration line is a JSON object with a non-empty ``text`` string; the file is about 1 MB at most."""
    path = MODEL_DIR / "calibration.jsonl"
    assert path.stat().st_size <= 1_100_000
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert len(records) >= 50
    for rec in records:
        assert isinstance(rec["text"], str) and rec["text"].strip()
        assert len(rec["text"]) < 20_000


def test_eval_perplexity_beats_uniform_baseline(model, hf_tokenizer, config: dict) -> None:
    """A trained model scores held-out stdlib code far better than guessing (uniform ppl = vocab size), and at the
    level the retrained model reached: 36.8 on these two windows (the first bundled model, 165)."""
    text = (MODEL_DIR / "eval.txt").read_text(encoding="utf-8")[:20_000]
    ids = hf_tokenizer(text, return_tensors="pt")["input_ids"][0]
    assert ids.numel() >= SEQ_LEN * N_WINDOWS
    windows = ids[: SEQ_LEN * N_WINDOWS].view(N_WINDOWS, SEQ_LEN)
    with torch.no_grad():
        loss = model(input_ids=windows, labels=windows).loss.item()
    ppl = math.exp(loss)
    assert ppl < 50, ppl


def test_training_metrics_recorded() -> None:
    """The training record carries the measured numbers the README quotes."""
    metrics = json.loads((MODEL_DIR / "training_metrics.json").read_text(encoding="utf-8"))
    assert metrics["train"]["steps"] > 0 and metrics["train"]["train_seconds"] > 0
    assert 1.0 < metrics["eval"]["eval_split_ppl"] < 20  # 15.68 (models/README.md)
    assert metrics["eval"]["eval_split_tokens"] >= 50_000
    assert len(metrics["samples"]) == 3


DRAFT_DIR = MODEL_DIR.parent / "pystdlib-llama-draft"


def test_draft_model_shares_the_tokenizer_and_proposes_the_target_tokens(model) -> None:
    """The bundled draft (builder.devtools.train_draft): the target's tokenizer byte for byte, its vocabulary, under
    2 MB of weights, and on held-out text its top token is often the target's (the training run's figure is 0.54
    over 32,768 held-out positions, 0.46 on the 511 scored here; an untrained draft's 0.01)."""
    from transformers import AutoModelForCausalLM

    assert (DRAFT_DIR / "tokenizer.json").read_bytes() == (MODEL_DIR / "tokenizer.json").read_bytes()
    assert (DRAFT_DIR / "model.safetensors").stat().st_size < 2 * 1024 * 1024
    draft = AutoModelForCausalLM.from_pretrained(DRAFT_DIR, dtype=torch.float32).eval()
    assert draft.config.vocab_size == model.config.vocab_size
    metrics = json.loads((DRAFT_DIR / "training_metrics.json").read_text())
    assert metrics["held_out"]["trained"]["top1_agreement"] > 0.5
    from tokenizers import Tokenizer

    text = (MODEL_DIR / "eval.txt").read_text()[:6000]
    ids = torch.tensor([Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json")).encode(text).ids[:512]])
    with torch.no_grad():
        same = (draft(input_ids=ids).logits.argmax(-1) == model(input_ids=ids).logits.argmax(-1)).float().mean()
    assert same > 0.4, f"the draft's top token is the target's at {same:.2f} of the positions"
