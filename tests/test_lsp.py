"""The LSP adapter through pygls' real `LanguageClient`, spawning `mtplxd lsp` over stdio.

The first `mtplxd lsp` of the module starts the daemon itself (as an editor's
would), on a temporary state dir and a tiny MiMo checkpoint passed by environment
(MTPLXD_HOME, MTPLXD_MODEL, MTPLXD_PORT=0); every later client shares it. A second
daemon serves the same model with a tokenizer without FIM tokens (as SmolLM2's):
prefix-only prompts. The post-processing rules, settings and prompts are also tested
directly, without a daemon, at the end of the file.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import shutil
import time
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import pytest
from lsprotocol import types
from pygls.exceptions import JsonRpcException
from pygls.lsp.client import LanguageClient

from adapters.lsp.documents import ContextDocument, Options, PromptBuilder, snapshot, workspace_of
from adapters.lsp.completions import snippet_text
from adapters.lsp.postprocess import (
    Cursor, TypeAheadCache, automatic_allowed, detect_indent_unit, finalize, line_break_at_rest, suffix_start, trim,
)
from mtplxd import client as daemon_client
from tests.checkpoints import write
from tests.checkpoints.common import drop_fim_tokens
from tests.daemon_fixture import daemon_env, mtplxd_command

CANCELLED, CONTENT_MODIFIED, INVALID_PARAMS, METHOD_NOT_FOUND = -32800, -32801, -32602, -32601
INVOKED, AUTOMATIC = types.InlineCompletionTriggerKind.Invoked, types.InlineCompletionTriggerKind.Automatic
SOURCE = "def add(a, b):\n    return \n"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write("mimo", tmp_path_factory.mktemp("ck") / "mimo", mtp_heads=1)


@pytest.fixture(scope="module")
def lsp_env(checkpoint, tmp_path_factory):
    """The environment an editor would give `mtplxd lsp`; stops the daemon it starts."""
    state = tmp_path_factory.mktemp("lsp-state")
    yield daemon_env({"MTPLXD_HOME": str(state), "MTPLXD_MODEL": str(checkpoint), "MTPLXD_PORT": "0"})
    daemon_client.stop(state)


@pytest.fixture(scope="module")
def no_fim_checkpoint(checkpoint, tmp_path_factory) -> Path:
    """The same model, its tokenizer without FIM tokens (as SmolLM2's, the default model)."""
    folder = tmp_path_factory.mktemp("ck-no-fim") / "mimo"
    shutil.copytree(checkpoint, folder)
    return drop_fim_tokens(folder)


@pytest.fixture(scope="module")
def no_fim_env(no_fim_checkpoint, tmp_path_factory):
    """`lsp_env` for a daemon serving the model without FIM tokens."""
    state = tmp_path_factory.mktemp("lsp-state-no-fim")
    yield daemon_env({"MTPLXD_HOME": str(state), "MTPLXD_MODEL": str(no_fim_checkpoint), "MTPLXD_PORT": "0"})
    daemon_client.stop(state)


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def folders(tmp_path) -> dict[str, Path]:
    out = {}
    for name in ("a", "b", "c"):
        out[name] = tmp_path / f"ws-{name}"
        out[name].mkdir()
    return out


@asynccontextmanager
async def lsp(env: dict, *folders: Path, inline: bool = True, options: dict | None = None,
              encodings: list[str] | None = None):
    """A client spawned as editors spawn us: yields (client, InitializeResult)."""
    client = LanguageClient("mtplxd-tests", "1")
    await client.start_io(*mtplxd_command(), "lsp", env=env)
    text = types.TextDocumentClientCapabilities(
        synchronization=types.TextDocumentSyncClientCapabilities(),
        inline_completion=types.InlineCompletionClientCapabilities() if inline else None,
        completion=None if inline else types.CompletionClientCapabilities(),
    )
    capabilities = types.ClientCapabilities(
        text_document=text,
        workspace=types.WorkspaceClientCapabilities(workspace_folders=True, configuration=True),
        general=types.GeneralClientCapabilities(position_encodings=encodings) if encodings else None,
    )
    try:
        result = await asyncio.wait_for(client.initialize_async(types.InitializeParams(
            capabilities=capabilities, initialization_options=options,
            workspace_folders=[types.WorkspaceFolder(f.as_uri(), f.name) for f in folders],
        )), 60)
        client.initialized(types.InitializedParams())
        yield client, result
        await asyncio.wait_for(client.shutdown_async(None), 10)
        client.exit(None)
        await asyncio.wait_for(client._server.wait(), 10)  # the bridge ends with the connection
    finally:
        if client._server is not None and client._server.returncode is None:
            client._server.kill()
        await client.stop()


def open_doc(client, path: Path, text: str, version: int = 1) -> str:
    uri = path.as_uri()
    client.text_document_did_open(types.DidOpenTextDocumentParams(types.TextDocumentItem(uri, "python", version, text)))
    return uri


def edit(client, uri: str, version: int, line: int, character: int, text: str, end: tuple | None = None) -> None:
    start = types.Position(line, character)
    stop = types.Position(*end) if end else start
    change = types.TextDocumentContentChangePartial(range=types.Range(start, stop), text=text)
    client.text_document_did_change(types.DidChangeTextDocumentParams(
        types.VersionedTextDocumentIdentifier(version=version, uri=uri), [change]))


def inline(client, uri: str, line: int, character: int, kind=INVOKED, msg_id: str | None = None):
    params = types.InlineCompletionParams(
        context=types.InlineCompletionContext(trigger_kind=kind),
        text_document=types.TextDocumentIdentifier(uri), position=types.Position(line, character))
    return client.protocol.send_request_async(types.TEXT_DOCUMENT_INLINE_COMPLETION, params, msg_id=msg_id)


async def texts(client, uri: str, line: int, character: int, kind=INVOKED) -> list[str]:
    result = await asyncio.wait_for(inline(client, uri, line, character, kind), 30)
    return [item.insert_text for item in result.items]


async def status(client, uri: str | None = None) -> dict:
    return await asyncio.wait_for(client.workspace_execute_command_async(
        types.ExecuteCommandParams("mtplxd.status", [uri] if uri else None)), 10)


async def wait_for(client, check, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        report = await status(client)
        if check(report) or time.monotonic() > deadline:
            return report
        await asyncio.sleep(0.02)


async def error_code(awaitable) -> int:
    with pytest.raises(JsonRpcException) as caught:
        await asyncio.wait_for(awaitable, 30)
    return caught.value.code


def idle(report: dict) -> bool:
    queue = report["scheduler"]
    return queue["active"] == 0 and not any(queue["queued_by_class"].values())


# -- through the real client ---------------------------------------------------------


@pytest.mark.anyio
async def test_initialize_sync_and_inline_completion(lsp_env, folders):
    async with lsp(lsp_env, folders["a"]) as (client, init):
        caps = init.capabilities
        assert caps.inline_completion_provider is not None and caps.completion_provider is None
        assert caps.text_document_sync.change == types.TextDocumentSyncKind.Incremental
        assert caps.position_encoding == types.PositionEncodingKind.Utf16
        state = Path(lsp_env["MTPLXD_HOME"])
        assert daemon_client.owner_pid(state) is not None  # `mtplxd lsp` started it
        assert (state / "lsp.sock").stat().st_mode & 0o777 == 0o600

        uri = open_doc(client, folders["a"] / "m.py", "def add(a, b):\n")
        edit(client, uri, 2, 1, 0, "    return \n")  # incremental: the line exists only after the edit
        end_of_line = await texts(client, uri, 1, 11)
        assert len(end_of_line) == 1 and end_of_line[0].strip()
        assert not any(not line.strip() for line in end_of_line[0].split("\n")[1:]), "stops at a blank line"
        [mid_line] = await texts(client, uri, 0, 8)  # before "add(a, b):": completes this line only
        assert mid_line.strip() and "\n" not in mid_line
        assert await texts(client, uri, 0, 4, AUTOMATIC) == []  # 9 characters right of the cursor
        report = await status(client, uri)
        assert report["connection"]["skipped"] == 1 and report["connection"]["jobs_started"] == 2
        assert report["document"] == {"uri": uri, "open": True, "version": 2, "workspace": str(folders["a"])}

        client.text_document_did_close(types.DidCloseTextDocumentParams(types.TextDocumentIdentifier(uri)))
        assert await error_code(inline(client, uri, 0, 0)) == INVALID_PARAMS


@pytest.mark.anyio
async def test_completion_fallback_without_inline_capability(lsp_env, folders):
    async with lsp(lsp_env, folders["a"], inline=False) as (client, init):
        assert init.capabilities.inline_completion_provider is None
        assert init.capabilities.completion_provider is not None
        uri = open_doc(client, folders["a"] / "f.py", SOURCE)
        position = types.Position(1, 11)
        result = await asyncio.wait_for(client.text_document_completion_async(types.CompletionParams(
            text_document=types.TextDocumentIdentifier(uri), position=position)), 30)
        [item] = result.items
        assert item.text_edit.range == types.Range(position, position) and item.text_edit.new_text.strip()
        assert item.insert_text_format == types.InsertTextFormat.PlainText  # no snippet support declared
        assert result.is_incomplete  # re-asked as the user types


@pytest.mark.anyio
async def test_storm_of_requests_only_the_newest_is_answered(lsp_env, folders):
    async with lsp(lsp_env, folders["a"]) as (client, _):
        uri = open_doc(client, folders["a"] / "storm.py", "def add(a, b):\n    ")
        typed = "total = sum(x for x in range(10) if x % 2 == 0) + 1"
        futures = []
        for i in range(50):  # one keystroke, one automatic request, 50 times, as fast as we can
            edit(client, uri, i + 2, 1, 4 + i, typed[i])
            futures.append(inline(client, uri, 1, 5 + i, AUTOMATIC))
        results = await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), 60)
        *older, newest = results
        assert not isinstance(newest, Exception) and newest.items and newest.items[0].insert_text.strip()
        assert all(isinstance(r, JsonRpcException) and r.code == CANCELLED for r in older), older
        report = await wait_for(client, idle)
        assert idle(report) and report["pending"] == 0
        assert report["connection"]["cancelled"] == 49 and report["connection"]["answered"] == 1
        jobs = report["connection"]
        assert jobs["jobs_completed"] == 1 and jobs["jobs_started"] == 1 + jobs["jobs_cancelled"], jobs
        assert jobs["jobs_started"] < 25, jobs  # the debounce kept the engine out of most of it


@pytest.mark.anyio
async def test_edit_or_cancel_while_generating_reaches_the_scheduler(lsp_env, folders):
    long = {"mtplxd": {"maxTokens": 2000, "timeBudgetMs": 60000}}
    async with lsp(lsp_env, folders["a"], options=long) as (client, _):
        uri = open_doc(client, folders["a"] / "long.py", "x = 1\ny = ")

        def generating(report):
            return report["pending"] == 1 and report["scheduler"]["active"] >= 1

        pending = inline(client, uri, 1, 4)
        assert generating(await wait_for(client, generating))
        edit(client, uri, 2, 1, 4, "2")  # the document moves on: that result must never arrive
        assert await error_code(pending) in (CANCELLED, CONTENT_MODIFIED)
        assert idle(await wait_for(client, idle))

        pending = inline(client, uri, 1, 5, msg_id="cancel-me")
        assert generating(await wait_for(client, generating))
        client.protocol.notify(types.CANCEL_REQUEST, types.CancelParams(id="cancel-me"))
        assert await error_code(pending) == CANCELLED
        report = await wait_for(client, idle)
        assert idle(report) and report["connection"]["jobs_cancelled"] == 2 and report["connection"]["answered"] == 0


@pytest.mark.anyio
async def test_type_ahead_and_settings(lsp_env, folders):
    async with lsp(lsp_env, folders["a"]) as (client, _):
        uri = open_doc(client, folders["a"] / "t.py", SOURCE)
        [first] = await texts(client, uri, 1, 11)
        assert len(first) >= 2
        edit(client, uri, 2, 1, 11, first[0])  # the user types the suggestion's first character
        assert await texts(client, uri, 1, 12, AUTOMATIC) == [first[1:]]
        report = await status(client)
        assert report["connection"]["cache_hits"] == 1 and report["connection"]["jobs_started"] == 1

        client.workspace_did_change_configuration(types.DidChangeConfigurationParams({"mtplxd": {"enable": False}}))
        assert await texts(client, uri, 1, 12) == []
        client.workspace_did_change_configuration(types.DidChangeConfigurationParams(
            {"mtplxd": {"enable": True, "debounceMs": "soon"}}))  # a bad value is ignored, with a warning
        report = await status(client)
        assert report["options"]["enable"] is True and report["options"]["debounceMs"] == 120


@pytest.mark.anyio
async def test_the_debounce_follows_the_typist(lsp_env, folders):
    for gap_s, options, expected in ((0.03, None, (20, 100)), (0.3, None, (120, 120)),
                                     (0.03, {"mtplxd": {"clientDebounces": True}}, (0, 0)),
                                     (0.03, {"mtplxd": {"adaptiveDebounce": False}}, (120, 120))):
        async with lsp(lsp_env, folders["a"], options=options) as (client, _):
            uri = open_doc(client, folders["a"] / "pace.py", "x = 1\n")
            for i, ch in enumerate("value = compute(1)"):  # a typist: one edit per gap
                edit(client, uri, i + 2, 1, i, ch)
                await asyncio.sleep(gap_s)
            wait_ms = (await status(client))["debounceMs"]
            assert expected[0] <= wait_ms <= expected[1], (gap_s, options, wait_ms)


@pytest.mark.anyio
async def test_the_length_fits_the_place(lsp_env, folders):
    options = {"mtplxd": {"lineMaxTokens": 3, "maxTokens": 40}}
    async with lsp(lsp_env, folders["a"], options=options) as (client, _):
        uri = open_doc(client, folders["a"] / "place.py", "def f(a, b):\n    return a\n")
        await texts(client, uri, 1, 10)  # mid-line: the text right of the cursor is "a"
        assert (await status(client))["lastPlace"] == {"mode": "line", "maxTokens": 3}
        await texts(client, uri, 2, 0)  # an empty line: a block
        assert (await status(client))["lastPlace"] == {"mode": "block", "maxTokens": 40}


@pytest.mark.anyio
async def test_a_block_is_shown_at_a_closed_line_break_once_the_budget_is_spent(lsp_env, folders):
    """With the time budget spent at once, a block ends at its first line break where its
    brackets balance; given all the time it wants, the same greedy block goes on from there."""
    shown = {}
    for budget in (0, 60000):
        options = {"mtplxd": {"timeBudgetMs": budget, "maxTokens": 40, "prefetch": False}}
        async with lsp(lsp_env, folders["a"], options=options) as (client, _):
            uri = open_doc(client, folders["a"] / "early.py", "def f(a, b):\n    \n")
            shown[budget] = "".join(await texts(client, uri, 1, 4))
    early, whole = shown[0], shown[60000]
    assert early.strip(), shown  # a suggestion came
    assert whole.startswith(early), (early, whole)
    assert line_break_at_rest(early, 1) is None  # no closed line break left inside it
    cut = line_break_at_rest(whole, 1)
    assert len(early) == (len(whole) if cut is None else cut), (early, whole)


@pytest.mark.anyio
@pytest.mark.parametrize("budget_ms, shown", [(0, "a = f(1,\n      2)"), (60000, "a = f(1,\n      2)\n    b = 3")])
async def test_a_spent_budget_ends_the_streamed_block_at_a_closed_line_break(budget_ms, shown):
    """`generate` on a scripted stream (the daemon test above runs the real engine, whose
    tiny model writes no line breaks): spent at once, the block ends after the call's
    closing line, not inside it; with time left, the blank line ends it."""
    from adapters.lsp.completions import ConnectionStats, generate
    from mtplxd.requests import Ticket, TextDelta

    send, receive = anyio.create_memory_object_stream(100)
    for piece in ("a = f(1,", "\n", "      2)", "\n", "    b = 3", "\n\n", "c"):
        send.send_nowait(TextDelta(piece, (1,)))
    send.close()

    class Runtime:
        def submit(self, request, client=""):
            return Ticket(1, receive, lambda: None)

    block = Cursor("    ", "", prev_line="def g():")
    done = await generate(Runtime(), None, block, budget_ms, ConnectionStats())  # type: ignore[arg-type]
    assert done.text == shown


def test_where_a_block_may_end_early():
    assert line_break_at_rest("a = 1\nb = 2\n", 1) == 5
    assert line_break_at_rest("a = f(1,\n      2)\nb", 1) == 17  # not inside the call
    assert line_break_at_rest("a = f(1,\n", 1) is None
    assert line_break_at_rest("x)\ny", 0) == 2  # a bracket opened before the cursor does not count
    assert line_break_at_rest("a\nb\nc", 2) == 3  # at or after `start`


def _end_of(line: int, character: int, inserted: str) -> tuple[int, int]:
    """The position after `inserted` typed at (line, character) (ASCII text)."""
    rows = inserted.split("\n")
    return line + len(rows) - 1, (character if len(rows) == 1 else 0) + len(rows[-1])


@pytest.mark.anyio
async def test_an_accept_raises_its_waiting_prefetch_to_interactive(lsp_env, folders):
    """Behind a normal-priority stream a background prefetch stays queued (a lone stream is
    always picked first); the accept raises it to interactive priority, and it answers."""
    from mtplxd.bench.serve import busy_streams

    async with lsp(lsp_env, folders["a"]) as (client, _):
        uri = open_doc(client, folders["a"] / "late.py", "def add(a, b):\n    ")
        base_url = daemon_client.daemon_url(Path(lsp_env["MTPLXD_HOME"]))
        assert base_url is not None
        with busy_streams(base_url, 1):
            [shown] = await texts(client, uri, 1, 4)
            jobs = (await status(client))["connection"]["jobs_started"]
            edit(client, uri, 2, 1, 4, shown)  # accepted at once
            await asyncio.wait_for(texts(client, uri, *_end_of(1, 4, shown), AUTOMATIC), 60)
            report = await status(client)
        connection = report["connection"]
        assert connection["prefetch_raised"] == 1 and connection["prefetch_hits"] == 1, connection
        assert connection["answered"] == 2 and connection["jobs_started"] == jobs  # no job of its own


@pytest.mark.anyio
async def test_an_accepted_suggestion_is_followed_by_a_prefetched_one(lsp_env, folders):
    done = lambda report: report["prefetchJobs"]["jobs_completed"] + report["prefetchJobs"]["jobs_cancelled"] >= 1  # noqa: E731
    async with lsp(lsp_env, folders["a"]) as (client, _):
        uri = open_doc(client, folders["a"] / "accept.py", "def add(a, b):\n    ")
        [shown] = await texts(client, uri, 1, 4)
        report = await wait_for(client, done, 30)  # computed ahead, at background priority
        assert report["connection"]["prefetch_started"] == 1 and report["prefetchJobs"]["jobs_completed"] == 1
        jobs = report["connection"]["jobs_started"]
        edit(client, uri, 2, 1, 4, shown)  # the user accepts the suggestion whole
        await texts(client, uri, *_end_of(1, 4, shown), AUTOMATIC)
        report = await status(client)
        assert report["connection"]["prefetch_hits"] == 1  # answered from the prefetch ...
        assert report["connection"]["jobs_started"] == jobs  # ... without a job of its own

        # The next suggestion was prefetched too; a diverging edit drops it.
        report = await wait_for(client, lambda r: r["connection"]["prefetch_started"] == 2, 30)
        line, character = _end_of(1, 4, shown)
        edit(client, uri, 3, line, character, "  # another thought")
        await texts(client, uri, line, character + len("  # another thought"))
        report = await status(client)
        assert report["connection"]["prefetch_hits"] == 1 and report["connection"]["jobs_started"] == jobs + 1


@pytest.mark.anyio
async def test_a_partial_accept_is_served_from_the_same_generation(lsp_env, folders):
    """Accepting a word, then the rest of the line, then the rest: type-ahead answers from the
    suggestion shown, and the prefetch computed for its end still answers the last request."""
    done = lambda report: report["prefetchJobs"]["jobs_completed"] >= 1  # noqa: E731
    async with lsp(lsp_env, folders["a"]) as (client, _):
        uri = open_doc(client, folders["a"] / "partial.py", "def add(a, b):\n    ")
        [shown] = await texts(client, uri, 1, 4)
        await wait_for(client, done, 30)
        jobs = (await status(client))["connection"]["jobs_started"]
        word = len(shown) - len(shown.lstrip())
        word += len(shown[word:]) - len(shown[word:].lstrip("abcdefghijklmnopqrstuvwxyz_0123456789")) or 1
        line = shown.find("\n", word) + 1 or len(shown)
        cuts = sorted({min(word, len(shown) - 1), line, len(shown)})
        version, at, done_chars = 2, (1, 4), 0
        for cut in cuts:
            part = shown[done_chars:cut]
            edit(client, uri, version, *at, part)  # the editor inserts the accepted part
            version, at, done_chars = version + 1, _end_of(*at, part), cut
            answer = await texts(client, uri, *at, AUTOMATIC)
            if cut < len(shown):
                assert answer == [shown[cut:]]  # the rest of the same suggestion
        report = await status(client)
        assert report["connection"]["cache_hits"] == len(cuts) - 1 and report["connection"]["prefetch_hits"] == 1
        assert report["connection"]["jobs_started"] == jobs  # no engine job for any of it


@pytest.mark.anyio
async def test_cross_file_context_comes_first_and_stays_cached(lsp_env, folders):
    """Chunks of the other open files of the workspace go before the current file; a second
    request at the same place restores them (and the file up to the cursor) from the bank."""
    short = {"mtplxd": {"lineMaxTokens": 2, "maxTokens": 2, "prefetch": False}}  # each job ends with its usage
    async with lsp(lsp_env, folders["a"], folders["b"], options=short) as (client, _):
        open_doc(client, folders["a"] / "util.py", "def noise():\n    return 0\n")
        open_doc(client, folders["a"] / "hdr.py", "def parse_header(line):\n    name, value = line.split(':')\n"
                                                  "    return name.strip(), value.strip()\n")
        open_doc(client, folders["b"] / "away.py", "def parse_header():\n    pass\n")  # another workspace
        uri = open_doc(client, folders["a"] / "main.py", "from hdr import parse_header\n\n"
                                                           "name, value = parse_header(line)\n")
        await texts(client, uri, 3, 0)
        first = (await status(client))["lastPrompt"]
        assert [c["path"] for c in first["context"]] == ["util.py", "hdr.py"]  # the related file nearest
        assert first["contextTokens"] > 0 and first["cachedTokens"] < first["contextTokens"]  # cold

        [shown] = (await texts(client, uri, 3, 0)) or [""]
        typed = "y" if shown.startswith("x") else "x"  # not the suggestion's start: no type-ahead answer
        edit(client, uri, 2, 3, 0, typed)
        await texts(client, uri, 3, 1)
        second = (await status(client))["lastPrompt"]
        assert second["context"] == first["context"] and second["contextTokens"] == first["contextTokens"]
        assert second["cachedTokens"] >= second["contextTokens"]
        assert second["promptTokens"] - second["cachedTokens"] <= 8, second  # only what the keystroke changed


@pytest.mark.anyio
async def test_a_model_without_fim_tokens_completes_from_the_prefix(no_fim_env, no_fim_checkpoint, folders):
    """No FIM tokens: the editor still gets suggestions, from the prefix alone (the prompt's
    length is the prefix-only prompt's: no FIM markers, no suffix), with the other open
    files before it, restored from the session bank on the next keystroke. The HTTP API
    still refuses a `suffix` such a model cannot read."""
    from engine.engine import load_tokenizer

    async with lsp(no_fim_env, folders["a"]) as (client, _):
        uri = open_doc(client, folders["a"] / "m.py", SOURCE)
        [shown] = await texts(client, uri, 1, 11)
        assert shown.strip()
        report = await status(client, uri)
        assert report["promptLayout"] == "prefix-only" and report["connection"]["answered"] == 1
        builder = PromptBuilder(load_tokenizer(no_fim_checkpoint))
        expected = builder.build(snapshot(uri, _Doc(SOURCE), 1, 11), Options())
        assert report["lastPrompt"]["promptTokens"] == len(expected.ids)

        short = {"mtplxd": {"lineMaxTokens": 2, "maxTokens": 2, "prefetch": False}}  # each job ends with its usage
        client.workspace_did_change_configuration(types.DidChangeConfigurationParams(settings=short))
        open_doc(client, folders["a"] / "hdr.py", "def parse_header(line):\n    name, value = line.split(':')\n")
        main = open_doc(client, folders["a"] / "main.py", "from hdr import parse_header\n\n"
                                                            "name, value = parse_header(line)\n")
        await texts(client, main, 3, 0)
        first = (await status(client))["lastPrompt"]
        assert "hdr.py" in [c["path"] for c in first["context"]] and first["contextTokens"] > 0
        edit(client, main, 2, 3, 0, "x")
        await texts(client, main, 3, 1)
        second = (await status(client))["lastPrompt"]
        assert second["context"] == first["context"] and second["cachedTokens"] >= second["contextTokens"] > 0
        assert second["promptTokens"] - second["cachedTokens"] <= 8, second  # only what the keystroke changed

    url = daemon_client.daemon_url(Path(no_fim_env["MTPLXD_HOME"]))
    body = {"prompt": "def f(", "suffix": "):\n", "max_tokens": 2}
    async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=30) as http:
        refused = await http.post("/v1/completions", json=body)
        assert refused.status_code == 400 and "fill-in-the-middle" in refused.text
        assert (await http.post("/v1/completions", json={**body, "suffix": None})).status_code == 200


@pytest.mark.anyio
async def test_two_clients_two_workspaces_and_folder_changes(lsp_env, folders):
    async with lsp(lsp_env, folders["a"]) as (one, _), lsp(lsp_env, folders["b"], encodings=["utf-8"]) as (two, init):
        assert init.capabilities.position_encoding == types.PositionEncodingKind.Utf8
        uri_a = open_doc(one, folders["a"] / "x.py", SOURCE)
        uri_b = open_doc(two, folders["b"] / "y.py", SOURCE)
        answers = await asyncio.gather(texts(one, uri_a, 1, 11), texts(two, uri_b, 1, 11))
        assert all(len(a) == 1 and a[0].strip() for a in answers)
        report_a, report_b = await status(one, uri_a), await status(two, uri_b)
        assert report_a["pid"] == report_b["pid"]  # one daemon, one model
        assert report_a["document"]["workspace"] == str(folders["a"])
        assert report_b["document"]["workspace"] == str(folders["b"])

        # UTF-8 columns: "é" is two units; 10 units = 5 characters, then 10 to the right
        uri_u = open_doc(two, folders["b"] / "u.py", "ééééé" + "abcdefghij\n")
        assert await texts(two, uri_u, 0, 10, AUTOMATIC) == []
        assert (await status(two))["connection"]["skipped"] == 1

        uri_c = open_doc(one, folders["c"] / "z.py", SOURCE)
        assert (await status(one, uri_c))["document"]["workspace"] is None
        added = types.WorkspaceFolder(folders["c"].as_uri(), "c")
        one.workspace_did_change_workspace_folders(types.DidChangeWorkspaceFoldersParams(
            types.WorkspaceFoldersChangeEvent(added=[added], removed=[])))
        report = await status(one, uri_c)
        assert report["document"]["workspace"] == str(folders["c"])
        assert report["workspaceFolders"] == sorted([str(folders["a"]), str(folders["c"])])
        one.workspace_did_change_workspace_folders(types.DidChangeWorkspaceFoldersParams(
            types.WorkspaceFoldersChangeEvent(added=[], removed=[added])))
        assert (await status(one, uri_c))["document"]["workspace"] is None


@pytest.mark.anyio
async def test_malformed_requests_get_errors_and_the_server_lives(lsp_env, folders):
    async with lsp(lsp_env, folders["a"]) as (client, _):
        uri = open_doc(client, folders["a"] / "bad.py", SOURCE)
        assert await error_code(inline(client, (folders["a"] / "never-opened.py").as_uri(), 0, 0)) == INVALID_PARAMS
        assert await error_code(inline(client, uri, 99, 0)) == INVALID_PARAMS  # past the last line
        assert await error_code(client.protocol.send_request_async("mtplxd/nonsense", {})) == METHOD_NOT_FOUND
        future: concurrent.futures.Future = concurrent.futures.Future()
        client.protocol._request_futures["raw-1"] = future  # a request pygls' types would refuse to send
        client.protocol._send_data({"jsonrpc": "2.0", "id": "raw-1", "method": types.TEXT_DOCUMENT_INLINE_COMPLETION,
                                    "params": {"textDocument": {"uri": uri}, "position": {"line": 0, "character": -1},
                                               "context": {"triggerKind": 1}}})
        assert await error_code(asyncio.wrap_future(future)) == INVALID_PARAMS
        assert await texts(client, uri, 1, 11)  # still serving


# -- the rules, without a daemon -------------------------------------------------------


def cursor(before: str, after: str = "", below: tuple[str, ...] = (), prev: str = "", unit: str = "    ") -> Cursor:
    return Cursor(before, after, below, prev, unit)


def test_line_mode_and_automatic_requests():
    assert cursor("x = f(", ")").mid_line and not cursor("x = ", "   ").mid_line
    assert automatic_allowed(cursor("f(", "a, b, c)")) and not automatic_allowed(cursor("f(", "a, b, c, d, e)"))
    assert trim("a, b)\nmore", cursor("f(", ")")) == ("a, b", True)
    assert trim("g(x), y", cursor("f(", ")")) == ("g(x), y", False)  # ")" inside a call it opened
    assert trim("1 +", cursor("x = ", "")) == ("1 +", False)
    assert suffix_start('hello" + x', '"') == 5


def test_multi_line_stops():
    here = cursor("def f():", below=("", "def g():"))
    assert trim("\n    a = 1\n\n    b = 2", here) == ("\n    a = 1", True)  # blank line
    assert trim("\n    a = 1\n    \n", here)[1]  # whitespace-only line counts as blank
    assert trim("\n    a = 1\ndef g():\n", here) == ("\n    a = 1", True)  # the next existing line
    inner = cursor("    x = ", below=("    return x",))
    assert trim("1\n    return x\n", inner) == ("1", True)
    assert trim("1\nprint(x)\n", inner) == ("1", True)  # back at column 0: left the block
    assert trim("1\n    y", inner) == ("1\n    y", False)  # an unfinished line is not judged yet
    assert finalize("1\n    return x", inner) == "1"  # ... until the end


def test_a_completion_cut_by_the_cap_closes_what_it_opened():
    mid = cursor("    total = ", ")")
    assert finalize("compute(a, b", mid, capped=True) == "compute"  # the call it opened never closed
    assert finalize("compute(a, b", mid) == "compute(a, b"  # not capped: as written
    assert finalize("x[0] + f(1) + g(", mid, capped=True) == "x[0] + f(1) + g"  # the last balanced point
    block = cursor("def f():", below=("", "def g():"))
    assert finalize("\n    a = 1\n    b = g(1,\n          2", block, capped=True) == "\n    a = 1"
    assert finalize("\n    a = [1,\n         2]\n    b = c + d", block, capped=True) == "\n    a = [1,\n         2]"
    assert finalize("\n    a = 1\n    b = c + d", block) == "\n    a = 1\n    b = c + d"


def test_indentation_and_repeats():
    typed = cursor("    ", prev="def f():")
    assert finalize("    return 1\n    pass", typed) == "return 1\npass"  # the typed indent, not twice
    assert finalize("return 1", typed) == "return 1"
    nested = cursor("    ", prev="    if x:")
    assert finalize("    y = 1", nested) == "    y = 1"  # the block does call for one more level
    tabs = cursor("", prev="def f():", unit="\t")
    assert finalize("    return 1\n        pass", tabs) == "\treturn 1\n\t\tpass"
    assert finalize("x = 1  \n\n", cursor("")) == "x = 1"
    assert finalize("  ", cursor("x = ")) == ""
    assert finalize("b)", cursor("f(a, ", "b)")) == ""  # only what already follows
    assert finalize("\n    return x", cursor("def f(x):", below=("    return x",))) == ""
    assert detect_indent_unit(["def f():\n", "  if x:\n", "    y\n"]) == "  "
    assert detect_indent_unit(["def f():\n", "\tpass\n"]) == "\t"


def test_snippet_text_expands_to_the_text():
    assert snippet_text("f(${x}) \\ $y") == "f(\\${x\\}) \\\\ \\$y"


def test_type_ahead_cache():
    cache = TypeAheadCache(size=2)
    cache.put("u", "x = ", "\n", "foo(1)")
    assert cache.get("u", "x = ", "\n") == "foo(1)"
    assert cache.get("u", "x = fo", "\n") == "o(1)"
    assert cache.get("u", "x = fx", "\n") is None  # typed something else
    assert cache.get("u", "x = fo", "\nchanged") is None
    assert cache.get("u", "x = foo(1)", "\n") is None  # all of it typed: ask the engine
    cache.put("v", "", "", "a")
    cache.put("w", "", "", "b")
    assert cache.get("u", "x = ", "\n") is None  # evicted


def test_typing_rhythm():
    from adapters.lsp.postprocess import TypingRhythm

    fast, slow, paused, burst = TypingRhythm(), TypingRhythm(), TypingRhythm(), TypingRhythm()
    for i in range(20):
        fast.edit(i * 0.06)
        slow.edit(i * 0.4)
        paused.edit(i * 2.0)  # every gap a pause: nothing learned
        burst.edit(i * 0.001)  # faster than anyone types
    assert fast.wait_ms(120) == 60 and slow.wait_ms(120) == 120 and paused.wait_ms(120) == 120
    assert burst.wait_ms(120) == 20
    assert TypingRhythm().wait_ms(120) == 120  # nothing seen yet: the setting
    assert fast.wait_ms(0) == 0  # the setting stays the ceiling


def test_typing_rhythm_learns_line_ends():
    """A user who stops after Enter to read gets no wait there; one who types straight on
    keeps the learned wait; mid-line keystrokes keep it either way."""
    from adapters.lsp.postprocess import MIN_LINE_ENDS, TypingRhythm

    def typist(pause_after_enter: float) -> TypingRhythm:
        rhythm, now = TypingRhythm(), 0.0
        for line in range(MIN_LINE_ENDS + 2):
            for _ in range(10):
                now += 0.06
                rhythm.edit(now)
            now += 0.06
            rhythm.edit(now, line_end=True)
            if line < MIN_LINE_ENDS + 1:
                now += pause_after_enter
        return rhythm

    reader, racer = typist(1.5), typist(0.0)
    assert reader.wait_ms(120) == 0 and racer.wait_ms(120) == 60
    reader.edit(100.0)
    reader.edit(100.06)  # typing again, mid-line
    assert reader.wait_ms(120) == 60
    few = TypingRhythm()
    for i in range(10):
        few.edit(i * 0.06, line_end=i == 9)
    assert few.wait_ms(120) == 60  # no line end seen followed by anything yet: the typing wait


def test_options():
    options, warnings = Options().merged({"mtplxd": {"maxTokens": 32, "debounceMs": -1, "enable": False}})
    assert options.max_tokens == 32 and options.debounce_ms == 120 and options.enable is False
    assert len(warnings) == 1 and "debounceMs" in warnings[0]
    assert Options().merged(None) == (Options(), [])
    assert Options().merged({"provider": "both"})[0].provider == "both"


def test_workspace_mapping():
    folders = ["file:///w", "file:///w/inner", "file:///x%20y"]
    assert workspace_of("file:///w/a.py", folders) == "/w"
    assert workspace_of("file:///w/inner/b.py", folders) == "/w/inner"
    assert workspace_of("file:///x%20y/c.py", folders) == "/x y"
    assert workspace_of("file:///wz/c.py", folders) is None
    assert workspace_of("file:///r/c.py", [], root_uri="file:///r") == "/r"
    assert workspace_of("untitled:1", folders) is None


class _Doc:
    """The part of pygls' TextDocument that `snapshot` reads."""

    def __init__(self, text: str, version: int = 1, encoding: str = "utf-16"):
        from pygls.workspace.position_codec import PositionCodec

        self.lines, self.version, self.language_id = text.splitlines(True), version, "python"
        self.position_codec = PositionCodec(encoding)


def test_snapshot_positions():
    snap = snapshot("file:///a.py", _Doc("a😀b\nxy"), 0, 3)  # the emoji is two UTF-16 units
    assert (snap.prefix, snap.cursor.line_suffix) == ("a😀", "b")
    assert snapshot("file:///a.py", _Doc("ab\n"), 0, 99).cursor.line_prefix == "ab"  # clamped, as the LSP says
    assert snapshot("file:///a.py", _Doc("ab\n"), 1, 0).prefix == "ab\n"  # the empty last line
    with pytest.raises(ValueError):
        snapshot("file:///a.py", _Doc("ab"), 1, 0)


def test_prompts_budget_and_stable_context(checkpoint):
    from engine.engine import load_tokenizer

    builder = PromptBuilder(load_tokenizer(checkpoint))
    lines = "".join(f"line{i} = {i}\n" for i in range(200))
    snap = snapshot("file:///w/a.py", _Doc(lines + "x = "), 200, 4)
    options = Options(context_tokens=400)
    ids, heal, _ = builder.build(snap, options)
    assert ids[0] == builder.layout.prefix and ids[-1] == builder.layout.middle
    assert len(ids) <= 400 + 3
    text = builder.tokenizer.decode(ids[1:ids.index(builder.layout.suffix)])
    first = int(text.split(" ")[0].removeprefix("line"))
    assert text.endswith("x =") and heal.text == " "  # the trailing space is left to the first token
    assert 160 < first and first % 4 == 0  # 28 lines fit: steps of 4

    other = [ContextDocument("file:///w/b.py", 3, "b.py", "python", "def helper():\n    return 42\n")]
    one, heal_one, _ = builder.build(snap, options, "a.py", other)
    snap2 = snapshot("file:///w/a.py", _Doc(lines + "x = h", 2), 200, 5)
    two, heal_two, _ = builder.build(snap2, options, "a.py", other)
    context_text = builder.tokenizer.decode(one[:one.index(builder.layout.suffix)])
    assert context_text.startswith("<|fim_prefix|># b.py\ndef helper():\n    return 42")  # other files first
    assert "# a.py\nline1" in context_text
    assert context_text.endswith("x =")
    # The next keystroke reuses all of it: only what follows the healed prompt differs.
    shared = next((i for i, (p, q) in enumerate(zip(one, two)) if p != q), len(one))
    assert shared >= one.index(builder.layout.suffix)
    assert heal_one.text == " " and heal_two.text in ("h", " h")  # by character, or byte-level BPE


def test_prompts_of_a_suffix_prefix_middle_model(checkpoint, tmp_path):
    """A model trained SPM (tokenizer_config.json "fim_order": "spm") gets the other files first,
    as plain documents ended by end-of-text (as in its training stream), then its suffix, then
    the prefix right before the middle; the other files survive a move to another line too."""
    import json
    import shutil

    from engine.engine import load_tokenizer

    folder = tmp_path / "spm"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(checkpoint / name, folder / name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "fim_order": "spm"}))
    builder = PromptBuilder(load_tokenizer(folder))
    other = [ContextDocument("file:///w/b.py", 3, "b.py", "python", "def helper():\n    return 42\n")]
    snap = snapshot("file:///w/a.py", _Doc("import os\nx = \nprint(x)\n"), 1, 4)
    ids, heal, context_tokens = builder.build(snap, Options(context_tokens=400), "a.py", other)
    assert ids.count(builder.layout.middle) == 1
    text = builder.tokenizer.decode(ids)
    assert text.startswith("# b.py\ndef helper():\n    return 42\n<|endoftext|><|fim_prefix|><|fim_suffix|>"
                           "\nprint(x)\n<|fim_middle|># a.py\nimport os\nx =") and heal.text == " "
    assert builder.tokenizer.decode(ids[:context_tokens]).endswith("<|endoftext|>")
    snap2 = snapshot("file:///w/a.py", _Doc("import os\nx = h\nprint(x)\n", 2), 1, 5)
    two, _, _ = builder.build(snap2, Options(context_tokens=400), "a.py", other)
    assert two[: len(ids) - 1] == ids[:-1]
    elsewhere, _, _ = builder.build(snapshot("file:///w/a.py", _Doc("import os\nx = h\nprint(x)\n", 2), 0, 0),
                                    Options(context_tokens=400), "a.py", other)
    assert elsewhere[:context_tokens] == ids[:context_tokens]  # another place, another suffix: same context


def test_prompts_of_a_model_without_fim_tokens(checkpoint, no_fim_checkpoint):
    """Prefix-only: the FIM layout's files and headers without FIM markers, then the prefix,
    ending at the cursor (its last token healed); no suffix. The workspace watcher's warm-up
    of the file is what the prompt begins with when no other file comes first, for this
    model as for one with FIM tokens."""
    from engine.engine import load_tokenizer
    from mtplxd.workspaces import warmup_prompt_ids

    builder = PromptBuilder(load_tokenizer(no_fim_checkpoint))
    assert builder.layout.name == "prefix-only"
    fim = PromptBuilder(load_tokenizer(checkpoint)).layout  # the ids, renamed in this tokenizer
    fim_ids = {fim.prefix, fim.suffix, fim.middle}
    other = [ContextDocument("file:///w/b.py", 3, "b.py", "python", "def helper():\n    return 42\n")]
    text = "import os\nx = \nprint(x)\n"
    snap = snapshot("file:///w/a.py", _Doc(text), 1, 4)
    ids, heal, context_tokens = builder.build(snap, Options(context_tokens=400), "a.py", other)
    assert not fim_ids & set(ids)
    decoded = builder.tokenizer.decode(ids)
    assert decoded.startswith("# b.py\ndef helper():\n    return 42") and "print" not in decoded
    assert decoded.endswith("# a.py\nimport os\nx =") and heal.text == " "  # the prefix, up to the cursor
    assert builder.tokenizer.decode(ids[:context_tokens]).startswith("# b.py")
    two, _, _ = builder.build(snapshot("file:///w/a.py", _Doc("import os\nx = h\nprint(x)\n", 2), 1, 5),
                              Options(context_tokens=400), "a.py", other)
    assert two[: len(ids)] == ids  # the next keystroke extends the prompt

    for model in (no_fim_checkpoint, checkpoint):
        builder = PromptBuilder(load_tokenizer(model))
        warm = warmup_prompt_ids(builder.tokenizer, text)
        at_the_end, _, _ = builder.build(snapshot("file:///w/a.py", _Doc(text), 3, 0), Options(context_tokens=400))
        assert len(warm) >= len(builder.encode(text)) and at_the_end[: len(warm) - 1] == warm[:-1], model


def test_chunk_ring_recency_similarity_budget_and_stability():
    from adapters.lsp.context import CHUNK_LINES, KEEP_LINES, ChunkRing, OpenDocument, as_documents

    def doc(name: str, text: str, version: int = 1) -> OpenDocument:
        return OpenDocument(f"file:///w/{name}", version, name, "python", tuple(text.splitlines(True)))

    count = lambda line: len(line.split()) + 1  # noqa: E731 (a stand-in tokenizer: words)
    current = doc("main.py", "import hdr\n\nname, value = hdr.parse_header(raw_line)\n")
    related = doc("hdr.py", "".join(f"# filler {i}\n" for i in range(CHUNK_LINES))
                  + "def parse_header(raw_line):\n    name, value = raw_line.split(':')\n")
    recent = doc("noise.py", "def unrelated_thing():\n    return 0\n")

    def filled() -> ChunkRing:
        ring = ChunkRing(size=3)
        ring.touch(related.uri, CHUNK_LINES + 1)  # an edit in hdr.py's second chunk
        ring.touch(related.uri, 0)  # its first chunk, viewed
        ring.touch(recent.uri, 0)  # the most recent, but unrelated
        return ring

    [only] = filled().select(current, 2, [related, recent], 14, count)  # a small budget: the best chunk alone
    assert (only.path, only.start) == ("hdr.py", CHUNK_LINES)
    ring = filled()
    chosen = ring.select(current, 2, [related, recent], 1000, count)
    assert [(c.path, c.start) for c in chosen][-1] == ("hdr.py", CHUNK_LINES)  # the similar chunk nearest the cursor
    assert {(c.path, c.start) for c in chosen} == {("hdr.py", 0), ("hdr.py", CHUNK_LINES), ("noise.py", 0)}

    # Stable between keystrokes: the same choice while the cursor stays near where it was made
    # and the other files do not change, even though touches reorder the ring.
    ring.touch(related.uri, 0)
    typed = doc("main.py", "import hdr\n\nname, value = hdr.parse_header(raw_line)\nx", version=2)
    assert ring.select(typed, 3, [related, recent], 1000, count) is chosen
    assert ring.select(typed, 2 + KEEP_LINES, [related, recent], 1000, count) is chosen
    assert ring.select(typed, 3 + KEEP_LINES, [related, recent], 1000, count) is not chosen  # moved away
    edited = doc("noise.py", "def unrelated_thing():\n    return 1\n", version=2)
    assert ring.select(typed, 3, [related, edited], 1000, count) is not chosen  # another file changed

    [hdr, noise] = as_documents(sorted(chosen, key=lambda c: (c.path, c.start)))
    assert hdr.text.startswith("# filler 0\n") and "# filler 15\ndef parse_header" in hdr.text  # adjacent: no gap
    assert noise.text == "def unrelated_thing():\n    return 0\n"
    [gap] = as_documents([c for c in chosen if c.start == CHUNK_LINES])
    assert gap.text.startswith("# ...\ndef parse_header")  # lines left out are marked

    ring.touch(current.uri, 0)  # a fourth chunk: the oldest (hdr.py's second) leaves the ring
    assert len(ring) == 3
    assert ("hdr.py", CHUNK_LINES) not in {(c.path, c.start) for c in ring.select(current, 40, [related, recent], 1000,
                                                                                  count)}
    ring.forget(related.uri)
    assert {c.path for c in ring.select(current, 2, [related, recent], 1000, count)} == {"noise.py"}
