"""OpenAI request bodies (pydantic) and their mapping to ``SamplingParams``.

Pydantic checks types; ``SamplingParams`` checks values and raises
``ValueError("field: ...")``, which the server answers with HTTP 400 and
``"param": field``. Which fields a body may carry is one rule, in
``fields.py``: the fields of these models are honoured (vLLM's extensions
``top_k``, ``min_p``, ``ignore_eos``, ``cache_salt``, ... among them); a
field of OpenAI's or vLLM's schema that cadence does not honour
(``logit_bias``, beam search, ...) is refused with a 400 when its value asks
for something; any other field is ignored and logged once. Structured
outputs come from ``constraints.py``, tool calls from ``tool_calls.py``.

Values no encoder downstream can take are refused here too, naming the
field: a lone surrogate (JSON may escape one, ``"\\ud800"``; the tokenizer,
msgpack and the response's UTF-8 all fail on it), a message without content,
and ``chat_template_kwargs`` that would collide with the template's own
arguments.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cadence.sampling_params import SamplingParams, StructuredOutputParams
from cadence.server.constraints import requested_constraint
from cadence.server.errors import quoted
from cadence.server.fields import check_fields
from cadence.server.tool_calls import check_tools, forced_call_constraint

MAX_LOGPROBS = 20
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
# Names the chat template's renderer sets itself (the parameters of
# Tokenizer.apply_chat_template and render_chat_template, and the globals
# templates call): a chat_template_kwargs key among them would collide.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "self", "template", "messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
    "raise_exception", "strftime_now", "range", "dict", "lipsum", "cycler", "joiner", "namespace",
})


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's name, schema, description, strict."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of these."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: Union[str, dict[str, Any], None] = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


def refuse_lone_surrogates(data: Any) -> None:
    """Raise ``ValueError("messages.0.content: ...")`` for the first string in the
    body that holds a lone surrogate. Iterative: the body may nest deeply."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if _LONE_SURROGATE.search(value):
                raise ValueError(f"{path or 'body'}: contains a lone surrogate (such as \\ud800), "
                                 "which is not valid Unicode")
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str) and _LONE_SURROGATE.search(key):
                    raise ValueError(f"{path or 'body'}: a key contains a lone surrogate, "
                                     "which is not valid Unicode")
                stack.append((f"{path}.{key}" if path else str(key), item))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}", item) for i, item in enumerate(value))


class RequestBody(BaseModel):
    """A route's body: its fields are the honoured ones of ``fields.py``'s rule,
    which refuses what OpenAI or vLLM define and cadence does not honour."""

    model_config = ConfigDict(extra="ignore")  # unknown fields: logged once by the rule
    ROUTE: ClassVar[str]

    @model_validator(mode="before")
    @classmethod
    def _apply_the_field_rule(cls, data: Any) -> Any:
        check_fields(cls.ROUTE, data, cls.model_fields)
        return data


class _Sampling(RequestBody):
    """Fields both endpoints share."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_lone_surrogates(cls, data: Any) -> Any:
        refuse_lone_surrogates(data)
        return data

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    # Latency targets for --policy slo (seconds); None: the server's defaults.
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    # Structured outputs (constraints.py): OpenAI's field, vLLM's, vLLM's older ones.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: Union[str, dict[str, Any], None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's, for a KV connector (prefill/decode disaggregation); refused by a
    # server whose engine has no connector that reads it.
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's: cached prefix blocks are shared only between equal salts.
    cache_salt: str | None = None

    def constraint(self) -> tuple[str, StructuredOutputParams] | None:
        """(the field it came from, the output constraint) of this request, if any."""
        return requested_constraint(self)

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         structured: StructuredOutputParams | None = None) -> SamplingParams:
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs: must be in [0, {MAX_LOGPROBS}], got {logprobs}")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream=true")
        values: dict[str, Any] = dict(
            n=self.n, seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=self.stop or (), stop_token_ids=self.stop_token_ids or (),
            ignore_eos=self.ignore_eos, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=structured, cache_salt=self.cache_salt,
        )
        optional = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                        min_p=self.min_p, presence_penalty=self.presence_penalty,
                        frequency_penalty=self.frequency_penalty,
                        repetition_penalty=self.repetition_penalty)
        values.update({name: value for name, value in optional.items() if value is not None})
        return SamplingParams(**values)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


Prompt = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_Sampling):
    ROUTE = "completions"
    prompt: Prompt
    max_tokens: int | None = 16
    logprobs: int | None = None
    best_of: int | None = None
    # The prompt before the completion, in the text and (with logprobs) in the logprobs.
    echo: bool = False
    # vLLM's: the top prompt_logprobs of every prompt position, in each choice.
    prompt_logprobs: int | None = None

    def to_sampling_params(self) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: not supported (use n)")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs: must be in [0, {MAX_LOGPROBS}], "
                             f"got {self.prompt_logprobs}")
        constraint = self.constraint()
        # echo with max_tokens 0 scores the prompt only (as vLLM): one token is
        # generated, for the engine's sake, and not shown.
        max_tokens = 1 if self.echo_only else self.max_tokens
        params = self._sampling_params(max_tokens, self.logprobs,
                                       constraint[1] if constraint else None)
        return params.replace(prompt_logprobs=self.num_prompt_logprobs)

    @property
    def echo_only(self) -> bool:
        """The prompt echoed and nothing generated (``echo`` with ``max_tokens`` 0)."""
        return self.echo and self.max_tokens == 0

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Top logprobs per prompt position the engine computes: what
        ``prompt_logprobs`` asks, and ``logprobs`` too when the prompt is echoed
        (as vLLM); None: none."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None)
                  if k is not None]
        return max(wanted) if wanted else None

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the batch: strings or token-id lists."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ValueError("prompt: must not be empty")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # one prompt of token ids
        return list(prompt)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: Union[str, dict[str, Any]] = "{}"  # OpenAI sends JSON text


class ToolCallMessage(BaseModel):
    """A call an earlier assistant turn made (shown to the model again)."""

    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # fields a template may read
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: str | None = None
    # An earlier turn's thinking, under vLLM's new name or its old one; the
    # templates read reasoning_content (and may strip it from earlier turns).
    reasoning: str | None = None
    reasoning_content: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if self.reasoning is not None and self.reasoning_content is None:
            message["reasoning_content"] = self.reasoning
        if self.content is None:  # an assistant turn may have none; templates expect a string
            message["content"] = ""
        elif isinstance(self.content, list):
            for part in self.content:
                if part.type != "text":
                    raise ValueError(f"messages: content parts of type {quoted(repr(part.type))} "
                                     "are not supported")
            message["content"] = "".join(part.text or "" for part in self.content)
        return message


def check_contents(messages: list[ChatMessage]) -> None:
    """Only an assistant turn may come without content (OpenAI's rule too)."""
    for i, message in enumerate(messages):
        if message.content is None and message.role != "assistant":
            raise ValueError(f"messages.{i}.content: required for a {message.role} message")


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs or {}))
    if reserved:
        raise ValueError(f"chat_template_kwargs: {', '.join(reserved)} cannot be set here: the "
                         "server passes them to the template itself (use the request's own fields)")


class ChatCompletionRequest(_Sampling):
    ROUTE = "chat"
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # Reasoning (reasoning.py, with --reasoning-parser): false leaves the thinking
    # out of the answer (it is still split from the content).
    include_reasoning: bool = True
    # vLLM's: thinking tokens before the engine closes the thinking (None: the
    # server's --thinking-token-budget).
    thinking_token_budget: int | None = None

    @model_validator(mode="after")
    def _check_conversation(self) -> "ChatCompletionRequest":
        check_contents(self.messages)
        check_template_kwargs(self.chat_template_kwargs)
        return self

    def tool_setup(self) -> tuple[list[dict[str, Any]], Any]:
        """(the function definitions, the effective tool_choice); see tool_calls.py."""
        return check_tools(self.tools, self.tool_choice)

    def constraint(self) -> tuple[str, StructuredOutputParams] | None:
        """The output constraint: a forced tool call's, or one of the structured-output fields'."""
        requested = requested_constraint(self)
        functions, tool_choice = self.tool_setup()
        forced = forced_call_constraint(functions, tool_choice, self.parallel_tool_calls)
        if forced is None:
            return requested
        if requested is not None:
            raise ValueError(f"{requested[0]}: cannot constrain the output while tool_choice "
                             "forces a tool call")
        return "tool_choice", forced

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        constraint = self.constraint()
        try:
            return self._sampling_params(max_tokens, logprobs, constraint[1] if constraint else None)
        except ValueError as err:
            message = str(err)
            if message.startswith("logprobs:") and self.logprobs:
                message = "top_logprobs:" + message[len("logprobs:"):]
            elif message.startswith("max_tokens:") and self.max_completion_tokens is not None:
                message = "max_completion_tokens:" + message[len("max_tokens:"):]
            raise ValueError(message) from None

    def conversation(self) -> list[dict[str, Any]]:
        return [message.as_template_input() for message in self.messages]


class TokenizeRequest(RequestBody):
    """POST /tokenize: a prompt, or messages rendered by the chat template (vLLM's
    two bodies in one)."""

    ROUTE = "tokenize"
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # the prompt's; the chat template adds its own
    add_generation_prompt: bool = True

    @model_validator(mode="before")
    @classmethod
    def _refuse_lone_surrogates(cls, data: Any) -> Any:
        refuse_lone_surrogates(data)
        return data

    @model_validator(mode="after")
    def _check_conversation(self) -> "TokenizeRequest":
        if self.messages is not None:
            check_contents(self.messages)
            if self.add_special_tokens and "add_special_tokens" in self.model_fields_set:
                raise ValueError("add_special_tokens: with messages, the chat template adds the "
                                 "special tokens (only false is honoured)")
        return self


class DetokenizeRequest(RequestBody):
    ROUTE = "detokenize"
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(RequestBody):
    """POST /v1/load_lora_adapter (with --allow-runtime-lora-updating), as vLLM's."""

    ROUTE = "load_lora_adapter"
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(RequestBody):
    """POST /v1/unload_lora_adapter: the adapter is found by its name; vLLM's
    ``lora_int_id`` is accepted and not needed."""

    ROUTE = "unload_lora_adapter"
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None
