/* DIVISION's encode for maps at most 16 wide, one row per AVX-512 register (division_cpu.c includes it). */
#ifndef DIVISION_NARROW_H
#define DIVISION_NARROW_H
#ifdef __AVX512F__
#include <immintrin.h>
#include <math.h>

#include "bits.h"

/* Lanes w0 .. w1 - 1 of a row of at most 16. */
static inline __mmask16 lanes(int64_t w0, int64_t w1) {
    return (__mmask16)(((1u << w1) - 1u) & ~((1u << w0) - 1u));
}

/* One block row of the stored bf16 LFC (``lm``), upsampled along a row at most 16 wide, plus ``offset``. */
static inline __m512 narrow_lfc_row(const uint16_t *lm, int64_t w, int64_t bw, float offset) {
    __m512 up = _mm512_setzero_ps();
    for (int64_t j = 0, w0 = 0; w0 < w; j++, w0 += bw)
        up = _mm512_mask_mov_ps(up, lanes(w0, w0 + bw < w ? w0 + bw : w), _mm512_set1_ps(offset + bf16_to_f32(lm[j])));
    return up;
}

/* Maps at most 16 wide (14 x 14 at B = 8): one row is one vector. Column sums of a block row stay in a
 * register, each block's mean comes from a masked reduction, and the HFC rows are made against the
 * upsampled LFC row held in a register: no map-sized LFC buffer, one pass over the input for the HFC. */
static void narrow_map_lfc_hfc(const float *restrict xm, int64_t h, int64_t w, int64_t bh, int64_t bw,
                               uint16_t *restrict lm, float *restrict hfc, float *mn, float *mx,
                               uint32_t *nonfinite) {
    const __mmask16 live = (__mmask16)((1u << w) - 1u);
    const int64_t wb = (w + bw - 1) / bw;
    __m512 vmn = _mm512_set1_ps(INFINITY), vmx = _mm512_set1_ps(-INFINITY);
    __mmask16 bad = 0;
    for (int64_t r0 = 0; r0 < h; r0 += bh) {
        const int64_t r1 = r0 + bh < h ? r0 + bh : h;
        uint16_t *restrict lrow = lm + (r0 / bh) * wb;
        __m512 cs = _mm512_setzero_ps();
        for (int64_t r = r0; r < r1; r++) cs = _mm512_add_ps(cs, _mm512_maskz_loadu_ps(live, xm + r * w));
        for (int64_t j = 0; j < wb; j++) {
            const int64_t w0 = j * bw, w1 = w0 + bw < w ? w0 + bw : w;
            lrow[j] = f32_to_bf16(_mm512_mask_reduce_add_ps(lanes(w0, w1), cs) / (float)((r1 - r0) * (w1 - w0)));
        }
        const __m512 up = narrow_lfc_row(lrow, w, bw, 0.0f);
        for (int64_t r = r0; r < r1; r++) {
            const __m512 v = _mm512_sub_ps(_mm512_maskz_loadu_ps(live, xm + r * w), up);
            _mm512_mask_storeu_ps(hfc + r * w, live, v);
            vmn = _mm512_mask_min_ps(vmn, live, vmn, v);
            vmx = _mm512_mask_max_ps(vmx, live, vmx, v);
            bad |= _mm512_mask_cmp_ps_mask(live, _mm512_sub_ps(v, v), _mm512_setzero_ps(), _CMP_NEQ_UQ);
        }
    }
    *mn = _mm512_reduce_min_ps(vmn);
    *mx = _mm512_reduce_max_ps(vmx);
    *nonfinite = bad != 0;
}
#endif
#endif
