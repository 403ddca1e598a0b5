"""The commands rank 0 announces before each piece of engine work, and how they travel.

A command travels over the ranks' own collectives (no transport of our own): a
header, then the command's bytes, each an all-sum to which only rank 0 adds
anything but zeros. The header also carries every follower's verdict on the
command before (0: done as told), so a follower that diverged or failed is seen
at the next command; when nothing runs, rank 0 pings. Commands are pickled
dataclasses, and unpickled by a loader that accepts only mtplxd's and the
engine's own classes: a rank never runs code that came over the wire.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Any

OK, DIVERGED, FAILED = 0, 1, 2
VERDICTS = {DIVERGED: "diverged from rank 0", FAILED: "failed a step"}


@dataclass(frozen=True)
class RowCheck:
    """A generation as rank 0 holds it before a step; a follower holding another diverged."""

    committed: int  # tokens committed (prompt included)
    fed: int  # tokens in the caches
    last: int  # the last committed token


def row_check(generation: Any) -> RowCheck:
    return RowCheck(len(generation.tokens), generation.fed_count, generation.tokens[-1])


@dataclass(frozen=True)
class Hello:
    settings: Any  # rank 0's Settings: the followers load the same model the same way


@dataclass(frozen=True)
class Start:
    entry: int
    request: Any  # the scheduler's Request
    seed: int | None = None
    plan: Any = None  # DecodePlan of a text request


@dataclass(frozen=True)
class Step:
    entry: int
    check: RowCheck | None = None


@dataclass(frozen=True)
class Join:
    entry: int
    depth: int  # the batch it joins (0: plain AR; an MTP row may be demoted to it)


@dataclass(frozen=True)
class Leave:
    entry: int


@dataclass(frozen=True)
class StepBatch:
    depth: int
    checks: tuple[RowCheck, ...]  # in the batch's row order


@dataclass(frozen=True)
class Close:
    entry: int


@dataclass(frozen=True)
class Ping:
    pass


@dataclass(frozen=True)
class Shutdown:
    pass


Command = Hello | Start | Step | Join | Leave | StepBatch | Close | Ping | Shutdown


class Channel:
    """Rank 0 sends, the others receive, in lock step."""

    def __init__(self, group: Any):
        self.group = group
        self.rank, self.size = group.rank(), group.size()

    def send(self, command: Command) -> dict[int, int]:
        """(rank 0) Announce `command`; the followers' verdicts on the one before
        that were not OK, by rank."""
        data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        header = self._header(len(data), OK)
        self._payload(data, len(data))
        return {rank: verdict for rank, verdict in enumerate(header) if rank > 0 and verdict != OK}

    def receive(self, verdict: int) -> Command:
        """(a follower) The next command, telling rank 0 how the last one went."""
        length = self._header(0, verdict)[0]
        return _load(self._payload(b"", length))

    def _header(self, length: int, verdict: int) -> list[int]:
        """[the command's length, rank 1's verdict, ..., the last rank's]."""
        import mlx.core as mx
        import numpy as np

        values = [0] * self.size
        values[self.rank] = length if self.rank == 0 else verdict
        total = mx.distributed.all_sum(mx.array(values, dtype=mx.int32), group=self.group)
        return [int(v) for v in np.array(total)]

    def _payload(self, data: bytes, length: int) -> bytes:
        import mlx.core as mx
        import numpy as np

        if length == 0:
            return b""
        mine = np.frombuffer(data, dtype=np.uint8) if self.rank == 0 else np.zeros(length, dtype=np.uint8)
        total = mx.distributed.all_sum(mx.array(mine), group=self.group)
        return bytes(np.array(total, copy=False))


_ALLOWED_BUILTINS = {"frozenset", "set", "tuple", "list", "dict", "int", "float", "str", "bytes", "bool",
                     "complex", "slice", "range"}


class _Loader(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.split(".")[0] in ("mtplxd", "engine", "adapters") or module in ("pathlib", "copyreg"):
            return super().find_class(module, name)
        if module == "builtins" and name in _ALLOWED_BUILTINS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a command may not hold {module}.{name}")


def _load(data: bytes) -> Command:
    return _Loader(io.BytesIO(data)).load()
