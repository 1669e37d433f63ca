"""Reasoning outputs: a model's thinking, split from its answer.

``--reasoning-parser`` names the format, as vLLM names it:

    qwen3        ``<think>...</think>`` (Qwen3, SmolLM3): the thinking may be
                 absent (``enable_thinking=false`` renders an empty, closed
                 block in the prompt), or opened by the prompt itself
    deepseek_r1  ``<think>...</think>`` (DeepSeek-R1): the template opens
                 ``<think>`` in the prompt, so the output starts inside the
                 thinking, with no opening tag

Whether the output starts inside the thinking is read from the rendered
prompt (its last ``<think>`` left open), so a ``qwen3`` output that was
truncated while thinking is still thinking, never content. The thinking
goes to the message's ``reasoning`` (and ``reasoning_content``, vLLM's older
name); what follows the end tag is the content, where tool calls are parsed.

``ReasoningSplitter`` does the split a delta at a time for streams, holding
back a tail that may be the start of a tag; a whole output is one feed.
``thinking_tokens`` gives the engine the token ids of the tags, for a
thinking budget (``cadence/core/sched/thinking.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from cadence.sampling_params import ThinkingTokens


class _Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, token_ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class ReasoningFormat:
    """Where a model's thinking starts and ends in its text."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    # The output starts inside the thinking whatever the prompt shows (DeepSeek-R1).
    always_starts_inside: bool = False
    # What the engine writes to close the thinking when a budget is spent.
    forced_end: str = "\n</think>\n\n"

    def starts_inside(self, prompt: str | None) -> bool:
        """Whether the output begins inside the thinking: the prompt's last
        start tag is not closed after it."""
        if self.always_starts_inside:
            return True
        prompt = prompt or ""
        opened = prompt.rfind(self.start)
        return opened >= 0 and prompt.find(self.end, opened) < 0


REASONING_PARSERS: dict[str, ReasoningFormat] = {
    "qwen3": ReasoningFormat("qwen3"),
    "deepseek_r1": ReasoningFormat("deepseek_r1", always_starts_inside=True),
}


def reasoning_format(name: str | None) -> ReasoningFormat | None:
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser: must be one of {', '.join(REASONING_PARSERS)}, got {name!r}")
    return REASONING_PARSERS[name]


def thinking_tokens(fmt: ReasoningFormat, tokenizer: _Tokenizer, prompt: str | None) -> ThinkingTokens:
    """The tags' token ids for the engine (a model with a ``</think>`` token
    gets that one id)."""
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    return ThinkingTokens(encode(fmt.start), encode(fmt.end), encode(fmt.forced_end),
                          starts_inside=fmt.starts_inside(prompt))


class ReasoningSplitter:
    """One output's text, fed in deltas: (reasoning, content) of each delta."""

    def __init__(self, fmt: ReasoningFormat, starts_inside: bool) -> None:
        self.fmt = fmt
        # "opening": the output may yet open with the start tag, which is
        # dropped (a prompt that opened it already, or not, as R1's older template).
        self.phase = "opening"
        self._starts_inside = starts_inside
        self._held = ""  # text that may begin a tag, not yet given out

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) of ``delta``; ``final`` gives out what was held."""
        text, self._held = self._held + delta, ""
        reasoning = content = ""
        if self.phase == "opening":
            stripped = text.lstrip()
            if stripped.startswith(self.fmt.start):
                self.phase, text = "thinking", stripped[len(self.fmt.start):]
            elif self.fmt.start.startswith(stripped) and not final:
                self._held = text  # may yet be the opening tag
                return "", ""
            else:
                self.phase = "thinking" if self._starts_inside else "answer"
        if self.phase == "thinking":
            end = text.find(self.fmt.end)
            if end >= 0:
                reasoning, text, self.phase = text[:end], text[end + len(self.fmt.end):], "answer"
            else:
                keep = 0 if final else _partial_suffix(text, self.fmt.end)
                reasoning, self._held = text[:len(text) - keep], text[len(text) - keep:]
                return reasoning, ""
        content = text
        return reasoning, content


def split_reasoning(fmt: ReasoningFormat, starts_inside: bool, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output; None for a part that is empty
    (vLLM's: no thinking gives reasoning None; thinking cut short, content None)."""
    reasoning, content = ReasoningSplitter(fmt, starts_inside).feed(text, final=True)
    return reasoning or None, content or None


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def count_reasoning_tokens(token_ids: Sequence[int], thinking: ThinkingTokens, reasoning: str | None,
                           tokenizer: _Tokenizer) -> int:
    """How many of the output's tokens are thinking: those before its close
    (the forced close, or the model's own end tag), else those whose text
    lies within ``reasoning``."""
    if not reasoning:
        return 0
    for end in (thinking.forced_end_ids, thinking.end_ids):
        at = _find(token_ids, end)
        if at is not None:
            return at - (len(thinking.start_ids) if _find(token_ids[:len(thinking.start_ids)],
                                                           thinking.start_ids) == 0 else 0)
    # Not closed, or closed in other tokens: the longest prefix whose text fits.
    lo, hi = 0, len(token_ids)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(tokenizer.decode(token_ids[:mid]).strip()) <= len(reasoning.strip()):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _find(seq: Sequence[int], sub: Sequence[int]) -> int | None:
    sub = list(sub)
    for i in range(len(seq) - len(sub) + 1):
        if list(seq[i:i + len(sub)]) == sub:
            return i
    return None
