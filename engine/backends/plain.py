"""Any mlx-lm architecture without MTP heads: autoregressive decoding only.

A Llama-style trunk (mlx-lm's Llama, Qwen2 or Qwen3 model: Llama 3.x, SmolLM2, TinyLlama,
Mistral, Qwen2.5, Qwen3, ...) runs through MiMo's backend with no heads instead. Its decode
path is tuned for the CPU (a block split around the KV cache, the native attention and
block operations; engine/backends/mimo.py) and decodes SmolLM2 ~2.5x as fast as mlx-lm's
own forward (docs/performance.md); the trunk, its weights and its arithmetic stay mlx-lm's."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import _get_classes

from engine.backends.base import Backend, Tape, build_trunk
from engine.backends.descriptors import mlx_model_type
from engine.backends.mimo import MiMoBackend

# mlx-lm's models whose blocks MiMo's decode path computes as they do: RMSNorms, q/k/v/o
# (biases allowed), Qwen3's per-head q/k norms, a rotary on the whole head, SwiGLU.
LLAMA_STYLE = ("llama", "qwen2", "qwen3")


class PlainBackend(Backend):
    def __init__(self, family: str, trunk):
        self.family = family
        self.trunk = trunk
        self.heads = []
        self.vocab_size = int(getattr(trunk.args, "vocab_size", 0))

    def forward(self, tokens: mx.array, cache, tape: Tape | None = None, last: bool = False):
        logits = self.trunk(tokens, cache=cache)  # mlx-lm's whole model: its own output head
        return (logits[:, -1:] if last else logits), None


def load(folder: Path, config: dict, weights: dict) -> Backend:
    model_class, args_class = _get_classes(config)
    trunk = build_trunk(model_class, args_class, config, weights)
    if mlx_model_type(config) in LLAMA_STYLE and _llama_style(trunk):
        backend = MiMoBackend(trunk, [])
        backend.family = config["model_type"]  # what the user loaded, in reports
        return backend
    return PlainBackend(config["model_type"], trunk)


def _llama_style(trunk: nn.Module) -> bool:
    """Every block has the parts MiMo's decode path reads, and the model keeps one plain
    KV cache a layer (no sliding windows)."""
    model = getattr(trunk, "model", None)
    blocks = getattr(model, "layers", None) or []
    if not blocks or not all(hasattr(model, name) for name in ("embed_tokens", "norm")):
        return False
    attention = ("q_proj", "k_proj", "v_proj", "o_proj", "n_heads", "n_kv_heads", "scale", "rope")
    return all(
        not getattr(block, "use_sliding", False)
        and all(hasattr(block.self_attn, name) for name in attention)
        and all(hasattr(block.mlp, name) for name in ("gate_proj", "up_proj", "down_proj"))
        and isinstance(block.input_layernorm, nn.RMSNorm) and isinstance(block.post_attention_layernorm, nn.RMSNorm)
        for block in blocks)
