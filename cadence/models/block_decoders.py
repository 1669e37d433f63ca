"""GGUF's quantized blocks decoded in PyTorch: the products' fallback where the C
kernel is not built (``QuantizedTensor.dequantize``, called per product).

Each decoder maps blocks uint8 [B, block bytes] to float32 [B, values per block]
as ggml's dequantize_row_* computes them; the layouts are written out in
``cadence/kernels/csrc/ggml_blocks.h``, and ``tests/models/test_quantized.py``
checks every decoder against the independent ones of ``tests/models/ggml_blocks.py``.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as GGMLType


def decode_rows(ggml_type: GGMLType, blocks: torch.Tensor, cols: int) -> torch.Tensor:
    """float32 [rows, cols] of ``blocks`` uint8 [rows, bytes per row] in ``ggml_type``."""
    decoder, block_bytes = _DECODERS[ggml_type]
    return decoder(blocks.reshape(-1, block_bytes)).reshape(blocks.shape[0], cols)


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


# type -> (decoder, bytes per block)
_DECODERS = {
    GGMLType.Q8_0: (_q8_0, 34), GGMLType.Q4_0: (_q4_0, 18), GGMLType.Q4_1: (_q4_1, 20),
    GGMLType.Q5_0: (_q5_0, 22), GGMLType.Q5_1: (_q5_1, 24), GGMLType.Q2_K: (_q2_k, 84),
    GGMLType.Q3_K: (_q3_k, 110), GGMLType.Q4_K: (_q4_k, 144), GGMLType.Q5_K: (_q5_k, 176),
    GGMLType.Q6_K: (_q6_k, 210), GGMLType.IQ4_NL: (_iq4_nl, 18), GGMLType.IQ4_XS: (_iq4_xs, 136),
}
