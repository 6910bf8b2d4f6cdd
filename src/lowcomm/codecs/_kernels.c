/* Fused CPU kernels of the codecs (lowcomm.codecs._native loads them; every one has a torch
 * path that gives the same bits, used where this library is not built).
 *
 * Built with -ffp-contract=off: each float operation rounds as torch's does (no fused
 * multiply-add), so the outputs are bit-identical to the torch path.
 */
#include <stdint.h>
#include <string.h>
#include <limits.h>
#include <stdlib.h>

static inline uint32_t bits_of(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

/* How many of a[0..n) are >= t (vectorized; cloned for AVX2 where the CPU has it). */
__attribute__((target_clones("avx2", "default")))
static int64_t count_at_least(const int32_t *a, int64_t n, int32_t t) {
    int32_t c = 0;
    for (int64_t i = 0; i < n; i++) c += a[i] >= t;
    return c;
}

/* The k-th largest of a[0..n) (1 <= k <= n, entries >= 0), by bisection on the value: the
 * largest t with at least k entries >= t. Branch-free counting, 31 rounds. */
static int32_t kth_largest(const int32_t *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = (int64_t)INT32_MAX + 1; /* count(lo) >= k > count(hi) */
    while (hi - lo > 1) {
        int64_t mid = lo + (hi - lo) / 2;
        if (count_at_least(a, n, (int32_t)mid) >= k) lo = mid;
        else hi = mid;
    }
    return (int32_t)lo;
}

#define GROUP 8
#define SPAN 16384 /* elements of the tiles gathered at once (they stay in the core's cache) */

/* One tile's selection from its values and magnitudes (see lc_topk_select). */
static void select_tile(const float *val, const int32_t *mag, int64_t L, int64_t k,
                        int64_t group, int32_t *work, int32_t *cand, int64_t **out_idx,
                        float **out_val) {
    int64_t G = L / group, ng = 0, nc = 0;
    int32_t t0 = 0;
    if (group > 1) {
        for (int64_t g = 0; g < G; g++) {
            int32_t mx = mag[g * group];
            for (int64_t j = 1; j < group; j++) mx = mag[g * group + j] > mx ? mag[g * group + j] : mx;
            work[g] = mx;
        }
        t0 = kth_largest(work, G, k);
        for (int64_t g = 0; g < G; g++) {
            if (work[g] >= t0) cand[ng++] = (int32_t)g;
        }
        for (int64_t c = 0; c < ng; c++)
            for (int64_t j = 0; j < group; j++) work[nc++] = mag[cand[c] * group + j];
    } else {
        for (int64_t i = 0; i < L; i++) cand[i] = (int32_t)i, work[i] = mag[i];
        ng = nc = L;
    }
    int32_t t = kth_largest(work, nc, k);
    int64_t above = t < INT32_MAX ? count_at_least(work, nc, t + 1) : 0;
    int64_t ties = k - above; /* entries equal to t that are kept, lowest index first */
    int64_t *oi = *out_idx;
    float *ov = *out_val;
    for (int64_t c = 0; c < ng; c++) {
        for (int64_t j = 0; j < group; j++) {
            int64_t i = (int64_t)cand[c] * group + j;
            if (mag[i] > t || (mag[i] == t && ties-- > 0)) {
                *oi++ = i;
                *ov++ = val[i];
            }
        }
    }
    *out_idx = oi;
    *out_val = ov;
}

/* Top-k by magnitude in every tr x tc tile of an R x C row-major matrix, tiles in row-major
 * tile order: the entries above the k-th largest magnitude T, then those equal to T from the
 * lowest index on (magnitudes compared as bit patterns: NaN counts as the largest). Writes
 * k tile-local indices per tile in increasing order and the kept values. L = tr * tc <= 4096.
 *
 * Two stages, exact: the k-th largest of the maxima of groups of 8 neighbours, T0, is at most
 * T (k groups hold an entry >= T0), so every entry >= T lies in a group whose maximum is >= T0;
 * T is then the k-th largest of those groups' entries (about 8k of the tile's L). Tiles are
 * gathered a span of neighbours at a time, row by row, so the input is read in order. */
int64_t lc_topk_select(const float *x, int64_t R, int64_t C, int64_t tr, int64_t tc, int64_t k,
                       int64_t *out_idx, float *out_val) {
    int64_t L = tr * tc, nti = R / tr, ntj = C / tc;
    int64_t group = (L % GROUP == 0 && L / GROUP >= k && L >= 256) ? GROUP : 1;
    int64_t span = SPAN / L > 0 ? SPAN / L : 1; /* tiles per gather */
    float *val = malloc((size_t)(span * L) * sizeof(float));
    int32_t *mag = malloc((size_t)(span * L) * sizeof(int32_t));
    int32_t work[4096], cand[4096];
    if (!val || !mag) {
        free(val);
        free(mag);
        return 1;
    }
    for (int64_t ti = 0; ti < nti; ti++) {
        for (int64_t tj0 = 0; tj0 < ntj; tj0 += span) {
            int64_t nt = ntj - tj0 < span ? ntj - tj0 : span;
            for (int64_t r = 0; r < tr; r++) {
                const float *row = x + (ti * tr + r) * C + tj0 * tc;
                for (int64_t t = 0; t < nt; t++) {
                    float *v = val + t * L + r * tc;
                    int32_t *m = mag + t * L + r * tc;
                    memcpy(v, row + t * tc, (size_t)tc * sizeof(float));
                    for (int64_t c = 0; c < tc; c++) m[c] = (int32_t)(bits_of(v[c]) & 0x7FFFFFFFu);
                }
            }
            for (int64_t t = 0; t < nt; t++)
                select_tile(val + t * L, mag + t * L, L, k, group, work, cand, &out_idx, &out_val);
        }
    }
    free(val);
    free(mag);
    return 0;
}

/* The largest |x| of x[0..n) as a bit pattern (for finite floats the patterns of magnitudes
 * order as the values do; >= 0x7F800000 means an inf or a NaN). */
__attribute__((target_clones("avx2", "default")))
static uint32_t max_magnitude(const float *x, int64_t n) {
    uint32_t top = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t b = bits_of(x[i]) & 0x7FFFFFFFu;
        top = b > top ? b : top;
    }
    return top;
}

/* FP4 codes of x[0..n) * inv, computed as the encode table does (fp4._encode_table): from
 * y's sign, biased exponent be and first mantissa bit h, 0 if be < 120, else sign << 3 |
 * clamp(be - 120 + h, 1, 7). Arithmetic, not a lookup, so the loop vectorizes. */
__attribute__((target_clones("avx2", "default")))
static void fp4_codes(const float *x, int64_t n, float inv, uint8_t *codes) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t b = bits_of(x[i] * inv);
        int32_t be = (int32_t)((b >> 23) & 0xFFu), e = be - 120 + (int32_t)((b >> 22) & 1u);
        e = e < 1 ? 1 : e;
        e = e > 7 ? 7 : e;
        codes[i] = (uint8_t)(be < 120 ? 0 : (int32_t)((b >> 31) << 3) | e);
    }
}

/* FP4 E3M0 encode of n floats, blocks of B (the last may be short): per block the absmax
 * clamped below to min_scale, its codes (the block re-read from the cache), packed planar (in
 * a group of 512 codes byte j holds code j low and code j + half high, half = 256 or, in a
 * last group of m, ceil(m / 2), padded with pad), ``span`` elements (a multiple of 512 and
 * of B) at a time. The same bits as the torch path. Returns 1, having written nothing
 * useful, if an input is not finite (the sign of a NaN made by arithmetic is the hardware's:
 * the torch path encodes those), 2 if out of memory. */
int64_t lc_fp4_encode(const float *x, int64_t n, int64_t B, int64_t span, float min_scale,
                      uint8_t pad, float *scales, uint8_t *packed) {
    uint8_t *codes = malloc((size_t)span);
    if (!codes) return 2;
    for (int64_t s0 = 0; s0 < n; s0 += span) {
        int64_t s1 = n - s0 < span ? n : s0 + span;
        for (int64_t b0 = s0; b0 < s1; b0 += B) {
            int64_t m = s1 - b0 < B ? s1 - b0 : B;
            uint32_t top = max_magnitude(x + b0, m);
            if (top >= 0x7F800000u) {
                free(codes);
                return 1;
            }
            float s;
            memcpy(&s, &top, 4);
            s = s < min_scale ? min_scale : s;
            scales[b0 / B] = s;
            fp4_codes(x + b0, m, 1.0f / s, codes + (b0 - s0));
        }
        for (int64_t g0 = s0; g0 < s1; g0 += 512) {
            int64_t m = s1 - g0 < 512 ? s1 - g0 : 512;
            int64_t half = m == 512 ? 256 : (m + 1) / 2;
            const uint8_t *c = codes + (g0 - s0);
            uint8_t *o = packed + g0 / 2;
            for (int64_t j = 0; j < m - half; j++) o[j] = (uint8_t)(c[j] | (c[j + half] << 4));
            for (int64_t j = m - half; j < half; j++) o[j] = (uint8_t)(c[j] | (pad << 4));
        }
    }
    free(codes);
    return 0;
}

/* One run of FP4 codes sharing a scale: out[i] = (first ? 0 : out[i]) + dec(code i) * scale
 * (* weight), then / divisor if last; code i in byte i at ``shift``. dec is computed, not
 * looked up (e = code & 7: 0 for e = 0, else +-2^(e-7), whose pattern is (e + 120) << 23 with
 * the sign bit), so the loop vectorizes; it equals the decode table. Returns how many codes
 * were 0b1000. */
static inline __attribute__((always_inline)) int64_t fp4_run(const uint8_t *bytes, int shift,
                                                              int64_t n, float scale,
                                                              float weight, int weighted,
                                                              int first, int last,
                                                              float divisor, float *out) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t c = (uint32_t)(bytes[i] >> shift) & 15u;
        uint32_t e = c & 7u;
        uint32_t pattern = e ? ((e + 120u) << 23) | ((c & 8u) << 28) : 0u;
        float v;
        memcpy(&v, &pattern, 4);
        v = v * scale;
        if (weighted) v = v * weight;
        v = (first ? 0.0f : out[i]) + v;
        out[i] = last ? v / divisor : v;
        bad += c == 8u;
    }
    return bad;
}

/* The mean of M payloads of FP4 codes (planar: in a group of 512 codes, byte j holds code j
 * in its low nibble and code j + half in its high one, half = 256 or, in a last group of m,
 * ceil(m / 2)), each code decoded as dec[code] * the scale of its block of B and, with
 * weights, times its payload's weight; added in payload order to 0, then divided by
 * ``divisor``, as torch adds decoded tensors to zeros and divides. Returns how many codes
 * were invalid (0b1000, negative zero). */
/* (cloned for AVX2 as a whole, so the runs inline into it and vectorize) */
__attribute__((target_clones("avx2", "default")))
int64_t lc_fp4_decode_mean(int64_t M, const int64_t *packed_at, const int64_t *scales_at,
                           const float *weights, float divisor, int64_t n, int64_t B,
                           float *out) {
    int64_t bad = 0;
    for (int64_t g0 = 0; g0 < n; g0 += 512) {
        int64_t m = n - g0 < 512 ? n - g0 : 512;
        int64_t half = m == 512 ? 256 : (m + 1) / 2;
        for (int64_t w = 0; w < M; w++) {
            const uint8_t *bytes = (const uint8_t *)packed_at[w] + g0 / 2;
            const float *scales = (const float *)scales_at[w];
            float weight = weights ? weights[w] : 1.0f;
            for (int64_t i = g0; i < g0 + m;) { /* runs within one plane and one block */
                int64_t j = i - g0, plane = j >= half, end = g0 + (plane ? m : half);
                int64_t block_end = (i / B + 1) * B;
                end = end < block_end ? end : block_end;
                bad += fp4_run(bytes + (j - plane * half), plane ? 4 : 0, end - i, scales[i / B],
                               weight, weights != 0, w == 0, w == M - 1, divisor, out + i);
                i = end;
            }
        }
    }
    return bad;
}

/* The selected mean of M sparse contributions to one tensor: worker w sent K entries at
 * positions idx_w (tiles of k, increasing within a tile, tiles the same on every worker) with
 * values val_w. Each sent position gets the sum of its values (each times its worker's
 * weight, with weights), added in worker order to 0, over how many workers sent it (with
 * weights: the sum of their weights): as torch's index_add_ of one worker after another and
 * a division give. Positions nobody sent are left as they are (the caller zeroes out).
 * Returns 1 if out of memory. */
int64_t lc_selected_mean(int64_t M, const int64_t *idx_at, const int64_t *val_at,
                         const float *weights, int64_t K, int64_t k, float *out) {
    int64_t *pos = malloc((size_t)M * sizeof(int64_t));
    if (!pos) return 1;
    for (int64_t t0 = 0; t0 < K; t0 += k) {
        int64_t t1 = t0 + k;
        for (int64_t w = 0; w < M; w++) pos[w] = t0;
        for (;;) {
            int64_t at = INT64_MAX;
            for (int64_t w = 0; w < M; w++) {
                const int64_t *idx = (const int64_t *)idx_at[w];
                if (pos[w] < t1 && idx[pos[w]] < at) at = idx[pos[w]];
            }
            if (at == INT64_MAX) break;
            float sum = 0.0f, weight_sum = 0.0f;
            int64_t count = 0;
            for (int64_t w = 0; w < M; w++) {
                const int64_t *idx = (const int64_t *)idx_at[w];
                if (pos[w] < t1 && idx[pos[w]] == at) {
                    float v = ((const float *)val_at[w])[pos[w]++];
                    if (weights) {
                        v = v * weights[w];
                        weight_sum = weight_sum + weights[w];
                    }
                    sum = sum + v;
                    count++;
                }
            }
            out[at] = sum / (weights ? weight_sum : (float)count);
        }
    }
    free(pos);
    return 0;
}

/* Code j of n packed planar with ``bits`` in {1, 2, 4, 8} (bitpack.pack_planar): groups of
 * 256 * per codes (per = 8 / bits), a group of m codes in nb = ceil(m / per) bytes, code j of
 * the group in byte j % nb at bit offset bits * (j / nb). */
static inline uint32_t planar_get(const uint8_t *p, int64_t n, int bits, int64_t j) {
    int64_t per = 8 / bits, group = 256 * per, g = j / group, jj = j - g * group;
    int64_t m = n - g * group < group ? n - g * group : group;
    int64_t nb = (m + per - 1) / per;
    return (uint32_t)(p[g * 256 + jj % nb] >> (bits * (jj / nb))) & ((1u << bits) - 1u);
}

/* Value j of n packed by bitpack.pack_bits with ``bits`` <= 24: planar streams of the bit
 * slices 8, 8, ..., 4, 2, 1 (the binary digits of bits), low bits first, one after another. */
static inline uint32_t wide_get(const uint8_t *p, int64_t n, int bits, int64_t j) {
    uint32_t v = 0;
    int shift = 0, rest = bits;
    for (; rest >= 8; rest -= 8, shift += 8, p += n) v |= planar_get(p, n, 8, j) << shift;
    for (int w = 4; w >= 1; w >>= 1) {
        if (rest & w) {
            v |= planar_get(p, n, w, j) << shift;
            p += (n * w + 7) / 8;
            shift += w;
        }
    }
    return v;
}

/* Top-k indices: K tile-local indices (k per tile, pack_bits of index_bits) to flat positions
 * of the R x C tensor (tiles tr x tc, ntj per row of tiles, row-major), validated. Returns 0,
 * 1 if an index is >= L, 2 if a tile's indices do not strictly increase. */
int64_t lc_topk_indices(const uint8_t *packed, int64_t K, int64_t index_bits, int64_t k,
                        int64_t L, int64_t ntj, int64_t tr, int64_t tc, int64_t C,
                        int64_t *out) {
    int64_t prev = -1;
    for (int64_t j = 0; j < K; j++) {
        int64_t li = index_bits ? (int64_t)wide_get(packed, K, (int)index_bits, j) : 0;
        if (li >= L) return 1;
        if (j % k && li <= prev) return 2;
        prev = li;
        int64_t t = j / k, r = li / tc;
        out[j] = (t / ntj) * (tr * C) + (t % ntj) * tc + r * C + (li - r * tc);
    }
    return 0;
}

/* LutCodec values: n codes of ``bits`` in {1, 2, 4, 8} (planar), each lut[code] + shift. */
int64_t lc_lut_decode(const uint8_t *packed, int64_t n, int64_t bits, const float *lut,
                      float shift, float *out) {
    for (int64_t j = 0; j < n; j++) out[j] = lut[planar_get(packed, n, (int)bits, j)] + shift;
    return 0;
}

/* out = ref - p, and snap = p if snap is given (snap may be ref itself: each ref[i] is read
 * before snap[i] is written), in one pass; returns whether some difference is not finite. */
__attribute__((target_clones("avx2", "default")))
int64_t lc_sub_check(const float *ref, const float *p, float *out, float *snap, int64_t n) {
    uint32_t top = 0;
    if (snap) {
        for (int64_t i = 0; i < n; i++) {
            float v = p[i], d = ref[i] - v;
            out[i] = d;
            snap[i] = v;
            uint32_t b = bits_of(d) & 0x7FFFFFFFu;
            top = b > top ? b : top;
        }
    } else {
        for (int64_t i = 0; i < n; i++) {
            float d = ref[i] - p[i];
            out[i] = d;
            uint32_t b = bits_of(d) & 0x7FFFFFFFu;
            top = b > top ? b : top;
        }
    }
    return top >= 0x7F800000u;
}
