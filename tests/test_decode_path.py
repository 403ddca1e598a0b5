"""The fast decode path against the reference implementations it replaces:
the MiMo backend's compiled blocks against mlx-lm's modules, the rotary table
against mx.fast.rope, and the BLAS shim's matrix-vector route against numpy."""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys

import engine  # noqa: F401  (BLAS before mlx)
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.rope_utils import initialize_rope

from engine.backends import mimo
from engine.backends.decode_ops import FIRST_SIZE, RopeTable, apply_rope, cpu_attention, grouped_mask, swiglu
from engine.blas import ensure_fast_blas
from tests.engine_helpers import available_families, load_family, restore_kernel
from tests.floats import DOT_ULPS, FEW_OPS_ULPS, PATHS_ULPS, assert_close, excess


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    return load_family(tmp_path_factory.mktemp("mimo"), "mimo", mtp_heads=2).backend


def test_trunk_matches_mlx_lm_in_prefill_and_decode_steps(backend):
    """Prefill (eager, > COMPILED_MAX_TOKENS) then 1- and 4-token steps (compiled):
    logits, hidden states and KV caches equal mlx-lm's own model's."""
    prompt = mx.array([list(range(3, 3 + 2 * mimo.COMPILED_MAX_TOKENS + 3))])
    ours, theirs = backend.make_cache(), backend.make_cache()
    for tokens in (prompt, mx.array([[7]]), mx.array([[8, 9, 10, 11]]), mx.array([[12]])):
        logits, _ = backend.forward(tokens, ours)
        reference = backend.trunk(tokens, cache=theirs)
        assert_close(logits, reference, PATHS_ULPS, "logits")
    for a, b in zip(ours, theirs):
        assert a.offset == b.offset
        assert_close(a.state[0], b.state[0], PATHS_ULPS, "keys")
        assert_close(a.state[1], b.state[1], PATHS_ULPS, "values")


def test_heads_match_the_module_forward(backend):
    cache_a, cache_b = backend.make_head_caches()[0], backend.make_head_caches()[0]
    head = backend.heads[0]
    embed = backend.trunk.model.embed_tokens
    for length in (12, 1, 3):
        hidden = mx.random.normal((1, length, backend.trunk.args.hidden_size), key=mx.random.key(length))
        tokens = mx.arange(length)[None] + 5
        logits, h = backend.head(0, hidden, tokens, cache_a)
        reference = head(hidden, embed(tokens), cache_b)
        assert_close(h, reference, PATHS_ULPS, "head hidden")
        assert_close(logits, backend._lm_head(reference), PATHS_ULPS, "head logits")


def test_compiled_blocks_see_weight_changes(tmp_path):
    """The compiled functions read the block's current weights, not the ones traced."""
    backend = load_family(tmp_path, "mimo").backend
    step = mx.array([[4]])
    backend.forward(step, backend.make_cache())  # traces the compiled blocks
    layer = backend.trunk.model.layers[0]
    layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * 3.0
    logits, _ = backend.forward(step, backend.make_cache())
    reference = backend.trunk(step, cache=backend.make_cache())
    assert_close(logits, reference, PATHS_ULPS, "logits")


@pytest.mark.parametrize("scaling", [None, {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
                                     {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}],
                         ids=["plain", "llama3", "yarn"])
def test_rope_table_equals_the_rope_module(scaling):
    head_dim = 64
    rope = initialize_rope(head_dim, base=10000.0, traditional=False, scaling_config=scaling,
                           max_position_embeddings=4096)
    table = RopeTable(rope, head_dim)
    x = mx.random.normal((1, 3, 5, head_dim), key=mx.random.key(1))
    # offsets inside the first table and across the first doubling
    for offset in (0, 17, FIRST_SIZE - 2, FIRST_SIZE + 100):
        expected = rope(x, offset=offset)
        assert_close(apply_rope(x, *table.slices(offset, 5)), expected, FEW_OPS_ULPS, "rotated")
    assert table.cos.shape[0] == 2 * FIRST_SIZE


def test_interleaved_rope_is_not_tabulated(tmp_path):
    rope = initialize_rope(64, base=10000.0, traditional=True, scaling_config=None,
                           max_position_embeddings=4096)
    assert not RopeTable.supports(rope)


@pytest.fixture
def few_rows_kernel():
    """The shim's switch for its few-row kernel (restored to this run's choice)."""
    if ensure_fast_blas().library != "openblas" or ensure_fast_blas().path is None:
        pytest.skip("the shim serves OpenBLAS on Linux only")
    switch = ctypes.CDLL(ensure_fast_blas().path).mtplxd_few_rows
    yield switch
    restore_kernel()


@pytest.mark.parametrize("kernel", [1, 2], ids=["widest", "avx2"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9])
@pytest.mark.parametrize("n,k", [(4096, 192), (1031, 203), (64, 2100), (7, 2048), (10, 1000), (1000, 9)])
def test_few_row_products_of_the_blas_shim(few_rows_kernel, kernel, rows, n, k):
    """Up to 8 rows of x @ W^T skip sgemm for the shim's own kernels (the AVX-512
    one where the CPU has it, and the AVX2 one: odd sizes, tails, and matrices
    shorter than the prefetch distance included); every operand layout must
    still give numpy's float64 product, and the same as sgemm/sgemv."""
    few_rows_kernel(kernel)
    rng = np.random.default_rng(rows * n)
    weight = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    expected = x.astype(np.float64) @ weight.T.astype(np.float64)
    w, xs = mx.array(weight), mx.array(x)
    x_strided = mx.array(np.ascontiguousarray(x.T)).T  # a transposed left operand
    x_padded = mx.array(np.pad(x, ((0, 0), (0, 5))))[:, :k]  # rows lda = k + 5 apart
    w_t = mx.array(np.ascontiguousarray(weight.T))  # an untransposed right operand
    products = [xs @ w.T, x_strided @ w.T, x_padded @ w.T, xs @ w_t,
                mx.addmm(mx.ones((rows, n)), xs, w.T, alpha=2.0, beta=0.5) - 0.5]
    expected_all = [expected] * 4 + [2 * expected]
    for product, want in zip(products, expected_all):
        assert_close(product, want, DOT_ULPS, "against float64")
    few_rows_kernel(0)
    with_sgemm = np.array(xs @ w.T)
    assert_close(products[0], with_sgemm, DOT_ULPS, "against sgemm")


def test_greedy_verification_is_the_exact_rule_on_one_hot_distributions():
    from engine.speculative import verify, verify_greedy

    rng = np.random.default_rng(0)
    batch, depth, vocab = 64, 3, 40
    logits = mx.array(rng.standard_normal((batch, depth + 1, vocab)).astype(np.float32))
    best = np.array(mx.argmax(logits, axis=-1))
    # each draft is the target's argmax with probability 0.7, another token otherwise
    drafts = np.where(rng.random((batch, depth)) < 0.7, best[:, :depth], (best[:, :depth] + 1) % vocab)
    p = mx.array(np.eye(vocab, dtype=np.float32)[best])
    q = mx.array(np.eye(vocab, dtype=np.float32)[drafts])
    n_fast, next_fast = verify_greedy(logits, mx.array(drafts))
    for seed in range(3):
        n_exact, next_exact = verify(p, q, mx.array(drafts), mx.random.key(seed))
        assert np.array_equal(np.array(n_fast), np.array(n_exact))
        assert np.array_equal(np.array(next_fast), np.array(next_exact))
    assert 0 < int(mx.sum(n_fast == depth)) < batch  # both full and partial acceptance occur


def test_swiglu_equals_the_library_activation():
    """decode_ops.swiglu (power in place of exp) against nn.silu, extremes included."""
    gate = mx.concatenate([mx.random.normal((4000,), key=mx.random.key(1)) * 6,
                           mx.array([-200.0, -90.0, -30.0, 0.0, 30.0, 90.0, 200.0])])
    x = mx.random.normal(gate.shape, key=mx.random.key(2))
    ours, library = swiglu(gate, x), mx.compile(lambda g, u: nn.silu(g) * u)(gate, x)
    assert not mx.isnan(ours).any()
    assert_close(ours, library, FEW_OPS_ULPS, "silu")


@pytest.mark.parametrize("heads,kv_heads,length", [(3, 1, 1), (3, 1, 4), (4, 2, 3), (4, 4, 2)])
def test_cpu_attention_equals_the_library_kernel(heads, kv_heads, length):
    cached = 37
    keys = mx.random.split(mx.random.key(heads + length), 3)
    q = mx.random.normal((1, heads, length, 16), key=keys[0])
    k = mx.random.normal((1, kv_heads, cached + length, 16), key=keys[1])
    v = mx.random.normal((1, kv_heads, cached + length, 16), key=keys[2])
    mask = grouped_mask(create_causal_mask(length, cached) if length > 1 else None, heads // kv_heads)
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal" if length > 1 else None)
    assert_close(cpu_attention(q * 0.25, k, v, mask), expected, DOT_ULPS, "attention")
    if length > 1:  # the mask matters: without it the result differs
        assert excess(cpu_attention(q * 0.25, k, v, None), expected, DOT_ULPS, "unmasked attention") > 1


@pytest.mark.parametrize("family", available_families())
def test_heads_give_the_last_logits_alone(tmp_path, family):
    """Drafting asks a head for its last position's logits only: the same values."""
    backend = load_family(tmp_path, family).backend
    prompt = mx.array([[5, 6, 7, 8, 9]])
    _, hidden = backend.forward(prompt, backend.make_cache())
    every, _ = backend.head(0, hidden[:, :-1], prompt[:, 1:], backend.make_head_caches()[0])
    last, _ = backend.head(0, hidden[:, :-1], prompt[:, 1:], backend.make_head_caches()[0], last=True)
    assert last.shape[1] == 1
    assert_close(last, every[:, -1:], PATHS_ULPS, "last logits")


@pytest.mark.parametrize("given,kept", [(None, "4"), ("12", "12")])
def test_openblas_idle_threads_sleep_at_once_unless_the_user_chose(given, kept):
    """OpenBLAS reads OPENBLAS_THREAD_TIMEOUT when it loads: importing the engine
    sets the shortest spin before that, and keeps a value the user set."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    if given is not None:
        env["OPENBLAS_THREAD_TIMEOUT"] = given
    probe = "import engine, os; print(os.environ['OPENBLAS_THREAD_TIMEOUT'])"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == kept


def test_the_shim_names_the_decode_kernel_this_cpu_gets():
    """`mtplxd doctor` reports which few-row kernel serves decode steps: the widest
    this CPU's flags allow."""
    blas = ensure_fast_blas()
    if blas.library != "openblas" or blas.path is None:
        pytest.skip("the shim serves OpenBLAS on Linux only")
    with open("/proc/cpuinfo") as f:
        flags = set(next((line for line in f if line.startswith("flags")), "").split())
    expected = "none"
    if platform.machine() == "x86_64" and {"avx2", "fma"} <= flags:
        expected = "AVX-512" if "avx512f" in flags else "AVX2"
    assert f"few-row decode kernel: {expected}" in blas.detail
