"""The MCP tools: generate, chat, fim_complete, warm_workspace and status.

Each generating tool builds its prompt, turns it into one normal-priority
TextRequest in the call's workspace and runs it through the adapter (model wait,
progress, time budget, cancellation: adapters/mcp/server.py). Which workspaces a call may
use, and the files in them, come from adapters/mcp/paths.py (every tool that takes a
workspace also takes `roots`, the client's declared roots, which the SDK fills in);
argument types and outputs from adapters/mcp/schema.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import anyio
from mcp.server import MCPServer
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import Field

from adapters.mcp.paths import (
    ClientRoots, Folder, WorkspaceFile, language_of, read_text, recent_files, resolve_path, split_at_cursor,
)
from adapters.mcp.schema import (
    DEFAULT_MAX_TOKENS, MAX_MESSAGES, MAX_PATH_CHARS, MAX_STOP_CHARS, MAX_STOPS, MAX_TEXT_CHARS, MAX_TOTAL_CHARS,
    ChatMessage, FimCompletion, Generation, MaxTokens, RequiredWorkspace, StatusResult, Temperature, WarmResult,
    WarmSkip, Workspace,
)
from mtplxd.runtime import ModelInfo
from engine.prompts import (
    Heal, chat_prompt_ids, completion_layout, completion_prompt_ids, cursor_prompt_ids, has_chat_template,
)
from engine.sampler_settings import SamplerSettings
from mtplxd.requests import Priority, TextRequest, WarmRequest, warmup_prompt_ids

if TYPE_CHECKING:
    from adapters.mcp.server import McpAdapter

FIM_PREFIX_CHARS = 16_000  # context kept before the cursor...
FIM_SUFFIX_CHARS = 4_000  # ...and after it
MAX_WARM_PATHS = 64
WARM_DEFAULT_FILES = 8  # warm_workspace without paths: the most recently modified source files
WARM_MAX_TOKENS = 2048  # prefilled per file

READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=False,
                            open_world_hint=False)
READ_ONLY_IDEMPOTENT = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True,
                                       open_world_hint=False)


def register_tools(server: MCPServer, adapter: McpAdapter) -> None:
    @server.tool(title="Generate text", annotations=READ_ONLY)
    async def generate(
        prompt: Annotated[str, Field(min_length=1, max_length=MAX_TEXT_CHARS, description="the request")],
        ctx: Context,
        roots: ClientRoots,
        system: Annotated[str | None, Field(max_length=MAX_TEXT_CHARS, description="system prompt")] = None,
        max_tokens: MaxTokens = None,
        temperature: Temperature = None,
        stop: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] | None, Field(
            max_length=MAX_STOPS, description="strings that end the output (not included)")] = None,
        workspace: Workspace = None,
    ) -> Generation:
        """Ask the local model for a draft, a summary or boilerplate: `prompt` is one user
        turn through the model's chat template (raw text for models without one), with
        `system` as the system turn. Returns the text with usage, cached tokens, decode
        speed and MTP acceptance. Progress notifications carry the tokens so far."""
        deadline = adapter.deadline()
        ws = _id(adapter.workspaces.use(workspace, roots, required=False))
        info = await adapter.ready(ctx, deadline)
        request = _request(info, _generate_ids(info, prompt, system), max_tokens, info.sampler(temperature=temperature), ws,
                           stop=stop or ())
        return Generation(**await adapter.run_text(ctx, request, info, deadline))

    @server.tool(title="Chat", annotations=READ_ONLY)
    async def chat(
        messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES, description=(
            "the conversation, oldest first; the model writes the next assistant turn"))],
        ctx: Context,
        roots: ClientRoots,
        max_tokens: MaxTokens = None,
        temperature: Temperature = None,
        workspace: Workspace = None,
    ) -> Generation:
        """Continue a conversation with the local model (the model's chat template). Returns
        the reply with usage, cached tokens, decode speed and MTP acceptance."""
        deadline = adapter.deadline()
        if sum(len(m.content) for m in messages) > MAX_TOTAL_CHARS:
            raise ToolError(f"the messages hold more than {MAX_TOTAL_CHARS} characters together")
        ws = _id(adapter.workspaces.use(workspace, roots, required=False))
        info = await adapter.ready(ctx, deadline)
        ids = _ids(chat_prompt_ids, info.tokenizer, [m.model_dump() for m in messages])
        request = _request(info, ids, max_tokens, info.sampler(temperature=temperature), ws)
        return Generation(**await adapter.run_text(ctx, request, info, deadline))

    @server.tool(title="Fill in the middle", annotations=READ_ONLY)
    async def fim_complete(
        workspace: RequiredWorkspace,
        ctx: Context,
        roots: ClientRoots,
        path: Annotated[str | None, Field(max_length=MAX_PATH_CHARS, description=(
            "a file inside the workspace (relative to it, or absolute inside it); give `line` and "
            "`character` too"))] = None,
        line: Annotated[int | None, Field(ge=0, description="the cursor's line in `path`, zero-based")] = None,
        character: Annotated[int | None, Field(ge=0, description=(
            "the cursor's column in `path`, zero-based (clamped to the line's length)"))] = None,
        prefix: Annotated[str | None, Field(max_length=MAX_TEXT_CHARS, description=(
            "text before the cursor (instead of `path`)"))] = None,
        suffix: Annotated[str | None, Field(max_length=MAX_TEXT_CHARS, description=(
            "text after the cursor (instead of `path`)"))] = None,
        language: Annotated[str | None, Field(max_length=64, description=(
            "the language, reported back (default: from the file's extension)"))] = None,
        max_tokens: MaxTokens = None,
    ) -> FimCompletion:
        """Fill in the middle: the code that belongs at a cursor, written by the model from its
        fill-in-the-middle tokens (greedy). A model without them continues the text before the
        cursor alone (`suffix_used` false in the result). Either a file `path` in the workspace
        plus a cursor (`line`, `character`, zero-based), or explicit `prefix` / `suffix`. Paths
        resolve inside the workspace only: `..`, absolute paths elsewhere and symlinks leading
        out are refused."""
        deadline = adapter.deadline()
        folder = adapter.workspaces.use(workspace, roots, required=True)
        cursor = Cursor(path=path, line=line, character=character, prefix=prefix, suffix=suffix)
        before, after, shown = await _cursor_context(folder, cursor)
        info = await adapter.ready(ctx, deadline)
        ids, heal = _fim_ids(info, before, after, max_tokens)
        request = _request(info, ids, max_tokens, SamplerSettings(temperature=0.0), folder.id, continuation=True,
                           heal=heal)
        return FimCompletion(**await adapter.run_text(ctx, request, info, deadline), path=shown,
                             line=cursor.line if shown else None, character=cursor.character if shown else None,
                             language=language_of(shown, language),
                             suffix_used=completion_layout(info.tokenizer).reads_suffix)

    @server.tool(title="Warm a workspace", annotations=READ_ONLY_IDEMPOTENT)
    async def warm_workspace(
        workspace: RequiredWorkspace,
        ctx: Context,
        roots: ClientRoots,
        paths: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_PATH_CHARS)]] | None, Field(
            max_length=MAX_WARM_PATHS, description=(
                f"files inside the workspace to warm (default: the {WARM_DEFAULT_FILES} most recently "
                "modified source files)"))] = None,
    ) -> WarmResult:
        """Warm the session bank for files of the workspace, in the background: each file's
        fill-in-the-middle prefix (the marker and the file's text, what every completion in it
        shares up to its cursor) is prefilled at background priority, below every editor and
        agent request, and kept in the workspace's session caches; later calls in this
        workspace start from them. Returns at once with what was queued. Paths resolve inside
        the workspace only."""
        deadline = adapter.deadline()
        folder = adapter.workspaces.use(workspace, roots, required=True)
        if paths is None:
            paths = await anyio.to_thread.run_sync(recent_files, folder.real, WARM_DEFAULT_FILES)
        chosen = [(given, resolve_path(folder, given)) for given in paths]  # any refusal fails the call
        info = await adapter.ready(ctx, deadline)
        return await _queue_warmups(adapter, info, folder.id, chosen)

    @server.tool(title="Daemon status", annotations=READ_ONLY_IDEMPOTENT)
    async def status() -> StatusResult:
        """The daemon's model, profile, default depth, queue and per-workspace / session-bank
        figures. Answers while the model is still loading."""
        return adapter.figures.status()


# -- prompts and requests ----------------------------------------------------------------


def _id(folder: Folder | None) -> str | None:
    """A request's workspace: the folder's id (None: the default namespace)."""
    return folder.id if folder is not None else None


def _built(build: Any, tokenizer: Any, *args: Any) -> Any:
    """What a prompt builder returns; what it refuses is the caller's error."""
    try:
        return build(tokenizer, *args)
    except ValueError as e:
        raise ToolError(str(e)) from None


def _ids(build: Any, tokenizer: Any, *args: Any) -> list[int]:
    """A prompt's token ids (see _built)."""
    ids = _built(build, tokenizer, *args)
    if not ids:
        raise ToolError("the prompt is empty")
    return ids


def _generate_ids(info: ModelInfo, prompt: str, system: str | None) -> list[int]:
    """`prompt` as a user turn (after `system`) where the model has a chat template, else raw text."""
    if has_chat_template(info.tokenizer):
        turns = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return _ids(chat_prompt_ids, info.tokenizer, turns)
    return _ids(completion_prompt_ids, info.tokenizer, f"{system}\n\n{prompt}" if system else prompt)


def _fim_ids(info: ModelInfo, before: str, after: str, max_tokens: int | None) -> tuple[list[int], Heal | None]:
    """The FIM prompt (the prefix alone for a model without FIM tokens), the context around
    the cursor trimmed to fit the model, its prefix's last token healed (engine/prompts.py)."""
    before, after = before[-FIM_PREFIX_CHARS:], after[:FIM_SUFFIX_CHARS]
    room = info.context_length - (max_tokens or min(DEFAULT_MAX_TOKENS, info.context_length // 4))
    while True:
        ids, heal = _built(cursor_prompt_ids, info.tokenizer, before, after)
        if len(ids) <= room or (not before and not after):
            return ids, heal
        before, after = before[len(before) // 2:], after[: len(after) // 2]


def _warm_ids(info: ModelInfo, text: str) -> list[int]:
    """A file's head as the workspace watcher warms it (mtplxd/workspaces.py): as a FIM
    prefix (the text alone for a model without FIM tokens), which fim_complete's prompts
    for the file begin with."""
    return warmup_prompt_ids(info.tokenizer, text)[: min(WARM_MAX_TOKENS, info.context_length - 1)] if text else []


def _budget(info: ModelInfo, prompt_len: int, wanted: int | None) -> int:
    """max_tokens for a prompt: the caller's (within the context) or the default."""
    room = info.context_length - prompt_len
    if room < 1:
        raise ToolError(f"the prompt has {prompt_len} tokens; this model's context is {info.context_length} tokens")
    if wanted is not None and wanted > room:
        raise ToolError(f"the prompt has {prompt_len} tokens; with max_tokens {wanted} that exceeds this "
                        f"model's context of {info.context_length} tokens")
    return wanted if wanted is not None else min(DEFAULT_MAX_TOKENS, room)


def _request(info: ModelInfo, ids: list[int], max_tokens: int | None, sampler: SamplerSettings,
             workspace: str | None, stop: Sequence[str] = (), continuation: bool = False,
             heal: Heal | None = None) -> TextRequest:
    return TextRequest(prompt_ids=tuple(ids), max_tokens=_budget(info, len(ids), max_tokens), sampler=sampler,
                       stop=tuple(stop), priority=Priority.NORMAL, workspace=workspace, continuation=continuation,
                       heal=heal)


# -- files -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cursor:
    """Where fim_complete writes, as its caller gave it: a file `path` with a cursor (`line`,
    `character`, zero-based), or an explicit `prefix` / `suffix`. Checked by _cursor_context."""

    path: str | None = None
    line: int | None = None
    character: int | None = None
    prefix: str | None = None
    suffix: str | None = None


async def _cursor_context(folder: Folder, cursor: Cursor) -> tuple[str, str, str | None]:
    """(text before the cursor, text after it, the file relative to the workspace or None):
    from a file and a cursor, or from an explicit prefix / suffix."""
    path, line, character, prefix, suffix = cursor.path, cursor.line, cursor.character, cursor.prefix, cursor.suffix
    if path is None:
        if line is not None or character is not None:
            raise ToolError("`line` and `character` go with `path`")
        if prefix is None and suffix is None:
            raise ToolError("give a file `path` with a cursor, or `prefix` and/or `suffix`")
        return prefix or "", suffix or "", None
    if prefix is not None or suffix is not None:
        raise ToolError("give either `path` with a cursor, or `prefix` / `suffix`, not both")
    if line is None or character is None:
        raise ToolError("with `path`, give the cursor too: `line` and `character` (zero-based)")
    file = resolve_path(folder, path)
    text = await anyio.to_thread.run_sync(read_text, file)
    return *split_at_cursor(text, line, character, file.shown), file.shown


async def _queue_warmups(adapter: McpAdapter, info: ModelInfo, workspace: str,
                         chosen: list[tuple[str, WorkspaceFile]]) -> WarmResult:
    """Queue each chosen file's warm-up at background priority; a file that cannot be
    warmed is skipped with the reason, and the others still go."""
    bank_off = adapter.figures.bank() is None
    queued, skipped, total = [], [], 0
    for given, file in chosen:
        try:
            if bank_off:
                raise ToolError("the session bank is off: nothing would be kept")
            ids = _warm_ids(info, await anyio.to_thread.run_sync(read_text, file))
            if not ids:
                raise ToolError("empty file")
            ticket = adapter.submit(WarmRequest(tuple(ids), workspace, Priority.BACKGROUND, label=file.full))
        except ToolError as e:
            skipped.append(WarmSkip(path=given, reason=str(e)))
            continue
        adapter.start_background(ticket)  # outside the try: a daemon shutting down fails the call
        queued.append(file.shown)
        total += len(ids)
    return WarmResult(workspace=workspace, queued=queued, skipped=skipped, prompt_tokens=total)
