"""LoRA adapters over HTTP, as vLLM serves them: --lora-modules at start, the
``model`` field picks the adapter, /v1/models lists them with their parent,
and the runtime load/unload endpoints exist only with
--allow-runtime-lora-updating. A bad adapter is a 400 and the server goes on.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from cadence.kernels.paged_attention import paged_attention
from cadence.models.default_model import default_model_path
from cadence.models.gguf_loader import gguf_model_config, read_gguf
from cadence.models.testing import write_random_adapter

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
GREEDY = dict(max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
# The batch-invariant mode attends on the C kernel (off where it does not build).
INVARIANT = "on" if paged_attention() is not None else "off"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    config = gguf_model_config(*read_gguf(default_model_path()))
    for i, rank in ((1, 8), (2, 16), (3, 4), (4, 32)):
        write_random_adapter(str(root / f"a{i}"), config, rank=rank, alpha=2 * rank, seed=i, std=0.05)
    return root


@pytest.fixture(scope="module")
def server(make_server, adapters):
    # Batch-invariant: a request's greedy text is the same alone and beside others
    # (test_model_field_routes_to_the_adapter compares one with three in a batch).
    return make_server("lora", [
        "--batch-invariant", INVARIANT, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
        "--lora-modules", f"a1={adapters / 'a1'}", f'{{"name": "a2", "path": "{adapters / "a2"}"}}',
        "--allow-runtime-lora-updating"])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def post(server, path, body):
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=120)


def test_models_lists_the_adapters_with_their_parent(client, adapters):
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == [MODEL, "a1", "a2"]
    assert cards["a1"].parent == MODEL and cards["a1"].root == str(adapters / "a1")
    assert cards[MODEL].parent is None


def test_model_field_routes_to_the_adapter(client, adapters):
    """Greedy text under each adapter equals offline LLM.generate with its LoRARequest,
    the three in one batch there: equal because both engines are batch-invariant."""
    from cadence.core.request import LoRARequest
    from cadence.engine.llm import LLM
    from cadence.sampling_params import SamplingParams

    served = {}
    for model in (MODEL, "a1", "a2"):
        response = client.completions.create(model=model, prompt=PROMPT, **GREEDY)
        assert response.model == model
        served[model] = response.choices[0].text
    llm = LLM(enable_lora=True, max_loras=2, max_lora_rank=16, num_gpu_blocks=256, max_model_len=512,
              batch_invariant=INVARIANT)
    loras = [None, LoRARequest("a1", 1, str(adapters / "a1")), LoRARequest("a2", 2, str(adapters / "a2"))]
    outputs = llm.generate([PROMPT] * 3, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                           lora_request=loras, use_tqdm=False)
    assert [o.outputs[0].text for o in outputs] == [served[MODEL], served["a1"], served["a2"]]
    assert served["a1"] != served[MODEL]  # the adapter changes what the model says


def test_chat_under_an_adapter(client):
    response = client.chat.completions.create(
        model="a2", messages=[{"role": "user", "content": "Hi"}], **GREEDY)
    assert response.model == "a2" and response.usage.completion_tokens == 8


def test_unknown_model_is_404(server, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-adapter", prompt=PROMPT, max_tokens=2)
    assert info.value.body["param"] == "model"
    response = post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2,
                                                 "lora_request": {"lora_name": "a1"}})
    assert response.status_code == 400
    assert "model field" in response.json()["error"]["message"]


def test_load_use_and_unload_at_run_time(server, client, adapters):
    response = post(server, "/v1/load_lora_adapter", {"lora_name": "a3", "lora_path": str(adapters / "a3")})
    assert response.status_code == 200, response.text
    assert "a3" in [m.id for m in client.models.list().data]
    assert client.completions.create(model="a3", prompt=PROMPT, **GREEDY).model == "a3"
    again = post(server, "/v1/load_lora_adapter", {"lora_name": "a3", "lora_path": str(adapters / "a3")})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "a3"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="a3", prompt=PROMPT, max_tokens=2)
    missing = post(server, "/v1/unload_lora_adapter", {"lora_name": "a3"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "lora_name"


@pytest.mark.parametrize("path, message", [
    ("a4", "rank 32 exceeds max_lora_rank 16"),
    ("nowhere", "no such folder"),
])
def test_bad_adapter_is_400_and_the_server_goes_on(server, client, adapters, path, message):
    response = post(server, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(adapters / path)})
    assert response.status_code == 400
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == "lora_path"
    assert "bad" not in [m.id for m in client.models.list().data]
    assert client.completions.create(model="a1", prompt=PROMPT, max_tokens=2).choices[0].text


def test_without_the_flag_there_are_no_adapter_endpoints(make_server):
    plain = make_server("plain")
    response = post(plain, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"})
    assert response.status_code == 404
    assert post(plain, "/v1/unload_lora_adapter", {"lora_name": "x"}).status_code == 404
    refused = post(plain, "/v1/completions", {"model": "a1", "prompt": PROMPT, "max_tokens": 2})
    assert refused.status_code == 404  # no adapter of that name here


def test_adapter_whose_files_are_gone_fails_its_request_only(make_server, adapters, tmp_path):
    """Unloaded for capacity, then its folder deleted: a request for it gets an
    error naming the adapter, and the server goes on serving."""
    import shutil
    shutil.copytree(adapters / "a3", tmp_path / "gone")
    one = make_server("lora-one", ["--enable-lora", "--max-loras", "1", "--max-cpu-loras", "1",
                                   "--lora-modules", f"gone={tmp_path / 'gone'}", f"a1={adapters / 'a1'}"])
    client = openai.OpenAI(base_url=f"{one.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    for model in ("gone", "a1"):  # a1's load unloads gone (room for one)
        assert client.completions.create(model=model, prompt=PROMPT, **GREEDY).model == model
    shutil.rmtree(tmp_path / "gone")
    response = post(one, "/v1/completions", {"model": "gone", "prompt": PROMPT, "max_tokens": 4})
    assert response.status_code == 400, response.text
    assert "adapter 'gone' was unloaded and cannot be loaded again" in response.json()["error"]["message"]
    assert client.completions.create(model="a1", prompt=PROMPT, **GREEDY).choices[0].text
