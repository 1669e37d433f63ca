"""Pure ASGI layers in front of the routes, outermost first:

    GateMiddleware       counts the requests in flight; while the server drains, new ones get 503
    ApiKeyMiddleware     with --api-key: no ``Authorization: Bearer <key>``, 401
    BodyLimitMiddleware  a body over --max-request-body-bytes gets 413 while it arrives

They are plain ASGI (no ``BaseHTTPMiddleware``): a refused request costs a
header check, a streamed response passes through untouched, and a body is
counted chunk by chunk as the route reads it, never buffered here. Their
errors have OpenAI's shape (``cadence.server.errors``).
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Any, Callable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cadence.server.errors import error_body

_POLL_S = 0.05


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


async def _answer(scope: Scope, receive: Receive, send: Send, status: int, body: dict[str, Any],
                  headers: dict[str, str] | None = None) -> None:
    await JSONResponse(body, status_code=status, headers=headers)(scope, receive, send)


# ---------------------------------------------------------------- drain


class RequestGate:
    """The HTTP requests in flight, and whether new ones are let in.

    A request is in flight from its first byte to the last byte of its
    response (a stream's ``[DONE]``), so ``num_in_flight == 0`` means that
    every answer has gone out.
    """

    def __init__(self) -> None:
        self.num_in_flight = 0
        self.closed_reason: str | None = None

    def close(self, reason: str) -> None:
        """From now on, every new request but /metrics gets 503 with ``reason``."""
        self.closed_reason = reason

    async def wait_idle(self, timeout_s: float, cut: Callable[[], bool] = lambda: False) -> bool:
        """True once nothing is in flight; False after ``timeout_s`` or once ``cut()``."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.num_in_flight and not cut():
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(_POLL_S)
        return self.num_in_flight == 0


class GateMiddleware:
    """Counts requests through a ``RequestGate``; refuses them once it is closed."""

    # Still answered while draining: a scraper watching the drain.
    OPEN_WHILE_DRAINING = ("/metrics",)

    def __init__(self, app: ASGIApp, gate: RequestGate) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        reason = self.gate.closed_reason
        if reason is not None and scope["path"] not in self.OPEN_WHILE_DRAINING:
            await _answer(scope, receive, send, 503, error_body(503, reason),
                          headers={"Connection": "close", "Retry-After": "1"})
            return
        self.gate.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.gate.num_in_flight -= 1


# ---------------------------------------------------------------- API key


class ApiKeyMiddleware:
    """Every route but the open ones needs ``Authorization: Bearer <api_key>``.

    Deny by default: /v1/*, /tokenize, /detokenize, /reset_prefix_cache,
    /docs, /openapi.json and any path added later are protected; /health
    (and /metrics unless ``protect_metrics``) stay open. The key is compared
    in constant time.
    """

    def __init__(self, app: ASGIApp, api_key: str, protect_metrics: bool = False) -> None:
        self.app = app
        self.expected = api_key.encode()
        self.open_paths = {"/health"} if protect_metrics else {"/health", "/metrics"}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths or self._allowed(scope):
            return await self.app(scope, receive, send)
        await _answer(scope, receive, send, 401, invalid_api_key_body(),
                      headers={"WWW-Authenticate": "Bearer"})

    def _allowed(self, scope: Scope) -> bool:
        scheme, _, token = (_header(scope, b"authorization") or b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected)


def invalid_api_key_body() -> dict[str, Any]:
    """OpenAI's answer to a wrong or missing key."""
    body = error_body(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>' "
                           "with the key the server was started with (--api-key).")
    body["error"].update(type="invalid_request_error", code="invalid_api_key")
    return body


# ---------------------------------------------------------------- body size


class BodyTooLarge(Exception):
    """Raised from ``receive`` once a body passes the limit."""


class BodyLimitMiddleware:
    """Answers 413 to a body over ``max_bytes``: at once when Content-Length says
    so, else as soon as the chunks read so far pass the limit. The route never
    holds more than ``max_bytes`` of a body; uvicorn discards the rest of it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            return await self._refuse(scope, receive, send)
        num_received = 0
        too_large = response_started = False

        async def counted_receive() -> Message:
            nonlocal num_received, too_large
            message = await receive()
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if num_received > self.max_bytes:
                    too_large = True
                    raise BodyTooLarge()
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal response_started
            if too_large:  # the route's answer to its failed read: ours is the 413
                return
            response_started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except Exception:
            if not too_large:
                raise
        if too_large and not response_started:
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = error_body(413, f"the request body is larger than {self.max_bytes} bytes "
                               "(--max-request-body-bytes)")
        body["error"]["type"] = "invalid_request_error"
        await _answer(scope, receive, send, 413, body)


def _content_length(scope: Scope) -> int | None:
    value = _header(scope, b"content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
