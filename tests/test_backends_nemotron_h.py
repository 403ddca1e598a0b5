"""Nemotron-H (hybrid Mamba2 / attention / MoE trunk, MTP heads of two layers) on its
tiny real-layout checkpoint.

What matters for exactness: chunked and token-by-token forwards agree; a verify
window rewound to any `keep` leaves every cache (attention KV, Mamba2 conv window and
SSM state) where feeding the kept tokens one by one would; in a batch, each row's
Mamba2 state replays its own kept prefix (mlx-lm's mixer, given the rows' mask,
does not: the negative control); the heads are position-consistent over their KV
cache, read both spellings of the MTP block types alike and survive conversion's
naming.
"""

import engine  # noqa: F401  (loads the fast BLAS before mlx)

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, KVCache

from engine.backends import nemotron_h
from engine.backends.base import Tape
from engine.checkpoint import CheckpointError, load_weights, read_config
from tests.checkpoints import write
from tests.engine_helpers import assert_caches_close, caches_excess
from tests.floats import PATHS_ULPS, assert_close

PROMPT = [7, 12, 30, 8, 41, 19, 23, 5, 11]
WINDOW = [14, 27, 9, 33]


def load(folder, weights=None, config=None):
    return nemotron_h.load(folder, config or read_config(folder), load_weights(folder) if weights is None else weights)


def tokens(ids):
    return mx.array([ids], dtype=mx.int32)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write("nemotron_h", tmp_path_factory.mktemp("nemotron_h"), mtp_heads=2)


@pytest.fixture(scope="module")
def backend(folder):
    return load(folder)


def one_by_one(backend, ids, cache):
    out = [backend.forward(tokens([t]), cache) for t in ids]
    return mx.concatenate([o[0] for o in out], axis=1), mx.concatenate([o[1] for o in out], axis=1)


def head_logits(backend, k=0):
    _, hidden = backend.forward(tokens(PROMPT), backend.make_cache())
    logits, _ = backend.head(k, hidden[:, :-1], tokens(PROMPT[1:]), KVCache())
    return logits


# (a) loading ---------------------------------------------------------------------------


@pytest.mark.parametrize("heads,sidecar", [(1, False), (2, True), (0, False)])
def test_loads_with_head_count(heads, sidecar, tmp_path):
    folder = write("nemotron_h", tmp_path / "n", mtp_heads=heads, sidecar=sidecar)
    config = read_config(folder)
    b = load(folder)
    assert (b.family, b.n_heads, b.vocab_size) == ("nemotron_h", heads, config["vocab_size"])
    assert len(b.make_head_caches()) == heads
    assert [type(c).__name__ for c in b.make_cache()] == ["ArraysCache", "KVCache", "ArraysCache"]  # M, *, M
    assert all(len(h.layers) == 2 for h in b.heads)  # attention, then MoE
    assert read_config(folder) == config  # mlx-lm's args did not rewrite the file's dict


def test_block_type_spellings_build_the_same_heads(backend, tmp_path):
    """The released list (`mtp_layers_block_type`), the older pattern string
    (`mtp_hybrid_override_pattern`), a pattern string in the list's field, and no field
    at all (transformers' default, attention then MoE) build one and the same head."""
    want = head_logits(backend)
    folder = write("nemotron_h", tmp_path / "p", mtp_heads=2, block_types="pattern")
    config = read_config(folder)
    assert config["mtp_hybrid_override_pattern"] == "*E" and "mtp_layers_block_type" not in config
    as_string = {**config, "mtp_layers_block_type": "*E"}
    del as_string["mtp_hybrid_override_pattern"]
    neither = {k: v for k, v in as_string.items() if k != "mtp_layers_block_type"}
    for variant in (config, as_string, neither):
        assert mx.array_equal(head_logits(load(folder, config=variant)), want).item()


def test_tagged_non_finite_floats_in_the_config(backend, folder):
    """transformers 5 and mlx-lm save time_step_limit's upper bound as {"__float__":
    "Infinity"} (a converted folder carries that); it is the same bound."""
    config = read_config(folder)
    assert config["time_step_limit"] == [0.0, float("inf")]
    tagged = {**config, "time_step_limit": [0.0, {"__float__": "Infinity"}]}
    assert mx.array_equal(head_logits(load(folder, config=tagged)), head_logits(backend)).item()


@pytest.mark.parametrize("blocks, why", [
    (["attention", "mamba"], "Mamba block"),
    (["moe"], "exactly one attention block"),
    ("**", "exactly one attention block"),
    (["attention", "conv2d"], "does not know"),
])
def test_head_blocks_this_engine_cannot_run_are_refused(folder, blocks, why):
    config = {**read_config(folder), "mtp_layers_block_type": blocks}
    with pytest.raises(CheckpointError, match=why):
        load(folder, config=config)


def test_layers_that_do_not_make_whole_heads_are_refused(folder):
    weights = {k: v for k, v in load_weights(folder).items() if not k.startswith("mtp.layers.3.")}
    with pytest.raises(CheckpointError, match="whole heads"):
        load(folder, weights=weights)


# (b) chunked prefill --------------------------------------------------------------------


def test_chunked_prefill_matches_token_by_token(backend):
    logits, hidden = backend.forward(tokens(PROMPT), backend.make_cache())
    step_logits, step_hidden = one_by_one(backend, PROMPT, backend.make_cache())
    assert_close(logits, step_logits, PATHS_ULPS, "logits")
    assert_close(hidden, step_hidden, PATHS_ULPS, "hidden")
    # Not degenerate: the tiny model spreads its mass.
    assert mx.softmax(logits[0], axis=-1).max(axis=-1).mean().item() < 0.9


# (c) rollback equivalence ---------------------------------------------------------------


def rewound(backend, keep, replay=True):
    cache = backend.make_cache()
    backend.forward(tokens(PROMPT), cache)
    tape = Tape()
    tape.length = len(WINDOW)
    backend.forward(tokens(WINDOW), cache, tape)
    assert set(tape.recurrent) == {i for i, c in enumerate(cache) if isinstance(c, ArraysCache)}
    if replay:
        backend.rewind(cache, tape, keep)
    else:  # broken: the state restored, the kept positions never replayed
        for i, c in enumerate(cache):
            if i in tape.recurrent:
                c.cache = list(tape.recurrent[i][0])
            else:
                c.trim(len(WINDOW) - keep)
    return cache


@pytest.mark.parametrize("keep", range(len(WINDOW) + 1))
def test_rewind_matches_feeding_kept_tokens(backend, keep):
    cache = rewound(backend, keep)
    ref = backend.make_cache()
    one_by_one(backend, PROMPT + WINDOW[:keep], ref)
    assert [getattr(c, "offset", None) for c in cache] == [getattr(c, "offset", None) for c in ref]
    assert_caches_close(cache, ref, PATHS_ULPS, "rewound cache")
    nxt = tokens([20])  # and the rewound cache carries on like the reference
    assert_close(backend.forward(nxt, cache)[0], backend.forward(nxt, ref)[0], PATHS_ULPS, "next logits")
    # Negative controls: one kept position too many, and a rewind that skips the replay.
    if keep < len(WINDOW):
        longer = backend.make_cache()
        one_by_one(backend, PROMPT + WINDOW[: keep + 1], longer)
        mamba = [i for i, c in enumerate(cache) if isinstance(c, ArraysCache)]
        pick = lambda caches: [caches[i] for i in mamba]  # noqa: E731  (same shapes: compare values)
        assert caches_excess(pick(cache), pick(longer), PATHS_ULPS, "Mamba2: a kept draft") > 1
    if keep > 0:
        assert caches_excess(rewound(backend, keep, replay=False), ref, PATHS_ULPS, "Mamba2: no replay") > 1


def _rows(backend, prompts):
    """Each prompt's trunk caches, built alone."""
    caches = []
    for prompt in prompts:
        cache = backend.make_cache()
        backend.forward(tokens(prompt), cache)
        mx.eval([c.state for c in cache])
        caches.append(cache)
    return caches


@pytest.mark.parametrize("keep", [[0, 2, 4], [1, 4, 3], [4, 4, 1]])
def test_rows_of_a_batch_replay_their_own_prefix(backend, keep):
    """engine/batch.py rewinds a batch's recurrent layers with one replay over every row,
    the cache's lengths saying how many positions each row keeps. Each row's conv window
    and SSM state must be its own replay's alone; mlx-lm's mixer, handed the same rows'
    mask, gets the SSM state wrong for every row that drops positions (negative control)."""
    prompts = [PROMPT, PROMPT[:4], PROMPT[3:] + PROMPT[:2]]
    d = backend.trunk.args.hidden_size
    x = mx.random.normal((len(prompts), len(WINDOW), d), key=mx.random.key(3))
    for layer, kind in enumerate(backend.make_cache()):
        if not isinstance(kind, ArraysCache):
            continue
        alone = []
        for i, cache in enumerate(_rows(backend, prompts)):
            if keep[i]:
                backend.replay(layer, x[i : i + 1, : keep[i]], cache[layer])
            alone.append(cache[layer])

        def batched(mixer_call):
            rows = ArraysCache.merge([cache[layer] for cache in _rows(backend, prompts)])
            rows.prepare(lengths=keep)
            mixer_call(rows)
            rows.finalize()
            return [rows.extract(i) for i in range(len(prompts))]

        got = batched(lambda rows: backend.replay(layer, x, rows))
        assert_caches_close(got, alone, PATHS_ULPS, f"layer {layer} rows")
        mixer = backend.trunk.layers[backend.cached_layers[layer]].mixer
        wrong = batched(lambda rows: mixer(x, rows.make_mask(x.shape[1]), rows))
        short = [i for i in range(len(prompts)) if keep[i] < len(WINDOW)]
        assert caches_excess([wrong[i] for i in short], [alone[i] for i in short], PATHS_ULPS,
                             "Mamba2 rows: mlx-lm's masked scan") > 1


# (d) the MTP heads ------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 1])
def test_head_batch_matches_position_by_position(backend, k):
    _, hidden = backend.forward(tokens(PROMPT), backend.make_cache())
    h, nxt = hidden[:, : -(k + 1)], tokens(PROMPT[k + 1 :])  # head k pairs hidden_t with token_{t+k+1}
    batch_cache, step_cache = KVCache(), KVCache()
    logits, out = backend.head(k, h, nxt, batch_cache)
    steps = [backend.head(k, h[:, t : t + 1], nxt[:, t : t + 1], step_cache) for t in range(h.shape[1])]
    assert logits.shape == (1, h.shape[1], backend.vocab_size) and out.shape == h.shape
    assert_close(logits, mx.concatenate([s[0] for s in steps], axis=1), PATHS_ULPS, "head logits")
    assert_close(out, mx.concatenate([s[1] for s in steps], axis=1), PATHS_ULPS, "head hidden")
    assert_caches_close([batch_cache], [step_cache], PATHS_ULPS)


def test_head_tensors_keep_the_checkpoint_names(folder, backend):
    """`mtplxd convert` stores the heads under `mtp.layers.{kP+j}.*` (experts stacked as
    the trunk stores its own); loading them back gives the same heads, bit for bit."""
    stored = load_weights(folder)
    exported = backend.head_tensors()
    per_expert = {k for k in stored if k.startswith("mtp.") and ".experts." in k}
    assert {k for k in stored if k.startswith("mtp.")} - per_expert == {k for k in exported if ".switch_mlp." not in k}
    assert {k.split(".mixer.")[0] for k in per_expert} == {k.split(".mixer.")[0] for k in exported
                                                           if ".switch_mlp." in k}
    trunk = {k: v for k, v in stored.items() if not k.startswith("mtp.")}
    again = load(folder, weights={**trunk, **exported})
    for before, after in zip(backend.heads, again.heads, strict=True):
        for (name, a), (_, b) in zip(tree_flatten(before.parameters()), tree_flatten(after.parameters()), strict=True):
            assert mx.array_equal(a, b).item(), name


def test_config_fields_are_the_released_ones(folder):
    config = json.loads((folder / "config.json").read_text())
    assert config["hybrid_override_pattern"] == "ME*M-E" and config["num_hidden_layers"] == 6
    assert config["mtp_layers_block_type"] == ["attention", "moe"] and config["num_nextn_predict_layers"] == 2
    keys = set(load_weights(folder))
    assert {"backbone.embeddings.weight", "backbone.norm_f.weight", "lm_head.weight",
            "backbone.layers.0.mixer.A_log", "backbone.layers.2.mixer.q_proj.weight",
            "mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
            "mtp.layers.1.final_layernorm.weight", "mtp.layers.3.mixer.gate.e_score_correction_bias"} <= keys
    assert not any(k.startswith(("mtp.layers.1.enorm", "mtp.layers.0.final_layernorm")) for k in keys)
    assert np.array(load_weights(folder)["backbone.layers.0.mixer.conv1d.weight"]).shape[1] == 1  # torch layout


# (e) through the engine -------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_greedy_mtp_equals_ar_at_every_depth(tmp_path, depth):
    """Depths 1 to the family's maximum over two heads (3 and 4 reuse the last one)."""
    from tests.engine_helpers import assert_greedy_agree, greedy, load_family, run

    engine_ = load_family(tmp_path, "nemotron_h", mtp_heads=2)
    ar, _, _ = run(engine_, PROMPT, mode="ar", sampler=greedy(), max_tokens=48)
    mtp, _, results = run(engine_, PROMPT, mode="mtp", depth=depth, sampler=greedy(), max_tokens=48)
    assert len(ar) == len(mtp) == 48 and sum(r.drafted for r in results) > 0
    assert_greedy_agree(engine_.backend, PROMPT, ar, mtp)
