"""`mtplxd doctor`: is this machine set up to run mtplxd fast?

Besides the BLAS and a matmul's GFLOP/s it measures the memory's read bandwidth and,
for a model (the configured default, or `--model`), what decoding it reads and
achieves: a decode step reads every weight of the trunk once, so bandwidth over the
bytes a token reads bounds its tokens per second, and the achieved fraction of that
bound says how much of a token's time goes elsewhere (docs/performance.md).
"""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, cast
from importlib.metadata import PackageNotFoundError, version

import engine  # loads the fast BLAS before mlx

MATMUL_N = 2048
SLOW_GFLOPS = 20.0  # below this a CPU matmul is served by the reference BLAS
READ_BYTES = 256 * 1024 * 1024  # read once per bandwidth measurement: far beyond any cache
DECODE_TOKENS = 48  # decoded (greedy, AR) to measure a model's tokens per second


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
    memory_read_gbs: float
    quantized_weights: str
    model: ModelReport | None
    problems: list[str]


@dataclass
class ModelReport:
    name: str  # the folder measured
    weights_read_per_token_mb: float  # every trunk weight once, as stored in memory
    decode_tok_s: float  # greedy AR, one stream
    achieved_gbs: float  # weights read per token x tokens per second
    bandwidth_fraction: float  # of memory_read_gbs
    bandwidth_limit_tok_s: float  # memory_read_gbs over the weights a token reads


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


def measure_read_gbs(repeats: int = 5) -> float:
    """Median rate of one thread summing a buffer far larger than any cache."""
    import numpy as np

    buffer = np.ones(READ_BYTES // 4, dtype=np.float32)
    buffer.sum()  # touch every page first
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - start)
    return READ_BYTES / sorted(times)[len(times) // 2] / 1e9


def weights_read_per_token(trunk) -> int:
    """Bytes of the trunk's weights, as held in memory: a decode step reads them all
    (an untied embedding table only by the row, so it is left out)."""
    from mlx.utils import tree_flatten

    untied = hasattr(trunk, "lm_head")
    weights = cast("list[tuple[str, Any]]", tree_flatten(trunk.parameters()))
    return sum(v.nbytes for k, v in weights if not (untied and "embed_tokens" in k))


def measure_model(name: str, read_gbs: float) -> ModelReport:
    from engine.engine import Engine
    from mtplxd.bench.decode import Config, Tally, run_once
    from mtplxd.calibrate import held_out_prompts
    from mtplxd.config import load_settings

    loaded = Engine.load(load_settings({"model": name}).model_path)
    prompt = tuple(loaded.tokenizer.encode(held_out_prompts(1)[0]))
    tally = Tally()
    run_once(loaded, prompt, Config("ar", 0, "t0"), DECODE_TOKENS, tally)
    tok_s = tally.decoded / tally.seconds
    per_token = weights_read_per_token(loaded.backend.trunk)
    achieved = per_token * tok_s / 1e9
    return ModelReport(name=name, weights_read_per_token_mb=round(per_token / 1e6, 1), decode_tok_s=round(tok_s, 1),
                       achieved_gbs=round(achieved, 2), bandwidth_fraction=round(achieved / read_gbs, 3),
                       bandwidth_limit_tok_s=round(read_gbs * 1e9 / per_token, 1))


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "missing"


def collect(model: str | None) -> Report:
    """`model`: a models-folder name or path to measure decoding on; None: no model."""
    import mlx.core as mx

    from engine.quantized_rows import describe

    blas = engine.BLAS
    gflops = measure_matmul_gflops()
    read_gbs = measure_read_gbs()
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
        memory_read_gbs=round(read_gbs, 1),
        quantized_weights=describe(),
        model=measure_model(model, read_gbs) if model else None,
        problems=problems,
    )


def run(as_json: bool, model: str | None) -> int:
    report = collect(model)
    if as_json:
        print(json.dumps(asdict(report), indent=2))
    else:
        for key, value in asdict(report).items():
            if key == "model" and value:
                for name, figure in value.items():
                    print(f"model {name:26} {figure}")
            elif key not in ("problems", "model"):
                print(f"{key:17} {value}")
        for problem in report.problems:
            print(f"problem: {problem}")
        print("ok" if not report.problems else f"{len(report.problems)} problem(s)")
    return 0 if not report.problems else 1
