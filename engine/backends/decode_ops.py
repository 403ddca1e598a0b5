"""Cheaper forms of three decode-step operations: rotary embedding from a table,
attention on the CPU (a few new positions in one native operation), and SwiGLU
without `exp`.

Rotary. On the CPU, `mx.fast.rope` is not a kernel but a dozen ops that recompute
the angles, cosines and sines on every call: ~190 us per tensor for one
token of the embedded model, twice per layer, a third of a decode step.
The cosines and sines of each position never change, so they are computed
once (grown by doubling as positions advance) and a step only slices them:

    rope(x)[p] = x * cos[p] + rotate_half(x) * sin[p]

The table is read off the model's own rope module by feeding it a probe
whose first half is ones and second half zeros: for the half-split pairing
(i, i + d/2) its output at position p is exactly (cos[p], sin[p]), scaling
variants (Llama-3, YaRN's magnitude factor) included, so no frequency
formula is duplicated here. Interleaved ("traditional") pairing is not
tabulated: `RopeTable.supports` says so and the caller keeps the module.
"""

from __future__ import annotations

# Being inside the engine package, engine/__init__ (the BLAS fix) has already run.
import math

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import BatchKVCache, KVCache

from engine.quantized_rows import RowsQuantizedLinear, native
from engine.sampling import softmax

FIRST_SIZE = 4096  # positions tabulated before the first doubling
# Steps of up to this many new positions attend in the native module's one operation;
# a prompt's chunk multiplies its scores with BLAS, which is faster for hundreds of rows.
NATIVE_MAX_POSITIONS = 16


class RopeTable:
    def __init__(self, rope: nn.Module, head_dim: int):
        self.rope = rope
        self.head_dim = head_dim
        self.cos = mx.zeros((0, head_dim))
        self.sin = mx.zeros((0, head_dim))

    @staticmethod
    def supports(rope: nn.Module) -> bool:
        return not getattr(rope, "traditional", True)

    def slices(self, offset: int, length: int) -> tuple[mx.array, mx.array]:
        """cos and sin [length, head_dim] for positions offset .. offset+length-1."""
        end = offset + length
        if end > self.cos.shape[0]:
            self._grow(end)
        return self.cos[offset:end], self.sin[offset:end]

    def rows(self, offsets: mx.array, length: int, bound: int) -> tuple[mx.array, mx.array]:
        """cos and sin [B, 1, length, head_dim] for rows each at its own position
        (offsets [B]; a batch of rows, engine/batch.py); `bound` >= every offset."""
        if bound + length > self.cos.shape[0]:
            self._grow(bound + length)
        positions = mx.maximum(offsets[:, None] + mx.arange(length), 0)  # a padded row reads position 0
        return self.cos[positions][:, None], self.sin[positions][:, None]

    def _grow(self, needed: int) -> None:
        size = max(FIRST_SIZE, self.cos.shape[0])
        while size < needed:
            size *= 2
        half = self.head_dim // 2
        probe = mx.concatenate([mx.ones((1, 1, size, half)), mx.zeros((1, 1, size, half))], axis=-1)
        out = self.rope(probe)[0, 0].astype(mx.float32)
        cos, sin = out[:, :half], out[:, half:]
        self.cos = mx.concatenate([cos, cos], axis=-1)
        self.sin = mx.concatenate([sin, sin], axis=-1)
        mx.eval(self.cos, self.sin)


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """x [B, heads, L, head_dim] rotated by the tabulated cos/sin [L, head_dim] (or
    [B, 1, L, head_dim], one position per row)."""
    half = x.shape[-1] // 2
    rotated = mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos + rotated * sin).astype(x.dtype)


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x, the SwiGLU of MLP blocks. MLX's CPU `exp` costs ~33 ns an element
    inside a compiled kernel: on the CPU the native module's (a vectorized exp), else
    power(e, -gate) (~13 ns; a 4-token window of a 480-wide MLP: ~40 us against ~80)."""
    module = native()
    if module is not None and gate.dtype == x.dtype == mx.float32 and gate.shape == x.shape:
        return module.swiglu(gate, x)
    return gate / (1 + mx.power(math.e, -gate)) * x


def grouped_mask(mask: mx.array | None, group: int) -> mx.array | None:
    """A causal mask [L, T] repeated for the `group` query heads that read each kv
    head, as cpu_attention takes it: built once a step rather than once a layer."""
    return None if mask is None else mx.tile(mask, (group, 1))


@dataclass(frozen=True)
class Causal:
    """The mask of `length` new positions after `offset` cached ones (query i reads keys
    0 .. offset + i), as cpu_attention takes it without building it: the native softmax
    skips the masked scores (a 512-token chunk after 1,500: a [1,536, 2,048] mask a head
    group and a `where` over 9 million scores a layer, otherwise)."""

    offset: int
    length: int


def cpu_attention(q: mx.array, k: mx.array, v: mx.array, mask: mx.array | Causal | None) -> mx.array:
    """Attention as mx.fast.scaled_dot_product_attention computes it, for decode steps
    and prompt chunks on the CPU; q comes already scaled.

    A step of up to NATIVE_MAX_POSITIONS new positions (a token, a verify window, a
    batch of rows) runs in the native module's one operation, which reads the keys and
    values in place in the cache's buffer: built from MLX's operations it took seven a
    layer, each with its dispatch cost (a SmolLM2 layer's decode attention: ~120 us
    evaluated alone against ~330). A prompt's chunk multiplies its scores with BLAS and
    takes the native softmax: MLX's CPU `exp` costs ~19 ns an element (a 512-token
    chunk after 1,500 tokens: 9 million a layer), the native one ~3, and the causal form
    never builds the mask. Not compiled: the key length grows every step and each new
    shape would be traced again. Metal keeps the fused kernel. Shapes: q [B, H, L, D];
    k, v [B, H_kv, T, D]; mask [H / H_kv * L, T] or [B, 1, H / H_kv * L, T] bool
    (True = may attend; `grouped_mask`), `Causal`, or None; query head h reads kv head
    h // (H / H_kv), as the library's grouped-query attention does.
    """
    B, H, L, D = q.shape
    module = native()
    if module is not None and L <= NATIVE_MAX_POSITIONS and q.dtype == k.dtype == v.dtype == mx.float32:
        if mask is None or isinstance(mask, Causal):
            return module.attention(q, k, v, causal=mask is not None and mask.length > 1)
        if mask.dtype == mx.bool_:
            return module.attention(q, k, v, mask)
    kv_heads = k.shape[1]
    group = H // kv_heads
    scores = q.reshape(B, kv_heads, group * L, D) @ k.swapaxes(-1, -2)
    if isinstance(mask, Causal) and module is not None and scores.dtype == mx.float32:
        weights = module.softmax(scores, mask.length, mask.offset)
    else:
        if isinstance(mask, Causal):
            mask = grouped_mask(create_causal_mask(mask.length, mask.offset), group)
        weights = softmax(scores if mask is None else mx.where(mask, scores, -mx.inf))
    return (weights @ v).reshape(B, H, L, D).astype(q.dtype)


class NativeBlock:
    """A Llama-style decoder block as the native module's operations, for decode steps on the
    CPU: `step`, the whole block with its KV cache's update and attention as one, where the
    cache is mlx-lm's KVCache or BatchKVCache; otherwise (another cache, a prompt's chunk)
    `inputs` (norm, q, k, v, rotary, q's scale) up to the KV cache and `output` (o, residual,
    norm, gate, up, SwiGLU, down, residual) after the attention. Built from MLX's operations the
    block was ~43 a layer, each with its dispatch on the Python thread and on the CPU worker:
    1,300 a SmolLM2 token; the halves made it ~10, the step one (docs/performance.md). `of`
    says whether a block is one: RMSNorms, the seven linear layers kept packed for the kernel
    (biases allowed), and either no norms of q and k or RMSNorms of each of their heads (Qwen3)."""

    def __init__(self, block: nn.Module, module: ModuleType):
        attn, mlp = block.self_attn, block.mlp
        self.module = module
        self.attention = attn
        self.norms = (block.input_layernorm, block.post_attention_layernorm)
        self.head_norms = (attn.q_norm, attn.k_norm) if hasattr(attn, "q_norm") else None
        self.into = (attn.q_proj, attn.k_proj, attn.v_proj)
        self.out = (attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        self.layouts_in = [n for layer in self.into for n in _layout(layer)]
        self.layouts_out = [n for layer in self.out for n in _layout(layer)]
        head_eps = self.head_norms[0].eps if self.head_norms else 0.0
        self.plan = (attn.n_heads, attn.n_kv_heads, attn.scale, self.norms[0].eps, self.norms[1].eps, head_eps,
                     self.head_norms is not None, self.layouts_in, self.layouts_out)  # block_step's settings

    @staticmethod
    def of(block: nn.Module) -> NativeBlock | None:
        attn, mlp = getattr(block, "self_attn", None), getattr(block, "mlp", None)
        norms = [getattr(block, name, None) for name in ("input_layernorm", "post_attention_layernorm")]
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
        module = native()
        if module is None or attn is None or mlp is None or not _head_norms_taken(attn):
            return None
        layers = [getattr(attn, n, None) for n in names] + [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if not all(type(layer) is RowsQuantizedLinear and "biases" in layer and layer.scales.dtype == mx.float32
                   for layer in layers):
            return None
        if not all(type(norm) is nn.RMSNorm and norm.weight.dtype == mx.float32 for norm in norms):
            return None
        return NativeBlock(block, module)

    def inputs(self, rows: mx.array, cos: mx.array, sin: mx.array, length: int) -> list[mx.array]:
        """Rows [B*L, D] -> q (scaled), k, v [B, heads, L, head_dim]; cos, sin [L, head_dim]
        or [B, 1, L, head_dim]."""
        attn, norm = self.attention, self.norms[0]
        cos, sin = cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1])
        head_norms = [n.weight for n in self.head_norms] if self.head_norms else []
        head_eps = self.head_norms[0].eps if self.head_norms else 0.0
        return self.module.block_in(rows, norm.weight, norm.eps, _weights(self.into), self.layouts_in, cos, sin,
                                    attn.n_heads, attn.n_kv_heads, length, attn.scale, head_norms, head_eps)

    def output(self, rows: mx.array, attended: mx.array) -> mx.array:
        norm = self.norms[1]
        return self.module.block_out(rows, attended, norm.weight, norm.eps, _weights(self.out), self.layouts_out)

    def step(self, rows: mx.array, cos: mx.array, sin: mx.array, cache: Any,
             mask: mx.array | None = None) -> mx.array | None:
        """Rows [B*L, D] of L new positions through the whole block as one operation, its keys
        and values written into `cache`, whose buffers the operation is given and writes in
        place: mlx-lm's KVCache (every row at one position; cos, sin [L, head_dim]), or its
        BatchKVCache (rows each at its own position: cos, sin [B, 1, L, head_dim], and the
        batch's bool mask [B, 1, G*L, T] for the left padding, grouped_mask's form). None where
        the cache is another kind or the positions are a prompt's chunk (cpu_attention's BLAS
        path is faster there): then `inputs`, the cache's own update, cpu_attention and `output`."""
        length = cos.shape[-2]
        batch = rows.shape[0] // length
        if not _written_by_step(cache, batch, length, mask):
            return None
        batched = type(cache) is BatchKVCache
        kept = cache._idx if batched else cache.offset  # where the step's positions go
        _make_room(cache, (batch, self.attention.n_kv_heads, length, cos.shape[-1]), kept)
        head_norms = [n.weight for n in self.head_norms] if self.head_norms else []
        arrays = [self.norms[0].weight, *head_norms, *_weights(self.into), self.norms[1].weight, *_weights(self.out)]
        if cos.ndim > 2:  # a batch's rows: one row of cos and sin per row and position
            cos, sin = cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1])
        rows, cache.keys, cache.values = self.module.block_step(rows, cos, sin, kept, self.plan, arrays,
                                                                cache.keys, cache.values, mask)
        cache.offset = cache.offset + length  # BatchKVCache: one per row (an array), a new one as its update adds
        if batched:
            cache._idx += length
        return rows


def _written_by_step(cache: Any, batch: int, length: int, mask: mx.array | None) -> bool:
    """Whether block_step takes this cache: a KVCache (no mask) or a BatchKVCache with the
    batch's bool mask over every position after the step, its buffers float32 for the step's rows."""
    if type(cache) is KVCache:
        masked_right = mask is None
    elif type(cache) is BatchKVCache:
        masked_right = mask is not None and mask.dtype == mx.bool_ and mask.shape[-1] == cache._idx + length
    else:
        return False
    return masked_right and length <= NATIVE_MAX_POSITIONS and (
        cache.keys is None or (cache.keys.dtype == mx.float32 and cache.keys.shape[0] == batch))


def _make_room(cache: KVCache | BatchKVCache, shape: tuple[int, int, int, int], kept: int) -> None:
    """Buffers with room for `shape`'s positions after the `kept` ones, grown as the cache's
    update_and_fetch grows them (a multiple of its step beyond what is kept)."""
    batch, heads, length, dim = shape
    if cache.keys is not None and kept + length <= cache.keys.shape[2]:
        return
    grown = (batch, heads, (length + cache.step - 1) // cache.step * cache.step, dim)
    keys, values = cache.keys, cache.values
    if keys is None or values is None or kept == 0:
        cache.keys, cache.values = mx.zeros(grown), mx.zeros(grown)
        return
    cache.keys, cache.values = (mx.concatenate([buffer[..., :kept, :], mx.zeros(grown)], axis=2)
                                for buffer in (keys, values))


def _head_norms_taken(attn: nn.Module) -> bool:
    """No norms of q's and k's heads, or two RMSNorms of one eps the operation applies (Qwen3)."""
    q, k = (getattr(attn, name, None) for name in ("q_norm", "k_norm"))
    if q is None and k is None:
        return True
    if type(q) is not nn.RMSNorm or type(k) is not nn.RMSNorm:
        return False
    return q.weight.dtype == k.weight.dtype == mx.float32 and q.eps == k.eps


def _layout(layer: nn.Module) -> tuple[int, int, int]:
    return layer.group_size, layer.bits, int("bias" in layer)


def _weights(layers: tuple[nn.Module, ...]) -> list[mx.array]:
    """Each layer's weight, scales, biases and (where it has one) bias, read at every call:
    a layer's arrays may be replaced after the block was first run."""
    arrays = []
    for layer in layers:
        arrays += [layer["weight"], layer["scales"], layer["biases"]]
        if "bias" in layer:
            arrays.append(layer["bias"])
    return arrays
