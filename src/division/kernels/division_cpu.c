/* Fused CPU kernels for DIVISION's codec (one pass per (sample, channel) map, OpenMP over maps).
 * Layout and arithmetic follow the reference implementation in division/codecs: LFC = block means rounded
 * to bf16, HFC = x - upsample(LFC), per-map minimum and scale in fp32, stochastic rounding (a counter-based
 * hash per element), codes packed little-end first, 8/bits codes per byte over the flattened tensor. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bits.h"
#include "narrow.h"
#include "split.h"

/* Means of the blocks of one block row (``rows`` x w) -> bf16 (lm, wb values); ``colsum`` is left holding
 * the stored means upsampled along the row. */
static void block_row_means(const float *restrict xr, int64_t rows, int64_t w, int64_t bw, uint16_t *restrict lm,
                            float *restrict colsum) {
    const int64_t wb = (w + bw - 1) / bw;
    for (int64_t c = 0; c < w; c++) colsum[c] = 0.0f;
    for (int64_t r = 0; r < rows; r++)
#pragma omp simd
        for (int64_t c = 0; c < w; c++) colsum[c] += xr[r * w + c];
    for (int64_t j = 0; j < wb; j++) {
        const int64_t w0 = j * bw, w1 = w0 + bw < w ? w0 + bw : w;
        float s = 0.0f;
        for (int64_t c = w0; c < w1; c++) s += colsum[c];
        const uint16_t b = f32_to_bf16(s / (float)(rows * (w1 - w0)));
        lm[j] = b;
        const float l = bf16_to_f32(b);
        for (int64_t c = w0; c < w1; c++) colsum[c] = l;
    }
}

/* Block means of one map -> bf16 LFC (lm), and ``up``: the stored LFC upsampled to the map plus ``offset``.
 * Column sums run along rows (vectorised over the width); the rest is one value per block. */
static void lfc_of_map(const float *restrict xm, int64_t h, int64_t w, int64_t bh, int64_t bw, uint16_t *restrict lm,
                       float *restrict colsum, float *restrict up) {
    const int64_t wb = (w + bw - 1) / bw;
    for (int64_t r0 = 0; r0 < h; r0 += bh) {
        const int64_t r1 = r0 + bh < h ? r0 + bh : h;
        block_row_means(xm + r0 * w, r1 - r0, w, bw, lm + (r0 / bh) * wb, colsum);
        for (int64_t r = r0; r < r1; r++) memcpy(up + r * w, colsum, (size_t)w * sizeof(float));
    }
}

/* The upsampled stored LFC of one map plus ``offset`` (decode). */
static void upsample_map(const uint16_t *restrict lm, int64_t h, int64_t w, int64_t bh, int64_t bw, float offset,
                         float *restrict row, float *restrict up) {
    const int64_t hb = (h + bh - 1) / bh, wb = (w + bw - 1) / bw;
    for (int64_t i = 0; i < hb; i++) {
        const int64_t h0 = i * bh, h1 = h0 + bh < h ? h0 + bh : h;
        for (int64_t j = 0; j < wb; j++) {
            const float o = offset + bf16_to_f32(lm[i * wb + j]);
            const int64_t w0 = j * bw, w1 = w0 + bw < w ? w0 + bw : w;
            for (int64_t c = w0; c < w1; c++) row[c] = o;
        }
        for (int64_t r = h0; r < h1; r++) memcpy(up + r * w, row, (size_t)w * sizeof(float));
    }
}

/* Returns the number of maps holding a NaN or Inf (in x, its LFC or its HFC range); the caller then uses the
 * reference path, which keeps such values exactly. */
int division_encode(const float *x, int64_t maps, int64_t h, int64_t w, int64_t bh, int64_t bw, int bits,
                    uint64_t seed, int stochastic, uint16_t *lfc, float *minimum, float *scale, uint8_t *codes,
                    uint8_t *packed, int threads, int fixed_range, int stat_bf16, const uint8_t *split) {
    /* lfc == NULL: no low-frequency component (a plain per-map quantizer; maps of 1 x n are rows).
     * fixed_range: minimum[m] and scale[m] are inputs (one range for many maps, BLPA), not outputs.
     * stat_bf16: the minimum and scale written (and used for the codes) are bf16 values, rounded outward.
     * split (packed bits over the flattened x, or NULL): each map gets two ranges, one for the elements whose
     * bit is set and one for the rest (minimum[2m + bit], scale[2m + bit]); the decoder knows the bits (a
     * ReLU's exact mask), so each side is quantized over its own, narrower range.
     * Maps whose codes fill whole bytes are packed here into ``packed``; otherwise codes go to ``codes``
     * (one byte each) and the caller packs them with pack_codes. After the block sums, every pass is a flat
     * loop over the map's h*w elements (upsampled LFC, HFC with its range and a non-finite flag, codes),
     * so small maps vectorise as well as large ones. */
    const int shift = bits == 1 ? 3 : (bits == 2 ? 2 : (bits == 4 ? 1 : 0));
    const int64_t per_mask = (1 << shift) - 1;
    const int64_t hw = h * w, split_nbytes = (maps * hw + 7) / 8;
    const int aligned = (hw & per_mask) == 0;
    const int64_t nbw = (w + bw - 1) / bw, nblocks = lfc ? ((h + bh - 1) / bh) * nbw : 0;
    const float levels = (float)((1 << bits) - 1);
    const int top = (int)levels;
    int bad = 0;
#pragma omp parallel num_threads(threads) reduction(+:bad)
    {
        float *colsum = malloc((size_t)w * sizeof(float));
        float *buf = malloc((size_t)hw * sizeof(float));
        uint8_t *cbuf = malloc((size_t)hw);
        uint16_t *rnd = malloc((size_t)(hw + 1) / 2 * sizeof(uint32_t));
        uint8_t *sbuf = split ? malloc((size_t)hw) : NULL;
#pragma omp for schedule(static)
        for (int64_t m = 0; m < maps; m++) {
            if (!colsum || !buf || !cbuf || !rnd || (split && !sbuf)) {  /* out of memory: the caller falls back to the reference path */
                bad += 1;
                continue;
            }
            const float *restrict xm = x + m * hw;
            float *restrict hfc = buf;
            float mn = INFINITY, mx = -INFINITY;
            uint32_t nonfinite = 0;
            if (lfc && h <= bh && w <= bw) {
                /* One block covers the map (7 x 7 maps at B = 8): its mean, then one flat pass. */
                float sum = 0.0f;
#pragma omp simd reduction(+:sum)
                for (int64_t e = 0; e < hw; e++) sum += xm[e];
                const uint16_t b16 = f32_to_bf16(sum / (float)hw);
                lfc[m] = b16;
                const float l = bf16_to_f32(b16);
#pragma omp simd reduction(min:mn) reduction(max:mx) reduction(|:nonfinite)
                for (int64_t e = 0; e < hw; e++) {
                    const float v = xm[e] - l;
                    uint32_t u;
                    memcpy(&u, &v, 4);
                    nonfinite |= (u & 0x7F800000u) == 0x7F800000u;
                    hfc[e] = v;
                    mn = v < mn ? v : mn;
                    mx = v > mx ? v : mx;
                }
#ifdef __AVX512F__
            } else if (lfc && w <= 16) {
                narrow_map_lfc_hfc(xm, h, w, bh, bw, lfc + m * nblocks, hfc, &mn, &mx, &nonfinite);
#endif
            } else if (lfc) {
                /* Block means into the bf16 LFC; ``up`` gets the stored LFC upsampled, one row per block row
                 * where rows are wide, the whole map where they are short (then one flat loop). */
                const int wide = w >= 48;  /* per-row reductions pay off on long rows only */
                const int64_t rows = wide ? bh : h;
                for (int64_t r0 = 0; r0 < h; r0 += rows) {
                    const int64_t r1 = r0 + rows < h ? r0 + rows : h;
                    if (wide)
                        block_row_means(xm + r0 * w, r1 - r0, w, bw, lfc + m * nblocks + (r0 / bh) * nbw, colsum);
                    else
                        lfc_of_map(xm, h, w, bh, bw, lfc + m * nblocks, colsum, buf);
                    const int64_t n = (r1 - r0) * w, period = wide ? w : n;
                    const float *restrict xr = xm + r0 * w;
                    float *restrict hr = hfc + r0 * w;
                    const float *restrict lr = wide ? colsum : buf;
                    for (int64_t o = 0; o < n; o += period) {
#pragma omp simd reduction(min:mn) reduction(max:mx) reduction(|:nonfinite)
                        for (int64_t c = 0; c < period; c++) {
                            const float v = xr[o + c] - lr[c];
                            uint32_t u;
                            memcpy(&u, &v, 4);
                            nonfinite |= (u & 0x7F800000u) == 0x7F800000u;
                            hr[o + c] = v;
                            mn = v < mn ? v : mn;
                            mx = v > mx ? v : mx;
                        }
                    }
                }
            } else {
                hfc = (float *)xm;
#pragma omp simd reduction(min:mn) reduction(max:mx) reduction(|:nonfinite)
                for (int64_t e = 0; e < hw; e++) {
                    const float v = xm[e];
                    uint32_t u;
                    memcpy(&u, &v, 4);
                    nonfinite |= (u & 0x7F800000u) == 0x7F800000u;
                    mn = v < mn ? v : mn;
                    mx = v > mx ? v : mx;
                }
            }
            if (nonfinite || !isfinite(mn) || !isfinite(mx) || !isfinite(mx - mn)) {
                bad += 1;
                continue;
            }
            float sc;
            const uint32_t key = (uint32_t)splitmix64(seed ^ (0xD1B54A32D192ED03ull * (uint64_t)(m + 1)));
            uint8_t *restrict out = aligned ? cbuf : codes + m * hw;
            if (split) {
                split_ranges(hfc, hw, split, split_nbytes, m * hw, sbuf, levels, stat_bf16, minimum + 2 * m,
                             scale + 2 * m);
                quantize_split(hfc, hw, split, split_nbytes, m * hw, sbuf, minimum + 2 * m, scale + 2 * m, key,
                               stochastic, top, rnd, out);
                if (aligned) pack_aligned(cbuf, hw, bits, packed + ((m * hw) >> shift));
                continue;
            }
            if (fixed_range) {
                mn = minimum[m];
                sc = scale[m];
            } else {
                if (stat_bf16) {
                    mn = bf16_down(mn);
                    sc = bf16_up((mx - mn) / levels);
                } else {
                    sc = (mx - mn) / levels;
                }
                minimum[m] = mn;
                scale[m] = sc;
            }
            const float inv = sc > 0.0f ? 1.0f / sc : 0.0f;
            if (stochastic) {
                rounding_draws(key, hw, rnd);
                const uint16_t *restrict r16 = rnd;
#pragma omp simd
                for (int64_t e = 0; e < hw; e++) {
                    const float u = ((float)r16[e] + 0.5f) * (1.0f / 65536.0f);
                    const float v = (hfc[e] - mn) * inv + u;
                    const int q = v > 0.0f ? (int)v : 0;  /* truncation == floor for v >= 0 */
                    out[e] = (uint8_t)(q < top ? q : top);
                }
            } else {
#pragma omp simd
                for (int64_t e = 0; e < hw; e++) {
                    const float v = (hfc[e] - mn) * inv + 0.5f;
                    int q = v > 0.0f ? (int)v : 0;
                    out[e] = (uint8_t)(q < top ? q : top);
                }
            }
            if (aligned) pack_aligned(cbuf, hw, bits, packed + ((m * hw) >> shift));
        }
        free(colsum);
        free(buf);
        free(cbuf);
        free(rnd);
        free(sbuf);
    }
    return bad;
}

/* Returns the number of maps not decoded for lack of memory (the caller raises). lfc == NULL: no LFC (a plain
 * per-map quantizer). zero_unset (with a split): exactly 0 where the split bit is unset. */
int division_decode(const uint8_t *packed, const uint16_t *lfc, const float *minimum, const float *scale,
                     int64_t maps, int64_t h, int64_t w, int64_t bh, int64_t bw, int bits, float *out, int threads,
                     const uint8_t *split, int zero_unset) {
    const int64_t hw = h * w, split_nbytes = (maps * hw + 7) / 8;
    const int64_t nblocks = lfc ? ((h + bh - 1) / bh) * ((w + bw - 1) / bw) : 0;
    const int shift = bits == 1 ? 3 : (bits == 2 ? 2 : (bits == 4 ? 1 : 0));  /* log2(codes per byte) */
    const int64_t per_mask = (1 << shift) - 1;
    const int aligned = (hw & per_mask) == 0;
    const uint8_t mask = (uint8_t)((1 << bits) - 1);
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(+:failed)
    {
        float *row = malloc((size_t)w * sizeof(float));
        float *up = malloc((size_t)hw * sizeof(float));
        uint8_t *cbuf = malloc((size_t)hw);
        uint8_t *sbuf = split ? malloc((size_t)hw) : NULL;
#pragma omp for schedule(static)
        for (int64_t m = 0; m < maps; m++) {
            if (!row || !up || !cbuf || (split && !sbuf)) {
                failed += 1;
                continue;
            }
            const float mn = split ? 0.0f : minimum[m], sc = split ? 0.0f : scale[m];
            float *restrict om = out + m * hw;
            if (aligned) {
                unpack_aligned(packed + ((m * hw) >> shift), hw, bits, cbuf);
            } else {
                for (int64_t e = 0; e < hw; e++) {
                    const int64_t idx = m * hw + e;
                    cbuf[e] = (packed[idx >> shift] >> (bits * (idx & per_mask))) & mask;
                }
            }
            if (split) {  /* two ranges per map, chosen by the split bit of each element */
                const int one_block = !lfc || (h <= bh && w <= bw);  /* a constant LFC: no upsampled map */
                if (!one_block)
                    upsample_map(lfc + m * nblocks, h, w, bh, bw, 0.0f, row, up);
                split_decode(cbuf, one_block ? NULL : up, lfc && one_block ? bf16_to_f32(lfc[m]) : 0.0f, hw, split,
                             split_nbytes, m * hw, sbuf, minimum + 2 * m, scale + 2 * m, om, zero_unset);
            } else if (lfc && w >= 16) {  /* wide rows: one upsampled row per block row, no map-sized buffer */
                const uint16_t *lm = lfc + m * nblocks;
                const int64_t wb = (w + bw - 1) / bw;
                for (int64_t i = 0; i * bh < h; i++) {
                    const int64_t h0 = i * bh, h1 = h0 + bh < h ? h0 + bh : h;
                    for (int64_t j = 0; j < wb; j++) {
                        const float o = mn + bf16_to_f32(lm[i * wb + j]);
                        const int64_t w0 = j * bw, w1 = w0 + bw < w ? w0 + bw : w;
                        for (int64_t c = w0; c < w1; c++) row[c] = o;
                    }
                    for (int64_t r = h0; r < h1; r++) {
                        float *restrict orow = om + r * w;
                        const uint8_t *restrict crow = cbuf + r * w;
#pragma omp simd
                        for (int64_t c = 0; c < w; c++) orow[c] = row[c] + (float)crow[c] * sc;
                    }
                }
            } else if (lfc && h <= bh && w <= bw) {  /* one block covers the map */
                const float o = mn + bf16_to_f32(lfc[m]);
#pragma omp simd
                for (int64_t e = 0; e < hw; e++) om[e] = o + (float)cbuf[e] * sc;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
            } else if (lfc && w <= 16) {  /* narrow maps: one row is one vector (see narrow_map_lfc_hfc) */
                const __mmask16 live = (__mmask16)((1u << w) - 1u);
                const int64_t wb = (w + bw - 1) / bw;
                const __m512 vsc = _mm512_set1_ps(sc);
                for (int64_t i = 0; i * bh < h; i++) {
                    const int64_t h0 = i * bh, h1 = h0 + bh < h ? h0 + bh : h;
                    const __m512 up = narrow_lfc_row(lfc + m * nblocks + i * wb, w, bw, mn);
                    for (int64_t r = h0; r < h1; r++) {
                        const __m512 code = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(live, cbuf + r * w)));
                        _mm512_mask_storeu_ps(om + r * w, live, _mm512_add_ps(up, _mm512_mul_ps(code, vsc)));
                    }
                }
#endif
            } else if (lfc) {  /* small maps: one flat loop over the map */
                upsample_map(lfc + m * nblocks, h, w, bh, bw, mn, row, up);
#pragma omp simd
                for (int64_t e = 0; e < hw; e++) om[e] = up[e] + (float)cbuf[e] * sc;
            } else {
#pragma omp simd
                for (int64_t e = 0; e < hw; e++) om[e] = mn + (float)cbuf[e] * sc;
            }
        }
        free(row);
        free(up);
        free(cbuf);
        free(sbuf);
    }
    return failed;
}
