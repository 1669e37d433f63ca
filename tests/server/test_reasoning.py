"""Reasoning outputs and thinking budgets behind the server (issue 35 items 1-2).

The default model does not think, so the servers here get a chat template
(``--chat-template``) that opens ``<think>\\n`` at the generation prompt
unless ``enable_thinking`` is false, as Qwen3's thinking templates do, and
renders an earlier turn's ``reasoning_content``. With a thinking budget of N
the model writes exactly N thinking tokens, then the forced
``\\n</think>\\n\\n``, then its answer: read from the logprobs' tokens, the
reasoning and content fields and the usage's reasoning tokens. The budget is
checked with streaming, n > 1, n-gram speculative decoding, async
scheduling with preemptions, and a structured answer."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.role == 'assistant' and m.reasoning_content %}<think>{{ m.reasoning_content }}</think>"
    "{%- endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{%- else %}<think>\n{% endif %}{% endif %}"
)
FORCED = "\n</think>\n\n"
QUESTION = [{"role": "user", "content": "What is the capital of France? Explain briefly."}]


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "thinking.jinja"
    path.write_text(TEMPLATE)
    return str(path)


@pytest.fixture(scope="module")
def server(make_server, template_file):
    return make_server("reasoning", ["--reasoning-parser", "qwen3", "--chat-template", template_file])


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def budgeted(budget: int, **kwargs):
    """A greedy request with a budget; min_tokens keeps an answer after the close."""
    num_close = 4  # "\n</think>\n\n" is at most this many of the model's tokens
    return dict(model=MODEL, messages=QUESTION, temperature=0, logprobs=True,
                max_tokens=budget + num_close + 6,
                extra_body={"thinking_token_budget": budget, "min_tokens": budget + num_close + 2,
                            **kwargs.pop("extra_body", {})}, **kwargs)


def assert_budget_kept(tokens: list[str], budget: int) -> None:
    """Exactly ``budget`` thinking tokens, then the forced close."""
    text = "".join(tokens)
    close_at = text.index(FORCED)
    assert len("".join(tokens[:budget])) == close_at, tokens
    assert "</think>" not in "".join(tokens[:budget])


def test_reasoning_and_content_are_split(server):
    client = client_of(server)
    answer = client.chat.completions.create(**budgeted(6))
    choice = answer.choices[0]
    message = choice.message.model_dump()
    assert_budget_kept([t.token for t in choice.logprobs.content], 6)
    assert message["reasoning"] and message["reasoning"] == message["reasoning_content"]
    assert message["content"] and "</think>" not in message["content"] + message["reasoning"]
    assert answer.usage.completion_tokens_details.reasoning_tokens == 6
    # Streamed: the same split, delta by delta.
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                 **{**budgeted(6), "logprobs": False}))
    deltas = [c.choices[0].delta.model_dump() for c in chunks if c.choices]
    assert "".join(d.get("reasoning") or "" for d in deltas) == message["reasoning"]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 6


def test_without_a_budget_the_thinking_runs_on_and_stays_out_of_content(server):
    answer = client_of(server).chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                                       max_tokens=12, extra_body={"min_tokens": 12})
    message = answer.choices[0].message.model_dump()
    assert message["reasoning"] and not message["content"]  # cut short while thinking
    assert answer.usage.completion_tokens_details.reasoning_tokens == 12


def test_enable_thinking_false_reaches_the_template(server):
    client = client_of(server)
    answer = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=8,
                                            extra_body={"chat_template_kwargs": {"enable_thinking": False},
                                                        "min_tokens": 4})
    message = answer.choices[0].message.model_dump()
    assert message["reasoning"] is None and message["content"]
    assert answer.usage.completion_tokens_details.reasoning_tokens == 0
    prompt = httpx.post(f"{server.base_url}/tokenize", json={"messages": QUESTION}).json()["tokens"]
    off = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens > len(prompt)  # the closed empty block is in the prompt


def test_earlier_reasoning_reaches_the_template_under_either_name(server):
    client = client_of(server)
    counts = []
    for field in ("reasoning", "reasoning_content", None):
        turn = {"role": "assistant", "content": "Paris."}
        if field:
            turn[field] = "The user asks about France. Its capital is Paris, a city on the Seine."
        messages = [*QUESTION, turn, {"role": "user", "content": "And Spain?"}]
        counts.append(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
                      .usage.prompt_tokens)
    assert counts[0] == counts[1] > counts[2]


def test_include_reasoning_false_leaves_it_out(server):
    answer = client_of(server).chat.completions.create(**budgeted(4, extra_body={"include_reasoning": False}))
    message = answer.choices[0].message.model_dump()
    assert message.get("reasoning") is None and message["content"]
    assert "</think>" not in message["content"]


def test_budget_with_n_and_a_structured_answer(server):
    client = client_of(server)
    answer = client.chat.completions.create(**{**budgeted(5), "n": 2, "temperature": 0.8, "seed": 3})
    for choice in answer.choices:
        assert_budget_kept([t.token for t in choice.logprobs.content], 5)
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    answer = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        extra_body={"thinking_token_budget": 3})
    message = answer.choices[0].message
    assert "city" in json.loads(message.content)  # the grammar applies to the answer
    assert answer.usage.completion_tokens_details.reasoning_tokens == 3


def test_a_budget_needs_a_reasoning_parser_and_a_valid_value(server, make_server):
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
        client_of(server).chat.completions.create(**budgeted(-1))
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        client_of(server).chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1,
                                                  reasoning_effort="low")


@pytest.mark.parametrize("mode", ["speculative", "async_preempting"])
def test_budget_holds_with_speculation_and_async_preemption(make_server, template_file, mode):
    args = ["--reasoning-parser", "qwen3", "--chat-template", template_file,
            "--thinking-token-budget", "5"]
    if mode == "speculative":
        args += ["--num-speculative-tokens", "3"]
    else:  # a cache too small for four at once: some are preempted
        args += ["--async-scheduling", "--num-gpu-blocks", "12", "--block-size", "8"]
    server = make_server(mode, args)
    client = client_of(server)
    kwargs = budgeted(5)
    del kwargs["extra_body"]["thinking_token_budget"]  # the server's default
    if mode == "speculative":  # a question whose thinking repeats itself: drafts get proposed
        answer = client.chat.completions.create(**kwargs)
        assert_budget_kept([t.token for t in answer.choices[0].logprobs.content], 5)
        assert server.metrics()["cadence:spec_decode_num_drafts_total"] > 0
        return
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: client.chat.completions.create(**kwargs), range(4)))
    for answer in answers:
        assert_budget_kept([t.token for t in answer.choices[0].logprobs.content], 5)
        assert answer.usage.completion_tokens_details.reasoning_tokens == 5
    assert server.metrics()["cadence:num_preemptions_total"] > 0


def test_a_forced_tool_call_follows_the_thinking_and_the_thinking_is_no_call(server):
    tool = {"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                              "required": ["city"]}}}
    answer = client_of(server).chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=60, tools=[tool], tool_choice="required",
        extra_body={"thinking_token_budget": 4})
    message = answer.choices[0].message.model_dump()
    assert message["reasoning"] and "<tool_call>" not in message["reasoning"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    assert "city" in json.loads(message["tool_calls"][0]["function"]["arguments"])
    assert answer.usage.completion_tokens_details.reasoning_tokens == 4
