"""DeepSeek-V3 / GLM-4.5 backends on tiny real-layout checkpoints.

Loading (head count, sidecar, appended layer kept out of the trunk), prefill
consistency, rollback equivalence of every cache after a partial accept, and
the MTP head's batched vs stepwise consistency.
"""

import engine  # noqa: F401  (fast BLAS before mlx)

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
import pytest

from engine.backends import deepseek_v3, glm4_moe
from engine.backends.base import Tape
from engine.checkpoint import load_weights, read_config
from tests.checkpoints import write
from tests.engine_helpers import assert_caches_close
from tests.floats import PATHS_ULPS, assert_close

BACKENDS = {"deepseek_v3": deepseek_v3, "glm4_moe": glm4_moe}
FAMILIES = sorted(BACKENDS)
LAYERS = 3  # the writers' num_hidden_layers: deliberately not DeepSeek's 61
PROMPT = [4, 10, 17, 23, 31, 8, 12, 50]
WINDOW = [40, 2, 15, 33]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Checkpoint folders by (family, heads, sidecar), written once."""
    made = {}

    def get(family, heads=1, sidecar=False):
        key = (family, heads, sidecar)
        if key not in made:
            folder = tmp_path_factory.mktemp(f"{family}_{heads}_{int(sidecar)}")
            made[key] = write(family, folder, mtp_heads=heads, sidecar=sidecar)
        return made[key]

    return get


def load(family, folder, keep=lambda key: True):
    weights = {k: v for k, v in load_weights(folder).items() if keep(k)}
    return BACKENDS[family].load(folder, read_config(folder), weights)


@pytest.fixture(scope="module")
def backends(folders):
    return {family: load(family, folders(family, heads=2)) for family in FAMILIES}


def tokens(ids):
    return mx.array([ids], dtype=mx.int32)


def stepwise(backend, ids, cache):
    """Feed ids one at a time; logits and hidden for every position."""
    outs = [backend.forward(tokens([t]), cache) for t in ids]
    return mx.concatenate([o[0] for o in outs], axis=1), mx.concatenate([o[1] for o in outs], axis=1)


def max_diff(a, b):
    """Only for comparisons that must be exact: the same operations on the same inputs
    give the same bits under any BLAS kernel."""
    return float(mx.max(mx.abs(a - b)))


def assert_caches_equal(got, want):
    assert [c.offset for c in got] == [c.offset for c in want]
    assert_caches_close(got, want, PATHS_ULPS)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("heads,sidecar", [(1, False), (2, False), (1, True), (2, True)])
def test_loads_heads(folders, family, heads, sidecar):
    folder = folders(family, heads, sidecar)
    assert (folder / "mtp.safetensors").exists() == sidecar
    backend = load(family, folder)
    assert backend.n_heads == heads
    assert len(backend.make_head_caches()) == heads
    assert backend.vocab_size == read_config(folders(family))["vocab_size"]


@pytest.mark.parametrize("family", FAMILIES)
def test_appended_layer_is_not_trunk(backends, family):
    backend = backends[family]
    assert len(backend.trunk.model.layers) == LAYERS
    assert len(backend.make_cache()) == LAYERS
    # Strict loading of a non-61 depth succeeded; the trunk holds no layer >= N.
    names = [k for k, _ in tree_flatten(backend.trunk.parameters())]
    assert not any(k.startswith(f"model.layers.{LAYERS}.") for k in names)
    # Head layers sit at index >= first_k_dense_replace: MoE with stacked experts.
    for head in backend.heads:
        assert head.mlp.switch_mlp.gate_proj.weight.shape[0] == 4


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_copies_are_optional(folders, backends, family):
    """The nextn layers' embed_tokens / shared_head.head copies are shared with
    the trunk: a checkpoint without them loads and drafts identically."""
    copies = tuple(f"model.layers.{LAYERS + i}.{name}" for i in range(2) for name in ("embed_tokens.", "shared_head.head."))
    bare = load(family, folders(family, heads=2), keep=lambda key: not key.startswith(copies))
    full = backends[family]
    _, hidden = full.forward(tokens(PROMPT), full.make_cache())
    for k in range(2):
        want = full.head(k, hidden, tokens(PROMPT), full.make_head_caches()[k])[0]
        got = bare.head(k, hidden, tokens(PROMPT), bare.make_head_caches()[k])[0]
        assert max_diff(got, want) == 0.0


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_matches_stepwise(backends, family):
    backend = backends[family]
    batched, hidden = backend.forward(tokens(PROMPT), backend.make_cache())
    single, single_hidden = stepwise(backend, PROMPT, backend.make_cache())
    assert_close(batched, single, PATHS_ULPS, "logits")
    assert_close(hidden, single_hidden, PATHS_ULPS, "hidden")
    # Logits are not degenerate: a clear but not certain top token.
    probs = np.array(mx.softmax(batched[0], axis=-1))
    assert 0.05 < probs.max(axis=-1).mean() < 0.99


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("keep", range(len(WINDOW) + 1))
def test_rollback_equivalence(backends, family, keep):
    backend = backends[family]
    cache = backend.make_cache()
    backend.forward(tokens(PROMPT), cache)
    tape = Tape()
    tape.length = len(WINDOW)
    backend.forward(tokens(WINDOW), cache, tape)
    backend.rewind(cache, tape, keep)

    reference = backend.make_cache()
    stepwise(backend, PROMPT + WINDOW[:keep], reference)
    assert_caches_equal(cache, reference)
    # Decoding continues identically from the rewound cache.
    nxt = tokens([WINDOW[keep] if keep < len(WINDOW) else 7])
    assert_close(backend.forward(nxt, cache)[0], backend.forward(nxt, reference)[0], PATHS_ULPS, "next logits")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("k", [0, 1])
def test_head_batched_matches_stepwise(backends, family, k):
    """Head k over all (hidden_t, token_{t+1}) pairs at once equals one at a time,
    logits, output hidden and its KV alike."""
    backend = backends[family]
    _, hidden = backend.forward(tokens(PROMPT), backend.make_cache())
    h_in, t_in = hidden[:, :-1], tokens(PROMPT[1:])
    batch_cache, step_cache = backend.make_head_caches()[k], backend.make_head_caches()[k]
    logits, h_out = backend.head(k, h_in, t_in, batch_cache)
    steps = [backend.head(k, h_in[:, i : i + 1], t_in[:, i : i + 1], step_cache) for i in range(h_in.shape[1])]
    assert_close(logits, mx.concatenate([s[0] for s in steps], axis=1), PATHS_ULPS, "head logits")
    assert_close(h_out, mx.concatenate([s[1] for s in steps], axis=1), PATHS_ULPS, "head hidden")
    assert_caches_equal([batch_cache], [step_cache])
    assert logits.shape == (1, len(PROMPT) - 1, backend.vocab_size)


@pytest.mark.parametrize("family", FAMILIES)
def test_head_cache_rewinds(backends, family):
    """A head's KV trims back like the trunk's (the loop rewinds heads too)."""
    backend = backends[family]
    _, hidden = backend.forward(tokens(PROMPT), backend.make_cache())
    cache, reference = backend.make_head_caches()[0], backend.make_head_caches()[0]
    backend.head(0, hidden[:, :-1], tokens(PROMPT[1:]), cache)
    tape = Tape(length=3)
    backend.rewind([cache], tape, keep=1)
    backend.head(0, hidden[:, :-3], tokens(PROMPT[1:-2]), reference)
    assert_caches_equal([cache], [reference])
