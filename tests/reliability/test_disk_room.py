"""The session bank's disk tier on a disk that fills up and empties while the bank runs
(engine/sessions/room.py): it writes what fits, keeping a margin free; what does not fit
waits in RAM with a warning; once space returns every waiting entry reaches the disk on
its own, and after a restart each one reads back bit for bit.

Two disks, the same steps: a real 16 MiB tmpfs where this machine allows mounting
(Linux, root; else the test skips and says why), and a simulated one through the bank's
free-space probe (always runs): a folder whose "free space" is its size less the files
in it and a filler count.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Protocol

import numpy as np
import pytest

from engine.sessions.bank import SessionBank
from engine.sessions.room import DiskRoom, free_bytes
from engine.sessions.state import LayerState, Layout, ModelKey, Snapshot, Tensor

MiB = 1 << 20
DISK_BYTES = 16 * MiB
MARGIN = 4 * MiB
H, D, N = 2, 256, 256  # one KV layer of 256 tokens: 1 MiB a snapshot
LAYOUT = Layout(kinds=("kv",), shapes=(((H, D, "float32"), (H, D, "float32")),), heads=(), hidden=None,
                vocab=(1000, "float32"))
MODEL = ModelKey("ab" * 32, LAYOUT)


class Disk(Protocol):
    folder: Path  # the bank's root, on this disk
    probe: Callable[[Path], int | None]

    def fill(self, leave: int) -> None: ...

    def empty(self) -> None: ...


class Tmpfs:
    """A real tmpfs; filled with a file."""

    def __init__(self, root: Path):
        self.root, self.folder, self.probe = root, root / "sessions", free_bytes
        self._filler = root / "filler"

    def fill(self, leave: int) -> None:
        self.empty()
        with open(self._filler, "wb") as f:
            while (free := free_bytes(self.root) or 0) > leave:
                try:
                    f.write(bytes(max(4096, min(MiB, free - leave))))
                    f.flush()
                except OSError as e:
                    assert e.errno == errno.ENOSPC
                    break

    def empty(self) -> None:
        self._filler.unlink(missing_ok=True)


class ProbedDisk:
    """A folder the probe says is DISK_BYTES big: free is that less its files and the filler."""

    def __init__(self, root: Path):
        self.folder, self._filled = root / "sessions", 0

    def probe(self, _: Path) -> int:
        used = sum(p.stat().st_size for p in self.folder.rglob("*") if p.is_file())
        return DISK_BYTES - used - self._filled

    def fill(self, leave: int) -> None:
        self._filled = 0
        self._filled = self.probe(self.folder) - leave

    def empty(self) -> None:
        self._filled = 0


def mount_tmpfs(root: Path) -> str | None:
    """Mount a DISK_BYTES tmpfs on `root`; None, or why not."""
    if not sys.platform.startswith("linux"):
        return f"tmpfs is Linux's ({sys.platform} here)"
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    if shutil.which("mount") is None:
        return "no mount command"
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES},mode=0700", "tmpfs", str(root)],
                          capture_output=True, text=True)
    return None if done.returncode == 0 else f"mount refused: {done.stderr.strip()}"


@pytest.fixture
def tmpfs(tmp_path) -> Iterator[Tmpfs]:
    root = tmp_path / "disk"
    root.mkdir()
    why = mount_tmpfs(root)
    if why is not None:
        pytest.skip(f"no real tmpfs on this machine ({why}); test_disk_through_the_probe covers the same steps")
    try:
        yield Tmpfs(root)
    finally:
        if subprocess.run(["umount", str(root)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(root)], capture_output=True)


def snapshot(seed: int) -> Snapshot:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 1000, N).astype(np.int32)
    tokens[0] = seed  # no entry is a prefix of another
    kv = [Tensor(rng.standard_normal((1, H, N, D)).astype(np.float32), "float32") for _ in range(2)]
    for t in kv:
        t.data.setflags(write=False)
    tokens.setflags(write=False)
    return Snapshot(tokens=tokens, layers=[LayerState("kv", list(kv))])


def open_bank(disk: Disk) -> SessionBank:
    room = DiskRoom(min_free=MARGIN, retry_s=0.2, probe=disk.probe)
    bank = SessionBank(disk.folder, ram_bytes=64 * MiB, disk_bytes=64 * MiB, write_delay_s=0, room=room)
    bank.attach(MODEL)
    return bank


def wait_until(check: Callable[[], object], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def served_exactly(bank: SessionBank, seeds: list[int], tier: str | None = None) -> None:
    """Every entry served, its arrays equal to those added."""
    for seed in seeds:
        want = snapshot(seed)
        got = bank.lookup("", want.tokens)
        assert got is not None and got.length == N - 1, seed  # without logits the last token is fed again
        assert tier is None or got.tier == tier, (seed, got.tier)
        for a, b in zip(want.tensors(), got.snapshot.tensors()):
            assert np.array_equal(a.data, b.data), seed


def fill_empty_and_restart(disk: Disk) -> None:
    bank = open_bank(disk)
    try:
        for seed in (1, 2):
            assert bank.add("", snapshot(seed))
        wait_until(lambda: bank.stats().disk_entries == 2, "the first writes")
        assert bank.disk_warning is None

        # Room for two more files above the margin: they are written, the third waits.
        disk.fill(leave=MARGIN + 2 * MiB + MiB // 2)
        for seed in (3, 4, 5):
            assert bank.add("", snapshot(seed))
        wait_until(lambda: bank.stats().waiting_writes == 1, "an entry waiting for room")
        stats = bank.stats()
        assert stats.disk_entries == 4 and stats.pending_writes == 0, stats
        assert bank.disk_warning is not None and "RAM only" in bank.disk_warning
        served_exactly(bank, [1, 2, 3, 4, 5])  # waiting costs nothing but the disk

        disk.fill(leave=MiB)  # under the margin: nothing new is written
        assert bank.add("", snapshot(6))
        wait_until(lambda: bank.stats().waiting_writes == 2, "two entries waiting")
        assert bank.flush(timeout=5)  # a flush does not wait for room
        assert bank.stats().disk_entries == 4

        disk.empty()  # space returns: the waiting entries reach the disk without a new request
        wait_until(lambda: bank.stats().disk_entries == 6 and bank.stats().waiting_writes == 0,
                   "the waiting entries to reach the disk")
        wait_until(lambda: bank.disk_warning is None, "the warning to clear")
        assert bank.add("", snapshot(7)) and bank.flush(timeout=5)
        assert bank.stats().disk_entries == 7 and bank.stats().bad_files == 0
    finally:
        assert bank.close(timeout=10)

    again = open_bank(disk)  # a restart: everything is on disk, bit for bit
    try:
        assert again.stats().disk_entries == 7
        served_exactly(again, [1, 2, 3, 4, 5, 6, 7], tier="disk")
        assert again.stats().bad_files == 0 and not list(disk.folder.rglob("*.bad"))
    finally:
        again.close(timeout=10)


def test_disk_on_a_real_tmpfs(tmpfs):
    fill_empty_and_restart(tmpfs)


def test_disk_through_the_probe(tmp_path):
    fill_empty_and_restart(ProbedDisk(tmp_path))


def test_a_full_disk_at_start_warns_and_clears_once_space_returns(tmp_path):
    disk = ProbedDisk(tmp_path)
    disk.folder.mkdir()
    disk.fill(leave=MiB)
    bank = open_bank(disk)
    try:
        assert bank.disk_warning is not None and "RAM only" in bank.disk_warning
        assert bank.folder is not None  # the disk tier is open, only waiting
        disk.empty()
        wait_until(lambda: bank.disk_warning is None, "the warning to clear with no entry written")
        assert bank.add("", snapshot(1)) and bank.flush(timeout=5) and bank.stats().disk_entries == 1
    finally:
        bank.close(timeout=10)
