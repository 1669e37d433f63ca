"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers reading the same file.

transformers dequantizes the GGUF and undoes llama.cpp's q/k permutation with
its own code, so agreement here checks cadence's tokenizer, chat template,
dequantization, weight mapping and decoder end to end, in float32.
"""

import copy

import pytest
import torch
import transformers

from cadence.models.attention_ref import ReferenceAttention
from cadence.models.loader import default_model_path, load_model
from tests.hf_reference import transformers_reference

STRINGS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "héllo wörld — naïve café, señor",
    "日本語のテキストと中文",
    "emoji 🤗🚀 and symbols ∑∫√ ©",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew\r\nlines\n\n",
    "code: def f(x):\n    return x ** 2  # square",
    "it's, we'll, they've — I'm 100% sure: 3.14159",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a fun fact about octopuses."}],
]

# Prompts whose greedy answers run past 48 tokens, so all 48 are compared.
LONG_ANSWER_PROMPTS = [
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a fun fact about octopuses."}],
    [{"role": "user", "content": "Write a short poem about autumn leaves."}],
]


@pytest.fixture(scope="module")
def cadence():
    model, tokenizer, config = load_model(None, torch.float32)
    return model, tokenizer


@pytest.fixture(scope="module")
def reference():
    return transformers_reference(default_model_path())


def test_token_ids_match(cadence, reference):
    _, tokenizer = cadence
    _, hf_tokenizer = reference
    for text in STRINGS:
        ids = tokenizer.encode(text)
        assert ids == hf_tokenizer.encode(text), text
        assert tokenizer.decode(ids) == hf_tokenizer.decode(ids) == text


def test_chat_templated_text_tokenizes_the_same(cadence, reference):
    _, tokenizer = cadence
    _, hf_tokenizer = reference
    for messages in CONVERSATIONS:
        text = tokenizer.apply_chat_template(messages)
        assert tokenizer.encode(text) == hf_tokenizer.encode(text)


def test_decode_skipping_special_tokens_matches(cadence, reference):
    _, tokenizer = cadence
    _, hf_tokenizer = reference
    ids = tokenizer.encode(tokenizer.apply_chat_template(CONVERSATIONS[2]))
    assert tokenizer.decode(ids, skip_special_tokens=True) == hf_tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(cadence, reference, add_generation_prompt):
    _, tokenizer = cadence
    _, hf_tokenizer = reference
    for messages in CONVERSATIONS:
        expected = hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_special_ids(cadence):
    _, tokenizer = cadence
    assert tokenizer.eos_token_ids == (2,) and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.bos_token_id == 1 and tokenizer.bos_token == "<|im_start|>"
    assert {0, 1, 2} <= set(tokenizer.all_special_ids)
    assert tokenizer.encode("hi", add_special_tokens=True) == tokenizer.encode("hi", add_special_tokens=False)


def test_digits_are_split_one_by_one_like_llama_cpp(cadence):
    """SmolLM2's GGUF names the "smollm" pre-tokenizer: digits are isolated before the GPT-2 split.

    (transformers' GGUF tokenizer skips that step, which differs only for a run
    of spaces before a digit, so those strings are not in the parity list.)
    """
    _, tokenizer = cadence
    pieces = [tokenizer.id_to_piece(i) for i in tokenizer.encode("b  45")]
    assert pieces == ["b", "ĠĠ", "4", "5"]


def prompt_ids(tokenizer, messages):
    return tokenizer.encode(tokenizer.apply_chat_template(messages))


def cadence_logits(model, ids):
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), ReferenceAttention()))


def test_prompt_logits_match(cadence, reference):
    model, tokenizer = cadence
    hf_model, _ = reference
    ids = prompt_ids(tokenizer, CONVERSATIONS[2])
    with torch.inference_mode():
        expected = hf_model(torch.tensor([ids])).logits[0].float()
    got = cadence_logits(model, ids)
    assert (got - expected).abs().max() < 1e-3
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def cadence_greedy(model, ids, max_new_tokens, eos_token_ids):
    """Greedy decoding: one prefill, then one token per forward through the reference KV."""
    attention = ReferenceAttention()
    new_ids = []
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), attention)
        for step in range(max_new_tokens):
            token = int(model.compute_logits(hidden[-1:]).argmax(-1))
            new_ids.append(token)
            if token in eos_token_ids:
                break
            hidden = model(torch.tensor([token]), torch.tensor([len(ids) + step]), attention)
    return new_ids


@pytest.mark.parametrize("messages", LONG_ANSWER_PROMPTS)
def test_greedy_generation_matches_transformers(cadence, reference, messages):
    model, tokenizer = cadence
    hf_model, _ = reference
    ids = prompt_ids(tokenizer, messages)
    with torch.inference_mode():
        output = hf_model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=48, do_sample=False, eos_token_id=list(tokenizer.eos_token_ids),
            pad_token_id=tokenizer.eos_token_ids[0])
    expected = output[0, len(ids):].tolist()
    got = cadence_greedy(model, ids, 48, tokenizer.eos_token_ids)
    assert got == expected, (tokenizer.decode(got), tokenizer.decode(expected))
    assert len(got) == 48


@pytest.fixture(scope="module")
def hf_folder(reference, tmp_path_factory):
    """A Hugging Face folder: transformers' tokenizer files and a tiny random Llama of the same vocab."""
    folder = tmp_path_factory.mktemp("hf_folder")
    _, hf_tokenizer = reference
    hf_tokenizer.save_pretrained(folder)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_tokenizer_from_directory_matches(cadence, hf_folder):
    from cadence.models.tokenizer import Tokenizer

    _, gguf_tokenizer = cadence
    tokenizer = Tokenizer.from_directory(str(hf_folder))
    for text in STRINGS:
        assert tokenizer.encode(text) == gguf_tokenizer.encode(text), text
    assert tokenizer.apply_chat_template(CONVERSATIONS[1]) == gguf_tokenizer.apply_chat_template(CONVERSATIONS[1])
    assert 2 in tokenizer.eos_token_ids and tokenizer.byte_level


def test_load_model_from_folder(hf_folder):
    model, tokenizer, config = load_model(str(hf_folder), torch.float32)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32).eval()
    ids = tokenizer.encode("A folder model.")
    with torch.inference_mode():
        expected = hf_model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(cadence_logits(model, ids), expected, atol=1e-4, rtol=1e-4)
    assert config.vocab_size == 49152 and tokenizer.eos_token_ids[0] == 2


def test_bfloat16_copy_agrees_with_float32(cadence):
    model, tokenizer = cadence
    half = copy.deepcopy(model).to(torch.bfloat16)
    assert half.dtype == torch.bfloat16
    ids = prompt_ids(tokenizer, CONVERSATIONS[0])
    full_logits, half_logits = cadence_logits(model, ids), cadence_logits(half, ids)
    agreement = (full_logits.argmax(-1) == half_logits.argmax(-1)).float().mean()
    assert half_logits.dtype == torch.float32 and agreement > 0.9
    assert full_logits[-1].argmax() == half_logits[-1].argmax()
