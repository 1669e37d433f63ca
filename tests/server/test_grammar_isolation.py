"""Issue 30: no output constraint a request carries can take the server down,
and none is answered with output that breaks it.

A Lark grammar of a few thousand chained rules crashed llguidance (SIGSEGV)
inside the server's own process; now the check runs in a worker process and
the crash is one 400. Over-size constraints get a 400 naming the option;
constraints that nothing satisfies get a 400 naming the field. After each,
the same server answers a normal request and a constrained one.

One server (llguidance), with the rule limit raised above the crashing
grammar's size, so that it reaches the grammar library.
"""

from __future__ import annotations

import json

import httpx
import pytest

MODEL = "SmolLM2-135M-Instruct"
CRASH_RULES = 5000  # ~110 KB; llguidance's validation overflows its stack from ~3000
MAX_RULES = 6000


def chain(num_rules: int) -> str:
    """``start: r0``, ``r0: "x0" | r1``, ...: each rule one literal or the next rule."""
    rules = [f'r{i}: "x{i}" | r{i + 1}' for i in range(num_rules - 1)]
    return "\n".join(["start: r0", *rules, f'r{num_rules - 1}: "x{num_rules - 1}"'])


@pytest.fixture(scope="module")
def server(make_server):
    return make_server("grammar-isolation", ["--structured-outputs-max-rules", str(MAX_RULES)])


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        yield http


def complete(http: httpx.Client, **body) -> httpx.Response:
    return http.post("/v1/completions", json={"model": MODEL, "prompt": "Answer:", "max_tokens": 4,
                                              "temperature": 0, **body})


def assert_still_serving(http: httpx.Client, server) -> None:
    assert server.process.poll() is None
    plain = complete(http)
    assert plain.status_code == 200, plain.text
    constrained = complete(http, structured_outputs={"choice": ["yes", "no"]})
    assert constrained.status_code == 200, constrained.text
    assert constrained.json()["choices"][0]["text"] in ("yes", "no")


def assert_400(response: httpx.Response, param: str, *words: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    for word in words:
        assert word in error["message"], error["message"]
    return error["message"]


def test_a_grammar_that_crashes_the_grammar_library_is_a_400_and_the_server_goes_on(http, server):
    engine_pid = server.engine_pid()
    for field, body in (("structured_outputs.grammar", {"structured_outputs": {"grammar": chain(CRASH_RULES)}}),
                        ("guided_grammar", {"guided_grammar": chain(CRASH_RULES + 1)})):
        message = assert_400(complete(http, **body), field, "could not be compiled", "crashed")
        assert "backtrace" not in message
        assert_still_serving(http, server)
    assert server.engine_pid() == engine_pid


def test_grammars_over_the_size_limits_get_a_400_naming_the_option(http, server):
    assert_400(complete(http, structured_outputs={"grammar": chain(MAX_RULES + 500)}),
               "structured_outputs.grammar", "--structured-outputs-max-rules")
    choices = [f"choice {i}" for i in range(100_000)]
    assert_400(complete(http, guided_choice=choices), "guided_choice", "100000 strings",
               "--structured-outputs-max-choices")
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 400}
                                             for i in range(3000)}}
    assert_400(http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": huge}}}),
        "response_format.json_schema.schema", "--structured-outputs-max-bytes")
    assert_still_serving(http, server)


def test_a_long_choice_list_is_followed_to_its_end(http):
    """20,000 strings: one token, then "the grammar refused a sampled token" before."""
    choices = [f"item number {i}" for i in range(20_000)]
    response = complete(http, structured_outputs={"choice": choices}, max_tokens=12)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["text"] in choices and choice["finish_reason"] == "stop"


def test_a_grammar_the_library_cannot_follow_is_a_400_not_a_refused_token(http, server):
    """2,000 chained rules compile, but the first token leaves a parser row over
    llguidance's limit: the check walks a few tokens and finds it."""
    assert_400(complete(http, structured_outputs={"grammar": chain(2000)}),
               "structured_outputs.grammar", "cannot follow")
    assert_still_serving(http, server)


CYCLE = {"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
                   "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}},
         "$ref": "#/$defs/a"}


@pytest.mark.parametrize("body, param, words", [
    ({"structured_outputs": {"regex": r"[^\s\S]"}}, "structured_outputs.regex", "no output satisfies"),
    ({"guided_regex": r"ab[^\s\S]"}, "guided_regex", "no output satisfies"),
    ({"structured_outputs": {"json": CYCLE}}, "structured_outputs.json", "$ref cycle"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": CYCLE}}},
     "response_format.json_schema.schema", "no JSON value satisfies"),
])
def test_constraints_nothing_satisfies_get_a_400_naming_the_field(http, server, body, param, words):
    if "response_format" in body:
        response = http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **body})
    else:
        response = complete(http, **body)
    assert_400(response, param, words)
    assert_still_serving(http, server)


def test_a_constraint_that_accepts_only_the_empty_output_is_served(http):
    response = complete(http, structured_outputs={"regex": "x{0}"})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == ""


def test_a_streamed_request_with_a_crashing_grammar_is_refused_before_the_stream(http):
    response = complete(http, stream=True, structured_outputs={"grammar": chain(CRASH_RULES + 2)})
    assert_400(response, "structured_outputs.grammar", "crashed")
    events = [line for line in complete(http, stream=True).text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and json.loads(events[0][6:])["choices"]
