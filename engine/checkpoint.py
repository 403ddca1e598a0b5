"""Reading Hugging Face checkpoint folders: config, weight files, tensors.

Shared by the compatibility registry (which reads only headers) and the
backends (which load tensors). Every problem is a CheckpointError whose
message is one line a user can act on.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Callable, cast


class CheckpointError(Exception):
    """A checkpoint folder that cannot be read; str(e) is one line."""


class GGUFError(CheckpointError):
    """A GGUF file that cannot be imported (engine/gguf_import.py); str(e) is one line."""


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a directory")
    if not path.is_file():
        raise CheckpointError(f"{folder}: no config.json")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: malformed JSON ({e.msg if hasattr(e, 'msg') else e})")
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return config


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: nested `text_config` where there is one."""
    nested = config.get("text_config")
    if isinstance(nested, dict):
        return {**nested, "model_type": nested.get("model_type", config.get("model_type"))}
    return config


def weight_files(folder: Path) -> list[Path]:
    """Every safetensors file of the checkpoint, shards and sidecars included.

    The index (model.safetensors.index.json) names the shards; files it does
    not name (a sidecar `mtp.safetensors`) are added, since MTP weights often
    ship beside the trunk's.
    """
    files: set[Path] = set()
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError):  # ValueError: bad JSON or UTF-8
            raise CheckpointError(f"{index}: malformed index (no weight_map)")
        if not isinstance(weight_map, dict) or not all(
            isinstance(name, str) for name in weight_map.values()
        ):
            raise CheckpointError(f"{index}: malformed index (weight_map is not key -> file)")
        for name in set(weight_map.values()):
            shard = folder / name
            if not shard.is_file():
                raise CheckpointError(f"{index}: names missing shard {name}")
            files.add(shard)
    files.update(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no safetensors weight files")
    return sorted(files)


def read_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file: key -> {dtype, shape, data_offsets}."""
    try:
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", raw)
            size = path.stat().st_size
            if n > size - 8:
                raise CheckpointError(f"{path}: truncated safetensors file (header past end)")
            header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{path}: corrupt safetensors header")
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    try:
        data_end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    except (KeyError, IndexError, TypeError, ValueError):
        raise CheckpointError(f"{path}: corrupt safetensors header (bad data_offsets)")
    if 8 + n + data_end > size:
        raise CheckpointError(f"{path}: truncated safetensors file (data past end)")
    return header


def weight_keys(folder: Path) -> dict[str, Path]:
    """Every tensor name of the checkpoint, mapped to the file holding it."""
    keys: dict[str, Path] = {}
    for path in weight_files(folder):
        for key in read_header(path):
            keys[key] = path
    return keys


def load_weights(folder: Path) -> dict[str, Any]:
    """All tensors of the checkpoint as mx.arrays (headers checked first)."""
    import mlx.core as mx

    weights: dict[str, Any] = {}
    for path in weight_files(folder):
        read_header(path)
        weights.update(cast("dict[str, Any]", mx.load(str(path))))  # a .safetensors file: a dict
    return weights


def write_safetensors_subset(src: Path, dst: Path, keep: Callable[[str], bool]) -> None:
    """The tensors of `src` that `keep` accepts, byte for byte (any dtype, never decoded,
    never all in memory), into `dst`; nothing is written when none is kept."""
    with src.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        metadata = header.pop("__metadata__", None)
        kept = sorted((k for k in header if keep(k)), key=lambda k: header[k]["data_offsets"][0])
        if not kept:
            return
        new: dict = {"__metadata__": metadata} if metadata is not None else {}
        offset = 0
        for k in kept:
            start, end = header[k]["data_offsets"]
            new[k] = {**header[k], "data_offsets": [offset, offset + end - start]}
            offset += end - start
        text = json.dumps(new, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the format aligns the data to 8 bytes
        tmp = dst.with_name(dst.name + ".tmp")
        with tmp.open("wb") as w:
            w.write(struct.pack("<Q", len(text)) + text)
            for k in kept:
                start, end = header[k]["data_offsets"]
                f.seek(8 + n + start)
                _copy_bytes(f, w, end - start)
    os.replace(tmp, dst)


def _copy_bytes(f, w, n: int, chunk: int = 1 << 26) -> None:
    while n > 0:
        data = f.read(min(n, chunk))
        if not data:
            raise CheckpointError(f"{f.name}: truncated safetensors file")
        w.write(data)
        n -= len(data)


# config.json key under which `mtplxd convert` records what it did to a checkpoint
# (see engine/conversion.py); mlx-lm ignores keys it does not know.
CONVERSION_KEY = "mtplxd_conversion"


def conversion_record(config: dict[str, Any]) -> dict[str, Any]:
    """What mtplxd's converter recorded in this config ({} for an original checkpoint)."""
    record = config.get(CONVERSION_KEY)
    return record if isinstance(record, dict) else {}
