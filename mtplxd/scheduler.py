"""THE scheduling queue: all model work passes through here.

MLX runs on one dedicated worker thread (an anyio worker thread, so it can
hand events back to the event loop); the event loop never waits on MLX.
Between two engine steps the worker picks the class the next pass serves
(mtplxd/shares.py: the highest class with work, unless a lower one has been
passed over its patience's worth of passes in a row), then the next job of
that class, round-robin inside it, so a long generation cannot starve a short
one. A cancelled job (client gone, superseded) is closed before the next step.
Admission control bounds open generations, the bytes of cache they hold, and
queued jobs; beyond the queue's bound `submit` raises `QueueFull`.

Continuous batching (engine/batch.py). Once two or more text generations are
decoding, they decode together: each pass of the worker runs one batched step
for all of them (one token a row) and then one step of the next job outside the
batch (a prefill chunk, a lone MTP cycle, an embedding), picked as above. So a
new request's prefill runs in chunks between the batch's steps, a generation
joins the batch as soon as its first token is out (at the next step boundary),
and a finished or cancelled one leaves at once. A generation that is alone
decodes alone, with MTP. Editors' completions (the interactive class) decode in
the same batch as everyone else: a row more costs a batched step far less than a
step of its own, so a storm of editors no longer takes the engine from the chats
(their shares of separate steps could only add up to one). Interactive work still
goes first: its prefill runs on the next pass, without waiting for a batch that
holds none of its rows, so a keystroke's completion waits for at most the batched
step already running, then rides in the batch. What runs outside the batch (new
jobs' prefills, lone decodes) is shared by class: the highest first, and a class
passed over its patience's worth of passes in a row goes next (mtplxd/shares.py).

The session bank (optional) is bound to the model on the worker thread once it
has loaded; text jobs look up and offer snapshots there, warm-up jobs
(`WarmRequest`, background class) fill it.
"""

from __future__ import annotations

import asyncio
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

from engine.batch import DecodeBatch, batchable, depth_of
from engine.calibration_store import CalibrationStore
from engine.checkpoint import CheckpointError, read_config
from engine.generation import Generation
from engine.profiles import Calibration, DecodePlan, DecodePlanner, auto_profile, get_profile
from mtplxd.calibrate import CalibrateJob, CalibrateRequest
from mtplxd.jobs import EmbedJob, TextJob, WarmJob, attach_bank, start_job
from mtplxd.ranks.channel import Close, Join, Leave, Start, Step, StepBatch, row_check
from mtplxd.ranks.leader import PING_S, Leader, RanksFailed
from mtplxd.shares import Shares
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
    batch_rows: int = 16  # decoding generations that share a forward pass (1: none do)
    max_cache_bytes: int | None = None  # KV held by open generations before new ones wait
    # Passes a class with work may be passed over in a row before it is due (mtplxd/shares.py);
    # the interactive class is never passed over twice in a row.
    patience_normal: int = 3
    patience_background: int = 8

    def patience(self) -> dict[Priority, int]:
        return {Priority.INTERACTIVE: 1, Priority.NORMAL: self.patience_normal,
                Priority.BACKGROUND: self.patience_background}


@dataclass(eq=False)
class _Entry:
    id: int
    request: Request
    send: MemoryObjectSendStream
    submitted: float = field(default_factory=time.perf_counter)
    job: Job | None = None
    cancelled: bool = False
    priority: Priority = Priority.NORMAL  # its class: the request's, unless raised since

    def __post_init__(self) -> None:
        self.priority = self.request.priority


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
        self.shares = Shares(limits.patience())  # which class each pass serves
        self._stopping = False
        self._ids = itertools.count(1)
        self.completed = self.cancelled = self.steps = 0
        self.batching = False  # set once the model has loaded, when batching is on
        self._batches: dict[int, DecodeBatch] = {}  # by MTP depth (0: plain AR)
        self._batched: dict[_Entry, DecodeBatch] = {}  # each batched entry's batch
        self.on_event: Callable[[_Entry, Event], None] | None = None  # mtplxd/runtime.py's listeners
        self._loop: asyncio.AbstractEventLoop | None = None  # the event loop the streams live on
        self.ranks: Leader | None = None  # several ranks (mtplxd/ranks/): set by the model load

    # -- event-loop side ---------------------------------------------------------

    async def run(self) -> None:
        """Load the engine and serve jobs on the worker thread until `stop()`."""
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:  # another anyio backend: hand events over the blocking way
            self._loop = None
        limiter = anyio.CapacityLimiter(1)
        try:
            await anyio.to_thread.run_sync(self._worker, limiter=limiter, abandon_on_cancel=True)
        finally:  # cancelled (shutdown, a failed caller): the abandoned worker must not wait for ever
            self.stop()

    def submit(self, request: Request) -> Ticket:
        if self.state == "failed":
            raise NotReady(self.failure_message())
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
        return Ticket(entry.id, receive, lambda: self._cancel(entry), lambda p: self._raise(entry, p))

    def failure_message(self) -> str:
        if self.ranks is not None and self.ranks.failure is not None:
            return f"the model's ranks are out of service ({self.ranks.failure}); restart the daemon"
        return f"the model failed to load: {self.load_error}"

    def abandon(self, reason: str) -> None:
        """(event loop) The ranks stopped answering while the worker waits on them: end
        every request now, refuse new ones; the worker's jobs are left as they are."""
        with self._cond:
            self.state, self.load_error = "failed", reason
            entries = [e for q in self._queues.values() for e in q]
            for queue in self._queues.values():
                queue.clear()
            self._batched.clear()
        for entry in entries:
            self._deliver(entry, Failed(self.failure_message(), "internal"))
            self._close_stream(entry)

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

    def entries(self) -> list[tuple[int, str, Request, float, bool]]:
        """Every queued or running job: (id, its class, its request, when submitted
        (perf_counter), started), for the runtime's read-only view."""
        with self._cond:
            return [(e.id, p.name.lower(), e.request, e.submitted, e.job is not None)
                    for p, q in self._queues.items() for e in q]

    def _cancel(self, entry: _Entry) -> None:
        with self._cond:
            entry.cancelled = True
            self._cond.notify()

    def _raise(self, entry: _Entry, priority: Priority) -> None:
        """Move a queued or running entry to a higher class (a batched row stays in the
        batch, which now steps on that class's passes too)."""
        with self._cond:
            queue = self._queues[entry.priority]
            if priority >= entry.priority or entry not in queue:
                return
            queue.remove(entry)
            self._queues[priority].append(entry)
            entry.priority = priority
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
        self.batching = self.limits.batch_rows > 1 and hasattr(self.engine, "backend")
        self._serve()
        if self.state == "failed":  # the ranks failed: nothing more runs on them
            return
        self.state = "stopped"
        self._fail_all("the daemon is shutting down", "shutdown")
        if self.ranks is not None:
            self.ranks.shutdown()

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
        if self.engine is not None:
            attach_bank(self.engine, self.bank)

    def _serve(self) -> None:
        """Until stopping: the batch's step, then one step of the next job outside it."""
        while True:
            if self.ranks is not None and self.ranks.failure is not None:
                self._ranks_failed()
                return
            with self._cond:
                closing = self._drop_cancelled()
                turn = None
                if not closing:
                    if self._stopping:
                        return
                    turn = self._turn()
                    if turn is None:
                        self._cond.wait(None if self.ranks is None else PING_S)
            if not closing and turn is None:
                if self.ranks is not None:
                    self.ranks.idle()  # outside the lock: a ping is a collective
                continue
            try:
                self._serve_once(closing, turn)
            except RanksFailed:  # reported at the top of the loop
                pass

    def _serve_once(self, closing: list[_Entry], turn: tuple[Priority, _Entry | None] | None) -> None:
        """One pass: the batch's step (skipped on an interactive pass while the batch
        holds no interactive row: a new editor's prefill goes first), then one step of
        the turn's job. A pass that closes entries has no class: the batch steps."""
        for closed in closing:  # outside the lock: closing offers a snapshot to the bank
            self._close(closed)
        priority, entry = turn if turn is not None else (None, None)
        # An editor's prefill does not wait for a batch that holds no editor's row.
        if self._batched and (priority != Priority.INTERACTIVE
                              or any(e.priority == Priority.INTERACTIVE for e in self._batched)):
            self._step_batches()
        if entry is not None:
            self._advance(entry)
            self._batch_decoding()

    def _ranks_failed(self) -> None:
        """The ranks are out of step: end every request with the reason, run nothing more."""
        self.state = "failed"
        self.load_error = self.ranks.failure if self.ranks is not None else None
        self._fail_all(self.failure_message(), "internal")

    def _turn(self) -> tuple[Priority, _Entry | None] | None:
        """(under the lock) The class this pass serves and its job to step (None: only
        the batch's rows); None when nothing can run. A class is ready when a job of it
        can step (started, or new with a free slot) or the batch holds rows of it; a
        class whose only work is new jobs without a slot waits, and once due it claims
        the next free slot: no higher class starts a new job before it."""
        running = {e.priority for e in self._batched}
        running |= {p for p, q in self._queues.items() if any(e.job is not None and e not in self._batched for e in q)}
        new = {p for p, q in self._queues.items() if any(e.job is None for e in q)}
        claim = self.shares.claims(new)
        startable = {p for p in new if self._has_slot(p, claim)}
        priority = self.shares.choose(running | startable)
        entry = self._pick(priority, starts=priority in startable) if priority is not None else None
        self.shares.started(new, priority if entry is not None and entry.job is None else None)
        return (priority, entry) if priority is not None else None

    def _pick(self, priority: Priority, starts: bool) -> _Entry | None:
        """Round-robin inside the class, the batch's rows aside; a new job only where
        `starts` (a free slot, not claimed by a lower class)."""
        queue = self._queues[priority]
        for _ in range(len(queue)):
            entry = queue.popleft()
            queue.append(entry)  # rotate: the next pick in this class starts after it
            if entry in self._batched:
                continue
            if entry.job is not None or starts:
                return entry
        return None

    def _has_slot(self, priority: Priority, claim: Priority | None = None) -> bool:
        """Whether a new job of this class may start: `max_active` slots for every class,
        and `interactive_reserve` more that interactive jobs fill first (so editors do not
        take the chats' slots). While a lower class claims the next slot (mtplxd/shares.py),
        a higher class starts nothing that would take it: interactive jobs only within
        their reserve, normal jobs not at all."""
        active, reserve = self._active_count(), self.limits.interactive_reserve
        interactive = sum(e.job is not None for e in self._queues[Priority.INTERACTIVE])
        claimed = claim is not None and claim > priority
        if priority == Priority.INTERACTIVE:
            if active >= self.limits.max_active + reserve or (claimed and interactive >= reserve):
                return False
        elif claimed or active - min(interactive, reserve) >= self.limits.max_active:
            return False
        budget = self.limits.max_cache_bytes
        return budget is None or active == 0 or self._cache_bytes() < budget

    def _cache_bytes(self) -> int:
        """KV and recurrent state held by open generations (the batch's padding included)."""
        held = sum(batch.nbytes for batch in self._batches.values())
        for queue in self._queues.values():
            for entry in queue:
                generation = getattr(entry.job, "generation", None)
                if isinstance(generation, Generation) and entry not in self._batched:
                    held += sum(getattr(c, "nbytes", 0) for c in generation.cache)
        return held

    # -- the batch ---------------------------------------------------------------

    def _batch_decoding(self) -> None:
        """Move decoding text generations, of every class, into a batch (one per MTP depth) once two or
        more decode; a lone row leaves (alone, a generation decodes faster outside).
        Where the calibration measured plain AR faster than MTP at this many rows,
        MTP rows decode plainly from now on (engine/profiles.py's batch_depth)."""
        if not self.batching:
            return
        with self._cond:
            ready = [e for q in self._queues.values() for e in q if e not in self._batched and not e.cancelled
                     and _decoding(e)]
        rows = len(self._batched) + len(ready)
        if rows >= 2:
            for entry in ready[: max(0, self.limits.batch_rows - len(self._batched))]:
                _text_job(entry).offer_prompt_snapshot()  # while it still holds its own caches
                self._join(entry, rows)
            for entry, batch in list(self._batched.items()):
                if batch.depth and self._batch_depth(rows, batch.depth) == 0:
                    self._unbatch(entry)  # the batch grew past where MTP pays
                    self._join(entry, rows)
        elif len(self._batched) == 1 and not ready:
            self._unbatch(next(iter(self._batched)))

    def _batch_depth(self, rows: int, depth: int) -> int:
        return self.planner.batch_depth(rows, depth) if self.planner is not None else depth

    def _join(self, entry: _Entry, rows: int) -> None:
        generation = _text_job(entry).generation
        if self._batch_depth(rows, depth_of(generation)) == 0:
            generation.to_ar()  # exact either way: the trunk's caches are the same
        depth = depth_of(generation)
        self._announce(Join(entry.id, depth))
        if depth not in self._batches:
            self._batches[depth] = DecodeBatch(generation.backend, depth)
        self._batches[depth].join(generation)
        self._batched[entry] = self._batches[depth]

    def _unbatch(self, entry: _Entry) -> None:
        batch = self._batched.pop(entry, None)
        if batch is not None:
            self._tell(Leave(entry.id))
            batch.leave(_text_job(entry).generation)

    def _step_batches(self) -> None:
        for batch in list(self._batches.values()):
            if len(batch):
                self._step_batch(batch)

    def _step_batch(self, batch: DecodeBatch) -> None:
        """One step for every row of the batch; rows that end leave it at once."""
        by_row = {id(_text_job(e).generation): e for e, b in self._batched.items() if b is batch}
        entries = [by_row[id(row)] for row in batch.rows]  # in the batch's row order
        try:
            if self.ranks is not None:
                self.ranks.announce(StepBatch(batch.depth, tuple(row_check(row) for row in batch.rows)))
            results = batch.step()
        except Exception as e:  # the batch's caches may be half-updated: end every row
            log.exception("batched step failed")
            if self.ranks is not None and not isinstance(e, RanksFailed):
                self.ranks.fail(f"a batched step failed on rank 0: {type(e).__name__}: {e}")
            for entry in entries:
                _text_job(entry).broken()
                self._unbatch(entry)
                self._deliver(entry, Failed(f"{type(e).__name__}: {e}", "internal"))
                self._finish(entry)
            return
        self.steps += 1
        deliveries = [(entry, event) for entry, result in zip(entries, results)
                      for event in _text_job(entry).events(result, batch=len(entries))]
        self._deliver_all(deliveries)
        for entry in entries:
            if _text_job(entry).finished:
                self._unbatch(entry)
                self._finish(entry)

    def _close(self, entry: _Entry) -> None:
        """Close an entry's job (out of the batch first: it closes with its own caches)."""
        self._unbatch(entry)
        self._tell(Close(entry.id))
        assert entry.job is not None
        entry.job.close()

    def _active_count(self) -> int:
        return sum(e.job is not None for q in self._queues.values() for e in q)

    def _drop_cancelled(self) -> list[_Entry]:
        """Unqueue cancelled entries; returns those with a job, for the caller to close."""
        started = []
        for queue in self._queues.values():
            for entry in [e for e in queue if e.cancelled]:
                queue.remove(entry)
                if entry.job is not None:
                    started.append(entry)
                self.cancelled += 1
        return started

    def _advance(self, entry: _Entry) -> None:
        """One engine step of one job, outside the lock."""
        try:
            if entry.job is None:
                entry.job = self._start(entry)
                if isinstance(entry.job, TextJob):
                    entry.job.queue_wait_s = time.perf_counter() - entry.submitted
            if self.ranks is not None:
                generation = getattr(entry.job, "generation", None)
                check = row_check(generation) if isinstance(generation, Generation) else None
                self.ranks.announce(Step(entry.id, check))
            events = entry.job.step()
        except ValueError as e:
            events = [Failed(str(e), "invalid")]
        except RanksFailed as e:
            events = [Failed(str(e), "internal")]
        except Exception as e:  # never let one request kill the worker
            events = [Failed(f"{type(e).__name__}: {e}", "internal")]
            if self.ranks is not None:  # the ranks may now be out of step: trust them no more
                self.ranks.fail(f"a step failed on rank 0: {type(e).__name__}: {e}")
        self.steps += 1
        finished = (entry.job is not None and entry.job.finished) or any(isinstance(e, Failed) for e in events)
        for event in events:
            self._deliver(entry, event)
        if finished:
            self._finish(entry)

    def _start(self, entry: _Entry) -> Job:
        engine, request = self.engine, entry.request
        if engine is None:
            raise NotReady("the model has not loaded")
        seed, plan = None, None
        if isinstance(request, TextRequest):
            seed = request.seed if request.seed is not None else random.getrandbits(31)
            plan = self.plan(request)
        self._announce(Start(entry.id, request, seed, plan))
        return start_job(request, engine, plan, seed, self.bank)

    def _announce(self, command: Any) -> None:
        """Several ranks: tell the followers the engine work about to run (mtplxd/ranks/)."""
        if self.ranks is not None:
            self.ranks.announce(command)

    def _tell(self, command: Close | Leave) -> None:
        if self.ranks is not None:
            self.ranks.tell(command)

    def _deliver(self, entry: _Entry, event: Event) -> None:
        self._deliver_all([(entry, event)])

    def _deliver_all(self, deliveries: list[tuple[_Entry, Event]]) -> None:
        """Hand events to their streams in one trip to the event loop (a batched step
        has one event per row or more)."""
        if self.on_event is not None:
            for entry, event in deliveries:
                self.on_event(entry, event)

        def send() -> None:
            for entry, event in deliveries:
                try:
                    entry.send.send_nowait(event)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    entry.cancelled = True  # the client is gone: free the engine next pick

        self._in_loop(send)

    def _in_loop(self, call: Callable[[], None]) -> None:
        """Run `call` on the event loop, in order with the calls before it. The worker
        does not wait for it: the next step need not wait for the streams' writes."""
        try:
            if self._loop is not None:
                self._loop.call_soon_threadsafe(call)
            else:
                anyio.from_thread.run_sync(call)
        except RuntimeError:
            pass  # event loop already closed (shutdown)

    def _finish(self, entry: _Entry) -> None:
        with self._cond:
            for queue in self._queues.values():
                if entry in queue:
                    queue.remove(entry)
        if entry.job is not None:
            self._close(entry)
        self.completed += 1
        self._close_stream(entry)

    def _close_stream(self, entry: _Entry) -> None:
        self._in_loop(entry.send.close)

    def _fail_all(self, message: str, kind: FailureKind) -> None:
        """End every job with a final error event (never while holding the lock:
        delivering waits on the event loop, which may be waiting on the lock)."""
        with self._cond:
            entries = [e for q in self._queues.values() for e in q]
            for queue in self._queues.values():
                queue.clear()
        for entry in entries:
            if entry.job is not None:
                self._close(entry)
            self._deliver(entry, Failed(message, kind))
            self._close_stream(entry)


def _text_job(entry: _Entry) -> TextJob:
    """The text job of a batched entry (only text jobs join the batch)."""
    assert isinstance(entry.job, TextJob)
    return entry.job


def _decoding(entry: _Entry) -> bool:
    """A text job between two decode steps, with caches a batch can hold."""
    generation = getattr(entry.job, "generation", None)
    return (isinstance(entry.job, TextJob) and not entry.job.finished and isinstance(generation, Generation)
            and batchable(generation))


def _config_of(engine: Any) -> dict:
    try:
        return read_config(engine.path)
    except (AttributeError, TypeError, CheckpointError):  # a test double without a folder
        return {}
