"""A draft vocabulary (engine/backends/draft_vocab.py): heads shipped with the ids of the
tokens they were trained on score only those rows of the LM head.

The rows equal the LM head's, plain or quantized, and follow it when the engine unpacks
it; a MiMo checkpoint whose sidecar holds the ids loads with them; its heads never draft
outside them; greedy MTP keeps AR's tokens; sampled MTP keeps the trunk's exact
distribution (the chi-square of tests/test_engine_exactness.py), and the same test fails
with a broken acceptance rule while the draft vocabulary is on.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import engine.generation
from engine.backends.draft_vocab import DRAFT_VOCAB_KEY, DraftVocabulary
from engine.engine import Engine
from engine.sampling import SamplerSettings, probabilities
from engine.speculative import sample
from tests.checkpoints import write
from tests.engine_helpers import assert_greedy_agree, greedy, run
from tests.floats import FEW_OPS_ULPS, assert_close, excess
from tests.test_engine_exactness import (
    PROMPT, SAMPLERS, broken_verify, chi_square_pvalue, exact_joint, sampled_counts,
)

IDS = [1, 2, 3, 5, 8, 9, 10, 11, 13]  # of the fixture's 16 tokens


def test_rows_equal_the_lm_head_plain_and_quantized():
    ids = mx.array([0, 3, 17, 40, 63])
    h = mx.random.normal((2, 3, 64), key=mx.random.key(1))
    for layer in (nn.Linear(64, 64, bias=False), nn.QuantizedLinear(64, 64, bias=False, group_size=32, bits=4)):
        draft = DraftVocabulary(ids, 64)
        draft.follow(layer)
        got, full = draft.logits(h), layer(h)
        outside = np.setdiff1d(np.arange(64), np.array(ids))
        assert bool(mx.all(mx.isinf(got[..., mx.array(outside)])).item())
        # the same products, one matmul over fewer rows: equal within a few roundings
        assert_close(got[..., ids], full[..., ids], FEW_OPS_ULPS, "draft rows")
    compiled = mx.compile(lambda x: draft.logits(x), inputs=draft.rows)
    assert bool(mx.array_equal(compiled(h), draft.logits(h)).item())


@pytest.mark.parametrize("settings", [
    SamplerSettings(temperature=0.6, top_p=0.95), SamplerSettings(temperature=1.0, top_k=20),
    SamplerSettings(temperature=1.0, top_k=500), SamplerSettings(temperature=0.8, min_p=0.05),
    SamplerSettings(temperature=0.0)], ids=str)
def test_a_draft_drawn_on_the_vocabulary_alone_is_the_full_rows_draw(settings):
    """Filtered on the subset's scores and spread back, a draft's q is the full row's
    (its -inf elsewhere) within a few roundings, and the same key draws the same token.
    top_k=500 keeps more than the subset holds. A control: q of another row is far off."""
    vocab_size, ids = 1024, mx.array(np.sort(np.random.default_rng(0).choice(1024, 300, replace=False)))
    draft = DraftVocabulary(ids, vocab_size)
    scores = mx.random.normal((1, 300), key=mx.random.key(2)) * 3
    full = _on_vocabulary(scores, ids, vocab_size)
    want = probabilities(full, settings)
    got = draft.spread(probabilities(draft.compact(full), settings))
    assert_close(got, want, FEW_OPS_ULPS, "q on the subset")
    other = _on_vocabulary(mx.roll(scores, 1, axis=-1), ids, vocab_size)
    assert excess(got, probabilities(other, settings), FEW_OPS_ULPS, "another row's q") > 1
    for seed in range(200):
        key = mx.random.key(seed)
        on_subset = draft.token(sample(probabilities(draft.compact(full), settings), key))
        assert on_subset.item() == sample(want, key).item()


def _on_vocabulary(scores: mx.array, ids: mx.array, vocab_size: int) -> mx.array:
    """A head's logits row: the scores at ids, -inf elsewhere."""
    row = np.full((1, vocab_size), -np.inf, dtype=np.float32)
    row[0, np.array(ids)] = np.array(scores[0])
    return mx.array(row)


def test_rows_follow_the_lm_head_when_it_is_replaced():
    layer = nn.Linear(8, 16, bias=False)
    draft = DraftVocabulary(mx.array([2, 7]), 16)
    draft.follow(layer)
    before = draft.rows["weight"]
    draft.follow(layer)
    assert draft.rows["weight"] is before  # the same weight: nothing taken again
    layer.weight = layer.weight * 2
    draft.follow(layer)
    assert bool(mx.array_equal(draft.rows["weight"], layer.weight[mx.array([2, 7])]).item())


def with_draft_vocab(folder, ids: list[int]):
    """The MiMo fixture in `folder`, its heads in a sidecar with the draft ids beside them."""
    sidecar = folder / "mtp.safetensors"
    heads = mx.load(str(sidecar))
    mx.save_safetensors(str(sidecar), {**heads, DRAFT_VOCAB_KEY: mx.array(ids, dtype=mx.int32)})
    return folder


@pytest.fixture
def folder(tmp_path):
    """Vocabulary 16, of which IDS are the draft vocabulary."""
    return with_draft_vocab(write("mimo", tmp_path / "mimo", mtp_heads=2, sidecar=True, n_chars=9), IDS)


def test_heads_draft_only_inside_the_vocabulary(folder):
    engine_ = Engine.load(folder)
    backend = engine_.backend
    assert backend.draft_vocab is not None and backend.draft_vocab.ids.tolist() == IDS
    drafted_logits = []
    head = backend.head

    def recording(*args, **kwargs):
        logits, hidden = head(*args, **kwargs)
        drafted_logits.append(logits)
        return logits, hidden

    backend.head = recording
    prompt = list(PROMPT) * 3
    mtp, _, results = run(engine_, prompt, mode="mtp", depth=2, sampler=greedy(), max_tokens=24)
    backend.head = head
    ar, _, _ = run(engine_, prompt, mode="ar", sampler=greedy(), max_tokens=24)
    assert sum(r.drafted for r in results) > 0 and drafted_logits
    outside = mx.array(np.setdiff1d(np.arange(16), IDS))
    for logits in drafted_logits:
        assert bool(mx.all(mx.isinf(logits[..., outside])).item())
        assert set(logits.argmax(axis=-1).reshape(-1).tolist()) <= set(IDS)
    assert_greedy_agree(backend, prompt, ar, mtp)


def _pvalue(folder, sampler_name: str, n: int) -> float:
    engine_ = Engine.load(folder)
    sampler = SAMPLERS[sampler_name]
    joint = exact_joint(engine_.backend, sampler)
    return chi_square_pvalue(joint, sampled_counts(engine_, sampler, n), n)


@pytest.mark.parametrize("sampler_name", list(SAMPLERS))
def test_output_distribution_stays_exact(folder, sampler_name):
    assert _pvalue(folder, sampler_name, n=800) > 1e-3


def test_negative_control_fails_with_the_draft_vocabulary(folder, monkeypatch):
    monkeypatch.setattr(engine.generation, "compiled_verify", broken_verify)
    assert _pvalue(folder, "t1.0", n=800) < 1e-6


def test_rows_in_a_batch_decode_as_alone(tmp_path):
    """The batch's drafts (every row's head at once) read the same rows as a row alone."""
    from tests.test_batch import ROWS, _batched, _solo

    plain = write("mimo", tmp_path / "mimo", mtp_heads=2, sidecar=True)
    vocab = Engine.load(plain).backend.trunk.args.vocab_size
    engine_ = Engine.load(with_draft_vocab(plain, list(range(0, vocab, 2))))
    assert engine_.backend.draft_vocab is not None
    for row, gen in zip(ROWS, _batched(engine_)):
        prompt, sampler = row[0], row[1]
        got, want = gen.tokens[len(prompt):], _solo(engine_, *row).tokens[len(prompt):]
        if sampler.greedy:
            assert_greedy_agree(engine_.backend, list(prompt), want, got)
        else:
            assert got == want, f"seeded row {prompt[:3]}...: {got} alone {want}"
