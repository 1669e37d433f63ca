"""Start and stop a real ``cadence serve`` on a free loopback port (a subprocess),
and read its /metrics. The engine runs on one thread with a small KV cache:
other jobs share the machine, and the tests ask for a few tokens per request.
``fuzz`` drives a server with schemathesis (tests/server/test_fuzz.py and
bench/server_fuzz.py).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import json
import sys
import threading
import time
from dataclasses import dataclass, field
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
        """The engine-core process: the server's first spawned child (a grammar
        checker's worker, spawned on the first structured request, comes later)."""
        spawned = [pid for pid in _children(self.process.pid)
                   if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        if not spawned:
            raise RuntimeError("no engine-core process under the server")
        return min(spawned, key=_start_time)

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


def _start_time(pid: int) -> int:
    """When ``pid`` started, in clock ticks since boot (field 22 of /proc/pid/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[19])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(name: str, extra_args: list[str], log_dir: Path,
                 env: dict[str, str] | None = None) -> Server:
    """``env``: variables set for the server over this process's and the offline defaults
    (a test of downloads sets HF_HUB_OFFLINE=0 for its server alone)."""
    port = free_port()
    log_path = log_dir / f"server-{name}-{port}.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           **(env or {})}
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


class RawStream:
    """A streamed /v1/completions read line by line in a thread (the ``openai``
    client hides ``[DONE]`` and stops at an error event)."""

    def __init__(self, server: Server, body: dict) -> None:
        self.events: list[str] = []
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._read, args=(server, body))
        self._thread.start()

    def _read(self, server: Server, body: dict) -> None:
        try:
            with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=120,
                              json={**body, "stream": True}) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: "):])
        except BaseException as err:  # noqa: BLE001 - asserted on by the test
            self.error = err

    def started(self) -> bool:
        return bool(self.events)

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the stream did not end"
        assert self.error is None, repr(self.error)

    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for e in self.events[:-1] for c in json.loads(e).get("choices", [])
                if c.get("finish_reason")]

    def errors(self) -> list[dict]:
        return [json.loads(e)["error"] for e in self.events[:-1] if "error" in json.loads(e)]


def wait_until(condition, timeout_s: float = 60.0, interval_s: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval_s)
    return condition()


# ---------------------------------------------------------------- fuzzing (schemathesis)

# Generated values are capped so that a case costs the engine a few tokens at most;
# everything else (types, signs, strings, nesting) stays as schemathesis made it.
FUZZ_CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "max_output_tokens": 4, "min_tokens": 4,
             "n": 2, "best_of": 2}
FUZZ_MAX_PROMPTS = 4


@dataclass
class FuzzReport:
    num_cases: int = 0
    statuses: dict[str, dict[int, int]] = field(default_factory=dict)  # operation -> status -> count
    findings: list[str] = field(default_factory=list)  # 5xx answers, requests over the time bound
    slowest_s: float = 0.0

    def record(self, label: str, body: object, status: int | None, detail: str,
               elapsed_s: float) -> None:
        """One case's answer (``status`` None: no answer, ``detail`` says why)."""
        self.num_cases += 1
        self.slowest_s = max(self.slowest_s, elapsed_s)
        if status is not None:
            statuses = self.statuses.setdefault(label, {})
            statuses[status] = statuses.get(status, 0) + 1
        if status is None or status >= 500:
            self.findings.append(f"{label}: {status or 'no answer'} {detail[:300]} (body {_short(body)})")


def fuzz(base_url: str, model: str, max_examples: int, *, headers: dict[str, str] | None = None,
         response_timeout_s: float = 30.0, seed: int | None = None) -> FuzzReport:
    """Every operation of the server's OpenAPI schema, with up to ``max_examples`` cases
    that fit the schema and as many that do not (schemathesis); no shrinking, nothing
    raises: what went wrong is in the report. ``seed`` None: the same cases every run."""
    return Fuzzer(base_url, model, max_examples, headers or {}, response_timeout_s, seed).run()


@dataclass
class Fuzzer:
    base_url: str
    model: str
    max_examples: int
    headers: dict[str, str]
    response_timeout_s: float
    seed: int | None

    def run(self) -> FuzzReport:
        import schemathesis
        from hypothesis.errors import Unsatisfiable

        report = FuzzReport()
        schema = schemathesis.openapi.from_url(f"{self.base_url}/openapi.json", headers=self.headers)
        for result in schema.get_all_operations():
            for mode in schemathesis.GenerationMode:
                try:
                    self._test(result.ok(), mode, report)()
                except Unsatisfiable:  # no parameters to break: nothing to send in negative mode
                    pass
        return report

    def _test(self, operation, mode, report: FuzzReport):
        """A hypothesis test that sends ``operation``'s generated cases and records them."""
        import requests
        from hypothesis import HealthCheck, Phase, given, settings
        from hypothesis import seed as hypothesis_seed

        @settings(max_examples=self.max_examples, deadline=None, database=None,
                  derandomize=self.seed is None, phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(operation.as_strategy(generation_mode=mode))
        def test(case) -> None:
            if isinstance(case.body, dict):
                keep_cheap(case.body, self.model)
            start = time.monotonic()
            try:
                response = case.call(base_url=self.base_url, headers=self.headers,
                                     timeout=self.response_timeout_s)
                status, detail = response.status_code, response.text
            except requests.RequestException as err:
                status, detail = None, f"{type(err).__name__}: {err}"
            report.record(operation.label, case.body, status, detail, time.monotonic() - start)

        return test if self.seed is None else hypothesis_seed(self.seed)(test)


def keep_cheap(body: dict, model: str) -> None:
    """Cap the costly values of a generated body in place (see FUZZ_CAPS); a string
    ``model`` becomes the served one, so that cases reach generation, not a 404."""
    if all(body.get(name) is None for name in ("max_tokens", "max_completion_tokens",
                                               "max_output_tokens")):
        # A chat or a response without one, or a completion with max_tokens null, may fill
        # the context (/v1/responses names it max_output_tokens).
        body["max_output_tokens" if "input" in body else "max_tokens"] = FUZZ_CAPS["max_tokens"]
    for name, cap in FUZZ_CAPS.items():
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[name] = cap
    for name in ("prompt", "messages", "input"):
        if isinstance(body.get(name), list) and body[name] and isinstance(body[name][0], (list, dict, str)):
            body[name] = body[name][:FUZZ_MAX_PROMPTS]
    if isinstance(body.get("model"), str):
        body["model"] = model


def _short(body: object) -> str:
    text = repr(body)
    return text if len(text) <= 300 else text[:300] + "..."
