"""The engine loop on every family's tiny checkpoint: greedy identity, cache
equivalence after partial acceptance, abandoning generations."""

from __future__ import annotations

import engine  # noqa: F401  (BLAS before mlx)
import mlx.core as mx
import pytest

from engine.generation import GenerationRequest
from engine.sampling import SamplerSettings
from tests.engine_helpers import (
    assert_caches_close,
    assert_greedy_agree,
    assert_last_logits_match,
    available_families,
    caches_excess,
    feed_one_by_one,
    greedy,
    load_family,
    reference_head_caches,
    run,
)
from tests.floats import LONG_PATHS_ULPS, PATHS_ULPS

PROMPT = [10, 11, 12, 43, 12, 46, 30, 47, 48, 8]


@pytest.mark.parametrize("family", available_families())
@pytest.mark.parametrize("depth", [1, 3])
def test_greedy_mtp_equals_ar(tmp_path, family, depth):
    engine_ = load_family(tmp_path, family, mtp_heads=2 if family == "mimo" else 1)
    ar, _, _ = run(engine_, PROMPT, mode="ar", sampler=greedy(), max_tokens=72)
    mtp, _, results = run(engine_, PROMPT, mode="mtp", depth=depth, sampler=greedy(), max_tokens=72)
    assert len(ar) == len(mtp) == 72
    assert sum(r.drafted for r in results) > 0
    assert_greedy_agree(engine_.backend, PROMPT, ar, mtp)


@pytest.mark.parametrize("family", available_families())
def test_a_prompts_last_chunk_scores_its_last_position_only(tmp_path, family):
    engine_ = load_family(tmp_path, family, mtp_heads=1)
    assert_last_logits_match(engine_.backend, mx.array([PROMPT]), PATHS_ULPS)


@pytest.mark.parametrize("family", available_families())
@pytest.mark.parametrize("heads,depth", [(1, 3), (2, 2), (2, 4)])
def test_caches_match_one_by_one_after_partial_acceptance(tmp_path, family, heads, depth):
    engine_ = load_family(tmp_path, family, mtp_heads=heads)
    backend = engine_.backend
    sampler = SamplerSettings(temperature=1.0)
    gen = engine_.open(GenerationRequest(prompt=tuple(PROMPT), depth=depth, sampler=sampler, max_tokens=40, seed=3))
    partial = 0
    while not gen.finished:
        result = gen.step()
        partial += result.drafted > 0 and not all(result.accepted)
    assert partial > 0, "the run never rejected a draft: nothing was rolled back"
    fed = gen.tokens[: gen._fed]
    ref_cache, ref_hidden = feed_one_by_one(backend, fed)
    assert_caches_close(gen.cache, ref_cache, LONG_PATHS_ULPS, "trunk cache")
    offsets = [c.offset for c in gen.head_caches]
    assert offsets[0] > len(PROMPT)  # the heads kept up with generated tokens
    ref_heads = reference_head_caches(backend, gen.tokens, ref_hidden, offsets)
    assert_caches_close(gen.head_caches, ref_heads, LONG_PATHS_ULPS, "head caches")
    assert_broken_rollbacks_fail(backend, gen, fed, ref_hidden, offsets, LONG_PATHS_ULPS)


@pytest.mark.parametrize("family", available_families())
def test_heads_take_in_the_prompt_during_prefill(tmp_path, family):
    """Prefill chunks feed the heads every prompt position whose tokens are known
    (head k at p reads token p+k+1), so the first cycle drafts at once; the
    head caches are those of feeding one position at a time."""
    heads = 2
    engine_ = load_family(tmp_path, family, mtp_heads=heads)
    backend = engine_.backend
    prompt = PROMPT * 2  # 20 tokens in chunks of 8, 8 and 4
    gen = engine_.open(GenerationRequest(prompt=tuple(prompt), depth=heads, prefill_chunk=8, max_tokens=8))
    used = len(gen.head_caches)
    for expected in ([8, 8], [16, 16], [19, 18]):
        gen.step()
        assert [c.offset for c in gen.head_caches] == expected[:used]
    _, ref_hidden = feed_one_by_one(backend, prompt)
    ref_heads = reference_head_caches(backend, gen.tokens, ref_hidden, expected[:used])
    assert_caches_close(gen.head_caches, ref_heads, PATHS_ULPS, "head caches")
    wrong = list(gen.tokens)
    wrong[expected[0]] += 1  # head 0's last position read another token
    wrong_heads = reference_head_caches(backend, wrong, ref_hidden, expected[:used])
    assert caches_excess(gen.head_caches, wrong_heads, PATHS_ULPS, "heads: another token") > 1


def assert_broken_rollbacks_fail(backend, gen, fed, ref_hidden, offsets, ulps):
    """Negative controls: the comparison above must catch what a faulty rollback leaves,
    a cache that kept one rejected draft position, or whose last position holds another
    token (a perturbed state), in the trunk and in the heads."""
    one_too_many, _ = feed_one_by_one(backend, fed + [(fed[-1] + 1) % backend.vocab_size])
    assert caches_excess(gen.cache, one_too_many, ulps, "trunk: a kept draft") > 1
    other_last, _ = feed_one_by_one(backend, fed[:-1] + [(fed[-1] + 1) % backend.vocab_size])
    assert caches_excess(gen.cache, other_last, ulps, "trunk: another last token") > 1
    wrong = list(gen.tokens)
    wrong[offsets[0]] = (wrong[offsets[0]] + 1) % backend.vocab_size
    wrong_heads = reference_head_caches(backend, wrong, ref_hidden, offsets)
    assert caches_excess(gen.head_caches, wrong_heads, ulps, "heads: another last token") > 1


def test_abandoned_generations_release_memory(tmp_path):
    engine_ = load_family(tmp_path, "mimo", mtp_heads=1)
    prompt = tuple(range(10, 50)) * 8

    def one_abandoned(seed):
        gen = engine_.open(GenerationRequest(prompt=prompt, depth=2, seed=seed, prefill_chunk=64))
        for _ in range(7):  # stop midway: inside prefill or between cycles
            gen.step()
        gen.close()

    one_abandoned(0)
    mx.clear_cache()
    baseline = mx.get_active_memory()
    for seed in range(1, 6):
        one_abandoned(seed)
    mx.clear_cache()
    assert mx.get_active_memory() <= baseline * 1.05 + 64 * 1024


def test_requests_are_validated(tmp_path):
    engine_ = load_family(tmp_path, "mimo", mtp_heads=1)
    with pytest.raises(ValueError):
        GenerationRequest(prompt=())
    with pytest.raises(ValueError):
        GenerationRequest(prompt=(1,), depth=0)
    with pytest.raises(ValueError):
        GenerationRequest(prompt=(1,), mode="beam")
    gen = engine_.open(GenerationRequest(prompt=(1, 2), max_tokens=2, mode="ar"))
    while not gen.finished:
        gen.step()
    with pytest.raises(RuntimeError):
        gen.step()


def test_stop_tokens_and_budget(tmp_path):
    engine_ = load_family(tmp_path, "mimo", mtp_heads=1)
    free, _, _ = run(engine_, PROMPT, sampler=greedy(), max_tokens=30, depth=2)
    stop = free[5]
    first = free.index(stop)
    stopped, gen, _ = run(engine_, PROMPT, sampler=greedy(), max_tokens=30, depth=2, stop_token_ids=frozenset({stop}))
    assert stopped == free[:first] and gen.finish_reason == "stop"
    short, gen, _ = run(engine_, PROMPT, sampler=greedy(), max_tokens=4, depth=3)
    assert short == free[:4] and gen.finish_reason == "length"


@pytest.mark.parametrize("family", available_families())
def test_head_in_sidecar_file_loads_the_same(tmp_path, family):
    inline = load_family(tmp_path / "inline", family, mtp_heads=1)
    sidecar = load_family(tmp_path / "sidecar", family, mtp_heads=1, sidecar=True)
    assert (sidecar.path / "mtp.safetensors").is_file()
    assert inline.backend.n_heads == sidecar.backend.n_heads == 1
    a, _, _ = run(inline, PROMPT, sampler=SamplerSettings(temperature=0.8), depth=2, max_tokens=16, seed=5)
    b, _, _ = run(sidecar, PROMPT, sampler=SamplerSettings(temperature=0.8), depth=2, max_tokens=16, seed=5)
    assert a == b


def test_decode_steps_run_on_one_blas_thread_and_prefill_on_all(tmp_path):
    from engine.blas import DECODE_THREADS, set_threads

    if set_threads(None) is None:
        pytest.skip("no OpenBLAS thread control here (Accelerate decides)")
    eng = load_family(tmp_path, "mimo", mtp_heads=1)
    seen: list[tuple[int, int | None]] = []
    forward = eng.backend.forward

    def spy(tokens, cache, tape=None, last=False):
        seen.append((tokens.shape[1], set_threads(None)))
        return forward(tokens, cache, tape, last)

    eng.backend.forward = spy
    before = set_threads(2)
    try:
        run(eng, PROMPT, sampler=greedy(), depth=1, max_tokens=6)
        assert set_threads(None) == 2  # restored after every step
    finally:
        set_threads(before)
    assert seen[0] == (len(PROMPT), 2)  # the prefill chunk: every thread
    assert {threads for _, threads in seen[1:]} == {DECODE_THREADS}  # verify forwards: one


@pytest.mark.parametrize("family", available_families())
def test_steps_whose_top_p_shortcut_missed_are_redone_exactly(tmp_path, family, monkeypatch):
    """A step samples with provisional top-p filters and checks them at its one
    host sync; where the candidates missed a cut, the step is undone (caches,
    heads, keys) and redone with the full sort. The tokens are those of runs that
    never took the shortcut, however often it missed."""
    from engine import generation, sampling

    engine_ = load_family(tmp_path, family, mtp_heads=2 if family == "mimo" else 1)
    vocab = len(engine_.tokenizer.vocab)
    exact_filters = []
    exact = sampling.probabilities
    monkeypatch.setattr(generation, "probabilities", lambda *a, **k: exact_filters.append(1) or exact(*a, **k))

    def tokens(candidates: int, compiled: bool = False) -> dict:
        monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", candidates)
        sampling.compiled_probabilities.cache_clear()
        exact_filters.clear()
        sampler = SamplerSettings(temperature=1.0, top_p=0.9)
        return {
            (mode, depth): run(engine_, PROMPT, mode=mode, depth=depth, sampler=sampler, max_tokens=24,
                               seed=5, compiled=compiled)[0]
            for mode, depth in (("ar", 1), ("mtp", 1), ("mtp", 3))
        }

    never = tokens(vocab)  # every candidate: nothing to check
    assert not exact_filters
    assert tokens(1) == never  # every shortcut misses
    always = len(exact_filters)
    assert tokens(vocab // 8) == never  # some do
    assert 0 < len(exact_filters) < always
    assert tokens(1, compiled=True) == never


@pytest.mark.parametrize("mode", ["ar", "mtp"])
def test_the_first_token_is_drawn_among_first_tokens(tmp_path, mode):
    """Token healing's constraint: the first token (only) comes from the allowed set,
    sampled from the model's distribution renormalised over it."""
    engine_ = load_family(tmp_path, "mimo", mtp_heads=1)
    allowed = frozenset({20, 21})
    firsts = set()
    for seed in range(12):
        tokens, _, _ = run(engine_, PROMPT, mode=mode, depth=2, sampler=SamplerSettings(temperature=1.5),
                           max_tokens=6, seed=seed, first_tokens=allowed)
        firsts.add(tokens[0])
    assert firsts == allowed  # both drawn, nothing else
    free = {run(engine_, PROMPT, mode=mode, sampler=SamplerSettings(temperature=1.5), max_tokens=1, seed=s)[0][0]
            for s in range(12)}
    assert not free <= allowed  # unconstrained, other tokens come first
    with pytest.raises(ValueError):
        GenerationRequest(prompt=(1,), first_tokens=frozenset())
