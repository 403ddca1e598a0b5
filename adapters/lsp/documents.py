"""Documents, settings and prompts of the LSP adapter. No I/O, no asyncio.

- `Options`: the per-connection settings, from `initializationOptions` and
  `workspace/didChangeConfiguration` (camelCase keys, optionally under "mtplxd").
- `snapshot`: a document's text, version and cursor, taken before any await; a
  position is read in the negotiated encoding (UTF-16 unless the client offered
  another), and one past the document's end is a ValueError.
- `workspace_of`: the workspace folder (an absolute path) a document belongs to,
  the session-bank namespace of its requests.
- `PromptBuilder`: fill-in-the-middle prompt ids with the model's own FIM tokens.
  Prefix and suffix budgets are in tokens (70/30 of `contextTokens`); chunks of
  other open documents of the same workspace (adapters/lsp/context.py chooses
  them) come before the current file, in an order kept between keystrokes, so that
  consecutive keystrokes share a long prompt prefix the session bank can reuse.
  With `<|file_sep|>` in the vocabulary (Qwen coder models), they are laid out in
  its repository format; a suffix-prefix-middle model gets them as the plain
  documents, each ended by end-of-text, it was trained on. A model without FIM
  tokens gets the same prompt without the FIM markers and the suffix: the other
  files, the file's header and the prefix (its whole budget), ending at the cursor
  (engine/prompts.PrefixOnly).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Any, Iterable, NamedTuple

from adapters.lsp.postprocess import Cursor, detect_indent_unit
from engine.prompts import Heal, completion_layout, heal_last_token, leading_special
from mtplxd.requests import file_uri_path

PREFIX_SHARE = 0.7
START_LINE_STEP = 16  # a cut prefix starts on a multiple of up to this many lines (a quarter of what fits)


# -- settings --------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    enable: bool = True
    max_tokens: int = 64  # new tokens per completion at a line's start or after a block opener (multi-line)
    line_max_tokens: int = 32  # ... in the middle of a line (to its end)
    debounce_ms: int = 120  # automatic requests wait at most this long for the next keystroke
    client_debounces: bool = False  # the editor waits for a pause itself: no wait here
    adaptive_debounce: bool = True  # false: always wait `debounce_ms` (the typing pace is not learned)
    prefetch: bool = True  # compute the suggestion after the one shown, for when it is accepted
    context_tokens: int = 1024  # prefix + suffix of the current document
    workspace_context_tokens: int = 512  # chunks of other open documents of the same workspace
    time_budget_ms: int = 70  # once spent, a multi-line completion ends at the next line break (brackets closed)
    temperature: float = 0.0  # 0: greedy (repeatable, which the type-ahead cache likes)
    provider: str = "auto"  # auto | inline | completion | both (read at initialize)

    def merged(self, raw: Any) -> tuple[Options, list[str]]:
        """These options with the recognised keys of `raw` applied; and one warning per bad value."""
        if isinstance(raw, dict) and isinstance(raw.get("mtplxd"), dict):
            raw = raw["mtplxd"]
        if not isinstance(raw, dict):
            return self, ([] if raw is None else [f"settings must be an object, got {type(raw).__name__}"])
        changes: dict[str, Any] = {}
        warnings = []
        for f in fields(self):
            key = _camel(f.name)
            if key not in raw:
                continue
            try:
                changes[f.name] = _check_option(f.name, raw[key])
            except ValueError as e:
                warnings.append(f"mtplxd: ignoring {key}: {e}")
        return replace(self, **changes), warnings

    def as_json(self) -> dict[str, Any]:
        return {_camel(f.name): getattr(self, f.name) for f in fields(self)}


_RANGES = {
    "max_tokens": (1, 2048),
    "line_max_tokens": (1, 2048),
    "debounce_ms": (0, 5000),
    "context_tokens": (16, 32768),
    "workspace_context_tokens": (0, 32768),
    "time_budget_ms": (0, 600000),
}


def _check_option(name: str, value: Any) -> Any:
    if name in ("enable", "client_debounces", "adaptive_debounce", "prefetch"):
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        return value
    if name == "provider":
        if value not in ("auto", "inline", "completion", "both"):
            raise ValueError(f"expected auto, inline, completion or both, got {value!r}")
        return value
    if name == "temperature":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 2:
            raise ValueError(f"expected a number in [0, 2], got {value!r}")
        return float(value)
    low, high = _RANGES[name]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"expected an integer in [{low}, {high}], got {value!r}")
    return value


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


# -- documents -------------------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    uri: str
    version: int | None
    language_id: str | None
    prefix: str  # the whole text before the cursor
    suffix: str  # the whole text after the cursor
    lines: tuple[str, ...]  # the document's lines, line breaks kept
    line: int  # the cursor's line
    column: int  # the cursor's column in code points
    cursor: Cursor


def snapshot(uri: str, document: Any, line: int, character: int) -> Snapshot:
    """`document`: a pygls TextDocument. Raises ValueError for a line past the end;
    a character past the end of its line means the end of the line (as the LSP says)."""
    lines = tuple(document.lines)
    text = "".join(lines)
    open_last = not lines or lines[-1].endswith(("\n", "\r"))
    if line > len(lines) or (line == len(lines) and not open_last):
        raise ValueError(f"line {line} is past the end of {uri} ({len(lines)} lines)")
    if line == len(lines):
        content, start = "", len(text)
    else:
        content = lines[line].rstrip("\r\n")
        start = sum(len(s) for s in lines[:line])
    column = _column(content, character, document.position_codec)
    return _at(uri, document.version, document.language_id, lines, line, content, column, start + column)


def accepted(snap: Snapshot, text: str) -> Snapshot:
    """The snapshot after the user accepts `text` at the cursor: the cursor at its end."""
    prefix = snap.prefix + text
    lines = tuple((prefix + snap.suffix).splitlines(keepends=True))
    line = prefix.count("\n")
    start = prefix.rfind("\n") + 1
    content = lines[line].rstrip("\r\n") if line < len(lines) else ""
    return _at(snap.uri, snap.version, snap.language_id, lines, line, content, len(prefix) - start, len(prefix))


def _at(uri: str, version: int | None, language_id: str | None, lines: tuple[str, ...], line: int, content: str,
        column: int, offset: int) -> Snapshot:
    """The snapshot at `offset` (line `line`, column `column` in code points)."""
    text = "".join(lines)
    below = tuple(s.rstrip("\r\n") for s in lines[line + 1:line + 9])
    cursor = Cursor(
        line_prefix=content[:column],
        line_suffix=content[column:],
        next_lines=below,
        prev_line=next((s.rstrip("\r\n") for s in reversed(lines[max(0, line - 40):line]) if s.strip()), ""),
        indent_unit=detect_indent_unit(lines),
    )
    return Snapshot(uri, version, language_id, text[:offset], text[offset:], lines, line, column, cursor)


def _column(content: str, character: int, codec: Any) -> int:
    """Code points before `character` client units (UTF-16 by default) of `content`."""
    units = 0
    for i, c in enumerate(content):
        if units >= character:
            return i
        units += codec.client_num_units(c)
    return len(content)


def workspace_of(uri: str, folders: Iterable[str], root_uri: str | None = None) -> str | None:
    """The innermost workspace folder (else the root) holding the document, as an absolute path."""
    path = file_uri_path(uri)
    if path is None:
        return None
    best = None
    for folder_uri in [*folders, *([root_uri] if root_uri else [])]:
        folder = file_uri_path(folder_uri)
        if folder and (path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)):
            if best is None or len(folder) > len(best):
                best = folder
    return best


# -- prompts ---------------------------------------------------------------------------

_HASH_COMMENT = {"python", "shellscript", "sh", "bash", "zsh", "fish", "ruby", "perl", "r", "yaml", "toml",
                 "makefile", "dockerfile", "cmake", "elixir", "julia", "nim", "powershell", "coffeescript"}
_DASH_COMMENT = {"lua", "sql", "haskell", "elm", "ada"}
_SEMI_COMMENT = {"lisp", "clojure", "scheme", "racket", "emacs-lisp", "elisp", "fennel"}
_EXTENSIONS = {".py": "python", ".sh": "sh", ".rb": "ruby", ".pl": "perl", ".r": "r", ".yaml": "yaml",
               ".yml": "yaml", ".toml": "toml", ".lua": "lua", ".sql": "sql", ".hs": "haskell",
               ".el": "emacs-lisp", ".clj": "clojure", ".scm": "scheme", ".jl": "julia", ".ex": "elixir"}


def comment_prefix(language_id: str | None, path: str) -> str:
    language = (language_id or _EXTENSIONS.get(os.path.splitext(path)[1].lower(), "")).lower()
    if language in _HASH_COMMENT:
        return "#"
    if language in _DASH_COMMENT:
        return "--"
    if language in _SEMI_COMMENT:
        return ";;"
    return "//"


class Prompt(NamedTuple):
    ids: list[int]
    heal: Heal | None
    context_tokens: int  # of `ids`, the other files' (before the current file's header)


@dataclass(frozen=True)
class ContextDocument:
    uri: str
    version: int | None
    path: str  # as shown to the model: relative to the workspace
    language_id: str | None
    text: str


class PromptBuilder:
    """Prompt ids for one tokenizer. Remembers token counts of lines and the ids of the
    workspace-context block (keyed by the documents' versions), so a keystroke costs
    little tokenizing."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.layout = completion_layout(tokenizer)  # the model's FIM tokens, or prefix-only
        added = _added_vocab(tokenizer)
        self.file_sep = added.get("<|file_sep|>")
        self.repo_name = added.get("<|repo_name|>")
        self.bos = leading_special(tokenizer)
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos = eos if isinstance(eos, int) else None
        self._line_counts: dict[str, int] = {}
        self._context: dict[tuple, tuple[list[int], list[int]]] = {}

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def count(self, line: str) -> int:
        n = self._line_counts.get(line)
        if n is None:
            if len(self._line_counts) > 50_000:
                self._line_counts.clear()
            n = self._line_counts[line] = len(self.encode(line))
        return n

    def build(self, snap: Snapshot, options: Options, path: str = "", context: Iterable[ContextDocument] = (),
              workspace_name: str = "") -> Prompt:
        """The prompt's ids, its prefix's last token healed (engine/prompts.py)."""
        budget = options.context_tokens
        # prefix-only: no suffix in the prompt, so the prefix gets the whole budget
        suffix = self.suffix_text(snap, budget - int(budget * PREFIX_SHARE)) if self.layout.reads_suffix else ""
        prefix = self.prefix_text(snap, budget - self.count_text(suffix))
        context = list(context)
        files: list[int] = []
        header: list[int] = []
        if context and options.workspace_context_tokens > 0:
            files, header = self.context_ids(context, path, snap.language_id, options.workspace_context_tokens,
                                             workspace_name)
        prefix_ids, heal = heal_last_token(self.tokenizer, self.encode(prefix))
        return Prompt(self.arrange(files, header, prefix_ids, self.encode(suffix)), heal, len(files))

    def arrange(self, files: list[int], header: list[int], prefix_ids: list[int], suffix_ids: list[int]) -> list[int]:
        """The prompt from its parts. The other files come before the current one in every
        layout, so the session bank keeps them warm: in the repository layout (`<|file_sep|>`)
        as files before this one; in a suffix-prefix-middle model's as plain documents ended
        by end-of-text, as it saw them in training, before the FIM part; in prefix-suffix-middle,
        at the prefix's start; in prefix-only (no FIM tokens), before the file's header, as
        the same files and headers without FIM markers."""
        if self.file_sep is not None:
            return [*self.bos, *files, *header, *self.layout.layout(prefix_ids, suffix_ids)]
        if self.layout.order == "spm":
            return [*self.bos, *files, *self.layout.layout([*header, *prefix_ids], suffix_ids)]
        return [*self.bos, *self.layout.layout([*files, *header, *prefix_ids], suffix_ids)]

    def count_text(self, text: str) -> int:
        return sum(self.count(line) for line in text.splitlines(True))

    def prefix_text(self, snap: Snapshot, budget: int) -> str:
        """The text before the cursor that fits `budget` tokens. When it is cut, it starts on
        a line number that is a multiple of a power of two (at most START_LINE_STEP, at most a
        quarter of the lines that fit), so that its start, and the tokens the session bank
        has cached, survive many keystrokes."""
        line_start = snap.prefix[len(snap.prefix) - snap.column:] if snap.column else ""
        used = self.count(line_start)
        if used > budget:  # one enormous line: keep its end
            return line_start[-budget * 2:]
        first = snap.line
        while first > 0 and used + self.count(snap.lines[first - 1]) <= budget:
            first -= 1
            used += self.count(snap.lines[first])
        if first > 0:  # cut: start on a multiple of a step, so the start moves rarely
            step = 1 << max(0, min(START_LINE_STEP, (snap.line - first) // 4).bit_length() - 1)
            first = -(-first // step) * step
        return "".join(snap.lines[first:snap.line]) + line_start

    def suffix_text(self, snap: Snapshot, budget: int) -> str:
        rest = snap.suffix
        end_of_line = rest.find("\n") + 1 or len(rest)
        text, used = rest[:end_of_line], self.count(rest[:end_of_line])
        if used > budget:
            return rest[:budget * 2]
        for line in snap.lines[snap.line + 1:]:
            n = self.count(line)
            if used + n > budget:
                break
            text += line
            used += n
        return text

    def context_ids(self, documents: list[ContextDocument], path: str, language_id: str | None,
                    budget: int, workspace_name: str = "") -> tuple[list[int], list[int]]:
        """Ids of the other documents in the order given, and of the current file's header:
        the same ids for as long as the documents' texts do not change."""
        key = (tuple((d.path, d.language_id, d.text) for d in documents), path, language_id, budget, workspace_name)
        cached = self._context.get(key)
        if cached is not None:
            return cached
        repo = self.file_sep is not None
        ended = not repo and self.layout.order == "spm" and self.eos is not None  # plain documents, as in training
        sep = [self.file_sep] if self.file_sep is not None else []  # what starts each file (repository layout)
        files: list[int] = []
        if repo and self.repo_name is not None:
            files += [self.repo_name, *self.encode(f"{workspace_name or 'workspace'}\n")]
        left = budget
        for doc in documents:
            head = f"{doc.path}\n" if repo else f"{comment_prefix(doc.language_id, doc.path)} {doc.path}\n"
            left -= self.count(head) + 1
            if left <= 0:
                break
            body = []
            for line in doc.text.splitlines(True):
                n = self.count(line)
                if n > left:
                    break
                body.append(line)
                left -= n
            text = head + "".join(body)
            text += "" if text.endswith("\n") else "\n"
            text += "" if repo or ended else "\n"  # a blank line between files
            files += sep + self.encode(text) + ([self.eos] if ended and self.eos is not None else [])
        if repo:
            header = [*sep, *self.encode(f"{path}\n")]
        else:
            header = self.encode(f"{comment_prefix(language_id, path)} {path}\n") if path else []
        if len(self._context) > 64:
            self._context.clear()
        self._context[key] = (files, header)
        return files, header


def _added_vocab(tokenizer: Any) -> dict[str, int]:
    get = getattr(tokenizer, "get_added_vocab", None)
    try:
        return dict(get()) if callable(get) else {}
    except Exception:
        return {}
