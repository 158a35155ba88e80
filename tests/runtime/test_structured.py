"""Structured output (runtime.structured) and tool calls (runtime.tool_calls): grammars checked and compiled, the
allowed-token bitmask against a brute-force reference, the mask applied on the logits, and the serving engine
holding the bundled model - whose free output is Python, rarely JSON - to a table of JSON schemas, greedy and
sampled, batched with free requests, through preemption, chunked prefill, the prefix cache and the overlapped
pipeline. The HTTP side is tests/runtime/test_server_structured.py.
"""

from __future__ import annotations

import dataclasses
import json
import random
import threading
import time

import jsonschema
import pytest
import torch
from llguidance import LLTokenizer

from runtime import Engine, SamplingParams
from runtime.sampling import SamplingError, TokenBitmask, apply_token_bitmask, sample
from runtime.scheduler import RequestStatus
from runtime.serving import ServingConfig, ServingEngine
from runtime.structured import (GRAMMAR_ERROR_PREFIX, CompiledGrammar, GrammarCompiler, GrammarState,
                                StructuredOutput, StructuredOutputError, check, fill_bitmasks, first_allowed,
                                grammar_text, locate_error, mask_threads, new_matcher)
from runtime.tool_calls import (CALL_OPEN, ToolCallParser, ToolError, format_call, parse_tools, resolve_tool_choice,
                                tool_grammar)


def _str(n: int) -> dict:
    return {"type": "string", "maxLength": n}


def _obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False}


def _int(lo: int, hi: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


# Every schema bounds its strings, arrays and numbers, so that any document it allows fits in MAX_TOKENS: then every
# request must end with its grammar complete ("stop"), and a document that does not validate is the engine's fault.
SCHEMAS: dict[str, dict] = {
    "flat_object": _obj({"name": _str(10), "age": _int(0, 120)}),
    "nested_object": _obj({"user": _obj({"id": _int(1, 999), "email": _str(12)})}),
    "array_of_ints": {"type": "array", "items": _int(-50, 50), "minItems": 1, "maxItems": 4},
    "array_of_objects": {"type": "array", "items": _obj({"k": _str(6), "v": {"type": "boolean"}}), "minItems": 1,
                         "maxItems": 2},
    "enum_string": {"enum": ["red", "green", "blue"]},
    "enum_in_object": _obj({"level": {"enum": ["debug", "info", "warning", "error"]}, "code": {"enum": [200, 404, 500]}}),
    "bounded_numbers": _obj({"ratio": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.05},
                             "temp": {"type": "number", "exclusiveMinimum": -10, "exclusiveMaximum": 40,
                                      "multipleOf": 0.5}}),
    "bounded_integer": _int(10, 99),
    "optional_fields": _obj({"a": _int(0, 9), "b": _str(5), "c": {"type": "boolean"}}, required=["a"]),
    "any_of": {"anyOf": [_int(0, 1000), _obj({"err": _str(8)})]},
    "any_of_in_object": _obj({"value": {"anyOf": [{"type": "boolean"}, {"type": "null"}, _str(6)]}}),
    "string_patterns": _obj({"version": {"type": "string", "pattern": r"^[0-9]\.[0-9]{1,2}\.[0-9]$"},
                             "ident": {"type": "string", "pattern": "^[a-z_][a-z0-9_]{0,7}$"}}),
    "date_pattern": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
    "boolean": {"type": "boolean"},
    "null_or_int": {"type": ["integer", "null"], "minimum": 0, "maximum": 9},
    "const_and_enum": _obj({"kind": {"const": "point"}, "axis": {"enum": ["x", "y", "z"]}}),
    "tuple": {"type": "array", "prefixItems": [_int(0, 9), {"enum": ["a", "b"]}], "items": False},
    "string_length_bounds": _obj({"code": {"type": "string", "minLength": 3, "maxLength": 3, "pattern": "^[A-Z]+$"}}),
    "deep_nesting": _obj({"a": _obj({"b": _obj({"c": {"type": "array", "items": _int(0, 9), "maxItems": 2}})})}),
    "defs_and_refs": {"$defs": {"pt": _obj({"x": _int(0, 9), "y": _int(0, 9)})},
                      **_obj({"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}})},
    "multiple_of": {"type": "integer", "minimum": 0, "maximum": 100, "multipleOf": 5},
    "array_of_enums": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 2, "maxItems": 3},
}
MAX_TOKENS = 48
PROMPT = "import json\n\nvalue = json.loads('"


def validates(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


@pytest.fixture(scope="module")
def engine(bundled_artifact) -> Engine:
    return Engine.load(bundled_artifact)


@pytest.fixture(scope="module")
def compiler(engine) -> GrammarCompiler:
    vocab = int(engine.executor.graph["meta"]["vocab_size"])
    return GrammarCompiler(engine.tokenizer, vocab)


def _serving(engine: Engine, **config) -> ServingEngine:
    return ServingEngine(engine, ServingConfig(**{"num_blocks": 256, "max_num_seqs": 64, **config}))


def _assert_no_leaks(s: ServingEngine) -> None:
    assert s.scheduler.num_unfinished == 0 and not s._compiling and s._inflight is None
    assert s.kv.pool.num_free == s.kv.pool.num_blocks


# --- grammars ------------------------------------------------------------------------------------------------------
def test_every_schema_of_the_table_compiles():
    assert len(SCHEMAS) >= 20
    for schema in SCHEMAS.values():
        check(StructuredOutput.json_schema(schema))


@pytest.mark.parametrize("spec, message, where", [
    (StructuredOutput.json_schema(_obj({"tags": {"type": "array", "uniqueItems": True}})), "uniqueItems",
     "/properties/tags/uniqueItems"),
    (StructuredOutput.json_schema(_obj({"a": {"type": "strin"}})), "strin", "/properties/a/type"),
    (StructuredOutput.json_schema(_obj({"a": {"type": "string", "pattern": "(?=x)"}})), "look-around",
     "/properties/a/pattern"),
    (StructuredOutput.json_schema({"if": {"type": "string"}}), "if", "/if"),
    (StructuredOutput.json_schema(_obj({"p": {"$ref": "#/$defs/missing"}})), "/$defs/missing", "/properties/p/$ref"),
    (StructuredOutput("json", "{not json"), "not valid JSON", None),
    (StructuredOutput("json", "[1, 2]"), "must be an object", None),
    (StructuredOutput("regex", "a(b"), "unclosed group", None),
    (StructuredOutput("choice", "[]"), "non-empty list", None),
    (StructuredOutput("choice", '["a", 3]'), "non-empty list", None),
    (StructuredOutput("grammar", "start: undefined_rule"), "undefined_rule", None),
], ids=["unsupported keyword", "bad type", "regex look-around", "if/then", "dangling $ref", "schema not JSON",
        "schema not an object", "bad regex", "no choices", "non-string choice", "undefined Lark rule"])
def test_a_bad_grammar_is_refused_naming_what_is_wrong(spec, message, where):
    with pytest.raises(StructuredOutputError, match=None) as e:
        check(spec)
    assert message in str(e.value)
    if where is not None:
        assert locate_error(json.loads(spec.value), str(e.value)) == where


def test_structured_output_spec_is_checked_and_crosses_as_a_dict():
    with pytest.raises(StructuredOutputError, match="kind 'xml'"):
        StructuredOutput("xml", "<a/>")
    spec = StructuredOutput.json_schema({"b": 1, "a": 2})
    assert json.loads(spec.value) == {"b": 1, "a": 2} and list(json.loads(spec.value)) == ["b", "a"]  # order kept
    assert spec.key == StructuredOutput(spec.kind, spec.value).key != StructuredOutput.json_schema({"a": 2, "b": 1}).key
    params = SamplingParams(max_tokens=5, structured=StructuredOutput("regex", "[a-z]+"))
    sent = json.dumps(dataclasses.asdict(params))  # what runtime.engine_process sends: JSON, no pickles
    assert SamplingParams(**json.loads(sent)) == params
    with pytest.raises(SamplingError, match="structured"):
        SamplingParams(structured={"kind": "regex"})


def test_compiles_are_cached_by_hash(compiler):
    a = compiler.submit(StructuredOutput.json_schema(SCHEMAS["flat_object"]))
    b = compiler.submit(StructuredOutput("json", json.dumps(json.loads(json.dumps(SCHEMAS["flat_object"])))))
    assert a is b  # the same schema again (another request): one compile
    assert compiler.submit(StructuredOutput.json_schema(SCHEMAS["boolean"])) is not a
    with pytest.raises(StructuredOutputError):
        compiler.compile(StructuredOutput("regex", "a(b"))


@pytest.mark.parametrize("spec", [
    StructuredOutput.json_schema(SCHEMAS["flat_object"]),  # a string of at most 10 characters
    StructuredOutput.json_schema(_obj({"tags": {"type": "array", "items": _str(3), "maxItems": 4}, "note": _str(40),
                                       "free": {"type": "string"}})),
    StructuredOutput.json_schema({"type": "object"}),
    StructuredOutput("regex", "[A-Za-z0-9 ,.]{0,40}"),
    StructuredOutput("grammar", 'start: item+\nitem: /[a-z_]+/ "(" /[0-9]+/ ")" " "'),
], ids=["bounded string", "short and long strings", "any object", "regex", "lark"])
def test_the_runtime_vocabulary_slices_mask_as_llguidance_defaults_do(compiler, spec):
    """The runtime's length-binned slices (structured.VOCAB_SLICES) only let whole slices skip the trie walk: along
    random paths of allowed tokens every mask equals the one llguidance's default slices give."""
    vocab = compiler.vocab_size
    ours = compiler.tokenizer()
    default = ours.with_slices(LLTokenizer.general_slices())
    text = grammar_text(spec)
    words = compiler.num_words
    gen = random.Random(7)
    for _ in range(6):
        a, b = new_matcher(ours, text), new_matcher(default, text)
        for _ in range(40):
            if a.is_stopped():
                break
            mask_a, mask_b = fill_bitmasks([GrammarState(a)], words), fill_bitmasks([GrammarState(b)], words)
            assert torch.equal(mask_a, mask_b)
            allowed = [t for t in range(vocab) if (int(mask_a[0, t // 32]) >> (t % 32)) & 1]
            token = gen.choice(allowed)
            assert a.consume_token(token) and b.consume_token(token)


def test_a_grammar_spreads_its_requests_over_several_matchers(engine):
    """Copies of one matcher share its lexer (behind a lock), so a grammar compiles up to ``spread`` matchers, the
    first before its future resolves and the others in the background, and hands out copies of them in turn; every
    copy masks alike."""
    vocab = int(engine.executor.graph["meta"]["vocab_size"])
    compiler = GrammarCompiler(engine.tokenizer, vocab, spread=3)
    try:
        grammar = compiler.compile(StructuredOutput.json_schema(SCHEMAS["flat_object"]))
        assert grammar.num_templates >= 1 and grammar.spread == 3
        deadline = time.monotonic() + 30
        while grammar.num_templates < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert grammar.num_templates == 3
        states = [grammar.new_state() for _ in range(6)]
        masks = fill_bitmasks(states, compiler.num_words)
        assert all(torch.equal(masks[0], m) for m in masks[1:])
    finally:
        compiler.close()
    assert GrammarCompiler(engine.tokenizer, vocab).spread == mask_threads()

    class Template:  # which template each state was copied from
        def __init__(self, name):
            self.name = name

        def deep_copy(self):
            return self

        def is_stopped(self):
            return False

    compiled = CompiledGrammar(Template("a"), spread=2)
    assert [compiled.new_state().matcher.name for _ in range(2)] == ["a", "a"]
    compiled.add_template(Template("b"))
    assert [compiled.new_state().matcher.name for _ in range(4)] == ["a", "b", "a", "b"]


def _allowed(bitmask_row: torch.Tensor, vocab: int) -> set[int]:
    return {t for t in range(vocab) if (int(bitmask_row[t // 32]) >> (t % 32)) & 1}


def test_bitmask_allows_exactly_the_tokens_that_keep_a_choice_possible(engine, compiler):
    """Reference: a token may come next when its text, after what was emitted, is still a prefix of a choice."""
    tok = engine.tokenizer
    choices = ["import os", "import sys", "def main():"]
    state = compiler.compile(StructuredOutput("choice", json.dumps(choices))).new_state()
    text, vocab = "", compiler.vocab_size
    special = set(tok.eos_token_ids) | {tok.bos_token_id, tok.pad_token_id}
    while not state.finished:
        allowed = _allowed(fill_bitmasks([state], compiler.num_words)[0], vocab)
        want = set()
        for t in range(tok.vocab_size):
            piece = tok.decode([t], skip_special_tokens=False)
            if t not in special and piece and "\ufffd" not in piece and any(
                    c.startswith(text + piece) for c in choices):
                want.add(t)
        if text in choices:
            want |= set(tok.eos_token_ids)
        assert allowed - set(range(tok.vocab_size)) == set(), "a token past the tokenizer's vocabulary is allowed"
        # byte-level pieces of multi-byte characters decode to U+FFFD alone: compare the others exactly
        assert {t for t in allowed if "\ufffd" not in tok.decode([t], skip_special_tokens=False)} == want, text
        token = min(want - set(tok.eos_token_ids), key=lambda t: -len(tok.decode([t])))  # the longest piece
        assert state.advance(token)
        text += tok.decode([token])
    assert text in choices and state.accepting
    assert not state.advance(tok.encode("x", add_special_tokens=False)[0]) and state.error


def test_draft_tokens_are_checked_without_advancing_and_rolled_back(engine, compiler):
    """The hooks speculative decoding uses: how many draft tokens the grammar takes, and undoing them."""
    tok = engine.tokenizer
    state = compiler.compile(StructuredOutput.json_schema(SCHEMAS["flat_object"])).new_state()
    good = tok.encode('{"name": "x", "age": 4', add_special_tokens=False)
    bad = good + tok.encode("x", add_special_tokens=False)
    assert state.num_valid_prefix(bad) == len(good)
    for t in good:
        assert state.advance(t)
    state.rollback(len(good))
    assert state.num_valid_prefix(good) == len(good) and state.error is None


@pytest.mark.parametrize("rows", [[1, 3], [0, 1, 2, 3, 4]], ids=["some rows", "every row"])
def test_apply_token_bitmask_matches_a_reference(rows):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 70, generator=g)
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), 3), generator=g, dtype=torch.int64).to(torch.int32)
    out = apply_token_bitmask(logits, TokenBitmask(rows, bitmask))
    want = logits.clone()
    for j, row in enumerate(rows):
        for t in range(70):
            if not (int(bitmask[j, t // 32]) >> (t % 32)) & 1:
                want[row, t] = float("-inf")
    assert torch.equal(out, want) and torch.isinf(out).sum() > 20
    assert not torch.isinf(logits).any(), "the raw logits were modified"


def test_sample_refuses_structured_rows_without_their_mask():
    params = [SamplingParams(), SamplingParams(structured=StructuredOutput("regex", "[0-9]"))]
    with pytest.raises(ValueError, match=r"rows \[1\] ask for structured output"):
        sample(torch.zeros(2, 8), params, [None, None])
    # with the mask, the masked row takes its only allowed token even against the logits
    mask = TokenBitmask([1], torch.tensor([[1 << 5]], dtype=torch.int32))
    logits = torch.arange(8.0).repeat(2, 1)
    assert sample(logits, params, [None, None], token_bitmask=mask).tolist() == [7, 5]


# --- tool calls ----------------------------------------------------------------------------------------------------
# (no additionalProperties: a function's arguments are still only its declared parameters)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": _str(12)},
                                                           "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": _obj({"a": _int(0, 9), "b": _int(0, 9)})}}


@pytest.mark.parametrize("tools, choice, message", [
    ([{"type": "retrieval"}], None, "tools[0]: each tool must be"),
    ([{"type": "function", "function": {"name": "bad name"}}], None, "tools[0].function.name"),
    ([WEATHER, WEATHER], None, "declared twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], None,
     "tools[0].function.parameters"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice: names the function 'nope'"),
    ([WEATHER], "sometimes", "tool_choice: must be"),
    ([], "required", "needs tools"),
])
def test_bad_tools_are_refused_naming_the_field(tools, choice, message):
    with pytest.raises(ToolError) as e:
        resolve_tool_choice(choice, parse_tools(tools))
    assert message in str(e.value)


def test_tool_grammars_compile_and_hold_the_format(engine, compiler):
    tools = parse_tools([WEATHER, ADD])
    tok = engine.tokenizer
    call = format_call("add", '{"a": 1, "b": 2}')
    for choice, text, ok in [("auto", "No call needed.", True), ("auto", "Sure. " + call, True),
                             ("required", call + "\n" + call, True), ("required", "Sure. " + call, False),
                             (tools[0], call, False), (tools[1], call, True),
                             ("required", format_call("add", '{"a": 10, "b": 2}'), False),
                             ("required", format_call("get_weather", '{"city": "P", "when": "now"}'), False)]:
        state = compiler.compile(tool_grammar(tools, choice)).new_state()
        taken = all(state.advance(t) for t in tok.encode(text, add_special_tokens=False))
        assert taken and state.accepting if ok else not taken, (choice, text)
    assert tool_grammar(tools, "none") is None


def test_tool_call_parser_streams_what_it_returns_whole():
    text = ("Let me check.  " + format_call("get_weather", '{"city": "P}a\\"ris"}') + "\n" +
            format_call("add", '{"a": 1, "b": 2}') + "\n  done \n")
    rng = random.Random(0)
    for _ in range(50):
        parser, content, names, args = ToolCallParser(), "", {}, {}
        i = 0
        while i <= len(text):
            n = rng.randint(1, 9)
            delta = parser.feed(text[i:i + n]) if i < len(text) else parser.finish()
            i += n
            content += delta.content
            for index, call, piece in delta.calls:
                if call is not None:
                    assert index not in names, "a call began twice"
                    names[index] = call.name
                args[index] = args.get(index, "") + piece
        assert content == parser.content == "Let me check.\ndone"
        assert names == {0: "get_weather", 1: "add"}
        assert args == {0: '{"city": "P}a\\"ris"}', 1: '{"a": 1, "b": 2}'} == {
            i: c.arguments for i, c in enumerate(parser.calls)}
        assert all(c.complete for c in parser.calls)
    cut = ToolCallParser()  # cut off by max_tokens inside the arguments: the call is there, incomplete
    cut.feed(format_call("add", '{"a": 1, "b": 2}').split(", \"b")[0])
    cut.finish()
    assert [(c.name, c.arguments, c.complete) for c in cut.calls] == [("add", '{"a": 1', False)]


@pytest.mark.parametrize("cut_after, arguments, content", [
    ('{"x": 1}}\n</to', '{"x": 1}', ""),  # inside the closing: none of it is arguments
    ('{"x": 1}}\n', '{"x": 1}', ""),
    ('{"x": 1}}', '{"x": 1}', ""),  # the first "}" of the closing: the arguments parse without it
    ('{"x": {"y": 1}}', '{"x": {"y": 1}}', ""),  # the arguments' own last "}": they parse with it
    ('{"x": 1}}\n</tool_call>\n<to', '{"x": 1}', ""),  # a second call's opening cut short: not content
])
def test_a_call_cut_off_by_max_tokens_keeps_only_its_arguments(cut_after, arguments, content):
    """Whole or streamed in any pieces, the markup of a call cut off by max_tokens never reaches its arguments or
    the content."""
    text = CALL_OPEN + '\n{"name": "get", "arguments": ' + cut_after
    rng = random.Random(0)
    for _ in range(20):
        parser, args, said, cuts = ToolCallParser(), "", "", [0]
        while cuts[-1] < len(text):
            cuts.append(min(len(text), cuts[-1] + rng.randint(1, 6)))
        for delta in [parser.feed(text[a:b]) for a, b in zip(cuts, cuts[1:])] + [parser.finish(cut_off=True)]:
            said += delta.content
            args += "".join(piece for _, _, piece in delta.calls)
        assert (parser.calls[0].arguments, args, said, parser.content) == (arguments, arguments, content, content)
    prose = ToolCallParser()  # a lone "<" at the end of content is text
    assert prose.feed("if a <").content + prose.finish(cut_off=True).content == prose.content == "if a <"
    ended = ToolCallParser()  # an output that finished (EOS, a stop string) ending in "<to" ends in text
    assert ended.feed("compare a<to").content + ended.finish().content == ended.content == "compare a<to"


# --- the serving engine on the bundled model -----------------------------------------------------------------------
def test_every_schema_validates_greedy_and_sampled_batched_with_free_requests(engine):
    """One batch: each schema greedy and sampled, beside free requests; every document is complete and valid. The
    same prompt without a schema gives no document valid under any schema (the constraint is what does it)."""
    s = _serving(engine)
    prompt = engine.tokenizer.encode(PROMPT)
    names = list(SCHEMAS)
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=i,
                             structured=StructuredOutput.json_schema(SCHEMAS[name]))
              for i, name in enumerate(names) for temperature in (0.0, 1.0)]
    free = [SamplingParams(max_tokens=MAX_TOKENS), SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=1)]
    outs = s.run([prompt] * (len(params) + len(free)), params + free)
    for out, p, name in zip(outs, params, [n for n in names for _ in range(2)]):
        assert out.finish_reason == "stop", (name, p.temperature, out.text, out.error)
        assert validates(out.text, SCHEMAS[name]), (name, p.temperature, out.text)
        assert out.token_ids[-1] not in engine.tokenizer.eos_token_ids or out.text
    assert len({o.text for o in outs[:len(params)]}) > len(names)  # sampling chose other documents
    for out in outs[len(params):]:
        assert not any(validates(out.text, schema) for schema in SCHEMAS.values()), out.text
    _assert_no_leaks(s)


def test_a_grammar_that_cannot_finish_in_max_tokens_ends_with_length(engine):
    s = _serving(engine)
    schema = SCHEMAS["defs_and_refs"]  # its shortest document is 40-odd characters
    out, = s.run([engine.tokenizer.encode(PROMPT)],
                 SamplingParams(max_tokens=6, structured=StructuredOutput.json_schema(schema)))
    assert out.finish_reason == "length" and len(out.token_ids) == 6 and not validates(out.text, schema)
    _assert_no_leaks(s)


def test_preemption_and_recompute_keep_the_grammar_state(engine):
    """Too few KV blocks for the batch: requests are preempted mid-document and recomputed; their documents are
    the ones generated without preemption."""
    names = ["nested_object", "array_of_objects", "defs_and_refs", "deep_nesting"]
    prompts = [engine.tokenizer.encode(f"{PROMPT[:-2]} # {i}\nv{i} = json.loads('") for i in range(len(names))]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0 if i % 2 else 1.0, seed=i,
                             structured=StructuredOutput.json_schema(SCHEMAS[n])) for i, n in enumerate(names)]
    want = _serving(engine).run(prompts, params)
    tight = _serving(engine, num_blocks=8, max_seq_len=96, enable_prefix_caching=False)
    got = tight.run(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    for g, w, name in zip(got, want, names):
        assert g.token_ids == w.token_ids and g.finish_reason == "stop" and validates(g.text, SCHEMAS[name])
    _assert_no_leaks(tight)


def test_chunked_prefill_and_prefix_cache_hits(engine):
    """A prompt longer than a step's token budget is prefilled in chunks; the same prompt again is served from the
    prefix cache; both give the same document."""
    s = _serving(engine, max_num_batched_tokens=32)
    prompt = engine.tokenizer.encode("import os\nimport sys\n" * 12 + PROMPT)
    assert len(prompt) > 2 * 32
    params = SamplingParams(max_tokens=MAX_TOKENS, structured=StructuredOutput.json_schema(SCHEMAS["enum_in_object"]))
    first, = s.run([prompt], params)
    second, = s.run([prompt], params)
    assert second.num_cached_tokens > 0
    assert first.token_ids == second.token_ids and validates(first.text, SCHEMAS["enum_in_object"])
    _assert_no_leaks(s)


def test_the_overlapped_pipeline_masks_with_the_tokens_in_flight(engine, monkeypatch):
    """With steps launched ahead (CUDA graphs, here an eager stand-in), a structured request's sampling waits for
    the tokens in flight to advance its grammar: the tokens equal the synchronous path's, the pipeline kept
    running ahead, and the masks were filled on the worker thread while the step before was recorded."""
    from test_overlap import _pair

    import threading

    import runtime.serving

    sync, overlapped, graphs = _pair(engine, num_blocks=128, max_num_seqs=16)
    fill, threads = runtime.serving.fill_bitmasks, []

    def recorded_fill(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return fill(*args, **kwargs)

    monkeypatch.setattr(runtime.serving, "fill_bitmasks", recorded_fill)
    prompt = engine.tokenizer.encode(PROMPT)
    names = ["flat_object", "array_of_objects", "boolean", "defs_and_refs"]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=t, seed=i,
                             structured=StructuredOutput.json_schema(SCHEMAS[n]))
              for i, n in enumerate(names) for t in (0.0, 1.0)]
    params += [SamplingParams(max_tokens=20, ignore_eos=True), SamplingParams(max_tokens=20, temperature=1.0, seed=3)]
    want = sync.run([prompt] * len(params), params)
    threads.clear()  # the overlapped engine's fills only
    got = overlapped.run([prompt] * len(params), params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(validates(o.text, SCHEMAS[n]) for o, n in zip(got, [n for n in names for _ in range(2)]))
    assert graphs.num_device_inputs > 10, "the pipeline never ran ahead"
    # the masks of a step in flight are filled on the worker while the step before is recorded
    assert sum(name.startswith("masks") for name in threads) > 10, threads
    _assert_no_leaks(overlapped)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_token_the_grammar_refuses_fails_that_request_alone(engine, monkeypatch, overlap):
    """Were a token outside the grammar sampled (here the mask is switched off), the grammar refuses it, with the
    step launched ahead or not, and that request alone fails, without the token; the free request beside it runs to
    the end."""
    import runtime.sampling
    from test_overlap import _pair

    sync, overlapped, _ = _pair(engine, num_blocks=128, max_num_seqs=16)
    s = overlapped if overlap else sync
    monkeypatch.setattr(runtime.sampling, "apply_token_bitmask", lambda logits, mask: logits)
    refused_on = []
    advance = GrammarState.advance

    def recorded(state, token):
        ok = advance(state, token)
        if not ok:
            refused_on.append(threading.current_thread().name)
        return ok

    monkeypatch.setattr(GrammarState, "advance", recorded)
    prompt = engine.tokenizer.encode("Write some prose, not JSON: the")
    held, free = s.run([prompt, prompt], [
        SamplingParams(max_tokens=16, structured=StructuredOutput.json_schema(SCHEMAS["flat_object"])),
        SamplingParams(max_tokens=16, ignore_eos=True)])
    assert held.finish_reason == "error" and "sampled outside the request's grammar" in held.error, held
    assert free.finish_reason == "length" and len(free.token_ids) == 16
    assert refused_on == ["MainThread"], refused_on  # advanced where the step is recorded
    _assert_no_leaks(s)


def test_a_slow_compile_holds_up_only_its_own_request(engine, monkeypatch):
    """The grammar compiles off the step thread: while it does, its request is PREPARING and the others run."""
    s = _serving(engine)
    release = threading.Event()
    compile_one = type(s.grammars)._compile

    def slow(self, spec):
        assert release.wait(30)
        return compile_one(self, spec)

    monkeypatch.setattr(type(s.grammars), "_compile", slow)
    prompt = engine.tokenizer.encode(PROMPT)
    slow_id = s.add_request(prompt, SamplingParams(max_tokens=MAX_TOKENS, structured=StructuredOutput.json_schema(
        SCHEMAS["const_and_enum"])))
    free_id = s.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    assert s.stats().num_waiting == 2
    finished = {}
    while free_id not in finished:
        finished.update({o.request_id: o for o in s.step() if o.finished})
    assert s.scheduler.get(slow_id).status is RequestStatus.PREPARING and slow_id not in finished
    release.set()
    text = ""
    while s.has_unfinished:
        for o in s.step():
            text += o.text if o.request_id == slow_id else ""
            finished.update({o.request_id: o} if o.finished else {})
    assert finished[slow_id].finish_reason == "stop" and validates(text, SCHEMAS["const_and_enum"])
    _assert_no_leaks(s)


def test_a_grammar_that_outgrows_its_limits_once_it_moves_is_refused_at_compile(compiler):
    """a{99999999} compiles and yields a first mask; its lexer then runs past llguidance's limits at the first
    token. The compile walks a few tokens down one path, so the request is refused before it is admitted (the
    server's 400), and a JSON schema of every table entry still compiles."""
    with pytest.raises(StructuredOutputError, match=r"too complex to follow \(lexer error: too many expressions"):
        compiler.compile(StructuredOutput("regex", "a{99999999}"))
    compiler.compile(StructuredOutput("regex", "a{1,40}b"))
    row = torch.zeros(4, dtype=torch.int32)
    assert first_allowed(row) is None
    row[2] = -(1 << 31) | (1 << 5)  # bit 31: the int32's sign bit
    assert first_allowed(row) == 69
    row[2] = -(1 << 31)
    assert first_allowed(row) == 95


def test_a_limit_reached_mid_request_is_the_grammars_error_anything_else_the_engines():
    """A token the mask allowed but the grammar then refused: when llguidance says a limit was reached, the request's
    grammar is at fault (GRAMMAR_ERROR_PREFIX: the server's 400); otherwise the engine is (a 500)."""
    from runtime.serving import _outside_grammar

    class Dead:
        def __init__(self, error):
            self.error = error

    limit = _outside_grammar(7, Dead("lexer error: too many expressions constructed\n<non-verbose/>"))
    assert limit.startswith(GRAMMAR_ERROR_PREFIX) and "too complex to follow at token 7" in limit, limit
    other = _outside_grammar(7, Dead("token 7 is not allowed"))
    assert not other.startswith(GRAMMAR_ERROR_PREFIX) and "sampled outside the request's grammar" in other
    # a refused token whose own text reads like a limit is still the engine's fault
    quoted = _outside_grammar(7, Dead('Parser Error: token " limit" doesn\'t satisfy the grammar; too many items'))
    assert not quoted.startswith(GRAMMAR_ERROR_PREFIX), quoted


def test_a_grammar_that_does_not_compile_fails_its_request_alone(engine):
    s = _serving(engine)
    prompt = engine.tokenizer.encode(PROMPT)
    bad, free = s.run([prompt, prompt], [SamplingParams(structured=StructuredOutput("regex", "a(b")),
                                         SamplingParams(max_tokens=5, ignore_eos=True)])
    assert bad.finish_reason == "error" and "structured output" in bad.error and "unclosed group" in bad.error
    assert free.finish_reason == "length" and len(free.token_ids) == 5
    # aborted while its grammar compiles: it finishes and leaves nothing behind
    rid = s.add_request(prompt, SamplingParams(structured=StructuredOutput.json_schema(SCHEMAS["tuple"])))
    s.abort(rid)
    outs = s.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [(rid, "abort")]
    _assert_no_leaks(s)


# --- speculative decoding -----------------------------------------------------------------------------------------
def test_masks_with_drafts_are_each_positions_mask(engine, compiler):
    """A verify step's masks (fill_bitmasks_with_drafts): row j is the grammar's mask after the first j drafts, as
    advancing a state by hand gives it, and the state is left where it was."""
    from runtime.structured import fill_bitmasks_with_drafts

    tok = engine.tokenizer
    states = [compiler.compile(StructuredOutput.json_schema(SCHEMAS[n])).new_state()
              for n in ("flat_object", "array_of_ints")]
    drafts = [tok.encode('{"name": "ab', add_special_tokens=False), tok.encode("[1, -", add_special_tokens=False)]
    assert all(s.num_valid_prefix(d) == len(d) for s, d in zip(states, drafts))
    words = compiler.num_words
    before = fill_bitmasks(states, words)
    got = fill_bitmasks_with_drafts(states, drafts, words)
    assert got.shape == (sum(len(d) + 1 for d in drafts), words)
    want, row = [], 0
    for state, tokens in zip(states, drafts):
        for j in range(len(tokens) + 1):
            want.append(fill_bitmasks([state], words)[0])
            if j < len(tokens):
                assert state.advance(tokens[j])
        state.rollback(len(tokens))
    assert torch.equal(got, torch.stack(want))
    assert len({tuple(r.tolist()) for r in got}) > 3  # the masks differ from row to row
    assert torch.equal(fill_bitmasks(states, words), before)  # rolled back


class _ScriptedDrafts:
    """Drafts the reference continuation of each request, the one at ``wrong_at`` replaced by the next token id (the
    grammar refuses most such tokens: the drafts are cut there; where it allows one, the verification rejects it)."""

    method = "scripted"

    def __init__(self, references: list[list[int]], vocab: int, wrong_at: int | None, on_device: bool) -> None:
        self.references, self.vocab, self.wrong_at, self.on_device = references, vocab, wrong_at, on_device
        self.proposed = 0

    def propose_pending(self, requests):
        out = []
        for r in requests:
            ref = next((ref for ref in self.references if ref[:len(r.token_ids)] == list(r.token_ids)), None)
            drafts = [] if ref is None else ref[len(r.token_ids):len(r.token_ids) + r.max_tokens]
            if self.wrong_at is not None and self.wrong_at < len(drafts):
                drafts[self.wrong_at] = (drafts[self.wrong_at] + 1) % self.vocab
            self.proposed += len(drafts)
            out.append(drafts)
        if not self.on_device:
            return out
        from runtime.speculative import PendingDrafts  # as a draft model leaves them: values read when resolved

        flat = [t for d in out for t in d]
        starts = [sum(map(len, out[:i])) for i in range(len(out))]
        return PendingDrafts(torch.tensor(flat, dtype=torch.long),
                             [list(range(a, a + len(d))) for a, d in zip(starts, out)])

    def may_propose(self, token_ids, request_id=None) -> bool:
        return True

    def release(self, request_id: str) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize("wrong_at, on_device", [(None, False), (1, False), (3, False), (2, True)])
def test_structured_requests_speculate_with_the_plain_output(engine, wrong_at, on_device):
    """Structured requests verify drafts: each is cut to what the grammar accepts, each verified row is masked by the
    grammar after the drafts before it, the grammar takes the emitted tokens in turn. Greedy and seeded output is
    the non-speculative output (valid documents), with drafts accepted, beside a free request. Drafts left on the
    device (a draft model's) are read at once when a structured request has some."""
    names = ["nested_object", "array_of_objects", "enum_in_object", "string_patterns"]
    prompt = engine.tokenizer.encode(PROMPT)
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0 if i % 2 else 0.9, seed=i,
                             structured=StructuredOutput.json_schema(SCHEMAS[n])) for i, n in enumerate(names)]
    params.append(SamplingParams(max_tokens=24, ignore_eos=True))
    want = _serving(engine).run([prompt] * len(params), params)
    s = _serving(engine, speculative={"method": "ngram", "num_speculative_tokens": 4, "min_acceptance": 0.0})
    vocab = int(engine.executor.graph["meta"]["vocab_size"])
    s.proposer = proposer = _ScriptedDrafts([prompt + w.token_ids for w in want], vocab, wrong_at, on_device)
    got = s.run([prompt] * len(params), params)
    for g, w, name in zip(got, want, names):
        assert (g.token_ids, g.finish_reason) == (w.token_ids, "stop"), (name, g.text, w.text, g.error)
        assert validates(g.text, SCHEMAS[name]), (name, g.text)
    assert got[-1].token_ids == want[-1].token_ids
    stats = s.stats()
    assert stats.spec_num_accepted_tokens > 20
    if wrong_at is None:
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    else:  # cut at the wrong draft (or rejected there): never more than wrong_at accepted per verify
        assert stats.spec_num_draft_tokens < proposer.proposed or stats.spec_num_accepted_tokens < \
            stats.spec_num_draft_tokens
    _assert_no_leaks(s)


def test_a_compile_cancelled_by_the_engine_closing_aborts_its_request_as_the_engines(engine, monkeypatch):
    """The compiler closed under a queued compile (the engine shutting down): the request is aborted (the server's
    503), not failed as its grammar's fault (GRAMMAR_ERROR_PREFIX, a 400), and leaves nothing behind."""
    from concurrent.futures import Future

    s = _serving(engine)
    cancelled = Future()
    assert cancelled.cancel()
    monkeypatch.setattr(s.grammars, "submit", lambda spec: cancelled)
    rid = s.add_request(engine.tokenizer.encode(PROMPT),
                        SamplingParams(structured=StructuredOutput.json_schema(SCHEMAS["tuple"])))
    done = [o for o in s.step() if o.finished]
    assert [(o.request_id, o.finish_reason) for o in done] == [(rid, "abort")], done
    assert "the engine is closing" in done[0].error and not done[0].error.startswith(GRAMMAR_ERROR_PREFIX)
    _assert_no_leaks(s)


def test_a_cancelled_compile_is_not_served_from_the_cache(engine):
    """A compile cancelled while queued (a pool shutting down, a caller that gave up without a shield) compiled
    nothing: the next submit of the spec queues it again instead of handing out the cancelled future."""
    import threading

    vocab = int(engine.executor.graph["meta"]["vocab_size"])
    compiler = GrammarCompiler(engine.tokenizer, vocab, max_workers=1, spread=1)
    gate = threading.Event()
    compiler._pool.submit(gate.wait, 30)  # the only worker is busy: the next compile stays queued
    spec = StructuredOutput("regex", "[0-9]{3}")
    queued = compiler.submit(spec)
    assert queued.cancel() and queued.cancelled()
    again = compiler.submit(spec)
    assert again is not queued
    gate.set()
    assert again.result(30).new_state().matcher is not None
    compiler.close()
