"""A recording KV connector pair for the runner-side plumbing tests.

The scheduler side numbers each step's metadata and, for prompts marked
``external``, claims their full blocks as an asynchronous load; the worker
side records every hook in order and reports each load finished in the step
that started it (``fail_loads``: with its blocks invalid).
"""

from __future__ import annotations

from typing import Any

from cadence.core.sched.kv_connector import KVConnectorBase, KVConnectorContext
from cadence.runner.kv_transfer.base import KVConnectorWorker


class RecordingScheduler(KVConnectorBase):
    def __init__(self, config, context: KVConnectorContext) -> None:
        self.block_size = context.block_size
        self.context = context
        self.num_steps = 0
        self.external_req_ids: set[str] = set(config.extra("external", ()))
        self._loads: list[tuple[str, list[int]]] = []
        self.outputs: list[Any] = []
        self.manager = None

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        self.manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.request_id not in self.external_req_ids:
            return 0, False
        self.external_req_ids.discard(request.request_id)  # claimed once
        num_full = (request.num_tokens - 1) // self.block_size * self.block_size
        return max(0, num_full - num_computed_tokens), True

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if num_external_tokens:
            self._loads.append((request.request_id, [b.block_id for b in blocks]))

    def build_connector_meta(self, scheduler_output):
        self.num_steps += 1
        loads, self._loads = self._loads, []
        return {"step": self.num_steps, "loads": loads}

    def update_connector_output(self, connector_output):
        self.outputs.append(connector_output)


class RecordingWorker(KVConnectorWorker):
    def __init__(self, config, context: KVConnectorContext) -> None:
        self.calls: list[Any] = []
        self.fail_loads = bool(config.extra("fail_loads", False))
        self.kv_caches = None
        self._recving: set[str] = set()
        self._invalid: set[int] = set()

    def register_kv_caches(self, kv_caches) -> None:
        self.kv_caches = kv_caches
        self.calls.append("register")

    def start_load_kv(self, metadata) -> None:
        self.calls.append(("load", metadata["step"]))
        for req_id, block_ids in metadata["loads"]:
            self._recving.add(req_id)
            if self.fail_loads:
                self._invalid.update(block_ids)

    def wait_for_save(self) -> None:
        self.calls.append("save")

    def get_finished(self, finished_req_ids):
        self.calls.append(("finished", set(finished_req_ids)))
        recving, self._recving = self._recving, set()
        return None, recving

    def get_block_ids_with_load_errors(self):
        invalid, self._invalid = self._invalid, set()
        return invalid

    def shutdown(self) -> None:
        self.calls.append("shutdown")
