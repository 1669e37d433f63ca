"""Prefill/decode disaggregation over HTTP: a prefill ``cadence serve``
(kv_producer), a decode one (kv_consumer) and ``cadence proxy`` on
loopback. Through the proxy, greedy answers (whole and streamed) equal the
decode instance's own answer computed alone; a decode instance killed
mid-stream ends the client's stream with an error, not a hang. After each
test both instances come to rest (no block held: conftest's check)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.server.serverlib import free_port, wait_until

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The three primary colors are"
CHAT = [{"role": "user", "content": "Name a large animal."}]
GREEDY = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


def pd_config(role: str, **extra) -> list[str]:
    config = {"kv_connector": "PDConnector", "kv_role": role, "kv_connector_extra_config": extra}
    return ["--kv-transfer-config", json.dumps(config)]


@pytest.fixture(scope="module")
def instances(make_server):
    """(prefill, decode), started side by side (each loads the model)."""
    # Blocks nobody pulls (a decode instance gone) are freed after 5 s.
    prefill_args = pd_config("kv_producer", kv_port=free_port(), hold_timeout_s=5)
    decode_args = pd_config("kv_consumer", transfer_timeout_s=10)
    with ThreadPoolExecutor(2) as pool:
        prefill = pool.submit(make_server, "prefill", prefill_args)
        decode = pool.submit(make_server, "decode", decode_args)
        return prefill.result(), decode.result()


@pytest.fixture(scope="module")
def proxy(instances, tmp_path_factory):
    prefill, decode = instances
    port = free_port()
    log_path = tmp_path_factory.mktemp("proxy") / "proxy.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "cadence.cli", "proxy", "--port", str(port),
             "--prefill", prefill.base_url, "--decode", decode.base_url, "--log-level", "warning"],
            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    assert wait_until(healthy, 60), log_path.read_text()
    yield url
    process.send_signal(signal.SIGINT)
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def test_answers_through_the_proxy_equal_one_instance(instances, proxy):
    _, decode = instances
    alone, through = client_of(decode.base_url), client_of(proxy)
    expected = alone.completions.create(model=MODEL, prompt=PROMPT, **GREEDY)
    answer = through.completions.create(model=MODEL, prompt=PROMPT, **GREEDY)
    assert answer.choices[0].text == expected.choices[0].text
    assert answer.usage.completion_tokens == 12
    expected_chat = alone.chat.completions.create(model=MODEL, messages=CHAT, **GREEDY)
    streamed = through.chat.completions.create(model=MODEL, messages=CHAT, stream=True, **GREEDY)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert text == expected_chat.choices[0].message.content


def test_the_prefill_answers_where_the_kv_waits(instances):
    prefill, decode = instances
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}}
    answer = httpx.post(f"{prefill.base_url}/v1/completions", json=body, timeout=60).json()
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_block_ids"]
    # The decode instance loads it: its prompt came cached (all but the last token).
    decoded = httpx.post(f"{decode.base_url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": params}).json()
    assert decoded["choices"][0]["text"]
    # The decode instance refuses what only a prefill instance does.
    refused = httpx.post(f"{decode.base_url}/v1/completions", json=body, timeout=60)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "kv_transfer_params"


def test_a_decode_instance_killed_mid_stream_ends_the_stream_with_an_error(instances, proxy):
    _, decode = instances
    stream = client_of(proxy).completions.create(
        model=MODEL, prompt=PROMPT, stream=True, temperature=0, max_tokens=1500,
        extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    engine_pid = decode.engine_pid()
    decode.process.kill()
    os.kill(engine_pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises((openai.APIError, httpx.HTTPError)):
        for _ in chunks:
            assert time.monotonic() - start < 30, "the stream went on after its instance died"
    assert time.monotonic() - start < 30
    # A new request through the proxy is refused at once (502), not held.
    answer = httpx.post(f"{proxy}/v1/completions", timeout=30,
                        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
    assert answer.status_code == 502
