"""The GGUF commands through the real CLI, on tiny GGUF files (tests/gguf_fixtures.py):
`mtplxd pull FILE.gguf`, `pull OWNER/REPO --file NAME.gguf`, `convert FILE.gguf`,
`inspect FILE.gguf`, the shipped MTP heads an import attaches, and the default model.

Local pulls, convert and inspect run in-process through `mtplxd.cli.main`, as
tests/test_models.py runs them, so that `engine.shipped_heads.HEADS_DIR` can point at a
tmp folder of shipped heads (monkeypatch). A pull from the Hub runs in a subprocess
(tests/test_pull.py's `pull`): huggingface_hub reads HF_ENDPOINT when it is imported.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import engine  # noqa: F401  (BLAS before mlx)
import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

import engine.shipped_heads
from engine.backends.descriptors import inspect_checkpoint
from engine.engine import Engine
from engine.gguf_import import import_gguf
from engine.head_export import HEADS_FILE
from mtplxd.cli import main
from mtplxd.config import DEFAULT_MODEL, Settings, embedded_model_dir
from mtplxd.store.models import RECORD_FILE, read_record
from tests.engine_helpers import assert_greedy_agree, greedy, run
from tests.fake_hub import FakeHub
from tests.gguf_fixtures import TYPES, tiny_model, write_gguf
from tests.test_pull import one_line_error, pull as pull_subprocess

PROMPT = [5, 77, 140, 9, 230, 31, 64, 200]
# What the tiny llama file's metadata says (tests/gguf_fixtures.py hf_config).
MATCH = {"general.architecture": "llama", "llama.block_count": 2}
N_HEADS = 2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """tiny.gguf (llama) and the bad files made from it."""
    root = tmp_path_factory.mktemp("gguf")
    model = tiny_model("llama")
    tiny = root / "tiny.gguf"
    write_gguf(tiny, model, TYPES["llama"])
    data = tiny.read_bytes()
    out = {"tiny": tiny}
    out["truncated"] = root / "truncated.gguf"
    out["truncated"].write_bytes(data[:-100])
    out["magic"] = root / "magic.gguf"
    out["magic"].write_bytes(b"GGML" + data[4:])
    out["arch"] = root / "arch.gguf"
    write_gguf(out["arch"], model, TYPES["llama"], {"general.architecture": "mamba"})
    return out


@pytest.fixture(scope="module")
def trunk(files, tmp_path_factory) -> Path:
    """tiny.gguf imported without heads: the trunk the fake shipped heads are made for."""
    return import_gguf(files["tiny"], tmp_path_factory.mktemp("trunk") / "tiny", heads=False).out


def make_heads(trunk: Path, out: Path, seed: int) -> Path:
    """A shipped-heads folder for the tiny trunk: heads.json matching its metadata and
    N_HEADS random MiMo MTP layers (engine.backends.mimo.MTPLayer) in mtp.safetensors."""
    from mlx_lm.models import mimo

    from engine.backends.mimo import HEAD_PREFIX, MTPLayer
    from engine.checkpoint import read_config, weight_keys
    from engine.training.heads import mimo_config

    config, _ = mimo_config(read_config(trunk), set(weight_keys(trunk)), N_HEADS)
    args = mimo.ModelArgs.from_dict(config)
    mx.random.seed(seed)
    weights = {}
    for i in range(N_HEADS):
        layer = MTPLayer(args)
        weights.update({f"{HEAD_PREFIX}{i}.{k}": v for k, v in tree_flatten(layer.parameters())})
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / HEADS_FILE), weights)
    (out / "heads.json").write_text(json.dumps({"match": MATCH, "heads": N_HEADS}))
    return out


@pytest.fixture
def heads_dir(tmp_path, monkeypatch) -> Path:
    """engine.shipped_heads.HEADS_DIR pointed at an empty tmp folder (no heads shipped yet)."""
    root = tmp_path / "shipped"
    root.mkdir()
    monkeypatch.setattr(engine.shipped_heads, "HEADS_DIR", root)
    return root


def cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    capsys.readouterr()  # drop what came before (a fixture's output)
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def cli_error(capsys, argv: list[str], command: str) -> str:
    code, _, err = cli(capsys, argv)
    lines = err.splitlines()
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err and lines[0].startswith(f"mtplxd {command}: "), err
    return lines[0]


def models_json(capsys, state: Path) -> list[dict]:
    code, out, _ = cli(capsys, ["models", "--json", "--state-dir", str(state)])
    assert code == 0
    return json.loads(out)


def mtimes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} | {".": folder.stat().st_mtime_ns}


def greedy_ar_and_mtp(folder: Path, max_tokens: int = 12) -> None:
    """The engine loads the folder; with heads, greedy MTP gives greedy AR's tokens."""
    engine_ = Engine.load(folder)
    ar, _, _ = run(engine_, PROMPT, mode="ar", sampler=greedy(), max_tokens=max_tokens)
    assert len(ar) == max_tokens
    if engine_.backend.heads:
        mtp, _, results = run(engine_, PROMPT, mode="mtp", depth=2, sampler=greedy(), max_tokens=max_tokens)
        assert sum(r.drafted for r in results) > 0
        assert_greedy_agree(engine_.backend, PROMPT, ar, mtp)


# -- pull FILE.gguf ------------------------------------------------------------------------


def test_pull_local_file(files, tmp_path, capsys, heads_dir):
    state = tmp_path / "S"
    argv = ["pull", str(files["tiny"]), "--state-dir", str(state)]
    code, out, err = cli(capsys, argv)
    assert code == 0, err
    model = state / "models" / "tiny"
    assert "mtplxd start --model tiny" in out and "no MTP head (AR only)" in out
    names = {p.name for p in model.iterdir()}
    assert {"config.json", "model.safetensors", RECORD_FILE, *TOKENIZER_FILES} <= names
    assert HEADS_FILE not in names
    record = read_record(model)
    assert record["source"] == str(files["tiny"].absolute())
    assert (record["family"], record["mtp_heads"], record["heads_digest"]) == ("llama", 0, None)
    assert sorted(p.name for p in (state / "models").iterdir()) == ["tiny"]  # nothing hidden left

    [row] = models_json(capsys, state)
    assert (row["name"], row["family"], row["heads"], row["source"]) == ("tiny", "llama", 0, record["source"])
    assert row["path"] == str(model) and row["size_bytes"] > 0

    before = mtimes(model)
    code, out, err = cli(capsys, argv)
    assert code == 0, err
    assert "already imported" in out and "importing" not in err
    assert mtimes(model) == before

    greedy_ar_and_mtp(model)


def test_pull_the_same_file_from_another_place(files, tmp_path, capsys, heads_dir):
    """A clone elsewhere on disk pulls the same file under another path: known by its content
    (make real-model in a second checkout); an import recorded before content hashes, from a
    file of the same name, is done again; another file under the name is refused."""
    state = tmp_path / "S"
    model = state / "models" / "tiny"
    assert cli(capsys, ["pull", str(files["tiny"]), "--state-dir", str(state)])[0] == 0
    copy = tmp_path / "elsewhere" / "tiny.gguf"
    copy.parent.mkdir()
    shutil.copyfile(files["tiny"], copy)
    before = mtimes(model)
    code, out, err = cli(capsys, ["pull", str(copy), "--state-dir", str(state)])
    assert code == 0 and "already imported" in out, err
    assert mtimes(model) == before

    record = read_record(model)
    del record["file_sha256"]
    record["source"] = "/another/checkout/tiny.gguf"
    (model / RECORD_FILE).write_text(json.dumps(record))
    code, out, err = cli(capsys, ["pull", str(copy), "--state-dir", str(state)])
    assert code == 0 and "imported before from /another/checkout/tiny.gguf" in err, err
    assert read_record(model)["source"] == str(copy.absolute()) and read_record(model)["file_sha256"]

    other = tmp_path / "other" / "tiny.gguf"
    other.parent.mkdir()
    write_gguf(other, tiny_model("llama", seed=5), TYPES["llama"])
    err = cli_error(capsys, ["pull", str(other), "--state-dir", str(state)], "pull")
    assert "already exists" in err
    assert read_record(model)["source"] == str(copy.absolute())


# -- shipped heads ---------------------------------------------------------------------------


def test_pull_attaches_shipped_heads_and_reimports_when_they_change(files, trunk, tmp_path, capsys, heads_dir):
    state = tmp_path / "S"
    model = state / "models" / "tiny"
    argv = ["pull", str(files["tiny"]), "--state-dir", str(state)]
    assert cli(capsys, argv)[0] == 0  # no heads shipped yet: AR only
    assert read_record(model)["heads_digest"] is None

    # Heads ship for the model: the next pull imports again and attaches them.
    shipped = make_heads(trunk, heads_dir / "tiny-llama", seed=1)
    code, out, err = cli(capsys, argv)
    assert code == 0, err
    assert "heads shipped for it changed" in err and f"{N_HEADS} shipped MTP head(s)" in out
    record = read_record(model)
    first = record["heads_digest"]
    assert first and (record["family"], record["mtp_heads"]) == ("mimo", N_HEADS)
    assert (model / HEADS_FILE).read_bytes() == (shipped / HEADS_FILE).read_bytes()
    config = json.loads((model / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == N_HEADS and config["mtplxd_shipped_heads"] == "tiny-llama"
    code, out, _ = cli(capsys, ["inspect", str(model), "--json"])
    report = json.loads(out)
    assert code == 0 and (report["status"], report["family"], report["mtp_heads"]) == ("supported", "mimo", N_HEADS)
    greedy_ar_and_mtp(model)

    # The same heads: nothing to do.
    before = mtimes(model)
    code, out, err = cli(capsys, argv)
    assert code == 0 and "already imported" in out, err
    assert mtimes(model) == before

    # Other heads: imported again, swapped in, nothing hidden left behind.
    make_heads(trunk, shipped, seed=2)
    code, out, err = cli(capsys, argv)
    assert code == 0, err
    record = read_record(model)
    assert record["heads_digest"] not in (None, first) and record["mtp_heads"] == N_HEADS
    assert (model / HEADS_FILE).read_bytes() == (shipped / HEADS_FILE).read_bytes()
    assert sorted(p.name for p in (state / "models").iterdir()) == ["tiny"]
    assert [row["name"] for row in models_json(capsys, state)] == ["tiny"]
    assert inspect_checkpoint(model).status == "supported"

    # convert --no-heads: the trunk alone, to train heads for (mtplxd train --heads-only)
    for flag, status in ((), "supported"), (("--no-heads",), "ar-only"):
        out = tmp_path / f"convert{len(flag)}"
        code, _, err = cli(capsys, ["convert", str(files["tiny"]), "--out", str(out), *flag])
        assert code == 0, err
        assert inspect_checkpoint(out).status == status and (out / HEADS_FILE).exists() == (not flag)


# -- pull OWNER/REPO --file NAME.gguf -------------------------------------------------------


def test_pull_one_file_of_a_hub_repository(files, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copyfile(files["tiny"], repo / "tiny.gguf")
    (repo / "README.md").write_text("a tiny GGUF\n")
    with FakeHub({"org/tiny-gguf": repo}) as hub:
        result = pull_subprocess(tmp_path, "org/tiny-gguf", "--file", "tiny.gguf", hub=hub)
        assert result.returncode == 0, result.stderr
        err = one_line_error(pull_subprocess(tmp_path, "org/tiny-gguf", "--file", "missing.gguf", hub=hub))
        assert "org/tiny-gguf" in err
        assert hub.gets("README.md") == []  # only the named file is fetched
    model = tmp_path / "state" / "models" / "tiny"
    record = read_record(model)
    assert (record["source"], record["family"], record["mtp_heads"]) == ("org/tiny-gguf:tiny.gguf", "llama", 0)
    assert {"config.json", "model.safetensors", *TOKENIZER_FILES} <= {p.name for p in model.iterdir()}
    assert sorted(p.name for p in model.parent.iterdir()) == ["tiny"]


# -- convert FILE.gguf --out DIR ---------------------------------------------------------------


def test_convert_gguf(files, tmp_path, capsys, heads_dir):
    out = tmp_path / "out"
    code, printed, err = cli(capsys, ["convert", str(files["tiny"]), "--out", str(out)])
    assert code == 0, err
    assert {"config.json", "model.safetensors", RECORD_FILE, *TOKENIZER_FILES} <= {p.name for p in out.iterdir()}
    assert read_record(out)["source"] == str(files["tiny"].absolute())
    assert inspect_checkpoint(out).status == "ar-only"

    err = cli_error(capsys, ["convert", str(files["tiny"]), "--out", str(out)], "convert")
    assert "already exists" in err
    err = cli_error(capsys, ["convert", str(files["truncated"]), "--out", str(tmp_path / "bad")], "convert")
    assert "truncated or corrupt" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "shipped"]


# -- inspect FILE.gguf -------------------------------------------------------------------------


def test_inspect_gguf(files, trunk, capsys, heads_dir):
    code, out, _ = cli(capsys, ["inspect", str(files["tiny"])])
    assert code == 3
    assert "status:       ar-only" in out and "architecture: llama" in out
    assert "Q/K rows: llama.cpp's rope permutation undone" in out
    code, out, _ = cli(capsys, ["inspect", str(files["tiny"]), "--json"])
    report = json.loads(out)
    assert code == 3
    assert (report["format"], report["status"], report["family"]) == ("gguf", "ar-only", "llama")
    assert report["mtp_heads"] == 0
    assert report["name"] == "tiny-llama" and report["import"]

    make_heads(trunk, heads_dir / "tiny-llama", seed=1)
    code, out, _ = cli(capsys, ["inspect", str(files["tiny"]), "--json"])
    report = json.loads(out)
    assert code == 0
    assert (report["status"], report["family"], report["mtp_heads"]) == ("supported", "mimo", N_HEADS)
    assert "tiny-llama" in report["reason"]
    code, out, _ = cli(capsys, ["inspect", str(files["tiny"])])
    assert code == 0 and "status:       supported" in out

    # Heads for another model do not match.
    info = heads_dir / "tiny-llama" / "heads.json"
    info.write_text(json.dumps({"match": {**MATCH, "llama.block_count": 3}, "heads": N_HEADS}))
    assert cli(capsys, ["inspect", str(files["tiny"]), "--json"])[0] == 3

    assert "truncated or corrupt" in cli_error(capsys, ["inspect", str(files["truncated"])], "inspect")
    assert "wrong magic number" in cli_error(capsys, ["inspect", str(files["magic"]), "--json"], "inspect")


# -- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad, words", [
    ("truncated", "truncated or corrupt"),
    ("magic", "wrong magic number"),
    ("arch", "'mamba' is not supported"),
    ("missing", "no such file"),
])
def test_pull_bad_file_one_line_and_nothing_left(files, tmp_path, capsys, heads_dir, bad, words):
    path = files.get(bad, tmp_path / "missing.gguf")
    state = tmp_path / "S"
    err = cli_error(capsys, ["pull", str(path), "--state-dir", str(state)], "pull")
    assert words in err, err
    models = state / "models"
    assert not models.exists() or list(models.iterdir()) == []


# -- the default model -----------------------------------------------------------------------------


def test_default_model_is_the_toy_until_the_real_one_is_there(trunk, tmp_path):
    state = tmp_path / "S"
    settings = Settings(state_dir=state)
    assert settings.model_path == embedded_model_dir()
    note = settings.default_model_note()
    assert note and DEFAULT_MODEL in note and "mtplxd pull" in note

    real = shutil.copytree(trunk, state / "models" / DEFAULT_MODEL)
    assert (real / "config.json").is_file()
    assert settings.model_path == real and settings.default_model_note() is None
    assert not settings.uses_embedded_model
    assert Settings(state_dir=state, model=embedded_model_dir()).default_model_note() is None  # named: no note


@pytest.mark.skipif(not (embedded_model_dir() / "config.json").is_file(), reason="no embedded model")
def test_health_warns_when_the_toy_serves_by_default(tmp_path):
    from mtplxd import client
    from tests.daemon_fixture import running_daemon

    state = tmp_path / "state"
    with running_daemon(state, None):
        health = client.health(state)
    assert Settings(state_dir=state).default_model_note() in health["warnings"], health


def test_make_real_model_offline_says_so_and_does_not_fail(tmp_path):
    """`make real-model` without a reachable package index: one clear message, exit 0 (the
    install goes on, the toy model stays the default), nothing imported."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    work = tmp_path / "checkout"
    shutil.copytree(root / "scripts", work / "scripts")
    bin_dir = Path(sys.executable).parent
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "MTPLXD_STATE_DIR": str(tmp_path / "state"),
           "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "", "PIP_CONFIG_FILE": "/dev/null"}
    done = subprocess.run(["sh", "scripts/real_model.sh", str(bin_dir)], cwd=work, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "could not download the real model" in done.stderr and "embedded toy model" in done.stderr
    assert not (work / "build" / "real-model" / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()
    assert not (tmp_path / "state" / "models").exists()
