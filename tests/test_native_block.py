"""A Llama-style decoder block as the native module's two operations (block_in, block_out in
engine/native/quantized_rows.cpp; NativeBlock in engine/backends/decode_ops.py): on every
path this CPU has, at 4 and 8 bits, with and without biases, for a token, a verify window
and a batch of rows, against float64 of the dequantized weights; bit for bit on 1 to 3
threads; their refusals; and the engine's steps through them, against the same steps in
MLX's operations. Negative controls: the rotation turned the other way, gate and up swapped,
the residual left out. The whole block's step with its KV cache (block_step) against the
two halves around mlx-lm's cache update and the attention, bit for bit, its cache written
in place only where nothing else holds it; so too for a batch's rows, each at its own position
(mlx-lm's BatchKVCache, left-padded, masked)."""

from __future__ import annotations

import io

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama, qwen3
from mlx_lm.models.cache import BatchKVCache, KVCache

from engine import quantized_rows
from engine.backends import decode_ops
from engine.backends.decode_ops import Causal, NativeBlock, RopeTable, cpu_attention
from engine.backends.mimo import attention_inputs, block_output
from tests.engine_helpers import restore_kernel
from tests.floats import DOT_ULPS, PATHS_ULPS, assert_close, excess

pytestmark = pytest.mark.skipif(quantized_rows.native() is None, reason="no decode kernel built (macOS: Metal's own kernels)")

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP = 128, 4, 2, 32, 256


@pytest.fixture
def kernel():
    yield quantized_rows.native()
    restore_kernel()


def packed_block(bits: int, group: int, bias: bool, seed: int = 0) -> nn.Module:
    """A random Llama block, its linear layers packed and kept for the kernel."""
    args = llama.ModelArgs(model_type="llama", hidden_size=HIDDEN, num_hidden_layers=1, intermediate_size=MLP,
                           num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rms_norm_eps=1e-5,
                           vocab_size=64, attention_bias=bias, mlp_bias=bias)
    mx.random.seed(seed)
    block = llama.TransformerBlock(args)
    # Norm weights and biases away from their initial ones and zeros, so that each counts.
    block.update({"input_layernorm": {"weight": mx.random.uniform(0.5, 1.5, (HIDDEN,))},
                  "post_attention_layernorm": {"weight": mx.random.uniform(0.5, 1.5, (HIDDEN,))}})
    nn.quantize(block, group_size=group, bits=bits)
    if bias:
        for _, layer in block.named_modules():
            if isinstance(layer, nn.QuantizedLinear):
                layer.bias = mx.random.normal(layer.bias.shape) * 0.1
    assert quantized_rows.keep_packed(block) == 7
    mx.eval(block.parameters())
    return block


def linear64(layer: nn.Module, x: np.ndarray) -> np.ndarray:
    w = np.array(mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=layer.group_size,
                               bits=layer.bits), dtype=np.float64)
    y = x @ w.T
    return y + np.array(layer.bias, dtype=np.float64) if "bias" in layer else y


def norm64(x: np.ndarray, norm: nn.Module) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + norm.eps) * np.array(norm.weight, dtype=np.float64)


def heads64(rows: np.ndarray, batch: int, heads: int) -> np.ndarray:
    return rows.reshape(batch, -1, heads, HEAD_DIM).transpose(0, 2, 1, 3)


def rope64(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, turn: float = 1.0) -> np.ndarray:
    """x [B, H, L, D]; cos, sin [B, 1, L, D] (turn -1: the rotation the other way)."""
    half = HEAD_DIM // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + turn * rotated * sin


def block_in64(block, x, cos, sin, batch, turn=1.0, head_norms=True):
    attn = block.self_attn
    h = norm64(np.array(x, dtype=np.float64), block.input_layernorm)
    q, k, v = (heads64(linear64(layer, h), batch, n) for layer, n in
               ((attn.q_proj, HEADS), (attn.k_proj, KV_HEADS), (attn.v_proj, KV_HEADS)))
    if head_norms and "q_norm" in attn:  # Qwen3: each head of q and k normed before the rotary
        q, k = norm64(q, attn.q_norm), norm64(k, attn.k_norm)
    return rope64(q, cos, sin, turn) * attn.scale, rope64(k, cos, sin, turn), v


def block_out64(block, x, attended, swapped=False, residual=True):
    mlp = block.mlp
    x = np.array(x, dtype=np.float64)
    joined = np.array(attended, dtype=np.float64).transpose(0, 2, 1, 3).reshape(x.shape[0], -1)
    h = x + linear64(block.self_attn.o_proj, joined)
    n = norm64(h, block.post_attention_layernorm)
    gate, up = linear64(mlp.gate_proj, n), linear64(mlp.up_proj, n)
    if swapped:
        gate, up = up, gate
    out = linear64(mlp.down_proj, gate / (1 + np.exp(-gate)) * up)
    return h + out if residual else out


def rotary(batch: int, length: int, per_row: bool) -> tuple[mx.array, mx.array, np.ndarray, np.ndarray]:
    """The step's cos and sin as the engine passes them ([L, D], or [B, 1, L, D] with each row
    at its own position), and as float64 [B, 1, L, D]."""
    table = RopeTable(nn.RoPE(HEAD_DIM, base=10000), HEAD_DIM)
    if per_row:
        cos, sin = table.rows(mx.array([5 + 7 * b for b in range(batch)]), length, 5 + 7 * batch)
    else:
        cos, sin = table.slices(9, length)
    wide = [np.broadcast_to(np.array(t, dtype=np.float64).reshape(-1, 1, length, HEAD_DIM), (batch, 1, length, HEAD_DIM))
            for t in (cos, sin)]
    return cos, sin, wide[0], wide[1]


@pytest.mark.parametrize("bits,group,bias", [(4, 32, False), (4, 64, True), (8, 32, True)])
@pytest.mark.parametrize("batch,length,per_row", [(1, 1, False), (1, 4, False), (3, 2, True)])
def test_block_halves_equal_float64_on_every_path(kernel, bits, group, bias, batch, length, per_row):
    block = packed_block(bits, group, bias)
    native = NativeBlock.of(block)
    assert native is not None
    x = mx.random.normal((batch * length, HIDDEN), key=mx.random.key(1))
    attended = mx.random.normal((batch, HEADS, length, HEAD_DIM), key=mx.random.key(2))
    cos, sin, cos64, sin64 = rotary(batch, length, per_row)
    want_in = block_in64(block, x, cos64, sin64, batch)
    want_out = block_out64(block, x, attended)
    where = f"{bits}-bit, group {group}, bias {bias}, B {batch}, L {length}"
    for name in kernel.paths():
        kernel.set_kernel(name)
        for got, want, what in zip(native.inputs(x, cos, sin, length), want_in, "qkv", strict=True):
            assert got.shape == want.shape
            assert_close(np.array(got), want, DOT_ULPS, f"block_in {what}, {name}", where)
        assert_close(np.array(native.output(x, attended)), want_out, DOT_ULPS, f"block_out, {name}", where)
    q, k, _ = native.inputs(x, cos, sin, length)
    turned = block_in64(block, x, cos64, sin64, batch, turn=-1.0)
    assert excess(np.array(q), turned[0], DOT_ULPS, "q rotated the other way") > 10
    assert excess(np.array(k), turned[1], DOT_ULPS, "k rotated the other way") > 10
    got = np.array(native.output(x, attended))
    assert excess(got, block_out64(block, x, attended, swapped=True), DOT_ULPS, "gate and up swapped") > 10
    assert excess(got, block_out64(block, x, attended, residual=False), DOT_ULPS, "no residual") > 10


def packed_qwen3_block(seed: int = 0) -> nn.Module:
    """A random Qwen3 block (per-head RMSNorms of q and k, head_dim set apart from the width),
    packed as `packed_block`'s, its head norms' weights away from 1."""
    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=HIDDEN, num_hidden_layers=1, intermediate_size=MLP,
                           num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rms_norm_eps=1e-6, vocab_size=64,
                           head_dim=HEAD_DIM, max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=True)
    mx.random.seed(seed)
    block = qwen3.TransformerBlock(args)
    block.update({name: {"weight": mx.random.uniform(0.5, 1.5, (size,))} for name, size in
                  (("input_layernorm", HIDDEN), ("post_attention_layernorm", HIDDEN))})
    block.self_attn.update({name: {"weight": mx.random.uniform(0.5, 1.5, (HEAD_DIM,))} for name in ("q_norm", "k_norm")})
    nn.quantize(block, group_size=32, bits=4)
    assert quantized_rows.keep_packed(block) == 7
    mx.eval(block.parameters())
    return block


@pytest.mark.parametrize("batch,length,per_row", [(1, 1, False), (3, 2, True)])
def test_qwen3s_head_norms_in_block_in_equal_float64_on_every_path(kernel, batch, length, per_row):
    block = packed_qwen3_block()
    native = NativeBlock.of(block)
    assert native is not None
    x = mx.random.normal((batch * length, HIDDEN), key=mx.random.key(1))
    cos, sin, cos64, sin64 = rotary(batch, length, per_row)
    want = block_in64(block, x, cos64, sin64, batch)
    for name in kernel.paths():
        kernel.set_kernel(name)
        for got, wanted, what in zip(native.inputs(x, cos, sin, length), want, "qkv", strict=True):
            assert_close(np.array(got), wanted, DOT_ULPS, f"qwen3 block_in {what}, {name}", f"B {batch}, L {length}")
    q, k, _ = native.inputs(x, cos, sin, length)
    bare = block_in64(block, x, cos64, sin64, batch, head_norms=False)
    assert excess(np.array(q), bare[0], DOT_ULPS, "q without its head norm") > 10
    assert excess(np.array(k), bare[1], DOT_ULPS, "k without its head norm") > 10


def test_helper_threads_change_nothing_in_a_block(kernel):
    """The products of a block are split over the helper threads by weight rows (q, k and v
    together, gate and up together): each output still computed by one thread, bit for bit.
    16 rows: every product of this block but o is large enough to be split."""
    block = packed_block(4, 32, True)
    native = NativeBlock.of(block)
    x = mx.random.normal((16, HIDDEN), key=mx.random.key(3))
    attended = mx.random.normal((16, HEADS, 1, HEAD_DIM), key=mx.random.key(4))
    cos, sin, _, _ = rotary(16, 1, True)
    threads = kernel.threads()
    results = []
    try:
        for n in (1, 2, 3):
            kernel.set_threads(n)
            results.append([np.array(a) for a in (*native.inputs(x, cos, sin, 1), native.output(x, attended))])
    finally:
        kernel.set_threads(threads)
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            np.testing.assert_array_equal(a, b)


def test_block_operations_refuse_what_they_do_not_take(kernel):
    block = packed_block(4, 32, False)
    native = NativeBlock.of(block)
    norm = block.input_layernorm
    x = mx.zeros((2, HIDDEN))
    cos, sin = mx.zeros((2, HEAD_DIM)), mx.zeros((2, HEAD_DIM))
    weights = decode_ops._weights(native.into)
    with pytest.raises(ValueError, match="layouts must be"):
        kernel.block_in(x, norm.weight, 1e-5, weights, native.layouts_in[:-3], cos, sin, HEADS, KV_HEADS, 2, 1.0)
    with pytest.raises(ValueError, match="more weights"):
        kernel.block_in(x, norm.weight, 1e-5, weights + [weights[0]], native.layouts_in, cos, sin, HEADS, KV_HEADS, 2, 1.0)
    with pytest.raises(ValueError, match="take the rows' width"):
        kernel.block_in(mx.zeros((2, 96)), norm.weight, 1e-5, weights, native.layouts_in, cos, sin, HEADS, KV_HEADS, 2, 1.0)
    with pytest.raises(ValueError, match="kv_heads x head_dim"):
        kernel.block_in(x, norm.weight, 1e-5, weights, native.layouts_in, cos, sin, HEADS, 1, 2, 1.0)
    with pytest.raises(ValueError, match="cos and sin"):
        kernel.block_in(x, norm.weight, 1e-5, weights, native.layouts_in, cos[:, :8], sin, HEADS, KV_HEADS, 2, 1.0)
    with pytest.raises(ValueError, match="none, or q's and k's"):
        kernel.block_in(x, norm.weight, 1e-5, weights, native.layouts_in, cos, sin, HEADS, KV_HEADS, 2, 1.0,
                        [mx.ones((HEAD_DIM,))], 1e-6)
    with pytest.raises(ValueError, match=r"head norm must be float32 \[head_dim\]"):
        kernel.block_in(x, norm.weight, 1e-5, weights, native.layouts_in, cos, sin, HEADS, KV_HEADS, 2, 1.0,
                        [mx.ones((HEAD_DIM,)), mx.ones((HEAD_DIM + 1,))], 1e-6)
    with pytest.raises(ValueError, match="attended must be"):
        native.output(x, mx.zeros((1, HEADS, 3, HEAD_DIM)))
    with pytest.raises(ValueError, match="scales and biases must be float32"):
        bad = [w.astype(mx.float16) if i == 1 else w for i, w in enumerate(weights)]
        kernel.block_in(x, norm.weight, 1e-5, bad, native.layouts_in, cos, sin, HEADS, KV_HEADS, 2, 1.0)


def test_blocks_the_operations_do_not_take_stay_with_mlx(kernel):
    """Layers not kept packed, a norm of q alone, another norm: MLX's operations."""
    assert NativeBlock.of(packed_block(4, 32, False)) is not None
    args = llama.ModelArgs(model_type="llama", hidden_size=HIDDEN, num_hidden_layers=1, intermediate_size=MLP,
                           num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rms_norm_eps=1e-5, vocab_size=64)
    assert NativeBlock.of(llama.TransformerBlock(args)) is None  # float layers
    with_norms = packed_block(4, 32, False)
    with_norms.self_attn.q_norm = nn.RMSNorm(HEAD_DIM)
    assert NativeBlock.of(with_norms) is None
    layer_norm = packed_block(4, 32, False)
    layer_norm.input_layernorm = nn.LayerNorm(HIDDEN)
    assert NativeBlock.of(layer_norm) is None


def halves_step(native: NativeBlock, rows: mx.array, cos: mx.array, sin: mx.array, cache: KVCache) -> mx.array:
    """A block's step as the engine took it before block_step: the two halves around mlx-lm's
    cache update and cpu_attention."""
    length = cos.shape[0]
    q, k, v = native.inputs(rows, cos, sin, length)
    k, v = cache.update_and_fetch(k, v)
    return native.output(rows, cpu_attention(q, k, v, Causal(cache.offset - length, length) if length > 1 else None))


def buffer_address(a: mx.array) -> int:
    view = np.asarray(memoryview(a))
    return view.__array_interface__["data"][0]


@pytest.mark.parametrize("make", [lambda: packed_block(4, 32, False), lambda: packed_block(8, 32, True), packed_qwen3_block],
                         ids=["4-bit", "8-bit with biases", "qwen3 head norms"])
@pytest.mark.parametrize("batch", [1, 2])
def test_a_blocks_step_equals_its_halves_bit_for_bit(kernel, make, batch):
    """Steps of 5, 1, 3 and 1 positions (a short prompt, a token, a verify window, a token)
    through block_step and through the halves, each with its own cache, on every path: the rows
    and the cached keys and values are the same bits, across the cache's growth (step 4)."""
    native = NativeBlock.of(make())
    assert native is not None
    table = RopeTable(nn.RoPE(HEAD_DIM, base=10000), HEAD_DIM)
    for name in kernel.paths():
        kernel.set_kernel(name)
        fused, halves = KVCache(), KVCache()
        fused.step = halves.step = 4
        for i, length in enumerate((5, 1, 3, 1)):
            rows = mx.random.normal((batch * length, HIDDEN), key=mx.random.key(10 + i))
            cos, sin = table.slices(fused.offset, length)
            got = native.step(rows, cos, sin, fused)
            assert got is not None
            want = halves_step(native, rows, cos, sin, halves)
            np.testing.assert_array_equal(np.array(got), np.array(want), f"{name}, step {i} of {length}")
        assert fused.offset == halves.offset == 10
        for got, want in zip(fused.state, halves.state, strict=True):
            np.testing.assert_array_equal(np.array(got), np.array(want), f"{name}: the cached keys and values")
    # Negative control: the same step over a cache one position short.
    rows = mx.random.normal((batch, HIDDEN), key=mx.random.key(20))
    cos, sin = table.slices(fused.offset, 1)
    halves.trim(1)
    got, short = native.step(rows, cos, sin, fused), halves_step(native, rows, cos, sin, halves)
    assert np.abs(np.array(got) - np.array(short)).max() > 1e-3


def batch_step_inputs(table: RopeTable, cache: BatchKVCache, length: int) -> tuple[mx.array, mx.array, mx.array]:
    """cos, sin and the grouped mask of a batch's step, as the MiMo backend builds them."""
    cos, sin = table.rows(cache.offset, length, cache._idx)
    mask = cache.make_mask(length, return_array=True)  # [B, 1, L, T]: the left padding and causality
    return cos, sin, mx.tile(mask, (1, 1, HEADS // KV_HEADS, 1))


def halves_batch_step(native: NativeBlock, rows: mx.array, cos: mx.array, sin: mx.array, cache: BatchKVCache,
                      mask: mx.array) -> mx.array:
    q, k, v = native.inputs(rows, cos, sin, cos.shape[-2])
    k, v = cache.update_and_fetch(k, v)
    return native.output(rows, cpu_attention(q, k, v, mask))


@pytest.mark.parametrize("make", [lambda: packed_block(4, 32, False), packed_qwen3_block], ids=["4-bit", "qwen3 head norms"])
def test_a_batchs_step_equals_its_halves_bit_for_bit(kernel, make):
    """Three rows left-padded by 2, 0 and 1 (mlx-lm's BatchKVCache: each row at its own rotary
    position, its padding masked), in steps of 4, 1, 3 and 1 positions: block_step and the
    halves give the same bits, rows and cache alike, across the cache's growth. Negative
    control: the mask without the padding's columns masked."""
    native = NativeBlock.of(make())
    assert native is not None
    table = RopeTable(nn.RoPE(HEAD_DIM, base=10000), HEAD_DIM)
    for name in kernel.paths():
        kernel.set_kernel(name)
        fused, halves = BatchKVCache([2, 0, 1]), BatchKVCache([2, 0, 1])
        fused.step = halves.step = 4
        for i, length in enumerate((4, 1, 3, 1)):
            rows = mx.random.normal((3 * length, HIDDEN), key=mx.random.key(30 + i))
            cos, sin, mask = batch_step_inputs(table, fused, length)
            got = native.step(rows, cos, sin, fused, mask)
            assert got is not None
            want = halves_batch_step(native, rows, cos, sin, halves, mask)
            np.testing.assert_array_equal(np.array(got), np.array(want), f"{name}, step {i} of {length}")
        assert fused._idx == halves._idx == 9 and np.array(fused.offset).tolist() == [7, 9, 8]
        for got, want in zip(fused.state, halves.state, strict=True):
            np.testing.assert_array_equal(np.array(got), np.array(want), f"{name}: the cache's state")
    rows = mx.random.normal((3, HIDDEN), key=mx.random.key(40))
    cos, sin, mask = batch_step_inputs(table, fused, 1)
    got = native.step(rows, cos, sin, fused, mask)
    unpadded = native.step(rows, cos, sin, halves, mx.ones_like(mask))
    assert np.abs(np.array(got[0]) - np.array(unpadded[0])).max() > 1e-3  # row 0 reads its padding otherwise
    np.testing.assert_array_equal(np.array(got[1]), np.array(unpadded[1]))  # row 1 has none


def test_a_blocks_step_writes_its_cache_in_place_only_where_nothing_else_holds_it(kernel):
    native = NativeBlock.of(packed_block(4, 32, False))
    table = RopeTable(nn.RoPE(HEAD_DIM, base=10000), HEAD_DIM)
    cache = KVCache()

    def step(length: int) -> None:
        rows = mx.random.normal((length, HIDDEN), key=mx.random.key(cache.offset))
        mx.eval(native.step(rows, *table.slices(cache.offset, length), cache), cache.keys, cache.values)

    step(5)
    before = buffer_address(cache.keys), buffer_address(cache.values)
    step(1)
    assert (buffer_address(cache.keys), buffer_address(cache.values)) == before  # donated: written in place
    held = cache.keys
    snapshot = np.array(held)
    step(1)
    assert buffer_address(cache.keys) != buffer_address(held)  # held elsewhere: the step wrote a copy
    np.testing.assert_array_equal(np.array(held), snapshot)
    np.testing.assert_array_equal(np.array(cache.keys)[:, :, :6], snapshot[:, :, :6])
    assert np.abs(np.array(cache.keys)[:, :, 6]).max() > 0  # the new position, written into the copy


def test_a_blocks_step_refuses_what_it_does_not_take(kernel):
    native = NativeBlock.of(packed_block(4, 32, False))
    cos, sin = RopeTable(nn.RoPE(HEAD_DIM, base=10000), HEAD_DIM).slices(0, 2)
    x = mx.zeros((2, HIDDEN))
    room = mx.zeros((1, KV_HEADS, 8, HEAD_DIM))
    arrays = [native.norms[0].weight, *decode_ops._weights(native.into), native.norms[1].weight,
              *decode_ops._weights(native.out)]
    assert len(kernel.block_step(x, cos, sin, 0, native.plan, arrays, room, room)) == 3
    with pytest.raises(ValueError, match="its plan takes"):
        kernel.block_step(x, cos, sin, 0, native.plan, arrays[:-1], room, room)
    with pytest.raises(ValueError, match="room for the step"):
        kernel.block_step(x, cos, sin, 7, native.plan, arrays, room, room)
    with pytest.raises(ValueError, match="room for the step"):
        kernel.block_step(x, cos, sin, 0, native.plan, arrays, mx.zeros((1, 1, 8, HEAD_DIM)), room)
    with pytest.raises(ValueError, match="q, k and v must take"):
        kernel.block_step(mx.zeros((2, 96)), cos, sin, 0, native.plan, arrays, room, room)
    grouped = HEADS // KV_HEADS * 2
    assert len(kernel.block_step(x, cos, sin, 0, native.plan, arrays, room, room, mx.ones((1, 1, grouped, 2), mx.bool_))) == 3
    with pytest.raises(ValueError, match="the mask must be"):
        kernel.block_step(x, cos, sin, 0, native.plan, arrays, room, room, mx.ones((1, 1, grouped, 3), mx.bool_))
    with pytest.raises(ValueError, match="the mask must be"):
        kernel.block_step(x, cos, sin, 0, native.plan, arrays, room, room, mx.ones((1, 1, grouped, 2)))
    # A cache the operation does not write (quantized, another batch): the caller steps by halves.
    other = KVCache()
    other.keys = other.values = mx.zeros((3, KV_HEADS, 8, HEAD_DIM))
    assert native.step(x, cos, sin, other) is None
    batch = BatchKVCache([0])  # a batch's cache without its mask, or a mask of another length
    assert native.step(x, cos, sin, batch) is None
    assert native.step(x, cos, sin, batch, mx.ones((1, 1, grouped, 3), mx.bool_)) is None


def _operations(out: mx.array) -> list[str]:
    graph = io.StringIO()
    mx.export_to_dot(graph, out)
    return [line.split('"')[1] for line in graph.getvalue().splitlines() if "label =" in line]


def test_the_engine_steps_through_the_block_operations(kernel, tmp_path, monkeypatch):
    """A MiMo checkpoint kept packed: its decode steps, verify windows and heads run each
    block as one block_step, with the bits of the two halves around the cache's update, and
    give the logits MLX's operations give on the same packed weights; a prompt's chunk of
    more than ROWS_MAX rows stays with MLX's."""
    from engine.conversion import QuantSpec, convert_checkpoint
    from engine.engine import Engine
    from tests.checkpoints import write

    out = convert_checkpoint(write("mimo", tmp_path / "src", mtp_heads=2), tmp_path / "out", QuantSpec(4, 32)).out
    backend = Engine.load(out).backend
    prompt = mx.array([[(3 + 7 * i) % 60 for i in range(90)]])

    def steps() -> list[mx.array]:
        cache, head_cache = backend.make_cache(), backend.make_head_caches()[0]
        logits, hidden = backend.forward(prompt, cache)
        window, window_hidden = backend.forward(mx.array([[5, 9, 11]]), cache)
        draft, _ = backend.head(0, window_hidden, mx.array([[9, 11, 4]]), head_cache)
        mx.eval(logits, window, draft)
        return [logits, window, draft]

    def step_operations(tokens: mx.array) -> list[str]:
        with monkeypatch.context() as lazy:  # the whole step's graph, not the blocks after the last one started
            lazy.setattr(mx, "async_eval", lambda *arrays: None)
            return _operations(backend.forward(tokens, backend.make_cache())[0])

    native = steps()
    operations = step_operations(mx.array([[5]]))
    assert operations.count("BlockStep") == len(backend.trunk.model.layers)
    assert "BlockIn" not in operations and "SwiGLU" not in operations
    assert step_operations(mx.array([[5, 6, 7]])).count("BlockStep") == len(backend.trunk.model.layers)
    assert "BlockStep" not in step_operations(prompt)  # 90 rows: a prompt's chunk

    with monkeypatch.context() as halves:  # the two halves around the cache's update: the same bits
        halves.setattr(decode_ops.NativeBlock, "step", lambda *args: None)
        assert "BlockStep" not in step_operations(mx.array([[5]]))
        for got, want in zip(native, steps(), strict=True):
            np.testing.assert_array_equal(np.array(got), np.array(want))

    monkeypatch.setattr(decode_ops.NativeBlock, "of", staticmethod(lambda block: None))
    backend._native.clear()
    library = steps()
    assert "BlockIn" not in step_operations(mx.array([[5]]))
    for got, want, what in zip(native, library, ("prompt", "verify window", "draft"), strict=True):
        assert_close(np.array(got), np.array(want), PATHS_ULPS, f"{what}: block operations against MLX's")


def test_a_batchs_rows_step_through_the_block_operation(kernel, tmp_path, monkeypatch):
    """Two rows of a batch (prompts of 40 and 25 tokens, left-padded in a BatchKVCache as
    engine/batch.py merges them): a step and a verify window run each block as one
    block_step, with the bits of the two halves around the cache's update."""
    from engine.conversion import QuantSpec, convert_checkpoint
    from engine.engine import Engine
    from tests.checkpoints import write

    out = convert_checkpoint(write("mimo", tmp_path / "src", mtp_heads=1), tmp_path / "out", QuantSpec(4, 32)).out
    backend = Engine.load(out).backend
    layers = len(backend.trunk.model.layers)

    def batch_cache() -> list[BatchKVCache]:
        rows = []
        for length in (40, 25):
            cache = backend.make_cache()
            mx.eval(backend.forward(mx.array([[(3 + 7 * i) % 60 for i in range(length)]]), cache)[0])
            rows.append(cache)
        return [BatchKVCache.merge(list(layer)) for layer in zip(*rows, strict=True)]

    def steps() -> tuple[list[mx.array], list[str]]:
        cache = batch_cache()
        with monkeypatch.context() as lazy:  # the whole step's graph
            lazy.setattr(mx, "async_eval", lambda *arrays: None)
            token, _ = backend.forward(mx.array([[5], [6]]), cache)
            operations = _operations(token)
        window, _ = backend.forward(mx.array([[5, 9, 11], [6, 2, 8]]), cache)
        mx.eval(token, window)
        return [token, window], operations

    fused, operations = steps()
    assert operations.count("BlockStep") == layers and "BlockIn" not in operations
    with monkeypatch.context() as halves:
        halves.setattr(decode_ops.NativeBlock, "step", lambda *args: None)
        split, operations = steps()
        assert "BlockStep" not in operations and operations.count("BlockIn") == layers
    for got, want in zip(fused, split, strict=True):
        np.testing.assert_array_equal(np.array(got), np.array(want))


def test_the_compiled_mlx_halves_agree_with_the_operations(kernel):
    """The MLX half-block functions the operations replace (mimo.attention_inputs and
    block_output, still used on a GPU and where a block is not one the operations take)
    compute the same on the same packed weights."""
    block = packed_block(4, 32, True)
    native = NativeBlock.of(block)
    x = mx.random.normal((2, HIDDEN), key=mx.random.key(6))
    attended = mx.random.normal((1, HEADS, 2, HEAD_DIM), key=mx.random.key(7))
    cos, sin, _, _ = rotary(1, 2, False)
    for got, want in zip(native.inputs(x, cos, sin, 2), attention_inputs(block, x, cos, sin), strict=True):
        assert_close(np.array(got), np.array(want), DOT_ULPS, "block_in against MLX's operations")
    assert_close(np.array(native.output(x, attended)), np.array(block_output(block, x, attended)), DOT_ULPS,
                 "block_out against MLX's operations")

