"""The daemon's own calibration: AR against MTP, timed on the scheduler's worker thread.

On the first start of a model on a machine there is no stored measurement
(engine/profiles.py), so the daemon queues one CalibrateJob at background
priority. It runs the same held-out prompt as AR and as MTP at each depth, at
temperature 0 and 0.6 (A B A B over rounds, like `mtplxd bench`), one decode
step per scheduler turn, so editors and agents never wait behind it. Only the
job's own steps are timed, so requests interleaved with it do not skew the
figures. The result is stored per model and machine and used at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from engine.engine import Engine
from engine.generation import Generation, GenerationRequest
from engine.profiles import MEASURED_SAMPLERS, Calibration
from mtplxd.requests import Priority


@dataclass(frozen=True)
class CalibrateRequest:
    prompt_ids: tuple[int, ...]
    depths: tuple[int, ...] = (1, 2, 3)
    max_tokens: int = 32
    rounds: int = 2
    priority: Priority = Priority.BACKGROUND
    workspace: str | None = None  # never banked; present for the scheduler's bookkeeping


@dataclass(frozen=True)
class Calibrated:
    calibration: Calibration


# One timed decode: (temperature key, mode, depth); depth 0 for AR.
_Run = tuple[str, Literal["ar", "mtp"], int]


@dataclass
class _Timing:
    seconds: float = 0.0
    tokens: int = 0


@dataclass
class CalibrateJob:
    request: CalibrateRequest
    engine: Engine
    finished: bool = False
    _runs: list[_Run] = field(default_factory=list)
    _timings: dict[_Run, _Timing] = field(default_factory=dict)
    _current: Generation | None = None

    def __post_init__(self) -> None:
        depths = [d for d in self.request.depths if d >= 1] if self.engine.backend.n_heads else []
        for _ in range(self.request.rounds):
            for key in MEASURED_SAMPLERS:
                for depth in depths:  # AR right before each depth: machine noise hits both alike
                    self._runs += [(key, "ar", 0), (key, "mtp", depth)]

    def step(self) -> list:
        if not self._runs:
            self.finished = True
            return [Calibrated(self._calibration())]
        run = self._runs[0]
        if self._current is None:
            self._current = self._open(run)
            self._current.step()  # the prompt and the first token: not decode speed
            return []
        started = time.perf_counter()
        result = self._current.step()
        timing = self._timings.setdefault(run, _Timing())
        timing.seconds += time.perf_counter() - started
        timing.tokens += len(result.tokens)
        if self._current.finished:
            self._current.close()
            self._current = None
            self._runs.pop(0)
        return []

    def close(self) -> None:
        if self._current is not None:
            self._current.close()
            self._current = None

    def _open(self, run: _Run) -> Generation:
        key, mode, depth = run
        return self.engine.open(GenerationRequest(
            prompt=self.request.prompt_ids, sampler=MEASURED_SAMPLERS[key], mode=mode, depth=max(depth, 1),
            max_tokens=self.request.max_tokens, seed=0, prefill_chunk=len(self.request.prompt_ids)))

    def _calibration(self) -> Calibration:
        speeds: dict[tuple[str, str, int], float] = {
            run: t.tokens / t.seconds for run, t in self._timings.items() if t.seconds > 0}
        r = self.request
        detail = f"daemon calibration: {len(r.prompt_ids)}-token prompt, {r.rounds} rounds x {r.max_tokens} tokens"
        return Calibration.from_speeds(speeds, time.time(), detail)


def calibration_prompt(engine: Engine, max_tokens: int = 512) -> tuple[int, ...]:
    """The opening of a held-out standard-library module (mtplxd bench's first prompt)."""
    from mtplxd.bench.decode import held_out_prompts  # the bench module only when calibrating

    texts = held_out_prompts(1) or ["def main(argv):\n    "]
    ids = engine.tokenizer.encode(texts[0])
    return tuple(ids[-max_tokens:])
