"""The requests the adapters submit and the events they read back: plain data, no MLX.

    ticket = runtime.submit(TextRequest(prompt_ids=ids, max_tokens=64, sampler=SamplerSettings(0.6)))
    async for event in ticket: ...   # TextDelta ... then Done, or Failed

mtplxd/jobs.py runs them on the engine; mtplxd/scheduler.py queues them and answers
with a `Ticket` (or raises `QueueFull` / `NotReady`). A workspace is named the same way
everywhere: `workspace_key()` of a folder path or file:// URI, None for the default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, AsyncIterator, Callable, Literal
from urllib.parse import unquote, urlparse

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from engine.prompts import Heal, completion_layout, cursor_prompt_ids
from engine.sampler_settings import SamplerSettings


class Priority(IntEnum):
    INTERACTIVE = 0  # editor completions
    NORMAL = 1  # chat, agents
    BACKGROUND = 2  # warm-ups


@dataclass(frozen=True)
class TextRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampler: SamplerSettings = SamplerSettings()
    mode: Literal["ar", "mtp"] | None = None  # None: the profile's measured choice
    depth: int | None = None  # None: the profile's measured choice for this model
    seed: int | None = None  # None: a fresh random seed
    stop: tuple[str, ...] = ()
    priority: Priority = Priority.NORMAL
    ignore_eos: bool = False  # benchmarks: fixed-length outputs
    workspace: str | None = None  # absolute folder: the session-bank namespace (None: default)
    profile: str | None = None  # engine/profiles.py; None: the daemon's
    heal: Heal | None = None  # the prompt's last token was dropped (engine/prompts.py): the text leaves out heal.text
    continuation: bool = False  # the output continues the prompt's text (completions, FIM), not a new turn


@dataclass(frozen=True)
class WarmRequest:
    """Prefill `prompt_ids` into the session bank (a file that changed on disk)."""

    prompt_ids: tuple[int, ...]
    workspace: str | None = None
    priority: Priority = Priority.BACKGROUND
    label: str = ""  # what is being warmed (a file path), for logs


def warmup_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """What completion prompts at a cursor in this file share up to it, when no other file
    comes first (an editor's with no other file of the workspace open, fim_complete's, a
    /v1/completions with a suffix): the BOS, the FIM prefix marker and the text; the BOS
    and the text for a model without FIM tokens (prefix-only). A model trained
    suffix-prefix-middle reads the suffix first, so only prompts with nothing after the
    cursor share the text: those are what it warms. The prompt of a file's WarmRequest,
    whether the daemon's watcher (mtplxd/workspaces.py) or an adapter (MCP `warm`) asks."""
    ids, _ = cursor_prompt_ids(tokenizer, text, "", heal=False)
    return ids[:-2] if completion_layout(tokenizer).order == "psm" else ids  # PSM: drop the suffix and middle markers


@dataclass(frozen=True)
class EmbedRequest:
    inputs: tuple[tuple[int, ...], ...]
    priority: Priority = Priority.NORMAL


# -- events ----------------------------------------------------------------------


@dataclass(frozen=True)
class TextDelta:
    text: str
    token_ids: tuple[int, ...]
    drafted: int = 0
    accepted: tuple[bool, ...] = ()
    batch: int = 1  # rows in the engine step that made it (mtplxd/scheduler.py's batch)
    # How each of `token_ids` was produced: k >= 1 a draft of head position k the trunk
    # accepted, 0 the trunk's own token (the verified correction, the bonus, or AR).
    sources: tuple[int, ...] = ()

    def then(self, later: TextDelta) -> TextDelta:
        """This delta and the next as one (a client that reads slower than the engine
        writes gets fewer, larger chunks)."""
        return TextDelta(self.text + later.text, self.token_ids + later.token_ids, self.drafted + later.drafted,
                         self.accepted + later.accepted, max(self.batch, later.batch), self.sources + later.sources)


def token_sources(tokens: int, accepted: list[bool] | tuple[bool, ...]) -> tuple[int, ...]:
    """`TextDelta.sources` of one engine step: the accepted prefix of the drafts, at head
    positions 1, 2, ..., then the trunk's tokens (one per MTP cycle; every AR token)."""
    drafts = 0
    for ok in accepted:
        if not ok:
            break
        drafts += 1
    drafts = min(drafts, tokens)
    return tuple(range(1, drafts + 1)) + (0,) * (tokens - drafts)


@dataclass
class MTPStats:
    depth: int = 0
    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_by_depth: list[int] = field(default_factory=list)

    def add(self, accepted: list[bool]) -> None:
        if not accepted:
            return
        if len(self.accepted_by_depth) < len(accepted):
            self.accepted_by_depth += [0] * (len(accepted) - len(self.accepted_by_depth))
        self.cycles += 1
        self.drafted += len(accepted)
        self.accepted += sum(accepted)
        for i, ok in enumerate(accepted):
            self.accepted_by_depth[i] += ok

    def acceptance_by_depth(self) -> list[float]:
        return [n / self.cycles for n in self.accepted_by_depth] if self.cycles else []


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


FinishReason = Literal["stop", "length"]
FailureKind = Literal["shutdown", "internal", "invalid"]


@dataclass(frozen=True)
class Done:
    finish_reason: FinishReason
    usage: Usage
    mtp: MTPStats
    time_to_first_token_s: float
    decode_tokens_per_s: float
    stop_sequence: str | None = None  # the stop string that ended the text, if one did
    queue_wait_s: float = 0.0  # submitted -> its job started (a slot, past admission control)


@dataclass(frozen=True)
class Embeddings:
    vectors: list[list[float]]
    prompt_tokens: int


@dataclass(frozen=True)
class Warmed:
    prompt_tokens: int
    cached_tokens: int  # already in the bank before the warm-up
    stored: int  # snapshots the warm-up added


@dataclass(frozen=True)
class Failed:
    message: str
    kind: FailureKind = "internal"


Event = TextDelta | Done | Embeddings | Warmed | Failed
State = Literal["loading", "ready", "failed", "stopping", "stopped"]


# -- submitting --------------------------------------------------------------------------


class QueueFull(Exception):
    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotReady(Exception):
    """The engine failed to load; no job can run."""


class Ticket:
    """The adapter's handle on one job: iterate its events, cancel it, or raise its priority."""

    def __init__(self, job_id: int, receive: MemoryObjectReceiveStream, cancel: Callable[[], None],
                 raise_to: Callable[[Priority], None] | None = None):
        self.id = job_id
        self._receive = receive
        self._cancel = cancel
        self._raise_to = raise_to

    def __aiter__(self):
        return self._receive.__aiter__()

    async def next_event(self) -> Event:
        return await self._receive.receive()

    async def coalesced(self) -> AsyncIterator[Event]:
        """The events, with the text deltas already waiting joined into one: a stream
        writes one chunk for what the engine made while it wrote the last."""
        async for event in self:
            while isinstance(event, TextDelta):
                try:
                    later = self._receive.receive_nowait()
                except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                    break
                if not isinstance(later, TextDelta):
                    yield event
                    event = later
                    break
                event = event.then(later)
            yield event

    def cancel(self) -> None:
        self._cancel()
        self._receive.close()

    def raise_priority(self, priority: Priority) -> None:
        """From the next pick on, the job runs in `priority`'s class (if that is higher):
        work done ahead at background priority (an editor's prefetch) that a user now waits for."""
        if self._raise_to is not None:
            self._raise_to(priority)


@dataclass
class SchedulerStats:
    state: State
    active: int
    queued_by_class: dict[str, int]
    completed: int
    cancelled: int
    steps: int


# -- workspaces --------------------------------------------------------------------------

DEFAULT_WORKSPACE: str | None = None  # what requests that name no workspace share
DEFAULT_WORKSPACE_NAME = "default"  # its name where a protocol needs a word (/v1/sessions)


def workspace_key(value: Any) -> str:
    """The one key of a named workspace: the normalized absolute folder path, from a
    path or a file:// URI (HTTP headers, MCP arguments and roots, LSP folders).
    ValueError for anything else."""
    if isinstance(value, str) and value.startswith("file:"):
        parsed = urlparse(value)
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"a workspace must be a local folder, got {value!r}")
        value = unquote(parsed.path)
    if not isinstance(value, str) or not value.strip() or "\0" in value:
        raise ValueError("a workspace must be an absolute folder path")
    if not os.path.isabs(value):
        raise ValueError(f"a workspace must be an absolute folder path, got {value!r}")
    return os.path.normpath(value)


def file_uri_path(uri: str) -> str | None:
    """The local path a file:// URI names, in workspace_key's form; None for another
    scheme or a URI that names no local path."""
    if not uri.startswith("file:"):
        return None
    try:
        return workspace_key(uri)
    except ValueError:
        return None
