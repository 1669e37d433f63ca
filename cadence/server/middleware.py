"""Pure ASGI layers in front of the routes, outermost first:

    BodyLimitMiddleware  a body over --max-request-body-bytes gets 413 while it arrives, one
                         slower than --request-body-timeout 408
    GateMiddleware       counts the requests in flight; while the server drains, new ones get 503
    ApiKeyMiddleware     with --api-key: no ``Authorization: Bearer <key>`` (or X-Api-Key), 401

They are plain ASGI (no ``BaseHTTPMiddleware``): a refused request costs a
header check, a streamed response passes through untouched, and a body is
counted chunk by chunk as the route reads it, never buffered here. Their
errors have OpenAI's shape (``cadence.server.errors``).

Below them, ``header_timeout_protocol`` gives uvicorn's HTTP protocol a
deadline on each request's headers (--request-header-timeout).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any, Callable

import h11
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

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
    """Every route but the open ones needs ``Authorization: Bearer <api_key>``
    (or ``X-Api-Key: <api_key>``, the header Anthropic's clients send).

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
        body = (anthropic_invalid_api_key_body() if scope["path"].startswith("/v1/messages")
                else invalid_api_key_body())
        await _answer(scope, receive, send, 401, body, headers={"WWW-Authenticate": "Bearer"})

    def _allowed(self, scope: Scope) -> bool:
        scheme, _, token = (_header(scope, b"authorization") or b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected):
            return True
        key = _header(scope, b"x-api-key")
        return key is not None and hmac.compare_digest(key.strip(), self.expected)


def anthropic_invalid_api_key_body() -> dict[str, Any]:
    """The same refusal in Anthropic's shape, for /v1/messages."""
    return {"type": "error", "error": {
        "type": "authentication_error",
        "message": "Incorrect or missing API key: send 'X-Api-Key: <key>' (or 'Authorization: "
                   "Bearer <key>') with the key the server was started with (--api-key)."}}


def invalid_api_key_body() -> dict[str, Any]:
    """OpenAI's answer to a wrong or missing key."""
    body = error_body(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>' "
                           "with the key the server was started with (--api-key).")
    body["error"].update(type="invalid_request_error", code="invalid_api_key")
    return body


# ---------------------------------------------------------------- body size and time


class BodyRefused(Exception):
    """Raised from ``receive`` once a body passes the size limit or its deadline."""


class _GuardedReceive:
    """The route's ``receive``: counts the body's bytes against ``max_bytes`` and
    bounds the time until its last byte; after that it is the plain ``receive``
    (a disconnect watcher may wait on it for as long as the answer takes)."""

    def __init__(self, receive: Receive, max_bytes: int, timeout_s: float | None) -> None:
        self.receive = receive
        self.max_bytes = max_bytes
        loop = asyncio.get_running_loop()
        self.deadline = None if timeout_s is None else loop.time() + timeout_s
        self.num_received = 0
        self.done = False
        self.refusal: int | None = None  # 413 or 408, once refused

    async def __call__(self) -> Message:
        if self.done:
            return await self.receive()
        if self.deadline is None:
            message = await self.receive()
        else:
            left_s = max(0.0, self.deadline - asyncio.get_running_loop().time())
            try:
                message = await asyncio.wait_for(self.receive(), left_s)
            except asyncio.TimeoutError:
                self.refusal = 408
                raise BodyRefused() from None
        if message["type"] != "http.request":  # the client went away
            self.done = True
            return message
        self.num_received += len(message.get("body", b""))
        if self.num_received > self.max_bytes:
            self.refusal = 413
            raise BodyRefused()
        self.done = not message.get("more_body", False)
        return message


class BodyLimitMiddleware:
    """A body over ``max_bytes`` gets 413: at once when Content-Length says so,
    else as soon as the chunks read so far pass the limit; the route never
    holds more than ``max_bytes`` of a body. A body still arriving
    ``timeout_s`` after its headers gets 408.

    An answer that goes out before the body was read (a 401, a 404, a 503
    while draining) closes the connection too: uvicorn would otherwise read
    and drop the rest of that body for as long as it kept coming, with no
    deadline. This layer is the outermost, so every answer passes it.

    A 413 or 408 closes the connection. Before a 413 closes it, the rest of
    the body is read and dropped for up to ``LINGER_S`` (nginx's lingering
    close): a socket closed with unread bytes sends the client a reset, which
    may reach it before the 413 does (a chunked upload got a reset, not the
    413). A 408 goes to a client too slow to be worth waiting for.
    """

    LINGER_S = 3.0

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        guarded = _GuardedReceive(receive, self.max_bytes, self.timeout_s)
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            guarded.refusal = 413
            return await self._refuse(guarded, send)
        response_started = False
        has_body = bool(declared) or _header(scope, b"transfer-encoding") is not None

        async def guarded_send(message: Message) -> None:
            nonlocal response_started
            if guarded.refusal is not None:  # the route's answer to its failed read: ours goes out
                return
            if not response_started and has_body and not guarded.done:
                message = _closing(message)
            response_started = True
            await send(message)

        try:
            await self.app(scope, guarded, guarded_send)
        except Exception:
            if guarded.refusal is None:
                raise
        if guarded.refusal is not None and not response_started:
            await self._refuse(guarded, send)

    async def _refuse(self, guarded: _GuardedReceive, send: Send) -> None:
        status = guarded.refusal
        assert status is not None
        if status == 413:
            message = (f"the request body is larger than {self.max_bytes} bytes "
                       "(--max-request-body-bytes)")
        else:
            message = (f"the request body did not arrive within {self.timeout_s:g} s of its "
                       "headers (--request-body-timeout)")
        response = JSONResponse(error_body(status, message), status_code=status,
                                headers={"Connection": "close"})
        await send({"type": "http.response.start", "status": status,
                    "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body, "more_body": True})
        if status == 413:
            await _drain(guarded, self.LINGER_S)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _drain(guarded: _GuardedReceive, timeout_s: float) -> None:
    """Read and drop the rest of a refused body, for at most ``timeout_s``."""

    async def read_to_end() -> None:
        while not guarded.done:
            message = await guarded.receive()
            guarded.done = message["type"] != "http.request" or not message.get("more_body")

    try:
        await asyncio.wait_for(read_to_end(), timeout_s)
    except asyncio.TimeoutError:
        pass


def _closing(start: Message) -> Message:
    """A response start that closes the connection after the response."""
    headers = list(start.get("headers", ()))
    if any(key.lower() == b"connection" for key, _ in headers):
        return start
    return {**start, "headers": headers + [(b"connection", b"close")]}


def _content_length(scope: Scope) -> int | None:
    value = _header(scope, b"content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


# ---------------------------------------------------------------- header time


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol (h11) with a deadline on each request's headers.

    uvicorn bounds only the idle time between requests (``timeout_keep_alive``),
    and only after a first response: a connection that opens and sends
    nothing, or trickles its headers a byte a second, was held for as long as
    it liked. Here a request's headers must be whole ``header_timeout_s``
    after the connection opened, or after the request's first byte on a
    kept-alive connection. Past that the connection closes, with a 408 if a
    request had begun. The body's time is ``BodyLimitMiddleware``'s.
    """

    header_timeout_s = 10.0

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # waiting for (the rest of) the headers
            self._arm_header_timer()
        else:
            self._cancel_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        if self.conn.trailing_data[0]:  # part of a request came: say why it ends
            self.transport.write(_timeout_response(self.header_timeout_s))
        self.transport.close()


def header_timeout_protocol(timeout_s: float) -> type[HeaderTimeoutProtocol]:
    """The protocol class for ``uvicorn.Config(http=...)``, with this deadline."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": timeout_s})


def _timeout_response(timeout_s: float) -> bytes:
    payload = json.dumps(error_body(408, f"the request headers did not arrive within "
                                         f"{timeout_s:g} s (--request-header-timeout)")).encode()
    head = ("HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n")
    return head.encode() + payload
