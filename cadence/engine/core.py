"""``EngineCore``: the step loop. One step is three calls:

    scheduler_output = scheduler.schedule()
    runner_output    = runner.execute_model(scheduler_output)
    outputs          = scheduler.update_from_output(scheduler_output, runner_output)

The runner is whatever executes a batch (the real model runner, or the
simulator's); the engine core does not know which.
"""

from __future__ import annotations

from typing import Iterable, Protocol

from cadence.core.outputs import EngineCoreOutputs, ModelRunnerOutput
from cadence.core.request import Request, RequestStatus
from cadence.core.sched.interface import SchedulerInterface
from cadence.core.sched.output import SchedulerOutput


class Runner(Protocol):
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class EngineCore:
    """A scheduler and a runner, stepped together."""

    def __init__(self, scheduler: SchedulerInterface, runner: Runner) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.num_steps = 0

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def finish_by_stop_string(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_STOPPED)

    def has_work(self) -> bool:
        return self.scheduler.has_requests()

    def step(self) -> dict[int, EngineCoreOutputs]:
        """Schedule, execute, update: outputs per client index."""
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute_model(scheduler_output)
        self.num_steps += 1
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def shutdown(self) -> None:
        self.scheduler.shutdown()
