"""The executor on the Triton kernels (paged attention, norms, RoPE, SwiGLU) equals the torch path:
the serving engine with ``use_kernels`` generates the same greedy tokens, with the same logprobs, as the
offline engine on the reference ops. On CPU the kernels run under TRITON_INTERPRET=1."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from conftest import build_artifact, make_checkpoint  # noqa: E402
from runtime import Engine, SamplingParams  # noqa: E402
from runtime.serving import ServingConfig, ServingEngine  # noqa: E402

if os.environ["TRITON_INTERPRET"] != "1":  # their engines run on the CPU: the GPU's checks are check_kernels/cuda_smoke
    pytest.skip("these tests run the kernels on the CPU under TRITON_INTERPRET=1", allow_module_level=True)

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\nclass Config:\n    pass\n" * 2, "for i in range(10):"]


# head_dim 32 (the kernels take 32, 64, 128, 256): GQA group 2; per-head q/k norms; a sliding window; head_dim 256
SHAPES = {
    "llama": dict(num_attention_heads=2, num_key_value_heads=1),
    "qwen3": dict(head_dim=32),
    "mistral": dict(num_attention_heads=2, num_key_value_heads=1, sliding_window=16),
    "qwen3-d256": dict(head_dim=256),  # Gemma's head_dim, on a family the tests build quickly
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_paged_kernels_match_the_reference_path(tmp_path, shape):
    family = shape.split("-")[0]
    path = build_artifact(make_checkpoint(tmp_path / "ckpt", family, **SHAPES[shape]), tmp_path / "art")
    ref = Engine.load(path, use_kernels=False)
    fused = ServingEngine(Engine.load(path, use_kernels=True),
                          ServingConfig(num_blocks=24, max_num_batched_tokens=32, max_seq_len=128))
    assert fused.executor.use_kernels and not ref.executor.use_kernels
    # every layer's RoPE runs inside its attention's KV write (kernels.paged_attention.rope_write_kv_cache)
    assert len(fused.executor._fusions.rope) == fused.executor.num_layers
    prompts = [ref.tokenizer.encode(p) for p in PROMPTS]
    assert max(map(len, prompts)) > 32, "one prompt must be prefilled in chunks"
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0)
    for prompt, out in zip(prompts, fused.run(prompts, params)):
        want = ref.generate(prompt, params)
        assert out.token_ids == want.token_ids
        got = torch.tensor([lp.logprob for lp in out.logprobs])
        assert torch.allclose(got, torch.tensor(want.logprobs), atol=1e-4)
    assert fused.kv.pool.num_free == fused.kv.pool.num_blocks


@pytest.mark.parametrize("shape", ["llama", "mistral", "qwen3"])
def test_fresh_prompts_attend_over_their_own_keys(tmp_path, monkeypatch, shape):
    """RUNTIME_PREFILL_OWN_KV: the eager steps of fresh prompts only run the prefill attention over the step's own
    rotated keys (contiguous rows), the others (a chunk after its context, decodes) over the cache; tokens and
    logprobs equal the cache-only path's exactly (the same values, the same arithmetic). Qwen3's per-head k norm
    makes k a tensor of its own while v stays a view of the QKV projection: rows of different strides."""
    from kernels import paged_attention
    from runtime import executor

    # one layer: the attention's routing is what is under test (test_paged_kernels_match_the_reference_path runs two)
    path = build_artifact(make_checkpoint(tmp_path / "ckpt", shape, num_hidden_layers=1, **SHAPES[shape]),
                          tmp_path / "art")
    calls, real = [], paged_attention.paged_prefill_attention

    def spy(*args, contiguous_kv=None, **kwargs):
        calls.append(contiguous_kv is not None)
        return real(*args, contiguous_kv=contiguous_kv, **kwargs)

    monkeypatch.setattr(paged_attention, "paged_prefill_attention", spy)
    tok = Engine.load(path, use_kernels=False).tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=0)
    runs = {}
    for own in (False, True):
        monkeypatch.setattr(executor, "PREFILL_OWN_KV", own)
        calls.clear()
        engine = ServingEngine(Engine.load(path, use_kernels=True),
                               ServingConfig(num_blocks=24, max_num_batched_tokens=32, max_seq_len=128))
        runs[own] = [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in engine.run(prompts, params)]
        used = sum(calls)
    assert runs[True] == runs[False]
    layers = engine.executor.num_layers
    assert used >= layers and len(calls) > used, (used, len(calls))  # a fresh step's layers; a chunk after context


@pytest.mark.parametrize("shape", ["llama", "mistral"])
def test_mixed_steps_attend_their_decodes_on_the_decode_kernel(tmp_path, monkeypatch, shape):
    """RUNTIME_MIXED_DECODE_SPLIT: steps that mix decodes with prompts (and chunks) run paged_mixed_attention, eagerly
    and as StepGraphs pads them (sequences without new tokens, tokens past the step; a graph of their own), with the
    reference path's greedy tokens and logprobs; steps of prompts alone keep the prefill kernel alone."""
    from kernels import paged_attention
    from runtime import executor
    from runtime.cuda_graphs import StepGraphs

    path = build_artifact(make_checkpoint(tmp_path / "ckpt", shape, num_hidden_layers=1, **SHAPES[shape]),
                          tmp_path / "art")
    ref = Engine.load(path, use_kernels=False)
    calls, plain = [], []  # each step's new tokens per sequence (padding's zeros left out): split, prefill alone
    real_mixed, real_prefill = paged_attention.paged_mixed_attention, paged_attention.paged_prefill_attention

    def q_lens(cu: torch.Tensor) -> list[int]:
        return [n for n in (cu[1:] - cu[:-1]).tolist() if n]

    def spy_mixed(q, k_cache, v_cache, block_tables, cu_seqlens_q, *args, **kwargs):
        calls.append(q_lens(cu_seqlens_q))
        return real_mixed(q, k_cache, v_cache, block_tables, cu_seqlens_q, *args, **kwargs)

    def spy_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, *args, skip_single=False, **kwargs):
        if not skip_single:
            plain.append(q_lens(cu_seqlens_q))
        return real_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, *args, skip_single=skip_single,
                            **kwargs)

    monkeypatch.setattr(paged_attention, "paged_mixed_attention", spy_mixed)
    monkeypatch.setattr(paged_attention, "paged_prefill_attention", spy_prefill)
    monkeypatch.setattr(executor, "MIXED_DECODE_SPLIT", True)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 40, 13, 3, 26)]
    params = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=0)
    wants = [ref.generate(prompt, params) for prompt in prompts]
    for padded in (False, True):
        calls.clear()
        plain.clear()
        fused = ServingEngine(Engine.load(path, use_kernels=True),
                              ServingConfig(num_blocks=48, max_num_batched_tokens=32, max_seq_len=128, max_num_seqs=8))
        if padded:
            fused.step_graphs = graphs = StepGraphs(fused.executor, fused.storage, 32, 8, 128,
                                                    token_buckets=(8, 16, 32), capture=False)
            keys = graphs.keys()
            assert (32, 4, True) in keys and (32, 4, False) in keys and not any(k[1] == 1 and k[2] for k in keys)
        for out, want in zip(fused.run(prompts, params), wants):
            assert out.token_ids == want.token_ids
            got = torch.tensor([lp.logprob for lp in out.logprobs])
            assert torch.allclose(got, torch.tensor(want.logprobs), atol=1e-4)
        assert calls, "no step mixed decodes with prompts"
        assert all(1 in lens and max(lens) > 1 for lens in calls), calls
        assert plain and not any(1 in lens and max(lens) > 1 for lens in plain), plain  # prompts alone
        assert fused.kv.pool.num_free == fused.kv.pool.num_blocks


def test_mixed_decode_split_by_default_over_quantized_caches(tmp_path, monkeypatch):
    """RUNTIME_MIXED_DECODE_SPLIT's and RUNTIME_PREFILL_OWN_CODES's default ("auto"): layers whose cache is FP8 take
    them, others do not; "1" / "0" force them (the own codes over quantized caches only); case and spaces are
    ignored, any other value is refused at import, naming the allowed ones. An FP8-KV artifact's mixed steps take
    paged_mixed_attention and its prefill steps its own codes by default, eagerly and as StepGraphs keys them, with
    the offline engine's greedy tokens and the logprobs of the same engine with both off (the offline engine attends
    a prompt over its unquantized keys, the paged kernels over the cache's codes), each alone too."""
    import subprocess
    import sys

    from builder.pipeline import build
    from builder.recipe import validate_recipe
    from kernels import paged_attention
    from runtime import executor
    from runtime.cuda_graphs import StepGraphs

    # the defaults, unless the environment sets them: auto, an FP8 cache only (INT8 ones were not timed)
    assert executor.MIXED_DECODE_SPLIT is None and executor.PREFILL_OWN_CODES is None
    split, codes = executor.mixed_decode_split, executor.prefill_own_codes
    for fn in (split, codes):
        assert fn(torch.float8_e4m3fn) and not fn(torch.int8)
        assert not fn(torch.bfloat16) and not fn(torch.float16) and not fn(torch.float32)
    for forced in (True, False):
        monkeypatch.setattr(executor, "MIXED_DECODE_SPLIT", forced)
        assert split(torch.bfloat16) is forced and split(torch.float8_e4m3fn) is forced
        monkeypatch.setattr(executor, "PREFILL_OWN_CODES", forced)  # "1": every quantized cache, never a 16-bit one
        assert codes(torch.int8) is forced and codes(torch.float8_e4m3fn) is forced and not codes(torch.bfloat16)
    monkeypatch.setattr(executor, "MIXED_DECODE_SPLIT", None)
    monkeypatch.setattr(executor, "PREFILL_OWN_CODES", None)
    probe = "import runtime.executor as e; print(e.MIXED_DECODE_SPLIT, e.PREFILL_OWN_CODES)"
    env = {**os.environ, "RUNTIME_MIXED_DECODE_SPLIT": " Auto ", "RUNTIME_PREFILL_OWN_CODES": "0"}
    ok = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.split() == ["None", "False"], ok.stderr
    env["RUNTIME_MIXED_DECODE_SPLIT"] = "yes"
    bad = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert bad.returncode != 0
    assert "RUNTIME_MIXED_DECODE_SPLIT='yes' is not one of auto, 1, 0" in bad.stderr

    ckpt = make_checkpoint(tmp_path / "ckpt", "llama", num_hidden_layers=1, **SHAPES["llama"])
    recipe = validate_recipe({
        "model": {"checkpoint": str(ckpt)}, "output_dir": str(tmp_path / "art"),
        "runtime": {"max_seq_len": 128, "max_num_tokens": 32, "kv_cache_dtype": "fp8"},
        "calibration": {"num_samples": 4, "seq_len": 32, "dataset": "bundled"}, "gates": {"enabled": False}})
    path = build(recipe).output_dir
    calls, own, only, real_mixed, real_prefill = [], [], [], paged_attention.paged_mixed_attention, \
        paged_attention.paged_prefill_attention

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real_mixed(*args, **kwargs)

    def spy_prefill(*args, contiguous_kv=None, **kwargs):
        own.append(contiguous_kv is not None)
        only.append(kwargs.get("prompts_only", False))
        return real_prefill(*args, contiguous_kv=contiguous_kv, **kwargs)

    monkeypatch.setattr(paged_attention, "paged_mixed_attention", spy)
    monkeypatch.setattr(paged_attention, "paged_prefill_attention", spy_prefill)
    ref = Engine.load(path)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 30, 3, 21)]
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=0)
    outs = {}
    # (split, own codes): the defaults (auto: both on over this FP8 cache); neither; each alone
    for mode, own_codes in ((None, None), (False, False), (None, False), (False, None)):
        monkeypatch.setattr(executor, "MIXED_DECODE_SPLIT", mode)
        monkeypatch.setattr(executor, "PREFILL_OWN_CODES", own_codes)
        fused = ServingEngine(Engine.load(path, use_kernels=True),
                              ServingConfig(num_blocks=48, max_num_batched_tokens=32, max_seq_len=128, max_num_seqs=8))
        assert all(t.dtype == torch.float8_e4m3fn for t in fused.storage.k)
        graphs = StepGraphs(fused.executor, fused.storage, 32, 8, 128, token_buckets=(8, 16, 32), capture=False)
        assert graphs.split_mixed is (mode is None) and ((32, 4, True) in graphs.keys()) is (mode is None)
        calls.clear()
        own.clear()
        only.clear()
        outs[mode, own_codes] = fused.run(prompts, params)
        assert bool(calls) is (mode is None), calls  # the default split the mixed steps; "0" none
        assert own and all(o is (own_codes is None) for o in own), own  # every prefill step over its own codes, or none
        # the prompts' tiling where no one-token sequence reaches the prefill kernel: with the split, every launch
        # (the split steps' and the prompt-only ones'); without it, none (the mixed steps' decodes are in them)
        assert all(o is (mode is None) for o in only), only
    for prompt, *runs in zip(prompts, *outs.values()):
        plain = runs[1]
        assert plain.token_ids == ref.generate(prompt, params).token_ids
        for out in runs:
            assert out.token_ids == plain.token_ids
            assert torch.allclose(torch.tensor([lp.logprob for lp in out.logprobs]),
                                  torch.tensor([lp.logprob for lp in plain.logprobs]), atol=1e-4)


def test_steps_carrying_prefill_padded_to_their_buckets(tmp_path):
    """StepGraphs' padded step (tokens past the step: slot -1, position 0, past cu_seqlens_q's end; sequences past
    it: no new tokens; logits rows past the sampling ones: row 0, dropped), run eagerly through the kernels here
    (the CUDA graphs replay exactly this step), gives the reference path's tokens and logprobs: prompts one at a
    time (padded to 8, 16 and 32 tokens, one prefilled in two 32-token chunks, a prefix-cache hit), then all of them
    at once, so that steps mix several prompts' chunks with the decodes of the others (padded to 2-8 sequences)."""
    from runtime.cuda_graphs import StepGraphs

    # one layer: the steps' padding is what is under test (test_paged_kernels_match_the_reference_path runs two),
    # and each layer's kernels cost the interpreter about a minute here
    path = build_artifact(make_checkpoint(tmp_path / "ckpt", "llama", num_hidden_layers=1, **SHAPES["llama"]),
                          tmp_path / "art")
    ref = Engine.load(path, use_kernels=False)
    fused = ServingEngine(Engine.load(path, use_kernels=True),
                          ServingConfig(num_blocks=48, max_num_batched_tokens=32, max_seq_len=128, max_num_seqs=8))
    fused.step_graphs = graphs = StepGraphs(fused.executor, fused.storage, 32, 8, 128, token_buckets=(8, 16, 32),
                                            capture=False)
    assert graphs.seq_buckets == [1, 4, 8] and graphs.bucket_for(9, 5) == (16, 8) and graphs.bucket_for(33, 1) is None
    runs, real_run = [], graphs.run

    def spy(step, feed=None):
        runs.append((step.num_tokens, step.num_seqs, step.context_lens[0], len(step.logits_rows)))
        return real_run(step, feed)

    graphs.run = spy
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 13, 32, 50)]
    prompts.append(prompts[3][:40] + [7, 8, 9])  # its first two blocks (16 tokens each) are cached by then
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=0)
    wants = [ref.generate(prompt, params) for prompt in prompts]
    for prompt, want in zip(prompts, wants):
        out = fused.run([prompt], params)[0]
        assert out.token_ids == want.token_ids
        got = torch.tensor([lp.logprob for lp in out.logprobs])
        assert torch.allclose(got, torch.tensor(want.logprobs), atol=1e-4)
    assert (5, 1, 0, 1) in runs and (13, 1, 0, 1) in runs and (32, 1, 0, 1) in runs  # padded to 8 and 16; whole
    assert (32, 1, 0, 0) in runs and (18, 1, 32, 1) in runs  # the 50-token prompt in two chunks
    assert (11, 1, 32, 1) in runs  # the prefix-cache hit: 32 tokens cached, 11 new
    assert fused.kv.pool.num_free == fused.kv.pool.num_blocks

    runs.clear()
    fresh = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (9, 30, 3, 21)]
    more = [ref.generate(prompt, params) for prompt in fresh]
    for out, want in zip(fused.run(prompts + fresh, params), wants + more):
        assert out.token_ids == want.token_ids
        got = torch.tensor([lp.logprob for lp in out.logprobs])
        assert torch.allclose(got, torch.tensor(want.logprobs), atol=1e-4)
    mixed = [r for r in runs if r[1] > 1 and r[0] > r[1]]  # several sequences, some prefilling
    assert mixed and any(r[1] not in graphs.seq_buckets for r in mixed), runs  # padded sequences too
    assert fused.kv.pool.num_free == fused.kv.pool.num_blocks

    # pipelined, as with CUDA graphs (no decode graphs here: every step goes through the step graphs), so steps
    # launched ahead take the tokens the step in flight sampled from the device (``feed``)
    class NoDecodeGraphs:
        def bucket_for(self, num_seqs):
            return None

        def close(self):
            pass

    fed, real = [], graphs.run

    def spy_feed(step, feed=None):
        fed.append(0 if feed is None else len(feed[1]))
        return real(step, feed)

    graphs.run = spy_feed
    fused.graphs = NoDecodeGraphs()
    plain = SamplingParams(max_tokens=4, ignore_eos=True)
    for out, prompt in zip(fused.run(prompts + fresh, plain), prompts + fresh):
        assert out.token_ids == ref.generate(prompt, plain).token_ids
    assert max(fed) > 1, fed
    assert fused.kv.pool.num_free == fused.kv.pool.num_blocks


@pytest.mark.parametrize("algo", ["gptq", "int8_wo", "smoothquant", "fp8"])
def test_quantized_linears_on_the_gemm_kernels(tmp_path, monkeypatch, algo):
    """W4A16 / W8A16 artifacts run the Triton GEMM on the repacked weights; W8A8 INT8 / FP8 ones quantize the
    20-token step (above FUSED_MAX_ROWS) with ``quantize_rows`` before the matmul. Steps of up to
    ``GEMV_RUNTIME_MAX_ROWS`` tokens run the GEMV kernels (``kernels.gemv``), or the GEMMs with ``GEMV_ENABLED``
    off. (The weight-only ones on the GEMV / GEMM path: ``kernels.w4a16_mma`` off, as for group sizes it does not
    take; its own path is tested below.)"""
    from kernels import gemv, w4a16_mma

    from builder.pipeline import build
    from builder.recipe import validate_recipe

    # one layer: its four linears (q/k/v, o, gate/up, down) are every kind of linear the kernels take; a second
    # layer would run the same kernels again (two layers: test_paged_kernels_match_the_reference_path)
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama", num_hidden_layers=1, **SHAPES["llama"])
    quant = {"gptq": {"algo": "gptq", "group_size": 16}, "int8_wo": {"algo": "int8_wo"},
             "smoothquant": {"algo": "smoothquant"},
             "fp8": {"algo": "fp8", "weight_granularity": "channel"}}[algo]
    recipe = validate_recipe({
        "model": {"checkpoint": str(ckpt), "dtype": "float32"}, "output_dir": str(tmp_path / "art"),
        "runtime": {"max_seq_len": 128, "max_num_tokens": 32}, "quantization": quant,
        "calibration": {"num_samples": 4, "seq_len": 32, "dataset": "bundled"}, "gates": {"enabled": False}})
    path = build(recipe).output_dir
    monkeypatch.setattr(w4a16_mma, "MMA_ENABLED", False)  # read when the engine loads (repacks) the weights
    ref, fused = Engine.load(path, use_kernels=False), Engine.load(path, use_kernels=True)
    ids = torch.randint(3, 300, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    assert (fused.logits(ids) - ref.logits(ids)).abs().max() < 1e-3

    num_quantized = sum(1 for n in fused.executor.graph["nodes"] if n["op"] == "linear" and n["attrs"].get("quant"))
    assert num_quantized > 0
    gemv_name = "w4a16_gemv" if algo in ("gptq", "int8_wo") else "w8a8_gemv"
    calls, real = [], getattr(gemv, gemv_name)

    def spy(x, *args, **kwargs):
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(gemv, gemv_name, spy)
    for enabled, runtime_rows in ((True, 1), (True, 4), (False, 4)):
        monkeypatch.setattr(gemv, "GEMV_ENABLED", enabled)
        monkeypatch.setattr(gemv, "GEMV_RUNTIME_MAX_ROWS", runtime_rows)
        for num_tokens in (1, 3):
            assert (fused.logits(ids[:num_tokens]) - ref.logits(ids[:num_tokens])).abs().max() < 1e-3
        # each quantized linear ran the GEMV once per step of at most runtime_rows rows; none with the switch off
        expected = [1] * num_quantized + ([3] * num_quantized if runtime_rows >= 3 else [])
        assert calls == (expected if enabled else []), calls
        calls.clear()


@pytest.mark.parametrize("algo", ["gptq", "int8_wo"])
def test_weight_only_linears_on_the_mma_kernel(tmp_path, monkeypatch, algo):
    """Where ``kernels.w4a16_mma`` takes the group size, W4A16 / W8A16 linears are repacked to its layout at load:
    steps of up to ``MMA_RUNTIME_MAX_ROWS`` tokens run its tensor-core kernel, longer ones the weight dequantized
    from that layout for a matmul; both equal the reference path."""
    from kernels import gemv, w4a16_mma

    from builder.pipeline import build
    from builder.recipe import validate_recipe

    ckpt = make_checkpoint(tmp_path / "ckpt", "llama", **SHAPES["llama"], intermediate_size=128)  # groups of 32
    quant = {"gptq": {"algo": "gptq", "group_size": 32}, "int8_wo": {"algo": "int8_wo"}}[algo]
    recipe = validate_recipe({
        "model": {"checkpoint": str(ckpt), "dtype": "float32"}, "output_dir": str(tmp_path / "art"),
        "runtime": {"max_seq_len": 128, "max_num_tokens": 32}, "quantization": quant,
        "calibration": {"num_samples": 4, "seq_len": 32, "dataset": "bundled"}, "gates": {"enabled": False}})
    path = build(recipe).output_dir
    ref, fused = Engine.load(path, use_kernels=False), Engine.load(path, use_kernels=True)
    num_quantized = sum(1 for n in fused.executor.graph["nodes"] if n["op"] == "linear" and n["attrs"].get("quant"))
    assert num_quantized > 0
    calls, gated, real = [], [], w4a16_mma.w4a16_mma
    dequantized, real_dequantize = [], w4a16_mma.dequantize_mma
    # each layer's down projection reads the merged gate/up and forms silu(gate) * up itself
    assert len(fused.executor._fusions.gated) == fused.executor.num_layers

    def spy(x, *args, **kwargs):
        calls.append(x.shape[0])
        gated.append(kwargs.get("gated", False))
        return real(x, *args, **kwargs)

    def spy_dequantize(*args, **kwargs):
        dequantized.append(1)
        return real_dequantize(*args, **kwargs)

    def never(*args, **kwargs):
        raise AssertionError("the GEMV ran on weights repacked for the mma kernel")

    monkeypatch.setattr(w4a16_mma, "w4a16_mma", spy)
    monkeypatch.setattr(w4a16_mma, "dequantize_mma", spy_dequantize)
    monkeypatch.setattr(gemv, "w4a16_gemv", never)
    # the kernel up to _KERNEL_ALWAYS_ROWS rows; up to MMA_RUNTIME_MAX_ROWS on wide / long-K layers only
    monkeypatch.setattr(w4a16_mma, "_KERNEL_ALWAYS_ROWS", 4)
    monkeypatch.setattr(w4a16_mma, "MMA_RUNTIME_MAX_ROWS", 16)
    ids = torch.randint(3, 300, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    for num_tokens in (1, 5, 20):
        assert (fused.logits(ids[:num_tokens]) - ref.logits(ids[:num_tokens])).abs().max() < 1e-3
    assert calls == [1] * num_quantized, calls  # 5 and 20 rows: no layer of this model is wide or long-K
    assert sum(gated) == fused.executor.num_layers
    assert len(dequantized) == 2 * num_quantized
    calls.clear()
    monkeypatch.setattr(w4a16_mma, "_LONG_K", 1)  # every layer is long-K now: 5 rows take the kernel, 20 do not
    assert (fused.logits(ids[:5]) - ref.logits(ids[:5])).abs().max() < 1e-3
    assert (fused.logits(ids) - ref.logits(ids)).abs().max() < 1e-3
    assert calls == [5] * num_quantized, calls


def _node(op, inputs, outputs, attrs=None, weights=None):
    return {"op": op, "inputs": inputs, "outputs": outputs, "attrs": attrs or {}, "weights": weights or {}}


def _layer(extra_reader: str | None = None, down_quant: dict | None = None) -> list[dict]:
    rope = dict(num_heads=4, head_dim=32)
    nodes = [
        _node("linear", ["x"], ["q0", "k0", "v"], {"split_sizes": [128, 64, 64]}),
        _node("rope", ["q0", "positions"], ["q"], rope, {"inv_freq": "f"}),
        _node("rope", ["k0", "positions"], ["k"], {**rope, "num_heads": 2}, {"inv_freq": "f"}),
        _node("attention", ["q", "k", "v"], ["a"], dict(layer=0, num_heads=4, num_kv_heads=2, head_dim=32)),
        _node("linear", ["a"], ["gu"], {"in_features": 128}),
        _node("silu_mul", ["gu"], ["h"]),
        _node("linear", ["h"], ["y"], {"in_features": 64, "quant": down_quant or {"scheme": "w4a16", "bits": 4,
                                                                                   "group_size": 32}}),
    ]
    if extra_reader:
        nodes.append(_node("elementwise", [extra_reader, extra_reader], ["z"], {"fn": "add"}))
    return nodes


def _plan(nodes):
    from runtime.executor import plan_fusions

    consumers: dict[str, int] = {}
    for n in nodes:
        for name in n["inputs"]:
            consumers[name] = consumers.get(name, 0) + 1
    return plan_fusions(nodes, consumers)


def test_fusions_need_values_no_one_else_reads():
    """RoPE goes into the attention and the SwiGLU into a weight-only down projection only where the values the
    fusion hides (the rotated q / k, their inputs, the SwiGLU's output) have no other reader."""
    plan = _plan(_layer())
    assert plan.absorbed == {1, 2, 5} and set(plan.rope) == {3} and plan.gated == {6}
    for hidden in ("q", "k", "q0", "k0"):  # another reader of a rotated or to-be-rotated value: no RoPE fusion
        plan = _plan(_layer(extra_reader=hidden))
        assert not plan.rope and plan.absorbed == {5}, hidden
    plan = _plan(_layer(extra_reader="h"))
    assert not plan.gated and plan.absorbed == {1, 2}
    # a down projection the mma kernel does not take (FP8), or a group its layout cannot hold: no gating
    assert not _plan(_layer(down_quant={"scheme": "fp8"})).gated
    assert not _plan(_layer(down_quant={"scheme": "w4a16", "bits": 4, "group_size": 24})).gated
    # an unquantized down projection forms it in dense_gemv's loads, unless that kernel is off
    dense = _layer()
    del dense[-1]["attrs"]["quant"]
    assert _plan(dense).gated == {6} and 5 in _plan(dense).absorbed
    assert not _plan(dense[:-1] + [dense[-1], _node("elementwise", ["h", "h"], ["z"], {"fn": "add"})]).gated
    from kernels import gemv

    original = gemv.DENSE_RUNTIME_MAX_ROWS
    try:
        gemv.DENSE_RUNTIME_MAX_ROWS = 0
        assert not _plan(dense).gated
    finally:
        gemv.DENSE_RUNTIME_MAX_ROWS = original


def test_frag_gate_up_forms_the_swiglu(monkeypatch):
    """A weight-only merged gate/up on the frag layout whose only reader is the SwiGLU forms it in its own kernel
    (swiglu_out; the SwiGLU absorbed), and then the down projection does not gate it again; an extra reader of its
    output, an lm_head, an act-order perm or a shape the layout does not take leave it alone."""
    from kernels import w4a16_frag

    monkeypatch.setattr(w4a16_frag, "runtime_layout", lambda bits, group, k, n, dtype: True)  # CUDA-only layout

    def layer(**gate_up):
        nodes = _layer()
        nodes[4]["attrs"].update({"out_features": 128, "quant": {"scheme": "w4a16", "bits": 4, "group_size": 128}},
                                 **gate_up.get("attrs", {}))
        nodes[4]["weights"].update(gate_up.get("weights", {}))
        return nodes + gate_up.get("extra", [])

    plan = _plan(layer())
    assert plan.swiglu_out == {4} and 5 in plan.absorbed and not plan.gated
    for kwargs in ({"extra": [_node("elementwise", ["gu", "gu"], ["z"], {"fn": "add"})]},
                   {"attrs": {"lm_head": True}}, {"weights": {"perm": "p"}}, {"attrs": {"out_features": 48}}):
        plan = _plan(layer(**kwargs))
        assert not plan.swiglu_out, kwargs
    monkeypatch.setattr(w4a16_frag, "runtime_layout", lambda bits, group, k, n, dtype: False)
    assert not _plan(layer()).swiglu_out and _plan(layer()).gated == {6}


def test_swiglu_out_off_the_frag_layout_still_forms_the_swiglu():
    """A linear planned to form the SwiGLU whose weights the frag layout does not take at load (here fp32, and the
    interpreter) still returns silu(gate) * up: its SwiGLU node was absorbed."""
    from kernels.activation import silu_mul
    from passes.quant_math import QuantConfig, pack_int4, quantize_groups
    from runtime.executor import _kernel_weight_only_linear

    g = torch.Generator().manual_seed(5)
    codes, scales, zeros = quantize_groups(torch.randn(64, 128, generator=g) * 0.05,
                                           QuantConfig(bits=4, group_size=64, symmetric=False))
    w = {"qweight": pack_int4(codes), "scales": scales, "zeros": zeros}
    quant = {"scheme": "w4a16", "bits": 4, "group_size": 64}
    x = torch.randn(3, 128, generator=g)
    plain = _kernel_weight_only_linear(w, quant, dtype=torch.float32)
    fused = _kernel_weight_only_linear(w, quant, dtype=torch.float32, swiglu_out=True)
    y = fused(x)
    assert y.shape == (3, 32) and torch.equal(y, silu_mul(plain(x)))


def test_frag_linears_take_over_the_residual_add_and_norm(monkeypatch):
    """o_proj -> fused_add_rms_norm -> gate_up with both linears on the frag layout: o_proj adds the residual (an
    extra input, the norm's) and the norm becomes a PendingNorm for gate_up; not when the norm has a gain offset,
    no gain, another reader of o_proj's output, a reader of its output that is not a frag linear, or fp32."""
    from kernels import w4a16_frag
    from runtime import executor
    from runtime.executor import plan_fusions

    monkeypatch.setattr(w4a16_frag, "runtime_layout", lambda bits, group, k, n, dtype: True)
    monkeypatch.setattr(executor, "FUSE_NORM_INTO_LINEARS", True)  # off by default (RUNTIME_FUSE_NORM_LINEAR=1)
    q = {"scheme": "w4a16", "bits": 4, "group_size": 128}

    def graph(norm_attrs=None, norm_weights=None, extra=(), reader_quant=q):
        nodes = [_node("linear", ["a"], ["o"], {"in_features": 256, "out_features": 256, "quant": q}),
                 _node("fused_add_rms_norm", ["o", "r"], ["n", "t"], {"eps": 1e-6, **(norm_attrs or {})},
                       {"weight": "g"} if norm_weights is None else norm_weights),
                 _node("linear", ["n"], ["gu"], {"in_features": 256, "out_features": 1024, "quant": reader_quant}),
                 *extra]
        consumers: dict[str, int] = {}
        for n in nodes:
            for name in n["inputs"]:
                consumers[name] = consumers.get(name, 0) + 1
        return nodes, consumers

    plan = plan_fusions(*graph(), torch.bfloat16)
    assert plan.residual_out == {0: "r"} and plan.pending_norms == {1}
    monkeypatch.setattr(executor, "FUSE_NORM_INTO_LINEARS", False)
    assert not plan_fusions(*graph(), torch.bfloat16).residual_out
    monkeypatch.setattr(executor, "FUSE_NORM_INTO_LINEARS", True)
    nodes, consumers = graph()
    nodes[1]["inputs"] = ["r", "o"]  # the graphs' order: the residual first
    plan = plan_fusions(nodes, consumers, torch.bfloat16)
    assert plan.residual_out == {0: "r"} and plan.pending_norms == {1}
    assert not plan_fusions(*graph(), torch.float32).residual_out
    for kwargs in ({"norm_attrs": {"weight_offset": 1.0}}, {"norm_weights": {}},
                   {"extra": [_node("elementwise", ["o", "o"], ["z"], {"fn": "add"})]},
                   {"extra": [_node("elementwise", ["n", "n"], ["z"], {"fn": "add"})]},
                   {"reader_quant": {"scheme": "fp8"}}):
        plan = plan_fusions(*graph(**kwargs), torch.bfloat16)
        assert not plan.residual_out and not plan.pending_norms, kwargs
    nodes, consumers = graph()
    nodes[2]["attrs"]["split_heads"] = 4  # a reader that splits per head takes no PendingNorm
    assert not plan_fusions(nodes, consumers, torch.bfloat16).residual_out
    # the residual made after the linear (here by another linear, itself a candidate): at most one producer, and
    # only where the residual exists by the time it runs
    nodes, consumers = graph()
    nodes.insert(1, _node("linear", ["b"], ["r"], {"in_features": 256, "out_features": 256, "quant": q}))
    consumers["b"] = 1
    plan = plan_fusions(nodes, consumers, torch.bfloat16)
    assert plan.residual_out == {1: "o"} and plan.pending_norms == {2}


def test_norms_quantize_for_the_fp8_linear_they_feed():
    """A norm (or SwiGLU) whose only reader is a W8A8 linear (aligned, not an lm_head) quantizes its rows itself:
    FP8 on _scaled_mm in bf16/fp16, INT8 on any device and activation dtype; dynamic activations or a static input
    scale (whose value the executor checks as loaded); any other reader, an act-order perm, a smoothing pre-quant
    scale, a Gemma gain offset, a per-head norm, another producer, a weight-only linear, or FP8 on a device without
    _scaled_mm or in fp32 leaves it alone."""
    from runtime.executor import plan_fusions

    def graph(norm_attrs=None, linear_attrs=None, weights=None, extra_reader=False, producer="fused_add_rms_norm"):
        fp8 = {"quant": {"scheme": "fp8"}, "in_features": 64, "out_features": 96, **(linear_attrs or {})}
        nodes = [_node(producer, ["x", "r"], ["n", "t"], {"eps": 1e-6, **(norm_attrs or {})}),
                 _node("linear", ["n"], ["y"], fp8, {"qweight": "w", "weight_scale": "s", **(weights or {})})]
        if extra_reader:
            nodes.append(_node("elementwise", ["n", "n"], ["z"], {"fn": "add"}))
        consumers: dict[str, int] = {}
        for n in nodes:
            for name in n["inputs"]:
                consumers[name] = consumers.get(name, 0) + 1
        return nodes, consumers

    assert plan_fusions(*graph(), torch.bfloat16, scaled_mm=True).quant_producers == {0: 1}
    assert plan_fusions(*graph(producer="silu_mul"), torch.bfloat16, scaled_mm=True).quant_producers == {0: 1}
    assert not plan_fusions(*graph(), torch.bfloat16, scaled_mm=False).quant_producers
    assert not plan_fusions(*graph(), torch.float32, scaled_mm=True).quant_producers
    assert plan_fusions(*graph(weights={"input_scale": "i"}), torch.bfloat16, scaled_mm=True).quant_producers == {0: 1}
    int8 = {"linear_attrs": {"quant": {"scheme": "w8a8_int8"}}}
    for dtype in (torch.bfloat16, torch.float32):
        assert plan_fusions(*graph(**int8), dtype, scaled_mm=False).quant_producers == {0: 1}, dtype
    for kwargs in ({"extra_reader": True}, {"weights": {"perm": "p"}}, {"weights": {"pre_quant_scale": "q"}},
                   {"norm_attrs": {"weight_offset": 1.0}}, {"norm_attrs": {"head_dim": 32}},
                   {"linear_attrs": {"lm_head": True}}, {"linear_attrs": {"out_features": 100}},
                   {"linear_attrs": {"quant": {"scheme": "w8a16", "bits": 8, "group_size": -1}}},
                   {"producer": "elementwise"}):
        assert not plan_fusions(*graph(**kwargs), torch.bfloat16, scaled_mm=True).quant_producers, kwargs


def test_static_tensor_fp8_linears_run_scaled_mm_tensorwise(tmp_path, monkeypatch):
    """FP8 with calibrated (static) input scales on per-tensor weight scales: past the rows kernels every linear
    runs _scaled_mm with one scale per operand (run on the CPU here), the same codes and scales as the row-wise call
    (test_norm_quantized_fp8_step_equals_the_unfused_one and the kernels' tests check that path against the
    references), so the logits of a 20-token step equal the row-wise path's; per-channel weight scales keep the
    row-wise call. The norms and the SwiGLU write their linears' codes at the input scale (plan_fusions'
    static_inputs), so only o_proj's input takes quantize_rows_static, and the logits equal those of the step with
    every linear quantizing its own input (FUSE_NORM_QUANT off), exactly."""
    import kernels.torch_quant as tq
    from kernels import w8a8_gemm, w8a8_rows
    from runtime import executor

    from builder.pipeline import build
    from builder.recipe import validate_recipe

    ckpt = make_checkpoint(tmp_path / "ckpt", "llama", **SHAPES["llama"])
    monkeypatch.setattr(executor, "_scaled_mm_device", lambda device: True)
    statics, scales, real_static, real_mm = [], [], w8a8_gemm.quantize_rows_static, torch._scaled_mm

    def spy_static(x, *args, **kwargs):
        statics.append(x.shape[0])
        return real_static(x, *args, **kwargs)

    def spy_mm(a, b, *, scale_a, scale_b, **kwargs):
        scales.append((scale_a.numel(), scale_b.numel()))
        return real_mm(a, b, scale_a=scale_a, scale_b=scale_b, **kwargs)

    monkeypatch.setattr(w8a8_gemm, "quantize_rows_static", spy_static)
    monkeypatch.setattr(tq.torch, "_scaled_mm", spy_mm)
    monkeypatch.setattr(w8a8_rows, "RUNTIME_MAX_ROWS", 0)  # 20 rows past the rows GEMM (KERNELS_W8A8_ROWS_MAX=0)
    ids = torch.randint(3, 300, (20,), generator=torch.Generator().manual_seed(6)).tolist()
    for granularity in ("tensor", "channel"):
        recipe = validate_recipe({
            "model": {"checkpoint": str(ckpt), "dtype": "bfloat16"}, "output_dir": str(tmp_path / granularity),
            "runtime": {"max_seq_len": 128, "max_num_tokens": 32},
            "calibration": {"num_samples": 4, "seq_len": 32, "dataset": "bundled"},
            "quantization": {"algo": "fp8", "activations": "static", "weight_granularity": granularity},
            "gates": {"enabled": False}})
        path = build(recipe).output_dir
        monkeypatch.setattr(executor, "FUSE_NORM_QUANT", False)
        plain = Engine.load(path, use_kernels=True)
        layers = plain.executor.num_layers
        statics.clear()
        unfused = plain.logits(ids)
        assert len(statics) == 4 * layers, statics  # every linear
        monkeypatch.setattr(executor, "FUSE_NORM_QUANT", True)
        engine = Engine.load(path, use_kernels=True)
        assert len(engine.executor._fusions.static_inputs) == 3 * layers  # the norms before qkv, gate/up; the SwiGLU
        statics.clear()
        scales.clear()
        got = engine.logits(ids)
        assert torch.equal(got, unfused)
        assert len(statics) == layers and set(statics) == {20}, statics  # o_proj's input only
        if granularity == "tensor":
            assert scales == [(1, 1)] * 4 * layers, scales
            monkeypatch.setattr(tq.torch, "_scaled_mm", lambda a, b, *, scale_a, scale_b, **kw: real_mm(
                a, b, scale_a=scale_a.reshape(1, 1).expand(a.shape[0], 1).contiguous(),
                scale_b=scale_b.reshape(1, 1).expand(1, b.shape[1]).contiguous(), **kw))
            rowwise = Engine.load(path, use_kernels=True).logits(ids)
            if got.is_cuda:  # two cuBLAS kernels: the fp32 epilogue's rounding may differ
                torch.testing.assert_close(got, rowwise, atol=2e-2, rtol=2e-2)
            else:
                assert torch.equal(got, rowwise)
            monkeypatch.setattr(tq.torch, "_scaled_mm", spy_mm)
        else:
            assert all(a == 20 and b > 1 for a, b in scales) and len(scales) == 4 * layers, scales
    # a decode batch and one row: the rows GEMM (5 rows) and, with KERNELS_GEMV_PREQUANT=1, the GEMV (1 row) take the
    # norms' static codes, their one scale expanded over the rows, and give the unfused step's logits exactly
    from kernels import gemv

    monkeypatch.setattr(w8a8_rows, "RUNTIME_MAX_ROWS", 64)
    monkeypatch.setattr(gemv, "GEMV_PREQUANT", True)
    engines = {}
    for fused in (False, True):
        monkeypatch.setattr(executor, "FUSE_NORM_QUANT", fused)
        engines[fused] = Engine.load(path, use_kernels=True)
    rows_scales, real_rows = [], w8a8_rows.w8a8_rows_linear

    def spy_rows(codes, x_scale, *args, **kwargs):
        rows_scales.append(x_scale.stride(0))
        return real_rows(codes, x_scale, *args, **kwargs)

    monkeypatch.setattr(w8a8_rows, "w8a8_rows_linear", spy_rows)
    for n in (5, 1):
        want = engines[False].logits(ids[:n])
        rows_scales.clear()
        assert torch.equal(engines[True].logits(ids[:n]), want), n
        if n == 5:  # qkv, gate/up and down on the norms' codes (stride 0), o_proj on quantize_rows_static's (also 0)
            assert rows_scales == [0] * 4 * layers, rows_scales


@pytest.mark.parametrize("activations", ["dynamic", "dynamic-bf16", "static", "static-128"])
def test_int8_norms_quantize_for_the_linear_they_feed(tmp_path, monkeypatch, activations):
    """An INT8 W8A8 (SmoothQuant) artifact on the kernels: the norms and the SwiGLU write the codes of the linear they
    feed (per token; at its calibrated scale with its act_qmin, -127 or -128), so only o_proj's input is quantized by
    the linear, and the logits equal the same executor's with that fusion off, exactly (INT8 sums are exact), at 5
    and 20 rows (the rows GEMM) and at 30 (past KERNELS_W8A8_ROWS_MAX_INT8, lowered here to 24 as the variable can:
    the torch INT8 matmul on the codes; the interpreter runs a program per row); fp32 and bf16 activations, and one
    row on the GEMV with KERNELS_GEMV_PREQUANT=1 (bf16)."""
    import json
    import shutil

    from kernels import gemv, w8a8_gemm, w8a8_rows
    from runtime import executor

    from builder.pipeline import build
    from builder.recipe import validate_recipe

    ckpt = make_checkpoint(tmp_path / "ckpt", "llama", **SHAPES["llama"])
    dtype = "bfloat16" if activations.endswith("bf16") else "float32"
    recipe = validate_recipe({
        "model": {"checkpoint": str(ckpt), "dtype": dtype}, "output_dir": str(tmp_path / "art"),
        "runtime": {"max_seq_len": 512, "max_num_tokens": 512},
        "quantization": {"algo": "smoothquant", "activations": activations.split("-")[0]},
        "calibration": {"num_samples": 4, "seq_len": 32, "dataset": "bundled"}, "gates": {"enabled": False}})
    path = build(recipe).output_dir
    if activations == "static-128":  # compressed-tensors' static INT8 codes reach -128 (the quant attr's act_qmin)
        from runtime.artifact import file_sha256, manifest_digest

        path = shutil.copytree(path, tmp_path / "art-128")
        graph = json.loads((path / "graph.json").read_text())
        for node in graph["nodes"]:
            if (node.get("attrs") or {}).get("quant", {}).get("scheme") == "w8a8_int8":
                node["attrs"]["quant"]["act_qmin"] = -128
        (path / "graph.json").write_text(json.dumps(graph))
        manifest = json.loads((path / "manifest.json").read_text())  # re-hashed: the artifact as an import makes it
        manifest["files"]["graph.json"] = {"bytes": (path / "graph.json").stat().st_size,
                                           "sha256": file_sha256(path / "graph.json")}
        manifest["manifest_sha256"] = manifest_digest(manifest)
        (path / "manifest.json").write_text(json.dumps(manifest))
    import kernels.torch_quant as tq

    quantizing = []
    for module, name in ((w8a8_gemm, "quantize_rows"), (w8a8_gemm, "quantize_rows_static"),
                         (tq, "quantize_activation_int8")):  # the last: a static linear's own, past the rows GEMM
        monkeypatch.setattr(module, name, lambda x, *a, real=getattr(module, name), **k: quantizing.append(
            x.reshape(-1, x.shape[-1]).shape[0]) or real(x, *a, **k))
    if dtype == "bfloat16":  # one row: the norms quantize for the GEMV too (read at load)
        monkeypatch.setattr(gemv, "GEMV_PREQUANT", True)
    assert 20 <= w8a8_rows.RUNTIME_MAX_ROWS_INT8 < 300  # the default; lowered (read at load and per call) so that 30
    monkeypatch.setattr(w8a8_rows, "RUNTIME_MAX_ROWS_INT8", 24)  # rows are past it
    engines = {}
    for fused in (False, True):
        monkeypatch.setattr(executor, "FUSE_NORM_QUANT", fused)
        engines[fused] = Engine.load(path, use_kernels=True)
    layers = engines[True].executor.num_layers
    fusions = engines[True].executor._fusions
    assert len(fusions.quant_producers) == 3 * layers  # the norms before qkv, gate/up; the SwiGLU
    assert len(fusions.static_inputs) == (0 if activations.startswith("dynamic") else 3 * layers)
    if activations == "static-128":
        assert {qmin for _, qmin in fusions.static_inputs.values()} == {-128}
    ids = torch.randint(3, 300, (30,), generator=torch.Generator().manual_seed(7)).tolist()
    gemv_rows = []
    monkeypatch.setattr(gemv, "w8a8_gemv", lambda x, *a, real=gemv.w8a8_gemv, **k: gemv_rows.append(
        isinstance(x, w8a8_gemm.QuantizedRows)) or real(x, *a, **k))
    for n in ((1,) if dtype == "bfloat16" else ()) + (5, 20, 30):
        want = engines[False].logits(ids[:n])
        quantizing.clear()
        gemv_rows.clear()
        got = engines[True].logits(ids[:n])
        assert torch.equal(got, want), (n, (got - want).abs().max())
        if n == 1:  # the norms' and the SwiGLU's codes reach the GEMV; o_proj's input the GEMV quantizes itself
            assert gemv_rows == [True, False, True, True] * layers, gemv_rows
        else:
            assert quantizing == [n] * layers, (n, quantizing)  # o_proj's input only
    if activations == "static-128":  # -128 codes occur on these inputs: clamped at -127 the logits are others
        monkeypatch.setattr(executor, "int8_act_qmin", lambda quant: -127)
        assert not torch.equal(Engine.load(path, use_kernels=True).logits(ids), want)


def test_norm_quantized_fp8_step_equals_the_unfused_one(tmp_path, monkeypatch):
    """A bf16 FP8 artifact on the kernels with the norms and the SwiGLU quantizing for _scaled_mm (run on the CPU
    here) gives the logits of the same executor with the fusion off, exactly, over a 20-token step (above
    FUSED_MAX_ROWS), and quantize_rows then runs for the o_proj inputs only."""
    from kernels import w8a8_gemm
    from runtime import executor

    from builder.pipeline import build
    from builder.recipe import validate_recipe

    ckpt = make_checkpoint(tmp_path / "ckpt", "llama", **SHAPES["llama"])
    recipe = validate_recipe({
        "model": {"checkpoint": str(ckpt), "dtype": "bfloat16"}, "output_dir": str(tmp_path / "art"),
        "runtime": {"max_seq_len": 128, "max_num_tokens": 32},
        "quantization": {"algo": "fp8", "weight_granularity": "channel"}, "gates": {"enabled": False}})
    path = build(recipe).output_dir
    monkeypatch.setattr(executor, "_scaled_mm_device", lambda device: True)
    calls, real = [], w8a8_gemm.quantize_rows

    def spy(x, dtype):
        calls.append(x.shape)
        return real(x, dtype)

    monkeypatch.setattr(w8a8_gemm, "quantize_rows", spy)
    ids = torch.randint(3, 300, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    monkeypatch.setattr(executor, "FUSE_NORM_QUANT", False)
    plain = Engine.load(path, use_kernels=True)
    expected, plain_calls = plain.logits(ids), len(calls)
    calls.clear()
    monkeypatch.setattr(executor, "FUSE_NORM_QUANT", True)
    fused = Engine.load(path, use_kernels=True)
    layers = fused.executor.num_layers
    assert len(fused.executor._fusions.quant_producers) == 3 * layers  # the norms before qkv, gate/up; the SwiGLU
    got = fused.logits(ids)
    assert torch.equal(got, expected)
    assert plain_calls == 4 * layers and len(calls) == layers, (plain_calls, len(calls))  # o_proj's input only
    # one row, with KERNELS_GEMV_PREQUANT=1: the same producers quantize for the GEMV, which skips its own max
    from kernels import gemv

    monkeypatch.setattr(gemv, "GEMV_PREQUANT", True)
    fused = Engine.load(path, use_kernels=True)
    quantized, real_gemv = [], gemv.w8a8_gemv

    def spy_gemv(x, *args, **kwargs):
        quantized.append(isinstance(x, w8a8_gemm.QuantizedRows))
        return real_gemv(x, *args, **kwargs)

    monkeypatch.setattr(gemv, "w8a8_gemv", spy_gemv)
    assert torch.equal(fused.logits(ids[:1]), plain.logits(ids[:1]))
    assert sum(quantized) == 3 * layers and len(quantized) == 2 * 4 * layers, quantized
    # 5 rows (a decode batch): the norms quantize them too, for the W8A8 rows GEMM (kernels.w8a8_rows), which gets the
    # norms' codes for qkv, gate/up and down and quantize_rows' for o_proj
    from kernels import w8a8_rows

    monkeypatch.setattr(gemv, "GEMV_PREQUANT", False)
    assert w8a8_rows.runtime_applies(5, torch.float8_e4m3fn, torch.bfloat16)
    fused = Engine.load(path, use_kernels=True)
    rows_calls, real_rows = [], w8a8_rows.w8a8_rows_linear

    def spy_rows(codes, *args, **kwargs):
        rows_calls.append((codes.shape[0], codes.dtype))
        return real_rows(codes, *args, **kwargs)

    monkeypatch.setattr(w8a8_rows, "w8a8_rows_linear", spy_rows)
    calls.clear()
    assert torch.equal(fused.logits(ids[:5]), plain.logits(ids[:5]))
    fused_rows = [c for c in rows_calls[:len(rows_calls) // 2]]  # the fused engine ran first
    assert fused_rows == [(5, torch.float8_e4m3fn)] * (4 * layers), rows_calls
    assert len(calls) == layers + 4 * layers, len(calls)  # o_proj's input in the fused engine; every input in the plain


def test_kernel_or_dequantize_by_the_measured_crossover():
    """``prefers_kernel`` at Llama-3-8B shapes: the kernel up to 64 rows; at 65-128 rows for gate_up (wide) and
    down (long K) only; dequantize + cuBLAS past MMA_RUNTIME_MAX_ROWS."""
    from kernels.w4a16_mma import MMA_RUNTIME_MAX_ROWS, prefers_kernel

    qkv, o_proj, gate_up, down = (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)
    for rows in (1, 16, 64):
        assert all(prefers_kernel(rows, n, k) for n, k in (qkv, o_proj, gate_up, down))
    assert [prefers_kernel(128, n, k) for n, k in (qkv, o_proj, gate_up, down)] == [False, False, True, True]
    assert not prefers_kernel(MMA_RUNTIME_MAX_ROWS + 1, *gate_up)


def test_fp8_accumulation_reaches_the_scaled_mm_linears(tmp_path, monkeypatch):
    """runtime.fp8_accumulation goes from the recipe to the manifest to every FP8 linear on cuBLAS (the executor
    builds them with ``fast_accum``); RUNTIME_FP8_FAST_ACCUM overrides it either way for one process; a build with no
    FP8 linear refuses 'fast', which would name nothing."""
    import json

    from runtime import executor

    from builder.pipeline import BuildError, build
    from builder.recipe import validate_recipe

    ckpt = make_checkpoint(tmp_path / "ckpt", "llama", **SHAPES["llama"])
    monkeypatch.setattr(executor, "_scaled_mm_device", lambda device: True)
    monkeypatch.delenv("RUNTIME_FP8_FAST_ACCUM", raising=False)
    made, real = [], executor.make_fp8_scaled_mm_linear

    def spy(*args, fast_accum=False, **kwargs):
        made.append(fast_accum)
        return real(*args, fast_accum=fast_accum, **kwargs)

    monkeypatch.setattr(executor, "make_fp8_scaled_mm_linear", spy)

    def recipe(name: str, algo: str, accumulation: str) -> dict:
        return {"model": {"checkpoint": str(ckpt), "dtype": "bfloat16"}, "output_dir": str(tmp_path / name),
                "runtime": {"max_seq_len": 128, "max_num_tokens": 32, "fp8_accumulation": accumulation},
                "quantization": {"algo": algo}, "gates": {"enabled": False}}

    path = build(validate_recipe(recipe("fast", "fp8", "fast"))).output_dir
    assert json.loads((path / "manifest.json").read_text())["runtime"]["fp8_accumulation"] == "fast"
    engine = Engine.load(path, use_kernels=True)
    layers = engine.executor.num_layers
    assert engine.executor.fp8_fast_accum and made == [True] * 4 * layers, made
    for env, want in (("0", False), ("1", True)):
        monkeypatch.setenv("RUNTIME_FP8_FAST_ACCUM", env)
        made.clear()
        assert Engine.load(path, use_kernels=True).executor.fp8_fast_accum is want
        assert made == [want] * 4 * layers, (env, made)
    monkeypatch.delenv("RUNTIME_FP8_FAST_ACCUM")
    made.clear()
    promoted = build(validate_recipe(recipe("promoted", "fp8", "promoted"))).output_dir
    assert not Engine.load(promoted, use_kernels=True).executor.fp8_fast_accum and made == [False] * 4 * layers
    with pytest.raises(BuildError, match="runtime.fp8_accumulation is .fast. but no quantization section is fp8"):
        build(validate_recipe(recipe("int8", "int8_wo", "fast")))
    assert not (tmp_path / "int8").exists()
