/* A ReLU output's codes kept only where its exact mask is set (division/codecs/compact.py), and back: the
 * b-bit codes (b in 1, 2, 4, 8; packed LSB first as pack_bits packs them) of the elements whose mask bit is
 * set, in element order, in a stream packed the same way. One 64-bit code word (64 / b elements) at a time:
 * with BMI2, pext gathers the kept codes and pdep scatters them back (a portable loop without BMI2). Chunks
 * of elements run in parallel; a chunk's stream starts at any bit, so the bytes it shares with its
 * neighbours are returned as edges and OR-ed in afterwards. Little-endian.
 * (Keeping the codes inside division_cpu.c's encode, per map, measured no faster: the pext work dominates.) */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __BMI2__
#include <immintrin.h>
#endif

static inline uint64_t gather(uint64_t word, uint64_t sel) {
#ifdef __BMI2__
    return _pext_u64(word, sel);
#else
    uint64_t out = 0;
    int k = 0;
    for (; sel; sel &= sel - 1) out |= (word >> __builtin_ctzll(sel) & 1ull) << k++;
    return out;
#endif
}

static inline uint64_t scatter(uint64_t value, uint64_t sel) {
#ifdef __BMI2__
    return _pdep_u64(value, sel);
#else
    uint64_t out = 0;
    for (int k = 0; sel; sel &= sel - 1, k++) out |= (value >> k & 1ull) << __builtin_ctzll(sel);
    return out;
#endif
}

static inline uint64_t load_bytes(const uint8_t *p, int64_t nb) {
    /* the first min(nb, 8) bytes at p (the fixed-size copy in the common case compiles to one load) */
    uint64_t w = 0;
    if (nb >= 8) memcpy(&w, p, 8);
    else if (nb > 0) memcpy(&w, p, (size_t)nb);
    return w;
}

static inline uint64_t read_bits(const uint8_t *p, int64_t nbytes, int64_t pos, int n) {
    /* n <= 64 bits from bit pos of a buffer of nbytes bytes (bits past its end read as 0) */
    const int64_t byte = pos >> 3;
    const int shift = (int)(pos & 7);
    uint64_t v = load_bytes(p + byte, nbytes - byte) >> shift;
    if (shift && n > 64 - shift && nbytes - byte > 8) v |= (uint64_t)p[byte + 8] << (64 - shift);
    return n < 64 ? v & ((1ull << n) - 1) : v;
}

static inline uint64_t field_starts(int bits) {
    /* the lowest bit of every b-bit field of a 64-bit word */
    uint64_t p = 0;
    for (int i = 0; i < 64; i += bits) p |= 1ull << i;
    return p;
}

static inline uint64_t selector(uint64_t m, int bits, uint64_t starts) {
    /* one bit per field -> every bit of the low ``bits`` of the set fields (fields are disjoint: the product
     * carries nothing) */
    return scatter(m, starts) * ((1ull << bits) - 1);
}

typedef struct {
    int64_t head_at, tail_at;  /* bytes shared with the stream before / after (-1: none) */
    uint8_t head, tail;
} Edges;

typedef struct {
    uint8_t *out;
    int64_t o, first;  /* next byte to write; the stream's first byte */
    uint64_t acc;      /* pending bits, nacc of them */
    int nacc, shared;  /* shared: the first byte's low bits belong to the stream before */
    Edges *e;
} Stream;

static inline Stream stream_at(uint8_t *out, int64_t bitpos, Edges *e) {
    e->head_at = e->tail_at = -1;
    Stream s = {out, bitpos >> 3, bitpos >> 3, 0, (int)(bitpos & 7), (bitpos & 7) != 0, e};
    return s;
}

static inline void put_byte(Stream *s, int64_t k, uint8_t v) {
    if (k == s->first && s->shared) {
        s->e->head_at = k;
        s->e->head = v;
    } else {
        s->out[k] = v;
    }
}

static inline void append(Stream *s, uint64_t kept, int n) {
    /* kept: n <= 64 bits, nothing above them */
    if (!n) return;
    s->acc |= kept << s->nacc;
    if (s->nacc + n < 64) {
        s->nacc += n;
        return;
    }
    if (s->o == s->first && s->shared) {
        for (int b = 0; b < 8; b++) put_byte(s, s->o + b, (uint8_t)(s->acc >> (8 * b)));
    } else {
        memcpy(s->out + s->o, &s->acc, 8);
    }
    s->o += 8;
    s->acc = s->nacc ? kept >> (64 - s->nacc) : 0;
    s->nacc += n - 64;
}

static inline void finish(Stream *s) {
    /* the whole bytes left; a partial last byte becomes an edge (the next stream writes its high bits) */
    for (; s->nacc >= 8; s->nacc -= 8, s->acc >>= 8, s->o++) put_byte(s, s->o, (uint8_t)s->acc);
    if (s->nacc > 0) {
        if (s->o == s->first && s->shared) {
            s->e->head_at = s->o;
            s->e->head = (uint8_t)s->acc;
        } else {
            s->e->tail_at = s->o;
            s->e->tail = (uint8_t)s->acc;
        }
    }
}

static inline void or_edges(uint8_t *out, const Edges *edges, int64_t n) {
    for (int64_t c = 0; c < n; c++) {
        if (edges[c].head_at >= 0) out[edges[c].head_at] |= edges[c].head;
        if (edges[c].tail_at >= 0) out[edges[c].tail_at] |= edges[c].tail;
    }
}

static inline uint64_t mask_word(const uint8_t *mask, int64_t w, int64_t numel) {
    /* mask bits of elements [64 w, 64 w + 64), zero past numel (read_bits at a word boundary, without its
     * shift: this is the inner loop's read, and read_bits here measured 10 % slower) */
    const int64_t left = numel - 64 * w;
    const uint64_t m = load_bytes(mask + 8 * w, left >= 64 ? 8 : (left + 7) / 8);
    return left >= 64 ? m : m & ((1ull << left) - 1);
}

static inline uint64_t part_of(uint64_t m, int j, int bits) {
    /* the mask bits of code word j of a mask word (64 / bits elements each) */
    return bits == 1 ? m : m >> (j * (64 / bits)) & ((1ull << (64 / bits)) - 1);
}

int64_t count_set(const uint8_t *mask, int64_t numel) {
    int64_t n = 0;
    const int64_t words = (numel + 63) / 64;
    for (int64_t w = 0; w < words; w++) n += __builtin_popcountll(mask_word(mask, w, numel));
    return n;
}

static void compact_range(const uint8_t *codes, const uint8_t *mask, int64_t numel, int bits, int64_t w0,
                          int64_t w1, int64_t bitpos, uint8_t *out, Edges *e) {
    /* mask words [w0, w1) into the stream from bit bitpos */
    const int64_t code_bytes = (numel * bits + 7) / 8;
    const uint64_t starts = field_starts(bits);
    Stream s = stream_at(out, bitpos, e);
    for (int64_t w = w0; w < w1; w++) {
        const uint64_t m = mask_word(mask, w, numel);
        if (!m) continue;
        for (int j = 0; j < bits; j++) {
            const uint64_t mj = part_of(m, j, bits);
            if (!mj) continue;
            const int64_t at = 8 * (w * bits + j);
            const uint64_t kept = gather(load_bytes(codes + at, code_bytes - at), selector(mj, bits, starts));
            append(&s, kept, __builtin_popcountll(mj) * bits);
        }
    }
    finish(&s);
}

static void chunk_starts(const uint8_t *mask, int64_t numel, int64_t words, int64_t chunks, int64_t per,
                         int64_t *start, int threads) {
    /* start[c]: set elements before chunk c (exclusive prefix over chunks of per mask words) */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t n = 0;
        const int64_t w1 = (c + 1) * per < words ? (c + 1) * per : words;
        for (int64_t w = c * per; w < w1; w++) n += __builtin_popcountll(mask_word(mask, w, numel));
        start[c] = n;
    }
    int64_t total = 0;
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n = start[c];
        start[c] = total;
        total += n;
    }
}

enum { CHUNK_WORDS = 1 << 11 };  /* 131072 elements per parallel chunk */

int compact_codes(const uint8_t *codes, const uint8_t *mask, int64_t numel, int bits, uint8_t *out, int threads) {
    /* out: zero-filled, packed_nbytes(count) bytes. Returns 1 if memory ran out. */
    const int64_t words = (numel + 63) / 64, chunks = (words + CHUNK_WORDS - 1) / CHUNK_WORDS;
    int64_t *start = malloc((size_t)(chunks ? chunks : 1) * sizeof(int64_t));
    Edges *edges = malloc((size_t)(chunks ? chunks : 1) * sizeof(Edges));
    if (!start || !edges) {
        free(start);
        free(edges);
        return 1;
    }
    chunk_starts(mask, numel, words, chunks, CHUNK_WORDS, start, threads);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t w1 = (c + 1) * CHUNK_WORDS < words ? (c + 1) * CHUNK_WORDS : words;
        compact_range(codes, mask, numel, bits, c * CHUNK_WORDS, w1, start[c] * bits, out, &edges[c]);
    }
    or_edges(out, edges, chunks);
    free(start);
    free(edges);
    return 0;
}

int expand_codes(const uint8_t *compact, int64_t count, const uint8_t *mask, int64_t numel, int bits,
                 uint8_t *out, int threads) {
    /* every byte of out (the full packed codes) is written; unset elements get code 0. Returns 1 if memory
     * ran out. */
    const int64_t words = (numel + 63) / 64, code_bytes = (numel * bits + 7) / 8;
    const int64_t stream_bytes = (count * bits + 7) / 8, chunks = (words + CHUNK_WORDS - 1) / CHUNK_WORDS;
    const uint64_t starts = field_starts(bits);
    int64_t *start = malloc((size_t)(chunks ? chunks : 1) * sizeof(int64_t));
    if (!start) return 1;
    chunk_starts(mask, numel, words, chunks, CHUNK_WORDS, start, threads);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t w1 = (c + 1) * CHUNK_WORDS < words ? (c + 1) * CHUNK_WORDS : words;
        int64_t pos = start[c] * bits;  /* bit position in the stream */
        for (int64_t w = c * CHUNK_WORDS; w < w1; w++) {
            const uint64_t m = mask_word(mask, w, numel);
            for (int j = 0; j < bits; j++) {
                const int64_t at = 8 * (w * bits + j);
                if (at >= code_bytes) break;
                const uint64_t mj = part_of(m, j, bits);
                uint64_t word = 0;
                if (mj) {
                    const int n = __builtin_popcountll(mj) * bits;
                    word = scatter(read_bits(compact, stream_bytes, pos, n), selector(mj, bits, starts));
                    pos += n;
                }
                if (code_bytes - at >= 8) memcpy(out + at, &word, 8);
                else memcpy(out + at, &word, (size_t)(code_bytes - at));
            }
        }
    }
    free(start);
    return 0;
}
