"""The daemon's main: one process, one model, one task group.

    mtplxd start  ->  run(settings)  ->  anyio.run(Daemon(settings).serve)

`serve` owns the state dir for its lifetime (an exclusive flock on daemon.pid), then
runs the HTTP server and the scheduler side by side. The server starts at once, so
/health answers "loading" while the model loads, and keeps answering if the load
fails. SIGINT/SIGTERM stop the scheduler first (in-flight streams get a final
"shutdown" error event from it), then the server; the pid and address files go last.

A full disk. The daemon cannot run without daemon.pid (its lock, and the pid that
`mtplxd stop` signals) and daemon.json (where clients find it): when either cannot be
written it exits with one line and EXIT_STATE_DIR (mtplxd/state_dir.py). Everything else carries on:
new sessions stay in RAM until the disk has room again (engine/sessions/room.py), log records that cannot
be written are dropped (LogFile), and /health lists each such condition in "warnings".
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Callable, NoReturn

import anyio
import uvicorn

from engine.calibration_store import CalibrationStore
from mtplxd import state_dir as layout
from mtplxd.calibrate import ROUNDS, Calibrated, CalibrateRequest, calibration_prompts
from mtplxd.config import Settings
from mtplxd.loader import load_model
from mtplxd.requests import Failed
from mtplxd.runtime import Runtime
from mtplxd.ranks.world import World, local_world, start_followers, stop_followers
from mtplxd.scheduler import NotReady, Scheduler, SchedulerLimits
from mtplxd.workspaces import WorkspaceRegistry, open_bank, physical_memory

if TYPE_CHECKING:  # annotations only: the engine loads on the worker thread (load_model)
    from engine.engine import Engine

log = logging.getLogger("mtplxd.daemon")

GRACEFUL_SHUTDOWN_S = 5  # open HTTP streams get this long to finish after a signal
LOADER_GRACE_S = 5  # a model load cannot be interrupted: wait this long, then abandon it
SESSION_FLUSH_S = 20  # on shutdown, pending session-bank writes get this long


class AlreadyRunning(Exception):
    pass


class ServerFailed(Exception):
    """uvicorn could not start (it logged why: address in use, lifespan error)."""


class StateDirError(Exception):
    """A file the daemon cannot run without (daemon.pid, daemon.json) cannot be written."""

    def __init__(self, path: Path, error: OSError):
        full = error.errno in (errno.ENOSPC, errno.EDQUOT)
        fix = "free some space there" if full else "check its permissions"
        super().__init__(f"cannot write {path}: {error.strerror or error}; mtplxd needs a few KiB in its state dir: "
                         f"{fix}, or start it with --state-dir on another disk")


def run(settings: Settings, log_to_stderr: bool = True, world: World | None = None) -> NoReturn:
    """Blocking entry point of `mtplxd start` (foreground). Ends the process. `world`:
    rank 0 of ranks `mlx.launch` started (`settings.ranks` starts them here instead)."""
    try:
        layout.prepare_state_dir(settings.state_dir)
    except OSError as e:  # no logging yet: it lives in the state dir
        print(f"mtplxd: {StateDirError(settings.state_dir, e)}", file=sys.stderr)
        _exit(layout.EXIT_STATE_DIR)
    warnings: list[str] = []  # one-line conditions /health reports (the log file, here)
    setup_logging(settings, log_to_stderr, warnings)
    code = 0
    try:
        anyio.run(Daemon(settings, warnings=warnings, world=world).serve)
    except StateDirError as e:
        log.error("%s", e)
        code = layout.EXIT_STATE_DIR
    except (AlreadyRunning, ServerFailed) as e:
        log.error("%s", e)
        code = 1
    except KeyboardInterrupt:  # Ctrl-C before the signal handlers were installed
        code = 130
    except Exception:
        log.exception("the daemon failed")
        code = 1
    _exit(code)


def _exit(code: int) -> NoReturn:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: MLX, once used from a worker thread, can abort in its
    # C++ static destructors at exit (ml-explore/mlx#3126), and an abandoned model load
    # would hold the interpreter until it ends. Files are closed and the pid file gone.
    os._exit(code)


class Daemon:
    def __init__(self, settings: Settings, load_engine: Callable[[], Engine] | None = None,
                 warnings: list[str] | None = None, world: World | None = None):
        """`warnings`: a list others add one-line conditions to (run's log file), shown by /health."""
        self.settings = settings
        self.world = world  # several ranks (mtplxd/ranks/); None: this process alone, or settings.ranks here
        self.followers: list[subprocess.Popen] = []  # the ranks this process started
        limits = SchedulerLimits(
            max_active=settings.max_active,
            interactive_reserve=settings.interactive_reserve,
            max_queued=settings.max_queued,
            default_depth=settings.depth,
            profile=settings.profile,
            batch_rows=settings.batch_rows,
            patience_normal=settings.patience_normal,
            patience_background=settings.patience_background,
            max_cache_bytes=settings.max_cache_bytes or physical_memory() // 4,
        )
        self.scheduler = Scheduler(load_engine or self._load, limits,
                                   bank=open_bank(settings),  # <state_dir>/sessions, flushed on shutdown
                                   calibrations=CalibrationStore(settings.state_dir))
        self.workspaces = WorkspaceRegistry(self.scheduler, settings.watch_workspaces, ignore=(settings.state_dir,))
        warnings = warnings if warnings is not None else []
        note = settings.default_model_note()
        if note:
            warnings.append(note)
        self.runtime = Runtime(self.scheduler, settings, self.workspaces, warnings)  # all the adapters get
        self.server: uvicorn.Server | None = None
        self.port: int | None = None  # the port actually bound, once listening
        self.failure: StateDirError | None = None  # daemon.json could not be written: serve raises it

    def _load(self) -> Engine:
        """(worker thread) The model, split over the ranks when there are several."""
        if self.world is None:
            return load_model(self.settings.model_path)
        from mtplxd.ranks.leader import lead

        engine, leader = lead(self.settings, self.world, self.followers)
        self.scheduler.bank = open_bank(self.settings, 0, leader.size)  # this rank's slices, in its own folder
        self.scheduler.ranks = leader
        return engine

    async def serve(self) -> None:
        state_dir = self.settings.state_dir
        try:
            layout.prepare_state_dir(state_dir)
        except OSError as e:
            raise StateDirError(state_dir, e) from None
        with PidLock(state_dir / layout.PID_FILE):
            try:
                self._start_ranks()
                await self._serve_locked()
            finally:
                (state_dir / layout.INFO_FILE).unlink(missing_ok=True)
                if self.followers:
                    stop_followers(self.followers)
        if self.failure is not None:
            raise self.failure
        log.info("stopped")

    def _start_ranks(self) -> None:
        """`settings.ranks` > 1: this process is rank 0 of ranks started here, on loopback."""
        if self.settings.ranks <= 1 or self.world is not None:
            return
        folder = self.settings.state_dir / "ranks"
        self.world, hostfile = local_world(self.settings.ranks, folder)
        self.followers = start_followers(self.settings.ranks, hostfile, self.settings.state_dir, folder)
        log.info("started %d follower ranks (logs in %s)", len(self.followers), folder)

    def shutdown(self) -> None:
        """Begin a clean shutdown (idempotent); `serve` returns when it is done."""
        self.scheduler.stop()
        if self.server is not None:
            self.server.should_exit = True

    async def _serve_locked(self) -> None:
        from adapters.mcp import server as mcp
        from adapters.lsp.transport import serve_lsp
        from adapters.http.app import create_app  # after the lock: a refused start stays cheap

        app = create_app(self.runtime, self.settings)
        mcp.mount(app, self.runtime, self.settings)  # /mcp: same port and API key (MCP in its lifespan)
        config = uvicorn.Config(
            app,
            host=self.settings.host,
            port=self.settings.port,
            log_config=None,  # our handlers (setup_logging) receive uvicorn's records
            lifespan="on",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
        self.server = _Server(config)
        scheduler_done = anyio.Event()
        server_failed = False
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch_signals)
            tg.start_soon(self._run_scheduler, scheduler_done)
            tg.start_soon(self._report_load)
            tg.start_soon(self._calibrate)  # first start of this model here: measure AR vs MTP
            tg.start_soon(self._watch_ranks)
            tg.start_soon(self._publish_address)
            tg.start_soon(serve_lsp, self.runtime, self.settings)  # <state_dir>/lsp.sock for editors
            tg.start_soon(self.workspaces.run)  # watches workspaces, warms changed files
            try:
                await self.server.serve()
            except SystemExit:  # uvicorn's way of saying it could not start
                server_failed = True
            finally:
                self.shutdown()
                with anyio.move_on_after(LOADER_GRACE_S, shield=True):
                    await scheduler_done.wait()
                await self._flush_sessions()
                tg.cancel_scope.cancel()
        if server_failed:
            raise ServerFailed(f"could not serve HTTP on {self.settings.host}:{self.settings.port}")

    async def _flush_sessions(self) -> None:
        """Write the session bank's pending entries to disk (bounded) before exiting."""
        bank = self.scheduler.bank
        if bank is None:
            return
        with anyio.move_on_after(SESSION_FLUSH_S + 2, shield=True):
            if not await anyio.to_thread.run_sync(bank.close, SESSION_FLUSH_S, abandon_on_cancel=True):
                log.warning("session bank: some entries were not written within %d s", SESSION_FLUSH_S)

    async def _run_scheduler(self, done: anyio.Event) -> None:
        try:
            await self.scheduler.run()
        finally:
            done.set()

    async def _calibrate(self) -> None:
        """Queue a background calibration when the model has heads and no stored
        measurement for this machine; store it and decode with it from then on."""
        if self.settings.calibrate_tokens <= 0 or self.world is not None:
            return  # several ranks: decode with this machine's one-rank measurement, or the defaults
        while self.scheduler.state == "loading":
            await anyio.sleep(0.05)
        planner, engine = self.scheduler.planner, self.scheduler.engine
        if self.scheduler.state != "ready" or planner is None or planner.calibration is not None or not planner.n_heads:
            return
        calibrations = self.scheduler.calibrations
        if engine is None or calibrations is None:  # no model, or nowhere to store a measurement
            return
        request = CalibrateRequest(calibration_prompts(engine, ROUNDS), max_tokens=self.settings.calibrate_tokens)
        log.info("calibrating: AR against MTP depths 1-3 at background priority")
        try:
            async for event in self.scheduler.submit(request):
                if isinstance(event, Calibrated):
                    calibrations.put(engine.path, event.calibration)
                    self.scheduler.set_calibration(event.calibration)
                    log.info("calibrated: %s", planner.describe())
                elif isinstance(event, Failed):
                    log.warning("calibration failed: %s", event.message)
        except (NotReady, OSError) as e:  # shutting down, or the state dir is not writable
            log.warning("calibration not stored: %s", e)

    async def _watch_ranks(self) -> None:
        """Several ranks: a rank that died or hangs puts them out of service at once."""
        while self.scheduler.state in ("loading", "ready"):
            leader = self.scheduler.ranks
            reason = leader.watch() if leader is not None else None
            if reason is not None:
                self.scheduler.abandon(reason)
            await anyio.sleep(0.25)

    async def _report_load(self) -> None:
        """Say in the log how the model load ended (the scheduler keeps it to /health)."""
        log.info("loading model %s", self.settings.model_path)
        note = self.settings.default_model_note()
        if note:
            log.warning("%s", note)
        started = time.perf_counter()
        while self.scheduler.state == "loading":
            await anyio.sleep(0.05)
        if self.scheduler.state == "ready":
            log.info("model ready after %.1f s", time.perf_counter() - started)
        elif self.scheduler.state == "failed":
            log.error("model failed to load: %s", self.scheduler.load_error)
            hint = self.settings.missing_model_hint()
            if hint:
                log.error("%s", hint)
            log.error("the daemon keeps running; /health reports the failure")

    async def _publish_address(self) -> None:
        """Write daemon.json once the server listens: its existence means "connect now"."""
        server = self.server
        if server is None:  # set before this task starts (_serve_locked)
            return
        while not server.started:
            if server.should_exit:
                return
            await anyio.sleep(0.02)
        sockname = server.servers[0].sockets[0].getsockname()
        self.port = int(sockname[1])
        info = {
            "host": self.settings.host,
            "port": self.port,
            "pid": os.getpid(),
            "version": _version(),
            "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        path = self.settings.state_dir / layout.INFO_FILE
        try:
            write_private(path, json.dumps(info, indent=2) + "\n")
        except OSError as e:  # clients could not find us: stop rather than serve unseen
            self.failure = StateDirError(path, e)
            self.shutdown()
            return
        log.info("listening on %s", layout.base_url(layout.connect_host(self.settings.host), self.port))

    async def _watch_signals(self) -> None:
        try:
            receiver = anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM)
            with receiver as signals:
                async for signum in signals:
                    server = self.server
                    if server is not None and server.should_exit:  # a second signal: stop waiting for streams
                        server.force_exit = True
                    self._log_signal(signal.Signals(signum).name)
                    self.shutdown()
        except (ValueError, RuntimeError, NotImplementedError):
            # Not on the main thread (an embedding test): the owner calls shutdown().
            await anyio.sleep_forever()


    def _log_signal(self, name: str) -> None:
        """One line; under mlx.launch a warning that says the signal may mean another rank died."""
        if self.world is None or self.followers:  # alone, or rank 0 of ranks started here
            log.info("received %s: shutting down", name)
            return
        from mtplxd.ranks.leader import launcher_note

        log.warning("received %s: shutting down; %s", name, launcher_note(self.scheduler.ranks))


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        # The daemon handles SIGINT/SIGTERM itself (scheduler first, then the server);
        # uvicorn's own handlers would re-raise the signal after serve() returns.
        yield


# -- the state dir -----------------------------------------------------------------


def write_private(path: Path, text: str) -> None:
    """Write a 0600 file atomically: readers never see half of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not keep a half-written temp file
        raise


class PidLock:
    """Holds daemon.pid, locked, for the daemon's lifetime (see mtplxd/state_dir.py)."""

    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = None

    def __enter__(self) -> PidLock:
        try:
            self._lock()
        except OSError as e:  # a full disk: no room for the pid
            if self.fd is not None:
                self.__exit__()
            raise StateDirError(self.path, e) from None
        return self

    def _lock(self) -> None:
        while self.fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                pid = layout.owner_pid(self.path.parent)
                raise AlreadyRunning(
                    f"mtplxd is already running (pid {pid}) with state dir {self.path.parent}; "
                    f"stop it first: mtplxd stop --state-dir {self.path.parent}"
                )
            if _same_file(fd, self.path):
                self.fd = fd
            else:  # a stale-file cleanup unlinked it between open and lock: start over
                os.close(fd)
        os.fchmod(self.fd, 0o600)
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def __exit__(self, *exc) -> None:
        self.path.unlink(missing_ok=True)  # before unlocking: no one sees a stale file
        if self.fd is not None:
            os.close(self.fd)
        self.fd = None


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


# -- logging -------------------------------------------------------------------------


def setup_logging(settings: Settings, to_stderr: bool, warnings: list[str] | None = None) -> None:
    """Everything (ours, uvicorn's, the engine's) to logs/daemon.log, and to stderr
    in the foreground. `warnings` gets a line while the log file cannot be written."""
    path = settings.state_dir / layout.LOG_FILE
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
        os.chmod(path, 0o600)  # requests' paths and errors land here
    except OSError:
        pass  # a full disk: LogFile notes it with the first record
    formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    handlers: list[logging.Handler] = [LogFile(path, [] if warnings is None else warnings)]
    if to_stderr:
        handlers.append(logging.StreamHandler(sys.stderr))
    root = logging.getLogger()
    for handler in handlers:
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(settings.log_level.upper())


class LogFile(logging.FileHandler):
    """logs/daemon.log, which a full disk must not turn into "--- Logging error ---"
    tracebacks: a record that cannot be written is dropped (stderr still has it in the
    foreground), and `warnings` holds one line saying so until a record is written again."""

    def __init__(self, path: Path, warnings: list[str]):
        super().__init__(path, encoding="utf-8", delay=True)
        self.warnings = warnings
        self.warning: str | None = None
        self._failed = False

    def emit(self, record: logging.LogRecord) -> None:
        self._failed = False
        try:
            super().emit(record)  # a failed write comes back through handleError
        except OSError as e:  # opening the file
            self._lost(e)
            return
        if not self._failed and self.warning is not None:
            with contextlib.suppress(ValueError):
                self.warnings.remove(self.warning)
            self.warning = None

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):
            super().handleError(record)
            return
        self._failed = True
        self._lost(error)
        stream, self.stream = self.stream, None  # reopened by the next record: nothing half-buffered stays
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()

    def _lost(self, error: OSError) -> None:
        if self.warning is None:
            self.warning = f"log records are lost: {self.baseFilename} cannot be written ({error.strerror or error})"
            self.warnings.append(self.warning)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mtplxd")
    except PackageNotFoundError:
        return "unknown"
