"""Independent decoders of ggml's block formats, for checking cadence's dequantization.

Written block by block from the layouts in ggml-common.h (``block_q4_K`` etc.)
and the scalar ``dequantize_row_*`` routines of ggml-quants.c, deliberately
plain (loops, no vectorised tricks) so they are easy to compare with the C.
All arithmetic is float32, as in C.
"""

from __future__ import annotations

import numpy as np

QK = 32  # values per block of Q8_0 / Q4_0 / Q4_1
QK_K = 256  # values per super-block of the K-quants
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q2_K": 84, "Q3_K": 110,
               "Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "IQ4_NL": 18, "IQ4_XS": 136}
BLOCK_VALUES = {"Q8_0": QK, "Q4_0": QK, "Q4_1": QK, "Q5_0": QK, "Q5_1": QK, "Q2_K": QK_K, "Q3_K": QK_K,
                "Q4_K": QK_K, "Q5_K": QK_K, "Q6_K": QK_K, "IQ4_NL": QK, "IQ4_XS": QK_K}


def dequantize(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """float32 [rows, cols] from raw bytes holding rows*cols/block values blocks."""
    decode = _DECODERS[kind]
    size = BLOCK_BYTES[kind]
    flat = np.asarray(raw, dtype=np.uint8).reshape(-1)
    blocks = [decode(flat[i:i + size]) for i in range(0, flat.size, size)]
    return np.concatenate(blocks).reshape(shape)


def random_blocks(kind: str, num_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random but valid blocks: random quants and sub-scales, small finite fp16 scales."""
    raw = rng.integers(0, 256, size=(num_blocks, BLOCK_BYTES[kind]), dtype=np.uint8)
    for offset in _FP16_FIELDS[kind]:
        scale = rng.uniform(-0.01, 0.01, size=num_blocks).astype(np.float16)
        raw[:, offset:offset + 2] = scale.view(np.uint8).reshape(num_blocks, 2)
    return raw


def _f16(two_bytes: np.ndarray) -> np.float32:
    return np.float32(two_bytes.view(np.float16)[0])


def _q8_0(block: np.ndarray) -> np.ndarray:
    # struct { half d; int8 qs[32]; }  y = qs * d
    d = _f16(block[0:2])
    qs = block[2:34].view(np.int8)
    return np.array([np.float32(q) * d for q in qs], dtype=np.float32)


def _q4_0(block: np.ndarray) -> np.ndarray:
    # struct { half d; uint8 qs[16]; }  low nibbles are values 0..15, high nibbles 16..31
    d = _f16(block[0:2])
    qs = block[2:18]
    y = np.zeros(QK, dtype=np.float32)
    for j in range(QK // 2):
        y[j] = np.float32(int(qs[j] & 0x0F) - 8) * d
        y[j + QK // 2] = np.float32(int(qs[j] >> 4) - 8) * d
    return y


def _q4_1(block: np.ndarray) -> np.ndarray:
    # struct { half d; half m; uint8 qs[16]; }  y = q * d + m
    d, m = _f16(block[0:2]), _f16(block[2:4])
    qs = block[4:20]
    y = np.zeros(QK, dtype=np.float32)
    for j in range(QK // 2):
        y[j] = np.float32(qs[j] & 0x0F) * d + m
        y[j + QK // 2] = np.float32(qs[j] >> 4) * d + m
    return y


def _q5_values(qh_bytes: np.ndarray, qs: np.ndarray) -> list[int]:
    """The 32 unsigned 5-bit values: qh is a little-endian uint32 holding bit 4 of every
    value (bit j for value j); qs[j] holds the low 4 bits of values j (low nibble) and j+16."""
    qh = int.from_bytes(bytes(qh_bytes), "little")
    low = [(int(qs[j]) & 0x0F) | (((qh >> j) & 1) << 4) for j in range(QK // 2)]
    high = [(int(qs[j]) >> 4) | (((qh >> (j + 16)) & 1) << 4) for j in range(QK // 2)]
    return low + high


def _q5_0(block: np.ndarray) -> np.ndarray:
    # struct { half d; uint8 qh[4]; uint8 qs[16]; }  y = (q - 16) * d
    d = _f16(block[0:2])
    return np.array([np.float32(q - 16) * d for q in _q5_values(block[2:6], block[6:22])], dtype=np.float32)


def _q5_1(block: np.ndarray) -> np.ndarray:
    # struct { half d; half m; uint8 qh[4]; uint8 qs[16]; }  y = q * d + m
    d, m = _f16(block[0:2]), _f16(block[2:4])
    return np.array([np.float32(q) * d + m for q in _q5_values(block[4:8], block[8:24])], dtype=np.float32)


def _k4_scale_min(j: int, scales: np.ndarray) -> tuple[int, int]:
    """6-bit scale and min of sub-block j (0..7) from the 12 packed bytes."""
    q = [int(b) for b in scales]
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    scale = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4)
    minimum = (q[j + 4] >> 4) | ((q[j] >> 6) << 4)
    return scale, minimum


def _k_sub_blocks(block: np.ndarray, qs: np.ndarray, qh: np.ndarray | None) -> np.ndarray:
    """Q4_K's and Q5_K's 256 values: half d, dmin at bytes 0..3, packed scales at 4..15.
    8 sub-blocks of 32; each 32 bytes of qs hold two sub-blocks (low then high nibbles);
    Q5_K's fifth bit of value l of sub-block ``sub`` is bit ``sub`` of qh[l]."""
    d, dmin = _f16(block[0:2]), _f16(block[2:4])
    scales = block[4:16]
    y = np.zeros(QK_K, dtype=np.float32)
    for chunk in range(4):
        for sub, shift in ((2 * chunk, 0), (2 * chunk + 1, 4)):
            scale, minimum = _k4_scale_min(sub, scales)
            d_sub, m_sub = d * np.float32(scale), dmin * np.float32(minimum)
            for l in range(32):
                q = (int(qs[32 * chunk + l]) >> shift) & 0x0F
                if qh is not None:
                    q |= ((int(qh[l]) >> sub) & 1) << 4
                y[32 * sub + l] = d_sub * np.float32(q) - m_sub
    return y


def _q4_k(block: np.ndarray) -> np.ndarray:
    # struct { half d; half dmin; uint8 scales[12]; uint8 qs[128]; }
    return _k_sub_blocks(block, block[16:144], None)


def _q2_k(block: np.ndarray) -> np.ndarray:
    # struct { uint8 scales[16]; uint8 qs[64]; half d; half dmin; }
    # 16 runs of 16 values, in the order of the loops below; run `is` takes scale byte is:
    # y = d * (sc & 15) * q - dmin * (sc >> 4)
    d, dmin = _f16(block[80:82]), _f16(block[82:84])
    y = np.zeros(QK_K, dtype=np.float32)
    out, scale_index = 0, 0
    for half in range(2):
        q = block[16 + 32 * half:48 + 32 * half]
        for shift in (0, 2, 4, 6):
            for start in (0, 16):
                sc = int(block[scale_index])
                scale_index += 1
                dl, ml = d * np.float32(sc & 0x0F), dmin * np.float32(sc >> 4)
                for l in range(start, start + 16):
                    y[out] = dl * np.float32((int(q[l]) >> shift) & 3) - ml
                    out += 1
    return y


def _q3_k(block: np.ndarray) -> np.ndarray:
    # struct { uint8 hmask[32]; uint8 qs[64]; uint8 scales[12]; half d; }
    # The 12 scale bytes, read as three little-endian uint32 words a0, a1, tmp, unpack to
    # four words of four 6-bit scales each (then minus 32), as ggml's kmask1/kmask2 code:
    d = _f16(block[108:110])
    a0, a1, tmp = (int.from_bytes(bytes(block[96 + 4 * i:100 + 4 * i]), "little") for i in range(3))
    k1, k2 = 0x03030303, 0x0F0F0F0F
    words = [(a0 & k2) | (((tmp >> 0) & k1) << 4), (a1 & k2) | (((tmp >> 2) & k1) << 4),
             ((a0 >> 4) & k2) | (((tmp >> 4) & k1) << 4), ((a1 >> 4) & k2) | (((tmp >> 6) & k1) << 4)]
    scales = [((w >> (8 * b)) & 0xFF) - 32 for w in words for b in range(4)]
    y = np.zeros(QK_K, dtype=np.float32)
    out, scale_index, mask = 0, 0, 1
    for half in range(2):  # 128 values each, qs[32 half ..]
        q = block[32 + 32 * half:64 + 32 * half]
        for shift in (0, 2, 4, 6):
            for start in (0, 16):
                dl = d * np.float32(scales[scale_index])
                scale_index += 1
                for l in range(start, start + 16):
                    value = ((int(q[l]) >> shift) & 3) - (0 if int(block[l]) & mask else 4)
                    y[out] = dl * np.float32(value)
                    out += 1
            mask <<= 1
    return y


def _q5_k(block: np.ndarray) -> np.ndarray:
    # struct { half d; half dmin; uint8 scales[12]; uint8 qh[32]; uint8 qs[128]; }
    return _k_sub_blocks(block, block[48:176], block[16:48])


IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # kvalues_iq4nl


def _iq4_levels(qs: np.ndarray, d: np.float32) -> np.ndarray:
    """16 bytes of nibbles: value j is level[low nibble of qs[j]], value j+16 the high one's."""
    y = np.zeros(QK, dtype=np.float32)
    for j in range(QK // 2):
        y[j] = d * np.float32(IQ4_LEVELS[int(qs[j]) & 0x0F])
        y[j + QK // 2] = d * np.float32(IQ4_LEVELS[int(qs[j]) >> 4])
    return y


def _iq4_nl(block: np.ndarray) -> np.ndarray:
    # struct { half d; uint8 qs[16]; }  y = d * level[nibble]
    return _iq4_levels(block[2:18], _f16(block[0:2]))


def _iq4_xs(block: np.ndarray) -> np.ndarray:
    # struct { half d; uint16 scales_h; uint8 scales_l[4]; uint8 qs[128]; }
    # sub-block ib (32 values, qs[16 ib ..]): 6-bit ls = low nibble pair | high bit pair << 4,
    # dl = d * (ls - 32), y = dl * level[nibble]
    d = _f16(block[0:2])
    scales_h = int(block[2]) | int(block[3]) << 8
    y = np.zeros(QK_K, dtype=np.float32)
    for ib in range(QK_K // QK):
        low = (int(block[4 + ib // 2]) >> (4 * (ib % 2))) & 0x0F
        high = (scales_h >> (2 * ib)) & 3
        dl = d * np.float32((low | high << 4) - 32)
        y[QK * ib:QK * (ib + 1)] = _iq4_levels(block[8 + 16 * ib:8 + 16 * (ib + 1)], dl)
    return y


def _q6_k(block: np.ndarray) -> np.ndarray:
    # struct { uint8 ql[128]; uint8 qh[64]; int8 scales[16]; half d; }
    # Two halves of 128 values; in each, value l + 32*k takes 4 low bits from ql
    # and 2 high bits from qh, minus 32, times d * scale[of its 16-value group].
    ql, qh = block[0:128], block[128:192]
    sc = block[192:208].view(np.int8)
    d = _f16(block[208:210])
    y = np.zeros(QK_K, dtype=np.float32)
    for half in range(2):
        base, l_off, h_off, s_off = 128 * half, 64 * half, 32 * half, 8 * half
        for l in range(32):
            low = (int(ql[l_off + l]), int(ql[l_off + l + 32]))
            high = int(qh[h_off + l])
            quants = ((low[0] & 0x0F) | ((high >> 0) & 3) << 4,
                      (low[1] & 0x0F) | ((high >> 2) & 3) << 4,
                      (low[0] >> 4) | ((high >> 4) & 3) << 4,
                      (low[1] >> 4) | ((high >> 6) & 3) << 4)
            group = s_off + l // 16
            for k, q in enumerate(quants):
                y[base + l + 32 * k] = d * np.float32(sc[group + 2 * k]) * np.float32(q - 32)
    return y


_DECODERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q2_K": _q2_k,
             "Q3_K": _q3_k,
             "Q4_K": _q4_k,
             "Q5_K": _q5_k, "Q6_K": _q6_k, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs}
# Byte offsets of the fp16 scale fields in each block.
_FP16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82),
                "Q3_K": (108,),
                "Q4_K": (0, 2),
                "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,)}

# Types cadence loads by dequantizing them (no kernel, no decoder here): their block
# sizes and fp16 fields, so random_blocks can write valid ones. ``gguf.quants`` decodes them.
UNDECODED_BLOCKS = {"TQ2_0": (QK_K, 66, (64,))}
for _kind, (_values, _size, _fields) in UNDECODED_BLOCKS.items():
    BLOCK_VALUES[_kind], BLOCK_BYTES[_kind], _FP16_FIELDS[_kind] = _values, _size, _fields


def decodes(kind: str) -> bool:
    """Whether ``dequantize`` here decodes ``kind`` (independently of cadence and gguf)."""
    return kind in _DECODERS


def round_activations(x: np.ndarray, steps: int = 32767, span: int = QK) -> np.ndarray:
    """float32 [rows, cols] rounded as quantized products see it: each ``span``
    values (a group of 32) to int16 steps (``steps`` 32767), the way ggml's AVX2
    quantize_row_q8_0 rounds to int8 but with 32767 for 127 (d = amax / 32767,
    id = 1 / d or 0, q = x * id rounded to nearest, ties to even), or to int8
    steps as ggml does (``steps`` 127; ``span`` 256 as its Q8_K), returned as
    q * d, every step in float32."""
    out = np.empty_like(x, dtype=np.float32)
    for r in range(x.shape[0]):
        for g in range(0, x.shape[1], span):
            group = x[r, g:g + span].astype(np.float32)
            amax = max(abs(float(v)) for v in group)
            d = np.float32(amax) / np.float32(steps)
            inverse = np.float32(1) / d if d != 0 else np.float32(0)
            q = np.rint(group * inverse)
            assert np.all(np.abs(q) <= steps)
            out[r, g:g + span] = q.astype(np.float32) * d
    return out
