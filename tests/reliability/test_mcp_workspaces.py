"""Which folders the MCP tools may use, through the `mcp` SDK's real client against a real daemon.

A tool call names a workspace; it is used only when it is (inside) a root the MCP client
declared, a folder an editor opened over LSP, or a folder of the `workspaces` setting
(MTPLXD_WORKSPACES here). Real paths are compared, so a symlink cannot bring a folder in.
Everything else is a tool error that says how to allow the folder.

One daemon (`mtplxd start`, a tiny MiMo checkpoint, MTPLXD_WORKSPACES=<configured>) serves
every test: Streamable HTTP clients in the handshake era (`legacy`, what agents use) and in
the SDK's default mode (`auto`, roots then travel in input_required rounds), the stdio shim
`mtplxd mcp`, and a pygls LanguageClient through `mtplxd lsp`.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

import anyio
import httpx2
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp.types import ListRootsResult, Root

from tests.checkpoints import write
from tests.daemon_fixture import daemon_env, mtplxd_command, running_daemon
from tests.test_lsp import lsp

pytestmark = pytest.mark.anyio

SETTING_HINTS = ("MCP client", "LSP", "`workspaces` setting", "config.toml", "MTPLXD_WORKSPACES")
MODULE = "def add(a, b):\n    return a + b\n"


@pytest.fixture
def anyio_backend():
    return "asyncio"  # pygls runs on asyncio


@dataclass
class Folders:
    root: Path  # declared as an MCP root by the clients that declare one
    project: Path  # inside root
    outside: Path  # declared nowhere
    link_out: Path  # inside root, a symlink to `outside`
    configured: Path  # in MTPLXD_WORKSPACES
    editor: Path  # opened over LSP by the test that needs it
    shim_cwd: Path  # the stdio shim's working directory


@dataclass
class Daemon:
    url: str
    state_dir: Path


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Folders:
    base = tmp_path_factory.mktemp("folders")
    f = Folders(base / "root", base / "root" / "project", base / "outside", base / "root" / "link_out",
                base / "configured", base / "editor", base / "shim-cwd")
    for folder in (f.project, f.outside, f.configured / "sub", f.editor, f.shim_cwd):
        folder.mkdir(parents=True)
    for folder in (f.project, f.outside, f.configured / "sub", f.editor, f.shim_cwd):
        (folder / "mod.py").write_text(MODULE)
    f.link_out.symlink_to(f.outside, target_is_directory=True)
    return f


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write("mimo", tmp_path_factory.mktemp("ck") / "mimo", mtp_heads=1)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, folders, checkpoint) -> Daemon:
    state_dir = tmp_path_factory.mktemp("state")
    with running_daemon(state_dir, checkpoint, env={"MTPLXD_WORKSPACES": str(folders.configured)}) as info:
        yield Daemon(info.base_url, state_dir)


# -- clients ---------------------------------------------------------------------------------


class Roots:
    """What a client answers to roots/list (changeable), and how often it was asked."""

    def __init__(self, *folders: Path):
        self.folders = list(folders)
        self.asked = 0

    async def __call__(self, context) -> ListRootsResult:
        self.asked += 1
        return ListRootsResult(roots=[Root(uri=folder.as_uri()) for folder in self.folders])


@contextlib.asynccontextmanager
async def http(daemon: Daemon, mode: str = "legacy", roots: Roots | None = None) -> AsyncIterator[Client]:
    async with httpx2.AsyncClient(timeout=httpx2.Timeout(30.0, read=120.0), trust_env=False) as h:
        async with Client(streamable_http_client(daemon.url + "/mcp", http_client=h), mode=mode,
                          list_roots_callback=roots) as session:
            yield session


@contextlib.asynccontextmanager
async def stdio(daemon: Daemon, cwd: Path, roots: Roots | None = None) -> AsyncIterator[Client]:
    command = mtplxd_command()
    env = daemon_env({"MTPLXD_HOME": str(daemon.state_dir)})  # finds the running daemon: no setting of its own
    params = StdioServerParameters(command=command[0], args=[*command[1:], "mcp"], env=env, cwd=str(cwd))
    async with Client(params, mode="legacy", list_roots_callback=roots) as session:
        yield session


async def fim(session: Client, workspace: Path | str | None, path: str = "mod.py") -> dict:
    """fim_complete at the start of `path` in `workspace` (None: the shim's default)."""
    arguments = {"path": path, "line": 1, "character": 4, "max_tokens": 1}
    if workspace is not None:
        arguments["workspace"] = str(workspace)
    result = await session.call_tool("fim_complete", arguments)
    assert not result.is_error, result.content
    return result.structured_content


async def refused(session: Client, tool: str, arguments: dict) -> str:
    """The tool error's message (a protocol error fails the test: it is not how refusals look)."""
    result = await session.call_tool(tool, arguments)
    assert result.is_error, result.structured_content
    return result.content[0].text


def assert_explains(message: str, folder: Path | str) -> None:
    assert str(folder) in message, message
    for hint in SETTING_HINTS:
        assert hint in message, (hint, message)


# -- the tests -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_the_filesystem_root_is_refused(daemon, folders, mode):
    """The hole: a call naming `/` and `etc/passwd` read any file. A client that declares
    no roots, and one whose roots are elsewhere, are both refused; tools that touch no
    files still work without a workspace."""
    for roots in (None, Roots(folders.root)):
        async with http(daemon, mode, roots) as session:
            message = await refused(session, "fim_complete", {"workspace": "/", "path": "etc/passwd", "line": 0,
                                                              "character": 0, "max_tokens": 1})
            assert_explains(message, "/")
            assert "root:x:" not in message  # nothing of the file
            message = await refused(session, "warm_workspace", {"workspace": "/", "paths": ["etc/passwd"]})
            assert_explains(message, "/")
            message = await refused(session, "generate", {"prompt": "hi", "max_tokens": 1, "workspace": "/"})
            assert_explains(message, "/")
            out = (await session.call_tool("generate", {"prompt": "hi", "max_tokens": 1})).structured_content
            assert out["workspace"] is None and out["usage"]["completion_tokens"] <= 1
            assert (await session.call_tool("status", {})).structured_content["state"] == "ready"


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_a_declared_root_is_accepted_and_a_folder_outside_it_refused(daemon, folders, mode):
    roots = Roots(folders.root)
    async with http(daemon, mode, roots) as session:
        assert (await fim(session, folders.root, "project/mod.py"))["path"] == "project/mod.py"
        out = await fim(session, folders.project)  # inside the root
        assert out["workspace"] == str(folders.project) and out["path"] == "mod.py"
        warm = (await session.call_tool("warm_workspace", {"workspace": str(folders.project)})).structured_content
        assert warm["queued"] == ["mod.py"]
        for tool, arguments in (("fim_complete", {"path": "mod.py", "line": 0, "character": 0}),
                                ("warm_workspace", {}), ("generate", {"prompt": "hi", "max_tokens": 1})):
            message = await refused(session, tool, {**arguments, "workspace": str(folders.outside)})
            assert_explains(message, folders.outside)
    assert roots.asked >= 1


async def test_a_symlink_inside_a_root_pointing_outside_is_refused(daemon, folders):
    async with http(daemon, roots=Roots(folders.root)) as session:
        message = await refused(session, "fim_complete", {"workspace": str(folders.link_out), "path": "mod.py",
                                                          "line": 0, "character": 0})
        assert_explains(message, folders.link_out)
        assert str(folders.outside) in message  # where it really leads
        message = await refused(session, "warm_workspace", {"workspace": str(folders.link_out)})
        assert_explains(message, folders.link_out)
    # a root declared through the symlink is the real folder it leads to: that folder, not its neighbours
    async with http(daemon, roots=Roots(folders.link_out)) as session:
        assert (await fim(session, folders.link_out))["workspace"] == str(folders.link_out)
        assert_explains(await refused(session, "warm_workspace", {"workspace": str(folders.root)}), folders.root)


@pytest.mark.filterwarnings("ignore::mcp.shared.exceptions.MCPDeprecationWarning")  # roots: deprecated in 2026-07-28
async def test_roots_are_asked_once_per_session_and_again_after_list_changed(daemon, folders):
    roots = Roots(folders.root)
    async with http(daemon, roots=roots) as session:
        await fim(session, folders.project)
        await fim(session, folders.project)
        assert roots.asked == 1
        roots.folders = [folders.outside]  # the user changed the client's roots
        await session.send_roots_list_changed()
        with anyio.fail_after(10):
            while True:  # a notification has no reply: the next calls see it once it has arrived
                result = await session.call_tool("fim_complete", {"workspace": str(folders.outside), "path": "mod.py",
                                                                  "line": 0, "character": 0, "max_tokens": 1})
                if not result.is_error:
                    break
                await anyio.sleep(0.05)
        assert roots.asked == 2
        assert_explains(await refused(session, "warm_workspace", {"workspace": str(folders.project)}), folders.project)


async def test_a_folder_of_the_workspaces_setting_is_accepted(daemon, folders):
    async with http(daemon) as session:  # declares no roots
        assert (await fim(session, folders.configured, "sub/mod.py"))["workspace"] == str(folders.configured)
        assert (await fim(session, folders.configured / "sub"))["workspace"] == str(folders.configured / "sub")
        assert_explains(await refused(session, "warm_workspace", {"workspace": str(folders.root)}), folders.root)


async def test_a_folder_opened_in_an_editor_over_lsp_is_accepted(daemon, folders):
    async with http(daemon) as session:
        assert_explains(await refused(session, "warm_workspace", {"workspace": str(folders.editor)}), folders.editor)
        env = daemon_env({"MTPLXD_HOME": str(daemon.state_dir)})
        async with lsp(env, folders.editor):  # an editor with the folder open, connected to the daemon
            out = await fim(session, folders.editor)
            assert out["workspace"] == str(folders.editor) and out["path"] == "mod.py"


async def test_a_folder_the_registry_has_from_an_editor_is_accepted(tmp_path, folders, checkpoint):
    """What the LSP adapter tells the registry (WorkspaceRegistry.open_in_editor), on a daemon
    run in-process so the test can reach its registry."""
    from mtplxd.config import Settings
    from mtplxd.daemon import Daemon as InProcess

    daemon = InProcess(Settings(state_dir=tmp_path / "state", port=0, model=checkpoint, calibrate_tokens=0))
    async with anyio.create_task_group() as tg:
        tg.start_soon(daemon.serve)
        try:
            with anyio.fail_after(30):
                while daemon.port is None:
                    await anyio.sleep(0.02)
            async with http(Daemon(f"http://127.0.0.1:{daemon.port}", tmp_path / "state")) as session:
                message = await refused(session, "warm_workspace", {"workspace": str(folders.editor)})
                assert_explains(message, folders.editor)
                daemon.workspaces.open_in_editor(str(folders.editor))
                out = await fim(session, folders.editor)
                assert out["workspace"] == str(folders.editor) and out["path"] == "mod.py"
        finally:
            daemon.shutdown()


async def test_the_stdio_shims_working_directory_is_accepted_without_configuration(daemon, folders):
    async with stdio(daemon, folders.shim_cwd) as session:  # an agent that declares no roots
        out = await fim(session, None)  # the shim fills in its working directory
        assert out["workspace"] == str(folders.shim_cwd) and out["path"] == "mod.py"
        out = (await session.call_tool("generate", {"prompt": "hi", "max_tokens": 1})).structured_content
        assert out["workspace"] == str(folders.shim_cwd)
        assert_explains(await refused(session, "warm_workspace", {"workspace": str(folders.outside)}),
                        folders.outside)
    roots = Roots(folders.root)
    async with stdio(daemon, folders.project, roots) as session:  # an agent that declares its own roots
        assert (await fim(session, None))["workspace"] == str(folders.project)
        assert (await fim(session, folders.root, "project/mod.py"))["workspace"] == str(folders.root)
        assert_explains(await refused(session, "warm_workspace", {"workspace": str(folders.shim_cwd)}),
                        folders.shim_cwd)  # not the shim's own folder then: the agent's roots say where
    assert roots.asked >= 1


async def test_a_refused_call_is_not_a_protocol_error(daemon, folders):
    """Agents show a tool error to their model; a JSON-RPC error would end the turn."""
    async with http(daemon) as session:
        try:
            await session.call_tool("fim_complete", {"workspace": str(folders.outside), "prefix": "x"})
        except MCPError as e:  # pragma: no cover - the failure being guarded against
            pytest.fail(f"a protocol error instead of a tool error: {e}")


# -- the sessions resource -------------------------------------------------------------------


def sessions_uri(folder: Path | str) -> str:
    return "mtplxd://sessions/" + urllib.parse.quote(str(folder), safe="")


async def resource_refused(session: Client, folder: Path | str) -> str:
    with pytest.raises(MCPError) as refusal:
        await session.read_resource(sessions_uri(folder))
    return refusal.value.message


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_the_sessions_resource_answers_only_for_allowed_folders(daemon, folders, mode):
    """The figures of a folder this client may not use (`/etc`, a folder outside its roots, a
    symlink out of them) are refused as a tool call naming it would be (before: any folder
    answered with its counts). The client's roots are asked as tools ask them: over the
    back-channel (`legacy`), in an input_required round (`auto`)."""
    fresh = folders.root / f"fresh-{mode}"  # never named by a call before
    fresh.mkdir(exist_ok=True)
    roots = Roots(folders.root)
    async with http(daemon, mode, roots) as session:
        for folder in ("/etc", folders.outside, folders.link_out):
            assert_explains(await resource_refused(session, folder), folder)
        figures = json.loads((await session.read_resource(sessions_uri(fresh))).contents[0].text)
        assert figures["workspace"] == str(fresh) and figures["jobs"] == 0
        configured = json.loads((await session.read_resource(sessions_uri(folders.configured))).contents[0].text)
        assert configured["workspace"] == str(folders.configured)
        await fim(session, folders.project)
        figures = json.loads((await session.read_resource(sessions_uri(folders.project))).contents[0].text)
        assert figures["workspace"] == str(folders.project) and figures["jobs"] >= 1
    assert roots.asked >= 1


async def test_the_sessions_resource_over_the_stdio_shim(daemon, folders, tmp_path):
    async with stdio(daemon, tmp_path) as session:  # the shim declares its working directory
        assert json.loads((await session.read_resource(sessions_uri(tmp_path))).contents[0].text)["jobs"] == 0
        assert_explains(await resource_refused(session, folders.outside), folders.outside)


# -- a folder swapped for a symlink while calls read ------------------------------------------

INSIDE, OUTSIDE = "x = 1\n", "SECRET = 'outside the workspace'\n" * 400
RACE_S = 3.0


@contextlib.contextmanager
def swapping(folder: Path, elsewhere: Path):
    """A thread that, in a loop until the block ends, swaps `folder` for a symlink to
    `elsewhere` and back: what an attacker with write access to the workspace would race."""
    stop = threading.Event()
    swaps = [0]

    def swap() -> None:
        kept = folder.with_name(folder.name + ".real")
        while not stop.is_set():
            folder.rename(kept)
            folder.symlink_to(elsewhere, target_is_directory=True)
            folder.unlink()
            kept.rename(folder)
            swaps[0] += 1

    thread = threading.Thread(target=swap, daemon=True)
    thread.start()
    try:
        yield swaps
    finally:
        stop.set()
        thread.join(10)


@pytest.fixture
def race(tmp_path) -> tuple[Path, Path]:
    """A workspace whose `sub/mod.py` is a short file, and an outside folder whose `mod.py`,
    at the same relative path, is a long secret."""
    workspace, outside = tmp_path / "ws", tmp_path / "outside"
    (workspace / "sub").mkdir(parents=True)
    outside.mkdir()
    (workspace / "sub" / "mod.py").write_text(INSIDE)
    (outside / "mod.py").write_text(OUTSIDE)
    return workspace, outside


async def test_a_folder_swapped_for_a_symlink_is_never_followed(race):
    """`resolve_path` checks, then the read opens each component with O_NOFOLLOW from a folder
    descriptor: every read is the inside file or a refusal, never the outside one."""
    from mcp.server.mcpserver.exceptions import ToolError

    from adapters.mcp.paths import Folder, read_text, resolve_path

    workspace, outside = race
    folder = Folder(str(workspace), str(workspace))
    read, refused_reads = 0, 0
    with swapping(workspace / "sub", outside) as swaps:
        deadline = time.monotonic() + RACE_S
        while time.monotonic() < deadline:
            try:
                assert read_text(resolve_path(folder, "sub/mod.py")) == INSIDE
                read += 1
            except ToolError:
                refused_reads += 1
    assert swaps[0] > 100 and read > 0 and refused_reads > 0, (swaps, read, refused_reads)


async def test_calls_racing_a_symlink_swap_never_read_outside(daemon, race):
    """The same race through the real client: fim_complete on the file while its folder is
    swapped; the long outside file would show in the prompt's token count."""
    workspace, outside = race
    async with http(daemon, roots=Roots(workspace)) as session:
        inside_tokens = (await fim(session, workspace, "sub/mod.py"))["usage"]["prompt_tokens"]
        outcomes = {"read": 0, "refused": 0}
        with swapping(workspace / "sub", outside):
            deadline = time.monotonic() + RACE_S
            while time.monotonic() < deadline:
                result = await session.call_tool("fim_complete", {"workspace": str(workspace), "path": "sub/mod.py",
                                                                  "line": 0, "character": 2, "max_tokens": 1})
                if result.is_error:
                    outcomes["refused"] += 1
                    assert "SECRET" not in result.content[0].text
                else:
                    outcomes["read"] += 1
                    assert result.structured_content["usage"]["prompt_tokens"] == inside_tokens
    assert outcomes["read"] + outcomes["refused"] >= 10, outcomes
