"""Small helpers for splitting streamed model text at markup markers.

Model output arrives in arbitrary pieces (a token can end in the middle of
`<tool_call>`), so every splitter here holds back the end of its buffer while
it could still grow into a marker, and decides only once it cannot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class Text:
    """Answer text (OpenAI `content`, an Anthropic text block)."""

    text: str


@dataclass(frozen=True)
class Reasoning:
    """Text of a <think> block (OpenAI `reasoning_content`, an Anthropic thinking block)."""

    text: str


def partial_marker(text: str, markers: Iterable[str]) -> int:
    """Length of the longest end of `text` that is a proper beginning of a marker:
    the part to hold back because the next piece may complete the marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(text), len(marker) - 1), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


def find_first(text: str, markers: Iterable[str]) -> tuple[int, str] | None:
    """The earliest marker in `text` as (position, marker); the longer marker wins a tie."""
    hits = [(i, -len(m), m) for m in markers if (i := text.find(m)) >= 0]
    if not hits:
        return None
    i, _, marker = min(hits)
    return i, marker


class TrimmedText:
    """Text whose whitespace next to a swallowed marker disappears.

    The whitespace a template puts around markup ("...\\n\\n<tool_call>\\n",
    "</think>\\n\\n") is layout, not answer: trailing whitespace is held until
    more text follows (then it is emitted) or a marker swallows it. Leading
    whitespace is dropped until the first text goes out (at the start, when asked,
    and after a marker); text that resumes after a marker keeps the whitespace
    that separates it from what went out before; whitespace after the last
    marker is dropped.
    """

    def __init__(self, strip_lead: bool = False):
        self.held = ""
        self.strip_lead = strip_lead
        self.emitted = False
        self.after_marker = False  # no text since the last marker

    def text(self, piece: str) -> str:
        if self.strip_lead and not self.emitted:
            piece = piece.lstrip()
            if not piece:
                return ""
        body = piece.rstrip()
        if not body:
            self.held += piece
            return ""
        out = self.held + body
        self.held = piece[len(body):]
        self.emitted = True
        self.after_marker = False
        return out

    def boundary(self) -> None:
        """A marker swallowed the held whitespace."""
        self.held = ""
        self.strip_lead = True
        self.after_marker = True

    def flush(self) -> str:
        """What is held at the end of the text (nothing if a marker came last)."""
        out, self.held = self.held, ""
        return "" if self.after_marker else out
