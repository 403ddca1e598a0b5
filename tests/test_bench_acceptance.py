"""`python -m mtplxd.bench.acceptance`: the heads' acceptance on held-out code, through the
real engine on a tiny MiMo checkpoint with two heads."""

from __future__ import annotations

import json

import engine  # noqa: F401  (BLAS before mlx)
import numpy as np
import pytest

from engine.training.corpus import held_out_files
from engine.training.measure import AcceptanceCounts, paired_difference
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
        drafts, errors = found[name]["drafts_by_depth"], found[name]["standard_error_by_depth"]
        assert len(drafts) == len(errors) == 2 and drafts[0] >= drafts[1] and drafts[0] > 0
        assert all(e >= 0.0 for e in errors)


def _clustered(rng, prompts: int, drafts: int) -> AcceptanceCounts:
    """Prompts whose own acceptance differs (drawn around 0.6), each with `drafts` draws."""
    rates = rng.beta(6, 4, size=prompts)
    reached = np.full((prompts, 1), drafts)
    return AcceptanceCounts(reached, rng.binomial(drafts, rates)[:, None])


def test_the_standard_error_is_how_far_another_set_of_prompts_lands():
    """Many sets of 8 prompts, each prompt with its own acceptance: the spread of the
    sets' rates is what the error across prompts says, where a binomial error over the
    drafts (the negative control) says about a third of it."""
    rng = np.random.default_rng(7)
    sets = [_clustered(rng, 8, 80) for _ in range(2000)]
    spread = np.std([s.rates()[0] for s in sets])
    across = np.mean([s.standard_errors()[0] for s in sets])
    binomial = np.mean([np.sqrt(r * (1 - r) / 640) for r in (s.rates()[0] for s in sets)])
    assert across == pytest.approx(spread, rel=0.12)
    assert binomial < 0.6 * spread


def test_a_paired_difference_tells_apart_what_the_errors_alone_cannot():
    """Two sets of heads on the same 8 prompts, the second 0.03 better on each: the paired
    error is the spread of the sets' differences, several times below what the two
    errors taken side by side say (the control)."""
    rng = np.random.default_rng(3)
    differences, errors, side_by_side = [], [], []
    for _ in range(2000):
        rates = rng.beta(6, 4, size=8)
        reached = np.full((8, 1), 80)
        a = AcceptanceCounts(reached, rng.binomial(80, np.minimum(rates + 0.03, 1))[:, None])
        b = AcceptanceCounts(reached, rng.binomial(80, rates)[:, None])
        (difference, error), = paired_difference(a, b)
        differences.append(difference)
        errors.append(error)
        side_by_side.append(np.hypot(a.standard_errors()[0], b.standard_errors()[0]))
    assert np.mean(differences) == pytest.approx(0.03, abs=0.002)
    assert np.mean(errors) == pytest.approx(np.std(differences), rel=0.12)
    assert np.mean(side_by_side) > 2.5 * np.std(differences)
    with pytest.raises(ValueError):
        paired_difference(a, AcceptanceCounts(np.ones((7, 1), int), np.ones((7, 1), int)))


def test_the_standard_error_of_equal_prompts_is_zero_and_a_lone_prompt_has_none():
    same = AcceptanceCounts(np.array([[10, 6], [20, 12]]), np.array([[6, 3], [12, 6]]))
    assert same.rates() == [0.6, 0.5] and same.standard_errors() == [0.0, 0.0]
    assert AcceptanceCounts(np.array([[10]]), np.array([[4]])).standard_errors() == [0.0]
    unreached = AcceptanceCounts(np.array([[10, 0], [8, 0]]), np.array([[0, 0], [8, 0]]))
    assert unreached.rates() == [8 / 18, 0.0] and unreached.standard_errors()[0] > 0.3


def test_a_model_against_itself_differs_by_nothing(tmp_path, capsys):
    folder = write("mimo", tmp_path / "mimo", mtp_heads=2)
    assert acceptance.main(["--model", str(folder), "--against", str(folder), "--lines", "3", "--defs", "2",
                            "--tokens", "8"]) == 0
    found = json.loads(capsys.readouterr().out)
    for name in ("first_defs", "line_breaks"):
        against = found[name]["against"]
        assert against["acceptance_by_depth_t0"] == found[name]["acceptance_by_depth_t0"]
        assert against["difference_by_depth"] == [0.0] and against["difference_error_by_depth"] == [0.0]


def test_a_model_without_heads_is_refused(tmp_path, capsys):
    folder = write("mimo", tmp_path / "plain", mtp_heads=0)
    with pytest.raises(SystemExit) as stopped:
        acceptance.main(["--model", str(folder), "--lines", "1"])
    assert stopped.value.code == 2 and "has no MTP heads" in capsys.readouterr().err
