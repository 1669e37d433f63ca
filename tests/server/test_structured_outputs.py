"""Structured outputs and tool calls through the official ``openai`` client
against a live server on the default model: ``parse`` with a pydantic model,
JSON schemas, regex and choice, tool calls (required, named, auto), streamed
tool-call deltas, and the 400s that name what is wrong.

Every schema keeps its strings and arrays short (maxLength, maxItems): a
135M model under greedy decoding may otherwise write one string for its
whole token budget, and a JSON cut at max_tokens is not JSON.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from enum import Enum

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

MODEL = "SmolLM2-135M-Instruct"

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "doctor", "teacher", "artist"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "skills"],
}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module", params=["llguidance", "xgrammar"])
def client(make_server, request):
    server = make_server(f"structured-{request.param}",
                         ["--structured-outputs-backend", request.param])
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


class Role(str, Enum):
    engineer = "engineer"
    doctor = "doctor"


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


class Profile(BaseModel):
    name: str = Field(max_length=24)
    age: int
    role: Role
    home: City
    hobbies: list[str] = Field(max_length=3)


def chat(client, content: str, **kwargs):
    kwargs = {"temperature": 0, "max_tokens": 150, **kwargs}
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], **kwargs)


# ------------------------------------------------------------------ structured outputs


def test_parse_returns_a_validated_pydantic_object(client):
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Invent an engineer's profile."}],
        response_format=Profile, temperature=0, max_tokens=150)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Profile)
    assert Profile.model_validate_json(message.content) == message.parsed


def test_json_schema_holds_for_twenty_prompts(client):
    """Nested objects, enums, a pattern and arrays: every answer is JSON that
    validates, whatever the prompt (the prompts differ, so do the answers)."""
    prompts = [f"Describe person number {i} who lives in city {chr(65 + i)}." for i in range(20)]
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}
    with ThreadPoolExecutor(len(prompts)) as pool:  # at once: the engine batches them
        choices = list(pool.map(lambda prompt: chat(client, prompt, response_format=response_format,
                                                    max_tokens=200).choices[0], prompts))
    answers = []
    for choice in choices:
        assert choice.finish_reason == "stop", choice.message.content
        answer = json.loads(choice.message.content)
        jsonschema.validate(answer, PERSON_SCHEMA)
        answers.append(answer)
    assert len({json.dumps(a, sort_keys=True) for a in answers}) > 1


def test_json_object_mode(client):
    choice = chat(client, "Give me a JSON object about a cat.",
                  response_format={"type": "json_object"}, max_tokens=200).choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict)
    # /v1/completions takes response_format too (as a request extra for the client).
    completion = client.completions.create(
        model=MODEL, prompt="A JSON object describing a dog:", max_tokens=150, temperature=0,
        extra_body={"response_format": {"type": "json_object"}})
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(completion.choices[0].text), dict)


def test_regex_and_choice_constrain(client):
    phone = chat(client, "What is your phone number?",
                 extra_body={"structured_outputs": {"regex": r"\+1-[0-9]{3}-[0-9]{4}"}}).choices[0]
    assert phone.finish_reason == "stop"
    assert phone.message.content.startswith("+1-") and len(phone.message.content) == 11
    answers = {chat(client, f"Is {thing} good or bad?", temperature=1.0, seed=seed,
                    extra_body={"guided_choice": ["good", "bad", "unsure"]}).choices[0].message.content
               for seed, thing in enumerate(["rain", "cake", "noise", "sleep", "tax", "music"])}
    assert answers <= {"good", "bad", "unsure"}
    completion = client.completions.create(
        model=MODEL, prompt="The answer, yes or no:", max_tokens=5, temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert completion.choices[0].text in ("yes", "no")


def test_a_grammar_constrains(client):
    lark = 'start: "SELECT " COLUMN " FROM " TABLE\nCOLUMN: /[a-z]{1,8}/\nTABLE: /[a-z]{1,8}/'
    text = chat(client, "Write a SQL query.", extra_body={"guided_grammar": lark}).choices[0].message.content
    words = text.split(" ")
    assert words[0] == "SELECT" and words[2] == "FROM" and len(words) == 4


def test_n_samples_all_obey_the_schema(client):
    response = chat(client, "Describe a person.", n=3, temperature=0.9, seed=5, max_tokens=200,
                    response_format={"type": "json_schema",
                                     "json_schema": {"name": "p", "schema": PERSON_SCHEMA}})
    assert len(response.choices) == 3
    for choice in response.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON_SCHEMA)


@pytest.mark.parametrize("kwargs, param, words", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}),
     "response_format.json_schema.schema", "frobnicate"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format.json_schema.schema", "JSON schema"),
    (dict(response_format={"type": "xml"}), "response_format.type", "json_schema"),
    (dict(extra_body={"structured_outputs": {"regex": "[a-"}}), "structured_outputs.regex", "["),
    (dict(extra_body={"guided_grammar": "start: missing_rule"}), "guided_grammar", "missing_rule"),
    (dict(extra_body={"structured_outputs": {"json": {}, "regex": "a"}}), "structured_outputs", "exactly one"),
    (dict(extra_body={"guided_regex": "a+", "guided_choice": ["a"]}), "guided_choice", "only one"),
    (dict(tools=[WEATHER_TOOL], tool_choice="required", response_format={"type": "json_object"}),
     "response_format", "tool"),
    (dict(tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice", "nope"),
    (dict(tool_choice="required"), "tool_choice", "needs tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
          tool_choice="required"), "tools", "bogus"),
])
def test_bad_constraints_get_a_400_naming_the_problem(client, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, "Hi.", max_tokens=5, **kwargs)
    assert err.value.param == param
    assert words in err.value.message
    assert chat(client, "Hi.", max_tokens=2).choices[0].message.content  # still serving


# ------------------------------------------------------------------ tool calls


def test_required_tool_call_round_trip(client):
    """Call, tool result, final answer: the call's arguments fit the tool's schema.
    (One call: left to itself, a 135M model may repeat calls until max_tokens.)"""
    tools = [WEATHER_TOOL, TIME_TOOL]
    first = client.chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, tools=tools,
                                           tool_choice="required", parallel_tool_calls=False,
                                           temperature=0, max_tokens=100)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert len(calls) == 1 and all(call.function.name in ("get_weather", "get_time") for call in calls)
    for call in calls:
        schema = (WEATHER_TOOL if call.function.name == "get_weather" else TIME_TOOL)["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)
        assert call.id.startswith("call_") and call.type == "function"
    messages = WEATHER_QUESTION + [choice.message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "sunny"}'}
        for call in calls]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=tools,
                                           temperature=0, max_tokens=40)
    assert final.choices[0].message.content
    assert not final.choices[0].message.tool_calls


def test_named_tool_choice_forces_that_function(client):
    response = client.chat.completions.create(
        model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL, TIME_TOOL], temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=60)
    (call,) = response.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME_TOOL["function"]["parameters"])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_call_deltas_reassemble_to_the_same_calls(client, tool_choice):
    kwargs = dict(model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL, TIME_TOOL],
                  tool_choice=tool_choice, temperature=0, max_tokens=70)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish_reason = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            finish_reason = choice.finish_reason or finish_reason
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
    # "required" lets the model call again and again (until max_tokens, for a
    # 135M model): the calls it completed are its calls, streamed or not.
    assert finish_reason == whole.finish_reason
    assert whole.finish_reason == "tool_calls" or tool_choice == "required"
    assert whole.message.tool_calls
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_auto_reads_hermes_tool_calls_whole_and_streamed(client):
    """Under "auto" the model chooses. A regex makes it write a Hermes call
    (a 135M model rarely chooses to): the parser turns the text into a call,
    whole and streamed; a plain answer stays content."""
    hermes = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris", "unit": "celsius"\}\}\n</tool_call>'
    kwargs = dict(model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL], temperature=0,
                  max_tokens=60, extra_body={"guided_regex": hermes})
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather", {"city": "Paris", "unit": "celsius"})
    streamed = [d for chunk in client.chat.completions.create(stream=True, **kwargs)
                for c in chunk.choices for d in c.delta.tool_calls or []]
    assert [(d.index, d.function.name, d.function.arguments) for d in streamed] == [
        (0, "get_weather", call.function.arguments)]
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                           tools=[WEATHER_TOOL], temperature=0, max_tokens=10)
    assert plain.choices[0].message.content and not plain.choices[0].message.tool_calls
