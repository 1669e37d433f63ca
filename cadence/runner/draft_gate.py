"""When drafting pays for a request, and when it does not.

Verifying k drafts costs the target k more token positions in the step. A
draft token is worth it when the chance it is accepted, times what an output
token costs now, exceeds what computing one more position costs: at batch 1
a step costs about the same for 1 or 4 positions (weights are read once),
so nearly any acceptance pays; in a large, compute-bound batch every
position costs its share, and only drafts that are mostly right pay.
``DraftCostModel`` measures both from the runner's own steps and gives the
break-even acceptance rate.

Each request keeps a moving average of the fraction of its drafts accepted
(``DraftGate``); below the floor it stops drafting for a while, and tries
again after a pause that doubles each time the retry fails too, so a request
whose text turns repetitive later (a quote, a list, code) is drafted for
again within a few steps.
"""

from __future__ import annotations

from cadence.core.step_time import StepTimeModel

# Weight of the newest verification in a request's moving average.
ACCEPTANCE_EMA_WEIGHT = 0.5
MAX_BACKOFF_STEPS = 64
# Weight of the newest step in the seconds-per-output-token average.
STEP_EMA_WEIGHT = 0.1


class DraftGate:
    """One request's drafting switch (see the module docstring)."""

    __slots__ = ("acceptance", "pause_steps", "backoff_steps")

    def __init__(self) -> None:
        self.acceptance = 1.0  # optimistic: a new request is drafted for
        self.pause_steps = 0
        self.backoff_steps = 1

    def allows_draft(self) -> bool:
        """Whether to draft for the next step (counts a paused step down)."""
        if self.pause_steps:
            self.pause_steps -= 1
            return False
        return True

    def observe(self, num_drafted: int, num_accepted: int, floor: float) -> None:
        """A verification's outcome: ``num_accepted`` of ``num_drafted`` drafts,
        judged against the acceptance ``floor`` drafting needs now."""
        if not num_drafted:
            return
        self.acceptance += ACCEPTANCE_EMA_WEIGHT * (num_accepted / num_drafted - self.acceptance)
        if self.acceptance >= floor:
            self.backoff_steps = 1
            return
        self.pause_steps = self.backoff_steps
        self.backoff_steps = min(2 * self.backoff_steps, MAX_BACKOFF_STEPS)
        # The retry after the pause is judged on its own result.
        self.acceptance = floor


class DraftCostModel:
    """The break-even acceptance rate of a draft token, from observed steps:
    the marginal seconds of one more computed position (a linear fit of step
    time on positions) over the seconds an output token costs now."""

    def __init__(self) -> None:
        # No trusted prior: the per-position cost differs a hundredfold between
        # a GPU and a small CPU, and must be learnt from the first few steps.
        self.step_time = StepTimeModel(per_token_doubt=1.0)
        self.seconds_per_output: float | None = None

    def observe_step(self, num_positions: int, num_outputs: int, seconds: float) -> None:
        self.step_time.observe(num_positions, seconds)
        if num_outputs:
            per_output = seconds / num_outputs
            if self.seconds_per_output is None:
                self.seconds_per_output = per_output
            else:
                self.seconds_per_output += STEP_EMA_WEIGHT * (per_output - self.seconds_per_output)

    def break_even_acceptance(self) -> float:
        if not self.seconds_per_output:
            return 0.0
        per_position = max(0.0, self.step_time.theta[1])
        return min(1.0, per_position / self.seconds_per_output)
