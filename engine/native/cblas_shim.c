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
char *scipy_openblas_get_config(void);

void cblas_sgemm(int order, int ta, int tb, blasint m, blasint n, blasint k,
                 float alpha, const float *a, blasint lda, const float *b,
                 blasint ldb, float beta, float *c, blasint ldc)
{
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
