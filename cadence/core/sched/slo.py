"""``slo``: schedule for latency targets (TTFT, TPOT) instead of arrival order.

A request may carry targets (``Request.slo_ttft_s``, ``slo_tpot_s``); the
deployment's defaults (``--slo-ttft-s``, ``--slo-tpot-s``) fill in the rest.
A request with neither is *batch* work: it runs when nothing urgent waits.

- **Order by slack.** Waiting requests are served by their latest start:
  ``arrival + TTFT target - predicted prefill time``, batch work last (FCFS
  among itself). The prediction comes from ``StepTimeModel``, fitted online
  to the engine's own step times (the time between consecutive ``schedule``
  calls of a busy engine, on the scheduler's clock: wall time when serving,
  the virtual clock in the simulator).
- **Preempt the loosest.** When blocks run out, the victim is batch work
  first (its latest arrival), then the request with the loosest TPOT target.
  When ``max_num_seqs`` is full, a waiting request with a target displaces
  the latest running batch request; targets never displace targets.
- **Refuse what cannot be met** (``--slo-reject``): a request whose predicted
  TTFT, behind every waiting request with an earlier latest start, already
  misses its target is refused at admission (``SLOUnattainable``, HTTP 429
  with a Retry-After), so the capacity goes to requests that can still meet
  theirs: goodput, not throughput.
"""

from __future__ import annotations

import math
import time
from typing import Callable

from cadence.core.request import Request
from cadence.core.sched.policy import AdmissionRefused, KeyedQueue, SchedulingPolicy
from cadence.core.step_time import StepTimer

_INF = float("inf")


class SLOUnattainable(AdmissionRefused):
    """The request's TTFT target cannot be met at the current load."""


class SLOPolicy(SchedulingPolicy):
    """The ``slo`` policy (see the module docstring)."""

    reads_slo = True  # front ends refuse per-request targets under other policies

    def __init__(self) -> None:
        self.default_ttft_s: float | None = None
        self.default_tpot_s: float | None = None
        self.reject = False
        self.token_budget = 2048
        self.timer = StepTimer(time.time)
        self.model = self.timer.model
        self._queue: KeyedQueue | None = None

    # ---- set-up -----------------------------------------------------------

    def configure(self, config) -> None:
        for name in ("slo_ttft_s", "slo_tpot_s"):
            value = getattr(config, name)
            if value is not None and not 0 < value < _INF:
                raise ValueError(f"{name}: must be a positive number of seconds")
        self.default_ttft_s = config.slo_ttft_s
        self.default_tpot_s = config.slo_tpot_s
        self.reject = config.slo_reject
        self.token_budget = config.max_num_batched_tokens

    def latency_targets(self) -> tuple[float | None, float | None]:
        return self.default_ttft_s, self.default_tpot_s

    def may_refuse_admission(self) -> bool:
        return self.reject

    def set_clock(self, clock: Callable[[], float]) -> None:
        self.timer.clock = clock

    def make_queue(self) -> KeyedQueue:
        # Latest start first (targets before batch work, inf), then arrival order.
        self._queue = KeyedQueue(self.latest_start)
        return self._queue

    # ---- targets and predictions ------------------------------------------

    def ttft_target(self, request: Request) -> float | None:
        return request.slo_ttft_s if request.slo_ttft_s is not None else self.default_ttft_s

    def tpot_target(self, request: Request) -> float | None:
        return request.slo_tpot_s if request.slo_tpot_s is not None else self.default_tpot_s

    def is_batch(self, request: Request) -> bool:
        return self.ttft_target(request) is None and self.tpot_target(request) is None

    def prefill_time(self, num_tokens: int) -> float:
        """Predicted time to prefill ``num_tokens`` in full-budget steps."""
        steps = max(1, math.ceil(num_tokens / self.token_budget))
        return steps * self.model.predict(min(num_tokens, self.token_budget))

    def latest_start(self, request: Request) -> float:
        """When the request must start prefilling to meet its TTFT target (inf: none)."""
        target = self.ttft_target(request)
        if target is None:
            return _INF
        remaining = request.num_tokens - request.num_computed_tokens
        return request.arrival_time + target - self.prefill_time(remaining)

    # ---- the policy interface ---------------------------------------------

    def pick_victim(self, running: list[Request]) -> Request:
        def looseness(request: Request) -> tuple[int, float, float]:
            tpot = self.tpot_target(request)
            return (1 if self.is_batch(request) else 0, _INF if tpot is None else tpot, request.arrival_time)

        # Ties (n > 1 children, equal targets and arrivals): the one admitted
        # last, as fcfs; taking the furthest along can cycle for ever.
        return max(reversed(running), key=looseness)

    def displace(self, waiting: Request, running: list[Request]) -> Request | None:
        if self.is_batch(waiting):
            return None
        for request in reversed(running):
            if self.is_batch(request):
                return request
        return None

    def account(self, scheduled: dict[str, int], requests: dict[str, Request],
                running: list[Request]) -> None:
        """Time the previous step by this call's clock; remember this step's size."""
        self.timer.step_begins()
        self.timer.step_planned(sum(scheduled.values()))

    def check_admission(self, request: Request) -> None:
        """With ``slo_reject``: refuse a request whose TTFT target is already out of reach."""
        target = self.ttft_target(request)
        if not self.reject or target is None or self._queue is None:
            return
        start = self.latest_start(request)
        ahead = sum(r.num_tokens - r.num_computed_tokens for r in self._queue
                    if self.latest_start(r) <= start)
        predicted = self.prefill_time(ahead + request.num_tokens)
        if predicted > target:
            retry_after = max(1.0, math.ceil(predicted - target))
            raise SLOUnattainable(
                f"slo_ttft_s: a first token in {target:g} s cannot be met now "
                f"(predicted {predicted:.2f} s behind the queue); retry in {retry_after:.0f} s",
                retry_after)
