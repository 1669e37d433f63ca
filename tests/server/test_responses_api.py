"""POST /v1/responses through the official ``openai`` client (``responses.create``
and ``responses.stream``): text and item input, instructions, a forced function
call and its output sent back, max_output_tokens -> incomplete, the typed
stream events as the client's accumulator reads them, refused fields; and,
without a server, reasoning deltas as reasoning items through the client's own
stream state (issue 35, item 4)."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent
from openai._models import construct_type

from cadence.server.formatting import SSE_DONE, sse
from cadence.server.responses import (
    ResponseEvents, ResponseHead, ResponsesRequest, chat_chunks, input_messages, translated_events,
)

MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"temperature": 0}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False}}
FORCE_WEATHER = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def server(make_server):
    return make_server("responses")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def chat_prompt_tokens(client, messages, **kwargs) -> int:
    """The prompt's token count on the chat path, for the same conversation."""
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                          **kwargs).usage.prompt_tokens


def test_text_input(client):
    response = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=24, **GREEDY)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status in ("completed", "incomplete")
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text.strip()
    assert response.usage.input_tokens == chat_prompt_tokens(
        client, [{"role": "user", "content": "Say hello."}])
    assert 0 < response.usage.output_tokens <= 24


def test_items_with_instructions_render_as_chat_does(client):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "My name is Ada."}]},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Hello Ada!"}]},
             {"role": "user", "content": "What is my name?"}]
    response = client.responses.create(model=MODEL, input=items, instructions="Answer briefly.",
                                       max_output_tokens=8, **GREEDY)
    chat = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": "Hello Ada!"},
            {"role": "user", "content": "What is my name?"}]
    assert response.usage.input_tokens == chat_prompt_tokens(client, chat)
    assert response.instructions == "Answer briefly."


def test_max_output_tokens_gives_incomplete(client):
    response = client.responses.create(model=MODEL, input="Count to one hundred.",
                                       max_output_tokens=3, **GREEDY)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3
    assert response.output[0].status == "incomplete"


def test_function_call_round_trip(client):
    question = {"role": "user", "content": "What is the weather in Paris?"}
    first = client.responses.create(model=MODEL, input=[question], tools=[WEATHER],
                                    tool_choice=FORCE_WEATHER, **GREEDY)
    assert first.status == "completed"
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert isinstance(json.loads(call.arguments)["city"], str)
    # The call and its output go back in; the prompt is what the chat path renders.
    items = [question, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}]
    second = client.responses.create(model=MODEL, input=items, tools=[WEATHER], tool_choice="none",
                                     max_output_tokens=16, **GREEDY)
    assert second.output[0].type == "message" and second.output_text
    chat = [question, {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.call_id, "type": "function",
                 "function": {"name": "get_weather", "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "18 C, sunny"}]
    chat_tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    assert second.usage.input_tokens == chat_prompt_tokens(client, chat, tools=chat_tools,
                                                           tool_choice="none")


def test_stream_events_and_final_response(client):
    whole = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=40, **GREEDY)
    assert whole.status == "completed", "the greedy answer should end before 40 tokens"
    with client.responses.stream(model=MODEL, input="Say hi.", max_output_tokens=40, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert final.output_text == deltas == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stream_incomplete_and_function_call(client):
    with client.responses.stream(model=MODEL, input="Count to one hundred.", max_output_tokens=2,
                                 **GREEDY) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    with client.responses.stream(model=MODEL, input="Weather in Rome?", tools=[WEATHER],
                                 tool_choice=FORCE_WEATHER, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert "response.function_call_arguments.delta" in kinds
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    [call] = final.output
    assert call.type == "function_call" and json.loads(call.arguments)["city"]


@pytest.mark.parametrize("kwargs, param, words", [
    ({"store": True}, "store", "stateless"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "stateless"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "not supported"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type", "function tools"),
    ({"tools": [{"type": "x" * 500}]}, "tools.0.type", "(502 characters)"),  # quoted, not whole
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0.type", "text"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0", "stateless"),
    ({"max_output_tokens": 100000}, "max_output_tokens", "context length"),
])
def test_refused_fields(client, kwargs, param, words):
    body = {"model": MODEL, "input": "Hi", **kwargs}
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(**body)
    assert caught.value.body["param"] == param
    assert words in caught.value.body["message"]


def test_neutral_values_are_served(client):
    response = client.responses.create(model=MODEL, input="Hi", store=False, truncation="disabled",
                                       metadata={"k": "v"}, max_output_tokens=2)
    assert response.status == "incomplete"


# ------------------------------------------------------------------ reasoning, without a server


def test_reasoning_items_go_back_as_reasoning_content():
    items = [{"role": "user", "content": "Hi"},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "They greet me."}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "ok"}]
    assert input_messages(items)[1] == {
        "role": "assistant", "content": None, "reasoning_content": "They greet me.",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    with pytest.raises(ValueError, match="reasoning item must come before"):
        input_messages(items[:2])


def test_reasoning_deltas_become_a_reasoning_item_the_client_reads():
    """Chat chunks with ``reasoning_content`` deltas (a reasoning parser's) through
    ResponseEvents, parsed by the ``openai`` client's own stream state."""
    events = ResponseEvents(ResponseHead(ResponsesRequest(input="Hi"), MODEL))
    chunks = [{"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
              {"choices": [{"delta": {"reasoning_content": "Think"}, "finish_reason": None}]},
              {"choices": [{"delta": {"reasoning_content": "ing."}, "finish_reason": None}]},
              {"choices": [{"delta": {"content": "Hello"}, "finish_reason": "stop"}]},
              {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9,
                                        "completion_tokens_details": {"reasoning_tokens": 3}}}]
    sse = events.start() + [e for chunk in chunks for e in events.take(chunk)] + events.end()
    state = ResponseStreamState(input_tools=openai.omit, text_format=openai.omit)
    for text in sse:
        data = json.loads(text.split("data: ", 1)[1])
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=data))
    final = state._completed_response
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "Thinking."
    assert final.output_text == "Hello"
    assert final.usage.output_tokens_details.reasoning_tokens == 3


def test_chat_chunks_read_any_text_and_close_the_chat_stream():
    """The chat stream read back as chunks: text with line separators that JSON
    leaves as they are (U+2028, U+0085), events split across pieces; the chat
    stream is closed when the reader stops early."""
    closed = []

    async def body():
        try:
            yield sse({"choices": [{"delta": {"content": "a\u2028b\x85c"}}]})
            text = sse({"choices": [{"delta": {"content": "d"}}]})
            yield text[:7]
            yield text[7:] + SSE_DONE
            yield sse({"never": "read"})
        finally:
            closed.append(True)

    class Response:
        body_iterator = body()

    async def read():
        return [chunk async for chunk in chat_chunks(Response())]

    chunks = asyncio.run(read())
    assert [c["choices"][0]["delta"]["content"] for c in chunks] == ["a\u2028b\x85c", "d"]
    assert closed == [True]


def test_a_failure_mid_stream_is_an_error_event():
    """The chat path's error chunk ends the stream with the Responses ``error`` event."""
    async def chunks():
        yield {"choices": [{"delta": {"content": "Hel"}, "finish_reason": None}]}
        yield {"error": {"message": "generation failed: the engine died", "type": "server_error"}}

    async def read():
        head = ResponseHead(ResponsesRequest(input="Hi"), MODEL)
        return [e async for e in translated_events(ResponseEvents(head), chunks())]

    events = [json.loads(e.split("data: ", 1)[1]) for e in asyncio.run(read())]
    error = construct_type(type_=ResponseStreamEvent, value=events[-1])
    assert error.type == "error" and error.message == "generation failed: the engine died"
    assert error.sequence_number == len(events) - 1
    assert "response.completed" not in [e["type"] for e in events]
