"""Any mlx-lm architecture without MTP heads: autoregressive decoding only."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import _get_classes

from engine.backends.base import Backend, Tape, build_trunk


class PlainBackend(Backend):
    def __init__(self, family: str, trunk):
        self.family = family
        self.trunk = trunk
        self.heads = []
        self.vocab_size = int(getattr(trunk.args, "vocab_size", 0))

    def forward(self, tokens: mx.array, cache, tape: Tape | None = None):
        return self.trunk(tokens, cache=cache), None


def load(folder: Path, config: dict, weights: dict) -> PlainBackend:
    model_class, args_class = _get_classes(config)
    return PlainBackend(config["model_type"], build_trunk(model_class, args_class, config, weights))
