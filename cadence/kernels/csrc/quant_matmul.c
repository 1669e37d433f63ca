/* Matmuls on GGUF's quantized blocks: out[M, N] = x[M, K] @ W[N, K]^T, W kept in blocks.
 *
 * Each weight row is K values stored as K/32 groups of 32 (one block of
 * Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL; one eighth of a 256-value Q2_K, Q3_K,
 * Q4_K, Q5_K, Q6_K or IQ4_XS super-block; the layouts are in ggml_blocks.h). x is first
 * rounded per group of 32 to int16 steps (see "activations"). Two paths,
 * each reading every weight byte from memory once per call:
 *
 *     M <= 4, or up to 12      each group of a weight row widened to 16-bit
 *     while M * K <= 10240    integers in registers and multiplied with the
 *     (decode)                M rows' integers (madd), 4 rows at a time,
 *                             scaled once per group
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
 * The byte types (Q4_K, Q6_K: x in int8 steps) take byte tiles instead, the
 * weights decoded to bytes and multiplied by maddubs (quant_byte_tiles_avx2.h;
 * 1.4-1.6x the float32 tiles' products a second). With AVX512F and AVX512BW in
 * -march both paths stay in integers: the decode path in quant_direct_avx512.h,
 * 32 products per instruction (VNNI's vpdpwssd where present), 64 for the byte
 * types (maddubs); the tiles, decoded to int16 (quant_tiles_avx512.h) or, for
 * the byte types, to bytes that VNNI's vpdpbusd multiplies 64 at a time
 * (quant_byte_tiles_avx512.h). ``quant_matmul_isa`` names the one built. Values decode as ggml's
 * dequantize_row_* (and the gguf package) compute them, so results match
 * dequantize-then-matmul of the rounded x up to the order of the float32 sums.
 *
 * ``quant_matmul_rows_apart`` takes the integer path at every number of rows
 * (the batch-invariant mode): a row's value is then the one it has alone.
 *
 * Threads: OpenMP over weight rows or tiles. Loaded after torch, the library
 * shares torch's libgomp and its thread count.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_num_threads(void) { return 1; }
static inline int omp_get_thread_num(void) { return 0; }
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QUANT_AVX2 1
/* Rows of x up to which products stay in integers (see "activations"). */
#define DIRECT_MAX_ROWS 4
#if defined(__AVX512F__) && defined(__AVX512BW__)
/* The decode path's products in 512-bit registers (quant_direct_avx512.h). */
#define QUANT_AVX512 1
#endif
/* Rows of x up to which the integer path runs, in chunks of DIRECT_MAX_ROWS (a
 * weight row read once serves every chunk from L1), while x's rounded rows
 * (m * k int16, read again for every weight row) take at most 20 KiB and stay
 * in L1 with it; other products go to tiles, which decode each weight row
 * once for all rows. Measured (BENCHMARKS.md, quant-direct-rows-v1 and
 * avx2-direct-runs-v1): on SmolLM2-135M and Gemma 3 270M the chunks beat the
 * tiles up to about 12 rows, with AVX-512 on a Zen 5 (decode steps of 5-8
 * streams 1.3-1.9x faster) and with AVX2 on an AVX2-only EPYC (9-12 streams
 * 1.1-1.5x); on a 1B-class model, k of 2048 and 8192, x past L1 made them
 * slower than AVX-512's integer tiles from 6 rows (1.7x at 12), hence the bound
 * on m * k there. AVX2's tiles are float32 and slower: on the AVX2-only EPYC the
 * chunks beat them at every k measured, 2048 and 8192 included (6-12 rows
 * 1.2-2.1x), and up to 16 rows (13-16 rows: decode steps 1.2-1.4x, past 20
 * the tiles win; avx2-chunks-any-k-v1), so without AVX-512 they take up to 16
 * rows of any length. */
/* The types that round x to bytes (byte_activations) are multiplied as bytes:
 * maddubs, 32 products in one instruction (64 with AVX-512). */
#define BYTE_PRODUCTS 1
#ifdef QUANT_AVX512
#define DIRECT_CHUNKED_MAX_ROWS 12
#define DIRECT_CHUNKED_MAX_VALUES 10240
#else
#define DIRECT_CHUNKED_MAX_ROWS 16
#define DIRECT_CHUNKED_MAX_VALUES INT64_MAX
#endif
#else
#define DIRECT_MAX_ROWS 0
#define DIRECT_CHUNKED_MAX_ROWS 0
#define DIRECT_CHUNKED_MAX_VALUES 0
#endif

/* Multiply-adds below which a call stays on one thread. */
#define PARALLEL_MIN_MACS (1 << 16)
/* Most float32 bytes one thread's decoded tile may take (it stays in L2). */
#define TILE_BYTES (96 * 1024)

/* The products' float arithmetic keeps the order written here, whatever the
 * build's flags (-fassociative-math, cadence/kernels/build.py): a row's value
 * must not depend on how many rows share its call (quant_matmul_rows_apart,
 * the batch-invariant mode), and with reassociation GCC multiplied a group's
 * scales (d s) d_x in one order for one row and in another for four (Q5_K and
 * IQ4_XS on an Ice Lake Xeon). Up to the end of this file. */
#pragma GCC push_options
#pragma GCC optimize("no-associative-math")

#include "ggml_blocks.h"

/* ---------------------------------------------------------------- dot products
 * R rows of x (row stride xs) against C decoded rows of w (contiguous, K each):
 * out[r * os + c] = sum_k x[r][k] w[c][k]. K is a multiple of 32. */

#ifdef QUANT_AVX2
#if defined(QUANT_AVX512) && defined(__AVX512VNNI__)
static const char ISA[] = "AVX2 FMA, AVX-512 VNNI decode and tiles";
#elif defined(QUANT_AVX512)
static const char ISA[] = "AVX2 FMA, AVX-512BW decode and tiles";
#else
static const char ISA[] = "AVX2 FMA";
#endif

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

static inline __attribute__((always_inline)) void transpose8(__m256 r[8]) {
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
 * moves by at most 1/65534 of its group's largest). For the types of
 * byte_activations the steps are int8's, d = max|x| / 127, one d per 256
 * values (a super-block of the weights), as llama.cpp's Q8_K activations:
 * their AVX2 products then multiply bytes (maddubs), 1.6x the weights read per
 * second of the int16 products on an AVX2-only EPYC (BENCHMARKS.md,
 * avx2-byte-products-v1), and the byte tiles sum a super-block's eight groups
 * in integers before one conversion to float. Every build and path rounds a
 * type alike. The
 * decode path multiplies these integers with the weight's own; the tile path
 * the rounded values q * d as float32. Both compute one product, up to the
 * order of float32 sums, whatever the number of rows. */

/* Whether x meets ``type``'s weights rounded to int8 steps (else int16's). */
static inline int byte_activations(int type) { return type == TYPE_Q4_K || type == TYPE_Q6_K; }

/* The largest integer of x's rounding for ``type``: 127 or 32767. */
static inline float activation_steps(int type) { return byte_activations(type) ? 127.0f : 32767.0f; }

/* Values of x that share one step d: a super-block's 256 for the byte types (as
 * llama.cpp's Q8_K activations: the byte tiles then sum a super-block's eight
 * groups in integers), a group's 32 for the others. */
static inline int64_t rounding_span(int type) { return byte_activations(type) ? 256 : GROUP; }

/* The step d = max|x| / steps of ``span`` values of x. */
static float rounding_step(const float *x, int64_t span, float steps) {
    float amax = 0.0f;
    for (int64_t i = 0; i < span; ++i) {
        const float v = fabsf(x[i]);
        amax = v > amax ? v : amax;
    }
    return amax / steps;
}

/* One group of x rounded to steps of d: its 32 integers q, and d * sum(q) (returned). */
static float round_group(const float *x, float d, int16_t *q) {
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int i = 0; i < GROUP; ++i) {
        const int value = (int)rintf(x[i] * id);
        q[i] = (int16_t)value;
        sum += value;
    }
    return d * (float)sum;
}

/* The rounded values q * d of x [m, k] (row stride xs) into out [m, k], for ``type``. */
static void rounded_rows(int type, const float *x, int64_t m, int64_t xs, int64_t k, float *out) {
    const float steps = activation_steps(type);
    const int64_t span = rounding_span(type);
    #pragma omp parallel for schedule(static) if (m * k >= PARALLEL_MIN_MACS)
    for (int64_t r = 0; r < m; ++r) {
        float d = 0.0f;
        for (int64_t g = 0; g < k / GROUP; ++g) {
            int16_t q[GROUP];
            if (g % (span / GROUP) == 0) d = rounding_step(x + r * xs + g * GROUP, span, steps);
            round_group(x + r * xs + g * GROUP, d, q);
            for (int i = 0; i < GROUP; ++i) out[r * k + g * GROUP + i] = (float)q[i] * d;
        }
    }
}

/* Exported for the tests: rounded_rows of x [m, k] (contiguous) for ``type``. */
int quant_round_activations(int type, const float *x, int64_t m, int64_t k, float *out) {
    if (k % rounding_span(type)) return -1;
    rounded_rows(type, x, m, k, k, out);
    return 0;
}

#ifdef QUANT_AVX2
/* Few rows of x (decode): each group of a weight row stays in integers,
 * widened to 16 bits, and is multiplied with the rows' int16 groups (madd:
 * 8 x 32-bit partial sums, exact) and scaled once: w = a * u + b per value u
 * of the group, so the group adds a * d * sum(u q) + b * d * sum(q). About
 * half the instructions of decoding the group to float32. The weights' integers
 * and scales come from ggml_blocks.h (weight_values and the others). */

/* Whether this build's decode rows multiply ``type``'s weights by x's bytes (q8). */
static inline int byte_decode_rows(int type) {
#ifdef BYTE_PRODUCTS
    return byte_activations(type);
#else
    (void)type;
    return 0;
#endif
}

/* Where group g of a row of x lies among its groups in bytes (q8): g itself,
 * except for Q4_K with AVX-512, whose products read a super-block's groups in the
 * order 0 2 1 3 4 6 5 7 (quant_direct_avx512.h, "in bytes"): bits 0 and 1 of g
 * swapped. */
static inline int64_t byte_group_slot(int type, int64_t g) {
#ifdef QUANT_AVX512
    if (type == TYPE_Q4_K) return (g & ~(int64_t)3) | (g & 1) << 1 | (g >> 1 & 1);
#else
    (void)type;
#endif
    return g;
}

/* Whether the decode rows take ``type``'s groups two at a time (quant_direct_avx512.h,
 * "pairs of groups"): the 32-value types, with AVX-512. */
static inline int decode_in_pairs(int type) {
#ifdef QUANT_AVX512
    switch (type) {
    case TYPE_Q8_0: case TYPE_Q4_0: case TYPE_Q4_1: case TYPE_Q5_0: case TYPE_Q5_1: case TYPE_IQ4_NL: return 1;
    default: return 0;
    }
#else
    (void)type;
    return 0;
#endif
}

/* Where group g's integers lie among a row's 32 * groups, in pairs: values 0..15
 * at low, 16..31 at high. Groups g, g + 1 (g even) as [g 0..15, g+1 0..15, g
 * 16..31, g+1 16..31]; a last group without a partner in order. */
static inline void pair_slots(int64_t g, int64_t groups, int64_t *low, int64_t *high) {
    if ((g | 1) >= groups) {
        *low = g * GROUP, *high = *low + GROUP / 2;
        return;
    }
    *low = (g & ~(int64_t)1) * GROUP + (g & 1) * (GROUP / 2), *high = *low + GROUP;
}

/* Rows of x rounded for the integer products: group i (row-major over rows) is
 * q[32 i .. 32 i + 31] (32-byte aligned; for the types of decode_in_pairs in the
 * products of few rows, a pair's values in the order pair_slots gives), step d[i], scaled_sum[i] = d * sum(q), and
 * half_sums[2 i], [2 i + 1] = d * sum(q) over values 0..15 and 16..31; where the
 * build multiplies bytes, q8 the same integers as bytes and half_q[2 i], [2 i + 1]
 * the sums of q over values 0..15 and 16..31 (|sum| <= 16 * 127). */
typedef struct {
    int16_t *q;
    float *d, *scaled_sum, *half_sums;
    int8_t *q8;
    int16_t *half_q;
    float *step_sums; /* [2 i] = d[i], [2 i + 1] = scaled_sum[i], for the pairs' rows; else NULL */
    void *owned; /* an allocation of its own (free it: release_rows), or NULL */
} RoundedGroups;

/* Bytes of x's rounded rows that a thread keeps between calls (rounding_buffer). */
#define KEPT_ROUNDING_BYTES ((size_t)16 << 20)

/* The calling thread's buffer for x's rounded rows, grown as needed and kept up
 * to KEPT_ROUNDING_BYTES: a fresh allocation of a batch's megabyte is fresh
 * pages, zeroed by the kernel, on every call (the 1B-class file's ffn_down by
 * 64 rows took 1.25x as long); NULL past that bound (or without memory). */
static void *rounding_buffer(size_t bytes) {
    static __thread void *buffer = NULL;
    static __thread size_t capacity = 0;
    if (bytes > KEPT_ROUNDING_BYTES) return NULL;
    if (bytes > capacity) {
        free(buffer);
        buffer = NULL;
        capacity = 0;
        if (posix_memalign(&buffer, 64, bytes)) return NULL;
        capacity = bytes;
    }
    return buffer;
}

/* x [m, k] (row stride xs) rounded for ``type`` into the thread's rounding_buffer
 * (valid until the thread's next call) or, past its bound, an allocation of its
 * own (release_rows frees it); q NULL without memory. half_sums only for Q2_K (its products read them), q8 only where
 * BYTE_PRODUCTS takes the type; NULL elsewhere. */
static RoundedGroups round_rows(int type, const float *x, int64_t m, int64_t xs, int64_t k, int in_pairs) {
    const int64_t groups = k / GROUP, count = m * groups;
#ifdef QUANT_AVX512 /* the byte tiles of Q6_K read them too */
    const int with_half_sums = type == TYPE_Q2_K || type == TYPE_Q6_K;
#else
    const int with_half_sums = type == TYPE_Q2_K;
#endif
    const int with_bytes = byte_decode_rows(type);
    const float steps = activation_steps(type);
    const int64_t span = rounding_span(type);
    RoundedGroups rounded = {NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    const size_t bytes = (size_t)count * (GROUP * sizeof(int16_t) + 4 * sizeof(float) +
                                          (with_bytes ? GROUP + 2 * sizeof(int16_t) : 0));
    rounded.q = rounding_buffer(bytes);
    if (rounded.q == NULL) { /* a prefill's rows: their own pages, returned after the call */
        if (posix_memalign((void **)&rounded.q, 64, bytes)) {
            rounded.q = NULL;
            return rounded;
        }
        rounded.owned = rounded.q;
    }
    rounded.d = (float *)(rounded.q + count * GROUP);
    rounded.scaled_sum = rounded.d + count;
    rounded.half_sums = with_half_sums ? rounded.scaled_sum + count : NULL;
    rounded.q8 = with_bytes ? (int8_t *)(rounded.scaled_sum + 3 * count) : NULL;
    rounded.half_q = with_bytes ? (int16_t *)(rounded.q8 + count * GROUP) : NULL;
    /* the pairs' types have no half sums: their two floats a group hold the step sums */
    rounded.step_sums = in_pairs ? rounded.scaled_sum + count : NULL;
    #pragma omp parallel for schedule(static) if (m * k >= PARALLEL_MIN_MACS)
    for (int64_t r = 0; r < m; ++r) {
        float step = 0.0f;
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t i = r * groups + g;
            int16_t q[GROUP];
            if (g % (span / GROUP) == 0) step = rounding_step(x + r * xs + g * GROUP, span, steps);
            rounded.d[i] = step;
            rounded.scaled_sum[i] = round_group(x + r * xs + g * GROUP, step, q);
            int64_t low = g * GROUP, high = low + GROUP / 2;
            if (in_pairs) pair_slots(g, groups, &low, &high);
            memcpy(rounded.q + r * groups * GROUP + low, q, sizeof q / 2);
            memcpy(rounded.q + r * groups * GROUP + high, q + GROUP / 2, sizeof q / 2);
            if (in_pairs) rounded.step_sums[2 * i] = step, rounded.step_sums[2 * i + 1] = rounded.scaled_sum[i];
            if (with_bytes) {
                int16_t halves[2] = {0, 0};
                int8_t *bytes = rounded.q8 + (r * groups + byte_group_slot(type, g)) * GROUP;
                for (int l = 0; l < GROUP; ++l) {
                    bytes[l] = (int8_t)q[l];
                    halves[l / (GROUP / 2)] += q[l];
                }
                rounded.half_q[2 * i] = halves[0], rounded.half_q[2 * i + 1] = halves[1];
            }
            if (!with_half_sums) continue;
            int32_t first = 0, second = 0;
            for (int l = 0; l < GROUP / 2; ++l) first += q[l], second += q[l + GROUP / 2];
            rounded.half_sums[2 * i] = rounded.d[i] * (float)first;
            rounded.half_sums[2 * i + 1] = rounded.d[i] * (float)second;
        }
    }
    return rounded;
}

/* Frees what round_rows allocated for these rows alone (nothing if they are in
 * the thread's buffer). */
static void release_rows(RoundedGroups *rounded) { free(rounded->owned); }

/* The scales of a run of up to eight groups g .. g + len - 1 of a weight row,
 * unpacked once for every row of x, in registers (a vector stored as floats and
 * loaded back would wait for the stores): group j's weights are a_j * u + b_j,
 * Q2_K's b_j for values 0..15 and 16..31 in b_halves (lanes 2 j, 2 j + 1 of the
 * pair). Lanes past the row's last group are 0. */
typedef struct {
    __m256 a, b, b_halves[2];
} RunScales;

/* The half floats at p + j * stride for the run's groups j < len (0 past them), as
 * floats (a gather of the eight measured no faster on an AVX2-only EPYC). */
static inline __attribute__((always_inline)) __m256 run_halves(const uint8_t *p, int64_t stride, int len) {
#define HALF_AT(j) ((j) < len ? f16_at(p + (j) * stride) : 0.0f)
    return _mm256_setr_ps(HALF_AT(0), HALF_AT(1), HALF_AT(2), HALF_AT(3), HALF_AT(4), HALF_AT(5), HALF_AT(6),
                          HALF_AT(7));
#undef HALF_AT
}

static inline __attribute__((always_inline)) RunScales run_scales(int type, const uint8_t *row, int64_t g, int len) {
    const __m256 zero = _mm256_setzero_ps();
    RunScales s = {zero, zero, {zero, zero}};
    if (SUPER_BLOCK_TYPE(type)) {
        const uint8_t *block = row + (g / 8) * row_bytes(type, 256);
        if (type == TYPE_Q4_K || type == TYPE_Q5_K) {
            q4_k_scale_vectors(block, &s.a, &s.b);
        } else if (type == TYPE_Q2_K) { /* the scales are in the integers, the mins in b */
            s.a = _mm256_set1_ps(f16_at(block + 80));
            const __m256 dmin = _mm256_set1_ps(-f16_at(block + 82));
            const __m128i mins = _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128((const __m128i *)block), 4),
                                               _mm_set1_epi8(15));
            s.b_halves[0] = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mins)));
            s.b_halves[1] = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(mins, 8))));
        } else if (type == TYPE_IQ4_XS) {
            s.a = _mm256_setr_ps(iq4_xs_scale(block, 0), iq4_xs_scale(block, 1), iq4_xs_scale(block, 2),
                                 iq4_xs_scale(block, 3), iq4_xs_scale(block, 4), iq4_xs_scale(block, 5),
                                 iq4_xs_scale(block, 6), iq4_xs_scale(block, 7));
        } else { /* Q3_K, Q6_K: the per-16 scales are in the integers */
            s.a = _mm256_set1_ps(f16_at(block + (type == TYPE_Q6_K ? 208 : 108)));
        }
        return s;
    }
    const uint8_t *block = row + g * row_bytes(type, GROUP);
    s.a = run_halves(block, row_bytes(type, GROUP), len);
    switch (type) {
    case TYPE_Q4_0: s.b = _mm256_mul_ps(_mm256_set1_ps(-8.0f), s.a); break;
    case TYPE_Q5_0: s.b = _mm256_mul_ps(_mm256_set1_ps(-16.0f), s.a); break;
    case TYPE_Q4_1:
    case TYPE_Q5_1: s.b = run_halves(block + 2, row_bytes(type, GROUP), len); break;
    default: break; /* Q8_0, IQ4_NL */
    }
    return s;
}

/* p[0 .. len - 1], then zeros (nothing past them is read). */
static inline __m256 load_run(const float *p, int len) {
    if (len == 8) return _mm256_loadu_ps(p);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(len), lanes));
}

/* One row of x against a run's scales, from x's group i: scale[j] = a_j * d_(i+j),
 * and the run's offsets b * d * sum(q) added into the row's accumulator ``acc``
 * (its 8 lanes are summed at the end). */
static inline __attribute__((always_inline)) void run_row_scales(int type, const RoundedGroups *x, int64_t i,
                                                                int len, const RunScales *s, float scale[8],
                                                                __m256 *acc) {
    _mm256_store_ps(scale, _mm256_mul_ps(s->a, load_run(x->d + i, len)));
    if (type == TYPE_Q2_K) { /* a super-block: len is 8 */
        *acc = _mm256_fmadd_ps(s->b_halves[0], _mm256_loadu_ps(x->half_sums + 2 * i), *acc);
        *acc = _mm256_fmadd_ps(s->b_halves[1], _mm256_loadu_ps(x->half_sums + 2 * i + 8), *acc);
    } else if (OFFSET_TYPE(type)) {
        *acc = _mm256_fmadd_ps(s->b, load_run(x->scaled_sum + i, len), *acc);
    }
}

/* acc[r] += (lo | hi) . q * scale[r][j] for each of R rows of x, its group g. */
static inline __attribute__((always_inline)) void scaled_rows(int R, const RoundedGroups *x, int64_t g, int64_t groups,
                                                             __m256i lo, __m256i hi, float scale[][8], int j,
                                                             __m256 *acc) {
    for (int r = 0; r < R; ++r) {
        const __m256i *q = (const __m256i *)(x->q + (r * groups + g) * GROUP);
        const __m256i sums = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_load_si256(q)),
                                              _mm256_madd_epi16(hi, _mm256_load_si256(q + 1)));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_broadcast_ss(&scale[r][j]), acc[r]);
    }
}

/* Half n of a Q6_K super-block (groups 4 n .. 4 n + 3, see q6_k_group), its 96
 * bytes loaded once: group c's 32 values q (0..63) as bytes in bytes[c]. */
static inline __attribute__((always_inline)) void q6_k_half_bytes(const uint8_t *block, int n, __m256i bytes[4]) {
    const uint8_t *ql = block + 64 * n, *qh = block + 128 + 32 * n;
    const __m256i first = _mm256_loadu_si256((const __m256i *)ql);
    const __m256i second = _mm256_loadu_si256((const __m256i *)(ql + 32));
    const __m256i high = _mm256_loadu_si256((const __m256i *)qh);
    const __m256i nibble = _mm256_set1_epi8(15), pair = _mm256_set1_epi8(3);
    bytes[0] = _mm256_or_si256(_mm256_and_si256(first, nibble), _mm256_slli_epi16(_mm256_and_si256(high, pair), 4));
    bytes[1] = _mm256_or_si256(_mm256_and_si256(second, nibble),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2), pair), 4));
    bytes[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(first, 4), nibble),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 4), pair), 4));
    bytes[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(second, 4), nibble),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 6), pair), 4));
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

/* out[r * os] for one weight row and R rows of x (``groups`` groups each). Per
 * run of eight groups the weights' scales are unpacked once, each row's
 * group scales a * d and its offsets b . (d sum q) taken eight at a time (the
 * offsets into the even groups' accumulator); then
 * each group's integers, decoded once, meet every row (madd, one FMA). Even and
 * odd groups go to separate accumulators, to hide the FMA latency. Inlined into
 * chunk_rows with constant type and R. */
static inline __attribute__((always_inline)) void direct_rows(int type, int R, const uint8_t *row, int64_t groups,
                                                             const RoundedGroups *x, float *out, int64_t os) {
    __m256 even[DIRECT_MAX_ROWS], odd[DIRECT_MAX_ROWS];
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g += 8) {
        const int len = groups - g < 8 ? (int)(groups - g) : 8;
        prefetch_block_ahead(row + row_bytes(type, g * GROUP), (int)row_bytes(type, 8 * GROUP));
        float scale[DIRECT_MAX_ROWS][8] __attribute__((aligned(32)));
        const RunScales scales = run_scales(type, row, g, len);
        for (int r = 0; r < R; ++r) run_row_scales(type, x, r * groups + g, len, &scales, scale[r], &even[r]);
        for (int j = 0; j < len; j += 2) {
            __m256i v[4];
            if (type == TYPE_Q5_K) {
                k_pair_values(type, row + (g / 8) * row_bytes(type, 256), j, v);
            } else {
                weight_values(type, row, g + j, &v[0], &v[1]);
                if (j + 1 < len) weight_values(type, row, g + j + 1, &v[2], &v[3]);
            }
            scaled_rows(R, x, g + j, groups, v[0], v[1], scale, j, even);
            if (j + 1 < len) scaled_rows(R, x, g + j + 1, groups, v[2], v[3], scale, j + 1, odd);
        }
    }
    for (int r = 0; r < R; ++r) out[r * os] = hsum(_mm256_add_ps(even[r], odd[r]));
}

#if defined(BYTE_PRODUCTS) && !defined(QUANT_AVX512)
/* direct_rows for Q4_K, x in bytes: per super-block its scales and mins (a, b)
 * once, each row's eight group scales a * d and offsets b . (d sum q); then each
 * pair of groups' 32 bytes of nibbles, split once, meets every row: the group's
 * 32 weight integers u (0..15) against x's bytes (maddubs: pairs of products,
 * |sum| <= 2 * 15 * 127, exact; madd into 32 bits), one FMA. */
static inline __attribute__((always_inline)) void q4_k_byte_rows(int R, const uint8_t *row, int64_t groups,
                                                                const RoundedGroups *x, float *out, int64_t os) {
    const __m256i low_nibble = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256 even[DIRECT_MAX_ROWS], odd[DIRECT_MAX_ROWS];
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g += 8) {
        const uint8_t *block = row + (g / 8) * 144;
        prefetch_block_ahead(block, 144);
        const RunScales scales = run_scales(TYPE_Q4_K, row, g, 8);
        float scale[DIRECT_MAX_ROWS][8] __attribute__((aligned(32)));
        for (int r = 0; r < R; ++r) run_row_scales(TYPE_Q4_K, x, r * groups + g, 8, &scales, scale[r], &even[r]);
        for (int j = 0; j < 8; j += 2) {
            const __m256i pair = _mm256_loadu_si256((const __m256i *)(block + 16 + 16 * j));
            const __m256i u[2] = {_mm256_and_si256(pair, low_nibble),
                                  _mm256_and_si256(_mm256_srli_epi16(pair, 4), low_nibble)};
            for (int r = 0; r < R; ++r) {
                const int8_t *q = x->q8 + (r * groups + g + j) * GROUP;
                const __m256i first = _mm256_madd_epi16(
                    _mm256_maddubs_epi16(u[0], _mm256_loadu_si256((const __m256i *)q)), ones);
                const __m256i second = _mm256_madd_epi16(
                    _mm256_maddubs_epi16(u[1], _mm256_loadu_si256((const __m256i *)(q + GROUP))), ones);
                even[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(first), _mm256_broadcast_ss(&scale[r][j]), even[r]);
                odd[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(second), _mm256_broadcast_ss(&scale[r][j + 1]), odd[r]);
            }
        }
    }
    for (int r = 0; r < R; ++r) out[r * os] = hsum(_mm256_add_ps(even[r], odd[r]));
}

/* direct_rows for Q6_K, x in bytes. A group's value is a * d * sum over its
 * halves h of s_h * sum (u - 32) q, u the weights' 6-bit integers (0..63), s_h
 * their per-16 scales, a the super-block's scale: the products u . q as bytes
 * (maddubs: |pair| <= 2 * 63 * 127), madd'ed with the halves' scales; the bias
 * -32 * sum_h s_h * (sum of q over half h) from x's half sums, eight groups in
 * one madd per super-block. */
static inline __attribute__((always_inline)) void q6_k_byte_rows(int R, const uint8_t *row, int64_t groups,
                                                                const RoundedGroups *x, float *out, int64_t os) {
    __m256 even[DIRECT_MAX_ROWS], odd[DIRECT_MAX_ROWS];
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g += 8) {
        const uint8_t *block = row + (g / 8) * 210;
        prefetch_block_ahead(block, 210);
        const __m256 a = _mm256_set1_ps(f16_at(block + 208)), bias = _mm256_set1_ps(-32.0f);
        const __m256i all_scales = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(block + 192)));
        float scale[DIRECT_MAX_ROWS][8] __attribute__((aligned(32)));
        for (int r = 0; r < R; ++r) {
            const int64_t i = r * groups + g;
            const __m256 scales = _mm256_mul_ps(a, _mm256_loadu_ps(x->d + i));
            _mm256_store_ps(scale[r], scales);
            const __m256i halves = _mm256_madd_epi16(all_scales, _mm256_loadu_si256((const __m256i *)(x->half_q + 2 * i)));
            even[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(halves), _mm256_mul_ps(bias, scales), even[r]);
        }
        for (int n = 0; n < 2; ++n) {
            __m256i bytes[4];
            q6_k_half_bytes(block, n, bytes);
            /* the half's eight scales as 16-bit integers, in both 128-bit lanes */
            const __m256i half_scales = _mm256_broadcastsi128_si256(
                _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(block + 192 + 8 * n))));
            for (int c = 0; c < 4; ++c) {
                /* values 0..15 (the low 128-bit lane of the products) take scale 2 c, 16..31 scale 2 c + 1 */
                const __m256i pick = _mm256_setr_m128i(_mm_set1_epi16((short)((4 * c + 1) << 8 | 4 * c)),
                                                       _mm_set1_epi16((short)((4 * c + 3) << 8 | (4 * c + 2))));
                const __m256i group_scales = _mm256_shuffle_epi8(half_scales, pick);
                for (int r = 0; r < R; ++r) {
                    const int8_t *q = x->q8 + (r * groups + g + 4 * n + c) * GROUP;
                    const __m256i sums = _mm256_madd_epi16(
                        _mm256_maddubs_epi16(bytes[c], _mm256_loadu_si256((const __m256i *)q)), group_scales);
                    __m256 *acc = (c & 1) ? odd : even;
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_broadcast_ss(&scale[r][4 * n + c]), acc[r]);
                }
            }
        }
    }
    for (int r = 0; r < R; ++r) out[r * os] = hsum(_mm256_add_ps(even[r], odd[r]));
}

#endif

#ifdef QUANT_AVX512
#include "quant_direct_avx512.h"
#include "quant_tiles_avx512.h"
#include "quant_byte_tiles_avx512.h"
#define DIRECT_ROWS direct_rows_512
#define Q4_K_BYTE_ROWS q4_k_byte_rows_512
#define Q6_K_BYTE_ROWS q6_k_byte_rows_512
#else
#include "quant_byte_tiles_avx2.h"
#define DIRECT_ROWS direct_rows
#define Q4_K_BYTE_ROWS q4_k_byte_rows
#define Q6_K_BYTE_ROWS q6_k_byte_rows
#endif

/* Weight rows first .. end - 1 against a chunk of R rows of x (R <= DIRECT_MAX_ROWS): the
 * byte rows for Q4_K and Q6_K where the build multiplies bytes, else DIRECT_ROWS.
 * Inlined with a constant type and R into row_products: the loop over weight rows
 * holds one kernel, whose constants stay in registers across it (with the four
 * kernels of R = 1..4 in one loop, GCC kept all their constants there and
 * spilled the accumulators: Q5_K and Q8_0 rows 1.2-1.4x slower). */
static inline __attribute__((always_inline)) void chunk_rows(int type, int R, const uint8_t *weight, int64_t stride,
                                                            int64_t first, int64_t end, int64_t groups,
                                                            const RoundedGroups *x, float *out, int64_t os) {
    for (int64_t c = first; c < end; ++c) {
        const uint8_t *row = weight + c * stride;
        if (!byte_decode_rows(type)) DIRECT_ROWS(type, R, row, groups, x, out + c, os);
        else if (type == TYPE_Q4_K) Q4_K_BYTE_ROWS(R, row, groups, x, out + c, os);
        else Q6_K_BYTE_ROWS(R, row, groups, x, out + c, os);
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

#if DIRECT_MAX_ROWS
/* Chunk j of x's rounded rows: rows 4 j .. 4 j + 3, a view into ``rounded``. */
static inline RoundedGroups chunk_of(const RoundedGroups *rounded, int64_t groups, int64_t j) {
    const int64_t first = j * DIRECT_MAX_ROWS * groups;
    const RoundedGroups chunk = {rounded->q + first * GROUP, rounded->d + first, rounded->scaled_sum + first,
                                 rounded->half_sums ? rounded->half_sums + 2 * first : NULL,
                                 rounded->q8 ? rounded->q8 + first * GROUP : NULL,
                                 rounded->half_q ? rounded->half_q + 2 * first : NULL,
                                 rounded->step_sums ? rounded->step_sums + 2 * first : NULL, NULL};
    return chunk;
}
#endif

#if DIRECT_MAX_ROWS
/* Passes begin .. end - 1 of products_of_groups for one type, each row's kernel
 * inlined with its type and R constant: through a switch on the type and a call
 * per weight row the Q4_K products read 25% fewer bytes a second, and the
 * 32-value types' short rows lost as much to each row's setting up. */
static inline __attribute__((always_inline)) void type_products(int type, const uint8_t *weight, int64_t stride,
                                                               int64_t n, int64_t groups,
                                                               const RoundedGroups *rounded, int64_t m,
                                                               int64_t pass, int64_t begin, int64_t end,
                                                               float *out, int64_t out_stride) {
    const int64_t num_chunks = (m + DIRECT_MAX_ROWS - 1) / DIRECT_MAX_ROWS;
    for (int64_t p = begin; p < end; ++p) {
        const int64_t first = p * pass, last = first + pass < n ? first + pass : n;
        for (int64_t j = 0; j < num_chunks; ++j) {
            const RoundedGroups chunk = chunk_of(rounded, groups, j);
            const int64_t rows = m - j * DIRECT_MAX_ROWS < DIRECT_MAX_ROWS ? m - j * DIRECT_MAX_ROWS : DIRECT_MAX_ROWS;
            float *chunk_out = out + j * DIRECT_MAX_ROWS * out_stride;
            switch (rows) {
            case 1: chunk_rows(type, 1, weight, stride, first, last, groups, &chunk, chunk_out, out_stride); break;
            case 2: chunk_rows(type, 2, weight, stride, first, last, groups, &chunk, chunk_out, out_stride); break;
            case 3: chunk_rows(type, 3, weight, stride, first, last, groups, &chunk, chunk_out, out_stride); break;
            default: chunk_rows(type, 4, weight, stride, first, last, groups, &chunk, chunk_out, out_stride); break;
            }
        }
    }
}

/* One thread's share of products_of_groups. Its own function, not the parallel
 * region's body: GCC outlines a region before it inlines, so a type constant at
 * the region's call site would be a variable inside it. */
static void thread_products(int type, const uint8_t *weight, int64_t stride, int64_t n, int64_t groups,
                            const RoundedGroups *rounded, int64_t m, int64_t pass, int64_t begin, int64_t end,
                            float *out, int64_t out_stride) {
#define TYPE_PRODUCTS(TYPE) type_products(TYPE, weight, stride, n, groups, rounded, m, pass, begin, end, out, out_stride)
    switch (type) {
    case TYPE_Q8_0: TYPE_PRODUCTS(TYPE_Q8_0); break;
    case TYPE_Q4_0: TYPE_PRODUCTS(TYPE_Q4_0); break;
    case TYPE_Q4_1: TYPE_PRODUCTS(TYPE_Q4_1); break;
    case TYPE_Q5_0: TYPE_PRODUCTS(TYPE_Q5_0); break;
    case TYPE_Q5_1: TYPE_PRODUCTS(TYPE_Q5_1); break;
    case TYPE_Q2_K: TYPE_PRODUCTS(TYPE_Q2_K); break;
    case TYPE_Q3_K: TYPE_PRODUCTS(TYPE_Q3_K); break;
    case TYPE_Q4_K: TYPE_PRODUCTS(TYPE_Q4_K); break;
    case TYPE_Q5_K: TYPE_PRODUCTS(TYPE_Q5_K); break;
    case TYPE_Q6_K: TYPE_PRODUCTS(TYPE_Q6_K); break;
    case TYPE_IQ4_NL: TYPE_PRODUCTS(TYPE_IQ4_NL); break;
    case TYPE_IQ4_XS: TYPE_PRODUCTS(TYPE_IQ4_XS); break;
    default: break;
    }
#undef TYPE_PRODUCTS
}
#endif

/* x's rows rounded as round_group says, then multiplied in integers, in chunks
 * of DIRECT_MAX_ROWS rows. Up to DIRECT_CHUNKED_MAX_ROWS rows a weight row, read
 * from memory once, serves every chunk from L1; past them (the rows-apart
 * products below) a pass of WEIGHT_ROWS_PER_PASS weight rows meets each chunk in
 * turn, so that the pass stays in L1 while x's chunks stream. A row's value
 * depends only on its own integers: the same in any chunk, alone or not. */
#define WEIGHT_ROWS_PER_PASS 16
static int products_of_groups(int type, const uint8_t *weight, int64_t stride, int64_t n, int64_t k,
                              const float *x, int64_t m, int64_t x_stride, float *out, int64_t out_stride) {
#if DIRECT_MAX_ROWS
    RoundedGroups rounded = round_rows(type, x, m, x_stride, k, decode_in_pairs(type));
    if (rounded.q == NULL) return -2;
    const int64_t groups = k / GROUP, pass = m <= DIRECT_CHUNKED_MAX_ROWS ? 1 : WEIGHT_ROWS_PER_PASS;
    const int64_t num_passes = (n + pass - 1) / pass;
    #pragma omp parallel if (m * n * k >= PARALLEL_MIN_MACS)
    {
        /* contiguous shares, as schedule(static) would give */
        const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
        const int64_t share = num_passes / threads, extra = num_passes % threads;
        const int64_t begin = thread * share + (thread < extra ? thread : extra);
        const int64_t end = begin + share + (thread < extra);
        thread_products(type, weight, stride, n, groups, &rounded, m, pass, begin, end, out, out_stride);
    }
    release_rows(&rounded);
    return 0;
#else
    (void)type, (void)weight, (void)stride, (void)n, (void)k, (void)x, (void)m, (void)x_stride, (void)out,
        (void)out_stride;
    return -1;
#endif
}

#if DIRECT_MAX_ROWS
/* Bytes of x's rounded integers per call of products_of_groups in the rows-apart
 * products: a block of x that stays in L2 while every weight row meets it. */
#define ROWS_APART_BLOCK_BYTES (128 * 1024)

/* products_of_groups for any number of rows, x taken a block of rows at a time. */
static int products_rows_apart(int type, const uint8_t *weight, int64_t stride, int64_t n, int64_t k,
                               const float *x, int64_t m, int64_t x_stride, float *out, int64_t out_stride) {
    int64_t block = ROWS_APART_BLOCK_BYTES / (k * (int64_t)sizeof(int16_t));
    block -= block % DIRECT_MAX_ROWS;
    block = block < DIRECT_MAX_ROWS ? DIRECT_MAX_ROWS : block;
    for (int64_t first = 0; first < m; first += block) {
        const int64_t rows = m - first < block ? m - first : block;
        const int status = products_of_groups(type, weight, stride, n, k, x + first * x_stride, rows, x_stride,
                                              out + first * out_stride, out_stride);
        if (status) return status;
    }
    return 0;
}
#endif

#ifdef BYTE_PRODUCTS
/* Many rows, a type whose x is in bytes: byte tiles (quant_byte_tiles_avx2.h, quant_byte_tiles_avx512.h). */
static int products_of_byte_tiles(int type, const uint8_t *weight, int64_t stride, int64_t n, int64_t k,
                                  const float *x, int64_t m, int64_t x_stride, float *out, int64_t out_stride) {
    RoundedGroups rounded = round_rows(type, x, m, x_stride, k, 0);
    if (rounded.q == NULL) return -2;
    const int64_t groups = k / GROUP, num_panels = (n + BYTE_PANEL_ROWS - 1) / BYTE_PANEL_ROWS;
    int failed = 0;
    #pragma omp parallel for schedule(static) if (m * n * k >= PARALLEL_MIN_MACS)
    for (int64_t t = 0; t < num_panels; ++t) {
        void *buffer = thread_tile(byte_panel_bytes(groups) / (int64_t)sizeof(float));
        if (buffer == NULL) {
            failed = 1;
            continue;
        }
        const int64_t first = t * BYTE_PANEL_ROWS, rows = n - first < BYTE_PANEL_ROWS ? n - first : BYTE_PANEL_ROWS;
        multiply_byte_panel(type, weight + first * stride, stride, rows, groups, &rounded, m, buffer, out + first,
                            out_stride);
    }
    release_rows(&rounded);
    return failed ? -2 : 0;
}
#endif

#ifdef QUANT_AVX512
/* Many rows with AVX-512: integer tiles (quant_tiles_avx512.h), byte tiles for the byte types. */
static int products_of_tiles(int type, const uint8_t *weight, int64_t stride, int64_t n, int64_t k,
                             const float *x, int64_t m, int64_t x_stride, float *out, int64_t out_stride) {
    if (byte_activations(type))
        return products_of_byte_tiles(type, weight, stride, n, k, x, m, x_stride, out, out_stride);
    RoundedGroups rounded = round_rows(type, x, m, x_stride, k, 0);
    if (rounded.q == NULL) return -2;
    const int64_t groups = k / GROUP, num_tiles = (n + INT_TILE_ROWS - 1) / INT_TILE_ROWS;
    int failed = 0;
    #pragma omp parallel for schedule(static) if (m * n * k >= PARALLEL_MIN_MACS)
    for (int64_t t = 0; t < num_tiles; ++t) {
        float *buffer = thread_tile(int_tile_bytes(groups) / (int64_t)sizeof(float));
        if (buffer == NULL) {
            failed = 1;
            continue;
        }
        IntTile tile = int_tile_at(buffer, groups);
        const int64_t first = t * INT_TILE_ROWS, rows = n - first < INT_TILE_ROWS ? n - first : INT_TILE_ROWS;
        decode_int_tile(type, weight + first * stride, stride, rows, groups, &tile);
        multiply_int_tile(type, &tile, groups, &rounded, m, rows, out + first, out_stride);
    }
    release_rows(&rounded);
    return failed ? -2 : 0;
}
#else
static int products_of_tiles(int type, const uint8_t *weight, int64_t stride, int64_t n, int64_t k,
                             const float *x, int64_t m, int64_t x_stride, float *out, int64_t out_stride) {
#ifdef BYTE_PRODUCTS
    if (byte_activations(type))
        return products_of_byte_tiles(type, weight, stride, n, k, x, m, x_stride, out, out_stride);
#endif
    float *rounded = malloc((size_t)(m * k) * sizeof(float));
    if (rounded == NULL) return -2;
    rounded_rows(type, x, m, x_stride, k, rounded);
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
#endif

/* out [m, n] (row stride out_stride) = x [m, k] (row stride x_stride) @ W^T, W being
 * n rows of k values in ``type`` blocks at ``weight``, x rounded per group of 32
 * (see "activations"). Returns 0, -1 for a type or k it cannot take, -2 when a
 * buffer cannot be allocated. */
int quant_matmul(int type, const uint8_t *weight, int64_t n, int64_t k, const float *x, int64_t m,
                 int64_t x_stride, float *out, int64_t out_stride) {
    const int64_t stride = row_bytes(type, k);
    if (stride < 0 || k % (SUPER_BLOCK_TYPE(type) ? 256 : GROUP)) return -1;
    if (m == 0 || n == 0) return 0;
    if (m <= DIRECT_MAX_ROWS || (m <= DIRECT_CHUNKED_MAX_ROWS && m * k <= DIRECT_CHUNKED_MAX_VALUES))
        return products_of_groups(type, weight, stride, n, k, x, m, x_stride, out, out_stride);
    return products_of_tiles(type, weight, stride, n, k, x, m, x_stride, out, out_stride);
}

/* quant_matmul with every row's value independent of the rows beside it, at any
 * number of rows (the batch-invariant mode): the integer path for all of them
 * where the build has one (AVX2, AVX-512), else the portable tiles, which
 * compute each row alone already. The same value a row has in quant_matmul
 * where that takes the integer path: alone, as a decode step. */
int quant_matmul_rows_apart(int type, const uint8_t *weight, int64_t n, int64_t k, const float *x, int64_t m,
                            int64_t x_stride, float *out, int64_t out_stride) {
#if DIRECT_MAX_ROWS
    const int64_t stride = row_bytes(type, k);
    if (stride < 0 || k % (SUPER_BLOCK_TYPE(type) ? 256 : GROUP)) return -1;
    if (m == 0 || n == 0) return 0;
    return products_rows_apart(type, weight, stride, n, k, x, m, x_stride, out, out_stride);
#else
    return quant_matmul(type, weight, n, k, x, m, x_stride, out, out_stride);
#endif
}

/* Rows of x up to which quant_matmul takes the integer path; from one more,
 * every row's value is the one it has in any larger product. */
int quant_direct_max_rows(void) { return DIRECT_CHUNKED_MAX_ROWS; }

/* The peak of the integer products' instruction on one core, for the benchmarks:
 * ``iterations`` rounds of 12 independent 16-bit dot products of 512 bits (or of
 * the AVX2 build's madd + add), 32 (AVX-512) or 16 (AVX2) multiply-adds each, all
 * in registers (AVX2's 16 hold the sums; its weights come from L1). Returns the
 * multiply-adds done (0 where the build has neither). */
int64_t quant_int16_peak_macs(int64_t iterations) {
#if defined(QUANT_AVX512)
    /* A weight vector of its own for each accumulator: with one for all, the
     * compiler computes madd(w, q) once where dot_words is madd + add (no VNNI). */
    __m512i acc[12], w[12];
    __m512i q = _mm512_set1_epi16(5);
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_epi32(i), w[i] = _mm512_set1_epi16((short)(3 + i));
    for (int64_t n = 0; n < iterations; ++n) {
        #pragma GCC unroll 12
        for (int i = 0; i < 12; ++i) acc[i] = dot_words(acc[i], w[i], q);
        __asm__ volatile("" : "+v"(q)); /* keeps the loop from being folded */
    }
    int32_t total = 0;
    for (int i = 0; i < 12; ++i) total += _mm512_reduce_add_epi32(acc[i]);
    __asm__ volatile("" ::"r"(total));
    return iterations * 12 * 32;
#elif defined(QUANT_AVX2)
    __m256i acc[12], w[12]; /* a weight vector each, as above (one was computed once) */
    __m256i q = _mm256_set1_epi16(5);
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_epi32(i), w[i] = _mm256_set1_epi16((short)(3 + i));
    for (int64_t n = 0; n < iterations; ++n) {
        #pragma GCC unroll 12
        for (int i = 0; i < 12; ++i) acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(w[i], q));
        __asm__ volatile("" : "+x"(q));
    }
    int32_t lanes[8], total = 0;
    for (int i = 0; i < 12; ++i) {
        _mm256_storeu_si256((__m256i *)lanes, acc[i]);
        for (int j = 0; j < 8; ++j) total += lanes[j];
    }
    __asm__ volatile("" ::"r"(total));
    return iterations * 12 * 16;
#else
    (void)iterations;
    return 0;
#endif
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

#pragma GCC pop_options
