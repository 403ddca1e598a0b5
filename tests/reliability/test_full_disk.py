"""The daemon on a full disk, through the real `mtplxd start`, the `openai` client, httpx
and `mtplxd status`: it starts with the session bank in RAM only and says so (log,
/health, status), and writes to disk on its own once space returns; a disk that fills
up while it runs costs the bank its disk writes until then, nothing else; a disk without
room even for daemon.pid is one line and an exit code.

Which full disk. Where this machine allows it (Linux, root, `mount` permitted) each test
mounts a small tmpfs under its own folder, fills it for real, and unmounts it after.
Elsewhere the same tests run on a simulated one: a `sitecustomize.py` on the daemon's
PYTHONPATH (written by FullDisk) makes `os.statvfs` report no free space under the
disk's folder and opening a file there for writing raise OSError(ENOSPC): the session
files only, or every file, as a marker file written by the test says. The real daemon
subprocess runs either way. MTPLXD_TEST_FULL_DISK=simulated forces the simulation;
each test prints the mode it used (pytest -s).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from mtplxd import client as mtplxd_client
from tests.checkpoints import write
from tests.daemon_fixture import daemon_env, mtplxd_command, running_daemon

TMPFS_BYTES = 80 << 20  # more than the 64 MiB the disk tier wants free at start
ROOM_FOR_SMALL_FILES = 256 << 10  # pid, address and log files fit; the session bank is off
FAST_WRITES = {"MTPLXD_SESSION_WRITE_DELAY_MS": "0"}
PROMPT = "".join(f"def f{i}(a, b):\n    return (a + {i}) * b\n\n" for i in range(12))

SITECUSTOMIZE = '''
"""Test-only (tests/reliability/test_full_disk.py): a simulated full disk under FULL_DISK_ROOT."""
import builtins, errno, io, os

ROOT = os.environ.get("FULL_DISK_ROOT", "")
_open, _io_open, _os_open, _statvfs = builtins.open, io.open, os.open, os.statvfs


def _mode():  # "", "sessions" (session files cannot be written), "daemon.json" or "all"
    try:
        with _io_open(os.path.join(ROOT, ".full")) as f:
            return f.read().strip()
    except OSError:
        return ""


def _full(path, writing):
    if not writing or isinstance(path, int):
        return False
    path = os.path.abspath(os.fsdecode(path))
    if not path.startswith(ROOT + os.sep):
        return False
    mode = _mode()
    if mode == "daemon.json":
        return "daemon.json" in os.path.basename(path)  # and its temp file
    return mode == "all" or (mode == "sessions" and os.sep + "sessions" + os.sep in path)


def _enospc(path):
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fsdecode(path))


def os_open(path, flags, mode=0o777, *, dir_fd=None):
    if _full(path, flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)):
        raise _enospc(path)
    return _os_open(path, flags, mode, dir_fd=dir_fd)


def io_open(file, mode="r", *args, **kwargs):
    if _full(file, any(c in mode for c in "wax+")):
        raise _enospc(file)
    return _io_open(file, mode, *args, **kwargs)


def statvfs(path):
    st = _statvfs(path)
    inside = not isinstance(path, int) and os.path.abspath(os.fsdecode(path)).startswith(ROOT)
    if not inside or _mode() not in ("sessions", "all"):
        return st
    return os.statvfs_result((st.f_bsize, st.f_frsize, st.f_blocks, 0, 0, st.f_files, st.f_ffree,
                              st.f_favail, st.f_flag, st.f_namemax))


if ROOT:
    os.open, builtins.open, io.open, os.statvfs = os_open, io_open, io_open, statvfs
'''


class FullDisk:
    """A folder on a disk the test fills up: a real tmpfs, or the simulation above."""

    def __init__(self, root: Path, mode: str, sim: Path | None = None):
        self.root, self.mode, self._sim = root, mode, sim
        self.state_dir = root / "state"
        self._filler = root / "filler"

    @classmethod
    def make(cls, folder: Path, simulated: bool = False) -> FullDisk:
        root = folder / "disk"
        root.mkdir()
        simulated = simulated or os.environ.get("MTPLXD_TEST_FULL_DISK") == "simulated"
        if not simulated and _mount_tmpfs(root):
            return cls(root, "tmpfs")
        sim = folder / "sim"
        sim.mkdir()
        (sim / "sitecustomize.py").write_text(SITECUSTOMIZE)
        return cls(root, "simulated", sim)

    @property
    def env(self) -> dict[str, str]:
        """For the daemon's environment (running_daemon's `env`)."""
        if self._sim is None:
            return {}
        path = os.pathsep.join(p for p in (str(self._sim), os.environ.get("PYTHONPATH", "")) if p)
        return {"PYTHONPATH": path, "FULL_DISK_ROOT": str(self.root)}

    def refuse(self, name: str) -> None:
        """Simulated only: files named `name` (and their temp files) cannot be written."""
        assert self.mode == "simulated"
        (self.root / ".full").write_text(name)

    def fill(self, leave: int = 0) -> None:
        """Leave `leave` bytes free (0: none at all). Simulated: `leave` > 0 blocks only the
        session files, 0 every file; os.statvfs reports no free space either way."""
        if self.mode == "simulated":
            (self.root / ".full").write_text("sessions" if leave else "all")
            return
        self.empty()
        with open(self._filler, "wb") as f:
            chunk = bytes(1 << 20)
            while (free := _free(self.root)) > leave:
                try:
                    f.write(chunk[: max(4096, min(len(chunk), free - leave))])
                    f.flush()
                except OSError as e:
                    assert e.errno == errno.ENOSPC
                    break

    def empty(self) -> None:
        (self.root / ".full").unlink(missing_ok=True)
        self._filler.unlink(missing_ok=True)

    def close(self) -> None:
        if self.mode == "tmpfs":
            if subprocess.run(["umount", str(self.root)], capture_output=True).returncode:
                subprocess.run(["umount", "-l", str(self.root)], capture_output=True)  # still busy: detach


def _mount_tmpfs(root: Path) -> bool:
    """Mount a TMPFS_BYTES tmpfs on `root`; False where this machine does not allow it."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES},mode=0700", "tmpfs", str(root)],
                          capture_output=True)
    return done.returncode == 0


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@pytest.fixture
def full_disk(tmp_path) -> Iterator[FullDisk]:
    disk = FullDisk.make(tmp_path)
    print(f"full disk: {disk.mode}")
    try:
        yield disk
    finally:
        disk.close()


@pytest.fixture(scope="module")
def mimo(tmp_path_factory) -> Path:
    return write("mimo", tmp_path_factory.mktemp("ck") / "mimo", mtp_heads=1)


# -- helpers ---------------------------------------------------------------------------------


def complete(base_url: str, prompt: str = PROMPT, workspace: Path | None = None) -> tuple[str, int]:
    """(text, cached prompt tokens) of a short seeded completion."""
    api = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=60)
    headers = {"X-Mtplx-Workspace": str(workspace)} if workspace else {}
    r = api.completions.create(model="default", prompt=prompt, max_tokens=8, temperature=1.0, seed=3,
                               extra_headers=headers)
    return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens


def status(state_dir: Path, *flags: str) -> subprocess.CompletedProcess:
    """`mtplxd status` as a user runs it (the console script next to this interpreter)."""
    return subprocess.run([*mtplxd_command(), "status", "--state-dir", str(state_dir), *flags],
                          env=daemon_env(), capture_output=True, text=True, timeout=60)


def output_of(process: subprocess.Popen) -> str:
    """What the running daemon printed so far (running_daemon keeps it in an unlinked temp
    file, still open as the daemon's stderr); "" where /proc is not there to read it."""
    try:
        return Path(f"/proc/{process.pid}/fd/2").read_text(errors="replace")
    except OSError:
        return ""


def wait_until(check, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def no_traceback(text: str) -> None:
    assert "Traceback" not in text and "Logging error" not in text, text[-3000:]


# -- the tests -------------------------------------------------------------------------------


def test_starts_on_a_full_disk_with_the_session_bank_in_ram(full_disk, mimo):
    full_disk.fill(leave=ROOM_FOR_SMALL_FILES)
    with running_daemon(full_disk.state_dir, mimo, env={**full_disk.env, **FAST_WRITES}) as daemon:
        http = httpx.Client(base_url=daemon.base_url, timeout=60)
        health = http.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        warnings = [w for w in health.json()["warnings"] if "RAM only" in w]
        assert len(warnings) == 1 and "\n" not in warnings[0], health.json()

        text, cached = complete(daemon.base_url)
        again, cached_again = complete(daemon.base_url)
        assert text and cached == 0 and again == text and cached_again > 0  # the RAM tier serves
        disk = http.get("/v1/sessions").json()["disk"]
        assert disk["entries"] == 0 and disk["waiting_writes"] >= 1, disk  # waits in RAM for room

        as_json = status(full_disk.state_dir, "--json")
        report = json.loads(as_json.stdout)
        assert as_json.returncode == 0 and warnings[0] in report["warnings"]
        assert warnings[0] in report["health"]["warnings"]
        as_text = status(full_disk.state_dir)
        assert as_text.returncode == 0 and f"warning: {warnings[0]}" in as_text.stdout, as_text.stdout
        assert not list((full_disk.state_dir / "sessions").glob("**/*.safetensors"))

        full_disk.empty()  # space returns: the waiting entry reaches the disk, no restart, no request
        sessions = lambda: http.get("/v1/sessions").json()["disk"]  # noqa: E731
        wait_until(lambda: sessions()["entries"] >= 1 and not sessions()["waiting_writes"], what="the disk writes")
        wait_until(lambda: http.get("/health").json()["warnings"] == [], what="the warning to clear")
        again, cached = complete(daemon.base_url)
        assert again == text and cached > 0
        output = output_of(daemon.process)
    assert "RAM only" in (full_disk.state_dir / mtplxd_client.LOG_FILE).read_text()
    assert list((full_disk.state_dir / "sessions").glob("**/*.safetensors"))
    no_traceback(output)


def test_a_disk_filling_up_while_running_costs_only_the_disk_writes(full_disk, mimo, tmp_path):
    env, workspace = {**full_disk.env, **FAST_WRITES}, tmp_path / "project"
    workspace.mkdir()
    with running_daemon(full_disk.state_dir, mimo, env=env) as daemon:
        http = httpx.Client(base_url=daemon.base_url, timeout=60)
        disk = lambda: http.get("/v1/sessions").json()["disk"]  # noqa: E731
        warnings = lambda: http.get("/health").json()["warnings"]  # noqa: E731
        written = lambda: disk()["entries"] and not disk()["pending_writes"]  # noqa: E731
        complete(daemon.base_url, "# first\n" + PROMPT, workspace)
        wait_until(written, what="the first write")
        assert warnings() == []

        full_disk.fill()
        text, _ = complete(daemon.base_url)
        wait_until(lambda: any("disk almost full" in w for w in warnings()), what="a session-bank warning")
        assert disk()["pending_writes"] == 0 and disk()["waiting_writes"] >= 1  # waits for room in RAM
        again, cached = complete(daemon.base_url)
        assert again == text and cached > 0  # kept in RAM
        forget(http, workspace)  # a new manifest, which cannot be written: tried again later, not in a loop
        time.sleep(1.5)
        assert output_of(daemon.process).count("session manifest not written") <= 2
        assert http.get("/health").json()["status"] == "ok"
        if full_disk.mode == "tmpfs":  # the log shares the disk: once its last page is full, records are lost
            for _ in range(60):  # ~90 bytes of access log each: past any page boundary
                http.get("/v1/models")
            wait_until(lambda: any("log records are lost" in w for w in warnings()), what="a log warning")

        full_disk.empty()
        complete(daemon.base_url, "# third\n" + PROMPT, workspace)
        wait_until(written, what="a write once there is room again")
        wait_until(lambda: not disk()["waiting_writes"], what="the waiting entry's write")
        wait_until(lambda: warnings() == [], what="the warnings to clear")

        full_disk.fill()  # stopping on a full disk: the flush gives up on the manifest at once
        forget(http, workspace)
        output = output_of(daemon.process)
        stopping = time.monotonic()
    assert daemon.process.returncode == 0 and time.monotonic() - stopping < 10
    no_traceback(output)
    if full_disk.mode == "simulated":  # (on the tmpfs the log was as full as the rest)
        assert "not written" in (full_disk.state_dir / mtplxd_client.LOG_FILE).read_text()


def forget(http: httpx.Client, workspace: Path) -> None:
    """Drop `workspace`'s sessions: their files leave the manifest."""
    assert http.delete("/v1/sessions", params={"workspace": str(workspace)}).json()["deleted"]


def test_no_room_even_for_the_pid_file_is_one_line_and_an_exit_code(full_disk, mimo):
    full_disk.state_dir.mkdir()
    full_disk.fill()
    done = subprocess.run(
        [*mtplxd_command(), "start", "--state-dir", str(full_disk.state_dir), "--port", "0", "--model", str(mimo)],
        env=daemon_env(full_disk.env), capture_output=True, text=True, timeout=120,
    )
    printed = done.stdout + done.stderr
    no_traceback(printed)
    assert done.returncode == mtplxd_client.EXIT_STATE_DIR, printed
    errors = [line for line in printed.splitlines() if "daemon.pid" in line]
    assert len(errors) == 1 and "No space left on device" in errors[0] and "--state-dir" in errors[0], printed
    assert mtplxd_client.owner_pid(full_disk.state_dir) is None
    assert not (full_disk.state_dir / "daemon.pid").exists()


def test_no_room_for_daemon_json_stops_the_daemon_with_one_line(tmp_path, mimo):
    """daemon.json is written once the server listens; a disk too full for it (simulated
    on any machine: the moment is hard to hit on a real one) stops the daemon cleanly."""
    disk = FullDisk.make(tmp_path, simulated=True)
    disk.refuse("daemon.json")
    done = subprocess.run(
        [*mtplxd_command(), "start", "--state-dir", str(disk.state_dir), "--port", "0", "--model", str(mimo)],
        env=daemon_env(disk.env), capture_output=True, text=True, timeout=120,
    )
    printed = done.stdout + done.stderr
    no_traceback(printed)
    assert done.returncode == mtplxd_client.EXIT_STATE_DIR, printed
    errors = [line for line in printed.splitlines() if "cannot write" in line]
    assert len(errors) == 1 and "daemon.json: No space left on device" in errors[0], printed
    assert not [p.name for p in disk.state_dir.iterdir() if "daemon." in p.name]  # no pid, address or temp file


def test_the_log_file_drops_records_it_cannot_write(tmp_path):
    """The daemon's log handler on a full disk: no "--- Logging error ---" traceback, a
    notice while records are lost, gone once they are written again."""
    from mtplxd.daemon import LogFile

    notices: list[str] = []
    handler = LogFile(tmp_path / "daemon.log", notices)
    record = logging.LogRecord("t", logging.INFO, __file__, 1, "hello", None, None)
    handler.emit(record)

    class Full:
        def write(self, text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        flush = close = lambda self: None

    handler.stream.close()
    handler.stream = Full()
    handler.emit(record)
    assert len(notices) == 1 and "No space left on device" in notices[0]
    handler.emit(record)  # the file is opened again: the disk has room now
    assert notices == [] and (tmp_path / "daemon.log").read_text().count("hello") == 2
    handler.close()
