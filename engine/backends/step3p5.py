"""Step-3.5 (step3p5): full and sliding-window attention with per-head output
gates, MoE trunk, zero-centred norms; next-n MTP heads appended as layers.

Head i is layer `model.layers.{num_hidden_layers + i}`. On the pair
(hidden_t, token_{t+1}):

    x = eh_proj(concat[enorm(embed(token)), hnorm(hidden_t)])   embedding FIRST
    x = decoder block (the trunk's type for layer N+i, own KV)
    logits = lm_head(transformer.shared_head.norm(x)); x feeds head i+1

Which hidden the heads consume: the trunk's before its final norm, and a head's
block output before `shared_head.norm` (the public loaders' chaining: their trunk
returns un-normed states and applies the norm only to compute logits). The
block's type follows the config's per-layer lists, which cover the MTP layers:
`layer_types[N+i]` (sliding window or full), `rope_theta[N+i]`,
`partial_rotary_factors[N+i]`, `moe_layers_enum` (the released MTP layers are
dense). Each MTP layer stores a copy of the output head
(`transformer.shared_head.output`); the training framework ties it to the main
model's output layer, so the trunk's lm_head is used and the copy dropped.

Norms: zero-centred. mlx-lm's sanitize adds 1 to the trunk's norms when it sees the
original layout and leaves its own (converted) layout alone; the heads' norms get
the +1 exactly when the trunk's did, and never when mtplxd's converter recorded that
it stored them shifted.

Caches: plain KVCache everywhere, the window applied as a mask (see
mimo_v2_flash.py for why not mlx-lm's RotatingKVCache).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import step3p5
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from engine.backends.base import Backend, Tape, build_trunk, materialize
from engine.backends.nextn import split_weights
from engine.checkpoint import CheckpointError, conversion_record

SHARED_WITH_TRUNK = ("embed_tokens.", "transformer.shared_head.output.")
# The head's tensors pass through the trunk's sanitize (MoE remapping) under this name.
SLOT = "model.layers.0."


class SharedHead(nn.Module):
    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.norm = step3p5.ZeroCenteredRMSNorm(dims, eps=eps)


class Transformer(nn.Module):
    """Where the checkpoint keeps the head's norm: `transformer.shared_head.norm`."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.shared_head = SharedHead(dims, eps)


class MTPLayer(step3p5.Step3p5DecoderLayer):
    """One next-n layer: the trunk's block for its index plus the fusion in front."""

    def __init__(self, args: step3p5.ModelArgs, layer_idx: int):
        super().__init__(args, layer_idx)
        d, eps = args.hidden_size, args.rms_norm_eps
        self.window = args.sliding_window if self.is_sliding else None
        self.enorm = step3p5.ZeroCenteredRMSNorm(d, eps=eps)
        self.hnorm = step3p5.ZeroCenteredRMSNorm(d, eps=eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.transformer = Transformer(d, eps)

    def __call__(self, hidden: mx.array, embeds: mx.array, cache) -> mx.array:  # type: ignore[override]
        x = self.eh_proj(mx.concatenate([self.enorm(embeds), self.hnorm(hidden)], axis=-1))
        mask = create_attention_mask(x, cache, window_size=self.window)
        return super().__call__(x, mask, cache)


class Step3p5Backend(Backend):
    family = "step3p5"

    def make_cache(self):
        return [KVCache() for _ in self.trunk.model.layers]

    def forward(self, tokens, cache, tape: Tape | None = None, last: bool = False):
        model = self.trunk.model
        h = model.embed_tokens(tokens)
        full = create_attention_mask(h, cache[0])
        window = create_attention_mask(h, cache[0], window_size=self.trunk.args.sliding_window)
        for layer, c in zip(model.layers, cache):
            h = layer(h, window if layer.is_sliding else full, c)
        return self.trunk.lm_head(model.norm(h[:, -1:] if last else h)), h

    def head(self, k, hidden, tokens, cache, last=False):
        head = self.heads[k]
        h = head(hidden, self.trunk.model.embed_tokens(tokens), cache)
        normed = head.transformer.shared_head.norm(h[:, -1:] if last else h)
        return self.trunk.lm_head(normed), h


def _is_norm(key: str) -> bool:
    return key.endswith("norm.weight")


def head_needs_shift(config: dict, stored: mx.array, loaded: mx.array) -> bool:
    """Add 1 to the heads' norms exactly when mlx-lm added it to the trunk's (it decides
    by layout), unless mtplxd's converter stored them shifted already; a converted
    trunk that mlx-lm shifted again would carry +2: refused."""
    shifted_now = not mx.array_equal(stored, loaded).item()
    if conversion_record(config).get("norm_shift_applied"):
        if shifted_now:
            raise CheckpointError("config.json says the zero-centred norms were shifted at conversion, "
                                  "but mlx-lm shifted the trunk again: reconvert from the original")
        return False
    return shifted_now


def prepare_head_weights(trunk: nn.Module, layer_weights: dict, shift: bool) -> dict:
    """Drop the copies of trunk tensors, remap a MoE head's experts as the trunk's
    sanitize does, and give the norms their +1 (or not) by the trunk's rule."""
    own = {k: v for k, v in layer_weights.items()
           if not k.startswith(SHARED_WITH_TRUNK) and not k.endswith("rotary_emb.inv_freq")}
    sanitized = {k[len(SLOT):]: v for k, v in trunk.sanitize({SLOT + k: v for k, v in own.items()}).items()}
    # sanitize shifts by what it sees of one layer alone: take the norms as stored.
    for key, value in own.items():
        if _is_norm(key):
            sanitized[key] = value + 1.0 if shift else value
    return sanitized


def load(folder: Path, config: dict, weights: dict) -> Step3p5Backend:
    trunk_weights, head_weights = split_weights(config, weights)
    trunk = build_trunk(step3p5.Model, step3p5.ModelArgs, config, trunk_weights)
    n = trunk.args.num_hidden_layers
    for name in ("layer_types", "partial_rotary_factors", "rope_theta"):
        listed = config.get(name)
        if isinstance(listed, list) and len(listed) < n + len(head_weights):
            raise CheckpointError(f"config.json {name} lists {len(listed)} layers; the {len(head_weights)} "
                                  f"MTP layer(s) after the {n} trunk layers need {n + len(head_weights)}")
    shift = head_needs_shift(config, trunk_weights["model.norm.weight"], trunk.model.norm.weight)
    heads: list[nn.Module] = []
    for i, layer_weights in enumerate(head_weights):
        head = MTPLayer(trunk.args, n + i)
        head.load_weights(list(prepare_head_weights(trunk, layer_weights, shift).items()), strict=True)
        materialize(head)
        heads.append(head)
    return Step3p5Backend(trunk, heads)
