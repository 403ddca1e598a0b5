"""Profiles and the measured depth choice (engine/profiles.py, stored by
engine/calibration_store.py), through the engine, `mtplxd bench` and the daemon."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import engine  # noqa: F401  (BLAS before mlx)
import httpx
import mlx.core as mx
import pytest
from openai import OpenAI

from engine import calibration_store
from engine.calibration_store import CalibrationStore
from engine.engine import Engine
from engine.profiles import MTP_MARGIN, PROFILES, Calibration, DecodePlanner, auto_profile, get_profile
from engine.sampling import SamplerSettings
from engine.speculative import compiled_sample, compiled_verify, sample, verify
from mtplxd.bench import cycle as bench_cycle
from mtplxd.bench import decode as bench
from mtplxd.calibrate import Calibrated, CalibrateJob, CalibrateRequest
from tests.checkpoints import write
from tests.daemon_fixture import running_daemon
from tests.engine_helpers import run

SUSTAINED, BURST, TURBO = PROFILES["sustained"], PROFILES["burst"], PROFILES["turbo"]


@pytest.fixture(scope="module")
def mimo_folder(tmp_path_factory):
    return write("mimo", tmp_path_factory.mktemp("profiles") / "mimo", mtp_heads=2)


# -- choosing ----------------------------------------------------------------------------


def test_choice_is_the_fastest_measured_depth_within_the_profile():
    cal = Calibration({"t0": {1: 1.2, 2: 1.5, 3: 1.7}, "t0.6": {1: 1.25, 2: 1.15, 3: 0.9}})
    assert cal.choose(TURBO, 0.0, n_heads=2).depth == 3  # turbo goes to depth 3
    assert cal.choose(SUSTAINED, 0.0, n_heads=2).depth == 2  # sustained stops at 2
    hot = cal.choose(BURST, 0.7, n_heads=2)  # nearest measured temperature: 0.6
    assert (hot.mode, hot.depth, hot.speedup, hot.source) == ("mtp", 1, 1.25, "measured")


def test_ar_is_chosen_when_no_depth_beats_it_clearly():
    cal = Calibration({"t0": {1: 0.97, 2: 0.8}, "t0.6": {1: 1.3}, })
    assert cal.choose(SUSTAINED, 0.0, n_heads=1).mode == "ar"
    assert cal.choose(SUSTAINED, 1.0, n_heads=1).mode == "mtp"
    # A near-tie is noise on a busy machine: AR, with the measured figure kept
    tie = Calibration({"t0": {1: MTP_MARGIN, 2: 1.04}}).choose(SUSTAINED, 0.0, n_heads=2)
    assert (tie.mode, tie.speedup, tie.source) == ("ar", MTP_MARGIN, "measured")
    assert Calibration({"t0": {1: MTP_MARGIN + 0.01}}).choose(SUSTAINED, 0.0, n_heads=2).mode == "mtp"


def test_without_a_measurement_the_profile_default_applies():
    assert Calibration().choose(BURST, 0.0, n_heads=2).source == "default"
    planner = DecodePlanner(BURST, n_heads=2)
    assert planner.plan(0.0).depth == BURST.default_depth and planner.plan(0.0).mode == "mtp"
    assert DecodePlanner(SUSTAINED, n_heads=0).plan(0.0).mode == "ar"  # no heads: always AR


def test_request_and_operator_choices_beat_the_measurement():
    cal = Calibration({"t0": {1: 0.5, 2: 0.6}})  # MTP loses: AR by default
    planner = DecodePlanner(SUSTAINED, n_heads=2, calibration=cal)
    assert planner.plan(0.0).mode == "ar"
    assert planner.plan(0.0, mode="mtp").mode == "mtp"  # the client asked for MTP
    assert planner.plan(0.0, depth=1).depth == 1 and planner.plan(0.0, depth=1).source == "request"
    assert planner.plan(0.0, profile="burst").prefill_chunk == BURST.prefill_chunk
    assert DecodePlanner(SUSTAINED, 2, cal, forced_depth=2).plan(0.0).mode == "mtp"  # --depth
    with pytest.raises(ValueError, match="unknown profile"):
        planner.plan(0.0, profile="warp")


def test_the_batch_size_decides_between_batched_mtp_and_plain_ar():
    # Measured: MTP pays in a batch of 2, not from 4 rows on (a compute-bound batch).
    cal = Calibration({"t0.6": {2: 1.3}}, batched={2: {2: 1.2}, 4: {2: 0.9}, 8: {2: 0.6}})
    planner = DecodePlanner(SUSTAINED, n_heads=2, calibration=cal)
    # 3 rows: as near 2 as 4; the larger measured size decides
    assert [planner.batch_depth(rows, 2) for rows in (1, 2, 3, 4, 6, 8, 16)] == [2, 2, 0, 0, 0, 0, 0]
    assert planner.batch_depth(8, 0) == 0  # AR rows stay AR
    assert DecodePlanner(SUSTAINED, 2).batch_depth(8, 2) == 2  # nothing measured: the plan stands
    assert DecodePlanner(SUSTAINED, 2, cal, forced_depth=2).batch_depth(8, 2) == 2  # --depth
    assert planner.describe()["batched_depth"] == {"1": 2, "2": 2, "4": 0, "8": 0}
    assert Calibration.from_json(cal.to_json()) == cal


def test_auto_profile_follows_the_model():
    assert auto_profile({"model_type": "mimo"}) is SUSTAINED
    assert auto_profile({"quantization": {"group_size": 64, "bits": 4}}) is TURBO
    assert get_profile("burst") is BURST


# -- the store ---------------------------------------------------------------------------


def test_store_is_per_model_private_and_survives_bad_files(tmp_path, mimo_folder):
    store = CalibrationStore(tmp_path / "state")
    assert store.get(mimo_folder) is None
    cal = Calibration({"t0": {1: 1.25}}, measured_at=1.0, detail="test")
    store.put(mimo_folder, cal)
    assert store.get(mimo_folder) == cal
    assert oct(store.path.stat().st_mode & 0o777) == "0o600"
    other = write("mimo", tmp_path / "other", mtp_heads=2, seed=5)  # other weights, same config
    assert store.get(other) is None
    store.path.write_text("{not json")
    assert store.get(mimo_folder) is None  # a broken file means "measure again", not a crash


def test_a_measurement_of_other_engine_code_is_measured_again(tmp_path, mimo_folder, monkeypatch):
    store = CalibrationStore(tmp_path / "state")
    store.put(mimo_folder, Calibration({"t0": {1: 1.25}}, measured_at=1.0, detail="old engine"))
    other_model = write("mimo", tmp_path / "other", mtp_heads=2, seed=5)
    store.put(other_model, Calibration({"t0": {1: 0.9}}, measured_at=1.0, detail="other model"))
    monkeypatch.setattr(calibration_store, "engine_id", lambda: "a-later-engine")
    assert store.get(mimo_folder) is None
    new = Calibration({"t0": {1: 1.5}}, measured_at=2.0, detail="new engine")
    store.put(mimo_folder, new)
    assert store.get(mimo_folder) == new
    kept = json.loads(store.path.read_text())
    assert len(kept) == 2  # the old engine's entry for this model is gone, the other model's stays
    assert store.get(other_model) is None  # measured by the old engine too


def test_engine_id_follows_the_engine_sources(tmp_path, monkeypatch):
    """The same sources give the same id wherever they lie; one changed line, another."""
    real = calibration_store.engine_id()
    source = Path(calibration_store.__file__).parent
    copy = tmp_path / "engine"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("__pycache__", "assets"))
    monkeypatch.setattr(calibration_store, "__file__", str(copy / "calibration_store.py"))
    calibration_store.engine_id.cache_clear()
    assert calibration_store.engine_id() == real
    shim = copy / "native" / "cblas_shim.c"
    shim.write_text(shim.read_text() + "\n/* a change */\n")
    calibration_store.engine_id.cache_clear()
    assert calibration_store.engine_id() != real
    monkeypatch.undo()
    calibration_store.engine_id.cache_clear()


# -- measured by the real bench ----------------------------------------------------------


def test_bench_report_becomes_a_calibration(mimo_folder):
    eng = Engine.load(mimo_folder)
    result = bench.bench(eng, ["def f(x):\n    return x\n"], [1, 2], rounds=1, max_tokens=6)
    cal = Calibration.from_bench(result, 0.0, "test")
    for key, t in (("t0", 0.0), ("t0.6", 0.6)):
        runs = [r for r in result["runs"] if r["temperature"] == t]
        ar = next(r["decode_tok_s"] for r in runs if r["mode"] == "ar")
        for r in (r for r in runs if r["mode"] == "mtp"):
            # float64 arithmetic; the calibration keeps ratios to three decimals
            assert cal.speedups[key][r["depth"]] == pytest.approx(r["decode_tok_s"] / ar, abs=1e-3)
    assert set(cal.speedups["t0"]) == {1, 2}


def test_bench_splits_each_token_between_the_graph_builder_and_the_workers(mimo_folder):
    eng = Engine.load(mimo_folder)
    result = bench.bench(eng, ["def f(x):\n    return x\n"], [1], rounds=1, max_tokens=12)
    for r in result["runs"]:
        ms = r["ms_per_token"]
        assert ms["wall"] > 0 and ms["worker_cpu"] > 0  # on the CPU, MLX's own thread does the math
        # One thread cannot use more CPU than the time that passed.
        assert 0 < ms["python_cpu"] <= ms["wall"] * 1.05 + 0.05
        assert ms["wall"] == pytest.approx(1e3 / r["decode_tok_s"], rel=0.5)


def test_cycle_parts_are_measured_on_a_real_checkpoint(mimo_folder):
    parts = bench_cycle.measure_parts(Engine.load(mimo_folder), context=24, repeats=3)
    assert all(ms > 0 for ms in parts.values())
    for b in bench_cycle.bounds(parts, target=1.8):  # every name the cycle model reads was measured
        assert b["cycle_ms"] > parts[f"forward_{b['depth'] + 1}"]


def test_cycle_model_adds_a_cycles_parts():
    parts = {"forward_1": 3.0, "forward_2": 3.5, "forward_3": 4.0, "forward_4": 4.5, "draft": 1.0,
             "draw_sampled": 0.4, "draw_greedy": 0.05}
    for k in (1, 2, 3):
        parts |= {f"filter_{k + 1}": 0.2 * (k + 1), f"verify_sampled_{k}": 0.3, f"verify_greedy_{k}": 0.1}
    by = {(b["temperature"], b["depth"]): b for b in bench_cycle.bounds(parts, target=1.8)}
    # float64 sums of these milliseconds, rounded by bounds() to 3 decimals (2 for the ratios)
    sampled = by[(0.6, 2)]  # window 4.0, two drafts 2 x 1.4, filter of 3 rows 0.6, verify 0.3
    assert sampled["cycle_ms"] == pytest.approx(7.7) and sampled["ar_token_ms"] == pytest.approx(3.4)
    assert sampled["best_speedup"] == pytest.approx(3 * 3.4 / 7.7, abs=0.01)
    assert sampled["tokens_per_cycle_for_target"] == pytest.approx(1.8 * 7.7 / 3.4, abs=0.01)
    greedy = by[(0.0, 1)]  # window 3.5, one draft 1.05, verify 0.1
    assert greedy["cycle_ms"] == pytest.approx(4.65) and greedy["ar_token_ms"] == pytest.approx(3.05)


def test_bench_command_stores_what_the_daemon_reads(tmp_path, mimo_folder):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MTPLXD_")}
    env["MTPLXD_STATE_DIR"] = str(tmp_path / "state")
    out = subprocess.run([str(Path(sys.executable).with_name("mtplxd")), "bench", "--model", str(mimo_folder),
                          "--prompts", "1", "--rounds", "1", "--max-tokens", "4", "--depths", "1",
                          "--json", str(tmp_path / "bench.json")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    stored = CalibrationStore(tmp_path / "state").get(mimo_folder)
    assert stored is not None and set(stored.speedups) == {"t0", "t0.6"}
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["profile"] == "sustained" and report["speedup"]["t0"] is not None



def test_each_calibration_round_decodes_its_own_prompt(mimo_folder):
    """One prompt's acceptance must not decide for every request: round r times AR and MTP
    on prompts[r % len(prompts)], both sides of a pair on the same one."""
    eng = Engine.load(mimo_folder)
    prompts = ((3, 4, 5, 6), (9, 8, 7), (20, 21))
    opened = []
    real_open = eng.open
    eng.open = lambda request: opened.append((request.prompt, request.mode)) or real_open(request)
    job = CalibrateJob(CalibrateRequest(prompts, depths=(1,), batch_sizes=(), max_tokens=3, rounds=4), eng)
    while not job.finished:
        events = job.step()
    assert isinstance(events[0], Calibrated) and "3 prompts, 4 rounds" in events[0].calibration.detail
    assert set(events[0].calibration.speedups) == {"t0", "t0.6"}
    # 4 rounds x 2 temperatures x (AR, MTP)
    assert [prompt for prompt, _ in opened] == [prompts[r % 3] for r in range(4) for _ in range(4)]
    assert [mode for _, mode in opened] == ["ar", "mtp"] * 8

# -- compiled sampling and verification --------------------------------------------------


def test_compiled_verify_matches_the_eager_sampler():
    for seed in range(20):
        mx.random.seed(seed)
        p = mx.softmax(mx.random.normal((1, 3, 11)) * 2, axis=-1)
        q = mx.softmax(mx.random.normal((1, 2, 11)) * 2, axis=-1)
        drafts = mx.random.randint(0, 11, (1, 2))
        key = mx.random.key(seed)
        a, b = verify(p, q, drafts, key), compiled_verify(p, q, drafts, key)
        assert a[0].item() == b[0].item() and a[1].item() == b[1].item()
        drawn = [sample(p[0], k) for k in mx.random.split(key, 8)]
        assert mx.array_equal(mx.stack(drawn), mx.stack([compiled_sample(p[0], k) for k in mx.random.split(key, 8)]))


def test_compiled_generation_equals_eager(mimo_folder):
    eng = Engine.load(mimo_folder)
    hot = SamplerSettings(temperature=0.8, top_p=0.9)
    for sampler in (SamplerSettings(temperature=0.0), hot):
        eager, _, _ = run(eng, [3, 4, 5], sampler=sampler, depth=2, max_tokens=24, seed=7, compiled=False)
        fused, _, _ = run(eng, [3, 4, 5], sampler=sampler, depth=2, max_tokens=24, seed=7)
        assert fused == eager


def test_one_compiled_filter_serves_every_temperature_and_top_p():
    """The numbers go into the compiled filters as an array: a new temperature or
    top-p reuses the trace (a number traced in would mean new kernels, and a C++
    compile, per value), and gives exactly the eager probabilities."""
    from engine import sampling

    sampling.compiled_probabilities.cache_clear()
    sampling._compiled_filters.cache_clear()
    logits = mx.random.normal((3, 64), key=mx.random.key(4)) * 3
    for temperature, top_p in ((0.6, 0.95), (0.7, 0.9), (1.3, 0.5)):
        settings = SamplerSettings(temperature=temperature, top_p=top_p)
        compiled, covered = sampling.compiled_probabilities(settings)(logits)
        assert covered.item()
        assert mx.array_equal(compiled, sampling.probabilities(logits, settings))
    assert sampling._compiled_filters.cache_info().misses == 1


# -- through the daemon ------------------------------------------------------------------


def test_daemon_decodes_with_the_measured_choice(tmp_path, mimo_folder):
    state = tmp_path / "state"
    # A measurement in which MTP loses at T=0 and wins at T=0.6 (depth 1).
    CalibrationStore(state).put(mimo_folder, Calibration({"t0": {1: 0.8, 2: 0.9}, "t0.6": {1: 1.4, 2: 1.2}}))
    with running_daemon(state, mimo_folder) as daemon:
        client = OpenAI(base_url=f"{daemon.base_url}/v1", api_key="unused")
        health = httpx.get(f"{daemon.base_url}/health").json()
        assert health["decoding"]["profile"] == "sustained" and health["decoding"]["t0"]["mode"] == "ar"
        cold = client.completions.create(model="default", prompt="abc", max_tokens=8, temperature=0)
        assert cold.model_extra["mtp"]["depth"] == 0  # AR: MTP measured slower here
        hot = client.completions.create(model="default", prompt="abc", max_tokens=8, temperature=0.6)
        assert hot.model_extra["mtp"]["depth"] == 1
        asked = client.completions.create(model="default", prompt="abc", max_tokens=8, temperature=0,
                                          extra_body={"generation_mode": "mtp"})
        assert asked.model_extra["mtp"]["depth"] == 2  # sustained's default depth for a forced MTP
        assert asked.choices[0].text == cold.choices[0].text  # exact: same greedy text either way
        turbo = client.completions.create(model="default", prompt="abc", max_tokens=8, temperature=0.6,
                                          extra_body={"profile": "turbo"})
        assert turbo.model_extra["mtp"]["depth"] == 1  # measured best, turbo may go deeper but 1 won
        with pytest.raises(Exception) as bad:
            client.completions.create(model="default", prompt="abc", max_tokens=4, extra_body={"profile": "warp"})
        assert getattr(bad.value, "status_code", None) == 400 and "profile" in str(bad.value)


def test_start_refuses_an_unknown_profile(tmp_path, mimo_folder):
    out = subprocess.run([str(Path(sys.executable).with_name("mtplxd")), "start", "--model", str(mimo_folder),
                          "--state-dir", str(tmp_path / "s"), "--profile", "warp"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "warp" in out.stderr


def test_daemon_calibrates_in_the_background_once(tmp_path, mimo_folder):
    state = tmp_path / "state"
    env = {"MTPLXD_CALIBRATE_TOKENS": "4"}
    with running_daemon(state, mimo_folder, env=env) as daemon:
        client = OpenAI(base_url=f"{daemon.base_url}/v1", api_key="unused")
        # Requests are served while the calibration runs at background priority.
        assert client.completions.create(model="default", prompt="abc", max_tokens=4).usage.completion_tokens > 0
        deadline = time.monotonic() + 120
        while not httpx.get(f"{daemon.base_url}/health").json()["decoding"]["calibrated"]:
            assert time.monotonic() < deadline, "the calibration never finished"
            time.sleep(0.2)
    stored = CalibrationStore(state).get(mimo_folder)
    assert stored is not None and set(stored.speedups) == {"t0", "t0.6"}
    assert set(stored.speedups["t0"]) == {1, 2, 3} and all(s > 0 for s in stored.speedups["t0"].values())
    assert set(stored.batched) == {2, 4, 8} and all(set(by) == {1, 2, 3} for by in stored.batched.values())
    assert all(s > 0 for by in stored.batched.values() for s in by.values())
    # A restart reads it instead of measuring again.
    with running_daemon(state, mimo_folder, env=env) as daemon:
        assert httpx.get(f"{daemon.base_url}/health").json()["decoding"]["calibrated"]
    assert CalibrationStore(state).get(mimo_folder) == stored
