/* What the CPU kernels share: bfloat16 conversions and a vectorisable exp. */

#ifndef CADENCE_KERNEL_COMMON_H
#define CADENCE_KERNEL_COMMON_H

#include <stdint.h>
#include <string.h>

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
