"""Grammar backends (llguidance and xgrammar) over the default model's tokenizer.

Each kind of constraint is compiled, walked token by token through its masks
and checked for bad input, on both backends; ``strict_schema``, which the
llguidance backend applies to every schema, is tested on its own.

Every backend here masks a vocabulary 64 ids wider than the tokenizer's (as
logits padded past the tokenizer would be): those ids must never be allowed.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from cadence.models import Tokenizer, default_model_path
from cadence.models.gguf_loader import read_gguf
from cadence.runner.grammar_mask import allowed_tokens
from cadence.sampling_params import StructuredOutputParams
from cadence.structured.backend import (
    ConstraintCache, GrammarBackendBase, make_grammar_backend, strict_schema,
)

BACKENDS = ("llguidance", "xgrammar")
EOS_ID = 2
NUM_PADDED_IDS = 64

# The JSON each backend lets a model write: llguidance compact, xgrammar with
# a space after "," and ":" (found by tokenizing both forms; each refuses the other).
JSON_SEPARATORS = {"llguidance": (",", ":"), "xgrammar": (", ", ": ")}

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "color": {"enum": ["red", "green"]},
        "tags": {"type": "array", "items": {"type": "integer"}},
        "pos": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]},
    },
    "required": ["name", "color", "tags", "pos"],
}
CHOICE = StructuredOutputParams(choice=["yes", "no"])
OPEN_REGEX = StructuredOutputParams(regex=r"\d{3}-[a-z]+")

# kind: (constraint, a valid complete output (a dict is JSON written with the
# backend's separators), [(marker, text)]: after the output up to, not
# including, the first ``marker``, the first token of ``text`` is refused).
KINDS = {
    "json": (
        StructuredOutputParams(json=SCHEMA),
        {"name": "Ann", "color": "red", "tags": [1, 2], "pos": {"x": 1.5}},
        [("{", "["), ('red"', "blue"), ("1,", '"')],
    ),
    "json_object": (StructuredOutputParams(json_object=True), {"k": [1, {"z": None}]}, [("{", "[")]),
    "regex": (OPEN_REGEX, "123-abc", [("1", "x"), ("-", "a")]),
    "choice": (CHOICE, "yes", [("y", " maybe"), ("y", "x")]),
    "lark": (StructuredOutputParams(grammar='start: "(" NUM ")"\nNUM: /[0-9]+/'), "(42)",
             [("(", "4"), (")", "x")]),
    "gbnf": (StructuredOutputParams(grammar='root ::= "(" num ")"\nnum ::= [0-9]+'), "(42)",
             [("(", "4"), (")", "x")]),
}

# What each kind reports for a typical mistake: the field, then the backend's words.
BAD_INPUTS = {
    "invalid JSON text": StructuredOutputParams(json="{not json"),
    "unknown schema type": StructuredOutputParams(json='{"type": "frobnicate"}'),
    "unclosed regex class": StructuredOutputParams(regex="[a-z"),
    "Lark unknown rule": StructuredOutputParams(grammar="start: missing"),
    "GBNF undefined rule": StructuredOutputParams(grammar="root ::= missing"),
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """The default model's tokenizer (SmolLM2: 49152 ids, EOS <|im_end|> = 2)."""
    return Tokenizer.from_gguf_metadata(read_gguf(default_model_path())[1])


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request, tokenizer: Tokenizer) -> GrammarBackendBase:
    pytest.importorskip(request.param)
    return make_grammar_backend(request.param, tokenizer, tokenizer.vocab_size + NUM_PADDED_IDS)


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def output_text(backend: GrammarBackendBase, output: str | dict) -> str:
    return output if isinstance(output, str) else json.dumps(output, separators=JSON_SEPARATORS[backend.name])


def mask_words(backend: GrammarBackendBase, grammar) -> torch.Tensor:
    """The grammar's mask now: int32 words [W]."""
    bitmask = backend.allocate_bitmask(1)
    grammar.fill_bitmask(bitmask, 0)
    return bitmask[0]


def allowed_ids(backend: GrammarBackendBase, grammar) -> torch.Tensor:
    """The grammar's mask now: bool [vocab_size]."""
    return allowed_tokens(mask_words(backend, grammar).unsqueeze(0), backend.vocab_size)[0]


def token_ids_of(mask: torch.Tensor) -> list[int]:
    return mask.nonzero().flatten().tolist()


# ------------------------------------------------------------ walking outputs


@pytest.mark.parametrize("kind", KINDS)
def test_valid_output_is_allowed_token_by_token(backend, tokenizer, kind):
    params, output, _ = KINDS[kind]
    grammar = backend.compile(params)
    other_special_ids = [i for i in tokenizer.all_special_ids if i != EOS_ID]
    for token_id in encode(tokenizer, output_text(backend, output)):
        allowed = allowed_ids(backend, grammar)
        assert allowed[token_id], tokenizer.decode([token_id])
        assert not allowed[other_special_ids].any()
        assert not allowed[tokenizer.vocab_size:].any()
        assert grammar.accept_tokens("req", [token_id])
    allowed = allowed_ids(backend, grammar)
    assert allowed[EOS_ID]
    assert not allowed[tokenizer.vocab_size:].any()


@pytest.mark.parametrize("kind", KINDS)
def test_invalid_continuation_is_masked_out(backend, tokenizer, kind):
    params, output, refusals = KINDS[kind]
    text = output_text(backend, output)
    for marker, refused in refusals:
        grammar = backend.compile(params)
        prefix = text[: text.index(marker)]
        assert grammar.accept_tokens("req", encode(tokenizer, prefix))
        refused_id = encode(tokenizer, refused)[0]
        assert not allowed_ids(backend, grammar)[refused_id], (prefix, refused)


def test_choice_allows_exactly_the_starts_of_its_choices(backend, tokenizer):
    allowed = allowed_ids(backend, backend.compile(CHOICE))
    starts = {tokenizer.decode([i]) for i in token_ids_of(allowed)}
    assert starts == {"y", "ye", "yes", "n", "no"}


@pytest.mark.parametrize("kind", [kind for kind in KINDS if kind != "regex"])
def test_a_finished_output_allows_only_eos(backend, tokenizer, kind):
    params, output, _ = KINDS[kind]
    grammar = backend.compile(params)
    assert grammar.accept_tokens("req", encode(tokenizer, output_text(backend, output)))
    assert token_ids_of(allowed_ids(backend, grammar)) == [EOS_ID]


def test_a_finished_regex_match_allows_eos_and_only_what_extends_it(backend, tokenizer):
    fixed = backend.compile(StructuredOutputParams(regex="[0-9]{3}"))
    assert fixed.accept_tokens("req", encode(tokenizer, "123"))
    assert token_ids_of(allowed_ids(backend, fixed)) == [EOS_ID]

    open_ended = backend.compile(OPEN_REGEX)
    assert open_ended.accept_tokens("req", encode(tokenizer, "123-abc"))
    allowed = allowed_ids(backend, open_ended)
    assert allowed[EOS_ID] and allowed[encode(tokenizer, "d")[0]]
    assert not allowed[encode(tokenizer, "-")[0]] and not allowed[encode(tokenizer, "1")[0]]
    assert not open_ended.is_terminated()


# ------------------------------------------------------------ termination


def test_no_grammar_is_terminated_before_a_complete_output(backend, tokenizer):
    grammar = backend.compile(CHOICE)
    assert not grammar.is_terminated()
    assert grammar.accept_tokens("req", encode(tokenizer, "ye"))
    assert not grammar.is_terminated()


def test_when_a_complete_match_terminates(backend, tokenizer):
    grammar = backend.compile(CHOICE)
    assert grammar.accept_tokens("req", encode(tokenizer, "yes"))
    if backend.name == "llguidance":
        # llguidance stops as soon as nothing can follow (the scheduler finishes
        # the request there); a stopped matcher takes nothing more, not even EOS.
        assert grammar.is_terminated()
        assert not grammar.accept_tokens("req", [EOS_ID])
    else:
        # xgrammar waits for the EOS its mask now allows.
        assert not grammar.is_terminated()
        assert grammar.accept_tokens("req", [EOS_ID])
        assert grammar.is_terminated()


def test_an_output_and_its_eos_in_one_call_terminate(backend, tokenizer):
    """A step that accepts a draft and its bonus EOS together (speculative decoding)."""
    grammar = backend.compile(CHOICE)
    assert grammar.accept_tokens("req", encode(tokenizer, "yes") + [EOS_ID])
    assert grammar.is_terminated()


# ------------------------------------------------------------ validate and rollback


def test_validate_tokens_returns_the_accepted_prefix_without_advancing(backend, tokenizer):
    grammar = backend.compile(OPEN_REGEX)
    assert grammar.accept_tokens("req", encode(tokenizer, "12"))
    before = mask_words(backend, grammar)
    good, bad = encode(tokenizer, "3-ab"), encode(tokenizer, "-")
    assert grammar.validate_tokens(good + bad + good) == good
    assert grammar.validate_tokens(good) == good
    assert grammar.validate_tokens(bad + good) == []
    assert torch.equal(mask_words(backend, grammar), before)
    assert grammar.accept_tokens("req", good)  # still where it was: "3-ab" follows "12"


def test_rollback_restores_the_previous_mask(backend, tokenizer):
    grammar = backend.compile(KINDS["json_object"][0])
    token_ids = encode(tokenizer, output_text(backend, KINDS["json_object"][1]))
    assert grammar.accept_tokens("req", token_ids[:2])
    before = mask_words(backend, grammar)
    assert grammar.accept_tokens("req", token_ids[2:5])
    after = mask_words(backend, grammar)
    grammar.rollback(3)
    assert torch.equal(mask_words(backend, grammar), before)
    grammar.rollback(0)
    assert torch.equal(mask_words(backend, grammar), before)
    assert grammar.accept_tokens("req", token_ids[2:5])
    assert torch.equal(mask_words(backend, grammar), after)


def test_rollback_undoes_termination(backend, tokenizer):
    grammar = backend.compile(CHOICE)
    start = mask_words(backend, grammar)
    assert grammar.accept_tokens("req", encode(tokenizer, "yes") + [EOS_ID])
    grammar.rollback(2)
    assert not grammar.is_terminated()
    assert torch.equal(mask_words(backend, grammar), start)


def test_a_refused_token_leaves_the_grammar_as_it_was(backend, tokenizer):
    grammar = backend.compile(OPEN_REGEX)
    assert grammar.accept_tokens("req", encode(tokenizer, "1"))
    before = mask_words(backend, grammar)
    assert not grammar.accept_tokens("req", encode(tokenizer, "2") + encode(tokenizer, "x"))
    assert torch.equal(mask_words(backend, grammar), before)
    assert not grammar.is_terminated()
    assert grammar.accept_tokens("req", encode(tokenizer, "23-a"))


def test_each_compile_is_a_separate_request_state(backend, tokenizer):
    first, second = backend.compile(CHOICE), backend.compile(CHOICE)
    assert first.accept_tokens("a", encode(tokenizer, "no"))
    assert allowed_ids(backend, second)[encode(tokenizer, "yes")[0]]


# ------------------------------------------------------------ bad input


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_names_its_field(backend, case):
    params = BAD_INPUTS[case]
    with pytest.raises(ValueError) as first:
        backend.check(params)
    message = str(first.value)
    assert message.startswith(f"structured_outputs.{params.kind}: ")
    assert len(message) > len(f"structured_outputs.{params.kind}: ")
    with pytest.raises(ValueError) as again:
        backend.check(params)
    assert str(again.value) == message
    with pytest.raises(ValueError) as compiling:
        backend.compile(params)
    assert str(compiling.value) == message


def test_check_and_compile_compile_each_input_once(backend, monkeypatch):
    calls: list[str] = []
    compile_source = backend._compile_source

    def counting(state, params):
        calls.append(params.kind)
        return compile_source(state, params)

    monkeypatch.setattr(backend, "_compile_source", counting)
    bad = StructuredOutputParams(regex="(unclosed")
    good = StructuredOutputParams(regex="[0-9]+ only compiled once")
    for _ in range(2):
        with pytest.raises(ValueError, match=r"^structured_outputs\.regex: "):
            backend.check(bad)
        backend.check(good)
        backend.compile(good)
    assert calls == ["regex", "regex"]


def test_the_compile_cache_is_bounded_by_the_constraints_bytes_as_well_as_their_count():
    """Distinct 20,000-string choice lists kept ~2 MiB each in the engine, up
    to 256 of them (issue 30): the cache also holds at most max_bytes of
    constraint text, the least recently used going first, the newest always kept."""
    cache = ConstraintCache(max_entries=3, max_bytes=100)
    lists = [StructuredOutputParams(choice=[f"{i}" * 10] * 4) for i in range(4)]  # 40 bytes each
    for params in lists[:2]:
        cache.put(params, params.kind)
    assert cache.get(ConstraintCache.key(lists[0])) == "choice"  # now the most recently used
    cache.put(lists[2], "third")  # 120 bytes: lists[1], the least recently used, goes
    assert cache.get(ConstraintCache.key(lists[1]), "gone") == "gone"
    assert len(cache) == 2 and cache.num_bytes == 80
    huge = StructuredOutputParams(regex="x" * 500)
    cache.put(huge, "kept alone")
    assert len(cache) == 1 and cache.get(ConstraintCache.key(huge)) == "kept alone"
    small = [StructuredOutputParams(regex=str(i)) for i in range(5)]
    for params in small:
        cache.put(params, None)
    assert len(cache) == 3 and cache.num_bytes == 3  # the count bound
    assert cache.get(ConstraintCache.key(small[-1]), "gone") is None


def test_unknown_backend_name_is_refused(tokenizer):
    with pytest.raises(ValueError, match="^structured_outputs_backend: ") as err:
        make_grammar_backend("outlines", tokenizer, tokenizer.vocab_size)
    assert "llguidance" in str(err.value) and "xgrammar" in str(err.value)


# ------------------------------------------------------------ the bitmask


def test_bitmask_is_as_wide_as_the_logits_and_starts_all_allowed(backend, tokenizer):
    bitmask = backend.allocate_bitmask(3)
    assert bitmask.dtype == torch.int32
    assert bitmask.shape == (3, math.ceil((tokenizer.vocab_size + NUM_PADDED_IDS) / 32))
    assert bitmask.shape == (3, 1538)
    assert (bitmask == -1).all()


def test_fill_writes_only_its_row_and_never_allows_padded_ids(backend, tokenizer):
    bitmask = backend.allocate_bitmask(3)
    backend.compile(KINDS["json_object"][0]).fill_bitmask(bitmask, 1)
    assert (bitmask[[0, 2]] == -1).all()
    allowed = allowed_tokens(bitmask, backend.vocab_size)
    assert allowed[1].any()
    assert not allowed[1, tokenizer.vocab_size:].any()
    assert allowed[0, tokenizer.vocab_size:].all()  # untouched rows stay all-allowed


# ------------------------------------------------------------ strict schemas


def test_strict_schema_closes_every_object_that_lists_properties():
    schema = {
        "type": "object",
        "properties": {
            "point": {"type": "object", "properties": {"x": {"type": "number"}}},
            "items": {"type": "array", "items": {"type": "object", "properties": {"y": {}}}},
            "either": {"anyOf": [{"type": "object", "properties": {"z": {}}}, {"type": "null"}]},
        },
    }
    strict = strict_schema(schema)
    props = strict["properties"]
    assert strict["additionalProperties"] is False
    assert props["point"]["additionalProperties"] is False
    assert props["items"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert props["either"]["anyOf"][1] == {"type": "null"}
    assert "additionalProperties" not in schema  # the input is not changed


def test_strict_schema_keeps_what_a_schema_says_of_other_keys():
    schema = {
        "type": "object",
        "properties": {"a": {}},
        "additionalProperties": {"type": "integer"},
    }
    assert strict_schema(schema) == schema
    assert strict_schema({"type": "object", "properties": {}, "additionalProperties": True})[
        "additionalProperties"] is True
    assert strict_schema({"type": "object"}) == {"type": "object"}  # no properties listed
    assert strict_schema(True) is True


def test_strict_schema_leaves_constant_values_alone():
    """Only schemas are closed: const, enum and default values are data, and a
    property named "properties" is a name, not a schema keyword."""
    schema = {"type": "object", "properties": {"x": {"const": {"properties": 1}},
                                               "y": {"enum": [{"properties": {}}]},
                                               "properties": {"type": "integer"}}}
    strict = strict_schema(schema)
    assert strict["properties"]["x"] == {"const": {"properties": 1}}
    assert strict["properties"]["y"] == {"enum": [{"properties": {}}]}
    assert set(strict["properties"]) == {"x", "y", "properties"}
    assert strict["additionalProperties"] is False


@pytest.mark.parametrize("additional", [None, True])
def test_schema_objects_refuse_unlisted_keys_unless_allowed(backend, tokenizer, additional):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    if additional is not None:
        schema["additionalProperties"] = additional
    grammar = backend.compile(StructuredOutputParams(json=schema))
    prefix = output_text(backend, {"a": 1})[:-1]  # '{"a":1' or '{"a": 1'
    assert grammar.accept_tokens("req", encode(tokenizer, prefix))
    allowed = allowed_ids(backend, grammar)
    comma_ids = [i for i in token_ids_of(allowed) if tokenizer.token_bytes(i).startswith(b",")]
    assert bool(comma_ids) is (additional is True)
    assert allowed[encode(tokenizer, "}")[0]]


@pytest.mark.parametrize("num_grammars", [2, 7])  # below and above the parallel threshold
def test_batch_fill_writes_each_grammar_mask_into_its_row(backend, tokenizer, num_grammars):
    """fill_bitmask_rows (parallel from PARALLEL_FILL_MIN_ROWS rows on) writes
    exactly what each grammar's own fill_bitmask writes, into the row given,
    and leaves the other rows as they were."""
    kinds = list(KINDS.values())
    grammars, expected = [], []
    for i in range(num_grammars):
        params, output, _ = kinds[i % len(kinds)]
        grammar = backend.compile(params)
        text = output_text(backend, output)
        grammar.accept_tokens("req", encode(tokenizer, text)[: i % 3])  # various states
        grammars.append(grammar)
        expected.append(mask_words(backend, grammar))
    rows = [2 * i + 1 for i in reversed(range(num_grammars))]  # out of order, with gaps
    bitmask = backend.allocate_bitmask(2 * num_grammars + 1)
    backend.fill_bitmask_rows(grammars, rows, bitmask)
    for grammar_words, row in zip(expected, rows):
        assert torch.equal(bitmask[row], grammar_words)
    untouched = [r for r in range(bitmask.shape[0]) if r not in rows]
    assert bool((bitmask[untouched] == -1).all())
