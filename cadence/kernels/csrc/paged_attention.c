/* Attention of short queries (decodes, speculative verification) straight
 * over the paged KV cache, on the CPU.
 *
 * The PyTorch path gathers every sequence's blocks into a padded tensor and
 * calls scaled_dot_product_attention; for a decode that is a copy of the
 * whole context per layer plus one tiny GEMM per (sequence, head). Here each
 * (sequence, KV head) pair is one task that reads its keys and values where
 * they lie, once, for all the query heads of its group:
 *
 *     for each visible key position p (block_table[p / bs], slot p % bs):
 *         score[r][p] = q[r] . k[p] * scale      for each query row r of the group
 *         (soft-capped, Gemma 2's: cap * tanh(score / cap))
 *     softmax of each row over the keys it may see
 *     out[r] = sum_p score[r][p] * v[p]
 *
 * Query row r = j * G + g is query token j (position seq_len - q_len + j) of
 * head h * G + g; it sees keys max(0, pos - window + 1) .. pos. Keys and
 * values are float32, bfloat16 or float16 (widened to float32 as they are
 * read); sums are float32.
 *
 * Tasks run on OpenMP threads. Loaded after torch, this library shares
 * torch's libgomp (same soname), so it uses torch's threads and thread count.
 *
 * Layouts (all contiguous):
 *     q, out        [T, Hq, D]
 *     k/v cache     [num_blocks, block_size, Hkv, D]
 *     block_table   [S, max_blocks] int32
 *     query_start, query_len, seq_len   [S] int64
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

/* Tokens ahead whose keys (values) are prefetched. */
#define PREFETCH_AHEAD 8

typedef struct {
    int64_t num_seqs;
    int num_heads;
    int num_kv_heads;
    int head_dim;
    int block_size;
    int max_blocks;
    int sliding_window; /* 0: none */
    float scale;
    float softcap; /* 0: none */
} AttentionShape;

typedef struct {
    const int64_t *query_start;
    const int64_t *query_len;
    const int64_t *seq_len;
    const int32_t *block_table;
} SequenceIndex;

static inline float dot(const float *a, const float *b, int n) {
    float sum = 0.0f;
    for (int i = 0; i < n; ++i) sum += a[i] * b[i];
    return sum;
}

static inline void add_scaled(float *acc, const float *x, float w, int n) {
    for (int i = 0; i < n; ++i) acc[i] += w * x[i];
}

/* The first key row r may see (its last is its own position). */
static inline int64_t first_visible(int64_t position, int sliding_window) {
    if (sliding_window <= 0) return 0;
    int64_t first = position - sliding_window + 1;
    return first > 0 ? first : 0;
}

/* A score soft-capped (cap > 0) as Gemma 2 caps them: cap * tanh(score / cap). */
static inline float soft_cap(float score, float cap) {
    return cap > 0.0f ? cap * tanhf(score / cap) : score;
}

/* In place: row[lo:hi] = softmax(row[lo:hi]). */
static inline void softmax(float *row, int64_t lo, int64_t hi) {
    float max = row[lo], sum = 0.0f;
    for (int64_t i = lo + 1; i < hi; ++i) max = row[i] > max ? row[i] : max;
    for (int64_t i = lo; i < hi; ++i) {
        row[i] = exp_approx(row[i] - max);
        sum += row[i];
    }
    float inverse = 1.0f / sum;
    for (int64_t i = lo; i < hi; ++i) row[i] *= inverse;
}

/* Floats of scratch sequence s needs: query rows, accumulators, scores, one token. */
static int64_t work_floats(const AttentionShape *shape, const SequenceIndex *seqs, int64_t s) {
    int64_t rows = seqs->query_len[s] * shape->num_heads;
    int64_t first_pos = seqs->seq_len[s] - seqs->query_len[s];
    int64_t span = seqs->seq_len[s] - first_visible(first_pos, shape->sliding_window);
    int64_t token = (int64_t)shape->num_kv_heads * shape->head_dim;
    return rows * (2 * (int64_t)shape->head_dim + span) + token;
}

/* One copy of the kernel per (query, cache) element type pair:
 * paged_attention_f32 and _bf16 (cache in the model's dtype), and
 * paged_attention_f32_kvf16, _f32_kvbf16 and _f32_kvq8_0 (a float32 model
 * over a half-width or q8_0 cache, --kv-cache-dtype). */
#define PASTE(a, b) a##_##b
#define EXPAND_PASTE(a, b) PASTE(a, b)
#define NAME(name) EXPAND_PASTE(name, SUFFIX)

#define SUFFIX f32
#define ELEM float
#define LOAD(x) (x)
#define STORE(x) (x)
#define KV_ROW_ELEMS(n) (n)
#define KV_ELEM float
#define KV_IS_FLOAT 1
#include "paged_attention_impl.h"
#undef SUFFIX
#undef KV_ELEM
#undef KV_IS_FLOAT

#define SUFFIX f32_kvf16
#define KV_ELEM uint16_t
#define KV_IS_FLOAT 0
#define KV_ROW_TO_FLOAT f16_row_to_float
#include "paged_attention_impl.h"
#undef SUFFIX
#undef KV_ROW_TO_FLOAT

#define SUFFIX f32_kvbf16
#define KV_ROW_TO_FLOAT bf16_row_to_float
#include "paged_attention_impl.h"
#undef SUFFIX
#undef KV_ROW_TO_FLOAT

#undef KV_ELEM
#undef KV_ROW_ELEMS
#define SUFFIX f32_kvq8_0
#define KV_ELEM uint8_t
#define KV_ROW_ELEMS(n) ((n) / Q8_0_VALUES * Q8_0_BYTES)
#define KV_ROW_TO_FLOAT q8_0_row_to_float
#include "paged_attention_impl.h"
#undef SUFFIX
#undef KV_ELEM
#undef KV_ROW_ELEMS
#undef KV_ROW_TO_FLOAT
#undef ELEM
#undef LOAD
#undef STORE

#define SUFFIX bf16
#define KV_ELEM uint16_t
#define KV_ROW_ELEMS(n) (n)
#define KV_ROW_TO_FLOAT bf16_row_to_float
#define ELEM uint16_t
#define LOAD(x) bf16_to_float(x)
#define STORE(x) float_to_bf16(x)
#include "paged_attention_impl.h"
