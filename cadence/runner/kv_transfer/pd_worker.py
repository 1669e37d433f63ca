"""Prefill/decode disaggregation, worker side: serve held blocks, pull remote ones.

The scheduler side (``cadence.core.kv_transfer.pd_connector``) plans; this side
moves bytes, through a ``KVTransport``:

- a prefill engine *holds* a finished request's blocks (the scheduler delays
  freeing them) and serves them from its KV cache until a decode engine has
  pulled them, or until ``hold_timeout_s`` passes; either way the request
  is reported in ``finished_sending`` and the scheduler frees its blocks;
- a decode engine *loads*: a pool thread fetches the bytes, the runner's
  thread copies them into the cache in ``get_finished`` (so the cache is
  only written between steps' forwards, by the thread that runs them) and
  reports the request in ``finished_recving``. A fetch that fails or times
  out marks the request's blocks invalid (``get_block_ids_with_load_errors``):
  the scheduler then recomputes those tokens.

Block bytes are the cache's own layout, ``[L, 2, n, block_size, Hkv, D]``;
a payload of another shape or dtype (another model) is a failed load.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from cadence.core.kv_transfer.pd_connector import (
    CONSUMER, BOTH, PDConnectorMetadata, PDOptions, RemoteBlocks,
)
from cadence.runner.kv_transfer.base import KVConnectorWorker
from cadence.runner.kv_transfer.transport import (
    GONE, NOT_READY, BlockPayload, KVTransferError, KVTransport, ZmqTransport,
)

if TYPE_CHECKING:
    from cadence.config import KVTransferConfig
    from cadence.core.sched.kv_connector import KVConnectorContext
    from cadence.runner.kv_cache import PagedKVCache

logger = logging.getLogger("cadence.kv_transfer")

_NUM_FETCH_THREADS = 2
# Ids of requests freed here, kept so a late fetch is answered GONE (not NOT_READY).
_MAX_RELEASED_IDS = 10_000


def make_transport(options: PDOptions) -> KVTransport:
    """The transport ``options.transport`` names, bound where a producer serves."""
    if options.transport == "zmq":
        return ZmqTransport(options.address)
    raise ValueError(f"kv_connector_extra_config.transport: unknown {options.transport!r}")


class PDConnectorWorker(KVConnectorWorker):
    """One engine's end of prefill/decode KV transfers."""

    def __init__(self, config: "KVTransferConfig", context: "KVConnectorContext", *,
                 transport: KVTransport | None = None) -> None:
        self.role = config.kv_role or BOTH
        options = PDOptions.from_extra(config.kv_connector_extra_config)
        self.transport = transport if transport is not None else make_transport(options)
        self.transfer_timeout_s = options.transfer_timeout_s
        self.hold_timeout_s = options.hold_timeout_s
        self.kv_data: torch.Tensor | None = None  # [L, 2, num_blocks, block_size, Hkv, D]
        self.address: str | None = None
        self._lock = threading.Lock()  # holds and sent, shared with the serving thread
        self._holds: dict[str, tuple[frozenset[int], float]] = {}  # req_id -> (blocks, deadline)
        self._sent: set[str] = set()
        self._released: set[str] = set()  # freed here: a late fetch is answered GONE
        self._fetches: dict[str, tuple[RemoteBlocks, Future[BlockPayload]]] = {}
        self._pool = ThreadPoolExecutor(_NUM_FETCH_THREADS, thread_name_prefix="cadence-kv-fetch")
        self._invalid_block_ids: set[int] = set()

    def register_kv_caches(self, kv_caches: "PagedKVCache") -> None:
        """The cache blocks live in; a producer starts serving them."""
        self.kv_data = kv_caches.data
        if self.role != CONSUMER and self.address is None:
            try:
                self.address = self.transport.serve(self)
            except KVTransferError as err:  # e.g. another engine took the port
                raise ValueError(f"kv_connector_extra_config.kv_port: {err}") from None
            logger.info("kv transfer: serving blocks at %s", self.address)

    # ------------------------------------------------------------ each step

    def start_load_kv(self, metadata: PDConnectorMetadata | None) -> None:
        """Before the step's forward: take new holds, start new fetches."""
        if metadata is None:
            return
        if metadata.holds:
            deadline = time.monotonic() + self.hold_timeout_s
            with self._lock:
                for req_id, block_ids in metadata.holds.items():
                    self._holds[req_id] = (frozenset(block_ids), deadline)
        for load in metadata.loads:
            future = self._pool.submit(self.transport.fetch, load.remote_address,
                                       load.remote_request_id, load.remote_block_ids,
                                       self.transfer_timeout_s)
            if load.local_block_ids:  # an empty one only tells the peer to free
                self._fetches[load.req_id] = (load, future)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """After the step's forward: (requests whose blocks were sent or whose
        hold expired, requests whose load finished, failed ones included)."""
        for req_id in finished_req_ids:
            self._fetches.pop(req_id, None)  # aborted while loading: its blocks are gone
        return self._take_sent(), self._take_loaded()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (their tokens are recomputed)."""
        invalid, self._invalid_block_ids = self._invalid_block_ids, set()
        return invalid

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.transport.close()

    # ------------------------------------------------------------ sending

    def read_blocks(self, request_id: str, block_ids: list[int]) -> BlockPayload | str:
        """Called on the transport's thread. The copy is made under the lock, so a
        hold that expires meanwhile frees its blocks only after it."""
        with self._lock:
            hold = self._holds.get(request_id)
            if hold is None:
                return GONE if request_id in self._released else NOT_READY
            if not set(block_ids) <= hold[0]:
                return GONE
            assert self.kv_data is not None
            index = torch.tensor(block_ids, dtype=torch.long, device=self.kv_data.device)
            blocks = self.kv_data.index_select(2, index).cpu().contiguous()
        data = blocks.view(torch.uint8).numpy()
        return BlockPayload(memoryview(data), tuple(blocks.shape), str(blocks.dtype))

    def mark_sent(self, request_id: str) -> None:
        with self._lock:
            if self._holds.pop(request_id, None) is not None:
                self._sent.add(request_id)

    def _take_sent(self) -> set[str]:
        now = time.monotonic()
        with self._lock:
            expired = [req_id for req_id, (_, deadline) in self._holds.items() if deadline <= now]
            for req_id in expired:
                del self._holds[req_id]
                logger.warning("kv transfer: %s was not pulled in %.0fs; its blocks are freed",
                               req_id, self.hold_timeout_s)
            sent, self._sent = self._sent | set(expired), set()
            self._released |= sent
            if len(self._released) > _MAX_RELEASED_IDS:
                self._released = set(sent)
        return sent

    # ------------------------------------------------------------ loading

    def _take_loaded(self) -> set[str]:
        done = [req_id for req_id, (_, future) in self._fetches.items() if future.done()]
        for req_id in done:
            load, future = self._fetches.pop(req_id)
            try:
                self._write_blocks(load, future.result())
            except Exception as err:  # noqa: BLE001 - any failure: the prompt is computed here
                logger.warning("kv transfer: loading %s failed (%s: %s); its prompt is recomputed",
                               req_id, type(err).__name__, err)
                self._invalid_block_ids.update(load.local_block_ids)
        return set(done)

    def _write_blocks(self, load: RemoteBlocks, payload: BlockPayload) -> None:
        assert self.kv_data is not None
        kv = self.kv_data
        expected = (kv.shape[0], kv.shape[1], len(load.local_block_ids), *kv.shape[3:])
        if tuple(payload.shape) != expected or payload.dtype != str(kv.dtype):
            raise ValueError(f"blocks of shape {payload.shape} {payload.dtype}, "
                             f"expected {expected} {kv.dtype}")
        incoming = torch.frombuffer(bytearray(payload.data), dtype=torch.uint8)
        blocks = incoming.view(kv.dtype).view(expected)
        kv[:, :, torch.tensor(load.local_block_ids, dtype=torch.long)] = blocks.to(kv.device)
