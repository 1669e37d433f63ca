"""``EngineCore``: the step loop. One step is three calls:

    scheduler_output = scheduler.schedule()
    runner_output    = runner.execute_model(scheduler_output)
    outputs          = scheduler.update_from_output(scheduler_output, runner_output)

The runner is whatever executes a batch (the real model runner, or the
simulator's); the engine core does not know which.

With async scheduling the runner executes in a worker thread and the core
keeps up to two steps in flight: it schedules step N+1 while step N runs
(the scheduler counts N's tokens as output placeholders), then waits for N
and absorbs it. Steps execute in order on the one worker, so step N+1 reads
the tokens N sampled from the runner's own state, and blocks that a finish
or a preemption frees while N runs are only reused by a later step.

After every step the core takes the scheduler's KV-cache events and hands
them to the event publisher as one batch, or drops them when it has none:
events never pile up in the scheduler.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Protocol, TypeVar, runtime_checkable

from cadence.core.outputs import EngineCoreOutputs, ModelRunnerOutput
from cadence.core.request import LoRARequest, Request, RequestStatus
from cadence.core.sched.interface import SchedulerInterface
from cadence.core.sched.output import SchedulerOutput
from cadence.core.sched.scheduler import Scheduler
from cadence.engine.kv_events import KVEventBatch


T = TypeVar("T")
log = logging.getLogger(__name__)

# Steps scheduled ahead of the one absorbed: the step running and the next one.
MAX_STEPS_IN_FLIGHT = 2
# Runner failures in a row the core takes back before it gives up: a request
# that fails steps is found and ended by the second (its suspects run one at
# a time, the others succeed between); a fault of the engine fails them all.
MAX_FAILED_STEPS_IN_A_ROW = 3


@runtime_checkable
class Runner(Protocol):
    """Everything the engine calls on whatever executes a batch (the model
    runner, the tensor-parallel driver, the simulator's runner, the tests'
    fake runner). ``cadence.core.runner_api.RunnerBase`` has the defaults."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def add_lora(self, lora_request: LoRARequest) -> bool: ...

    def remove_lora(self, lora_int_id: int) -> bool: ...

    def list_loras(self) -> list[int]: ...

    def shutdown(self) -> None: ...


class EventPublisher(Protocol):
    def publish(self, batch: KVEventBatch) -> Any: ...

    def close(self) -> None: ...


class EngineCore:
    """A scheduler and a runner, stepped together."""

    def __init__(
        self,
        scheduler: SchedulerInterface,
        runner: Runner,
        *,
        event_publisher: EventPublisher | None = None,
        async_scheduling: bool = False,
        executor: Executor | None = None,
    ) -> None:
        """``async_scheduling``: overlap scheduling with execution (the
        scheduler must be configured for it too, to keep placeholders).
        ``executor``: where steps execute then (default: one worker thread;
        the simulator passes one that runs them at once)."""
        self.scheduler = scheduler
        self.runner = runner
        self.event_publisher = event_publisher
        self.num_steps = 0
        # Steps in a row that computed nothing (e.g. only KV transfers to wait
        # for): the engine process paces them instead of spinning.
        self.num_idle_steps = 0
        self.async_scheduling = async_scheduling
        self._executor = executor
        if async_scheduling and executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="cadence-runner")
        # Scheduled steps not absorbed yet, oldest first (async scheduling only).
        self.in_flight: deque[tuple[SchedulerOutput, Future[ModelRunnerOutput]]] = deque()
        # (lora_int_id, lora_path) of the adapters the runner accepted.
        self._checked_loras: set[tuple[int, str]] = set()
        self._request_errors: dict[str, str] = {}  # see take_request_errors
        self.num_failed_steps = 0  # steps the runner raised on, taken back
        self._runner_faults: set[str] = set()  # of _request_errors: ended by a failed step
        self._failed_in_a_row = 0
        # Cache events are the Scheduler's, outside the scheduler contract; so is
        # taking failed steps back (another scheduler's core stops on one).
        self._take_kv_events = scheduler.take_kv_events if isinstance(scheduler, Scheduler) else None
        self._take_back_steps = scheduler.take_back_steps if isinstance(scheduler, Scheduler) else None

    def add_request(self, request: Request) -> None:
        """Queue a request; its LoRA adapter is loaded first (ValueError: a bad one,
        or kv_transfer_params that no KV connector here reads).

        An adapter loaded once is not loaded again here: the runner loads it
        anew itself if it unloaded it meanwhile.
        """
        connector = self.scheduler.get_kv_connector()
        if request.kv_transfer_params is not None and (
                connector is None or not connector.reads_kv_transfer_params):
            raise ValueError("kv_transfer_params: this engine has no KV connector that reads them")
        lora = request.lora_request
        if lora is not None and (lora.lora_int_id, lora.lora_path) not in self._checked_loras:
            self.add_lora(lora)
        self.scheduler.add_request(request)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter in the runner (once); True if loaded now."""
        loaded = self._between_steps(self.runner.add_lora, lora_request)
        self._checked_loras.add((lora_request.lora_int_id, lora_request.lora_path))
        return loaded

    def remove_lora(self, lora_int_id: int) -> bool:
        self._checked_loras = {key for key in self._checked_loras if key[0] != lora_int_id}
        return self._between_steps(self.runner.remove_lora, lora_int_id)

    def list_loras(self) -> list[int]:
        return self._between_steps(self.runner.list_loras)

    def _between_steps(self, fn: Callable[..., T], *args: Any) -> T:
        """Call the runner where no step is executing: with async scheduling, on
        its worker after the steps in flight (which read what ``fn`` changes)."""
        if self._executor is None:
            return fn(*args)
        return self._executor.submit(fn, *args).result()

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def finish_by_stop_string(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_STOPPED)

    def has_work(self) -> bool:
        return bool(self.in_flight) or self.scheduler.has_requests()

    def step(self) -> dict[int, EngineCoreOutputs]:
        """Schedule, execute, update: outputs per client index.

        With async scheduling: schedule until two steps are in flight (or a
        step has nothing to compute), then absorb the oldest.
        """
        if self.async_scheduling:
            return self._step_overlapped()
        scheduler_output = self.scheduler.schedule()
        try:
            runner_output = self.runner.execute_model(scheduler_output)
        except Exception as error:
            return self._take_back([scheduler_output], error)
        return self._absorb(scheduler_output, runner_output)

    def _step_overlapped(self) -> dict[int, EngineCoreOutputs]:
        in_flight, executor = self.in_flight, self._executor
        assert executor is not None  # (made with async scheduling)
        while len(in_flight) < MAX_STEPS_IN_FLIGHT and self.scheduler.has_requests():
            scheduler_output = self.scheduler.schedule()
            in_flight.append((scheduler_output, executor.submit(self.runner.execute_model, scheduler_output)))
            if not scheduler_output.total_num_scheduled_tokens:
                break  # the next schedule would find the same: wait for results first
        if not in_flight:
            return {}
        scheduler_output, future = in_flight.popleft()
        try:
            runner_output = future.result()
        except Exception as error:
            failed = [scheduler_output]
            while in_flight:  # it read what the failed step left: taken back too
                later, later_future = in_flight.popleft()
                try:
                    later_future.result()
                except Exception:
                    pass
                failed.append(later)
            return self._take_back(failed, error)
        return self._absorb(scheduler_output, runner_output)

    def _take_back(self, failed: list[SchedulerOutput], error: Exception) -> dict[int, EngineCoreOutputs]:
        """The runner raised on ``failed``: the scheduler takes the steps back and
        ends the request found to fail them (``core/sched/step_faults.py``).
        Re-raised where it cannot, or after MAX_FAILED_STEPS_IN_A_ROW."""
        self.num_failed_steps += 1
        self._failed_in_a_row += 1
        if self._take_back_steps is None or self._failed_in_a_row > MAX_FAILED_STEPS_IN_A_ROW:
            raise error
        culprits = self._take_back_steps(failed)
        if culprits is None:
            raise error
        log.error("the model runner failed on a step of %d requests; taken back%s",
                  len({r for output in failed for r in output.num_scheduled_tokens}),
                  f", ending {', '.join(culprits)}" if culprits else ", its requests run again one suspect at a time",
                  exc_info=error)
        if culprits:
            self.scheduler.finish_requests(culprits, RequestStatus.FINISHED_ABORTED)
            why = f"the model runner failed on this request: {type(error).__name__}: {error}"
            self._request_errors.update(dict.fromkeys(culprits, why))
            self._runner_faults.update(culprits)
        self._publish_kv_events()
        return {}

    def _absorb(self, scheduler_output: SchedulerOutput,
                runner_output: ModelRunnerOutput) -> dict[int, EngineCoreOutputs]:
        """Take a step's results; requests the runner could not serve end first,
        their reasons kept for ``take_request_errors``."""
        self._count_step(scheduler_output)
        self._failed_in_a_row = 0
        if runner_output.failed_requests:
            self.scheduler.finish_requests(list(runner_output.failed_requests),
                                           RequestStatus.FINISHED_ABORTED)
            self._request_errors.update(runner_output.failed_requests)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self._publish_kv_events()
        return outputs

    def _count_step(self, scheduler_output: SchedulerOutput) -> None:
        self.num_steps += 1
        idle = not scheduler_output.total_num_scheduled_tokens
        self.num_idle_steps = self.num_idle_steps + 1 if idle else 0

    def take_request_errors(self) -> dict[str, str]:
        """Requests ended because the runner could not serve them: id -> why."""
        errors, self._request_errors = self._request_errors, {}
        return errors

    def take_runner_faults(self) -> set[str]:
        """Of the ids ``take_request_errors`` gave: those a failed step ended (the
        engine's fault, not the request's input)."""
        faults, self._runner_faults = self._runner_faults, set()
        return faults

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (refused while blocks are owned); the
        AllBlocksCleared event is published now, not at the next step."""
        ok = self.scheduler.reset_prefix_cache()
        self._publish_kv_events()
        return ok

    def shutdown(self) -> None:
        try:
            if self._executor is not None:
                for _, future in self.in_flight:
                    future.cancel()
                self._executor.shutdown(wait=True)
            self.scheduler.shutdown()
            self.runner.shutdown()
        finally:
            if self.event_publisher is not None:
                self._publish_kv_events()
                self.event_publisher.close()

    def _publish_kv_events(self) -> None:
        """Take the scheduler's cache events: one batch to the publisher, or
        dropped without one (so an offline engine's memory stays bounded)."""
        if self._take_kv_events is None:
            return
        events = self._take_kv_events()
        if events and self.event_publisher is not None:
            self.event_publisher.publish(KVEventBatch(ts=time.time(), events=events))
