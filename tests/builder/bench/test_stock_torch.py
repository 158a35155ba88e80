"""The stock-PyTorch baseline computes the model it claims to: logits equal Hugging Face's, greedy tokens too at
batch 1 and per row at batch N, its int8 and int4 linears stay close to the float model, and its command prints
one JSON line."""

from __future__ import annotations

import json

import pytest
import torch

from builder.bench.stock_torch import (Int4TinygemmLinear, Int8WeightOnlyLinear, LlamaShape, StockModelError,
                                       generate, load_stock_model, main, quantize_int4_groups, rope_inv_freq)
from tests.conftest import hf_logits, make_checkpoint


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    # in_features multiples of 128 so every linear fits int4 groups of 128
    return make_checkpoint(tmp_path_factory.mktemp("stock") / "llama", "llama", seed=3, hidden_size=128,
                           intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefill_and_decode_match_hugging_face(llama):
    model = load_stock_model(llama, "bf16", "cpu", max_seq_len=32, dtype=torch.float32)
    ids = _ids(12, model.shape.vocab_size, 0)
    ref = hf_logits(llama, ids)  # [12, vocab]
    with torch.inference_mode():
        prefill = model(torch.tensor([ids[:8]]), torch.arange(8))
        steps = [model(torch.tensor([[t]]), torch.tensor([8 + i])) for i, t in enumerate(ids[8:])]
    torch.testing.assert_close(prefill[0], ref[7], atol=1e-4, rtol=1e-4)
    for i, logits in enumerate(steps):
        torch.testing.assert_close(logits[0], ref[8 + i], atol=1e-4, rtol=1e-4)


def test_llama3_rope_frequencies_match_hugging_face(llama):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.from_pretrained(llama)
    shape = LlamaShape.from_config(json.loads((llama / "config.json").read_text()))
    assert shape.rope_scaling is not None  # the fixture's llama uses llama3 scaling
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    torch.testing.assert_close(rope_inv_freq(shape), ref.float())


@pytest.mark.parametrize("quant, min_cosine", [("int8wo", 0.999), ("int4", 0.9)])
def test_quantized_linears_stay_close(llama, quant, min_cosine):
    ids = torch.tensor([_ids(16, 300, 1)])
    with torch.inference_mode():
        ref = load_stock_model(llama, "bf16", "cpu", 32, torch.float32)(ids, torch.arange(16))
        got = load_stock_model(llama, quant, "cpu", 32, torch.float32)(ids, torch.arange(16))
    cosine = torch.nn.functional.cosine_similarity(got, ref).item()
    assert min_cosine < cosine < 1 - 1e-7, f"{quant}: cosine {cosine} (must be close, and not the float model)"


def test_int4_linear_is_the_dequantized_matmul():
    """tinygemm's result equals a float matmul with the weight its groups encode: (q - 8) * scale + zero."""
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(32, 256, generator=g), torch.randn(3, 256, generator=g)
    layer = Int4TinygemmLinear(w)
    codes, scales_and_zeros = quantize_int4_groups(w, 128)
    scale, zero = scales_and_zeros.float().unbind(-1)
    dequant = ((codes.float().view(32, 2, 128) - 8) * scale.t()[..., None] + zero.t()[..., None]).view(32, 256)
    ref = x.bfloat16().float() @ dequant.t()
    torch.testing.assert_close(layer(x), ref, atol=0.05 * ref.abs().max().item(), rtol=0)
    assert (layer(x) - x @ w.t()).abs().max() > 1e-3  # and it is not the float weight


def test_int8_linear_is_the_dequantized_matmul():
    g = torch.Generator().manual_seed(6)
    w, x = torch.randn(32, 64, generator=g), torch.randn(3, 64, generator=g)
    layer = Int8WeightOnlyLinear(w)
    torch.testing.assert_close(layer(x), x @ (layer.weight.float() * layer.scale[:, None]).t())
    assert (layer.weight.float() * layer.scale[:, None] - w).abs().max() <= w.abs().amax() / 127


def test_int4_groups_reconstruct_within_half_a_step():
    w = torch.randn(16, 256, generator=torch.Generator().manual_seed(4))
    codes, scales_and_zeros = quantize_int4_groups(w, 128)
    scale, zero = scales_and_zeros.float().unbind(-1)  # [groups, out] each
    back = (codes.float().view(16, 2, 128) - 8) * scale.t()[..., None] + zero.t()[..., None]
    assert codes.min() >= 0 and codes.max() <= 15
    step = scale.t()[..., None].expand(16, 2, 128)
    assert ((back - w.view(16, 2, 128)).abs() <= 0.5 * step + 2e-2 * w.abs().amax()).all()


def test_greedy_generation_equals_hugging_face(llama):
    from transformers import AutoModelForCausalLM

    model = load_stock_model(llama, "bf16", "cpu", 32, torch.float32)
    prompt = torch.tensor([_ids(6, model.shape.vocab_size, 2)])
    with torch.inference_mode():
        _, tokens = generate(model, model, model, prompt, 8)
        hf = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32)
        ref = hf.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, 6:]
    assert tokens[0].tolist() == ref.tolist()


def _hf_greedy(hf, prompt: torch.Tensor, num_new: int) -> list[int]:
    """HF's greedy continuation of ``prompt`` [n], EOS included (generate's min_new_tokens would mask it)."""
    ids = prompt[None]
    for _ in range(num_new):
        ids = torch.cat((ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    return ids[0, len(prompt):].tolist()


def test_batched_greedy_generation_equals_hugging_face_per_row(llama):
    """Batch N: N prompts in a static cache of N rows, decoded together; each row's tokens are HF's for that
    prompt alone, and with time_steps every decode step is timed."""
    from transformers import AutoModelForCausalLM

    model = load_stock_model(llama, "bf16", "cpu", 32, torch.float32, batch_size=3)
    prompts = torch.tensor([_ids(6, model.shape.vocab_size, seed) for seed in (7, 8, 9)])
    with torch.inference_mode():
        times, tokens = generate(model, model, model, prompts, 8, time_steps=True)
        hf = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32)
        refs = [_hf_greedy(hf, row, 8) for row in prompts]
    assert tokens.shape == (3, 8) and len(times) == 8  # after the prefill's token, then after each decode step
    assert tokens.tolist() == refs
    assert len({tuple(r) for r in refs}) == 3  # the rows differ: a row mix-up would show


def test_command_prints_one_json_line(llama, capsys):
    assert main([str(llama), "--device", "cpu", "--no-compile", "--input-len", "8", "--output-len", "4",
                 "--repeats", "1", "--quant", "int8wo"]) == 0
    result = json.loads(capsys.readouterr().out.strip())
    assert result["baseline"] == "stock-torch-int8wo" and result["decode_tok_s"] > 0 and result["ttft_ms"] > 0


def test_command_at_batch_n_prints_the_decode_step(llama, capsys):
    assert main([str(llama), "--device", "cpu", "--no-compile", "--input-len", "8", "--output-len", "5",
                 "--repeats", "1", "--quant", "int4", "--batch-size", "3"]) == 0
    result = json.loads(capsys.readouterr().out.strip())
    assert result["baseline"] == "stock-torch-int4" and result["batch_size"] == 3 and result["decode_step_ms"] > 0
    assert result["decode_tok_s"] == pytest.approx(3e3 / result["decode_step_ms"], rel=1e-2)


@pytest.mark.parametrize("argv, message", [(["--batch-size", "0"], "--batch-size 0"),
                                           (["--batch-size", "2", "--output-len", "2"], "--output-len 2")])
def test_command_refuses_bad_batch_settings(llama, capsys, argv, message):
    with pytest.raises(SystemExit):
        main([str(llama), "--device", "cpu", "--no-compile", *argv])
    assert message in capsys.readouterr().err


def test_refuses_other_families(tmp_path):
    path = make_checkpoint(tmp_path / "qwen2", "qwen2")
    with pytest.raises(StockModelError, match="plain Llama"):
        load_stock_model(path, "bf16", "cpu")


def test_bench_latency_runs_the_baseline_and_records_figures(artifacts, checkpoints, tmp_path):
    """`builder bench latency --baseline CKPT --record FILE`: our figure, the baseline's and the ratio, and
    one record line per figure."""
    from typer.testing import CliRunner

    from builder.cli import app

    record = tmp_path / "benchmarks.jsonl"
    res = CliRunner().invoke(app, ["bench", "latency", str(artifacts["llama"]), "--device", "cpu", "--input-len", "8",
                                   "--output-len", "4", "--repeats", "1", "--baseline", str(checkpoints["llama"]),
                                   "--record", str(record)])
    assert res.exit_code == 0, res.output
    stock = [json.loads(line) for line in res.output.splitlines() if '"stock-torch-bf16"' in line]
    assert len(stock) == 1 and stock[0]["ratio"] == pytest.approx(stock[0]["ours_decode_tok_s"]
                                                                 / stock[0]["decode_tok_s"], rel=1e-2)
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert [x["figure"] for x in lines] == ["decode_b1_fp32_in8", "ttft_8_fp32", "baseline_decode_b1_fp32_in8",
                                           "baseline_ttft_8_fp32"]
    assert all(x["value"] > 0 and x["device"].startswith("cpu") and x["versions"]["torch"] and x["date"]
               and "bench latency" in x["command"] for x in lines)
