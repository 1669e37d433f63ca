"""``cadence serve``, ``cadence proxy`` and ``cadence bench serve``: parsers the main CLI mounts.

    cadence serve [MODEL] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [engine options]
    cadence proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 [--port 8000]
    cadence bench serve --rate 0.5 --num-prompts 64 [--base-url http://127.0.0.1:8000]

Options are generated from ``ServerConfig`` and the engine's config classes
(help text written once, in the dataclasses). Heavy imports (FastAPI, torch)
wait until a command runs, so mounting these parsers costs nothing.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from cadence.config_cli import add_config_options, options_of
from cadence.server.config import API_KEY_ENV, ServerConfig, runtime_lora_from_env


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server (the engine core runs in its own process)",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /tokenize, "
                    "/detokenize, /health and /metrics. Listens on 127.0.0.1 unless --host says "
                    f"otherwise. With --api-key (or {API_KEY_ENV}) every route but /health (and "
                    "/metrics) needs 'Authorization: Bearer <key>'. SIGTERM drains in-flight "
                    "requests (--shutdown-timeout); the process exits 1 if the engine dies.")
    parser.add_argument("model_tag", nargs="?", metavar="MODEL",
                        help="the model, as --model takes it (vllm serve's form): cadence serve "
                             "Qwen/Qwen3-0.6B")
    add_config_options(parser, (ServerConfig,))
    add_config_options(parser)
    parser.set_defaults(func=cmd_serve)
    return parser


def add_bench_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    from cadence.server.bench import add_arguments

    parser = subparsers.add_parser(
        "serve", help="load benchmark of a running server (Poisson arrivals)",
        description="Send requests with Poisson arrivals to a running cadence (or any "
                    "OpenAI-compatible) server; report TTFT, TPOT, ITL and end-to-end latency "
                    "percentiles and throughput.")
    add_arguments(parser)
    parser.set_defaults(func=cmd_bench_serve)
    return parser


def add_proxy_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "proxy", help="one OpenAI endpoint over a prefill and a decode instance (P/D disaggregation)",
        description="Send each /v1/completions or /v1/chat/completions request to a prefill "
                    "instance (cadence serve --kv-transfer-config '{\"kv_connector\": "
                    "\"PDConnector\", \"kv_role\": \"kv_producer\", ...}') for one token, "
                    "then to a decode instance (kv_consumer) that pulls the prompt's KV and "
                    "generates; streams pass through.")
    parser.add_argument("--prefill", action="append", required=True, metavar="URL",
                        help="a prefill instance, e.g. http://127.0.0.1:8100 (repeatable)")
    parser.add_argument("--decode", action="append", required=True, metavar="URL",
                        help="a decode instance (repeatable)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--read-timeout-s", type=float, default=600.0,
                        help="longest silence of an instance mid-answer")
    parser.add_argument("--log-level", default="info")
    parser.set_defaults(func=cmd_proxy)
    return parser


def cmd_proxy(args: argparse.Namespace) -> int:
    import uvicorn

    from cadence.server.proxy import ProxyConfig, build_proxy_app

    config = ProxyConfig(tuple(url.rstrip("/") for url in args.prefill),
                         tuple(url.rstrip("/") for url in args.decode),
                         read_timeout_s=args.read_timeout_s)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    uvicorn.run(build_proxy_app(config), host=args.host, port=args.port, log_level=args.log_level)
    return 0


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The options given, and the API key from the environment when --api-key is not."""
    values = options_of(args, (ServerConfig,))
    if "api_key" not in values and os.environ.get(API_KEY_ENV):
        values["api_key"] = os.environ[API_KEY_ENV]
    if "allow_runtime_lora_updating" not in values and runtime_lora_from_env():
        values["allow_runtime_lora_updating"] = True
    return ServerConfig(**values)


def cmd_serve(args: argparse.Namespace) -> int:
    config = server_config_from_args(args)
    return run_server(config, serving_engine_options(args))  # a Hub id is fetched as the app is built


def serving_engine_options(args: argparse.Namespace):
    """The engine's options for ``cadence serve``: those given, and the
    serving defaults where none is (every core, the step-time bound and its
    burst wait)."""
    from cadence.config import EngineOptions

    engine_options = options_of(args)
    if args.model_tag is not None:
        if engine_options.get("model", args.model_tag) != args.model_tag:
            raise ValueError(f"model: named twice, {args.model_tag} and --model {engine_options['model']}")
        engine_options["model"] = args.model_tag
    engine_options.setdefault("num_threads", serving_threads())
    engine_options.setdefault("step_time_target_s", SERVING_STEP_TIME_TARGET_S)
    if engine_options["step_time_target_s"]:
        engine_options.setdefault("step_time_target_solo_steps", SERVING_STEP_TIME_SOLO_STEPS)
        engine_options.setdefault("step_time_max_wait_s", SERVING_STEP_TIME_MAX_WAIT_S)
    return EngineOptions.from_kwargs(**engine_options)


# A served stream's time per output token as the running batch grows: a step
# of one token for every running request is kept under 45 ms (22 tokens/s a
# stream), or 6 of the model's single-stream steps where that is longer, and
# later requests queue. Without a bound a 2-core CPU ran 40-64 streams at 4-8
# requests/s, each slower than llama-server's 16 slots gave. At 50 ms alone
# Gemma 3 270M (a 9 ms single-stream step, its 262k-token head) ran so few
# streams that it drained a queue no faster than llama-server; and a Poisson
# burst at 1 request/s queued past the 2 s TTFT of the serving SLO, so a
# request that waited half a second (a quarter of that) runs past the bound
# while the queue is short (BENCHMARKS.md, serve-vs-llama-server-v1).
SERVING_STEP_TIME_TARGET_S = 0.045
SERVING_STEP_TIME_SOLO_STEPS = 6.0
SERVING_STEP_TIME_MAX_WAIT_S = 0.5


def serving_threads() -> int:
    """torch threads of the engine when --num-threads is not given: every core.

    Leaving one to the HTTP front end (tokenizing, detokenizing, SSE), on the
    reasoning that the engine's OpenMP barriers would otherwise stall behind
    it, measured worse everywhere: on 2 cores, under aiperf at 1 to 64
    requests/s, an engine with both cores had the lower TTFT and TPOT at
    every rate on both the default model and Gemma 3 270M, the front end and
    the client taking 0.1-0.5 of a core beside it (BENCHMARKS.md,
    serve-vs-llama-server-v1)."""
    return os.cpu_count() or 1


def run_server(config: ServerConfig, options: Any) -> int:
    """Serve until a signal (exit code 0) or the engine's death (1; a supervisor restarts)."""
    import uvicorn

    from cadence.server.api import FLUSH_TIMEOUT_S, GracefulServer, build_app

    logging.basicConfig(level=config.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if logging.getLogger().level > logging.DEBUG:  # huggingface_hub's clients: a line per request
        for client in ("httpx", "httpx2"):
            logging.getLogger(client).setLevel(logging.WARNING)
    app = build_app(config, options)
    # The drain (GracefulServer) has answered every request before uvicorn's own
    # shutdown starts: its timeout only bounds closing idle connections.
    server = GracefulServer(uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level,
        access_log=config.access_log, lifespan="on",
        timeout_graceful_shutdown=int(FLUSH_TIMEOUT_S)), app.state.cadence)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises a third Ctrl-C after its forced shutdown
        pass
    return server.exit_code if server.started else 1


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from cadence.server.bench import main_from_args

    return main_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    """A stand-alone parser (``python -m cadence.server``) with the same commands."""
    parser = argparse.ArgumentParser(prog="python -m cadence.server")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    add_proxy_parser(sub)
    bench = sub.add_parser("bench", help="benchmarks")
    add_bench_serve_parser(bench.add_subparsers(dest="bench_command", required=True))
    return parser
