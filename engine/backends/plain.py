"""Any mlx-lm architecture without MTP heads: autoregressive decoding only.

A Llama or Qwen2 trunk (Llama 3.x, SmolLM2, TinyLlama, Qwen2.5, ...) runs in MiMo's
layout instead, with no heads: MiMo's backend has the decode path tuned for the CPU (a
block as two native operations, the native attention; engine/backends/mimo.py), which
decodes SmolLM2 ~2.5x as fast as mlx-lm's own model (docs/performance.md). It computes
the same trunk: MiMo's blocks are Qwen2's, and a Llama gets zero q/k/v biases."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import _get_classes

from engine.backends import mimo
from engine.backends.base import Backend, Tape, build_trunk, untagged
from engine.checkpoint import CheckpointError


class PlainBackend(Backend):
    def __init__(self, family: str, trunk):
        self.family = family
        self.trunk = trunk
        self.heads = []
        self.vocab_size = int(getattr(trunk.args, "vocab_size", 0))

    def forward(self, tokens: mx.array, cache, tape: Tape | None = None):
        return self.trunk(tokens, cache=cache), None


def load(folder: Path, config: dict, weights: dict) -> Backend:
    in_mimo_layout = _in_mimo_layout(folder, config, weights)
    if in_mimo_layout is not None:
        return in_mimo_layout
    model_class, args_class = _get_classes(config)
    return PlainBackend(config["model_type"], build_trunk(model_class, args_class, config, weights))


def _in_mimo_layout(folder: Path, config: dict, weights: dict) -> Backend | None:
    """The trunk as MiMo's backend runs it, without heads; None where MiMo's layout
    cannot express it (another family, biases a Llama layout cannot hold, sliding windows)."""
    try:
        converted, biases = mimo.mimo_config(untagged(config), set(weights), heads=0)
    except CheckpointError:
        return None
    like = weights.get("model.layers.0.self_attn.q_proj.scales", weights.get("model.layers.0.self_attn.q_proj.weight"))
    dtype = like.dtype if like is not None and mx.issubdtype(like.dtype, mx.floating) else mx.float32
    backend = mimo.load(folder, converted, {**weights, **{name: mx.zeros(shape, dtype) for name, shape in biases.items()}})
    backend.family = config["model_type"]  # what the user loaded, in reports
    return backend
