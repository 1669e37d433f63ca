"""The model runners of a tensor-parallel engine: one per rank, all in step.

    engine core: scheduler.schedule() -> SchedulerOutput
      DriverRunner (rank 0, in the engine core's process)
        sends the SchedulerOutput to every worker      ShardRunner (rank r, a worker process)
        execute_model on its shard  <-- collectives -->  execute_model on its shard
        samples; broadcasts the tokens  ------------->  appends rank 0's tokens
      ModelRunnerOutput -> scheduler.update_from_output

Every rank runs the same ``ModelRunner`` code on the same ``SchedulerOutput``,
so their persistent batches, block tables and collective calls stay in
lockstep; only rank 0 samples (random draws, grammars, drafts and logprobs
happen once) and its tokens are what every rank appends, so they never
diverge. A worker does not draft: the scheduler's drafts reach it in the
``SchedulerOutput``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from cadence.core.outputs import LogprobsLists, ModelRunnerOutput
from cadence.core.sched.output import SchedulerOutput
from cadence.models.tp_group import TensorParallelGroup
from cadence.runner.input_batch import StepInputs
from cadence.runner.model_runner import ModelRunner

if TYPE_CHECKING:
    from cadence.runner.tp_workers import WorkerPool


class DriverRunner(ModelRunner):
    """Rank 0: sends each step to the workers, runs its shard, samples for all."""

    def __init__(self, model: torch.nn.Module, model_config: Any, *, group: TensorParallelGroup,
                 workers: "WorkerPool", **runner_args: Any) -> None:
        self.tp_group = group
        self.workers = workers
        super().__init__(model, model_config, **runner_args)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step on every rank; a failed or dead worker raises RuntimeError naming it."""
        self.workers.send_step(scheduler_output)
        try:
            return super().execute_model(scheduler_output)
        except RuntimeError as err:  # a collective whose peer is gone, most likely
            failure = self.workers.find_failure()
            if failure is None:
                raise
            raise failure from err

    def _sample(self, step: StepInputs, hidden: torch.Tensor, logits_indices: torch.Tensor,
                scheduler_output: SchedulerOutput) -> tuple[list[list[int]], LogprobsLists | None]:
        sampled, logprobs = super()._sample(step, hidden, logits_indices, scheduler_output)
        self.tp_group.broadcast_object(sampled)
        return sampled, logprobs

    def shutdown(self) -> None:
        self.workers.shutdown()


class ShardRunner(ModelRunner):
    """Rank r > 0: runs its shard of each step and appends the tokens rank 0 sampled."""

    def __init__(self, model: torch.nn.Module, model_config: Any, *, group: TensorParallelGroup,
                 **runner_args: Any) -> None:
        self.tp_group = group
        super().__init__(model, model_config, **runner_args)

    def _sample(self, step: StepInputs, hidden: torch.Tensor, logits_indices: torch.Tensor,
                scheduler_output: SchedulerOutput) -> tuple[list[list[int]], LogprobsLists | None]:
        if step.does_sample.any():  # rank 0 computes these logits too: the LM head's all-gather
            self.model.compute_logits(hidden.index_select(0, logits_indices))
        return self.tp_group.broadcast_object(), None

    def _propose_drafts(self, step: StepInputs, sampled: list[list[int]]) -> None:
        return None  # rank 0 drafts; its drafts come back through the scheduler
