"""The engine: the step loop (``EngineCore``), the offline ``LLM`` API,
detokenization and stop strings, and the online client: ``AsyncLLM``
(``async_llm``) runs an ``EngineCore`` in its own process (``core_proc``)
and talks to it in the messages of ``wire``.

Names are imported on first use: ``cadence.engine.core`` is pure Python, and
the simulator uses it without loading torch.
"""

from __future__ import annotations

from cadence._lazy import lazy_exports

_EXPORTS = {
    "CompletionOutput": "cadence.engine.outputs",
    "EngineCore": "cadence.engine.core",
    "LLM": "cadence.engine.llm",
    "Logprob": "cadence.engine.outputs",
    "RequestOutput": "cadence.engine.outputs",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
