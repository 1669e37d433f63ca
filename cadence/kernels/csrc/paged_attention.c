/* Attention of short queries (decodes, speculative verification) straight
 * over the paged KV cache, on the CPU.
 *
 * The PyTorch path gathers every sequence's blocks into a padded tensor and
 * calls scaled_dot_product_attention; for a decode that is a copy of the
 * whole context per layer plus one tiny GEMM per (sequence, head). Here a
 * sequence's visible keys are cut at every multiple of KEY_CHUNK positions,
 * and each (sequence, chunk) is one task that reads its keys and values where
 * they lie, once, for all the query heads:
 *
 *     for each visible key position p of the chunk (block_table[p / bs], slot p % bs):
 *         score[r][p] = q[r] . k[p] * scale      for each query row r
 *         (soft-capped, Gemma 2's: cap * tanh(score / cap))
 *     m[r] = max of row r's scores, e[r][p] = exp(score[r][p] - m[r]), l[r] = sum of e[r]
 *     acc[r] = sum_p e[r][p] * v[p]
 *
 * and a sequence's chunks are then merged (M = max of the chunks' m):
 *     out[r] = sum_c e^(m_c - M) acc_c[r] / sum_c e^(m_c - M) l_c[r]
 *
 * So one long decode runs on every thread, and a batch of them keeps the
 * threads even. Keys go four at a time (groups at multiples of 4 positions):
 * four independent dot products per query row, and four value rows added to a
 * row's sum with one load and store of it. A row's result depends only on its
 * own visible keys: chunks and groups are placed by absolute position, a
 * group's keys that a row does not see weigh exactly 0, and the chunks merge
 * in order. A query row's value is therefore the same to the bit however its
 * prompt was chunked and whatever else is in the batch (the batch-invariant
 * mode relies on it).
 *
 * Query row r = j * Hq + h is query token j (position seq_len - q_len + j) of
 * head h; it sees keys max(0, pos - window + 1) .. pos. Keys and values are
 * float32, bfloat16, float16 or q8_0 (widened to float32 as they are read;
 * float16 in registers where the CPU has AVX-512, for up to four query heads
 * of a KV head at once); sums are float32.
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
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* Tokens ahead whose keys (values) are prefetched. */
#define PREFETCH_AHEAD 8
/* Key positions per task: a sequence's keys are cut at multiples of it. */
#define KEY_CHUNK 128
/* Keys read together: groups start at multiples of it. */
#define KEY_GROUP 4

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

/* s[t] = a . b[t] for the KEY_GROUP rows b[t]: independent sums, so each is
 * computed as it would be alone. */
static inline void dot_group(const float *a, const float *const *b, int n, float *s) {
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
    const float *b0 = b[0], *b1 = b[1], *b2 = b[2], *b3 = b[3];
    for (int i = 0; i < n; ++i) {
        s0 += a[i] * b0[i];
        s1 += a[i] * b1[i];
        s2 += a[i] * b2[i];
        s3 += a[i] * b3[i];
    }
    s[0] = s0, s[1] = s1, s[2] = s2, s[3] = s3;
}

/* acc += w[0] x[0] + ... + w[3] x[3]: one pass over acc for a group's rows. */
static inline void add_scaled_group(float *acc, const float *const *x, const float *w, int n) {
    const float *x0 = x[0], *x1 = x[1], *x2 = x[2], *x3 = x[3];
    const float w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
    for (int i = 0; i < n; ++i) acc[i] += (w0 * x0[i] + w1 * x1[i]) + (w2 * x2[i] + w3 * x3[i]);
}

/* The cache slot of key position p: slot p % bs of block block_table[p / bs]. */
static inline int64_t slot_of(const int32_t *blocks, int64_t p, const AttentionShape *shape) {
    const int bs = shape->block_size;
    return (int64_t)blocks[p / bs] * bs + p % bs;
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

/* In place: row[lo:hi] = exp(row[lo:hi] - max); returns the max, *sum gets the sum. */
static inline float exp_shifted(float *row, int64_t lo, int64_t hi, float *sum) {
    float max = row[lo], total = 0.0f;
    for (int64_t i = lo + 1; i < hi; ++i) max = row[i] > max ? row[i] : max;
    for (int64_t i = lo; i < hi; ++i) {
        row[i] = exp_approx(row[i] - max);
        total += row[i];
    }
    *sum = total;
    return max;
}

/* One task: a sequence's keys in [lo, hi), all inside one chunk; ``partial`` is
 * where its rows' max, sum and weighted values go ([rows] + [rows] + [rows, D]). */
typedef struct {
    int64_t seq, lo, hi, partial;
} AttentionTask;

/* The tasks of the S sequences, in order (a sequence's chunks in position
 * order); *count gets their number, *partial_floats the floats of all partials. */
static AttentionTask *attention_tasks(const AttentionShape *shape, const SequenceIndex *seqs,
                                      int64_t *count, int64_t *partial_floats) {
    int64_t n = 0, floats = 0;
    for (int64_t s = 0; s < shape->num_seqs; ++s) {
        int64_t start = first_visible(seqs->seq_len[s] - seqs->query_len[s], shape->sliding_window);
        n += (seqs->seq_len[s] - 1) / KEY_CHUNK - start / KEY_CHUNK + 1;
    }
    AttentionTask *tasks = (AttentionTask *)malloc(sizeof(AttentionTask) * (size_t)(n > 0 ? n : 1));
    n = 0;
    for (int64_t s = 0; s < shape->num_seqs; ++s) {
        int64_t rows = seqs->query_len[s] * shape->num_heads, end = seqs->seq_len[s];
        for (int64_t lo = first_visible(end - seqs->query_len[s], shape->sliding_window); lo < end;) {
            int64_t hi = (lo / KEY_CHUNK + 1) * KEY_CHUNK;
            tasks[n++] = (AttentionTask){s, lo, hi < end ? hi : end, floats};
            floats += rows * (2 + (int64_t)shape->head_dim);
            lo = hi;
        }
    }
    *count = n;
    *partial_floats = floats;
    return tasks;
}

/* Scratch floats of the task with the most query rows: its rows (pre-scaled
 * queries), scores, a group of key or value rows and a row of zeros. */
static int64_t work_floats(const AttentionShape *shape, const SequenceIndex *seqs) {
    int64_t rows = 0;
    for (int64_t s = 0; s < shape->num_seqs; ++s)
        rows = seqs->query_len[s] > rows ? seqs->query_len[s] : rows;
    rows *= shape->num_heads;
    return rows * ((int64_t)shape->head_dim + KEY_CHUNK) +
           (KEY_GROUP * (int64_t)shape->num_kv_heads + 1) * shape->head_dim;
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
#if defined(__AVX512F__) /* float16 keys and values read in place (paged_attention_impl.h) */
#define KV_DIRECT_F16 1
#endif
#include "paged_attention_impl.h"
#undef KV_DIRECT_F16
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
