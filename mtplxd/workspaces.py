"""Workspaces: session-bank namespaces, watched for changed files.

A workspace is an absolute folder path. Requests name theirs (HTTP header
`X-Mtplx-Workspace` or `metadata.workspace`; MCP and LSP pass their own) and the
session bank keeps one namespace per workspace. The scheduler tells the registry
about every workspace a request names; the registry watches the most recent
ones (watchfiles, `watch_workspaces` at most) and, when a source file changes on
disk, warms that file's context at background priority: the prefix every
completion in the file shares up to its cursor (the FIM prefix marker and the
file's text; the text alone for a model without FIM tokens, which completes from
the prefix), so the next completion there starts warm.
Changes to one file coalesce (the newest content wins, a warm-up in flight for
an older one is cancelled); one warm-up runs at a time. When a watched folder
disappears, its entries are dropped from the bank.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import anyio
import anyio.to_thread
from watchfiles import Change, DefaultFilter, awatch

from mtplxd.requests import Failed, WarmRequest, Warmed, warmup_prompt_ids, workspace_key

log = logging.getLogger("mtplxd.workspaces")
logging.getLogger("watchfiles").setLevel(logging.WARNING)  # it logs every batch of changes at INFO

SOURCE_SUFFIXES = frozenset(
    ".py .pyi .js .jsx .mjs .cjs .ts .tsx .go .rs .c .h .cc .cpp .cxx .hpp .hh .m .mm .java .kt .kts .scala "
    ".swift .rb .php .cs .fs .lua .sh .bash .zsh .sql .r .jl .ex .exs .erl .hs .ml .clj .dart .vue .svelte "
    ".html .css .scss .md .rst .txt .toml .yaml .yml .json .ini .cfg .proto .graphql .zig .nim".split()
)
MAX_FILE_BYTES = 512 * 1024  # larger files are not warmed
MIN_WARM_TOKENS = 16
WATCH_TIMEOUT_MS = 2000  # the watcher wakes this often to see whether its folder still exists


class SourceFilter(DefaultFilter):
    """watchfiles' default ignores (.git, node_modules, .venv, caches...) plus source suffixes;
    `ignore_paths` (the daemon's own state dir) are never warmed."""

    def __call__(self, change: Change, path: str) -> bool:
        return Path(path).suffix.lower() in SOURCE_SUFFIXES and super().__call__(change, path)


def read_source(path: str) -> str | None:
    """The file's text, or None when it is missing, too big, binary or not UTF-8."""
    try:
        if not os.path.isfile(path) or os.path.getsize(path) > MAX_FILE_BYTES:
            return None
        raw = Path(path).read_bytes()
    except OSError:
        return None
    if b"\0" in raw:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


class WorkspaceRegistry:
    MAX_EDITOR_FOLDERS = 1024  # names only; bounded all the same

    def __init__(
        self,
        scheduler: Any,
        max_watched: int = 8,
        debounce_ms: int = 1600,
        prompt_ids: Callable[[Any, str], list[int]] = warmup_prompt_ids,
        ignore: tuple[str | Path, ...] = (),
    ):
        self.scheduler = scheduler
        self.ignore = tuple(os.path.normpath(os.path.abspath(p)) for p in ignore)
        self.max_watched = max_watched
        self.debounce_ms = debounce_ms
        self.prompt_ids = prompt_ids
        self.known: OrderedDict[str, None] = OrderedDict()  # registered, most recent last
        self._watchers: dict[str, anyio.Event] = {}  # folder -> its stop event
        self._requested: set[str] = set()  # sent to run(), not handled yet
        self._send, self._receive = anyio.create_memory_object_stream[str](1024)
        self._queue: OrderedDict[str, str] = OrderedDict()  # file -> workspace, waiting to be warmed
        self._wake = anyio.Event()
        self._current: tuple[str, Any] | None = None  # (file, ticket) being warmed
        self.warmups_started = self.warmups_done = self.warmups_failed = 0
        self.dropped: list[str] = []  # workspaces dropped because their folder went away
        # Folders editors opened over LSP, most recent last: MCP tools may use them
        # (adapters/mcp/paths.py). Kept apart from `known`, which any HTTP request can add to.
        self._editor_folders: OrderedDict[str, None] = OrderedDict()

    # -- event-loop side ---------------------------------------------------------------

    def register(self, ws: str) -> None:
        """Note a workspace a request named (a workspace_key); watch it if it is a folder
        (non-blocking)."""
        self.known[ws] = None
        self.known.move_to_end(ws)
        while len(self.known) > 4096:  # names only; bounded all the same
            self.known.popitem(last=False)
        if self.max_watched > 0 and ws not in self._watchers and ws not in self._requested:
            try:
                self._send.send_nowait(ws)
                self._requested.add(ws)
            except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError):
                pass

    def watched(self) -> list[str]:
        return sorted(self._watchers)

    def open_in_editor(self, folder: str) -> None:
        """Note a folder an editor opened over LSP (its root or a workspace folder)."""
        try:
            ws = workspace_key(folder)
        except ValueError:
            return
        self._editor_folders[ws] = None
        self._editor_folders.move_to_end(ws)
        while len(self._editor_folders) > self.MAX_EDITOR_FOLDERS:
            self._editor_folders.popitem(last=False)

    def editor_folders(self) -> list[str]:
        """The folders editors opened over LSP during this daemon's life."""
        return list(self._editor_folders)

    async def run(self) -> None:
        """Watch registered workspaces and run warm-ups until cancelled."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._warm_loop)
            async with self._receive:
                async for ws in self._receive:
                    self._requested.discard(ws)
                    if ws in self._watchers or _inside(ws, self.ignore) \
                            or not await anyio.to_thread.run_sync(os.path.isdir, ws):
                        continue
                    while len(self._watchers) >= self.max_watched:  # stop the least recently named
                        oldest = next((w for w in self.known if w in self._watchers), None)
                        if oldest is None:
                            break
                        self._watchers.pop(oldest).set()
                    stop = anyio.Event()
                    self._watchers[ws] = stop
                    tg.start_soon(self._watch, ws, stop)

    async def _watch(self, ws: str, stop: anyio.Event) -> None:
        gone = False
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_set_when_cancelled, stop)  # the Rust watcher polls `stop`
                log.info("watching workspace %s", ws)
                async for changes in awatch(ws, watch_filter=SourceFilter(ignore_paths=self.ignore),
                                            debounce=self.debounce_ms,
                                            rust_timeout=WATCH_TIMEOUT_MS, yield_on_timeout=True,
                                            stop_event=stop, ignore_permission_denied=True):
                    if not await anyio.to_thread.run_sync(os.path.isdir, ws):
                        gone = True
                        break
                    for change, path in sorted(changes, key=lambda c: c[1]):
                        if change != Change.deleted:
                            self._schedule(ws, path)
                tg.cancel_scope.cancel()
        except Exception as e:  # a folder deleted under the watcher, a permission error...
            log.warning("stopped watching %s: %s", ws, e)
            gone = not os.path.isdir(ws)
        finally:
            if self._watchers.get(ws) is stop:
                del self._watchers[ws]
        if gone:
            self._drop(ws)

    def _drop(self, ws: str) -> None:
        log.info("workspace %s is gone: dropping its session entries", ws)
        self.known.pop(ws, None)
        self.dropped.append(ws)
        bank = getattr(self.scheduler, "bank", None)
        if bank is not None:
            bank.clear(ws)

    def _schedule(self, ws: str, path: str) -> None:
        if self._current is not None and self._current[0] == path:
            self._current[1].cancel()  # the newer content supersedes the warm-up in flight
        self._queue[path] = ws
        self._queue.move_to_end(path)
        self._wake.set()

    async def _warm_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            while self._queue:
                path, ws = self._queue.popitem(last=False)
                try:
                    await self._warm(ws, path)
                except Exception:
                    self.warmups_failed += 1
                    log.exception("warm-up of %s failed", path)

    async def _warm(self, ws: str, path: str) -> None:
        engine = self.scheduler.engine
        if self.scheduler.state != "ready" or engine is None or getattr(self.scheduler, "bank", None) is None:
            return
        text = await anyio.to_thread.run_sync(read_source, path)
        if not text:
            return
        ids = await anyio.to_thread.run_sync(self.prompt_ids, engine.tokenizer, text)
        ids = ids[: max(0, int(getattr(engine, "context_length", len(ids) + 1)) - 1)]
        if len(ids) < MIN_WARM_TOKENS:
            return
        try:
            ticket = self.scheduler.submit(WarmRequest(tuple(ids), ws, label=path))
        except Exception as e:  # queue full, shutting down: a warm-up is optional
            log.debug("warm-up of %s skipped: %s", path, e)
            return
        self.warmups_started += 1
        self._current = (path, ticket)
        try:
            async for event in ticket:
                if isinstance(event, Warmed):
                    self.warmups_done += 1
                    log.debug("warmed %s: %d tokens (%d cached)", path, event.prompt_tokens, event.cached_tokens)
                elif isinstance(event, Failed):
                    self.warmups_failed += 1
        except (anyio.ClosedResourceError, anyio.EndOfStream):
            pass  # cancelled: a newer change of the same file
        finally:
            self._current = None
            ticket.cancel()


def _inside(path: str, folders: tuple[str, ...]) -> bool:
    return any(path == f or path.startswith(f.rstrip(os.sep) + os.sep) for f in folders)


async def _set_when_cancelled(event: anyio.Event) -> None:
    try:
        await anyio.sleep_forever()
    finally:
        event.set()


# -- the session bank of a daemon ------------------------------------------------------


def physical_memory() -> int:
    """Bytes of physical memory (8 GiB when it cannot be read)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8 << 30


DEFAULT_DISK_BYTES = 8 << 30  # or a quarter of the free disk, the smaller (open_bank)


def default_ram_bytes() -> int:
    """An eighth of physical memory, at most 32 GiB."""
    return min(physical_memory() // 8, 32 << 30)


def open_bank(settings: Any, rank: int = 0, size: int = 1) -> Any:
    """The session bank of `settings` (<state_dir>/sessions), or None when switched off.
    Its disk budget is a cap: the bank writes what fits in the disk's free space as it is
    at each write (engine/sessions/room.py); by default 8 GiB or a quarter of the room it
    has, the smaller. On a (nearly) full disk new sessions stay in RAM, with a warning in
    the log and bank.disk_warning, until there is room again.
    Of several ranks, each keeps its slices in its own folder (mtplxd/ranks/world.py)."""
    from engine.sessions.bank import SessionBank
    from engine.sessions.room import DiskRoom

    ram = settings.session_ram_bytes if settings.session_ram_bytes is not None else default_ram_bytes()
    if ram <= 0:
        return None
    folder = Path(settings.state_dir) / "sessions"
    if size > 1:
        from mtplxd.ranks.world import rank_folder

        folder = folder / rank_folder(rank, size)
    delay, bps = settings.session_write_delay_ms / 1000.0, settings.session_write_bps
    if settings.session_disk_bytes is None:
        return SessionBank(folder, ram, DEFAULT_DISK_BYTES, delay, bps, room=DiskRoom(share=0.25))
    return SessionBank(folder, ram, settings.session_disk_bytes, delay, bps)
