"""SeededStreams: a seeded request's generator goes back to where the first
discarded step found it, and nowhere else (runner/seeded_streams.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from cadence.runner.seeded_streams import KEPT_NOTES, SeededStreams


def draws(generator: torch.Generator, n: int = 3) -> list[float]:
    return torch.rand(n, generator=generator).tolist()


def step(streams: SeededStreams, requests: dict, sampled: dict[str, int]) -> None:
    """One step: notes, then each request in ``sampled`` draws and gains that many tokens."""
    streams.note_step(dict.fromkeys(sampled, 1), requests)
    for req_id, num_tokens in sampled.items():
        draws(requests[req_id].generator)
        requests[req_id].output_token_ids.extend([0] * num_tokens)


def setup(*req_ids: str) -> tuple[SeededStreams, dict, dict[str, torch.Generator]]:
    """Streams of seeded requests (runner states with no tokens yet), and their generators."""
    streams, requests = SeededStreams(), {}
    for seed, req_id in enumerate(req_ids):
        requests[req_id] = SimpleNamespace(output_token_ids=[], generator=torch.Generator().manual_seed(seed))
        streams.track(req_id, requests[req_id].generator)
    return streams, requests, {req_id: state.generator for req_id, state in requests.items()}


def test_a_request_sent_back_to_a_noted_count_draws_again_what_it_drew_there():
    streams, requests, generators = setup("a", "b")
    step(streams, requests, {"a": 0, "b": 0})  # prompt chunks: nothing sampled, yet drawn here
    step(streams, requests, {"a": 1, "b": 1})
    state_at_1 = generators["a"].get_state()
    expected = draws(torch.Generator().set_state(state_at_1))
    step(streams, requests, {"a": 1, "b": 1})  # the step that failed, after it sampled
    step(streams, requests, {"a": 1})  # async: the one in flight behind it
    streams.rewind("a", 1)  # sent anew with the one token it had before them
    assert draws(generators["a"]) == expected


def test_a_preempted_request_keeps_its_stream_as_it_is():
    streams, requests, generators = setup("a")
    for _ in range(3):
        step(streams, requests, {"a": 1})
    state = generators["a"].get_state()
    streams.rewind("a", 3)  # the tokens it sampled: past every note
    assert torch.equal(generators["a"].get_state(), state)
    streams.rewind("a", 7)  # (a count no step began at)
    assert torch.equal(generators["a"].get_state(), state)


def test_one_note_per_count_and_at_most_kept_notes():
    streams, requests, generators = setup("a")
    step(streams, requests, {"a": 0})
    step(streams, requests, {"a": 0})  # a second chunk of the prompt: the note is the newer state
    assert [count for count, _ in streams._notes["a"]] == [0]
    for _ in range(KEPT_NOTES + 2):
        step(streams, requests, {"a": 1})
    assert [count for count, _ in streams._notes["a"]] == list(range(2, 2 + KEPT_NOTES))
    state = generators["a"].get_state()
    streams.rewind("a", 0)  # older than the notes kept: left as it is
    assert torch.equal(generators["a"].get_state(), state)


def test_only_the_steps_requests_are_noted_and_a_finished_one_is_forgotten():
    streams, requests, generators = setup("a", "b")
    step(streams, requests, {"a": 1})
    assert set(streams._notes) == {"a"}
    streams.forget("a")
    assert len(streams) == 1 and "a" not in streams._notes
    streams.rewind("a", 0)  # nothing to rewind: no error
