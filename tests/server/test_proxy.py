"""``cadence proxy`` against fake instances (httpx's mock transport): what it
asks each instance, what it passes on, and how failures reach the client."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi.testclient import TestClient

from cadence.server.proxy import ProxyConfig, build_proxy_app

PREFILL, DECODE = "http://prefill:1", "http://decode:2"
PARAMS = {"do_remote_prefill": True, "remote_block_ids": [3, 4]}


class Instances:
    """Answers as a prefill and a decode instance would, recording what they got."""

    def __init__(self, prefill_answer=None, decode_stream=None, fail=None):
        self.seen: list[tuple[str, dict]] = []
        self.prefill_answer = prefill_answer or httpx.Response(
            200, json={"choices": [{"text": "x"}], "kv_transfer_params": PARAMS})
        self.decode_stream = decode_stream
        self.fail = fail

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        host = f"http://{request.url.host}:{request.url.port}"
        self.seen.append((host, body))
        if self.fail == host:
            raise httpx.ConnectError("refused", request=request)
        if host == PREFILL:
            return self.prefill_answer
        if body.get("stream"):
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  stream=self.decode_stream)
        return httpx.Response(200, json={"choices": [{"text": "decoded"}]})


def client_for(instances: Instances) -> TestClient:
    app = build_proxy_app(ProxyConfig((PREFILL,), (DECODE,)), httpx.MockTransport(instances))
    return TestClient(app)


def test_prefill_then_decode():
    instances = Instances()
    body = {"model": "m", "prompt": "hi", "max_tokens": 9, "min_tokens": 2,
            "stream_options": None}
    answer = client_for(instances).post("/v1/completions", json=body)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "decoded"
    (prefill_host, prefill_body), (decode_host, decode_body) = instances.seen
    assert prefill_host == PREFILL and decode_host == DECODE
    assert prefill_body == {"model": "m", "prompt": "hi", "max_tokens": 1, "stream": False,
                            "kv_transfer_params": {"do_remote_decode": True}}
    assert decode_body == {**body, "kv_transfer_params": PARAMS}


def test_a_refusal_of_the_prefill_instance_is_passed_on():
    refusal = httpx.Response(400, json={"error": {"message": "prompt: too long", "param": "prompt"}})
    instances = Instances(prefill_answer=refusal)
    answer = client_for(instances).post("/v1/chat/completions", json={"messages": []})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "prompt"
    assert [host for host, _ in instances.seen] == [PREFILL]


@pytest.mark.parametrize("role, host", [("prefill", PREFILL), ("decode", DECODE)])
def test_an_instance_that_cannot_be_reached_is_a_502(role, host):
    answer = client_for(Instances(fail=host)).post("/v1/completions", json={"prompt": "hi"})
    assert answer.status_code == 502
    assert f"the {role} instance" in answer.json()["error"]["message"]


@pytest.mark.parametrize("body", [{"prompt": "hi", "n": 2}, {"prompt": ["a", "b"]}])
def test_several_completions_go_to_the_decode_instance_whole(body):
    instances = Instances()
    assert client_for(instances).post("/v1/completions", json=body).status_code == 200
    assert instances.seen == [(DECODE, body)]


def test_clients_cannot_set_kv_transfer_params():
    answer = client_for(Instances()).post(
        "/v1/completions", json={"prompt": "hi", "kv_transfer_params": PARAMS})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "kv_transfer_params"


class BrokenStream(httpx.AsyncByteStream):
    """One event, then the connection drops."""

    async def __aiter__(self):
        yield b'data: {"choices": [{"text": "a"}]}\n\n'
        raise httpx.RemoteProtocolError("peer closed connection")


def test_a_stream_cut_mid_way_ends_with_an_error_event():
    instances = Instances(decode_stream=BrokenStream())
    with client_for(instances).stream("POST", "/v1/completions",
                                      json={"prompt": "hi", "stream": True}) as answer:
        events = [line[len("data: "):] for line in answer.iter_lines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["text"] == "a"
    assert json.loads(events[1])["error"]["code"] == 502
    assert events[-1] == "[DONE]"
    assert instances.seen[0][1]["stream"] is False  # the prefill is never streamed


def test_options_are_checked():
    with pytest.raises(ValueError, match="decode: give at least one URL"):
        ProxyConfig((PREFILL,), ())
    with pytest.raises(ValueError, match="prefill: 'localhost:8000' is not an http"):
        ProxyConfig(("localhost:8000",), (DECODE,))
