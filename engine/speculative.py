"""The one exact speculative sampler (Leviathan et al. / Chen et al.), used by every backend.

Inputs are *filtered* probabilities from `engine.sampling.probabilities`,
applied identically to target (p) and draft (q) logits: the output is then
distributed exactly as plain sampling from the filtered target. All of it is
mx ops in float32 (ratios of bfloat16 probabilities underflow), batched over a
leading batch dim, with no host sync, so a backend can fuse it into its step.

Temperature 0 needs no special case: p and q are one-hot, a draft is accepted
iff it is the target's argmax (u * 1 < 1 always, u * 1 < 0 never), the residual
of a rejected one-hot draft is the target's one-hot, and the bonus is the
argmax: exactly greedy decoding.
"""

from __future__ import annotations

# Being inside the engine package, engine/__init__ (the BLAS fix) has already run.
import mlx.core as mx


def sample(probs: mx.array, key: mx.array) -> mx.array:
    """Categorical sample from probabilities [..., V] -> int32 [...], by inverting
    the CDF with one uniform per row.

    (Gumbel-max needs V random numbers and two logarithms a row: ~250 us for a
    4096-token row on a CPU, against ~60 us for a cumulative sum and a count.)
    Token i is drawn iff cdf[i-1] <= u * cdf[V-1] < cdf[i], so a zero-probability
    token, whose cdf step is exactly 0, is never drawn; should rounding put u at
    the very top, the last token with mass is taken. Each token's interval is
    exact up to float32 rounding of the running sum.
    """
    return inverse_cdf(probs, mx.random.uniform(shape=(*probs.shape[:-1], 1), key=key))


def inverse_cdf(probs: mx.array, u: mx.array) -> mx.array:
    """`sample` with its uniforms u [..., 1] in [0, 1) given (a batch of rows draws
    each row's from its own key: engine/batch.py)."""
    probs = probs.astype(mx.float32)
    cdf = mx.cumsum(probs, axis=-1)
    drawn = (cdf <= u * cdf[..., -1:]).sum(axis=-1)
    last_with_mass = (mx.arange(probs.shape[-1]) * (probs > 0)).max(axis=-1)
    return mx.minimum(drawn, last_with_mass).astype(mx.int32)


def accept_probability(p_draft: mx.array, q_draft: mx.array) -> mx.array:
    """min(1, p/q) elementwise: the chance of keeping a draft drawn from q.

    q > 0 wherever a draft was actually drawn; where q == 0 we return 1 (the
    limit for p > 0) only so the function is total and NaN-free.
    """
    p = p_draft.astype(mx.float32)
    q = q_draft.astype(mx.float32)
    ratio = p / mx.where(q > 0, q, 1.0)
    return mx.where(q > 0, mx.minimum(ratio, 1.0), 1.0)


def residual(p: mx.array, q: mx.array) -> mx.array:
    """norm(max(p - q, 0)) over the last axis: what to sample after a rejection.

    The residual mass equals the rejection probability, so a row with zero
    mass (p == q) is rejected with probability 0; we return p there to keep the
    result a valid distribution instead of 0/0.
    """
    p = p.astype(mx.float32)
    excess = mx.maximum(p - q.astype(mx.float32), 0.0)
    mass = excess.sum(axis=-1, keepdims=True)
    return mx.where(mass > 0, excess / mx.where(mass > 0, mass, 1.0), p)


def verify(
    p: mx.array, q: mx.array, drafts: mx.array, key: mx.array
) -> tuple[mx.array, mx.array]:
    """Accept a prefix of the drafts and pick the token that follows it.

    p: [B, K+1, V] target probabilities at the K+1 verify positions (row i is
       the target's distribution for the token at draft position i; row K is
       the bonus position after all drafts).
    q: [B, K, V] draft probabilities the drafts were sampled from.
    drafts: [B, K] int tokens, drafts[:, i] ~ q[:, i].
    Returns (n_accepted [B] int32 in 0..K, next_token [B] int32).

    Draft i is accepted iff u_i * q_i(d_i) < p_i(d_i), u_i ~ U[0, 1): the strict
    `<` means a token with p = 0 is never accepted, even at u = 0. The first
    rejection at i ends the cycle with next_token ~ residual(p_i, q_i); if all
    K are accepted, next_token ~ p_K. K = 0 is plain sampling from p_0.
    """
    key_u, key_next = mx.random.split(key)
    n_accepted = _accepted_prefix(p, q, drafts, key_u)
    final = _final_distribution(p, q, n_accepted)
    return n_accepted, sample(final, key_next)


def _accepted_prefix(p: mx.array, q: mx.array, drafts: mx.array, key: mx.array) -> mx.array:
    """Length [B] of the accepted prefix of the drafts."""
    batch, depth = drafts.shape
    index = drafts.astype(mx.uint32)[..., None]
    p_draft = mx.take_along_axis(p[:, :depth].astype(mx.float32), index, axis=-1)[..., 0]
    q_draft = mx.take_along_axis(q.astype(mx.float32), index, axis=-1)[..., 0]
    u = mx.random.uniform(shape=(batch, depth), key=key)
    accepted = (u * q_draft < p_draft).astype(mx.int32)
    # cumprod zeroes everything after the first rejection.
    return mx.cumprod(accepted, axis=1).sum(axis=1).astype(mx.int32)


def _final_distribution(p: mx.array, q: mx.array, n_accepted: mx.array) -> mx.array:
    """[B, V]: residual at the first rejected position, or p_K if none was rejected.

    Residuals are computed for every position (K * V work, cheap) so the choice
    is a gather on device rather than host-side branching.
    """
    p = p.astype(mx.float32)
    depth = q.shape[1]
    candidates = mx.concatenate([residual(p[:, :depth], q), p[:, depth:]], axis=1)
    index = n_accepted.astype(mx.uint32)[:, None, None]
    return mx.take_along_axis(candidates, index, axis=1)[:, 0]


def verify_greedy(logits: mx.array, drafts: mx.array) -> tuple[mx.array, mx.array]:
    """`verify` at temperature 0, from the target logits [B, K+1, V] alone.

    With one-hot p and q, draft i is accepted iff it is the target's argmax
    (u * 1 < 1 always, u * 1 < 0 never) and the residual after a rejection is
    p's one-hot, so the next token is the argmax at the first rejected row, or
    at row K when all are accepted. Same result, without K+1 distributions.
    """
    best = mx.argmax(logits.astype(mx.float32), axis=-1).astype(mx.int32)  # [B, K+1]
    depth = drafts.shape[1]
    matches = (drafts.astype(mx.int32) == best[:, :depth]).astype(mx.int32)
    n_accepted = mx.cumprod(matches, axis=1).sum(axis=1).astype(mx.int32)
    return n_accepted, mx.take_along_axis(best, n_accepted[:, None], axis=1)[:, 0]


# The same functions traced once per input shape (one per depth) and fused: identical
# math, so the same exactness, at half the cost of a cycle's verification on the CPU
# (231 against 460 us for depth 1) and ~70-110 us less a draw (filter and draw of a
# 4096-token row: 205-249 against 316-320 us); tests/test_profiles.py checks that both
# give the same tokens for the same keys.
compiled_verify = mx.compile(verify)
compiled_sample = mx.compile(sample)
compiled_inverse_cdf = mx.compile(inverse_cdf)
