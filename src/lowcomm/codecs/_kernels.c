/* The CPU's kernels (lowcomm.codecs._native builds and loads them, lowcomm.codecs.kernels
 * chooses them): top-k selection, a block codec's quantisation and dequantisation, and a
 * fragment's pseudo-gradient with its finite check. Each
 * gives the bits of its torch implementation, the reference (tests/test_kernels.py).
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

/* Top-k by magnitude in each of ``ntiles`` tiles of tr x tc entries: tile t's row r holds the
 * tc floats from x + base[t] + r * row[t]. Keeps the entries above the k-th largest magnitude
 * T, then those equal to T from the lowest index on (magnitudes compared as bit patterns: NaN
 * counts as the largest), and writes their tile-local indices in increasing order and their
 * values from kept_at[t] on. L = tr * tc <= 4096. Returns 1, having written nothing, if out
 * of memory.
 *
 * Two stages, exact: the k-th largest of the maxima of groups of 8 neighbours, T0, is at most
 * T (k groups hold an entry >= T0), so every entry >= T lies in a group whose maximum is >= T0;
 * T is then the k-th largest of those groups' entries (about 8k of the tile's L). */
int64_t lc_select_tiles(const float *x, const int64_t *base, const int64_t *row,
                        const int64_t *kept_at, int64_t ntiles, int64_t tr, int64_t tc,
                        int64_t k, int64_t *out_idx, float *out_val) {
    int64_t L = tr * tc;
    int64_t group = (L % GROUP == 0 && L / GROUP >= k && L >= 256) ? GROUP : 1;
    float *val = malloc((size_t)L * sizeof(float));
    int32_t *mag = malloc((size_t)L * sizeof(int32_t));
    int32_t *work = malloc((size_t)L * sizeof(int32_t)), *cand = malloc((size_t)L * sizeof(int32_t));
    if (!val || !mag || !work || !cand) {
        free(val);
        free(mag);
        free(work);
        free(cand);
        return 1;
    }
    for (int64_t t = 0; t < ntiles; t++) {
        for (int64_t r = 0; r < tr; r++) {
            const float *src = x + base[t] + r * row[t];
            float *v = val + r * tc;
            int32_t *m = mag + r * tc;
            memcpy(v, src, (size_t)tc * sizeof(float));
            for (int64_t c = 0; c < tc; c++) m[c] = (int32_t)(bits_of(v[c]) & 0x7FFFFFFFu);
        }
        int64_t *oi = out_idx + kept_at[t];
        float *ov = out_val + kept_at[t];
        select_tile(val, mag, L, k, group, work, cand, &oi, &ov);
    }
    free(val);
    free(mag);
    free(work);
    free(cand);
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

/* int-k codes of x[0..n): the low byte of the pattern of x * inv + (2^23 + offset), as the
 * torch steps compute them (round to nearest even in the FPU). */
__attribute__((target_clones("avx2", "default")))
static void int_codes(const float *x, int64_t n, float inv, float magic, uint8_t *codes) {
    for (int64_t i = 0; i < n; i++) {
        float y = x[i] * inv;
        y = y + magic;
        codes[i] = (uint8_t)(bits_of(y) & 0xFFu);
    }
}

/* FP4 codes of x[0..n) * inv, as the encode table gives them (fp4._encode_table): from y's
 * sign, biased exponent be and first mantissa bit h, 0 if be < 120, else sign << 3 |
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

/* A block codec's rows of B floats to one scale each (the absmax, at least min_scale) and one
 * code a byte: int-k (qmax > 0) as x * ((1 / s) * qmax) rounded, offset by ``offset`` (torch's
 * ``qmax / s`` is a reciprocal, then a product: a division differs in the last bit, which moves
 * a code at a tie); FP4 (qmax 0) as x * (1 / s) by its table's rule. The bits of the torch steps. Returns 1, having written
 * nothing useful, if an input is not finite (which NaN a scale holds is the hardware's: the
 * torch steps encode those). */
int64_t lc_quantize_rows(const float *x, int64_t rows, int64_t B, int64_t qmax, int64_t offset,
                         float min_scale, float *scales, uint8_t *codes) {
    float magic = 8388608.0f + (float)offset;
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * B;
        uint32_t top = max_magnitude(row, B);
        if (top >= 0x7F800000u) return 1;
        float s;
        memcpy(&s, &top, 4);
        s = s < min_scale ? min_scale : s;
        scales[r] = s;
        if (qmax > 0) int_codes(row, B, (1.0f / s) * (float)qmax, magic, codes + r * B);
        else fp4_codes(row, B, 1.0f / s, codes + r * B);
    }
    return 0;
}

/* lc_quantize_rows for each of T tensors laid one after another in x: tensor t's count[t]
 * values from x + src[t] in blocks of B (its last one may be short), its blocks' scales and
 * codes from row first[t] on (a short block's missing codes: ``pad``). The torch steps pad a
 * short block with zeros, whose absmax is the same and whose code is ``pad``. */
int64_t lc_quantize_runs(const float *x, int64_t T, const int64_t *src, const int64_t *count,
                         const int64_t *first, int64_t B, int64_t qmax, int64_t offset,
                         float min_scale, uint8_t pad, float *scales, uint8_t *codes) {
    float magic = 8388608.0f + (float)offset;
    for (int64_t t = 0; t < T; t++) {
        const float *xs = x + src[t];
        int64_t n = count[t], r0 = first[t];
        for (int64_t j = 0; j * B < n; j++) {
            int64_t m = n - j * B < B ? n - j * B : B;
            const float *block = xs + j * B;
            uint32_t top = max_magnitude(block, m);
            if (top >= 0x7F800000u) return 1;
            float s;
            memcpy(&s, &top, 4);
            s = s < min_scale ? min_scale : s;
            scales[r0 + j] = s;
            uint8_t *c = codes + (r0 + j) * B;
            if (qmax > 0) int_codes(block, m, (1.0f / s) * (float)qmax, magic, c);
            else fp4_codes(block, m, 1.0f / s, c);
            memset(c + m, pad, (size_t)(B - m));
        }
    }
    return 0;
}

/* One block's n codes at c with scale s into o (or added to it), as lc_dequantize_rows does;
 * how many are outside the format. The add and the format chosen outside the loops. */
static inline int64_t dequantize_row(const uint8_t *c, int64_t n, float s, int64_t qmax,
                                     int64_t offset, int64_t add, float *o) {
    int64_t bad = 0;
    if (qmax > 0) {
        float step = s / (float)qmax, off = (float)offset;
        if (add)
            for (int64_t i = 0; i < n; i++) o[i] = o[i] + ((float)c[i] - off) * step;
        else
            for (int64_t i = 0; i < n; i++) o[i] = ((float)c[i] - off) * step;
        for (int64_t i = 0; i < n; i++) bad += c[i] == 0;
    } else {
        for (int64_t i = 0; i < n; i++) {
            uint32_t code = c[i] & 15u, e = code & 7u;
            uint32_t pattern = e ? ((e + 120u) << 23) | ((code & 8u) << 28) : 0u;
            float v;
            memcpy(&v, &pattern, 4);
            o[i] = add ? o[i] + v * s : v * s;
        }
        for (int64_t i = 0; i < n; i++) bad += (c[i] & 15u) == 8u;
    }
    return bad;
}

/* The values of a block codec's codes (one a byte) into out (rows x B), or with ``add`` added
 * to it: int-k as (code - offset) * (s / qmax), FP4 as its table's value times s. Returns how
 * many codes are outside the format (int-k's 0, FP4's 0b1000). */
__attribute__((target_clones("avx2", "default")))
int64_t lc_dequantize_rows(const uint8_t *codes, const float *scales, int64_t rows, int64_t B,
                           int64_t qmax, int64_t offset, int64_t add, float *out) {
    int64_t bad = 0;
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *c = codes + r * B;
        float *o = out + r * B;
        float s = scales[r];
        if (qmax > 0) {
            float step = s / (float)qmax, off = (float)offset;
            for (int64_t i = 0; i < B; i++) {
                float v = ((float)c[i] - off) * step;
                o[i] = add ? o[i] + v : v;
                bad += c[i] == 0;
            }
        } else {
            for (int64_t i = 0; i < B; i++) {
                uint32_t code = c[i] & 15u, e = code & 7u;
                uint32_t pattern = e ? ((e + 120u) << 23) | ((code & 8u) << 28) : 0u;
                float v;
                memcpy(&v, &pattern, 4);
                v = v * s;
                o[i] = add ? o[i] + v : v;
                bad += code == 8u;
            }
        }
    }
    return bad;
}

/* lc_dequantize_rows for each of T tensors: tensor t's count[t] codes from row first[t] of
 * codes (rows of B) into out + src[t] (or added to it), without its last block's padding. */
__attribute__((target_clones("avx2", "default")))
int64_t lc_dequantize_runs(const uint8_t *codes, const float *scales, int64_t T,
                           const int64_t *src, const int64_t *count, const int64_t *first,
                           int64_t B, int64_t qmax, int64_t offset, int64_t add, float *out) {
    int64_t bad = 0;
    for (int64_t t = 0; t < T; t++) {
        float *os = out + src[t];
        int64_t n = count[t], r0 = first[t];
        for (int64_t j = 0; j * B < n; j++) {
            int64_t m = n - j * B < B ? n - j * B : B;
            bad += lc_dequantize_rows(codes + (r0 + j) * B, scales + r0 + j, 1, m, qmax, offset,
                                      add, os + j * B);
        }
    }
    return bad;
}

/* lc_dequantize_runs straight from codes of ``bits`` in {2, 4} packed planar (lc_pack_planar's
 * layout): tensor t's count[t] codes at payload + dst[t], its blocks' scales from
 * scales + first[t], into out + src[t] (or added to it). A group of codes at a time is unpacked
 * into a buffer that stays in cache: the codes are never written out whole. */
__attribute__((target_clones("avx2", "default")))
int64_t lc_dequantize_planar(const uint8_t *payload, const float *scales, int64_t T,
                             const int64_t *src, const int64_t *count, const int64_t *first,
                             const int64_t *dst, int64_t bits, int64_t B, int64_t qmax,
                             int64_t offset, int64_t add, float *out) {
    int64_t per = 8 / bits, group = 256 * per, bad = 0;
    uint8_t mask = (uint8_t)((1u << bits) - 1u);
    uint8_t buf[256 * 8];
    for (int64_t t = 0; t < T; t++) {
        const uint8_t *o = payload + dst[t];
        float *os = out + src[t];
        int64_t n = count[t];
        for (int64_t g0 = 0, g = 0; g0 < n; g0 += group, g++) {
            int64_t m = n - g0 < group ? n - g0 : group;
            const uint8_t *og = o + g * 256;
            if (m == group) {
                for (int64_t p = 0; p < per; p++) {
                    int shift = (int)(bits * p);
                    for (int64_t j = 0; j < 256; j++) buf[p * 256 + j] = (og[j] >> shift) & mask;
                }
            } else {
                int64_t nb = (m + per - 1) / per;
                for (int64_t p = 0; p < per; p++)
                    for (int64_t j = 0; j < nb && p * nb + j < m; j++)
                        buf[p * nb + j] = (og[j] >> (bits * p)) & mask;
            }
            for (int64_t k = 0; k < m;) {
                int64_t blk = (g0 + k) / B, end = (blk + 1) * B - g0;
                end = end < m ? end : m;
                bad += dequantize_row(buf + k, end - k, scales[first[t] + blk], qmax, offset,
                                      add, os + g0 + k);
                k = end;
            }
        }
    }
    return bad;
}

/* One whole planar group: byte i of og holds codes i, i + 256, ... of cg at bits 0, bits, ...
 * (the widths spelled out, so each loop vectorizes). */
__attribute__((target_clones("avx2", "default")))
static void pack_group(const uint8_t *cg, int64_t bits, uint8_t *og) {
    if (bits == 4) {
        for (int64_t i = 0; i < 256; i++) og[i] = (uint8_t)(cg[i] | (cg[256 + i] << 4));
    } else if (bits == 2) {
        for (int64_t i = 0; i < 256; i++)
            og[i] = (uint8_t)(cg[i] | (cg[256 + i] << 2) | (cg[512 + i] << 4) |
                              (cg[768 + i] << 6));
    } else {
        for (int64_t i = 0; i < 256; i++) {
            uint32_t byte = 0;
            for (int64_t p = 0; p < 8 / bits; p++) byte |= (uint32_t)cg[p * 256 + i] << (bits * p);
            og[i] = (uint8_t)byte;
        }
    }
}

/* Pack codes of ``bits`` in {1, 2, 4} planar (bitpack.pack_planar) for each of T runs: run t's
 * count[t] codes from codes + src[t] into out + dst[t]; in a group of 256 * per codes (per =
 * 8 / bits) byte i holds codes i, i + 256, ... at bits 0, bits, ...; a last group of m codes
 * holds them in nb = ceil(m / per) bytes the same way, padded with ``pad``. */
int64_t lc_pack_planar(const uint8_t *codes, int64_t T, const int64_t *src, const int64_t *count,
                       const int64_t *dst, int64_t bits, uint8_t pad, uint8_t *out) {
    int64_t per = 8 / bits, group = 256 * per;
    for (int64_t t = 0; t < T; t++) {
        const uint8_t *c = codes + src[t];
        uint8_t *o = out + dst[t];
        int64_t n = count[t], full = n / group;
        for (int64_t g = 0; g < full; g++)
            pack_group(c + g * group, bits, o + g * 256);
        int64_t rest = n - full * group;
        if (rest) {
            int64_t nb = (rest + per - 1) / per;
            const uint8_t *cg = c + full * group;
            uint8_t *og = o + full * 256;
            for (int64_t j = 0; j < nb; j++) {
                uint32_t byte = 0;
                for (int64_t p = 0; p < per; p++) {
                    int64_t at = j + p * nb;
                    byte |= (uint32_t)(at < rest ? cg[at] : pad) << (bits * p);
                }
                og[j] = (uint8_t)byte;
            }
        }
    }
    return 0;
}

/* The inverse of lc_pack_planar: each run's count[t] codes from payload + dst[t] into
 * codes + src[t]. */
int64_t lc_unpack_planar(const uint8_t *payload, int64_t T, const int64_t *src,
                         const int64_t *count, const int64_t *dst, int64_t bits,
                         uint8_t *codes) {
    int64_t per = 8 / bits, group = 256 * per;
    uint32_t mask = (1u << bits) - 1u;
    for (int64_t t = 0; t < T; t++) {
        uint8_t *c = codes + src[t];
        const uint8_t *o = payload + dst[t];
        int64_t n = count[t], full = n / group;
        for (int64_t g = 0; g < full; g++) {
            uint8_t *cg = c + g * group;
            const uint8_t *og = o + g * 256;
            for (int64_t p = 0; p < per; p++)
                for (int64_t i = 0; i < 256; i++) cg[p * 256 + i] = (uint8_t)((og[i] >> (bits * p)) & mask);
        }
        int64_t rest = n - full * group;
        if (rest) {
            int64_t nb = (rest + per - 1) / per;
            uint8_t *cg = c + full * group;
            const uint8_t *og = o + full * 256;
            for (int64_t p = 0; p < per; p++)
                for (int64_t j = 0; j < nb; j++) {
                    int64_t at = j + p * nb;
                    if (at < rest) cg[at] = (uint8_t)((og[j] >> (bits * p)) & mask);
                }
        }
    }
    return 0;
}

/* Streams (bitpack.Streams): S segments, each a row of (first, count, nbytes, at, shift,
 * width): values first..first+count of a vector, their bits shift..shift+width, packed planar
 * in nbytes bytes from payload byte at (plane p of byte j holds value p * nbytes + j). */
int64_t lc_pack_streams(const int64_t *values, int64_t S, const int64_t *rows, uint8_t *out) {
    for (int64_t s = 0; s < S; s++) {
        const int64_t *r = rows + 6 * s;
        int64_t first = r[0], count = r[1], nb = r[2], at = r[3], shift = r[4], w = r[5];
        int64_t per = 8 / w, mask = (1 << w) - 1;
        for (int64_t j = 0; j < nb; j++) {
            uint32_t byte = 0;
            for (int64_t p = 0; p < per; p++) {
                int64_t k = p * nb + j;
                if (k < count) byte |= (uint32_t)((values[first + k] >> shift) & mask) << (w * p);
            }
            out[at + j] = (uint8_t)byte;
        }
    }
    return 0;
}

/* The inverse of lc_pack_streams: each segment's bits ORed into values (zeroed by the caller). */
int64_t lc_unpack_streams(const uint8_t *payload, int64_t S, const int64_t *rows,
                          int64_t *values) {
    for (int64_t s = 0; s < S; s++) {
        const int64_t *r = rows + 6 * s;
        int64_t first = r[0], count = r[1], nb = r[2], at = r[3], shift = r[4], w = r[5];
        int64_t per = 8 / w, mask = (1 << w) - 1;
        for (int64_t p = 0; p < per; p++)
            for (int64_t j = 0; j < nb && p * nb + j < count; j++)
                values[first + p * nb + j] |= (int64_t)((payload[at + j] >> (w * p)) & mask)
                                               << shift;
    }
    return 0;
}

/* Whether a field of ``bits`` in the n bytes at o equals code (every field of those bytes is a
 * code: whole planar groups). Constant shifts and an OR, so the loop vectorizes. */
__attribute__((target_clones("avx2", "default")))
static int fields_hold(const uint8_t *o, int64_t n, int64_t bits, uint8_t code) {
    uint8_t hit = 0;
    if (bits == 8) {
        for (int64_t i = 0; i < n; i++) hit |= o[i] == code;
    } else if (bits == 4) {
        for (int64_t i = 0; i < n; i++) hit |= ((o[i] & 15) == code) | ((o[i] >> 4) == code);
    } else {
        for (int64_t i = 0; i < n; i++) {
            uint8_t b = o[i];
            hit |= ((b & 3) == code) | (((b >> 2) & 3) == code) | (((b >> 4) & 3) == code) |
                   ((b >> 6) == code);
        }
    }
    return hit != 0;
}

/* Whether ``code`` (one outside the format) is among each of T tensors' count[t] codes packed
 * planar at payload + dst[t] (see lc_pack_planar; bits 8: the bytes themselves): a decoder's
 * check of the codes without unpacking them. */
int64_t lc_has_code(const uint8_t *payload, int64_t T, const int64_t *count, const int64_t *dst,
                    int64_t bits, uint8_t code) {
    int64_t per = 8 / bits, group = 256 * per;
    uint32_t mask = (1u << bits) - 1u;
    for (int64_t t = 0; t < T; t++) {
        const uint8_t *o = payload + dst[t];
        int64_t n = count[t], full = n / group, rest = n - full * group;
        if (fields_hold(o, full * 256, bits, code)) return 1;
        if (rest) {  /* the last group: fields past the codes are padding */
            int64_t nb = (rest + per - 1) / per;
            const uint8_t *og = o + full * 256;
            for (int64_t p = 0; p < per; p++)
                for (int64_t j = 0; j < nb && j + p * nb < rest; j++)
                    if (((og[j] >> (bits * p)) & mask) == code) return 1;
        }
    }
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
