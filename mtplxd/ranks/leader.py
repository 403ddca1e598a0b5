"""Rank 0's side: announce each piece of engine work, and notice a rank that is gone.

The scheduler's worker calls `announce` before it runs engine work and `idle` when it
has none (every PING_S an idle worker pings, so a rank that died while nothing ran is
noticed too). A lost rank breaks the next collective at once (the ring backend
raises); a rank that hangs leaves it waiting, so the event loop's `watch` calls a
collective that has not returned within the timeout a failure. Either way the ranks
are out of service: open requests end with the reason, new ones get 503, rank 0
stays up to say so on /health, and `mtplxd stop` ends every rank.
"""

from __future__ import annotations

import logging
import subprocess
import time

from typing import Any

from mtplxd.ranks.channel import VERDICTS, Channel, Command, Hello, Ping, Shutdown
from mtplxd.ranks.world import World, init_group

log = logging.getLogger("mtplxd.ranks")

PING_S = 1.0


def lead(settings: Any, world: World, followers: list[subprocess.Popen]) -> tuple[Any, Leader]:
    """(rank 0's worker) Meet the other ranks, tell them the settings, load our slice."""
    from mtplxd.loader import load_model

    group = init_group(world)
    leader = Leader(Channel(group), settings.rank_timeout_s, followers)
    leader.announce(Hello(settings))
    engine = load_model(settings.model_path, group)
    leader.idle()  # the load is not a hung collective
    leader.sharding = engine.sharding
    log.info("rank 0 of %d: %s", group.size(), engine.sharding)
    return engine, leader


def launcher_note(leader: Leader | None) -> str:
    """Why a signal may have come, for rank 0 of ranks mlx.launch started (`leader` None while
    the ranks still meet): the launcher stops every rank with SIGTERM when one of them exits,
    and rank 0 cannot see the others' processes to tell which."""
    who = f"rank 0 of {leader.size}" if leader is not None else "rank 0"
    known = f" (the ranks had already failed: {leader.failure})" if leader is not None and leader.failure else ""
    return (f"{who} under mlx.launch{known}: the launcher also stops every rank this way when one of them "
            "exits, so unless mtplxd was asked to stop, another rank failed (the launcher's output and that "
            "rank's log say which)")


class RanksFailed(Exception):
    """The ranks are no longer in step; str(e) says why."""


class Leader:
    def __init__(self, channel: Channel, timeout_s: float, followers: list[subprocess.Popen] | None = None):
        self.channel = channel
        self.size = channel.size
        self.timeout_s = timeout_s
        self.followers = followers or []  # ranks started here (mtplxd start --ranks N)
        self.failure: str | None = None
        self.sharding = ""  # how the model is split, in words (engine/distributed.py)
        self._busy_since: float | None = None  # an announced piece of work has not ended
        self._last_contact = time.monotonic()

    def announce(self, command: Command) -> None:
        """Tell every rank what to run next; raises RanksFailed when they cannot follow."""
        if self.failure is not None:
            raise RanksFailed(self.failure)
        self._busy_since = time.monotonic()
        try:
            bad = self.channel.send(command)
        except RuntimeError as e:  # the ring backend lost a peer
            raise RanksFailed(self.fail(f"lost contact with the other ranks ({e})")) from None
        self._last_contact = time.monotonic()
        if bad:
            reason = "; ".join(f"rank {rank} {VERDICTS.get(v, 'failed')}" for rank, v in sorted(bad.items()))
            raise RanksFailed(self.fail(reason))

    def tell(self, command: Command) -> None:
        """Announce housekeeping that needs no answer once the ranks have failed."""
        try:
            self.announce(command)
        except RanksFailed:
            pass

    def idle(self) -> None:
        """The worker has nothing to run; ping now and then."""
        if time.monotonic() - self._last_contact >= PING_S:
            self.tell(Ping())
        self._busy_since = None

    def watch(self) -> str | None:
        """(event loop) A failure the worker cannot report itself: a rank started here
        exited, or a collective hangs. Returns it once, when it is new."""
        if self.failure is not None:
            return None
        for rank, process in enumerate(self.followers, start=1):
            if process.poll() is not None:
                return self.fail(f"rank {rank} exited (status {process.returncode})")
        busy = self._busy_since
        if busy is not None and time.monotonic() - busy > self.timeout_s:
            return self.fail(f"the other ranks did not answer for {self.timeout_s:g} s")
        return None

    def fail(self, reason: str) -> str:
        if self.failure is None:
            self.failure = reason
            log.error("ranks out of service: %s", reason)
        return self.failure

    def describe(self) -> list[dict]:
        """Each rank and its state, for /health and `mtplxd status`."""
        ranks = [{"rank": 0, "state": "ok", "role": "daemon"}]
        for rank in range(1, self.size):
            state = "ok" if self.failure is None else "out of service"
            if rank <= len(self.followers) and self.followers[rank - 1].poll() is not None:
                state = "exited"
            ranks.append({"rank": rank, "state": state, "role": "follower"})
        return ranks

    def shutdown(self) -> None:
        """(worker, at the end) Send the followers home."""
        self.tell(Shutdown())


