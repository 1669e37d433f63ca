/* What the CPU kernels share: bfloat16 and float16 conversions and a
 * vectorisable exp. */

#ifndef CADENCE_KERNEL_COMMON_H
#define CADENCE_KERNEL_COMMON_H

#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

static inline float bf16_to_float(uint16_t bits) {
    uint32_t widened = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &widened, sizeof value);
    return value;
}

/* Round to nearest even, as PyTorch does; NaN stays NaN. */
static inline uint16_t float_to_bf16(float value) {
    union { uint32_t u; float f; } cast;
    cast.f = value;
    if ((cast.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((cast.u >> 16) | 0x40u);
    cast.u += 0x7fffu + ((cast.u >> 16) & 1u);
    return (uint16_t)(cast.u >> 16);
}

/* n bfloat16 values widened to float32 (exact). */
static inline void bf16_row_to_float(float *dst, const uint16_t *src, int n) {
    for (int i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
}

/* IEEE half to float, exactly (subnormals, infinities and NaN included): one
 * instruction where the CPU has F16C. Always inlined: quant_matmul.c's products,
 * compiled with other float options (no reassociation), call it in their loops. */
static inline __attribute__((always_inline)) float f16_to_float(uint16_t half) {
#if defined(__F16C__)
    return _cvtsh_ss(half);
#endif
    uint32_t sign = (uint32_t)(half & 0x8000u) << 16;
    uint32_t exponent = (half >> 10) & 0x1fu, mantissa = half & 0x3ffu, bits;
    if (exponent == 0x1fu) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13); /* rebias 15 -> 127 */
    } else {
        float value = (float)mantissa * 5.9604644775390625e-08f; /* 0 or mantissa * 2^-24 */
        return sign ? -value : value;
    }
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* float to IEEE half, rounded to nearest even as PyTorch rounds; overflow
 * gives infinity, NaN stays NaN. */
static inline uint16_t float_to_f16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    const uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
    const uint32_t magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return sign | 0x7e00u | (uint16_t)((magnitude >> 13) & 0x1ffu);
    if (magnitude >= 0x477ff000u) return sign | 0x7c00u; /* >= 65520 rounds up to infinity */
    if (magnitude >= 0x38800000u) {                       /* a normal half: >= 2^-14 */
        const uint32_t rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u);
        return sign | (uint16_t)((rounded - 0x38000000u) >> 13); /* rebias 127 -> 15 */
    }
    if (magnitude <= 0x33000000u) return sign; /* <= 2^-25: zero (2^-25 ties to even) */
    /* A subnormal half: in units of 2^-24, the 24-bit significand shifted right. */
    const uint32_t exponent = magnitude >> 23, significand = (magnitude & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exponent, halfway = 1u << (shift - 1);
    uint32_t units = significand >> shift;
    const uint32_t rest = significand & ((1u << shift) - 1);
    if (rest > halfway || (rest == halfway && (units & 1u))) ++units;
    return sign | (uint16_t)units;
}

/* n float16 values widened to float32: eight per instruction where the CPU
 * has F16C, one by one in plain C elsewhere. */
static inline void f16_row_to_float(float *dst, const uint16_t *src, int n) {
    int i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; ++i) dst[i] = f16_to_float(src[i]);
}

/* A q8_0 cache row (llama.cpp's block_q8_0, as --cache-type-k q8_0 keeps
 * keys): each 32 values are 34 bytes, a float16 scale d then 32 int8 q,
 * value = d * q. Written with d = max|x| / 127 and q = x / d rounded to
 * nearest even (as torch.round, so the PyTorch path writes the same bytes:
 * cadence/runner/kv_quant.py). n is a multiple of Q8_0_VALUES. */
#define Q8_0_VALUES 32
#define Q8_0_BYTES 34

static inline void q8_0_row_to_float(float *dst, const uint8_t *src, int n) {
    for (int b = 0; b < n / Q8_0_VALUES; ++b, src += Q8_0_BYTES, dst += Q8_0_VALUES) {
        uint16_t half;
        memcpy(&half, src, sizeof half);
        const float d = f16_to_float(half);
        const int8_t *q = (const int8_t *)(src + 2);
        for (int i = 0; i < Q8_0_VALUES; ++i) dst[i] = d * (float)q[i];
    }
}

static inline void float_row_to_q8_0(uint8_t *dst, const float *src, int64_t n) {
    for (int64_t b = 0; b < n / Q8_0_VALUES; ++b, src += Q8_0_VALUES, dst += Q8_0_BYTES) {
        float amax = 0.0f;
        for (int i = 0; i < Q8_0_VALUES; ++i) {
            float a = src[i] < 0 ? -src[i] : src[i];
            amax = a > amax ? a : amax;
        }
        const float d = amax / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
        const uint16_t half = float_to_f16(d);
        memcpy(dst, &half, sizeof half);
        int8_t *q = (int8_t *)(dst + 2);
        for (int i = 0; i < Q8_0_VALUES; ++i) q[i] = (int8_t)__builtin_rintf(src[i] * inverse);
    }
}

/* e^x to about 1 ulp for float32, in plain arithmetic the compiler can
 * vectorise (expf is a library call it leaves scalar): x = n ln2 + r with
 * |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial, times 2^n. */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = __builtin_roundf(x * 1.44269504088896341f);
    /* ln 2 split in two, so n * ln2 loses no digits */
    float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * scale.f;
}

#endif
