"""What the MCP tools take and return: argument types, structured outputs, and the
size limits of their input schemas (oversize input is refused before a tool runs).

`generation_fields` turns a finished run, or one the call's time budget cut short,
into the fields every generating tool returns (usage, MTP figures, timings).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from mtplxd.runtime import ModelInfo
from mtplxd.requests import Done, MTPStats, TextRequest

DEFAULT_MAX_TOKENS = 256
MAX_TOKENS_LIMIT = 2048
MAX_TEXT_CHARS = 200_000  # one prompt, message, prefix or suffix
MAX_TOTAL_CHARS = 400_000  # all messages of one chat
MAX_MESSAGES = 256
MAX_STOPS = 4
MAX_STOP_CHARS = 64
MAX_PATH_CHARS = 4096


# -- arguments --------------------------------------------------------------------------

MaxTokens = Annotated[int | None, Field(ge=1, le=MAX_TOKENS_LIMIT, description=(
    f"tokens to generate at most (default {DEFAULT_MAX_TOKENS}; at most {MAX_TOKENS_LIMIT}, so that "
    "a call ends inside agents' 60 s tool timeouts)"))]
Temperature = Annotated[float | None, Field(ge=0.0, le=2.0, description=(
    "sampling temperature; 0 is greedy (default: the model family's recommended value)"))]
Workspace = Annotated[str | None, Field(max_length=MAX_PATH_CHARS, description=(
    "absolute path of the project folder: its warm caches are kept apart from other projects' "
    "(mtplxd mcp fills in its working directory)"))]
RequiredWorkspace = Annotated[str, Field(min_length=1, max_length=MAX_PATH_CHARS, description=(
    "absolute path of the project folder (mtplxd mcp fills in its working directory)"))]


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: Annotated[str, Field(max_length=MAX_TEXT_CHARS)]


# -- structured outputs -----------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = Field(description="prompt tokens served from a warm cache")
    total_tokens: int


class MtpFigures(BaseModel):
    mode: Literal["mtp", "ar"] = Field(description="mtp: speculative decoding with the model's own MTP heads")
    depth: int = Field(description="draft tokens proposed per cycle (0 in ar mode)")
    drafted: int
    accepted: int
    acceptance: float | None = Field(description="accepted / drafted; null when nothing was drafted")
    acceptance_by_depth: list[float] = Field(description="acceptance rate of the k-th draft token, k = 1..depth")


class Timings(BaseModel):
    time_to_first_token_s: float
    decode_tokens_per_s: float
    total_s: float = Field(description="the whole call, queueing and prefill included")


class Generation(BaseModel):
    text: str
    finish_reason: Literal["stop", "length", "time_limit"] = Field(
        description="stop: end of text or a stop string; length: max_tokens; time_limit: the call's time budget")
    model: str
    workspace: str | None = Field(description="the workspace (session-bank namespace); null: the default one")
    usage: Usage
    mtp: MtpFigures
    timings: Timings


class FimCompletion(Generation):
    path: str | None = Field(description="the file, relative to the workspace; null with explicit prefix/suffix")
    line: int | None
    character: int | None
    language: str | None
    suffix_used: bool = Field(description=(
        "false: the model has no fill-in-the-middle tokens, so it completed from the text before the cursor alone"))


class WarmSkip(BaseModel):
    path: str
    reason: str


class WarmResult(BaseModel):
    workspace: str
    queued: list[str] = Field(description="files whose prefill was queued, relative to the workspace")
    skipped: list[WarmSkip]
    prompt_tokens: int = Field(description="tokens queued for prefill, all files together")
    priority: Literal["background"] = "background"


class QueueFigures(BaseModel):
    active: int = Field(description="jobs holding an engine slot")
    queued_by_class: dict[str, int]
    completed: int
    cancelled: int
    steps: int


class WorkspaceFigures(BaseModel):
    workspace: str
    jobs: int = Field(description="generations the scheduler finished for this workspace")
    warmups: int = Field(description="warm-ups (background prefills) the scheduler finished for it")
    prompt_tokens: int
    cached_tokens: int = Field(description="prompt tokens restored from the workspace's session caches")
    completion_tokens: int
    last_used: str | None


class StatusResult(BaseModel):
    state: Literal["loading", "ready", "failed", "stopping", "stopped"]
    model: str | None
    family: str | None
    mtp_heads: int | None
    profile: str
    depth: int = Field(description="the default speculative depth")
    context_length: int | None
    load_error: str | None
    uptime_s: float
    queue: QueueFigures
    workspaces: list[WorkspaceFigures] = Field(description="per-workspace figures, most recently used first")
    session_bank: dict[str, Any] | None = Field(
        description="the session bank's figures (entries, bytes and budgets per tier, hits, misses, cached "
                    "tokens, evictions) and the watched workspaces; null when the bank is off")


# -- a run's result -----------------------------------------------------------------------


@dataclass
class Outcome:
    """What a run streamed; `done` is None when the call's time budget cut it short."""

    text: str
    done: Done | None
    tokens: int
    mtp: MTPStats
    first_token_s: float | None
    started: float


def generation_fields(outcome: Outcome, request: TextRequest, info: ModelInfo) -> dict[str, Any]:
    """The Generation fields of a run: the scheduler's own figures when it finished, else
    figures measured here from what streamed before the time limit."""
    done = outcome.done
    mtp = done.mtp if done else outcome.mtp
    prompt_tokens = len(request.prompt_ids)
    completion = done.usage.completion_tokens if done else outcome.tokens
    cached = done.usage.cached_tokens if done else 0
    now = time.monotonic()
    if done is not None:
        ttft, rate = done.time_to_first_token_s, done.decode_tokens_per_s
    else:
        ttft = outcome.first_token_s if outcome.first_token_s is not None else now - outcome.started
        decode_s = now - outcome.started - ttft
        rate = (outcome.tokens - 1) / decode_s if outcome.tokens > 1 and decode_s > 0 else 0.0
    return dict(
        text=outcome.text,
        finish_reason=done.finish_reason if done else "time_limit",
        model=info.id,
        workspace=request.workspace,
        usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, cached_tokens=cached,
                    total_tokens=prompt_tokens + completion),
        mtp=MtpFigures(
            mode="mtp" if mtp.depth else "ar", depth=mtp.depth, drafted=mtp.drafted, accepted=mtp.accepted,
            acceptance=round(mtp.accepted / mtp.drafted, 4) if mtp.drafted else None,
            acceptance_by_depth=[round(a, 4) for a in mtp.acceptance_by_depth()],
        ),
        timings=Timings(time_to_first_token_s=round(ttft, 4), decode_tokens_per_s=round(rate, 2),
                        total_s=round(now - outcome.started, 4)),
    )
