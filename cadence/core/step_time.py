"""A step's duration predicted from its token count, learned online.

The ``slo`` policy predicts prefill times with it; the runner's draft gate
(speculative decoding) prices a verified position with it.
"""

from __future__ import annotations


class StepTimeModel:
    """``seconds = a + b * tokens``, fitted by recursive least squares with forgetting.

    Starts from a prior (10 ms + 20 us a token) and follows the engine as
    steps are observed; old observations fade with ``forgetting`` per step.
    """

    def __init__(self, base_s: float = 0.01, per_token_s: float = 2e-5, forgetting: float = 0.995,
                 per_token_doubt: float = 1e-6) -> None:
        self.theta = [base_s, per_token_s]
        # Covariance: how far the fit may move from the prior (``per_token_doubt``
        # for the per-token cost: a larger one learns it from fewer steps).
        self.p = [[1.0, 0.0], [0.0, per_token_doubt]]
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
