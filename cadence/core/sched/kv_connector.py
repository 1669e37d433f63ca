"""KV connector, scheduler side: KV computed elsewhere (another engine, a CPU
or disk tier) loaded into this engine's blocks, and KV sent out on finish.

The scheduler calls the hooks; the worker side (in the runner) moves bytes
and reports finished transfers in ``ModelRunnerOutput.kv_connector_output``.

- ``get_num_new_matched_tokens``: tokens beyond the local prefix hit that
  the connector can supply, and whether the load is asynchronous (the
  request then waits in ``WAITING_FOR_REMOTE_KVS`` holding its blocks);
- ``update_state_after_alloc``: blocks were allocated for those tokens;
- ``build_connector_meta``: the step's transfer plan, handed to the runner;
- ``request_finished``: whether to delay freeing blocks while they are sent;
- ``request_preempted``: whether the connector keeps a victim's KV (swap
  preemption): it then offers it back as matched tokens when the request
  is admitted again.

Connectors are built by name (``cadence.engine.kv_connectors``), each side
given the ``KVConnectorContext`` of the engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cadence.core.compiled import mypyc_attr

if TYPE_CHECKING:
    from cadence.core.kv_cache import BlockIds, Blocks
    from cadence.core.kv_cache import AnyKVCacheManager
    from cadence.core.outputs import KVConnectorOutput, PrefixCacheStats
    from cadence.core.request import Request
    from cadence.core.sched.output import SchedulerOutput


@dataclass(frozen=True)
class KVConnectorContext:
    """What both sides of a connector know of the engine they serve."""

    block_size: int
    num_blocks: int  # blocks of the engine's own (primary) KV cache
    bytes_per_block: int  # one block across all layers, keys and values
    kv_role: str = "kv_both"
    # Estimated seconds the engine spends computing one token's KV (a cost
    # model's input, e.g. recompute against copy for swap preemption).
    seconds_per_token: float = 0.0
    # Estimated bytes per second of a copy between the KV cache and host memory.
    copy_bytes_per_second: float = 0.0
    # recompute, swap or auto (SchedulerConfig.preemption_mode made concrete).
    preemption_mode: str = "recompute"


@mypyc_attr(allow_interpreted_subclasses=True)  # connectors live outside core/sched
class KVConnectorBase(ABC):
    """Scheduler-side connector hooks."""

    # Whether requests' ``kv_transfer_params`` mean something to this connector
    # (the engine refuses them otherwise).
    reads_kv_transfer_params: bool = False

    def bind_kv_cache_manager(self, kv_cache_manager: AnyKVCacheManager) -> None:
        """The scheduler's KV cache manager (block ids and block hashes of
        requests); called once, when the scheduler is built."""

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int, bool]:
        """(external tokens available beyond ``num_computed_tokens``, load asynchronously)."""

    def would_load_async(self, request: "Request", num_computed_tokens: int) -> bool:
        """Whether ``get_num_new_matched_tokens`` would now answer an asynchronous
        load for ``request`` — a look-up only, changing nothing. The scheduler
        asks before displacing a running request for it: a request that first
        loads its KV does not take the seat this step (default: never)."""
        return False

    @abstractmethod
    def update_state_after_alloc(
        self, request: "Request", blocks: "Blocks", num_external_tokens: int
    ) -> None:
        """Blocks now hold room for the external tokens; plan their load."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> Any:
        """The transfers of this step, for the worker side. Resets per-step state."""

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        """Worker-side results of a step."""

    def request_finished(
        self, request: "Request", block_ids: BlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        """(delay freeing the blocks until sent, transfer params for the client)."""
        return False, None

    def request_preempted(self, request: "Request") -> bool:
        """``request`` is preempted now, its blocks about to be freed (they hold
        ``request.num_computed_tokens`` tokens of KV): True when the connector
        keeps that KV and will offer it back as an asynchronous load."""
        return False

    def make_prefix_cache_stats(self) -> "PrefixCacheStats | None":
        """Lookups of external tokens since the last call (None: not counted)."""
        return None

    def shutdown(self) -> None:
        """Release connections."""
