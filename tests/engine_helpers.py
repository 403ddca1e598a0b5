"""Shared helpers for engine-level tests: tiny checkpoints, references, comparisons."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import engine  # noqa: F401  (BLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache

from engine.engine import Engine
from engine.generation import Generation, GenerationRequest
from engine.sampling import SamplerSettings
from tests.checkpoints import FAMILIES, write

BACKEND_MODULES = {
    "mimo": "engine.backends.mimo",
    "deepseek_v3": "engine.backends.deepseek_v3",
    "glm4_moe": "engine.backends.glm4_moe",
    "qwen3_next": "engine.backends.qwen3_next",
    "qwen3_5": "engine.backends.qwen3_5",
    "qwen3_5_moe": "engine.backends.qwen3_5_moe",
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


def cache_arrays(cache) -> list[np.ndarray]:
    """The meaningful contents of one cache: KV up to offset, recurrent arrays."""
    if isinstance(cache, ArraysCache):
        return [np.array(a) for a in cache.cache if a is not None]
    if hasattr(cache, "keys") and hasattr(cache, "offset"):
        if cache.keys is None:
            return []
        return [np.array(cache.keys[..., : cache.offset, :]), np.array(cache.values[..., : cache.offset, :])]
    return [np.array(a) for a in cache.state if isinstance(a, mx.array)]


def max_cache_diff(a: list, b: list) -> float:
    worst = 0.0
    for ca, cb in zip(a, b, strict=True):
        for x, y in zip(cache_arrays(ca), cache_arrays(cb), strict=True):
            assert x.shape == y.shape, (x.shape, y.shape)
            worst = max(worst, float(np.abs(x - y).max()) if x.size else 0.0)
    return worst


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
