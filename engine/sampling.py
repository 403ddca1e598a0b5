"""Sampler settings and the filtered probabilities that both target and draft use.

Speculative decoding is exact only with respect to the *filtered* target, so the
same `probabilities` must be applied to the target logits and to the draft
logits (REFERENCE §2). Everything here is mx ops on float32 and batched over
leading dims, so it never forces a host sync.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache, partial

# Being inside the engine package, engine/__init__ (the BLAS fix) has already run.
import mlx.core as mx


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


@lru_cache(maxsize=32)
def compiled_probabilities(settings: SamplerSettings) -> Callable[[mx.array], mx.array]:
    """`probabilities` for fixed settings, traced once per shape by mx.compile."""
    return mx.compile(partial(probabilities, settings=settings))


def probabilities(logits: mx.array, settings: SamplerSettings) -> mx.array:
    """Logits [..., V] -> float32 probabilities [..., V] after all filters.

    Order: temperature, top-k, top-p (on the top-k renormalised mass), min-p,
    renormalise. Temperature 0 returns the one-hot of the argmax (first index
    on ties); every filter keeps the top token, so filtering cannot change it.
    """
    logits = logits.astype(mx.float32)
    if settings.greedy:
        return _one_hot_argmax(logits)
    probs = mx.softmax(logits / settings.temperature, axis=-1, precise=True)
    keep = _keep_mask(probs, settings)
    if keep is None:
        return probs
    probs = mx.where(keep, probs, 0.0)
    return probs / probs.sum(axis=-1, keepdims=True)


def _one_hot_argmax(logits: mx.array) -> mx.array:
    vocab = mx.arange(logits.shape[-1])
    top = mx.argmax(logits, axis=-1, keepdims=True)
    return (vocab == top).astype(mx.float32)


def _keep_mask(probs: mx.array, s: SamplerSettings) -> mx.array | None:
    """Boolean [..., V] of the tokens the filters keep; None when no filter is on.

    All three filters are decided on one descending sort: top-k is a rank cut
    (exactly k tokens, even with ties), top-p a cut on the mass before each
    token, min-p a cut relative to the top probability. The mask is then
    scattered back to vocabulary order.
    """
    vocab_size = probs.shape[-1]
    use_k = 0 < s.top_k < vocab_size
    use_p = s.top_p < 1.0  # skip at 1.0: float32 cumsum rounding could drop tail tokens
    use_min = s.min_p > 0.0
    if not (use_k or use_p or use_min):
        return None

    order = mx.argsort(-probs, axis=-1)
    sorted_p = mx.take_along_axis(probs, order, axis=-1)
    keep = mx.ones(sorted_p.shape, dtype=mx.bool_)
    rank = mx.arange(vocab_size)
    if use_k:
        keep = keep & (rank < s.top_k)
    if use_p:
        # Keep a token while the mass strictly before it (within the top-k set)
        # is below top_p: the smallest prefix with mass >= top_p. The top token
        # has 0 mass before it and top_p > 0, so it is always kept.
        kept_p = mx.where(keep, sorted_p, 0.0)
        before = mx.cumsum(kept_p, axis=-1, inclusive=False)
        keep = keep & (before < s.top_p * kept_p.sum(axis=-1, keepdims=True))
    if use_min:
        # Relative cut, so the renormalisation of top-k/top-p does not change it.
        keep = keep & (sorted_p >= s.min_p * sorted_p[..., :1])
    return mx.put_along_axis(mx.zeros(keep.shape, dtype=mx.bool_), order, keep, axis=-1)
