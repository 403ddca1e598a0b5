"""How much of its disk the session bank may fill, asked again before every write.

The byte budget is a cap, not a promise: a disk shared with the user's own files may
have less room than the budget, and more again later. Before each write the bank asks
the disk for its free space (a probe, replaceable in tests) and writes only what
leaves `min_free` free; an entry that does not fit waits in RAM and is tried again
every `retry_s`, so the disk tier resumes on its own once space comes back. `share`
caps the bank at a part of the room it has (its own files plus the free space): the
default budget, a quarter of the free disk, measured as the disk is now, not once at
start. Never imports MLX.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# Left free for the user's own files (and the daemon's small ones): the bank writes
# nothing that would take the disk below it.
MIN_FREE_BYTES = 64 << 20
SPACE_RETRY_S = 5.0  # an entry waiting for room is tried again this often
HEADER_BYTES = 64 << 10  # a session file's header and padding, over the snapshot's bytes


def free_bytes(folder: Path) -> int | None:
    """Bytes free to this user on the disk of `folder` (or of its nearest existing
    parent); None when it cannot be told (the writes themselves will say)."""
    probe = Path(folder)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        st = os.statvfs(probe)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


@dataclass(frozen=True)
class DiskRoom:
    min_free: int = MIN_FREE_BYTES
    share: float = 1.0  # of (the bank's files + free space), the most the bank fills
    retry_s: float = SPACE_RETRY_S
    probe: Callable[[Path], int | None] = free_bytes

    def cap(self, budget: int, own: int, free: int | None) -> int:
        """The most bytes the bank's files may take now: the budget, or less under `share`."""
        if free is None:
            return budget
        return min(budget, int(self.share * (own + free)))

    def fits(self, size: int, free: int | None) -> bool:
        """Whether writing `size` bytes leaves `min_free` free (True when unknown)."""
        return free is None or free - size >= self.min_free

    def warning(self, folder: Path, free: int) -> str:
        """The /health line while entries wait for room."""
        return (f"disk almost full ({free >> 20} MiB free on the disk of {folder}, the session bank keeps "
                f"{self.min_free >> 20} MiB free): new sessions stay in RAM only until there is room, "
                f"then the bank writes them to disk")


def file_bytes(snapshot_bytes: int) -> int:
    """What writing a snapshot of `snapshot_bytes` takes on disk, about."""
    return snapshot_bytes + HEADER_BYTES
