"""Structured output in the scheduler: grammar readiness and the batch bitmask.

A request with ``structured_outputs`` waits in ``WAITING_FOR_FSM`` until its
grammar is compiled (compilation runs off the step loop). Each step the
manager asks every scheduled grammar for its allowed-token mask; the runner
applies the mask to the logits. After sampling, accepted tokens advance the
grammar; a grammar that reached its end stops the request.

The grammar library is native code a request drives: an exception (or a
Rust panic) while a grammar fills its mask ends that request, never the
step. The failed grammar refuses every token from then on, so the request
is aborted when its next token is absorbed.

The grammar backend (e.g. xgrammar) lives outside ``cadence.core``; this
module only fixes the protocol it implements.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from cadence.core.compiled import mypyc_attr
from cadence.core.request import Request
from cadence.core.sched.thinking import ThinkingBudget

logger = logging.getLogger("cadence.structured")


class Grammar(Protocol):
    def accept_tokens(self, request_id: str, token_ids: list[int]) -> bool:
        """Advance over ``token_ids``; False (and no advance past it) at a token it refuses."""
        ...
    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        """The longest prefix of ``token_ids`` the grammar accepts (not advancing)."""
        ...
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        ...
    def fill_bitmask(self, bitmask: Any, row: int) -> None: ...
    def is_terminated(self) -> bool: ...


class GrammarBackend(Protocol):
    def compile(self, params: Any) -> Grammar: ...
    def allocate_bitmask(self, num_rows: int) -> Any: ...
    def fill_bitmask_rows(self, grammars: list[Grammar], rows: list[int], bitmask: Any) -> None:
        """``grammars[i].fill_bitmask(bitmask, rows[i])`` for all, maybe in parallel."""
        ...


class RefusingGrammar:
    """What a grammar becomes once the library failed inside it: it refuses every token."""

    def accept_tokens(self, request_id: str, token_ids: list[int]) -> bool:
        return False

    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        return []

    def rollback(self, num_tokens: int) -> None:
        pass

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        pass  # the row stays as allocated; the token sampled there is refused

    def is_terminated(self) -> bool:
        return False


class StructuredOutputRequest:
    """A request's grammar, available once compilation finished."""

    def __init__(self, future: Future) -> None:
        self._future = future
        self._runtime_error = ""  # see fail

    @property
    def grammar(self) -> Grammar | None:
        """The compiled grammar; None while compiling or if compilation failed."""
        if not self._future.done() or self._future.exception() is not None:
            return None
        return RefusingGrammar() if self._runtime_error else self._future.result()

    def fail(self, reason: str) -> None:
        """The library failed inside this grammar: from now on it refuses every token."""
        self._runtime_error = reason

    @property
    def failed(self) -> bool:
        return self._future.done() and self._future.exception() is not None

    @property
    def error(self) -> str:
        """Why compilation failed, for the client ("" when it did not)."""
        return str(self._future.exception()) if self.failed else ""


@mypyc_attr(allow_interpreted_subclasses=True)  # (tests step its compiles by hand)
class StructuredOutputManager:
    """Compiles grammars in a thread and builds each step's bitmask."""

    def __init__(self, backend: GrammarBackend, max_workers: int = 1) -> None:
        self.backend = backend
        self._executor = ThreadPoolExecutor(max_workers=max_workers)

    def grammar_init(self, request: Request) -> None:
        params = request.sampling_params
        if params.thinking_token_budget is None:
            future = self._executor.submit(self.backend.compile, params.structured_outputs)
        elif params.structured_outputs is None:
            future = Future()  # nothing to compile: ready at once
            future.set_result(self._thinking_budget(request, None))
        else:
            future = self._executor.submit(
                lambda: self._thinking_budget(request, self.backend.compile(params.structured_outputs)))
        request.structured_output_request = StructuredOutputRequest(future)

    @staticmethod
    def _thinking_budget(request: Request, answer: Grammar | None) -> ThinkingBudget:
        """The budget's state, in front of the answer's grammar (thinking.py)."""
        params = request.sampling_params
        # Validated together (SamplingParams): a budget comes with the model's thinking tokens.
        assert params.thinking_token_budget is not None and params.thinking is not None
        return ThinkingBudget(params.thinking_token_budget, params.thinking, answer)

    def grammar_bitmask(
        self,
        requests: dict[str, Request],
        structured_output_request_ids: dict[str, int],
        scheduled_spec_decode_tokens: dict[str, list[int]],
    ) -> Any:
        """The allowed tokens of every logits row of the structured requests.

        A request has 1 + len(drafts) rows from its first row on (see
        ``StepPlan.structured_output_request_ids``): row j is the mask after
        its drafts[:j], so the grammar steps over the drafts and back.
        None when no structured request is in the batch.
        """
        if not structured_output_request_ids:
            return None
        num_rows = sum(1 + len(scheduled_spec_decode_tokens.get(req_id, ()))
                       for req_id in structured_output_request_ids)
        bitmask = self.backend.allocate_bitmask(num_rows)
        grammars, rows, req_ids = [], [], []
        for req_id, row in structured_output_request_ids.items():
            grammar = requests[req_id].structured_output_request.grammar
            if isinstance(grammar, ThinkingBudget):  # not the backend's: it fills its own row
                _guarded(requests[req_id], grammar.fill_bitmask, bitmask, row)
            else:
                grammars.append(grammar)
                rows.append(row)
                req_ids.append(req_id)
        try:
            self.backend.fill_bitmask_rows(grammars, rows, bitmask)
        except BaseException as err:
            _reraise_interrupt(err)
            # Again row by row, so that only the failing grammars' requests end.
            for grammar, req_id, row in zip(grammars, req_ids, rows):
                _guarded(requests[req_id], grammar.fill_bitmask, bitmask, row)
        if scheduled_spec_decode_tokens:
            for req_id, row in structured_output_request_ids.items():
                drafts = scheduled_spec_decode_tokens.get(req_id)
                if drafts:
                    so = requests[req_id].structured_output_request  # a grammar that failed above refuses
                    _guarded(requests[req_id], self._fill_draft_rows, so.grammar, req_id, drafts, bitmask, row)
        return bitmask

    @staticmethod
    def _fill_draft_rows(grammar: Grammar, req_id: str, drafts: list[int], bitmask: Any, row: int) -> None:
        """Rows ``row + 1 ...``: the masks after each accepted draft; then back."""
        num_accepted = 0
        for draft in drafts:
            if not grammar.accept_tokens(req_id, [draft]):
                # (Rare: drafts are validated.) Its own row refuses it, so the
                # target rejects it there and the rows after go unused.
                break
            num_accepted += 1
            grammar.fill_bitmask(bitmask, row + num_accepted)
        grammar.rollback(num_accepted)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def can_fill_ahead(request: Request) -> bool:
    """Whether the request's next mask is known before its tokens in flight
    come back (async scheduling); only a thinking budget's may be."""
    grammar = request.structured_output_request.grammar
    return isinstance(grammar, ThinkingBudget) and grammar.can_fill_ahead(request.num_output_placeholders)


def _guarded(request: Request, fill: Any, *args: Any) -> None:
    """``fill(*args)``; a failure inside the grammar library fails ``request``'s grammar."""
    try:
        fill(*args)
    except BaseException as err:
        _reraise_interrupt(err)
        logger.warning("cadence: the grammar library failed on request %s (%s: %s); it ends",
                       request.request_id, type(err).__name__, str(err)[:200])
        request.structured_output_request.fail(f"the grammar library failed ({type(err).__name__})")


def _reraise_interrupt(err: BaseException) -> None:
    """Any exception, and a Rust panic (pyo3 raises a ``BaseException``), is the
    library's failure; an interrupt or an exit goes on up."""
    if isinstance(err, (KeyboardInterrupt, SystemExit, GeneratorExit)):
        raise err
