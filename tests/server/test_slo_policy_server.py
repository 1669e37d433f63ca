"""The slo policy in a live server: targets per request, 429 + Retry-After for a miss."""

from __future__ import annotations

import httpx
import pytest


@pytest.fixture(scope="module")
def slo_server(make_server):
    # A 1 ms default TTFT target no prefill can meet: every request without its own is refused.
    return make_server("slo", ["--policy", "slo", "--slo-reject", "--slo-ttft-s", "0.001"])


def complete(server, **fields):
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0.0, **fields}
    return httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)


def test_a_target_out_of_reach_gets_429_with_retry_after(slo_server):
    response = complete(slo_server)
    assert response.status_code == 429, response.text
    assert int(response.headers["Retry-After"]) >= 1
    assert "slo_ttft_s" in response.json()["error"]["message"]


@pytest.mark.parametrize("route, body", [
    ("completions", {"prompt": "The capital of France is"}),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
])
def test_a_streamed_request_out_of_reach_gets_429_too(slo_server, route, body):
    """The refusal comes before the stream begins: a 429, not an error event."""
    body = {**body, "max_tokens": 4, "stream": True}
    response = httpx.post(f"{slo_server.base_url}/v1/{route}", json=body, timeout=60)
    assert response.status_code == 429, response.text
    assert int(response.headers["Retry-After"]) >= 1
    served = httpx.post(f"{slo_server.base_url}/v1/{route}", timeout=60,
                        json={**body, "slo_ttft_s": 60.0, "slo_tpot_s": 5.0})
    assert served.status_code == 200
    events = [line for line in served.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3


def test_a_request_with_a_reachable_target_is_served(slo_server):
    before = slo_server.metrics('result="met"').get("cadence:slo_requests_total", 0)
    response = complete(slo_server, slo_ttft_s=60.0, slo_tpot_s=5.0)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"]
    # /metrics counts it as a request that met its targets.
    assert slo_server.metrics('result="met"').get("cadence:slo_requests_total", 0) == before + 1


def test_an_invalid_target_is_a_400(slo_server):
    response = complete(slo_server, slo_ttft_s=-1)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "slo_ttft_s"


def test_targets_are_refused_where_the_policy_ignores_them(make_server):
    server = make_server("fcfs-slo", [])
    response = complete(server, slo_ttft_s=1.0)
    assert response.status_code == 400
    assert "--policy slo" in response.json()["error"]["message"]
