"""A full queue answers 429; a dead engine fails requests in flight instead of
hanging, and the server exits non-zero. One small server: two running slots,
one queued."""

from __future__ import annotations

import os
import signal
import threading

import openai
import pytest

from tests.server.serverlib import wait_until

MODEL = "SmolLM2-135M-Instruct"
LONG = dict(model=MODEL, prompt="Tell me a story.", max_tokens=1500, temperature=0,
            extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(make_server):
    return make_server("limits", ["--max-num-seqs", "2", "--max-num-queued-requests", "1"])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def test_full_queue_answers_429(server, client):
    streams = [client.completions.create(stream=True, **LONG) for _ in range(3)]  # 2 run, 1 waits
    try:
        with pytest.raises(openai.RateLimitError) as err:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert err.value.status_code == 429
        assert "queue is full" in err.value.message
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model=MODEL, max_tokens=2,
                                           messages=[{"role": "user", "content": "Hi"}])
    finally:
        for stream in streams:
            stream.close()
    # The aborted streams free their slots and blocks: the server takes work again.
    assert wait_until(lambda: server.metrics()["cadence:kv_cache_usage_perc"] == 0.0, 60)
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices


def test_engine_death_fails_requests_instead_of_hanging(server, client):
    stream = client.completions.create(stream=True, **LONG)
    next(iter(stream))  # the request is running

    in_flight: dict[str, BaseException] = {}

    def non_streamed() -> None:
        try:
            client.completions.create(**LONG)
        except BaseException as err:  # noqa: BLE001 - recorded for the assertion
            in_flight["error"] = err

    thread = threading.Thread(target=non_streamed)
    thread.start()
    assert wait_until(lambda: server.metrics()["cadence:num_requests_running"] == 2, 60)

    os.kill(server.engine_pid(), signal.SIGKILL)

    with pytest.raises(openai.APIError) as err:
        for _ in stream:
            pass
    assert "engine" in err.value.message
    thread.join(60)
    assert not thread.is_alive()
    assert isinstance(in_flight.get("error"), openai.InternalServerError)

    # Then the front end exits non-zero, so that a supervisor restarts it (until it
    # has, new requests and /health get 503): tests/server/test_server_lifecycle.py.
    assert server.process.wait(30) != 0
