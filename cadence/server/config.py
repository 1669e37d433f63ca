"""The server's own options (the engine's are ``cadence.config``); the CLI is generated from them."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from cadence.config import _require, option

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
TOOL_CALL_PARSERS = ("hermes",)  # cadence.server.tool_calls.AUTO_TOOL_PARSERS
REASONING_PARSERS = ("qwen3", "deepseek_r1")  # cadence.server.reasoning.REASONING_PARSERS
API_KEY_ENV = "CADENCE_API_KEY"
# vLLM's switch for the runtime adapter endpoints, honoured too.
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP front end."""

    host: str = option("127.0.0.1", "Address to listen on (0.0.0.0: every interface).")
    port: int = option(8000, "TCP port to listen on.")
    served_model_name: str | None = option(
        None, "Model name in the API (default: the model file's name, SmolLM2-135M-Instruct "
              "for the embedded model).")
    max_num_queued_requests: int = option(
        1024, "Sequences that may wait for a running slot beyond --max-num-seqs; "
              "further requests get HTTP 429.")
    # 16: each of n samples costs a full generation; n 1000 held the engine for 83 s.
    max_n: int = option(16, "Most completions (n) one request may ask for; more get HTTP 400.")
    tool_call_parser: str = option(
        "hermes", "How tool calls are read from the model's text under tool_choice \"auto\": "
                  "hermes (<tool_call>{json}</tool_call>, the format of Hermes, Qwen and "
                  "SmolLM-style templates).")
    reasoning_parser: str | None = option(
        None, "Split the model's thinking from its answer into the message's reasoning "
              "(and reasoning_content) field: qwen3 (<think>...</think>, as Qwen3 and SmolLM3 "
              "write it) or deepseek_r1 (the same tags, the output starting inside the "
              "thinking). Default: no split.")
    thinking_token_budget: int | None = option(
        None, "Thinking tokens a chat request may spend before the engine makes the model "
              "close its thinking and answer (a request's thinking_token_budget overrides it). "
              "Needs --reasoning-parser. Default: no limit.")
    chat_template: str | None = option(
        None, "A Jinja chat template (its file's path, or the template itself) used in place "
              "of the model's own.")
    access_log: bool = option(False, "Log every HTTP request.")
    log_level: str = option("info", "Server log level: critical, error, warning, info, debug.")
    # Not option(): repr=False keeps the key out of logs and tracebacks.
    api_key: str | None = field(default=None, repr=False, metadata={"help": (
        "Require 'Authorization: Bearer <key>' on /v1/* and the admin routes (/tokenize, "
        "/detokenize, /reset_prefix_cache, /docs); others get HTTP 401. Also read from the "
        f"{API_KEY_ENV} environment variable. /health stays open.")})
    metrics_require_api_key: bool = option(
        False, "With --api-key, protect /metrics too (default: open, for Prometheus scrapers).")
    # 8 MiB: a prompt of a million token ids as JSON (~7 bytes each), or ~2M tokens of
    # English text, far beyond any context served here, yet small enough that a body is
    # never a memory or event-loop hazard (a 20 MB prompt froze the server for 37 s).
    max_request_body_bytes: int = option(
        8 * 1024 * 1024, "Largest request body in bytes; a larger one gets HTTP 413 as soon as "
                         "its Content-Length or its bytes so far pass the limit.")
    # 10 s: headers are a few hundred bytes. uvicorn alone bounds only the idle time
    # between requests, so 200 connections trickling a byte a second were all held.
    request_header_timeout: float = option(
        10.0, "Seconds a client has to send a request's headers, from the connection's "
              "opening (or the request's first byte on a kept-alive connection); then the "
              "connection closes, with HTTP 408 if a request had begun.")
    # 30 s: the largest body (--max-request-body-bytes, 8 MiB) at 280 KB/s.
    request_body_timeout: float = option(
        30.0, "Seconds a request's body may take to arrive after its headers; a slower one "
              "gets HTTP 408 and the connection closes.")
    # 15 s: the drain and the engine's stop (at most 10 s more) fit in Kubernetes'
    # default 30 s grace period. vLLM's --shutdown-timeout defaults to 0 (abort at once).
    shutdown_timeout: float = option(
        15.0, "Seconds that requests in flight get to finish after SIGTERM or Ctrl-C (new "
              "requests get 503 meanwhile); those still running then end with an error. A "
              "second signal ends them at once.")

    lora_modules: tuple[str, ...] = option(
        (), "LoRA adapters served from the start, as name=path (PEFT folders) or JSON "
            "'{\"name\": ..., \"path\": ...}'; several after one flag or the flag repeated. "
            "A request picks one by its model field. Needs --enable-lora.")
    allow_runtime_lora_updating: bool = option(
        False, "Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (else 404). "
               f"Also set by {RUNTIME_LORA_ENV}=true.")

    def __post_init__(self) -> None:
        parse_lora_modules(self.lora_modules)
        _require(0 <= self.port < 65536, "port", "must be in [0, 65536)")
        _require(self.max_num_queued_requests >= 0, "max_num_queued_requests", "must be >= 0")
        _require(self.tool_call_parser in TOOL_CALL_PARSERS, "tool_call_parser",
                 f"must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}")
        _require(self.log_level in LOG_LEVELS, "log_level", f"must be one of {LOG_LEVELS}")
        _require(self.reasoning_parser in (None, *REASONING_PARSERS), "reasoning_parser",
                 f"must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}")
        _require(self.thinking_token_budget is None or self.thinking_token_budget >= 0,
                 "thinking_token_budget", "must be >= 0")
        _require(self.thinking_token_budget is None or self.reasoning_parser is not None,
                 "thinking_token_budget", "needs --reasoning-parser (which tags to close)")
        _require(self.api_key != "", "api_key", "must not be empty")
        _require(self.max_request_body_bytes >= 1, "max_request_body_bytes", "must be >= 1")
        _require(self.shutdown_timeout >= 0, "shutdown_timeout", "must be >= 0")
        for name in ("request_header_timeout", "request_body_timeout"):
            value = getattr(self, name)
            _require(0 < value < float("inf"), name, f"must be a positive number of seconds, "
                                                     f"got {value}")


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the value itself when it names no file."""
    if value is None or not os.path.isfile(value):
        return value
    with open(value, encoding="utf-8") as f:
        return f.read()


def parse_lora_modules(items: tuple[str, ...]) -> list[tuple[str, str]]:
    """(name, path) of each ``name=path`` or ``{"name": ..., "path": ...}``; names unique."""
    modules: list[tuple[str, str]] = []
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
            except ValueError as err:
                raise ValueError(f"lora_modules: cannot read {item!r} as JSON: {err}") from None
            name, path = (spec.get("name"), spec.get("path")) if isinstance(spec, dict) else (None, None)
        else:
            name, _, path = item.partition("=")
        if not isinstance(name, str) or not name.strip() or not isinstance(path, str) or not path:
            raise ValueError(f"lora_modules: expected name=path or JSON with name and path, "
                             f"got {item!r}")
        if any(name.strip() == known for known, _ in modules):
            raise ValueError(f"lora_modules: the name {name.strip()!r} is given twice")
        modules.append((name.strip(), path))
    return modules


def runtime_lora_from_env() -> bool:
    return os.environ.get(RUNTIME_LORA_ENV, "").strip().lower() in ("1", "true", "yes", "on")
