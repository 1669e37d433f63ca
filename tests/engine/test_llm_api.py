"""The offline ``LLM`` API on the real default model (SmolLM2-135M, float32, CPU).

One engine for the module; each model run is a module fixture shared by the
tests that read it, and every ``generate`` must leave the KV cache empty.
Reference outputs are the engine's own greedy tokens: this file checks the
API's contract (order, stops, seeds, logprobs, validation), and
test_greedy_parity.py checks the tokens against transformers.
"""

import pytest

from cadence.engine import LLM, builder
from cadence.kernels.paged_attention import paged_attention
from cadence.sampling_params import SamplingParams

MAX_MODEL_LEN = 128
NUM_TOKENS = 6
PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time", "def fib(n):",
           "Hello, my name is"]
COUNTING = PROMPTS[1]  # greedy: " 5, 6, 7, ..."
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=1234, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=3)
PARALLEL = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=4, ignore_eos=True)
# The model answers both in 8 tokens, ending with <|im_end|> (its EOS).
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
TWO_PLUS_TWO = [{"role": "user", "content": "What is 2+2? Answer with just the number."}]


@pytest.fixture(scope="module")
def llm():
    # Batch-invariant (where the C attention kernel builds): the tests below compare a
    # request alone with it in a batch.
    return LLM(dtype="float32", max_num_seqs=16, kv_cache_memory="256MiB", max_model_len=MAX_MODEL_LEN,
               batch_invariant="on" if paged_attention() is not None else "off")


def generate(llm, prompts, params=None):
    """``llm.generate`` that also checks the engine is left idle with an empty KV cache."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert not llm.scheduler.has_requests()
    assert llm.scheduler.kv_cache_manager.usage == 0
    return outs


@pytest.fixture(scope="module")
def greedy_batch(llm, tokenizer):
    """Six greedy prompts in one batch; the last is COUNTING again, given as token ids."""
    return generate(llm, [*PROMPTS, {"prompt_token_ids": tokenizer.encode(COUNTING)}], GREEDY)


@pytest.fixture(scope="module")
def counting(greedy_batch):
    return greedy_batch[1].outputs[0].token_ids


# ------------------------------------------------------------ prompts, order, greedy


def test_outputs_come_in_prompt_order(greedy_batch, tokenizer):
    assert [o.prompt for o in greedy_batch] == [*PROMPTS, None]
    for out, prompt in zip(greedy_batch, PROMPTS):
        assert out.prompt_token_ids == tokenizer.encode(prompt)
    assert len({o.request_id for o in greedy_batch}) == len(greedy_batch)
    assert all(o.finished and len(o.outputs) == 1 for o in greedy_batch)


def test_max_tokens_is_exact_with_ignore_eos(greedy_batch, tokenizer):
    for out in greedy_batch:
        completion = out.outputs[0]
        assert len(completion.token_ids) == NUM_TOKENS
        assert completion.finish_reason == "length" and completion.stop_reason is None
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def test_token_id_prompt_gives_the_same_output_as_its_string(greedy_batch, counting, tokenizer):
    assert greedy_batch[5].prompt_token_ids == greedy_batch[1].prompt_token_ids
    assert greedy_batch[5].outputs[0].token_ids == counting
    assert greedy_batch[5].outputs[0].text == greedy_batch[1].outputs[0].text
    assert tokenizer.decode(counting) == " 5, 6,"  # the model really counts


def test_greedy_alone_equals_greedy_in_a_batch(llm, greedy_batch):
    alone = generate(llm, PROMPTS[3], GREEDY)
    assert len(alone) == 1
    assert alone[0].outputs[0].token_ids == greedy_batch[3].outputs[0].token_ids
    assert alone[0].outputs[0].text == greedy_batch[3].outputs[0].text


def test_longest_prompt_gets_one_token(llm, tokenizer):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 30)[: MAX_MODEL_LEN - 1]
    out = generate(llm, {"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=5))[0]
    assert len(out.outputs[0].token_ids) == 1
    assert out.outputs[0].finish_reason == "length"


# ------------------------------------------------------------ stops


STOP_PARAMS = {
    "stop string": SamplingParams(temperature=0.0, max_tokens=16, stop=[" 6"]),
    "stop string kept": SamplingParams(temperature=0.0, max_tokens=16, stop=[" 6"],
                                       include_stop_str_in_output=True),
    "two stops": SamplingParams(temperature=0.0, max_tokens=16, stop=[" 6", ","]),
    "stop token": SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[28]),  # ","
    "stop never seen": SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, stop=["zzz"]),
}


@pytest.fixture(scope="module")
def stopped(llm):
    """COUNTING under each of STOP_PARAMS, in one batch. The stopping ones may run
    16 tokens, so the engine must finish them in the scheduler when a stop
    string matches, or ``generate`` would leave them running."""
    outs = generate(llm, [COUNTING] * len(STOP_PARAMS), list(STOP_PARAMS.values()))
    return {name: out.outputs[0] for name, out in zip(STOP_PARAMS, outs)}


def test_stop_string_ends_the_text(stopped, counting):
    completion = stopped["stop string"]
    assert completion.text == " 5,"
    assert completion.finish_reason == "stop" and completion.stop_reason == " 6"
    assert completion.token_ids == counting[:5]  # " 6" is two tokens: " " and "6"


def test_stop_string_included_when_asked(stopped, counting):
    completion = stopped["stop string kept"]
    assert completion.text == " 5, 6"
    assert completion.stop_reason == " 6" and completion.token_ids == counting[:5]


def test_first_stop_string_to_appear_wins(stopped, counting):
    completion = stopped["two stops"]
    assert completion.text == " 5" and completion.stop_reason == ","
    assert completion.token_ids == counting[:3]


def test_stop_token_id(stopped, counting):
    completion = stopped["stop token"]
    assert counting[2] == 28
    assert completion.token_ids == counting[:3]
    assert completion.finish_reason == "stop" and completion.stop_reason == 28


def test_stop_token_text_is_left_out(stopped):
    assert stopped["stop token"].text == " 5"


def test_unmatched_stop_string_shows_all_text_at_the_end(stopped, greedy_batch):
    completion = stopped["stop never seen"]
    assert completion.finish_reason == "length" and completion.stop_reason is None
    assert completion.text == greedy_batch[1].outputs[0].text


# ------------------------------------------------------------ seeds, n > 1, logprobs


@pytest.fixture(scope="module")
def seeded_alone(llm):
    return generate(llm, PROMPTS[2], SEEDED)[0]


@pytest.fixture(scope="module")
def mixed_batch(llm, seeded_alone):
    """Greedy with logprobs, the seeded request and n=3, together."""
    greedy_logprobs = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=3)
    return generate(llm, [PROMPTS[0], PROMPTS[2], PROMPTS[3]], [greedy_logprobs, SEEDED, PARALLEL])


@pytest.fixture(scope="module")
def parallel_alone(llm, mixed_batch):
    return generate(llm, PROMPTS[3], PARALLEL)[0]


def test_seeded_request_alone_equals_in_a_batch(seeded_alone, mixed_batch):
    assert mixed_batch[1].outputs[0].token_ids == seeded_alone.outputs[0].token_ids
    assert mixed_batch[1].outputs[0].text == seeded_alone.outputs[0].text


def test_n_completions_in_one_output(mixed_batch):
    out = mixed_batch[2]
    assert out.finished and out.prompt == PROMPTS[3]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 4 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # temperature 1: they differ


def test_same_seed_same_n_completions(mixed_batch, parallel_alone):
    assert [c.token_ids for c in parallel_alone.outputs] == [c.token_ids for c in mixed_batch[2].outputs]


def test_logprobs_of_sampled_tokens(seeded_alone, tokenizer):
    completion = seeded_alone.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids)
    for token, row in zip(completion.token_ids, completion.logprobs):
        assert token in row
        sampled = row[token]
        assert sampled.logprob <= 0 and sampled.rank >= 1
        assert sampled.decoded_token == tokenizer.token_bytes(token).decode("utf-8", errors="replace")
        top = sorted((lp for lp in row.values() if lp.rank <= 3), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top] == [1, 2, 3]
        assert top[0].logprob >= top[1].logprob >= top[2].logprob
        if sampled.rank > 3:
            assert sampled.logprob <= top[2].logprob
        assert len(row) == (3 if sampled.rank <= 3 else 4)
    assert completion.cumulative_logprob == pytest.approx(
        sum(row[t].logprob for t, row in zip(completion.token_ids, completion.logprobs)), abs=1e-4)


def test_greedy_logprobs_rank_first(mixed_batch, greedy_batch):
    completion = mixed_batch[0].outputs[0]
    assert completion.token_ids == greedy_batch[0].outputs[0].token_ids  # logprobs change nothing
    for token, row in zip(completion.token_ids, completion.logprobs):
        assert row[token].rank == 1
        assert row[token].logprob == max(lp.logprob for lp in row.values())
        assert len(row) == 3


def test_no_logprobs_unless_asked(greedy_batch):
    assert greedy_batch[0].outputs[0].logprobs is None
    assert greedy_batch[0].prompt_logprobs is None


@pytest.fixture(scope="module")
def prompt_logprob_runs(llm):
    long_prompt = "The quick brown fox jumps over the lazy dog and then runs into the forest to find"
    params = [SamplingParams(n=n, temperature=0.5, seed=1, max_tokens=1, prompt_logprobs=1)
              for n in (1, 2, 2)]
    return generate(llm, [COUNTING, COUNTING, long_prompt], params)


def test_prompt_logprobs(prompt_logprob_runs):
    out = prompt_logprob_runs[0]
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert out.prompt_logprobs[0] is None  # nothing scores the first token
    for token, row in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert token in row and row[token].logprob <= 0 and row[token].rank >= 1
        assert any(lp.rank == 1 for lp in row.values())


def test_prompt_logprobs_with_n(prompt_logprob_runs):
    for out in prompt_logprob_runs[1:]:
        assert len(out.prompt_logprobs) == len(out.prompt_token_ids)


# ------------------------------------------------------------ chat


@pytest.fixture(scope="module")
def chats(llm):
    return llm.chat([CAPITAL, TWO_PLUS_TWO], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)


def test_chat_renders_the_template(chats, tokenizer):
    assert len(chats) == 2
    for out, messages in zip(chats, (CAPITAL, TWO_PLUS_TWO)):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        assert out.prompt == text
        assert out.prompt.startswith("<|im_start|>system\n")
        assert out.prompt.endswith(messages[0]["content"] + "<|im_end|>\n<|im_start|>assistant\n")
        assert out.prompt_token_ids == tokenizer.encode(text, add_special_tokens=False)


def test_chat_answers_and_stops_at_end_of_turn(chats, tokenizer):
    capital, two_plus_two = (out.outputs[0] for out in chats)
    assert "Paris" in capital.text and "4" in two_plus_two.text
    for answer in (capital, two_plus_two):
        assert answer.finish_reason == "stop" and answer.stop_reason is None
        assert len(answer.token_ids) < 16 and answer.token_ids[-1] == tokenizer.eos_token_ids[0]
        assert "<|im_end|>" not in answer.text


def test_chat_of_one_conversation(llm, chats):
    out = llm.chat(CAPITAL, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert len(out) == 1
    assert out[0].outputs[0].token_ids == chats[0].outputs[0].token_ids[:3]
    assert llm.scheduler.kv_cache_manager.usage == 0


# ------------------------------------------------------------ validation


def test_invalid_sampling_params_name_the_field():
    with pytest.raises(ValueError, match=r"^temperature: "):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match=r"^max_tokens: "):
        SamplingParams(max_tokens=0)


def test_unknown_engine_option_is_named_before_loading():
    with pytest.raises(ValueError, match=r"^max_num_sequences: unknown engine option"):
        LLM(dtype="float32", max_num_sequences=4)


@pytest.mark.parametrize(
    "prompt, field",
    [
        ({"prompt_token_ids": [100] * MAX_MODEL_LEN}, "prompt"),
        ("word " * (MAX_MODEL_LEN + 10), "prompt"),
        ("", "prompt"),
        ({"prompt_token_ids": []}, "prompt"),
        ({"prompt_token_ids": [100, 49152]}, "prompt_token_ids"),
        ({"prompt_token_ids": [-1, 100]}, "prompt_token_ids"),
        ({"prompt_token_ids": [100, 2.5]}, "prompt_token_ids"),
        ({"text": "hello"}, "prompt"),
    ],
)
def test_invalid_prompt_is_refused_before_anything_runs(llm, tokenizer, prompt, field):
    assert tokenizer.vocab_size == 49152
    num_steps = llm.engine.core.num_steps
    with pytest.raises(ValueError, match=rf"^{field}: "):
        llm.generate(["Hello", prompt], GREEDY, use_tqdm=False)  # the valid one must not run either
    assert llm.engine.core.num_steps == num_steps
    assert not llm.scheduler.has_requests()


def test_wrong_number_of_sampling_params(llm):
    with pytest.raises(ValueError, match=r"^sampling_params: "):
        llm.generate(PROMPTS[:3], [GREEDY, GREEDY], use_tqdm=False)


def test_still_works_after_bad_requests(llm, greedy_batch):
    with pytest.raises(ValueError):
        llm.generate(["Hello", ""], GREEDY, use_tqdm=False)
    out = generate(llm, COUNTING, GREEDY.replace(max_tokens=2))[0]
    assert out.outputs[0].token_ids == greedy_batch[1].outputs[0].token_ids[:2]


def test_prompt_larger_than_the_kv_cache_is_refused(llm, monkeypatch):
    engine = llm.engine
    # Reuse the loaded model: only the 2-block (32-token) KV cache is new.
    monkeypatch.setattr(builder, "load_model",
                        lambda path, dtype, quantization="none": (engine.core.runner.model, engine.tokenizer, engine.model_config))
    try:
        small = LLM(dtype="float32", max_model_len=MAX_MODEL_LEN, num_gpu_blocks=2)
    except ValueError:
        return  # refusing such an engine is a fix too
    core, step = small.engine.core, small.engine.core.step

    def bounded_step():
        if core.num_steps >= 20:
            raise RuntimeError("no progress in 20 steps")
        return step()

    core.step = bounded_step
    try:
        out = small.generate({"prompt_token_ids": [100] * 40}, GREEDY, use_tqdm=False)
    except ValueError as error:
        assert str(error).startswith("prompt")
        return
    assert out[0].finished


# ------------------------------------------------------------ users (the fair policy)


def test_fair_policy_serves_each_user_the_same_greedy_tokens(greedy_batch):
    """user= reaches the scheduler's fair policy; greedy tokens do not depend on the order."""
    fair_llm = LLM(dtype="float32", max_num_seqs=2, kv_cache_memory="64MiB",
                   max_model_len=MAX_MODEL_LEN, policy="fair", fair_client_weights="alice=2")
    users = ["alice", "bob", "bob", "bob", None, "alice"]
    prompts = [*PROMPTS, COUNTING]
    outs = fair_llm.generate(prompts, GREEDY, use_tqdm=False, user=users)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in greedy_batch]
    counters = fair_llm.scheduler.policy.counters.counters
    assert set(counters) == {"alice", "bob", None}
    with pytest.raises(ValueError, match=r"^user: need one per prompt"):
        fair_llm.generate(prompts, GREEDY, use_tqdm=False, user=["alice"])
    with pytest.raises(ValueError, match=r"^user: must be a string of at most 256"):
        fair_llm.generate(PROMPTS[0], GREEDY, use_tqdm=False, user="x" * 300)


def test_user_travels_to_the_engine_process():
    from cadence.core.request import Request
    from cadence.engine.wire import EngineCoreRequest

    request = Request("r", [1, 2], GREEDY, tenant="alice")
    assert EngineCoreRequest.from_request(request).to_request(64).tenant == "alice"
