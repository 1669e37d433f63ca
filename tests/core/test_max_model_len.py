"""No request goes past max_model_len."""

import pytest

from tests.core.scheduler_sim import ModelRunnerSim, make_request, make_scheduler, run_to_completion, step
from cadence.core.request import FinishReason


def test_generation_stops_at_max_model_len():
    s = make_scheduler(max_model_len=20)
    s.add_request(make_request("a", 15, max_tokens=100))
    runner = ModelRunnerSim(4)
    tokens, finish = [], None
    while s.has_requests():
        so, outputs = step(s, runner)
        for out in outputs:
            tokens += out.new_token_ids
            finish = out.finish_reason
        assert all(s.requests[r].num_computed_tokens < 20 for r in so.num_scheduled_tokens if r in s.requests)
    assert len(tokens) == 5 and finish == FinishReason.LENGTH


def test_prompt_that_fills_the_context_is_rejected():
    s = make_scheduler(max_model_len=16)
    with pytest.raises(ValueError, match="^prompt"):
        s.add_request(make_request("a", 16))
    with pytest.raises(ValueError, match="^prompt"):
        s.add_request(make_request("b", []))
    assert not s.has_requests()


def test_request_max_tokens_capped_by_context_when_given():
    from cadence.core.request import Request
    from cadence.sampling_params import SamplingParams
    req = Request("a", [1] * 10, SamplingParams(max_tokens=None), max_model_len=16)
    assert req.max_tokens == 6


def test_drafts_never_schedule_past_max_model_len():
    from cadence.config import SpeculativeConfig
    s = make_scheduler(max_model_len=12, speculative_config=SpeculativeConfig(num_speculative_tokens=4))
    s.add_request(make_request("a", 8, max_tokens=50))
    runner = ModelRunnerSim(4, draft_fn=lambda req_id, toks: [1, 2, 3, 4])
    streams = run_to_completion(s, runner)
    assert len(streams["a"]) == 4
