"""`python -m mtplxd.bench.acceptance`: the heads' acceptance on held-out code, through the
real engine on a tiny MiMo checkpoint with two heads."""

from __future__ import annotations

import json

import engine  # noqa: F401  (BLAS before mlx)
import pytest

from engine.training.corpus import held_out_files
from mtplxd.bench import acceptance
from tests.checkpoints import write


def test_line_prompts_end_at_line_breaks_of_held_out_code():
    prompts = acceptance.line_prompts(12, seed=3)
    assert len(prompts) == 12 and prompts == acceptance.line_prompts(12, seed=3)
    assert prompts != acceptance.line_prompts(12, seed=4)
    texts = [doc.text for doc in held_out_files()]
    for prompt in prompts:
        assert prompt.endswith("\n") and 0 < len(prompt) <= acceptance.CHARS
        assert any(prompt in text for text in texts)


def test_reports_both_sets_for_a_model_with_heads(tmp_path, capsys):
    folder = write("mimo", tmp_path / "mimo", mtp_heads=2)
    assert acceptance.main(["--model", str(folder), "--lines", "3", "--defs", "2", "--tokens", "8",
                            "--depth", "2"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["first_defs"]["prompts"] == 2 and found["line_breaks"]["prompts"] == 3
    for name in ("first_defs", "line_breaks"):
        by_depth = found[name]["acceptance_by_depth_t0"]
        assert len(by_depth) == 2 and all(0.0 <= a <= 1.0 for a in by_depth)


def test_a_model_without_heads_is_refused(tmp_path, capsys):
    folder = write("mimo", tmp_path / "plain", mtp_heads=0)
    with pytest.raises(SystemExit) as stopped:
        acceptance.main(["--model", str(folder), "--lines", "1"])
    assert stopped.value.code == 2 and "has no MTP heads" in capsys.readouterr().err
