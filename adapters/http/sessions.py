"""The session bank over HTTP: workspace ids on requests, /v1/sessions, and its metrics.

    X-Mtplx-Workspace: /abs/folder     (or body `metadata.workspace`) names the
                                       session-bank namespace of a completion
    GET    /v1/sessions                workspaces with entries: entries, bytes per
                                       tier, hits, misses, cached tokens, watched
    DELETE /v1/sessions?workspace=...  drop one workspace's entries (RAM and disk);
                                       `default` names the requests without one

/metrics gains mtplxd_session_{hits,misses,evictions,bad_files,cached_tokens}_total,
mtplxd_session_bytes{tier} and mtplxd_session_entries{tier}, read from the bank at
scrape time.
"""

from __future__ import annotations

import dataclasses

import anyio.to_thread
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from adapters.common.errors import ApiError, bad
from adapters.http.openai_schema import TextParams
from mtplxd.runtime import Runtime
from mtplxd.requests import DEFAULT_WORKSPACE, DEFAULT_WORKSPACE_NAME, workspace_key

WORKSPACE_HEADER = "x-mtplx-workspace"


def with_workspace(params: TextParams, request: Request, body: dict) -> TextParams:
    """`params` with the workspace the request names (header first, then metadata)."""
    raw = request.headers.get(WORKSPACE_HEADER)
    param = None
    if raw is None:
        metadata = body.get("metadata")
        raw = metadata.get("workspace") if isinstance(metadata, dict) else None
        param = "metadata.workspace"
    if raw is None:
        return params
    try:
        workspace = workspace_key(raw)
    except ValueError as e:
        raise bad(f"{e} ({'the X-Mtplx-Workspace header' if param is None else param})", param) from None
    return dataclasses.replace(params, request=dataclasses.replace(params.request, workspace=workspace))


def session_routes(runtime: Runtime) -> list[Route]:
    api = _Sessions(runtime)
    return [Route("/v1/sessions", api.list, methods=["GET"]), Route("/v1/sessions", api.delete, methods=["DELETE"])]


class _Sessions:
    def __init__(self, runtime: Runtime):
        self.runtime = runtime

    async def list(self, request: Request) -> JSONResponse:
        bank = self.runtime.sessions()
        registry = self.runtime.workspaces
        watched = set(registry.watched()) if registry is not None else set()
        data = []
        if bank is not None:
            for s in await anyio.to_thread.run_sync(bank.workspaces):
                data.append({
                    "object": "session.workspace", "workspace": s.workspace, "entries": s.entries,
                    "ram_entries": s.ram_entries, "disk_entries": s.disk_entries, "ram_bytes": s.ram_bytes,
                    "disk_bytes": s.disk_bytes, "bytes": s.ram_bytes + s.disk_bytes, "hits": s.hits,
                    "hits_ram": s.hits_ram, "hits_disk": s.hits_disk, "misses": s.misses,
                    "cached_tokens": s.cached_tokens, "watched": s.workspace in watched,
                })
        listed = {d["workspace"] for d in data}
        for ws in sorted(watched - listed):
            data.append({"object": "session.workspace", "workspace": ws, "entries": 0, "ram_entries": 0,
                         "disk_entries": 0, "ram_bytes": 0, "disk_bytes": 0, "bytes": 0, "hits": 0, "hits_ram": 0,
                         "hits_disk": 0, "misses": 0, "cached_tokens": 0, "watched": True})
        body: dict = {"object": "list", "data": data, "enabled": bool(bank is not None and bank.enabled)}
        if bank is not None:
            st = bank.stats()
            body["ram"] = {"bytes": st.ram_bytes, "budget": st.ram_budget, "entries": st.ram_entries}
            body["disk"] = {"bytes": st.disk_bytes, "budget": st.disk_budget, "entries": st.disk_entries,
                            "pending_writes": st.pending_writes, "waiting_writes": st.waiting_writes}
        if registry is not None:
            body["warmups"] = {"started": registry.warmups_started, "done": registry.warmups_done,
                               "failed": registry.warmups_failed}
        return JSONResponse(body)

    async def delete(self, request: Request) -> JSONResponse:
        raw = request.query_params.get("workspace")
        if raw is None:
            raise bad("name the workspace to clear: DELETE /v1/sessions?workspace=/abs/folder "
                      f"(or {DEFAULT_WORKSPACE_NAME!r} for requests without one)", "workspace")
        if raw == DEFAULT_WORKSPACE_NAME:
            workspace = DEFAULT_WORKSPACE
        else:
            try:
                workspace = workspace_key(raw)
            except ValueError as e:
                raise bad(str(e), "workspace") from None
        bank = self.runtime.sessions()
        if bank is None:
            raise ApiError(404, "the session bank is off", code="sessions_disabled")
        deleted = await anyio.to_thread.run_sync(bank.clear, workspace)
        return JSONResponse({"object": "session.deleted", "workspace": workspace, "deleted": deleted})


class SessionCollector:
    """Prometheus collector reading the bank's counters at scrape time."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime

    def describe(self) -> list:
        return []  # no fixed description: the registry calls collect() on scrape only

    def collect(self):
        bank = self.runtime.sessions()
        if bank is None:
            return
        st = bank.stats()
        hits = CounterMetricFamily("mtplxd_session_hits", "Session-bank lookups that reused a prefix, by tier",
                                   labels=["tier"])
        hits.add_metric(["ram"], st.hits_ram)
        hits.add_metric(["disk"], st.hits_disk)
        yield hits
        yield CounterMetricFamily("mtplxd_session_misses", "Session-bank lookups with no reusable prefix",
                                  value=st.misses)
        evictions = CounterMetricFamily("mtplxd_session_evictions", "Session-bank entries evicted, by tier",
                                        labels=["tier"])
        evictions.add_metric(["ram"], st.evictions_ram)
        evictions.add_metric(["disk"], st.evictions_disk)
        yield evictions
        yield CounterMetricFamily("mtplxd_session_bad_files", "Session files set aside (corrupt, truncated, foreign)",
                                  value=st.bad_files)
        yield CounterMetricFamily("mtplxd_session_cached_tokens", "Prompt tokens restored instead of prefilled",
                                  value=st.cached_tokens)
        size = GaugeMetricFamily("mtplxd_session_bytes", "Session-bank bytes held, by tier", labels=["tier"])
        size.add_metric(["ram"], st.ram_bytes)
        size.add_metric(["disk"], st.disk_bytes)
        yield size
        entries = GaugeMetricFamily("mtplxd_session_entries", "Session-bank entries, by tier", labels=["tier"])
        entries.add_metric(["ram"], st.ram_entries)
        entries.add_metric(["disk"], st.disk_entries)
        yield entries
        budget = GaugeMetricFamily("mtplxd_session_budget_bytes", "Session-bank byte budget, by tier", labels=["tier"])
        budget.add_metric(["ram"], st.ram_budget)
        budget.add_metric(["disk"], st.disk_budget)
        yield budget
