"""Exactness through the real engine loop (REFERENCE §2, engine level).

The exact joint of the first three generated tokens is enumerated from the
trunk's own (filtered) distributions; seeded MTP generations at depth 2 then
produce tokens 2-3 through draft, verify, accept/resample and rollback, and a
chi-square test compares their histogram with that joint. A generation that
swaps in a broken acceptance rule must fail the same test.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from scipy.stats import chi2

import engine.generation
from engine.generation import GenerationRequest
from engine.sampling import SamplerSettings, probabilities
from engine.speculative import sample
from tests.engine_helpers import load_family
from tests.floats import FEW_OPS_ULPS, assert_close

PROMPT = (8, 9, 10, 11, 9)
MIN_EXPECTED = 5.0


def exact_joint(backend, sampler: SamplerSettings) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3 | prompt) from batched trunk forwards, with the sampler's filtering."""
    def next_probs(prefixes: list[tuple[int, ...]]) -> np.ndarray:
        logits, _ = backend.forward(mx.array([PROMPT + p for p in prefixes]), backend.make_cache())
        return np.array(probabilities(logits[:, -1].astype(mx.float32), sampler), dtype=np.float64)

    joint = {(): 1.0}
    for _ in range(3):
        prefixes = list(joint)
        probs = next_probs(prefixes)
        joint = {
            prefix + (int(t),): joint[prefix] * probs[i, t]
            for i, prefix in enumerate(prefixes)
            for t in np.flatnonzero(probs[i] > 1e-12)
        }
    return joint


def sampled_counts(engine_, sampler: SamplerSettings, n: int, depth: int = 2) -> dict:
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(n):
        gen = engine_.open(GenerationRequest(prompt=PROMPT, sampler=sampler, depth=depth, max_tokens=3, seed=seed))
        while not gen.finished:
            gen.step()
        key = tuple(gen.tokens[len(PROMPT):])
        counts[key] = counts.get(key, 0) + 1
    return counts


def chi_square_pvalue(joint: dict, counts: dict, n: int) -> float:
    """Pearson chi-square; bins expected under MIN_EXPECTED are pooled into one."""
    assert set(counts) <= set(joint), "sampled a sequence of probability zero"
    big = [s for s, p in joint.items() if p * n >= MIN_EXPECTED]
    expected = [joint[s] * n for s in big]
    observed = [counts.get(s, 0) for s in big]
    rest = n - sum(expected)
    if rest > 1e-9:
        expected.append(rest)
        observed.append(n - sum(observed))
    expected, observed = np.array(expected), np.array(observed)
    stat = float(((observed - expected) ** 2 / expected).sum())
    return float(chi2.sf(stat, len(expected) - 1))


SAMPLERS = {
    "t1.0": SamplerSettings(temperature=1.0),
    "t0.6-top_p0.9": SamplerSettings(temperature=0.6, top_p=0.9),
}


# attention-only (the embedded model), GLM-5: sparse attention whose indexer keys roll
# back with the KV (the prompt and its three tokens outgrow the fixture's index_topk), and
# Nemotron-H: a hybrid whose Mamba2 conv window and SSM state roll back by replay
FAMILIES = ["mimo", "glm_moe_dsa", "nemotron_h"]


def _exactness(tmp_path, sampler_name: str, n: int, family: str = "mimo") -> float:
    engine_ = load_family(tmp_path, family, mtp_heads=1, n_chars=9)  # V = 16
    sampler = SAMPLERS[sampler_name]
    joint = exact_joint(engine_.backend, sampler)
    # float32 rows of probabilities, each summing to 1 within a few roundings, multiplied
    assert_close(sum(joint.values()), 1.0, FEW_OPS_ULPS, "total probability")
    p_value = chi_square_pvalue(joint, sampled_counts(engine_, sampler, n), n)
    print(f"engine chi-square {family} {sampler_name} n={n}: p={p_value:.4g}")
    return p_value


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("sampler_name", list(SAMPLERS))
def test_engine_output_distribution_is_exact(tmp_path, sampler_name, family):
    assert _exactness(tmp_path, sampler_name, n=800, family=family) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("sampler_name", list(SAMPLERS))
def test_engine_output_distribution_is_exact_large(tmp_path, sampler_name):
    assert _exactness(tmp_path, sampler_name, n=20000) > 1e-3


def broken_verify(p, q, drafts, key):
    """Negative control: on rejection resample from p instead of the residual."""
    k_u, k_s = mx.random.split(key)
    K = drafts.shape[1]
    idx = mx.arange(K)
    p_d = p[:, :K][0, idx, drafts[0]]
    q_d = q[0, idx, drafts[0]]
    u = mx.random.uniform(shape=(K,), key=k_u)
    ok = (u * q_d < p_d).astype(mx.int32)
    m = int(mx.cumprod(ok).sum().item())
    # The bug: p[0, m] where a rejection needs residual(p[0, m], q[0, m]).
    return mx.array([m]), sample(p[0, m], k_s)[None]


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_negative_control_fails(tmp_path, monkeypatch, family):
    monkeypatch.setattr(engine.generation, "compiled_verify", broken_verify)
    assert _exactness(tmp_path, "t1.0", n=800, family=family) < 1e-6
