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
import sys
from dataclasses import dataclass
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


def _load() -> BlasInfo:
    if sys.platform == "darwin":
        return BlasInfo("accelerate", None, "macOS: MLX uses Accelerate and Metal")
    if not sys.platform.startswith("linux"):
        return BlasInfo("unknown", None, f"platform {sys.platform}")
    if "mlx.core" in sys.modules:
        return BlasInfo("reference", None, "mlx was imported before engine.blas")
    if SHIM_PATH.exists():
        lib = ctypes.CDLL(str(SHIM_PATH), mode=ctypes.RTLD_GLOBAL)
        lib.mtplxd_blas_config.restype = ctypes.c_char_p
        config = lib.mtplxd_blas_config().decode()
        return BlasInfo("openblas", str(SHIM_PATH), f"scipy-openblas32 via shim: {config}")
    system = ctypes.util.find_library("openblas")
    if system:
        ctypes.CDLL(system, mode=ctypes.RTLD_GLOBAL)
        return BlasInfo("openblas", system, "system OpenBLAS")
    return BlasInfo(
        "reference",
        None,
        "no OpenBLAS found: run `make install` (needs a C compiler) for fast CPU matmuls",
    )
