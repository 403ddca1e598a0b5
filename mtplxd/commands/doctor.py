"""`mtplxd doctor`: is this machine set up to run mtplxd fast?"""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version

import engine  # loads the fast BLAS before mlx

MATMUL_N = 2048
SLOW_GFLOPS = 20.0  # below this a CPU matmul is served by the reference BLAS


@dataclass
class Report:
    platform: str
    python: str
    mlx: str
    mlx_lm: str
    device: str
    blas: str
    blas_path: str | None
    blas_detail: str
    matmul_gflops: float
    problems: list[str]


def measure_matmul_gflops(n: int = MATMUL_N, repeats: int = 5) -> float:
    """Median float32 n x n matmul throughput through MLX."""
    import mlx.core as mx

    a = mx.random.normal((n, n), key=mx.random.key(0))
    b = mx.random.normal((n, n), key=mx.random.key(1))
    mx.eval(a @ b)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(a @ b)
        times.append(time.perf_counter() - start)
    return 2 * n**3 / sorted(times)[len(times) // 2] / 1e9


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "missing"


def collect() -> Report:
    import mlx.core as mx

    blas = engine.BLAS
    gflops = measure_matmul_gflops()
    problems = []
    if sys.platform.startswith("linux") and blas.library == "reference":
        problems.append(f"MLX uses the reference BLAS: {blas.detail}")
    if mx.default_device() == mx.cpu and gflops < SLOW_GFLOPS:
        problems.append(f"CPU matmul runs at {gflops:.1f} GFLOP/s; expected far more with OpenBLAS")
    return Report(
        platform=f"{platform.system()} {platform.machine()}",
        python=platform.python_version(),
        mlx=_version("mlx"),
        mlx_lm=_version("mlx-lm"),
        device=str(mx.default_device()),
        blas=blas.library,
        blas_path=blas.path,
        blas_detail=blas.detail,
        matmul_gflops=round(gflops, 1),
        problems=problems,
    )


def run(as_json: bool) -> int:
    report = collect()
    if as_json:
        print(json.dumps(asdict(report), indent=2))
    else:
        for key, value in asdict(report).items():
            if key != "problems":
                print(f"{key:14} {value}")
        for problem in report.problems:
            print(f"problem: {problem}")
        print("ok" if not report.problems else f"{len(report.problems)} problem(s)")
    return 0 if not report.problems else 1
