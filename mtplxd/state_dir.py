"""The state dir's layout: the files the daemon writes and its clients read.

    daemon.pid   the daemon's lock (an exclusive flock for its lifetime) and its pid
    daemon.json  where it listens: {"host", "port", "pid", "version", "started_at"}
    lsp.sock     the LSP socket editors reach through `mtplxd lsp`
    logs/        daemon.log

The daemon (mtplxd/daemon.py), its LSP listener (adapters/lsp/transport.py) and its
clients (mtplxd/client.py, mtplxd/shims/) all name these files from here, so neither
side imports the other. Standard library only: the client commands start fast.

A daemon owns its state dir while it holds an exclusive flock on `daemon.pid` (the
kernel drops the lock when the process dies, so a crash never leaves a live-looking
pid file behind, and a recycled pid cannot be mistaken for the daemon).
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

PID_FILE = "daemon.pid"
INFO_FILE = "daemon.json"
LOG_FILE = Path("logs") / "daemon.log"
LSP_SOCKET = "lsp.sock"
# `mtplxd start` exits with this (sysexits' EX_CANTCREAT) when the state dir cannot take
# daemon.pid or daemon.json, a full disk most often: its log may not have room to say so.
EXIT_STATE_DIR = 73


def owner_pid(state_dir: Path) -> int | None:
    """The pid of the live daemon that owns `state_dir`, or None."""
    try:
        fd = os.open(Path(state_dir) / PID_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_pid(fd)
        return None  # nobody holds the lock: a stale file
    finally:
        os.close(fd)


def _read_pid(fd: int) -> int:
    # The daemon locks first and writes its pid just after: allow it that moment.
    for _ in range(100):
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if text.isdigit():
            return int(text)
        time.sleep(0.01)
    return -1  # locked by something that never wrote a pid: still "running"


def connect_host(host: str) -> str:
    """Where a local client connects when the daemon listens on a wildcard address."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def base_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def prepare_state_dir(state_dir: Path) -> None:
    """Create the state dir and logs/ private to the user (chmod: they may predate us)."""
    for folder in (Path(state_dir), Path(state_dir) / LOG_FILE.parent):
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
