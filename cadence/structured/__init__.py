"""Grammar backends for structured outputs: JSON schema, regex, choice, grammar.

The scheduler (``cadence.core.sched.structured_output``) fixes the protocol;
this package implements it over llguidance (the default) or xgrammar
(``--structured-outputs-backend xgrammar``, when installed). A backend
compiles a request's ``StructuredOutputParams`` into a per-request grammar
(compiled forms are cached by key), and fills one row of the step's token
bitmask per logits row; the runner applies the mask to the logits.

A server checks each constraint before it sends the request: its size
against the ``structured_outputs_*`` limits (``limits.py``), then the
grammar library's verdict from a worker process (``isolated.py``), so that
a crash or runaway inside the library costs that request, not the server.
"""

from cadence.structured.backend import (
    STRUCTURED_OUTPUTS_BACKENDS,
    GrammarBackendBase,
    make_grammar_backend,
)
from cadence.structured.isolated import IsolatedGrammarChecker
from cadence.structured.limits import GrammarLimits

__all__ = ["STRUCTURED_OUTPUTS_BACKENDS", "GrammarBackendBase", "GrammarLimits", "IsolatedGrammarChecker",
           "make_grammar_backend"]
