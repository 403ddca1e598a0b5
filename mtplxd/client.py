"""Finding and talking to the running daemon: the state dir's files and plain-urllib HTTP.

Standard library only, so that `mtplxd status | stop | lsp | mcp` start fast. The
state dir's layout (daemon.pid and its lock, daemon.json, the log) is
mtplxd/state_dir.py, which the daemon writes by; its names are re-exported here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mtplxd.state_dir import (  # noqa: F401  (the state dir's names, for the client side)
    EXIT_STATE_DIR, INFO_FILE, LOG_FILE, LSP_SOCKET, PID_FILE, base_url, connect_host, owner_pid, prepare_state_dir,
)

# Never route calls to the local daemon through an HTTP proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def read_info(state_dir: Path) -> dict[str, Any] | None:
    """daemon.json of the live daemon; None when not running or not listening yet."""
    pid = owner_pid(state_dir)
    if pid is None:
        return None
    try:
        info = json.loads((Path(state_dir) / INFO_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return info if isinstance(info, dict) and info.get("pid") == pid else None


def read_address(state_dir: Path) -> tuple[str, int] | None:
    """(host, port) to connect to the running daemon, or None."""
    info = read_info(state_dir)
    return (connect_host(info["host"]), int(info["port"])) if info else None


def daemon_url(state_dir: Path) -> str | None:
    address = read_address(state_dir)
    return base_url(*address) if address else None


def get_json(url: str, api_key: str | None = None, timeout: float = 5.0) -> tuple[int, Any]:
    """(HTTP status, parsed body). Error statuses are returned, not raised (/health
    may answer 503 while loading); connection problems raise OSError."""
    headers = {"Accept": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, headers=headers)
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            return response.status, _parse(response.read())
    except urllib.error.HTTPError as e:
        return e.code, _parse(e.read())


def _parse(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return {"error": body.decode(errors="replace").strip()}


def health(state_dir: Path, api_key: str | None = None, timeout: float = 5.0) -> dict[str, Any] | None:
    """The running daemon's /health body, or None if there is none or it does not answer."""
    url = daemon_url(state_dir)
    if url is None:
        return None
    try:
        _, body = get_json(f"{url}/health", api_key, timeout)
    except OSError:
        return None
    return body if isinstance(body, dict) else {"body": body}


def status(state_dir: Path, api_key: str | None = None) -> dict[str, Any]:
    """What `mtplxd status` reports: running or not, where, since when, and /health."""
    state_dir = Path(state_dir)
    pid = owner_pid(state_dir)
    report: dict[str, Any] = {"running": pid is not None, "state_dir": str(state_dir)}
    if pid is None:
        return report
    report["pid"] = pid
    info = read_info(state_dir)
    if info is None:  # locked the state dir, not listening yet
        return report
    report["url"] = base_url(connect_host(info["host"]), int(info["port"]))
    report["page"] = report["url"] + "/"  # the daemon's page (adapters/http/page.py)
    report["version"] = info.get("version")
    report["started_at"] = info.get("started_at")
    try:
        started = datetime.fromisoformat(info["started_at"])
        report["uptime_s"] = round((datetime.now(timezone.utc) - started).total_seconds(), 1)
    except (KeyError, TypeError, ValueError):
        pass
    report["health"] = health(state_dir, api_key)
    warnings = (report["health"] or {}).get("warnings")
    if isinstance(warnings, list):  # conditions the daemon runs degraded under (a full disk)
        report["warnings"] = warnings
    return report


def remove_stale_files(state_dir: Path) -> bool:
    """Remove daemon.pid / daemon.json left by a daemon that died; True if any was."""
    if owner_pid(state_dir) is not None:
        return False
    removed = False
    for name in (PID_FILE, INFO_FILE):
        try:
            (Path(state_dir) / name).unlink()
            removed = True
        except FileNotFoundError:
            pass
    return removed


def stop(state_dir: Path, timeout: float = 30.0) -> tuple[int, str]:
    """SIGTERM the daemon and wait until it has let go of the state dir.
    Returns (exit code, message); not running is success."""
    pid = owner_pid(state_dir)
    if pid is None or pid <= 0:
        stale = remove_stale_files(state_dir)
        return 0, "mtplxd is not running" + (" (removed stale pid files)" if stale else "")
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + timeout
    while owner_pid(state_dir) is not None:
        if time.monotonic() > deadline:
            return 1, f"mtplxd (pid {pid}) did not exit within {timeout:.0f} s; see {Path(state_dir) / LOG_FILE}"
        time.sleep(0.05)
    remove_stale_files(state_dir)
    return 0, f"stopped mtplxd (pid {pid})"


def spawn(
    state_dir: Path,
    start_args: list[str],
    api_key: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> tuple[int, str]:
    """Start `mtplxd start START_ARGS` in the background (with `env` added to this
    environment) and wait until it answers /health.
    Returns (exit code, message): the URL, or why it failed with the log's tail."""
    state_dir = Path(state_dir)
    log = state_dir / LOG_FILE
    command = [sys.executable, "-m", "mtplxd", "start", *start_args, "--no-stderr-log"]
    # Its own session: the daemon outlives this terminal and its Ctrl-C. Its stray output
    # (a traceback before logging is set up) lands in the log, where the tail shows it.
    try:
        prepare_state_dir(state_dir)
        out = open(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")
    except OSError as e:
        return EXIT_STATE_DIR, f"cannot write the state dir {state_dir}: {e.strerror or e}"
    with out:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    deadline = time.monotonic() + timeout
    while (code := process.poll()) is None:
        info = read_info(state_dir)
        if info is not None and info["pid"] == process.pid and health(state_dir, api_key, 2.0) is not None:
            return 0, base_url(connect_host(info["host"]), int(info["port"]))
        if time.monotonic() > deadline:
            process.terminate()
            return 1, f"mtplxd did not answer within {timeout:.0f} s; log tail:\n{log_tail(state_dir)}"
        time.sleep(0.1)
    if code == EXIT_STATE_DIR:  # its own one-line error may not have fitted in the log
        tail = log_tail(state_dir)
        return code, f"cannot write daemon.pid or daemon.json in {state_dir} (is its disk full?)" + (
            f"; log tail:\n{tail}" if tail.strip() else "")
    return code or 1, f"mtplxd exited during startup (exit {code}); log tail:\n{log_tail(state_dir)}"


def log_tail(state_dir: Path, lines: int = 20) -> str:
    try:
        text = (Path(state_dir) / LOG_FILE).read_text(errors="replace")
    except FileNotFoundError:
        return "(no log yet)"
    return "\n".join(text.splitlines()[-lines:])
