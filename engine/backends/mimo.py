"""MiMo (XiaomiMiMo/MiMo-7B): dense Qwen2-like trunk, MTP heads `model.mtp_layers.{i}`.

Head i (drafting depth i+1) on the pair (hidden_t, token_{t+1}):

    x = input_proj(concat[hidden_layernorm(hidden_t), token_layernorm(embed(token))])
    x = decoder block (own attention KV)
    h = final_layernorm(x)        -> LM head -> logits; h feeds head i+1

MiMo puts the hidden state first in the concat (DeepSeek and Qwen put the
embedding first). The trunk's hidden is its final-normed output, the same
vector its LM head reads.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import mimo
from mlx_lm.models.base import create_attention_mask

from engine.backends.base import Backend, Tape, build_trunk, load_head_weights

HEAD_PREFIX = "model.mtp_layers."


class MTPLayer(mimo.TransformerBlock):
    """One MiMo MTP layer: the trunk's block plus the fusion in front of it."""

    def __init__(self, args: mimo.ModelArgs):
        super().__init__(args)
        d, eps = args.hidden_size, args.rms_norm_eps
        self.token_layernorm = nn.RMSNorm(d, eps=eps)
        self.hidden_layernorm = nn.RMSNorm(d, eps=eps)
        self.input_proj = nn.Linear(2 * d, d, bias=False)
        self.final_layernorm = nn.RMSNorm(d, eps=eps)

    def __call__(self, hidden: mx.array, embeds: mx.array, cache) -> mx.array:
        x = mx.concatenate(
            [self.hidden_layernorm(hidden), self.token_layernorm(embeds)], axis=-1
        )
        x = self.input_proj(x)
        x = super().__call__(x, create_attention_mask(x, cache), cache)
        return self.final_layernorm(x)


class MiMoBackend(Backend):
    family = "mimo"

    def _lm_head(self, h: mx.array) -> mx.array:
        if self.trunk.args.tie_word_embeddings:
            return self.trunk.model.embed_tokens.as_linear(h)
        return self.trunk.lm_head(h)

    def forward(self, tokens, cache, tape: Tape | None = None):
        model = self.trunk.model
        h = model.embed_tokens(tokens)
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(model.layers, cache):
            h = layer(h, mask, c)
        h = model.norm(h)
        return self._lm_head(h), h

    def head(self, k, hidden, tokens, cache):
        h = self.heads[k](hidden, self.trunk.model.embed_tokens(tokens), cache)
        return self._lm_head(h), h


def head_count(weights: dict) -> int:
    indices = {int(k[len(HEAD_PREFIX):].split(".")[0]) for k in weights if k.startswith(HEAD_PREFIX)}
    return len(indices)


def load(folder: Path, config: dict, weights: dict) -> MiMoBackend:
    n_heads = head_count(weights)
    trunk_weights = {k: v for k, v in weights.items() if not k.startswith(HEAD_PREFIX)}
    trunk = build_trunk(mimo.Model, mimo.ModelArgs, config, trunk_weights)
    heads = []
    for i in range(n_heads):
        head = MTPLayer(trunk.args)
        load_head_weights(head, weights, f"{HEAD_PREFIX}{i}.")
        heads.append(head)
    return MiMoBackend(trunk, heads)
