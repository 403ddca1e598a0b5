"""Acceptance of a model's MTP heads, measured through the real engine loop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from engine.generation import GenerationRequest
from engine.sampler_settings import SamplerSettings


@dataclass(frozen=True)
class AcceptanceCounts:
    """Per prompt and draft position i: the speculative cycles that reached draft i (drafts
    0..i-1 accepted) and those of them that accepted it."""

    reached: np.ndarray  # [prompts, depth] int
    accepted: np.ndarray  # [prompts, depth] int

    def rates(self) -> list[float]:
        """Per draft position: accepted / reached over every prompt (the per-position
        acceptance `a` of the cost model); 0.0 where no cycle got that far."""
        reached, accepted = self.reached.sum(axis=0), self.accepted.sum(axis=0)
        return [float(a / r) if r else 0.0 for a, r in zip(accepted, reached)]

    def standard_errors(self) -> list[float]:
        """Per draft position: the standard error of `rates`, with the prompt as the unit.
        A prompt's drafts are not independent draws (a function the heads read well
        is read well throughout), so a binomial error over the drafts understates how
        far another set of prompts could land; this is the ratio estimator's error
        across prompts. 0.0 with fewer than two prompts that reached the position."""
        return [_error(self._shares(i), self.reached[:, i] > 0) for i in range(self.reached.shape[1])]

    def _shares(self, i: int) -> np.ndarray:
        """Per prompt, its share of the error of draft position i's rate."""
        reached, accepted = self.reached[:, i], self.accepted[:, i]
        total = reached.sum()
        return (accepted - accepted.sum() / total * reached) / total if total else np.zeros(len(reached))


def paired_difference(a: AcceptanceCounts, b: AcceptanceCounts) -> list[tuple[float, float]]:
    """Per draft position: a's rate less b's, and that difference's standard error, both
    counted on the same prompts. Paired, a prompt's own ease cancels: two sets of heads
    0.02 apart can be told apart on prompts whose rates alone spread by more."""
    if a.reached.shape != b.reached.shape:
        raise ValueError("paired counts need the same prompts and depth")
    return [(ra - rb, _error(a._shares(i) - b._shares(i), (a.reached[:, i] > 0) | (b.reached[:, i] > 0)))
            for i, (ra, rb) in enumerate(zip(a.rates(), b.rates()))]


def _error(shares: np.ndarray, used: np.ndarray) -> float:
    n = int(used.sum())
    return float(np.sqrt(n / (n - 1) * (shares[used] ** 2).sum())) if n >= 2 else 0.0


def count_acceptance(engine, prompts: Sequence[str | Sequence[int]], depth: int, n_tokens: int) -> AcceptanceCounts:
    """Greedy generations of `n_tokens` at temperature 0, one a prompt (text, encoded with
    the engine's tokenizer, or token ids), through the engine's own speculative loop."""
    reached = np.zeros((len(prompts), depth), dtype=np.int64)
    accepted = np.zeros((len(prompts), depth), dtype=np.int64)
    for p, prompt in enumerate(prompts):
        ids = tuple(engine.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt)
        gen = engine.open(GenerationRequest(
            prompt=ids, sampler=SamplerSettings(temperature=0.0), mode="mtp", depth=depth,
            max_tokens=n_tokens,
        ))
        try:
            while not gen.finished:
                for i, ok in enumerate(gen.step().accepted):
                    reached[p, i] += 1
                    accepted[p, i] += ok
                    if not ok:
                        break
        finally:
            gen.close()
    return AcceptanceCounts(reached, accepted)


def measure_acceptance(engine, prompts: Sequence[str | Sequence[int]], depth: int, n_tokens: int) -> list[float]:
    """Per-depth acceptance at temperature 0 (`AcceptanceCounts.rates`)."""
    return count_acceptance(engine, prompts, depth, n_tokens).rates()
