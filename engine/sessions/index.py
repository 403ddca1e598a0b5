"""The session bank's prefix index: entries by id, by workspace and by chained block hash.

Every entry is indexed under the chained hash of each of its 256-token blocks,
h0 = sha256(model fingerprint, workspace), h_i = sha256(h_{i-1}, tokens of block i),
so a lookup walks the prompt's blocks and only compares token ids with the
entries that share the deepest block; the stored ids are always compared before
an entry is used. The workspace is inside h0: one workspace's entries never
serve another's requests.

Not thread-safe: the bank's lock guards every call. Never imports MLX.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field

import numpy as np

from engine.sessions.state import Snapshot

BLOCK = 256


def block_hashes(seed: bytes, tokens: np.ndarray) -> list[bytes]:
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
class Entry:
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
    waiting: bool = False  # no room on the disk at its last try: tried again later (engine/sessions/room.py)
    no_disk: bool = False  # evicted from disk (or too big): never written again
    dropped: bool = False
    hits: int = 0
    parents: set[int] = field(default_factory=set)
    children: set[int] = field(default_factory=set)
    retained: list[dict] = field(default_factory=list)  # superseded files kept until this one is written

    @property
    def n(self) -> int:
        return int(self.tokens.shape[0])


def usable(entry: Entry, tokens: np.ndarray, trimmable: bool) -> int:
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


class PrefixIndex:
    def __init__(self) -> None:
        self.fingerprint = ""  # the model's, set on attach; part of every seed
        self.entries: dict[int, Entry] = {}
        self.by_hash: dict[bytes, set[int]] = {}
        self.by_ws: dict[str, set[int]] = {}
        self._ids = itertools.count(1)
        self._seeds: dict[str, bytes] = {}

    def new_entry(self, ws: str, tokens: np.ndarray, **fields) -> Entry:
        """A new entry of `ws` (not yet inserted), with its block hashes."""
        return Entry(id=next(self._ids), workspace=ws, tokens=tokens, hashes=self.hashes(ws, tokens), **fields)

    def hashes(self, ws: str, tokens: np.ndarray) -> list[bytes]:
        seed = self._seeds.get(ws)
        if seed is None:
            seed = self._seeds[ws] = hashlib.sha256(f"{self.fingerprint}\0{ws}".encode()).digest()
        return block_hashes(seed, tokens)

    def of(self, ws: str) -> list[Entry]:
        return [self.entries[i] for i in self.by_ws.get(ws, set())]

    def insert(self, entry: Entry) -> None:
        self.entries[entry.id] = entry
        self.by_ws.setdefault(entry.workspace, set()).add(entry.id)
        for h in entry.hashes:
            self.by_hash.setdefault(h, set()).add(entry.id)

    def remove(self, entry: Entry) -> None:
        """Unindex `entry` and unlink it from its parents and children."""
        self.entries.pop(entry.id, None)
        _discard(self.by_ws, entry.workspace, entry.id)
        for h in entry.hashes:
            _discard(self.by_hash, h, entry.id)
        for i in entry.parents:
            if i in self.entries:
                self.entries[i].children.discard(entry.id)
        for i in entry.children:
            if i in self.entries:
                self.entries[i].parents.discard(entry.id)

    def best(self, ws: str, tokens: np.ndarray, tried: set[int], trimmable: bool) -> tuple[Entry, int] | None:
        """The entry restoring the most of `tokens` (RAM, then most recent, breaks ties), and how much."""
        hashes = self.hashes(ws, tokens)
        best: tuple[int, int, float, Entry] | None = None
        seen: set[int] = set()
        level = len(hashes)
        while level >= 0:
            if level == 0:
                ids = self.by_ws.get(ws, set())
            else:
                ids = self.by_hash.get(hashes[level - 1], set())
            for i in ids - seen - tried:
                seen.add(i)
                entry = self.entries[i]
                length = usable(entry, tokens, trimmable)
                if length > 0:
                    key = (length, entry.snapshot is not None, entry.last_used, entry)
                    if best is None or key[:3] > best[:3]:
                        best = key
            if best is not None and (trimmable or best[0] >= BLOCK * level):
                break  # nothing at a shallower level can be longer
            level -= 1
        return None if best is None else (best[3], best[0])

    def covering(self, ws: str, tokens: np.ndarray, logits: bool, trimmable: bool) -> Entry | None:
        """An entry that already serves everything a snapshot of `tokens` would."""
        hashes = self.hashes(ws, tokens)
        ids = self.by_hash.get(hashes[-1], set()) if hashes else self.by_ws.get(ws, set())
        n = len(tokens)
        for i in ids:
            e = self.entries[i]
            if e.n == n and (e.logits or not logits) and np.array_equal(e.tokens, tokens):
                return e
            if trimmable and e.n > n and np.array_equal(e.tokens[:n], tokens):
                return e
        return None

    def related(self, ws: str, tokens: np.ndarray) -> list[Entry]:
        """Entries of `ws` that are a prefix of `tokens` or that `tokens` is a prefix of."""
        out = []
        for e in self.of(ws):
            m = min(e.n, len(tokens))
            if np.array_equal(e.tokens[:m], tokens[:m]):
                out.append(e)
        return out

    def link_all(self) -> None:
        """Parent/child links between entries loaded from disk (leaves-first eviction)."""
        for ws in self.by_ws:
            entries = sorted(self.of(ws), key=lambda e: e.n)
            for a_index, a in enumerate(entries):
                for b in entries[a_index + 1 :]:
                    if b.n > a.n and np.array_equal(b.tokens[: a.n], a.tokens):
                        a.children.add(b.id)
                        b.parents.add(a.id)


def _discard(buckets: dict, key: object, entry_id: int) -> None:
    bucket = buckets.get(key)
    if bucket is not None:
        bucket.discard(entry_id)
        if not bucket:
            del buckets[key]
