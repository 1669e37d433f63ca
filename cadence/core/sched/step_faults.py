"""Steps the runner failed: take them back, then find the request that fails.

When ``execute_model`` raises, no token of the step exists, yet the scheduler
has counted its tokens as computed and entered the blocks it was to fill in
the prefix cache (``Scheduler._advance_computed_tokens``). The engine core
hands the failed steps back (``take_back_steps``: the one that raised, and
with async scheduling the one in flight behind it); every request in them

- has the blocks those steps were to fill taken out of the prefix cache
  (they hold no such KV, or half of it), so no later request reads them;
- goes back to the head of the waiting queue holding nothing, to be sent to
  the runner anew (its state there may hold what the failed step did).

Then the request that makes steps fail is looked for, one suspect at a time:

    a step of a, b, c fails      ->  a, b, c wait again, all suspects
    later steps run one suspect, beside any number of others
    a suspect's step succeeds    ->  it is cleared
    a step with one suspect fails->  that suspect ends with the error; the
                                     others wait again, not suspects
    a step of one request fails  ->  that request ends with the error

so one bad request (a parameter a kernel cannot take) ends alone while the
engine serves the others. A fault that is not a request's fails every step:
the engine core stops after a few in a row (``EngineCore``).

A KV connector's transfers cannot be taken back here: with one, a failed
step stops the engine as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cadence.core.compiled import trait
from cadence.core.request import Request, RequestStatus
from cadence.core.sched.lifecycle import RequestLifecycle

if TYPE_CHECKING:
    from cadence.core.sched.output import SchedulerOutput

_WAITING = RequestStatus.WAITING


@trait
class StepFaults(RequestLifecycle):
    """Methods of ``Scheduler`` that take failed steps back and isolate the
    request that fails them (see the module docstring)."""

    # The scheduler's state these methods read and change (see Scheduler.__init__;
    # RequestLifecycle declares the suspects, and the requests freed while steps ran).
    block_size: int
    # Ids taken back since the last schedule(): the runner drops their rows.
    taken_back_req_ids: set[str]

    def take_back_steps(self, failed: list[SchedulerOutput]) -> list[str] | None:
        """Undo ``failed`` (steps the runner raised on, oldest first); returns the
        ids to end with the runner's error (the request found to fail), or None
        where steps cannot be taken back (a KV connector's transfers)."""
        if self.connector is not None:
            return None
        self.num_steps_absorbed += len(failed)  # (they come back as nothing)
        taken: dict[str, Request] = {}
        for output in failed:
            for request, begin, end in self._step_spans(output):
                self.kv_cache_manager.forget_blocks(request, begin // self.block_size, end // self.block_size)
                if request.request_id in self.requests and not request.is_finished():
                    taken[request.request_id] = request
        culprits = self._blame(list(taken))
        # (those a later step preempted already wait)
        was_running = [r for r in taken.values() if r.status == RequestStatus.RUNNING]
        for request in taken.values():
            self._take_back(request)
        self.waiting.prepend_requests(was_running)
        self.taken_back_req_ids.update(taken)
        if not culprits:
            self.suspects.update(taken)
        self._let_go_of_freed()
        return culprits

    def _step_spans(self, output: SchedulerOutput) -> list[tuple[Request, int, int]]:
        """Each request of a step, with the token positions it was to compute
        (those whose ids were known, the only ones hashed)."""
        begins = {new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs}
        cached = output.scheduled_cached_reqs
        begins.update(zip(cached.req_ids, cached.num_computed_tokens))
        spans = []
        for req_id, num_scheduled in output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None and req_id in self.freed_in_flight:
                request = self.freed_in_flight[req_id][0]
            if request is None:
                continue
            begin = begins[req_id]
            spans.append((request, begin, min(begin + num_scheduled, request.num_tokens)))
        return spans

    def _blame(self, req_ids: list[str]) -> list[str]:
        """The request the failure is laid on: the step's only one, or its one suspect."""
        if len(req_ids) == 1:
            return req_ids
        held = [req_id for req_id in req_ids if req_id in self.suspects]
        return held if len(held) == 1 else []

    def _take_back(self, request: Request) -> None:
        """Back to waiting, holding nothing, to be sent to the runner anew."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        self.encoder_cache_manager.free(request)
        self.kv_cache_manager.free(request)
        self.unsent_running.discard(request.request_id)
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0
        request.spec_token_ids = []
        request.status = _WAITING

    def _has_running_suspect(self) -> bool:
        suspects = self.suspects
        return any(request.request_id in suspects for request in self.running)

    def _after_absorbed(self, output: SchedulerOutput) -> None:
        """A step came back whole (with suspects or kept requests): its suspects
        are cleared, and requests freed before the next was scheduled let go."""
        if self.suspects:
            self.suspects.difference_update(output.num_scheduled_tokens)
        self._let_go_of_freed()

    def _let_go_of_freed(self) -> None:
        """Drop the requests freed before the oldest step still in flight was scheduled."""
        if self.freed_in_flight:
            absorbed = self.num_steps_absorbed
            self.freed_in_flight = {req_id: kept for req_id, kept in self.freed_in_flight.items()
                                    if kept[1] > absorbed}
