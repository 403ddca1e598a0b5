"""The daemon as the adapters see it: one typed object instead of the scheduler.

    runtime = Runtime(scheduler, settings, workspaces, warnings)   # mtplxd/daemon.py
    create_app(runtime, settings); mcp.mount(app, runtime, settings); serve_lsp(runtime, settings)

An adapter (adapters/http, adapters/mcp, adapters/lsp) submits typed requests
(mtplxd/jobs.py) and reads their events; it reads the daemon's state and the loaded
model's facts (`ModelInfo`), the decoding plan, warnings and memory; it sees the session
bank (`Sessions`) and the workspace registry (`Workspaces`) through views of what it may
read and do; it sees every queued and running job (`JobView`: who asked, how long it
waited, its tokens so far); and it listens to every job's events. It never holds the
scheduler, the engine, the bank or an MLX array: what it may know is what this module offers.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from engine.sampler_settings import SamplerSettings
from mtplxd.requests import (
    Done, EmbedRequest, Event, Failed, SchedulerStats, TextDelta, TextRequest, Ticket, WarmRequest,
)

if TYPE_CHECKING:  # annotations only: importing the adapters never loads MLX or the scheduler
    from engine.profiles import DecodePlan
    from engine.sessions.bank import SessionBank
    from engine.sessions.stats import BankStats, WorkspaceStats
    from mtplxd.config import Settings
    from mtplxd.scheduler import Scheduler
    from mtplxd.workspaces import WorkspaceRegistry

# (the job's entry: its `.request` and `.priority`, the class it runs in; the event) on the
# scheduler's worker thread
Listener = Callable[[Any, Event], None]
MAX_PROGRESS = 256  # jobs' counters kept before those of ended jobs are dropped


@dataclass(frozen=True)
class ModelInfo:
    """The loaded model as requests need it (read once, when it is ready)."""

    id: str  # the checkpoint folder's name
    path: Path
    family: str | None
    mtp_heads: int
    depth_range: tuple[int, int]
    tokenizer: Any  # a Hugging Face tokenizer: prompts are built with it
    context_length: int
    vocab_size: int
    hidden_size: int | None
    depth_max: int
    # Unset sampler fields take the model family's recommended values, not OpenAI's
    # temperature 1, which suits few local models.
    temperature: float
    top_p: float
    top_k: int
    default_depth: int | None  # the `depth` setting, if any
    quantization: str = "float"  # "4-bit, group 64" for a quantized checkpoint (its config's)

    @classmethod
    def from_engine(cls, engine: Any, default_depth: int | None) -> ModelInfo:
        backend, descriptor = engine.backend, engine.descriptor
        defaults = getattr(descriptor, "sampler_defaults", None)
        depth_range = tuple(getattr(descriptor, "depth_range", (1, 1)))
        return cls(
            id=engine.path.name,
            path=Path(engine.path),
            family=getattr(descriptor, "family", None),
            mtp_heads=backend.n_heads,
            depth_range=(int(depth_range[0]), int(depth_range[1])) if descriptor is not None else (0, 0),
            tokenizer=engine.tokenizer,
            context_length=engine.context_length,
            vocab_size=backend.vocab_size,
            hidden_size=getattr(getattr(backend.trunk, "args", None), "hidden_size", None),
            depth_max=max(depth_range[1], backend.n_heads),
            temperature=defaults.temperature if defaults else 1.0,
            top_p=defaults.top_p if defaults else 1.0,
            top_k=defaults.top_k if defaults else 0,
            default_depth=default_depth,
            quantization=_quantization(engine),
        )

    def sampler(self, temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                min_p: float = 0.0) -> SamplerSettings:
        """A request's sampler: the fields it set (each protocol checks its own ranges
        first), the model family's defaults for the others."""
        return SamplerSettings(
            temperature=self.temperature if temperature is None else temperature,
            top_p=self.top_p if top_p is None else top_p,
            top_k=self.top_k if top_k is None else top_k,
            min_p=min_p,
        )


def _quantization(engine: Any) -> str:
    """The checkpoint's quantization in words, from its config.json."""
    from engine.checkpoint import CheckpointError, read_config

    try:
        config = read_config(engine.path)
    except (AttributeError, TypeError, OSError, CheckpointError):  # a test double without a folder
        return "unknown"
    q = config.get("quantization")
    if isinstance(q, dict) and "bits" in q:
        return f"{q['bits']}-bit, group {q.get('group_size', '?')}"
    return str(config.get("torch_dtype") or "float")


@dataclass(frozen=True)
class JobView:
    """One queued or running job, read-only: who asked, its class, how long it waited
    (or has been waiting), and the tokens it made so far."""

    id: int
    client: str  # openai | anthropic | mcp | lsp | ... as the adapter said; else what the request is
    kind: str  # text | embed | warm | calibrate
    priority: str  # interactive | normal | background
    running: bool
    wait_s: float  # submitted -> its first token, or -> now while it waits for one
    tokens: int
    tokens_per_s: float  # since its first token
    drafted: int
    accepted: int


@dataclass
class _Progress:
    """A job's counters, kept from its events on the worker thread."""

    client: str = ""
    created: float = dataclasses.field(default_factory=time.perf_counter)
    started: float | None = None  # perf_counter of its first token
    last: float = 0.0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0


class Runtime:
    def __init__(self, scheduler: Scheduler, settings: Settings, workspaces: WorkspaceRegistry | None = None,
                 warnings: list[str] | None = None):
        """`warnings`: one-line conditions others add to (the daemon's log file), for /health."""
        self._scheduler = scheduler
        self._settings = settings
        self._workspaces = workspaces
        self._workspace_view = Workspaces(workspaces) if workspaces is not None else None
        self._warnings = warnings if warnings is not None else []
        self._listeners: list[Listener] = []
        self._model: ModelInfo | None = None
        self._progress: dict[int, _Progress] = {}  # by job id; written on the worker thread
        self._progress_lock = threading.Lock()
        scheduler.on_event = self._tell

    # -- work ----------------------------------------------------------------------------

    def submit(self, request: TextRequest | EmbedRequest | WarmRequest, client: str = "") -> Ticket:
        """Queue a job (raises QueueFull or NotReady). A workspace a text request names is
        registered, so the daemon watches its files (mtplxd/workspaces.py). `client`: who
        asks, in a word (openai, anthropic, mcp, lsp), shown by `jobs()`."""
        ticket = self._scheduler.submit(request)
        if client:
            with self._progress_lock:
                self._progress.setdefault(ticket.id, _Progress()).client = client
        if len(self._progress) > MAX_PROGRESS:  # cancelled jobs end without an event: forget them
            self.jobs()
        if isinstance(request, TextRequest) and request.workspace and self._workspaces is not None:
            self._workspaces.register(request.workspace)
        return ticket

    def plan(self, request: TextRequest) -> DecodePlan:
        """The mode and depth `request` will decode with."""
        return self._scheduler.plan(request)

    def listen(self, listener: Listener) -> None:
        """Call `listener` with every job's events (on the worker thread: keep it short)."""
        self._listeners.append(listener)

    def _tell(self, entry: Any, event: Event) -> None:
        self._count(entry.id, event)
        for listener in self._listeners:
            listener(entry, event)

    def _count(self, job_id: int, event: Event) -> None:
        """A job's progress for `jobs()`; forgotten when it ends."""
        with self._progress_lock:
            if isinstance(event, (Done, Failed)):
                self._progress.pop(job_id, None)
                return
            if not isinstance(event, TextDelta) or not event.token_ids:
                return
            progress = self._progress.setdefault(job_id, _Progress())
            now = time.perf_counter()
            if progress.started is None:
                progress.started = now
            progress.last = now
            progress.tokens += len(event.token_ids)
            progress.drafted += event.drafted
            progress.accepted += sum(event.accepted)

    def jobs(self) -> list[JobView]:
        """Every queued and running job, by class then arrival."""
        now = time.perf_counter()
        entries = self._scheduler.entries()
        with self._progress_lock:
            alive = {job_id for job_id, *_ in entries}
            for gone in [i for i, p in self._progress.items() if i not in alive and p.created < now]:
                del self._progress[gone]  # cancelled: no Done came
            progress = {i: dataclasses.replace(self._progress[i]) for i in alive if i in self._progress}
        return [_job_view(job_id, priority, request, now - submitted, running, progress.get(job_id), now)
                for job_id, priority, request, submitted, running in entries]

    # -- state ---------------------------------------------------------------------------

    @property
    def state(self) -> str:
        """loading | ready | failed | stopping | stopped"""
        return self._scheduler.state

    @property
    def load_error(self) -> str | None:
        return self._scheduler.load_error

    def failure(self) -> str:
        """Why nothing runs (state "failed"): the model did not load, or its ranks stopped."""
        return self._scheduler.failure_message()

    def stats(self) -> SchedulerStats:
        return self._scheduler.stats()

    def model(self) -> ModelInfo | None:
        """The loaded model's facts; None until it is ready."""
        engine = self._scheduler.engine
        if self._model is None and self.state == "ready" and engine is not None:
            self._model = ModelInfo.from_engine(engine, self._settings.depth)
        return self._model

    def model_id(self) -> str | None:
        """The model's name, known from the settings before it has loaded."""
        engine = self._scheduler.engine
        if engine is not None:
            return engine.path.name
        try:
            return self._settings.model_path.name
        except Exception:  # a model setting that cannot be resolved: no name yet
            return None

    def decoding(self) -> dict | None:
        """The profile and the mode/depth it picks per temperature (engine/profiles.py)."""
        planner = self._scheduler.planner
        return planner.describe() if planner is not None else None

    def profile_name(self) -> str:
        planner = self._scheduler.planner
        return planner.profile.name if planner is not None else self._settings.profile or "auto"

    def depth_for(self, temperature: float) -> int:
        """The depth a request at `temperature` decodes with (0: AR, or no model yet)."""
        planner = self._scheduler.planner
        if planner is None:
            return 0
        plan = planner.plan(temperature)
        return plan.depth if plan.mode == "mtp" else 0

    def ranks(self) -> dict | None:
        """Several ranks (mtplxd/ranks/): how the model is split and each rank's state;
        None for one process."""
        leader = self._scheduler.ranks
        if leader is None:
            return None
        return {"size": leader.size, "sharding": leader.sharding, "failure": leader.failure,
                "ranks": leader.describe()}

    def warnings(self) -> list[str]:
        """One line per condition the user should know of (a full disk, an unwritable log)."""
        bank = self._scheduler.bank
        disk = bank.disk_warning if bank is not None else None
        return [*self._warnings, *([disk] if disk else [])]

    def memory(self) -> dict[str, int]:
        import mlx.core as mx

        return {"active_bytes": mx.get_active_memory(), "peak_bytes": mx.get_peak_memory()}

    # -- the session bank and the workspaces ----------------------------------------------

    def sessions(self) -> Sessions | None:
        """The session bank's figures and its one action; None when the daemon runs without."""
        bank = self._scheduler.bank
        return Sessions(bank) if bank is not None else None

    @property
    def workspaces(self) -> Workspaces | None:
        """The workspace registry's view; None when the daemon runs without one (tests)."""
        return self._workspace_view


def _job_view(job_id: int, priority: str, request: Any, age_s: float, running: bool, progress: _Progress | None,
              now: float) -> JobView:
    kind = {"TextRequest": "text", "EmbedRequest": "embed", "WarmRequest": "warm"}.get(
        type(request).__name__, "calibrate")
    p = progress or _Progress()
    started = p.started if p.started is not None else now
    waited = age_s - (now - started) if p.started is not None else age_s
    rate = p.tokens / (p.last - p.started) if p.started is not None and p.last > p.started else 0.0
    return JobView(job_id, p.client or kind, kind, priority, running, max(0.0, waited), p.tokens, rate,
                   p.drafted, p.accepted)


class Sessions:
    """What the adapters see of the session bank (engine/sessions/bank.py): its figures,
    and clearing a workspace. The default workspace is None here, as on requests."""

    def __init__(self, bank: SessionBank):
        self._bank = bank

    @property
    def enabled(self) -> bool:
        """False until the model has loaded, or with a RAM budget of 0."""
        return self._bank.enabled

    def stats(self) -> BankStats:
        return self._bank.stats()

    def workspaces(self) -> list[WorkspaceStats]:
        """Blocking (the bank's lock): call from a worker thread."""
        return [dataclasses.replace(s, workspace=s.workspace or None) for s in self._bank.workspaces()]

    def clear(self, workspace: str | None) -> int:
        """Drop `workspace`'s entries in RAM and on disk; how many. Blocking, like `workspaces`."""
        return self._bank.clear(workspace)


class Workspaces:
    """What the adapters see of the workspace registry (mtplxd/workspaces.py): the
    folders it watches, and the folders editors opened over LSP (noted by the LSP
    adapter, read by the MCP one). Registering a workspace happens on `Runtime.submit`."""

    def __init__(self, registry: WorkspaceRegistry):
        self._registry = registry

    def watched(self) -> list[str]:
        return self._registry.watched()

    def open_in_editor(self, folder: str) -> None:
        """Note a folder an editor opened (its root or a workspace folder)."""
        self._registry.open_in_editor(folder)

    def editor_folders(self) -> list[str]:
        """The folders editors opened during this daemon's life, most recent last."""
        return self._registry.editor_folders()

    # Warm-ups of changed files, counted since the daemon started.
    @property
    def warmups_started(self) -> int:
        return self._registry.warmups_started

    @property
    def warmups_done(self) -> int:
        return self._registry.warmups_done

    @property
    def warmups_failed(self) -> int:
        return self._registry.warmups_failed
