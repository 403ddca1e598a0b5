"""Make an optimised BLAS serve MLX's CPU matmuls on Linux.

The mlx-cpu wheel links the reference BLAS (a few GFLOP/s). `make install`
builds a small forwarding library (engine/native/cblas_shim.c) against the
OpenBLAS of the scipy-openblas32 wheel; loading it with RTLD_GLOBAL before
`mlx.core` makes the dynamic linker bind MLX's `cblas_sgemm` to OpenBLAS.
A system OpenBLAS (libopenblas.so.0) is the fallback.

This module must not import mlx: it runs before MLX is loaded.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

SHIM_PATH = Path(sys.prefix) / "lib" / "mtplxd" / "libmtplxd_cblas.so"


@dataclass(frozen=True)
class BlasInfo:
    library: str  # "openblas (scipy-openblas32 via mtplxd shim)", "accelerate", ...
    path: str | None
    detail: str = ""


_loaded: BlasInfo | None = None


def ensure_fast_blas() -> BlasInfo:
    """Load the fastest available BLAS into the global symbol scope, once."""
    global _loaded
    if _loaded is None:
        _loaded = _load()
    return _loaded


# OpenBLAS's idle threads spin for 2^28 cycles (~0.1 s) after each threaded call
# before they sleep. After a prefill chunk that spinning thread takes a core from
# MLX's worker and the Python thread that builds the next step: on the 2-core
# development machine it cost decode a fifth of its speed (AR 221 -> 282 tok/s
# at temperature 0 with 2^4, the least OpenBLAS allows) while prefill kept its
# speed (1,047 / 1,009 tok/s). OpenBLAS reads the variable when it loads.
IDLE_SPIN = "4"


def _load() -> BlasInfo:
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", IDLE_SPIN)
    if sys.platform == "darwin":
        return BlasInfo("accelerate", None, "macOS: MLX uses Accelerate and Metal")
    if not sys.platform.startswith("linux"):
        return BlasInfo("unknown", None, f"platform {sys.platform}")
    if "mlx.core" in sys.modules:
        # Too late to bind MLX's matmuls: a script that did this runs several times
        # slower (a SmolLM2 prompt of 100 tokens: 6.5 s against ~0.2 s) and silently.
        warnings.warn("mlx was imported before engine: MLX's CPU matmuls use its reference BLAS, several "
                      "times slower; import engine first", RuntimeWarning)
        return BlasInfo("reference", None, "mlx was imported before engine.blas")
    if SHIM_PATH.exists():
        lib = ctypes.CDLL(str(SHIM_PATH), mode=ctypes.RTLD_GLOBAL)
        lib.mtplxd_blas_config.restype = ctypes.c_char_p
        config = lib.mtplxd_blas_config().decode()
        detail = f"scipy-openblas32 via shim: {config}"
        kernel = getattr(lib, "mtplxd_few_rows_kernel", None)  # a shim built before it has none
        if kernel is not None:
            kernel.restype = ctypes.c_char_p
            detail += f"; few-row decode kernel: {kernel().decode()}"
        return BlasInfo("openblas", str(SHIM_PATH), detail)
    system = ctypes.util.find_library("openblas")
    if system:
        ctypes.CDLL(system, mode=ctypes.RTLD_GLOBAL)
        return BlasInfo("openblas", system, "system OpenBLAS")
    return BlasInfo(
        "reference",
        None,
        "no OpenBLAS found: run `make install` (needs a C compiler) for fast CPU matmuls",
    )


# -- thread count ------------------------------------------------------------------

# Decode steps multiply a handful of rows (1 token, or K+1 in a verify) by each
# weight matrix. OpenBLAS splits such a call over its threads, and waking a second
# thread costs more than the multiply whenever the other core is busy (the
# daemon's own HTTP thread, an editor, a build): on the 2-core development machine
# a [4, 256] x [256, 640] matmul took 98 us on one thread and 3,984 us on two, and
# an MTP cycle of the embedded model 34-40 ms against 75-77 ms. Prefill chunks
# (hundreds of rows) keep every thread.
DECODE_THREADS = 1


@lru_cache(maxsize=1)
def _thread_functions() -> tuple | None:
    try:
        lib = ctypes.CDLL(None)
    except OSError:
        return None
    for prefix in ("scipy_openblas", "openblas"):
        setter = getattr(lib, f"{prefix}_set_num_threads", None)
        getter = getattr(lib, f"{prefix}_get_num_threads", None)
        if setter is not None and getter is not None:
            return setter, getter
    return None


def set_threads(n: int | None) -> int | None:
    """Set OpenBLAS's thread count where OpenBLAS serves MLX; returns the old count
    (None where there is none to set, e.g. macOS, where Accelerate decides)."""
    functions = _thread_functions()
    if functions is None:
        return None
    setter, getter = functions
    old = int(getter())
    if n is not None and n != old:
        setter(int(n))
    return old


@contextmanager
def decode_threads() -> Iterator[None]:
    """Run a decode step's few-row matmuls on DECODE_THREADS BLAS threads."""
    old = set_threads(DECODE_THREADS)
    try:
        yield
    finally:
        if old is not None:
            set_threads(old)
