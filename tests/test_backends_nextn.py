"""The MoE families with DeepSeek-style heads (enorm / hnorm / eh_proj over a block)
on tiny real-layout checkpoints: DeepSeek-V3, GLM-4.5, GLM-5 (appended layers),
Step-3.5 (appended layers, zero-centred norms), MiMo-V2-Flash (`model.mtp.layers`).

Loading (head count, sidecar, heads kept out of the trunk), prefill consistency,
rollback equivalence of every cache after a partial accept, the MTP head's batched
vs stepwise consistency; for the families whose trunk this engine runs with other
caches than mlx-lm's (sliding windows over plain caches, GLM-5's indexer keys beside
the latent), logits equal to mlx-lm's own model; greedy MTP equal to AR at every depth.
"""

import engine  # noqa: F401  (fast BLAS before mlx)

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
import pytest

from engine.backends import deepseek_v3, glm4_moe, glm_moe_dsa, hy_v3, mimo_v2_flash, step3p5
from engine.backends.base import Tape
from engine.backends.descriptors import DESCRIPTORS
from engine.checkpoint import load_weights, read_config
from tests.checkpoints import write
from tests.engine_helpers import assert_caches_close, assert_greedy_agree, greedy, load_family, run
from tests.floats import PATHS_ULPS, assert_close, excess

BACKENDS = {"deepseek_v3": deepseek_v3, "glm4_moe": glm4_moe, "glm_moe_dsa": glm_moe_dsa, "step3p5": step3p5,
            "mimo_v2_flash": mimo_v2_flash, "hy_v3": hy_v3}
FAMILIES = sorted(BACKENDS)
NEW = ["glm_moe_dsa", "mimo_v2_flash", "step3p5"]  # trunks mlx-lm builds with other caches
OWN_TRUNK = ["hy_v3"]  # trunks mlx-lm has no model for, written in their backend
APPENDED = {"deepseek_v3", "glm4_moe", "glm_moe_dsa", "step3p5", "hy_v3"}  # heads at model.layers.{N+i}
DENSE_HEADS = {"mimo_v2_flash", "step3p5"}  # as released; the others' heads are MoE
# The heads' copies of trunk tensors, where a family's checkpoints carry them.
COPIES = {"deepseek_v3": ("embed_tokens.", "shared_head.head."), "glm4_moe": ("embed_tokens.", "shared_head.head."),
          "step3p5": ("transformer.shared_head.output.",)}
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


def n_layers(folders, family):
    """The writers' num_hidden_layers: deliberately not the released models' (61, 78, 45...)."""
    return read_config(folders(family))["num_hidden_layers"]


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
def test_heads_are_not_trunk(folders, backends, family):
    backend = backends[family]
    layers = n_layers(folders, family)
    assert len(backend.trunk.model.layers) == layers
    assert len(backend.make_cache()) == layers
    # Strict loading of an unreleased depth succeeded; the trunk holds no head layer.
    names = [k for k, _ in tree_flatten(backend.trunk.parameters())]
    assert not any(k.startswith(f"model.layers.{layers}.") or ".mtp." in k for k in names)
    for head in backend.heads:
        if family in DENSE_HEADS:
            assert head.mlp.gate_proj.weight.shape[0] == read_config(folders(family))["intermediate_size"]
        else:  # at an index >= first_k_dense_replace: MoE with stacked experts
            assert head.mlp.switch_mlp.gate_proj.weight.shape[0] == 4


@pytest.mark.parametrize("family", sorted(COPIES))
def test_shared_copies_are_optional(folders, backends, family):
    """The nextn layers' copies of the embedding / output head are shared with the
    trunk: a checkpoint without them loads and drafts identically."""
    layers = n_layers(folders, family)
    copies = tuple(f"model.layers.{layers + i}.{name}" for i in range(2) for name in COPIES[family])
    assert any(k.startswith(copies) for k in load_weights(folders(family, heads=2)))
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


LONG = PROMPT + [40, 2, 15, 33, 9, 11, 27, 5, 36, 21]  # past the fixtures' windows and index_topk


def _reach(backend, family):
    """The attribute that makes the fixture's attention local or sparse, and its value."""
    if family == "mimo_v2_flash":
        return [(backend.trunk.model, "sliding_window_size")]
    if family == "step3p5":
        return [(backend.trunk.args, "sliding_window")]
    return [(layer.self_attn.indexer, "index_topk") for layer in backend.trunk.model.layers]


@pytest.mark.parametrize("family", NEW)
def test_trunk_equals_mlx_lm_model(backends, family, monkeypatch):
    """mlx-lm runs these trunks with rotating caches (sliding windows) or a second cache
    for the indexer's keys; the backend keeps one plain KVCache a layer. Same logits,
    over a prompt in one forward and one token at a time; and the window / top-k
    selection matters on this prompt (without it the logits differ)."""
    backend = backends[family]
    ids = tokens(LONG)
    assert len(LONG) > max(getattr(obj, name) for obj, name in _reach(backend, family))
    logits, _ = backend.forward(ids, backend.make_cache())
    assert_close(logits, backend.trunk(ids, backend.trunk.make_cache()), PATHS_ULPS, "prefill logits")
    theirs = backend.trunk.make_cache()
    step_theirs = mx.concatenate([backend.trunk(tokens([t]), theirs) for t in LONG], axis=1)
    step_mine, _ = stepwise(backend, LONG, backend.make_cache())
    assert_close(step_mine, step_theirs, PATHS_ULPS, "stepwise logits")
    for obj, name in _reach(backend, family):
        monkeypatch.setattr(obj, name, 10_000)
    unlimited, _ = backend.forward(ids, backend.make_cache())
    assert excess(unlimited, logits, PATHS_ULPS, "without the window / top-k") > 1


def test_index_selection_keeps_the_latest_of_exact_ties():
    scores = mx.array([[3.0, 0.0, 1.0, 0.0, 0.0, -1.0, 2.0]])
    assert glm_moe_dsa.select_top(scores, 4).tolist() == [[True, False, True, False, True, False, True]]
    assert glm_moe_dsa.select_top(scores, 5).tolist() == [[True, False, True, True, True, False, True]]
    assert glm_moe_dsa.select_top(scores, 7).tolist() == [[True] * 7]
    masked = mx.array([[2.0, -float("inf"), 1.0, -float("inf")]])  # fewer candidates than k
    assert glm_moe_dsa.select_top(masked, 3).tolist() == [[True, False, True, True]]


@pytest.mark.parametrize("family", [*NEW, *OWN_TRUNK])
def test_greedy_mtp_equals_ar_at_every_depth(tmp_path, family):
    """Every head the checkpoint has (three, as MiMo-V2-Flash and Step-3.5 ship), at
    every depth the family drafts, then beyond the heads (the last head reused)."""
    engine_ = load_family(tmp_path, family, mtp_heads=3)
    assert engine_.backend.n_heads == 3
    ar, _, _ = run(engine_, LONG, mode="ar", sampler=greedy(), max_tokens=40)
    for depth in range(1, DESCRIPTORS[family].depth_range[1] + 1):
        mtp, _, results = run(engine_, LONG, mode="mtp", depth=depth, sampler=greedy(), max_tokens=40)
        assert len(mtp) == len(ar) == 40
        assert max(r.drafted for r in results) == depth  # every head drafted, and then the last again
        assert_greedy_agree(engine_.backend, LONG, ar, mtp)


def test_step3p5_head_norms_get_their_one_once(folders, backends, tmp_path):
    """Step-3.5's norms are zero-centred: mlx-lm adds 1 to the trunk's (original layout), the
    backend to the heads' alike, every head norm included; a config recording that the
    shift was applied at conversion, over an original-layout trunk, is refused."""
    import json
    import shutil

    from engine.checkpoint import CONVERSION_KEY, CheckpointError

    folder = folders("step3p5", heads=2)
    stored = load_weights(folder)
    head = backends["step3p5"].heads[1]
    p = f"model.layers.{n_layers(folders, 'step3p5') + 1}."
    for name, value in tree_flatten(head.parameters()):
        if name.endswith("norm.weight"):
            assert max_diff(value, stored[p + name] + 1.0) == 0.0, name
    assert max_diff(head.eh_proj.weight, stored[p + "eh_proj.weight"]) == 0.0
    claimed = shutil.copytree(folder, tmp_path / "claimed")
    config = json.loads((claimed / "config.json").read_text())
    config[CONVERSION_KEY] = {"norm_shift_applied": True}
    (claimed / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="shifted"):
        load("step3p5", claimed)
