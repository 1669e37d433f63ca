"""How the server stops. SIGTERM drains: new requests get 503, requests in flight
finish or, past --shutdown-timeout, end with an error (JSON, or an SSE error
event and ``[DONE]``), and the process exits 0; a second signal ends the drain
at once. A dead engine ends the server with a non-zero exit code, so that a
supervisor restarts it. Each test stops its own server."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import httpx

from cadence.core.outputs import SchedulerStats
from cadence.engine.async_llm import AsyncLLM
from tests.server.serverlib import RawStream, Server, wait_until

MODEL = "SmolLM2-135M-Instruct"
SHUTDOWN_TIMEOUT_S = 5
LONG = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 1500, "temperature": 0,
        "ignore_eos": True}


def test_sigterm_drains_then_ends_what_is_left_with_errors(make_server):
    server = make_server("drain", ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)])
    long = RawStream(server, LONG)
    plain: dict[str, httpx.Response] = {}
    blocking = threading.Thread(target=lambda: plain.setdefault("answer", httpx.post(
        f"{server.base_url}/v1/completions", json=LONG, timeout=120)))
    blocking.start()
    assert wait_until(lambda: server.metrics()["cadence:num_requests_running"] == 2, 60)
    # The short one starts last, so it is still in flight at the signal (24
    # tokens: a second or two of work) and must finish inside the drain.
    short = RawStream(server, {**LONG, "max_tokens": 24})
    assert wait_until(lambda: short.started() and long.started(), 60)

    server.process.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    # Draining: new requests and /health get 503 at once; /metrics still answers.
    assert wait_until(lambda: httpx.get(f"{server.base_url}/health", timeout=5).status_code == 503, 5)
    refused = httpx.post(f"{server.base_url}/v1/completions", timeout=5,
                         json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]

    # The short request finishes as usual inside the drain.
    short.join(SHUTDOWN_TIMEOUT_S + 30)
    assert short.events[-1] == "[DONE]" and short.finish_reasons() == ["length"]
    assert not short.errors()
    # Past the timeout the long ones end with an error: an SSE error event and [DONE] ...
    long.join(SHUTDOWN_TIMEOUT_S + 30)
    assert time.monotonic() - sent >= SHUTDOWN_TIMEOUT_S - 0.5
    assert long.events[-1] == "[DONE]"
    assert [e["code"] for e in long.errors()] == [500]
    assert "shutting down" in long.errors()[0]["message"]
    # ... and a JSON error body.
    blocking.join(30)
    answer = plain["answer"]
    assert answer.status_code == 500 and "shutting down" in answer.json()["error"]["message"]

    assert server.process.wait(30) == 0
    assert time.monotonic() - sent < SHUTDOWN_TIMEOUT_S + 20


def test_a_second_ctrl_c_ends_the_drain_at_once(make_server):
    server = make_server("cut", ["--shutdown-timeout", "300"])
    stream = RawStream(server, LONG)
    assert wait_until(stream.started, 60)

    server.process.send_signal(signal.SIGINT)
    time.sleep(1.0)
    assert not stream.events or stream.events[-1] != "[DONE]"  # still draining
    server.process.send_signal(signal.SIGINT)
    cut = time.monotonic()

    stream.join(30)
    assert stream.events[-1] == "[DONE]" and "shutting down" in stream.errors()[0]["message"]
    assert server.process.wait(30) == 0
    assert time.monotonic() - cut < 20


def test_engine_death_ends_the_server_with_a_nonzero_exit_code(make_server):
    server = make_server("engine-death")
    stream = RawStream(server, LONG)
    assert wait_until(stream.started, 60)

    os.kill(server.engine_pid(), signal.SIGKILL)
    killed = time.monotonic()

    stream.join(30)
    assert stream.events[-1] == "[DONE]"
    assert "engine" in stream.errors()[0]["message"]
    exit_code = server.process.wait(30)
    assert exit_code not in (0, None)
    assert time.monotonic() - killed < 15
    assert "the engine process died" in server.log()


def test_engine_death_during_a_drain_is_still_a_nonzero_exit(make_server):
    """SIGTERM starts a drain; the engine dying in it is a crash all the same."""
    server = make_server("drain-death", ["--shutdown-timeout", "60"])
    stream = RawStream(server, LONG)
    assert wait_until(stream.started, 60)
    server.process.send_signal(signal.SIGTERM)
    assert wait_until(lambda: httpx.get(f"{server.base_url}/health", timeout=5).status_code == 503, 5)
    os.kill(server.engine_pid(), signal.SIGKILL)

    stream.join(30)
    assert stream.events[-1] == "[DONE]" and stream.errors()
    assert server.process.wait(30) == 1
    assert "the engine died while the server was draining" in server.log()


def test_a_dead_engine_reports_nothing_running():
    """/metrics must not show the dead engine's last step (its gauges go to zero)."""

    class Recorder:
        def __init__(self) -> None:
            self.stats: list[SchedulerStats] = []

        def record_scheduler_stats(self, stats: SchedulerStats) -> None:
            self.stats.append(stats)

        def __getattr__(self, name: str):  # the rest of the StatLogger protocol: ignored
            return lambda *args, **kwargs: None

    async def run() -> list[SchedulerStats]:
        recorder = Recorder()
        llm = AsyncLLM(stat_logger=recorder)
        llm._mark_dead("the engine process died (exit code -9)")  # what the sentinel calls
        stats = list(recorder.stats)
        await llm.shutdown()
        return stats

    stats = asyncio.run(run())
    assert stats == [SchedulerStats()]  # nothing running or waiting, no KV in use
