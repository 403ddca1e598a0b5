"""Run the engine tests under every BLAS kernel choice a machine may make (`make test-kernels`).

Which OpenBLAS kernel runs (CPU model, OPENBLAS_CORETYPE, thread count) and which of
the BLAS shim's few-row kernels and the quantized-rows kernel's paths serve decode steps
(AVX-512, AVX2, none / portable) change the
order of float additions, so a float comparison that holds on one machine may fail on
the next. Each configuration runs in a fresh process; the summary lists each one's
result and, per comparison, the largest difference seen in any of them against its
bound (tests/floats.py), and how far the negative controls fell outside theirs.

    python scripts/kernel_matrix.py [--tests FILES] [--only NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENGINE_TESTS = [
    "tests/test_engine.py", "tests/test_backends_nextn.py", "tests/test_backends_qwen.py",
    "tests/test_backends_nemotron_h.py", "tests/test_backends_deepseek_v4.py",
    "tests/test_decode_path.py", "tests/test_session_bank.py", "tests/test_models.py",
    "tests/test_speculative.py", "tests/test_engine_exactness.py", "tests/test_train.py", "tests/test_batch.py",
    "tests/test_quantized_rows.py", "tests/test_draft_vocab.py", "tests/test_plain_backend.py",
]

UNSET = None
# name -> (environment changes, pytest options)
CONFIGS: dict[str, tuple[dict[str, str | None], list[str]]] = {
    "shim AVX-512 (widest)": ({}, ["--few-rows-kernel", "widest"]),
    "shim AVX2": ({}, ["--few-rows-kernel", "avx2"]),
    "shim off (OpenBLAS sgemv/sgemm)": ({}, ["--few-rows-kernel", "off"]),
    "OPENBLAS_NUM_THREADS=1": ({"OPENBLAS_NUM_THREADS": "1"}, []),
    "OPENBLAS_NUM_THREADS=2": ({"OPENBLAS_NUM_THREADS": "2"}, []),
    "OPENBLAS_CORETYPE unset": ({"OPENBLAS_CORETYPE": UNSET, "OPENBLAS_L2_SIZE": UNSET}, []),
    "OPENBLAS_CORETYPE=Haswell": ({"OPENBLAS_CORETYPE": "Haswell"}, []),
    "OPENBLAS_CORETYPE=Sandybridge": ({"OPENBLAS_CORETYPE": "Sandybridge"}, []),
}


def run(name: str, tests: list[str], report: Path) -> tuple[bool, str, float]:
    changes, options = CONFIGS[name]
    env = dict(os.environ)
    for key, value in changes.items():
        if value is UNSET:
            env.pop(key, None)
        else:
            env[key] = value
    command = [sys.executable, "-m", "pytest", "-q", *tests, *options, "--float-json", str(report)]
    started = time.monotonic()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    summary = (lines or done.stderr.strip().splitlines() or ["no output"])[-1].strip("= ")
    if done.returncode != 0:
        failed = [line for line in lines if line.startswith("FAILED")]
        print("\n".join(failed[:20]) or done.stdout[-3000:] + done.stderr[-2000:])
    return done.returncode == 0, summary, time.monotonic() - started


def kernel_line() -> str:
    probe = "import engine.blas as b; print(b.ensure_fast_blas().detail)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return out.stdout.strip() or out.stderr.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", nargs="+", default=ENGINE_TESTS)
    parser.add_argument("--only", action="append", choices=sorted(CONFIGS), help="run only these")
    args = parser.parse_args()
    print(f"BLAS here: {kernel_line()}")
    print(f"environment here: OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}, "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', '(unset)')}")
    worst: dict[tuple[str, str], dict] = {}
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only or CONFIGS:
            report = Path(tmp) / f"{re.sub(r'[^a-z0-9]+', '-', name.lower())}.json"
            ok, summary, seconds = run(name, args.tests, report)
            results.append((name, ok, summary, seconds))
            print(f"{'ok    ' if ok else 'FAILED'} {name:<34} {summary} ({seconds:.0f} s)", flush=True)
            seen = json.loads(report.read_text()) if report.exists() else {}
            for test, comparisons in seen.items():
                for what, s in comparisons.items():
                    key, ratio = (test, what), s["seen_ulps"] / s["ulps"]
                    old = worst.get(key)
                    further = old is None or (ratio < old["ratio"] if s["control"] else ratio > old["ratio"])
                    if further:
                        worst[key] = {**s, "ratio": ratio, "config": name}
    print("\nPer comparison, over every configuration: the largest difference (a negative control, marked !:")
    print("the smallest), in float32 epsilons of the magnitude, against the bound")
    print(f"{'test':<58} {'what':<26} {'worst':>9} {'bound':>6} {'of bound':>9}  configuration")
    for (test, what), s in sorted(worst.items()):
        label = ("! " if s["control"] else "") + what
        print(f"{test.removeprefix('tests/')[-58:]:<58} {label[:26]:<26} {s['seen_ulps']:>9.4g} {s['ulps']:>6g} "
              f"{s['ratio']:>9.3g}  {s['config']}")
    failed = [name for name, ok, _, _ in results if not ok]
    print(f"\n{len(results) - len(failed)} of {len(results)} configurations passed"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
