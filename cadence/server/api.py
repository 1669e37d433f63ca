"""The FastAPI app: routes, and the engine's life cycle inside the app's.

    build_app(server_config, engine_options) -> FastAPI
    GracefulServer(uvicorn_config, app.state.cadence).run(); .exit_code

At start-up the app starts its ``AsyncLLM``, which spawns the engine-core
process and waits for its handshake; uvicorn starts listening only then. At
shutdown it stops the ``AsyncLLM`` and with it the engine process.

Stopping, by ``GracefulServer``:

    SIGTERM / Ctrl-C ──► drain: new requests 503, in flight get --shutdown-timeout s
                            │ (a second signal cuts it short)
                            ▼
                         the rest end with an error (JSON, or SSE error + [DONE])
                            ▼
                         uvicorn's shutdown, the engine stops          exit 0
    engine process dies ──► its requests fail at once; drain; exit 1 (a supervisor restarts)
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from cadence.config import EngineOptions
from cadence.engine.dp_client import make_async_llm
from cadence.models.default_model import model_name_of
from cadence.models.hub import resolve_model_options
from cadence.server.adapters import ServedModels
from cadence.server.config import ServerConfig, parse_lora_modules, read_chat_template
from cadence.server.embeddings import EmbeddingRequest, EmbeddingServing
from cadence.server.errors import error_response, install_error_handlers
from cadence.server.messages import add_messages_routes
from cadence.server.metrics import CONTENT_TYPE, PrometheusStatLogger
from cadence.server.middleware import (
    ApiKeyMiddleware, BodyLimitMiddleware, GateMiddleware, RequestGate, header_timeout_protocol,
)
from cadence.server.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, LoadLoRAAdapterRequest,
    TokenizeRequest, UnloadLoRAAdapterRequest,
)
from cadence.server.responses import add_responses_routes
from cadence.server.serving import OpenAIServing

logger = logging.getLogger("cadence.server")
# How long the answers of failed requests get to go out before the server stops anyway.
FLUSH_TIMEOUT_S = 5.0


class ServerState:
    """What the routes share: the engine client, the metrics, the model's name, the gate."""

    def __init__(self, config: ServerConfig, options: EngineOptions) -> None:
        self.lora_modules = lora_modules_of(config, options)  # checked before anything starts
        self.config = config
        # The model as the user named it (a Hub id stays one); its files are fetched here, once,
        # before the engine starts: the engine and the tokenizer get their local path.
        self.model_name = config.served_model_name or model_name_of(options.engine.model)
        model_root = options.engine.model or self.model_name
        self.options = options = resolve_model_options(options)
        self.metrics = PrometheusStatLogger(self.model_name)
        self.llm = make_async_llm(options, stat_logger=self.metrics,
                                  max_num_queued_requests=config.max_num_queued_requests)
        self.serving = OpenAIServing(self.llm, self.model_name, max_n=config.max_n,
                                     tool_call_parser=config.tool_call_parser,
                                     reasoning_parser=config.reasoning_parser,
                                     thinking_token_budget=config.thinking_token_budget,
                                     chat_template=read_chat_template(config.chat_template))
        self.gate = RequestGate()
        self.created = int(time.time())
        self.models = ServedModels(self.llm, self.model_name, model_root)

    async def start(self) -> None:
        await self.llm.start(self.options, self.model_name)
        for name, path in self.lora_modules:  # a bad adapter stops the start, saying why
            await self.models.load(name, path)

    async def stop(self) -> None:
        await self.llm.shutdown()

    async def drain(self, reason: str, timeout_s: float, cut: Callable[[], bool]) -> None:
        """Refuse new requests (503, ``reason``); give those in flight ``timeout_s`` to
        finish (less once ``cut()``), then end the rest with an error and let it go out."""
        self.gate.close(reason)
        if await self.gate.wait_idle(timeout_s, cut):
            return
        num_left = self.gate.num_in_flight
        self.llm.abort_all(f"{reason}: the request was still running when the drain ended")
        logger.warning("cadence: ended %d requests still in flight with an error", num_left)
        if not await self.gate.wait_idle(FLUSH_TIMEOUT_S):
            logger.warning("cadence: %d requests had not answered %g s later; stopping anyway",
                           self.gate.num_in_flight, FLUSH_TIMEOUT_S)

    def check_model(self, model: str | None) -> None:
        """404 unless ``model`` is absent, the base model or a served adapter."""
        self.models.resolve(model)


def lora_modules_of(config: ServerConfig, options: EngineOptions) -> list[tuple[str, str]]:
    """(name, path) of --lora-modules; ValueError if adapters are asked of an engine
    without LoRA, or LoRA is on with no way to serve an adapter."""
    modules = parse_lora_modules(config.lora_modules)
    if (modules or config.allow_runtime_lora_updating) and options.lora is None:
        name = "lora_modules" if modules else "allow_runtime_lora_updating"
        raise ValueError(f"{name}: serving LoRA adapters needs --enable-lora")
    if options.lora is not None and not modules and not config.allow_runtime_lora_updating:
        raise ValueError("enable_lora: no request could name an adapter: give --lora-modules "
                         "name=path, or --allow-runtime-lora-updating to load them at run time")
    return modules


def build_app(config: ServerConfig, options: EngineOptions) -> FastAPI:
    state = ServerState(config, options)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            await state.start()
        except BaseException:
            await state.stop()
            raise
        print(banner(state), file=sys.stderr, flush=True)
        yield
        await state.stop()

    app = FastAPI(title="cadence", lifespan=lifespan)
    app.state.cadence = state
    install_error_handlers(app)
    # The last added runs first: the body's size and time (it sees every answer),
    # the gate, then the key.
    if config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key,
                           protect_metrics=config.metrics_require_api_key)
    app.add_middleware(GateMiddleware, gate=state.gate)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_body_bytes,
                       timeout_s=config.request_body_timeout)
    llm, serving = state.llm, state.serving

    @app.get("/health")
    async def health() -> Response:
        if not llm.is_alive:
            return error_response(503, "the engine process is not running")
        replica_health = getattr(llm, "replica_health", None)
        if replica_health is not None:  # data parallel: 200 while one replica serves
            return JSONResponse({"replicas": replica_health()})
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        cards = state.models.cards(state.created, llm.info.max_model_len if llm.info else None)
        return JSONResponse({"object": "list", "data": cards})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        return await serving.completions(body, raw, state.models.resolve(body.model))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await serving.chat(body, raw, state.models.resolve(body.model))

    embedder = EmbeddingServing(llm, state.model_name)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, raw: Request):
        return await embedder.embeddings(body, raw, state.models.resolve(body.model))

    add_responses_routes(app, serving, state.models.resolve)  # /v1/responses
    add_messages_routes(app, serving, state.models.resolve)  # /v1/messages (Anthropic's)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        state.check_model(body.model)
        return JSONResponse(await serving.tokenize(body))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        state.check_model(body.model)
        tokenizer = llm.tokenizer
        assert tokenizer is not None
        vocab_size = tokenizer.vocab_size
        if not all(0 <= t < vocab_size for t in body.tokens):
            raise ValueError(f"tokens: every id must be in [0, {vocab_size})")
        return JSONResponse({"prompt": tokenizer.decode(body.tokens)})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> JSONResponse:
        """Forget cached prefix blocks (for benchmarks); false while blocks are in use."""
        return JSONResponse({"reset": bool(await llm.call_utility("reset_prefix_cache"))})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    if config.allow_runtime_lora_updating:
        add_lora_routes(app, state.models)
    return app


def add_lora_routes(app: FastAPI, models: ServedModels) -> None:
    """vLLM's runtime adapter endpoints; a bad adapter is a 400 and the server goes on."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        await models.load(body.lora_name, body.lora_path)
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.",
                        media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        await models.unload(body.lora_name)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.",
                        media_type="text/plain")


class GracefulServer(uvicorn.Server):
    """uvicorn's server, stopping as the module docstring draws.

    The first SIGTERM or Ctrl-C drains (new requests get 503, those in flight
    get --shutdown-timeout seconds, then an error); a second cuts the drain
    short; a third is uvicorn's own exit. When the engine process dies, its
    requests have failed already: the server lets their errors go out and
    stops with ``exit_code`` 1, so that a supervisor restarts it (as vLLM does).

    Its connections speak uvicorn's HTTP/1.1 protocol with a deadline on each
    request's headers (--request-header-timeout; ``middleware.py``).
    """

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        config.http = header_timeout_protocol(state.config.request_header_timeout)
        super().__init__(config)
        self.state = state
        self.exit_code = 0
        self._num_signals = 0
        self._drain: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        # A signal handler runs between any two bytecodes: it only counts; on_tick acts.
        self._num_signals += 1
        if self._num_signals > 2:
            super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's main loop calls this every 0.1 s; True stops the server."""
        if self._drain is None:
            self._drain = self._start_drain()
        if self._drain is not None and self._drain.done():
            if self.exit_code == 0 and not self.state.llm.engine_process_running:
                # It died during a signal's drain: still a crash, for the supervisor.
                self.exit_code = 1
                logger.error("cadence: the engine died while the server was draining: "
                             "exit code 1")
            return True
        return await super().on_tick(counter)

    def _start_drain(self) -> asyncio.Task | None:
        state, num_signals = self.state, self._num_signals
        if num_signals:
            reason, timeout_s = "the server is shutting down", state.config.shutdown_timeout
            logger.info("cadence: shutting down: %d requests in flight get up to %g s to finish, "
                        "new ones get 503 (signal again to end them now)",
                        state.gate.num_in_flight, timeout_s)
        elif not state.llm.is_alive:
            # Its requests failed already: the drain only lets their errors go out.
            reason, timeout_s = "the engine process is not running", FLUSH_TIMEOUT_S
            self.exit_code = 1
            logger.error("cadence: the engine is gone: stopping the server with exit code 1, so "
                         "that a supervisor restarts it")
        else:
            return None
        cut = lambda: self._num_signals > num_signals  # noqa: E731 - a signal since the start
        return asyncio.create_task(state.drain(reason, timeout_s, cut), name="cadence-drain")


def banner(state: ServerState) -> str:
    host = state.config.host
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)
    url = f"http://{shown}:{state.config.port}"
    body = json.dumps({"model": state.model_name,
                       "messages": [{"role": "user", "content": "Why is the sky blue?"}],
                       "max_tokens": 64})
    threads = state.options.engine.num_threads or "torch's default"
    auth = " -H 'Authorization: Bearer <your --api-key>'" if state.config.api_key else ""
    replicas = getattr(state.llm, "replicas", None)
    if replicas is not None:
        where = (f"{len(replicas)} engine-core replicas ({state.llm.backend}: "
                 f"{', '.join(str(replica.process.pid) for replica in replicas)})")
    else:
        where = f"engine core in process {state.llm.process.pid}"
    return (f"cadence: {where} ({threads} threads, "
            f"max_model_len {state.llm.info.max_model_len})\n"
            f"cadence: serving {state.model_name} at {url}/v1 (OpenAI API; /health, /metrics)\n"
            f"  try: curl {url}/v1/chat/completions{auth} -H 'Content-Type: application/json' "
            f"-d '{body}'")
