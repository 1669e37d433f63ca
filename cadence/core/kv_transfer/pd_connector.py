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
  ``remote_port``, ``remote_engine_id``, plus cadence's ``remote_num_tokens``,
  ``remote_block_size`` and ``remote_prompt_digest`` (what the blocks hold:
  a decode request whose prompt differs computes its prompt itself instead).

KV cache groups (``cadence.core.kv_cache.groups``): ``remote_block_ids`` is
then one list per group (vLLM sends one per KV cache group too), and a decode
engine pulls, in a window group, only the positions its window reads once the
prompt is loaded; the two engines must group their layers alike (the same
model and options do), else the decode engine computes the prompt itself.

The worker side (``cadence.runner.kv_transfer.pd_worker``) reads the
``PDConnectorMetadata`` of each step: blocks to hold for sending, loads to
start, peers to tell that their blocks are not needed.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from cadence.core.kv_cache.groups import as_groups, first_entry_in_window
from cadence.core.request import RequestStatus
from cadence.core.sched.kv_connector import KVConnectorBase

if TYPE_CHECKING:
    from cadence.core.kv_cache import BlockIds, Blocks
    from cadence.config import KVTransferConfig
    from cadence.core.kv_cache import AnyKVCacheManager
    from cadence.core.request import Request
    from cadence.core.sched.kv_connector import KVConnectorContext
    from cadence.core.sched.output import SchedulerOutput

logger = logging.getLogger("cadence.kv_transfer")

PRODUCER, CONSUMER, BOTH = "kv_producer", "kv_consumer", "kv_both"
_REMOTE_FIELDS = ("remote_request_id", "remote_block_ids", "remote_host", "remote_port",
                  "remote_num_tokens", "remote_block_size", "remote_prompt_digest")
TRANSPORTS = ("zmq",)


@dataclass(frozen=True)
class PDOptions:
    """The connector's own options (``kv_connector_extra_config``)."""

    kv_host: str = "127.0.0.1"  # where a producer serves its blocks (told to decoders)
    kv_port: int = 14579  # vLLM's default kv_port
    engine_id: str | None = None  # this engine's name to its peers (default host:port)
    transport: str = "zmq"
    # How long a decode engine waits for a prompt's blocks before computing it.
    transfer_timeout_s: float = 10.0
    # How long a prefill engine holds a finished prompt's blocks for a decoder.
    hold_timeout_s: float = 120.0

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> "PDOptions":
        """ValueError naming ``kv_connector_extra_config.<key>`` for a bad one."""
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"kv_connector_extra_config.{unknown[0]}: unknown option of the "
                             f"PDConnector (known: {', '.join(sorted(known))})")
        options = cls(**extra)
        options._check()
        return options

    def _check(self) -> None:
        def require(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise ValueError(f"kv_connector_extra_config.{name}: {what}, "
                                 f"got {getattr(self, name)!r}")
        require(isinstance(self.kv_host, str) and bool(self.kv_host), "kv_host", "must be a host name")
        require(_is_int(self.kv_port) and 0 < self.kv_port < 65536, "kv_port", "must be a TCP port")
        require(self.transport in TRANSPORTS, "transport", f"must be one of {', '.join(TRANSPORTS)}")
        for name in ("transfer_timeout_s", "hold_timeout_s"):
            value = getattr(self, name)
            require(_is_number(value) and value > 0, name, "must be a positive number of seconds")

    @property
    def address(self) -> str:
        return f"tcp://{self.kv_host}:{self.kv_port}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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


def check_kv_transfer_params(params: Any, role: str | None) -> None:
    """ValueError naming ``kv_transfer_params`` when an engine of ``role`` cannot
    act on them."""
    if not isinstance(params, dict):
        raise ValueError("kv_transfer_params: must be an object")
    if params.get("do_remote_decode") and role == CONSUMER:
        raise ValueError("kv_transfer_params: do_remote_decode asks a prefill instance, "
                         "and this one is a kv_consumer")
    if not params.get("do_remote_prefill"):
        return
    if role == PRODUCER:
        raise ValueError("kv_transfer_params: do_remote_prefill asks a decode instance, "
                         "and this one is a kv_producer")
    missing = [name for name in _REMOTE_FIELDS if params.get(name) is None]
    if missing:
        raise ValueError(f"kv_transfer_params: do_remote_prefill needs {', '.join(missing)}")
    ids = params["remote_block_ids"]
    groups = ids if isinstance(ids, list) and ids and all(isinstance(g, list) for g in ids) else [ids]
    if not all(isinstance(g, list) and all(_is_int(b) and b >= 0 for b in g) for g in groups):
        raise ValueError("kv_transfer_params: remote_block_ids must be a list of block ids "
                         "(or one such list per KV cache group)")
    for name in ("remote_port", "remote_num_tokens", "remote_block_size"):
        if not _is_int(params[name]) or params[name] <= 0:
            raise ValueError(f"kv_transfer_params: {name} must be a positive integer")


def prompt_digest(token_ids: list[int]) -> str:
    """A short fingerprint of a prompt: the decode engine loads KV only for the
    very prompt it was computed for."""
    return hashlib.blake2b(repr(token_ids).encode(), digest_size=12).hexdigest()


class PDConnectorScheduler(KVConnectorBase):
    """Hold a finished prefill's blocks for a peer; load a decode's prompt from one."""

    # The server accepts a request's kv_transfer_params when the engine's connector reads them.
    reads_kv_transfer_params = True

    def __init__(self, config: "KVTransferConfig", context: "KVConnectorContext") -> None:
        self.role = config.kv_role or BOTH
        self.block_size = context.block_size
        self.options = PDOptions.from_extra(config.kv_connector_extra_config)
        self.engine_id = self.options.engine_id or f"{self.options.kv_host}:{self.options.kv_port}"
        self._meta = PDConnectorMetadata()
        # Requests whose remote prompt was already asked for (one that comes
        # back, after a failed load or a preemption, computes it here).
        self._asked: set[str] = set()
        # This engine's KV cache groups: each one's window (None: full attention),
        # whether block ids come one list per group, and the id behind a window.
        self.windows: tuple[int | None, ...] = (None,)
        self.grouped = False
        self._null_id: int | None = None

    def bind_kv_cache_manager(self, kv_cache_manager: "AnyKVCacheManager") -> None:
        self.windows = tuple(getattr(kv_cache_manager, "sliding_windows", (None,)))
        null_block = getattr(kv_cache_manager, "null_block", None)
        self.grouped = null_block is not None  # the hybrid manager: a list per group
        self._null_id = None if null_block is None else null_block.block_id

    @staticmethod
    def check_kv_transfer_params(params: Any, config: "KVTransferConfig") -> None:
        """The front end's check of a request's params (ValueError naming the field)."""
        check_kv_transfer_params(params, config.kv_role or BOTH)

    # ------------------------------------------------------------ decode side

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        if not self._matches(request):
            return 0, False  # not this prompt's KV: computed here instead
        num_external = request.num_prompt_tokens - num_computed_tokens
        # The last prompt token is computed here anyway (its logits give the
        # first output token): a load of that token alone would gain nothing.
        return (num_external, True) if num_external > 1 else (0, False)

    def would_load_async(self, request: "Request", num_computed_tokens: int) -> bool:
        return self._matches(request) and request.num_prompt_tokens - num_computed_tokens > 1

    def update_state_after_alloc(self, request: "Request", blocks: "Blocks",
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
        local, remote = [], []
        for g, (group_blocks, group_remote) in enumerate(
                zip(as_groups(blocks), self._remote_groups(params))):
            start = max(first, self._first_read(g, request))
            local.extend(block.block_id for block in group_blocks[start:num_blocks])
            remote.extend(group_remote[start:num_blocks])
        self._meta.loads.append(RemoteBlocks(request.request_id, local, remote, address,
                                             remote_request_id))

    def _remote_groups(self, params: dict) -> list[list[int]]:
        """The peer's block ids, one list per KV cache group."""
        ids = params["remote_block_ids"]
        return ids if self.grouped else [ids]

    def _load_end(self, request: "Request") -> int:
        """The tokens computed once the prompt is loaded (the scheduler keeps one
        to compute, and a parent's block before its fork point)."""
        end = request.num_prompt_tokens - 1
        if request.fork_point is not None:
            end = min(end, request.fork_point - self.block_size)
        return end

    def _first_read(self, group: int, request: "Request") -> int:
        """The first position group ``group`` needs from the peer (a window group
        only what its window reads once the prompt is loaded)."""
        window = self.windows[group]
        if window is None:
            return 0
        return first_entry_in_window(max(0, self._load_end(request)), window, self.block_size)

    def _remote_prefill(self, request: "Request") -> dict | None:
        """The request's params when it is to load its prompt from a peer (once)."""
        params = request.kv_transfer_params
        if (self.role == PRODUCER or not params or not params.get("do_remote_prefill")
                or request.request_id in self._asked):
            return None
        try:
            check_kv_transfer_params(params, self.role)
        except ValueError as err:
            logger.warning("kv transfer: %s computes its prompt here: %s", request.request_id, err)
            return None
        return params

    def _matches(self, request: "Request") -> bool:
        """Whether the peer's blocks hold this very prompt's KV."""
        params = self._remote_prefill(request)
        if params is None:
            return False
        num_prompt = request.num_prompt_tokens
        return (params["remote_num_tokens"] == num_prompt
                and params["remote_block_size"] == self.block_size
                and self._holds_every_read(request, params)
                and params["remote_prompt_digest"] == prompt_digest(request.prompt_token_ids))

    def _holds_every_read(self, request: "Request", params: dict) -> bool:
        """Whether the peer's block ids are grouped as this engine's and cover
        every position each group reads (not the null block inside a window)."""
        ids = params["remote_block_ids"]
        grouped = bool(ids) and all(isinstance(g, list) for g in ids)
        if grouped != self.grouped or (grouped and len(ids) != len(self.windows)):
            logger.warning("kv transfer: %s computes its prompt here: the peer groups its KV cache "
                           "layers otherwise", request.request_id)
            return False
        num_blocks = -(-request.num_prompt_tokens // self.block_size)
        for g, group_ids in enumerate(self._remote_groups(params)):
            if len(group_ids) < num_blocks:
                return False
            if self.windows[g] is not None and self._null_id in group_ids[self._first_read(g, request):num_blocks]:
                return False
        return True

    # ------------------------------------------------------------ prefill side

    def request_finished(self, request: "Request", block_ids: "BlockIds"
                         ) -> tuple[bool, dict[str, Any] | None]:
        unasked = self._remote_prefill(request)
        if unasked is not None:
            # A decode request that never asked for its prompt (aborted while it
            # waited): the peer may let its blocks go now, not at its hold timeout.
            self._meta.loads.append(RemoteBlocks(
                request.request_id, [], [], f"tcp://{unasked['remote_host']}:{unasked['remote_port']}",
                str(unasked["remote_request_id"])))
        self._asked.discard(request.request_id)
        params = request.kv_transfer_params
        groups = as_groups(block_ids)
        if (self.role == CONSUMER or not params or not params.get("do_remote_decode")
                or request.status != RequestStatus.FINISHED_LENGTH_CAPPED or not groups[0]):
            # Aborted, or stopped on its first token: nothing left to decode elsewhere.
            return False, None
        num_blocks = -(-request.num_prompt_tokens // self.block_size)
        self._meta.holds[request.request_id] = [
            block_id for group_ids in groups for block_id in group_ids if block_id != self._null_id]
        remote = [list(group_ids[:num_blocks]) for group_ids in groups]
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_request_id": request.request_id,
            "remote_block_ids": remote if self.grouped else remote[0],
            "remote_num_tokens": request.num_prompt_tokens,
            "remote_block_size": self.block_size,
            "remote_prompt_digest": prompt_digest(request.prompt_token_ids),
            "remote_host": self.options.kv_host, "remote_port": self.options.kv_port,
            "remote_engine_id": self.engine_id,
        }

    # ------------------------------------------------------------ each step

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> PDConnectorMetadata:
        meta, self._meta = self._meta, PDConnectorMetadata()
        return meta
