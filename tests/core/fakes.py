"""The scheduler-feature tests' helpers: the harness of ``cadence.core.testing``
(a fake runner, builders, step helpers) under the names these tests import,
plus ``wait_until`` and an in-memory KV connector.

``FakeRunner()`` samples ``greedy_token(req_id, tokens)``, a function of the
sequence only, like greedy decoding, so outputs do not depend on batching;
pass another token function (of the request id and its tokens) to change it.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from cadence.core.outputs import KVConnectorOutput
from cadence.core.request import Request
from cadence.core.sched.kv_connector import KVConnectorBase
from cadence.core.sched.output import SchedulerOutput
from cadence.core.testing import (  # noqa: F401  (re-exported for the tests)
    FakeRunner,
    all_blocks_free,
    flatten,
    greedy_token,
    new_request,
    new_scheduler,
    prompt_of,
    ref_counts,
    run_pipelined,
    run_until_done,
    step,
)


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(0.001)


# ----------------------------------------------------------------------
# An in-memory KV connector
# ----------------------------------------------------------------------


class InMemoryConnector(KVConnectorBase):
    """An external KV store keyed by token prefixes of whole blocks.

    ``store(tokens)`` (or a finished request, when ``save_on_finish``) puts
    the KV of every full-block prefix of ``tokens`` in the store. For a new
    request it claims the longest stored prefix beyond the local hits,
    leaving at least one prompt token to compute. With ``load_async`` the
    request waits in ``WAITING_FOR_REMOTE_KVS`` until the test reports
    ``finished_recving``; with ``delay_free`` a finished request keeps its
    blocks until the test reports ``finished_sending``.
    """

    def __init__(
        self,
        block_size: int,
        *,
        load_async: bool = False,
        delay_free: bool = False,
        save_on_finish: bool = False,
    ) -> None:
        self.block_size = block_size
        self.load_async = load_async
        self.delay_free = delay_free
        self.save_on_finish = save_on_finish
        self.prefixes: set[tuple[int, ...]] = set()
        # Call records, for the tests.
        self.match_calls: list[tuple[str, int]] = []
        self.alloc_calls: list[tuple[str, list[int], int]] = []
        self.meta_calls: list[SchedulerOutput] = []
        self.connector_outputs: list[KVConnectorOutput] = []
        self.finished_calls: list[tuple[str, list[int]]] = []
        self.sending: set[str] = set()
        self.shut_down = False
        self._pending_loads: list[tuple[str, list[int], int]] = []

    def store(self, tokens: list[int]) -> None:
        bs = self.block_size
        for end in range(bs, len(tokens) + 1, bs):
            self.prefixes.add(tuple(tokens[:end]))

    def num_stored_tokens(self, tokens: list[int]) -> int:
        bs = self.block_size
        num = 0
        for end in range(bs, len(tokens) + 1, bs):
            if tuple(tokens[:end]) not in self.prefixes:
                break
            num = end
        return num

    # ---- hooks ---------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        self.match_calls.append((request.request_id, num_computed_tokens))
        tokens = request.all_token_ids
        # Leave at least one token to compute, so the request gets logits.
        limit = (len(tokens) - 1) // self.block_size * self.block_size
        num_hit = min(self.num_stored_tokens(tokens), limit)
        num_external = max(0, num_hit - num_computed_tokens)
        return num_external, self.load_async and num_external > 0

    def update_state_after_alloc(self, request: Request, blocks: list, num_external_tokens: int) -> None:
        block_ids = [b.block_id for b in blocks]
        self.alloc_calls.append((request.request_id, block_ids, num_external_tokens))
        if num_external_tokens > 0:
            self._pending_loads.append((request.request_id, block_ids, num_external_tokens))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> dict[str, Any]:
        self.meta_calls.append(scheduler_output)
        loads, self._pending_loads = self._pending_loads, []
        return {"step": len(self.meta_calls), "loads": loads}

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.connector_outputs.append(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.finished_calls.append((request.request_id, list(block_ids)))
        if self.save_on_finish:
            self.store(request.prompt_token_ids)
        if not self.delay_free:
            return False, None
        self.sending.add(request.request_id)
        return True, {"remote_block_ids": list(block_ids)}

    def shutdown(self) -> None:
        self.shut_down = True
