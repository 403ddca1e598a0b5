"""The trained model: mlx-lm's MiMo trunk plus the engine's own MTP layers.

No architecture is defined here: the trunk is `mlx_lm.models.mimo.Model` and
each head is `engine.backends.mimo.MTPLayer`, exactly what the engine loads.

Teacher-forced losses over a window x[0..S] in one forward, no cache:

    trunk:  h = final-normed trunk hidden over x[0..S-1];  CE(lm(h_t), x[t+1])
    head k: at position p it reads (hidden-in_p, x[p+k+1]) and predicts
            x[p+k+2]; hidden-in is h for k = 0 and head k-1's output
            otherwise; causal attention over positions 0..S-k-2.

That is the pairing engine/generation.py uses when drafting, so a head
trained here drafts at the depth it was trained for.
"""

from __future__ import annotations

import json
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import mimo

from engine.backends.mimo import HEAD_PREFIX, MTPLayer
from engine.sampling import softmax


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a model trained from scratch. None: derived from `hidden`
    (intermediate: default_intermediate; attention heads: one per 64 dimensions;
    KV heads: half the attention heads)."""

    hidden: int = 256
    layers: int = 12
    heads: int = 2  # MTP heads
    intermediate: int | None = None
    attention_heads: int | None = None
    kv_heads: int | None = None
    max_positions: int = 2048


def model_config(vocab_size: int, shape: ModelShape = ModelShape(), eos_token_id: int = 0) -> dict:
    """A MiMo config.json (real MiMo field names) for a model trained from scratch."""
    hidden = shape.hidden
    attention_heads = shape.attention_heads or max(1, hidden // 64)
    kv_heads = shape.kv_heads or max(1, attention_heads // 2)
    if hidden % attention_heads or attention_heads % kv_heads:
        raise ValueError(f"hidden {hidden}, {attention_heads} attention heads, {kv_heads} KV heads do not divide")
    return {
        "architectures": ["MiMoForCausalLM"],
        "model_type": "mimo",
        "hidden_size": hidden,
        "intermediate_size": shape.intermediate or default_intermediate(hidden),
        "num_hidden_layers": shape.layers,
        "num_attention_heads": attention_heads,
        "num_key_value_heads": kv_heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": shape.max_positions,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "num_nextn_predict_layers": shape.heads,
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "torch_dtype": "bfloat16",
    }


def default_intermediate(hidden: int) -> int:
    """2.5x the hidden size, a multiple of 32 (640 for 256): a narrower FFN buys
    depth, and depth is what speculative decoding rewards."""
    return max(32, 5 * hidden // 2 // 32 * 32)


def parameter_count(config: dict) -> dict[str, int]:
    """Trunk and head parameter counts of a config (without building it)."""
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = d // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    block = d * q + q + 2 * (d * kv + kv) + q * d + 3 * d * f + 2 * d
    embed = v * d * (1 if config.get("tie_word_embeddings") else 2)
    trunk = embed + config["num_hidden_layers"] * block + d
    head = block + 2 * d * d + 3 * d
    return {"trunk": trunk, "heads": config["num_nextn_predict_layers"] * head}


class MTPModel(nn.Module):
    """Trunk + MTP layers, trained together (or the layers alone on a frozen trunk)."""

    def __init__(self, config: dict, trunk: nn.Module | None = None, n_heads: int | None = None):
        super().__init__()
        args = mimo.ModelArgs.from_dict(config)
        self.trunk = trunk if trunk is not None else mimo.Model(args)
        n = config.get("num_nextn_predict_layers", 0) if n_heads is None else n_heads
        self.mtp_layers = [MTPLayer(args) for _ in range(n)]

    @property
    def n_heads(self) -> int:
        return len(self.mtp_layers)

    def trunk_forward(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(logits, final-normed hidden) of the trunk over x: what head 0 reads."""
        h = self.trunk.model(x)
        return self.lm_head(h), h

    def lm_head(self, h: mx.array) -> mx.array:
        trunk = self.trunk
        if getattr(trunk.args, "tie_word_embeddings", False) or not hasattr(trunk, "lm_head"):
            return trunk.model.embed_tokens.as_linear(h)
        return trunk.lm_head(h)

    def embed(self, tokens: mx.array) -> mx.array:
        return self.trunk.model.embed_tokens(tokens)

    def heads_forward(self, hidden: mx.array, x: mx.array):
        """Yield (k, head k's logits) over every position it can predict."""
        S = x.shape[1] - 1
        for k, layer in enumerate(self.mtp_layers):
            n = S - k - 1
            if n < 1:
                break
            hidden = layer(hidden[:, :n], self.embed(x[:, k + 1 : k + 1 + n]), None)
            yield k, self.lm_head(hidden)

    def named_tensors(self, heads_only: bool = False) -> dict[str, mx.array]:
        """Parameters under their checkpoint names (Hugging Face MiMo keys)."""
        out: dict[str, mx.array] = {}
        if not heads_only:
            out.update(_flat(self.trunk.parameters()))
        for i, layer in enumerate(self.mtp_layers):
            out.update({f"{HEAD_PREFIX}{i}.{k}": v for k, v in _flat(layer.parameters())})
        return out


def _flat(tree: dict) -> list[tuple[str, mx.array]]:
    # without `destination`, tree_flatten returns a list of (key, value) (its hint says list or dict)
    return cast(list[tuple[str, mx.array]], tree_flatten(tree))


# MLX's CPU exp is slow (about 20 ns an element, measured with mlx 0.32) and
# exponentials dominate a small model's training step; 2**x is about 3x
# cheaper, so the losses exponentiate that way (same values to float32
# rounding, gradients included; tests/test_train.py compares).
_LOG2E = 1.0 / math.log(2.0)


def fast_exp(x: mx.array) -> mx.array:
    return mx.power(2.0, x * _LOG2E)


def log_softmax(logits: mx.array) -> mx.array:
    shifted = logits - mx.stop_gradient(logits.max(axis=-1, keepdims=True))
    return shifted - mx.log(fast_exp(shifted).sum(axis=-1, keepdims=True))


def topk_cross_entropy(logits: mx.array, top: mx.array, p: mx.array) -> mx.array:
    """Per row of logits [..., V]: -sum_j p_j log softmax(logits)[top_j], the top-k
    cross-entropy heads train with (top [..., K] distinct ids, p their target mass).

    A heads step's element-wise work (a log-softmax over 8,192 scores per position and
    its gradient, on one thread) cost about what its matrix products did; this is one
    softmax on the native module's vectorized exp over its helper threads, forward and
    backward, and its gradient, written out: sum(p) softmax(logits) - p at the top ids."""
    return cast(mx.array, _topk_cross_entropy(logits, top, p))


@mx.custom_function
def _topk_cross_entropy(logits: mx.array, top: mx.array, p: mx.array) -> mx.array:
    q = softmax(logits)
    lse = logits.max(axis=-1) - mx.log(q.max(axis=-1))  # the largest q is exp(0) / sum
    return p.sum(axis=-1) * lse - (p * mx.take_along_axis(logits, top, axis=-1)).sum(axis=-1)


@_topk_cross_entropy.vjp
def _topk_cross_entropy_vjp(primals, cotangent, output):
    logits, top, p = primals
    g = cotangent[..., None]
    grad = softmax(logits) * (g * p.sum(axis=-1, keepdims=True))
    grad = mx.put_along_axis(grad, top, mx.take_along_axis(grad, top, axis=-1) - g * p, axis=-1)
    return grad, mx.zeros_like(top), mx.zeros_like(p)


def cross_entropy(logits: mx.array, targets: mx.array) -> mx.array:
    """Mean cross-entropy of integer targets (as nn.losses.cross_entropy)."""
    shifted = logits - mx.stop_gradient(logits.max(axis=-1, keepdims=True))
    lse = mx.log(fast_exp(shifted).sum(axis=-1))
    return (lse - mx.take_along_axis(shifted, targets[..., None], axis=-1)[..., 0]).mean()


def unfused_attention(queries: mx.array, keys: mx.array, values: mx.array, cache, scale: float,
                      mask, sinks=None) -> mx.array:
    """Causal attention as plain ops (same values as mx.fast's; softmax via 2**x).

    On the CPU, the gradient of mx.fast.scaled_dot_product_attention costs
    about 18x that of this unfused graph (mlx 0.32: 1010 ms vs 57 ms for
    8 x 3 heads x 256 positions), so training swaps it in.
    """
    causal = isinstance(mask, str) and mask == "causal"
    if cache is not None or sinks is not None or not (mask is None or causal):
        raise ValueError("training attention is causal, without a cache or sinks")
    B, n_q, L, dh = queries.shape
    n_kv = keys.shape[1]
    q = (queries * (scale * _LOG2E)).reshape(B, n_kv, n_q // n_kv, L, dh)
    scores = q @ keys[:, :, None].swapaxes(-1, -2)
    if causal:
        scores = scores + _causal_bias(L, scores.dtype)
    scores = scores - mx.stop_gradient(scores.max(axis=-1, keepdims=True))
    weights = mx.power(2.0, scores)
    weights = weights / weights.sum(axis=-1, keepdims=True)
    return (weights @ values[:, :, None]).reshape(B, n_q, L, dh)


def _causal_bias(n: int, dtype: mx.Dtype) -> mx.array:
    return mx.triu(mx.full((n, n), -1e9, dtype=dtype), k=1)


@contextmanager
def training_attention() -> Iterator[None]:
    """Route mlx-lm's MiMo attention (trunk and MTP layers) through unfused_attention."""
    fused = mimo.scaled_dot_product_attention
    mimo.scaled_dot_product_attention = unfused_attention
    try:
        yield
    finally:
        mimo.scaled_dot_product_attention = fused


def trunk_loss(model: MTPModel, x: mx.array, head_weights: tuple[float, ...]):
    """Full training: CE of the trunk + weighted CE of each head, one forward."""
    S = x.shape[1] - 1
    h = model.trunk.model(x[:, :S])
    losses = [cross_entropy(model.lm_head(h), x[:, 1:])]
    for k, logits in model.heads_forward(h, x):
        n = logits.shape[1]
        losses.append(cross_entropy(logits, x[:, k + 2 : k + 2 + n]))
    total = losses[0] + sum(w * l for w, l in zip(head_weights, losses[1:]))
    return total, mx.stack(losses)


def distill_loss(model: MTPModel, x: mx.array, h: mx.array, target_logp: mx.array,
                 head_weights: tuple[float, ...]):
    """Heads-only: KL(trunk || head k) on the trunk's own next-token distribution.

    `h` and `target_logp` (trunk log-probabilities over positions 0..S-1) are
    computed outside the gradient: the trunk is frozen.
    """
    losses = []
    for k, logits in model.heads_forward(h, x):
        n = logits.shape[1]
        p_logp = target_logp[:, k + 1 : k + 1 + n]
        losses.append((fast_exp(p_logp) * (p_logp - log_softmax(logits))).sum(axis=-1).mean())
    total = sum(w * l for w, l in zip(head_weights, losses))
    return total, mx.stack(losses)


class HeadsModel(Protocol):
    """What head_agreement reads: MTPModel, or engine/training/heads.py's FamilyHeads."""

    def heads_forward(self, hidden: mx.array, x: mx.array) -> Iterator[tuple[int, mx.array]]: ...


def head_agreement(model: HeadsModel, x: mx.array, h: mx.array, target: mx.array) -> list[float]:
    """Per head: how often its argmax equals `target` (token ids over positions 0..S-1,
    aligned like the trunk's predictions: target[:, t] is what position t predicts)."""
    out = []
    for k, logits in model.heads_forward(h, x):
        n = logits.shape[1]
        out.append((logits.argmax(axis=-1) == target[:, k + 1 : k + 1 + n]).astype(mx.float32).mean())
    return [float(a) for a in out] if out else []


def save_safetensors(path: Path, tensors: dict[str, mx.array], dtype: mx.Dtype | None = mx.bfloat16) -> None:
    """Write atomically (a temporary file renamed), casting floats to `dtype`."""
    if dtype is not None:
        tensors = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in tensors.items()}
    tmp = path.with_name(path.stem + ".tmp.safetensors")
    mx.save_safetensors(str(tmp), tensors, metadata={"format": "pt"})
    os.replace(tmp, path)


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
