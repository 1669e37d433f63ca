"""The reasoning parsers alone (cadence/server/reasoning.py): whole outputs
and the same outputs streamed in every split of their text; no server."""

from __future__ import annotations

import pytest

from cadence.server.reasoning import (
    REASONING_PARSERS, ReasoningSplitter, count_reasoning_tokens, reasoning_format, split_reasoning,
)
from cadence.sampling_params import ThinkingTokens

QWEN3, R1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]
OPEN_PROMPT = "<|im_start|>assistant\n<think>\n"
CLOSED_PROMPT = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
PLAIN_PROMPT = "<|im_start|>assistant\n"


def test_where_the_output_starts():
    assert QWEN3.starts_inside(OPEN_PROMPT)
    assert not QWEN3.starts_inside(CLOSED_PROMPT)  # enable_thinking=false
    assert not QWEN3.starts_inside(PLAIN_PROMPT)
    assert R1.starts_inside(PLAIN_PROMPT)  # DeepSeek-R1: inside, with no opening tag


@pytest.mark.parametrize("fmt, prompt, text, want", [
    (QWEN3, OPEN_PROMPT, "Let me see.\n</think>\n\nParis.", ("Let me see.\n", "\n\nParis.")),
    (QWEN3, PLAIN_PROMPT, "<think>Hmm.</think>Paris.", ("Hmm.", "Paris.")),
    (QWEN3, PLAIN_PROMPT, "\n<think>Hmm.</think>Paris.", ("Hmm.", "Paris.")),
    (QWEN3, PLAIN_PROMPT, "Paris, not <think>.", (None, "Paris, not <think>.")),
    (QWEN3, CLOSED_PROMPT, "Paris.", (None, "Paris.")),
    (QWEN3, OPEN_PROMPT, "Still thinking", ("Still thinking", None)),  # cut short: never content
    (R1, PLAIN_PROMPT, "Hmm.</think>Paris.", ("Hmm.", "Paris.")),
    (R1, PLAIN_PROMPT, "Hmm, still", ("Hmm, still", None)),
    (R1, PLAIN_PROMPT, "<think>Hmm.</think>Paris.", ("Hmm.", "Paris.")),  # an opening tag is dropped
    (R1, PLAIN_PROMPT, "\n\n", ("\n\n", None)),
])
def test_whole_and_streamed_in_every_split(fmt, prompt, text, want):
    inside = fmt.starts_inside(prompt)
    assert split_reasoning(fmt, inside, text) == want
    for cut in range(len(text) + 1):
        for cut2 in range(cut, len(text) + 1):
            splitter = ReasoningSplitter(fmt, inside)
            parts = [splitter.feed(text[:cut]), splitter.feed(text[cut:cut2]),
                     splitter.feed(text[cut2:], final=True)]
            reasoning = "".join(p[0] for p in parts) or None
            content = "".join(p[1] for p in parts) or None
            assert (reasoning, content) == want, (cut, cut2, parts)


def test_a_partial_tag_is_held_back_until_it_is_known():
    splitter = ReasoningSplitter(QWEN3, starts_inside=True)
    assert splitter.feed("Hmm </thi") == ("Hmm ", "")
    assert splitter.feed("s is not it") == ("</this is not it", "")
    assert splitter.feed("</think>ok") == ("", "ok")


def test_reasoning_tokens_are_counted_before_the_close():
    thinking = ThinkingTokens((1,), (2,), (7, 2, 8), starts_inside=True)
    assert count_reasoning_tokens([5, 5, 5, 7, 2, 8, 9], thinking, "x", tokenizer=None) == 3
    assert count_reasoning_tokens([5, 5, 2, 9], thinking, "x", tokenizer=None) == 2
    assert count_reasoning_tokens([9], thinking, None, tokenizer=None) == 0


def test_unknown_parser_is_refused_naming_the_option():
    with pytest.raises(ValueError, match="^reasoning_parser: must be one of qwen3, deepseek_r1"):
        reasoning_format("granite")


def test_a_call_written_while_thinking_is_no_tool_call():
    from cadence.server.tool_calls import HermesParser, parse_all

    text = ('Maybe <tool_call>{"name": "f", "arguments": {}}</tool_call> would do.\n</think>\n\n'
            '<tool_call>{"name": "g", "arguments": {"x": 1}}</tool_call>')
    reasoning, content = split_reasoning(QWEN3, True, text)
    _, calls = parse_all(HermesParser(), content)
    assert [call.name for call in calls] == ["g"] and "<tool_call>" in reasoning
