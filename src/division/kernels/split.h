/* Split maps (two ranges per map, one per side of an exact mask the decoder also holds): ranges, codes and
 * decode of one map (division_cpu.c includes it). With AVX-512 the mask is read 16 bits at a time into lane
 * masks; otherwise its bits are spread into bytes first. */
#ifndef DIVISION_SPLIT_H
#define DIVISION_SPLIT_H
#include <math.h>
#include <stdint.h>

#include "bits.h"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#endif

/* Minimum and scale of each side of a split map from its extremes (0, 0 for a side without elements). */
static void finish_split_ranges(const float lo[2], const float hi[2], float levels, int stat_bf16, float *minimum,
                                float *scale) {
    for (int b = 0; b < 2; b++) {
        if (!(lo[b] <= hi[b])) {  /* no element on this side */
            minimum[b] = 0.0f;
            scale[b] = 0.0f;
        } else if (stat_bf16) {
            minimum[b] = bf16_down(lo[b]);
            scale[b] = bf16_up((hi[b] - minimum[b]) / levels);
        } else {
            minimum[b] = lo[b];
            scale[b] = (hi[b] - lo[b]) / levels;
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SPLIT_IN_REGISTERS 1
/* Elements e .. e + 15 of a map of n (fewer at its end): the lanes in the map (``live``) and, returned, those
 * whose mask bit is set. */
static inline __mmask16 side_lanes(const uint8_t *restrict split, int64_t nbytes, int64_t base, int64_t e, int64_t n,
                                   __mmask16 *live) {
    const int64_t k = n - e < 16 ? n - e : 16;
    *live = (__mmask16)((1u << k) - 1u);
    return (__mmask16)bits16(split, nbytes, base + e) & *live;
}

/* Split maps with the mask read 16 bits at a time into lane masks: no byte per element, any bit offset. */
static void split_ranges(const float *restrict v, int64_t n, const uint8_t *restrict split, int64_t nbytes,
                         int64_t base, uint8_t *restrict sbuf, float levels, int stat_bf16, float *minimum,
                         float *scale) {
    (void)sbuf;
    __m512 mn0 = _mm512_set1_ps(INFINITY), mx0 = _mm512_set1_ps(-INFINITY);
    __m512 mn1 = mn0, mx1 = mx0;
    for (int64_t e = 0; e < n; e += 16) {
        __mmask16 live;
        const __mmask16 s = side_lanes(split, nbytes, base, e, n, &live), r = live & ~s;
        const __m512 a = _mm512_maskz_loadu_ps(live, v + e);
        mn0 = _mm512_mask_min_ps(mn0, r, mn0, a);
        mx0 = _mm512_mask_max_ps(mx0, r, mx0, a);
        mn1 = _mm512_mask_min_ps(mn1, s, mn1, a);
        mx1 = _mm512_mask_max_ps(mx1, s, mx1, a);
    }
    const float lo[2] = {_mm512_reduce_min_ps(mn0), _mm512_reduce_min_ps(mn1)};
    const float hi[2] = {_mm512_reduce_max_ps(mx0), _mm512_reduce_max_ps(mx1)};
    finish_split_ranges(lo, hi, levels, stat_bf16, minimum, scale);
}

static void quantize_split(const float *restrict v, int64_t n, const uint8_t *restrict split, int64_t nbytes,
                           int64_t base, uint8_t *restrict sbuf, const float *minimum, const float *scale, uint32_t key,
                           int stochastic, int top, uint16_t *restrict rnd, uint8_t *restrict out) {
    (void)sbuf;
    const __m512 mn0 = _mm512_set1_ps(minimum[0]), mn1 = _mm512_set1_ps(minimum[1]);
    const __m512 inv0 = _mm512_set1_ps(scale[0] > 0.0f ? 1.0f / scale[0] : 0.0f);
    const __m512 inv1 = _mm512_set1_ps(scale[1] > 0.0f ? 1.0f / scale[1] : 0.0f);
    const __m512i vtop = _mm512_set1_epi32(top);
    if (stochastic) rounding_draws(key, n, rnd);
    for (int64_t e = 0; e < n; e += 16) {
        __mmask16 live;
        const __mmask16 s = side_lanes(split, nbytes, base, e, n, &live);
        __m512 u = _mm512_set1_ps(0.5f);
        if (stochastic) {
            const __m512 draw = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, rnd + e)));
            u = _mm512_mul_ps(_mm512_add_ps(draw, u), _mm512_set1_ps(1.0f / 65536.0f));
        }
        const __m512 d = _mm512_sub_ps(_mm512_maskz_loadu_ps(live, v + e), _mm512_mask_blend_ps(s, mn0, mn1));
        const __m512 t = _mm512_max_ps(_mm512_add_ps(_mm512_mul_ps(d, _mm512_mask_blend_ps(s, inv0, inv1)), u),
                                       _mm512_setzero_ps());
        _mm512_mask_cvtepi32_storeu_epi8(out + e, live, _mm512_min_epi32(_mm512_cvttps_epi32(t), vtop));
    }
}
#else
/* Two ranges of one map's values, by split bit: minimum[b], scale[b] for b = 0, 1 (0, 0 for an empty side). */
static void split_ranges(const float *restrict v, int64_t n, const uint8_t *restrict split, int64_t nbytes,
                         int64_t base, uint8_t *restrict sbuf, float levels, int stat_bf16, float *minimum,
                         float *scale) {
    (void)nbytes;
    split_bits(split, base, n, sbuf);
    float mn0 = INFINITY, mx0 = -INFINITY, mn1 = INFINITY, mx1 = -INFINITY;
#pragma omp simd reduction(min:mn0, mn1) reduction(max:mx0, mx1)
    for (int64_t e = 0; e < n; e++) {
        const float a = v[e];
        const int s = sbuf[e];
        mn0 = (!s && a < mn0) ? a : mn0;
        mx0 = (!s && a > mx0) ? a : mx0;
        mn1 = (s && a < mn1) ? a : mn1;
        mx1 = (s && a > mx1) ? a : mx1;
    }
    const float lo[2] = {mn0, mn1}, hi[2] = {mx0, mx1};
    finish_split_ranges(lo, hi, levels, stat_bf16, minimum, scale);
}

/* Codes of one map with the range of each element's side (sbuf: its bits, from split_ranges). */
static void quantize_split(const float *restrict v, int64_t n, const uint8_t *restrict split, int64_t nbytes,
                           int64_t base, uint8_t *restrict sbuf, const float *minimum, const float *scale, uint32_t key,
                           int stochastic, int top, uint16_t *restrict rnd, uint8_t *restrict out) {
    (void)split;
    (void)nbytes;
    (void)base;
    const float mn0 = minimum[0], mn1 = minimum[1];
    const float inv0 = scale[0] > 0.0f ? 1.0f / scale[0] : 0.0f, inv1 = scale[1] > 0.0f ? 1.0f / scale[1] : 0.0f;
    if (stochastic) rounding_draws(key, n, rnd);
#pragma omp simd
    for (int64_t e = 0; e < n; e++) {
        const int s = sbuf[e];
        const float u = stochastic ? ((float)rnd[e] + 0.5f) * (1.0f / 65536.0f) : 0.5f;
        const float t = (v[e] - (s ? mn1 : mn0)) * (s ? inv1 : inv0) + u;
        const int q = t > 0.0f ? (int)t : 0;
        out[e] = (uint8_t)(q < top ? q : top);
    }
}
#endif

/* One split map's values: (upsampled LFC, or ``offset`` where up is NULL) + minimum + code * scale of each
 * element's side; with zero_unset, exactly 0 where the split bit is unset (a ReLU output's zeros). */
static void split_decode(const uint8_t *restrict codes, const float *restrict up, float offset, int64_t n,
                         const uint8_t *restrict split, int64_t nbytes, int64_t base, uint8_t *restrict sbuf,
                         const float *minimum, const float *scale, float *restrict out, int zero_unset) {
#ifdef SPLIT_IN_REGISTERS
    (void)sbuf;
    const __m512 mn0 = _mm512_set1_ps(minimum[0]), mn1 = _mm512_set1_ps(minimum[1]);
    const __m512 sc0 = _mm512_set1_ps(scale[0]), sc1 = _mm512_set1_ps(scale[1]);
    for (int64_t e = 0; e < n; e += 16) {
        __mmask16 live;
        const __mmask16 s = side_lanes(split, nbytes, base, e, n, &live);
        const __m512 code = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(live, codes + e)));
        const __m512 lo = up ? _mm512_maskz_loadu_ps(live, up + e) : _mm512_set1_ps(offset);
        const __m512 v = _mm512_add_ps(_mm512_add_ps(lo, _mm512_mask_blend_ps(s, mn0, mn1)),
                                       _mm512_mul_ps(code, _mm512_mask_blend_ps(s, sc0, sc1)));
        _mm512_mask_storeu_ps(out + e, live, zero_unset ? _mm512_maskz_mov_ps(s, v) : v);
    }
#else
    (void)nbytes;
    split_bits(split, base, n, sbuf);
    const float mn0 = minimum[0], mn1 = minimum[1], sc0 = scale[0], sc1 = scale[1];
#pragma omp simd
    for (int64_t e = 0; e < n; e++) {
        const int s = sbuf[e];
        const float v = (up ? up[e] : offset) + (s ? mn1 : mn0) + (float)codes[e] * (s ? sc1 : sc0);
        out[e] = (zero_unset && !s) ? 0.0f : v;
    }
#endif
}

#endif
