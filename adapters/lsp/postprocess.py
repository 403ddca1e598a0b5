"""Line mode and post-processing of editor completions: pure functions, no I/O.

A completion is the text the model writes at the cursor. Before the editor
sees it, these rules decide whether to ask at all and cut what came back:

- mid-line (non-space text right of the cursor): complete the current line only;
- more than MAX_RIGHT_CHARS non-space characters right of the cursor: no
  automatic request (an explicit one still goes);
- stop at a blank line, at the start of the suffix (the text right of the
  cursor, where the brackets before it balance), at a line equal to the next
  existing line, and where an indented block's completion falls back to column 0;
- indentation: no indent on top of the one the user already typed beyond what the
  previous line calls for; tabs or spaces as the document uses them;
- drop completions that are empty or only repeat what follows the cursor;
- cut by the token cap: never leave a bracket the completion opened unclosed, nor
  (multi-line) a half line.

`trim` runs on every streamed delta (so generation stops as soon as a rule
fires); `finalize` runs once on the text that will be shown. `TypeAheadCache`
answers a request from the last suggestion when the user typed its start.
`TypingRhythm` learns how long an automatic request waits for the next keystroke.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

MAX_RIGHT_CHARS = 8  # non-space characters right of the cursor that still allow an automatic request
OPENERS, CLOSERS = "([{", ")]}"
BLOCK_OPENERS = (":", "{", "(", "[", "=>", "->", " do", " then")


@dataclass(frozen=True)
class Cursor:
    """Where a completion goes: the cursor's line split at the cursor, and its neighbours."""

    line_prefix: str  # the cursor's line left of the cursor
    line_suffix: str  # the cursor's line right of the cursor (no line break)
    next_lines: tuple[str, ...] = ()  # the lines below, nearest first, without line breaks
    prev_line: str = ""  # the nearest non-blank line above the cursor's line
    indent_unit: str = "    "  # the document's indentation step: "\t" or some spaces

    @property
    def mid_line(self) -> bool:
        return self.line_suffix.strip() != ""

    @property
    def at_line_start(self) -> bool:
        return self.line_prefix.strip() == ""

    def following_text(self) -> str:
        return "\n".join((self.line_suffix, *self.next_lines))


def automatic_allowed(cursor: Cursor) -> bool:
    """An automatic (typing) request is worth making: at most a few characters right of the cursor."""
    return sum(not c.isspace() for c in cursor.line_suffix) <= MAX_RIGHT_CHARS


def stop_strings(cursor: Cursor) -> tuple[str, ...]:
    """Stops the scheduler can apply itself (the rest is `trim`'s)."""
    return ("\n",) if cursor.mid_line else ("\n\n",)


# -- cutting -------------------------------------------------------------------------


def trim(raw: str, cursor: Cursor, final: bool = False) -> tuple[str, bool]:
    """Apply the stop rules to the text generated so far.

    Returns (the part that survives, whether a rule fired: generation can stop).
    A last line without a line break is only judged as a whole line when `final`.
    """
    if cursor.mid_line:
        return _trim_line(raw, cursor)
    lines = raw.split("\n")
    nexts = [line.strip() for line in cursor.next_lines[:1]]
    nexts += [line.strip() for line in cursor.next_lines if line.strip()][:1]
    nexts = [n for n in nexts if n]
    block_indent = _indent_width(cursor.line_prefix if cursor.at_line_start else _leading(cursor.line_prefix))
    if cursor.at_line_start and lines[0].strip() and lines[0].strip() in nexts and (final or len(lines) > 1):
        return "", True  # the first line is the line that already follows
    for i in range(1, len(lines)):
        line = lines[i]
        complete = final or i < len(lines) - 1
        stripped = line.strip()
        if not stripped and complete:
            return "\n".join(lines[:i]), True  # a blank line
        if stripped and complete and stripped in nexts:
            return "\n".join(lines[:i]), True  # the next existing line (the suffix starts here)
        if block_indent > 0 and stripped and not line[:1].isspace():
            return "\n".join(lines[:i]), True  # left the enclosing block for column 0
    return raw, False


def _trim_line(raw: str, cursor: Cursor) -> tuple[str, bool]:
    text, done = raw, False
    newline = text.find("\n")
    if newline >= 0:
        text, done = text[:newline], True
    cut = suffix_start(text, cursor.line_suffix.strip())
    if cut is not None:
        return text[:cut], True
    return text, done


def suffix_start(text: str, target: str) -> int | None:
    """Where `text` runs into `target` (the text right of the cursor): the first position
    where the brackets opened in `text` are balanced and either `target` starts there or
    a closing bracket there would close one the completion never opened."""
    if not target:
        return None
    depth = 0
    for i, c in enumerate(text):
        if depth == 0 and text.startswith(target, i):
            return i
        if c in OPENERS:
            depth += 1
        elif c in CLOSERS:
            if depth == 0 and target[0] == c:
                return i
            depth = max(0, depth - 1)
    return None


# -- the final shape -------------------------------------------------------------------


def finalize(raw: str, cursor: Cursor, capped: bool = False) -> str:
    """The completion to show: cut, re-indented, and empty when it adds nothing.
    `capped`: generation ended at the token cap, in the middle of whatever it wrote."""
    text, stopped = trim(raw, cursor, final=True)
    if capped and not stopped:
        text = balanced(text, cursor.mid_line)
    text = fix_indentation(text, cursor)
    text = _rstrip_lines(text)
    if not text.strip() or repeats_following(text, cursor):
        return ""
    return text


def balanced(text: str, mid_line: bool) -> str:
    """What a completion cut by the token cap keeps: up to the last point where every
    bracket it opened is closed; in a multi-line completion, whole lines only (the
    last, cut one goes). Closers of brackets opened before the cursor do not count."""
    if not mid_line and "\n" in text:
        text = text[: text.rfind("\n")]
        ends = [i for i, c in enumerate(text) if c == "\n"] + [len(text)]
        whole = [end for end in ends if _depth(text[:end]) == 0]
        return text[: whole[-1]] if whole else ""
    depth, keep = 0, 0
    for i, c in enumerate(text):
        depth = _step(depth, c)
        if depth == 0:
            keep = i + 1
    return text[:keep]


def line_break_at_rest(text: str, start: int) -> int | None:
    """The first line break at or after `start` where every bracket the completion opened
    is closed: where a multi-line completion may end early without leaving one open."""
    cut = text.find("\n", start)
    while cut >= 0 and _depth(text[:cut]) > 0:
        cut = text.find("\n", cut + 1)
    return cut if cut >= 0 else None


def _step(depth: int, c: str) -> int:
    if c in OPENERS:
        return depth + 1
    if c in CLOSERS:
        return max(0, depth - 1)
    return depth


def _depth(text: str) -> int:
    depth = 0
    for c in text:
        depth = _step(depth, c)
    return depth


def fix_indentation(text: str, cursor: Cursor) -> str:
    lines = text.split("\n")
    removed = 0
    if cursor.at_line_start and cursor.line_prefix and lines[0][:1].isspace():
        # The user (or the editor) already indented this line: the model's own indent
        # goes on top of it only as far as the previous line calls for.
        expected = _expected_indent(cursor)
        typed = _indent_width(cursor.line_prefix)
        extra = _indent_width(_leading(lines[0]))
        keep = max(0, min(extra, expected - typed))
        lead = _leading(lines[0])
        removed = extra - keep
        lines[0] = _indent_string(keep, cursor.indent_unit) + lines[0][len(lead):]
    if removed and all(_indent_width(_leading(line)) >= removed for line in lines[1:] if line.strip()):
        lines[1:] = [_shift(line, removed, cursor.indent_unit) if line.strip() else line for line in lines[1:]]
    if cursor.at_line_start and not cursor.line_prefix:
        lines[0] = _restyle(lines[0], cursor.indent_unit)
    lines[1:] = [_restyle(line, cursor.indent_unit) for line in lines[1:]]
    return "\n".join(lines)


def repeats_following(text: str, cursor: Cursor) -> bool:
    """The completion only repeats what already follows the cursor (spacing aside)."""
    said = _squash(text)
    if not said:
        return True
    following = _squash(cursor.line_suffix) if cursor.mid_line else _squash(cursor.following_text())
    return following.startswith(said)


def _expected_indent(cursor: Cursor) -> int:
    prev = cursor.prev_line.rstrip()
    base = _indent_width(_leading(prev))
    step = _indent_width(cursor.indent_unit)
    return base + step if prev.endswith(BLOCK_OPENERS) else base


def _rstrip_lines(text: str) -> str:
    lines = [line.rstrip() for line in text.split("\n")]
    while len(lines) > 1 and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def _squash(text: str) -> str:
    return " ".join(text.split())


def _leading(line: str) -> str:
    return line[: len(line) - len(line.lstrip(" \t"))]


def _indent_width(whitespace: str, tab: int = 4) -> int:
    return sum(tab if c == "\t" else 1 for c in whitespace if c in " \t")


def _indent_string(width: int, unit: str) -> str:
    if unit == "\t":
        return "\t" * (width // 4) + " " * (width % 4)
    return " " * width


def _shift(line: str, width: int, unit: str) -> str:
    lead = _leading(line)
    return _indent_string(_indent_width(lead) - width, unit) + line[len(lead):]


def _restyle(line: str, unit: str) -> str:
    """Leading indentation in the document's style (tabs or spaces)."""
    lead = _leading(line)
    if not lead or (unit == "\t" and " " not in lead) or (unit != "\t" and "\t" not in lead):
        return line
    width = _indent_width(lead, tab=4 if unit == "\t" else len(unit))
    return _indent_string(width, unit) + line[len(lead):]


def detect_indent_unit(lines: list[str] | tuple[str, ...], sample: int = 400) -> str:
    """The document's indentation step: "\\t" when lines mostly start with tabs, else the
    most common positive difference between consecutive indents (default 4 spaces)."""
    tabs = spaces = 0
    steps: dict[int, int] = {}
    previous = 0
    for line in lines[:sample]:
        if not line.strip():
            continue
        lead = _leading(line)
        if lead.startswith("\t"):
            tabs += 1
        elif lead:
            spaces += 1
        width = len(lead.replace("\t", ""))
        if not lead.startswith("\t") and width > previous:
            steps[width - previous] = steps.get(width - previous, 0) + 1
        previous = width
    if tabs > spaces:
        return "\t"
    if not steps:
        return "    "
    step = max(sorted(steps), key=lambda s: steps[s])
    return " " * step if 1 < step <= 8 else "    "


# -- type-ahead ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Suggestion:
    prefix: str  # the document's text before the cursor when it was made
    suffix: str  # ... and after the cursor
    text: str


class TypeAheadCache:
    """The last suggestion per document. A request whose text before the cursor is the
    old one plus the start of the suggestion (and whose text after the cursor did not
    change) is answered with the rest of the suggestion, without the engine."""

    def __init__(self, size: int = 64):
        self.size = size
        self._items: OrderedDict[str, _Suggestion] = OrderedDict()

    def put(self, uri: str, prefix: str, suffix: str, text: str) -> None:
        if not text:
            return
        self._items[uri] = _Suggestion(prefix, suffix, text)
        self._items.move_to_end(uri)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def get(self, uri: str, prefix: str, suffix: str) -> str | None:
        item = self._items.get(uri)
        if item is None or suffix != item.suffix or not prefix.startswith(item.prefix):
            return None
        typed = prefix[len(item.prefix):]
        if len(typed) >= len(item.text) or not item.text.startswith(typed):
            return None
        return item.text[len(typed):]

    def drop(self, uri: str) -> None:
        self._items.pop(uri, None)

    def __len__(self) -> int:
        return len(self._items)


# -- debounce ----------------------------------------------------------------------------

BURST_GAP_S = 1.0  # a longer gap between two edits is a pause, not the typing pace
MIN_GAPS = 8  # gaps seen before the learned wait replaces the setting's
GAP_QUANTILE = 0.75  # wait as long as three keystrokes in four take to follow the last
MIN_WAIT_MS = 20  # edits faster than typing (a paste, key repeat, a script) still wait this long
LINE_END_WINDOW = 16  # line ends remembered: did the user pause after them?
MIN_LINE_ENDS = 4  # line ends seen before they may skip the wait (at least half of them paused)


class TypingRhythm:
    """The user's pace on one connection: the gaps between their edits while typing.

    An automatic request waits for the next keystroke before it asks the engine (a
    keystroke would cancel the work). Waiting the time most of this user's keystrokes
    take to follow the one before serves a fast typist sooner, and never waits longer
    than the `debounceMs` setting. Line ends are learned apart: a user who mostly
    stops after Enter to see what comes (the next edit came more than twice the wait later)
    gets no wait there at all; one who types straight on keeps it."""

    def __init__(self, window: int = 64) -> None:
        self.gaps: deque[float] = deque(maxlen=window)
        self.after_line_end: deque[bool] = deque(maxlen=LINE_END_WINDOW)  # paused after Enter?
        self.last: float | None = None
        self.last_was_line_end = False

    def edit(self, now: float, line_end: bool = False) -> None:
        """An edit at `now`; `line_end`: it began a new line (Enter)."""
        if self.last is not None:
            gap = now - self.last
            if self.last_was_line_end:
                self.after_line_end.append(gap * 1000 > 2 * self._typing_wait_ms())  # clearly a pause
            if gap < BURST_GAP_S:
                self.gaps.append(gap)
        self.last, self.last_was_line_end = now, line_end

    def wait_ms(self, ceiling_ms: int) -> int:
        """How long a request made now waits for the next keystroke."""
        if self.last_was_line_end and self.pauses_at_line_ends():
            return 0
        return min(ceiling_ms, self._typing_wait_ms(ceiling_ms))

    def pauses_at_line_ends(self) -> bool:
        seen = self.after_line_end
        return len(seen) >= MIN_LINE_ENDS and 2 * sum(seen) >= len(seen)

    def _typing_wait_ms(self, unknown_ms: int = round(BURST_GAP_S * 1000)) -> int:
        if len(self.gaps) < MIN_GAPS:
            return unknown_ms
        ordered = sorted(self.gaps)
        quantile = ordered[min(len(ordered) - 1, int(GAP_QUANTILE * len(ordered)))]
        return max(MIN_WAIT_MS, round(quantile * 1000))
