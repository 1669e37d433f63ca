"""``EngineCore``: the step loop. One step is three calls:

    scheduler_output = scheduler.schedule()
    runner_output    = runner.execute_model(scheduler_output)
    outputs          = scheduler.update_from_output(scheduler_output, runner_output)

The runner is whatever executes a batch (the real model runner, or the
simulator's); the engine core does not know which.

After every step the core takes the scheduler's KV-cache events and hands
them to the event publisher as one batch, or drops them when it has none:
events never pile up in the scheduler.
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Protocol

from cadence.core.outputs import EngineCoreOutputs, ModelRunnerOutput
from cadence.core.request import LoRARequest, Request, RequestStatus
from cadence.core.sched.interface import SchedulerInterface
from cadence.core.sched.output import SchedulerOutput
from cadence.engine.kv_events import KVEventBatch


class Runner(Protocol):
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


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
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.event_publisher = event_publisher
        self.num_steps = 0
        # Cache events are the Scheduler's, outside the scheduler contract.
        self._take_kv_events = getattr(scheduler, "take_kv_events", None)

    def add_request(self, request: Request) -> None:
        """Queue a request; its LoRA adapter is loaded first (ValueError: a bad one)."""
        if request.lora_request is not None:
            self.add_lora(request.lora_request)
        self.scheduler.add_request(request)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter in the runner (once); True if loaded now."""
        add_lora = getattr(self.runner, "add_lora", None)
        if add_lora is None:
            raise ValueError("lora_request: this engine's runner serves no LoRA adapters")
        return add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        remove_lora = getattr(self.runner, "remove_lora", None)
        return remove_lora is not None and remove_lora(lora_int_id)

    def list_loras(self) -> list[int]:
        list_loras = getattr(self.runner, "list_loras", None)
        return list_loras() if list_loras is not None else []

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
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self._publish_kv_events()
        return outputs

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (refused while blocks are owned); the
        AllBlocksCleared event is published now, not at the next step."""
        ok = self.scheduler.reset_prefix_cache()
        self._publish_kv_events()
        return ok

    def shutdown(self) -> None:
        try:
            self.scheduler.shutdown()
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
