"""Heads-only training of a checkpoint's OWN heads for the MTP families other than
MiMo (`mtplxd train --heads-only --replace-heads`, engine/training/heads.py): the
heads distil towards the frozen trunk, go back under the family's own key names,
and the output folder loads with them. Tiny fixtures, a few steps each: seconds."""

from __future__ import annotations

import random
from pathlib import Path

import engine  # noqa: F401  (BLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from engine.backends.descriptors import head_key_predicate, inspect_checkpoint
from engine.checkpoint import CheckpointError, read_config, text_config, weight_keys
from engine.engine import Engine
from engine.head_export import HEADS_FILE
from engine.train import HeadsSettings, train_heads
from engine.training.heads import FamilyHeads, evaluate_heads
from engine.training.model import distill_loss, log_softmax
from tests.checkpoints import write
from tests.floats import FEW_OPS_ULPS, assert_close

STEPS = dict(seq_len=32, batch=4, lr=3e-3, save_every=1000, eval_windows=0, compile=False, progress=False)
# One appended-layer family, one under `model.mtp.layers` / `mtp.layers` (heads of two
# checkpoint layers each), one Qwen (shared fc and norms, zero-centred norms).
TRAINED = ["deepseek_v3", "nemotron_h", "qwen3_5"]
# Every family with its own heads that the engine ran when this was written (a family
# added since joins once its heads are known to train: scripts/family_bench.py tries all).
FAMILY_ONLY = ["deepseek_v3", "glm4_moe", "glm_moe_dsa", "hy_v3", "mimo_v2_flash", "nemotron_h", "qwen3_5",
               "qwen3_5_moe", "qwen3_next", "step3p5"]


def python_like(seed: int) -> str:
    """Predictable text over the fixtures' character tokenizer."""
    rng = random.Random(seed)
    return "".join(f"def add_{n}(x):\n    return x + {n}\n\n" for n in (rng.randint(0, 9) for _ in range(30)))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("corpus")
    for i in range(4):
        (folder / f"mod{i}.py").write_text(python_like(i))
    return folder


def windows(eng: Engine, n: int = 4, length: int = 33) -> mx.array:
    ids = list(eng.tokenizer.encode(python_like(99)))
    return mx.array([ids[i * length : (i + 1) * length] for i in range(n)])


def distillation(eng: Engine, folder: Path, x: mx.array) -> tuple[float, dict]:
    """The training loss of the folder's heads on x, and their agreement with the trunk."""
    model = FamilyHeads(eng.backend, inspect_checkpoint(folder), folder)
    logits, h = model.trunk_forward(x[:, :-1])
    total, _ = distill_loss(model, x, h, log_softmax(logits), (1.0,) * model.n_heads)
    return total.item(), evaluate_heads(model, x)


def head_parameters(eng: Engine) -> dict[str, np.ndarray]:
    return {f"{k}.{name}": np.array(v) for k, head in enumerate(eng.backend.heads)
            for name, v in tree_flatten(head.parameters())}


@pytest.mark.parametrize("family", TRAINED)
def test_training_a_familys_own_heads(family, corpus, tmp_path):
    src = write(family, tmp_path / "src", mtp_heads=2)
    out = tmp_path / "out"
    train_heads(HeadsSettings(model=str(src), out=str(out), corpus=str(corpus), steps=40, replace_heads=True, **STEPS))

    before, trained = Engine.load(src), Engine.load(out)
    report = inspect_checkpoint(out)
    assert (report.family, report.status, report.mtp_heads) == (family, "supported", 2)
    assert (out / "config.json").read_bytes() == (src / "config.json").read_bytes()
    trunk_keys = {k for k, f in weight_keys(out).items() if f.name != HEADS_FILE}
    assert trunk_keys == set(weight_keys(src)) - set(_head_keys(src))
    x = windows(before)
    assert mx.array_equal(trained.backend.forward(x, trained.backend.make_cache())[0],
                          before.backend.forward(x, before.backend.make_cache())[0]).item()

    old_loss, old_agree = distillation(before, src, x)
    new_loss, new_agree = distillation(trained, out, x)
    print(f"{family}: distillation loss {old_loss:.3f} -> {new_loss:.3f}, agreement {old_agree} -> {new_agree}")
    assert new_loss < 0.5 * old_loss
    assert new_agree["head1_agree"] > old_agree["head1_agree"] + 0.1
    old, new = head_parameters(before), head_parameters(trained)
    assert old.keys() == new.keys()
    assert any(not np.allclose(old[k], new[k], atol=1e-4) for k in old)


def _head_keys(folder: Path) -> list[str]:
    config = text_config(read_config(folder))
    is_head = head_key_predicate(inspect_checkpoint(folder).descriptor, config["num_hidden_layers"])
    return [k for k in weight_keys(folder) if is_head(k)]


@pytest.mark.parametrize("family", FAMILY_ONLY)
def test_heads_go_back_in_the_sources_layout(family, corpus, tmp_path):
    """One step at a learning rate of 1e-9 leaves the heads as they were: loading the
    output must give the source's heads again (names, expert stacking, the Qwen /
    Step-3.5 norm shift applied exactly once), at the source's dtype."""
    src = write(family, tmp_path / "src", mtp_heads=2)
    out = tmp_path / "out"
    train_heads(HeadsSettings(model=str(src), out=str(out), corpus=str(corpus), steps=1, replace_heads=True,
                              **{**STEPS, "lr": 1e-9}))
    old, new = head_parameters(Engine.load(src)), head_parameters(Engine.load(out))
    assert old.keys() == new.keys()
    for k in old:
        assert_close(new[k], old[k], FEW_OPS_ULPS, "heads", where=k)


def test_the_cli_trains_a_familys_heads(corpus, tmp_path, capsys):
    from mtplxd.cli import main

    src = write("mimo_v2_flash", tmp_path / "src", mtp_heads=1)
    out = tmp_path / "out"
    args = ["train", "--heads-only", "--model", str(src), "--out", str(out), "--corpus", str(corpus),
            "--steps", "2", "--seq-len", "32", "--batch", "2", "--no-compile"]
    assert main(args) == 1
    assert "already has 1 MTP head(s) (--replace-heads distils them further)" in capsys.readouterr().err
    assert main(args + ["--replace-heads", "--heads", "2"]) == 1
    assert "cannot add or drop heads" in capsys.readouterr().err
    assert main(args + ["--replace-heads"]) == 0
    report = inspect_checkpoint(out)
    assert (report.family, report.mtp_heads) == ("mimo_v2_flash", 1)


def test_new_heads_for_a_family_without_any_are_refused(corpus, tmp_path):
    src = write("qwen3_next", tmp_path / "src", mtp_heads=0)
    with pytest.raises(CheckpointError, match="new heads are MiMo-style.*--replace-heads"):
        train_heads(HeadsSettings(model=str(src), out=str(tmp_path / "out"), corpus=str(corpus), steps=1, **STEPS))
