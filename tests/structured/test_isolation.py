"""Issue 30: what a request's constraint may cost the grammar library, and
where a failure inside the library ends.

- sizes (bytes, rules, choices) refused with the option's name;
- constraints nothing satisfies (an empty regex class, a $ref cycle) refused
  at check time, where the empty output alone is still fine;
- the check in a worker process: a crash (a real SIGSEGV) or a timeout is
  one ValueError, cached, and the next check gets a new worker;
- in the engine, a grammar whose mask fill raises ends its request only.
"""

from __future__ import annotations

import threading
import time

import pytest
from tests.core.fakes import FakeRunner, all_blocks_free, new_request, run_until_done, step, wait_until
from tests.core.test_structured_output import FakeGrammarBackend, grammar_ready, make, structured

from cadence.config import EngineConfig
from cadence.core.request import FinishReason
from cadence.engine.outputs import CompletionOutput, RequestOutput
from cadence.models import Tokenizer, default_model_path
from cadence.models.gguf_loader import read_gguf
from cadence.sampling_params import StructuredOutputParams
from cadence.server.errors import GenerationFailed
from cadence.server.serving import raise_if_failed
from cadence.structured import GrammarLimits, IsolatedGrammarChecker, make_grammar_backend
from cadence.structured.limits import check_size, count_rules, unsatisfiable_schema_reason

BACKENDS = ("llguidance", "xgrammar")
NUM_PADDED_IDS = 64
LIMITS = GrammarLimits.of(EngineConfig())


def chain(num_rules: int) -> str:
    rules = [f'r{i}: "x{i}" | r{i + 1}' for i in range(num_rules - 1)]
    return "\n".join(["start: r0", *rules, f'r{num_rules - 1}: "x{num_rules - 1}"'])


def ref_cycle(required: bool = True) -> dict:
    def node(other: str) -> dict:
        schema = {"type": "object", "properties": {other: {"$ref": f"#/$defs/{other}"}}}
        return {**schema, "required": [other]} if required else schema
    return {"$defs": {"a": node("b"), "b": node("a")}, "$ref": "#/$defs/a"}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(read_gguf(default_model_path())[1])


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request, tokenizer):
    pytest.importorskip(request.param)
    return make_grammar_backend(request.param, tokenizer, tokenizer.vocab_size + NUM_PADDED_IDS)


# ------------------------------------------------------------------ sizes


def test_limits_come_from_the_engine_options():
    config = EngineConfig(structured_outputs_max_bytes=10, structured_outputs_max_rules=2,
                          structured_outputs_max_choices=3, structured_outputs_compile_timeout_s=0.5)
    assert GrammarLimits.of(config) == GrammarLimits(10, 2, 3, 0.5)
    with pytest.raises(ValueError, match="^structured_outputs_max_choices: "):
        EngineConfig(structured_outputs_max_choices=0)
    with pytest.raises(ValueError, match="^structured_outputs_compile_timeout_s: "):
        EngineConfig(structured_outputs_compile_timeout_s=0)


@pytest.mark.parametrize("params, words", [
    (StructuredOutputParams(choice=[str(i) for i in range(LIMITS.max_choices + 1)]),
     f"{LIMITS.max_choices + 1} strings, more than this server's limit of {LIMITS.max_choices} "
     "(--structured-outputs-max-choices)"),
    (StructuredOutputParams(grammar=chain(LIMITS.max_rules)),  # + start
     f"{LIMITS.max_rules + 1} rules, more than this server's limit of {LIMITS.max_rules} "
     "(--structured-outputs-max-rules)"),
    (StructuredOutputParams(regex="a" * (LIMITS.max_bytes + 1)), "(--structured-outputs-max-bytes)"),
    (StructuredOutputParams(json={"description": "é" * (LIMITS.max_bytes // 2)}),
     "(--structured-outputs-max-bytes)"),
])
def test_a_constraint_over_a_limit_is_refused_naming_the_field_and_the_option(params, words):
    with pytest.raises(ValueError, match=f"^structured_outputs.{params.kind}: ") as err:
        check_size(params, LIMITS)
    assert words in str(err.value)


def test_constraints_within_the_limits_pass():
    check_size(StructuredOutputParams(choice=[str(i) for i in range(LIMITS.max_choices)]), LIMITS)
    check_size(StructuredOutputParams(grammar=chain(LIMITS.max_rules - 1)), LIMITS)
    check_size(StructuredOutputParams(json_object=True), LIMITS)


@pytest.mark.parametrize("grammar, num_rules", [
    ('start: "(" NUM ")"\nNUM: /[0-9]+/', 2),
    ("start: a\n    | b\n?a.2: \"x\"\nb: \"y\"  // b: c\n%import common.WS", 3),
    ('root ::= "(" num ")"\nnum ::= [0-9]+\nnum-list ::= num ("," num)*', 3),
])
def test_rules_are_counted_by_their_definitions(grammar, num_rules):
    assert count_rules(grammar) == num_rules


# ------------------------------------------------------------------ nothing satisfies it


def test_a_required_ref_cycle_has_no_value():
    assert "#/$defs/a, #/$defs/b" in unsatisfiable_schema_reason(ref_cycle())
    root_cycle = {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}
    assert unsatisfiable_schema_reason(root_cycle) is not None
    nonempty_tree = {"$defs": {"n": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/n"}}},
                     "$ref": "#/$defs/n"}
    assert unsatisfiable_schema_reason(nonempty_tree) is not None


@pytest.mark.parametrize("schema", [
    ref_cycle(required=False),  # {} ends it
    {"$defs": {"n": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
                     "required": ["kids"]}}, "$ref": "#/$defs/n"},  # [] ends it
    {"$defs": {"n": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"x": {"$ref": "#/$defs/n"}},
                                                  "required": ["x"]}]}}, "$ref": "#/$defs/n"},
    {"type": ["object", "null"], "properties": {"x": {"$ref": "#"}}, "required": ["x"]},
    {"properties": {"x": {"$ref": "#"}}, "required": ["x"]},  # untyped: a string satisfies it
    {"type": "object", "properties": {"x": {"$ref": "other.json#/a"}}, "required": ["x"]},
])
def test_a_ref_cycle_with_a_way_out_is_satisfiable(schema):
    assert unsatisfiable_schema_reason(schema) is None


@pytest.mark.parametrize("params, words", [
    (StructuredOutputParams(regex=r"[^\s\S]"), "no output satisfies this constraint"),
    (StructuredOutputParams(regex=r"ab[^\s\S]c"), "no output satisfies this constraint"),
    (StructuredOutputParams(json=ref_cycle()), "$ref cycle"),
])
def test_a_constraint_nothing_satisfies_is_refused_at_check(backend, params, words):
    if backend.name == "xgrammar" and params.kind == "regex" and params.regex != r"[^\s\S]":
        pytest.skip("xgrammar allows the tokens of a prefix that leads nowhere (no probe beyond the start)")
    with pytest.raises(ValueError, match=f"^structured_outputs.{params.kind}: ") as err:
        backend.check(params)
    assert words in str(err.value)


def test_a_constraint_of_only_the_empty_output_is_fine(backend):
    backend.check(StructuredOutputParams(regex="x{0}"))


def test_llguidance_refuses_a_grammar_it_cannot_follow(tokenizer):
    """2,000 right-recursive rules compile, then the first token's parser row
    passes llguidance's limit: found by the check's walk, not by a request."""
    llguidance = make_grammar_backend("llguidance", tokenizer, tokenizer.vocab_size)
    with pytest.raises(ValueError, match="^structured_outputs.grammar: the grammar library cannot follow"):
        llguidance.check(StructuredOutputParams(grammar=chain(2000)))
    with pytest.raises(ValueError, match="^structured_outputs.grammar: the grammar library cannot follow"):
        llguidance.check(StructuredOutputParams(grammar='start: a\na: "x" a'))  # no end
    llguidance.check(StructuredOutputParams(grammar=chain(300)))


def test_llguidance_follows_a_long_choice_list_to_its_end(tokenizer):
    llguidance = make_grammar_backend("llguidance", tokenizer, tokenizer.vocab_size)
    choices = [f"item number {i}" for i in range(20_000)]
    grammar = llguidance.compile(StructuredOutputParams(choice=choices))
    # "item number 1999", which "item number 19990" ... extend: a stop ends it.
    assert grammar.accept_tokens("r", tokenizer.encode(choices[1999], add_special_tokens=False))
    assert not grammar.is_terminated()
    assert grammar.accept_tokens("r", [tokenizer.eos_token_ids[0]])
    assert grammar.is_terminated()


def test_library_messages_lose_their_backtrace(tokenizer):
    llguidance = make_grammar_backend("llguidance", tokenizer, tokenizer.vocab_size)
    with pytest.raises(ValueError) as err:
        llguidance.check(StructuredOutputParams(grammar="start: missing"))
    assert "\n<" not in str(err.value) and len(str(err.value)) < 400


# ------------------------------------------------------------------ the worker


@pytest.fixture
def checker(tokenizer):
    checker = IsolatedGrammarChecker("llguidance", tokenizer, tokenizer.vocab_size,
                                     GrammarLimits(10**7, 10**6, 10**6, 20.0))
    yield checker
    checker.close()


def test_a_crash_in_the_grammar_library_fails_one_check_and_the_next_gets_a_new_worker(checker):
    yes_no = StructuredOutputParams(choice=["yes", "no"])
    checker.check(yes_no)
    assert checker.num_worker_starts == 1
    crash = StructuredOutputParams(grammar=chain(5000))  # overflows llguidance's stack: SIGSEGV
    with pytest.raises(ValueError, match="^structured_outputs.grammar: the grammar could not be compiled: "
                                         "the grammar library crashed .*SIGSEGV"):
        checker.check(crash)
    checker.check(StructuredOutputParams(regex="[0-9]+"))
    assert checker.num_worker_starts == 2
    with pytest.raises(ValueError, match="crashed"):  # answered from the cache: no new crash
        checker.check(crash)
    assert checker.num_worker_starts == 2
    with pytest.raises(ValueError, match="^structured_outputs.regex: no output satisfies"):
        checker.check(StructuredOutputParams(regex=r"[^\s\S]"))


def test_a_compile_past_the_timeout_is_refused_and_the_worker_replaced(tokenizer):
    checker = IsolatedGrammarChecker("llguidance", tokenizer, tokenizer.vocab_size,
                                     GrammarLimits(10**8, 10**6, 10**6, 0.2))
    try:
        slow = StructuredOutputParams(choice=[f"a long choice number {i}" for i in range(150_000)])
        checker.check(StructuredOutputParams(choice=["yes", "no"]))  # the worker's start is not timed
        with pytest.raises(ValueError, match=r"^structured_outputs.choice: .* timed out after 0.2 s "
                                             r"\(--structured-outputs-compile-timeout-s\)"):
            checker.check(slow)
        checker.check(StructuredOutputParams(regex="[a-z]+"))
        assert checker.num_worker_starts == 2
    finally:
        checker.close()


def test_a_cached_answer_does_not_wait_behind_a_compile(tokenizer):
    """add_request checks again on the server's event loop: a cached answer
    must come at once even while another constraint compiles in the worker."""
    checker = IsolatedGrammarChecker("llguidance", tokenizer, tokenizer.vocab_size,
                                     GrammarLimits(10**8, 10**6, 10**6, 20.0))
    try:
        yes_no = StructuredOutputParams(choice=["yes", "no"])
        checker.check(yes_no)
        # ~1 s, then refused (past llguidance's lexer budget): either way, slow.
        slow = StructuredOutputParams(choice=[f"a long choice number {i}" for i in range(200_000)])
        compiling = threading.Thread(target=lambda: pytest.raises(ValueError, checker.check, slow))
        compiling.start()
        time.sleep(0.1)
        start = time.monotonic()
        checker.check(yes_no)
        assert time.monotonic() - start < 0.1
        assert compiling.is_alive()
        compiling.join(30)
    finally:
        checker.close()


def test_sizes_are_checked_before_the_worker_starts(tokenizer):
    checker = IsolatedGrammarChecker("llguidance", tokenizer, tokenizer.vocab_size, GrammarLimits(10, 1, 2, 5.0))
    with pytest.raises(ValueError, match="--structured-outputs-max-choices"):
        checker.check(StructuredOutputParams(choice=["a", "b", "c"]))
    assert checker.num_worker_starts == 0


# ------------------------------------------------------------------ in the engine


def test_a_grammar_whose_mask_fill_raises_ends_only_its_request():
    backend = FakeGrammarBackend()
    s = make(backend)
    s.add_request(structured("bad", "r1", prompt=6, max_tokens=8))
    s.add_request(structured("good", "r2", prompt=6, max_tokens=3))
    s.add_request(new_request("plain", 6, max_tokens=3))
    backend.open("r1", "r2")
    wait_until(lambda: grammar_ready(s.requests["bad"]) and grammar_ready(s.requests["good"]))

    def panic(bitmask, row):
        raise BaseException("a Rust panic, as pyo3 raises it")

    backend.grammars["r1"].fill_bitmask = panic
    runner = FakeRunner()
    _, outputs = step(s, runner)  # the prompts, and each request's first token
    finished = {o.request_id: o for o in outputs if o.finish_reason is not None}
    assert set(finished) == {"bad"} and finished["bad"].finish_reason == FinishReason.ABORT
    run_until_done(s, runner)
    assert all_blocks_free(s)
    assert backend.grammars["r2"].accepted  # the other grammar went on


def test_an_engine_failure_is_a_500_naming_it_not_an_abort():
    def output(finish_reason, stop_reason):
        completion = CompletionOutput(index=0, text="", token_ids=[], finish_reason=finish_reason,
                                      stop_reason=stop_reason)
        return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1], outputs=[completion],
                             finished=True)
    with pytest.raises(GenerationFailed, match="^structured_outputs: the grammar refused"):
        raise_if_failed(output("abort", "structured_outputs: the grammar refused a sampled token"))
    raise_if_failed(output("stop", None))
    raise_if_failed(output("abort", None))  # a client's own abort
