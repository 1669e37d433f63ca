"""Chunked prefill, long_prefill_token_threshold, and whole-prompt admission."""

from tests.core.scheduler_sim import ModelRunnerSim, expected_stream, make_request, make_scheduler, run_to_completion, step


def test_long_prompt_is_split_across_steps_under_the_budget():
    s = make_scheduler(max_num_batched_tokens=16)
    req = make_request("a", 40, max_tokens=2)
    s.add_request(req)
    runner = ModelRunnerSim(4)
    chunks = []
    for _ in range(3):
        so, outputs = step(s, runner)
        chunks.append(so.num_scheduled_tokens["a"])
        assert req.num_computed_tokens == sum(chunks)
    assert chunks == [16, 16, 8]
    assert outputs[0].new_token_ids == expected_stream(req.prompt_token_ids, 1)


def test_running_requests_first_then_waiting_fill_the_rest():
    s = make_scheduler(max_num_batched_tokens=16)
    s.add_request(make_request("a", 10, max_tokens=4))
    runner = ModelRunnerSim(4)
    step(s, runner)  # a: whole prompt
    s.add_request(make_request("b", 30, max_tokens=4))
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 15}
    assert [r.req_id for r in so.scheduled_new_reqs] == ["b"]
    assert so.scheduled_cached_reqs.req_ids == ["a"]
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 15}
    assert so.scheduled_cached_reqs.req_ids == ["a", "b"]
    assert so.scheduled_cached_reqs.num_computed_tokens == [11, 15]


def test_long_prefill_token_threshold_caps_each_request():
    s = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=10)
    s.add_request(make_request("a", 25, max_tokens=1))
    s.add_request(make_request("b", 25, max_tokens=1))
    runner = ModelRunnerSim(4)
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"a": 10, "b": 10}
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"a": 10, "b": 10}
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"a": 5, "b": 5}


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    s = make_scheduler(max_num_batched_tokens=32, enable_chunked_prefill=False)
    s.add_request(make_request("a", 20, max_tokens=3))
    s.add_request(make_request("b", 20, max_tokens=3))
    runner = ModelRunnerSim(4)
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"a": 20}  # b does not fit whole: skipped, not split
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 20}


def test_chunked_output_matches_one_shot_output():
    prompt = list(range(500, 547))
    streams = []
    for budget in (8, 13, 64):
        s = make_scheduler(max_num_batched_tokens=budget, prefix_caching=False)
        s.add_request(make_request("a", prompt, max_tokens=6))
        streams.append(run_to_completion(s)["a"])
    assert streams[0] == streams[1] == streams[2] == expected_stream(prompt, 6)
