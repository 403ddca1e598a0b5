"""Plumbing shared by the DeepSeek-V3-style "nextn" families (DeepSeek-V3, GLM-4.5).

Their MTP heads are extra decoder layers appended after the trunk:
`model.layers.{num_hidden_layers + i}.*`, each holding a trunk-type block plus
`enorm`, `hnorm`, `eh_proj` and `shared_head.norm`. The layer also carries
copies of `embed_tokens` and `shared_head.head`; DeepSeek's weight notes say
both are shared with the main model, so the backends use the trunk's and drop
the copies (about 2 GB on DeepSeek-V3).

mlx-lm's sanitize knows nothing of these layers (DeepSeek drops only layer 61,
GLM only layer num_hidden_layers), so they are split off here before the
trunk is built, and prepared separately.
"""

from __future__ import annotations

import mlx.nn as nn

from engine.backends.base import materialize
from engine.checkpoint import CheckpointError

LAYER_PREFIX = "model.layers."
SHARED_WITH_TRUNK = ("embed_tokens.", "shared_head.head.")
# The head's tensors pass through the trunk's sanitize under this name, so the
# trunk's own expert stacking, fp8 dequantisation and kv_b_proj split apply.
SLOT = "model.layers.0."


class SharedHead(nn.Module):
    """`shared_head`: only its norm is the head's own (the projection is lm_head)."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.norm = nn.RMSNorm(dims, eps=eps)


def _layer_index(key: str) -> int | None:
    if not key.startswith(LAYER_PREFIX):
        return None
    return int(key[len(LAYER_PREFIX):].split(".", 1)[0])


def head_layer_indices(config: dict, weights: dict) -> list[int]:
    """The appended layer indices present in the weights (from keys, not config:
    conversions that dropped the head still say num_nextn_predict_layers=1)."""
    n = config["num_hidden_layers"]
    extra = sorted({i for i in map(_layer_index, weights) if i is not None and i >= n})
    if extra != list(range(n, n + len(extra))):
        raise CheckpointError(f"MTP layers {extra} do not follow the {n} trunk layers")
    return extra


def split_weights(config: dict, weights: dict) -> tuple[dict, list[dict]]:
    """(trunk weights, one dict per head with keys relative to its layer)."""
    n = config["num_hidden_layers"]
    heads: list[dict] = [{} for _ in head_layer_indices(config, weights)]
    trunk = {}
    for key, value in weights.items():
        i = _layer_index(key)
        if i is not None and i >= n:
            heads[i - n][key.split(".", 3)[3]] = value
        else:
            trunk[key] = value
    return trunk, heads


def prepare_head_weights(trunk: nn.Module, layer_weights: dict, slot: str = SLOT,
                         shared: tuple[str, ...] = SHARED_WITH_TRUNK) -> dict:
    """Drop the shared copies and sanitize the rest as the trunk would a layer.

    Presenting the layer as trunk layer 0 (in a dict of its own) makes the
    trunk's sanitize stack `mlp.experts.{e}.*` into `mlp.switch_mlp.*` and, for
    DeepSeek, dequantise fp8 blocks and split `kv_b_proj` into the MLA's
    `embed_q` / `unembed_out`: the same transforms, never a second copy of them.
    """
    own = {k: v for k, v in layer_weights.items() if not k.startswith(shared)}
    sanitized = trunk.sanitize({slot + k: v for k, v in own.items()})
    return {k[len(slot):]: v for k, v in sanitized.items()}


def load_heads(trunk: nn.Module, head_class: type, heads: list[dict], slot: str = SLOT,
               shared: tuple[str, ...] = SHARED_WITH_TRUNK) -> list[nn.Module]:
    """Build head i as layer num_hidden_layers + i, so the trunk's dense/MoE rule
    decides its MLP, and load it strictly. `slot` and `shared`: the trunk's name for
    its layer 0 and the prefixes of the trunk tensors a head may carry copies of, for
    families that name them otherwise (Hy-V3, DeepSeek-V4)."""
    n = trunk.args.num_hidden_layers
    built = []
    for i, layer_weights in enumerate(heads):
        head = head_class(trunk.args, n + i)
        head.load_weights(list(prepare_head_weights(trunk, layer_weights, slot, shared).items()), strict=True)
        materialize(head)
        built.append(head)
    return built
