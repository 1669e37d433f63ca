"""A request the model runner fails on gets a 500 naming the error; the others
in its steps get the tokens they get alone, and the server goes on serving
(core/sched/step_faults.py). The fault comes from ``tests/plugins/faulty_runner.py``,
which the engine process imports for the policy it names."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

# tests/plugins/faulty_runner.py's (not imported here: importing it breaks this
# process's runner too, which the other tests' engines use)
POISON_SEED = 4242

SYSTEM = "You are a careful assistant. Answer in one short sentence, and never use lists. "
PROMPTS = [SYSTEM + p for p in ("The capital of France is", "Name a prime number.",
                                "What colour is the sky?", "Say hello in Spanish.")]


@pytest.fixture(scope="module")
def server(make_server):
    return make_server("faulty-runner", ["--policy", "tests.plugins.faulty_runner:FirstComeFirstServed"])


def complete(server, prompt, **fields):
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True, **fields}
    return httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)


def test_the_failing_request_gets_a_500_and_the_others_their_own_tokens(server):
    alone = [complete(server, p).json()["choices"][0]["text"] for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS) + 1) as pool:
        poisoned = pool.submit(complete, server, SYSTEM + "Count to three.", seed=POISON_SEED)
        together = list(pool.map(lambda p: complete(server, p), PROMPTS))
    failed = poisoned.result()
    assert failed.status_code == 500, failed.text
    assert "the model runner failed on this request: RuntimeError: a kernel fell over" in \
        failed.json()["error"]["message"]
    assert [r.status_code for r in together] == [200] * len(PROMPTS)
    assert [r.json()["choices"][0]["text"] for r in together] == alone
    # What the failed steps cached is never read: the same prompts again, from the prefix cache.
    assert [complete(server, p).json()["choices"][0]["text"] for p in PROMPTS] == alone
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200


def test_a_stream_that_fails_ends_with_an_error_event(server):
    body = {"prompt": SYSTEM + "Count to five.", "max_tokens": 12, "temperature": 0.0,
            "seed": POISON_SEED, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=120) as response:
        text = "".join(response.iter_text())
    assert "the model runner failed on this request" in text, text
    assert complete(server, PROMPTS[0]).status_code == 200
