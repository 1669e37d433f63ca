#!/usr/bin/env python3
"""Soak: mixed traffic against ``cadence serve`` under a supervisor, with a few
engine kills, on loopback, for a bounded time.

    python bench/server_soak.py [--minutes 30] [--clients 4] [--kills 3] [--seed 0]

A supervisor loop keeps one ``cadence serve`` on a fixed loopback port and
restarts it whenever it exits non-zero (as it does when its engine dies).
Client threads send completions and chats, streamed or not, a fifth of them
cut off by the client (a stream closed after a few events, a plain request
given up after a short timeout). ``--kills`` times, evenly spaced, the engine
process gets SIGKILL. Every ``--sample-s`` the front end's RSS is read.

At the end it stops the traffic, checks that nothing is running and no KV
block is in use, stops the server with SIGTERM (exit code 0 expected) and
prints a JSON summary: requests by outcome, errors outside the kill windows
(should be none), restarts and how long each took, and front-end RSS per
server life against the bound: after the first ``--warmup-s`` of a life,
RSS may not grow by more than ``--rss-bound-mib``. Exit code 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: tests.server.serverlib

import httpx  # noqa: E402

from tests.server.serverlib import BASE_ARGS, Server, free_port, wait_until  # noqa: E402
from cadence.models.default_model import DEFAULT_MODEL_NAME

MODEL = DEFAULT_MODEL_NAME
STARTUP_TIMEOUT_S = 300


@dataclass
class Life:
    """One server process, from spawn to exit."""

    pid: int
    started: float
    healthy: float | None = None
    exit_code: int | None = None
    rss_mib: list[tuple[float, float]] = field(default_factory=list)  # (time, front-end RSS)


class Supervisor:
    """Keeps one server up on ``port``; restarts it when it exits non-zero."""

    def __init__(self, port: int, log_dir: Path) -> None:
        self.port = port
        self.log_dir = log_dir
        self.lives: list[Life] = []
        self.stopping = False
        self.process: subprocess.Popen | None = None
        self._thread = threading.Thread(target=self._loop, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._thread.start()
        if not wait_until(lambda: self.lives and self.lives[-1].healthy, STARTUP_TIMEOUT_S):
            raise RuntimeError("the first server did not become healthy")

    def _loop(self) -> None:
        while not self.stopping:
            life = self._spawn()
            code = self.process.wait()
            life.exit_code = code
            if code == 0 or self.stopping:
                return
            print(f"supervisor: server exited with {code}; restarting", file=sys.stderr, flush=True)

    def _spawn(self) -> Life:
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
        log = open(self.log_dir / f"server-{len(self.lives)}.log", "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "cadence.server", "serve", "--host", "127.0.0.1",
             "--port", str(self.port), *BASE_ARGS], stdout=log, stderr=subprocess.STDOUT, env=env)
        life = Life(self.process.pid, time.monotonic())
        self.lives.append(life)
        if wait_until(lambda: self._healthy() or self.process.poll() is not None, STARTUP_TIMEOUT_S):
            if self.process.poll() is None:
                life.healthy = time.monotonic()
        return life

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def engine_pid(self) -> int | None:
        try:
            return Server(self.process, self.port, Path(os.devnull)).engine_pid()
        except (RuntimeError, OSError):
            return None

    def stop(self) -> int | None:
        self.stopping = True
        self.process.send_signal(signal.SIGTERM)
        self._thread.join(120)
        return self.lives[-1].exit_code


# ---------------------------------------------------------------- traffic


@dataclass
class Outcome:
    start: float
    end: float
    kind: str  # ok, cut (the client's own disconnect), or the error's class


def client(base_url: str, seed: int, stop: threading.Event, outcomes: list[Outcome]) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=base_url, timeout=60) as http:
        while not stop.is_set():
            start = time.monotonic()
            kind = one_request(http, rng)
            outcomes.append(Outcome(start, time.monotonic(), kind))
            # While the server restarts, retry twice a second (a client's backoff).
            time.sleep(0.5 if kind == "ConnectError" else rng.uniform(0, 0.2))


def one_request(http: httpx.Client, rng: random.Random) -> str:
    stream, cut = rng.random() < 0.5, rng.random() < 0.2
    body: dict = {"model": MODEL, "max_tokens": rng.randint(1, 48), "stream": stream,
                  "temperature": rng.choice([0, 0.7]), "n": 2 if rng.random() < 0.1 else 1}
    if rng.random() < 0.5:
        path, body["prompt"] = "/v1/completions", rng.choice(PROMPTS)
    else:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
    try:
        if stream:
            with http.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    return f"http_{response.status_code}"
                for i, line in enumerate(response.iter_lines()):
                    if cut and i >= rng.randint(1, 6):
                        return "cut"
                    if line.startswith('data: {"error"'):
                        return "stream_error"
            return "ok"
        response = http.post(path, json=body, timeout=rng.uniform(0.3, 1.5) if cut else 60)
        return "ok" if response.status_code == 200 else f"http_{response.status_code}"
    except httpx.TimeoutException:
        return "cut" if cut else "timeout"
    except httpx.HTTPError as err:
        return type(err).__name__


PROMPTS = [
    "Tell me a story about a lighthouse.", "Why is the sky blue?", "List three prime numbers.",
    "Write a haiku about continuous batching.", "What is the capital of France?",
    "Explain paged attention in one sentence.", "Count from one to ten.",
]


# ---------------------------------------------------------------- the run


def rss_mib(pid: int) -> float | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]) / 1024


def gauge(base_url: str, name: str) -> float:
    """The sum of the samples whose name starts with ``name`` (all labels)."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="traffic duration (default 30)")
    parser.add_argument("--clients", type=int, default=4, help="client threads (default 4)")
    parser.add_argument("--kills", type=int, default=3, help="engine SIGKILLs, evenly spaced (default 3)")
    parser.add_argument("--sample-s", type=float, default=10.0, help="RSS sampling period (default 10)")
    parser.add_argument("--warmup-s", type=float, default=60.0,
                        help="RSS of a server life is measured from this far into it (default 60)")
    parser.add_argument("--rss-bound-mib", type=float, default=64.0,
                        help="most a life's front-end RSS may grow after its warm-up (default 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the summary here")
    args = parser.parse_args(argv)

    supervisor = Supervisor(free_port(), Path(tempfile.mkdtemp(prefix="cadence-soak-")))
    supervisor.start()
    outcomes: list[Outcome] = []
    start = time.monotonic()
    kills = run_traffic(supervisor, args, outcomes)
    wait_until(lambda: supervisor.lives[-1].healthy is not None, STARTUP_TIMEOUT_S)
    # Nothing running or waiting in the engine, no front-end state held (the
    # cadence:frontend_* gauges), no KV block in use.
    busy = ("cadence:num_requests_running{", "cadence:num_requests_waiting{", "cadence:frontend_")
    at_rest = wait_until(lambda: all(gauge(supervisor.base_url, name) == 0 for name in busy), 60)
    kv_at_end = gauge(supervisor.base_url, "cadence:kv_cache_usage_perc{")
    final_exit_code = supervisor.stop()
    summary = summarize(args, start, kills, supervisor.lives, outcomes, at_rest, kv_at_end,
                        final_exit_code)
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if summary["passed"] else 1


def run_traffic(supervisor: Supervisor, args: argparse.Namespace, outcomes: list[Outcome]) -> list[float]:
    """The clients for ``args.minutes``, the engine kills, the RSS samples; returns the kill times."""
    stop = threading.Event()
    threads = [threading.Thread(target=client, args=(supervisor.base_url, args.seed + i, stop, outcomes))
               for i in range(args.clients)]
    for thread in threads:
        thread.start()
    start = time.monotonic()
    duration_s = args.minutes * 60
    kill_times = [start + duration_s * (k + 1) / (args.kills + 1) for k in range(args.kills)]
    kills: list[float] = []
    last_sample = 0.0
    while time.monotonic() - start < duration_s:
        life = supervisor.lives[-1]
        if (time.monotonic() - last_sample >= args.sample_s and life.healthy is not None
                and supervisor.process.poll() is None):
            rss = rss_mib(life.pid)
            if rss is not None:
                life.rss_mib.append((time.monotonic(), rss))
                last_sample = time.monotonic()
        if kill_times and time.monotonic() >= kill_times[0]:
            kill_times.pop(0)
            engine = supervisor.engine_pid()
            if engine is not None:
                os.kill(engine, signal.SIGKILL)
                kills.append(time.monotonic())
                print(f"soak: killed engine {engine} at {kills[-1] - start:.0f} s", file=sys.stderr,
                      flush=True)
        time.sleep(0.5)
    stop.set()
    for thread in threads:
        thread.join(120)
    return kills


def summarize(args, start, kills, lives, outcomes, at_rest, kv_at_end, final_exit_code) -> dict:
    # A kill window runs from the kill to one second after the next life is healthy.
    windows = []
    for killed in kills:
        after = [life.healthy for life in lives if life.healthy is not None and life.started > killed]
        windows.append((killed, (after[0] if after else float("inf")) + 1.0))
    by_kind: dict[str, int] = {}
    unexpected: dict[str, int] = {}
    for outcome in outcomes:
        by_kind[outcome.kind] = by_kind.get(outcome.kind, 0) + 1
        in_window = any(outcome.end >= lo and outcome.start <= hi for lo, hi in windows)
        if outcome.kind not in ("ok", "cut") and not in_window:
            unexpected[outcome.kind] = unexpected.get(outcome.kind, 0) + 1
    rss = [rss_report(life, args.warmup_s, start) for life in lives]
    growth_ok = all(r["growth_after_warmup_mib"] is None
                    or r["growth_after_warmup_mib"] <= args.rss_bound_mib for r in rss)
    restarts = [round(hi - 1.0 - lo, 1) for lo, hi in windows]
    passed = (not unexpected and at_rest and kv_at_end == 0.0 and final_exit_code == 0
              and growth_ok and all(life.exit_code not in (None, 0) for life in lives[:-1]))
    return {
        "minutes": args.minutes, "clients": args.clients, "kills": len(kills),
        "requests": len(outcomes), "outcomes": by_kind, "errors_outside_kill_windows": unexpected,
        "restart_s": restarts, "exit_codes": [life.exit_code for life in lives],
        "rss_bound_mib": args.rss_bound_mib, "front_end_rss": rss,
        "at_rest_at_end": at_rest, "kv_cache_usage_at_end": kv_at_end, "passed": passed,
    }


def rss_report(life: Life, warmup_s: float, start: float) -> dict:
    samples = life.rss_mib
    warm = [rss for t, rss in samples if life.healthy is not None and t - life.healthy >= warmup_s]
    return {
        "life_s": round(samples[-1][0] - samples[0][0], 0) if samples else 0,
        "first_mib": round(samples[0][1], 1) if samples else None,
        "after_warmup_mib": round(warm[0], 1) if warm else None,
        "max_mib": round(max(rss for _, rss in samples), 1) if samples else None,
        "last_mib": round(samples[-1][1], 1) if samples else None,
        "growth_after_warmup_mib": round(max(warm) - warm[0], 1) if warm else None,
        "timeline": " ".join(f"{t - start:.0f}s:{rss:.1f}" for t, rss in samples),
    }


if __name__ == "__main__":
    sys.exit(main())
