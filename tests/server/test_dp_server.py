"""Data parallelism end to end: ``cadence serve --data-parallel-size 2`` with the
engine cores as local processes (``mp``) and as Ray actors on a local Ray
cluster this module starts (``ray start --head``, 2 CPUs: one per replica,
one thread each). The same tests run on both: a batch through one endpoint
is spread over the replicas, requests sharing a prefix follow the replica
whose KV events told the router it holds it, and killing a replica fails
its requests cleanly while the other serves on.

The tests of one backend share its server and run in order; the last one
kills a replica.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.server.serverlib import RawStream, Server, free_port, start_server, stop_server, wait_until

MODEL = "SmolLM2-135M-Instruct"
DP_ARGS = ["--data-parallel-size", "2", "--num-gpu-blocks", "128", "--max-model-len", "1024"]
RAY_START_TIMEOUT_S = 60
# The test cluster listens on this machine only for the module; without token
# authentication whether or not a token was ever saved in ~/.ray (Ray turns it
# on for `ray start` when one was, and never for a driver given an address).
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
# Eight full 16-token blocks, whatever the tokenizer does with the text.
SHARED_PREFIX = "You are a careful assistant. " + " ".join(f"rule {i} holds." for i in range(40))


@pytest.fixture(scope="module")
def ray_address():
    """A Ray head on this machine for the module (stopped by its own pid, not `ray stop`)."""
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths
    port = free_port()
    ray = Path(sys.executable).with_name("ray")
    log_path = Path(temp_dir) / "head.log"
    with open(log_path, "w") as log:
        head = subprocess.Popen(
            [str(ray), "start", "--head", "--block", "--port", str(port), "--num-cpus", "2",
             # Free ports where Ray has fixed defaults: another Ray on this machine keeps its own.
             "--dashboard-agent-listen-port", str(free_port()),
             "--metrics-export-port", str(free_port()),
             "--object-store-memory", str(100 * 2**20), "--include-dashboard", "false",
             "--temp-dir", temp_dir, "--disable-usage-stats"],
            stdout=log, stderr=subprocess.STDOUT,
            env=dict(os.environ, **RAY_ENV))
    try:
        started = wait_until(lambda: head.poll() is not None
                             or "Ray runtime started" in log_path.read_text(), RAY_START_TIMEOUT_S)
        assert started and head.poll() is None, f"ray start failed:\n{log_path.read_text()}"
        yield f"127.0.0.1:{port}"
    finally:
        head.send_signal(signal.SIGTERM)  # --block: it stops the processes it started
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait(10)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module", params=["mp", "ray"])
def dp_server(request, make_server, tmp_path_factory):
    """A server with two replicas; it is stopped before the next backend's starts."""
    env, args = {}, list(DP_ARGS)
    if request.param == "ray":
        env.update(RAY_ENV, RAY_ADDRESS=request.getfixturevalue("ray_address"))
        args += ["--distributed-executor-backend", "ray"]
    server = start_server(f"dp-{request.param}", args, tmp_path_factory.mktemp("server"), env=env)
    make_server.servers.append(server)  # checked at rest after each test (conftest)
    yield server
    stop_server(server)


def health(server: Server) -> list[dict]:
    response = httpx.get(f"{server.base_url}/health", timeout=10)
    assert response.status_code == 200, response.text
    return response.json()["replicas"]


def routed_totals(server: Server) -> list[int]:
    return [replica["num_routed_total"] for replica in health(server)]


def complete(server: Server, prompt: str, max_tokens: int = 4) -> dict:
    response = httpx.post(f"{server.base_url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


def test_health_lists_every_replica_alive(dp_server):
    replicas = health(dp_server)
    assert [r["rank"] for r in replicas] == [0, 1]
    assert all(r["alive"] and r["pid"] for r in replicas)
    assert len({r["pid"] for r in replicas}) == 2


def test_a_batch_through_one_endpoint_is_spread_over_the_replicas(dp_server):
    before = routed_totals(dp_server)
    prompts = [f"{word} is a word that means" for word in
               ("Apple", "River", "Mountain", "Lantern", "Harbor", "Meadow", "Copper", "Violet")]
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda prompt: complete(dp_server, prompt), prompts))
    assert all(a["choices"][0]["finish_reason"] == "length" for a in answers)
    added = [after - b for after, b in zip(routed_totals(dp_server), before)]
    assert sum(added) == len(prompts)
    assert min(added) >= 2, added  # least loaded among replicas holding no prefix of them


def test_a_shared_prefix_follows_the_replica_that_cached_it(dp_server):
    before = routed_totals(dp_server)
    first = complete(dp_server, SHARED_PREFIX + " Question one:")
    rank = next(r for r, (a, b) in enumerate(zip(routed_totals(dp_server), before)) if a > b)
    # The router learns of the cached blocks from the replica's KV events.
    assert wait_until(lambda: health(dp_server)[rank]["num_cached_blocks"] >= 8, 10)
    others = [complete(dp_server, SHARED_PREFIX + f" Question {n}:") for n in ("two", "three", "four")]
    added = [after - b for after, b in zip(routed_totals(dp_server), before)]
    assert added[rank] == 4 and sum(added) == 4, added
    assert first["usage"]["prompt_tokens"] > 8 * 16
    for answer in others:  # served from the prefix cache of that replica
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 8 * 16


def test_killing_a_replica_fails_its_requests_and_the_other_serves_on(dp_server):
    """Last: it kills one replica, then the other."""
    stream = RawStream(dp_server, {"model": MODEL, "prompt": "Tell me a long story.",
                                   "max_tokens": 900, "temperature": 0, "ignore_eos": True})
    assert wait_until(stream.started, 60)
    victim = next(r for r in health(dp_server) if r["num_requests"] == 1)
    os.kill(victim["pid"], signal.SIGKILL)

    stream.join(60)
    assert stream.events[-1] == "[DONE]"
    assert f"replica {victim['rank']}" in stream.errors()[0]["message"]
    assert wait_until(lambda: not health(dp_server)[victim["rank"]]["alive"], 30)
    dead = health(dp_server)[victim["rank"]]
    assert "died" in dead["error"] and dead["num_requests"] == 0
    survivor = 1 - victim["rank"]
    before = routed_totals(dp_server)[survivor]
    for n in range(3):
        assert complete(dp_server, f"Count to {n + 3}:")["choices"][0]["text"]
    assert routed_totals(dp_server)[survivor] == before + 3
    metrics = httpx.get(f"{dp_server.base_url}/metrics", timeout=10).text
    assert f'cadence:dp_replica_up{{model_name="{MODEL}",replica="{victim["rank"]}"}} 0.0' in metrics
    assert dp_server.process.poll() is None
    # The server exits (for a supervisor to restart it) only when no replica is left.
    os.kill(health(dp_server)[survivor]["pid"], signal.SIGKILL)
    assert dp_server.process.wait(30) not in (0, None)
