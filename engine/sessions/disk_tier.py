"""The session bank's disk tier: loading, the byte budget, the writer thread, the manifest.

An entry is written some seconds after it appears (a burst of requests supersedes
most entries before they are written), at once when it leaves RAM, and all at
once on flush or close. The manifest is rewritten after each file is in place;
files it no longer lists are deleted only after that. Over budget, superseded
files go first, then least recently used leaves. Before each write the disk is asked
for its free space (engine/sessions/room.py): an entry that does not fit waits in RAM
and is tried again, so a disk that fills up and empties again costs writes, never the
disk tier. A disk hit is read and verified
against the index; a bad file is set aside and counted. No file is touched while
holding the bank's lock. What is on disk at start: engine/sessions/folder.py.

A mixin of `SessionBank` (engine/sessions/bank.py), whose state it shares: the lock
`_cond`, `_index`/`_entries`, `folder`, `model`, budgets and counters, the flags
`_flushing`, `_closing`, `_manifest_dirty`, `_touched`, and the `_doomed` file list;
it calls back the bank's `_drop` and `_victim`.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, cast

import numpy as np

from engine.sessions.files import Aborted, BadFile, read_snapshot, snapshot_metadata, write_json_atomic, write_snapshot
from engine.sessions.folder import MANIFEST, manifest_record, prune_other_models, scan_folder, set_aside
from engine.sessions.index import Entry, PrefixIndex
from engine.sessions.room import DiskRoom, file_bytes
from engine.sessions.state import FORMAT, ModelKey, Snapshot

log = logging.getLogger("mtplxd.sessions")

MANIFEST_RETRY_S = 5.0  # after a failed manifest write (a full disk) the next try waits this long


def _write_warning(folder: Path, error: OSError) -> str:
    return (f"session bank: cannot write to {folder} ({error.strerror or error}); "
            f"new sessions stay in RAM only until a write succeeds")


class DiskTier:
    # The bank's state this mixin shares: set by SessionBank.__init__ and attach.
    root: Path | None
    folder: Path | None  # the open disk tier's folder; None: RAM only
    model: ModelKey | None
    disk_budget: int
    room: DiskRoom
    write_bps: int
    disk_warning: str | None
    _cond: threading.Condition
    _clock: Callable[[], float]
    _index: PrefixIndex
    _entries: dict[int, Entry]
    _writer: threading.Thread | None
    _flushing: bool
    _closing: bool
    _manifest_dirty: bool
    _manifest_retry_at: float
    _touched: bool
    _doomed: list[str]
    _short_of_space: bool  # entries wait for room: logged once, warned until written
    _space_check_at: float  # short of space: when the writer asks the disk again
    _writes: int
    _bad: int
    _evictions_disk: int

    if TYPE_CHECKING:  # the bank's own, called back
        @property
        def trimmable(self) -> bool: ...

        def _drop(self, entry: Entry, superseded_by: Entry | None = None, keep_file: bool = False) -> None: ...

        @staticmethod
        def _victim(entries: Iterable[Entry], keep: Entry | None) -> Entry | None: ...

    def _opened(self) -> tuple[Path, ModelKey]:
        """The disk tier's folder and the model it belongs to, once open (attach sets both
        before the writer starts; nothing here runs without them)."""
        return cast(Path, self.folder), cast(ModelKey, self.model)

    def _drain(self, deadline: float) -> None:
        """Have the writer write everything now; wait (holding the lock) until it has or `deadline`."""
        self._flushing = True
        self._cond.notify_all()
        while self._writer is not None and self._writer.is_alive() and (
            self._pending_writes() or self._manifest_due(flushing=True)
        ):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._cond.wait(min(left, 0.1))

    def _pending_writes(self) -> int:
        """Entries to write; not those waiting for room (a flush does not wait for them)."""
        return sum(1 for e in self._entries.values()
                   if (e.write_due is not None and not e.no_disk and not e.waiting) or e.writing)

    def _waiting_writes(self) -> int:
        return sum(1 for e in self._entries.values() if e.waiting and not e.writing)

    def _doom(self, entry: Entry) -> None:
        """Delete the superseded files `entry` kept, with the next manifest."""
        self._doomed += [r["file"] for r in entry.retained]
        entry.retained = []

    # -- the writer thread -----------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                entry = None
                while True:
                    recheck = False
                    if self.folder is not None:
                        entry = self._next_write()
                    recheck = self._space_recheck_due()
                    if entry is not None or recheck or self._manifest_due(self._flushing):
                        break
                    if self._closing:
                        return
                    self._cond.wait(self._next_due_in())
                if entry is not None:
                    entry.writing = True
                    snapshot = cast(Snapshot, entry.snapshot)  # _next_write picks entries that hold one
            if recheck:
                self._recheck_space()
            if entry is not None:
                self._write_entry(entry, snapshot)
            if self.folder is not None and (self._manifest_dirty or self._doomed or self._touched):
                self._write_manifest()
            elif self.folder is None:
                with self._cond:
                    self._manifest_dirty, self._touched, self._doomed = False, False, []
            with self._cond:
                self._cond.notify_all()

    def _manifest_due(self, flushing: bool) -> bool:
        """A manifest to write now; not while a failed write waits out MANIFEST_RETRY_S
        (on a full disk it would fail again at once, in a loop)."""
        wanted = self._manifest_dirty or bool(self._doomed) or (self._touched and flushing)
        return wanted and self._clock() >= self._manifest_retry_at

    def _next_write(self) -> Entry | None:
        if self._closing and not self._flushing:
            return None
        now = self._clock()
        due = [e for e in self._entries.values()
               if e.write_due is not None and not e.no_disk and not e.writing and e.snapshot is not None
               and ((self._flushing and not e.waiting) or e.write_due <= now)]
        return min(due, key=lambda e: cast(float, e.write_due)) if due else None

    def _space_recheck_due(self) -> bool:
        """Short of space with no entry waiting (full at start, say): the warning stays
        until the disk is asked again, every `room.retry_s`."""
        return (self.folder is not None and self._short_of_space and not self._waiting_writes()
                and self._clock() >= self._space_check_at)

    def _recheck_space(self) -> None:
        free = self.room.probe(self._opened()[0])
        with self._cond:
            if self.room.fits(0, free):
                self.disk_warning, self._short_of_space = None, False
            else:
                self._space_check_at = self._clock() + self.room.retry_s

    def _next_due_in(self) -> float | None:
        dues = [e.write_due for e in self._entries.values() if e.write_due is not None and not e.no_disk]
        if self._short_of_space and not self._waiting_writes():  # else the waiting entries' own retries ask
            dues.append(self._space_check_at)
        if self._manifest_dirty or self._doomed:  # a manifest waiting out its retry delay
            dues.append(self._manifest_retry_at)
        if not dues:
            return None if not self._closing else 0.1
        return max(0.0, min(dues) - self._clock()) + 0.001

    def _write_entry(self, entry: Entry, snapshot: Snapshot) -> None:
        folder, model = self._opened()
        free = self.room.probe(folder)  # outside the lock: a syscall on the disk
        with self._cond:
            if not self._make_room(entry, free):
                self._wait_for_room(entry, folder, free)
                return
        metadata = snapshot_metadata(snapshot, model.fingerprint, entry.workspace)
        try:
            sha, size = write_snapshot(folder, entry.name, snapshot, metadata, self.write_bps,
                                       abort=lambda: entry.dropped or (self._closing and not self._flushing))
        except Aborted:
            with self._cond:
                entry.writing = False
                if not entry.dropped:
                    entry.write_due = None
                    entry.no_disk = True
            return
        except OSError as e:  # a full disk: the entry stays in RAM (if it still fits), the daemon goes on
            if e.errno in (errno.ENOSPC, errno.EDQUOT):  # filled up since the probe: tried again later
                free = self.room.probe(folder)
                with self._cond:
                    self._wait_for_room(entry, folder, free)
                return
            log.warning("session file %s not written: %s", entry.name, e)
            with self._cond:
                self.disk_warning = _write_warning(folder, e)
                entry.writing, entry.write_due, entry.no_disk = False, None, True
                if not entry.in_ram:
                    self._drop(entry)
            return
        with self._cond:
            entry.writing = entry.waiting = False
            entry.write_due = None
            if entry.dropped:
                self._doomed.append(entry.name)  # never listed: safe to delete at once
                return
            self._writes += 1
            if not self._waiting_writes():  # writes work (again) and none waits for room
                self.disk_warning, self._short_of_space = None, False
            entry.file, entry.sha256, entry.file_bytes = True, sha, size
            if not entry.in_ram:
                entry.snapshot = None
            if entry.retained:
                self._doom(entry)
            self._manifest_dirty = True
            self._evict_disk(keep=entry)

    def _make_room(self, entry: Entry, free: int | None) -> bool:
        """Whether `entry` may be written now, `free` bytes being free: within the cap (the
        bank's own least recently used files make way) and leaving the margin free (the
        user's files never make way: the entry waits)."""
        size = file_bytes(entry.nbytes)
        cap = self.room.cap(self.disk_budget, self._disk_bytes(), free)
        if size > cap or not self.room.fits(size, free):
            return False
        self._evict_disk(keep=entry, cap=cap - size)
        return True

    def _wait_for_room(self, entry: Entry, folder: Path, free: int | None) -> None:
        """No room for `entry` now: it stays in RAM and is tried again in `room.retry_s`;
        one out of RAM already goes (holding it would overrun the RAM budget)."""
        entry.writing = False
        if entry.dropped:
            return
        if not entry.in_ram:
            entry.write_due, entry.no_disk = None, True
            self._drop(entry)
            return
        entry.waiting, entry.write_due = True, self._clock() + self.room.retry_s
        self.disk_warning = self.room.warning(folder, free or 0)
        self._space_check_at = entry.write_due
        if not self._short_of_space:  # once per spell of a full disk, not once per entry
            self._short_of_space = True
            log.warning("%s", self.disk_warning)

    def _write_manifest(self) -> None:
        folder, _ = self._opened()
        with self._cond:
            manifest = self._manifest()
            doomed, self._doomed = self._doomed, []
            self._manifest_dirty = self._touched = False
        try:
            write_json_atomic(folder / MANIFEST, manifest)
        except OSError as e:
            log.warning("session manifest not written: %s", e)
            with self._cond:
                self.disk_warning = _write_warning(folder, e)
                self._manifest_retry_at = self._clock() + MANIFEST_RETRY_S
                self._manifest_dirty = True
                self._doomed = doomed + self._doomed
            return
        self._manifest_retry_at = float("-inf")
        for name in doomed:  # only now that no manifest lists them
            (folder / name).unlink(missing_ok=True)

    def _manifest(self) -> dict:
        records = []
        for e in self._entries.values():
            if e.file:
                records.append(manifest_record(e))
            records += e.retained
        return {"format": FORMAT, "fingerprint": self._opened()[1].fingerprint, "entries": records}

    # -- reading and the budget (the lock held except in _load) ----------------------------

    def _load(self, entry: Entry, name: str, sha: str) -> Snapshot | None:
        folder, model = self._opened()
        path = folder / name
        try:
            snapshot, metadata = read_snapshot(path, sha, model.fingerprint, model.layout)
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
                self._count_bad()
            set_aside(path)
            return None

    def _disk_bytes(self) -> int:
        files = sum(e.file_bytes for e in self._entries.values() if e.file)
        return files + sum(r["bytes"] for e in self._entries.values() for r in e.retained)

    def _evict_disk(self, keep: Entry | None = None, cap: int | None = None) -> None:
        """Delete files (superseded ones, then least recently used) until the bank's take
        `cap` bytes at most (the budget by default)."""
        cap = self.disk_budget if cap is None else cap
        while self._disk_bytes() > cap:
            holder = next((e for e in self._entries.values() if e.retained), None)
            if holder is not None:  # superseded files first
                self._doom(holder)
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

    def _count_bad(self) -> None:
        self._bad += 1

    # -- opening the disk tier -------------------------------------------------------------

    def _open_disk(self) -> None:
        root, model = cast(Path, self.root), cast(ModelKey, self.model)  # a disk tier configured, a model attached
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        folder = root / model.fingerprint[:16]
        folder.mkdir(exist_ok=True, mode=0o700)
        self.folder = folder
        if scan_folder(folder, model, self._index_file, self._count_bad):
            self._manifest_dirty = True
        prune_other_models(root, folder, self.disk_budget)
        with self._cond:
            self._evict_disk()
            if not self.trimmable:  # a trimmable bank supersedes prefixes instead of linking them
                self._index.link_all()
        if self._manifest_dirty:
            self._write_manifest()
        log.info("session bank: %d entries on disk in %s", sum(e.file for e in self._entries.values()), folder)
        free = self.room.probe(folder)
        if not self.room.fits(0, free):  # full at start: said at once, not at the first write
            self._short_of_space, self._space_check_at = True, self._clock() + self.room.retry_s
            self.disk_warning = self.room.warning(folder, free or 0)
            log.warning("%s", self.disk_warning)

    def _index_file(self, name: str, sha: str, size: int, metadata: dict, tokens: np.ndarray,
                    last_used: object) -> None:
        created = float(metadata.get("created", 0) or 0)
        used = float(last_used) if isinstance(last_used, (int, float)) else created
        entry = self._index.new_entry(
            metadata["workspace"], tokens, heads=int(metadata["heads"]), logits=metadata.get("logits") == "1",
            created=created, last_used=used, name=name, file=True, sha256=sha, file_bytes=size,
        )
        with self._cond:
            self._index.insert(entry)
