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
 * Every type but Q4_K and Q6_K takes its 16-bit integers from ggml_blocks.h's
 * AVX2 forms, two halves joined into one register. Q4_K and Q6_K, the types of
 * Q4_K_M files, meet x in bytes ("in bytes" below): 64 products per maddubs,
 * a super-block's sums kept in integers.
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

/* How far ahead of a weight row's block the decode rows ask for the weights
 * (prefetcht0, one line per 64 bytes of the block): without it one decode thread
 * kept too few lines in flight, and on an Ice Lake Xeon a row of Q4_K read 12
 * GB/s on two threads, with it 20 (BENCHMARKS.md, avx512-byte-products-v1).
 * Rows of a thread's range lie one after another, so the lines ahead are its
 * next rows'. */
#ifndef DECODE_PREFETCH_AHEAD
#define DECODE_PREFETCH_AHEAD 4096
#endif

static inline __attribute__((always_inline)) void prefetch_block_ahead(const uint8_t *block, int bytes) {
    for (int offset = 0; offset < bytes; offset += 64)
        _mm_prefetch((const char *)block + DECODE_PREFETCH_AHEAD + offset, _MM_HINT_T0);
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

/* out[r * os] for one weight row and R rows of x, R <= DIRECT_MAX_ROWS (every type but
 * the byte types, Q4_K and Q6_K: "in bytes" below). */
static inline __attribute__((always_inline)) void direct_rows_512(int type, int R, const uint8_t *row, int64_t groups,
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
            prefetch_block_ahead(block, (int)block_bytes);
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
        /* even and odd groups by name, not by (g & 1) ? odd : even: a pointer picked
         * at run time kept the accumulators on the stack, each group waiting for the
         * last one's store (Q4_1 and Q5_0 rows 1.6x slower) */
        float a, b[2];
        for (; g < groups; g += 2) {
            _mm_prefetch((const char *)row + g * row_bytes(type, GROUP) + DECODE_PREFETCH_AHEAD, _MM_HINT_T0);
            group_scales(type, row, g, &a, b);
            weight_values(type, row, g, &v[0], &v[1]);
            words_group_512(type, R, g, groups, x, join_halves(v[0], v[1]), a, b, even, offset);
            if (g + 1 == groups) break;
            group_scales(type, row, g + 1, &a, b);
            weight_values(type, row, g + 1, &v[2], &v[3]);
            words_group_512(type, R, g + 1, groups, x, join_halves(v[2], v[3]), a, b, odd, offset);
        }
    }
    for (int r = 0; r < R; ++r) {
        /* every lane of an offset holds the same sum: one lane of it */
        out[r * os] = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r])) + _mm256_cvtss_f32(offset[r]);
    }
}

/* ---------------------------------------------------------------- in bytes
 * Q4_K and Q6_K against x in bytes (int8 steps, one d_x per super-block: see
 * "activations" in quant_matmul.c), the weights' unsigned integers u (Q4_K's
 * nibbles 0..15, Q6_K's 6-bit values 0..63) as maddubs' unsigned operand: 64
 * products in pairs into 16-bit lanes (|pair| <= 2 x 63 x 127, exact), then
 * times each run's integer scale into 32-bit lanes (vpdpwssd, or madd + add),
 * a super-block summed in integers (|sum| < 2^28) before one conversion:
 *
 *     Q4_K  d_x (d sum_j s_j (u . q)_j  -  dmin sum_j m_j (sum q)_j)
 *     Q6_K  d_x d (sum_h s_h (u . q)_h  -  32 sum_h s_h (sum q)_h)
 *
 * j the eight groups, h the sixteen runs of 16 values. A 64-byte load of Q4_K's
 * nibbles holds groups 0 and 2 in its low nibbles, 1 and 3 in its high ones, so
 * x's bytes of a Q4_K super-block lie in the order 0 2 1 3 4 6 5 7
 * (byte_group_slot in quant_matmul.c); Q6_K's half super-blocks are in order. */

/* A vpermw index: word ``low`` in the 16 low lanes, word ``high`` in the 16 high ones. */
static inline __m512i words_picked(int low, int high) {
    return join_halves(_mm256_set1_epi16((short)low), _mm256_set1_epi16((short)high));
}

/* A vpermw index: words first .. first + 3, each in 8 lanes. */
static inline __m512i four_words_picked(int first) {
    return join_halves(_mm256_setr_m128i(_mm_set1_epi16((short)first), _mm_set1_epi16((short)(first + 1))),
                       _mm256_setr_m128i(_mm_set1_epi16((short)(first + 2)), _mm_set1_epi16((short)(first + 3))));
}

/* acc + (u . q in pairs) times the pairs' 16-bit scales. */
static inline __attribute__((always_inline)) __m512i scaled_bytes(__m512i acc, __m512i u, const int8_t *q,
                                                                 __m512i scales) {
    return dot_words(acc, _mm512_maddubs_epi16(u, _mm512_loadu_si512((const void *)q)), scales);
}

/* A Q4_K super-block's nibbles as four vectors in x's slot order (groups 0 2, 1 3,
 * 4 6, 5 7). */
static inline __attribute__((always_inline)) void q4_k_byte_nibbles_512(const uint8_t *block, __m512i u[4]) {
    const __m512i low_nibble = _mm512_set1_epi8(15);
    const __m512i first = _mm512_loadu_si512((const void *)(block + 16)), second = _mm512_loadu_si512((const void *)(block + 80));
    u[0] = _mm512_and_si512(first, low_nibble), u[1] = _mm512_and_si512(_mm512_srli_epi16(first, 4), low_nibble);
    u[2] = _mm512_and_si512(second, low_nibble), u[3] = _mm512_and_si512(_mm512_srli_epi16(second, 4), low_nibble);
}

static inline __attribute__((always_inline)) void q4_k_byte_rows_512(int R, const uint8_t *row, int64_t groups,
                                                                    const RoundedGroups *x, float *out, int64_t os) {
    __m512 acc[DIRECT_MAX_ROWS];
    __m256 mins_acc[DIRECT_MAX_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), mins_acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g += 8) {
        const uint8_t *block = row + (g / 8) * 144;
        prefetch_block_ahead(block, 144);
        __m512i u[4];
        q4_k_byte_nibbles_512(block, u);
        /* each vector's scales: 16-bit lanes 0..15 its first group's s, 16..31 its second's */
        const __m256i scales_and_mins = q4_k_scales_and_mins(block);
        const __m512i all = _mm512_castsi256_si512(scales_and_mins);
        const __m512i scales[4] = {_mm512_permutexvar_epi16(words_picked(0, 2), all),
                                   _mm512_permutexvar_epi16(words_picked(1, 3), all),
                                   _mm512_permutexvar_epi16(words_picked(4, 6), all),
                                   _mm512_permutexvar_epi16(words_picked(5, 7), all)};
        const __m256i mins = twice_each(_mm256_extracti128_si256(scales_and_mins, 1));
        const float d = f16_at(block), dmin = -f16_at(block + 2);
        for (int r = 0; r < R; ++r) {
            const int64_t i = r * groups + g;
            const int8_t *q = x->q8 + i * GROUP;
            __m512i sums = _mm512_setzero_si512();
            for (int t = 0; t < 4; ++t) sums = scaled_bytes(sums, u[t], q + 64 * t, scales[t]);
            const float step = x->d[i];
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(d * step), acc[r]);
            /* lane j: m_j (sum of q over group j's two halves) */
            const __m256i min_sums = _mm256_madd_epi16(mins, _mm256_loadu_si256((const __m256i *)(x->half_q + 2 * i)));
            mins_acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(min_sums), _mm256_set1_ps(dmin * step), mins_acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) out[r * os] = _mm512_reduce_add_ps(acc[r]) + hsum(mins_acc[r]);
}

/* Half n of a Q6_K super-block's 6-bit values as bytes: u[0] groups 4n and 4n + 1,
 * u[1] groups 4n + 2 and 4n + 3 (see q6_k_group); each group's high bit pair
 * moved to bits 4..5 by a shift of its 64-bit lanes. */
static inline __attribute__((always_inline)) void q6_k_byte_half_512(const uint8_t *block, int n, __m512i u[2]) {
    const __m512i low = _mm512_loadu_si512((const void *)(block + 64 * n));
    const __m512i high = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(block + 128 + 32 * n)));
    const __m512i nibble = _mm512_set1_epi8(15), pair = _mm512_set1_epi8(0x30);
    const __m512i left = join_halves(_mm256_set1_epi64x(4), _mm256_set1_epi64x(2)); /* bits 0..1, 2..3 */
    const __m512i right = join_halves(_mm256_set1_epi64x(0), _mm256_set1_epi64x(2)); /* bits 4..5, 6..7 */
    u[0] = _mm512_or_si512(_mm512_and_si512(low, nibble), _mm512_and_si512(_mm512_sllv_epi64(high, left), pair));
    u[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(low, 4), nibble),
                           _mm512_and_si512(_mm512_srlv_epi64(high, right), pair));
}

static inline __attribute__((always_inline)) void q6_k_byte_rows_512(int R, const uint8_t *row, int64_t groups,
                                                                    const RoundedGroups *x, float *out, int64_t os) {
    __m512 acc[DIRECT_MAX_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g += 8) {
        const uint8_t *block = row + (g / 8) * 210;
        prefetch_block_ahead(block, 210);
        __m512i u[4];
        q6_k_byte_half_512(block, 0, u), q6_k_byte_half_512(block, 1, u + 2);
        /* the sixteen runs' scales: vector t's lanes 8 c .. 8 c + 7 take run 4 t + c */
        const __m256i runs = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(block + 192)));
        const __m512i all = _mm512_castsi256_si512(runs);
        __m512i scales[4];
        for (int t = 0; t < 4; ++t) scales[t] = _mm512_permutexvar_epi16(four_words_picked(4 * t), all);
        const float d = f16_at(block + 208);
        for (int r = 0; r < R; ++r) {
            const int64_t i = r * groups + g;
            const int8_t *q = x->q8 + i * GROUP;
            __m512i sums = _mm512_setzero_si512();
            for (int t = 0; t < 4; ++t) sums = scaled_bytes(sums, u[t], q + 64 * t, scales[t]);
            /* the bias: 32 sum_h s_h (sum q)_h, in eight lanes */
            const __m256i bias = _mm256_madd_epi16(runs, _mm256_loadu_si256((const __m256i *)(x->half_q + 2 * i)));
            sums = _mm512_sub_epi32(sums, _mm512_zextsi256_si512(_mm256_slli_epi32(bias, 5)));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(d * x->d[i]), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) out[r * os] = _mm512_reduce_add_ps(acc[r]);
}

#endif /* CADENCE_QUANT_DIRECT_AVX512_H */
