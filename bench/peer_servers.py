"""The two servers of ``serve_vs_llama_server.py`` as processes: the command
line of each configuration, start on a free localhost port pinned to the
given cores, wait until it answers, warm it up, stop it.

A configuration is a name and the extra arguments it adds to the server's
plain command (``cadence serve MODEL`` / ``llama-server -m MODEL``); its
"defaults" adds nothing but what a chat endpoint needs to exist (a chat
template where the GGUF has none, the same file for both servers).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0
# Unrelated to the workload's prompts, so nothing it caches is reused later.
WARMUP_MESSAGE = "Count from one to twenty in words."
WARMUP_TOKENS = 16


@dataclass(frozen=True)
class ServerConfig:
    """One server in one configuration: ``kind`` is "cadence" or "llama-server"."""

    name: str
    kind: str
    extra_args: tuple[str, ...] = ()


def server_configs(num_cores: int) -> dict[str, ServerConfig]:
    """Each server in its defaults and in its best configuration for ``num_cores``.

    cadence's best: every core for the engine (issue 37 measured 2 engine
    threads ahead of the default 1 on 2 cores). llama-server's: every core for
    prefill and decode, 16 slots of continuous batching (its default), each
    slot 2,048 tokens of context (enough for the shared-system-prompt mix);
    its prompt cache is on by default.
    """
    slots, per_slot = 16, 2048
    cores = str(num_cores)
    return {
        "cadence-defaults": ServerConfig("cadence defaults", "cadence"),
        "cadence-best": ServerConfig(f"cadence --num-threads {cores}", "cadence",
                                     ("--num-threads", cores)),
        "llama-defaults": ServerConfig("llama-server defaults", "llama-server"),
        "llama-best": ServerConfig(f"llama-server -t {cores} -np {slots}", "llama-server",
                                   ("-t", cores, "-tb", cores, "-np", str(slots),
                                    "-c", str(slots * per_slot), "--cont-batching")),
    }


def config_named(name: str, configs: dict[str, ServerConfig]) -> ServerConfig:
    """A configuration of ``server_configs``, or ``cadence:ARGS``: cadence's defaults
    with ARGS (space-separated options, e.g. ``cadence:--max-num-seqs 16``) added."""
    if name in configs:
        return configs[name]
    kind, _, args = name.partition(":")
    if kind != "cadence" or not args.strip():
        raise ValueError(f"--servers: {name!r} is neither one of {sorted(configs)} nor cadence:ARGS")
    return ServerConfig(f"cadence {args.strip()}", "cadence", tuple(args.split()))


def cadence_argv(model: Path, port: int, config: ServerConfig, chat_template: Path | None) -> list[str]:
    """``cadence serve`` from this checkout (``python -m cadence.server serve``)."""
    argv = [sys.executable, "-m", "cadence.server", "serve", str(model), "--host", "127.0.0.1",
            "--port", str(port)]
    if chat_template is not None:
        argv += ["--chat-template", str(chat_template)]
    return argv + list(config.extra_args)


def llama_server_argv(binary: Path, model: Path, port: int, config: ServerConfig,
                      chat_template: Path | None) -> list[str]:
    argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    if chat_template is not None:
        argv += ["--jinja", "--chat-template-file", str(chat_template)]
    return argv + list(config.extra_args)


class CpuMeter:
    """Cores busy while a measurement runs: the server's (every process of its
    session), the load client's (this process's waited-for children: run the
    client with subprocess.run inside the window) and everything else's. On a
    small CPU the client's share is part of the result, and the others' says
    whether the machine was quiet."""

    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid
        self.start = self._sample()

    def read(self) -> dict[str, float]:
        end = self._sample()
        wall, machine, server, client = (b - a for a, b in zip(self.start, end))
        return {"wall_s": wall, "server_cores": server / wall, "client_cores": client / wall,
                "other_cores": max(0.0, machine - server - client) / wall}

    def _sample(self) -> tuple[float, float, float, float]:
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return (time.monotonic(), machine_busy_seconds(), session_cpu_seconds(self.server_pid),
                children.ru_utime + children.ru_stime)


def machine_busy_seconds() -> float:
    """CPU seconds every core of the machine has been busy (all but idle and iowait)."""
    with open("/proc/stat") as stat:
        ticks = [int(x) for x in stat.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def session_cpu_seconds(session_id: int) -> float:
    """User + system CPU seconds of the live processes of one session."""
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[3]) == session_id:  # fields from "state": session is the 4th, utime the 12th
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    """A localhost port nothing listens on now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RunningServer:
    """A server process in its own session (so it and its children stop together),
    its output in ``log_path``; use as a context manager."""

    def __init__(self, argv: list[str], port: int, log_path: Path, cores: list[int],
                 cwd: Path | None = None) -> None:
        self.argv, self.port, self.log_path, self.cores, self.cwd = argv, port, log_path, cores, cwd
        self.url = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> RunningServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("w")
        log.write(" ".join(self.argv) + "\n\n")
        log.flush()
        self.process = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.cwd, start_new_session=True,
            preexec_fn=lambda: os.sched_setaffinity(0, self.cores))
        log.close()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until /health answers 200 (llama-server: 503 while it loads)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}; see {self.log_path}")
            if _status(self.url + "/health") == 200:
                return
            time.sleep(0.5)
        raise TimeoutError(f"server not ready after {timeout_s:.0f} s; see {self.log_path}")

    def model_name(self) -> str:
        """The first model /v1/models lists (what a request's "model" names)."""
        with urllib.request.urlopen(self.url + "/v1/models", timeout=30) as response:
            return json.loads(response.read())["data"][0]["id"]

    def warm_up(self, model: str) -> None:
        """One short chat request, so the first measured one pays no first-call costs."""
        body = {"model": model, "messages": [{"role": "user", "content": WARMUP_MESSAGE}],
                "max_tokens": WARMUP_TOKENS, "temperature": 0.0}
        request = urllib.request.Request(self.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            response.read()

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL if it outlives STOP_TIMEOUT_S."""
        if self.process is None or self.process.poll() is not None:
            return
        _signal_group(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _signal_group(self.process.pid, signal.SIGKILL)
            self.process.wait()


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the session this server leads (start_new_session)
    except ProcessLookupError:
        pass


def _status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code
    except (urllib.error.URLError, OSError):
        return None
