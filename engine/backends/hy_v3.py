"""Hy-V3 (hy_v3, HYV3ForCausalLM): GQA attention with per-head q/k RMSNorm, a dense
first layer then MoE layers (many routed experts, sigmoid top-k, one shared expert);
MTP heads appended as layers. mlx-lm has no model for it: the trunk is written here.

Trunk, layer by layer (the released config.json and the public loaders):

    x = x + o_proj(attn(rope(q_norm(q)), rope(k_norm(k)), v))   norms per head, then rope
    x = x + mlp(post_attention_layernorm(x))                     mlp on input_layernorm'd x above
    mlp: SwiGLU for the first `first_k_dense_replace` layers, else
         s = sigmoid(router.gate(x))                  in float32
         top-k experts by s + expert_bias             (the bias only chooses)
         w = s[top-k] / sum(s[top-k]) * router_scaling_factor   (route_norm)
         sum_k w_k expert_k(x) + shared_mlp(x)

Head i is layer `model.layers.{num_hidden_layers + i}`. On the pair
(hidden_t, token_{t+1}):

    x = eh_proj(concat[enorm(embed(token)), hnorm(hidden_t)])   embedding FIRST
    x = decoder block (MoE, own KV)
    h = final_layernorm(x)        -> lm_head -> logits; h feeds head i+1

Which hidden the head consumes (HEAD_INPUT): "normed", the trunk after its final
norm and a head after `final_layernorm` (what the public inference engines pass
their Hy-V3 drafter), or "raw", both before their norm. Measured on the fixture's
heads distilled each way (docs/engine.md): the choice never breaks exactness,
only acceptance.

Checkpoint names kept as module names: `mlp.router.gate`, `mlp.expert_bias`,
`mlp.shared_mlp`; the per-expert tensors `mlp.experts.{e}.*` are stacked into
`mlp.switch_mlp.*` (mlx-lm's SwitchGLU) by `Model.sanitize`, which also takes
transformers' fused layout (`experts.gate_up_proj`, `gate`, `e_score_correction_bias`,
`shared_experts`) and leaves an already converted trunk alone. The MTP layer carries
no copy of the embedding or the output head; if one does, it is dropped.

Caches: one plain KVCache per layer and per head; rewind is a trim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import BaseModelArgs, create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import KVCache
from mlx_lm.models.switch_layers import SwitchGLU

from engine.backends.base import Backend, Tape, build_trunk
from engine.backends.nextn import load_heads, split_weights
from engine.checkpoint import CheckpointError

HEAD_INPUT = "normed"  # or "raw": see the module docstring
SHARED_WITH_TRUNK = ("embed_tokens.", "shared_head.")
SLOT = "model.layers.0."  # head tensors pass through the trunk's sanitize under this name


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    head_dim: int | None = None
    num_shared_experts: int = 1
    router_scaling_factor: float = 1.0
    route_norm: bool = True
    first_k_dense_replace: int = 1
    mlp_layer_types: list[str] | None = None
    qk_norm: bool = True
    hidden_act: str = "silu"
    rope_parameters: dict[str, Any] = field(default_factory=dict)
    rope_theta: float = 11158840.0
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        rope = self.rope_parameters or {}
        if rope.get("rope_type", "default") != "default":
            raise CheckpointError(f"hy_v3: rope_type {rope['rope_type']!r} is not implemented (only 'default')")
        self.rope_theta = float(rope.get("rope_theta", self.rope_theta))
        if self.hidden_act != "silu" or self.attention_bias or self.mlp_bias:
            raise CheckpointError("hy_v3: only silu MLPs without biases and attention without biases are "
                                  "implemented (as released)")

    def is_moe(self, layer: int) -> bool:
        """The trunk's per-layer list where the config has one (transformers), else
        first_k_dense_replace (the released config; it also decides the MTP layers)."""
        if self.mlp_layer_types and layer < len(self.mlp_layer_types):
            return self.mlp_layer_types[layer] == "sparse"
        return layer >= self.first_k_dense_replace


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        d, hd = args.hidden_size, args.head_dim
        assert hd is not None
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, hd
        self.scale = hd**-0.5
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)
        if args.qk_norm:
            self.q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
            self.k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.rope = nn.RoPE(hd, traditional=False, base=args.rope_theta)

    def __call__(self, x: mx.array, mask: Any, cache: Any) -> mx.array:
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
        q, k = self.rope(q, offset=cache.offset), self.rope(k, offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, dims: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dims, hidden, bias=False)
        self.up_proj = nn.Linear(dims, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dims, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)


class MoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k, self.norm_topk, self.scaling = args.num_experts_per_tok, args.route_norm, args.router_scaling_factor
        self.router = Router(args)
        self.expert_bias = mx.zeros((args.num_experts,))
        self.switch_mlp = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.num_experts)
        if args.num_shared_experts:
            self.shared_mlp = MLP(args.hidden_size, args.moe_intermediate_size * args.num_shared_experts)

    def __call__(self, x: mx.array) -> mx.array:
        scores = mx.sigmoid(self.router.gate(x.astype(mx.float32)).astype(mx.float32))
        choice = scores + self.expert_bias.astype(mx.float32)
        k = self.top_k
        chosen = mx.stop_gradient(mx.argpartition(-choice, kth=k - 1, axis=-1)[..., :k])
        weights = mx.take_along_axis(scores, chosen, axis=-1)
        if self.norm_topk:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        weights = weights * self.scaling
        y = (self.switch_mlp(x, chosen) * weights[..., None]).sum(axis=-2).astype(x.dtype)
        return y + self.shared_mlp(x) if "shared_mlp" in self else y


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        d, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Attention(args)
        self.mlp = MoE(args) if args.is_moe(layer) else MLP(d, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(d, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(d, eps=eps)

    def __call__(self, x: mx.array, mask: Any, cache: Any) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class HYV3Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(nn.Module):
    """The trunk, shaped as mlx-lm's models are (`model`, `lm_head`, `args`, `sanitize`,
    `make_cache`, `__call__`), so conversion, quantization and loading treat it alike."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = HYV3Model(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @property
    def layers(self) -> list[DecoderLayer]:
        return self.model.layers

    def logits(self, h: mx.array) -> mx.array:
        return self.lm_head(h) if "lm_head" in self else self.model.embed_tokens.as_linear(h)

    def hidden(self, tokens: mx.array, cache: list[Any]) -> mx.array:
        """The last layer's output, before the final norm."""
        h = self.model.embed_tokens(tokens)
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.model.layers, cache):
            h = layer(h, mask, c)
        return h

    def __call__(self, tokens: mx.array, cache: list[Any] | None = None) -> mx.array:
        cache = cache if cache is not None else self.make_cache()
        return self.logits(self.model.norm(self.hidden(tokens, cache)))

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.model.layers]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Released names -> this model's: experts stacked, transformers' names mapped back."""
        out: dict[str, mx.array] = {}
        experts: dict[str, dict[int, mx.array]] = {}
        for key, value in weights.items():
            if key.endswith("rotary_emb.inv_freq"):
                continue
            key = (key.replace("mlp.e_score_correction_bias", "mlp.expert_bias")
                   .replace("mlp.shared_experts.", "mlp.shared_mlp.")
                   .replace("mlp.gate.weight", "mlp.router.gate.weight"))
            if ".mlp.experts." in key:
                before, rest = key.split(".mlp.experts.", 1)
                if rest == "gate_up_proj":  # transformers: [E, 2I, D], gate rows first
                    gate, up = mx.split(value, 2, axis=1)
                    out[f"{before}.mlp.switch_mlp.gate_proj.weight"] = gate
                    out[f"{before}.mlp.switch_mlp.up_proj.weight"] = up
                elif rest == "down_proj":
                    out[f"{before}.mlp.switch_mlp.down_proj.weight"] = value
                else:  # the released layout: one tensor per expert
                    index, name = rest.split(".", 1)
                    experts.setdefault(f"{before}.mlp.switch_mlp.{name}", {})[int(index)] = value
                continue
            if self.args.tie_word_embeddings and key == "lm_head.weight":
                continue
            out[key] = value
        for key, by_expert in experts.items():
            if sorted(by_expert) != list(range(self.args.num_experts)):
                raise CheckpointError(f"{key}: experts {sorted(by_expert)[:4]}... of {self.args.num_experts}")
            out[key] = mx.stack([by_expert[e] for e in range(self.args.num_experts)])
        return out

    @property
    def quant_predicate(self):
        def predicate(path: str, _module: nn.Module) -> bool | dict:
            return {"group_size": 64, "bits": 8} if path.endswith("router.gate") else True

        return predicate


class MTPLayer(DecoderLayer):
    """One MTP layer: the trunk's block for its index plus the fusion in front and the
    final norm behind."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__(args, layer)
        d, eps = args.hidden_size, args.rms_norm_eps
        self.enorm = nn.RMSNorm(d, eps=eps)
        self.hnorm = nn.RMSNorm(d, eps=eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.final_layernorm = nn.RMSNorm(d, eps=eps)

    def block(self, hidden: mx.array, embeds: mx.array, cache: Any) -> mx.array:
        x = self.eh_proj(mx.concatenate([self.enorm(embeds), self.hnorm(hidden)], axis=-1))
        return super().__call__(x, create_attention_mask(x, cache), cache)


class HYV3Backend(Backend):
    family = "hy_v3"
    head_input = HEAD_INPUT

    def forward(self, tokens, cache, tape: Tape | None = None, last: bool = False):
        h = self.trunk.hidden(tokens, cache)
        normed = self.trunk.model.norm(h)
        return self.trunk.logits(normed[:, -1:] if last else normed), normed if self.head_input == "normed" else h

    def head(self, k, hidden, tokens, cache, last=False):
        head = self.heads[k]
        x = head.block(hidden, self.trunk.model.embed_tokens(tokens), cache)
        if self.head_input == "normed":
            h = head.final_layernorm(x)
            return self.trunk.logits(h[:, -1:] if last else h), h
        return self.trunk.logits(head.final_layernorm(x[:, -1:] if last else x)), x


def load(folder: Path, config: dict, weights: dict) -> HYV3Backend:
    trunk_weights, head_weights = split_weights(config, weights)
    trunk = build_trunk(Model, ModelArgs, config, trunk_weights)
    return HYV3Backend(trunk, load_heads(trunk, MTPLayer, head_weights, shared=SHARED_WITH_TRUNK))
