"""/v1/completions and /v1/chat/completions: prompts in, streams or bodies out.

A request becomes one engine request per prompt (``n`` completions each);
validation happens before anything is sent, so a bad request costs the engine
nothing. A request that could never be served (``n`` above ``max_n``, more
tokens than the context holds, more sequences than the server ever admits)
is refused with a 400; only one that would fit later gets a 429. Chat
templates and tokenization run in a worker thread: a prompt of megabytes
must not stall the event loop, and with it every other client and /health.
Streams send one SSE chunk per choice per update; a client that goes away
closes its streams, which aborts the engine requests and frees their KV
blocks.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator, Callable

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from cadence.core.request import LoRARequest
from cadence.engine.async_llm import AsyncLLM, EngineDeadError, RequestFailed, RequestStream
from cadence.engine.inputs import prompt_token_ids
from cadence.engine.outputs import RequestOutput
from cadence.models.chat_template import render_chat_template
from cadence.models.tokenizer import Tokenizer
from cadence.sampling_params import SamplingParams
from cadence.server.constraints import rename_field
from cadence.server.echo import PromptEcho
from cadence.server.errors import ClientGone, GenerationFailed, error_body
from cadence.server.formatting import SSE_DONE, ChatLogprobs, CompletionLogprobs, TextDelta, sse, usage
from cadence.server.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from cadence.server.reasoning import (
    ReasoningFormat, ReasoningSplitter, count_reasoning_tokens, reasoning_format, split_reasoning,
    thinking_tokens,
)
from cadence.server.tool_calls import (
    AUTO_TOOL_PARSERS, ToolCallDeltas, ToolParser, parse_all, parser_for, prepare_conversation,
    tool_calls_finish,
)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class OpenAIServing:
    """The two generation endpoints over one ``AsyncLLM``."""

    def __init__(self, llm: AsyncLLM, model_name: str, max_n: int = 16,
                 tool_call_parser: str = "hermes", reasoning_parser: str | None = None,
                 thinking_token_budget: int | None = None, chat_template: str | None = None) -> None:
        """``reasoning_parser``: the thinking format (reasoning.py), None: none;
        ``thinking_token_budget``: the default of a chat request's own;
        ``chat_template``: a Jinja template in place of the model's."""
        if max_n < 1:
            raise ValueError(f"max_n: must be >= 1, got {max_n}")
        if tool_call_parser not in AUTO_TOOL_PARSERS:
            raise ValueError(f"tool_call_parser: must be one of {', '.join(AUTO_TOOL_PARSERS)}, "
                             f"got {tool_call_parser!r}")
        self.llm = llm
        self.model_name = model_name
        self.max_n = max_n
        self.tool_call_parser = tool_call_parser
        self.reasoning = reasoning_format(reasoning_parser)
        if thinking_token_budget is not None and self.reasoning is None:
            raise ValueError("thinking_token_budget: needs a --reasoning-parser (which tags to close)")
        self.thinking_token_budget = thinking_token_budget
        self.chat_template = chat_template

    # ------------------------------------------------------------ completions

    async def completions(self, body: CompletionRequest, raw: Request,
                          lora_request: LoRARequest | None = None):
        """``lora_request``: the adapter the request's model field named (None: the base)."""
        self._check_n(body.n)
        params = body.to_sampling_params()
        request_id = f"cmpl-{uuid.uuid4().hex}"
        prompts = await asyncio.to_thread(self._completion_prompts, body)
        await asyncio.to_thread(self._check_constraint, params, body.constraint())
        for _, token_ids in prompts:
            check_fits_context(len(token_ids), params, self._max_model_len)
        self.llm.check_can_ever_admit(params.n * len(prompts))
        streams = self._submit(request_id, prompts, params, body, lora_request)
        created = int(time.time())
        model = self._served_name(lora_request)
        if body.stream:
            await self._wait_accepted(streams)
            chunks = self._completion_chunks(request_id, created, streams, params.n,
                                             body.include_usage, model, self._prompt_echo(body))
            return event_stream(chunks, streams)
        finals = await collect(streams, raw)
        echo = self._prompt_echo(body)
        choices = []
        for i, final in enumerate(finals):
            for c in final.outputs:
                logprobs = echo.completion_logprobs(final).take(c)
                choices.append({
                    "index": i * params.n + c.index, **echo.first_choice(final, c.text, logprobs),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                })
        return JSONResponse({
            "id": request_id, "object": "text_completion", "created": created,
            "model": model, "choices": choices, "usage": echo.usage(usage(finals)),
            **kv_transfer_answer(finals),
        })

    def _completion_prompts(self, body: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        """(text, token ids) of each prompt; runs in a worker thread."""
        return [self._completion_prompt(p) for p in body.prompts()]

    def _completion_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        assert self.llm.tokenizer is not None
        if isinstance(prompt, str):
            return prompt_token_ids(prompt, self.llm.tokenizer)
        try:
            return prompt_token_ids({"prompt_token_ids": prompt}, self.llm.tokenizer)
        except ValueError as err:  # the API's field is "prompt"
            raise ValueError("prompt:" + str(err).split(":", 1)[1]) from None

    def _prompt_echo(self, body: CompletionRequest) -> PromptEcho:
        assert self.llm.tokenizer is not None
        return PromptEcho(self.llm.tokenizer, body.echo, body.logprobs, body.prompt_logprobs,
                          body.echo_only)

    async def _completion_chunks(self, request_id: str, created: int, streams: list[RequestStream],
                                 n: int, include_usage: bool, model: str,
                                 echo: PromptEcho) -> AsyncIterator[str]:
        deltas: dict[tuple[int, int], TextDelta] = {}
        logprobs: dict[tuple[int, int], CompletionLogprobs] = {}
        finals: dict[int, RequestOutput] = {}
        head = {"id": request_id, "object": "text_completion", "created": created,
                "model": model}
        extra = {"usage": None} if include_usage else {}
        async for i, output in merge(streams):
            raise_if_failed(output)
            finals[i] = output
            for c in output.outputs:
                delta = deltas.setdefault((i, c.index), TextDelta())
                if delta.finished:
                    continue
                text = delta.take(c)
                first = (i, c.index) not in logprobs
                if first:
                    logprobs[(i, c.index)] = echo.completion_logprobs(output)
                lp = logprobs[(i, c.index)].take(c)
                if not text and not c.finished and not (lp and lp["tokens"]):
                    if first:
                        del logprobs[(i, c.index)]  # the prompt goes out with the first chunk
                    continue
                delta.finished = c.finished
                shown = echo.first_choice(output, text, lp) if first else {"text": text, "logprobs": lp}
                choice = {"index": i * n + c.index, **shown,
                          "finish_reason": c.finish_reason,
                          "stop_reason": c.stop_reason if c.finished else None}
                yield sse({**head, "choices": [choice], **extra})
        if include_usage:
            yield sse({**head, "choices": [], "usage": echo.usage(usage(list(finals.values())))})
        yield SSE_DONE

    # ------------------------------------------------------------ chat

    async def chat(self, body: ChatCompletionRequest, raw: Request,
                   lora_request: LoRARequest | None = None):
        self._check_n(body.n)
        params = body.to_sampling_params()
        functions, tool_choice = body.tool_setup()
        tokenizer = self.llm.tokenizer
        assert tokenizer is not None
        template = self.chat_template or tokenizer.chat_template
        conversation, template_tools = prepare_conversation(
            body.conversation(), functions if tool_choice != "none" else [], template)
        text, token_ids = await asyncio.to_thread(
            render_chat, tokenizer, conversation, body.add_generation_prompt, template_tools,
            body.chat_template_kwargs, self.chat_template)
        params, thinking = self._with_thinking_budget(params, body, text)
        await asyncio.to_thread(self._check_constraint, params, body.constraint())
        tokens_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        check_fits_context(len(token_ids), params, self._max_model_len, "messages", tokens_field)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            streams = self._submit(request_id, [(text, token_ids)], params, body, lora_request)
        except ValueError as err:
            message = str(err)
            if message.startswith("prompt:"):  # the conversation is the prompt here
                message = "messages:" + message[len("prompt:"):]
            raise ValueError(message) from None
        created = int(time.time())
        model = self._served_name(lora_request)
        num_top = body.top_logprobs or 0
        new_parser = lambda: parser_for(tool_choice, self.tool_call_parser)  # noqa: E731
        thoughts = Thoughts(self.reasoning, thinking, body.include_reasoning, tokenizer)
        if body.stream:
            await self._wait_accepted(streams)
            chunks = self._chat_chunks(request_id, created, streams[0], params.n, num_top,
                                       body.include_usage, new_parser, model, thoughts)
            return event_stream(chunks, streams)
        final = (await collect(streams, raw))[0]
        choices = []
        for c in final.outputs:
            reasoning, content = thoughts.split(c.text)
            message: dict[str, Any] = {"role": "assistant", "content": content,
                                       **thoughts.fields(reasoning)}
            finish_reason = c.finish_reason
            parser = new_parser()
            if parser is not None:
                message["content"], calls = parse_all(parser, content)
                if calls:
                    message["tool_calls"] = [call.to_openai() for call in calls]
                    finish_reason = tool_calls_finish(finish_reason)
            choices.append({
                "index": c.index, "message": message,
                "logprobs": ChatLogprobs(tokenizer, num_top).take(c),
                "finish_reason": finish_reason, "stop_reason": c.stop_reason,
            })
        return JSONResponse({
            "id": request_id, "object": "chat.completion", "created": created,
            "model": model, "choices": choices, "usage": thoughts.usage(final),
            **kv_transfer_answer([final]),
        })

    def _with_thinking_budget(self, params: SamplingParams, body: ChatCompletionRequest,
                              prompt: str) -> tuple[SamplingParams, Any]:
        """The request's budget (or the server's) with the tags' token ids,
        and those ids (None without a reasoning parser)."""
        if self.reasoning is None:
            if body.thinking_token_budget is not None:
                raise ValueError("thinking_token_budget: this server has no --reasoning-parser")
            return params, None
        assert self.llm.tokenizer is not None
        thinking = thinking_tokens(self.reasoning, self.llm.tokenizer, prompt)
        budget = body.thinking_token_budget
        if budget is None:
            budget = self.thinking_token_budget
        if budget is None:
            return params, thinking
        return params.replace(thinking_token_budget=budget, thinking=thinking), thinking

    async def _chat_chunks(self, request_id: str, created: int, stream: RequestStream, n: int,
                           num_top: int, include_usage: bool,
                           new_parser: Callable[[], ToolParser | None],
                           model: str, thoughts: "Thoughts") -> AsyncIterator[str]:
        assert self.llm.tokenizer is not None
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": model}
        extra = {"usage": None} if include_usage else {}
        deltas = [TextDelta() for _ in range(n)]
        logprobs = [ChatLogprobs(self.llm.tokenizer, num_top) for _ in range(n)]
        tool_streams = [ToolCallDeltas(new_parser()) for _ in range(n)]
        splitters = [thoughts.splitter() for _ in range(n)]
        final = None
        for index in range(n):
            role = {"index": index, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None}
            yield sse({**head, "choices": [role], **extra})
        async for output in stream:
            raise_if_failed(output)
            final = output
            for c in output.outputs:
                delta = deltas[c.index]
                if delta.finished:
                    continue
                reasoning, content = thoughts.feed(splitters[c.index], delta.take(c), c.finished)
                message = {**thoughts.fields(reasoning, delta=True),
                           **tool_streams[c.index].take(content, c.finished)}
                lp = logprobs[c.index].take(c)
                if not message and not c.finished and not (lp and lp["content"]):
                    continue
                delta.finished = c.finished
                finish_reason = c.finish_reason
                if c.finished and tool_streams[c.index].num_calls:
                    finish_reason = tool_calls_finish(finish_reason)
                choice = {"index": c.index, "delta": message, "logprobs": lp,
                          "finish_reason": finish_reason}
                if c.finished:
                    choice["stop_reason"] = c.stop_reason
                yield sse({**head, "choices": [choice], **extra})
        if include_usage and final is not None:
            yield sse({**head, "choices": [], "usage": thoughts.usage(final)})
        yield SSE_DONE

    # ------------------------------------------------------------ tokenize

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """/tokenize: the token ids of a prompt, or of a conversation as the chat
        template renders it (in a worker thread, as for generation)."""
        tokenizer = self.llm.tokenizer
        assert tokenizer is not None
        if (body.prompt is None) == (body.messages is None):
            raise ValueError("prompt: give exactly one of prompt and messages")
        if body.messages is not None:
            conversation = [m.as_template_input() for m in body.messages]
            _, tokens = await asyncio.to_thread(render_chat, tokenizer, conversation,
                                                body.add_generation_prompt, None, None,
                                                self.chat_template)
        else:
            tokens = await asyncio.to_thread(tokenizer.encode, body.prompt or "",
                                             add_special_tokens=body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": self._max_model_len, "tokens": tokens}

    # ------------------------------------------------------------ shared

    @property
    def _max_model_len(self) -> int:
        assert self.llm.info is not None
        return self.llm.info.max_model_len

    async def _wait_accepted(self, streams: list[RequestStream]) -> None:
        """Where the engine may refuse a request under load (``--slo-reject``), a
        stream waits for its first output before the 200 goes out, so that a
        refusal is a 429 with Retry-After, as for a whole response, rather than an
        error event inside a stream already begun. It costs nothing: the first
        chunk could not have carried a token sooner."""
        if not self.llm.refuses_under_load:
            return
        try:
            for stream in streams:
                await stream.wait_accepted()
        except BaseException:
            close_all(streams)
            raise

    def _check_constraint(self, params: SamplingParams, constraint) -> None:
        """The grammar compiles, or a 400 naming the request's field; runs in a
        worker thread (a large schema takes a while), so ``add_request``'s own
        check finds it cached."""
        try:
            self.llm.check_structured_outputs(params)
        except ValueError as err:
            raise ValueError(rename_field(str(err), constraint[0]) if constraint else str(err)) from None

    def _check_n(self, n: int) -> None:
        # Each of n samples is a whole generation: n is bounded like any other cost.
        if n > self.max_n:
            raise ValueError(f"n: must be <= {self.max_n} (this server's --max-n), got {n}")

    def _served_name(self, lora_request: LoRARequest | None) -> str:
        """The model a response names: the adapter's name, as the request gave it, or the base."""
        return lora_request.lora_name if lora_request is not None else self.model_name

    def _submit(self, request_id: str, prompts: list[tuple[str | None, list[int]]], params,
                body, lora_request: LoRARequest | None = None) -> list[RequestStream]:
        """One engine request per prompt; on any refusal, nothing stays submitted."""
        streams: list[RequestStream] = []
        if body.kv_transfer_params is not None and len(prompts) > 1:
            raise ValueError("kv_transfer_params: only for a request of one prompt")
        try:
            for i, (text, token_ids) in enumerate(prompts):
                sub_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(self.llm.add_request(sub_id, token_ids, params, prompt=text,
                                                    priority=body.priority, user=body.user,
                                                    slo_ttft_s=body.slo_ttft_s,
                                                    slo_tpot_s=body.slo_tpot_s,
                                                    lora_request=lora_request,
                                                    kv_transfer_params=body.kv_transfer_params))
        except BaseException:
            for stream in streams:
                stream.close()
            raise
        return streams


class Thoughts:
    """A chat request's reasoning: the split of each choice's text, the
    message fields (``reasoning`` and vLLM's older ``reasoning_content``), and
    the reasoning tokens in the usage. Without a parser: all content."""

    def __init__(self, fmt: ReasoningFormat | None, thinking: Any, include: bool,
                 tokenizer: Tokenizer) -> None:
        self.fmt = fmt
        self.thinking = thinking  # ThinkingTokens, with whether the prompt opened the thinking
        self.include = include
        self.tokenizer = tokenizer

    def split(self, text: str) -> tuple[str | None, str]:
        if self.fmt is None:
            return None, text
        reasoning, content = split_reasoning(self.fmt, self.thinking.starts_inside, text)
        return reasoning, content or ""

    def splitter(self) -> ReasoningSplitter | None:
        return None if self.fmt is None else ReasoningSplitter(self.fmt, self.thinking.starts_inside)

    @staticmethod
    def feed(splitter: ReasoningSplitter | None, text: str, final: bool) -> tuple[str, str]:
        return ("", text) if splitter is None else splitter.feed(text, final)

    def fields(self, reasoning: str | None, delta: bool = False) -> dict[str, Any]:
        """The message's reasoning fields; a stream's delta has them only when it has some."""
        if self.fmt is None or not self.include or (delta and not reasoning):
            return {}
        return {"reasoning": reasoning, "reasoning_content": reasoning}

    def usage(self, final: RequestOutput) -> dict[str, Any]:
        result = usage([final])
        if self.fmt is not None:
            num = sum(count_reasoning_tokens(c.token_ids, self.thinking, self.split(c.text)[0],
                                             self.tokenizer) for c in final.outputs)
            result["completion_tokens_details"] = {"reasoning_tokens": num}
        return result


def kv_transfer_answer(finals: list[RequestOutput]) -> dict[str, Any]:
    """The KV connector's answer (vLLM's ``kv_transfer_params`` field), if it gave one."""
    params = finals[0].kv_transfer_params if len(finals) == 1 else None
    return {"kv_transfer_params": params} if params is not None else {}


def render_chat(tokenizer: Tokenizer, conversation: list[dict[str, Any]], add_generation_prompt: bool,
                tools: list[dict[str, Any]] | None = None,
                template_kwargs: dict[str, Any] | None = None,
                template: str | None = None) -> tuple[str, list[int]]:
    """(prompt text, token ids) of a conversation; runs in a worker thread.

    The template is the model's and renders every well-formed conversation, so
    a failure is the request's (an odd message, a chat_template_kwargs value
    the template cannot use): a 400 naming messages, never a 500.
    """
    try:
        if template is None:  # the model's own
            text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                 tools=tools, **(template_kwargs or {}))
        else:
            text = render_chat_template(template, conversation, add_generation_prompt=add_generation_prompt,
                                        tools=tools, bos_token=tokenizer.bos_token,
                                        eos_token=tokenizer.eos_token, **(template_kwargs or {}))
    except ValueError as err:  # the template's raise_exception (roles out of order, ...)
        raise ValueError(f"messages: {err}") from None
    except (jinja2.TemplateError, TypeError) as err:  # e.g. a kwarg of a type it cannot use
        extra = " with these chat_template_kwargs" if template_kwargs else ""
        raise ValueError(f"messages: the model's chat template cannot render this conversation"
                         f"{extra} ({type(err).__name__}: {err})") from None
    return text, tokenizer.encode(text, add_special_tokens=False)


def check_fits_context(num_prompt_tokens: int, params: SamplingParams, max_model_len: int,
                       prompt_field: str = "prompt", tokens_field: str = "max_tokens") -> None:
    """Refuse an output the context cannot hold, saying how much room there is
    (vLLM's message); the engine would otherwise cut it short without a word."""
    if num_prompt_tokens >= max_model_len:
        return  # no room at all: make_request refuses the prompt itself
    room = max_model_len - num_prompt_tokens
    if params.max_tokens is not None and params.max_tokens > room:
        raise ValueError(
            f"{tokens_field}: This model's maximum context length is {max_model_len} tokens. "
            f"However, you requested {num_prompt_tokens + params.max_tokens} tokens "
            f"({num_prompt_tokens} in the {prompt_field}, {params.max_tokens} in the completion). "
            f"Please reduce the length of the {prompt_field} or completion: at most {room} "
            "completion tokens fit.")
    if params.min_tokens > room:
        raise ValueError(f"min_tokens: {params.min_tokens} tokens cannot follow a "
                         f"{num_prompt_tokens}-token {prompt_field} in the model's context of "
                         f"{max_model_len} tokens; at most {room} fit")


def event_stream(chunks: AsyncIterator[str], streams: list[RequestStream]) -> StreamingResponse:
    """An SSE response; an engine failure mid-stream becomes an error event (the
    ``openai`` client raises it), and however the stream ends, its requests close:
    a client that disconnects cancels the iteration, which aborts them. The
    background close covers a client gone before the first chunk (the
    iteration never starts, so its ``finally`` never runs)."""

    async def guarded() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        except (EngineDeadError, GenerationFailed, RequestFailed) as err:
            yield sse(error_body(500, f"generation failed: {err}"))
            yield SSE_DONE  # as vLLM: the error event, then the stream's usual end
        except ValueError as err:
            yield sse(error_body(400, str(err)))
            yield SSE_DONE
        finally:
            for stream in streams:
                stream.close()

    return StreamingResponse(guarded(), media_type="text/event-stream", headers=SSE_HEADERS,
                             background=BackgroundTask(close_all, streams))


def close_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.close()


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((i, output))
            queue.put_nowait((i, None))
        except Exception as err:
            queue.put_nowait((i, err))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def collect(streams: list[RequestStream], raw: Request) -> list[RequestOutput]:
    """The final output of every stream; aborts them all if the client disconnects."""
    finals: list[RequestOutput | None] = [None] * len(streams)

    async def consume() -> None:
        async for i, output in merge(streams):
            raise_if_failed(output)
            finals[i] = output

    consumer = asyncio.create_task(consume())
    watcher = asyncio.create_task(wait_for_disconnect(raw.receive))
    try:
        done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if consumer not in done:
            raise ClientGone()
        try:
            consumer.result()
        except EngineDeadError as err:
            raise GenerationFailed(str(err)) from err
        return [f for f in finals if f is not None]
    finally:
        consumer.cancel()
        watcher.cancel()
        for stream in streams:
            stream.close()


def raise_if_failed(output: RequestOutput) -> None:
    """GenerationFailed (a 500 naming the cause) for a sequence that the engine
    ended with a reason, e.g. a grammar the library failed on in the engine:
    "abort" is not a finish reason of OpenAI's, and the output breaks its
    constraint. (A request that a client aborts carries no reason.)"""
    for c in output.outputs:
        if c.finish_reason == "abort" and isinstance(c.stop_reason, str) and c.stop_reason:
            raise GenerationFailed(c.stop_reason[:500])


async def wait_for_disconnect(receive: Callable[[], Any]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
