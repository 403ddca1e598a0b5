#!/bin/sh
# Builds engine/native/quantized_rows.cpp, the CPU decode kernel for quantized weights
# (an MLX extension, engine/quantized_rows.py), against the installed MLX and nanobind
# into <venv>/lib/mtplxd/. Linux only: on macOS MLX's Metal kernels serve quantized
# weights. Without a C++ compiler or CMake the engine unpacks quantized weights to
# float32 as before, and `make install` tries again next time.
set -eu
python=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")  # absolute: CMake runs elsewhere
[ "$(uname -s)" = Linux ] || exit 0
for tool in c++ cmake; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "warning: no $tool: quantized models are unpacked to float32 on the CPU (slower); install it and rerun 'make install'" >&2
        exit 0
    fi
done
prefix=$("$python" -c 'import sys; print(sys.prefix)')
build="$prefix/build/native"
rm -f "$prefix/lib/mtplxd"/_mtplxd_quantized_rows*.so  # a failed build must not leave an old one
mkdir -p "$build"
cmake -S engine/native -B "$build" -DPython_EXECUTABLE="$python" -DCMAKE_BUILD_TYPE=Release >"$build.log" 2>&1 \
    && cmake --build "$build" -j 2 >>"$build.log" 2>&1 \
    || { echo "warning: building the quantized decode kernel failed (see $build.log); quantized models are unpacked to float32" >&2; exit 0; }
mkdir -p "$prefix/lib/mtplxd"
cp "$build"/_mtplxd_quantized_rows*.so "$prefix/lib/mtplxd/"
echo "built the quantized decode kernel into $prefix/lib/mtplxd"
