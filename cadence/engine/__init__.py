"""The engine: the step loop (``EngineCore``), the offline ``LLM`` API,
detokenization and stop strings."""

from cadence.engine.core import EngineCore
from cadence.engine.llm import LLM
from cadence.engine.outputs import CompletionOutput, Logprob, RequestOutput

__all__ = ["CompletionOutput", "EngineCore", "LLM", "Logprob", "RequestOutput"]
