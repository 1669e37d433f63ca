"""Speculative decoding in the scheduler: schedule drafts, roll back rejections.

A request with drafts ``d0..d(k-1)`` after its last known token computes
1 + k tokens in one step. The runner returns the accepted drafts plus one
token of its own; each rejected draft was counted in ``num_computed_tokens``
by ``schedule()`` and is taken back here:

    scheduled:  [last] d0 d1 d2        (num_scheduled = 4)
    sampled:    d0 d1 x                (2 accepted + 1 new)
    rejected:   4 - 3 = 1  ->  num_computed_tokens -= 1
"""

from __future__ import annotations

from cadence.core.outputs import SpecDecodingStats
from cadence.core.request import Request


def take_scheduled_drafts(request: Request, num_new_tokens: int) -> list[int] | None:
    """Remove the request's drafts; return those that fit in ``num_new_tokens``.

    Drafts are verified once: the runner proposes fresh ones for the next step.
    """
    drafts, request.spec_token_ids = request.spec_token_ids, []
    num_drafts = num_new_tokens + request.num_computed_tokens - request.num_tokens
    if num_drafts <= 0:
        return None
    del drafts[num_drafts:]
    return drafts


def roll_back_rejected(request: Request, num_drafts: int, num_sampled: int) -> int:
    """Undo the computed-token count of rejected drafts; returns accepted drafts."""
    num_rejected = num_drafts + 1 - num_sampled
    if num_rejected > 0:
        request.num_computed_tokens -= num_rejected
    return num_sampled - 1


def observe(
    stats: SpecDecodingStats | None, num_spec_tokens: int, num_drafts: int, num_accepted: int
) -> SpecDecodingStats:
    if stats is None:
        stats = SpecDecodingStats.new(max(num_spec_tokens, num_drafts))
    stats.observe_draft(num_drafts, num_accepted)
    return stats
