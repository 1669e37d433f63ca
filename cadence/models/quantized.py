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
coarser), so all of them compute one product, up to the order of float32
sums, whatever the batch; against dequantize-at-load (``quantization none``,
the exact float32 model) that rounding is the difference, ~2e-5 of a
product: tests/engine/test_quantized_default_model.py checks perplexity
and greedy tokens. Products run in float32 (x cast up, the result cast back
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
from cadence.models.dequant import FLOAT_TYPES

if TYPE_CHECKING:
    from cadence.kernels.quant_matmul import QuantMatmul

# none: dequantize every GGUF at load. auto: keep the types below quantized,
# dequantize others. gguf: keep them, refuse a quantized type without a kernel.
QUANTIZATION_MODES = ("auto", "gguf", "none")
KERNEL_TYPES = (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q2_K,
                GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.IQ4_NL, GGMLType.IQ4_XS)


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
        """float32 [rows, cols], decoded in PyTorch."""
        per_block = _DECODERS[self.ggml_type]
        block_bytes = _BLOCK_BYTES[self.ggml_type]
        return per_block(self.blocks.reshape(-1, block_bytes)).reshape(self.shape)


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
           kernel: "QuantMatmul | None") -> torch.Tensor:
    """``x [..., in] @ W.T (+ bias)`` for W stored as ``parts`` (stacked by rows)."""
    if len(parts) == 1:
        y = matmul(x, parts[0], kernel)
    else:
        y = torch.cat([matmul(x, part, kernel) for part in parts], dim=-1)
    return y if bias is None else y + bias


def matmul(x: torch.Tensor, weight: Part, kernel: "QuantMatmul | None") -> torch.Tensor:
    """``x [..., in] @ W.T`` in x's dtype, W float or quantized."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight)
    if kernel is None:
        return F.linear(round_activations(x.float()).to(x.dtype), weight.dequantize().to(x.dtype))
    if x.dim() == 2 and x.dtype == torch.float32:  # the model's case: no reshaping, no casts
        return kernel.matmul_checked_blocks(x, weight.blocks, weight.ggml_type.value, weight.cols)
    rows = x.reshape(-1, weight.cols).float()
    y = kernel.matmul_checked_blocks(rows, weight.blocks, weight.ggml_type.value, weight.cols)
    return y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x [..., K]`` with each group of 32 values rounded to int16 steps of
    d = max|x| / 32767 (to the nearest integer, ties to even): the values every
    product on quantized weights multiplies, as the C kernel rounds them."""
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    d = groups.abs().amax(dim=-1, keepdim=True) / 32767.0
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


# ---------------------------------------------------------------- PyTorch decoders
# Each maps blocks uint8 [B, block bytes] to float32 [B, values per block], as
# ggml's dequantize_row_* (layouts in cadence/kernels/csrc/quant_matmul.c).

def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).float()  # [B, 1]


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[B, 16] bytes -> [B, 32]: the low nibbles, then the high ones."""
    return torch.cat([packed & 15, packed >> 4], dim=1)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].contiguous().view(torch.int8).float() * _f16(blocks, 0)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return (_nibbles(blocks[:, 2:]).float() - 8) * _f16(blocks, 0)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return _nibbles(blocks[:, 4:]).float() * _f16(blocks, 0) + _f16(blocks, 2)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """[B, 4] bytes (a little-endian 32-bit word) -> [B, 32]: bit i of the word, times 16."""
    bits = (qh.unsqueeze(2) >> torch.arange(8, dtype=torch.uint8)) & 1  # [B, byte, bit]
    return bits.reshape(-1, 32) << 4


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    return ((_nibbles(blocks[:, 6:]) | _fifth_bits(blocks[:, 2:6])).float() - 16) * _f16(blocks, 0)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    return (_nibbles(blocks[:, 8:]) | _fifth_bits(blocks[:, 4:8])).float() * _f16(blocks, 0) + _f16(blocks, 2)


def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's 12 bytes of packed 6-bit values -> scales, mins float32 [B, 8]."""
    packed = packed.int()
    low, mid, high = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([low & 63, (high & 15) | ((low >> 6) << 4)], dim=1).float()
    mins = torch.cat([mid & 63, (high >> 4) | ((mid >> 6) << 4)], dim=1).float()
    return scales, mins


def _k_nibbles(quants: torch.Tensor) -> torch.Tensor:
    """128 bytes [B, 128] -> [B, 8, 32]: bytes 32c .. 32c+31 hold sub-block 2c in their
    low nibbles, 2c+1 in their high ones."""
    quants = quants.reshape(-1, 4, 32)
    return torch.stack([quants & 15, quants >> 4], dim=2).reshape(-1, 8, 32)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # 8 sub-blocks of 32: 6-bit scales and mins packed in bytes 4..15, nibbles in 16..143.
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    values = _k_nibbles(blocks[:, 16:]).float()
    d, dmin = _f16(blocks, 0) * scales, _f16(blocks, 2) * mins  # [B, 8]
    return (d.unsqueeze(2) * values - dmin.unsqueeze(2)).reshape(-1, 256)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    # Q4_K's layout with 32 bytes qh (16..47) before the nibbles (48..175): bit j of qh[l]
    # is bit 4 of value l of sub-block j.
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    fifth = (blocks[:, 16:48].unsqueeze(1) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1  # [B, 8, 32]
    values = (_k_nibbles(blocks[:, 48:]) | (fifth << 4)).float()
    d, dmin = _f16(blocks, 0) * scales, _f16(blocks, 2) * mins
    return (d.unsqueeze(2) * values - dmin.unsqueeze(2)).reshape(-1, 256)


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    # 16 scale bytes (4-bit scale, 4-bit min: one per 16 values), qs [64], half d, dmin. Half n
    # (128 values) takes qs[32n ..]: value l of quarter c is (qs[32n + l] >> 2c) & 3.
    qs = blocks[:, 16:80].reshape(-1, 2, 1, 32)  # [B, half, 1, l]
    values = torch.cat([(qs >> (2 * c)) & 3 for c in range(4)], dim=2).reshape(-1, 16, 16).float()
    scales = blocks[:, :16]
    d = _f16(blocks, 80) * (scales & 15).float()  # [B, 16]
    dmin = _f16(blocks, 82) * (scales >> 4).float()
    return (d.unsqueeze(2) * values - dmin.unsqueeze(2)).reshape(-1, 256)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    # hmask [32], qs [64], 12 bytes of sixteen 6-bit scales, half d. Half n (128 values) takes
    # qs[32n ..]: value l of quarter c is (qs[32n + l] >> 2c) & 3, minus 4 unless bit 4n + c of
    # hmask[l] is set; scale i: nibble i % 8 of bytes 0..7 | bits 2 (i // 4).. of byte 8 + i % 4.
    hmask = blocks[:, :32].reshape(-1, 1, 32)
    qs = blocks[:, 32:96].reshape(-1, 2, 1, 32)  # [B, half, 1, l]
    low = torch.cat([(qs >> (2 * c)) & 3 for c in range(4)], dim=2).reshape(-1, 8, 32)  # [B, sub-block, l]
    high = (hmask >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1
    values = low.float() - 4 * (1 - high.float())
    packed = blocks[:, 96:108].int()
    nibbles = torch.cat([packed[:, :8] & 15, packed[:, :8] >> 4], dim=1)  # [B, 16]
    high_bits = torch.cat([(packed[:, 8:12] >> (2 * k)) & 3 for k in range(4)], dim=1)  # [B, 16]
    scales = ((nibbles | high_bits << 4) - 32).float().reshape(-1, 8, 2, 1)
    d = _f16(blocks, 108).reshape(-1, 1, 1, 1)
    return ((d * scales) * values.reshape(-1, 8, 2, 16)).reshape(-1, 256)  # (d * scale) * q, as ggml


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # Two halves of 128 values: ql [64] low nibbles, qh [32] high bit pairs, 8 int8
    # scales (one per 16 values); value l of quarter c (l < 32) is
    # ((ql[32 (c & 1) + l] >> 4 (c // 2)) & 15) | ((qh[l] >> 2c) & 3) << 4, minus 32.
    ql = blocks[:, :128].reshape(-1, 2, 2, 32)  # [B, half, c & 1, l]
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32)  # [B, half, 1, l]
    low = torch.cat([ql & 15, ql >> 4], dim=2)  # [B, half, c, l]: c = 0, 1 low nibbles; 2, 3 high
    high = torch.cat([(qh >> (2 * c)) & 3 for c in range(4)], dim=2)  # [B, half, c, l]
    values = (low | (high << 4)).float() - 32
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float().reshape(-1, 2, 4, 2, 1)
    d = _f16(blocks, 208).reshape(-1, 1, 1, 1, 1)
    return ((d * scales) * values.reshape(-1, 2, 4, 2, 16)).reshape(-1, 256)  # (d * scale) * q, as ggml


# ggml's 16 non-uniform levels of IQ4_NL and IQ4_XS
_IQ4_LEVELS = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                           dtype=torch.float32)


def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * _IQ4_LEVELS[_nibbles(blocks[:, 2:]).long()]


def _iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    # half d; 16 bits scales_h; 4 bytes scales_l; 8 sub-blocks of 16 nibble bytes (as IQ4_NL's).
    # Sub-block j's scale: nibble j of scales_l | bits 2j, 2j+1 of scales_h << 4, minus 32.
    high = blocks[:, 2:4].contiguous().view(torch.int16).int() & 0xFFFF  # [B, 1]
    low = blocks[:, 4:8]
    low = torch.stack([low & 15, low >> 4], dim=2).reshape(-1, 8).int()  # [B, 8]
    scales = (low | ((high >> torch.arange(0, 16, 2)) & 3) << 4).float() - 32
    d = _f16(blocks, 0) * scales  # [B, 8]
    levels = _IQ4_LEVELS[_nibbles(blocks[:, 8:].reshape(-1, 16)).long()].reshape(-1, 8, 32)
    return (d.unsqueeze(2) * levels).reshape(-1, 256)


_DECODERS = {GGMLType.Q8_0: _q8_0, GGMLType.Q4_0: _q4_0, GGMLType.Q4_1: _q4_1, GGMLType.Q5_0: _q5_0,
             GGMLType.Q5_1: _q5_1, GGMLType.Q2_K: _q2_k, GGMLType.Q3_K: _q3_k, GGMLType.Q4_K: _q4_k, GGMLType.Q5_K: _q5_k, GGMLType.Q6_K: _q6_k,
             GGMLType.IQ4_NL: _iq4_nl, GGMLType.IQ4_XS: _iq4_xs}
_BLOCK_BYTES = {GGMLType.Q8_0: 34, GGMLType.Q4_0: 18, GGMLType.Q4_1: 20, GGMLType.Q5_0: 22, GGMLType.Q5_1: 24,
                GGMLType.Q2_K: 84, GGMLType.Q3_K: 110, GGMLType.Q4_K: 144, GGMLType.Q5_K: 176, GGMLType.Q6_K: 210, GGMLType.IQ4_NL: 18,
                GGMLType.IQ4_XS: 136}
