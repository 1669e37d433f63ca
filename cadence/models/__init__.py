"""Llama-family models: config, PyTorch decoder, GGUF / Hugging Face loaders, tokenizer.

The runner uses ``load_model`` and the ``LlamaForCausalLM`` interface
(``forward(input_ids, positions, attention)``, ``compute_logits(hidden)``;
``pack_weights``, ``use_fused_ops``, ``use_quant_kernel`` for the CPU's paths;
``quantized_weights()`` and ``dequantized_at_load`` for the start-up log).
Every architecture is that one class, so these are declared, never probed.
Nothing here imports transformers. Names are imported on first use:
``cadence.models.config`` is pure Python and the simulator reads model
shapes with it without loading torch.
"""

from __future__ import annotations

from cadence._lazy import lazy_exports

_EXPORTS = {
    "DEFAULT_MODEL_FILE": "cadence.models.default_model",
    "DEFAULT_MODEL_NAME": "cadence.models.default_model",
    "LlamaForCausalLM": "cadence.models.llama",
    "ModelConfig": "cadence.models.config",
    "Tokenizer": "cadence.models.tokenizer",
    "checkpoint_dtype": "cadence.models.loader",
    "default_model_path": "cadence.models.default_model",
    "load_model": "cadence.models.loader",
    "model_name_of": "cadence.models.default_model",
    "resolve_model": "cadence.models.hub",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
