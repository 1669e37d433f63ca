"""The fair policy in a live server: the OpenAI ``user`` field names the client.

One running slot (``--max-num-seqs 1``) makes the order of service the
order of admission. A heavy client queues six requests, then a light client
sends one: under ``fair`` the light request is served next, under ``fcfs``
it waits for all six.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server.serverlib import wait_until

HEAVY = 6
# Tokens per heavy request: long enough that no second heavy request finishes
# between the check that they are queued and the light request's arrival
# (one decode step of the default model takes ~10 ms here: ~0.5 s each).
HEAVY_TOKENS = 48


def finish_order(server) -> list[str]:
    done: list[str] = []
    lock = threading.Lock()

    def send(name: str, user: str, max_tokens: int) -> None:
        body = {"prompt": f"Tell me about {name}.", "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True, "user": user}
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        with lock:
            done.append(name)

    threads = [threading.Thread(target=send, args=(f"heavy{i}", "heavy", HEAVY_TOKENS)) for i in range(HEAVY)]
    for thread in threads:
        thread.start()
    # Wait until the heavy requests are in the engine (one running, the rest queued).
    assert wait_until(lambda: server.metrics().get("cadence:num_requests_waiting", 0) >= HEAVY - 2, 30,
                      interval_s=0.02)
    light = threading.Thread(target=send, args=("light", "light", 12))
    light.start()
    for thread in [*threads, light]:
        thread.join(120)
    return done


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_light_client_is_served_before_the_heavy_backlog(make_server, policy):
    server = make_server(policy, ["--policy", policy, "--max-num-seqs", "1"])
    order = finish_order(server)
    assert sorted(order) == sorted([f"heavy{i}" for i in range(HEAVY)] + ["light"])
    if policy == "fair":
        assert order.index("light") <= 2, order  # behind at most the one or two already admitted
        # /metrics names each client's service (a bounded set of labels).
        for client in ("heavy", "light"):
            served = server.metrics(f'client="{client}"').get("cadence:client_service_tokens", 0)
            assert served > 0, client
    else:
        assert order.index("light") >= HEAVY - 1, order
