"""What the MCP server reports about the daemon: the model's facts, the status tool's
figures, the model card, per-workspace figures and the metrics resource.

Per-workspace figures come from the session bank and from a tally of the jobs the
scheduler finished (`WorkspaceTally`, a listener of the runtime's events).
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, is_dataclass
from datetime import datetime, timezone
from typing import Any

from adapters.mcp.schema import QueueFigures, StatusResult, WorkspaceFigures
from engine.prompts import completion_layout, has_chat_template
from mtplxd.requests import Done, Warmed
from mtplxd.runtime import ModelInfo, Runtime, Sessions


@dataclass
class _Tally:
    jobs: int = 0
    warmups: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    last_used: float | None = None


class WorkspaceTally:
    """Figures per TextRequest.workspace, counted from the Done events of the jobs
    the scheduler ran (a runtime listener, on the worker thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tallies: dict[str, _Tally] = {}

    def attach(self, runtime: Runtime) -> None:
        runtime.listen(lambda entry, event: self.observe(entry.request, event))

    def observe(self, request: Any, event: Any) -> None:
        workspace = getattr(request, "workspace", None)
        if workspace is None or not isinstance(event, (Done, Warmed)):
            return
        with self._lock:
            tally = self._tallies.setdefault(workspace, _Tally())
            if isinstance(event, Warmed):
                tally.warmups += 1
                tally.prompt_tokens += event.prompt_tokens
                tally.cached_tokens += event.cached_tokens
            else:
                tally.jobs += 1
                tally.prompt_tokens += event.usage.prompt_tokens
                tally.cached_tokens += event.usage.cached_tokens
                tally.completion_tokens += event.usage.completion_tokens
            tally.last_used = time.time()

    def figures(self, workspace: str) -> WorkspaceFigures:
        with self._lock:
            tally = _Tally(**asdict(self._tallies.get(workspace, _Tally())))
        return _figures(workspace, tally)

    def all(self) -> list[WorkspaceFigures]:
        with self._lock:
            items = [(w, _Tally(**asdict(t))) for w, t in self._tallies.items()]
        items.sort(key=lambda item: item[1].last_used or 0, reverse=True)
        return [_figures(w, t) for w, t in items]


def _figures(workspace: str, tally: _Tally) -> WorkspaceFigures:
    last = datetime.fromtimestamp(tally.last_used, timezone.utc).isoformat(timespec="seconds") \
        if tally.last_used else None
    return WorkspaceFigures(workspace=workspace, jobs=tally.jobs, warmups=tally.warmups,
                            prompt_tokens=tally.prompt_tokens, cached_tokens=tally.cached_tokens,
                            completion_tokens=tally.completion_tokens, last_used=last)


class Figures:
    """The daemon as the tools and resources describe it, from the runtime, the
    metrics and the workspace tally (a listener of the runtime's events)."""

    def __init__(self, runtime: Runtime, metrics: Any = None):
        self.runtime = runtime
        self.metrics = metrics
        self.started = time.monotonic()
        self.workspaces = WorkspaceTally()
        self.workspaces.attach(runtime)

    # -- the model ---------------------------------------------------------------------------

    def model_id(self) -> str | None:
        return self.runtime.model_id()

    def model_info(self) -> ModelInfo | None:
        return self.runtime.model()

    def model_card(self) -> dict[str, Any]:
        info = self.runtime.model()
        card: dict[str, Any] = {"id": self.model_id(), "state": self.runtime.state}
        if self.runtime.load_error:
            card["load_error"] = self.runtime.load_error
        if info is None:
            return card
        layout = completion_layout(info.tokenizer)
        card.update(
            path=str(info.path),
            family=info.family,
            mtp_heads=info.mtp_heads,
            depth_range=list(info.depth_range),
            default_depth=self.runtime.depth_for(0.0) or None,
            context_length=info.context_length,
            vocab_size=info.vocab_size,
            sampler_defaults={"temperature": info.temperature, "top_p": info.top_p, "top_k": info.top_k},
            chat_template=has_chat_template(info.tokenizer),
            fill_in_the_middle=layout.reads_suffix,
            code_completion=layout.name,  # fim-psm, fim-spm, or prefix-only (no FIM tokens: the suffix is not used)
        )
        return card

    # -- the daemon --------------------------------------------------------------------------

    def bank(self) -> Sessions | None:
        """The daemon's session bank when it is on, else None."""
        bank = self.runtime.sessions()
        return bank if bank is not None and bank.enabled else None

    def _watched(self) -> list[str] | None:
        """The workspaces the daemon watches for changed files; None without a watcher."""
        registry = self.runtime.workspaces
        return registry.watched() if registry is not None else None

    def session_bank_figures(self) -> dict[str, Any] | None:
        bank = self.bank()
        if bank is None:
            return None
        figures = _as_dict(bank.stats())
        watched = self._watched()
        if watched is not None:
            figures["watched_workspaces"] = watched
        return figures

    def workspace_figures(self, workspace: str) -> dict[str, Any]:
        """One workspace: the scheduler's tally, its session-bank entries, whether it is watched."""
        body: dict[str, Any] = self.workspaces.figures(workspace).model_dump()
        bank = self.bank()
        entries = None
        if bank is not None:
            found = [s for s in bank.workspaces() if s.workspace == workspace]
            entries = {**_as_dict(found[0]), "hits": found[0].hits} if found else {"entries": 0, "hits": 0}
            entries.pop("workspace", None)
        body["session_bank"] = entries
        body["watched"] = workspace in (self._watched() or ())
        return body

    def status(self) -> StatusResult:
        stats = self.runtime.stats()
        info = self.runtime.model()
        return StatusResult(
            state=stats.state,
            model=self.model_id(),
            family=info.family if info is not None else None,
            mtp_heads=info.mtp_heads if info is not None else None,
            profile=self.runtime.profile_name(),
            depth=self.runtime.depth_for(0.0),
            context_length=info.context_length if info is not None else None,
            load_error=self.runtime.load_error,
            uptime_s=round(time.monotonic() - self.started, 3),
            queue=QueueFigures(active=stats.active, queued_by_class=stats.queued_by_class,
                               completed=stats.completed, cancelled=stats.cancelled, steps=stats.steps),
            workspaces=self.workspaces.all(),
            session_bank=self.session_bank_figures(),
        )

    def metrics_text(self) -> str:
        if self.metrics is None:
            return ""
        return self.metrics.render(self.runtime.stats(), self.runtime.decoding()).decode()


def _as_dict(figures: Any) -> dict[str, Any]:
    return asdict(figures) if is_dataclass(figures) and not isinstance(figures, type) else dict(figures)
