"""The per-request drafting switch: pauses while acceptance is low, for a
pause that doubles while retries fail, and drafts again once they succeed."""

from __future__ import annotations

from cadence.runner.draft_gate import MAX_BACKOFF_STEPS, DraftGate


def drafted_steps(gate: DraftGate, outcomes: list[int]) -> list[bool]:
    """Step by step, whether the gate drafts, until every outcome (drafts
    accepted of 3) went to a drafted step."""
    allowed = []
    remaining = list(outcomes)
    while remaining:
        drafts = gate.allows_draft()
        allowed.append(drafts)
        if drafts:
            gate.observe(3, remaining.pop(0))
    return allowed


def test_a_request_whose_drafts_are_accepted_always_drafts():
    gate = DraftGate(floor=0.3)
    assert drafted_steps(gate, [3, 2, 3, 1, 3, 3]) == [True] * 6
    assert gate.pause_steps == 0 and gate.backoff_steps == 1


def test_rejected_drafts_pause_drafting_for_a_doubling_while():
    gate = DraftGate(floor=0.3)
    # Rejected twice: the average falls under the floor (1 -> 0.5 -> 0.25), pause 1 step;
    # each failed retry doubles the pause: 2, 4.
    steps = drafted_steps(gate, [0, 0, 0, 0, 0])
    assert steps == [True, True, False, True, False, False, True, False, False, False, False, True]
    assert gate.backoff_steps == 16


def test_a_successful_retry_resumes_drafting_every_step():
    gate = DraftGate(floor=0.3)
    steps = drafted_steps(gate, [0, 0, 3, 3, 3])
    assert steps == [True, True, False, True, True, True]
    assert gate.backoff_steps == 1


def test_the_pause_is_bounded():
    gate = DraftGate(floor=0.3)
    for _ in range(20):
        gate.observe(3, 0)
    assert gate.pause_steps == gate.backoff_steps == MAX_BACKOFF_STEPS


def test_floor_zero_never_pauses():
    gate = DraftGate(floor=0.0)
    assert drafted_steps(gate, [0] * 10) == [True] * 10
