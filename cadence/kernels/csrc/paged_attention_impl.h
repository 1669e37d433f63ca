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
                                        const AttentionShape *shape, int width) {
    const char *row = (const char *)(cache + slot_of(blocks, p, shape) * KV_ROW_ELEMS(width));
    for (int64_t offset = 0; offset < (int64_t)(KV_ROW_ELEMS(width) * sizeof(KV_ELEM)); offset += 64)
        __builtin_prefetch(row + offset, 0, 3);
}

/* Row pointers of the KEY_GROUP keys (values) at positions base .. base + 3;
 * positions outside [lo, hi) point at position ``lo``'s row (they weigh 0). */
static inline void NAME(group_rows)(const KV_ELEM *cache, const int32_t *blocks, int64_t base,
                                    int64_t lo, int64_t hi, const AttentionShape *shape, int width,
                                    float *buffer, const float **rows) {
    for (int t = 0; t < KEY_GROUP; ++t) {
        int64_t p = base + t < lo || base + t >= hi ? lo : base + t;
        rows[t] = NAME(token_row)(cache, slot_of(blocks, p, shape), width, buffer + t * width);
        if (base + t + PREFETCH_AHEAD < hi)
            NAME(prefetch_token)(cache, blocks, base + t + PREFETCH_AHEAD, shape, width);
    }
}

#ifdef KV_DIRECT_F16
/* The float16 cache read in place with AVX-512, where D is a multiple of 16:
 * a group's four key (value) rows are widened 16 values at a time in
 * registers and serve up to DIRECT_HEADS query heads of their KV head at
 * once (the generic path widens each row into a buffer and reads it back
 * once per head). A row's sums are the same whichever heads it shares a
 * pass with. */
#define DIRECT_HEADS 4

/* The row pointers of the KEY_GROUP keys (values) at positions base .. base + 3,
 * unwidened (positions outside [lo, hi) at position lo's row, as group_rows). */
static inline void NAME(group_raw_rows)(const KV_ELEM *cache, const int32_t *blocks, int64_t base,
                                        int64_t lo, int64_t hi, const AttentionShape *shape, int width,
                                        const KV_ELEM **rows) {
    for (int t = 0; t < KEY_GROUP; ++t) {
        int64_t p = base + t < lo || base + t >= hi ? lo : base + t;
        rows[t] = cache + slot_of(blocks, p, shape) * KV_ROW_ELEMS(width);
        if (base + t + PREFETCH_AHEAD < hi)
            NAME(prefetch_token)(cache, blocks, base + t + PREFETCH_AHEAD, shape, width);
    }
}

/* scores[g * KEY_CHUNK + t] = q[g * D ..] . keys[t] for the first n (<= DIRECT_HEADS) heads. */
static inline __attribute__((always_inline)) void NAME(dot_heads)(const float *q, int n, const uint16_t *const *keys,
                                                                 int D, float *scores) {
    const uint16_t *rows[KEY_GROUP];
    __m512 acc[DIRECT_HEADS][KEY_GROUP];
    for (int t = 0; t < KEY_GROUP; ++t) rows[t] = keys[t];
    for (int g = 0; g < n; ++g)
        for (int t = 0; t < KEY_GROUP; ++t) acc[g][t] = _mm512_setzero_ps();
    for (int i = 0; i < D; i += 16) {
        __m512 k[KEY_GROUP];
        for (int t = 0; t < KEY_GROUP; ++t) k[t] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rows[t] + i)));
        for (int g = 0; g < n; ++g) {
            const __m512 qv = _mm512_loadu_ps(q + g * D + i);
            for (int t = 0; t < KEY_GROUP; ++t) acc[g][t] = _mm512_fmadd_ps(qv, k[t], acc[g][t]);
        }
    }
    for (int g = 0; g < n; ++g)
        for (int t = 0; t < KEY_GROUP; ++t) scores[g * KEY_CHUNK + t] = _mm512_reduce_add_ps(acc[g][t]);
}

/* acc[g * D ..] += (w0 x0 + w1 x1) + (w2 x2 + w3 x3) for the first n heads, w = weights[g * KEY_CHUNK ..]. */
static inline __attribute__((always_inline)) void NAME(add_heads)(float *restrict acc, int n,
                                                                 const uint16_t *const *values,
                                                                 const float *restrict weights, int D) {
    const uint16_t *rows[KEY_GROUP]; /* in registers: acc's stores cannot move them */
    __m512 w[DIRECT_HEADS][KEY_GROUP];
    for (int t = 0; t < KEY_GROUP; ++t) rows[t] = values[t];
    for (int g = 0; g < n; ++g)
        for (int t = 0; t < KEY_GROUP; ++t) w[g][t] = _mm512_set1_ps(weights[g * KEY_CHUNK + t]);
    for (int i = 0; i < D; i += 16) {
        __m512 x[KEY_GROUP];
        for (int t = 0; t < KEY_GROUP; ++t) x[t] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rows[t] + i)));
        for (int g = 0; g < n; ++g) {
            const __m512 low = _mm512_fmadd_ps(w[g][1], x[1], _mm512_mul_ps(w[g][0], x[0]));
            const __m512 high = _mm512_fmadd_ps(w[g][3], x[3], _mm512_mul_ps(w[g][2], x[2]));
            float *a = acc + g * D + i;
            _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), _mm512_add_ps(low, high)));
        }
    }
}

/* dot_heads and add_heads with n a constant, so their loops unroll and acc stays in registers. */
static void NAME(dot_heads_any)(const float *q, int n, const uint16_t *const *keys, int D, float *scores) {
    switch (n) {
    case 1: NAME(dot_heads)(q, 1, keys, D, scores); break;
    case 2: NAME(dot_heads)(q, 2, keys, D, scores); break;
    case 3: NAME(dot_heads)(q, 3, keys, D, scores); break;
    default: NAME(dot_heads)(q, 4, keys, D, scores); break;
    }
}

static void NAME(add_heads_any)(float *acc, int n, const uint16_t *const *values, const float *weights, int D) {
    switch (n) {
    case 1: NAME(add_heads)(acc, 1, values, weights, D); break;
    case 2: NAME(add_heads)(acc, 2, values, weights, D); break;
    case 3: NAME(add_heads)(acc, 3, values, weights, D); break;
    default: NAME(add_heads)(acc, 4, values, weights, D); break;
    }
}

/* attend_chunk's two passes over the keys and values, reading the float16 cache in
 * place: the heads of a KV head DIRECT_HEADS at a time. A head whose group has a key
 * of weight 0 adds its values alone, that key's row replaced by zeros (0 x inf). */
static void NAME(direct_scores)(const float *q_rows, const KV_ELEM *k_cache, const int32_t *blocks,
                                const AttentionShape *shape, int64_t q_len, int64_t lo, int64_t hi,
                                float *scores) {
    const int Hq = shape->num_heads, Hkv = shape->num_kv_heads, G = Hq / Hkv, D = shape->head_dim;
    const int64_t chunk = lo / KEY_CHUNK * KEY_CHUNK;
    const KV_ELEM *group[KEY_GROUP];
    for (int64_t base = lo / KEY_GROUP * KEY_GROUP; base < hi; base += KEY_GROUP) {
        NAME(group_raw_rows)(k_cache, blocks, base, lo, hi, shape, Hkv * D, group);
        for (int64_t j = 0; j < q_len; ++j)
            for (int kv = 0; kv < Hkv; ++kv) {
                const KV_ELEM *keys[KEY_GROUP];
                for (int t = 0; t < KEY_GROUP; ++t) keys[t] = group[t] + kv * D;
                for (int g = 0; g < G; g += DIRECT_HEADS) {
                    const int64_t r = j * Hq + kv * G + g;
                    const int n = G - g < DIRECT_HEADS ? G - g : DIRECT_HEADS;
                    NAME(dot_heads_any)(q_rows + r * D, n, keys, D, scores + r * KEY_CHUNK + (base - chunk));
                }
            }
    }
}

static void NAME(direct_values)(const KV_ELEM *v_cache, const int32_t *blocks, const AttentionShape *shape,
                                int64_t q_len, int64_t first_pos, int64_t lo, int64_t hi, const float *scores,
                                const KV_ELEM *zeros, float *acc) {
    const int Hq = shape->num_heads, Hkv = shape->num_kv_heads, G = Hq / Hkv, D = shape->head_dim;
    const int64_t chunk = lo / KEY_CHUNK * KEY_CHUNK;
    const KV_ELEM *group[KEY_GROUP];
    for (int64_t base = lo / KEY_GROUP * KEY_GROUP; base < hi; base += KEY_GROUP) {
        NAME(group_raw_rows)(v_cache, blocks, base, lo, hi, shape, Hkv * D, group);
        for (int64_t j = 0; j < q_len; ++j) {
            int64_t pos = first_pos + j;
            if (base > pos || base + KEY_GROUP <= first_visible(pos, shape->sliding_window))
                continue; /* no key of this group is the token's */
            for (int kv = 0; kv < Hkv; ++kv) {
                const KV_ELEM *values[KEY_GROUP];
                for (int t = 0; t < KEY_GROUP; ++t) values[t] = group[t] + kv * D;
                for (int g = 0; g < G; g += DIRECT_HEADS) {
                    const int64_t r = j * Hq + kv * G + g;
                    const int n = G - g < DIRECT_HEADS ? G - g : DIRECT_HEADS;
                    const float *weights = scores + r * KEY_CHUNK + (base - chunk);
                    int all_weigh = 1;
                    for (int h = 0; h < n; ++h)
                        for (int t = 0; t < KEY_GROUP; ++t) all_weigh &= weights[h * KEY_CHUNK + t] != 0.0f;
                    if (all_weigh) {
                        NAME(add_heads_any)(acc + r * D, n, values, weights, D);
                        continue;
                    }
                    for (int h = 0; h < n; ++h) {
                        const KV_ELEM *own[KEY_GROUP];
                        for (int t = 0; t < KEY_GROUP; ++t)
                            own[t] = weights[h * KEY_CHUNK + t] == 0.0f ? zeros : values[t];
                        NAME(add_heads_any)(acc + (r + h) * D, 1, own, weights + h * KEY_CHUNK, D);
                    }
                }
            }
        }
    }
}
#endif

/* One task: keys [lo, hi) of one sequence (one chunk) for all its query rows,
 * into the task's partial: per row the max score m, the sum of e^(score - m)
 * and the values weighted by it. Always inlined, so a call with a constant
 * head_dim D compiles to fully unrolled vector loops. */
static inline __attribute__((always_inline)) void NAME(attend_chunk)(
        const ELEM *q, const KV_ELEM *k_cache, const KV_ELEM *v_cache, const AttentionShape *shape,
        const SequenceIndex *seqs, const AttentionTask *task, float *partials, float *work, const int D) {
    const int Hq = shape->num_heads, Hkv = shape->num_kv_heads, G = Hq / Hkv;
    const int width = Hkv * D;
    const int64_t s = task->seq, lo = task->lo, hi = task->hi;
    const int64_t q_len = seqs->query_len[s], first_pos = seqs->seq_len[s] - q_len;
    const int64_t rows = q_len * Hq, chunk = lo / KEY_CHUNK * KEY_CHUNK, first_group = lo / KEY_GROUP * KEY_GROUP;
    const int32_t *blocks = seqs->block_table + s * shape->max_blocks;
    float *q_rows = work;                  /* [rows, D], row j * Hq + head, pre-scaled */
    float *scores = q_rows + rows * D;     /* [rows, KEY_CHUNK], key p at p - chunk */
    float *buffer = scores + rows * KEY_CHUNK; /* [KEY_GROUP, Hkv * D] */
    float *zeros = buffer + KEY_GROUP * width; /* [D]: the values of a key that weighs 0 */
    float *max = partials + task->partial, *sum = max + rows, *acc = sum + rows;
    const float *group[KEY_GROUP];
    int head_offset[Hq]; /* where head h's KV head lies in a token's row (no division per key) */
    for (int h = 0; h < Hq; ++h) head_offset[h] = h / G * D;
    NAME(load_row)(q_rows, q + seqs->query_start[s] * Hq * D, (int)(rows * D), shape->scale);

#ifdef KV_DIRECT_F16
    const int direct = D % 16 == 0;
    if (direct) NAME(direct_scores)(q_rows, k_cache, blocks, shape, q_len, lo, hi, scores);
    for (int64_t base = first_group; !direct && base < hi; base += KEY_GROUP) {
#else
    for (int64_t base = first_group; base < hi; base += KEY_GROUP) {
#endif
        NAME(group_rows)(k_cache, blocks, base, lo, hi, shape, width, buffer, group);
        for (int64_t j = 0, r = 0; j < q_len; ++j) {
            for (int h = 0; h < Hq; ++h, ++r) {
                const float *keys[KEY_GROUP];
                for (int t = 0; t < KEY_GROUP; ++t) keys[t] = group[t] + head_offset[h];
                float *row = scores + r * KEY_CHUNK + (base - chunk);
                dot_group(q_rows + r * D, keys, D, row);
            }
        }
    }
    if (shape->softcap > 0.0f) /* each score of the chunk's groups, capped */
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t p = first_group; p < hi; ++p) {
                float *score = scores + r * KEY_CHUNK + (p - chunk);
                *score = soft_cap(*score, shape->softcap);
            }
    /* Each row's keys in this chunk: [row_lo, row_hi), the rest of its groups weigh 0. */
    int64_t group_end = (hi + KEY_GROUP - 1) / KEY_GROUP * KEY_GROUP;
    for (int64_t r = 0; r < rows; ++r) {
        int64_t pos = first_pos + r / Hq, row_lo = first_visible(pos, shape->sliding_window), row_hi = pos + 1;
        row_lo = row_lo > lo ? row_lo : lo;
        row_hi = row_hi < hi ? row_hi : hi;
        float *row = scores + r * KEY_CHUNK - chunk;
        if (row_lo >= row_hi) {
            max[r] = -INFINITY, sum[r] = 0.0f;
            continue;
        }
        max[r] = exp_shifted(row, row_lo, row_hi, sum + r);
        for (int64_t p = first_group; p < row_lo; ++p) row[p] = 0.0f;
        for (int64_t p = row_hi; p < group_end; ++p) row[p] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * rows * D);
    memset(zeros, 0, sizeof(float) * D);
#ifdef KV_DIRECT_F16
    if (direct) { /* zeros: D float32 zeros, so D float16 zeros too */
        NAME(direct_values)(v_cache, blocks, shape, q_len, first_pos, lo, hi, scores, (const KV_ELEM *)zeros, acc);
        return;
    }
#endif
    for (int64_t base = first_group; base < hi; base += KEY_GROUP) {
        NAME(group_rows)(v_cache, blocks, base, lo, hi, shape, width, buffer, group);
        for (int64_t j = 0, r = 0; j < q_len; ++j, r += Hq) {
            int64_t pos = first_pos + j;
            if (base > pos || base + KEY_GROUP <= first_visible(pos, shape->sliding_window))
                continue; /* no key of this group is the token's */
            for (int h = 0; h < Hq; ++h) {
                const float *weights = scores + (r + h) * KEY_CHUNK + (base - chunk), *values[KEY_GROUP];
                for (int t = 0; t < KEY_GROUP; ++t) /* 0 x 0, where 0 x inf would be NaN */
                    values[t] = weights[t] == 0.0f ? zeros : group[t] + head_offset[h];
                add_scaled_group(acc + (r + h) * D, values, weights, D);
            }
        }
    }
}

/* attend_chunk() specialised for the common head sizes. */
static void NAME(attend_chunk_any)(const ELEM *q, const KV_ELEM *k_cache, const KV_ELEM *v_cache,
                                   const AttentionShape *shape, const SequenceIndex *seqs,
                                   const AttentionTask *task, float *partials, float *work) {
    switch (shape->head_dim) {
    case 64: NAME(attend_chunk)(q, k_cache, v_cache, shape, seqs, task, partials, work, 64); break;
    case 128: NAME(attend_chunk)(q, k_cache, v_cache, shape, seqs, task, partials, work, 128); break;
    case 256: NAME(attend_chunk)(q, k_cache, v_cache, shape, seqs, task, partials, work, 256); break;
    default: NAME(attend_chunk)(q, k_cache, v_cache, shape, seqs, task, partials, work, shape->head_dim);
    }
}

/* out's rows of the sequence whose tasks are tasks[0 .. count): their chunks
 * merged in order. */
static void NAME(merge_chunks)(ELEM *out, const AttentionShape *shape, const SequenceIndex *seqs,
                               const AttentionTask *tasks, int64_t count, const float *partials) {
    const int D = shape->head_dim;
    const int64_t s = tasks[0].seq, rows = seqs->query_len[s] * shape->num_heads;
    ELEM *out_seq = out + seqs->query_start[s] * shape->num_heads * D;
    for (int64_t r = 0; r < rows; ++r) {
        float top = -INFINITY, total = 0.0f;
        for (int64_t c = 0; c < count; ++c) {
            float m = partials[tasks[c].partial + r];
            top = m > top ? m : top;
        }
        for (int64_t c = 0; c < count; ++c) {
            const float *max = partials + tasks[c].partial, *sum = max + rows;
            if (max[r] != -INFINITY) total += exp_approx(max[r] - top) * sum[r];
        }
        float merged[D];
        memset(merged, 0, sizeof merged);
        for (int64_t c = 0; c < count; ++c) {
            const float *max = partials + tasks[c].partial, *acc = max + 2 * rows + r * D;
            if (max[r] == -INFINITY) continue;
            const float weight = exp_approx(max[r] - top) / total;
            for (int i = 0; i < D; ++i) merged[i] += weight * acc[i];
        }
        for (int i = 0; i < D; ++i) out_seq[r * D + i] = STORE(merged[i]);
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
    int64_t num_tasks, partial_floats, max_work = work_floats(&shape, &seqs);
    AttentionTask *tasks = attention_tasks(&shape, &seqs, &num_tasks, &partial_floats);
    float *partials = (float *)malloc(sizeof(float) * (size_t)(partial_floats > 0 ? partial_floats : 1));
    #pragma omp parallel
    {
        float *work = (float *)malloc(sizeof(float) * (size_t)max_work);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < num_tasks; ++t)
            NAME(attend_chunk_any)(q, k_cache, v_cache, &shape, &seqs, tasks + t, partials, work);
        free(work);
        /* each sequence's first task: the sequences' merges, once every task is done */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < num_tasks; ++t) {
            if (t > 0 && tasks[t - 1].seq == tasks[t].seq) continue;
            int64_t count = 1;
            while (t + count < num_tasks && tasks[t + count].seq == tasks[t].seq) ++count;
            NAME(merge_chunks)(out, &shape, &seqs, tasks + t, count, partials);
        }
    }
    free(partials);
    free(tasks);
}
