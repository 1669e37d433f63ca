/* Many rows of x (prefill, batches) against GGUF blocks with AVX-512, for quant_matmul.c.
 *
 * The float32 tiles of the AVX2 build (quant_matmul.c, "many rows of x") cost
 * one FMA per 8 products. Here a tile of 32 weight rows is decoded once to the
 * 16-bit integers u of the decode path (w = a u + b per group of 32), and
 * multiplied with x's int16 integers q by VNNI's vpdpwssd (or madd + add with
 * AVX512BW only): 32 products per instruction, summed exactly in 32-bit lanes.
 * Each group's sums are then scaled once, as the decode path scales them:
 *
 *     out[r][c] = sum over groups g of  a[g][c] d[r][g] (u . q)[r][c][g]  +  b[g][c] (d sum q)[r][g]
 *
 * so both paths compute one product, up to the order of float32 sums.
 *
 * Layout of a decoded tile (IntTile): for each group, 16 vectors of 32
 * int16, vector p holding values 2p and 2p + 1 of the 16 rows of a panel
 * (a 32-bit pair per row: vpdpwssd multiplies it with one broadcast pair of
 * x), the two panels' vectors side by side; then each row's a and b per group.
 * A register tile is R rows of x by the 32 weight rows: R x 2 integer sums
 * and R x 2 float accumulators.
 *
 * The includer defines QUANT_AVX512 and includes ggml_blocks.h,
 * quant_direct_avx512.h and the RoundedGroups of x first. */

#ifndef CADENCE_QUANT_TILES_AVX512_H
#define CADENCE_QUANT_TILES_AVX512_H

#define INT_TILE_ROWS 32
#define INT_PANEL 16

/* One tile: words[g][p][panel] (a __m512i each), a[g][row], b[g][half][row]. */
typedef struct {
    __m512i *words;
    float *a, *b;
} IntTile;

/* Bytes of a tile of rows of ``groups`` groups. */
static inline int64_t int_tile_bytes(int64_t groups) {
    return groups * (int64_t)(INT_PANEL * 2 * sizeof(__m512i) + 3 * INT_TILE_ROWS * sizeof(float));
}

static inline IntTile int_tile_at(void *buffer, int64_t groups) {
    IntTile tile;
    tile.words = (__m512i *)buffer;
    tile.a = (float *)(tile.words + groups * INT_PANEL * 2);
    tile.b = tile.a + groups * INT_TILE_ROWS;
    return tile;
}

/* Groups g .. g + count - 1 of one weight row (count 8 for super-block types, else
 * 1) as 16-bit integers words[j][32], with a[j], b[2 j], b[2 j + 1]. */
static inline int row_words(int type, const uint8_t *row, int64_t g, int16_t words[8][GROUP], float a[8],
                            float b[16]) {
    if (!SUPER_BLOCK_TYPE(type)) {
        __m256i lo, hi;
        group_scales(type, row, g, a, b);
        weight_values(type, row, g, &lo, &hi);
        _mm512_storeu_si512(words[0], join_halves(lo, hi));
        return 1;
    }
    const uint8_t *block = row + (g / 8) * row_bytes(type, 256);
    super_block_scales(type, block, a, b);
    for (int j = 0; j < 8; j += 2) {
        __m512i first, second;
        super_block_pair_words(type, row, block, g, j, &first, &second);
        _mm512_storeu_si512(words[j], first);
        _mm512_storeu_si512(words[j + 1], second);
    }
    return 8;
}

/* r[i] (row i: 16 pairs) -> r[p] (pair p of the 16 rows): a 16 x 16 transpose of
 * 32-bit elements. */
static inline void transpose16_epi32(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    /* u[4 i + c], 128-bit lane L: element 4 L + c of rows 4 i .. 4 i + 3 */
    for (int i = 0; i < 4; ++i) {
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; ++c) {
        const __m512i even_low = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88);
        const __m512i odd_low = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
        const __m512i even_high = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
        const __m512i odd_high = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
        r[c] = _mm512_shuffle_i32x4(even_low, even_high, 0x88);
        r[8 + c] = _mm512_shuffle_i32x4(even_low, even_high, 0xdd);
        r[4 + c] = _mm512_shuffle_i32x4(odd_low, odd_high, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(odd_low, odd_high, 0xdd);
    }
}

/* ``rows`` (<= 32) weight rows into a tile; rows past the last are zeros. */
static void decode_int_tile(int type, const uint8_t *weight, int64_t stride, int64_t rows, int64_t groups,
                            IntTile *tile) {
    const int per_step = SUPER_BLOCK_TYPE(type) ? 8 : 1;
    int16_t words[INT_PANEL][8][GROUP] __attribute__((aligned(64)));
    for (int panel = 0; panel < 2; ++panel)
        for (int64_t g = 0; g < groups; g += per_step) {
            for (int j = 0; j < INT_PANEL; ++j) {
                const int64_t c = panel * INT_PANEL + j;
                float a[8], b[16];
                if (c < rows) {
                    row_words(type, weight + c * stride, g, words[j], a, b);
                } else {
                    memset(words[j], 0, sizeof words[j]);
                    memset(a, 0, sizeof a), memset(b, 0, sizeof b);
                }
                for (int s = 0; s < per_step; ++s) {
                    tile->a[(g + s) * INT_TILE_ROWS + c] = a[s];
                    tile->b[((g + s) * 2) * INT_TILE_ROWS + c] = b[2 * s];
                    tile->b[((g + s) * 2 + 1) * INT_TILE_ROWS + c] = b[2 * s + 1];
                }
            }
            for (int s = 0; s < per_step; ++s) {
                __m512i r[INT_PANEL];
                for (int j = 0; j < INT_PANEL; ++j) r[j] = _mm512_load_si512(words[j][s]);
                transpose16_epi32(r);
                __m512i *out = tile->words + (g + s) * INT_PANEL * 2 + panel;
                for (int p = 0; p < INT_PANEL; ++p) _mm512_store_si512(out + 2 * p, r[p]);
            }
        }
}

/* R rows of x (from r0) against a tile: result[r][0..31]. */
static inline __attribute__((always_inline)) void int_tile_rows(int type, int R, const IntTile *tile, int64_t groups,
                                                               const RoundedGroups *x, int64_t r0,
                                                               float result[][INT_TILE_ROWS]) {
    __m512 acc[6][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        __m512i sums[6][2];
        for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm512_setzero_si512();
        const __m512i *w = tile->words + g * INT_PANEL * 2;
        #pragma GCC unroll 16
        for (int p = 0; p < INT_PANEL; ++p) {
            const __m512i w0 = _mm512_load_si512(w + 2 * p), w1 = _mm512_load_si512(w + 2 * p + 1);
            for (int r = 0; r < R; ++r) {
                int32_t pair;
                memcpy(&pair, x->q + ((r0 + r) * groups + g) * GROUP + 2 * p, sizeof pair);
                const __m512i xb = _mm512_set1_epi32(pair);
                sums[r][0] = dot_words(sums[r][0], w0, xb);
                sums[r][1] = dot_words(sums[r][1], w1, xb);
            }
        }
        const float *a = tile->a + g * INT_TILE_ROWS, *b = tile->b + g * 2 * INT_TILE_ROWS;
        const __m512 a0 = _mm512_loadu_ps(a), a1 = _mm512_loadu_ps(a + INT_PANEL);
        for (int r = 0; r < R; ++r) {
            const int64_t i = (r0 + r) * groups + g;
            const __m512 d = _mm512_set1_ps(x->d[i]);
            acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][0]), _mm512_mul_ps(a0, d), acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][1]), _mm512_mul_ps(a1, d), acc[r][1]);
            if (type == TYPE_Q2_K) {
                const __m512 first = _mm512_set1_ps(x->half_sums[2 * i]), second = _mm512_set1_ps(x->half_sums[2 * i + 1]);
                for (int q = 0; q < 2; ++q) {
                    acc[r][q] = _mm512_fmadd_ps(_mm512_loadu_ps(b + INT_PANEL * q), first, acc[r][q]);
                    acc[r][q] = _mm512_fmadd_ps(_mm512_loadu_ps(b + INT_TILE_ROWS + INT_PANEL * q), second, acc[r][q]);
                }
            } else if (OFFSET_TYPE(type)) {
                const __m512 sum = _mm512_set1_ps(x->scaled_sum[i]);
                for (int q = 0; q < 2; ++q) acc[r][q] = _mm512_fmadd_ps(_mm512_loadu_ps(b + INT_PANEL * q), sum, acc[r][q]);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        _mm512_storeu_ps(result[r], acc[r][0]);
        _mm512_storeu_ps(result[r] + INT_PANEL, acc[r][1]);
    }
}

#define INT_TILE_BY_ROWS(TYPE)                                                                   \
    switch (step) {                                                                              \
    case 6: int_tile_rows(TYPE, 6, tile, groups, x, r, result); break;                           \
    case 4: int_tile_rows(TYPE, 4, tile, groups, x, r, result); break;                           \
    case 2: int_tile_rows(TYPE, 2, tile, groups, x, r, result); break;                           \
    default: int_tile_rows(TYPE, 1, tile, groups, x, r, result); break;                          \
    }

/* Every row of x (m) against a decoded tile of ``cols`` weight rows: out[:, 0:cols]. */
static void multiply_int_tile(int type, const IntTile *tile, int64_t groups, const RoundedGroups *x, int64_t m,
                              int64_t cols, float *out, int64_t os) {
    float result[6][INT_TILE_ROWS] __attribute__((aligned(64)));
    for (int64_t r = 0; r < m;) {
        const int64_t left = m - r, step = left >= 6 ? 6 : (left >= 4 ? 4 : (left >= 2 ? 2 : 1));
        /* int_tile_rows asks only whether the type is Q2_K, or has offsets b */
        if (type == TYPE_Q2_K) {
            INT_TILE_BY_ROWS(TYPE_Q2_K);
        } else if (OFFSET_TYPE(type)) {
            INT_TILE_BY_ROWS(TYPE_Q4_K);
        } else {
            INT_TILE_BY_ROWS(TYPE_Q6_K);
        }
        for (int64_t i = 0; i < step; ++i) memcpy(out + (r + i) * os, result[i], (size_t)cols * sizeof(float));
        r += step;
    }
}

#endif /* CADENCE_QUANT_TILES_AVX512_H */
