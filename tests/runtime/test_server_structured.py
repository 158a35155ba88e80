"""Structured output and tool calls over HTTP: the official ``openai`` client's ``chat.completions.parse`` with a
pydantic model and with a pydantic function tool, the JSON-schema table streamed (greedy and sampled, beside free
requests), ``tools`` / ``tool_choice`` answered as ``tool_calls`` whole and streamed in OpenAI's chunk shape, vLLM's
``guided_*`` fields on completions, and the 400s a bad schema or a bad combination gets.
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pydantic
import pytest

from conftest import BUNDLED, serve_app
from runtime.engine_process import EngineProcess
from runtime.server import APIError, ChatMessage, _chat_prompt_ids, create_app
from runtime.serving import ServingConfig
from runtime.tokenizer import Tokenizer
from runtime.tool_calls import format_call, parse_tools
from test_server import API_KEY, MODEL, assert_error, read_events, run_server
from test_structured import ADD, PROMPT, SCHEMAS, WEATHER, validates

GREEDY = {"temperature": 0, "max_tokens": 48}
USER = [{"role": "user", "content": "Give me the data as JSON."}]


@pytest.fixture(scope="module")
def server(bundled_artifact):
    with run_server(bundled_artifact, ServingConfig(num_blocks=256, max_num_seqs=32)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


class Point(pydantic.BaseModel):
    label: str = pydantic.Field(max_length=8)
    x: int = pydantic.Field(ge=0, le=9)
    y: int = pydantic.Field(ge=0, le=9)
    visible: bool


def test_openai_client_parses_into_a_pydantic_model(server, client):
    completion = client.chat.completions.parse(model=MODEL, messages=USER, response_format=Point, **GREEDY)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Point)
    assert Point.model_validate_json(choice.message.content) == choice.message.parsed
    # the same conversation without the format is not a Point: the constraint is what does it
    free = client.chat.completions.create(model=MODEL, messages=USER, **GREEDY).choices[0].message.content
    with pytest.raises(pydantic.ValidationError):
        Point.model_validate_json(free)
    server.wait_idle()


def test_n_sampled_choices_each_follow_the_schema(server, client):
    """n > 1 with a schema: every choice (sampled, seed + i) is a complete, valid document of its own grammar state,
    parsed by the openai client; and a tool-call request's choices each hold a valid call."""
    completion = client.chat.completions.parse(model=MODEL, messages=USER, response_format=Point, n=4, seed=3,
                                               temperature=1.0, max_tokens=48)
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    for choice in completion.choices:
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Point)
    assert len({c.message.content for c in completion.choices}) > 1, "four seeds drew one document"
    tools = [WEATHER, ADD]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is 2 + 3?"}],
                                       tools=tools, tool_choice="required", parallel_tool_calls=False, n=2,
                                       temperature=0.7, seed=9, max_tokens=128)
    assert [c.index for c in r.choices] == [0, 1]
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            _check_call(call, tools)
    server.wait_idle()


def test_streamed_documents_validate_beside_free_requests(server):
    """Every schema of the table streamed at once (greedy and sampled alternately), two free streams beside them:
    every joined document is complete and valid."""
    names = list(SCHEMAS)

    async def stream(http, body):
        async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200, await r.aread()
            return read_events([line async for line in r.aiter_lines()])

    bodies = [{"messages": USER, "max_tokens": 48, "temperature": 1.0 if i % 2 else 0.0, "seed": i,
               "response_format": {"type": "json_schema", "json_schema": {"name": n, "schema": SCHEMAS[n],
                                                                          "strict": True}}}
              for i, n in enumerate(names)]
    bodies += [{"messages": USER, "max_tokens": 24, "temperature": 1.0, "seed": 5}, {"messages": USER, **GREEDY}]

    async def main():
        async with server.async_client() as http:
            return await asyncio.gather(*(stream(http, b) for b in bodies))

    for name, (events, done) in zip(names, asyncio.run(main())):
        assert done
        text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
        assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["stop"], name
        assert validates(text, SCHEMAS[name]), (name, text)
    server.wait_idle()


def _check_call(call, tools: list[dict]) -> dict:
    """A tool call names a declared function and its arguments validate against that function's schema."""
    declared = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in declared
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, declared[call.function.name])
    return arguments


def test_tool_calls_required_and_named(server, client):
    tools = [WEATHER, ADD]
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    for choice, parallel in [("required", False), ({"type": "function", "function": {"name": "add"}}, True)]:
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice=choice,
                                           parallel_tool_calls=parallel, **GREEDY)
        (answer,) = r.choices
        assert answer.finish_reason == "tool_calls" and answer.message.content is None
        (call,) = answer.message.tool_calls
        _check_call(call, tools)
        if isinstance(choice, dict):
            assert call.function.name == "add"

    # the openai client's strict function tools, parsed into the pydantic model
    completion = client.chat.completions.parse(model=MODEL, messages=messages, tools=[openai.pydantic_function_tool(
        Point)], tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=80)
    (call,) = completion.choices[0].message.tool_calls
    assert call.function.name == "Point" and isinstance(call.function.parsed_arguments, Point)
    server.wait_idle()


def test_streamed_tool_calls_add_up_to_the_whole_answer(server, client):
    body = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER, ADD],
                tool_choice="required", parallel_tool_calls=False, **GREEDY)
    whole = client.chat.completions.create(**body).choices[0]
    calls: dict[int, dict] = {}
    finish = []
    for chunk in client.chat.completions.create(**body, stream=True):
        for c in chunk.choices:
            finish += [c.finish_reason] if c.finish_reason else []
            assert not c.delta.content
            for d in c.delta.tool_calls or []:
                if d.index not in calls:  # the first piece of a call: its id, type and name
                    assert d.id and d.type == "function" and d.function.name
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments or ""
    assert finish == ["tool_calls"] == [whole.finish_reason]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    server.wait_idle()


def test_a_conversation_with_tool_results_is_rendered_for_the_template():
    """The bundled template knows no tools: they go into the system message, an earlier call into the assistant's
    text, and the tool's result is a message of role tool."""
    tok = Tokenizer.from_dir(BUNDLED)
    messages = [ChatMessage.model_validate(m) for m in [
        {"role": "user", "content": "2 + 3?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}]]
    text = tok.decode(_chat_prompt_ids(messages, tok, parse_tools([ADD])), skip_special_tokens=False)
    assert text.startswith("<|system|>\nYou may call these functions") and '"name": "add"' in text
    assert format_call("add", '{"a": 2, "b": 3}') in text and "<|tool|>\n5<|end|>" in text
    anonymous = messages[:2] + [ChatMessage.model_validate({"role": "tool", "content": "5"})]
    with pytest.raises(APIError) as refused:  # the route answers 400 with this message (as OpenAI does)
        _chat_prompt_ids(anonymous, tok, parse_tools([ADD]))
    assert refused.value.status == 400 and refused.value.param == "messages[2].tool_call_id"
    assert "a message of role tool answers one of the assistant's tool calls" in refused.value.message


def test_auto_tool_choice_answers_text_or_valid_calls(server, client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                       tools=[WEATHER, ADD], max_tokens=24, temperature=1.0, seed=3)
    (answer,) = r.choices
    for call in answer.message.tool_calls or []:
        _check_call(call, [WEATHER, ADD])
    assert answer.message.content or answer.message.tool_calls
    server.wait_idle()


def test_completions_take_vllm_guided_fields(server):
    prompt = {"prompt": PROMPT, "temperature": 1.0, "seed": 1, "max_tokens": 32}
    lark = 'start: "def " NAME "(" NAME? ")"\nNAME: /[a-z_]{1,8}/'
    with server.client() as http:
        for field, value, ok in [
                ("guided_regex", r"[0-9]{3}-[a-c]{2}", lambda t: re.fullmatch(r"[0-9]{3}-[a-c]{2}", t)),
                ("guided_choice", ["spam", "eggs"], lambda t: t in ("spam", "eggs")),
                ("guided_grammar", lark, lambda t: re.fullmatch(r"def [a-z_]{1,8}\(([a-z_]{1,8})?\)", t)),
                ("guided_json", SCHEMAS["nested_object"], lambda t: validates(t, SCHEMAS["nested_object"])),
                ("response_format", {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMAS["tuple"]}},
                 lambda t: validates(t, SCHEMAS["tuple"]))]:
            r = http.post("/v1/completions", json={**prompt, field: value})
            assert r.status_code == 200, r.text
            (choice,) = r.json()["choices"]
            assert choice["finish_reason"] == "stop" and ok(choice["text"]), (field, choice)
    server.wait_idle()


BAD_SCHEMA = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
# compiles (valid JSON schema, valid grammar) but admits no document: caught by the first mask with the vocabulary
SELF_REFERRING = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
BAD = [
    ("unsupported keyword", "/v1/chat/completions",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}},
     "response_format", "uniqueItems", "/properties/tags/uniqueItems"),
    ("schema missing", "/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format", "response_format.json_schema.schema", None),
    ("unknown format type", "/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format",
     "'yaml'", None),
    ("bad regex", "/v1/completions", {"guided_regex": "a(b"}, "guided_regex", "unclosed group", None),
    ("guided_json not JSON", "/v1/completions", {"guided_json": "{oops"}, "guided_json", "not valid JSON", None),
    ("two constraints", "/v1/completions", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice",
     "both constrain", None),
    ("tools and a format", "/v1/chat/completions",
     {"tools": [ADD], "response_format": {"type": "json_object"}}, "response_format", "cannot be combined", None),
    ("tool with a bad schema", "/v1/chat/completions",
     {"tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}]}, "tools",
     "tools[0].function.parameters", "/properties/tags/uniqueItems"),
    ("schema that only refers to itself", "/v1/completions", {"guided_json": {"$ref": "#"}}, "guided_json",
     "cannot produce a first token", None),
    ("definitions that only refer to each other", "/v1/chat/completions",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SELF_REFERRING}}},
     "response_format", "cannot produce a first token", None),
    ("a regex that outgrows the lexer once it moves", "/v1/completions", {"guided_regex": "a{99999999}"},
     "guided_regex", "too complex to follow", None),
    ("unknown tool named", "/v1/chat/completions",
     {"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "sub"}}}, "tool_choice", "'sub'",
     None),
]


@pytest.mark.parametrize("path, body, param, says, where", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_schema_or_combination_is_a_400_naming_it(server, path, body, param, says, where):
    base = {"prompt": "x"} if path == "/v1/completions" else {"messages": USER}
    with server.client() as http:
        error = assert_error(http.post(path, json={**base, **body}), 400, param)
        assert says in error["message"], error
        if where is not None:
            assert f"(at {where} in the schema)" in error["message"], error
    server.wait_idle()


def test_a_grammar_that_cannot_start_is_refused_before_the_stream_starts(server):
    body = {"messages": USER, "stream": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SELF_REFERRING}}}
    with server.client() as http:
        error = assert_error(http.post("/v1/chat/completions", json=body), 400, "response_format")
        assert "cannot produce a first token" in error["message"], error
    server.wait_idle()


def test_the_engines_grammar_failures_are_the_clients_errors():
    """A grammar that fails once generation has started (a lexer limit reached at some step) finishes its request
    with the engine's structured-output message: answered as the client's 400, any other failure as a 500."""
    from runtime.outputs import RequestOutput
    from runtime.server import _finish_error
    from runtime.structured import GRAMMAR_ERROR_PREFIX

    def failed(error: str) -> RequestOutput:
        return RequestOutput("r", "", [], None, True, "error", 3, 1, error=error)

    grammar = _finish_error(failed(f"{GRAMMAR_ERROR_PREFIX}the grammar cannot continue (lexer error)"))
    assert (grammar.status, grammar.body()["error"]["code"], grammar.body()["error"]["type"]) == \
        (400, "invalid_grammar", "invalid_request_error")
    assert _finish_error(failed("the forward pass failed")).status == 500


def test_through_the_engine_process(bundled_artifact):
    """With the engine in its own process the grammar crosses as JSON text and compiles there."""
    engine = EngineProcess(bundled_artifact, "cpu", ServingConfig(num_blocks=64, max_num_seqs=4))
    with serve_app(create_app(engine, MODEL)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        completion = client.chat.completions.parse(model=MODEL, messages=USER, response_format=Point, **GREEDY)
        assert isinstance(completion.choices[0].message.parsed, Point)
        r = client.chat.completions.create(model=MODEL, messages=USER, tools=[ADD], tool_choice="required",
                                           parallel_tool_calls=False, **GREEDY)
        _check_call(r.choices[0].message.tool_calls[0], [ADD])
        with pytest.raises(openai.BadRequestError, match="cannot produce a first token"):  # the server's own check
            client.chat.completions.create(model=MODEL, messages=USER, **GREEDY, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": SELF_REFERRING}})
