"""FCFS and priority order of the waiting queue."""

import pytest

from tests.core.scheduler_sim import ModelRunnerSim, make_request, make_scheduler, step
from cadence.core.sched.policy import make_policy, register_policy


def admission_order(s, runner):
    order = []
    while s.has_requests():
        so, _ = step(s, runner)
        order += [r.req_id for r in so.scheduled_new_reqs]
    return order


def test_fcfs_admits_in_arrival_order():
    s = make_scheduler(max_num_seqs=1)
    for i, name in enumerate(["c", "a", "b"]):
        s.add_request(make_request(name, 5, max_tokens=2, arrival_time=i))
    assert admission_order(s, ModelRunnerSim(4)) == ["c", "a", "b"]


def test_priority_lower_value_first_ties_by_arrival():
    s = make_scheduler(max_num_seqs=1, policy="priority")
    s.add_request(make_request("late-urgent", 5, max_tokens=2, priority=0, arrival_time=3))
    s.add_request(make_request("early-low", 5, max_tokens=2, priority=5, arrival_time=0))
    s.add_request(make_request("early-urgent", 5, max_tokens=2, priority=0, arrival_time=1))
    s.add_request(make_request("mid", 5, max_tokens=2, priority=2, arrival_time=2))
    assert admission_order(s, ModelRunnerSim(4)) == ["early-urgent", "late-urgent", "mid", "early-low"]


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="^policy"):
        make_scheduler(policy="lottery")
    with pytest.raises(ValueError, match="^policy"):
        make_policy("lottery")


def test_policies_plug_in_through_the_registry():
    from cadence.core.sched.policy import FCFSQueue

    class NewestFirst:
        def make_queue(self):
            return FCFSQueue()

        def pick_victim(self, running):
            return running[0]

    register_policy("test-newest")(NewestFirst)
    assert isinstance(make_policy("test-newest"), NewestFirst)
