"""Grammar backends for structured outputs: JSON schema, regex, choice, grammar.

The scheduler (``cadence.core.sched.structured_output``) fixes the protocol;
this package implements it over llguidance (the default) or xgrammar
(``--structured-outputs-backend xgrammar``, when installed). A backend
compiles a request's ``StructuredOutputParams`` into a per-request grammar
(compiled forms are cached by key), and fills one row of the step's token
bitmask per logits row; the runner applies the mask to the logits.
"""

from cadence.structured.backend import (
    STRUCTURED_OUTPUTS_BACKENDS,
    GrammarBackendBase,
    make_grammar_backend,
)

__all__ = ["STRUCTURED_OUTPUTS_BACKENDS", "GrammarBackendBase", "make_grammar_backend"]
