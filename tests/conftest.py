"""Options of the suite: the soak's length (`make test-reliability` runs the full size),
and two for running it under each BLAS kernel choice (`make test-kernels`):

    --soak-seconds S                    how long tests/reliability/test_soak.py runs (10)

    --few-rows-kernel widest|avx2|off   which of the BLAS shim's few-row kernels serves
                                        decode-sized matmuls (widest: AVX-512 where the
                                        CPU has it); off: OpenBLAS's sgemm/sgemv; the
                                        same path of the quantized-rows kernel (off:
                                        its portable loop)
    --float-report                      print the largest float difference each test saw,
                                        against its bound (tests/floats.py)
    --float-json FILE                   write the same as JSON (scripts/kernel_matrix.py)
"""

from __future__ import annotations

import json
from dataclasses import asdict

import engine  # noqa: F401  (BLAS before mlx)
from engine.blas import ensure_fast_blas
from tests import engine_helpers
from tests.floats import RECORD


def pytest_addoption(parser) -> None:
    parser.addoption("--few-rows-kernel", choices=sorted(engine_helpers.KERNELS), default="widest",
                     help="the BLAS shim's few-row kernel for this run (Linux)")
    parser.addoption("--float-report", action="store_true",
                     help="print each test's largest float difference against its bound")
    parser.addoption("--float-json", metavar="FILE", help="write those differences as JSON")
    parser.addoption("--soak-seconds", type=float, default=10.0, help="length of the reliability soak")


def pytest_configure(config) -> None:
    engine_helpers.choose_kernel(config.getoption("--few-rows-kernel"))


def pytest_report_header(config) -> str:
    blas = ensure_fast_blas()
    return f"BLAS: {blas.library} ({blas.detail}); few-row kernel asked: {config.getoption('--few-rows-kernel')}"


def pytest_terminal_summary(terminalreporter, config) -> None:
    if config.getoption("--float-json"):
        with open(config.getoption("--float-json"), "w") as f:
            json.dump({test: {what: asdict(s) for what, s in seen.items()} for test, seen in RECORD.items()}, f)
    if not config.getoption("--float-report") or not RECORD:
        return
    write = terminalreporter.write_line
    terminalreporter.section("float differences against their bounds (float32 epsilons of the magnitude)")
    write("worst: the largest difference seen; a negative control (marked !) shows its smallest,")
    write("which must exceed the bound")
    write(f"{'test':<64} {'what':<24} {'worst':>10} {'bound':>6} {'of bound':>9}")
    for test, seen in sorted(RECORD.items()):
        for what, s in sorted(seen.items()):
            label = ("! " if s.control else "") + what
            write(f"{test[-64:]:<64} {label[:24]:<24} {s.seen_ulps:>10.4g} {s.ulps:>6g} {s.seen_ulps / s.ulps:>9.3g}")
