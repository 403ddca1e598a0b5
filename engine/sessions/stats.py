"""The session bank's figures: hit/miss counters per workspace and the listings built from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from engine.sessions.index import PrefixIndex


@dataclass
class WorkspaceStats:
    workspace: str | None  # None: the default workspace (the bank keys it "")
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
    waiting_writes: int  # entries in RAM waiting for room on the disk (engine/sessions/room.py)
    hits_ram: int
    hits_disk: int
    misses: int
    cached_tokens: int
    evictions_ram: int
    evictions_disk: int
    bad_files: int
    writes: int


@dataclass
class Counters:
    hits_ram: int = 0
    hits_disk: int = 0
    misses: int = 0
    cached_tokens: int = 0

    def hit(self, tier: str, length: int) -> None:
        if tier == "ram":
            self.hits_ram += 1
        else:
            self.hits_disk += 1
        self.cached_tokens += length


def total(counters: Iterable[Counters]) -> Counters:
    out = Counters()
    for c in counters:
        out.hits_ram += c.hits_ram
        out.hits_disk += c.hits_disk
        out.misses += c.misses
        out.cached_tokens += c.cached_tokens
    return out


def workspace_stats(index: PrefixIndex, counters: dict[str, Counters]) -> list[WorkspaceStats]:
    """One row per workspace with entries or traffic, sorted by name."""
    out = []
    for ws in sorted(set(index.by_ws) | set(counters)):
        s = WorkspaceStats(ws)
        for e in index.of(ws):
            s.entries += 1
            if e.in_ram:
                s.ram_entries += 1
                s.ram_bytes += e.nbytes
            if e.file:
                s.disk_entries += 1
                s.disk_bytes += e.file_bytes
        c = counters.get(ws, Counters())
        s.hits_ram, s.hits_disk, s.misses, s.cached_tokens = c.hits_ram, c.hits_disk, c.misses, c.cached_tokens
        if s.entries or s.hits or s.misses:
            out.append(s)
    return out
