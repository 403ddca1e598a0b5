"""THE scheduling queue: all model work passes through here.

MLX runs on one dedicated worker thread (an anyio worker thread, so it can
hand events back to the event loop); the event loop never waits on MLX.
Between two engine steps the worker picks the next job: the highest
priority class first, round-robin inside a class, so a long generation
cannot starve a short one. A cancelled job (client gone, superseded) is
closed before the next step. Admission control bounds open generations and
queued jobs; beyond the bound `submit` raises `QueueFull`.

The session bank (optional) is bound to the model on the worker thread once it
has loaded; text jobs look up and offer snapshots there, warm-up jobs
(`WarmRequest`, background class) fill it.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import anyio
import anyio.from_thread
import anyio.to_thread
from anyio.streams.memory import MemoryObjectSendStream

from engine.checkpoint import CheckpointError, read_config
from engine.profiles import (
    Calibration, CalibrationStore, DecodePlan, DecodePlanner, auto_profile, get_profile,
)
from mtplxd.calibrate import CalibrateJob, CalibrateRequest
from mtplxd.jobs import EmbedJob, TextJob, WarmJob
from mtplxd.requests import (
    EmbedRequest, Event, Failed, FailureKind, NotReady, Priority, QueueFull, SchedulerStats, State, TextRequest, Ticket,
    WarmRequest,
)

if TYPE_CHECKING:  # annotations only
    from engine.engine import Engine
    from engine.sessions.bank import SessionBank

# What the worker runs: the adapters' requests, and the daemon's own calibration.
Request = TextRequest | EmbedRequest | WarmRequest | CalibrateRequest
Job = TextJob | EmbedJob | WarmJob | CalibrateJob

log = logging.getLogger("mtplxd.scheduler")


@dataclass(frozen=True)
class SchedulerLimits:
    max_active: int = 8  # generations open at once (each holds its caches)
    interactive_reserve: int = 2  # extra slots only interactive jobs may use
    max_queued: int = 64  # jobs waiting for a slot
    default_depth: int | None = None  # forces this depth; None: the profile's measured choice
    profile: str | None = None  # engine/profiles.py; None: chosen from the model


@dataclass(eq=False)
class _Entry:
    id: int
    request: Request
    send: MemoryObjectSendStream
    submitted: float = field(default_factory=time.perf_counter)
    job: Job | None = None
    cancelled: bool = False


class Scheduler:
    def __init__(self, load_engine: Callable[[], Engine], limits: SchedulerLimits = SchedulerLimits(),
                 bank: SessionBank | None = None, calibrations: CalibrationStore | None = None):
        self._load_engine = load_engine
        self.limits = limits
        self.calibrations = calibrations  # measured depth choices per model and machine
        self.planner: DecodePlanner | None = None  # set once the model has loaded
        self.bank = bank  # bound once the model has loaded
        self.engine: Engine | None = None
        self.state: State = "loading"
        self.load_error: str | None = None
        self._cond = threading.Condition()
        self._queues: dict[Priority, deque[_Entry]] = {p: deque() for p in Priority}
        self._stopping = False
        self._ids = itertools.count(1)
        self.completed = self.cancelled = self.steps = 0
        self.on_event: Callable[[_Entry, Event], None] | None = None  # mtplxd/runtime.py's listeners

    # -- event-loop side ---------------------------------------------------------

    async def run(self) -> None:
        """Load the engine and serve jobs on the worker thread until `stop()`."""
        limiter = anyio.CapacityLimiter(1)
        await anyio.to_thread.run_sync(self._worker, limiter=limiter, abandon_on_cancel=True)

    def submit(self, request: Request) -> Ticket:
        if self.state == "failed":
            raise NotReady(f"model failed to load: {self.load_error}")
        if self.state in ("stopping", "stopped"):
            raise NotReady("the daemon is shutting down")
        send, receive = anyio.create_memory_object_stream[Event](math.inf)
        with self._cond:
            waiting = sum(1 for q in self._queues.values() for e in q if e.job is None)
            if waiting >= self.limits.max_queued:
                raise QueueFull(f"{waiting} requests already queued; retry shortly")
            entry = _Entry(next(self._ids), request, send)
            self._queues[request.priority].append(entry)
            self._cond.notify()
        return Ticket(entry.id, receive, lambda: self._cancel(entry))

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            if self.state in ("loading", "ready"):
                self.state = "stopping"
            self._cond.notify()

    def stats(self) -> SchedulerStats:
        with self._cond:
            return SchedulerStats(
                state=self.state,
                active=self._active_count(),
                queued_by_class={p.name.lower(): sum(e.job is None for e in q) for p, q in self._queues.items()},
                completed=self.completed,
                cancelled=self.cancelled,
                steps=self.steps,
            )

    def _cancel(self, entry: _Entry) -> None:
        with self._cond:
            entry.cancelled = True
            self._cond.notify()

    # -- worker thread -----------------------------------------------------------

    def _worker(self) -> None:
        try:
            self.engine = self._load_engine()
            self.planner = self._make_planner(self.engine)
            self._attach_bank()
            if self.state == "loading":
                self.state = "ready"
        except Exception as e:  # reported through /health and every submit
            self.load_error = f"{type(e).__name__}: {e}"
            self.state = "failed"
            self._fail_all(f"model failed to load: {self.load_error}", "internal")
            return
        while (entry := self._next_entry()) is not None:
            self._advance(entry)
        self.state = "stopped"
        self._fail_all("the daemon is shutting down", "shutdown")

    def _make_planner(self, engine: Any) -> DecodePlanner:
        n_heads = engine.backend.n_heads
        if self.limits.profile:
            profile = get_profile(self.limits.profile)
        else:
            profile = auto_profile(_config_of(engine))
        calibration = None
        if self.calibrations is not None and n_heads:
            try:
                calibration = self.calibrations.get(engine.path)
            except OSError as e:  # unreadable weights or state dir: decode with the defaults
                log.warning("calibration not read: %s", e)
        return DecodePlanner(profile, n_heads, calibration, self.limits.default_depth)

    def set_calibration(self, calibration: Calibration) -> None:
        """A fresh measurement (the background calibration job): later requests use it."""
        if self.planner is not None:
            self.planner.calibration = calibration

    def plan(self, request: TextRequest) -> DecodePlan:
        """How `request` will decode (raises ValueError for an unknown profile)."""
        if self.planner is None:
            raise NotReady("the model has not loaded")
        return self.planner.plan(request.sampler.temperature, request.profile, request.mode, request.depth)

    def _attach_bank(self) -> None:
        """Bind the session bank to the loaded model (fingerprint, layout, disk tier)."""
        if self.bank is None:
            return
        try:
            from engine.sessions.arrays import describe

            key = describe(self.engine)
            if key is None:
                log.info("session bank off: this model's caches cannot be snapshotted")
                return
            self.bank.attach(key)
        except Exception as e:  # a model without the usual engine surface, a broken disk: run without
            log.warning("session bank off: %s: %s", type(e).__name__, e)

    def _next_entry(self) -> _Entry | None:
        """Block until there is a job to step; None once stopping."""
        while True:
            with self._cond:
                closing = self._drop_cancelled()
                if not closing:
                    if self._stopping:
                        return None
                    entry = self._pick()
                    if entry is not None:
                        return entry
                    self._cond.wait()
                    continue
            for job in closing:  # outside the lock: closing offers a snapshot to the bank
                job.close()

    def _pick(self) -> _Entry | None:
        """Class order, round-robin inside a class; a new job needs a free slot."""
        for priority, queue in self._queues.items():
            for _ in range(len(queue)):
                entry = queue.popleft()
                queue.append(entry)  # rotate: the next pick in this class starts after it
                if entry.job is not None or self._has_slot(priority):
                    return entry
        return None

    def _has_slot(self, priority: Priority) -> bool:
        limit = self.limits.max_active
        if priority == Priority.INTERACTIVE:
            limit += self.limits.interactive_reserve
        return self._active_count() < limit

    def _active_count(self) -> int:
        return sum(e.job is not None for q in self._queues.values() for e in q)

    def _drop_cancelled(self) -> list:
        """Unqueue cancelled entries; returns their jobs for the caller to close."""
        jobs = []
        for queue in self._queues.values():
            for entry in [e for e in queue if e.cancelled]:
                queue.remove(entry)
                if entry.job is not None:
                    jobs.append(entry.job)
                self.cancelled += 1
        return jobs

    def _advance(self, entry: _Entry) -> None:
        """One engine step of one job, outside the lock."""
        try:
            if entry.job is None:
                entry.job = self._start(entry.request)
            events = entry.job.step()
        except ValueError as e:
            events = [Failed(str(e), "invalid")]
        except Exception as e:  # never let one request kill the worker
            events = [Failed(f"{type(e).__name__}: {e}", "internal")]
        self.steps += 1
        finished = (entry.job is not None and entry.job.finished) or any(isinstance(e, Failed) for e in events)
        for event in events:
            self._deliver(entry, event)
        if finished:
            self._finish(entry)

    def _start(self, request: Request) -> Job:
        engine = self.engine
        if engine is None:
            raise NotReady("the model has not loaded")
        if isinstance(request, EmbedRequest):
            return EmbedJob(request, engine)
        if isinstance(request, WarmRequest):
            return WarmJob(request, engine, self.bank)
        if isinstance(request, CalibrateRequest):
            return CalibrateJob(request, engine)
        seed = request.seed if request.seed is not None else random.getrandbits(31)
        return TextJob(request, engine, self.plan(request), seed, self.bank)

    def _deliver(self, entry: _Entry, event: Event) -> None:
        if self.on_event is not None:
            self.on_event(entry, event)
        try:
            anyio.from_thread.run_sync(entry.send.send_nowait, event)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            entry.cancelled = True  # the client is gone: free the engine next pick
        except RuntimeError:
            pass  # event loop already closed (shutdown)

    def _finish(self, entry: _Entry) -> None:
        with self._cond:
            for queue in self._queues.values():
                if entry in queue:
                    queue.remove(entry)
        if entry.job is not None:
            entry.job.close()
        self.completed += 1
        self._close_stream(entry)

    def _close_stream(self, entry: _Entry) -> None:
        try:
            anyio.from_thread.run_sync(entry.send.close)
        except RuntimeError:
            pass

    def _fail_all(self, message: str, kind: FailureKind) -> None:
        """End every job with a final error event (never while holding the lock:
        delivering waits on the event loop, which may be waiting on the lock)."""
        with self._cond:
            entries = [e for q in self._queues.values() for e in q]
            for queue in self._queues.values():
                queue.clear()
        for entry in entries:
            if entry.job is not None:
                entry.job.close()
            self._deliver(entry, Failed(message, kind))
            self._close_stream(entry)


def _config_of(engine: Any) -> dict:
    try:
        return read_config(engine.path)
    except (AttributeError, TypeError, CheckpointError):  # a test double without a folder
        return {}
