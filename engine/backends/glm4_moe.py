"""GLM-4.5 / 4.6 (glm4_moe): GQA attention with partial rope, MoE trunk,
MTP heads as appended layers, laid out like DeepSeek-V3's.

Head i is layer `model.layers.{num_hidden_layers + i}`. On the pair
(hidden_t, token_{t+1}):

    x = eh_proj(concat[enorm(embed(token)), hnorm(hidden_t)])   embedding FIRST
    x = decoder block (attention + MoE, own KV)
    h = shared_head.norm(x)       -> lm_head -> logits; h feeds head i+1

The hidden consumed is the one the output head reads (trunk after its final
norm, a head after `shared_head.norm`), as in deepseek_v3.py; see there why.

mlx-lm's glm4_moe sanitize drops keys starting with `model.layers.{N}`: the
first appended layer only, never a second one, and it never stacks that
layer's experts. The appended layers are split off before it runs.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import glm4_moe
from mlx_lm.models.base import create_attention_mask

from engine.backends.base import Backend, Tape, build_trunk
from engine.backends.nextn import SharedHead, load_heads, split_weights


class MTPLayer(glm4_moe.DecoderLayer):
    """One nextn layer: the trunk's block plus the fusion in front of it."""

    def __init__(self, args: glm4_moe.ModelArgs, layer_idx: int):
        super().__init__(args, layer_idx)
        d, eps = args.hidden_size, args.rms_norm_eps
        self.enorm = nn.RMSNorm(d, eps=eps)
        self.hnorm = nn.RMSNorm(d, eps=eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.shared_head = SharedHead(d, eps)

    def __call__(self, hidden: mx.array, embeds: mx.array, cache) -> mx.array:  # type: ignore[override]
        x = mx.concatenate([self.enorm(embeds), self.hnorm(hidden)], axis=-1)
        x = self.eh_proj(x)
        x = super().__call__(x, create_attention_mask(x, cache), cache)
        return self.shared_head.norm(x)


class Glm4MoeBackend(Backend):
    family = "glm4_moe"

    def forward(self, tokens, cache, tape: Tape | None = None, last: bool = False):
        model = self.trunk.model
        h = model.embed_tokens(tokens)
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(model.layers, cache):
            h = layer(h, mask, c)
        h = model.norm(h)
        return self.trunk.lm_head(h[:, -1:] if last else h), h

    def head(self, k, hidden, tokens, cache, last=False):
        h = self.heads[k](hidden, self.trunk.model.embed_tokens(tokens), cache)
        return self.trunk.lm_head(h[:, -1:] if last else h), h


def load(folder: Path, config: dict, weights: dict) -> Glm4MoeBackend:
    trunk_weights, head_weights = split_weights(config, weights)
    trunk = build_trunk(glm4_moe.Model, glm4_moe.ModelArgs, config, trunk_weights)
    return Glm4MoeBackend(trunk, load_heads(trunk, MTPLayer, head_weights))
