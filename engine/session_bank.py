"""The session bank: cache snapshots keyed by token prefix, per workspace, in RAM and on disk.

Keys. Every entry belongs to one workspace (an absolute folder; "" is the default
namespace) and holds the tokens its snapshot was fed. Entries are indexed by a
chained hash of their 256-token blocks, h0 = sha256(model fingerprint, workspace),
h_i = sha256(h_{i-1}, tokens of block i), so a lookup walks the prompt's blocks and
only compares token ids with the entries that share the deepest block; the stored
ids are always compared before an entry is used. The workspace is inside h0: one
workspace's entries never serve another's requests.

Reuse. For attention-only models (every trunk cache is KV) an entry serves any
prefix of itself: the KV is sliced at restore, which subsumes checkpoints at block
boundaries; an entry whose tokens are a strict prefix of a new one is superseded
by it. Hybrid models (recurrent GatedDeltaNet state, which cannot be sliced) only
reuse an entry whole, so their checkpoints are taken where they are exact (end of
each prompt, end of generation, prefill chunk boundaries of warm-ups). A prompt
restored whole samples its first token from the stored logits; otherwise at least
its last token is fed again.

Tiers. RAM: snapshots as read-only numpy arrays, bounded in bytes, least recently
used evicted first among leaves (entries no other entry extends), so a shared
prefix outlives its branches. Disk: `<state>/sessions/<fingerprint[:16]>/`, one
safetensors file per entry (engine/session_files.py) written by a background
thread some seconds after the entry appears (a burst of requests supersedes most
entries before they are written), at once when it leaves RAM, and all at once on
close; `manifest.json` lists every file with its sha256 and is replaced
atomically after the file is in place. A disk hit is read, verified (checksum,
fingerprint, shapes, offsets) and promoted to RAM; a bad file is renamed
`*.bad`, counted, and the lookup goes on as if it were not there. At start,
leftover temp files are removed, listed files are indexed from their headers,
and complete files a crash left out of the manifest are adopted after their data
checksum is verified.

Thread model: `lookup`/`add` run on the engine worker thread, listings and
`clear` on the event loop, file writes on the bank's own thread. One lock guards
the index; no file is read or written while holding it. This module never
imports MLX.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from engine.session_files import (
    Aborted,
    BadFile,
    file_sha256,
    read_index,
    read_snapshot,
    snapshot_metadata,
    write_json_atomic,
    write_snapshot,
)
from engine.session_state import FORMAT, ModelKey, Restore, Snapshot

log = logging.getLogger("mtplxd.sessions")

BLOCK = 256
MANIFEST = "manifest.json"
SUFFIX = ".safetensors"
KEEP_BAD = 16  # set-aside files kept for inspection


def _block_hashes(seed: bytes, tokens: np.ndarray) -> list[bytes]:
    out, h = [], seed
    for i in range(len(tokens) // BLOCK):
        h = hashlib.sha256(h + tokens[i * BLOCK : (i + 1) * BLOCK].astype("<i4").tobytes()).digest()
        out.append(h)
    return out


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    if m == 0:
        return 0
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


@dataclass(eq=False)
class _Entry:
    id: int
    workspace: str
    tokens: np.ndarray
    hashes: list[bytes]
    heads: int
    logits: bool
    created: float
    last_used: float
    snapshot: Snapshot | None = None  # held in RAM, or until its file is written
    in_ram: bool = False  # counted in the RAM tier
    nbytes: int = 0
    name: str = ""  # file name, once chosen
    file: bool = False  # the file is complete and in the manifest
    sha256: str = ""
    file_bytes: int = 0
    write_due: float | None = None  # monotonic time the background write may start
    writing: bool = False
    no_disk: bool = False  # evicted from disk (or too big): never written again
    dropped: bool = False
    hits: int = 0
    parents: set[int] = field(default_factory=set)
    children: set[int] = field(default_factory=set)
    retained: list[dict] = field(default_factory=list)  # superseded files kept until this one is written

    @property
    def n(self) -> int:
        return int(self.tokens.shape[0])


@dataclass
class WorkspaceStats:
    workspace: str
    entries: int = 0
    ram_entries: int = 0
    disk_entries: int = 0
    ram_bytes: int = 0
    disk_bytes: int = 0
    hits_ram: int = 0
    hits_disk: int = 0
    misses: int = 0
    cached_tokens: int = 0

    @property
    def hits(self) -> int:
        return self.hits_ram + self.hits_disk


@dataclass
class BankStats:
    enabled: bool
    ram_bytes: int
    ram_budget: int
    disk_bytes: int
    disk_budget: int
    ram_entries: int
    disk_entries: int
    pending_writes: int
    hits_ram: int
    hits_disk: int
    misses: int
    cached_tokens: int
    evictions_ram: int
    evictions_disk: int
    bad_files: int
    writes: int


@dataclass
class _Counters:
    hits_ram: int = 0
    hits_disk: int = 0
    misses: int = 0
    cached_tokens: int = 0


class SessionBank:
    def __init__(
        self,
        folder: Path | None,
        ram_bytes: int,
        disk_bytes: int = 0,
        write_delay_s: float = 2.0,
        write_bps: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`folder`: the disk tier's root (None: RAM only); budgets in bytes (0 disables
        a tier; a bank without RAM is off). `write_delay_s`: how long a new entry waits
        before its background write; `write_bps`: a cap on write speed (0: none)."""
        self.root = Path(folder) if folder is not None else None
        self.ram_budget = max(0, int(ram_bytes))
        self.disk_budget = max(0, int(disk_bytes)) if folder is not None else 0
        self.write_delay_s = write_delay_s
        self.write_bps = write_bps
        self._clock = clock
        self._cond = threading.Condition(threading.RLock())
        self.model: ModelKey | None = None
        self.folder: Path | None = None
        self._entries: dict[int, _Entry] = {}
        self._by_hash: dict[bytes, set[int]] = {}
        self._by_ws: dict[str, set[int]] = {}
        self._ids = itertools.count(1)
        self._seeds: dict[str, bytes] = {}
        self._counters: dict[str, _Counters] = {}
        self._ram_bytes = 0
        self._evictions_ram = self._evictions_disk = self._bad = self._writes = 0
        self._manifest_dirty = False
        self._touched = False
        self._doomed: list[str] = []  # files to delete once the manifest no longer lists them
        self._flushing = False
        self._closing = False
        self._writer: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self.ram_budget > 0 and self.model is not None

    @property
    def trimmable(self) -> bool:
        return self.model is not None and self.model.layout.trimmable

    def attach(self, model: ModelKey) -> None:
        """Bind to the loaded model: open its disk tier and start the writer."""
        with self._cond:
            self.model = model
        if self.ram_budget <= 0:
            return
        if self.root is not None and self.disk_budget > 0:
            try:
                self._open_disk()
            except OSError as e:
                log.warning("session bank: disk tier unavailable (%s); RAM only", e)
                self.folder, self.disk_budget = None, 0
        self._writer = threading.Thread(target=self._write_loop, name="mtplxd-session-writer", daemon=True)
        self._writer.start()

    def close(self, timeout: float = 30.0) -> bool:
        """Write every pending entry (within `timeout`), then stop the writer.
        True when nothing was left unwritten."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._flushing = True
            self._cond.notify_all()
            while self._writer is not None and self._writer.is_alive() and (
                self._pending_writes() or self._manifest_dirty or self._touched or self._doomed
            ):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.1))
            done = not self._pending_writes()
            self._flushing = False  # a write still going is called off (its temp file removed)
            self._closing = True
            self._cond.notify_all()
        if self._writer is not None:
            self._writer.join(max(0.0, deadline - time.monotonic()) + 1.0)
        return done

    def flush(self, timeout: float = 30.0) -> bool:
        """Write every pending entry now; the writer keeps running."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._flushing = True
            self._cond.notify_all()
            while self._writer is not None and self._writer.is_alive() and (
                self._pending_writes() or self._manifest_dirty or self._touched or self._doomed
            ):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.1))
            self._flushing = False
            return not self._pending_writes()

    # -- lookups (engine worker thread) ------------------------------------------------------

    def lookup(self, workspace: str | None, prompt: Iterable[int]) -> Restore | None:
        """The longest reusable prefix of `prompt` in `workspace`, or None (a miss)."""
        if not self.enabled:
            return None
        ws = workspace or ""
        tokens = np.asarray(list(prompt), dtype=np.int32)
        tried: set[int] = set()
        while True:
            with self._cond:
                found = self._best(ws, tokens, tried)
                counters = self._counters.setdefault(ws, _Counters())
                if found is None:
                    counters.misses += 1
                    return None
                entry, length = found
                if entry.snapshot is not None:
                    self._touch(entry)
                    counters.hits_ram += 1
                    counters.cached_tokens += length
                    return Restore(entry.snapshot, length, "ram")
                name, sha = entry.name, entry.sha256
            tried.add(entry.id)
            snapshot = self._load(entry, name, sha)
            if snapshot is None:
                continue
            with self._cond:
                if not entry.dropped:
                    self._promote(entry, snapshot)
                counters = self._counters.setdefault(ws, _Counters())
                counters.hits_disk += 1
                counters.cached_tokens += length
            return Restore(snapshot, length, "disk")

    def _best(self, ws: str, tokens: np.ndarray, tried: set[int]) -> tuple[_Entry, int] | None:
        hashes = _block_hashes(self._seed(ws), tokens)
        best: tuple[int, int, float, _Entry] | None = None
        seen: set[int] = set()
        trimmable = self.trimmable
        level = len(hashes)
        while level >= 0:
            if level == 0:
                ids = self._by_ws.get(ws, set())
            else:
                ids = self._by_hash.get(hashes[level - 1], set())
            for i in ids - seen - tried:
                seen.add(i)
                entry = self._entries[i]
                length = self._usable(entry, tokens, trimmable)
                if length > 0:
                    key = (length, entry.snapshot is not None, entry.last_used, entry)
                    if best is None or key[:3] > best[:3]:
                        best = key
            if best is not None and (trimmable or best[0] >= BLOCK * level):
                break  # nothing at a shallower level can be longer
            level -= 1
        return None if best is None else (best[3], best[0])

    @staticmethod
    def _usable(entry: _Entry, tokens: np.ndarray, trimmable: bool) -> int:
        """How many prompt tokens `entry` can restore (0: none)."""
        n, p = entry.n, len(tokens)
        lcp = _lcp(entry.tokens, tokens)
        if lcp >= n:  # the whole entry is a prefix of the prompt
            if n < p or entry.logits:
                length = n
            else:
                length = n - 1 if trimmable else 0
        else:
            length = min(lcp, p - 1) if trimmable else 0
        return max(length, 0)

    def _load(self, entry: _Entry, name: str, sha: str) -> Snapshot | None:
        path = self.folder / name
        try:
            snapshot, metadata = read_snapshot(path, sha, self.model.fingerprint, self.model.layout)
            if metadata.get("workspace") != entry.workspace or not np.array_equal(snapshot.tokens, entry.tokens):
                raise BadFile("tokens or workspace differ from the index")
            return snapshot
        except FileNotFoundError:
            log.warning("session file %s vanished; dropping its entry", name)
            with self._cond:
                self._drop(entry)
            return None
        except (BadFile, OSError, ValueError) as e:
            log.warning("session file %s set aside: %s", name, e)
            with self._cond:
                self._drop(entry, keep_file=True)
                self._bad += 1
            self._set_aside(path)
            return None

    # -- storing (engine worker thread) ---------------------------------------------------

    def wants(self, workspace: str | None, tokens: Iterable[int], logits: bool = True) -> bool:
        """Whether a snapshot of `tokens` would add anything (checked before copying one)."""
        if not self.enabled:
            return False
        tokens = np.asarray(list(tokens), dtype=np.int32)
        if len(tokens) == 0:
            return False
        with self._cond:
            return self._covering(workspace or "", tokens, logits) is None

    def _covering(self, ws: str, tokens: np.ndarray, logits: bool) -> _Entry | None:
        """An entry that already serves everything a snapshot of `tokens` would."""
        hashes = _block_hashes(self._seed(ws), tokens)
        ids = self._by_hash.get(hashes[-1], set()) if hashes else self._by_ws.get(ws, set())
        n = len(tokens)
        for i in ids:
            e = self._entries[i]
            if e.n == n and (e.logits or not logits) and np.array_equal(e.tokens, tokens):
                return e
            if self.trimmable and e.n > n and np.array_equal(e.tokens[:n], tokens):
                return e
        return None

    def add(self, workspace: str | None, snapshot: Snapshot | None) -> bool:
        """Keep `snapshot` for `workspace`. False when it added nothing."""
        if snapshot is None or not self.enabled:
            return False
        ws = workspace or ""
        tokens = snapshot.tokens
        with self._cond:
            if self._covering(ws, tokens, snapshot.logits is not None) is not None:
                return False
            now = time.time()
            entry = _Entry(
                id=next(self._ids), workspace=ws, tokens=tokens, hashes=_block_hashes(self._seed(ws), tokens),
                heads=len(snapshot.heads), logits=snapshot.logits is not None, created=now, last_used=now,
                snapshot=snapshot, nbytes=snapshot.nbytes, name=f"{uuid.uuid4().hex}{SUFFIX}",
            )
            if self.folder is None or entry.nbytes > self.disk_budget:
                entry.no_disk = True
            for other in self._related(ws, tokens):
                if other.n == entry.n:  # same tokens, fewer parts (no logits): replaced
                    self._drop(other, superseded_by=entry)
                elif other.n < entry.n:
                    if self.trimmable:
                        self._drop(other, superseded_by=entry)  # the new entry serves its prefix
                    else:
                        entry.parents.add(other.id)
                        other.children.add(entry.id)
                else:
                    entry.children.add(other.id)
                    other.parents.add(entry.id)
            self._insert(entry)
            if entry.no_disk:
                self._doomed += [r["file"] for r in entry.retained]
                entry.retained = []
            else:
                entry.write_due = self._clock() + self.write_delay_s
            if entry.nbytes <= self.ram_budget:
                entry.in_ram = True
                self._ram_bytes += entry.nbytes
                self._evict_ram(keep=entry)
            elif entry.no_disk:
                self._drop(entry)
                return False
            else:
                entry.write_due = self._clock()  # too big for RAM: straight to disk
            self._cond.notify_all()
            return True

    def _related(self, ws: str, tokens: np.ndarray) -> list[_Entry]:
        """Entries of `ws` that are a prefix of `tokens` or that `tokens` is a prefix of."""
        out = []
        for i in self._by_ws.get(ws, set()):
            e = self._entries[i]
            m = min(e.n, len(tokens))
            if np.array_equal(e.tokens[:m], tokens[:m]):
                out.append(e)
        return out

    # -- administration (any thread) ------------------------------------------------------

    def clear(self, workspace: str | None) -> int:
        """Drop every entry of `workspace`, in RAM and on disk. Returns how many."""
        ws = workspace or ""
        with self._cond:
            entries = [self._entries[i] for i in list(self._by_ws.get(ws, set()))]
            for entry in entries:
                self._drop(entry)
            self._counters.pop(ws, None)
            self._cond.notify_all()
            return len(entries)

    def workspaces(self) -> list[WorkspaceStats]:
        with self._cond:
            names = set(self._by_ws) | set(self._counters)
            out = []
            for ws in sorted(names):
                s = WorkspaceStats(ws)
                for i in self._by_ws.get(ws, set()):
                    e = self._entries[i]
                    s.entries += 1
                    if e.in_ram:
                        s.ram_entries += 1
                        s.ram_bytes += e.nbytes
                    if e.file:
                        s.disk_entries += 1
                        s.disk_bytes += e.file_bytes
                c = self._counters.get(ws, _Counters())
                s.hits_ram, s.hits_disk, s.misses, s.cached_tokens = c.hits_ram, c.hits_disk, c.misses, c.cached_tokens
                if s.entries or s.hits or s.misses:
                    out.append(s)
            return out

    def stats(self) -> BankStats:
        with self._cond:
            totals = _Counters()
            for c in self._counters.values():
                totals.hits_ram += c.hits_ram
                totals.hits_disk += c.hits_disk
                totals.misses += c.misses
                totals.cached_tokens += c.cached_tokens
            files = [e for e in self._entries.values() if e.file]
            return BankStats(
                enabled=self.enabled, ram_bytes=self._ram_bytes, ram_budget=self.ram_budget,
                disk_bytes=self._disk_bytes(), disk_budget=self.disk_budget,
                ram_entries=sum(e.in_ram for e in self._entries.values()), disk_entries=len(files),
                pending_writes=self._pending_writes(), hits_ram=totals.hits_ram, hits_disk=totals.hits_disk,
                misses=totals.misses, cached_tokens=totals.cached_tokens, evictions_ram=self._evictions_ram,
                evictions_disk=self._evictions_disk, bad_files=self._bad, writes=self._writes,
            )

    # -- index internals (hold the lock) -----------------------------------------------------

    def _seed(self, ws: str) -> bytes:
        seed = self._seeds.get(ws)
        if seed is None:
            fingerprint = self.model.fingerprint if self.model else ""
            seed = self._seeds[ws] = hashlib.sha256(f"{fingerprint}\0{ws}".encode()).digest()
        return seed

    def _insert(self, entry: _Entry) -> None:
        self._entries[entry.id] = entry
        self._by_ws.setdefault(entry.workspace, set()).add(entry.id)
        for h in entry.hashes:
            self._by_hash.setdefault(h, set()).add(entry.id)

    def _touch(self, entry: _Entry) -> None:
        entry.last_used = time.time()
        entry.hits += 1
        if entry.file:
            self._touched = True  # LRU order survives a restart: written with the next change or flush

    def _drop(self, entry: _Entry, superseded_by: _Entry | None = None, keep_file: bool = False) -> None:
        if entry.dropped:
            return
        entry.dropped = True
        self._entries.pop(entry.id, None)
        ids = self._by_ws.get(entry.workspace)
        if ids is not None:
            ids.discard(entry.id)
            if not ids:
                del self._by_ws[entry.workspace]
        for h in entry.hashes:
            bucket = self._by_hash.get(h)
            if bucket is not None:
                bucket.discard(entry.id)
                if not bucket:
                    del self._by_hash[h]
        for i in entry.parents:
            if i in self._entries:
                self._entries[i].children.discard(entry.id)
        for i in entry.children:
            if i in self._entries:
                self._entries[i].parents.discard(entry.id)
        if entry.in_ram:
            self._ram_bytes -= entry.nbytes
            entry.in_ram = False
        entry.snapshot = None
        doomed = list(entry.retained)
        entry.retained = []
        if entry.file and not keep_file:
            doomed.append(self._record(entry))
        if entry.file:
            self._manifest_dirty = True
        if superseded_by is not None and not superseded_by.file:
            superseded_by.retained += doomed  # deleted once the new entry is on disk
        else:
            self._doomed += [r["file"] for r in doomed]
        self._cond.notify_all()

    def _promote(self, entry: _Entry, snapshot: Snapshot) -> None:
        self._touch(entry)
        entry.snapshot = snapshot
        if not entry.in_ram and snapshot.nbytes <= self.ram_budget:
            entry.in_ram, entry.nbytes = True, snapshot.nbytes
            self._ram_bytes += entry.nbytes
            self._evict_ram(keep=entry)
        elif not entry.in_ram:
            entry.snapshot = None

    def _victim(self, entries: Iterable[_Entry], keep: _Entry | None) -> _Entry | None:
        """Least recently used, leaves (entries nothing extends) first."""
        candidates = [e for e in entries if e is not keep]
        if not candidates:
            return None
        return min(candidates, key=lambda e: (bool(e.children), e.last_used))

    def _evict_ram(self, keep: _Entry | None = None) -> None:
        while self._ram_bytes > self.ram_budget:
            victim = self._victim((e for e in self._entries.values() if e.in_ram), keep)
            if victim is None:
                return
            self._evictions_ram += 1
            victim.in_ram = False
            self._ram_bytes -= victim.nbytes
            if victim.file:
                victim.snapshot = None  # still served from disk
            elif victim.write_due is not None and not victim.no_disk:
                victim.write_due = self._clock()  # write it now; the snapshot goes once written
            else:
                self._drop(victim)
        self._cond.notify_all()

    def _disk_bytes(self) -> int:
        files = sum(e.file_bytes for e in self._entries.values() if e.file)
        return files + sum(r["bytes"] for e in self._entries.values() for r in e.retained)

    def _evict_disk(self, keep: _Entry | None = None) -> None:
        while self._disk_bytes() > self.disk_budget:
            retained = [e for e in self._entries.values() if e.retained]
            if retained:  # superseded files first
                holder = retained[0]
                self._doomed += [r["file"] for r in holder.retained]
                holder.retained = []
                self._manifest_dirty = True
                continue
            victim = self._victim((e for e in self._entries.values() if e.file), keep)
            if victim is None:
                return
            self._evictions_disk += 1
            if victim.in_ram:
                victim.file, victim.no_disk = False, True
                self._doomed.append(victim.name)
                self._manifest_dirty = True
            else:
                self._drop(victim)

    def _pending_writes(self) -> int:
        return sum(1 for e in self._entries.values() if (e.write_due is not None and not e.no_disk) or e.writing)

    def _record(self, e: _Entry) -> dict:
        return {"file": e.name, "sha256": e.sha256, "bytes": e.file_bytes, "workspace": e.workspace,
                "n_tokens": e.n, "heads": e.heads, "logits": e.logits, "created": e.created, "last_used": e.last_used}

    def _manifest(self) -> dict:
        records = []
        for e in self._entries.values():
            if e.file:
                records.append(self._record(e))
            records += e.retained
        return {"format": FORMAT, "fingerprint": self.model.fingerprint, "entries": records}

    # -- the disk tier -------------------------------------------------------------------

    def _open_disk(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        folder = self.root / self.model.fingerprint[:16]
        folder.mkdir(exist_ok=True, mode=0o700)
        self.folder = folder
        for tmp in folder.glob(".*.tmp"):  # a write or manifest update a crash interrupted
            tmp.unlink(missing_ok=True)
        records = self._read_manifest(folder / MANIFEST)
        listed = set()
        fingerprint = self.model.fingerprint
        for record in records:
            name = record.get("file") if isinstance(record, dict) else None
            if not isinstance(name, str) or not name.endswith(SUFFIX) or "/" in name or name.startswith("."):
                self._manifest_dirty = True
                continue
            listed.add(name)
            path = folder / name
            try:
                metadata, tokens, size = read_index(path, fingerprint)
                if size != record.get("bytes") or metadata["workspace"] != record.get("workspace") \
                        or not isinstance(record.get("sha256"), str):
                    raise BadFile("does not match its manifest record")
            except FileNotFoundError:
                self._manifest_dirty = True
                continue
            except (BadFile, OSError, ValueError, KeyError) as e:
                log.warning("session file %s set aside: %s", name, e)
                self._bad += 1
                self._set_aside(path)
                self._manifest_dirty = True
                continue
            self._index_file(name, record["sha256"], size, metadata, tokens, record.get("last_used"))
        for path in folder.glob(f"*{SUFFIX}"):  # complete files a crash kept out of the manifest
            if path.name in listed:
                continue
            try:
                metadata, tokens, size = read_index(path, fingerprint)
                sha = file_sha256(path)
                read_snapshot(path, None, fingerprint, self.model.layout)  # verifies the data checksum
            except (BadFile, OSError, ValueError, KeyError) as e:
                log.warning("session file %s set aside: %s", path.name, e)
                self._bad += 1
                self._set_aside(path)
                continue
            self._index_file(path.name, sha, size, metadata, tokens, None)
            self._manifest_dirty = True
        bad = sorted(folder.glob("*.bad"), key=lambda p: p.stat().st_mtime)
        for path in bad[:-KEEP_BAD]:
            path.unlink(missing_ok=True)
        self._prune_other_models()
        with self._cond:
            self._evict_disk()
            self._link_all()
        if self._manifest_dirty:
            self._write_manifest()
        log.info("session bank: %d entries on disk in %s", sum(e.file for e in self._entries.values()), folder)

    def _read_manifest(self, path: Path) -> list:
        if not path.exists():
            return []
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), list):
                raise ValueError("not a session manifest")
            if data.get("fingerprint") != self.model.fingerprint:
                raise ValueError("manifest of another model")
            return data["entries"]
        except (OSError, ValueError, UnicodeDecodeError) as e:
            log.warning("session manifest set aside: %s", e)
            self._set_aside(path)
            return []

    def _index_file(self, name: str, sha: str, size: int, metadata: dict, tokens: np.ndarray,
                    last_used: object) -> None:
        ws = metadata["workspace"]
        created = float(metadata.get("created", 0) or 0)
        used = float(last_used) if isinstance(last_used, (int, float)) else created
        heads = int(metadata["heads"])
        entry = _Entry(
            id=next(self._ids), workspace=ws, tokens=tokens, hashes=_block_hashes(self._seed(ws), tokens),
            heads=heads, logits=metadata.get("logits") == "1", created=created, last_used=used, name=name,
            file=True, sha256=sha, file_bytes=size,
        )
        with self._cond:
            self._insert(entry)

    def _link_all(self) -> None:
        """Parent/child links between entries loaded from disk (leaves-first eviction)."""
        if self.trimmable:
            return
        for ids in self._by_ws.values():
            entries = sorted((self._entries[i] for i in ids), key=lambda e: e.n)
            for a_index, a in enumerate(entries):
                for b in entries[a_index + 1 :]:
                    if b.n > a.n and np.array_equal(b.tokens[: a.n], a.tokens):
                        a.children.add(b.id)
                        b.parents.add(a.id)

    def _prune_other_models(self) -> None:
        """Folders of other model fingerprints share the disk budget; the oldest go first."""
        others = [p for p in self.root.iterdir() if p.is_dir() and p != self.folder]
        if not others:
            return
        sizes = {p: sum(f.stat().st_size for f in p.glob("*") if f.is_file()) for p in others}
        total = sum(sizes.values()) + sum(f.stat().st_size for f in self.folder.glob("*") if f.is_file())
        for p in sorted(others, key=lambda p: p.stat().st_mtime):
            if total <= self.disk_budget:
                break
            shutil.rmtree(p, ignore_errors=True)
            total -= sizes[p]

    def _set_aside(self, path: Path) -> None:
        try:
            os.replace(path, path.with_name(path.name + ".bad"))
        except OSError:
            pass

    def _write_manifest(self) -> None:
        with self._cond:
            manifest = self._manifest()
            doomed, self._doomed = self._doomed, []
            self._manifest_dirty = self._touched = False
        try:
            write_json_atomic(self.folder / MANIFEST, manifest)
        except OSError as e:
            log.warning("session manifest not written: %s", e)
            with self._cond:
                self._manifest_dirty = True
                self._doomed = doomed + self._doomed
            return
        for name in doomed:  # only now that no manifest lists them
            (self.folder / name).unlink(missing_ok=True)

    # -- the writer thread -----------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                entry = None
                while True:
                    if self.folder is not None:
                        entry = self._next_write()
                    if entry is not None or self._manifest_dirty or self._doomed or (
                        self._touched and self._flushing
                    ):
                        break
                    if self._closing:
                        return
                    self._cond.wait(self._next_due_in())
                if entry is not None:
                    entry.writing = True
                    snapshot = entry.snapshot
            if entry is not None:
                self._write_entry(entry, snapshot)
            if self.folder is not None and (self._manifest_dirty or self._doomed or self._touched):
                self._write_manifest()
            elif self.folder is None:
                with self._cond:
                    self._manifest_dirty, self._touched, self._doomed = False, False, []
            with self._cond:
                self._cond.notify_all()

    def _next_write(self) -> _Entry | None:
        if self._closing and not self._flushing:
            return None
        now = self._clock()
        due = [e for e in self._entries.values()
               if e.write_due is not None and not e.no_disk and not e.writing and e.snapshot is not None
               and (self._flushing or e.write_due <= now)]
        return min(due, key=lambda e: e.write_due) if due else None

    def _next_due_in(self) -> float | None:
        dues = [e.write_due for e in self._entries.values() if e.write_due is not None and not e.no_disk]
        if not dues:
            return None if not self._closing else 0.1
        return max(0.0, min(dues) - self._clock()) + 0.001

    def _write_entry(self, entry: _Entry, snapshot: Snapshot) -> None:
        metadata = snapshot_metadata(snapshot, self.model.fingerprint, entry.workspace)
        try:
            sha, size = write_snapshot(self.folder, entry.name, snapshot, metadata, self.write_bps,
                                       abort=lambda: entry.dropped or (self._closing and not self._flushing))
        except Aborted:
            with self._cond:
                entry.writing = False
                if not entry.dropped:
                    entry.write_due = None
                    entry.no_disk = True
            return
        except OSError as e:
            log.warning("session file %s not written: %s", entry.name, e)
            with self._cond:
                entry.writing, entry.write_due, entry.no_disk = False, None, True
                if not entry.in_ram:
                    self._drop(entry)
            return
        with self._cond:
            entry.writing = False
            entry.write_due = None
            if entry.dropped:
                self._doomed.append(entry.name)  # never listed: safe to delete at once
                return
            self._writes += 1
            entry.file, entry.sha256, entry.file_bytes = True, sha, size
            if not entry.in_ram:
                entry.snapshot = None
            if entry.retained:
                self._doomed += [r["file"] for r in entry.retained]
                entry.retained = []
            self._manifest_dirty = True
            self._evict_disk(keep=entry)
