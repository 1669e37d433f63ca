"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API
as a translation over the chat path.

    MessagesRequest ──► ChatCompletionRequest ──► OpenAIServing.chat ──► the chat body
      system, blocks      messages, tools,            (or its SSE chunks)     │
      tool_use/result     tool_choice, stop                                    ▼
                                  content blocks (thinking, text, tool_use), stop_reason,
                                  usage; or message_start ... message_stop events

Blocks to messages: ``text`` is content; an assistant's ``tool_use`` is a
tool call; a user's ``tool_result`` is a ``tool`` message (before the turn's
text); an assistant's ``thinking`` goes back to the template as
``reasoning_content``. A model's reasoning (the chat message's
``reasoning_content`` or ``reasoning``, where a reasoning parser fills it)
comes back as a ``thinking`` block, with an empty signature (cadence signs
nothing). ``thinking``: ``enabled`` sets the template's ``enable_thinking`` and
its ``budget_tokens`` is the thinking token budget (with ``--reasoning-parser``),
``disabled`` clears ``enable_thinking``, ``adaptive`` leaves the model its own
way. stop_reason: ``end_turn``, ``max_tokens``, ``stop_sequence`` (with
the sequence) or ``tool_use``. Errors are Anthropic's shape,
``{"type": "error", "error": {"type", "message"}}``, streamed as an ``error``
event. Which top-level fields are honoured is ``fields.py``'s rule.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Callable, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import Field, ValidationError, model_validator

from cadence.engine.async_llm import EngineDeadError, QueueFullError
from cadence.server.errors import (
    ClientGone, GenerationFailed, ModelNotFound, error_response, field_of, validation_error_response,
)
from cadence.server.protocol import ChatCompletionRequest, RequestBody, refuse_lone_surrogates
from cadence.server.responses import (
    translated_events,
    chat_chunks, chat_json, chat_request, message_reasoning, new_id, open_chat_stream, served_name,
    shown, translated_stream,
)
from cadence.server.serving import OpenAIServing, render_chat
from cadence.server.tool_calls import prepare_conversation

_RENAMES = ((r"^messages\.\d+", "messages"), (r"^max_(completion_)?tokens", "max_tokens"),
            (r"^stop(?!_)", "stop_sequences"), (r"^(tools\.\d+)\.function\.parameters", r"\1.input_schema"),
            (r"^(tools\.\d+)\.function", r"\1"), (r"^thinking_token_budget", "thinking.budget_tokens"),
            (r"^chat_template_kwargs", "thinking"))
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error"}


class _Conversation(RequestBody):
    """What both routes read: the conversation, its system prompt and tools."""

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: Union[str, list[dict[str, Any]], None] = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_lone_surrogates(cls, data: Any) -> Any:
        refuse_lone_surrogates(data)
        return data

    def chat_fields(self, generating: bool = True) -> dict[str, Any]:
        fields = dict(model=self.model, messages=self.conversation(), tools=chat_tools(self.tools),
                      tool_choice=chat_tool_choice(self.tool_choice),
                      **thinking_fields(self.thinking, generating))
        if (self.tool_choice or {}).get("disable_parallel_tool_use"):
            fields["parallel_tool_calls"] = False
        return fields

    def conversation(self) -> list[dict[str, Any]]:
        messages = [{"role": "system", "content": system_text(self.system)}] if self.system else []
        for i, message in enumerate(self.messages):
            messages += chat_messages(message, i)
        if self.messages[-1].get("role") == "assistant":
            raise ValueError("messages: a last assistant turn (a prefill to continue) is not "
                             "supported yet")
        return messages


class MessagesRequest(_Conversation):
    """The honoured fields of POST /v1/messages; the others are in ``fields.py``.
    ``temperature``, ``top_p`` and ``top_k`` are Anthropic's older sampling fields."""

    ROUTE = "messages"
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None

    def to_chat(self) -> ChatCompletionRequest:
        fields = dict(self.chat_fields(), max_completion_tokens=self.max_tokens,
                      stop=self.stop_sequences, temperature=self.temperature, top_p=self.top_p,
                      top_k=self.top_k, stream=self.stream)
        if self.stream:
            fields["stream_options"] = {"include_usage": True}
        return chat_request(fields, _RENAMES)


class CountTokensRequest(_Conversation):
    ROUTE = "messages_count_tokens"


# ---------------------------------------------------------------- request: blocks -> messages


def thinking_fields(thinking: dict[str, Any] | None, generating: bool) -> dict[str, Any]:
    """Anthropic's ``thinking`` as chat fields: the template's ``enable_thinking``
    (as Qwen3's templates read it; others ignore it) and, when ``enabled``, its
    ``budget_tokens`` as the thinking token budget (a server with a
    ``--reasoning-parser`` closes the thinking there). ``adaptive``: the model's own way."""
    if thinking is None:
        return {}
    kind = thinking.get("type")
    if kind == "adaptive":
        return {}
    if kind not in ("enabled", "disabled"):
        raise ValueError(f"thinking.type: must be enabled, disabled or adaptive, got {shown(kind)}")
    fields: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": kind == "enabled"}}
    if kind == "enabled" and generating:
        fields["thinking_token_budget"] = thinking.get("budget_tokens")
    return fields


def system_text(system: str | list[dict[str, Any]]) -> str:
    return system if isinstance(system, str) else block_texts(system, "system")


def block_texts(blocks: Any, where: str) -> str:
    """The text of a string or of a list of text blocks."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise ValueError(f"{where}: must be a string or a list of text blocks")
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise ValueError(f"{where}.{j}.type: only text blocks are supported here")
    return "".join(block.get("text") or "" for block in blocks)


def chat_messages(message: dict[str, Any], i: int) -> list[dict[str, Any]]:
    """The chat messages of one Anthropic message: a user's ``tool_result``
    blocks become ``tool`` messages before the rest of its text."""
    role, content = message.get("role"), message.get("content")
    if role not in ("user", "assistant"):
        raise ValueError(f"messages.{i}.role: must be user or assistant, got {shown(role)}")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise ValueError(f"messages.{i}.content: must be a string or a list of content blocks")
    turn: dict[str, Any] = {"role": role, "content": ""}
    results = []
    for j, block in enumerate(content):
        where = f"messages.{i}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            turn["content"] += block.get("text") or ""
        elif kind == "tool_use" and role == "assistant":
            turn.setdefault("tool_calls", []).append({
                "id": block.get("id"), "type": "function",
                "function": {"name": block.get("name"),
                             "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            results.append(tool_message(block, where))
        elif kind == "thinking" and role == "assistant":
            turn["reasoning_content"] = turn.get("reasoning_content", "") + (block.get("thinking") or "")
        else:
            raise ValueError(f"{where}.type: {shown(kind)} blocks are not supported in a {role} turn "
                             "(text, tool_use and thinking from the assistant, text and "
                             "tool_result from the user)")
    keep_turn = turn["content"] or turn.get("tool_calls") or turn.get("reasoning_content") or not results
    return results + ([turn] if keep_turn else [])


def tool_message(block: dict[str, Any], where: str) -> dict[str, Any]:
    text = block_texts(block.get("content") or "", f"{where}.content")
    if block.get("is_error"):
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text}


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Anthropic's client tools (name, description, input_schema) as chat's functions."""
    if tools is None:
        return None
    converted = []
    for i, tool in enumerate(tools):
        if tool.get("type", "custom") != "custom":
            raise ValueError(f"tools.{i}.type: {shown(tool.get('type'))} tools are not supported "
                             "(client tools with an input_schema are)")
        function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        converted.append({"type": "function", "function": function})
    return converted


def chat_tool_choice(choice: dict[str, Any] | None) -> str | dict[str, Any] | None:
    """auto, any (one call at least), tool (that one) and none, as chat's tool_choice."""
    if choice is None:
        return None
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    chosen = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if chosen is None:
        raise ValueError(f"tool_choice.type: must be auto, any, tool or none, got {shown(kind)}")
    return chosen


# ---------------------------------------------------------------- response: chat -> blocks


def stop_reason(finish_reason: str | None, matched: Any, stop_sequences: list[str] | None
                ) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat choice's finish."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(matched, str) and matched in (stop_sequences or ()):
        return "stop_sequence", matched
    return "end_turn", None


def message_usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    """Anthropic's usage: input_tokens counts the prompt tokens not read from the cache."""
    usage = usage or {"prompt_tokens": 0, "completion_tokens": 0}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"] - cached, "output_tokens": usage["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """thinking, text, then tool_use blocks. A call whose arguments are not a
    JSON object (cut by max_tokens) stays text, as the model wrote it."""
    blocks = []
    reasoning = message_reasoning(message)
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    text = message.get("content") or ""
    calls = []
    for call in message.get("tool_calls") or []:
        arguments = call["function"]["arguments"]
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError:
            value = None
        if isinstance(value, dict):
            calls.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                          "input": value})
        else:
            text += arguments
    if text or not (calls or blocks):
        blocks.append({"type": "text", "text": text})
    return blocks + calls


def whole_message(message_id: str, model: str, chat: dict[str, Any],
                  stop_sequences: list[str] | None) -> dict[str, Any]:
    choice = chat["choices"][0]
    reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_reason"), stop_sequences)
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": content_blocks(choice["message"]), "stop_reason": reason,
            "stop_sequence": sequence, "usage": message_usage(chat.get("usage"))}


class MessageEvents:
    """The chat stream's chunks as Anthropic's events:

        message_start, ping
        per block: content_block_start, content_block_delta (text_delta,
                   thinking_delta, input_json_delta)..., content_block_stop
        message_delta (stop_reason, stop_sequence, usage), message_stop

    The prompt's token count is known at the end only: message_start says 0,
    and message_delta's usage carries the totals (which the client keeps).
    """

    def __init__(self, message_id: str, model: str, stop_sequences: list[str] | None) -> None:
        self.message_id, self.model, self.stop_sequences = message_id, model, stop_sequences
        self.num_blocks = 0
        self.open: str | None = None  # the open block's type
        self.finish: tuple[str | None, Any] = (None, None)
        self.usage: dict[str, Any] | None = None

    @staticmethod
    def event(kind: str, **fields: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"

    def start(self) -> list[str]:
        message = {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": message_usage(None)}
        return [self.event("message_start", message=message), self.event("ping")]

    def take(self, chunk: dict[str, Any]) -> list[str]:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        events: list[str] = []
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            reasoning = message_reasoning(delta)
            if reasoning:
                events += self._delta("thinking", {"type": "thinking_delta", "thinking": reasoning})
            if delta.get("content"):
                events += self._delta("text", {"type": "text_delta", "text": delta["content"]})
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            if choice.get("finish_reason"):
                self.finish = (choice["finish_reason"], choice.get("stop_reason"))
        return events

    def end(self) -> list[str]:
        events = self._close()
        if not self.num_blocks:
            events += self._delta("text", None) + self._close()
        reason, sequence = stop_reason(*self.finish, self.stop_sequences)
        usage = message_usage(self.usage)
        return events + [self.event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                                    usage=usage),
                         self.event("message_stop")]

    @classmethod
    def error(cls, error: dict[str, Any]) -> list[str]:
        status = error.get("code") if isinstance(error.get("code"), int) else 500
        return [cls.event("error", error={"type": ERROR_TYPES.get(status, "api_error"),
                                          "message": error.get("message", "")})]

    def _delta(self, kind: str, delta: dict[str, Any] | None) -> list[str]:
        events = []
        if self.open != kind:
            events += self._close()
            block = {"type": "text", "text": ""} if kind == "text" else {
                "type": "thinking", "thinking": "", "signature": ""}
            events += self._start(kind, block)
        if delta is not None:
            events.append(self.event("content_block_delta", index=self.num_blocks - 1, delta=delta))
        return events

    def _call(self, call: dict[str, Any]) -> list[str]:
        events = []
        if call.get("id"):  # a new call
            events += self._close()
            events += self._start("tool_use", {"type": "tool_use", "id": call["id"],
                                               "name": call["function"]["name"], "input": {}})
        arguments = (call.get("function") or {}).get("arguments")
        if arguments and self.open == "tool_use":
            events.append(self.event("content_block_delta", index=self.num_blocks - 1,
                                     delta={"type": "input_json_delta", "partial_json": arguments}))
        return events

    def _start(self, kind: str, block: dict[str, Any]) -> list[str]:
        self.open = kind
        self.num_blocks += 1
        return [self.event("content_block_start", index=self.num_blocks - 1, content_block=block)]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [self.event("content_block_stop", index=self.num_blocks - 1)]


# ---------------------------------------------------------------- errors and routes


def anthropic_error(status: int, message: str) -> JSONResponse:
    body = {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}
    return JSONResponse(body, status_code=status)


def as_anthropic(response: JSONResponse) -> JSONResponse:
    """An OpenAI-shaped error response of errors.py in Anthropic's shape (same status and headers)."""
    error = json.loads(response.body)["error"]
    answer = anthropic_error(response.status_code, error["message"])
    if "retry-after" in response.headers:
        answer.headers["Retry-After"] = response.headers["retry-after"]
    return answer


def error_of(err: Exception) -> JSONResponse | None:
    """The answer errors.py gives an exception, in Anthropic's shape (None: not a request's error)."""
    if isinstance(err, ValidationError):
        return as_anthropic(validation_error_response(RequestValidationError(err.errors())))
    if isinstance(err, ValueError):
        return as_anthropic(error_response(400, str(err), field_of(str(err))))
    if isinstance(err, ModelNotFound):
        return as_anthropic(error_response(404, str(err), err.param))
    if isinstance(err, QueueFullError):
        response = error_response(429, str(err))
        if err.retry_after_s is not None:
            response.headers["Retry-After"] = str(max(1, round(err.retry_after_s)))
        return as_anthropic(response)
    if isinstance(err, EngineDeadError):
        return as_anthropic(error_response(503, f"the engine is not available: {err}"))
    if isinstance(err, GenerationFailed):
        return as_anthropic(error_response(500, f"generation failed: {err}"))
    if isinstance(err, ClientGone):
        return as_anthropic(error_response(499, "the client closed the connection"))
    return None


async def parsed(raw: Request, model: type[RequestBody]) -> Any:
    try:
        data = await raw.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"malformed JSON body: {err}") from None
    return model.model_validate(data)


def add_messages_routes(app: FastAPI, serving: OpenAIServing, resolve: Callable[[str | None], Any]
                        ) -> None:
    """POST /v1/messages and /v1/messages/count_tokens; ``resolve``: the model
    field -> its LoRA request (404 if unknown). Each reads its body itself, so
    that a malformed one too is answered in Anthropic's shape; the schema
    still documents it."""

    def body_schema(model: type[RequestBody]) -> dict[str, Any]:
        return {"requestBody": {"required": True, "content": {
            "application/json": {"schema": model.model_json_schema()}}}}

    @app.post("/v1/messages", openapi_extra=body_schema(MessagesRequest))
    async def messages(raw: Request):
        try:
            return await create_message(serving, resolve, await parsed(raw, MessagesRequest), raw)
        except Exception as err:
            answer = error_of(err)
            if answer is None:
                raise
            return answer

    @app.post("/v1/messages/count_tokens", openapi_extra=body_schema(CountTokensRequest))
    async def count_tokens(raw: Request):
        try:
            body = await parsed(raw, CountTokensRequest)
            resolve(body.model)
            return JSONResponse({"input_tokens": await count_prompt_tokens(serving, body)})
        except Exception as err:
            answer = error_of(err)
            if answer is None:
                raise
            return answer


async def create_message(serving: OpenAIServing, resolve: Callable[[str | None], Any],
                         body: MessagesRequest, raw: Request):
    lora_request = resolve(body.model)
    chat = body.to_chat()
    message_id, model = new_id("msg"), served_name(serving, lora_request)
    if not body.stream:
        result = await chat_json(serving, chat, raw, lora_request, _RENAMES)
        return JSONResponse(whole_message(message_id, model, result, body.stop_sequences))
    response = await open_chat_stream(serving, chat, raw, lora_request, _RENAMES)
    events = MessageEvents(message_id, model, body.stop_sequences)
    return translated_stream(translated_events(events, chat_chunks(response)), response)


async def count_prompt_tokens(serving: OpenAIServing, body: CountTokensRequest) -> int:
    """The prompt's tokens as generation would render it: the chat template,
    with the tools (in the template, or in the system message where it has none)."""
    chat = chat_request(body.chat_fields(generating=False), _RENAMES)
    functions, tool_choice = chat.tool_setup()
    tokenizer = serving.llm.tokenizer
    assert tokenizer is not None
    # As OpenAIServing.chat renders it: the server's --chat-template, else the model's.
    conversation, template_tools = prepare_conversation(
        chat.conversation(), functions if tool_choice != "none" else [],
        serving.chat_template or tokenizer.chat_template)
    _, token_ids = await asyncio.to_thread(render_chat, tokenizer, conversation, True, template_tools,
                                           chat.chat_template_kwargs, serving.chat_template)
    return len(token_ids)
