"""Llama-family models: config, PyTorch decoder, GGUF / Hugging Face loaders, tokenizer.

The runner uses ``load_model`` and the ``LlamaForCausalLM`` interface
(``forward(input_ids, positions, attention)``, ``compute_logits(hidden)``).
Nothing here imports transformers.
"""

from cadence.models.config import ModelConfig
from cadence.models.llama import LlamaForCausalLM
from cadence.models.loader import default_model_path, load_model
from cadence.models.tokenizer import Tokenizer

__all__ = ["LlamaForCausalLM", "ModelConfig", "Tokenizer", "default_model_path", "load_model"]
