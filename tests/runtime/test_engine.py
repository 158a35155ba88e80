"""The engine against the Hugging Face model: greedy generation, chunked prefill, packed batches; penalties
and logprobs against the engine's own full-sequence logits."""

from __future__ import annotations

import logging

import pytest
import torch

from conftest import FAMILIES, hf_logits
from runtime import Engine, RequestError, SamplingParams
from runtime.engine import DeviceError, resolve_device
from runtime.executor import SeqSlice, StepInput
from runtime.kv_cache import SequenceKV


def _hf_greedy(path, prompt_ids, n):
    """Greedy tokens from the HF model, re-running the whole sequence each step (no cache)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_hf(family, checkpoints, artifacts):
    engine = Engine.load(artifacts[family])
    prompt = engine.tokenizer.encode("def fibonacci(n):")
    ours = engine.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True))
    assert ours.token_ids == _hf_greedy(checkpoints[family], prompt, 24)
    assert ours.finish_reason == "length"


def test_logits_match_hf_on_fresh_random_input(checkpoints, artifacts):
    engine = Engine.load(artifacts["qwen3"])
    ids = torch.randint(3, 320, (40,)).tolist()
    assert (engine.logits(ids) - hf_logits(checkpoints["qwen3"], ids)).abs().max() < 1e-4


def test_chunked_prefill_equals_one_shot(artifacts):
    engine = Engine.load(artifacts["llama"])  # max_num_tokens = 64
    ids = torch.randint(3, 320, (150,)).tolist()  # three chunks
    chunked = engine.logits(ids)
    kv = SequenceKV(engine.kv_layout, 150)
    inp = StepInput(torch.tensor(ids), torch.arange(150), [SeqSlice(kv, 0, 150)])
    assert torch.allclose(chunked, engine.executor.forward(inp), atol=1e-5)


def test_packed_batch_equals_sequences_one_at_a_time(artifacts):
    """Prefill of one sequence packed with the decode of another gives each its own logits."""
    engine = Engine.load(artifacts["mistral"])
    a = torch.randint(3, 320, (20,)).tolist()
    b = torch.randint(3, 320, (9,)).tolist()
    alone_a, alone_b = engine.logits(a), engine.logits(b)
    kv_a, kv_b = SequenceKV(engine.kv_layout, 32), SequenceKV(engine.kv_layout, 32)
    # step 1: a's first 19 tokens alone; step 2: a's last token (decode) packed with all of b (prefill)
    engine.executor.forward(StepInput(torch.tensor(a[:19]), torch.arange(19), [SeqSlice(kv_a, 0, 19)]))
    ids = torch.tensor(a[19:] + b)
    pos = torch.cat([torch.tensor([19]), torch.arange(9)])
    out = engine.executor.forward(StepInput(ids, pos, [SeqSlice(kv_a, 19, 1), SeqSlice(kv_b, 0, 9)]))
    assert torch.allclose(out[0], alone_a[19], atol=1e-5)
    assert torch.allclose(out[1:], alone_b, atol=1e-5)


def test_stop_string_and_seeded_sampling(artifacts):
    engine = Engine.load(artifacts["llama"])
    greedy = engine.generate("def", SamplingParams(max_tokens=20, ignore_eos=True))
    assert len(greedy.text) > 3
    stop = greedy.text[2:4]
    stopped = engine.generate("def", SamplingParams(max_tokens=20, ignore_eos=True, stop=[stop]))
    assert stopped.finish_reason == "stop" and stop not in stopped.text
    assert greedy.text.startswith(stopped.text)
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    assert engine.generate("import", p).token_ids == engine.generate("import", p).token_ids


def num_repeats(token_ids: list[int]) -> int:
    return len(token_ids) - len(set(token_ids))


def test_repetition_penalty_reduces_repeats(artifacts):
    """Each greedy token is the argmax of the penalized logits at its position (recomputed as one
    sequence, penalties written plainly); the tiny model loops without the penalty and not with it."""
    engine = Engine.load(artifacts["qwen3"])
    prompt = engine.tokenizer.encode("def fibonacci(n):")
    plain = engine.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True)).token_ids
    penalty = 3.0
    ours = engine.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True, repetition_penalty=penalty))
    assert num_repeats(plain) >= 20 and num_repeats(ours.token_ids) < num_repeats(plain) // 4
    logits = engine.logits(prompt + ours.token_ids[:-1])[len(prompt) - 1:]  # logits: [40, vocab]
    for step, token in enumerate(ours.token_ids):
        row = logits[step].clone()
        for seen in set(prompt + ours.token_ids[:step]):
            row[seen] = row[seen] / penalty if row[seen] > 0 else row[seen] * penalty
        assert token == int(row.argmax()), f"step {step}"


def test_logprobs_with_alternatives(artifacts):
    engine = Engine.load(artifacts["llama"])
    prompt = engine.tokenizer.encode("import")
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True, logprobs=3)
    out = engine.generate(prompt, params)
    reference = torch.log_softmax(engine.logits(prompt + out.token_ids[:-1])[len(prompt) - 1:], dim=-1)
    assert len(out.top_logprobs) == len(out.token_ids) == 12
    assert out.logprobs == [entry.logprob for entry in out.top_logprobs]
    for step, (token, entry) in enumerate(zip(out.token_ids, out.top_logprobs)):
        assert entry.token_id == token
        assert abs(entry.logprob - float(reference[step, token])) < 1e-4
        assert [t for t, _ in entry.top] == reference[step].topk(3).indices.tolist()
        for alternative, logprob in entry.top:
            assert abs(logprob - float(reference[step, alternative])) < 1e-4
    assert any(entry.top[0][0] != entry.token_id for entry in out.top_logprobs)  # sampled, not always the top
    assert engine.generate(prompt, SamplingParams(max_tokens=2, ignore_eos=True)).top_logprobs is None


def test_prompt_too_long(artifacts):
    engine = Engine.load(artifacts["llama"])
    with pytest.raises(RequestError, match="max_seq_len is 256"):
        engine.generate(list(range(3, 300)))


def test_chat_template(artifacts):
    engine = Engine.load(artifacts["llama"])
    out = engine.chat([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=4, ignore_eos=True))
    rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}])
    assert rendered == "<|user|>\nhello<|end|>\n<|assistant|>\n"
    assert out.prompt_token_ids == engine.tokenizer.encode(rendered, add_special_tokens=False)


# --- devices ----------------------------------------------------------------------------------------------
@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def two_gpus(monkeypatch):
    """This machine as one with two GPUs, as far as resolving a device name goes (nothing is loaded)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_auto_is_the_cpu_without_cuda_and_says_so(no_cuda, caplog):
    with caplog.at_level(logging.INFO, logger="runtime.engine"):
        assert resolve_device("auto") == torch.device("cpu")
    assert "device auto: CUDA is not available, using the CPU" in caplog.text


def test_auto_is_cuda_where_there_is_one(two_gpus, caplog):
    with caplog.at_level(logging.INFO, logger="runtime.engine"):
        assert resolve_device("auto") == torch.device("cuda")
    assert "device auto: CUDA is available, using cuda" in caplog.text
    assert resolve_device() == torch.device("cuda")
    assert resolve_device("cuda") == torch.device("cuda") and resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device(torch.device("cuda", 0)) == torch.device("cuda", 0)
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name, machine, message", [
    ("cuda", "no_cuda", "device 'cuda': CUDA is not available on this machine"),
    ("cuda:0", "no_cuda", "device 'cuda:0': CUDA is not available on this machine"),
    ("cuda:2", "two_gpus", "device 'cuda:2': this machine has 2 CUDA devices (cuda:0 to cuda:1)"),
    ("gpu", "two_gpus", "device 'gpu' is not one of auto, cpu, cuda, cuda:N"),
    ("cuda:x", "two_gpus", "device 'cuda:x' is not one of auto, cpu, cuda, cuda:N"),
    ("", "no_cuda", "device '' is not one of auto, cpu, cuda, cuda:N"),
])
def test_a_device_this_machine_does_not_have_is_an_error(request, name, machine, message):
    request.getfixturevalue(machine)
    with pytest.raises(DeviceError) as info:
        resolve_device(name)
    assert str(info.value).startswith(message)


def test_engine_load_resolves_the_device(artifacts, no_cuda, caplog):
    with caplog.at_level(logging.INFO, logger="runtime.engine"):
        assert Engine.load(artifacts["llama"], device="auto").device == torch.device("cpu")
    assert "using the CPU" in caplog.text
    with pytest.raises(DeviceError, match="CUDA is not available"):
        Engine.load(artifacts["llama"], device="cuda")
