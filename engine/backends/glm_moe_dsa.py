"""GLM-5 (glm_moe_dsa): DeepSeek-V3.2-style sparse MLA attention, MoE trunk, MTP
heads as appended layers laid out like DeepSeek-V3's.

Head i is layer `model.layers.{num_hidden_layers + i}`. On the pair
(hidden_t, token_{t+1}):

    x = eh_proj(concat[enorm(embed(token)), hnorm(hidden_t)])   embedding FIRST
    x = decoder block (sparse MLA + MoE, its own indexer and KV)
    h = shared_head.norm(x)       -> lm_head -> logits; h feeds head i+1

The hidden consumed is the one the output head reads (trunk after its final norm,
a head after `shared_head.norm`), as in deepseek_v3.py. The MTP layer stores no
copy of the embedding or output head: the trunk's are used.

Attention, written out here (`attention`) over mlx-lm's modules and weights:

    latent, k_pe = kv_a_layernorm / rope of kv_a_proj_with_mqa(x)    MLA, as V3
    indexer: q_i = rope(wq_b(q latent)), k_i = rope(k_norm(wk(x)))   one key a position
             score(t, s) = sum_h w_h(t) * relu(q_ih(t) . k_i(s)),  w = weights_proj(x)
    each query attends to the index_topk positions of highest score (all of them
    while there are no more than index_topk)

mlx-lm keeps the indexer's keys in a second cache per layer (a CacheList), which
neither the session bank nor continuous batching stores. Here each layer keeps one
KVCache: keys = [latent | indexer key] side by side, values = rope key. A trim
rolls both back together; the bank and the batch store it like any KVCache.

Ties: among positions whose scores are exactly equal at the index_topk-th place,
the latest are kept (a sort on the values, then counting), so that a verify
window and one-token steps choose the same positions; reference implementations
leave the order of exact ties unspecified. Decode steps attend through a mask over
all positions rather than gathering the selected ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import deepseek_v32, glm_moe_dsa
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import KVCache

from engine.backends.base import Backend, Tape, build_trunk
from engine.backends.nextn import SharedHead, load_heads, split_weights


def _mask(x: mx.array, cache) -> mx.array | None:
    # A boolean array (the rope scores are masked with mx.where); None for one
    # query over a plain cache: it sees every position.
    return create_attention_mask(x, cache, return_array=True)


def select_top(scores: mx.array, k: int) -> mx.array:
    """A boolean mask of each row's k highest scores; exact ties at the k-th place
    resolved towards later positions."""
    kth = mx.sort(scores, axis=-1)[..., -k:][..., :1]
    above = scores > kth
    tied = scores == kth
    need = k - above.astype(mx.int32).sum(axis=-1, keepdims=True)
    later = mx.cumsum(tied.astype(mx.int32), axis=-1, reverse=True)
    return above | (tied & (later <= need))


def index_scores(indexer: deepseek_v32.Indexer, x: mx.array, qr: mx.array, keys: mx.array,
                 offset) -> mx.array:
    """The indexer's score of every cached position for every query: [B, 1, L, S]."""
    B, L, _ = x.shape
    q = indexer.wq_b(qr).reshape(B, L, indexer.n_heads, indexer.head_dim).swapaxes(1, 2)
    q = indexer.rope(q, offset=offset)
    scores = mx.maximum(q @ keys.swapaxes(-1, -2), 0)  # [B, H, L, S]
    weights = indexer.weights_proj(x) * (indexer.n_heads**-0.5 * indexer.softmax_scale)
    scores = scores * weights.swapaxes(-1, -2)[..., None]
    # Summed head by head, in one order whatever L is (mlx-lm does the same).
    return sum(scores[:, h : h + 1] for h in range(scores.shape[1]))


def attention(attn: deepseek_v32.DeepseekV32Attention, x: mx.array, mask: mx.array | None,
              cache: KVCache) -> mx.array:
    B, L, _ = x.shape
    qr = attn.q_a_layernorm(attn.q_a_proj(x))
    q = attn.q_b_proj(qr).reshape(B, L, attn.num_heads, attn.q_head_dim).transpose(0, 2, 1, 3)
    q_nope, q_pe = mx.split(q, [attn.qk_nope_head_dim], axis=-1)
    latent, k_pe = mx.split(attn.kv_a_proj_with_mqa(x), [attn.kv_lora_rank], axis=-1)
    k_pe = k_pe.reshape(B, L, 1, attn.qk_rope_head_dim).transpose(0, 2, 1, 3)
    latent = mx.expand_dims(attn.kv_a_layernorm(latent), axis=1)  # [B, 1, L, kv_lora_rank]
    indexer = attn.indexer
    index_key = indexer.k_norm(indexer.wk(x)).reshape(B, 1, L, indexer.head_dim)

    offset = cache.offset
    q_pe = attn.rope(q_pe, offset)
    k_pe = attn.rope(k_pe, offset)
    index_key = indexer.rope(index_key, offset=offset)
    keys, k_pe = cache.update_and_fetch(mx.concatenate([latent, index_key], axis=-1), k_pe)
    latent, index_keys = mx.split(keys, [attn.kv_lora_rank], axis=-1)

    if keys.shape[2] > indexer.index_topk:
        scores = index_scores(indexer, x, qr, index_keys, offset)
        if mask is not None:
            scores = mx.where(mask, scores, -float("inf"))
        chosen = select_top(scores, indexer.index_topk)
        mask = chosen if mask is None else chosen & mask

    pe_scores = (q_pe * attn.scale) @ k_pe.swapaxes(-1, -2)
    if mask is not None:
        pe_scores = mx.where(mask, pe_scores, mx.array(mx.finfo(pe_scores.dtype).min, pe_scores.dtype))
    if L == 1:  # absorbed: attend in the latent space, then project out
        out = scaled_dot_product_attention(attn.embed_q(q_nope), latent, latent, cache=cache,
                                           scale=attn.scale, mask=pe_scores)
        out = attn.unembed_out(out)
    else:
        k = attn.embed_q(latent, transpose=False)
        v = attn.unembed_out(latent)
        out = scaled_dot_product_attention(q_nope, k, v, cache=cache, scale=attn.scale, mask=pe_scores)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def block(layer: deepseek_v32.DeepseekV32DecoderLayer, x: mx.array, mask, cache) -> mx.array:
    h = x + attention(layer.self_attn, layer.input_layernorm(x), mask, cache)
    return h + layer.mlp(layer.post_attention_layernorm(h))


class MTPLayer(deepseek_v32.DeepseekV32DecoderLayer):
    """One nextn layer: the trunk's block plus the fusion in front of it."""

    def __init__(self, args: Any, layer_idx: int):  # glm_moe_dsa.ModelArgs: DeepSeek-V3.2's fields
        super().__init__(args, layer_idx)
        d, eps = args.hidden_size, args.rms_norm_eps
        self.enorm = nn.RMSNorm(d, eps=eps)
        self.hnorm = nn.RMSNorm(d, eps=eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.shared_head = SharedHead(d, eps)

    def __call__(self, hidden: mx.array, embeds: mx.array, cache) -> mx.array:  # type: ignore[override]
        x = self.eh_proj(mx.concatenate([self.enorm(embeds), self.hnorm(hidden)], axis=-1))
        return self.shared_head.norm(block(self, x, _mask(x, cache), cache))


class GlmMoeDsaBackend(Backend):
    family = "glm_moe_dsa"

    def make_cache(self):
        return [KVCache() for _ in self.trunk.model.layers]

    def forward(self, tokens, cache, tape: Tape | None = None, last: bool = False):
        model = self.trunk.model
        h = model.embed_tokens(tokens)
        mask = _mask(h, cache[0])
        for layer, c in zip(model.layers, cache):
            h = block(layer, h, mask, c)
        h = model.norm(h)
        return self.trunk.lm_head(h[:, -1:] if last else h), h

    def head(self, k, hidden, tokens, cache, last=False):
        h = self.heads[k](hidden, self.trunk.model.embed_tokens(tokens), cache)
        return self.trunk.lm_head(h[:, -1:] if last else h), h


def load(folder: Path, config: dict, weights: dict) -> GlmMoeDsaBackend:
    # mlx-lm's sanitize drops every layer >= num_hidden_layers; the heads are split
    # off first and sanitized as trunk layers (experts stacked, kv_b_proj split).
    trunk_weights, head_weights = split_weights(config, weights)
    trunk = build_trunk(glm_moe_dsa.Model, glm_moe_dsa.ModelArgs, config, trunk_weights)
    return GlmMoeDsaBackend(trunk, load_heads(trunk, MTPLayer, head_weights))
