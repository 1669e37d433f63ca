"""Speculative decoding through ``LLM`` on the default model: greedy output
with n-gram drafts equals greedy output without, every accepted token gets
its logprobs, and the engine's stats report acceptance."""

from __future__ import annotations

import pytest

from cadence import LLM, SamplingParams

PARAGRAPH = ("The old lighthouse stood on the northern cliff for more than a century, guiding "
             "fishing boats home through fog and storms.")
REPEAT = [{"role": "user", "content": f'Rewrite this, changing "northern" to "southern":\n\n{PARAGRAPH}'}]
OPEN = [{"role": "user", "content": "Why do cats sleep so much?"}]


def engine(**options) -> LLM:
    # A float32 cache: verification rows and decode rows take different product paths
    # (~1e-5 apart), which a float16 cache's rounding can carry past the 1e-3 compared here.
    return LLM(dtype="float32", kv_cache_dtype="float32", max_num_seqs=8, kv_cache_memory="128MiB",
               max_model_len=512, **options)


@pytest.fixture(scope="module")
def llms():
    return engine(), engine(num_speculative_tokens=3, draft_acceptance_floor=0.0)


def test_greedy_output_with_speculation_equals_without(llms):
    plain, speculative = llms
    params = SamplingParams(temperature=0, max_tokens=60, logprobs=2)
    conversations = [REPEAT, OPEN, REPEAT]
    expected = plain.chat(conversations, params, use_tqdm=False)
    speculative.spec_decoding_stats = None
    got = speculative.chat(conversations, params, use_tqdm=False)
    for want, have in zip(expected, got):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        # A logprobs row for every token, drafted or not, and the same values.
        rows = have.outputs[0].logprobs
        assert len(rows) == len(have.outputs[0].token_ids)
        for token, row, want_row in zip(have.outputs[0].token_ids, rows, want.outputs[0].logprobs):
            assert row[token].logprob == pytest.approx(want_row[token].logprob, abs=1e-3)
            assert row[token].rank == 1
    stats = speculative.spec_decoding_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert 0 < stats.acceptance_rate <= 1
    assert stats.mean_acceptance_length > 1.5  # the rewrite repeats the prompt


def test_a_floor_stops_drafting_what_the_drafter_cannot_guess():
    """A request whose drafts fail drafts less under an acceptance floor than
    with none, and answers the same. (The default floor is measured from step
    times, so it is tested on its own in tests/runner/test_draft_gate.py.)"""
    always, adaptive = llms_pair = (engine(num_speculative_tokens=3, draft_acceptance_floor=0.0),
                                    engine(num_speculative_tokens=3, draft_acceptance_floor=0.3))
    params = SamplingParams(temperature=0, max_tokens=80)
    outputs = []
    for llm in llms_pair:
        llm.spec_decoding_stats = None
        outputs.append(llm.chat([OPEN], params, use_tqdm=False)[0].outputs[0].token_ids)
    assert outputs[0] == outputs[1]
    always_stats, adaptive_stats = always.spec_decoding_stats, adaptive.spec_decoding_stats
    assert always_stats is not None and always_stats.acceptance_rate < 0.3
    assert adaptive_stats is None or adaptive_stats.num_draft_tokens < always_stats.num_draft_tokens
