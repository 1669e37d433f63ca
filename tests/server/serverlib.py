"""Start and stop a real ``cadence serve`` on a free loopback port (a subprocess),
and read its /metrics. The engine runs on one thread with a small KV cache:
other jobs share the machine, and the tests ask for a few tokens per request.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 300
BASE_ARGS = ["--num-threads", "1", "--num-gpu-blocks", "512", "--max-model-len", "2048"]


@dataclass
class Server:
    process: subprocess.Popen
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def engine_pid(self) -> int:
        """The engine-core process: the server's spawned child."""
        for pid in _children(self.process.pid):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"spawn_main" in cmdline:
                return pid
        raise RuntimeError("no engine-core process under the server")

    def metrics(self, label: str = "") -> dict[str, float]:
        """Sample values of /metrics by name, summed over labels; only the samples
        whose labels contain ``label`` (e.g. 'finished_reason="abort"') if given."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=30).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            match = re.match(r"^([^#{\s]+)(\{[^}]*\})?\s+(\S+)$", line)
            if match and label in (match.group(2) or ""):
                name, value = match.group(1), float(match.group(3))
                values[name] = values.get(name, 0.0) + value
        return values

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _children(pid: int) -> list[int]:
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...; comm may contain spaces: split after the last ')'.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            children.append(int(entry.name))
    return children


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(name: str, extra_args: list[str], log_dir: Path) -> Server:
    port = free_port()
    log_path = log_dir / f"server-{name}-{port}.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "cadence.server", "serve", "--port", str(port), *BASE_ARGS,
             *extra_args],
            stdout=log, stderr=subprocess.STDOUT, env=env)
    server = Server(process, port, log_path)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}):\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(server)
    raise RuntimeError(f"the server did not become healthy in {STARTUP_TIMEOUT_S} s:\n{server.log()}")


def stop_server(server: Server) -> None:
    children = _children(server.process.pid)
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGINT)
        try:
            server.process.wait(30)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait(10)
    for pid in children:  # the engine exits with its parent; make sure of it
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_until(condition, timeout_s: float = 60.0, interval_s: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval_s)
    return condition()
