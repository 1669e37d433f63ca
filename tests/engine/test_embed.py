"""``LLM.embed`` (issue 35 item 6): pooling requests through the same scheduler.

The embedding of a prompt equals transformers' last hidden state (the final
norm applied) of the same GGUF, dequantized, float32, within 1e-3 relative:
in one step, chunk by chunk on a small budget, from a fully cached prompt
(the scheduler computes its last token again), and beside generation; mean
pooling equals the mean of transformers' states. No KV stays held after.
"""

import pytest
import torch

from cadence import LLM, SamplingParams
from cadence.models import Tokenizer
from cadence.models.gguf_loader import read_gguf
from cadence.models.loader import default_model_path
from cadence.sampling_params import PoolingParams
from tests.hf_reference import transformers_reference

RELATIVE = 1e-3
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings of a decoder model: the final hidden state of the last prompt token, after the "
    "model's final norm, which is what a last-token pooling returns for this whole sentence.",
    "Hi",
]
RAW = PoolingParams(type="last", normalize=False)


@pytest.fixture(scope="module")
def prompt_ids():
    tokenizer = Tokenizer.from_gguf_metadata(read_gguf(default_model_path())[1])
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def states(prompt_ids):
    """transformers' final hidden states [P, H] per prompt (the final norm applied)."""
    model, _ = transformers_reference(default_model_path())
    with torch.inference_mode():
        return [model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
                for ids in prompt_ids]


def make_llm(**options):
    return LLM(dtype="float32", quantization="none", max_num_seqs=4, kv_cache_memory="64MiB",
               **options)


def assert_close(got, want):
    got = torch.tensor(got)
    assert (got - want).norm() <= RELATIVE * want.norm(), float((got - want).norm() / want.norm())


def inputs(prompt_ids):
    return [{"prompt_token_ids": ids} for ids in prompt_ids]


def test_last_token_equals_transformers(prompt_ids, states):
    llm = make_llm(enable_prefix_caching=False)
    raw = llm.embed(inputs(prompt_ids), RAW, use_tqdm=False)
    for got, want in zip(raw, states, strict=True):
        assert_close(got, want[-1])
    normalised = llm.embed(inputs(prompt_ids), use_tqdm=False)  # the default: L2-normalised
    for got, want in zip(normalised, states):
        assert_close(got, torch.nn.functional.normalize(want[-1], dim=-1))
    assert llm.scheduler.kv_cache_manager.usage == 0


def test_chunked_and_cached_prompts(prompt_ids, states):
    llm = make_llm(enable_prefix_caching=True, max_num_batched_tokens=8, block_size=16)
    assert len(prompt_ids[1]) > 16  # chunked, and whole blocks to hit
    first = llm.embed(inputs(prompt_ids), RAW, use_tqdm=False)
    pooled = SamplingParams(max_tokens=None, pooling=RAW)
    again = llm.generate(inputs(prompt_ids), pooled, use_tqdm=False)  # the prompts' blocks hit
    assert again[1].num_cached_tokens >= 16
    for got_first, got_again, want in zip(first, again, states):
        assert_close(got_first, want[-1])
        assert_close(got_again.embedding, want[-1])
    assert llm.scheduler.kv_cache_manager.usage == 0  # blocks freed (kept only in the prefix cache)


def test_mean_pooling_equals_the_mean_state(prompt_ids, states):
    llm = make_llm(enable_prefix_caching=True, max_num_batched_tokens=8)
    mean = PoolingParams(type="mean", normalize=False)
    for _ in range(2):  # the second time its blocks are cached: mean pooling takes no hit
        got = llm.embed(inputs(prompt_ids), mean, use_tqdm=False)
        for vector, want in zip(got, states):
            assert_close(vector, want.mean(dim=0))


def test_generation_beside_embeddings(prompt_ids, states):
    llm = make_llm()
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    alone = llm.generate(inputs(prompt_ids), greedy, use_tqdm=False)
    pooled = SamplingParams(max_tokens=None, pooling=RAW)
    mixed = llm.generate(inputs(prompt_ids) * 2, [greedy] * 3 + [pooled] * 3, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == [o.outputs[0].token_ids for o in alone]
    for out, want in zip(mixed[3:], states):
        assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "stop"
        assert_close(out.embedding, want[-1])


def test_pooling_refuses_sampling_fields():
    for field, value in (("n", 2), ("logprobs", 1), ("prompt_logprobs", 1)):
        with pytest.raises(ValueError, match=f"^{field}: a pooling"):
            SamplingParams(pooling=PoolingParams(), **{field: value})
    with pytest.raises(ValueError, match="^pooling: type"):
        PoolingParams(type="cls")


def test_the_model_chooses_the_pooling():
    from cadence.models.config import ModelConfig
    from cadence.sampling_params import embedding_params

    metadata = dict(read_gguf(default_model_path())[1])
    arch = metadata["general.architecture"]
    assert ModelConfig.from_gguf_metadata(metadata, tie_word_embeddings=True).pooling_type is None
    for value, expected in ((1, "mean"), (3, "last"), (2, None)):  # llama.cpp's mean, last, cls
        metadata[f"{arch}.pooling_type"] = value
        config = ModelConfig.from_gguf_metadata(metadata, tie_word_embeddings=True)
        assert config.pooling_type == expected
    assert embedding_params(None, "mean").pooling.type == "mean"
    assert embedding_params(None, None).pooling.type == "last"
    assert embedding_params(PoolingParams(type="last"), "mean").pooling.type == "last"
