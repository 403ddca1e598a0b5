"""Naming a loaded backend's MTP head tensors so the loader finds them again.

A converted checkpoint stores its heads in a sidecar `mtp.safetensors` (mlx-lm
reads only `model*.safetensors`, so stock mlx-lm still loads the folder, AR
only) under the family's own key names, the first of its descriptor's
`head_key_patterns`: `model.mtp_layers.{i}.` (MiMo), `model.layers.{N+i}.`
(DeepSeek-V3, GLM-4.5), `mtp.layers.{i}.` plus the shared `mtp.fc`,
`mtp.pre_fc_norm_*`, `mtp.norm` (Qwen). The tensors are the head modules'
parameters as loaded, i.e. after the family's own preparation: experts
stacked, DeepSeek's kv_b_proj split, Qwen's norms shifted. Those preparations
leave already-prepared tensors alone, so loading the sidecar again is exact.
"""

from __future__ import annotations

from typing import Iterable, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from engine.backends.descriptors import BackendDescriptor

HEADS_FILE = "mtp.safetensors"


def head_prefix(pattern: str, index: int, n_layers: int) -> str:
    """The key prefix of head `index` under a descriptor pattern."""
    return pattern.replace("{n+i}", str(n_layers + index)).replace("{i}", str(index))


def head_tensors(d: BackendDescriptor, heads: list[nn.Module], n_layers: int,
                 pattern: str | None = None) -> dict[str, mx.array]:
    """Every head's parameters under the family's key names (those of `pattern`, one of
    the descriptor's; by default its first).

    Qwen's shared parts (`fc.weight`, the pre-fc norms, the final norm) are the
    same tensors in every head (each head is built from the one shared copy),
    so they are written once, beside the layers.
    """
    pattern = pattern or d.head_key_patterns[0]
    shared_root = pattern.rsplit("layers.", 1)[0]
    tensors: dict[str, mx.array] = {}
    for i, head in enumerate(heads):
        prefix = head_prefix(pattern, i, n_layers)
        for name, value in cast("list[tuple[str, mx.array]]", tree_flatten(head.parameters())):
            if name in d.shared_parts:
                tensors.setdefault(shared_root + name, value)
            else:
                tensors[prefix + name] = value
    return tensors


def stored_head_pattern(d: BackendDescriptor, keys: Iterable[str], n_layers: int) -> str:
    """The descriptor pattern a checkpoint's head keys use (Qwen3.5's heads may sit at
    `mtp.layers.{i}.` or under `model.language_model.`), so heads written back keep the
    source's names; the first pattern when no key matches."""
    keys = list(keys)
    for pattern in d.head_key_patterns:
        first = head_prefix(pattern, 0, n_layers)
        if any(k.startswith(first) for k in keys):
            return pattern
    return d.head_key_patterns[0]
