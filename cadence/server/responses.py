"""POST /v1/responses: OpenAI's Responses API as a translation over the chat path.

    ResponsesRequest ──► ChatCompletionRequest ──► OpenAIServing.chat ──► the chat body
         input items      messages (+ system)         (or its SSE chunks)      │
         tools, text       tools, response_format                              ▼
                                               output items (reasoning, message, function_call),
                                               status; or the typed stream events

Stateless: every turn comes in ``input`` (earlier ``function_call`` /
``function_call_output`` / ``reasoning`` items included), so ``store: true``
and ``previous_response_id`` are refused. Which top-level fields are honoured
is ``fields.py``'s rule (route "responses"). A model's reasoning (the chat
message's ``reasoning_content`` or ``reasoning``, where a reasoning parser fills
it) becomes a ``reasoning`` output item; a ``reasoning`` input item goes back
to the template as its assistant turn's ``reasoning_content``.

The helpers at the end (``chat_json``, ``chat_chunks``, ``chat_request``) read
the chat path's answers as JSON; ``messages.py`` uses them too.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, AsyncIterator, Callable, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError, model_validator

from cadence.server.errors import quoted
from cadence.server.protocol import ChatCompletionRequest, RequestBody, refuse_lone_surrogates
from cadence.server.serving import SSE_HEADERS, OpenAIServing

# How the chat path's field names read in this API's errors.
_RENAMES = ((r"^messages(\.\d+)?", "input"), (r"^max_(completion_)?tokens", "max_output_tokens"),
            (r"^response_format", "text.format"), (r"^(tools\.\d+)\.function", r"\1"))
_REASONING_FIRST = "a reasoning item must come before its assistant turn (a message or function_call)"
_STATELESS = "cadence keeps no responses (stateless): send the whole conversation in input"


class ResponsesRequest(RequestBody):
    """The honoured fields of POST /v1/responses; the others are in ``fields.py``."""

    ROUTE = "responses"
    model: str | None = None
    input: Union[str, list[dict[str, Any]]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_lone_surrogates(cls, data: Any) -> Any:
        refuse_lone_surrogates(data)
        return data

    def to_chat(self) -> ChatCompletionRequest:
        fields: dict[str, Any] = dict(
            model=self.model, messages=self.conversation(), max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature, top_p=self.top_p, tools=chat_tools(self.tools),
            tool_choice=chat_tool_choice(self.tool_choice), response_format=response_format(self.text),
            stream=self.stream, user=self.user)
        if self.parallel_tool_calls is not None:
            fields["parallel_tool_calls"] = self.parallel_tool_calls
        if self.stream:
            fields["stream_options"] = {"include_usage": True}
        return chat_request(fields, _RENAMES)

    def conversation(self) -> list[dict[str, Any]]:
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return messages + [{"role": "user", "content": self.input}]
        return messages + input_messages(self.input)


# ---------------------------------------------------------------- request: items -> messages


def input_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages of ``input`` items. A ``function_call`` joins the assistant
    turn before it (or starts one); a ``reasoning`` item becomes the next
    assistant turn's ``reasoning_content``."""
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None
    for i, item in enumerate(items):
        if item.get("type") == "reasoning":
            reasoning = (reasoning or "") + reasoning_text(item)
            continue
        message = item_message(item, i, messages, reasoning)
        if reasoning is not None:
            if message.get("role") != "assistant":
                raise ValueError(f"input.{i}: {_REASONING_FIRST}")
            message["reasoning_content"], reasoning = reasoning, None
        if not messages or messages[-1] is not message:
            messages.append(message)
    if reasoning is not None:
        raise ValueError(f"input: {_REASONING_FIRST}")
    return messages


def item_message(item: dict[str, Any], i: int, messages: list[dict[str, Any]],
                 reasoning: str | None) -> dict[str, Any]:
    """The chat message of input item ``i`` (a function call: the turn it joins)."""
    kind = item.get("type", "message")
    if kind == "message":
        return {"role": item.get("role"), "content": message_text(item.get("content"), i)}
    if kind == "function_call":
        message = assistant_turn(messages, reasoning)
        message.setdefault("tool_calls", []).append({
            "id": item.get("call_id"), "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}})
        return message
    if kind == "function_call_output":
        return {"role": "tool", "tool_call_id": item.get("call_id"),
                "content": message_text(item.get("output"), i, "output")}
    if kind == "item_reference":
        raise ValueError(f"input.{i}: item_reference: {_STATELESS}")
    raise ValueError(f"input.{i}.type: {shown(kind)} items are not supported (text messages, "
                     "function_call, function_call_output and reasoning are)")


def assistant_turn(messages: list[dict[str, Any]], reasoning: str | None) -> dict[str, Any]:
    """The assistant turn a function call joins: the last message if it is one
    (and no new reasoning starts a new turn), else a new one."""
    if messages and messages[-1]["role"] == "assistant" and reasoning is None:
        return messages[-1]
    return {"role": "assistant", "content": None}


def reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning item's text: its ``content`` (reasoning_text parts), else its summary."""
    parts = item.get("content") or item.get("summary") or []
    return "".join(part.get("text", "") for part in parts if isinstance(part, dict))


def message_text(content: Any, i: int, field: str = "content") -> str | None:
    """A message's or output's text: a string, or text parts joined."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"input.{i}.{field}: must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise ValueError(f"input.{i}.{field}.{j}.type: {shown(kind)} parts are not supported "
                             "(cadence serves text models: input_text and output_text)")
        texts.append(part.get("text") or "")
    return "".join(texts)


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat's ``{"type": "function", "function": {...}}``."""
    if tools is None:
        return None
    converted = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise ValueError(f"tools.{i}.type: {shown(tool.get('type'))} tools are not supported "
                             "(function tools are)")
        converted.append({"type": "function", "function": {
            key: value for key, value in tool.items() if key != "type" and value is not None}})
    return converted


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function":
        raise ValueError(f"tool_choice: {shown(choice.get('type'))} choices are not supported "
                         '(none, auto, required or {"type": "function", "name": ...})')
    return {"type": "function", "function": {"name": choice.get("name")}}


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``; ``text.verbosity`` is refused."""
    text = dict(text or {})
    fmt = text.pop("format", None) or {"type": "text"}
    for key, value in text.items():
        if value is not None:
            raise ValueError(f"text.{key}: not supported yet")
    if fmt.get("type") != "json_schema":
        return fmt
    details = {key: fmt.get(key) for key in ("name", "schema", "strict", "description")}
    return {"type": "json_schema", "json_schema": details}


# ---------------------------------------------------------------- response: chat -> output items


def shown(value: Any) -> str:
    """A value of the request as an error quotes it (at most 100 characters)."""
    return quoted(repr(value))


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_reasoning(message: dict[str, Any]) -> str | None:
    """The reasoning a chat message or delta carries, under either of its names."""
    return message.get("reasoning_content") or message.get("reasoning")


def output_items(message: dict[str, Any], incomplete: bool) -> list[dict[str, Any]]:
    """The output items of one chat message: reasoning, text, then function calls."""
    items = []
    status = "incomplete" if incomplete else "completed"
    reasoning = message_reasoning(message)
    if reasoning:
        items.append(reasoning_item(new_id("rs"), reasoning, status))
    calls = message.get("tool_calls") or []
    if message.get("content") or not (calls or items):
        items.append(message_item(new_id("msg"), message.get("content") or "", status))
    for call in calls:
        function = call["function"]
        items.append(call_item(new_id("fc"), call["id"], function["name"], function["arguments"],
                               status))
    return items


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [output_text(text)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": content}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def response_usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    prompt_details = usage.get("prompt_tokens_details") or {}
    completion_details = usage.get("completion_tokens_details") or {}
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": prompt_details.get("cached_tokens", 0)},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": completion_details.get("reasoning_tokens", 0)},
            "total_tokens": usage["total_tokens"]}


class ResponseHead:
    """The response object's fields that do not depend on the output."""

    def __init__(self, body: ResponsesRequest, model: str) -> None:
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.fields = {
            "object": "response", "model": model, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "temperature": body.temperature,
            "top_p": body.top_p, "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
            "previous_response_id": None, "store": False, "truncation": "disabled",
            "reasoning": {"effort": None, "summary": None}, "metadata": {}, "user": body.user,
        }

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None
                 ) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        finished = status in ("completed", "incomplete")
        return {"id": self.id, "created_at": self.created_at, "status": status, **self.fields,
                "completed_at": int(time.time()) if finished else None, "error": None,
                "incomplete_details": incomplete, "output": output, "usage": usage}


def whole_response(head: ResponseHead, chat: dict[str, Any]) -> dict[str, Any]:
    choice = chat["choices"][0]
    incomplete = choice["finish_reason"] == "length"
    output = output_items(choice["message"], incomplete)
    return head.response("incomplete" if incomplete else "completed", output,
                         response_usage(chat.get("usage")))


class ResponseEvents:
    """The chat stream's chunks as the Responses API's typed events, in the
    order the ``openai`` client's accumulator reads them:

        response.created, response.in_progress
        per item: output_item.added, [content_part.added], its deltas,
                  its .done events, [content_part.done], output_item.done
        response.completed (or response.incomplete: max_output_tokens)
    """

    def __init__(self, head: ResponseHead) -> None:
        self.head = head
        self.num_events = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item whose deltas are arriving
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.num_events, **fields}
        self.num_events += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def start(self) -> list[str]:
        response = self.head.response("in_progress", [], None)
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response)]

    def take(self, chunk: dict[str, Any]) -> list[str]:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        events: list[str] = []
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            reasoning = message_reasoning(delta)
            if reasoning:
                events += self._text_delta("reasoning", reasoning)
            if delta.get("content"):
                events += self._text_delta("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call_delta(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return events

    def end(self) -> list[str]:
        incomplete = self.finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        events = self._close(status)
        if not self.output:  # nothing came: an empty message, as the whole body has
            events += self._open("message") + self._close(status)
        response = self.head.response(status, self.output, response_usage(self.usage))
        return events + [self.event(f"response.{status}", response=response)]

    def error(self, error: dict[str, Any]) -> list[str]:
        return [self.event("error", code=error.get("type"), message=error.get("message", ""),
                           param=error.get("param"))]

    def _text_delta(self, kind: str, text: str) -> list[str]:
        events = [] if self.open is not None and self.open["type"] == kind else self._close() + self._open(kind)
        part = self.open["content"][0]
        part["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return events + [self.event(name, **self._where(), content_index=0, delta=text, **extra)]

    def _call_delta(self, call: dict[str, Any]) -> list[str]:
        events: list[str] = []
        arguments = (call.get("function") or {}).get("arguments") or ""
        if call.get("id"):  # a new call
            events += self._close()
            name = call["function"]["name"]
            events += self._open("function_call", call_item(new_id("fc"), call["id"], name, "",
                                                            "in_progress"))
        if arguments and self.open is not None:
            self.open["arguments"] += arguments
            events.append(self.event("response.function_call_arguments.delta", **self._where(),
                                     delta=arguments))
        return events

    def _open(self, kind: str, item: dict[str, Any] | None = None) -> list[str]:
        if item is None:
            item = (reasoning_item(new_id("rs"), "", "in_progress") if kind == "reasoning"
                    else message_item(new_id("msg"), "", "in_progress"))
        self.open = item
        output_index = len(self.output)
        self.output.append(item)
        added = {**item, "content": []} if kind != "function_call" else dict(item)
        events = [self.event("response.output_item.added", output_index=output_index, item=added)]
        if kind != "function_call":
            part = {**item["content"][0], "text": ""}
            events.append(self.event("response.content_part.added", **self._where(),
                                     content_index=0, part=part))
        return events

    def _close(self, status: str = "completed") -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        where = {"item_id": item["id"], "output_index": self.output.index(item)}
        if item["type"] == "function_call":
            events = [self.event("response.function_call_arguments.done", **where,
                                 name=item["name"], arguments=item["arguments"])]
        else:
            part = item["content"][0]
            done = ({"text": part["text"]} if item["type"] == "reasoning"
                    else {"text": part["text"], "logprobs": []})
            kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
            events = [self.event(f"response.{kind}.done", **where, content_index=0, **done),
                      self.event("response.content_part.done", **where, content_index=0,
                                 part=part)]
        return events + [self.event("response.output_item.done", output_index=where["output_index"],
                                    item=item)]

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1}


# ---------------------------------------------------------------- the route


def add_responses_routes(app: FastAPI, serving: OpenAIServing, resolve: Callable[[str | None], Any]
                         ) -> None:
    """POST /v1/responses; ``resolve``: the model field -> its LoRA request (404 if unknown)."""

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, raw: Request):
        lora_request = resolve(body.model)
        chat = body.to_chat()
        head = ResponseHead(body, served_name(serving, lora_request))
        if not body.stream:
            result = await chat_json(serving, chat, raw, lora_request, _RENAMES)
            return JSONResponse(whole_response(head, result))
        response = await open_chat_stream(serving, chat, raw, lora_request, _RENAMES)
        return translated_stream(translated_events(ResponseEvents(head), chat_chunks(response)), response)


async def translated_events(events: Any, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """An API's stream events from the chat stream's chunks: ``events`` (this
    module's ``ResponseEvents`` or messages.py's ``MessageEvents``) gives the
    opening events, the events of each chunk, those of an error (which ends
    the stream) and the closing ones."""
    for event in events.start():
        yield event
    async for chunk in chunks:
        if "error" in chunk:
            for event in events.error(chunk["error"]):
                yield event
            return
        for event in events.take(chunk):
            yield event
    for event in events.end():
        yield event


# ---------------------------------------------------------------- the chat path, read as JSON


def served_name(serving: OpenAIServing, lora_request: Any) -> str:
    """The model an answer names: the adapter the model field named, or the base model."""
    return lora_request.lora_name if lora_request is not None else serving.model_name


def chat_request(fields: dict[str, Any], renames: tuple[tuple[str, str], ...]) -> ChatCompletionRequest:
    """The chat request of a translated body (None fields left out); its
    errors name the translating API's fields."""
    try:
        return ChatCompletionRequest.model_validate(
            {key: value for key, value in fields.items() if value is not None})
    except ValidationError as err:
        first = err.errors()[0]
        message = first.get("msg", "invalid value").removeprefix("Value error, ")
        location = ".".join(str(part) for part in first.get("loc", ()))
        raise ValueError(renamed(f"{location}: {message}" if location else message, renames)) from None
    except ValueError as err:
        raise ValueError(renamed(str(err), renames)) from None


def renamed(message: str, renames: tuple[tuple[str, str], ...]) -> str:
    """An error of the chat path with its leading field in the translating API's name."""
    for pattern, name in renames:
        message, count = re.subn(pattern, name, message, count=1)
        if count:
            return message
    return message


async def chat_json(serving: OpenAIServing, chat: ChatCompletionRequest, raw: Request,
                    lora_request: Any, renames: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """The chat path's whole answer, as its JSON body."""
    try:
        response = await serving.chat(chat, raw, lora_request)
    except ValueError as err:
        raise ValueError(renamed(str(err), renames)) from None
    return json.loads(response.body)


async def open_chat_stream(serving: OpenAIServing, chat: ChatCompletionRequest, raw: Request,
                           lora_request: Any, renames: tuple[tuple[str, str], ...]) -> StreamingResponse:
    try:
        return await serving.chat(chat, raw, lora_request)
    except ValueError as err:
        raise ValueError(renamed(str(err), renames)) from None


async def chat_chunks(response: StreamingResponse) -> AsyncIterator[dict[str, Any]]:
    """The chat stream's chunks as dicts (an error event as ``{"error": ...}``),
    until ``[DONE]``. However the iteration ends, the chat stream is closed,
    which aborts its engine request (a client gone mid-stream)."""
    iterator = response.body_iterator
    pending = ""
    try:
        async for piece in iterator:
            pending += piece.decode() if isinstance(piece, bytes) else str(piece)
            # Events end with a blank line. Not splitlines(): a model's text may hold
            # U+2028 or U+0085, which JSON leaves unescaped and splitlines() splits on.
            *events, pending = pending.split("\n\n")
            for event in events:
                if event == "data: [DONE]":
                    return
                if event.startswith("data: "):
                    yield json.loads(event[len("data: "):])
    finally:
        await iterator.aclose()  # type: ignore[attr-defined]


def translated_stream(events: AsyncIterator[str], chat_response: StreamingResponse) -> StreamingResponse:
    """The translated events as SSE, keeping the chat response's background close."""
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS,
                             background=chat_response.background)
