"""The MCP adapter: the daemon as a tool server for coding agents.

One `MCPServer` (the `mcp` package, v2 API) defines every tool, resource and
prompt, once: `build_server` registers the tools (adapters/mcp/tools.py, their
arguments and outputs in adapters/mcp/schema.py) and the resources and prompts
(adapters/mcp/resources.py). Two transports serve those definitions:

- Streamable HTTP at `/mcp` in the daemon's own Starlette app (`mount`): same
  port and same API key middleware as the OpenAI routes, DNS-rebinding
  protection on (`transport_security`);
- stdio, through `mtplxd mcp` (mtplxd/shims/mcp_shim.py), which relays to `/mcp`
  and defines nothing itself.

Tools (structured output: usage with cached tokens, decode tok/s, MTP figures):

    generate(prompt, system?, max_tokens?, temperature?, stop?, workspace?)
    chat(messages, max_tokens?, temperature?, workspace?)
    fim_complete(workspace, path?, line?, character?, prefix?, suffix?, language?, max_tokens?)
        (a model without fill-in-the-middle tokens completes from the prefix alone)
    warm_workspace(workspace, paths?)
    status()

Resources: `mtplxd://model`, `mtplxd://metrics` and the template
`mtplxd://sessions/{workspace}` (the workspace's absolute path, percent-encoded).
Prompts: explain_selection, write_docstring, commit_message.

Bounds. `initialize` never waits for the model: a tool called while it loads
waits up to MODEL_WAIT_S (with a progress notification), then fails with a
clear message. Every call ends within CALL_BUDGET_S, under the 60 s tool
timeouts of Claude Code and Cline: a generation still running then stops and
returns its text so far with finish_reason "time_limit". `max_tokens` defaults
to DEFAULT_MAX_TOKENS and is capped at MAX_TOKENS_LIMIT; texts, lists and files
have size limits in the input schemas, so oversize input is refused up front.

Progress: while generating, `notifications/progress` carries the tokens so far
(total: max_tokens). Cancellation: `notifications/cancelled` (or a client that
goes away) cancels the tool's task, whose `finally` cancels the scheduler
ticket: the job leaves the queue before the engine's next step.

Workspaces. A workspace is an existing absolute folder, normalized as every
adapter does (mtplxd/workspaces.py). A call may use only one the user allowed:
inside a root the MCP client declared, a folder an editor opened over LSP, or a
folder of the `workspaces` setting; anything else is a tool error saying how to
allow it (`WorkspaceGuard`, adapters/mcp/paths.py: the server's lifespan hands
it to the tools' roots resolvers, and a middleware forgets a session's roots on
notifications/roots/list_changed). It becomes TextRequest.workspace, the
session-bank namespace, so each project restores its own cached prefixes
(`usage.cached_tokens`) and the daemon watches it for changed files.
`warm_workspace` queues the same background warm-ups (WarmRequest) as that
watcher. `path` arguments resolve inside the workspace only: `..`, absolute
paths elsewhere and symlinks leading out are refused with a tool error
(adapters/mcp/paths.py). Per-workspace figures come from the bank and from a
tally of the jobs the scheduler finished (`WorkspaceTally`, on the runtime's
event hook; adapters/mcp/figures.py).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, AsyncIterator

import anyio
import anyio.abc
from mcp.server import MCPServer
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.transport_security import TransportSecuritySettings
from starlette.applications import Starlette

from adapters.http.guard import LOOPBACK_NAMES, host_names
from adapters.mcp.figures import Figures
from adapters.mcp.paths import WorkspaceGuard
from adapters.mcp.resources import register_prompts, register_resources
from adapters.mcp.schema import Outcome, generation_fields
from adapters.mcp.tools import register_tools
from mtplxd.config import Settings
from mtplxd.runtime import ModelInfo, Runtime
from mtplxd.requests import Done, Failed, MTPStats, TextDelta, TextRequest, WarmRequest
from mtplxd.requests import NotReady, QueueFull

MCP_PATH = "/mcp"
SERVER_NAME = "mtplxd"

# The bounds of a call, read from this module at each call (never copied into the others).
CALL_BUDGET_S = 50.0  # a whole tool call, model wait included: agents time out at 60 s
MODEL_WAIT_S = 30.0  # how long a tool waits for a model that is still loading
PROGRESS_INTERVAL_S = 0.05  # at most this often a progress notification

INSTRUCTIONS = """\
A local model on this machine, served by mtplxd, for cheap drafts, summaries,
boilerplate and fill-in-the-middle. Pass `workspace` (the absolute project
folder) so each project keeps its own warm caches. Calls end within 50 s;
long outputs stop at max_tokens (default 256, at most 2048)."""


class McpAdapter:
    """What the tools share: the runtime, the daemon's figures, and the task group
    that drains warm-up jobs. `server` is the one MCPServer."""

    def __init__(self, runtime: Runtime, settings: Settings, metrics: Any = None):
        self.runtime = runtime
        self.figures = Figures(runtime, metrics)
        self.workspaces = WorkspaceGuard(settings, runtime)
        self._background: anyio.abc.TaskGroup | None = None
        self.server = build_server(self)

    # -- lifecycle -------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Run the Streamable HTTP session manager (and the warm-up drains) for the app's
        lifetime. Once the scheduler stops, every MCP session is closed, so that open
        streams do not hold up the server's graceful shutdown."""
        async with anyio.create_task_group() as tg:
            self._background = tg
            await tg.start(self._serve_sessions)
            try:
                yield
            finally:
                self._background = None
                tg.cancel_scope.cancel()

    async def _serve_sessions(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        async with self.server.session_manager.run():
            task_status.started()
            while self.runtime.state not in ("stopping", "stopped"):
                await anyio.sleep(0.1)
            await anyio.sleep(0.5)  # in-flight calls get the scheduler's shutdown error out first

    # -- a tool call -------------------------------------------------------------------------

    def deadline(self) -> float:
        """When a tool call starting now must have answered."""
        return time.monotonic() + CALL_BUDGET_S

    async def ready(self, ctx: Context, deadline: float) -> ModelInfo:
        """The loaded model's facts; waits (bounded) while it loads, else a clear ToolError."""
        if self.runtime.state == "loading":
            await _progress(ctx, 0, None, "waiting for the model to load")
            limit = min(deadline, time.monotonic() + MODEL_WAIT_S)
            while self.runtime.state == "loading" and time.monotonic() < limit:
                await anyio.sleep(0.05)
        state = self.runtime.state
        if state == "loading":
            raise ToolError("the model is still loading; retry in a few seconds")
        if state == "failed":
            raise ToolError(self.runtime.failure())
        info = self.figures.model_info()
        if state != "ready" or info is None:
            raise ToolError("the daemon is shutting down")
        return info

    def submit(self, request: TextRequest | WarmRequest) -> Any:
        try:
            return self.runtime.submit(request, "mcp")
        except QueueFull as e:
            raise ToolError(f"the daemon is busy: {e}") from None
        except NotReady as e:
            raise ToolError(str(e)) from None

    async def run_text(self, ctx: Context, request: TextRequest, info: ModelInfo,
                       deadline: float) -> dict[str, Any]:
        """Submit, stream with progress, and release the ticket on every path out: a
        cancelled call (notifications/cancelled, a client gone) cancels the job. Returns
        the Generation fields, the text so far when the deadline cut the run short."""
        started = time.monotonic()
        ticket = self.submit(request)
        parts: list[str] = []
        tokens, last_report, first = 0, 0.0, None
        plan = self.runtime.plan(request) if info.mtp_heads else None
        mtp = MTPStats(depth=plan.depth if plan is not None and plan.mode == "mtp" else 0)
        done: Done | None = None
        try:
            with anyio.move_on_after(max(deadline - time.monotonic(), 0.0)):
                async for event in ticket:
                    if isinstance(event, TextDelta):
                        parts.append(event.text)
                        tokens += len(event.token_ids)
                        mtp.add(list(event.accepted))
                        now = time.monotonic()
                        if first is None and event.token_ids:
                            first = now - started
                        if tokens and now - last_report >= PROGRESS_INTERVAL_S:
                            last_report = now
                            await _progress(ctx, tokens, request.max_tokens, f"{tokens} tokens")
                    elif isinstance(event, Done):
                        done = event
                    elif isinstance(event, Failed):
                        raise ToolError(f"the generation failed: {event.message}")
            if done is None and time.monotonic() < deadline:
                raise ToolError("the generation ended without a result")
        finally:
            if done is None:
                ticket.cancel()
        return generation_fields(Outcome("".join(parts), done, tokens, mtp, first, started), request, info)

    def start_background(self, ticket: Any) -> None:
        """Drain a warm-up job's events without waiting for it (the daemon's lifetime)."""
        if self._background is None:
            ticket.cancel()
            raise ToolError("the daemon is not accepting background work")

        async def drain() -> None:
            try:
                async for _ in ticket:
                    pass
            finally:
                ticket.cancel()

        self._background.start_soon(drain)


async def _progress(ctx: Context, progress: float, total: float | None, message: str) -> None:
    """Progress is best effort: a client that cannot take it does not fail the call."""
    try:
        await ctx.report_progress(progress, total, message)
    except Exception:
        pass


def build_server(adapter: McpAdapter) -> MCPServer:
    """The one MCPServer: every tool, resource and prompt, defined once."""
    @contextlib.asynccontextmanager
    async def lifespan(_: MCPServer) -> AsyncIterator[WorkspaceGuard]:
        yield adapter.workspaces  # each request's lifespan_context: what the roots resolvers read

    server = MCPServer(SERVER_NAME, title="mtplxd: local MLX model", version=_version(),
                       instructions=INSTRUCTIONS, lifespan=lifespan)
    server.middleware.append(adapter.workspaces.forget_changed_roots)
    register_tools(server, adapter)
    register_resources(server, adapter.figures)
    register_prompts(server)
    return server


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mtplxd")
    except PackageNotFoundError:
        return "unknown"


# -- mounting in the daemon's app -----------------------------------------------------------


def transport_security(settings: Any) -> TransportSecuritySettings:
    """The SDK's own DNS-rebinding check, with the names and origins of the app's
    (adapters/http/guard.py, which already checked every request): a second line."""
    hosts = host_names(settings)
    if not hosts:  # a wildcard bind without allowed_hosts: the API key protects
        return TransportSecuritySettings(enable_dns_rebinding_protection=False)
    origins = [f"{scheme}://{h}" for h in LOOPBACK_NAMES for scheme in ("http", "https")]
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=hosts + [f"{h}:*" for h in hosts],
        allowed_origins=origins + [f"{o}:*" for o in origins] + list(settings.allowed_origins),
    )


def mount(app: Starlette, runtime: Runtime, settings: Settings) -> McpAdapter:
    """Serve the MCP server at /mcp in `app` (the OpenAI adapter's app): its routes share
    the app's middleware (API key, request counting); the app's lifespan now also runs
    the MCP session manager."""
    adapter = McpAdapter(runtime, settings, getattr(app.state, "metrics", None))
    mcp_app = adapter.server.streamable_http_app(
        streamable_http_path=MCP_PATH,
        transport_security=transport_security(settings),
        # One body limit: the app's (adapters/http/body_limit.py), answered in JSON-RPC's form
        # before the SDK reads; the SDK's own (4 MiB, a plain-text 413) is set to the same.
        max_request_body_size=settings.max_body_bytes,
    )
    app.router.routes.extend(mcp_app.routes)  # one Route at /mcp
    previous = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: Any) -> AsyncIterator[Any]:
        async with previous(a) as state, adapter.running():
            yield state

    app.router.lifespan_context = lifespan
    app.state.mcp = adapter
    return adapter
