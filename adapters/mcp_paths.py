"""Workspaces and files for the MCP tools, inside the workspace only.

A workspace is an existing absolute folder, normalized as every adapter does
(mtplxd/workspaces.py). A `path` argument resolves inside it: `..`, absolute paths
elsewhere and symlinks leading out are refused with a ToolError, and files are read
without following a symlink swapped in after that check.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from mcp.server.mcpserver.exceptions import ToolError

from mtplxd.workspaces import normalize_workspace

MAX_FILE_BYTES = 1_000_000  # a file read for fim_complete or warm_workspace
WARM_SCAN_LIMIT = 5_000  # directory entries looked at to find the recent files

SKIP_DIRS = frozenset({"node_modules", "__pycache__", "venv", "build", "dist", "target", "site-packages"})
LANGUAGES = {
    ".py": "python", ".pyi": "python", ".js": "javascript", ".jsx": "javascript", ".mjs": "javascript",
    ".ts": "typescript", ".tsx": "typescript", ".rs": "rust", ".go": "go", ".java": "java", ".kt": "kotlin",
    ".c": "c", ".h": "c", ".cc": "cpp", ".cpp": "cpp", ".hpp": "cpp", ".cs": "csharp", ".rb": "ruby",
    ".php": "php", ".swift": "swift", ".m": "objective-c", ".scala": "scala", ".sh": "shell", ".bash": "shell",
    ".zsh": "shell", ".lua": "lua", ".sql": "sql", ".html": "html", ".css": "css", ".scss": "scss",
    ".md": "markdown", ".rst": "restructuredtext", ".toml": "toml", ".yaml": "yaml", ".yml": "yaml",
    ".json": "json", ".zig": "zig", ".ex": "elixir", ".exs": "elixir", ".hs": "haskell", ".ml": "ocaml",
    ".jl": "julia", ".r": "r", ".dart": "dart", ".vue": "vue", ".svelte": "svelte",
}


def resolve_workspace(value: str | None, required: bool) -> str | None:
    """The workspace id (an existing absolute folder, normalized as every adapter does), or
    None when absent and optional."""
    if value is None or value == "":
        if required:
            raise ToolError("`workspace` is required: the absolute path of the project folder")
        return None
    try:
        workspace = normalize_workspace(value)
    except ValueError as e:
        raise ToolError(f"`workspace`: {e}") from None
    if not os.path.isdir(workspace):
        raise ToolError(f"`workspace` {value!r} is not an existing folder")
    return workspace


def resolve_path(workspace: str, path: str) -> tuple[Path, str]:
    """A file path given by a client, resolved inside `workspace` only: (its real path, the
    path relative to the workspace). `..`, absolute paths elsewhere and symlinks leading out
    are refused."""
    if not path or "\x00" in path:
        raise ToolError("`path` must be a non-empty file path without NUL characters")
    given = Path(path)
    if ".." in given.parts:
        raise ToolError(f"path {path!r} refused: `..` is not allowed, give a path inside the workspace")
    root = Path(os.path.realpath(workspace))
    real = Path(os.path.realpath(given if given.is_absolute() else Path(workspace) / given))
    if not real.is_relative_to(root):
        why = "is outside the workspace" if given.is_absolute() else "leads outside the workspace through a symlink"
        raise ToolError(f"path {path!r} refused: it {why} ({workspace})")
    return real, str(real.relative_to(root))


def read_text(real: Path, shown: str) -> str:
    """A regular UTF-8 file of at most MAX_FILE_BYTES (never following a last-moment symlink)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(real, flags)
    except FileNotFoundError:
        raise ToolError(f"{shown}: no such file") from None
    except OSError as e:
        raise ToolError(f"{shown}: cannot open: {e.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ToolError(f"{shown}: not a regular file")
        if info.st_size > MAX_FILE_BYTES:
            raise ToolError(f"{shown}: {info.st_size} bytes; files over {MAX_FILE_BYTES} bytes are refused")
        chunks, size = [], 0
        while size <= MAX_FILE_BYTES and (chunk := os.read(fd, 1 << 16)):
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > MAX_FILE_BYTES:
        raise ToolError(f"{shown}: files over {MAX_FILE_BYTES} bytes are refused")
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError:
        raise ToolError(f"{shown}: not UTF-8 text") from None


def split_at_cursor(text: str, line: int, character: int, shown: str) -> tuple[str, str]:
    """(text before, text after) a zero-based (line, character) cursor; the character is
    clamped to the line's length, as LSP does."""
    lines = text.split("\n")
    if line >= len(lines):
        raise ToolError(f"{shown}: line {line} is past the end of the file ({len(lines)} lines, zero-based)")
    offset = sum(len(lines[i]) + 1 for i in range(line)) + min(character, len(lines[line].rstrip("\r")))
    return text[:offset], text[offset:]


def recent_files(workspace: str, limit: int) -> list[str]:
    """The most recently modified source files of a workspace (relative paths), from a
    bounded walk that skips hidden and vendored folders and never follows symlinks."""
    found: list[tuple[float, str]] = []
    seen = 0
    for folder, dirs, files in os.walk(workspace):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS)
        for name in files:
            seen += 1
            if Path(name).suffix.lower() not in LANGUAGES:
                continue
            full = os.path.join(folder, name)
            try:
                info = os.lstat(full)
            except OSError:
                continue
            if stat.S_ISREG(info.st_mode) and info.st_size <= MAX_FILE_BYTES:
                found.append((info.st_mtime, os.path.relpath(full, workspace)))
        if seen >= WARM_SCAN_LIMIT:
            break
    found.sort(reverse=True)
    return [path for _, path in found[:limit]]


def language_of(path: str | None, given: str | None) -> str | None:
    """The language a caller named, else the one of the file's extension."""
    if given:
        return given
    return LANGUAGES.get(Path(path).suffix.lower()) if path else None
