"""Qwen3.5 / 3.6, dense and MoE: the Qwen3-Next hybrid trunk inside a vision-language wrapper.

Families "qwen3_5" (dense MLPs) and "qwen3_5_moe" (MoE MLPs) share this module:
mlx-lm's two model classes differ only in how `sanitize` reads the experts, and
the structure follows `num_experts` in the text config.

Checkpoint layout (Qwen/Qwen3.5-*): config.json nests the language model under
`text_config` (with `mtp_num_hidden_layers`); trunk tensors under
`model.language_model.*`, a vision tower `model.visual.*` (mlx-lm's sanitize
drops it), the LM head `lm_head.weight` (absent when tied). The MTP head sits
under `mtp.*`, which conversions also spell `language_model.mtp.*` or
`model.language_model.mtp.*`, sometimes in a sidecar `mtp.safetensors`.

The head is Qwen3-Next's (see engine/backends/qwen3_next.py for the fusion,
the shared fc / norms, and the decisions): the trunk hidden is taken after the
final norm, and the zero-centred head norms get their +1 once, exactly when
mlx-lm gave it to the trunk. MoE heads store their experts fused, as the trunk
does (`experts.gate_up_proj` [E, 2I, D], `experts.down_proj` [E, D, I]);
per-expert tensors are stacked as well.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5, qwen3_5_moe
from mlx_lm.models.base import create_attention_mask, create_ssm_mask

from engine.backends.base import Backend, Tape, build_trunk
from engine.backends.qwen3_next import (
    build_heads,
    head_indices,
    head_needs_shift,
    shift_norms,
    stack_experts,
)
from engine.checkpoint import text_config

HEAD_RE = re.compile(r"^(?:model\.)?(?:language_model\.)?mtp\.")


class MTPLayer(qwen3_5.DecoderLayer):
    """The trunk's full-attention decoder layer plus the fusion in front and norm behind."""

    def __init__(self, args: qwen3_5.TextModelArgs):
        # Any full-attention index gives a gated-attention mixer; the MLP follows num_experts.
        super().__init__(args, layer_idx=args.full_attention_interval - 1)
        d, eps = args.hidden_size, args.rms_norm_eps
        self.pre_fc_norm_embedding = nn.RMSNorm(d, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(d, eps=eps)
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.norm = nn.RMSNorm(d, eps=eps)

    def __call__(self, hidden: mx.array, embeds: mx.array, cache) -> mx.array:  # type: ignore[override]
        x = mx.concatenate(
            [self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], axis=-1
        )
        x = self.fc(x)
        x = super().__call__(x, create_attention_mask(x, cache), cache)
        return self.norm(x)


class Qwen3_5Backend(Backend):
    def __init__(self, family: str, trunk: nn.Module, heads: list[nn.Module]):  # trunk: a qwen3_5(_moe) Model
        self.family = family
        self.trunk = trunk
        self.text = trunk.language_model  # TextModel: .model, .args, .lm_head
        self.heads = heads
        self.vocab_size = self.text.args.vocab_size

    def _lm_head(self, h: mx.array) -> mx.array:
        if self.text.args.tie_word_embeddings:
            return self.text.model.embed_tokens.as_linear(h)
        return self.text.lm_head(h)

    def forward(self, tokens, cache, tape: Tape | None = None, last: bool = False):
        model = self.text.model
        h = model.embed_tokens(tokens)
        fa_mask = create_attention_mask(h, cache[model.fa_idx])
        ssm_mask = create_ssm_mask(h, cache[model.ssm_idx])
        if tape is not None:
            tape.length = tokens.shape[1]  # what rewind undoes; the loop sets the same
        for i, (layer, c) in enumerate(zip(model.layers, cache)):
            x = layer.input_layernorm(h)
            if layer.is_linear:
                # Recurrent state cannot be trimmed: keep its input for replay.
                if tape is not None:
                    tape.record(i, c, x)
                r = layer.linear_attn(x, ssm_mask, c)
            else:
                r = layer.self_attn(x, fa_mask, c)
            h = h + r
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = model.norm(h)
        return self._lm_head(h[:, -1:] if last else h), h

    def head(self, k, hidden, tokens, cache, last=False):
        h = self.heads[k](hidden, self.text.model.embed_tokens(tokens), cache)
        return self._lm_head(h[:, -1:] if last else h), h

    def replay(self, layer, mixer_input, cache):
        # Same call the forward made, over the kept prefix only, from the restored state.
        # A batch of rows (engine/batch.py) keeps a different prefix per row: the cache's
        # lengths mask the rest (None for one row).
        self.text.model.layers[layer].linear_attn(mixer_input, cache.make_mask(mixer_input.shape[1]), cache)


def split_weights(weights: dict) -> tuple[dict, dict]:
    """(trunk tensors, head tensors with the `...mtp.` prefix stripped)."""
    trunk, head = {}, {}
    for key, value in weights.items():
        m = HEAD_RE.match(key)
        if m:
            head[key[m.end():]] = value
        else:
            trunk[key] = value
    return trunk, head


def unfuse_experts(head: dict, prefix: str) -> None:
    """Fused HF experts -> SwitchGLU's stacked gate / up / down (gate is the first half)."""
    gate_up = head.pop(f"{prefix}experts.gate_up_proj", None)
    if gate_up is None:
        return
    mid = gate_up.shape[-2] // 2
    head[f"{prefix}switch_mlp.gate_proj.weight"] = gate_up[..., :mid, :]
    head[f"{prefix}switch_mlp.up_proj.weight"] = gate_up[..., mid:, :]
    head[f"{prefix}switch_mlp.down_proj.weight"] = head.pop(f"{prefix}experts.down_proj")


def stored_final_norm(trunk_weights: dict) -> mx.array:
    """The trunk's final norm as stored, wherever the text model is rooted."""
    embed = next(
        k for k in trunk_weights
        if k.endswith("embed_tokens.weight") and not k.startswith("model.visual")
    )
    return trunk_weights[embed[: -len("embed_tokens.weight")] + "norm.weight"]


def load(folder: Path, config: dict, weights: dict) -> Qwen3_5Backend:
    moe = text_config(config).get("num_experts", 0) > 0
    module = qwen3_5_moe if moe else qwen3_5
    trunk_weights, head = split_weights(weights)
    # mlx-lm wants the outer config; its TextModelArgs rewrites rope_parameters in place.
    trunk = build_trunk(module.Model, module.ModelArgs, copy.deepcopy(config), trunk_weights)
    args = trunk.language_model.args
    for k in head_indices(head):
        unfuse_experts(head, f"layers.{k}.mlp.")
        stack_experts(head, f"layers.{k}.mlp.", args.num_experts)
    if head_needs_shift(config, stored_final_norm(trunk_weights), trunk.language_model.model.norm.weight):
        shift_norms(head)
    family = "qwen3_5_moe" if moe else "qwen3_5"
    return Qwen3_5Backend(family, trunk, build_heads(lambda: MTPLayer(args), head))
