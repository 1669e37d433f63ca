"""A scheduling policy from outside the package, named on ``cadence serve``'s
command line by its import path or by the name an installed package declares
(entry points): the engine process imports and runs it, and its refusal (the
contract's ``AdmissionRefused``) reaches the client as 429."""

from __future__ import annotations

import os

import httpx
import pytest

POLICY = "tests.plugins.shortest_first:ShortPromptsOnly"


@pytest.fixture(scope="module", params=["import path", "installed name"])
def server(request, make_server, tmp_path_factory):
    if request.param == "import path":
        return make_server("custom-policy", ["--policy", POLICY, "--max-num-seqs", "2"])
    from tests.plugins.installed import install_plugin
    from tests.server.serverlib import start_server

    site = install_plugin(tmp_path_factory.mktemp("site"))
    server = start_server("installed-policy", ["--policy", "short-prompts-only", "--max-num-seqs", "2"],
                          tmp_path_factory.mktemp("server"),
                          env={"PYTHONPATH": os.pathsep.join([str(site), os.getcwd()])})
    make_server.servers.append(server)  # stopped (and checked at rest) with the others
    return server


def complete(server, prompt, **fields):
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True, **fields}
    return httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)


def test_the_policy_serves_what_it_admits(server):
    response = complete(server, "The capital of France is")
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("stream", [False, True])
def test_the_policys_refusal_is_a_429_with_its_retry_after(server, stream):
    long_prompt = "one two three four five six seven eight nine ten " * 8
    response = complete(server, long_prompt, stream=stream)
    assert response.status_code == 429, response.text
    assert response.headers["Retry-After"] == "7"
    assert "this policy admits at most 32" in response.json()["error"]["message"]
    # The engine goes on: the next short request is served.
    assert complete(server, "Hello").status_code == 200


def test_an_unknown_policy_path_stops_the_server_at_start(tmp_path):
    from tests.server.serverlib import start_server

    with pytest.raises(RuntimeError, match="policy"):
        start_server("bad-policy", ["--policy", "tests.plugins.shortest_first:NoSuchPolicy"], tmp_path)
