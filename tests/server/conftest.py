"""tests/server: the OpenAI API of a real ``cadence serve``, driven by the
official ``openai`` client. Each module starts its server once (the default
model loads once per module) and stops it at the end.

After every test, each server its module started must come back to rest
within ``REST_TIMEOUT_S``: no request holding front-end state (the
``cadence:frontend_*`` gauges: output queues, sequence counts, detokenizers,
utility calls) and none running, waiting or holding KV blocks in the engine.
A request that leaks any of them fails the test that sent it, at teardown.
"""

from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.server.serverlib import Server, start_server, stop_server

REST_TIMEOUT_S = 10.0
# Every gauge that counts what requests hold; each is 0 when none is in flight.
AT_REST_GAUGES = (
    "cadence:frontend_open_requests", "cadence:frontend_unfinished_seqs",
    "cadence:frontend_output_requests", "cadence:frontend_output_routes",
    "cadence:frontend_pending_utility_calls",
    "cadence:num_requests_running", "cadence:num_requests_waiting", "cadence:kv_cache_usage_perc",
)


@pytest.fixture(scope="module")
def make_server(tmp_path_factory):
    servers: list[Server] = []

    def make(name: str, extra_args: list[str] | None = None) -> Server:
        servers.append(start_server(name, extra_args or [], tmp_path_factory.mktemp("server")))
        return servers[-1]

    make.servers = servers  # read by servers_come_to_rest
    yield make
    for server in servers:
        stop_server(server)


@pytest.fixture(autouse=True)
def servers_come_to_rest(request):
    """The invariant check after each test (see the module docstring)."""
    yield
    if "make_server" not in request.fixturenames:
        return  # the test started no server
    for server in request.getfixturevalue("make_server").servers:
        busy = wait_for_rest(server, REST_TIMEOUT_S)
        if busy:
            pytest.fail(f"server {server.base_url} not at rest {REST_TIMEOUT_S:g} s after the "
                        f"test: {busy}", pytrace=False)


def wait_for_rest(server: Server, timeout_s: float) -> dict[str, object]:
    """{} once every at-rest gauge is 0 (or the server has exited); else the
    gauges still busy when ``timeout_s`` runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        busy = busy_gauges(server)
        if not busy or time.monotonic() > deadline:
            return busy
        time.sleep(0.1)


def busy_gauges(server: Server) -> dict[str, object]:
    if server.process.poll() is not None:
        return {}  # an exited server holds nothing
    api_key = getattr(server, "api_key", None)  # for a server whose /metrics needs the key
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{server.base_url}/metrics", headers=headers, timeout=10)
    except httpx.HTTPError as err:
        return {"/metrics": repr(err)}
    if response.status_code == 401 and not api_key:
        return {}  # its /metrics needs a key this test did not give the Server: cannot check
    values = {name: float(value) for name, value in re.findall(
        r'^(cadence:[\w:]+)\{[^}]*\}\s+(\S+)$', response.text, re.MULTILINE)}
    missing = {name: "missing" for name in AT_REST_GAUGES if name not in values}
    return missing or {name: values[name] for name in AT_REST_GAUGES if values[name] != 0.0}
