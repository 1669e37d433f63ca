"""The contract between the engine loop and a scheduler (vLLM v1's names)."""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from typing import TYPE_CHECKING, Any, Iterable

from cadence.core.compiled import trait

if TYPE_CHECKING:
    from cadence.core.outputs import EngineCoreOutputs, ModelRunnerOutput, SchedulerStats, SpecDecodingStats
    from cadence.core.request import Request, RequestStatus
    from cadence.core.sched.output import SchedulerOutput


@trait
class SchedulerInterface(metaclass=ABCMeta):
    """What ``EngineCore`` calls, once per step and on requests from outside."""

    @abstractmethod
    def schedule(self) -> "SchedulerOutput":
        """Decide this step: ``{req_id: num_tokens}`` under the token and block budgets.

        One step is one forward pass. A request may get its whole prompt,
        a chunk of it, one decode token, or a decode plus speculative drafts.
        Every scheduled request's ``num_computed_tokens`` is advanced before
        this returns, so the next step can be scheduled at once.
        """
        raise NotImplementedError

    @abstractmethod
    def update_from_output(
        self, scheduler_output: "SchedulerOutput", model_runner_output: "ModelRunnerOutput"
    ) -> "dict[int, EngineCoreOutputs]":
        """Absorb a step's sampled tokens: append them, roll back rejected
        drafts, stop finished requests. Returns outputs per client index."""
        raise NotImplementedError

    @abstractmethod
    def add_request(self, request: "Request") -> None:
        """Queue a new request."""
        raise NotImplementedError

    @abstractmethod
    def finish_requests(
        self, request_ids: "str | Iterable[str]", finished_status: "RequestStatus"
    ) -> None:
        """Finish requests from outside (client abort, stop string found by
        the detokenizer). Unknown ids are ignored."""
        raise NotImplementedError

    @abstractmethod
    def get_num_unfinished_requests(self) -> int:
        """Requests waiting or running."""
        raise NotImplementedError

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""
        return self.get_num_unfinished_requests() > 0

    @abstractmethod
    def has_finished_requests(self) -> bool:
        """Whether requests finished since the last ``schedule()`` still have
        to be reported to the runner (in the next ``SchedulerOutput``)."""
        raise NotImplementedError

    def has_requests(self) -> bool:
        """Unfinished requests, or finished ones not yet reported."""
        return self.has_unfinished_requests() or self.has_finished_requests()

    @abstractmethod
    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (e.g. after a weight update); False while blocks are in use."""
        raise NotImplementedError

    @abstractmethod
    def get_request_counts(self) -> tuple[int, int]:
        """(num_running_reqs, num_waiting_reqs)."""
        raise NotImplementedError

    @abstractmethod
    def make_stats(self, spec_decoding_stats: "SpecDecodingStats | None" = None) -> "SchedulerStats | None":
        """A stats snapshot (None unless the scheduler logs stats), with the
        step's speculative-decoding counts if it has some."""
        raise NotImplementedError

    @abstractmethod
    def shutdown(self) -> None:
        """Release resources held outside the process (connectors, publishers)."""
        raise NotImplementedError

    def get_kv_connector(self) -> Any:
        """The KV connector in use, or None."""
        return None
