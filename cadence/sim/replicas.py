"""Data-parallel serving on the virtual clock: N engine cores behind one router.

Each replica is a whole ``Simulator`` (the real ``Scheduler`` and
``EngineCore`` on a ``SimRunner``, its own ``VirtualClock``); the router is
the front end's own (``cadence.engine.dp_router.DPRouter``: round robin,
least loaded, cache aware). One event queue orders what happens on the
shared virtual time:

    arrival at t      the router picks replica k; k gets the request (and
                      starts a step at t if it was idle)
    k starts a step   core.step() runs at once; its cost says when it ends
    the step ends     its outputs are recorded; finished requests leave the
                      router's load; the step's KV-cache events reach the router;
                      k starts its next step if it has work

A step's effects reach the router when the step ends, as the front end sees
a replica's outputs and cache events only then. At equal times a step's end
comes before an arrival. A request arriving while its replica steps joins
the next step, as in a real engine loop.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import replace
from typing import Any, Callable, Sequence

from cadence.config import CacheConfig, SchedulerConfig
from cadence.core.kv_cache.events import KVCacheEvent
from cadence.core.sched.policy import AdmissionRefused
from cadence.engine.dp_router import DPRouter
from cadence.engine.kv_events import KVEventBatch
from cadence.sim.conversations import refuse_later_turns
from cadence.sim.cost_model import CostModel
from cadence.sim.metrics import MetricsRecorder
from cadence.sim.simulator import RequestFactory, SimResult, Simulator, SimulationStalled, _gc_paused
from cadence.sim.workload import PromptMaker, RequestSpec

_STEP_END, _ARRIVAL = 0, 1  # at equal times a step's end comes first


class CollectedEvents:
    """An ``EventPublisher`` that keeps a replica's cache events until its step ends."""

    def __init__(self) -> None:
        self.events: list[KVCacheEvent] = []

    def publish(self, batch: KVEventBatch) -> None:
        self.events.extend(batch.events)

    def take(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events

    def close(self) -> None:
        pass


class Replica:
    """One engine core of the fleet and whether a step of it is under way."""

    def __init__(self, simulator: Simulator, publisher: CollectedEvents | None) -> None:
        self.simulator = simulator
        self.core = simulator.core
        self.clock = simulator.clock
        self.publisher = publisher
        self.core.event_publisher = publisher
        self.stepping = False
        self.stalled = False  # its last step did nothing: wait for an arrival
        self.num_steps = 0

    def can_step(self) -> bool:
        return not self.stepping and not self.stalled and self.core.has_work()

    def step(self, now: float) -> tuple[float, Any, list[KVCacheEvent]]:
        """Run one step starting at ``now``: (its end, its outputs, its cache events)."""
        clock = self.clock
        clock.wait_until(now)
        clock.before_step()
        outputs = self.core.step()
        end = clock.after_step()
        self.num_steps += 1
        self.stepping = True
        self.stalled = not clock.check_progress(self.core)
        return end, outputs, self.publisher.take() if self.publisher is not None else []


def record_queues(replicas: Sequence[Replica], now: float, recorder: MetricsRecorder) -> None:
    """The replicas' running and waiting requests, and their mean KV usage."""
    num_running = num_waiting = 0
    usage = 0.0
    for replica in replicas:
        running, waiting = replica.core.scheduler.get_request_counts()
        num_running, num_waiting = num_running + running, num_waiting + waiting
        usage += replica.core.scheduler.kv_cache_manager.usage
    recorder.on_queues(now, num_running, num_waiting, usage / len(replicas))


class ReplicaFleet:
    """``num_replicas`` simulated engine cores behind one ``DPRouter`` (module docstring)."""

    def __init__(self, num_replicas: int, routing: str, scheduler_config: SchedulerConfig,
                 cache_config: CacheConfig, cost_model: CostModel, *,
                 load_margin_tokens: int = 8192, prompt_maker: PromptMaker | None = None,
                 charge_host_time: bool = False) -> None:
        cache_aware = routing == "cache_aware"
        if cache_aware:  # the router learns what each replica caches from its events
            cache_config = replace(cache_config, enable_kv_cache_events=True)
        self.replicas = [
            Replica(Simulator(scheduler_config, cache_config, cost_model,
                              charge_host_time=charge_host_time),
                    CollectedEvents() if cache_aware else None)
            for _ in range(num_replicas)]
        self.router = DPRouter(num_replicas, routing, block_size=cache_config.block_size,
                               load_margin_tokens=load_margin_tokens)
        self.routing = routing
        self.factory = RequestFactory(prompt_maker or PromptMaker(), scheduler_config.max_model_len)
        self._events: list[tuple] = []  # (time, kind, seq, payload), a heap
        self._seq = itertools.count()
        self._step_end: float | None = None  # the end of the step the current event started

    def run(self, specs: Sequence[RequestSpec], label: str | None = None, *,
            arrivals: Sequence[int] | None = None,
            on_event: Callable[[int, float, float | None, MetricsRecorder], None] | None = None,
            ) -> SimResult:
        """Simulate ``specs`` on the fleet. ``arrivals``: the indices of the specs
        that arrive (all by default); ``on_event(kind, time, end, recorder)``:
        called after each event with the end of the step it started (or None),
        for ``cadence.sim.replica_pool``, which runs replicas apart."""
        refuse_later_turns(specs, "data_parallel_size")
        recorder = MetricsRecorder(specs)
        start = time.perf_counter()
        for index in range(len(specs)) if arrivals is None else arrivals:
            self._push(specs[index].arrival_time, _ARRIVAL, index)
        now = 0.0
        with _gc_paused():
            while self._events:
                now, kind, _, payload = heapq.heappop(self._events)
                self._step_end = None
                if kind == _ARRIVAL:
                    self._arrive(now, payload, specs, recorder)
                else:
                    self._end_step(now, *payload, recorder)
                if on_event is not None:
                    on_event(kind, now, self._step_end, recorder)
        self._check_all_done()
        simulators = [replica.simulator for replica in self.replicas]
        return SimResult(
            label=label or self.routing, recorder=recorder,
            num_steps=sum(replica.num_steps for replica in self.replicas),
            num_preemptions=sum(s.scheduler.num_preemptions_total for s in simulators),
            clock_s=max(s.clock.now for s in simulators),
            busy_s=sum(s.clock.busy_seconds for s in simulators),
            wall_s=time.perf_counter() - start)

    def requests_per_replica(self) -> list[int]:
        return list(self.router.num_routed_total)

    # ------------------------------------------------------------ events

    def _push(self, when: float, kind: int, payload: Any) -> None:
        heapq.heappush(self._events, (when, kind, next(self._seq), payload))

    def _arrive(self, now: float, index: int, specs: Sequence[RequestSpec],
                recorder: MetricsRecorder) -> None:
        spec = specs[index]
        if not self.factory.fits(spec):
            recorder.on_reject(index)
            return
        request = self.factory.make(index, spec)
        rank = self.router.route(request.request_id, request.prompt_token_ids, spec.output_tokens)
        replica = self.replicas[rank]
        try:
            replica.core.add_request(request)
        except AdmissionRefused:  # the policy refused it at this load (e.g. slo with slo_reject)
            self.router.release(request.request_id)
            recorder.on_reject(index)
            return
        recorder.on_arrival(index, request.request_id, spec.arrival_time)
        replica.stalled = False
        self._start_step(rank, now)

    def _start_step(self, rank: int, now: float) -> None:
        replica = self.replicas[rank]
        if replica.can_step():
            end, outputs, events = replica.step(now)
            self._push(end, _STEP_END, (rank, outputs, events))
            self._step_end = end

    def _end_step(self, now: float, rank: int, outputs: Any, events: list[KVCacheEvent],
                  recorder: MetricsRecorder) -> None:
        replica = self.replicas[rank]
        replica.stepping = False
        if outputs:
            recorder.on_step(now, outputs)
            for engine_outputs in outputs.values():
                for out in engine_outputs.outputs:
                    if out.finish_reason is not None:
                        self.router.release(out.request_id)
        if events:
            self.router.absorb_kv_events(rank, events)
        record_queues(self.replicas, now, recorder)
        self._start_step(rank, now)

    def _check_all_done(self) -> None:
        stuck = sum(r.core.scheduler.get_num_unfinished_requests() for r in self.replicas)
        if stuck:
            raise SimulationStalled(f"{stuck} requests can never be scheduled "
                                    "(a prompt needs more KV blocks than a replica's cache has?)")


def compare_routing(specs: Sequence[RequestSpec], routings: Sequence[str], num_replicas: int,
                    scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                    cost_model: CostModel, *, load_margin_tokens: int = 8192,
                    charge_host_time: bool = False, parallel_replicas: bool = False,
                    ) -> dict[str, tuple[SimResult, list[int]]]:
    """The same specs (the same prompts) on ``num_replicas`` replicas under each
    routing policy: per policy, the run and the requests each replica got.
    ``parallel_replicas``: each replica in a process of its own, the same
    results (round robin only, ``cadence.sim.replica_pool``)."""
    from cadence.sim.replica_pool import ParallelReplicaFleet

    results = {}
    for routing in routings:
        if parallel_replicas:
            fleet: ReplicaFleet | ParallelReplicaFleet = ParallelReplicaFleet(
                num_replicas, routing, scheduler_config, cache_config, cost_model,
                charge_host_time=charge_host_time)
        else:
            fleet = ReplicaFleet(num_replicas, routing, scheduler_config, cache_config, cost_model,
                                 load_margin_tokens=load_margin_tokens, charge_host_time=charge_host_time)
        results[routing] = (fleet.run(specs, label=routing), fleet.requests_per_replica())
    return results
