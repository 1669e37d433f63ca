"""The iteration-level scheduler.

Each step hands out one token budget. Running requests go first (decodes,
drafts, the next chunk of a split prompt), then waiting ones are admitted
while budget, blocks and ``max_num_seqs`` allow. There are no phases: every
request's ``num_computed_tokens`` just catches up with its known tokens.
When a running request needs a block and none is free, the policy's victim
is preempted (blocks freed, recomputed later), and nothing new is admitted in
that step.

Features keep their logic in their own modules; ``schedule()`` calls them:
``policy`` (queue order, victim), ``admission`` (safety margin, prefill-first,
KV-read budget), ``encoder``, ``spec_decode``, ``structured_output``,
``lora``, ``kv_connector``, ``parallel_sampling``.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any, Iterable

from cadence.config import CacheConfig, LoRAConfig, SchedulerConfig, SpeculativeConfig
from cadence.core.kv_cache import KVCacheManager
from cadence.core.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    KVConnectorOutput,
    ModelRunnerOutput,
    PrefixCacheStats,
    SchedulerStats,
    SpecDecodingStats,
)
from cadence.core.request import Request, RequestEventType, RequestStatus
from cadence.core.sched import parallel_sampling, spec_decode
from cadence.core.sched.admission import make_admission_policy, prefill_first_order
from cadence.core.sched.encoder import EncoderCacheManager, free_consumed_encoder_inputs
from cadence.core.sched.interface import SchedulerInterface
from cadence.core.sched.lora import LoRABatchLimit
from cadence.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from cadence.core.sched.policy import make_policy
from cadence.core.sched.step import StepPlan
from cadence.core.sched.stop import check_stop

_RUNNING = RequestStatus.RUNNING
_WAITING = RequestStatus.WAITING
_PREEMPTED = RequestStatus.PREEMPTED  # statuses above it are finished ones


class Scheduler(SchedulerInterface):
    """Continuous-batching scheduler over a paged KV cache."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        *,
        speculative_config: SpeculativeConfig | None = None,
        lora_config: LoRAConfig | None = None,
        kv_connector: Any = None,
        structured_output_manager: Any = None,
        log_stats: bool = False,
        include_finished_set: bool = False,
    ) -> None:
        if cache_config.num_gpu_blocks is None:
            raise ValueError("num_gpu_blocks: the scheduler needs the number of KV-cache blocks")
        self.config = scheduler_config
        self.max_num_running_reqs = scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.block_size = cache_config.block_size
        self.log_stats = log_stats
        self.kv_cache_manager = KVCacheManager(
            cache_config.num_gpu_blocks,
            cache_config.block_size,
            scheduler_config.max_model_len,
            enable_caching=cache_config.enable_prefix_caching,
            hash_algo=cache_config.prefix_caching_hash_algo,
            enable_kv_cache_events=cache_config.enable_kv_cache_events,
            log_stats=log_stats,
        )
        self.policy = make_policy(scheduler_config.policy)
        self.waiting = self.policy.make_queue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.admission = make_admission_policy(scheduler_config.admission_safety_margin)
        # Finished since the last schedule(): the runner drops their state.
        self.finished_req_ids: set[str] = set()
        self.finished_req_ids_dict: dict[int, set[str]] | None = (
            defaultdict(set) if include_finished_set else None
        )
        self.encoder_cache_manager = EncoderCacheManager(scheduler_config.encoder_cache_tokens)
        self.speculative_config = speculative_config
        self.num_spec_tokens = speculative_config.num_speculative_tokens if speculative_config else 0
        self.num_lookahead_tokens = (
            speculative_config.num_lookahead_tokens if speculative_config else 0
        )
        self.lora_config = lora_config
        self.connector = kv_connector
        self.finished_recving_kv_req_ids: set[str] = set()
        self.structured_output_manager = structured_output_manager
        self.async_scheduling = scheduler_config.async_scheduling
        # Thread-safe cancellation: other threads queue ids, schedule() applies them.
        self._cancel_lock = threading.Lock()
        self._pending_cancels: set[str] = set()
        self.forks = parallel_sampling.ForkRegistry(self.block_size)
        self.kv_events: list[Any] = []
        # Running requests the runner has not seen yet (forked children).
        self._unsent_running: set[str] = set()
        # Outputs of requests finished inside schedule() (e.g. a grammar that failed).
        self._orphan_outputs: list[EngineCoreOutput] = []
        self._orphan_clients: list[int] = []
        self.step_counter = 0
        self.num_preemptions_total = 0
        self._num_step_preemptions = 0

    # ------------------------------------------------------------------
    # schedule()
    # ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self._apply_cancellations()
        plan = StepPlan(self.max_num_scheduled_tokens, self.config)
        if self.lora_config is not None:
            # Count every running request's adapter, scheduled this step or not,
            # so the running set itself never holds more than max_loras adapters.
            plan.loras = LoRABatchLimit(self.lora_config.max_loras)
            plan.loras.add_running(self.running)
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting(plan)
        return self._make_output(plan)

    def _schedule_running(self, plan: StepPlan) -> None:
        """Give running requests their next tokens, preempting when blocks run out."""
        config = self.config
        threshold = config.long_prefill_token_threshold
        max_model_len = self.max_model_len
        allocate = self.kv_cache_manager.allocate_slots
        lookahead = self.num_lookahead_tokens
        unsent = self._unsent_running
        schedule_running = plan.schedule_running
        order = prefill_first_order(self.running) if config.prefill_first else list(self.running)
        for request in order:
            budget = plan.token_budget
            if budget <= 0:
                break
            if request.status != _RUNNING:
                continue  # preempted earlier in this loop
            # Catch up with the known tokens (+ drafts, + async placeholders).
            num_computed = request.num_computed_tokens
            num_new = (
                request.num_tokens + len(request.spec_token_ids)
                + request.num_output_placeholders - num_computed
            )
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > budget:
                num_new = budget
            # Drafts may not run past the context: the last position samples the next token.
            if num_new > max_model_len - 1 - num_computed:
                num_new = max_model_len - 1 - num_computed
            if request.fork_point is not None or request.num_output_placeholders:
                num_new = self._limit_special(request, num_new)
            if num_new <= 0 or (
                plan.kv_read_budget is not None and not plan.can_read_kv(request, num_new)
            ):
                # Nothing to do (or over a budget): later requests may still fit.
                continue
            if request.mm_positions:
                num_new = plan.add_encoder_inputs(request, num_new, self.encoder_cache_manager)
                if num_new <= 0:
                    continue
            new_block_ids = allocate(request, num_new, 0, None, lookahead)
            if new_block_ids is None:
                new_block_ids = self._preempt_until_allocated(request, num_new, plan)
                if new_block_ids is None:
                    break
            if unsent and request.request_id in unsent:
                # A forked child: the runner gets its whole data once.
                unsent.discard(request.request_id)
                plan.new.append(request)
                plan.schedule_admitted(request, num_new, self.kv_cache_manager.get_block_ids(request.request_id))
            else:
                schedule_running(request, num_new, new_block_ids)

    def _limit_special(self, request: Request, num_new: int) -> int:
        """Limits of a parent waiting to fork (n > 1) and of async placeholders."""
        if request.fork_point is not None:
            num_new = min(num_new, request.fork_point - request.num_computed_tokens)
        if request.num_output_placeholders and request.max_tokens is not None:
            # Async: the tokens in flight may already reach max_tokens.
            if request.num_output_tokens + request.num_output_placeholders >= request.max_tokens:
                return 0
        return num_new

    def _preempt_until_allocated(
        self, request: Request, num_new: int, plan: StepPlan
    ) -> list[int] | None:
        """Preempt victims until ``request`` gets its blocks; None if it was the victim."""
        while True:
            victim = self.policy.pick_victim(self.running)
            self._preempt(victim, plan)
            if victim is request:
                return None
            new_block_ids = self.kv_cache_manager.allocate_slots(
                request, num_new, num_lookahead_tokens=self.num_lookahead_tokens
            )
            if new_block_ids is not None:
                return new_block_ids

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Preemption by recompute: free the blocks, requeue at the head."""
        if self.running and self.running[-1] is request:
            self.running.pop()
        else:
            self.running.remove(request)
        plan.unschedule(request)
        plan.drop_encoder_inputs(request, self.encoder_cache_manager)
        self.kv_cache_manager.free(request)
        self.encoder_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        if request.request_id in self._unsent_running:
            # Never sent to the runner: it will start as a new request.
            self._unsent_running.discard(request.request_id)
            request.status = _WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.spec_token_ids = []
        if self.log_stats:
            request.record_event(RequestEventType.PREEMPTED)
        self.waiting.prepend_request(request)
        plan.preempted.append(request)

    def _schedule_waiting(self, plan: StepPlan) -> None:
        """Admit waiting requests while budget, blocks and max_num_seqs allow."""
        skipped: list[Request] = []
        waiting = self.waiting
        while waiting and plan.token_budget > 0:
            if len(self.running) >= self.max_num_running_reqs:
                break
            request = waiting.peek_request()
            if self._grammar_failed(request):
                waiting.pop_request()
                self._abort_unservable(request, "grammar compilation failed")
                continue
            if not self._is_ready(request) or (plan.loras and not plan.loras.can_add(request)):
                skipped.append(waiting.pop_request())
                continue
            if (
                self.running
                and request.num_computed_tokens == 0
                and not self.admission.can_admit(request, self.kv_cache_manager)
            ):
                # A request that already holds its KV (async load done) must not be
                # locked out by its own blocks; with nothing running, anyone may start.
                break
            admitted = self._try_admit(request, plan)
            if admitted is None:
                break
            waiting.pop_request()
            if not admitted:
                skipped.append(request)  # not runnable this step (e.g. async KV load)
        if skipped:
            waiting.prepend_requests(skipped)

    def _try_admit(self, request: Request, plan: StepPlan) -> bool | None:
        """Schedule one waiting request: True if admitted, False if it must wait
        off the head of the queue, None if admission stops for this step."""
        kv = self.kv_cache_manager
        hits, num_local, num_external, load_async = self._computed_prefix(request)
        num_computed = request.num_computed_tokens + num_local + num_external
        if load_async:
            num_new = 0
        else:
            num_new = request.num_tokens - num_computed
            threshold = self.config.long_prefill_token_threshold
            if 0 < threshold < num_new:
                num_new = threshold
            if request.fork_point is not None:
                num_new = min(num_new, request.fork_point - num_computed)
            if not self.config.enable_chunked_prefill and num_new > plan.token_budget:
                return False
            num_new = min(num_new, plan.token_budget)
            if num_new <= 0 or not plan.can_read_kv(request, num_new, num_computed):
                return None
            if request.mm_positions:
                num_new = plan.add_encoder_inputs(
                    request, num_new, self.encoder_cache_manager, num_computed
                )
                if num_new <= 0:
                    return None
        new_block_ids = kv.allocate_slots(
            request, num_new + num_external, num_local, hits,
            num_lookahead_tokens=self.num_lookahead_tokens, delay_cache_blocks=load_async,
        )
        if new_block_ids is None:
            plan.drop_encoder_inputs(request, self.encoder_cache_manager)
            return None
        if self.connector is not None:
            self.connector.update_state_after_alloc(
                request, kv.req_to_blocks[request.request_id], num_external
            )
        if load_async:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            return False
        self._start_running(request, num_computed, num_new, plan)
        return True

    def _computed_prefix(self, request: Request) -> tuple[list, int, int, bool]:
        """(local cache hits, their token count, external tokens, async load?)."""
        if request.num_computed_tokens > 0:
            # Its KV is already in place (a forked child, or an async load that finished).
            return [], 0, 0, False
        hits, num_local = self.kv_cache_manager.get_computed_blocks(request)
        if request.fork_point is not None:
            # A parent must compute something before it forks.
            hits = hits[: max(0, request.fork_point // self.block_size - 1)]
            num_local = len(hits) * self.block_size
        if self.connector is None:
            return hits, num_local, 0, False
        num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_local)
        return hits, num_local, num_external or 0, bool(load_async)

    def _start_running(self, request: Request, num_computed: int, num_new: int, plan: StepPlan) -> None:
        self.running.append(request)
        if request.status == RequestStatus.PREEMPTED:
            plan.resumed.append(request)
        else:
            plan.new.append(request)
        if self.log_stats:
            request.record_event(RequestEventType.SCHEDULED)
        request.status = _RUNNING
        request.num_computed_tokens = num_computed
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_computed
        plan.schedule_admitted(request, num_new, self.kv_cache_manager.get_block_ids(request.request_id))

    @staticmethod
    def _grammar_failed(request: Request) -> bool:
        so = request.structured_output_request
        return request.status == RequestStatus.WAITING_FOR_FSM and so is not None and so.failed

    def _abort_unservable(self, request: Request, reason: str) -> None:
        """Finish a request that can never run; its client hears it in the next outputs."""
        request.status = RequestStatus.FINISHED_ABORTED
        request.stop_reason = reason
        self._free_request(request)
        self._orphan_outputs.append(
            EngineCoreOutput(
                request_id=request.request_id, new_token_ids=[],
                finish_reason=request.get_finished_reason(), stop_reason=reason,
                parent_request_id=request.parent_request_id,
            )
        )
        self._orphan_clients.append(request.client_index)

    def _is_ready(self, request: Request) -> bool:
        """Whether a waiting request may be scheduled (grammar compiled, remote KV in)."""
        status = request.status
        if status == RequestStatus.WAITING_FOR_FSM:
            so = request.structured_output_request
            if so is None or so.grammar is None:
                return False
            request.status = _WAITING
        elif status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            if request.request_id not in self.finished_recving_kv_req_ids:
                return False
            self._finish_remote_kv_load(request)
        return True

    def _finish_remote_kv_load(self, request: Request) -> None:
        """Blocks loaded by the connector become the request's computed prefix."""
        self.finished_recving_kv_req_ids.discard(request.request_id)
        num_blocks = len(self.kv_cache_manager.req_to_blocks.get(request.request_id, ()))
        # Keep at least one token to compute, so the request gets logits.
        num_computed = min(num_blocks * self.block_size, request.num_tokens - 1)
        self.kv_cache_manager.cache_blocks(request, num_computed)
        request.num_computed_tokens = num_computed
        request.status = _WAITING

    # ------------------------------------------------------------------
    # building the output
    # ------------------------------------------------------------------

    def _make_output(self, plan: StepPlan) -> SchedulerOutput:
        num_scheduled = plan.num_scheduled_tokens
        new_reqs = [
            NewRequestData.from_request(r, plan.new_block_ids[r.request_id]) for r in plan.new
        ]
        cached = self._make_cached_request_data(plan)
        structured_ids = plan.structured_output_request_ids()
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.max_num_scheduled_tokens - plan.token_budget,
            scheduled_spec_decode_tokens=plan.spec_tokens,
            scheduled_encoder_inputs=plan.encoder_inputs,
            num_common_prefix_blocks=self._num_common_prefix_blocks(),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in plan.preempted},
            free_encoder_input_ids=self.encoder_cache_manager.take_freed_ids(),
            structured_output_request_ids=structured_ids,
        )
        if structured_ids and self.structured_output_manager is not None:
            output.grammar_bitmask = self.structured_output_manager.grammar_bitmask(
                self.requests, structured_ids, plan.spec_tokens
            )
        if self.connector is not None:
            output.kv_connector_metadata = self.connector.build_connector_meta(output)
        self._advance_computed_tokens(plan)
        if self.kv_cache_manager.block_pool.enable_events:
            self.kv_events.extend(self.kv_cache_manager.take_events())
        self.finished_req_ids = set()
        self._num_step_preemptions = len(plan.preempted)
        self.num_preemptions_total += len(plan.preempted)
        self.step_counter += 1
        return output

    def _make_cached_request_data(self, plan: StepPlan) -> CachedRequestData:
        running, resumed = plan.running, plan.resumed
        req_ids = [r.request_id for r in running]
        num_computed = [r.num_computed_tokens for r in running]
        new_block_ids = plan.new_block_ids
        block_ids = [new_block_ids[req_id] for req_id in req_ids]
        resumed_flags = [False] * len(running)
        for request in resumed:
            req_ids.append(request.request_id)
            num_computed.append(request.num_computed_tokens)
            block_ids.append(new_block_ids[request.request_id])
            resumed_flags.append(True)
        return CachedRequestData(
            req_ids=req_ids,
            resumed_from_preemption=resumed_flags,
            new_token_ids=[],
            new_block_ids=block_ids,
            num_computed_tokens=num_computed,
        )

    def _advance_computed_tokens(self, plan: StepPlan) -> None:
        """Count this step's tokens as computed now, so the next step can be
        scheduled before this one's results arrive. Rejected drafts are
        taken back in ``update_from_output``."""
        requests = self.requests
        track_placeholders = self.async_scheduling
        for req_id, num_new in plan.num_scheduled_tokens.items():
            request = requests[req_id]
            request.num_computed_tokens += num_new
            if track_placeholders and request.num_computed_tokens >= request.num_tokens:
                # Every token past the known ones samples one (the last) output.
                request.num_output_placeholders += 1 + len(plan.spec_tokens.get(req_id, ()))
            if request.mm_positions:
                free_consumed_encoder_inputs(request, self.encoder_cache_manager)

    def _num_common_prefix_blocks(self) -> int:
        if not self.running:
            return 0
        return self.kv_cache_manager.get_num_common_prefix_blocks(self.running[0], len(self.running))

    # ------------------------------------------------------------------
    # update_from_output()
    # ------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        """Absorb the step's sampled tokens; the new outputs per client.

        Most requests of a step are plain decodes (one token, no drafts, no
        logprobs, no fork): those take a short path inline, since this loop
        runs once per request per step; everything else goes through
        ``_update_request``.
        """
        sampled_token_ids = model_runner_output.sampled_token_ids
        req_id_to_index = model_runner_output.req_id_to_index
        scheduled_drafts = scheduler_output.scheduled_spec_decode_tokens
        max_model_len = self.max_model_len
        requests = self.requests
        outputs = self._take_orphan_outputs()
        plain_step = self._is_plain_step(scheduler_output, model_runner_output)
        spec_stats: SpecDecodingStats | None = None
        num_stopped = 0
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(req_id)
            if request is None or request.status > _PREEMPTED:
                continue  # finished (e.g. aborted) while the step ran
            index = req_id_to_index[req_id]
            new_token_ids = sampled_token_ids[index] if sampled_token_ids else []
            if plain_step and len(new_token_ids) == 1 and request.fork_point is None:
                request.append_output_token(new_token_ids[0])
                kv_transfer_params = None
                if check_stop(request, max_model_len):
                    num_stopped += 1
                    kv_transfer_params = self._free_request(request)
                output = self._make_engine_core_output(
                    request, new_token_ids, None, None, kv_transfer_params
                )
            else:
                if scheduled_drafts and scheduled_drafts.get(req_id):
                    spec_stats = self._roll_back_rejected(
                        request, scheduled_drafts[req_id], len(new_token_ids), spec_stats
                    )
                output = self._update_request(request, index, new_token_ids, model_runner_output)
                if output is None:
                    continue
                if output.finish_reason is not None:
                    num_stopped += 1  # only a request that stopped in this step has one
            client_outputs = outputs.get(request.client_index)
            if client_outputs is None:
                client_outputs = outputs[request.client_index] = []
            client_outputs.append(output)
        if num_stopped:
            self._remove_finished_from_queues()
        if model_runner_output.kv_connector_output is not None:
            self._update_from_kv_xfer_finished(model_runner_output.kv_connector_output)
        return self._make_engine_core_outputs(outputs, spec_stats)

    def _take_orphan_outputs(self) -> dict[int, list[EngineCoreOutput]]:
        """Outputs per client, starting with those of requests finished inside ``schedule()``."""
        outputs: dict[int, list[EngineCoreOutput]] = {}
        if self._orphan_outputs:
            for client, output in zip(self._orphan_clients, self._orphan_outputs):
                outputs.setdefault(client, []).append(output)
            self._orphan_outputs, self._orphan_clients = [], []
        return outputs

    def _is_plain_step(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> bool:
        """No drafts (verified or new), logprobs, grammars or async placeholders in
        this step: a request that sampled one token needs no more than appending it."""
        return not (
            scheduler_output.scheduled_spec_decode_tokens or runner_output.spec_token_ids is not None
            or runner_output.logprobs is not None or runner_output.prompt_logprobs_dict
            or self.structured_output_manager is not None or self.async_scheduling
        )

    def _update_request(
        self, request: Request, index: int, new_token_ids: list[int], runner_output: ModelRunnerOutput
    ) -> EngineCoreOutput | None:
        """Absorb one request's result in the general case; its output, if it has one."""
        if request.num_output_placeholders:
            request.num_output_placeholders = max(
                0, request.num_output_placeholders - len(new_token_ids)
            )
        stopped = False
        if new_token_ids:
            new_token_ids, stopped = self._append_output(request, new_token_ids, self.max_model_len)
        fork = False
        if stopped:
            kv_transfer_params = self._free_request(request)
        else:
            kv_transfer_params = None
            if runner_output.spec_token_ids is not None:
                self._set_drafts(request, runner_output.spec_token_ids[index])
            fork = request.fork_point is not None and request.num_computed_tokens >= request.fork_point
        prompt_logprobs = runner_output.prompt_logprobs_dict.get(request.request_id)
        output = None
        if new_token_ids or kv_transfer_params or prompt_logprobs is not None:
            new_logprobs = None
            if request.sampling_params.logprobs is not None and runner_output.logprobs is not None:
                new_logprobs = runner_output.logprobs.slice(index, index + 1)
            output = self._make_engine_core_output(
                request, new_token_ids, new_logprobs, prompt_logprobs, kv_transfer_params
            )
        if fork:
            # After the output is made: the parent's output does not carry the fork's finish.
            self._fork(request)
        return output

    def _roll_back_rejected(
        self, request: Request, drafts: list[int], num_sampled: int, spec_stats: SpecDecodingStats | None
    ) -> SpecDecodingStats | None:
        num_accepted = spec_decode.roll_back_rejected(request, len(drafts), num_sampled)
        if self.log_stats:
            spec_stats = spec_decode.observe(spec_stats, self.num_spec_tokens, len(drafts), num_accepted)
        return spec_stats

    def _append_output(
        self, request: Request, new_token_ids: list[int], max_model_len: int
    ) -> tuple[list[int], bool]:
        """Append sampled tokens one by one; cut the list at the one that stops."""
        if len(new_token_ids) == 1:  # the common case: one decode token
            request.append_output_token(new_token_ids[0])
            if check_stop(request, max_model_len):
                return new_token_ids, True
        else:
            for num_appended, token_id in enumerate(new_token_ids, 1):
                request.append_output_token(token_id)
                if check_stop(request, max_model_len):
                    if num_appended < len(new_token_ids):
                        new_token_ids = new_token_ids[:num_appended]
                    return new_token_ids, True
        so = request.structured_output_request
        if so is not None and self.structured_output_manager is not None:
            grammar = so.grammar
            if grammar is not None:
                grammar.accept_tokens(request.request_id, new_token_ids)
                if grammar.is_terminated():
                    request.status = RequestStatus.FINISHED_STOPPED
                    return new_token_ids, True
        return new_token_ids, False

    def _set_drafts(self, request: Request, drafts: list[int]) -> None:
        so = request.structured_output_request
        if so is not None and so.grammar is not None:
            drafts = so.grammar.validate_tokens(drafts)
        request.spec_token_ids = list(drafts)

    @staticmethod
    def _make_engine_core_output(
        request: Request,
        new_token_ids: list[int],
        new_logprobs: Any,
        prompt_logprobs: Any,
        kv_transfer_params: dict | None,
    ) -> EngineCoreOutput:
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            finish_reason=request.get_finished_reason(),
            stop_reason=request.stop_reason,
            new_logprobs=new_logprobs,
            new_prompt_logprobs=prompt_logprobs,
            num_cached_tokens=request.num_cached_tokens or 0,
            events=request.take_events() if request.events else None,
            kv_transfer_params=kv_transfer_params,
            parent_request_id=request.parent_request_id,
        )

    def _remove_finished_from_queues(self) -> None:
        self.running = [r for r in self.running if r.status <= _PREEMPTED]
        finished_waiting = [r for r in self.waiting if r.status > _PREEMPTED]
        if finished_waiting:
            self.waiting.remove_requests(finished_waiting)

    def _make_engine_core_outputs(
        self, outputs: dict[int, list[EngineCoreOutput]], spec_stats: SpecDecodingStats | None
    ) -> dict[int, EngineCoreOutputs]:
        engine_core_outputs = {
            client: EngineCoreOutputs(outputs=client_outputs)
            for client, client_outputs in outputs.items()
        }
        if self.finished_req_ids_dict:
            for client, finished in self.finished_req_ids_dict.items():
                eco = engine_core_outputs.get(client)
                if eco is None:
                    eco = engine_core_outputs[client] = EngineCoreOutputs()
                eco.finished_requests = finished
            self.finished_req_ids_dict.clear()
        if engine_core_outputs and self.log_stats:
            # Stats go to one front end only.
            next(iter(engine_core_outputs.values())).scheduler_stats = self.make_stats(spec_stats)
        return engine_core_outputs

    # ------------------------------------------------------------------
    # parallel sampling (n > 1)
    # ------------------------------------------------------------------

    def _fork(self, parent: Request) -> None:
        """Replace a parent that computed its shared prefix by its n children.

        Children that fit under max_num_seqs run at once, holding references to
        the parent's blocks. The others wait holding nothing (a waiting request
        that held blocks could starve the pool: waiting ones are never
        preempted); they recompute, or hit the prefix cache, when admitted.
        """
        children = self.forks.make_children(parent)
        self.running.remove(parent)
        room = self.max_num_running_reqs - len(self.running)
        waiting_children = []
        for child in children:
            self._init_grammar(child)
            self.requests[child.request_id] = child
            if room > 0 and child.status == _WAITING:
                room -= 1
                self.forks.share_prefix(parent, child, self.kv_cache_manager)
                child.status = _RUNNING
                self.running.append(child)
                self._unsent_running.add(child.request_id)
            else:
                waiting_children.append(child)
        self.kv_cache_manager.free(parent)
        del self.requests[parent.request_id]
        self.finished_req_ids.add(parent.request_id)
        parent.status = RequestStatus.FINISHED_STOPPED
        if waiting_children:
            self.waiting.prepend_requests(waiting_children)

    # ------------------------------------------------------------------
    # requests from outside
    # ------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in the scheduler")
        if request.num_prompt_tokens == 0:
            raise ValueError("prompt: must contain at least one token")
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt: {request.num_prompt_tokens} tokens leave no room to generate "
                f"within max_model_len={self.max_model_len}"
            )
        if request.use_structured_output and self.structured_output_manager is None:
            raise ValueError("structured_outputs: this engine has no grammar backend")
        if request.sampling_params.n > 1:
            children = self.forks.prepare(request, self.kv_cache_manager)
            if children is not None:  # too short to share a block: fork at once
                for child in children:
                    self._init_grammar(child)
                    self._add_one(child)
                return
        else:
            self._init_grammar(request)
        self._add_one(request)

    def _init_grammar(self, request: Request) -> None:
        """Start compiling the request's grammar; it waits in WAITING_FOR_FSM meanwhile."""
        if request.use_structured_output:
            self.structured_output_manager.grammar_init(request)
            request.status = RequestStatus.WAITING_FOR_FSM

    def _add_one(self, request: Request) -> None:
        self.waiting.add_request(request)
        self.requests[request.request_id] = request
        if self.log_stats:
            request.record_event(RequestEventType.QUEUED)

    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> None:
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"finished_status: {finished_status!r} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        requests = []
        for req_id in self.forks.expand(request_ids):
            request = self.requests.get(req_id)
            if request is not None and not request.is_finished():
                requests.append(request)
        if not requests:
            return
        running = {r for r in requests if r.status == _RUNNING}
        if running:
            self.running = [r for r in self.running if r not in running]
        waiting = [r for r in requests if r.status != _RUNNING]
        if waiting:
            self.waiting.remove_requests(waiting)
        for request in requests:
            request.status = finished_status
            self._free_request(request)

    def cancel_request(self, request_id: str) -> None:
        """Abort a request from any thread; applied at the start of the next step."""
        with self._cancel_lock:
            self._pending_cancels.add(request_id)

    def _apply_cancellations(self) -> None:
        if not self._pending_cancels:
            return
        with self._cancel_lock:
            cancels, self._pending_cancels = self._pending_cancels, set()
        self.finish_requests(cancels, RequestStatus.FINISHED_ABORTED)

    def _free_request(self, request: Request) -> dict[str, Any] | None:
        """A finished request leaves; its blocks go back unless a connector still sends them."""
        delay_free, kv_transfer_params = False, None
        if self.connector is not None:
            delay_free, kv_transfer_params = self.connector.request_finished(
                request, self.kv_cache_manager.get_block_ids(request.request_id)
            )
        self.encoder_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        if self.finished_req_ids_dict is not None:
            self.finished_req_ids_dict[request.client_index].add(request.request_id)
        self.forks.forget(request)
        if not delay_free:
            self._free_blocks(request)
        return kv_transfer_params

    def _free_blocks(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.kv_cache_manager.free_block_hashes(request)
        self.requests.pop(request.request_id, None)

    def _update_from_kv_xfer_finished(self, output: KVConnectorOutput) -> None:
        if self.connector is not None:
            self.connector.update_connector_output(output)
        for req_id in output.finished_recving or ():
            self.finished_recving_kv_req_ids.add(req_id)
        for req_id in output.finished_sending or ():
            request = self.requests.get(req_id)
            if request is not None:
                self._free_blocks(request)

    # ------------------------------------------------------------------
    # queries
    # ------------------------------------------------------------------

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_requests(self) -> bool:
        # The interface's answer in one expression: an engine loop asks every step.
        return bool(self.running or self.waiting or self.finished_req_ids)

    def has_finished_requests(self) -> bool:
        return len(self.finished_req_ids) > 0

    def get_request_counts(self) -> tuple[int, int]:
        return len(self.running), len(self.waiting)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self, spec_decoding_stats: SpecDecodingStats | None = None) -> SchedulerStats | None:
        if not self.log_stats:
            return None
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_stats=self.kv_cache_manager.make_prefix_cache_stats() or PrefixCacheStats(),
            spec_decoding_stats=spec_decoding_stats,
            num_corrupted_reqs=sum(1 for r in self.running if r.num_nans_in_logits > 0),
            num_preemptions=self._num_step_preemptions,
            step_counter=self.step_counter,
        )

    def take_kv_events(self) -> list[Any]:
        """Cache events since the last call (including a reset between steps)."""
        events, self.kv_events = self.kv_events, []
        events.extend(self.kv_cache_manager.take_events())
        return events

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()
        if self.structured_output_manager is not None:
            self.structured_output_manager.shutdown()

    def get_kv_connector(self) -> Any:
        return self.connector
