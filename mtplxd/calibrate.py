"""The daemon's own calibration: AR against MTP, timed on the scheduler's worker thread.

On the first start of a model on a machine there is no stored measurement
(engine/profiles.py), so the daemon queues one CalibrateJob at background
priority. It runs held-out prompts as AR and as MTP at each depth, at
temperature 0 and 0.6 (A B A B over rounds, like `mtplxd bench`), one decode
step per scheduler turn, so editors and agents never wait behind it. Each round
takes the next prompt: acceptance, and so MTP's speed, differs much from one
prompt to another, and one prompt's luck must not decide for every request. Then the
same at 2, 4 and 8 rows decoding in one batch (engine/batch.py), batched AR
against batched MTP, from which batch size plain AR is faster. Only the job's
own steps are timed, so requests interleaved with it do not skew the figures.
The result is stored per model and machine and used at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from engine.batch import DecodeBatch
from engine.engine import Engine
from engine.generation import Generation, GenerationRequest
from engine.profiles import BATCH_TEMPERATURE, MEASURED_BATCH_SIZES, MEASURED_SAMPLERS, Calibration
from mtplxd.requests import Priority

ROUNDS = 2  # each with its own prompt


@dataclass(frozen=True)
class CalibrateRequest:
    prompts: tuple[tuple[int, ...], ...]  # token ids; round r decodes prompts[r % len(prompts)]
    depths: tuple[int, ...] = (1, 2, 3)
    batch_sizes: tuple[int, ...] = MEASURED_BATCH_SIZES
    max_tokens: int = 32
    rounds: int = ROUNDS
    priority: Priority = Priority.BACKGROUND
    workspace: str | None = None  # never banked; present for the scheduler's bookkeeping


@dataclass(frozen=True)
class Calibrated:
    calibration: Calibration


# One timed decode: (temperature key, mode, depth); depth 0 for AR.
_Run = tuple[str, Literal["ar", "mtp"], int]
# A timed decode's prompt is the round's: (round, run).
_Scheduled = tuple[int, _Run]
# One timed batch: (rows, depth); depth 0 for AR.
_BatchRun = tuple[int, int]
UNTIMED_BATCH_STEPS = 3


@dataclass
class _Timing:
    seconds: float = 0.0
    tokens: int = 0


@dataclass
class CalibrateJob:
    request: CalibrateRequest
    engine: Engine
    finished: bool = False
    _runs: list[_Scheduled] = field(default_factory=list)
    _timings: dict[_Run, _Timing] = field(default_factory=dict)
    _current: Generation | None = None
    _batch_runs: list[_BatchRun] = field(default_factory=list)
    _batch_timings: dict[_BatchRun, _Timing] = field(default_factory=dict)  # every step
    _steady_timings: dict[_BatchRun, _Timing] = field(default_factory=dict)  # full batches, traced shapes
    _opened: list[Generation] = field(default_factory=list)  # the rows of the batch run under way
    _batch: DecodeBatch | None = None
    _batch_steps: int = 0  # steps of the batch run under way

    def __post_init__(self) -> None:
        depths = [d for d in self.request.depths if d >= 1] if self.engine.backend.n_heads else []
        for round_ in range(self.request.rounds):
            for key in MEASURED_SAMPLERS:
                for depth in depths:  # AR right before each depth: machine noise hits both alike
                    self._runs += [(round_, (key, "ar", 0)), (round_, (key, "mtp", depth))]
        for round_ in range(self.request.rounds):
            for rows in self.request.batch_sizes:
                for depth in depths:  # A B, then B A: a drift of the machine's speed hits both alike
                    pair = [(rows, 0), (rows, depth)]
                    self._batch_runs += pair if round_ % 2 == 0 else pair[::-1]

    def step(self) -> list:
        if not self._runs:
            if self._batch_runs:
                self._batch_step()
                return []
            self.finished = True
            return [Calibrated(self._calibration())]
        round_, run = self._runs[0]
        if self._current is None:
            self._current = self._open(run, self._prompt(round_))
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

    def _batch_step(self) -> None:
        """One short unit of the batch run under way: open a row (its prompt and first
        token, untimed), or time one batched step of all of them."""
        rows, depth = run = self._batch_runs[0]
        if len(self._opened) < rows:
            generation = self._open((BATCH_TEMPERATURE, "mtp" if depth else "ar", depth), self._prompt(0))
            generation.step()
            self._opened.append(generation)
            return
        if self._batch is None:
            self._batch = DecodeBatch(self.engine.backend, depth)
            for generation in self._opened:
                if not generation.finished:
                    self._batch.join(generation)
        # Timed: full batches past their first steps (a new batch shape is traced by
        # mx.compile on its first step; the end of a run, as rows finish, has new ones).
        # Runs too short for that (a few tokens a row) are timed whole.
        steady = len(self._batch) == rows and self._batch_steps >= UNTIMED_BATCH_STEPS
        started = time.perf_counter()
        results = self._batch.step() if len(self._batch) else []
        self._batch_steps += 1
        for timings in (self._batch_timings, self._steady_timings) if steady else (self._batch_timings,):
            timing = timings.setdefault(run, _Timing())
            timing.seconds += time.perf_counter() - started
            timing.tokens += sum(len(r.tokens) for r in results)
        for generation in [g for g in self._batch.rows if g.finished]:
            self._batch.leave(generation)
        if not len(self._batch):
            self.close()
            self._batch_runs.pop(0)

    def close(self) -> None:
        if self._current is not None:
            self._current.close()
            self._current = None
        if self._batch is not None:
            for generation in list(self._batch.rows):
                self._batch.leave(generation)
            self._batch = None
        self._batch_steps = 0
        for generation in self._opened:
            generation.close()
        self._opened = []

    def _prompt(self, round_: int) -> tuple[int, ...]:
        return self.request.prompts[round_ % len(self.request.prompts)]

    def _open(self, run: _Run, prompt: tuple[int, ...]) -> Generation:
        key, mode, depth = run
        return self.engine.open(GenerationRequest(
            prompt=prompt, sampler=MEASURED_SAMPLERS[key], mode=mode, depth=max(depth, 1),
            max_tokens=self.request.max_tokens, seed=0, prefill_chunk=len(prompt)))

    def _calibration(self) -> Calibration:
        speeds: dict[tuple[str, str, int], float] = {
            run: t.tokens / t.seconds for run, t in self._timings.items() if t.seconds > 0}
        r = self.request
        detail = (f"daemon calibration: {min(r.rounds, len(r.prompts))} prompts, {r.rounds} rounds x "
                  f"{r.max_tokens} tokens")
        calibration = Calibration.from_speeds(speeds, time.time(), detail)
        for rows, depth in {run for run in self._batch_timings if run[1]}:
            pair = [(rows, 0), (rows, depth)]
            # Both sides steady when both have steady steps, else both whole.
            timings = self._steady_timings if all(run in self._steady_timings for run in pair) else self._batch_timings
            ar, mtp = (timings.get(run) for run in pair)
            if ar and mtp and ar.tokens and mtp.seconds:
                speedup = (mtp.tokens / mtp.seconds) / (ar.tokens / ar.seconds)
                calibration.batched.setdefault(rows, {})[depth] = round(speedup, 3)
        return calibration


def calibration_prompts(engine: Engine, count: int, max_tokens: int = 512) -> tuple[tuple[int, ...], ...]:
    """The openings of `count` held-out standard-library modules (mtplxd bench's first prompts)."""
    texts = held_out_prompts(count) or ["def main(argv):\n    "]
    return tuple(tuple(engine.tokenizer.encode(text)[-max_tokens:]) for text in texts)


def held_out_prompts(n: int, chars: int = 1200) -> list[str]:
    """The opening of the first `def` in each held-out module (deterministic): the
    prompts the daemon's calibration and `mtplxd bench` (mtplxd/bench/decode.py) decode."""
    from engine.training.corpus import held_out_files

    prompts = []
    for doc in held_out_files():
        start = doc.text.find("\ndef ")
        if start >= 0:
            prompts.append(doc.text[max(0, start - chars) : start + 1 + doc.text[start + 1 :].find("\n") + 1])
        if len(prompts) == n:
            break
    return prompts
