"""How fast many requests' grammar masks fill at once, by how their grammar states were made.

    python -m builder.bench.grammar_masks TOKENIZER_DIR [--rows 64] [--steps 24] [--templates 1 4 13]
        [--vocab-size V] [--threads-sweep 1 2 4 8 13 [--sweep-templates 0 13]]

Every row holds RECORDS_SCHEMA (builder.bench.structured) and walks its own seeded random path of allowed tokens;
each step fills all rows' masks at once (``runtime.structured.fill_bitmasks``: llguidance's thread pool) and the
median fill over --steps is printed, per way of making the states. Matchers build their lexer's automaton as
they go and copies share it, so rows copied from templates are measured after a warm-up walk of other copies (as
a served grammar is warm after its first requests); independent matchers start cold, as they would per request:

- ``copies of T``: the rows are deep copies of T compiled matchers (row i of template i mod T): copies of one
  matcher share its lexer, so T bounds how many rows can fill at the same time;
- ``as served``: ``GrammarCompiler``'s grammar, once it has its ``spread`` matchers (``CompiledGrammar``);
- ``independent``: every row a matcher compiled on its own (and the compile time per matcher).

``--threads-sweep N...`` measures instead how the fill scales with llguidance's threads: every step fills the same
states once per thread count (each from its own copies, in a rotating order, so no count reuses another's masks)
and the median time and the median ratio to one-by-one filling on the calling thread are printed, for rows that are
independent matchers (``--sweep-templates 0``) and copies of T templates (the served layout). Row costs are
heavy-tailed (a state that builds new lexer states), so unpaired medians of different steps mislead.

Nothing here needs a model or a GPU; the device's many cores are what it is for.
"""

from __future__ import annotations

import argparse
import statistics
import time

import llguidance
import torch

from builder.bench.structured import RECORDS_SCHEMA
from runtime.structured import (GrammarCompiler, GrammarState, StructuredOutput, fill_bitmasks, grammar_text,
                                mask_threads, new_matcher)
from runtime.tokenizer import Tokenizer

_BITS = torch.tensor([1 << b if b < 31 else -(1 << 31) for b in range(32)], dtype=torch.int32)


def fill_us(states: list[GrammarState], num_words: int, vocab: int, steps: int, seed: int) -> float:
    """Median µs of one fill of every state's mask, each state then advanced by a random allowed token."""
    gen = torch.Generator().manual_seed(seed)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        bitmask = fill_bitmasks(states, num_words)
        times.append((time.perf_counter() - start) * 1e6)
        allowed = ((bitmask[:, :, None] & _BITS) != 0).flatten(1)[:, :vocab].float()
        for state, row in zip(states, allowed):
            assert state.advance(int(torch.multinomial(row, 1, generator=gen))), state.error
    return statistics.median(times[1:])  # the first fill builds the lexers' first states


def _advance(states: list, bitmask: torch.Tensor, vocab: int, gen: torch.Generator, restart) -> None:
    """Each matcher advanced by a random token its mask allows; a stopped one replaced by ``restart(i)``."""
    allowed = ((bitmask[:, :, None] & _BITS) != 0).flatten(1)[:, :vocab].float()
    for i, m in enumerate(states):
        if m.is_stopped() or m.is_error():
            states[i] = restart(i)
        else:
            assert m.consume_token(int(torch.multinomial(allowed[i], 1, generator=gen))), m.get_error()


def threads_sweep(compiler: GrammarCompiler, text: str, vocab: int, rows: int, steps: int, threads: list[int],
                  templates: int, warm: int = 8) -> dict[str, tuple[float, float]]:
    """{method: (median us per fill, median ratio to "serial")} over ``steps`` steps after ``warm`` (see the module
    docstring); methods "serial" (one by one on this thread) and "threads N" (an LLExecutor of N threads)."""
    num_words = compiler.num_words
    if templates:
        bases = [new_matcher(compiler.tokenizer(), text) for _ in range(templates)]
        restart = lambda i: bases[i % templates].deep_copy()  # noqa: E731
    else:
        restart = lambda i: new_matcher(compiler.tokenizer(), text)  # noqa: E731
    states = [restart(i) for i in range(rows)]
    executors = {n: llguidance.LLExecutor(num_threads=n) for n in threads}
    methods = ["serial"] + [f"threads {n}" for n in threads]
    bitmask = torch.empty((rows, num_words), dtype=torch.int32)
    times: dict[str, list[float]] = {m: [] for m in methods}
    ratios: dict[str, list[float]] = {m: [] for m in methods}
    gen = torch.Generator().manual_seed(0)
    for step in range(warm + steps):
        took = {}
        for name in methods[step % len(methods):] + methods[:step % len(methods)]:
            copies = [m.deep_copy() for m in states]  # the current state, no mask cached for it
            start = time.perf_counter()
            if name == "serial":
                for i, m in enumerate(copies):
                    m.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), num_words * 4)
            else:
                executors[int(name.split()[1])].unsafe_compute_mask_ptr(
                    [(m, i) for i, m in enumerate(copies)], bitmask.data_ptr(), num_words * 4, rows)
            took[name] = (time.perf_counter() - start) * 1e6
        if step >= warm:
            for name, us in took.items():
                times[name].append(us)
                ratios[name].append(us / took["serial"])
        _advance(states, bitmask, vocab, gen, restart)
    return {m: (statistics.median(times[m]), statistics.median(ratios[m])) for m in methods}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokenizer")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--templates", type=int, nargs="+", default=[1, 4, 13])
    parser.add_argument("--vocab-size", type=int, default=None, help="mask width (default: the tokenizer's)")
    parser.add_argument("--threads-sweep", type=int, nargs="+", default=None, metavar="N",
                        help="instead: the fill's scaling with llguidance's threads, paired on the same states")
    parser.add_argument("--sweep-templates", type=int, nargs="+", default=[0, 13],
                        help="row layouts of the sweep: 0 = every row its own matcher, T = copies of T templates")
    args = parser.parse_args(argv)
    tokenizer = Tokenizer.from_dir(args.tokenizer)
    vocab = args.vocab_size or tokenizer.vocab_size
    compiler = GrammarCompiler(tokenizer, vocab)
    spec = StructuredOutput.json_schema(RECORDS_SCHEMA)
    text = grammar_text(spec)
    if args.threads_sweep:
        for t in args.sweep_templates:
            layout = "independent matchers" if t == 0 else f"copies of {t} templates"
            print(f"{args.rows} rows of RECORDS_SCHEMA, {vocab}-token vocabulary, {layout}; {args.steps} fills per "
                  f"method on the same states")
            for name, (us, ratio) in threads_sweep(compiler, text, vocab, args.rows, args.steps, args.threads_sweep,
                                                   t).items():
                print(f"  {name:>10}: {us:8.0f} us per fill (median), {us / args.rows:6.1f} per row, "
                      f"{ratio:5.2f}x the serial fill's time (median of the steps' ratios)")
        compiler.close()
        return 0
    print(f"{args.rows} rows of RECORDS_SCHEMA, {vocab}-token vocabulary, {mask_threads()} mask threads; median "
          f"fill of all rows over {args.steps} steps")
    for t in args.templates:
        templates = [new_matcher(compiler.tokenizer(), text) for _ in range(t)]
        fill_us([GrammarState(templates[i % t].deep_copy()) for i in range(args.rows)], compiler.num_words, vocab,
                args.steps, 0)  # warm-up: the lexers' automata, kept by the templates for later copies
        states = [GrammarState(templates[i % t].deep_copy()) for i in range(args.rows)]
        us = fill_us(states, compiler.num_words, vocab, args.steps, 1)
        print(f"copies of {t:>3}: {us:9.0f} us per fill, {us / args.rows:7.1f} per row")
    grammar = compiler.compile(spec)
    start = time.perf_counter()
    while grammar.num_templates < grammar.spread and time.perf_counter() - start < 60:
        time.sleep(0.01)
    spread_s = time.perf_counter() - start
    fill_us([grammar.new_state() for _ in range(args.rows)], compiler.num_words, vocab, args.steps, 0)  # warm-up
    us = fill_us([grammar.new_state() for _ in range(args.rows)], compiler.num_words, vocab, args.steps, 1)
    print(f"as served ({grammar.num_templates} matchers, the others ready {spread_s * 1e3:.0f} ms after the first): "
          f"{us:9.0f} us per fill, {us / args.rows:7.1f} per row")
    start = time.perf_counter()
    matchers = [new_matcher(compiler.tokenizer(), text) for _ in range(args.rows)]
    compile_ms = (time.perf_counter() - start) * 1e3 / args.rows
    us = fill_us([GrammarState(m) for m in matchers], compiler.num_words, vocab, args.steps, 1)  # cold, as served
    print(f"independent: {us:9.0f} us per fill, {us / args.rows:7.1f} per row (compiled in {compile_ms:.1f} ms each)")
    compiler.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
