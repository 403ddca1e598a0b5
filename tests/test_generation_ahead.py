"""Plain decoding one step ahead (engine/generation.py, `_Ahead`): an AR step queues the next
one before its own token reaches the host. The tokens, the keys, the caches and what a
snapshot holds are those of a step at a time, through top-p cuts beyond the shortcut, stop
tokens, the budget and a batch taking the row; negative controls: a queued step that is
never taken back leaves the caches one position long, and a redraw with the wrong key
changes the tokens."""

from __future__ import annotations

import engine  # noqa: F401  (BLAS before mlx)
import pytest

from engine import generation as generation_module
from engine import sampling
from engine.batch import DecodeBatch
from engine.generation import Generation, GenerationRequest
from engine.sampling import SamplerSettings
from tests.engine_helpers import greedy, load_family

PROMPT = (10, 11, 12, 43, 12, 46, 30, 47, 48, 8)
SAMPLED = SamplerSettings(temperature=1.0, top_p=0.9)


@pytest.fixture
def engine_(tmp_path):
    return load_family(tmp_path, "mimo", mtp_heads=1)


def one_at_a_time(monkeypatch) -> None:
    """Steps without the queued one (the caches' kind is what allows it)."""
    monkeypatch.setattr(generation_module, "supported", lambda cache: False)


def steps(engine_, sampler: SamplerSettings, max_tokens: int = 24, record: bool = True, **kwargs) -> Generation:
    gen = engine_.open(GenerationRequest(prompt=PROMPT, sampler=sampler, mode="ar", max_tokens=max_tokens,
                                         seed=5, **kwargs), record=record)
    while not gen.finished:
        gen.step()
    return gen


@pytest.mark.parametrize("sampler", [greedy(), SAMPLED], ids=["greedy", "sampled"])
def test_a_step_ahead_decodes_what_a_step_at_a_time_decodes(engine_, sampler, monkeypatch):
    ahead = steps(engine_, sampler)
    gen = engine_.open(GenerationRequest(prompt=PROMPT, sampler=sampler, mode="ar", max_tokens=24, seed=5))
    gen.step()  # prompt and first token
    gen.step()
    assert gen.cache[0].offset == len(gen.tokens)  # the last token fed already: the next step is queued
    assert gen.decoding and gen.fed_count == len(gen.tokens)
    with monkeypatch.context() as patch:
        one_at_a_time(patch)
        alone = steps(engine_, sampler)
    assert ahead.tokens == alone.tokens
    assert len(ahead.tokens) == len(PROMPT) + 24
    # At the budget nothing is queued: the caches hold what a step at a time leaves.
    assert ahead.fed_count == alone.fed_count == ahead.cache[0].offset == alone.cache[0].offset
    a, b = ahead.snapshot(), alone.snapshot()
    assert (a.tokens == b.tokens).all() and a.hidden.data.shape == b.hidden.data.shape
    assert (a.logits.data == b.logits.data).all()


def test_top_p_cuts_beyond_the_shortcut_take_the_queued_step_back(engine_, monkeypatch):
    """Every shortcut misses (one candidate): each step's queued one is rewound and its token
    drawn again exactly with its own key; the tokens are those of the full sort, and the
    hidden states the session bank keeps stay one per fed position."""
    never = steps(engine_, SAMPLED, max_tokens=16, compiled=False)
    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", 1)  # read by the eager filters at every call
    undone = []
    original = Generation._undo
    monkeypatch.setattr(Generation, "_undo", lambda self, ahead: undone.append(1) or original(self, ahead))
    try:
        missed = steps(engine_, SAMPLED, max_tokens=16, compiled=False)
        assert len(undone) >= 8  # most of its 15 queued steps were taken back
        assert missed.tokens == never.tokens
        snap = missed.snapshot()
        assert snap is not None and snap.hidden.data.shape[1] == missed.fed_count == missed.cache[0].offset
        # Negative control: the key the queued step split off kept, not given back.
        def keep_key(self, ahead):
            key = self._key
            original(self, ahead)
            self._key = key

        monkeypatch.setattr(Generation, "_undo", keep_key)
        assert steps(engine_, SAMPLED, max_tokens=16, compiled=False).tokens != never.tokens
    finally:
        monkeypatch.undo()


def test_a_stop_token_leaves_the_caches_a_step_at_a_time_leaves(engine_, monkeypatch):
    generated = steps(engine_, greedy()).tokens[len(PROMPT):]
    # a token that first comes after a few steps ahead
    first, stop = next((i, t) for i, t in enumerate(generated) if i >= 3 and t not in generated[:i])
    stopped = steps(engine_, greedy(), stop_token_ids=frozenset({stop}))
    assert stopped.finish_reason == "stop"
    assert stopped.tokens == list(PROMPT) + generated[:first]
    assert stopped.fed_count == len(stopped.tokens) == stopped.cache[0].offset  # the stop not fed
    with monkeypatch.context() as patch:
        one_at_a_time(patch)
        alone = steps(engine_, greedy(), stop_token_ids=frozenset({stop}))
    assert alone.fed_tokens == stopped.fed_tokens
    assert (stopped.snapshot().logits.data == alone.snapshot().logits.data).all()
    # Negative control: without taking the queued step back, the stop is in the caches.
    monkeypatch.setattr(Generation, "_undo", lambda self, ahead: None)
    assert steps(engine_, greedy(), stop_token_ids=frozenset({stop})).cache[0].offset == len(stopped.tokens) + 1


@pytest.mark.parametrize("sampler", [greedy(), SAMPLED], ids=["greedy", "sampled"])
def test_settling_takes_the_queued_step_back_and_changes_nothing_after(engine_, sampler):
    whole = steps(engine_, sampler)
    gen = engine_.open(GenerationRequest(prompt=PROMPT, sampler=sampler, mode="ar", max_tokens=24, seed=5),
                       record=True)
    for _ in range(6):
        gen.step()
    gen.settle()
    assert gen.decoding and gen.cache[0].offset == gen.fed_count == len(gen.tokens) - 1
    assert gen.snapshot().hidden.data.shape[1] == gen.fed_count
    gen.settle()  # nothing queued: nothing changes
    assert gen.cache[0].offset == len(gen.tokens) - 1
    while not gen.finished:
        gen.step()
    assert gen.tokens == whole.tokens


def test_a_batch_takes_a_row_that_runs_ahead(engine_):
    """Two generations a step ahead join a batch (which steps its rows together, not ahead)
    and decode what they decode alone."""
    requests = [GenerationRequest(prompt=PROMPT, sampler=SAMPLED, mode="ar", max_tokens=20, seed=seed)
                for seed in (1, 2)]
    alone = []
    for request in requests:
        gen = engine_.open(request)
        while not gen.finished:
            gen.step()
        alone.append(gen.tokens)
    rows = [engine_.open(request) for request in requests]
    batch = DecodeBatch(engine_.backend, 0)
    for row in rows:
        for _ in range(4):
            row.step()
        assert row.cache[0].offset == len(row.tokens)  # queued
        batch.join(row)
    while len(batch):
        batch.step()
        for row in [row for row in rows if row.finished and row in batch]:
            batch.leave(row)
    assert [row.tokens for row in rows] == alone
