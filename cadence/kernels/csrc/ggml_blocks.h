/* ggml's block layouts (GGUF's quantized types), for quant_matmul.c: what each
 * type's bytes mean, decoded group by group (32 values: one block of Q8_0, Q4_0,
 * Q4_1, Q5_0, Q5_1, IQ4_NL; one eighth of a 256-value Q2_K, Q3_K, Q4_K, Q5_K,
 * Q6_K or IQ4_XS super-block):
 *
 *     decode_row, decode_group_avx2   to float32, as ggml's dequantize_row_* (and
 *                                     the gguf package) compute the values
 *     weight_values, k_pair_values,   (AVX2) to 16-bit integers u with float
 *     group_scales, super_block_scales  scales a, b: the group's weights are a u + b
 *
 * Each layout is written out above its scalar decoder; tests/models/ggml_blocks.py
 * holds independent reference decoders of the same layouts. The includer defines
 * QUANT_AVX2 where AVX2 and FMA are available and includes common.h first. */

#ifndef CADENCE_GGML_BLOCKS_H
#define CADENCE_GGML_BLOCKS_H

/* ggml's type ids (GGMLQuantizationType). */
enum {
    TYPE_Q4_0 = 2, TYPE_Q4_1 = 3, TYPE_Q5_0 = 6, TYPE_Q5_1 = 7, TYPE_Q8_0 = 8,
    TYPE_Q2_K = 10, TYPE_Q3_K = 11, TYPE_Q4_K = 12, TYPE_Q5_K = 13, TYPE_Q6_K = 14,
    TYPE_IQ4_NL = 20, TYPE_IQ4_XS = 23
};
/* Types whose values come in 256-value super-blocks. */
#define SUPER_BLOCK_TYPE(type)                                                                     \
    ((type) == TYPE_Q2_K || (type) == TYPE_Q3_K || (type) == TYPE_Q4_K || (type) == TYPE_Q5_K ||  \
     (type) == TYPE_Q6_K || (type) == TYPE_IQ4_XS)
/* Types whose weights are a * q + b with b != 0 (the others: a * q). */
#define OFFSET_TYPE(type)                                                                          \
    ((type) == TYPE_Q4_0 || (type) == TYPE_Q4_1 || (type) == TYPE_Q5_0 || (type) == TYPE_Q5_1 || \
     (type) == TYPE_Q2_K || (type) == TYPE_Q4_K || (type) == TYPE_Q5_K)
#define GROUP 32

static inline float f16_at(const uint8_t *bytes) {
    uint16_t half;
    memcpy(&half, bytes, sizeof half);
    return f16_to_float(half);
}

/* ---------------------------------------------------------------- group decoders
 * Group g (values 32g .. 32g+31) of one weight row into out[32]. */

static inline void decode_q8_0(const uint8_t *row, int64_t g, float *restrict out) {
    const uint8_t *block = row + g * 34; /* half d; int8 q[32] */
    const float d = f16_at(block);
    const int8_t *q = (const int8_t *)(block + 2);
    for (int i = 0; i < GROUP; ++i) out[i] = (float)q[i] * d;
}

static inline void decode_q4_0(const uint8_t *row, int64_t g, float *restrict out) {
    const uint8_t *block = row + g * 18; /* half d; low nibbles are values 0..15, high 16..31 */
    const float d = f16_at(block);
    const uint8_t *q = block + 2;
    for (int i = 0; i < GROUP / 2; ++i) {
        out[i] = (float)((int)(q[i] & 15) - 8) * d;
        out[i + GROUP / 2] = (float)((int)(q[i] >> 4) - 8) * d;
    }
}

static inline void decode_q4_1(const uint8_t *row, int64_t g, float *restrict out) {
    const uint8_t *block = row + g * 20; /* half d, m; nibbles as Q4_0; y = q d + m */
    const float d = f16_at(block), m = f16_at(block + 2);
    const uint8_t *q = block + 4;
    for (int i = 0; i < GROUP / 2; ++i) {
        out[i] = (float)(q[i] & 15) * d + m;
        out[i + GROUP / 2] = (float)(q[i] >> 4) * d + m;
    }
}

/* Q5_0 block (32 values, 22 bytes): half d; 4 bytes qh, a little-endian 32-bit word
 * whose bit i is bit 4 of value i; 16 bytes of nibbles as Q4_0. y = (q - 16) d.
 * Q5_1 (24 bytes): half d, m, then qh and the nibbles; y = q d + m. */
static inline uint32_t fifth_bits_word(const uint8_t *qh) {
    uint32_t word;
    memcpy(&word, qh, sizeof word);
    return word;
}

static inline int q5_value(const uint8_t *q, uint32_t fifth_bits, int i) {
    const int nibble = i < GROUP / 2 ? q[i] & 15 : q[i - GROUP / 2] >> 4;
    return nibble | (int)((fifth_bits >> i) & 1) << 4;
}

static inline void decode_q5_0(const uint8_t *row, int64_t g, float *restrict out) {
    const uint8_t *block = row + g * 22;
    const float d = f16_at(block);
    const uint32_t fifth_bits = fifth_bits_word(block + 2);
    for (int i = 0; i < GROUP; ++i) out[i] = (float)(q5_value(block + 6, fifth_bits, i) - 16) * d;
}

static inline void decode_q5_1(const uint8_t *row, int64_t g, float *restrict out) {
    const uint8_t *block = row + g * 24;
    const float d = f16_at(block), m = f16_at(block + 2);
    const uint32_t fifth_bits = fifth_bits_word(block + 4);
    for (int i = 0; i < GROUP; ++i) out[i] = (float)q5_value(block + 8, fifth_bits, i) * d + m;
}

/* Q4_K super-block (256 values, 144 bytes): half d, dmin; 12 bytes holding eight
 * 6-bit scales and eight 6-bit mins; 128 bytes of nibbles. Sub-block j (32 values)
 * is y = d*scale_j*q - dmin*min_j, its nibbles the low (j even) or high (j odd)
 * halves of bytes 32*(j/2) .. 32*(j/2)+31. */
static inline void q4_k_scale_min(const uint8_t *packed, int j, int *scale, int *min) {
    if (j < 4) {
        *scale = packed[j] & 63;
        *min = packed[j + 4] & 63;
    } else {
        *scale = (packed[j + 4] & 15) | ((packed[j - 4] >> 6) << 4);
        *min = (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4);
    }
}

static inline void decode_q4_k(const uint8_t *row, int64_t g, float *restrict out) {
    const uint8_t *block = row + (g / 8) * 144, *packed = block + 4;
    const int j = (int)(g % 8);
    int scale, min;
    q4_k_scale_min(packed, j, &scale, &min);
    const float d = f16_at(block) * (float)scale, offset = f16_at(block + 2) * (float)min;
    const uint8_t *q = block + 16 + 32 * (j / 2);
    const int shift = (j & 1) * 4;
    for (int i = 0; i < GROUP; ++i) out[i] = (float)((q[i] >> shift) & 15) * d - offset;
}

/* Q5_K super-block (256 values, 176 bytes): Q4_K's d, dmin and packed scales, then
 * 32 bytes qh, then Q4_K's 128 bytes of nibbles. Bit j of qh[l] is bit 4 of value l
 * of sub-block j. */
static inline void decode_q5_k(const uint8_t *row, int64_t g, float *restrict out) {
    const uint8_t *block = row + (g / 8) * 176;
    const int j = (int)(g % 8);
    int scale, min;
    q4_k_scale_min(block + 4, j, &scale, &min);
    const float d = f16_at(block) * (float)scale, offset = f16_at(block + 2) * (float)min;
    const uint8_t *qh = block + 16, *q = block + 48 + 32 * (j / 2);
    const int shift = (j & 1) * 4;
    for (int i = 0; i < GROUP; ++i)
        out[i] = (float)(((q[i] >> shift) & 15) | ((qh[i] >> j) & 1) << 4) * d - offset;
}

/* IQ4_NL block (32 values, 18 bytes): half d; 16 bytes of nibbles as Q4_0, each an
 * index into ggml's 16 non-uniform levels: y = d * IQ4_LEVELS[nibble].
 * IQ4_XS super-block (256 values, 136 bytes): half d; 16 bits scales_h; 4 bytes
 * scales_l; 128 bytes of nibbles, 16 per sub-block j (as an IQ4_NL block's). Sub-block
 * j's 6-bit scale is nibble j of scales_l (low nibble first) | bits 2j, 2j+1 of
 * scales_h << 4, and y = d * (scale - 32) * IQ4_LEVELS[nibble]. */
static const int8_t IQ4_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static inline float iq4_xs_scale(const uint8_t *block, int j) {
    const int high = (int)((block[2] | block[3] << 8) >> (2 * j)) & 3;
    const int low = (block[4 + j / 2] >> (4 * (j & 1))) & 15;
    return f16_at(block) * (float)((low | high << 4) - 32);
}

/* The 32 values of 16 bytes of IQ4 nibbles (low nibbles first), times d. */
static inline void decode_iq4_levels(const uint8_t *q, float d, float *restrict out) {
    for (int i = 0; i < GROUP / 2; ++i) {
        out[i] = d * (float)IQ4_LEVELS[q[i] & 15];
        out[i + GROUP / 2] = d * (float)IQ4_LEVELS[q[i] >> 4];
    }
}

static inline void decode_iq4_nl(const uint8_t *row, int64_t g, float *restrict out) {
    const uint8_t *block = row + g * 18;
    decode_iq4_levels(block + 2, f16_at(block), out);
}

static inline void decode_iq4_xs(const uint8_t *row, int64_t g, float *restrict out) {
    const uint8_t *block = row + (g / 8) * 136;
    const int j = (int)(g % 8);
    decode_iq4_levels(block + 8 + 16 * j, iq4_xs_scale(block, j), out);
}

/* Q2_K super-block (256 values, 84 bytes): 16 bytes of scales (one per 16 values: a
 * 4-bit scale in the low nibble, a 4-bit min in the high one), qs[64], half d, dmin.
 * Sub-block g (32 values) lies in half n = g / 4 (qs + 32n), quarter c = g % 4: value
 * l is (qs[32n + l] >> 2c) & 3, and y = d * scale * q - dmin * min with the scale
 * byte 2g + l / 16. */
static inline int q2_k_value(const uint8_t *block, int g, int l) {
    return (block[16 + 32 * (g / 4) + l] >> (2 * (g % 4))) & 3;
}

static inline void decode_q2_k(const uint8_t *row, int64_t g, float *restrict out) {
    const uint8_t *block = row + (g / 8) * 84;
    const int j = (int)(g % 8);
    const float d = f16_at(block + 80), dmin = f16_at(block + 82);
    for (int l = 0; l < GROUP; ++l) {
        const uint8_t scale = block[2 * j + l / 16];
        out[l] = d * (float)(scale & 15) * (float)q2_k_value(block, j, l) - dmin * (float)(scale >> 4);
    }
}

/* Q3_K super-block (256 values, 110 bytes): hmask[32], qs[64], 12 bytes of sixteen
 * 6-bit scales (one per 16 values), half d last. Sub-block g (32 values) lies in
 * half n = g / 4 (qs + 32n), quarter c = g % 4: value l is ((qs[32n + l] >> 2c) & 3),
 * minus 4 unless bit g of hmask[l] is set, times d * (scale[2g + l / 16] - 32).
 * Scale i: its low 4 bits are nibble i % 8 of bytes 0..7 (low nibbles for i < 8),
 * its high 2 bits bits 2 (i / 4), 2 (i / 4) + 1 of byte 8 + i % 4. */
static inline int q3_k_scale(const uint8_t *block, int i) {
    const uint8_t *packed = block + 96;
    const int low = (packed[i % 8] >> (4 * (i / 8))) & 15, high = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
    return (low | high << 4) - 32;
}

static inline int q3_k_value(const uint8_t *block, int g, int l) {
    const int low = (block[32 + 32 * (g / 4) + l] >> (2 * (g % 4))) & 3;
    return low - ((block[l] >> g) & 1 ? 0 : 4);
}

static inline void decode_q3_k(const uint8_t *row, int64_t g, float *restrict out) {
    const uint8_t *block = row + (g / 8) * 110;
    const int j = (int)(g % 8);
    const float d = f16_at(block + 108);
    /* (d * scale) * value, as ggml multiplies them */
    const float scaled[2] = {d * (float)q3_k_scale(block, 2 * j), d * (float)q3_k_scale(block, 2 * j + 1)};
    for (int l = 0; l < GROUP; ++l) out[l] = scaled[l / 16] * (float)q3_k_value(block, j, l);
}

/* Q6_K super-block (256 values, 210 bytes): 128 bytes of low nibbles (ql), 64
 * bytes of high bit pairs (qh), 16 int8 scales (one per 16 values), half d last.
 * Sub-block j (32 values) lies in half n = j / 4 (ql + 64n, qh + 32n, scales +
 * 8n), quarter c = j % 4: value l is ((ql[32 (c & 1) + l] >> 4 (c / 2)) & 15) |
 * ((qh[l] >> 2c) & 3) << 4, minus 32, times d * scale[2c + l / 16]. */
typedef struct {
    const uint8_t *ql, *qh;
    const int8_t *scales; /* the sub-block's two */
    int low_shift, high_shift;
    float d;
} Q6kGroup;

static inline Q6kGroup q6_k_group(const uint8_t *row, int64_t g) {
    const uint8_t *block = row + (g / 8) * 210;
    const int j = (int)(g % 8), n = j / 4, c = j % 4;
    Q6kGroup group = {block + 64 * n + 32 * (c & 1), block + 128 + 32 * n,
                      (const int8_t *)(block + 192) + 8 * n + 2 * c, 4 * (c / 2), 2 * c, f16_at(block + 208)};
    return group;
}

static inline void decode_q6_k(const uint8_t *row, int64_t g, float *restrict out) {
    const Q6kGroup q = q6_k_group(row, g);
    /* (d * scale) * value, as ggml multiplies them */
    const float scaled[2] = {q.d * (float)q.scales[0], q.d * (float)q.scales[1]};
    for (int l = 0; l < GROUP; ++l) {
        const int value = (((q.ql[l] >> q.low_shift) & 15) | (((q.qh[l] >> q.high_shift) & 3) << 4)) - 32;
        out[l] = scaled[l / 16] * (float)value;
    }
}

static int64_t row_bytes(int type, int64_t k) {
    switch (type) {
    case TYPE_Q8_0: return k / 32 * 34;
    case TYPE_Q4_0: return k / 32 * 18;
    case TYPE_Q4_1: return k / 32 * 20;
    case TYPE_Q5_0: return k / 32 * 22;
    case TYPE_Q5_1: return k / 32 * 24;
    case TYPE_Q2_K: return k / 256 * 84;
    case TYPE_Q3_K: return k / 256 * 110;
    case TYPE_Q4_K: return k / 256 * 144;
    case TYPE_Q5_K: return k / 256 * 176;
    case TYPE_IQ4_NL: return k / 32 * 18;
    case TYPE_IQ4_XS: return k / 256 * 136;
    case TYPE_Q6_K: return k / 256 * 210;
    default: return -1;
    }
}

#ifdef QUANT_AVX2
/* The same groups as four vectors of 8 floats, in registers (AVX2). */
static inline __m256 bytes_to_floats(__m128i bytes, int is_signed) {
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
}

/* v[0..3] <- values 0..31 of 32 bytes of small integers, times d plus m. */
static inline void scale_bytes(__m256i bytes, int is_signed, float d, float m, __m256 v[4]) {
    const __m128i low = _mm256_castsi256_si128(bytes), high = _mm256_extracti128_si256(bytes, 1);
    const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
    const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
    for (int j = 0; j < 4; ++j) v[j] = _mm256_fmadd_ps(bytes_to_floats(parts[j], is_signed), dv, mv);
}

/* A Q6_K group's 32 values, each q - 32, as signed bytes. */
static inline __m256i q6_k_bytes(const Q6kGroup *q) {
    const __m256i low = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)q->ql), q->low_shift),
                                         _mm256_set1_epi8(15));
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)q->qh), q->high_shift),
                                          _mm256_set1_epi8(3));
    return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), _mm256_set1_epi8(32));
}

/* 16 bytes of nibble pairs -> 32 bytes: low nibbles first, then high ones. */
static inline __m256i split_nibbles(const uint8_t *q) {
    const __m128i packed = _mm_loadu_si128((const __m128i *)q), mask = _mm_set1_epi8(15);
    const __m128i low = _mm_and_si128(packed, mask), high = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
    return _mm256_set_m128i(high, low);
}

/* A Q5_0 / Q5_1 group's fifth bits as bytes: byte i is 16 where bit i of the word is set. */
static inline __m256i fifth_bit_bytes(const uint8_t *qh) {
    /* byte i takes byte i / 8 of the word, then keeps only its bit i % 8 */
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)fifth_bits_word(qh)),
                                               _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                                 0x0101010101010101, 0));
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

/* Bit j of each of a Q5_K block's 32 qh bytes, moved to bit 4. */
static inline __m256i q5_k_fifth_bytes(const uint8_t *qh, int j) {
    const __m256i bits = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)qh), j),
                                          _mm256_set1_epi8(1));
    return _mm256_slli_epi16(bits, 4); /* bytes of 0 or 1: nothing crosses into the next byte */
}

/* 16 bytes of IQ4 nibbles -> their 32 levels as signed bytes (low nibbles first). */
static inline __m256i iq4_level_bytes(const uint8_t *q) {
    const __m256i levels = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_LEVELS));
    return _mm256_shuffle_epi8(levels, split_nibbles(q)); /* split_nibbles: both lanes index one table */
}

/* A Q2_K sub-block's 32 values (0..3) as bytes. */
static inline __m256i q2_k_bytes(const uint8_t *block, int j) {
    const __m256i packed = _mm256_loadu_si256((const __m256i *)(block + 16 + 32 * (j / 4)));
    return _mm256_and_si256(_mm256_srli_epi16(packed, 2 * (j % 4)), _mm256_set1_epi8(3));
}

/* A Q3_K sub-block's 32 values (each 2 bits, minus 4 where its hmask bit is clear) as signed bytes. */
static inline __m256i q3_k_bytes(const uint8_t *block, int j) {
    const __m256i low = _mm256_and_si256(
        _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(block + 32 + 32 * (j / 4))), 2 * (j % 4)),
        _mm256_set1_epi8(3));
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)block), j),
                                          _mm256_set1_epi8(1));
    return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 2)), _mm256_set1_epi8(4));
}

static inline void decode_group_avx2(int type, const uint8_t *row, int64_t g, __m256 v[4]) {
    switch (type) {
    case TYPE_Q8_0: {
        const uint8_t *block = row + g * 34;
        scale_bytes(_mm256_loadu_si256((const __m256i *)(block + 2)), 1, f16_at(block), 0.0f, v);
        break;
    }
    case TYPE_Q4_0: {
        const uint8_t *block = row + g * 18;
        const __m256i centred = _mm256_sub_epi8(split_nibbles(block + 2), _mm256_set1_epi8(8));
        scale_bytes(centred, 1, f16_at(block), 0.0f, v);
        break;
    }
    case TYPE_Q4_1: {
        const uint8_t *block = row + g * 20;
        scale_bytes(split_nibbles(block + 4), 0, f16_at(block), f16_at(block + 2), v);
        break;
    }
    case TYPE_Q5_0: {
        const uint8_t *block = row + g * 22;
        const __m256i values = _mm256_or_si256(split_nibbles(block + 6), fifth_bit_bytes(block + 2));
        scale_bytes(_mm256_sub_epi8(values, _mm256_set1_epi8(16)), 1, f16_at(block), 0.0f, v);
        break;
    }
    case TYPE_Q5_1: {
        const uint8_t *block = row + g * 24;
        const __m256i values = _mm256_or_si256(split_nibbles(block + 8), fifth_bit_bytes(block + 4));
        scale_bytes(values, 0, f16_at(block), f16_at(block + 2), v);
        break;
    }
    case TYPE_Q4_K:
    case TYPE_Q5_K: {
        const int five_bits = type == TYPE_Q5_K;
        const uint8_t *block = row + (g / 8) * (five_bits ? 176 : 144);
        const int j = (int)(g % 8);
        int scale, min;
        q4_k_scale_min(block + 4, j, &scale, &min);
        const __m256i packed = _mm256_loadu_si256((const __m256i *)(block + (five_bits ? 48 : 16) + 32 * (j / 2)));
        __m256i values = _mm256_and_si256(_mm256_srli_epi16(packed, (j & 1) * 4), _mm256_set1_epi8(15));
        if (five_bits) values = _mm256_or_si256(values, q5_k_fifth_bytes(block + 16, j));
        scale_bytes(values, 0, f16_at(block) * (float)scale, -f16_at(block + 2) * (float)min, v);
        break;
    }
    case TYPE_IQ4_NL: {
        const uint8_t *block = row + g * 18;
        scale_bytes(iq4_level_bytes(block + 2), 1, f16_at(block), 0.0f, v);
        break;
    }
    case TYPE_IQ4_XS: {
        const uint8_t *block = row + (g / 8) * 136;
        const int j = (int)(g % 8);
        scale_bytes(iq4_level_bytes(block + 8 + 16 * j), 1, iq4_xs_scale(block, j), 0.0f, v);
        break;
    }
    case TYPE_Q2_K: { /* values 0..15 and 16..31 have a scale and a min each */
        const uint8_t *block = row + (g / 8) * 84;
        const int j = (int)(g % 8);
        const __m256i values = q2_k_bytes(block, j);
        const __m128i low = _mm256_castsi256_si128(values), high = _mm256_extracti128_si256(values, 1);
        const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
        const float d = f16_at(block + 80), dmin = f16_at(block + 82);
        for (int i = 0; i < 4; ++i) {
            const uint8_t scale = block[2 * j + i / 2];
            v[i] = _mm256_fmadd_ps(bytes_to_floats(parts[i], 0), _mm256_set1_ps(d * (float)(scale & 15)),
                                   _mm256_set1_ps(-dmin * (float)(scale >> 4)));
        }
        break;
    }
    case TYPE_Q3_K: { /* values 0..15 and 16..31 have a scale each */
        const uint8_t *block = row + (g / 8) * 110;
        const int j = (int)(g % 8);
        const __m256i values = q3_k_bytes(block, j);
        const __m128i low = _mm256_castsi256_si128(values), high = _mm256_extracti128_si256(values, 1);
        const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
        const float d = f16_at(block + 108);
        for (int i = 0; i < 4; ++i)
            v[i] = _mm256_mul_ps(_mm256_set1_ps(d * (float)q3_k_scale(block, 2 * j + i / 2)),
                                 bytes_to_floats(parts[i], 1));
        break;
    }
    case TYPE_Q6_K: { /* values 0..15 and 16..31 have a scale each */
        const Q6kGroup q = q6_k_group(row, g);
        const __m256i values = q6_k_bytes(&q);
        const __m128i low = _mm256_castsi256_si128(values), high = _mm256_extracti128_si256(values, 1);
        const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
        for (int j = 0; j < 4; ++j)
            v[j] = _mm256_mul_ps(_mm256_set1_ps(q.d * (float)q.scales[j / 2]), bytes_to_floats(parts[j], 1));
        break;
    }
    }
}

/* One whole row of K values into out[K] (32-byte aligned). */
static void decode_row(int type, const uint8_t *row, int64_t k, float *restrict out) {
    for (int64_t g = 0; g < k / GROUP; ++g) {
        __m256 v[4];
        decode_group_avx2(type, row, g, v);
        for (int j = 0; j < 4; ++j) _mm256_store_ps(out + g * GROUP + 8 * j, v[j]);
    }
}
#else
/* One whole row of K values into out[K]; the switch sits outside the loops. */
static void decode_row(int type, const uint8_t *row, int64_t k, float *restrict out) {
    const int64_t groups = k / GROUP;
    switch (type) {
    case TYPE_Q8_0: for (int64_t g = 0; g < groups; ++g) decode_q8_0(row, g, out + g * GROUP); break;
    case TYPE_Q4_0: for (int64_t g = 0; g < groups; ++g) decode_q4_0(row, g, out + g * GROUP); break;
    case TYPE_Q4_1: for (int64_t g = 0; g < groups; ++g) decode_q4_1(row, g, out + g * GROUP); break;
    case TYPE_Q5_0: for (int64_t g = 0; g < groups; ++g) decode_q5_0(row, g, out + g * GROUP); break;
    case TYPE_Q5_1: for (int64_t g = 0; g < groups; ++g) decode_q5_1(row, g, out + g * GROUP); break;
    case TYPE_Q2_K: for (int64_t g = 0; g < groups; ++g) decode_q2_k(row, g, out + g * GROUP); break;
    case TYPE_Q3_K: for (int64_t g = 0; g < groups; ++g) decode_q3_k(row, g, out + g * GROUP); break;
    case TYPE_Q4_K: for (int64_t g = 0; g < groups; ++g) decode_q4_k(row, g, out + g * GROUP); break;
    case TYPE_Q5_K: for (int64_t g = 0; g < groups; ++g) decode_q5_k(row, g, out + g * GROUP); break;
    case TYPE_IQ4_NL: for (int64_t g = 0; g < groups; ++g) decode_iq4_nl(row, g, out + g * GROUP); break;
    case TYPE_IQ4_XS: for (int64_t g = 0; g < groups; ++g) decode_iq4_xs(row, g, out + g * GROUP); break;
    case TYPE_Q6_K: for (int64_t g = 0; g < groups; ++g) decode_q6_k(row, g, out + g * GROUP); break;
    }
}
#endif

#ifdef QUANT_AVX2
/* ---------------------------------------------------------------- integer forms
 * A group of a weight row as 16-bit integers for the integer products (see
 * quant_matmul.c, "few rows of x"). */

/* 16 bits as 16-bit lanes: lane i is 16 where bit i is set. */
static inline __m256i fifth_bit_words(uint16_t bits) {
    const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                          (short)0x8000);
    return _mm256_and_si256(_mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16((short)bits), bit), bit),
                            _mm256_set1_epi16(16));
}

/* Group g of a weight row as 16-bit integers u (values 0..15 in lo, 16..31 in hi);
 * the group's weights are a * u + b (``group_scales``, ``super_block_scales``). */
static inline __attribute__((always_inline)) void weight_values(int type, const uint8_t *row, int64_t g, __m256i *lo, __m256i *hi) {
    const __m256i low_nibble = _mm256_set1_epi16(15);
    switch (type) {
    case TYPE_Q8_0: {
        const uint8_t *block = row + g * 34;
        *lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(block + 2)));
        *hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(block + 18)));
        return;
    }
    case TYPE_Q4_0:
    case TYPE_Q4_1: { /* byte i holds values i (low nibble) and i + 16 (high) */
        const uint8_t *q = row + g * (type == TYPE_Q4_0 ? 18 : 20) + (type == TYPE_Q4_0 ? 2 : 4);
        const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)q));
        *lo = _mm256_and_si256(bytes, low_nibble);
        *hi = _mm256_srli_epi16(bytes, 4);
        return;
    }
    case TYPE_Q5_0:
    case TYPE_Q5_1: { /* as Q4_0, plus the fifth bits of values 0..15 and 16..31 */
        const uint8_t *qh = row + g * (type == TYPE_Q5_0 ? 22 : 24) + (type == TYPE_Q5_0 ? 2 : 4);
        const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qh + 4)));
        const uint32_t fifth_bits = fifth_bits_word(qh);
        *lo = _mm256_or_si256(_mm256_and_si256(bytes, low_nibble), fifth_bit_words((uint16_t)fifth_bits));
        *hi = _mm256_or_si256(_mm256_srli_epi16(bytes, 4), fifth_bit_words((uint16_t)(fifth_bits >> 16)));
        return;
    }
    case TYPE_IQ4_NL:
    case TYPE_IQ4_XS: { /* the nibbles' levels, looked up as bytes, widened with their sign */
        const uint8_t *q = type == TYPE_IQ4_NL ? row + g * 18 + 2 : row + (g / 8) * 136 + 8 + 16 * (g % 8);
        const __m128i levels = _mm_loadu_si128((const __m128i *)IQ4_LEVELS), mask = _mm_set1_epi8(15);
        const __m128i packed = _mm_loadu_si128((const __m128i *)q);
        *lo = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(levels, _mm_and_si128(packed, mask)));
        *hi = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(levels, _mm_and_si128(_mm_srli_epi16(packed, 4), mask)));
        return;
    }
    case TYPE_Q2_K: { /* each half's 4-bit scale folded into its integers: scale * q <= 45 */
        const uint8_t *block = row + (g / 8) * 84;
        const int j = (int)(g % 8);
        const __m256i values = q2_k_bytes(block, j);
        *lo = _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(values)),
                                 _mm256_set1_epi16((short)(block[2 * j] & 15)));
        *hi = _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(values, 1)),
                                 _mm256_set1_epi16((short)(block[2 * j + 1] & 15)));
        return;
    }
    case TYPE_Q3_K: { /* each half's scale folded into its integers: |scale * q| <= 128 */
        const uint8_t *block = row + (g / 8) * 110;
        const int j = (int)(g % 8);
        const __m256i values = q3_k_bytes(block, j);
        *lo = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(values)),
                                 _mm256_set1_epi16((short)q3_k_scale(block, 2 * j)));
        *hi = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(values, 1)),
                                 _mm256_set1_epi16((short)q3_k_scale(block, 2 * j + 1)));
        return;
    }
    default: { /* TYPE_Q6_K, each half's scale folded into its integers: |scale * q| <= 4096
                * (Q4_K's and Q5_K's groups come in pairs: k_pair_values) */
        const Q6kGroup q = q6_k_group(row, g);
        const __m256i values = q6_k_bytes(&q);
        *lo = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(values)), _mm256_set1_epi16(q.scales[0]));
        *hi = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(values, 1)),
                                 _mm256_set1_epi16(q.scales[1]));
        return;
    }
    }
}

/* Groups j and j + 1 (j even) of a Q4_K or Q5_K super-block, which share their 32
 * bytes of nibbles: j in the low nibbles, j + 1 in the high ones (values[0..1] and
 * [2..3]). Each byte is widened once; Q5_K's fifth bits are bits j, j + 1 of qh. */
static inline __attribute__((always_inline)) void k_pair_values(int type, const uint8_t *block, int j, __m256i values[4]) {
    const uint8_t *q = block + (type == TYPE_Q5_K ? 48 : 16) + 32 * (j / 2);
    const __m256i low_nibble = _mm256_set1_epi16(15);
    const __m256i first = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)q));
    const __m256i second = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(q + 16)));
    values[0] = _mm256_and_si256(first, low_nibble), values[1] = _mm256_and_si256(second, low_nibble);
    values[2] = _mm256_srli_epi16(first, 4), values[3] = _mm256_srli_epi16(second, 4);
    if (type != TYPE_Q5_K) return;
    const __m256i one = _mm256_set1_epi16(1);
    const __m256i high[2] = {_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(block + 16))),
                             _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(block + 32)))};
    for (int i = 0; i < 4; ++i) {
        const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(high[i & 1], j + i / 2), one);
        values[i] = _mm256_or_si256(values[i], _mm256_slli_epi16(bit, 4));
    }
}

/* The eight 6-bit scales and mins of a Q4_K or Q5_K super-block (12 packed bytes,
 * see q4_k_scale_min) as eight floats each, in registers: a = d * scale, b = -dmin * min. */
static inline __attribute__((always_inline)) void q4_k_scale_vectors(const uint8_t *block, __m256 *a, __m256 *b) {
    uint32_t word[3];
    memcpy(word, block + 4, sizeof word);
    const uint32_t low6 = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, low2 = 0x03030303u;
    const uint64_t scales = (uint64_t)(word[0] & low6) |
                            (uint64_t)((word[2] & low4) | (((word[0] >> 6) & low2) << 4)) << 32;
    const uint64_t mins = (uint64_t)(word[1] & low6) |
                          (uint64_t)(((word[2] >> 4) & low4) | (((word[1] >> 6) & low2) << 4)) << 32;
    const __m256 as_floats = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)scales)));
    const __m256 mins_floats = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mins)));
    *a = _mm256_mul_ps(as_floats, _mm256_set1_ps(f16_at(block)));
    *b = _mm256_mul_ps(mins_floats, _mm256_set1_ps(-f16_at(block + 2)));
}

/* A Q4_K super-block's eight 6-bit scales (16-bit lanes 0..7) and mins (8..15),
 * unpacked from its 12 packed bytes with 32-bit masks (as q4_k_scale_min reads them). */
static inline __m256i q4_k_scales_and_mins(const uint8_t *block) {
    uint32_t packed[3];
    memcpy(packed, block + 4, 12);
    const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, top2 = 0x03030303;
    /* built in registers: four scalar stores read back as one vector would wait for them */
    return _mm256_cvtepu8_epi16(_mm_setr_epi32((int)(packed[0] & low6),                                      /* scales 0..3 */
                                               (int)((packed[2] & low4) | (((packed[0] >> 6) & top2) << 4)),  /* scales 4..7 */
                                               (int)(packed[1] & low6),                                       /* mins 0..3 */
                                               (int)(((packed[2] >> 4) & low4) | (((packed[1] >> 6) & top2) << 4)))); /* mins 4..7 */
}

/* Eight 16-bit values, each twice: a group's value for both its runs. */
static inline __m256i twice_each(__m128i values) {
    return _mm256_setr_m128i(_mm_unpacklo_epi16(values, values), _mm_unpackhi_epi16(values, values));
}

/* For the 32-value types: whether a block holds its offset m after d (Q4_1, Q5_1),
 * else the factor of b = factor * d (Q4_0's -8, Q5_0's -16, 0 for Q8_0 and IQ4_NL). */
static inline int with_m(int type) { return type == TYPE_Q4_1 || type == TYPE_Q5_1; }
static inline float offset_factor(int type) { return type == TYPE_Q4_0 ? -8.0f : type == TYPE_Q5_0 ? -16.0f : 0.0f; }

/* a and b of group g of a Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 or IQ4_NL row (b[0] = b[1]: a group's
 * offset is taken whole, see ``run_scales`` in quant_matmul.c). */
static inline __attribute__((always_inline)) void group_scales(int type, const uint8_t *row, int64_t g, float *a, float b[2]) {
    const uint8_t *block = row + g * row_bytes(type, GROUP);
    *a = f16_at(block);
    b[0] = b[1] = with_m(type) ? f16_at(block + 2) : offset_factor(type) * *a;
}

/* a and b of the eight groups of a Q2_K, Q3_K, Q4_K, Q5_K, Q6_K or IQ4_XS super-block,
 * unpacked once for all of them: group j's a[j], its halves' b[2 j], b[2 j + 1]. */
static inline __attribute__((always_inline)) void super_block_scales(int type, const uint8_t *block, float a[8], float b[16]) {
    if (type == TYPE_Q4_K || type == TYPE_Q5_K) {
        const float d = f16_at(block), dmin = f16_at(block + 2);
        for (int j = 0; j < 8; ++j) {
            int scale, min;
            q4_k_scale_min(block + 4, j, &scale, &min);
            a[j] = d * (float)scale, b[2 * j] = b[2 * j + 1] = -dmin * (float)min;
        }
        return;
    }
    if (type == TYPE_Q2_K) { /* the scales are in the integers, the mins in b */
        const float d = f16_at(block + 80), dmin = f16_at(block + 82);
        for (int j = 0; j < 8; ++j) a[j] = d;
        for (int j = 0; j < 16; ++j) b[j] = -dmin * (float)(block[j] >> 4);
        return;
    }
    for (int j = 0; j < 16; ++j) b[j] = 0.0f;
    if (type == TYPE_IQ4_XS) {
        for (int j = 0; j < 8; ++j) a[j] = iq4_xs_scale(block, j);
        return;
    }
    /* Q3_K, Q6_K: the per-16 scales are in the integers (weight_values) */
    const float d = f16_at(block + (type == TYPE_Q6_K ? 208 : 108));
    for (int j = 0; j < 8; ++j) a[j] = d;
}
#endif

#endif /* CADENCE_GGML_BLOCKS_H */
