"""xgrammar (vLLM's and SGLang's default): grammars compiled to token-level
automata ahead of time, masks in a few microseconds."""

from __future__ import annotations

from typing import Any

import xgrammar

from cadence.sampling_params import StructuredOutputParams
from cadence.structured.backend import (
    ANY_JSON_OBJECT, PARALLEL_FILL_MIN_ROWS, GrammarBackendBase, choice_alternatives, fill_threads, is_gbnf,
    parse_schema, reraise_unless_library_failure,
)

COMPILE_THREADS = 2


class XGrammarBackend(GrammarBackendBase):
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        super().__init__(tokenizer, vocab_size)
        self._batch: xgrammar.BatchGrammarMatcher | None = None

    def _build_state(self) -> xgrammar.GrammarCompiler:
        tokenizer = self.tokenizer
        special = set(tokenizer.all_special_ids)
        # Raw bytes per id; special tokens as "" (xgrammar never allows those
        # inside text), padded to the logits' width.
        vocab = [b"" if i in special else tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        vocab += [b""] * (self.vocab_size - len(vocab))
        info = xgrammar.TokenizerInfo(
            vocab, vocab_type=xgrammar.VocabType.RAW, vocab_size=self.vocab_size,
            stop_token_ids=list(tokenizer.eos_token_ids) or None,
        )
        return xgrammar.GrammarCompiler(info, max_threads=COMPILE_THREADS)

    def _compile_source(self, compiler: xgrammar.GrammarCompiler,
                        params: StructuredOutputParams) -> xgrammar.CompiledGrammar:
        kind = params.kind
        try:
            if kind == "json":
                parse_schema(params)
                return compiler.compile_json_schema(params.json, any_whitespace=False)
            if kind == "json_object":
                return compiler.compile_json_schema(ANY_JSON_OBJECT, any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_grammar(
                    choice_alternatives(params.choice, lambda alts: f"root ::= {alts}"))
            if is_gbnf(params.grammar):
                return compiler.compile_grammar(params.grammar)
            return compiler.compile_lark(params.grammar)
        except RuntimeError as err:  # xgrammar reports bad input this way
            raise ValueError(f"structured_outputs.{kind}: {_message(err)}") from None

    def fill_bitmask_rows(self, grammars: list["XGrammarGrammar"], rows: list[int], bitmask: Any) -> None:
        if len(grammars) < PARALLEL_FILL_MIN_ROWS:
            return super().fill_bitmask_rows(grammars, rows, bitmask)
        if self._batch is None:
            self._batch = xgrammar.BatchGrammarMatcher(fill_threads())
        self._batch.batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask, rows)

    def _new_grammar(self, compiler: Any, compiled: xgrammar.CompiledGrammar) -> "XGrammarGrammar":
        return XGrammarGrammar(xgrammar.GrammarMatcher(compiled))

    def _probe(self, compiler: Any, compiled: xgrammar.CompiledGrammar, params: StructuredOutputParams) -> None:
        # xgrammar's masks allow only tokens that lead somewhere, a stop where the
        # output may end: a first mask allowing nothing means nothing satisfies it.
        bitmask = xgrammar.allocate_token_bitmask(1, self.vocab_size)
        xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
        if not bitmask.any():
            raise ValueError(f"structured_outputs.{params.kind}: no output satisfies this constraint")


def _message(err: RuntimeError) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(err).strip()
    head, sep, rest = text.partition(": ")
    return rest if sep and head.endswith(tuple("0123456789")) and ".cc:" in head else text


class XGrammarGrammar:
    """One request's matcher."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: xgrammar.GrammarMatcher) -> None:
        self.matcher = matcher

    def accept_tokens(self, request_id: str, token_ids: list[int]) -> bool:
        # A failure inside the library refuses: it ends this request, not the engine.
        try:
            for i, token in enumerate(token_ids):
                if not self.matcher.accept_token(token):
                    self.rollback(i)  # as before the call
                    return False
            return True
        except BaseException as err:
            reraise_unless_library_failure(err)
            return False

    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        num_valid = 0
        try:
            for token in token_ids:
                if not self.matcher.accept_token(token):
                    break
                num_valid += 1
            self.rollback(num_valid)
        except BaseException as err:
            reraise_unless_library_failure(err)
            return []
        return token_ids[:num_valid]

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()
