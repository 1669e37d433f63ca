"""The FastAPI app: routes, and the engine's life cycle inside the app's.

    build_app(server_config, engine_options) -> FastAPI

At start-up the app spawns the engine-core process, loads the tokenizer
alone (the weights live in the engine process) and waits for the engine's
handshake; uvicorn starts listening only then. At shutdown it stops the
engine process.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from cadence.config import EngineOptions
from cadence.engine.async_llm import AsyncLLM, load_tokenizer
from cadence.server.config import ServerConfig
from cadence.server.engine_process import model_name_of, start_engine_process
from cadence.server.errors import ModelNotFound, error_response, install_error_handlers
from cadence.server.metrics import CONTENT_TYPE, PrometheusStatLogger
from cadence.server.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
)
from cadence.server.serving import OpenAIServing


class ServerState:
    """What the routes share: the engine client, the metrics, the model's name."""

    def __init__(self, config: ServerConfig, options: EngineOptions) -> None:
        self.config = config
        self.options = options
        self.model_name = config.served_model_name or model_name_of(options.engine.model)
        self.metrics = PrometheusStatLogger(self.model_name)
        self.llm = AsyncLLM(stat_logger=self.metrics,
                            max_num_queued_requests=config.max_num_queued_requests)
        self.serving = OpenAIServing(self.llm, self.model_name)
        self.created = int(time.time())

    async def start(self) -> None:
        process = start_engine_process(self.options, self.llm.input_address,
                                       self.llm.output_address, self.model_name)
        tokenizer = await asyncio.to_thread(load_tokenizer, self.options.engine.model)
        await self.llm.attach(process, tokenizer)

    async def stop(self) -> None:
        await self.llm.shutdown()

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ModelNotFound(model)


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
    llm, serving = state.llm, state.serving

    @app.get("/health")
    async def health() -> Response:
        if not llm.is_alive:
            return error_response(503, "the engine process is not running")
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = {"id": state.model_name, "object": "model", "created": state.created,
                "owned_by": "cadence", "root": options.engine.model or state.model_name,
                "max_model_len": llm.info.max_model_len if llm.info else None}
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        state.check_model(body.model)
        return await serving.completions(body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        state.check_model(body.model)
        return await serving.chat(body, raw)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        state.check_model(body.model)
        tokenizer = llm.tokenizer
        assert tokenizer is not None and llm.info is not None
        if (body.prompt is None) == (body.messages is None):
            raise ValueError("prompt: give exactly one of prompt and messages")
        if body.messages is not None:
            text = tokenizer.apply_chat_template(
                [m.as_template_input() for m in body.messages],
                add_generation_prompt=body.add_generation_prompt)
            tokens = tokenizer.encode(text, add_special_tokens=False)
        else:
            tokens = tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)
        return JSONResponse({"count": len(tokens), "max_model_len": llm.info.max_model_len,
                             "tokens": tokens})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        state.check_model(body.model)
        tokenizer = llm.tokenizer
        assert tokenizer is not None
        if not all(0 <= t < tokenizer.vocab_size for t in body.tokens):
            raise ValueError(f"tokens: every id must be in [0, {tokenizer.vocab_size})")
        return JSONResponse({"prompt": tokenizer.decode(body.tokens)})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> JSONResponse:
        """Forget cached prefix blocks (for benchmarks); false while blocks are in use."""
        return JSONResponse({"reset": bool(await llm.call_utility("reset_prefix_cache"))})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    return app


def banner(state: ServerState) -> str:
    host = state.config.host
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)
    url = f"http://{shown}:{state.config.port}"
    body = json.dumps({"model": state.model_name,
                       "messages": [{"role": "user", "content": "Why is the sky blue?"}],
                       "max_tokens": 64})
    threads = state.options.engine.num_threads or "torch's default"
    return (f"cadence: engine core in process {state.llm.process.pid} ({threads} threads, "
            f"max_model_len {state.llm.info.max_model_len})\n"
            f"cadence: serving {state.model_name} at {url}/v1 (OpenAI API; /health, /metrics)\n"
            f"  try: curl {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'")
