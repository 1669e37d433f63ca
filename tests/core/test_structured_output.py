"""Structured output: requests wait in WAITING_FOR_FSM until their grammar is
compiled; each step carries a grammar bitmask for the structured requests."""

from __future__ import annotations

import threading

import pytest
from tests.core.fakes import (
    FakeRunner, all_blocks_free, greedy_token, new_request, new_scheduler, run_until_done, step, wait_until,
)

from cadence.config import SpeculativeConfig
from cadence.core.request import FinishReason, RequestStatus
from cadence.core.sched.structured_output import StructuredOutputManager
from cadence.sampling_params import StructuredOutputParams


class FakeGrammar:
    def __init__(self, name: str, stop_token: int | None) -> None:
        self.name = name
        self.stop_token = stop_token
        self.accepted: list[int] = []
        self.accept_calls: list[tuple[str, list[int]]] = []
        self.filled_rows: list[int] = []
        self.seen_at_fill: list[tuple[int, ...]] = []  # the accepted tokens at each fill

    def accept_tokens(self, request_id: str, token_ids: list[int]) -> bool:
        self.accept_calls.append((request_id, list(token_ids)))
        self.accepted.extend(token_ids)
        return True

    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        return list(token_ids)

    def rollback(self, num_tokens: int) -> None:
        del self.accepted[len(self.accepted) - num_tokens:]

    def fill_bitmask(self, bitmask: list[set], row: int) -> None:
        self.filled_rows.append(row)
        self.seen_at_fill.append(tuple(self.accepted))
        bitmask[row].add(f"allowed-by-{self.name}")

    def is_terminated(self) -> bool:
        return self.stop_token is not None and self.stop_token in self.accepted


class FakeGrammarBackend:
    """compile() blocks until the test opens the regex's gate."""

    def __init__(self, stop_tokens: dict[str, int] | None = None) -> None:
        self.stop_tokens = stop_tokens or {}
        self.gates: dict[str, threading.Event] = {}
        self.grammars: dict[str, FakeGrammar] = {}
        self.bitmasks: list[list[set]] = []
        self.failing: set[str] = set()
        self._lock = threading.Lock()

    def gate(self, regex: str) -> threading.Event:
        with self._lock:
            return self.gates.setdefault(regex, threading.Event())

    def open(self, *regexes: str) -> None:
        for regex in regexes:
            self.gate(regex).set()

    def compile(self, params: StructuredOutputParams) -> FakeGrammar:
        self.gate(params.regex).wait(timeout=10)
        if params.regex in self.failing:
            raise RuntimeError(f"cannot compile {params.regex!r}")
        grammar = FakeGrammar(params.regex, self.stop_tokens.get(params.regex))
        self.grammars[params.regex] = grammar
        return grammar

    def fill_bitmask_rows(self, grammars: list[FakeGrammar], rows: list[int], bitmask: list[set]) -> None:
        for grammar, row in zip(grammars, rows):
            grammar.fill_bitmask(bitmask, row)

    def allocate_bitmask(self, num_rows: int) -> list[set]:
        bitmask = [set() for _ in range(num_rows)]
        self.bitmasks.append(bitmask)
        return bitmask


@pytest.fixture
def backend():
    backend = FakeGrammarBackend()
    yield backend
    for gate in list(backend.gates.values()):
        gate.set()  # never leave a compile thread blocked


def structured(req_id: str, regex: str, prompt=8, **kwargs):
    return new_request(req_id, prompt, structured_outputs=StructuredOutputParams(regex=regex), **kwargs)


def grammar_ready(request) -> bool:
    so = request.structured_output_request
    return so is not None and so._future.done()


def make(backend, **kwargs):
    manager = StructuredOutputManager(backend, max_workers=4)
    return new_scheduler(structured_output_manager=manager, **kwargs)


def test_request_waits_for_its_grammar_while_others_run(backend):
    s = make(backend)
    s.add_request(structured("s", "r1", max_tokens=3))
    s.add_request(new_request("p1", 8, max_tokens=3))
    s.add_request(new_request("p2", 6, max_tokens=3))
    request = s.requests["s"]
    assert request.status == RequestStatus.WAITING_FOR_FSM
    runner = FakeRunner()
    for _ in range(2):
        so, _ = step(s, runner)
        assert "s" not in so.num_scheduled_tokens
        assert request.status == RequestStatus.WAITING_FOR_FSM
        assert request.num_computed_tokens == 0
        assert so.structured_output_request_ids == {}
        assert so.grammar_bitmask is None
        assert [r.request_id for r in s.waiting] == ["s"]  # kept at the head
    assert s.kv_cache_manager.get_block_ids("s") == []

    backend.open("r1")
    wait_until(lambda: grammar_ready(request))
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"p1": 1, "p2": 1, "s": 8}
    assert [n.req_id for n in so.scheduled_new_reqs] == ["s"]
    assert request.status == RequestStatus.RUNNING
    assert so.structured_output_request_ids == {"s": 0}
    assert so.grammar_bitmask == [{"allowed-by-r1"}]


def test_bitmask_rows_cover_only_the_structured_requests(backend):
    s = make(backend)
    s.add_request(structured("s1", "r1"))
    s.add_request(new_request("plain", 8))
    s.add_request(structured("s2", "r2"))
    backend.open("r1", "r2")
    wait_until(lambda: all(grammar_ready(s.requests[r]) for r in ("s1", "s2")))
    runner = FakeRunner()
    for _ in range(3):
        so, _ = step(s, runner)
        assert set(so.num_scheduled_tokens) == {"s1", "plain", "s2"}
        assert so.structured_output_request_ids == {"s1": 0, "s2": 1}
        assert so.grammar_bitmask == [{"allowed-by-r1"}, {"allowed-by-r2"}]
    assert backend.grammars["r1"].filled_rows == [0, 0, 0]
    assert backend.grammars["r2"].filled_rows == [1, 1, 1]
    assert len(backend.bitmasks) == 3  # one bitmask per step


def test_no_bitmask_in_steps_without_structured_requests(backend):
    s = make(backend)
    s.add_request(new_request("plain", 8))
    so, _ = step(s, FakeRunner())
    assert so.structured_output_request_ids == {}
    assert so.grammar_bitmask is None
    assert backend.bitmasks == []


def test_sampled_tokens_reach_the_grammar(backend):
    s = make(backend)
    s.add_request(structured("s", "r1", prompt=6, max_tokens=4))
    s.add_request(new_request("plain", 6, max_tokens=4))
    backend.open("r1")
    wait_until(lambda: grammar_ready(s.requests["s"]))
    script = iter([501, 502, 503, 504])
    runner = FakeRunner(lambda rid, toks: next(script) if rid == "s" else greedy_token(rid, toks))
    streamed = []
    for _ in range(4):
        _, outputs = step(s, runner)
        streamed += [t for o in outputs if o.request_id == "s" for t in o.new_token_ids]
    grammar = backend.grammars["r1"]
    assert streamed == [501, 502, 503, 504]
    # The last token stopped the request on max_tokens; the ones before reached the grammar.
    assert grammar.accepted[:3] == [501, 502, 503]
    assert all(req_id == "s" for req_id, _ in grammar.accept_calls)


def test_terminated_grammar_stops_the_request(backend):
    backend.stop_tokens["r1"] = 7
    s = make(backend)
    s.add_request(structured("s", "r1", prompt=6, max_tokens=10))
    backend.open("r1")
    wait_until(lambda: grammar_ready(s.requests["s"]))
    script = iter([5, 6, 7, 8, 9])
    runner = FakeRunner(lambda rid, toks: next(script))
    outputs = []
    for _ in range(3):
        _, step_outputs = step(s, runner)
        outputs += step_outputs
    assert [o.new_token_ids for o in outputs] == [[5], [6], [7]]
    assert [o.finish_reason for o in outputs] == [None, None, FinishReason.STOP]
    assert backend.grammars["r1"].accepted == [5, 6, 7]
    assert not s.has_unfinished_requests()
    so = s.schedule()
    assert so.finished_req_ids == {"s"}
    assert so.num_scheduled_tokens == {}
    assert all_blocks_free(s)


def test_structured_request_without_a_manager_is_refused():
    s = new_scheduler()
    with pytest.raises(ValueError, match="structured_outputs"):
        s.add_request(structured("s", "r1"))
    assert "s" not in s.requests
    assert not s.has_unfinished_requests()


def test_failed_grammar_does_not_break_the_step(backend):
    backend.failing.add("bad")
    s = make(backend)
    s.add_request(structured("s", "bad"))
    s.add_request(new_request("plain", 8))
    request = s.requests["s"]
    backend.open("bad")
    wait_until(lambda: grammar_ready(request))
    so, _ = step(s, FakeRunner())
    assert so.num_scheduled_tokens == {"plain": 8}
    # The request ends (aborted) instead of taking the engine down.
    assert request.is_finished()
    assert [r.request_id for r in s.waiting] == []
    assert request.stop_reason == "structured_outputs: cannot compile 'bad'"


def test_a_structured_request_with_drafts_gets_a_mask_row_per_draft(backend):
    """Row j of a request's block is the grammar's mask after drafts[:j]; the
    grammar steps over the drafts to fill them and back, and advances only on
    what the step accepted."""
    s = make(backend, speculative_config=SpeculativeConfig(num_speculative_tokens=2))
    s.add_request(structured("s1", "r1", prompt=6, max_tokens=8))
    s.add_request(structured("s2", "r2", prompt=6, max_tokens=8))
    backend.open("r1", "r2")
    wait_until(lambda: all(grammar_ready(s.requests[r]) for r in ("s1", "s2")))
    # The target samples 70, 71, 72, ...; s1's drafts are right, s2's are wrong.
    runner = FakeRunner(lambda rid, toks: 70 + len(toks) - 6,
                        draft_fn=lambda rid, toks: ([70 + len(toks) - 6, 71 + len(toks) - 6]
                                                    if rid == "s1" else [5, 5]))
    step(s, runner)  # the prompts; drafts proposed
    r1, r2 = backend.grammars["r1"], backend.grammars["r2"]
    assert r1.accepted == [70] and r2.accepted == [70]
    so, _ = step(s, runner)
    assert so.scheduled_spec_decode_tokens == {"s1": [71, 72], "s2": [5, 5]}
    assert so.structured_output_request_ids == {"s1": 0, "s2": 3}
    assert len(so.grammar_bitmask) == 6
    assert r1.filled_rows[-3:] == [0, 1, 2]
    assert r1.seen_at_fill[-3:] == [(70,), (70, 71), (70, 71, 72)]
    assert r2.filled_rows[-3:] == [3, 4, 5]
    assert r2.seen_at_fill[-3:] == [(70,), (70, 5), (70, 5, 5)]
    # Advanced by what was accepted: s1 all its drafts and the bonus token, s2 one token.
    assert r1.accepted == [70, 71, 72, 73]
    assert r2.accepted == [70, 71]


def test_a_grammar_that_refuses_a_sampled_token_aborts_its_request(backend):
    s = make(backend)
    s.add_request(structured("s", "r1", prompt=6, max_tokens=8))
    s.add_request(new_request("plain", 6, max_tokens=3))
    backend.open("r1")
    wait_until(lambda: grammar_ready(s.requests["s"]))
    grammar_refuses = lambda request_id, token_ids: False  # noqa: E731
    runner = FakeRunner()
    step(s, runner)
    backend.grammars["r1"].accept_tokens = grammar_refuses
    _, outputs = step(s, runner)
    finished = {o.request_id: o for o in outputs if o.finish_reason is not None}
    assert finished["s"].finish_reason == FinishReason.ABORT
    assert "refused a sampled token" in finished["s"].stop_reason
    run_until_done(s, runner)
    assert all_blocks_free(s)
