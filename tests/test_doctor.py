"""`mtplxd doctor` through its command line: the installation checks, the memory's
read bandwidth, the quantized-weights path, and what decoding a model reads per token
against what it achieves (here the embedded model, whose weights are counted again
independently)."""

from __future__ import annotations

import json
import subprocess
import sys

from mlx.utils import tree_flatten

from engine import EMBEDDED_MODEL
from engine.engine import Engine


def doctor(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "mtplxd", "doctor", "--json", *args],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 1), done.stderr  # 1: problems found, still a report
    return json.loads(done.stdout)


def test_doctor_measures_the_bandwidth_and_a_models_decoding():
    report = doctor("--model", str(EMBEDDED_MODEL))
    assert report["memory_read_gbs"] > 0.1 and report["matmul_gflops"] > 0
    if sys.platform.startswith("linux"):
        assert report["quantized_weights"].startswith("kept packed, decode kernel")
    model = report["model"]
    trunk = Engine.load(EMBEDDED_MODEL).backend.trunk
    untied = hasattr(trunk, "lm_head")
    stored = sum(v.size * v.dtype.size for k, v in tree_flatten(trunk.parameters())
                 if not (untied and "embed_tokens" in k))
    assert abs(model["weights_read_per_token_mb"] - stored / 1e6) <= 0.05
    assert model["decode_tok_s"] > 0
    weights = model["weights_read_per_token_mb"] * 1e6
    assert abs(model["achieved_gbs"] - weights * model["decode_tok_s"] / 1e9) <= 0.01 + 0.01 * model["achieved_gbs"]
    assert abs(model["bandwidth_limit_tok_s"] - report["memory_read_gbs"] * 1e9 / weights) \
        <= 0.01 * model["bandwidth_limit_tok_s"] + 1
    assert 0 < model["bandwidth_fraction"] <= 2  # can exceed 1 when a small model stays in cache


def test_doctor_without_a_model():
    assert doctor("--no-model")["model"] is None


def test_importing_mlx_before_engine_is_said():
    """On Linux the BLAS can only be bound before MLX loads; too late, the engine says so."""
    script = "import mlx.core, engine; print(engine.BLAS.library)"
    late = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    in_order = subprocess.run([sys.executable, "-c", "import engine, mlx.core; print(engine.BLAS.library)"],
                              capture_output=True, text=True, check=True)
    if sys.platform.startswith("linux"):
        assert late.stdout.strip() == "reference" and "import engine first" in late.stderr, late.stderr
    assert "import engine first" not in in_order.stderr and in_order.stdout.strip() != "reference"
