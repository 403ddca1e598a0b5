"""Snapshots <-> MLX caches, and what identifies a loaded model to the session bank.

Capturing copies device -> host, restoring copies host -> device: a stored
snapshot never shares a buffer with a live cache (KVCache.update_and_fetch writes
into its buffer in place).
"""

from __future__ import annotations

import hashlib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache

from engine.sessions.state import (
    DTYPES,
    FORMAT,
    HeadState,
    LayerState,
    Layout,
    ModelKey,
    SnapshotMismatch,
    Tensor,
)


def to_host(x: mx.array) -> Tensor:
    """A host copy of `x` (evaluates it)."""
    name = _dtype_name(x.dtype)
    if name not in DTYPES:
        raise SnapshotMismatch(f"cannot snapshot arrays of dtype {name}")
    if name == "bfloat16":
        x = x.view(mx.uint16)
    data = np.array(x, copy=True)
    data.flags.writeable = False
    return Tensor(data, name)


def to_device(t: Tensor) -> mx.array:
    """A fresh device copy of `t` (never aliases the host array)."""
    x = mx.array(np.ascontiguousarray(t.data))
    return x.view(mx.bfloat16) if t.dtype == "bfloat16" else x


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


# -- caches <-> snapshot parts ------------------------------------------------------


def supported(cache: list[Any]) -> bool:
    return all(type(c) in (KVCache, ArraysCache) for c in cache)


def capture_layer(c: Any, n: int) -> LayerState:
    if type(c) is KVCache:
        if c.offset != n or c.keys is None:
            raise SnapshotMismatch(f"attention cache holds {c.offset} tokens, expected {n}")
        values = cast(mx.array, c.values)  # set with the keys
        return LayerState("kv", [to_host(c.keys[..., :n, :]), to_host(values[..., :n, :])])
    if type(c) is ArraysCache:
        return LayerState("arrays", [None if a is None else to_host(a) for a in c.cache])
    raise SnapshotMismatch(f"cannot snapshot a {type(c).__name__}")


def restore_layer(c: Any, layer: LayerState, length: int) -> None:
    """Fill a fresh cache `c` (from make_cache) with `layer`, cut to `length` tokens."""
    if layer.kind == "kv" and type(c) is KVCache:
        keys, values = cast("list[Tensor]", layer.tensors)  # a checked kv layer holds both
        c.keys = to_device(keys.slice_seq(2, 0, length))
        c.values = to_device(values.slice_seq(2, 0, length))
        c.offset = length
    elif layer.kind == "arrays" and type(c) is ArraysCache and len(c.cache) == len(layer.tensors):
        c.cache = cast(Any, [None if t is None else to_device(t) for t in layer.tensors])  # mlx-lm types it list[None]
    else:
        raise SnapshotMismatch(f"a {layer.kind!r} layer cannot fill a {type(c).__name__}")


def capture_head(c: KVCache, pending: mx.array | None) -> HeadState:
    keys = values = None
    if c.offset > 0:  # then it holds keys and values
        keys = to_host(cast(mx.array, c.keys)[..., : c.offset, :])
        values = to_host(cast(mx.array, c.values)[..., : c.offset, :])
    held = to_host(pending) if pending is not None and pending.shape[1] > 0 else None
    return HeadState(keys, values, held)


def restore_head(c: KVCache, head: HeadState, offset: int) -> None:
    if offset > 0:  # then the head state holds keys and values that long (Layout.check)
        c.keys = to_device(cast(Tensor, head.keys).slice_seq(2, 0, offset))
        c.values = to_device(cast(Tensor, head.values).slice_seq(2, 0, offset))
        c.offset = offset


def describe(engine: Any) -> ModelKey | None:
    """Fingerprint and probe the engine's model; None when its caches cannot be banked."""
    backend = engine.backend
    cache = backend.make_cache()
    if not supported(cache):
        return None
    layout = probe(backend)
    return ModelKey(model_fingerprint(Path(engine.path), backend, layout), layout)


def probe(backend: Any) -> Layout:
    """Run one token through fresh caches to learn every shape and dtype."""
    cache = backend.make_cache()
    token = mx.array([[0]])
    logits, hidden = backend.forward(token, cache)
    kinds: list[str] = []
    shapes: list[Any] = []
    for c in cache:
        if type(c) is KVCache:
            kinds.append("kv")
            keys, values = cast(mx.array, c.keys), cast(mx.array, c.values)  # filled by the forward
            shapes.append(((keys.shape[1], keys.shape[3], _dtype_name(keys.dtype)),
                           (values.shape[1], values.shape[3], _dtype_name(values.dtype))))
        else:
            kinds.append("arrays")
            shapes.append(tuple(None if a is None else (tuple(a.shape), _dtype_name(a.dtype)) for a in c.cache))
    heads: list[Any] = []
    if hidden is not None:
        for k in range(backend.n_heads):
            hc = backend.make_head_caches()[k]
            backend.head(k, hidden, token, hc, last=True)
            heads.append(((hc.keys.shape[1], hc.keys.shape[3], _dtype_name(hc.keys.dtype)),
                          (hc.values.shape[1], hc.values.shape[3], _dtype_name(hc.values.dtype))))
    mx.eval(logits)
    hidden_desc = None if hidden is None else (int(hidden.shape[-1]), _dtype_name(hidden.dtype))
    return Layout(tuple(kinds), _tuplify(shapes), tuple(heads), hidden_desc,
                  (int(logits.shape[-1]), _dtype_name(logits.dtype)))


def _tuplify(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return tuple(_tuplify(i) for i in x)
    return int(x) if isinstance(x, (np.integer,)) else x


def model_fingerprint(folder: Path, backend: Any, layout: Layout) -> str:
    """config.json, every weight file's header, size and sampled bytes, the loaded dtypes
    and cache layout, MTP head count, mlx and mlx-lm versions."""
    h = hashlib.sha256(FORMAT.encode())
    hash_checkpoint_files(h, folder)
    h.update(layout.to_json().encode())
    h.update(f"heads={backend.n_heads}".encode())
    h.update(f"mlx={mx.__version__}".encode())  # type: ignore[attr-defined]  # not in mlx's stubs
    h.update(f"mlx-lm={_package_version('mlx-lm')}".encode())
    return h.hexdigest()


def hash_checkpoint_files(h: Any, folder: Path) -> None:
    """Feed config.json and a cheap digest of every weight file into the hash `h`."""
    config = folder / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    for path in sorted(folder.glob("*.safetensors")):
        h.update(path.name.encode())
        h.update(weights_digest(path))


SAMPLE = 1 << 18  # bytes read from each end and the middle of a weight file's data


def weights_digest(path: Path) -> bytes:
    """sha256 of a safetensors file's header, its size and 3 x 256 KiB of its data:
    cheap, and different for different weights of the same architecture."""
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(str(size).encode())
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        n = min(n, max(size - 8, 0))
        h.update(f.read(n))
        start = 8 + n
        data = size - start
        for offset in sorted({start, start + max(data // 2 - SAMPLE // 2, 0), max(size - SAMPLE, start)}):
            f.seek(offset)
            h.update(f.read(SAMPLE))
    return h.digest()


def _package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"
