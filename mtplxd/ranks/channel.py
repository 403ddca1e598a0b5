"""The commands rank 0 announces before each piece of engine work, and how they travel.

A command travels over the ranks' own collectives (no transport of our own): one
all-sum to which only rank 0 adds anything but zeros, carrying its length and its
first bytes (a second one carries the rest of a long command, a prompt). The same
all-sum carries every follower's verdict on the command before (0: done as told),
so a follower that diverged or failed is seen at the next command; when nothing
runs, rank 0 pings. Commands are pickled
dataclasses, and unpickled by a loader that accepts only mtplxd's and the
engine's own classes: a rank never runs code that came over the wire.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Any

OK, DIVERGED, FAILED = 0, 1, 2
INLINE = 1024  # command bytes that travel with the header (a step's command is ~200)
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
        verdicts = self._exchange(data, OK)[1]
        return {rank: verdict for rank, verdict in enumerate(verdicts) if rank > 0 and verdict != OK}

    def receive(self, verdict: int) -> Command:
        """(a follower) The next command, telling rank 0 how the last one went."""
        return _load(self._exchange(b"", verdict)[0])

    def _exchange(self, data: bytes, verdict: int) -> tuple[bytes, list[int]]:
        """One all-sum of [length (4 bytes) | a verdict byte per rank | the first INLINE
        bytes of the command]; a longer command (a long prompt) takes a second one."""
        import mlx.core as mx
        import numpy as np

        message = np.zeros(4 + self.size + INLINE, dtype=np.uint8)
        if self.rank == 0:
            message[:4] = np.frombuffer(len(data).to_bytes(4, "little"), dtype=np.uint8)
            head = np.frombuffer(data[:INLINE], dtype=np.uint8)
            message[4 + self.size : 4 + self.size + len(head)] = head
        else:
            message[4 + self.rank] = verdict
        total = np.array(mx.distributed.all_sum(mx.array(message), group=self.group))
        length = int.from_bytes(total[:4].tobytes(), "little")
        verdicts = [int(v) for v in total[4 : 4 + self.size]]
        body = total[4 + self.size : 4 + self.size + min(length, INLINE)].tobytes()
        if length > INLINE:
            rest = np.frombuffer(data[INLINE:], dtype=np.uint8) if self.rank == 0 else np.zeros(length - INLINE, np.uint8)
            body += np.array(mx.distributed.all_sum(mx.array(rest), group=self.group)).tobytes()
        return body, verdicts


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
