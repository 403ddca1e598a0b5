"""Qwen hybrid backends (Qwen3-Next, Qwen3.5 dense and MoE) on tiny real-layout checkpoints.

What matters for exactness: chunked and token-by-token forwards agree, a
verify window rewound to any `keep` leaves every cache (attention KV,
GatedDeltaNet conv and recurrent state) where feeding the kept tokens one by
one would, and the MTP head is position-consistent over its own KV cache.
The norm-shift test guards acceptance: a missed or doubled +1 on the head's
zero-centred norms loads fine and silently collapses acceptance.
"""

import engine  # noqa: F401  (loads the fast BLAS before mlx)

import importlib

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from engine.backends.base import Tape
from engine.checkpoint import load_weights, read_config
from tests.checkpoints import write
from tests.engine_helpers import assert_caches_close
from tests.floats import PATHS_ULPS, assert_close

FAMILIES = ["qwen3_next", "qwen3_5", "qwen3_5_moe"]
PROMPT = [7, 12, 30, 8, 41, 19, 23, 5, 11]
WINDOW = [14, 27, 9, 33]


def load(family, folder, weights=None):
    module = importlib.import_module(f"engine.backends.{family}")
    weights = load_weights(folder) if weights is None else weights
    return module.load(folder, read_config(folder), weights)


def tokens(ids):
    return mx.array([ids], dtype=mx.int32)


@pytest.fixture(scope="module", params=FAMILIES)
def family_folder(request, tmp_path_factory):
    folder = write(request.param, tmp_path_factory.mktemp(request.param), mtp_heads=2)
    return request.param, folder


@pytest.fixture(scope="module")
def backend(family_folder):
    return load(*family_folder)


def max_diff(a, b):
    """Only for comparisons that must be exact: the same operations on the same inputs
    give the same bits under any BLAS kernel."""
    return mx.abs(a - b).max().item()


def assert_caches_equal(got, want):
    """KV up to its offset, GatedDeltaNet conv window and recurrent state (shapes included)."""
    assert [getattr(c, "offset", None) for c in got] == [getattr(c, "offset", None) for c in want]
    assert_caches_close(got, want, PATHS_ULPS)


def one_by_one(backend, ids, cache):
    out = [backend.forward(tokens([t]), cache) for t in ids]
    return mx.concatenate([o[0] for o in out], axis=1), mx.concatenate([o[1] for o in out], axis=1)


# (a) loading ---------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("heads,sidecar", [(1, False), (2, True), (0, False)])
def test_loads_with_head_count(family, heads, sidecar, tmp_path):
    folder = write(family, tmp_path / family, mtp_heads=heads, sidecar=sidecar)
    config = read_config(folder)
    b = load(family, folder)
    assert b.family == family
    assert b.n_heads == heads
    assert b.vocab_size == config.get("text_config", config)["vocab_size"]
    assert len(b.make_head_caches()) == heads
    kinds = {type(c).__name__ for c in b.make_cache()}
    assert kinds == {"ArraysCache", "KVCache"}  # both layer kinds exist
    assert read_config(folder) == config  # mlx-lm's args did not rewrite the file's dict


@pytest.mark.parametrize("prefix", ["language_model.mtp.", "model.language_model.mtp."])
def test_qwen3_5_head_prefix_variants(prefix, tmp_path):
    folder = write("qwen3_5", tmp_path / "q", mtp_heads=1)
    plain = load("qwen3_5", folder)
    renamed = {
        (prefix + k[len("mtp."):] if k.startswith("mtp.") else k): v
        for k, v in load_weights(folder).items()
    }
    other = load("qwen3_5", folder, renamed)
    assert other.n_heads == 1
    hidden = mx.random.normal((1, 3, 32), key=mx.random.key(0))
    a, _ = plain.head(0, hidden, tokens([3, 4, 5]), KVCache())
    b, _ = other.head(0, hidden, tokens([3, 4, 5]), KVCache())
    assert max_diff(a, b) == 0.0


# (b) chunked prefill --------------------------------------------------------------


def test_chunked_prefill_matches_token_by_token(backend):
    logits, hidden = backend.forward(tokens(PROMPT), backend.make_cache())
    step_logits, step_hidden = one_by_one(backend, PROMPT, backend.make_cache())
    assert_close(logits, step_logits, PATHS_ULPS, "logits")
    assert_close(hidden, step_hidden, PATHS_ULPS, "hidden")
    # Not degenerate: the tiny model spreads its mass.
    assert mx.softmax(logits[0], axis=-1).max(axis=-1).mean().item() < 0.9


# (c) rollback equivalence -----------------------------------------------------------


@pytest.mark.parametrize("keep", range(len(WINDOW) + 1))
def test_rewind_matches_feeding_kept_tokens(backend, keep):
    cache = backend.make_cache()
    backend.forward(tokens(PROMPT), cache)
    tape = Tape()
    tape.length = len(WINDOW)
    backend.forward(tokens(WINDOW), cache, tape)
    recurrent = {i for i, c in enumerate(cache) if not isinstance(c, KVCache)}
    assert set(tape.recurrent) == recurrent  # every GatedDeltaNet layer is on the tape
    backend.rewind(cache, tape, keep)

    ref = backend.make_cache()
    one_by_one(backend, PROMPT + WINDOW[:keep], ref)
    assert_caches_equal(cache, ref)

    # And the rewound cache carries on like the reference.
    nxt = tokens([20])
    assert_close(backend.forward(nxt, cache)[0], backend.forward(nxt, ref)[0], PATHS_ULPS, "next logits")


# (d) the MTP head ----------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 1])
def test_head_batch_matches_position_by_position(backend, k):
    _, hidden = backend.forward(tokens(PROMPT), backend.make_cache())
    # Head k pairs hidden_t with token_{t+k+1}.
    h, nxt = hidden[:, : -(k + 1)], tokens(PROMPT[k + 1 :])
    batch_cache, step_cache = KVCache(), KVCache()
    logits, out = backend.head(k, h, nxt, batch_cache)
    steps = [backend.head(k, h[:, t : t + 1], nxt[:, t : t + 1], step_cache) for t in range(h.shape[1])]
    assert logits.shape == (1, h.shape[1], backend.vocab_size)
    assert out.shape == h.shape
    assert_close(logits, mx.concatenate([s[0] for s in steps], axis=1), PATHS_ULPS, "head logits")
    assert_close(out, mx.concatenate([s[1] for s in steps], axis=1), PATHS_ULPS, "head hidden")
    assert_caches_equal([batch_cache], [step_cache])


# (e) the norm shift ---------------------------------------------------------------------


def head_norms(head):
    return {
        "norm.weight": head.norm.weight,
        "pre_fc_norm_embedding.weight": head.pre_fc_norm_embedding.weight,
        "pre_fc_norm_hidden.weight": head.pre_fc_norm_hidden.weight,
        "input_layernorm.weight": head.input_layernorm.weight,
        "post_attention_layernorm.weight": head.post_attention_layernorm.weight,
        "self_attn.q_norm.weight": head.self_attn.q_norm.weight,
        "self_attn.k_norm.weight": head.self_attn.k_norm.weight,
    }


def stored_head_key(name, k):
    shared = name.startswith(("norm.", "pre_fc_norm"))
    return f"mtp.{name}" if shared else f"mtp.layers.{k}.{name}"


def test_norm_shift_applied_exactly_once(family_folder, backend):
    family, folder = family_folder
    stored = load_weights(folder)
    for k, head in enumerate(backend.heads):
        for name, value in head_norms(head).items():
            raw = stored[stored_head_key(name, k)]
            assert max_diff(value, raw + 1.0) == 0.0, f"head {k} {name}"
    # Trunk: zero-centred norms shifted by mlx-lm, the GDN gated norm never.
    text = backend.trunk.model
    root = "model." if family == "qwen3_next" else "model.language_model."
    assert max_diff(text.norm.weight, stored[f"{root}norm.weight"] + 1.0) == 0.0
    gdn = text.layers[0].linear_attn.norm.weight
    assert max_diff(gdn, stored[f"{root}layers.0.linear_attn.norm.weight"]) == 0.0


def test_head_norms_follow_an_unshifted_trunk(tmp_path):
    """A checkpoint already in MLX layout (conv1d [C, K, 1], norms shifted): mlx-lm
    leaves the trunk alone, so the head must not be shifted either."""
    folder = write("qwen3_5", tmp_path / "q", mtp_heads=1)
    weights = load_weights(folder)
    for key in list(weights):
        if key.endswith("conv1d.weight"):
            weights[key] = weights[key].moveaxis(2, 1)
    b = load("qwen3_5", folder, weights)
    assert max_diff(b.heads[0].norm.weight, weights["mtp.norm.weight"]) == 0.0
    stored_trunk_norm = weights["model.language_model.norm.weight"]
    assert max_diff(b.trunk.model.norm.weight, stored_trunk_norm) == 0.0
