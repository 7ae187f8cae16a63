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

/* Each codec's constants, which its Python module states too (by these names, in its
 * kernel_constants; tests/unit/test_kernel_constants.py checks that they agree). */
enum { INT8_LEVELS = 127, INT4_LEVELS = 7, INT4_MAX_BLOCK = 256, INT2_LEVELS = 3 };
static const double INT2_SCALE_OF_MEAN = 2.0 / 3.0;

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

/* ``exact`` rounded up to the next bfloat16 (the top 16 bits of an fp32), so that a
 * scale is stored in 2 bytes and decodes exactly. */
ALWAYS_INLINE float bf16_round_up(float exact, uint16_t *stored) {
    uint32_t bits;
    memcpy(&bits, &exact, sizeof bits);
    bits = (bits + 0xFFFFu) & 0xFFFF0000u;
    *stored = (uint16_t)(bits >> 16);
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return scale;
}

/* The block scale absmax/levels, rounded up: every |x| / scale stays within the levels. */
ALWAYS_INLINE float bf16_scale_up(float absmax, float levels, uint16_t *stored) {
    return bf16_round_up(absmax / levels, stored);
}

/* The level (-3, -1, 1 or 3) of value j of an int2 block's packed codes. */
ALWAYS_INLINE float int2_level(const uint8_t *pb, int64_t j) {
    return (float)(((pb[j / 4] >> (2 * (j % 4))) & 3) * 2 - INT2_LEVELS);
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
    return quantize_levels(x, n, block, INT8_LEVELS, scales, codes, residual);
}

/* int4: codes q+8 in 1..15, two per byte, the even element in the low nibble.  Works in
 * blocks through a small stack buffer so the unpacked codes never leave the cache. */
MULTIVERSION
int64_t diloco_quantize_int4(const float *x, int64_t n, int64_t block, uint16_t *scales,
                             uint8_t *packed, float *residual) {
    enum { CHUNK_BLOCKS = 64 };
    int8_t codes[CHUNK_BLOCKS * INT4_MAX_BLOCK];
    if (block > INT4_MAX_BLOCK || block % 2) return -1;
    int64_t num_blocks = (n + block - 1) / block;
    for (int64_t b0 = 0; b0 < num_blocks; b0 += CHUNK_BLOCKS) {
        int64_t start = b0 * block;
        int64_t len = n - start;
        if (len > CHUNK_BLOCKS * block) len = CHUNK_BLOCKS * block;
        int64_t status = quantize_levels(x + start, len, block, INT4_LEVELS, scales + b0, codes,
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

/* int2: the odd levels q in {-3, -1, 1, 3} of a scale 2/3 of the block's mean absolute
 * value (summed in double, sequentially), rounded up to a bfloat16; values beyond 3 scales
 * are clipped.  Codes (q+3)/2 in 0..3, four per byte, the first value in the lowest bits;
 * a tail short of four is padded with code 0.  Returns 0, or the 1-based index of the
 * first block holding a non-finite value. */
MULTIVERSION
int64_t diloco_quantize_int2(const float *x, int64_t n, int64_t block, uint16_t *scales,
                             uint8_t *packed, float *residual) {
    int64_t num_blocks = (n + block - 1) / block;
    for (int64_t b = 0; b < num_blocks; ++b) {
        int64_t start = b * block;
        int64_t len = n - start < block ? n - start : block;
        const float *xb = x + start;
        float absmax = block_absmax(xb, len);
        if (!(absmax <= MAX_ABSMAX)) return b + 1;
        double sum = 0.0;
        for (int64_t j = 0; j < len; ++j) sum += (double)fabsf(xb[j]);
        float scale = bf16_round_up((float)(sum / (double)len * INT2_SCALE_OF_MEAN), &scales[b]);
        float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
        uint8_t *pb = packed + start / 4;
        for (int64_t j = 0; j < len; j += 4) {
            uint8_t byte = 0;
            for (int k = 0; k < 4 && j + k < len; ++k) {
                float v = xb[j + k] * inverse;
                float half = (v - 1.0f) / 2.0f;
                float r = (half + ROUNDING_MAGIC) - ROUNDING_MAGIC;
                float q = r * 2.0f + 1.0f;
                q = q > INT2_LEVELS ? INT2_LEVELS : (q < -INT2_LEVELS ? -INT2_LEVELS : q);
                byte |= (uint8_t)(((int)q + INT2_LEVELS) / 2) << (2 * k);
                if (residual) residual[start + j + k] = xb[j + k] - q * scale;
            }
            pb[j / 4] = byte;
        }
    }
    return 0;
}

MULTIVERSION
void diloco_dequantize_int2(const uint8_t *packed, const uint16_t *scales, int64_t n,
                            int64_t block, float *out, int accumulate) {
    int64_t num_blocks = (n + block - 1) / block;
    for (int64_t b = 0; b < num_blocks; ++b) {
        int64_t start = b * block;
        int64_t len = n - start < block ? n - start : block;
        float scale = bf16_to_float(scales[b]);
        const uint8_t *pb = packed + start / 4;
        float *ob = out + start;
        for (int64_t j = 0; j < len; ++j) {
            float value = int2_level(pb, j) * scale;
            if (accumulate) ob[j] += value; else ob[j] = value;
        }
    }
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
        float values[INT4_MAX_BLOCK];
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

/* ------------------------------------------------------------------ merge kernels
 *
 * A learner's payload folded straight into a merge's running sums: each tile of a section
 * (one quantization block, or 1024 values of a float format) is decoded into a stack
 * buffer, anchored on the drift (g = drift + q*scale, the product rounded to fp32 first,
 * exactly as decoding onto the drift does) and then either squared into a float64 sum
 * (the norm) or added, times its weights, into the running sums.  Nothing
 * fragment-sized is written but the sums.
 *
 * Every call covers one chunk of a tensor starting at a block boundary (codes, scales and
 * drift point at the chunk's first value).  The caller cuts tensors into fixed chunks
 * whatever its thread count, and adds the chunks' partial sums in chunk order, so results
 * do not depend on the number of threads.
 */

enum { KIND_FP32 = 0, KIND_BF16 = 1, KIND_INT8 = 2, KIND_INT4 = 3, KIND_INT2 = 4 };
enum { MAX_TILE = 4096, FLOAT_TILE = 1024 };

/* Values [start, start + len) of a chunk, decoded: a pointer into the section itself for
 * fp32, else into values.  A tile of a quantized format is one block. */
ALWAYS_INLINE const float *decode_tile(int kind, const void *codes, const uint16_t *scales,
                                       int64_t start, int64_t len, int64_t block,
                                       float *values) {
    if (kind == KIND_FP32) return (const float *)codes + start;
    if (kind == KIND_BF16) {
        const uint16_t *stored = (const uint16_t *)codes + start;
        for (int64_t j = 0; j < len; ++j) values[j] = bf16_to_float(stored[j]);
        return values;
    }
    float scale = bf16_to_float(scales[start / block]);
    if (kind == KIND_INT8) {
        const int8_t *qb = (const int8_t *)codes + start;
        for (int64_t j = 0; j < len; ++j) values[j] = (float)qb[j] * scale;
        return values;
    }
    if (kind == KIND_INT2) {
        const uint8_t *pb = (const uint8_t *)codes + start / 4;
        for (int64_t j = 0; j < len; ++j)
            values[j] = int2_level(pb, j) * scale;
        return values;
    }
    const uint8_t *pb = (const uint8_t *)codes + start / 2;
    int64_t pairs = len / 2;
    for (int64_t j = 0; j < pairs; ++j) {
        values[2 * j] = (float)((int)(pb[j] & 15) - 8) * scale;
        values[2 * j + 1] = (float)((int)(pb[j] >> 4) - 8) * scale;
    }
    if (len % 2) values[len - 1] = (float)((int)(pb[pairs] & 15) - 8) * scale;
    return values;
}

ALWAYS_INLINE int64_t tile_of(int kind, int64_t block) {
    return kind >= KIND_INT8 ? block : FLOAT_TILE;
}

/* Sum over the chunk of g*g in float64, g = drift + decoded (drift may be NULL).
 * Returns -1 for a block larger than the tile buffer. */
MULTIVERSION
double diloco_fold_sumsq(int kind, const void *codes, const uint16_t *scales, int64_t n,
                         int64_t block, const float *drift) {
    int64_t tile = tile_of(kind, block);
    if (tile > MAX_TILE) return -1.0;
    if (kind == KIND_INT4 && !drift) {
        /* Without a drift every g is q*scale, exact in fp32 and its square exact in
         * float64: a block's sum is scale^2 * (the integer sum of q^2), from the codes
         * alone.  The blocks' sums are added in order. */
        const uint8_t *packed = (const uint8_t *)codes;
        double sum = 0.0;
        for (int64_t start = 0; start < n; start += block) {
            int64_t len = n - start < block ? n - start : block;
            const uint8_t *pb = packed + start / 2;
            int32_t squares = 0;
            for (int64_t j = 0; j < len / 2; ++j) {
                int32_t low = (int32_t)(pb[j] & 15) - 8, high = (int32_t)(pb[j] >> 4) - 8;
                squares += low * low + high * high;
            }
            if (len % 2) {
                int32_t low = (int32_t)(pb[len / 2] & 15) - 8;
                squares += low * low;
            }
            double scale = (double)bf16_to_float(scales[start / block]);
            sum += (double)squares * (scale * scale);
        }
        return sum;
    }
    double lanes[LANES] = {0};
    float values[MAX_TILE];
    for (int64_t start = 0; start < n; start += tile) {
        int64_t len = n - start < tile ? n - start : tile;
        const float *v = decode_tile(kind, codes, scales, start, len, block, values);
        const float *d = drift ? drift + start : NULL;
        int64_t j = 0;
        if (d) {
            for (; j + LANES <= len; j += LANES) {
                for (int k = 0; k < LANES; ++k) {
                    float g = d[j + k] + v[j + k];
                    lanes[k] += (double)g * (double)g;
                }
            }
            for (int k = 0; j < len; ++j, ++k) {
                float g = d[j] + v[j];
                lanes[k] += (double)g * (double)g;
            }
        } else {
            for (; j + LANES <= len; j += LANES) {
                for (int k = 0; k < LANES; ++k) lanes[k] += (double)v[j + k] * (double)v[j + k];
            }
            for (int k = 0; j < len; ++j, ++k) lanes[k] += (double)v[j] * (double)v[j];
        }
    }
    double sum = 0.0;
    for (int k = 0; k < LANES; ++k) sum += lanes[k];
    return sum;
}

/* sum = weight * g (overwrite) or sum += weight * g, the product rounded to fp32 first. */
ALWAYS_INLINE void fold_into(float *sum, const float *g, int64_t len, float weight, int overwrite) {
    if (overwrite) {
        for (int64_t j = 0; j < len; ++j) sum[j] = 0.0f + weight * g[j];
    } else {
        for (int64_t j = 0; j < len; ++j) sum[j] += weight * g[j];
    }
}

/* weighted += weight * g and unit += unit_weight * g over the chunk, g = drift + decoded
 * (drift, weighted and unit may each be NULL).  Bit 1 of overwrite makes the first
 * write to weighted, bit 2 the first to unit (no zeroing pass before the first
 * arrival).  Returns -1 for a block larger than the tile buffer, else 0. */
MULTIVERSION
int diloco_fold_sums(int kind, const void *codes, const uint16_t *scales, int64_t n,
                     int64_t block, const float *drift, float *weighted, float weight,
                     float *unit, float unit_weight, int overwrite) {
    int64_t tile = tile_of(kind, block);
    if (tile > MAX_TILE) return -1;
    float values[MAX_TILE];
    float anchored[MAX_TILE];
    for (int64_t start = 0; start < n; start += tile) {
        int64_t len = n - start < tile ? n - start : tile;
        const float *g = decode_tile(kind, codes, scales, start, len, block, values);
        if (drift) {
            const float *d = drift + start;
            for (int64_t j = 0; j < len; ++j) anchored[j] = d[j] + g[j];
            g = anchored;
        }
        if (weighted) fold_into(weighted + start, g, len, weight, overwrite & 1);
        if (unit) fold_into(unit + start, g, len, unit_weight, overwrite & 2);
    }
    return 0;
}
