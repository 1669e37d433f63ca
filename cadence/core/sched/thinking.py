"""A thinking budget: after N thinking tokens the model must close its thinking.

A request with ``thinking_token_budget`` gets a ``ThinkingBudget`` in place of
its grammar (it implements the ``Grammar`` protocol of
``structured_output.py``), so the bitmask path that enforces grammars also
enforces the budget: drafts are validated against it, draft rows are filled
by stepping over them and back, async scheduling waits for the token in
flight, a preempted request keeps its state, each fork of ``n > 1`` gets its
own. The phases, one token at a time::

    OPENING --start_ids--> THINKING --N tokens--> CLOSING --forced_end_ids--> ANSWER
       |                       |                                                ^
       | (another token)       +------ the model writes end_ids itself ---------+
       +------------------------------------------------------------------------+

While THINKING every token is allowed (the request's grammar, if any, is for
the answer, not the thinking); CLOSING allows exactly the next forced token;
ANSWER is the request's grammar (or everything). OPENING, for a prompt that
left the thinking closed, allows the grammar's tokens plus ``start_ids[0]``,
and once the opening has begun, only its next token.

The bitmask is an int32 array [rows, words]: bit ``t % 32`` of word
``t // 32`` allows token ``t`` (what the grammar backends allocate). Pure
Python: rows are written by indexing, whatever array type it is.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

from cadence.sampling_params import ThinkingTokens

# Rollbacks undo drafts (at most the speculative tokens of a step), so only
# the last tokens' states are kept: a long thinking costs no memory per token.
MAX_ROLLBACK = 64


class Phase(enum.Enum):
    OPENING = "opening"
    THINKING = "thinking"
    CLOSING = "closing"
    ANSWER = "answer"


class _State(NamedTuple):
    phase: Phase
    num_thinking: int  # thinking tokens so far (OPENING: tokens of start_ids matched)
    num_forced: int  # forced tokens written so far (CLOSING)
    to_answer: bool  # whether the token was the answer grammar's (rolled back with it)


class ThinkingBudget:
    """One request's thinking budget, and then its answer's grammar (if any)."""

    def __init__(self, budget: int, tokens: ThinkingTokens, answer: Any = None) -> None:
        self.budget = budget
        self.tokens = tokens
        self.answer = answer  # the request's Grammar, or None
        self.phase = Phase.THINKING if tokens.starts_inside else Phase.OPENING
        self.num_thinking = 0
        self.num_forced = 0
        self._accepted: list[int] = []  # every token accepted, for the end's match
        self._history: list[_State] = []  # the state before each accepted token
        self._enter_thinking_if_spent()

    # ---- the Grammar protocol ------------------------------------------

    def accept_tokens(self, request_id: str, token_ids: list[int]) -> bool:
        for token in token_ids:
            if not self._accept_one(request_id, token):
                return False
        return True

    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        num_valid = 0
        for token in token_ids:
            if not self._accept_one("", token):
                break
            num_valid += 1
        self.rollback(num_valid)
        return list(token_ids[:num_valid])

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` (at most ``MAX_ROLLBACK``) accepted tokens."""
        num_answer = 0
        for _ in range(num_tokens):
            state = self._history.pop()
            self._accepted.pop()
            num_answer += state.to_answer
            self.phase, self.num_thinking, self.num_forced = state.phase, state.num_thinking, state.num_forced
        if num_answer and self.answer is not None:
            self.answer.rollback(num_answer)

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        if self.phase is Phase.THINKING:
            bitmask[row] = -1
        elif self.phase is Phase.CLOSING:
            allow_only(bitmask, row, self.tokens.forced_end_ids[self.num_forced])
        elif self.phase is Phase.OPENING and self.num_thinking:
            allow_only(bitmask, row, self.tokens.start_ids[self.num_thinking])
        else:  # ANSWER, or OPENING before its first token
            self._fill_answer(bitmask, row)
            if self.phase is Phase.OPENING:
                allow_also(bitmask, row, self.tokens.start_ids[0])

    def is_terminated(self) -> bool:
        return self.phase is Phase.ANSWER and self.answer is not None and self.answer.is_terminated()

    def can_fill_ahead(self, num_in_flight: int) -> bool:
        """Whether the mask after ``num_in_flight`` tokens not yet seen is
        known now (async scheduling need not wait for them): still thinking
        after them, or answering freely (a model that closes itself has no
        grammar to hand over to), and the budget not reached by them."""
        return (self.phase is Phase.THINKING and self.answer is None
                and self.num_thinking + num_in_flight < self.budget)

    # ---- internals ------------------------------------------------------

    def _accept_one(self, request_id: str, token: int) -> bool:
        before = _State(self.phase, self.num_thinking, self.num_forced, False)
        if self.phase is Phase.THINKING:
            self._think(token)
        elif self.phase is Phase.CLOSING:
            if token != self.tokens.forced_end_ids[self.num_forced]:
                return False
            self.num_forced += 1
            if self.num_forced == len(self.tokens.forced_end_ids):
                self.phase = Phase.ANSWER
        elif self.phase is Phase.OPENING and token == self.tokens.start_ids[self.num_thinking]:
            self.num_thinking += 1
            if self.num_thinking == len(self.tokens.start_ids):
                self.phase, self.num_thinking = Phase.THINKING, 0
                self._enter_thinking_if_spent()
        elif self.phase is Phase.OPENING and self.num_thinking:
            return False  # an opening begun must be finished
        else:  # ANSWER, or OPENING left for the answer at once
            if self.answer is not None and not self.answer.accept_tokens(request_id, [token]):
                return False
            self.phase = Phase.ANSWER
            before = before._replace(to_answer=self.answer is not None)
        self._history.append(before)
        self._accepted.append(token)
        if len(self._history) > 2 * MAX_ROLLBACK:
            del self._history[:-MAX_ROLLBACK]
            del self._accepted[:-MAX_ROLLBACK]
        return True

    def _think(self, token: int) -> None:
        self.num_thinking += 1
        end_ids = self.tokens.end_ids
        tail = self._accepted[1 - len(end_ids):] if len(end_ids) > 1 else []
        if tuple(tail) + (token,) == end_ids:
            self.phase = Phase.ANSWER  # the model closed its thinking itself
        elif self.num_thinking >= self.budget:
            self.phase, self.num_forced = Phase.CLOSING, 0

    def _enter_thinking_if_spent(self) -> None:
        if self.phase is Phase.THINKING and self.num_thinking >= self.budget:
            self.phase, self.num_forced = Phase.CLOSING, 0  # a budget of 0: close at once

    def _fill_answer(self, bitmask: Any, row: int) -> None:
        if self.answer is None:
            bitmask[row] = -1
        else:
            self.answer.fill_bitmask(bitmask, row)


def _signed_bit(bit: int) -> int:
    """The int32 value whose only set bit is ``bit`` (bit 31 is negative)."""
    word = 1 << bit
    return word - (1 << 32) if bit == 31 else word


def allow_only(bitmask: Any, row: int, token: int) -> None:
    """Row ``row`` allows ``token`` alone."""
    bitmask[row] = 0
    bitmask[row, token // 32] = _signed_bit(token % 32)


def allow_also(bitmask: Any, row: int, token: int) -> None:
    """Row ``row`` allows ``token`` besides what it allowed."""
    word = int(bitmask[row, token // 32]) | _signed_bit(token % 32)
    bitmask[row, token // 32] = word - (1 << 32) if word >= 1 << 31 else word
