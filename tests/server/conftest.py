"""tests/server: the OpenAI API of a real ``cadence serve``, driven by the
official ``openai`` client. Each module starts its server once (the default
model loads once per module) and stops it at the end."""

from __future__ import annotations

import pytest

from serverlib import Server, start_server, stop_server


@pytest.fixture(scope="module")
def make_server(tmp_path_factory):
    servers: list[Server] = []

    def make(name: str, extra_args: list[str] | None = None) -> Server:
        servers.append(start_server(name, extra_args or [], tmp_path_factory.mktemp("server")))
        return servers[-1]

    yield make
    for server in servers:
        stop_server(server)
