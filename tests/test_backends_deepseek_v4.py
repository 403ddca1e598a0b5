"""DeepSeek-V4 (engine/backends/deepseek_v4.py) on a tiny checkpoint in the release's layout:
a window-only hash-routed layer, a ratio-4 layer (overlapping compressor, lightning
indexer), a ratio-128 layer, hyper-connection streams, MTP heads under `mtp.{i}`.

Loading (heads, sidecar, heads kept out of the trunk), prefill equal to one token at a
time past the 128-token block, compressed entries appearing exactly when their block
ends, the window and the indexer's choice mattering, every cache after a partial accept
equal to a one-by-one replay (windows across block ends), the heads batched vs stepwise,
greedy MTP equal to AR at every depth, batched rows across block ends, and the configs
and weight files the backend refuses.
"""

import engine  # noqa: F401  (fast BLAS before mlx)

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from safetensors.numpy import load_file, save_file

from engine.backends import deepseek_v4
from engine.backends.base import Tape
from engine.backends.descriptors import DESCRIPTORS, inspect_checkpoint
from engine.checkpoint import CheckpointError, load_weights, read_config
from engine.engine import Engine
from engine.sampling import SamplerSettings
from tests.checkpoints import write
from tests.checkpoints.deepseek_v4 import RATIOS, WINDOW
from tests.engine_helpers import assert_caches_close, assert_greedy_agree, greedy, load_family, run
from tests.floats import LONG_PATHS_ULPS, PATHS_ULPS, assert_close, excess

VOCAB_LOW, VOCAB_HIGH = 7, 59  # the fixture tokenizer's characters


def ids(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(VOCAB_LOW, VOCAB_HIGH, n)]


PROMPT = ids(0, 8)
LONG = ids(1, 140)  # past the ratio-128 layer's first block (positions 0..127)
DRAFTS = 4


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made = {}

    def get(heads=1, sidecar=False):
        key = (heads, sidecar)
        if key not in made:
            made[key] = write("deepseek_v4", tmp_path_factory.mktemp(f"dsv4_{heads}_{int(sidecar)}"),
                              mtp_heads=heads, sidecar=sidecar)
        return made[key]

    return get


def load(folder):
    return deepseek_v4.load(folder, read_config(folder), load_weights(folder))


@pytest.fixture(scope="module")
def backend(folders):
    return load(folders(heads=2))


def tokens(values):
    return mx.array([values], dtype=mx.int32)


def stepwise(backend, values, cache):
    outs = [backend.forward(tokens([t]), cache) for t in values]
    return mx.concatenate([o[0] for o in outs], axis=1), mx.concatenate([o[1] for o in outs], axis=1)


def max_diff(a, b):
    """Only for comparisons that must be exact: the same operations on the same inputs."""
    return float(mx.max(mx.abs(a - b)))


def assert_caches_equal(got, want):
    assert [c.offset for c in got] == [c.offset for c in want]
    assert_caches_close(got, want, PATHS_ULPS)


# -- loading --------------------------------------------------------------------------


@pytest.mark.parametrize("heads,sidecar", [(1, False), (2, False), (1, True), (2, True)])
def test_loads_heads(folders, heads, sidecar):
    folder = folders(heads, sidecar)
    assert (folder / "mtp.safetensors").exists() == sidecar
    b = load(folder)
    assert b.n_heads == heads and len(b.make_head_caches()) == heads
    assert b.vocab_size == read_config(folder)["vocab_size"]
    assert len(b.make_cache()) == len(b.trunk.layers) == len(RATIOS)
    names = [k for k, _ in tree_flatten(b.trunk.parameters())]
    assert not any(k.startswith("mtp.") for k in names)
    # the layer kinds as the config lays them out
    attn = [layer.attn for layer in b.trunk.layers]
    assert [a.ratio for a in attn] == list(RATIOS)
    assert ["indexer" in a for a in attn] == [r == 4 for r in RATIOS]
    assert ["tid2eid" in layer.ffn.gate for layer in b.trunk.layers] == [True, False, False]
    assert all(head.attn.ratio == 0 for head in b.heads)  # compress_ratios' trailing zeros
    assert b.trunk.layers[1].ffn.experts.gate_proj.weight.shape[0] == read_config(folder)["n_routed_experts"]


def test_without_heads_runs_ar_on_its_own_trunk(tmp_path):
    engine_ = load_family(tmp_path, "deepseek_v4", mtp_heads=0)
    assert engine_.backend.family == "deepseek_v4" and engine_.backend.n_heads == 0
    out, _, _ = run(engine_, PROMPT, mode="ar", sampler=greedy(), max_tokens=5)
    assert len(out) == 5


# -- the trunk --------------------------------------------------------------------------


def test_prefill_matches_stepwise(backend):
    logits, hidden = backend.forward(tokens(LONG), backend.make_cache())
    single, single_hidden = stepwise(backend, LONG, backend.make_cache())
    assert_close(logits, single, PATHS_ULPS, "logits")
    assert_close(hidden, single_hidden, PATHS_ULPS, "hidden")
    assert hidden.shape == (1, len(LONG), 4 * 32)  # the hc_mult streams, flattened
    probs = np.array(mx.softmax(logits[0], axis=-1))
    assert 0.05 < probs.max(axis=-1).mean() < 0.99  # a clear but not certain top token
    # negative control: one other token at position 100 moves the logits from there on
    other = LONG[:100] + [LONG[100] % 50 + 8] + LONG[101:]
    moved, _ = backend.forward(tokens(other), backend.make_cache())
    assert excess(moved[:, 100:], logits[:, 100:], PATHS_ULPS, "another token at one position") > 1
    assert max_diff(moved[:, :100], logits[:, :100]) == 0.0


@pytest.mark.parametrize("layer", [1, 2])
def test_compressed_entries_appear_when_their_block_ends(backend, layer):
    """Changing a layer's compressor changes nothing before its first block's last
    position (r - 1) and everything from there on: an entry is attended as soon as, and
    only once, its block has ended, in a prefill and one token at a time alike."""
    r = RATIOS[layer]
    logits, _ = backend.forward(tokens(LONG), backend.make_cache())
    compressor = backend.trunk.layers[layer].attn.compressor
    ape = compressor["ape"]
    compressor["ape"] = ape + 3.0 * mx.arange(r, dtype=mx.float32)[:, None]  # mlx modules are dicts
    try:
        changed, _ = backend.forward(tokens(LONG), backend.make_cache())
        steps, _ = stepwise(backend, LONG[: r + 2], backend.make_cache())
    finally:
        compressor["ape"] = ape
    assert max_diff(changed[:, : r - 1], logits[:, : r - 1]) == 0.0
    assert excess(changed[:, r - 1 :], logits[:, r - 1 :], PATHS_ULPS, "another compressor") > 1
    assert_close(steps, changed[:, : r + 2], PATHS_ULPS, "stepwise, another compressor")


def test_compressed_entries_sit_in_their_block_ends_column(backend):
    """The cache holds a compressed entry in the column of each block's last position
    and zeros elsewhere (a partly filled block has none)."""
    cache = backend.make_cache()
    backend.forward(tokens(LONG[:130]), cache)
    hd = backend.trunk.args.head_dim
    for layer in (1, 2):
        r = RATIOS[layer]
        entries = np.array(cache[layer].keys[0, 0, :130, hd : 2 * hd])
        ends = [(p + 1) % r == 0 for p in range(130)]
        assert all(np.abs(entries[p]).max() > 0 for p in range(130) if ends[p])
        assert all(np.abs(entries[p]).max() == 0 for p in range(130) if not ends[p])


@pytest.mark.parametrize("what", ["window", "index_topk"])
def test_window_and_index_choice_matter(backend, what, monkeypatch):
    """The sliding window and the indexer's top-k both cut what LONG's queries see:
    without them the logits differ."""
    logits, _ = backend.forward(tokens(LONG), backend.make_cache())
    assert len(LONG) > WINDOW
    for layer in backend.trunk.layers:
        if what == "window":
            monkeypatch.setattr(layer.attn, "window", 10_000)
        elif "indexer" in layer.attn:
            monkeypatch.setattr(layer.attn.indexer, "topk", 10_000)
    unlimited, _ = backend.forward(tokens(LONG), backend.make_cache())
    assert excess(unlimited, logits, PATHS_ULPS, f"without the {what}") > 1


def test_index_selection_ties_keep_the_latest():
    """The indexer's top-k is glm_moe_dsa.select_top: exact ties go to later entries."""
    scores = mx.array([[1.0, 2.0, 1.0, 1.0]])
    assert deepseek_v4.select_top(scores, 2).tolist() == [[False, True, False, True]]


# -- rollback ------------------------------------------------------------------------------


@pytest.mark.parametrize("start", [6, 125])  # windows across the ends of blocks 4 (7) and 128 (127)
@pytest.mark.parametrize("keep", range(DRAFTS + 1))
def test_rollback_equivalence(backend, start, keep):
    cache = backend.make_cache()
    backend.forward(tokens(LONG[:start]), cache)
    tape = Tape(length=DRAFTS)
    backend.forward(tokens(LONG[start : start + DRAFTS]), cache, tape)
    backend.rewind(cache, tape, keep)

    reference = backend.make_cache()
    stepwise(backend, LONG[: start + keep], reference)
    assert_caches_equal(cache, reference)
    nxt = tokens([LONG[start + DRAFTS]])
    assert_close(backend.forward(nxt, cache)[0], backend.forward(nxt, reference)[0], PATHS_ULPS, "next logits")


def test_rollback_negative_control(backend):
    """A cache that kept one rejected draft's position is caught by the comparison."""
    start, keep = 125, 2
    cache, reference = backend.make_cache(), backend.make_cache()
    backend.forward(tokens(LONG[:start]), cache)
    tape = Tape(length=DRAFTS)
    backend.forward(tokens(LONG[start : start + DRAFTS]), cache, tape)
    backend.rewind(cache, tape, keep + 1)
    stepwise(backend, LONG[: start + keep], reference)
    nxt = tokens([7])
    assert excess(backend.forward(nxt, cache)[0], backend.forward(nxt, reference)[0], PATHS_ULPS,
                  "kept a rejected draft") > 1


# -- heads ---------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 1])
def test_head_batched_matches_stepwise(backend, k):
    """Head k over all (streams_t, token_{t+1}) pairs at once equals one at a time,
    logits, output streams and its cache alike (past the head's window)."""
    values = LONG[:20]
    _, hidden = backend.forward(tokens(values), backend.make_cache())
    h_in, t_in = hidden[:, :-1], tokens(values[1:])
    batch_cache, step_cache = backend.make_head_caches()[k], backend.make_head_caches()[k]
    logits, h_out = backend.head(k, h_in, t_in, batch_cache)
    steps = [backend.head(k, h_in[:, i : i + 1], t_in[:, i : i + 1], step_cache) for i in range(h_in.shape[1])]
    assert_close(logits, mx.concatenate([s[0] for s in steps], axis=1), PATHS_ULPS, "head logits")
    assert_close(h_out, mx.concatenate([s[1] for s in steps], axis=1), PATHS_ULPS, "head hidden")
    assert_caches_equal([batch_cache], [step_cache])
    assert logits.shape == (1, len(values) - 1, backend.vocab_size) and h_out.shape == h_in.shape
    last, _ = backend.head(k, h_in, t_in, backend.make_head_caches()[k], last=True)
    assert max_diff(last, logits[:, -1:]) == 0.0
    # negative control: the head reads its streams (each position given its neighbour's)
    other, _ = backend.head(k, mx.roll(h_in, 1, axis=1), t_in, backend.make_head_caches()[k])
    assert excess(other, logits, PATHS_ULPS, "head on other streams") > 1


def test_head_cache_rewinds(backend):
    _, hidden = backend.forward(tokens(PROMPT), backend.make_cache())
    cache, reference = backend.make_head_caches()[0], backend.make_head_caches()[0]
    backend.head(0, hidden[:, :-1], tokens(PROMPT[1:]), cache)
    backend.rewind([cache], Tape(length=3), keep=1)
    backend.head(0, hidden[:, :-3], tokens(PROMPT[1:-2]), reference)
    assert_caches_equal([cache], [reference])


# -- through the engine ----------------------------------------------------------------------


def test_greedy_mtp_equals_ar_at_every_depth(tmp_path):
    """Every head (three), every depth, then beyond the heads (the last reused), over a
    generation that crosses the ratio-128 layer's first block end."""
    engine_ = load_family(tmp_path, "deepseek_v4", mtp_heads=3)
    prompt = ids(2, 110)
    ar, _, _ = run(engine_, prompt, mode="ar", sampler=greedy(), max_tokens=40)
    for depth in range(1, DESCRIPTORS["deepseek_v4"].depth_range[1] + 1):
        mtp, _, results = run(engine_, prompt, mode="mtp", depth=depth, sampler=greedy(), max_tokens=40)
        assert len(mtp) == len(ar) == 40
        assert max(r.drafted for r in results) == depth
        assert_greedy_agree(engine_.backend, prompt, ar, mtp)


def test_batched_rows_across_block_ends(tmp_path):
    """Rows of different lengths in one batch (left-padded caches, a position per row)
    crossing the ends of 4- and 128-blocks at different steps decode as they do alone."""
    from tests.test_batch import _batched, _solo

    engine_ = load_family(tmp_path, "deepseek_v4", mtp_heads=2)
    rows = [
        (ids(3, 120), greedy(), 0, 12, "mtp", 2, 0),
        (ids(4, 5), greedy(), 0, 10, "mtp", 2, 0),
        (ids(5, 123), SamplerSettings(temperature=0.8), 3, 10, "mtp", 2, 1),
        (ids(6, 126), greedy(), 0, 8, "ar", 0, 0),
        (ids(7, 9), greedy(), 0, 8, "ar", 0, 1),
    ]
    for row, gen in zip(rows, _batched(engine_, rows)):
        prompt, sampler = row[0], row[1]
        solo = _solo(engine_, *row)
        got, want = gen.tokens[len(prompt):], solo.tokens[len(prompt):]
        if sampler.greedy:
            assert_greedy_agree(engine_.backend, list(prompt), want, got)
        else:
            assert got == want
        if got == want:
            assert_caches_close(gen.cache, solo.cache, LONG_PATHS_ULPS, f"row of {len(prompt)}")


# -- what the backend refuses ------------------------------------------------------------------


@pytest.mark.parametrize("change, said", [
    ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
    ({"rope_scaling": {"type": "linear", "factor": 2}}, "rope_scaling type 'linear'"),
    ({"compress_ratios": None}, "compress_ratios=None"),
    ({"scoring_func": "tanh"}, "scoring_func='tanh'"),
])
def test_unimplemented_configs_are_refused(folders, tmp_path, change, said):
    import shutil

    folder = shutil.copytree(folders(), tmp_path / "changed")
    config = json.loads((folder / "config.json").read_text())
    config.update({k: v for k, v in change.items() if v is not None})
    for k in [k for k, v in change.items() if v is None]:
        del config[k]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="deepseek_v4: not implemented") as caught:
        Engine.load(folder)
    assert said in str(caught.value)
    report = inspect_checkpoint(folder)  # inspect says so before anything loads
    assert report.status == "unsupported" and "deepseek_v4: not implemented" in report.reason, report


def test_quantized_release_weights_are_refused(folders, tmp_path):
    """The release's FP8 / FP4 tensors carry per-block `*.scale` tensors: not dequantized
    here, so refused with why rather than loaded as garbage."""
    import shutil

    folder = shutil.copytree(folders(), tmp_path / "fp8")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["layers.1.attn.wq_b.scale"] = np.ones((1, 1), dtype=np.float32)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="FP8 / FP4"):
        load(folder)
    report = inspect_checkpoint(folder)
    assert report.status == "unsupported" and "FP8 / FP4" in report.reason and "wq_b.scale" in report.reason
