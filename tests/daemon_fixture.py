"""Run a real daemon for a test, the way users do: the `mtplxd start` console script.

    from tests.daemon_fixture import running_daemon

    with running_daemon(tmp_path / "state", model_folder) as daemon:
        openai.OpenAI(base_url=daemon.base_url + "/v1", api_key="x")...

It listens on a free port (--port 0, read back from daemon.json), waits until
/health says "ok" (or the `until` status), and on exit sends SIGTERM (then SIGKILL
after a bound). The environment's MTPLXD_* variables are dropped so a developer's
own settings cannot leak in; pass `env=` to set some. Extra arguments go to `start`
(`"--api-key", "k"`). A daemon that dies or never gets there fails the test with
its log tail.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from mtplxd import client

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class DaemonInfo:
    base_url: str  # http://127.0.0.1:PORT, no trailing slash
    state_dir: Path
    process: subprocess.Popen


def mtplxd_command() -> list[str]:
    """The installed console script next to this interpreter (<venv>/bin/mtplxd)."""
    script = Path(sys.executable).parent / "mtplxd"
    if script.exists():
        return [str(script)]
    found = shutil.which("mtplxd")
    return [found] if found else [sys.executable, "-m", "mtplxd"]


def daemon_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MTPLXD_")}
    # No background calibration (mtplxd/calibrate.py) unless a test asks for it: it would
    # compete for the CPU and change the decoding mode mid-test.
    env["MTPLXD_CALIBRATE_TOKENS"] = "0"
    env.update(extra or {})
    return env


@contextmanager
def running_daemon(
    state_dir: Path,
    model_path: Path | None,
    *extra_args: str,
    until: str | None = "ok",
    env: dict[str, str] | None = None,
    timeout: float = START_TIMEOUT_S,
) -> Iterator[DaemonInfo]:
    """`until`: the /health status to wait for ("ok", "failed"); None: any answer.
    `model_path` None starts the embedded default model."""
    state_dir = Path(state_dir)
    command = [*mtplxd_command(), "start", "--state-dir", str(state_dir), "--port", "0"]
    if model_path is not None:
        command += ["--model", str(model_path)]
    output = tempfile.TemporaryFile()  # stderr before logging is set up (bad flags)
    process = subprocess.Popen(
        [*command, *extra_args], env=daemon_env(env), stdin=subprocess.DEVNULL,
        stdout=output, stderr=output,
    )
    try:
        base_url = _wait_until(process, state_dir, until, timeout, output)
        yield DaemonInfo(base_url, state_dir, process)
    finally:
        stop_process(process)
        output.close()


def _wait_until(process: subprocess.Popen, state_dir: Path, until: str | None, timeout: float, output) -> str:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"mtplxd exited with {process.returncode}:\n{_diagnostics(state_dir, output)}")
        info = client.read_info(state_dir)
        if info is not None and info["pid"] == process.pid:
            url = client.base_url(client.connect_host(info["host"]), int(info["port"]))
            last = client.health(state_dir, timeout=2.0)
            if last is not None and (until is None or last.get("status") == until):
                return url
        time.sleep(0.05)
    raise TimeoutError(f"/health not {until!r} within {timeout:.0f} s (last: {last}):\n"
                       f"{_diagnostics(state_dir, output)}")


def _diagnostics(state_dir: Path, output) -> str:
    output.seek(0)
    printed = output.read().decode(errors="replace")[-4000:]
    return f"--- output ---\n{printed}\n--- log tail ---\n{client.log_tail(state_dir, 40)}"


def stop_process(process: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S) -> int:
    """Signal the daemon and reap it; SIGKILL if it outstays `timeout`. Returns its exit code."""
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode
