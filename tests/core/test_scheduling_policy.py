"""FCFS and priority order of the waiting queue."""

import pytest

from tests.core.scheduler_sim import ModelRunnerSim, make_request, make_scheduler, step
from cadence.core.sched.policy import make_policy, register_policy
from cadence.core.testing import new_request, new_scheduler, run_until_done


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
    from cadence.core.sched.policy import FCFSQueue, SchedulingPolicy

    class NewestFirst(SchedulingPolicy):
        def make_queue(self):
            return FCFSQueue()

        def pick_victim(self, running):
            return running[0]

    register_policy("test-newest")(NewestFirst)
    assert isinstance(make_policy("test-newest"), NewestFirst)
    # Registered in this process: the config takes its name too.
    assert new_scheduler(policy="test-newest").policy.pick_victim(["a", "b"]) == "a"


def test_a_policy_from_outside_the_package_by_its_import_path():
    prompts = {"long": 40, "mid": 20, "short": 6}
    s = new_scheduler(policy="tests.plugins.shortest_first:ShortestPromptFirst",
                      max_num_seqs=1, max_num_batched_tokens=64)
    for req_id, length in prompts.items():
        s.add_request(new_request(req_id, length, max_tokens=2))
    order = []
    run_until_done(s, on_step=lambda so: order.extend(n.req_id for n in so.scheduled_new_reqs))
    assert order == ["short", "mid", "long"]
    # Imported, it registered its own name.
    assert type(new_scheduler(policy="shortest-first").policy).__name__ == "ShortestPromptFirst"


def test_a_policy_path_that_is_not_a_policy_is_refused():
    with pytest.raises(ValueError, match=r"^policy: .*NotAPolicy, not a SchedulingPolicy"):
        new_scheduler(policy="tests.plugins.shortest_first:NotAPolicy")
    with pytest.raises(ValueError, match=r"^policy: cannot import 'tests.plugins.nowhere'"):
        new_scheduler(policy="tests.plugins.nowhere:Policy")
    with pytest.raises(ValueError, match=r"^policy: must be one of"):
        new_scheduler(policy="no-such-policy")


def test_the_default_hooks_decide_nothing():
    from cadence.core.sched.policy import FCFSPolicy

    policy = FCFSPolicy()
    request = new_request("r", [1, 2, 3])
    assert policy.displace(request, []) is None and policy.step_budget(77) == 77
    assert not policy.defers_prefill(request) and policy.service_stats() is None
    assert not policy.overrides("begin_step") and policy.overrides("pick_victim")


