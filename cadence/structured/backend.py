"""What every grammar backend shares: the bitmask, the compile cache, the factory.

The bitmask is a torch int32 tensor [rows, ceil(vocab / 32)]: bit ``t % 32``
of word ``t // 32`` set means token ``t`` is allowed (the layout of both
llguidance and xgrammar). A front end (which never imports torch) uses a
backend only to check grammars before it sends a request.
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable

from cadence.config import STRUCTURED_OUTPUTS_BACKENDS
from cadence.models.tokenizer import Tokenizer
from cadence.sampling_params import StructuredOutputParams
from cadence.structured.limits import constraint_bytes, unsatisfiable_schema_reason

if TYPE_CHECKING:
    import torch

# Rows filled in parallel from this many on (below it a thread pool costs more
# than it saves), on this many threads: the CPU's cores, as the forward pass.
PARALLEL_FILL_MIN_ROWS = 4


def fill_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


# Compiled grammars kept per backend (a key is the request's whole constraint):
# at most this many, and at most this many bytes of constraint text together.
# A compiled grammar's memory grows with its text (a 20,000-string choice list,
# ~400 KB, keeps ~2 MiB in llguidance): bounded by count alone, distinct large
# lists grew the engine by 2 MiB each, up to 256 of them (issue 30). 4 MiB
# holds four constraints of the default size limit, or 256 schemas of 16 KB.
COMPILE_CACHE_SIZE = 256
COMPILE_CACHE_BYTES = 4 << 20
ANY_JSON_OBJECT = '{"type": "object"}'
# Tokens a check walks from a grammar's start (see ``GrammarBackendBase._probe``).
PROBE_STEPS = 8
# Characters of a grammar library's own message kept in an error (its first line).
MAX_LIBRARY_MESSAGE = 300


def make_grammar_backend(name: str, tokenizer: Tokenizer, vocab_size: int) -> "GrammarBackendBase":
    """The backend ``name`` over ``tokenizer``; masks are ``vocab_size`` wide (the logits')."""
    check_backend_available(name)
    if name == "xgrammar":
        from cadence.structured.xgrammar_backend import XGrammarBackend
        return XGrammarBackend(tokenizer, vocab_size)
    from cadence.structured.llguidance_backend import LLGuidanceBackend
    return LLGuidanceBackend(tokenizer, vocab_size)


def check_backend_available(name: str) -> None:
    """ValueError naming the option unless backend ``name`` exists and is installed."""
    if name not in STRUCTURED_OUTPUTS_BACKENDS:
        raise ValueError(f"structured_outputs_backend: must be one of "
                         f"{', '.join(STRUCTURED_OUTPUTS_BACKENDS)}, got {name!r}")
    if importlib.util.find_spec(name) is None:
        raise ValueError(f"structured_outputs_backend: {name} is not installed "
                         f"(pip install {name})")


class ConstraintCache:
    """Values keyed by constraints, least recently used first out: at most
    ``max_entries``, and at most ``max_bytes`` of constraint text together,
    though the newest entry stays even when it alone is larger. Thread-safe."""

    def __init__(self, max_entries: int = COMPILE_CACHE_SIZE, max_bytes: int = COMPILE_CACHE_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple, tuple[Any, int]] = OrderedDict()  # key -> (value, bytes)

    @staticmethod
    def key(params: StructuredOutputParams) -> tuple:
        return (params.kind, getattr(params, params.kind))

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple, default: Any = None) -> Any:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return default
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, params: StructuredOutputParams, value: Any) -> None:
        key, num_bytes = self.key(params), constraint_bytes(params)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.num_bytes -= old[1]
            self._entries[key] = (value, num_bytes)
            self.num_bytes += num_bytes
            while len(self._entries) > 1 and (len(self._entries) > self.max_entries
                                              or self.num_bytes > self.max_bytes):
                self.num_bytes -= self._entries.popitem(last=False)[1][1]


class GrammarBackendBase:
    """Compile-once-per-key and the bitmask; subclasses turn params into grammars.

    The tokenizer-dependent state (vocabulary tables, ~0.1-0.3 s to build) is
    made on first use, in the compile thread, so an engine that never sees a
    structured request never pays for it.
    """

    name = ""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._compiled = ConstraintCache()  # -> (True, compiled) or (False, the error)
        self._state: Any = None

    # ---- what a subclass provides ----------------------------------------

    def _build_state(self) -> Any:
        """The tokenizer-dependent tables (called once, under the lock)."""
        raise NotImplementedError

    def _compile_source(self, state: Any, params: StructuredOutputParams) -> Any:
        """The compiled form shared by every request with these params; raises on bad input."""
        raise NotImplementedError

    def _new_grammar(self, state: Any, compiled: Any) -> Any:
        """A fresh per-request matcher over a compiled form."""
        raise NotImplementedError

    def _probe(self, state: Any, compiled: Any, params: StructuredOutputParams) -> None:
        """Walk a few tokens from the start of a fresh matcher; ValueError naming
        the field if no output at all satisfies the constraint (nothing but a stop
        is allowed where the empty output is not accepted), or if the library
        fails on the way (a limit it hits, which a request would hit too)."""

    # ---- the protocol ----------------------------------------------------

    def compile(self, params: StructuredOutputParams) -> Any:
        """A new grammar for one request; ``ValueError`` naming the field if it cannot be."""
        return self._new_grammar(self._tables(), self._cached(params))

    def prepare(self) -> None:
        """Build the tokenizer-dependent tables now rather than in the first compile."""
        self._tables()

    def check(self, params: StructuredOutputParams) -> None:
        """Raise ``ValueError`` if ``params`` cannot compile (the compiled form is
        cached) or nothing satisfies it. The grammar library runs here: a server
        calls this in a worker process (``isolated.py``), not in its own."""
        self._probe(self._tables(), self._cached(params), params)

    def fill_bitmask_rows(self, grammars: list[Any], rows: list[int], bitmask: "torch.Tensor") -> None:
        """Each grammar's mask into its row (a backend with a parallel filler overrides this)."""
        for grammar, row in zip(grammars, rows):
            grammar.fill_bitmask(bitmask, row)

    def allocate_bitmask(self, num_rows: int) -> "torch.Tensor":
        import torch  # the engine process has it; a front end only checks grammars

        return torch.full((num_rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)

    # ---- internals -------------------------------------------------------

    def _tables(self) -> Any:
        with self._lock:
            if self._state is None:
                self._state = self._build_state()
            return self._state

    def _cached(self, params: StructuredOutputParams) -> Any:
        hit = self._compiled.get(ConstraintCache.key(params))
        if hit is None:
            try:
                hit = (True, self._compile(params))
            except ValueError as err:
                hit = (False, str(err))
            except Exception as err:  # a backend's own error type: still the input's fault
                hit = (False, f"structured_outputs.{params.kind}: {library_message(str(err))}")
            self._compiled.put(params, hit)
        ok, value = hit
        if not ok:
            raise ValueError(value)
        return value

    def _compile(self, params: StructuredOutputParams) -> Any:
        if params.kind == "json":  # before the library: it takes a $ref cycle without a word
            reason = unsatisfiable_schema_reason(parse_schema(params))
            if reason is not None:
                raise ValueError(f"structured_outputs.json: {reason}")
        return self._compile_source(self._tables(), params)


def reraise_unless_library_failure(err: BaseException) -> None:
    """Raise ``err`` again unless it is a grammar library's failure, which ends
    one request: any exception, and a Rust panic (pyo3 raises those as a
    ``BaseException``); an interrupt or an exit goes on up."""
    if isinstance(err, (KeyboardInterrupt, SystemExit, GeneratorExit)):
        raise err


def library_message(text: str) -> str:
    """A grammar library's message without the state dump or backtrace it may
    append (``<state>``, ``<backtrace>``...), and bounded: what a client reads."""
    head = text.split("\n<", 1)[0].strip()
    return head if len(head) <= MAX_LIBRARY_MESSAGE else head[:MAX_LIBRARY_MESSAGE] + "..."


def choice_alternatives(choices: tuple[str, ...], rule: Callable[[str], str]) -> str:
    """``rule(alt1 | alt2 | ...)`` with each choice as a JSON-escaped string literal
    (the string syntax Lark and GBNF share)."""
    return rule(" | ".join(json.dumps(c) for c in choices))


def is_gbnf(grammar: str) -> bool:
    """GBNF/EBNF (``root ::= ...``) rather than Lark (``start: ...``)."""
    return "::=" in grammar


def parse_schema(params: StructuredOutputParams) -> dict | bool:
    """The JSON schema of ``params.json``, or ValueError naming the field."""
    try:
        schema = json.loads(params.json)
    except json.JSONDecodeError as err:
        raise ValueError(f"structured_outputs.json: not valid JSON ({err})") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError("structured_outputs.json: a JSON schema must be an object")
    return schema


# Keywords whose value is a schema, a list of schemas, or a map of names to schemas
# (strict_schema descends into these only: const, enum, default... hold data).
_SCHEMA_VALUED = ("items", "additionalItems", "contains", "not", "if", "then", "else",
                  "additionalProperties", "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def strict_schema(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that lists
    ``properties`` and says nothing of others: what an application means by a
    schema (OpenAI's strict mode, xgrammar's default), and what keeps a small
    model from inventing keys until it runs out of tokens."""
    if not isinstance(schema, dict):
        return schema
    strict = dict(schema)
    for key in _SCHEMA_VALUED:
        if key in strict:
            strict[key] = strict_schema(strict[key])
    for key in _SCHEMA_LISTS:
        if isinstance(strict.get(key), list):
            strict[key] = [strict_schema(item) for item in strict[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(strict.get(key), dict):
            strict[key] = {name: strict_schema(sub) for name, sub in strict[key].items()}
    if "properties" in strict and "additionalProperties" not in strict:
        strict["additionalProperties"] = False
    return strict
