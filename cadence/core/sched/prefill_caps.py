"""Caps on the prompts being prefilled in one step (vLLM's partial-prefill options).

With chunked prefill, a few long prompts can take every prefill slot of
every step while short prompts wait behind them (vLLM #14003, #21495):
their time to first token becomes the long prompts' prefill time. Two caps
fix that, counted per step over every request that gets prompt tokens
(running chunks and new admissions alike):

- ``max_num_partial_prefills``: at most this many requests prefill in one step;
- ``max_long_partial_prefills``: at most this many of them have a *long*
  prompt (more than ``long_prefill_token_threshold`` tokens).

With the second below the first, at least the difference is left to short
prompts: a long one waiting for a slot is passed over, not waited for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cadence.config import SchedulerConfig
    from cadence.core.request import Request


def is_prefilling(request: "Request") -> bool:
    """Whether the request still has prompt tokens to compute."""
    return request.num_computed_tokens < request.num_prompt_tokens


class PrefillCaps:
    """One step's count of prefilling requests, against the configured caps."""

    __slots__ = ("max_partial", "max_long", "long_threshold", "num_partial", "num_long")

    def __init__(self, max_partial: int | None, max_long: int | None, long_threshold: int) -> None:
        self.max_partial = max_partial
        self.max_long = max_long
        self.long_threshold = long_threshold
        self.num_partial = 0
        self.num_long = 0

    @classmethod
    def from_config(cls, config: "SchedulerConfig") -> "PrefillCaps | None":
        """The caps a config asks for, or None (no caps: nothing is counted)."""
        if config.max_num_partial_prefills is None and config.max_long_partial_prefills is None:
            return None
        return cls(config.max_num_partial_prefills, config.max_long_partial_prefills,
                   config.long_prefill_token_threshold)

    def is_long(self, request: "Request") -> bool:
        return self.long_threshold > 0 and request.num_prompt_tokens > self.long_threshold

    @property
    def full(self) -> bool:
        """No prefill slot left at all this step."""
        return self.max_partial is not None and self.num_partial >= self.max_partial

    def admits(self, request: "Request") -> bool:
        """Whether ``request`` may get prompt tokens this step (always, if it has none left)."""
        if not is_prefilling(request):
            return True
        if self.full:
            return False
        return not (self.max_long is not None and self.is_long(request)
                    and self.num_long >= self.max_long)

    def count(self, request: "Request") -> None:
        """Record a request just scheduled (prefilling or not)."""
        if is_prefilling(request):
            self.num_partial += 1
            if self.is_long(request):
                self.num_long += 1

    def uncount(self, request: "Request") -> None:
        """Undo ``count`` for a request preempted after it was scheduled this step."""
        if is_prefilling(request):
            self.num_partial -= 1
            if self.is_long(request):
                self.num_long -= 1
