"""SchedulerStats and request events."""

from tests.core.scheduler_sim import ModelRunnerSim, make_request, make_scheduler, step
from cadence.core.request import RequestEventType


def test_stats_snapshot_after_each_step():
    s = make_scheduler(max_num_seqs=2, num_blocks=10, block_size=4)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 8, max_tokens=3))
    runner = ModelRunnerSim(4)
    so = s.schedule()
    result = s.update_from_output(so, runner.execute(so))
    stats = result[0].scheduler_stats
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (2, 1)
    assert stats.kv_cache_usage == 4 / 10  # 2 requests x 2 blocks
    assert stats.prefix_cache_stats.requests == 2
    assert stats.num_corrupted_reqs == 0 and stats.spec_decoding_stats is None
    assert stats.step_counter == 1


def test_no_stats_without_log_stats():
    s = make_scheduler(log_stats=False)
    s.add_request(make_request("a", 4, max_tokens=2))
    runner = ModelRunnerSim(4)
    so = s.schedule()
    result = s.update_from_output(so, runner.execute(so))
    assert result[0].scheduler_stats is None and s.make_stats() is None


def test_request_events_queued_scheduled_preempted():
    s = make_scheduler(num_blocks=4, prefix_caching=False)
    s.add_request(make_request("a", 8, max_tokens=10, arrival_time=0))
    s.add_request(make_request("b", 7, max_tokens=10, arrival_time=1))
    runner = ModelRunnerSim(4)
    events = {}
    for _ in range(4):
        _, outputs = step(s, runner)
        for out in outputs:
            events.setdefault(out.request_id, []).extend(e.type for e in out.events or [])
    assert events["a"][:2] == [RequestEventType.QUEUED, RequestEventType.SCHEDULED]
    assert RequestEventType.PREEMPTED in events.get("b", []) or s.requests["b"].events[-1].type == RequestEventType.PREEMPTED


def test_preemptions_counted_in_stats():
    s = make_scheduler(num_blocks=4, prefix_caching=False)
    s.add_request(make_request("a", 8, max_tokens=10))
    s.add_request(make_request("b", 7, max_tokens=10))
    runner = ModelRunnerSim(4)
    seen = 0
    for _ in range(3):
        so = s.schedule()
        result = s.update_from_output(so, runner.execute(so))
        if result:
            seen += next(iter(result.values())).scheduler_stats.num_preemptions
    assert seen == 1
