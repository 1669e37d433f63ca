"""Preemption by recompute when blocks run out."""

from tests.core.scheduler_sim import ModelRunnerSim, expected_stream, make_request, make_scheduler, run_to_completion, step
from cadence.core.request import RequestStatus


def fill_until_preemption(s, runner, max_steps=200):
    for _ in range(max_steps):
        so, _ = step(s, runner)
        if so.preempted_req_ids:
            return so
    raise AssertionError("no preemption happened")


def test_fcfs_preempts_the_last_admitted_and_admits_nothing_that_step():
    # 3 requests of 8 prompt tokens (2 blocks each) in 7 blocks: decoding needs a 3rd block each.
    s = make_scheduler(num_blocks=7, max_num_batched_tokens=64, prefix_caching=False)
    for name in ["a", "b", "c"]:
        s.add_request(make_request(name, 8, max_tokens=10))
    s.add_request(make_request("d", 4, max_tokens=5))  # takes the 7th block
    runner = ModelRunnerSim(4)
    so = fill_until_preemption(s, runner)
    # a needs a block: d (admitted last) goes; b needs one: c goes.
    assert so.preempted_req_ids == {"c", "d"}
    assert [r.request_id for r in s.waiting] == ["c", "d"]
    victim = s.requests["c"]
    assert victim.status == RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
    assert victim.num_preemptions == 1
    assert s.waiting.peek_request() is victim  # back at the head
    assert so.scheduled_new_reqs == []  # no admissions in a step that preempted
    assert "c" not in so.num_scheduled_tokens
    assert s.kv_cache_manager.get_block_ids("c") == []


def test_resumed_request_is_flagged_and_recomputes_its_outputs():
    s = make_scheduler(num_blocks=7, max_num_batched_tokens=64, prefix_caching=False)
    prompts = {n: list(range(i * 100, i * 100 + 8)) for i, n in enumerate("abc")}
    for name, prompt in prompts.items():
        s.add_request(make_request(name, prompt, max_tokens=10))
    runner = ModelRunnerSim(4)
    fill_until_preemption(s, runner)
    c = s.requests["c"]
    num_outputs_before = c.num_output_tokens
    assert num_outputs_before > 0
    resumed = None
    streams = {}
    while s.has_requests():
        num_outputs_now = c.num_output_tokens
        so, outputs = step(s, runner)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id == "c" and cached.resumed_from_preemption[i] and resumed is None:
                resumed = (cached.num_computed_tokens[i], so.num_scheduled_tokens["c"],
                           cached.new_block_ids[i], num_outputs_now)
        for out in outputs:
            streams.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert resumed is not None
    num_computed, num_scheduled, block_ids, num_outputs_before = resumed
    # Recompute from scratch: prompt plus the outputs it already had.
    assert num_computed == 0 and num_scheduled == 8 + num_outputs_before
    assert len(block_ids) * 4 >= num_scheduled  # the whole block list is sent again
    assert c.num_output_tokens == 10
    assert c.output_token_ids == expected_stream(prompts["c"], 10)
    assert s.kv_cache_manager.num_free_blocks == 7


def test_priority_preempts_the_worst_priority_even_if_already_scheduled():
    s = make_scheduler(num_blocks=7, max_num_batched_tokens=64, prefix_caching=False, policy="priority")
    s.add_request(make_request("low", 8, max_tokens=10, priority=9, arrival_time=0))
    s.add_request(make_request("high", 8, max_tokens=10, priority=0, arrival_time=1))
    s.add_request(make_request("mid", 8, max_tokens=10, priority=5, arrival_time=2))
    runner = ModelRunnerSim(4)
    so = fill_until_preemption(s, runner)
    assert so.preempted_req_ids == {"low"}
    assert "low" not in so.num_scheduled_tokens
    assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
    run_to_completion(s, runner)


def test_greedy_streams_survive_preemption():
    prompts = {f"r{i}": list(range(i * 50, i * 50 + 6 + i)) for i in range(5)}
    s = make_scheduler(num_blocks=12, max_num_batched_tokens=32, prefix_caching=False)
    for name, prompt in prompts.items():
        s.add_request(make_request(name, prompt, max_tokens=12))
    runner = ModelRunnerSim(4)
    streams = run_to_completion(s, runner)
    for name, prompt in prompts.items():
        assert streams[name] == expected_stream(prompt, 12), name


def test_request_that_cannot_fit_alone_preempts_itself_and_waits():
    s = make_scheduler(num_blocks=3, max_num_batched_tokens=64, prefix_caching=False)
    s.add_request(make_request("a", 10, max_tokens=10))
    runner = ModelRunnerSim(4)
    step(s, runner)  # 10 tokens: 3 blocks
    so, _ = step(s, runner)  # 11th token fits in block 3
    so, _ = step(s, runner)  # 12th: still fits
    so, _ = step(s, runner)  # 13th needs a 4th block: preempts itself
    assert so.preempted_req_ids == {"a"} and so.num_scheduled_tokens == {}
