"""What the engine calls on whatever executes a batch, with the defaults a
runner that serves no LoRA adapters and holds nothing to release gets.

``cadence.engine.core.Runner`` is the protocol; this base class lets the
model runner, the tensor-parallel driver, the simulator's runner and the
tests' fake runner satisfy all of it while writing only what they do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cadence.core.outputs import ModelRunnerOutput
    from cadence.core.request import LoRARequest
    from cadence.core.sched.output import SchedulerOutput


class RunnerBase:
    def execute_model(self, scheduler_output: "SchedulerOutput") -> "ModelRunnerOutput":
        """Run one step: one sampled-token list per scheduled request."""
        raise NotImplementedError

    def add_lora(self, lora_request: "LoRARequest") -> bool:
        """Load an adapter (ValueError naming what is wrong); True if loaded now."""
        raise ValueError("lora_request: this engine's runner serves no LoRA adapters")

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter; False if it was not loaded."""
        return False

    def list_loras(self) -> list[int]:
        """The ids of the adapters loaded."""
        return []

    def shutdown(self) -> None:
        """Release what the runner holds (worker processes, threads)."""
