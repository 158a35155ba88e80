"""`builder bench latency --batch-size N`: the decode step time of N sequences decoded together, which steps it
counts, and the figures it records beside the stock-PyTorch baseline's."""

from __future__ import annotations

import json

import pytest
import torch

from builder.bench.offline import decode_steps, load_for_bench, steady_step_seconds
from runtime.outputs import RequestOutput


def _out(request_id: str, num_tokens: int = 1, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id, "", [7] * num_tokens, None, finished, "length" if finished else None, 4, 0)


def test_steady_steps_leave_out_prefill_first_decode_and_last():
    # overlapped pipeline: prefill, a call that only launches the first graph step, then one token per call
    calls = [(1.0, [_out("a"), _out("b")]),  # prefill: first tokens
             (1.5, []),  # launches decode step 1
             (3.0, [_out("a"), _out("b")]),  # decode step 1's tokens: not measured
             (5.0, [_out("a"), _out("b")]),  # decode step 2: 2.0
             (8.0, [_out("b"), _out("a")]),  # decode step 3: 3.0
             (9.0, [_out("a", finished=True), _out("b", finished=True)])]  # last: not measured
    assert steady_step_seconds(calls, 2) == [2.0, 3.0]


def test_steady_steps_need_every_sequence_in_the_step():
    calls = [(1.0, [_out("a")]),  # a's prefill
             (2.0, [_out("a"), _out("b")]),  # mixed: a decodes, b's prefill ends
             (4.0, [_out("a"), _out("b")]),  # b's first decode step
             (5.0, [_out("a")]),  # b left out of the step
             (7.0, [_out("a"), _out("b")]),  # full, but the call before was not
             (10.0, [_out("a"), _out("b")]),  # measured: 3.0
             (11.0, [_out("a", 2), _out("b")]),  # two tokens for a: not one step
             (12.0, [_out("a"), _out("b")])]
    assert steady_step_seconds(calls, 2) == [3.0]
    assert steady_step_seconds(calls[:6], 3) == []  # a third request never got a token


def test_decode_steps_run_every_sequence_together(artifacts):
    engine = load_for_bench(str(artifacts["llama"]), "cpu", max_num_seqs=4, max_seq_len=None,
                            max_num_batched_tokens=None, cuda_graphs=True)
    try:
        for batch_size in (2, 4):
            before = engine.num_steps
            r = decode_steps(engine, batch_size, input_len=8, output_len=6, repeats=1)
            # warm-up (prefill + 3 decode steps), then one prefill and 5 decode steps of all the sequences:
            # a sequence outside a step would add steps
            assert engine.num_steps - before == 4 + 6
            assert (r.batch_size, r.input_len, r.output_len, r.num_steps) == (batch_size, 8, 6, 3)
            assert r.decode_step_ms > 0 and r.tok_s == pytest.approx(batch_size * 1e3 / r.decode_step_ms)
        with pytest.raises(ValueError, match="max_num_seqs 4"):
            decode_steps(engine, 5, input_len=8, output_len=6)
    finally:
        engine.close()


def test_bench_latency_records_decode_step_figures_beside_the_baseline(artifacts, checkpoints, tmp_path):
    from typer.testing import CliRunner

    from builder.cli import app

    record, results = tmp_path / "benchmarks.jsonl", tmp_path / "results.jsonl"
    res = CliRunner().invoke(app, ["bench", "latency", str(artifacts["llama"]), "--device", "cpu", "--input-len", "8",
                                   "--output-len", "5", "--repeats", "1", "--batch-size", "2", "--batch-size", "2",
                                   "--baseline", str(checkpoints["llama"]), "--record", str(record),
                                   "--json", str(results)])
    assert res.exit_code == 0, res.output
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert [(x["figure"], x["unit"]) for x in lines] == [
        ("decode_b1_fp32_in8", "tok/s"), ("ttft_8_fp32", "ms"),
        ("decode_step_b2_fp32_in8", "ms"),  # a batch size given twice is measured once
        ("baseline_decode_b1_fp32_in8", "tok/s"), ("baseline_ttft_8_fp32", "ms"),
        ("baseline_decode_step_b2_fp32_in8", "ms")]
    assert all(x["value"] > 0 and x["command"].endswith("--batch-size 2 --baseline " + str(checkpoints["llama"]))
               for x in lines)
    stock = [json.loads(line) for line in res.output.splitlines() if line.startswith('{"baseline"')]
    assert [s.get("batch_size") for s in stock] == [None, 2]
    assert stock[1]["ratio"] == pytest.approx(stock[1]["decode_step_ms"] / stock[1]["ours_decode_step_ms"], rel=1e-2)
    ours = {x["figure"]: x["value"] for x in lines}
    table = res.output[res.output.index("decode step, 8-token prompts"):].splitlines()
    assert table[1].split() == ["batch", "ms/step", "tok/s", "baseline", "ms/step", "ratio"]
    row = [float(v) for v in table[2].split()]
    assert row[:2] == [2, pytest.approx(ours["decode_step_b2_fp32_in8"], abs=1e-3)]
    assert row[3:] == [pytest.approx(ours["baseline_decode_step_b2_fp32_in8"], abs=1e-3),
                       pytest.approx(ours["baseline_decode_step_b2_fp32_in8"] / ours["decode_step_b2_fp32_in8"],
                                     abs=0.01)]
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r.get("batch_size") for r in rows] == [None, 2]  # --json: the batch-1 row, then one per batch size


def _latency_batch_2_fails(artifacts, record):
    """``bench latency --batch-size 2 --record`` on the CPU, expected to fail in its batch-2 part: the result,
    after checking that it exited 1 with the batch-1 figures recorded."""
    from typer.testing import CliRunner

    from builder.cli import app

    res = CliRunner().invoke(app, ["bench", "latency", str(artifacts["llama"]), "--device", "cpu", "--input-len", "8",
                                   "--output-len", "4", "--repeats", "1", "--batch-size", "2", "--record", str(record)])
    assert res.exit_code == 1
    assert [json.loads(line)["figure"] for line in record.read_text().splitlines()] == ["decode_b1_fp32_in8",
                                                                                       "ttft_8_fp32"]
    return res


def test_bench_latency_records_batch_1_figures_when_a_decode_step_run_fails(artifacts, tmp_path, monkeypatch):
    import builder.bench.offline

    def fail(engine, batch_size, *args):
        raise RuntimeError("no decode step of all 2 sequences together was measured")

    monkeypatch.setattr(builder.bench.offline, "decode_steps", fail)
    record = tmp_path / "benchmarks.jsonl"
    res = _latency_batch_2_fails(artifacts, record)
    assert "error: decode step at batch 2, 8-token prompts: no decode step of all 2" in res.output


def test_bench_latency_records_batch_1_figures_when_the_batch_engine_cannot_load(artifacts, tmp_path, monkeypatch):
    """The batch-N engine is a second load (max_num_seqs = the largest N): when it fails (no memory plan, out of
    memory), the batch-1 figures already measured are still recorded."""
    import builder.bench.offline
    from runtime.memory import MemoryPlanError

    real = builder.bench.offline.load_for_bench

    def load(artifact, device, *, max_num_seqs, **kwargs):
        if max_num_seqs > 1:
            raise MemoryPlanError("no KV cache for 2 sequences in this budget")
        return real(artifact, device, max_num_seqs=max_num_seqs, **kwargs)

    monkeypatch.setattr(builder.bench.offline, "load_for_bench", load)
    record = tmp_path / "benchmarks.jsonl"
    res = _latency_batch_2_fails(artifacts, record)
    assert "for batch 2: no KV cache for 2 sequences" in res.output


def test_bench_throughput_records_the_best_point_and_each_concurrency(artifacts, tmp_path):
    from typer.testing import CliRunner

    from builder.cli import app

    record, results = tmp_path / "benchmarks.jsonl", tmp_path / "results.jsonl"
    res = CliRunner().invoke(app, ["bench", "throughput", str(artifacts["llama"]), "--device", "cpu", "--input-len",
                                   "8", "--output-len", "4", "--concurrency", "1", "--concurrency", "2",
                                   "--num-prompts", "2", "--record", str(record), "--json", str(results)])
    assert res.exit_code == 0, res.output
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert [(x["figure"], x["unit"]) for x in lines] == [
        ("throughput_8_4_fp32", "tok/s"), ("throughput_8_4_fp32_c1", "tok/s"), ("preemptions_8_4_fp32_c1", "count"),
        ("throughput_8_4_fp32_c2", "tok/s"), ("preemptions_8_4_fp32_c2", "count")]
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    figures = {x["figure"]: x["value"] for x in lines}
    assert [r["concurrency"] for r in rows] == [1, 2]
    for r in rows:  # the recorded figures are the measured points
        assert figures[f"throughput_8_4_fp32_c{r['concurrency']}"] == pytest.approx(r["output_tok_s"], abs=1e-3)
        assert figures[f"preemptions_8_4_fp32_c{r['concurrency']}"] == r["num_preemptions"]
    assert figures["throughput_8_4_fp32"] == max(figures["throughput_8_4_fp32_c1"], figures["throughput_8_4_fp32_c2"])
    assert all(x["command"].endswith("--concurrency 1 --concurrency 2 --num-prompts 2") for x in lines)


def test_bench_block_size_is_run_and_recorded(artifacts, tmp_path, monkeypatch):
    """--tokens-per-block (or $RUNTIME_TOKENS_PER_BLOCK) sets the engine's KV block size, and the recorded command
    says which, as a flag or as the environment's setting; a block size that is not a power of two fails cleanly."""
    from typer.testing import CliRunner

    import runtime.serving as serving
    from builder.cli import app

    sizes = []
    real = serving.ServingEngine.__init__

    def spy(self, *args, **kwargs):
        real(self, *args, **kwargs)
        sizes.append(self.block_size)

    monkeypatch.setattr(serving.ServingEngine, "__init__", spy)
    base = ["bench", "throughput", str(artifacts["llama"]), "--device", "cpu", "--input-len", "8", "--output-len",
            "4", "--concurrency", "2", "--num-prompts", "2"]
    record = tmp_path / "flag.jsonl"
    res = CliRunner().invoke(app, base + ["--tokens-per-block", "32", "--record", str(record)])
    assert res.exit_code == 0, res.output
    assert sizes == [32]
    assert all(json.loads(x)["command"].endswith("--num-prompts 2 --tokens-per-block 32")
               for x in record.read_text().splitlines())
    monkeypatch.setenv("RUNTIME_TOKENS_PER_BLOCK", "8")
    record = tmp_path / "env.jsonl"
    res = CliRunner().invoke(app, base + ["--record", str(record)])
    assert res.exit_code == 0, res.output
    assert sizes == [32, 8]
    assert all(json.loads(x)["command"].startswith("RUNTIME_TOKENS_PER_BLOCK=8 builder bench throughput ")
               for x in record.read_text().splitlines())
    res = CliRunner().invoke(app, base + ["--tokens-per-block", "48"])
    assert res.exit_code != 0 and "tokens_per_block 48 must be a power of two" in res.output


def test_bench_throughput_with_and_without_speculation(artifacts, tmp_path):
    """--speculative-ngram K runs each point twice and records the pair's ratio and the acceptance, from the
    measured rows (issue 21: spec_throughput_ratio_cC), and each point, but not the headline best point."""
    from typer.testing import CliRunner

    from builder.cli import app

    record, results = tmp_path / "benchmarks.jsonl", tmp_path / "results.jsonl"
    res = CliRunner().invoke(app, ["bench", "throughput", str(artifacts["llama"]), "--device", "cpu", "--input-len",
                                   "8", "--output-len", "6", "--concurrency", "2", "--num-prompts", "2",
                                   "--speculative-ngram", "3", "--record", str(record), "--json", str(results)])
    assert res.exit_code == 0, res.output
    figures = {x["figure"]: x["value"] for x in map(json.loads, record.read_text().splitlines())}
    plain, spec = [json.loads(line) for line in results.read_text().splitlines()]
    assert plain["spec_draft_tokens"] == 0
    assert figures["throughput_8_6_fp32_spec_c2"] == pytest.approx(spec["output_tok_s"], abs=1e-3)
    assert figures["spec_throughput_ratio_c2"] == pytest.approx(spec["output_tok_s"] / plain["output_tok_s"], rel=1e-3)
    expected = spec["spec_accepted_tokens"] / spec["spec_draft_tokens"] if spec["spec_draft_tokens"] else 0.0
    assert figures["spec_acceptance_c2"] == pytest.approx(expected, abs=1e-3)
    assert figures["throughput_8_6_fp32_c2"] == pytest.approx(plain["output_tok_s"], abs=1e-3)
    assert "throughput_8_6_fp32" not in figures  # the headline belongs to plain sweeps


@pytest.fixture(scope="module")
def moe_artifact(tmp_path_factory):
    """The tiny Qwen3-MoE preset (2 layers of 8 experts, 2 per token), fp32, built."""
    from conftest import build_artifact

    from builder.devtools.make_checkpoint import PRESETS, make_checkpoint

    root = tmp_path_factory.mktemp("moe")
    ckpt = make_checkpoint(root / "ckpt", PRESETS["tiny-moe"], dtype=torch.float32)
    return build_artifact(ckpt, root / "artifact")


def test_decode_reads_the_routed_experts_only(moe_artifact):
    """A batch-1 decode step of a mixture of experts reads every weight but the experts, and of each layer's experts
    the top_k a token is routed to: the latency figure's roofline is computed from that byte count."""
    from builder.bench.offline import decode_weight_bytes, latency
    from builder.devtools.make_checkpoint import PRESETS

    s = PRESETS["tiny-moe"]
    h, e, k, i = s.hidden_size, s.num_experts, s.num_experts_per_tok, s.moe_intermediate_size
    attention = h * s.num_attention_heads * s.head_dim * 2 + h * s.num_key_value_heads * s.head_dim * 2
    norms = 2 * h + 2 * s.head_dim
    per_layer = attention + norms + e * h + k * 3 * h * i  # the router whole, top_k of the experts
    # + embedding, lm_head, final norm and the rotary frequencies
    expected = 4 * (2 * s.vocab_size * h + s.num_hidden_layers * per_layer + h + s.head_dim // 2)
    engine = load_for_bench(str(moe_artifact), "cpu", max_num_seqs=1, max_seq_len=None, max_num_batched_tokens=None,
                            cuda_graphs=True)
    try:
        params = engine.executor.params
        everything = sum(t.numel() * t.element_size() for t in params.values())
        assert everything == expected + 4 * s.num_hidden_layers * (e - k) * 3 * h * i  # all experts are stored
        assert decode_weight_bytes(engine.executor.graph, params) == expected
        r = latency(engine, input_len=4, output_len=4, repeats=1)
        assert r.weight_bytes == expected
        mean_context = 4 + 4 / 2
        read = expected + r.kv_bytes_per_token * mean_context
        assert r.roofline_tok_s == pytest.approx(r.bandwidth_gb_s * 1e9 / read)
    finally:
        engine.close()


def test_moe_figures_are_named_moe(moe_artifact, artifacts, tmp_path):
    """`bench latency --record` and `bench throughput --record` name a mixture-of-experts model's figures with the
    moe_ infix (issue 19: decode_b1_moe_{precision}, throughput_128_128_moe_{precision}); a dense model's keep
    theirs."""
    from typer.testing import CliRunner

    from builder.bench.record import figure_tag
    from builder.cli import app

    record = tmp_path / "benchmarks.jsonl"
    runner = CliRunner()
    res = runner.invoke(app, ["bench", "latency", str(moe_artifact), "--device", "cpu", "--input-len", "8",
                              "--output-len", "4", "--repeats", "1", "--record", str(record)])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["bench", "throughput", str(moe_artifact), "--device", "cpu", "--input-len", "8",
                              "--output-len", "4", "--concurrency", "2", "--num-prompts", "2", "--record", str(record)])
    assert res.exit_code == 0, res.output
    assert [json.loads(line)["figure"] for line in record.read_text().splitlines()] == [
        "decode_b1_moe_fp32_in8", "ttft_8_moe_fp32", "throughput_8_4_moe_fp32", "throughput_8_4_moe_fp32_c2",
        "preemptions_8_4_moe_fp32_c2"]
    graph = json.loads((artifacts["llama"] / "graph.json").read_text())
    manifest = json.loads((artifacts["llama"] / "manifest.json").read_text())
    assert figure_tag(graph, manifest) == "fp32"
    assert figure_tag(graph, {**manifest, "quantization": {"lm_head": "fp8"}}) == "fp32_qhead"
    # a quantized KV cache names its figures apart: the same weights with a bf16 cache are another artifact
    assert figure_tag(graph, {**manifest, "runtime": {**manifest["runtime"], "kv_cache_dtype": "fp8"}}) == "fp32_kvfp8"
    # quantized linears beside experts left in the model dtype say so; quantized experts are the default name
    linear = {"op": "linear", "attrs": {"quant": {"scheme": "fp8"}}}
    moe = {"op": "moe", "attrs": {}}
    fp8 = {**manifest, "quantization": {"algo": "fp8", "lm_head": "none"}}
    tag = figure_tag({"nodes": [linear, moe]}, fp8)
    assert tag.startswith("moe_") and tag.endswith("_float_experts")
    assert not figure_tag({"nodes": [linear, {"op": "moe", "attrs": {"quant": {"scheme": "fp8"}}}]},
                          fp8).endswith("_float_experts")
    # calibrated (static) activation scales name their figures apart from per-token ones
    static = {"op": "linear", "attrs": {"quant": {"scheme": "fp8", "activations": "static"}}}
    kv = {**fp8, "runtime": {**manifest["runtime"], "kv_cache_dtype": "fp8"}}
    assert figure_tag({"nodes": [static]}, kv) == "fp8_static_kvfp8"
    assert figure_tag({"nodes": [{"op": "linear", "attrs": {"quant": {"scheme": "fp8", "activations": "dynamic"}}}]},
                      kv) == "fp8_kvfp8"


def test_figures_name_fast_fp8_accumulation(monkeypatch):
    from builder.bench.record import figure_tag

    monkeypatch.delenv("RUNTIME_FP8_FAST_ACCUM", raising=False)
    fp8 = {"op": "linear", "attrs": {"quant": {"scheme": "fp8", "activations": "static"}}}
    fast = {"model": {"dtype": "bfloat16"}, "quantization": {"algo": "fp8", "lm_head": "none"},
            "runtime": {"kv_cache_dtype": "fp8", "fp8_accumulation": "fast"}}
    promoted = {**fast, "runtime": {"kv_cache_dtype": "fp8", "fp8_accumulation": "promoted"}}
    older = {**fast, "runtime": {"kv_cache_dtype": "fp8"}}  # a manifest from before the setting: promoted
    assert figure_tag({"nodes": [fp8]}, fast) == "fp8_static_kvfp8_fastacc"
    assert figure_tag({"nodes": [fp8]}, promoted) == figure_tag({"nodes": [fp8]}, older) == "fp8_static_kvfp8"
    # the process's override (A/B runs of one artifact) names what ran
    monkeypatch.setenv("RUNTIME_FP8_FAST_ACCUM", "1")
    assert figure_tag({"nodes": [fp8]}, promoted) == "fp8_static_kvfp8_fastacc"
    int8 = {"op": "linear", "attrs": {"quant": {"scheme": "w8a8_int8"}}}  # no FP8 GEMM: nothing to name
    assert figure_tag({"nodes": [int8]}, fast) == "int8_kvfp8"
    fp32 = {**fast, "model": {"dtype": "float32"}}  # FP8 linears on fp32 activations run the reference arithmetic
    assert figure_tag({"nodes": [fp8]}, fp32) == "fp8_static_kvfp8"
    experts = {"op": "moe", "attrs": {"quant": {"scheme": "fp8"}}}  # the fused MoE kernels, not cuBLAS
    assert not figure_tag({"nodes": [int8, experts]}, fast).endswith("_fastacc")
    monkeypatch.setenv("RUNTIME_FP8_FAST_ACCUM", "0")
    assert figure_tag({"nodes": [fp8]}, fast) == "fp8_static_kvfp8"
    monkeypatch.setenv("RUNTIME_FP8_FAST_ACCUM", "yes")
    with pytest.raises(ValueError, match="RUNTIME_FP8_FAST_ACCUM='yes'"):
        figure_tag({"nodes": [fp8]}, fast)
