/* Few rows of x (decode) against GGUF blocks with AVX-512, for quant_matmul.c.
 *
 * The same products as the AVX2 integer path ("few rows of x" in
 * quant_matmul.c): each group of 32 weights as 16-bit integers u, times x's
 * int16 integers q, the exact 32-bit sums scaled once per group. Here one
 * group is one 512-bit register (32 x 16 bits), multiplied in one VNNI
 * instruction (vpdpwssd: 32 products summed in pairs into 16 lanes and added)
 * where the CPU has AVX512_VNNI, or madd + add where it has only AVX512BW:
 * half the instructions per group of the AVX2 path, so a decode step reads
 * the weights at the memory's speed instead of the core's.
 *
 * Q4_K and Q6_K, the types of Q4_K_M files, are decoded 64 values at a time
 * with their scales unpacked once per super-block in vector registers; every
 * other type takes its 16-bit integers from ggml_blocks.h's AVX2 forms, two
 * halves joined into one register.
 *
 * The includer defines QUANT_AVX512 (AVX512F and AVX512BW in -march) and
 * includes ggml_blocks.h and the RoundedGroups of x first. */

#ifndef CADENCE_QUANT_DIRECT_AVX512_H
#define CADENCE_QUANT_DIRECT_AVX512_H

/* acc + the pairwise sums of w * q (16 x 32-bit lanes). */
static inline __attribute__((always_inline)) __m512i dot_words(__m512i acc, __m512i w, __m512i q) {
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(acc, w, q);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, q));
#endif
}

static inline __attribute__((always_inline)) __m512i join_halves(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

static inline __attribute__((always_inline)) __m512i group_words(const RoundedGroups *x, int64_t i) {
    return _mm512_loadu_si512((const void *)(x->q + i * GROUP));
}

/* acc += (w . q_i) * scale: group i of x against one group of weights w. */
static inline __attribute__((always_inline)) __m512 scaled_group(__m512 acc, __m512i w, const RoundedGroups *x, int64_t i, float scale) {
    const __m512i sums = dot_words(_mm512_setzero_si512(), w, group_words(x, i));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(scale), acc);
}

/* ---------------------------------------------------------------- Q4_K */

/* out[r * os] for one Q4_K row and R rows of x: per super-block the scales once,
 * each row's group scales a_j * d (8 at once) and its mins' share b . (d sum q);
 * then 32 bytes of nibbles per pair of groups, widened once for all rows. */
static inline __attribute__((always_inline)) void q4_k_rows_512(int R, const uint8_t *row, int64_t groups,
                                                               const RoundedGroups *x, float *out, int64_t os) {
    __m512 even[DIRECT_MAX_ROWS], odd[DIRECT_MAX_ROWS];
    __m256 offset[DIRECT_MAX_ROWS];
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps(), offset[r] = _mm256_setzero_ps();
    const __m512i low_nibble = _mm512_set1_epi16(15);
    for (int64_t g = 0; g < groups; g += 8) {
        const uint8_t *block = row + (g / 8) * 144;
        __m256 a, b;
        q4_k_scale_vectors(block, &a, &b);
        float scale[DIRECT_MAX_ROWS][8] __attribute__((aligned(32)));
        for (int r = 0; r < R; ++r) {
            const int64_t i = r * groups + g;
            _mm256_store_ps(scale[r], _mm256_mul_ps(a, _mm256_loadu_ps(x->d + i)));
            offset[r] = _mm256_fmadd_ps(b, _mm256_loadu_ps(x->scaled_sum + i), offset[r]);
        }
        for (int j = 0; j < 8; j += 2) {
            const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(block + 16 + 16 * j)));
            const __m512i first = _mm512_and_si512(bytes, low_nibble), second = _mm512_srli_epi16(bytes, 4);
            for (int r = 0; r < R; ++r) {
                const int64_t i = r * groups + g + j;
                even[r] = scaled_group(even[r], first, x, i, scale[r][j]);
                odd[r] = scaled_group(odd[r], second, x, i + 1, scale[r][j + 1]);
            }
        }
    }
    for (int r = 0; r < R; ++r) out[r * os] = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r])) + hsum(offset[r]);
}

/* ---------------------------------------------------------------- Q6_K
 * A half super-block (128 values, groups 4n .. 4n + 3, see q6_k_group): 64 bytes
 * of low nibbles, 32 of high bit pairs, widened once; each group's values q - 32
 * times its two per-16 scales, in 16-bit integers (|scale (q - 32)| <= 4096). */
static inline __attribute__((always_inline)) void q6_k_half_512(const uint8_t *block, int n, __m512i w[4]) {
    const uint8_t *ql = block + 64 * n, *qh = block + 128 + 32 * n;
    const __m512i first = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)ql));
    const __m512i second = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(ql + 32)));
    const __m512i high = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)qh));
    const __m512i nibble = _mm512_set1_epi16(15), pair = _mm512_set1_epi16(3), bias = _mm512_set1_epi16(32);
    const __m512i value[4] = {
        _mm512_or_si512(_mm512_and_si512(first, nibble), _mm512_slli_epi16(_mm512_and_si512(high, pair), 4)),
        _mm512_or_si512(_mm512_and_si512(second, nibble),
                        _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(high, 2), pair), 4)),
        _mm512_or_si512(_mm512_srli_epi16(first, 4),
                        _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(high, 4), pair), 4)),
        _mm512_or_si512(_mm512_srli_epi16(second, 4), _mm512_slli_epi16(_mm512_srli_epi16(high, 6), 4)),
    };
    /* group c's scales 2c (values 0..15) and 2c + 1 (16..31), each spread over its 16 lanes */
    const __m512i scales = _mm512_castsi128_si512(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(block + 192 + 8 * n))));
    for (int c = 0; c < 4; ++c) {
        const __m512i spread = join_halves(_mm256_set1_epi16((short)(2 * c)), _mm256_set1_epi16((short)(2 * c + 1)));
        w[c] = _mm512_mullo_epi16(_mm512_sub_epi16(value[c], bias), _mm512_permutexvar_epi16(spread, scales));
    }
}

static inline __attribute__((always_inline)) void q6_k_rows_512(int R, const uint8_t *row, int64_t groups,
                                                               const RoundedGroups *x, float *out, int64_t os) {
    __m512 even[DIRECT_MAX_ROWS], odd[DIRECT_MAX_ROWS];
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g += 8) {
        const uint8_t *block = row + (g / 8) * 210;
        const __m256 d = _mm256_set1_ps(f16_at(block + 208));
        float scale[DIRECT_MAX_ROWS][8] __attribute__((aligned(32)));
        for (int r = 0; r < R; ++r) _mm256_store_ps(scale[r], _mm256_mul_ps(d, _mm256_loadu_ps(x->d + r * groups + g)));
        for (int n = 0; n < 2; ++n) {
            __m512i w[4];
            q6_k_half_512(block, n, w);
            for (int r = 0; r < R; ++r) {
                const int64_t i = r * groups + g + 4 * n;
                even[r] = scaled_group(even[r], w[0], x, i, scale[r][4 * n]);
                odd[r] = scaled_group(odd[r], w[1], x, i + 1, scale[r][4 * n + 1]);
                even[r] = scaled_group(even[r], w[2], x, i + 2, scale[r][4 * n + 2]);
                odd[r] = scaled_group(odd[r], w[3], x, i + 3, scale[r][4 * n + 3]);
            }
        }
    }
    for (int r = 0; r < R; ++r) out[r * os] = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r]));
}

/* Groups j and j + 1 (j even) of the super-block at ``block`` (groups g .. g + 7 of
 * ``row``) as 16-bit integers, one register each, from the AVX2 integer forms. */
static inline __attribute__((always_inline)) void super_block_pair_words(int type, const uint8_t *row,
                                                                        const uint8_t *block, int64_t g, int j,
                                                                        __m512i *first, __m512i *second) {
    __m256i v[4];
    if (type == TYPE_Q5_K) {
        k_pair_values(type, block, j, v);
    } else {
        weight_values(type, row, g + j, &v[0], &v[1]);
        weight_values(type, row, g + j + 1, &v[2], &v[3]);
    }
    *first = join_halves(v[0], v[1]), *second = join_halves(v[2], v[3]);
}

/* offset += group i's b times x's scaled sums: Q2_K's two halves apart (b, b_high),
 * the other offset types' whole (every lane the same sum). */
static inline __attribute__((always_inline)) void add_group_offset(int type, const RoundedGroups *x, int64_t i,
                                                                  __m256 b, __m256 b_high, __m256 *offset) {
    if (type == TYPE_Q2_K) {
        *offset = _mm256_fmadd_ps(b, _mm256_set1_ps(x->half_sums[2 * i]), *offset);
        *offset = _mm256_fmadd_ps(b_high, _mm256_set1_ps(x->half_sums[2 * i + 1]), *offset);
    } else if (OFFSET_TYPE(type)) {
        *offset = _mm256_fmadd_ps(b, _mm256_set1_ps(x->scaled_sum[i]), *offset);
    }
}

/* ---------------------------------------------------------------- other types
 * The AVX2 integer forms (weight_values, k_pair_values, group_scales,
 * super_block_scales), each group's halves joined into one register. */
static inline __attribute__((always_inline)) void words_group_512(int type, int R, int64_t g, int64_t groups,
                                                                 const RoundedGroups *x, __m512i w, float a,
                                                                 const float b[2], __m512 *acc, __m256 *offset) {
    const __m256 bv = _mm256_set1_ps(b[0]), b_high = _mm256_set1_ps(b[1]);
    for (int r = 0; r < R; ++r) {
        const int64_t i = r * groups + g;
        acc[r] = scaled_group(acc[r], w, x, i, a * x->d[i]);
        add_group_offset(type, x, i, bv, b_high, &offset[r]);
    }
}

static inline __attribute__((always_inline)) void words_rows_512(int type, int R, const uint8_t *row, int64_t groups,
                                                                const RoundedGroups *x, float *out, int64_t os) {
    __m512 even[DIRECT_MAX_ROWS], odd[DIRECT_MAX_ROWS];
    __m256 offset[DIRECT_MAX_ROWS];
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps(), offset[r] = _mm256_setzero_ps();
    __m256i v[4];
    int64_t g = 0;
    if (SUPER_BLOCK_TYPE(type)) {
        const int64_t block_bytes = row_bytes(type, 256);
        for (; g < groups; g += 8) {
            const uint8_t *block = row + (g / 8) * block_bytes;
            float a[8], b[16];
            super_block_scales(type, block, a, b);
            for (int j = 0; j < 8; j += 2) {
                __m512i first, second;
                super_block_pair_words(type, row, block, g, j, &first, &second);
                words_group_512(type, R, g + j, groups, x, first, a[j], b + 2 * j, even, offset);
                words_group_512(type, R, g + j + 1, groups, x, second, a[j + 1], b + 2 * j + 2, odd, offset);
            }
        }
    } else {
        float a, b[2];
        for (; g < groups; ++g) {
            group_scales(type, row, g, &a, b);
            weight_values(type, row, g, &v[0], &v[1]);
            words_group_512(type, R, g, groups, x, join_halves(v[0], v[1]), a, b, (g & 1) ? odd : even, offset);
        }
    }
    for (int r = 0; r < R; ++r) {
        /* every lane of an offset holds the same sum: one lane of it */
        out[r * os] = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r])) + _mm256_cvtss_f32(offset[r]);
    }
}

/* out[r * os] for one weight row and R rows of x, R <= DIRECT_MAX_ROWS. */
static inline __attribute__((always_inline)) void direct_rows_512(int type, int R, const uint8_t *row, int64_t groups,
                                                                 const RoundedGroups *x, float *out, int64_t os) {
    if (type == TYPE_Q4_K) q4_k_rows_512(R, row, groups, x, out, os);
    else if (type == TYPE_Q6_K) q6_k_rows_512(R, row, groups, x, out, os);
    else words_rows_512(type, R, row, groups, x, out, os);
}

#endif /* CADENCE_QUANT_DIRECT_AVX512_H */
