"""A follower rank: load the model's slice, then run what rank 0 announces.

The follower holds the same jobs and batches as rank 0's scheduler, keyed by the
scheduler's entry ids, and runs the same code on them (mtplxd/jobs.py,
engine/batch.py), so every collective inside a sharded forward meets its peers.
Its tokens are rank 0's (engine/distributed.py decides them there); before each
step it checks that its generations hold what rank 0's hold (RowCheck) and says
so with its next answer: a follower that diverged is reported, never trusted.
It keeps its own slice of the session bank, in its own folder (world.rank_folder).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from mtplxd.ranks.channel import (
    DIVERGED, FAILED, OK, Channel, Close, Command, Hello, Join, Leave, Ping, Shutdown, Start, Step, StepBatch,
    row_check,
)
from mtplxd.ranks.world import World, init_group

log = logging.getLogger("mtplxd.follower")


class Mirror:
    """Rank 0's jobs and batches, as this rank holds them."""

    def __init__(self, engine: Any, bank: Any):
        self.engine = engine
        self.bank = bank
        self.jobs: dict[int, Any] = {}
        self.batches: dict[int, Any] = {}  # by depth, as the scheduler's
        self.batched: dict[int, Any] = {}  # entry -> its batch

    def run(self, command: Command) -> int:
        """Run one command; the verdict rank 0 gets with the next one."""
        try:
            return self._run(command)
        except Exception:
            log.exception("command %s failed", type(command).__name__)
            return FAILED

    def _run(self, command: Command) -> int:
        from engine.batch import DecodeBatch
        from mtplxd.jobs import start_job

        if isinstance(command, Start):
            self.jobs[command.entry] = start_job(command.request, self.engine, command.plan, command.seed, self.bank)
        elif isinstance(command, Step):
            job = self.jobs[command.entry]
            if command.check is not None and row_check(job.generation) != command.check:
                return DIVERGED
            job.step()
        elif isinstance(command, Join):
            job = self.jobs[command.entry]
            job.offer_prompt_snapshot()
            if command.depth == 0:
                job.generation.to_ar()
            if command.depth not in self.batches:
                self.batches[command.depth] = DecodeBatch(self.engine.backend, command.depth)
            batch = self.batches[command.depth]
            batch.join(job.generation)
            self.batched[command.entry] = batch
        elif isinstance(command, Leave):
            self.batched.pop(command.entry).leave(self.jobs[command.entry].generation)
        elif isinstance(command, StepBatch):
            batch = self.batches[command.depth]
            if tuple(row_check(row) for row in batch.rows) != command.checks:
                return DIVERGED
            batch.step()
        elif isinstance(command, Close):
            self._close(command.entry)
        return OK

    def _close(self, entry: int) -> None:
        job = self.jobs.pop(entry, None)
        batch = self.batched.pop(entry, None)
        if batch is not None and job is not None:
            batch.leave(job.generation)
        if job is not None:
            job.close()


def follow(world: World, state_dir: Any) -> int:
    """The follower's whole life: join, load, serve commands until Shutdown."""
    from mtplxd.loader import load_model
    from mtplxd.jobs import attach_bank
    from mtplxd.workspaces import open_bank

    group = init_group(world)
    channel = Channel(group)
    hello = channel.receive(OK)
    if not isinstance(hello, Hello):
        log.error("rank 0 spoke out of turn: %s", type(hello).__name__)
        return 1
    settings = replace(hello.settings, state_dir=state_dir)  # rank 0's model and settings, our own folder
    log.info("rank %d of %d: loading %s", group.rank(), group.size(), settings.model_path)
    engine = load_model(settings.model_path, group)
    bank = open_bank(settings, group.rank(), group.size())
    attach_bank(engine, bank)  # the same call rank 0's scheduler makes
    mirror = Mirror(engine, bank)
    verdict = OK
    while True:
        try:
            command = channel.receive(verdict)
        except RuntimeError as e:  # rank 0 is gone
            log.error("lost rank 0: %s", e)
            return 1
        if isinstance(command, Shutdown):
            if bank is not None:
                bank.close()
            return 0
        verdict = OK if isinstance(command, Ping) else mirror.run(command)
