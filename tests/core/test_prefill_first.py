"""Prefill-first ordering (transformers' PrefillFirstScheduler): running
requests that are still prefilling are served before decoding ones."""

import pytest
from tests.core.fakes import FakeRunner, all_blocks_free, new_request, new_scheduler, run_until_done, step


def workload(s):
    s.add_request(new_request("a", 4, max_tokens=6))  # short prompt: decodes from step 2
    s.add_request(new_request("b", 20, max_tokens=2))  # long prompt: prefills in chunks
    s.add_request(new_request("c", 10, max_tokens=2))


def schedules(s, num_steps):
    runner = FakeRunner()
    return [list(step(s, runner)[0].num_scheduled_tokens.items()) for _ in range(num_steps)]


def test_split_prefill_goes_before_decodes():
    s = new_scheduler(max_num_batched_tokens=8, prefill_first=True)
    workload(s)
    assert schedules(s, 6) == [
        [("a", 4), ("b", 4)],
        [("b", 8)],  # a, decoding, waits for b's prefill
        [("b", 8)],  # b's prompt done (20 tokens)
        [("a", 1), ("b", 1), ("c", 6)],  # nobody prefills: running order, then c is admitted
        [("c", 4), ("a", 1)],  # c still prefilling: first
        [("a", 1), ("c", 1)],
    ]


def test_default_order_serves_decodes_first():
    s = new_scheduler(max_num_batched_tokens=8)
    assert s.config.prefill_first is False
    workload(s)
    assert schedules(s, 4) == [
        [("a", 4), ("b", 4)],
        [("a", 1), ("b", 7)],
        [("a", 1), ("b", 7)],
        [("a", 1), ("b", 2), ("c", 5)],
    ]


def test_prefilling_requests_keep_their_admission_order():
    s = new_scheduler(max_num_batched_tokens=10, prefill_first=True)
    s.add_request(new_request("d", 2, max_tokens=8))
    s.add_request(new_request("p1", 12, max_tokens=2))
    s.add_request(new_request("p2", 16, max_tokens=2))
    s.add_request(new_request("p3", 16, max_tokens=2))
    assert schedules(s, 4) == [
        [("d", 2), ("p1", 8)],
        [("p1", 4), ("d", 1), ("p2", 5)],
        [("p2", 10)],  # the only one still prefilling; d and p1 wait
        [("p2", 1), ("d", 1), ("p1", 1), ("p3", 7)],
    ]
    s = new_scheduler(max_num_batched_tokens=10, prefill_first=True)
    for req_id in ("p1", "p2", "p3"):
        s.add_request(new_request(req_id, 12, max_tokens=2))
    # Three prefilling requests: served in admission order.
    assert schedules(s, 3) == [
        [("p1", 10)],
        [("p1", 2), ("p2", 8)],
        [("p2", 4), ("p1", 1), ("p3", 5)],
    ]


@pytest.mark.parametrize("budget", [8, 13])
def test_order_does_not_change_the_outputs(budget):
    def run(prefill_first):
        s = new_scheduler(max_num_batched_tokens=budget, prefill_first=prefill_first)
        workload(s)
        outputs = run_until_done(s)
        assert all_blocks_free(s)
        return {r: [t for o in outs for t in o.new_token_ids] for r, outs in outputs.items()}

    plain = run(False)
    assert {r: len(t) for r, t in plain.items()} == {"a": 6, "b": 2, "c": 2}
    assert run(True) == plain
