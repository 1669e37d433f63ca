"""Greedy parity with Hugging Face transformers on the default model, float32.

cadence's greedy token ids must equal transformers' ``generate`` on the same
GGUF, token for token, for 48 new tokens, however the engine batches: one
prompt at a time, all prompts in one batch, chunked prefill (64-token
budget), prefix caching over a shared prefix, and a KV cache small enough
that requests are preempted and recomputed; and on every CPU path this
machine can be made to take (``cpu_paths_helpers``).
"""

import pytest
import torch

from cadence import LLM, SamplingParams
from cadence.models import Tokenizer
from cadence.models.gguf_loader import read_gguf
from cadence.models.loader import default_model_path
from tests.cpu_paths_helpers import CPU_PATHS, hide_cpu_features
from tests.hf_reference import transformers_reference

NUM_NEW_TOKENS = 48
SYSTEM = (
    "You are a careful assistant for a school science club. Answer clearly, in complete "
    "sentences, and explain the reasoning behind each answer step by step, with one "
    "concrete example that a curious twelve-year-old could try at home or observe outside, "
    "and say which part of the explanation is the most important to remember."
)
QUESTIONS = [
    "Why is the sky blue?",
    "How do plants make food?",
    "What causes the seasons on Earth?",
    "How does a rainbow form?",
    "Why do we have tides?",
    "What is an atom made of?",
    "How do vaccines train the immune system?",
    "Why does ice float on water?",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)


def conversation(question):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def make_llm(**options):
    return LLM(dtype="float32", max_num_seqs=8, kv_cache_memory="64MiB", **options)


@pytest.fixture(scope="module")
def prompts():
    tokenizer = Tokenizer.from_gguf_metadata(read_gguf(default_model_path())[1])
    ids = [tokenizer.encode(tokenizer.apply_chat_template(conversation(q)), add_special_tokens=False)
           for q in QUESTIONS]
    # The shared system prompt spans several full KV blocks.
    common = 0
    while all(p[common] == ids[0][common] for p in ids):
        common += 1
    assert common >= 48
    return [{"prompt_token_ids": p} for p in ids]


@pytest.fixture(scope="module")
def expected(prompts):
    model, _ = transformers_reference(default_model_path())
    model.generation_config.eos_token_id = None  # generate exactly NUM_NEW_TOKENS
    streams = []
    with torch.inference_mode():
        for prompt in prompts:
            input_ids = torch.tensor([prompt["prompt_token_ids"]])
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                 max_new_tokens=NUM_NEW_TOKENS, do_sample=False)
            streams.append(out[0, input_ids.shape[1]:].tolist())
    assert all(len(s) == NUM_NEW_TOKENS for s in streams)
    return streams


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_one_prompt_at_a_time(prompts, expected):
    llm = make_llm(enable_prefix_caching=False)
    got = [token_ids(llm.generate(p, GREEDY, use_tqdm=False))[0] for p in prompts]
    assert got == expected


@pytest.mark.parametrize("path", list(CPU_PATHS))
def test_all_prompts_in_one_batch(prompts, expected, monkeypatch, path):
    # Every CPU path (AVX2-only, pre-AVX2 C builds, no oneDNN, no C kernels)
    # on this machine, by hiding its features: each gives transformers' tokens.
    hide_cpu_features(monkeypatch, *CPU_PATHS[path])
    llm = make_llm(enable_prefix_caching=False)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected


def test_chunked_prefill_with_a_64_token_budget(prompts, expected):
    llm = make_llm(enable_prefix_caching=False, max_num_batched_tokens=64)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(outputs) == expected
    assert all(len(p["prompt_token_ids"]) > 64 for p in prompts)  # every prompt was chunked


def test_prefix_caching_over_a_shared_prefix(prompts, expected):
    llm = make_llm(enable_prefix_caching=True)
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert token_ids(first + rest) == expected
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= 48 for o in rest)  # the system prompt's blocks hit


def test_preemption_recomputes_identically(prompts, expected):
    # 8 requests of ~90 + 48 tokens need ~72 blocks of 16; 24 blocks force preemption.
    llm = make_llm(enable_prefix_caching=False, num_gpu_blocks=24)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.scheduler.num_preemptions_total > 0
    assert token_ids(outputs) == expected
    assert llm.scheduler.kv_cache_manager.usage == 0
