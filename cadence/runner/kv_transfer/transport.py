"""KV transport: block bytes pulled from the engine that holds them.

The decode engine *pulls*: it learns where a prompt's KV lives (address,
request id, block ids) from the request's ``kv_transfer_params`` and asks
that address for the blocks; the prefill engine answers from its cache.

    decode engine                                   prefill engine
    fetch(address, req_id, block_ids, timeout) ──►  serve(provider)
                                               ◄──  header + block bytes
                                                    (provider.mark_sent(req_id))

``KVTransport`` is the interface; ``ZmqTransport`` carries it over ZMQ
(TCP, ``ipc://`` or ``inproc://``: one host today, a network tomorrow with
the same code, since TCP addresses travel as they are). A transport over
RDMA or NIXL would implement the same two verbs.

Failures never hang: every fetch has a deadline, and a peer that says the
blocks are gone (freed after its hold timeout, an unknown request, a bad
block id) answers at once; both raise ``KVTransferError``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import zmq

logger = logging.getLogger("cadence.kv_transfer")

# Status of a reply, the first field of its header.
OK, NOT_READY, GONE = "ok", "not_ready", "gone"
# How long a fetch waits before asking again for blocks not registered yet.
_RETRY_INTERVAL_S = 0.02
_SERVE_POLL_MS = 100


class KVTransferError(RuntimeError):
    """A fetch failed (timed out, the blocks are gone, a malformed reply)."""


@dataclass(frozen=True)
class BlockPayload:
    """Blocks as bytes, with the layout the receiver checks before copying."""

    data: bytes | memoryview
    shape: tuple[int, ...]
    dtype: str


class BlockProvider(Protocol):
    """What a serving transport reads blocks from (the prefill engine's worker)."""

    def read_blocks(self, request_id: str, block_ids: list[int]) -> BlockPayload | str:
        """The blocks' bytes, or why not: ``NOT_READY`` (not registered yet) or
        ``GONE`` (freed, unknown, or ids the request does not hold)."""

    def mark_sent(self, request_id: str) -> None:
        """The request's blocks were handed over: they may be freed."""


class KVTransport(ABC):
    """Serves this engine's blocks and fetches other engines' blocks."""

    @abstractmethod
    def serve(self, provider: BlockProvider) -> str:
        """Start answering fetches from ``provider``; returns the address peers use
        (``KVTransferError`` when it cannot listen there)."""

    @abstractmethod
    def fetch(self, address: str, request_id: str, block_ids: list[int],
              timeout_s: float) -> BlockPayload:
        """The blocks ``block_ids`` of ``request_id`` at ``address``; raises
        ``KVTransferError`` by the deadline. An empty ``block_ids`` only tells the
        peer the blocks are no longer needed. Callable from any thread."""

    @abstractmethod
    def close(self) -> None:
        """Stop serving; fetches in flight fail."""


class ZmqTransport(KVTransport):
    """ROUTER socket answering fetches on a thread; one DEALER per fetch.

    ``bind``: a ZMQ endpoint; ``tcp://HOST:0`` takes a free port.
    """

    def __init__(self, bind: str = "tcp://127.0.0.1:0") -> None:
        self._bind = bind
        self._context = zmq.Context()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.address: str | None = None

    # ------------------------------------------------------------ serving

    def serve(self, provider: BlockProvider) -> str:
        if self._thread is not None:
            raise RuntimeError("serve: this transport already serves")
        socket = self._context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.bind(self._bind)
        except zmq.ZMQError as err:
            socket.close(linger=0)
            raise KVTransferError(f"cannot serve KV blocks at {self._bind}: {err}") from None
        self.address = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._thread = threading.Thread(target=self._serve_loop, args=(socket, provider),
                                        name="cadence-kv-serve", daemon=True)
        self._thread.start()
        return self.address

    def _serve_loop(self, socket: zmq.Socket, provider: BlockProvider) -> None:
        try:
            while not self._stop.is_set():
                if socket.poll(_SERVE_POLL_MS):
                    identity, _, body = socket.recv_multipart()
                    socket.send_multipart([identity, b"", *self._answer(provider, body)], copy=False)
        finally:
            socket.close(linger=0)

    @staticmethod
    def _answer(provider: BlockProvider, body: bytes) -> list[bytes | memoryview]:
        """The reply to one fetch; never raises (the serving thread must live on)."""
        try:
            return ZmqTransport._reply(provider, body)
        except Exception:  # a bug here must not stop every later transfer
            logger.exception("kv transfer: answering a fetch failed")
            return [json.dumps({"status": GONE, "reason": "the server failed"}).encode()]

    @staticmethod
    def _reply(provider: BlockProvider, body: bytes) -> list[bytes | memoryview]:
        try:
            ask = json.loads(body)
            request_id, block_ids = str(ask["request_id"]), [int(b) for b in ask["block_ids"]]
        except (ValueError, KeyError, TypeError):
            return [json.dumps({"status": GONE, "reason": "malformed fetch"}).encode()]
        if not block_ids:  # the peer no longer needs them
            provider.mark_sent(request_id)
            return [json.dumps({"status": OK}).encode()]
        payload = provider.read_blocks(request_id, block_ids)
        if isinstance(payload, str):
            return [json.dumps({"status": payload}).encode()]
        provider.mark_sent(request_id)
        header = {"status": OK, "shape": list(payload.shape), "dtype": payload.dtype}
        return [json.dumps(header).encode(), payload.data]

    # ------------------------------------------------------------ fetching

    def fetch(self, address: str, request_id: str, block_ids: list[int],
              timeout_s: float) -> BlockPayload:
        deadline = time.monotonic() + timeout_s
        body = json.dumps({"request_id": request_id, "block_ids": list(block_ids)}).encode()
        while True:
            frames = self._ask(address, body, deadline)
            header = json.loads(frames[0])
            status = header.get("status")
            if status == OK:
                return _payload_of(header, frames)
            if status != NOT_READY:
                raise KVTransferError(f"{address} has no blocks for {request_id}: {status}")
            if time.monotonic() + _RETRY_INTERVAL_S >= deadline:
                raise KVTransferError(f"{address}: blocks of {request_id} not ready in {timeout_s}s")
            time.sleep(_RETRY_INTERVAL_S)

    def _ask(self, address: str, body: bytes, deadline: float) -> list[bytes]:
        """One round trip on a fresh socket (a timed-out one is simply dropped)."""
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.connect(address)
            socket.send_multipart([b"", body])
            remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not socket.poll(remaining_ms):
                raise KVTransferError(f"{address}: no answer by the deadline")
            _, *frames = socket.recv_multipart()
            return frames
        except zmq.ZMQError as err:
            raise KVTransferError(f"{address}: {err}") from None
        finally:
            socket.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._context.term()


def _payload_of(header: dict, frames: list[bytes]) -> BlockPayload:
    if "shape" not in header:
        return BlockPayload(b"", (), "")
    if len(frames) != 2:
        raise KVTransferError("a reply without its block bytes")
    return BlockPayload(frames[1], tuple(header["shape"]), str(header["dtype"]))
