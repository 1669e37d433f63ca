"""Issue 18's requests, sent as they were: none locks, freezes or crashes the
server. Each gets a clear 4xx naming its field (OpenAI's error shape), and the
next request, on the same keep-alive connection, is served. One small server:
4 running slots, 4 queued, --max-n 12 (so n 9..12 is never admissible)."""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import time

import httpx
import openai
import pytest

from cadence.engine.async_llm import AsyncLLM, load_tokenizer
from cadence.engine.output_processor import OutputProcessor
from cadence.engine.wire import EngineReady
from cadence.models.chat_template import _environment, render_chat_template
from cadence.models.tokenizer import Tokenizer
from cadence.sampling_params import SamplingParams
from cadence.server.protocol import RESERVED_TEMPLATE_KWARGS

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Say hello."}]
CAPACITY = 8  # --max-num-seqs 4 + --max-num-queued-requests 4
FRONTEND_GAUGES = ("cadence:frontend_open_requests", "cadence:frontend_unfinished_seqs",
                   "cadence:frontend_output_requests", "cadence:frontend_output_routes")


@pytest.fixture(scope="module")
def server(make_server):
    return make_server("hardening", ["--max-num-seqs", "4", "--max-num-queued-requests", "4",
                                     "--max-n", "12"])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture
def http(server):
    """One keep-alive connection for a bad request and the good one after it."""
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        yield http


def post_raw(http: httpx.Client, path: str, body: bytes) -> httpx.Response:
    return http.post(path, content=body, headers={"Content-Type": "application/json"})


def assert_error(response: httpx.Response, status: int, param: str) -> str:
    """The OpenAI error shape, naming ``param``; the connection stays open."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"].startswith(f"{param}: ")
    assert error["type"] == "invalid_request_error" and error["code"] == status
    assert response.headers.get("connection") != "close"
    return error["message"]


def assert_still_serves(http: httpx.Client) -> None:
    """A normal request, on the same connection, is served (not 429, not reset)."""
    body = {"model": MODEL, "prompt": "The sky is", "max_tokens": 2, "temperature": 0}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


def frontend_gauges(server) -> dict[str, float]:
    metrics = server.metrics()
    return {name: metrics[name] for name in FRONTEND_GAUGES}


# ------------------------------------------------------------------ finding 1: the lock-out


@pytest.mark.parametrize("body, param", [
    # The exact request of the issue: 500, then 429 for everyone until a restart.
    (b'{"prompt":"hi","max_tokens":1,"n":1280,"seed":18446744073709551616}', "n"),
    (b'{"prompt":"hi","max_tokens":1,"seed":18446744073709551616}', "seed"),
    (b'{"prompt":"hi","max_tokens":1,"seed":-1}', "seed"),
    (b'{"prompt":"hi","max_tokens":1,"n":2,"seed":18446744073709551615}', "seed"),  # seed + 1 overflows
    (b'{"prompt":"hi","max_tokens":1,"priority":1000000000000000000000000000000}', "priority"),
    (b'{"prompt":"hi","max_tokens":1,"top_k":100000000000000000000000}', "top_k"),
])
def test_out_of_range_integers_are_400s_that_take_nothing(server, http, body, param):
    for _ in range(CAPACITY + 1):  # a leak of even one sequence each would fill the queue
        assert_error(post_raw(http, "/v1/completions", body), 400, param)
    assert frontend_gauges(server) == dict.fromkeys(FRONTEND_GAUGES, 0.0)
    assert_still_serves(http)


@pytest.fixture
def detached_llm():
    """An AsyncLLM with a faked handshake (no engine process) and a socket that fails."""

    class FailingSocket:
        def send_multipart(self, frames, copy=True):
            raise OverflowError("int too big to convert")  # what msgpack raised in the issue

    llm = AsyncLLM(max_num_queued_requests=4)
    tokenizer = load_tokenizer(None)
    llm.tokenizer = tokenizer
    llm.info = EngineReady(model_name=MODEL, max_model_len=64, vocab_size=tokenizer.vocab_size,
                           max_num_seqs=2, num_kv_blocks=16, block_size=16)
    llm._processor = OutputProcessor(tokenizer)
    real_socket, llm._input = llm._input, FailingSocket()
    yield llm
    llm._input = real_socket
    asyncio.run(llm.shutdown())


def test_a_failed_send_gives_back_everything(detached_llm):
    llm = detached_llm
    for i in range(llm.seq_capacity + 1):
        with pytest.raises(OverflowError):
            llm.add_request(f"r{i}", [1, 2, 3], SamplingParams(n=3, max_tokens=4))
        assert llm.frontend_state().is_idle, llm.frontend_state()
    with pytest.raises(ValueError, match="^priority: "):
        llm.add_request("p", [1, 2, 3], SamplingParams(max_tokens=4), priority=10**30)
    assert llm.frontend_state().is_idle

    sent = []
    llm._input = type("RecordingSocket", (), {"send_multipart": lambda self, f, copy=True: sent.append(f)})()
    stream = llm.add_request("ok", [1, 2, 3], SamplingParams(n=3, max_tokens=4))
    state = llm.frontend_state()
    assert (state.open_requests, state.unfinished_seqs, state.output_requests) == (1, 3, 1)
    assert state.output_routes == 4  # the parent and its three children
    stream.close()  # aborts it
    assert llm.frontend_state().is_idle and len(sent) == 2  # the add and the abort


# ------------------------------------------------------------------ finding 3: 500s that were 400s


TEMPLATE_KEYS = ["add_generation_prompt", "template", "bos_token", "messages", "tools", "eos_token"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions",
     b'{"messages":[{"role":"user","content":"hi \\ud800"}],"max_tokens":2}', "messages.0.content"),
    ("/v1/chat/completions",
     b'{"messages":[{"role":"user","content":[{"type":"text","text":"\\udfff"}]}]}',
     "messages.0.content.0.text"),
    ("/v1/completions", b'{"prompt":"hi \\ud800","max_tokens":2}', "prompt"),
    ("/v1/completions", b'{"prompt":["ok","\\ud800"],"max_tokens":2}', "prompt.1"),
    ("/v1/completions", b'{"prompt":"hi","stop":["\\ud800"],"max_tokens":2}', "stop.0"),
    ("/tokenize", b'{"prompt":"hi \\ud800"}', "prompt"),
    ("/v1/chat/completions", b'{"messages":[{"role":"user"}],"max_tokens":2}', "messages.0.content"),
    ("/v1/chat/completions",
     b'{"messages":[{"role":"system","content":"x"},{"role":"user","content":null}]}',
     "messages.1.content"),
    ("/tokenize", b'{"messages":[{"role":"user"}]}', "messages.0.content"),
    *[("/v1/chat/completions",
       json.dumps({"messages": CHAT, "max_tokens": 2, "chat_template_kwargs": {key: True}}).encode(),
       "chat_template_kwargs") for key in TEMPLATE_KEYS],
    ("/v1/completions", b'{"prompt":"hi","max_tokens":2,"seed":99999999999999999999999}', "seed"),
])
def test_client_errors_are_400s_on_a_connection_that_stays_usable(http, path, body, param):
    assert_error(post_raw(http, path, body), 400, param)
    assert_still_serves(http)


def test_an_assistant_turn_without_content_is_served(http):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant"},
                {"role": "user", "content": "Say hello."}]
    response = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert response.status_code == 200, response.text


def test_template_kwargs_that_do_not_collide_still_reach_the_template(http):
    body = {"messages": CHAT, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}}
    assert http.post("/v1/chat/completions", json=body).status_code == 200


def test_reserved_template_kwargs_cover_what_the_renderer_sets():
    """Every name the renderer passes itself must be refused as a kwarg (else: a 500)."""
    own = set(inspect.signature(render_chat_template).parameters)
    own |= set(inspect.signature(Tokenizer.apply_chat_template).parameters)
    own |= set(_environment().globals)
    own -= {"extra"}  # the **kwargs themselves
    assert own <= RESERVED_TEMPLATE_KWARGS, own - RESERVED_TEMPLATE_KWARGS


# ------------------------------------------------------------------ finding 5: limits


@pytest.mark.parametrize("fields, param, words", [
    ('"n":13', "n", "--max-n"),
    (f'"n":{CAPACITY + 1}', "n", "can never be admitted"),  # was 429 "retry later", forever
    ('"n":5,"prompt":["a","b"]', "n", "can never be admitted"),  # 2 prompts x 5
    ('"temperature":Infinity', "temperature", "finite"),  # JSON as Python's json module writes it
    ('"temperature":1e308', "temperature", "<= 100"),
    ('"repetition_penalty":"inf"', "repetition_penalty", "finite"),
    ('"top_p":NaN', "top_p", "finite"),
    ('"max_tokens":5000', "max_tokens", "maximum context length is 2048 tokens"),
])
def test_limits_are_400s(http, fields, param, words):
    body = f'{{"prompt":"The sky is","max_tokens":2,{fields}}}'.encode()
    assert words in assert_error(post_raw(http, "/v1/completions", body), 400, param)
    assert_still_serves(http)


def test_max_tokens_beyond_the_context_says_how_much_room_there_is(client):
    prompt = [100] * 2040  # 8 tokens of room in the 2048-token context
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=9)
    assert err.value.body["message"] == (
        "max_tokens: This model's maximum context length is 2048 tokens. However, you requested "
        "2049 tokens (2040 in the prompt, 9 in the completion). Please reduce the length of the "
        "prompt or completion: at most 8 completion tokens fit.")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=4000)
    assert err.value.param == "max_completion_tokens" and "in the messages" in err.value.message
    # Exactly the room left is served, all of it (it was cut short silently before).
    fits = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                     extra_body={"ignore_eos": True})
    assert fits.usage.completion_tokens == 8


def test_n_up_to_the_capacity_is_served(client):
    response = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=2,
                                         n=CAPACITY, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in response.choices) == list(range(CAPACITY))


# ------------------------------------------------------------------ finding 2: off the event loop


def big_requests() -> list[tuple[str, dict]]:
    text = "All work and no play makes Jack a dull boy. " * 45_000  # ~2 MB, ~500k tokens
    return [
        ("/tokenize", {"prompt": text}),
        ("/v1/completions", {"prompt": text, "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 2}),
    ]


def test_health_answers_while_a_large_prompt_is_tokenized(server):
    statuses: list[tuple[str, int, str]] = []

    def send_big() -> None:
        with httpx.Client(base_url=server.base_url, timeout=300) as http:
            for path, body in big_requests():
                response = http.post(path, json=body)
                statuses.append((path, response.status_code, response.text[:200]))

    sender = threading.Thread(target=send_big)
    sender.start()
    latencies = []
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        while sender.is_alive():
            start = time.monotonic()
            assert http.get("/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.05)
    sender.join()
    assert len(latencies) >= 5, "the large requests finished too fast to watch /health"
    assert max(latencies) < 1.0, sorted(latencies)[-5:]
    (_, tokenize_status, _), completion, chat = statuses
    assert tokenize_status == 200
    for path, status, text in (completion, chat):  # tokenized, then refused: far past the context
        assert status == 400 and "2048" in text, (path, text)
