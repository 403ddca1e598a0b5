"""The engine side of the LSP adapter: one completion as one scheduler job.

`generate` submits an interactive-class job and reads its events, applying the
stop rules of adapters/lsp/postprocess.py to the text as it streams (so the job
ends as soon as one fires) and a time budget that, once spent, ends a multi-line
completion at the next line break where its brackets balance (what follows is the
next suggestion, prefetched once this one is shown). The ticket is cancelled on every way out, so
an abandoned request never keeps the engine busy.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Any

import anyio
from pygls.exceptions import JsonRpcException

from adapters.lsp.documents import Options, PromptBuilder
from adapters.lsp.postprocess import Cursor, line_break_at_rest, trim
from mtplxd.requests import Done, Failed, Priority, TextDelta, TextRequest, Ticket, Usage
from mtplxd.runtime import ModelInfo, Runtime
from mtplxd.requests import NotReady, QueueFull

REQUEST_FAILED = -32803  # LSP 3.17 RequestFailed: a well-formed request the server could not serve


class RequestFailed(JsonRpcException):
    CODE = REQUEST_FAILED
    MESSAGE = "Request Failed"


@dataclass
class ConnectionStats:
    requests: int = 0  # completion requests received
    answered: int = 0  # ... answered with a suggestion
    empty: int = 0  # ... answered with none
    cancelled: int = 0  # ... answered with the cancellation error (superseded, edited, $/cancelRequest)
    stale: int = 0  # ... whose result was for an older version (dropped)
    skipped: int = 0  # ... not sent to the engine by the line-mode rules or `enable: false`
    cache_hits: int = 0  # ... answered by type-ahead
    prefetch_started: int = 0  # suggestions computed ahead, for when the one shown is accepted
    prefetch_hits: int = 0  # ... answered from one
    prefetch_raised: int = 0  # ... accepted before their prefetch ended (raised to interactive priority, awaited)
    shown_chars: int = 0  # characters of the suggestions answered by the engine or a prefetch (not type-ahead)
    jobs_started: int = 0  # scheduler jobs submitted
    jobs_cancelled: int = 0  # ... cancelled before their end
    jobs_completed: int = 0  # ... run to their end (or to a stop rule)
    tokens_generated: int = 0  # by those jobs, cancelled ones included
    prompt_tokens: int = 0  # prompt tokens of the jobs that ended
    cached_tokens: int = 0  # ... of them restored from the session bank, not prefilled


class Watch:
    """A job run ahead (a prefetch), with a way to raise its priority once someone waits for it."""

    def __init__(self) -> None:
        self.urgent = False
        self._ticket: Ticket | None = None

    def attach(self, ticket: Ticket) -> None:
        self._ticket = ticket
        if self.urgent:
            ticket.raise_priority(Priority.INTERACTIVE)

    def hurry(self) -> None:
        """A user waits for it now: interactive priority (before its job exists: from its submission)."""
        self.urgent = True
        if self._ticket is not None:
            self._ticket.raise_priority(Priority.INTERACTIVE)


@dataclass(frozen=True)
class Generated:
    text: str
    capped: bool  # the token cap ended it (`finalize`'s `capped`)
    usage: Usage | None  # None: the job ended without its Done event


async def generate(runtime: Runtime, request: TextRequest, cursor: Cursor, budget_ms: int,
                   stats: ConnectionStats, watch: Watch | None = None) -> Generated:
    """Run one job to its end or to the first stop rule; the ticket is released on every path."""
    try:
        ticket = runtime.submit(request, "lsp")
    except (QueueFull, NotReady) as e:
        raise RequestFailed(str(e)) from None
    stats.jobs_started += 1
    if watch is not None:
        watch.attach(ticket)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + budget_ms / 1000
    spent_at: int | None = None  # length of the text when the time budget ran out
    text, ended, capped = "", False, False
    usage: Usage | None = None
    try:
        while not ended:
            try:
                event = await ticket.next_event()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                break
            if isinstance(event, TextDelta):
                stats.tokens_generated += len(event.token_ids)
                text, ended = trim(text + event.text, cursor)
                if not ended and not cursor.mid_line and loop.time() > deadline:
                    spent_at = len(text) if spent_at is None else spent_at
                    cut = line_break_at_rest(text, max(1, spent_at))
                    if cut is not None:
                        text, ended = text[:cut], True
            elif isinstance(event, Done):
                ended, capped, usage = True, event.finish_reason == "length", event.usage
                stats.prompt_tokens += usage.prompt_tokens
                stats.cached_tokens += usage.cached_tokens
            elif isinstance(event, Failed):
                if event.kind == "shutdown":
                    return Generated("", False, None)
                raise RequestFailed(event.message)
    finally:
        ticket.cancel()
        if ended:
            stats.jobs_completed += 1
        else:
            stats.jobs_cancelled += 1
    return Generated(text, capped, usage)


async def ready_model(runtime: Runtime) -> ModelInfo:
    """The loaded model's facts, once it is ready (a request waits while the model loads)."""
    while runtime.state == "loading":
        await asyncio.sleep(0.05)
    model = runtime.model()
    if runtime.state == "ready" and model is not None:
        return model
    if runtime.state == "failed":
        raise RequestFailed(runtime.failure())
    raise RequestFailed("the daemon is shutting down")


_BUILDER: tuple[Any, PromptBuilder] | None = None


def prompt_builder(model: ModelInfo) -> PromptBuilder:
    """One prompt builder for the loaded model (its token counts are shared by every connection)."""
    global _BUILDER
    if _BUILDER is None or _BUILDER[0] is not model:
        _BUILDER = (model, PromptBuilder(model.tokenizer))  # a model without FIM tokens: prefix-only prompts
    return _BUILDER[1]


def fit_options(options: Options, context_length: int) -> Options:
    """Budgets that leave room for the completion in the model's context (2/3 document, 1/3 others)."""
    room = max(32, context_length - options.max_tokens - 8)
    if options.context_tokens + options.workspace_context_tokens <= room:
        return options
    return replace(options, context_tokens=min(options.context_tokens, max(16, room * 2 // 3)),
                   workspace_context_tokens=min(options.workspace_context_tokens, room // 3))


def snippet_text(text: str) -> str:
    """Plain text as an LSP snippet that expands to exactly that text."""
    return text.replace("\\", "\\\\").replace("$", "\\$").replace("}", "\\}")
