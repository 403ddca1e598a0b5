"""Workspaces and files for the MCP tools: which folders a call may use, and files in them.

A workspace is an existing absolute folder, normalized as every adapter does
(mtplxd/workspaces.py). A call may use the one it names only when its real path
(symlinks resolved) is, or is inside, the real path of
- a root the MCP client declared (MCP roots),
- a folder an editor opened over LSP (the daemon's WorkspaceRegistry), or
- a folder of the `workspaces` setting (config.toml, MTPLXD_WORKSPACES).
Anything else is refused with a ToolError that names the folder and says how to allow
it (`WorkspaceGuard`); the resource `mtplxd://sessions/{workspace}` is guarded the same way
(`WorkspaceGuard.use_in_read`). The client is asked for its roots only when the other two do
not already allow the folder: through the tool's `ClientRoots` parameter, which the
SDK fills in before the tool runs (a roots/list request in the handshake era, an
input_required round from 2026-07-28 on). Handshake-era roots are kept per
Streamable HTTP session until the client sends notifications/roots/list_changed.

A `path` argument resolves inside the workspace's real path as it was when allowed:
`..`, absolute paths elsewhere and symlinks leading out are refused with a ToolError,
and files are opened one component at a time with O_NOFOLLOW (`open_beneath`), so a
folder swapped for a symlink after that check is never followed.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Iterable, Literal, overload

import anyio
from mcp.server.mcpserver import Context, ListRoots, Resolve
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import InputRequiredResult, ListRootsRequest, ListRootsResult
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

from mtplxd.config import Settings
from mtplxd.runtime import Runtime
from mtplxd.requests import file_uri_path, workspace_key

log = logging.getLogger("mtplxd.mcp")

MAX_FILE_BYTES = 1_000_000  # a file read for fim_complete or warm_workspace
WARM_SCAN_LIMIT = 5_000  # directory entries looked at to find the recent files
ROOTS_SESSIONS = 256  # Streamable HTTP sessions whose declared roots are kept
ROOTS_TIMEOUT_S = 10.0  # a client's answer to roots/list asked during a resource read
ROOTS_INPUT = "mtplxd_roots"  # the key of a resource read's roots/list in an input_required round
SESSION_HEADER = "mcp-session-id"
ROOTS_CHANGED = "notifications/roots/list_changed"

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


@dataclass(frozen=True)
class Folder:
    """A workspace a call may use. `id`: as the client named it, normalized (the session-bank
    namespace); `real`: its real path when it was allowed, where its files are looked up, so
    that a symlink swapped in afterwards cannot move the call elsewhere."""

    id: str
    real: str


class WorkspaceGuard:
    """Which folders the MCP tools may use (see the module docstring), and the roots each
    handshake-era session declared."""

    def __init__(self, settings: Settings, runtime: Runtime):
        self.configured = _configured_folders(settings.workspaces)
        self.runtime = runtime
        self._roots: OrderedDict[str, tuple[str, ...]] = OrderedDict()  # session id -> root folders

    @overload
    def use(self, value: str | None, roots: tuple[str, ...], required: Literal[True]) -> Folder: ...
    @overload
    def use(self, value: str | None, roots: tuple[str, ...], required: bool) -> Folder | None: ...

    def use(self, value: str | None, roots: tuple[str, ...], required: bool) -> Folder | None:
        """The workspace a call names, when it may use it (None: none named and optional);
        else a ToolError saying how to allow it."""
        workspace = resolve_workspace(value, required)
        if workspace is None:
            return None
        real = os.path.realpath(workspace)
        if not (self._daemon_allows(real) or _inside_any(real, roots)):
            raise ToolError(_refusal(workspace, real, roots))
        return Folder(workspace, real)

    async def use_in_read(self, value: str, ctx: Context) -> Folder | InputRequiredResult:
        """The workspace a resource read names, when a tool call of this client could use it.
        Resources have no resolvers, so the client's roots are asked here when needed: over
        the session's back-channel in the handshake era, else in one input_required round."""
        if not self.must_ask(value, ctx):
            return self.use(value, self.declared(ctx, None), required=True)
        if ctx.protocol_version is None or ctx.protocol_version in HANDSHAKE_PROTOCOL_VERSIONS:
            return self.use(value, self.declared(ctx, await _roots_now(ctx)), required=True)
        answer = (ctx.input_responses or {}).get(ROOTS_INPUT)
        if answer is None:  # the client answers roots/list, then retries the read
            return InputRequiredResult(input_requests={ROOTS_INPUT: ListRootsRequest()})
        try:
            listed = ListRootsResult.model_validate(answer.model_dump(mode="json", by_alias=True, exclude_none=True))
        except ValueError:  # an answer that is not a roots list declares none
            listed = ListRootsResult(roots=[])
        return self.use(value, self.declared(ctx, listed), required=True)

    def _daemon_allows(self, real: str) -> bool:
        """Allowed without the client's roots: by the setting or by an editor."""
        registry = self.runtime.workspaces
        editors = registry.editor_folders() if registry is not None else ()
        return _inside_any(real, self.configured) or _inside_any(real, editors)

    def must_ask(self, workspace: str | None, ctx: Context) -> bool:
        """Whether this call needs the client's roots and has none cached."""
        if not workspace or not _declares_roots(ctx):
            return False
        try:
            real = os.path.realpath(workspace_key(workspace))
        except ValueError:
            return False  # the tool refuses it, without asking
        if self._daemon_allows(real):
            return False
        session = _session(ctx)
        return session is None or session not in self._roots

    def declared(self, ctx: Context, listed: ListRootsResult | None) -> tuple[str, ...]:
        """The client's root folders: those it just listed (kept for its session), else the
        session's cached ones, else none."""
        session = _session(ctx)
        if listed is None:
            return self._roots.get(session, ()) if session is not None else ()
        folders = tuple(folder for root in listed.roots if (folder := file_uri_path(str(root.uri))))
        if session is not None:
            self._roots[session] = folders
            self._roots.move_to_end(session)
            while len(self._roots) > ROOTS_SESSIONS:
                self._roots.popitem(last=False)
        return folders

    async def forget_changed_roots(self, ctx: Any, call_next: Any) -> Any:
        """Server middleware: a session's notifications/roots/list_changed drops its cached
        roots, so that its next call asks again."""
        if ctx.method == ROOTS_CHANGED:
            headers = getattr(ctx.request, "headers", None) or {}
            session = headers.get(SESSION_HEADER)
            if session is not None:
                self._roots.pop(session, None)
        return await call_next(ctx)


async def _roots_now(ctx: Context) -> ListRootsResult | None:
    """A roots/list request sent now, outside any resolver; None when the client gives none."""
    try:
        with anyio.fail_after(ROOTS_TIMEOUT_S):
            result: ListRootsResult = await ctx.session.send_request(ListRootsRequest(), ListRootsResult)
            return result
    except Exception as e:  # a client that declares roots but cannot list them
        log.info("the client did not list its roots (%s: %s)", type(e).__name__, e)
        return None


async def _asked_roots(workspace: str | None, ctx: Context) -> ListRoots | None:
    """Resolver: a roots/list request to the client, when the call needs its roots."""
    return ListRoots() if guard_of(ctx).must_ask(workspace, ctx) else None


async def _client_roots(listed: Annotated[ListRootsResult | None, Resolve(_asked_roots)],
                        ctx: Context) -> tuple[str, ...]:
    """Resolver: the folders of the roots the client declared."""
    return guard_of(ctx).declared(ctx, listed)


# A tool parameter the SDK fills in (never an argument): the client's declared root folders.
ClientRoots = Annotated[tuple[str, ...], Resolve(_client_roots)]


def guard_of(ctx: Context) -> WorkspaceGuard:
    """The guard, which the MCP server's lifespan hands every request (adapters/mcp/server.py)."""
    guard = ctx.request_context.lifespan_context
    if not isinstance(guard, WorkspaceGuard):
        raise ToolError("this server has no workspace guard: no workspace can be used")
    return guard


def _declares_roots(ctx: Context) -> bool:
    capabilities = ctx.client_capabilities
    return capabilities is not None and capabilities.roots is not None


def _session(ctx: Context) -> str | None:
    """The Streamable HTTP session of a handshake-era call; None where roots are not kept
    (later protocol versions ask within each call)."""
    if ctx.protocol_version not in HANDSHAKE_PROTOCOL_VERSIONS:
        return None
    return (ctx.headers or {}).get(SESSION_HEADER)


def _configured_folders(values: Iterable[str]) -> tuple[str, ...]:
    """The `workspaces` setting's folders; a relative one names no folder and is ignored."""
    folders = []
    for value in values:
        path = os.path.expanduser(value)
        if os.path.isabs(path):
            folders.append(os.path.normpath(path))
        else:
            log.warning("setting `workspaces`: %r is not an absolute folder path; ignored", value)
    return tuple(folders)


def _inside_any(real: str, folders: Iterable[str]) -> bool:
    """Whether a real path is one of the folders or inside one, their symlinks resolved now."""
    for folder in folders:
        top = os.path.realpath(folder)
        if real == top or real.startswith(top.rstrip(os.sep) + os.sep):
            return True
    return False


def _refusal(workspace: str, real: str, roots: tuple[str, ...]) -> str:
    shown = workspace if real == workspace else f"{workspace} (really {real})"
    declared = f"this client declared the roots {', '.join(roots[:8])}" if roots else \
        "this client declared no roots"
    return (f"workspace {shown} refused: the MCP tools use only folders you allowed ({declared}). "
            f"To allow it: declare it, or a folder above it, as a root in your MCP client; open it in an "
            f"editor connected to mtplxd over LSP; or add it to the `workspaces` setting (config.toml: "
            f"workspaces = [{json.dumps(workspace)}], or MTPLXD_WORKSPACES={workspace}) and restart mtplxd.")


def resolve_workspace(value: str | None, required: bool) -> str | None:
    """The workspace id (an existing absolute folder, normalized as every adapter does), or
    None when absent and optional."""
    if value is None or value == "":
        if required:
            raise ToolError("`workspace` is required: the absolute path of the project folder")
        return None
    try:
        workspace = workspace_key(value)
    except ValueError as e:
        raise ToolError(f"`workspace`: {e}") from None
    if not os.path.isdir(workspace):
        raise ToolError(f"`workspace` {value!r} is not an existing folder")
    return workspace


@dataclass(frozen=True)
class WorkspaceFile:
    """A file a call may read: the workspace's real path when it was allowed, and the file's
    real path relative to it as resolved when checked (also what the client is shown)."""

    root: str
    shown: str

    @property
    def full(self) -> str:
        return os.path.join(self.root, self.shown)


def resolve_path(workspace: Folder, path: str) -> WorkspaceFile:
    """A file path given by a client, resolved inside `workspace` only (its real path when it
    was allowed). `..`, absolute paths elsewhere and symlinks leading out are refused."""
    if not path or "\x00" in path:
        raise ToolError("`path` must be a non-empty file path without NUL characters")
    given = Path(path)
    if ".." in given.parts:
        raise ToolError(f"path {path!r} refused: `..` is not allowed, give a path inside the workspace")
    root = Path(workspace.real)
    try:
        real = Path(os.path.realpath(given if given.is_absolute() else root / given))
    except OSError as e:  # a folder on the way removed or replaced while it was resolved
        raise ToolError(f"path {path!r}: cannot resolve it: {e.strerror}") from None
    if not real.is_relative_to(root):
        why = "is outside the workspace" if given.is_absolute() else "leads outside the workspace through a symlink"
        raise ToolError(f"path {path!r} refused: it {why} ({workspace.id})")
    return WorkspaceFile(workspace.real, str(real.relative_to(root)))


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW
_FILE_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | _NOFOLLOW  # a FIFO must not block the open


def open_beneath(file: WorkspaceFile) -> int:
    """The file opened one path component at a time from `/`, each relative to its folder's
    descriptor (openat) and with O_NOFOLLOW: a folder or file swapped for a symlink after
    `resolve_path` checked the path fails the open (ELOOP, ENOTDIR) instead of being
    followed, so no read ever leaves the workspace."""
    parts = Path(file.full).parts[1:]
    if not parts:
        raise IsADirectoryError(21, "Is a directory")
    fd = os.open("/", _DIR_FLAGS)
    try:
        for name in parts[:-1]:
            folder = os.open(name, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = folder
        return os.open(parts[-1], _FILE_FLAGS, dir_fd=fd)
    finally:
        os.close(fd)


def read_text(file: WorkspaceFile) -> str:
    """A regular UTF-8 file of at most MAX_FILE_BYTES, opened without following any symlink."""
    shown = file.shown
    try:
        fd = open_beneath(file)
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
