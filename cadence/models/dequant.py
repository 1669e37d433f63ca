"""GGUF tensor data -> torch tensor, dequantizing the block formats cadence supports.

The block formats (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) are decoded by ``gguf.quants``
(llama.cpp's own Python package); ``tests/models/test_dequant.py`` checks it
against block layouts written out independently from ggml's definitions.
Float formats are reinterpreted directly in torch.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as GGMLType
from gguf import quants

FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
BLOCK_TYPES = (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q4_K, GGMLType.Q6_K)
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
