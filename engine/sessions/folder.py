"""The session bank's disk folder at start: what is there, what can be trusted, what goes.

`<state>/sessions/<fingerprint[:16]>/` holds one safetensors file per entry
(engine/sessions/files.py) and `manifest.json`, which lists every file with its
sha256 and is replaced atomically after the file is in place. At start, leftover
temp files are removed, listed files are indexed from their headers, and complete
files a crash left out of the manifest are adopted after their data checksum is
verified. A bad file is renamed `*.bad` and counted; the newest few are kept for
inspection. Folders of other models share the disk budget, oldest first out.

Never imports MLX.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np

from engine.sessions.files import BadFile, file_sha256, read_index, read_snapshot
from engine.sessions.index import Entry
from engine.sessions.state import FORMAT, ModelKey

log = logging.getLogger("mtplxd.sessions")

MANIFEST = "manifest.json"
SUFFIX = ".safetensors"
KEEP_BAD = 16  # set-aside files kept for inspection

# (name, sha256, bytes, metadata, tokens, last_used from the manifest or None)
OnFile = Callable[[str, str, int, dict, np.ndarray, object], None]


def manifest_record(e: Entry) -> dict:
    return {"file": e.name, "sha256": e.sha256, "bytes": e.file_bytes, "workspace": e.workspace,
            "n_tokens": e.n, "heads": e.heads, "logits": e.logits, "created": e.created, "last_used": e.last_used}


def set_aside(path: Path) -> None:
    try:
        os.replace(path, path.with_name(path.name + ".bad"))
    except OSError:
        pass


def scan_folder(folder: Path, model: ModelKey, on_file: OnFile, on_bad: Callable[[], None]) -> bool:
    """Report every trustworthy file of `folder` to `on_file` and count each set-aside one
    with `on_bad`. True when the manifest needs rewriting."""
    for tmp in folder.glob(".*.tmp"):  # a write or manifest update a crash interrupted
        tmp.unlink(missing_ok=True)
    dirty, listed = False, set()
    for record in _read_manifest(folder / MANIFEST, model.fingerprint):
        name = record.get("file") if isinstance(record, dict) else None
        if not isinstance(name, str) or not name.endswith(SUFFIX) or "/" in name or name.startswith("."):
            dirty = True
            continue
        listed.add(name)
        path = folder / name
        try:
            metadata, tokens, size = read_index(path, model.fingerprint)
            if size != record.get("bytes") or metadata["workspace"] != record.get("workspace") \
                    or not isinstance(record.get("sha256"), str):
                raise BadFile("does not match its manifest record")
        except FileNotFoundError:
            dirty = True
            continue
        except (BadFile, OSError, ValueError, KeyError) as e:
            _bad_file(path, e, on_bad)
            dirty = True
            continue
        on_file(name, record["sha256"], size, metadata, tokens, record.get("last_used"))
    for path in folder.glob(f"*{SUFFIX}"):  # complete files a crash kept out of the manifest
        if path.name in listed:
            continue
        try:
            metadata, tokens, size = read_index(path, model.fingerprint)
            sha = file_sha256(path)
            read_snapshot(path, None, model.fingerprint, model.layout)  # verifies the data checksum
        except (BadFile, OSError, ValueError, KeyError) as e:
            _bad_file(path, e, on_bad)
            continue
        on_file(path.name, sha, size, metadata, tokens, None)
        dirty = True
    bad = sorted(folder.glob("*.bad"), key=lambda p: p.stat().st_mtime)
    for path in bad[:-KEEP_BAD]:
        path.unlink(missing_ok=True)
    return dirty


def _bad_file(path: Path, error: Exception, on_bad: Callable[[], None]) -> None:
    log.warning("session file %s set aside: %s", path.name, error)
    on_bad()
    set_aside(path)


def _read_manifest(path: Path, fingerprint: str) -> list:
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), list):
            raise ValueError("not a session manifest")
        if data.get("fingerprint") != fingerprint:
            raise ValueError("manifest of another model")
        return data["entries"]
    except (OSError, ValueError, UnicodeDecodeError) as e:
        log.warning("session manifest set aside: %s", e)
        set_aside(path)
        return []


def prune_other_models(root: Path, folder: Path, budget: int) -> None:
    """Delete other models' folders, oldest first, until everything under `root` fits `budget`."""
    others = [p for p in root.iterdir() if p.is_dir() and p != folder]
    if not others:
        return
    sizes = {p: sum(f.stat().st_size for f in p.glob("*") if f.is_file()) for p in others}
    total = sum(sizes.values()) + sum(f.stat().st_size for f in folder.glob("*") if f.is_file())
    for p in sorted(others, key=lambda p: p.stat().st_mtime):
        if total <= budget:
            break
        shutil.rmtree(p, ignore_errors=True)
        total -= sizes[p]
