"""--api-key and the body-size limit: a real server (started with a key) driven by
the ``openai`` client and raw HTTP, and the ASGI layers alone on a tiny app."""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from fastapi import FastAPI, Request

from cadence.server.cli import add_serve_parser, server_config_from_args
from cadence.server.middleware import ApiKeyMiddleware, BodyLimitMiddleware, GateMiddleware, RequestGate

MODEL = "SmolLM2-135M-Instruct"
KEY = "sk-test-0123456789"
MiB = 1024 * 1024
# (method, path, body) of every protected route, with a body each accepts.
PROTECTED = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"model": MODEL, "max_tokens": 1,
                                      "messages": [{"role": "user", "content": "Hi"}]}),
    ("POST", "/tokenize", {"prompt": "Hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("POST", "/reset_prefix_cache", None),
    ("GET", "/docs", None),
    ("GET", "/redoc", None),
    ("GET", "/openapi.json", None),
]


@pytest.fixture(scope="module")
def server(make_server):
    server = make_server("auth", ["--api-key", KEY])
    server.api_key = KEY  # read by conftest's at-rest check (/metrics stays open here anyway)
    return server


def client_with(server, api_key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=api_key, max_retries=0,
                         timeout=60)


# ---------------------------------------------------------------- --api-key


def test_right_key_is_served_wrong_key_is_refused(server):
    client = client_with(server, KEY)
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text
    assert client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
        {"role": "user", "content": "Hi"}]).choices[0].message.content is not None
    assert [m.id for m in client.models.list()] == [MODEL]

    for wrong in ("sk-wrong", KEY[:-1], KEY + "0"):
        with pytest.raises(openai.AuthenticationError) as err:
            client_with(server, wrong).completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client_with(server, "sk-wrong").chat.completions.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])


def test_a_missing_key_gets_openais_401(server):
    response = httpx.post(f"{server.base_url}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    assert error["param"] is None and "API key" in error["message"]
    for header in (f"Basic {KEY}", KEY, "Bearer", f"Bearer  {KEY}x"):
        response = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": header},
                             timeout=30)
        assert response.status_code == 401, header


def test_every_route_but_health_and_metrics_needs_the_key(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        for method, path, body in PROTECTED:
            assert http.request(method, path, json=body).status_code == 401, path
            answer = http.request(method, path, json=body, headers={"Authorization": f"Bearer {KEY}"})
            assert answer.status_code == 200, (path, answer.text[:300])
        assert http.get("/v1/no-such-route").status_code == 401  # deny by default
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code == 200


# ---------------------------------------------------------------- body size


def front_end_rss_mib(server) -> float:
    status = Path(f"/proc/{server.process.pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]) / 1024


def test_a_20_mb_body_gets_413_and_the_server_stays_responsive(server):
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    url = f"{server.base_url}/v1/completions"
    rss_before = front_end_rss_mib(server)

    # Content-Length says 20 MB: refused before the body is read.
    body = b'{"model": "' + MODEL.encode() + b'", "prompt": "' + b"a" * (20 * MiB) + b'"}'
    response = httpx.post(url, content=body, headers=auth, timeout=60)
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "8388608 bytes" in error["message"]

    # Chunked, 20 MB at ~20 MB/s: refused once 8 MiB have arrived; /health answers meanwhile.
    def chunks():
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"a" * MiB
            time.sleep(0.05)

    answers: dict[str, httpx.Response] = {}
    upload = threading.Thread(target=lambda: answers.setdefault(
        "upload", httpx.post(url, content=chunks(), headers=auth, timeout=60)))
    upload.start()
    health_s = []
    while upload.is_alive():
        start = time.monotonic()
        assert httpx.get(f"{server.base_url}/health", timeout=1.0).status_code == 200
        health_s.append(time.monotonic() - start)
        time.sleep(0.05)
    upload.join()
    assert answers["upload"].status_code == 413
    assert health_s and max(health_s) < 1.0
    # Neither body was held whole (the 20 MB prompt once cost the front end 3 GB).
    assert front_end_rss_mib(server) - rss_before < 20

    client = client_with(server, KEY)
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text


# ---------------------------------------------------------------- the layers alone


def tiny_app(gate: RequestGate | None = None, *, max_bytes: int = 10,
             api_key: str | None = None, protect_metrics: bool = False) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"size": len(await request.body())}

    @app.get("/metrics")
    async def metrics() -> dict:
        return {}

    @app.get("/health")
    async def health() -> dict:
        return {}

    app.add_middleware(BodyLimitMiddleware, max_bytes=max_bytes)
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, protect_metrics=protect_metrics)
    if gate is not None:
        app.add_middleware(GateMiddleware, gate=gate)
    return app


def call(app: FastAPI, method: str, path: str, **kwargs) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())


def test_body_limit_is_exact_with_and_without_content_length():
    app = tiny_app(max_bytes=10)

    async def chunked(size: int):
        for _ in range(size):
            yield b"x"

    assert call(app, "POST", "/echo", content=b"x" * 10).json() == {"size": 10}
    assert call(app, "POST", "/echo", content=b"x" * 11).status_code == 413
    assert call(app, "POST", "/echo", content=chunked(10)).json() == {"size": 10}
    refused = call(app, "POST", "/echo", content=chunked(11))
    assert refused.status_code == 413 and refused.json()["error"]["code"] == 413


def test_metrics_can_require_the_key():
    open_metrics = tiny_app(api_key="k")
    assert call(open_metrics, "GET", "/metrics").status_code == 200
    closed = tiny_app(api_key="k", protect_metrics=True)
    assert call(closed, "GET", "/metrics").status_code == 401
    assert call(closed, "GET", "/metrics", headers={"Authorization": "Bearer k"}).status_code == 200
    assert call(closed, "GET", "/health").status_code == 200


def test_a_closed_gate_answers_503_but_to_metrics():
    gate = RequestGate()
    app = tiny_app(gate)
    assert call(app, "POST", "/echo", content=b"x").status_code == 200
    assert gate.num_in_flight == 0
    gate.close("the server is shutting down")
    refused = call(app, "POST", "/echo", content=b"x")
    assert refused.status_code == 503 and refused.json()["error"]["message"] == "the server is shutting down"
    assert call(app, "GET", "/metrics").status_code == 200


def test_api_key_from_the_environment(monkeypatch):
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    monkeypatch.setenv("CADENCE_API_KEY", "from-env")
    config = server_config_from_args(parser.parse_args(["serve"]))
    assert config.api_key == "from-env" and "from-env" not in repr(config)
    assert server_config_from_args(parser.parse_args(["serve", "--api-key", "flag"])).api_key == "flag"
    monkeypatch.delenv("CADENCE_API_KEY")
    assert server_config_from_args(parser.parse_args(["serve"])).api_key is None


def test_anthropics_x_api_key_header_is_accepted_and_its_401_is_anthropics(server):
    """Anthropic's clients send the key as X-Api-Key; a refusal on /v1/messages
    comes in Anthropic's error shape (the client raises AuthenticationError)."""
    import anthropic

    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    served = httpx.post(f"{server.base_url}/v1/messages", json=body, headers={"X-Api-Key": KEY},
                        timeout=60)
    assert served.status_code == 200, served.text
    assert httpx.get(f"{server.base_url}/v1/models", headers={"X-Api-Key": KEY}, timeout=30).status_code == 200
    refused = httpx.post(f"{server.base_url}/v1/messages", json=body, headers={"X-Api-Key": "sk-wrong"},
                         timeout=30)
    assert refused.status_code == 401
    assert refused.json()["type"] == "error" and refused.json()["error"]["type"] == "authentication_error"
    client = anthropic.Anthropic(base_url=server.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        client.messages.create(**body)
    assert anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0) \
        .messages.create(**body).content
