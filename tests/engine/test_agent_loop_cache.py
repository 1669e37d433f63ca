"""Agent loops keep their cache (issue 35 item 3).

A chat template that strips earlier turns' thinking (as Qwen3's does) makes
turn k+1's prompt differ from turn k's prompt + output where that thinking
was. The prefix cache hashes whole blocks, so the next turn still reuses
every full block before the first changed token: this shows it with the
engine's hits (a request's ``num_cached_tokens``) over a 3-turn loop with a
thinking budget, on the default model.
"""

from __future__ import annotations

import pytest

from cadence.engine.llm import LLM
from cadence.models.chat_template import render_chat_template
from cadence.sampling_params import SamplingParams, ThinkingTokens

BLOCK_SIZE = 16
# Earlier assistant turns keep only their answer; the generation prompt opens the thinking.
TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
SYSTEM = ("You are a travel assistant. You answer in one short sentence, and you think about "
          "the question before you answer it. Cities, rivers and mountains are your topics.")
QUESTIONS = ["What is the capital of France?", "Which river runs through it?",
             "And what is the highest mountain of that country?"]


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=1024, kv_cache_memory="64MiB", block_size=BLOCK_SIZE)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_each_turn_reuses_every_full_block_before_the_stripped_thinking(llm):
    encode = lambda text: llm.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    thinking = ThinkingTokens(encode("<think>"), encode("</think>"), encode("\n</think>\n\n"),
                              starts_inside=True)
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=14, thinking_token_budget=6,
                            thinking=thinking)
    messages = [{"role": "system", "content": SYSTEM}]
    before: list[int] | None = None  # the previous turn's prompt + output
    num_before_prompt = 0  # the previous turn's prompt tokens
    for turn, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        prompt = encode(render_chat_template(TEMPLATE, messages, add_generation_prompt=True))
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        if before is not None:
            first_change = common_prefix(prompt, before)
            # Where the stripped thinking began: the end of the previous prompt.
            assert num_before_prompt - len(encode("<think>\n")) <= first_change <= num_before_prompt
            assert out.num_cached_tokens == first_change // BLOCK_SIZE * BLOCK_SIZE > 0
        text = out.outputs[0].text
        assert "</think>" in text  # the budget closed the thinking
        messages.append({"role": "assistant", "content": text.split("</think>", 1)[1].strip()})
        before, num_before_prompt = prompt + list(out.outputs[0].token_ids), len(prompt)
