"""The OpenAI API of ``cadence serve`` through the official ``openai`` client:
chat and completions, streamed and not, ``n``, logprobs, stop strings, seeds,
usage, 32 concurrent streams, disconnect aborts, bad input, /metrics."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.server.serverlib import wait_until

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The sky is"
CHAT = [{"role": "user", "content": "Say hello."}]
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(make_server):
    return make_server("api")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def tokenize(server, **body) -> list[int]:
    return httpx.post(f"{server.base_url}/tokenize", json=body, timeout=30).json()["tokens"]


# ------------------------------------------------------------------ basics


def test_health_and_models(server, client):
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_chat_completion(server, client):
    response = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6,
                                              temperature=0, extra_body=NO_EOS)
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason == "length"
    assert response.usage.completion_tokens == 6
    assert response.usage.prompt_tokens == len(tokenize(server, messages=CHAT))
    assert response.usage.total_tokens == response.usage.prompt_tokens + 6


def test_completion_and_stream_agree(server, client):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == plain.usage.completion_tokens
    assert usage.prompt_tokens == plain.usage.prompt_tokens == len(tokenize(server, prompt=PROMPT))


def test_chat_stream_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=NO_EOS)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0,
                                           extra_body=NO_EOS)
    assert content == plain.choices[0].message.content
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].usage.completion_tokens == 5


def test_token_id_prompt_and_max_completion_tokens(server, client):
    ids = tokenize(server, prompt=PROMPT)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=3,
                                          temperature=0, extra_body=NO_EOS)
    assert chat.usage.completion_tokens == 3


# ------------------------------------------------------------------ sampling


def test_n_two(client):
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=2,
                                         temperature=1.0, seed=3, extra_body=NO_EOS)
    assert sorted(c.index for c in response.choices) == [0, 1]
    assert response.usage.completion_tokens == 8
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, n=2,
                                            stream=True, extra_body=NO_EOS)
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in stream
                if c.choices and c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length"}


def test_batch_of_prompts(client):
    prompts = [PROMPT, "Once upon a time"]
    response = client.completions.create(model=MODEL, prompt=prompts, max_tokens=3, n=2,
                                         temperature=0, extra_body=NO_EOS)
    assert sorted(c.index for c in response.choices) == [0, 1, 2, 3]
    assert response.usage.completion_tokens == 12
    alone = client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=3, temperature=0,
                                      extra_body=NO_EOS).choices[0].text
    assert {c.index: c.text for c in response.choices}[2] == alone
    stream = client.completions.create(model=MODEL, prompt=prompts, max_tokens=3, temperature=0,
                                       stream=True, extra_body=NO_EOS)
    texts: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts[1] == alone


def test_seed_repeats(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, top_p=0.9,
                  presence_penalty=0.5, frequency_penalty=0.5)
    first = client.completions.create(seed=1234, **kwargs).choices[0].text
    second = client.completions.create(seed=1234, **kwargs).choices[0].text
    assert first == second


def test_stop_string(client):
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                       extra_body=NO_EOS).choices[0].text
    words = greedy.split()
    stop = words[len(words) // 2]
    expected = greedy[: greedy.index(stop)]
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                      stop=[stop], extra_body=NO_EOS)
    assert plain.choices[0].text == expected
    assert plain.choices[0].finish_reason == "stop"
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                       stop=stop, stream=True, extra_body=NO_EOS)
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_logprobs(client):
    response = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                              temperature=0, logprobs=True, top_logprobs=3,
                                              extra_body=NO_EOS)
    content = response.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert item.logprob <= 0.0
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].token == item.token  # greedy picks the best
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token
    assert "".join(i.token for i in content) == response.choices[0].message.content
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0,
                                            logprobs=True, top_logprobs=1, stream=True,
                                            extra_body=NO_EOS)
    streamed = [i for c in stream if c.choices and c.choices[0].logprobs
                for i in c.choices[0].logprobs.content]
    assert [i.token for i in streamed] == [i.token for i in content]


def test_completion_logprobs(client):
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                         logprobs=2, extra_body=NO_EOS)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    assert "".join(logprobs.tokens) == response.choices[0].text
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert value <= 0.0 and len(top) >= 2 and top[token] == value
    assert logprobs.text_offset[0] == 0


# ------------------------------------------------------------------ load


def test_32_concurrent_streams(server):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, object]:
        stream = await client.completions.create(
            model=MODEL, prompt=f"Count to {i}:", max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=NO_EOS)
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage:
                usage = chunk.usage
        return text, usage

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused",
                                      max_retries=0, timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(main())
    assert len(results) == 32
    for i, (text, usage) in enumerate(results):
        assert usage.completion_tokens == 6
        assert usage.prompt_tokens == len(tokenize(server, prompt=f"Count to {i}:"))
        assert text
    assert wait_until(lambda: server.metrics()["cadence:num_requests_running"] == 0, 30)


def num_aborted(server) -> float:
    return server.metrics('finished_reason="abort"').get("cadence:request_success_total", 0.0)


def test_disconnect_aborts_and_frees_blocks(server, client):
    aborted = num_aborted(server)
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1500, temperature=0,
                                       stream=True, extra_body=NO_EOS)
    received = 0
    for chunk in stream:
        received += 1
        if received == 3:
            break
    metrics = server.metrics()
    assert metrics["cadence:num_requests_running"] == 1
    assert metrics["cadence:kv_cache_usage_perc"] > 0
    stream.close()  # the client goes away mid-stream
    assert wait_until(lambda: server.metrics()["cadence:kv_cache_usage_perc"] == 0.0, 60), \
        server.metrics()
    assert server.metrics()["cadence:num_requests_running"] == 0
    assert num_aborted(server) == aborted + 1


def test_disconnect_aborts_a_request_that_is_not_streamed(server):
    aborted = num_aborted(server)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1900, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):  # the client gives up and closes the connection
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=2.0)
    assert wait_until(lambda: num_aborted(server) == aborted + 1, 30)
    assert wait_until(lambda: server.metrics()["cadence:kv_cache_usage_perc"] == 0.0, 30)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(n=0), "n"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(logprobs=99), "logprobs"),
    (dict(temperature="hot"), "temperature"),
    (dict(extra_body={"stop": [""]}), "stop"),
])
def test_invalid_completion_params(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROMPT, **kwargs)
    assert err.value.status_code == 400
    assert err.value.param == param
    assert err.value.body["message"].startswith(param)


@pytest.mark.parametrize("kwargs, param", [
    (dict(top_logprobs=2), "top_logprobs"),
    (dict(logprobs=True, top_logprobs=50), "top_logprobs"),
    (dict(max_completion_tokens=-5), "max_completion_tokens"),
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages.0.role"),
])
def test_invalid_chat_params(client, kwargs, param):
    kwargs = {"messages": CHAT, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, **kwargs)
    assert err.value.param == param


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("kwargs, param", [
    (dict(logit_bias={"42": 100}), "logit_bias"),
    (dict(extra_body={"guided_decoding_backend": "xgrammar"}), "guided_decoding_backend"),
    (dict(extra_body={"use_beam_search": True}), "use_beam_search"),
    (dict(extra_body={"chat_template": "{{ messages }}"}), "chat_template"),
    (dict(extra_body={"priority": 3}), "priority"),  # the server runs fcfs: a priority would be ignored
    # No KV connector reads them here (prefill/decode disaggregation needs --kv-transfer-config).
    (dict(extra_body={"kv_transfer_params": {"do_remote_decode": True}}), "kv_transfer_params"),
])
def test_options_that_would_do_nothing_are_refused(client, kwargs, param):
    kwargs = {"messages": CHAT, "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, **kwargs)
    assert err.value.param == param
    assert any(why in err.value.message
               for why in ("not supported", "--policy priority", "--kv-transfer-config"))
    # The neutral values ask for nothing and pass; the server goes on serving
    # (greedy: two sampled tokens at temperature 1 may decode to no text).
    ok = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, logit_bias={},
                                        tools=[TOOL], tool_choice="none", temperature=0,
                                        extra_body={"use_beam_search": False, "priority": 0})
    assert ok.choices[0].message.content and not ok.choices[0].message.tool_calls


def test_completion_refuses_logit_bias(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, logit_bias={"7": -100})
    assert err.value.param == "logit_bias"


def test_malformed_json_and_missing_fields(server):
    response = httpx.post(f"{server.base_url}/v1/chat/completions", content=b'{"model": "x", ',
                          headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 400
    assert "malformed JSON" in response.json()["error"]["message"]
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json={"model": MODEL}, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages"
    response = httpx.post(f"{server.base_url}/v1/completions", json=[1, 2], timeout=30)
    assert response.status_code == 400


def test_prompt_longer_than_context(server, client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=[100] * 2100, max_tokens=4)
    assert err.value.param == "prompt" and "2048" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, max_tokens=4,
                                       messages=[{"role": "user", "content": "word " * 2100}])
    assert err.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=[10**9], max_tokens=4)
    assert err.value.param == "prompt"


def test_unknown_model(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-9", messages=CHAT, max_tokens=2)
    assert err.value.status_code == 404 and err.value.param == "model"


def test_bad_requests_leave_the_engine_healthy(server, client):
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert response.usage.completion_tokens >= 1
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    assert wait_until(lambda: server.metrics()["cadence:kv_cache_usage_perc"] == 0.0, 30)


# ------------------------------------------------------------------ tokenizer, metrics


def test_tokenize_detokenize(server):
    tokens = tokenize(server, prompt="Hello world", add_special_tokens=False)
    assert tokens
    text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": tokens}, timeout=30).json()
    assert text["prompt"] == "Hello world"
    bad = httpx.post(f"{server.base_url}/detokenize", json={"tokens": [-1]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_reset_prefix_cache(server):
    response = httpx.post(f"{server.base_url}/reset_prefix_cache", timeout=30)
    assert response.status_code == 200 and response.json() == {"reset": True}


def test_metrics_move(server, client):
    before = server.metrics()
    client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0,
                              extra_body=NO_EOS)
    after = server.metrics()
    assert after["cadence:generation_tokens_total"] - before["cadence:generation_tokens_total"] == 5
    assert after["cadence:prompt_tokens_total"] > before["cadence:prompt_tokens_total"]
    for name in ("cadence:time_to_first_token_seconds_count", "cadence:e2e_request_latency_seconds_count"):
        assert after[name] == before[name] + 1
    assert after["cadence:time_per_output_token_seconds_count"] > before["cadence:time_per_output_token_seconds_count"]
    assert after["cadence:prefix_cache_queries_total"] > before["cadence:prefix_cache_queries_total"]
    for name in ("cadence:num_requests_running", "cadence:num_requests_waiting",
                 "cadence:kv_cache_usage_perc", "cadence:prefix_cache_hits_total",
                 "cadence:num_preemptions_total", "cadence:prefix_cache_hit_rate"):
        assert name in after
    # cadence serve bounds its batch by step time (its default): the seats it gives now
    assert 1 <= after["cadence:running_seats"] <= 256


def test_bench_serve_against_the_server(server):
    from cadence.server.bench import format_report, run
    from cadence.server.cli import build_parser

    args = build_parser().parse_args([
        "bench", "serve", "--base-url", server.base_url, "--num-prompts", "4", "--rate", "inf",
        "--synthetic", "--input-len", "16", "--output-len", "4"])
    summary = asyncio.run(run(args))
    assert summary["completed"] == 4 and summary["failed"] == 0
    assert summary["output_tokens"] == 16
    assert summary["ttft_s"]["median"] > 0 and summary["e2e_s"]["p99"] >= summary["ttft_s"]["p99"]
    assert "TTFT" in format_report(summary)
    json.dumps(summary)
