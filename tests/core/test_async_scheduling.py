"""Async scheduling: step t+1 is scheduled before step t's tokens come back;
sampled positions in flight are counted as output placeholders."""

import pytest
from tests.core.fakes import (
    FakeRunner,
    all_blocks_free,
    flatten,
    greedy_token,
    new_request,
    new_scheduler,
    prompt_of,
    run_pipelined,
    run_until_done,
)

from cadence.core.request import FinishReason, RequestStatus


def streams(outputs):
    return {
        req_id: ([t for o in outs for t in o.new_token_ids], outs[-1].finish_reason)
        for req_id, outs in outputs.items()
    }


def test_next_step_is_scheduled_before_the_previous_update():
    s = new_scheduler(async_scheduling=True)
    s.add_request(new_request("a", 10, max_tokens=5))
    runner = FakeRunner()
    request = s.requests["a"]
    so1 = s.schedule()
    out1 = runner.execute(so1)
    assert so1.num_scheduled_tokens == {"a": 10}
    assert request.num_output_placeholders == 1  # the prefill samples one token
    so2 = s.schedule()  # before the first token is back
    assert so2.num_scheduled_tokens == {"a": 1}
    assert so2.scheduled_cached_reqs.req_ids == ["a"]
    assert so2.scheduled_cached_reqs.num_computed_tokens == [10]
    assert request.num_tokens == 10 and request.num_computed_tokens == 11
    out2 = runner.execute(so2)

    [out] = flatten(s.update_from_output(so1, out1))
    assert out.new_token_ids == out1.sampled_token_ids[0]
    assert request.num_tokens == 11
    assert request.output_token_ids == out1.sampled_token_ids[0]
    [out] = flatten(s.update_from_output(so2, out2))
    assert out.new_token_ids == out2.sampled_token_ids[0]
    assert request.num_tokens == 12
    assert request.num_output_placeholders == 0


def test_placeholders_drop_as_tokens_arrive():
    s = new_scheduler(async_scheduling=True)
    s.add_request(new_request("a", 6, max_tokens=8))
    runner = FakeRunner()
    request = s.requests["a"]
    so1 = s.schedule()
    out1 = runner.execute(so1)
    assert request.num_output_placeholders == 1
    s.update_from_output(so1, out1)
    assert request.num_output_placeholders == 0
    assert request.num_output_tokens == 1


def test_decode_is_scheduled_in_every_step_while_a_token_is_in_flight():
    s = new_scheduler(async_scheduling=True)
    s.add_request(new_request("a", 10, max_tokens=6))
    scheduled = []
    run_pipelined(s, on_schedule=lambda so: scheduled.append(so.num_scheduled_tokens.get("a", 0)))
    # One prefill and 5 decodes sample the 6 tokens; then two steps report the finish.
    assert scheduled[:6] == [10, 1, 1, 1, 1, 1]


def test_two_tokens_in_flight_count_as_two_placeholders():
    s = new_scheduler(async_scheduling=True)
    s.add_request(new_request("a", 10, max_tokens=6))
    runner = FakeRunner()
    request = s.requests["a"]
    so1 = s.schedule()
    out1 = runner.execute(so1)
    so2 = s.schedule()
    assert request.num_output_placeholders == 2
    runner.execute(so2)
    s.update_from_output(so1, out1)
    assert request.num_output_placeholders == 1
    so3 = s.schedule()
    assert so3.num_scheduled_tokens == {"a": 1}


def test_a_request_never_samples_past_max_tokens():
    s = new_scheduler(async_scheduling=True)
    s.add_request(new_request("a", 5, max_tokens=4))
    s.add_request(new_request("b", 9, max_tokens=1))
    runner = FakeRunner()
    outputs = run_pipelined(s, runner)
    assert runner.num_sampled == {"a": 4, "b": 1}  # exactly max_tokens sampled positions
    assert {r: len(t) for r, (t, _) in streams(outputs).items()} == {"a": 4, "b": 1}
    assert all_blocks_free(s)


def make_workload(s, eos_token_id=None):
    for i, (length, max_tokens) in enumerate([(3, 5), (17, 4), (9, 7), (30, 3), (5, 1)]):
        s.add_request(new_request(f"r{i}", prompt_of(f"r{i}", length), max_tokens=max_tokens,
                                  eos_token_id=eos_token_id))


@pytest.mark.parametrize("num_blocks", [64, 12])  # 12: tight, with preemptions
def test_outputs_equal_the_synchronous_run(num_blocks):
    sync = new_scheduler(max_num_batched_tokens=16, num_gpu_blocks=num_blocks)
    make_workload(sync)
    expected = streams(run_until_done(sync))
    asyn = new_scheduler(max_num_batched_tokens=16, num_gpu_blocks=num_blocks, async_scheduling=True)
    make_workload(asyn)
    got = streams(run_pipelined(asyn))
    assert got == expected
    assert {r: len(t) for r, (t, _) in got.items()} == {"r0": 5, "r1": 4, "r2": 7, "r3": 3, "r4": 1}
    assert all_blocks_free(asyn)


def test_stop_token_in_flight_ends_the_request_like_the_synchronous_run():
    # Pick as EOS the 3rd token r2 would produce, so r2 stops while its 4th is in flight.
    tokens = prompt_of("r2", 9)
    for _ in range(3):
        tokens.append(greedy_token("r2", tokens))
    eos = tokens[-1]
    sync = new_scheduler(max_num_batched_tokens=16)
    make_workload(sync, eos_token_id=eos)
    expected = streams(run_until_done(sync))
    assert expected["r2"] == (tokens[9:], FinishReason.STOP)
    asyn = new_scheduler(max_num_batched_tokens=16, async_scheduling=True)
    make_workload(asyn, eos_token_id=eos)
    assert streams(run_pipelined(asyn)) == expected
    assert all_blocks_free(asyn)


def test_abort_while_a_step_is_in_flight():
    s = new_scheduler(async_scheduling=True)
    s.add_request(new_request("a", 8, max_tokens=10))
    runner = FakeRunner()
    so1 = s.schedule()
    out1 = runner.execute(so1)
    request = s.requests["a"]
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert flatten(s.update_from_output(so1, out1)) == []  # its token is dropped
    assert request.status == RequestStatus.FINISHED_ABORTED
    assert request.output_token_ids == []
    so2 = s.schedule()
    assert so2.finished_req_ids == {"a"}
    assert so2.num_scheduled_tokens == {}
    assert all_blocks_free(s)
