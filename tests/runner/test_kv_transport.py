"""The ZMQ KV transport on loopback: blocks fetched as bytes, every failure a
``KVTransferError`` by the deadline, a serving side that outlives its errors."""

from __future__ import annotations

import time

import pytest

from cadence.runner.kv_transfer.transport import (
    GONE, NOT_READY, BlockPayload, KVTransferError, ZmqTransport,
)


class Provider:
    def __init__(self):
        self.blocks = {"r": BlockPayload(b"\x01\x02\x03\x04", (2, 2), "torch.uint8")}
        self.sent: list[str] = []
        self.explode = False

    def read_blocks(self, request_id, block_ids):
        if self.explode:
            raise RuntimeError("a bug")
        if request_id == "later":
            return NOT_READY
        return self.blocks.get(request_id, GONE)

    def mark_sent(self, request_id):
        self.sent.append(request_id)


@pytest.fixture
def served():
    server, client, provider = ZmqTransport(), ZmqTransport(), Provider()
    address = server.serve(provider)
    yield address, client, provider
    client.close()
    server.close()


def test_fetch_returns_the_blocks_and_marks_them_sent(served):
    address, client, provider = served
    payload = client.fetch(address, "r", [0, 1], timeout_s=5)
    assert bytes(payload.data) == b"\x01\x02\x03\x04" and payload.shape == (2, 2)
    assert provider.sent == ["r"]
    client.fetch(address, "done-with", [], timeout_s=5)  # only tells the peer to free
    assert provider.sent == ["r", "done-with"]


def test_failures_raise_by_the_deadline(served):
    address, client, provider = served
    with pytest.raises(KVTransferError, match="gone"):
        client.fetch(address, "unknown", [0], timeout_s=5)
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="not ready|no answer"):
        client.fetch(address, "later", [0], timeout_s=0.3)
    assert time.monotonic() - start < 2
    with pytest.raises(KVTransferError, match="no answer"):
        client.fetch("tcp://127.0.0.1:9", "r", [0], timeout_s=0.3)  # nobody serves there
    provider.explode = True
    with pytest.raises(KVTransferError, match="gone"):
        client.fetch(address, "r", [0], timeout_s=5)
    provider.explode = False  # the serving thread lived through it
    assert client.fetch(address, "r", [0], timeout_s=5).shape == (2, 2)
