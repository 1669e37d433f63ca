/* The functions of fused_ops.c, written once for an element type: the
 * includer defines ELEM (the stored type), LOAD (ELEM -> float), STORE
 * (float -> ELEM) and NAME(x) (x with the type's suffix). ROUND(x) is x
 * rounded to the element type, as PyTorch rounds between operations. */

#define ROUND(x) LOAD(STORE(x))

/* For each of ``rows`` rows of ``width``: with a residual, residual += x
 * (rounded) and the sum is normed; without, x is. out = weight * (v * rsqrt(
 * mean(v^2) + eps)), the norm rounded before the weight as in PyTorch.
 * Row strides are in elements. */
void NAME(add_rms_norm)(const ELEM *x, int64_t x_stride, ELEM *residual, int64_t residual_stride,
                        const ELEM *weight, ELEM *out, int64_t out_stride, int64_t rows,
                        int64_t width, float eps) {
    #pragma omp parallel for schedule(static) if (rows * width >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < rows; ++t) {
        const ELEM *src = x + t * x_stride;
        ELEM *dst = out + t * out_stride;
        float sum_squares = 0.0f;
        if (residual) {
            ELEM *stream = residual + t * residual_stride;
            for (int64_t i = 0; i < width; ++i) {
                ELEM total = STORE(LOAD(stream[i]) + LOAD(src[i]));
                stream[i] = total;
                float v = LOAD(total);
                sum_squares += v * v;
            }
            src = stream;
        } else {
            for (int64_t i = 0; i < width; ++i) {
                float v = LOAD(src[i]);
                sum_squares += v * v;
            }
        }
        float inverse_rms = 1.0f / sqrtf(sum_squares / (float)width + eps);
        for (int64_t i = 0; i < width; ++i)
            dst[i] = STORE(LOAD(weight[i]) * ROUND(LOAD(src[i]) * inverse_rms));
    }
}

/* Rotate heads in place: x [rows, heads, D] (row stride in elements), token
 * t by row t of the float32 cos/sin [rows, R] (rounded to the element type
 * first, as PyTorch casts them). Only the first R values of each head turn
 * (R = D but for partial rotary). With h = R / 2:
 * x[:h] <- x[:h] cos[:h] - x[h:R] sin[:h];  x[h:R] <- x[h:R] cos[h:] + x[:h] sin[h:].
 * Products and the sum are rounded as PyTorch's x * cos + rotate_half(x) * sin.
 * ``cos``/``sin`` here are the row's values already rounded. */
static inline void NAME(rotate_row)(ELEM *x, int heads, int D, int R, const float *cos, const float *sin) {
    const int half = R / 2;
    for (int head = 0; head < heads; ++head) {
        ELEM *v = x + head * D;
        for (int i = 0; i < half; ++i) {
            float a = LOAD(v[i]), b = LOAD(v[i + half]);
            v[i] = STORE(ROUND(a * cos[i]) + ROUND(-b * sin[i]));
            v[i + half] = STORE(ROUND(b * cos[i + half]) + ROUND(a * sin[i + half]));
        }
    }
}

void NAME(rotary)(ELEM *q, int64_t q_stride, int q_heads, ELEM *k, int64_t k_stride, int k_heads,
                  const float *cos, const float *sin, int64_t rows, int D, int R) {
    #pragma omp parallel for schedule(static) if (rows * (q_heads + k_heads) * R >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < rows; ++t) {
        float row_cos[R], row_sin[R]; /* rounded once per token, used by every head */
        for (int i = 0; i < R; ++i) {
            row_cos[i] = ROUND(cos[t * R + i]);
            row_sin[i] = ROUND(sin[t * R + i]);
        }
        NAME(rotate_row)(q + t * q_stride, q_heads, D, R, row_cos, row_sin);
        NAME(rotate_row)(k + t * k_stride, k_heads, D, R, row_cos, row_sin);
    }
}

/* RMSNorm in place of each of ``heads`` groups of D values in each of
 * ``rows`` rows (row stride in elements): q/k norms over a head (Qwen3,
 * Gemma 3; heads = H) or over the whole projection (OLMo 2; heads = 1).
 * Rounds as add_rms_norm does without a residual. */
void NAME(head_rms_norm)(ELEM *x, int64_t row_stride, int64_t heads, int64_t D, const ELEM *weight,
                         int64_t rows, float eps) {
    #pragma omp parallel for schedule(static) if (rows * heads * D >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < rows; ++t)
        for (int64_t head = 0; head < heads; ++head) {
            ELEM *v = x + t * row_stride + head * D;
            float sum_squares = 0.0f;
            for (int64_t i = 0; i < D; ++i) {
                float value = LOAD(v[i]);
                sum_squares += value * value;
            }
            float inverse_rms = 1.0f / sqrtf(sum_squares / (float)D + eps);
            for (int64_t i = 0; i < D; ++i) v[i] = STORE(LOAD(weight[i]) * ROUND(LOAD(v[i]) * inverse_rms));
        }
}

/* out [rows, I] = act(gate) * up, where row t of gate_up [rows, 2I] is
 * gate | up; act is rounded before the product, as in PyTorch. Inlined with
 * a constant ``act``, so its arithmetic vectorises. */
static inline __attribute__((always_inline)) void NAME(gated_mul)(const ELEM *gate_up, ELEM *out, int64_t rows,
                                                                  int64_t I, float (*act)(float)) {
    #pragma omp parallel for schedule(static) if (rows * I >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < rows; ++t) {
        const ELEM *gate = gate_up + t * 2 * I, *up = gate + I;
        ELEM *dst = out + t * I;
        for (int64_t i = 0; i < I; ++i) dst[i] = STORE(ROUND(act(LOAD(gate[i]))) * LOAD(up[i]));
    }
}

/* SwiGLU's and GeGLU's (Gemma's) products. */
void NAME(silu_mul)(const ELEM *gate_up, ELEM *out, int64_t rows, int64_t I) {
    NAME(gated_mul)(gate_up, out, rows, I, silu);
}

void NAME(gelu_tanh_mul)(const ELEM *gate_up, ELEM *out, int64_t rows, int64_t I) {
    NAME(gated_mul)(gate_up, out, rows, I, gelu_tanh);
}

#undef ROUND
