/* A step of short queries (decodes, speculative verification) through every
 * decoder layer in one call, for float32 models whose projections are kept
 * in GGUF blocks.
 *
 * At one decode row a layer's kernels take microseconds each; called one by
 * one from Python (norm, projections, rotary, cache write, attention, SiLU)
 * the dispatch between them cost as much as the kernels. Here the same
 * kernels run back to back in C, in the same order and on the same values as
 * the module path (cadence/models/llama.py with fused ops, quantized
 * products and the native attention), so the two agree to the bit. A
 * pre-norm layer (Llama's):
 *
 *     normed = input_norm(delta + residual)      (first layer: norm(hidden))
 *     qkv = normed @ Wqkv^T (+ bias)             each part into its columns
 *     q/k norms in place (per head or whole)     Qwen3, Gemma 3, OLMo 2
 *     rotate q, k in place; write k, v at their slots (cache dtype)
 *     attn = attention(q over the cache)         the layer's window or the whole context
 *     delta = attn @ Wo^T
 *     normed = post_norm(delta + residual)
 *     delta = down(act(gate) * up)               act: SiLU or GELU-tanh
 *
 * or, in a layer of routed experts (Qwen3-MoE; see moe_block), the sum of
 * each token's k experts' SwiGLU outputs, weighted by the router;
 * A sandwich layer (Gemma's) norms the attention's and the MLP's outputs
 * too before they join the stream; a post-norm layer (OLMo 2's) attends and
 * feeds forward on the stream itself and norms only the outputs. Then
 *
 *     out = final_norm(delta + residual)
 *
 * Norms with an offset (Gemma's 1 + weight) arrive with it added. One
 * translation unit with the kernels (the three sources are included), so
 * nothing is called through a library boundary. The caller (Python,
 * cadence/kernels/decoder_stack.py) decides which models and steps qualify.
 */

#include <stddef.h>

#include "quant_matmul.c"
#include "fused_ops.c"
#include "paged_attention.c"

/* A matrix in ggml blocks: ``rows`` rows of the layer's input width. */
typedef struct {
    int64_t type; /* ggml type id */
    const uint8_t *blocks;
    int64_t rows;
} BlockMatrix;

#define MAX_PARTS 3

/* One routed expert's SwiGLU matrices: gate|up (2I rows, in parts) and down (H rows). */
typedef struct {
    BlockMatrix gate_up[MAX_PARTS];
    int64_t gate_up_parts;
    BlockMatrix down;
} ExpertMatrices;

/* ggml's type id of float32 rows: a router kept in float. */
#define TYPE_F32_ROWS 0

/* One decoder layer's weights and caches. A projection is up to MAX_PARTS
 * row ranges of its matrix (shards of different ggml types stay apart).
 * Norms a layer's placement does not use are NULL. */
typedef struct {
    const float *input_norm;            /* [H]: pre and sandwich */
    const float *post_attention_norm;   /* [H] */
    const float *pre_feedforward_norm;  /* [H]: sandwich */
    const float *post_feedforward_norm; /* [H]: sandwich and post */
    const float *q_norm, *k_norm;       /* [D] per head, [Hq D] / [Hkv D] whole, or NULL */
    BlockMatrix qkv[MAX_PARTS];
    int64_t qkv_parts;
    const float *qkv_bias; /* [(Hq + 2 Hkv) D], or NULL */
    BlockMatrix o;
    BlockMatrix gate_up[MAX_PARTS]; /* a dense MLP's (no parts in a layer of experts) */
    int64_t gate_up_parts;
    BlockMatrix down;
    BlockMatrix router;               /* [E, H]: blocks, or TYPE_F32_ROWS (float32 rows) */
    const ExpertMatrices *experts;    /* [E]: the MLP is routed experts; NULL: the dense MLP above */
    void *key_cache;   /* [num_blocks, block_size, Hkv, D] of the cache dtype */
    void *value_cache;
    int64_t rotary;         /* ROTARY_NONE (SmolLM3's), ROTARY_MAIN or ROTARY_SLIDING (Gemma 3's local tables) */
    int64_t full_attention; /* 1: sees the whole context despite the step's window (Gemma's global layers) */
    int64_t group;          /* its KV cache group: which of the step's group tables it reads */
} DecoderLayer;

/* The model's sizes and building blocks. */
typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int64_t cache_dtype; /* CACHE_F32, CACHE_F16, CACHE_BF16 or CACHE_Q8_0 */
    int64_t block_size, num_slots; /* num_slots: blocks x block_size */
    int64_t norm_placement; /* NORM_PRE, NORM_POST or NORM_SANDWICH */
    int64_t activation;     /* ACT_SILU or ACT_GELU_TANH */
    int64_t qk_norm;        /* QK_NORM_NONE, QK_NORM_PER_HEAD or QK_NORM_WHOLE */
    int64_t rotary_dim;     /* values of each head that turn (head_dim but for partial rotary) */
    float eps, scale, softcap; /* softcap: attention scores' cap (Gemma 2's), 0: none */
    /* Routed experts (layers with ``experts``): E, k per token, each one's I, renormalised top-k */
    int64_t num_experts, experts_per_token, expert_intermediate, norm_topk_prob;
    int64_t rows_apart; /* 1: products through quant_matmul_rows_apart (the batch-invariant mode) */
} DecoderShape;

enum { CACHE_F32 = 0, CACHE_F16 = 1, CACHE_BF16 = 2, CACHE_Q8_0 = 3 };
enum { NORM_PRE = 0, NORM_POST = 1, NORM_SANDWICH = 2 };
enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };
enum { QK_NORM_NONE = 0, QK_NORM_PER_HEAD = 1, QK_NORM_WHOLE = 2 };
enum { ROTARY_NONE = 0, ROTARY_MAIN = 1, ROTARY_SLIDING = 2 };

/* The step: T query rows of S sequences, as the attention kernel reads them. */
typedef struct {
    int64_t num_tokens;
    const float *cos, *sin;      /* [T, R] */
    const float *sliding_cos, *sliding_sin; /* [T, R], for ROTARY_SLIDING layers (else NULL) */
    const int64_t *slot_mapping; /* [T] */
    const int64_t *query_start, *query_len, *seq_len; /* [S] */
    const int32_t *block_table;  /* [S, max_blocks] */
    int64_t num_seqs, max_blocks, sliding_window;
    /* KV cache groups (layers of one attention type share a table): [G, S, max_blocks] and
     * [G, T], layer->group picks a row; NULL: every layer reads block_table and slot_mapping. */
    const int32_t *group_block_tables;
    const int64_t *group_slot_mappings;
} DecoderStep;

/* The slots a layer writes and the block table it reads (its group's, with KV cache groups). */
static const int64_t *layer_slot_mapping(const DecoderLayer *layer, const DecoderStep *step) {
    if (!step->group_slot_mappings) return step->slot_mapping;
    return step->group_slot_mappings + layer->group * step->num_tokens;
}

static const int32_t *layer_block_table(const DecoderLayer *layer, const DecoderStep *step) {
    if (!step->group_block_tables) return step->block_table;
    return step->group_block_tables + layer->group * step->num_seqs * step->max_blocks;
}

/* Bytes n values take in the cache (n a multiple of Q8_0_VALUES for q8_0). */
static size_t cache_bytes(int64_t n, int64_t cache_dtype) {
    if (cache_dtype == CACHE_Q8_0) return (size_t)(n / Q8_0_VALUES * Q8_0_BYTES);
    return (size_t)n * (cache_dtype == CACHE_F32 ? sizeof(float) : sizeof(uint16_t));
}

/* n floats stored as the cache's element type. */
static void store_row(void *dst, const float *src, int64_t n, int64_t cache_dtype) {
    if (cache_dtype == CACHE_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else if (cache_dtype == CACHE_Q8_0) {
        float_row_to_q8_0((uint8_t *)dst, src, n);
    } else if (cache_dtype == CACHE_BF16) {
        uint16_t *out = (uint16_t *)dst;
        for (int64_t i = 0; i < n; ++i) out[i] = float_to_bf16(src[i]);
    } else {
        uint16_t *out = (uint16_t *)dst;
        int64_t i = 0;
#if defined(__F16C__)
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(out + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
        for (; i < n; ++i) out[i] = float_to_f16(src[i]);
    }
}

/* n floats as the cache stores them (for the tests of the rounding). */
int decoder_store_row(const float *src, int64_t n, int64_t cache_dtype, void *dst) {
    if (cache_dtype < CACHE_F32 || cache_dtype > CACHE_Q8_0) return -1;
    if (cache_dtype == CACHE_Q8_0 && n % Q8_0_VALUES) return -1;
    store_row(dst, src, n, cache_dtype);
    return 0;
}

/* out [T, sum of rows] = x [T, k] @ W^T, part by part into its columns. */
static int project(const DecoderShape *shape, const BlockMatrix *parts, int64_t num_parts, int64_t k,
                   const float *x, int64_t T, float *out, int64_t out_width) {
    int64_t column = 0;
    for (int64_t p = 0; p < num_parts; ++p) {
        const int type = (int)parts[p].type;
        int status = shape->rows_apart
            ? quant_matmul_rows_apart(type, parts[p].blocks, parts[p].rows, k, x, T, k, out + column, out_width)
            : quant_matmul(type, parts[p].blocks, parts[p].rows, k, x, T, k, out + column, out_width);
        if (status) return status;
        column += parts[p].rows;
    }
    return column == out_width ? 0 : -1;
}

/* Each new token's keys and values (columns [q_size, q_size + 2 kv_size) of
 * its qkv row) written at its slot. */
static int write_cache(const DecoderShape *shape, const DecoderLayer *layer, const DecoderStep *step,
                        const float *qkv, int64_t qkv_width) {
    const int64_t q_size = shape->num_heads * shape->head_dim, kv_size = shape->num_kv_heads * shape->head_dim;
    const size_t row_bytes = cache_bytes(kv_size, shape->cache_dtype);
    const int64_t *slot_mapping = layer_slot_mapping(layer, step);
    for (int64_t t = 0; t < step->num_tokens; ++t)
        if (slot_mapping[t] < 0 || slot_mapping[t] >= shape->num_slots) return -1;
    for (int64_t t = 0; t < step->num_tokens; ++t) {
        const float *row = qkv + t * qkv_width + q_size;
        const size_t offset = (size_t)slot_mapping[t] * row_bytes;
        store_row((char *)layer->key_cache + offset, row, kv_size, shape->cache_dtype);
        store_row((char *)layer->value_cache + offset, row + kv_size, kv_size, shape->cache_dtype);
    }
    return 0;
}

static void attend(const DecoderShape *shape, const DecoderLayer *layer, const DecoderStep *step,
                   const float *q, float *out) {
    const int Hq = (int)shape->num_heads, Hkv = (int)shape->num_kv_heads, D = (int)shape->head_dim;
    const int bs = (int)shape->block_size, max_blocks = (int)step->max_blocks;
    const int window = layer->full_attention ? 0 : (int)step->sliding_window;
    const int32_t *block_table = layer_block_table(layer, step);
    switch (shape->cache_dtype) {
    case CACHE_F32:
        paged_attention_f32(q, layer->key_cache, layer->value_cache, out, step->query_start, step->query_len,
                            step->seq_len, block_table, step->num_seqs, Hq, Hkv, D, bs, max_blocks,
                            window, shape->scale, shape->softcap);
        break;
    case CACHE_F16:
        paged_attention_f32_kvf16(q, layer->key_cache, layer->value_cache, out, step->query_start,
                                  step->query_len, step->seq_len, block_table, step->num_seqs, Hq, Hkv,
                                  D, bs, max_blocks, window, shape->scale, shape->softcap);
        break;
    case CACHE_Q8_0:
        paged_attention_f32_kvq8_0(q, layer->key_cache, layer->value_cache, out, step->query_start,
                                   step->query_len, step->seq_len, block_table, step->num_seqs, Hq, Hkv,
                                   D, bs, max_blocks, window, shape->scale, shape->softcap);
        break;
    default:
        paged_attention_f32_kvbf16(q, layer->key_cache, layer->value_cache, out, step->query_start,
                                   step->query_len, step->seq_len, block_table, step->num_seqs, Hq, Hkv,
                                   D, bs, max_blocks, window, shape->scale, shape->softcap);
    }
}

/* The step's buffers, one allocation (the experts' part only for a model with experts):
 * P = T k (token, expert) pairs. */
typedef struct {
    float *normed, *delta, *qkv, *q, *attn, *gate_up, *act;
    float *logits;       /* [T, E] */
    float *weights;      /* [P]: pair t k + j's weight (token t's j-th pick) */
    int64_t *ids;        /* [P]: its expert */
    int64_t *pair_rows;  /* [P]: its row in rows / outs */
    float *rows, *outs;  /* [P, H]: the pairs' inputs and expert outputs, grouped by expert */
} Scratch;

static void *scratch_alloc(const DecoderShape *shape, int64_t T, int64_t qkv_width, Scratch *s) {
    const int64_t H = shape->hidden, q_size = shape->num_heads * shape->head_dim;
    const int64_t E = shape->num_experts, P = E ? T * shape->experts_per_token : 0;
    /* gate_up and act serve the dense MLP's T rows and an expert's (at most P) rows */
    const int64_t I = shape->intermediate, Ie = shape->expert_intermediate;
    const int64_t mlp_rows = T * I > P * Ie ? T * I : P * Ie;
    const int64_t floats = T * (2 * H + qkv_width + 2 * q_size) + 3 * mlp_rows + T * E + P + 2 * P * H;
    void *all = malloc((size_t)floats * sizeof(float) + (size_t)(2 * P) * sizeof(int64_t));
    if (all == NULL) return NULL;
    s->ids = all; /* the int64 arrays first, so they stay aligned */
    s->pair_rows = s->ids + P;
    s->normed = (float *)(s->pair_rows + P);
    s->delta = s->normed + T * H;
    s->qkv = s->delta + T * H;
    s->q = s->qkv + T * qkv_width;
    s->attn = s->q + T * q_size;
    s->gate_up = s->attn + T * q_size;
    s->act = s->gate_up + 2 * mlp_rows;
    s->logits = s->act + mlp_rows;
    s->weights = s->logits + T * E;
    s->rows = s->weights + P;
    s->outs = s->rows + P * H;
    return all;
}

/* q/k norms in place in each qkv row (q: columns [0, q_size), k: the next kv_size). */
static void norm_qk(const DecoderShape *shape, const DecoderLayer *layer, float *qkv, int64_t T, int64_t qkv_width) {
    const int64_t D = shape->head_dim, Hq = shape->num_heads, Hkv = shape->num_kv_heads;
    if (shape->qk_norm == QK_NORM_PER_HEAD) {
        head_rms_norm_f32(qkv, qkv_width, Hq, D, layer->q_norm, T, shape->eps);
        head_rms_norm_f32(qkv + Hq * D, qkv_width, Hkv, D, layer->k_norm, T, shape->eps);
    } else if (shape->qk_norm == QK_NORM_WHOLE) {
        head_rms_norm_f32(qkv, qkv_width, 1, Hq * D, layer->q_norm, T, shape->eps);
        head_rms_norm_f32(qkv + Hq * D, qkv_width, 1, Hkv * D, layer->k_norm, T, shape->eps);
    }
}

/* s->delta [T, H] = the attention block's output for the layer's input ``x`` [T, H]. */
static int attention_block(const DecoderShape *shape, const DecoderLayer *layer, const DecoderStep *step,
                           const float *x, Scratch *s) {
    const int64_t T = step->num_tokens, H = shape->hidden, D = shape->head_dim;
    const int64_t q_size = shape->num_heads * D, qkv_width = q_size + 2 * shape->num_kv_heads * D;
    int status;
    if ((status = project(shape, layer->qkv, layer->qkv_parts, H, x, T, s->qkv, qkv_width))) return status;
    if (layer->qkv_bias)
        for (int64_t t = 0; t < T; ++t)
            for (int64_t i = 0; i < qkv_width; ++i) s->qkv[t * qkv_width + i] += layer->qkv_bias[i];
    norm_qk(shape, layer, s->qkv, T, qkv_width);
    if (layer->rotary != ROTARY_NONE) {
        const int sliding = layer->rotary == ROTARY_SLIDING;
        rotary_f32(s->qkv, qkv_width, (int)shape->num_heads, s->qkv + q_size, qkv_width, (int)shape->num_kv_heads,
                   sliding ? step->sliding_cos : step->cos, sliding ? step->sliding_sin : step->sin, T, (int)D,
                   (int)shape->rotary_dim);
    }
    if ((status = write_cache(shape, layer, step, s->qkv, qkv_width))) return status;
    for (int64_t t = 0; t < T; ++t) memcpy(s->q + t * q_size, s->qkv + t * qkv_width, (size_t)q_size * sizeof(float));
    attend(shape, layer, step, s->q, s->attn);
    return project(shape, &layer->o, 1, q_size, s->attn, T, s->delta, H);
}

/* s->delta [T, H] = the routed experts' output for ``x`` [T, H], as
 * cadence/models/moe.py computes it with fused ops (the same C functions in
 * the same order, on the same rows):
 *
 *     logits = x @ router^T                      [T, E]  (float32 rows or blocks)
 *     weights, ids = moe_route(logits)           [T, k]  softmax, top-k (ties: lower id), renormalised
 *     pairs grouped by expert, in token order:   rows [P, H] = x[token of each pair]
 *     for each expert e with n pairs: outs[its run] = down_e(silu(gate_e(rows)) * up_e(rows))
 *     delta[t] = sum over j < k, in order, of weights[t, j] * outs[pair_rows[t, j]]
 */
static int moe_block(const DecoderShape *shape, const DecoderLayer *layer, int64_t T, const float *x, Scratch *s) {
    const int64_t H = shape->hidden, E = shape->num_experts, k = shape->experts_per_token;
    const int64_t Ie = shape->expert_intermediate, P = T * k;
    int status;
    if (layer->router.type == TYPE_F32_ROWS) {
        if (layer->router.rows != E) return -1;
        linear_f32(x, T, H, (const float *)layer->router.blocks, E, s->logits);
    } else if ((status = project(shape, &layer->router, 1, H, x, T, s->logits, E))) {
        return status;
    }
    moe_route_f32(s->logits, T, E, k, (int)shape->norm_topk_prob, s->weights, s->ids);
    int64_t next = 0;
    for (int64_t e = 0; e < E; ++e) {
        const int64_t start = next;
        for (int64_t p = 0; p < P; ++p)
            if (s->ids[p] == e) {
                s->pair_rows[p] = next;
                memcpy(s->rows + next * H, x + (p / k) * H, (size_t)H * sizeof(float));
                ++next;
            }
        const int64_t n = next - start;
        if (n == 0) continue;
        const ExpertMatrices *expert = &layer->experts[e];
        if ((status = project(shape, expert->gate_up, expert->gate_up_parts, H, s->rows + start * H, n, s->gate_up, 2 * Ie)))
            return status;
        silu_mul_f32(s->gate_up, s->act, n, Ie);
        if ((status = project(shape, &expert->down, 1, Ie, s->act, n, s->outs + start * H, H))) return status;
    }
    moe_combine_f32(s->outs, s->pair_rows, s->weights, T, k, H, s->delta);
    return 0;
}

/* s->delta [T, H] = the MLP's output for its input ``x`` [T, H]. */
static int mlp_block(const DecoderShape *shape, const DecoderLayer *layer, int64_t T, const float *x, Scratch *s) {
    const int64_t H = shape->hidden, I = shape->intermediate;
    int status;
    if (layer->experts) return moe_block(shape, layer, T, x, s);
    if ((status = project(shape, layer->gate_up, layer->gate_up_parts, H, x, T, s->gate_up, 2 * I))) return status;
    if (shape->activation == ACT_GELU_TANH)
        gelu_tanh_mul_f32(s->gate_up, s->act, T, I);
    else
        silu_mul_f32(s->gate_up, s->act, T, I);
    return project(shape, &layer->down, 1, I, s->act, T, s->delta, H);
}

/* out [T, H] = norm(x) (with ``residual``: residual += x first, and the sum is normed). */
static void norm_rows(const DecoderShape *shape, const float *weight, const float *x, float *residual, float *out,
                      int64_t T) {
    const int64_t H = shape->hidden;
    add_rms_norm_f32(x, H, residual, H, weight, out, H, T, H, shape->eps);
}

/* One layer: residual (the stream, updated in place) and delta (the last
 * block's output, which this layer adds in first; the first layer's
 * residual is its input). Leaves this layer's MLP output in delta. */
static int run_layer(const DecoderShape *shape, const DecoderLayer *layer, const DecoderStep *step,
                     float *residual, int first, Scratch *s) {
    const int64_t T = step->num_tokens, H = shape->hidden;
    int status;
    if (shape->norm_placement == NORM_POST) {
        /* h = x + norm(attn(x)); delta = norm(mlp(h)), each sum as PyTorch adds it */
        if (!first)
            for (int64_t i = 0; i < T * H; ++i) residual[i] += s->delta[i];
        if ((status = attention_block(shape, layer, step, residual, s))) return status;
        norm_rows(shape, layer->post_attention_norm, s->delta, NULL, s->normed, T);
        for (int64_t i = 0; i < T * H; ++i) residual[i] += s->normed[i];
        if ((status = mlp_block(shape, layer, T, residual, s))) return status;
        norm_rows(shape, layer->post_feedforward_norm, s->delta, NULL, s->normed, T);
        memcpy(s->delta, s->normed, (size_t)(T * H) * sizeof(float));
        return 0;
    }
    norm_rows(shape, layer->input_norm, first ? residual : s->delta, first ? NULL : residual, s->normed, T);
    if ((status = attention_block(shape, layer, step, s->normed, s))) return status;
    if (shape->norm_placement == NORM_SANDWICH) {
        /* attn_out = norm(attn); normed = pre_ff_norm(attn_out + residual); delta = norm(mlp) */
        norm_rows(shape, layer->post_attention_norm, s->delta, NULL, s->normed, T);
        norm_rows(shape, layer->pre_feedforward_norm, s->normed, residual, s->delta, T);
        if ((status = mlp_block(shape, layer, T, s->delta, s))) return status;
        norm_rows(shape, layer->post_feedforward_norm, s->delta, NULL, s->normed, T);
        memcpy(s->delta, s->normed, (size_t)(T * H) * sizeof(float));
        return 0;
    }
    norm_rows(shape, layer->post_attention_norm, s->delta, residual, s->normed, T);
    return mlp_block(shape, layer, T, s->normed, s);
}

/* out [T, H] = the final norm of the stack's output for the step's embedded
 * tokens ``hidden`` [T, H] (used as the residual stream: overwritten).
 * Returns 0, -1 for arguments the kernels refuse, -2 when out of memory. */
int decoder_stack(const DecoderShape *shape, const DecoderLayer *layers, const float *final_norm,
                  const DecoderStep *step, float *hidden, float *out) {
    const int64_t T = step->num_tokens, H = shape->hidden;
    if (T == 0) return 0;
    if (shape->cache_dtype == CACHE_Q8_0 && shape->head_dim % Q8_0_VALUES) return -1;
    if (shape->rotary_dim < 2 || shape->rotary_dim > shape->head_dim || shape->rotary_dim % 2) return -1;
    for (int64_t l = 0; l < shape->num_layers; ++l) {
        const DecoderLayer *layer = &layers[l];
        if (layer->qkv_parts < 1 || layer->qkv_parts > MAX_PARTS
            || (!layer->experts && (layer->gate_up_parts < 1 || layer->gate_up_parts > MAX_PARTS)))
            return -1;
        if (layer->experts) {
            if (shape->num_experts < 1 || shape->experts_per_token < 1
                || shape->experts_per_token > shape->num_experts || layer->router.rows != shape->num_experts)
                return -1;
            for (int64_t e = 0; e < shape->num_experts; ++e)
                if (layer->experts[e].gate_up_parts < 1 || layer->experts[e].gate_up_parts > MAX_PARTS) return -1;
        }
        if ((shape->qk_norm != QK_NORM_NONE && (!layer->q_norm || !layer->k_norm))
            || (layer->rotary == ROTARY_SLIDING && (!step->sliding_cos || !step->sliding_sin))
            || (shape->norm_placement != NORM_POST && !layer->input_norm)
            || (shape->norm_placement != NORM_PRE && !layer->post_feedforward_norm)
            || (shape->norm_placement == NORM_SANDWICH && !layer->pre_feedforward_norm))
            return -1;
    }
    const int64_t qkv_width = (shape->num_heads + 2 * shape->num_kv_heads) * shape->head_dim;
    Scratch s;
    void *all = scratch_alloc(shape, T, qkv_width, &s);
    if (all == NULL) return -2;
    int status = 0;
    for (int64_t l = 0; l < shape->num_layers && status == 0; ++l)
        status = run_layer(shape, &layers[l], step, hidden, l == 0, &s);
    if (status == 0) add_rms_norm_f32(s.delta, H, hidden, H, final_norm, out, H, T, H, shape->eps);
    free(all);
    return status;
}

/* sizeof and field offsets of the structures, for the binding's test:
 * DecoderLayer (size, then 20 offsets), DecoderShape (size, 21), DecoderStep
 * (size, 15), BlockMatrix (size, 3), ExpertMatrices (size, 3): 67 values. */
int decoder_struct_layout(int64_t *out) {
#define PUT(value) (*out++ = (int64_t)(value))
    PUT(sizeof(DecoderLayer));
    PUT(offsetof(DecoderLayer, input_norm)); PUT(offsetof(DecoderLayer, post_attention_norm));
    PUT(offsetof(DecoderLayer, pre_feedforward_norm)); PUT(offsetof(DecoderLayer, post_feedforward_norm));
    PUT(offsetof(DecoderLayer, q_norm)); PUT(offsetof(DecoderLayer, k_norm));
    PUT(offsetof(DecoderLayer, qkv)); PUT(offsetof(DecoderLayer, qkv_parts));
    PUT(offsetof(DecoderLayer, qkv_bias)); PUT(offsetof(DecoderLayer, o));
    PUT(offsetof(DecoderLayer, gate_up)); PUT(offsetof(DecoderLayer, gate_up_parts));
    PUT(offsetof(DecoderLayer, down)); PUT(offsetof(DecoderLayer, router));
    PUT(offsetof(DecoderLayer, experts)); PUT(offsetof(DecoderLayer, key_cache));
    PUT(offsetof(DecoderLayer, value_cache)); PUT(offsetof(DecoderLayer, rotary));
    PUT(offsetof(DecoderLayer, full_attention)); PUT(offsetof(DecoderLayer, group));
    PUT(sizeof(DecoderShape));
    PUT(offsetof(DecoderShape, num_layers)); PUT(offsetof(DecoderShape, hidden));
    PUT(offsetof(DecoderShape, num_heads)); PUT(offsetof(DecoderShape, num_kv_heads));
    PUT(offsetof(DecoderShape, head_dim)); PUT(offsetof(DecoderShape, intermediate));
    PUT(offsetof(DecoderShape, cache_dtype)); PUT(offsetof(DecoderShape, block_size));
    PUT(offsetof(DecoderShape, num_slots)); PUT(offsetof(DecoderShape, norm_placement));
    PUT(offsetof(DecoderShape, activation)); PUT(offsetof(DecoderShape, qk_norm));
    PUT(offsetof(DecoderShape, rotary_dim));
    PUT(offsetof(DecoderShape, eps)); PUT(offsetof(DecoderShape, scale)); PUT(offsetof(DecoderShape, softcap));
    PUT(offsetof(DecoderShape, num_experts)); PUT(offsetof(DecoderShape, experts_per_token));
    PUT(offsetof(DecoderShape, expert_intermediate)); PUT(offsetof(DecoderShape, norm_topk_prob));
    PUT(offsetof(DecoderShape, rows_apart));
    PUT(sizeof(DecoderStep));
    PUT(offsetof(DecoderStep, num_tokens)); PUT(offsetof(DecoderStep, cos)); PUT(offsetof(DecoderStep, sin));
    PUT(offsetof(DecoderStep, sliding_cos)); PUT(offsetof(DecoderStep, sliding_sin));
    PUT(offsetof(DecoderStep, slot_mapping)); PUT(offsetof(DecoderStep, query_start));
    PUT(offsetof(DecoderStep, query_len)); PUT(offsetof(DecoderStep, seq_len));
    PUT(offsetof(DecoderStep, block_table)); PUT(offsetof(DecoderStep, num_seqs));
    PUT(offsetof(DecoderStep, max_blocks)); PUT(offsetof(DecoderStep, sliding_window));
    PUT(offsetof(DecoderStep, group_block_tables)); PUT(offsetof(DecoderStep, group_slot_mappings));
    PUT(sizeof(BlockMatrix));
    PUT(offsetof(BlockMatrix, type)); PUT(offsetof(BlockMatrix, blocks)); PUT(offsetof(BlockMatrix, rows));
    PUT(sizeof(ExpertMatrices));
    PUT(offsetof(ExpertMatrices, gate_up)); PUT(offsetof(ExpertMatrices, gate_up_parts));
    PUT(offsetof(ExpertMatrices, down));
#undef PUT
    return 0;
}
