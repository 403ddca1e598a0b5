"""Exactness of the speculative sampler (REFERENCE §2) and of the sampler filters.

What proves exactness here:
- analytic: one accept/reject step, computed from the module's own pieces,
  has marginal p to rounding;
- statistical: whole 3-token sequences produced by speculative cycles through
  `engine.speculative.verify` match the analytic joint of toy autoregressive
  tables by chi-square, and four known-wrong rules fail the same test.
Run with `pytest -s` to see the p-values.
"""

import engine  # noqa: F401  (fast BLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest
from scipy.stats import chi2

from engine import sampling, speculative
from tests.floats import DOT_ULPS, EPS32, FEW_OPS_ULPS, assert_close
from engine.sampling import (
    TOP_P_CANDIDATES,
    SamplerSettings,
    compiled_probabilities,
    probabilities,
    provisional_probabilities,
)

V = 4  # toy vocabulary
LENGTH = 3  # toy sequence length: V**LENGTH = 64 sequences
CHAINS = 50_000
SLOW_CHAINS = 200_000
PASS_P = 1e-3
FAIL_P = 1e-6

PLAIN = SamplerSettings()
FILTERED = SamplerSettings(temperature=0.6, top_p=0.9)


# --------------------------------------------------------------------------- helpers


def _np(x: mx.array) -> np.ndarray:
    return np.array(x)


def _row(p: mx.array, n: mx.array) -> mx.array:
    """p[b, n[b]] for p [B, K+1, V] -> [B, V]."""
    return mx.take_along_axis(p, n.astype(mx.uint32)[:, None, None], axis=1)[:, 0]


def _prefix_length(accepted: mx.array) -> mx.array:
    return mx.cumprod(accepted.astype(mx.int32), axis=1).sum(axis=1).astype(mx.int32)


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, float, int]:
    """(p-value, statistic, dof) of counts against probs; dof = (bins with probs > 0) - 1.

    A count in a zero-probability bin is impossible under the reference: statistic inf, p 0.
    """
    expected = probs.ravel() * counts.sum()
    counts = counts.ravel()
    support = expected > 0
    dof = int(support.sum()) - 1
    # Below ~5 expected per bin the chi-square approximation is unreliable.
    assert expected[support].min() >= 5, "test sizes too small for a chi-square test"
    if counts[~support].any():
        return 0.0, float("inf"), dof
    stat = float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())
    return float(chi2.sf(stat, dof)), stat, dof


def report(label: str, result: tuple[float, float, int]) -> float:
    pval, stat, dof = result
    print(f"\n{label}: chi-square p = {pval:.3g} (statistic {stat:.1f}, {dof} dof)")
    return pval


# ------------------------------------------------------------- toy autoregressive model
#
# A table t[pos, prev, x] = prob(token x at position pos | previous token prev);
# position 0 conditions on a BOS token, encoded as prev = 0. Tables have more
# positions than LENGTH because a cycle may draft past the end (those tokens
# are discarded, which leaves the marginal of the first LENGTH tokens exact).


def toy_logits(seed: int, depth: int) -> np.ndarray:
    # Scale 0.5 keeps every one of the 64 sequences at >= ~20 expected counts
    # with 50 000 chains (valid chi-square), while p and q still differ enough
    # that each negative control fails by a wide margin.
    rng = np.random.default_rng(seed)
    return 0.5 * rng.normal(size=(LENGTH + depth + 1, V, V)).astype(np.float32)


def table(logits: np.ndarray, settings: SamplerSettings) -> mx.array:
    return probabilities(mx.array(logits), settings)


def joint(p_table: mx.array) -> np.ndarray:
    """Analytic [V, V, V] joint of the first three tokens, in float64."""
    t = _np(p_table).astype(np.float64)
    return t[0, 0][:, None, None] * t[1][:, :, None] * t[2][None, :, :]


def run_chains(p_table, q_table, depth, chains, seed, verify=speculative.verify, shift_p=False):
    """Sequences [chains, LENGTH] from speculative cycles, vectorised over chains.

    Each cycle drafts `depth` tokens from q, builds the K+1 target rows from p
    along the drafted path, and commits n_accepted drafts plus next_token.
    `verify` and `shift_p` let the negative controls swap in broken rules.
    """
    tokens = np.zeros((chains, LENGTH + depth + 1), np.int32)
    length = np.zeros(chains, np.int64)
    everyone = np.arange(chains)
    key = mx.random.key(seed)
    while (length < LENGTH).any():
        key, draft_key, verify_key = mx.random.split(key, 3)
        start = np.minimum(length, LENGTH - 1)  # finished chains idle at a valid position
        prev = np.where(start > 0, tokens[everyone, start - 1], 0)
        p, q, drafts = _draft(p_table, q_table, mx.array(start), mx.array(prev), depth, draft_key)
        if shift_p:  # control (c): verify draft i against the row of position i + 1
            p = mx.concatenate([p[:, 1:], p[:, depth:]], axis=1)
        n_acc, next_token = verify(p, q, drafts, verify_key)
        _commit(tokens, length, start, _np(drafts), _np(n_acc), _np(next_token))
    return tokens[:, :LENGTH]


def _draft(p_table, q_table, start, prev, depth, key):
    """Draft from q along one path; p rows along the same path (K+1 of them)."""
    p_rows, q_rows, drafts = [], [], []
    keys = mx.random.split(key, max(depth, 1))
    for i in range(depth):
        p_rows.append(p_table[start + i, prev])
        q_rows.append(q_table[start + i, prev])
        prev = speculative.sample(q_rows[-1], keys[i])
        drafts.append(prev)
    p_rows.append(p_table[start + depth, prev])
    chains = start.shape[0]
    q = mx.stack(q_rows, axis=1) if depth else mx.zeros((chains, 0, V))
    d = mx.stack(drafts, axis=1) if depth else mx.zeros((chains, 0), dtype=mx.int32)
    return mx.stack(p_rows, axis=1), q, d


def _commit(tokens, length, start, drafts, n_acc, next_token):
    """Write accepted drafts + next_token for chains still short of LENGTH."""
    active = length < LENGTH
    block = np.concatenate([drafts, np.zeros((len(drafts), 1), np.int32)], axis=1)
    block[np.arange(len(block)), n_acc] = next_token
    for i in range(block.shape[1]):
        write = active & (i <= n_acc)
        tokens[write, start[write] + i] = block[write, i]
    length[active] = start[active] + n_acc[active] + 1


def sequence_chi_square(seqs: np.ndarray, reference: np.ndarray) -> tuple[float, float, int]:
    index = seqs @ np.array([V * V, V, 1])
    return chi_square(np.bincount(index, minlength=V**LENGTH), reference)


def speculative_chi_square(settings, depth, chains, seed, *, p_settings=None, **broken):
    """Chi-square of speculative sequences against the joint of the filtered target.

    `settings` filter q and the reference; `p_settings` (control d) filter the p
    that verify sees differently.
    """
    p_logits, q_logits = toy_logits(100 + depth, depth), toy_logits(200 + depth, depth)
    p_table = table(p_logits, p_settings or settings)
    q_table = table(q_logits, settings)
    seqs = run_chains(p_table, q_table, depth, chains, seed, **broken)
    return sequence_chi_square(seqs, joint(table(p_logits, settings)))


# -------------------------------------------------- broken rules for negative controls


def verify_resample_from_p(p, q, drafts, key):
    """(a) Right acceptance, but a rejection resamples from p instead of the residual."""
    n_acc, _ = speculative.verify(p, q, drafts, key)
    return n_acc, speculative.sample(_row(p, n_acc), mx.random.split(key, 3)[2])


def verify_argmax_accept(p, q, drafts, key):
    """(b) Accept iff the draft is p's argmax (right only at temperature 0); resample from p."""
    depth = drafts.shape[1]
    n_acc = _prefix_length(drafts == mx.argmax(p[:, :depth], axis=-1))
    return n_acc, speculative.sample(_row(p, n_acc), key)


# ------------------------------------------------------------------- analytic tests


def random_pairs(seed: int, n: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Float32 (p, q) rows: dense, sparse (random zeros), p == q and one-hot cases."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(vocab, 0.7), size=n)
    q = rng.dirichlet(np.full(vocab, 0.7), size=n)
    # Sparse rows: zero out random entries (keep at least one per row).
    for x in (p, q):
        mask = rng.random(x.shape) < 0.4
        mask[np.arange(n), rng.integers(vocab, size=n)] = False
        x[: n // 2][mask[: n // 2]] = 0.0
    q[n // 2 : n // 2 + n // 8] = p[n // 2 : n // 2 + n // 8]  # p == q
    hot = np.eye(vocab)[rng.integers(vocab, size=(2, n // 8))]
    p[-n // 8 :], q[-n // 8 :] = hot[0], hot[1]  # one-hot pairs (greedy)
    p, q = (x / x.sum(axis=1, keepdims=True) for x in (p, q))
    return p.astype(np.float32), q.astype(np.float32)


def test_one_step_marginal_is_p_analytically():
    p, q = random_pairs(seed=0, n=4000, vocab=6)
    pm, qm = mx.array(p), mx.array(q)
    kept = qm * speculative.accept_probability(pm, qm)  # P(draft d, accepted)
    rejected = 1.0 - kept.sum(axis=-1, keepdims=True)
    marginal = kept + rejected * speculative.residual(pm, qm)
    assert_close(marginal, p, FEW_OPS_ULPS, "marginal")


def test_residual_and_accept_probability_edge_cases():
    p = mx.array([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = mx.array([[0.5, 0.5, 0.0], [0.0, 0.6, 0.4]])
    res = _np(speculative.residual(p, q))
    np.testing.assert_array_equal(res[0], [0.5, 0.5, 0.0])  # p == q: returns p itself
    assert_close(res[1], [2 / 3, 0.0, 1 / 3], FEW_OPS_ULPS, "residual")
    acc = _np(speculative.accept_probability(p, q))
    assert not np.isnan(acc).any()
    assert_close(acc[1, 1:], [0.5, 1.0], FEW_OPS_ULPS, "acceptance")


def test_sample_never_draws_zero_probability():
    probs = np.array([0.0, 0.7, 0.0, 0.3, 0.0], np.float32)
    batched = mx.broadcast_to(mx.array(probs), (4, 25_000, 5))
    drawn = _np(speculative.sample(batched, mx.random.key(1)))
    assert drawn.shape == (4, 25_000) and drawn.dtype == np.int32
    counts = np.bincount(drawn.ravel(), minlength=5)
    assert report("sample()", chi_square(counts, probs)) > PASS_P


# -------------------------------------------------------------- one-step Monte Carlo


def test_one_step_verify_matches_p():
    """K = 1: the first committed token (accepted draft or next_token) ~ p_0."""
    batch = 200_000
    p0 = np.array([0.35, 0.0, 0.25, 0.3, 0.1, 0.0], np.float32)
    q0 = np.array([0.1, 0.2, 0.0, 0.5, 0.1, 0.1], np.float32)
    p1 = np.full(6, 1 / 6, np.float32)
    p = mx.broadcast_to(mx.array(np.stack([p0, p1])), (batch, 2, 6))
    q = mx.broadcast_to(mx.array(q0), (batch, 1, 6))
    drafts = speculative.sample(q, mx.random.key(2))
    n_acc, next_token = speculative.verify(p, q, drafts, mx.random.key(3))
    first = _np(mx.where(n_acc == 1, drafts[:, 0], next_token))
    assert report("one-step verify, K=1", chi_square(np.bincount(first, minlength=6), p0)) > PASS_P


def test_verify_with_no_drafts_samples_p():
    batch = 100_000
    p0 = np.array([0.1, 0.6, 0.0, 0.3], np.float32)
    p = mx.broadcast_to(mx.array(p0), (batch, 1, 4))
    n_acc, next_token = speculative.verify(
        p, mx.zeros((batch, 0, 4)), mx.zeros((batch, 0), dtype=mx.int32), mx.random.key(4)
    )
    assert n_acc.dtype == mx.int32 and next_token.dtype == mx.int32
    assert not _np(n_acc).any()
    counts = np.bincount(_np(next_token), minlength=4)
    assert report("verify K=0", chi_square(counts, p0)) > PASS_P


# ----------------------------------------------------------- whole-sequence exactness

CASES = [pytest.param(PLAIN, 2, id="T1-K2"), pytest.param(FILTERED, 3, id="T0.6-topp0.9-K3")]


@pytest.mark.parametrize("settings,depth", CASES)
def test_sequences_match_joint(settings, depth):
    result = speculative_chi_square(settings, depth, CHAINS, seed=7)
    assert report(f"sequences {settings} K={depth} n={CHAINS}", result) > PASS_P


@pytest.mark.slow
@pytest.mark.parametrize("settings,depth", CASES)
def test_sequences_match_joint_large(settings, depth):
    result = speculative_chi_square(settings, depth, SLOW_CHAINS, seed=8)
    assert report(f"sequences {settings} K={depth} n={SLOW_CHAINS}", result) > PASS_P


CONTROLS = {
    "a-resample-from-p": dict(settings=PLAIN, verify=verify_resample_from_p),
    "b-argmax-accept": dict(settings=PLAIN, verify=verify_argmax_accept),
    "c-wrong-position": dict(settings=PLAIN, shift_p=True),
    "d-filter-q-only": dict(settings=FILTERED, p_settings=PLAIN),
}


@pytest.mark.parametrize("name", CONTROLS)
def test_negative_controls_fail(name):
    """Each known-wrong rule must be caught by the same chi-square test."""
    result = speculative_chi_square(depth=2, chains=CHAINS, seed=9, **CONTROLS[name])
    assert report(f"negative control {name} n={CHAINS}", result) < FAIL_P


def test_no_host_sync_inside():
    """mx.compile refuses to evaluate arrays while tracing, so compiling proves no host sync."""
    keys = mx.random.split(mx.random.key(11), 3)
    p = mx.softmax(mx.random.normal((8, 3, 5), key=keys[0]), axis=-1)
    q = mx.softmax(mx.random.normal((8, 2, 5), key=keys[1]), axis=-1)
    drafts = speculative.sample(q, keys[2])
    compiled = mx.compile(speculative.verify)(p, q, drafts, mx.random.key(12))
    eager = speculative.verify(p, q, drafts, mx.random.key(12))
    for a, b in zip(compiled, eager):
        np.testing.assert_array_equal(_np(a), _np(b))
    settings = SamplerSettings(temperature=0.7, top_k=3, top_p=0.9, min_p=0.05)
    filtered = mx.compile(lambda x: probabilities(x, settings))(p)
    assert_close(filtered, probabilities(p, settings), FEW_OPS_ULPS, "compiled filters")


# ------------------------------------------------------------------------- greedy


def test_greedy_verify_is_argmax_decoding():
    """One-hot p/q (temperature 0): accept exactly drafts equal to argmax p, then argmax."""
    rng = np.random.default_rng(5)
    batch, depth, vocab = 2048, 3, 8
    greedy = SamplerSettings(temperature=0)
    target = rng.normal(size=(batch, depth + 1, vocab)).astype(np.float32)
    draft = rng.normal(size=(batch, depth, vocab)).astype(np.float32)
    agree = rng.random((batch, depth)) < 0.7  # draft head agrees with the target here
    draft[agree] = target[:, :depth][agree]
    p = probabilities(mx.array(target), greedy)
    q = probabilities(mx.array(draft), greedy)
    drafts = speculative.sample(q, mx.random.key(6))
    np.testing.assert_array_equal(_np(drafts), draft.argmax(-1))

    expect_n = np.cumprod(draft.argmax(-1) == target[:, :depth].argmax(-1), axis=1).sum(1)
    expect_next = target.argmax(-1)[np.arange(batch), expect_n]
    for seed in range(5):  # the result must not depend on the key
        n_acc, next_token = speculative.verify(p, q, drafts, mx.random.key(seed))
        np.testing.assert_array_equal(_np(n_acc), expect_n)
        np.testing.assert_array_equal(_np(next_token), expect_next)
    assert set(expect_n) == set(range(depth + 1))  # every acceptance length occurs


# ------------------------------------------------------------------- sampler filters

TOY = np.array([0.5, 0.3, 0.15, 0.05])
HOT = np.sqrt(TOY) / np.sqrt(TOY).sum()  # temperature 2


@pytest.mark.parametrize(
    "settings,expected",
    [
        (SamplerSettings(), TOY),
        (SamplerSettings(top_k=2), [0.625, 0.375, 0, 0]),
        (SamplerSettings(top_k=4), TOY),
        (SamplerSettings(top_p=0.75), [0.625, 0.375, 0, 0]),  # 0.5 < 0.75 <= 0.8
        (SamplerSettings(top_p=0.85), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
        (SamplerSettings(top_p=0.01), [1, 0, 0, 0]),  # the top token is always kept
        (SamplerSettings(min_p=0.2), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),  # < 0.1 dropped
        (SamplerSettings(min_p=0.5), [0.625, 0.375, 0, 0]),  # < 0.25 dropped
        (SamplerSettings(top_k=3, top_p=0.6), [0.625, 0.375, 0, 0]),  # top-p on top-3 mass
        (SamplerSettings(temperature=0, top_p=0.5), [1, 0, 0, 0]),
        (SamplerSettings(temperature=2.0), HOT),
    ],
)
def test_probabilities_filters(settings, expected):
    # Shuffled vocabulary order and a batch of 2x3 rows: the filters must not
    # depend on position in the vocabulary or on leading dims.
    perm = np.array([2, 0, 3, 1])
    logits = mx.array(np.broadcast_to(np.log(TOY[perm]), (2, 3, 4)).astype(np.float32))
    out = probabilities(logits, settings)
    assert out.dtype == mx.float32 and out.shape == (2, 3, 4)
    want = np.broadcast_to(np.asarray(expected, np.float64)[perm], (2, 3, 4))
    assert_close(out, want, FEW_OPS_ULPS, "filtered")
    # Any float dtype is accepted and the result is float32.
    assert probabilities(logits.astype(mx.bfloat16), settings).dtype == mx.float32


def test_probabilities_greedy_is_one_hot_argmax():
    logits = mx.array(np.random.default_rng(0).normal(size=(5, 7)).astype(np.float32))
    out = _np(probabilities(logits, SamplerSettings(temperature=0)))
    np.testing.assert_array_equal(out, np.eye(7)[_np(logits).argmax(-1)])


# Top-p looks for its cut among the top TOP_P_CANDIDATES and, where they may not
# hold it, says so (`covered`): `probabilities` then checks with one host sync and
# falls back to a full sort, `provisional_probabilities` leaves the check to its
# caller. All must agree
# with one tie-inclusive definition: keep a token iff the mass of the strictly more
# probable tokens (within the top-k set) is < top_p times that set's mass.


def reference_keep(probs: np.ndarray, s: SamplerSettings) -> np.ndarray:
    """The filters' definition, token by token in float64, on probs [rows, V]."""
    keep = np.ones(probs.shape, bool)
    for row, p in zip(keep, probs):
        if 0 < s.top_k < p.size:
            row[np.argsort(-p, kind="stable")[s.top_k :]] = False  # exactly k, lowest ids on ties
        if s.top_p < 1:
            q = np.where(row, p, 0.0)
            row &= np.array([q[q > v].sum() for v in q]) < s.top_p * q.sum()
        if s.min_p > 0:
            row &= p >= s.min_p * p.max()
    return keep


def filter_case(name: str) -> np.ndarray:
    """Logits [rows, V] with V > TOP_P_CANDIDATES, so the shortcut is possible."""
    rng = np.random.default_rng(sum(map(ord, name)))
    V = 4 * TOP_P_CANDIDATES
    peaked = rng.normal(size=(3, V)) * 4  # nucleus of a few tokens at T 0.6
    flat = rng.normal(size=(2, V)) * 0.1  # nucleus of most of the vocabulary
    if name == "peaked":
        return peaked
    if name == "flat":
        return flat
    if name == "mixed":
        return np.concatenate([peaked[:1], flat[:1], peaked[1:]])
    # Ties: 0.4, then three tokens of 0.2 straddling top_p 0.5 (and top_k 2), then a tail.
    ties = np.full((2, V), np.log(1e-6))
    ties[:, :4] = np.log([0.4, 0.2, 0.2, 0.2])
    ties[1] = ties[1, rng.permutation(V)]
    if name == "ties":
        return ties
    # A tie group at the cut, running past the candidates: all kept.
    group = TOP_P_CANDIDATES + 100
    wide = np.concatenate([[np.log(50.0)], np.zeros(group), np.full(V - group - 1, -20.0)])
    return np.stack([wide, wide[rng.permutation(V)]])


def test_softmax_is_as_accurate_as_the_library_one():
    """sampling.softmax uses power(e, x) for exp: its error against float64 stays
    that of mx.softmax (the float32 input's own rounding), and -inf gives 0."""
    rng = np.random.default_rng(5)
    logits = (rng.normal(size=(4, 4096)) * 6).astype(np.float32)
    logits[0, :10] = -np.inf
    exact = np.exp(logits.astype(np.float64) - logits.max(-1, keepdims=True))
    exact /= exact.sum(-1, keepdims=True)
    ours = _np(sampling.softmax(mx.array(logits)))
    library = _np(mx.softmax(mx.array(logits), axis=-1, precise=True))
    tiny = exact > 1e-30
    assert (ours[0, :10] == 0).all()
    # no worse than twice the library's own error (which is float32 rounding of the input)
    assert np.abs(ours - exact)[tiny].max() <= 2 * np.abs(library - exact)[tiny].max() + 1e-12
    assert_close(ours.sum(-1), np.ones(4), DOT_ULPS, "sum")  # a float32 sum of 4096 terms


FILTER_SETTINGS = [
    SamplerSettings(temperature=0.6, top_p=0.95),
    SamplerSettings(temperature=1.0, top_p=0.5),
    SamplerSettings(temperature=0.6, top_p=0.9, top_k=2),
    SamplerSettings(temperature=0.6, top_p=0.95, top_k=20),
    SamplerSettings(temperature=0.6, top_p=0.9, top_k=40),
    SamplerSettings(temperature=0.6, top_p=0.95, top_k=200),
    SamplerSettings(temperature=0.6, top_p=0.9, min_p=0.05),
    SamplerSettings(temperature=0.6, top_k=3),
]


@pytest.mark.parametrize("settings", FILTER_SETTINGS, ids=str)
@pytest.mark.parametrize("name", ["peaked", "flat", "mixed", "ties", "wide-ties"])
def test_top_p_shortcut_full_sort_and_definition_agree(name, settings, monkeypatch):
    logits = mx.array(filter_case(name).astype(np.float32))
    V = logits.shape[-1]
    full_sorts = []
    sort = mx.sort
    monkeypatch.setattr(mx, "sort", lambda a, **kw: full_sorts.append(a.shape[-1] == V) or sort(a, **kw))
    eager = probabilities(logits, settings)
    took_full_sort = any(full_sorts)
    provisional, covered = provisional_probabilities(logits, settings)
    compiled, compiled_covered = compiled_probabilities(settings)(logits)
    monkeypatch.undo()
    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", 1)  # never enough: always the full sort
    full_sort = probabilities(logits, settings)
    # Exactly the same floats, whichever path each ran; the provisional ones
    # claim to be covered exactly when no full sort was needed.
    assert covered is None or bool(covered.item()) != took_full_sort
    assert bool(compiled_covered.item()) != took_full_sort
    others = [full_sort] + ([] if took_full_sort else [provisional, compiled])
    for other in others:
        np.testing.assert_array_equal(_np(eager), _np(other))
    # Row by row, alone (peaked rows take the shortcut), equals the batch.
    for i in range(logits.shape[0]):
        np.testing.assert_array_equal(_np(probabilities(logits[i : i + 1], settings))[0], _np(eager)[i])

    probs = np.array(sampling.softmax(logits / settings.temperature), np.float64)
    keep = reference_keep(probs, settings)
    np.testing.assert_array_equal(_np(eager) > 0, keep)
    # float32 softmax and renormalisation over up to ~600 kept tokens against float64
    assert_close(eager, keep * probs / (keep * probs).sum(-1, keepdims=True), DOT_ULPS, "renormalised")
    if settings.top_p < 1:
        in_k = reference_keep(probs, SamplerSettings(top_k=settings.top_k))
        nucleus = reference_keep(probs, SamplerSettings(top_p=settings.top_p, top_k=settings.top_k))
        kept = (nucleus * probs).sum(-1) / (in_k * probs).sum(-1)  # the engine's mask before min-p
        # float64 sums of float32 probabilities: the cut may round by FEW_OPS_ULPS of the mass
        assert (kept >= settings.top_p * (1 - FEW_OPS_ULPS * EPS32)).all()
        # The full sort runs iff the candidates miss part of the top-k set and in
        # some row the last candidate is still kept.
        descending = -np.sort(-(in_k * probs), axis=-1)
        before_last = descending[:, : TOP_P_CANDIDATES - 1].sum(-1)
        some_row_long = (before_last < settings.top_p * descending.sum(-1)).any()
        assert took_full_sort == (in_k.sum(-1).max() > TOP_P_CANDIDATES and some_row_long)
    if name == "ties":
        kept = (_np(eager) > 0).sum(-1).tolist()
        if settings.top_k == 2:
            assert kept == [2, 2]  # exactly 2 of the tied 0.2s (the lowest ids)
        elif settings.top_p == 0.5:
            assert kept == [4, 4]  # 0.4 before each 0.2, below 0.5: all three kept


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-0.1),
        dict(temperature=float("nan")),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=-1),
        dict(top_k=2.5),
        dict(min_p=-0.1),
        dict(min_p=1.0),
    ],
)
def test_settings_validation(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplerSettings(**kwargs)
