"""The session bank: cache snapshots keyed by token prefix, per workspace, in RAM and on disk.

Keys. Every entry belongs to one workspace (an absolute folder; "" is the default
namespace) and holds the tokens its snapshot was fed; engine/sessions/index.py
finds the longest stored prefix of a prompt by chained block hashes, and one
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
prefix outlives its branches. Disk: one file per entry and a manifest
(engine/sessions/folder.py, engine/sessions/files.py), written by a background
thread and bounded in bytes the same way (engine/sessions/disk_tier.py). A disk
hit is read, verified (checksum, fingerprint, shapes, offsets) and promoted to
RAM; a bad file is renamed `*.bad`, counted, and the lookup goes on as if it were
not there.

Thread model: `lookup`/`add` run on the engine worker thread, listings and
`clear` on the event loop, file writes on the bank's own thread. One lock guards
the index; no file is read or written while holding it. This module never
imports MLX.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from engine.sessions.disk_tier import DiskTier
from engine.sessions.folder import MANIFEST, SUFFIX, manifest_record
from engine.sessions.index import BLOCK, Entry, PrefixIndex
from engine.sessions.room import DiskRoom
from engine.sessions.state import ModelKey, Restore, Snapshot
from engine.sessions.stats import BankStats, Counters, WorkspaceStats, total, workspace_stats

__all__ = ["BLOCK", "MANIFEST", "SUFFIX", "BankStats", "SessionBank", "WorkspaceStats"]

log = logging.getLogger("mtplxd.sessions")


class SessionBank(DiskTier):
    def __init__(
        self,
        folder: Path | None,
        ram_bytes: int,
        disk_bytes: int = 0,
        write_delay_s: float = 2.0,
        write_bps: int = 0,
        clock: Callable[[], float] = time.monotonic,
        room: DiskRoom = DiskRoom(),
    ):
        """`folder`: the disk tier's root (None: RAM only); budgets in bytes (0 disables
        a tier; a bank without RAM is off). `write_delay_s`: how long a new entry waits
        before its background write; `write_bps`: a cap on write speed (0: none); `room`:
        how much of the disk's free space it may take (engine/sessions/room.py)."""
        self.root = Path(folder) if folder is not None else None
        self.ram_budget = max(0, int(ram_bytes))
        self.disk_budget = max(0, int(disk_bytes)) if folder is not None else 0
        self.write_delay_s = write_delay_s
        self.write_bps = write_bps
        self.room = room
        self._clock = clock
        self._cond = threading.Condition(threading.RLock())
        self.model: ModelKey | None = None
        self.folder: Path | None = None
        self._index = PrefixIndex()
        self._entries = self._index.entries  # the same dict, read by every tier
        self._counters: dict[str, Counters] = {}
        self._ram_bytes = 0
        self._evictions_ram = self._evictions_disk = self._bad = self._writes = 0
        self._manifest_dirty = False
        self._manifest_retry_at = float("-inf")  # after a failed manifest write: not before then
        self._touched = False
        self._doomed: list[str] = []  # files to delete once the manifest no longer lists them
        self._flushing = False
        self._closing = False
        self._short_of_space = False
        self._space_check_at = float("-inf")
        self._writer: threading.Thread | None = None
        # One line for /health while the disk tier is off or failing (a full disk); None when fine.
        self.disk_warning: str | None = None

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
            self._index.fingerprint = model.fingerprint
        if self.ram_budget <= 0:
            return
        if self.root is not None and self.disk_budget > 0:
            try:
                self._open_disk()
            except OSError as e:
                self.disk_warning = f"session bank in RAM only: its disk folder is unavailable ({e.strerror or e})"
                log.warning("session bank: disk tier unavailable (%s); RAM only", e)
                self.folder, self.disk_budget = None, 0
        self._writer = threading.Thread(target=self._write_loop, name="mtplxd-session-writer", daemon=True)
        self._writer.start()

    def close(self, timeout: float = 30.0) -> bool:
        """Write every pending entry (within `timeout`), then stop the writer.
        True when nothing was left unwritten but entries waiting for room on a full disk
        (their warning has said so; they are lost, as a cache may be)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._drain(deadline)
            done = not self._pending_writes()
            if waiting := self._waiting_writes():
                log.info("session bank: %d entries waiting for room on the disk not written", waiting)
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
            self._drain(deadline)
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
                found = self._index.best(ws, tokens, tried, self.trimmable)
                counters = self._counters.setdefault(ws, Counters())
                if found is None:
                    counters.misses += 1
                    return None
                entry, length = found
                if entry.snapshot is not None:
                    self._touch(entry)
                    counters.hit("ram", length)
                    return Restore(entry.snapshot, length, "ram")
                name, sha = entry.name, entry.sha256
            tried.add(entry.id)
            snapshot = self._load(entry, name, sha)
            if snapshot is None:
                continue  # the file was bad or gone: try the next best entry
            with self._cond:
                if not entry.dropped:
                    self._promote(entry, snapshot)
                self._counters.setdefault(ws, Counters()).hit("disk", length)
            return Restore(snapshot, length, "disk")

    # -- storing (engine worker thread) ---------------------------------------------------

    def wants(self, workspace: str | None, tokens: Iterable[int], logits: bool = True) -> bool:
        """Whether a snapshot of `tokens` would add anything (checked before copying one)."""
        if not self.enabled:
            return False
        tokens = np.asarray(list(tokens), dtype=np.int32)
        if len(tokens) == 0:
            return False
        with self._cond:
            return self._index.covering(workspace or "", tokens, logits, self.trimmable) is None

    def add(self, workspace: str | None, snapshot: Snapshot | None) -> bool:
        """Keep `snapshot` for `workspace`. False when it added nothing."""
        if snapshot is None or not self.enabled:
            return False
        ws = workspace or ""
        tokens = snapshot.tokens
        with self._cond:
            if self._index.covering(ws, tokens, snapshot.logits is not None, self.trimmable) is not None:
                return False
            now = time.time()
            entry = self._index.new_entry(
                ws, tokens, heads=len(snapshot.heads), logits=snapshot.logits is not None, created=now,
                last_used=now, snapshot=snapshot, nbytes=snapshot.nbytes, name=f"{uuid.uuid4().hex}{SUFFIX}",
            )
            if self.folder is None or entry.nbytes > self.disk_budget:
                entry.no_disk = True
            self._supersede_or_link(entry)
            self._index.insert(entry)
            if entry.no_disk:
                self._doom(entry)
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

    def _supersede_or_link(self, entry: Entry) -> None:
        """Drop the entries the new one serves in their place; link it to the others it extends or prefixes."""
        for other in self._index.related(entry.workspace, entry.tokens):
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

    # -- administration (any thread) ------------------------------------------------------

    def clear(self, workspace: str | None) -> int:
        """Drop every entry of `workspace`, in RAM and on disk. Returns how many."""
        ws = workspace or ""
        with self._cond:
            entries = self._index.of(ws)
            for entry in entries:
                self._drop(entry)
            self._counters.pop(ws, None)
            self._cond.notify_all()
            return len(entries)

    def workspaces(self) -> list[WorkspaceStats]:
        with self._cond:
            return workspace_stats(self._index, self._counters)

    def stats(self) -> BankStats:
        with self._cond:
            totals = total(self._counters.values())
            files = [e for e in self._entries.values() if e.file]
            return BankStats(
                enabled=self.enabled, ram_bytes=self._ram_bytes, ram_budget=self.ram_budget,
                disk_bytes=self._disk_bytes(), disk_budget=self.disk_budget,
                ram_entries=sum(e.in_ram for e in self._entries.values()), disk_entries=len(files),
                pending_writes=self._pending_writes(), waiting_writes=self._waiting_writes(), hits_ram=totals.hits_ram, hits_disk=totals.hits_disk,
                misses=totals.misses, cached_tokens=totals.cached_tokens, evictions_ram=self._evictions_ram,
                evictions_disk=self._evictions_disk, bad_files=self._bad, writes=self._writes,
            )

    # -- the tiers (hold the lock) -----------------------------------------------------------

    def _touch(self, entry: Entry) -> None:
        entry.last_used = time.time()
        entry.hits += 1
        if entry.file:
            self._touched = True  # LRU order survives a restart: written with the next change or flush

    def _drop(self, entry: Entry, superseded_by: Entry | None = None, keep_file: bool = False) -> None:
        if entry.dropped:
            return
        entry.dropped = True
        self._index.remove(entry)
        if entry.in_ram:
            self._ram_bytes -= entry.nbytes
            entry.in_ram = False
        entry.snapshot = None
        doomed = list(entry.retained)
        entry.retained = []
        if entry.file and not keep_file:
            doomed.append(manifest_record(entry))
        if entry.file:
            self._manifest_dirty = True
        if superseded_by is not None and not superseded_by.file:
            superseded_by.retained += doomed  # deleted once the new entry is on disk
        else:
            self._doomed += [r["file"] for r in doomed]
        self._cond.notify_all()

    def _promote(self, entry: Entry, snapshot: Snapshot) -> None:
        self._touch(entry)
        entry.snapshot = snapshot
        if not entry.in_ram and snapshot.nbytes <= self.ram_budget:
            entry.in_ram, entry.nbytes = True, snapshot.nbytes
            self._ram_bytes += entry.nbytes
            self._evict_ram(keep=entry)
        elif not entry.in_ram:
            entry.snapshot = None

    @staticmethod
    def _victim(entries: Iterable[Entry], keep: Entry | None) -> Entry | None:
        """Least recently used, leaves (entries nothing extends) first."""
        candidates = [e for e in entries if e is not keep]
        if not candidates:
            return None
        return min(candidates, key=lambda e: (bool(e.children), e.last_used))

    def _evict_ram(self, keep: Entry | None = None) -> None:
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
