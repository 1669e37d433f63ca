"""The per-request drafting switch: pauses while acceptance is low, for a
pause that doubles while retries fail, and drafts again once they succeed."""

from __future__ import annotations

import pytest

from cadence.runner.draft_gate import MAX_BACKOFF_STEPS, DraftCostModel, DraftGate


def drafted_steps(gate: DraftGate, outcomes: list[int], floor: float = 0.3) -> list[bool]:
    """Step by step, whether the gate drafts, until every outcome (drafts
    accepted of 3) went to a drafted step."""
    allowed = []
    remaining = list(outcomes)
    while remaining:
        drafts = gate.allows_draft()
        allowed.append(drafts)
        if drafts:
            gate.observe(3, remaining.pop(0), floor)
    return allowed


def test_a_request_whose_drafts_are_accepted_always_drafts():
    gate = DraftGate()
    assert drafted_steps(gate, [3, 2, 3, 1, 3, 3]) == [True] * 6
    assert gate.pause_steps == 0 and gate.backoff_steps == 1


def test_rejected_drafts_pause_drafting_for_a_doubling_while():
    gate = DraftGate()
    # Rejected twice: the average falls under the floor (1 -> 0.5 -> 0.25), pause 1 step;
    # each failed retry doubles the pause: 2, 4.
    steps = drafted_steps(gate, [0, 0, 0, 0, 0])
    assert steps == [True, True, False, True, False, False, True, False, False, False, False, True]
    assert gate.backoff_steps == 16


def test_a_successful_retry_resumes_drafting_every_step():
    gate = DraftGate()
    steps = drafted_steps(gate, [0, 0, 3, 3, 3])
    assert steps == [True, True, False, True, True, True]
    assert gate.backoff_steps == 1


def test_the_pause_is_bounded():
    gate = DraftGate()
    for _ in range(20):
        gate.observe(3, 0, 0.3)
    assert gate.pause_steps == gate.backoff_steps == MAX_BACKOFF_STEPS


def test_floor_zero_never_pauses():
    assert drafted_steps(DraftGate(), [0] * 10, floor=0.0) == [True] * 10


def test_the_break_even_rate_is_a_positions_cost_over_an_outputs():
    """Steps of 4 ms + 1 ms a position: at 8 positions giving 8 outputs an
    output costs 1.5 ms, so a draft token must be accepted 1/1.5 of the time;
    at 1 position a step costs 5 ms an output, and 1/5 suffices."""
    costs = DraftCostModel()
    assert costs.break_even_acceptance() == 0.0  # nothing measured: draft
    for num_positions in [1, 4, 8, 16, 2, 8] * 30:
        costs.observe_step(num_positions, 8, 0.004 + 0.001 * num_positions)
    for _ in range(60):
        costs.observe_step(8, 8, 0.012)
    assert costs.break_even_acceptance() == pytest.approx(1 / 1.5, rel=0.05)
    for _ in range(60):
        costs.observe_step(1, 1, 0.005)
    assert costs.break_even_acceptance() == pytest.approx(1 / 5, rel=0.05)
