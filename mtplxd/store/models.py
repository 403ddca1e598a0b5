"""The models folder: `<state dir>/models/<name>/`, one converted checkpoint each.

Each model folder is an ordinary Hugging Face-layout checkpoint (what
engine/conversion.py writes) plus RECORD_FILE, a small JSON record: where it
came from (repository id or folder, revision), its quantization, family and
head count, when it was made and when a daemon last loaded it.

`--model` accepts a path, a models-folder name or a pulled repository id
(resolve_model). Standard library only: `mtplxd models` and option parsing
stay fast and never load MLX.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RECORD_FILE = "mtplxd-model.json"
MODELS_DIR = "models"
# Hugging Face repository ids: "name" or "owner/name" (letters, digits, - _ .).
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_NAME = re.compile(r"[A-Za-z0-9][\w.+-]*")


class ModelError(ValueError):
    """A model name, repository id or folder that cannot be used; str(e) is one line."""


def models_dir(state_dir: Path) -> Path:
    return Path(state_dir) / MODELS_DIR


def check_name(name: str) -> str:
    """A models-folder name: one path component, no hidden or relative names."""
    if not _NAME.fullmatch(name) or name in (".", ".."):
        raise ModelError(f"{name!r} is not a valid model name (letters, digits, and - _ . + inside)")
    return name


def check_repo_id(repo_id: str) -> str:
    if not REPO_ID.fullmatch(repo_id) or ".." in repo_id:
        raise ModelError(f"{repo_id!r} is not a valid repository id (expected owner/name)")
    return repo_id


def default_name(repo_id: str, bits: int | None) -> str:
    """`owner/Name` pulled in 4-bit is `Name-4bit`; unquantized, just `Name`."""
    base = repo_id.rstrip("/").rsplit("/", 1)[-1]
    return f"{base}-{bits}bit" if bits else base


# -- records -------------------------------------------------------------------------


def read_record(folder: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((Path(folder) / RECORD_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def write_record(folder: Path, record: dict[str, Any]) -> None:
    """Atomically, so a reader never sees half a record."""
    path = Path(folder) / RECORD_FILE
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)


def new_record(name: str, source: str, revision: str | None, result: Any) -> dict[str, Any]:
    """The record of a fresh conversion (`result`: an engine ConversionResult)."""
    return {
        "name": name,
        "source": source,
        "revision": revision,
        "quantization": result.quantization,
        "family": result.family,
        "mtp_heads": result.mtp_heads,
        "size_bytes": result.size_bytes,
        "created": time.time(),
        "last_used": None,
    }


def touch_last_used(folder: Path) -> None:
    """Note that a daemon loaded this model (a no-op outside the models folder's layout)."""
    record = read_record(folder)
    if record is None:
        return
    record["last_used"] = time.time()
    try:
        write_record(folder, record)
    except OSError:  # a read-only model folder still loads
        pass


# -- listing, removing, resolving --------------------------------------------------------


@dataclass(frozen=True)
class ModelEntry:
    name: str
    path: Path
    record: dict[str, Any]  # {} for a folder without a record (copied in by hand)

    @property
    def last_used(self) -> float | None:
        return self.record.get("last_used")


def list_models(state_dir: Path) -> list[ModelEntry]:
    folder = models_dir(state_dir)
    if not folder.is_dir():
        return []
    return [
        ModelEntry(p.name, p, read_record(p) or {})
        for p in sorted(folder.iterdir())
        if p.is_dir() and not p.name.startswith(".")  # hidden: conversions in progress
    ]


def remove_model(state_dir: Path, name: str) -> Path:
    path = models_dir(state_dir) / check_name(name)
    if not path.is_dir():
        raise ModelError(f"no model named {name!r} in {models_dir(state_dir)} (see: mtplxd models)")
    shutil.rmtree(path)
    return path


def resolve_model(value: str, state_dir: Path) -> Path:
    """What `--model VALUE` names: an existing path, else a models-folder name, else the
    most recently used model pulled from that repository id."""
    path = Path(value).expanduser()
    if path.exists():
        return path.absolute()
    named = models_dir(state_dir) / value
    if _NAME.fullmatch(value) and named.is_dir():
        return named
    pulled = [e for e in list_models(state_dir) if e.record.get("source") == value]
    if pulled:
        newest = max(pulled, key=lambda e: (e.last_used or 0, e.record.get("created") or 0))
        return newest.path
    hint = f"; pull it with: mtplxd pull {value}" if "/" in value and REPO_ID.fullmatch(value) else ""
    raise ModelError(f"{value!r} is not a folder, a model in {models_dir(state_dir)}, "
                     f"or a pulled repository{hint}")


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())
