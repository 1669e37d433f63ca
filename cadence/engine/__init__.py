"""The engine: the step loop (``EngineCore``), the offline ``LLM`` API,
detokenization and stop strings.

Names are imported on first use: ``cadence.engine.core`` is pure Python, and
the simulator uses it without loading torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CompletionOutput": "cadence.engine.outputs",
    "EngineCore": "cadence.engine.core",
    "LLM": "cadence.engine.llm",
    "Logprob": "cadence.engine.outputs",
    "RequestOutput": "cadence.engine.outputs",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'cadence.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
