"""One session-bank entry on disk: a safetensors file, written atomically, read suspiciously.

Layout (plain safetensors, readable by any safetensors reader):

    tokens              I32 [n]            the fed tokens
    layer.{i}.{j}       trunk layer i, tensor j (kv: 0 keys, 1 values; arrays: slot j,
                        a missing name is an empty slot)
    head.{k}.keys|values|pending
    hidden, logits

and string metadata: format, fingerprint, workspace, n_tokens, layers (JSON
[[kind, tensors], ...]), heads, data_sha256 (of the bytes after the header),
created. bfloat16 is stored as BF16 from its uint16 bit pattern.

Writing: a temp file in the same folder, flushed and fsynced, then `os.replace`
and an fsync of the folder: a reader (or a restart after `kill -9`) sees the whole
file or none of it. Reading checks, before any array is used: the whole-file
sha256 from the manifest, the header's JSON shape, every dtype, shape and offset
(contiguous, inside the file, sized by shape), the format and model fingerprint,
then the snapshot against the model's layout. Any failure is a `BadFile`.

This module only touches numpy and files, never MLX: the bank's writer thread
runs it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from pathlib import Path
from typing import Callable

import numpy as np

from engine.sessions.state import CODES, DTYPES, FORMAT, HeadState, Layout, LayerState, Snapshot, Tensor

CHUNK = 1 << 20  # bytes per write (and per throttle tick)
MAX_HEADER = 64 << 20


class BadFile(Exception):
    """A session file that must not be used (corrupt, truncated, foreign, inconsistent)."""


class Aborted(Exception):
    """The write was called off (the entry was dropped, or the bank is closing)."""


# -- writing ----------------------------------------------------------------------------


def _bytes(data: np.ndarray) -> memoryview:
    """The array's memory as bytes (C-contiguous arrays, as the snapshot's are)."""
    return memoryview(data).cast("B")  # type: ignore[arg-type]  # a buffer (not in the 3.11 stubs)


def _named(s: Snapshot) -> list[tuple[str, np.ndarray, str]]:
    items: list[tuple[str, np.ndarray, str]] = [("tokens", s.tokens, "int32")]
    for i, layer in enumerate(s.layers):
        for j, t in enumerate(layer.tensors):
            if t is not None:
                items.append((f"layer.{i}.{j}", t.data, t.dtype))
    for k, head in enumerate(s.heads):
        for part in ("keys", "values", "pending"):
            t = getattr(head, part)
            if t is not None:
                items.append((f"head.{k}.{part}", t.data, t.dtype))
    for name in ("hidden", "logits"):
        t = getattr(s, name)
        if t is not None:
            items.append((name, t.data, t.dtype))
    return [(name, np.ascontiguousarray(data), dtype) for name, data, dtype in items]


def _header(items: list[tuple[str, np.ndarray, str]], metadata: dict[str, str]) -> bytes:
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, data, dtype in items:
        header[name] = {"dtype": DTYPES[dtype][0], "shape": list(data.shape),
                        "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def snapshot_metadata(s: Snapshot, fingerprint: str, workspace: str) -> dict[str, str]:
    return {
        "format": FORMAT,
        "fingerprint": fingerprint,
        "workspace": workspace,
        "n_tokens": str(s.n),
        "layers": json.dumps([[layer.kind, len(layer.tensors)] for layer in s.layers]),
        "heads": str(len(s.heads)),
        "logits": "1" if s.logits is not None else "0",
        "created": str(round(time.time(), 3)),
    }


def write_snapshot(
    folder: Path,
    name: str,
    s: Snapshot,
    metadata: dict[str, str],
    rate_bps: int = 0,
    abort: Callable[[], bool] = lambda: False,
) -> tuple[str, int]:
    """Write `s` to folder/name atomically. Returns (sha256 of the file, its size)."""
    items = _named(s)
    data_hash = hashlib.sha256()
    for _, data, _ in items:
        data_hash.update(_bytes(data))
    header = _header(items, {**metadata, "data_sha256": data_hash.hexdigest()})
    file_hash = hashlib.sha256()
    tmp = folder / f".{name}.tmp"
    written, started = 0, time.monotonic()
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            for piece in (len(header).to_bytes(8, "little"), header):
                f.write(piece)
                file_hash.update(piece)
            step = CHUNK if rate_bps <= 0 else max(4096, min(CHUNK, rate_bps // 10))
            for _, data, _ in items:
                view = _bytes(data)
                for start in range(0, len(view), step):
                    if abort():
                        raise Aborted()
                    part = view[start : start + step]
                    f.write(part)
                    file_hash.update(part)
                    written += len(part)
                    if rate_bps > 0:  # a background write must not hog the disk
                        f.flush()
                        while (ahead := written / rate_bps - (time.monotonic() - started)) > 0:
                            if abort():
                                raise Aborted()
                            time.sleep(min(ahead, 0.1))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / name)
        fsync_dir(folder)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return file_hash.hexdigest(), 8 + len(header) + written


def fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: Path, value: object) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(value, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


# -- reading ----------------------------------------------------------------------------


def _parse(buf: bytes | memoryview, size: int) -> tuple[dict[str, str], dict[str, tuple[str, tuple, int, int]], int]:
    """(metadata, name -> (dtype name, shape, start, stop) relative to the data, data start).
    `buf` holds at least the length prefix and the header; `size` is the file size."""
    if size < 8 or len(buf) < 8:
        raise BadFile("shorter than a safetensors header")
    n = int.from_bytes(bytes(buf[:8]), "little")
    if n <= 1 or n > MAX_HEADER or 8 + n > size or 8 + n > len(buf):
        raise BadFile(f"header length {n} does not fit a {size}-byte file")
    try:
        header = json.loads(bytes(buf[8 : 8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadFile(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise BadFile("header is not an object")
    metadata = header.pop("__metadata__", None)
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise BadFile("metadata missing or not strings")
    data_size = size - 8 - n
    infos: dict[str, tuple[str, tuple, int, int]] = {}
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise BadFile(f"{name}: malformed entry")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in CODES:
            raise BadFile(f"{name}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 1 << 40 for d in shape):
            raise BadFile(f"{name}: bad shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise BadFile(f"{name}: bad offsets {offsets!r}")
        start, stop = offsets
        itemsize = np.dtype(DTYPES[CODES[dtype]][1]).itemsize
        if not 0 <= start <= stop <= data_size or stop - start != math.prod(shape) * itemsize:
            raise BadFile(f"{name}: offsets {offsets} do not match shape {shape} inside {data_size} bytes")
        infos[name] = (CODES[dtype], tuple(shape), start, stop)
    spans = sorted((start, stop) for _, _, start, stop in infos.values())
    position = 0
    for start, stop in spans:
        if start != position:
            raise BadFile("tensor data overlaps or leaves holes")
        position = stop
    if position != data_size:
        raise BadFile(f"data region is {data_size} bytes, tensors cover {position} (truncated or padded)")
    return metadata, infos, 8 + n


def _check_metadata(metadata: dict[str, str], fingerprint: str) -> int:
    if metadata.get("format") != FORMAT:
        raise BadFile(f"not a {FORMAT} file (format {metadata.get('format')!r})")
    if metadata.get("fingerprint") != fingerprint:
        raise BadFile("written for another model (fingerprint mismatch)")
    try:
        n = int(metadata["n_tokens"])
        json.loads(metadata["layers"])
        int(metadata["heads"])
    except (KeyError, ValueError) as e:
        raise BadFile(f"bad metadata: {e}") from None
    if n < 1 or "workspace" not in metadata or len(metadata.get("data_sha256", "")) != 64:
        raise BadFile("bad metadata")
    return n


def _array(buf: bytes, start: int, info: tuple[str, tuple, int, int]) -> np.ndarray:
    dtype, shape, a, b = info
    raw = np.dtype(DTYPES[dtype][1])
    array = np.frombuffer(buf, dtype=raw, count=(b - a) // raw.itemsize, offset=start + a).reshape(shape)
    return array  # read-only: a view of an immutable bytes object


def read_index(path: Path, fingerprint: str) -> tuple[dict[str, str], np.ndarray, int]:
    """Header and tokens only (cheap, for building the index at start):
    (metadata, tokens, file size)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        n = int.from_bytes(prefix, "little") if len(prefix) == 8 else 0
        if n <= 1 or n > MAX_HEADER or 8 + n > size:
            raise BadFile("bad header length")
        buf = prefix + f.read(n)
        metadata, infos, start = _parse(buf, size)
        n_tokens = _check_metadata(metadata, fingerprint)
        info = infos.get("tokens")
        if info is None or info[0] != "int32" or info[1] != (n_tokens,):
            raise BadFile("tokens missing or of the wrong shape")
        f.seek(start + info[2])
        raw = f.read(info[3] - info[2])
    if len(raw) != info[3] - info[2]:
        raise BadFile("truncated")
    tokens = np.frombuffer(raw, dtype="<i4").astype(np.int32)
    tokens.flags.writeable = False
    return metadata, tokens, size


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(CHUNK * 4):
            h.update(piece)
    return h.hexdigest()


def read_snapshot(path: Path, sha256: str | None, fingerprint: str, layout: Layout) -> tuple[Snapshot, dict[str, str]]:
    """The whole entry, verified. `sha256` None: check the header's data_sha256 only."""
    buf = path.read_bytes()
    if sha256 is not None and hashlib.sha256(buf).hexdigest() != sha256:
        raise BadFile("checksum mismatch (corrupt or truncated)")
    metadata, infos, start = _parse(buf, len(buf))
    n = _check_metadata(metadata, fingerprint)
    if sha256 is None and hashlib.sha256(memoryview(buf)[start:]).hexdigest() != metadata["data_sha256"]:
        raise BadFile("data checksum mismatch")
    used: set[str] = set()

    def take(name: str, dtype: str | None = None) -> Tensor | None:
        info = infos.get(name)
        if info is None:
            return None
        used.add(name)
        return Tensor(_array(buf, start, info), info[0])

    tokens = take("tokens")
    if tokens is None or tokens.dtype != "int32" or tokens.shape != (n,):
        raise BadFile("tokens missing or of the wrong shape")
    layers = []
    for i, spec in enumerate(json.loads(metadata["layers"])):
        if not (isinstance(spec, list) and len(spec) == 2 and spec[0] in ("kv", "arrays") and type(spec[1]) is int
                and 0 <= spec[1] <= 64):
            raise BadFile(f"layer {i}: bad description {spec!r}")
        layers.append(LayerState(spec[0], [take(f"layer.{i}.{j}") for j in range(spec[1])]))
    heads = [HeadState(take(f"head.{k}.keys"), take(f"head.{k}.values"), take(f"head.{k}.pending"))
             for k in range(int(metadata["heads"]))]
    snapshot = Snapshot(tokens.data, layers, heads, take("hidden"), take("logits"))
    unknown = set(infos) - used
    if unknown:
        raise BadFile(f"unexpected tensors {sorted(unknown)[:3]}")
    try:
        layout.check(snapshot)
    except ValueError as e:
        raise BadFile(f"does not fit this model: {e}") from None
    return snapshot, metadata
