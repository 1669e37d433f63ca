"""Publish KV-cache events over ZeroMQ, on vLLM's wire protocol.

A router in front of several replicas subscribes to learn which replica holds
which prefix. One engine step's events travel as one ``KVEventBatch``:

    PUB      [topic, seq, msgpack(KVEventBatch)]      seq: 8 bytes, big-endian

``seq`` counts batches from 0 per publisher and is taken when a batch is
queued, so a batch dropped on overflow leaves a gap: a subscriber that sees
one knows it lost cache state. It can ask the replay socket (a ROUTER, when
configured) for the batches it missed, from the ring of the last
``buffer_steps`` sent:

    request  [b"", start_seq]                          (a REQ socket adds the b"")
    replies  [b"", seq, payload]    for each buffered seq >= start_seq, oldest first
    end      [b"", END_SEQ, b""]                       END_SEQ: -1, signed

Memory stays bounded: at most ``max_queue_size`` batches wait for the sender
thread (beyond that the oldest is dropped and counted in ``num_dropped``),
``buffer_steps`` sent batches are kept for replay, and the PUB socket's
high-water mark bounds what ZeroMQ holds per subscriber.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

import msgspec
import zmq

from cadence.config import CacheConfig
from cadence.core.kv_cache.events import KVCacheEvent

logger = logging.getLogger("cadence.kv_events")

DEFAULT_ENDPOINT = "tcp://*:5557"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_IDLE_WAIT_SECONDS = 0.05  # how long an idle sender waits before checking for replay requests
_CLOSE_TIMEOUT_SECONDS = 1.0


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The cache events of one engine step, in the order they happened."""

    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    """A sequence number frame; -1 is the replay's end marker."""
    return int.from_bytes(frame, "big", signed=True)


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard or local address, connect to any other
    (a stable subscriber binds, volatile engines connect to it)."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    return any(wildcard in endpoint for wildcard in ("*", "::", "0.0.0.0"))


def publisher_for(cache_config: CacheConfig) -> ZmqEventPublisher | None:
    """The publisher the cache options ask for; None when events are off."""
    if not cache_config.enable_kv_cache_events:
        return None
    return ZmqEventPublisher(
        cache_config.kv_events_endpoint,
        replay_endpoint=cache_config.kv_events_replay_endpoint,
        topic=cache_config.kv_events_topic,
        buffer_steps=cache_config.kv_events_buffer_steps,
    )


class ZmqEventPublisher:
    """Sends ``KVEventBatch``es from a background thread; ``publish`` never blocks.

    Ownership: the constructor creates the sockets and binds or connects them
    (so a bad or busy address fails here, in the caller), then hands them to
    the sender thread, which alone touches them afterwards. The caller and the
    thread share only the queue and its counters, under ``_cond``.
    """

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        max_queue_size: int = 100_000,
        hwm: int = 100_000,
    ) -> None:
        if buffer_steps < 1:
            raise ValueError("buffer_steps: must be >= 1")
        if max_queue_size < 1:
            raise ValueError("max_queue_size: must be >= 1")
        self.endpoint = endpoint
        self.topic = topic
        self._topic_bytes = topic.encode("utf-8")
        self._ctx = zmq.Context()
        try:
            self._pub, self._replay = self._open_sockets(endpoint, replay_endpoint, hwm)
        except zmq.ZMQError:
            self._ctx.destroy(linger=0)
            raise
        self._max_queue_size = max_queue_size
        self._queue: deque[tuple[int, KVEventBatch]] = deque()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)  # sender thread only
        self._cond = threading.Condition()
        self._next_seq = 0
        self._closing = False
        # Set on a data-parallel replica: stamped on every batch it publishes.
        self.data_parallel_rank: int | None = None
        self.num_dropped = 0
        self.num_sent = 0
        self._thread = threading.Thread(target=self._run, name="cadence-kv-events", daemon=True)
        self._thread.start()

    def _open_sockets(
        self, endpoint: str, replay_endpoint: str | None, hwm: int
    ) -> tuple[zmq.Socket, zmq.Socket | None]:
        pub = self._ctx.socket(zmq.PUB)
        pub.set_hwm(hwm)
        if binds(endpoint):
            pub.bind(endpoint)
        else:
            pub.connect(endpoint)
        replay = None
        if replay_endpoint is not None:
            replay = self._ctx.socket(zmq.ROUTER)
            replay.bind(replay_endpoint)
        return pub, replay

    # ---- caller side ---------------------------------------------------

    def publish(self, batch: KVEventBatch) -> int | None:
        """Queue ``batch``; its sequence number, or None once closed.

        A full queue drops its oldest batch (counted in ``num_dropped``): the
        engine step never waits on the network.
        """
        with self._cond:
            if self._closing:
                return None
            if len(self._queue) >= self._max_queue_size:
                self._queue.popleft()
                self._count_dropped()
            seq = self._next_seq
            self._next_seq += 1
            if self.data_parallel_rank is not None:
                batch.data_parallel_rank = self.data_parallel_rank
            self._queue.append((seq, batch))
            self._cond.notify()
        return seq

    def close(self, timeout: float = _CLOSE_TIMEOUT_SECONDS) -> None:
        """Send what is queued (for up to ``timeout`` seconds), then close the
        sockets. Later ``publish`` calls are ignored; closing twice is harmless."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("cadence: KV event sender did not stop in %.1fs", timeout)
        elif not self._ctx.closed:
            self._ctx.term()  # the thread closed its sockets on the way out

    def _count_dropped(self) -> None:
        self.num_dropped += 1
        if self.num_dropped & (self.num_dropped - 1) == 0:  # 1, 2, 4, ...: log sparsely
            logger.warning("cadence: %d KV event batches dropped (queue full)", self.num_dropped)

    # ---- sender thread -------------------------------------------------

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        try:
            while (items := self._take_queued()) is not None:
                for seq, batch in items:
                    self._send(encoder, seq, batch)
                if self._replay is not None:
                    self._serve_replay_requests()
        except Exception:  # a bug here must not end the thread silently
            logger.exception("cadence: KV event sender failed")
        finally:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _take_queued(self) -> list[tuple[int, KVEventBatch]] | None:
        """Every queued batch, possibly none after a short idle wait; None
        once closing with nothing left to send."""
        with self._cond:
            if not self._queue and not self._closing:
                self._cond.wait(_IDLE_WAIT_SECONDS)
            if not self._queue:
                return None if self._closing else []
            items = list(self._queue)
            self._queue.clear()
        return items

    def _send(self, encoder: msgspec.msgpack.Encoder, seq: int, batch: KVEventBatch) -> None:
        payload = encoder.encode(batch)
        try:
            # PUB never blocks: past the high-water mark ZeroMQ drops for that subscriber.
            self._pub.send_multipart([self._topic_bytes, encode_seq(seq), payload])
        except zmq.ZMQError as err:
            logger.warning("cadence: KV event batch %d not sent: %s", seq, err)
            with self._cond:
                self._count_dropped()
            return
        self._buffer.append((seq, payload))
        with self._cond:
            self.num_sent += 1

    def _serve_replay_requests(self) -> None:
        """Answer each waiting request ``[identity, b"", start_seq]`` with the
        buffered batches from ``start_seq`` on, then the end marker."""
        replay = self._replay
        while replay.poll(0):
            frames = replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("cadence: malformed KV event replay request (%d frames)", len(frames))
                continue
            identity, _, start = frames
            start_seq = decode_seq(start)
            for seq, payload in self._buffer:
                if seq >= start_seq:
                    replay.send_multipart([identity, b"", encode_seq(seq), payload])
            replay.send_multipart([identity, b"", END_SEQ, b""])
