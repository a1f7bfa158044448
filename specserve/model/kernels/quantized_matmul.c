/*
 * int4 or int8 weights x int8 activations on AVX-512 VNNI: y[T, N] = x[T, K] @ W[N, K]^T.
 *
 * Why our own kernel: a decode step reads every weight once, so its time is the
 * weight bytes over the memory bandwidth. PyTorch's int4 and int8 CPU kernels
 * (bfloat16 activations) reach about half that limit and their cost grows with every
 * row, so verifying k drafts costs several plain steps. This kernel does what llama.cpp
 * does: it quantizes each row of activations to int8 per group of 32 and multiplies
 * unsigned weight levels by int8 values with `vpdpbusd` (64 byte products per
 * instruction). Each super-block of a weight row is unpacked once into registers and
 * used for up to TILE activation rows, so the weights are read from memory once per call.
 * Where many rows of long activations outgrow the L1 cache, rows go in chunks of
 * inputs (see CHUNK_Q_BYTES).
 *
 * Every output is computed by the same arithmetic in the same order whatever the
 * number of rows, the row's slot or its neighbours: the results are batch invariant.
 *
 * Weights (as native.py lays them out): group g of a row has 32 levels; for
 * int4 0..15, with a scale s[g] and a zero z[g] (bfloat16), w = (level - 8) s + z; for
 * int8 0..255 with one scale per row, w = (level - 128) s.
 * Groups go in super-blocks of n = min(16, groups left) groups, one int32 lane each.
 * Element i of group g in a super-block is quad r = i / 4, byte p = i % 4; its level
 * sits in byte 16*g0 + (r % 4)*4n + (g - g0)*4 + p (g0: the super-block's first group),
 * low nibble for r < 4, high nibble for r >= 4 (int8: byte 32*g0 + r*4n + (g - g0)*4 + p),
 * and its int8 activation at byte 64r + (g - g0)*4 + p of that row's super-block of
 * activations (512 bytes, padded with zeros; see block_slot). So one load gives quad r
 * of every group, and `vpdpbusd` adds each group's products into its
 * own lane.
 */
#include <immintrin.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "swiglu.h"

#define GROUP 32
#define BLOCK_GROUPS 16 /* groups per super-block: one int32 lane each */

static inline __mmask64 byte_mask(int n) { return n == BLOCK_GROUPS ? ~0ULL : (1ULL << (4 * n)) - 1; }

static inline __m512 load_bf16(const uint16_t *p, __mmask16 lanes) {
    return widen_bf16(_mm256_maskz_loadu_epi16(lanes, p));
}

/* Activation rows that share one unpacked super-block of weights (8 rows: ~10% faster
 * than 4 on verification's 8 rows). The compiler keeps their accumulators in memory
 * and the levels of one or two weight rows (8 or 16) in registers. */
#define TILE 8

/* Groups rounded up to whole super-blocks. */
static inline int padded_groups(int G) { return (G + BLOCK_GROUPS - 1) / BLOCK_GROUPS * BLOCK_GROUPS; }

/* Where super-block b of activation row t sits in the buffers, in super-blocks (512
 * bytes of q, 16 floats of d and a): rows go in tiles of TILE, each tile's super-blocks
 * one after another, and within each, the tile's rows side by side. So the rows a
 * weight row is multiplied by are read as one stream, in the order they are used
 * (row by row, 8 rows of a long layer would be 8 streams far apart; the figures are in
 * benchmarks/EXPERIMENTS.md). */
static inline size_t slot_in_tile(int b, int nt, int t) { return (size_t)b * nt + (size_t)t; }

static inline size_t block_slot(int t, int b, int T, int blocks) {
    const int t0 = t - t % TILE, nt = T - t0 < TILE ? T - t0 : TILE;
    return (size_t)t0 * blocks + slot_in_tile(b, nt, t - t0);
}

/* x [T, K] bfloat16 -> q int8 in super-blocks of 8 quads x 64 bytes (lane = group),
 * and per group d = max|x| / 127 and a = d * sum(q), float32, placed by block_slot.
 * Padding stays zero, so it adds nothing to a dot product. */
static void quantize_rows(const uint16_t *x, int T, int K, int8_t *q, float *d, float *a) {
    const int G = K / GROUP, Gp = padded_groups(G);
    memset(q, 0, (size_t)T * GROUP * Gp);
    memset(d, 0, sizeof(float) * (size_t)T * Gp);
    memset(a, 0, sizeof(float) * (size_t)T * Gp);
    for (int t = 0; t < T; t++) {
        for (int g = 0; g < G; g++) {
            const uint16_t *xg = x + (size_t)t * K + (size_t)g * GROUP;
            __m512 lo = load_bf16(xg, 0xffff), hi = load_bf16(xg + 16, 0xffff);
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            float scale = amax / 127.0f;
            __m512 inverse = _mm512_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
            __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inverse)); /* round half to even */
            __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inverse));
            int8_t levels[GROUP];
            _mm_storeu_si128((__m128i *)levels, _mm512_cvtsepi32_epi8(qlo));
            _mm_storeu_si128((__m128i *)(levels + 16), _mm512_cvtsepi32_epi8(qhi));
            int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
            const int g0 = g - g % BLOCK_GROUPS;
            const size_t at = block_slot(t, g0 / BLOCK_GROUPS, T, Gp / BLOCK_GROUPS);
            int8_t *block = q + at * GROUP * BLOCK_GROUPS + (size_t)(g - g0) * 4;
            for (int r = 0; r < 8; r++) memcpy(block + (size_t)r * 64, levels + 4 * r, 4);
            d[at * BLOCK_GROUPS + g - g0] = scale;
            a[at * BLOCK_GROUPS + g - g0] = scale * (float)sum;
        }
    }
}

/* Bytes of weights ahead of the super-block being read that are prefetched, with the
 * int4 scales and zeros as far ahead (they are streams of their own: 4 bytes a group
 * beside the levels' 16). The hardware prefetcher alone keeps one streamed row far
 * below the memory on some machines. On a Zen 4 (32-34 GB/s) the int8 head
 * [151936, 1536] with it against without: 8 rows (k = 7 verified) 1.31-1.42x faster,
 * 1-4 rows 0.96-1.03x. On a Zen 5 (77 GB/s, 2 cores, the 1.5B int4 target, its layers
 * in a forward's order so that each comes from memory): one row of the head 10.5-11.5
 * -> 3.1-5.7 ms (21 GB/s without); the int4 layers' scales and zeros prefetched too,
 * one row 22-24 -> 16-17 ms, 8 rows 51-56 -> 39-44 ms; a whole decode step 38 -> 25-27
 * ms, the 0.5B draft's 18.4 -> 8.9 ms. 4 KB or 8 KB ahead measured as 2 KB. */
#define PREFETCH_AHEAD 2048

/* Weight rows 0 .. nr-1 (nr = 1 or 2, the second pair_bytes and pair_scales after the
 * first) against the nt activation rows of one tile (q, d and a: the tile's first
 * super-block, the others placed as block_slot places them). Two weight rows share
 * each activation load. Whole rows (chunked = 0) go through every group; a chunk
 * through groups g_begin .. g_end - 1 (whole super-blocks but the row's last), resuming
 * the sums `carried` ([nr][TILE]) holds unless g_begin is 0 and leaving them there
 * unless g_end is G. Either way each output lane adds the same terms in the same
 * order. The weights `ahead` bytes on are prefetched (the int4 scales and zeros as
 * far). bits, nr, nt and chunked are constants after inlining (see TILE for what the
 * compiler keeps in registers; whole rows are compiled apart because the chunks' extra
 * integers made it spill in the int8 loop: 1.15x the time at 8 rows).
 * bits 4: levels 0..15, scale and zero per group: w = (level - 8) s + z.
 * bits 8: levels 0..255 (int8 weight + 128), one scale per row: w = (level - 128) s. */
static inline __attribute__((always_inline)) void rows_tile(
    const int bits, const int nr, const int chunked, const uint8_t *w, size_t pair_bytes, const uint16_t *scale,
    const uint16_t *zero, size_t pair_scales, int G, int g_begin, int g_end, size_t ahead, const int8_t *q,
    const float *d, const float *a, const int nt, __m512 *carried, float *out /* [nr][TILE] */) {
    const __m512i low_nibble = _mm512_set1_epi8(0x0f);
    __m512 acc[2][TILE];
    for (int i = 0; i < nr; i++)
        for (int t = 0; t < nt; t++) acc[i][t] = chunked && g_begin > 0 ? carried[i * TILE + t] : _mm512_setzero_ps();
    for (int g0 = g_begin, b = g_begin / BLOCK_GROUPS; g0 < g_end; g0 += BLOCK_GROUPS, b++) {
        const int n = G - g0 < BLOCK_GROUPS ? G - g0 : BLOCK_GROUPS;
        const __mmask64 bytes = byte_mask(n);
        const __mmask16 lanes = (__mmask16)((1u << n) - 1);
        __m512i levels[2][8]; /* quad r of each group's levels, as unsigned bytes */
        __m512 s[2], level0[2]; /* per group: the scale, and the value of level 0 */
        for (int i = 0; i < nr; i++) {
            if (bits == 4) {
                const uint8_t *wb = w + i * pair_bytes + (size_t)16 * g0;
                /* The levels 2 KB ahead (on a Zen 4: 10-20% faster than none), and the
                 * scales and zeros of the same groups: 2 bytes a group where levels take 16 */
                for (int p = 0; p < 4; p++) _mm_prefetch((const char *)(wb + ahead + 64 * p), _MM_HINT_T0);
                _mm_prefetch((const char *)(scale + i * pair_scales + g0 + ahead / 16), _MM_HINT_T0);
                _mm_prefetch((const char *)(zero + i * pair_scales + g0 + ahead / 16), _MM_HINT_T0);
                for (int j = 0; j < 4; j++) {
                    __m512i packed = _mm512_maskz_loadu_epi8(bytes, wb + (size_t)j * 4 * n);
                    levels[i][j] = _mm512_and_si512(packed, low_nibble);
                    levels[i][j + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibble);
                }
                s[i] = load_bf16(scale + i * pair_scales + g0, lanes);
                level0[i] = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s[i], load_bf16(zero + i * pair_scales + g0, lanes));
            } else {
                const uint8_t *wb = w + i * pair_bytes + (size_t)32 * g0;
                for (int p = 0; p < 8; p++) _mm_prefetch((const char *)(wb + ahead + 64 * p), _MM_HINT_T0);
                for (int r = 0; r < 8; r++) levels[i][r] = _mm512_maskz_loadu_epi8(bytes, wb + (size_t)r * 4 * n);
                s[i] = _mm512_set1_ps(from_bf16(scale[i * pair_scales]));
                level0[i] = _mm512_mul_ps(_mm512_set1_ps(-128.0f), s[i]);
            }
        }
        for (int t = 0; t < nt; t++) {
            const size_t at = slot_in_tile(b, nt, t); /* q, d and a start at the tile's first slot */
            const __m512i *qb = (const __m512i *)(q + at * GROUP * BLOCK_GROUPS);
            /* per group: sum of level * q, as four chains (quads r % 4) added at the
             * end: the same integers, a quarter of the latency. Against two chains
             * (`kernel_ab.py --forward`, Zen 5, three runs): 8 rows 0.972-0.978x the
             * time, 16 rows 0.990x, one row within the memory's noise. */
            __m512i dot[2][4];
            for (int i = 0; i < nr; i++) dot[i][0] = dot[i][1] = dot[i][2] = dot[i][3] = _mm512_setzero_si512();
            for (int r = 0; r < 8; r++) {
                __m512i qv = _mm512_load_si512(qb + r);
                /* Into a register: the compiler would fold the load into each row's
                 * vpdpbusd, two loads where one serves both. */
                if (nr == 2) __asm__("" : "+v"(qv));
                for (int i = 0; i < nr; i++) dot[i][r % 4] = _mm512_dpbusd_epi32(dot[i][r % 4], levels[i][r], qv);
            }
            for (int i = 0; i < nr; i++)
                dot[i][0] = _mm512_add_epi32(_mm512_add_epi32(dot[i][0], dot[i][1]), _mm512_add_epi32(dot[i][2], dot[i][3]));
            const __m512 dv = _mm512_load_ps(d + at * BLOCK_GROUPS);
            const __m512 av = _mm512_load_ps(a + at * BLOCK_GROUPS);
            for (int i = 0; i < nr; i++) {
                /* sum (level s + level0) d q = s d dot + level0 d sum(q) */
                acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][0]), _mm512_mul_ps(s[i], dv), acc[i][t]);
                acc[i][t] = _mm512_fmadd_ps(av, level0[i], acc[i][t]);
            }
        }
    }
    for (int i = 0; i < nr; i++)
        for (int t = 0; t < nt; t++) {
            if (chunked && g_end < G) carried[i * TILE + t] = acc[i][t];
            else out[i * TILE + t] = _mm512_reduce_add_ps(acc[i][t]);
        }
}

#define ONE_ROW_CASE(NT, CHUNKED)                                                                   \
    case NT:                                                                                        \
        if (bits == 4)                                                                              \
            rows_tile(4, 1, CHUNKED, w, 0, scale, zero, 0, G, g_begin, g_end, ahead, q, d, a, NT, carried, out); \
        else rows_tile(8, 1, CHUNKED, w, 0, scale, zero, 0, G, g_begin, g_end, ahead, q, d, a, NT, carried, out); \
        break;
#define ROW_PAIR_CASE(NT, CHUNKED)                                                                                   \
    case NT:                                                                                                         \
        rows_tile(4, 2, CHUNKED, w, pair_bytes, scale, zero, pair_scales, G, g_begin, g_end, ahead, q, d, a, NT,       \
                  carried, out);                                                                                     \
        break;
#define EVERY_TILE_SIZE(CASE, CHUNKED) \
    CASE(1, CHUNKED) CASE(2, CHUNKED) CASE(3, CHUNKED) CASE(4, CHUNKED) CASE(5, CHUNKED) CASE(6, CHUNKED) CASE(7, CHUNKED) CASE(8, CHUNKED)

/* nt <= TILE; nr = 1, or int4 with nr = 2. Whole rows: the group bounds and prefetch
 * distance are constants here, for the compiler. */
static void rows_tile_any(int bits, int nr, const uint8_t *w, size_t pair_bytes, const uint16_t *scale,
                          const uint16_t *zero, size_t pair_scales, int G, const int8_t *q, const float *d,
                          const float *a, int nt, float *out) {
    const int g_begin = 0, g_end = G;
    const size_t ahead = PREFETCH_AHEAD;
    __m512 *carried = NULL;
    if (nr == 2) switch (nt) { EVERY_TILE_SIZE(ROW_PAIR_CASE, 0) }
    else switch (nt) { EVERY_TILE_SIZE(ONE_ROW_CASE, 0) }
}

/* The same for a chunk of the rows (see rows_tile). */
static void chunk_tile_any(int bits, int nr, const uint8_t *w, size_t pair_bytes, const uint16_t *scale,
                           const uint16_t *zero, size_t pair_scales, int G, int g_begin, int g_end, size_t ahead,
                           const int8_t *q, const float *d, const float *a, int nt, __m512 *carried, float *out) {
    if (nr == 2) switch (nt) { EVERY_TILE_SIZE(ROW_PAIR_CASE, 1) }
    else switch (nt) { EVERY_TILE_SIZE(ONE_ROW_CASE, 1) }
}

/* Weight row n, and row `second` with it unless second < 0 (int4 only), against
 * activation rows t0 .. t0 + nt - 1 (nt <= TILE): out [2][TILE] float32, before bias.
 * With `carried`, a chunk of groups g_begin .. g_end - 1 (see rows_tile), the weights
 * `ahead` bytes on prefetched; without, whole rows. */
static inline void dot_tile_part(int bits, int n, int second, int t0, int nt, int K, int g_begin, int g_end,
                                 size_t ahead, const uint8_t *weights, const uint16_t *scale, const uint16_t *zero,
                                 const int8_t *q, const float *d, const float *a, __m512 *carried, float *out) {
    const int G = K / GROUP, nr = second < 0 ? 1 : 2;
    const size_t tile = (size_t)t0 * (padded_groups(G) / BLOCK_GROUPS); /* the tile's first slot */
    const size_t row_bytes = (size_t)K * bits / 8, row_scales = bits == 4 ? (size_t)G : 1;
    const size_t apart = second < 0 ? 0 : (size_t)(second - n);
    const uint8_t *w = weights + n * row_bytes;
    const uint16_t *s = scale + n * row_scales, *z = zero ? zero + n * row_scales : NULL;
    q += tile * GROUP * BLOCK_GROUPS, d += tile * BLOCK_GROUPS, a += tile * BLOCK_GROUPS;
    if (carried)
        chunk_tile_any(bits, nr, w, apart * row_bytes, s, z, apart * row_scales, G, g_begin, g_end, ahead, q, d, a, nt,
                       carried, out);
    else
        rows_tile_any(bits, nr, w, apart * row_bytes, s, z, apart * row_scales, G, q, d, a, nt, out);
}

/* The same over whole rows. */
static inline void dot_tile(int bits, int n, int second, int t0, int nt, int K, const uint8_t *weights,
                            const uint16_t *scale, const uint16_t *zero, const int8_t *q, const float *d,
                            const float *a, float *out) {
    dot_tile_part(bits, n, second, t0, nt, K, 0, K / GROUP, PREFETCH_AHEAD, weights, scale, zero, q, d, a, NULL, out);
}

/* Whether two int4 weight rows share each activation load: with several activation
 * rows (see plain_rows). */
static inline int paired(int bits, int T) { return bits == 4 && T > 1; }

/* Where a tile's activations outgrow what the L1 cache keeps (more than CHUNK_Q_BYTES of
 * q), long rows go in chunks of CHUNK_GROUPS groups: a unit of weight rows (one row, or
 * a pair) runs every tile over its first chunk, the next units the same chunk while
 * those activations sit in the L1, then all of them the next chunk, carrying their sums
 * in between. Read whole, the 1.5B target's down projection (8960 inputs: 8 rows take
 * 72 KB of q against a Zen 5's 48 KB L1) read every tile's activations from L2 again
 * for each unit, and its speed swung with where the buffers sat: in decode_blocks, code
 * changes elsewhere in this file moved it from 10 to 17 ms a forward at 8 rows (and
 * the same in a C harness with q moved by 256 bytes). At 16 rows it took 2.5x the time
 * of 8, where gate/up took 2x. Chunked, in the int4 target on a Zen 5 (2 cores, weights
 * in huge pages, builds in processes taking turns, 4 rounds): down at 4 rows 0.97x the
 * time, at 8 rows 1.00x, at 16 rows 0.71x (the forward 0.90x). On weights in 4 KB pages
 * a C harness measured 8 chunked rows slower (1.27x: 1 KB pieces of 64 rows instead of
 * whole rows one after another). */
#define CHUNK_Q_BYTES (32 * 1024)
#define CHUNK_GROUPS 64 /* 2048 inputs: 16 KB of q for 8 rows */
/* At most this many bytes of carried sums per pass (a thread's, in its L2). */
#define CARRIED_BYTES (64 * 1024)

/* Whether plain_rows takes T rows of K inputs in chunks: where a tile's activations
 * outgrow CHUNK_Q_BYTES and a chunk of every tile's fits in it (up to 16 rows; a
 * prompt's 41 rows in chunks that did not fit took 1.04x the time of whole rows). */
static inline int in_chunks(int T, int K) {
    const size_t tiles = (size_t)(T + TILE - 1) / TILE;
    return (size_t)(T < TILE ? T : TILE) * K > CHUNK_Q_BYTES && K / GROUP > CHUNK_GROUPS &&
           tiles * TILE * CHUNK_GROUPS * GROUP <= CHUNK_Q_BYTES;
}

/* Outputs n .. n + nr - 1 of activation rows t0 .. t0 + nt - 1, from dot_tile's out. */
static inline void write_tile(int n, int nr, int t0, int nt, int N, const uint16_t *bias, const float *out, uint16_t *y) {
    for (int i = 0; i < nr; i++) {
        const float b = bias ? from_bf16(bias[n + i]) : 0.0f;
        for (int t = 0; t < nt; t++) y[(size_t)(t0 + t) * N + n + i] = to_bf16(out[i * TILE + t] + b);
    }
}

/* plain_rows in chunks of CHUNK_GROUPS: units of `step` weight rows
 * in passes of as many as CARRIED_BYTES of sums allow. Returns -1, having written
 * nothing, when out of memory. */
static int chunked_rows(int bits, int step, int T, int K, const uint8_t *weights, const uint16_t *scale,
                        const uint16_t *zero, const uint16_t *bias, int N, const int8_t *q, const float *d,
                        const float *a, uint16_t *y) {
    const int G = K / GROUP, tiles = (T + TILE - 1) / TILE, units = (N + step - 1) / step;
    const size_t unit_carried = 2 * TILE * (size_t)tiles; /* in vectors */
    const int pass_units = CARRIED_BYTES / (sizeof(__m512) * unit_carried) > 1
                               ? (int)(CARRIED_BYTES / (sizeof(__m512) * unit_carried)) : 1;
    __m512 *carried_all = aligned_alloc(64, sizeof(__m512) * unit_carried * pass_units * omp_get_max_threads());
    if (!carried_all) return -1;
    const size_t ahead = (size_t)step * K * bits / 8; /* the next unit's chunk */
#pragma omp parallel for schedule(static)
    for (int u0 = 0; u0 < units; u0 += pass_units) {
        const int u1 = u0 + pass_units < units ? u0 + pass_units : units;
        __m512 *carried = carried_all + unit_carried * pass_units * omp_get_thread_num();
        for (int g_begin = 0; g_begin < G; g_begin += CHUNK_GROUPS) {
            const int g_end = g_begin + CHUNK_GROUPS < G ? g_begin + CHUNK_GROUPS : G;
            for (int u = u0; u < u1; u++) {
                const int n = u * step, nr = n + step <= N ? step : N - n;
                for (int t0 = 0, tile = 0; t0 < T; t0 += TILE, tile++) {
                    const int nt = T - t0 < TILE ? T - t0 : TILE;
                    float out[2 * TILE];
                    dot_tile_part(bits, n, nr == 2 ? n + 1 : -1, t0, nt, K, g_begin, g_end, ahead, weights, scale, zero,
                                  q, d, a, carried + ((size_t)(u - u0) * tiles + tile) * 2 * TILE, out);
                    if (g_end == G) write_tile(n, nr, t0, nt, N, bias, out, y);
                }
            }
        }
    }
    free(carried_all);
    return 0;
}

/* y [T, N] = x W^T + bias, each output rounded to bfloat16 once. */
static void plain_rows(int bits, int T, int K, const uint8_t *weights, const uint16_t *scale, const uint16_t *zero,
                       const uint16_t *bias, int N, const int8_t *q, const float *d, const float *a, uint16_t *y) {
    /* With several activation rows, two int4 weight rows share each activation load
     * (gated_rows pairs each gate row with its up row): one row alone needs one 64-byte
     * load per vpdpbusd, about what the L1 serves. Against one row at a time (the 1.5B
     * target's o, gate/up and down; 7 rounds taking turns): 2-16 rows 0.81-0.90x the
     * time, 200 rows 0.85-0.96x; the whole forward 0.96x at 8 rows, a 200-token prompt
     * 0.90-0.95x. (Pairs once took tiles of 4, their accumulators held in registers,
     * which spilled them: within L1 they lost 0-10%, and gate/up pairs 9-16%.) */
    const int step = paired(bits, T) ? 2 : 1;
    if (in_chunks(T, K) && chunked_rows(bits, step, T, K, weights, scale, zero, bias, N, q, d, a, y) == 0)
        return;
    /* Whole rows, a unit at a time (a loop of its own: at 1536 inputs a unit's 8 rows
     * take ~25 ns, and the chunks' bookkeeping cost int8 1.06x the time). */
#pragma omp parallel for schedule(static)
    for (int first = 0; first < (N + step - 1) / step; first++) {
        const int n = first * step, nr = n + step <= N ? step : N - n;
        float out[2 * TILE];
        for (int t0 = 0; t0 < T; t0 += TILE) {
            const int nt = T - t0 < TILE ? T - t0 : TILE;
            dot_tile(bits, n, nr == 2 ? n + 1 : -1, t0, nt, K, weights, scale, zero, q, d, a, out);
            write_tile(n, nr, t0, nt, N, bias, out, y);
        }
    }
}

/* The gate and up projections of a SwiGLU MLP in one: W holds the gate's rows, then the
 * up's (N rows in all); y [T, N/2] = silu(gate) * up (see swiglu.h), 16 outputs at a
 * time through the vectorised exp. */
static void gated_rows(int bits, int T, int K, const uint8_t *weights, const uint16_t *scale, const uint16_t *zero,
                       const uint16_t *bias, int N, const int8_t *q, const float *d, const float *a, uint16_t *y) {
    const int half = N / 2;
#pragma omp parallel for schedule(static)
    for (int block = 0; block < (half + 15) / 16; block++) {
        const int n0 = 16 * block, width = half - n0 < 16 ? half - n0 : 16;
        for (int t0 = 0; t0 < T; t0 += TILE) {
            const int nt = T - t0 < TILE ? T - t0 : TILE;
            float gate[TILE][16] = {{0}}, up[TILE][16] = {{0}}, out[2 * TILE];
            for (int j = 0; j < width; j++) {
                const int n = n0 + j;  /* the gate's row; the up's is n + half */
                if (paired(bits, T)) {
                    dot_tile(bits, n, n + half, t0, nt, K, weights, scale, zero, q, d, a, out);
                } else {
                    dot_tile(bits, n, -1, t0, nt, K, weights, scale, zero, q, d, a, out);
                    dot_tile(bits, n + half, -1, t0, nt, K, weights, scale, zero, q, d, a, out + TILE);
                }
                for (int part = 0; part < 2; part++) {
                    const float b = bias ? from_bf16(bias[n + part * half]) : 0.0f;
                    for (int t = 0; t < nt; t++) (part ? up : gate)[t][j] = round_bf16(out[part * TILE + t] + b);
                }
            }
            for (int t = 0; t < nt; t++) silu_times_up(gate[t], up[t], width, y + (size_t)(t0 + t) * half + n0);
        }
    }
}

/* x [T, K] bf16 -> y [T, N] bf16 (gated: [T, N/2], see gated_rows), bias [N] bf16 or NULL.
 * bits 4: weights [N, K/2] uint8, scale and zero [N, K/32] bf16.
 * bits 8: weights [N, K] uint8, scale [N] bf16, zero unused.
 * Returns 0, or -1 when out of memory. */
int quantized_matmul(int bits, int gated, const uint16_t *x, int T, int K, const uint8_t *weights,
                     const uint16_t *scale, const uint16_t *zero, const uint16_t *bias, int N, uint16_t *y) {
    const int G = K / GROUP, Gp = padded_groups(G);
    int8_t *q = aligned_alloc(64, (size_t)T * GROUP * Gp);
    float *d = aligned_alloc(64, sizeof(float) * (size_t)T * Gp);
    float *a = aligned_alloc(64, sizeof(float) * (size_t)T * Gp);
    if (!q || !d || !a) {
        free(q), free(d), free(a);
        return -1;
    }
    quantize_rows(x, T, K, q, d, a);
    (gated ? gated_rows : plain_rows)(bits, T, K, weights, scale, zero, bias, N, q, d, a, y);
    free(q), free(d), free(a);
    return 0;
}
