/* The engine's CPU kernels (layers/cpu_kernels.py builds and loads this): few-row
   float32 products (kvgate_runs, kvgate_runs_mxfp4) and a decode group's attention
   (kvgate_decode_attention).

   A decode step multiplies a few rows by weights read from memory: a mixture of
   experts' sorted runs (gpt-oss at 16 sequences: about 4 rows an expert), a verify's
   k + 1 rows. The BLAS libraries' kernels for so few rows run below the memory's rate.
   Here each block of NB weight rows is read once, into registers, for every row of the
   run, with the next block prefetched: the product costs about what reading the weight
   costs. Experts' weights are held in blocks (`kvgate_runs`): a block's NB rows
   interleaved 8 columns at a time, so the block is one stream of memory, not NB (18%
   less time for gpt-oss's experts).

   Vectors are GCC's (8 floats): AVX2 and FMA where -march=native has them, plain SSE
   code elsewhere, the same results either way up to the order of the sums. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef __AVX__
#include <immintrin.h>
#endif

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4))); /* any float's address */
#define LOAD(p) (*(const v8u *)(p))
#define NB 4     /* weight rows a tile reads at once */
#define MB_MAX 2 /* input rows a tile holds: NB * MB_MAX sums, the rows and the weights
                    fit the 16 vector registers of AVX2 */

static inline float hsum(v8 v) {
#ifdef __AVX__
    __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#else
    float s = 0.0f;
    for (int i = 0; i < 8; i++) s += v[i];
    return s;
#endif
}

/* o[c] = b[c] + the sum of a[c]'s lanes, c < 4: one shuffle tree for the four */
static inline void store4(float *o, const v8 *a, const float *b) {
#ifdef __AVX__
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps((__m256)a[0], (__m256)a[1]),
                              _mm256_hadd_ps((__m256)a[2], (__m256)a[3]));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    _mm_storeu_ps(o, b ? _mm_add_ps(s, _mm_loadu_ps(b)) : s);
#else
    for (int c = 0; c < 4; c++) o[c] = (b ? b[c] : 0.0f) + hsum(a[c]);
#endif
}

/* o[i * ldo + c] = b[c] + x[i] . (weight row c) for i < MB, c < NBV: row c's values j to
   j + 7 at w + j * js + c * cs (a block: js NB, cs 8; plain rows: js 1, cs k). `next`:
   the weights read after these, prefetched meanwhile (NULL: none). */
#define TILE(NBV, MB)                                                                     \
    static void tile_##NBV##_##MB(const float *x, int64_t k, const float *w, float *o,    \
                                  int64_t ldo, const float *b, const float *next,         \
                                  int64_t js, int64_t cs) {                               \
        v8 a[NBV][MB];                                                                    \
        for (int c = 0; c < NBV; c++)                                                     \
            for (int i = 0; i < MB; i++) a[c][i] = (v8){0};                               \
        for (int64_t j = 0; j < k; j += 8) {                                              \
            v8 xr[MB];                                                                    \
            for (int i = 0; i < MB; i++) xr[i] = LOAD(x + i * k + j);                     \
            for (int c = 0; c < NBV; c++) {                                               \
                if (next) __builtin_prefetch(next + j * js + c * cs, 0, 0);               \
                v8 u = LOAD(w + j * js + c * cs);                                         \
                for (int i = 0; i < MB; i++) a[c][i] += u * xr[i];                        \
            }                                                                             \
        }                                                                                 \
        for (int i = 0; i < MB; i++) {                                                    \
            if (NBV == 4) {                                                               \
                v8 col[4] = {a[0][i], a[1 % NBV][i], a[2 % NBV][i], a[3 % NBV][i]};     \
                store4(o + i * ldo, col, b);                                              \
            } else                                                                        \
                for (int c = 0; c < NBV; c++) o[i * ldo + c] = (b ? b[c] : 0.0f) + hsum(a[c][i]); \
        }                                                                                 \
    }
TILE(4, 1)
TILE(4, 2)
TILE(1, 1)
TILE(1, 2)

/* rows r0 <= r < r1 of x times the nb (<= NB) weight rows at w (a block if `blocked`
   and nb is NB, else plain rows), their biases b (or NULL), into columns o[r * n];
   `next` as the tiles'. */
static void block(const float *x, int64_t r0, int64_t r1, const float *w, const float *b,
                  float *o, int64_t n, int64_t k, int nb, const float *next, int blocked) {
    for (int64_t r = r0; r < r1; r += MB_MAX) {
        int two = r1 - r >= 2;
        for (int c = 0; c < nb; c += nb == NB ? NB : 1) {
            const float *bc = b ? b + c : 0, *wc = w + c * k;
            float *oc = o + r * n + c;
            if (nb == NB)
                (two ? tile_4_2 : tile_4_1)(x + r * k, k, wc, oc, n, bc, next, blocked ? NB : 1,
                                            blocked ? 8 : k);
            else
                (two ? tile_1_2 : tile_1_1)(x + r * k, k, wc, oc, n, bc, next ? wc + k : 0, 1, k);
        }
    }
}

/* starts[e] = the first row of run e (runs[e] rows each, in order), starts[experts] all */
static void run_starts(const int64_t *runs, int64_t experts, int64_t *starts) {
    starts[0] = 0;
    for (int64_t e = 0; e < experts; e++) starts[e + 1] = starts[e] + runs[e];
}

/* out[r] = x[r] @ w[e].T + bias[e] for each row r of run e: runs[e] rows each, the runs
   in order in x [rows, k] and out [rows, n]; bias [experts, n] or NULL; k a multiple of 8.
   w: each expert's [n, k] matrix in blocks, the rows of each whole block of NB as
   [k / 8][NB][8], the n % NB rows after the last whole block as they are (cpu_kernels.py,
   `blocked`), or plain rows where `blocked` is 0. The weight blocks are shared among
   `threads` threads. */
void kvgate_runs(const float *x, const int64_t *runs, int64_t experts, const float *w,
                 const float *bias, float *out, int64_t n, int64_t k, int threads, int blocked) {
    int64_t starts[experts + 1]; /* run e's first row: a few hundred experts at most */
    run_starts(runs, experts, starts);
    int64_t blocks = (n + NB - 1) / NB;
#pragma omp parallel for collapse(2) schedule(static) if (threads > 1) num_threads(threads)
    for (int64_t e = 0; e < experts; e++) {
        for (int64_t blk = 0; blk < blocks; blk++) {
            int64_t m = runs[e], c = blk * NB;
            if (!m) continue;
            int nb = n - c < NB ? (int)(n - c) : NB;
            const float *wc = w + (e * n + c) * k;
            block(x, starts[e], starts[e] + m, wc, bias ? bias + e * n + c : 0, out + c, n, k, nb,
                  wc + nb * k, blocked);
        }
    }
}

/* MXFP4 (quantization/mxfp4.py): 32 E2M1 codes two a byte, low nibble first, under an
   E8M0 scale byte (2 ** (byte - 127)): a code times its power of two, exact in float32. */

static inline void decode_group(const uint8_t *bytes, uint8_t scale, float *out) {
    /* 2 ** (scale - 127) built from its bits: byte 0 is the subnormal 2 ** -127, 255
       the infinity torch's 2 ** 128 is (mxfp4.py's table) */
    union {
        uint32_t bits;
        float value;
    } p = {scale ? (uint32_t)scale << 23 : 1u << 22};
    float power = p.value;
#ifdef __AVX2__
    const __m256 magnitude = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
    const __m256i shifts = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4);
    __m128i all = _mm_loadu_si128((const __m128i *)bytes);
    for (int q = 0; q < 4; q++) { /* bytes 4q..4q+3: codes 8q..8q+7 */
        __m128i pick = _mm_setr_epi8(4 * q, 4 * q, 4 * q + 1, 4 * q + 1, 4 * q + 2, 4 * q + 2,
                                     4 * q + 3, 4 * q + 3, 0, 0, 0, 0, 0, 0, 0, 0);
        __m256i code = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(_mm_shuffle_epi8(all, pick)), shifts);
        code = _mm256_and_si256(code, _mm256_set1_epi32(15));
        __m256 value = _mm256_permutevar8x32_ps(magnitude, code); /* the low 3 bits */
        __m256i sign = _mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(8)), 28);
        value = _mm256_xor_ps(value, _mm256_castsi256_ps(sign));
        _mm256_storeu_ps(out + 8 * q, _mm256_mul_ps(value, _mm256_set1_ps(power)));
    }
#else
    static const float E2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                   -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
    for (int i = 0; i < 16; i++) {
        out[2 * i] = E2M1[bytes[i] & 15] * power;
        out[2 * i + 1] = E2M1[bytes[i] >> 4] * power;
    }
#endif
}

/* nb weight rows from row c0 of an MXFP4 matrix (blocks [n][k / 32][16], scales
   [n][k / 32]) into buf as kvgate_runs holds float32 ones: a whole block as
   [k / 8][NB][8], fewer rows plain. */
static void decode_rows(const uint8_t *blocks, const uint8_t *scales, int64_t k, int64_t c0,
                        int nb, float *buf) {
    int64_t groups = k / 32;
    float group[32];
    for (int c = 0; c < nb; c++) {
        for (int64_t g = 0; g < groups; g++) {
            decode_group(blocks + ((c0 + c) * groups + g) * 16, scales[(c0 + c) * groups + g], group);
            for (int q = 0; q < 4; q++) {
                int64_t j = g * 32 + q * 8;
                v8 *to = (v8 *)(nb == NB ? buf + j * NB + c * 8 : buf + c * k + j);
                *to = LOAD(group + q * 8);
            }
        }
    }
}

/* kvgate_runs over MXFP4 experts (blocks [experts][n][k / 32][16], scales
   [experts][n][k / 32]; k a multiple of 32): each block of weight rows decoded once
   into a buffer of the thread's, then multiplied by every row of the run as a float32
   block is. A quarter of float32's bytes read, and no matrix widened whole. Returns 0,
   or -1 where a buffer could not be had (the output then incomplete). */
int kvgate_runs_mxfp4(const float *x, const int64_t *runs, int64_t experts,
                      const uint8_t *blocks, const uint8_t *scales, const float *bias, float *out,
                      int64_t n, int64_t k, int threads) {
    int64_t starts[experts + 1], failed = 0;
    run_starts(runs, experts, starts);
    int64_t count = (n + NB - 1) / NB, groups = k / 32;
#pragma omp parallel if (threads > 1) num_threads(threads) reduction(+ : failed)
    {
        float *buf = aligned_alloc(32, (size_t)(NB * k) * sizeof *buf);
        if (!buf) failed++;
#pragma omp for collapse(2) schedule(static)
        for (int64_t e = 0; e < experts; e++) {
            for (int64_t blk = 0; blk < count; blk++) {
                int64_t m = runs[e], c = blk * NB;
                if (!m || !buf) continue;
                int nb = n - c < NB ? (int)(n - c) : NB;
                const uint8_t *eb = blocks + e * n * groups * 16, *es = scales + e * n * groups;
                for (int64_t line = 0; line < nb * groups * 16; line += 64) /* the next rows */
                    __builtin_prefetch(eb + (c + nb) * groups * 16 + line, 0, 0);
                decode_rows(eb, es, k, c, nb, buf);
                block(x, starts[e], starts[e] + m, buf, bias ? bias + e * n + c : 0, out + c, n, k,
                      nb, 0, 1);
            }
        }
        free(buf);
    }
    return failed ? -1 : 0;
}

/* Attention of one query per sequence (a decode group, layers/attention.py) over the
   paged caches, read where they lie: sequence b's query q[rows[b]] ([heads, d]) over its
   first lens[b] keys (the last `window` of them; window 0: all), key t in slot
   tables[b * blocks_per_row + t / block_size] * block_size + t % block_size of k and v
   ([slots, kv_heads, d]); query head h reads KV head h / (heads / kv_heads); `sinks`
   (or NULL): a logit per head in the softmax's denominator that attends to nothing.
   Scores q . k * scale in float32, the output times v_scale into out[rows[b]]. The
   torch path gathers the blocks, pads the group and makes some twenty calls a layer;
   this reads each key once a query head. Returns 0, or -1 where a buffer could not be
   had (the output then incomplete: the caller computes it otherwise). d is a multiple
   of 8, at most 512. */
static inline int64_t slot_of(const int64_t *table, int64_t t, int64_t block_size) {
    return table[t / block_size] * block_size + t % block_size;
}

int kvgate_decode_attention(const float *q, const int64_t *rows, int64_t batch, const float *k,
                            const float *v, const int64_t *tables, int64_t blocks_per_row,
                            const int64_t *lens, int64_t block_size, int64_t heads,
                            int64_t kv_heads, int64_t d, int64_t window, const float *sinks,
                            float scale, float v_scale, float *out, int threads) {
    int64_t longest = 0, failed = 0;
    for (int64_t b = 0; b < batch; b++) longest = lens[b] > longest ? lens[b] : longest;
    int64_t group = heads / kv_heads;
#pragma omp parallel if (threads > 1) num_threads(threads) reduction(+ : failed)
    {
        float *s = malloc((size_t)(longest > 0 ? longest : 1) * sizeof *s);
        if (!s) failed++;
#pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < batch; b++) {
            for (int64_t h = 0; h < heads; h++) {
                if (!s) continue;
                int64_t len = lens[b], first = window > 0 && len > window ? len - window : 0;
                const float *qh = q + (rows[b] * heads + h) * d;
                const int64_t *table = tables + b * blocks_per_row;
                int64_t kv = h / group;
                float top = sinks ? sinks[h] : -INFINITY;
                for (int64_t t = first; t < len;) { /* block by block: no division a key */
                    int64_t end = (t / block_size + 1) * block_size;
                    const float *kt = k + (slot_of(table, t, block_size) * kv_heads + kv) * d;
                    for (; t < len && t < end; t++, kt += kv_heads * d) {
                        v8 dot = {0};
                        for (int64_t j = 0; j < d; j += 8) dot += LOAD(qh + j) * LOAD(kt + j);
                        float score = hsum(dot) * scale;
                        s[t - first] = score;
                        top = score > top ? score : top;
                    }
                }
                float total = sinks ? expf(sinks[h] - top) : 0.0f;
                v8 acc[64] = {{0}};
                for (int64_t t = first; t < len; t++) {
                    s[t - first] = expf(s[t - first] - top);
                    total += s[t - first];
                }
                for (int64_t t = first; t < len;) {
                    int64_t end = (t / block_size + 1) * block_size;
                    const float *vt = v + (slot_of(table, t, block_size) * kv_heads + kv) * d;
                    for (; t < len && t < end; t++, vt += kv_heads * d) {
                        float p = s[t - first];
                        v8 pv = {p, p, p, p, p, p, p, p};
                        for (int64_t j = 0; j < d; j += 8) acc[j / 8] += pv * LOAD(vt + j);
                    }
                }
                float norm = total > 0.0f ? v_scale / total : 0.0f;
                float *o = out + (rows[b] * heads + h) * d;
                for (int64_t j = 0; j < d; j += 8)
                    for (int i = 0; i < 8; i++) o[j + i] = acc[j / 8][i] * norm;
            }
        }
        free(s);
    }
    return failed ? -1 : 0;
}
