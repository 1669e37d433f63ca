"""cadence: an LLM inference engine around an iteration-level scheduler."""

from cadence.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
__version__ = "0.1.0"
