"""cadence: an LLM inference engine around an iteration-level scheduler."""

from typing import Any

from cadence.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy: importing cadence (e.g. cadence.core) must not import torch.
    if name == "LLM":
        from cadence.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'cadence' has no attribute {name!r}")
