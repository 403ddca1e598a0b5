"""Cross-file context for editor completions: a bounded ring of recently touched chunks.

A chunk is a window of CHUNK_LINES lines of an open document, aligned to a multiple
of CHUNK_LINES so that its identity survives edits around it. Opening a document
touches its first chunk (what the editor shows first); an edit touches the chunk
it lands in, and so does a completion request at the cursor. The ring keeps the
RING_SIZE most recently touched chunks.

For a request, the chunks of the *other* open documents of the same workspace are
scored by how much their identifiers overlap those around the cursor (Jaccard) plus
a smaller weight for recency, and taken best first while they fit the token budget.
The choice is kept while the cursor stays within KEEP_LINES of where it was made
and no other document changes (or enters or leaves the ring): the prompt starts
with the same context between keystrokes, and for the prefetch after a suggestion,
so the daemon's session bank restores it instead of prefilling it again.

Pure Python, no I/O, no asyncio.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable

from adapters.lsp.documents import ContextDocument, comment_prefix

CHUNK_LINES = 16
RING_SIZE = 32
KEEP_LINES = 2 * CHUNK_LINES  # a choice holds while the cursor stays this close to where it was made
NEIGHBOURHOOD_ABOVE, NEIGHBOURHOOD_BELOW = 24, 8  # lines around the cursor that name what it is about
RECENCY_WEIGHT = 0.25  # a chunk just touched scores this much on top of its similarity
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{2,}")
# Words every file of a language uses: they say nothing about which chunk is related.
_COMMON = frozenset("""self cls def return class import from None True False and not for while with elif else
    pass break continue lambda yield async await try except finally raise assert global print len range
    const let var function this new null undefined true false int char void static public private struct
    """.split())


@dataclass(frozen=True)
class OpenDocument:
    """What the ring reads of an open document (pygls' TextDocument, reduced)."""

    uri: str
    version: int | None
    path: str  # as shown to the model: relative to the workspace
    language_id: str | None
    lines: tuple[str, ...]  # line breaks kept


@dataclass(frozen=True)
class Chunk:
    uri: str
    path: str
    language_id: str | None
    start: int  # first line (0-based)
    text: str
    score: float

    @property
    def end(self) -> int:
        """One past the last line."""
        return self.start + self.text.count("\n") + (0 if self.text.endswith("\n") else 1)


def identifiers(text: str) -> frozenset[str]:
    return frozenset(word for word in _IDENTIFIER.findall(text) if word not in _COMMON)


def jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    return len(a & b) / len(a | b) if a and b else 0.0


class ChunkRing:
    def __init__(self, size: int = RING_SIZE):
        self.size = size
        self._ticks: OrderedDict[tuple[str, int], None] = OrderedDict()  # oldest first
        # per document: the other chunks the last choice was made from, the line it was made
        # for, and the choice
        self._chosen: dict[str, tuple[tuple, int, list[Chunk]]] = {}
        self._words: dict[tuple[str, int, int | None], frozenset[str]] = {}

    def touch(self, uri: str, line: int) -> None:
        key = (uri, max(0, line) // CHUNK_LINES)
        self._ticks[key] = None
        self._ticks.move_to_end(key)
        while len(self._ticks) > self.size:
            self._ticks.popitem(last=False)

    def forget(self, uri: str) -> None:
        for key in [k for k in self._ticks if k[0] == uri]:
            del self._ticks[key]
        self._chosen.pop(uri, None)
        self._words = {k: v for k, v in self._words.items() if k[0] != uri}

    def __len__(self) -> int:
        return len(self._ticks)

    def select(self, current: OpenDocument, line: int, others: Iterable[OpenDocument], budget: int,
               count: Callable[[str], int]) -> list[Chunk]:
        """The chunks of `others` for a request at `line` of `current`, within `budget`
        tokens (`count`: tokens of one line), in prompt order: files whose best chunk scores
        lower first, so the most related text sits nearest the cursor."""
        documents = {d.uri: d for d in others if d.uri != current.uri}
        candidates = [(uri, index) for uri, index in self._ticks if uri in documents]
        signature = (budget, tuple(sorted((uri, index, documents[uri].version) for uri, index in candidates)))
        kept = self._chosen.get(current.uri)
        if kept is not None and kept[0] == signature and abs(line - kept[1]) <= KEEP_LINES:
            return kept[2]  # the same context as the last keystroke: its cached prefix stays valid
        chunks = self._choose(current, line, documents, candidates, budget, count)
        self._chosen[current.uri] = (signature, line, chunks)
        return chunks

    def _choose(self, current: OpenDocument, line: int, documents: dict[str, OpenDocument],
                candidates: list[tuple[str, int]], budget: int, count: Callable[[str], int]) -> list[Chunk]:
        around = identifiers("".join(current.lines[max(0, line - NEIGHBOURHOOD_ABOVE):line + NEIGHBOURHOOD_BELOW]))
        scored = []
        for age, (uri, index) in enumerate(reversed(candidates)):  # age 0: the most recent
            document = documents[uri]
            lines = document.lines[index * CHUNK_LINES:(index + 1) * CHUNK_LINES]
            if not any(s.strip() for s in lines):
                continue
            similarity = jaccard(around, self._identifiers(document, index, lines))
            scored.append(Chunk(uri, document.path, document.language_id, index * CHUNK_LINES, "".join(lines),
                                similarity + RECENCY_WEIGHT / (1 + age)))
        chosen, left = [], budget
        for chunk in sorted(scored, key=lambda c: (-c.score, c.uri, c.start)):
            cost = count(f"{chunk.path}\n") + sum(count(s) for s in chunk.text.splitlines(True)) + 2
            if cost <= left:
                chosen.append(chunk)
                left -= cost
        best = {uri: max(c.score for c in chosen if c.uri == uri) for uri in {c.uri for c in chosen}}
        return sorted(chosen, key=lambda c: (best[c.uri], c.uri, c.start))

    def _identifiers(self, document: OpenDocument, index: int, lines: tuple[str, ...]) -> frozenset[str]:
        key = (document.uri, index, document.version)
        words = self._words.get(key)
        if words is None:
            if len(self._words) > 4 * self.size:
                self._words.clear()
            words = self._words[key] = identifiers("".join(lines))
        return words


def as_documents(chunks: list[Chunk]) -> list[ContextDocument]:
    """One context document per file, in the chunks' order: its chunks in line order, with
    a comment line `...` where lines between them (or before the first) are left out."""
    out: dict[str, ContextDocument] = {}
    ends: dict[str, int] = {}
    for chunk in chunks:
        text = chunk.text if chunk.text.endswith("\n") else chunk.text + "\n"
        gap = chunk.start > ends.get(chunk.uri, 0)
        if gap:
            text = f"{comment_prefix(chunk.language_id, chunk.path)} ...\n" + text
        ends[chunk.uri] = chunk.end
        before = out.get(chunk.uri)
        out[chunk.uri] = ContextDocument(chunk.uri, None, chunk.path, chunk.language_id,
                                         (before.text if before else "") + text)
    return list(out.values())
