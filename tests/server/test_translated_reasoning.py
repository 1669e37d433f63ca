"""Reasoning through the translated APIs (issue 35 items 4, 5): a server with
``--reasoning-parser qwen3`` and test_reasoning.py's thinking template (the
default model does not think; the template opens ``<think>`` for it). The
chat path's reasoning comes back as a Responses ``reasoning`` item and as an
Anthropic ``thinking`` block, whole and streamed, equal to the chat answer's
``reasoning``; Anthropic's ``thinking.budget_tokens`` is the thinking budget,
``thinking: disabled`` reaches the template; earlier reasoning items and
thinking blocks reach the template as ``reasoning_content``."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.server.test_reasoning import TEMPLATE

MODEL = "SmolLM2-135M-Instruct"
ASK = "What is the capital of France? Explain briefly."
QUESTION = [{"role": "user", "content": ASK}]


@pytest.fixture(scope="module")
def server(make_server, tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "thinking.jinja"
    path.write_text(TEMPLATE)
    return make_server("translated-reasoning", ["--reasoning-parser", "qwen3", "--chat-template", str(path)])


@pytest.fixture(scope="module")
def chat(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def chat_answer(chat, max_tokens: int, **extra):
    return chat.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=max_tokens,
                                        temperature=0, extra_body=extra or None)


def prompt_tokens(chat, messages) -> int:
    return chat.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage.prompt_tokens


def test_responses_reasoning_item_whole_and_streamed(chat):
    expected = chat_answer(chat, 5)
    reasoning = expected.choices[0].message.model_dump()["reasoning"]
    assert reasoning and expected.choices[0].finish_reason == "length"  # thinking, cut
    response = chat.responses.create(model=MODEL, input=ASK, max_output_tokens=5, temperature=0)
    assert response.status == "incomplete"
    [item] = response.output
    assert item.type == "reasoning" and item.content[0].text == reasoning
    assert response.usage.output_tokens_details.reasoning_tokens == 5
    with chat.responses.stream(model=MODEL, input=ASK, max_output_tokens=5, temperature=0) as stream:
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == reasoning
    assert events[-1].type == "response.incomplete"
    assert [i.type for i in events[-1].response.output] == ["reasoning"]


def test_reasoning_items_reach_the_template(chat):
    items = [QUESTION[0],
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "Paris, surely."}]},
             {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "Why?"}]
    response = chat.responses.create(model=MODEL, input=items, max_output_tokens=1)
    turns = [QUESTION[0], {"role": "assistant", "content": "Paris.", "reasoning_content": "Paris, surely."},
             {"role": "user", "content": "Why?"}]
    assert response.usage.input_tokens == prompt_tokens(chat, turns)
    assert response.usage.input_tokens > prompt_tokens(chat, [turns[0], {"role": "assistant", "content": "Paris."},
                                                              turns[2]])


def test_messages_thinking_block_with_a_budget(chat, claude):
    expected = chat_answer(chat, 24, thinking_token_budget=6).choices[0].message.model_dump()
    kwargs = dict(model=MODEL, max_tokens=24, messages=QUESTION, extra_body={"temperature": 0},
                  thinking={"type": "enabled", "budget_tokens": 6})
    message = claude.messages.create(**kwargs)
    assert message.content[0].type == "thinking"
    assert message.content[0].thinking == expected["reasoning"]
    assert "".join(b.text for b in message.content[1:] if b.type == "text") == (expected["content"] or "")
    with claude.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in message.content]
    assert final.stop_reason == message.stop_reason


def test_thinking_disabled_and_thinking_blocks_reach_the_template(chat, claude):
    default = claude.messages.count_tokens(model=MODEL, messages=QUESTION).input_tokens
    disabled = claude.messages.count_tokens(model=MODEL, messages=QUESTION,
                                            thinking={"type": "disabled"}).input_tokens
    assert default == prompt_tokens(chat, QUESTION) and disabled > default  # + "\n</think>\n\n"
    turns = [QUESTION[0], {"role": "assistant", "content": [
                 {"type": "thinking", "thinking": "Paris, surely.", "signature": ""},
                 {"type": "text", "text": "Paris."}]},
             {"role": "user", "content": "Why?"}]
    counted = claude.messages.count_tokens(model=MODEL, messages=turns).input_tokens
    assert counted == prompt_tokens(chat, [QUESTION[0], {"role": "assistant", "content": "Paris.",
                                                         "reasoning_content": "Paris, surely."},
                                           {"role": "user", "content": "Why?"}])
