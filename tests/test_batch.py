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
from mlx_lm.models.cache import BatchKVCache, KVCache

import engine.batch
from engine.batch import DecodeBatch, batchable, depth_of
from engine.generation import GenerationRequest
from engine.sampling import SamplerSettings
from tests.engine_helpers import (
    assert_caches_close, assert_greedy_agree, available_families, caches_excess, greedy, load_family, run,
)
from tests.floats import LONG_PATHS_ULPS, assert_close
import engine.speculative
from engine.speculative import sample
from tests.test_engine_exactness import PROMPT, SAMPLERS, chi_square_pvalue, exact_joint

# (prompt, sampler, seed, max_tokens, mode, depth, the batch step at which it is opened):
# two MTP batches (depths 2 and 3; the checkpoints have 2 heads, so depth 3 reuses
# the last one) and one AR batch.
ROWS = [
    ([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], greedy(), 0, 14, "mtp", 2, 0),
    ([9, 4], SamplerSettings(temperature=0.8), 11, 10, "mtp", 2, 0),
    ([3, 3, 4, 4, 5, 5, 6], greedy(), 0, 6, "mtp", 2, 2),
    ([7, 1, 2, 8, 2, 1, 7, 1, 2, 8, 2, 1, 7, 1, 2, 8, 2, 1, 4, 5, 6], SamplerSettings(temperature=0.6, top_p=0.9),
     5, 9, "mtp", 2, 3),
    ([12, 13], SamplerSettings(temperature=1.0, top_k=4), 7, 12, "mtp", 2, 5),
    ([4, 4, 4, 9], greedy(), 0, 11, "mtp", 3, 0),
    ([8, 3, 8, 3, 8], SamplerSettings(temperature=0.7), 2, 13, "mtp", 3, 1),
    ([2, 7], SamplerSettings(temperature=0.9), 4, 8, "ar", 0, 0),
    ([6, 5, 4, 3, 2, 1], greedy(), 0, 10, "ar", 0, 1),
]


def _request(prompt, sampler, seed, max_tokens, mode, depth) -> GenerationRequest:
    return GenerationRequest(prompt=tuple(prompt), sampler=sampler, seed=seed, max_tokens=max_tokens, mode=mode,
                             depth=depth)


def _batched(engine_, rows=ROWS, corrupt=None) -> list:
    """Run `rows` through batches (one per depth, as the scheduler keeps them); each row
    is opened at its step, prefilled and given its first token alone, then joins;
    returns the generations once all are done."""
    batches: dict[int, DecodeBatch] = {}
    gens: list = [None] * len(rows)
    step = 0
    while step == 0 or any(len(b) for b in batches.values()):
        for i, (prompt, sampler, seed, max_tokens, mode, depth, at) in enumerate(rows):
            if at == step:
                gen = engine_.open(_request(prompt, sampler, seed, max_tokens, mode, depth), record=True)
                while not gen.finished and not batchable(gen):
                    gen.step()
                gens[i] = gen
                if not gen.finished:
                    batch = batches.setdefault(depth_of(gen), DecodeBatch(engine_.backend, depth_of(gen)))
                    batch.join(gen)
                    if corrupt is not None:
                        corrupt(batch)
        for batch in batches.values():
            batch.step()
            for gen in list(batch.rows):
                if gen.finished:
                    batch.leave(gen)
        step += 1
    return gens


def _solo(engine_, prompt, sampler, seed, max_tokens, mode, depth, at):
    """The same row alone."""
    gen = engine_.open(_request(prompt, sampler, seed, max_tokens, mode, depth), record=True)
    while not gen.finished:
        gen.step()
    return gen


@pytest.mark.parametrize("family", [*available_families(), "mimo:3"])
def test_rows_in_a_batch_decode_as_alone(tmp_path, family):
    """`family:n`: a checkpoint with n MTP heads (each head's own pending inputs)."""
    family, _, heads = family.partition(":")
    engine_ = load_family(tmp_path, family, **({"mtp_heads": int(heads)} if heads else {}))
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
        if got == want:  # the caches it leaves with are the solo run's, heads and their inputs included
            what = f"{family} row {prompt[:3]}"
            assert_caches_close(gen.cache, solo.cache, LONG_PATHS_ULPS, what)
            assert_caches_close(gen.head_caches, solo.head_caches, LONG_PATHS_ULPS, what + " heads")
            # what it offers the session bank: its hidden states and last logits too
            mine_snap, their_snap = gen.snapshot(), solo.snapshot()
            assert (mine_snap.tokens == their_snap.tokens).all()
            assert_close(mine_snap.hidden.data, their_snap.hidden.data, LONG_PATHS_ULPS, what + " hidden")
            assert_close(mine_snap.logits.data, their_snap.logits.data, LONG_PATHS_ULPS, what + " logits")
            for mine, theirs in zip(gen._heads, solo._heads):
                assert (mine.pending is None) == (theirs.pending is None), what
                if mine.pending is not None:
                    assert_close(mine.pending, theirs.pending, LONG_PATHS_ULPS, what + " pending")


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
    """Seeded 3-token MTP generations at depth 2, 8 at a time in one batch beside two
    long-running greedy neighbours; the first token is drawn at prefill, the others by
    the batch's draft-verify cycles."""
    batch = DecodeBatch(engine_.backend, depth=2)
    for prompt in ([4, 5, 6, 7, 8, 9, 10, 11], [12, 3]):
        neighbour = engine_.open(_request(prompt, greedy(), 0, 10**6, "mtp", 2))
        neighbour.step()
        batch.join(neighbour)
    counts: dict = {}
    for start in range(0, n, wave):
        rows = [engine_.open(GenerationRequest(prompt=PROMPT, sampler=sampler, depth=2, max_tokens=3, seed=seed))
                for seed in range(start, min(n, start + wave))]
        for gen in rows:
            gen.step()
            batch.join(gen)
        while any(gen in batch for gen in rows):
            batch.step()
            for gen in rows:
                if gen.finished and gen in batch:
                    batch.leave(gen)
        for gen in rows:
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


def _failed_exactness(tmp_path) -> float:
    try:
        return _batched_exactness(tmp_path, n=800)
    except AssertionError:  # it even drew a sequence of probability zero
        return 0.0


def test_batched_negative_control_rows_fails(tmp_path, monkeypatch):
    """A batch that verifies each row against its neighbour's logits must fail the same test."""
    original = engine.batch._verify_groups
    monkeypatch.setattr(engine.batch, "_verify_groups",
                        lambda groups, logits, *rest: original(groups, mx.roll(logits, 1, axis=0), *rest))
    assert _failed_exactness(tmp_path) < 1e-6


def test_batched_negative_control_rule_fails(tmp_path, monkeypatch):
    """A batch whose rows resample from p instead of the residual must fail it too."""
    def broken_row(p, q, drafts, key):
        key_u, key_next = mx.random.split(key)
        n = engine.speculative._accepted_prefix(p[None], q[None], drafts[None], key_u)
        # The bug: p at the first rejection where the rule takes residual(p, q) there.
        final = mx.take_along_axis(p[None], n.astype(mx.uint32)[:, None, None], axis=1)[:, 0]
        return n, sample(final, key_next)

    monkeypatch.setattr(engine.batch, "_verify_rows", mx.vmap(broken_row))
    assert _failed_exactness(tmp_path) < 1e-6


def test_rows_leaving_keep_one_offset_array_and_cut_the_padding(tmp_path):
    """A batch's blocks share one array of the rows' positions: a block whose offsets
    nothing reads (the rotary comes from a table, by the first block's) would otherwise
    grow a chain of lazy additions by one a step. When the row with the longest cache
    leaves, the padding the others all have is cut from every block's buffers."""
    engine_ = load_family(tmp_path, "mimo")
    batch = DecodeBatch(engine_.backend, 0)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [9, 4], [3, 3, 4, 4, 5]]
    for prompt in prompts:
        gen = engine_.open(_request(prompt, greedy(), 0, 12, "ar", 0))
        gen.step()
        batch.join(gen)
    for _ in range(3):
        batch.step()
    longest = batch.rows[0]
    batch.leave(longest)
    for _ in range(2):
        batch.step()
    first = batch._cache[0]
    assert all(cache.offset is first.offset for cache in batch._cache)
    assert first.offset.tolist() == [len(row.tokens) - 1 for row in batch.rows]
    assert min(first.left_padding.tolist()) == 0  # the longest row's padding columns went with it
    assert first.keys.shape[2] >= first._idx == len(prompts[2]) + 1 + 3 + 2 - 1


def _random_batch_cache(rows: int, width: int, idx: int, padding: list[int], seed: int) -> BatchKVCache:
    """A BatchKVCache of `rows` rows, `width` columns of which the first `idx` are in use."""
    cache = BatchKVCache(padding)
    mx.random.seed(seed)
    cache.keys, cache.values = mx.random.normal((rows, 2, width, 4)), mx.random.normal((rows, 2, width, 4))
    cache.offset = mx.array([idx - p for p in padding])
    cache._idx = idx
    return cache


def _lone_cache(length: int, width: int, seed: int) -> KVCache:
    cache = KVCache()
    mx.random.seed(seed)
    cache.keys, cache.values = mx.random.normal((1, 2, width, 4)), mx.random.normal((1, 2, width, 4))
    cache.offset = length
    return cache


def _same_caches(got: list, want: list) -> bool:
    """Equal in every position in use (padding included), bit for bit, and in their bookkeeping."""
    for a, b in zip(got, want):
        used = slice(0, b._idx)
        if a._idx != b._idx or a.offset.tolist() != b.offset.tolist() or a.left_padding.tolist() != b.left_padding.tolist():
            return False
        if not all(mx.array_equal(x[:, :, used], y[:, :, used]).item() for x, y in ((a.keys, b.keys), (a.values, b.values))):
            return False
    return True


@pytest.mark.skipif(engine.batch.native() is None, reason="no native module built (macOS: Metal's own kernels)")
@pytest.mark.parametrize("length", [5, 11], ids=["shorter", "longer"])
def test_a_join_and_a_leave_lay_the_buffers_out_as_mlx_lm_does(monkeypatch, length):
    """A row joining three (shorter or longer than their 9 positions) and then a row leaving:
    the native operation (`rows_laid_out`, one for all layers) leaves the caches mlx-lm's
    `extend` and the slices of `_without_row` leave, bit for bit. Negative control: the
    joining row written at the left, not right-justified."""
    def caches():
        batch = [_random_batch_cache(3, 16, 9, [2, 0, 4], seed) for seed in range(3)]
        return batch, [_lone_cache(length, 12, 10 + seed) for seed in range(3)]

    native_batch, row = caches()
    engine.batch._extend(native_batch, row)
    with monkeypatch.context() as patch:
        patch.setattr(engine.batch, "native", lambda: None)
        library_batch, row = caches()
        engine.batch._extend(library_batch, row)
    assert native_batch[0].keys.shape[0] == 4 and _same_caches(native_batch, library_batch)

    for batch in (native_batch, library_batch):
        mx.eval([c.left_padding for c in batch])
    keep = mx.array([0, 2, 3])
    engine.batch._drop_row(native_batch, 1, keep)
    with monkeypatch.context() as patch:
        patch.setattr(engine.batch, "native", lambda: None)
        engine.batch._drop_row(library_batch, 1, keep)
    assert min(native_batch[0].left_padding.tolist()) == 0 and _same_caches(native_batch, library_batch)

    reference = _joined_by_library(monkeypatch, caches)
    wrong, row = caches()
    joined = max(9, length)
    places = [(0, b, 0, 9, joined - 9) for b in range(3)] + [(1, 0, 0, length, 1 if joined == length else 0)]
    engine.batch._laid_out(wrong, [row], places, 16)
    for cache, want in zip(wrong, reference):
        cache.offset, cache.left_padding, cache._idx = want.offset, want.left_padding, want._idx
    assert not _same_caches(wrong, reference)


def _joined_by_library(monkeypatch, caches) -> list:
    with monkeypatch.context() as patch:
        patch.setattr(engine.batch, "native", lambda: None)
        batch, row = caches()
        engine.batch._extend(batch, row)
    return batch


@pytest.mark.skipif(engine.batch.native() is None, reason="no native module built (macOS: Metal's own kernels)")
def test_laying_rows_out_refuses_what_is_not_there():
    module = engine.batch.native()
    keys = mx.zeros((2, 2, 8, 4))
    with pytest.raises(ValueError, match="outside its source"):
        module.rows_laid_out([[keys]], [(0, 0, 4, 5, 0)], 16)
    with pytest.raises(ValueError, match="outside its source"):
        module.rows_laid_out([[keys]], [(0, 2, 0, 4, 0)], 16)
    with pytest.raises(ValueError, match="set that is not there"):
        module.rows_laid_out([[keys]], [(1, 0, 0, 4, 0)], 16)
    with pytest.raises(ValueError, match="float32"):
        module.rows_laid_out([[keys.astype(mx.float16)]], [(0, 0, 0, 4, 0)], 16)
