"""``cadence serve <Hub id>`` (issue 38 item 4): the model is fetched from a stand-in Hub
on loopback (tests/models/hub_standin.py; HF_ENDPOINT and HF_HUB_OFFLINE off in the
server's environment only), and /v1/models, the model field and the start-up log name
it as the user did."""

from __future__ import annotations

import httpx
import pytest

from tests.models.hub_standin import GGUF_REPO, StandInHub, add_test_repos, hub_env
from tests.server.serverlib import start_server, stop_server


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with StandInHub() as hub:
        add_test_repos(hub, str(tmp_path_factory.mktemp("repos")))
        folder = tmp_path_factory.mktemp("server")
        env = {k: v for k, v in hub_env(hub, str(folder)).items()
               if k.startswith("HF_") or k == "TRANSFORMERS_OFFLINE"}  # over this process's
        server = start_server("hub", [GGUF_REPO], folder, env=env)  # cadence serve MODEL
        try:
            yield server
        finally:
            stop_server(server)


def test_v1_models_and_the_log_name_the_model_as_given(served):
    cards = httpx.get(f"{served.base_url}/v1/models", timeout=30).json()["data"]
    assert [(card["id"], card["root"]) for card in cards] == [(GGUF_REPO, GGUF_REPO)]
    log = served.log()
    assert f"cadence: serving {GGUF_REPO} at {served.base_url}/v1" in log
    assert f"cadence: model {GGUF_REPO} (revision main) -> " in log
    assert "SmolLM2-135M-Instruct-Q4_K_M.gguf" in log


def test_requests_name_the_model_as_given(served):
    body = {"model": GGUF_REPO, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 3}
    answer = httpx.post(f"{served.base_url}/v1/chat/completions", json=body, timeout=120).json()
    assert answer["model"] == GGUF_REPO and answer["usage"]["completion_tokens"] == 3
