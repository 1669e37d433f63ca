"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}``.

Every failure a request can meet maps to one status here:

    ValueError("field: ...")          400  param = field (SamplingParams, prompts)
    request validation (pydantic)     400  param = the offending field; malformed JSON too
    unknown model (or LoRA adapter)   404  param = "model" ("lora_name" for an unload)
    QueueFullError                    429
    GenerationFailed (engine died)    500  for requests that were in flight
    RequestFailed (a step failed)     500  that request only; the engine goes on
    EngineDeadError                   503  for new requests, and /health
    anything else (a bug)             500  logged; the connection stays usable

A request that names something it cannot have (n above --max-n, more tokens
than the context holds, more sequences than the server can ever admit) is a
400; only a request that would fit later gets 429.

An error quotes at most ``MAX_QUOTED_CHARS`` of anything the request sent
(``quoted``: a model name of 1 MB came back whole in a 404), and no message
or param is longer than ``MAX_MESSAGE_CHARS``, whatever built it.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cadence.engine.async_llm import EngineDeadError, QueueFullError, RequestFailed

ERROR_TYPES = {
    400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
    408: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 499: "client_closed_request", 500: "server_error",
    503: "service_unavailable",
}
_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")
logger = logging.getLogger("cadence.server")
MAX_QUOTED_CHARS = 100
MAX_MESSAGE_CHARS = 2000  # the longest message written here is ~400 characters


def quoted(text: str, limit: int = MAX_QUOTED_CHARS) -> str:
    """``text`` if it is at most ``limit`` characters, else its first ``limit``
    and an ellipsis that says how long it was: what an error echoes of a request."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


class ModelNotFound(Exception):
    """A model (or LoRA adapter) name the server does not serve: 404, ``param`` the field."""

    def __init__(self, model: str, param: str = "model", message: str | None = None) -> None:
        super().__init__(message or f"The model `{quoted(model)}` does not exist.")
        self.param = param


class GenerationFailed(RuntimeError):
    """The engine died while this request was generating."""


class ClientGone(Exception):
    """The client disconnected before its (non-streamed) answer was ready."""


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    message = utf8_safe(quoted(message, MAX_MESSAGE_CHARS))
    param = utf8_safe(quoted(param, MAX_QUOTED_CHARS)) if param is not None else None
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "error"),
                      "param": param, "code": status}}


def utf8_safe(text: str) -> str:
    """``text`` with any lone surrogate written as ``\\ud800``: an error that quotes
    the request must not fail to encode itself."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def field_of(message: str) -> str | None:
    """"temperature: must be >= 0" -> "temperature"."""
    match = _FIELD.match(message)
    return match.group(1) if match else None


def validation_error_response(err: RequestValidationError) -> JSONResponse:
    first = err.errors()[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return error_response(400, f"malformed JSON body: {detail}".rstrip(": "))
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    # Union members add their type names to the location: keep the field path.
    path = [p for p in location if not _is_type_name(p)]
    param = ".".join(path) if path else None
    message = first.get("msg", "invalid value")
    if param is None and first.get("type") == "value_error":
        # A whole-body check ("logit_bias: not supported yet"): its field leads the message.
        message = message.removeprefix("Value error, ")
        return error_response(400, message, field_of(message))
    if param is None and first.get("type") in ("model_attributes_type", "dict_type"):
        message = "the body must be a JSON object"
    return error_response(400, f"{param}: {message}" if param else message, param)


def _is_type_name(part: str) -> bool:
    return part in ("str", "int", "float", "bool", "list", "dict") or "[" in part or part.startswith(
        "function-") or part[:1].isupper()


class InternalErrorMiddleware:
    """A bug answers a JSON 500 in OpenAI's shape, and the connection stays open.

    Left to Starlette, an unhandled exception answers plain text and is raised
    again, and uvicorn then closes the keep-alive connection: the client's next
    request would fail too. An exception after the response started (a stream)
    cannot be answered any more and goes on up.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except Exception:
            if started:
                raise
            logger.exception("cadence: internal error answering %s %s", scope.get("method"),
                             scope.get("path"))
            response = error_response(500, "internal server error (details are in the server log)")
            await response(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    app.add_middleware(InternalErrorMiddleware)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, err: RequestValidationError) -> JSONResponse:
        return validation_error_response(err)

    @app.exception_handler(ValueError)
    async def _value(_: Request, err: ValueError) -> JSONResponse:
        return error_response(400, str(err), field_of(str(err)))

    @app.exception_handler(ModelNotFound)
    async def _model(_: Request, err: ModelNotFound) -> JSONResponse:
        return error_response(404, str(err), err.param)

    @app.exception_handler(QueueFullError)
    async def _queue(_: Request, err: QueueFullError) -> JSONResponse:
        response = error_response(429, str(err))
        if err.retry_after_s is not None:
            response.headers["Retry-After"] = str(max(1, round(err.retry_after_s)))
        return response

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, err: EngineDeadError) -> JSONResponse:
        return error_response(503, f"the engine is not available: {err}")

    @app.exception_handler(RequestFailed)
    async def _request_failed(_: Request, err: RequestFailed) -> JSONResponse:
        return error_response(500, f"generation failed: {err}")

    @app.exception_handler(GenerationFailed)
    async def _failed(_: Request, err: GenerationFailed) -> JSONResponse:
        return error_response(500, f"generation failed: {err}")

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, err: ClientGone) -> JSONResponse:
        return error_response(499, "the client closed the connection")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, err: StarletteHTTPException) -> JSONResponse:
        return error_response(err.status_code, str(err.detail))
