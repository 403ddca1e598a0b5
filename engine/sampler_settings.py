"""A request's sampler settings: plain numbers, no MLX (engine/sampling.py turns them
into probabilities). The adapters build them from a protocol's fields."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplerSettings:
    """temperature 0 means greedy; top_p 1, top_k 0 and min_p 0 mean "off"."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    def __post_init__(self):
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_top_p(self) -> bool:
        return self.top_p < 1.0  # skip at 1.0: float32 cumsum rounding could drop tail tokens

    @property
    def uses_min_p(self) -> bool:
        return self.min_p > 0.0
