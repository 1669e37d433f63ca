"""llguidance: grammars as Lark text, a lazy parser per request (~50 µs a mask)."""

from __future__ import annotations

from typing import Any

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

from cadence.sampling_params import StructuredOutputParams
from cadence.structured.backend import (
    ANY_JSON_OBJECT, PARALLEL_FILL_MIN_ROWS, PROBE_STEPS, GrammarBackendBase, choice_alternatives, fill_threads,
    is_gbnf, library_message, parse_schema, reraise_unless_library_failure, strict_schema,
)

# Compact JSON ("," and ":" between items, no free whitespace): a small
# model given room for whitespace may spend its whole budget on it.
JSON_OPTIONS = {"whitespace_flexible": False}
# llguidance's own limits, with short errors (no parser state: it quotes the grammar).
LIMITS = llguidance.LLParserLimits(verbose_errors=False)
# What llguidance reports when no token can extend the output: nothing satisfies the grammar.
NOTHING_EXTENDS = "NoExtensionBias"


class LLGuidanceBackend(GrammarBackendBase):
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        super().__init__(tokenizer, vocab_size)
        self._executor: llguidance.LLExecutor | None = None

    def _build_state(self) -> llguidance.LLTokenizer:
        # The tokenizer's own JSON: llguidance reads its vocabulary, merges and special tokens.
        return llguidance.LLTokenizer(
            self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
            eos_token=list(self.tokenizer.eos_token_ids) or None,
        )

    def _compile_source(self, state: llguidance.LLTokenizer, params: StructuredOutputParams) -> str:
        grammar = _grammar_text(params)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, state, limits=LIMITS)
        if is_error:
            raise ValueError(f"structured_outputs.{params.kind}: {library_message(messages[0])}")
        return grammar

    def _probe(self, state: llguidance.LLTokenizer, compiled: str, params: StructuredOutputParams) -> None:
        field = f"structured_outputs.{params.kind}"
        matcher = llguidance.LLMatcher(state, compiled, log_level=0, limits=LIMITS)
        stops = set(self.tokenizer.eos_token_ids)
        for step in range(PROBE_STEPS):
            token = _first_allowed(matcher.compute_bitmask(), stops)
            error = matcher.get_error()
            if error:
                if step == 0 and error.startswith(NOTHING_EXTENDS):
                    raise ValueError(f"{field}: no output satisfies this constraint")
                raise ValueError(f"{field}: the grammar library cannot follow this constraint "
                                 f"({library_message(error)})")
            if matcher.is_accepting():
                return
            if token is None:
                if step == 0:  # only a stop, and the empty output is not accepted
                    raise ValueError(f"{field}: no output satisfies this constraint")
                return  # a dead end on this path only: other paths may go on
            matcher.consume_token(token)

    def fill_bitmask_rows(self, grammars: list["LLGuidanceGrammar"], rows: list[int], bitmask: Any) -> None:
        if len(grammars) < PARALLEL_FILL_MIN_ROWS:
            return super().fill_bitmask_rows(grammars, rows, bitmask)
        if self._executor is None:
            self._executor = llguidance.LLExecutor(fill_threads())
        # One call for the batch; llguidance's threads fill the rows without the GIL.
        self._executor.unsafe_compute_mask_ptr(
            [(g.matcher, row) for g, row in zip(grammars, rows)], bitmask.data_ptr(),
            bitmask.shape[1] * 4, bitmask.shape[0])

    def _new_grammar(self, state: llguidance.LLTokenizer, compiled: str) -> "LLGuidanceGrammar":
        matcher = llguidance.LLMatcher(state, compiled, log_level=0, limits=LIMITS)
        if matcher.is_error():
            raise ValueError(f"structured_outputs: {library_message(matcher.get_error())}")
        return LLGuidanceGrammar(matcher)


def _first_allowed(mask: bytes, skip: set[int]) -> int | None:
    """The lowest token id that ``mask`` (bit t of byte t // 8) allows, besides ``skip``."""
    for i, byte in enumerate(mask):
        while byte:
            low = byte & -byte
            token = i * 8 + low.bit_length() - 1
            if token not in skip:
                return token
            byte ^= low
    return None


def _grammar_text(params: StructuredOutputParams) -> str:
    kind = params.kind
    if kind == "json":
        schema = strict_schema(parse_schema(params))
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        # One terminal, not one rule per string: the lexer matches the strings as
        # one automaton, where parser rows of 20,000 alternatives pass
        # llguidance's limit on a row's items (and 100,000 its symbol count).
        return llguidance.LLMatcher.grammar_from_lark(
            choice_alternatives(params.choice, lambda alts: f"start: CHOICE\nCHOICE: {alts}"))
    lark = gbnf_to_lark(params.grammar) if is_gbnf(params.grammar) else params.grammar
    return llguidance.LLMatcher.grammar_from_lark(lark)


class LLGuidanceGrammar:
    """One request's parser state."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept_tokens(self, request_id: str, token_ids: list[int]) -> bool:
        # A refused token would leave llguidance's matcher in an error state for
        # good: check first, so a refusal changes nothing (as the protocol says).
        # A failure inside the library refuses too: it ends this request, not the engine.
        try:
            if self.matcher.validate_tokens(token_ids) < len(token_ids):
                return False
            return self.matcher.consume_tokens(token_ids)
        except BaseException as err:
            reraise_unless_library_failure(err)
            return False

    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        try:
            return token_ids[: self.matcher.validate_tokens(token_ids)]
        except BaseException as err:
            reraise_unless_library_failure(err)
            return []

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        words = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()
