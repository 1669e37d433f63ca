"""The request lifecycle: a request enters, may fork, finishes and leaves.

    add ──> waiting ──(schedule)──> running ──(stop, finish, cancel)──> freed
                                      │
                  n > 1, at its fork point: the parent is replaced by its
                  n children; those that fit run at once on its blocks,
                  the others wait holding nothing

``RequestLifecycle`` holds the ``Scheduler``'s methods for: the checks a
new request must pass; starting its grammar; the parallel-sampling forks;
finishing requests from outside, from any thread (cancellation) or because
they can never run; freeing a finished request (its blocks go back at once,
or once a KV connector has sent them); and the ids finished since the last
step, which the runner and the front ends are told about.

It is a mixin of the scheduler, which owns the state (declared in
``Scheduler.__init__``): ``requests``, ``running``, ``waiting`` and the id
sets below live on one object. The scheduler decides who runs; these
methods only move requests in and out.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Callable, Iterable

from cadence.core.compiled import trait
from cadence.core.outputs import EngineCoreOutput
from cadence.core.request import Request, RequestEventType, RequestStatus
from cadence.core.sched.interface import SchedulerInterface

if TYPE_CHECKING:
    from cadence.config import SchedulerConfig
    from cadence.core.kv_cache.interface import KVCacheManagerBase
    from cadence.core.sched.encoder import EncoderCacheManager
    from cadence.core.sched.kv_connector import KVConnectorBase
    from cadence.core.sched.parallel_sampling import ForkRegistry
    from cadence.core.sched.policy import RequestQueue
    from cadence.core.sched.structured_output import StructuredOutputManager

_RUNNING = RequestStatus.RUNNING
_WAITING = RequestStatus.WAITING
_PREEMPTED = RequestStatus.PREEMPTED  # statuses above it are finished ones


@trait
class RequestLifecycle(SchedulerInterface):
    """Methods of ``Scheduler`` that add, fork, finish and free requests.

    A mixin with no state of its own: it reads and changes the scheduler's
    ``requests``, ``running`` and ``waiting``, and the finished, sending and
    unsent id sets that ``Scheduler.__init__`` declares. It implements the
    interface's ``add_request`` and ``finish_requests``; a trait, so that the
    compiled build keeps the scheduler's one chain of bases (``compiled``).
    """

    # The scheduler's state these methods read and change (see Scheduler.__init__).
    config: SchedulerConfig
    requests: dict[str, Request]
    running: list[Request]
    waiting: RequestQueue
    kv_cache_manager: KVCacheManagerBase
    encoder_cache_manager: EncoderCacheManager
    connector: KVConnectorBase | None
    structured_output_manager: StructuredOutputManager | None
    forks: ForkRegistry
    finished_req_ids: set[str]
    finished_req_ids_dict: dict[int, set[str]] | None
    unsent_running: set[str]
    sending_req_ids: set[str]
    max_model_len: int
    max_num_running_reqs: int
    max_num_scheduled_tokens: int
    log_stats: bool
    _check_admission: Callable[[Request], None] | None  # the policy's hook, if it has one
    _cancel_lock: threading.Lock
    _pending_cancels: set[str]  # cancelled from other threads, applied by schedule()
    _orphan_outputs: list[EngineCoreOutput]  # of requests finished inside schedule()
    _orphan_clients: list[int]
    async_scheduling: bool
    step_counter: int  # steps scheduled so far
    num_steps_absorbed: int  # steps whose results came back (update_from_output)
    # Requests freed while steps were in flight (async scheduling), kept until
    # those steps come back: one that failed had entered their blocks in the
    # prefix cache (``step_faults``). req_id -> (request, step_counter then).
    freed_in_flight: dict[str, tuple[Request, int]]
    suspects: set[str]  # requests a failed step held (``step_faults``)

    # ------------------------------------------------------------------
    # entering
    # ------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request; ``ValueError`` naming the field if it can never run here
        (or, n > 1 with nothing to share, queue its children)."""
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
            field = ("structured_outputs" if request.sampling_params.structured_outputs is not None
                     else "thinking_token_budget")
            raise ValueError(f"{field}: this engine has no grammar backend (it has no tokenizer: "
                             "token-id prompts only)")
        if not self.config.enable_chunked_prefill and request.num_prompt_tokens > self.max_num_scheduled_tokens:
            # It would wait forever, and (the queue stops behind it) so would everyone after it.
            raise ValueError(
                f"prompt: {request.num_prompt_tokens} tokens exceed max_num_batched_tokens="
                f"{self.max_num_scheduled_tokens}, and without chunked prefill a prompt is "
                "prefilled in one step")
        if self._check_admission is not None:
            self._check_admission(request)  # the policy's, e.g. a latency target out of reach
        if request.sampling_params.n > 1:
            children = self.forks.prepare(request, self.kv_cache_manager)
            if children is not None:  # too short to share a block: fork at once
                for child in children:
                    self._init_grammar(child)
                    self._queue(child)
                return
        else:
            self._init_grammar(request)
        self._queue(request)

    def _init_grammar(self, request: Request) -> None:
        """Start compiling the request's grammar; it waits in WAITING_FOR_FSM meanwhile."""
        if request.use_structured_output:
            assert self.structured_output_manager is not None  # add_request refuses grammars without one
            self.structured_output_manager.grammar_init(request)
            request.status = RequestStatus.WAITING_FOR_FSM

    def _queue(self, request: Request) -> None:
        self.waiting.add_request(request)
        self.requests[request.request_id] = request
        if self.log_stats:
            request.record_event(RequestEventType.QUEUED)

    # ------------------------------------------------------------------
    # forking (n > 1)
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
                self.unsent_running.add(child.request_id)
            else:
                waiting_children.append(child)
        self.kv_cache_manager.free(parent)
        del self.requests[parent.request_id]
        self.finished_req_ids.add(parent.request_id)
        parent.status = RequestStatus.FINISHED_STOPPED
        if waiting_children:
            self.waiting.prepend_requests(waiting_children)

    # ------------------------------------------------------------------
    # finishing
    # ------------------------------------------------------------------

    def finish_requests(self, request_ids: str | Iterable[str], finished_status: RequestStatus) -> None:
        """Finish requests (and a forked parent's live children); unknown ids are ignored."""
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
            self.running[:] = [r for r in self.running if r not in running]
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
        """Abort the requests cancelled since the last call (``schedule()`` calls it first)."""
        if not self._pending_cancels:
            return
        with self._cancel_lock:
            cancels, self._pending_cancels = self._pending_cancels, set()
        self.finish_requests(cancels, RequestStatus.FINISHED_ABORTED)

    def _abort_unservable(self, request: Request, reason: str) -> None:
        """Finish a request that can never run; its client hears it in the next outputs.

        The caller has taken it off the waiting queue."""
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

    def _remove_finished_from_queues(self, stopped: list[Request] | None = None) -> None:
        """Drop requests that stopped in this step from ``running`` and
        ``waiting``; ``stopped``: all of them, if known (each step stops few of
        many running, so those are looked for, not every request checked)."""
        if stopped is not None:
            running = self.running
            if all(request in running for request in stopped):
                for request in stopped:
                    running.remove(request)
                return
        self.running[:] = [r for r in self.running if r.status <= _PREEMPTED]
        finished_waiting = [r for r in self.waiting if r.status > _PREEMPTED]
        if finished_waiting:
            self.waiting.remove_requests(finished_waiting)

    # ------------------------------------------------------------------
    # leaving
    # ------------------------------------------------------------------

    def _free_request(self, request: Request) -> dict[str, Any] | None:
        """A finished request leaves; its blocks go back unless a connector still
        sends them. Returns the connector's transfer params for the client."""
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
        if delay_free:
            self.sending_req_ids.add(request.request_id)
        else:
            self._free_blocks(request)
        return kv_transfer_params

    def _free_blocks(self, request: Request) -> None:
        """The last step of leaving: blocks back to the pool, the request forgotten."""
        if self.async_scheduling and self.step_counter > self.num_steps_absorbed:
            self.freed_in_flight[request.request_id] = (request, self.step_counter)
        if self.suspects:
            self.suspects.discard(request.request_id)
        self.kv_cache_manager.free(request)
        self.kv_cache_manager.free_block_hashes(request)
        self.requests.pop(request.request_id, None)
        self.sending_req_ids.discard(request.request_id)

    # ------------------------------------------------------------------
    # what finished, for the step's outputs
    # ------------------------------------------------------------------

    def _take_finished_req_ids(self) -> set[str]:
        """Ids finished since the last call, for the runner to drop."""
        finished, self.finished_req_ids = self.finished_req_ids, set()
        return finished

    def _take_finished_per_client(self) -> dict[int, set[str]]:
        """Ids finished since the last call, per client (always empty unless
        ``include_finished_set``)."""
        finished = self.finished_req_ids_dict
        if not finished:
            return {}
        self.finished_req_ids_dict = defaultdict(set)
        return finished

    def _take_orphan_outputs(self) -> dict[int, list[EngineCoreOutput]]:
        """Outputs per client of requests finished inside ``schedule()``."""
        outputs: dict[int, list[EngineCoreOutput]] = {}
        if self._orphan_outputs:
            for client, output in zip(self._orphan_clients, self._orphan_outputs):
                outputs.setdefault(client, []).append(output)
            self._orphan_outputs, self._orphan_clients = [], []
        return outputs
