"""max_num_seqs bounds the running set; waiting requests start as others finish."""

from tests.core.scheduler_sim import ModelRunnerSim, make_request, make_scheduler, run_to_completion, step


def test_no_more_than_max_num_seqs_run():
    s = make_scheduler(max_num_seqs=3, max_num_batched_tokens=256)
    for i in range(7):
        s.add_request(make_request(f"r{i}", 5, max_tokens=4))
    runner = ModelRunnerSim(4)
    so, _ = step(s, runner)
    assert set(so.num_scheduled_tokens) == {"r0", "r1", "r2"}
    assert s.get_request_counts() == (3, 4)
    while s.has_requests():
        so, _ = step(s, runner)
        assert len(so.num_scheduled_tokens) <= 3
        assert len(s.running) <= 3


def test_waiting_requests_admitted_in_order_as_slots_free():
    s = make_scheduler(max_num_seqs=2, max_num_batched_tokens=256)
    for i in range(4):
        s.add_request(make_request(f"r{i}", 5, max_tokens=2 + i))
    runner = ModelRunnerSim(4)
    first_scheduled = {}
    n = 0
    while s.has_requests():
        so, _ = step(s, runner)
        n += 1
        for new in so.scheduled_new_reqs:
            first_scheduled[new.req_id] = n
    assert first_scheduled == {"r0": 1, "r1": 1, "r2": 3, "r3": 4}


def test_all_finish_with_tiny_limit():
    s = make_scheduler(max_num_seqs=1)
    for i in range(5):
        s.add_request(make_request(f"r{i}", 9, max_tokens=3))
    streams = run_to_completion(s)
    assert sorted(streams) == [f"r{i}" for i in range(5)]
    assert all(len(v) == 3 for v in streams.values())
