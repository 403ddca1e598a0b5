"""DeepSeek-V4 (deepseek_v4, DeepseekV4ForCausalLM): hyper-connected residual streams,
shared-KV attention over a sliding window plus compressed blocks, hash- and score-routed
MoE; MTP heads under `mtp.{i}.*`. mlx-lm has no model for it: the trunk is written here,
after DeepSeek's own inference code (`inference/model.py` of the release) and its names.

Residual stream: `hc_mult` copies of the hidden state, [B, L, hc, D]. Each block:

    y, post, comb = hc_pre(x)     pre  = sigmoid(.) + hc_eps            weights over the streams
                                  post = 2 sigmoid(.)                    weights of the branch output
                                  comb = Sinkhorn(softmax(.))            stream-to-stream residual map
                                  from (flatten(x) @ hc_fn^T) / rms(flatten(x)) * hc_scale + hc_base
    x = post * attn(attn_norm(sum_h pre_h x_h)) + comb^T x      (hc_post), then the same for ffn

    logits = head(norm(sum_h pre_h x_h)),  pre = sigmoid(hc_head mixes) + hc_eps   (hc_head)

Attention (one layer, head_dim d, rope on the LAST rope_dim channels, pairs interleaved):

    q  = rms(wq_b(q_norm(wq_a(x))))  per head, then rope        kv = rope(kv_norm(wkv(x)))
    keys = values = kv (one head shared by all query heads), attention sinks per head,
    each query sees the last `sliding_window` positions (itself included) and, where the
    layer's compress ratio r > 0, compressed entries of the blocks of r positions that
    ended at or before it:
      r == 4   overlapping blocks (each entry pools its block and the one before, 2r
               positions) and a lightning indexer keeping the `index_topk` entries of
               highest score sum_h w_h relu(q_h . k_I), scored on its own compressed keys
      other r  plain blocks (128 as released), every ended block attended
    an entry: softmax over the block's positions, channel by channel, of wgate(x) + ape,
    weighting wkv(x); then norm and rope at the block's first position
    out = wo_b(grouped wo_a(inverse-rope(o)))       o_groups groups of heads, o_lora_rank each
    layers with r > 0 rope with compress_rope_theta and YaRN, r == 0 with rope_theta plain

MoE: scores = sqrtsoftplus(gate(x)) in float32 (sigmoid / softmax by config); the first
`num_hash_layers` layers take their experts from `gate.tid2eid[token]`, the others top-k
of scores + gate.bias (the bias only chooses); weights = chosen scores / their sum *
routed_scaling_factor; plus the shared expert. SwiGLU with `swiglu_limit` clamping
(up to [-l, l], gate to <= l).

MTP head i (`mtp.{i}.*`) on the pair (streams_t, token_{t+1}):

    x = e_proj(enorm(embed(token))) + h_proj(hnorm(streams_t))   added to every stream
    x = block (the trunk's kind, compress_ratios[N + i], own cache)
    logits = trunk head(norm(hc_head with the head's own hc_head_*))
The hidden passed on (trunk -> head 0, head k -> head k+1) is the streams before any
hc_head, flattened to [B, L, hc * D]: what DeepSeek's Transformer hands its MTP block.

Caches. Every layer keeps one plain KVCache, so a rejected draft is a trim, and the
session bank and continuous batching store it like any attention layer:
    keys   [kv | compressed entry | indexer compressed entry]   one column per position
    values [wkv(x) | wgate(x) + ape | indexer's wkv | indexer's wgate + ape]   (float32)
           or one zero column for a layer without compressor
A compressed entry sits in the column of its block's last position (zero elsewhere) and
is computed when that position is fed, from the raw inputs of its block read back from
the values: a partly filled block has no entry yet, so trimming positions never leaves
one behind, and nothing is stateful beyond the columns. The window is a mask over the
plain cache; compressed entries are attended through a mask over all columns (O(T) per
query, where the reference gathers T/r entries).

Ties: the indexer's top-k keeps the latest entries among exact ties at the k-th place
(glm_moe_dsa.select_top), so a verify window and one-token steps choose alike.

Not done here (said in docs/engine.md): the reference's FP8/FP4 simulation of activations
(kv and indexer round trips; the Hadamard rotation before the FP4 one, orthogonal and so
a no-op on indexer scores without it): this engine keeps them in float; the release's
FP8 / FP4 weight files (`*.scale` tensors) are refused, not dequantized.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import BaseModelArgs
from mlx_lm.models.cache import KVCache
from mlx_lm.models.switch_layers import SwitchGLU

from engine.backends.base import Backend, Tape, build_trunk, split_numbered
from engine.backends.descriptors import deepseek_v4_unsupported
from engine.backends.glm_moe_dsa import select_top
from engine.backends.nextn import load_heads
from engine.checkpoint import CheckpointError

HEAD_PREFIX = "mtp."
SLOT = "layers.0."  # head tensors pass through the trunk's sanitize under this name
SHARED_WITH_TRUNK = ("embed.", "head.")  # copies of the trunk's, if a head carries any
# DeepSeek's inference code (release commit 60d8d70) clamps the shared expert's SwiGLU
# too; transformers' docstring speaks of routed experts only. The release's code rules.
CLAMP_SHARED = True


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    n_routed_experts: int
    num_experts_per_tok: int
    compress_ratios: list[int] = field(default_factory=list)
    num_key_value_heads: int = 1
    n_shared_experts: int = 1
    num_hash_layers: int = 0
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.0
    swiglu_limit: float = 0.0
    sliding_window: int = 128
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: dict[str, Any] | None = None
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0

    def __post_init__(self) -> None:
        why = deepseek_v4_unsupported(vars(self))  # the same test inspect runs on config.json
        if why:
            raise CheckpointError(why)

    def compress_ratio(self, layer: int) -> int:
        """Layer `layer`'s ratio; MTP layers (N + i) read the entries past the trunk's,
        0 where the list stops (as released: one trailing 0 for the one MTP layer)."""
        return self.compress_ratios[layer] if layer < len(self.compress_ratios) else 0


# -- rotary embedding: interleaved pairs on the last rope_dim channels -------------------


def inv_frequencies(args: ModelArgs, compressed: bool) -> mx.array:
    """DeepSeek's frequencies: rope_theta plain for window-only layers; for layers with a
    compressor compress_rope_theta, with YaRN's ramp where rope_scaling asks for it
    (frequency interpolation only: V4 does not scale attention by YaRN's mscale)."""
    dims = args.qk_rope_head_dim
    base = args.compress_rope_theta if compressed else args.rope_theta
    freqs = 1.0 / (base ** (np.arange(0, dims, 2, dtype=np.float32) / dims))
    yarn = args.rope_scaling or {}
    original = yarn.get("original_max_position_embeddings", 0) if compressed else 0
    if original:
        factor, fast, slow = yarn.get("factor", 1.0), yarn.get("beta_fast", 32), yarn.get("beta_slow", 1)

        def dim_of(rotations: float) -> float:
            return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = max(math.floor(dim_of(fast)), 0), min(math.ceil(dim_of(slow)), dims - 1)
        spread = (high - low) or 0.001
        ramp = np.clip((np.arange(dims // 2, dtype=np.float32) - low) / spread, 0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return mx.array(freqs.astype(np.float32))


def rope(x: mx.array, positions: mx.array, inv_freq: mx.array, inverse: bool = False) -> mx.array:
    """Rotate the last 2 * len(inv_freq) channels of x [B, N, L, C] at positions [B|1, L]
    (float32, as the reference's complex multiply); inverse undoes it."""
    dims = 2 * inv_freq.shape[0]
    angles = positions[..., None].astype(mx.float32) * inv_freq  # [B|1, L, dims/2]
    cos, sin = mx.cos(angles)[:, None], mx.sin(angles)[:, None]
    if inverse:
        sin = -sin
    pe = x[..., -dims:].astype(mx.float32).reshape(*x.shape[:-1], dims // 2, 2)
    a, b = pe[..., 0], pe[..., 1]
    rotated = mx.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(*x.shape[:-1], dims)
    return mx.concatenate([x[..., :-dims], rotated.astype(x.dtype)], axis=-1)


# -- hyper-connections -----------------------------------------------------------------


def _mixes(x: mx.array, fn: mx.array, eps: float) -> tuple[mx.array, mx.array]:
    """(flattened streams in float32, their mixes fn . x / rms(x))."""
    flat = x.reshape(*x.shape[:2], -1).astype(mx.float32)
    inv_rms = mx.rsqrt(mx.mean(flat * flat, axis=-1, keepdims=True) + eps)
    return flat, (flat @ fn.astype(mx.float32).T) * inv_rms


def hc_pre(x: mx.array, fn: mx.array, scale: mx.array, base: mx.array, args: ModelArgs):
    """The branch input (streams weighted by `pre`) and the maps hc_post needs."""
    hc = args.hc_mult
    _, mixes = _mixes(x, fn, args.rms_norm_eps)
    pre = mx.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + args.hc_eps
    post = 2 * mx.sigmoid(mixes[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = (mixes[..., 2 * hc :] * scale[2] + base[2 * hc :]).reshape(*mixes.shape[:2], hc, hc)
    comb = mx.softmax(comb, axis=-1) + args.hc_eps  # then Sinkhorn towards doubly stochastic
    comb = comb / (comb.sum(axis=-2, keepdims=True) + args.hc_eps)
    for _ in range(args.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + args.hc_eps)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + args.hc_eps)
    y = (pre[..., None] * x.astype(mx.float32)).sum(axis=2)
    return y.astype(x.dtype), post, comb


def hc_post(y: mx.array, residual: mx.array, post: mx.array, comb: mx.array) -> mx.array:
    """Stream i: post_i * y + sum_j comb[j, i] * residual_j."""
    mixed = mx.swapaxes(comb, -1, -2) @ residual.astype(mx.float32)
    return (post[..., None] * y[:, :, None].astype(mx.float32) + mixed).astype(y.dtype)


def hc_head(x: mx.array, fn: mx.array, scale: mx.array, base: mx.array, args: ModelArgs) -> mx.array:
    """Collapse the streams for the output head: sigmoid weights, no Sinkhorn."""
    _, mixes = _mixes(x, fn, args.rms_norm_eps)
    pre = mx.sigmoid(mixes * scale + base) + args.hc_eps
    return (pre[..., None] * x.astype(mx.float32)).sum(axis=2).astype(x.dtype)


# -- attention -------------------------------------------------------------------------


def _positions(cache: Any, length: int) -> mx.array:
    """Positions of the next `length` tokens: [1, L] for a KVCache, [B, L] for a batch's
    cache (one offset per row)."""
    offset = cache.offset
    if isinstance(offset, int):
        return mx.arange(offset, offset + length)[None]
    return offset[:, None] + mx.arange(length)[None]


def _stored_values(cache: Any, count: int) -> mx.array | None:
    """The last `count` value columns already in the cache (before this forward)."""
    n = getattr(cache, "_idx", cache.offset)  # a batch cache's columns, a KVCache's positions
    if cache.values is None or n == 0 or count == 0:
        return None
    return cache.values[..., max(n - count, 0) : n, :][:, 0]


class Compressor(nn.Module):
    """Pools blocks of `ratio` positions into one entry (DeepSeek's names: ape, wkv, wgate,
    norm). With ratio 4 the blocks overlap: an entry pools its block's second-half channels
    and the previous block's first-half channels, 2 * ratio positions."""

    def __init__(self, args: ModelArgs, ratio: int, dims: int):
        super().__init__()
        self.ratio, self.dims, self.overlap = ratio, dims, ratio == 4
        width = (2 if self.overlap else 1) * dims
        self.ape = mx.zeros((ratio, width))
        self.wkv = nn.Linear(args.hidden_size, width, bias=False)
        self.wgate = nn.Linear(args.hidden_size, width, bias=False)
        self.norm = nn.RMSNorm(dims, eps=args.rms_norm_eps)

    @property
    def span(self) -> int:
        """Positions one entry reads."""
        return (2 if self.overlap else 1) * self.ratio

    def inputs(self, x: mx.array, positions: mx.array) -> tuple[mx.array, mx.array]:
        """Per position: the pooled values and their gate scores (ape by position in block)."""
        x = x.astype(mx.float32)
        ape = self.ape.astype(mx.float32)[positions % self.ratio]  # [B|1, L, width]
        return self.wkv(x), self.wgate(x) + ape

    def entries(self, kv: mx.array, score: mx.array, before: mx.array | None, positions: mx.array,
                inv_freq: mx.array, dtype: mx.Dtype) -> mx.array:
        """The entry of the block ending at each new position (zero where none ends).
        kv, score [B, L, width] new; before [B, P, 2 * width] stored (P < span)."""
        B, L, width = kv.shape
        span, r, d = self.span, self.ratio, self.dims
        pad = span - 1 - (0 if before is None else before.shape[1])
        parts_kv, parts_score = [mx.zeros((B, pad, width)), kv], [mx.full((B, pad, width), -mx.inf), score]
        if before is not None:  # the stored positions go between the padding and the new ones
            parts_kv.insert(1, before[..., :width])
            parts_score.insert(1, before[..., width:])
        every_kv, every_score = mx.concatenate(parts_kv, axis=1), mx.concatenate(parts_score, axis=1)
        window = mx.arange(L)[:, None] + mx.arange(span)[None]  # [L, span]: row l ends at new position l
        g_kv, g_score = every_kv[:, window], every_score[:, window]  # [B, L, span, width]
        entry_pos = positions[..., None] - (span - 1) + mx.arange(span)
        g_score = mx.where((entry_pos >= 0)[..., None], g_score, -mx.inf)  # before the sequence / padding
        if self.overlap:  # previous block: first half of the channels; this block: second half
            g_kv = mx.concatenate([g_kv[:, :, :r, :d], g_kv[:, :, r:, d:]], axis=2)
            g_score = mx.concatenate([g_score[:, :, :r, :d], g_score[:, :, r:, d:]], axis=2)
        pooled = (g_kv * mx.softmax(g_score, axis=2)).sum(axis=2)
        out = self.norm(pooled.astype(dtype))[:, None]  # [B, 1, L, d]
        out = rope(out, positions - r + 1, inv_freq)  # at the block's first position
        ends = ((positions + 1) % r == 0) & (positions >= r - 1)
        return mx.where(ends[:, None, :, None], out, mx.zeros_like(out))


class Indexer(nn.Module):
    """The lightning indexer of ratio-4 layers (DeepSeek's names)."""

    def __init__(self, args: ModelArgs, ratio: int):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = args.index_n_heads, args.index_head_dim, args.index_topk
        self.wq_b = nn.Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(args.hidden_size, self.n_heads, bias=False)
        self.compressor = Compressor(args, ratio, self.head_dim)

    def scores(self, x: mx.array, qr: mx.array, keys: mx.array, positions: mx.array,
               inv_freq: mx.array) -> mx.array:
        """sum_h w_h relu(q_h . k) for every query and column: [B, L, T]."""
        B, L, _ = x.shape
        q = self.wq_b(qr).reshape(B, L, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        q = rope(q, positions, inv_freq)
        each = mx.maximum(q @ mx.swapaxes(keys, -1, -2), 0)  # [B, H, L, T]
        w = self.weights_proj(x) * (self.head_dim**-0.5 * self.n_heads**-0.5)  # [B, L, H]
        # summed head by head, in one order whatever L is
        return sum(each[:, h] * w[..., h : h + 1] for h in range(self.n_heads))


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        d, hd, heads = args.hidden_size, args.head_dim, args.num_attention_heads
        self.n_heads, self.head_dim, self.groups, self.rank = heads, hd, args.o_groups, args.o_lora_rank
        self.window, self.eps = args.sliding_window, args.rms_norm_eps
        self.ratio = args.compress_ratio(layer)
        self.wq_a = nn.Linear(d, args.q_lora_rank, bias=False)
        self.q_norm = nn.RMSNorm(args.q_lora_rank, eps=args.rms_norm_eps)
        self.wq_b = nn.Linear(args.q_lora_rank, heads * hd, bias=False)
        self.wkv = nn.Linear(d, hd, bias=False)
        self.kv_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.wo_a = nn.Linear(heads * hd // self.groups, self.groups * self.rank, bias=False)
        self.wo_b = nn.Linear(self.groups * self.rank, d, bias=False)
        self.attn_sink = mx.zeros((heads,))
        if self.ratio:
            self.compressor = Compressor(args, self.ratio, hd)
            if self.ratio == 4:
                self.indexer = Indexer(args, self.ratio)
        self._inv_freq = inv_frequencies(args, compressed=self.ratio > 0)

    def _compressors(self) -> list[Compressor]:
        found = [self.compressor] if "compressor" in self else []
        return found + ([self.indexer.compressor] if "indexer" in self else [])

    def __call__(self, x: mx.array, cache: Any) -> mx.array:
        B, L, _ = x.shape
        hd, freq = self.head_dim, self._inv_freq
        positions = _positions(cache, L)
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).reshape(B, L, self.n_heads, hd)
        q = q * mx.rsqrt(mx.mean(q.astype(mx.float32) ** 2, axis=-1, keepdims=True) + self.eps).astype(q.dtype)
        q = rope(q.transpose(0, 2, 1, 3), positions, freq)
        kv = rope(self.kv_norm(self.wkv(x))[:, None], positions, freq)  # [B, 1, L, hd]
        keys, values = self._new_columns(x, kv, positions, cache)
        all_keys, _ = cache.update_and_fetch(keys, values)
        attend, mask = self._visible(x, qr, all_keys, positions, cache)
        out = mx.fast.scaled_dot_product_attention(q, attend, attend, scale=hd**-0.5, mask=mask[:, None],
                                                   sinks=self.attn_sink.astype(q.dtype))
        out = rope(out, positions, freq, inverse=True).transpose(0, 2, 1, 3)  # [B, L, H, hd]
        # grouped low-rank output: group g's heads through its own slice of wo_a
        grouped = out.reshape(B, L, self.groups, -1).transpose(2, 0, 1, 3)  # [G, B, L, H*hd/G]
        wo_a = self.wo_a.weight.reshape(self.groups, self.rank, -1)
        low = (grouped @ mx.swapaxes(wo_a, -1, -2)[:, None]).transpose(1, 2, 0, 3)  # [B, L, G, R]
        return self.wo_b(low.reshape(B, L, -1))

    def _new_columns(self, x: mx.array, kv: mx.array, positions: mx.array, cache: Any):
        """This forward's cache columns: keys [kv | entries...], values [raw inputs...]
        (one zero column without a compressor)."""
        B, L, _ = x.shape
        keys, values = [kv], []
        compressors = self._compressors()
        before = _stored_values(cache, max((c.span for c in compressors), default=1) - 1)
        start = 0
        for c in compressors:
            ckv, cscore = c.inputs(x, positions)
            width = ckv.shape[-1]
            held = None if before is None or c.span == 1 else before[..., start : start + 2 * width][:, 1 - c.span :]
            keys.append(c.entries(ckv, cscore, held, positions, self._inv_freq, x.dtype))
            values += [ckv, cscore]
            start += 2 * width
        new_values = mx.concatenate(values, axis=-1)[:, None] if values else mx.zeros((B, 1, L, 1), x.dtype)
        return mx.concatenate(keys, axis=-1), new_values

    def _visible(self, x: mx.array, qr: mx.array, all_keys: mx.array, positions: mx.array, cache: Any):
        """What the queries attend ([B, 1, S, hd]: the window's kv, then every column's
        compressed entry) and which of it each query sees ([B|1, L, S])."""
        L, T, hd = x.shape[1], all_keys.shape[2], self.head_dim
        column = mx.arange(T)[None] - (T - mx.array(cache.offset)).reshape(-1, 1)  # each column's position
        query = positions[..., None]
        recent = min(T, self.window + L - 1)  # the window reaches no further back
        near = column[:, None, T - recent :]
        window = (near >= 0) & (near <= query) & (near > query - self.window)
        if not self.ratio:
            return all_keys[..., T - recent :, :hd], window
        entry = column[:, None, :]
        seen = ((entry + 1) % self.ratio == 0) & (entry >= 0) & (entry <= query)  # its block has ended
        if "indexer" in self:
            scores = self.indexer.scores(x, qr, all_keys[..., 2 * hd :], positions, self._inv_freq)
            seen = seen & select_top(mx.where(seen, scores, -mx.inf), self.indexer.topk)
        rows = max(window.shape[0], seen.shape[0])
        attend = mx.concatenate([all_keys[..., T - recent :, :hd], all_keys[..., hd : 2 * hd]], axis=2)
        mask = mx.concatenate([mx.broadcast_to(window, (rows, L, recent)), mx.broadcast_to(seen, (rows, L, T))], -1)
        return attend, mask


# -- mixture of experts ----------------------------------------------------------------


class ClampedSwiGLU(nn.Module):
    """silu(min(gate, l)) * clip(up, -l, l), in float32 (l = 0: no clamp)."""

    def __init__(self, limit: float):
        super().__init__()
        self.limit = limit

    def __call__(self, up: mx.array, gate: mx.array) -> mx.array:
        dtype = up.dtype
        up, gate = up.astype(mx.float32), gate.astype(mx.float32)
        if self.limit > 0:
            up, gate = mx.clip(up, -self.limit, self.limit), mx.minimum(gate, self.limit)
        return (nn.silu(gate) * up).astype(dtype)


class Expert(nn.Module):
    """The shared expert (w1 gate, w3 up, w2 down)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        d, inner = args.hidden_size, args.moe_intermediate_size
        self.w1, self.w2, self.w3 = nn.Linear(d, inner, bias=False), nn.Linear(inner, d, bias=False), nn.Linear(
            d, inner, bias=False)
        self.act = ClampedSwiGLU(args.swiglu_limit if CLAMP_SHARED else 0.0)

    def __call__(self, x: mx.array) -> mx.array:
        return self.w2(self.act(self.w3(x), self.w1(x)))


class Gate(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.top_k, self.func, self.scale = args.num_experts_per_tok, args.scoring_func, args.routed_scaling_factor
        self.weight = mx.zeros((args.n_routed_experts, args.hidden_size))
        if layer < args.num_hash_layers:
            self.tid2eid = mx.zeros((args.vocab_size, args.num_experts_per_tok), dtype=mx.int32)
        else:
            self.bias = mx.zeros((args.n_routed_experts,))

    def __call__(self, x: mx.array, tokens: mx.array) -> tuple[mx.array, mx.array]:
        logits = x.astype(mx.float32) @ self.weight.astype(mx.float32).T
        if self.func == "softmax":
            scores = mx.softmax(logits, axis=-1)
        elif self.func == "sigmoid":
            scores = mx.sigmoid(logits)
        else:
            scores = mx.sqrt(mx.logaddexp(logits, 0.0))  # sqrt(softplus)
        if "tid2eid" in self:  # hash routing: the token decides
            chosen = self.tid2eid[tokens].astype(mx.int32)
        else:  # the bias only chooses
            choice = scores + self.bias.astype(mx.float32)
            chosen = mx.argpartition(-choice, kth=self.top_k - 1, axis=-1)[..., : self.top_k]
        chosen = mx.stop_gradient(chosen)  # indices have no gradient (training the heads differentiates this)
        weights = mx.take_along_axis(scores, chosen, axis=-1)
        if self.func != "softmax":
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return chosen, weights * self.scale


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.gate = Gate(args, layer)
        self.experts = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.n_routed_experts,
                                 activation=ClampedSwiGLU(args.swiglu_limit))
        self.shared_experts = Expert(args)

    def __call__(self, x: mx.array, tokens: mx.array) -> mx.array:
        chosen, weights = self.gate(x, tokens)
        y = (self.experts(x, chosen).astype(mx.float32) * weights[..., None]).sum(axis=-2)
        return (y + self.shared_experts(x).astype(mx.float32)).astype(x.dtype)


# -- blocks and the model ----------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.args = args
        d, mix, width = args.hidden_size, (2 + args.hc_mult) * args.hc_mult, args.hc_mult * args.hidden_size
        self.attn = Attention(args, layer)
        self.ffn = MoE(args, layer)
        self.attn_norm = nn.RMSNorm(d, eps=args.rms_norm_eps)
        self.ffn_norm = nn.RMSNorm(d, eps=args.rms_norm_eps)
        for part in ("attn", "ffn"):
            setattr(self, f"hc_{part}_fn", mx.zeros((mix, width)))
            setattr(self, f"hc_{part}_base", mx.zeros((mix,)))
            setattr(self, f"hc_{part}_scale", mx.ones((3,)))

    def __call__(self, x: mx.array, tokens: mx.array, cache: Any) -> mx.array:
        """x: streams [B, L, hc, D]."""
        y, post, comb = hc_pre(x, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, self.args)
        x = hc_post(self.attn(self.attn_norm(y), cache), x, post, comb)
        y, post, comb = hc_pre(x, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base, self.args)
        return hc_post(self.ffn(self.ffn_norm(y), tokens), x, post, comb)


class Model(nn.Module):
    """The trunk, shaped as mlx-lm's models are (`args`, `layers`, `sanitize`, `make_cache`,
    `__call__`), with DeepSeek's tensor names as module names."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        d = args.hidden_size
        self.embed = nn.Embedding(args.vocab_size, d)
        self.layers = [Block(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(d, eps=args.rms_norm_eps)
        self.head = nn.Linear(d, args.vocab_size, bias=False)
        self.hc_head_fn = mx.zeros((args.hc_mult, args.hc_mult * d))
        self.hc_head_base = mx.zeros((args.hc_mult,))
        self.hc_head_scale = mx.ones((1,))

    def streams(self, tokens: mx.array, cache: list[Any]) -> mx.array:
        """The last block's streams [B, L, hc, D] (the embedding copied into each)."""
        e = self.embed(tokens)
        x = mx.broadcast_to(e[:, :, None], (*e.shape[:2], self.args.hc_mult, e.shape[-1]))
        for layer, c in zip(self.layers, cache):
            x = layer(x, tokens, c)
        return x

    def logits(self, x: mx.array, owner: nn.Module) -> mx.array:
        """Output head over streams, collapsed with `owner`'s hc_head_* and norm (the
        trunk's, or an MTP head's own)."""
        h = hc_head(x, owner.hc_head_fn, owner.hc_head_scale, owner.hc_head_base, self.args)
        return self.head(owner.norm(h))

    def __call__(self, tokens: mx.array, cache: list[Any] | None = None) -> mx.array:
        cache = cache if cache is not None else self.make_cache()
        return self.logits(self.streams(tokens, cache), self)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Per-expert tensors `ffn.experts.{e}.w1/w3/w2` stacked into the SwitchGLU's
        gate/up/down projections; quantized release weights refused."""
        scaled = sorted(k for k in weights if k.endswith(".scale"))
        if scaled:
            raise CheckpointError(f"deepseek_v4: {scaled[0]} and {len(scaled) - 1} more: the release's FP8 / FP4 "
                                  "weights (with per-block scales) are not dequantized here; convert them to "
                                  "bfloat16 first")
        names = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
        out: dict[str, mx.array] = {}
        experts: dict[str, dict[int, mx.array]] = {}
        for key, value in weights.items():
            if ".ffn.experts." in key:  # the release: one tensor per expert; converted: stacked already
                before, rest = key.split(".ffn.experts.", 1)
                index, name, kind = (rest.split(".", 2) + ["", ""])[:3]
                if index.isdigit() and name in names and kind == "weight":
                    experts.setdefault(f"{before}.ffn.experts.{names[name]}.weight", {})[int(index)] = value
                    continue
            out[key] = value
        n = self.args.n_routed_experts
        for key, by_expert in experts.items():
            if sorted(by_expert) != list(range(n)):
                raise CheckpointError(f"{key}: experts {sorted(by_expert)[:4]}... of {n}")
            out[key] = mx.stack([by_expert[e] for e in range(n)])
        return out

    @property
    def quant_predicate(self):
        def predicate(path: str, _module: nn.Module) -> bool | dict:
            return not path.endswith("wo_a")  # read as a grouped matrix, not called

        return predicate


class MTPHead(Block):
    """`mtp.{i}`: a block of the trunk's kind with the fusion in front and its own
    hc_head and norm behind (the embedding and output head are the trunk's)."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__(args, layer)
        d = args.hidden_size
        self.enorm = nn.RMSNorm(d, eps=args.rms_norm_eps)
        self.hnorm = nn.RMSNorm(d, eps=args.rms_norm_eps)
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.norm = nn.RMSNorm(d, eps=args.rms_norm_eps)
        self.hc_head_fn = mx.zeros((args.hc_mult, args.hc_mult * d))
        self.hc_head_base = mx.zeros((args.hc_mult,))
        self.hc_head_scale = mx.ones((1,))

    def streams(self, hidden: mx.array, embeds: mx.array, tokens: mx.array, cache: Any) -> mx.array:
        x = self.e_proj(self.enorm(embeds))[:, :, None] + self.h_proj(self.hnorm(hidden))
        return self(x, tokens, cache)


def _flat(x: mx.array) -> mx.array:
    return x.reshape(*x.shape[:2], -1)


class DeepseekV4Backend(Backend):
    family = "deepseek_v4"

    def make_cache(self):
        return [KVCache() for _ in self.trunk.layers]

    def forward(self, tokens, cache, tape: Tape | None = None, last: bool = False):
        x = self.trunk.streams(tokens, cache)
        return self.trunk.logits(x[:, -1:] if last else x, self.trunk), _flat(x)

    def head(self, k, hidden, tokens, cache, last=False):
        head, args = self.heads[k], self.trunk.args
        streams = hidden.reshape(*hidden.shape[:2], args.hc_mult, args.hidden_size)
        x = head.streams(streams, self.trunk.embed(tokens), tokens, cache)
        return self.trunk.logits(x[:, -1:] if last else x, head), _flat(x)


def load(folder: Path, config: dict, weights: dict) -> DeepseekV4Backend:
    trunk_weights, head_weights = split_numbered(weights, HEAD_PREFIX)
    trunk = build_trunk(Model, ModelArgs, config, trunk_weights)
    return DeepseekV4Backend(trunk, load_heads(trunk, MTPHead, head_weights, SLOT, SHARED_WITH_TRUNK))
