"""The LSP adapter: inline completions for editors, through the one scheduling queue.

The daemon serves LSP on a unix socket in its state dir (`lsp.sock`, 0600; see
adapters/lsp/transport.py); each connection gets its own `CompletionServer`, a
pygls LanguageServer, and every completion it asks for is an interactive-class
job of the shared scheduler. Editors spawn `mtplxd lsp` (mtplxd/shims/lsp_bridge.py),
which pipes their stdio to that socket. The prompt, settings and documents are
in adapters/lsp/documents.py, the line-mode and post-processing rules in
adapters/lsp/postprocess.py, the scheduler job in adapters/lsp/completions.py.

- `textDocument/inlineCompletion` (LSP 3.18) when the client declares it, else the
  `textDocument/completion` fallback: one item, a zero-width text edit at the
  cursor, as a snippet where the client takes snippets (Neovim inserts only the first
  word of a plain-text item) (initializationOptions `provider`: auto | inline |
  completion | both).
- Incremental sync; UTF-16 positions unless the client offers another encoding.
- Cancellation: a new request for a document supersedes the one in flight, an edit
  to the document cancels it, and so does `$/cancelRequest`; each cancels the
  scheduler ticket (the engine drops the job before its next step) and the reply
  is the LSP cancellation error (-32800). A result computed for an older version
  of the document is never returned (-32801, content modified).
- Automatic requests first wait for the next keystroke (a superseding keystroke
  cancels them there, before any engine work): as long as most of this user's
  keystrokes take to follow the one before (postprocess.TypingRhythm), at most
  `debounceMs`; not at all after Enter for a user who mostly pauses there, when the
  client says it waits itself (`clientDebounces`), or for explicitly invoked ones.
- The last suggestion per document answers a request whose typed text is its start
  (type-ahead, a partial accept), without the engine; the suggestion after it is
  prefetched at background priority and answers the request once it is accepted whole
  (raised to interactive priority if it is still running then).
- Cross-file context: chunks of the other open documents of the workspace, from a ring
  of the recently touched ones (adapters/lsp/context.py), before the current file.
- A model without fill-in-the-middle tokens completes from the prefix alone
  (adapters/lsp/documents.PromptBuilder); the stop rules still read the lines below
  the cursor from the document.
- Settings: initializationOptions and workspace/didChangeConfiguration (see
  adapters/lsp/documents.Options). Command `mtplxd.status` [uri] reports this
  connection's counters, settings, folders, the prompt layout (fim-psm, fim-spm or
  prefix-only), the document's workspace and the queue.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, cast
from urllib.parse import unquote

from lsprotocol import types
from pygls.exceptions import JsonRpcContentModified, JsonRpcInvalidParams, JsonRpcServerNotInitialized
from pygls.lsp.server import LanguageServer
from pygls.protocol import LanguageServerProtocol
from pygls.protocol.language_server import lsp_method

from adapters.lsp.context import Chunk, ChunkRing, OpenDocument, as_documents
from adapters.lsp.documents import Options, accepted, snapshot, workspace_of
from adapters.lsp.completions import (
    ConnectionStats, RequestFailed, Watch, fit_options, generate, prompt_builder, ready_model, snippet_text,
)
from adapters.lsp.postprocess import TypeAheadCache, TypingRhythm, automatic_allowed, finalize, stop_strings
from engine.sampler_settings import SamplerSettings
from mtplxd.requests import Priority, TextRequest, file_uri_path
from mtplxd.runtime import Runtime

log = logging.getLogger("mtplxd.lsp")

STATUS_COMMAND = "mtplxd.status"
TRIGGER_CHARACTERS = [".", "(", "[", "{", ",", ":", "=", " "]
_EXPECTED = (JsonRpcInvalidParams, JsonRpcContentModified, JsonRpcServerNotInitialized, RequestFailed)


@dataclass
class _Prefetch:
    prefix: str  # the document around the cursor it was computed for: the text before ...
    suffix: str  # ... and after
    task: asyncio.Future
    watch: Watch  # its job: raised to interactive priority when the user accepts before it ends


@dataclass(eq=False)
class _Pending:
    task: asyncio.Task
    version: int | None


class _Protocol(LanguageServerProtocol):
    # pygls runs plain handlers too: its own is a generator (it chains the user handler, then exits)
    @lsp_method(types.EXIT)
    def lsp_exit(self, *args: Any) -> None:  # type: ignore[override]
        """End this connection, never the daemon (pygls' own handler exits the process)."""
        self._server.close()  # type: ignore[attr-defined]

    def _send_handler_result(self, future: Any, *, msg_id: Any) -> None:
        # Errors the client caused (or that editing causes) are answered without a logged traceback.
        if not future.cancelled() and isinstance(future.exception(), _EXPECTED):
            self._request_futures.pop(msg_id, None)
            self._send_response(msg_id, error=future.exception().to_response_error())
            return
        super()._send_handler_result(future, msg_id=msg_id)


class CompletionServer(LanguageServer):
    """One editor connection."""

    def __init__(self, runtime: Runtime):
        super().__init__("mtplxd", _version(), types.TextDocumentSyncKind.Incremental, protocol_cls=_Protocol)
        self.runtime = runtime
        self.options = Options()
        self.cache = TypeAheadCache()
        self.rhythm = TypingRhythm()
        self.last_place: dict[str, Any] | None = None  # the last request's length choice (mtplxd.status)
        self.last_prompt: dict[str, Any] | None = None  # the last request's prompt: context, usage (mtplxd.status)
        self.ring = ChunkRing()  # recently touched chunks of the open documents (cross-file context)
        self.pending: dict[str, _Pending] = {}
        self.prefetches: dict[str, _Prefetch] = {}  # per document: the suggestion after the one shown
        self.prefetch_jobs = ConnectionStats()  # the prefetches' engine jobs, apart from the requests'
        self.stats = ConnectionStats()
        self.closed = False
        self.snippets = False  # the client expands snippets (set at initialize)
        self._register(types.INITIALIZE, self._initialize)
        self._register(types.TEXT_DOCUMENT_DID_OPEN, self._did_open)
        self._register(types.TEXT_DOCUMENT_DID_CHANGE, self._did_change)
        self._register(types.TEXT_DOCUMENT_DID_CLOSE, self._did_close)
        self._register(types.WORKSPACE_DID_CHANGE_CONFIGURATION, self._did_change_configuration)
        self._register(types.WORKSPACE_DID_CHANGE_WORKSPACE_FOLDERS, self._did_change_folders)
        self.command(STATUS_COMMAND)(lambda *args: self._status(*args))

    def _register(self, name: str, method: Any, options: Any = None) -> None:
        """pygls marks its handlers with attributes, which bound methods cannot carry: wrap them."""
        handler: Callable[[Any], Any]
        if asyncio.iscoroutinefunction(method):
            async def handler(params: Any) -> Any:
                return await method(params)
        else:
            def handler(params: Any) -> Any:
                return method(params)
        self.feature(name, options)(handler)

    # -- lifecycle and settings ------------------------------------------------------

    def _initialize(self, params: types.InitializeParams) -> None:
        self._apply_settings(Options(), params.initialization_options)
        self._open_folders([params.root_uri, *(f.uri for f in params.workspace_folders or ())])
        text = params.capabilities.text_document
        has_inline = text is not None and text.inline_completion is not None
        item = text.completion.completion_item if text is not None and text.completion is not None else None
        # Some clients (Neovim) insert only the first word of a plain-text item: a snippet goes whole.
        self.snippets = bool(item is not None and item.snippet_support)
        provider = self.options.provider
        features = self.protocol.fm.features
        if provider in ("inline", "both") or (provider == "auto" and has_inline):
            if types.TEXT_DOCUMENT_INLINE_COMPLETION not in features:
                self._register(types.TEXT_DOCUMENT_INLINE_COMPLETION, self._inline_completion,
                               types.InlineCompletionOptions())
        if provider in ("completion", "both") or (provider == "auto" and not has_inline):
            if types.TEXT_DOCUMENT_COMPLETION not in features:
                options = types.CompletionOptions(trigger_characters=TRIGGER_CHARACTERS, resolve_provider=False)
                self._register(types.TEXT_DOCUMENT_COMPLETION, self._completion, options)

    def _did_change_folders(self, params: types.DidChangeWorkspaceFoldersParams) -> None:
        self._open_folders([f.uri for f in params.event.added])

    def _open_folders(self, uris: list[str | None]) -> None:
        """Tell the daemon's registry which folders this editor opened: MCP tools may use them."""
        registry = self.runtime.workspaces  # None: a daemon without one (tests)
        paths = [file_uri_path(uri) for uri in uris if uri]
        if registry is None:
            return
        for path in filter(None, paths):
            registry.open_in_editor(path)

    def _did_change_configuration(self, params: types.DidChangeConfigurationParams) -> None:
        self._apply_settings(self.options, params.settings)

    def _apply_settings(self, base: Options, raw: Any) -> None:
        self.options, warnings = base.merged(raw)
        for warning in warnings:
            self.window_log_message(types.LogMessageParams(types.MessageType.Warning, warning))

    def close(self) -> None:
        """Drop the connection: cancel what it has in flight (their tickets with them)."""
        if self.closed:
            return
        self.closed = True
        writer, self.protocol.writer = self.protocol.writer, _NullWriter()
        for pending in list(self.pending.values()):
            pending.task.cancel()
        for key in list(self.prefetches):
            self._drop_prefetch(key)
        for future in list(self.protocol._request_futures.values()):
            future.cancel()
        if writer is not None:
            writer.close()

    # -- documents -------------------------------------------------------------------

    def _did_open(self, params: types.DidOpenTextDocumentParams) -> None:
        self.ring.touch(unquote(params.text_document.uri), 0)  # what an editor shows first

    def _did_change(self, params: types.DidChangeTextDocumentParams) -> None:
        changes = params.content_changes
        enter = len(changes) == 1 and changes[0].text[:1] in ("\n", "\r") and not changes[0].text.strip()
        self.rhythm.edit(time.monotonic(), line_end=enter)  # Enter (and the editor's auto-indent)
        key = unquote(params.text_document.uri)
        for change in params.content_changes:
            if isinstance(change, types.TextDocumentContentChangePartial):
                self.ring.touch(key, change.range.start.line)
        self._drop_stale(key, params.text_document.version)

    def _did_close(self, params: types.DidCloseTextDocumentParams) -> None:
        key = unquote(params.text_document.uri)
        self._drop_stale(key, None)
        self._drop_prefetch(key)
        self.cache.drop(key)
        self.ring.forget(key)

    def _drop_stale(self, key: str, version: int | None) -> None:
        pending = self.pending.get(key)
        if pending is not None and (version is None or pending.version != version):
            pending.task.cancel()  # its result would be for text that is gone

    def workspace_for(self, key: str) -> str | None:
        return workspace_of(key, self.workspace.folders.keys(), self.workspace.root_uri)

    # -- completions -----------------------------------------------------------------

    async def _inline_completion(self, params: types.InlineCompletionParams) -> types.InlineCompletionList:
        explicit = params.context.trigger_kind == types.InlineCompletionTriggerKind.Invoked
        text = await self._suggest(params.text_document.uri, params.position, explicit)
        position = params.position
        items = [types.InlineCompletionItem(insert_text=text, range=types.Range(position, position))] if text else []
        return types.InlineCompletionList(items=items)

    async def _completion(self, params: types.CompletionParams) -> types.CompletionList:
        # Typing and Ctrl-Space both say `Invoked` here: every request counts as automatic.
        text = await self._suggest(params.text_document.uri, params.position, explicit=False)
        if not text:
            return types.CompletionList(is_incomplete=True, items=[])
        label = next((line.strip() for line in text.split("\n") if line.strip()), text)
        item = types.CompletionItem(
            label=label if len(label) <= 60 else label[:59] + "…",
            kind=types.CompletionItemKind.Snippet,
            detail="mtplxd",
            documentation=types.MarkupContent(types.MarkupKind.PlainText, text),
            text_edit=types.TextEdit(types.Range(params.position, params.position),
                                     snippet_text(text) if self.snippets else text),
            insert_text_format=types.InsertTextFormat.Snippet if self.snippets else types.InsertTextFormat.PlainText,
            filter_text=label,
            sort_text="0",
            preselect=True,
        )
        return types.CompletionList(is_incomplete=True, items=[item])

    async def _suggest(self, uri: str, position: types.Position, explicit: bool) -> str:
        """The suggestion at `position`, "" for none. Everything up to registering the
        request is synchronous: the snapshot belongs to the version the request saw."""
        key = unquote(uri)
        try:
            document = self.workspace.text_documents.get(key)
        except RuntimeError:
            raise JsonRpcServerNotInitialized("initialize first") from None
        if document is None:
            raise JsonRpcInvalidParams(f"unknown document {uri}: send textDocument/didOpen first")
        try:
            snap = snapshot(uri, document, position.line, position.character)
        except ValueError as e:
            raise JsonRpcInvalidParams(str(e)) from None
        self.stats.requests += 1
        self.ring.touch(key, position.line)
        # a coroutine handler: pygls runs it in a task (ensure_future), so there is a current one
        me = _Pending(cast(asyncio.Task, asyncio.current_task()), snap.version)
        previous = self.pending.get(key)
        if previous is not None:
            previous.task.cancel()  # superseded
        self.pending[key] = me
        try:
            text = await self._compute(key, snap, explicit)
        except asyncio.CancelledError:
            self.stats.cancelled += 1
            raise
        finally:
            if self.pending.get(key) is me:
                del self.pending[key]
        if text:
            self.stats.answered += 1
        else:
            self.stats.empty += 1
        return text

    async def _compute(self, key: str, snap: Any, explicit: bool) -> str:
        options = self.options
        if not options.enable or (not explicit and not automatic_allowed(snap.cursor)):
            self.stats.skipped += 1
            return ""
        cached = self.cache.get(key, snap.prefix, snap.suffix)
        if cached:
            self.stats.cache_hits += 1
            return cached
        text = await self._prefetched(key, snap) if options.prefetch else None
        if text is not None:
            self.stats.prefetch_hits += 1
        else:
            wait_ms = 0 if explicit else self._debounce_ms()
            if wait_ms:
                await asyncio.sleep(wait_ms / 1000)
            text = await self._complete(key, snap, Priority.INTERACTIVE)
        document = self.workspace.text_documents.get(key)
        if document is None or document.version != snap.version:
            self.stats.stale += 1
            raise JsonRpcContentModified(f"{key} changed (version {snap.version}) while completing")
        self.cache.put(key, snap.prefix, snap.suffix, text)
        self.stats.shown_chars += len(text)
        if text and options.prefetch:
            self._prefetch(key, snap, text)
        return text

    async def _complete(self, key: str, snap: Any, priority: Priority, watch: Watch | None = None) -> str:
        """One suggestion from the engine."""
        model = await ready_model(self.runtime)
        builder = prompt_builder(model)
        options = fit_options(self.options, model.context_length)
        workspace = self.workspace_for(key)
        chunks = self._context(key, snap, workspace, options.workspace_context_tokens, builder.count)
        prompt = builder.build(snap, options, self._display_path(key, workspace), as_documents(chunks),
                               os.path.basename(workspace or ""))
        # The length fits the place: mid-line to the line's end, else a block.
        max_tokens = options.line_max_tokens if snap.cursor.mid_line else options.max_tokens
        if priority == Priority.INTERACTIVE:
            self.last_place = {"mode": "line" if snap.cursor.mid_line else "block", "maxTokens": max_tokens}
        request = TextRequest(
            prompt_ids=tuple(prompt.ids),
            heal=prompt.heal,
            continuation=True,
            max_tokens=max_tokens,
            sampler=SamplerSettings(temperature=options.temperature),
            stop=stop_strings(snap.cursor),
            priority=priority,
            workspace=workspace,
        )
        jobs = self.stats if priority == Priority.INTERACTIVE else self.prefetch_jobs
        done = await generate(self.runtime, request, snap.cursor, options.time_budget_ms, jobs, watch)
        if priority == Priority.INTERACTIVE:
            usage = done.usage
            self.last_prompt = {
                "context": [{"path": c.path, "lines": [c.start, c.end]} for c in chunks],
                "contextTokens": prompt.context_tokens,
                "promptTokens": usage.prompt_tokens if usage else None,
                "cachedTokens": usage.cached_tokens if usage else None,  # restored by the session bank
            }
        return finalize(done.text, snap.cursor, done.capped)

    # -- prefetch after a suggestion ------------------------------------------------------

    def _prefetch(self, key: str, snap: Any, text: str) -> None:
        """Compute, at background priority, the suggestion that follows `text` once the user
        accepts it: the next request at its end is answered at once. The engine's session
        bank already holds the prompt up to the suggestion's start."""
        self._drop_prefetch(key)
        target = accepted(snap, text)
        watch = Watch()
        task = asyncio.ensure_future(self._complete(key, target, Priority.BACKGROUND, watch))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a failed prefetch is a miss, not a log
        self.prefetches[key] = _Prefetch(target.prefix, target.suffix, task, watch)
        self.stats.prefetch_started += 1

    async def _prefetched(self, key: str, snap: Any) -> str | None:
        """The prefetched suggestion when the document is exactly where it was computed for
        (the user accepted the suggestion); otherwise None, and the prefetch is dropped."""
        prefetch = self.prefetches.pop(key, None)
        if prefetch is None:
            return None
        if (prefetch.prefix, prefetch.suffix) != (snap.prefix, snap.suffix):
            prefetch.task.cancel()  # the document went elsewhere
            return None
        if not prefetch.task.done():
            # At background priority it may wait behind other work as long as the daemon is
            # busy: the user waits for it now, so it goes on at interactive priority, keeping
            # what it has done.
            prefetch.watch.hurry()
            self.stats.prefetch_raised += 1
        try:
            return await asyncio.shield(prefetch.task)
        except asyncio.CancelledError:
            if prefetch.task.cancelled():
                return None
            prefetch.task.cancel()  # this request was cancelled: the user moved on
            raise
        except Exception:
            return None

    def _drop_prefetch(self, key: str) -> None:
        prefetch = self.prefetches.pop(key, None)
        if prefetch is not None:
            prefetch.task.cancel()

    def _debounce_ms(self) -> int:
        """How long an automatic request waits for the next keystroke."""
        if self.options.client_debounces:
            return 0
        if not self.options.adaptive_debounce:
            return self.options.debounce_ms
        return self.rhythm.wait_ms(self.options.debounce_ms)

    def _display_path(self, key: str, workspace: str | None) -> str:
        path = file_uri_path(key) or key
        return os.path.relpath(path, workspace) if workspace else os.path.basename(path)

    def _context(self, key: str, snap: Any, workspace: str | None, budget: int,
                 count: Callable[[str], int]) -> list[Chunk]:
        """Chunks of the other open documents of the same workspace (adapters/lsp/context.py)."""
        if workspace is None or budget <= 0:
            return []
        current = OpenDocument(key, snap.version, "", snap.language_id, snap.lines)
        others = [
            OpenDocument(uri, doc.version, self._display_path(uri, workspace), doc.language_id, tuple(doc.lines))
            for uri, doc in self.workspace.text_documents.items()
            if uri != key and self.workspace_for(uri) == workspace
        ]
        return self.ring.select(current, snap.line, others, budget, count)

    # -- introspection ---------------------------------------------------------------

    def _status(self, *args: Any) -> dict[str, Any]:
        model = self.runtime.model()
        report: dict[str, Any] = {
            "pid": os.getpid(),
            "connection": asdict(self.stats),
            "prefetchJobs": {k: v for k, v in asdict(self.prefetch_jobs).items()
                             if k.startswith("jobs_") or k == "tokens_generated"},
            "pending": len(self.pending),
            "options": self.options.as_json(),
            "debounceMs": self._debounce_ms(),  # what an automatic request waits now
            "lastPlace": self.last_place,
            "lastPrompt": self.last_prompt,
            "promptLayout": prompt_builder(model).layout.name if model is not None else None,  # None: loading
            "contextRing": len(self.ring),
            "workspaceFolders": sorted(filter(None, (file_uri_path(f) for f in self.workspace.folders))),
            "scheduler": asdict(self.runtime.stats()),
        }
        if args and isinstance(args[0], str):
            key = unquote(args[0])
            document = self.workspace.text_documents.get(key)
            report["document"] = {
                "uri": args[0],
                "open": document is not None,
                "version": document.version if document else None,
                "workspace": self.workspace_for(key),
            }
        return report


class _NullWriter:
    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mtplxd")
    except PackageNotFoundError:
        return "unknown"
