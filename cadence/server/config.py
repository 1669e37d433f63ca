"""The server's own options (the engine's are ``cadence.config``); the CLI is generated from them."""

from __future__ import annotations

from dataclasses import dataclass

from cadence.config import _require, option

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


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
    access_log: bool = option(False, "Log every HTTP request.")
    log_level: str = option("info", "Server log level: critical, error, warning, info, debug.")

    def __post_init__(self) -> None:
        _require(0 <= self.port < 65536, "port", "must be in [0, 65536)")
        _require(self.max_num_queued_requests >= 0, "max_num_queued_requests", "must be >= 0")
        _require(self.log_level in LOG_LEVELS, "log_level", f"must be one of {LOG_LEVELS}")
