"""The ``slo`` policy: slack order, batch work last, loosest preempted, misses refused."""

from __future__ import annotations

import pytest

from cadence.config import SchedulerConfig
from cadence.core.sched.policy import configured_policy
from cadence.core.sched.slo import SLOPolicy, SLOUnattainable
from cadence.core.step_time import StepTimeModel
from cadence.core.testing import FakeRunner, all_blocks_free, new_request, new_scheduler, run_until_done, step


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def slo_request(req_id, *, ttft=None, tpot=None, arrival=0.0, prompt=8, max_tokens=4):
    """A request arriving at ``arrival`` on the test's clock (0 by default)."""
    request = new_request(req_id, prompt, max_tokens=max_tokens, arrival_time=arrival)
    request.slo_ttft_s, request.slo_tpot_s = ttft, tpot
    return request


def test_step_time_model_learns_a_line():
    model = StepTimeModel()
    for _ in range(200):
        for tokens in (1, 64, 512, 2048):
            model.observe(tokens, 0.005 + 1e-5 * tokens)
    assert model.predict(1000) == pytest.approx(0.015, rel=0.02)
    assert model.predict(1) == pytest.approx(0.005, rel=0.05)


def test_tightest_deadline_first_and_batch_last():
    s = new_scheduler(policy="slo", max_num_seqs=1, num_gpu_blocks=256)
    runner = FakeRunner(block_size=s.block_size)
    s.add_request(slo_request("batch", arrival=0.0))
    s.add_request(slo_request("loose", ttft=5.0, arrival=0.0))
    s.add_request(slo_request("tight", ttft=0.5, arrival=1.0))  # later, but due sooner
    order = []
    while s.has_requests():
        so, _ = step(s, runner)
        order += [r.req_id for r in so.scheduled_new_reqs]
    assert order == ["tight", "loose", "batch"]


def test_a_request_with_a_target_displaces_batch_work_at_max_num_seqs():
    s = new_scheduler(policy="slo", max_num_seqs=2, num_gpu_blocks=256)
    runner = FakeRunner(block_size=s.block_size)
    s.add_request(slo_request("batch1", max_tokens=20))
    s.add_request(slo_request("batch2", max_tokens=20))
    step(s, runner)
    s.add_request(slo_request("chat", ttft=0.5, arrival=1.0))
    so, _ = step(s, runner)
    assert [r.req_id for r in so.scheduled_new_reqs] == ["chat"]
    assert so.preempted_req_ids == {"batch2"}
    # Targets never displace targets.
    s.add_request(slo_request("chat2", ttft=0.1, arrival=2.0))
    so, _ = step(s, runner)
    assert "chat" not in so.preempted_req_ids
    run_until_done(s, runner)
    assert all_blocks_free(s)


def test_the_victim_is_batch_work_then_the_loosest_tpot():
    policy = SLOPolicy()
    batch = slo_request("b")
    loose, tight = slo_request("l", tpot=0.2), slo_request("t", tpot=0.02)
    assert policy.pick_victim([tight, batch, loose]) is batch
    assert policy.pick_victim([tight, loose]) is loose


def test_a_target_out_of_reach_is_refused_with_a_retry_after():
    clock = FakeClock()
    s = new_scheduler(policy="slo", slo_reject=True, max_num_batched_tokens=64, num_gpu_blocks=256,
                      clock=clock)
    s.add_request(slo_request("ok", ttft=10.0, prompt=16))
    s.policy.reject = False  # let a backlog in: 20,000 prompt tokens, ~3.5 s of prefill
    for i in range(100):
        s.add_request(slo_request(f"q{i}", ttft=2.0, prompt=200))
    s.policy.reject = True
    with pytest.raises(SLOUnattainable, match=r"^slo_ttft_s: a first token in 1.5 s cannot be met") as err:
        s.add_request(slo_request("late", ttft=1.5, arrival=1.0, prompt=200))
    assert err.value.retry_after_s >= 1
    s.add_request(slo_request("patient", ttft=60.0, arrival=1.0, prompt=200))  # reachable: admitted
    assert "late" not in s.requests
    run_until_done(s, FakeRunner(block_size=s.block_size))


def test_slo_options_belong_to_the_slo_policy():
    assert SchedulerConfig(policy="slo", slo_ttft_s=0.5, slo_tpot_s=0.05, slo_reject=True)
    for name, value in (("slo_ttft_s", 0.5), ("slo_tpot_s", 0.05), ("slo_reject", True)):
        with pytest.raises(ValueError, match=rf"^{name}: applies to policy slo only"):
            SchedulerConfig(**{name: value})
    # The slo module checks its options' values (wherever the policy is made).
    with pytest.raises(ValueError, match=r"^slo_ttft_s: must be a positive number"):
        configured_policy(SchedulerConfig(policy="slo", slo_ttft_s=-1.0))
    with pytest.raises(ValueError, match=r"^slo_tpot_s: must be a positive number"):
        new_scheduler(policy="slo", slo_tpot_s=float("inf"))


def test_steps_are_timed_on_the_schedulers_clock():
    clock = FakeClock()
    s = new_scheduler(policy="slo", num_gpu_blocks=256, clock=clock)
    runner = FakeRunner(block_size=s.block_size)
    for i in range(4):
        s.add_request(slo_request(f"r{i}", ttft=1.0, prompt=32, max_tokens=30))
    while s.has_requests():
        step(s, runner)
        clock.now += 0.02  # every step takes 20 ms on this clock
    assert s.policy.model.num_observed > 20
    assert s.policy.model.predict(4) == pytest.approx(0.02, rel=0.25)
