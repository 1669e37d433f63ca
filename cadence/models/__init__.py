"""Llama-family models: config, PyTorch decoder, GGUF / Hugging Face loaders, tokenizer.

The runner uses ``load_model`` and the ``LlamaForCausalLM`` interface
(``forward(input_ids, positions, attention)``, ``compute_logits(hidden)``).
Nothing here imports transformers. Names are imported on first use:
``cadence.models.config`` is pure Python and the simulator reads model
shapes with it without loading torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LlamaForCausalLM": "cadence.models.llama",
    "ModelConfig": "cadence.models.config",
    "Tokenizer": "cadence.models.tokenizer",
    "default_model_path": "cadence.models.loader",
    "load_model": "cadence.models.loader",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'cadence.models' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
