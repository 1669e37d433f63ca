/* Many rows of x (prefill, batches) against Q4_K and Q6_K blocks with AVX-512, in bytes.
 *
 * x's bytes (int8 steps, one step d_x per 256 values: see "activations" in
 * quant_matmul.c) meet the weights' unsigned integers u (Q4_K's nibbles 0..15,
 * Q6_K's 6-bit values 0..63) by VNNI's vpdpbusd: 64 products per instruction,
 * four at a time into each 32-bit lane (maddubs + madd + add where the CPU has
 * only AVX512BW; a pair is at most 2 x 63 x 127, exact). A panel of 32 weight
 * rows is decoded once per call, and each group's exact sums (each run's, for
 * Q6_K's per-16 scales) are scaled once, as the int16 tiles scale theirs:
 *
 *     Q4_K  out[r][c] = sum over groups g of  a[g][c] d_x[r] (u . q)[r][c][g]  +  b[g][c] (d_x sum q)[r][g]
 *     Q6_K  out[r][c] = sum over runs h of    a[h][c] (d_x (u . q)[r][c][h]  -  32 (d_x sum q)[r][h])
 *
 * with a = d s, b = -dmin m (Q4_K) and a = d s_h (Q6_K). The decode path
 * (quant_direct_avx512.h, "in bytes") multiplies the same integers, so both
 * compute one product up to the order of float32 sums.
 *
 * Layout of a decoded panel (BytePanel): for each of a row's groups in x's
 * slot order (byte_group_slot), 8 quads (values 4v .. 4v + 3), each as two
 * vectors of 16 rows' four bytes (vpdpbusd meets them with one broadcast quad
 * of x); then per group two rows of 32 floats (Q4_K: a, b; Q6_K: the two runs'
 * a). A register tile is R <= 6 rows of x by the 32 weight rows.
 *
 * The includer defines QUANT_AVX512 and BYTE_PRODUCTS and includes
 * ggml_blocks.h, quant_direct_avx512.h and quant_tiles_avx512.h
 * (transpose16_epi32) first. */

#ifndef CADENCE_QUANT_BYTE_TILES_AVX512_H
#define CADENCE_QUANT_BYTE_TILES_AVX512_H

#define BYTE_PANEL_ROWS 32
#define BYTE_HALF_PANEL 16

typedef struct {
    __m512i *quads; /* slot s, quad v, half p (rows 16 p .. 16 p + 15): quads[(s * 8 + v) * 2 + p] */
    float *scales;  /* group g (a row's own order), row c: scales[g * 64 + c] and [g * 64 + 32 + c] */
} BytePanel;

/* Bytes of a decoded panel of rows of ``groups`` groups. */
static inline int64_t byte_panel_bytes(int64_t groups) {
    return groups * (int64_t)(8 * 2 * sizeof(__m512i) + 2 * BYTE_PANEL_ROWS * sizeof(float));
}

/* acc + the sums of four products u . q in each 32-bit lane. */
static inline __attribute__((always_inline)) __m512i dot_bytes(__m512i acc, __m512i u, __m512i q) {
#ifdef __AVX512VNNI__
    return _mm512_dpbusd_epi32(acc, u, q);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, q), _mm512_set1_epi16(1)));
#endif
}

/* Super-block ``s`` of one weight row: its 256 bytes u as four vectors in x's slot
 * order, and its groups' two rows of scales into panel column c. */
static inline void byte_row_block(int type, const uint8_t *row, int64_t s, __m512i u[4], float *scales, int c) {
    if (type == TYPE_Q4_K) {
        const uint8_t *block = row + s * 144;
        q4_k_byte_nibbles_512(block, u);
        float a[8], b[8];
        __m256 av, bv;
        q4_k_scale_vectors(block, &av, &bv);
        _mm256_storeu_ps(a, av), _mm256_storeu_ps(b, bv);
        for (int g = 0; g < 8; ++g) scales[g * 64 + c] = a[g], scales[g * 64 + 32 + c] = b[g];
    } else {
        const uint8_t *block = row + s * 210;
        q6_k_byte_half_512(block, 0, u), q6_k_byte_half_512(block, 1, u + 2);
        const float d = f16_at(block + 208);
        for (int h = 0; h < 16; ++h) scales[(h / 2) * 64 + (h % 2) * 32 + c] = d * (float)(int8_t)block[192 + h];
    }
}

/* ``rows`` (<= 32) weight rows into a panel; rows past the last are zeros. */
static void decode_byte_panel(int type, const uint8_t *weight, int64_t stride, int64_t rows, int64_t groups,
                              BytePanel *panel) {
    for (int half = 0; half < 2; ++half)
        for (int64_t s = 0; s < groups / 8; ++s) {
            __m512i u[BYTE_HALF_PANEL][4];
            float *scales = panel->scales + s * 8 * 64;
            for (int j = 0; j < BYTE_HALF_PANEL; ++j) {
                const int c = half * BYTE_HALF_PANEL + j;
                if (c < rows) {
                    byte_row_block(type, weight + c * stride, s, u[j], scales, c);
                } else {
                    for (int t = 0; t < 4; ++t) u[j][t] = _mm512_setzero_si512();
                    for (int g = 0; g < 8; ++g) scales[g * 64 + c] = scales[g * 64 + 32 + c] = 0.0f;
                }
            }
            for (int t = 0; t < 4; ++t) { /* vector t: slots 2 t (quads 0..7) and 2 t + 1 (8..15) */
                __m512i r[BYTE_HALF_PANEL];
                for (int j = 0; j < BYTE_HALF_PANEL; ++j) r[j] = u[j][t];
                transpose16_epi32(r);
                for (int p = 0; p < 16; ++p) {
                    const int64_t slot = s * 8 + 2 * t + p / 8;
                    _mm512_store_si512(panel->quads + (slot * 8 + p % 8) * 2 + half, r[p]);
                }
            }
        }
}

/* The quads v0 .. v1 - 1 of slot s against R rows of x (from r0): sums[r][half]. */
static inline __attribute__((always_inline)) void byte_quad_sums(int R, const __m512i *quads, const int8_t *q,
                                                                int64_t row_bytes, int v0, int v1,
                                                                __m512i sums[][2]) {
    for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm512_setzero_si512();
    #pragma GCC unroll 8
    for (int v = v0; v < v1; ++v) {
        const __m512i w0 = _mm512_load_si512(quads + 2 * v), w1 = _mm512_load_si512(quads + 2 * v + 1);
        for (int r = 0; r < R; ++r) {
            int32_t quad;
            memcpy(&quad, q + r * row_bytes + 4 * v, sizeof quad);
            const __m512i xb = _mm512_set1_epi32(quad);
            sums[r][0] = dot_bytes(sums[r][0], w0, xb);
            sums[r][1] = dot_bytes(sums[r][1], w1, xb);
        }
    }
}

/* R rows of x (from r0) against a panel: result[r][0..31]. */
static inline __attribute__((always_inline)) void byte_panel_rows(int type, int R, const BytePanel *panel,
                                                                 int64_t groups, const RoundedGroups *x, int64_t r0,
                                                                 float result[][BYTE_PANEL_ROWS]) {
    __m512 acc[6][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int64_t row_bytes = groups * GROUP;
    for (int64_t s = 0; s < groups; ++s) {
        const int64_t g = byte_group_slot(type, s); /* the slot's own group (the order is its own inverse) */
        const __m512i *quads = panel->quads + s * 16;
        const float *scales = panel->scales + g * 64;
        const int8_t *q = x->q8 + r0 * row_bytes + s * GROUP;
        __m512i sums[6][2];
        if (type == TYPE_Q4_K) {
            byte_quad_sums(R, quads, q, row_bytes, 0, 8, sums);
            for (int r = 0; r < R; ++r) {
                const int64_t i = (r0 + r) * groups + g;
                const __m512 d = _mm512_set1_ps(x->d[i]), sum = _mm512_set1_ps(x->scaled_sum[i]);
                for (int h = 0; h < 2; ++h) {
                    const __m512 a = _mm512_loadu_ps(scales + BYTE_HALF_PANEL * h);
                    const __m512 b = _mm512_loadu_ps(scales + 32 + BYTE_HALF_PANEL * h);
                    acc[r][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][h]), _mm512_mul_ps(a, d), acc[r][h]);
                    acc[r][h] = _mm512_fmadd_ps(b, sum, acc[r][h]);
                }
            }
            continue;
        }
        for (int run = 0; run < 2; ++run) { /* Q6_K: values 0..15, then 16..31 */
            byte_quad_sums(R, quads, q, row_bytes, 4 * run, 4 * run + 4, sums);
            for (int r = 0; r < R; ++r) {
                const int64_t i = (r0 + r) * groups + g;
                const __m512 d = _mm512_set1_ps(x->d[i]), bias = _mm512_set1_ps(-32.0f * x->half_sums[2 * i + run]);
                for (int h = 0; h < 2; ++h) {
                    const __m512 a = _mm512_loadu_ps(scales + 32 * run + BYTE_HALF_PANEL * h);
                    acc[r][h] = _mm512_fmadd_ps(a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][h]), d, bias), acc[r][h]);
                }
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        _mm512_storeu_ps(result[r], acc[r][0]);
        _mm512_storeu_ps(result[r] + BYTE_HALF_PANEL, acc[r][1]);
    }
}

#define BYTE_PANEL_BY_ROWS(TYPE)                                                                  \
    switch (step) {                                                                               \
    case 6: byte_panel_rows(TYPE, 6, &panel, groups, x, r, result); break;                        \
    case 4: byte_panel_rows(TYPE, 4, &panel, groups, x, r, result); break;                        \
    case 2: byte_panel_rows(TYPE, 2, &panel, groups, x, r, result); break;                        \
    default: byte_panel_rows(TYPE, 1, &panel, groups, x, r, result); break;                       \
    }

/* out[0:m, 0:rows] (row stride os) for the ``rows`` (<= BYTE_PANEL_ROWS) weight rows
 * at ``weight``, x's rows rounded for the type (``groups`` groups each), ``buffer``
 * a thread's byte_panel_bytes(groups). Each row of x is computed alone. */
static void multiply_byte_panel(int type, const uint8_t *weight, int64_t stride, int64_t rows, int64_t groups,
                                const RoundedGroups *x, int64_t m, void *buffer, float *out, int64_t os) {
    BytePanel panel = {(__m512i *)buffer, (float *)((__m512i *)buffer + groups * 16)};
    decode_byte_panel(type, weight, stride, rows, groups, &panel);
    float result[6][BYTE_PANEL_ROWS] __attribute__((aligned(64)));
    for (int64_t r = 0; r < m;) {
        const int64_t left = m - r, step = left >= 6 ? 6 : (left >= 4 ? 4 : (left >= 2 ? 2 : 1));
        if (type == TYPE_Q4_K) {
            BYTE_PANEL_BY_ROWS(TYPE_Q4_K);
        } else {
            BYTE_PANEL_BY_ROWS(TYPE_Q6_K);
        }
        for (int64_t i = 0; i < step; ++i) memcpy(out + (r + i) * os, result[i], (size_t)rows * sizeof(float));
        r += step;
    }
}

#endif /* CADENCE_QUANT_BYTE_TILES_AVX512_H */
