#!/bin/sh
# Builds engine/native/cblas_shim.c against the scipy-openblas32 wheel into
# <venv>/lib/mtplxd/libmtplxd_cblas.so, where engine/blas.py looks for it.
# Linux only; on macOS MLX uses Accelerate and Metal and needs nothing.
set -eu
python="$1"
[ "$(uname -s)" = Linux ] || exit 0
if ! command -v cc >/dev/null 2>&1; then
    echo "warning: no C compiler (cc): MLX keeps the slow reference BLAS; install gcc and rerun 'make install'" >&2
    exit 0
fi
libdir=$("$python" -c 'import scipy_openblas32 as s; print(s.get_lib_dir())')
prefix=$("$python" -c 'import sys; print(sys.prefix)')
mkdir -p "$prefix/lib/mtplxd"
cc -O2 -shared -fPIC engine/native/cblas_shim.c -o "$prefix/lib/mtplxd/libmtplxd_cblas.so" \
   -L"$libdir" -lscipy_openblas -Wl,-rpath,"$libdir"
echo "built $prefix/lib/mtplxd/libmtplxd_cblas.so (OpenBLAS for MLX)"
