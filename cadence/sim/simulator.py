"""The engine loop on a virtual clock, and the same loop on the wall clock.

The simulator runs the real ``Scheduler`` inside the real ``EngineCore``;
only the runner is simulated (``SimRunner``). One loop drives both a
simulation and a real-time replay on the real model (on the wall clock, or
on this process's CPU clock), so both measure alike:

    while requests are pending or the engine has work:
        add every request whose arrival time has come
        if the engine is idle: wait for (jump to) the next arrival
        outputs = core.step()               # schedule -> execute -> update
        now = clock after the step          # virtual: += the step's cost
        record outputs at `now`             # tokens exist when the step ends
        a finished turn's next turn is now pending (at now + think time)

A request arriving while a step runs is added after that step, as in a
real engine loop; its TTFT counts from its arrival time all the same.
Multi-turn conversations: ``cadence.sim.conversations``.
"""

from __future__ import annotations

import gc
import heapq
import time
from concurrent.futures import Executor, Future
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

from cadence.config import POLICY_OPTIONS, CacheConfig, SchedulerConfig
from cadence.core.compiled import mypyc_attr
from cadence.core.sched.policy import AdmissionRefused
from cadence.core.request import Request
from cadence.core.sched.kv_connector import KVConnectorBase
from cadence.core.sched.scheduler import Scheduler
from cadence.engine.core import EngineCore
from cadence.sampling_params import SamplingParams
from cadence.sim.conversations import Conversations
from cadence.sim.cost_model import CostModel, StepShape
from cadence.sim.kv_tier import SimKVTier, TierCopies, make_tier_connector
from cadence.sim.metrics import SLO, MetricsRecorder, summarize
from cadence.sim.runner import ExecutedStep, SimRunner, StepTransfers
from cadence.sim.workload import PromptMaker, RequestSpec


@mypyc_attr(native_class=False)  # (the compiled build subclasses only Exception natively)
class SimulationStalled(RuntimeError):
    """Requests are left that the scheduler will never schedule (e.g. too few KV blocks)."""


class RequestFactory:
    """Core requests from specs: exactly ``output_tokens`` tokens each (EOS ignored)."""

    def __init__(self, prompt_maker: PromptMaker, max_model_len: int, eos_token_id: int | None = None) -> None:
        self.prompt_maker = prompt_maker
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self._params: dict[int, SamplingParams] = {}  # one per output length

    def fits(self, spec: RequestSpec) -> bool:
        return spec.prompt_tokens < self.max_model_len

    def make(self, index: int, spec: RequestSpec, *, prompt_token_ids: list[int] | None = None,
             params: SamplingParams | None = None, arrival_time: float | None = None) -> Request:
        """The request of ``spec``; ``prompt_token_ids`` and ``params`` given: those
        instead of its own (a P/D fleet's two halves of one request; a later
        turn's history); ``arrival_time``: when it came, if not at its spec's
        (a later turn's)."""
        if params is None:
            params = self._params.get(spec.output_tokens)
            if params is None:
                params = SamplingParams(max_tokens=spec.output_tokens, ignore_eos=True, temperature=0.0)
                self._params[spec.output_tokens] = params
        if prompt_token_ids is None:
            prompt_token_ids = self.prompt_maker.make(index, spec)
        return Request(
            str(index), prompt_token_ids, params,
            eos_token_id=self.eos_token_id,
            arrival_time=spec.arrival_time if arrival_time is None else arrival_time,
            priority=spec.priority, client_index=spec.client, max_model_len=self.max_model_len,
            tenant=f"client{spec.client}", slo_ttft_s=spec.slo_ttft_s, slo_tpot_s=spec.slo_tpot_s,
        )


# ---------------------------------------------------------------- clocks


_NO_STEP = ExecutedStep(0.0, StepShape(0, 0, 0, 0), 0)  # nothing executed


class VirtualClock:
    """Advances by the simulated runner's cost of each step.

    With ``charge_host_time`` it also charges the host's share of a step: the
    real seconds the engine loop spent in the step (scheduling, absorbing,
    the simulated runner's bookkeeping), measured here as the host CPU's
    work. A synchronous step costs host + model; with async scheduling the
    host works while the model runs, so a step costs the slower of the two.
    """

    def __init__(self, runner: SimRunner, *, charge_host_time: bool = False,
                 overlapped: bool = False, host_timer: Callable[[], float] = time.perf_counter) -> None:
        self.runner = runner
        self.charge_host_time = charge_host_time
        self.host_timer = host_timer
        self.overlapped = overlapped
        self.now = 0.0
        self.busy_seconds = 0.0
        self.host_seconds = 0.0
        self._step_start = 0.0
        self.last_step: ExecutedStep = _NO_STEP

    def read(self) -> float:
        return self.now

    def before_step(self) -> None:
        if self.charge_host_time:
            self._step_start = self.host_timer()

    def after_step(self) -> float:
        executed = self.runner.executed
        self.last_step = step = executed.popleft() if executed else _NO_STEP
        cost = step.seconds
        if self.charge_host_time:
            host = self.host_timer() - self._step_start
            self.host_seconds += host
            cost = max(cost, host) if self.overlapped else cost + host
        self.busy_seconds += cost
        self.now += cost
        return self.now

    def wait_until(self, t: float) -> None:
        self.now = max(self.now, t)

    def check_progress(self, core: EngineCore) -> bool:
        """False when a step did nothing and nothing will change without an arrival.

        With async scheduling a step scheduled while another ran may be empty
        (its requests waited for that step's tokens); it is the steps still in
        flight with tokens that promise progress. Empty ones do not: once nothing
        can run, the loop keeps one empty step in flight behind another."""
        step = self.last_step
        return bool(step.shape.num_tokens or step.num_preempted
                    or any(output.total_num_scheduled_tokens for output, _ in core.in_flight)
                    or not core.scheduler.has_unfinished_requests())


class WallClock:
    """Real seconds since the start; idle time is slept through."""

    def __init__(self) -> None:
        self._start = time.perf_counter()

    def before_step(self) -> None:
        pass

    def read(self) -> float:
        return time.perf_counter() - self._start

    def after_step(self) -> float:
        return self.read()

    def wait_until(self, t: float) -> None:
        delay = t - self.read()
        if delay > 0:
            time.sleep(delay)

    def check_progress(self, core: EngineCore) -> bool:
        return True


class CpuClock:
    """This process's CPU seconds, plus the idle gaps jumped over.

    On a shared machine the wall clock also measures other people's jobs;
    CPU time is what the steps would take on a core of their own (with one
    torch thread; memory-bandwidth contention still shows). Idle time jumps
    to the next arrival, as in the simulator, instead of sleeping.
    """

    def __init__(self) -> None:
        self._start = time.process_time()
        self._idle = 0.0

    def before_step(self) -> None:
        pass

    def read(self) -> float:
        return time.process_time() - self._start + self._idle

    def after_step(self) -> float:
        return self.read()

    def wait_until(self, t: float) -> None:
        self._idle += max(0.0, t - self.read())

    def check_progress(self, core: EngineCore) -> bool:
        return True


# ---------------------------------------------------------------- the loop


def drive(
    core: EngineCore,
    specs: Sequence[RequestSpec],
    factory: RequestFactory,
    clock: VirtualClock | WallClock | CpuClock,
    recorder: MetricsRecorder,
    on_step: Callable[[], None] | None = None,
) -> int:
    """Replay ``specs`` through ``core`` on ``clock``; returns the number of steps."""
    scheduler = core.scheduler
    kv_manager = getattr(scheduler, "kv_cache_manager", None)
    conversations = Conversations(specs)
    pending = conversations.first_arrivals()  # a heap of (arrival time, index)
    heapq.heapify(pending)
    num_steps = 0
    while pending or core.has_work():
        now = clock.read()
        while pending and pending[0][0] <= now:
            arrival, index = heapq.heappop(pending)
            _inject(core, specs, index, arrival, factory, recorder, conversations)
        if not core.has_work():
            if pending:
                clock.wait_until(pending[0][0])
            continue
        clock.before_step()
        outputs = core.step()
        num_steps += 1
        now = clock.after_step()
        if outputs:
            recorder.on_step(now, outputs)
            if conversations:
                for next_turn in conversations.released(now, outputs):
                    heapq.heappush(pending, next_turn)
        num_running, num_waiting = scheduler.get_request_counts()
        recorder.on_queues(now, num_running, num_waiting, kv_manager.usage if kv_manager else 0.0)
        if on_step is not None:
            on_step()
        if not clock.check_progress(core):
            if not pending:
                raise SimulationStalled(
                    f"{scheduler.get_num_unfinished_requests()} requests can never be scheduled "
                    "(a prompt needs more KV blocks than the cache has?)"
                )
            clock.wait_until(pending[0][0])
    return num_steps


def _inject(core, specs, index, arrival, factory, recorder, conversations) -> None:
    spec = specs[index]
    request = None
    if factory.fits(spec):
        prompt = conversations.prompt_token_ids(index, factory.prompt_maker)
        request = factory.make(index, spec, prompt_token_ids=prompt, arrival_time=arrival)
        try:
            core.add_request(request)
        except AdmissionRefused:  # the policy refused it at this load (e.g. slo with slo_reject)
            request = None
    if request is None:
        for refused in (index, *conversations.refused(index)):
            recorder.on_reject(refused)
        return
    conversations.on_added(index, request)
    recorder.on_arrival(index, request.request_id, arrival)


# ---------------------------------------------------------------- simulation


@mypyc_attr(allow_interpreted_subclasses=True)  # (disaggregation's PDResult)
@dataclass
class SimResult:
    """One simulated run: the metrics recorder and the engine's counters."""

    label: str
    recorder: MetricsRecorder
    num_steps: int
    num_preemptions: int
    clock_s: float
    busy_s: float
    wall_s: float

    def summary(self, slo: SLO = SLO(), client_weights: dict[int, float] | None = None) -> dict[str, Any]:
        result = summarize(self.recorder, slo, self.num_preemptions, client_weights)
        result.update(
            label=self.label, num_steps=self.num_steps, clock_s=self.clock_s,
            busy_s=self.busy_s, sim_wall_s=self.wall_s,
        )
        return result


@contextmanager
def _gc_paused():
    """No cyclic GC during a run: the loop allocates millions of short-lived,
    acyclic objects, and each full collection walks every live request."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class ImmediateExecutor(Executor):
    """Runs each submitted call at once, in the caller's thread."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as err:  # the engine loop raises it from result()
            future.set_exception(err)
        return future


class Simulator:
    """A real scheduler and engine core on a simulated runner and a virtual clock."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        cost_model: CostModel,
        *,
        prompt_maker: PromptMaker | None = None,
        charge_host_time: bool = False,
        kv_tier: SimKVTier | None = None,
        kv_connector: Callable[[CacheConfig], tuple[KVConnectorBase, StepTransfers]] | None = None,
    ) -> None:
        """``charge_host_time``: charge the engine loop's measured seconds per
        step on the virtual clock too (see ``VirtualClock``). ``kv_tier``: a
        host-memory KV tier (and swap preemption), its copies charged at the
        link's bandwidth (see ``cadence.sim.kv_tier``). ``kv_connector``: given
        the sized cache config, another scheduler-side connector and what its
        step plans cost on the runner (a P/D fleet's, ``cadence.sim.disaggregation``)."""
        if kv_tier is not None and kv_connector is not None:
            raise ValueError("kv_offload_size: the host tier and another KV connector cannot be combined")
        # The cache's width and the engine's KV cache groups (the tier, P/D and KV cache
        # events follow each group's blocks): a model that cannot price them keeps the model's dtype.
        groups = cache_config.kv_cache_groups
        if hasattr(cost_model, "with_kv_cache"):
            cost_model = cost_model.with_kv_cache(cache_config.kv_cache_dtype, groups)
        elif cache_config.kv_cache_dtype != "auto":
            raise ValueError("kv_cache_dtype: this cost model keeps the KV cache in the "
                             "model's dtype; size a cache of another width with num_gpu_blocks")
        layout = cost_model.kv_cache_layout() if hasattr(cost_model, "kv_cache_layout") else None
        num_blocks = cache_config.num_gpu_blocks
        if num_blocks is None:
            if cache_config.kv_cache_memory is not None:
                raise ValueError("kv_cache_memory: the simulator sizes the cache in blocks; give num_gpu_blocks")
            num_blocks = cost_model.num_kv_blocks(cache_config.block_size)
            if num_blocks is None:
                raise ValueError("num_gpu_blocks: the cost model does not size the KV cache; give it")
            cache_config = replace(cache_config, num_gpu_blocks=num_blocks)
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        # The policy reads the virtual clock (arrival times are on it).
        connector: KVConnectorBase | None = None
        transfers: StepTransfers | None = None
        if kv_tier is not None:
            connector = make_tier_connector(kv_tier, cost_model, cache_config.block_size, num_blocks)
            transfers = TierCopies(connector.context.bytes_per_block, kv_tier.bytes_per_second)
        elif kv_connector is not None:
            connector, transfers = kv_connector(cache_config)
        self.connector = connector
        self.scheduler = Scheduler(scheduler_config, cache_config, kv_connector=connector,
                                   clock=lambda: self.clock.now, kv_cache_layout=layout)
        self.runner = SimRunner(cost_model, transfers)
        overlapped = scheduler_config.async_scheduling
        # Steps execute at once on submission: the clock, not a thread, overlaps them.
        self.core = EngineCore(self.scheduler, self.runner, async_scheduling=overlapped,
                               executor=ImmediateExecutor() if overlapped else None)
        self.clock = VirtualClock(self.runner, charge_host_time=charge_host_time, overlapped=overlapped)
        self.factory = RequestFactory(prompt_maker or PromptMaker(), scheduler_config.max_model_len)

    def run(self, specs: Sequence[RequestSpec], label: str | None = None) -> SimResult:
        recorder = MetricsRecorder(specs)
        start = time.perf_counter()
        with _gc_paused():
            num_steps = drive(self.core, specs, self.factory, self.clock, recorder)
        return SimResult(
            label=label or self.scheduler_config.policy,
            recorder=recorder,
            num_steps=num_steps,
            num_preemptions=self.scheduler.num_preemptions_total,
            clock_s=self.clock.now,
            busy_s=self.clock.busy_seconds,
            wall_s=time.perf_counter() - start,
        )


def compare_policies(
    specs: Sequence[RequestSpec],
    policies: Sequence[str],
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    cost_model: CostModel,
    *,
    prompt_maker_factory: Callable[[], PromptMaker] = PromptMaker,
    policy_options: Mapping[str, Mapping[str, Any]] | None = None,
    charge_host_time: bool = False,
    kv_tier: SimKVTier | None = None,
) -> dict[str, SimResult]:
    """The same specs (and so the same prompts) simulated under each policy.

    ``policy_options``: options of one policy only (fair's client weights,
    slo's targets), given to that policy's run; every other run has none.
    """
    results = {}
    defaults = SchedulerConfig()
    for policy in policies:
        cleared = {name: getattr(defaults, name) for names in POLICY_OPTIONS.values() for name in names}
        own = dict((policy_options or {}).get(policy, {}))
        config = replace(scheduler_config, policy=policy, **{**cleared, **own})
        simulator = Simulator(config, cache_config, cost_model, prompt_maker=prompt_maker_factory(),
                              charge_host_time=charge_host_time, kv_tier=kv_tier)
        results[policy] = simulator.run(specs, label=policy)
    return results
