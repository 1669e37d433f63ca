"""GGUF tensor data -> torch tensor, dequantizing the block formats cadence supports.

The block formats are decoded by ``gguf.quants`` (llama.cpp's own Python
package): every type a llama.cpp quantization preset writes, so any GGUF
from ``llama-quantize`` loads (Q4_K_M files mix Q4_K, Q6_K and, in matrices
whose rows are not a multiple of 256, Q5_0; IQ4_XS presets fall back to
IQ4_NL). ``tests/models/test_gguf_dequant.py`` checks the types with a
quantized kernel against block layouts written out independently from
ggml's definitions. Float formats are reinterpreted directly in torch.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as GGMLType
from gguf import quants

FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
BLOCK_TYPES = (
    GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1,
    GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K,
    GGMLType.IQ1_S, GGMLType.IQ1_M, GGMLType.IQ2_XXS, GGMLType.IQ2_XS, GGMLType.IQ2_S,
    GGMLType.IQ3_XXS, GGMLType.IQ3_S, GGMLType.IQ4_NL, GGMLType.IQ4_XS,
    GGMLType.TQ1_0, GGMLType.TQ2_0, GGMLType.MXFP4,
)
SUPPORTED_TYPES = FLOAT_TYPES + BLOCK_TYPES


def check_supported(name: str, ggml_type: GGMLType) -> None:
    """Raise a ValueError naming the tensor if cadence cannot load its type."""
    if ggml_type not in SUPPORTED_TYPES:
        supported = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise ValueError(f"GGUF tensor {name!r} has type {ggml_type.name}, which cadence cannot load "
                         f"(supported: {supported}); re-quantize the model to one of these types")


def to_torch(name: str, ggml_type: GGMLType, data: np.ndarray, shape: tuple[int, ...],
             dtype: torch.dtype) -> torch.Tensor:
    """The tensor of ``shape`` (torch order: rows first) stored in ``data``, as ``dtype``.

    ``data`` is what ``GGUFFile`` (as ``gguf.GGUFReader``) gives: typed values for F32/F16, raw
    bytes (uint8) for everything else. The result owns its memory (no mmap view).
    """
    check_supported(name, ggml_type)
    if ggml_type == GGMLType.BF16:
        raw = torch.from_numpy(np.array(data, dtype=np.uint8).reshape(-1))
        return raw.view(torch.bfloat16).reshape(shape).to(dtype)
    if ggml_type in (GGMLType.F32, GGMLType.F16):
        return torch.from_numpy(np.array(data)).reshape(shape).to(dtype)
    values = quants.dequantize(np.asarray(data, dtype=np.uint8), ggml_type)  # float32, rows first
    return torch.from_numpy(values).reshape(shape).to(dtype)
