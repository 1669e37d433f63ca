"""When drafting pays for a request, and when it does not.

Verifying k drafts costs the target k more token positions in the step; a
request whose drafts are rejected pays that for nothing (and at a large
batch the step is compute-bound: the waste slows every request). Each
request keeps a moving average of the fraction of its drafts accepted;
below the floor it stops drafting for a while, and tries again after
``backoff`` steps, doubling the pause each time the retry fails too, so a
request whose text turns repetitive later (a quote, a list, code) is
drafted for again within a few steps.
"""

from __future__ import annotations

# Weight of the newest verification in the moving average.
ACCEPTANCE_EMA_WEIGHT = 0.5
MAX_BACKOFF_STEPS = 64


class DraftGate:
    """One request's drafting switch (see the module docstring)."""

    __slots__ = ("floor", "acceptance", "pause_steps", "backoff_steps")

    def __init__(self, floor: float) -> None:
        self.floor = floor
        self.acceptance = 1.0  # optimistic: a new request is drafted for
        self.pause_steps = 0
        self.backoff_steps = 1

    def allows_draft(self) -> bool:
        """Whether to draft for the next step (counts a paused step down)."""
        if self.pause_steps:
            self.pause_steps -= 1
            return False
        return True

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """A verification's outcome: ``num_accepted`` of ``num_drafted`` drafts."""
        if not num_drafted:
            return
        self.acceptance += ACCEPTANCE_EMA_WEIGHT * (num_accepted / num_drafted - self.acceptance)
        if self.acceptance >= self.floor:
            self.backoff_steps = 1
            return
        self.pause_steps = self.backoff_steps
        self.backoff_steps = min(2 * self.backoff_steps, MAX_BACKOFF_STEPS)
        # The retry after the pause is judged on its own result.
        self.acceptance = self.floor
