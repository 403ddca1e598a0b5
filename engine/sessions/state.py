"""Cache snapshots of a generation as host arrays, and what makes one safe to reuse.

A `Snapshot` is everything a generation needs to continue from a prefix as if it
had fed those tokens itself, at a step boundary (see engine/generation.py):

    tokens   the n tokens the trunk has been fed (int32 [n])
    layers   one entry per trunk cache: attention KV up to n ("kv": keys, values),
             or a recurrent layer's arrays ("arrays": GatedDeltaNet conv + state)
    heads    per MTP head used: its KV up to its offset and, for heads k >= 1, the
             real hidden-ins it has not consumed yet
    hidden   the trunk's hidden state at every position [1, n, D] (backends with
             heads): head 0's pending inputs, and what lets a restore shorten or
             reset the head caches
    logits   the trunk's logits after token n-1 [1, V], so an exact hit samples its
             first token without a forward (None when not known)

Host copies (numpy, read-only) on purpose: a live KVCache is updated in place by
slice assignment, so a stored entry must never share a buffer with a live cache.
Capturing copies device -> host, restoring copies host -> device, and the bank's
background writer thread only ever touches numpy, never MLX. bfloat16 travels as
its uint16 bit pattern (numpy has no bfloat16).

Only mlx-lm's `KVCache` and `ArraysCache` are understood; a model with any other
cache class (rotating, quantized) is not banked.

This module is data only (numpy): engine/sessions/arrays.py moves snapshots between
MLX caches and host arrays and describes a loaded model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

FORMAT = "mtplxd-session/1"

# MLX dtype name -> (safetensors code, numpy dtype of the raw bytes)
DTYPES: dict[str, tuple[str, str]] = {
    "float32": ("F32", "<f4"),
    "float16": ("F16", "<f2"),
    "bfloat16": ("BF16", "<u2"),
    "int32": ("I32", "<i4"),
    "uint32": ("U32", "<u4"),
    "int64": ("I64", "<i8"),
    "uint16": ("U16", "<u2"),
    "uint8": ("U8", "|u1"),
}
CODES = {code: name for name, (code, _) in DTYPES.items()}


class SnapshotMismatch(Exception):
    """A snapshot that does not fit this generation (never a client error)."""


@dataclass(frozen=True, eq=False)
class Tensor:
    data: np.ndarray  # read-only; bfloat16 held as its uint16 bit pattern
    dtype: str  # the MLX dtype name

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.data.shape)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def slice_seq(self, axis: int, start: int, stop: int) -> Tensor:
        index = [slice(None)] * self.data.ndim
        index[axis] = slice(start, stop)
        return Tensor(self.data[tuple(index)], self.dtype)


@dataclass(eq=False)
class LayerState:
    kind: str  # "kv" | "arrays"
    tensors: list[Tensor | None]  # kv: [keys, values], sequence on axis 2; arrays: the cache slots


@dataclass(eq=False)
class HeadState:
    keys: Tensor | None  # [1, H, offset, d]; None when the head cache is empty
    values: Tensor | None
    pending: Tensor | None = None  # heads k >= 1: [1, m, D] real hidden-ins not consumed yet

    @property
    def offset(self) -> int:
        return self.keys.shape[2] if self.keys is not None else 0


@dataclass(eq=False)
class Snapshot:
    tokens: np.ndarray  # int32 [n], read-only
    layers: list[LayerState]
    heads: list[HeadState] = field(default_factory=list)
    hidden: Tensor | None = None  # [1, n, D]
    logits: Tensor | None = None  # [1, V]

    @property
    def n(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def trimmable(self) -> bool:
        """Attention-only: any prefix can be served by slicing."""
        return all(layer.kind == "kv" for layer in self.layers)

    @property
    def nbytes(self) -> int:
        total = int(self.tokens.nbytes)
        for t in self.tensors():
            total += t.nbytes
        return total

    def tensors(self) -> list[Tensor]:
        out = [t for layer in self.layers for t in layer.tensors if t is not None]
        for head in self.heads:
            out += [t for t in (head.keys, head.values, head.pending) if t is not None]
        return out + [t for t in (self.hidden, self.logits) if t is not None]


@dataclass(frozen=True)
class Restore:
    """What the bank hands a new generation: a snapshot and how many of its tokens to reuse."""

    snapshot: Snapshot
    length: int
    tier: str = "ram"  # where it came from: "ram" | "disk"


# -- the model a snapshot belongs to -------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """Shapes and dtypes of everything a snapshot of this model holds, sequence
    lengths aside: what a file from disk is checked against before use."""

    kinds: tuple[str, ...]
    # per layer: kv -> ((H, dk, dtype), (H, dv, dtype)); arrays -> ((shape, dtype) | None, ...)
    shapes: tuple[Any, ...]
    heads: tuple[tuple[tuple[int, int, str], tuple[int, int, str]], ...]
    hidden: tuple[int, str] | None  # (D, dtype)
    vocab: tuple[int, str]  # (V, dtype)

    @property
    def trimmable(self) -> bool:
        return all(k == "kv" for k in self.kinds)

    def check(self, s: Snapshot) -> None:
        """Raise ValueError unless `s` could have been captured from this model."""
        n = s.n
        _need(n >= 1, "no tokens")
        _need(len(s.layers) == len(self.kinds), f"{len(s.layers)} layers, the model has {len(self.kinds)}")
        for i, (layer, kind, shape) in enumerate(zip(s.layers, self.kinds, self.shapes)):
            _need(layer.kind == kind, f"layer {i} is {layer.kind!r}, expected {kind!r}")
            if kind == "kv":
                _need(len(layer.tensors) == 2 and None not in layer.tensors, f"layer {i}: keys and values")
                for t, (h, d, dtype) in zip(cast("list[Tensor]", layer.tensors), shape):  # no None: checked
                    _need(t.shape == (1, h, n, d) and t.dtype == dtype,
                          f"layer {i}: {t.shape} {t.dtype}, expected {(1, h, n, d)} {dtype} (offset == n_tokens)")
            else:
                _need(len(layer.tensors) == len(shape), f"layer {i}: {len(layer.tensors)} arrays")
                for array, want in zip(layer.tensors, shape):
                    got = None if array is None else (array.shape, array.dtype)
                    _need(got == want, f"layer {i}: array {got}, expected {want}")
        _need(len(s.heads) <= len(self.heads), f"{len(s.heads)} head states, the model has {len(self.heads)}")
        previous = 0  # head 0's offset, set before another head reads it
        for k, (head, ((h, dk, kt), (_, dv, vt))) in enumerate(zip(s.heads, self.heads)):
            off = head.offset
            _need(off + k + 1 <= n or off == 0, f"head {k}: offset {off} past the fed tokens")
            if head.keys is not None:
                _need(head.keys.shape == (1, h, off, dk) and head.keys.dtype == kt, f"head {k}: keys {head.keys.shape}")
                _need(head.values is not None and head.values.shape == (1, h, off, dv) and head.values.dtype == vt,
                      f"head {k}: values")
            else:
                _need(head.values is None, f"head {k}: values without keys")
            if k == 0:
                _need(head.pending is None, "head 0 keeps no pending inputs (they come from `hidden`)")
            else:
                _need(off <= previous, f"head {k} ahead of head {k - 1}")
                rows = previous - off
                pending = head.pending.shape if head.pending is not None else (1, 0, self.hidden[0] if self.hidden else 0)
                _need(self.hidden is not None and pending == (1, rows, self.hidden[0]), f"head {k}: pending {pending}")
                if head.pending is not None:
                    _need(head.pending.dtype == cast("tuple[int, str]", self.hidden)[1], f"head {k}: pending dtype")
            previous = off
        if self.hidden is None:
            _need(s.hidden is None, "hidden states for a model without heads")
        else:
            _need(s.hidden is not None, "no hidden states")
            hidden = cast(Tensor, s.hidden)  # checked just above
            _need(hidden.shape == (1, n, self.hidden[0]) and hidden.dtype == self.hidden[1],
                  f"hidden {hidden.shape} {hidden.dtype}")
        if s.logits is not None:
            _need(s.logits.shape == (1, self.vocab[0]) and s.logits.dtype == self.vocab[1],
                  f"logits {s.logits.shape} {s.logits.dtype}")
        _need(s.tokens.dtype == np.int32 and s.tokens.ndim == 1, "tokens must be int32 [n]")
        _need(bool(((s.tokens >= 0) & (s.tokens < self.vocab[0])).all()), "token ids outside the vocabulary")

    def to_json(self) -> str:
        return json.dumps([self.kinds, self.shapes, self.heads, self.hidden, self.vocab])


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class ModelKey:
    """What the bank needs to know about the loaded model."""

    fingerprint: str  # hex sha256
    layout: Layout


