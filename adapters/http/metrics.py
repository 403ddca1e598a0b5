"""Prometheus metrics of one app, in its own CollectorRegistry.

Each app owns its registry (never prometheus_client's global one), so two
apps in one process (tests, or a daemon restarted in-process) never collide.
Engine-side numbers arrive through the runtime's event listeners (mtplxd/runtime.py) on the
worker thread (prometheus_client is thread-safe); queue gauges are read from
`runtime.stats()` at scrape time, so they are never stale.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from adapters.http.sessions import SessionCollector
from mtplxd.requests import Done, TextDelta
from mtplxd.runtime import Runtime

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Paths worth a label of their own; anything else is "other", so a scanner
# probing random URLs cannot grow the label set without bound.
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/health", "/metrics",
             "/v1/sessions", "/v1/messages", "/v1/messages/count_tokens",
             "/mcp", "/v1/status", "/v1/status/stream", "/")
STATES = ("loading", "ready", "failed", "stopping", "stopped")


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("mtplxd_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.cancelled = Counter("mtplxd_cancelled_requests", "Requests cancelled before they finished "
                                 "(client gone)", ["endpoint"], registry=r)
        self.queue_depth = Gauge("mtplxd_queue_depth", "Requests waiting for a slot, by priority class",
                                 ["class"], registry=r)
        self.active = Gauge("mtplxd_active_generations", "Jobs holding an engine slot", registry=r)
        self.state = Enum("mtplxd_model_state", "Model lifecycle state", states=list(STATES), registry=r)
        # By priority class: the scheduler's shares (mtplxd/shares.py) bound each class's wait.
        self.ttft = Histogram("mtplxd_time_to_first_token_seconds", "Submit to first generated token, by "
                              "priority class", ["class"],
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.queue_wait = Histogram("mtplxd_queue_wait_seconds", "Submit to the job's first engine step (a slot "
                                    "and its class's turn), by priority class", ["class"],
                                    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                                    registry=r)
        self.decode_rate = Histogram("mtplxd_decode_tokens_per_second", "Decode speed of finished generations",
                                     buckets=(1, 2, 5, 10, 20, 35, 50, 75, 100, 150, 200, 300, 500, 1000),
                                     registry=r)
        self.prompt_tokens = Counter("mtplxd_prompt_tokens", "Prompt tokens of finished generations", registry=r)
        self.completion_tokens = Counter("mtplxd_completion_tokens", "Generated tokens", registry=r)
        self.drafted = Counter("mtplxd_mtp_drafted_tokens", "MTP draft tokens proposed, by draft depth",
                               ["depth"], registry=r)
        self.accepted = Counter("mtplxd_mtp_accepted_tokens", "MTP draft tokens accepted, by draft depth",
                                ["depth"], registry=r)
        self.acceptance = Gauge("mtplxd_mtp_acceptance_ratio", "Accepted / drafted since start, by draft depth",
                                ["depth"], registry=r)
        self.batch_rows = Histogram("mtplxd_batch_rows", "Rows in the engine step that made each row's tokens "
                                    "(1: it stepped alone; mtplxd/scheduler.py)",
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32), registry=r)
        self.batch_depth = Gauge("mtplxd_batch_depth", "MTP depth rows decode with at this many rows in a batch "
                                 "(0: plain AR; engine/profiles.py, measured per batch size)", ["rows"], registry=r)
        self.step_tokens = Histogram("mtplxd_step_tokens", "Tokens a generation committed in one engine step",
                                     buckets=(1, 2, 3, 4, 5, 6, 8), registry=r)
        self._tallies: dict[str, list[int]] = {}  # depth -> [drafted, accepted], for the ratio

    def attach(self, runtime: Runtime) -> None:
        """Listen to every job's events; read the session bank's counters at scrape time."""
        runtime.listen(lambda entry, event: self.observe(event, class_of(entry)))
        self.registry.register(SessionCollector(runtime))

    def observe(self, event: Any, priority_class: str = "normal") -> None:
        if isinstance(event, TextDelta):
            if event.token_ids:
                self.batch_rows.observe(event.batch)
                self.step_tokens.observe(len(event.token_ids))
            for i, ok in enumerate(event.accepted):
                self._count_draft(str(i + 1), ok)
        elif isinstance(event, Done):
            self.ttft.labels(priority_class).observe(event.time_to_first_token_s)
            self.queue_wait.labels(priority_class).observe(event.queue_wait_s)
            if event.decode_tokens_per_s > 0:
                self.decode_rate.observe(event.decode_tokens_per_s)
            self.prompt_tokens.inc(event.usage.prompt_tokens)
            self.completion_tokens.inc(event.usage.completion_tokens)

    def _count_draft(self, depth: str, ok: bool) -> None:
        self.drafted.labels(depth).inc()
        tally = self._tallies.setdefault(depth, [0, 0])
        tally[0] += 1
        if ok:
            self.accepted.labels(depth).inc()
            tally[1] += 1

    def render(self, stats: Any, decoding: dict | None = None) -> bytes:
        """The Prometheus text exposition, with the queue gauges read now; `decoding`:
        the runtime's decoding plan (the depth per batch size)."""
        for rows, depth in ((decoding or {}).get("batched_depth") or {}).items():
            self.batch_depth.labels(rows).set(depth)
        for name, count in stats.queued_by_class.items():
            self.queue_depth.labels(name).set(count)
        self.active.set(stats.active)
        if stats.state in STATES:
            self.state.state(stats.state)
        for depth, (drafted, accepted) in list(self._tallies.items()):
            self.acceptance.labels(depth).set(accepted / drafted if drafted else 0.0)
        return generate_latest(self.registry)


def class_of(entry: Any) -> str:
    """The priority class a job ran in: the one it was raised to, else the request's."""
    priority = getattr(entry, "priority", None)  # INTERACTIVE is 0: compare with None, never `or`
    if priority is None:
        priority = getattr(entry.request, "priority", None)
    return priority.name.lower() if priority is not None else "normal"


def endpoint_label(path: str) -> str:
    if path.startswith("/v1/models"):
        return "/v1/models"  # also /v1/models/{id}
    return path if path in ENDPOINTS else "other"


class RequestCounter:
    """ASGI middleware: counts every HTTP response by endpoint and status,
    errors raised past the app's handlers included (as 500). The status counted is the
    one the client got: the first response start the server sent. (The MCP SDK, when a
    session closes under a notification it has already answered 202, tries to send a
    500 too; the server refuses it, and the client saw a 202.)"""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: list[int] = []

        async def counting_send(message: dict) -> None:
            await send(message)
            if message["type"] == "http.response.start" and not status:
                status.append(message["status"])

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.requests.labels(endpoint_label(scope["path"]), str(status[0] if status else 500)).inc()
