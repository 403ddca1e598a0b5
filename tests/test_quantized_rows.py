"""The CPU decode kernel for quantized weights (engine/native/quantized_rows.cpp,
engine/quantized_rows.py): every path this CPU has (AVX-512, AVX2, portable) against
a float64 product of the dequantized weights, at 4 and 8 bits and groups of 32 to 128,
for 1 to ROWS_MAX rows, in batches, on strided inputs and inside mx.compile; longer
inputs through the unpacking path; its refusals; and negative controls: kernels with a
plausible bug (the nibbles of a byte read in the other order, one group's scale
applied to the next) fall far outside the bound that the real one holds. The module's
other operations (softmax, SwiGLU, unpacking, the decode attention) likewise, each
against float64 on every path with its negative control.

Models through the kernel are compared with unpacked weights in test_models.py."""

from __future__ import annotations

import io
import os
import sys

import mlx.core as mx
import numpy as np
import pytest

from engine import quantized_rows
from tests.engine_helpers import restore_kernel
from tests.floats import DOT_ULPS, FEW_OPS_ULPS, assert_close, excess

pytestmark = pytest.mark.skipif(sys.platform == "darwin", reason="macOS: MLX's Metal kernels serve quantized weights")

@pytest.fixture
def kernel():
    module = quantized_rows.native()
    assert module is not None, "the decode kernel is not built: run `make install` (needs c++ and cmake)"
    yield module
    restore_kernel()  # the path this run asked for (--few-rows-kernel)


def weights(n: int, k: int, bits: int, group: int, seed: int = 0):
    w = mx.random.normal((n, k), key=mx.random.key(seed))
    return mx.quantize(w, group_size=group, bits=bits)


def reference(x: mx.array, packed, bits: int, group: int) -> np.ndarray:
    """float64 product with the dequantized weights."""
    w = np.array(mx.dequantize(*packed, group_size=group, bits=bits), dtype=np.float64)
    return np.array(x, dtype=np.float64) @ w.T


@pytest.mark.parametrize("bits,group,k", [(4, 32, 640), (4, 64, 640), (4, 128, 640), (8, 32, 640), (8, 64, 640),
                                          (8, 128, 640), (4, 32, 576), (4, 64, 576), (8, 32, 576), (4, 32, 544)])
def test_every_path_equals_float64(kernel, bits, group, k):
    # 99 output rows: not a multiple of the 4 or 2 weight rows a vector path takes at once.
    # One row is factored in blocks of 64 bytes (128 values at 4 bits): k = 640 is whole
    # blocks, 576 at 4 bits pairs rows of W (and its 99th row is alone, its last block
    # masked), 544 keeps the lookups.
    packed = weights(99, k, bits, group)
    for name in kernel.paths():
        kernel.set_kernel(name)
        for rows in (1, 2, 3, 4, 5, 8, 9, 16, quantized_rows.ROWS_MAX):
            x = mx.random.normal((rows, k), key=mx.random.key(rows))
            got = kernel.quantized_rows(x, *packed, group, bits)
            assert_close(np.array(got), reference(x, packed, bits, group), DOT_ULPS,
                         what=f"{name} {bits}-bit", where=f"group {group}, {rows} rows")


def test_the_paths_this_machine_should_have(kernel):
    """On x86-64 the two vector paths are there whenever the CPU has the instructions."""
    found = kernel.paths()
    assert found[-1] == "portable" and kernel.kernel() in found
    flags = open("/proc/cpuinfo").read() if sys.platform.startswith("linux") else ""
    assert ("avx512" in found) == (" avx512f" in flags)
    assert ("avx2" in found) == (" avx2" in flags and " fma" in flags)


def test_helper_threads_change_nothing(kernel):
    """A large product is split by weight rows over helper threads, the attention of a
    step of many rows by (row, KV head), a prompt chunk's causal softmax by rows; each
    output is still computed by one thread with the same code: bitwise the same result."""
    packed = weights(1000, 1024, 4, 64)
    x = mx.random.normal((8, 1024), key=mx.random.key(5))
    q = mx.random.normal((8, 8, 1, 64), key=mx.random.key(6)) * 0.3
    k, v = (mx.random.normal((8, 4, 600, 64), key=mx.random.key(s)) for s in (7, 8))
    scores = mx.random.normal((1, 3, 3 * 64, 600), key=mx.random.key(9)) * 4  # 64 new positions after 536
    threads = kernel.threads()
    try:
        products, attended, softmaxed = [], [], []
        for n in (1, 2, 3):
            kernel.set_threads(n)
            assert kernel.threads() == n
            products.append(np.array(kernel.quantized_rows(x, *packed, 64, 4)))
            attended.append(np.array(kernel.attention(q, k, v)))
            softmaxed.append(np.array(kernel.softmax(scores, 64, 536)))
    finally:
        kernel.set_threads(threads)
    for results in (products, attended, softmaxed):
        np.testing.assert_array_equal(results[0], results[1])
        np.testing.assert_array_equal(results[0], results[2])
    assert_close(products[0], reference(x, packed, 4, 64), DOT_ULPS, "split over threads")
    everywhere = np.ones((8, 8, 1, 600), bool)
    assert_close(attended[1], attention64(q, k, v, everywhere), DOT_ULPS, "attention split over threads")


def test_pieces_taken_by_busy_helpers_change_nothing(kernel):
    """The work of a split product is taken piece by piece from one counter by whichever
    thread comes first, the caller included, so a helper whose core is busy takes fewer
    pieces or none. With more helpers than cores and a Python thread spinning beside them,
    who takes what changes from call to call: the results must not, bit for bit, and no
    call may wait for ever for a helper (a lost piece would hang here)."""
    import threading

    packed = weights(1000, 1024, 4, 64)
    x = mx.random.normal((8, 1024), key=mx.random.key(5))
    scores = mx.random.normal((1, 3, 3 * 64, 600), key=mx.random.key(9)) * 4
    want = np.array(kernel.quantized_rows(x, *packed, 64, 4)), np.array(kernel.softmax(scores, 64, 536))
    threads, busy = kernel.threads(), threading.Event()

    def spin() -> None:
        while not busy.is_set():
            sum(range(1000))

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        kernel.set_threads(4)
        for _ in range(60):
            np.testing.assert_array_equal(np.array(kernel.quantized_rows(x, *packed, 64, 4)), want[0])
            np.testing.assert_array_equal(np.array(kernel.softmax(scores, 64, 536)), want[1])
    finally:
        busy.set()
        spinner.join()
        kernel.set_threads(threads)


def test_strided_inputs_are_read_as_laid_out(kernel):
    """A view (a cache's buffer cut to its positions, a transposed x) is copied in runs of
    its last axis: the same result as its contiguous copy, bit for bit, whether the last
    axis is contiguous (a cut) or strided (a transpose)."""
    q = mx.random.normal((2, 4, 1, 64), key=mx.random.key(6)) * 0.3
    k, v = (mx.random.normal((2, 2, 300, 64), key=mx.random.key(s)) for s in (7, 8))
    cut_k, cut_v = k[:, :, 37:], v[:, :, 37:]
    got = np.array(kernel.attention(q, cut_k, cut_v))
    np.testing.assert_array_equal(got, np.array(kernel.attention(q, mx.contiguous(cut_k), mx.contiguous(cut_v))))
    assert not np.array_equal(got, np.array(kernel.attention(q, k[:, :, :263], v[:, :, :263])))  # other keys: other result
    packed = weights(64, 256, 4, 64)
    xt = mx.random.normal((256, 3), key=mx.random.key(4)).T  # rows strided by 3
    np.testing.assert_array_equal(np.array(kernel.quantized_rows(xt, *packed, 64, 4)),
                                  np.array(kernel.quantized_rows(mx.contiguous(xt), *packed, 64, 4)))


def test_decoding_splits_products_over_two_cores_where_there_are_two(kernel):
    """Rows beyond the first are compute-bound in the kernel: a helper thread serves them
    (engine/quantized_rows.py, KERNEL_THREADS)."""
    assert kernel.threads() == min(2, os.cpu_count() or 1)  # as loaded, before any test changes it


def test_negative_controls_fall_outside_the_bound(kernel):
    """What two plausible bugs would compute is caught by the same bound."""
    bits, group = 4, 32
    packed = weights(64, 576, bits, group)
    w, scales, biases = packed
    swapped = ((w & 0x0F0F0F0F) << 4) | ((w >> 4) & 0x0F0F0F0F)  # the two values of each byte in the other order
    shifted = (mx.roll(scales, 1, axis=1), mx.roll(biases, 1, axis=1))  # each group's scale and bias from the one before
    pairs = np.arange(64).reshape(32, 2)[:, ::-1].ravel()  # the outputs of each pair of W's rows swapped
    for rows in (1, 3):  # one row is factored (AVX-512), three look their weights up
        x = mx.random.normal((rows, 576), key=mx.random.key(7))
        got = np.array(kernel.quantized_rows(x, *packed, group, bits))
        assert_close(got, reference(x, packed, bits, group), DOT_ULPS, f"{rows} rows")
        assert excess(got, reference(x, (swapped, scales, biases), bits, group), DOT_ULPS, "nibbles swapped") > 100
        assert excess(got, reference(x, (w, *shifted), bits, group), DOT_ULPS, "scales shifted") > 100
        assert excess(got, reference(x, packed, bits, group)[:, pairs], DOT_ULPS, "pairs swapped") > 100
    packed = weights(64, 576, 8, group)
    w, scales, biases = packed
    swapped = ((w & 0x00FF00FF) << 8) | ((w >> 8) & 0x00FF00FF)  # each word's bytes in pairs, in the other order
    for rows in (1, 3):
        x = mx.random.normal((rows, 576), key=mx.random.key(8))
        got = np.array(kernel.quantized_rows(x, *packed, group, 8))
        assert_close(got, reference(x, packed, 8, group), DOT_ULPS, f"8 bits, {rows} rows")
        assert excess(got, reference(x, (swapped, scales, biases), 8, group), DOT_ULPS, "bytes swapped") > 100


def test_batches_strides_and_compile(kernel):
    bits, group = 4, 64
    packed = weights(48, 256, bits, group)
    x = mx.random.normal((2, 3, 256), key=mx.random.key(1))
    want = reference(x.reshape(6, 256), packed, bits, group).reshape(2, 3, 48)
    assert_close(np.array(kernel.quantized_rows(x, *packed, group, bits)), want, DOT_ULPS, "batched rows")
    strided = mx.random.normal((256, 5), key=mx.random.key(2)).T  # a transposed view: not row-contiguous
    assert_close(np.array(kernel.quantized_rows(strided, *packed, group, bits)),
                 reference(strided, packed, bits, group), DOT_ULPS, "strided rows")
    every_other = tuple(a[::2] for a in packed)  # views of a weight: strided rows
    assert_close(np.array(kernel.quantized_rows(x, *every_other, group, bits)),
                 reference(x.reshape(6, 256), every_other, bits, group).reshape(2, 3, 24), DOT_ULPS, "strided weights")
    compiled = mx.compile(lambda a: kernel.quantized_rows(a * 2.0, *packed, group, bits) + 1.0)
    assert_close(np.array(compiled(x)), 2.0 * want + 1.0, DOT_ULPS, "inside mx.compile")


def test_longer_inputs_unpack_for_blas(kernel):
    """Above ROWS_MAX rows the product unpacks the matrix (same numbers, BLAS speed)."""
    bits, group = 8, 32
    packed = weights(40, 128, bits, group)
    x = mx.random.normal((quantized_rows.ROWS_MAX + 7, 128), key=mx.random.key(3))
    got = quantized_rows.quantized_matmul(x, *packed, group, bits)
    assert_close(np.array(got), reference(x, packed, bits, group), DOT_ULPS, "unpacked path")


def test_inputs_it_does_not_take_are_refused(kernel):
    w, scales, biases = weights(8, 64, 4, 32)
    x = mx.ones((1, 64))
    cases = [
        ((x, w, scales, biases, 32, 3), "bits must be 4 or 8"),
        ((x, w, scales, biases, 48, 4), "group_size must be a multiple of 32"),
        ((x.astype(mx.float16), w, scales, biases, 32, 4), "must be float32"),
        ((mx.ones((1, 32)), w, scales, biases, 32, 4), "x has 32 columns, w holds 64"),
        ((x, w, scales[:, :1], biases, 32, 4), "scales and biases must be [N, K / group_size]"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            kernel.quantized_rows(*args)
    # the routing function leaves what the kernel does not take to MLX
    half = quantized_rows.quantized_matmul(x.astype(mx.float16), w, scales.astype(mx.float16),
                                           biases.astype(mx.float16), 32, 4)
    assert half.dtype == mx.float16


def test_layers_the_kernel_does_not_take_are_unpacked(kernel):
    """Loading keeps packed only what the kernel reads; the rest (another bit width here,
    MoE experts in real models) is unpacked as before, not left to MLX's slow loop."""
    import mlx.nn as nn

    import engine.engine

    model = nn.Module()
    model.kept = nn.QuantizedLinear(64, 32, bias=False, group_size=32, bits=4)
    model.other = nn.QuantizedLinear(64, 32, bias=False, group_size=32, bits=3)
    x = mx.random.normal((2, 64), key=mx.random.key(9))
    want = {name: np.array(getattr(model, name)(x)) for name in ("kept", "other")}
    assert quantized_rows.keep_packed(model) == 1
    engine.engine._dequantize(model)
    assert isinstance(model.kept, quantized_rows.RowsQuantizedLinear)
    assert type(model.other) is nn.Linear
    for name in ("kept", "other"):
        assert_close(np.array(getattr(model, name)(x)), want[name], DOT_ULPS, f"{name} after loading")


SOFTMAX_ULPS = 16  # a few roundings of exp, and of the row's sum (measured: <= 6 on 49,152 values)


def softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_softmax_equals_float64_on_every_path(kernel):
    """The native softmax (MLX's CPU exp costs ~19 ns an element; this one ~3) against
    float64, on rows as attention and sampling give them: masked positions (-inf, which
    must give exactly 0), rows shorter than a vector, a vocabulary-sized one, a strided
    view and a compiled graph; then a negative control."""
    rng = np.random.default_rng(0)
    for name in kernel.paths():
        kernel.set_kernel(name)
        for n in (1, 7, 16, 33, 4096, 49152):
            x = rng.normal(0, 8, (5, n)).astype(np.float32)
            if n > 1:
                x[:, 1::3] = -np.inf
            got = np.array(kernel.softmax(mx.array(x)))
            assert_close(got, softmax64(x), SOFTMAX_ULPS, what=f"softmax {name}", where=f"rows of {n}")
            assert (got[:, 1::3] == 0).all() and np.allclose(got.sum(axis=-1), 1.0, atol=1e-5)
        far = np.array([[0.0, -80.0, -87.0, -90.0, -200.0]], dtype=np.float32)  # underflow: 0, not garbage
        assert_close(np.array(kernel.softmax(mx.array(far))), softmax64(far), SOFTMAX_ULPS, f"softmax {name} far")
    x = mx.array(rng.normal(0, 3, (4, 3, 100)).astype(np.float32))
    view = x.swapaxes(0, 1)
    assert_close(np.array(kernel.softmax(view)), softmax64(np.array(view)), SOFTMAX_ULPS, "softmax of a view")
    compiled = mx.compile(lambda a: kernel.softmax(2.0 * a))
    assert_close(np.array(compiled(x)), softmax64(2.0 * np.array(x)), SOFTMAX_ULPS, "softmax compiled")
    wrong = np.array(kernel.softmax(x * 1.0001))  # a temperature off by 1e-4
    assert excess(wrong, softmax64(np.array(x)), SOFTMAX_ULPS, "softmax, inputs scaled 1e-4") > 10
    with pytest.raises(ValueError, match="float32"):
        kernel.softmax(x.astype(mx.float16))


def test_the_engine_softmax_takes_the_native_one(kernel):
    """engine.sampling.softmax (sampling, and attention on the CPU) runs the native
    softmax where it is built: one Softmax node, not MLX's max, power, sum and divide."""
    from engine.sampling import softmax

    x = mx.random.normal((3, 50))
    assert_close(np.array(softmax(x)), softmax64(np.array(x)), SOFTMAX_ULPS, "engine softmax")
    dot = io.StringIO()
    mx.export_to_dot(dot, softmax(x))
    assert "Softmax" in dot.getvalue() and "Power" not in dot.getvalue()


def test_causal_softmax_reads_only_the_keys_before_each_query(kernel, monkeypatch):
    """Attention scores of 5 new positions after 7 cached ones, for 3 heads sharing a kv
    head (rows: head, then position): the causal softmax equals a float64 softmax with
    the causal mask applied, and the CPU attention gives the same with `Causal` as with
    the boolean mask it used to build. A wrong offset is the negative control."""
    from mlx_lm.models.base import create_causal_mask

    from engine.backends.decode_ops import Causal, cpu_attention, grouped_mask

    length, offset, group = 5, 7, 3
    rng = np.random.default_rng(1)
    scores = rng.normal(0, 4, (2, 1, group * length, offset + length)).astype(np.float32)
    allowed = np.array(grouped_mask(create_causal_mask(length, offset), group))
    want = softmax64(np.where(allowed, scores, -np.inf))
    for name in kernel.paths():
        kernel.set_kernel(name)
        got = np.array(kernel.softmax(mx.array(scores), length, offset))
        assert_close(got, want, SOFTMAX_ULPS, what=f"causal softmax {name}")
        assert (got[..., ~allowed] == 0).all()
    shifted = np.array(kernel.softmax(mx.array(scores), length, offset + 1))
    assert excess(shifted, want, SOFTMAX_ULPS, "causal softmax, offset off by one") > 100
    q = mx.random.normal((1, 2 * group, length, 16), key=mx.random.key(3))
    k, v = (mx.random.normal((1, 2, offset + length, 16), key=mx.random.key(s)) for s in (4, 5))
    as_mask = cpu_attention(q, k, v, grouped_mask(create_causal_mask(length, offset), group))
    assert_close(np.array(cpu_attention(q, k, v, Causal(offset, length))), np.array(as_mask), SOFTMAX_ULPS,
                 "attention with Causal")
    from engine.backends import decode_ops

    monkeypatch.setattr(decode_ops, "native", lambda: None)  # without the module: the mask is built
    assert_close(np.array(cpu_attention(q, k, v, Causal(offset, length))), np.array(as_mask), SOFTMAX_ULPS,
                 "attention with Causal, no native module")
    with pytest.raises(ValueError, match="causal rows"):
        kernel.softmax(mx.array(scores), 4, offset)  # 15 rows are not (heads, 4 positions)


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 128), (8, 64)])
def test_unpacking_equals_mlx_on_every_path(kernel, bits, group):
    """The native unpacking a prompt's chunk multiplies with (MLX's CPU dequantize is ~9x
    slower) against MLX's own, every path; weights read through a strided view; a
    scale off in one group is the negative control."""
    w, scales, biases = weights(37, 384, bits, group)
    want = np.array(mx.dequantize(w, scales, biases, group_size=group, bits=bits))
    for name in kernel.paths():
        kernel.set_kernel(name)
        got = np.array(kernel.dequantize(w, scales, biases, group, bits))
        assert_close(got, want, FEW_OPS_ULPS, what=f"unpacked {name} {bits}-bit")
    every_other = (w[::2], scales[::2], biases[::2])
    assert_close(np.array(kernel.dequantize(*every_other, group, bits)), want[::2], FEW_OPS_ULPS, "strided weights")
    off = mx.array(np.where(np.arange(scales.size).reshape(scales.shape) == 5, 1.01, 1.0).astype(np.float32)) * scales
    assert excess(np.array(kernel.dequantize(w, off, biases, group, bits)), want, FEW_OPS_ULPS, "one scale off") > 10


def test_swiglu_equals_float64_on_every_path(kernel):
    """silu(gate) * x, the MLP activation, against float64 on every path, with gates far
    out on both sides (e^-gate overflows float32 below -88: the result must be ~0, not
    NaN); the engine's swiglu takes it; gates 1% off are the negative control."""
    from engine.backends.decode_ops import swiglu

    rng = np.random.default_rng(2)
    gate = rng.normal(0, 6, (7, 133)).astype(np.float32)
    gate[0, :6] = [-1000.0, -100.0, -88.5, 88.5, 100.0, 1000.0]
    x = rng.normal(0, 1, gate.shape).astype(np.float32)
    g64 = gate.astype(np.float64)
    with np.errstate(over="ignore"):
        want = g64 / (1 + np.exp(-g64)) * x
    for name in kernel.paths():
        kernel.set_kernel(name)
        got = np.array(kernel.swiglu(mx.array(gate), mx.array(x)))
        assert np.isfinite(got).all()
        assert_close(got, want, FEW_OPS_ULPS, what=f"swiglu {name}")
    assert_close(np.array(swiglu(mx.array(gate), mx.array(x))), want, FEW_OPS_ULPS, "engine swiglu")
    off = np.array(kernel.swiglu(mx.array(gate * 1.01), mx.array(x)))
    assert excess(off, want, FEW_OPS_ULPS, "swiglu, gates 1% off") > 10
    with pytest.raises(ValueError, match="one shape"):
        kernel.swiglu(mx.array(gate), mx.array(x[:, :5]))


def attention64(q, k, v, allowed) -> np.ndarray:
    """float64 attention: q [B, H, L, D], k and v [B, H_kv, T, D], allowed [B, H, L, T]."""
    q, k, v = (np.array(a, dtype=np.float64) for a in (q, k, v))
    group = q.shape[1] // k.shape[1]
    scores = q @ np.repeat(k, group, axis=1).swapaxes(-1, -2)
    return softmax64(np.where(allowed, scores, -np.inf)) @ np.repeat(v, group, axis=1)


@pytest.mark.parametrize("batch,heads,kv_heads,length,keys", [(1, 9, 3, 1, 300), (1, 9, 3, 4, 37), (3, 4, 2, 2, 17),
                                                               (2, 4, 4, 1, 5), (8, 9, 3, 2, 300)])
def test_attention_equals_float64_on_every_path(kernel, batch, heads, kv_heads, length, keys):
    """The native attention of a decode step, a verify window and a batch of rows (the last
    case large enough to be split over the helper threads), over keys and values read in
    place from a longer cache buffer (a strided view), causal or with a batch's mask
    ([B, 1, G * L, T], or one [G * L, T] for every row). Negative controls: the window read
    as if unmasked, and half of a row's mask flipped."""
    rng = np.random.default_rng(batch * 100 + keys)
    q = mx.array(rng.normal(0, 0.3, (batch, heads, length, 64)).astype(np.float32))
    k_buffer, v_buffer = (mx.array(rng.normal(0, 1, (batch, kv_heads, keys + 40, 64)).astype(np.float32))
                          for _ in range(2))
    k, v = k_buffer[:, :, :keys], v_buffer[:, :, :keys]
    causal = np.tril(np.ones((length, keys), bool), keys - length)
    group = heads // kv_heads
    allowed = rng.random((batch, 1, length, keys)) > 0.3
    allowed[..., 0] = True
    batch_mask = mx.array(np.tile(allowed, (1, 1, group, 1)))  # rows: head of the group, then position
    shared_mask = mx.array(np.tile(allowed[0, 0], (group, 1)))
    want_causal = attention64(q, k, v, np.broadcast_to(causal, (batch, heads, length, keys)))
    want_masked = attention64(q, k, v, np.broadcast_to(allowed, (batch, heads, length, keys)))
    want_shared = attention64(q, k, v, np.broadcast_to(allowed[0, 0], (batch, heads, length, keys)))
    for name in kernel.paths():
        kernel.set_kernel(name)
        where = f"B {batch}, H {heads}/{kv_heads}, L {length}, T {keys}"
        assert_close(np.array(kernel.attention(q, k, v, causal=True)), want_causal, DOT_ULPS,
                     f"attention {name}, causal", where)
        assert_close(np.array(kernel.attention(q, k, v, batch_mask)), want_masked, DOT_ULPS,
                     f"attention {name}, batch mask", where)
        assert_close(np.array(kernel.attention(q, k, v, shared_mask)), want_shared, DOT_ULPS,
                     f"attention {name}, shared mask", where)
    if length > 1:
        assert excess(np.array(kernel.attention(q, k, v)), want_causal, DOT_ULPS, "attention, window unmasked") > 10
    flipped = np.array(batch_mask)
    flipped[..., 0, 1: keys // 2 + 1] = ~flipped[..., 0, 1: keys // 2 + 1]
    assert excess(np.array(kernel.attention(q, k, v, mx.array(flipped))), want_masked, DOT_ULPS,
                  "attention, half the mask of a row flipped") > 10


def test_a_long_cache_is_attended_in_chunks(kernel):
    """Over ATTENTION_CHUNK (512) keys the attention is computed chunk by chunk (split over
    the helper threads) and the chunks merged: the same as float64 on every path, bit for
    bit on 1 to 3 threads, with a row whose whole first chunks are masked (a short row's
    left padding in a batch beside a long one). Negative control: the merge's weights left
    out (each chunk's softmax averaged)."""
    rng = np.random.default_rng(3)
    batch, heads, kv_heads, keys = 2, 4, 2, 1300
    q = mx.array(rng.normal(0, 0.3, (batch, heads, 1, 64)).astype(np.float32))
    k, v = (mx.array(rng.normal(0, 1, (batch, kv_heads, keys, 64)).astype(np.float32)) for _ in range(2))
    allowed = np.ones((batch, 1, 1, keys), bool)
    allowed[1, ..., :1100] = False  # row 1 reads its last 200 keys only: chunks 0 and 1 wholly masked
    mask = mx.array(np.tile(allowed, (1, 1, heads // kv_heads, 1)))
    want = attention64(q, k, v, np.broadcast_to(allowed, (batch, heads, 1, keys)))
    for name in kernel.paths():
        kernel.set_kernel(name)
        assert_close(np.array(kernel.attention(q, k, v, mask)), want, DOT_ULPS, f"attention in chunks, {name}")
    threads = kernel.threads()
    try:
        results = []
        for n in (1, 2, 3):
            kernel.set_threads(n)
            results.append(np.array(kernel.attention(q, k, v, mask)))
    finally:
        kernel.set_threads(threads)
    for other in results[1:]:
        np.testing.assert_array_equal(results[0], other)
    chunks = [slice(0, 512), slice(512, 1024), slice(1024, keys)]
    averaged = np.mean([attention64(q, k[:, :, part], v[:, :, part], np.ones((batch, heads, 1, part.stop - part.start), bool))
                        for part in chunks], axis=0)
    assert excess(results[0][:1], averaged[:1], DOT_ULPS, "chunks averaged, not merged") > 10


@pytest.mark.parametrize("rows,n,k", [(3, 49152, 512), (2, 600, 600), (4, 1000, 1), (2, 7, 3)])
def test_top_values_are_the_values_of_mx_topk(kernel, rows, n, k):
    """The k largest of each row, as a multiset (neither returns them in order): rows with
    negatives, ties across the k-th value, zeros and -inf, and probability rows as top-p
    reads them. Negative control: the row's largest value lowered changes the answer."""
    rng = np.random.default_rng(n + k)
    x = rng.normal(0, 3, (rows, n)).astype(np.float32)
    x[0, : n // 4] = 0.0
    x[0, -1] = -np.inf
    x[-1, 1 : min(n, 600)] = x[-1, 0]  # a tie that spans the k-th value
    probs = np.array(mx.softmax(mx.array(x[:, ::-1] / 0.6), axis=-1))
    for values in (x, probs):
        got = np.sort(np.array(kernel.top_values(mx.array(values), k)), axis=-1)
        want = np.sort(np.array(mx.topk(mx.array(values), k, axis=-1)), axis=-1)
        np.testing.assert_array_equal(got, want)
    lowered = x.copy()
    lowered[0, np.argmax(lowered[0])] = np.float32(-1e30)
    got = np.sort(np.array(kernel.top_values(mx.array(lowered), k)), axis=-1)
    assert not np.array_equal(got, np.sort(np.array(mx.topk(mx.array(x), k, axis=-1)), axis=-1))


def test_sampling_takes_the_native_top_values(kernel):
    from engine.sampling import top_values

    graph = io.StringIO()
    mx.export_to_dot(graph, top_values(mx.random.normal((2, 100)), 10))
    assert '"TopValues"' in graph.getvalue()
    with pytest.raises(ValueError, match="k must be"):
        kernel.top_values(mx.zeros((2, 5)), 6)
    with pytest.raises(ValueError, match="float32"):
        kernel.top_values(mx.zeros((2, 5), dtype=mx.float16), 2)


def test_the_engine_attention_takes_the_native_one(kernel, monkeypatch):
    """cpu_attention runs a step of up to NATIVE_MAX_POSITIONS positions in the native
    operation (one node in the graph) and gives what MLX's operations give; a prompt's
    chunk stays with them."""
    from engine.backends import decode_ops
    from engine.backends.decode_ops import Causal, cpu_attention

    q = mx.random.normal((1, 6, 3, 32), key=mx.random.key(7))
    k, v = (mx.random.normal((1, 2, 20, 32), key=mx.random.key(s)) for s in (8, 9))
    mx.eval(q, k, v)

    def operations(out: mx.array) -> list[str]:
        graph = io.StringIO()
        mx.export_to_dot(graph, out)
        return [line.split('"')[1] for line in graph.getvalue().splitlines() if "label =" in line]

    native = cpu_attention(q, k, v, Causal(17, 3))
    assert operations(native) == ["Attention"]
    monkeypatch.setattr(decode_ops, "NATIVE_MAX_POSITIONS", 2)  # 3 positions: MLX's operations
    library = cpu_attention(q, k, v, Causal(17, 3))
    assert "Matmul" in operations(library)
    assert_close(np.array(native), np.array(library), DOT_ULPS, "native against MLX's operations")


def test_attention_refuses_what_it_does_not_take(kernel):
    q = mx.zeros((1, 4, 2, 8))
    k = mx.zeros((1, 3, 5, 8))
    with pytest.raises(ValueError, match="kv_heads dividing"):
        kernel.attention(q, k, k)
    k = mx.zeros((1, 2, 5, 8))
    assert kernel.attention(q, k, k, mx.ones((4, 5), dtype=mx.bool_)).shape == q.shape  # 2 heads a kv head x 2 positions
    with pytest.raises(ValueError, match="mask must be bool"):
        kernel.attention(q, k, k, mx.ones((3, 5), dtype=mx.bool_))
    with pytest.raises(ValueError, match="not both"):
        kernel.attention(q, k, k, mx.ones((4, 5), dtype=mx.bool_), causal=True)
    with pytest.raises(ValueError, match="float32"):
        kernel.attention(q.astype(mx.float16), k, k)


def test_a_build_from_an_older_source_is_not_used(kernel, monkeypatch, caplog):
    """A module without an operation the engine calls (built before it was added, and
    `make install` not rerun) is refused with the reason, and the engine runs without it."""
    monkeypatch.setattr(quantized_rows, "OPERATIONS", (*quantized_rows.OPERATIONS, "an_operation_not_built"))
    quantized_rows.built.cache_clear()
    try:
        assert quantized_rows.native() is None
        assert "lacks an_operation_not_built: run `make install`" in caplog.text
    finally:
        monkeypatch.undo()
        quantized_rows.built.cache_clear()
    assert quantized_rows.native() is not None


def test_a_gpu_keeps_mlx_own_kernels(kernel, monkeypatch):
    """Where the engine's arrays live on a GPU (Metal, CUDA: MLX's default device), the
    extension's CPU-only operations are never chosen, and weights load as stored."""
    from engine.engine import default_dtype

    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    assert quantized_rows.native() is None
    assert quantized_rows.describe() == "MLX's own kernels on Device(gpu, 0)"
    assert default_dtype() is None
    monkeypatch.undo()  # the negative control: the CPU takes the extension
    assert quantized_rows.native() is kernel
    assert default_dtype() == mx.float32


def test_the_harness_builds_and_measures(tmp_path):
    """scripts/quantized_rows_harness.cpp (the kernel alone, for docs/performance.md) still
    compiles against the kernel's source and runs every row count."""
    import shutil
    import subprocess
    from pathlib import Path

    compiler = shutil.which("c++")
    assert compiler is not None, "no C++ compiler: `make install` needs one for the native module"
    script = Path(__file__).resolve().parent.parent / "scripts" / "quantized_rows_harness.cpp"
    binary = tmp_path / "harness"
    subprocess.run([compiler, "-O1", "-std=c++17", "-o", str(binary), str(script), "-lpthread"], check=True)
    lines = subprocess.run([str(binary), "4", "64", "256"], check=True, capture_output=True, text=True).stdout.splitlines()
    assert len(lines) == 6
    for rows, line in zip((1, 2, 4, 8, 16, 32), lines):
        assert line.startswith(f"4-bit 64 x 256, {rows} rows: ") and "GMAC/s" in line, line
