"""POST /v1/messages and /v1/messages/count_tokens through the official
``anthropic`` client (``base_url`` at the server, any key): system and content
blocks, a forced tool_use and its tool_result sent back, each stop_reason
(end_turn, max_tokens, stop_sequence, tool_use), the stream's events as
``messages.stream`` reads them, count_tokens against the chat path's prompt,
refused fields and errors in Anthropic's shape; and, without a server,
reasoning deltas as a thinking block through the client's own accumulator
(issue 35, item 5)."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import openai
import pytest
from anthropic.lib.streaming._messages import accumulate_event

from cadence.server.messages import MessageEvents, chat_messages
from cadence.server.responses import translated_events
from tests.server.serverlib import wait_until

MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"temperature": 0}  # Anthropic's older field: this client sends it as an extra
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"], "additionalProperties": False}}
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}


@pytest.fixture(scope="module")
def server(make_server):
    return make_server("messages")


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def create(client, **kwargs):
    return client.messages.create(model=MODEL, extra_body=GREEDY, **kwargs)


def chat_prompt_tokens(chat, messages, **kwargs) -> int:
    return chat.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                        **kwargs).usage.prompt_tokens


def test_text_end_turn_and_usage(client, chat):
    message = create(client, max_tokens=64, system=[{"type": "text", "text": "Be brief."}],
                     messages=[{"role": "user", "content": [{"type": "text", "text": "Say hi."}]}])
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    [block] = message.content
    assert block.type == "text" and block.text.strip()
    prompt = chat_prompt_tokens(chat, [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Say hi."}])
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == prompt
    assert 0 < message.usage.output_tokens < 64


def test_max_tokens_and_stop_sequence(client):
    cut = create(client, max_tokens=3, messages=[{"role": "user", "content": "Count to one hundred."}])
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    whole = create(client, max_tokens=12, messages=[{"role": "user", "content": "Count to one hundred."}])
    word = whole.content[0].text.split()[1]  # greedy: the same text again, stopped at this word
    stopped = create(client, max_tokens=12, stop_sequences=[word],
                     messages=[{"role": "user", "content": "Count to one hundred."}])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert word not in stopped.content[0].text


def test_tool_use_round_trip(client, chat):
    first = create(client, max_tokens=64, messages=[QUESTION], tools=[WEATHER],
                   tool_choice={"type": "tool", "name": "get_weather"})
    assert first.stop_reason == "tool_use"
    [call] = first.content
    assert call.type == "tool_use" and call.name == "get_weather" and isinstance(call.input["city"], str)
    turns = [QUESTION, {"role": "assistant", "content": [block.model_dump() for block in first.content]},
             {"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": call.id, "content": "18 C, sunny"}]}]
    second = create(client, max_tokens=16, messages=turns, tools=[WEATHER],
                    tool_choice={"type": "none"})
    assert second.content[0].type == "text"
    chat_turns = [QUESTION, {"role": "assistant", "content": "", "tool_calls": [
                      {"id": call.id, "type": "function",
                       "function": {"name": "get_weather", "arguments": json.dumps(call.input)}}]},
                  {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]
    assert (second.usage.input_tokens + second.usage.cache_read_input_tokens
            == chat_prompt_tokens(chat, chat_turns, tools=tools, tool_choice="none"))


def test_stream_events_and_final_message(client):
    kwargs = dict(max_tokens=64, messages=[{"role": "user", "content": "Say hi."}], extra_body=GREEDY)
    whole = client.messages.create(model=MODEL, **kwargs)
    with client.messages.stream(model=MODEL, **kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events if not event.type.startswith("text")]  # the helper's own
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason == "end_turn"
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert (final.usage.input_tokens + final.usage.cache_read_input_tokens
            == whole.usage.input_tokens + whole.usage.cache_read_input_tokens)


def test_stream_tool_use(client):
    with client.messages.stream(model=MODEL, max_tokens=64, messages=[QUESTION], tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"},
                                extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    [call] = final.content
    assert call.type == "tool_use" and isinstance(call.input["city"], str)


def test_count_tokens_is_the_chat_templates_count(client, chat):
    system, turns = "Be brief.", [{"role": "user", "content": "Say hi."}]
    counted = client.messages.count_tokens(model=MODEL, system=system, messages=turns)
    assert counted.input_tokens == chat_prompt_tokens(chat, [{"role": "system", "content": system}] + turns)
    with_tools = client.messages.count_tokens(model=MODEL, messages=[QUESTION], tools=[WEATHER])
    tools = [{"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]
    assert with_tools.input_tokens == chat_prompt_tokens(chat, [QUESTION], tools=tools)


@pytest.mark.parametrize("kwargs, words", [
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}},
     "thinking.budget_tokens: this server has no --reasoning-parser"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"output_config": {"effort": "high"}}, "output_config: not supported"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]},
     "prefill"),
    ({"max_tokens": 100000}, "max_tokens: This model's maximum context length"),
])
def test_refused_fields_in_anthropic_shape(client, kwargs, words):
    body = {"max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], **kwargs}
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL, **body)
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert words in caught.value.body["error"]["message"]


def test_errors_in_anthropic_shape(server, client):
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="claude-nope", max_tokens=4, messages=[QUESTION])
    assert caught.value.body["error"]["type"] == "not_found_error"
    for body in (b"{not json", json.dumps({"model": MODEL, "messages": [QUESTION]}).encode()):
        answer = httpx.post(f"{server.base_url}/v1/messages", content=body, timeout=30,
                            headers={"content-type": "application/json"})
        assert answer.status_code == 400
        assert answer.json()["type"] == "error", answer.text
    assert "max_tokens" in answer.json()["error"]["message"]  # the missing field is named
    neutral = client.messages.create(model=MODEL, max_tokens=2, messages=[QUESTION],
                                     thinking={"type": "disabled"}, metadata={"user_id": "u1"})
    assert neutral.stop_reason == "max_tokens"


def test_disconnect_mid_stream_aborts(server, client):
    """A client gone mid-stream closes the chat stream under the translation:
    its engine request is aborted and its KV blocks are freed."""
    aborted = server.metrics('finished_reason="abort"').get("cadence:request_success_total", 0.0)
    with client.messages.stream(model=MODEL, max_tokens=1500, extra_body=GREEDY, messages=[
            {"role": "user", "content": "Count from 1 to 1000, one number per line."}]) as stream:
        for i, _ in enumerate(stream):
            if i == 5:
                break
        assert server.metrics()["cadence:num_requests_running"] == 1
    assert wait_until(lambda: server.metrics()["cadence:kv_cache_usage_perc"] == 0.0, 60)
    assert server.metrics('finished_reason="abort"')["cadence:request_success_total"] == aborted + 1


# ------------------------------------------------------------------ reasoning, without a server


def test_thinking_blocks_go_back_as_reasoning_content():
    turn = {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "They greet me.", "signature": ""},
        {"type": "text", "text": "Hello!"}]}
    assert chat_messages(turn, 1) == [{"role": "assistant", "content": "Hello!",
                                       "reasoning_content": "They greet me."}]


def test_reasoning_deltas_become_a_thinking_block_the_client_reads():
    """Chat chunks with ``reasoning_content`` deltas (a reasoning parser's) through
    MessageEvents, accumulated by the ``anthropic`` client's own code."""
    events = MessageEvents("msg_1", MODEL, None)
    chunks = [{"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
              {"choices": [{"delta": {"reasoning_content": "Think"}, "finish_reason": None}]},
              {"choices": [{"delta": {"reasoning_content": "ing."}, "finish_reason": None}]},
              {"choices": [{"delta": {"content": "Hello"}, "finish_reason": "stop"}]},
              {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}}]
    sse = events.start() + [e for chunk in chunks for e in events.take(chunk)] + events.end()
    snapshot = None
    for text in sse:
        data = json.loads(text.split("data: ", 1)[1])
        if data["type"] != "ping":
            snapshot = accumulate_event(event=data, current_snapshot=snapshot, json_bufs={})
    assert [block.type for block in snapshot.content] == ["thinking", "text"]
    assert snapshot.content[0].thinking == "Thinking." and snapshot.content[1].text == "Hello"
    assert snapshot.stop_reason == "end_turn"
    assert (snapshot.usage.input_tokens, snapshot.usage.output_tokens) == (5, 4)


def test_a_failure_mid_stream_is_an_error_event():
    """The chat path's error chunk (an engine failure mid-stream) ends the
    translated stream with Anthropic's error event, which the client raises."""
    async def chunks():
        yield {"choices": [{"delta": {"content": "Hel"}, "finish_reason": None}]}
        yield {"error": {"message": "generation failed: the engine died", "code": 500}}

    async def read():
        return [e async for e in translated_events(MessageEvents("msg_1", MODEL, None), chunks())]

    events = asyncio.run(read())
    assert events[-1].startswith("event: error\n")
    assert json.loads(events[-1].split("data: ", 1)[1]) == {
        "type": "error", "error": {"type": "api_error", "message": "generation failed: the engine died"}}
    assert not any(e.startswith("event: message_stop") for e in events)
