"""/v1/completions and /v1/chat/completions: prompts in, streams or bodies out.

A request becomes one engine request per prompt (``n`` completions each);
validation happens before anything is sent, so a bad request costs the engine
nothing. Streams send one SSE chunk per choice per update; a client that
goes away closes its streams, which aborts the engine requests and frees
their KV blocks.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from cadence.engine.async_llm import AsyncLLM, EngineDeadError, RequestStream
from cadence.engine.inputs import prompt_token_ids
from cadence.engine.outputs import RequestOutput
from cadence.server.errors import ClientGone, GenerationFailed, error_body
from cadence.server.formatting import SSE_DONE, ChatLogprobs, CompletionLogprobs, TextDelta, sse, usage
from cadence.server.protocol import ChatCompletionRequest, CompletionRequest

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class OpenAIServing:
    """The two generation endpoints over one ``AsyncLLM``."""

    def __init__(self, llm: AsyncLLM, model_name: str) -> None:
        self.llm = llm
        self.model_name = model_name

    # ------------------------------------------------------------ completions

    async def completions(self, body: CompletionRequest, raw: Request):
        params = body.to_sampling_params()
        request_id = f"cmpl-{uuid.uuid4().hex}"
        prompts = [self._completion_prompt(p) for p in body.prompts()]
        streams = self._submit(request_id, prompts, params, body.priority)
        created = int(time.time())
        if body.stream:
            chunks = self._completion_chunks(request_id, created, streams, params.n,
                                             body.include_usage)
            return event_stream(chunks, streams)
        finals = await collect(streams, raw)
        choices = []
        for i, final in enumerate(finals):
            for c in final.outputs:
                choices.append({
                    "index": i * params.n + c.index, "text": c.text,
                    "logprobs": CompletionLogprobs().take(c), "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                })
        return JSONResponse({
            "id": request_id, "object": "text_completion", "created": created,
            "model": self.model_name, "choices": choices, "usage": usage(finals),
        })

    def _completion_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        assert self.llm.tokenizer is not None
        if isinstance(prompt, str):
            return prompt_token_ids(prompt, self.llm.tokenizer)
        try:
            return prompt_token_ids({"prompt_token_ids": prompt}, self.llm.tokenizer)
        except ValueError as err:  # the API's field is "prompt"
            raise ValueError("prompt:" + str(err).split(":", 1)[1]) from None

    async def _completion_chunks(self, request_id: str, created: int, streams: list[RequestStream],
                                 n: int, include_usage: bool) -> AsyncIterator[str]:
        deltas: dict[tuple[int, int], TextDelta] = {}
        logprobs: dict[tuple[int, int], CompletionLogprobs] = {}
        finals: dict[int, RequestOutput] = {}
        head = {"id": request_id, "object": "text_completion", "created": created,
                "model": self.model_name}
        extra = {"usage": None} if include_usage else {}
        async for i, output in merge(streams):
            finals[i] = output
            for c in output.outputs:
                delta = deltas.setdefault((i, c.index), TextDelta())
                if delta.finished:
                    continue
                text = delta.take(c)
                lp = logprobs.setdefault((i, c.index), CompletionLogprobs()).take(c)
                if not text and not c.finished and not (lp and lp["tokens"]):
                    continue
                delta.finished = c.finished
                choice = {"index": i * n + c.index, "text": text, "logprobs": lp,
                          "finish_reason": c.finish_reason,
                          "stop_reason": c.stop_reason if c.finished else None}
                yield sse({**head, "choices": [choice], **extra})
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(list(finals.values()))})
        yield SSE_DONE

    # ------------------------------------------------------------ chat

    async def chat(self, body: ChatCompletionRequest, raw: Request):
        params = body.to_sampling_params()
        tools = body.template_tools()
        tokenizer = self.llm.tokenizer
        assert tokenizer is not None
        try:
            text = tokenizer.apply_chat_template(
                body.conversation(), add_generation_prompt=body.add_generation_prompt,
                tools=tools, **(body.chat_template_kwargs or {}))
        except ValueError as err:
            raise ValueError(f"messages: {err}") from None
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            streams = self._submit(request_id, [(text, token_ids)], params, body.priority)
        except ValueError as err:
            message = str(err)
            if message.startswith("prompt:"):  # the conversation is the prompt here
                message = "messages:" + message[len("prompt:"):]
            raise ValueError(message) from None
        created = int(time.time())
        num_top = body.top_logprobs or 0
        if body.stream:
            chunks = self._chat_chunks(request_id, created, streams[0], params.n, num_top,
                                       body.include_usage)
            return event_stream(chunks, streams)
        final = (await collect(streams, raw))[0]
        choices = [{
            "index": c.index, "message": {"role": "assistant", "content": c.text},
            "logprobs": ChatLogprobs(tokenizer, num_top).take(c),
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
        } for c in final.outputs]
        return JSONResponse({
            "id": request_id, "object": "chat.completion", "created": created,
            "model": self.model_name, "choices": choices, "usage": usage([final]),
        })

    async def _chat_chunks(self, request_id: str, created: int, stream: RequestStream, n: int,
                           num_top: int, include_usage: bool) -> AsyncIterator[str]:
        assert self.llm.tokenizer is not None
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": self.model_name}
        extra = {"usage": None} if include_usage else {}
        deltas = [TextDelta() for _ in range(n)]
        logprobs = [ChatLogprobs(self.llm.tokenizer, num_top) for _ in range(n)]
        final = None
        for index in range(n):
            role = {"index": index, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None}
            yield sse({**head, "choices": [role], **extra})
        async for output in stream:
            final = output
            for c in output.outputs:
                delta = deltas[c.index]
                if delta.finished:
                    continue
                text = delta.take(c)
                lp = logprobs[c.index].take(c)
                if not text and not c.finished and not (lp and lp["content"]):
                    continue
                delta.finished = c.finished
                choice = {"index": c.index, "delta": {"content": text} if text else {},
                          "logprobs": lp, "finish_reason": c.finish_reason}
                if c.finished:
                    choice["stop_reason"] = c.stop_reason
                yield sse({**head, "choices": [choice], **extra})
        if include_usage and final is not None:
            yield sse({**head, "choices": [], "usage": usage([final])})
        yield SSE_DONE

    # ------------------------------------------------------------ shared

    def _submit(self, request_id: str, prompts: list[tuple[str | None, list[int]]], params,
                priority: int) -> list[RequestStream]:
        """One engine request per prompt; on any refusal, nothing stays submitted."""
        streams: list[RequestStream] = []
        try:
            for i, (text, token_ids) in enumerate(prompts):
                sub_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(self.llm.add_request(sub_id, token_ids, params, prompt=text,
                                                    priority=priority))
        except BaseException:
            for stream in streams:
                stream.close()
            raise
        return streams


def event_stream(chunks: AsyncIterator[str], streams: list[RequestStream]) -> StreamingResponse:
    """An SSE response; an engine failure mid-stream becomes an error event (the
    ``openai`` client raises it), and however the stream ends, its requests close:
    a client that disconnects cancels the iteration, which aborts them."""

    async def guarded() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        except EngineDeadError as err:
            yield sse(error_body(500, f"generation failed: {err}"))
        except ValueError as err:
            yield sse(error_body(400, str(err)))
        finally:
            for stream in streams:
                stream.close()

    return StreamingResponse(guarded(), media_type="text/event-stream", headers=SSE_HEADERS)


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


async def wait_for_disconnect(receive: Callable[[], Any]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
