"""Nemotron-H (nemotron_h): a hybrid trunk of Mamba2, attention (NoPE), MoE and MLP
blocks laid out by `hybrid_override_pattern`; MTP heads under `mtp.layers.{i}`.

One head is P consecutive layers, P the number of MTP blocks the config names
(`mtp_layers_block_type`, e.g. ["attention", "moe"], or the older pattern string
`mtp_hybrid_override_pattern`, e.g. "*E"): head k is `mtp.layers.{kP}` ..
`mtp.layers.{kP+P-1}`. On the pair (hidden_t, token_{t+1}):

    x = eh_proj(concat[enorm(embed(token)), hnorm(hidden_t)])   embedding FIRST (layer kP)
    x = x + mixer_j(norm_j(x))            for each of the head's blocks j (attention: own KV)
    h = final_layernorm(x)               (layer kP+P-1) -> lm_head -> logits; h feeds head k+1

Which hidden the heads consume: the trunk's after its final norm (`norm_f`), the
vector the output head reads, and a head's after `final_layernorm`: what the public
inference engines pass to and between the MTP layers. The embedding and the LM head
are the trunk's (the MTP layers carry no copies).

Rollback. Attention KV is trimmed. A Mamba2 layer's state (the conv window, the last
K-1 conv inputs, and the SSM state [B, H, Dh, N]) cannot be trimmed: the forward
records each Mamba2 mixer's input on the Tape, and rewind restores the state from
before the verify window (the mixer replaces its arrays rather than mutating them,
so holding them is a zero-copy snapshot) and replays the kept prefix through the
mixer. In a batch (engine/batch.py) every row keeps its own prefix: the cache's
`lengths` say how many positions each row keeps. mlx-lm's Mamba2 mixer honours them
for the conv window but not for the SSM state: with the dropped positions at the
end of a row, its masked scan zeroes the decay from the row's last position and
drops the kept inputs too. So the replay of rows of different lengths runs the
mixer's steps here and hands the scan each row's length (mlx-lm's `ssm_attn`, which
then reads the state at the row's last kept position); one row replays with the
mixer's own call, as the forward ran it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import nemotron_h
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.ssm import ssm_attn

from engine.backends.base import Backend, Tape, build_trunk, materialize, split_numbered
from engine.backends.descriptors import head_block_types, head_blocks_problem
from engine.checkpoint import CheckpointError

HEAD_PREFIX = "mtp.layers."
# A head layer's tensors pass through the trunk's sanitize (expert stacking, conv layout) as this layer.
SLOT = "backbone.layers.0."
SYMBOLS = {"attention": "*", "moe": "E", "mlp": "-"}


class MTPBlock(nemotron_h.NemotronHBlock):
    """One layer of a head: the trunk's block, plus the fusion on a head's first layer
    and the final norm on its last."""

    def __init__(self, args: nemotron_h.ModelArgs, kind: str, first: bool, last: bool):
        super().__init__(args, SYMBOLS[kind])
        d, eps = args.hidden_size, args.layer_norm_epsilon
        if first:
            self.enorm = nn.RMSNorm(d, eps=eps)
            self.hnorm = nn.RMSNorm(d, eps=eps)
            self.eh_proj = nn.Linear(2 * d, d, bias=False)
        if last:
            self.final_layernorm = nn.RMSNorm(d, eps=eps)


class MTPHead(nn.Module):
    """Head k: `layers.{j}` is checkpoint layer `mtp.layers.{kP + j}`."""

    def __init__(self, args: nemotron_h.ModelArgs, blocks: tuple[str, ...]):
        super().__init__()
        n = len(blocks)
        self.layers = [MTPBlock(args, kind, j == 0, j == n - 1) for j, kind in enumerate(blocks)]

    def __call__(self, hidden: mx.array, embeds: mx.array, cache) -> mx.array:
        first, last = self.layers[0], self.layers[-1]
        x = first.eh_proj(mx.concatenate([first.enorm(embeds), first.hnorm(hidden)], axis=-1))
        mask = create_attention_mask(x, cache)
        for layer in self.layers:
            attention = layer.block_type == "*"  # exactly one per head (descriptors.head_blocks_problem)
            x = layer(x, mask=mask if attention else None, cache=cache if attention else None)
        return last.final_layernorm(x)


class NemotronHBackend(Backend):
    family = "nemotron_h"

    def __init__(self, trunk: nn.Module, heads: list[nn.Module]):
        super().__init__(trunk, heads)
        # make_cache holds one cache per Mamba2 or attention layer, in layer order:
        # cache index -> the layer it belongs to.
        self.cached_layers = [i for i, layer in enumerate(trunk.layers) if layer.block_type in "M*"]

    def forward(self, tokens, cache, tape: Tape | None = None, last: bool = False):
        model = self.trunk.backbone
        h = model.embeddings(tokens)
        kinds = [model.layers[i].block_type for i in self.cached_layers]
        attn_mask = create_attention_mask(h, cache[kinds.index("*")]) if "*" in kinds else None
        ssm_mask = create_ssm_mask(h, cache[kinds.index("M")]) if "M" in kinds else None
        if tape is not None:
            tape.length = tokens.shape[1]  # what rewind undoes; the loop sets the same
        c = 0  # the next cache index
        for layer in model.layers:
            x = layer.norm(h)
            if layer.block_type == "M":
                # Recurrent state cannot be trimmed: keep the mixer's input for replay.
                if tape is not None:
                    tape.record(c, cache[c], x)
                r = layer.mixer(x, ssm_mask, cache[c])
                c += 1
            elif layer.block_type == "*":
                r = layer.mixer(x, attn_mask, cache[c])
                c += 1
            else:
                r = layer.mixer(x)
            h = h + r
        h = model.norm_f(h)
        return self.trunk.lm_head(h[:, -1:] if last else h), h

    def head(self, k, hidden, tokens, cache, last=False):
        h = self.heads[k](hidden, self.trunk.backbone.embeddings(tokens), cache)
        return self.trunk.lm_head(h[:, -1:] if last else h), h

    def replay(self, layer, mixer_input, cache):
        mixer = self.trunk.layers[self.cached_layers[layer]].mixer
        if cache.lengths is None:
            # One row: the same call the forward made, over the kept prefix only.
            mixer(mixer_input, None, cache)
        else:
            replay_rows(mixer, mixer_input, cache)

    def head_tensors(self) -> dict[str, mx.array]:
        """The heads' parameters under the checkpoint's names (`mtplxd convert`): head k's
        `layers.{j}.*` is `mtp.layers.{kP + j}.*`."""
        tensors: dict[str, mx.array] = {}
        for k, head in enumerate(self.heads):
            n = len(head.layers)
            for j, layer in enumerate(head.layers):
                flat = cast(list[tuple[str, mx.array]], tree_flatten(layer.parameters()))
                tensors.update({f"{HEAD_PREFIX}{k * n + j}.{name}": value for name, value in flat})
        return tensors


def replay_rows(mixer: nemotron_h.NemotronHMamba2Mixer, x: mx.array, cache: ArraysCache) -> None:
    """Advance a batch's Mamba2 state by each row's first cache.lengths[i] inputs of x
    [B, L, D] (the rest are dropped positions): the mixer's own steps, with the scan
    told each row's length."""
    lengths = cache.lengths
    mask = cache.make_mask(x.shape[1])
    inner, conv_dim = mixer.intermediate_size, mixer.conv_dim
    _, conv_input, dt = mx.split(mixer.in_proj(x), [inner, inner + conv_dim], axis=-1)
    conv_output = mixer._conv(conv_input, cache, mask)  # keeps each row's window ending at its length
    groups = mixer.n_groups * mixer.ssm_state_size
    states, B, C = mx.split(conv_output, [inner, inner + groups], axis=-1)
    b, n = states.shape[:2]
    limit = mixer.time_step_limit
    assert limit is not None  # ModelArgs sets it
    _, cache[1] = ssm_attn(
        states.reshape(b, n, mixer.num_heads, mixer.head_dim),
        mixer.A_log,
        B.reshape(b, n, mixer.n_groups, mixer.ssm_state_size),
        C.reshape(b, n, mixer.n_groups, mixer.ssm_state_size),
        mixer.D.astype(states.dtype),
        dt,
        mixer.dt_bias,
        cache[1],
        limit,
        mask=mask,
        lengths=lengths,
    )
    cache.advance(n)


def load_head(trunk: nn.Module, blocks: tuple[str, ...], layers: list[dict]) -> MTPHead:
    """One head from its P layers' tensors, each sanitized as a trunk layer would be."""
    own: dict[str, mx.array] = {}
    for j, tensors in enumerate(layers):
        sanitized = trunk.sanitize({SLOT + k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")})
        own.update({f"layers.{j}.{k[len(SLOT):]}": v for k, v in sanitized.items()})
    head = MTPHead(trunk.args, blocks)
    head.load_weights(list(own.items()), strict=True)
    materialize(head)
    return head


def load(folder: Path, config: dict, weights: dict) -> NemotronHBackend:
    trunk_weights, layers = split_numbered(weights, HEAD_PREFIX)
    # build_trunk untags time_step_limit's inf, which transformers 5 and mlx-lm save tagged.
    trunk = build_trunk(nemotron_h.Model, nemotron_h.ModelArgs, config, trunk_weights)
    heads: list[nn.Module] = []
    if layers:
        try:
            blocks = head_block_types(config)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        problem = head_blocks_problem(blocks)
        if problem:
            raise CheckpointError(problem)
        span = len(blocks)
        if len(layers) % span:
            raise CheckpointError(f"{len(layers)} MTP layers do not make whole heads of {span} blocks {list(blocks)}")
        heads = [load_head(trunk, blocks, layers[k : k + span]) for k in range(0, len(layers), span)]
    return NemotronHBackend(trunk, heads)
