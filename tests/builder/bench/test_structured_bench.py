"""`python -m builder.bench.structured`: the decode step with and without a JSON-schema constraint, the host stages
of a step (--breakdown), the mask fill between advancing states, and the figures it records."""

from __future__ import annotations

import json

from builder.bench import structured


def test_the_bench_times_both_runs_and_the_host_stages(bundled_artifact, tmp_path, capsys):
    record = tmp_path / "figures.jsonl"
    assert structured.main([str(bundled_artifact), "--device", "cpu", "--batch-size", "1", "--batch-size", "3",
                            "--output-len", "10", "--repeats", "1", "--fields", "5", "--threads", "1",
                            "--breakdown", "--record", str(record)]) == 0
    out = capsys.readouterr().out
    figures = {json.loads(line)["figure"]: json.loads(line) for line in record.read_text().splitlines()}
    for n in (1, 3):
        assert figures[f"structured_decode_step_b{n}_fp32"]["value"] > 0
        assert figures[f"structured_free_decode_step_b{n}_fp32"]["value"] > 0
        assert figures[f"structured_mask_fill_b{n}_fp32"]["value"] > 0
    assert "structured_compile_5f_fp32" in figures and "structured_vocab_view_fp32" in figures
    rows = [line.split() for line in out.splitlines() if line.split()[1:3] in (["free", "step"], ["json", "step"])]
    assert [(r[0], r[1]) for r in rows] == [("1", "free"), ("1", "json"), ("3", "free"), ("3", "json")]
    stages = {(r[0], r[1]): dict(zip(r[2::2], map(float, r[3::2]))) for r in rows}
    for (n, name), times in stages.items():  # "step" first, then the stages, every step call timed
        assert set(times) == set(structured.STAGES) and times["step"] > 0
        if name == "json":  # free steps only check that nothing is held
            assert times["_fill_masks"] > 5 * stages[n, "free"]["_fill_masks"], stages


def test_the_mask_fill_advances_the_states_between_fills(bundled_artifact, monkeypatch):
    from runtime.serving import ServingConfig, ServingEngine
    from runtime.structured import GrammarState, StructuredOutput

    engine = ServingEngine.load(bundled_artifact, config=ServingConfig(max_num_seqs=2))
    advanced = []
    advance = GrammarState.advance
    monkeypatch.setattr(GrammarState, "advance", lambda self, t: advanced.append(t) or advance(self, t))
    try:
        prefix = len(engine.tokenizer.encode(structured.RECORDS_PREFIX, add_special_tokens=False))
        assert structured.mask_fill_us(engine, 2, StructuredOutput.json_schema(structured.RECORDS_SCHEMA), 5) > 0
    finally:
        engine.close()
    assert len(advanced) == 2 * (prefix + 5)


def test_the_threads_sweep_pairs_every_thread_count_on_the_same_states():
    """builder.bench.grammar_masks --threads-sweep: one entry per method, the serial fill's ratio to itself 1, every
    time positive, for independent matchers and for copies of templates (the bundled model's vocabulary)."""
    from builder.bench.grammar_masks import threads_sweep
    from builder.bench.structured import RECORDS_SCHEMA
    from runtime.structured import GrammarCompiler, StructuredOutput, grammar_text
    from runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir("models/pystdlib-llama")
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, spread=1)
    text = grammar_text(StructuredOutput.json_schema(RECORDS_SCHEMA))
    try:
        for templates in (0, 2):
            out = threads_sweep(compiler, text, tokenizer.vocab_size, rows=6, steps=3, threads=[1, 2],
                                templates=templates, warm=1)
            assert list(out) == ["serial", "threads 1", "threads 2"]
            assert out["serial"][1] == 1.0 and all(us > 0 and ratio > 0 for us, ratio in out.values())
    finally:
        compiler.close()
