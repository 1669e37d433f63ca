"""``SimRunner``: the model runner's interface, a cost model instead of a model.

It keeps what a real runner keeps per request that matters here, the number
of known tokens (prompt + sampled), so it knows which scheduled requests
sample: the rule of every fake runner, ``cadence.core.testing.samples`` (a
prefill chunk short of the prompt's end samples nothing, as on a model).

Each sampled token is ``FILLER_TOKEN_ID``. Output lengths come from the
requests themselves: the simulator sends ``max_tokens = target`` with
``ignore_eos``, so the real scheduler's stop check ends each request at its
target. The step's duration is ``cost_model.step_seconds(step_shape)``,
left in ``last_step_seconds``, and queued in ``executed`` for the loop's
virtual clock (with async scheduling a step executes one call of the loop
before it is absorbed, so the clock takes the steps in order from there).
"""

from __future__ import annotations

from collections import deque
from typing import Any, NamedTuple, Protocol

from cadence.core.compiled import mypyc_attr
from cadence.core.outputs import KVConnectorOutput, ModelRunnerOutput
from cadence.core.runner_api import RunnerBase
from cadence.core.sched.output import SchedulerOutput
from cadence.sim.cost_model import CostModel, StepShape

FILLER_TOKEN_ID = 0


class StepTransfers(Protocol):
    """The worker side of a simulated KV connector: what a step's transfer
    plan costs, and the transfers the step reports finished."""

    def charge(self, metadata: Any, forward_seconds: float) -> tuple[float, float, KVConnectorOutput | None]:
        """(seconds before the forward, seconds beside it, the connector output);
        ``forward_seconds``: the step's own cost."""
        ...


class KnownTokens:
    """A request's known tokens (prompt + sampled) in the runner: counted in
    place, without a store into the runner's map per step."""

    __slots__ = ("count",)

    def __init__(self, count: int) -> None:
        self.count = count


class ExecutedStep(NamedTuple):
    seconds: float
    shape: StepShape
    num_preempted: int


@mypyc_attr(allow_interpreted_subclasses=True)  # (tests slow it down)
class SimRunner(RunnerBase):
    """Charges each step's cost; "samples" one filler token per finished row."""

    def __init__(self, cost_model: CostModel, transfers: StepTransfers | None = None) -> None:
        """``transfers``: price a KV connector's step plans too (the host tier's
        copies, ``cadence.sim.kv_tier``; P/D pulls, ``cadence.sim.disaggregation``)."""
        self.cost_model = cost_model
        self.transfers = transfers
        # req_id -> known tokens (prompt + sampled), kept across preemption.
        self._num_tokens: dict[str, KnownTokens] = {}
        self.last_step_seconds = 0.0
        self.last_shape = StepShape(0, 0, 0, 0)
        self.last_num_preempted = 0
        self.num_tokens_computed = 0  # since start: prefill, recompute and decode tokens
        self.executed: deque[ExecutedStep] = deque(maxlen=8)  # not yet taken by a clock

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        num_tokens = self._num_tokens
        for req_id in scheduler_output.finished_req_ids:
            num_tokens.pop(req_id, None)
        new_reqs = scheduler_output.scheduled_new_reqs
        cached = scheduler_output.scheduled_cached_reqs
        # Every scheduled request, and the tokens it had computed before this
        # step: the running ones first, as the scheduler lists them.
        req_ids, computed = cached.req_ids, cached.num_computed_tokens
        if new_reqs:
            req_ids = req_ids + [r.req_id for r in new_reqs]
            computed = computed + [r.num_computed_tokens for r in new_reqs]
            for new_req in new_reqs:
                num_tokens[new_req.req_id] = KnownTokens(len(new_req.prompt_token_ids) + len(new_req.output_token_ids))
        # One pass: sample where this step reaches the known tokens' end (with
        # drafts scheduled, all are rejected: one token, the scheduler rolls
        # back), and count the attention pairs beyond a decode's c + 1.
        scheduled = scheduler_output.num_scheduled_tokens
        sampled: list[list[int]] = []
        append = sampled.append
        # One list for every row that samples: nothing downstream changes a
        # row's tokens (they are appended to the request and read by the
        # client), and a list per row and step is most of a decode's garbage.
        filler = [FILLER_TOKEN_ID]
        extra_pairs = 0
        for req_id, c in zip(req_ids, computed):
            q = scheduled[req_id]
            known = num_tokens[req_id]
            if c + q >= known.count:  # samples(c, q, known), inline (it runs per request and step)
                known.count += 1
                append(filler)
            else:
                append([])  # a prefill chunk short of the prompt's end
            if q != 1:
                extra_pairs += q * c + (q * (q + 1) >> 1) - c - 1
        # The same shape as cost_model.step_shape (a test keeps them equal).
        total = scheduler_output.total_num_scheduled_tokens
        self.num_tokens_computed += total
        num_computed = sum(computed)
        num_reqs = len(req_ids)
        shape = StepShape(total, num_reqs, num_computed + total, num_computed + num_reqs + extra_pairs)
        self.last_shape = shape
        seconds = self.cost_model.step_seconds(shape)
        connector_output = None
        if self.transfers is not None:
            before, after, connector_output = self.transfers.charge(scheduler_output.kv_connector_metadata, seconds)
            seconds = before + max(seconds, after)
        self.last_step_seconds = seconds
        self.last_num_preempted = len(scheduler_output.preempted_req_ids)
        self.executed.append(ExecutedStep(self.last_step_seconds, shape, self.last_num_preempted))
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index=dict(zip(req_ids, range(num_reqs))),
            sampled_token_ids=sampled,
            kv_connector_output=connector_output,
        )
