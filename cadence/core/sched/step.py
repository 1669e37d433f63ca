"""What one ``schedule()`` call has decided so far, and its remaining budgets.

The scheduler fills a ``StepPlan`` request by request; ``_make_output`` turns
it into a ``SchedulerOutput``. Budgets: tokens (always), encoder-input tokens
(multimodal requests), KV tokens read (when configured).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cadence.core.sched import spec_decode
from cadence.core.sched.admission import kv_read_tokens
from cadence.core.sched.encoder import EncoderCacheManager, schedule_encoder_inputs
from cadence.core.sched.prefill_caps import PrefillCaps

if TYPE_CHECKING:
    from cadence.config import SchedulerConfig
    from cadence.core.kv_cache import BlockIds
    from cadence.core.request import Request
    from cadence.core.sched.lora import LoRABatchLimit


class StepPlan:
    """Requests scheduled in this step, with their token counts and new blocks."""

    __slots__ = (
        "token_budget", "num_scheduled_tokens", "new_block_ids", "running", "running_block_ids", "new",
        "resumed",
        "preempted", "spec_tokens", "encoder_inputs", "encoder_budget", "kv_read_budget",
        "sliding_window", "_loras", "_tracks_extras", "_structured", "_disable_chunked_mm_input",
        "prefill_caps", "token_limit",
    )

    def __init__(self, token_budget: int, config: "SchedulerConfig") -> None:
        self.token_budget = token_budget
        self.token_limit = token_budget  # the step's whole budget (token_budget: what is left)
        self.num_scheduled_tokens: dict[str, int] = {}
        self.new_block_ids: dict[str, BlockIds] = {}  # of the new and resumed requests
        self.running: list[Request] = []  # already running, scheduled again
        self.running_block_ids: list[BlockIds] = []  # their new blocks, in the same order
        self.new: list[Request] = []  # first time the runner sees them
        self.resumed: list[Request] = []  # back from preemption
        self.preempted: list[Request] = []
        self.spec_tokens: dict[str, list[int]] = {}
        self.encoder_inputs: dict[str, list[int]] = {}
        self.encoder_budget = config.encoder_compute_budget
        self.kv_read_budget = config.max_num_kv_read_tokens
        self.sliding_window = config.sliding_window
        self._loras: LoRABatchLimit | None = None
        # Whether every scheduled request needs the per-request bookkeeping below.
        self._tracks_extras = self.kv_read_budget is not None
        self._structured: list[str] = []
        self._disable_chunked_mm_input = config.disable_chunked_mm_input
        self.prefill_caps = PrefillCaps.from_config(config)  # None: no caps configured

    @property
    def loras(self) -> "LoRABatchLimit | None":
        return self._loras

    @loras.setter
    def loras(self, limit: "LoRABatchLimit | None") -> None:
        self._loras = limit
        self._tracks_extras = limit is not None or self.kv_read_budget is not None

    # ---- recording -----------------------------------------------------

    def schedule_running(self, request: "Request", num_new: int, new_block_ids: BlockIds) -> None:
        req_id = request.request_id
        self.running.append(request)
        self.running_block_ids.append(new_block_ids)
        self.num_scheduled_tokens[req_id] = num_new
        self.token_budget -= num_new
        if request.spec_token_ids:
            drafts = spec_decode.take_scheduled_drafts(request, num_new)
            if drafts:
                self.spec_tokens[req_id] = drafts
        if self._tracks_extras or request.structured_output_request is not None:
            self._after_scheduled(request)

    def schedule_admitted(self, request: "Request", num_new: int, block_ids: BlockIds) -> None:
        req_id = request.request_id
        self.num_scheduled_tokens[req_id] = num_new
        self.new_block_ids[req_id] = block_ids
        self.token_budget -= num_new
        self._after_scheduled(request)

    def _after_scheduled(self, request: "Request") -> None:
        if self.loras is not None:
            self.loras.add(request)
        if self.kv_read_budget is not None:
            self.kv_read_budget -= kv_read_tokens(
                request, self.num_scheduled_tokens[request.request_id], self.sliding_window
            )
        if request.structured_output_request is not None:
            self._structured.append(request.request_id)

    def unschedule(self, request: "Request") -> None:
        """Take back a request preempted after it was scheduled in this step."""
        req_id = request.request_id
        num_new = self.num_scheduled_tokens.pop(req_id, None)
        if num_new is None:
            return
        self.token_budget += num_new
        if self.prefill_caps is not None:
            self.prefill_caps.uncount(request)
        if self.kv_read_budget is not None:
            self.kv_read_budget += kv_read_tokens(request, num_new, self.sliding_window)
        self.new_block_ids.pop(req_id, None)
        self.spec_tokens.pop(req_id, None)
        self.encoder_inputs.pop(req_id, None)
        if request in self.running:
            index = self.running.index(request)
            del self.running[index], self.running_block_ids[index]
        for scheduled in (self.new, self.resumed):
            if request in scheduled:
                scheduled.remove(request)
        if req_id in self._structured:
            self._structured.remove(req_id)

    # ---- budgets -------------------------------------------------------

    def can_read_kv(self, request: "Request", num_new: int, num_computed: int | None = None) -> bool:
        """Whether the KV-read budget (if any) covers this request's attention reads."""
        if self.kv_read_budget is None or not self.num_scheduled_tokens:
            # The first request of a step always may read: a context longer than
            # the budget must not stall its request forever.
            return True
        context = (request.num_computed_tokens if num_computed is None else num_computed) + num_new
        if self.sliding_window is not None:
            context = min(context, self.sliding_window)
        return context <= self.kv_read_budget

    def add_encoder_inputs(
        self,
        request: "Request",
        num_new: int,
        cache: EncoderCacheManager,
        num_computed: int | None = None,
    ) -> int:
        """Schedule the request's encoder inputs in range; returns the (maybe cut) token count."""
        if num_computed is None:
            num_computed = request.num_computed_tokens
        inputs, num_new, self.encoder_budget = schedule_encoder_inputs(
            request, num_computed, num_new, self.encoder_budget, cache,
            self._disable_chunked_mm_input,
        )
        if inputs and num_new > 0:
            for input_id in inputs:
                cache.allocate(request, input_id)
            self.encoder_inputs[request.request_id] = inputs
        return num_new

    def drop_encoder_inputs(self, request: "Request", cache: EncoderCacheManager) -> None:
        """Undo ``add_encoder_inputs`` for a request that could not get blocks."""
        inputs = self.encoder_inputs.pop(request.request_id, None)
        if inputs:
            for input_id in inputs:
                self.encoder_budget += request.mm_positions[input_id].length
                cache.free_encoder_input(request, input_id)

    def structured_output_request_ids(self) -> dict[str, int]:
        """First bitmask row of each scheduled request with structured output.

        A request takes one row per logits row it samples from: 1 + its
        scheduled drafts (a draft row is masked as if the drafts before it
        were accepted)."""
        rows, row = {}, 0
        for req_id in self._structured:
            rows[req_id] = row
            row += 1 + len(self.spec_tokens.get(req_id, ()))
        return rows
