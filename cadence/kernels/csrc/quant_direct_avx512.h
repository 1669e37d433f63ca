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
 * The 32-value types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL) are taken two
 * groups at a time, x's integers of a pair laid out to match the weights'
 * ("pairs of groups" below). The other super-block types take their 16-bit
 * integers from ggml_blocks.h's AVX2 forms, two halves joined into one
 * register. Q4_K and Q6_K, the types of Q4_K_M files, meet x in bytes ("in
 * bytes" below): 64 products per maddubs, a super-block's sums kept in
 * integers.
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

/* ---------------------------------------------------------------- pairs of groups
 * The 32-value types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL: a scale a, for some an
 * offset b, per group) two groups g, g + 1 (g even) at a time. x's integers of the
 * pair lie as [g 0..15, g+1 0..15] [g 16..31, g+1 16..31] (``pair_slots`` in
 * quant_matmul.c), matching a register of both groups' weights 0..15 (each group's
 * low nibbles, one zero-extension of the pair's 32 bytes) and one of their
 * 16..31: two vpdpwssd give 16 sums, lanes 0..7 group g's and 8..15 group g + 1's,
 * scaled by one vector. Two pairs' scales and offsets come from one multiply of
 * eight floats, [a_g, b_g, a_g+1, b_g+1, ...] x [d_g, (d sum q)_g, ...] (x's
 * step_sums). A pair left over is taken alone, and a last group without a
 * partner lies in order and is taken alone too. The shuffle port sets the
 * pace here (each pair's widening, its scales' gathering and conversion, the
 * scale vectors' permutes): per group about a third of the one-group-at-a-time
 * path's shuffles. */

/* The pair's weights as 16-bit integers u: low = both groups' values 0..15, high 16..31. */
static inline __attribute__((always_inline)) void pair_words(int type, const uint8_t *first, const uint8_t *second,
                                                            __m512i *low, __m512i *high) {
    const __m512i low_nibble = _mm512_set1_epi16(15);
    switch (type) {
    case TYPE_Q8_0:
        *low = _mm512_cvtepi8_epi16(_mm256_loadu2_m128i((const __m128i *)(second + 2), (const __m128i *)(first + 2)));
        *high = _mm512_cvtepi8_epi16(_mm256_loadu2_m128i((const __m128i *)(second + 18), (const __m128i *)(first + 18)));
        return;
    case TYPE_Q4_0:
    case TYPE_Q4_1: { /* byte i holds values i (low nibble) and i + 16 (high) */
        const int at = type == TYPE_Q4_0 ? 2 : 4;
        const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu2_m128i((const __m128i *)(second + at),
                                                                       (const __m128i *)(first + at)));
        *low = _mm512_and_si512(words, low_nibble), *high = _mm512_srli_epi16(words, 4);
        return;
    }
    case TYPE_Q5_0:
    case TYPE_Q5_1: { /* as Q4_0, plus 16 where value i's fifth bit (bit i of qh) is set */
        const int at = type == TYPE_Q5_0 ? 2 : 4;
        const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu2_m128i((const __m128i *)(second + at + 4),
                                                                       (const __m128i *)(first + at + 4)));
        const uint32_t bits_first = fifth_bits_word(first + at), bits_second = fifth_bits_word(second + at);
        const __mmask32 low_bits = (bits_first & 0xffffu) | bits_second << 16;
        const __mmask32 high_bits = bits_first >> 16 | (bits_second & 0xffff0000u);
        const __m512i sixteen = _mm512_set1_epi16(16), nibbles = _mm512_and_si512(words, low_nibble);
        *low = _mm512_mask_add_epi16(nibbles, low_bits, nibbles, sixteen);
        *high = _mm512_mask_add_epi16(_mm512_srli_epi16(words, 4), high_bits, _mm512_srli_epi16(words, 4), sixteen);
        return;
    }
    default: { /* TYPE_IQ4_NL: the nibbles' levels, looked up as bytes, widened with their sign */
        const __m256i levels = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_LEVELS));
        const __m256i mask = _mm256_set1_epi8(15);
        const __m256i packed = _mm256_loadu2_m128i((const __m128i *)(second + 2), (const __m128i *)(first + 2));
        *low = _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(levels, _mm256_and_si256(packed, mask)));
        *high = _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(levels, _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask)));
        return;
    }
    }
}

/* [a_g, b_g, a_g+1, b_g+1] of the pair (the groups' weights are a u + b). */
static inline __attribute__((always_inline)) __m128 pair_scales(int type, const uint8_t *first, const uint8_t *second) {
    uint16_t d[2];
    memcpy(&d[0], first, 2), memcpy(&d[1], second, 2);
    if (with_m(type)) { /* half d then half m */
        uint32_t dm[2];
        memcpy(&dm[0], first, 4), memcpy(&dm[1], second, 4);
        return _mm_cvtph_ps(_mm_setr_epi32((int)dm[0], (int)dm[1], 0, 0));
    }
    const float factor = offset_factor(type); /* each d twice, then times [1, factor] */
    const __m128 twice = _mm_cvtph_ps(_mm_setr_epi32((int)(d[0] * 0x10001u), (int)(d[1] * 0x10001u), 0, 0));
    return _mm_mul_ps(twice, _mm_setr_ps(1.0f, factor, 1.0f, factor));
}

#ifdef __AVX512VBMI__
/* With VBMI a pair of 18..24-byte blocks is one 64-byte load, and its words are
 * picked from it by one vpermb; two pairs' eight scale halves by one vpermt2b.
 * Q8_0's pair of 34-byte blocks does not fit one load. */
#define PICK_BYTE_WORDS(at) (at), 0, (at) + 1, 0, (at) + 2, 0, (at) + 3, 0, (at) + 4, 0, (at) + 5, 0, (at) + 6, 0,   \
                            (at) + 7, 0, (at) + 8, 0, (at) + 9, 0, (at) + 10, 0, (at) + 11, 0, (at) + 12, 0,       \
                            (at) + 13, 0, (at) + 14, 0, (at) + 15, 0
/* vpermb indexes: byte 2 w of the result is the pair's byte of qs[w] (the first block's
 * 16 bytes of nibbles at ``at``, then the second's), byte 2 w + 1 zeroed by the mask */
#define PICK_QS(at, block) {PICK_BYTE_WORDS(at), PICK_BYTE_WORDS((block) + (at))}
static const uint8_t PICK_Q4_0_QS[64] __attribute__((aligned(64))) = PICK_QS(2, 18); /* and IQ4_NL */
static const uint8_t PICK_Q4_1_QS[64] __attribute__((aligned(64))) = PICK_QS(4, 20);
static const uint8_t PICK_Q5_0_QS[64] __attribute__((aligned(64))) = PICK_QS(6, 22);
static const uint8_t PICK_Q5_1_QS[64] __attribute__((aligned(64))) = PICK_QS(8, 24);
#undef PICK_QS
#undef PICK_BYTE_WORDS

/* A pair's two blocks (``block`` bytes each), one masked load: nothing past them is read. */
static inline __attribute__((always_inline)) __m512i pair_bytes(const uint8_t *first, int block) {
    return _mm512_maskz_loadu_epi8(((__mmask64)1 << (2 * block)) - 1, first);
}

/* The pair's words (as pair_words) from its bytes. */
static inline __attribute__((always_inline)) void pair_words_picked(int type, const uint8_t *first, __m512i bytes,
                                                                   __m512i *low, __m512i *high) {
    const int block = (int)row_bytes(type, GROUP);
    const uint8_t *pick = type == TYPE_Q4_1 ? PICK_Q4_1_QS : type == TYPE_Q5_0 ? PICK_Q5_0_QS
                          : type == TYPE_Q5_1 ? PICK_Q5_1_QS : PICK_Q4_0_QS;
    const __m512i words = _mm512_maskz_permutexvar_epi8(0x5555555555555555ull, _mm512_load_si512((const void *)pick), bytes);
    *low = _mm512_and_si512(words, _mm512_set1_epi16(15)), *high = _mm512_srli_epi16(words, 4);
    if (type == TYPE_Q5_0 || type == TYPE_Q5_1) { /* 16 where value i's fifth bit (bit i of qh) is set */
        const int at = type == TYPE_Q5_0 ? 2 : 4;
        const uint32_t bits_first = fifth_bits_word(first + at), bits_second = fifth_bits_word(first + block + at);
        const __m512i sixteen = _mm512_set1_epi16(16);
        *low = _mm512_mask_add_epi16(*low, (bits_first & 0xffffu) | bits_second << 16, *low, sixteen);
        *high = _mm512_mask_add_epi16(*high, bits_first >> 16 | (bits_second & 0xffff0000u), *high, sixteen);
    } else if (type == TYPE_IQ4_NL) { /* the nibbles' levels, looked up as words */
        const __m512i levels = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)IQ4_LEVELS)));
        *low = _mm512_permutexvar_epi16(*low, levels), *high = _mm512_permutexvar_epi16(*high, levels);
    }
}

/* vpermt2b index of a block's d (and m) halves as two halves of the result: d, m or d, d. */
#define HALVES_PICK(at, m) (char)(at), (char)((at) + 1), (char)((at) + 2 * (m)), (char)((at) + 2 * (m) + 1)

/* Two pairs' [a, b] of their four groups from the pairs' bytes (``first``'s and ``second``'s). */
static inline __attribute__((always_inline)) __m256 two_pairs_scales_picked(int type, __m512i first, __m512i second) {
    const int block = (int)row_bytes(type, GROUP), m = with_m(type);
    const __m512i pick = _mm512_castsi128_si512(_mm_setr_epi8(HALVES_PICK(0, m), HALVES_PICK(block, m),
                                                              HALVES_PICK(64, m), HALVES_PICK(64 + block, m)));
    const __m256 halves = _mm256_cvtph_ps(_mm512_castsi512_si128(_mm512_permutex2var_epi8(first, pick, second)));
    if (m) return halves;
    const float factor = offset_factor(type);
    return _mm256_mul_ps(halves, _mm256_setr_ps(1.0f, factor, 1.0f, factor, 1.0f, factor, 1.0f, factor));
}
#undef HALVES_PICK
#endif

/* Pairs g, g + 1 and g + 2, g + 3 of a row: their words and their four groups' [a, b]. */
static inline __attribute__((always_inline)) void two_pairs(int type, const uint8_t *first, int64_t block,
                                                           __m512i low[2], __m512i high[2], __m256 *scales) {
#ifdef __AVX512VBMI__
    if (type != TYPE_Q8_0) {
        const __m512i bytes[2] = {pair_bytes(first, (int)block), pair_bytes(first + 2 * block, (int)block)};
        pair_words_picked(type, first, bytes[0], &low[0], &high[0]);
        pair_words_picked(type, first + 2 * block, bytes[1], &low[1], &high[1]);
        *scales = two_pairs_scales_picked(type, bytes[0], bytes[1]);
        return;
    }
#endif
    for (int p = 0; p < 2; ++p) pair_words(type, first + 2 * p * block, first + (2 * p + 1) * block, &low[p], &high[p]);
    *scales = _mm256_set_m128(pair_scales(type, first + 2 * block, first + 3 * block),
                              pair_scales(type, first, first + block));
}

/* Group i's and i + 1's sums (lanes 0..7, 8..15) of one row of x against a pair's words. */
static inline __attribute__((always_inline)) __m512i pair_sums(const RoundedGroups *x, int64_t i, __m512i low, __m512i high) {
    return dot_words(_mm512_madd_epi16(low, group_words(x, i)), high, group_words(x, i + 1));
}

/* The scale vector of pair p (0 or 1) of ``products`` = [a d, b (d sum q)] of four groups. */
static inline __attribute__((always_inline)) __m512 pair_scale_vector(__m256 products, int p) {
    const __m512i pick = _mm512_setr_epi32(4 * p, 4 * p, 4 * p, 4 * p, 4 * p, 4 * p, 4 * p, 4 * p, 4 * p + 2,
                                           4 * p + 2, 4 * p + 2, 4 * p + 2, 4 * p + 2, 4 * p + 2, 4 * p + 2, 4 * p + 2);
    return _mm512_permutexvar_ps(pick, _mm512_castps256_ps512(products));
}

/* Pairs g, g + 1 and g + 2, g + 3 of a row (of blocks ``block`` bytes long) against R
 * rows of x: the first pair into even, the second into odd; offset += the products,
 * whose odd lanes are the four groups' b (d sum q). */
static inline __attribute__((always_inline)) void two_pairs_rows(int type, int R, const uint8_t *row, int64_t block,
                                                                int64_t g, int64_t groups, const RoundedGroups *x,
                                                                __m512 *even, __m512 *odd, __m256 *offset) {
    const uint8_t *first = row + g * block;
    prefetch_block_ahead(first, (int)(4 * block));
    __m512i low[2], high[2];
    __m256 scales;
    two_pairs(type, first, block, low, high, &scales);
    for (int r = 0; r < R; ++r) {
        const int64_t i = r * groups + g;
        const __m256 products = _mm256_mul_ps(scales, _mm256_loadu_ps(x->step_sums + 2 * i));
        even[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pair_sums(x, i, low[0], high[0])), pair_scale_vector(products, 0), even[r]);
        odd[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pair_sums(x, i + 2, low[1], high[1])), pair_scale_vector(products, 1), odd[r]);
        if (OFFSET_TYPE(type)) offset[r] = _mm256_add_ps(offset[r], products);
    }
}

/* One pair g, g + 1 (the last of an odd number of pairs) against R rows of x. */
static inline __attribute__((always_inline)) void pair_rows(int type, int R, const uint8_t *row, int64_t block, int64_t g,
                                                           int64_t groups, const RoundedGroups *x, __m512 *acc,
                                                           __m256 *offset) {
    const uint8_t *first = row + g * block;
    __m512i low, high;
    pair_words(type, first, first + block, &low, &high);
    const __m128 scales = pair_scales(type, first, first + block);
    for (int r = 0; r < R; ++r) {
        const int64_t i = r * groups + g;
        const __m256 products = _mm256_castps128_ps256(_mm_mul_ps(scales, _mm_loadu_ps(x->step_sums + 2 * i)));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pair_sums(x, i, low, high)), pair_scale_vector(products, 0), acc[r]);
        if (OFFSET_TYPE(type)) offset[r] = _mm256_add_ps(offset[r], _mm256_zextps128_ps256(_mm256_castps256_ps128(products)));
    }
}

static inline __attribute__((always_inline)) void pair_rows_512(int type, int R, const uint8_t *row, int64_t groups,
                                                              const RoundedGroups *x, float *out, int64_t os) {
    const int64_t block = row_bytes(type, GROUP);
    __m512 even[DIRECT_MAX_ROWS], odd[DIRECT_MAX_ROWS];
    __m256 offset[DIRECT_MAX_ROWS];
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps(), offset[r] = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 4 <= groups; g += 4) two_pairs_rows(type, R, row, block, g, groups, x, even, odd, offset);
    if (g + 2 <= groups) pair_rows(type, R, row, block, g, groups, x, even, offset), g += 2;
    float alone[DIRECT_MAX_ROWS] = {0.0f};
    if (g < groups) { /* the last group, without a partner: in order */
        float a, b[2];
        __m256i lo, hi;
        group_scales(type, row, g, &a, b);
        weight_values(type, row, g, &lo, &hi);
        const __m512i words = join_halves(lo, hi);
        for (int r = 0; r < R; ++r) {
            const int64_t i = r * groups + g;
            odd[r] = scaled_group(odd[r], words, x, i, a * x->d[i]);
            alone[r] = b[0] * x->scaled_sum[i];
        }
    }
    for (int r = 0; r < R; ++r) {
        float offsets[8];
        _mm256_storeu_ps(offsets, offset[r]);
        out[r * os] = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r])) +
                      (((offsets[1] + offsets[3]) + (offsets[5] + offsets[7])) + alone[r]);
    }
}

/* out[r * os] for one weight row and R rows of x, R <= DIRECT_MAX_ROWS (every type but
 * the byte types, Q4_K and Q6_K: "in bytes" below). */
static inline __attribute__((always_inline)) void direct_rows_512(int type, int R, const uint8_t *row, int64_t groups,
                                                                const RoundedGroups *x, float *out, int64_t os) {
    if (!SUPER_BLOCK_TYPE(type)) {
        pair_rows_512(type, R, row, groups, x, out, os);
        return;
    }
    __m512 even[DIRECT_MAX_ROWS], odd[DIRECT_MAX_ROWS];
    __m256 offset[DIRECT_MAX_ROWS];
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps(), offset[r] = _mm256_setzero_ps();
    const int64_t block_bytes = row_bytes(type, 256);
    for (int64_t g = 0; g < groups; g += 8) {
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
