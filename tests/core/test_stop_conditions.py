"""eos, stop_token_ids, max_tokens, min_tokens, ignore_eos."""

from tests.core.scheduler_sim import ModelRunnerSim, make_request, make_scheduler, run_to_completion
from cadence.core.request import FinishReason, RequestStatus


def scripted(tokens):
    """A runner whose n-th sampled token of every request is tokens[n]."""
    counts = {}

    def token_fn(seq):
        key = seq[0]
        n = counts.get(key, 0)
        counts[key] = n + 1
        return tokens[n]

    return token_fn


def run_with_outputs(req, tokens):
    s = make_scheduler()
    s.add_request(req)
    runner = ModelRunnerSim(4, token_fn=scripted(tokens))
    final = {}
    streams = {}
    from tests.core.scheduler_sim import step
    while s.has_requests():
        _, outputs = step(s, runner)
        for out in outputs:
            streams.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                final[out.request_id] = (out.finish_reason, out.stop_reason)
    return streams[req.request_id], final[req.request_id], req


def test_eos_stops_and_is_emitted():
    tokens, (reason, stop_reason), req = run_with_outputs(
        make_request("a", 5, max_tokens=10, eos_token_id=2), [5, 6, 2, 7])
    assert tokens == [5, 6, 2] and reason == FinishReason.STOP and stop_reason is None
    assert req.status == RequestStatus.FINISHED_STOPPED


def test_ignore_eos_keeps_going_to_max_tokens():
    req = make_request("a", 5, max_tokens=4, eos_token_id=2, ignore_eos=True)
    tokens, (reason, _), _ = run_with_outputs(req, [5, 2, 2, 7, 8])
    assert tokens == [5, 2, 2, 7] and reason == FinishReason.LENGTH


def test_stop_token_ids_set_stop_reason():
    req = make_request("a", 5, max_tokens=10, stop_token_ids=[9, 11])
    tokens, (reason, stop_reason), _ = run_with_outputs(req, [5, 6, 11, 7])
    assert tokens == [5, 6, 11] and reason == FinishReason.STOP and stop_reason == 11


def test_max_tokens_caps_length():
    tokens, (reason, _), _ = run_with_outputs(make_request("a", 5, max_tokens=3), [4, 4, 4, 4, 4])
    assert tokens == [4, 4, 4] and reason == FinishReason.LENGTH


def test_min_tokens_holds_back_eos_and_stop_tokens():
    req = make_request("a", 5, max_tokens=10, eos_token_id=2, min_tokens=3, stop_token_ids=[9])
    tokens, (reason, _), _ = run_with_outputs(req, [2, 9, 2, 2, 5])
    assert tokens == [2, 9, 2] and reason == FinishReason.STOP  # 3rd token may stop


def test_stop_inside_accepted_drafts_truncates_the_output():
    from cadence.config import SpeculativeConfig
    s = make_scheduler(speculative_config=SpeculativeConfig(num_speculative_tokens=3))
    req = make_request("a", 5, max_tokens=20, stop_token_ids=[555])
    s.add_request(req)
    # Every draft is accepted (the drafter predicts the model exactly), and the
    # model emits 555 as its 3rd token: the request must stop right there.
    seq_tokens = [11, 12, 555, 13, 14, 15, 16]

    def token_fn(seq):
        return seq_tokens[len(seq) - 5]

    runner = ModelRunnerSim(4, token_fn=token_fn,
                            draft_fn=lambda rid, toks: seq_tokens[len(toks) - 5:len(toks) - 2])
    streams = run_to_completion(s, runner)
    assert streams["a"] == [11, 12, 555]
    assert req.stop_reason == 555
