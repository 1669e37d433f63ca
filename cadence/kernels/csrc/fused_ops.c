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
 * Rows are split over OpenMP threads when there are enough of them; loaded
 * after torch, this library shares torch's libgomp and thread count.
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

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
