"""The scheduler test harness, cadence.core.testing: one sampling rule, and a
fake runner that is also the engine's runner."""

from cadence.core.testing import (
    FakeRunner,
    fixed_token,
    greedy_stream,
    greedy_token,
    new_request,
    new_scheduler,
    prompt_of,
    samples,
    verify_drafts,
)
from cadence.engine.core import EngineCore


def test_a_request_samples_when_the_step_reaches_its_known_tokens_end():
    assert not samples(3, 2, 6)  # a prefill chunk short of the end
    assert samples(3, 3, 6)
    assert samples(5, 3, 6)  # the last known token and two drafts


def test_fake_runner_runs_inside_the_engine_core():
    scheduler = new_scheduler(max_num_batched_tokens=8)
    runner = FakeRunner(block_size=scheduler.block_size)
    core = EngineCore(scheduler, runner)
    core.add_request(new_request("a", 10, max_tokens=3))  # a 10-token prompt in chunks of 8 and 2
    streams = {}
    while core.has_work():
        for outputs in core.step().values():
            for out in outputs.outputs:
                streams.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert streams == {"a": greedy_stream(prompt_of("a", 10), 3)}
    assert runner.num_sampled == {"a": 3}


def test_drafts_are_accepted_up_to_the_first_wrong_one():
    tokens = [5, 6, 7]
    right = greedy_stream(tokens, 3)
    assert verify_drafts(greedy_token, "r", tokens, right[:2]) == right  # both right: one more
    assert verify_drafts(greedy_token, "r", tokens, [right[0], right[1] + 1]) == right[:2]
    assert verify_drafts(fixed_token(9), "r", tokens, [9, 9, 4]) == [9, 9, 9]
