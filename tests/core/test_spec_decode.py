"""Speculative tokens: scheduled in the budget, rejections rolled back, stats, lookahead."""

from tests.core.scheduler_sim import ModelRunnerSim, expected_stream, make_request, make_scheduler, model_token, run_to_completion, step
from cadence.config import SpeculativeConfig


def good_drafter(k):
    """Drafts exactly what the model will say: everything is accepted."""
    def draft(req_id, tokens):
        seq, out = list(tokens), []
        for _ in range(k):
            out.append(model_token(seq))
            seq.append(out[-1])
        return out
    return draft


def half_right_drafter(req_id, tokens):
    """First draft right, second wrong, third anything."""
    return [model_token(tokens), 1, 2]


def test_drafts_are_scheduled_with_the_decode_token():
    s = make_scheduler(speculative_config=SpeculativeConfig(num_speculative_tokens=3))
    s.add_request(make_request("a", 6, max_tokens=20))
    runner = ModelRunnerSim(4, draft_fn=half_right_drafter)
    so, outputs = step(s, runner)  # prefill samples 1 token and gets 3 drafts
    assert s.requests["a"].spec_token_ids == half_right_drafter("a", runner.tokens["a"])
    so, outputs = step(s, runner)
    assert so.num_scheduled_tokens["a"] == 4  # last sampled token + 3 drafts
    assert len(so.scheduled_spec_decode_tokens["a"]) == 3
    assert so.total_num_scheduled_tokens == 4
    # 1 accepted + 1 corrected token; the 2 rejected drafts are rolled back.
    assert len(outputs[0].new_token_ids) == 2
    req = s.requests["a"]
    assert req.num_computed_tokens == req.num_tokens - 1


def test_partial_acceptance_gives_the_plain_greedy_stream():
    prompt = list(range(40, 49))
    for drafter in (half_right_drafter, good_drafter(3), lambda r, t: [0, 0, 0]):
        s = make_scheduler(speculative_config=SpeculativeConfig(num_speculative_tokens=3))
        s.add_request(make_request("a", prompt, max_tokens=17))
        streams = run_to_completion(s, ModelRunnerSim(4, draft_fn=drafter))
        assert streams["a"] == expected_stream(prompt, 17)


def test_accepted_drafts_take_fewer_steps():
    prompt = list(range(9))
    steps = {}
    for name, drafter in (("none", None), ("good", good_drafter(3))):
        spec = SpeculativeConfig(num_speculative_tokens=3) if drafter else None
        s = make_scheduler(speculative_config=spec)
        s.add_request(make_request("a", prompt, max_tokens=16))
        runner = ModelRunnerSim(4, draft_fn=drafter)
        run_to_completion(s, runner)
        steps[name] = runner.num_steps
    # +1: a last, empty step reports the finished request to the runner.
    assert steps["none"] == 16 + 1 and steps["good"] == 1 + 4 + 1


def test_drafts_trimmed_to_the_token_budget():
    s = make_scheduler(max_num_batched_tokens=5, speculative_config=SpeculativeConfig(num_speculative_tokens=3))
    s.add_request(make_request("a", 3, max_tokens=20))
    s.add_request(make_request("b", 2, max_tokens=20))
    runner = ModelRunnerSim(4, draft_fn=good_drafter(3))
    step(s, runner)  # 5 prompt tokens
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"a": 4, "b": 1}
    assert "b" not in so.scheduled_spec_decode_tokens


def test_spec_decoding_stats():
    s = make_scheduler(speculative_config=SpeculativeConfig(num_speculative_tokens=3))
    s.add_request(make_request("a", 6, max_tokens=20))
    runner = ModelRunnerSim(4, draft_fn=half_right_drafter)
    step(s, runner)
    so = s.schedule()
    result = s.update_from_output(so, runner.execute(so))
    stats = result[0].scheduler_stats.spec_decoding_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    assert stats.num_accepted_tokens_per_pos == [1, 0, 0]


def test_lookahead_slots_reserved_for_draft_model_methods():
    s = make_scheduler(block_size=4, speculative_config=SpeculativeConfig(num_speculative_tokens=4, method="eagle"))
    assert s.num_lookahead_tokens == 4
    s.add_request(make_request("a", 8, max_tokens=5))
    so = s.schedule()
    # 8 tokens + 4 lookahead slots: 3 blocks instead of 2.
    assert len(so.scheduled_new_reqs[0].block_ids) == 3
    ngram = make_scheduler(speculative_config=SpeculativeConfig(num_speculative_tokens=4))
    assert ngram.num_lookahead_tokens == 0
