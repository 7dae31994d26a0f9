/* DIVISION's codec for channels-last maps (memory order N, H, W, C), as a compiled graph on a CPU lays out
 * its activations: the same quantities as division_cpu.c (LFC = block means rounded to bf16, HFC = x minus
 * the upsampled LFC, a minimum and scale per (sample, channel) in fp32, stochastic rounding), computed with
 * the channels as the vector lanes, so that no map is copied to (N, C, H, W) order and back. The LFC is
 * written (N, C, H/bh, W/bw) as the NCHW kernel writes it; the codes follow the memory order (N, H, W, C),
 * packed little end first, one sample's codes in whole bytes. OpenMP over samples. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bits.h"

/* at[col] = (col / bw) * c: where a pixel column's block starts in a row of per-block vectors. A table,
 * because a division per pixel cost more than the pixel's work with 16 channels (one vector). NULL when
 * memory runs out. */
static int64_t *block_offsets(int64_t w, int64_t bw, int64_t c) {
    int64_t *at = malloc((size_t)w * sizeof(int64_t));
    if (at)
        for (int64_t col = 0; col < w; col++) at[col] = (col / bw) * c;
    return at;
}

/* a = 0, lo = +Inf, hi = -Inf over n elements: empty sums and ranges for add_min_max. */
static inline void reset_sums(int64_t n, float *restrict a, float *restrict lo, float *restrict hi) {
    for (int64_t e = 0; e < n; e++) {
        a[e] = 0.0f;
        lo[e] = INFINITY;
        hi[e] = -INFINITY;
    }
}

/* a += x, lo = min(lo, x), hi = max(hi, x) over n elements; returns nonzero if any x is NaN or Inf. */
static inline uint32_t add_min_max(const float *restrict x, int64_t n, float *restrict a, float *restrict lo,
                                   float *restrict hi) {
    uint32_t nonfinite = 0;
#pragma omp simd reduction(|:nonfinite)
    for (int64_t e = 0; e < n; e++) {
        const float v = x[e];
        uint32_t u;
        memcpy(&u, &v, 4);
        nonfinite |= (u & 0x7F800000u) == 0x7F800000u;
        a[e] += v;
        lo[e] = v < lo[e] ? v : lo[e];
        hi[e] = v > hi[e] ? v : hi[e];
    }
    return nonfinite;
}

/* Codes of n elements: (x - l - m) * inv rounded up with probability its fraction (draws r16) or to nearest
 * (r16 NULL), clamped to [0, top]. */
static inline void quantize_run(const float *restrict x, const float *restrict l, const float *restrict m,
                                const float *restrict inv, const uint16_t *restrict r16, int64_t n, int top,
                                uint8_t *restrict out) {
    if (r16) {
#pragma omp simd
        for (int64_t e = 0; e < n; e++) {
            const float u = ((float)r16[e] + 0.5f) * (1.0f / 65536.0f);
            const float v = (x[e] - l[e] - m[e]) * inv[e] + u;
            const int q = v > 0.0f ? (int)v : 0;  /* truncation == floor for v >= 0 */
            out[e] = (uint8_t)(q < top ? q : top);
        }
    } else {
#pragma omp simd
        for (int64_t e = 0; e < n; e++) {
            const float v = (x[e] - l[e] - m[e]) * inv[e] + 0.5f;
            const int q = v > 0.0f ? (int)v : 0;
            out[e] = (uint8_t)(q < top ? q : top);
        }
    }
}

/* Maps with fewer than 64 channels and rows of at most this many elements (w * c; three float rows fit in
 * L1) are encoded in flat loops along each image row: the block sums and ranges per column, then per block,
 * and the codes against rows of per-element operands. Per pixel, each pixel's one or two vectors were added
 * into the same block's accumulators as the pixel before (a chain through memory) and every pixel paid a
 * loop's set-up: 128x16x32x32 encoded in 1.97 ms, 0.66 ms flat (the NCHW kernel: 0.69 ms); with 64 channels
 * and more the per-pixel loops are as fast. The block sums then add in another order: an LFC value may
 * differ in the last bit before its rounding to bf16. */
#define FLAT_ROW 2048

/* Returns the number of (sample, channel) maps holding a NaN or Inf (their codes are not written), or -1 when
 * a sample's codes do not fill whole bytes or memory runs out (the caller takes another path). */
int division_encode_nhwc(const float *x, int64_t n, int64_t h, int64_t w, int64_t c, int64_t bh, int64_t bw,
                         int bits, uint64_t seed, int stochastic, uint16_t *lfc, float *minimum, float *scale,
                         uint8_t *packed, int threads) {
    const int shift = bits == 1 ? 3 : (bits == 2 ? 2 : (bits == 4 ? 1 : 0));
    const int64_t hwc = h * w * c, hb = (h + bh - 1) / bh, wb = (w + bw - 1) / bw;
    if (hwc & ((1 << shift) - 1)) return -1;
    const float levels = (float)((1 << bits) - 1);
    const int top = (int)levels;
    int64_t *at = block_offsets(w, bw, c);
    if (!at) return -1;
    const int64_t wc = w * c;
    const int flat = c < 64 && wc <= FLAT_ROW;
    int bad = 0, failed = 0;
#pragma omp parallel num_threads(threads) reduction(+:bad, failed)
    {
        /* three rows of wc floats, 192 bytes apart beyond their length: rows a multiple of 4 KiB apart made
         * loads and stores of different rows alias in the CPU's store buffer (runs 1.5x slower at random) */
        const int64_t stride = wc + 48;
        float *csum = flat ? malloc((size_t)(3 * stride) * sizeof(float)) : NULL;
        float *cmin = csum ? csum + stride : NULL, *cmax = csum ? csum + 2 * stride : NULL;
        float *lf = malloc((size_t)(hb * wb * c) * sizeof(float));
        float *acc = malloc((size_t)(wb * c) * sizeof(float));
        float *bmn = malloc((size_t)(wb * c) * sizeof(float)), *bmx = malloc((size_t)(wb * c) * sizeof(float));
        float *mn = malloc((size_t)c * sizeof(float)), *mx = malloc((size_t)c * sizeof(float));
        float *inv = malloc((size_t)c * sizeof(float));
        uint8_t *cbuf = malloc((size_t)hwc);
        uint16_t *rnd = malloc((size_t)(hwc + 1) / 2 * sizeof(uint32_t));
#pragma omp for schedule(static)
        for (int64_t s = 0; s < n; s++) {
            if (!lf || !acc || !bmn || !bmx || !mn || !mx || !inv || !cbuf || !rnd || (flat && !csum)) {
                failed += 1;
                continue;
            }
            const float *restrict xs = x + s * hwc;
            for (int64_t ch = 0; ch < c; ch++) {
                mn[ch] = INFINITY;
                mx[ch] = -INFINITY;
            }
            uint32_t nonfinite = 0;
            for (int64_t i = 0; i < hb; i++) {  /* one block row in one pass: each block's sum, minimum, maximum */
                const int64_t r0 = i * bh, r1 = r0 + bh < h ? r0 + bh : h;
                reset_sums(wb * c, acc, bmn, bmx);
                if (flat) {  /* short rows: per column over the rows, flat, then per block (see FLAT_ROW) */
                    reset_sums(wc, csum, cmin, cmax);
                    for (int64_t r = r0; r < r1; r++) nonfinite |= add_min_max(xs + r * wc, wc, csum, cmin, cmax);
                    for (int64_t col = 0; col < w; col++) {
                        float *restrict a = acc + at[col], *restrict lo = bmn + at[col], *restrict hi = bmx + at[col];
                        const float *restrict cs = csum + col * c, *restrict cl = cmin + col * c,
                                                  *restrict chh = cmax + col * c;
#pragma omp simd
                        for (int64_t ch = 0; ch < c; ch++) {
                            a[ch] += cs[ch];
                            lo[ch] = cl[ch] < lo[ch] ? cl[ch] : lo[ch];
                            hi[ch] = chh[ch] > hi[ch] ? chh[ch] : hi[ch];
                        }
                    }
                } else {
                    for (int64_t r = r0; r < r1; r++)
                        for (int64_t col = 0; col < w; col++)
                            nonfinite |= add_min_max(xs + (r * w + col) * c, c, acc + at[col], bmn + at[col],
                                                     bmx + at[col]);
                }
                /* The HFC's range without a second pass: within a block the LFC l is one number and rounding
                 * is monotonic, so min(x - l) == min(x) - l exactly (the same for the maximum). */
                for (int64_t j = 0; j < wb; j++) {
                    const int64_t w0 = j * bw, w1 = w0 + bw < w ? w0 + bw : w;
                    const float count = (float)((r1 - r0) * (w1 - w0));
                    for (int64_t ch = 0; ch < c; ch++) {
                        const uint16_t b = f32_to_bf16(acc[j * c + ch] / count);
                        const float l = bf16_to_f32(b);
                        lfc[((s * c + ch) * hb + i) * wb + j] = b;
                        lf[(i * wb + j) * c + ch] = l;
                        const float lo = bmn[j * c + ch] - l, hi = bmx[j * c + ch] - l;
                        mn[ch] = lo < mn[ch] ? lo : mn[ch];
                        mx[ch] = hi > mx[ch] ? hi : mx[ch];
                    }
                }
            }
            int bad_here = 0;
            for (int64_t ch = 0; ch < c; ch++) {
                const int ok = isfinite(mn[ch]) && isfinite(mx[ch]) && isfinite(mx[ch] - mn[ch]);
                bad_here += !ok;
                const float sc = ok ? (mx[ch] - mn[ch]) / levels : 0.0f;
                minimum[s * c + ch] = mn[ch];
                scale[s * c + ch] = sc;
                inv[ch] = sc > 0.0f ? 1.0f / sc : 0.0f;
            }
            if (nonfinite && !bad_here) bad_here = 1;  /* a NaN leaves the range finite (comparisons skip it) */
            if (bad_here) {
                bad += bad_here;
                continue;
            }
            if (stochastic)
                rounding_draws((uint32_t)splitmix64(seed ^ (0xD1B54A32D192ED03ull * (uint64_t)(s + 1))), hwc, rnd);
            if (flat) {  /* codes, a row at a time against per-element rows of the LFC, minimum, 1 / scale */
                float *restrict lrow = csum, *restrict mnrow = cmin, *restrict invrow = cmax;  /* reused */
                for (int64_t col = 0; col < w; col++) {
                    memcpy(mnrow + col * c, mn, (size_t)c * sizeof(float));
                    memcpy(invrow + col * c, inv, (size_t)c * sizeof(float));
                }
                for (int64_t r = 0; r < h; r++) {
                    if (r % bh == 0)
                        for (int64_t col = 0; col < w; col++)
                            memcpy(lrow + col * c, lf + (r / bh) * wb * c + at[col], (size_t)c * sizeof(float));
                    quantize_run(xs + r * wc, lrow, mnrow, invrow, stochastic ? rnd + r * wc : NULL, wc, top,
                                 cbuf + r * wc);
                }
            } else {
                for (int64_t r = 0; r < h; r++)  /* codes */
                    for (int64_t col = 0; col < w; col++) {
                        const int64_t p = (r * w + col) * c;
                        quantize_run(xs + p, lf + (r / bh) * wb * c + at[col], mn, inv, stochastic ? rnd + p : NULL, c,
                                     top, cbuf + p);
                    }
            }
            pack_aligned(cbuf, hwc, bits, packed + ((s * hwc) >> shift));
        }
        free(csum);
        free(lf);
        free(acc);
        free(bmn);
        free(bmx);
        free(mn);
        free(mx);
        free(inv);
        free(cbuf);
        free(rnd);
    }
    free(at);
    return failed ? -1 : bad;
}

/* n decoded elements, o = b + code * sc, starting at element ``first`` of the tensor. ``signs`` (or NULL): a
 * ReLU output's exact mask, one bit per element: at least ``floor`` where set, exactly 0 elsewhere. ``bit``:
 * n + 8 bytes of scratch. */
static inline void decode_run(const float *restrict b, const uint8_t *restrict code, const float *restrict sc,
                              int64_t n, float *restrict o, const uint8_t *restrict signs, int64_t first,
                              float floor, uint8_t *restrict bit) {
    if (signs && (first & 7) == 0 && (n & 7) == 0) {  /* the run's bits are whole bytes: spread to 0/1 bytes */
        for (int64_t k = 0; k < n / 8; k++) {
            const uint64_t t = spread_bits(signs[(first >> 3) + k]);
            memcpy(bit + 8 * k, &t, 8);
        }
#pragma omp simd
        for (int64_t e = 0; e < n; e++) {
            const float v = b[e] + (float)code[e] * sc[e];
            o[e] = (v > floor ? v : floor) * (float)bit[e];
        }
    } else if (signs) {
        for (int64_t e = 0; e < n; e++) {
            const int64_t g = first + e;
            const float v = b[e] + (float)code[e] * sc[e];
            o[e] = ((signs[g >> 3] >> (g & 7)) & 1) ? (v > floor ? v : floor) : 0.0f;
        }
    } else {
#pragma omp simd
        for (int64_t e = 0; e < n; e++) o[e] = b[e] + (float)code[e] * sc[e];
    }
}

/* Inverse of division_encode_nhwc into ``out`` (memory order N, H, W, C), a ReLU output's ``signs`` applied
 * in the same pass (see decode_run). Short rows of few channels in flat loops, as the encode. Returns -1 when
 * memory runs out. */
int division_decode_nhwc(const uint8_t *packed, const uint16_t *lfc, const float *minimum, const float *scale,
                         int64_t n, int64_t h, int64_t w, int64_t c, int64_t bh, int64_t bw, int bits, float *out,
                         int threads, const uint8_t *signs, float floor) {
    const int shift = bits == 1 ? 3 : (bits == 2 ? 2 : (bits == 4 ? 1 : 0));
    const int64_t hwc = h * w * c, hb = (h + bh - 1) / bh, wb = (w + bw - 1) / bw;
    if (hwc & ((1 << shift) - 1)) return -1;
    int64_t *at = block_offsets(w, bw, c);
    if (!at) return -1;
    const int64_t wc = w * c, stride = wc + 48;  /* rows off 4 KiB multiples, as in the encode */
    const int flat = c < 64 && wc <= FLAT_ROW;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(+:failed)
    {
        float *base = malloc((size_t)(wb * c) * sizeof(float));
        float *rows = flat ? malloc((size_t)(2 * stride) * sizeof(float)) : NULL;
        uint8_t *cbuf = malloc((size_t)hwc), *bit = malloc((size_t)(flat ? wc : c) + 8);
#pragma omp for schedule(static)
        for (int64_t s = 0; s < n; s++) {
            if (!base || !cbuf || !bit || (flat && !rows)) {
                failed += 1;
                continue;
            }
            unpack_aligned(packed + ((s * hwc) >> shift), hwc, bits, cbuf);
            const float *restrict sc = scale + s * c;
            float *restrict brow = rows, *restrict scrow = rows ? rows + stride : NULL;
            if (flat)
                for (int64_t col = 0; col < w; col++) memcpy(scrow + col * c, sc, (size_t)c * sizeof(float));
            for (int64_t i = 0; i < hb; i++) {
                for (int64_t j = 0; j < wb; j++)  /* minimum + LFC of each block of this block row */
                    for (int64_t ch = 0; ch < c; ch++)
                        base[j * c + ch] = minimum[s * c + ch] + bf16_to_f32(lfc[((s * c + ch) * hb + i) * wb + j]);
                if (flat)
                    for (int64_t col = 0; col < w; col++)
                        memcpy(brow + col * c, base + at[col], (size_t)c * sizeof(float));
                const int64_t r1 = (i + 1) * bh < h ? (i + 1) * bh : h;
                for (int64_t r = i * bh; r < r1; r++) {
                    const int64_t p = s * hwc + r * wc;
                    if (flat) {
                        decode_run(brow, cbuf + r * wc, scrow, wc, out + p, signs, p, floor, bit);
                        continue;
                    }
                    for (int64_t col = 0; col < w; col++)
                        decode_run(base + at[col], cbuf + (r * w + col) * c, sc, c, out + p + col * c, signs,
                                   p + col * c, floor, bit);
                }
            }
        }
        free(base);
        free(rows);
        free(cbuf);
        free(bit);
    }
    free(at);
    return failed ? -1 : 0;
}
