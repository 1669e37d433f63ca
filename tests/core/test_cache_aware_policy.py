"""The ``lpm`` policy: the longest cached prefix first, and no request passed
more than ``lpm_max_bypass`` times."""

import pytest

from cadence.core.testing import FakeRunner, new_request, new_scheduler, prompt_of, run_until_done

SHARED = prompt_of("shared", 32)
# One runner per test module run: its shadow KV cache must outlive the warm-up.
RUNNERS: dict[int, FakeRunner] = {}


def runner_of(scheduler) -> FakeRunner:
    return RUNNERS.setdefault(id(scheduler), FakeRunner(block_size=scheduler.block_size, check_kv=True))


def admitted_order(scheduler) -> list[str]:
    order: list[str] = []
    run_until_done(scheduler, runner_of(scheduler),
                   on_step=lambda so: order.extend(n.req_id for n in so.scheduled_new_reqs))
    return order


def warm(scheduler) -> None:
    """Put SHARED's blocks in the prefix cache."""
    scheduler.add_request(new_request("warm", SHARED + [7], max_tokens=1))
    run_until_done(scheduler, runner_of(scheduler))


def test_requests_with_the_longest_cached_prefix_go_first():
    s = new_scheduler(policy="lpm", max_num_seqs=1, num_gpu_blocks=128)
    warm(s)
    s.add_request(new_request("cold1", 30, max_tokens=2))
    s.add_request(new_request("hit16", SHARED[:16] + prompt_of("x", 10), max_tokens=2))
    s.add_request(new_request("cold2", 30, max_tokens=2))
    s.add_request(new_request("hit32", SHARED + prompt_of("y", 10), max_tokens=2))
    assert admitted_order(s) == ["hit32", "hit16", "cold1", "cold2"]


def test_fcfs_order_for_the_same_requests():
    s = new_scheduler(policy="fcfs", max_num_seqs=1, num_gpu_blocks=128)
    warm(s)
    for req_id, prompt in (("cold1", 30), ("hit32", SHARED + [5, 6])):
        s.add_request(new_request(req_id, prompt, max_tokens=2))
    assert admitted_order(s) == ["cold1", "hit32"]


@pytest.mark.parametrize("bound", [0, 1, 3])
def test_no_request_is_passed_more_than_the_bound(bound):
    s = new_scheduler(policy="lpm", lpm_max_bypass=bound, max_num_seqs=1, num_gpu_blocks=128)
    warm(s)
    s.add_request(new_request("cold", 30, max_tokens=2))
    for i in range(6):
        s.add_request(new_request(f"hit{i}", SHARED + prompt_of(f"h{i}", 6), max_tokens=2))
    order = admitted_order(s)
    assert order.index("cold") == bound


def test_an_unbounded_lpm_starves_the_cold_request_to_the_end():
    s = new_scheduler(policy="lpm", lpm_max_bypass=10**9, max_num_seqs=1, num_gpu_blocks=128)
    warm(s)
    s.add_request(new_request("cold", 30, max_tokens=2))
    for i in range(6):
        s.add_request(new_request(f"hit{i}", SHARED + prompt_of(f"h{i}", 6), max_tokens=2))
    assert admitted_order(s)[-1] == "cold"


def test_the_bound_is_an_lpm_option():
    with pytest.raises(ValueError, match=r"^lpm_max_bypass: applies to policy lpm only"):
        new_scheduler(policy="fcfs", lpm_max_bypass=4)
    with pytest.raises(ValueError, match=r"^lpm_max_bypass: must be >= 0"):
        new_scheduler(policy="lpm", lpm_max_bypass=-1)


def test_a_passed_request_ages_and_one_nearly_as_hot_goes_before_the_bound():
    # bound 4: each bypass adds 32 // 4 = 8 tokens. "half" (16 cached) ties the hits'
    # 32 after two bypasses and goes (ties: the earlier one); "cold" reaches the bound.
    s = new_scheduler(policy="lpm", lpm_max_bypass=4, max_num_seqs=1, num_gpu_blocks=128)
    warm(s)
    s.add_request(new_request("cold", 30, max_tokens=2))
    s.add_request(new_request("half", SHARED[:16] + prompt_of("x", 10), max_tokens=2))
    for i in range(6):
        s.add_request(new_request(f"hit{i}", SHARED + prompt_of(f"h{i}", 6), max_tokens=2))
    order = admitted_order(s)
    assert order[:5] == ["hit0", "hit1", "half", "hit2", "cold"]
