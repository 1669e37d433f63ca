"""Prompt logprobs (issue 35 item 7) equal transformers' log-softmax on the default
model, float32 (its weights dequantized, as transformers reads the GGUF), within
1e-3 per token: in one step, chunk by chunk on a small
budget, and with the prompt's prefix already in the prefix cache (a request
asking prompt logprobs takes no cache hit: it computes every position)."""

import pytest
import torch

from cadence import LLM, SamplingParams
from cadence.models import Tokenizer
from cadence.models.gguf_loader import read_gguf
from cadence.models.loader import default_model_path
from tests.hf_reference import transformers_reference

TOLERANCE = 1e-3
NUM_TOP = 3
PROMPTS = [
    "The quick brown fox jumps over the lazy dog and then runs into the forest to find its den.",
    "Water boils at one hundred degrees Celsius at sea level, but at lower temperatures on high "
    "mountains, because the air pressure there is lower and the molecules escape more easily.",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12",
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=NUM_TOP)


@pytest.fixture(scope="module")
def prompt_ids():
    tokenizer = Tokenizer.from_gguf_metadata(read_gguf(default_model_path())[1])
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def expected(prompt_ids):
    """Per prompt: transformers' log-softmax over the vocabulary at each position but the last."""
    model, _ = transformers_reference(default_model_path())
    with torch.inference_mode():
        return [model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1) for ids in prompt_ids]


def make_llm(**options):
    # The weights dequantized and the cache in float32, as transformers computes: the C
    # kernel's products over GGUF blocks round activations to int16 steps, and the default
    # float16 cache keys and values, each a few 1e-3 off in logprobs.
    return LLM(dtype="float32", quantization="none", kv_cache_dtype="float32", max_num_seqs=4,
               kv_cache_memory="64MiB", **options)


def check(outputs, prompt_ids, expected):
    for out, ids, reference in zip(outputs, prompt_ids, expected, strict=True):
        rows = out.prompt_logprobs
        assert len(rows) == len(ids) and rows[0] is None  # nothing scores the first token
        for position, (token, row) in enumerate(zip(ids[1:], rows[1:])):
            want = reference[position]
            assert row[token].logprob == pytest.approx(want[token].item(), abs=TOLERANCE)
            # Its rank, up to the tokens whose logprobs lie within the tolerance of its own.
            value = want[token].item()
            assert 1 + int((want > value + TOLERANCE).sum()) <= row[token].rank
            assert row[token].rank <= 1 + int((want > value - TOLERANCE).sum())
            top = [t for t, lp in row.items() if lp.rank is not None and lp.rank <= NUM_TOP]
            assert len(top) == NUM_TOP
            for t in top:
                assert row[t].logprob == pytest.approx(want[t].item(), abs=TOLERANCE)
            assert max(row[t].logprob for t in top) == pytest.approx(want.max().item(), abs=TOLERANCE)


def test_prompt_logprobs_equal_transformers(prompt_ids, expected):
    llm = make_llm(enable_prefix_caching=False)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], PARAMS, use_tqdm=False)
    check(outputs, prompt_ids, expected)


def test_chunk_by_chunk_on_a_small_budget(prompt_ids, expected):
    llm = make_llm(enable_prefix_caching=False, max_num_batched_tokens=8)
    assert all(len(ids) > 8 for ids in prompt_ids)  # every prompt takes several chunks
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], PARAMS, use_tqdm=False)
    check(outputs, prompt_ids, expected)


def test_a_cached_prefix_is_computed_again(prompt_ids, expected):
    llm = make_llm(enable_prefix_caching=True, block_size=16)
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
    plain = SamplingParams(temperature=0.0, max_tokens=1)
    warm = llm.generate(prompts, plain, use_tqdm=False)
    again = llm.generate(prompts, plain, use_tqdm=False)
    assert warm[0].num_cached_tokens == 0 and again[0].num_cached_tokens >= 16  # the cache holds them
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert all(o.num_cached_tokens == 0 for o in outputs)  # no hit taken
    check(outputs, prompt_ids, expected)
    after = llm.generate(prompts, plain, use_tqdm=False)
    assert after[0].num_cached_tokens >= 16  # the cache still serves the others
