/* A ReLU output's codes kept only where its exact mask is set (division/codecs/compact.py), and back: the
 * b-bit codes (b in 1, 2, 4, 8; packed LSB first as pack_bits packs them) of the elements whose mask bit is
 * set, in element order, in a stream packed the same way. Eight elements (one mask byte, b code bytes) at a
 * time: with BMI2, pext gathers the kept codes and pdep scatters them back. Little-endian. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __BMI2__
#include <immintrin.h>
#endif

static void spread_table(int bits, uint64_t table[256]) {
    /* table[m]: every set bit t of m widened to the b-bit field of element t */
    const uint64_t ones = (1ull << bits) - 1;
    for (unsigned m = 0; m < 256; m++) {
        uint64_t s = 0;
        for (int t = 0; t < 8; t++)
            if (m >> t & 1) s |= ones << (t * bits);
        table[m] = s;
    }
}

static inline uint64_t gather(uint64_t word, uint64_t sel) {
#ifdef __BMI2__
    return _pext_u64(word, sel);
#else
    uint64_t out = 0;
    int k = 0;
    for (int i = 0; i < 64; i++)
        if (sel >> i & 1) out |= (word >> i & 1ull) << k++;
    return out;
#endif
}

static inline uint64_t scatter(uint64_t value, uint64_t sel) {
#ifdef __BMI2__
    return _pdep_u64(value, sel);
#else
    uint64_t out = 0;
    int k = 0;
    for (int i = 0; i < 64; i++)
        if (sel >> i & 1) out |= (value >> k++ & 1ull) << i;
    return out;
#endif
}

static inline unsigned group_mask(const uint8_t *mask, int64_t g, int64_t numel) {
    unsigned m = mask[g];
    const int64_t left = numel - 8 * g;
    return left < 8 ? m & ((1u << left) - 1) : m;
}

int64_t count_set(const uint8_t *mask, int64_t numel) {
    int64_t n = 0;
    const int64_t groups = (numel + 7) / 8;
    for (int64_t g = 0; g < groups; g++) n += __builtin_popcount(group_mask(mask, g, numel));
    return n;
}

static inline uint64_t load_group(const uint8_t *p, int64_t nb, int bits) {
    /* the codes of eight elements (bits bytes; nb < bits only for the last, partial group) */
    uint64_t w = 0;
    if (nb == bits) {
        switch (bits) {
            case 1: return p[0];
            case 2: { uint16_t v; memcpy(&v, p, 2); return v; }
            case 4: { uint32_t v; memcpy(&v, p, 4); return v; }
            default: memcpy(&w, p, 8); return w;
        }
    }
    memcpy(&w, p, (size_t)nb);
    return w;
}

static inline void store_group(uint8_t *p, uint64_t w, int64_t nb, int bits) {
    if (nb == bits) {
        switch (bits) {
            case 1: p[0] = (uint8_t)w; return;
            case 2: { uint16_t v = (uint16_t)w; memcpy(p, &v, 2); return; }
            case 4: { uint32_t v = (uint32_t)w; memcpy(p, &v, 4); return; }
            default: memcpy(p, &w, 8); return;
        }
    }
    memcpy(p, &w, (size_t)nb);
}

typedef struct {
    int64_t head_at, tail_at;  /* bytes shared with the chunk before / after (-1: none), OR-ed in afterwards */
    uint8_t head, tail;
} Edges;

static inline void emit(uint8_t *out, int64_t k, uint8_t v, int64_t first, int shared, Edges *e) {
    if (k == first && shared) {
        e->head_at = k;
        e->head = v;
    } else {
        out[k] = v;
    }
}

static void compact_range(const uint8_t *codes, const uint8_t *mask, int64_t numel, int bits, const uint64_t *table,
                          int64_t g0, int64_t g1, int64_t bitpos, uint8_t *out, Edges *e) {
    /* groups [g0, g1) into the stream from bit bitpos; bytes it shares with its neighbours go to e */
    const int64_t code_bytes = (numel * bits + 7) / 8, first = bitpos >> 3;
    const int shared = (bitpos & 7) != 0;
    uint64_t acc = 0;
    int nacc = (int)(bitpos & 7);  /* the low bits of the first byte belong to the chunk before */
    int64_t o = first;
    e->head_at = e->tail_at = -1;
    for (int64_t g = g0; g < g1; g++) {
        const unsigned m = group_mask(mask, g, numel);
        if (!m) continue;
        const int64_t at = g * bits, nb = code_bytes - at < bits ? code_bytes - at : bits;
        const uint64_t kept = gather(load_group(codes + at, nb, bits), table[m]);
        const int n = __builtin_popcount(m) * bits;
        for (int part = 0; part < (n > 32 ? 2 : 1); part++) {
            const int k = part ? n - 32 : (n > 32 ? 32 : n);
            acc |= (part ? kept >> 32 : (n > 32 ? kept & 0xffffffffull : kept)) << nacc;
            nacc += k;
            if (nacc >= 32) {  /* nacc < 32 before, k <= 32: no overflow */
                if (o == first && shared) {
                    for (int b = 0; b < 4; b++) emit(out, o + b, (uint8_t)(acc >> (8 * b)), first, shared, e);
                } else {
                    const uint32_t word = (uint32_t)acc;
                    memcpy(out + o, &word, 4);
                }
                o += 4;
                acc >>= 32;
                nacc -= 32;
            }
        }
    }
    for (; nacc >= 8; nacc -= 8, acc >>= 8, o++) emit(out, o, (uint8_t)acc, first, shared, e);
    if (nacc > 0) {  /* a partial last byte: the next chunk writes its high bits */
        if (o == first && shared) {
            e->head_at = o;
            e->head = (uint8_t)acc;
        } else {
            e->tail_at = o;
            e->tail = (uint8_t)acc;
        }
    }
}

static int64_t chunk_starts(const uint8_t *mask, int64_t numel, int64_t groups, int64_t chunks, int64_t per,
                            int64_t *start, int threads) {
    /* start[c]: set elements before chunk c (exclusive prefix over chunks of per groups); returns the total */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t n = 0;
        const int64_t g1 = (c + 1) * per < groups ? (c + 1) * per : groups;
        for (int64_t g = c * per; g < g1; g++) n += __builtin_popcount(group_mask(mask, g, numel));
        start[c] = n;
    }
    int64_t total = 0;
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n = start[c];
        start[c] = total;
        total += n;
    }
    return total;
}

int compact_codes(const uint8_t *codes, const uint8_t *mask, int64_t numel, int bits, uint8_t *out, int threads) {
    /* out: zero-filled, packed_nbytes(count) bytes. Chunks in parallel; returns 1 if memory ran out. */
    uint64_t table[256];
    spread_table(bits, table);
    const int64_t groups = (numel + 7) / 8, per = 1 << 14, chunks = (groups + per - 1) / per;
    int64_t *start = malloc((size_t)(chunks ? chunks : 1) * sizeof(int64_t));
    Edges *edges = malloc((size_t)(chunks ? chunks : 1) * sizeof(Edges));
    if (!start || !edges) {
        free(start);
        free(edges);
        return 1;
    }
    chunk_starts(mask, numel, groups, chunks, per, start, threads);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t g1 = (c + 1) * per < groups ? (c + 1) * per : groups;
        compact_range(codes, mask, numel, bits, table, c * per, g1, start[c] * bits, out, &edges[c]);
    }
    for (int64_t c = 0; c < chunks; c++) {
        if (edges[c].head_at >= 0) out[edges[c].head_at] |= edges[c].head;
        if (edges[c].tail_at >= 0) out[edges[c].tail_at] |= edges[c].tail;
    }
    free(start);
    free(edges);
    return 0;
}

int expand_codes(const uint8_t *compact, int64_t count, const uint8_t *mask, int64_t numel, int bits,
                 uint8_t *out, int threads) {
    /* every byte of out (the full packed codes) is written; unset elements get code 0. Returns 1 if memory
     * ran out. */
    uint64_t table[256];
    spread_table(bits, table);
    const int64_t groups = (numel + 7) / 8, code_bytes = (numel * bits + 7) / 8;
    const int64_t stream_bytes = (count * bits + 7) / 8, per = 1 << 14, chunks = (groups + per - 1) / per;
    int64_t *start = malloc((size_t)(chunks ? chunks : 1) * sizeof(int64_t));
    if (!start) return 1;
    chunk_starts(mask, numel, groups, chunks, per, start, threads);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t g1 = (c + 1) * per < groups ? (c + 1) * per : groups;
        int64_t pos = start[c] * bits;  /* bit position in the stream: a multiple of bits */
        for (int64_t g = c * per; g < g1; g++) {
            const unsigned m = group_mask(mask, g, numel);
            uint64_t word = 0;
            if (m) {
                const int n = __builtin_popcount(m) * bits;
                const int64_t byte = pos >> 3;
                const int64_t avail = stream_bytes - byte < 8 ? stream_bytes - byte : 8;
                uint64_t v = 0;
                if (avail == 8) memcpy(&v, compact + byte, 8);
                else memcpy(&v, compact + byte, (size_t)avail);
                v >>= pos & 7;
                if (n < 64) v &= (1ull << n) - 1;
                word = scatter(v, table[m]);
                pos += n;
            }
            const int64_t at = g * bits, nb = code_bytes - at < bits ? code_bytes - at : bits;
            store_group(out + at, word, nb, bits);
        }
    }
    free(start);
    return 0;
}
