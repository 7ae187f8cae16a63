/*
 * Fused block-wise absmax quantization kernels for the diloco codec.
 *
 * One pass per block: find the block's absolute maximum, derive its scale (a bfloat16,
 * rounded up), round every
 * value to the nearest level (ties to even, like torch.round), pack the codes and, when
 * asked, write the quantization residual x - q*scale for error feedback.  Decoding
 * multiplies each code by its block's scale and either stores or adds the result.
 *
 * These functions are loaded with ctypes (no Python C-API).  They must produce exactly
 * what the torch reference in quantize.py produces, so the build disables floating-point
 * contraction (-ffp-contract=off): q*scale is rounded to fp32 before any add.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 8

/* On x86-64, compile each exported kernel twice, for AVX2 and for the baseline, and pick
 * one at load time (GCC/clang function multiversioning); both round identically. */
#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define MULTIVERSION __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef MULTIVERSION
#define MULTIVERSION
#endif
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* 1.5 * 2^23: adding and subtracting it rounds |v| < 2^22 to the nearest integer,
 * ties to even, in the default rounding mode, using only vectorisable adds. */
static const float ROUNDING_MAGIC = 12582912.0f;

/* Beyond this, absmax / levels rounded up to a bfloat16 would overflow. */
static const float MAX_ABSMAX = 3.0e38f;

/* Absolute maximum of n values.  Clearing the sign bit makes an IEEE float's bit pattern
 * order like its value, so an integer max (which vectorises) finds it; NaN and infinity
 * have the largest patterns, so a non-finite block shows up as a non-finite maximum. */
ALWAYS_INLINE float block_absmax(const float *x, int64_t n) {
    const int32_t *bits = (const int32_t *)x;
    int32_t lanes[LANES] = {0};
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES) {
        for (int k = 0; k < LANES; ++k) {
            int32_t a = bits[j + k] & 0x7fffffff;
            lanes[k] = a > lanes[k] ? a : lanes[k];
        }
    }
    int32_t m = 0;
    for (; j < n; ++j) {
        int32_t a = bits[j] & 0x7fffffff;
        m = a > m ? a : m;
    }
    for (int k = 0; k < LANES; ++k) m = lanes[k] > m ? lanes[k] : m;
    float result;
    memcpy(&result, &m, sizeof result);
    return result;
}

/* The block scale absmax/levels rounded up to the next bfloat16 (the top 16 bits of an
 * fp32), so that it is stored in 2 bytes and decodes exactly; rounding up keeps every
 * |x| / scale within the levels. */
ALWAYS_INLINE float bf16_scale_up(float absmax, float levels, uint16_t *stored) {
    float exact = absmax / levels;
    uint32_t bits;
    memcpy(&bits, &exact, sizeof bits);
    bits = (bits + 0xFFFFu) & 0xFFFF0000u;
    *stored = (uint16_t)(bits >> 16);
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return scale;
}

ALWAYS_INLINE float bf16_to_float(uint16_t stored) {
    uint32_t bits = (uint32_t)stored << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* Quantize n values to signed integers in [-levels, levels] per block.  Writes one
 * bfloat16 scale per block and one int8 code per value (later packed for int4).  Returns
 * 0, or the 1-based index of the first block holding a non-finite value. */
MULTIVERSION
static int64_t quantize_levels(const float *x, int64_t n, int64_t block, int levels,
                               uint16_t *scales, int8_t *codes, float *residual) {
    const float flevels = (float)levels;
    int64_t num_blocks = (n + block - 1) / block;
    for (int64_t b = 0; b < num_blocks; ++b) {
        int64_t start = b * block;
        int64_t len = n - start < block ? n - start : block;
        const float *xb = x + start;
        float absmax = block_absmax(xb, len);
        if (!(absmax <= MAX_ABSMAX)) return b + 1; /* NaN, infinity, or a scale overflow */
        float scale = bf16_scale_up(absmax, flevels, &scales[b]);
        float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
        int8_t *qb = codes + start;
        for (int64_t j = 0; j < len; ++j) {
            float v = xb[j] * inverse;
            float r = (v + ROUNDING_MAGIC) - ROUNDING_MAGIC;
            r = r > flevels ? flevels : (r < -flevels ? -flevels : r);
            qb[j] = (int8_t)r;
        }
        if (residual) {
            float *eb = residual + start;
            for (int64_t j = 0; j < len; ++j) eb[j] = xb[j] - (float)qb[j] * scale;
        }
    }
    return 0;
}

int64_t diloco_quantize_int8(const float *x, int64_t n, int64_t block, uint16_t *scales,
                             int8_t *codes, float *residual) {
    return quantize_levels(x, n, block, 127, scales, codes, residual);
}

/* int4: codes q+8 in 1..15, two per byte, the even element in the low nibble.  Works in
 * blocks through a small stack buffer so the unpacked codes never leave the cache. */
MULTIVERSION
int64_t diloco_quantize_int4(const float *x, int64_t n, int64_t block, uint16_t *scales,
                             uint8_t *packed, float *residual) {
    enum { CHUNK_BLOCKS = 64 };
    int8_t codes[CHUNK_BLOCKS * 256];
    if (block > 256 || block % 2) return -1;
    int64_t num_blocks = (n + block - 1) / block;
    for (int64_t b0 = 0; b0 < num_blocks; b0 += CHUNK_BLOCKS) {
        int64_t start = b0 * block;
        int64_t len = n - start;
        if (len > CHUNK_BLOCKS * block) len = CHUNK_BLOCKS * block;
        int64_t status = quantize_levels(x + start, len, block, 7, scales + b0, codes,
                                         residual ? residual + start : NULL);
        if (status) return b0 + status;
        uint8_t *pb = packed + start / 2;
        int64_t pairs = len / 2;
        for (int64_t j = 0; j < pairs; ++j)
            pb[j] = (uint8_t)((codes[2 * j] + 8) | ((codes[2 * j + 1] + 8) << 4));
        if (len % 2) pb[pairs] = (uint8_t)(codes[len - 1] + 8) | (uint8_t)(8 << 4);
    }
    return 0;
}

/* out = q*scale (accumulate == 0) or out += q*scale (accumulate != 0). */
MULTIVERSION
void diloco_dequantize_int8(const int8_t *codes, const uint16_t *scales, int64_t n,
                            int64_t block, float *out, int accumulate) {
    int64_t num_blocks = (n + block - 1) / block;
    for (int64_t b = 0; b < num_blocks; ++b) {
        int64_t start = b * block;
        int64_t len = n - start < block ? n - start : block;
        float scale = bf16_to_float(scales[b]);
        const int8_t *qb = codes + start;
        float *ob = out + start;
        if (accumulate) {
            for (int64_t j = 0; j < len; ++j) ob[j] += (float)qb[j] * scale;
        } else {
            for (int64_t j = 0; j < len; ++j) ob[j] = (float)qb[j] * scale;
        }
    }
}

MULTIVERSION
void diloco_dequantize_int4(const uint8_t *packed, const uint16_t *scales, int64_t n,
                            int64_t block, float *out, int accumulate) {
    int64_t num_blocks = (n + block - 1) / block;
    for (int64_t b = 0; b < num_blocks; ++b) {
        int64_t start = b * block;
        int64_t len = n - start < block ? n - start : block;
        float scale = bf16_to_float(scales[b]);
        const uint8_t *pb = packed + start / 2;
        float *ob = out + start;
        int64_t pairs = len / 2;
        float values[256];
        for (int64_t j = 0; j < pairs; ++j) {
            values[2 * j] = (float)((int)(pb[j] & 15) - 8) * scale;
            values[2 * j + 1] = (float)((int)(pb[j] >> 4) - 8) * scale;
        }
        if (len % 2) values[len - 1] = (float)((int)(pb[pairs] & 15) - 8) * scale;
        if (accumulate) {
            for (int64_t j = 0; j < len; ++j) ob[j] += values[j];
        } else {
            memcpy(ob, values, (size_t)len * sizeof(float));
        }
    }
}
