"""/v1/completions with ``echo`` and ``logprobs``, and vLLM's ``prompt_logprobs``
(issue 35 item 7), through the ``openai`` client: the prompt's tokens come
first with their logprobs, the first one null as in OpenAI and vLLM."""

import httpx
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def server(make_server):
    return make_server("echo")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def prompt_ids(server, text=PROMPT):
    return httpx.post(f"{server.base_url}/tokenize", json={"prompt": text}, timeout=60).json()["tokens"]


def test_echo_puts_the_prompt_and_its_logprobs_first(server, client):
    ids = prompt_ids(server)
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                         echo=True, logprobs=2)
    choice = response.choices[0]
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 4
    assert "".join(lp.tokens[:len(ids)]) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[token] == value and 2 <= len(top) <= 3  # the top 2, and the token itself
    offsets = lp.text_offset
    assert offsets[0] == 0 and offsets[len(ids)] == len(PROMPT)
    assert all(offsets[i + 1] == offsets[i] + len(lp.tokens[i]) for i in range(len(offsets) - 1))
    # The completion's part is what the same request without echo answers.
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                      logprobs=2).choices[0]
    assert choice.text == PROMPT + plain.text
    assert lp.tokens[len(ids):] == plain.logprobs.tokens
    assert lp.token_logprobs[len(ids):] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-4)


def test_echo_without_logprobs_and_from_token_ids(server, client):
    ids = prompt_ids(server)
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                     echo=True).choices[0]
    assert text.text.startswith(PROMPT) and text.logprobs is None
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0,
                                       echo=True).choices[0]
    assert by_ids.text == text.text


def test_streamed_echo_equals_the_whole_answer(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                      echo=True, logprobs=1).choices[0]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                            echo=True, logprobs=1, stream=True))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.tokens]
    assert tokens == whole.logprobs.tokens


def test_prompt_logprobs_field(server, client):
    ids = prompt_ids(server)
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                       echo=True, logprobs=1).choices[0].logprobs
    response = httpx.post(f"{server.base_url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2})
    rows = response.json()["choices"][0]["prompt_logprobs"]
    assert len(rows) == len(ids) and rows[0] is None
    for token, row, value in zip(ids[1:], rows[1:], echoed.token_logprobs[1:]):
        assert row[str(token)]["logprob"] == pytest.approx(value, abs=1e-4)
        assert sum(1 for entry in row.values() if entry["rank"] <= 2) == 2
    refused = httpx.post(f"{server.base_url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 21})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"
    chat = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 1})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "prompt_logprobs"


def test_a_cached_prompt_is_scored_whole(client):
    long_prompt = PROMPT + " Rome. " * 20  # several KV blocks
    for _ in range(2):  # the second finds the prompt's blocks in the prefix cache
        cached = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=1)
    assert cached.usage.prompt_tokens_details.cached_tokens > 0
    echoed = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=1, echo=True,
                                       logprobs=0)
    assert echoed.usage.prompt_tokens_details is None  # no hit: every position computed
    assert all(v is not None for v in echoed.choices[0].logprobs.token_logprobs[1:])


def test_echo_with_max_tokens_0_scores_the_prompt_alone(server, client):
    ids = prompt_ids(server)
    for stream in (False, True):
        response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True,
                                             logprobs=1, stream=stream)
        chunks = list(response) if stream else [response]
        choices = [c.choices[0] for c in chunks if c.choices]
        assert "".join(c.text for c in choices) == PROMPT
        tokens = [t for c in choices if c.logprobs for t in c.logprobs.tokens]
        assert len(tokens) == len(ids) and "".join(tokens) == PROMPT
        if not stream:
            assert response.usage.completion_tokens == 0
            assert response.usage.total_tokens == response.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)  # no echo: nothing asked
