"""The requests the adapters submit and the events they read back: plain data, no MLX.

    ticket = runtime.submit(TextRequest(prompt_ids=ids, max_tokens=64, sampler=SamplerSettings(0.6)))
    async for event in ticket: ...   # TextDelta ... then Done, or Failed

mtplxd/jobs.py runs them on the engine; adapters import only this module's types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Literal

from engine.prompts import Heal
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
