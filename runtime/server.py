"""The OpenAI-compatible HTTP server: an ASGI app over an ``AsyncEngine`` (the engine stepping in a thread of this
process) or an ``EngineProcess`` (the engine in its own process: what ``builder serve`` runs).

    app = create_app(AsyncEngine(ServingEngine.load(path)), model_name="pystdlib", api_key=None)
    app = create_app(EngineProcess(path), model_name="pystdlib", api_key=None)

Routes:

    GET  /health                200 {"status": "ok"} once the model is loaded and the engine is stepping, else 503
    GET  /metrics               Prometheus text format (runtime.metrics); no API key
    GET  /v1/models             the one served model, with its max_model_len
    GET  /openapi.json          the OpenAPI 3.1 schema: request bodies, responses, errors; no API key
    POST /v1/completions        prompt: a string, a list of token ids, or a one-element list of either
    POST /v1/chat/completions   messages rendered with the checkpoint's chat template

``stream: true`` answers with server-sent events (``data: {json}`` chunks, then ``data: [DONE]``);
``stream_options: {"include_usage": true}`` adds a usage chunk before ``[DONE]``.

Policies:

- Request bodies are JSON objects, whatever the Content-Type header says, validated strictly: a string
  where a number belongs is an error, not converted.
- Unknown request fields are ignored, as other OpenAI-compatible servers do, so clients that send newer
  OpenAI fields keep working. OpenAI fields this server knows but does not implement (completions' ``best_of``,
  ``suffix``, and ``echo`` together with ``logprobs``: the prompt's logprobs are not computed) are rejected with 400
  naming the field when they ask for anything but the default. ``echo: true`` alone returns the prompt's text
  before each choice's completion (streamed as the choice's first chunk).
- vLLM's ``min_tokens`` (both routes): no EOS or ``stop_token_ids`` token before that many tokens (stop strings and
  a structured output's grammar still end a request), at most ``max_tokens``.
- ``n`` (both routes, 1 to MAX_CHOICES = 16): n choices, each a request of its own in the engine (a seeded request's
  choice i takes seed + i, so seeded choices differ and each is reproducible alone), answered as one response with
  the choices' indexes (streamed: each choice's chunks as they come, the usage chunk once all have finished), usage
  counting the prompt once. A refusal of any choice (queue full) refuses the request and aborts the others. In
  /metrics each choice counts as a request (its own latencies and tokens).
- ``logit_bias`` (both routes): token ids (decimal-string keys) to numbers in [-100, 100] added to those tokens'
  logits before sampling (after the penalties, before a structured-output mask; runtime.sampling), at most 300,
  ids inside the model's vocabulary, else 400 naming ``logit_bias``. Logprobs still report the model's own logits.
- Structured output (runtime.structured): ``response_format`` ``json_object`` or ``json_schema`` (both routes), vLLM's
  ``guided_json``, ``guided_regex``, ``guided_choice`` and ``guided_grammar`` (Lark or GBNF), one of them per
  request; chat ``tools`` with ``tool_choice`` (runtime.tool_calls), answered as ``tool_calls`` (streamed as
  OpenAI's deltas) with finish_reason ``tool_calls``. A grammar is checked before the request is queued: one that
  is malformed or uses what is not supported is a 400 naming the field (and where in the schema). A structured
  request that reaches max_tokens first ends with finish_reason ``length``; ``stop`` means the grammar is complete.
- Sampling fields a request leaves out take the checkpoint's defaults from its generation_config.json
  (``<artifact>/tokenizer/generation_config.json``: temperature, top_p, top_k, min_p,
  repetition_penalty, the fields vLLM takes, only those the file sets; see runtime.generation_config),
  else OpenAI's: temperature 1.0 and top_p 1.0, so a request without ``temperature`` samples. Send
  ``temperature: 0`` for greedy decoding. The file's values are checked when the app is created.
- ``max_tokens`` (chat: also ``max_completion_tokens``, which wins) must fit: prompt plus max_tokens
  at most max_seq_len, else 400 (``context_length_exceeded``). When absent it is what is left of
  max_seq_len after the prompt, capped at DEFAULT_MAX_TOKENS (256) so a request that forgot it does
  not hold a sequence slot for the whole context.
- Errors are OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``:

      400 invalid_request_error   malformed JSON, body not UTF-8, wrong types, bad values (the
                                  SamplingError message), empty or too long prompt, empty messages,
                                  unsupported fields, prompt + max_tokens over max_seq_len
      401 authentication_error    missing or wrong ``Authorization: Bearer <key>`` on a /v1 route
                                  (when the app has an API key); with ``WWW-Authenticate: Bearer``
      404 not_found_error         a model name other than the served one; unknown routes
      405 invalid_request_error   a known route with the wrong method
      413 invalid_request_error   a body over MAX_BODY_BYTES
      429 rate_limit_error        the engine's waiting queue is full; ``Retry-After`` says when to retry
      500 server_error            the engine failed the request (never for bad input)
      503 server_error            the engine is not running or is shutting down
      504 timeout_error           the request did not finish within the server's request timeout

  Refusals are decided when the request is submitted, before any byte is sent, so a streamed request
  still gets a plain 4xx/429/503. A streamed request that is accepted gets its response headers at
  once, even while it waits in the queue, and an SSE comment (``: keep-alive``) every
  SSE_KEEPALIVE_S seconds without a delta, so clients with short read timeouts do not give up. Once a
  stream has started, a timeout or engine failure sends ``data: {"error": {...}}`` (the body a
  non-streamed request would have got) and then ``data: [DONE]``.
- Timeouts are the engine's per-request deadline (``ServingConfig.request_timeout_s``,
  ``--request-timeout``), counted from admission: 504 for a non-streamed request (its partial text is
  dropped), an error event for a streamed one.
- A client that disconnects, mid-stream or while waiting for a non-streamed answer, aborts its request:
  the engine frees its KV blocks within a step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError, WithJsonSchema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from runtime.artifact import TOKENIZER_DIR
from runtime.async_engine import KEEP_ALIVE, AsyncEngine, EngineNotRunning, RequestStream
from runtime.engine_process import EngineClient
from runtime.engine import RequestError
from runtime.generation_config import sampling_defaults
from runtime.metrics import RequestTracker, ServerMetrics
from runtime.outputs import RequestOutput, TokenLogprob, merge_deltas
from runtime.sampling import MAX_SEED, SamplingError, SamplingParams
from runtime.scheduler import QueueFullError
from runtime.structured import (ANY_JSON_OBJECT, GRAMMAR_ERROR_PREFIX, GrammarCompiler, StructuredOutput,
                                StructuredOutputError, check, locate_error)
from runtime.tokenizer import GENERATION_CONFIG_FILE, Tokenizer, TokenizerError
from runtime.tool_calls import (Tool, ToolCallParser, ToolError, message_for_template, parse_tools,
                                resolve_tool_choice, system_prompt, tool_grammar)

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256  # max_tokens when a request leaves it out (and the context has room)
# choices one request may ask for (``n``): each is a request of its own in the engine (the prompt's blocks shared
# through the prefix cache), so n is bounded like a batch a client could send anyway
MAX_CHOICES = 16
# sampling fields a request leaves out, where the checkpoint's generation_config.json does not set them
OPENAI_SAMPLING_DEFAULTS: dict[str, float] = {"temperature": 1.0, "top_p": 1.0}
MAX_BODY_BYTES = 16 << 20  # larger request bodies are refused (413) before any parsing or tokenizing
RETRY_AFTER_S = 1  # what a 429 tells the client to wait
DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks whether its client is still there
SSE_KEEPALIVE_S = 5.0  # a streamed request without a delta for this long (queued, prefilling) gets a comment line
SSE_KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: clients ignore it, read timeouts and proxies see traffic
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")  # whose refusals count in llm_requests_total

T = TypeVar("T")

__all__ = ["DEFAULT_MAX_TOKENS", "APIError", "create_app"]


class APIError(Exception):
    """An error answered in OpenAI's shape with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# --- request bodies ---------------------------------------------------------------------------------
class _Body(BaseModel):
    """Strict types, unknown fields ignored (see the module docstring)."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class _GenerationBody(_Body):
    """Fields common to both generation routes; None means the default (the checkpoint's, else OpenAI's)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # structured output: at most one of these (see _structured_output)
    response_format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", "json_schema"}
    guided_json: dict[str, Any] | str | None = None  # vLLM: a JSON schema (or its text)
    guided_regex: str | None = None  # vLLM: a regular expression (Rust regex syntax)
    guided_choice: list[str] | None = None  # vLLM: the output is one of these strings
    guided_grammar: str | None = None  # vLLM: a Lark or GBNF grammar
    # token id (as JSON keys are: a decimal string) -> a number in [-100, 100] added to its logit before sampling
    logit_bias: dict[str, Any] | None = None
    n: int | None = None  # choices to generate, 1..MAX_CHOICES (seeded: choice i takes seed + i)
    min_tokens: int | None = None  # vLLM: no EOS or stop_token_ids before this many tokens (stop strings still apply)

    # OpenAI fields that are not implemented: field -> the values that mean "not asked for"; others are refused
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {}

    def check_supported(self) -> None:
        if self.n is not None and not 1 <= self.n <= MAX_CHOICES:
            raise _invalid(f"n: {self.n} is not in [1, {MAX_CHOICES}] (choices to generate for the prompt)", param="n",
                           code="invalid_value")
        for name, allowed in self.UNSUPPORTED.items():
            if getattr(self, name) not in allowed:
                raise _invalid(f"{name}: {getattr(self, name)!r} is not supported by this server "
                               f"(leave it out or send {allowed[-1]!r})", param=name, code="unsupported_parameter")
        if self.stream_options is not None and not self.stream:  # as OpenAI: it would be silently ignored
            raise _invalid("stream_options is only allowed with stream: true", param="stream_options",
                           code="invalid_value")

    def sampling_fields(self) -> dict[str, Any]:
        """The SamplingParams fields this request sets (max_tokens and logprobs are resolved apart)."""
        names = ("temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "ignore_eos",
                 "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "min_tokens")
        fields = {k: getattr(self, k) for k in names if getattr(self, k) is not None}
        if self.stop is not None:
            fields["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        return fields

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage


# what a completions prompt may be, for the schema (the route checks it itself, with its own messages)
_PROMPT_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}},
                            {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1},
                            {"type": "array", "items": {"type": "array", "items": {"type": "integer"}},
                             "minItems": 1, "maxItems": 1}],
                  "description": "text, token ids, or a one-element list of either"}


def _prompt_is_required(schema: dict[str, Any]) -> None:
    """The schema says what the route requires: a prompt (its Python default None only lets the route name
    a missing prompt in its own message)."""
    schema["required"] = ["prompt"]
    schema["properties"]["prompt"].pop("default", None)


class CompletionBody(_GenerationBody):
    """POST /v1/completions; None means the default (see the module docstring)."""

    model_config = ConfigDict(json_schema_extra=_prompt_is_required)

    # str | list[int] | [str] | [list[int]]: checked by _completion_prompt
    prompt: Annotated[Any, WithJsonSchema(_PROMPT_SCHEMA)] = None
    logprobs: int | None = None  # top alternatives per token, 0..20 (OpenAI allows 0..5)
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {**_GenerationBody.UNSUPPORTED, "best_of": (None, 1),
                                               "suffix": (None, "")}

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo and self.logprobs is not None:
            raise _invalid("echo with logprobs is not supported by this server: it would need the prompt tokens' "
                           "logprobs, which it does not compute (send echo or logprobs, not both)", param="echo",
                           code="unsupported_parameter")


class ContentPart(_Body):
    type: str
    text: str | None = None


class FunctionCall(_Body):
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class ToolCallIn(_Body):
    """An earlier tool call of the assistant, sent back in the conversation."""

    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: str  # system, user, assistant, tool (a tool's result), or what the chat template knows
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: which call this is the result of


class ChatBody(_GenerationBody):
    """POST /v1/chat/completions; None means the default (see the module docstring)."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # [{"type": "function", "function": {"name", "description", "parameters", "strict"}}] (runtime.tool_calls)
    tools: list[Any] | None = None
    tool_choice: Any = None  # "none" | "auto" (default with tools) | "required" | {"type": "function", "function": ...}
    parallel_tool_calls: bool | None = None  # false: at most one call (default: any number)


# --- response bodies (the routes build them as dicts; these models document them in /openapi.json) ----------
class ErrorDetail(BaseModel):
    message: str  # what was wrong and what is allowed
    type: str  # invalid_request_error, authentication_error, not_found_error, rate_limit_error, server_error...
    param: str | None = None  # the request field at fault
    code: str | None = None  # e.g. invalid_value, context_length_exceeded, queue_full, request_timeout


class ErrorResponse(BaseModel):
    """OpenAI's error shape: every error response has it."""

    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens served from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None  # tokens, token_logprobs, top_logprobs, text_offset
    finish_reason: str | None  # stop or length


class CompletionResponse(BaseModel):
    """The whole answer of POST /v1/completions (``stream: true``: text_completion chunks as server-sent events)."""

    id: str
    object: str  # text_completion
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # the arguments as JSON text


class ToolCallOut(BaseModel):
    id: str  # call_...: what the tool's result message names as tool_call_id
    type: str  # function
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: str  # assistant
    content: str | None  # None when the answer is only tool calls
    tool_calls: list[ToolCallOut] | None = None  # present when the model called tools


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None  # content: [{token, logprob, bytes, top_logprobs}]
    finish_reason: str | None  # stop, length or tool_calls


class ChatCompletionResponse(BaseModel):
    """The whole answer of POST /v1/chat/completions (``stream: true``: chat.completion.chunk server-sent events)."""

    id: str
    object: str  # chat.completion
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: str  # model
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: str  # list
    data: list[ModelCard]


class HealthResponse(BaseModel):
    status: str  # ok


_ERRORS = {400: "the request is malformed, has wrong types or out-of-range values, or asks for an unsupported field",
           401: "missing or wrong API key", 404: "another model than the served one",
           413: f"the request body is larger than {MAX_BODY_BYTES} bytes",
           429: "the waiting queue is full; Retry-After says when to retry",
           500: "the engine failed the request", 503: "the engine is not running",
           504: "the request did not finish within the server's request timeout"}


def _error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorResponse, "description": _ERRORS[status]} for status in statuses}


def _generation_responses(model: type[BaseModel], chunk: str) -> dict[int | str, dict[str, Any]]:
    """A generation route's documented responses: the whole answer, the event stream, and every error."""
    stream = {"schema": {"type": "string", "description": f"server-sent events: 'data: {{{chunk}}}' lines, "
                                                          f"then 'data: [DONE]'; ': keep-alive' comments"}}
    return {200: {"model": model, "description": "the answer, or its stream with stream: true",
                  "content": {"text/event-stream": stream}},
            **_error_responses(400, 401, 404, 413, 429, 500, 503, 504)}


def _json_body(model: type[BaseModel]) -> dict[str, Any]:
    """openapi_extra declaring ``model`` as the request body: the routes read and validate the body themselves
    (strictly, with OpenAI-shaped errors), so FastAPI does not see it."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


_BEARER = {"security": [{"bearer": []}]}  # openapi_extra of the routes that need the API key


def _openapi(app: FastAPI, bodies: tuple[type[BaseModel], ...], secured: bool) -> dict[str, Any]:
    """The app's OpenAPI document, with the request body models (and the models they use) as components, and
    the bearer scheme the /v1 routes name when ``secured`` (the app has an API key)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {})
        schemas = components.setdefault("schemas", {})
        for model in bodies:
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(body.pop("$defs", {}))
            schemas[model.__name__] = body
        if secured:
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        app.openapi_schema = schema
    return app.openapi_schema


async def _read_body(request: Request) -> bytes:
    """The request body, refused (413) past MAX_BODY_BYTES without reading the rest."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _parse(raw: bytes, model: type[_Body]) -> Any:
    """A JSON object body validated into ``model``; 400 naming the first bad field."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _invalid(f"the request body is not valid UTF-8 (byte {e.start}); send a UTF-8 JSON object",
                       code="invalid_json") from None
    try:
        return model.model_validate_json(text)
    except ValidationError as e:
        raise _validation_error(e.errors()) from None


_UNION_MEMBERS = frozenset(("str", "int", "float", "bool", "list", "dict", "none"))  # type names, not fields


def _validation_error(errors: list[dict]) -> APIError:
    """The first of pydantic's (or FastAPI's) validation errors as an OpenAI 400."""
    first = errors[0] if errors else {"type": "", "loc": (), "msg": "invalid request"}
    if first["type"] in ("json_invalid", "json_type"):
        detail = first.get("ctx", {}).get("error") or first["msg"]
        return _invalid(f"the request body is not valid JSON: {detail}", code="invalid_json")
    loc = [str(p) for p in first["loc"] if p != "body"]
    if not loc and first["type"] in ("model_type", "model_attributes_type", "dict_type"):
        return _invalid("the request body must be a JSON object", code="invalid_json")
    param = loc[0] if loc else None
    # union members show up as type names in the location: keep field names and list indices only
    path = ".".join(p for p in loc if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*|\d+", p) and p not in _UNION_MEMBERS)
    return _invalid(f"{path or 'body'}: {first['msg']}", param=param, code="invalid_type"
                    if first["type"].endswith("_type") else "invalid_value")


# --- prompts and parameters -------------------------------------------------------------------------
def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _completion_prompt(prompt: Any) -> str | list[int]:
    """A completions prompt as text to encode (with BOS) or as token ids: a string, token ids, or a one-element
    list of either."""
    if prompt is None:
        raise _invalid("prompt is required", param="prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 1:
            raise _invalid(f"prompt: a batch of {len(prompt)} prompts is not supported; send one request per prompt",
                           param="prompt", code="unsupported_parameter")
        prompt = prompt[0]
        if not isinstance(prompt, str) and not _is_token_ids(prompt):
            raise _invalid("prompt[0] must be a string or a list of token ids (a one-element list holds one prompt)",
                           param="prompt", code="invalid_type")
    if isinstance(prompt, str) or _is_token_ids(prompt):
        if not prompt:
            raise _invalid("prompt is empty", param="prompt")
        return prompt if isinstance(prompt, str) else list(prompt)
    raise _invalid("prompt must be a string, a list of token ids, or a one-element list of either",
                   param="prompt", code="invalid_type")


# A prompt text longer than this is first counted in pieces of about this many characters, and refused as soon as
# the count shows it cannot fit: the work of refusing a huge prompt stays near that of one max_seq_len prompt (the
# tokenizer holds the GIL, so one whole encode of megabytes would stall every other request). The pieces end at a
# space, where the tokenizers' pre-tokenizers split anyway; a piece's own start can still add a token or two (a
# dummy prefix, a merge across the cut), hence the slack per piece before a count refuses.
COUNT_PIECE_CHARS = 1 << 15
COUNT_SLACK_PER_PIECE = 8


async def _encode_prompt(tokenizer: Tokenizer, text: str, add_special_tokens: bool, max_seq_len: int,
                         param: str) -> list[int]:
    """``text``'s token ids; a text that cannot fit in ``max_seq_len`` tokens is refused after counting at most
    about that many (``COUNT_PIECE_CHARS``), yielding to the event loop between pieces."""
    if len(text) > max(COUNT_PIECE_CHARS, max_seq_len):
        count, start, pieces = 0, 0, 0
        while start < len(text):
            end = min(len(text), start + COUNT_PIECE_CHARS)
            if end < len(text):
                cut = text.rfind(" ", start + COUNT_PIECE_CHARS // 2, end)
                end = cut if cut > start else end
            count += len(tokenizer.encode(text[start:end], add_special_tokens=False))
            pieces += 1
            start = end
            if count > max_seq_len + COUNT_SLACK_PER_PIECE * pieces:
                raise _invalid(f"the prompt has more than {max_seq_len} tokens ({len(text)} characters; refused "
                               f"after counting {count} tokens in its first {start} characters); this model's "
                               f"max_seq_len is {max_seq_len} (prompt plus at least one generated token)",
                               param=param, code="context_length_exceeded")
            await asyncio.sleep(0)  # other requests' events between pieces
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _message_dict(i: int, message: ChatMessage) -> dict[str, Any]:
    if message.role == "tool" and not message.tool_call_id:
        raise _invalid(f"messages[{i}].tool_call_id: a message of role tool answers one of the assistant's tool "
                       f"calls; give that call's id (tool_calls[].id of the assistant message before it)",
                       param=f"messages[{i}].tool_call_id", code="missing_required_parameter")
    content = message.content
    if isinstance(content, list):
        bad = [p.type for p in content if p.type != "text"]
        if bad:
            raise _invalid(f"messages[{i}].content: only text parts are supported, got {bad[0]!r}",
                           param="messages", code="unsupported_parameter")
        if (j := next((j for j, p in enumerate(content) if p.text is None), None)) is not None:
            raise _invalid(f"messages[{i}].content[{j}]: a text part needs its text: {{\"type\": \"text\", "
                           f"\"text\": \"...\"}}", param="messages", code="invalid_value")
        content = "".join(p.text for p in content)
    out: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id or f"call_{i}_{j}", "type": c.type,
                              "function": {"name": c.function.name, "arguments": c.function.arguments}}
                             for j, c in enumerate(message.tool_calls)]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _chat_prompt_ids(messages: list[ChatMessage], tokenizer: Tokenizer, tools: list[Tool]) -> list[int]:
    """``_chat_prompt_text`` encoded (the template holds the special tokens, so none are added)."""
    return tokenizer.encode(_chat_prompt_text(messages, tokenizer, tools), add_special_tokens=False)


def _chat_prompt_text(messages: list[ChatMessage], tokenizer: Tokenizer, tools: list[Tool]) -> str:
    """The conversation rendered with the checkpoint's chat template. ``tools``: the functions the model may call
    (runtime.tool_calls says how a template that does not render them is told about them)."""
    if not messages:
        raise _invalid("messages is empty; send at least one message", param="messages")
    dicts = [message_for_template(_message_dict(i, m), tokenizer.chat_template_uses("tool_calls"))
             for i, m in enumerate(messages)]
    extra: dict[str, Any] = {}
    if tools and tokenizer.chat_template_uses("tools"):
        extra["tools"] = [t.spec for t in tools]
    elif tools:
        prompt = system_prompt(tools)
        if dicts[0]["role"] == "system":
            dicts[0] = {**dicts[0], "content": f"{dicts[0]['content']}\n\n{prompt}"}
        else:
            dicts.insert(0, {"role": "system", "content": prompt})
    try:
        return tokenizer.apply_chat_template(dicts, add_generation_prompt=True, **extra)
    except TokenizerError as e:
        raise _invalid(str(e), param="messages") from None


def _structured_output(body: _GenerationBody) -> tuple[StructuredOutput, str, Any] | None:
    """The grammar the request's structured-output fields ask for, the field that asks and its JSON schema (if
    it is one), or None; 400 when more than one asks or one is malformed (not yet compiled: ``_checked_grammar``)."""
    asked: list[tuple[StructuredOutput, str, Any]] = []
    if (fmt := body.response_format) is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            asked.append((StructuredOutput("json", ANY_JSON_OBJECT), "response_format", None))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise _invalid('response_format.json_schema.schema: required, a JSON schema object (response_format '
                               'is {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}})',
                               param="response_format", code="invalid_value")
            asked.append((StructuredOutput.json_schema(schema), "response_format", schema))
        elif kind != "text":
            raise _invalid(f"response_format.type: {kind!r} is not one of text, json_object, json_schema",
                           param="response_format", code="invalid_value")
    if body.guided_json is not None:
        schema = body.guided_json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise _invalid(f"guided_json: not valid JSON ({e})", param="guided_json", code="invalid_value") \
                    from None
        asked.append((StructuredOutput.json_schema(schema), "guided_json", schema))
    if body.guided_regex is not None:
        asked.append((StructuredOutput("regex", body.guided_regex), "guided_regex", None))
    if body.guided_choice is not None:
        asked.append((StructuredOutput("choice", json.dumps(body.guided_choice)), "guided_choice", None))
    if body.guided_grammar is not None:
        asked.append((StructuredOutput("grammar", body.guided_grammar), "guided_grammar", None))
    if len(asked) > 1:
        raise _invalid(f"{asked[0][1]} and {asked[1][1]} both constrain the output; send one of them",
                       param=asked[1][1], code="unsupported_parameter")
    return asked[0] if asked else None


async def _checked_grammar(grammars: GrammarCompiler | None, spec: StructuredOutput, param: str,
                           schema: Any = None) -> StructuredOutput:
    """``spec`` once it compiles and, with ``grammars``, compiles for the model's vocabulary and can produce a first
    token (checked in worker threads: a large schema must not hold up the event loop); else 400 naming ``param``,
    what is wrong and, for a JSON schema, where."""
    try:
        await asyncio.to_thread(check, spec)
        if grammars is not None:  # cached by the spec's hash; shielded: a cancelled handler must not cancel a
            # compile the engine shares
            await asyncio.shield(asyncio.wrap_future(grammars.submit(spec)))
    except RuntimeError as e:  # the compiler's pool is closed: the engine is shutting down
        raise APIError(503, f"the engine is shutting down ({e})", type="server_error", code="shutting_down") from None
    except StructuredOutputError as e:
        where = locate_error(schema, str(e)) if schema is not None else None
        raise _invalid(f"{param}: {e}" + (f" (at {where} in the schema)" if where else ""),
                       param=param.split(".")[0].split("[")[0], code="invalid_schema") from None
    return spec


def _sampling_params(fields: dict[str, Any], max_tokens: int | None, logprobs: int | None, num_prompt: int,
                     max_seq_len: int, param_names: dict[str, str], defaults: dict[str, Any]) -> SamplingParams:
    """SamplingParams of a request whose prompt has ``num_prompt`` tokens; 400 naming the bad field.

    ``fields``: the sampling fields the request sets, over ``defaults``. ``param_names`` maps
    SamplingParams field names to the request's where they differ."""
    room = max_seq_len - num_prompt
    try:
        params = SamplingParams(max_tokens=min(DEFAULT_MAX_TOKENS, room) if max_tokens is None else max_tokens,
                                logprobs=logprobs, **{**defaults, **fields})
    except SamplingError as e:
        field, _, rest = str(e).partition(":")
        name = param_names.get(field, field)  # the request's own name for the field, in the message too
        raise _invalid(f"{name}:{rest}", param=name, code="invalid_value") from None
    if params.max_tokens > room:
        name = param_names.get("max_tokens", "max_tokens")
        raise _invalid(f"{name} {params.max_tokens} does not fit: this model's max_seq_len is {max_seq_len} tokens "
                       f"and the prompt has {num_prompt}; ask for at most {room}", param=name,
                       code="context_length_exceeded")
    return params


def _check_prompt_len(num_prompt: int, max_seq_len: int, param: str) -> None:
    if num_prompt >= max_seq_len:
        raise _invalid(f"the prompt has {num_prompt} tokens; this model's max_seq_len is {max_seq_len} "
                       f"(prompt plus at least one generated token)", param=param, code="context_length_exceeded")


# --- logprobs -----------------------------------------------------------------------------------------
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable stand-in character of each byte -> the byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_decoder()


class TokenText:
    """Text and UTF-8 bytes of single tokens, as logprobs show them (cached per token id).

    A token that is part of a multi-byte character has no text of its own; OpenAI shows it as
    ``bytes:\\xe2\\x80`` and its ``bytes`` are the exact ones (from the byte-level alphabet or a
    ``<0xNN>`` byte-fallback token)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, str, list[int]]:
        """(label for logprobs, decoded text for offsets, UTF-8 bytes)."""
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._describe(token_id)
        return hit

    def _describe(self, token_id: int) -> tuple[str, str, list[int]]:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        raw = self.tokenizer.id_to_token(token_id) or ""
        if "\ufffd" not in text:
            if raw.startswith("\u2581") and not text.startswith(" "):  # SentencePiece: the decoder drops it
                text = " " + text
            return text, text, list(text.encode("utf-8"))
        if m := _BYTE_FALLBACK.fullmatch(raw):
            data = bytes([int(m[1], 16)])
        elif raw and all(c in _BYTE_LEVEL for c in raw):
            data = bytes(_BYTE_LEVEL[c] for c in raw)
        else:
            data = text.encode("utf-8")
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data), text, list(data)


def _completion_logprobs(entries: list[TokenLogprob], token_text: TokenText, offset: int) -> tuple[dict, int]:
    """OpenAI's completions logprobs object for ``entries``, text offsets from ``offset``; and the offset after."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for entry in entries:
        label, text, _ = token_text(entry.token_id)
        tokens.append(label)
        token_logprobs.append(entry.logprob)
        alternatives: dict[str, float] = {}
        for token_id, logprob in entry.top:
            alternatives.setdefault(token_text(token_id)[0], logprob)  # two ids may render alike: keep the likelier
        top.append(alternatives)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}, offset


def _chat_logprobs(entries: list[TokenLogprob], token_text: TokenText) -> dict:
    """OpenAI's chat logprobs object for ``entries``."""
    def item(token_id: int, logprob: float) -> dict:
        label, _, data = token_text(token_id)
        return {"token": label, "logprob": logprob, "bytes": data}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}


# --- responses -------------------------------------------------------------------------------------------
def _usage(out: RequestOutput, *more: RequestOutput) -> dict:
    """Usage of a request's last delta; with ``more`` (the other choices of an ``n`` request) the prompt counted
    once and the completion tokens summed."""
    completion = out.num_output_tokens + sum(o.num_output_tokens for o in more)
    return {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": completion,
            "total_tokens": out.num_prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass
class _Call:
    """One generation request on its way through the server."""

    chat: bool  # /v1/chat/completions (else /v1/completions)
    request_id: str  # also the response id: cmpl-... or chatcmpl-...
    created: int  # unix seconds
    model: str
    want_logprobs: bool
    include_usage: bool
    token_text: TokenText
    tracker: RequestTracker
    text_offset: int = 0  # completions logprobs: characters of text so far
    tools: ToolCallParser | None = None  # chat with tools: splits the text into content and tool calls
    index: int = 0  # the choice's index (a request asking for n choices has a _Call per choice)
    echo: str = ""  # completions with echo: the prompt's text, before the completion's
    _text_event: tuple[str, str] | None = None  # text_event's frame around the text, made on first use

    def text_event(self, out: RequestOutput, done: bool) -> str | None:
        """The SSE event of a delta that is only text (no logprobs asked, no tool calls, not the finishing one)
        as one string format: the chunk's JSON around the text is the same on every such delta, so only the text
        is encoded (the same bytes as ``_sse(delta_chunk(...))``); None where the delta needs the full chunk."""
        if done or not out.text or self.want_logprobs or self.tools is not None:
            return None
        if self._text_event is None:
            mark = "\u0000text\u0000"  # json.dumps spells it "\\u0000text\\u0000": no chunk field holds it
            frame = _sse(self.chunk(mark, None, None)).split(json.dumps(mark, ensure_ascii=False), 1)
            self._text_event = (frame[0], frame[1])
        head, tail = self._text_event
        return f"{head}{json.dumps(out.text, ensure_ascii=False)}{tail}"

    def logprobs(self, entries: list[TokenLogprob] | None) -> dict | None:
        if not self.want_logprobs or entries is None:
            return None
        if self.chat:
            return _chat_logprobs(entries, self.token_text)
        result, self.text_offset = _completion_logprobs(entries, self.token_text, self.text_offset)
        return result

    def envelope(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}

    def response(self, outs: list[RequestOutput]) -> dict:
        """The non-streamed response from all the request's deltas."""
        last = outs[-1]
        text = "".join(o.text for o in outs)
        entries = [e for o in outs for e in (o.logprobs or [])]
        choice: dict[str, Any] = {"index": self.index}
        finish = last.finish_reason
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
            if self.tools is not None:
                self.tools.feed(text)
                self.tools.finish(cut_off=finish == "length")
                choice["message"]["content"] = self.tools.content or None
                if self.tools.calls:
                    choice["message"]["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                        "name": c.name, "arguments": c.arguments}} for c in self.tools.calls]
                    finish = "tool_calls" if finish == "stop" else finish
        else:
            choice["text"] = self.echo + text
        choice["logprobs"] = self.logprobs(entries)
        choice["finish_reason"] = finish
        return {**self.envelope(False), "choices": [choice], "usage": _usage(last)}

    def delta_chunk(self, out: RequestOutput, done: bool) -> dict | None:
        """The chunk streaming ``out`` (None when it adds nothing to show); ``done``: it finished normally."""
        finish = out.finish_reason if done else None
        if self.tools is None:
            if out.text or (out.token_ids and self.want_logprobs) or done:
                return self.chunk(out.text or (None if self.chat else ""), out.logprobs, finish)
            return None
        delta = self.tools.feed(out.text)
        if done:
            delta.extend(self.tools.finish(cut_off=out.finish_reason == "length"))
            finish = "tool_calls" if finish == "stop" and self.tools.calls else finish
        if not (delta.content or delta.calls or (out.token_ids and self.want_logprobs) or done):
            return None
        body = self.chunk(delta.content or None, out.logprobs, finish)
        if delta.calls:
            body["choices"][0]["delta"]["tool_calls"] = [
                {"index": i, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": args}}
                if c is not None else {"index": i, "function": {"arguments": args}} for i, c, args in delta.calls]
        return body

    def chunk(self, text: str | None, entries: list[TokenLogprob] | None, finish_reason: str | None,
              role: bool = False) -> dict:
        choice: dict[str, Any] = {"index": self.index}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice["logprobs"] = self.logprobs(entries)
        choice["finish_reason"] = finish_reason
        body = {**self.envelope(True), "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, last: RequestOutput) -> dict:
        return {**self.envelope(True), "choices": [], "usage": _usage(last)}


def _finish_error(out: RequestOutput) -> APIError:
    """The error a request that did not finish normally (timeout, error, abort) is answered with."""
    if out.finish_reason == "timeout":
        return APIError(504, out.error or "the request timed out", type="timeout_error", code="request_timeout")
    if out.finish_reason == "abort":
        return APIError(503, out.error or "the request was aborted", type="server_error", code="aborted")
    if out.error and out.error.startswith(GRAMMAR_ERROR_PREFIX):  # the request's own grammar: the client's error
        return APIError(400, out.error, code="invalid_grammar")
    return APIError(500, out.error or "the engine failed the request", type="server_error", code="engine_error")


class _ClientGone(Exception):
    """The client disconnected while the server was waiting for the engine."""


async def _until_disconnect(http_request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise _ClientGone. Cancelling work
    that is iterating the engine's stream closes it, which aborts the request."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await http_request.is_disconnected():
                raise _ClientGone
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # let it finish unwinding (and aborting) before we go on


async def _drain(stream: RequestStream, tracker: RequestTracker) -> list[RequestOutput]:
    outs = []
    async for out in stream:
        tracker.delta(out)
        outs.append(out)
    return outs


class _KeepAlive:
    """The streams' keep-alives from one timer per app: a ticker wakes every stream that has had no delta for
    ``interval_s`` (``RequestStream.nudge``: its consumer gets KEEP_ALIVE and sends an SSE comment), checking a
    quarter of the interval apart, so the comment goes out 1 to 1.25 intervals after the last delta. (A timeout
    around each wait for a delta did the same at a timer per delta: a tenth of the server's CPU per token.)"""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.last: dict[RequestStream, float] = {}  # stream -> when it last got a delta (or a keep-alive)
        self._ticker: asyncio.Task | None = None

    def watch(self, stream: RequestStream) -> None:
        self.last[stream] = time.monotonic()
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick())

    def touch(self, stream: RequestStream) -> None:
        self.last[stream] = time.monotonic()

    def forget(self, stream: RequestStream) -> None:
        self.last.pop(stream, None)

    async def close(self) -> None:
        """Stop the ticker (the app's shutdown)."""
        if self._ticker is not None and not self._ticker.done():
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker

    async def _tick(self) -> None:
        while self.last:
            await asyncio.sleep(self.interval_s / 4)
            now = time.monotonic()
            for stream, last in list(self.last.items()):
                if now - last >= self.interval_s:
                    stream.nudge()
                    self.last[stream] = now


class _EventStream(StreamingResponse):
    """Server-sent events whose generator is closed however the response ends, so a client that
    disconnects mid-stream aborts its request at once rather than when the generator is collected."""

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


# --- the app -------------------------------------------------------------------------------------------
class _Handlers:
    """What the routes do, for one app over one engine."""

    def __init__(self, engine: AsyncEngine | EngineClient, model_name: str, api_key: str | None,
                 sse_keepalive_s: float, stream_interval: int, multiprocess_metrics: bool) -> None:
        self.engine = engine
        self.stream_interval = stream_interval
        artifact = engine.artifact
        # sampling fields a request leaves out (checked now: a bad file stops the start-up, not requests)
        self.sampling_defaults = {**OPENAI_SAMPLING_DEFAULTS, **sampling_defaults(
            artifact.file(f"{TOKENIZER_DIR}/{GENERATION_CONFIG_FILE}"))}
        self.keep_alive = _KeepAlive(sse_keepalive_s)
        self.model_name = model_name
        self.api_key = api_key
        self.tokenizer = engine.tokenizer
        self.max_seq_len = engine.max_seq_len
        self.metrics = ServerMetrics(engine.stats, multiprocess=multiprocess_metrics)
        self.token_text = TokenText(self.tokenizer)
        self.created = int(time.time())

    # --- checks and errors ---
    def error_response(self, request: Request, error: APIError) -> JSONResponse:
        if request.url.path in GENERATION_PATHS and 400 <= error.status < 500:
            self.metrics.refused("rejected" if error.status == 429 else "invalid")
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    def check_api_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "missing or wrong API key; send the header 'Authorization: Bearer <key>'",
                           type="authentication_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           type="not_found_error", param="model", code="model_not_found")

    # --- routes ---
    async def health(self) -> JSONResponse:
        if self.engine.ready:
            return JSONResponse({"status": "ok"})
        return JSONResponse(APIError(503, "the engine is not running", type="server_error").body(), status_code=503)

    async def prometheus(self) -> Response:
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "llm-builder", "max_model_len": self.max_seq_len}]}

    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        body: CompletionBody = _parse(await _read_body(request), CompletionBody)
        self._check_model(body.model)
        body.check_supported()
        prompt = _completion_prompt(body.prompt)
        ids = prompt if isinstance(prompt, list) else await _encode_prompt(self.tokenizer, prompt, True,
                                                                              self.max_seq_len, "prompt")
        _check_prompt_len(len(ids), self.max_seq_len, "prompt")
        fields = body.sampling_fields()
        if (asked := _structured_output(body)) is not None:
            fields["structured"] = await _checked_grammar(self.engine.grammars, *asked)
        params = _sampling_params(fields, body.max_tokens, body.logprobs, len(ids),
                                  self.max_seq_len, {}, self.sampling_defaults)
        echo = (prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)) if body.echo else ""
        return await self._serve(request, False, ids, params, body, arrival, echo=echo)

    async def chat_completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        body: ChatBody = _parse(await _read_body(request), ChatBody)
        self._check_model(body.model)
        body.check_supported()
        if body.top_logprobs is not None and not body.logprobs:
            raise _invalid("top_logprobs needs logprobs: true", param="top_logprobs")
        try:
            tools = parse_tools(body.tools or [])
            choice = resolve_tool_choice(body.tool_choice, tools)
        except ToolError as e:
            raise _invalid(str(e), param=e.param, code="invalid_value") from None
        fields = body.sampling_fields()
        asked = _structured_output(body)
        if choice != "none":
            if asked is not None:
                raise _invalid(f"{asked[1]} and tools cannot be combined: the answer is either tool calls or the "
                               f"format; leave one out or send tool_choice 'none'", param=asked[1],
                               code="unsupported_parameter")
            for i, tool in enumerate(tools):  # each schema checked alone (named in a 400); compiled with the
                # vocabulary below, within the tools' grammar
                await _checked_grammar(None, StructuredOutput.json_schema(tool.parameters),
                                       f"tools[{i}].function.parameters", tool.parameters)
            fields["structured"] = await _checked_grammar(
                self.engine.grammars,
                tool_grammar(tools, choice, body.parallel_tool_calls is not False), "tools")
        elif asked is not None:
            fields["structured"] = await _checked_grammar(self.engine.grammars, *asked)
        text = _chat_prompt_text(body.messages, self.tokenizer, tools if choice != "none" else [])
        ids = await _encode_prompt(self.tokenizer, text, False, self.max_seq_len, "messages")
        _check_prompt_len(len(ids), self.max_seq_len, "messages")
        max_tokens, names = body.max_tokens, {"logprobs": "top_logprobs"}
        if body.max_completion_tokens is not None:
            max_tokens, names["max_tokens"] = body.max_completion_tokens, "max_completion_tokens"
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = _sampling_params(fields, max_tokens, logprobs, len(ids), self.max_seq_len, names,
                                  self.sampling_defaults)
        return await self._serve(request, True, ids, params, body, arrival, tool_calls=choice != "none")

    # --- one generation request ---
    async def _serve(self, http_request: Request, chat: bool, ids: list[int], params: SamplingParams,
                     body: _GenerationBody, arrival: float, tool_calls: bool = False, echo: str = "") -> Response:
        """Submit the request (a refusal is decided here, so it is still a plain HTTP error); then answer
        with the whole result, or start the stream at once. ``tool_calls``: the output may hold tool calls;
        ``echo``: a completion's text starts with it (the prompt's, for echo: true).
        ``n`` choices are n requests in the engine (ids ``<id>-<i>``; seeded, choice i takes seed + i), answered
        as one response whose choices carry their index; a refusal of any of them refuses all."""
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        n = body.n or 1
        calls = [_Call(chat, response_id, int(time.time()), self.model_name, params.logprobs is not None,
                       body.include_usage, self.token_text, self.metrics.track(arrival),
                       tools=ToolCallParser() if tool_calls else None, index=i, echo=echo) for i in range(n)]
        streams: list[RequestStream] = []
        try:
            for i in range(n):
                choice = params if n == 1 or params.seed is None else \
                    dataclasses.replace(params, seed=(params.seed + i) % (MAX_SEED + 1))
                streams.append(self.engine.submit(ids, choice, request_id=response_id if n == 1
                                                  else f"{response_id}-{i}"))
        except (QueueFullError, RequestError, EngineNotRunning) as e:
            for call, stream in zip(calls, streams):  # the choices queued before the refusal are aborted
                await stream.aclose()
                call.tracker.finish("abort")
            if isinstance(e, EngineNotRunning):  # starting, shut down, or its step loop died
                raise _unavailable(e) from None
            raise _refusal(e, chat) from None
        if body.stream:
            return _EventStream(self._events(calls, streams))
        return await self._complete(http_request, calls, streams)

    async def _complete(self, http_request: Request, calls: list[_Call], streams: list[RequestStream]) -> Response:
        async def drain_all() -> list[list[RequestOutput]]:
            return list(await asyncio.gather(*(_drain(s, c.tracker) for c, s in zip(calls, streams))))

        try:
            results = await _until_disconnect(http_request, drain_all())
        except _ClientGone:
            for call in calls:
                call.tracker.finish("abort")
            return Response(status_code=499)
        except (QueueFullError, RequestError) as e:  # refused by the engine thread after all (a race)
            raise _refusal(e, calls[0].chat) from None
        except EngineNotRunning as e:  # the engine shut down under the request
            for call in calls:
                call.tracker.finish("error")
            raise _unavailable(e) from None
        finally:
            for stream in streams:
                await stream.aclose()  # a no-op once finished; else it aborts the request
        for call, outs in zip(calls, results):
            call.tracker.finish(outs[-1].finish_reason)
        failed = next((outs[-1] for outs in results if outs[-1].finish_reason not in ("stop", "length")), None)
        if failed is not None:
            raise _finish_error(failed)
        answers = [call.response(outs) for call, outs in zip(calls, results)]
        if len(answers) > 1:
            answers[0]["choices"] = [a["choices"][0] for a in answers]
            answers[0]["usage"] = _usage(*(outs[-1] for outs in results))
        return JSONResponse(answers[0])

    async def _events(self, calls: list[_Call], streams: list[RequestStream]) -> AsyncIterator[str]:
        """The SSE body: a keep-alive comment while no delta comes (queued, prefilling), a chunk per delta
        with text (or logprobs), the finish reason on the last one, usage if asked; an error event if the
        request ended otherwise; then [DONE]. Several choices: each choice's chunks as they come (each with its
        index), usage once all have finished (completion tokens summed); a choice that fails ends the stream with
        its error (the others are aborted)."""
        lasts: list[RequestOutput | None] = [None] * len(calls)
        if len(calls) == 1:  # (closed explicitly: a client gone mid-stream aborts the request at once)
            async with contextlib.aclosing(self._choice_events(calls[0], streams[0], lasts, 0,
                                                               first_bytes=True)) as events:
                async for event in events:
                    yield event
        else:
            if not calls[0].chat:
                try:
                    yield SSE_KEEPALIVE  # the first bytes (see _choice_events)
                except BaseException:  # the client left before any choice started: abort them all
                    for call, stream in zip(calls, streams):
                        await stream.aclose()
                        call.tracker.finish("abort")
                    raise
            queue: asyncio.Queue[str | None] = asyncio.Queue()

            async def pump(i: int) -> None:
                try:
                    async with contextlib.aclosing(self._choice_events(calls[i], streams[i], lasts, i)) as events:
                        async for event in events:
                            await queue.put(event)
                finally:
                    queue.put_nowait(None)

            tasks = [asyncio.ensure_future(pump(i)) for i in range(len(calls))]
            try:
                running = len(tasks)
                while running:
                    event = await queue.get()
                    if event is None:
                        running -= 1
                        continue
                    yield event
                    if event.startswith('data: {"error"'):  # a failed choice ends the response
                        break
            finally:
                for task in tasks:
                    task.cancel()  # a finished one ignores it; a running one closes its stream (an abort)
                await asyncio.gather(*tasks, return_exceptions=True)
        if all(last is not None and last.finish_reason in ("stop", "length") for last in lasts) \
                and calls[0].include_usage:
            yield _sse({**calls[0].envelope(True), "choices": [], "usage": _usage(*lasts)})
        yield _sse("[DONE]")

    async def _choice_events(self, call: _Call, stream: RequestStream, lasts: list[RequestOutput | None],
                             i: int, first_bytes: bool = False) -> AsyncIterator[str]:
        """One choice's events of ``_events`` (its role chunk first on chat; no [DONE], no usage); ``lasts[i]``
        becomes its last delta when it finished normally. ``first_bytes``: a completion's stream opens with a
        keep-alive comment (the headers are out, and the client sees the stream alive)."""
        try:
            if call.chat:
                yield _sse(call.chunk("", None, None, role=True))
            elif call.echo:  # the prompt's text first (also the stream's first bytes)
                yield _sse(call.chunk(call.echo, None, None))
            elif first_bytes:
                yield SSE_KEEPALIVE
            self.keep_alive.watch(stream)
            sent = 0  # tokens sent so far
            while True:
                out = await stream.__anext__()  # no suspension when a delta is queued already
                if out is KEEP_ALIVE:  # no delta for sse_keepalive_s (queued, prefilling, a stalled engine)
                    yield SSE_KEEPALIVE
                    continue
                if behind := stream.ready_deltas():  # the client fell behind: what is queued goes as one chunk
                    out = merge_deltas([out, *behind])
                if self.stream_interval > 1 and sent and not out.finished \
                        and len(out.token_ids) < self.stream_interval:
                    out = await _gather_tokens(stream, out, self.stream_interval)
                sent += len(out.token_ids)
                self.keep_alive.touch(stream)
                call.tracker.delta(out)
                done = out.finished and out.finish_reason in ("stop", "length")
                if (event := call.text_event(out, done)) is not None:
                    yield event
                elif (chunk := call.delta_chunk(out, done)) is not None:
                    yield _sse(chunk)
                if out.finished:
                    break
            call.tracker.finish(out.finish_reason)
            if done:
                lasts[i] = out
            else:
                yield _sse(_finish_error(out).body())
        except (QueueFullError, RequestError) as e:  # refused by the engine thread after all (a race)
            call.tracker.finish("rejected" if isinstance(e, QueueFullError) else "invalid")
            yield _sse(_refusal(e, call.chat).body())
        except EngineNotRunning as e:  # the engine shut down mid-stream: tell the client, then end the stream
            call.tracker.finish("error")
            yield _sse(_unavailable(e).body())
        finally:
            self.keep_alive.forget(stream)
            await stream.aclose()  # a no-op once finished; else it aborts the request (client gone)
            call.tracker.finish("abort")  # a no-op once finished


async def _gather_tokens(stream: RequestStream, out: RequestOutput, interval: int) -> RequestOutput:
    """``out`` merged with the stream's next deltas until they hold ``interval`` tokens, the request finishes, or a
    keep-alive comes (the engine stalled: what is held goes out rather than wait longer)."""
    held, num_tokens = [out], len(out.token_ids)
    while num_tokens < interval and not held[-1].finished:
        nxt = await stream.__anext__()
        if nxt is KEEP_ALIVE:
            break
        held.append(nxt)
        num_tokens += len(nxt.token_ids)
    return merge_deltas(held) if len(held) > 1 else out


def _unavailable(e: Exception) -> APIError:
    return APIError(503, f"the engine is not available: {e}", type="server_error", code="engine_unavailable")


def _refusal(e: QueueFullError | RequestError, chat: bool) -> APIError:
    """A request the engine refused: 429 when its queue is full, else 400."""
    if isinstance(e, QueueFullError):
        return APIError(429, f"the server is busy ({e}); retry shortly", type="rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    field = str(e).partition(":")[0]  # a sampling field the engine checks against its model (check_vocab_params)
    return _invalid(str(e), param=field if field == "logit_bias" else "messages" if chat else "prompt")


def create_app(engine: AsyncEngine | EngineClient, model_name: str, api_key: str | None = None, *,
               sse_keepalive_s: float = SSE_KEEPALIVE_S, stream_interval: int = 1,
               multiprocess_metrics: bool = False) -> FastAPI:
    """The server app over ``engine``; the app starts the engine (if it is not running yet) and shuts it
    down with itself. ``api_key``: required as ``Authorization: Bearer <key>`` on /v1 routes.
    ``sse_keepalive_s``: how long a stream goes without a delta before it gets a keep-alive comment.
    ``stream_interval``: tokens a streamed response gathers per event after its first (1: an event per engine step;
    N: a write and its framing per N tokens, for servers whose event loop is the limit at high concurrency).
    ``multiprocess_metrics``: this app is one of several server processes over one engine (``runtime.api_servers``);
    /metrics sums every process's request metrics (``runtime.metrics``).
    Raises ValueError for an empty key, and GenerationConfigError (a ValueError) when the artifact's
    generation_config.json sets a sampling default that is not allowed."""
    if api_key is not None and not api_key.strip():
        raise ValueError(f"api_key {api_key!r} is empty: it would let every request in; pass a non-empty key, "
                         f"or None to serve without one")
    if not sse_keepalive_s > 0:
        raise ValueError(f"sse_keepalive_s must be > 0, got {sse_keepalive_s}")
    if isinstance(stream_interval, bool) or not isinstance(stream_interval, int) or stream_interval < 1:
        raise ValueError(f"stream_interval must be a whole number of tokens >= 1, got {stream_interval!r}")
    h = _Handlers(engine, model_name, api_key, sse_keepalive_s, stream_interval, multiprocess_metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        log.info("serving %s (max_seq_len %d)%s; sampling defaults %s", model_name, h.max_seq_len,
                 "" if api_key else ", no API key", h.sampling_defaults)
        try:
            yield
        finally:
            await h.keep_alive.close()
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="llm-builder runtime", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine, app.state.metrics = engine, h.metrics

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return h.error_response(request, exc)

    @app.exception_handler(RequestValidationError)  # FastAPI's own validation: 400, not 422
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return h.error_response(request, _validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)  # unknown routes, wrong methods
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = (f"no route {request.method} {request.url.path}" if exc.status_code == 404
                   else f"{request.method} {request.url.path}: {exc.detail}")
        return h.error_response(request, APIError(exc.status_code, message, type=kind, headers=exc.headers))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return h.error_response(request, APIError(500, f"internal error: {type(exc).__name__}", type="server_error"))

    auth = [Depends(h.check_api_key)]
    bearer = _BEARER if api_key is not None else {}
    app.add_api_route("/health", h.health, methods=["HEAD"], include_in_schema=False)  # uptime probes that ask HEAD
    app.add_api_route("/health", h.health, methods=["GET"], response_model=None,
                      responses={200: {"model": HealthResponse, "description": "the engine is stepping"},
                                 **_error_responses(503)})
    app.add_api_route("/metrics", h.prometheus, methods=["GET"], response_class=PlainTextResponse,
                      responses={200: {"description": "Prometheus text format (all llm_*)"}})
    app.add_api_route("/v1/models", h.models, methods=["GET"], dependencies=auth, response_model=None,
                      responses={200: {"model": ModelList, "description": "the served model"},
                                 **_error_responses(401)}, openapi_extra=bearer or None)
    app.add_api_route("/v1/completions", h.completions, methods=["POST"], dependencies=auth, response_model=None,
                      responses=_generation_responses(CompletionResponse, "text_completion"),
                      openapi_extra={**_json_body(CompletionBody), **bearer})
    app.add_api_route("/v1/chat/completions", h.chat_completions, methods=["POST"], dependencies=auth,
                      response_model=None, responses=_generation_responses(ChatCompletionResponse,
                                                                           "chat.completion.chunk"),
                      openapi_extra={**_json_body(ChatBody), **bearer})
    app.openapi = lambda: _openapi(app, (CompletionBody, ChatBody), api_key is not None)
    return app
