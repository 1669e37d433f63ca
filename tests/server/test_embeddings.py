"""/v1/embeddings (issue 35 item 6) through the ``openai`` client: floats and
base64 agree, a batch equals its inputs one by one, token ids are inputs too,
``dimensions`` is refused naming it, and generation runs beside embeddings."""

import base64
import concurrent.futures
import math

import httpx
import numpy as np
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
TEXTS = ["The cat sat on the mat.", "Paris is the capital of France.",
         "A long sentence about embeddings, batching and the prefix cache, " * 4, "Hi"]
HIDDEN_SIZE = 576


@pytest.fixture(scope="module")
def server(make_server):
    # Long inputs chunk; a batch's chunks differ from one input's, so the outputs compared
    # across batches are computed batch-invariant.
    return make_server("embeddings", ["--max-num-batched-tokens", "32", "--batch-invariant", "on"])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def vectors(response):
    return [item.embedding for item in sorted(response.data, key=lambda item: item.index)]


def close(a, b, tolerance=1e-5):
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) <= tolerance


def test_floats_and_base64_are_equal(client):
    floats = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    encoded = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="base64")
    default = client.embeddings.create(model=MODEL, input=TEXTS[0])  # the client asks base64
    # Asked explicitly, base64 comes back as the text: little-endian float32 bytes.
    (a,), (text,), (c,) = vectors(floats), vectors(encoded), vectors(default)
    b = np.frombuffer(base64.b64decode(text), dtype="<f4").tolist()
    assert len(a) == HIDDEN_SIZE and math.isclose(math.fsum(x * x for x in a), 1.0, rel_tol=1e-5)
    assert close(a, b) and close(a, c)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 0
    assert floats.model == MODEL and floats.object == "list"


def test_a_batch_equals_its_inputs_one_by_one(client):
    batch = vectors(client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float"))
    single = [vectors(client.embeddings.create(model=MODEL, input=t, encoding_format="float"))[0]
              for t in TEXTS]
    assert len(batch) == len(TEXTS)
    for got, want in zip(batch, single):
        assert close(got, want, 1e-4)
    assert not close(batch[0], batch[1], 1e-2)  # different texts, different embeddings


def test_token_ids_are_inputs(server, client):
    ids = [httpx.post(f"{server.base_url}/tokenize", json={"prompt": t}, timeout=60).json()["tokens"]
           for t in TEXTS[:2]]
    by_text = vectors(client.embeddings.create(model=MODEL, input=TEXTS[:2], encoding_format="float"))
    one = vectors(client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float"))
    many = vectors(client.embeddings.create(model=MODEL, input=ids, encoding_format="float"))
    assert close(one[0], by_text[0], 1e-4)
    assert all(close(a, b, 1e-4) for a, b in zip(many, by_text))


def test_a_cached_input_still_gets_its_embedding(client):
    text = TEXTS[2]  # several KV blocks
    first = vectors(client.embeddings.create(model=MODEL, input=text, encoding_format="float"))
    again = vectors(client.embeddings.create(model=MODEL, input=text, encoding_format="float"))
    assert close(first[0], again[0], 1e-4)


def test_refusals_name_the_field(server, client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=MODEL, input="x", dimensions=64)
    assert refused.value.body["param"] == "dimensions"
    for body, param in (({"input": []}, "input"), ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
                        ({"input": [10 ** 9]}, "input")):
        response = httpx.post(f"{server.base_url}/v1/embeddings", json={"model": MODEL, **body}, timeout=60)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
    unknown = httpx.post(f"{server.base_url}/v1/embeddings", json={"model": "other", "input": "x"}, timeout=60)
    assert unknown.status_code == 404


def test_raw_states_with_normalize_false(server):
    response = httpx.post(f"{server.base_url}/v1/embeddings", timeout=60,
                          json={"model": MODEL, "input": TEXTS[0], "normalize": False})
    raw = response.json()["data"][0]["embedding"]
    norm = math.sqrt(math.fsum(x * x for x in raw))
    assert norm > 1.5  # the final norm's output, not divided by its length


def test_generation_runs_beside_embeddings(client):
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        embeds = [pool.submit(client.embeddings.create, model=MODEL, input=TEXTS,
                              encoding_format="float") for _ in range(3)]
        completion = pool.submit(client.completions.create, model=MODEL, prompt="Once upon a time",
                                 max_tokens=8, temperature=0)
        texts = completion.result()
        results = [vectors(e.result()) for e in embeds]
    assert texts.choices[0].text and texts.usage.completion_tokens == 8
    for result in results[1:]:
        assert all(close(a, b, 1e-4) for a, b in zip(result, results[0]))
