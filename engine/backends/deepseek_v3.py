"""DeepSeek-V3: MLA attention, MoE trunk, MTP heads as appended layers.

Head i is layer `model.layers.{num_hidden_layers + i}`. On the pair
(hidden_t, token_{t+1}):

    x = eh_proj(concat[enorm(embed(token)), hnorm(hidden_t)])   embedding FIRST
    x = decoder block (MLA + MoE, own KV)
    h = shared_head.norm(x)       -> lm_head -> logits; h feeds head i+1

Which hidden the head consumes: the one the output head reads, i.e. the trunk
after its final norm, and a head's output after `shared_head.norm`. That is
how the heads were trained in Megatron-style MTP (the main model's output and
each MTP layer's output are normed before they feed the next depth). vLLM
chains the un-normed block output between depths instead; the choice never
breaks exactness, only acceptance, so measure it on a trained head.

Cache: mlx-lm 0.32's MLA stores (normed kv latent, rope key) in a plain
KVCache, so the trunk and the heads use KVCache and rewind is a trim.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import deepseek_v3
from mlx_lm.models.base import create_attention_mask

from engine.backends.base import Backend, Tape, build_trunk
from engine.backends.nextn import SharedHead, load_heads, split_weights


def _mask(x: mx.array, cache):
    # MLA applies the mask with mx.where on its rope scores, so it needs a
    # boolean array; the "causal" string other models accept would fail.
    return create_attention_mask(x, cache, return_array=True)


class MTPLayer(deepseek_v3.DeepseekV3DecoderLayer):
    """One nextn layer: the trunk's block plus the fusion in front of it."""

    def __init__(self, args: deepseek_v3.ModelArgs, layer_idx: int):
        super().__init__(args, layer_idx)
        d, eps = args.hidden_size, args.rms_norm_eps
        self.enorm = nn.RMSNorm(d, eps=eps)
        self.hnorm = nn.RMSNorm(d, eps=eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.shared_head = SharedHead(d, eps)

    def __call__(self, hidden: mx.array, embeds: mx.array, cache) -> mx.array:  # type: ignore[override]
        x = mx.concatenate([self.enorm(embeds), self.hnorm(hidden)], axis=-1)
        x = self.eh_proj(x)
        x = super().__call__(x, _mask(x, cache), cache)
        return self.shared_head.norm(x)


class DeepseekV3Backend(Backend):
    family = "deepseek_v3"

    def forward(self, tokens, cache, tape: Tape | None = None, last: bool = False):
        model = self.trunk.model
        h = model.embed_tokens(tokens)
        mask = _mask(h, cache[0])
        for layer, c in zip(model.layers, cache):
            h = layer(h, mask, c)
        h = model.norm(h)
        return self.trunk.lm_head(h[:, -1:] if last else h), h

    def head(self, k, hidden, tokens, cache, last=False):
        h = self.heads[k](hidden, self.trunk.model.embed_tokens(tokens), cache)
        return self.trunk.lm_head(h[:, -1:] if last else h), h


def load(folder: Path, config: dict, weights: dict) -> DeepseekV3Backend:
    # Split the appended layers off first: mlx-lm's sanitize removes only
    # layer 61, so any other depth would reach strict loading and fail.
    trunk_weights, head_weights = split_weights(config, weights)
    trunk = build_trunk(deepseek_v3.Model, deepseek_v3.ModelArgs, config, trunk_weights)
    return DeepseekV3Backend(trunk, load_heads(trunk, MTPLayer, head_weights))
