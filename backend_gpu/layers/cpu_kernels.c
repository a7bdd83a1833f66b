/* Few-row float32 products on the CPU (layers/cpu_kernels.py builds and loads this).

   A decode step multiplies a few rows by weights read from memory: a mixture of
   experts' sorted runs (gpt-oss at 16 sequences: about 4 rows an expert). The BLAS
   libraries' kernels for so few rows run below the memory's rate. Here each block of
   NB weight rows is read once, into registers, for every row of the run, with the next
   block prefetched: the product costs about what reading the weight costs. The weights
   are held in blocks (`kvgate_runs`): a block's NB rows interleaved 8 columns at a time,
   so the block is one stream of memory, not NB (18% less time for gpt-oss's experts).

   Vectors are GCC's (8 floats): AVX2 and FMA where -march=native has them, plain SSE
   code elsewhere, the same results either way up to the order of the sums. */
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
    float s = 0.0f;
    for (int i = 0; i < 8; i++) s += v[i];
    return s;
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

/* o[i * ldo + c] = b[c] + x[i] . (weight row c) for i < MB, c < NBV; the NBV rows at w
   in blocks (NBV 1: a plain row). */
#define TILE(NBV, MB)                                                                     \
    static void tile_##NBV##_##MB(const float *x, int64_t k, const float *w, float *o,    \
                                  int64_t ldo, const float *b) {                          \
        v8 a[NBV][MB];                                                                    \
        for (int c = 0; c < NBV; c++)                                                     \
            for (int i = 0; i < MB; i++) a[c][i] = (v8){0};                               \
        const float *next = w + NBV * k; /* the next tile's rows: prefetched meanwhile */ \
        for (int64_t j = 0; j < k; j += 8) {                                              \
            v8 xr[MB];                                                                    \
            for (int i = 0; i < MB; i++) xr[i] = LOAD(x + i * k + j);                     \
            for (int c = 0; c < NBV; c++) {                                               \
                __builtin_prefetch(next + j * NBV + c * 8, 0, 0);                         \
                v8 u = LOAD(w + j * NBV + c * 8);                                         \
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

/* rows r0 <= r < r1 of x times weight rows c0 <= c < c0 + nb (nb <= NB), into out. */
static void block(const float *x, int64_t r0, int64_t r1, const float *w, const float *b,
                  float *out, int64_t n, int64_t k, int64_t c0, int nb) {
    for (int64_t r = r0; r < r1; r += MB_MAX) {
        int two = r1 - r >= 2;
        for (int c = 0; c < nb; c += nb == NB ? NB : 1) {
            const float *wc = w + (c0 + c) * k, *bc = b ? b + c0 + c : 0;
            float *o = out + r * n + c0 + c;
            if (nb == NB)
                (two ? tile_4_2 : tile_4_1)(x + r * k, k, wc, o, n, bc);
            else
                (two ? tile_1_2 : tile_1_1)(x + r * k, k, wc, o, n, bc);
        }
    }
}

/* out[r] = x[r] @ w[e].T + bias[e] for each row r of run e: runs[e] rows each, the runs
   in order in x [rows, k] and out [rows, n]; bias [experts, n] or NULL; k a multiple of 8.
   w: each expert's [n, k] matrix in blocks, the rows of each whole block of NB as
   [k / 8][NB][8], the n % NB rows after the last whole block as they are (cpu_kernels.py,
   `blocked`). The weight blocks are shared among `threads` threads. */
void kvgate_runs(const float *x, const int64_t *runs, int64_t experts, const float *w,
                 const float *bias, float *out, int64_t n, int64_t k, int threads) {
    int64_t *starts = malloc((size_t)(experts + 1) * sizeof *starts);
    if (!starts) return;
    starts[0] = 0;
    for (int64_t e = 0; e < experts; e++) starts[e + 1] = starts[e] + runs[e];
    int64_t blocks = (n + NB - 1) / NB;
#pragma omp parallel for collapse(2) schedule(static) if (threads > 1) num_threads(threads)
    for (int64_t e = 0; e < experts; e++) {
        for (int64_t blk = 0; blk < blocks; blk++) {
            int64_t m = runs[e], c = blk * NB;
            if (!m) continue;
            int nb = n - c < NB ? (int)(n - c) : NB;
            block(x, starts[e], starts[e] + m, w + e * n * k, bias ? bias + e * n : 0, out, n, k,
                  c, nb);
        }
    }
    free(starts);
}
