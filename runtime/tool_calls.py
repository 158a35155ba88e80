"""Tool (function) calling: the OpenAI ``tools`` / ``tool_choice`` fields as a grammar the output is held to, the
conversation rendered with the tools, and the generated text parsed back into ``tool_calls``, whole or streamed.

The model calls a tool by writing (the Hermes / Qwen convention, one line of compact JSON per call):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

    tool_choice   what the output may be (the grammar, runtime.structured)
    none          free text; the tools are not shown to the model
    auto          free text with any number of calls in it; a call, once begun, follows its function's schema
    required      one or more calls and nothing else (exactly one when parallel_tool_calls is false)
    {"type": "function", "function": {"name": N}}   exactly one call of N

A chat template that renders tools itself (it mentions ``tools``) gets them as the ``tools`` variable, and earlier
assistant calls as ``tool_calls`` (arguments as objects, as Hugging Face templates expect); for one that does not,
the tools and the format above go into the system message and earlier calls into the assistant's text. Tool
results are messages of role ``tool``, rendered by the template as any other role.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from runtime.structured import JSON_FORMAT, StructuredOutput

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_HEAD = '\n{"name": "'  # after CALL_OPEN, up to the function name
_ARGS = '", "arguments": '  # after the name, before the arguments object
_TAIL = "}\n" + CALL_CLOSE  # after the arguments object
NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # a function declared without parameters


class ToolError(ValueError):
    """Bad ``tools`` / ``tool_choice``: the message starts with the field path at fault."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param.split(".")[0].split("[")[0]  # the top-level request field


@dataclass(frozen=True)
class Tool:
    """One declared function."""

    name: str
    parameters: dict[str, Any]  # the arguments' JSON schema
    description: str | None = None
    spec: dict[str, Any] = field(default_factory=dict, compare=False)  # the request's tool object, for the template


def parse_tools(tools: list[Any]) -> list[Tool]:
    """The request's ``tools``, checked: ``{"type": "function", "function": {"name", "description"?,
    "parameters"?, "strict"?}}`` each, names unique."""
    out: list[Tool] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ToolError(where, 'each tool must be {"type": "function", "function": {...}}; only function tools '
                                   'are supported')
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolError(f"{where}.function", "must be an object with a name (and description, parameters)")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise ToolError(f"{where}.function.name", f"{name!r} is not a function name: 1 to 64 letters, digits, "
                                                      f"underscores or dashes")
        if any(t.name == name for t in out):
            raise ToolError(f"{where}.function.name", f"{name!r} is declared twice")
        parameters = fn.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise ToolError(f"{where}.function.parameters", "must be a JSON schema of an object")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise ToolError(f"{where}.function.description", "must be a string")
        out.append(Tool(name, parameters, description, tool))
    return out


def resolve_tool_choice(tool_choice: Any, tools: list[Tool]) -> str | Tool:
    """``tool_choice`` as "none", "auto", "required" or the named Tool. Without tools only "none" (or nothing)."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if tool_choice in ("none", "auto", "required"):
        if not tools and tool_choice != "none":
            raise ToolError("tool_choice", f"{tool_choice!r} needs tools; the request declares none")
        return tool_choice
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise ToolError("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "function": '
                                       '{"name": ...}}')
    for tool in tools:
        if tool.name == name:
            return tool
    raise ToolError("tool_choice", f"names the function {name!r}, which tools does not declare "
                                   f"(declared: {', '.join(t.name for t in tools) or 'none'})")


def _literal(text: str) -> str:
    return json.dumps(text)  # a Lark string literal: JSON's escapes


def _function_rules(tools: list[Tool]) -> str:
    """One Lark rule per function: its name, then its arguments' schema (compact JSON, as JSON_FORMAT). The arguments
    are the declared parameters only, unless the schema says otherwise: they become a function's keyword arguments,
    where an undeclared one is an error."""
    rules = []
    for i, tool in enumerate(tools):
        schema = {"additionalProperties": False, **tool.parameters,
                  "x-guidance": {**JSON_FORMAT, **tool.parameters.get("x-guidance", {})}}
        rules.append(f"fn_{i}: {_literal(tool.name + _ARGS)} %json {json.dumps(schema, ensure_ascii=False)}")
    return "\n".join(rules)


def tool_grammar(tools: list[Tool], choice: str | Tool, parallel: bool = True) -> StructuredOutput | None:
    """The grammar of the output under ``choice`` (module docstring); None for "none" (free text)."""
    if choice == "none":
        return None
    chosen = [choice] if isinstance(choice, Tool) else tools
    fns = " | ".join(f"fn_{i}" for i in range(len(chosen)))
    body = f"{_literal(_HEAD)} ({fns}) {_literal(_TAIL)}"  # fn_i: the name, its closing quote, the arguments
    if choice == "auto":
        lark = ["start: (before_call call)* TEXT", f"before_call[lazy]: TEXT {_literal(CALL_OPEN)}",
                r"TEXT: /(.|\n)*/", f"call: {body}"]
    else:
        repeat = ' ("\\n" call)*' if parallel and not isinstance(choice, Tool) else ""
        lark = [f"start: call{repeat}", f"call: {_literal(CALL_OPEN)} {body}"]
    return StructuredOutput("grammar", "%llguidance {}\n" + "\n".join(lark) + "\n" + _function_rules(chosen) + "\n")


def format_call(name: str, arguments: str) -> str:
    """One call as the model writes it (also how earlier calls are shown to a template without tool support)."""
    return f"{CALL_OPEN}{_HEAD}{name}{_ARGS}{arguments}{_TAIL}"


def system_prompt(tools: list[Tool]) -> str:
    """What a chat template that does not render tools is told in the system message."""
    declared = "\n".join(json.dumps({"name": t.name, "description": t.description or "", "parameters": t.parameters},
                                    ensure_ascii=False) for t in tools)
    return ("You may call these functions (JSON schemas of their arguments):\n" + declared +
            "\nTo call one, write\n" + format_call("<function name>", "<arguments as a JSON object>") +
            "\nand wait for its result.")


# --- parsing the output ------------------------------------------------------------------------------------------
@dataclass
class ToolCall:
    id: str  # call_<hex>, what a tool result's tool_call_id refers to
    name: str
    arguments: str  # the JSON text of the arguments, as generated (OpenAI sends them as a string)
    complete: bool = False  # its closing tag has been read


@dataclass
class ToolCallDelta:
    """What one piece of streamed text adds: content, a call begun (with its name), or more of a call's arguments."""

    content: str = ""
    calls: list[tuple[int, ToolCall | None, str]] = field(default_factory=list)  # (index, the call when it just
    # began else None, arguments text added); one entry per index

    def add_call(self, index: int, call: ToolCall | None, arguments: str) -> None:
        if self.calls and self.calls[-1][0] == index:
            last_index, last_call, last_arguments = self.calls[-1]
            self.calls[-1] = (index, last_call or call, last_arguments + arguments)
        else:
            self.calls.append((index, call, arguments))

    def extend(self, other: ToolCallDelta) -> None:
        self.content += other.content
        for entry in other.calls:
            self.add_call(*entry)


def _held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _cut_tail(arguments: str) -> int:
    """At the end of an output cut off inside a call: how many characters at the end of ``arguments`` are the
    start of the call's closing (``_TAIL``), not arguments. With a line break in it that is certain (the arguments
    are one line); a lone "}" is the closing's when the arguments parse without it and not with it."""
    held = _held_back(arguments, _TAIL)
    if held >= 2:
        return held
    return held if held == 1 and not _is_json(arguments) and _is_json(arguments[:-1]) else 0


class ToolCallParser:
    """Splits the generated text into content and tool calls as it arrives (the format in the module docstring;
    the grammar guarantees it, so a call is recognised by position, not by guessing).

    ``feed`` returns what each new piece adds, holding back text that may be the start of a marker; ``finish``
    returns what is left. Content that is only whitespace around calls is dropped."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self.content = ""  # all content so far
        self._buffer = ""  # text not yet classified
        self._state = "content"  # content | head (reading the name) | arguments
        self._pending_space = ""  # whitespace held until content that is not whitespace follows
        self._after_call = False  # a call just ended: the whitespace after it is dropped
        self._cut_off = False  # finish's: the output ended at max_tokens

    def feed(self, text: str) -> ToolCallDelta:
        delta = ToolCallDelta()
        self._buffer += text
        while self._step(delta, final=False):
            pass
        return delta

    def finish(self, cut_off: bool = False) -> ToolCallDelta:
        """The rest, at the end of the output (an unfinished call keeps the arguments it has). ``cut_off``: the
        output ended at max_tokens, so content ending in the start of a call's opening ("<tool_call" cut short) is
        that call's, not text."""
        delta = ToolCallDelta()
        self._cut_off = cut_off
        while self._step(delta, final=True):
            pass
        return delta

    def _step(self, delta: ToolCallDelta, final: bool) -> bool:
        """Consume what the buffer allows; True when the state changed (call again)."""
        buf = self._buffer
        if self._state == "content":
            at = buf.find(CALL_OPEN)
            held = _held_back(buf, CALL_OPEN)
            # at the end of an output max_tokens cut off, a "<t..." is the start of a call, not content (a lone "<"
            # is too common in text to drop); at the end of one that finished, it is text
            end = at if at >= 0 else len(buf) - (held if not final or (self._cut_off and held >= 2) else 0)
            self._add_content(delta, buf[:end], final and at < 0)
            if at < 0:
                self._buffer = buf[end:]
                return False
            self._buffer, self._state = buf[at + len(CALL_OPEN):], "head"
            return True
        if self._state == "head":
            match = re.match(r'\n\{"name": "((?:[^"\\]|\\.)*)", "arguments": ', buf)
            if match is None:
                if final:  # cut off (max_tokens) before the name was complete: nothing to report
                    self._buffer = ""
                return False
            self._pending_space = ""  # whitespace before a call is dropped
            call = ToolCall(f"call_{uuid.uuid4().hex[:24]}", json.loads(f'"{match[1]}"'), "")
            self.calls.append(call)
            delta.add_call(len(self.calls) - 1, call, "")
            self._buffer, self._state = buf[match.end():], "arguments"
            return True
        at = buf.find(_TAIL)  # arguments: compact JSON on one line, so the first "}\n</tool_call>" ends them
        if at >= 0:
            end = at
        elif final:  # judged on the call's whole arguments (what was sent already included)
            end = len(buf) - min(len(buf), _cut_tail(self.calls[-1].arguments + buf))
        else:
            end = len(buf) - _held_back(buf, _TAIL)
        if end > 0:
            self.calls[-1].arguments += buf[:end]
            delta.add_call(len(self.calls) - 1, None, buf[:end])
        if at < 0:
            self._buffer = buf[end:]
            return False
        self.calls[-1].complete = True
        self._buffer, self._state, self._after_call = buf[at + len(_TAIL):], "content", True
        return True

    def _add_content(self, delta: ToolCallDelta, text: str, drop_trailing: bool) -> None:
        """Content, less the whitespace next to a call and at the end (trailing whitespace waits for what follows)."""
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
            if self.content:  # text on both sides of a call: one line break between them
                text = "\n" + text
        text = self._pending_space + text
        keep = text.rstrip()
        self._pending_space = "" if drop_trailing else text[len(keep):]
        self.content += keep
        delta.content += keep


def message_for_template(message: dict[str, Any], native: bool) -> dict[str, Any]:
    """An assistant message with ``tool_calls`` as the chat template takes it: ``native`` (the template renders
    calls): arguments as objects; else the calls written into the content as the model writes them."""
    calls = message.get("tool_calls") or []
    if not calls:
        return message
    if native:
        rendered = []
        for call in calls:
            fn = dict(call.get("function", {}))
            try:
                fn["arguments"] = json.loads(fn.get("arguments") or "{}")
            except (TypeError, json.JSONDecodeError):
                pass  # not JSON: the template gets the text
            rendered.append({**call, "function": fn})
        return {**message, "tool_calls": rendered}
    text = "\n".join(format_call(c["function"]["name"], c["function"].get("arguments") or "{}") for c in calls)
    content = message.get("content") or ""
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": f"{content}\n{text}".strip()}
