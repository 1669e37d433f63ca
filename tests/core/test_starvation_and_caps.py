"""Issue 12, items 3-5: priority displacement at max_num_seqs, partial-prefill caps,
and no starvation (FCFS stops at a prompt that does not fit; bounded bypass)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cadence.core.testing import (
    FakeRunner, all_blocks_free, greedy_stream, new_request, new_scheduler, run_until_done, step,
)


def scheduled(so) -> dict[str, int]:
    return dict(so.num_scheduled_tokens)


# ---------------------------------------------------------------- no starvation


def test_without_chunked_prefill_the_queue_stops_at_a_prompt_that_does_not_fit():
    """As vLLM does: c would fit, but it arrived after b, which does not."""
    s = new_scheduler(max_num_batched_tokens=32, enable_chunked_prefill=False)
    runner = FakeRunner(block_size=s.block_size)
    for req_id, length in (("a", 20), ("b", 20), ("c", 5)):
        s.add_request(new_request(req_id, length, max_tokens=3))
    so, _ = step(s, runner)
    assert scheduled(so) == {"a": 20}
    so, _ = step(s, runner)
    assert scheduled(so) == {"a": 1, "b": 20, "c": 5}


def admissions_behind_a_blocked_prompt(bypass_steps: int) -> list[str]:
    """b (30 tokens) does not fit beside three decodes; one short request arrives a step.

    Returns the order in which requests were admitted over 20 steps.
    """
    s = new_scheduler(max_num_batched_tokens=32, enable_chunked_prefill=False,
                      max_blocked_bypass_steps=bypass_steps, num_gpu_blocks=256)
    runner = FakeRunner(block_size=s.block_size)
    for i in range(3):
        s.add_request(new_request(f"a{i}", 8, max_tokens=12))
    step(s, runner)
    s.add_request(new_request("b", 30, max_tokens=2))
    admitted = []
    for k in range(20):
        s.add_request(new_request(f"s{k}", 1, max_tokens=3))
        so, _ = step(s, runner)
        admitted += [r.req_id for r in so.scheduled_new_reqs]
    run_until_done(s, runner)
    assert all_blocks_free(s)
    return admitted


def test_bounded_bypass_lets_short_requests_pass_for_that_many_steps_only():
    """With max_blocked_bypass_steps=2 the shorts pass b in the first two steps it is
    blocked; from then on the queue waits for b, however long that takes."""
    admitted = admissions_behind_a_blocked_prompt(2)
    assert admitted[:3] == ["s0", "s1", "b"]
    assert set(admitted) >= {"b", "s2", "s3"}


def test_without_bypass_nothing_passes_a_blocked_prompt():
    assert admissions_behind_a_blocked_prompt(0)[0] == "b"


def test_a_prompt_longer_than_the_budget_is_refused_without_chunked_prefill():
    s = new_scheduler(max_num_batched_tokens=32, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match=r"^prompt: 40 tokens exceed max_num_batched_tokens=32"):
        s.add_request(new_request("a", 40))
    assert not s.has_requests()


# ---------------------------------------------------------------- priority displacement


def test_a_better_priority_displaces_the_worst_running_request_when_seqs_are_full():
    s = new_scheduler(max_num_seqs=2, policy="priority", num_gpu_blocks=256)
    runner = FakeRunner(block_size=s.block_size)
    s.add_request(new_request("low1", 8, max_tokens=10, priority=5, arrival_time=1.0))
    s.add_request(new_request("low2", 8, max_tokens=10, priority=5, arrival_time=2.0))
    step(s, runner)
    s.add_request(new_request("urgent", 8, max_tokens=2, priority=0, arrival_time=3.0))
    so, _ = step(s, runner)
    assert [r.req_id for r in so.scheduled_new_reqs] == ["urgent"]
    assert so.preempted_req_ids == {"low2"}  # the worst: same priority, later arrival
    outputs = run_until_done(s, runner)
    assert set(outputs) >= {"low1", "low2", "urgent"} and all_blocks_free(s)


def test_equal_priority_never_displaces_and_fcfs_never_does():
    for policy, priority in (("priority", 5), ("fcfs", 0)):
        s = new_scheduler(max_num_seqs=2, policy=policy, num_gpu_blocks=256)
        runner = FakeRunner(block_size=s.block_size)
        s.add_request(new_request("r1", 8, max_tokens=10, priority=priority))
        s.add_request(new_request("r2", 8, max_tokens=10, priority=priority))
        step(s, runner)
        s.add_request(new_request("late", 8, max_tokens=2, priority=priority))
        so, _ = step(s, runner)
        assert not so.scheduled_new_reqs and not so.preempted_req_ids, policy


# ---------------------------------------------------------------- partial-prefill caps


def test_partial_prefill_caps_leave_a_slot_to_short_prompts():
    s = new_scheduler(max_num_batched_tokens=128, long_prefill_token_threshold=16,
                      max_num_partial_prefills=2, max_long_partial_prefills=1, num_gpu_blocks=256)
    runner = FakeRunner(block_size=s.block_size)
    for req_id, length in (("long1", 100), ("long2", 100), ("short1", 8), ("short2", 8)):
        s.add_request(new_request(req_id, length, max_tokens=2))
    so, _ = step(s, runner)
    # One long prompt (capped at 16 tokens a step), and short1 in the second slot;
    # long2 is passed over (long slot taken), short2 waits (no slot left).
    assert scheduled(so) == {"long1": 16, "short1": 8}
    so, _ = step(s, runner)
    assert scheduled(so) == {"long1": 16, "short1": 1, "short2": 8}
    run_until_done(s, runner)
    assert all_blocks_free(s)


def test_partial_prefill_options_are_checked():
    with pytest.raises(ValueError, match=r"^max_long_partial_prefills: needs long_prefill_token_threshold"):
        new_scheduler(max_long_partial_prefills=1)
    with pytest.raises(ValueError, match=r"^max_long_partial_prefills: must be <= max_num_partial_prefills"):
        new_scheduler(max_num_partial_prefills=1, max_long_partial_prefills=2,
                      long_prefill_token_threshold=8)
    with pytest.raises(ValueError, match=r"^max_num_partial_prefills: must be >= 1"):
        new_scheduler(max_num_partial_prefills=0)


# ---------------------------------------------------------------- every request finishes


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(["fcfs", "priority", "fair", "slo"]),
    chunked=st.booleans(),
    caps=st.sampled_from([None, (1, 1), (2, 1), (3, 2)]),
    bypass=st.sampled_from([0, 3]),
    arrivals=st.lists(
        st.tuples(st.integers(0, 6), st.integers(1, 60), st.integers(1, 12), st.integers(0, 3)),
        min_size=1, max_size=14),
)
def test_every_request_finishes_under_random_arrivals(policy, chunked, caps, bypass, arrivals):
    """(arrival step, prompt, max_tokens, priority): each finishes with its exact stream."""
    options = dict(policy=policy, enable_chunked_prefill=chunked, max_blocked_bypass_steps=bypass,
                   max_num_seqs=4, max_num_batched_tokens=64, num_gpu_blocks=48)
    if caps is not None:
        options.update(max_num_partial_prefills=caps[0], max_long_partial_prefills=caps[1],
                       long_prefill_token_threshold=24)
    s = new_scheduler(**options)
    runner = FakeRunner(block_size=s.block_size)
    pending = sorted(enumerate(arrivals), key=lambda item: item[1][0])
    outputs: dict[str, list[int]] = {}
    prompts = {}
    for step_index in range(3000):
        while pending and pending[0][1][0] <= step_index:
            i, (_, length, max_tokens, priority) = pending.pop(0)
            request = new_request(f"r{i}", length, max_tokens=max_tokens, priority=priority,
                                  arrival_time=float(step_index))
            request.tenant = f"t{i % 3}"  # three clients, for the fair policy
            if i % 2:  # half with latency targets, for the slo policy
                request.slo_ttft_s, request.slo_tpot_s = 0.05 * (1 + priority), 0.01
            prompts[request.request_id] = (request.prompt_token_ids, max_tokens)
            s.add_request(request)
        if not pending and not s.has_requests():
            break
        _, step_outputs = step(s, runner)
        for out in step_outputs:
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        s.kv_cache_manager.check_consistency()
    assert not s.has_requests(), f"starved: {sorted(s.requests)}"
    for req_id, (prompt, max_tokens) in prompts.items():
        assert outputs[req_id] == greedy_stream(prompt, max_tokens), req_id
    assert all_blocks_free(s)
