"""`mtplxd lsp`: the command editors spawn as their language server.

It pipes the editor's stdin/stdout to the daemon's LSP socket (`<state_dir>/lsp.sock`),
byte for byte, and starts a daemon in the background first when none owns the state
dir, so that every editor on the machine shares one daemon and one model. It ends
when either side closes. Nothing but LSP traffic goes to stdout; what went wrong goes
to stderr (editors show it in their LSP log).

Standard library only (no pygls, no MLX): editors start it often and wait for it.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from pathlib import Path

from mtplxd.state_dir import LSP_SOCKET
SPAWNED_WAIT_S = 60.0  # a daemon we started: it binds the socket right after taking the state dir
RUNNING_WAIT_S = 10.0  # a daemon that was already running (perhaps starting up itself)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", metavar="DIR", help="the daemon's state dir (default: as for start)")
    p.add_argument("--model", metavar="PATH", help="checkpoint for a daemon this command starts "
                   "(default: the configured or embedded model)")


def run(state_dir: str | None = None, model: str | None = None) -> int:
    code = _run(state_dir, model)
    sys.stdout.flush()
    sys.stderr.flush()
    # The stdin reader thread may sit in read(); do not wait for it.
    os._exit(code)


def _run(state_dir_flag: str | None, model: str | None) -> int:
    from mtplxd import client
    from mtplxd.config import ConfigError, load_settings

    try:
        settings = load_settings({"state_dir": state_dir_flag, "model": model})
    except ConfigError as e:
        _say(str(e))
        return 2
    state_dir = settings.state_dir
    path = state_dir / LSP_SOCKET
    sock = _connect(path)
    if sock is None:
        wait = RUNNING_WAIT_S
        if client.owner_pid(state_dir) is None:
            start = ["--state-dir", str(state_dir)] + (["--model", str(settings.model)] if model else [])
            code, message = client.spawn(state_dir, start, settings.api_key)
            # Another editor may have started one at the same moment: its daemon won the state dir.
            if code != 0 and client.owner_pid(state_dir) is None:
                _say(f"could not start the daemon: {message}")
                return 1
            wait = SPAWNED_WAIT_S
        sock = _connect(path, wait)
        if sock is None:
            _say(f"the daemon that owns {state_dir} does not serve LSP at {path}; "
                 f"see {state_dir / client.LOG_FILE} (restart it: mtplxd stop; mtplxd lsp)")
            return 1
    return _pipe(sock)


def _connect(path: Path, wait: float = 0.0) -> socket.socket | None:
    deadline = time.monotonic() + wait
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(path))
            return sock
        except OSError:
            sock.close()
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def _pipe(sock: socket.socket) -> int:
    stdin, stdout = sys.stdin.fileno(), sys.stdout.fileno()

    def upstream() -> None:
        try:
            while data := os.read(stdin, 65536):
                sock.sendall(data)
        except OSError:
            pass
        finally:
            try:
                sock.shutdown(socket.SHUT_WR)  # the editor is gone: the server sees the end
            except OSError:
                pass

    threading.Thread(target=upstream, name="mtplxd-lsp-stdin", daemon=True).start()
    try:
        while data := sock.recv(65536):
            view = memoryview(data)
            while view:
                view = view[os.write(stdout, view):]
    except OSError:  # the editor closed our stdout, or the daemon went away
        pass
    finally:
        sock.close()
    return 0


def _say(message: str) -> None:
    print(f"mtplxd lsp: {message}", file=sys.stderr)
