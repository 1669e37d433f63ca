"""Async scheduling behind the server: greedy answers (whole and streamed,
with stop strings and an abort mid-stream) equal a server without it."""

from __future__ import annotations

import openai
import pytest

from tests.server.serverlib import wait_until

MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [[{"role": "user", "content": text}] for text in (
    "Name three rivers in Europe.", "What is a prime number?", "Write a short poem about rain.")]


@pytest.fixture(scope="module")
def servers(make_server):
    return make_server("plain"), make_server("async", ["--async-scheduling"])


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def answers(server, **kwargs) -> list[str]:
    client = client_of(server)
    return [client.chat.completions.create(model=MODEL, messages=m, temperature=0, **kwargs)
            .choices[0].message.content for m in MESSAGES]


def test_greedy_answers_equal_a_server_without_it(servers):
    plain, overlapped = servers
    assert answers(overlapped, max_tokens=40) == answers(plain, max_tokens=40)
    assert answers(overlapped, max_tokens=60, stop=[" the"]) == answers(plain, max_tokens=60, stop=[" the"])
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client_of(overlapped).chat.completions.create(
            model=MODEL, messages=MESSAGES[0], temperature=0, max_tokens=40, stream=True)
        if chunk.choices)
    assert streamed == answers(plain, max_tokens=40)[0]


def test_a_stream_closed_mid_answer_frees_its_blocks(servers):
    _, overlapped = servers
    stream = client_of(overlapped).chat.completions.create(
        model=MODEL, messages=MESSAGES[2], temperature=0, max_tokens=200, stream=True)
    for i, _ in enumerate(stream):
        if i == 5:
            break
    stream.close()
    assert wait_until(lambda: overlapped.metrics()["cadence:num_requests_running"] == 0, 60)
    assert wait_until(lambda: overlapped.metrics()["cadence:kv_cache_usage_perc"] == 0.0, 60)
    assert overlapped.metrics('finished_reason="abort"')["cadence:request_success_total"] >= 1
    assert answers(overlapped, max_tokens=10)  # still serving
