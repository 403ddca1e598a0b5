"""`mtplxd mcp`: the stdio MCP server that coding agents spawn.

    claude mcp add mtplxd -- mtplxd mcp

It serves MCP on stdin/stdout and forwards every request to the running
daemon's Streamable HTTP endpoint (`/mcp`, found through the state dir's
daemon.json), starting a daemon (`mtplxd start`, detached, so that it outlives
this agent session and keeps its warm caches) when none is running.

Design: an MCP-level relay, not a byte-level one. The shim is a low-level MCP
`Server` on stdio whose handlers are an MCP client (`mcp.Client`, legacy
handshake) of the daemon:

- the tools, resources and prompts are defined once, in adapters/mcp/tools.py and adapters/mcp/resources.py (assembled by adapters/mcp/server.py): the
  shim has no definitions of its own, it relays tools/list, tools/call,
  resources/*, prompts/* (so a new tool needs no change here);
- `initialize` is answered by the shim itself, at once, before the daemon is
  found or started (agents give up on slow servers); the daemon is located or
  spawned in the background, and a request that needs it waits for it up to
  CONNECT_TIMEOUT_S, then fails with a clear message;
- progress and cancellation are the SDK's on both legs: upstream progress is
  re-reported against the agent's own progress token; `notifications/cancelled`
  from the agent cancels the handler, whose upstream request the SDK then
  cancels in turn (`notifications/cancelled` to the daemon, which cancels the
  scheduler ticket);
- the default workspace is this process's working directory (or --workspace):
  filled into every call of a tool that takes `workspace` when the agent gives
  none, and `workspace` is listed as optional here;
- roots: the daemon's tools use only folders the user allowed, among them the
  MCP client's roots. The shim declares roots to the daemon: the agent's own
  when the agent declares roots (asked through the agent's session, and
  `notifications/roots/list_changed` passed on), else its workspace, which the
  user chose by starting the agent there;
- a lost connection (daemon restarted, session expired) is re-established once
  per request, through daemon.json again (the port may have changed).

A byte-level JSON-RPC proxy would have to fake `initialize` and replay it,
rewrite progress tokens, and track Streamable HTTP sessions by hand; the
relay gets all of that from the SDK, at the cost of one extra hop in-process.

Nothing but MCP messages is written to stdout; logs go to stderr. This module
imports only the standard library at the top, since the CLI imports it to
build its parser; `mcp` is imported when the command runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, TypeVar

from mtplxd import client

if TYPE_CHECKING:  # annotations only: `mcp` is imported when the command runs
    from mcp.client.session import ListRootsFnT

MCP_PATH = "/mcp"  # where the daemon serves MCP (adapters/mcp/server.py MCP_PATH)
CONNECT_TIMEOUT_S = 45.0  # find or start the daemon, and connect to it
SPAWN_TIMEOUT_S = 40.0  # a started daemon must answer /health within this
CALL_TIMEOUT_S = 120.0  # the daemon ends every tool call within 50 s; beyond this it is hung
ROOTS_TIMEOUT_S = 10.0  # the agent's answer to roots/list

log = logging.getLogger("mtplxd.mcp")
T = TypeVar("T")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", metavar="DIR", help="the daemon's state dir (default: as for start)")
    p.add_argument("--model", metavar="PATH",
                   help="checkpoint for a daemon this command starts (default: as for start)")
    p.add_argument("--workspace", metavar="DIR",
                   help="default workspace of the tools (default: the working directory)")


def main(args: argparse.Namespace) -> int:
    from mtplxd.config import ConfigError, load_settings

    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="mtplxd mcp: %(message)s")
    try:
        settings = load_settings({"state_dir": args.state_dir, "model": args.model})
    except ConfigError as e:
        print(f"mtplxd mcp: {e}", file=sys.stderr)
        return 2
    workspace = os.path.abspath(args.workspace) if args.workspace else os.getcwd()
    if not os.path.isdir(workspace):
        print(f"mtplxd mcp: --workspace {args.workspace!r} is not a folder", file=sys.stderr)
        return 2
    start_args = ["--state-dir", str(settings.state_dir)]
    if settings.model is not None:
        start_args += ["--model", str(settings.model)]
    import anyio

    # One limit for a message on either leg: the daemon refuses a larger /mcp body anyway.
    shim = Shim(Upstream(settings.state_dir, settings.api_key, start_args), workspace, settings.max_body_bytes)
    try:
        anyio.run(shim.serve)
    except KeyboardInterrupt:
        return 130
    return 0


class UpstreamError(Exception):
    """The daemon could not be found, started or reached; str(e) says why."""


class Upstream:
    """The shim's one MCP connection to the daemon, owned by the `run` task (an MCP
    client's task groups must be entered and left by one task); requests borrow it
    through `call`, which (re)connects on demand."""

    def __init__(self, state_dir: Path, api_key: str | None, start_args: list[str]):
        import anyio

        self.state_dir = Path(state_dir)
        self.api_key = api_key
        self.start_args = start_args
        self._client: Any = None
        self._failure: str | None = None
        self._changed = anyio.Event()  # replaced at each change of _client / _failure
        self._attempt = anyio.Event()  # set: the owner should connect
        self._drop = anyio.Event()  # set: the owner should close the connection
        self.list_roots: ListRootsFnT | None = None  # answers the daemon's roots/list

    def want(self) -> None:
        """Find or start the daemon now, in the background."""
        self._attempt.set()

    async def run(self) -> None:
        """Owner task: connect when asked, hold the connection until told to drop it."""
        import anyio
        import httpx2
        from contextlib import AsyncExitStack

        from mcp import Client
        from mcp.client.streamable_http import streamable_http_client
        from mcp.types import Implementation

        while True:
            await self._attempt.wait()
            self._attempt = anyio.Event()
            self._failure = None
            connected = False
            try:
                url = await _in_thread(self._locate)
                headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
                async with AsyncExitStack() as stack:
                    # trust_env=False: never route calls to the local daemon through a proxy
                    http = await stack.enter_async_context(httpx2.AsyncClient(
                        headers=headers, timeout=httpx2.Timeout(30.0, read=300.0), trust_env=False))
                    upstream = Client(streamable_http_client(url, http_client=http), mode="legacy", cache=None,
                                      client_info=Implementation(name="mtplxd-mcp", version=_version()),
                                      list_roots_callback=self.list_roots)
                    await stack.enter_async_context(upstream)
                    connected = True
                    self._set(upstream)
                    await self._drop.wait()
            except Exception as e:  # ExceptionGroups from the client's task groups included
                if connected:  # a connection that ended (daemon stopped): the next request reconnects
                    log.info("connection to the daemon ended: %s", _describe(e))
                else:  # this attempt failed: its waiters hear why
                    self._failure = _describe(e)
                    log.warning("%s", self._failure)
            finally:
                self._drop = anyio.Event()
                self._set(None)

    def _set(self, upstream: Any) -> None:
        import anyio

        self._client = upstream
        changed, self._changed = self._changed, anyio.Event()
        changed.set()

    def _locate(self) -> str:
        """(Worker thread.) The daemon's MCP URL, starting a daemon when none owns the state dir."""
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        spawned = False
        while True:
            address = client.read_address(self.state_dir)
            if address is not None:
                return client.base_url(*address) + MCP_PATH
            if client.owner_pid(self.state_dir) is None and not spawned:
                spawned = True
                log.info("starting mtplxd (state dir %s)", self.state_dir)
                code, message = client.spawn(self.state_dir, self.start_args, self.api_key, timeout=SPAWN_TIMEOUT_S)
                if code != 0 and client.owner_pid(self.state_dir) is None:  # not merely a lost race
                    raise UpstreamError(f"could not start the mtplxd daemon: {message}")
                continue
            if time.monotonic() > deadline:
                raise UpstreamError(f"the mtplxd daemon (state dir {self.state_dir}) did not start listening "
                                    f"within {CONNECT_TIMEOUT_S:.0f} s; see {self.state_dir / client.LOG_FILE}")
            time.sleep(0.05)

    async def session(self) -> Any:
        """The connected ClientSession, connecting first if needed (bounded)."""
        import anyio

        asked = False
        with anyio.move_on_after(CONNECT_TIMEOUT_S + 5.0):
            while self._client is None:
                if asked and self._failure is not None:
                    raise UpstreamError(self._failure)
                changed = self._changed
                self._attempt.set()
                asked = True
                await changed.wait()
        if self._client is None:
            raise UpstreamError(f"could not reach the mtplxd daemon within {CONNECT_TIMEOUT_S:.0f} s")
        return self._client.session

    async def notify(self, notification: Any) -> None:
        """Pass a notification on to the daemon, when connected (a new connection starts afresh)."""
        upstream = self._client
        if upstream is not None:
            try:
                await upstream.session.send_notification(notification)
            except Exception as e:  # the next request reconnects
                log.info("could not notify the daemon: %s", _describe(e))

    def _reset(self, session: Any) -> None:
        if self._client is not None and self._client.session is session:
            self._client = None
            self._drop.set()

    async def call(self, op: Callable[[Any], Awaitable[T]]) -> T:
        """Run `op(session)` against the daemon; a lost connection is re-made once."""
        import anyio
        import httpx2
        from mcp.shared.exceptions import MCPError

        for attempt in (1, 2):
            session = await self.session()
            try:
                return await op(session)
            except MCPError as e:
                if attempt == 1 and _connection_lost(e):
                    self._reset(session)
                    continue
                raise
            except (httpx2.HTTPError, OSError, anyio.BrokenResourceError, anyio.ClosedResourceError,
                    anyio.EndOfStream) as e:
                self._reset(session)
                if attempt == 1:
                    continue
                raise UpstreamError(f"lost the connection to the mtplxd daemon: {_describe(e)}") from None
        raise AssertionError("unreachable")


class Shim:
    """The stdio side: a low-level MCP server whose handlers relay to `Upstream`."""

    def __init__(self, upstream: Upstream, workspace: str, max_line_bytes: int):
        from mcp.server.lowlevel import Server

        self.upstream = upstream
        self.workspace = workspace
        self.max_line_bytes = max_line_bytes
        self._workspace_tools: set[str] | None = None  # tools that take `workspace`
        self._agent: Any = None  # the agent's session, from its latest tool call: where its roots are asked
        upstream.list_roots = self.roots
        self.server = Server(
            "mtplxd",
            version=_version(),
            title="mtplxd: local MLX model",
            instructions=(f"Tools of the local mtplxd daemon. `workspace` defaults to {workspace}. Calls end "
                          "within 50 s; outputs stop at max_tokens (default 256)."),
            on_list_tools=self.list_tools,
            on_call_tool=self.call_tool,
            on_list_resources=self.list_resources,
            on_list_resource_templates=self.list_resource_templates,
            on_read_resource=self.read_resource,
            on_list_prompts=self.list_prompts,
            on_get_prompt=self.get_prompt,
        )
        from mcp.types import NotificationParams

        self.server.add_notification_handler("notifications/roots/list_changed", NotificationParams,
                                             self.roots_changed)

    async def serve(self) -> None:
        import anyio
        from mtplxd.shims.mcp_stdio import stdio_transport  # answers malformed lines, unlike the SDK's

        async with anyio.create_task_group() as tg:
            tg.start_soon(self.upstream.run)
            self.upstream.want()  # find or start the daemon while the agent initializes
            async with stdio_transport(self.max_line_bytes) as (read, write):
                await self.server.run(read, write, self.server.create_initialization_options())
            tg.cancel_scope.cancel()

    async def _relay(self, op: Callable[[Any], Awaitable[T]]) -> T:
        from mcp.shared.exceptions import MCPError
        from mcp.types import INTERNAL_ERROR

        try:
            return await self.upstream.call(op)
        except UpstreamError as e:
            raise MCPError(INTERNAL_ERROR, str(e)) from None

    # -- tools ---------------------------------------------------------------------------------

    async def list_tools(self, ctx: Any, params: Any) -> Any:
        result = await self._relay(lambda s: s.list_tools(params=params))
        self._note_workspace_tools(result, first_page=params is None or params.cursor is None)
        return result.model_copy(update={"tools": [self._default_workspace(tool) for tool in result.tools]})

    def _note_workspace_tools(self, result: Any, first_page: bool) -> None:
        names = {t.name for t in result.tools if "workspace" in (t.input_schema.get("properties") or {})}
        self._workspace_tools = names if first_page else (self._workspace_tools or set()) | names

    def _default_workspace(self, tool: Any) -> Any:
        """`workspace` is optional here: the shim fills in its own."""
        schema = tool.input_schema
        props = schema.get("properties") or {}
        if "workspace" not in props:
            return tool
        prop = dict(props["workspace"])
        prop["description"] = f"{prop.get('description', '')} (default: {self.workspace})".strip()
        schema = {**schema, "properties": {**props, "workspace": prop}}
        if "required" in schema:
            schema["required"] = [name for name in schema["required"] if name != "workspace"]
        return tool.model_copy(update={"input_schema": schema})

    async def call_tool(self, ctx: Any, params: Any) -> Any:
        from mcp.types import CallToolResult, TextContent

        self._agent = ctx.session  # the daemon may ask for roots while this call runs
        arguments = dict(params.arguments or {})
        try:
            if self._workspace_tools is None:  # called before any tools/list
                self._note_workspace_tools(await self.upstream.call(lambda s: s.list_tools()), first_page=True)
            if params.name in (self._workspace_tools or ()) and arguments.get("workspace") in (None, ""):
                arguments["workspace"] = self.workspace

            async def progress(value: float, total: float | None, message: str | None) -> None:
                await ctx.session.report_progress(value, total, message)

            return await self.upstream.call(lambda s: s.call_tool(
                params.name, arguments, read_timeout_seconds=CALL_TIMEOUT_S, progress_callback=progress))
        except UpstreamError as e:  # the agent's model should read why, as for any tool failure
            return CallToolResult(content=[TextContent(type="text", text=str(e))], is_error=True)

    # -- roots ---------------------------------------------------------------------------------

    async def roots(self, context: Any) -> Any:
        """The roots the shim declares to the daemon: the agent's own when it declares roots,
        else the shim's workspace (--workspace or the working directory), where the user
        started the agent."""
        import anyio
        from mcp.types import ListRootsRequest, ListRootsResult, Root
        from pydantic import FileUrl

        agent = self._agent
        capabilities = agent.client_capabilities if agent is not None else None
        if capabilities is not None and capabilities.roots is not None:
            try:
                with anyio.fail_after(ROOTS_TIMEOUT_S):
                    return await agent.send_request(ListRootsRequest(), ListRootsResult)
            except Exception as e:  # an agent that declares roots but cannot list them
                log.warning("the agent did not list its roots (%s: %s); declaring %s", type(e).__name__, e,
                            self.workspace)
        return ListRootsResult(roots=[Root(uri=FileUrl(Path(self.workspace).as_uri()), name="mtplxd mcp workspace")])

    async def roots_changed(self, ctx: Any, params: Any) -> None:
        """The agent's roots changed: the daemon forgets the ones it has from this shim."""
        from mcp.types import RootsListChangedNotification

        await self.upstream.notify(RootsListChangedNotification())

    # -- resources and prompts -----------------------------------------------------------------

    async def list_resources(self, ctx: Any, params: Any) -> Any:
        return await self._relay(lambda s: s.list_resources(params=params))

    async def list_resource_templates(self, ctx: Any, params: Any) -> Any:
        return await self._relay(lambda s: s.list_resource_templates(params=params))

    async def read_resource(self, ctx: Any, params: Any) -> Any:
        return await self._relay(lambda s: s.read_resource(str(params.uri)))

    async def list_prompts(self, ctx: Any, params: Any) -> Any:
        return await self._relay(lambda s: s.list_prompts(params=params))

    async def get_prompt(self, ctx: Any, params: Any) -> Any:
        return await self._relay(lambda s: s.get_prompt(params.name, params.arguments))


# -- helpers -------------------------------------------------------------------------------------


async def _in_thread(fn: Callable[[], T]) -> T:
    """Run blocking `fn` on a daemon thread: a spawn still waiting when the agent goes
    away must not hold this process open (anyio's worker threads would)."""
    import anyio
    import anyio.from_thread
    import anyio.lowlevel

    done = anyio.Event()
    token = anyio.lowlevel.current_token()
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the waiting task
            box["error"] = e
        try:
            anyio.from_thread.run_sync(done.set, token=token)
        except RuntimeError:  # the event loop is gone
            pass

    threading.Thread(target=target, name="mtplxd-mcp-locate", daemon=True).start()
    await done.wait()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _connection_lost(e: Any) -> bool:
    from mcp.types import CONNECTION_CLOSED, INVALID_REQUEST

    return e.code == CONNECTION_CLOSED or (e.code == INVALID_REQUEST and "Session terminated" in e.message)


def _describe(e: BaseException) -> str:
    """One line for an exception, the first leaf of an exception group."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    if isinstance(e, UpstreamError):
        return str(e)
    return f"cannot reach the mtplxd daemon: {type(e).__name__}: {e}"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mtplxd")
    except PackageNotFoundError:
        return "unknown"
