"""MiMo-V2-Flash (mimo_v2_flash): global and sliding-window attention layers (with
attention sinks) over an MoE trunk; several MTP heads under `model.mtp.layers.{i}`.

Head i on the pair (hidden_t, token_{t+1}):

    x = eh_proj(concat[enorm(embed(token)), hnorm(hidden_t)])   embedding FIRST
    x = x + self_attn(input_layernorm(x))       sliding-window attention, own KV
    x = x + mlp(pre_mlp_layernorm(x))           dense MLP (intermediate_size)
    h = final_layernorm(x)          -> lm_head -> logits; h feeds head i+1

The head's attention has the shape of the trunk's sliding-window layers (its
heads, head dims, sink logits, rope base and window), as the public loaders build
it. The hidden consumed is the one the output head reads: the trunk after its
final norm, a head after its `final_layernorm` (what the public loaders pass on).
The embedding and LM head are the trunk's: the MTP layers carry no copies.

Caches: every layer, heads included, keeps a plain KVCache and applies the
window as a mask (`create_attention_mask(..., window_size=W)`), instead of
mlx-lm's RotatingKVCache. Attention is the same (each query sees its last W
positions); a plain cache trims exactly after a rejected draft, where a rotating
one that has wrapped cannot, and it is what the session bank and continuous
batching store. The cost: sliding-window layers keep every position's KV.

mlx-lm's sanitize stacks the trunk's experts, dequantises fp8 blocks and drops
`model.mtp.*`; the head tensors are split off first and go through the same
sanitize presented as a trunk layer, so fp8 heads are dequantised the same way.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import mimo_v2_flash
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from engine.backends.base import Backend, Tape, build_trunk, materialize, split_numbered
from engine.checkpoint import CheckpointError

HEAD_PREFIX = "model.mtp.layers."
# The head's tensors pass through the trunk's sanitize under this name.
SLOT = "model.layers.0."


class MTPLayer(nn.Module):
    """One MTP head, named as the checkpoint names it."""

    def __init__(self, args: mimo_v2_flash.ModelArgs):
        super().__init__()
        d, eps = args.hidden_size, args.layernorm_epsilon
        self.window = args.sliding_window_size
        self.enorm = nn.RMSNorm(d, eps=eps)
        self.hnorm = nn.RMSNorm(d, eps=eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.input_layernorm = nn.RMSNorm(d, eps=eps)
        self.self_attn = mimo_v2_flash.Attention(args, is_sliding_window=True)
        self.pre_mlp_layernorm = nn.RMSNorm(d, eps=eps)
        self.mlp = mimo_v2_flash.MLP(args)
        self.final_layernorm = nn.RMSNorm(d, eps=eps)

    def __call__(self, hidden: mx.array, embeds: mx.array, cache) -> mx.array:
        x = self.eh_proj(mx.concatenate([self.enorm(embeds), self.hnorm(hidden)], axis=-1))
        mask = create_attention_mask(x, cache, window_size=self.window)
        x = x + self.self_attn(self.input_layernorm(x), mask, cache)
        x = x + self.mlp(self.pre_mlp_layernorm(x))
        return self.final_layernorm(x)


class MimoV2FlashBackend(Backend):
    family = "mimo_v2_flash"

    def make_cache(self):
        return [KVCache() for _ in self.trunk.model.layers]

    def forward(self, tokens, cache, tape: Tape | None = None, last: bool = False):
        model = self.trunk.model
        h = model.embed_tokens(tokens)
        full = create_attention_mask(h, cache[0])
        window = create_attention_mask(h, cache[0], window_size=model.sliding_window_size)
        for layer, c in zip(model.layers, cache):
            h = layer(h, window if layer.is_sliding_window else full, c)
        h = model.norm(h)
        return self.trunk.lm_head(h[:, -1:] if last else h), h

    def head(self, k, hidden, tokens, cache, last=False):
        h = self.heads[k](hidden, self.trunk.model.embed_tokens(tokens), cache)
        return self.trunk.lm_head(h[:, -1:] if last else h), h


def load_head(trunk: nn.Module, layer_weights: dict) -> MTPLayer:
    sanitized = trunk.sanitize({SLOT + k: v for k, v in layer_weights.items()
                                if not k.endswith("rotary_emb.inv_freq")})
    head = MTPLayer(trunk.args)
    head.load_weights([(k[len(SLOT):], v) for k, v in sanitized.items()], strict=True)
    materialize(head)
    return head


def load(folder: Path, config: dict, weights: dict) -> MimoV2FlashBackend:
    trunk_weights, head_weights = split_numbered(weights, HEAD_PREFIX)
    trunk = build_trunk(mimo_v2_flash.Model, mimo_v2_flash.ModelArgs, config, trunk_weights)
    return MimoV2FlashBackend(trunk, [load_head(trunk, h) for h in head_weights])
