/* Matmuls on GGUF's quantized blocks: out[M, N] = x[M, K] @ W[N, K]^T, W kept in blocks.
 *
 * Each weight row is K values stored as K/32 groups of 32 (one block of
 * Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL; one eighth of a 256-value Q2_K, Q3_K,
 * Q4_K, Q5_K, Q6_K or IQ4_XS super-block). x is first
 * rounded per group of 32 to int16 steps (see "activations"). Two paths,
 * each reading every weight byte from memory once per call:
 *
 *     M <= 4 (decode, AVX2)   each group of a weight row widened to 16-bit
 *                             integers in registers and multiplied with the
 *                             M rows' integers (madd), scaled once per group
 *     more rows               a thread decodes a tile of up to 32 weight rows
 *                             to float32 (<= 96 KiB, in L2) and multiplies it
 *                             with every rounded row of x: decoded once per call
 *
 *     weight rows  ──tile of TN rows──▶ decode (float32) ──▶ register tiles
 *     n0 .. n0+TN                                            (rows of x by rows of the tile)
 *
 * With AVX2 and FMA in -march the tile is k-major panels of 16 rows and the
 * register tiles are 6 rows of x by 16 weight rows (broadcast x, no
 * horizontal sums); elsewhere plain C dot products over row-major tiles.
 * ``quant_matmul_isa`` names the one built. Values decode as ggml's
 * dequantize_row_* (and the gguf package) compute them, so results match
 * dequantize-then-matmul of the rounded x up to the order of the float32 sums.
 *
 * Threads: OpenMP over weight rows or tiles. Loaded after torch, the library
 * shares torch's libgomp and its thread count.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QUANT_AVX2 1
/* Rows of x up to which products stay in integers (see "activations"). */
#define DIRECT_MAX_ROWS 4
#else
#define DIRECT_MAX_ROWS 0
#endif

/* ggml's type ids (GGMLQuantizationType). */
enum {
    TYPE_Q4_0 = 2, TYPE_Q4_1 = 3, TYPE_Q5_0 = 6, TYPE_Q5_1 = 7, TYPE_Q8_0 = 8,
    TYPE_Q2_K = 10, TYPE_Q3_K = 11, TYPE_Q4_K = 12, TYPE_Q5_K = 13, TYPE_Q6_K = 14, TYPE_IQ4_NL = 20, TYPE_IQ4_XS = 23
};
/* Types whose values come in 256-value super-blocks. */
#define SUPER_BLOCK_TYPE(type)                                                                     \
    ((type) == TYPE_Q2_K || (type) == TYPE_Q3_K || (type) == TYPE_Q4_K || (type) == TYPE_Q5_K ||  \
     (type) == TYPE_Q6_K || (type) == TYPE_IQ4_XS)
/* Types whose 16-value halves of a group have a scale each (folded into the integers). */
#define HALF_SCALED_TYPE(type) ((type) == TYPE_Q2_K || (type) == TYPE_Q3_K || (type) == TYPE_Q6_K)
/* Types whose weights are a * q + b with b != 0 (the others: a * q). */
#define OFFSET_TYPE(type)                                                                          \
    ((type) == TYPE_Q4_0 || (type) == TYPE_Q4_1 || (type) == TYPE_Q5_0 || (type) == TYPE_Q5_1 || \
     (type) == TYPE_Q2_K || (type) == TYPE_Q4_K || (type) == TYPE_Q5_K)
#define GROUP 32
/* Multiply-adds below which a call stays on one thread. */
#define PARALLEL_MIN_MACS (1 << 16)
/* Most float32 bytes one thread's decoded tile may take (it stays in L2). */
#define TILE_BYTES (96 * 1024)

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
            v[i] = _mm256_mul_ps(_mm256_set1_ps(d * (float)q3_k_scale(block, 2 * j + i / 2)), bytes_to_floats(parts[i], 1));
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

/* ---------------------------------------------------------------- dot products
 * R rows of x (row stride xs) against C decoded rows of w (contiguous, K each):
 * out[r * os + c] = sum_k x[r][k] w[c][k]. K is a multiple of 32. */

#ifdef QUANT_AVX2
static const char ISA[] = "AVX2 FMA";

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#else
#define DEFINE_DOT(R, C)                                                                          \
    static void dot_##R##x##C(const float *x, int64_t xs, const float *w, int64_t k, float *out,   \
                              int64_t os) {                                                       \
        for (int r = 0; r < R; ++r)                                                               \
            for (int c = 0; c < C; ++c) {                                                         \
                const float *xr = x + r * xs, *wc = w + c * k;                                    \
                float sum = 0.0f;                                                                 \
                for (int64_t i = 0; i < k; ++i) sum += xr[i] * wc[i];                             \
                out[r * os + c] = sum;                                                            \
            }                                                                                     \
    }
static const char ISA[] = "portable C";

DEFINE_DOT(4, 2)
DEFINE_DOT(4, 1)
DEFINE_DOT(1, 4)
DEFINE_DOT(1, 1)
#endif

const char *quant_matmul_isa(void) { return ISA; }

#ifdef QUANT_AVX2
/* Many rows of x, AVX2: the tile is stored as panels of PANEL weight rows,
 * k-major (panel[i * PANEL + j] = value i of the panel's row j; rows past the
 * last are zeros), and R x 16 register tiles (R <= 6: 12 accumulators)
 * multiply x's rows: one broadcast value of x against two vectors of the
 * panel per step, no horizontal sums. A group of 32 values of the panel's 16
 * rows is decoded to a 16 x 32 scratch (L1), then transposed 8 x 8 at a time. */
#define PANEL 16
#define TILE_MULTIPLE PANEL

static inline void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int i = 0; i < 4; ++i) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

static void decode_tile(int type, const uint8_t *weight, int64_t stride, int64_t rows, int64_t k,
                        float *tile) {
    float scratch[PANEL * GROUP] __attribute__((aligned(32)));
    for (int64_t p = 0; p * PANEL < rows; ++p) {
        float *panel = tile + p * PANEL * k;
        for (int64_t g = 0; g < k / GROUP; ++g) {
            for (int64_t j = 0; j < PANEL; ++j) {
                __m256 v[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
                if (p * PANEL + j < rows) decode_group_avx2(type, weight + (p * PANEL + j) * stride, g, v);
                for (int q = 0; q < 4; ++q) _mm256_store_ps(scratch + j * GROUP + 8 * q, v[q]);
            }
            for (int h = 0; h < 2; ++h)
                for (int q = 0; q < 4; ++q) {
                    __m256 block[8];
                    for (int i = 0; i < 8; ++i) block[i] = _mm256_load_ps(scratch + (8 * h + i) * GROUP + 8 * q);
                    transpose8(block);
                    for (int i = 0; i < 8; ++i)
                        _mm256_store_ps(panel + (g * GROUP + 8 * q + i) * PANEL + 8 * h, block[i]);
                }
        }
    }
}

#define DEFINE_PANEL(R)                                                                           \
    static void panel_##R(const float *x, int64_t xs, const float *panel, int64_t k, float *out) { \
        __m256 acc[R][2];                                                                         \
        for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();                  \
        for (int64_t i = 0; i < k; ++i) {                                                         \
            const __m256 w0 = _mm256_load_ps(panel + i * PANEL), w1 = _mm256_load_ps(panel + i * PANEL + 8); \
            for (int r = 0; r < R; ++r) {                                                         \
                const __m256 xb = _mm256_broadcast_ss(x + r * xs + i);                            \
                acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);                                   \
                acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);                                   \
            }                                                                                     \
        }                                                                                         \
        for (int r = 0; r < R; ++r) {                                                             \
            _mm256_store_ps(out + r * PANEL, acc[r][0]);                                          \
            _mm256_store_ps(out + r * PANEL + 8, acc[r][1]);                                      \
        }                                                                                         \
    }
DEFINE_PANEL(6)
DEFINE_PANEL(4)
DEFINE_PANEL(2)
DEFINE_PANEL(1)

/* x [m, k] against a decoded tile of tn rows: out[:, 0:tn] (row stride os). */
static void multiply_tile(const float *x, int64_t m, int64_t xs, const float *tile, int64_t tn,
                          int64_t k, float *out, int64_t os) {
    float result[6 * PANEL] __attribute__((aligned(32)));
    for (int64_t p = 0; p * PANEL < tn; ++p) {
        const float *panel = tile + p * PANEL * k;
        const int64_t cols = tn - p * PANEL < PANEL ? tn - p * PANEL : PANEL;
        for (int64_t r = 0; r < m;) {
            const int64_t left = m - r, step = left >= 6 ? 6 : (left >= 4 ? 4 : (left >= 2 ? 2 : 1));
            const float *xr = x + r * xs;
            switch (step) {
            case 6: panel_6(xr, xs, panel, k, result); break;
            case 4: panel_4(xr, xs, panel, k, result); break;
            case 2: panel_2(xr, xs, panel, k, result); break;
            default: panel_1(xr, xs, panel, k, result); break;
            }
            for (int64_t i = 0; i < step; ++i)
                memcpy(out + (r + i) * os + p * PANEL, result + i * PANEL, (size_t)cols * sizeof(float));
            r += step;
        }
    }
}
#else
/* Many rows of x, portable: the tile is tn decoded rows, each row of x dotted with them. */
#define TILE_MULTIPLE 2

static void decode_tile(int type, const uint8_t *weight, int64_t stride, int64_t rows, int64_t k,
                        float *tile) {
    for (int64_t c = 0; c < rows; ++c) decode_row(type, weight + c * stride, k, tile + c * k);
}

/* x [m, k] against a decoded tile [tn, k]: out[:, 0:tn] (row stride os). */
static void multiply_tile(const float *x, int64_t m, int64_t xs, const float *tile, int64_t tn,
                          int64_t k, float *out, int64_t os) {
    int64_t r = 0;
    for (; r + 4 <= m; r += 4) {
        int64_t c = 0;
        for (; c + 2 <= tn; c += 2) dot_4x2(x + r * xs, xs, tile + c * k, k, out + r * os + c, os);
        for (; c < tn; ++c) dot_4x1(x + r * xs, xs, tile + c * k, k, out + r * os + c, os);
    }
    for (; r < m; ++r) {
        int64_t c = 0;
        for (; c + 4 <= tn; c += 4) dot_1x4(x + r * xs, xs, tile + c * k, k, out + r * os + c, os);
        for (; c < tn; ++c) dot_1x1(x + r * xs, xs, tile + c * k, k, out + r * os + c, os);
    }
}
#endif

/* ---------------------------------------------------------------- activations
 * x enters every product rounded, per group of 32 values, to int16 steps of
 * d = max|x| / 32767: q = x / d to the nearest integer, ties to even (as
 * llama.cpp rounds its activations to int8, but 256 times finer: a value
 * moves by at most 1/65534 of its group's largest). The decode path
 * multiplies these integers with the weight's own; the tile path the rounded
 * values q * d as float32. Both compute one product, up to the order of
 * float32 sums, whatever the number of rows. */

/* One group of x: its 32 integers q, its step d (returned) and d * sum(q). */
static float round_group(const float *x, int16_t *q, float *scaled_sum) {
    float amax = 0.0f;
    for (int i = 0; i < GROUP; ++i) {
        const float v = fabsf(x[i]);
        amax = v > amax ? v : amax;
    }
    const float d = amax / 32767.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int i = 0; i < GROUP; ++i) {
        const int value = (int)rintf(x[i] * id);
        q[i] = (int16_t)value;
        sum += value;
    }
    *scaled_sum = d * (float)sum;
    return d;
}

/* The rounded values q * d of x [m, k] (row stride xs) into out [m, k]. */
static void rounded_rows(const float *x, int64_t m, int64_t xs, int64_t k, float *out) {
    #pragma omp parallel for schedule(static) if (m * k >= PARALLEL_MIN_MACS)
    for (int64_t r = 0; r < m; ++r)
        for (int64_t g = 0; g < k / GROUP; ++g) {
            int16_t q[GROUP];
            float scaled_sum;
            const float d = round_group(x + r * xs + g * GROUP, q, &scaled_sum);
            for (int i = 0; i < GROUP; ++i) out[r * k + g * GROUP + i] = (float)q[i] * d;
        }
}

/* Exported for the tests: rounded_rows of x [m, k] (contiguous). */
int quant_round_activations(const float *x, int64_t m, int64_t k, float *out) {
    if (k % GROUP) return -1;
    rounded_rows(x, m, k, k, out);
    return 0;
}

#ifdef QUANT_AVX2
/* Few rows of x (decode): each group of a weight row stays in integers,
 * widened to 16 bits, and is multiplied with the rows' int16 groups (madd:
 * 8 x 32-bit partial sums, exact) and scaled once: w = a * u + b per value u
 * of the group, so the group adds a * d * sum(u q) + b * d * sum(q). About
 * half the instructions of decoding the group to float32. */

/* 16 bits as 16-bit lanes: lane i is 16 where bit i is set. */
static inline __m256i fifth_bit_words(uint16_t bits) {
    const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                          (short)0x8000);
    return _mm256_and_si256(_mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16((short)bits), bit), bit),
                            _mm256_set1_epi16(16));
}

/* Group g of a weight row as 16-bit integers u (values 0..15 in lo, 16..31 in hi);
 * the group's weights are a * u + b (``group_scales``, ``super_block_scales``). */
static inline void weight_values(int type, const uint8_t *row, int64_t g, __m256i *lo, __m256i *hi) {
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
static inline void k_pair_values(int type, const uint8_t *block, int j, __m256i values[4]) {
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

/* a and b of group g of a Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 or IQ4_NL row (b[0] = b[1]: see
 * ``direct_group``). */
static inline void group_scales(int type, const uint8_t *row, int64_t g, float *a, float b[2]) {
    const uint8_t *block = row + g * row_bytes(type, GROUP);
    *a = f16_at(block);
    switch (type) {
    case TYPE_Q8_0:
    case TYPE_IQ4_NL: b[0] = 0.0f; break;
    case TYPE_Q4_0: b[0] = -8.0f * *a; break;
    case TYPE_Q5_0: b[0] = -16.0f * *a; break;
    default: b[0] = f16_at(block + 2); break; /* Q4_1, Q5_1 */
    }
    b[1] = b[0];
}

/* a and b of the eight groups of a Q2_K, Q3_K, Q4_K, Q5_K, Q6_K or IQ4_XS super-block,
 * unpacked once for all of them: group j's a[j], its halves' b[2 j], b[2 j + 1]. */
static inline void super_block_scales(int type, const uint8_t *block, float a[8], float b[16]) {
    for (int j = 0; j < 16; ++j) b[j] = 0.0f;
    if (type == TYPE_IQ4_XS) {
        for (int j = 0; j < 8; ++j) a[j] = iq4_xs_scale(block, j);
        return;
    }
    if (type == TYPE_Q2_K) { /* the scales are in the integers, the mins in b */
        const float d = f16_at(block + 80), dmin = f16_at(block + 82);
        for (int j = 0; j < 8; ++j) a[j] = d;
        for (int j = 0; j < 16; ++j) b[j] = -dmin * (float)(block[j] >> 4);
        return;
    }
    if (HALF_SCALED_TYPE(type)) { /* the per-16 scales are in the integers (weight_values) */
        const float d = f16_at(block + (type == TYPE_Q6_K ? 208 : 108));
        for (int j = 0; j < 8; ++j) a[j] = d;
        return;
    }
    const float d = f16_at(block), dmin = f16_at(block + 2);
    for (int j = 0; j < 8; ++j) {
        int scale, min;
        q4_k_scale_min(block + 4, j, &scale, &min);
        a[j] = d * (float)scale, b[2 * j] = b[2 * j + 1] = -dmin * (float)min;
    }
}

/* Rows of x rounded for the integer products: group i (row-major over rows) is
 * q[32 i .. 32 i + 31] (32-byte aligned), step d[i], scaled_sum[i] = d * sum(q), and
 * half_sums[2 i], [2 i + 1] = d * sum(q) over values 0..15 and 16..31. */
typedef struct {
    int16_t *q;
    float *d, *scaled_sum, *half_sums;
} RoundedGroups;

/* x [m, k] (row stride xs) rounded into one allocation (free ``q``), or q NULL. */
static RoundedGroups round_rows(const float *x, int64_t m, int64_t xs, int64_t k) {
    const int64_t groups = k / GROUP, count = m * groups;
    RoundedGroups rounded = {NULL, NULL, NULL, NULL};
    if (posix_memalign((void **)&rounded.q, 32, (size_t)count * (GROUP * sizeof(int16_t) + 4 * sizeof(float)))) {
        rounded.q = NULL;
        return rounded;
    }
    rounded.d = (float *)(rounded.q + count * GROUP);
    rounded.scaled_sum = rounded.d + count;
    rounded.half_sums = rounded.scaled_sum + count;
    for (int64_t r = 0; r < m; ++r)
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t i = r * groups + g;
            const int16_t *q = rounded.q + i * GROUP;
            rounded.d[i] = round_group(x + r * xs + g * GROUP, rounded.q + i * GROUP, rounded.scaled_sum + i);
            int32_t first = 0, second = 0;
            for (int l = 0; l < GROUP / 2; ++l) first += q[l], second += q[l + GROUP / 2];
            rounded.half_sums[2 * i] = rounded.d[i] * (float)first;
            rounded.half_sums[2 * i + 1] = rounded.d[i] * (float)second;
        }
    return rounded;
}

/* Group g's share for R rows, its weights a * (lo | hi) + b: acc[r] += a * d * sums,
 * offset[r] += b * d * sum(q). Q2_K's halves have a b each (b[0] for values 0..15,
 * b[1] for 16..31); the other types' are equal and their sum is taken whole. */
static inline __attribute__((always_inline)) void direct_group(int type, int R, int64_t g, int64_t groups,
                                                              const RoundedGroups *x, __m256i lo, __m256i hi,
                                                              float a, const float b[2], __m256 *acc,
                                                              __m256 *offset) {
    const __m256 av = _mm256_set1_ps(a), bv = _mm256_set1_ps(b[0]), b_high = _mm256_set1_ps(b[1]);
    for (int r = 0; r < R; ++r) {
        const int64_t i = r * groups + g;
        const __m256i *q = (const __m256i *)(x->q + i * GROUP);
        const __m256i sums = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_load_si256(q)),
                                              _mm256_madd_epi16(hi, _mm256_load_si256(q + 1)));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(av, _mm256_set1_ps(x->d[i])), acc[r]);
        if (type == TYPE_Q2_K) {
            offset[r] = _mm256_fmadd_ps(bv, _mm256_set1_ps(x->half_sums[2 * i]), offset[r]);
            offset[r] = _mm256_fmadd_ps(b_high, _mm256_set1_ps(x->half_sums[2 * i + 1]), offset[r]);
        } else if (OFFSET_TYPE(type)) {
            offset[r] = _mm256_fmadd_ps(bv, _mm256_set1_ps(x->scaled_sum[i]), offset[r]);
        }
    }
}

/* out[r * os] for one weight row and R rows of x (``groups`` groups each): even
 * and odd groups in separate accumulators, to hide the FMA latency. Inlined into
 * direct_row with constant type and R. */
static inline __attribute__((always_inline)) void direct_rows(int type, int R, const uint8_t *row, int64_t groups,
                                                             const RoundedGroups *x, float *out, int64_t os) {
    __m256 even[DIRECT_MAX_ROWS], odd[DIRECT_MAX_ROWS], even_offset[DIRECT_MAX_ROWS], odd_offset[DIRECT_MAX_ROWS];
    for (int r = 0; r < R; ++r)
        even[r] = odd[r] = even_offset[r] = odd_offset[r] = _mm256_setzero_ps();
    int64_t g = 0;
    __m256i v[4];
    if (SUPER_BLOCK_TYPE(type)) { /* groups come in eights, their scales unpacked together */
        const int64_t block_bytes = row_bytes(type, 256);
        for (; g < groups; g += 8) {
            const uint8_t *block = row + (g / 8) * block_bytes;
            float a[8], b[16];
            super_block_scales(type, block, a, b);
            for (int j = 0; j < 8; j += 2) {
                if (type == TYPE_Q4_K || type == TYPE_Q5_K) {
                    k_pair_values(type, block, j, v);
                } else {
                    weight_values(type, row, g + j, &v[0], &v[1]);
                    weight_values(type, row, g + j + 1, &v[2], &v[3]);
                }
                direct_group(type, R, g + j, groups, x, v[0], v[1], a[j], b + 2 * j, even, even_offset);
                direct_group(type, R, g + j + 1, groups, x, v[2], v[3], a[j + 1], b + 2 * j + 2, odd, odd_offset);
            }
        }
    } else {
        float a, b[2];
        for (; g + 2 <= groups; g += 2) {
            group_scales(type, row, g, &a, b);
            weight_values(type, row, g, &v[0], &v[1]);
            direct_group(type, R, g, groups, x, v[0], v[1], a, b, even, even_offset);
            group_scales(type, row, g + 1, &a, b);
            weight_values(type, row, g + 1, &v[2], &v[3]);
            direct_group(type, R, g + 1, groups, x, v[2], v[3], a, b, odd, odd_offset);
        }
        if (g < groups) {
            group_scales(type, row, g, &a, b);
            weight_values(type, row, g, &v[0], &v[1]);
            direct_group(type, R, g, groups, x, v[0], v[1], a, b, even, even_offset);
        }
    }
    for (int r = 0; r < R; ++r) {
        /* every lane of an offset holds the same sum: one lane of it */
        const float offset = _mm256_cvtss_f32(_mm256_add_ps(even_offset[r], odd_offset[r]));
        out[r * os] = hsum(_mm256_add_ps(even[r], odd[r])) + offset;
    }
}

#define DIRECT_BY_ROWS(TYPE)                                                                      \
    switch (m) {                                                                                  \
    case 1: direct_rows(TYPE, 1, row, groups, x, out, os); break;                                 \
    case 2: direct_rows(TYPE, 2, row, groups, x, out, os); break;                                 \
    case 3: direct_rows(TYPE, 3, row, groups, x, out, os); break;                                 \
    default: direct_rows(TYPE, 4, row, groups, x, out, os); break;                                \
    }

/* out[0:m, n] for one weight row, m <= DIRECT_MAX_ROWS. */
static void direct_row(int type, const uint8_t *row, int64_t groups, const RoundedGroups *x, int64_t m,
                       float *out, int64_t os) {
    switch (type) {
    case TYPE_Q8_0: DIRECT_BY_ROWS(TYPE_Q8_0); break;
    case TYPE_Q4_0: DIRECT_BY_ROWS(TYPE_Q4_0); break;
    case TYPE_Q4_1: DIRECT_BY_ROWS(TYPE_Q4_1); break;
    case TYPE_Q5_0: DIRECT_BY_ROWS(TYPE_Q5_0); break;
    case TYPE_Q5_1: DIRECT_BY_ROWS(TYPE_Q5_1); break;
    case TYPE_Q5_K: DIRECT_BY_ROWS(TYPE_Q5_K); break;
    case TYPE_IQ4_NL: DIRECT_BY_ROWS(TYPE_IQ4_NL); break;
    case TYPE_IQ4_XS: DIRECT_BY_ROWS(TYPE_IQ4_XS); break;
    case TYPE_Q2_K: DIRECT_BY_ROWS(TYPE_Q2_K); break;
    case TYPE_Q3_K: DIRECT_BY_ROWS(TYPE_Q3_K); break;
    case TYPE_Q6_K: DIRECT_BY_ROWS(TYPE_Q6_K); break;
    default: DIRECT_BY_ROWS(TYPE_Q4_K); break;
    }
}
#endif

/* ---------------------------------------------------------------- entry points */

/* Each thread's tile buffer, grown as needed and kept (32-byte aligned). */
static float *thread_tile(int64_t floats) {
    static __thread float *buffer = NULL;
    static __thread int64_t capacity = 0;
    if (floats > capacity) {
        free(buffer);
        buffer = NULL;
        capacity = 0;
        if (posix_memalign((void **)&buffer, 64, (size_t)floats * sizeof(float))) return NULL;
        capacity = floats;
    }
    return buffer;
}

/* As many weight rows as fit TILE_BYTES (each decoded row then serves all m rows
 * of x), at most 32, a multiple of TILE_MULTIPLE and at least one multiple. */
static int64_t tile_rows(int64_t k) {
    int64_t rows = TILE_BYTES / (k * (int64_t)sizeof(float));
    rows = rows > 32 ? 32 : rows;
    rows -= rows % TILE_MULTIPLE;
    return rows < TILE_MULTIPLE ? TILE_MULTIPLE : rows;
}

/* x's rows rounded as round_group says, then multiplied: integers for few rows,
 * float32 tiles for more (see "activations"). */
static int products_of_groups(int type, const uint8_t *weight, int64_t stride, int64_t n, int64_t k,
                              const float *x, int64_t m, int64_t x_stride, float *out, int64_t out_stride) {
#if DIRECT_MAX_ROWS
    const RoundedGroups rounded = round_rows(x, m, x_stride, k);
    if (rounded.q == NULL) return -2;
    #pragma omp parallel for schedule(static) if (m * n * k >= PARALLEL_MIN_MACS)
    for (int64_t c = 0; c < n; ++c) direct_row(type, weight + c * stride, k / GROUP, &rounded, m, out + c, out_stride);
    free(rounded.q);
    return 0;
#else
    (void)type, (void)weight, (void)stride, (void)n, (void)k, (void)x, (void)m, (void)x_stride, (void)out,
        (void)out_stride;
    return -1;
#endif
}

static int products_of_tiles(int type, const uint8_t *weight, int64_t stride, int64_t n, int64_t k,
                             const float *x, int64_t m, int64_t x_stride, float *out, int64_t out_stride) {
    float *rounded = malloc((size_t)(m * k) * sizeof(float));
    if (rounded == NULL) return -2;
    rounded_rows(x, m, x_stride, k, rounded);
    const int64_t tn = tile_rows(k), num_tiles = (n + tn - 1) / tn;
    int failed = 0;
    #pragma omp parallel for schedule(static) if (m * n * k >= PARALLEL_MIN_MACS)
    for (int64_t t = 0; t < num_tiles; ++t) {
        float *tile = thread_tile(tn * k);
        if (tile == NULL) {
            failed = 1;
            continue;
        }
        const int64_t first = t * tn, rows = n - first < tn ? n - first : tn;
        decode_tile(type, weight + first * stride, stride, rows, k, tile);
        multiply_tile(rounded, m, k, tile, rows, k, out + first, out_stride);
    }
    free(rounded);
    return failed ? -2 : 0;
}

/* out [m, n] (row stride out_stride) = x [m, k] (row stride x_stride) @ W^T, W being
 * n rows of k values in ``type`` blocks at ``weight``, x rounded per group of 32
 * (see "activations"). Returns 0, -1 for a type or k it cannot take, -2 when a
 * buffer cannot be allocated. */
int quant_matmul(int type, const uint8_t *weight, int64_t n, int64_t k, const float *x, int64_t m,
                 int64_t x_stride, float *out, int64_t out_stride) {
    const int64_t stride = row_bytes(type, k);
    if (stride < 0 || k % (SUPER_BLOCK_TYPE(type) ? 256 : GROUP)) return -1;
    if (m == 0 || n == 0) return 0;
    if (m <= DIRECT_MAX_ROWS) return products_of_groups(type, weight, stride, n, k, x, m, x_stride, out, out_stride);
    return products_of_tiles(type, weight, stride, n, k, x, m, x_stride, out, out_stride);
}

/* Rows ids[0..count) of W decoded to out [count, k] (an embedding lookup). */
int quant_dequantize_rows(int type, const uint8_t *weight, int64_t k, const int64_t *ids, int64_t count,
                          float *out) {
    const int64_t stride = row_bytes(type, k);
    if (stride < 0 || k % (SUPER_BLOCK_TYPE(type) ? 256 : GROUP)) return -1;
    #pragma omp parallel for schedule(static) if (count * k >= PARALLEL_MIN_MACS)
    for (int64_t i = 0; i < count; ++i) decode_row(type, weight + ids[i] * stride, k, out + i * k);
    return 0;
}
