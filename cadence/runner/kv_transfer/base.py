"""The worker side of a KV connector (vLLM v1's names), and the runner's step
around it.

Per step, on the runner's thread, in this order:

    start_load_kv(metadata)      before the forward: start (or do) the step's loads
                                 and any copies out of blocks the step reuses
    <forward, sampling>
    wait_for_save()              after the forward: issue the saves of blocks it
                                 filled (may return before they complete, but
                                 they complete before the next start_load_kv returns)
    get_finished(finished_ids)   (sends done, loads done) since the last call
    get_block_ids_with_load_errors()   blocks whose load failed or timed out

``register_kv_caches`` is called once the paged cache exists (and again if it
is reallocated). Empty steps run these hooks too: an asynchronous load may be
the only work of a step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from cadence.core.outputs import KVConnectorOutput

if TYPE_CHECKING:
    from cadence.runner.kv_cache import PagedKVCache


class KVConnectorWorker(ABC):
    """Worker-side connector hooks, called by the model runner."""

    @abstractmethod
    def register_kv_caches(self, kv_caches: "PagedKVCache") -> None:
        """The runner's paged cache, whose blocks the scheduler's ids name."""

    @abstractmethod
    def start_load_kv(self, metadata: Any) -> None:
        """Before the forward: the step's transfer plan (the scheduler side's
        ``build_connector_meta``); loads the forward reads must be in place
        when this returns, asynchronous ones are reported by ``get_finished``."""

    def wait_for_save(self) -> None:
        """After the forward: the blocks it computed may be saved now."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose blocks were all sent, requests whose async load ended)
        since the last call. ``finished_req_ids``: requests finished this step."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed or timed out since the last call."""
        return set()

    def shutdown(self) -> None:
        """Stop threads, release memory."""


def take_connector_output(
    worker: KVConnectorWorker, finished_req_ids: set[str]
) -> KVConnectorOutput | None:
    """What the worker finished this step, or None when nothing."""
    sending, recving = worker.get_finished(finished_req_ids)
    invalid = worker.get_block_ids_with_load_errors()
    if not (sending or recving or invalid):
        return None
    return KVConnectorOutput(finished_sending=sending or None, finished_recving=recving or None,
                             invalid_block_ids=invalid or None)
