"""GGUF weights kept in their quantized blocks, and the products that read them.

With ``quantization`` ``auto`` or ``gguf`` (see ``QUANTIZATION_MODES``) the
GGUF loader hands a ``QuantizedTensor`` (ggml's raw blocks, one row of the
matrix per row of bytes) for every matmul weight of a type in
``KERNEL_TYPES``; ``Linear`` and ``Embedding`` keep it instead of a float
copy, so a Q4 model takes about its file size in memory. The products:

    C kernel   ``cadence.kernels.quant_matmul``: a decode step's few rows of x
               multiply the blocks' integers in registers (AVX2); more rows
               get blocks decoded per tile; or portable C
    PyTorch    the matrix dequantized for each call (``dequantize``), then
               ``F.linear``: slow, for machines without a C compiler

Every path first rounds x per group of 32 values to int16 steps of
max|x| / 32767 (``round_activations``; llama.cpp rounds to int8, 256 times
coarser), or, for ``BYTE_ACTIVATION_TYPES``, per 256 values to int8 steps of
max|x| / 127 as llama.cpp does (the AVX2 build multiplies those as bytes, 1.6x
the weights read per second), so all of them compute one product, up to the order of
float32 sums, whatever the batch; against dequantize-at-load (``quantization
none``, the exact float32 model) that rounding is the difference, ~2e-5 of a
product with int16 steps, ~5e-3 with int8's:
tests/engine/test_quantized_default_model.py checks perplexity and greedy
tokens. Products run in float32 (x cast up, the result cast back
to x's dtype).

A fused projection (q|k|v, gate|up) whose shards differ in type (Q4_K_M
files store v_proj in another type than q_proj) keeps one part per run of
same-typed shards; a shard of a type without a kernel (``auto``) is a float
part. The parts' outputs are concatenated.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Union

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as GGMLType

from cadence.kernels.quant_matmul import check_blocks
from cadence.models.block_decoders import decode_rows
from cadence.models.dequant import FLOAT_TYPES

if TYPE_CHECKING:
    from cadence.kernels.quant_matmul import QuantMatmul
    from cadence.models.step_buffer import StepBuffer

# none: dequantize every GGUF at load. auto: keep the types below quantized,
# dequantize others. gguf: keep them, refuse a quantized type without a kernel.
QUANTIZATION_MODES = ("auto", "gguf", "none")
KERNEL_TYPES = (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q2_K,
                GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.IQ4_NL, GGMLType.IQ4_XS)
# Types whose products round x to int8 steps (``byte_activations`` in quant_matmul.c).
BYTE_ACTIVATION_TYPES = frozenset({GGMLType.Q4_K.value, GGMLType.Q6_K.value})


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """A [rows, cols] matrix as ggml blocks: ``blocks`` uint8 [rows, bytes per row]."""

    ggml_type: GGMLType
    blocks: torch.Tensor
    cols: int

    def __post_init__(self) -> None:
        if self.ggml_type in KERNEL_TYPES:
            check_blocks(self.blocks, int(self.ggml_type), self.cols)  # once, not per product

    @classmethod
    def from_gguf(cls, ggml_type: GGMLType, data: np.ndarray, shape: tuple[int, int]) -> "QuantizedTensor":
        """From a GGUF tensor's raw bytes (copied: the result owns its memory)."""
        raw = torch.from_numpy(np.array(data, dtype=np.uint8).reshape(shape[0], -1))
        return cls(ggml_type, raw, shape[1])

    @property
    def shape(self) -> tuple[int, int]:
        return (self.blocks.shape[0], self.cols)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def with_blocks(self, blocks: torch.Tensor) -> "QuantizedTensor":
        """The same type and width over other rows (reordered, selected, stacked)."""
        return QuantizedTensor(self.ggml_type, blocks.contiguous(), self.cols)

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols], decoded in PyTorch (``block_decoders``)."""
        return decode_rows(self.ggml_type, self.blocks, self.cols)


# A fused layer's row range: quantized blocks, or a float matrix.
Part = Union[QuantizedTensor, torch.Tensor]


def keeps_quantized(name: str, ggml_type: GGMLType, mode: str) -> bool:
    """Whether the loader keeps GGUF tensor ``name`` of ``ggml_type`` quantized under ``mode``.

    ValueError (``gguf``) for a quantized type no kernel computes, naming it and the supported ones.
    """
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization: must be one of {', '.join(QUANTIZATION_MODES)}, got {mode!r}")
    if mode == "none" or ggml_type in FLOAT_TYPES:
        return False
    if ggml_type in KERNEL_TYPES:
        return True
    if mode == "gguf":
        supported = ", ".join(t.name for t in KERNEL_TYPES)
        raise ValueError(f"quantization gguf: GGUF tensor {name!r} has type {ggml_type.name}, which no "
                         f"quantized kernel computes (supported: {supported}); use quantization auto "
                         f"to dequantize such tensors at load")
    return False


def merge_parts(shards: Iterable[Part]) -> tuple[Part, ...]:
    """Stack consecutive shards of one kind (same quantized type, or float) into one part."""
    runs: list[list[Part]] = []
    for shard in shards:
        if runs and _kind(runs[-1][0]) == _kind(shard):
            runs[-1].append(shard)
        else:
            runs.append([shard])
    return tuple(_stack(run) for run in runs)


def _kind(part: Part) -> GGMLType | None:
    return part.ggml_type if isinstance(part, QuantizedTensor) else None


def _stack(run: list[Part]) -> Part:
    if len(run) == 1:
        return run[0]
    if isinstance(run[0], QuantizedTensor):
        return run[0].with_blocks(torch.cat([part.blocks for part in run]))
    return torch.cat(run)


def linear(x: torch.Tensor, parts: tuple[Part, ...], bias: torch.Tensor | None,
           kernel: "QuantMatmul | None", buffer: "StepBuffer | None" = None) -> torch.Tensor:
    """``x [..., in] @ W.T (+ bias)`` for W stored as ``parts`` (stacked by rows); ``buffer``
    as ``matmul``'s, for one part."""
    if len(parts) == 1:
        y = matmul(x, parts[0], kernel, buffer)
    else:
        y = torch.cat([matmul(x, part, kernel) for part in parts], dim=-1)
    return y if bias is None else y + bias


def matmul(x: torch.Tensor, weight: Part, kernel: "QuantMatmul | None",
           buffer: "StepBuffer | None" = None) -> torch.Tensor:
    """``x [..., in] @ W.T`` in x's dtype, W float or quantized. ``buffer``: where the C
    kernel's float32 product of a 2-D x goes (see ``StepBuffer``); other paths allocate."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight)
    if kernel is None:
        rounded = round_activations(x.float(), weight.ggml_type.value).to(x.dtype)
        return F.linear(rounded, weight.dequantize().to(x.dtype))
    if x.dim() == 2 and x.dtype == torch.float32:  # the model's case: no reshaping, no casts
        out = None if buffer is None else buffer.rows(x.shape[0], weight.shape[0])
        return kernel.matmul_checked_blocks(x, weight.blocks, weight.ggml_type.value, weight.cols, out)
    rows = x.reshape(-1, weight.cols).float()
    y = kernel.matmul_checked_blocks(rows, weight.blocks, weight.ggml_type.value, weight.cols)
    return y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)


def activation_steps(type_id: int) -> float:
    """The largest integer x is rounded to before it meets ``type_id``'s weights."""
    return 127.0 if type_id in BYTE_ACTIVATION_TYPES else 32767.0


def rounding_span(type_id: int) -> int:
    """Values of x that share one rounding step: 256 (a super-block) for the byte types, else 32."""
    return 256 if type_id in BYTE_ACTIVATION_TYPES else 32


def round_activations(x: torch.Tensor, type_id: int = GGMLType.Q8_0.value) -> torch.Tensor:
    """float32 ``x [..., K]`` with each group of 32 values rounded to int16 steps of
    d = max|x| / 32767, or, for ``BYTE_ACTIVATION_TYPES``, each 256 values to int8
    steps of max|x| / 127 (to the nearest integer, ties to even): the values every
    product on ``type_id``'s weights multiplies, as the C kernel rounds them."""
    span = rounding_span(type_id)
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // span, span)
    d = groups.abs().amax(dim=-1, keepdim=True) / activation_steps(type_id)
    inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(groups * inverse) * d).reshape(x.shape)


def embedding(ids: torch.Tensor, weight: QuantizedTensor, kernel: "QuantMatmul | None",
              dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of the table, decoded: [*ids.shape, cols] in ``dtype``."""
    if kernel is None:
        rows = weight.with_blocks(weight.blocks[ids.reshape(-1)]).dequantize()
        return rows.reshape(*ids.shape, weight.cols).to(dtype)
    return kernel.dequantize_rows(weight.blocks, int(weight.ggml_type), weight.cols, ids).to(dtype)


def describe(weights: Iterable[Part]) -> str:
    """``"Q4_1 x210, Q8_0 x1 (92 MiB)"``: the quantized parts among ``weights``."""
    quantized = [w for w in weights if isinstance(w, QuantizedTensor)]
    counts = Counter(w.ggml_type.name for w in quantized)
    mib = sum(w.nbytes for w in quantized) / 2**20
    return f"{', '.join(f'{name} x{n}' for name, n in counts.most_common())} ({mib:.0f} MiB)"
