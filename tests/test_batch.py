"""Rows decoding in one batch (engine/batch.py): each row's output is what it is alone.

Rows of different prompt lengths, samplers, seeds and budgets join a running batch
at different steps and leave when done. Greedy rows give their solo tokens (or part
after a near-tie, the float caveat of engine/batch.py); seeded sampled rows follow
their solo key sequence token for token; a row that leaves carries the caches a solo
run builds. The sampled distribution through a batch of busy neighbours passes the
engine's chi-square test, and a batch that hands a row its neighbour's logits fails it.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

import engine.batch
from engine.batch import DecodeBatch, batchable
from engine.generation import GenerationRequest
from engine.sampling import SamplerSettings
from tests.engine_helpers import (
    assert_caches_close, assert_greedy_agree, available_families, caches_excess, greedy, load_family, run,
)
from tests.floats import LONG_PATHS_ULPS
from tests.test_engine_exactness import PROMPT, SAMPLERS, chi_square_pvalue, exact_joint

# (prompt, sampler, seed, max_tokens, mode, the batch step at which it is opened)
ROWS = [
    ([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], greedy(), 0, 14, "mtp", 0),
    ([9, 4], SamplerSettings(temperature=0.8), 11, 10, "ar", 0),
    ([3, 3, 4, 4, 5, 5, 6], greedy(), 0, 6, "ar", 2),
    ([7, 1, 2, 8, 2, 1, 7, 1, 2, 8, 2, 1, 7, 1, 2, 8, 2, 1, 4, 5, 6], SamplerSettings(temperature=0.6, top_p=0.9),
     5, 9, "mtp", 3),
    ([12, 13], SamplerSettings(temperature=1.0, top_k=4), 7, 12, "ar", 5),
]


def _request(prompt, sampler, seed, max_tokens, mode) -> GenerationRequest:
    return GenerationRequest(prompt=tuple(prompt), sampler=sampler, seed=seed, max_tokens=max_tokens, mode=mode,
                             depth=1, compiled=True)


def _batched(engine_, rows=ROWS, corrupt=None) -> list:
    """Run `rows` through one batch; each is opened at its step, prefilled and given its
    first token alone, then joins; returns the generations once all are done."""
    batch = DecodeBatch(engine_.backend)
    gens: list = [None] * len(rows)
    step = 0
    while step == 0 or len(batch):
        for i, (prompt, sampler, seed, max_tokens, mode, at) in enumerate(rows):
            if at == step:
                gen = engine_.open(_request(prompt, sampler, seed, max_tokens, mode))
                while not gen.finished and not batchable(gen):
                    gen.step()
                gens[i] = gen
                if not gen.finished:
                    batch.join(gen)
                    if corrupt is not None:
                        corrupt(batch)
        for gen in list(batch.rows):
            if gen.finished:
                batch.leave(gen)
        batch.step()
        for gen in list(batch.rows):
            if gen.finished:
                batch.leave(gen)
        step += 1
    return gens


def _solo(engine_, prompt, sampler, seed, max_tokens, mode, at):
    """The same row alone: plain decoding after its first token, as in a batch."""
    gen = engine_.open(_request(prompt, sampler, seed, max_tokens, mode))
    while not gen.finished:
        if batchable(gen):
            gen.to_ar()
        gen.step()
    return gen


@pytest.mark.parametrize("family", available_families())
def test_rows_in_a_batch_decode_as_alone(tmp_path, family):
    engine_ = load_family(tmp_path, family)
    batched = _batched(engine_)
    for row, gen in zip(ROWS, batched):
        prompt, sampler = row[0], row[1]
        solo = _solo(engine_, *row)
        got, want = gen.tokens[len(prompt):], solo.tokens[len(prompt):]
        assert len(got) == len(want) == row[3] or gen.finish_reason == "stop"
        if sampler.greedy:
            assert_greedy_agree(engine_.backend, list(prompt), want, got)
        else:
            assert got == want, f"seeded row {prompt[:3]}...: {got} alone {want}"
        if got == want:  # the caches it leaves with are the solo run's
            assert_caches_close(gen.cache, solo.cache, LONG_PATHS_ULPS, f"{family} row {prompt[:3]}")


def test_a_batch_that_misplaces_rows_fails(tmp_path):
    """Negative control: a joining row read at the wrong rotary position (one past its
    own) leaves with caches outside the bound the test above holds."""
    engine_ = load_family(tmp_path, "mimo")

    def shift(batch):
        for c in batch._cache:
            c.offset = c.offset + mx.array([0] * (len(batch) - 1) + [1])

    row = ROWS[2]
    gen = _batched(engine_, [ROWS[0], row], corrupt=shift)[1]
    solo = _solo(engine_, *row)
    assert caches_excess(gen.cache, solo.cache, LONG_PATHS_ULPS) > 1.0


def _batched_counts(engine_, sampler, n: int, wave: int = 8) -> dict:
    """Seeded 3-token generations, 8 at a time in one batch beside two long-running
    greedy neighbours; the first token is drawn at prefill, the others in the batch."""
    batch = DecodeBatch(engine_.backend)
    for prompt in ([4, 5, 6, 7, 8, 9, 10, 11], [12, 3]):
        neighbour = engine_.open(_request(prompt, greedy(), 0, 10**6, "ar"))
        neighbour.step()
        batch.join(neighbour)
    counts: dict = {}
    for start in range(0, n, wave):
        rows = [engine_.open(GenerationRequest(prompt=PROMPT, sampler=sampler, depth=2, max_tokens=3, seed=seed))
                for seed in range(start, min(n, start + wave))]
        for gen in rows:
            gen.step()
            batch.join(gen)
        while any(not gen.finished for gen in rows):
            batch.step()
        for gen in rows:
            batch.leave(gen)
            key = tuple(gen.tokens[len(PROMPT):])
            counts[key] = counts.get(key, 0) + 1
    return counts


def _batched_exactness(tmp_path, n: int) -> float:
    engine_ = load_family(tmp_path, "mimo", mtp_heads=1, n_chars=9)  # V = 16
    sampler = SAMPLERS["t0.6-top_p0.9"]
    return chi_square_pvalue(exact_joint(engine_.backend, sampler), _batched_counts(engine_, sampler, n), n)


def test_batched_output_distribution_is_exact(tmp_path):
    assert _batched_exactness(tmp_path, n=800) > 1e-3


@pytest.mark.slow
def test_batched_output_distribution_is_exact_large(tmp_path):
    assert _batched_exactness(tmp_path, n=20000) > 1e-3


def test_batched_negative_control_fails(tmp_path, monkeypatch):
    """A batch that gives each row its neighbour's logits must fail the same test."""
    original = engine.batch.row_logits
    monkeypatch.setattr(engine.batch, "row_logits", lambda logits: original(mx.roll(logits, 1, axis=0)))
    try:
        p_value = _batched_exactness(tmp_path, n=800)
    except AssertionError:  # it even drew a sequence of probability zero
        p_value = 0.0
    assert p_value < 1e-6
