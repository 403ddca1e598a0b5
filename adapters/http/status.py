"""The daemon's live status: one JSON document, once or as a stream (the page reads it).

    GET /v1/status          the document now, with `history` (the last minutes)
    GET /v1/status/stream   SSE: the same document every second (`event: status`); the
                            first carries `history`, each later one the `points` of the
                            seconds completed since the one before

The document: `state`, `model` (name, family, quantization, heads, profile, the depth
per temperature, ranks), `queue` (waiting per class, the longest wait per class),
`jobs` (each queued or running job: client, class, wait, tokens, tok/s), `sessions`
(the session bank per workspace: entries and bytes in RAM and on disk, hit rate),
`memory`, `warnings` (as /health has them). A point is one second: aggregate tok/s,
mean batch rows, acceptance per head position, mean queue wait per class of the jobs
that started decoding then. docs/protocols.md lists every field.

The points come from the runtime's event listener: a few additions per engine event
under a lock, so a page left open costs decoding nothing it would notice; the
document itself is built once a second per subscriber, on the event loop.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, AsyncIterator

import anyio
import anyio.to_thread
from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from mtplxd.requests import Done, Priority, TextDelta
from mtplxd.runtime import JobView, Runtime

HISTORY_S = 300  # the plots' window: five minutes of one-second points
PERIOD_S = 1.0  # one document a second per subscriber
SESSIONS_EVERY_S = 2.0  # the bank's per-workspace figures take its lock: read them less often
CLASSES = tuple(p.name.lower() for p in Priority)
SSE_PING_S = 15


@dataclass
class _Second:
    """What the engine did in one wall-clock second."""

    t: int
    tokens: int = 0
    deltas: int = 0
    rows: int = 0  # sum of the batch sizes of the deltas: mean rows = rows / deltas
    drafted: list[int] = field(default_factory=list)  # by head position
    accepted: list[int] = field(default_factory=list)
    waits: dict[str, list[float]] = field(default_factory=dict)  # class -> [sum, count]

    def point(self) -> dict[str, Any]:
        return {
            "t": self.t,
            "tokens_per_s": self.tokens,
            "batch": round(self.rows / self.deltas, 2) if self.deltas else 0,
            "acceptance": [round(a / d, 3) if d else None for a, d in zip(self.accepted, self.drafted)],
            "queue_wait_s": {c: round(s / n, 4) for c, (s, n) in self.waits.items() if n},
        }


class StatusBoard:
    """Per-second tallies of every job's events, kept for HISTORY_S seconds."""

    def __init__(self, runtime: Runtime, clock: Any = time.time):
        self.runtime = runtime
        self.clock = clock
        self.started = time.monotonic()
        self._seconds: deque[_Second] = deque(maxlen=HISTORY_S + 1)
        self._lock = threading.Lock()
        self._bank_rows: list[dict] = []
        self._bank_read = -math.inf
        runtime.listen(self.observe)

    def observe(self, entry: Any, event: Any) -> None:
        """(worker thread) Count one event into its second."""
        if isinstance(event, TextDelta) and event.token_ids:
            with self._lock:
                s = self._second()
                s.tokens += len(event.token_ids)
                s.deltas += 1
                s.rows += event.batch
                _grow(s.drafted, len(event.accepted))
                _grow(s.accepted, len(event.accepted))
                for i, ok in enumerate(event.accepted):
                    s.drafted[i] += 1
                    s.accepted[i] += ok
        elif isinstance(event, Done):
            priority = getattr(getattr(entry, "request", None), "priority", Priority.NORMAL)
            with self._lock:
                tally = self._second().waits.setdefault(Priority(priority).name.lower(), [0.0, 0])
                tally[0] += event.queue_wait_s
                tally[1] += 1

    def _second(self) -> _Second:
        now = int(self.clock())
        if not self._seconds or self._seconds[-1].t != now:
            self._seconds.append(_Second(now))
        return self._seconds[-1]

    def points(self, since: int) -> list[dict]:
        """One point per completed second after `since` (seconds without events: zeros)."""
        now = int(self.clock())
        first = max(since + 1, now - HISTORY_S)
        with self._lock:
            known = {s.t: s.point() for s in self._seconds if first <= s.t < now}
        return [known.get(t) or _Second(t).point() for t in range(first, now)]

    # -- the document -------------------------------------------------------------------

    async def document(self) -> dict[str, Any]:
        runtime = self.runtime
        stats = runtime.stats()
        jobs = runtime.jobs()
        return {
            "object": "mtplxd.status",
            "time": round(self.clock(), 3),
            "state": stats.state,
            "uptime_s": round(time.monotonic() - self.started, 1),
            "model": self._model(),
            "queue": _queue(stats, jobs),
            "jobs": [asdict(j) | {"wait_s": round(j.wait_s, 3), "tokens_per_s": round(j.tokens_per_s, 1)}
                     for j in jobs],
            "sessions": await self._sessions(),
            "memory": _memory(runtime),
            "warnings": runtime.warnings(),
        }

    def _model(self) -> dict[str, Any]:
        runtime = self.runtime
        info = runtime.model()
        body: dict[str, Any] = {"id": runtime.model_id(), "profile": runtime.profile_name(),
                                "decoding": runtime.decoding(), "ranks": runtime.ranks()}
        if info is not None:
            body |= {"family": info.family, "quantization": info.quantization, "mtp_heads": info.mtp_heads,
                     "depth_range": list(info.depth_range), "context_length": info.context_length,
                     "temperature": info.temperature}
        return body

    async def _sessions(self) -> dict[str, Any]:
        bank = self.runtime.sessions()
        if bank is None:
            return {"enabled": False, "workspaces": []}
        if time.monotonic() - self._bank_read >= SESSIONS_EVERY_S:
            self._bank_read = time.monotonic()
            self._bank_rows = [_workspace_row(w) for w in await anyio.to_thread.run_sync(bank.workspaces)]
        s = bank.stats()
        lookups = s.hits_ram + s.hits_disk + s.misses
        return {"enabled": bank.enabled, "ram_bytes": s.ram_bytes, "ram_budget": s.ram_budget,
                "disk_bytes": s.disk_bytes, "disk_budget": s.disk_budget,
                "hit_rate": round((s.hits_ram + s.hits_disk) / lookups, 3) if lookups else None,
                "workspaces": self._bank_rows}


def _grow(values: list[int], n: int) -> None:
    if len(values) < n:
        values += [0] * (n - len(values))


def _queue(stats: Any, jobs: list[JobView]) -> dict[str, Any]:
    waiting = {c: [j.wait_s for j in jobs if j.priority == c and not j.running] for c in CLASSES}
    longest = {c: round(max(w), 3) if w else 0 for c, w in waiting.items()}
    return {"active": stats.active, "queued": dict(stats.queued_by_class), "completed": stats.completed,
            "cancelled": stats.cancelled, "longest_wait_s": longest}


def _workspace_row(w: Any) -> dict[str, Any]:
    lookups = w.hits + w.misses
    return {"workspace": w.workspace or "default", "entries": w.entries, "ram_entries": w.ram_entries,
            "disk_entries": w.disk_entries, "ram_bytes": w.ram_bytes, "disk_bytes": w.disk_bytes,
            "hits": w.hits, "misses": w.misses, "hit_rate": round(w.hits / lookups, 3) if lookups else None}


def _memory(runtime: Runtime) -> dict[str, int] | None:
    try:
        return runtime.memory()
    except Exception:  # no MLX memory figures on this device: the page shows none
        return None


# -- routes ---------------------------------------------------------------------------


def status_routes(board: StatusBoard) -> list[Route]:
    async def once(request: Request) -> JSONResponse:
        body = await board.document()
        body["history"] = board.points(-1)
        return JSONResponse(body)

    async def stream(request: Request) -> EventSourceResponse:
        return EventSourceResponse(_documents(board), ping=SSE_PING_S)

    return [Route("/v1/status", once, methods=["GET"]), Route("/v1/status/stream", stream, methods=["GET"])]


async def _documents(board: StatusBoard) -> AsyncIterator[dict]:
    """The stream: one document a second until the client goes (sse-starlette cancels
    us) or the daemon stops (the last document says "stopping": a stream left open would
    hold the server's shutdown up)."""
    last = -1
    while True:
        body = await board.document()
        points = board.points(last)
        body["history" if last < 0 else "points"] = points
        last = points[-1]["t"] if points else int(board.clock()) - 1
        yield {"event": "status", "data": json.dumps(body)}
        if body["state"] in ("stopping", "stopped"):
            return
        await anyio.sleep(PERIOD_S)
