"""Tool calls: the tools shown to the model, the grammar that forces a call,
and the model's text turned into OpenAI ``tool_calls`` (whole or streamed).

``tool_choice`` decides how:

- ``"auto"`` (the default with tools): the model may answer or call; a
  parser finds the calls in its text. The default parser reads the
  JSON-in-tags format of Hermes, Qwen and SmolLM-style templates:
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
- ``"required"``: the grammar allows only a JSON array of one or more calls
  ``[{"name": ..., "arguments": {...}}]``, each one's arguments valid for its
  function's schema (vLLM's way: it works with every grammar backend).
- a named function: the grammar allows only that function's arguments.
- ``"none"``: no call; the tools are not shown.

A chat template that does not render tools (SmolLM2's) gets them in a
system message, in the Hermes format the parser reads, and earlier calls
and results in the conversation become that format's text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from cadence.sampling_params import StructuredOutputParams
from cadence.server.errors import quoted

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


# ---------------------------------------------------------------- the request side


def check_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> tuple[list[dict], Any]:
    """(the function definitions, the effective tool_choice), or ValueError naming the field."""
    functions = []
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise ValueError(f'tools.{i}: must be {{"type": "function", "function": {{"name": ...}}}}')
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools.{i}.function.name: must be a non-empty string")
        parameters = function.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(parameters, dict):
            raise ValueError(f"tools.{i}.function.parameters: must be a JSON schema object")
        functions.append({**function, "parameters": parameters})
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = (function.get("name") if tool_choice.get("type") == "function" and isinstance(function, dict)
                else None)
        if not isinstance(name, str):
            raise ValueError('tool_choice: a named choice is {"type": "function", "function": {"name": ...}}')
        if name not in {f["name"] for f in functions}:
            raise ValueError(f"tool_choice: no tool named {quoted(repr(name))} in tools")
    elif tool_choice not in ("none", "auto", "required"):
        raise ValueError("tool_choice: must be none, auto, required or a named function, "
                         f"got {quoted(repr(tool_choice))}")
    elif tool_choice in ("auto", "required") and not functions:
        raise ValueError(f"tool_choice: {tool_choice!r} needs tools")
    return functions, tool_choice


def forced_call_constraint(functions: list[dict], tool_choice: Any,
                           parallel_tool_calls: bool = True) -> StructuredOutputParams | None:
    """The grammar of ``"required"`` or a named function (None for auto and none)."""
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        function = next(f for f in functions if f["name"] == name)
        return StructuredOutputParams(json=function["parameters"])
    if tool_choice != "required":
        return None
    calls = [{"type": "object",
              "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
              "required": ["name", "arguments"]} for f in functions]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return StructuredOutputParams(json=schema)


def template_renders_tools(chat_template: str | None) -> bool:
    return chat_template is not None and "tools" in chat_template


def tools_system_prompt(functions: list[dict]) -> str:
    """The Hermes tool-use instructions, which the default parser reads back."""
    listed = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False)
                       for f in functions)
    return ("You are a function calling AI model. You may call one or more functions to assist "
            "with the user query. Here are the available tools:\n<tools>\n" + listed +
            "\n</tools>\nFor each function call, return a JSON object with the function name and "
            "arguments within <tool_call></tool_call> tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def prepare_conversation(conversation: list[dict[str, Any]], functions: list[dict],
                         chat_template: str | None) -> tuple[list[dict[str, Any]], list[dict] | None]:
    """(the messages, the tools) to render.

    A template that renders tools gets them, and earlier calls' arguments as
    objects (templates ``tojson`` them). One that does not gets the tools in
    the system message, earlier calls as ``<tool_call>`` text and results as
    ``<tool_response>`` user turns.
    """
    if template_renders_tools(chat_template):
        return [_arguments_as_objects(m) for m in conversation], [
            {"type": "function", "function": f} for f in functions] or None
    messages = [_as_hermes_text(m) for m in conversation]
    if functions:
        prompt = tools_system_prompt(functions)
        if messages and messages[0]["role"] in ("system", "developer"):
            messages[0] = {**messages[0], "role": "system",
                           "content": f"{messages[0]['content']}\n\n{prompt}"}
        else:
            messages.insert(0, {"role": "system", "content": prompt})
    return messages, None


def _arguments_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    converted = []
    for call in calls:
        function = dict(call.get("function") or {})
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except json.JSONDecodeError:
                pass  # the template shows the text as it is
        converted.append({**call, "function": function})
    return {**message, "tool_calls": converted}


def _as_hermes_text(message: dict[str, Any]) -> dict[str, Any]:
    role = message["role"]
    if role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message.get('content', '')}\n</tool_response>"}
    calls = message.get("tool_calls")
    if role != "assistant" or not calls:
        return message
    texts = [message.get("content") or ""]
    for call in _arguments_as_objects(message)["tool_calls"]:
        function = call.get("function") or {}
        body = json.dumps({"name": function.get("name"), "arguments": function.get("arguments", {})},
                          ensure_ascii=False)
        texts.append(f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}")
    return {"role": "assistant", "content": "\n".join(t for t in texts if t)}


# ---------------------------------------------------------------- the response side


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Parsed:
    """What a piece of model text turned into: plain content and whole calls
    (``arguments_delta``: a fragment of the one open call's arguments, named choice only)."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    arguments_delta: str = ""


class HermesParser:
    """``<tool_call>{json}</tool_call>`` blocks; text around them is content.

    Fed text as it arrives; holds back what may be the start of a tag, and a
    block until it closes. A block whose JSON is not a call stays content.
    """

    def __init__(self) -> None:
        self._pending = ""  # text not yet classified
        self._in_call = False

    def feed(self, text: str) -> Parsed:
        self._pending += text
        parsed = Parsed()
        while True:
            if self._in_call:
                end = self._pending.find(CALL_CLOSE)
                if end < 0:
                    return parsed
                self._close_call(self._pending[:end], parsed)
                self._pending = self._pending[end + len(CALL_CLOSE):]
                self._in_call = False
                continue
            start = self._pending.find(CALL_OPEN)
            if start < 0:
                keep = _partial_tag_length(self._pending, CALL_OPEN)
                parsed.content += self._pending[:len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep:]
                return parsed
            parsed.content += self._pending[:start]
            self._pending = self._pending[start + len(CALL_OPEN):]
            self._in_call = True

    def finish(self) -> Parsed:
        """The end of the text: an unclosed block still counts if its JSON is a call
        (else it stays content, as written: no closing tag added)."""
        parsed = Parsed()
        if self._in_call:
            self._close_call(self._pending, parsed, closed=False)
        else:
            parsed.content = self._pending
        self._pending, self._in_call = "", False
        return parsed

    @staticmethod
    def _close_call(body: str, parsed: Parsed, closed: bool = True) -> None:
        call = _call_of(body)
        if call is None:
            parsed.content += f"{CALL_OPEN}{body}{CALL_CLOSE if closed else ''}"
        else:
            parsed.calls.append(call)


class CallArrayParser:
    """``[{"name": ..., "arguments": ...}, ...]`` (``tool_choice: "required"``):
    each call is parsed as soon as its object closes.

    A text cut before its array closes (by ``max_tokens``, or a stop string)
    loses nothing: the calls that closed stay calls, and the rest (the whole
    text when none closed) is content, with the finish reason that cut it.
    """

    def __init__(self) -> None:
        self._scanner = _JsonScanner()
        self._text: list[str] = []
        self._num_calls = 0

    def feed(self, text: str) -> Parsed:
        self._text.append(text)
        parsed = Parsed()
        for element in self._scanner.feed(text):
            call = _call_of(element)
            if call is not None:
                parsed.calls.append(call)
        self._num_calls += len(parsed.calls)
        return parsed

    def finish(self) -> Parsed:
        if self._scanner.closed:
            return Parsed()
        rest = "".join(self._text)[self._scanner.num_consumed:]
        if self._num_calls:  # the separator before the cut call is not part of it
            rest = rest.lstrip(", \n\t\r")
        return Parsed(content=rest)


class NamedCallParser:
    """The whole text is the arguments of one call to ``name`` (a named
    ``tool_choice``), streamed as it comes."""

    def __init__(self, name: str) -> None:
        self.call = ToolCall(name, "")
        self._started = False

    def feed(self, text: str) -> Parsed:
        if not self._started:
            self._started = True
            self.call.arguments = text
            return Parsed(calls=[self.call])
        self.call.arguments += text
        return Parsed(arguments_delta=text)

    def finish(self) -> Parsed:
        return self.feed("") if not self._started else Parsed()


ToolParser = HermesParser | CallArrayParser | NamedCallParser
# Parsers of tool_choice "auto", by --tool-call-parser name.
AUTO_TOOL_PARSERS: dict[str, Callable[[], ToolParser]] = {"hermes": HermesParser}


def parser_for(tool_choice: Any, auto_parser: str = "hermes") -> ToolParser | None:
    if tool_choice == "none":
        return None
    if tool_choice == "required":
        return CallArrayParser()
    if isinstance(tool_choice, dict):
        return NamedCallParser(tool_choice["function"]["name"])
    return AUTO_TOOL_PARSERS[auto_parser]()


def parse_all(parser: ToolParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content or None, calls) of a whole completion."""
    first, last = parser.feed(text), parser.finish()
    calls = first.calls + last.calls
    content = first.content + last.content
    if calls and not content.strip():
        return None, calls
    return content, calls


def _call_of(text: str) -> ToolCall | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _partial_tag_length(text: str, tag: str) -> int:
    """How many of ``text``'s last characters could begin ``tag``."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


class _JsonScanner:
    """Finds the elements of a top-level JSON array as they complete.

    ``num_consumed``: characters fed up to the end of the last complete
    element; ``closed``: the array's ``]`` has been seen.
    """

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._element: list[str] = []
        self._num_fed = 0
        self.num_consumed = 0
        self.closed = False

    def feed(self, text: str) -> list[str]:
        done = []
        for char in text:
            self._num_fed += 1
            if self._depth >= 2 or (self._depth == 1 and char not in ",] \n\t\r"):
                self._element.append(char)
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
                continue
            if char == '"':
                self._in_string = True
            elif char in "[{":
                self._depth += 1
            elif char in "]}":
                self._depth -= 1
                if self._depth == 1 and self._element:
                    done.append("".join(self._element))
                    self._element = []
                    self.num_consumed = self._num_fed
                elif self._depth == 0:
                    self.closed = True
        return done


def tool_calls_finish(finish_reason: str | None) -> str | None:
    """A completion that ended on its own after calling tools finished with "tool_calls"."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


class ToolCallDeltas:
    """One streamed choice: its text deltas as OpenAI ``delta`` objects, with
    content and ``tool_calls`` separated (``parser`` None: all content)."""

    def __init__(self, parser: ToolParser | None) -> None:
        self.parser = parser
        self.num_calls = 0
        # Whitespace-only content is held until text follows it: a completion
        # that turns out to be only calls has no content, as its whole parse.
        self.held_space = ""

    def take(self, text: str, finished: bool) -> dict[str, Any]:
        if self.parser is None:
            return {"content": text} if text else {}
        parsed = self.parser.feed(text)
        if finished:
            end = self.parser.finish()
            parsed = Parsed(parsed.content + end.content, parsed.calls + end.calls,
                            parsed.arguments_delta + end.arguments_delta)
        delta: dict[str, Any] = {}
        content = self.held_space + parsed.content
        self.held_space = ""
        if content.strip() or (finished and not self.num_calls + len(parsed.calls)):
            if content:
                delta["content"] = content
        elif not finished:
            self.held_space = content
        calls = []
        for call in parsed.calls:
            calls.append({"index": self.num_calls, **call.to_openai()})
            self.num_calls += 1
        if parsed.arguments_delta:  # the open call is the last one started
            calls.append({"index": self.num_calls - 1, "function": {"arguments": parsed.arguments_delta}})
        if calls:
            delta["tool_calls"] = calls
        return delta
