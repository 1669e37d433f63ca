"""Issue 30's server findings, sent as a client would: one rule for request
fields (fields.py, the README's list), values out of range, ``cache_salt``,
bounded echoes of the request in errors, a forced tool call cut by
``max_tokens``, and the connection limits (header and body deadlines, 413
for chunked bodies) over raw sockets on 127.0.0.1.

One server, with deadlines short enough that the socket tests take seconds.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from pathlib import Path

import httpx
import openai
import pytest
from fastapi import FastAPI, Request

from cadence.server import fields
from cadence.server.config import ServerConfig
from cadence.server.embeddings import EmbeddingRequest
from cadence.server.fields import ANY_VALUE, NOT_HONOURED
from cadence.server.middleware import BodyLimitMiddleware
from cadence.server.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, LoadLoRAAdapterRequest,
    TokenizeRequest, UnloadLoRAAdapterRequest,
)

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Say hello."}]
HEADER_TIMEOUT_S, BODY_TIMEOUT_S = 1.0, 2.0
MAX_BODY = 8 * 1024 * 1024
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}


@pytest.fixture(scope="module")
def server(make_server):
    return make_server("rules", ["--request-header-timeout", str(HEADER_TIMEOUT_S),
                                 "--request-body-timeout", str(BODY_TIMEOUT_S)])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=120)


def assert_400(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: ")
    return error["message"]


# ------------------------------------------------------------------ one rule for fields


from cadence.server.messages import CountTokensRequest, MessagesRequest  # noqa: E402
from cadence.server.responses import ResponsesRequest  # noqa: E402

BODIES = {"chat": ChatCompletionRequest, "completions": CompletionRequest,
          "embeddings": EmbeddingRequest,
          "tokenize": TokenizeRequest, "detokenize": DetokenizeRequest,
          "load_lora_adapter": LoadLoRAAdapterRequest,
          "unload_lora_adapter": UnloadLoRAAdapterRequest,
          "responses": ResponsesRequest, "messages": MessagesRequest,
          "messages_count_tokens": CountTokensRequest}


def test_every_route_with_a_body_follows_the_rule_and_the_readme_lists_its_fields():
    assert set(BODIES) == set(NOT_HONOURED)
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    section = readme.split("## The HTTP API", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`(\w+)`", section))
    for route, body in BODIES.items():
        assert body.ROUTE == route
        honoured, refused = set(body.model_fields), set(NOT_HONOURED[route])
        assert not honoured & refused, route  # a field is one or the other
        assert honoured | refused <= listed, (route, sorted((honoured | refused) - listed))


def test_known_fields_not_honoured_are_400s_naming_them(server):
    cases = [
        ("/v1/chat/completions", {"store": True}, "store"),
        ("/v1/chat/completions", {"request_id": "mine"}, "request_id"),
        ("/v1/chat/completions", {"reasoning_effort": "high"}, "reasoning_effort"),
        ("/v1/chat/completions", {"add_special_tokens": True}, "add_special_tokens"),
        ("/v1/chat/completions", {"length_penalty": 0.5}, "length_penalty"),
        ("/v1/chat/completions", {"echo": True}, "echo"),
        ("/v1/completions", {"suffix": "end"}, "suffix"),
        ("/v1/completions", {"bad_words": ["x"]}, "bad_words"),
        ("/tokenize", {"return_token_strs": True}, "return_token_strs"),
    ]
    for path, fields, param in cases:
        base = ({"prompt": "Hi"} if path != "/v1/chat/completions" else {"messages": CHAT})
        response = post(server, path, {"model": MODEL, "max_tokens": 2, **base, **fields})
        assert_400(response, param)
    chat_tokens = post(server, "/tokenize", {"messages": CHAT, "add_special_tokens": True})
    assert_400(chat_tokens, "add_special_tokens")


def test_neutral_values_and_hints_are_served(client):
    response = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=2, store=False, metadata={"team": "a"},
        service_tier="auto", prompt_cache_key="k", safety_identifier="u1", logit_bias={},
        extra_body={"use_beam_search": False, "spaces_between_special_tokens": True,
                    "modalities": ["text"], "length_penalty": 1.0, "include_reasoning": True,
                    "echo": False, "add_special_tokens": False})
    assert response.choices[0].message.content


def test_unknown_fields_are_ignored_and_logged_once(server, client):
    for _ in range(2):
        response = client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=2,
            extra_body={"cadence_test_unknown_field": {"x": 1}})
        assert response.choices[0].message.content
    completion = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                           extra_body={"cadence_test_unknown_field": 3})
    assert completion.choices[0].text is not None
    deadline = time.monotonic() + 5
    while "cadence_test_unknown_field" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.log().count("cadence_test_unknown_field") == 1


# ------------------------------------------------------------------ values out of range


@pytest.mark.parametrize("fields, param", [
    ({"repetition_penalty": 1e-40}, "repetition_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"cache_salt": ""}, "cache_salt"),
])
def test_values_out_of_range_are_400s_naming_the_field(server, fields, param):
    for path, base in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": CHAT})):
        assert_400(post(server, path, {"model": MODEL, "max_tokens": 2, **base, **fields}), param)


# ------------------------------------------------------------------ cache_salt


def cached_tokens(server, path: str, salt: str | None, **body) -> int:
    extra = {"cache_salt": salt} if salt is not None else {}
    response = post(server, path, {"model": MODEL, "max_tokens": 1, "temperature": 0, **body, **extra})
    assert response.status_code == 200, response.text
    return (response.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_salted_request_never_hits_another_salts_cached_prompt(server, path):
    text = f"Cache salt check on {path}: " + " ".join(f"word{i}" for i in range(80))
    body = {"prompt": text} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": text}]}
    # A prompt nobody sent before: only the chat template's opening may be cached.
    first = cached_tokens(server, path, None, **body)
    assert first == 0 or path == "/v1/chat/completions"
    assert cached_tokens(server, path, "tenant-b", **body) == 0  # unsalted blocks: not for a salt
    assert cached_tokens(server, path, None, **body) > first  # unsalted shares with unsalted
    assert cached_tokens(server, path, "tenant-b", **body) > 0  # equal salts share
    assert cached_tokens(server, path, "tenant-c", **body) == 0  # other salts never do


# ------------------------------------------------------------------ bounded echoes


def test_errors_quote_a_bounded_prefix_of_the_request(server):
    huge = "m" * 1_000_000
    response = post(server, "/v1/completions", {"model": huge, "prompt": "Hi", "max_tokens": 1})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["param"] == "model" and len(response.content) < 600
    assert "m" * 100 + "... (1000000 characters)" in error["message"]

    tool_choice = {"type": "function", "function": {"name": "t" * 100_000}}
    response = post(server, "/v1/chat/completions", {"messages": CHAT, "tools": [WEATHER],
                                                     "tool_choice": tool_choice})
    assert_400(response, "tool_choice")
    assert len(response.content) < 600

    key = "k" * 100_000  # echoed in the field's path by the body's validation
    response = post(server, "/v1/completions", {"prompt": "Hi", "structured_outputs": {key: 1}})
    assert response.status_code == 400 and len(response.content) < 3000


# ------------------------------------------------------------------ a forced call cut short


def test_a_required_tool_call_cut_by_max_tokens_returns_its_text(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                  tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=4)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "length"
    assert not choice.message.tool_calls
    assert choice.message.content and choice.message.content.lstrip().startswith("[")
    streamed, finish_reason, calls = "", None, []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            streamed += c.delta.content or ""
            calls += c.delta.tool_calls or []
            finish_reason = c.finish_reason or finish_reason
    assert (streamed, finish_reason, calls) == (choice.message.content, "length", [])


# ------------------------------------------------------------------ connection limits


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def read_until_closed(sock: socket.socket, timeout_s: float = 10.0) -> tuple[bytes, float]:
    """(everything the server sent, seconds until it closed the connection)."""
    start = time.monotonic()
    sock.settimeout(timeout_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data, time.monotonic() - start


def test_an_idle_connection_is_closed_after_the_header_timeout(server):
    with connect(server) as sock:
        data, waited_s = read_until_closed(sock)
    assert data == b"" and HEADER_TIMEOUT_S * 0.8 < waited_s < HEADER_TIMEOUT_S + 2


def test_connections_trickling_their_headers_get_408_in_time(server):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    sockets = [connect(server) for _ in range(50)]
    start = time.monotonic()
    open_ones, answers = list(sockets), []
    for i in range(len(head)):  # one byte a tick on every connection, while it is open
        for sock in list(open_ones):
            try:
                sock.send(head[i:i + 1])
            except OSError:
                open_ones.remove(sock)
        if not open_ones or time.monotonic() - start > HEADER_TIMEOUT_S + 3:
            break
        time.sleep(0.1)
    for sock in sockets:
        answers.append(read_until_closed(sock, timeout_s=5)[0])
        sock.close()
    assert time.monotonic() - start < HEADER_TIMEOUT_S + 5
    assert all(answer.startswith(b"HTTP/1.1 408 ") for answer in answers), answers[:2]
    assert b"--request-header-timeout" in answers[0]


def test_a_trickled_body_gets_408_after_the_body_timeout(server):
    with connect(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nContent-Length: 200\r\n\r\n")
        start = time.monotonic()
        try:
            for char in b'{"prompt": "':
                sock.send(bytes([char]))
                time.sleep(0.25)
        except OSError:
            pass
        data, _ = read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 408 ") and b"--request-body-timeout" in data
    assert BODY_TIMEOUT_S * 0.8 < time.monotonic() - start < BODY_TIMEOUT_S + 3


def test_a_kept_alive_connection_may_idle_longer_than_the_header_timeout(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
        first = http.post("/v1/completions", json=body)
        time.sleep(HEADER_TIMEOUT_S + 0.5)  # uvicorn's keep-alive (5 s) governs the idle time
        second = http.post("/v1/completions", json=body)
    assert first.status_code == second.status_code == 200
    assert first.headers.get("connection") != "close"


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("close", [True, False])
def test_a_body_over_the_limit_gets_413_not_a_reset(server, chunked, close):
    """Sent whole as fast as the socket takes it, then read: the client must see
    the 413 (a socket closed on unread bytes resets the connection instead)."""
    size, piece = MAX_BODY + 1024 * 1024, b"a" * 65536
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + (b"Connection: close\r\n" if close else b"")
            + (b"Transfer-Encoding: chunked\r\n\r\n" if chunked else b"Content-Length: %d\r\n\r\n" % size))
    with connect(server) as sock:
        sock.sendall(head)
        for _ in range(size // len(piece)):
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
        if chunked:
            sock.sendall(b"0\r\n\r\n")
        data, _ = read_until_closed(sock)
    status, _, rest = data.partition(b"\r\n")
    assert status == b"HTTP/1.1 413 Request Entity Too Large"
    assert b"connection: close" in rest.lower()
    assert json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]["code"] == 413


def test_the_limits_are_options_with_positive_defaults():
    config = ServerConfig()
    assert (config.request_header_timeout, config.request_body_timeout) == (10.0, 30.0)
    for name in ("request_header_timeout", "request_body_timeout"):
        for bad in (0, -1, float("inf")):
            with pytest.raises(ValueError, match=f"^{name}: "):
                ServerConfig(**{name: bad})


def test_an_answer_before_the_body_was_read_closes_the_connection():
    """A 401 or 404 leaves the body unread: uvicorn would read and drop it for as
    long as it came, so the connection closes instead (BodyLimitMiddleware is the
    outermost layer: it sees every answer)."""
    app = FastAPI()

    @app.post("/read")
    async def read(request: Request) -> dict:
        return {"size": len(await request.body())}

    app.add_middleware(BodyLimitMiddleware, max_bytes=100, timeout_s=5)

    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            return [await http.post("/read", content=b"x" * 10),
                    await http.post("/nowhere", content=b"x" * 10),
                    await http.get("/nowhere")]

    read, unread, no_body = asyncio.run(go())
    assert read.json() == {"size": 10} and read.headers.get("connection") is None
    assert unread.status_code == 404 and unread.headers["connection"] == "close"
    assert no_body.status_code == 404 and no_body.headers.get("connection") is None


def test_the_field_table_names_only_fields_with_a_reason():
    for route, table in NOT_HONOURED.items():
        for name, rule in table.items():
            assert rule.reason, (route, name)
            assert rule.neutral is ANY_VALUE or isinstance(rule.neutral, tuple)


def test_unknown_field_names_are_logged_once_each_and_boundedly(caplog, monkeypatch):
    monkeypatch.setattr(fields, "_logged_unknown", set())
    with caplog.at_level("WARNING", logger="cadence.server"):
        for _ in range(3):
            CompletionRequest(prompt="x", some_field=1)
        assert len(caplog.records) == 1 and "'some_field'" in caplog.records[0].getMessage()
        for i in range(fields.MAX_LOGGED_UNKNOWN_FIELDS * 2):
            CompletionRequest(prompt="x", **{f"field_{i}" + "y" * 1000: 1})
    assert len(fields._logged_unknown) == fields.MAX_LOGGED_UNKNOWN_FIELDS + 1
    assert len(caplog.records) == fields.MAX_LOGGED_UNKNOWN_FIELDS + 1  # the last says so
    assert "further ones are ignored" in caplog.records[-1].getMessage()
    assert max(len(r.getMessage()) for r in caplog.records) < 400


def test_the_readme_lists_every_route_the_server_serves():
    from fastapi.routing import APIRoute

    from cadence.config import EngineOptions
    from cadence.server.api import build_app
    from cadence.server.config import ServerConfig

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    section = readme.split("## The HTTP API", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`(?:GET|POST) (/[\w/]+)`", section))
    served = {route.path for route in build_app(ServerConfig(allow_runtime_lora_updating=True), EngineOptions.from_kwargs(enable_lora=True)).routes
              if isinstance(route, APIRoute) and not route.path.startswith(("/docs", "/openapi", "/redoc"))}
    assert served == listed
