"""Structured output: a request's generated text held to a grammar (a JSON schema, a regular expression, a
choice of strings, a Lark or GBNF grammar) by masking, at every step, the tokens that would leave it.

    caller / server   StructuredOutput(kind, value): plain strings, so it crosses the engine process boundary
                      check(spec): is the grammar valid? (the server answers 400 with what is wrong)
    engine, a worker  GrammarCompiler.submit(spec) -> Future[CompiledGrammar], cached by the spec's hash, so a large
                      schema compiles once and never on the step thread
    engine, a step    GrammarState per request: fill_bitmasks (host) -> sampling.apply_token_bitmask (device, before
                      the draw) -> GrammarState.advance(sampled token)

The grammar engine is llguidance: an Earley parser over a lazily built lexer, so there is no per-grammar pass over
the vocabulary and a mask costs microseconds per step. It reads the vocabulary from the checkpoint's tokenizer.json
(``tokenizers``' own serialization); nothing else is needed.

Bitmask layout (llguidance's, read by ``sampling.apply_token_bitmask``): int32 [rows, ceil(vocab / 32)]; token t is
allowed when bit t % 32 of word t // 32 is set.

JSON is generated compactly on one line, with ", " and ": " as separators (``JSON_FORMAT``: what json.dumps writes),
so a model cannot spend its tokens on whitespace; a schema's own ``x-guidance`` options override this.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import torch
from llguidance import LLMatcher, LLParserLimits, LLTokenizer
from llguidance.gbnf_to_lark import any_to_lark

from runtime.env import env_number
from runtime.tokenizer import Tokenizer

log = logging.getLogger(__name__)

KINDS = ("json", "regex", "choice", "grammar")  # what StructuredOutput.kind may be
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = '{"type": "object"}'  # response_format json_object
MAX_CACHED_GRAMMARS = 512  # compiled grammars kept per engine (least recently used dropped first)
COMPILE_WORKERS = 2  # threads compiling grammars (llguidance releases the GIL while it compiles)

# The vocabulary's "slices" (llguidance's mask optimization): each token belongs to the first of these regexes it
# matches, and a slice whose every token the lexer allows at a step is added to the mask whole instead of walked
# token by token. llguidance's default JSON slices bin string-safe tokens by length 1-10, 11-30 and 31+, so inside a
# string bounded by maxLength (name: max 16, tag: max 8) a bin applies only while at least 10 characters are left and
# the trie walk takes ~2-3 ms a mask at a 128k vocabulary. Bins of each length up to 10, then 11-12, 13-14, 15-16,
# 17-20, 21-30 and 31+, let a mask skip every length that still fits: the same masks (bit for bit on the grammars
# checked: tests/runtime/test_structured.py), 15-25% less time a mask on one thread for JSON schemas on a 128k
# byte-level BPE vocabulary (2-core CPU), level for regexes and Lark grammars (whose lexemes contain no slice). On the
# H200's host, 64 rows on 13 threads, the fill is bound by the threads slowing each other and moved within the spread
# (docs/BENCHMARKS.md, session 53). RUNTIME_GRAMMAR_SLICES=default restores llguidance's own (A/B runs).
_STRING_CHAR = r'[^"\\\x00-\x1F\x7F]'  # a character a JSON string holds unescaped (the regex's text)
_SLICE_LENGTHS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 14, 16, 20, 30)
VOCAB_SLICES = ([r"[\x20\x0A\x0D\x09]+"] + [f"{_STRING_CHAR}{{1,{n}}}" for n in _SLICE_LENGTHS]
                + [f"{_STRING_CHAR}+"])


class StructuredOutputError(ValueError):
    """A grammar, schema, regex or choice list that is malformed or uses what llguidance does not support."""


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match. Plain strings: it crosses process boundaries as JSON."""

    kind: str  # "json": a JSON schema; "regex"; "choice": a JSON list of strings; "grammar": Lark or GBNF text
    value: str  # the schema (JSON text), the regex, the choices (JSON text) or the grammar

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StructuredOutputError(f"structured output kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if not isinstance(self.value, str):
            raise StructuredOutputError(f"structured output value must be a string, got {type(self.value).__name__}")

    @classmethod
    def json_schema(cls, schema: dict) -> StructuredOutput:
        """A JSON schema; its key order is kept (properties are generated in the order they are declared)."""
        return cls("json", json.dumps(schema, ensure_ascii=False))

    @property
    def key(self) -> str:
        """The hash compiled grammars are cached by."""
        return hashlib.sha256(f"{self.kind}\0{self.value}".encode()).hexdigest()


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar of ``spec`` (not yet checked); StructuredOutputError for malformed input."""
    if spec.kind == "json":
        try:
            schema = json.loads(spec.value)
        except json.JSONDecodeError as e:
            raise StructuredOutputError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise StructuredOutputError(f"a JSON schema must be an object, got {type(schema).__name__}")
        try:
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_FORMAT)
        except ValueError as e:
            raise StructuredOutputError(f"the JSON schema cannot be read: {e}") from None
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        try:
            choices = json.loads(spec.value)
        except json.JSONDecodeError as e:
            raise StructuredOutputError(f"the choices are not valid JSON: {e}") from None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise StructuredOutputError("the choices must be a non-empty list of non-empty strings")
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    try:
        lark = any_to_lark(spec.value)
    except Exception as e:  # the GBNF converter raises whatever its parser raises
        raise StructuredOutputError(f"the grammar is neither Lark nor GBNF that converts to Lark: {e}") from None
    return LLMatcher.grammar_from_lark(lark)


def _limits() -> LLParserLimits:
    return LLParserLimits(verbose_errors=False)  # errors name the problem without dumping the parser state


_checked: OrderedDict[str, str] = OrderedDict()  # spec key -> error ("" when valid), most recent last
_checked_lock = threading.Lock()


# how the engine's messages about a request's own grammar begin (a compile that failed, a grammar that cannot
# continue): the server answers those as the client's error, not the engine's
GRAMMAR_ERROR_PREFIX = "structured output: "


def check(spec: StructuredOutput) -> None:
    """Raise StructuredOutputError naming what is wrong when ``spec`` does not compile (checked without the
    vocabulary; results are remembered by the spec's hash)."""
    with _checked_lock:
        error = _checked.get(spec.key)
    if error is None:
        try:
            is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar_text(spec), limits=_limits())
            error = messages[0] if is_error else ""
        except StructuredOutputError as e:
            error = str(e)
        with _checked_lock:
            _checked[spec.key] = error
            while len(_checked) > MAX_CACHED_GRAMMARS:
                _checked.popitem(last=False)
    if error:
        raise StructuredOutputError(error)


_CONSTRAINT_KEYWORDS = frozenset((
    "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minItems", "maxItems",
    "minProperties", "maxProperties", "multipleOf", "pattern", "format", "enum", "const", "required",
    "additionalProperties", "prefixItems", "$ref"))


def locate_error(schema: object, message: str) -> str | None:
    """Where in ``schema`` an error message points (a JSON pointer such as ``/properties/tags/uniqueItems``), or
    None. llguidance names the keyword, type or regex at fault but not where it is: this finds the first key or
    string value equal to something the message quotes, then to a constraint keyword it names."""
    lines = [line.strip() for line in message.splitlines()]
    candidates = re.findall(r'"([^"]+)"|\'([^\']+)\'', message)
    quoted = [a or b for a, b in candidates]
    needles = quoted + ["#" + q for q in quoted if q.startswith("/")]  # a JSON pointer, as a $ref writes it
    needles += [lines[0].rsplit(": ", 1)[-1]] + [line for line in lines if line]
    words = [w for w in re.findall(r"\$?[A-Za-z]+", message) if w in _CONSTRAINT_KEYWORDS]
    for needle, keys_only in [(n, False) for n in needles] + [(w, True) for w in words]:
        if (where := _find(schema, needle, keys_only, "")) is not None:
            return where or "/"
    return None


def _find(node: object, needle: str, keys_only: bool, path: str) -> str | None:
    """The JSON pointer of the first key (or, unless ``keys_only``, string value) equal to ``needle`` under node."""
    if isinstance(node, dict):
        items = list(node.items())
        for key, _ in items:
            if key == needle:
                return f"{path}/{_escape(key)}"
    elif isinstance(node, list):
        items = list(enumerate(node))
    else:
        return None
    for key, value in items:
        here = f"{path}/{_escape(str(key))}"
        if not keys_only and isinstance(value, str) and value == needle:
            return here
        if (found := _find(value, needle, keys_only, here)) is not None:
            return found
    return None


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


# --- compiled grammars and per-request state --------------------------------------------------------------------
class GrammarState:
    """One request's position in its grammar: which tokens may come next, advanced by each emitted token.

    Preemption keeps the state (recompute does not re-emit tokens). ``num_valid_prefix`` and ``rollback`` serve
    speculative decoding: how many draft tokens the grammar accepts, and undoing advances (a verify step's masks,
    ``fill_bitmasks_with_drafts``)."""

    def __init__(self, matcher: LLMatcher) -> None:
        self.matcher = matcher
        self._finished = matcher.is_stopped()

    def advance(self, token_id: int) -> bool:
        """Consume an emitted token; False (and the state is dead, see ``error``) when the grammar refuses it."""
        ok = self.matcher.consume_token(token_id)
        self._finished = self.matcher.is_stopped()
        return ok

    @property
    def finished(self) -> bool:
        """The grammar is complete and nothing can extend it (only EOS may follow). Read when the state last
        moved, so it may be asked while another thread fills this state's mask (the matcher is busy then)."""
        return self._finished

    @property
    def accepting(self) -> bool:
        """The text so far is a complete match (it may still be extended)."""
        return self.matcher.is_accepting()

    @property
    def error(self) -> str | None:
        """Why the state is dead (a refused token, a grammar too complex to continue), or None."""
        if not self.matcher.is_error():
            return None
        return self.matcher.get_error() or "the grammar is in an error state"

    def num_valid_prefix(self, token_ids: list[int]) -> int:
        """How many leading ``token_ids`` the grammar accepts from here, without advancing (draft tokens)."""
        return self.matcher.validate_tokens(token_ids)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` advances (rejected draft tokens)."""
        if not self.matcher.rollback(num_tokens):
            raise RuntimeError(f"rolling back {num_tokens} tokens failed: {self.matcher.get_error()}")
        self._finished = self.matcher.is_stopped()


class CompiledGrammar:
    """A grammar compiled for one vocabulary; cheap to instantiate per request (the parser tables are shared).

    A request's state is a deep copy of a compiled matcher, and copies of one matcher share its lexer (the lazily
    built automaton, behind a lock): many rows of copies of one matcher, filled at once, wait on each other (64 rows
    on the H100 host's 13 mask threads took as long as one by one). So a grammar keeps up to ``spread`` matchers,
    the first compiled before any request runs and the others in the background (``GrammarCompiler``), and hands
    out copies of them in turn."""

    def __init__(self, template: LLMatcher, spread: int = 1) -> None:
        self.spread = spread  # how many matchers it may keep
        self._templates = [template]  # each in its initial state; only ever copied
        self._next = 0
        self._lock = threading.Lock()

    @property
    def num_templates(self) -> int:
        return len(self._templates)

    def add_template(self, template: LLMatcher) -> None:
        with self._lock:
            self._templates.append(template)

    def new_state(self) -> GrammarState:
        with self._lock:
            template = self._templates[self._next % len(self._templates)]
            self._next += 1
        return GrammarState(template.deep_copy())


def new_matcher(tokenizer: LLTokenizer, grammar: str) -> LLMatcher:
    """A matcher of ``grammar`` (``grammar_text``) in its initial state, or in its error state when it does not
    compile (``is_error``)."""
    return LLMatcher(tokenizer, grammar, log_level=0, limits=_limits())


class GrammarCompiler:
    """Compiles grammars for one model's vocabulary on a small thread pool, caching them by the spec's hash.

    ``submit`` returns at once; the future fails with StructuredOutputError when the grammar does not compile. The
    vocabulary view (LLTokenizer, from the tokenizer's tokenizer.json) is built by the first compile, in a worker
    too: it takes up to a second for a large vocabulary."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, *, max_workers: int = COMPILE_WORKERS,
                 max_cached: int = MAX_CACHED_GRAMMARS, spread: int | None = None) -> None:
        self.vocab_size = vocab_size  # the width of the logits (may exceed the tokenizer's; the rest never allowed)
        self.num_words = (vocab_size + 31) // 32  # bitmask words per row
        self._source = tokenizer
        self._tokenizer: LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[str, Future] = OrderedDict()  # spec key -> its compile (done or not)
        self._cache_lock = threading.Lock()
        self._max_cached = max_cached
        self.spread = mask_threads() if spread is None else spread  # matchers per grammar (see CompiledGrammar)

    def tokenizer(self) -> LLTokenizer:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                try:
                    slices = None if os.environ.get("RUNTIME_GRAMMAR_SLICES") == "default" else VOCAB_SLICES
                    self._tokenizer = LLTokenizer(self._source.to_json(), n_vocab=self.vocab_size,
                                                  eos_token=self._source.eos_token_ids, slices=slices)
                except ValueError as e:  # a pre-tokenizer or decoder llguidance cannot map to bytes
                    raise StructuredOutputError(f"this model's tokenizer is not supported (llguidance: {e})") from None
            return self._tokenizer

    def submit(self, spec: StructuredOutput) -> Future:
        """The compile of ``spec`` (Future[CompiledGrammar]): a cached one, or one queued now."""
        key = spec.key
        with self._cache_lock:
            future = self._cache.get(key)
            if future is not None and not future.cancelled():  # a cancelled one compiled nothing: queued again
                self._cache.move_to_end(key)
                return future
            future = self._cache[key] = self._pool.submit(self._compile, spec)
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
            return future

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """``submit`` and wait (tests, benchmarks)."""
        return self.submit(spec).result()

    def _compile(self, spec: StructuredOutput) -> CompiledGrammar:
        text = grammar_text(spec)
        matcher = new_matcher(self.tokenizer(), text)
        if matcher.is_error():
            raise StructuredOutputError(matcher.get_error())
        # the first mask, on a copy: a grammar that compiles but cannot produce a first token (a definition that
        # only refers to itself) fails here, before its request is admitted, instead of at its first step
        probe = matcher.deep_copy()
        mask = fill_bitmasks([GrammarState(probe)], self.num_words)
        if probe.is_error():
            reason = probe.get_error().split("\n")[0].strip()
            raise StructuredOutputError(f"the grammar cannot produce a first token with this vocabulary ({reason}); "
                                        f"a definition that only refers to itself, for example")
        # then a few tokens down one path (the lowest allowed id each time): a grammar whose lexer outgrows
        # llguidance's limits as soon as it moves (a regex repeated 99,999,999 times) fails here too, not mid-request
        for _ in range(PROBE_TOKENS):
            token = first_allowed(mask[0])
            if token is None or probe.is_stopped() or not probe.consume_token(token):
                break
            mask = fill_bitmasks([GrammarState(probe)], self.num_words)
        if probe.is_error() and is_limit_error(probe.get_error()):
            raise StructuredOutputError(f"the grammar is too complex to follow ({probe.get_error().split(chr(10))[0]}"
                                        f"); bound its repetitions and lengths more tightly")
        compiled = CompiledGrammar(matcher, self.spread)
        if compiled.spread > 1:
            self._pool.submit(self._spread, compiled, text)
        return compiled

    def _spread(self, compiled: CompiledGrammar, text: str) -> None:
        """One more matcher for ``compiled`` (see CompiledGrammar), then queue the next: one such task per grammar at
        a time, so that other grammars' first compiles are not queued behind them."""
        try:
            compiled.add_template(new_matcher(self.tokenizer(), text))
        except Exception:  # the grammar compiled once already: keep serving from the matchers it has
            log.exception("compiling another matcher of a grammar failed")
            return
        if compiled.num_templates < compiled.spread:
            try:
                self._pool.submit(self._spread, compiled, text)
            except RuntimeError:  # the compiler is closing
                pass

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_executor: llguidance.LLExecutor | None = None
_PARALLEL_MIN_ROWS = 4  # below this, the rows are filled one by one (the thread pool's hand-off costs more)


def mask_threads() -> int:
    """Threads that fill many rows' masks at once: RUNTIME_MASK_THREADS, else 80% of the CPUs this process may run
    on (at most 32). Counted from the process's CPU affinity and passed explicitly: llguidance's own default comes
    from the CPU quota the container reports, which can be far below the cores it has."""
    threads = env_number("RUNTIME_MASK_THREADS", None)
    if threads is not None:
        if threads < 1:
            raise ValueError(f"RUNTIME_MASK_THREADS={threads} must be at least 1")
        return threads
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(32, round(0.8 * cpus)))


# tokens a compile walks past the first mask (GrammarCompiler._compile)
PROBE_TOKENS = 4
# how llguidance words a limit of its own that a request's grammar ran into (its lexer's or parser's size or fuel)
_LIMIT_ERRORS = ("too many expressions", "too many states", "too many items", "fuel", "too large", "too complex")


def is_limit_error(error: str | None) -> bool:
    """Whether a matcher's error is a limit its grammar ran into (the grammar's size), not a token outside it. The
    words are looked for outside quotes: a refused token's text is quoted in llguidance's message ("token \" limit\"
    doesn't satisfy the grammar")."""
    first = re.sub(r'"(?:[^"\\]|\\.)*"', '""', (error or "").split("\n")[0]).lower()
    return "doesn't satisfy" not in first and any(words in first for words in _LIMIT_ERRORS)


def first_allowed(row: torch.Tensor) -> int | None:
    """The lowest token id a bitmask row [num_words] int32 allows, or None."""
    words = row.nonzero()
    if not len(words):
        return None
    w = int(words[0])
    bits = int(row[w]) & 0xFFFFFFFF
    return w * 32 + ((bits & -bits).bit_length() - 1)


def fill_bitmasks(states: list[GrammarState], num_words: int, pin_memory: bool = False) -> torch.Tensor:
    """The allowed tokens of each state as an int32 bitmask [len(states), num_words] on the host (layout: module
    docstring). Many rows are filled in parallel by llguidance's threads, without the GIL."""
    global _executor
    bitmask = torch.empty((len(states), num_words), dtype=torch.int32, pin_memory=pin_memory)
    row_bytes = num_words * 4
    if len(states) < _PARALLEL_MIN_ROWS:
        for i, state in enumerate(states):
            state.matcher.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), row_bytes)
        return bitmask
    if _executor is None:
        _executor = llguidance.LLExecutor(num_threads=mask_threads())
    _executor.unsafe_compute_mask_ptr([(s.matcher, i) for i, s in enumerate(states)], bitmask.data_ptr(),
                                      row_bytes, len(states))
    return bitmask


def fill_bitmasks_with_drafts(states: list[GrammarState], drafts: list[list[int]], num_words: int,
                              pin_memory: bool = False) -> torch.Tensor:
    """The masks of a speculative verify step's rows: for a state with drafts d_1..d_k, k + 1 rows, the state's own
    mask, then its mask after d_1, ..., after d_1..d_k (each row j is what the grammar allows in the position the
    verify step's row j samples), the states' rows back to back. Every draft must be one the grammar accepts in
    turn (``GrammarState.num_valid_prefix``); the states are left as they were (advanced, then rolled back)."""
    rows = sum(len(d) + 1 for d in drafts)
    bitmask = torch.empty((rows, num_words), dtype=torch.int32, pin_memory=pin_memory)
    row_bytes, row = num_words * 4, 0
    for state, tokens in zip(states, drafts):
        for j in range(len(tokens) + 1):
            state.matcher.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), row_bytes)
            row += 1
            if j < len(tokens) and not state.advance(tokens[j]):
                raise ValueError(f"draft token {tokens[j]} is outside the grammar (drafts must be validated first: "
                                 f"GrammarState.num_valid_prefix)")
        if tokens:
            state.rollback(len(tokens))
    return bitmask

