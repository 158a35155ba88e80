"""What structured output costs: the decode step with a JSON-schema constraint against the same step without, at
each batch size, the host time to fill the masks, and how long a large schema takes to check and to compile.

    python -m builder.bench.structured ARTIFACT [--device auto|cpu|cuda] [--batch-size 1 --batch-size 64]
        [--input-len 32] [--output-len 64] [--repeats 3] [--fields 200] [--tokenizer DIR] [--threads N]
        [--record FILE]

Decode step: N random prompts admitted together and decoded together for --output-len tokens, timed as
``builder bench latency --batch-size N`` times them (median wall time of the steady-state steps); once free (EOS
ignored) and once each request held to RECORDS_SCHEMA, an array of records that cannot close before --output-len
tokens (minItems), so both runs decode every request at every step. Free and constrained runs alternate, --repeats
times each; overhead = constrained / free - 1. On CUDA the steps replay CUDA graphs and overlap the host, as served.

Masks: the host time to fill N requests' masks at once, each request inside a record (llguidance's threads fill
many in parallel, without the GIL); median of 50, each state advanced by a random allowed token between fills
(refilling an unchanged state is several times cheaper than decoding makes it).

Compile: a schema of --fields properties of every kind (bounded strings with patterns, integers and numbers with
bounds, enums, nested objects, arrays, anyOf) checked as the server checks a request's (no vocabulary), then
compiled for the artifact's vocabulary, which is built first and timed apart (once per engine); a second compile
of the same schema is a cache hit.

The grammar's cost per step grows with the vocabulary it walks. An artifact whose tokenizer cannot write JSON (the
random checkpoints of builder.devtools.make_checkpoint have word-level vocabularies of ``t123`` tokens) is refused;
``--tokenizer DIR`` (a directory with a tokenizer.json of at most the model's vocabulary, e.g. Llama 3's 128,256
tokens for the llama3-8b shape) serves the artifact with that tokenizer instead: the prompts are random ids anyway.

Host stages (``--breakdown``): one more free and one more constrained run with the engine's step stages timed on
the host (µs per step): the whole ``step`` call, launching the next step, waiting for the tokens in flight,
recording them (grammars advanced, detokenized, stop checks), sampling (the mask joined or filled, applied, the
draw launched), filling the masks (on whichever thread fills them), copying them to the device, and inside the
sampling, ``runtime.sampling.sample`` and its ``apply_token_bitmask``. On CUDA a further pair of runs records CUDA
events around every forward and sampling launch: the device's time in each, and how long it sat idle before each
(nothing queued: waiting for the host).

Figures (``--record``, the JSON lines of builder.bench.record): structured_free_decode_step_b{N}_{precision} and
structured_decode_step_b{N}_{precision} (ms), structured_overhead_b{N}_{precision} (%),
structured_mask_fill_b{N}_{precision} (us), structured_check_{F}f_{precision}, structured_compile_{F}f_{precision}
and structured_vocab_view_{precision} (ms); the precision names the artifact (the vocabulary differs with it).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterator

import torch

from builder.bench.offline import _random_prompts, _sync, steady_step_seconds, timed_steps
from builder.bench.record import append_figures, precision_of
from runtime.engine import resolve_device
from runtime.sampling import SamplingParams
from runtime.serving import ServingConfig, ServingEngine, _InFlight
from runtime.structured import (GrammarCompiler, StructuredOutput, StructuredOutputError, check, fill_bitmasks,
                                mask_threads)
from runtime.tokenizer import Tokenizer

RECORD = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 99999},
    "name": {"type": "string", "maxLength": 16},
    "kind": {"enum": ["file", "directory", "link"]},
    "size": {"type": "number", "minimum": 0, "maximum": 1e9},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
    "required": ["id", "name", "kind"], "additionalProperties": False}
# minItems: a document cannot close within any realistic --output-len, so every request runs to max_tokens
RECORDS_SCHEMA = {"type": "object", "properties": {"records": {"type": "array", "items": RECORD, "minItems": 1000}},
                  "required": ["records"], "additionalProperties": False}
RECORDS_PREFIX = '{"records": [{"id": 1, "name": "a.txt", "kind": "file", "size": 12.5, "tags": ["x"]}, {"id": 2, "na'


def large_schema(num_fields: int) -> dict:
    """A schema of ``num_fields`` properties cycling through the kinds of constraint, half of them required."""
    kinds = [
        lambda i: {"type": "string", "pattern": f"^[a-z]{{1,{4 + i % 8}}}[0-9]*$", "maxLength": 24},
        lambda i: {"type": "integer", "minimum": -i, "maximum": 1000 + i},
        lambda i: {"type": "number", "exclusiveMinimum": 0, "maximum": i + 1.5},
        lambda i: {"enum": [f"value_{i}_{k}" for k in range(8)]},
        lambda i: {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": ["string", "null"]},
                                                    "c": {"type": "array", "items": {"type": "integer"}}},
                   "required": ["a"], "additionalProperties": False},
        lambda i: {"type": "array", "items": RECORD, "maxItems": 4},
        lambda i: {"anyOf": [{"type": "integer"}, {"type": "string", "format": "date"}]},
    ]
    properties = {f"field_{i}": kinds[i % len(kinds)](i) for i in range(num_fields)}
    return {"type": "object", "properties": properties, "required": list(properties)[::2],
            "additionalProperties": False}


def decode_step_ms(engine: ServingEngine, batch_size: int, input_len: int, output_len: int,
                   structured: StructuredOutput | None, repeat: int) -> list[float]:
    """The steady-state decode step times (ms) of one run of ``batch_size`` requests (see the module docstring)."""
    vocab = int(engine.executor.graph["meta"]["vocab_size"])
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, structured=structured)
    engine.kv.pool.reset_prefix_cache()
    for i, prompt in enumerate(_random_prompts(batch_size, input_len, vocab, repeat)):
        engine.add_request(prompt, params, request_id=f"b{batch_size}-{repeat}-{i}-{structured is not None}")
    outputs = []
    _sync(engine.device)
    with timed_steps(engine) as timings:
        while engine.has_unfinished:
            outputs.append(engine.step())
    _sync(engine.device)
    finishes = {o.request_id: o.finish_reason for out in outputs for o in out if o.finished}
    assert set(finishes.values()) == {"length"}, f"a request did not run to max_tokens: {finishes}"
    return [s * 1e3 for s in steady_step_seconds([(t.end, o) for t, o in zip(timings, outputs)], batch_size)]


STAGES = ("step", "_launch_next", "read", "_record", "_sample", "_fill_masks", "_token_bitmask", "sample",
          "apply_token_bitmask")  # see --breakdown
_FUNCTIONS = {"sample": "runtime.serving", "apply_token_bitmask": "runtime.sampling"}  # module-level stages


@contextlib.contextmanager
def host_stages(engine: ServingEngine) -> Iterator[dict[str, float]]:
    """Seconds spent in each of STAGES while the block runs, summed over calls ("read": waiting for a step in
    flight; "_fill_masks": on whichever thread fills them); "calls": how many ``step`` calls ran."""
    totals: dict[str, float] = defaultdict(float)

    def timed(fn, name):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[name] += time.perf_counter() - start
                if name == "step":
                    totals["calls"] += 1
        return wrapper

    methods = [name for name in STAGES if name != "read" and name not in _FUNCTIONS]
    for name in methods:
        setattr(engine, name, timed(getattr(engine, name), name))
    functions = {name: (importlib.import_module(module), getattr(importlib.import_module(module), name))
                 for name, module in _FUNCTIONS.items()}
    for name, (module, fn) in functions.items():
        setattr(module, name, timed(fn, name))
    read = _InFlight.read
    _InFlight.read = timed(read, "read")
    try:
        yield totals
    finally:
        _InFlight.read = read
        for name, (module, fn) in functions.items():
            setattr(module, name, fn)
        for name in methods:
            delattr(engine, name)


@contextlib.contextmanager
def gpu_timeline(engine: ServingEngine) -> Iterator[list[tuple[str, torch.cuda.Event, torch.cuda.Event]]]:
    """CUDA events around every forward (``_run``) and every sampling (``_sample``) launched in the block, in launch
    order (CUDA only): where the device waited for the host (see ``timeline_gaps``)."""
    marks: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def marked(fn, kind):
        def wrapper(*args, **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                return fn(*args, **kwargs)
            finally:
                end.record()
                marks.append((kind, start, end))
        return wrapper

    engine._run = marked(engine._run, "forward")
    engine._sample = marked(engine._sample, "sample")
    try:
        yield marks
    finally:
        del engine._run, engine._sample


def timeline_gaps(marks: list[tuple[str, torch.cuda.Event, torch.cuda.Event]]) -> dict[str, float]:
    """Mean µs per forward of: the forward on the device, the device idle before it, the sampling, the device idle
    before the sampling (waiting for the host, e.g. for the masks), over the steady part of the run (a quarter of
    the marks at each end left out). An event's time is when the stream reached it, so the gap between one launch's
    end and the next one's start is time the device had nothing queued."""
    torch.cuda.synchronize()
    times = {"forward": [], "idle before forward": [], "sample": [], "idle before sample": []}
    inner = marks[len(marks) // 4: len(marks) - len(marks) // 4]
    for (_, _, prev_end), (kind, start, end) in zip(inner, inner[1:]):
        times[kind].append(start.elapsed_time(end) * 1e3)
        times[f"idle before {kind}"].append(max(prev_end.elapsed_time(start), 0.0) * 1e3)
    return {k: statistics.fmean(v) if v else 0.0 for k, v in times.items()}


def mask_fill_us(engine: ServingEngine, batch_size: int, spec: StructuredOutput, fills: int = 50) -> float:
    """Median host time to fill ``batch_size`` masks, each request inside a record; between two fills every state
    takes a random token its mask allows (seeded), as in decoding, so no fill repeats the one before."""
    grammar = engine.grammars.compile(spec)
    prefix = engine.tokenizer.encode(RECORDS_PREFIX, add_special_tokens=False)
    states = [grammar.new_state() for _ in range(batch_size)]
    for state in states:
        assert all(state.advance(t) for t in prefix), state.error
    pin = engine.device.type == "cuda"
    gen = torch.Generator().manual_seed(0)
    vocab = engine.grammars.vocab_size
    bit = torch.tensor([1 << b if b < 31 else -(1 << 31) for b in range(32)], dtype=torch.int32)
    times = []
    for _ in range(fills):
        start = time.perf_counter()
        bitmask = fill_bitmasks(states, engine.grammars.num_words, pin_memory=pin)
        times.append((time.perf_counter() - start) * 1e6)
        allowed = ((bitmask[:, :, None] & bit) != 0).flatten(1)[:, :vocab].float()
        for state, row in zip(states, allowed):
            token = int(torch.multinomial(row, 1, generator=gen))
            assert state.advance(token), state.error
    return statistics.median(times)


def compile_ms(engine: ServingEngine, num_fields: int) -> dict[str, float]:
    """check (no vocabulary), the vocabulary view, a first compile and a cached one of ``large_schema``, in ms."""
    spec = StructuredOutput.json_schema(large_schema(num_fields))
    start = time.perf_counter()
    check(spec)
    checked = time.perf_counter()
    compiler = GrammarCompiler(engine.tokenizer, engine.grammars.vocab_size)
    compiler.tokenizer()
    viewed = time.perf_counter()
    compiler.compile(spec)
    compiled = time.perf_counter()
    compiler.compile(spec)
    cached = time.perf_counter()
    compiler.close()
    return {"check": (checked - start) * 1e3, "vocab_view": (viewed - checked) * 1e3,
            "compile": (compiled - viewed) * 1e3, "cached": (cached - compiled) * 1e3,
            "schema_kib": len(spec.value) / 1024}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--batch-size", type=int, action="append", help="repeat for several (default: 1 and 64)")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fields", type=int, default=200, help="properties of the schema whose compile is timed")
    parser.add_argument("--tokenizer", default=None, help="serve with this tokenizer directory's vocabulary instead")
    parser.add_argument("--threads", type=int, default=None, help="CPU: torch's threads (on a shared machine, 1 "
                                                                  "keeps other processes from stalling every op)")
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--breakdown", action="store_true", help="also time the step's host stages (see above)")
    parser.add_argument("--profile", action="store_true", help="CUDA: one more constrained run at the largest batch "
                                                              "under torch.profiler; prints the device kernels by time")
    parser.add_argument("--record", default=None, help="append the figures to this JSON-lines file")
    args = parser.parse_args(argv)
    batch_sizes = args.batch_size or [1, 64]
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    max_seq_len = args.input_len + args.output_len + 8
    config = ServingConfig(max_num_seqs=max(batch_sizes), max_seq_len=max_seq_len, cuda_graphs=not args.no_cuda_graphs,
                           num_blocks=None if device.type == "cuda" else max(batch_sizes) * (-(-max_seq_len // 16) + 1))
    engine = ServingEngine.load(args.artifact, device, config)
    vocab = int(engine.executor.graph["meta"]["vocab_size"])
    if args.tokenizer is not None:
        tokenizer = Tokenizer.from_dir(args.tokenizer)
        if tokenizer.vocab_size > vocab:
            parser.error(f"--tokenizer {args.tokenizer} has {tokenizer.vocab_size} tokens; the model's vocabulary has "
                         f"{vocab}")
        engine.tokenizer = tokenizer  # before the first structured request: the grammars take its vocabulary
    spec = StructuredOutput.json_schema(RECORDS_SCHEMA)
    try:  # the runs time decoding, not the first compile (timed below)
        state = engine.grammars.compile(spec).new_state()
    except StructuredOutputError as e:
        parser.error(f"{e}; pass --tokenizer DIR with a byte-level or SentencePiece tokenizer.json of at most {vocab} "
                     f"tokens")
    if not fill_bitmasks([state], engine.grammars.num_words).any():
        parser.error(f"the tokenizer of {args.artifact} cannot write JSON (no token starts a document); pass "
                     f"--tokenizer DIR with a tokenizer.json of at most {vocab} tokens")
    precision = precision_of(engine.executor.graph, engine.engine.artifact.manifest)
    rows, figures, breakdowns, timelines = [], [], [], []
    try:
        for n in batch_sizes:
            engine.run(_random_prompts(n, args.input_len, vocab, 99), SamplingParams(max_tokens=4, ignore_eos=True))
            free: list[float] = []
            held: list[float] = []
            for r in range(args.repeats):  # alternate, so that drift on a shared machine hits both alike
                free += decode_step_ms(engine, n, args.input_len, args.output_len, None, r)
                held += decode_step_ms(engine, n, args.input_len, args.output_len, spec, r)
            free_ms, held_ms = statistics.median(free), statistics.median(held)
            fill = mask_fill_us(engine, n, spec)
            rows.append((n, free_ms, held_ms, fill))
            if args.breakdown:
                for name, s_ in (("free", None), ("json", spec)):
                    with host_stages(engine) as totals:
                        decode_step_ms(engine, n, args.input_len, args.output_len, s_, args.repeats)
                    calls = max(totals.pop("calls", 0), 1)
                    breakdowns.append((n, name, {k: v / calls * 1e6 for k, v in totals.items()}))
                    if device.type == "cuda":
                        with gpu_timeline(engine) as marks:
                            decode_step_ms(engine, n, args.input_len, args.output_len, s_, args.repeats + 1)
                        timelines.append((n, name, timeline_gaps(marks)))
            figures += [(f"structured_free_decode_step_b{n}_{precision}", free_ms, "ms"),
                        (f"structured_decode_step_b{n}_{precision}", held_ms, "ms"),
                        (f"structured_overhead_b{n}_{precision}", (held_ms / free_ms - 1) * 100, "%"),
                        (f"structured_mask_fill_b{n}_{precision}", fill, "us")]
        if args.profile and device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            n = max(batch_sizes)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                decode_step_ms(engine, n, args.input_len, args.output_len, spec, args.repeats + 2)
            print(f"device kernels of a constrained run at batch {n} ({args.output_len} steps), by device time:")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60))
        timing = compile_ms(engine, args.fields)
    finally:
        engine.close()
    figures += [(f"structured_check_{args.fields}f_{precision}", timing["check"], "ms"),
                (f"structured_compile_{args.fields}f_{precision}", timing["compile"], "ms"),
                (f"structured_vocab_view_{precision}", timing["vocab_view"], "ms")]
    threads = f", {torch.get_num_threads()} torch threads" if device.type == "cpu" else ""
    threads += f", {mask_threads()} mask threads"
    print(f"structured output on {device}{threads}: {args.input_len}-token prompts, {args.output_len} tokens out, "
          f"median steady-state decode step over {args.repeats} alternating runs")
    print(f"{'batch':>5}  {'free ms/step':>12}  {'json ms/step':>12}  {'overhead':>8}  {'mask fill us':>12}")
    for n, free_ms, held_ms, fill in rows:
        print(f"{n:>5}  {free_ms:>12.3f}  {held_ms:>12.3f}  {(held_ms / free_ms - 1) * 100:>+7.1f}%  {fill:>12.1f}")
    if breakdowns:
        print(f"host time per step call, µs ({', '.join(STAGES)}):")
        for n, name, per_step in breakdowns:
            print(f"{n:>5} {name:>5}  " + "  ".join(f"{k} {per_step.get(k, 0.0):.1f}" for k in STAGES))
    if timelines:
        print("device timeline, mean µs per launch (CUDA events around each forward and each sampling):")
        for n, name, gaps in timelines:
            print(f"{n:>5} {name:>5}  " + "  ".join(f"{k} {v:.1f}" for k, v in gaps.items()))
    print(f"schema of {args.fields} properties ({timing['schema_kib']:.1f} KiB): check {timing['check']:.1f} ms, "
          f"compile {timing['compile']:.1f} ms, cached {timing['cached']:.3f} ms; the vocabulary view "
          f"{timing['vocab_view']:.1f} ms (once per engine)")
    if args.record:
        command = "python -m builder.bench.structured " + " ".join(sys.argv[1:] if argv is None else argv)
        append_figures(args.record, figures, device, command)
        print(f"appended {len(figures)} figures to {args.record}")
    print(json.dumps({name: round(value, 3) for name, value, _ in figures}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
