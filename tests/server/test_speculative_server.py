"""Speculative decoding behind the server: greedy answers equal a server
without it (streamed and whole, with logprobs for every token), and
/metrics counts drafts and their acceptance."""

from __future__ import annotations

import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
PARAGRAPH = ("Our team meets every Monday at nine to plan the week. We review the open tickets, "
             "agree on priorities and assign each task to one person.")
MESSAGES = [{"role": "user", "content": f'Rewrite this, changing "Monday" to "Tuesday":\n\n{PARAGRAPH}'}]


@pytest.fixture(scope="module")
def servers(make_server):
    return make_server("plain"), make_server("speculative", ["--num-speculative-tokens", "3"])


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_greedy_answers_equal_a_server_without_speculation(servers):
    plain, speculative = servers
    kwargs = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=60, logprobs=True,
                  top_logprobs=1)
    want = client_of(plain).chat.completions.create(**kwargs).choices[0]
    have = client_of(speculative).chat.completions.create(**kwargs).choices[0]
    assert have.message.content == want.message.content
    assert [t.token for t in have.logprobs.content] == [t.token for t in want.logprobs.content]
    for mine, theirs in zip(have.logprobs.content, want.logprobs.content):
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-3)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client_of(speculative).chat.completions.create(
        stream=True, **{k: v for k, v in kwargs.items() if k not in ("logprobs", "top_logprobs")})
        if chunk.choices)
    assert streamed == want.message.content
    metrics = speculative.metrics()
    assert metrics["cadence:spec_decode_num_drafts_total"] > 0
    assert metrics["cadence:spec_decode_num_accepted_tokens_total"] > 0
    assert 0 < metrics["cadence:spec_decode_acceptance_rate"] <= 1
    assert metrics["cadence:spec_decode_mean_acceptance_length"] > 1
    assert plain.metrics().get("cadence:spec_decode_num_drafts_total", 0) == 0
