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
 * Where the CPU has AVX-512, few_rows_nt512 takes four rows of W at a time:
 * more reads in flight, and twice the multiply width for a window's extra rows.
 * A 4-token window of a 369M-parameter trunk went from 163 ms (the AVX2 kernel)
 * to 125 ms, about one token's 121 ms (python -m engine.bench_rows).
 *
 * Matrices under GEMV_MIN elements, prefill chunks and other layouts: sgemm. */
#define FEW_ROWS 8
#define GEMV_MIN (8 * 1024) /* elements of W: smaller matmuls cost next to nothing */
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 8 /* how far ahead few_rows_nt prefetches W */
#endif

/* mtplxd_few_rows: 0 turns the kernels off, 2 keeps the AVX2 one where AVX-512 is there
 * (tests and side-by-side measurements), 1 (the default) takes the widest. */
static int few_rows_enabled = 1;

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

/* AVX-512: four rows of W at a time, dotted with 1 to 4 rows of x (16
 * accumulators of 16 floats), the tail of each row by a masked load. Four
 * rows of W in flight instead of two keep more of the memory pipeline busy,
 * and the 512-bit FMAs give the verify window's extra rows room to hide under
 * the reads: see "Fast CPU matmuls on Linux" in docs/engine.md for what it did. */
__attribute__((target("avx512f"))) static inline __m256 fold16(__m512 v)
{
    return _mm256_add_ps(_mm512_castps512_ps256(v),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

/* The four sums of a, b, c, d, in that order. */
__attribute__((target("avx512f"))) static inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d)
{
    __m256 ab = _mm256_hadd_ps(fold16(a), fold16(b)), cd = _mm256_hadd_ps(fold16(c), fold16(d));
    __m256 s = _mm256_hadd_ps(ab, cd);
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

/* out[r * 4 + i] = x[r] . w[i] for ROWS rows of x and the 4 rows w[0..3] of W;
 * ahead (or NULL): 4 rows of W further on (ldb apart), prefetched a line per step. */
#define DEFINE_DOTS4W(ROWS)                                                                  \
    __attribute__((target("avx512f"))) static void dots4w_##ROWS(                          \
        const float *x, blasint lda, const float *const w[4], blasint k, float *out,        \
        const float *ahead, blasint ldb)                                                    \
    {                                                                                       \
        __m512 acc[ROWS][4];                                                                \
        _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; r++)                              \
            _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) acc[r][i] = _mm512_setzero_ps(); \
        for (blasint j = 0; j < k; j += 16) {                                               \
            __mmask16 live = k - j >= 16 ? 0xFFFF : (__mmask16)((1u << (k - j)) - 1);       \
            if (ahead)                                                                      \
                _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++)                         \
                    _mm_prefetch((const char *)(ahead + (long)i * ldb + j), _MM_HINT_T0);   \
            __m512 v[4];                                                                    \
            _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++)                             \
                v[i] = _mm512_maskz_loadu_ps(live, w[i] + j);                               \
            _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; r++) {                        \
                __m512 xr = _mm512_maskz_loadu_ps(live, x + (long)r * lda + j);             \
                _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++)                         \
                    acc[r][i] = _mm512_fmadd_ps(xr, v[i], acc[r][i]);                       \
            }                                                                               \
        }                                                                                   \
        for (int r = 0; r < ROWS; r++)                                                      \
            _mm_storeu_ps(out + r * 4, sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));   \
    }
DEFINE_DOTS4W(1)
DEFINE_DOTS4W(2)
DEFINE_DOTS4W(3)
DEFINE_DOTS4W(4)

static void dots4w(blasint rows, const float *x, blasint lda, const float *const w[4], blasint k,
                   float *out, const float *ahead, blasint ldb)
{
    switch (rows) {
    case 1: dots4w_1(x, lda, w, k, out, ahead, ldb); break;
    case 2: dots4w_2(x, lda, w, k, out, ahead, ldb); break;
    case 3: dots4w_3(x, lda, w, k, out, ahead, ldb); break;
    default: dots4w_4(x, lda, w, k, out, ahead, ldb); break;
    }
}

static void few_rows_nt512(blasint m, blasint n, blasint k, float alpha, const float *a, blasint lda,
                           const float *b, blasint ldb, float beta, float *c, blasint ldc)
{
    float d[16];
    for (blasint j = 0; j < n; j += 4) {
        const float *w[4];
        for (int i = 0; i < 4; i++) /* past the end of W: its last row again, not stored */
            w[i] = b + (long)(j + i < n ? j + i : n - 1) * ldb;
        const float *ahead = j + PREFETCH_ROWS + 4 <= n ? w[0] + (long)PREFETCH_ROWS * ldb : 0;
        for (blasint r0 = 0; r0 < m; r0 += 4) {
            blasint rows = m - r0 < 4 ? m - r0 : 4;
            dots4w(rows, a + (long)r0 * lda, lda, w, k, d, r0 == 0 ? ahead : 0, ldb);
            for (blasint r = 0; r < rows; r++) {
                float *out = c + (long)(r0 + r) * ldc + j;
                for (blasint i = 0; i < 4 && j + i < n; i++)
                    out[i] = alpha * d[r * 4 + i] + (beta == 0.0f ? 0.0f : beta * out[i]);
            }
        }
    }
}

/* 2: AVX-512, 1: AVX2 + FMA, 0: neither (few_rows_nt declines). */
static int kernel_level(void)
{
    static int level = -1;
    if (level < 0) {
        int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
        level = avx2 ? (__builtin_cpu_supports("avx512f") ? 2 : 1) : 0;
    }
    return level;
}

static int few_rows_nt(blasint m, blasint n, blasint k, float alpha, const float *a,
                       blasint lda, const float *b, blasint ldb, float beta, float *c, blasint ldc)
{
    int level = kernel_level();
    if (level == 0 || !few_rows_enabled)
        return 0;
    if (level == 2 && few_rows_enabled == 1) {
        few_rows_nt512(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        return 1;
    }
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
static int kernel_level(void) { return 0; }

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

/* Lets `mtplxd doctor` name the few-row kernel decode steps get. */
const char *mtplxd_few_rows_kernel(void)
{
    static const char *names[] = {"none (sgemv/sgemm)", "AVX2", "AVX-512"};
    return names[kernel_level()];
}

/* Lets `mtplxd doctor` name the library that serves MLX. */
const char *mtplxd_blas_config(void)
{
    return scipy_openblas_get_config();
}
