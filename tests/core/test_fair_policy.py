"""The ``fair`` policy (VTC): fair shares across clients by weighted service counters."""

from __future__ import annotations

import pytest

from cadence.config import SchedulerConfig
from cadence.core.sched import fair
from cadence.core.sched.policy import configured_policy
from cadence.core.testing import FakeRunner, all_blocks_free, new_request, new_scheduler, run_until_done, step


def tenant_request(req_id, tenant, prompt=8, max_tokens=4, **kwargs):
    request = new_request(req_id, prompt, max_tokens=max_tokens, **kwargs)
    request.tenant = tenant
    return request


def admission_order(s, runner, max_steps=500):
    order = []
    for _ in range(max_steps):
        if not s.has_requests():
            break
        so, _ = step(s, runner)
        order += [r.req_id for r in so.scheduled_new_reqs]
    return order


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_a_light_client_is_not_queued_behind_a_heavy_one(policy):
    s = new_scheduler(policy=policy, max_num_seqs=2, num_gpu_blocks=256)
    runner = FakeRunner(block_size=s.block_size)
    for i in range(12):
        s.add_request(tenant_request(f"heavy{i}", "heavy", max_tokens=6))
    step(s, runner)
    s.add_request(tenant_request("light0", "light", max_tokens=6))
    s.add_request(tenant_request("light1", "light", max_tokens=6))
    order = admission_order(s, runner)
    # Under fair, light's requests are next in line as soon as slots free;
    # under FCFS they wait for all ten queued heavy ones.
    positions = [order.index("light0"), order.index("light1")]
    if policy == "fair":
        assert max(positions) <= 2
    else:
        assert min(positions) == 10
    assert all_blocks_free(s)


def test_no_banked_credit_for_a_client_that_was_idle():
    """B idles while A is served; back, B is lifted to A's counter: they alternate."""
    s = new_scheduler(policy="fair", max_num_seqs=1, num_gpu_blocks=256)
    runner = FakeRunner(block_size=s.block_size)
    for i in range(20):
        s.add_request(tenant_request(f"a{i}", "A", max_tokens=4))
    for _ in range(30):
        step(s, runner)  # A alone (and still busy): its counter grows
    counters = s.policy.counters
    assert counters.get("A") > 0 and counters.get("B") == 0
    for i in range(4):
        s.add_request(tenant_request(f"b{i}", "B", max_tokens=4))
    assert counters.get("B") == pytest.approx(counters.get("A"))  # lifted, not 0
    order = admission_order(s, runner)
    b_first = order[: 2 * 2]
    # Without the lift B would take the next four slots in a row.
    assert [r[0] for r in b_first] != ["b", "b", "b", "b"]
    assert {f"b{i}" for i in range(4)} <= set(order)
    assert all_blocks_free(s)


def test_weights_share_service_two_to_one():
    s = new_scheduler(policy="fair", fair_client_weights="alice=2,bob=1", max_num_seqs=1,
                      num_gpu_blocks=256)
    runner = FakeRunner(block_size=s.block_size)
    for i in range(40):
        s.add_request(tenant_request(f"alice{i}", "alice", prompt=4, max_tokens=4))
        s.add_request(tenant_request(f"bob{i}", "bob", prompt=4, max_tokens=4))
    order = admission_order(s, runner, max_steps=120)
    first = order[:30]
    alice = sum(r.startswith("alice") for r in first)
    bob = sum(r.startswith("bob") for r in first)
    assert 1.6 <= alice / bob <= 2.5, (alice, bob)


def test_the_victim_is_from_the_most_served_client():
    policy = fair.FairPolicy()
    policy.make_queue()
    a1, a2, b1 = (tenant_request(r, t) for r, t in (("a1", "A"), ("a2", "A"), ("b1", "B")))
    policy.counters.counters.update({"A": 50.0, "B": 10.0})
    assert policy.pick_victim([a1, b1, a2]) is a2  # A's, the latest admitted
    # With every slot taken, B may displace A's request while it is still prefilling
    # (little work lost), never one that is already decoding, never a less-served one.
    assert policy.displace(b1, [a1]) is a1
    a1.num_computed_tokens = a1.num_prompt_tokens
    assert policy.displace(b1, [a1]) is None
    assert policy.displace(a2, [b1]) is None


def test_a_step_that_admits_an_under_served_client_carries_no_other_prompt():
    """B (active, less served) sends while A's long prompts prefill: the next step is
    B's prompt and the running decodes only, so its first token comes after a short step."""
    s = new_scheduler(policy="fair", max_num_batched_tokens=64, num_gpu_blocks=256,
                      fair_short_step_tokens=64)  # no short steps: the favoured step alone
    runner = FakeRunner(block_size=s.block_size)
    s.add_request(tenant_request("b-chat", "B", prompt=4, max_tokens=40))
    for i in range(3):
        s.add_request(tenant_request(f"a{i}", "A", prompt=200, max_tokens=4))
    for _ in range(3):
        step(s, runner)  # A's prompts fill every step beside B's one decode
    assert s.policy.counters.get("B") < s.policy.counters.get("A")
    s.add_request(tenant_request("b0", "B", prompt=8, max_tokens=2))
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"b-chat": 1, "b0": 8}  # A's chunks wait one step
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens["b0"] == 1 and sum(so.num_scheduled_tokens.values()) == 64
    run_until_done(s, runner)
    assert all_blocks_free(s)


def test_the_short_step_holds_back_more_served_clients_still_waiting():
    """No prompt of A is running, but A's requests wait behind B's: the step that
    admits B carries no A prompt either (before, A's waiting prompts filled it)."""
    s = new_scheduler(policy="fair", max_num_batched_tokens=64, max_num_seqs=8, num_gpu_blocks=256)
    runner = FakeRunner(block_size=s.block_size)
    s.add_request(tenant_request("b-chat", "B", prompt=4, max_tokens=60))
    for i in range(2):
        s.add_request(tenant_request(f"a-run{i}", "A", prompt=30, max_tokens=60))
    for _ in range(4):
        step(s, runner)  # every prompt computed: A's two and B's one decode
    for i in range(3):
        s.add_request(tenant_request(f"a{i}", "A", prompt=100, max_tokens=2))
    s.add_request(tenant_request("b0", "B", prompt=8, max_tokens=2))
    assert s.policy.counters.get("B") < s.policy.counters.get("A")
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"b-chat": 1, "a-run0": 1, "a-run1": 1, "b0": 8}
    so, _ = step(s, runner)
    assert any(req_id.startswith("a") and n > 1 for req_id, n in so.num_scheduled_tokens.items())
    run_until_done(s, runner)
    assert all_blocks_free(s)


def test_steps_are_short_while_a_less_served_client_is_active():
    """B decodes while A's prompts prefill: A's steps take 3/8 of the budget, so B's next
    request waits for a short step. Once B is done, A's steps take the whole budget."""
    s = new_scheduler(policy="fair", max_num_batched_tokens=64, num_gpu_blocks=512)
    runner = FakeRunner(block_size=s.block_size)
    assert s.policy.short_step_tokens == 24  # 3/8 of the budget
    s.add_request(tenant_request("b-chat", "B", prompt=4, max_tokens=6))
    for i in range(4):
        s.add_request(tenant_request(f"a{i}", "A", prompt=200, max_tokens=2))
    totals = []
    while s.has_requests():
        so, _ = step(s, runner)
        b_active = "b-chat" in s.requests
        totals.append((so.total_num_scheduled_tokens, b_active))
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
    while_b = [total for total, active in totals[1:] if active]
    after_b = [total for total, active in totals if not active]
    assert while_b and max(while_b) <= 24
    assert max(after_b) == 64
    assert all_blocks_free(s)


def test_short_step_option_is_checked():
    with pytest.raises(ValueError, match="fair_short_step_tokens"):
        SchedulerConfig(policy="fcfs", fair_short_step_tokens=16)
    with pytest.raises(ValueError, match="fair_short_step_tokens"):
        configured_policy(SchedulerConfig(policy="fair", max_num_batched_tokens=64,
                                          fair_short_step_tokens=65))
    s = new_scheduler(policy="fair", max_num_batched_tokens=64, fair_short_step_tokens=64)
    assert s.policy.short_step_tokens is None  # the whole budget: no short steps


def test_idle_counters_stay_bounded(monkeypatch):
    monkeypatch.setattr(fair, "MAX_IDLE_COUNTERS", 5)
    counters = fair.ServiceCounters()
    for i in range(50):
        counters.counters[f"gone{i}"] = float(i)
    counters.counters["live"] = 100.0
    counters.end_step({"live"})
    assert len(counters.counters) == 6 and "live" in counters.counters
    assert {f"gone{i}" for i in range(45, 50)} <= set(counters.counters)  # the highest are kept


def test_client_weight_option_is_checked():
    assert SchedulerConfig(policy="fair", fair_client_weights="a=2, b=0.5").fair_client_weights
    with pytest.raises(ValueError, match=r"^fair_client_weights: applies to policy fair only"):
        SchedulerConfig(fair_client_weights="a=2")
    with pytest.raises(ValueError, match=r"^fair_client_weights: expected name=weight"):
        configured_policy(SchedulerConfig(policy="fair", fair_client_weights="a=0"))
    with pytest.raises(ValueError, match=r"^fair_short_step_tokens: must be between 1"):
        new_scheduler(policy="fair", fair_short_step_tokens=0)


def test_fair_queue_keeps_every_request_once():
    s = new_scheduler(policy="fair", max_num_seqs=3, num_gpu_blocks=40)
    runner = FakeRunner(block_size=s.block_size)
    for i in range(15):
        s.add_request(tenant_request(f"r{i}", f"t{i % 4}", prompt=10 + i, max_tokens=5 + i % 3))
    outputs = run_until_done(s, runner)
    assert sorted(outputs) == sorted(f"r{i}" for i in range(15))
    assert all_blocks_free(s) and len(s.waiting) == 0


def test_service_stats_name_at_most_sixteen_clients():
    counters = fair.ServiceCounters()
    for i in range(20):
        counters.served[f"c{i}"] = 100 + i
    counters.served[None] = 1000
    top = counters.top_served(fair.MAX_REPORTED_CLIENTS)
    assert len(top) == 17 and top[fair.ANONYMOUS] == 1000
    named = {k for k in top if k.startswith("c")}
    assert named == {f"c{i}" for i in range(5, 20)}
    assert top[fair.OTHER_CLIENTS] == sum(100 + i for i in range(5))


def test_scheduler_stats_carry_client_service_under_fair_only():
    for policy in ("fair", "fcfs"):
        s = new_scheduler(policy=policy, log_stats=True)
        runner = FakeRunner(block_size=s.block_size)
        s.add_request(tenant_request("a", "alice", prompt=8, max_tokens=3))
        run_until_done(s, runner)
        stats = s.make_stats()
        if policy == "fair":
            assert stats.client_service == {"alice": 8 + 2}  # the prompt, then 2 decode steps
        else:
            assert stats.client_service is None
