"""The MCP adapter through the `mcp` SDK's own client, over both transports.

- stdio: `mtplxd mcp` spawned the way agents spawn it, in a workspace folder, with
  MTPLXD_HOME (a temporary state dir), MTPLXD_MODEL (a tiny MiMo checkpoint) and
  MTPLXD_API_KEY in its environment. The first session finds no daemon and starts
  one (the `daemon` fixture); later sessions find it running.
- Streamable HTTP: the same daemon's /mcp, with the API key; once in the handshake
  era (`mode="legacy"`, what agents use today) and once in the SDK's default mode.
- In-process: a daemon whose model load the test holds back, for the "still
  loading" paths and the time budget of a call.

"Separate caches per workspace" is checked through the session bank: two clients
at once, in two workspaces, each restore their own prompts (`usage.cached_tokens`)
and never the other's, and each workspace reaches the scheduler as its own
TextRequest.workspace (the per-workspace job tally).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import statistics
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

import anyio
import httpx
import httpx2
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp.types import ListRootsResult, Root

import engine  # noqa: F401  (BLAS before mlx)
from engine.engine import load_tokenizer
from engine.prompts import chat_prompt_ids
from mtplxd import client
from mtplxd.config import Settings
from tests.checkpoints import write
from tests.checkpoints.common import drop_fim_tokens
from tests.daemon_fixture import mtplxd_command, running_daemon

pytestmark = pytest.mark.anyio

KEY = "sk-mcp-test"
TOOLS = {"generate", "chat", "fim_complete", "warm_workspace", "status"}
PROMPTS = {"explain_selection": {"code": "x = 1"}, "write_docstring": {"code": "def f(): pass"},
           "commit_message": {"diff": "+x = 1"}}
LONG = {"prompt": "hi", "max_tokens": 2000, "temperature": 0}  # greedy: runs the full 2000 tokens
MODULE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"


@pytest.fixture
def anyio_backend():
    return "asyncio"


@dataclass
class Folders:
    a: Path  # the stdio shim's working directory: its default workspace
    b: Path
    c: Path  # c and d: only the two-clients test uses them (their session caches start empty)
    d: Path
    outside: Path


@dataclass
class DaemonInfo:
    url: str
    state_dir: Path
    env: dict[str, str]
    first: dict  # what the very first stdio session saw


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write("mimo", tmp_path_factory.mktemp("ck") / "mimo", mtp_heads=1)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Folders:
    root = tmp_path_factory.mktemp("folders")
    a, b, c, d, outside = (root / name for name in ("ws-a", "ws-b", "ws-c", "ws-d", "outside"))
    for folder in (a / "pkg", b, c, d, outside):
        folder.mkdir(parents=True)
    (a / "pkg" / "mod.py").write_text(MODULE)
    (b / "main.py").write_text("print('b')\n")
    (outside / "secret.txt").write_text("secret\n")
    (a / "link_out").symlink_to(outside / "secret.txt")
    (a / "linkdir").symlink_to(outside, target_is_directory=True)
    (a / "pkg" / "inner_link.py").symlink_to(a / "pkg" / "mod.py")  # a symlink that stays inside
    return Folders(a, b, c, d, outside)


@pytest.fixture(scope="module")
def daemon(checkpoint, folders, tmp_path_factory):
    """Started by the first `mtplxd mcp` session, as an agent's first session would."""
    state_dir = tmp_path_factory.mktemp("state")
    env = {"MTPLXD_HOME": str(state_dir), "MTPLXD_MODEL": str(checkpoint), "MTPLXD_API_KEY": KEY,
           "MTPLXD_PORT": "0", "MTPLXD_CALIBRATE_TOKENS": "0"}  # no background calibration (daemon_fixture)
    assert client.owner_pid(state_dir) is None
    first: dict = {}

    async def first_session() -> None:
        started = time.perf_counter()
        async with stdio(env, folders.a) as session:
            first["initialize_s"] = time.perf_counter() - started
            first["health_at_initialize"] = client.health(state_dir, KEY, 1.0)
            first["status"] = (await session.call_tool("status", {})).structured_content
            first["tools"] = {t.name for t in (await session.list_tools()).tools}

    try:
        anyio.run(first_session)
        url = client.daemon_url(state_dir)
        assert url is not None, client.log_tail(state_dir)
        yield DaemonInfo(url, state_dir, env, first)
    finally:
        client.stop(state_dir)


# -- connecting ----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def stdio(env: dict[str, str], cwd: Path) -> AsyncIterator[Client]:
    command = mtplxd_command()
    params = StdioServerParameters(command=command[0], args=[*command[1:], "mcp"], env=env, cwd=str(cwd))
    async with Client(params, mode="legacy") as session:
        yield session


def declare(*folders: Path):
    """A client's roots/list answer: the daemon's tools use only folders a client declared as
    roots (or that the user allowed otherwise: tests/reliability/test_mcp_workspaces.py)."""
    async def list_roots(context) -> ListRootsResult:
        return ListRootsResult(roots=[Root(uri=folder.as_uri()) for folder in folders])

    return list_roots


@contextlib.asynccontextmanager
async def http(url: str, mode: str = "legacy", key: str | None = KEY, roots: tuple[Path, ...] = ()
               ) -> AsyncIterator[Client]:
    headers = {"Authorization": f"Bearer {key}"} if key else None
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30.0, read=120.0), trust_env=False) as h:
        async with Client(streamable_http_client(url + "/mcp", http_client=h), mode=mode,
                          list_roots_callback=declare(*roots) if roots else None) as session:
            yield session


@contextlib.asynccontextmanager
async def connect(transport: str, daemon: DaemonInfo, folders: Folders) -> AsyncIterator[Client]:
    if transport == "stdio":
        async with stdio(daemon.env, folders.a) as session:
            yield session
    else:
        async with http(daemon.url, "legacy" if transport == "http" else "auto", roots=(folders.a,)) as session:
            yield session


def ws_args(transport: str, folders: Folders, **arguments) -> dict:
    """Over stdio the shim fills in its working directory; over HTTP it is explicit."""
    return arguments if transport == "stdio" else {"workspace": str(folders.a), **arguments}


async def call(session: Client, tool: str, arguments: dict, progress: list | None = None) -> dict:
    async def on_progress(value, total, message):
        progress.append((value, total, message))

    result = await session.call_tool(tool, arguments, progress_callback=on_progress if progress is not None else None)
    assert not result.is_error, result.content
    return result.structured_content


async def refused(session: Client, tool: str, arguments: dict) -> str:
    """A tool error or an MCP error; returns its message."""
    try:
        result = await session.call_tool(tool, arguments)
    except MCPError as e:
        return e.message
    assert result.is_error, result.structured_content
    return result.content[0].text


async def queue(session: Client) -> dict:
    return (await call(session, "status", {}))["queue"]


async def idle(session: Client, timeout: float = 10.0) -> dict:
    with anyio.fail_after(timeout):
        while (q := await queue(session))["active"] or any(q["queued_by_class"].values()):
            await anyio.sleep(0.02)
    return q


async def sessions_figures(session: Client, workspace: Path) -> dict:
    uri = "mtplxd://sessions/" + urllib.parse.quote(str(workspace), safe="")
    return json.loads((await session.read_resource(uri)).contents[0].text)


def check_generation(out: dict, workspace: Path | None) -> None:
    assert out["model"] == "mimo" and out["finish_reason"] in ("stop", "length")
    assert out["workspace"] == (str(workspace) if workspace else None)
    usage = out["usage"]
    assert usage["prompt_tokens"] > 0 and 0 <= usage["cached_tokens"] < usage["prompt_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert out["timings"]["decode_tokens_per_s"] >= 0 and out["timings"]["total_s"] > 0
    mtp = out["mtp"]
    assert mtp["mode"] == "mtp" and mtp["depth"] >= 1 and 0 <= mtp["accepted"] <= mtp["drafted"]
    assert mtp["acceptance"] is None or 0 <= mtp["acceptance"] <= 1


# -- the tests -------------------------------------------------------------------------------


def test_stdio_answers_initialize_at_once_and_starts_the_daemon(daemon):
    first = daemon.first
    assert first["initialize_s"] < 10
    # answered before the daemon it started was serving a loaded model
    assert first["health_at_initialize"] is None or first["health_at_initialize"]["status"] != "ok"
    assert first["status"]["state"] in ("loading", "ready") and first["status"]["model"] == "mimo"
    assert first["tools"] == TOOLS
    assert client.owner_pid(daemon.state_dir) is not None  # the daemon outlives the session


@pytest.mark.parametrize("transport", ["stdio", "http", "http-auto"])
async def test_tools_resources_and_prompts(transport, daemon, folders):
    async with connect(transport, daemon, folders) as session:
        tools = {t.name: t for t in (await session.list_tools()).tools}
        assert set(tools) == TOOLS
        for tool in tools.values():
            assert tool.annotations.read_only_hint is True and tool.annotations.destructive_hint is False
            assert tool.output_schema and tool.description
        generate = tools["generate"].input_schema
        assert generate["required"] == ["prompt"]
        assert generate["properties"]["prompt"]["type"] == "string"
        assert "usage" in tools["generate"].output_schema["properties"]
        fim_required = tools["fim_complete"].input_schema.get("required", [])
        assert ("workspace" in fim_required) == (transport != "stdio")

        progress: list = []
        out = await call(session, "generate", ws_args(transport, folders, prompt="write a haiku", max_tokens=24,
                                                      temperature=0.7, stop=["\n\n"]), progress)
        check_generation(out, folders.a)
        assert progress and all(t == 24 for _, t, _ in progress)
        assert [p for p, _, _ in progress] == sorted({p for p, _, _ in progress})  # increasing
        assert progress[-1][0] <= out["usage"]["completion_tokens"]

        out = await call(session, "chat", {"messages": [{"role": "system", "content": "be brief"},
                                                        {"role": "user", "content": "hi"}], "max_tokens": 8})
        check_generation(out, folders.a if transport == "stdio" else None)  # HTTP: the default namespace
        assert out["usage"]["completion_tokens"] <= 8

        out = await call(session, "fim_complete", ws_args(transport, folders, path="pkg/mod.py", line=1, character=4,
                                                          max_tokens=8))
        check_generation(out, folders.a)
        assert (out["path"], out["line"], out["character"], out["language"]) == ("pkg/mod.py", 1, 4, "python")
        out = await call(session, "fim_complete", ws_args(transport, folders, prefix="def f(x):\n    ",
                                                          suffix="\n", language="python", max_tokens=8))
        assert out["path"] is None and out["language"] == "python" and out["suffix_used"] is True

        warm = await call(session, "warm_workspace", ws_args(transport, folders, paths=["pkg/mod.py"]))
        assert warm["workspace"] == str(folders.a) and warm["queued"] == ["pkg/mod.py"]
        assert warm["prompt_tokens"] > 0
        warm = await call(session, "warm_workspace", ws_args(transport, folders))  # recent files
        assert "pkg/mod.py" in warm["queued"]

        status = await call(session, "status", {})
        assert (status["state"], status["model"], status["family"], status["mtp_heads"]) == ("ready", "mimo", "mimo", 1)
        assert status["depth"] >= 1 and status["session_bank"]["enabled"] is True
        assert str(folders.a) in status["session_bank"]["watched_workspaces"]
        assert set(status["queue"]["queued_by_class"]) == {"interactive", "normal", "background"}
        assert str(folders.a) in {w["workspace"] for w in status["workspaces"]}

        resources = {str(r.uri) for r in (await session.list_resources()).resources}
        assert resources == {"mtplxd://model", "mtplxd://metrics"}
        templates = [t.uri_template for t in (await session.list_resource_templates()).resource_templates]
        assert templates == ["mtplxd://sessions/{workspace}"]
        model = json.loads((await session.read_resource("mtplxd://model")).contents[0].text)
        assert (model["id"], model["mtp_heads"], model["fill_in_the_middle"]) == ("mimo", 1, True)
        assert model["code_completion"] == "fim-psm"
        metrics = (await session.read_resource("mtplxd://metrics")).contents[0].text
        assert "mtplxd_active_generations" in metrics and 'endpoint="/mcp"' in metrics
        await idle(session)
        figures = await sessions_figures(session, folders.a)
        assert figures["jobs"] >= 3 and figures["warmups"] >= 2 and figures["prompt_tokens"] > 0
        assert figures["session_bank"]["entries"] >= 1 and figures["watched"] is True

        prompts = {p.name: p for p in (await session.list_prompts()).prompts}
        assert set(prompts) == set(PROMPTS)
        for name, arguments in PROMPTS.items():
            rendered = await session.get_prompt(name, arguments)
            assert rendered.messages and next(iter(arguments.values())) in rendered.messages[0].content.text


@pytest.mark.parametrize("transport", ["stdio", "http", "http-auto"])
async def test_cancelling_a_long_generation_empties_the_queue(transport, daemon, folders):
    async with connect(transport, daemon, folders) as session:
        before = await idle(session)
        progressed = anyio.Event()

        async def on_progress(value, total, message):
            if value >= 3:
                progressed.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: session.call_tool("generate", LONG, progress_callback=on_progress))
            with anyio.fail_after(30):
                await progressed.wait()
            assert (await queue(session))["active"] == 1
            tg.cancel_scope.cancel()  # the SDK sends notifications/cancelled
        cancelled_at = time.monotonic()
        after = await idle(session, 5.0)
        assert time.monotonic() - cancelled_at < 2.0
        assert after["cancelled"] == before["cancelled"] + 1
        assert after["completed"] == before["completed"]
        assert after["steps"] - before["steps"] < 500, "the 2000-token job must stop early"
        metrics = (await session.read_resource("mtplxd://metrics")).contents[0].text
        assert "mtplxd_active_generations 0.0" in metrics


async def test_two_clients_in_two_workspaces_keep_separate_caches(daemon, folders, checkpoint):
    """Client one (stdio, its working directory c) and client two (HTTP, workspace d), at once.
    Prompt p then q in c, q then p in d: a prompt the other workspace has cached restores no
    more than the chat template's prefix that p and q share; the workspace's own repeat
    restores nearly all of it. Greedy, so both workspaces' texts for a prompt agree."""
    tokenizer = load_tokenizer(checkpoint)
    p, q = "def fib(n):", "class Stack:"
    ids = [chat_prompt_ids(tokenizer, [{"role": "user", "content": text}]) for text in (p, q)]
    shared = next(i for i, (x, y) in enumerate(zip(*ids)) if x != y)
    c, d = str(folders.c), str(folders.d)

    async def both(one_prompt: str, two_prompt: str) -> tuple[dict, dict]:
        out: dict = {}

        async def run(name, session, arguments):
            out[name] = await call(session, "generate", {**arguments, "max_tokens": 16, "temperature": 0})

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "one", one, {"prompt": one_prompt})  # the shim fills in c
            tg.start_soon(run, "two", two, {"prompt": two_prompt, "workspace": d})
        await idle(one)  # the jobs have closed and offered their caches to the bank
        return out["one"], out["two"]

    async with stdio(daemon.env, folders.c) as one, http(daemon.url, roots=(folders.d,)) as two:
        await idle(one)
        first_c, first_d = await both(p, q)  # new workspaces: nothing cached
        cross_c, cross_d = await both(q, p)  # the other workspace's prompt
        again_c, again_d = await both(p, q)  # its own prompt again
        figures_c, figures_d = await sessions_figures(one, folders.c), await sessions_figures(two, folders.d)
        for session, other in ((one, folders.d), (two, folders.c)):  # each client sees its own workspace only
            with pytest.raises(MCPError, match="refused"):
                await sessions_figures(session, other)
    for out, workspace in ((first_c, c), (cross_c, c), (again_c, c), (first_d, d), (cross_d, d), (again_d, d)):
        assert out["workspace"] == workspace
    assert first_c["usage"]["cached_tokens"] == first_d["usage"]["cached_tokens"] == 0
    assert cross_c["usage"]["cached_tokens"] <= shared and cross_d["usage"]["cached_tokens"] <= shared
    assert again_c["usage"]["cached_tokens"] > shared and again_d["usage"]["cached_tokens"] > shared
    assert first_c["text"] == cross_d["text"] == again_c["text"]  # p, in either workspace
    assert first_d["text"] == cross_c["text"] == again_d["text"]  # q
    for figures in (figures_c, figures_d):  # each reached the scheduler as its own TextRequest.workspace
        assert figures["jobs"] == 3 and figures["session_bank"]["entries"] >= 1
        assert figures["cached_tokens"] > 0 and figures["session_bank"]["hits"] >= 1


async def test_fim_complete_without_fim_tokens_continues_the_prefix(checkpoint, tmp_path):
    """A model without FIM tokens (as SmolLM2's, the default model): fim_complete answers from
    the text before the cursor alone and says so (`suffix_used` false), the model card says
    prefix-only, and a completion at a file's end restores the file's warm-up from the bank."""
    model = drop_fim_tokens(Path(shutil.copytree(checkpoint, tmp_path / "no-fim")))
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "mod.py").write_text(MODULE)
    with running_daemon(tmp_path / "state", model, "--api-key", KEY) as daemon_:
        async with http(daemon_.base_url, roots=(workspace,)) as session:
            card = json.loads((await session.read_resource("mtplxd://model")).contents[0].text)
            assert (card["fill_in_the_middle"], card["code_completion"]) == (False, "prefix-only")
            out = await call(session, "fim_complete", {"workspace": str(workspace), "prefix": "def f(x):\n    ",
                                                       "suffix": "\n", "max_tokens": 8})
            assert out["suffix_used"] is False and out["text"] and out["usage"]["completion_tokens"] > 0

            warm = await call(session, "warm_workspace", {"workspace": str(workspace), "paths": ["mod.py"]})
            assert warm["queued"] == ["mod.py"] and warm["prompt_tokens"] > 0
            await idle(session)
            out = await call(session, "fim_complete", {"workspace": str(workspace), "path": "mod.py",
                                                       "line": MODULE.count("\n"), "character": 0, "max_tokens": 4})
            usage = out["usage"]
            assert out["suffix_used"] is False and usage["prompt_tokens"] == warm["prompt_tokens"] - 1  # healed
            assert usage["cached_tokens"] >= usage["prompt_tokens"] - 1  # all but the token fed again


@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_path_escapes_are_refused(transport, daemon, folders):
    escapes = ["../outside/secret.txt", "pkg/../../outside/secret.txt", str(folders.outside / "secret.txt"),
               "link_out", "linkdir/secret.txt", "/etc/passwd"]
    async with connect(transport, daemon, folders) as session:
        for path in escapes:
            message = await refused(session, "fim_complete", ws_args(transport, folders, path=path, line=0,
                                                                     character=0, max_tokens=4))
            assert "refused" in message, (path, message)
            assert "secret" not in message.replace("secret.txt", "")
            message = await refused(session, "warm_workspace", ws_args(transport, folders, paths=["pkg/mod.py", path]))
            assert "refused" in message, (path, message)
        inside = [str(folders.a / "pkg" / "mod.py"), "pkg/inner_link.py", "./pkg/mod.py"]
        for path in inside:  # absolute inside, a symlink that stays inside, a ./ path
            out = await call(session, "fim_complete", ws_args(transport, folders, path=path, line=0, character=3,
                                                              max_tokens=4))
            assert out["path"] == "pkg/mod.py"
        message = await refused(session, "fim_complete", {"workspace": "relative/dir", "prefix": "x"})
        assert "absolute" in message
        message = await refused(session, "fim_complete", ws_args(transport, folders, path="pkg/mod.py", line=99,
                                                                 character=0))
        assert "past the end" in message
        assert (await call(session, "status", {}))["state"] == "ready"


@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_bad_input_is_an_error_and_the_server_keeps_serving(transport, daemon, folders):
    bad = [
        ("generate", {"prompt": "hi", "max_tokens": "many"}),  # wrong type
        ("generate", {"max_tokens": 4}),  # missing argument
        ("generate", {"prompt": "hi", "max_tokens": 100_000}),  # beyond the cap
        ("generate", {"prompt": "hi", "temperature": 5}),
        ("generate", {"prompt": "x" * 200_001}),  # oversize
        ("generate", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}),
        ("chat", {"messages": []}),
        ("chat", {"messages": [{"role": "robot", "content": "hi"}]}),
        ("fim_complete", ws_args(transport, folders, path="pkg/mod.py")),  # no cursor
        ("fim_complete", ws_args(transport, folders, path="pkg/mod.py", line=0, character=0, prefix="x")),
        ("fim_complete", ws_args(transport, folders, path="missing.py", line=0, character=0)),
        ("warm_workspace", ws_args(transport, folders, paths=[f"f{i}.py" for i in range(65)])),
        ("no_such_tool", {}),
    ]
    async with connect(transport, daemon, folders) as session:
        for tool, arguments in bad:
            message = await refused(session, tool, arguments)
            assert message, (tool, arguments)
        with pytest.raises(MCPError):
            await session.read_resource("mtplxd://nothing")
        with pytest.raises(MCPError):
            await session.get_prompt("no_such_prompt", {})
        assert (await call(session, "generate", {"prompt": "hi", "max_tokens": 2}))["usage"]["completion_tokens"] <= 2


async def test_http_needs_the_api_key_and_guards_against_dns_rebinding(daemon):
    body = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}}
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    with httpx.Client(base_url=daemon.url, timeout=10, trust_env=False) as raw:
        assert raw.post("/mcp", json=body, headers=headers).status_code == 401
        authed = {**headers, "Authorization": f"Bearer {KEY}"}
        assert raw.post("/mcp", json=body, headers={**authed, "Host": "evil.example"}).status_code == 421
        assert raw.post("/mcp", json=body, headers={**authed, "Origin": "http://evil.example"}).status_code == 403
        assert raw.post("/mcp", json=body, headers=authed).status_code == 200
    with pytest.raises(Exception):
        async with http(daemon.url, key="wrong") as session:
            await session.list_tools()


@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_latency_of_a_short_generate(transport, daemon, folders):
    async with connect(transport, daemon, folders) as session:
        await call(session, "generate", {"prompt": "hi", "max_tokens": 16, "temperature": 0})  # warm
        times, inside = [], []
        for _ in range(5):
            started = time.perf_counter()
            out = await call(session, "generate", {"prompt": "hi", "max_tokens": 16, "temperature": 0})
            times.append(time.perf_counter() - started)
            inside.append(out["timings"]["total_s"])  # submit to the last token, in the daemon
            assert out["usage"]["completion_tokens"] == 16
    median = statistics.median(times)
    print(f"\nMCP {transport}: generate of 16 tokens, call latency median {median * 1000:.0f} ms "
          f"(min {min(times) * 1000:.0f}, max {max(times) * 1000:.0f}); "
          f"in the daemon median {statistics.median(inside) * 1000:.0f} ms")
    assert median < 5.0


async def test_the_shim_reconnects_after_the_daemon_restarts(daemon, folders):
    """Last of the daemon tests: it replaces the daemon (the fixture stops whichever runs)."""
    async with stdio(daemon.env, folders.a) as session:
        assert (await call(session, "status", {}))["state"] == "ready"
        before = client.owner_pid(daemon.state_dir)
        code, message = await anyio.to_thread.run_sync(client.stop, daemon.state_dir)
        assert code == 0, message
        out = await call(session, "generate", {"prompt": "hi", "max_tokens": 4})  # starts a new daemon
        assert out["usage"]["completion_tokens"] <= 4
    assert client.owner_pid(daemon.state_dir) not in (None, before)


def test_example_configurations_point_at_mtplxd():
    examples = Path(__file__).resolve().parent.parent / "examples" / "mcp"
    servers = {}
    for name in ("claude-code/stdio/.mcp.json", "claude-code/http/.mcp.json", "cline/cline_mcp_settings.json"):
        servers.update({f"{name}:{k}": v for k, v in json.loads((examples / name).read_text())["mcpServers"].items()})
    vscode = json.loads((examples / "vscode/.vscode/mcp.json").read_text())["servers"]
    servers.update({f"vscode:{k}": v for k, v in vscode.items()})
    for where, server in servers.items():
        if "command" in server:
            assert (server["command"], server["args"][0]) == ("mtplxd", "mcp"), where
        else:
            assert server["url"] == "http://127.0.0.1:8765/mcp", where
    assert {s.get("type") for s in servers.values()} == {"stdio", "http", "streamableHttp"}
    for name in ("mtplxd.yaml", "mtplxd-http.yaml"):
        text = (examples / "continue/.continue/mcpServers" / name).read_text()
        assert "command: mtplxd" in text or "url: http://127.0.0.1:8765/mcp" in text


# -- in-process: a model load the test holds back -----------------------------------------------


async def test_calls_are_bounded_while_the_model_loads_and_while_it_generates(tmp_path, checkpoint, monkeypatch):
    from adapters.mcp import server as adapter
    from mtplxd.daemon import Daemon, load_model

    monkeypatch.setattr(adapter, "MODEL_WAIT_S", 0.3)
    gate = threading.Event()
    daemon = Daemon(Settings(state_dir=tmp_path / "state", port=0, model=checkpoint, calibrate_tokens=0),
                    lambda: gate.wait(30) and load_model(checkpoint))
    async with anyio.create_task_group() as tg:
        tg.start_soon(daemon.serve)
        with anyio.fail_after(20):
            while daemon.port is None:
                await anyio.sleep(0.02)
        try:
            async with http(f"http://127.0.0.1:{daemon.port}", key=None) as session:  # initialize while loading
                assert daemon.scheduler.state == "loading"
                status = await call(session, "status", {})
                assert (status["state"], status["model"]) == ("loading", "mimo")
                progress: list = []
                started = time.monotonic()
                result = await session.call_tool("generate", {"prompt": "hi"}, progress_callback=(
                    lambda v, t, m: _append(progress, m)))
                assert result.is_error and "still loading" in result.content[0].text
                assert time.monotonic() - started < 5
                assert progress == ["waiting for the model to load"]

                monkeypatch.setattr(adapter, "MODEL_WAIT_S", 30.0)
                waiting = anyio.Event()

                async def on_progress(value, total, message):
                    if message == "waiting for the model to load":
                        waiting.set()

                results: list = []

                async def generate():
                    results.append(await session.call_tool("generate", {"prompt": "hi", "max_tokens": 4},
                                                           progress_callback=on_progress))

                tg.start_soon(generate)
                with anyio.fail_after(10):
                    await waiting.wait()
                gate.set()
                with anyio.fail_after(20):
                    while not results:
                        await anyio.sleep(0.02)
                assert not results[0].is_error, results[0].content
                assert results[0].structured_content["usage"]["completion_tokens"] <= 4

                monkeypatch.setattr(adapter, "CALL_BUDGET_S", 1.0)  # a call's time budget runs out
                started = time.monotonic()
                out = await call(session, "generate", LONG)
                assert out["finish_reason"] == "time_limit" and 0 < out["usage"]["completion_tokens"] < 2000
                assert time.monotonic() - started < 3
                with anyio.fail_after(5):  # and the job has left the queue
                    while daemon.scheduler.stats().active:
                        await anyio.sleep(0.02)
        finally:
            gate.set()
            daemon.shutdown()


async def _append(items: list, value) -> None:
    items.append(value)
