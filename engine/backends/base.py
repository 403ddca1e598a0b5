"""The backend contract every model family implements.

A backend wraps mlx-lm's model class for the trunk and adds the MTP head(s)
that mlx-lm's `sanitize` throws away. The generation loop (engine/generation.py)
only ever calls the methods below, so the whole speculative machinery is
family-agnostic:

    forward(tokens, cache, tape, last)
                                   trunk forward: logits and the hidden states
                                   the first MTP head consumes; with last=True,
                                   logits of the last position only (a prompt's
                                   chunk needs no more: its LM head over every
                                   position was a fifth of a SmolLM2 prefill)
    head(k, hidden, tokens, cache, last)
                                   MTP head k on (hidden_i, token_{i+k+1}) pairs;
                                   with last=True, logits of the last pair only
                                   (drafting needs no more: an LM head is big)
    rewind(cache, tape, keep)      undo a verify window except its first `keep`
                                   positions (attention KV trim, recurrent replay)

Shapes: tokens [1, L] int32, hidden [1, L, D], logits [1, L, V]. Batch is 1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache

from engine.checkpoint import CheckpointError
from engine.distributed import Ranks, shard_trunk
from engine.quantized import quantize_like_checkpoint

if TYPE_CHECKING:
    from engine.backends.draft_vocab import DraftVocabulary

# Set while converting a checkpoint: parameters stay lazy (memory-mapped from the
# safetensors files) so that a model larger than memory streams through
# quantization and saving shard by shard instead of being read in whole.
_LAZY = ContextVar("lazy_load", default=False)


@contextlib.contextmanager
def lazy_loading() -> Iterator[None]:
    token = _LAZY.set(True)
    try:
        yield
    finally:
        _LAZY.reset(token)


def materialize(module: nn.Module) -> None:
    """Load a module's parameters now, unless loading lazily."""
    if not _LAZY.get():
        mx.eval(module.parameters())


@dataclass
class Tape:
    """What a verify forward records so it can be partly undone.

    For each recurrent (GatedDeltaNet) layer: the cache arrays before the
    window (GDN replaces its arrays rather than mutating them, so holding the
    list is a zero-copy snapshot) and the mixer's input over the window.
    """

    length: int = 0
    recurrent: dict[int, tuple[list[Any], mx.array]] = field(default_factory=dict)

    def record(self, layer: int, cache: ArraysCache, mixer_input: mx.array) -> None:
        self.recurrent[layer] = (list(cache.cache), mixer_input)


class Backend:
    """Base class: subclasses set the attributes and implement forward/head."""

    family: str
    trunk: nn.Module  # the mlx-lm Model
    heads: list[nn.Module]  # MTP heads, one per depth the checkpoint has
    vocab_size: int
    ranks: Ranks = Ranks()  # one rank until engine/distributed.py shards it
    # Whether the heads' linear layers are only ever called, never read as `.weight`: then
    # the CPU kernel may pack them (engine/quantized_rows.py, pack_heads).
    packable_heads: bool = False
    draft_vocab: DraftVocabulary | None = None  # heads that score only some tokens (draft_vocab.py)

    def __init__(self, trunk: nn.Module, heads: list[nn.Module]):
        self.trunk = trunk
        self.heads = heads
        self.vocab_size = trunk.args.vocab_size

    @property
    def n_heads(self) -> int:
        return len(self.heads)

    def shard(self, group: Any) -> str:
        """Split the trunk over `group`'s ranks (engine/distributed.py); how, in words.
        Families whose mlx-lm model cannot split override this or refuse."""
        return shard_trunk(self.trunk, self.family, group)

    def make_cache(self) -> list[Any]:
        return self.trunk.make_cache() if hasattr(self.trunk, "make_cache") else [
            KVCache() for _ in self.trunk.layers
        ]

    def make_head_caches(self) -> list[KVCache]:
        return [KVCache() for _ in self.heads]

    def forward(
        self, tokens: mx.array, cache: list[Any], tape: Tape | None = None, last: bool = False
    ) -> tuple[mx.array, mx.array]:
        raise NotImplementedError

    def head(
        self, k: int, hidden: mx.array, tokens: mx.array, cache: KVCache | BatchKVCache, last: bool = False
    ) -> tuple[mx.array, mx.array]:
        """Run head k. Returns (logits, hidden for head k+1); logits [1, 1, V] when `last`
        (rows of a batch, engine/batch.py: [B, 1, V], with a BatchKVCache)."""
        raise NotImplementedError

    def replay(self, layer: int, mixer_input: mx.array, cache: ArraysCache) -> None:
        """Re-run recurrent layer `layer`'s mixer to advance its state."""
        raise NotImplementedError(f"{self.family} has no recurrent layers")

    def rewind(self, cache: list[Any], tape: Tape, keep: int) -> None:
        """Undo the last forward (recorded on `tape`) except its first `keep` positions."""
        drop = tape.length - keep
        if drop == 0:
            return
        for i, c in enumerate(cache):
            if i in tape.recurrent:
                saved, mixer_input = tape.recurrent[i]
                c.cache = list(saved)
                if keep > 0:
                    self.replay(i, mixer_input[:, :keep], c)
            else:
                c.trim(drop)


def build_trunk(model_class: type, args_class: Any, config: dict, weights: dict) -> nn.Module:
    """Instantiate mlx-lm's model for the trunk and load its (MTP-free) weights,
    quantized layers included (engine/quantized.py). Every family, the plain one included,
    reads the config with its non-finite floats untagged."""
    model = model_class(args_class.from_dict(untagged(config)))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    quantize_like_checkpoint(model, config, weights)
    model.load_weights(list(weights.items()), strict=True)
    materialize(model)
    return model


_FLOAT_TAGS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def untagged(value: Any) -> Any:
    """A copy of `value` (mlx-lm's ModelArgs keeps the caller's lists) with transformers'
    tags for non-finite floats ({"__float__": "Infinity"}: how transformers 5 and mlx-lm save
    them, JSON having none) made floats again."""
    if isinstance(value, dict):
        if set(value) == {"__float__"} and value["__float__"] in _FLOAT_TAGS:
            return _FLOAT_TAGS[value["__float__"]]
        return {k: untagged(v) for k, v in value.items()}
    if isinstance(value, list):
        return [untagged(v) for v in value]
    return value


def load_head_weights(head: nn.Module, weights: dict[str, mx.array], prefix: str) -> None:
    """Load the tensors under `prefix` into `head`, strictly (names must match)."""
    own = {
        k[len(prefix):]: v
        for k, v in weights.items()
        if k.startswith(prefix) and not k.endswith("rotary_emb.inv_freq")
    }
    head.load_weights(list(own.items()), strict=True)
    materialize(head)


def split_numbered(weights: dict, prefix: str) -> tuple[dict, list[dict]]:
    """(trunk weights, one dict per MTP layer `{prefix}{i}.` with keys relative to it),
    for checkpoints that number their MTP layers under a prefix of their own."""
    trunk: dict = {}
    by_index: dict[int, dict] = {}
    for key, value in weights.items():
        if key.startswith(prefix):
            index, rest = key[len(prefix):].split(".", 1)
            by_index.setdefault(int(index), {})[rest] = value
        else:
            trunk[key] = value
    if sorted(by_index) != list(range(len(by_index))):
        raise CheckpointError(f"MTP layers {sorted(by_index)} under {prefix}* are not numbered from 0")
    return trunk, [by_index[i] for i in range(len(by_index))]
