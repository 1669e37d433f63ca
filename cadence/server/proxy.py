"""``cadence proxy``: one OpenAI endpoint in front of a prefill and a decode instance.

    client ──► proxy ──(1) body + max_tokens=1, stream=false,
                     │     kv_transfer_params {do_remote_decode: true}──► prefill (kv_producer)
                     │  ◄── its response's kv_transfer_params (where the prompt's KV waits)
                     └─(2) body + those kv_transfer_params ──────────────► decode (kv_consumer)
               ◄──────── the decode instance's answer, streamed through as it comes

The decode instance pulls the prompt's KV from the prefill instance and
generates; the proxy never looks inside a stream. When the prefill answers
without kv_transfer_params (its first token ended the request), the decode
instance computes the prompt itself: the answer is the same.

Failures reach the client, never a hang: a refusal of either instance is
passed on with its status; an instance that cannot be reached is a 502; one
that dies mid-stream ends the stream with an error event (the ``openai``
client raises it), as ``cadence serve`` does when its engine dies.

Several ``--prefill`` / ``--decode`` URLs are taken in turn (round robin).
"""

from __future__ import annotations

import itertools
import json
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cadence.server.errors import error_body

logger = logging.getLogger("cadence.proxy")

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
# Request headers passed on to the instances (an API key, a trace id).
_FORWARDED_HEADERS = ("authorization", "x-request-id")
_SSE_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class ProxyConfig:
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    connect_timeout_s: float = 10.0
    # Longest silence of an instance mid-answer (a prompt's prefill included).
    read_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for name, urls in (("prefill", self.prefill_urls), ("decode", self.decode_urls)):
            if not urls:
                raise ValueError(f"{name}: give at least one URL of a {name} instance")
            for url in urls:
                if not url.startswith(("http://", "https://")):
                    raise ValueError(f"{name}: {url!r} is not an http(s) URL")
        for name in ("connect_timeout_s", "read_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0 seconds")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """What the prefill instance is asked: one token, no stream, KV kept for a decoder."""
    prefill = {key: value for key, value in body.items()
               if key not in ("stream_options", "min_tokens")}
    prefill.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    return prefill


def disaggregable(body: dict[str, Any]) -> bool:
    """Whether the prompt's KV can be computed elsewhere: one completion of one
    prompt (a request for several goes to the decode instance whole)."""
    if body.get("n", 1) != 1:
        return False
    prompt = body.get("prompt")
    return not (isinstance(prompt, list) and len(prompt) > 1
                and not all(isinstance(token, int) for token in prompt))


def decode_body(body: dict[str, Any], prefill_answer: dict[str, Any]) -> dict[str, Any]:
    """The client's body, with where the prefill instance keeps its KV (if it kept it)."""
    params = prefill_answer.get("kv_transfer_params")
    return {**body, "kv_transfer_params": params} if params else dict(body)


class DisaggProxy:
    """Routes each generation request to a prefill instance, then a decode instance."""

    def __init__(self, config: ProxyConfig, transport: httpx.AsyncBaseTransport | None = None
                 ) -> None:
        self.config = config
        timeout = httpx.Timeout(config.read_timeout_s, connect=config.connect_timeout_s)
        self.client = httpx.AsyncClient(timeout=timeout, transport=transport)
        self._prefill = itertools.cycle(config.prefill_urls)
        self._decode = itertools.cycle(config.decode_urls)

    async def close(self) -> None:
        await self.client.aclose()

    async def generate(self, path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "body: not valid JSON")
        if not isinstance(body, dict):
            return _error(400, "body: must be a JSON object")
        if body.get("kv_transfer_params") is not None:
            return _error(400, "kv_transfer_params: set by the proxy, not by its clients",
                          "kv_transfer_params")
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}
        if not disaggregable(body):
            return await self._decode_only(path, body, headers)
        prefill_url = next(self._prefill)
        try:
            answer = await self.client.post(prefill_url + path, json=prefill_body(body),
                                            headers=headers)
        except httpx.HTTPError as err:
            return _unreachable("prefill", prefill_url, err)
        if answer.status_code != 200:
            return _passed_on(answer)
        try:
            forward = decode_body(body, answer.json())
        except (ValueError, AttributeError):
            return _error(502, f"the prefill instance {prefill_url} answered no JSON object")
        return await self._decode_only(path, forward, headers)

    async def _decode_only(self, path: str, body: dict[str, Any], headers: dict[str, str]
                           ) -> Response:
        """``body`` answered by a decode instance (streamed if it asks)."""
        decode_url = next(self._decode)
        if body.get("stream"):
            return await self._stream(decode_url + path, body, headers)
        try:
            return _passed_on(await self.client.post(decode_url + path, json=body,
                                                     headers=headers))
        except httpx.HTTPError as err:
            return _unreachable("decode", decode_url, err)

    async def _stream(self, url: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
        """The decode instance's SSE stream, passed on chunk by chunk."""
        upstream_request = self.client.build_request("POST", url, json=body, headers=headers)
        try:
            upstream = await self.client.send(upstream_request, stream=True)
        except httpx.HTTPError as err:
            return _unreachable("decode", url, err)
        if upstream.status_code != 200:
            await upstream.aread()
            await upstream.aclose()
            return _passed_on(upstream)
        return StreamingResponse(_relay(upstream, url), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def models(self) -> Response:
        url = self.config.decode_urls[0]
        try:
            return _passed_on(await self.client.get(url + "/v1/models"))
        except httpx.HTTPError as err:
            return _unreachable("decode", url, err)

    async def health(self) -> Response:
        """200 when every instance answers its /health with 200."""
        down = []
        for url in (*self.config.prefill_urls, *self.config.decode_urls):
            try:
                ok = (await self.client.get(url + "/health", timeout=5.0)).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                down.append(url)
        if down:
            return _error(503, f"instances not healthy: {', '.join(down)}")
        return Response(status_code=200)


async def _relay(upstream: httpx.Response, url: str) -> AsyncIterator[bytes]:
    """Bytes as they come; an instance gone mid-stream ends it with an error event."""
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    except httpx.HTTPError as err:
        logger.warning("cadence proxy: the decode instance %s failed mid-stream: %r", url, err)
        message = f"the decode instance failed mid-stream ({type(err).__name__})"
        yield b"\n\ndata: " + json.dumps(error_body(502, message)).encode() + b"\n\n"
        yield _SSE_DONE
    finally:
        await upstream.aclose()


def _passed_on(answer: httpx.Response) -> Response:
    return Response(answer.content, status_code=answer.status_code,
                    media_type=answer.headers.get("content-type", "application/json"))


def _unreachable(role: str, url: str, err: httpx.HTTPError) -> Response:
    logger.warning("cadence proxy: the %s instance %s failed: %r", role, url, err)
    return _error(502, f"the {role} instance {url} failed: {type(err).__name__}: {err}")


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def _generation_route(proxy: DisaggProxy, path: str):
    async def route(request: Request) -> Response:
        return await proxy.generate(path, request)
    return route


def build_proxy_app(config: ProxyConfig, transport: httpx.AsyncBaseTransport | None = None
                    ) -> FastAPI:
    proxy = DisaggProxy(config, transport)
    app = FastAPI(title="cadence prefill/decode proxy")
    app.state.proxy = proxy
    app.router.add_event_handler("shutdown", proxy.close)

    for path in GENERATION_PATHS:
        app.add_api_route(path, _generation_route(proxy, path), methods=["POST"])
    app.add_api_route("/v1/models", proxy.models, methods=["GET"])
    app.add_api_route("/health", proxy.health, methods=["GET"])
    return app
