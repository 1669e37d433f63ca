"""The iteration-level scheduler.

Each step hands out one token budget. Running requests go first (decodes,
drafts, the next chunk of a split prompt), then waiting ones are admitted
while budget, blocks and ``max_num_seqs`` allow. There are no phases: every
request's ``num_computed_tokens`` just catches up with its known tokens.
When a running request needs a block and none is free, the policy's victim
is preempted (blocks freed, recomputed later), and nothing new is admitted in
that step.

This module decides who runs and builds the ``SchedulerOutput``. The
``Scheduler`` is the one owner of the queues (``waiting``, ``running``), the
request map and the finished/sending id sets, all declared in its
``__init__``; two mixins hold its methods for the rest of a request's life,
one chain of bases (``Scheduler`` → ``OutputAbsorber`` → ``RequestLifecycle``
→ ``SchedulerInterface``, all but the first traits for the optional compiled
build, ``core/compiled.py``):

- ``lifecycle``: add, finish, cancel, fork (n > 1) and free requests;
- ``absorb``: ``update_from_output``, the runner's sampled tokens turned
  into request state and per-client outputs.

Nothing outside ``core/sched`` reaches into that state: the simulator and
the engine read it through the query methods at the end of this class.

Features keep their logic in their own modules; ``schedule()`` calls them:
``policy`` (queue order, victim), ``admission`` (safety margin, prefill-first,
KV-read budget), ``encoder``, ``spec_decode``, ``structured_output``,
``lora``, ``kv_connector``, ``parallel_sampling``.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Callable, Iterable, cast

from cadence.config import CacheConfig, LoRAConfig, SchedulerConfig, SpeculativeConfig
from cadence.core.kv_cache import KVCacheLayout, make_kv_cache_manager
from cadence.core.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
    PrefixCacheStats,
    SchedulerStats,
    SpecDecodingStats,
)
from cadence.core.request import Request, RequestEventType, RequestStatus
from cadence.core.sched.absorb import OutputAbsorber
from cadence.core.sched.admission import make_admission_policy, prefill_first_order
from cadence.core.sched.encoder import EncoderCacheManager, free_consumed_encoder_inputs
from cadence.core.sched.lora import LoRABatchLimit
from cadence.core.sched.parallel_sampling import ForkRegistry
from cadence.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from cadence.core.sched.prefill_caps import is_prefilling
from cadence.core.sched.policy import configured_policy
from cadence.core.sched.step import StepPlan
from cadence.core.sched.structured_output import can_fill_ahead
from cadence.core.step_time import StepTimeModel, StepTimer

if TYPE_CHECKING:
    from cadence.core.kv_cache import BlockIds
    from cadence.core.kv_cache.block_pool import KVCacheEvent
    from cadence.core.sched.kv_connector import KVConnectorBase
    from cadence.core.sched.structured_output import StructuredOutputManager

_RUNNING = RequestStatus.RUNNING
_WAITING = RequestStatus.WAITING
# Decode steps the step-time model sees before its fit bounds the running batch
# (step_time_target_s); until then COLD_START_SEATS requests run at once. Steps
# with prompts are not learned, so a cold start that admitted everyone would,
# under a stream of long prompts, leave the model nothing to learn from for as
# long as prompts keep coming, while every stream decoded slower.
MIN_STEPS_TIMED = 8
COLD_START_SEATS = 4
# The bound gives at most this many times the largest decode step timed: a fit
# from steps of one size can put the base where its prior was and extrapolate
# the rest, and a request admitted on it runs to its end. The seats grow by
# doubling, each size timed before the next.
SEATS_GROWTH = 2
# The bound's fit holds its prior (10 ms + 20 us a token) this loosely: two
# step sizes put it on the engine's line (a doubt of 1, the weight of one step,
# kept the prior's base through steps of 4, 8 and 16 tokens, and too many seats).
STEP_FIT_DOUBT = 100.0


def _decode_step_tokens(plan: StepPlan) -> int:
    """The step's tokens if every one decodes (drafts included), else 0: the
    running batch's bound learns decode steps only. A prompt token costs a
    fraction of a decoded one (the LM head runs on last positions only), so
    steps mixing both would pull the fit's per-token cost down and its base
    up, away from what one more running request adds."""
    if plan.new_block_ids:
        return 0  # a new or resumed request: its prompt
    num_tokens = plan.token_limit - plan.token_budget
    num_drafts = sum(map(len, plan.spec_tokens.values())) if plan.spec_tokens else 0
    return num_tokens if num_tokens == len(plan.running) + num_drafts else 0


class Admission(enum.Enum):
    """What ``_schedule_waiting`` does with the request ``_try_admit`` was given."""

    # It runs from this step on: off the waiting queue.
    ADMITTED = "admitted"
    # It cannot run this step but those behind it may (its KV loads
    # asynchronously; its whole prompt does not fit the budget and chunked
    # prefill is off): set it aside, try the next one.
    SKIPPED = "skipped"
    # No room for it (token, KV-read or encoder budget, blocks): it stays at
    # the head of the queue and nobody else is admitted this step.
    STOP = "stop"


class Scheduler(OutputAbsorber):
    """Continuous-batching scheduler over a paged KV cache."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        *,
        speculative_config: SpeculativeConfig | None = None,
        lora_config: LoRAConfig | None = None,
        kv_connector: KVConnectorBase | None = None,
        structured_output_manager: StructuredOutputManager | None = None,
        log_stats: bool = False,
        include_finished_set: bool = False,
        clock: Callable[[], float] = time.time,
        kv_cache_layout: KVCacheLayout | None = None,
    ) -> None:
        """``clock``: the time requests' arrival times are on (the simulator's
        virtual clock there); policies that time steps read it.
        ``kv_cache_layout``: the model's groups of layers (``kv_cache/groups.py``);
        None: one group of full attention, the plain manager."""
        if cache_config.num_gpu_blocks is None:
            raise ValueError("num_gpu_blocks: the scheduler needs the number of KV-cache blocks")
        self.config = scheduler_config
        self.max_num_running_reqs = scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.block_size = cache_config.block_size
        self.log_stats = log_stats
        self.kv_cache_manager = make_kv_cache_manager(
            cache_config.num_gpu_blocks,
            cache_config.block_size,
            scheduler_config.max_model_len,
            enable_caching=cache_config.enable_prefix_caching,
            hash_algo=cache_config.prefix_caching_hash_algo,
            enable_kv_cache_events=cache_config.enable_kv_cache_events,
            log_stats=log_stats,
            layout=kv_cache_layout,
        )
        # Stats report each group's share of the blocks where there are groups.
        self._reports_group_usage = kv_cache_layout is not None and kv_cache_layout.is_hybrid
        policy = self.policy = configured_policy(scheduler_config)
        policy.set_clock(clock)
        policy.bind_kv_cache_manager(self.kv_cache_manager)
        # The hooks a policy overrides; None where it keeps the default (which
        # decides nothing), so a plain step does not call them.
        overrides = policy.overrides
        self._check_admission = policy.check_admission if overrides("check_admission") else None
        self._displace = policy.displace if overrides("displace") else None
        self._account = policy.account if overrides("account") else None
        self._defers_prefill = policy.defers_prefill if overrides("defers_prefill") else None
        self._begin_step = policy.begin_step if overrides("begin_step") else None
        self._step_budget = policy.step_budget if overrides("step_budget") else None
        # The queues and the request map: this object is their one owner.
        self.waiting = self.policy.make_queue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.admission = make_admission_policy(scheduler_config.admission_safety_margin)
        # step_time_target_s: the engine's steps, timed on this clock, bound the running batch.
        self.step_time_target_s = scheduler_config.step_time_target_s or None  # (0: no bound)
        self.step_time_max_wait_s = scheduler_config.step_time_max_wait_s
        self.step_time_target_solo_steps = scheduler_config.step_time_target_solo_steps or None
        self._clock = clock
        self._step_timer = (
            StepTimer(clock, StepTimeModel(per_token_doubt=STEP_FIT_DOUBT, base_doubt=STEP_FIT_DOUBT))
            if self.step_time_target_s is not None else None
        )
        self.encoder_cache_manager = EncoderCacheManager(scheduler_config.encoder_cache_tokens)
        self.speculative_config = speculative_config
        self.num_spec_tokens = speculative_config.num_speculative_tokens if speculative_config else 0
        self.num_lookahead_tokens = (
            speculative_config.num_lookahead_tokens if speculative_config else 0
        )
        self.lora_config = lora_config
        self.connector = kv_connector
        if kv_connector is not None:
            kv_connector.bind_kv_cache_manager(self.kv_cache_manager)
        # Requests whose async KV load finished -> their valid leading blocks
        # (None: all): the absorber adds, admission takes.
        self.finished_recving_kv_req_ids: dict[str, int | None] = {}
        # Requests loading KV -> (the tokens they will have computed, their
        # status before): set when the load starts, taken when it finished.
        self._remote_kv_loads: dict[str, tuple[int, RequestStatus]] = {}
        # Waiting requests whose load finished, holding their blocks, not admitted yet.
        self._loaded_waiting: set[str] = set()
        self.structured_output_manager = structured_output_manager
        self.async_scheduling = scheduler_config.async_scheduling
        self.forks = ForkRegistry(cache_config.block_size)  # parallel sampling (n > 1)
        # Finished since the last schedule(): the runner drops their state.
        self.finished_req_ids: set[str] = set()
        # The same per client, for front ends that asked (include_finished_set).
        self.finished_req_ids_dict: dict[int, set[str]] | None = (
            defaultdict(set) if include_finished_set else None)
        # Running requests the runner has not seen yet (forked children).
        self.unsent_running: set[str] = set()
        # Finished requests whose blocks a KV connector still sends: the engine
        # keeps stepping until it reports them sent (or gives up on them).
        self.sending_req_ids: set[str] = set()
        # Thread-safe cancellation: other threads queue ids, schedule() applies them.
        self._cancel_lock = threading.Lock()
        self._pending_cancels: set[str] = set()
        # Outputs of requests finished inside schedule() (e.g. a grammar that failed).
        self._orphan_outputs: list[EngineCoreOutput] = []
        self._orphan_clients: list[int] = []
        self.kv_events: list[KVCacheEvent] = []
        self.step_counter = 0
        # Failed steps taken back (step_faults): suspects, ids for the runner to
        # drop, steps absorbed, requests freed while steps ran.
        self.suspects: set[str] = set()
        self.taken_back_req_ids: set[str] = set()
        self.num_steps_absorbed = 0
        self.freed_in_flight: dict[str, tuple[Request, int]] = {}
        # Waiting request id -> the step it was first blocked (max_blocked_bypass_steps).
        self._blocked_since: dict[str, int] = {}
        self.num_preemptions_total = 0
        self._num_step_preemptions = 0
        self.num_swapped_preemptions_total = 0
        self._num_swaps_unreported = 0  # swapped preemptions since the last stats

    # ------------------------------------------------------------------
    # schedule()
    # ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self._apply_cancellations()
        if self._step_timer is not None:
            # With nothing running since the last step the engine may have idled.
            self._step_timer.step_begins(learn=bool(self.running))
        if self._begin_step is not None:
            self._begin_step(self.running)
        budget = self.max_num_scheduled_tokens
        if self._step_budget is not None:
            budget = self._step_budget(budget)
        plan = StepPlan(budget, self.config)
        if self.lora_config is not None:
            # Count every running request's adapter, scheduled this step or not,
            # so the running set itself never holds more than max_loras adapters.
            plan.loras = LoRABatchLimit(self.lora_config.max_loras)
            plan.loras.add_running(self.running)
        deferred = self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting(plan)
        if deferred and not plan.num_scheduled_tokens:
            # The policy held these prompts back for a request that could not
            # be admitted after all: an empty step helps nobody (and, while
            # they hold the blocks it needs, would repeat for ever).
            self._schedule_running(plan, deferred, honour_deferral=False)
        if self._step_timer is not None:
            self._step_timer.step_planned(_decode_step_tokens(plan))
        return self._make_output(plan)

    def running_seats(self) -> int:
        """How many requests may run at once now: ``max_num_seqs``, or fewer
        where ``step_time_target_s`` is set and the step-time model, once it
        has seen a few steps, predicts that a step of one token per running
        request would pass the target with more (never fewer than one). With
        ``step_time_target_solo_steps`` the target is at least that many
        single-stream steps. Before the model has seen MIN_STEPS_TIMED decode
        steps: COLD_START_SEATS; after, never more than SEATS_GROWTH times the
        largest decode step it has seen (nor than that where its fit gives a
        step no cost per token)."""
        seats = self.max_num_running_reqs
        timer = self._step_timer
        if timer is None or self.step_time_target_s is None:
            return seats
        if timer.model.num_observed < MIN_STEPS_TIMED:
            return min(seats, COLD_START_SEATS)
        grown = max(COLD_START_SEATS, SEATS_GROWTH * timer.max_tokens_timed)
        base_s, per_token_s = timer.model.theta
        if per_token_s <= 0:
            return min(seats, grown)  # steps of one size, faster than the prior's base
        target_s = self.step_time_target_s
        stream_s = timer.stream_step_s()
        if self.step_time_target_solo_steps is not None and stream_s is not None:
            # A model whose single stream is slow is held to its own pace instead.
            # Not the fit's prediction for one token: over large steps, which cost
            # less per token, its base rises, and the seats with it, and the base again.
            target_s = max(target_s, self.step_time_target_solo_steps * stream_s)
        fits = int((target_s - base_s) / per_token_s)
        return max(1, min(seats, grown, fits))

    def _burst_admits(self, request: Request, seats: int) -> bool:
        """Whether ``request`` runs past the step-time bound: it waited
        ``step_time_max_wait_s`` while the queue is short (a burst; a long
        queue is sustained load, which the bound holds back). ``max_num_seqs``
        is never passed."""
        max_wait_s = self.step_time_max_wait_s
        return (
            max_wait_s is not None
            and len(self.running) < self.max_num_running_reqs
            and len(self.waiting) <= max(1, seats // 4)
            and self._clock() - request.arrival_time >= max_wait_s
        )

    def _schedule_running(
        self, plan: StepPlan, requests: list[Request] | None = None, honour_deferral: bool = True
    ) -> list[Request]:
        """Give running requests (all, or ``requests``) their next tokens,
        preempting when blocks run out; returns those whose prompt the policy
        deferred."""
        config = self.config
        threshold = config.long_prefill_token_threshold
        max_model_len = self.max_model_len
        kv = self.kv_cache_manager
        lookahead = self.num_lookahead_tokens
        unsent = self.unsent_running
        if requests is not None:
            order = requests
        else:
            order = prefill_first_order(self.running) if config.prefill_first else list(self.running)
        caps = plan.prefill_caps
        defers = self._defers_prefill if honour_deferral else None
        deferred: list[Request] = []
        for request in order:
            budget = plan.token_budget
            if budget <= 0:
                break
            if request.status != _RUNNING:
                continue  # preempted earlier in this loop
            if caps is not None and not caps.admits(request):
                continue  # its prompt waits for a prefill slot
            if defers is not None and is_prefilling(request) and defers(request):
                deferred.append(request)
                continue  # the policy gives this step to a waiting request's prompt
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
            new_block_ids = kv.allocate_slots(request, num_new, 0, None, lookahead, True)
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
                plan.schedule_running(request, num_new, new_block_ids)
            if caps is not None:
                caps.count(request)
        return deferred

    def _limit_special(self, request: Request, num_new: int) -> int:
        """Limits of a parent waiting to fork (n > 1) and of async placeholders."""
        if request.fork_point is not None:
            num_new = min(num_new, request.fork_point - request.num_computed_tokens)
        if request.num_output_placeholders:
            # Async: the tokens in flight may already reach max_tokens; and a
            # grammar's mask needs the token in flight, so it waits for it
            # (a thinking budget's mask while it thinks does not: can_fill_ahead).
            if request.max_tokens is not None and \
                    request.num_output_tokens + request.num_output_placeholders >= request.max_tokens:
                return 0
            if request.structured_output_request is not None and not can_fill_ahead(request):
                return 0
        return num_new

    def _preempt_until_allocated(
        self, request: Request, num_new: int, plan: StepPlan
    ) -> BlockIds | None:
        """Preempt victims until ``request`` gets its blocks; None if it was the victim."""
        while True:
            victim = self.policy.pick_victim(self.running)
            self._preempt(victim, plan)
            if victim is request:
                return None
            new_block_ids = self.kv_cache_manager.allocate_slots(
                request, num_new, num_lookahead_tokens=self.num_lookahead_tokens,
                delay_cache_blocks=True,
            )
            if new_block_ids is not None:
                return new_block_ids

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Preemption by recompute: free the blocks, requeue at the head."""
        if self.running and self.running[-1] is request:
            self.running.pop()
        else:
            self.running.remove(request)
        # A forked child first sent in this very step is taken back before the
        # runner ever sees it: like an unsent one, it will start as a new request.
        sent_this_step = request in plan.new
        plan.unschedule(request)
        plan.drop_encoder_inputs(request, self.encoder_cache_manager)
        self.encoder_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        unsent = self.unsent_running
        if request.request_id in unsent or sent_this_step:
            # Never sent to the runner: it will start as a new request.
            unsent.discard(request.request_id)
            request.status = _WAITING
        elif self.connector is not None and self.connector.request_preempted(request):
            # Swap preemption: the connector copies the KV out before the
            # blocks are reused, and offers it back when the request is admitted.
            self.num_swapped_preemptions_total += 1
            self._num_swaps_unreported += 1
        self.kv_cache_manager.free(request)
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
        caps = plan.prefill_caps
        if (self.finished_recving_kv_req_ids or self._loaded_waiting) and not self._admit_loaded(plan):
            return
        seats = self.running_seats()
        while waiting and plan.token_budget > 0:
            request = waiting.peek_request()
            if self._grammar_failed(request):
                # Before the seat check: a failed grammar at the head must not
                # wait for a seat (a policy may hold the others back for it).
                waiting.pop_request()
                error = request.structured_output_request.error
                if not error.startswith("structured_outputs"):
                    error = f"structured_outputs: {error}"
                self._abort_unservable(request, error)
                continue
            if (len(self.running) >= seats and not self._burst_admits(request, seats)
                    and not self._displace_for(request, plan)):
                break
            if plan.preempted and request in plan.preempted:
                # Displaced in this very step: it does not come back in the same one
                # (with a step in flight its placeholders would count twice).
                break
            if self.suspects and request.request_id in self.suspects and self._has_running_suspect():
                break  # one suspect of a failed step runs at a time (step_faults)
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
            if self._defers_prefill is not None and self._defers_prefill(request):
                break  # this step is kept short for the client the policy favours
            if caps is not None and not caps.admits(request):
                if caps.full:
                    break
                skipped.append(waiting.pop_request())  # a long prompt: short ones may pass
                continue
            outcome = self._try_admit(request, plan)
            if outcome is Admission.STOP:
                break
            waiting.pop_request()
            if outcome is Admission.SKIPPED:
                skipped.append(request)  # not runnable this step (e.g. async KV load)
            elif caps is not None:
                caps.count(request)
        if skipped:
            waiting.prepend_requests(skipped)

    def _admit_loaded(self, plan: StepPlan) -> bool:
        """Admit first the waiting requests whose KV load finished: they hold
        blocks, and behind a request that waits for blocks (waiting requests are
        never preempted) they would hold them forever, whatever the queue order.
        False: nobody else may be admitted this step (see ``_release_loaded``)."""
        requests = self.requests
        self._loaded_waiting.intersection_update(requests)  # drop those aborted meanwhile
        admitted: list[Request] = []
        for req_id in (*self.finished_recving_kv_req_ids, *self._loaded_waiting):
            request = requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if len(self.running) >= self.max_num_running_reqs or plan.token_budget <= 0:
                break
            if not self._is_ready(request) or request.num_computed_tokens == 0:
                continue  # a failed load holds nothing: it waits its turn
            if plan.loras and not plan.loras.can_add(request):
                continue
            if self._try_admit(request, plan) is not Admission.ADMITTED:
                if not plan.num_scheduled_tokens and not any(
                        r.num_output_placeholders for r in self.running):
                    # No progress this step, none in flight: free the others' loads.
                    self._release_loaded(keep=request)
                    self.waiting.remove_requests(admitted)
                    return False
                break
            admitted.append(request)
        if admitted:
            self.waiting.remove_requests(admitted)
        return True

    def _release_loaded(self, keep: Request) -> None:
        """Nothing runs this step and ``keep``, loaded, cannot get the blocks
        it needs: other loaded requests may hold them (loads start beside each
        other, and waiting requests are never preempted). Their KV goes back to the
        prefix cache (registered when their loads finished) and they start
        over, finding it as local hits if it is still there; nobody else is
        admitted in this step, so ``keep`` gets the blocks in the next."""
        kv = self.kv_cache_manager
        for req_id in [*self.finished_recving_kv_req_ids, *self._loaded_waiting]:
            request = self.requests.get(req_id)
            if request is None or request is keep or request.is_finished():
                continue
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self._finish_remote_kv_load(request)
            self._loaded_waiting.discard(req_id)
            kv.free(request)
            request.num_computed_tokens = 0

    def _displace_for(self, request: Request, plan: StepPlan) -> bool:
        """With every running slot taken: preempt the running request the policy
        says ``request`` outranks; False when it must wait."""
        if not self._is_ready(request):
            return False  # not ready to run (grammar, remote KV): no reason to displace
        caps = plan.prefill_caps
        if caps is not None and not caps.admits(request):
            return False  # it could not take the seat this step: displacing would only cost
        if self.connector is not None and request.num_computed_tokens == 0 and \
                self.connector.would_load_async(
                    request, self.kv_cache_manager.num_cached_prefix_tokens(request)):
            return False  # it would load its KV first, not run: it waits for a seat
        victim = None if self._displace is None else self._displace(request, self.running)
        if victim is None:
            return False
        self._preempt(victim, plan)
        return True

    def _blocked(self, request: Request) -> Admission:
        """A prompt that does not fit this step's budget whole (chunked prefill off).

        The queue stops behind it, as vLLM's does, unless
        ``max_blocked_bypass_steps`` lets later requests pass it for that many steps.
        """
        bypass = self.config.max_blocked_bypass_steps
        if bypass:
            blocked = self._blocked_since
            if len(blocked) > 2 * len(self.requests):  # drop requests that left
                self._blocked_since = blocked = {r: s for r, s in blocked.items() if r in self.requests}
            first = blocked.setdefault(request.request_id, self.step_counter)
            if self.step_counter - first < bypass:
                return Admission.SKIPPED
        return Admission.STOP

    def _try_admit(self, request: Request, plan: StepPlan) -> Admission:
        """Schedule one waiting request, or say why not (see ``Admission``)."""
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
                # A request back from preemption whose prompt and outputs outgrew the
                # whole budget could never run again: it alone is chunked.
                if num_new <= self.max_num_scheduled_tokens:
                    return self._blocked(request)
            num_new = min(num_new, plan.token_budget)
            if num_new <= 0 or not plan.can_read_kv(request, num_new, num_computed):
                return Admission.STOP
            if request.mm_positions:
                num_new = plan.add_encoder_inputs(
                    request, num_new, self.encoder_cache_manager, num_computed
                )
                if num_new <= 0:
                    return Admission.STOP
        new_block_ids = kv.allocate_slots(
            request, num_new + num_external, num_local, hits,
            num_lookahead_tokens=self.num_lookahead_tokens, delay_cache_blocks=True,
            # (what a window group must hold follows where the load leaves the request)
            num_external_computed_tokens=max(
                0, self._computed_after_load(request, num_computed) - num_computed + num_external)
            if num_external else 0,
        )
        if new_block_ids is None:
            plan.drop_encoder_inputs(request, self.encoder_cache_manager)
            return Admission.STOP
        if self.connector is not None:
            blocks = cast(Any, kv).req_to_blocks[request.request_id]  # (one list, or one per group)
            self.connector.update_state_after_alloc(request, blocks, num_external)
        if load_async:
            self._start_remote_kv_load(request, num_computed)
            return Admission.SKIPPED
        self._start_running(request, num_computed, num_new, plan)
        return Admission.ADMITTED

    def _computed_prefix(self, request: Request) -> tuple[Any, int, int, bool]:
        """(local cache hits, their token count, external tokens, async load?)."""
        if request.num_computed_tokens > 0:
            # Its KV is already in place (a forked child, or an async load that finished).
            return None, 0, 0, False
        hits, num_local = self.kv_cache_manager.get_computed_blocks(request)
        if request.fork_point is not None:
            # A parent must compute something before it forks.
            hits, num_local = self.kv_cache_manager.cut_hits(
                hits, max(0, request.fork_point // self.block_size - 1))
            if num_local >= request.fork_point - self.block_size:
                # Nothing external could be used either (a load is cut there too).
                return hits, num_local, 0, False
        if self.connector is None:
            return hits, num_local, 0, False
        num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_local)
        return hits, num_local, num_external or 0, bool(load_async)

    def _start_running(self, request: Request, num_computed: int, num_new: int, plan: StepPlan) -> None:
        if self._blocked_since:
            self._blocked_since.pop(request.request_id, None)
        if self._loaded_waiting:
            self._loaded_waiting.discard(request.request_id)
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

    def _start_remote_kv_load(self, request: Request, num_computed: int) -> None:
        """The request waits, holding its blocks, while the connector loads its KV."""
        loads = self._remote_kv_loads
        if len(loads) > 2 * len(self.requests):  # drop requests aborted while loading
            self._remote_kv_loads = loads = {r: v for r, v in loads.items() if r in self.requests}
        loads[request.request_id] = (num_computed, request.status)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS

    def _computed_after_load(self, request: Request, num_loaded: int) -> int:
        """Tokens computed once a load up to ``num_loaded`` lands."""
        # Keep at least one token to compute, so the request gets logits.
        num_computed = min(num_loaded, request.num_tokens - 1)
        if request.fork_point is not None:
            # A parent forks after a step of its own: as with local hits, it
            # computes (again) the block before its fork point.
            num_computed = min(num_computed, request.fork_point - self.block_size)
        return num_computed

    def _finish_remote_kv_load(self, request: Request) -> None:
        """Blocks loaded by the connector become the request's computed prefix.

        When a load failed, the blocks before the first bad one enter the
        prefix cache and all are released: the request starts over, finding
        the good ones as local hits, and computes the rest."""
        num_valid = self.finished_recving_kv_req_ids.pop(request.request_id)
        num_loaded, status = self._remote_kv_loads.pop(request.request_id)
        # Back from a swap: still preempted, so the runner resumes its state.
        request.status = status
        kv = self.kv_cache_manager
        num_computed = self._computed_after_load(request, num_loaded)
        # A window group got only what its window reads at the load's end: the
        # entries before it (never written) go before anything enters the prefix cache.
        kv.free_behind_window(request, num_computed)
        if num_valid is not None:
            kv.cache_blocks(request, min(num_valid * self.block_size, num_computed))
            kv.free(request)
            return
        kv.cache_blocks(request, num_computed)
        request.num_computed_tokens = num_computed
        self._loaded_waiting.add(request.request_id)

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
            total_num_scheduled_tokens=plan.token_limit - plan.token_budget,
            scheduled_spec_decode_tokens=plan.spec_tokens,
            scheduled_encoder_inputs=plan.encoder_inputs,
            num_common_prefix_blocks=self._num_common_prefix_blocks(),
            finished_req_ids=self._take_finished_req_ids(),
            preempted_req_ids=self._preempted_ids(plan),
            free_encoder_input_ids=self.encoder_cache_manager.take_freed_ids(),
            structured_output_request_ids=structured_ids,
        )
        if structured_ids and self.structured_output_manager is not None:
            output.grammar_bitmask = self.structured_output_manager.grammar_bitmask(
                self.requests, structured_ids, plan.spec_tokens
            )
        if self.connector is not None:
            output.kv_connector_metadata = self.connector.build_connector_meta(output)
        if self._account is not None:
            self._account(plan.num_scheduled_tokens, self.requests, self.running)
        self._advance_computed_tokens(plan)
        if self.kv_cache_manager.block_pool.enable_events:
            self.kv_events.extend(self.kv_cache_manager.take_events())
        self._num_step_preemptions = len(plan.preempted)
        self.num_preemptions_total += len(plan.preempted)
        self.step_counter += 1
        return output

    def _preempted_ids(self, plan: StepPlan) -> set[str]:
        """Ids whose rows the runner drops: this step's preempted, and any taken back."""
        preempted = {r.request_id for r in plan.preempted}
        if self.taken_back_req_ids:
            preempted |= self.taken_back_req_ids
            self.taken_back_req_ids = set()
        return preempted

    def _make_cached_request_data(self, plan: StepPlan) -> CachedRequestData:
        running, resumed = plan.running, plan.resumed
        req_ids = [r.request_id for r in running]
        num_computed = [r.num_computed_tokens for r in running]
        new_block_ids = plan.new_block_ids
        block_ids = plan.running_block_ids  # (the plan ends with this step)
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
        taken back in ``update_from_output``.

        Blocks this step fills enter the prefix cache here, once the step is
        final, never at allocation: a request scheduled and then taken back
        in the same ``schedule()`` call (displaced, preempted) must not leave
        blocks that no step writes findable as hits. A request admitted in
        this step therefore does not share blocks another one fills in this
        same step; from the next step on it would (the step in flight writes
        them before any later step reads them)."""
        requests = self.requests
        track_placeholders = self.async_scheduling
        kv = self.kv_cache_manager
        caching, num_cached, block_size = kv.enable_caching, kv.num_cached_blocks, self.block_size
        for req_id, num_new in plan.num_scheduled_tokens.items():
            request = requests[req_id]
            num_computed = request.num_computed_tokens = request.num_computed_tokens + num_new
            if caching:
                # Only tokens whose ids are known are hashed (not drafts, not placeholders).
                num_known = request.num_tokens
                if num_computed < num_known:
                    num_known = num_computed
                if num_known // block_size > num_cached[req_id]:
                    kv.cache_blocks(request, num_known)
            if track_placeholders and num_computed >= request.num_tokens and not request.is_pooling:
                # Every token past the known ones samples one (the last) output
                # (a pooling request samples none: it finishes with its prompt).
                request.num_output_placeholders += 1 + len(plan.spec_tokens.get(req_id, ()))
            if request.mm_positions:
                free_consumed_encoder_inputs(request, self.encoder_cache_manager)

    def _num_common_prefix_blocks(self) -> int:
        if not self.running:
            return 0
        return self.kv_cache_manager.get_num_common_prefix_blocks(self.running[0], len(self.running))

    # ------------------------------------------------------------------
    # update_from_output() and requests from outside
    # ------------------------------------------------------------------

    # ------------------------------------------------------------------
    # queries
    # ------------------------------------------------------------------

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_requests(self) -> bool:
        # The interface's answer in one expression: an engine loop asks every step.
        # Blocks a KV connector still sends count: their frees come in steps.
        return bool(self.running or self.waiting or self.finished_req_ids
                    or self.sending_req_ids)

    def has_finished_requests(self) -> bool:
        return len(self.finished_req_ids) > 0

    def get_request_counts(self) -> tuple[int, int]:
        return len(self.running), len(self.waiting)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished (or still sending) request of this id, if any."""
        return self.requests.get(request_id)

    def num_sending_requests(self) -> int:
        """Finished requests whose blocks a KV connector still sends."""
        return len(self.sending_req_ids)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self, spec_decoding_stats: SpecDecodingStats | None = None) -> SchedulerStats | None:
        if not self.log_stats:
            return None
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            kv_cache_group_usage=self.kv_cache_manager.group_usage() if self._reports_group_usage else None,
            prefix_cache_stats=self.kv_cache_manager.make_prefix_cache_stats() or PrefixCacheStats(),
            spec_decoding_stats=spec_decoding_stats,
            num_corrupted_reqs=sum(1 for r in self.running if r.num_nans_in_logits > 0),
            num_preemptions=self._num_step_preemptions,
            num_swapped_preemptions=self._take_num_swaps(),
            step_counter=self.step_counter,
            client_service=self.policy.service_stats(),
            connector_prefix_cache_stats=(self.connector.make_prefix_cache_stats()
                                          if self.connector is not None else None),
            running_seats=self.running_seats() if self._step_timer is not None else None,
        )

    def _take_num_swaps(self) -> int:
        num_swaps, self._num_swaps_unreported = self._num_swaps_unreported, 0
        return num_swaps

    def take_kv_events(self) -> list[KVCacheEvent]:
        """Cache events since the last call (including a reset between steps)."""
        events, self.kv_events = self.kv_events, []
        events.extend(self.kv_cache_manager.take_events())
        return events

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()
        if self.structured_output_manager is not None:
            self.structured_output_manager.shutdown()

    def get_kv_connector(self) -> KVConnectorBase | None:
        return self.connector
