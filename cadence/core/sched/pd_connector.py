"""Prefill/decode disaggregation, scheduler side: the prompt's KV is computed
by a *prefill* engine (``kv_producer``) and pulled by a *decode* engine
(``kv_consumer``), as vLLM's NixlConnector does it.

    client/proxy ──{do_remote_decode}, max_tokens=1──► prefill engine
                 ◄──kv_transfer_params─── request_finished: blocks held, where they are
    client/proxy ──kv_transfer_params──► decode engine
        get_num_new_matched_tokens: the prompt is external, loaded asynchronously
        (WAITING_FOR_REMOTE_KVS while its worker pulls the blocks), then decodes;
        the prefill engine frees its blocks once they are pulled (or its hold times out).

The kv_transfer_params (vLLM's names):

- to the prefill engine: ``{"do_remote_decode": true}``;
- back from it, to pass on to the decode engine: ``do_remote_prefill``,
  ``remote_request_id``, ``remote_block_ids``, ``remote_host``,
  ``remote_port``, ``remote_engine_id``, plus ``remote_num_tokens`` (the
  prompt length whose KV the blocks hold: a decode request with another
  prompt length computes its prompt itself instead).

The worker side (``cadence.runner.kv_transfer.pd_worker``) reads the
``PDConnectorMetadata`` of each step: blocks to hold for sending, loads to
start, peers to tell that their blocks are not needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cadence.core.request import RequestStatus
from cadence.core.sched.kv_connector import KVConnectorBase

if TYPE_CHECKING:
    from cadence.core.kv_cache.block_pool import KVCacheBlock
    from cadence.core.request import Request
    from cadence.core.sched.output import SchedulerOutput

PRODUCER, CONSUMER, BOTH = "kv_producer", "kv_consumer", "kv_both"
PD_ROLES = (PRODUCER, CONSUMER, BOTH)
_REMOTE_FIELDS = ("remote_request_id", "remote_block_ids", "remote_host", "remote_port",
                  "remote_num_tokens")


@dataclass(frozen=True)
class RemoteBlocks:
    """Blocks to pull from a peer into ``local_block_ids`` (same length);
    both empty: only tell the peer its blocks are no longer needed."""

    req_id: str
    local_block_ids: list[int]
    remote_block_ids: list[int]
    remote_address: str
    remote_request_id: str


@dataclass
class PDConnectorMetadata:
    """One step's work for the worker side."""

    # req_id -> block ids to serve to a decode engine until it pulls them.
    holds: dict[str, list[int]] = field(default_factory=dict)
    loads: list[RemoteBlocks] = field(default_factory=list)
    # Requests that left this step (their loads, if any, are dropped).
    finished_req_ids: set[str] = field(default_factory=set)


def check_kv_transfer_params(params: Any, role: str | None) -> None:
    """ValueError naming ``kv_transfer_params`` when this engine cannot act on them
    (``role`` None: no P/D connector configured)."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise ValueError("kv_transfer_params: must be an object")
    if role is None:
        raise ValueError("kv_transfer_params: this server has no prefill/decode KV connector; "
                         "start it with --kv-transfer-config")
    if params.get("do_remote_decode") and role == CONSUMER:
        raise ValueError("kv_transfer_params: do_remote_decode asks a prefill instance, "
                         "and this one is a kv_consumer")
    if params.get("do_remote_prefill"):
        if role == PRODUCER:
            raise ValueError("kv_transfer_params: do_remote_prefill asks a decode instance, "
                             "and this one is a kv_producer")
        missing = [name for name in _REMOTE_FIELDS if params.get(name) is None]
        if missing:
            raise ValueError(f"kv_transfer_params: do_remote_prefill needs {', '.join(missing)}")
        ids = params["remote_block_ids"]
        if not isinstance(ids, list) or not all(isinstance(b, int) and b >= 0 for b in ids):
            raise ValueError("kv_transfer_params: remote_block_ids must be a list of block ids")


class PDConnectorScheduler(KVConnectorBase):
    """Hold a finished prefill's blocks for a peer; load a decode's prompt from one.

    ``host``/``port``: where this engine's worker serves its blocks (told to
    clients in the params); ``engine_id`` names this engine to its peers.
    """

    def __init__(self, role: str, block_size: int, *, host: str, port: int,
                 engine_id: str) -> None:
        if role not in PD_ROLES:
            raise ValueError(f"kv_role: must be one of {', '.join(PD_ROLES)}, got {role!r}")
        self.role = role
        self.block_size = block_size
        self.host, self.port, self.engine_id = host, port, engine_id
        self._meta = PDConnectorMetadata()
        # Requests whose remote prompt was already asked for (a preempted one recomputes).
        self._asked: set[str] = set()

    # ------------------------------------------------------------ decode side

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        params = self._remote_prefill(request)
        num_prompt = request.num_prompt_tokens
        if (params is None or params["remote_num_tokens"] != num_prompt
                or len(params["remote_block_ids"]) < -(-num_prompt // self.block_size)):
            return 0, False  # not this prompt's KV: computed here instead
        num_external = request.num_prompt_tokens - num_computed_tokens
        return (num_external, True) if num_external > 0 else (0, False)

    def update_state_after_alloc(self, request: "Request", blocks: "list[KVCacheBlock]",
                                 num_external_tokens: int) -> None:
        params = self._remote_prefill(request)
        if params is None:
            return
        self._asked.add(request.request_id)
        address = f"tcp://{params['remote_host']}:{params['remote_port']}"
        remote_request_id = str(params["remote_request_id"])
        if num_external_tokens <= 0:  # all local (or refused): the peer may free its blocks
            self._meta.loads.append(RemoteBlocks(request.request_id, [], [], address,
                                                 remote_request_id))
            return
        first = (request.num_prompt_tokens - num_external_tokens) // self.block_size
        num_blocks = -(-request.num_prompt_tokens // self.block_size)
        local = [block.block_id for block in blocks[first:num_blocks]]
        remote = list(params["remote_block_ids"][first:num_blocks])
        self._meta.loads.append(RemoteBlocks(request.request_id, local, remote, address,
                                             remote_request_id))

    def _remote_prefill(self, request: "Request") -> dict | None:
        params = request.kv_transfer_params
        if (self.role == PRODUCER or not params or not params.get("do_remote_prefill")
                or request.request_id in self._asked):
            return None
        return params

    # ------------------------------------------------------------ prefill side

    def request_finished(self, request: "Request", block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        self._asked.discard(request.request_id)
        params = request.kv_transfer_params
        if (self.role == CONSUMER or not params or not params.get("do_remote_decode")
                or request.status != RequestStatus.FINISHED_LENGTH_CAPPED or not block_ids):
            # Aborted, or stopped on its first token: nothing left to decode elsewhere.
            return False, None
        num_blocks = -(-request.num_prompt_tokens // self.block_size)
        self._meta.holds[request.request_id] = list(block_ids)
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_request_id": request.request_id,
            "remote_block_ids": list(block_ids[:num_blocks]),
            "remote_num_tokens": request.num_prompt_tokens,
            "remote_host": self.host, "remote_port": self.port,
            "remote_engine_id": self.engine_id,
        }

    # ------------------------------------------------------------ each step

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> PDConnectorMetadata:
        meta, self._meta = self._meta, PDConnectorMetadata()
        meta.finished_req_ids = set(scheduler_output.finished_req_ids)
        return meta
