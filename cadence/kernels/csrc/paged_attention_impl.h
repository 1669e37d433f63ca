/* The kernel of paged_attention.c, written once for a pair of element
 * types: the includer defines ELEM (the type of q and out), LOAD (ELEM ->
 * float), STORE (float -> ELEM), KV_ELEM (the type of the cache),
 * KV_IS_FLOAT (1 when KV_ELEM is float), KV_ROW_TO_FLOAT(dst, src, n) (n
 * cache values widened to float), KV_ROW_ELEMS(n) (the KV_ELEMs that hold n
 * values: n, or q8_0's bytes) and NAME(x) (x with the pair's suffix). */

/* dst[i] = src[i] * scale, as float. */
static inline void NAME(load_row)(float *dst, const ELEM *src, int n, float scale) {
    for (int i = 0; i < n; ++i) dst[i] = LOAD(src[i]) * scale;
}

/* The keys or values of one token, all KV heads: [Hkv * D] floats. Float
 * caches are read in place; others are converted into ``buffer``. */
static inline const float *NAME(token_row)(const KV_ELEM *cache, int64_t slot, int width,
                                           float *buffer) {
    const KV_ELEM *row = cache + slot * KV_ROW_ELEMS(width);
#if KV_IS_FLOAT
    (void)buffer;
    return (const float *)row;
#else
    KV_ROW_TO_FLOAT(buffer, row, width);
    return buffer;
#endif
}

/* Ask for token p's row ahead of use: rows of consecutive tokens lie in
 * different blocks at every block boundary, where the hardware cannot guess. */
static inline void NAME(prefetch_token)(const KV_ELEM *cache, const int32_t *blocks, int64_t p,
                                        int bs, int width) {
    const char *row = (const char *)(cache + ((int64_t)blocks[p / bs] * bs + p % bs) * KV_ROW_ELEMS(width));
    for (int64_t offset = 0; offset < (int64_t)(KV_ROW_ELEMS(width) * sizeof(KV_ELEM)); offset += 64)
        __builtin_prefetch(row + offset, 0, 3);
}

/* One sequence, all its heads. Always inlined, so a call with a constant
 * head_dim D compiles to fully unrolled vector loops. */
static inline __attribute__((always_inline)) void NAME(attend)(
        const ELEM *q, const KV_ELEM *k_cache, const KV_ELEM *v_cache, ELEM *out,
        const AttentionShape *shape, const SequenceIndex *seqs, int64_t s,
        float *work, const int D) {
    const int Hq = shape->num_heads, Hkv = shape->num_kv_heads, G = Hq / Hkv;
    const int bs = shape->block_size, width = Hkv * D;
    const int64_t q_len = seqs->query_len[s], seq_len = seqs->seq_len[s];
    const int64_t first_pos = seq_len - q_len; /* position of query token 0 */
    const int64_t key_start = first_visible(first_pos, shape->sliding_window);
    const int64_t span = seq_len - key_start, rows = q_len * Hq;
    const int32_t *blocks = seqs->block_table + s * shape->max_blocks;
    const ELEM *q_seq = q + seqs->query_start[s] * Hq * D;
    float *q_rows = work;              /* [rows, D], row j * Hq + head, pre-scaled */
    float *acc = q_rows + rows * D;    /* [rows, D] */
    float *scores = acc + rows * D;    /* [rows, span] */
    float *buffer = scores + rows * span; /* [Hkv * D] */
    NAME(load_row)(q_rows, q_seq, (int)(rows * D), shape->scale);

    for (int64_t p = key_start; p < seq_len; ++p) {
        int64_t slot = (int64_t)blocks[p / bs] * bs + p % bs;
        if (p + PREFETCH_AHEAD < seq_len) NAME(prefetch_token)(k_cache, blocks, p + PREFETCH_AHEAD, bs, width);
        const float *keys = NAME(token_row)(k_cache, slot, width, buffer);
        for (int64_t j = 0; j < q_len; ++j) {
            int64_t pos = first_pos + j;
            if (p > pos || p < first_visible(pos, shape->sliding_window)) continue;
            for (int head = 0; head < Hq; ++head) {
                int64_t r = j * Hq + head;
                scores[r * span + (p - key_start)] = soft_cap(dot(q_rows + r * D, keys + (head / G) * D, D),
                                                              shape->softcap);
            }
        }
    }
    for (int64_t j = 0; j < q_len; ++j) {
        int64_t pos = first_pos + j;
        int64_t lo = first_visible(pos, shape->sliding_window) - key_start;
        int64_t hi = pos + 1 - key_start;
        for (int head = 0; head < Hq; ++head) softmax(scores + (j * Hq + head) * span, lo, hi);
    }
    memset(acc, 0, sizeof(float) * rows * D);
    for (int64_t p = key_start; p < seq_len; ++p) {
        int64_t slot = (int64_t)blocks[p / bs] * bs + p % bs;
        if (p + PREFETCH_AHEAD < seq_len) NAME(prefetch_token)(v_cache, blocks, p + PREFETCH_AHEAD, bs, width);
        const float *values = NAME(token_row)(v_cache, slot, width, buffer);
        for (int64_t j = 0; j < q_len; ++j) {
            int64_t pos = first_pos + j;
            if (p > pos || p < first_visible(pos, shape->sliding_window)) continue;
            for (int head = 0; head < Hq; ++head) {
                int64_t r = j * Hq + head;
                add_scaled(acc + r * D, values + (head / G) * D, scores[r * span + (p - key_start)], D);
            }
        }
    }
    ELEM *out_seq = out + seqs->query_start[s] * Hq * D;
    for (int64_t i = 0; i < rows * D; ++i) out_seq[i] = STORE(acc[i]);
}

/* attend() specialised for the common head sizes. */
static void NAME(attend_any)(const ELEM *q, const KV_ELEM *k_cache, const KV_ELEM *v_cache,
                             ELEM *out, const AttentionShape *shape,
                             const SequenceIndex *seqs, int64_t s, float *work) {
    switch (shape->head_dim) {
    case 64: NAME(attend)(q, k_cache, v_cache, out, shape, seqs, s, work, 64); break;
    case 128: NAME(attend)(q, k_cache, v_cache, out, shape, seqs, s, work, 128); break;
    default: NAME(attend)(q, k_cache, v_cache, out, shape, seqs, s, work, shape->head_dim);
    }
}

void NAME(paged_attention)(const ELEM *q, const KV_ELEM *k_cache, const KV_ELEM *v_cache,
                           ELEM *out, const int64_t *query_start,
                           const int64_t *query_len, const int64_t *seq_len,
                           const int32_t *block_table, int64_t num_seqs, int num_heads,
                           int num_kv_heads, int head_dim, int block_size,
                           int max_blocks, int sliding_window, float scale, float softcap) {
    AttentionShape shape = {num_seqs,   num_heads,  num_kv_heads,   head_dim,
                            block_size, max_blocks, sliding_window, scale, softcap};
    SequenceIndex seqs = {query_start, query_len, seq_len, block_table};
    int64_t max_work = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        int64_t need = work_floats(&shape, &seqs, s);
        max_work = need > max_work ? need : max_work;
    }
    #pragma omp parallel
    {
        float *work = (float *)malloc(sizeof(float) * (size_t)max_work);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t s = 0; s < num_seqs; ++s)
            NAME(attend_any)(q, k_cache, v_cache, out, &shape, &seqs, s, work);
        free(work);
    }
}
