/*
 * Routes the CBLAS GEMM calls of the mlx-cpu wheel to OpenBLAS.
 *
 * The Linux mlx-cpu wheel links the reference BLAS, whose sgemm is 30-60x
 * slower than OpenBLAS. The scipy-openblas32 wheel ships a current OpenBLAS,
 * but with every symbol prefixed by "scipy_", so it cannot stand in for
 * libblas directly. This library exports the unprefixed names MLX's hot paths
 * use and forwards them. engine/blas.py loads it with RTLD_GLOBAL before MLX,
 * so the dynamic linker binds MLX's cblas_* references here.
 */
typedef int blasint;

void scipy_cblas_sgemm(int, int, int, blasint, blasint, blasint, float,
                       const float *, blasint, const float *, blasint, float,
                       float *, blasint);
void scipy_cblas_dgemm(int, int, int, blasint, blasint, blasint, double,
                       const double *, blasint, const double *, blasint,
                       double, double *, blasint);
void scipy_cblas_cgemm(int, int, int, blasint, blasint, blasint, const void *,
                       const void *, blasint, const void *, blasint,
                       const void *, void *, blasint);
void scipy_cblas_sgemv(int, int, blasint, blasint, float, const float *, blasint,
                       const float *, blasint, float, float *, blasint);
char *scipy_openblas_get_config(void);

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

/* Decode steps multiply 1 to a few rows (a token, or a verify window of K+1)
 * by each weight matrix, which MLX stores as W [n, k] and multiplies as
 * x @ W^T. OpenBLAS's sgemm packs all of W on every call, so for a few rows it
 * costs several times one pass over W: [4, 2048] x [2048, 5632] took 9.8 ms
 * against 2.4 ms for one row through sgemv. A verify window should cost about
 * one row, so 1..FEW_ROWS rows of x @ W^T go to few_rows_nt, which streams W
 * once, each pair of its rows dotted with every row of x (AVX2 + FMA, checked
 * at run time; elsewhere one row goes to sgemv and more to sgemm).
 *
 * Between two matmuls of a decode step MLX runs dozens of small ops, so W is
 * rarely still in the near caches: every matmul reads it from far away, and a
 * kernel that waits for each line stalls once per line. few_rows_nt prefetches
 * the rows PREFETCH_ROWS ahead while it computes. Inside the embedded model's
 * decode steps (all its matmuls, summed per step) this took the BLAS time of a
 * one-token step from 3.0 ms (sgemv) to 1.3 ms, and of a 4-token verify window
 * from 5.6 ms (the same kernel without prefetching) to 2.3 ms.
 *
 * Matrices under GEMV_MIN elements, prefill chunks and other layouts: sgemm. */
#define FEW_ROWS 8
#define GEMV_MIN (8 * 1024) /* elements of W: smaller matmuls cost next to nothing */
#define PREFETCH_ROWS 8     /* how far ahead few_rows_nt prefetches W */

static int few_rows_enabled = 1; /* mtplxd_few_rows(0) turns the kernel off (tests) */

void mtplxd_few_rows(int enabled) { few_rows_enabled = enabled; }

#if defined(__x86_64__)
#include <immintrin.h>

__attribute__((target("avx2,fma"))) static inline float sum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Dot products of rows x[0..ROWS) (1 to 4 rows, lda apart) with two rows w0, w1
 * of W: 2 x ROWS independent accumulators, each load of x shared by both rows
 * of W and each load of W by every row of x. p0, p1 (or NULL): rows of W further
 * on, prefetched a cache line per 16 floats (see few_rows_nt). */
#define DEFINE_DOTS(ROWS)                                                                  \
    __attribute__((target("avx2,fma"))) static void dots##ROWS(                          \
        const float *x, blasint lda, const float *w0, const float *w1, blasint k,         \
        float *out0, float *out1, const float *p0, const float *p1)                       \
    {                                                                                      \
        __m256 a0[ROWS], a1[ROWS];                                                         \
        _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; r++)                             \
            a0[r] = a1[r] = _mm256_setzero_ps();                                           \
        blasint i = 0;                                                                     \
        for (; i + 8 <= k; i += 8) {                                                       \
            if (p0 && (i & 15) == 0) {                                                     \
                _mm_prefetch((const char *)(p0 + i), _MM_HINT_T0);                         \
                _mm_prefetch((const char *)(p1 + i), _MM_HINT_T0);                         \
            }                                                                              \
            __m256 v0 = _mm256_loadu_ps(w0 + i), v1 = _mm256_loadu_ps(w1 + i);            \
            _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; r++) {                       \
                __m256 xr = _mm256_loadu_ps(x + r * lda + i);                              \
                a0[r] = _mm256_fmadd_ps(xr, v0, a0[r]);                                    \
                a1[r] = _mm256_fmadd_ps(xr, v1, a1[r]);                                    \
            }                                                                              \
        }                                                                                  \
        for (int r = 0; r < ROWS; r++) {                                                   \
            float s0 = sum8(a0[r]), s1 = sum8(a1[r]);                                      \
            for (blasint j = i; j < k; j++) {                                              \
                s0 += x[r * lda + j] * w0[j];                                              \
                s1 += x[r * lda + j] * w1[j];                                              \
            }                                                                              \
            out0[r] = s0;                                                                  \
            out1[r] = s1;                                                                  \
        }                                                                                  \
    }
DEFINE_DOTS(1)
DEFINE_DOTS(2)
DEFINE_DOTS(3)
DEFINE_DOTS(4)

static void dots(blasint rows, const float *x, blasint lda, const float *w0, const float *w1,
                 blasint k, float *out0, float *out1, const float *p0, const float *p1)
{
    switch (rows) {
    case 1: dots1(x, lda, w0, w1, k, out0, out1, p0, p1); break;
    case 2: dots2(x, lda, w0, w1, k, out0, out1, p0, p1); break;
    case 3: dots3(x, lda, w0, w1, k, out0, out1, p0, p1); break;
    default: dots4(x, lda, w0, w1, k, out0, out1, p0, p1); break;
    }
}

static int few_rows_nt(blasint m, blasint n, blasint k, float alpha, const float *a,
                       blasint lda, const float *b, blasint ldb, float beta, float *c, blasint ldc)
{
    static int usable = -1;
    if (usable < 0)
        usable = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (!usable || !few_rows_enabled)
        return 0;
    float d0[4], d1[4];
    for (blasint j = 0; j < n; j += 2) {
        const float *w0 = b + (long)j * ldb;
        const float *w1 = j + 1 < n ? w0 + ldb : w0; /* odd n: the last row twice */
        const float *ahead = j + PREFETCH_ROWS + 1 < n ? w0 + (long)PREFETCH_ROWS * ldb : 0;
        for (blasint r0 = 0; r0 < m; r0 += 4) {
            blasint rows = m - r0 < 4 ? m - r0 : 4;
            const float *p0 = r0 == 0 ? ahead : 0; /* rows 4.. read W while it is still near */
            dots(rows, a + (long)r0 * lda, lda, w0, w1, k, d0, d1, p0, p0 ? p0 + ldb : 0);
            for (blasint r = 0; r < rows; r++) {
                float *out = c + (long)(r0 + r) * ldc + j;
                out[0] = alpha * d0[r] + (beta == 0.0f ? 0.0f : beta * out[0]);
                if (j + 1 < n)
                    out[1] = alpha * d1[r] + (beta == 0.0f ? 0.0f : beta * out[1]);
            }
        }
    }
    return 1;
}
#else
static int few_rows_nt(blasint m, blasint n, blasint k, float alpha, const float *a,
                       blasint lda, const float *b, blasint ldb, float beta, float *c, blasint ldc)
{
    return 0;
}
#endif

static int few_rows_sgemm(int order, int ta, int tb, blasint m, blasint n, blasint k,
                          float alpha, const float *a, blasint lda, const float *b,
                          blasint ldb, float beta, float *c, blasint ldc)
{
    if (order != ROW_MAJOR || m < 1 || m > FEW_ROWS || n < 1 || k < 1 || (long)n * k < GEMV_MIN)
        return 0;
    if (ta == NO_TRANS && tb == TRANS && few_rows_nt(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc))
        return 1;
    if (m == 1) {
        blasint inc = ta == NO_TRANS ? 1 : lda; /* A's one row: strided when transposed */
        if (tb == TRANS) /* B is n x k: c = B a */
            scipy_cblas_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, inc, beta, c, 1);
        else /* B is k x n: c = B^T a */
            scipy_cblas_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a, inc, beta, c, 1);
        return 1;
    }
    return 0;
}

void cblas_sgemm(int order, int ta, int tb, blasint m, blasint n, blasint k,
                 float alpha, const float *a, blasint lda, const float *b,
                 blasint ldb, float beta, float *c, blasint ldc)
{
    if (few_rows_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc))
        return;
    scipy_cblas_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_dgemm(int order, int ta, int tb, blasint m, blasint n, blasint k,
                 double alpha, const double *a, blasint lda, const double *b,
                 blasint ldb, double beta, double *c, blasint ldc)
{
    scipy_cblas_dgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_cgemm(int order, int ta, int tb, blasint m, blasint n, blasint k,
                 const void *alpha, const void *a, blasint lda, const void *b,
                 blasint ldb, const void *beta, void *c, blasint ldc)
{
    scipy_cblas_cgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

/* Lets `mtplxd doctor` name the library that serves MLX. */
const char *mtplxd_blas_config(void)
{
    return scipy_openblas_get_config();
}
