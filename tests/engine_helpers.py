"""Shared helpers for engine-level tests: tiny checkpoints, references, comparisons."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import engine  # noqa: F401  (BLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache

from mtplxd.bench.rows import few_rows_switch
from engine import quantized_rows
from engine.engine import Engine
from engine.generation import Generation, GenerationRequest
from engine.sampling import SamplerSettings
from tests.checkpoints import FAMILIES, write
from tests.floats import EPS32, LONG_PATHS_ULPS, assert_close, excess, record

BACKEND_MODULES = {
    "mimo": "engine.backends.mimo",
    "deepseek_v3": "engine.backends.deepseek_v3",
    "glm4_moe": "engine.backends.glm4_moe",
    "qwen3_next": "engine.backends.qwen3_next",
    "qwen3_5": "engine.backends.qwen3_5",
    "qwen3_5_moe": "engine.backends.qwen3_5_moe",
    "mimo_v2_flash": "engine.backends.mimo_v2_flash",
    "step3p5": "engine.backends.step3p5",
    "glm_moe_dsa": "engine.backends.glm_moe_dsa",
    "nemotron_h": "engine.backends.nemotron_h",
    "hy_v3": "engine.backends.hy_v3",
    "deepseek_v4": "engine.backends.deepseek_v4",
}


def available_families() -> list:
    """Every family, skipped (not dropped) while its backend is missing."""
    params = []
    for family in FAMILIES:
        present = importlib.util.find_spec(BACKEND_MODULES[family]) is not None
        marks = [] if present else [pytest.mark.skip(reason=f"no backend for {family} yet")]
        params.append(pytest.param(family, marks=marks, id=family))
    return params


def load_family(tmp_path: Path, family: str, **options) -> Engine:
    folder = write(family, tmp_path / family, **options)
    return Engine.load(folder)


def run(engine_: Engine, prompt: list[int], **kwargs) -> tuple[list[int], Generation, list]:
    """Run a generation to the end; returns (generated ids, generation, step results)."""
    gen = engine_.open(GenerationRequest(prompt=tuple(prompt), **kwargs))
    results = []
    while not gen.finished:
        results.append(gen.step())
    return gen.tokens[len(prompt):], gen, results


def greedy(**kwargs) -> SamplerSettings:
    return SamplerSettings(temperature=0.0, **kwargs)


def assert_greedy_agree(backend, prompt: list[int], ar: list[int], mtp: list[int]) -> None:
    """Greedy MTP equals greedy AR token for token, except after a near-tie.

    MTP's verify forward (K+1 positions at once, over a cache built by such forwards)
    and AR's one-position forwards compute the same logits along different paths, so
    they differ by up to one LONG_PATHS_ULPS bound each: where the top two logits are
    closer than twice that, the two argmaxes may differ, and from there on the texts
    part. That is all exact decoding can promise under every BLAS kernel; this asserts it.
    """
    assert len(ar) == len(mtp)
    for i, (a, b) in enumerate(zip(ar, mtp)):
        if a != b:
            logits, _ = backend.forward(mx.array([prompt + ar[:i]]), backend.make_cache())
            last = np.array(logits[0, -1], dtype=np.float64)
            top = np.sort(last)[-2:]
            near_tie = 2 * LONG_PATHS_ULPS * EPS32 * float(np.abs(last).max())
            assert top[1] - top[0] <= near_tie, (
                f"MTP diverged from AR at token {i}: top-2 gap {top[1] - top[0]:.3g} > near-tie {near_tie:.3g}")
            return


def assert_served_greedy_agree(model: Path, prompt: str, ar_text: str, mtp_text: str, max_tokens: int,
                               depth: int) -> None:
    """Greedy completions served over HTTP in AR and MTP mode: the same text, or else the
    engine in this process (same machine, same kernels) parts at the same place, after a
    near-tie (assert_greedy_agree). A difference the engine does not reproduce fails."""
    if ar_text == mtp_text:
        return
    from engine.prompts import completion_prompt_ids

    engine_ = Engine.load(model)
    ids = completion_prompt_ids(engine_.tokenizer, prompt)
    ar, _, _ = run(engine_, ids, mode="ar", sampler=greedy(), max_tokens=max_tokens)
    mtp, _, _ = run(engine_, ids, mode="mtp", depth=depth, sampler=greedy(), max_tokens=max_tokens)
    assert ar != mtp, f"served texts differ but the engine's do not: {ar_text!r} / {mtp_text!r}"
    assert_greedy_agree(engine_.backend, ids, ar, mtp)


def assert_batched_greedy_agree(model: Path, prompt: str, alone_text: str, batched_text: str) -> None:
    """Greedy completions served alone and in a batch that differ: they must part at a
    near-tie of the model's own logits (assert_greedy_agree), read from the texts'
    tokens."""
    from engine.prompts import completion_prompt_ids

    engine_ = Engine.load(model)
    ids = completion_prompt_ids(engine_.tokenizer, prompt)
    encode = lambda text: engine_.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    alone, batched = encode(alone_text), encode(batched_text)
    n = min(len(alone), len(batched))
    assert alone[:n] != batched[:n], f"texts differ only in length: {alone_text!r} / {batched_text!r}"
    assert_greedy_agree(engine_.backend, ids, alone[:n], batched[:n])


def cache_arrays(cache) -> list[np.ndarray]:
    """The meaningful contents of one cache: KV up to offset, recurrent arrays."""
    if isinstance(cache, ArraysCache):
        return [np.array(a) for a in cache.cache if a is not None]
    if hasattr(cache, "keys") and hasattr(cache, "offset"):
        if cache.keys is None:
            return []
        return [np.array(cache.keys[..., : cache.offset, :]), np.array(cache.values[..., : cache.offset, :])]
    return [np.array(a) for a in cache.state if isinstance(a, mx.array)]


def _cache_pairs(a: list, b: list):
    for layer, (ca, cb) in enumerate(zip(a, b, strict=True)):
        for i, (x, y) in enumerate(zip(cache_arrays(ca), cache_arrays(cb), strict=True)):
            yield f"layer {layer} array {i}", x, y


def assert_caches_close(got: list, want: list, ulps: float, what: str = "cache") -> None:
    """Every array of every layer within `ulps` float32 epsilons of its own largest
    value (keys, values, conv windows and recurrent states differ in scale)."""
    for where, x, y in _cache_pairs(got, want):
        assert_close(x, y, ulps, what, where=where)


def caches_excess(got: list, want: list, ulps: float, what: str = "") -> float:
    """The worst array's difference as a multiple of its bound (negative controls);
    arrays of different shapes (a cache one position longer) count as infinitely far."""
    worst = 0.0
    for _, x, y in _cache_pairs(got, want):
        worst = max(worst, excess(x, y, ulps) if x.shape == y.shape else float("inf"))
    if what:
        record(what, ulps, worst, control=True)
    return worst


def assert_last_logits_match(backend, tokens: mx.array, ulps: float) -> None:
    """`forward(..., last=True)` (a prompt's last chunk) gives the last position's logits
    of the whole forward, the same hidden states and caches; a negative control: the
    position before it is far outside the bound."""
    whole_cache, last_cache = backend.make_cache(), backend.make_cache()
    whole, whole_hidden = backend.forward(tokens, whole_cache)
    last, last_hidden = backend.forward(tokens, last_cache, last=True)
    assert last.shape == (tokens.shape[0], 1, whole.shape[-1])
    assert_close(last[:, 0], whole[:, -1], ulps, "last position's logits")
    assert excess(last[:, 0], whole[:, -2], ulps, "the position before") > 1
    if whole_hidden is not None:
        assert_close(last_hidden, whole_hidden, ulps, "hidden states")
    assert_caches_close(last_cache, whole_cache, ulps)


# -- the decode kernels (tests/conftest.py: --few-rows-kernel) -------------------------
# One choice sets both: the BLAS shim's few-row kernel for float weights and the
# quantized-rows kernel's path (engine/quantized_rows.py) for quantized ones.

KERNELS = {"widest": 1, "avx2": 2, "off": 0}  # the shim's mtplxd_few_rows argument
QUANTIZED_PATHS = {"widest": None, "avx2": "avx2", "off": "portable"}  # None: the best this CPU has
_chosen = "widest"


def choose_kernel(name: str) -> None:
    """This run's kernels; tests that switch kernels restore them with restore_kernel()."""
    global _chosen
    _chosen = name
    restore_kernel()


def restore_kernel() -> None:
    switch = few_rows_switch()
    if switch is not None:
        switch(KERNELS[_chosen])
    quantized = quantized_rows.native()
    if quantized is not None:
        path = QUANTIZED_PATHS[_chosen]
        quantized.set_kernel(path if path in quantized.paths() else quantized.paths()[0])


def feed_one_by_one(backend, tokens: list[int]) -> tuple[list, list[mx.array]]:
    """The reference state: trunk cache and hidden states from single-token forwards."""
    cache = backend.make_cache()
    hidden = []
    for t in tokens:
        _, h = backend.forward(mx.array([[t]]), cache)
        hidden.append(h)
        mx.eval(h)
    return cache, hidden


def reference_head_caches(backend, tokens: list[int], hidden: list[mx.array], offsets: list[int]):
    """Head caches built one real position at a time, up to each head's offset."""
    caches = backend.make_head_caches()[: len(offsets)]
    inputs = hidden
    for k, (cache, offset) in enumerate(zip(caches, offsets)):
        outputs = []
        for p in range(offset):
            _, g = backend.head(k, inputs[p], mx.array([[tokens[p + k + 1]]]), cache)
            mx.eval(g)
            outputs.append(g)
        inputs = outputs
    return caches
