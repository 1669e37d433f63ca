/* The decoder layer's elementwise steps, each one pass over its rows.
 *
 * PyTorch runs each of these as several kernels (RMSNorm alone: to float,
 * norm, back, times weight), each with its own dispatch and memory pass;
 * at 64 decode rows that costs more than the arithmetic. Every function
 * rounds where the unfused PyTorch code rounds (to the element type after
 * each operation PyTorch does in that type), so results match it up to
 * the order of the float32 sums.
 *
 *     add_rms_norm   residual += x (optional); out = weight * norm(residual)
 *     rotary         q and k rotated in place (rotate-half layout; the first R of each head)
 *     head_rms_norm  q or k normed in place per head (or over the whole projection)
 *     silu_mul       out = silu(gate) * up, from the fused [T, 2I] projection
 *     gelu_tanh_mul  out = gelu_tanh(gate) * up (Gemma's GeGLU)
 *
 * and, for float32 only, a mixture of experts' routing (Qwen3-MoE):
 *
 *     linear_f32       out = x @ W^T for a float32 W (the router's product)
 *     moe_route_f32    each token's k experts and weights from its router logits
 *     moe_combine_f32  out[t] = the weighted sum of its experts' outputs, in pick order
 *
 * and each row's argmax (argmax_rows_f32: a greedy step's token from its logits).
 *
 * The module path (cadence/models/moe.py) and the one-call decoder
 * (decoder_stack.c) both call these three, so the two agree to the bit.
 *
 * Rows are split over OpenMP threads when there are enough of them; loaded
 * after torch, this library shares torch's libgomp and thread count.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* Elements below which a call stays on one thread (waking threads costs more). */
#define PARALLEL_MIN_ELEMENTS (1 << 16)

/* The MLP's activations, in float32. */
static inline float silu(float g) {
    /* The reciprocal apart: written as g / (1 + e), gcc keeps a slow divide (3x the time). */
    return g * (1.0f / (1.0f + exp_approx(-g)));
}

/* gelu_tanh(g) = g/2 (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g^3), as g * sigmoid(2u). */
static inline float gelu_tanh(float g) {
    float u = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    return g * (1.0f / (1.0f + exp_approx(-2.0f * u)));
}

#define PASTE(a, b) a##_##b
#define EXPAND_PASTE(a, b) PASTE(a, b)
#define NAME(name) EXPAND_PASTE(name, SUFFIX)

#define SUFFIX f32
#define ELEM float
#define LOAD(x) (x)
#define STORE(x) (x)
#include "fused_ops_impl.h"
#undef SUFFIX
#undef ELEM
#undef LOAD
#undef STORE

#define SUFFIX bf16
#define ELEM uint16_t
#define LOAD(x) bf16_to_float(x)
#define STORE(x) float_to_bf16(x)
#include "fused_ops_impl.h"
#undef SUFFIX
#undef ELEM
#undef LOAD
#undef STORE

/* out [rows, n] = x [rows, k] @ W^T for a float32 W [n, k] (row strides k and
 * n): the router's product. Each dot product sums in one order the compiler
 * fixes, whatever the rows or threads. */
void linear_f32(const float *x, int64_t rows, int64_t k, const float *weight, int64_t n, float *out) {
    #pragma omp parallel for schedule(static) if (rows * n * k >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < rows; ++t)
        for (int64_t j = 0; j < n; ++j) {
            const float *a = x + t * k, *w = weight + j * k;
            float sum = 0.0f;
            for (int64_t i = 0; i < k; ++i) sum += a[i] * w[i];
            out[t * n + j] = sum;
        }
}

/* Each row of router logits [rows, E] -> its k experts, best first:
 * probabilities = softmax(logits) in float32 (exp(l - max) / sum); the k
 * largest, a tie going to the lower expert id (torch.topk names no order
 * for ties: one rule, for both decode paths); ids [rows, k] and weights
 * [rows, k] = their probabilities, with
 * ``normalize`` divided by the sum of the k (summed in pick order). */
void moe_route_f32(const float *logits, int64_t rows, int64_t E, int64_t k, int normalize, float *weights,
                   int64_t *ids) {
    for (int64_t t = 0; t < rows; ++t) {
        const float *l = logits + t * E;
        float p[E];
        unsigned char taken[E];
        float max = l[0];
        for (int64_t e = 1; e < E; ++e)
            if (l[e] > max) max = l[e];
        float sum = 0.0f;
        for (int64_t e = 0; e < E; ++e) {
            p[e] = expf(l[e] - max);
            sum += p[e];
            taken[e] = 0;
        }
        for (int64_t e = 0; e < E; ++e) p[e] = p[e] / sum;
        float *w = weights + t * k;
        int64_t *id = ids + t * k;
        for (int64_t j = 0; j < k; ++j) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; ++e)
                if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
            taken[best] = 1;
            id[j] = best;
            w[j] = p[best];
        }
        if (normalize) {
            float total = 0.0f;
            for (int64_t j = 0; j < k; ++j) total += w[j];
            for (int64_t j = 0; j < k; ++j) w[j] = w[j] / total;
        }
    }
}

/* out [rows, H] = for each token t, sum over its picks j = 0..k-1 in order of
 * weights[t, j] * outs[pair_rows[t k + j]], outs [pairs, H] being each
 * (token, expert) pair's expert output in whatever order the experts ran. */
void moe_combine_f32(const float *outs, const int64_t *pair_rows, const float *weights, int64_t rows, int64_t k,
                     int64_t H, float *out) {
    #pragma omp parallel for schedule(static) if (rows * k * H >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < rows; ++t) {
        float *dst = out + t * H;
        const float *first = outs + pair_rows[t * k] * H;
        const float w0 = weights[t * k];
        for (int64_t i = 0; i < H; ++i) dst[i] = w0 * first[i];
        for (int64_t j = 1; j < k; ++j) {
            const float *y = outs + pair_rows[t * k + j] * H;
            const float w = weights[t * k + j];
            for (int64_t i = 0; i < H; ++i) dst[i] += w * y[i];
        }
    }
}

/* ---------------------------------------------------------------- argmax
 * Each row's index of its largest value, as torch.argmax gives it: the first
 * of equal maxima (-0.0 equals 0.0), and the first NaN where a row has one.
 * PyTorch took 0.4 ms for one row of Gemma 3's 262,144 logits, one thread,
 * a scalar comparison per value; here a row is cut into chunks (tasks over
 * the threads), each chunk's maximum found in vectors and then its first
 * index, and the chunks merged in order. */

#define ARGMAX_CHUNK 16384

typedef struct {
    float value;
    int64_t index;
} ArgmaxPart;

/* The first NaN of x[begin, end) as the part, or a part with index -1 if none. */
static ArgmaxPart first_nan(const float *x, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
        if (x[i] != x[i]) return (ArgmaxPart){x[i], i};
    return (ArgmaxPart){0.0f, -1};
}

/* The largest value of x[begin, end) (not empty) and its first index. */
static ArgmaxPart chunk_argmax(const float *x, int64_t begin, int64_t end) {
    int64_t i = begin;
    float top;
#if defined(__AVX512F__)
    const __m512 lowest = _mm512_set1_ps(-INFINITY);
    __m512 tops = lowest;
    __mmask16 unordered = 0;
    for (; i + 16 <= end; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        tops = _mm512_max_ps(tops, v);
    }
    if (i < end) {
        const __m512 v = _mm512_mask_loadu_ps(lowest, (__mmask16)((1u << (end - i)) - 1), x + i);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        tops = _mm512_max_ps(tops, v);
    }
    if (unordered) return first_nan(x, begin, end);
    top = _mm512_reduce_max_ps(tops);
    const __m512 wanted = _mm512_set1_ps(top);
    for (i = begin; i + 16 <= end; i += 16) {
        const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), wanted, _CMP_EQ_OQ);
        if (hit) return (ArgmaxPart){top, i + __builtin_ctz(hit)};
    }
#elif defined(__AVX2__)
    __m256 tops = _mm256_set1_ps(-INFINITY);
    int unordered = 0;
    for (; i + 8 <= end; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        unordered |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        tops = _mm256_max_ps(tops, v);
    }
    if (unordered) return first_nan(x, begin, end);
    float lanes[8];
    _mm256_storeu_ps(lanes, tops);
    top = lanes[0];
    for (int l = 1; l < 8; ++l) top = lanes[l] > top ? lanes[l] : top;
    for (int64_t j = i; j < end; ++j) { /* the tail, past the vectors */
        if (x[j] != x[j]) return first_nan(x, begin, end);
        top = x[j] > top ? x[j] : top;
    }
    const __m256 wanted = _mm256_set1_ps(top);
    for (i = begin; i + 8 <= end; i += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), wanted, _CMP_EQ_OQ));
        if (hit) return (ArgmaxPart){top, i + __builtin_ctz((unsigned)hit)};
    }
#else
    top = x[begin];
    for (; i < end; ++i) {
        if (x[i] != x[i]) return (ArgmaxPart){x[i], i};
        top = x[i] > top ? x[i] : top;
    }
    i = begin;
#endif
    for (; i < end; ++i)
        if (x[i] == top) return (ArgmaxPart){top, i};
    return (ArgmaxPart){top, begin}; /* not reached: top is one of the values */
}

/* out[r] = the argmax of row r of x [rows, n] (row stride ``stride``), n >= 1.
 * Returns 0, or -2 without memory for the chunks' parts. */
int argmax_rows_f32(const float *x, int64_t rows, int64_t n, int64_t stride, int64_t *out) {
    const int64_t chunks = (n + ARGMAX_CHUNK - 1) / ARGMAX_CHUNK, tasks = rows * chunks;
    ArgmaxPart *parts = malloc(sizeof(ArgmaxPart) * (size_t)(tasks > 0 ? tasks : 1));
    if (parts == NULL) return -2;
    #pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < tasks; ++t) {
        const int64_t r = t / chunks, begin = (t % chunks) * ARGMAX_CHUNK;
        const int64_t end = begin + ARGMAX_CHUNK < n ? begin + ARGMAX_CHUNK : n;
        parts[t] = chunk_argmax(x + r * stride, begin, end);
    }
    for (int64_t r = 0; r < rows; ++r) {
        ArgmaxPart best = parts[r * chunks];
        for (int64_t c = 1; c < chunks && best.value == best.value; ++c) { /* a NaN stays */
            const ArgmaxPart part = parts[r * chunks + c];
            if (part.value != part.value || part.value > best.value) best = part;
        }
        out[r] = best.index;
    }
    free(parts);
    return 0;
}
