"""finish_requests from outside (abort, stop string), include_finished_set."""

import pytest

from tests.core.scheduler_sim import ModelRunnerSim, make_request, make_scheduler, step
from cadence.core.request import FinishReason, RequestStatus


def test_abort_running_and_waiting_frees_blocks():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("run", 10, max_tokens=50))
    s.add_request(make_request("wait", 10, max_tokens=50))
    runner = ModelRunnerSim(4)
    step(s, runner)
    assert s.kv_cache_manager.usage > 0
    s.finish_requests(["run", "wait"], RequestStatus.FINISHED_ABORTED)
    assert s.get_request_counts() == (0, 0)
    assert s.kv_cache_manager.usage == 0
    assert s.has_finished_requests() and s.has_requests() and not s.has_unfinished_requests()
    so = s.schedule()
    assert so.finished_req_ids == {"run", "wait"} and so.num_scheduled_tokens == {}
    assert not s.has_requests()


def test_finish_single_id_and_unknown_ids_are_ignored():
    s = make_scheduler()
    req = make_request("a", 5, max_tokens=9)
    s.add_request(req)
    s.finish_requests("nope", RequestStatus.FINISHED_ABORTED)
    s.finish_requests("a", RequestStatus.FINISHED_STOPPED)  # e.g. a stop string found
    assert req.status == RequestStatus.FINISHED_STOPPED and req.get_finished_reason() == FinishReason.STOP
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # already finished: no-op
    assert req.status == RequestStatus.FINISHED_STOPPED


def test_finish_requires_a_finished_status():
    s = make_scheduler()
    with pytest.raises(ValueError, match="^finished_status"):
        s.finish_requests("a", RequestStatus.RUNNING)


def test_abort_while_step_runs_drops_its_tokens():
    s = make_scheduler()
    s.add_request(make_request("a", 5, max_tokens=9))
    runner = ModelRunnerSim(4)
    so = s.schedule()
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    result = s.update_from_output(so, runner.execute(so))
    assert all(not eco.outputs for eco in result.values())
    assert s.kv_cache_manager.usage == 0


def test_include_finished_set_per_client():
    s = make_scheduler(include_finished_set=True)
    s.add_request(make_request("a", 5, max_tokens=1, client_index=0))
    s.add_request(make_request("b", 5, max_tokens=2, client_index=1))
    runner = ModelRunnerSim(4)
    so = s.schedule()
    result = s.update_from_output(so, runner.execute(so))
    assert result[0].finished_requests == {"a"}
    assert result[1].finished_requests is None
    so = s.schedule()
    result = s.update_from_output(so, runner.execute(so))
    assert result[1].finished_requests == {"b"}
    assert [o.request_id for o in result[1].outputs] == ["b"]


def test_outputs_routed_to_their_client():
    s = make_scheduler()
    s.add_request(make_request("a", 5, max_tokens=2, client_index=3))
    s.add_request(make_request("b", 5, max_tokens=2, client_index=7))
    runner = ModelRunnerSim(4)
    so = s.schedule()
    result = s.update_from_output(so, runner.execute(so))
    assert {c: [o.request_id for o in eco.outputs] for c, eco in result.items()} == {3: ["a"], 7: ["b"]}
    assert sum(eco.scheduler_stats is not None for eco in result.values()) == 1


def test_duplicate_request_id_is_rejected():
    s = make_scheduler()
    s.add_request(make_request("a", 5))
    with pytest.raises(ValueError, match="^request_id"):
        s.add_request(make_request("a", 5))
