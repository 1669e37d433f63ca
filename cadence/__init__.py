"""cadence: an LLM inference engine around an iteration-level scheduler."""

from cadence._lazy import lazy_exports
from cadence.sampling_params import PoolingParams, SamplingParams

__all__ = ["LLM", "PoolingParams", "SamplingParams"]
__version__ = "0.1.0"

# Lazy: importing cadence (e.g. cadence.core) must not import torch.
__getattr__ = lazy_exports(__name__, {"LLM": "cadence.engine.llm"})
