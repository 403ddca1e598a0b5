"""Qwen3-Next: hybrid GatedDeltaNet / gated-attention trunk with MoE MLPs, MTP under `mtp.*`.

Head k (drafting depth k+1) on the pair (hidden_t, token_{t+1}):

    x = fc(concat[pre_fc_norm_embedding(embed(token)), pre_fc_norm_hidden(hidden_t)])
    x = full-attention decoder layer `mtp.layers.{k}` (own KV cache, MoE MLP)
    h = norm(x)                   -> shared LM head -> logits; h feeds head k+1

`fc`, the two pre-fc norms and the final `norm` are shared by every
`mtp.layers.{k}` (the layout vLLM reads: step k uses layer k). Embedding
first in the concat, as DeepSeek; the embedding table and LM head are the
trunk's.

Decisions:
- The trunk hidden handed to head 0 is the final-normed one (the vector the LM
  head reads), as vLLM's Qwen3-Next MTP consumes it. pre_fc_norm_hidden
  renormalises it anyway, so the choice only reweights channels; it affects
  acceptance, never exactness.
- Qwen's RMSNorm weights are stored zero-centred (applied as 1 + w). mlx-lm's
  sanitize adds the 1 to trunk norms but drops the `mtp.*` tensors first, so
  the head norms are shifted here, once, and only when mlx-lm shifted the
  trunk (checked by comparing the loaded final norm with the stored one), so
  trunk and head always agree. `linear_attn.norm` is a plain RMSNorm: never.
  A folder written by `mtplxd convert` stores both already shifted, in mlx-lm's
  layout, and records so in config.json (head_needs_shift).
- The head count comes from the `mtp.layers.{i}` keys: the released config
  has no MTP count field.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_next
from mlx_lm.models.base import create_attention_mask, create_ssm_mask

from engine.backends.base import Backend, Tape, build_trunk, load_head_weights
from engine.checkpoint import CheckpointError, conversion_record
from engine.distributed import pipeline_trunk, pass_stage, receive_stage

HEAD_PREFIX = "mtp."
# Module names of Qwen's zero-centred norms inside the head (relative to `mtp.`).
ZERO_CENTRED = {
    "input_layernorm", "post_attention_layernorm", "q_norm", "k_norm",
    "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm",
}
SHARED = ("fc.", "pre_fc_norm_embedding.", "pre_fc_norm_hidden.", "norm.")


class MTPLayer(qwen3_next.Qwen3NextDecoderLayer):
    """The trunk's full-attention decoder layer plus the fusion in front and norm behind."""

    def __init__(self, args: qwen3_next.ModelArgs, moe: bool):
        # Any full-attention index gives a gated-attention mixer.
        super().__init__(args, layer_idx=args.full_attention_interval - 1)
        d, eps = args.hidden_size, args.rms_norm_eps
        if moe:
            self.mlp = qwen3_next.Qwen3NextSparseMoeBlock(args)
        else:
            self.mlp = qwen3_next.Qwen3NextMLP(d, args.intermediate_size)  # type: ignore[assignment]
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


class Qwen3NextBackend(Backend):
    family = "qwen3_next"

    def _lm_head(self, h: mx.array) -> mx.array:
        if self.trunk.args.tie_word_embeddings:
            return self.trunk.model.embed_tokens.as_linear(h)
        return self.trunk.lm_head(h)

    def shard(self, group) -> str:
        """mlx-lm has no tensor-parallel split for Qwen3-Next: its layers are split instead."""
        return pipeline_trunk(self.trunk.model, self.family, group)

    def forward(self, tokens, cache, tape: Tape | None = None, last: bool = False):
        model = self.trunk.model
        h = model.embed_tokens(tokens)
        # On several ranks this rank holds only some layers (a pipeline); cache is theirs.
        fa_mask = create_attention_mask(h, cache[model.fa_idx]) if model.fa_idx is not None else None
        ssm_mask = create_ssm_mask(h, cache[model.ssm_idx]) if model.ssm_idx is not None else None
        if tape is not None:
            tape.length = tokens.shape[1]  # what rewind undoes; the loop sets the same
        h = receive_stage(model, h)
        for i, (layer, c) in enumerate(zip(model.pipeline_layers, cache)):
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
        h = model.norm(pass_stage(model, h, cache))
        return self._lm_head(h[:, -1:] if last else h), h

    def head(self, k, hidden, tokens, cache, last=False):
        h = self.heads[k](hidden, self.trunk.model.embed_tokens(tokens), cache)
        return self._lm_head(h[:, -1:] if last else h), h

    def replay(self, layer, mixer_input, cache):
        # Same call the forward made, over the kept prefix only, from the restored state.
        # A batch of rows (engine/batch.py) keeps a different prefix per row: the cache's
        # lengths mask the rest (None for one row).
        self.trunk.model.pipeline_layers[layer].linear_attn(mixer_input, cache.make_mask(mixer_input.shape[1]), cache)


# --- loading helpers, shared with the Qwen3.5 backend -------------------------


def head_indices(head: dict) -> list[int]:
    """The `layers.{i}` indices present in the (prefix-stripped) head tensors."""
    found = {int(m.group(1)) for k in head if (m := re.match(r"layers\.(\d+)\.", k))}
    return sorted(found)


def stack_experts(head: dict, prefix: str, n_experts: int) -> None:
    """Per-expert `experts.{e}.{proj}.weight` -> SwitchGLU's stacked `switch_mlp.{proj}.weight`."""
    if f"{prefix}experts.0.up_proj.weight" not in head:
        return
    for proj in ("gate_proj", "up_proj", "down_proj"):
        parts = [head.pop(f"{prefix}experts.{e}.{proj}.weight") for e in range(n_experts)]
        head[f"{prefix}switch_mlp.{proj}.weight"] = mx.stack(parts)


def shift_norms(head: dict) -> None:
    """Add the 1 Qwen's zero-centred norms leave out (call exactly once)."""
    for key, value in head.items():
        module = key.split(".")[-2]
        if module in ZERO_CENTRED and value.ndim == 1 and ".linear_attn." not in key:
            head[key] = value + 1.0


def trunk_was_shifted(stored_norm: mx.array, loaded_norm: mx.array) -> bool:
    """Did mlx-lm's sanitize add 1 to the trunk's norms? (It decides by checkpoint layout.)"""
    return not mx.array_equal(stored_norm, loaded_norm).item()


def head_needs_shift(config: dict, stored_norm: mx.array, loaded_norm: mx.array) -> bool:
    """Shift the head norms exactly when mlx-lm shifted the trunk's, unless mtplxd's
    converter already stored them shifted (it records that in config.json). A converted
    trunk is in mlx-lm's own layout, which mlx-lm never shifts again; if it did, trunk
    and head would both carry the +1 twice, which collapses acceptance: refuse."""
    shifted_now = trunk_was_shifted(stored_norm, loaded_norm)
    if conversion_record(config).get("norm_shift_applied"):
        if shifted_now:
            raise CheckpointError("config.json says the Qwen norm shift was applied at conversion, "
                                  "but mlx-lm shifted the trunk again: reconvert from the original")
        return False
    return shifted_now


def layer_weights(head: dict, k: int) -> dict:
    """Head k's tensors: layer k's own plus the shared fc / pre-fc norms / final norm."""
    own = {key[len(f"layers.{k}."):]: v for key, v in head.items() if key.startswith(f"layers.{k}.")}
    shared = {key: v for key, v in head.items() if key.startswith(SHARED)}
    return {**shared, **own}


def build_heads(make_layer, head: dict) -> list[nn.Module]:
    """One head per `layers.{k}`, each built by `make_layer()` and loaded strictly."""
    heads = []
    for k in head_indices(head):
        layer = make_layer()
        load_head_weights(layer, layer_weights(head, k), "")
        heads.append(layer)
    return heads


def load(folder: Path, config: dict, weights: dict) -> Qwen3NextBackend:
    head = {k[len(HEAD_PREFIX):]: v for k, v in weights.items() if k.startswith(HEAD_PREFIX)}
    trunk_weights = {k: v for k, v in weights.items() if not k.startswith(HEAD_PREFIX)}
    # mlx-lm's ModelArgs may rewrite nested dicts (rope settings): keep the caller's intact.
    trunk = build_trunk(qwen3_next.Model, qwen3_next.ModelArgs, copy.deepcopy(config), trunk_weights)
    args = trunk.args
    for k in head_indices(head):
        stack_experts(head, f"layers.{k}.mlp.", args.num_experts)
    if head_needs_shift(config, weights["model.norm.weight"], trunk.model.norm.weight):
        shift_norms(head)
    moe = any(k.endswith("mlp.gate.weight") for k in head)
    return Qwen3NextBackend(trunk, build_heads(lambda: MTPLayer(args, moe), head))
