"""Model management: `mtplxd convert` on every family's tiny checkpoint, loading
quantized checkpoints, the models folder (`models`, `rm`, `--model NAME`), and the
one-line errors of bad input. `mtplxd pull` is tested in test_pull.py."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import engine.conversion
import engine.engine
from engine import quantized_rows
from engine.backends.descriptors import inspect_checkpoint
from engine.checkpoint import CONVERSION_KEY, CheckpointError, read_header, weight_files
from engine.conversion import QuantSpec, convert_checkpoint
from engine.engine import Engine
from engine.head_export import HEADS_FILE
from engine.quantized_rows import RowsQuantizedEmbedding, RowsQuantizedLinear
from mtplxd.bench import model_folder
from mtplxd.cli import main
from mtplxd.config import ConfigError, load_settings
from mtplxd.store.models import RECORD_FILE, read_record, resolve_model
from tests.checkpoints import write
from tests.engine_helpers import assert_greedy_agree, available_families, greedy, run
from tests.floats import PATHS_ULPS, assert_close
from tests.test_engine import PROMPT

GROUP = 32  # the tiny checkpoints are 32 wide: the smallest group MLX accepts


def heads_for(family: str) -> int:
    return 2 if family == "mimo" else 1


def _header_keys(path: Path) -> dict[str, str]:
    return {k: v["dtype"] for k, v in read_header(path).items()}


def _head_params(engine_: Engine) -> list[dict[str, np.ndarray]]:
    return [{k: np.array(v) for k, v in tree_flatten(h.parameters())} for h in engine_.backend.heads]


def load_unpacked(folder: Path, monkeypatch) -> Engine:
    """Load on the CPU as where the decode kernel is not built: quantized layers unpacked."""
    with monkeypatch.context() as m:
        m.setattr(engine.engine, "keep_packed", lambda model: 0)
        return Engine.load(folder)


def load_as_on_metal(folder: Path, monkeypatch) -> Engine:
    """Load keeping the quantized layers as MLX's own, as on Metal."""
    with monkeypatch.context() as m:
        m.setattr(engine.engine, "default_dtype", lambda: None)
        return Engine.load(folder)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("family", available_families())
def test_convert_keeps_heads_in_float(tmp_path, monkeypatch, family, bits):
    src = write(family, tmp_path / "src", mtp_heads=heads_for(family))
    result = convert_checkpoint(src, tmp_path / "out", QuantSpec(bits, GROUP))
    out = result.out

    report = inspect_checkpoint(out)
    assert (report.status, report.mtp_heads) == ("supported", heads_for(family))
    # The trunk is quantized by mlx-lm; the head file holds float tensors only.
    trunk_keys = {k for f in weight_files(out) if f.name != HEADS_FILE for k in _header_keys(f)}
    assert any(k.endswith(".scales") for k in trunk_keys)
    head_keys = _header_keys(out / HEADS_FILE)
    assert head_keys and not any(k.endswith((".scales", ".biases")) for k in head_keys)
    assert set(head_keys.values()) <= {"F32", "F16", "BF16"}
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == bits
    assert config[CONVERSION_KEY]["mtp_heads"] == heads_for(family)

    original, converted = Engine.load(src), load_as_on_metal(out, monkeypatch)
    quantized = [m for _, m in converted.backend.trunk.named_modules() if hasattr(m, "scales")]
    assert quantized and all(m.bits == bits for m in quantized if m.group_size == GROUP)
    # Head weights survive exactly (for Qwen: the +1 norm shift applied once, not twice).
    for before, after in zip(_head_params(original), _head_params(converted), strict=True):
        assert before.keys() == after.keys()
        for name in before:
            np.testing.assert_array_equal(before[name], after[name], err_msg=name)
    # On the CPU the trunk keeps its packed weights for the decode kernel
    # (engine/quantized_rows.py), or is unpacked to float32 where the kernel is not
    # built: the same numbers either way, and the same as MLX's own quantized product.
    kept, unpacked = Engine.load(out), load_unpacked(out, monkeypatch)
    assert not any(hasattr(m, "scales") for _, m in unpacked.backend.trunk.named_modules())
    kept_layers = [m for _, m in kept.backend.trunk.named_modules() if hasattr(m, "scales")]
    if quantized_rows.native() is not None:
        assert kept_layers and all(isinstance(m, (RowsQuantizedLinear, RowsQuantizedEmbedding))
                                   for m in kept_layers if type(m).__name__ != "QuantizedSwitchLinear")
    tokens = mx.array([PROMPT])
    want = converted.backend.forward(tokens, converted.backend.make_cache())[0]
    for name, loaded in (("unpacked", unpacked), ("kept packed", kept)):
        assert_close(loaded.backend.forward(tokens, loaded.backend.make_cache())[0], want, PATHS_ULPS,
                     f"logits, {name}")

    ar, _, _ = run(kept, PROMPT, mode="ar", sampler=greedy(), max_tokens=24)
    mtp, _, results = run(kept, PROMPT, mode="mtp", depth=2, sampler=greedy(), max_tokens=24)
    assert sum(r.drafted for r in results) > 0
    assert_greedy_agree(kept.backend, PROMPT, ar, mtp)


def _head_linears(engine_: Engine) -> list:
    return [m for head in engine_.backend.heads for _, m in head.named_modules()
            if isinstance(m, (nn.Linear, nn.QuantizedLinear))]


@pytest.mark.skipif(quantized_rows.native() is None, reason="no decode kernel built (macOS: Metal's own kernels)")
def test_mimo_heads_are_packed_beside_a_packed_trunk(tmp_path):
    """On the CPU, MiMo heads beside a trunk kept packed are packed at 8 bits for the
    kernel: their drafts stay close to the stored heads', MTP stays exact, and training
    loads them as stored. A family whose heads read `.weight` directly keeps them."""
    src = write("mimo", tmp_path / "src", mtp_heads=2)
    out = convert_checkpoint(src, tmp_path / "out", QuantSpec(4, GROUP)).out
    packed, stored = Engine.load(out), Engine.load(out, trainable_heads=True)
    assert _head_linears(packed) and all(isinstance(m, RowsQuantizedLinear) and m.bits == quantized_rows.HEAD_BITS
                                         for m in _head_linears(packed))
    assert _head_linears(stored) and all(type(m) is nn.Linear for m in _head_linears(stored))

    tokens = mx.array([PROMPT])
    drafts = []
    for loaded in (packed, stored):
        _, hidden = loaded.backend.forward(tokens, loaded.backend.make_cache())
        logits, _ = loaded.backend.head(0, hidden[:, :-1], tokens[:, 1:], loaded.backend.make_head_caches()[0])
        drafts.append(np.array(logits[0], dtype=np.float64))
    # 8-bit rounding of each weight (a 255th of its group's range) moves the logits by a
    # small fraction of their spread, and seldom their argmax
    assert 0 < np.abs(drafts[0] - drafts[1]).max() <= 2**-5 * np.abs(drafts[1]).max()
    assert (drafts[0].argmax(-1) == drafts[1].argmax(-1)).mean() >= 0.75

    ar, _, _ = run(packed, PROMPT, mode="ar", sampler=greedy(), max_tokens=24)
    mtp, _, results = run(packed, PROMPT, mode="mtp", depth=2, sampler=greedy(), max_tokens=24)
    assert sum(r.drafted for r in results) > 0
    assert_greedy_agree(packed.backend, PROMPT, ar, mtp)

    other = convert_checkpoint(write("deepseek_v4", tmp_path / "v4"), tmp_path / "v4q", QuantSpec(4, GROUP)).out
    kept_float = _head_linears(Engine.load(other))
    assert kept_float and all(type(m) is nn.Linear for m in kept_float)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5_moe"])
def test_unquantized_conversion_computes_the_same_logits(tmp_path, family):
    src = write(family, tmp_path / "src", mtp_heads=1)
    out = convert_checkpoint(src, tmp_path / "out", QuantSpec(None, GROUP)).out
    tokens = mx.array([PROMPT])
    for folder in (src, out):
        backend = Engine.load(folder).backend
        logits, hidden = backend.forward(tokens, backend.make_cache())
        head_logits, _ = backend.head(0, hidden[:, :-1], tokens[:, 1:], backend.make_head_caches()[0])
        if folder == src:
            expected = (np.array(logits), np.array(head_logits))
    assert_close(logits, expected[0], PATHS_ULPS, "logits")
    assert_close(head_logits, expected[1], PATHS_ULPS, "head logits")


def test_a_recorded_norm_shift_is_never_applied_twice(tmp_path):
    # An original (HF-layout) Qwen checkpoint claiming its norms were already shifted:
    # mlx-lm shifts the trunk anyway, so trunk and head would carry +2. Refused.
    src = write("qwen3_5", tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config[CONVERSION_KEY] = {"norm_shift_applied": True}
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="applied twice|shifted the trunk again"):
        Engine.load(src)


# -- the command line: one line per bad input ------------------------------------------


def _one_line_error(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_convert_bad_input(tmp_path, capsys, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps({"model_type": "mimo"}))
    assert "no safetensors weight files" in _one_line_error(capsys, ["convert", str(empty), "--out", str(tmp_path / "a")])
    assert "not a directory" in _one_line_error(capsys, ["convert", str(tmp_path / "nope"), "--out", str(tmp_path / "a")])

    headless = write("mimo", tmp_path / "headless", mtp_heads=0)
    err = _one_line_error(capsys, ["convert", str(headless), "--out", str(tmp_path / "a")])
    assert "no MTP head" in err and "mtplxd train --heads-only" in err

    src = write("mimo", tmp_path / "src")
    monkeypatch.setattr(engine.conversion, "free_bytes", lambda path: 1000)
    err = _one_line_error(capsys, ["convert", str(src), "--out", str(tmp_path / "full")])
    assert "not enough disk space" in err
    assert not (tmp_path / "full").exists() and not list(tmp_path.glob(".full*"))
    monkeypatch.undo()

    assert main(["convert", str(src), "--out", str(tmp_path / "q"), "--group-size", "32"]) == 0
    capsys.readouterr()
    assert "already exists" in _one_line_error(capsys, ["convert", str(src), "--out", str(tmp_path / "q")])
    assert "already quantized" in _one_line_error(capsys, ["convert", str(tmp_path / "q"), "--out", str(tmp_path / "qq")])
    # (pull's other bad input is in test_pull.py; this one fails before any download)
    assert "not a valid repository id" in _one_line_error(capsys, ["pull", "not a repo!"])


def test_size_estimate_is_close_to_the_result(tmp_path):
    src = write("qwen3_5_moe", tmp_path / "src")
    for bits in (4, 8, None):
        spec = QuantSpec(bits, GROUP)
        config, report = engine.conversion.check_source(src)
        estimate = engine.conversion.estimate_output_bytes(src, config, report, spec)
        actual = convert_checkpoint(src, tmp_path / f"out{bits}", spec).size_bytes
        assert 0.8 * actual < estimate < 1.5 * actual, (bits, estimate, actual)


# -- the models folder -------------------------------------------------------------------


def test_models_list_resolve_and_rm(tmp_path, capsys, monkeypatch):
    state = tmp_path / "state"
    monkeypatch.setenv("MTPLXD_HOME", str(state))
    src = write("mimo", tmp_path / "src", mtp_heads=2)
    target = state / "models" / "tiny"
    assert main(["convert", str(src), "--out", str(target), "--quantize", "8", "--group-size", "32"]) == 0
    capsys.readouterr()
    record = read_record(target)
    assert record["source"] == str(src) and record["last_used"] is None
    record["source"] = "org/tiny-mimo"  # as `pull org/tiny-mimo` records it
    (target / RECORD_FILE).write_text(json.dumps(record))

    assert main(["models", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert (row["name"], row["family"], row["heads"], row["quantization"]) == ("tiny", "mimo", 2, "8-bit g32")
    assert row["size_bytes"] > 0 and row["last_used"] is None
    assert main(["models"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["NAME", "FAMILY", "HEADS"] and table[1].split()[:3] == ["tiny", "mimo", "2"]

    # --model: a path, a models-folder name or a pulled repository id.
    assert resolve_model(str(src), state) == src
    assert resolve_model("tiny", state) == target
    assert resolve_model("org/tiny-mimo", state) == target
    assert load_settings({"model": "tiny"}).model == target
    # the engine-level benches take the same (python -m mtplxd.bench.batch --model tiny)
    assert model_folder("tiny") == str(target)
    with pytest.raises(argparse.ArgumentTypeError, match="mtplxd pull org/other"):
        model_folder("org/other")
    with pytest.raises(ConfigError, match="mtplxd pull org/other") as e:
        load_settings({"model": "org/other"})
    assert len(str(e.value).splitlines()) == 1

    from mtplxd.daemon import load_model

    load_model(target)  # what the daemon runs: records the use
    assert read_record(target)["last_used"] is not None

    assert main(["rm", "tiny"]) == 0 and not target.exists()
    capsys.readouterr()
    assert "no model named 'tiny'" in _one_line_error(capsys, ["rm", "tiny"])
    assert "not a valid model name" in _one_line_error(capsys, ["rm", "../state"])
    assert state.exists()


def test_convert_copies_tokenizer_files_and_not_code(tmp_path):
    src = write("mimo", tmp_path / "src")
    (src / "modeling_mimo.py").write_text("raise SystemExit('remote code must never run')\n")
    (src / "generation_config.json").write_text("{}")
    out = convert_checkpoint(src, tmp_path / "out", QuantSpec(4, GROUP)).out
    names = {p.name for p in out.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json", HEADS_FILE} <= names
    assert "modeling_mimo.py" not in names
    shutil.rmtree(src)  # the converted folder stands alone
    assert Engine.load(out).tokenizer.encode("def f")
