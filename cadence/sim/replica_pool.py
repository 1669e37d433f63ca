"""Round-robin replicas of a data-parallel simulation, each in a process of its own.

Under round robin a request's replica depends only on its place among the
arrivals (``DPRouter`` deals them in turn), never on what the replicas hold,
so each replica can run alone on its own arrivals. Only the run's timeline
(the fleet's running and waiting requests and KV use after every step) and
its pooled inter-token gaps follow the order of all replicas' events; the
parent rebuilds them by replaying the fleet's event queue over the replicas'
logs, so the result equals ``ReplicaFleet``'s to the bit:

    parent     deal the arrivals in turn (those that fit the context)
    worker k   ReplicaFleet of replica k alone, on its arrivals -> its metrics
               and a log: after each of its events, the end of the step the
               event started (if any), its queues and KV use, and for a
               step's end the gaps and service it recorded
    parent     pop events in the fleet's order (time, step ends first, then the
               order they were queued in): each takes the next entry of its
               replica's log and queues the step it started

The fleet's routing policies that read the replicas' state (least loaded,
cache aware) need every replica's state at every arrival: they do not run
apart (``ValueError``).
"""

from __future__ import annotations

import heapq
import itertools
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

from cadence.config import CacheConfig, SchedulerConfig
from cadence.sim.conversations import refuse_later_turns
from cadence.sim.cost_model import CostModel
from cadence.sim.metrics import SERVICE_WINDOW_S, MetricsRecorder
from cadence.sim.replicas import _ARRIVAL, _STEP_END, ReplicaFleet
from cadence.sim.simulator import RequestFactory, SimResult
from cadence.sim.workload import PromptMaker, RequestSpec

PARALLEL_ROUTINGS = ("round_robin",)


@dataclass
class ReplicaLog:
    """What one replica did, in the order of its own events (module docstring)."""

    rank: int
    # Per event: (the end of the step it started or None, then running, waiting
    # and KV usage after it; for a step's end also its gaps' end in ``itl``,
    # {client: tokens served} and the queues it recorded, before the next step).
    events: list[tuple] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)  # its arrivals
    first_token: list[float] = field(default_factory=list)  # per arrival, as indices
    last_token: list[float] = field(default_factory=list)
    num_output: list[int] = field(default_factory=list)
    num_cached: list[int] = field(default_factory=list)
    finished: list[bool] = field(default_factory=list)
    rejected: list[bool] = field(default_factory=list)
    itl: Any = None  # array("d")
    num_steps: int = 0
    num_preemptions: int = 0
    clock_s: float = 0.0
    busy_s: float = 0.0


class ParallelReplicaFleet:
    """``ReplicaFleet``'s results for round robin, its replicas run in ``max_workers`` processes."""

    def __init__(self, num_replicas: int, routing: str, scheduler_config: SchedulerConfig,
                 cache_config: CacheConfig, cost_model: CostModel, *,
                 prompt_maker: PromptMaker | None = None, charge_host_time: bool = False,
                 max_workers: int | None = None) -> None:
        if routing not in PARALLEL_ROUTINGS:
            raise ValueError(f"parallel_replicas: routing {routing!r} reads every replica's state "
                             f"at each arrival; only {', '.join(PARALLEL_ROUTINGS)} replicas run apart")
        self.num_replicas = num_replicas
        self.routing = routing
        self.fleet_args = (scheduler_config, cache_config, cost_model)
        self.prompt_maker = prompt_maker or PromptMaker()
        self.charge_host_time = charge_host_time
        self.max_workers = max_workers or min(num_replicas, os.cpu_count() or 1)
        self.factory = RequestFactory(self.prompt_maker, scheduler_config.max_model_len)
        self.num_routed: list[int] = [0] * num_replicas

    def run(self, specs: Sequence[RequestSpec], label: str | None = None) -> SimResult:
        refuse_later_turns(specs, "data_parallel_size")
        start = time.perf_counter()
        fits = [self.factory.fits(spec) for spec in specs]
        ranks = self._deal(fits)
        arrivals = [[i for i, rank in enumerate(ranks) if rank == k] for k in range(self.num_replicas)]
        self.num_routed = [len(indices) for indices in arrivals]
        logs = self._run_replicas(specs, arrivals)
        recorder = MetricsRecorder(specs)
        for index, fit in enumerate(fits):
            if not fit:
                recorder.on_reject(index)
        for log in logs:
            _copy_request_metrics(log, recorder)
        _replay(specs, ranks, logs, recorder)
        return SimResult(
            label=label or self.routing, recorder=recorder,
            num_steps=sum(log.num_steps for log in logs),
            num_preemptions=sum(log.num_preemptions for log in logs),
            clock_s=max(log.clock_s for log in logs),
            busy_s=sum(log.busy_s for log in logs),
            wall_s=time.perf_counter() - start)

    def requests_per_replica(self) -> list[int]:
        return list(self.num_routed)

    def _deal(self, fits: list[bool]) -> list[int | None]:
        """Each spec's replica in turn, as ``DPRouter`` deals them (None: rejected)."""
        turn = itertools.cycle(range(self.num_replicas))
        return [next(turn) if fit else None for fit in fits]

    def _run_replicas(self, specs: Sequence[RequestSpec], arrivals: list[list[int]]) -> list[ReplicaLog]:
        run = _Run(specs, self.fleet_args, self.prompt_maker, self.charge_host_time)
        ranks = range(self.num_replicas)
        if self.max_workers <= 1:
            return [run.replica(rank, indices) for rank, indices in zip(ranks, arrivals)]
        # fork where there is one: the workers inherit the run (the specs) instead
        # of unpickling it; elsewhere each worker unpickles it once.
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
        with ProcessPoolExecutor(self.max_workers, mp_context=multiprocessing.get_context(method),
                                 initializer=_set_worker_run, initargs=(run,)) as pool:
            return list(pool.map(_run_replica_in_worker, ranks, arrivals))


@dataclass
class _Run:
    """What every replica's worker needs, handed to each worker once."""

    specs: Sequence[RequestSpec]
    fleet_args: tuple  # scheduler config, cache config, cost model
    prompt_maker: PromptMaker
    charge_host_time: bool

    def replica(self, rank: int, indices: list[int]) -> ReplicaLog:
        return _run_one(rank, self.specs, indices, self.fleet_args, self.prompt_maker,
                        self.charge_host_time)


_worker_run: _Run | None = None  # in a worker process: the run it serves


def _set_worker_run(run: _Run) -> None:
    global _worker_run
    _worker_run = run


def _run_replica_in_worker(rank: int, indices: list[int]) -> ReplicaLog:
    assert _worker_run is not None, "the pool's initializer sets the run"
    return _worker_run.replica(rank, indices)


def _run_one(rank: int, specs: Sequence[RequestSpec], indices: list[int], fleet_args: tuple,
             prompt_maker: PromptMaker, charge_host_time: bool) -> ReplicaLog:
    """Replica ``rank`` alone on its arrivals, as a one-replica ``ReplicaFleet``."""
    fleet = ReplicaFleet(1, "round_robin", *fleet_args, prompt_maker=prompt_maker,
                         charge_host_time=charge_host_time)
    scheduler = fleet.replicas[0].core.scheduler
    log = ReplicaLog(rank, indices=indices)
    service = _ServiceDeltas()

    def on_event(kind: int, now: float, step_end: float | None, recorder: MetricsRecorder) -> None:
        running, waiting = scheduler.get_request_counts()
        state = (step_end, running, waiting, scheduler.kv_cache_manager.usage)
        if kind == _ARRIVAL:
            log.events.append(state)
        else:
            # The replica's queues as the step's end recorded them (before its next step).
            timeline = recorder.timeline
            recorded = (timeline.running[-1], timeline.waiting[-1], timeline.kv_usage[-1])
            log.events.append(state + (len(recorder.itl), service.of_step(recorder, now), recorded))

    result = fleet.run(specs, arrivals=indices, on_event=on_event)
    recorder = result.recorder
    for name in ("first_token", "last_token", "num_output", "num_cached", "finished", "rejected"):
        values = getattr(recorder, name)
        setattr(log, name, [values[i] for i in indices])
    log.itl = recorder.itl
    log.num_steps, log.num_preemptions = result.num_steps, result.num_preemptions
    log.clock_s, log.busy_s = result.clock_s, result.busy_s
    return log


class _ServiceDeltas:
    """The tokens a step served per client: its window now, less the window
    after the replica's previous step (service changes only at step ends)."""

    def __init__(self) -> None:
        self._key: int | None = None
        self._before: dict[int, int] = {}

    def of_step(self, recorder: MetricsRecorder, now: float) -> dict[int, int]:
        key = int(now / SERVICE_WINDOW_S)
        window = recorder.service.get(key, {})
        before = self._before if key == self._key else {}
        delta = {client: tokens - before.get(client, 0) for client, tokens in window.items()
                 if tokens != before.get(client, 0)}
        self._key, self._before = key, dict(window)
        return delta


def _copy_request_metrics(log: ReplicaLog, recorder: MetricsRecorder) -> None:
    """The replica's requests' own metrics into the fleet's recorder."""
    for name in ("first_token", "last_token", "num_output", "num_cached", "finished", "rejected"):
        values, own = getattr(recorder, name), getattr(log, name)
        for index, value in zip(log.indices, own):
            values[index] = value


def _replay(specs: Sequence[RequestSpec], ranks: list[int | None], logs: list[ReplicaLog],
            recorder: MetricsRecorder) -> None:
    """The fleet's event queue over the replicas' logs: the pooled gaps, the
    service windows and the timeline in ``ReplicaFleet``'s order."""
    # (time, kind, seq, rank) as the fleet queues them: arrival i is queued i-th.
    events = [(spec.arrival_time, _ARRIVAL, index, ranks[index]) for index, spec in enumerate(specs)
              if ranks[index] is not None]
    heapq.heapify(events)
    seq = itertools.count(len(specs))
    cursors = [iter(log.events) for log in logs]
    itl_start = [0] * len(logs)
    states = [(0, 0, 0.0)] * len(logs)  # per replica: running, waiting, KV usage
    while events:
        now, kind, _, rank = heapq.heappop(events)
        if kind == _ARRIVAL:
            step_end, *state = next(cursors[rank])
        else:
            step_end, running, waiting, usage, itl_end, served, recorded = next(cursors[rank])
            state = running, waiting, usage
            recorder.itl.extend(logs[rank].itl[itl_start[rank]:itl_end])
            itl_start[rank] = itl_end
            if served:
                window = recorder.service.setdefault(int(now / SERVICE_WINDOW_S), {})
                for client, tokens in served.items():
                    window[client] = window.get(client, 0) + tokens
        if kind != _ARRIVAL:
            states[rank] = recorded
            _record_queues(states, now, recorder)
        states[rank] = tuple(state)
        if step_end is not None:
            heapq.heappush(events, (step_end, _STEP_END, next(seq), rank))


def _record_queues(states: list[tuple], now: float, recorder: MetricsRecorder) -> None:
    """``replicas.record_queues`` from the replicas' last logged states."""
    num_running = num_waiting = 0
    usage = 0.0
    for running, waiting, kv_usage in states:
        num_running, num_waiting = num_running + running, num_waiting + waiting
        usage += kv_usage
    recorder.on_queues(now, num_running, num_waiting, usage / len(states))
