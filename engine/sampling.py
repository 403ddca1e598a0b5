"""Sampler settings and the filtered probabilities that both target and draft use.

Speculative decoding is exact only with respect to the *filtered* target, so the
same `probabilities` must be applied to the target logits and to the draft
logits (REFERENCE §2). Everything here is mx ops on float32 and batched over
leading dims; the only host sync is the check of top-p's shortcut, which
`provisional_probabilities` leaves to its caller (`_top_p_cut`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

# Being inside the engine package, engine/__init__ (the BLAS fix) has already run.
import mlx.core as mx

from engine.quantized_rows import native
from engine.sampler_settings import SamplerSettings


@dataclass(frozen=True)
class _TracedSettings:
    """SamplerSettings inside a compiled trace: the numbers are arrays (inputs of
    the trace), the choices that shape the graph stay Python values."""

    temperature: mx.array
    top_p: mx.array
    top_k: int
    min_p: mx.array
    uses_top_p: bool
    uses_min_p: bool
    greedy: bool


# Candidates for the top-p cut before falling back to a full sort: a sampled
# nucleus is usually far smaller, and mx.topk is ~10x cheaper than mx.sort here.
# 64 candidates missed the nucleus of 34-49% of the draws on held-out code at
# temperature 0.6 (flat positions, flatter heads); 512 missed none, at the same cost.
TOP_P_CANDIDATES = 512


@lru_cache(maxsize=64)
def compiled_probabilities(settings: SamplerSettings) -> Callable[[mx.array], tuple[mx.array, mx.array]]:
    """`provisional_probabilities` for these settings, compiled (covered is always an
    array here). The temperature, top-p and min-p go in as an array: one trace per
    input shape and kind of filtering serves every value, where a number traced in
    would be a constant of the generated CPU kernels, each new value costing a
    C++ compile of its own (~0.6 s at a request's first token)."""
    numbers = mx.array([settings.temperature, settings.top_p, settings.min_p], dtype=mx.float32)
    traced = _compiled_filters(settings.top_k, settings.uses_top_p, settings.uses_min_p, settings.greedy)
    return lambda logits: traced(logits, numbers)


@lru_cache(maxsize=32)
def _compiled_filters(top_k: int, uses_top_p: bool, uses_min_p: bool, greedy: bool) -> Callable:
    def provisional(logits: mx.array, numbers: mx.array) -> tuple[mx.array, mx.array]:
        settings = _TracedSettings(numbers[0], numbers[1], top_k, numbers[2], uses_top_p, uses_min_p, greedy)
        probs, covered = _filtered(logits, settings, shortcut=True)
        return probs, mx.array(True) if covered is None else covered

    return mx.compile(provisional)


def probabilities(logits: mx.array, settings: SamplerSettings) -> mx.array:
    """Logits [..., V] -> float32 probabilities [..., V] after all filters.

    Order: temperature, top-k, top-p (on the top-k renormalised mass), min-p,
    renormalise. Temperature 0 returns the one-hot of the argmax (first index
    on ties); every filter keeps the top token, so filtering cannot change it.
    Syncs with the host at most once, to check the top-p shortcut.
    """
    probs, covered = provisional_probabilities(logits, settings)
    if covered is None or covered.item():
        return probs
    return _filtered(logits, settings, shortcut=False)[0]


def provisional_probabilities(logits: mx.array, settings: SamplerSettings) -> tuple[mx.array, mx.array | None]:
    """`probabilities` without a host sync: (probs, covered). The top-p cut is sought
    among the TOP_P_CANDIDATES most probable tokens only; `covered` (a bool array,
    or None when there was nothing to check) says whether they held it. Where it
    is true, probs equal `probabilities` exactly; where false, they must not be
    used. A caller evaluates `covered` with its other results, so a decode cycle
    needs no sync of its own, and redoes the work with `probabilities` in the rare
    case that it is false."""
    return _filtered(logits, settings, shortcut=True)


def _filtered(logits: mx.array, settings: SamplerSettings | _TracedSettings, shortcut: bool) -> tuple[mx.array, mx.array | None]:
    logits = logits.astype(mx.float32)
    if settings.greedy:
        return _one_hot_argmax(logits), None
    probs = softmax(logits / settings.temperature)
    keep, covered = _keep_mask(probs, settings, shortcut)
    if keep is None:
        return probs, None
    probs = mx.where(keep, probs, 0.0)
    return probs / probs.sum(axis=-1, keepdims=True), covered


def softmax(logits: mx.array) -> mx.array:
    """Softmax over the last axis, float32. MLX's CPU `exp` costs ~19 ns an element:
    on the CPU the native module's softmax (engine/native, a vectorized exp: ~4 ns),
    else power(e, x) (~10 ns). A -inf logit gets exactly 0 either way."""
    module = native()
    if module is not None and logits.dtype == mx.float32:
        return module.softmax(logits)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    weights = mx.power(math.e, shifted)
    return weights / weights.sum(axis=-1, keepdims=True)


def top_values(x: mx.array, k: int) -> mx.array:
    """The k largest values of each row of x [..., V], in no particular order (the values
    of mx.topk). On the CPU the native module's: MLX's CPU topk partitions the whole row
    (~0.6 ms of SmolLM2's 49,152 tokens, two thirds of a top-p filter), the native one
    finds the k-th value's bucket in a histogram (8 rows of 512 of 49,152: 0.65 ms against
    3.1, each with ~0.07 ms of MLX's evaluation)."""
    module = native()
    if module is not None and x.dtype == mx.float32:
        return module.top_values(x, k)
    return mx.topk(x, k, axis=-1)


def _one_hot_argmax(logits: mx.array) -> mx.array:
    vocab = mx.arange(logits.shape[-1])
    top = mx.argmax(logits, axis=-1, keepdims=True)
    return (vocab == top).astype(mx.float32)


def _keep_mask(probs: mx.array, s: SamplerSettings | _TracedSettings, shortcut: bool) -> tuple[mx.array | None, mx.array | None]:
    """Boolean [..., V] of the tokens the filters keep (None when no filter is on),
    and whether the top-p shortcut held the cut (None when not taken).

    top-k is a rank cut (exactly k tokens, even with ties), top-p a cut on the
    mass of the more probable tokens within the top-k set, min-p a cut relative
    to the top probability. Each is a threshold on probs, so none needs the
    vocabulary in sorted order.
    """
    vocab_size = probs.shape[-1]
    use_k = 0 < s.top_k < vocab_size
    use_p = s.uses_top_p
    use_min = s.uses_min_p
    if not (use_k or use_p or use_min):
        return None, None

    keep, covered = mx.array(True), None
    if use_k:
        keep = _top_k_mask(probs, s.top_k)
    if use_p:
        size = s.top_k if use_k else vocab_size
        cut, covered = _top_p_cut(mx.where(keep, probs, 0.0), s.top_p, size, shortcut)
        keep = keep & (probs >= cut)
    if use_min:
        # Relative cut, so the renormalisation of top-k/top-p does not change it.
        keep = keep & (probs >= s.min_p * probs.max(axis=-1, keepdims=True))
    return keep, covered


def _top_k_mask(probs: mx.array, k: int) -> mx.array:
    """The k most probable tokens; ties at the k-th value go to the lowest ids
    (as a stable descending sort would), so exactly k are kept."""
    kth = top_values(probs, k).min(axis=-1, keepdims=True)
    above = probs > kth
    tied = probs == kth
    room = k - above.sum(axis=-1, keepdims=True)
    return above | (tied & (mx.cumsum(tied.astype(mx.int32), axis=-1) <= room))


def _top_p_cut(probs: mx.array, top_p: float | mx.array, size: int, shortcut: bool) -> tuple[mx.array, mx.array | None]:
    """([..., 1] the smallest probability top-p keeps, covered): top-p keeps
    `probs >= cut`.

    A token is kept iff the mass of the tokens with strictly greater probability
    is < top_p times the total. On the descending sort, that mass is the
    exclusive cumsum at the first of the token's ties; it only grows, so the
    kept ranks are a prefix, every tie of its last value included. The sorted
    values, hence the float32 cumsum, do not depend on how ties are ordered.

    Only `size` tokens can be kept (the top-k set; the rest are 0 here and
    masked by the caller). With `shortcut`, the cut is sought among the top
    TOP_P_CANDIDATES only. That is final when they hold the whole set (the full
    sort would only add zeros, whose cut keeps no more of it: covered is None);
    otherwise covered says whether every row's cut lies among them (its last
    candidate is cut). The candidates' cumsum is a prefix of the full one (MLX's
    CPU scan adds in order), so where covered, both give the same mask.
    """
    threshold = top_p * probs.sum(axis=-1, keepdims=True)

    def cut(values: mx.array) -> tuple[mx.array, mx.array]:  # values: the top of probs, any order
        descending = mx.sort(values, axis=-1)[..., ::-1]
        before = mx.cumsum(descending, axis=-1, inclusive=False)
        return mx.where(before < threshold, descending, mx.inf).min(axis=-1, keepdims=True), before

    if not shortcut:
        return cut(probs)[0], None
    value, before = cut(top_values(probs, min(size, TOP_P_CANDIDATES)))
    if size <= TOP_P_CANDIDATES:
        return value, None
    return value, mx.all(before[..., -1:] >= threshold)
