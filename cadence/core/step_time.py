"""A step's duration predicted from its token count, learned online.

The ``slo`` policy predicts prefill times with it; the scheduler bounds its
running batch by it (``step_time_target_s``); the runner's draft gate
(speculative decoding) prices a verified position with it. ``StepTimer``
feeds it a busy engine's steps as its scheduler sees them.
"""

from __future__ import annotations

from typing import Callable


class StepTimeModel:
    """``seconds = a + b * tokens``, fitted by recursive least squares with forgetting.

    Starts from a prior (10 ms + 20 us a token) and follows the engine as
    steps are observed; old observations fade with ``forgetting`` per step.
    """

    def __init__(self, base_s: float = 0.01, per_token_s: float = 2e-5, forgetting: float = 0.995,
                 per_token_doubt: float = 1e-6, base_doubt: float = 1.0) -> None:
        self.theta = [base_s, per_token_s]
        # Covariance: how far the fit may move from the prior, against an
        # observation's weight of one (``per_token_doubt`` for the per-token
        # cost, ``base_doubt`` for the base: a larger one learns it from fewer steps).
        self.p = [[base_doubt, 0.0], [0.0, per_token_doubt]]
        self.forgetting = forgetting
        self.num_observed = 0

    def predict(self, num_tokens: int) -> float:
        return max(1e-4, self.theta[0] + self.theta[1] * num_tokens)

    def observe(self, num_tokens: int, seconds: float) -> None:
        x = (1.0, float(num_tokens))
        p, lam = self.p, self.forgetting
        px = (p[0][0] * x[0] + p[0][1] * x[1], p[1][0] * x[0] + p[1][1] * x[1])
        denom = lam + x[0] * px[0] + x[1] * px[1]
        gain = (px[0] / denom, px[1] / denom)
        error = seconds - (self.theta[0] * x[0] + self.theta[1] * x[1])
        self.theta = [self.theta[0] + gain[0] * error, self.theta[1] + gain[1] * error]
        xp = (x[0] * p[0][0] + x[1] * p[1][0], x[0] * p[0][1] + x[1] * p[1][1])
        self.p = [[(p[i][j] - gain[i] * xp[j]) / lam for j in range(2)] for i in range(2)]
        self.num_observed += 1


# Weight of each new step of the fewest tokens in StepTimer.fewest_s (an exponential average).
SOLO_AVERAGING = 0.1
# Steps of one size the timer learns before it counts that size as seen
# (StepTimer.max_tokens_timed): one step moves a fit seen at smaller sizes only part way.
TIMES_TO_TRUST = 4


class StepTimer:
    """Times a busy engine's steps on its scheduler's clock (wall time when
    serving, the virtual clock in the simulator): the time from one
    ``schedule`` call to the next is the earlier step's, whose token count the
    scheduler gave at the end of that call. A gap far beyond the prediction
    was the engine idling, not computing, and is not learned."""

    def __init__(self, clock: Callable[[], float], model: StepTimeModel | None = None) -> None:
        self.clock = clock
        self.model = model if model is not None else StepTimeModel()
        # The fewest tokens a learned step computed, and that size's time,
        # averaged (None until a step was learned): a single stream's step
        # where the size is one, a bound below it per token elsewhere.
        self.fewest_tokens = 0
        self.fewest_s: float | None = None
        # How far the fit has seen: the most tokens computed by TIMES_TO_TRUST
        # learned steps of one size (step sizes -> how many were learned).
        self.max_tokens_timed = 0
        self._times_timed: dict[int, int] = {}
        self._last_start: float | None = None
        self._last_tokens = 0

    def step_begins(self, learn: bool = True) -> None:
        """A ``schedule`` call starts: the previous step has run. ``learn``
        False: the engine may have idled since (nothing was running), so the
        time since the last call is not a step's."""
        now = self.clock()
        if learn and self._last_start is not None and self._last_tokens:
            elapsed = now - self._last_start
            model = self.model
            # An idle gap is far beyond what a credible model predicts; a fit that is
            # not yet credible (a per-token cost <= 0, from steps of one size) judges nothing.
            if (elapsed < 10 * model.predict(self._last_tokens) or model.num_observed < 3
                    or model.theta[1] <= 0):
                self.model.observe(self._last_tokens, elapsed)
                self._count_size(self._last_tokens)
                self._time_fewest(self._last_tokens, elapsed)
        self._last_start = now
        self._last_tokens = 0

    @property
    def solo_s(self) -> float | None:
        """A one-token step's time (a single stream decoding), averaged; None until one ran."""
        return self.fewest_s if self.fewest_tokens == 1 else None

    def stream_step_s(self) -> float | None:
        """A single stream's step: timed, or (none ran alone yet) the smallest
        step timed per token, no more than it (a step's cost grows with its
        tokens, and less than in proportion). None before any step."""
        return None if self.fewest_s is None else self.fewest_s / self.fewest_tokens

    def _time_fewest(self, num_tokens: int, seconds: float) -> None:
        if self.fewest_s is None or num_tokens < self.fewest_tokens:
            self.fewest_tokens, self.fewest_s = num_tokens, seconds
        elif num_tokens == self.fewest_tokens:
            self.fewest_s += SOLO_AVERAGING * (seconds - self.fewest_s)

    def _count_size(self, num_tokens: int) -> None:
        if num_tokens <= self.max_tokens_timed:
            return
        times = self._times_timed[num_tokens] = self._times_timed.get(num_tokens, 0) + 1
        if times == TIMES_TO_TRUST:
            self.max_tokens_timed = num_tokens
            for size in [size for size in self._times_timed if size <= num_tokens]:
                del self._times_timed[size]

    def step_planned(self, num_tokens: int) -> None:
        """The step just scheduled computes ``num_tokens`` tokens."""
        self._last_tokens = num_tokens
